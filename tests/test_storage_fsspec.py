"""The fsspec backend's streaming writer: exact files, bounded memory, errors that surface."""
import datetime
import hashlib
import importlib
import random
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import fsspec
import numpy as np
import pytest
import torch
import torch.nn as nn
from fsspec.spec import AbstractBufferedFile

import statesnap as ss
from statesnap.engine.write import write_file
from statesnap.plan.save_plan import ALIGN
from statesnap.storage import fsspec_backend
from statesnap.storage.fsspec_backend import PAD_ALIGN, FsspecBackend, _FsspecWriter

MiB = 1 << 20


def random_bytes(nbytes: int, seed: int) -> memoryview:
    return memoryview(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).data)


def laid_out(sizes: list[int], seed: int) -> tuple[list[tuple[int, memoryview]], bytes]:
    """Jobs placed as the save plan places pieces (each on the next multiple of ALIGN) and the
    file they make (zeros in the gaps)."""
    jobs, end = [], 0
    for i, size in enumerate(sizes):
        start = -(-end // ALIGN) * ALIGN
        jobs.append((start, random_bytes(size, seed + i)))
        end = start + size
    expected = bytearray(end)
    for start, view in jobs:
        expected[start:start + len(view)] = view
    return jobs, bytes(expected)


class RecordingFile(AbstractBufferedFile):
    """An object-store upload as fsspec does it (a buffer sent one part per ``blocksize``) that
    keeps a hash of its bytes, not the bytes; records the writer's held bytes at every write,
    sleeps on some parts (an upload's pace) and can fail."""

    def __init__(self, fail_at_write: int | None = None, fail_on_close: bool = False, slow: float = 0.0):
        super().__init__(RecordingFS(), "bucket/data.bin", mode="wb", block_size=MiB)
        self.fs.file = self
        self.hash, self.size, self.writes, self.max_held = hashlib.sha256(), 0, 0, 0
        self.writer = None
        self.fail_at_write, self.fail_on_close, self.slow = fail_at_write, fail_on_close, slow
        self.rng = random.Random(0)
        self.completed = self.aborted = False

    def write(self, data) -> int:
        self.writes += 1
        if self.writes == self.fail_at_write:
            raise OSError(5, "upload failed")
        if self.writer is not None:
            self.max_held = max(self.max_held, self.writer.held)
        return super().write(data)

    def _initiate_upload(self) -> None:
        pass

    def _upload_chunk(self, final: bool = False) -> bool:
        if final and self.fail_on_close:
            raise OSError(5, "completing the upload failed")
        if self.slow and self.rng.random() < 0.5:
            time.sleep(self.slow)
        data = self.buffer.getvalue()
        self.hash.update(data)
        self.size += len(data)
        self.completed = final
        return True

    def discard(self) -> None:
        self.aborted = True


class RecordingFS:
    """What the writer and fsspec's buffered file call on a file system."""

    def __init__(self):
        self.file, self.removed = None, []

    def open(self, path, mode):
        assert mode == "wb"
        return self.file

    def rm(self, path):
        self.removed.append(path)

    def invalidate_cache(self, path=None):
        pass

    def _parent(self, path):
        return path.rsplit("/", 1)[0]


def recording_writer(file: RecordingFile, reorder_bytes: int) -> tuple[_FsspecWriter, RecordingFS]:
    fs = file.fs
    writer = _FsspecWriter(fs, "bucket/data.bin", "mem://bucket/data.bin", reorder_bytes)
    file.writer = writer
    return writer, fs


class OneWriterBackend:
    """What ``write_file`` needs of a backend: hands out one prepared writer."""

    def __init__(self, writer):
        self.writer = writer

    def open_write(self, path, durable):
        return self.writer


def test_padding_rule_matches_the_save_plan():
    assert PAD_ALIGN == ALIGN


def test_blocking_save_of_a_large_file_holds_at_most_the_cap():
    """A 100+ MiB file written by write_file's pool (jobs in file order, FIFO, 8 threads) while
    the upload is slow: the writer never holds more than its cap of early bytes, and the file is
    exact (zeros in the alignment gaps)."""
    sizes = [7 * MiB + 3, 13 * MiB + 17, 1000, 40 * MiB + 5, 9, 25 * MiB, 20 * MiB + 60]
    jobs, expected = laid_out(sizes, seed=1)
    assert len(expected) > 100 * MiB
    cap = 6 * MiB
    file = RecordingFile(slow=0.005)
    writer, fs = recording_writer(file, cap)
    write_file(OneWriterBackend(writer), "x", jobs, block_bytes=256 << 10, durable=True, threads=8)
    assert file.completed and not fs.removed
    assert 0 < file.max_held <= cap
    assert file.size == len(expected) and file.hash.digest() == hashlib.sha256(expected).digest()


def test_out_of_order_writes_from_several_threads_are_exact():
    """Parts in a random order from 6 threads, with a cap far below the file: parts wait while
    the stream is being written and go to the spill file when nobody is writing; the file is
    exact whatever the order."""
    for seed in range(4):
        sizes = [random.Random(seed * 100 + i).randrange(1, 300_000) for i in range(60)]
        jobs, expected = laid_out(sizes, seed)
        cut = 1536 * PAD_ALIGN  # pieces are cut at multiples of PAD_ALIGN, as the callers cut them
        parts = [(off + pos, view[pos:pos + cut]) for off, view in jobs for pos in range(0, len(view), cut)]
        random.Random(seed).shuffle(parts)
        file = RecordingFile(slow=0.001)
        writer, _ = recording_writer(file, 250_000)
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda part: writer.pwrite(part[0], [part[1]]), parts))
        writer.close(durable=True)
        assert file.max_held <= 250_000
        assert file.hash.digest() == hashlib.sha256(expected).digest(), seed


