"""store_cache: MHA/GQA K and V row scatter with optional FP8 quantize-on-write (docs/design.md §2-§4)."""

from __future__ import annotations

import math

import torch
from torch.compiler import is_compiling

from .. import reference
from ..jit import JitSpec
from ..layouts import FP8_CODES, FP8_DTYPES
from . import _validate
from ._common import cuda_target, debug_checks, device_index, jit_function, name_ffi_error, require_triton
from ._dispatch import Dispatcher

OP = "store_cache"
_DISPATCH = Dispatcher(OP)
_MISSING_SCALE = -1.0  # tells the C++ binding "no scale given" (see store_cache.cuh)


def store_cache(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    *,
    kv_cache_dtype="auto",
    k_scale=None,
    v_scale=None,
    loc_map=None,
    skip_slot=None,
    backend=None,
):
    """Write K and V rows into their caches: ``k_cache[slot] = k[i]``, ``v_cache[slot] = v[i]``.

    Args:
        k, v: ``[n', H, D]`` or ``[n', H*D]`` (n' >= n; extra rows never read). Any token/head
            strides (views of a fused qkv tensor work); the last dim must be contiguous.
        k_cache, v_cache: flat ``[num_slots, H, D]`` / ``[num_slots, H*D]``, or paged in the logical
            shape ``[num_blocks, block_size, H, D]`` (an HND cache is passed as its
            ``.permute(0, 2, 1, 3)`` view). Slot s is block ``s // block_size``, token
            ``s % block_size``. Written in place; never copied or made contiguous.
        slot_mapping: ``[n]`` int32/int64. Slot < 0 or == ``skip_slot`` is padding (skipped).
        kv_cache_dtype: "auto" (cache dtype == source dtype, bitwise copy), "fp8"/"fp8_e4m3"
            (e4m3fn, max 448) or "fp8_e5m2" (max 57344): stored = RNE(clamp(x / scale, ±max)),
            from bf16/fp16/fp32 into float8 or uint8 caches.
        k_scale, v_scale: required for fp8: a finite float > 0, or a float32 tensor on the cache's
            device (read on the device, so CUDA graphs replay with new values) of 1 element, or of
            shape ``[H]``: per-head scales (vLLM's per-head quantization), head h of every row stored
            as RNE(clamp(x / scale[h], ±max)); K and V each take either kind. A tensor's values must
            be finite and > 0 too: checked on the host for CPU tensors, and for CUDA tensors only
            under ``JITKV_DEBUG=1`` (the check syncs; otherwise a value that is not finite and > 0
            writes unspecified codes, never outside the cache).
        loc_map: optional ``[num_full_slots]`` int32/int64; ``slot = loc_map[slot]`` first (full ->
            sliding-window pool), fused in the kernel; a mapped value < 0 is skipped.
        skip_slot: an extra padding slot, compared before ``loc_map``; None for none.
        backend: "jit", "triton", "torch" or None (auto; also ``JITKV_BACKEND``).

    Raises:
        TypeError: wrong dtype or non-tensor argument. ValueError: shape/device/layout mismatch,
        unknown kv_cache_dtype, fp8 string vs cache dtype mismatch, a missing scale, a scale tensor
        of neither 1 element nor shape ``[H]``, or a scale that is not finite and > 0 (see k_scale).
        IndexError: slot (or loc_map entry) out of range — CPU always, CUDA under JITKV_DEBUG=1 (CUDA
        otherwise skips the row); nothing is written then.

    Algorithm: CPU — one serial range check, then per-row AVX-512 copies / fp32->fp8 conversion,
    OpenMP above a payload threshold, non-temporal stores for caches far larger than the LLC.
    CUDA — K and V in one launch with 16-byte vectors and hardware saturating fp8 conversion: at
    small n a latency kernel (one vector per lane, all address math done while the slot load is in
    flight; fp8: K and V in separate warps), beyond it a bulk kernel (one warp per row, rows >= 2 KB
    split across warps); with per-head scales each lane divides by its vector's head's scale (its
    own kernels). Heads that are not a multiple of 16 bytes, and views whose base or used strides
    are not 16-byte aligned (the 16-byte build checks them and answers before launching), take the
    any-alignment build (the widest vector the call allows), recorded in ``backend_info``
    ("alignment"). Triton (one program per row) as the fallback.
    """
    if is_compiling():
        ks_t, ks_v = _scale_args(k_scale, "k_scale", kv_cache_dtype)
        vs_t, vs_v = _scale_args(v_scale, "v_scale", kv_cache_dtype)
        return torch.ops.jitkv.store_cache(
            k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype, ks_t, ks_v, vs_t, vs_v, loc_map, skip_slot, backend
        )
    index = device_index(OP, "k_cache", k_cache)
    if index < 0:
        _DISPATCH.get_cpu(backend)(k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, loc_map,
                                   skip_slot)
        return
    variant = _cuda_variant(k, v, k_cache, v_cache, kv_cache_dtype)
    impl = _DISPATCH.get_cuda(index, backend, variant)
    if impl(k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, loc_map, skip_slot):
        # NEEDS_ANY_ALIGNMENT: the 16-byte build found an address or stride it cannot use, before any launch.
        impl = _DISPATCH.get_cuda(index, backend, any_alignment(variant))
        impl(k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, loc_map, skip_slot)


