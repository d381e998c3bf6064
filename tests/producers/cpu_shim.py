"""Test-only shims that let megatron-core 0.16 write real checkpoints on a CPU-only machine (gloo).

megatron-core assumes CUDA in a few places that have nothing to do with the checkpoint layout:
``torch.cuda.synchronize`` before writing, flag tensors on ``torch.cuda.current_device()``,
``device='cuda'`` factory calls and a ``Tensor.type()`` check in the distributed optimizer, and the
CUDA RNG tracker's ``fork``. These shims turn exactly those into CPU no-ops, so the files are still
written by megatron-core's own code (see research/producers.md section 4). Never import this
outside the producers.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode


def _fix(device):
    """Any CUDA device (or a bare device index, which torch reads as CUDA) becomes the CPU."""
    if isinstance(device, int) or (isinstance(device, (str, torch.device)) and "cuda" in str(device)):
        return "cpu"
    return device


class CudaToCpu(TorchFunctionMode):
    """Factory calls with ``device='cuda'`` make CPU tensors, ``Tensor.cuda()`` is the identity and
    ``Tensor.type()`` reports ``torch.cuda.*Tensor`` (megatron-core's optimizer accepts only those)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _fix(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda":
            return args[0]
        if name == "type" and len(args) == 1 and not kwargs:
            result = func(*args)
            if isinstance(result, str) and ".cuda." not in result:
                return result.replace("torch.", "torch.cuda.", 1)
            return result
        if name == "to":
            args = tuple(_fix(a) if isinstance(a, (str, torch.device)) else a for a in args)
        return func(*args, **kwargs)


def install_sync() -> None:
    """Enough for model-only saves: the writer's CUDA sync and device query."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def install() -> None:
    """Everything a training run (DDP, distributed optimizer) needs besides :func:`install_sync`."""
    install_sync()
    torch.cuda.device_count = lambda: 1
    CudaToCpu().__enter__()


def install_megatron_rng() -> None:
    """The CUDA RNG tracker's ``fork`` (dropout under TP) becomes a context that does nothing."""
    from megatron.core.tensor_parallel import random as mrandom
    mrandom.CudaRNGStatesTracker.fork = contextlib.contextmanager(lambda self, name=None: (yield))
