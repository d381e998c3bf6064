"""``source="deepspeed"``: DeepSpeed ``save_checkpoint`` directories (ZeRO 1-3, pipeline, TP, both).

A DeepSpeed checkpoint is one ``*_model_states.pt`` per model-parallel rank (per data-parallel
rank too under ZeRO-3) and one ``*_optim_states.pt`` per rank, in which the fp32 master weights
and the Adam moments are flat, padded partitions of whole parameter groups. Everything needed to
cut them back into parameters is in the files: ``param_shapes`` (names, shapes and order),
ZeRO-1/2's ``param_slice_mappings`` (where each parameter's fragment sits in each rank's
partition) and ZeRO-3's rule (each parameter split into ``ceil(numel / dp)`` pieces, the pieces of
a rank concatenated in parameter order). This module reads them (through the allow-listed
:mod:`.unpickler`, so no DeepSpeed code runs and DeepSpeed need not be installed) and names the
values as ``source="ucp"`` names the same run's universal checkpoint, so either loads into the
same state:

- ``model.<param>``: the module's weights as DeepSpeed held them (bf16 for bf16 runs), buffers,
  frozen and tied parameters included; ``fp32.<param>``: the fp32 master weights, stored for
  fp32 runs too (where they equal ``model.*``) so that every run has the same names;
- ``optim.state.<param>.exp_avg`` / ``.exp_avg_sq`` / ``.step`` (whatever the torch optimizer
  keeps), full shape, unpadded; ``optim.param_groups`` with parameter names as ``params``;
- the engine's ``global_steps``, ``global_samples``, ``skipped_steps``, ``lr_scheduler`` and the
  client state under the keys DeepSpeed saved them; ``ds_loss_scaler`` (the loss scaler's
  attributes) and ``ds_zero_stage``.

Pipeline stages write their layers to ``layer_XX-model_states.pt`` and are merged into one name
space (``PipelineModule`` names parameters ``<layer index>.<name>``). Tensor-parallel slices
(AutoTP's, or a pipeline's ``layer_XX-model_YY-model_states.pt`` with model-parallel rank =
stage x TP + TP rank) are kept per TP rank as ``tp_rank_XX.<name>`` and merged by a transform
spec derived from the ``universal_checkpoint_info`` DeepSpeed saved (:func:`derive_spec`), the
same rules ``ds_to_universal`` applies, sub-parameters of uneven sizes included. Tensors stay
:class:`Lazy`: the files are memory-mapped and a tensor is cut out of its partitions only when it
is written.
"""
from __future__ import annotations

import math
import os
import re
from functools import partial
from typing import Any

import torch

from ..errors import CheckpointError
from . import unpickler
from .transform import Lazy, apply_spec, is_tensor, load_spec
from .ds_common import (MODEL_FILE, add_client_state, engine_state, model_path, model_states, module_weights,
                        parallel_dims, param_groups, param_shapes, pointed_folder, positive_int)

LATEST = "latest"
_OPTIM = re.compile(r"(?P<prefix>(?:bf16_)?)zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt")
_LAYER = re.compile(r"layer_(?P<layer>\d+)(?:-model_(?P<mp>\d+))?-model_states\.pt")
TP_PREFIX = "tp_rank_{:02d}."


def tag_dir(src: str) -> str:
    """The tag directory of ``src``: the one its ``latest`` file names, or ``src`` itself."""
    if not os.path.isdir(src):
        raise CheckpointError(f"{src} is not a directory; a DeepSpeed checkpoint is the save_checkpoint directory "
                              "(with a 'latest' file) or one tag directory in it")
    latest = os.path.join(src, LATEST)
    if os.path.isfile(latest):
        return pointed_folder(latest, os.path.isdir)
    if not any(MODEL_FILE.fullmatch(n) for n in os.listdir(src)):
        raise CheckpointError(f"{src} is not a DeepSpeed checkpoint: no 'latest' file and no *model_states.pt files")
    return src


def is_deepspeed(src: str) -> bool:
    """Whether ``src`` looks like a DeepSpeed run directory or tag directory (for ``detect_source``)."""
    return os.path.isfile(os.path.join(src, LATEST)) or any(n.endswith("model_states.pt") for n in os.listdir(src))