def _scale_args(scale, name, kv_cache_dtype):
    """(tensor or None, float value) as the bindings take a scale; -1.0 means "not given"."""
    if isinstance(scale, torch.Tensor):
        return scale, _MISSING_SCALE
    if scale is None or kv_cache_dtype == "auto":
        return None, _MISSING_SCALE
    return None, _validate.scale_value(OP, name, scale)


COPY = FP8_CODES[None]
# kv_cache_dtype -> the cache format's code (the binding's kv_cache_dtype argument, JITKV_KV_DTYPE).
_KV_CODE = {"auto": COPY, **{name: FP8_CODES[dtype] for name, dtype in FP8_DTYPES.items()}}
_SRC_CODE = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}  # JITKV_SRC_DTYPE of fp8 builds; 0: a copy
GENERIC = (0, 0)  # head bytes of the any-alignment build: vector width picked per call
ALIGNED, ANY_ALIGNMENT = 16, 1  # the variant's last field: the bytes every address is a multiple of
NEEDS_ANY_ALIGNMENT = 1  # a 16-byte binding's answer to a view it cannot address (store_cache.cuh Status)


def _cuda_variant(k, v, k_cache, v_cache, kv_cache_dtype) -> tuple:
    """The CUDA build for these arguments: (K head bytes, V head bytes, source dtype code, fp8 code,
    alignment). Head bytes are those of the cache (head_dim * cache element size). Heads of whole
    16-byte multiples take the 16-byte build (ALIGNED), whose binding checks every address and stride
    and answers NEEDS_ANY_ALIGNMENT (before any launch) to a view it cannot address; other heads, and
    arguments this cannot read (the binding then raises the precise error), take the any-alignment
    build (head bytes GENERIC). Runs on every eager call: caches with a head dim (3-D flat, 4-D paged)
    give head_dim as their last dim, read once from each shape, and both caches have one element size
    (else the binding raises)."""
    try:
        kv = _KV_CODE[kv_cache_dtype]
        ks, vs = k_cache.shape, v_cache.shape
        if len(ks) > 2 and len(vs) > 2:
            es = k_cache.element_size()
            kb, vb = ks[-1] * es, vs[-1] * es
        else:
            kb, vb = _head_bytes_any_layout(k, k_cache, v, v_cache)
        src = _SRC_CODE.get(k.dtype, 0) if kv != COPY else 0
        if (kb | vb) % 16 == 0 and kb > 0 and vb > 0:
            return (kb, vb, src, kv, ALIGNED)
    except (AttributeError, KeyError, TypeError, ZeroDivisionError):
        return (*GENERIC, 0, COPY, ANY_ALIGNMENT)
    return (*GENERIC, src, kv, ANY_ALIGNMENT)


