"""The build core: cache keys, cache dir, build + publish under locks, failure memory."""

from .build import CaptureBuildError, JitUnavailable, artifact_dir, ensure_built, get_module, is_built
from .cache_dir import cache_dir, configured_cache_dir
from .spec import CSRC, JitSpec, env_flag
from .util import cache_once

__all__ = [
    "CSRC",
    "CaptureBuildError",
    "JitSpec",
    "JitUnavailable",
    "artifact_dir",
    "cache_dir",
    "cache_once",
    "ensure_built",
    "configured_cache_dir",
    "env_flag",
    "get_module",
    "is_built",
]
