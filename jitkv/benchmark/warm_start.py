"""Warm start: ms from ``import jitkv`` to the first call of every op returning, in a new process with
every kernel it needs published and (on CUDA) the context already created, as in an engine that
imports jitkv after torch. Each probe is a new ``python -c`` process: ``python -m`` of a jitkv module
would import jitkv before the clock starts."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

_PROBE = """
import json, sys, time
import torch
dev, tvm_ffi_first = sys.argv[1], sys.argv[2] == "1"
if dev == "cuda":
    torch.zeros(1, device=dev); torch.cuda.synchronize()
if tvm_ffi_first:
    import tvm_ffi
g = torch.Generator().manual_seed(0)
def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=g).to(dtype).to(dev)
def raw(*shape, dtype=torch.uint8):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(dtype).to(dev)
def idx(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=dev)
slots = torch.randperm(256, generator=g)[:8].to(dev)
table = idx([2, 0, 3, 1], [1, 3, 0, 2])
calls = [
    ("set_mla_kv_buffer", dict(kv_buffer=rand(256, 576), loc=slots, cache_k_nope=rand(8, 512), cache_k_rope=rand(8, 64))),
    ("store_cache", dict(k=rand(8, 8, 128), v=rand(8, 8, 128), k_cache=raw(256, 8, 128, dtype=torch.float8_e4m3fn),
                         v_cache=raw(256, 8, 128, dtype=torch.float8_e4m3fn), slot_mapping=slots,
                         kv_cache_dtype="fp8_e4m3", k_scale=idx(0.5, dtype=torch.float32),
                         v_scale=idx(2.0, dtype=torch.float32))),
    ("quantize_and_insert_k_cache", dict(k=rand(8, 512), k_cache=raw(4, 37376), slot_mapping=slots, block_size=64)),
    ("dequantize_and_gather_k_cache", dict(out=rand(2, 100, 512), k_cache=raw(4, 37376), seq_lens=idx(90, 200),
                                           gather_lens=idx(70, 100), block_table=table, block_size=64, offset=0)),
    ("indexer_k_quant_and_cache", dict(k=rand(8, 128), kv_cache=raw(4, 8448), slot_mapping=slots, block_size=64,
                                       scale_fmt="ue8m0")),
    ("gather_indexer_k_quant_cache", dict(kv_cache=raw(4, 8448), dst_k=raw(100, 128, dtype=torch.float8_e4m3fn),
                                          dst_scale=raw(100, 4), block_table=table, cu_seq_lens=idx(0, 70, 95),
                                          block_size=64)),
    ("gather_mla_cache", dict(out=rand(50, 576), kv_cache=raw(6, 16, 576, dtype=torch.float8_e4m3fn),
                              block_table=idx([3, 0, 5], [1, 2, 4]), cu_seq_lens=idx(0, 20, 45),
                              seq_starts=idx(5, 30), kv_cache_dtype="fp8_e4m3", scale=idx(0.37, dtype=torch.float32))),
]
if dev == "cuda":
    torch.cuda.synchronize()
t0 = time.perf_counter()
import jitkv
for op, kw in calls:
    getattr(jitkv, op)(**kw)
if dev == "cuda":
    torch.cuda.synchronize()
ms = (time.perf_counter() - t0) * 1e3
info = jitkv.backend_info()
device = str(torch.device(dev, 0) if dev == "cuda" else torch.device(dev))
print("RESULT " + json.dumps({"ms": ms, "backends": {op: info[op][device]["backend"] for op, _ in calls}}))
"""


def probe(device: str, *, tvm_ffi_first: bool = False, env: dict | None = None) -> dict:
    """One new process: {"ms": float, "backends": {op: backend}}. Raises RuntimeError if it fails."""
    res = subprocess.run([sys.executable, "-c", _PROBE, device, "1" if tvm_ffi_first else "0"], capture_output=True,
                         text=True, env={**os.environ, **(env or {})})
    if res.returncode != 0 or "RESULT " not in res.stdout:
        raise RuntimeError(f"warm-start probe failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.split("RESULT ", 1)[1])


def warm_start(device: str, runs: int = 5, env: dict | None = None) -> dict:
    """Median ms over ``runs`` probes, without and with tvm_ffi imported before the clock (engines
    using FlashInfer or sglang's JIT kernels have imported it already), after one probe that
    publishes whatever the cache still lacks."""
    first = probe(device, env=env)
    out = {}
    for tvm_ffi_first, label in ((False, f"import jitkv + first call of all {len(first['backends'])} ops"),
                                 (True, "the same with tvm_ffi already imported")):
        times = [probe(device, tvm_ffi_first=tvm_ffi_first, env=env)["ms"] for _ in range(runs)]
        out[f"warm start: {label} (ms, median of {runs})"] = round(statistics.median(times), 1)
    out["warm start: backends"] = ", ".join(f"{op} {b}" for op, b in first["backends"].items())
    return out
