"""The few collectives a save or load needs, with a deadline, and a single-process stand-in.

Every cross-rank step goes through :class:`Comm`, so errors travel too: a rank that failed
contributes its error instead of its result, and :meth:`Comm.agree` makes every rank raise the
same ``CheckpointError`` instead of some ranks hanging in the next collective.

A rank can also vanish (killed, its node lost) or stop answering (hung). gloo reports the first
as a raw ``RuntimeError`` and waits for the second as long as the group's timeout (30 minutes by
default). So objects travel as byte tensors over a gloo group with ``async_op`` work whose
``wait`` has this Comm's own deadline, and any failure of the transport, making the group
included (a rank already gone when it is made), becomes a :class:`PeerLostError` that says what
was being done and which rank is gone, where this host can tell (ranks on this host whose
process has exited).
"""
from __future__ import annotations

import atexit
import os
import pickle
import socket
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import CheckpointError, described, explained

DEFAULT_TIMEOUT_S = 1800.0  # torch.distributed's own default for gloo groups
# Bytes of an object that a broadcast sends in its first round: a slot this small costs nothing
# to send, and spares most broadcasts their second round (each round, 4 ranks on this project's
# 2-core machine: about 1 to 5 ms, as every step of it waits for a process to be scheduled).
BROADCAST_SLOT = 16 << 10

# Keyed by id(group); the values hold the group too, so an id cannot be reused while it is a key.
_SIDE_GROUPS: dict = {}  # (id(group), timeout) -> (group, its side group), made once
_IDENTITIES: dict = {}  # id(side group) -> (it, [(host, pid)] of its ranks), learned on first use


class RemoteFailure(CheckpointError):
    pass


class PeerLostError(CheckpointError):
    """A collective failed in the transport: a rank vanished or did not answer in time."""


def side_group(group, timeout_s: float, what: str = "checkpointing"):
    """A gloo group over the ranks of ``group`` whose operations give up after ``timeout_s``,
    made once per (group, timeout) by every member of ``group`` (making it is collective).
    gloo ends an operation only at its group's timeout: the operation's ``wait(timeout)`` alone
    would leave it pending, and the process would then hang at exit until the peer answers.
    Making it waits up to ``timeout_s`` for every member: a rank that is gone by then (or never
    comes) is a :class:`PeerLostError` naming ``what``, not torch's raw store error."""
    key = (id(group), timeout_s)
    known = _SIDE_GROUPS.get(key)
    if known is None or known[0] is not group:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        side = timed_group(ranks, timeout_s, what, dist.get_rank(group), use_local_synchronization=ranks is not None)
        known = _SIDE_GROUPS[key] = (group, side)
    return known[1]


def timed_group(ranks, timeout_s: float, what: str, rank: int | None = None, **kwargs):
    """``dist.new_group(ranks, backend="gloo", timeout=timeout_s)``, collective over ``ranks``
    (None: all). gloo connects to every member while the group is made and waits for each up to
    ``timeout_s``; a member that is gone raises torch's ``DistStoreError`` (or a connection
    error), which becomes a :class:`PeerLostError` that says which operation was being set up."""
    try:
        return dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=timeout_s), **kwargs)
    except RuntimeError as exc:  # DistStoreError, DistNetworkError: both RuntimeErrors
        rank = dist.get_rank() if rank is None else rank
        if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
            why = f"another rank did not join within {timeout_s:g} s"
        else:
            why = "another rank vanished while they were connecting"
        raise PeerLostError(f"{what} failed on rank {rank}: setting up its collectives: {why} "
                            f"({type(exc).__name__}: {exc})") from exc


def _drop_side_group(side) -> None:
    """Destroy a side group whose peer is lost, now, while the interpreter is whole: left to the
    end of the process, gloo's teardown of a group with a broken pair sometimes aborts it
    ("terminate called without an active exception"). The next Comm makes a new one."""
    for key, (_, known) in list(_SIDE_GROUPS.items()):
        if known is side:
            del _SIDE_GROUPS[key]
    destroy_group(side)


def destroy_group(group) -> None:
    """Destroy a group statesnap made, the side groups made over it, and what it learned of them:
    the identities of a group's ranks held it, and with it its sockets and threads, after it was
    destroyed (a Checkpointer made and closed 200 times on 2 ranks ran out of file descriptors)."""
    if group is None:  # (the default group is the job's, never statesnap's)
        return
    for key, (over, side) in list(_SIDE_GROUPS.items()):
        if over is group:
            del _SIDE_GROUPS[key]
            destroy_group(side)
    _IDENTITIES.pop(id(group), None)
    if not dist.is_initialized():  # (destroyed with all the others: dist.destroy_process_group())
        return
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 (already torn down)
        pass


