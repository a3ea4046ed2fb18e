"""set_mla_kv_buffer: the MLA ``[nope | rope]`` row scatter, copied or quantized to FP8 on write
(docs/design.md §2-§4)."""

from __future__ import annotations

import torch
from torch.compiler import is_compiling

from .. import reference
from ..jit import JitSpec
from ..layouts import (
    DS_MLA_CODE,
    DS_MLA_NOPE,
    DS_MLA_ROPE,
    FP8_CODES,
    FP8_DTYPES,
)
from . import _validate
from ._common import cuda_target, debug_checks, device_index, jit_function, name_ffi_error, require_triton
from ._dispatch import Dispatcher

OP = "set_mla_kv_buffer"
FP8_ENTRY = "set_mla_kv_buffer_fp8"  # the bindings' quantizing entry point
_DISPATCH = Dispatcher(OP)  # kv_cache_dtype "auto"
_FP8 = Dispatcher(OP)  # the fp8 formats
_MISSING_SCALE = -1.0  # tells the C++ binding "no scale given" (set_mla_kv_buffer.cuh parse_fp8_scale)

# kv_cache_dtype -> the cache format code of the kernels' build arguments (jitkv/layouts.py).
FORMATS = {**{name: FP8_CODES[dtype] for name, dtype in FP8_DTYPES.items()}, "fp8_ds_mla": DS_MLA_CODE}
_SRC_CODES = {torch.bfloat16: 1, torch.float16: 2}  # fp8 sources (JITKV_SRC_DTYPE)


