"""Hostile, damaged and foreign inputs to ``ss.convert`` and ``ss.export``: each is a
``CheckpointError`` naming the file and the value, in little time and memory, never a hang, a
crash, a raw Python exception or a silently wrong checkpoint.

DeepSpeed checkpoints are built here from plain dicts (one rank, two tiny parameters), in the
layout DeepSpeed 0.19 writes, so that these tests need neither DeepSpeed nor its producers.
"""
from __future__ import annotations

import copyreg
import dataclasses
import errno
import json
import os
import subprocess
import sys
import textwrap
import time
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import statesnap as ss
from statesnap.convert import api, unpickler
from statesnap.errors import CheckpointError, CheckpointExistsError
from statesnap.convert.transform import TransformError


def _convert(src, tmp_path, **kwargs):
    return ss.convert(str(src), str(tmp_path / "out"), **kwargs)


# --- object graphs: shared, cyclic, deep ------------------------------------------------------

def _dag(levels: int) -> list:
    shared = [1, 2]
    for _ in range(levels):
        shared = [shared, shared]
    return shared


def test_shared_lists_that_would_expand_exponentially_are_refused(tmp_path):
    """20 levels of ``l = [l, l]`` are a 1 KB file and 2**20 values written out as a tree."""
    torch.save({"v": _dag(21)}, tmp_path / "x.pt")
    started = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"x\.pt: its lists and dicts refer to each other"):
        _convert(tmp_path / "x.pt", tmp_path, source="torch")
    with pytest.raises(CheckpointError, match="refer to each other"):  # DeepSpeed's and Megatron's unpickler
        unpickler.load(str(tmp_path / "x.pt"))
    assert time.perf_counter() - started < 5


def test_a_little_sharing_is_kept(tmp_path):
    config = {"lr": 0.1, "betas": [0.9, 0.99]}
    torch.save({"a": config, "b": config, "w": torch.ones(2)}, tmp_path / "x.pt")
    _convert(tmp_path / "x.pt", tmp_path)
    assert ss.open(str(tmp_path / "out")).read("b.betas") == [0.9, 0.99]


def _deep(depth: int) -> list:
    value = [1]
    for _ in range(depth):
        value = [value]
    return value


def _cyclic_list():
    value = [1]
    value.append(value)
    return value


def _cyclic_dict():
    value = {"a": 1}
    value["self"] = value
    return value


@pytest.mark.parametrize("case, says", [("list", r"v\.1 contains itself"), ("dict", r"v\.self contains itself"),
                                        ("deep", "nested more than 100 levels")])
def test_cycles_and_deep_nesting_are_refused(case, says, tmp_path):
    value = {"list": _cyclic_list, "dict": _cyclic_dict, "deep": lambda: _deep(3000)}[case]()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)  # torch.save itself recurses
    try:
        torch.save({"v": value}, tmp_path / "x.pt")
    finally:
        sys.setrecursionlimit(limit)
    with pytest.raises(CheckpointError, match=says):
        _convert(tmp_path / "x.pt", tmp_path, source="torch")
    with pytest.raises(CheckpointError, match=says):
        unpickler.load(str(tmp_path / "x.pt"))


# --- tensors that are no plain dense block --------------------------------------------------

def test_stride0_view_claiming_gigabytes_of_a_tiny_storage_is_refused(tmp_path):
    big = torch.zeros(1).as_strided((1 << 14, 1 << 15), (0, 0))  # 2 GiB shown, 4 bytes stored
    torch.save({"w": big}, tmp_path / "tiny.pt")
    with pytest.raises(CheckpointError, match=r"tiny\.pt: its tensors are views of 4 stored bytes.*w alone"):
        _convert(tmp_path / "tiny.pt", tmp_path)
    assert not os.path.exists(tmp_path / "out")


def test_small_expanded_views_are_materialized(tmp_path):
    """Expanded buffers are legitimate (position ids, masks): written out at their logical size."""
    torch.save({"ones": torch.ones(1).expand(4096), "ids": torch.arange(8).expand(2, 8)}, tmp_path / "x.pt")
    _convert(tmp_path / "x.pt", tmp_path)
    reader = ss.open(str(tmp_path / "out"))
    assert torch.equal(reader.read("ones"), torch.ones(4096))
    assert torch.equal(reader.read("ids"), torch.arange(8).expand(2, 8))


@pytest.mark.parametrize("case", ["nested", "sparse in a list"])
def test_nested_and_sparse_tensors_are_refused_by_name(case, tmp_path):
    value = (torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]) if case == "nested"
             else [torch.sparse_coo_tensor([[0]], [1.0], (2,))])
    torch.save({"v": value}, tmp_path / "x.pt")
    name = "v" if case == "nested" else r"v\.0"
    with pytest.raises(CheckpointError, match=rf"x\.pt: {name} is a (nested|sparse_coo) tensor"):
        _convert(tmp_path / "x.pt", tmp_path)


# --- numpy in the allow-listed unpickler ------------------------------------------------------

class _Pickled:
    """Pickles as ``func(*args)`` followed, with ``state``, by a BUILD: any call a file may name."""

    def __init__(self, func, args, state=None):
        self.reduced = (func, args) if state is None else (func, args, state)

    def __reduce__(self):
        return self.reduced


class _NewArray:
    """Pickles as NEWOBJ ``numpy.ndarray((2**30,), "u1")``, which pickle itself will not write."""

    def __reduce__(self):
        return copyreg.__newobj__, (_NewArray, (1 << 30,), "u1")


def _save_renamed(obj, path, ours: type, theirs: bytes) -> None:
    """torch.save of ``obj`` with the class ``ours`` renamed to the global ``theirs`` in the pickle."""
    torch.save(obj, path)
    with zipfile.ZipFile(path) as zf:
        entries = {info.filename: zf.read(info) for info in zf.infolist()}
    name = f"c{ours.__module__}\n{ours.__qualname__}\n".encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for entry, data in entries.items():
            zf.writestr(entry, data.replace(name, b"c" + theirs.replace(b":", b"\n") + b"\n"))


