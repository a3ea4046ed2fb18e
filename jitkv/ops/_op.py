"""One declaration per public op, and the one way every op runs (docs/architecture.md).

An ``Op`` holds everything about a public op: its schema (argument names, types, defaults, which
tensors it writes), the argument whose device the others share, the backends in order per device
type, how its CUDA variant is read from the arguments, its checks, the JIT specs it builds, its torch
reference, Triton kernel, a sample call and its benchmark cases. ``OPS`` is the registry: custom-op
registration, ``prebuild``, the benchmark and the tests enumerate it, and no other list of ops exists.

A call (``Op.run``): the home tensor's device picks the backend (jit -> triton -> torch, decided
once per device, forced backend and variant, recorded for ``backend_info``), the runner runs the
public arguments. A runner returns None, or the variant that must run these arguments instead (a
16-byte build given a view it cannot address); a type error from a binding (tvm-ffi's, by position)
is replaced by the op's own check, which names the argument.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.compiler import is_compiling

from .. import _warn, checks, codes
from ..jit import JitSpec, JitUnavailable, artifact_dir, env_flag, get_function

logger = logging.getLogger("jitkv")

BACKENDS = ("jit", "triton", "torch")
DEFAULT_ORDER = {"cpu": ("jit", "torch"), "cuda": ("jit", "triton", "torch")}
OPS: dict[str, Op] = {}  # the registry, by op name, in declaration order
# What else decides once what the environment asks and forgets it with the ops' decisions (ops.reset):
# jitkv.compat.flashinfer's page-table builds.
RESET_HOOKS: list[Callable[[], None]] = []

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


class Param(NamedTuple):
    """One argument of an op's schema. ``type`` is a torch schema type, or ``Scale?`` (an fp8 scale:
    a float or a float32 tensor, which the registered custom op takes as a tensor and a float)."""

    name: str
    type: str
    default: str | None  # the schema's text, None when required
    written: bool  # the op writes this tensor

    @property
    def is_tensor(self) -> bool:
        return self.type.startswith("Tensor")


_PARAM = re.compile(
    r"^\s*(?P<type>[A-Za-z]+(?:\((?P<alias>[a-z])!\))?\??)\s+(?P<name>\w+)\s*(?:=\s*(?P<default>.+?))?\s*$"
)


def parse_schema(schema: str) -> tuple[Param, ...]:
    """The parameters of ``(Tensor(a!) kv_buffer, Tensor loc, *, Scale? scale=None, ...)``; ``*`` (the
    keyword-only marker) is skipped."""
    inner = schema.strip()
    if not (inner.startswith("(") and inner.endswith(")")):
        raise ValueError(f"schema {schema!r}: expected '(...)'")
    params = []
    for part in inner[1:-1].split(","):
        if part.strip() == "*":
            continue
        m = _PARAM.match(part)
        if m is None:
            raise ValueError(f"schema {schema!r}: cannot read {part.strip()!r}")
        params.append(Param(m["name"], m["type"], m["default"], m["alias"] is not None))
    return tuple(params)


# A factory builds the runner of one backend for (device, variant), or raises BackendUnavailable /
# JitUnavailable; it returns (runner, extra backend_info fields).
Factory = Callable[[torch.device, object], tuple[Callable, dict]]


class Op:
    """A public op's declaration (see the module docstring) and its dispatch.

    fn:           the public function; its docstring is the op's documentation.
    schema:       the public arguments in torch schema syntax, ``Tensor(a!)`` for written tensors and
                  ``Scale?`` for fp8 scales (``backend`` is implied).
    home:         the tensor whose device the others must share.
    check:        (*args) -> the arguments normalized for the reference and Triton (views, parsed
                  scales); raises TypeError/ValueError naming the argument. Reads no CUDA tensor.
    debug_check:  (*checked args) -> None: what JITKV_DEBUG=1 checks on the host before a CUDA call
                  (slot ranges, device scales); raises IndexError/ValueError.
    variant:      (*args) -> a tuple of the fields of ``variant_type``, the CUDA build the arguments
                  select (read on every CUDA call: keep it cheap); None when the op has no variants.
    specs:        target ("cpu" or a CUDA arch) -> the JitSpecs ``prebuild`` builds for it.
    reference:    the torch reference, called with the checked arguments by name.
    triton:       the name of the Triton launcher in jitkv/triton/<family>.py (called with the checked
                  arguments in order), or None.
    sample:       (device, generator) -> keyword arguments of a small valid call (fresh random data).
    bench_cpu, bench_gpu: (harness) -> benchmark rows, or None.
    backends:     backend order per device type (default jit -> torch on CPU, jit -> triton -> torch on CUDA).
    """

    def __init__(
        self,
        fn,
        *,
        schema: str,
        home: str,
        check,
        reference,
        sample,
        specs,
        variant=None,
        variant_type=None,
        debug_check=None,
        triton=None,
        bench_cpu=None,
        bench_gpu=None,
        backends=None,
    ):
        self.name, self.fn, self.schema = fn.__name__, fn, schema
        self.params = parse_schema(schema)
        names = [p.name for p in self.params]
        self.home, self._home_at = home, names.index(home)
        self.destinations = tuple(p.name for p in self.params if p.written)
        self.check, self.debug_check, self.reference, self.triton = check, debug_check, reference, triton
        self.variant, self.variant_type = variant, variant_type
        self.sample, self.specs, self.bench_cpu, self.bench_gpu = sample, specs, bench_cpu, bench_gpu
        self.family = fn.__module__.rsplit(".", 1)[-1]
        self.order = {**DEFAULT_ORDER, **(backends or {})}
        self.factories: dict[str, Factory] = {"torch": self._torch_factory}
        if triton is not None:
            self.factories["triton"] = self._triton_factory
        self._cpu: dict[str | None, Callable] = {}  # hot path: keyed by the backend argument
        self._cuda: dict[tuple, Callable] = {}  # hot path: (device index, backend argument, variant fields)
        self.run = self._make_run()
        if self.name in OPS:
            raise ValueError(f"jitkv: op {self.name!r} declared twice")
        OPS[self.name] = self

    def __repr__(self) -> str:
        return f"Op({self.name})"

    # ------------------------------------------------------------------------------ a call

    def _make_run(self):
        """``run(args, backend)``: the op on its public arguments ``args`` (in schema order, without
        ``backend``). A closure over what it reads: every eager call runs it, and a closure's cells
        are cheaper to read than the attributes of ``self``."""
        home_at, variant, check, compiled = self._home_at, self.variant, self.check, self.compiled
        cuda_get, cpu_get, cuda_runner, cpu_runner = self._cuda.get, self._cpu.get, self._cuda_runner, self._cpu_runner

        def run(args: tuple, backend=None):
            if is_compiling():
                return compiled(args, backend)
            home = args[home_at]
            try:
                # One tensor attribute read on the hot path (each costs tens of ns): the device index,
                # -1 off the accelerators. The device type is checked where a runner is first made;
                # a tensor of another type that meets a runner made for CUDA or the CPU (an XPU
                # tensor of a cached index, a meta tensor) fails in it, and the op's check names it.
                index = home.get_device()
                if index >= 0:
                    key = variant(*args) if variant is not None else ()
                    fn = cuda_get((index, backend, key)) or cuda_runner(index, backend, key, home)
                else:
                    fn = cpu_get(backend) or cpu_runner(backend, home)
            except (AttributeError, TypeError, KeyError, BackendUnavailable):
                # A home that is no tensor, arguments the variant cannot read, or a view no backend
                # (or the forced one) takes: bad input gets its own error first, whichever backend
                # would have run it.
                check(*args)
                raise
            try:
                again = fn(*args)
            except (AttributeError, IndexError, TypeError, ValueError, RuntimeError):
                # tvm-ffi's type errors name an argument by position, a DLPack refusal (meta) none, an
                # array that is no torch.Tensor (numpy) reaches a binding's dtype or device checks, and
                # a runner reading shapes meets arguments that have none: raise the op's check, which
                # names the argument as every backend does; what it accepts (a slot or position out of
                # range, a module's own limits, a launch failure) is the binding's to report.
                check(*args)
                raise
            if again is not None:
                cuda_runner(index, backend, again)(*args)

        return run

    def args_of(self, kwargs: dict) -> tuple:
        """The public arguments of a keyword call (defaults filled in), in schema order."""
        bound = inspect.signature(self.fn).bind(**kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments[p.name] for p in self.params)

    def runner(self, device: torch.device, backend: str | None = None, variant: tuple = ()) -> Callable:
        """The runner that calls with these arguments would take (tests and the benchmark)."""
        if device.type == "cuda":
            return self._cuda_runner(device.index if device.index is not None else 0, backend, variant)
        return self._cpu_runner(backend)

    def cuda_runner(self, index: int, backend: str | None, key: tuple) -> Callable:
        """The runner of CUDA device ``index`` for these variant fields, as ``run`` finds it: a dict
        lookup once made (no lock), for an op module's own fast path (transfer_pages' (K, V) launch)."""
        return self._cuda.get((index, backend, key)) or self._cuda_runner(index, backend, key)

    def _cpu_runner(self, backend, home=None):
        if home is not None and not home.is_cpu:
            raise checks.unsupported_device(self.name, self.home, home)
        with _LOCK:
            fn = self._cpu.get(backend)
            if fn is None:
                fn = self._cpu[backend] = self._resolve(_CPU, forced_backend(backend), None)
        return fn

    def _cuda_runner(self, index, backend, key, home=None):
        if home is not None and not home.is_cuda:
            raise checks.unsupported_device(self.name, self.home, home)
        with _LOCK:
            fn = self._cuda.get((index, backend, key))
            if fn is None:
                variant = self.variant_type(*key) if self.variant_type is not None else None
                fn = self._resolve(torch.device("cuda", index), forced_backend(backend), variant)
                self._cuda[(index, backend, key)] = fn
        return fn

    def reset(self) -> None:
        """Forget every decision (tests that change the environment or a factory)."""
        with _LOCK:
            self._cpu.clear()
            self._cuda.clear()
            _INFO.pop(self.name, None)

    # ---------------------------------------------------------------------- backend choice

    def backend(self, name: str):
        """Decorator registering ``factory(device, variant) -> (runner, info)`` for backend ``name``."""

        def deco(factory: Factory) -> Factory:
            self.factories[name] = factory
            return factory

        return deco

    def _resolve(self, device: torch.device, forced: str | None, variant) -> Callable:
        order = self.order[device.type]
        if forced is not None:
            if forced not in order:
                raise BackendUnavailable(f"{self.name}: backend {forced!r} is not available on {device.type}")
            try:
                fn, info = self.factories[forced](device, variant)
            except (BackendUnavailable, JitUnavailable) as e:
                raise BackendUnavailable(f"{self.name}: forced backend {forced!r} unavailable: {e.reason}") from e
            self._record(device, forced, "forced by backend=/JITKV_BACKEND", variant, info, forced=True)
            return fn
        failures = []
        for name in order:
            try:
                fn, info = self.factories[name](device, variant)
            except (BackendUnavailable, JitUnavailable) as e:
                failures.append(f"{name} unavailable: {e.reason}")
                continue
            reason = "; ".join(failures) if failures else "preferred backend"
            self._record(device, name, reason, variant, info)
            if failures:
                self._warn_fallback(name, reason)
            return fn
        raise BackendUnavailable(f"{self.name}: no backend can run on {device}: " + "; ".join(failures))

    def _record(self, device, name, reason, variant, info, forced: bool = False) -> None:
        """Note a decision for backend_info. A forced call (backend=) does not replace what the
        automatic choice decided: the automatic runner stays cached and keeps running later calls."""
        entry = {"backend": name, "reason": reason, **info}
        if variant is not None:
            entry["variant"] = variant
        per_device = _INFO.setdefault(self.name, {})
        previous = per_device.get(str(device))
        if forced and previous is not None and not previous.get("forced"):
            return
        if forced:
            entry["forced"] = True
        per_device[str(device)] = entry

    def note(self, device: torch.device, name: str, reason: str, info: dict, key: str | None = None) -> None:
        """Record for backend_info a path a runner chose inside its backend (transfer_pages' copy
        engines under its CPU-homed runner), as ``_resolve`` records a backend. A call per op call:
        nothing is written when backend_info already holds this backend and reason; ``key``:
        ``str(device)`` made once by the caller."""
        entry = _INFO.get(self.name, {}).get(key or str(device))
        if entry is not None and entry["reason"] == reason and entry["backend"] == name:
            return
        with _LOCK:
            self._record(device, name, reason, None, info)

    def _warn_fallback(self, name: str, reason: str) -> None:
        if (self.name, reason) in _WARNED:
            return
        _WARNED.add((self.name, reason))
        msg = f"jitkv: {self.name} falls back to the {name} backend: {reason}"
        logger.warning(msg)
        _warn.warn(msg, JitkvFallbackWarning)

    # ------------------------------------------------------------- the Python backends

    def with_debug_checks(self, device, run):
        """``run``, or on CUDA under JITKV_DEBUG=1 a runner that first checks the arguments and runs
        the host checks (slot ranges, device scales), which sync."""
        if not (device.type == "cuda" and self.debug_check is not None and debug_checks()):
            return run

        def checked(*args):
            self.debug_check(*self.check(*args))
            return run(*args)

        return checked

    def _python_runner(self, device, target):
        """A runner checking the arguments (and the host checks, as ``with_debug_checks``), then
        ``target(*checked)``."""
        debug = device.type == "cuda" and self.debug_check is not None and debug_checks()

        def run(*args):
            checked = self.check(*args)
            if debug:
                self.debug_check(*checked)
            target(*checked)

        return run

    def _torch_factory(self, device, variant):
        names = [p.name for p in self.params]
        return self._python_runner(device, lambda *a: self.reference(**dict(zip(names, a)))), {}

    def triton_kernel(self) -> Callable:
        """The Triton launcher, ``jitkv.triton.<family>.<triton>`` (imports triton)."""
        module = importlib.import_module(f"jitkv.triton.{self.family}")
        return getattr(module, self.triton)

    def _triton_factory(self, device, variant):
        if device.type != "cuda":
            raise BackendUnavailable("Triton kernels run on CUDA devices only")
        try:
            launcher = self.triton_kernel()
        except ImportError as e:
            raise BackendUnavailable(f"triton is not installed ({e})") from e

        def launch(*checked):
            with torch.cuda.device(device):
                launcher(*checked)

        return self._python_runner(device, launch), {}

    # ------------------------------------------------------------------- torch.compile

    def compiled(self, args: tuple, backend=None):
        """The call as the registered custom op ``torch.ops.jitkv.<name>`` (what torch.compile traces)."""
        flat = []
        for p, a in zip(self.params, args):
            if p.type == "Scale?":
                flat += _scale_parts(self.name, p.name, a)
            else:
                flat.append(a)
        return getattr(torch.ops.jitkv, self.name)(*flat, backend)

    def custom_op_schema(self) -> str:
        """The registered schema: every argument positional, a scale as ``Tensor? <name>_tensor`` and
        ``float <name>_value`` (codes.MISSING_SCALE: not given), ``str? backend`` last."""
        parts, alias = [], iter("abcdefghijklmnopqrstuvwxyz")
        for p in self.params:
            if p.type == "Scale?":
                parts += [f"Tensor? {p.name}_tensor=None", f"float {p.name}_value={codes.MISSING_SCALE}"]
                continue
            typ = f"Tensor({next(alias)}!){'?' if p.type.endswith('?') else ''}" if p.written else p.type
            parts.append(f"{typ} {p.name}" + (f"={p.default}" if p.default is not None else ""))
        return f"({', '.join([*parts, 'str? backend=None'])}) -> ()"

    def custom_op_impl(self, *flat, **named):
        """The registered op's implementation: the public function on the unflattened arguments."""
        values = dict(zip(self._flat_names(), flat), **named)
        kwargs = {}
        for p in self.params:
            if p.type == "Scale?":
                t, v = values.get(f"{p.name}_tensor"), values.get(f"{p.name}_value", codes.MISSING_SCALE)
                kwargs[p.name] = t if t is not None else (None if v == codes.MISSING_SCALE else v)
            elif p.name in values:
                kwargs[p.name] = values[p.name]
        self.fn(**kwargs, backend=values.get("backend"))

    def _flat_names(self) -> list[str]:
        names = []
        for p in self.params:
            names += [f"{p.name}_tensor", f"{p.name}_value"] if p.type == "Scale?" else [p.name]
        return [*names, "backend"]


