"""``source="ucp"``: DeepSpeed universal checkpoint folders, as ``ds_to_universal`` writes them.

Universal Checkpointing (research/ucp_bytecheckpoint.md, 1.4) already did the hard part: every
trainable parameter's fp32 master weight and Adam moments are consolidated, unpadded and merged
across tensor-parallel ranks, one directory per parameter::

    <folder>/zero/<param>/fp32.pt, exp_avg.pt, exp_avg_sq.pt[, step.pt]
    <folder>/zero/optimizer_state.pt          param_groups, loss scaler, zero stage, ...
    <folder>/*model_states.pt                 copied from the source checkpoint unchanged
    <parent>/latest_universal                 the folder's name

What is left is reading it without trusting it, and naming the values as ``source="deepspeed"``
names the same run's values, so that either source loads into the same ``ss.load`` state:
``model.<param>``, ``fp32.<param>``, ``optim.state.<param>.exp_avg|exp_avg_sq|step``,
``optim.param_groups`` (parameter names, as ``get_optimizer_state_dict`` lists them) and the
engine's counters and client state as plain data. The layout differs by ZeRO stage, and the
differences are the reason this module exists:

- ZeRO-1/2 (and any tensor-parallel run) store ``{"param": full tensor, "cat_dim": ..., ...}``
  and a ``step.pt`` per parameter; what has no optimizer state (frozen parameters, tied aliases)
  gets only an ``fp32.pt`` made from the module's weights, upcast. That is no master weight, so
  it is not kept as ``fp32.<name>``; ``model.<name>`` holds the weight as the module did.
- ZeRO-3 without tensor parallelism stores bare flat 1-D tensors (reshaped here by the
  ``param_shapes`` of the model-states files), no ``step.pt`` (the step is per parameter group,
  in ``optimizer_state.pt``), and placeholders instead of module weights: ``model.<param>`` is
  then the fp32 master cast to the module's dtype, which is how DeepSpeed itself refreshes the
  module's weights from the masters after every step. Frozen parameters are not in ``zero/``;
  they are rebuilt from the ``frozen_param_fragments`` every rank saved.

Every file is read with the allow-listed unpickler (:mod:`.unpickler`); tensors stay
:class:`~.transform.Lazy` and are checked against the shape and dtype announced for them when
they are read.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch

from ..errors import CheckpointError
from . import unpickler
from .ds_common import (add_client_state, engine_state, model_states, module_weights, parallel_dims,
                        param_groups, param_shapes, pointed_folder)
from .transform import Lazy

LATEST = "latest_universal"
ZERO = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")


def folder_of(src: str) -> str:
    """The universal folder ``src`` names: itself (it has ``zero/``) or the one its ``latest_universal`` names."""
    if not os.path.isdir(src):
        raise CheckpointError(f"{src} is not a directory; a DeepSpeed universal checkpoint is a folder "
                              "(ds_to_universal's --output_folder) or its parent holding latest_universal")
    if os.path.isdir(os.path.join(src, ZERO)):
        return src
    latest = os.path.join(src, LATEST)
    if not os.path.isfile(latest):
        raise CheckpointError(f"{src} is not a DeepSpeed universal checkpoint: it has neither a {ZERO}/ "
                              f"folder nor a {LATEST} file")
    return pointed_folder(latest, lambda folder: os.path.isdir(os.path.join(folder, ZERO)))


def is_universal(src: str) -> bool:
    """Whether ``src`` looks like a universal folder or its parent (for ``detect_source``).

    ds_to_universal writes ``latest_universal`` into the training run's directory, beside
    DeepSpeed's own ``latest``; such a directory is read as the native checkpoint (what
    ``latest`` names is exact and may be newer than the universal copy): ``source="ucp"`` picks
    the universal one."""
    if os.path.isfile(os.path.join(src, LATEST)):
        return not os.path.isfile(os.path.join(src, "latest"))
    zero = os.path.join(src, ZERO)
    return os.path.isfile(os.path.join(zero, OPTIMIZER_STATE)) or (
        os.path.isdir(zero) and any(os.path.isfile(os.path.join(zero, n, "fp32.pt")) for n in os.listdir(zero)))


def read(src: str) -> dict[str, Any]:
    """``{name: Lazy tensor or plain value}`` of the universal folder ``src`` (or its parent)."""
    folder = folder_of(src)
    zero = os.path.join(folder, ZERO)
    ranks = model_states(folder)
    first = ranks[min(ranks)]
    if first.get("module") is None:
        raise CheckpointError(f"{folder} is a pipeline-parallel universal checkpoint (its model states hold no "
                              "module; ds_to_universal does not copy the layer files): convert the DeepSpeed "
                              "checkpoint it was made from with source='deepspeed'")
    groups = param_shapes(first, os.path.join(folder, "*model_states.pt"))
    optimizer = unpickler.load(_need(os.path.join(zero, OPTIMIZER_STATE)))
    if not isinstance(optimizer, dict):
        raise CheckpointError(f"{zero}/{OPTIMIZER_STATE} holds a {type(optimizer).__name__}, not a ZeRO "
                              "optimizer state")
    group_of = {name: index for index, shapes in enumerate(groups) for name in shapes}
    shapes = {name: shape for group in groups for name, shape in group.items()}
    tp = parallel_dims(first, os.path.join(folder, "*model_states.pt")).get("tp_degree", 1)
    if type(tp) is not int or tp < 1:
        raise CheckpointError(f"{folder}: the model states' tp_degree is {str(tp)[:80]}, not a positive int")
    names = sorted(n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n)))
    unknown = set(group_of) - set(names)
    if unknown:
        raise CheckpointError(f"{zero} lacks the folders of parameters {_show(unknown)} that the model states list")

    # ds_to_universal also writes an fp32.pt for what has no optimizer state (frozen parameters, tied
    # aliases), made from the module's weights upcast: not a master weight, and model.<name> has it.
    stray = set(names) - set(group_of) - set(first.get("module") or {})
    if stray:
        raise CheckpointError(f"{zero} has folders {_show(stray)} that are neither parameters the optimizer "
                              "holds nor module weights")
    out: dict[str, Any] = {}
    steps = _group_steps(optimizer, zero)
    fp32 = {}
    for name in (n for n in names if n in group_of):
        folder_p = os.path.join(zero, name)
        fp32[name] = _tensor(os.path.join(folder_p, "fp32.pt"), name, shapes[name] if tp == 1 else None)
        out[f"fp32.{name}"] = fp32[name]
        for moment in MOMENTS:
            out[f"optim.state.{name}.{moment}"] = _tensor(os.path.join(folder_p, f"{moment}.pt"), name,
                                                          fp32[name].shape)
        step_path = os.path.join(folder_p, "step.pt")
        if os.path.exists(step_path):
            out[f"optim.state.{name}.step"] = _step(unpickler.load(step_path), step_path, name)
        elif group_of[name] in steps:
            out[f"optim.state.{name}.step"] = steps[group_of[name]]
        else:
            raise CheckpointError(f"{folder_p}: no step.pt, and {zero}/{OPTIMIZER_STATE} has no step for "
                                  f"parameter group {group_of[name]} of {name}")
    out.update(module_weights(folder, ranks, fp32, tp))
    out["optim.param_groups"] = param_groups(optimizer, groups, os.path.join(zero, OPTIMIZER_STATE))
    out.update(engine_state(optimizer, os.path.join(zero, OPTIMIZER_STATE)))
    add_client_state(out, first, os.path.join(folder, "*model_states.pt"))
    return out


def _need(path: str) -> str:
    if not os.path.isfile(path):
        raise CheckpointError(f"missing {path}: not a complete DeepSpeed universal checkpoint")
    return path


def _tensor(path: str, name: str, shape: torch.Size | None) -> Lazy:
    """The tensor in a ``zero/<name>/<state>.pt`` file, lazily: its dtype and shape are read now
    (the file is memory-mapped, its data is not read), its data when materialized. A flat ZeRO-3
    tensor is reshaped to ``shape``."""
    value = _unwrap(unpickler.load(_need(path)), path, name)
    if shape is not None and tuple(value.shape) != tuple(shape):
        if value.dim() != 1 or value.numel() != math.prod(shape):
            raise CheckpointError(f"{path}: {name} has shape {tuple(value.shape)}, but the model states give "
                                  f"{tuple(shape)}")
    final = tuple(shape) if shape is not None else tuple(value.shape)
    dtype = value.dtype
    del value

    def load() -> torch.Tensor:
        tensor = _unwrap(unpickler.load(path), path, name)
        if tensor.dtype != dtype or tensor.numel() != math.prod(final):
            raise CheckpointError(f"{path} changed while it was converted ({name})")
        return tensor.reshape(final)

    return Lazy(dtype, final, load)


def _unwrap(value: Any, path: str, name: str) -> torch.Tensor:
    """A bare tensor (ZeRO-3) or the ``param`` of ``{"param": tensor, "cat_dim": ...}``."""
    if isinstance(value, dict):
        value = value.get("param")
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{path} holds no tensor for {name} (expected a tensor or a dict with 'param')")
    return value


def _step(value: Any, path: str, name: str) -> torch.Tensor | int | float:
    """A step as the optimizer kept it: a 0-d tensor (torch's Adam), or a number (AutoTP runs store an int)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise CheckpointError(f"{path}: the step of {name} is {type(value).__name__}, not a number or a "
                              "one-element tensor")
    return value.reshape(())


def _group_steps(optimizer: dict, zero: str) -> dict[int, torch.Tensor]:
    """ZeRO-3's per-group Adam step, from the inner ``optimizer_state_dict`` of ``optimizer_state.pt``."""
    inner = optimizer.get("optimizer_state_dict")
    state = inner.get("state") if isinstance(inner, dict) else None
    if not isinstance(state, dict):
        return {}
    path = os.path.join(zero, OPTIMIZER_STATE)
    return {int(group): _step(s["step"], path, f"parameter group {group}")
            for group, s in state.items() if isinstance(s, dict) and "step" in s}


def _show(names) -> str:
    names = sorted(names)
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
