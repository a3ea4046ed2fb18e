"""Small helpers of the build core."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def cache_once(fn: F) -> F:
    """Memoize ``fn`` per positional/keyword arguments for the life of the process.

    A plain dict rather than functools.lru_cache, which torch.compile cannot trace through.
    Exceptions are not memoized here: callers that must remember failures do so explicitly."""
    memo: dict = {}
    lock = threading.RLock()  # re-entrant: a memoized builder may call another

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items()))) if kwargs else args
        try:
            return memo[key]
        except KeyError:
            pass
        with lock:
            if key not in memo:
                memo[key] = fn(*args, **kwargs)
            return memo[key]

    wrapper.cache_clear = memo.clear  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
