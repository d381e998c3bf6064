"""The lazy asynchronous multi-level Checkpointer (see docs/checkpointer.md)."""
from .config import CheckpointerConfig
from .handle import SaveHandle
from .manager import Checkpointer
from ..monitor.events import CommitRecord

__all__ = ["Checkpointer", "CheckpointerConfig", "SaveHandle", "CommitRecord"]
