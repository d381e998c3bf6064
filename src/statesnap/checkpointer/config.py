"""Every tunable of the Checkpointer in one dataclass, validated when it is built.

A wrong setting should fail at construction, on the line the user wrote, rather than as a
confusing error in a background thread an hour into training.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Callable

from ..engine.replicas import REPLICA_CHECK_MB
from ..errors import CheckpointError, refuse_non_switches
from ..format.checksum import DEFAULT_BLOCK_BYTES
from ..monitor.events import CommitRecord
from ..storage import path_text, place_of
from ..storage.base import StorageBackend

GB = 1e9
MIN_ARENA_BYTES = 64 << 10
# Share of the node's available RAM the staging arenas of all local ranks may take by default.
DEFAULT_RAM_SHARE = 0.4


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def local_ranks() -> int:
    """Ranks sharing this node's RAM (torchrun sets LOCAL_WORLD_SIZE)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def default_host_memory_gb() -> float:
    return DEFAULT_RAM_SHARE * available_ram_bytes() / local_ranks() / GB


@dataclass
class CheckpointerConfig:
    """Settings of :class:`statesnap.Checkpointer`; see docs/checkpointer.md.

    ``keep_last``: committed checkpoints kept on the persistent level. ``host_memory_gb``: the
    staging arena's size limit per rank (default: 40% of available RAM divided by the local ranks).
    ``persist_every``: steps that are multiples of it go to the persistent level; the others stay
    in host memory only. ``further_root``/``further_every``/``further_keep_last``: an optional
    slower level (shared storage) that receives a copy of every ``further_every``-th step.
    ``max_in_flight``: checkpoints staged or flushing at once; ``save`` waits beyond it.
    ``on_error``: what a background failure does at the next call, ``"raise"`` or ``"warn"``.
    ``eager_copy_mb``: tensors that no optimizer in the state writes (buffers such as BatchNorm
    statistics, EMA weights, extra tensors) are copied inside ``save`` when they total at most
    this much, because nothing would hold back a change to them; larger sets (frozen weights)
    are copied in the background and checked. ``copy_threads``/``threads``: staging copy and
    write workers. ``backend``: a custom :class:`StorageBackend` for the persistent level (tests
    inject slow or failing storage). ``take_over``: claim the roots even if another job holds
    them (see docs/checkpointer.md, "One job per root"); ``lease_s``: how long a claim on an
    object store lasts without renewal. ``replica_check_mb``: replicated pieces up to this size are
    compared whole across their holders before a commit, larger ones by a sample of each block
    (0: none; see docs/resharding.md).
    ``local_root``/``local_every``/``local_keep_last``: the node-local level (an NVMe path or
    ``shm://NAME``, per node) that receives every ``local_every``-th step; ``node_id`` says which
    node this rank is on (default: torchrun's ``GROUP_RANK``). ``peer_replicas=1`` also sends each
    rank's snapshot to a partner rank on another node, which keeps it in its node-local level
    (see docs/checkpointer.md, "Levels").
    """

    root: str
    keep_last: int = 3
    host_memory_gb: float | None = None
    persist_every: int = 1
    further_root: str | None = None
    further_every: int = 10
    further_keep_last: int = 2
    max_in_flight: int = 2
    on_error: str = "raise"
    eager_copy_mb: float = 64.0
    copy_threads: int = 1
    threads: int | None = None
    durable: bool = True
    allow_pickle: bool = False
    storage_options: dict | None = None
    backend: StorageBackend | None = None
    process_group: Any = None
    events: bool = True
    commit_timeout_s: float = 600.0
    block_bytes: int = DEFAULT_BLOCK_BYTES
    take_over: bool = False
    lease_s: float = 60.0
    replica_check_mb: float = REPLICA_CHECK_MB
    local_root: str | None = None
    local_every: int = 1
    local_keep_last: int = 2
    peer_replicas: int = 0
    node_id: int | None = None
    on_commit: Callable[[CommitRecord], None] | None = None

    def __post_init__(self):
        self.root = path_text(self.root)
        self.local_root = None if self.local_root is None else path_text(self.local_root)
        self.further_root = None if self.further_root is None else path_text(self.further_root)
        if self.node_id is None:
            self.node_id = int(os.environ.get("GROUP_RANK", "0"))
        if self.host_memory_gb is None:
            self.host_memory_gb = default_host_memory_gb()
        self._check_types()
        refuse_non_switches("invalid Checkpointer setting", durable=self.durable, allow_pickle=self.allow_pickle,
                            events=self.events, take_over=self.take_over)
        shared_root = self._shared_root()
        checks = [
            (self.keep_last >= 1, f"keep_last must be at least 1 (got {self.keep_last}): the newest "
                                  "committed checkpoint is never deleted"),
            (self.host_memory_gb * GB >= MIN_ARENA_BYTES,
             f"host_memory_gb={self.host_memory_gb} is below the minimum of {MIN_ARENA_BYTES} bytes"),
            (self.persist_every >= 1, f"persist_every must be at least 1 (got {self.persist_every})"),
            (self.further_root is None or (self.further_every >= 1 and self.persist_every >= 1 and
                                           self.further_every % self.persist_every == 0),
             f"further_every ({self.further_every}) must be a positive multiple of persist_every "
             f"({self.persist_every}): the further level copies persisted checkpoints"),
            (self.further_keep_last >= 1, f"further_keep_last must be at least 1 (got {self.further_keep_last})"),
            (self.max_in_flight >= 1, f"max_in_flight must be at least 1 (got {self.max_in_flight})"),
            (self.on_error in ("raise", "warn"), f"on_error must be 'raise' or 'warn', not {self.on_error!r}"),
            (self.eager_copy_mb >= 0, f"eager_copy_mb must not be negative (got {self.eager_copy_mb})"),
            (self.copy_threads >= 1, f"copy_threads must be at least 1 (got {self.copy_threads})"),
            (self.threads is None or self.threads >= 1, f"threads must be at least 1 (got {self.threads})"),
            (0 < self.commit_timeout_s <= 1e9, "commit_timeout_s must be positive (at most 1e9 seconds)"),
            (self.lease_s >= 3, f"lease_s must be at least 3 seconds (got {self.lease_s})"),
            (self.replica_check_mb >= 0, f"replica_check_mb must not be negative (got {self.replica_check_mb})"),
            (self.local_every >= 1, f"local_every must be at least 1 (got {self.local_every})"),
            (self.local_keep_last >= 1, f"local_keep_last must be at least 1 (got {self.local_keep_last})"),
            (self.on_commit is None or callable(self.on_commit),
             f"on_commit must be a callable taking a CommitRecord (got {type(self.on_commit).__name__})"),
            (self.peer_replicas in (0, 1), f"peer_replicas must be 0 or 1 (got {self.peer_replicas})"),
            (self.node_id >= 0, f"node_id must not be negative (got {self.node_id})"),
            (self.peer_replicas == 0 or self.local_root is not None,
             "peer_replicas needs local_root: the partner writes the replica into its node-local level"),
            (shared_root is None,
             f"root, local_root and further_root must be different directories, each level claiming and "
             f"retaining its own: {shared_root}"),
            (self.block_bytes >= 4096 and self.block_bytes % 4096 == 0,
             f"block_bytes must be a positive multiple of 4096 (got {self.block_bytes}): checksum blocks are "
             "written whole, and pieces start on 64-byte boundaries"),
        ]
        for ok, message in checks:
            if not ok:
                raise CheckpointError(f"invalid Checkpointer setting: {message}")

    def _shared_root(self) -> str | None:
        """Which two levels were given one directory, or None. (Given one, the second level's
        claim found the first's and advised ``take_over=True``, which made every save fail.)"""
        seen: dict[str, str] = {}
        for name in ("root", "local_root", "further_root"):
            where = getattr(self, name)
            if where is None:
                continue
            where = place_of(where)
            if where in seen:
                return f"{seen[where]} and {name} are both {getattr(self, name)}"
            seen[where] = name
        return None

    @classmethod
    def of(cls, root, settings: dict) -> "CheckpointerConfig":
        """The config of ``Checkpointer(root, **settings)`` (see :meth:`check_names`)."""
        cls.check_names(settings)
        return cls(root=root, **settings)

    @classmethod
    def check_names(cls, settings: dict) -> None:
        """A misspelled setting is a CheckpointError naming the closest ones (a bare TypeError
        says nothing of what exists); the integrations check theirs before training starts."""
        known = [f.name for f in dataclasses.fields(cls) if f.name != "root"]
        unknown = sorted(set(settings) - set(known))
        if unknown:
            hints = [f"{name!r} (did you mean {', '.join(map(repr, close))}?)" if close else repr(name)
                     for name in unknown for close in [difflib.get_close_matches(name, known, 2)]]
            raise CheckpointError(f"invalid Checkpointer setting: no setting {', '.join(hints)}; the settings are "
                                  "the fields of CheckpointerConfig (docs/checkpointer.md)")

    def _check_types(self) -> None:
        """Numbers where numbers belong, before the ranges are compared (``keep_last=None``
        would otherwise be a bare TypeError, and ``keep_last=2.5`` pass)."""
        whole = ("keep_last", "persist_every", "further_every", "further_keep_last", "max_in_flight", "copy_threads",
                 "block_bytes", "local_every", "local_keep_last", "peer_replicas", "node_id")
        real = ("host_memory_gb", "eager_copy_mb", "commit_timeout_s", "lease_s", "replica_check_mb")
        for name in (*whole, *real, "threads"):
            value = getattr(self, name)
            kinds = numbers.Integral if name in whole or name == "threads" else numbers.Real
            if (value is None and name == "threads") or (isinstance(value, kinds) and not isinstance(value, bool)
                                                         and (kinds is numbers.Integral or _finite(value))):
                continue
            wanted = "an integer" if name in whole or name == "threads" else "a finite number"
            raise CheckpointError(f"invalid Checkpointer setting: {name} must be {wanted} (got {value!r})")

    @property
    def host_memory_bytes(self) -> int:
        return int(self.host_memory_gb * GB)

    @property
    def eager_copy_bytes(self) -> int:
        """Eager copies per snapshot; they come out of the host budget, at most a quarter of it
        over all snapshots in flight."""
        return min(int(self.eager_copy_mb * (1 << 20)), self.host_memory_bytes // (4 * self.max_in_flight))


def _finite(value: numbers.Real) -> bool:
    """Whether ``value`` is a finite float (an integer past float's range is not: the settings
    that take any number are used as floats)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
