"""``ss.open(path)``: inspect, read and verify a checkpoint without a training state."""
from __future__ import annotations

import operator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .engine.load import blob_reader, read_manifest
from .engine.objects import decode_value
from .engine.read import ReadExecutor
from .engine.write import default_threads
from .errors import (
    CheckpointError, CorruptCheckpointError, ManifestError, MissingFileError, NotInCheckpointError, RegionOutOfRangeError,
    refuse_bad_settings, refuse_non_switches,
)
from .format.checksum import checksum_blocks
from .format.manifest import BOX, MANIFEST_NAME, Manifest, SplitTensors, TensorEntry
from .plan.load_plan import plan_target
from .plan.save_plan import ALIGN
from .progress import bar
from .storage import backend_for, normalize

VERIFY_CHUNK_BLOCKS = 4


@dataclass
class TensorInfo:
    fqn: str
    dtype: torch.dtype
    shape: tuple
    nbytes: int
    pieces: int
    layout: str
    files: list[str]


@dataclass
class ObjectInfo:
    fqn: str
    kind: str  # "json", "pickle" or "per_rank"


class Reader:
    """A committed checkpoint, opened for reading. Nothing is read until asked for."""

    def __init__(self, path, *, storage_options: dict | None = None, allow_pickle: bool = False,
                 verify: bool = True):
        refuse_non_switches("ss.open", allow_pickle=allow_pickle, verify=verify)
        self.path = normalize(path)
        self.backend = backend_for(self.path, storage_options)
        self.manifest: Manifest = read_manifest(self.backend, self.path)
        self.allow_pickle = allow_pickle
        self.check = verify

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @property
    def meta(self) -> dict:
        return self.manifest.meta

    def keys(self) -> list[str]:
        return self.manifest.keys()

    def __contains__(self, fqn: str) -> bool:
        return fqn in self.manifest.tensors or fqn in self.manifest.objects

    def info(self, fqn: str) -> TensorInfo | ObjectInfo:
        entry = self.manifest.tensors.get(fqn)
        if entry is not None:
            files = sorted({self.manifest.files[i] for i in set(entry.file.tolist())})
            return TensorInfo(fqn, entry.dtype, entry.shape, entry.stored_bytes, entry.num_pieces, entry.layout, files)
        if fqn in self.manifest.objects:
            return ObjectInfo(fqn, self.manifest.objects[fqn].kind)
        raise NotInCheckpointError(self._unknown(fqn))

    def read(self, fqn: str, index: Any = None) -> Any:
        """The logical tensor ``fqn`` assembled from its pieces, or only ``tensor[index]`` (basic
        slices with step 1 and integers), reading just the bytes that region needs."""
        entry = self.manifest.tensors.get(fqn)
        if entry is None:
            if fqn in self.manifest.objects and index is not None:  # (it was ignored: the whole value came back)
                raise CheckpointError(f"{fqn} is a plain value, not a tensor: read it whole (no index) and index that")
            if fqn in self.manifest.objects:
                return decode_value(fqn, self.manifest.objects[fqn], self.allow_pickle,
                                    blob_reader(self.backend, self.path, self.manifest), self._manifest_path)
            raise NotInCheckpointError(self._unknown(fqn))
        start, size, squeeze = _region(entry.shape, index, fqn)
        try:
            out = torch.empty(size, dtype=entry.dtype)
        except RuntimeError as exc:  # (what the manifest claims may be made up: 2**50 elements)
            raise CheckpointError(f"{fqn}: cannot allocate the {list(size)} {str(entry.dtype)[6:]} tensor the "
                                  f"checkpoint {self.path} records ({exc})") from None
        plan = plan_target(entry, BOX, start, size)
        if plan.covered != out.numel():
            raise CorruptCheckpointError(f"{fqn}: the checkpoint {self.path} does not store all of the "
                                         f"requested region ({plan.covered} of {out.numel()} elements)")
        executor = ReadExecutor(self.backend, self.path, self.manifest, self.check)
        executor.add(fqn, entry, out, plan)
        executor.run()
        return out.squeeze(squeeze) if squeeze else out

    def verify(self, threads: int | None = None, progress: bool | None = None) -> int:
        """Read every stored byte and check it against its checksum, and that every file has the
        size the manifest records; return the bytes of the data files checked.

        Raises one :class:`CorruptCheckpointError` (or :class:`MissingFileError`) listing every
        damaged piece by tensor and file, so one run shows the whole extent of the damage.
        ``progress``: a bar on stderr (default: only when stderr is a terminal)."""
        refuse_bad_settings("Reader.verify", threads=threads, progress=progress)
        problems, missing, resized = [], [], []
        for name, recorded in zip(self.manifest.files, self.manifest.file_sizes):
            try:
                resized += self._resized(self.backend.join(self.path, name), name, int(recorded))
            except FileNotFoundError:
                missing.append(name)
        entries = self._readable_entries(problems)
        tasks = [(fqn, entry, i) for fqn, entry in entries for i in range(entry.num_pieces)
                 if self.manifest.files[int(entry.file[i])] not in missing]
        total = sum(int(entry.nbytes[i]) for _, entry, i in tasks)
        with bar(total, f"verify {self.path}", progress) as advance, \
                ThreadPoolExecutor(threads or default_threads()) as pool:
            def check(task) -> str | None:
                problem = self._verify_piece(*task)
                advance(int(task[1].nbytes[task[2]]))
                return problem

            problems += [problem for problem in pool.map(check, tasks) if problem]
        values = self._verify_objects(missing)
        found = [f"{len(kind)} {what}: " + "; ".join(kind[:20])
                 for kind, what in ((problems, "damaged piece(s)"), (values, "damaged value(s)"),
                                    (resized, "file(s) of another size than recorded")) if kind]
        if missing:  # (with what else is wrong: the other files were checked all the same)
            needed = {fqn for fqn, _, _ in self._pieces_in(missing, entries)} | self._in_sections(missing)
            needed |= {fqn for fqn, ref in self._pickle_refs() if self.manifest.files[ref[0]] in missing}
            section_names = {self.manifest.files[i] for i in self.manifest.sections}
            kinds = [f"{what} missing: {', '.join(names)}" for what, names in
                     (("data files", [n for n in missing if n not in section_names]),
                      ("manifest sections", [n for n in missing if n in section_names])) if names]
            raise MissingFileError(f"{self.path}: {'; '.join(kinds)} (needed for " +
                                   ", ".join(sorted(needed)[:10]) + (" and more" if len(needed) > 10 else "") + ")" +
                                   "".join(f"; also {what}" for what in found))
        if found:
            raise CorruptCheckpointError(f"{self.path}: " + "; ".join(found))
        return self.manifest.total_bytes

    def _resized(self, where: str, name: str, recorded: int) -> list[str]:
        """A file larger than the manifest records was written to after the commit (appended to,
        or overwritten by a larger file), even where every checksummed piece still reads back
        intact. One shorter by less than ``ALIGN`` bytes is whole: checkpoints written before
        sizes were exact record the padding after the last piece that was never written
        (docs/format.md §1); shorter by more, it is cut short, or its recorded size (which
        ``verify`` reports as checked) is false. A ``FileNotFoundError`` where there is no file."""
        try:
            reader = self.backend.open_read(where)
        except FileNotFoundError:
            raise
        except (OSError, CorruptCheckpointError):  # (a link that loops, a FIFO: not missing, but unreadable)
            return []  # (each of its pieces reports why it cannot be read)
        try:
            size = reader.size()
        finally:
            reader.close()
        return [f"{name} is {size} bytes, the manifest records {recorded}"] if not 0 <= recorded - size < ALIGN else []

    def _verify_objects(self, missing: list[str]) -> list[str]:
        """Problems with the values that are not tensors: plain data that does not decode, and
        pickled bytes that do not match their checksum (checked, never unpickled)."""
        read_blob = blob_reader(self.backend, self.path, self.manifest)
        problems = []
        for fqn, ref in self._pickle_refs():
            if self.manifest.files[ref[0]] not in missing:
                try:
                    read_blob(fqn, ref)
                except CorruptCheckpointError as exc:
                    problems.append(str(exc))
        for fqn, entry in self._object_entries():
            if entry.kind == "json":
                try:
                    decode_value(fqn, entry, False, None, self._manifest_path)
                except ManifestError as exc:
                    problems.append(str(exc))
        return problems

    @property
    def _manifest_path(self) -> str:
        return self.backend.join(self.path, MANIFEST_NAME)

    def _object_entries(self):
        """(fqn, entry) of every value that is not a tensor, each rank's of a per-rank one too."""
        pending = list(self.manifest.objects.items())
        while pending:
            fqn, entry = pending.pop()
            pending += [(fqn, e) for e in entry.per_rank]
            yield fqn, entry

    def _pickle_refs(self):
        """(fqn, [file, offset, nbytes, checksum]) of every pickled value, per-rank ones included."""
        return ((fqn, entry.value) for fqn, entry in self._object_entries() if entry.kind == "pickle")

    def _readable_entries(self, problems: list[str]) -> list[tuple[str, TensorEntry]]:
        """Every tensor's entry, but those that a split manifest's damaged or missing section
        cannot give: what is wrong with a damaged one goes to ``problems`` (once per message; a
        missing section is reported as a missing file), and the check goes on, as past a damaged
        piece."""
        entries, failed = [], {}
        for fqn in self.manifest.tensors:
            try:
                entries.append((fqn, self.manifest.tensors[fqn]))
            except MissingFileError:
                pass
            except (CorruptCheckpointError, ManifestError) as exc:
                failed[str(exc)] = None
        problems += failed
        return entries

    def _in_sections(self, names: list[str]) -> set[str]:
        """The tensors a split manifest keeps in the sections ``names``."""
        if not isinstance(self.manifest.tensors, SplitTensors):
            return set()
        files, sections = self.manifest.files, self.manifest.sections
        return {fqn for fqn, row in self.manifest.tensors.rows.items() if files[sections[row.section]] in names}

    def _pieces_in(self, names: list[str], entries: list[tuple[str, TensorEntry]]):
        for fqn, entry in entries:
            for i in range(entry.num_pieces):
                if self.manifest.files[int(entry.file[i])] in names:
                    yield fqn, entry, i

    def _verify_piece(self, fqn: str, entry, i: int) -> str | None:
        name = self.manifest.files[int(entry.file[i])]
        block = self.manifest.block_bytes
        base, nbytes = int(entry.offset[i]), int(entry.nbytes[i])
        reader = None
        try:
            reader = self.backend.open_read(self.backend.join(self.path, name))
            if nbytes > reader.size() - base:  # (before sizing a buffer by the manifest's word)
                return f"{fqn} in {name}: file truncated before byte {base + nbytes}"
            sums, pos, chunk = [], 0, block * VERIFY_CHUNK_BLOCKS
            buf = bytearray(min(chunk, nbytes))
            while pos < nbytes or not sums:
                take = min(chunk, nbytes - pos)
                view = memoryview(buf)[:take]
                if reader.readinto(base + pos, [view]) != take:
                    return f"{fqn} in {name}: file truncated before byte {base + nbytes}"
                sums += checksum_blocks([view], block)
                pos += take
        except (OSError, CorruptCheckpointError) as exc:  # not a regular file, an I/O error
            return f"{fqn} in {name}: cannot be read ({type(exc).__name__}: {exc})"
        finally:
            if reader is not None:
                reader.close()
        if sums != entry.piece_checksums(i):
            return f"{fqn} in {name}: checksum mismatch in bytes [{base}, {base + nbytes})"
        return None

    def _unknown(self, fqn: str) -> str:
        return f"{fqn!r} is not in checkpoint {self.path} ({len(self.keys())} keys; see Reader.keys())"