def read(src: str, notes: list[str] | None = None) -> dict[str, Any]:
    """``{name: Lazy tensor or plain value}`` of the DeepSpeed checkpoint ``src``, TP slices merged.

    What merging noticed without refusing (TP replicas that drifted) is appended to ``notes``."""
    ckpt = _Checkpoint(tag_dir(src))
    return apply_spec(load_spec(_spec(ckpt)), ckpt.values(), notes=notes)


def derive_spec(src: str) -> dict:
    """The transform spec :func:`read` applies to merge tensor-parallel slices (``{"ops": []}``
    without TP), derived from ``universal_checkpoint_info``; print it, edit it, and pass the edit
    as ``ss.convert(..., spec=...)`` on top of the one read applies, or rebuild from the per-rank
    names with your own."""
    return _spec(_Checkpoint(tag_dir(src)))


class _Checkpoint:
    """The files of one tag directory, loaded (memory-mapped) once."""

    def __init__(self, folder: str):
        self.folder = folder
        names = sorted(os.listdir(folder))
        self.states = model_states(folder)
        # model-parallel ranks with one model-states file per DP rank (ZeRO-3)
        self.per_dp = {int(m["mp"]) for n in names for m in [MODEL_FILE.fullmatch(n)] if m and m["dp"] is not None}
        self.first = self.states[min(self.states)]
        first_mp, first_dp = min(self.states)
        self.first_path = model_path(folder, first_mp, first_dp if first_mp in self.per_dp else None)
        # every rank's parameter shapes (its slices under TP), for the spec derived from patterns
        self.shapes = {name: shape for (mp, dp), states in self.states.items()
                       for group in param_shapes(states, model_path(folder, mp, dp if mp in self.per_dp else None))
                       for name, shape in group.items()}
        self.mp = positive_int(self.first, "mp_world_size", folder)
        self.dp = positive_int(self.first, "dp_world_size", folder)
        self.optim_files = {(int(m["mp"]), int(m["dp"])): os.path.join(folder, n)
                            for n in names for m in [_OPTIM.fullmatch(n)] if m}
        self.layer_files = {(int(m["layer"]), int(m["mp"] or 0)): os.path.join(folder, n)
                            for n in names for m in [_LAYER.fullmatch(n)] if m}
        # Model-parallel rank = stage x tp + TP rank (DeepSpeed's grid: pipe outer, model inner).
        # Checkpoints older than checkpoint_parallel_dimensions give TP only in layer file names.
        dims = parallel_dims(self.first, self.first_path) or {
            "tp_degree": 1 + max((tp for _, tp in self.layer_files), default=0)}
        self.tp = dims.get("tp_degree", 1)
        self.pp = dims.get("pp_degree", self.mp // self.tp if type(self.tp) is int and self.tp > 0 else 1)
        if type(self.tp) is not int or type(self.pp) is not int or self.tp < 1 or self.pp < 1 or (
                self.tp * self.pp != self.mp and self.tp > 1):
            raise CheckpointError(f"{self.first_path}: checkpoint_parallel_dimensions {dims!r} do not multiply "
                                  f"to mp_world_size {self.mp}")

    def values(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        groups: list[dict] = []
        for mp in range(self.mp):
            values = self._rank(mp)
            rank_groups = values.pop("optim.param_groups")
            if mp % self.tp == 0:  # one TP rank of each stage: the others have the same groups
                groups = _merge_groups(groups, rank_groups)
            prefix = TP_PREFIX.format(mp % self.tp) if self.tp > 1 else ""
            for name, value in values.items():
                key = prefix + name if is_tensor(value) else name
                if key in out and is_tensor(value):
                    raise CheckpointError(f"{self.folder}: two model-parallel ranks both hold {name}")
                out.setdefault(key, value)
        out["optim.param_groups"] = groups
        return out

    def _rank(self, mp: int) -> dict[str, Any]:
        """The values of one model-parallel rank (a pipeline stage, a TP rank, or a TP rank of a
        stage), DP partitions merged."""
        states = self._dp_states(mp)
        first = states[(mp, 0)]
        shapes = param_shapes(first, model_path(self.folder, mp, 0 if mp in self.per_dp else None))
        optims = [self._optim(mp, dp) for dp in range(self.dp)]
        inner = optims[0][1]["optimizer_state_dict"]
        engine = engine_state(inner, optims[0][0])
        stage = engine["ds_zero_stage"]
        for path, loaded in optims:  # the ranks of one run agree on the stage and on how it was partitioned
            count = loaded["optimizer_state_dict"].get("partition_count", self.dp)
            if loaded["optimizer_state_dict"].get("zero_stage") != stage or any(
                    c != self.dp for c in (count if isinstance(count, list) else [count])):
                raise CheckpointError(f"{path}: zero_stage {loaded['optimizer_state_dict'].get('zero_stage')!r} "
                                      f"partition_count {count!r}, but {os.path.basename(optims[0][0])} has "
                                      f"zero_stage {stage} and dp_world_size is {self.dp}; the folder mixes runs")
        if stage == 3:
            fp32, state, base = self._zero3(mp, shapes, optims)
        else:
            fp32, state, base = self._zero12(mp, shapes, optims)
        out = {f"fp32.{name}": value for name, value in fp32.items()}
        out.update(state)
        module_states = dict(states)
        if first.get("module") is None:  # a pipeline stage: its weights are in the layer files
            module_states[(mp, 0)] = {**first, "module": self._layers(mp)}
        out.update(module_weights(self.folder, module_states, fp32, tp=1))
        out["optim.param_groups"] = param_groups(base, shapes, optims[0][0])
        out.update(engine)
        add_client_state(out, first, model_path(self.folder, mp, 0 if mp in self.per_dp else None))
        return out

    def _dp_states(self, mp: int) -> dict[tuple[int, int], dict]:
        zero3 = mp in self.per_dp
        wanted = range(self.dp) if zero3 else range(1)
        missing = [model_path(self.folder, mp, dp if zero3 else None) for dp in wanted if (mp, dp) not in self.states]
        if missing:
            raise CheckpointError(f"missing DeepSpeed rank file {missing[0]} (mp_world_size={self.mp}, "
                                  f"dp_world_size={self.dp}); the checkpoint is incomplete")
        return {(mp, dp): self.states[(mp, dp)] for dp in wanted}

    def _optim(self, mp: int, dp: int) -> tuple[str, dict]:
        path = self.optim_files.get((mp, dp))
        if path is None:
            name = f"[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"
            raise CheckpointError(f"missing DeepSpeed optimizer file {os.path.join(self.folder, name)} "
                                  f"(dp_world_size={self.dp}); the checkpoint is incomplete")
        loaded = unpickler.load(path)
        if not isinstance(loaded, dict) or not isinstance(loaded.get("optimizer_state_dict"), dict):
            raise CheckpointError(f"{path} has no optimizer_state_dict; not a DeepSpeed ZeRO optimizer file")
        return path, loaded

    def _layers(self, mp: int) -> dict[str, torch.Tensor]:
        """A pipeline stage's module, from the layer files (global layer numbers) its param_shapes name,
        those of its TP rank where the layers are tensor-parallel."""
        wanted = {name.split(".", 1)[0] for group in self.states[(mp, 0)]["param_shapes"] for name in group}
        module = {}
        for (layer, tp), path in sorted(self.layer_files.items()):
            if str(layer) in wanted and tp == mp % self.tp:
                wanted.discard(str(layer))
                loaded = unpickler.load(path)
                if not isinstance(loaded, dict):
                    raise CheckpointError(f"{path} holds a {type(loaded).__name__}, not a layer's state dict")
                module.update({f"{layer}.{key}": value for key, value in loaded.items()})
        if wanted:
            layer = min(wanted, key=lambda n: (len(n), n))
            name = f"layer_{layer.zfill(2)}{f'-model_{mp % self.tp:02d}' if self.tp > 1 else ''}-model_states.pt"
            raise CheckpointError(f"missing DeepSpeed layer file {os.path.join(self.folder, name)} (the parameters of "
                                  f"{model_path(self.folder, mp)} name layer {layer}); the checkpoint is incomplete")
        return module

    def _zero12(self, mp: int, shapes: list[dict], optims: list) -> tuple[dict, dict, dict]:
        """ZeRO-1/2: each rank's partition holds fragments of parameters at ``param_slice_mappings``."""
        fp32: dict[str, Any] = {}
        state: dict[str, Any] = {}
        base = optims[0][1]["optimizer_state_dict"].get("base_optimizer_state")
        if not isinstance(base, dict):
            raise CheckpointError(f"{optims[0][0]} has no base_optimizer_state; not a ZeRO-1/2 optimizer file")
        for g, group in enumerate(shapes):
            parts = []
            for path, loaded in optims:
                inner = loaded["optimizer_state_dict"]
                try:
                    flat = inner["single_partition_of_fp32_groups"][g]
                    mapping = inner["param_slice_mappings"][g]
                    moments = inner["base_optimizer_state"]["state"].get(g, {})
                except (KeyError, IndexError, TypeError, AttributeError):
                    raise CheckpointError(f"{path} lacks the partition of parameter group {g}") from None
                _check_fragments(path, mapping, moments)
                parts.append((path, flat, mapping, moments))
            for name, shape in group.items():
                pieces = [(path, flat, mapping[name], moments) for path, flat, mapping, moments in parts
                          if name in mapping]
                held = sum(address.numel for _, _, address, _ in pieces)
                if held != shape.numel():
                    raise CheckpointError(f"{self.folder}: the partitions of {name} hold {held} elements "
                                          f"({', '.join(os.path.basename(p[0]) for p in pieces) or 'none'}), "
                                          f"but param_shapes gives {tuple(shape)} ({shape.numel()})")
                fp32[name] = _gather(name, shape, [(path, flat, a.start, a.numel) for path, flat, a, _ in pieces])
                for key, value in parts[0][3].items():
                    if isinstance(value, torch.Tensor) and value.dim() == 1:
                        state[f"optim.state.{name}.{key}"] = _gather(
                            f"{name} {key}", shape, [(path, moments.get(key), a.start, a.numel)
                                                     for path, _, a, moments in pieces])
                    else:
                        state[f"optim.state.{name}.{key}"] = value
        return fp32, state, base

    def _zero3(self, mp: int, shapes: list[dict], optims: list) -> tuple[dict, dict, dict]:
        """ZeRO-3: each parameter split into ``ceil(numel / dp)`` pieces, a rank's pieces concatenated
        in parameter order over its (sub-)groups' flat tensors."""
        params = {name: torch.Size(shape) for group in shapes for name, shape in group.items()}
        per_rank = []
        for path, loaded in optims:
            inner = loaded["optimizer_state_dict"]
            flats = inner.get("fp32_flat_groups")
            torch_state = inner.get("optimizer_state_dict") or {}
            moments = (torch_state.get("state") if isinstance(torch_state, dict) else None) or {}
            if not isinstance(torch_state, dict) or not isinstance(moments, dict):
                raise CheckpointError(f"{path}: the inner optimizer_state_dict or its state is not a dict")
            if not isinstance(flats, list) or not all(isinstance(t, torch.Tensor) for t in flats):
                raise CheckpointError(f"{path} has no fp32_flat_groups; not a ZeRO-3 optimizer file")
            need = sum(math.ceil(s.numel() / self.dp) for s in params.values())
            have = sum(t.numel() for t in flats)
            if have != need:
                raise CheckpointError(f"{path}: the fp32 partition holds {have} elements, but the parameters of "
                                      f"param_shapes need {need} ({self.dp} ranks, ceil(numel/{self.dp}) each)")
            per_group = [moments.get(i, {}) for i in range(len(flats))]
            if not all(isinstance(m, dict) for m in per_group):
                raise CheckpointError(f"{path}: the optimizer state of a parameter group is not a dict")
            per_rank.append((path, flats, per_group))
        base = {"param_groups": (optims[0][1]["optimizer_state_dict"].get("optimizer_state_dict") or {}).get(
            "param_groups")}
        fp32: dict[str, Any] = {}
        state: dict[str, Any] = {}
        offset = 0
        for name, shape in params.items():
            piece = math.ceil(shape.numel() / self.dp)
            fp32[name] = _gather(name, shape, [(path, _Flat(flats), offset, piece) for path, flats, _ in per_rank])
            for key, value in per_rank[0][2][_group_at(per_rank[0][1], offset)].items():
                if isinstance(value, torch.Tensor) and value.dim() == 1:
                    state[f"optim.state.{name}.{key}"] = _gather(
                        f"{name} {key}", shape, [(path, _Flat([m.get(key) for m in moments]), offset, piece)
                                                 for path, _, moments in per_rank])
                else:
                    state[f"optim.state.{name}.{key}"] = value
            offset += piece
        return fp32, state, base


def _check_fragments(path: str, mapping: Any, moments: Any) -> None:
    """A rank's ``param_slice_mappings`` of one group: fragments that do not overlap (else two
    parameters would be cut from the same elements); each is checked against the partition's
    length when it is gathered."""
    if not isinstance(mapping, dict) or not all(isinstance(a, unpickler.FragmentAddress) for a in mapping.values()):
        raise CheckpointError(f"{path}: param_slice_mappings is not a {{name: fragment_address}} dict")
    if not isinstance(moments, dict):
        raise CheckpointError(f"{path}: the optimizer state of a parameter group is not a dict")
    end, last = 0, None
    for name, address in sorted(mapping.items(), key=lambda item: item[1].start):
        if address.start < end:
            raise CheckpointError(f"{path}: the fragment of {name} (elements {address.start}..) overlaps the one "
                                  f"of {last} (..{end}) in param_slice_mappings")
        end, last = address.start + address.numel, name


class _Flat:
    """Several flat tensors seen as their concatenation, without concatenating them."""

    def __init__(self, tensors: list):
        self.tensors = tensors
        self.dtype = tensors[0].dtype if tensors and all(isinstance(t, torch.Tensor) for t in tensors) else None

    def numel(self) -> int:
        return sum(t.numel() for t in self.tensors if isinstance(t, torch.Tensor))

    def narrow(self, start: int, length: int) -> torch.Tensor:
        out, at = [], 0
        for t in self.tensors:
            n = t.numel()
            if at + n > start and at < start + length:
                lo = max(start - at, 0)
                out.append(t.reshape(-1)[lo:min(start + length - at, n)])
            at += n
        return out[0] if len(out) == 1 else torch.cat(out)


def _group_at(flats: list, offset: int) -> int:
    at = 0
    for index, t in enumerate(flats):
        at += t.numel()
        if offset < at:
            return index
    return len(flats) - 1


def _gather(name: str, shape: torch.Size, pieces: list[tuple[str, Any, int, int]]) -> Lazy:
    """The tensor of ``shape`` made of ``(file, flat, start, numel)`` pieces in order, cut to its size."""
    dtypes = set()
    for path, flat, start, numel in pieces:
        if not isinstance(flat, (torch.Tensor, _Flat)) or flat.dtype is None:
            raise CheckpointError(f"{path}: {name} has no flat partition tensor")
        if start < 0 or start + numel > flat.numel():
            raise CheckpointError(f"{path}: {name} needs elements [{start}, {start + numel}) of a partition "
                                  f"of {flat.numel()}; the file does not match param_shapes (truncated or foreign)")
        dtypes.add(flat.dtype)
    if len(dtypes) != 1:
        raise CheckpointError(f"{name}: the ranks' partitions have different dtypes {sorted(map(str, dtypes))}")
    return Lazy(dtypes.pop(), tuple(shape), partial(_read, shape, pieces))


def _read(shape: torch.Size, pieces: list) -> torch.Tensor:
    """The pieces cut to the tensor's size (ZeRO pads the last one) and joined: one copy at most,
    none for a tensor in one piece (a view of the memory-mapped partition, which the writer only reads)."""
    parts, left = [], shape.numel()
    for _, flat, start, numel in pieces:
        take = min(numel, left)
        if take > 0:
            parts.append(flat.narrow(0, start, take) if isinstance(flat, torch.Tensor) else flat.narrow(start, take))
            left -= take
    if left:
        raise CheckpointError(f"{pieces[0][0] if pieces else 'the partitions'}: {left} elements of a tensor of "
                              f"shape {list(shape)} are in no partition")
    if not parts:  # an empty tensor
        return torch.empty(shape, dtype=pieces[0][1].dtype)
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(shape)


def _merge_groups(groups: list[dict], more: list[dict]) -> list[dict]:
    """Pipeline stages' param groups merged index by index (their hyperparameters agree; the
    parameters differ), so that one torch optimizer over the whole model matches them."""
    if not groups:
        return [dict(g) for g in more]
    if len(groups) != len(more):
        raise CheckpointError(f"pipeline stages have {len(groups)} and {len(more)} parameter groups")
    return [{**g, "params": g["params"] + m["params"]} for g, m in zip(groups, more)]


def _padded(ckpt: _Checkpoint, patterns: list[str], size: int) -> bool:
    """Whether a vocabulary tensor has more rows than ``size`` once its TP slices are joined."""
    return any(any(re.match(p, name) for p in patterns) and len(shape) > 0 and shape[0] * ckpt.tp > size
               for name, shape in ckpt.shapes.items())


def _spec(ckpt: _Checkpoint) -> dict:
    """Fuse ops merging the ``tp_rank_XX.`` slices, by ``universal_checkpoint_info``'s patterns."""
    if ckpt.tp == 1:
        return {"ops": []}
    info = ckpt.first.get("universal_checkpoint_info")
    if not isinstance(info, dict):
        raise CheckpointError(f"{ckpt.folder}: tensor-parallel checkpoint without universal_checkpoint_info; "
                              "write a transform spec fusing the tp_rank_XX.* slices yourself")
    rank = r"tp_rank_(?P<index>\d+)\."

    def names(patterns: list[str]) -> str:
        # UCP patterns match parameter names (re.match); here they match inside our value names.
        body = "|".join(f"(?:{p.lstrip('^').rstrip('$')})" for p in patterns)
        return rf"(?:model|fp32)\.(?:{body})|optim\.state\.(?:{body})\.(?!step$)[^.]+"

    ops: list[dict] = [{"fuse": rank + r"(?P<name>optim\.state\..*\.step)", "to": r"\g<name>", "same": True,
                        "optional": True}]
    replicated, average, row, vocab, two_sub = (_patterns(ckpt, info, key) for key in (
        "tp_replicated_parameter_patterns", "parameter_to_average_patterns", "parameter_with_row_parallelism_patterns",
        "vocabulary_parameter_patterns",
        "parameter_with_2_sub_params_cat_dim_0"))  # [gate; up] fused per rank: [gate_r; up_r] (Megatron's SwiGLU fc1)
    entries = info.get("parameter_with_sub_params") or []
    if not isinstance(entries, list):
        raise CheckpointError(f"{ckpt.first_path}: universal_checkpoint_info's parameter_with_sub_params is "
                              f"{str(entries)[:200]}, not a list of entries")
    sub_params = [(pattern, how) for entry in entries for pattern, how in _sub_param_fusions(ckpt, info, entry)]
    for patterns, how in ((replicated, {"same": True}), (average, {"cat": 0, "average": True}),
                          (two_sub, {"cat": 0, "groups": 2}), *(([p], how) for p, how in sub_params),
                          (row, {"cat": 1}), (vocab, {"cat": 0})):
        if patterns:
            op = {"fuse": rank + f"(?P<name>{names(patterns)})", "to": r"\g<name>", **how, "optional": True}
            if "average" in how:
                op = {k: v for k, v in op.items() if k != "cat"}
            ops.append(op)
    ops.append({"fuse": rank + r"(?P<name>.*)", "to": r"\g<name>", "cat": 0, "optional": True})
    size = info.get("original_vocab_size")
    if size is not None and (type(size) is not int or size < 0):
        raise CheckpointError(f"{ckpt.first_path}: universal_checkpoint_info's original_vocab_size is "
                              f"{str(size)[:200]}, not a number of rows")
    if vocab and size and _padded(ckpt, vocab, size):
        ops.append({"vocab": f"^(?:{names(vocab)})$", "size": size, "dim": 0})
    return {"ops": ops}


def _sub_param_fusions(ckpt: _Checkpoint, info: dict, entry: Any) -> list[tuple[str, dict]]:
    """``(pattern, fuse mode)`` for one ``parameter_with_sub_params`` entry, as ``ds_to_universal``
    merges it: each rank's slice along ``partition_dim`` is [its piece of sub-parameter 0 | of 1 |
    ...]; the parameter is sub-parameter 0 of every rank, then 1, ... Version 0.4 records each
    rank's width of each sub-parameter (``sub_param_shard_widths``, uneven GQA heads included);
    before it, ``shape[partition_dim]`` was a count of equal sub-parameters or their sizes, each cut
    evenly over the ranks."""
    where = f"{ckpt.first_path}: universal_checkpoint_info's parameter_with_sub_params entry {str(entry)[:200]}"
    patterns = entry.get("patterns") if isinstance(entry, dict) else None
    shape, dim = (entry.get("shape"), entry.get("partition_dim")) if isinstance(entry, dict) else (None, None)
    if (not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) for p in patterns)
            or not isinstance(shape, (list, tuple)) or type(dim) is not int or not 0 <= dim < len(shape)):
        raise CheckpointError(f"{where} is not {{patterns: [regex], shape: [...], partition_dim: int < len(shape)}}")
    for pattern in patterns:
        _check_pattern(pattern, where)
    sizes = shape[dim]
    recorded = info.get("sub_param_shard_widths") or {}
    version = info.get("universal_checkpoint_version") or 0
    if isinstance(version, bool) or not isinstance(version, (int, float)) or not isinstance(recorded, dict):
        raise CheckpointError(f"{ckpt.first_path}: universal_checkpoint_version {version!r} is not a number, or "
                              "sub_param_shard_widths not a {pattern: widths} dict")
    out = []
    for pattern in patterns:
        for name, held in _shapes_matching(ckpt, pattern).items():
            if len(held) != len(shape):  # a view spec that reshapes, e.g. experts (E, -1, H) of a 2-D weight
                raise CheckpointError(f"{where}: {name} has shape {tuple(held)}, which the sub-parameter shape "
                                      f"{list(shape)} reshapes; this importer does not derive a spec for that, "
                                      "convert with ds_to_universal and source='ucp'")
        if pattern in recorded:
            widths = recorded[pattern]
        elif version >= 0.4:
            raise CheckpointError(f"{where}: universal_checkpoint_version 0.4 and no sub_param_shard_widths for "
                                  f"{pattern}")
        elif type(sizes) is int and sizes > 0:
            out.append((pattern, {"cat": dim, "groups": sizes}))
            continue
        elif (isinstance(sizes, (list, tuple)) and all(type(n) is int and n >= 0 and n % ckpt.tp == 0 for n in sizes)):
            widths = [[n // ckpt.tp] * ckpt.tp for n in sizes]
        else:
            raise CheckpointError(f"{where}: sub-parameter sizes {sizes!r} that {ckpt.tp} ranks do not divide, "
                                  "and no sub_param_shard_widths saying how they were cut")
        if (not isinstance(widths, (list, tuple)) or not widths
                or not all(isinstance(w, (list, tuple)) and len(w) == ckpt.tp and all(type(n) is int and n >= 0
                                                                                    for n in w) for w in widths)
                or (isinstance(sizes, (list, tuple)) and [sum(w) for w in widths] != list(sizes))):
            raise CheckpointError(f"{where}: sub_param_shard_widths of {pattern} is {str(widths)[:200]}, not one "
                                  f"width per rank ({ckpt.tp}) for each sub-parameter {sizes!r}")
        out.append((pattern, {"cat": dim, "widths": [list(w) for w in widths]}))
    return out


def _shapes_matching(ckpt: _Checkpoint, pattern: str) -> dict[str, torch.Size]:
    """The per-rank shapes of the parameters ``pattern`` (a UCP regex) matches, from param_shapes."""
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise CheckpointError(f"{ckpt.first_path}: universal_checkpoint_info pattern {pattern!r}: {exc}") from None
    return {name: shape for name, shape in ckpt.shapes.items() if compiled.match(name)}


# What DeepSpeed writes into universal_checkpoint_info: ``^<re.escape(name)>$`` (AutoTP), or a few
# hand-written forms such as ``\d+.input_layernorm.weight`` (Megatron-DeepSpeed) and
# ``.*\.experts\.w[123]$`` (the engine's MoE patterns).
MAX_PATTERN_CHARS = 1000
MAX_REPEATS = 2  # repeats that choose how often (*, +, ?, {m,n}, {m,}) of single items in one pattern
_BOUNDS = re.compile(r"\{(\d*)(,?)(\d*)\}")


def _patterns(ckpt: _Checkpoint, info: dict, key: str) -> list[str]:
    """One of ``universal_checkpoint_info``'s pattern lists, each checked by :func:`_check_pattern`."""
    patterns = info.get(key) or []
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise CheckpointError(f"{ckpt.first_path}: universal_checkpoint_info's {key} is {str(patterns)[:200]}, "
                              "not a list of regexes")
    for pattern in patterns:
        _check_pattern(pattern, f"{ckpt.first_path}: universal_checkpoint_info's {key}")
    return patterns


def _check_pattern(pattern: str, where: str) -> None:
    r"""Refuse a regex from a checkpoint whose matching could take time exponential (or a high
    power) in the length of a name, which the same file chooses: ``(a+)+$`` against 28 a's and a
    ``!`` took 18 s, and each two more characters three times as long.

    Python's ``re`` cannot be interrupted, so the pattern's form is bounded instead: no repeated
    group (``(...)*``, ``(...)+``, ``(...){m,n}``: what makes backtracking explode, ``(a|a)*``
    included), at most ``MAX_REPEATS`` repeats that choose how often to match a single item
    (``.*``, ``\d+``, ``[^.]+``, ``a?``, ``a{0,40}``: each is a choice the matcher may revisit,
    so ten of ``a{0,40}`` took 84 s; an exact ``{n}`` is none), at most ``MAX_PATTERN_CHARS``
    characters. Every pattern DeepSpeed writes has that form (above), and such patterns match in
    time at most quadratic in a name's length."""
    problem = f"it is longer than {MAX_PATTERN_CHARS} characters" if len(pattern) > MAX_PATTERN_CHARS else None
    repeats, at, previous = 0, 0, ""  # previous: "(", ")", "repeat" or "" (anything else)
    while problem is None and at < len(pattern):
        char, bounds = pattern[at], _BOUNDS.match(pattern, at)
        token = ""
        if char == "?" and previous in ("(", "repeat"):  # a group's flag, or a lazy repeat
            at += 1
        elif char in "*+?" or (char == "{" and bounds):
            if previous == ")":
                problem = f"it repeats a group ({pattern[max(0, at - 20):at + 1]!r})"
            # {n} and {n,n} repeat exactly; {m,n}, {m,} and {,} (0 or more) choose how often
            repeats += char != "{" or bool(bounds[2]) and (not bounds[3] or bounds[1] != bounds[3])
            at, token = (bounds.end() if char == "{" else at + 1), "repeat"
        elif char == "\\":
            at += 2
        elif char == "[":
            at = _class_end(pattern, at)
        else:
            at, token = at + 1, char if char in "()" else ""
        previous = token
    if problem is None and repeats > MAX_REPEATS:
        problem = f"it has {repeats} repeats of varying length (at most {MAX_REPEATS})"
    try:
        problem = problem or re.compile(pattern) and None
    except re.error as exc:
        problem = f"it is no regex ({exc})"
    if problem:
        raise CheckpointError(f"{where}: pattern {pattern[:200]!r} is refused: {problem}, so matching it against "
                              "names could take practically forever; DeepSpeed writes plain patterns such as "
                              "'^layers\\.0\\.mlp\\.weight$' or '\\d+.input_layernorm.weight'")


def _class_end(pattern: str, at: int) -> int:
    """The index just past the character class ``[...]`` opening at ``at``."""
    at += 1
    at += pattern.startswith("^", at)
    at += pattern.startswith("]", at)  # a ] right after [ or [^ is a literal
    while at < len(pattern) and pattern[at] != "]":
        at += 2 if pattern[at] == "\\" else 1
    return at + 1
