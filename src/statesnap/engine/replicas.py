"""Replicas are decided from descriptions; this module checks that their values agree.

The save plan stores a piece once when several ranks describe it identically (name, dtype,
shape, box). That is right for DDP parameters, and silently wrong for a per-rank value that
looks alike everywhere (each rank's ``torch.get_rng_state()``, a data-loader position kept as a
tensor) or for replicas that drifted apart: one rank's copy would be kept and the others lost.

So before anything commits, the values of small replicated pieces are compared. Every piece is
written by exactly one of its holders, so the pieces a rank holds but does not write are exactly
its replicas of pieces another rank writes. Each rank hashes those (block checksums, as the
writer computes anyway for the manifest) and sends the hashes to the tensor's owner
(plan/owners.py) with the writers' reports that the commit sends it anyway; the owner compares
them with the writer's checksums, and rank 0 refuses to commit if any owner found a difference.
The cost is one pass over the small replicas and a few integers per piece in a message that is
sent anyway.

Shared plain values (numbers, strings, lists, small tensors inside them) are stored from one rank
(the lowest holding each), so they are compared too: every holder sends a hash of its JSON form. Pickled values
are not compared (equal values may pickle to different bytes, e.g. sets in another hash order).

Pieces up to a size limit are compared whole. Hashing every large replica whole (a whole DDP
model on every rank) would cost a pass over memory per checkpoint, so a larger one is compared
by a sample: the first 4 KiB of each checksum block (``block_heads``), which its writer hashes
beside the block's checksum and each holder of its copy. Per-rank values differ all through and
are caught so; replicas that drifted apart in a few elements may not be. (Before the sample, a
per-rank tensor of more than the limit, not wrapped in ``ss.PerRank``, was stored from one rank
and the others' values lost without a word.) Pieces the state declares replicated
(``ss.Replicated``, DTensor ``Replicate``, the buffers of a DDP module that broadcasts them) are
not compared: their holders may differ on purpose.
"""
from __future__ import annotations

import json
from typing import Callable, Iterable, Mapping, Sequence

import torch

from ..format.checksum import HEAD_BYTES, block_heads, checksum_blocks, checksum_whole
from ..format.manifest import ObjectEntry
from ..state.items import Flattened, ItemMeta
from .buffers import byte_view, host_contiguous, memory_in_order

REPLICA_CHECK_MB = 1.0  # default size limit of a piece compared whole, in MiB

# (fqn, writer rank, writer's item index, block checksums of this rank's copy, or its
# ``block_heads`` where ``sampled``, sampled)
ReplicaHash = tuple[str, int, int, list[int], bool]


def limit_bytes(check_mb: float) -> int:
    return int(check_mb * (1 << 20))


def replicas_to_check(elsewhere: Mapping[int, tuple[int, int]], metas: Sequence[ItemMeta],
                      declared: Sequence[bool], limit: int) -> list[tuple[int, str, int, int, bool]]:
    """(item index, fqn, writer rank, writer's item index, sampled) for each piece this rank
    holds but another rank writes (``elsewhere``: item index -> (writer, writer's item index),
    from the save plan) and that is not declared replicated; sampled: larger than ``limit``
    bytes (``limit <= 0``: none is compared)."""
    if limit <= 0:
        return []
    return [(index, metas[index].fqn, *writer, metas[index].nbytes > limit)
            for index, writer in sorted(elsewhere.items()) if not declared[index]]


def sampled_items(metas: Sequence[ItemMeta], declared: Sequence[bool], limit: int) -> set[int]:
    """The items whose writer hashes ``block_heads`` too: those a holder of a copy samples."""
    if limit <= 0:
        return set()
    return {index for index, meta in enumerate(metas) if meta.nbytes > limit and not declared[index]}


def hash_tensors(targets: list[tuple[int, str, int, int, bool]], tensors, block_bytes: int) -> list[ReplicaHash]:
    """This rank's hashes of ``targets`` (from :func:`replicas_to_check`); ``tensors[index]`` is
    the item's value (a blocking save) or its staged bytes (the Checkpointer)."""
    return [(fqn, writer, item, heads_of(tensors[index], block_bytes) if sampled else
             checksum_blocks([byte_view(host_contiguous(tensors[index]))], block_bytes), sampled)
            for index, fqn, writer, item, sampled in targets]