def any_alignment(variant: tuple) -> tuple:
    """The any-alignment build of a variant's sources and cache format."""
    return (*GENERIC, *variant[2:4], ANY_ALIGNMENT)


def _head_bytes_any_layout(k, k_cache, v, v_cache) -> tuple[int, int]:
    h = _num_heads(k, k_cache, v, v_cache)
    return math.prod(k.shape[1:]) // h * k_cache.element_size(), math.prod(v.shape[1:]) // h * v_cache.element_size()


def _num_heads(k, k_cache, v, v_cache) -> int:
    """H from the first tensor with a head dim (3-D source, 3-D/4-D cache), as the binding does."""
    for t, is_cache in ((k, False), (k_cache, True), (v, False), (v_cache, True)):
        if t.dim() == 3 or (is_cache and t.dim() == 4):
            return t.shape[-2]
    return 1


# Argument names of the C++ binding, by position (for tvm-ffi's positional type errors).
_BINDING_ARGS = ("k", "v", "k_cache", "v_cache", "slot_mapping", "loc_map", "skip_slot", "kv_cache_dtype",
                 "k_scale", "v_scale", "k_scale", "v_scale")


COPY_ENTRY = "store_cache_copy"  # the binding's kv_cache_dtype "auto" entry point: 7 arguments instead of 12


def cpu_spec() -> JitSpec:
    return JitSpec("store_cache_cpu", ("store_cache/store_cache_cpu.cpp",), exports=(OP, COPY_ENTRY))


def cuda_spec(arch: str, k_head_bytes: int, v_head_bytes: int, src_dtype: int, kv_dtype: int, *,
              pdl: bool = True) -> JitSpec:
    """The CUDA module for caches of ``k_head_bytes``/``v_head_bytes`` per head (GENERIC: the
    any-alignment build), sources of ``src_dtype`` (_SRC_CODE; 0 for a copy) and the cache format
    ``kv_dtype`` (_KV_CODE); ``pdl=False`` launches without programmatic dependent launch."""
    return JitSpec(
        "store_cache_cuda",
        ("store_cache/store_cache_cuda.cu",),
        args=(("k_head_bytes", k_head_bytes), ("v_head_bytes", v_head_bytes), ("src_dtype", src_dtype),
              ("kv_dtype", kv_dtype), ("pdl", int(pdl))),
        target=arch,
        exports=(OP, COPY_ENTRY),
    )


# Prebuilt CUDA variants: bf16/fp16 head_dim 64, 128, 256 copies; bf16 -> e4m3 at 128; any alignment.
CUDA_PREBUILD_VARIANTS = ((128, 128, 0, COPY), (256, 256, 0, COPY), (512, 512, 0, COPY),
                          (128, 128, _SRC_CODE[torch.bfloat16], _KV_CODE["fp8_e4m3"]), (*GENERIC, 0, COPY))


@_DISPATCH.register("jit")
def _jit(device, variant):
    if device.type == "cpu":
        spec = cpu_spec()
    else:
        *build, alignment = variant
        spec = cuda_spec(cuda_target(device), *build)
    fn, info = jit_function(spec, OP)
    copy_fn, _ = jit_function(spec, COPY_ENTRY)
    if device.type == "cuda":
        info["alignment"] = "16 bytes" if alignment == ALIGNED else "any (vector width per call)"
    return _binding_caller(fn, copy_fn, debug=device.type == "cuda" and debug_checks()), info


def _binding_caller(fn, copy_fn, debug=False):
    """Call a store_cache binding with the public arguments ("auto" through its short entry point,
    ``copy_fn``)."""

    def run(k, v, k_cache, v_cache, slot_mapping, kv_dtype, k_scale, v_scale, loc_map, skip):
        """The binding's status: 0 done, NEEDS_ANY_ALIGNMENT from a 16-byte build given a view it
        cannot address (nothing launched)."""
        if debug:
            _validate.store_cache(k, v, k_cache, v_cache, slot_mapping, kv_dtype, k_scale, v_scale, loc_map, debug)
            _host_range_check(k_cache, slot_mapping, loc_map, skip)
        skip = -1 if skip is None else skip
        if kv_dtype == "auto":  # the common case: no scales to look at
            try:
                return copy_fn(k, v, k_cache, v_cache, slot_mapping, loc_map, skip)
            except (TypeError, RuntimeError) as e:
                args = (k, v, k_cache, v_cache, slot_mapping, loc_map, skip)
                raise name_ffi_error(OP, e, _BINDING_ARGS, args) from None
        args = (k, v, k_cache, v_cache, slot_mapping, loc_map, skip, *_fp8_scale_args(kv_dtype, k_scale, v_scale))
        try:
            return fn(*args)
        except (TypeError, RuntimeError) as e:
            raise name_ffi_error(OP, e, _BINDING_ARGS, args) from None

    return run


