"""What a JIT module is made of, and its content-hash cache key (docs/design.md §6)."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

from .. import _version, codes
from . import toolchain
from .util import cache_once

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# Headers made from Python at build time (include name -> the function giving its text): in every
# spec's closure that includes one, keyed by the hash of its text like a source on disk.
GENERATED = {"jitkv/codes.h": codes.header}
_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*[<"]([^>"\n]+)[>"]', re.M)


class _Closure(NamedTuple):
    files: dict[str, Path]  # key path -> real file, entry sources and every include found on disk
    generated: set[str]  # GENERATED headers included, by include name
    opened: list[str]  # each file by the path it was found at (before symlinks are resolved)
    absent: set[str]  # include candidates tried before the one found (or every dir's, for none)


class JitSpec(NamedTuple):
    """One buildable module.

    op:      readable family name, e.g. "mla_cuda".
    sources: entry files relative to ``root`` (one .cu binding for CUDA, one .cpp for CPU).
    args:    template arguments, passed as ``-DJITKV_<NAME>=<value>`` to every source.
    target:  "cpu" (host ISA, -march=native, held down to toolchain.cpu_isa()) or a CUDA arch such as "9.0a".
    exports: functions the module must export (checked after load)."""

    op: str
    sources: tuple[str, ...]
    args: tuple[tuple[str, object], ...] = ()
    target: str = "cpu"
    exports: tuple[str, ...] = ()
    cflags: tuple[str, ...] = ()
    root: Path = CSRC

    @property
    def is_cuda(self) -> bool:
        return self.target != "cpu"

    @property
    def target_name(self) -> str:
        return toolchain.sm_name(self.target) if self.is_cuda else "cpu"

    def include_dirs(self) -> list[Path]:
        dirs = [self.root / "include", self.root]
        return dirs + [d for d in (CSRC / "include", CSRC) if d not in dirs]

    def defines(self) -> list[str]:
        return [f"-DJITKV_{name.upper()}={value}" for name, value in self.args]

    def host_cflags(self) -> list[str]:
        base = ["-O3", "-std=c++17", *self.defines(), *self.cflags]
        if self.is_cuda:
            return base
        return [*base, "-march=native", *toolchain.cpu_isa_cflags(), "-fopenmp"]

    def cuda_cflags(self) -> list[str]:
        return ["-O3", "-std=c++17", "--expt-relaxed-constexpr", *self.defines(), *self.cflags]

    def ldflags(self) -> list[str]:
        """``--exclude-libs,ALL``: what a static archive brings (libstdc++ on toolchains that link it
        statically by default) stays private to the module instead of being exported: every module
        would otherwise export its own copy of the C++ runtime, which interposes between modules and
        makes each dlopen resolve its symbols against the whole process (docs/performance.md,
        ``ldflags``)."""
        return ["-Wl,--no-undefined", "-Wl,--exclude-libs,ALL"] + ([] if self.is_cuda else ["-fopenmp"])

    def closure(self) -> list[tuple[str, Path]]:
        """Entry sources plus every quoted or <jitkv/...> include they reach on disk, as (key path,
        file); generated headers are ``generated()``."""
        return sorted(self._closure().files.items())

    def generated(self) -> list[str]:
        """The GENERATED headers the sources include, by include name."""
        return sorted(self._closure().generated)

    def _closure(self) -> _Closure:
        files: dict[str, Path] = {}
        generated: set[str] = set()
        opened: list[str] = []
        absent: set[str] = set()
        dirs = tuple(str(d) for d in self.include_dirs())
        todo = [str(self.root / s) for s in self.sources]
        while todo:
            found = todo.pop()
            path = _realpath(found)
            rel = self._key_path(path)
            if rel in files:
                continue
            files[rel] = Path(path)
            opened.append(found)
            for inc in _scan(path)[1]:
                if inc in GENERATED:
                    generated.add(inc)
                    continue
                where, tried = _find_include(inc, (os.path.dirname(path), *dirs))
                absent.update(tried)
                if where is not None:
                    todo.append(where)
        return _Closure(files, generated, opened, absent)

    def _key_path(self, path: str) -> str:
        for base in (self.root, CSRC):
            real = _realpath(str(base))
            if path.startswith(real + os.sep):
                return Path(path[len(real) + 1 :]).as_posix()
        return Path(path).as_posix()

    def key_components(self) -> dict[str, object]:
        """What the artifact is made of and runs on. No compiler probe: a process without a compiler
        computes the same key and loads what another machine published (the compiler that built an
        artifact is recorded in its manifest instead)."""
        closure = self._closure()
        files = {rel: _scan(str(p))[0] for rel, p in sorted(closure.files.items())}
        files.update({f"generated:{inc}": generated_sha256(inc) for inc in sorted(closure.generated)})
        return {**self.fixed_components(), "files": files}

    def fixed_components(self) -> dict[str, object]:
        """The key's components other than the files' bytes: computed without reading a source."""
        import tvm_ffi

        comps: dict[str, object] = {
            "op": self.op,
            "sources": list(self.sources),
            "args": [[k, str(v)] for k, v in self.args],
            "target": self.target if self.is_cuda else toolchain.cpu_target(),
            "host_cflags": self.host_cflags(),
            "ldflags": self.ldflags(),
            "platform": f"{sys.platform}-{platform.machine()}",
            "tvm_ffi": tvm_ffi.__version__,
            "jitkv": _version.__version__,
            "python": sys.implementation.cache_tag,
        }
        if self.is_cuda:
            comps["cuda_cflags"] = self.cuda_cflags()
        return comps

    def key(self) -> str:
        blob = repr(sorted(self.key_components().items())).encode()
        return hashlib.sha256(blob).hexdigest()

    def lookups(self) -> tuple[list[str], list[str], dict[str, str]]:
        """How the closure was found, for a key memo (key_memo.py): the paths opened (entry sources and
        each include where it was found, before symlinks are resolved), the include candidates that
        were tried and absent (sorted), and the sha256 of each generated header. While the
        opened paths keep their contents and the absent ones stay absent, every include resolves to
        the same file."""
        closure = self._closure()
        return closure.opened, sorted(closure.absent), {inc: generated_sha256(inc) for inc in sorted(closure.generated)}

    def readable_name(self) -> str:
        parts = [self.op] + [f"{k}{v}" for k, v in self.args] + [self.target_name]
        return re.sub(r"[^A-Za-z0-9_]+", "_", "_".join(parts))

    def dirname(self, key: str) -> str:
        return f"{self.readable_name()}_{key[:16]}"

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.args)
        return f"{self.op}[{args}] for {self.target_name}" if args else f"{self.op} for {self.target_name}"


@cache_once
def _generated(inc: str) -> tuple[str, str]:
    """(sha256, text) of a GENERATED header, made once per process."""
    text = GENERATED[inc]()
    return hashlib.sha256(text.encode()).hexdigest(), text


def generated_sha256(inc: str) -> str:
    """The sha256 of the GENERATED header ``inc`` as this process makes it."""
    return _generated(inc)[0]


def write_generated(spec: JitSpec, root: Path) -> Path:
    """Write the generated headers ``spec`` includes under ``root`` (an include dir of its build)."""
    root.mkdir(parents=True, exist_ok=True)
    for inc in spec.generated():
        path = root / inc
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_generated(inc)[1])
    return root


@cache_once
def _find_include(inc: str, dirs: tuple[str, ...]) -> tuple[str | None, tuple[str, ...]]:
    """(the path of ``inc`` in the first of ``dirs`` that has it, or None: a system or tvm-ffi header,
    covered by the tvm-ffi version and the target; the candidates tried before it, absent). Memoized
    per process: which headers exist does not change under a running engine, and the stats (a failed
    one per dir for each system header) are most of a key's cost."""
    tried = []
    for d in dirs:
        p = os.path.join(d, inc)
        if os.path.isfile(p):
            return p, tuple(tried)
        tried.append(p)
    return None, tuple(tried)


_realpath = cache_once(os.path.realpath)  # lstats every path component: once per path and process

# A file's (size, mtime, ctime, inode) -> its scan, per path: each source is read once per process.
_SCANS: dict[str, tuple[tuple[int, int, int, int], tuple[str, tuple[str, ...]]]] = {}
# A file whose timestamps are this recent when read is read again next time: a rewrite within one
# timestamp tick (up to 2 s on some file systems) can leave size and times unchanged (git's "racy
# clean" rule). Installed sources are always older, so an engine reads each once per process.
RACY_NS = 3_000_000_000


def _scan(path: str) -> tuple[str, tuple[str, ...]]:
    """(sha256, included names) of a source file."""
    st = os.stat(path)
    sig = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    memo = _SCANS.get(path)
    if memo is not None and memo[0] == sig:
        return memo[1]
    data = Path(path).read_bytes()
    scan = hashlib.sha256(data).hexdigest(), tuple(inc.decode() for inc in _INCLUDE.findall(data))
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_NS:
        _SCANS[path] = (sig, scan)
    return scan


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")
