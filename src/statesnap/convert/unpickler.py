"""Read DeepSpeed's ``.pt`` files without DeepSpeed and without running code from them.

DeepSpeed pickles a few of its own classes into its checkpoints (the loss scaler object, the
ZeRO stage enum, the ``fragment_address`` records of ``param_slice_mappings``), so
``torch.load(weights_only=True)`` refuses its optimizer files and ``weights_only=False`` would run
whatever a file names (and needs DeepSpeed importable). Here PyTorch's weights-only unpickler runs
with exactly those names admitted (``torch.serialization.safe_globals`` with ``(stand-in, name)``
pairs), each bound to an inert stand-in defined in this module: the stand-ins only hold data, so
a file naming ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` gets a dict of the scaler's
attributes and no DeepSpeed code runs, or is even imported. Any other global (``os.system``, a
training script's class) is still refused, with :class:`UnsafeCheckpointError` naming the file and
the global. After loading, the stand-ins are replaced by plain data (see :func:`load`).
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import pickletools
import threading
import zipfile
from collections import OrderedDict, namedtuple
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from ..storage.local import open_source
from .tree import check_graph
from .zip_members import check_member_crcs, crcs_recorded, looks_like_zip, read_member, refuse_compressed_members

FragmentAddress = namedtuple("FragmentAddress", ["numel", "start"])
FragmentAddress.__doc__ = ("DeepSpeed's ``fragment_address``: a parameter's ``numel`` elements at ``start`` "
                           "of a flat partition.")


class _ScalerStandIn(dict):
    """Receives a pickled loss scaler's attributes (BUILD state) as dict items; nothing else."""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"a loss scaler's state must be a dict of attributes, got {type(state)}")
        self.update(state)


class _FragmentStandIn:
    """Receives a pickled ``fragment_address`` dataclass's two fields."""

    __slots__ = ("numel", "start")

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != {"numel", "start"} or \
                not all(type(v) is int and v >= 0 for v in state.values()):
            raise pickle.UnpicklingError(f"fragment_address state must be {{numel: int >= 0, start: int >= 0}}, got {state!r}")
        self.numel, self.start = state["numel"], state["start"]


def _zero_stage(value: Any) -> int:
    """``ZeroStageEnum(value)`` as the plain int it is (the enum subclasses int)."""
    if type(value) is not int or not 0 <= value <= 3:
        raise pickle.UnpicklingError(f"ZeroStageEnum value must be an int 0..3, got {value!r}")
    return value


# The globals DeepSpeed 0.19 writes into its checkpoints (found by scanning every pickle its ZeRO 1-3,
# bf16/fp16, pipeline, AutoTP and ds_to_universal outputs hold), each with its stand-in.
STAND_INS = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": _ScalerStandIn,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": _ScalerStandIn,
    "deepspeed.runtime.zero.config.ZeroStageEnum": _zero_stage,
    "deepspeed.utils.tensor_fragment.fragment_address": _FragmentStandIn,
    "argparse.Namespace": _ScalerStandIn,  # Megatron-LM's args (common.pt, model_optim_rng.pt): a dict
}
# numpy arrays, as Megatron-LM's rng_state holds numpy's RNG state. A pickled array is
# ``_reconstruct(numpy.ndarray, (0,), b"b")`` (an empty array), then BUILD with (version, shape,
# dtype, fortran order, the data); a dtype is ``numpy.dtype("u4", False, True)``, then BUILD with
# its byte order. Only that is admitted, through the stand-ins below: numpy.ndarray's own
# constructor (NEWOBJ/REDUCE on the class) would allocate any shape, uninitialised, from a few
# bytes; ``_reconstruct`` with another shape likewise; an object array's BUILD with too short a
# list of elements crashes the process, and a dtype's BUILD can give a u4 a 1000-byte subarray
# (reads past the data). Files from numpy 1.x name numpy.core..., from 2.x numpy._core...
_RECONSTRUCT = np.ndarray.__reduce__(np.zeros(0))[0]
_DTYPE_KINDS = "biufcO"  # bool, integers, floats, complex, object (its elements go through this unpickler)


class _Array(np.ndarray):
    """What a file's ``numpy.ndarray`` names: an array only ``_reconstruct`` makes and only a
    BUILD with data of exactly its size fills; turned into a plain ``np.ndarray`` after loading."""

    def __new__(cls, *args, **kwargs):
        raise pickle.UnpicklingError("numpy.ndarray(...) called directly (it would allocate an uninitialised "
                                     "array of any size); numpy pickles arrays with _reconstruct")

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 5 and state[0] == 1 and isinstance(state[1], tuple)
                and all(type(n) is int and n >= 0 for n in state[1]) and isinstance(state[2], _Dtype)
                and state[2].value is not None and isinstance(state[3], bool)):
            raise pickle.UnpicklingError(f"a numpy array's state must be (1, shape, dtype, fortran, data), got "
                                         f"{str(state)[:200]}")
        _, shape, dtype, fortran, data = state
        count = math.prod(shape)
        if dtype.value.hasobject:
            ok = isinstance(data, list) and len(data) == count
        else:
            ok = isinstance(data, bytes) and len(data) == count * dtype.value.itemsize
        if not ok:
            size = len(data) if isinstance(data, (bytes, list)) else "?"
            raise pickle.UnpicklingError(f"a numpy array of shape {list(shape)} and dtype {dtype.value} holds "
                                         f"{type(data).__name__} data of length {size}")
        super().__setstate__((1, shape, dtype.value, fortran, data))