def test_pwrite_copies_what_it_holds():
    """The caller may reuse its memory once pwrite returns (the staging arena does)."""
    fs = fsspec.filesystem("memory")
    writer = _FsspecWriter(fs, "/copies/data.bin", "memory://copies/data.bin")
    later = bytearray(b"b" * 64)
    writer.pwrite(64, [memoryview(later)])  # early: held
    later[:] = b"x" * 64
    writer.pwrite(0, [memoryview(b"a" * 64)])
    writer.close(durable=True)
    assert fs.cat_file("/copies/data.bin") == b"a" * 64 + b"b" * 64


def test_a_part_behind_the_stream_fails_the_file_instead_of_being_lost():
    """A stream ending off PAD_ALIGN is taken to end a piece; a part that then turns up in the
    padding (a caller cutting pieces off PAD_ALIGN) raises, it is never silently dropped."""
    file = RecordingFile()
    writer, fs = recording_writer(file, MiB)
    writer.pwrite(0, [random_bytes(100, 0)])
    writer.pwrite(128, [random_bytes(64, 1)])  # streamed after 28 bytes of padding
    with pytest.raises(ss.CheckpointError, match=r"bytes \[100, 110\) of mem://bucket/data.bin arrived after"):
        writer.pwrite(100, [random_bytes(10, 2)])
    with pytest.raises(ss.CheckpointError):
        writer.close(durable=True)
    assert fs.removed == ["bucket/data.bin"]


def test_an_upload_error_raises_from_pwrite_and_close_and_deletes_the_object():
    file = RecordingFile(fail_at_write=2)
    writer, fs = recording_writer(file, MiB)
    writer.pwrite(0, [random_bytes(100, 0)])
    with pytest.raises(ss.CheckpointError, match="mem://bucket/data.bin.*upload failed"):
        writer.pwrite(128, [random_bytes(100, 1)])
    with pytest.raises(ss.CheckpointError, match="upload failed"):
        writer.pwrite(256, [random_bytes(100, 2)])
    with pytest.raises(ss.CheckpointError, match="upload failed"):
        writer.close(durable=True)
    assert fs.removed == ["bucket/data.bin"] and file.aborted and not file.completed


def test_an_error_completing_the_upload_raises_from_close():
    file = RecordingFile(fail_on_close=True)
    writer, fs = recording_writer(file, MiB)
    writer.pwrite(64, [random_bytes(100, 0)])  # held until close
    writer.pwrite(0, [random_bytes(64, 1)])
    with pytest.raises(ss.CheckpointError, match="completing mem://bucket/data.bin failed"):
        writer.close(durable=True)
    assert fs.removed == ["bucket/data.bin"]


