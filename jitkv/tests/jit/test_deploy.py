"""Deployable: no compiler, layered and read-only caches, relocation, integrity, trust, warm start."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
import warnings
from pathlib import Path

import pytest

from jitkv.jit import toolchain
from jitkv.prebuild import specs_for
from jitkv.tests.jit.conftest import NO_COMPILER, needs_root, run_cli, run_py

# set_mla_kv_buffer and store_cache (copy and fp8) on the CPU in a new process: prints correctness
# against the reference, backend_info and the warnings raised.
OPS = textwrap.dedent(
    """
    import json, warnings
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
        jitkv.set_mla_kv_buffer(buf, loc, nope, rope)
        jitkv.store_cache(k, v, *copy, loc)
        jitkv.store_cache(k, v, *fp8, loc, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=0.25)
    from jitkv import reference
    ref = torch.zeros_like(buf); reference.set_mla_kv_buffer(ref, loc, nope, rope)
    ok = torch.equal(ref, buf)
    ref = [torch.zeros_like(c) for c in copy]; reference.store_cache(k, v, *ref, loc)
    ok = ok and all(torch.equal(a, b) for a, b in zip(ref, copy))
    ref = [torch.zeros_like(c) for c in fp8]
    reference.store_cache(k, v, *ref, loc, kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=0.25)
    ok = ok and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ref, fp8))
    info = {op: d["cpu"] for op, d in jitkv.backend_info().items()}
    print("RESULT " + json.dumps({"correct": ok, "info": info, "warnings": [str(w.message) for w in caught]}))
    """
)
OPS_NAMES = ("set_mla_kv_buffer", "store_cache")
CPU_MODULES = len(specs_for("cpu"))  # what prebuild builds for the CPU


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


def _copy(published: Path, dst: Path) -> Path:
    shutil.copytree(published, dst, ignore=shutil.ignore_patterns("locks", "staging"))
    return dst


def _read_only(root: Path) -> None:
    """chmod -R a-w (root ignores the bits, so jitkv must honour the owner's missing write bit)."""
    for path in [root, *root.rglob("*")]:
        os.chmod(path, path.stat().st_mode & ~0o222)


def _mla_lib(cache: Path) -> Path:
    (lib,) = cache.glob("mla_cpu_*/*.so")
    return lib


def _truncate(lib: Path) -> None:
    os.truncate(lib, lib.stat().st_size // 2)


# ------------------------------------------------------------------------------------ no compiler


def test_key_does_not_probe_the_compiler(monkeypatch):
    from jitkv.ops import mla

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
    assert len(manifests) == CPU_MODULES
    for m in manifests:
        cxx = m["compilers"]["cxx"]
        assert os.path.isabs(cxx["path"]) and cxx["version"] == toolchain.compiler_version(toolchain.cxx())
    info = run_cli("info", cache=published, **NO_COMPILER)
    assert info.returncode == 0, info.stderr
    assert info.stdout.count(f"with {manifests[0]['compilers']['cxx']['version']}") == CPU_MODULES


# ---------------------------------------------------------------------------------------- layers


def test_relocated_read_only_layer_is_used_as_is(published, tmp_path):
    image = _copy(published, tmp_path / "moved" / "image")
    _read_only(image)
    writable = tmp_path / "user"
    out = _ops([image, writable], **NO_COMPILER)
    assert _backends(out) == {"set_mla_kv_buffer": "jit", "store_cache": "jit"}
    assert all(out["info"][op]["artifact"].startswith(str(image) + os.sep) for op in OPS_NAMES)
    assert out["warnings"] == [] and "jitkv" not in out["stderr"], out
    assert not writable.exists()  # nothing to build: the write layer is never even created


def test_prebuild_out_writes_a_relocatable_cache(tmp_path):
    out = tmp_path / "out"
    res = run_cli("prebuild", "--out", str(out), cache=tmp_path / "user")
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "user").exists()
    artifacts = [p for p in out.iterdir() if (p / "manifest.json").is_file()]
    assert len(artifacts) == CPU_MODULES
    for artifact in artifacts:
        lib = json.loads((artifact / "manifest.json").read_text())["lib"]
        assert sorted(os.listdir(artifact)) == sorted([lib, "manifest.json"])  # no build files
        for path in artifact.iterdir():
            assert str(out).encode() not in path.read_bytes(), path
    moved = tmp_path / "elsewhere" / "image"
    shutil.move(out, moved)
    assert _backends(_ops(moved, **NO_COMPILER)) == {"set_mla_kv_buffer": "jit", "store_cache": "jit"}


def test_builds_go_to_the_first_writable_layer(tmp_path):
    read_only, writable = tmp_path / "ro", tmp_path / "rw"
    read_only.mkdir()
    _read_only(read_only)
    out = _ops([read_only, writable])
    assert _backends(out) == {"set_mla_kv_buffer": "jit", "store_cache": "jit"}
    assert all(out["info"][op]["artifact"].startswith(str(writable) + os.sep) for op in OPS_NAMES)
    assert out["stderr"].count("jitkv: building") == 2 and out["warnings"] == []
    assert not any(read_only.iterdir())
    for private in ("locks", "staging"):
        assert (writable / private).stat().st_mode & 0o777 == 0o700


def test_cache_verify_checks_every_layer(published, tmp_path):
    first, second = _copy(published, tmp_path / "a"), _copy(published, tmp_path / "b")
    res = run_cli("cache", "verify", cache=[first, second])
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("ok ") == 2 * CPU_MODULES
    _truncate(_mla_lib(second))
    res = run_cli("cache", "verify", cache=[first, second])
    assert res.returncode == 1
    lines = res.stdout.splitlines()
    assert len(lines) == 2 * CPU_MODULES and [ln.split()[0] for ln in lines].count("DAMAGED") == 1
    assert str(_mla_lib(second).parent) in next(ln for ln in lines if ln.startswith("DAMAGED"))


# ------------------------------------------------------------------------------------- integrity


def test_truncated_library_is_set_aside_and_rebuilt(published, tmp_path):
    cache = _copy(published, tmp_path / "cache")
    _truncate(_mla_lib(cache))
    out = _ops(cache)  # before: dlopen of the truncated file killed the process (SIGBUS)
    assert _backends(out) == {"set_mla_kv_buffer": "jit", "store_cache": "jit"}
    warned = [ln for ln in out["stderr"].splitlines() if "not using" in ln]
    assert len(warned) == 1 and "rebuilding mla_cpu" in warned[0] and out["warnings"] == [], out["stderr"]
    assert "jitkv: building mla_cpu" in out["stderr"]
    assert len(list((cache / "damaged").iterdir())) == 1
    again = _ops(cache)
    assert _backends(again) == {"set_mla_kv_buffer": "jit", "store_cache": "jit"}
    assert "jitkv" not in again["stderr"] and again["warnings"] == [], again["stderr"]


def test_damaged_artifact_in_read_only_layer_without_compiler_falls_back(published, tmp_path):
    cache = _copy(published, tmp_path / "cache")
    _truncate(_mla_lib(cache))
    _read_only(cache)
    out = _ops(cache, **NO_COMPILER, TMPDIR=str(tmp_path))
    assert _backends(out) == {"set_mla_kv_buffer": "torch", "store_cache": "jit"}
    layer, fallback = out["warnings"]  # the miss looks in the temp dir earlier processes may have built into
    assert layer.startswith(f"jitkv: cache dir {cache} is read-only") and str(tmp_path / "jitkv-") in layer, layer
    assert "manifest says" in fallback and "no compiler" in fallback
    assert _mla_lib(cache).is_file() and not (cache / "damaged").exists()


# ----------------------------------------------------------------------------------------- trust


@needs_root
@pytest.mark.parametrize("change", ["foreign owner", "world-writable"])
@pytest.mark.parametrize("where", ["layer", "artifact", "library"])
def test_untrusted_cache_is_never_loaded(published, tmp_path, where, change):
    cache = _copy(published, tmp_path / "cache")
    target = {"layer": cache, "artifact": _mla_lib(cache).parent, "library": _mla_lib(cache)}[where]
    if change == "foreign owner":
        os.chown(target, 65534, 65534)
    else:
        os.chmod(target, 0o777)
    out = _ops(cache, JITKV_DISABLE_JIT="1", TMPDIR=str(tmp_path))
    assert out["info"]["set_mla_kv_buffer"]["backend"] == "torch"
    why = "owned by uid 65534" if change == "foreign owner" else "group/world-writable"
    assert any(why in text for text in [*out["warnings"], out["info"]["set_mla_kv_buffer"]["reason"]]), out


@needs_root
@pytest.mark.parametrize("kind", ["foreign owner", "mode 777", "symlink"])
def test_unsafe_temp_fallback_is_refused(tmp_path, kind):
    fallback = tmp_path / f"jitkv-{os.geteuid()}"
    if kind == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        fallback.symlink_to(tmp_path / "elsewhere")
    else:
        fallback.mkdir(mode=0o700)
        os.chown(fallback, 65534, 65534) if kind == "foreign owner" else os.chmod(fallback, 0o777)
    blocker = tmp_path / "file"
    blocker.write_text("a dir below a file cannot be created, even by root")
    out = _ops(blocker / "cache", TMPDIR=str(tmp_path))
    assert _backends(out) == {"set_mla_kv_buffer": "torch", "store_cache": "torch"}
    assert sum("refusing temp cache dir" in w for w in out["warnings"]) == 1, out["warnings"]
    assert not any(fallback.iterdir())


# ------------------------------------------------------------------------------------ warm start


# A new process runs every op once on the CPU and prints which backend each took, whether each result
# matches the reference, which files it read (source scans) and which libraries it hashed.
WARM = textwrap.dedent(
    """
    import collections, json, pathlib, warnings
    import torch
    from jitkv.jit import build
    from jitkv.tests import op_calls
    from jitkv.tests.conftest import as_bytes
    reads, hashed = collections.Counter(), []
    read_bytes, sha256 = pathlib.Path.read_bytes, build._sha256
    pathlib.Path.read_bytes = lambda self: reads.update([str(self)]) or read_bytes(self)
    build._sha256 = lambda path: hashed.append(path.name) or sha256(path)
    correct = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for op in op_calls.OP_NAMES:
            args = op_calls.make_args(op, "cpu")
            want = op_calls.expected(op, args)
            op_calls.run(op, args)
            correct[op] = all(torch.equal(as_bytes(args[d]), as_bytes(w))
                              for d, w in zip(op_calls.DESTINATIONS[op], want))
    info = {op: d["cpu"]["backend"] for op, d in __import__("jitkv").backend_info().items()}
    print("RESULT " + json.dumps({"correct": correct, "backends": info, "reads": reads, "hashed": hashed,
                                  "warnings": [str(w.message) for w in caught]}))
    """
)


def _warm(cache, **env) -> dict:
    res = run_py(WARM, cache, **env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.split("RESULT ", 1)[1])


def test_warm_start_reads_each_source_once_and_hashes_no_untouched_library(published, tmp_path):
    """What keeps a warm start short (python -m jitkv.benchmark's build section times it): in a new
    process with everything published in a read-only image and no compiler, every op runs its jit
    kernel (where the CPU has one), each source of the keys is read once, and libraries that keep the
    mtime their manifest recorded are loaded without hashing them."""
    from jitkv.tests.op_calls import BACKENDS

    image = _copy(published, tmp_path / "image")  # copytree keeps mtimes, as tar and image layers do
    _read_only(image)
    out = _warm(image, **NO_COMPILER)
    assert all(out["correct"].values()), out["correct"]
    assert out["backends"] == {op: kinds[0] for op, kinds in BACKENDS["cpu"].items()}
    assert out["hashed"] == [] and out["warnings"] == [], out
    sources = {path: n for path, n in out["reads"].items() if path.endswith((".cpp", ".cuh", ".h"))}
    assert sources and max(sources.values()) == 1, sources


def test_library_with_a_new_mtime_is_hashed_before_it_loads(published, tmp_path):
    cache = _copy(published, tmp_path / "cache")
    lib = _mla_lib(cache)
    st = lib.stat()
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # e.g. copied without its times: same bytes
    out = _warm(cache, **NO_COMPILER)
    assert out["hashed"] == [lib.name] and out["backends"]["set_mla_kv_buffer"] == "jit", out


def test_library_rewritten_in_place_is_never_loaded(published, tmp_path):
    """Same size, other bytes (the write gives it a new mtime): the hash catches it."""
    cache = _copy(published, tmp_path / "cache")
    lib = _mla_lib(cache)
    with open(lib, "r+b") as f:
        f.seek(lib.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = _ops(cache, **NO_COMPILER, JITKV_DISABLE_JIT="1")
    assert out["info"]["set_mla_kv_buffer"]["backend"] == "torch" and out["info"]["store_cache"]["backend"] == "jit"
    (warning,) = out["warnings"]
    assert "does not match the sha256" in warning, warning
    assert len(list((cache / "damaged").iterdir())) == 1


def test_benchmark_warm_start_probe_runs_every_op(published, tmp_path):
    from jitkv.benchmark.warm_start import _samples, probe
    from jitkv.tests.jit.conftest import child_env
    from jitkv.tests.op_calls import BACKENDS

    _samples(str(tmp_path / "samples.pt"))
    out = probe("cpu", str(tmp_path / "samples.pt"), env=child_env(_copy(published, tmp_path / "cache"), **NO_COMPILER))
    assert out["backends"] == {op: kinds[0] for op, kinds in BACKENDS["cpu"].items()} and out["ms"] > 0
    assert set(out["first_call_ms"]) == set(BACKENDS["cpu"]) and 0 < out["import_ms"] < out["ms"]


# ------------------------------------------------------------------------------------- log level


def test_bad_log_level_env_warns_and_import_works(tmp_path):
    res = run_py(
        "import logging, jitkv; print('LEVEL', logging.getLogger('jitkv').level)", tmp_path, JITKV_LOG_LEVEL="bogus"
    )
    assert res.returncode == 0, res.stderr
    assert "LEVEL 20" in res.stdout and res.stderr.count("JITKV_LOG_LEVEL") == 1, res.stderr


@pytest.mark.parametrize("value, level", [("10", 10), ("debug", 10), ("Warning", 30), (" error ", 40)])
def test_log_level_env_values(value, level):
    import jitkv

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jitkv._log_level(value) == level
