"""Ready-made transform specs shipped with statesnap, found by name.

A spec that maps between two model families often depends on a few sizes of the model (Megatron
interleaves Q, K and V by query group, so splitting ``linear_qkv`` needs the number of groups and
the head size). Such a spec holds placeholders: a string value ``"{name}"`` or a product
``"{a}*{b}"`` stands for an integer given to :func:`load`. Specs without placeholders can also be
passed by file with :func:`path`.

- ``megatron_llama_to_hf``: megatron-core GPT names (as ``ss.convert(..., source="megatron")``
  gives them: RMSNorm, SwiGLU, RoPE, untied embeddings, no biases) to Hugging Face Llama names.
  Placeholders: ``query_groups`` (``num_query_groups``), ``heads_per_group``
  (``num_attention_heads // num_query_groups``), ``head_dim`` (``kv_channels``).
- ``deepspeed_to_hf``: the module weights of a ``source="deepspeed"`` or ``"ucp"`` import (``model.*``)
  under the module's own names, which for a Hugging Face model are the names ``from_pretrained``
  reads. The fp32 master weights (``fp32.*``) and optimizer state are left out.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

from ..transform import TransformError

HERE = os.path.dirname(os.path.abspath(__file__))
_PLACEHOLDER = re.compile(r"\{(\w+)\}(?:\*\{\w+\})*")
_NAME = re.compile(r"\{(\w+)\}")


def names() -> list[str]:
    """The shipped specs' names."""
    return sorted(n[:-len(".json")] for n in os.listdir(HERE) if n.endswith(".json"))


def path(name: str) -> str:
    """The JSON file of the shipped spec ``name`` (usable as ``spec=`` where it has no placeholders)."""
    file = os.path.join(HERE, f"{name}.json")
    if not os.path.isfile(file):
        raise TransformError(f"no shipped spec {name!r}; the shipped specs are {', '.join(names())}")
    return file


def load(name: str, **sizes: int) -> dict:
    """The shipped spec ``name`` as a dict, its placeholders replaced by ``sizes``; a placeholder
    left without a size, or a size the spec does not use, is an error (a typo must not pass)."""
    with open(path(name), encoding="utf-8") as f:
        spec = json.load(f)
    used: set[str] = set()
    spec = _fill(spec, sizes, used, name)
    unused = sorted(set(sizes) - used)
    if unused:
        raise TransformError(f"spec {name!r} has no placeholder {', '.join(unused)}")
    return spec


def _fill(value: Any, sizes: dict, used: set, name: str) -> Any:
    if isinstance(value, dict):
        return {key: _fill(inner, sizes, used, name) for key, inner in value.items()}
    if isinstance(value, list):
        return [_fill(inner, sizes, used, name) for inner in value]
    if isinstance(value, str) and _PLACEHOLDER.fullmatch(value):
        product = 1
        for key in _NAME.findall(value):
            if type(sizes.get(key)) is not int or sizes[key] <= 0:
                raise TransformError(f"spec {name!r} needs {key}=<positive int> (for {value!r})")
            used.add(key)
            product *= sizes[key]
        return product
    return value
