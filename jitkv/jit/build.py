"""Load a published artifact from the cache layers, or build it once under a per-key lock and publish
it atomically into the write layer (cache_dir.py says which layers are searched and which is written).

Layout of a layer:
  <name>_<key16>/        published artifact: <lib>.so and manifest.json (the library's size and
                         sha256, the compiler that built it); nothing that names a path of the
                         layer, so a layer can be moved or mounted elsewhere
  locks/<dir>.lock       per-key lock (filelock; the file is never unlinked)
  failed/<dir>.json      remembered failure: later processes fall back at once
  logs/<dir>.log         full compiler output of a failed build
  staging/               private build dirs, renamed into place when complete
  damaged/               artifacts that failed their integrity check, set aside

An artifact is loaded only when its dir and library are trusted (cache_dir.untrusted) and the
library has the manifest's size and, unless its mtime is still the one the manifest recorded, its
sha256: a truncated, rewritten or replaced file is never dlopen'ed. ``cache verify`` always hashes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from . import key_memo, toolchain
from .cache_dir import cache_dir, is_writable, lookup_layers, private_subdir, untrusted
from .errors import JitUnavailable
from .spec import JitSpec, env_flag, write_generated
from .util import cache_once

logger = logging.getLogger("jitkv")

MANIFEST = "manifest.json"
# Errors tvm-ffi and the toolchain raise for a failed build or load (research: tvm-ffi.md §6).
BUILD_ERRORS = (RuntimeError, FileNotFoundError, ValueError, OSError)
_ENV_LOCK = threading.Lock()  # tvm-ffi reads the arch and CUDA_HOME from os.environ
_LOADED: dict[JitSpec, Path] = {}  # the artifact dir each module of this process was loaded from
T = TypeVar("T")


class CaptureBuildError(RuntimeError):
    """A build was needed while the current CUDA stream was capturing a graph."""


class ArtifactProblem(Exception):
    """A published artifact that must not be loaded; ``damaged``: its bytes are wrong (set it
    aside), rather than it being untrusted (leave it alone)."""

    def __init__(self, reason: str, damaged: bool = True):
        super().__init__(reason)
        self.damaged = damaged


def artifact_dir(spec: JitSpec) -> Path:
    """The dir this process loaded ``spec`` from, else the first layer that publishes it, else where
    a build would publish it. Raises JitUnavailable when that needs a cache dir and none is usable."""
    return _LOADED.get(spec) or _published(spec) or Path(cache_dir()) / _dirname(spec)


def is_built(spec: JitSpec) -> bool:
    """Some layer publishes ``spec`` (integrity is checked when it is loaded)."""
    return _published(spec) is not None


@cache_once
def spec_key(spec: JitSpec) -> str:
    """``spec.key()``, once per process, through the key memo of the write layer (key_memo.py)."""
    return key_memo.key(spec)


@cache_once
def load(spec: JitSpec):
    """The tvm-ffi module for ``spec``: loaded from the cache, or built once and published.

    Raises CaptureBuildError; a JitUnavailable (no usable artifact and none can be built) is
    returned as a memoized _Failed."""
    try:
        return _first_usable(spec, lambda final: _load_artifact(spec, final))
    except JitUnavailable as e:
        return _Failed(e)


def ensure_built(spec: JitSpec) -> Path:
    """Build and publish ``spec`` unless an intact artifact is published; returns its dir, without
    loading it (prebuild for absent GPUs). Raises JitUnavailable or CaptureBuildError."""
    return _first_usable(spec, _verified)


def get_module(spec: JitSpec):
    """The loaded module for ``spec``. Raises JitUnavailable (remembered for the process) or
    CaptureBuildError."""
    mod = load(spec)
    if isinstance(mod, _Failed):
        raise mod.error
    return mod


def get_function(spec: JitSpec, name: str):
    """Function ``name`` of the loaded module for ``spec`` (the benchmark's and tests' way to call a
    kernel variant the ops do not dispatch to). Raises what get_module raises."""
    return getattr(get_module(spec), name)


def verify_artifact(final: Path, *, hash_always: bool = True) -> dict:
    """The manifest of a trusted artifact whose library matches its recorded size and sha256.
    ``hash_always=False`` (loads): the hash is skipped while the library keeps the mtime the manifest
    recorded (see _check_library).

    Raises ArtifactProblem."""
    why = _untrusted_path(final)
    if why:
        raise ArtifactProblem(f"untrusted dir ({why})", damaged=False)
    try:
        manifest = json.loads((final / MANIFEST).read_text())
        lib, size, digest = final / manifest["lib"], manifest["size"], manifest["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ArtifactProblem(f"unreadable manifest ({e})") from None
    if lib.parent != final:
        raise ArtifactProblem(f"manifest names a library outside the artifact: {manifest['lib']!r}", damaged=False)
    _check_library(lib, size, digest, None if hash_always else manifest.get("mtime_ns"))
    return manifest


def published_artifacts(layer: Path) -> list[Path]:
    """The artifact dirs of one layer (those with a manifest), sorted."""
    return sorted(p.parent for p in layer.glob(f"*/{MANIFEST}"))


class _Failed:
    """Memoized failure (cache_once does not memoize exceptions)."""

    def __init__(self, error: JitUnavailable):
        self.error = error


def _dirname(spec: JitSpec) -> str:
    return spec.dirname(spec_key(spec))


def _published(spec: JitSpec) -> Path | None:
    return next(_published_dirs(spec), None)


def _published_dirs(spec: JitSpec):
    name = _dirname(spec)
    return (layer / name for layer in lookup_layers() if (layer / name / MANIFEST).is_file())


def _first_usable(spec: JitSpec, use: Callable[[Path], T]) -> T:
    """``use(dir)`` of the first published artifact it accepts, else of a fresh build. Damaged ones
    are set aside (in writable layers) and named in the one warning or fallback reason."""
    problems = []
    for final in _published_dirs(spec):
        try:
            result = use(final)
        except ArtifactProblem as e:
            problems.append(f"{final}: {e}")
            if e.damaged:
                _set_aside(final)
            continue
        if problems:
            logger.warning("jitkv: not using %s; using %s", "; ".join(problems), final)
        return result
    final = _build(spec, problems)
    try:
        return use(final)
    except ArtifactProblem as e:
        raise JitUnavailable(f"{spec.describe()}: built but failed to load: {e}") from e


def _build(spec: JitSpec, problems: list[str]) -> Path:
    """Build and publish into the write layer unless another process did; returns the artifact dir.

    ``problems``: why the published copies were not used; they lead the warning or the reason."""
    try:
        final = _build_target(spec)
    except JitUnavailable as e:
        raise JitUnavailable("; ".join([*problems, e.reason]), e.log_path) from e
    if problems:
        logger.warning("jitkv: not using %s; rebuilding %s", "; ".join(problems), spec.describe())
    with _key_lock(final):
        if not _intact(final):  # else another process published it while we waited
            _check_failure_memory(final)
            _build_and_publish(spec, final)
    return final


def _build_target(spec: JitSpec) -> Path:
    """Where ``spec`` is to be built. Raises JitUnavailable when it cannot be, or CaptureBuildError."""
    if env_flag("JITKV_DISABLE_JIT"):
        raise JitUnavailable("JIT disabled by JITKV_DISABLE_JIT")
    missing = toolchain.missing_compiler(spec.is_cuda)
    if missing:
        raise JitUnavailable(f"{spec.describe()}: no compiler ({missing} not found) and no prebuilt artifact")
    final = Path(cache_dir()) / _dirname(spec)
    _check_failure_memory(final)
    _check_not_capturing(spec)
    return final


def _check_not_capturing(spec: JitSpec) -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise CaptureBuildError(
            f"jitkv: {spec.describe()} is not built and the current CUDA stream is capturing a graph; "
            "call jitkv.warmup(device) or run 'python -m jitkv prebuild' before graph capture"
        )


def _verified(final: Path) -> Path:
    verify_artifact(final)
    return final


def _intact(final: Path) -> bool:
    try:
        verify_artifact(final)
    except ArtifactProblem:
        return False
    return True


def _set_aside(final: Path) -> None:
    """Move a damaged artifact into ``<layer>/damaged/`` so that no process tries it again (a
    read-only layer keeps it: each process skips it after its checks)."""
    layer = final.parent
    if not is_writable(layer):
        return
    with _key_lock(final):
        if (final / MANIFEST).is_file() and not _intact(final):  # not replaced by a fresh build meanwhile
            with contextlib.suppress(OSError):  # another process moved it first
                os.rename(final, private_subdir(layer, "damaged") / f"{final.name}.{uuid.uuid4().hex[:8]}")


def _untrusted_path(path: Path) -> str | None:
    try:
        return untrusted(os.stat(path))
    except OSError as e:
        return str(e)


def _check_library(lib: Path, size: int, digest: str, mtime_ns: int | None = None) -> None:
    """Raises ArtifactProblem unless ``lib`` is trusted and has ``size`` bytes and sha256 ``digest``.

    The size check is one stat. The hash is skipped when ``lib`` still has ``mtime_ns``, the mtime
    recorded at publish: writing a file sets its mtime, so an edited or partly written library is
    hashed, as is a cache copied without its times (cp -r; tar, cp -a and image layers keep them).
    Hashing every library would be a large share of the warm start (docs/performance.md,
    ``_check_library``)."""
    try:
        st = os.stat(lib)
    except OSError as e:
        raise ArtifactProblem(f"library missing ({e})") from None
    why = untrusted(st)
    if why:
        raise ArtifactProblem(f"untrusted library ({why})", damaged=False)
    if st.st_size != size:
        raise ArtifactProblem(f"{lib.name} has {st.st_size} bytes, its manifest says {size}")
    if st.st_mtime_ns == mtime_ns:
        return
    if _sha256(lib) != digest:
        raise ArtifactProblem(f"{lib.name} does not match the sha256 in its manifest")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _failure_path(final: Path) -> Path:
    return final.parent / "failed" / (final.name + ".json")


def _check_failure_memory(final: Path) -> None:
    path = _failure_path(final)
    if env_flag("JITKV_RETRY_FAILED") or not path.is_file():
        return
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    raise JitUnavailable(f"earlier build failed: {info.get('reason', '?')}", info.get("log"))


@contextlib.contextmanager
def _key_lock(final: Path):
    from filelock import FileLock

    with FileLock(str(private_subdir(final.parent, "locks") / (final.name + ".lock"))):
        yield


def _build_and_publish(spec: JitSpec, final: Path) -> None:
    """Build in a private staging dir, keep only the library and the manifest, rename into place."""
    import tvm_ffi.cpp

    name = f"{final.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    staging = private_subdir(final.parent, "staging") / name
    staging.mkdir(mode=0o700)
    logger.info("jitkv: building %s in %s", spec.describe(), final)
    t0 = time.perf_counter()
    try:
        with _build_env(spec):
            so = tvm_ffi.cpp.build(
                name=_lib_name(spec),
                sources=[str(spec.root / s) for s in spec.sources],
                extra_cflags=spec.host_cflags(),
                extra_cuda_cflags=spec.cuda_cflags() if spec.is_cuda else None,
                extra_ldflags=spec.ldflags(),
                extra_include_paths=[
                    str(write_generated(spec, staging / "generated")),
                    *(str(d) for d in spec.include_dirs()),
                ],
                build_directory=str(staging / "build"),
                backend="cuda" if spec.is_cuda else None,
            )
    except BUILD_ERRORS as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise _remember_failure(spec, final, str(e)) from e
    seconds = time.perf_counter() - t0
    lib = staging / os.path.basename(so)
    os.replace(so, lib)
    shutil.rmtree(staging / "build")  # objects and ninja files name this layer's path
    shutil.rmtree(staging / "generated")
    _write_manifest(spec, lib, seconds)
    # Readable by all, writable by us only, whatever the umask: the trust check refuses looser modes.
    os.chmod(lib, 0o755)
    os.chmod(staging, 0o755)
    try:
        os.rename(staging, final)
    except OSError:  # published by another host between our checks: keep theirs
        shutil.rmtree(staging, ignore_errors=True)
    _failure_path(final).unlink(missing_ok=True)
    logger.info("jitkv: built %s in %.1f s", spec.describe(), seconds)


def _write_manifest(spec: JitSpec, lib: Path, seconds: float) -> None:
    st = lib.stat()
    manifest = {
        "op": spec.op,
        "describe": spec.describe(),
        "key": spec_key(spec),
        "lib": lib.name,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "sha256": _sha256(lib),
        "seconds": round(seconds, 3),
        "built_at": time.time(),
        "compilers": toolchain.build_compilers(spec.is_cuda),
        "components": spec.key_components(),
    }
    path = lib.parent / MANIFEST
    path.write_text(json.dumps(manifest, indent=1))
    os.chmod(path, 0o644)


@contextlib.contextmanager
def _build_env(spec: JitSpec):
    """Set what tvm-ffi reads from the environment (arch list, CUDA_HOME, ninja on PATH)."""
    toolchain.ensure_ninja_on_path()
    env = {}
    if spec.is_cuda:
        env = {"TVM_FFI_CUDA_ARCH_LIST": spec.target, "CUDA_HOME": os.path.dirname(os.path.dirname(toolchain.nvcc()))}
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _remember_failure(spec: JitSpec, final: Path, output: str) -> JitUnavailable:
    reason = f"{spec.describe()}: {_first_error(output)}"
    layer = final.parent
    log = private_subdir(layer, "logs") / (final.name + ".log")
    log.write_text(output)
    tmp = private_subdir(layer, "failed") / f"{final.name}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"reason": reason, "log": str(log), "at": time.time()}))
    os.replace(tmp, _failure_path(final))
    return JitUnavailable(reason, str(log))


def _first_error(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in lines:
        low = ln.lower()
        if "error" in low and not low.startswith(("ninja", "failed:", "runtimeerror")):
            return ln[:300]
    return _first_line(output)


def _first_line(text: str) -> str:
    for ln in text.splitlines():
        if ln.strip():
            return ln.strip()[:300]
    return "unknown error"


def _lib_name(spec: JitSpec) -> str:
    return "jitkv_" + spec.readable_name()


def _load_artifact(spec: JitSpec, final: Path):
    """Verify, dlopen and check the exports. Raises ArtifactProblem (damaged when it fails to load)."""
    import tvm_ffi

    manifest = verify_artifact(final, hash_always=False)
    try:
        mod = tvm_ffi.load_module(str(final / manifest["lib"]))
        for name in spec.exports:
            getattr(mod, name)  # AttributeError -> the artifact is not what the spec expects
    except (*BUILD_ERRORS, AttributeError) as e:
        raise ArtifactProblem(f"failed to load ({_first_line(str(e))})") from e
    _LOADED[spec] = final
    return mod
