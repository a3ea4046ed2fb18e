"""set_mla_kv_buffer: the MLA ``[nope | rope]`` row scatter (docs/design.md §2, §3)."""

from __future__ import annotations

import torch
from torch.compiler import is_compiling

from .. import reference
from ..jit import JitSpec
from . import _validate
from ._common import cuda_target, debug_checks, device_index, jit_function, name_ffi_error, require_triton
from ._dispatch import Dispatcher

OP = "set_mla_kv_buffer"
_DISPATCH = Dispatcher(OP)


def set_mla_kv_buffer(kv_buffer, loc, cache_k_nope, cache_k_rope, *, skip_slot=None, backend=None):
    """Scatter MLA rows: ``kv_buffer[loc[i], :nope] = k_nope[i]``, ``kv_buffer[loc[i], nope:nope+rope] = k_rope[i]``.

    Args:
        kv_buffer: ``[num_slots, W]`` or ``[num_slots, 1, W]``, W >= nope + rope; written in place,
            columns past nope + rope untouched. Any row stride; the last dim must be contiguous.
        loc: ``[n]`` int32 or int64 slot per row. ``loc < 0`` and ``loc == skip_slot`` are padding
            (skipped); ``loc >= num_slots`` is never written (CPU raises IndexError first; CUDA skips,
            or raises IndexError on the host with ``JITKV_DEBUG=1``).
        cache_k_nope: ``[n', nope]`` or ``[n', 1, nope]``, n' >= n (extra rows are never read).
        cache_k_rope: ``[n', rope]`` or ``[n', 1, rope]``.
            One dtype everywhere: bf16, fp16, fp32, or a 1-byte type (uint8, float8_e4m3fn,
            float8_e5m2) for pre-quantized byte layouts such as 528 + 128.
        skip_slot: an extra padding slot (engines that reserve slot 0), or None.
        backend: "jit", "triton", "torch" or None (auto; also ``JITKV_BACKEND``).

    Raises:
        TypeError: wrong dtype or a non-tensor argument. ValueError: shape, device or layout
        mismatch. IndexError: an out-of-range slot (CPU, or CUDA under JITKV_DEBUG=1); nothing is
        written then.

    Algorithm: CPU — one pass over rows with AVX-512 copies, OpenMP above a payload threshold,
    non-temporal stores when the buffer dwarfs the LLC. CUDA — for 16-byte aligned rows a latency
    kernel: one warp per row issues the slot load and the row's 16-byte loads together after the
    programmatic-dependent-launch wait (SM90+), lets the next kernel launch, then stores if the slot
    is kept (padding rows' sources are read, never written); other views take a bulk kernel that
    reads the slot first. A TMA bulk-store variant (sm_90a) is built but only runs when forced: it
    measured no faster. Triton (one program per row) as the fallback.
    """
    if is_compiling():
        return torch.ops.jitkv.set_mla_kv_buffer(kv_buffer, loc, cache_k_nope, cache_k_rope, skip_slot, backend)
    index = device_index(OP, "kv_buffer", kv_buffer)
    if index < 0:
        impl = _DISPATCH.get_cpu(backend)
    else:
        impl = _DISPATCH.get_cuda(index, backend, _cuda_variant(cache_k_nope, cache_k_rope))
    impl(kv_buffer, loc, cache_k_nope, cache_k_rope, skip_slot)


def _cuda_variant(k_nope, k_rope) -> tuple:
    """CUDA kernels are templated on the nope and rope byte widths."""
    try:
        return (k_nope.shape[-1] * k_nope.element_size(), k_rope.shape[-1] * k_rope.element_size())
    except AttributeError:
        name = "cache_k_nope" if not isinstance(k_nope, torch.Tensor) else "cache_k_rope"
        raise TypeError(f"{OP}: {name}: expected a torch.Tensor") from None


def cpu_spec() -> JitSpec:
    return JitSpec("mla_cpu", ("mla/set_mla_kv_buffer_cpu.cpp",), exports=(OP,))


