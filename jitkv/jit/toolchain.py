"""Toolchain and target probes: compilers, CUDA_HOME, ninja, CPU ISA, CUDA arch.

Every probe is lazy and memoized: importing jitkv runs none of them."""

from __future__ import annotations

import os
import platform
import re
import shlex
import shutil
import subprocess
import warnings

from .util import cache_once

# ISA features that change what `-march=native` emits; their set is part of the CPU target.
_ISA_FLAG = re.compile(
    r"^(avx\w*|amx\w*|sse\w*|ssse3|fma\w*|f16c|bmi\w*|popcnt|lzcnt|movbe|vaes|vpclmulqdq|gfni|sha_ni|adx|asimd\w*|sve\w*|fp16|bf16|i8mm)$"
)


def cxx() -> str:
    """The host compiler command tvm-ffi runs (``CXX``, else ``c++``)."""
    return os.environ.get("CXX") or "c++"


def missing_compiler(cuda: bool) -> str | None:
    """The compiler a build needs and cannot find (``nvcc`` or the ``CXX`` command), or None.

    A lookup on PATH, no subprocess: run only when an artifact is not published."""
    if cuda and cuda_home() is None:
        return "nvcc"
    return None if _cxx_exe() else cxx()


def build_compilers(cuda: bool) -> dict[str, dict[str, str]]:
    """The compilers a build runs, as recorded in its manifest: {"cxx": {"path", "version"}, "nvcc": ...}."""
    exes = {"cxx": _cxx_exe() or cxx()}
    if cuda:
        exes["nvcc"] = nvcc()
    return {name: {"path": os.path.realpath(exe), "version": compiler_version(exe)} for name, exe in exes.items()}


def _cxx_exe() -> str | None:
    words = shlex.split(cxx())  # CXX may be a launcher and a compiler, e.g. "ccache g++"
    return shutil.which(words[0]) if words else None


@cache_once
def compiler_version(exe: str) -> str:
    """First line of `<exe> --version` (for nvcc the last, which names the release); for display."""
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (subprocess.SubprocessError, OSError) as e:
        return f"unavailable ({e})"
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    if not lines:
        return "unknown"
    return lines[-1] if "nvcc" in exe else lines[0]


def _has_cudart(home: str) -> bool:
    for sub in ("lib64", "lib", os.path.join("targets", f"{platform.machine()}-linux", "lib")):
        d = os.path.join(home, sub)
        if os.path.isdir(d) and any(f.startswith("libcudart.so") for f in os.listdir(d)):
            return True
    return False


