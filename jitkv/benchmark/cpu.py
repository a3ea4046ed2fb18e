"""CPU cases (docs/design.md §8): jit kernels against torch indexing, timed in the same process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import jitkv
from jitkv import reference

from .common import Row, time_us
from .warm_start import warm_start


def _rand(shape, dtype):
    return torch.randn(shape).to(dtype)


def copy_gbps(nbytes=256 << 20) -> float:
    """Host memory copy bandwidth, bytes read + written, of a copy_ far larger than the LLC: the best
    of 5, so that a fraction of it is conservative (the GPU benchmark's rule)."""
    src = torch.full((nbytes,), 7, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    best = min(_seconds(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * nbytes / best / 1e9


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def store_cache_rows(ns=(1, 7, 133, 4096)) -> list[Row]:
    rows = []
    kc, vc = _rand((4096, 8, 128), torch.bfloat16), _rand((4096, 8, 128), torch.bfloat16)
    for n in ns:
        k, v = _rand((n, 8, 128), torch.bfloat16), _rand((n, 8, 128), torch.bfloat16)
        idx = torch.randperm(4096)[:n]
        moved = 2 * 2 * k.numel() * 2  # K and V, read + write, 2 bytes each

        def torch_index():
            kc[idx] = k
            vc[idx] = v

        base = time_us(torch_index)
        rows.append(Row("store_cache", "[4096,8,128] bf16", n, "torch index", base, moved, base))
        us = time_us(lambda: jitkv.store_cache(k, v, kc, vc, idx))
        rows.append(Row("store_cache", "[4096,8,128] bf16", n, "jitkv jit", us, moved, base))
    return rows


def store_cache_fp8_rows(ns=(133, 4096)) -> list[Row]:
    rows = []
    kc, vc = torch.empty(4096, 8, 128, dtype=torch.float8_e4m3fn), torch.empty(4096, 8, 128, dtype=torch.float8_e4m3fn)
    for n in ns:
        k, v = _rand((n, 8, 128), torch.bfloat16), _rand((n, 8, 128), torch.bfloat16)
        idx = torch.randperm(4096)[:n]
        moved = 2 * k.numel() * (2 + 1)  # K and V: 2 bytes read, 1 written per element
        per_head = dict(k_scale=torch.linspace(0.5, 1.5, 8), v_scale=torch.linspace(0.25, 2.0, 8))
        for case, scales in (("bf16->e4m3", dict(k_scale=0.5, v_scale=0.25)), ("bf16->e4m3 per-head", per_head)):
            kw = dict(kv_cache_dtype="fp8_e4m3", **scales)
            base = time_us(lambda: reference.store_cache(k, v, kc, vc, idx, **kw))
            rows.append(Row("store_cache fp8", f"[4096,8,128] {case}", n, "torch reference", base, moved, base))
            us = time_us(lambda: jitkv.store_cache(k, v, kc, vc, idx, **kw))
            rows.append(Row("store_cache fp8", f"[4096,8,128] {case}", n, "jitkv jit", us, moved, base))
    return rows


def large_cache_rows(num_rows=1 << 20, n=65536) -> list[Row]:
    """A cache far larger than the LLC: K and V caches of 512 Ki rows x 1152 B (1.2 GB together)."""
    half = num_rows // 2
    kc, vc = _rand((half, 576), torch.bfloat16), _rand((half, 576), torch.bfloat16)
    k, v = _rand((n, 576), torch.bfloat16), _rand((n, 576), torch.bfloat16)
    idx = torch.randperm(half)[:n]
    payload = 2 * k.numel() * 2
    src, dst = torch.cat([k, v]), torch.empty(2 * n, 576, dtype=torch.bfloat16)
    copy_us = time_us(lambda: dst.copy_(src), min_time=1.0)
    copy_gbps = 2 * payload / copy_us.median_us / 1e3
    rows = [Row("copy_", "same payload bytes", n, "torch copy_", copy_us, 2 * payload, None, copy_gbps)]

    def torch_index():
        kc[idx] = k
        vc[idx] = v

    base = time_us(torch_index, min_time=1.0)
    rows.append(Row("store_cache", "1.2 GB cache, 1152 B rows", n, "torch index", base, 2 * payload, base, copy_gbps))
    us = time_us(lambda: jitkv.store_cache(k, v, kc, vc, idx), min_time=1.0)
    rows.append(Row("store_cache", "1.2 GB cache, 1152 B rows", n, "jitkv jit", us, 2 * payload, base, copy_gbps))
    return rows


def mla_rows(ns=(1, 133, 4096)) -> list[Row]:
    rows = []
    buf = _rand((65536, 576), torch.bfloat16)
    for n in ns:
        nope, rope = _rand((n, 512), torch.bfloat16), _rand((n, 64), torch.bfloat16)
        loc = torch.randperm(65536)[:n]
        moved = 2 * n * 576 * 2

        def torch_index():
            buf[loc, :512] = nope
            buf[loc, 512:] = rope

        base = time_us(torch_index)
        rows.append(Row("set_mla_kv_buffer", "512+64 bf16", n, "torch index", base, moved, base))
        us = time_us(lambda: jitkv.set_mla_kv_buffer(buf, loc, nope, rope))
        rows.append(Row("set_mla_kv_buffer", "512+64 bf16", n, "jitkv jit", us, moved, base))
    return rows


def indexer_rows(ns=(1, 133, 4096)) -> list[Row]:
    """The indexer K cache writer (ue8m0) and the gather of one request, against the torch reference."""
    bs, nb = 64, 1024
    cache = jitkv.INDEXER_K_CACHE.allocate(nb, bs, "cpu").random_(0, 256)
    rows = []
    for n in ns:
        k, sm = _rand((n, 128), torch.bfloat16), torch.randperm(nb * bs)[:n]
        kw = dict(block_size=bs, scale_fmt="ue8m0")
        moved = n * (2 * 128 + 132)
        base = time_us(lambda: reference.indexer_k_quant_and_cache(k, cache, sm, **kw))
        rows.append(Row("indexer_k_quant_and_cache", "bf16, block_size 64, ue8m0", n, "torch reference", base, moved, base))
        us = time_us(lambda: jitkv.indexer_k_quant_and_cache(k, cache, sm, **kw))
        rows.append(Row("indexer_k_quant_and_cache", "bf16, block_size 64, ue8m0", n, "jitkv jit", us, moved, base))
    for n in (2048, 16384):
        table = torch.randperm(nb)[: n // bs].int()[None]
        cu = torch.tensor([0, n], dtype=torch.int32)
        dst_k, dst_scale = torch.empty(n, 128, dtype=torch.uint8), torch.empty(n, dtype=torch.float32)
        moved = n * 2 * 132
        args = (cache, dst_k, dst_scale, table, cu)
        base = time_us(lambda: reference.gather_indexer_k_quant_cache(*args, block_size=bs))
        rows.append(Row("gather_indexer_k_quant_cache", "1 request", n, "torch reference", base, moved, base))
        us = time_us(lambda: jitkv.gather_indexer_k_quant_cache(*args, block_size=bs))
        rows.append(Row("gather_indexer_k_quant_cache", "1 request", n, "jitkv jit", us, moved, base))
    return rows


def mla_gather_rows(reqs=4, tokens=1024, block_size=64) -> list[Row]:
    """gather_mla_cache: reqs x tokens of 576 bf16 from random blocks, copied and from fp8_e4m3."""
    rows = []
    nblk = tokens // block_size
    table = torch.randperm(2 * reqs * nblk)[: reqs * nblk].view(reqs, nblk).int()
    cu = torch.arange(0, (reqs + 1) * tokens, tokens, dtype=torch.int32)
    out = torch.empty(reqs * tokens, 576, dtype=torch.bfloat16)
    for fmt, cache in (("auto", _rand((2 * reqs * nblk, block_size, 576), torch.bfloat16)),
                       ("fp8_e4m3", _rand((2 * reqs * nblk, block_size, 576), torch.float8_e4m3fn))):
        kw = dict(kv_cache_dtype=fmt, scale=0.5 if fmt != "auto" else None)
        moved = reqs * tokens * 576 * (cache.element_size() + 2)
        case = f"{reqs} req x {tokens}, {fmt}"
        base = time_us(lambda: reference.gather_mla_cache(out, cache, table, cu, **kw))
        rows.append(Row("gather_mla_cache", case, reqs * tokens, "torch reference", base, moved, base))
        us = time_us(lambda: jitkv.gather_mla_cache(out, cache, table, cu, **kw))
        rows.append(Row("gather_mla_cache", case, reqs * tokens, "jitkv jit", us, moved, base))
    return rows


def mla_fp8_rows(ns=(1, 133, 4096)) -> list[Row]:
    rows = []
    for fmt, width in (("fp8_e4m3", 576), ("fp8_ds_mla", 656)):
        buf = torch.zeros(65536, width, dtype=torch.uint8)
        kw = dict(kv_cache_dtype=fmt, scale=None if fmt == "fp8_ds_mla" else 0.37)
        for n in ns:
            nope, rope = _rand((n, 512), torch.bfloat16), _rand((n, 64), torch.bfloat16)
            loc = torch.randperm(65536)[:n]
            moved = n * (1152 + width)
            base = time_us(lambda: reference.set_mla_kv_buffer_fp8(buf, loc, nope, rope, **kw))
            rows.append(Row("set_mla_kv_buffer", f"512+64 bf16 -> {fmt}", n, "torch reference", base, moved, base))
            us = time_us(lambda: jitkv.set_mla_kv_buffer(buf, loc, nope, rope, **kw))
            rows.append(Row("set_mla_kv_buffer", f"512+64 bf16 -> {fmt}", n, "jitkv jit", us, moved, base))
    return rows


def build_timings() -> dict:
    """Cold build of each CPU module in an empty cache, then new processes that find them published."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "JITKV_CACHE_DIR": cache, "JITKV_LOG_LEVEL": "WARNING"}
        res = subprocess.run([sys.executable, "-m", "jitkv", "prebuild"], capture_output=True, text=True, env=env)
        if res.returncode != 0:
            return {"error": res.stderr[-2000:]}
        for d in sorted(os.listdir(cache)):
            m = os.path.join(cache, d, "manifest.json")
            if os.path.isfile(m):
                with open(m) as f:
                    man = json.load(f)
                out[f"cold build {man['op']} (s)"] = man["seconds"]
        out.update(warm_start("cpu", env=env))
    return out