def _fp8_scale_args(kv_dtype, k_scale, v_scale):
    """(dtype code, k_scale tensor, v_scale tensor, k_scale value, v_scale value) for the binding.
    The binding checks a scale tensor's dtype, size and device; a CPU one's value is checked here."""
    code = _KV_CODE.get(kv_dtype) if isinstance(kv_dtype, str) else None
    if code is None:
        raise ValueError(f"{OP}: kv_cache_dtype: expected one of {', '.join(_validate.KV_CACHE_DTYPES)}, got {kv_dtype!r}")
    ks_t, ks_v = _scale_args(k_scale, "k_scale", kv_dtype)
    vs_t, vs_v = _scale_args(v_scale, "v_scale", kv_dtype)
    for name, t in (("k_scale", ks_t), ("v_scale", vs_t)):
        if t is not None and t.is_cpu:
            _validate.scale_tensor_value(OP, name, t)
    return code, ks_t, vs_t, ks_v, vs_v


def _host_range_check(k_cache, slot_mapping, loc_map, skip):
    num_slots = k_cache.shape[0] * (k_cache.shape[1] if k_cache.dim() == 4 else 1)
    reference.check_slots(slot_mapping, num_slots, skip_slot=skip, loc_map=loc_map, op=OP)


@_DISPATCH.register("triton")
def _triton(device, variant):
    require_triton(device)
    from ..triton.store_cache import store_cache_triton  # noqa: PLC0415

    debug = debug_checks()

    def run(k, v, k_cache, v_cache, slot_mapping, kv_dtype, k_scale, v_scale, loc_map, skip):
        kv, vv, kc, vc, (ks, vs) = _validate.store_cache(k, v, k_cache, v_cache, slot_mapping, kv_dtype, k_scale, v_scale,
                                                         loc_map, debug)
        if debug:
            _host_range_check(kc, slot_mapping, loc_map, skip)
        if slot_mapping.numel():
            with torch.cuda.device(device):
                store_cache_triton(kv, vv, kc, vc, slot_mapping, loc_map, -1 if skip is None else skip,
                                   _canonical_dtype(kv_dtype), _scale_tensor(ks, device), _scale_tensor(vs, device))

    return run, {}


def _canonical_dtype(kv_dtype: str) -> str:
    return "fp8_e4m3" if kv_dtype == "fp8" else kv_dtype


def _scale_tensor(scale, device):
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    return torch.tensor([scale], dtype=torch.float32, device=device)


@_DISPATCH.register("torch")
def _torch(device, variant):
    debug = debug_checks()

    def run(k, v, k_cache, v_cache, slot_mapping, kv_dtype, k_scale, v_scale, loc_map, skip):
        kv, vv, kc, vc, (ks, vs) = _validate.store_cache(k, v, k_cache, v_cache, slot_mapping, kv_dtype, k_scale, v_scale,
                                                         loc_map, debug)
        reference.store_cache(kv, vv, kc, vc, slot_mapping, kv_cache_dtype=kv_dtype, k_scale=ks, v_scale=vs,
                              loc_map=loc_map, skip_slot=skip)

    return run, {}


def jit_specs(target: str) -> list[JitSpec]:
    if target == "cpu":
        return [cpu_spec()]
    return [cuda_spec(target, *v) for v in CUDA_PREBUILD_VARIANTS]


def reset() -> None:
    _DISPATCH.reset()
