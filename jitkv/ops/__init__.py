"""One module per op family: its public functions, their declarations (``_op.Op``), checks, variants
and backends. Every module here not starting with ``_`` is a family; importing this package imports
them all, which fills the registry ``OPS`` and ``PUBLIC``, the names each family's ``__all__`` gives
``jitkv`` to export (kept out of this package's namespace, where ``store_cache`` is its module)."""

from __future__ import annotations

import importlib
import pkgutil

from ._op import OPS, RESET_HOOKS, BackendUnavailable, JitkvFallbackWarning, Op, backend_info  # noqa: F401

PUBLIC: dict[str, object] = {}
for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        _family = importlib.import_module(f"{__name__}.{_module.name}")
        PUBLIC.update({name: getattr(_family, name) for name in _family.__all__})


def reset() -> None:
    """Forget every op's backend decisions, and the shims' (RESET_HOOKS): tests that change the
    environment or a factory."""
    for op in OPS.values():
        op.reset()
    for hook in RESET_HOOKS:
        hook()
