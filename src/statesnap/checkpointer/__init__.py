"""The lazy asynchronous multi-level Checkpointer (see docs/checkpointer.md)."""
from .config import CheckpointerConfig
from .manager import Checkpointer, SaveHandle
from ..monitor.events import CommitRecord

__all__ = ["Checkpointer", "CheckpointerConfig", "SaveHandle", "CommitRecord"]
