"""store_cache: MHA/GQA K and V row scatter with optional FP8 quantize-on-write (DESIGN §2-§4)."""

from __future__ import annotations

import torch

from .. import reference
from ..jit import JitSpec
from . import _validate
from ._common import cuda_target, debug_checks, device_of, jit_function, name_ffi_type_error, require_triton
from ._dispatch import BackendUnavailable, Dispatcher

OP = "store_cache"
_DISPATCH = Dispatcher(OP)
_MISSING_SCALE = -1.0  # tells the C++ binding "no scale given" (see store_cache_args.h)


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
        k_scale, v_scale: required for fp8: a finite float > 0, or a 1-element float32 tensor on
            the cache's device (read on the device, so CUDA graphs replay with new values).
        loc_map: optional ``[num_full_slots]`` int32/int64; ``slot = loc_map[slot]`` first (full ->
            sliding-window pool), fused in the kernel; a mapped value < 0 is skipped.
        skip_slot: an extra padding slot, compared before ``loc_map``; None for none.
        backend: "jit", "triton", "torch" or None (auto; also ``JITKV_BACKEND``).

    Raises:
        TypeError: wrong dtype or non-tensor argument. ValueError: shape/device/layout mismatch,
        unknown kv_cache_dtype, fp8 string vs cache dtype mismatch, missing or non-positive scale.
        IndexError: slot (or loc_map entry) out of range — CPU always, CUDA under JITKV_DEBUG=1 (CUDA
        otherwise skips the row); nothing is written then.

    Algorithm: CPU — one serial range check, then per-row AVX-512 copies / fp32->fp8 conversion,
    OpenMP above a payload threshold, non-temporal stores for caches far larger than the LLC.
    CUDA — K and V in one launch, one warp per row with 16-byte vectors (rows >= 2 KB split across
    warps), hardware saturating fp8 conversion. Triton (one program per row) as the fallback.
    """
    if torch.compiler.is_compiling():
        ks_t, ks_v = _scale_args(k_scale, "k_scale", kv_cache_dtype)
        vs_t, vs_v = _scale_args(v_scale, "v_scale", kv_cache_dtype)
        return torch.ops.jitkv.store_cache(
            k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype, ks_t, ks_v, vs_t, vs_v, loc_map, skip_slot, backend
        )
    device = device_of(OP, "k_cache", k_cache)
    variant = _cuda_variant(k, k_cache, v, v_cache, kv_cache_dtype) if device.type == "cuda" else ()
    _DISPATCH.get(device, backend, variant)(
        k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, loc_map, skip_slot
    )


def _scale_args(scale, name, kv_cache_dtype):
    """(tensor or None, float value) as the bindings take a scale; -1.0 means "not given"."""
    if isinstance(scale, torch.Tensor):
        return scale, _MISSING_SCALE
    if scale is None or kv_cache_dtype == "auto":
        return None, _MISSING_SCALE
    return None, _validate.scale_value(OP, name, scale)


def _cuda_variant(k, k_cache, v, v_cache, kv_cache_dtype) -> tuple:
    """CUDA kernels are templated on the row bytes of K and V and on the source/cache dtypes."""
    try:
        return (k.dtype, k_cache.dtype, kv_cache_dtype, k.shape[-1], v.shape[-1])
    except AttributeError:
        raise TypeError(f"{OP}: k, v, k_cache, v_cache: expected torch.Tensor arguments") from None


# Argument names of the C++ binding, by position (for tvm-ffi's positional type errors).
_BINDING_ARGS = ("k", "v", "k_cache", "v_cache", "slot_mapping", "loc_map", "skip_slot", "kv_cache_dtype",
                 "k_scale", "v_scale", "k_scale", "v_scale")


def cpu_spec() -> JitSpec:
    return JitSpec("store_cache_cpu", ("store_cache/store_cache_cpu.cpp",), exports=(OP,))


@_DISPATCH.register("jit")
def _jit(device, variant):
    if device.type != "cpu":
        raise BackendUnavailable("no CUDA store_cache kernel yet")
    fn, info = jit_function(cpu_spec(), OP)

    def run(k, v, k_cache, v_cache, slot_mapping, kv_dtype, k_scale, v_scale, loc_map, skip):
        ks_t, ks_v = _scale_args(k_scale, "k_scale", kv_dtype)
        vs_t, vs_v = _scale_args(v_scale, "v_scale", kv_dtype)
        try:
            fn(k, v, k_cache, v_cache, slot_mapping, loc_map, -1 if skip is None else skip, kv_dtype, ks_t, vs_t, ks_v, vs_v)
        except TypeError as e:
            raise name_ffi_type_error(OP, e, _BINDING_ARGS) from None

    return run, info


@_DISPATCH.register("triton")
def _triton(device, variant):
    require_triton(device)
    from ..triton.store_cache import store_cache_triton  # noqa: PLC0415

    def run(k, v, k_cache, v_cache, slot_mapping, kv_dtype, k_scale, v_scale, loc_map, skip):
        kv, vv, kc, vc, (ks, vs) = _validate.store_cache(k, v, k_cache, v_cache, slot_mapping, kv_dtype, k_scale, v_scale, loc_map)
        if debug_checks():
            reference.valid_rows(slot_mapping, kc.shape[0] * kc.shape[1], skip_slot=skip, loc_map=loc_map, strict=True)
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
    def run(k, v, k_cache, v_cache, slot_mapping, kv_dtype, k_scale, v_scale, loc_map, skip):
        kv, vv, kc, vc, (ks, vs) = _validate.store_cache(k, v, k_cache, v_cache, slot_mapping, kv_dtype, k_scale, v_scale, loc_map)
        reference.store_cache(kv, vv, kc, vc, slot_mapping, kv_cache_dtype=kv_dtype, k_scale=ks, v_scale=vs,
                              loc_map=loc_map, skip_slot=skip)

    return run, {}


def jit_specs(target: str) -> list[JitSpec]:
    return [cpu_spec()] if target == "cpu" else []


def reset() -> None:
    _DISPATCH.reset()