def _scale_parts(op, name, scale) -> list:
    """A scale as the custom op takes it: (tensor or None, value or MISSING_SCALE)."""
    if isinstance(scale, torch.Tensor):
        return [scale, codes.MISSING_SCALE]
    if scale is None:
        return [None, codes.MISSING_SCALE]
    return [None, checks.scale_value(op, name, scale)]


def forced_backend(backend: str | None) -> str | None:
    name = backend if backend is not None else os.environ.get("JITKV_BACKEND", "auto")
    if not isinstance(name, str):
        raise TypeError(f"jitkv: backend: expected a str or None, got {type(name).__name__}")
    name = name.strip().lower()
    if name in ("", "auto"):
        return None
    if name not in BACKENDS:
        raise ValueError(f"jitkv: unknown backend {name!r}; expected one of auto, {', '.join(BACKENDS)}")
    return name


def debug_checks() -> bool:
    """JITKV_DEBUG=1: CUDA calls check slot ranges and device scales on the host first (syncs; not
    graph-safe). Read when an op's backend is resolved (first call per device and variant)."""
    return env_flag("JITKV_DEBUG")


def jit_function(spec: JitSpec, name: str):
    """(function ``name`` of the built module, its backend_info fields: key, artifact, and for a CPU
    module the kernel path it was built for, "isa": avx512, avx2 or scalar); JitUnavailable propagates."""
    info = {"key": artifact_dir(spec).name, "artifact": str(artifact_dir(spec))}
    if not spec.is_cuda:
        info["isa"] = get_function(spec, "cpu_isa")()
    return get_function(spec, name), info


def scale_args(op: str, name: str, scale) -> tuple:
    """A scale as the bindings take it: (float32 tensor or None, value or codes.MISSING_SCALE). A
    Python number is checked here; a tensor's dtype, size, device and, on the host, its values by the
    binding (jitkv/check.h check_host_scale; read here they cost microseconds a call: docs/performance.md
    "Host scale tensors"); a CUDA one's values only under JITKV_DEBUG=1."""
    if isinstance(scale, torch.Tensor):
        return scale, codes.MISSING_SCALE
    if scale is None:
        return None, codes.MISSING_SCALE
    return None, checks.scale_value(op, name, scale)


def backend_info(op: str | None = None) -> dict:
    """Per op and device: which backend runs and why, as decided by the calls made so far.

    ``{op: {device: {"backend", "reason", "variant"?, "key"?, "artifact"?, ...}}}``; with ``op`` given,
    that op's ``{device: {...}}`` only. Ops not called yet are absent (see ``python -m jitkv info``)."""
    with _LOCK:
        snapshot = {k: {d: dict(v) for d, v in devs.items()} for k, devs in _INFO.items()}
    return snapshot.get(op, {}) if op is not None else snapshot