def heads_of(tensor: torch.Tensor, block_bytes: int) -> list[int]:
    """``block_heads`` of a tensor's bytes in row-major order. Of one on a device or laid out
    otherwise, only the sampled elements are gathered (``torch.take`` reads any layout as
    row-major), not a copy of it all: sampling is to cost no pass over the replica's memory."""
    tensor = tensor.detach()
    if tensor.is_cpu and memory_in_order(tensor):
        return block_heads(byte_view(tensor), block_bytes)
    size = tensor.element_size()  # (divides HEAD_BYTES and a block, both multiples of 4096)
    nbytes = tensor.numel() * size
    index = torch.cat([torch.arange(pos // size, min(pos + HEAD_BYTES, nbytes) // size)
                       for pos in range(0, max(nbytes, 1), block_bytes)])
    # the samples back to back: each HEAD_BYTES long but the last, so they are the heads of that size
    return block_heads(byte_view(host_contiguous(torch.take(tensor, index.to(tensor.device)))), HEAD_BYTES)


def object_digests(flat: Flattened, entries: dict[str, ObjectEntry]) -> dict[str, int]:
    """A hash of the JSON form of each shared value that is not declared replicated."""
    return {item.fqn: checksum_whole(memoryview(json.dumps(entries[item.fqn].value, sort_keys=True).encode()))
            for item in flat.objects
            if item.per_rank is None and not item.replicated and entries[item.fqn].kind == "json"}


def mismatches(outputs: Sequence, pieces: dict[str, list[str]]) -> str | None:
    """On rank 0, given every rank's ``RankOutput`` and the differing tensor pieces the owners
    found (:func:`differing_pieces`): a description of the replicated pieces and shared values
    whose holders hold different values, or None when all agree."""
    by_tensor = {**pieces, **_differing_objects(outputs)}
    if not by_tensor:
        return None
    described = [f"{fqn} ({'; '.join(sorted(parts))})" for fqn, parts in sorted(by_tensor.items())]
    shown = "; ".join(described[:10]) + (f"; and {len(described) - 10} more" if len(described) > 10 else "")
    return (f"{len(described)} replicated value(s) differ between the ranks holding them: {shown}. "
            "A tensor that several ranks hold with the same name, dtype and shape, and a plain value, are "
            "stored once, from one rank, so the other values would be lost. Wrap per-rank state (an RNG "
            "state, a data-loader position) in ss.PerRank(...) to save every rank's value; wrap a value "
            "whose copies may differ on purpose (one rank's copy is enough) in ss.Replicated(...). "
            "Parameters that should be replicas (DDP) but differ point to a bug in the training loop.")


def differing_pieces(checksums_of: Callable[[int, int, bool], list[int] | None],
                     hashes: Iterable[tuple[int, ReplicaHash]]) -> dict[str, list[str]]:
    """fqn -> for each differing piece, which ranks agree with which (``rank 0 vs rank 1``).
    ``hashes``: (holder rank, its hash of a piece another rank writes); ``checksums_of(writer,
    item, sampled)``: the writer's checksums of that piece, or its ``block_heads`` (None where it
    took none). Run by each tensor's owner, which receives both for its tensors only, so no rank
    sees every rank's checksums."""
    groups: dict[tuple[int, int], dict[tuple, list[int]]] = {}
    names: dict[tuple[int, int], str] = {}
    for rank, (fqn, writer, item, sums, sampled) in hashes:
        key = (writer, item)
        if key not in groups:
            written = checksums_of(writer, item, sampled)
            if written is None:
                continue
            groups[key], names[key] = {tuple(written): [writer]}, fqn
        groups[key].setdefault(tuple(sums), []).append(rank)
    by_tensor: dict[str, list[str]] = {}  # a sharded tensor may have several differing pieces
    for key, found in groups.items():
        if len(found) > 1:
            by_tensor.setdefault(names[key], []).append(_versus(found.values()))
    return by_tensor


def _differing_objects(outputs: Sequence) -> dict[str, list[str]]:
    """fqn -> which ranks agree with which, for shared values some holder holds differently
    (ranks that do not hold a value, such as other pipeline stages, are not compared)."""
    holders: dict[str, dict[int, list[int]]] = {}  # fqn -> digest -> ranks holding that value
    for rank, output in enumerate(outputs):
        for fqn, digest in output.object_digests.items():
            holders.setdefault(fqn, {}).setdefault(digest, []).append(rank)
    return {fqn: [_versus(groups.values())] for fqn, groups in sorted(holders.items()) if len(groups) > 1}


def _versus(groups) -> str:
    return " vs ".join(_ranks(r) for r in sorted(map(sorted, groups)))


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``: short even for a thousand ranks."""
    spans, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur is None or cur != prev + 1:
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)