def test_threads_waiting_for_room_are_released_by_a_failure():
    """A thread waits for room only while another writes; when that write fails, it raises."""
    gate, started = threading.Event(), threading.Event()

    class StuckFile(RecordingFile):
        def write(self, data):
            started.set()
            gate.wait(10)
            raise OSError(5, "connection reset")

    writer, fs = recording_writer(StuckFile(), 100)
    results = {}

    def put(name, offset):
        try:
            writer.pwrite(offset, [random_bytes(100, offset)])
            results[name] = "returned"
        except ss.CheckpointError as exc:
            results[name] = str(exc)

    streaming = threading.Thread(target=put, args=("streaming", 0))
    streaming.start()
    assert started.wait(10)
    put("held", 128)  # fits the cap: returns at once
    waiting = threading.Thread(target=put, args=("waiting", 256))
    waiting.start()
    time.sleep(0.2)
    assert "waiting" not in results  # no room, and a write is under way: it waits
    gate.set()
    streaming.join(10)
    waiting.join(10)
    assert results["held"] == "returned"
    assert "connection reset" in results["streaming"] and "connection reset" in results["waiting"]
    with pytest.raises(ss.CheckpointError):
        writer.close(durable=False)
    assert fs.removed


def trained(seed: int, extra: dict) -> dict:
    """A model and AdamW after one step (so the optimizer has state), with ``extra``."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(300, 301), nn.Linear(301, 7))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 300)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "extra": extra}


def test_save_and_load_through_memory_url_are_bit_exact(monkeypatch):
    """Small write chunks from several threads and a small cap: the streaming path, its waits
    and its spills all run; every tensor and object comes back bit for bit."""
    monkeypatch.setattr(fsspec_backend, "REORDER_BYTES", 300_000)
    state = trained(0, {"odd": torch.randn(1001, dtype=torch.float64), "half": torch.randn(333).bfloat16(),
                        "empty": torch.empty(0), "step": 7})
    url = "memory://statesnap-fsspec-tests/save/step-7"
    ss.save(state, url, overwrite=True, threads=4, block_bytes=4096)
    ss.open(url).verify()
    target = trained(1, {"odd": torch.zeros(1001, dtype=torch.float64), "half": torch.zeros(333).bfloat16(),
                         "empty": torch.empty(0), "step": 0})
    ss.load(target, url)
    for (name, a), (_, b) in zip(state["model"].state_dict().items(), target["model"].state_dict().items()):
        assert torch.equal(a, b), name
    for a, b in zip(state["optim"].state.values(), target["optim"].state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    for key in ("odd", "half"):
        assert torch.equal(state["extra"][key].view(torch.uint8), target["extra"][key].view(torch.uint8))
    assert target["extra"]["step"] == 7


def test_checkpointer_streams_to_an_object_store_bit_exact(monkeypatch):
    """A Checkpointer whose arena is smaller than the state streams batches to memory://. Its
    write workers may finish parts out of order, so with a cap this small early parts wait or
    spill; the memory held stays under the cap and every step is exact."""
    monkeypatch.setattr(fsspec_backend, "REORDER_BYTES", 1 << 18)
    held = [0]
    real_admit = _FsspecWriter._admit

    def recording_admit(self, offset, nbytes):  # the held bytes grow only here
        how = real_admit(self, offset, nbytes)
        held.append(self.held)
        return how

    monkeypatch.setattr(_FsspecWriter, "_admit", recording_admit)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = torch.randn(400_000)
    state = {"model": model, "optim": optim, "extra": {"ema": ema}}
    root = "memory://statesnap-fsspec-tests/ckpt"
    FsspecBackend(root).remove(root)
    records = {}
    ckpt = ss.Checkpointer(root, keep_last=3, host_memory_gb=0.0015, eager_copy_mb=0.1)
    for step in range(1, 4):
        optim.zero_grad()
        model(torch.randn(4, 128)).pow(2).sum().backward()
        optim.step()
        ema.mul_(0.5)
        ckpt.save(step, state).wait()
        records[step] = {k: v.clone() for k, v in model.state_dict().items()} | {"ema": ema.clone()}
    ckpt.close()
    assert max(held) <= 1 << 18  # how much is early depends on thread timing: only the bound is fixed
    for step, record in records.items():
        reader = ss.open(f"{root}/step-{step}")
        reader.verify()
        assert torch.equal(reader.read("extra.ema"), record["ema"])
        for name, value in record.items():
            if name != "ema":
                assert torch.equal(reader.read(f"model.{name}"), value), (step, name)


def test_a_url_fsspec_cannot_serve_is_a_checkpoint_error_naming_it(monkeypatch):
    """An unknown protocol, one whose package is not installed (gs:// without gcsfs), or options
    the file system refuses: a CheckpointError naming the URL and the reason, as any other
    trouble opening a checkpoint is, not fsspec's ValueError or ImportError."""
    registry = importlib.import_module("fsspec.registry")  # (fsspec.registry is its dict of classes)
    monkeypatch.setitem(registry.known_implementations, "notinstalled",
                        {"class": "statesnap_no_such_package.FileSystem", "err": "Please install no-such-package"})
    cases = {"nosuchprotocol://bucket/ckpt": "Protocol not known: nosuchprotocol",
             "notinstalled://bucket/ckpt": "ImportError: Please install no-such-package"}
    for url, reason in cases.items():
        for attempt in (lambda: ss.open(url), lambda: ss.load({"w": torch.zeros(2)}, url),
                        lambda: ss.save({"w": torch.zeros(2)}, url)):
            with pytest.raises(ss.CheckpointError, match=f"^cannot open {url}: .*{reason}"):
                attempt()
    with pytest.raises(ss.CheckpointError, match="^cannot open memory://b/ckpt: .*retries"):
        ss.open("memory://b/ckpt", storage_options={"retries": 0})


def test_a_store_whose_pipe_file_takes_no_mode_still_saves_and_refuses_a_second_save(monkeypatch, caplog):
    """An fsspec store from before ``pipe_file`` took a mode (its keyword arguments go to its
    client, which refuses ``mode``): a save without overwrite looks first and writes plainly,
    said once in the log; a second save to the path is still a CheckpointExistsError."""
    from fsspec.implementations.memory import MemoryFileSystem

    plain = MemoryFileSystem.pipe_file

    def older(self, path, value, **kwargs):
        if kwargs:
            raise TypeError(f"put_object() got an unexpected keyword argument {next(iter(kwargs))!r}")
        return plain(self, path, value)

    monkeypatch.setattr(MemoryFileSystem, "pipe_file", older)
    monkeypatch.setattr(fsspec_backend, "_NO_CONDITIONAL_WRITES", weakref.WeakSet())  # (for this test only)
    url = f"memory://older-store-{time.monotonic_ns()}/ckpt"
    with caplog.at_level("WARNING", logger="statesnap"):
        ss.save({"w": torch.arange(5.0)}, url)
    assert "refuses conditional writes" in caplog.text
    with pytest.raises(ss.CheckpointExistsError):
        ss.save({"w": torch.zeros(5)}, url)
    target = {"w": torch.zeros(5)}
    ss.load(target, url)
    assert torch.equal(target["w"], torch.arange(5.0))


def test_an_overwrite_in_place_deletes_only_the_replaced_checkpoints_files_and_old_leftovers():
    """Two saves to one object-store path at once: the first to commit deleted every file its
    manifest did not name, the other save's data file among them, and that save's manifest,
    committed next, named a file that was gone. A commit now deletes the files of the
    checkpoint it replaced, and files no save has written for a day (a killed save's)."""
    url = "memory://statesnap-fsspec-tests/overwrite-race/ck"
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)
    ss.save({"t": torch.zeros(1000)}, url)
    old_files = set(ss.open(url).manifest.files)
    base = "/statesnap-fsspec-tests/overwrite-race/ck"
    fs.pipe_file(f"{base}/data-0123456789ab-r00000.bin", b"another save's, being written")
    fs.pipe_file(f"{base}/data-ba9876543210-r00000.bin", b"a killed save's")
    fs.store[f"{base}/data-ba9876543210-r00000.bin"].created -= datetime.timedelta(days=2)
    ss.save({"t": torch.ones(1000)}, url, overwrite=True)
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(base, detail=False)}
    new_files = set(ss.open(url).manifest.files)
    assert names == new_files | {"manifest.json", "data-0123456789ab-r00000.bin"} and not old_files & names
    assert torch.equal(ss.open(url).read("t"), torch.ones(1000))
    fs.rm(url, recursive=True)
