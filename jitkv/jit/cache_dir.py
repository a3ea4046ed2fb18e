"""Where artifacts live (docs/design.md §6): one or more cache layers.

``JITKV_CACHE_DIR`` lists layers separated by ``os.pathsep``; unset, the one layer is
$XDG_CACHE_HOME/jitkv, else ~/.cache/jitkv (never inside the installed package). Published artifacts
are looked up in every layer in order; builds, locks and failure records go to the first writable
one, else to a private per-user temp dir. A layer whose root has no owner write bit is read-only even
for root, so a prebuilt cache shipped with ``chmod -R a-w`` is used as is.

Trust: a layer (and, in build.py, an artifact) is used only when it is owned by this user or root and
is not group/world-writable; the temp fallback must be a real 0700 directory owned by this user, so
nobody else's library is ever loaded.

Each process that resolves where builds go (on its first miss, or on meeting a refused layer) warns
once, naming each layer it skips, why, and where builds go: every skipped layer when builds go to the
temp dir; else only the refused ones (a read-only layer before a writable one is a prebuilt image)."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from .._warn import warn
from .errors import JitUnavailable
from .util import cache_once

_VERDICTS: dict[str, str] = {}  # per existing layer root, for the life of the process: "" trusted, else why not


class _WriteChoice(NamedTuple):
    path: Path | None  # where builds go; None: nowhere (the temp dir is refused)
    fallback: bool  # path is the per-user temp dir
    problem: str  # why nothing is writable, when path is None


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
    then the temp fallback when builds go there. Where builds go is resolved only when a caller gets
    that far (a miss) or meets a refused layer (its warning names where builds go), so a hit in a
    read-only layer creates nothing and warns nothing."""
    configured = tuple(configured_layers())
    for layer in configured:
        verdict = _verdict(layer)
        if verdict == "":
            yield Path(layer)
        elif verdict:
            _write_choice(configured)  # its warning names this layer, why, and where builds go
    choice = _write_choice(configured)
    if choice.fallback and choice.path is not None:
        yield choice.path


def cache_dir() -> str:
    """The layer builds, locks and failure records go to (created 0700 on first use).

    Raises JitUnavailable when no layer is writable and the per-user temp dir is refused."""
    choice = _write_choice(tuple(configured_layers()))
    if choice.path is None:
        raise JitUnavailable(f"no usable cache dir: {choice.problem}")
    return str(choice.path)


def is_writable(layer: Path | str) -> bool:
    """``layer`` is an existing dir we may write, and its owner has not marked it read-only."""
    try:
        mode = os.stat(layer).st_mode
    except OSError:
        return False
    return stat.S_ISDIR(mode) and _not_writable(layer, mode) is None


def existing_write_layer() -> str | None:
    """The first configured layer that exists, is trusted and writable, or None; unlike cache_dir()
    it creates, warns and falls back to nothing (where the key memo lives, or None: no memo)."""
    return next((p for p in configured_layers() if _verdict(p) == "" and is_writable(p)), None)


def private_subdir(layer: Path, name: str) -> Path:
    """``layer/name`` created 0700 if absent (staging, locks, failed, logs, damaged)."""
    path = layer / name
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    return path


def _verdict(path: str) -> str | None:
    """Why the existing layer root ``path`` is never loaded from ("" when it is trusted), or None when
    there is none. Absence is not memoized: the first build creates the write layer."""
    verdict = _VERDICTS.get(path)
    if verdict is None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        verdict = _VERDICTS[path] = (untrusted(st) if stat.S_ISDIR(st.st_mode) else "not a directory") or ""
    return verdict


@cache_once
def _write_choice(configured: tuple[str, ...]) -> _WriteChoice:
    """Where builds go: the first configured layer that is trusted and writable (created if absent),
    else the per-user temp dir. Warns once (see the module's docstring)."""
    skipped = []  # (layer, why builds do not go there)
    for layer in configured:
        why = _unusable(layer)
        if why is None:
            ignored = [(s, w) for s, w in skipped if _verdict(s)]
            if ignored:
                warn(f"jitkv: {_listing(ignored)}; builds go to {layer}")
            return _WriteChoice(Path(layer), False, "")
        skipped.append((layer, why))
    temp, refused = _private_temp_dir()
    listing = _listing(skipped)
    if temp is None:
        warn(
            f"jitkv: {listing}; refusing temp cache dir {_fallback_path()}: {refused}; "
            "jit kernels that are not prebuilt fall back"
        )
        return _WriteChoice(None, True, f"{listing}; temp cache dir {_fallback_path()} refused ({refused})")
    warn(
        f"jitkv: {listing}; builds go to {temp}. Set JITKV_CACHE_DIR to a directory you own and may write, "
        "or prebuild with 'python -m jitkv prebuild'."
    )
    return _WriteChoice(temp, True, "")


def _listing(skipped: list[tuple[str, str]]) -> str:
    return "; ".join(f"cache dir {layer} {why}" for layer, why in skipped)


def _unusable(layer: str) -> str | None:
    """Why builds cannot go to ``layer`` (created 0700 if absent), or None."""
    try:
        os.makedirs(layer, mode=0o700, exist_ok=True)
    except FileExistsError:  # a file: its verdict says so
        pass
    except OSError as e:
        return _not_created(layer, e)
    verdict = _verdict(layer)
    if verdict:
        return f"is ignored: {verdict}"
    try:
        return _not_writable(layer, os.stat(layer).st_mode)
    except OSError as e:  # gone since makedirs
        return _not_created(layer, e)


def _not_created(layer: str, error: OSError) -> str:
    parent = os.path.dirname(layer)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent} is not a directory"
    return f"cannot be created in {parent}: {error.strerror}"


def _not_writable(layer: Path | str, mode: int) -> str | None:
    if not mode & stat.S_IWUSR:
        return f"is read-only (its owner has no write bit: mode {mode & 0o777:o})"
    if not os.access(layer, os.W_OK | os.X_OK):
        return f"is not writable by uid {os.geteuid()}"
    return None


def _fallback_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"jitkv-{os.geteuid()}")


def _private_temp_dir() -> tuple[Path | None, str | None]:
    """(the per-user temp dir, created like mkdtemp (0700), None), or (None, why it is refused): a
    symlink, not ours, or open to others (someone could plant a library there)."""
    path = _fallback_path()
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.lstat(path)
    except OSError as e:
        return None, str(e)
    why = _not_private(st)
    return (None, why) if why else (Path(path), None)


def _not_private(st: os.stat_result) -> str | None:
    if not stat.S_ISDIR(st.st_mode):
        return "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}"
    if st.st_mode & 0o077:
        return f"mode {st.st_mode & 0o777:o}, not 700"
    return None
