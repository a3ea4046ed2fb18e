"""Shared fixtures: an isolated cache dir per test session, random data helpers, GPU skipping."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

# What a test session builds and compiles goes to one scratch dir, removed when the session ends; the
# hooks below run in pytest only, so a child process importing this module creates nothing.
_SESSION_CACHES = {"JITKV_CACHE_DIR": "jitkv", "TORCHINDUCTOR_CACHE_DIR": "torchinductor"}  # variable: subdir
_SCRATCH = pytest.StashKey[str]()


def pytest_configure(config):
    """Point each cache of _SESSION_CACHES the caller did not choose (CI sets JITKV_CACHE_DIR) into the
    session's scratch dir; the test processes started inherit them."""
    unset = [var for var in _SESSION_CACHES if var not in os.environ]
    if unset:
        scratch = config.stash[_SCRATCH] = tempfile.mkdtemp(prefix="jitkv-test-session-")
        os.environ.update({var: os.path.join(scratch, _SESSION_CACHES[var]) for var in unset})


def pytest_unconfigure(config):
    if _SCRATCH in config.stash:
        shutil.rmtree(config.stash[_SCRATCH], ignore_errors=True)


HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
# The backends of an op with a CPU C++ kernel, per device, and every (device, backend) pair present.
BACKENDS = {"cpu": ["jit", "torch"], "cuda": ["jit", "triton", "torch"]}
DEV_BACKENDS = [(d, b) for d in DEVICES for b in BACKENDS[d]]


def rand(shape, dtype, device="cpu", gen=None):
    """Fresh random data of any dtype (never zeros); 1-byte types get random bytes."""
    if dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(dtype).to(device)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def as_bytes(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(-1).view(torch.uint8)


def assert_bitwise(actual, expected):
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = as_bytes(actual), as_bytes(expected)
    if not torch.equal(a, e):
        bad = (a != e).nonzero()
        raise AssertionError(f"{bad.shape[0]} bytes differ; first at byte {bad[0].tolist()}")


def slots(num_slots, n, dtype=torch.int64, device="cpu"):
    """n distinct random slots (unique: with duplicates the winner is unspecified)."""
    return torch.randperm(num_slots)[:n].to(dtype).to(device)


# Scales around the CUDA fp8 writers' quick-division window (jitkv/cuda/fp8.cuh Divider: 2^-80 <= scale
# < 2^100 divides as is, a scale outside it is first brought into it): outside, on both edges, inside.
QUICK_WINDOW_SCALES = [
    2.0**-81,
    2.0**-80,
    1.5 * 2.0**-80,
    1e-20,
    0.37,
    1.0,
    3e5,
    1.9 * 2.0**99,
    2.0**100,
    1e30,
    2.0**127,
]


def every_16_bit_value(dtype, width):
    """Every bit pattern of a 16-bit float dtype (NaNs, infinities, subnormals, ±0 included), in rows of
    ``width`` values, the last row filled from the start."""
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    rows = -(-bits.numel() // width)
    bits = torch.cat([bits, bits[: rows * width - bits.numel()]])
    return bits.view(dtype).view(rows, width)
