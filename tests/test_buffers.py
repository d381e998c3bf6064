"""Byte views of tensors (engine/buffers.py): the bytes the storage layer reads and writes."""
import gc

import pytest
import torch

from statesnap.engine.buffers import borrowed_byte_view, byte_view

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.int8, torch.uint8,
          torch.int64, torch.bool] + ([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_both_views_are_the_tensors_bytes_and_write_through(dtype):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6).to(dtype)
    for t in (base, base[1:3], torch.nn.Parameter(base.clone(), requires_grad=dtype.is_floating_point)):
        want = t.detach().reshape(-1).view(torch.uint8).tolist()
        owned, borrowed = byte_view(t), borrowed_byte_view(t)
        assert owned.format == borrowed.format == "B" and not borrowed.readonly
        assert list(owned) == list(borrowed) == want
        borrowed[:1] = bytes([0x3C])
        assert t.detach().reshape(-1).view(torch.uint8)[0].item() == 0x3C


def test_empty_tensors_have_empty_views():
    for t in (torch.zeros(0), torch.zeros(3, 0, dtype=torch.bfloat16)):
        assert len(byte_view(t)) == len(borrowed_byte_view(t)) == 0


def test_byte_view_keeps_the_memory_alive_and_refuses_what_has_no_plain_bytes():
    view = byte_view(torch.full((1000,), 7, dtype=torch.int32) + 0)  # (a temporary: only the view holds it)
    gc.collect()
    assert bytes(view[:8]) == torch.tensor([7, 7], dtype=torch.int32).numpy().tobytes()
    for bad in (torch.zeros(4, 4).t(), torch.zeros(3, dtype=torch.complex64).conj()):
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            byte_view(bad)