def _reconstruct(subtype: Any, shape: Any, typecode: Any) -> _Array:
    """numpy's ``_reconstruct`` as its pickles call it: an empty array for a BUILD to fill."""
    if subtype is not _Array or shape != (0,):
        raise pickle.UnpicklingError(f"numpy _reconstruct({subtype!r}, {shape!r}, ...): numpy pickles arrays as "
                                     "_reconstruct(numpy.ndarray, (0,), ...)")
    return _RECONSTRUCT(_Array, (0,), b"b")


class _Dtype:
    """What a file's ``numpy.dtype`` names: a plain numeric, bool or object dtype by its code
    ("u4"), whose BUILD may set the byte order and nothing else."""

    value = None  # none yet: made by NEWOBJ rather than by numpy.dtype(code)

    def __init__(self, code: Any, align: Any = False, copy: Any = True):
        try:
            value = np.dtype(code) if isinstance(code, str) and len(code) <= 8 else None
        except (TypeError, ValueError):
            value = None
        if value is None or value.kind not in _DTYPE_KINDS or value.fields or value.subdtype or align:
            raise pickle.UnpicklingError(f"numpy dtype {code!r}: only plain numeric, bool and object dtypes are read")
        self.value = value

    def __setstate__(self, state: Any) -> None:
        if (self.value is None or not isinstance(state, tuple) or len(state) != 8
                or state[1] not in ("<", ">", "|", "=") or state[2:] != (None, None, None, -1, -1, state[7])
                or type(state[7]) is not int):
            raise pickle.UnpicklingError(f"a numpy dtype's state must give its byte order only, got {str(state)[:200]}")
        self.value = self.value.newbyteorder(state[1]) if state[1] in "<>" else self.value


def _empty_bytes(*args: Any) -> bytes:
    """``b""`` as pickle protocol 2 writes it, a call of ``bytes`` with no argument (torch.save,
    and so DCP's plain values: a statesnap export of one). Any argument is refused: ``bytes(n)``
    would allocate n bytes from a few in the file."""
    if args:
        raise pickle.UnpicklingError(f"bytes{args!r:.80}: only bytes() (an empty value) is read")
    return b""


NUMPY_GLOBALS = [(_Array, "numpy.ndarray"), (_Dtype, "numpy.dtype"),
                 (_reconstruct, "numpy._core.multiarray._reconstruct"),
                 (_reconstruct, "numpy.core.multiarray._reconstruct")]
_ALLOWED = ([(stand_in, name) for name, stand_in in STAND_INS.items()] + NUMPY_GLOBALS
            + [(_empty_bytes, "builtins.bytes")])
# safe_globals adds to and removes from one process-wide set; two loads overlapping in threads
# would remove each other's entries, so loads take turns.
_LOCK = threading.Lock()


