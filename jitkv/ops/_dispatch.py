"""Backend choice per op (docs/design.md §7): jit (C++/CUDA) -> triton (CUDA only) -> torch reference.

``backend=`` or ``JITKV_BACKEND`` forces one (forcing one that cannot run raises with the reason);
an automatic fallback warns once per (op, reason). Each decision is memoized per (device, forced
backend, variant) so the hot path is one dict lookup, and recorded for ``backend_info``."""

from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Callable

import torch

from ..jit import JitUnavailable

logger = logging.getLogger("jitkv")

BACKENDS = ("jit", "triton", "torch")
ORDER = {"cpu": ("jit", "torch"), "cuda": ("jit", "triton", "torch")}

_CPU = torch.device("cpu")
_WARNED: set[tuple[str, str]] = set()
_INFO: dict[str, dict[str, dict]] = {}
_LOCK = threading.RLock()


class BackendUnavailable(RuntimeError):
    """A backend cannot run this op here; ``reason`` says why in one line."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class JitkvFallbackWarning(RuntimeWarning):
    """An op runs on a slower backend than jitkv would prefer (see jitkv.backend_info())."""


def forced_backend(backend: str | None) -> str | None:
    name = backend if backend is not None else os.environ.get("JITKV_BACKEND", "auto")
    name = name.strip().lower()
    if name in ("", "auto"):
        return None
    if name not in BACKENDS:
        raise ValueError(f"jitkv: unknown backend {name!r}; expected one of auto, {', '.join(BACKENDS)}")
    return name


# A factory builds the callable for (device, variant) or raises BackendUnavailable/JitUnavailable.
# It returns (callable, info) where info holds extra fields for backend_info (key, artifact, path).
Factory = Callable[[torch.device, tuple], tuple[Callable, dict]]


class Dispatcher:
    def __init__(self, op: str, order: dict[str, tuple[str, ...]] | None = None):
        self.op = op
        self.order = {**ORDER, **(order or {})}
        self.factories: dict[str, Factory] = {}
        self._memo: dict[tuple, Callable] = {}
        self._cpu: dict[str | None, Callable] = {}  # hot path: keyed by backend alone
        self._cuda: dict[tuple, Callable] = {}  # hot path: keyed by (device index, backend, variant)

    def register(self, name: str):
        def deco(factory: Factory) -> Factory:
            self.factories[name] = factory
            return factory

        return deco

    def get(self, device: torch.device, backend: str | None = None, variant: tuple = ()) -> Callable:
        key = (device, backend, variant)
        fn = self._memo.get(key)
        if fn is None:
            with _LOCK:
                fn = self._memo.get(key) or self._resolve(device, forced_backend(backend), variant)
                self._memo[key] = fn
        return fn

    def get_cpu(self, backend: str | None = None) -> Callable:
        """``get`` for the CPU device with no variant, without building a torch.device per call."""
        fn = self._cpu.get(backend)
        if fn is None:
            fn = self._cpu[backend] = self.get(_CPU, backend)
        return fn

    def get_cuda(self, index: int, backend: str | None = None, variant: tuple = ()) -> Callable:
        """``get`` for CUDA device ``index`` (``tensor.get_device()``), without building a torch.device
        per call (0.2 us of the eager host cost)."""
        key = (index, backend, variant)
        fn = self._cuda.get(key)
        if fn is None:
            fn = self._cuda[key] = self.get(torch.device("cuda", index), backend, variant)
        return fn

    def get_for_index(self, index: int, backend: str | None = None) -> Callable:
        """``get_cpu`` for index -1, else ``get_cuda`` (ops without CUDA variants)."""
        return self.get_cpu(backend) if index < 0 else self.get_cuda(index, backend)

    def reset(self) -> None:
        self._memo.clear()
        self._cpu.clear()
        self._cuda.clear()

    def _resolve(self, device: torch.device, forced: str | None, variant: tuple) -> Callable:
        order = self.order.get(device.type)
        if order is None:
            raise ValueError(f"{self.op}: unsupported device type {device.type!r} (expected cpu or cuda)")
        if forced is not None:
            if forced not in order:
                raise BackendUnavailable(f"{self.op}: backend {forced!r} is not available on {device.type}")
            try:
                fn, info = self.factories[forced](device, variant)
            except (BackendUnavailable, JitUnavailable) as e:
                raise BackendUnavailable(f"{self.op}: forced backend {forced!r} unavailable: {e.reason}") from e
            self._record(device, forced, "forced by backend=/JITKV_BACKEND", info)
            return fn
        failures = []
        for name in order:
            try:
                fn, info = self.factories[name](device, variant)
            except (BackendUnavailable, JitUnavailable) as e:
                failures.append(f"{name} unavailable: {e.reason}")
                continue
            reason = "; ".join(failures) if failures else "preferred backend"
            self._record(device, name, reason, info)
            if failures:
                self._warn_fallback(name, reason)
            return fn
        raise BackendUnavailable(f"{self.op}: no backend can run on {device}: " + "; ".join(failures))

    def _record(self, device, name, reason, info) -> None:
        _INFO.setdefault(self.op, {})[str(device)] = {"backend": name, "reason": reason, **info}

    def _warn_fallback(self, name: str, reason: str) -> None:
        if (self.op, reason) in _WARNED:
            return
        _WARNED.add((self.op, reason))
        msg = f"jitkv: {self.op} falls back to the {name} backend: {reason}"
        logger.warning(msg)
        warnings.warn(msg, JitkvFallbackWarning, stacklevel=4)


def backend_info(op: str | None = None) -> dict:
    """Per op and device: which backend runs and why, as decided by the calls made so far.

    ``{op: {device: {"backend", "reason", "key"?, "artifact"?, ...}}}``; with ``op`` given, that
    op's ``{device: {...}}`` only. Ops not called yet are absent (see ``python -m jitkv info``)."""
    with _LOCK:
        snapshot = {k: {d: dict(v) for d, v in devs.items()} for k, devs in _INFO.items()}
    return snapshot.get(op, {}) if op is not None else snapshot
