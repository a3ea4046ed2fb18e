"""Load a published artifact, or build it once under a per-key lock and publish it atomically.

Layout under the cache dir:
  <name>_<key16>/        published artifact: <lib>.so, build files, manifest.json (written last
                         inside the staging dir, which is then renamed into place)
  locks/<dir>.lock       per-key build lock (filelock; the file is never unlinked)
  failed/<dir>.json      remembered failure: later processes fall back at once
  logs/<dir>.log         full compiler output of a failed build
  staging/               private build dirs
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

from . import toolchain
from .cache_dir import cache_dir
from .spec import JitSpec, env_flag
from .util import cache_once

logger = logging.getLogger("jitkv")

# Errors tvm-ffi and the toolchain raise for a failed build or load (research: tvm-ffi.md §6).
BUILD_ERRORS = (RuntimeError, FileNotFoundError, ValueError, OSError)
_ENV_LOCK = threading.Lock()  # tvm-ffi reads the arch and CUDA_HOME from os.environ


class JitUnavailable(RuntimeError):
    """The JIT module cannot be used; ``reason`` is one line, ``log_path`` the full log if any."""

    def __init__(self, reason: str, log_path: str | None = None):
        super().__init__(reason + (f" (log: {log_path})" if log_path else ""))
        self.reason = reason
        self.log_path = log_path


class CaptureBuildError(RuntimeError):
    """A build was needed while the current CUDA stream was capturing a graph."""


def artifact_dir(spec: JitSpec) -> Path:
    return Path(cache_dir()) / spec.dirname(spec_key(spec))


@cache_once
def spec_key(spec: JitSpec) -> str:
    return spec.key()


def is_built(spec: JitSpec) -> bool:
    return (artifact_dir(spec) / "manifest.json").is_file()


@cache_once
def load(spec: JitSpec):
    """The tvm-ffi module for ``spec``: loaded from the cache, or built once and published.

    Raises JitUnavailable (build/load failed, remembered per key), or CaptureBuildError."""
    try:
        return _load_or_build(spec)
    except JitUnavailable as e:
        return _Failed(e)


def ensure_built(spec: JitSpec) -> Path:
    """Build and publish ``spec`` if needed, without loading it (prebuild for absent GPUs)."""
    final = artifact_dir(spec)
    if (final / "manifest.json").is_file():
        return final
    _check_can_build(spec, final)
    with _key_lock(final):
        if not (final / "manifest.json").is_file():
            _check_failure_memory(final)
            _build_and_publish(spec, final)
    return final


def get_module(spec: JitSpec):
    mod = load(spec)
    if isinstance(mod, _Failed):
        raise mod.error
    return mod


class _Failed:
    """Memoized failure (cache_once does not memoize exceptions)."""

    def __init__(self, error: JitUnavailable):
        self.error = error


def _load_or_build(spec: JitSpec):
    final = artifact_dir(spec)
    if (final / "manifest.json").is_file():
        try:
            return _load_artifact(spec, final)
        except (*BUILD_ERRORS, AttributeError) as e:
            logger.warning("jitkv: cached %s failed to load (%s); rebuilding", final, e)
            with _key_lock(final):
                shutil.rmtree(final, ignore_errors=True)
    _check_can_build(spec, final)
    with _key_lock(final):
        if (final / "manifest.json").is_file():  # another process published while we waited
            return _load_artifact(spec, final)
        _check_failure_memory(final)
        _build_and_publish(spec, final)
    try:
        return _load_artifact(spec, final)
    except (*BUILD_ERRORS, AttributeError) as e:
        raise JitUnavailable(f"{spec.describe()}: built but failed to load: {_first_line(str(e))}") from e


def _check_can_build(spec: JitSpec, final: Path) -> None:
    if env_flag("JITKV_DISABLE_JIT"):
        raise JitUnavailable("JIT disabled by JITKV_DISABLE_JIT")
    missing = toolchain.missing_compiler(spec.is_cuda)
    if missing:
        raise JitUnavailable(f"{spec.describe()}: no compiler ({missing} not found) and no prebuilt artifact")
    _check_failure_memory(final)
    if _capturing():
        raise CaptureBuildError(
            f"jitkv: {spec.describe()} is not built and the current CUDA stream is capturing a graph; "
            "call jitkv.warmup(device) or run 'python -m jitkv prebuild' before graph capture"
        )


def _capturing() -> bool:
    import torch  # noqa: PLC0415

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


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
    from filelock import FileLock  # noqa: PLC0415

    lock_dir = final.parent / "locks"
    lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    with FileLock(str(lock_dir / (final.name + ".lock"))):
        yield


def _build_and_publish(spec: JitSpec, final: Path) -> None:
    import tvm_ffi.cpp  # noqa: PLC0415

    staging = final.parent / "staging" / f"{final.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    staging.mkdir(mode=0o700, parents=True)
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
                extra_include_paths=[str(d) for d in spec.include_dirs()],
                build_directory=str(staging),
                backend="cuda" if spec.is_cuda else None,
            )
    except BUILD_ERRORS as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise _remember_failure(spec, final, str(e)) from e
    seconds = time.perf_counter() - t0
    manifest = {
        "op": spec.op,
        "describe": spec.describe(),
        "key": spec_key(spec),
        "lib": os.path.basename(so),
        "seconds": round(seconds, 3),
        "built_at": time.time(),
        "compilers": toolchain.build_compilers(spec.is_cuda),
        "components": spec.key_components(),
    }
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=1))
    try:
        os.rename(staging, final)
    except OSError:  # published by another host between our checks: keep theirs
        shutil.rmtree(staging, ignore_errors=True)
    _failure_path(final).unlink(missing_ok=True)
    logger.info("jitkv: built %s in %.1f s", spec.describe(), seconds)


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
    root = final.parent
    (root / "logs").mkdir(mode=0o700, exist_ok=True)
    (root / "failed").mkdir(mode=0o700, exist_ok=True)
    log = root / "logs" / (final.name + ".log")
    log.write_text(output)
    tmp = _failure_path(final).with_suffix(f".{os.getpid()}.tmp")
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
    import tvm_ffi  # noqa: PLC0415

    manifest = json.loads((final / "manifest.json").read_text())
    mod = tvm_ffi.load_module(str(final / manifest["lib"]))
    for name in spec.exports:
        getattr(mod, name)  # AttributeError -> the artifact is not what the spec expects
    return mod
