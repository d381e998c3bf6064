"""The engine: blocking save/load pipelines (and, in checkpointer.py, the asynchronous one)."""
from .load import LoadInfo, load
from .save import SaveInfo, save

__all__ = ["save", "load", "SaveInfo", "LoadInfo"]
