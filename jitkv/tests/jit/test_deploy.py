"""Deployable: no compiler, layered and read-only caches, relocation, integrity, trust, warm start."""

from __future__ import annotations

import json
import os
import textwrap
import warnings
from pathlib import Path

import pytest

from jitkv.jit import toolchain
from jitkv.tests.jit.conftest import NO_COMPILER, run_cli, run_py

# Every CPU jit op (set_mla_kv_buffer, store_cache copy and fp8) on its first call in a new process:
# prints the ms from `import jitkv` returning to the last call returning, correctness against the
# reference, backend_info and the warnings raised.
OPS = textwrap.dedent(
    """
    import json, time, warnings
    import torch
    g = torch.Generator().manual_seed(0)
    loc = torch.randperm(64, generator=g)[:8]
    buf = torch.zeros(64, 576, dtype=torch.bfloat16)
    nope, rope = torch.randn(8, 512, generator=g).bfloat16(), torch.randn(8, 64, generator=g).bfloat16()
    k, v = torch.randn(8, 4, 64, generator=g).bfloat16(), torch.randn(8, 4, 64, generator=g).bfloat16()
    copy = [torch.zeros(64, 4, 64, dtype=torch.bfloat16) for _ in range(2)]
    fp8 = [torch.zeros(64, 4, 64, dtype=torch.float8_e4m3fn) for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import jitkv
        t0 = time.perf_counter()
        jitkv.set_mla_kv_buffer(buf, loc, nope, rope)
        jitkv.store_cache(k, v, *copy, loc)
        jitkv.store_cache(k, v, *fp8, loc, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=0.25)
        ms = (time.perf_counter() - t0) * 1e3
    from jitkv import reference
    ref = torch.zeros_like(buf); reference.set_mla_kv_buffer(ref, loc, nope, rope)
    ok = torch.equal(ref, buf)
    ref = [torch.zeros_like(c) for c in copy]; reference.store_cache(k, v, *ref, loc)
    ok = ok and all(torch.equal(a, b) for a, b in zip(ref, copy))
    ref = [torch.zeros_like(c) for c in fp8]
    reference.store_cache(k, v, *ref, loc, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=0.25)
    ok = ok and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ref, fp8))
    info = {op: d["cpu"] for op, d in jitkv.backend_info().items()}
    print("RESULT " + json.dumps({"ms": ms, "correct": ok, "info": info, "warnings": [str(w.message) for w in caught]}))
    """
)
OPS_NAMES = ("set_mla_kv_buffer", "store_cache")


def _ops(cache, **env) -> dict:
    res = run_py(OPS, cache, **env)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.split("RESULT ", 1)[1])
    assert out["correct"], out
    out["stderr"] = res.stderr
    return out


def _backends(out: dict) -> dict:
    return {op: out["info"][op]["backend"] for op in OPS_NAMES}


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """A cache holding every CPU artifact (for tests to copy; never written after this)."""
    cache = tmp_path_factory.mktemp("published")
    res = run_cli("prebuild", cache=cache)
    assert res.returncode == 0, res.stderr
    return cache



# ------------------------------------------------------------------------------------ no compiler


def test_key_does_not_probe_the_compiler(monkeypatch):
    from jitkv.ops import mla  # noqa: PLC0415

    key = mla.cpu_spec().key()
    monkeypatch.setenv("CXX", NO_COMPILER["CXX"])
    assert mla.cpu_spec().key() == key
    assert not {"cxx", "nvcc"} & set(mla.cpu_spec().key_components())


def test_no_compiler_loads_every_published_artifact(published):
    out = _ops(published, **NO_COMPILER)
    assert _backends(out) == {"set_mla_kv_buffer": "jit", "store_cache": "jit"}
    assert out["warnings"] == [], out["warnings"]
    res = run_py(
        """
        from jitkv.jit import JitUnavailable, get_module, is_built
        from jitkv.ops import mla
        spec = mla.cuda_spec("9.0a", 1024, 128)
        print("BUILT", is_built(spec))
        try:
            get_module(spec)
        except JitUnavailable as e:
            print("REASON", e.reason)
        """,
        published,
        **NO_COMPILER,
    )
    assert res.returncode == 0, res.stderr
    assert "BUILT False" in res.stdout and "no compiler (nvcc not found) and no prebuilt artifact" in res.stdout


def test_no_compiler_and_nothing_published_falls_back_with_one_warning(tmp_path):
    out = _ops(tmp_path / "cache", **NO_COMPILER)
    assert _backends(out) == {"set_mla_kv_buffer": "torch", "store_cache": "torch"}
    text = f"no compiler ({NO_COMPILER['CXX']} not found) and no prebuilt artifact"
    assert len(out["warnings"]) == 2 and all(text in w for w in out["warnings"]), out["warnings"]
    assert all(text in out["info"][op]["reason"] for op in OPS_NAMES)


def test_manifest_records_the_compiler_and_info_shows_it(published):
    manifests = [json.loads(p.read_text()) for p in published.glob("*/manifest.json")]
    assert len(manifests) == 2
    for m in manifests:
        cxx = m["compilers"]["cxx"]
        assert os.path.isabs(cxx["path"]) and cxx["version"] == toolchain.compiler_version(toolchain.cxx())
    info = run_cli("info", cache=published, **NO_COMPILER)
    assert info.returncode == 0, info.stderr
    assert info.stdout.count(f"with {manifests[0]['compilers']['cxx']['version']}") == 2


# ------------------------------------------------------------------------------------- log level


def test_bad_log_level_env_warns_and_import_works(tmp_path):
    res = run_py("import logging, jitkv; print('LEVEL', logging.getLogger('jitkv').level)", tmp_path, JITKV_LOG_LEVEL="bogus")
    assert res.returncode == 0, res.stderr
    assert "LEVEL 20" in res.stdout and res.stderr.count("JITKV_LOG_LEVEL") == 1, res.stderr


@pytest.mark.parametrize("value, level", [("10", 10), ("debug", 10), ("Warning", 30), (" error ", 40)])
def test_log_level_env_values(value, level):
    import jitkv  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jitkv._log_level(value) == level