_RECONSTRUCT = np.ndarray.__reduce__(np.zeros(0))[0]
_DTYPE_U4 = ("u4", False, True)  # how numpy pickles np.dtype("u4")
NUMPY_HOSTILE = {  # a few hundred bytes each
    "NEWOBJ ndarray": _NewArray,
    "REDUCE ndarray": lambda: _Pickled(np.ndarray, ((1 << 30,), "u1")),
    "_reconstruct of a huge shape": lambda: _Pickled(_RECONSTRUCT, (np.ndarray, (1 << 30,), b"b")),
}


@pytest.mark.parametrize("case", sorted(NUMPY_HOSTILE))
def test_numpy_arrays_are_only_built_from_their_data(case, tmp_path):
    """A small file must not make a 1 GiB uninitialised array (nor leak heap contents)."""
    path = str(tmp_path / "arr.pt")
    _save_renamed({"rng": NUMPY_HOSTILE[case]()}, path, _NewArray, b"numpy:ndarray")
    with pytest.raises(CheckpointError, match="arr.pt"):
        unpickler.load(path)


def test_numpy_states_that_would_read_out_of_bounds_are_refused(tmp_path):
    """An object array with fewer elements than its shape, and a dtype whose state adds a subarray,
    made numpy read past its memory (the first crashed the process): run in a child process."""
    short = _Pickled(_RECONSTRUCT, (np.ndarray, (0,), b"b"), (1, (4,), np.dtype("O"), False, [1, 2]))
    grown = _Pickled(np.dtype, _DTYPE_U4, (3, "<", (np.dtype("u1"), (1000,)), None, None, -1, -1, 0))
    grown = _Pickled(_RECONSTRUCT, (np.ndarray, (0,), b"b"), (1, (1,), grown, False, b"\0" * 4))
    paths = [str(tmp_path / "short.pt"), str(tmp_path / "grown.pt")]
    torch.save({"rng": short}, paths[0])
    torch.save({"rng": grown}, paths[1])
    script = textwrap.dedent(f"""
        from statesnap.convert import unpickler
        from statesnap.errors import UnsafeCheckpointError
        for path in {paths!r}:
            try:
                unpickler.load(path)
                print("loaded")
            except UnsafeCheckpointError as exc:
                print("refused")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["refused", "refused"]


def test_numpy_rng_state_still_loads(tmp_path):
    """What Megatron-LM saves: numpy's RNG state, a uint32 array (here big-endian too)."""
    state = np.random.RandomState(3).get_state()
    torch.save({"np": state, "be": np.arange(3, dtype=">u4")}, tmp_path / "rng.pt")
    loaded = unpickler.load(str(tmp_path / "rng.pt"))
    assert type(loaded["np"][1]) is np.ndarray and np.array_equal(loaded["np"][1], state[1])
    assert loaded["be"].tolist() == [0, 1, 2]  # numpy itself loads it in native byte order


# --- FIFOs in place of source files -----------------------------------------------------------

def test_a_fifo_in_place_of_a_source_file_is_refused_not_waited_on(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    os.mkfifo(src / "model.safetensors")
    os.mkfifo(src / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match="model.safetensors is a FIFO"):
        _convert(src / "model.safetensors", tmp_path)
    with pytest.raises(CheckpointError, match="model.safetensors is a FIFO"):
        _convert(src, tmp_path, source="safetensors")
    with pytest.raises(CheckpointError, match="optim_states.pt is a FIFO"):
        unpickler.load(str(src / "zero_pp_rank_1_mp_rank_00_optim_states.pt"))


def test_a_symlinked_source_is_still_followed(tmp_path):
    """The Hugging Face cache is symbolic links into a blob store."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snapshot").mkdir()
    save_file({"w": torch.arange(4.0)}, str(tmp_path / "blobs" / "abc"))
    os.symlink(tmp_path / "blobs" / "abc", tmp_path / "snapshot" / "model.safetensors")
    _convert(tmp_path / "snapshot", tmp_path)
    assert torch.equal(ss.open(str(tmp_path / "out")).read("w"), torch.arange(4.0))


# --- DeepSpeed checkpoints, built here --------------------------------------------------------

@dataclasses.dataclass
class _Fragment:
    """Pickled under DeepSpeed's name ``fragment_address`` (see :func:`_save`)."""

    numel: int
    start: int


def _save(obj, path) -> None:
    """torch.save, with :class:`_Fragment` renamed to DeepSpeed's class in the pickle."""
    _save_renamed(obj, path, _Fragment, b"deepspeed.utils.tensor_fragment:fragment_address")


SHAPES = OrderedDict(w=torch.Size([4, 2]), b=torch.Size([3]))


def _model_states(stage: int, tp: int) -> dict:
    module = {"w": torch.randn(4, 2), "b": torch.randn(3)} if stage < 3 else {"w": torch.empty(0), "b": torch.empty(0)}
    return {"module": {**module, "n": torch.ones(2)}, "buffer_names": [], "optimizer": None,
            "param_shapes": [OrderedDict(SHAPES)], "frozen_param_shapes": OrderedDict(n=torch.Size([2])),
            "shared_params": {}, "frozen_param_fragments": OrderedDict(n=torch.ones(2)), "lr_scheduler": {},
            "global_steps": 3, "skipped_steps": 0, "global_samples": 12, "dp_world_size": 1, "mp_world_size": tp,
            "checkpoint_parallel_dimensions": {"tp_degree": tp, "pp_degree": 1}, "ds_version": "0.19.8",
            "my_extra": 42}


def _optim_states(stage: int) -> dict:
    moments = {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(11), "exp_avg_sq": torch.zeros(11)}}
    groups = [{"lr": 0.1, "params": [0]}]
    if stage == 3:
        inner = {"zero_stage": 3, "partition_count": 1, "fp32_flat_groups": [torch.randn(11)],
                 "optimizer_state_dict": {"state": moments, "param_groups": groups}}
    else:
        inner = {"zero_stage": stage, "partition_count": [1], "single_partition_of_fp32_groups": [torch.randn(11)],
                 "base_optimizer_state": {"state": moments, "param_groups": groups},
                 "param_slice_mappings": [OrderedDict(w=_Fragment(8, 0), b=_Fragment(3, 8))]}
    return {"optimizer_state_dict": inner}


def _deepspeed(tmp_path, stage: int = 2, tp: int = 1, model=None, optim=None) -> str:
    """A one-DP-rank DeepSpeed run directory (``tp`` model-parallel ranks alike); ``model`` and
    ``optim`` change rank 0's model and optimizer states before they are saved."""
    run = tmp_path / "run"
    tag = run / "global_step3"
    tag.mkdir(parents=True)
    (run / "latest").write_text("global_step3")
    for mp in range(tp):
        torch.manual_seed(0)  # the TP ranks alike: replicated tensors must be equal
        states, optimizer = _model_states(stage, tp), _optim_states(stage)
        if model:
            model(states)
        if optim:
            optim(optimizer["optimizer_state_dict"])
        prefix = "zero_pp_rank_0_" if stage == 3 else ""
        _save(states, tag / f"{prefix}mp_rank_{mp:02d}_model_states.pt")
        _save(optimizer, tag / f"zero_pp_rank_0_mp_rank_{mp:02d}_optim_states.pt")
    return str(run)


@pytest.mark.parametrize("optimizer", ["torch's own (stage 0)", "none"])
def test_a_deepspeed_checkpoint_without_zero_says_how_to_convert_it(tmp_path, optimizer):
    """Without ZeRO, DeepSpeed saves the module and PyTorch's own optimizer state dict (keyed by
    the parameters' positions) in the model states file, and no param_shapes: the error says so
    and names the conversion that takes it, which then holds every value bit for bit."""
    run = tmp_path / "run"
    (run / "global_step3").mkdir(parents=True)
    (run / "latest").write_text("global_step3")
    states = {**_model_states(2, 1), "param_shapes": None}
    if optimizer != "none":
        states["optimizer"] = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 2)}},
                               "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    file = run / "global_step3" / "mp_rank_00_model_states.pt"
    _save(states, file)
    held = "PyTorch's own optimizer state dict" if optimizer != "none" else "no optimizer state"
    with pytest.raises(CheckpointError, match=f"{file} has no param_shapes, so it is no ZeRO checkpoint: it holds "
                                              f"its module's weights and {held}.*source='torch'"):
        _convert(run, tmp_path, source="deepspeed")
    _convert(file, tmp_path, source="torch")
    reader = ss.open(str(tmp_path / "out"))
    assert torch.equal(reader.read("module.w"), states["module"]["w"]) and reader.read("my_extra") == 42
    if optimizer != "none":
        assert torch.equal(reader.read("optimizer.state.0.exp_avg"), states["optimizer"]["state"][0]["exp_avg"])


