"""One module per op family: its public functions, their declarations (``_op.Op``), checks, variants
and backends. Every module here not starting with ``_`` is a family; importing this package imports
them all, which fills the registry ``OPS`` and this package's namespace with each family's ``__all__``
(the public names ``jitkv`` exports)."""

from __future__ import annotations

import importlib
import pkgutil

from ._op import OPS, BackendUnavailable, JitkvFallbackWarning, Op, backend_info  # noqa: F401  (jitkv's API)

__all__: list[str] = []
for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        _family = importlib.import_module(f"{__name__}.{_module.name}")
        globals().update({name: getattr(_family, name) for name in _family.__all__})
        __all__ += _family.__all__


def reset() -> None:
    """Forget every op's backend decisions (tests that change the environment or a factory)."""
    for op in OPS.values():
        op.reset()
