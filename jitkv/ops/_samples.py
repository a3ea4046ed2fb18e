"""Fresh random arguments for the ops' sample calls (``Op.sample``: the tests' every-op tables, the
benchmark's warm-start probe) and the tests: never zeros, 1-byte types as random bytes."""

from __future__ import annotations

import torch

_BYTES = (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)


def rand(shape, dtype, device="cpu", gen=None):
    """Random data of any dtype: normal values for floats, random bytes for 1-byte types."""
    if dtype in _BYTES:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(dtype).to(device)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def slots(num_slots, n, dtype=torch.int64, device="cpu", gen=None):
    """n distinct random slots below num_slots (unique: with duplicates the winner is unspecified)."""
    return torch.randperm(num_slots, generator=gen)[:n].to(dtype).to(device)


def index(values, dtype=torch.int32, device="cpu"):
    """An index tensor of the given values (block tables, sequence lengths)."""
    return torch.tensor(values, dtype=dtype, device=device)
