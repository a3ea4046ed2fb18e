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
import tempfile

import torch

_PROBE = """
import json, sys, time
import torch
path, dev, tvm_ffi_first = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if dev == "cuda":
    torch.zeros(1, device=dev); torch.cuda.synchronize()
if tvm_ffi_first:
    import tvm_ffi
calls = [(op, {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
         for op, kw in torch.load(path).items()]
if dev == "cuda":
    torch.cuda.synchronize()
t0 = time.perf_counter()
import jitkv
t_import = time.perf_counter()
firsts = {}
for op, kw in calls:
    t = time.perf_counter()
    getattr(jitkv, op)(**kw)
    firsts[op] = (time.perf_counter() - t) * 1e3
if dev == "cuda":
    torch.cuda.synchronize()
ms = (time.perf_counter() - t0) * 1e3
info = jitkv.backend_info()
device = str(torch.device(dev, 0) if dev == "cuda" else torch.device(dev))
print("RESULT " + json.dumps({"ms": ms, "import_ms": (t_import - t0) * 1e3, "first_call_ms": firsts,
                              "backends": {op: info[op][device]["backend"] for op, _ in calls}}))
"""


def _samples(path: str) -> None:
    """Every op's sample call (on the CPU; the probe moves it to its device), saved for the probes, which
    must not import jitkv before their clock starts."""
    from jitkv.ops import OPS

    gen = torch.Generator().manual_seed(0)
    torch.save({name: op.sample("cpu", gen) for name, op in OPS.items()}, path)


def probe(device: str, samples: str, *, tvm_ffi_first: bool = False, env: dict | None = None) -> dict:
    """One new process: {"ms", "import_ms", "first_call_ms": {op: ms}, "backends": {op: backend}}.
    Raises RuntimeError if it fails. Bytecode is written (PYTHONDONTWRITEBYTECODE dropped), as an
    installed package has it: the first probe writes it, later ones time what an engine sees."""
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "PYTHONDONTWRITEBYTECODE"}
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, samples, device, "1" if tvm_ffi_first else "0"],
        capture_output=True,
        text=True,
        env=env,
    )
    if res.returncode != 0 or "RESULT " not in res.stdout:
        raise RuntimeError(f"warm-start probe failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.split("RESULT ", 1)[1])


def warm_start(device: str, runs: int = 5, env: dict | None = None) -> dict:
    """Median ms over ``runs`` probes, without and with tvm_ffi imported before the clock (engines
    using FlashInfer or sglang's JIT kernels have imported it already), after one probe that
    publishes whatever the cache still lacks; with tvm_ffi first, also the median import and the
    median first call of each op."""
    with tempfile.TemporaryDirectory() as tmp:
        samples = os.path.join(tmp, "samples.pt")
        _samples(samples)
        first = probe(device, samples, env=env)
        out = {}
        for tvm_ffi_first, label in (
            (False, f"import jitkv + first call of all {len(first['backends'])} ops"),
            (True, "the same with tvm_ffi already imported"),
        ):
            runs_ = [probe(device, samples, tvm_ffi_first=tvm_ffi_first, env=env) for _ in range(runs)]
            out[f"warm start: {label} (ms, median of {runs})"] = _median(r["ms"] for r in runs_)
        out["warm start, tvm_ffi first: import jitkv (ms)"] = _median(r["import_ms"] for r in runs_)
        for op in first["backends"]:
            out[f"warm start, tvm_ffi first: first {op} (ms)"] = _median(r["first_call_ms"][op] for r in runs_)
    out["warm start: backends"] = ", ".join(f"{op} {b}" for op, b in first["backends"].items())
    return out


def _median(values) -> float:
    return round(statistics.median(values), 1)
