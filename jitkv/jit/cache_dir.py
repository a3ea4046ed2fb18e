"""Where artifacts live (docs/design.md §6): one or more cache layers.

``JITKV_CACHE_DIR`` lists layers separated by ``os.pathsep``; unset, the one layer is
$XDG_CACHE_HOME/jitkv, else ~/.cache/jitkv (never inside the installed package). Published artifacts
are looked up in every layer in order; builds, locks and failure records go to the first writable
one, else to a private per-user temp dir (one warning naming both). A layer whose root has no owner
write bit is read-only even for root, so a prebuilt cache shipped with ``chmod -R a-w`` is used as is.

Trust: a layer (and, in build.py, an artifact) is used only when it is owned by this user or root and
is not group/world-writable; the temp fallback must be a real 0700 directory owned by this user. A
refused one is skipped with one warning, so nobody else's library is ever loaded."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

from .errors import JitUnavailable
from .util import cache_once

_WARNED: set[str] = set()
_TRUSTED: dict[str, bool] = {}  # verdict per existing layer root, for the life of the process


def configured_layers() -> list[str]:
    """The cache layers the environment asks for, in lookup order, before any check."""
    raw = os.environ.get("JITKV_CACHE_DIR", "")
    layers = [os.path.abspath(os.path.expanduser(p)) for p in raw.split(os.pathsep) if p.strip()]
    if layers:
        return layers
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return [os.path.join(os.path.abspath(base), "jitkv")]


def untrusted(st: os.stat_result) -> str | None:
    """Why a file or dir with this stat must not be loaded from, or None: another user owns it,
    or its group or others may write it."""
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}"
    if st.st_mode & 0o022:
        return f"group/world-writable (mode {st.st_mode & 0o777:o})"
    return None


def lookup_layers() -> Iterator[Path]:
    """Layers to search for published artifacts, in order: the trusted configured layers that exist,
    then the temp fallback when builds go there. The fallback is resolved only when a caller gets
    that far (a miss), so a hit in a read-only layer creates nothing and warns nothing."""
    configured = configured_layers()
    yield from (Path(p) for p in configured if _trusted_layer(p))
    path, fallback = _write_choice(tuple(configured))
    if fallback and path is not None:
        yield path


def cache_dir() -> str:
    """The layer builds, locks and failure records go to (created 0700 on first use).

    Raises JitUnavailable when no layer is writable and the per-user temp dir is refused."""
    configured = tuple(configured_layers())
    path, fallback = _write_choice(configured)
    if path is None:
        raise JitUnavailable(f"no usable cache dir: {os.pathsep.join(configured)} not writable and "
                             f"{_fallback_path()} refused")
    if fallback:
        _warn_once(f"jitkv: cache dir {os.pathsep.join(configured)} is not writable; using {path} for this "
                   "process. Set JITKV_CACHE_DIR to a writable directory or prebuild with 'python -m jitkv prebuild'.")
    return str(path)


def is_writable(layer: Path | str) -> bool:
    """``layer`` is an existing dir we may write, and its owner has not marked it read-only."""
    try:
        mode = os.stat(layer).st_mode
    except OSError:
        return False
    return bool(stat.S_ISDIR(mode) and mode & stat.S_IWUSR) and os.access(layer, os.W_OK | os.X_OK)


def private_subdir(layer: Path, name: str) -> Path:
    """``layer/name`` created 0700 if absent (staging, locks, failed, logs, damaged)."""
    path = layer / name
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    return path


def _trusted_layer(path: str) -> bool:
    """An existing layer root we may load from; a refused one warns once. Absence is not memoized:
    the first build creates the write layer."""
    verdict = _TRUSTED.get(path)
    if verdict is None:
        try:
            st = os.stat(path)
        except OSError:
            return False
        why = untrusted(st) if stat.S_ISDIR(st.st_mode) else "not a directory"
        if why:
            _warn_once(f"jitkv: ignoring cache dir {path}: {why}")
        verdict = _TRUSTED[path] = why is None
    return verdict


@cache_once
def _write_choice(configured: tuple[str, ...]) -> tuple[Path | None, bool]:
    """(the layer builds go to or None, whether it is the temp fallback)."""
    for layer in configured:
        with contextlib.suppress(OSError):
            os.makedirs(layer, mode=0o700, exist_ok=True)
        if _trusted_layer(layer) and is_writable(layer):
            return Path(layer), False
    return _private_temp_dir(), True


def _fallback_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"jitkv-{os.geteuid()}")


def _private_temp_dir() -> Path | None:
    """The per-user temp dir, created like mkdtemp (0700); None, with a warning, when it is a
    symlink, not ours, or open to others (someone could plant a library there)."""
    path = _fallback_path()
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.lstat(path)
    except OSError as e:
        why = str(e)
    else:
        why = _not_private(st)
    if why:
        _warn_once(f"jitkv: refusing temp cache dir {path}: {why}; jit kernels that are not prebuilt fall back")
        return None
    return Path(path)


def _not_private(st: os.stat_result) -> str | None:
    if not stat.S_ISDIR(st.st_mode):
        return "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}"
    if st.st_mode & 0o077:
        return f"mode {st.st_mode & 0o777:o}, not 700"
    return None


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
