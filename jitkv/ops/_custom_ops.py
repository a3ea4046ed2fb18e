"""torch.library registrations so the ops work under torch.compile(fullgraph=True).

Eager calls never go through these (the torch dispatcher costs more than a whole eager call: docs/
performance.md, ``custom ops``); an op's call routes here only while compiling (``Op.compiled``). Each
op is defined from its declaration's schema string with ``torch.library.Library`` rather than the
``custom_op`` decorator, which infers a schema from annotations at a cost of milliseconds per op at
``import jitkv`` (the warm-start budget). Every op
mutates its destinations and returns nothing; its Meta kernel (what fake tensors run) does nothing.
"""

from __future__ import annotations

import torch

from ._op import OPS

_LIB: torch.library.Library | None = None


def _nothing(*args, **kwargs) -> None:
    return None


def register_all() -> None:
    """Define jitkv::<op> for every declared op (once per process)."""
    global _LIB
    if _LIB is not None:
        return
    _LIB = torch.library.Library("jitkv", "DEF")
    for op in OPS.values():
        _LIB.define(f"{op.name}{op.custom_op_schema()}")
        _LIB.impl(op.name, op.custom_op_impl, "CompositeExplicitAutograd")
        _LIB.impl(op.name, _nothing, "Meta")