@cache_once
def cuda_home() -> str | None:
    """CUDA_HOME/CUDA_PATH when either is set (they decide alone, so a process can hide the toolkit),
    else /usr/local/cuda, else the toolkit that owns `nvcc` on PATH.

    `which nvcc` alone is not enough: it may be a wrapper script outside the toolkit."""
    candidates = [h for h in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")) if h]
    if not candidates:
        candidates.append("/usr/local/cuda")
        nvcc = shutil.which("nvcc")
        if nvcc:
            candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for home in candidates:
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")) and _has_cudart(home):
            return home
    return None


def nvcc() -> str:
    home = cuda_home()
    if home is None:
        raise FileNotFoundError("nvcc not found (looked in CUDA_HOME, CUDA_PATH, /usr/local/cuda, PATH)")
    return os.path.join(home, "bin", "nvcc")


def ensure_ninja_on_path() -> None:
    """tvm-ffi runs `ninja` from PATH; the pip wheel's binary is not on PATH outside a venv's bin."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError as e:
        raise FileNotFoundError("ninja not found: pip install ninja") from e
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@cache_once
def _cpu_flags() -> frozenset[str]:
    """The host's ISA flags (/proc/cpuinfo) that _ISA_FLAG names; empty when it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(w for w in line.split(":", 1)[1].split() if _ISA_FLAG.match(w))
    except OSError:
        pass
    return frozenset()


@cache_once
def cpu_target() -> str:
    """The host ISA as a target string, e.g. 'x86_64+avx512bw+avx512f+...'; builds use -march=native."""
    return "+".join([platform.machine(), *sorted(_cpu_flags())])


# The vector paths of the CPU kernels (jitkv/cpu/isa.h), lowest first, and the flags that hold a
# `-march=native` build of an x86 host down to each: -mno-avx512f drops every AVX-512 subset, -mno-avx
# also AVX2, F16C and FMA, so the headers' macros select the path.
CPU_ISAS = ("scalar", "avx2", "avx512")
_ISA_CFLAGS = {"scalar": ["-mno-avx"], "avx2": ["-mno-avx512f"]}
_ISA_NEEDS = {"avx512": {"avx512f", "avx512bw"}, "avx2": {"avx2", "f16c", "fma"}}
_ISA_WARNED: set[str] = set()


def host_cpu_isa() -> str:
    """The best CPU kernel path this host runs: "avx512" (AVX-512 F and BW), "avx2" (AVX2, F16C and
    FMA), else "scalar"; from /proc/cpuinfo, "scalar" off x86-64."""
    flags = _cpu_flags() if platform.machine() in ("x86_64", "AMD64") else frozenset()
    return next((isa for isa in ("avx512", "avx2") if _ISA_NEEDS[isa] <= flags), "scalar")


def host_cache_bytes(level: int) -> int | None:
    """cpu0's data or unified cache of ``level`` in bytes as sysfs lists it, None where it lists none: the
    sizes the CPU kernels' streaming rule reads (jitkv/cpu/caches.h; sysconf may give a whole package's
    L3 instead of the slice a core shares). The L3 counts at most ``LLC_PER_CPU`` for each CPU sharing
    it (caches.h llc_share: a 2-vCPU guest of a Xeon lists the socket's 300 MiB)."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for d in sorted(os.listdir(root)):
            path = os.path.join(root, d)
            if d.startswith("index") and _read(path, "level") == str(level) and _read(path, "type") != "Instruction":
                size = _read(path, "size")
                size = int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(size[-1], 0)
                if level != 3:
                    return size
                cpus = _shared_cpus(path)
                return min(size, cpus * LLC_PER_CPU) if cpus else size
    except (OSError, ValueError, IndexError):
        pass
    return None


# The most L3 the streaming rule counts for each CPU sharing it (caches.h kLlcPerCpu).
LLC_PER_CPU = 16 << 20


def cpu_list_count(cpu_list: str) -> int:
    """CPUs in a sysfs cpu list ("0-1", "0-7,64-71", "0,2"); 0 for one it cannot read (caches.h
    cpu_list_count)."""
    count = 0
    try:
        for part in cpu_list.split(","):
            first, _, last = part.partition("-")
            n = int(last or first) - int(first) + 1
            if n <= 0:
                return 0
            count += n
    except ValueError:
        return 0
    return count


def _shared_cpus(path: str) -> int:
    """CPUs sharing the cache whose sysfs directory is ``path``; 0 where it lists none, which leaves the
    L3 uncapped (caches.h sysfs_cache_cpus)."""
    try:
        return cpu_list_count(_read(path, "shared_cpu_list"))
    except OSError:
        return 0


def _read(directory: str, name: str) -> str:
    with open(os.path.join(directory, name)) as f:
        return f.read().strip()


def host_cpu_isas() -> tuple[str, ...]:
    """Every CPU kernel path this host runs, lowest first (``JITKV_CPU_ISA`` may choose any of them)."""
    return CPU_ISAS[: CPU_ISAS.index(host_cpu_isa()) + 1]


def cpu_isa() -> str:
    """The path the CPU kernels are built for: "avx512", "avx2" or "scalar".

    ``JITKV_CPU_ISA`` (any case) chooses it: ``native`` (default) is ``host_cpu_isa()``; ``avx512``,
    ``avx2`` or ``scalar`` caps it there (tests and A/B timings of the lower paths). Asking for more
    than this CPU runs warns once and gives the host's path, so one environment serves hosts of
    either kind; any other value raises ValueError. The choice adds flags to CPU builds
    (``cpu_isa_cflags``), so each path is its own artifact, and each CPU module's ``cpu_isa()``
    returns the path it was compiled for."""
    asked = os.environ.get("JITKV_CPU_ISA", "").strip().lower() or "native"
    host = host_cpu_isa()
    if asked == "native":
        return host
    if asked not in CPU_ISAS:
        raise ValueError(f"jitkv: JITKV_CPU_ISA={asked!r}: expected native, {', '.join(reversed(CPU_ISAS))}")
    if CPU_ISAS.index(asked) <= CPU_ISAS.index(host):
        return asked
    if asked not in _ISA_WARNED:
        _ISA_WARNED.add(asked)
        warnings.warn(
            f"jitkv: JITKV_CPU_ISA={asked}: this CPU lacks it; building for {host}", RuntimeWarning, stacklevel=2
        )
    return host


def cpu_isa_cflags(isa: str | None = None) -> list[str]:
    """Flags that hold a CPU build to ``isa`` (default ``cpu_isa()``), one of the paths this host runs,
    on top of ``-march=native``: none for the host's own path (its key stays that of a plain native
    build) or off x86-64."""
    isa = cpu_isa() if isa is None else isa
    return [] if isa == host_cpu_isa() else list(_ISA_CFLAGS[isa])


def normalize_cuda_arch(arch: str) -> str:
    """'9.0a', '90a', 'sm_90a', '9.0' -> '9.0a' (Hopper and newer get the arch-specific 'a' suffix)."""
    m = re.fullmatch(r"(?:sm_|compute_)?(\d+)\.?(\d)([af]?)", arch.strip())
    if not m:
        raise ValueError(f"jitkv: cannot parse CUDA arch {arch!r} (expected e.g. '9.0a', 'sm_90a', '8.0')")
    major, minor, suffix = int(m.group(1)), m.group(2), m.group(3)
    if major >= 9 and not suffix:
        suffix = "a"
    return f"{major}.{minor}{suffix}"


def sm_name(arch: str) -> str:
    return "sm_" + arch.replace(".", "")


def cuda_arch(device) -> str:
    """Build target for a CUDA device: JITKV_CUDA_ARCH if set, else the device's capability."""
    env = os.environ.get("JITKV_CUDA_ARCH")
    if env:
        return normalize_cuda_arch(env)
    return _device_arch(device.index if device.index is not None else _current_device())


def _current_device() -> int:
    import torch

    return torch.cuda.current_device()


@cache_once
def _device_arch(index: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return normalize_cuda_arch(f"{major}.{minor}")
