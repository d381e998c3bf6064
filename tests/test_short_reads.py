"""Reads that answer fewer or more bytes than asked: a store's short answer is its failure, not
the file's end, and is sent again; a file that is really shorter is damage; a copy to the further
level that ends early is never committed."""
from __future__ import annotations

import uuid
import warnings

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import statesnap as ss
from statesnap.storage.local import LocalBackend, _LocalReader

STATE_BYTES = 1 << 20  # (above the small-value limit: stored in the data file)


def _state(value=None):
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(STATE_BYTES // 4, generator=gen) if value is None else torch.full((STATE_BYTES // 4,),
                                                                                                value)}


def _answering(monkeypatch, answer):
    """MemoryFileSystem.cat_file answering ``answer(data, calls)`` for ranged reads of data files."""
    real, calls = MemoryFileSystem.cat_file, []

    def cat_file(self, path, start=None, end=None, **kwargs):
        data = real(self, path, start=start, end=end, **kwargs)
        if path.endswith(".bin") and start is not None:
            calls.append(path)
            return answer(data, len(calls))
        return data
    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat_file)
    return calls


def test_a_short_answer_from_the_store_is_read_again(monkeypatch):
    url = f"memory://short-{uuid.uuid4().hex[:8]}/ck"
    ss.save(_state(), url)
    calls = _answering(monkeypatch, lambda data, n: data[:100] if n == 1 else data)
    target = {"w": torch.zeros(STATE_BYTES // 4)}
    ss.load(target, url, storage_options={"retry_backoff_s": 0.01, "retry_max_backoff_s": 0.01})
    assert torch.equal(target["w"], _state()["w"]) and len(calls) >= 2


@pytest.mark.parametrize("answer, said", [(lambda data, n: data[:100], "answered 100 bytes"),
                                          (lambda data, n: data + b"x" * 10, "may not take ranged reads")])
def test_a_store_that_answers_the_wrong_length_fails_the_read_as_its_own_failure(monkeypatch, answer, said):
    """Always short: an error that says so, not 'truncated' (damage); longer (a store that
    ignores the range): an error, where a bare StopIteration escaped."""
    url = f"memory://wrong-{uuid.uuid4().hex[:8]}/ck"
    ss.save(_state(), url)
    _answering(monkeypatch, answer)
    for read in (lambda: ss.load({"w": torch.zeros(STATE_BYTES // 4)}, url, storage_options={"retries": 1}),
                 lambda: ss.open(url, storage_options={"retries": 1}).read("w")):
        with pytest.raises(ss.CheckpointError, match=said) as raised:
            read()
        assert not isinstance(raised.value, ss.CorruptCheckpointError)


def test_a_restart_does_not_go_back_past_a_step_the_store_answers_short(monkeypatch):
    """Step 3 read short every time: load_latest raises (try again), where it went back to
    step 2 as if step 3 were damaged, and the resumed run would have saved over step 3."""
    root = f"memory://restart-{uuid.uuid4().hex[:8]}/run"
    with ss.Checkpointer(root, host_memory_gb=0.01) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(float(step))).wait()
    real = MemoryFileSystem.cat_file

    def cat_file(self, path, start=None, end=None, **kwargs):
        data = real(self, path, start=start, end=end, **kwargs)
        return data[:100] if "step-3" in path and path.endswith(".bin") and start is not None else data
    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat_file)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with ss.Checkpointer(root, host_memory_gb=0.01, storage_options={"retries": 1}) as ckpt:
            with pytest.raises(ss.CheckpointError, match="answered 100 bytes"):
                ckpt.load_latest(_state(0.0))
    monkeypatch.setattr(MemoryFileSystem, "cat_file", real)
    target = _state(0.0)
    with ss.Checkpointer(root, host_memory_gb=0.01) as ckpt:
        assert ckpt.load_latest(target) == 3 and torch.equal(target["w"], _state(3.0)["w"])


def test_a_local_read_that_stops_inside_the_file_is_no_truncation(tmp_path, monkeypatch):
    """A reader whose read stops short while the file holds the bytes (a backend of one's own,
    an interrupted read) fails the load as an I/O error, not as damage; a file cut short is damage."""
    ss.save(_state(), tmp_path / "ck")
    real = _LocalReader.readinto
    monkeypatch.setattr(_LocalReader, "readinto", lambda self, offset, views: min(real(self, offset, views), 100))
    with pytest.raises(ss.ReadFailedError, match="stopped at byte .* though the file holds"):
        ss.load({"w": torch.zeros(STATE_BYTES // 4)}, tmp_path / "ck")
    monkeypatch.setattr(_LocalReader, "readinto", real)
    data = next(p for p in (tmp_path / "ck").iterdir() if p.name.endswith(".bin"))
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(ss.CorruptCheckpointError, match="truncated"):
        ss.load({"w": torch.zeros(STATE_BYTES // 4)}, tmp_path / "ck", verify=False)


def test_a_further_copy_that_reads_short_is_not_committed(tmp_path, monkeypatch):
    """One read of the copy to the further level comes back empty: the copy fails, named, and
    the further level holds no step that no load could read; the next step is copied whole."""
    real_open, real_read = LocalBackend.open_read, _LocalReader.readinto
    failed = []

    def open_read(self, path):
        reader = real_open(self, path)
        reader.source = path
        return reader

    def readinto(self, offset, views):
        source = getattr(self, "source", "")
        if source.startswith(str(tmp_path / "root")) and source.endswith(".bin") and not failed and offset > 0:
            failed.append(source)
            return 0
        return real_read(self, offset, views)
    monkeypatch.setattr("statesnap.checkpointer.further.COPY_CHUNK", 1 << 16)
    monkeypatch.setattr(LocalBackend, "open_read", open_read)
    monkeypatch.setattr(_LocalReader, "readinto", readinto)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ss.Checkpointer(tmp_path / "root", further_root=tmp_path / "further", further_every=1,
                             host_memory_gb=0.01, on_error="warn") as ckpt:
            for step in (1, 2):
                ckpt.save(step, _state(float(step))).wait()
    assert failed
    said = [str(w.message) for w in caught if "not copied" in str(w.message)]
    assert len(said) == 1 and "ended at byte" in said[0], said
    assert not (tmp_path / "further" / "step-1").exists()
    assert ss.open(tmp_path / "further" / "step-2").verify() > 0