@pytest.mark.parametrize("stage", [2, 3])
def test_the_built_deepspeed_checkpoints_convert(stage, tmp_path):
    _convert(_deepspeed(tmp_path, stage), tmp_path, source="deepspeed")
    reader = ss.open(str(tmp_path / "out"))
    assert reader.read("fp32.w").shape == (4, 2) and reader.read("my_extra") == 42


def _info(**info):
    return lambda states: states.__setitem__("universal_checkpoint_info", info)


@pytest.mark.parametrize("pattern", ["(a+)+$", "a{0,40}" * 10 + "$", "a?" * 30 + "a" * 30, "a{,}" * 12 + "b",
                                     "{?" * 24 + "{" * 24])
def test_checkpoint_regexes_that_backtrack_catastrophically_are_refused(tmp_path, pattern):
    """A TP checkpoint's own patterns, matched against names from the same file: ``(a+)+$``
    against a buffer named a...a! took 18 s at 28 a's, three times as long per two more; ten
    ``a{0,40}`` took 84 s against 41 a's and a ``!`` (no group repeated there, nor in ``a?``
    thirty times)."""
    def hostile(states):
        _info(tp_replicated_parameter_patterns=[pattern])(states)
        states["module"]["a" * 22 + "!"] = torch.zeros(1)
    run = _deepspeed(tmp_path, tp=2, model=hostile)
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states.pt: .*pattern .* is refused"):
        _convert(run, tmp_path, source="deepspeed")


def test_the_patterns_deepspeed_writes_are_accepted(tmp_path):
    run = _deepspeed(tmp_path, tp=2, model=_info(tp_replicated_parameter_patterns=[r"^b$", r"\d*n", r".*?x$",
                                                                                   r"(?:^|\.)b{1}$"],
                                                 parameter_with_row_parallelism_patterns=["^w$"]))
    _convert(run, tmp_path, source="deepspeed")
    assert ss.open(str(tmp_path / "out")).read("fp32.w").shape == (4, 4)


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


GARBAGE = {  # name -> (stage, tp, model change, optimizer change, what the error says)
    "parallel dimensions a list": (2, 1, _set("checkpoint_parallel_dimensions", [1, 1]), None, "not a dict"),
    "parallel dimensions text": (2, 1, _set("checkpoint_parallel_dimensions", "tp=1"), None, "not a dict"),
    "frozen shape an int": (2, 1, lambda o: o["frozen_param_shapes"].__setitem__("n", 5), None, "shape 5"),
    "frozen shape None": (2, 1, lambda o: o["frozen_param_shapes"].__setitem__("n", None), None, "shape None"),
    "ZeRO-3 inner state dict a list": (3, 1, None, _set("optimizer_state_dict", [1]), "not a dict"),
    "ZeRO-3 state a list": (3, 1, None, lambda o: o["optimizer_state_dict"].__setitem__("state", [1]), "not a dict"),
    "vocabulary size text": (2, 2, _info(vocabulary_parameter_patterns=["^w$"], original_vocab_size="abc"), None,
                             "original_vocab_size is abc"),
    "vocabulary size a list": (2, 2, _info(vocabulary_parameter_patterns=["^w$"], original_vocab_size=[3]), None,
                               r"original_vocab_size is \[3\]"),
    "a pattern an int": (2, 2, _info(tp_replicated_parameter_patterns=[1]), None, "not a list of regexes"),
    "patterns an int": (2, 2, _info(parameter_to_average_patterns=5), None, "not a list of regexes"),
    "sub-parameters an int": (2, 2, _info(parameter_with_sub_params=5), None, "not a list of entries"),
}


