"""Shared reads: bytes that several ranks need are read from storage once and sent to the others.

Replicated targets (DDP, TP ``Replicate``, HSDP replicas, norms under TP) make every replica
read the same bytes. With shared reads each distinct target part is read by one of the ranks
that need it (the least loaded, largest parts first, as saves balance writes) and sent to the
other holders over a gloo process group: one coalesced message per (sender, receiver) pair,
point to point, so ranks that do not need a part never see it.

Whether that is faster depends on storage against the interconnect. On a local file system
whose pages are cached, a read is a memcpy and any send is slower; when storage is remote
(fsspec, object stores) or the checkpoint is cold on a shared file system, one read plus sends
beats N reads. ``shared_reads=None`` (auto) therefore shares only for non-local backends; see
``docs/resharding.md`` for the measured crossover on this machine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..state.items import Flattened
from ..format.dtypes import flat_bytes
from .buffers import host_contiguous
from .dist import Comm


def should_share(requested: bool | None, comm: Comm, backend_is_local: bool) -> bool:
    """The decision every rank takes identically (it decides whether collectives follow)."""
    if comm.world_size == 1 or not comm.active:
        return False
    return (not backend_is_local) if requested is None else bool(requested)


@dataclass
class SharedReads:
    """This rank's part of the exchange: items it receives instead of reading, and what it sends."""

    received: set[int] = field(default_factory=set)  # indices into flat.tensors
    sends: dict[int, list[int]] = field(default_factory=dict)  # peer rank -> item indices, in order
    recvs: dict[int, list[int]] = field(default_factory=dict)  # peer rank -> item indices, in order
    group: object = None
    comm: Comm | None = None
    bytes_received: int = 0

    def run(self, flat: Flattened) -> None:
        """Send what this rank read to the ranks that share it; receive what others read."""
        if not self.sends and not self.recvs:
            return
        requests, inbox = [], {}
        for peer, indices in self.sends.items():
            packed = torch.cat([flat_bytes(host_contiguous(flat.tensors[i].local)) for i in indices])
            requests.append(dist.isend(packed, dst=peer, group=self.group))
        for peer, indices in self.recvs.items():
            inbox[peer] = torch.empty(sum(flat.tensors[i].nbytes for i in indices), dtype=torch.uint8)
            requests.append(dist.irecv(inbox[peer], src=peer, group=self.group))
        for request in requests:
            self.comm.wait(request)
        with torch.no_grad():
            for peer, indices in self.recvs.items():
                pos = 0
                for i in indices:
                    local = flat.tensors[i].local
                    n = flat.tensors[i].nbytes
                    piece = inbox[peer][pos:pos + n]
                    if pos % local.element_size():  # packed after an odd size: a dtype view needs alignment
                        piece = piece.clone()
                    local.copy_(piece.view(local.dtype).reshape(local.shape))
                    pos += n
                self.bytes_received += pos


def plan_shared_reads(comm: Comm, flat: Flattened, skip: set[str], enabled: bool) -> SharedReads:
    """Agree (one all-gather) on who reads each target part that several ranks hold.

    A collective when ``enabled``: every rank must call it with the same ``enabled``."""
    if not enabled:
        return SharedReads()
    mine = [(i, (item.fqn, item.layout, tuple(item.start), tuple(item.size), str(item.dtype)), item.nbytes)
            for i, item in enumerate(flat.tensors) if item.fqn not in skip]
    holders: dict[tuple, list[tuple[int, int]]] = {}
    sizes: dict[tuple, int] = {}
    for rank, items in enumerate(comm.all_gather(mine)):
        for index, key, nbytes in items:
            holders.setdefault(key, []).append((rank, index))
            sizes[key] = nbytes
    load = [0] * comm.world_size
    for key, hs in holders.items():
        if len(hs) == 1:
            load[hs[0][0]] += sizes[key]
    out = SharedReads(group=comm.transport(), comm=comm)
    for key in sorted((k for k, hs in holders.items() if len(hs) > 1), key=lambda k: (-sizes[k], k)):
        hs = holders[key]
        owner, owner_index = min(hs, key=lambda h: (load[h[0]], h[0]))
        load[owner] += sizes[key]
        for rank, index in hs:
            if rank == owner:
                continue
            if owner == comm.rank:
                out.sends.setdefault(_peer(comm, rank), []).append(owner_index)
            elif rank == comm.rank:
                out.recvs.setdefault(_peer(comm, owner), []).append(index)
                out.received.add(index)
    return out


def _peer(comm: Comm, group_rank: int) -> int:
    """Point-to-point calls take global ranks."""
    return group_rank if comm.group is None else dist.get_global_rank(comm.group, group_rank)

