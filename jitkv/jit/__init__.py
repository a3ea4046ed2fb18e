"""The build core: cache keys, cache layers, build + publish under locks, integrity, failure memory."""

from .build import CaptureBuildError, artifact_dir, ensure_built, get_function, get_module, is_built
from .cache_dir import cache_dir, configured_layers
from .errors import JitUnavailable
from .spec import CSRC, JitSpec, env_flag
from .toolchain import cuda_arch
from .util import cache_once

__all__ = [
    "CSRC",
    "CaptureBuildError",
    "JitSpec",
    "JitUnavailable",
    "artifact_dir",
    "cache_dir",
    "cache_once",
    "configured_layers",
    "cuda_arch",
    "ensure_built",
    "env_flag",
    "get_function",
    "get_module",
    "is_built",
]