# Kernels a module can be built to run (set_mla_kv_buffer_cuda.cu): "auto" is the measured choice the op
# uses; the others exist for the tests and the benchmark's per-kernel rows.
KERNELS = {"auto": 0, "tma": 1, "vector": 2, "latency": 3}


def cuda_spec(arch: str, nope_bytes: int, rope_bytes: int, *, kernel: str = "auto", pdl: bool = True) -> JitSpec:
    """The CUDA module for rows of ``nope_bytes + rope_bytes``; ``kernel`` in KERNELS forces one kernel
    (a call it cannot run raises ValueError), ``pdl=False`` launches without programmatic dependent launch."""
    return JitSpec(
        "mla_cuda",
        ("mla/set_mla_kv_buffer_cuda.cu",),
        args=(("nope_bytes", nope_bytes), ("rope_bytes", rope_bytes), ("kernel", KERNELS[kernel]), ("pdl", int(pdl))),
        target=arch,
        exports=(OP,),
    )


# Byte layouts prebuilt for CUDA: DeepSeek/Kimi bf16 512+64, fp8 528+128 and 512+64.
CUDA_PREBUILD_VARIANTS = ((1024, 128), (656, 0), (528, 128), (512, 64))


_BINDING_ARGS = ("kv_buffer", "loc", "k_nope", "k_rope", "skip_slot")


def _skip(skip_slot) -> int:
    return -1 if skip_slot is None else int(skip_slot)


@_DISPATCH.register("jit")
def _jit(device, variant):
    if device.type == "cpu":
        fn, info = jit_function(cpu_spec(), OP)

        def run_cpu(buf, loc, nope, rope, skip):
            args = (buf, loc, nope, rope, -1 if skip is None else skip)
            try:
                fn(*args)
            except (TypeError, RuntimeError) as e:
                raise name_ffi_error(OP, e, _BINDING_ARGS, args) from None

        return run_cpu, info
    fn, info = jit_function(cuda_spec(cuda_target(device), *variant), OP)
    info["path"] = "latency kernel for 16-byte aligned rows, else the bulk vector kernel (set_mla_kv_buffer_cuda.cu)"
    debug = debug_checks()

    def run(buf, loc, nope, rope, skip):
        if debug:
            _host_range_check(buf, loc, skip)
        args = (buf, loc, nope, rope, _skip(skip))
        try:
            fn(*args)
        except (TypeError, RuntimeError) as e:
            raise name_ffi_error(OP, e, _BINDING_ARGS, args) from None

    return run, info


def _host_range_check(buf, loc, skip):
    reference.check_slots(loc, buf.shape[0], skip_slot=skip, name="loc", op=OP)


@_DISPATCH.register("triton")
def _triton(device, variant):
    require_triton(device)
    from ..triton.mla import set_mla_kv_buffer_triton  # noqa: PLC0415

    debug = debug_checks()

    def run(buf, loc, nope, rope, skip):
        b, n, r = _validate.mla(buf, loc, nope, rope)
        if debug:
            _host_range_check(b, loc, skip)
        if loc.numel():
            with torch.cuda.device(device):
                set_mla_kv_buffer_triton(b, loc, n, r, _skip(skip))

    return run, {}


@_DISPATCH.register("torch")
def _torch(device, variant):
    def run(buf, loc, nope, rope, skip):
        b, n, r = _validate.mla(buf, loc, nope, rope)
        reference.set_mla_kv_buffer(b, loc, n, r, skip_slot=skip)

    return run, {}


def jit_specs(target: str) -> list[JitSpec]:
    """Specs ``prebuild``/``warmup`` build for a target ("cpu" or a CUDA arch)."""
    if target == "cpu":
        return [cpu_spec()]
    return [cuda_spec(target, nope, rope) for nope, rope in CUDA_PREBUILD_VARIANTS]


def reset() -> None:
    _DISPATCH.reset()
