"""jitkv's warnings point at the caller's line: the first frame outside the jitkv package."""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TESTS = os.path.join(_PACKAGE, "tests") + os.sep  # jitkv's own tests call jitkv as its users do


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the innermost frame that is not jitkv's."""
    warnings.warn(message, category, stacklevel=_caller_level(sys._getframe(1)))


def _caller_level(frame) -> int:
    """The stacklevel, for a warnings.warn called one frame below ``frame``, of the first frame
    outside jitkv. warnings does not count the import machinery's frames (a warning raised while
    ``import jitkv`` runs lands on the import line), so neither does this."""
    level = 2
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _import_machinery(filename):
            if not _inside_jitkv(filename):
                break
            level += 1
        frame = frame.f_back
    return level


def _inside_jitkv(filename: str) -> bool:
    return filename.startswith(_PACKAGE) and not filename.startswith(_TESTS)


def _import_machinery(filename: str) -> bool:
    """The frames warnings skips while it walks up the stack (CPython's _is_internal_frame)."""
    return "importlib" in filename and "_bootstrap" in filename