def set_mla_kv_buffer(kv_buffer, loc, cache_k_nope, cache_k_rope, *, kv_cache_dtype="auto", scale=None,
                      skip_slot=None, backend=None):
    """Scatter MLA rows: ``kv_buffer[loc[i], :nope] = k_nope[i]``, ``kv_buffer[loc[i], nope:nope+rope] = k_rope[i]``,
    copied, or quantized to FP8 on the way (``kv_cache_dtype``).

    Args:
        kv_buffer: ``[num_slots, W]`` or ``[num_slots, 1, W]``; written in place, columns past the
            written row untouched. Any row stride; the last dim must be contiguous.
        loc: ``[n]`` int32 or int64 slot per row. ``loc < 0`` and ``loc == skip_slot`` are padding
            (skipped); ``loc >= num_slots`` is never written (CPU raises IndexError first; CUDA skips,
            or raises IndexError on the host with ``JITKV_DEBUG=1``).
        cache_k_nope: ``[n', nope]`` or ``[n', 1, nope]``, n' >= n (extra rows are never read).
        cache_k_rope: ``[n', rope]`` or ``[n', 1, rope]``.
        kv_cache_dtype: what a row becomes (docs/design.md §4):

            - "auto": a bitwise copy, W >= nope + rope. One dtype everywhere: bf16, fp16, fp32, or a
              1-byte type (uint8, float8_e4m3fn, float8_e5m2) for pre-quantized byte layouts such as
              528 + 128.
            - "fp8"/"fp8_e4m3" (max 448), "fp8_e5m2" (max 57344): each value stored as
              ``fp8(clamp(x / scale, ±max))`` (true fp32 division, round to nearest even), nope then
              rope, one byte each. Sources bf16 or fp16; kv_buffer uint8 or the format's float8 dtype,
              W >= nope + rope bytes.
            - "fp8_ds_mla": vLLM's 656-byte DeepSeek record (jitkv/layouts.py ``DS_MLA_*``), nope 512
              and rope 64 values, bf16 or fp16, kv_buffer uint8 with W >= 656::

                  byte 0        512          528                 656
                       | e4m3 x 512 | fp32 x 4 | rope 16-bit x 64 |
                         4 tiles of 128 values; tile t's scale at 512 + 4 t

              per tile amax = max |x| (NaN left out), scale = max(amax / 448, FLT_MIN) (true
              division), values stored as e4m3(clamp(x / scale, ±448)); the rope values' 16-bit
              patterns are copied (vLLM's concat_and_cache_ds_mla).
        scale: "fp8"/"fp8_e4m3"/"fp8_e5m2" only, required: a finite float > 0, or a 1-element
            float32 tensor on kv_buffer's device (read on the device, so CUDA graphs replay with new
            values; its value is checked on the host for CPU tensors, for CUDA tensors only under
            ``JITKV_DEBUG=1``). None for "auto" and "fp8_ds_mla".
        skip_slot: an extra padding slot (engines that reserve slot 0), or None.
        backend: "jit", "triton", "torch" or None (auto; also ``JITKV_BACKEND``).

    Raises:
        TypeError: wrong dtype or a non-tensor argument. ValueError: shape, device or layout mismatch,
        an unknown kv_cache_dtype, a buffer dtype the format does not write, a missing or invalid
        scale (or one given to "fp8_ds_mla"). IndexError: an out-of-range slot (CPU, or CUDA under
        JITKV_DEBUG=1); nothing is written then.

    Algorithm: CPU — one pass over rows with AVX-512 copies or fp8 conversions, OpenMP above a
    payload threshold, non-temporal stores when the buffer dwarfs the LLC. CUDA — for 16-byte
    aligned rows a latency kernel: one warp per row (one per 16-byte register of the row up to 32
    rows; fp8: the same up to 32 rows for e4m3 / e5m2, then two warps per row up to 8 rows per SM)
    issues the slot load and the row's 16-byte loads together after the programmatic-dependent-launch
    wait (SM90+), lets the next kernel launch, then stores if the slot is kept (padding rows' sources
    are read, never written); fp8 divides with a branch-free exact reciprocal division and converts
    with cvt.satfinite, fp8_ds_mla reduces each tile's amax with redux.sync. Other views take a bulk
    (copy) or generic (fp8) kernel that reads the slot first. A TMA bulk-store copy variant (sm_90a)
    is built but only runs when forced: it measured no faster. Triton (one program per row) as the
    fallback.
    """
    if is_compiling():
        scale_t, scale_v = _scale_args(scale, kv_cache_dtype)
        return torch.ops.jitkv.set_mla_kv_buffer(kv_buffer, loc, cache_k_nope, cache_k_rope, skip_slot, backend,
                                                 kv_cache_dtype, scale_t, scale_v)
    index = device_index(OP, "kv_buffer", kv_buffer)
    if kv_cache_dtype == "auto":
        if index < 0:
            impl = _DISPATCH.get_cpu(backend)
        else:
            impl = _DISPATCH.get_cuda(index, backend, _cuda_variant(cache_k_nope, cache_k_rope))
        impl(kv_buffer, loc, cache_k_nope, cache_k_rope, skip_slot)
        return
    code = _format_code(kv_cache_dtype)
    if index < 0:
        impl = _FP8.get_cpu(backend)
    else:
        impl = _FP8.get_cuda(index, backend, _fp8_variant(code, cache_k_nope, cache_k_rope))
    impl(kv_buffer, loc, cache_k_nope, cache_k_rope, skip_slot, kv_cache_dtype, scale)


