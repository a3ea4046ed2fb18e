"""The build core: cache keys, publish/load across processes, races, failures, cache-dir fallback."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import jitkv
from jitkv.jit import JitSpec, JitUnavailable, ensure_built, get_module, toolchain
from jitkv.tests.conftest import assert_bitwise, rand, slots
from jitkv.tests.jit.conftest import NO_COMPILER, child_env, run_cli, run_py

GOOD = textwrap.dedent(
    """
    #include "jitkv/check.h"
    #include "tiny/delta.h"
    #include <tvm/ffi/function.h>
    // Adds JITKV_SCALE * kDelta to every float of x.
    void add(tvm::ffi::TensorView x) {
      float* p = reinterpret_cast<float*>(jitkv::data_ptr(x));
      for (int64_t i = 0; i < x.numel(); ++i) p[i] += JITKV_SCALE * kDelta;
    }
    TVM_FFI_DLL_EXPORT_TYPED_FUNC(add, add);
    """
)


def _tree(root: Path, delta: int = 1, body: str = GOOD) -> Path:
    (root / "tiny").mkdir(parents=True, exist_ok=True)
    (root / "tiny" / "add.cpp").write_text(body)
    (root / "tiny" / "delta.h").write_text(f"#pragma once\nconstexpr int kDelta = {delta};\n")
    return root


def _spec(root: Path, scale: int = 2, **kw) -> JitSpec:
    return JitSpec("tiny", ("tiny/add.cpp",), args=(("scale", scale),), exports=("add",), root=root, **kw)


def test_key_tracks_content_args_flags_target_not_location(tmp_path):
    a, b = _tree(tmp_path / "a"), _tree(tmp_path / "b")
    base = _spec(a).key()
    assert _spec(b).key() == base  # same bytes installed elsewhere
    assert _spec(a, scale=3).key() != base  # template arg
    assert _spec(a, cflags=("-DEXTRA=1",)).key() != base  # flags
    assert _spec(a, target="9.0a").key() != _spec(a, target="10.0a").key()  # target
    _tree(b, delta=5)  # an included header changes
    assert _spec(b).key() != base


def test_key_reads_a_settled_source_once_and_sees_every_edit(tmp_path, monkeypatch):
    """Sources whose times are older than the racy window are scanned once per process; an edit that
    keeps the size is still seen (its mtime and ctime move)."""
    from jitkv.jit import spec as spec_module

    root = _tree(tmp_path)
    monkeypatch.setattr(spec_module, "RACY_NS", 0)  # every file counts as settled
    monkeypatch.setattr(spec_module, "_SCANS", {})  # check.h may be memoized by earlier tests
    reads = []
    read_bytes = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self.name) or read_bytes(self))
    base = _spec(root).key()
    assert sorted(reads) == ["add.cpp", "check.h", "delta.h"]
    reads.clear()
    assert _spec(root).key() == base and reads == []
    _tree(root, delta=7)  # same size, new bytes
    assert _spec(root).key() != base and sorted(reads) == ["add.cpp", "delta.h"]


CODES = textwrap.dedent(
    """
    #include "jitkv/codes.h"
    #include <tvm/ffi/function.h>
    int64_t record_bytes() { return jitkv::codes::DsMla::kBytes + int(jitkv::codes::KvFormat::kDsMla); }
    TVM_FFI_DLL_EXPORT_TYPED_FUNC(record_bytes, record_bytes);
    """
)


def test_generated_codes_header_is_built_with_and_keyed_by_its_text(tmp_path, monkeypatch):
    """A source including jitkv/codes.h sees jitkv.codes' values; its key hashes the header's text."""
    from jitkv import codes
    from jitkv.jit import spec as spec_module

    root = _tree(tmp_path / "src", body=CODES)
    monkeypatch.setenv("JITKV_CACHE_DIR", str(tmp_path / "cache"))
    spec = JitSpec("tiny_codes", ("tiny/add.cpp",), exports=("record_bytes",), root=root)
    assert spec.generated() == ["jitkv/codes.h"] and "jitkv/codes.h" not in dict(spec.closure())
    assert get_module(spec).record_bytes() == codes.DsMla.BYTES + codes.KvFormat.DS_MLA
    key = spec.key()
    monkeypatch.setitem(spec_module.GENERATED, "jitkv/codes.h", lambda: codes.header() + "// changed\n")
    spec_module._generated.cache_clear()
    try:
        assert spec.key() != key
    finally:
        monkeypatch.undo()
        spec_module._generated.cache_clear()


def test_codes_header_names():
    from jitkv import codes

    text = codes.header()
    assert "enum class KvFormat : int32_t { kCopy = 0, kE4M3 = 1, kE5M2 = 2, kDsMla = 3 };" in text
    assert "static constexpr int kRopeOffset = 528;" in text and "static constexpr float kFP8Max = 0x1.cp+8f;" in text
    assert codes.cpp_name("NEEDS_ANY_ALIGNMENT") == "kNeedsAnyAlignment"


def test_closure_follows_includes(tmp_path):
    rels = [rel for rel, _ in _spec(_tree(tmp_path)).closure()]
    assert rels == ["include/jitkv/check.h", "tiny/add.cpp", "tiny/delta.h"]


def test_build_publish_and_second_process_loads_without_compiling(tmp_path):
    root, cache = _tree(tmp_path / "src"), tmp_path / "cache"
    code = f"""
        import time, torch
        from pathlib import Path
        from jitkv.jit import JitSpec, get_module
        spec = JitSpec("tiny", ("tiny/add.cpp",), args=(("scale", 2),), exports=("add",), root=Path({str(root)!r}))
        t = time.perf_counter(); m = get_module(spec); x = torch.ones(3); m.add(x)
        print("RESULT", x.tolist(), time.perf_counter() - t)
    """
    first = run_py(code, cache)
    assert first.returncode == 0, first.stderr
    assert "building tiny[scale=2]" in first.stderr and "built tiny[scale=2]" in first.stderr
    second = run_py(code, cache)
    assert second.returncode == 0, second.stderr
    assert "building" not in second.stderr
    assert "RESULT [3.0, 3.0, 3.0]" in second.stdout
    (artifact,) = [p for p in cache.iterdir() if (p / "manifest.json").is_file()]
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["components"]["args"] == [["scale", "2"]] and manifest["seconds"] > 0


def test_four_processes_racing_a_cold_cache_build_once(tmp_path):
    root, cache = _tree(tmp_path / "src"), tmp_path / "cache"
    code = f"""
        import torch
        from pathlib import Path
        from jitkv.jit import JitSpec, get_module
        spec = JitSpec("tiny", ("tiny/add.cpp",), args=(("scale", 2),), exports=("add",), root=Path({str(root)!r}))
        x = torch.arange(4, dtype=torch.float32); get_module(spec).add(x); print("RESULT", x.tolist())
    """
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(cache),
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert all("RESULT [2.0, 3.0, 4.0, 5.0]" in o[0] for o in outs)
    assert sum(o[1].count("building tiny") for o in outs) == 1
    assert not any((cache / "staging").iterdir())


def test_broken_source_falls_back_and_failure_is_remembered(tmp_path, monkeypatch):
    broken = _tree(tmp_path / "broken", body=GOOD.replace("p[i] +=", "p[i] + = undeclared_thing"))
    cache = tmp_path / "cache"
    monkeypatch.setenv("JITKV_CACHE_DIR", str(cache))
    spec = _spec(broken)
    with pytest.raises(JitUnavailable, match="error") as err:
        get_module(spec)
    assert err.value.log_path and "undeclared_thing" in Path(err.value.log_path).read_text()
    # A second process falls back at once: no compile, the remembered reason.
    code = f"""
        from pathlib import Path
        from jitkv.jit import JitSpec, JitUnavailable, get_module
        spec = JitSpec("tiny", ("tiny/add.cpp",), args=(("scale", 2),), exports=("add",), root=Path({str(broken)!r}))
        try:
            get_module(spec)
        except JitUnavailable as e:
            print("FALLBACK", e.reason)
    """
    again = run_py(code, cache)
    assert "FALLBACK earlier build failed" in again.stdout and "building" not in again.stderr
    retried = run_py(code, cache, JITKV_RETRY_FAILED="1")
    assert "building" in retried.stderr and "FALLBACK" in retried.stdout


def test_op_falls_back_to_torch_with_one_warning(tmp_path, monkeypatch):
    from jitkv.ops import mla

    broken = _tree(tmp_path / "broken", body="#error deliberately broken for this test\n")
    monkeypatch.setenv("JITKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(mla, "cpu_spec", lambda: JitSpec("mla_cpu_broken", ("tiny/add.cpp",), root=broken))
    jitkv.ops.reset()
    try:
        buf, k_nope, k_rope = (
            rand((64, 576), torch.bfloat16),
            rand((8, 512), torch.bfloat16),
            rand((8, 64), torch.bfloat16),
        )
        loc = slots(64, 8)
        ref = buf.clone()
        jitkv.reference.set_mla_kv_buffer(ref, loc, k_nope, k_rope)
        with pytest.warns(jitkv.JitkvFallbackWarning, match="deliberately broken") as rec:
            jitkv.set_mla_kv_buffer(buf, loc, k_nope, k_rope)
            jitkv.set_mla_kv_buffer(buf, loc, k_nope, k_rope)
        assert len(rec) == 1
        assert_bitwise(buf, ref)
        info = jitkv.backend_info("set_mla_kv_buffer")["cpu"]
        assert info["backend"] == "torch" and "deliberately broken" in info["reason"]
        with pytest.raises(jitkv.BackendUnavailable, match="deliberately broken"):
            jitkv.ops.reset()
            jitkv.set_mla_kv_buffer(buf, loc, k_nope, k_rope, backend="jit")
    finally:
        monkeypatch.undo()
        jitkv.ops.reset()


def test_import_builds_nothing(tmp_path):
    res = run_py(
        """
        import os, sys, jitkv
        print("TVM", "tvm_ffi" in sys.modules, "CACHE", os.path.exists(os.environ["JITKV_CACHE_DIR"]))
        """,
        tmp_path / "cache",
    )
    assert res.returncode == 0, res.stderr
    assert "TVM False CACHE False" in res.stdout


def test_backend_choice_and_info():
    buf, k_nope, k_rope = rand((64, 576), torch.bfloat16), rand((8, 512), torch.bfloat16), rand((8, 64), torch.bfloat16)
    jitkv.set_mla_kv_buffer(buf, slots(64, 8), k_nope, k_rope)
    info = jitkv.backend_info()["set_mla_kv_buffer"]["cpu"]
    assert info["backend"] == "jit" and os.path.isdir(info["artifact"])
    with pytest.raises(jitkv.BackendUnavailable, match="not available on cpu"):
        jitkv.set_mla_kv_buffer(buf, slots(64, 8), k_nope, k_rope, backend="triton")
    with pytest.raises(ValueError, match="unknown backend"):
        jitkv.set_mla_kv_buffer(buf, slots(64, 8), k_nope, k_rope, backend="cutlass")


def test_a_forced_call_leaves_the_automatic_choice_on_record():
    """backend= runs one call on the named backend; backend_info keeps naming the backend that
    later automatic calls run (its runner stays cached), and reset() forgets both."""
    buf, k_nope, k_rope = rand((64, 576), torch.bfloat16), rand((8, 512), torch.bfloat16), rand((8, 64), torch.bfloat16)
    jitkv.ops.reset()
    jitkv.set_mla_kv_buffer(buf, slots(64, 8), k_nope, k_rope)
    jitkv.set_mla_kv_buffer(buf, slots(64, 8), k_nope, k_rope, backend="torch")
    assert jitkv.backend_info("set_mla_kv_buffer")["cpu"]["backend"] == "jit"
    jitkv.ops.reset()
    assert "cpu" not in jitkv.backend_info("set_mla_kv_buffer")
    jitkv.set_mla_kv_buffer(buf, slots(64, 8), k_nope, k_rope, backend="torch")
    info = jitkv.backend_info("set_mla_kv_buffer")["cpu"]
    assert info["backend"] == "torch" and info["forced"]


def _need_nvcc():
    if toolchain.cuda_home() is None:
        if os.environ.get("JITKV_REQUIRE_NVCC"):
            pytest.fail("JITKV_REQUIRE_NVCC is set but nvcc was not found")
        pytest.skip("nvcc not found")


def _cuobjdump() -> str | None:
    """cuobjdump from the CUDA toolkit, else from the nvidia-cuda-cuobjdump wheel (the test extra)."""
    found = shutil.which("cuobjdump") or os.path.join(toolchain.cuda_home(), "bin", "cuobjdump")
    if os.path.exists(found):
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else ():
        for sub in ("cu13", "cuda_cuobjdump"):
            if os.path.exists(path := os.path.join(root, sub, "bin", "cuobjdump")):
                return path
    return None


# A SASS line "/*0120*/  @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;": its opcode, predicate skipped.
_OPCODE = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_]+)")
_GLOBAL_ACCESS = {
    "LDG",
    "STG",
    "LD",
    "ST",
    "ATOMG",
    "ATOM",
    "RED",
    "REDG",
    "LDGSTS",
    "UTMALDG",
    "UTMASTG",
    "UBLKCP",
    "UBLKRED",
    "UBLKPF",
}


def accesses_before_pdl_wait(sass: str) -> dict[str, list[str]]:
    """For each kernel that waits for the previous grid (griddepcontrol.wait, SASS ACQBULK), the global
    memory instructions scheduled before the wait: each may read what that grid has not written yet."""
    early = {}
    for body in re.split(r"\n\s*Function : ", sass)[1:]:
        name, code = body.split("\n", 1)
        ops = [
            (m.group(1), line.split("*/", 1)[1].split(";")[0].strip())
            for line in code.splitlines()
            if (m := _OPCODE.search(line))
        ]
        wait = next((i for i, (op, _) in enumerate(ops) if op == "ACQBULK"), None)
        if wait is not None and (bad := [text for op, text in ops[:wait] if op in _GLOBAL_ACCESS]):
            early[name.strip()] = bad
    return early


def test_accesses_before_pdl_wait_finds_a_hoisted_load():
    sass = textwrap.dedent(
        """
        \t\tFunction : good
                /*0000*/                   LDC R1, c[0x0][0x28] ;
                /*0010*/                   ACQBULK ;
                /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        \t\tFunction : hoisted
                /*0000*/              @!P0 LDG.E.64.CONSTANT R14, desc[UR6][R14.64] ;
                /*0010*/                   ACQBULK ;
        \t\tFunction : no_wait
                /*0000*/                   LDG.E R4, desc[UR4][R2.64] ;
        """
    )
    assert accesses_before_pdl_wait(sass) == {"hoisted": ["@!P0 LDG.E.64.CONSTANT R14, desc[UR6][R14.64]"]}


def compile_only_specs():
    """(every prebuilt sm_90a module of every op, the forced TMA copy, rows of sglang's odd test widths
    (13 + 8 bf16: no 16-byte vector divides them) in the copy and an fp8 writer, the benchmark's own
    modules; the TMA copy's spec). A function, so that the no-compiler process below lists the same."""
    from jitkv.benchmark.gpu import latency_floor_spec
    from jitkv.benchmark.transfer import block_memcpy_spec
    from jitkv.codes import KvFormat, SrcDtype
    from jitkv.ops.mla import cuda_spec as mla_spec
    from jitkv.prebuild import specs_for

    odd = [mla_spec("9.0a", 26, 16), mla_spec("9.0a", 26, 16, kv_format=KvFormat.E4M3, src_dtype=SrcDtype.BF16)]
    tma = mla_spec("9.0a", 1024, 128, kernel="tma")
    return [*specs_for("9.0a"), tma, *odd, latency_floor_spec("9.0a"), block_memcpy_spec("9.0a")], tma


def test_cuda_compile_only_sm90a(tmp_path, monkeypatch):
    """The Hopper kernels (the MLA fp8 writers included, and the benchmark's latency-floor kernel) compile
    with no GPU present (CI has nvcc, no GPU), and a process without nvcc finds them intact. In their SASS
    no kernel touches global memory before its PDL wait (jitkv/cuda/vec.cuh load: ptxas may hoist a
    non-coherent load above it)."""
    _need_nvcc()
    cuobjdump = _cuobjdump()
    if cuobjdump is None and os.environ.get("JITKV_REQUIRE_NVCC"):
        pytest.fail("JITKV_REQUIRE_NVCC is set but cuobjdump was not found (pip install nvidia-cuda-cuobjdump)")
    from jitkv.prebuild import build_specs

    monkeypatch.setenv("JITKV_CACHE_DIR", str(tmp_path))
    specs, tma = compile_only_specs()
    failed = {k: v for k, v in build_specs(specs, jobs=2).items() if v != "ok"}
    assert not failed, failed
    built = []
    for spec in specs:
        artifact = ensure_built(spec)
        built.append(artifact.name)
        manifest = json.loads((artifact / "manifest.json").read_text())
        so = artifact / manifest["lib"]
        assert so.is_file() and "cuda" in manifest["compilers"]["nvcc"]["version"]
        if cuobjdump:
            listing = subprocess.run([cuobjdump, "--list-elf", str(so)], capture_output=True, text=True).stdout
            assert "sm_90a" in listing
            sass = subprocess.run([cuobjdump, "-sass", str(so)], capture_output=True, text=True).stdout
            if spec.op in ("transfer_ce", "block_memcpy_cuda"):  # host code only: copy-engine calls, no kernel
                assert "Function : " not in sass
                continue
            assert "Function : " in sass, f"{cuobjdump} -sass printed no SASS (it needs nvdisasm beside it)"
            assert "ACQBULK" in sass and accesses_before_pdl_wait(sass) == {}, artifact.name
            if spec is tma:
                assert "UBLKCP" in sass  # the TMA bulk store is really there
    found = run_py(
        """
        from jitkv.jit import artifact_dir, is_built
        from jitkv.jit.build import verify_artifact
        from jitkv.tests.jit.test_build import compile_only_specs
        found = [artifact_dir(s) for s in compile_only_specs()[0] if is_built(s)]
        print("INTACT", sorted(d.name for d in found if verify_artifact(d)))
        """,
        tmp_path,
        **NO_COMPILER,
    )
    assert found.returncode == 0, found.stderr
    assert f"INTACT {sorted(built)}" in found.stdout


def test_prebuild_cli_cpu(tmp_path):
    from jitkv.prebuild import specs_for

    res = run_cli("prebuild", cache=tmp_path)
    assert res.returncode == 0, res.stderr
    info = run_cli("info", cache=tmp_path)
    assert info.returncode == 0, info.stderr
    assert (
        f"{len(specs_for('cpu'))} built module(s)" in info.stdout
        and "not built yet" not in info.stdout.split("backend per op")[1].split("cuda")[0]
    )
    clear = run_cli("cache", "clear", cache=tmp_path)
    assert clear.returncode == 0 and not any((tmp_path / d / "manifest.json").exists() for d in os.listdir(tmp_path))


@pytest.mark.skipif(shutil.which("c++") is None or shutil.which("nm") is None, reason="needs c++ and nm")
def test_a_statically_linked_cpp_runtime_stays_private_to_its_module(tmp_path, monkeypatch):
    """Some toolchains link libstdc++ statically into every shared object (CXX wrapping g++ with
    -static-libstdc++ here); the module keeps it private (-Wl,--exclude-libs,ALL) instead of exporting a
    C++ runtime of its own, which would interpose between modules and slow every dlopen."""
    if not _has_static_libstdcxx():
        pytest.skip("no static libstdc++ for this compiler")
    wrapper = tmp_path / "cxx"
    wrapper.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = -shared ] && exec c++ "$@" -static-libstdc++; done\nexec c++ "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("JITKV_CACHE_DIR", str(tmp_path / "cache"))
    (lib,) = ensure_built(_spec(_tree(tmp_path / "src"))).glob("*.so")
    exported = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    names = [line.split()[-1] for line in exported.stdout.splitlines()]
    assert any("add" in n for n in names), names  # the module's own function is exported
    # the runtime's own functions (templates the module instantiates are its own, and may be exported)
    assert not [n for n in names if n.startswith(("__cxa_", "_ZSt9terminate", "_ZNSt8ios_base"))], "libstdc++ exported"


def _has_static_libstdcxx() -> bool:
    """c++ finds libstdc++.a (it prints the bare name back when it does not)."""
    out = subprocess.run(["c++", "-print-file-name=libstdc++.a"], capture_output=True, text=True)
    path = out.stdout.strip()
    return out.returncode == 0 and os.path.isabs(path) and os.path.isfile(path)