def _region(shape: tuple, index: Any, fqn: str) -> tuple[tuple, tuple, tuple]:
    """(start, size, dims to squeeze) of a basic index into a tensor of ``shape``."""
    if index is None:
        return (0,) * len(shape), tuple(shape), ()
    if not isinstance(index, tuple):
        index = (index,)
    if len(index) > len(shape):
        raise CheckpointError(f"{fqn}: index {index} has more dimensions than shape {list(shape)}")
    start, size, squeeze = [], [], []
    for dim, length in enumerate(shape):
        sel = _integer(index[dim], fqn) if dim < len(index) else slice(None)
        if isinstance(sel, int):
            pos = sel + length if sel < 0 else sel
            if not 0 <= pos < length:
                raise RegionOutOfRangeError(f"{fqn}: index {sel} out of range for dimension {dim} of size {length}")
            start.append(pos)
            size.append(1)
            squeeze.append(dim)
        elif isinstance(sel, slice):
            try:
                lo, hi, step = slice(*(None if b is None else operator.index(b) for b in
                                       (sel.start, sel.stop, sel.step))).indices(length)
            except TypeError:  # (a bound that is no integer)
                raise CheckpointError(f"{fqn}: slice bounds must be integers, not {sel}") from None
            if step != 1:
                raise CheckpointError(f"{fqn}: only slices with step 1 can be read as a region")
            start.append(lo)
            size.append(max(0, hi - lo))
        else:
            raise CheckpointError(f"{fqn}: region index must be integers and slices, not {type(sel).__name__}")
    return tuple(start), tuple(size), tuple(squeeze)


def _integer(sel: Any, fqn: str) -> Any:
    """``sel`` as an int where torch reads it as one (a numpy integer, a 0-d integer tensor),
    else as it is (refused by the caller). A bool is refused here: torch reads ``t[True]`` as a new
    dimension, not as row 1, and a uint8 tensor as a mask."""
    if isinstance(sel, (bool, np.bool_)) or (isinstance(sel, torch.Tensor) and sel.dtype in (torch.bool, torch.uint8)) \
            or (isinstance(sel, np.ndarray) and sel.dtype in (np.bool_, np.uint8)):
        raise CheckpointError(f"{fqn}: a bool or uint8 index is a mask to torch, not a region; pass an int")
    if isinstance(sel, (int, slice)) or not hasattr(sel, "__index__"):
        return sel
    if isinstance(sel, (torch.Tensor, np.ndarray)) and sel.ndim != 0:  # (t[tensor([1])] keeps the dimension)
        return sel
    try:
        return operator.index(sel)
    except TypeError:  # (a tensor of floats)
        return sel


def open(path, *, storage_options: dict | None = None, allow_pickle: bool = False, verify: bool = True) -> Reader:  # noqa: A001
    return Reader(path, storage_options=storage_options, allow_pickle=allow_pickle, verify=verify)
