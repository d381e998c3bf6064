"""Names of dtypes in the manifest: PyTorch's own spelling without the ``torch.`` prefix."""
from __future__ import annotations

import torch

from ..errors import ManifestError

_CANDIDATES = [
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "complex128", "complex64", "complex32",
    "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
]
# Only dtypes this torch build has; the table is the allowlist for names read from manifests.
NAME_TO_DTYPE: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _CANDIDATES if isinstance(getattr(torch, name, None), torch.dtype)
}
DTYPE_TO_NAME = {dtype: name for name, dtype in NAME_TO_DTYPE.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_TO_NAME[dtype]
    except KeyError:
        raise ManifestError(f"dtype {dtype} is not supported by the statesnap format") from None


def dtype_from_name(name: str, where: str = "") -> torch.dtype:
    try:
        return NAME_TO_DTYPE[name]
    except (KeyError, TypeError):
        raise ManifestError(f"unknown dtype {name!r}{' for ' + where if where else ''}; "
                            "the checkpoint may come from a newer statesnap or torch") from None


def tensor_dtype(name: str, where: str) -> torch.dtype:
    """The dtype a manifest records for a tensor; ``where`` (the manifest and the tensor) leads
    the error, as it does every other error about the tensor."""
    try:
        return dtype_from_name(name)
    except ManifestError as exc:
        raise ManifestError(f"{where}: {exc}") from None


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The memory of ``t`` as a flat uint8 tensor, without a copy, for a ``t`` whose memory holds
    its values in order (contiguous, no conjugate or negative bit). Not ``t.reshape(-1)``: that
    keeps the stride of a dimension of size 1 (``w[:, 0]`` of a (1, n) weight has stride n, and
    counts as contiguous), which the byte view then refuses."""
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)
