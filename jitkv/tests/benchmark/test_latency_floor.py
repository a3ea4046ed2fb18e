"""The benchmark's latency-floor kernel writes 16 bytes at loc[0] and nothing else (GPU only)."""

from __future__ import annotations

import pytest
import torch

import jitkv
from jitkv.tests.conftest import assert_bitwise, gpu, rand


def _floor_fn():
    from jitkv.benchmark.gpu import latency_floor_spec  # noqa: PLC0415

    return jitkv.jit.get_function(latency_floor_spec(jitkv.jit.cuda_arch(torch.device("cuda"))), "latency_floor")


@gpu
@pytest.mark.parametrize("slot", [0, 37, 63, -1, 64, 1 << 40])
def test_writes_16_bytes_at_the_slot_only(slot):
    fn = _floor_fn()
    dst = rand((64, 576), torch.bfloat16, "cuda")
    src = rand((1, 576), torch.bfloat16, "cuda")
    expected = dst.clone()
    if 0 <= slot < 64:
        expected[slot, :8] = src[0, :8]  # 8 bf16 = 16 bytes
    fn(dst, torch.tensor([slot], device="cuda"), src)
    torch.cuda.synchronize()
    assert_bitwise(dst, expected)


@gpu
def test_bad_input():
    fn = _floor_fn()
    dst = torch.empty(64, 576, dtype=torch.bfloat16, device="cuda")
    src = torch.empty(1, 576, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="latency_floor: expected CUDA tensors dst"):
        fn(dst, torch.tensor([3], dtype=torch.int32, device="cuda"), src)
