"""Where built artifacts live (DESIGN §6): JITKV_CACHE_DIR, else $XDG_CACHE_HOME/jitkv, else
~/.cache/jitkv; never inside the installed package. An unwritable choice falls back to a per-user
temp dir with one warning naming both paths."""

from __future__ import annotations

import os
import tempfile
import warnings

from .util import cache_once


def configured_cache_dir() -> str:
    """The cache dir the environment asks for, before any writability check."""
    if os.environ.get("JITKV_CACHE_DIR"):
        return os.path.abspath(os.path.expanduser(os.environ["JITKV_CACHE_DIR"]))
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "jitkv")


def _writable_dir(path: str) -> bool:
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".probe-", delete=True)
        probe.close()
        return True
    except OSError:
        return False


@cache_once
def _resolve(configured: str) -> str:
    if _writable_dir(configured):
        return configured
    fallback = os.path.join(tempfile.gettempdir(), f"jitkv-{os.getuid()}")
    if not _writable_dir(fallback):
        raise OSError(f"jitkv: neither cache dir {configured} nor fallback {fallback} is writable")
    warnings.warn(
        f"jitkv: cache dir {configured} is not writable; using {fallback} for this process. "
        "Set JITKV_CACHE_DIR to a writable directory or prebuild with 'python -m jitkv prebuild'.",
        RuntimeWarning,
        stacklevel=3,
    )
    return fallback


def cache_dir() -> str:
    """The writable cache dir for this process (created 0700 on first use)."""
    return _resolve(configured_cache_dir())
