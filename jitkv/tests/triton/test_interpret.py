"""The Triton fallbacks under TRITON_INTERPRET=1 (runs on CPU, so CI exercises them without a GPU).

Each check runs in a subprocess because the interpreter is chosen when @triton.jit decorates."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("numpy")  # the interpreter computes with numpy (the test extra installs both)
REPO = Path(__file__).resolve().parents[3]

MLA = """
import torch
from jitkv import reference
from jitkv.tests.conftest import assert_bitwise, rand, slots
from jitkv.triton.mla import set_mla_kv_buffer_triton
for dtype, nope, rope, width in ((torch.bfloat16, 512, 64, 600), (torch.uint8, 528, 128, 656), (torch.float8_e4m3fn, 512, 64, 576)):
    buf = rand((300, width), dtype)
    k_nope, k_rope = rand((40, nope), dtype), rand((40, rope), dtype)
    loc = slots(300, 37, torch.int32)
    loc[::5] = -1
    loc[3] = 7
    loc[4] = 300  # out of range: never written
    got, ref = buf.clone(), buf.clone()
    set_mla_kv_buffer_triton(got, loc, k_nope, k_rope, 7)
    keep = torch.ones(37, dtype=torch.bool); keep[4] = False
    reference.set_mla_kv_buffer(ref, loc[keep], k_nope[:37][keep], k_rope[:37][keep], skip_slot=7)
    assert_bitwise(got, ref)
print("OK")
"""

DSV4 = """
import torch
from jitkv import DSV4_K_CACHE, reference
from jitkv.tests.conftest import assert_bitwise, rand, slots
from jitkv.triton.dsv4 import dequantize_and_gather_k_cache_triton, quantize_and_insert_k_cache_triton
for bs, stride in ((64, None), (2, None), (64, 64 * 584)):  # padded, and vLLM's unpadded blocks
    cache = DSV4_K_CACHE.allocate(24, bs, "cpu", block_stride=stride).random_(0, 256)
    k = (torch.randn(50, 512) * torch.logspace(-3, 2, 50)[:, None]).bfloat16()
    sm = slots(24 * bs, 45)
    sm[::6] = -1
    got, ref = cache.clone(), cache.clone()
    quantize_and_insert_k_cache_triton(k, got, sm, bs)
    reference.quantize_and_insert_k_cache(k, ref, sm, block_size=bs)
    assert_bitwise(got, ref)
    seq = torch.tensor([5 * bs - 3, 2 * bs], dtype=torch.int32)
    gl = torch.tensor([3 * bs, 2 * bs + 9], dtype=torch.int32)
    table = torch.randperm(24)[:10].view(2, 5).int()
    table[1, 0] = -1
    out = rand((2, 4 * bs, 512), torch.bfloat16)
    expect = out.clone()
    dequantize_and_gather_k_cache_triton(out, got, seq, gl, table, bs, 5)
    reference.dequantize_and_gather_k_cache(expect, ref, seq, gl, table, bs, 5)
    assert_bitwise(out, expect)
print("OK")
"""

INDEXER = """
import torch
from jitkv import INDEXER_K_CACHE, reference
from jitkv.tests.conftest import assert_bitwise, rand, slots
from jitkv.triton.indexer import gather_indexer_k_quant_cache_triton, indexer_k_quant_and_cache_triton
for bs, stride in ((64, None), (3, 3 * 132)):  # jitkv's blocks, and vLLM's 396-byte ones
    for dtype, ue8m0 in ((torch.bfloat16, True), (torch.float16, False)):
        cache = INDEXER_K_CACHE.allocate(10, bs, "cpu", block_stride=stride).random_(0, 256)
        k = (torch.randn(30, 128) * torch.logspace(-3, 2, 30)[:, None]).to(dtype)
        k[0, 3], k[1], k[2, 5], k[3] = float("nan"), float("nan"), float("inf"), 0.0
        sm = slots(10 * bs, 27)
        sm[::6] = -1
        got, ref = cache.clone(), cache.clone()
        indexer_k_quant_and_cache_triton(k, got, sm, bs, ue8m0)
        reference.indexer_k_quant_and_cache(k, ref, sm, block_size=bs, scale_fmt="ue8m0" if ue8m0 else None)
        assert_bitwise(got, ref)
    cu = torch.tensor([2, 9, 9, 3 * bs + 4], dtype=torch.int32)
    table = torch.randperm(10)[:9].view(3, 3).int()
    table[0, 0], table[2, 1] = -1, 10
    dst_k, dst_scale = rand((3 * bs + 9, 128), torch.uint8), rand((3 * bs + 9, 4), torch.uint8)
    want_k, want_scale = dst_k.clone(), dst_scale.clone()
    gather_indexer_k_quant_cache_triton(got, dst_k, dst_scale, table, cu, bs)
    reference.gather_indexer_k_quant_cache(got, want_k, want_scale, table, cu, block_size=bs)
    assert_bitwise(dst_k, want_k)
    assert_bitwise(dst_scale, want_scale)
