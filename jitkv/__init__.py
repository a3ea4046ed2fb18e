"""jitkv: JIT-compiled KV-cache kernels for LLM serving engines.

Importing jitkv builds nothing, takes no lock and queries no GPU: kernels are compiled on first
call (or by ``prebuild``/``warmup``) and cached under ``JITKV_CACHE_DIR``."""

import logging as _logging
import os as _os

from . import _warn
from . import ops as _ops

# "x as x": explicit re-exports (__all__ below is built at import time, beyond the linter's reach)
from ._version import __version__ as __version__
from .ops import BackendUnavailable as BackendUnavailable
from .ops import JitkvFallbackWarning as JitkvFallbackWarning
from .ops import backend_info as backend_info
from .ops._custom_ops import register_all as _register_custom_ops
from .prebuild import prebuild as prebuild
from .prebuild import warmup as warmup


def _log_level(text: str) -> int:
    """JITKV_LOG_LEVEL as a level: a number, or a name in any case; anything else warns once and
    gives INFO (a typo in the environment must not break ``import jitkv``)."""
    text = text.strip()
    if text.isdecimal():
        return int(text)
    level = _logging.getLevelName(text.upper())
    if isinstance(level, int):
        return level
    _warn.warn(f"jitkv: JITKV_LOG_LEVEL={text!r} is not a logging level; using INFO")
    return _logging.INFO


def _setup_logging() -> None:
    """Build start/end lines are INFO and shown by default: a first-call compile must not look
    like a hang. JITKV_LOG_LEVEL changes the level; an app can replace the handler."""
    logger = _logging.getLogger("jitkv")
    logger.setLevel(_log_level(_os.environ.get("JITKV_LOG_LEVEL") or "INFO"))
    if not logger.handlers:
        handler = _logging.StreamHandler()
        handler.setFormatter(_logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


_setup_logging()
_register_custom_ops()  # torch.ops.jitkv.*, what torch.compile traces
globals().update(_ops.PUBLIC)  # every family's public names: the ops and their record layouts

__all__ = sorted(
    ["BackendUnavailable", "JitkvFallbackWarning", "__version__", "backend_info", "prebuild", "warmup", *_ops.PUBLIC]
)
