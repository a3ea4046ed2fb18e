"""Every header of the CUDA device library (csrc/include/jitkv/cuda) and every family header compiles on
its own: a translation unit that includes only that header, with the generated jitkv/codes.h and no
family's -D arguments. Headers of host code (.h, which the CPU bindings include) also go through the host
compiler. Few compiler processes: nvcc -ptx (the front end and the device code of every unit, no ptxas)
in two processes side by side (CI has 2 cores), and one c++ -fsyntax-only."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from jitkv import codes
from jitkv.jit import toolchain
from jitkv.jit.spec import CSRC
from jitkv.ops import OPS

FAMILIES = sorted({op.family for op in OPS.values()})  # each family's kernels are in csrc/<family>


def _rel(paths) -> list[str]:
    return sorted(p.relative_to(CSRC).as_posix() for p in paths)


LIBRARY = [h.removeprefix("include/") for h in _rel((CSRC / "include" / "jitkv" / "cuda").glob("*.cuh"))]
HOST_LIBRARY = ["jitkv/check.h", "jitkv/host_device.h"]
CPU_LIBRARY = [h.removeprefix("include/") for h in _rel((CSRC / "include" / "jitkv" / "cpu").glob("*.h"))]
FAMILY_CUDA = _rel(p for f in FAMILIES for p in (CSRC / f).glob("*.cuh"))
FAMILY_HOST = _rel(p for f in FAMILIES for p in (CSRC / f).glob("*.h"))


def test_every_family_has_split_headers():
    """The seams: parameter blocks (params.h) in every family, kernels (.cuh) in every family with a
    CUDA jit backend, the parsers of the families with a CPU binding in parse.h."""
    cuda_jit = {op.family for op in OPS.values() if "jit" in op.order["cuda"]}
    for family in FAMILIES:
        assert f"{family}/params.h" in FAMILY_HOST, family
        assert family not in cuda_jit or any(h.startswith(f"{family}/") for h in FAMILY_CUDA), family
    assert {f"{f}/parse.h" for f in ("mla", "store_cache", "indexer", "mla_gather", "rope")} <= set(FAMILY_HOST)
    assert {"jitkv/cpu/fp8.h", "jitkv/cpu/isa.h", "jitkv/cpu/row_copy.h"} <= set(CPU_LIBRARY)
    assert {"jitkv/cuda/fp8.cuh", "jitkv/cuda/launch.cuh", "jitkv/cuda/paged.cuh", "jitkv/cuda/vec.cuh"} <= set(LIBRARY)


MAX_SOURCE_LINES = 500  # a csrc file longer than this is split along its seams (docs/architecture.md)


def test_no_source_file_over_the_line_limit():
    sources = [p for p in CSRC.rglob("*") if p.suffix in (".h", ".cuh", ".cpp", ".cu")]
    assert sources
    long = {
        p.relative_to(CSRC).as_posix(): n for p in sources if (n := len(p.read_text().splitlines())) > MAX_SOURCE_LINES
    }
    assert not long, f"csrc files over {MAX_SOURCE_LINES} lines: {long}"


def _units(root: Path, headers: list[str], suffix: str) -> list[str]:
    """One translation unit per header, named after it (a failure names the header)."""
    root.mkdir(parents=True)
    units = []
    for header in headers:
        unit = root / (header.replace("/", "__") + suffix)
        unit.write_text(f'#include "{header}"\n')
        units.append(str(unit))
    return units


def includes(tmp_path: Path) -> list[str]:
    import tvm_ffi.libinfo

    generated = tmp_path / "generated"
    (generated / "jitkv").mkdir(parents=True)
    (generated / "jitkv" / "codes.h").write_text(codes.header())
    dirs = [
        generated,
        CSRC / "include",
        CSRC,
        tvm_ffi.libinfo.find_include_path(),
        tvm_ffi.libinfo.find_dlpack_include_path(),
    ]
    return [f"-I{d}" for d in dirs]


def _check(cmds: list[list[str]], cwd: Path) -> None:
    """Runs the commands side by side; each must succeed."""
    procs = [
        subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for cmd in cmds
    ]
    for cmd, proc in zip(cmds, procs):
        out = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, f"{shlex.join(cmd[:3])} ...:\n{out}"


def test_cuda_and_family_headers_compile_alone(tmp_path):
    if toolchain.cuda_home() is None:
        if os.environ.get("JITKV_REQUIRE_NVCC"):
            pytest.fail("JITKV_REQUIRE_NVCC is set but nvcc was not found")
        pytest.skip("nvcc not found")
    headers = LIBRARY + HOST_LIBRARY + FAMILY_CUDA + FAMILY_HOST
    units = _units(tmp_path / "units", headers, ".cu")
    nvcc = [toolchain.nvcc(), "-ptx", "-arch=sm_90a", "-std=c++17", "--expt-relaxed-constexpr", *includes(tmp_path)]
    _check([[*nvcc, *units[0::2]], [*nvcc, *units[1::2]]], cwd=tmp_path / "units")


def test_host_headers_compile_alone(tmp_path):
    cxx = shlex.split(toolchain.cxx())
    units = _units(tmp_path / "units", HOST_LIBRARY + FAMILY_HOST, ".cpp")
    _check([[*cxx, "-fsyntax-only", "-std=c++17", *includes(tmp_path), *units]], cwd=tmp_path / "units")


@pytest.mark.skipif(toolchain.host_cpu_isa() == "scalar", reason="a host without AVX2 builds the scalar path only")
def test_cpu_headers_compile_alone_on_every_path(tmp_path):
    """Each jitkv/cpu header alone, on each vector path this host runs (jitkv/cpu/isa.h picks it from
    the flags the builds add to -march=native for it)."""
    cxx = shlex.split(toolchain.cxx())
    units = _units(tmp_path / "units", CPU_LIBRARY, ".cpp")
    base = [*cxx, "-fsyntax-only", "-std=c++17", "-march=native", *includes(tmp_path)]
    cmds = [[*base, *toolchain.cpu_isa_cflags(isa), *units] for isa in toolchain.host_cpu_isas()]
    _check(cmds, cwd=tmp_path / "units")