print("OK")
"""

STORE_CACHE = """
import torch
from jitkv import reference
from jitkv.tests.conftest import assert_bitwise, rand, slots
from jitkv.triton.store_cache import store_cache_triton
n, h, d = 21, 4, 64
for kv_dtype, cdt in (("auto", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.uint8)):
    k, v = rand((n + 3, h, d), torch.bfloat16) * 300, rand((n + 3, h, d), torch.bfloat16)
    kc = rand((6, h, 8, d), cdt).permute(0, 2, 1, 3)  # paged HND
    vc = rand((6, 8, h, d), cdt)  # paged NHD
    sm = slots(48, n)
    sm[::4] = -1
    loc_map = torch.randperm(48)
    loc_map[sm[1]] = -1
    # one scale per side; then per-head scales, V's a strided view
    per_head = (torch.rand(h) * 3 + 0.05, (torch.rand(2 * h) * 3 + 0.05)[::2])
    for k_scale, v_scale in ((torch.tensor([0.37]),) * 2, per_head)[: 1 if kv_dtype == "auto" else 2]:
        got_k, got_v, ref_k, ref_v = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        store_cache_triton(k, v, got_k, got_v, sm, loc_map, 5, kv_dtype, k_scale, v_scale)
        kw = {} if kv_dtype == "auto" else dict(k_scale=k_scale, v_scale=v_scale)
        reference.store_cache(k, v, ref_k, ref_v, sm, kv_cache_dtype=kv_dtype, loc_map=loc_map, skip_slot=5, **kw)
        assert_bitwise(got_k, ref_k)
        assert_bitwise(got_v, ref_v)
print("OK")
"""

MLA_GATHER = """
import torch
from jitkv import reference
from jitkv.ops.mla_gather import FORMATS
from jitkv.tests.conftest import assert_bitwise, rand
from jitkv.tests.ops.test_mla_gather import _cache, _requests
from jitkv.triton.mla_gather import gather_mla_cache_triton
for fmt, dtype, width in (("auto", torch.bfloat16, 576), ("auto", torch.uint8, 100), ("fp8_e4m3", torch.float8_e4m3fn, 576),
                          ("fp8_e5m2", torch.uint8, 576), ("fp8_ds_mla", torch.uint8, 656)):
    bs, nb = 8, 24
    table, cu, starts = _requests([21, 0, 30, 9], bs, nb, "cpu", max_blocks=4, starts=[3, 0, -2, 1])
    table[0, 1] = -1
    table[3, 0] = nb
    cache = _cache(fmt, dtype, width, nb, bs, "cpu", pad=16)
    d = 576 if fmt != "auto" else width
    out = rand((64, d), dtype if fmt == "auto" else torch.bfloat16)[:55]
    cu += 3  # rows 0..2 are no request's, rows past 55 are clipped: neither is written
    for scale in ((0.37, torch.tensor([2.5])) if fmt.startswith("fp8_e") else (None,)):
        got, want = out.clone(), out.clone()
        gather_mla_cache_triton(got, cache, table, cu, starts, FORMATS[fmt], scale)
        reference.gather_mla_cache(want, cache, table, cu, seq_starts=starts, kv_cache_dtype=fmt, scale=scale, strict=False)
        assert_bitwise(got, want)
print("OK")
"""

MLA_FP8 = """
import torch
from jitkv import reference
from jitkv.tests.conftest import assert_bitwise, rand, slots
from jitkv.tests.ops.test_mla_fp8 import values, with_specials
from jitkv.triton.mla import set_mla_kv_buffer_fp8_triton
for fmt, src, cdt, width in (("fp8_e4m3", torch.bfloat16, torch.float8_e4m3fn, 600), ("fp8_e5m2", torch.float16, torch.uint8, 576),
                             ("fp8_ds_mla", torch.bfloat16, torch.uint8, 660), ("fp8_ds_mla", torch.float16, torch.uint8, 656)):
    buf = rand((300, width), cdt)
    x = with_specials(values((40, 700), src))
    k_nope, k_rope = x[:, 16:528], x[:, 600:664]  # strided views, extra rows
    loc = slots(300, 37, torch.int64)
    loc[::5] = -1
    loc[3] = 7
    loc[4] = 300  # out of range: never written
    scale = None if fmt == "fp8_ds_mla" else torch.tensor([0.37])
    got, ref = buf.clone(), buf.clone()
    set_mla_kv_buffer_fp8_triton(got, loc, k_nope, k_rope, 7, fmt, scale)
    keep = torch.ones(37, dtype=torch.bool); keep[4] = False
    reference.set_mla_kv_buffer_fp8(ref, loc[keep], k_nope[:37][keep], k_rope[:37][keep], kv_cache_dtype=fmt,
                                    scale=scale, skip_slot=7)
    assert_bitwise(got, ref)
print("OK")
"""

CASES = {"mla": MLA, "dsv4": DSV4, "store_cache": STORE_CACHE, "indexer": INDEXER, "mla_gather": MLA_GATHER,
         "mla_fp8": MLA_FP8}


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_under_interpreter(name):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(CASES[name])], capture_output=True, text=True,
                         env=env, timeout=900)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]
