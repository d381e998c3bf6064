"""All-to-all of Python objects: each rank sends one object to each rank and receives one from each.

The scalable save plan (plan/owners.py) moves each item description only to the rank that plans
its tensor, and each answer only back to its holder, so a rank receives O(its own items) rather
than every rank's items (an all-gather). gloo implements ``all_to_all_single`` with uneven splits;
the objects are pickled as ``Comm``'s own collectives do (peers of one job trust each other;
nothing read from a checkpoint comes through here).
"""
from __future__ import annotations

import pickle
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .dist import Comm


def all_to_all(comm: Comm, outgoing: Sequence[Any]) -> list[Any]:
    """``outgoing[r]`` goes to rank ``r``; returns what each rank sent this one, by rank."""
    if comm.world_size == 1 or not comm.active:
        return [outgoing[0]]
    payloads = [pickle.dumps(obj) for obj in outgoing]
    send_sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64)
    recv_sizes = torch.empty_like(send_sizes)
    group = comm.transport()
    comm.wait(dist.all_to_all_single(recv_sizes, send_sizes, group=group, async_op=True))
    send = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)  # pickles are never empty
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    comm.wait(dist.all_to_all_single(recv, send, recv_sizes.tolist(), send_sizes.tolist(), group=group,
                                     async_op=True))
    raw, out, at = recv.numpy().tobytes(), [], 0
    for size in recv_sizes.tolist():
        out.append(pickle.loads(raw[at:at + size]))
        at += size
    return out
