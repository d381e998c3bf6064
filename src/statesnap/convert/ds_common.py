"""What ``source="deepspeed"`` and ``source="ucp"`` read alike: the model-states files DeepSpeed
writes (``ds_to_universal`` copies them unchanged), the ``latest``-style pointer files, and the
names both give the module weights, param groups and engine state, so that either source loads
into the same ``ss.load`` state. Every value read here comes from an untrusted file, so each is
checked for the type and range the importers rely on before it is used: a damaged or foreign file
is a :class:`CheckpointError` naming it, never an ``IndexError`` or a wrong value.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any

import torch

from ..errors import CheckpointError
from . import unpickler
from .transform import Lazy

MODEL_FILE = re.compile(r"(?:zero_pp_rank_(?P<dp>\d+)_)?mp_rank_(?P<mp>\d+)_model_states\.pt")
SCALER_KEYS = ("dynamic_loss_scale", "overflow", "clip_grad")
# Model-states keys that describe the layout (rebuilt by the importers as names and shapes), not state to keep.
LAYOUT_KEYS = {"module", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
               "shared_params", "buffer_names", "universal_checkpoint_info", "ds_config", "ds_version",
               "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions"}
_POINTER_BYTES = 4096  # a tag name; anything longer is not a pointer file


def pointed_folder(path: str, is_target) -> str:
    """The directory beside the pointer file ``path`` (``latest``, ``latest_universal``) it names.

    The name must be one plain directory name: ``../x``, an absolute path or a name that is not
    text would point outside the checkpoint, so they are refused, as is a name ``is_target``
    (a predicate on the folder) does not accept."""
    with open(path, "rb") as f:
        raw = f.read(_POINTER_BYTES + 1)
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = None
    folder = os.path.join(os.path.dirname(path), tag or "")
    if (not tag or len(raw) > _POINTER_BYTES or "/" in tag or os.sep in tag or tag in (".", "..")
            or not is_target(folder)):
        raise CheckpointError(f"{path} names {tag if tag is None else tag[:80]!r}, which is not a checkpoint "
                              "folder beside it")
    return folder


def model_states(folder: str) -> dict[tuple[int, int], dict]:
    """Each ``*model_states.pt`` of ``folder`` keyed by (model-parallel rank, data-parallel rank),
    checked to come from one run: they must agree on the world sizes and the step."""
    ranks: dict[tuple[int, int], dict] = {}
    for entry in sorted(os.listdir(folder)):
        match = MODEL_FILE.fullmatch(entry)
        if match:
            path = os.path.join(folder, entry)
            loaded = unpickler.load(path)
            if not isinstance(loaded, dict):
                raise CheckpointError(f"{path} holds a {type(loaded).__name__}, not DeepSpeed model states")
            ranks[(int(match["mp"]), int(match["dp"] or 0))] = loaded
    if not ranks:
        raise CheckpointError(f"{folder} holds no DeepSpeed *model_states.pt file")
    first = ranks[min(ranks)]
    for key, states in ranks.items():
        for field in ("dp_world_size", "mp_world_size", "global_steps"):
            if states.get(field) != first.get(field):
                raise CheckpointError(
                    f"{model_path(folder, *key)}: {field} is {states.get(field)!r}, but "
                    f"{os.path.basename(model_path(folder, *min(ranks)))} has {first.get(field)!r}; the folder "
                    "mixes files of different runs or steps")
    return ranks


def model_path(folder: str, mp: int, dp: int | None = None) -> str:
    """The model-states file of a rank (``dp`` given: ZeRO-3's one file per data-parallel rank)."""
    name = f"mp_rank_{mp:02d}_model_states.pt"
    return os.path.join(folder, name if dp is None else f"zero_pp_rank_{dp}_{name}")


def positive_int(states: dict, key: str, where: str) -> int:
    value = states.get(key)
    if type(value) is not int or value < 1:
        raise CheckpointError(f"{where}: the model states' {key} is {value!r}, not a positive int")
    return value


def is_shape(value: Any) -> bool:
    """Whether ``value`` is a shape as DeepSpeed saves one: a tuple (``torch.Size``) or list of ints >= 0."""
    return isinstance(value, (list, tuple)) and all(type(n) is int and n >= 0 for n in value)


def parallel_dims(states: dict, where: str) -> dict:
    """The model states' ``checkpoint_parallel_dimensions`` (``{}`` when absent: older checkpoints)."""
    dims = states.get("checkpoint_parallel_dimensions") or {}
    if not isinstance(dims, dict):
        raise CheckpointError(f"{where}: checkpoint_parallel_dimensions is {str(dims)[:200]}, not a dict of degrees")
    return dims


def add_client_state(out: dict[str, Any], states: dict, where: str) -> None:
    """Add to the converted values ``out`` the model states' keys that describe no layout: the
    engine's counters and the client state the training script saved beside the model.

    A client key is the script's choice, so it may take the name of a converted value
    (``fp32.fc1.weight``), or be a dotted prefix of one (``optim``, whose keys ``ss.save`` joins
    into ``optim.param_groups``), or extend one. Either way one of the two would silently be
    lost (the fp32 master weight replaced by a number), so that is refused, naming both."""
    prefixes = {name[:at] for name in out for at in range(len(name)) if name[at] == "."}
    for key, value in states.items():
        if key in LAYOUT_KEYS:
            continue
        name = str(key)
        parts = name.split(".")
        above = [".".join(parts[:n]) for n in range(1, len(parts)) if ".".join(parts[:n]) in out]
        if name in out or name in prefixes or above:
            other = name if name in out else above[0] if above else next(n for n in out if n.startswith(name + "."))
            raise CheckpointError(f"{where}: its key {key!r} (state saved beside the model, e.g. client_state) "
                                  f"collides with the converted value {other!r}; one would replace the other, so "
                                  "rename that key where the checkpoint is saved")
        out[name] = value


def param_shapes(states: dict, where: str) -> list[dict[str, torch.Size]]:
    """The model states' ``param_shapes``: per parameter group, ``{name: shape}`` in DeepSpeed's
    order, every size a non-negative int (a shape decides how many elements are cut from the
    partitions, so it is checked before anything is sized by it)."""
    groups = states.get("param_shapes")
    if not groups:
        if isinstance(states.get("optimizer"), dict):  # ZeRO stage 0: PyTorch's own optimizer state dict
            held = ("its module's weights and PyTorch's own optimizer state dict, which keys the state by the "
                    "parameters' positions, not their names (ZeRO stage 0)")
            keys = "module.*, optimizer.state.<position>.*"
        else:
            held, keys = "its module's weights and no optimizer state", "module.*"
        raise CheckpointError(f"{where} has no param_shapes, so it is no ZeRO checkpoint: it holds {held}. "
                              f"Convert that file as the torch.save file it is: ss.convert({where!r}, DST, "
                              "source='torch') (`statesnap convert FILE DST --from torch`) stores everything in "
                              f"it by its keys ({keys})")
    if not isinstance(groups, list) or not all(isinstance(group, dict) for group in groups):
        raise CheckpointError(f"{where}: param_shapes is not a list of {{name: shape}} dicts")
    out = []
    for group in groups:
        shapes = {}
        for name, shape in group.items():
            if not isinstance(name, str) or not is_shape(shape):
                raise CheckpointError(f"{where}: param_shapes gives {name!r} the shape {shape!r}, not a tuple of "
                                      "non-negative ints")
            shapes[name] = torch.Size(shape)
        out.append(shapes)
    return out


def engine_state(optimizer: dict, path: str) -> dict[str, Any]:
    """``ds_zero_stage`` and ``ds_loss_scaler`` (its attributes and the scaling flags) as plain data,
    from a ZeRO optimizer's state; the fp16 scaler's ``torch.dtype`` is kept by name."""
    stage = optimizer.get("zero_stage")
    if type(stage) is not int or not 0 <= stage <= 3:
        raise CheckpointError(f"{path}: zero_stage is {stage!r}, not a ZeRO stage 0..3")
    scaler = optimizer.get("loss_scaler") or {}
    if not isinstance(scaler, dict):
        raise CheckpointError(f"{path}: loss_scaler is a {type(scaler).__name__}, not a loss scaler's attributes")
    scaler = {**scaler, **{key: optimizer[key] for key in SCALER_KEYS if key in optimizer}}
    return {"ds_zero_stage": stage,
            "ds_loss_scaler": {key: str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
                               for key, value in scaler.items()}}


def param_groups(optimizer: dict, groups: list[dict], path: str) -> list[dict]:
    """The optimizer's param groups with ``params`` as parameter names, as ``get_optimizer_state_dict`` gives them."""
    loaded = optimizer.get("param_groups")
    if not isinstance(loaded, list) or len(loaded) != len(groups) or not all(isinstance(g, dict) for g in loaded):
        raise CheckpointError(f"{path} has {len(loaded) if isinstance(loaded, list) else 'no'} param_groups "
                              f"(dicts), the model states {len(groups)}")
    return [{**{k: v for k, v in group.items() if k != "params"}, "params": list(shapes)}
            for group, shapes in zip(loaded, groups)]


def module_weights(folder: str, ranks: dict, fp32: dict[str, Lazy], tp: int) -> dict[str, Any]:
    """``model.<name>``: the module's weights and buffers as DeepSpeed held them.

    Where the model states hold the full module (ZeRO-1/2 without tensor parallelism) they are
    taken from there; else each parameter is its fp32 master cast to the module's dtype, and a
    frozen parameter is rebuilt from the data-parallel ranks' ``frozen_param_fragments``."""
    first = ranks[min(ranks)]
    where = model_path(folder, *min(ranks))
    module = first.get("module") or {}
    frozen = first.get("frozen_param_shapes") or {}
    shared = first.get("shared_params") or {}
    if not isinstance(module, dict) or not isinstance(frozen, dict) or not isinstance(shared, dict):
        raise CheckpointError(f"{where}: module, frozen_param_shapes and shared_params must be dicts")
    for name, shape in frozen.items():  # compared with the module's shapes below, so checked first
        if not is_shape(shape):
            raise CheckpointError(f"{where}: frozen_param_shapes gives {name} the shape {str(shape)[:200]}, not a "
                                  "tuple of non-negative ints")
    trainable = {name for shapes in param_shapes(first, where) for name in shapes}
    out: dict[str, Any] = {}
    for name, value in module.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{where}: module entry {name} is not a tensor")
        if name in trainable and (tp > 1 or tuple(value.shape) != tuple(fp32[name].shape)):
            out[f"model.{name}"] = _cast(fp32[name], value.dtype)
        elif name in frozen and tuple(value.shape) != tuple(frozen[name]):
            out[f"model.{name}"] = _frozen(folder, ranks, name, frozen[name])
        else:
            out[f"model.{name}"] = value.detach()
    for alias, source in shared.items():
        if f"model.{source}" not in out:
            raise CheckpointError(f"{where}: shared parameter {alias} names {source}, which the module does not hold")
        out[f"model.{alias}"] = out[f"model.{source}"]
    return out


def _cast(value: Lazy, dtype: torch.dtype) -> Lazy:
    if value.dtype == dtype:
        return value
    return Lazy(dtype, value.shape, lambda: value.read().to(dtype))


def _frozen(folder: str, ranks: dict, name: str, shape: Any) -> torch.Tensor:
    """A frozen ZeRO-3 parameter: every data-parallel rank saved its ``ceil(numel / dp)`` slice."""
    if len({mp for mp, _ in ranks}) > 1:
        raise CheckpointError(f"{folder}: frozen parameter {name} is split over model-parallel ranks, "
                              "which the universal format does not consolidate")
    pieces = []
    for key in sorted(ranks):
        piece = (ranks[key].get("frozen_param_fragments") or {}).get(name)
        if not isinstance(piece, torch.Tensor):
            raise CheckpointError(f"{model_path(folder, *key)} saved no fragment of frozen parameter {name}")
        pieces.append(piece.detach().reshape(-1))
    held = sum(piece.numel() for piece in pieces)
    if held < math.prod(shape):  # checked before the fragments are joined
        raise CheckpointError(f"{folder}: the fragments of frozen parameter {name} hold {held} elements, "
                              f"fewer than its shape {tuple(shape)} needs")
    return torch.cat(pieces)[:math.prod(shape)].reshape(shape).clone()