@pytest.mark.parametrize("case", sorted(GARBAGE))
def test_garbage_deepspeed_fields_are_checkpoint_errors(case, tmp_path):
    stage, tp, model, optim, says = GARBAGE[case]
    with pytest.raises(CheckpointError, match=rf"_states\.pt.*{says}"):
        _convert(_deepspeed(tmp_path, stage, tp, model, optim), tmp_path, source="deepspeed")


@pytest.mark.parametrize("key, clashes", [("fp32.w", "fp32.w"), ("optim", "optim."), ("model.w.extra", "model.w")])
def test_client_state_named_like_a_converted_value_is_refused(key, clashes, tmp_path):
    """It used to replace the fp32 master weight silently."""
    run = _deepspeed(tmp_path, model=_set(key, 123))
    with pytest.raises(CheckpointError, match=rf"mp_rank_00_model_states.pt: its key '{key}' .* collides with the "
                                              rf"converted value '{clashes}"):
        _convert(run, tmp_path, source="deepspeed")


# --- disk full --------------------------------------------------------------------------------

def test_a_full_disk_is_a_checkpoint_error_naming_the_destination(tmp_path):
    """Under a 64 KiB file size limit (EFBIG, as ENOSPC would be) in a child process: torch's own
    writers (the torch and DCP exports) hide the errno of a failed write, and it must still come out."""
    save_file({"w": torch.randn(256, 256)}, str(tmp_path / "model.safetensors"))
    ss.convert(str(tmp_path / "model.safetensors"), str(tmp_path / "ck"))
    script = textwrap.dedent(f"""
        import resource, statesnap as ss
        from statesnap.errors import CheckpointError
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        d = {str(tmp_path)!r}
        for name, call in [("o1", lambda: ss.convert(d + "/model.safetensors", d + "/o1")),
                           ("o2", lambda: ss.export(d + "/ck", d + "/o2")),
                           ("o3.pt", lambda: ss.export(d + "/ck", d + "/o3.pt", to="torch")),
                           ("o4", lambda: ss.export(d + "/ck", d + "/o4", to="dcp"))]:
            try:
                call()
                print("written", name)
            except CheckpointError as exc:
                print("refused", name, d + "/" + name in str(exc), "full or over its quota" in str(exc))
            except BaseException as exc:
                print("raw", name, type(exc).__name__)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]
    # each names its destination and says what to do about a full disk
    assert done.stdout.split() == [word for name in ("o1", "o2", "o3.pt", "o4")
                                   for word in ("refused", name, "True", "True")]
    assert sorted(os.listdir(tmp_path)) == ["ck", "model.safetensors"]  # nothing half-written left


def test_a_failed_write_of_an_export_leaves_nothing(tmp_path, monkeypatch):
    ss.save({"w": torch.ones(3)}, str(tmp_path / "ck"))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(api.safetensors_io, "_write_file", full)
    with pytest.raises(CheckpointError, match=r"exporting to .*hf failed.*No space left on device "
                                              r"\(the storage is full or over its quota"):
        ss.export(str(tmp_path / "ck"), str(tmp_path / "hf"))
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# --- transform specs and export destinations ---------------------------------------------------

@pytest.mark.parametrize("op", [{"fuse": r"tp_rank_(?P<index>\d+)\.w", "to": ["w"], "cat": 0},
                                {"rename": "w", "to": ["x"]}])
def test_a_list_of_names_is_for_split_only(op, tmp_path):
    torch.save({"tp_rank_00.w": torch.ones(2), "tp_rank_01.w": torch.ones(2)}, tmp_path / "m.pt")
    with pytest.raises(TransformError, match="op #0"):
        _convert(tmp_path / "m.pt", tmp_path, spec={"ops": [op]})


def test_a_deeply_nested_spec_file_is_a_transform_error(tmp_path):
    (tmp_path / "deep.json").write_text('{"ops": ' + "[" * 50000 + "]" * 50000 + "}")
    with pytest.raises(TransformError, match="nested too deeply"):
        ss.convert(str(tmp_path / "nowhere.pt"), str(tmp_path / "out"), spec=str(tmp_path / "deep.json"))


@pytest.mark.parametrize("to, name", [("torch", "out.pt"), ("safetensors", "out.safetensors")])
def test_a_single_file_export_does_not_replace_a_directory(to, name, tmp_path):
    ss.save({"w": torch.ones(3)}, str(tmp_path / "ck"))
    (tmp_path / name).mkdir()
    (tmp_path / name / "keep").write_text("mine")
    with pytest.raises(CheckpointExistsError, match="is a directory"):
        ss.export(str(tmp_path / "ck"), str(tmp_path / name), to=to, overwrite=True)
    assert (tmp_path / name / "keep").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == sorted(["ck", name])


# --- DCP: its pickles are read without running code ---------------------------------------------

class _RunsCode:
    """Pickles as a call of ``os.system``: what a hostile checkpoint would hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_metadata_file_that_names_code_is_refused_and_runs_nothing(tmp_path):
    import pickle

    src, marker = tmp_path / "dcp", tmp_path / "ran"
    src.mkdir()
    (src / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(ss.UnsafeCheckpointError, match=r"\.metadata.*global posix\.system"):
        _convert(src, tmp_path)
    (src / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(CheckpointError, match=r"\.metadata is not DCP metadata"):
        _convert(src, tmp_path)
    (src / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointError, match=r"\.metadata is not readable DCP metadata"):
        _convert(src, tmp_path)
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("eager", [True, False])
def test_a_dcp_value_that_names_code_is_refused_by_name_and_runs_nothing(tmp_path, monkeypatch, eager):
    import torch.distributed.checkpoint as dcp

    from statesnap.convert import dcp as convert_dcp

    src, marker = tmp_path / "dcp", tmp_path / "ran"
    dcp.save({"w": torch.arange(6.0), "plain": {"step": 3, "betas": (0.9, 0.99)}, "evil": _RunsCode(marker)},
             checkpoint_id=str(src), no_dist=True)
    if not eager:  # values are read with the large tensors one by one, not all at first
        monkeypatch.setattr(convert_dcp, "EAGER_BYTES", -1)
    with pytest.raises(ss.UnsafeCheckpointError, match=r"__0_0\.distcp: value 'evil'.*posix\.system"):
        _convert(src, tmp_path)
    assert not marker.exists()
    dcp.save({"w": torch.arange(6.0), "plain": {"step": 3, "betas": (0.9, 0.99)}}, checkpoint_id=str(src),
             no_dist=True)
    _convert(src, tmp_path, overwrite=True)
    reader = ss.open(tmp_path / "out")
    assert reader.read("plain.step") == 3 and reader.read("plain.betas") == (0.9, 0.99)
    assert torch.equal(reader.read("w"), torch.arange(6.0))


def _pickle_ops(*parts: bytes) -> bytes:
    return b"\x80\x02" + b"".join(parts) + b"."


def _text(value: str) -> bytes:
    import pickle
    import struct

    data = value.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("case", ["function", "class", "enum member"])
def test_dcp_metadata_gives_state_to_no_shared_object(tmp_path, case):
    """pickle's BUILD never asks find_class: on an admitted function (``_get_layout``, whose
    cache every torch.load of a layout reads), a class (``PurePosixPath``: every path of the
    process) or an enum member, it would change them for the whole process."""
    import pathlib
    import pickle

    target = {"function": _global("torch.serialization", "_get_layout"),
              "class": _global("pathlib", "PosixPath"),
              "enum member": _global("torch.distributed.checkpoint.planner", "WriteItemType")
              + b"K\x01" + pickle.TUPLE1 + pickle.REDUCE}[case]
    state = {"function": pickle.EMPTY_DICT + _text("cache") + pickle.EMPTY_DICT + pickle.SETITEM,
             "class": pickle.NONE + pickle.EMPTY_DICT + _text("__str__") + _global("torch.serialization", "_get_layout")
             + pickle.SETITEM + pickle.TUPLE2,
             "enum member": pickle.EMPTY_DICT + _text("_value_") + b"Kc" + pickle.SETITEM}[case]
    src = tmp_path / "dcp"
    src.mkdir()
    (src / ".metadata").write_bytes(_pickle_ops(target, state, pickle.BUILD, pickle.POP, pickle.EMPTY_DICT))
    with pytest.raises(ss.UnsafeCheckpointError, match=r"\.metadata: refused to unpickle: state given to"):
        _convert(src, tmp_path)
    from torch.distributed.checkpoint.planner import WriteItemType
    assert torch.serialization._get_layout("torch.strided") is torch.strided
    assert str(pathlib.PurePosixPath("/a")) == "/a" and WriteItemType(1).value == 1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_values_of_numpy_and_metadata_of_older_torch_convert(tmp_path):
    """numpy arrays (Megatron's RNG state holds them) are data; DCP of torch 2.0-2.2 pickled
    its TensorProperties from the sharded tensor's module."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import metadata as sharded

    src = tmp_path / "dcp"
    dcp.save({"w": torch.arange(6.0), "arr": np.arange(3)}, checkpoint_id=str(src), no_dist=True)
    metadata = pickle.loads((src / ".metadata").read_bytes())
    for item in metadata.state_dict_metadata.values():
        if hasattr(item, "properties"):
            old = item.properties
            item.properties = sharded.TensorProperties(dtype=old.dtype, layout=old.layout, requires_grad=False,
                                                       memory_format=old.memory_format, pin_memory=False)
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    assert b"_shard.sharded_tensor.metadata" in (src / ".metadata").read_bytes()
    _convert(src, tmp_path, allow_pickle=True)  # a numpy array is no plain data of statesnap's
    reader = ss.open(tmp_path / "out", allow_pickle=True)
    assert torch.equal(reader.read("w"), torch.arange(6.0)) and np.array_equal(reader.read("arr"), np.arange(3))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("how", ["absolute", "parent", "fifo"])
def test_dcp_data_files_must_be_regular_files_inside_the_checkpoint(tmp_path, how):
    import pickle

    import torch.distributed.checkpoint as dcp

    elsewhere, src = tmp_path / "elsewhere", tmp_path / "dcp"
    dcp.save({"w": torch.arange(3.0), "token": "secret"}, checkpoint_id=str(elsewhere), no_dist=True)
    metadata = pickle.loads((elsewhere / ".metadata").read_bytes())
    src.mkdir()
    for info in metadata.storage_data.values():
        if how == "fifo":
            if not (src / info.relative_path).exists():
                os.mkfifo(src / info.relative_path)
        else:
            info.relative_path = str(elsewhere / info.relative_path) if how == "absolute" else \
                os.path.join("..", "elsewhere", info.relative_path)
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    words = "is a FIFO, not the regular file" if how == "fifo" else "which is not a path inside"
    with pytest.raises(CheckpointError, match=words):
        _convert(src, tmp_path)
    assert not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_metadata_of_tuples_nested_to_hash_forever_is_refused_at_once(tmp_path):
    """``t = (t', t')`` nested 64 deep is a few hundred bytes; as a dict key, hashing it never ends."""
    src = tmp_path / "dcp"
    src.mkdir()
    (src / ".metadata").write_bytes(_nested_key_pickle(64))
    started = time.perf_counter()
    with pytest.raises(ss.UnsafeCheckpointError, match="tuples nested deeper than 16"):
        _convert(src, tmp_path)
    assert time.perf_counter() - started < 10


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("chunks, says", [([], r"\[0:3, 0:4\] is in no piece"),
                                          ([((0, 0), (3, 4)), ((2, 0), (1, 4))], "overlap"),
                                          ([((0, 0), (3, 5))], "chunk 0 lies outside it")])
def test_dcp_chunks_that_do_not_cover_a_tensor_exactly_are_refused(tmp_path, chunks, says):
    """A tensor they left a hole in was converted with whatever memory held there."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    src = tmp_path / "dcp"
    dcp.save({"w": torch.arange(12.0).reshape(3, 4)}, checkpoint_id=str(src), no_dist=True)
    metadata = pickle.loads((src / ".metadata").read_bytes())
    metadata.state_dict_metadata["w"].chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks]
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"\.metadata: tensor 'w' of shape \[3, 4\]: .*" + says):
        _convert(src, tmp_path)


def _nested_key_pickle(depth: int) -> bytes:
    """``{t: None}`` with ``t = (t', t')`` ``depth`` deep, shared through the memo."""
    import pickle

    ops = [pickle.EMPTY_DICT, pickle.NONE]
    for _ in range(depth):
        ops += [pickle.MEMOIZE, pickle.DUP, pickle.TUPLE2]
    return _pickle_ops(*ops, pickle.NONE, pickle.SETITEM)


@pytest.mark.parametrize("depth, refused", [(64, True), (16, False)])
def test_a_torch_save_file_of_tuples_nested_to_hash_forever_is_refused_at_once(tmp_path, depth, refused):
    torch.save({"a": 1}, tmp_path / "good.pt")
    with zipfile.ZipFile(tmp_path / "good.pt") as source, zipfile.ZipFile(tmp_path / "bad.pt", "w") as out:
        for name in source.namelist():
            out.writestr(name, _nested_key_pickle(depth) if name.endswith("data.pkl") else source.read(name))
    started = time.perf_counter()
    if refused:
        with pytest.raises(ss.UnsafeCheckpointError, match="bad.pt: refused to unpickle: tuples nested deeper than 16"):
            _convert(tmp_path / "bad.pt", tmp_path)
    else:  # as deep as admitted: 2^16 hashes, quick; its key is no name a checkpoint can hold
        with pytest.raises(CheckpointError):
            _convert(tmp_path / "bad.pt", tmp_path)
    assert time.perf_counter() - started < 20


def test_an_allowed_global_named_but_never_called_is_refused(tmp_path):
    """A pickle that only names an admitted global (here ``builtins.bytes``, admitted for ``b""``)
    gave the stand-in function itself back as a value: code, not data."""
    import pickle

    torch.save({"a": 1}, tmp_path / "good.pt")
    with zipfile.ZipFile(tmp_path / "good.pt") as source, zipfile.ZipFile(tmp_path / "bad.pt", "w") as out:
        for name in source.namelist():
            data = _pickle_ops(pickle.GLOBAL + b"builtins\nbytes\n")
            out.writestr(name, data if name.endswith("data.pkl") else source.read(name))
    with pytest.raises(ss.UnsafeCheckpointError, match="bad.pt: refused to unpickle: _empty_bytes is code, not a value"):
        unpickler.load_from(str(tmp_path / "bad.pt"), str(tmp_path / "bad.pt"))


def test_an_allowed_global_as_a_key_is_refused_too(tmp_path):
    """Keys are values too: the stand-in passed there unrefused. (Sets do not reach this far: the
    weights-only unpickler refuses their opcodes.)"""
    import pickle

    body = pickle.EMPTY_DICT + pickle.GLOBAL + b"builtins\nbytes\n" + pickle.NONE + pickle.SETITEM
    torch.save({"a": 1}, tmp_path / "good.pt")
    with zipfile.ZipFile(tmp_path / "good.pt") as source, zipfile.ZipFile(tmp_path / "bad.pt", "w") as out:
        for entry in source.namelist():
            out.writestr(entry, _pickle_ops(body) if entry.endswith("data.pkl") else source.read(entry))
    with pytest.raises(ss.UnsafeCheckpointError, match="_empty_bytes is code, not a value"):
        unpickler.load_from(str(tmp_path / "bad.pt"), str(tmp_path / "bad.pt"))


# --- torch.save archives with compressed members ----------------------------------------------

@pytest.mark.parametrize("member", ["data/0", "data.pkl"])
def test_a_torch_save_archive_with_a_compressed_member_is_refused_by_name(tmp_path, member):
    """torch.load(mmap=True) reads a tensor's bytes at the member's place in the file: a storage
    deflated by a repacking (or a hostile) zip converted as its compressed bytes, garbage values
    without a word. Without mmap a deflated member inflates to what it declares (1 MB of zlib'd
    zeros is 1 GB). torch.save writes every member stored, so a compressed one is refused."""
    torch.save({"w": torch.arange(10.0)}, tmp_path / "good.pt")
    with zipfile.ZipFile(tmp_path / "good.pt") as source, zipfile.ZipFile(tmp_path / "bad.pt", "w") as out:
        for name in source.namelist():
            deflate = name.endswith("/" + member)
            out.writestr(name, source.read(name), zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED)
    says = f"bad.pt: its archive member '.*/{member}' is compressed"
    with pytest.raises(ss.CorruptCheckpointError, match=says):
        _convert(tmp_path / "bad.pt", tmp_path)
    with pytest.raises(ss.CorruptCheckpointError, match=says):  # DeepSpeed's and Megatron's files
        unpickler.load(str(tmp_path / "bad.pt"))
    assert not os.path.exists(tmp_path / "out")
    _convert(tmp_path / "good.pt", tmp_path)
    assert torch.equal(ss.open(str(tmp_path / "out")).read("w"), torch.arange(10.0))


# --- damaged bytes in torch.save archives and DCP chunks ---------------------------------------

def _flip_in_member(path, member_suffix: str, at: int = 40) -> None:
    """Flip one bit ``at`` bytes into the first zip member of ``path`` named ``...member_suffix``."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(member_suffix))
    raw = bytearray(path.read_bytes())
    name_len, extra_len = np.frombuffer(bytes(raw[info.header_offset + 26:info.header_offset + 30]), "<u2")
    raw[info.header_offset + 30 + int(name_len) + int(extra_len) + at] ^= 0x10
    path.write_bytes(bytes(raw))


def test_a_torch_save_file_with_a_damaged_tensor_is_refused_naming_the_file_member_and_tensor(tmp_path):
    """torch.load checks no CRC-32: a flipped bit in a tensor's bytes converted into a checkpoint
    with fresh checksums of its own, which then verified as good."""
    state = {"w": torch.arange(256.0), "b": torch.ones(64)}
    torch.save(state, tmp_path / "bad.pt")
    with zipfile.ZipFile(tmp_path / "bad.pt") as archive:
        first = sorted(i.filename for i in archive.infolist() if "/data/" in i.filename)[0].rsplit("/", 1)[1]
    _flip_in_member(tmp_path / "bad.pt", f"data/{first}")
    says = r"bad.pt is damaged: the bytes of its archive member '.*/data/\d+' \(the bytes of '[wb]'\) differ"
    with pytest.raises(ss.CorruptCheckpointError, match=says):
        _convert(tmp_path / "bad.pt", tmp_path)
    with pytest.raises(ss.CorruptCheckpointError, match="bad.pt is damaged"):  # DeepSpeed's and Megatron's files
        unpickler.load(str(tmp_path / "bad.pt"))
    assert not os.path.exists(tmp_path / "out")
    torch.save(state, tmp_path / "good.pt")
    _convert(tmp_path / "good.pt", tmp_path)
    assert torch.equal(ss.open(str(tmp_path / "out")).read("w"), state["w"])


@pytest.mark.parametrize("member", ["data.pkl", "byteorder"])
def test_damage_to_a_torch_save_file_s_pickle_or_records_is_a_corrupt_checkpoint_error(tmp_path, member):
    """A damaged data.pkl escaped as zipfile's BadZipFile from the nesting check, and a damaged
    byte order record as a generic 'not a readable torch.save file'."""
    torch.save({"w": torch.arange(256.0), "s": torch.randn(4, 4).to_sparse()}, tmp_path / "bad.pt")
    _flip_in_member(tmp_path / "bad.pt", member, at=1)
    with pytest.raises(ss.CorruptCheckpointError, match=rf"bad.pt is damaged: .*{member}"):
        _convert(tmp_path / "bad.pt", tmp_path)
    with pytest.raises(ss.CorruptCheckpointError, match=rf"bad.pt is damaged: .*{member}"):
        unpickler.load(str(tmp_path / "bad.pt"))


def test_a_torch_save_file_with_a_garbled_zip_directory_is_a_checkpoint_error(tmp_path):
    """Flipped bytes of the archive's directory escaped as zipfile's own errors (an end record
    claiming several disks), or loaded nothing into a tensor (a member marked as a directory,
    which PyTorch's reader skips: its tensor held whatever memory it was given)."""
    torch.save({"w": torch.arange(15.0).reshape(5, 3)}, tmp_path / "good.pt")
    raw = (tmp_path / "good.pt").read_bytes()
    locator = raw.rindex(b"PK\x06\x07")  # the zip64 end of central directory locator torch.save writes
    with zipfile.ZipFile(tmp_path / "good.pt") as archive:
        data = next(i for i in archive.infolist() if i.filename.endswith("data/0"))
    entries = [i for i in range(len(raw)) if raw.startswith(b"PK\x01\x02", i)]  # the directory's records
    name_of = {i: raw[i + 46:i + 46 + int.from_bytes(raw[i + 28:i + 30], "little")].decode() for i in entries}
    entry = next(i for i in entries if name_of[i] == data.filename)
    cases = {"several disks": (locator + 4, 0x01, "bad.pt"),
             "a directory": (entry + 38, 0x10, f"bad.pt is damaged: its archive member '{data.filename}' is marked as a "
                                               "directory")}
    for what, (at, bit, says) in cases.items():
        damaged = bytearray(raw)
        damaged[at] ^= bit
        (tmp_path / "bad.pt").write_bytes(bytes(damaged))
        with pytest.raises(ss.CheckpointError, match=says):
            _convert(tmp_path / "bad.pt", tmp_path)
        assert not os.path.exists(tmp_path / "out"), what


def test_files_written_without_crc32s_convert_exactly(tmp_path):
    """torch.serialization.set_crc32_options(False) writes 0 for every member's CRC-32: nothing
    to check, and not damage (torch.load reads such files)."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(256.0), "big": torch.randn((1 << 20) // 4 + 8)}
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(state, tmp_path / "a.pt")
        with pytest.warns(UserWarning):
            dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    finally:
        torch.serialization.set_crc32_options(True)
    for src, kind in ((tmp_path / "a.pt", "torch"), (tmp_path / "dcp", "dcp")):
        ss.convert(str(src), str(tmp_path / f"from-{kind}"), source=kind)
        reader = ss.open(str(tmp_path / f"from-{kind}"))
        assert all(torch.equal(reader.read(name), value) for name, value in state.items())


@pytest.mark.parametrize("numel", [4096, (1 << 20) // 4 + 1024], ids=["small", "read in place"])
def test_a_dcp_chunk_with_a_damaged_tensor_is_refused_naming_the_file_and_tensor(tmp_path, numel):
    """Small tensors come through dcp.load, larger ones are read in place (convert/dcp_chunks.py):
    both check each chunk's CRC-32, which neither dcp.load nor torch.load does."""
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):
        dcp.save({"w": torch.full((numel,), 1.0)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    chunk = next((tmp_path / "dcp").glob("*.distcp"))
    _flip_in_member(chunk, "data/0", at=100)
    with pytest.raises(ss.CorruptCheckpointError,
                       match=rf"{chunk.name}: the chunk of 'w' at offsets \[0\] .*damaged.*CRC-32"):
        _convert(tmp_path / "dcp", tmp_path, source="dcp")
    assert not os.path.exists(tmp_path / "out")


# --- safetensors indexes ----------------------------------------------------------------------

@pytest.mark.parametrize("index, says", [
    ('{"weight_map":' + "[" * 100_000 + "]" * 100_000 + "}", "its JSON is nested too deeply"),
    ('{"weight_map": {"a": "model-1.safetensors", "a": "model-2.safetensors"}}', "names given twice: 'a'")],
    ids=["nested", "listed twice"])
def test_a_safetensors_index_nested_too_deeply_or_naming_a_tensor_twice_is_refused(tmp_path, index, says):
    """JSON nested 100,000 deep raised a RecursionError out of ss.convert; a tensor listed for two
    shards was read from the one named last (json keeps the last key), as each shard's own
    header refuses a name given twice."""
    src = tmp_path / "src"
    src.mkdir()
    save_file({"a": torch.zeros(2)}, str(src / "model-1.safetensors"))
    save_file({"a": torch.ones(2)}, str(src / "model-2.safetensors"))
    (src / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=f"model.safetensors.index.json is not a safetensors index.*{says}"):
        _convert(src, tmp_path, source="safetensors")


# --- destinations that are the source, lie inside it or hold it -------------------------------

@pytest.mark.parametrize("where", ["itself", "inside", "parent"])
def test_an_export_never_writes_over_the_checkpoint_it_reads(tmp_path, where):
    """With overwrite=True an export onto its own checkpoint, or onto the directory holding it,
    replaced that directory as a whole: the checkpoint being exported was deleted."""
    ck = tmp_path / "out" / "ck"
    ss.save({"w": torch.ones(3)}, str(ck))
    (tmp_path / "out" / "notes.txt").write_text("mine")
    dst = {"itself": ck, "inside": ck / "hf", "parent": tmp_path / "out"}[where]
    for to in ("safetensors", "dcp"):
        with pytest.raises(CheckpointError, match="the destination is the source, lies inside it or holds it"):
            ss.export(str(ck), str(dst), to=to, overwrite=True)
    assert torch.equal(ss.open(str(ck)).read("w"), torch.ones(3))
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_a_conversion_into_its_own_source_is_refused(tmp_path):
    """A checkpoint converted into its source directory became part of the source: the next
    conversion of it read statesnap's data files as torch.save files."""
    src = tmp_path / "ranks"
    src.mkdir()
    torch.save({"w": torch.ones(2)}, src / "tp_rank_00.pt")
    for dst in (src / "converted", src):
        with pytest.raises(CheckpointError, match="the destination is the source, lies inside it or holds it"):
            ss.convert(str(src), str(dst))
    assert os.listdir(src) == ["tp_rank_00.pt"]
    ss.convert(str(src / "tp_rank_00.pt"), str(tmp_path / "ck"))  # beside it: fine
    assert torch.equal(ss.open(str(tmp_path / "ck")).read("w"), torch.ones(2))


def test_a_directory_of_torch_save_files_giving_one_name_twice_is_refused(tmp_path):
    """Merged with dict.update, the second file's value replaced the first's without a word."""
    for files in ({"model.bin": {"w": torch.ones(2)}, "model.pt": {"w": torch.zeros(2)}},
                  {"a.pt": {"b": {"c": torch.ones(2)}}, "a.b.pt": {"c": torch.zeros(2)}}):
        src = tmp_path / f"src{len(os.listdir(tmp_path))}"
        src.mkdir()
        for name, value in files.items():
            torch.save(value, src / name)
        with pytest.raises(CheckpointError, match=r"\S+ and \S+ under .* both give a value named"):
            ss.convert(str(src), str(tmp_path / "ck"))
        assert not (tmp_path / "ck").exists()


def test_a_tensor_named_as_the_safetensors_metadata_is_skipped_by_name(tmp_path):
    """Written under the header's own metadata key, it made a file safetensors cannot read, which
    statesnap then read back without the tensor."""
    ss.save({"__metadata__": torch.ones(2), "x": torch.zeros(2)}, str(tmp_path / "ck"))
    info = ss.export(str(tmp_path / "ck"), str(tmp_path / "hf"))
    assert [s.split(" ")[0] for s in info.skipped] == ["__metadata__"] and info.tensors == 1
    assert set(load_file(str(tmp_path / "hf" / "model.safetensors"))) == {"x"}
    header = json.dumps({"__metadata__": ["not", "strings"], "x": {"dtype": "F32", "shape": [1],
                                                                   "data_offsets": [0, 4]}}).encode()
    (tmp_path / "bad.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    with pytest.raises(CheckpointError, match="its __metadata__ is not a map of strings to strings"):
        ss.convert(str(tmp_path / "bad.safetensors"), str(tmp_path / "ck2"))


def test_damage_in_a_small_dcp_tensor_s_pickle_is_named_by_its_file_and_tensor(tmp_path):
    """A byte flipped in the pickle of a small tensor's DCP chunk fails DCP's own load with an
    error that names no file (torch.load's weights_only hint): the chunk's CRC-32 names the
    file, the member and the tensor, as the same damage in a torch.save file is named."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    state = {f"t{i}": torch.full((4,), float(i)) for i in range(6)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp", single_file_per_rank=False),
             no_dist=True)
    info = next(v for k, v in FileSystemReader(tmp_path / "dcp").read_metadata().storage_data.items()
                if k.fqn == "t3")
    path = tmp_path / "dcp" / info.relative_path
    raw = bytearray(path.read_bytes())
    raw[info.offset + bytes(raw[info.offset:info.offset + info.length]).find(b"_rebuild_tensor_v2") + 3] ^= 0x20
    path.write_bytes(bytes(raw))
    with pytest.raises(ss.CorruptCheckpointError, match=rf"{info.relative_path}: the chunk of 't3'.*CRC-32"):
        ss.convert(tmp_path / "dcp", tmp_path / "out")