@atexit.register
def _drop_side_groups() -> None:
    """Side groups are statesnap's own: tear them down before the interpreter is (see above)."""
    if dist.is_available() and dist.is_initialized():
        for _, side in list(_SIDE_GROUPS.values()):
            _drop_side_group(side)


def _process_gone(pid: int) -> bool:
    """Has process ``pid`` on this host exited? (A zombie not yet reaped by its parent has.)"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


class Comm:
    """Collectives among the ranks of ``group`` (None: the default group) for one save, load or
    commit. ``what`` names the operation in errors; ``timeout_s`` bounds every collective. They
    run on a side group (:func:`side_group`) unless ``dedicated`` says ``group`` is already a gloo
    group made for this, with that timeout."""

    def __init__(self, group=None, what: str = "checkpointing", timeout_s: float = DEFAULT_TIMEOUT_S,
                 dedicated: bool = False):
        self.active = dist.is_available() and dist.is_initialized()
        self.group = group
        self.what = what
        self.timeout = timedelta(seconds=timeout_s)
        self.rank = dist.get_rank(group) if self.active else 0
        self.world_size = dist.get_world_size(group) if self.active else 1
        self._gloo = group if dedicated else None
        self._dedicated = dedicated
        self._timeout_s = timeout_s
        self._released = False

    # ----------------------------------------------------------------- object collectives

    def all_gather(self, obj: Any) -> list:
        if not self._multi():
            return [obj]
        payload = self._encode(obj)
        # One gather of a small slot each, with the size in front, serves what fits (flags,
        # steps, short lists); only when a rank's object is larger does a second gather follow,
        # of the whole objects. The slot shrinks as the job grows, to keep the first gather small.
        slot = max(64, min(1024, (1 << 20) // self.world_size))
        first = torch.zeros(8 + slot, dtype=torch.uint8)
        first[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
        first[8:8 + min(len(payload), slot)] = payload[:slot]
        gathered = self._all_gather_tensor(first)
        sizes = [int(t[:8].view(torch.int64)) for t in gathered]
        if max(sizes) > slot:
            whole = self._all_gather_tensor(self._pad(payload, max(sizes)))
            return [self._decode(t, n) for t, n in zip(whole, sizes)]
        return [self._decode(t[8:], n) for t, n in zip(gathered, sizes)]

    def gather(self, obj: Any) -> list | None:
        """Objects of all ranks on rank 0, None elsewhere."""
        if not self._multi():
            return [obj]
        payload = self._encode(obj)
        sizes = self._all_gather_tensor(torch.tensor([len(payload)], dtype=torch.int64))
        padded = self._pad(payload, int(max(sizes)))
        inbox = [torch.empty_like(padded) for _ in range(self.world_size)] if self.rank == 0 else None
        self.wait(dist.gather(padded, inbox, dst=self._global(0), group=self.transport(), async_op=True))
        return [self._decode(t, int(n)) for t, n in zip(inbox, sizes)] if self.rank == 0 else None

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (the others' ``obj`` is ignored). What fits a
        slot of ``BROADCAST_SLOT`` bytes (tokens, paths, outcomes, a small manifest) goes in one
        round with its size in front; only the rest of a larger object follows in a second."""
        if not self._multi():
            return obj
        payload = self._encode(obj) if self.rank == src else None
        first = torch.zeros(8 + BROADCAST_SLOT, dtype=torch.uint8)
        if payload is not None:
            first[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
            first[8:8 + min(len(payload), BROADCAST_SLOT)] = payload[:BROADCAST_SLOT]
        self.wait(dist.broadcast(first, src=self._global(src), group=self.transport(), async_op=True))
        size = int(first[:8].view(torch.int64))
        if size <= BROADCAST_SLOT:
            return self._decode(first[8:], size)
        rest = payload[BROADCAST_SLOT:] if payload is not None else torch.empty(size - BROADCAST_SLOT,
                                                                                  dtype=torch.uint8)
        self.wait(dist.broadcast(rest, src=self._global(src), group=self.transport(), async_op=True))
        return self._decode(torch.cat([first[8:], rest]), size)

    def any_of(self, flags: list[bool]) -> list[bool]:
        """Element-wise: whether any rank's flag is set. Every rank passes as many flags, in the
        same order; what each receives is one flag per element, whatever the number of ranks."""
        if not self._multi():
            return list(flags)
        # packed 8 to a byte and OR-ed: the exchange's rounds grow with its elements, and a
        # one-element reduction is the shortest (4 ranks here: 0.7 ms against 3.9 ms for five)
        packed = torch.from_numpy(np.packbits(np.asarray(flags, dtype=bool)))
        self.wait(dist.all_reduce(packed, op=dist.ReduceOp.BOR, group=self.transport(), async_op=True))
        return np.unpackbits(packed.numpy(), count=len(flags)).astype(bool).tolist()

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank if any rank failed ``what``; return normally if all succeeded.

        One flag first, and the messages only if a rank failed: a one-element reduction is one
        short exchange, where gathering objects is two gathers of several (measured on this
        project's 2-core machine, 4 ranks: 0.7 ms against 7 ms), and a load agrees four times."""
        if self._multi() and not self.any_of([error is not None])[0]:
            return
        self.raise_any(error, self.all_gather(described(error)), what)

    def raise_any(self, error: BaseException | None, errors: list[str | None], what: str) -> None:
        """Raise ``error`` if this rank failed ``what``, or a :class:`RemoteFailure` naming the
        ranks that did (``errors``: every rank's ``described(error)``, gathered by the caller,
        perhaps in an exchange it makes anyway); return if none failed."""
        if error is not None:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"{what} failed on rank {self.rank}: {explained(error)}") from error
        failed = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None)
        if failed:
            raise RemoteFailure(f"{what} failed on another rank: {failed}")

    def release(self) -> None:
        """Let go of the group, destroyed by whoever made it: a Comm kept past that (by a closed
        Checkpointer's stages) held its sockets and threads. Its collectives then fail."""
        self.group = self._gloo = None
        self._released = True

    # ----------------------------------------------------------------- transport

    def _multi(self) -> bool:
        if not self.active or self.world_size == 1:
            return False
        if self._released:
            raise CheckpointError(f"{self.what} failed on rank {self.rank}: its group was let go (its Checkpointer "
                                  "was closed)")
        if not dist.is_initialized():  # (a program's last line, dist.destroy_process_group(), came first)
            raise CheckpointError(f"{self.what} failed on rank {self.rank}: the process groups were destroyed "
                                  "(dist.destroy_process_group()) before it finished; close() the Checkpointer "
                                  "before destroying them")
        return True

    def transport(self):
        """The gloo group these collectives run on (point-to-point calls may use it too)."""
        if self._gloo is None:
            self._multi()  # (a released Comm, or destroyed groups: said so, no side group made)
            self._gloo = side_group(self.group, self._timeout_s, self.what)
        known = _IDENTITIES.get(id(self._gloo))
        if known is None or known[0] is not self._gloo:  # who is who, to name a rank that vanishes
            _IDENTITIES[id(self._gloo)] = (self._gloo, None)  # before the exchange, which calls back here
            _IDENTITIES[id(self._gloo)] = (self._gloo, self.all_gather((socket.gethostname(), os.getpid())))
        return self._gloo

    def _all_gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.wait(dist.all_gather(out, tensor, group=self.transport(), async_op=True))
        return out

    def wait(self, work) -> None:
        """Wait for ``work`` (an ``async_op`` request on this Comm's group) within the deadline."""
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:  # gloo: "Connection closed by peer", "Operation timed out!"
            error = PeerLostError(f"{self.what} failed on rank {self.rank}: {self._who_is_gone(exc)} ({exc})")
            if not self._dedicated:
                _drop_side_group(self._gloo)
            raise error from exc

    def _who_is_gone(self, exc: RuntimeError) -> str:
        known = _IDENTITIES.get(id(self._gloo))
        identities = known[1] if known is not None and known[0] is self._gloo else None
        here = socket.gethostname()
        if identities:
            local = [r for r, (host, _) in enumerate(identities) if r != self.rank and host == here]
            for _ in range(100):  # a killed process closes its sockets a moment before it is gone
                gone = [r for r in local if _process_gone(identities[r][1])]
                if gone or not local:
                    break
                time.sleep(0.05)
            if gone:
                names = ", ".join(f"rank {r} (pid {identities[r][1]})" for r in gone)
                return f"{names} on this host exited"
            hosts = sorted({host for host, _ in identities if host != here})
            if hosts:
                return f"a rank on another host ({', '.join(hosts)}) vanished or did not answer"
        if "timed out" in str(exc).lower():
            return f"another rank did not answer within {self.timeout.total_seconds():g} s"
        return "another rank vanished"

    @staticmethod
    def _encode(obj: Any) -> torch.Tensor:
        return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)

    @staticmethod
    def _pad(payload: torch.Tensor, size: int) -> torch.Tensor:
        out = torch.zeros(max(size, 1), dtype=torch.uint8)
        out[:len(payload)] = payload
        return out

    @staticmethod
    def _decode(tensor: torch.Tensor, size: int) -> Any:
        # Peers of one job are trusted as torch.distributed's own object collectives trust them;
        # nothing read from a checkpoint ever comes through here.
        return pickle.loads(tensor[:size].numpy().tobytes())

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)