def load(path: str) -> Any:
    """The object in the DeepSpeed ``torch.save`` file at ``path``, as tensors and plain data.

    DeepSpeed's classes come back as plain data: a loss scaler as a dict of its attributes
    (``cur_scale``, ``dynamic``, ...), ``ZeroStageEnum`` as an int and ``fragment_address`` as a
    :data:`FragmentAddress` ``(numel, start)`` named tuple. Raises :class:`UnsafeCheckpointError`
    for any other global and :class:`CheckpointError` for a missing, truncated or garbled file."""
    try:
        with open_source(path) as f:  # a FIFO would block torch.load: refused here
            mmap = looks_like_zip(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    return load_from(path, path, mmap)


def load_from(source, where: str, mmap: bool = False) -> Any:
    """As :func:`load`, from ``source`` (a path or a file object); errors name ``where``."""
    refuse_compressed_members(source, where)
    problem = nesting_problem_of(source, where)
    if problem is not None:
        raise UnsafeCheckpointError(f"{where}: refused to unpickle: {problem}")
    try:
        with _LOCK, torch.serialization.safe_globals(_ALLOWED):
            obj = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
        check_member_crcs(source, where, obj)
        check_graph(obj, where)  # before _plain walks it as a tree
        return _plain(obj)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{where}: refused to unpickle: {refusal_reason(exc)}. statesnap admits only tensors, plain data, numpy "
            f"arrays and the records {', '.join(STAND_INS)} (as inert data), and never runs code from a "
            "checkpoint") from None
    except Exception as exc:
        check_member_crcs(source, where, None)  # (damage, where that is why)
        raise CheckpointError(f"{where} is not a readable torch.save file (truncated or damaged?): "
                              f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


MAX_TUPLE_NESTING = 16
_MADE_NESTED = {"TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "FROZENSET"}
_KEEPS_TOP = {"BUILD", "SETITEM", "SETITEMS", "APPEND", "APPENDS", "ADDITEMS", "MEMOIZE", "DUP"}


def nesting_problem(stream) -> str | None:
    """Why the pickles at the start of ``stream`` (a binary file object, one pickle or several
    back to back) may not be unpickled: tuples nested deeper than :data:`MAX_TUPLE_NESTING`.
    ``t = (t', t')`` through the memo, 64 deep, is a few hundred bytes; as a dict key, unpickling
    it hashes 2^64 tuples, and written out as a name it would be as long. Read from the opcodes
    alone, before any unpickler runs; what they do not parse is left to the unpickler."""
    while True:  # genops stops at each pickle's STOP
        stack: list = []  # per item, how deep its tuples nest (None: a mark)
        memo: dict = {}
        try:
            for op, arg, _ in pickletools.genops(stream):
                popped = _pop(stack, op.stack_before)
                depth = 0
                if op.name in _MADE_NESTED:
                    depth = 1 + max(popped, default=0)
                    if depth > MAX_TUPLE_NESTING:
                        return f"tuples nested deeper than {MAX_TUPLE_NESTING}"
                elif op.name in _KEEPS_TOP:
                    depth = popped[0]
                elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                    depth = memo.get(arg, 0)
                if op.name in ("PUT", "BINPUT", "LONG_BINPUT") and stack:
                    memo[arg] = stack[-1]
                elif op.name == "MEMOIZE":
                    memo[len(memo)] = depth
                stack += [None if item is pickletools.markobject else depth for item in op.stack_after]
        except (ValueError, IndexError):  # the end of the stream, or no pickle: a legacy file's raw data
            return None


def _pop(stack: list, before: list) -> list:
    """The depths an opcode takes off ``stack`` (those above its mark, for a mark and a slice)."""
    popped = []
    count = len(before)
    if count >= 2 and before[-1] is pickletools.stackslice:
        while stack and stack[-1] is not None:
            popped.append(stack.pop())
        if not stack:
            raise IndexError("no mark")
        stack.pop()
        count -= 2
    for _ in range(count):
        popped.append(stack.pop())  # IndexError on a stack too short: left to the unpickler
    return popped[::-1]


def nesting_problem_of(source, where: str) -> str | None:
    """:func:`nesting_problem` of a ``torch.save`` file or stream (its members stored, as
    ``refuse_compressed_members`` checks first): its archive's ``data.pkl``, or the pickles a
    legacy file starts with. A ``data.pkl`` whose bytes differ from its CRC-32 is a
    :class:`CorruptCheckpointError` naming ``where``."""
    with contextlib.ExitStack() as stack:
        if isinstance(source, (str, os.PathLike)):
            source = stack.enter_context(open(source, "rb"))
        start = source.tell()
        stack.callback(source.seek, start)
        if looks_like_zip(source):
            try:
                members = zipfile.ZipFile(source).infolist()
                pickled = [i for i in members if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
                data = read_member(source, 0, pickled[0], crcs_recorded(members)) if pickled else None
            except (zipfile.BadZipFile, OSError, ValueError) as exc:  # (a directory garbled: names not UTF-8, ...)
                raise CorruptCheckpointError(f"{where} is damaged: {type(exc).__name__}: {exc}; restore the file from "
                                             "another copy") from None
            return nesting_problem(io.BytesIO(data)) if data is not None else None
        source.seek(start)
        return nesting_problem(source)


def refusal_reason(exc: Exception) -> str:
    """The line of torch's message that says what was refused: the global it names, or what a
    stand-in found wrong with its arguments (torch wraps both in advice to pass weights_only=False)."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [line.strip() for line in text.splitlines()
             if line.strip() and not line.strip().startswith(("Weights only load failed", "Check the documentation"))]
    return (lines or [type(exc).__name__])[0].split(" was not an allowed global")[0]


def _plain(obj: Any) -> Any:
    """``obj`` with the stand-ins replaced by plain dicts and named tuples (containers rebuilt as
    their own type; tensors untouched)."""
    if isinstance(obj, _ScalerStandIn):
        return {key: _plain(value) for key, value in obj.items()}
    if isinstance(obj, _Array):
        return obj.view(np.ndarray)
    if isinstance(obj, _Dtype):
        if obj.value is None:
            raise pickle.UnpicklingError("a numpy dtype made without its code")
        return obj.value
    if isinstance(obj, _FragmentStandIn):
        if not hasattr(obj, "numel"):  # created without the BUILD that gives it its two fields
            raise pickle.UnpicklingError("a fragment_address without its numel and start")
        return FragmentAddress(obj.numel, obj.start)
    if isinstance(obj, dict):
        out = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for key, value in obj.items():
            out[_plain(key)] = _plain(value)
        return out
    if isinstance(obj, list):
        return [_plain(value) for value in obj]
    if type(obj) is tuple:
        return tuple(_plain(value) for value in obj)
    if callable(obj):
        # (a pickle naming an allowed global without calling it: the stand-in itself, never data)
        raise pickle.UnpicklingError(f"{getattr(obj, '__name__', type(obj).__name__)} is code, not a value")
    return obj