def _format_code(kv_cache_dtype) -> int:
    code = FORMATS.get(kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None
    if code is None:
        raise ValueError(f"{OP}: kv_cache_dtype: expected one of auto, {', '.join(FORMATS)}, got {kv_cache_dtype!r}")
    return code


def _scale_args(scale, kv_cache_dtype):
    """(tensor or None, float value) as the custom op takes a scale; -1.0 means "not given"."""
    if isinstance(scale, torch.Tensor):
        return scale, _MISSING_SCALE
    if scale is None or kv_cache_dtype == "auto":
        return None, _MISSING_SCALE
    return None, _validate.scale_value(OP, "scale", scale)


def _cuda_variant(k_nope, k_rope) -> tuple:
    """CUDA kernels are templated on the nope and rope byte widths."""
    try:
        return (k_nope.shape[-1] * k_nope.element_size(), k_rope.shape[-1] * k_rope.element_size())
    except AttributeError:
        name = "cache_k_nope" if not isinstance(k_nope, torch.Tensor) else "cache_k_rope"
        raise TypeError(f"{OP}: {name}: expected a torch.Tensor") from None


def _fp8_variant(code, k_nope, k_rope) -> tuple:
    """CUDA fp8 modules are templated on the row parts' source bytes (fp8_ds_mla: the record's; the
    binding names any other width), the format and the source dtype."""
    src = _SRC_CODES.get(_validate.tensor(OP, "k_nope", k_nope).dtype)
    if src is None:
        raise TypeError(f"{OP}: k_nope: fp8 quantize-on-write takes bfloat16 or float16 sources, got {k_nope.dtype}")
    if code == DS_MLA_CODE:
        return (2 * DS_MLA_NOPE, 2 * DS_MLA_ROPE, code, src)
    return (2 * k_nope.shape[-1], 2 * _validate.tensor(OP, "k_rope", k_rope).shape[-1], code, src)


def cpu_spec() -> JitSpec:
    return JitSpec("mla_cpu", ("mla/set_mla_kv_buffer_cpu.cpp",), exports=(OP, FP8_ENTRY))


# Kernels a module can be built to run (set_mla_kv_buffer_cuda.cu): "auto" is the measured choice the op
# uses; the others exist for the tests and the benchmark's per-kernel rows.
KERNELS = {"auto": 0, "tma": 1, "vector": 2, "latency": 3}
# The same for the fp8 modules: two warps per row, one warp per row, the any-alignment kernel, one source
# vector per lane (e4m3 / e5m2).
FP8_KERNELS = {"auto": 0, "split": 1, "row": 2, "generic": 3, "lanes": 4}


def cuda_spec(arch: str, nope_bytes: int, rope_bytes: int, *, kernel: str = "auto", pdl: bool = True,
              kv_format: int = 0, src_dtype: int = 0) -> JitSpec:
    """The CUDA module for rows of ``nope_bytes + rope_bytes`` source bytes: the copy (``kv_format`` 0,
    exports set_mla_kv_buffer), or the writer of an fp8 format (a FORMATS code, with ``src_dtype`` 1
    bf16 or 2 fp16; exports set_mla_kv_buffer_fp8). ``kernel`` in KERNELS (FP8_KERNELS) forces one
    kernel (a call it cannot run raises ValueError), ``pdl=False`` launches without programmatic
    dependent launch."""
    kernels = FP8_KERNELS if kv_format else KERNELS
    args = (("nope_bytes", nope_bytes), ("rope_bytes", rope_bytes), ("kernel", kernels[kernel]), ("pdl", int(pdl)))
    if kv_format:
        args += (("kv_format", kv_format), ("src_dtype", src_dtype))
        return JitSpec("mla_cuda", ("mla/set_mla_kv_buffer_fp8_cuda.cu",), args=args, target=arch, exports=(FP8_ENTRY,))
    return JitSpec("mla_cuda", ("mla/set_mla_kv_buffer_cuda.cu",), args=args, target=arch, exports=(OP,))


# Byte layouts prebuilt for CUDA: DeepSeek/Kimi bf16 512+64, fp8 528+128 and 512+64; quantizing bf16
# 512+64 to e4m3 and to the fp8_ds_mla record.
CUDA_PREBUILD_VARIANTS = ((1024, 128), (656, 0), (528, 128), (512, 64))
CUDA_PREBUILD_FP8 = ((1024, 128, FORMATS["fp8_e4m3"], 1), (1024, 128, DS_MLA_CODE, 1))


_BINDING_ARGS = ("kv_buffer", "loc", "k_nope", "k_rope", "skip_slot")
_FP8_BINDING_ARGS = (*_BINDING_ARGS, "kv_cache_dtype", "scale", "scale")


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


def _fp8_binding_args(kv_cache_dtype, scale):
    """(format code, scale tensor or None, scale value) for a binding: the bindings check a scale
    tensor's dtype, size and device and a missing scale; a float's and a CPU tensor's value are checked
    here, and a scale given to fp8_ds_mla."""
    code = FORMATS[kv_cache_dtype]
    if code == DS_MLA_CODE:
        _validate.no_ds_mla_scale(OP, scale)
        return code, None, _MISSING_SCALE
    if isinstance(scale, torch.Tensor):
        if scale.is_cpu:
            _validate.scale_tensor_value(OP, "scale", scale)
        return code, scale, _MISSING_SCALE
    if scale is None:
        return code, None, _MISSING_SCALE
    return code, None, _validate.scale(OP, "scale", scale, None, "kv_buffer")


def _fp8_caller(fn, debug=False):
    def run(buf, loc, nope, rope, skip, kv_cache_dtype, scale):
        if debug:
            _validate.mla_fp8(buf, loc, nope, rope, kv_cache_dtype, scale, debug)
            _host_range_check(buf, loc, skip)
        args = (buf, loc, nope, rope, _skip(skip), *_fp8_binding_args(kv_cache_dtype, scale))
        try:
            fn(*args)
        except (TypeError, RuntimeError) as e:
            raise name_ffi_error(OP, e, _FP8_BINDING_ARGS, args) from None

    return run


@_FP8.register("jit")
def _jit_fp8(device, variant):
    if device.type == "cpu":
        fn, info = jit_function(cpu_spec(), FP8_ENTRY)
        return _fp8_caller(fn), info
    nope_bytes, rope_bytes, code, src = variant
    fn, info = jit_function(cuda_spec(cuda_target(device), nope_bytes, rope_bytes, kv_format=code, src_dtype=src),
                            FP8_ENTRY)
    info["path"] = ("fp8 kernel for 16-byte aligned sources (e4m3 / e5m2: one vector per lane up to 32 rows; then "
                    "two warps per row up to 8 rows per SM, else one), else the generic fp8 kernel "
                    "(set_mla_kv_buffer_cuda.cu)")
    return _fp8_caller(fn, debug_checks()), info


@_FP8.register("triton")
def _triton_fp8(device, variant):
    require_triton(device)
    from ..triton.mla import set_mla_kv_buffer_fp8_triton  # noqa: PLC0415

    debug = debug_checks()

    def run(buf, loc, nope, rope, skip, kv_cache_dtype, scale):
        b, n, r, s = _validate.mla_fp8(buf, loc, nope, rope, kv_cache_dtype, scale, debug)
        if debug:
            _host_range_check(b, loc, skip)
        if loc.numel():
            if s is not None and not isinstance(s, torch.Tensor):
                s = torch.full((1,), s, dtype=torch.float32, device=device)
            with torch.cuda.device(device):
                set_mla_kv_buffer_fp8_triton(b, loc, n, r, _skip(skip), kv_cache_dtype, s)

    return run, {}


@_FP8.register("torch")
def _torch_fp8(device, variant):
    debug = debug_checks()

    def run(buf, loc, nope, rope, skip, kv_cache_dtype, scale):
        b, n, r, s = _validate.mla_fp8(buf, loc, nope, rope, kv_cache_dtype, scale, debug)
        reference.set_mla_kv_buffer_fp8(b, loc, n, r, kv_cache_dtype=kv_cache_dtype, scale=s, skip_slot=skip)

    return run, {}


def jit_specs(target: str) -> list[JitSpec]:
    """Specs ``prebuild``/``warmup`` build for a target ("cpu" or a CUDA arch)."""
    if target == "cpu":
        return [cpu_spec()]
    return [cuda_spec(target, nope, rope) for nope, rope in CUDA_PREBUILD_VARIANTS] + [
        cuda_spec(target, nope, rope, kv_format=code, src_dtype=src) for nope, rope, code, src in CUDA_PREBUILD_FP8
    ]


def reset() -> None:
    _DISPATCH.reset()
    _FP8.reset()
