"""gather_mla_cache: the paged MLA cache's tokens of each request into contiguous rows, copied or
dequantized (vLLM's cp_gather_cache / gather_and_maybe_dequant_cache; docs/design.md §2)."""

from __future__ import annotations

import torch
from torch.compiler import is_compiling

from .. import reference
from ..jit import JitSpec
from ..layouts import DS_MLA_CODE, DS_MLA_NOPE, DS_MLA_ROPE, FP8_CODES, FP8_DTYPES
from . import _validate
from ._common import cuda_target, debug_checks, device_index, jit_function, name_ffi_error, require_triton
from ._dispatch import BackendUnavailable, Dispatcher

OP = "gather_mla_cache"
_DISPATCH = Dispatcher(OP)
_MISSING_SCALE = -1.0  # tells the C++ binding "no scale given" (see gather_mla_cache.cuh)
# kv_cache_dtype -> the kernels' format code (layouts.py).
FORMATS = {"auto": FP8_CODES[None], **{k: FP8_CODES[v] for k, v in FP8_DTYPES.items()}, "fp8_ds_mla": DS_MLA_CODE}


def gather_mla_cache(out, kv_cache, block_table, cu_seq_lens, *, seq_starts=None, kv_cache_dtype="auto", scale=None,
                     backend=None):
    """Gather each request's tokens from a paged MLA cache into contiguous rows of ``out``.

    Output row ``t`` belongs to request ``r`` when ``cu_seq_lens[r] <= t < cu_seq_lens[r + 1]``; it is
    token ``i = t - cu_seq_lens[r]`` of the request, at position ``p = seq_starts[r] + i`` (``p = i``
    without seq_starts) of its block table: block ``block_table[r, p // block_size]``, row
    ``p % block_size``::

        kv_cache [num_blocks, block_size, W]      out [total_tokens, D]
        block_table[r] = [7, 2, ...]              rows cu_seq_lens[r] ... cu_seq_lens[r + 1] - 1:
        seq_starts[r] = s                         kv_cache[7, s], kv_cache[7, s + 1], ...

    A position < 0 or past the table's width, or a block entry < 0 or >= num_blocks, gives a zero
    row (nothing outside the cache is read). Rows no request covers are not written.

    ``out.shape[0]`` is the total: the kernels never read ``cu_seq_lens[-1]`` on the host (graph-safe),
    so rows of a request past ``out`` are clipped (never written). On CPU, and on CUDA under
    ``JITKV_DEBUG=1`` (a host sync, refused during graph capture), cu_seq_lens is checked first:
    ValueError where it decreases, IndexError where a request starts below row 0 or ends past
    ``out``; on CUDA otherwise a decreasing cu_seq_lens is the caller's error (rows it maps to several
    requests get one of them).

    Args:
        out: ``[total_tokens, D]``, written in place; any row stride, last dim contiguous.
        kv_cache: ``[num_blocks, block_size, W]``, any block and token strides (a padded cache is
            passed as a view), last dim contiguous. sglang's flat ``[num_slots, 1, W]`` buffer is a
            cache of block size 1.
        block_table: ``[>= num_reqs, max_blocks]`` int32/int64 (extra rows never read).
        cu_seq_lens: ``[num_reqs + 1]`` int32/int64, non-decreasing output row offsets.
        seq_starts: ``[>= num_reqs]`` int32/int64 token offset of each request in its block table
            (chunked prefill over a cached prefix), or None.
        kv_cache_dtype:
            - "auto": a bitwise copy, ``out.dtype == kv_cache.dtype`` (bf16, fp16, fp32, uint8,
              float8), ``D == W``.
            - "fp8"/"fp8_e4m3", "fp8_e5m2": a float8 (or uint8) cache with a per-tensor ``scale``;
              ``out = bf16(float32(x) * scale)`` (bf16 out, ``D == W``).
            - "fp8_ds_mla": vLLM's 656-byte DeepSeek record (uint8, ``W == 656``; ``layouts.DS_MLA_*``)
              ``[512 e4m3 in 4 tiles of 128 | 4 fp32 tile scales | 64 bf16 rope]``; ``out`` bf16
              ``[total_tokens, 576]``: ``bf16(float32(e4m3) * tile scale)``, then the rope copied.
            bf16 rounds to nearest even; a NaN is written as 0x7FFF.
        scale: the per-tensor fp8 formats' scale: a finite float > 0, or a 1-element float32
            tensor on out's device (read on the device: graphs replay with new values; its value
            is checked on CPU, and on CUDA only under JITKV_DEBUG=1). Ignored by the other formats.
        backend: "jit", "triton", "torch" or None (auto; also ``JITKV_BACKEND``).

    vLLM: ``cp_gather_cache(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts)`` is
    ``gather_mla_cache(dst, src_cache, block_table, cu_seq_lens[:batch_size + 1], seq_starts=seq_starts)``;
    ``gather_and_maybe_dequant_cache(src_cache, dst, block_table, cu_seq_lens, token_to_seq,
    num_tokens, kv_cache_dtype, scale, seq_starts)`` is ``gather_mla_cache(dst[:num_tokens],
    src_cache, block_table, cu_seq_lens, seq_starts=seq_starts, kv_cache_dtype=kv_cache_dtype,
    scale=scale)`` (no token_to_seq: each row finds its request); ``cp_gather_and_upconvert_fp8_kv_cache``
    with ``workspace_starts`` the prefix sums of ``seq_lens`` is ``kv_cache_dtype="fp8_ds_mla"`` with
    ``cu_seq_lens = [*workspace_starts, total]``.

    Raises:
        TypeError: a wrong dtype or a non-tensor argument. ValueError: shape, device, layout or
        format mismatch, an unknown kv_cache_dtype, a missing or invalid scale, a decreasing
        cu_seq_lens (CPU; CUDA under JITKV_DEBUG=1). IndexError: requests outside out's rows (CPU;
        CUDA under JITKV_DEBUG=1). Nothing is written when anything is raised.

    Algorithm: CUDA — one warp per 2 output rows (4 warps per CTA, the grid from out.shape[0]):
    lanes 0-1 find their row's request (binary search over cu_seq_lens), position and block-table
    entry; then the warp issues all 16-byte (fp8: 8-byte) loads of both entries before converting
    (fp8 in registers: e4m3 through the hardware f16 conversion on sm_89+, e5m2 as the high byte of
    an fp16; times the scale; bf16 round) and storing 16-byte vectors. CPU — the same rule per row,
    AVX-512 copies, fp8 through a 256-entry float table, OpenMP above a payload threshold. Triton
    (16 rows per program, integer-exact fp8 decode) as the fallback.
    """
    if is_compiling():
        scale_t, scale_v = _scale_args(scale, kv_cache_dtype)
        return torch.ops.jitkv.gather_mla_cache(out, kv_cache, block_table, cu_seq_lens, seq_starts, kv_cache_dtype,
                                                scale_t, scale_v, backend)
    index = device_index(OP, "out", out)
    if index < 0:
        impl = _DISPATCH.get_cpu(backend)
    else:
        impl = _DISPATCH.get_cuda(index, backend, _cuda_variant(out, kv_cache, kv_cache_dtype))
    impl(out, kv_cache, block_table, cu_seq_lens, seq_starts, kv_cache_dtype, scale)


def _format(kv_cache_dtype) -> int:
    code = FORMATS.get(kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None
    if code is None:
        raise ValueError(f"{OP}: kv_cache_dtype: expected one of {', '.join(_validate.GATHER_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    return code


def _scale_args(scale, kv_cache_dtype):
    """(tensor or None, float value) as the bindings take a scale; -1.0 means "not given"."""
    if isinstance(scale, torch.Tensor):
        return scale, _MISSING_SCALE
    if scale is None or kv_cache_dtype not in FP8_DTYPES:
        return None, _MISSING_SCALE
    return None, _validate.scale_value(OP, "scale", scale)


# An output row the module serves when the arguments' own shapes say nothing (the binding then raises
# the precise error before anything runs).
_ANY_ROW_BYTES = 2 * (DS_MLA_NOPE + DS_MLA_ROPE)


def _cuda_variant(out, kv_cache, kv_cache_dtype) -> tuple:
    """(format code, output row bytes, aligned): the CUDA module's build arguments, and whether the
    views suit its vectors (16-byte output rows and stores; cache loads of 16 bytes, per-tensor fp8: 8).
    An unaligned view falls back like any unavailable backend (Triton, then torch; warned once).
    Arguments the binding refuses anyway (ranks, strides, non-tensors) go to it for its precise error."""
    code = _format(kv_cache_dtype)
    try:
        if (out.dim() != 2 or kv_cache.dim() != 3 or (out.stride(1) != 1 and out.shape[1] > 1)
                or (kv_cache.stride(2) != 1 and kv_cache.shape[2] > 1)):
            return (code, _ANY_ROW_BYTES, True)
        oes, ces = out.element_size(), kv_cache.element_size()
        row = out.shape[1] * oes
        cache_align = 8 if code in (FP8_CODES[torch.float8_e4m3fn], FP8_CODES[torch.float8_e5m2]) else 16
    except (AttributeError, TypeError):
        return (code, _ANY_ROW_BYTES, True)
    aligned = (row > 0 and row % 16 == 0 and out.data_ptr() % 16 == 0 and out.stride(0) * oes % 16 == 0
               and kv_cache.data_ptr() % cache_align == 0 and kv_cache.stride(0) * ces % cache_align == 0
               and kv_cache.stride(1) * ces % cache_align == 0)
    return (code, row, True) if aligned else (code, _ANY_ROW_BYTES, False)


def cpu_spec() -> JitSpec:
    return JitSpec("mla_gather_cpu", ("mla_gather/gather_mla_cache_cpu.cpp",), exports=(OP,))


def cuda_spec(arch: str, format_code: int, out_row_bytes: int) -> JitSpec:
    """The CUDA module for one kv_cache_dtype code (FORMATS) and output rows of ``out_row_bytes``."""
    return JitSpec(
        "mla_gather_cuda",
        ("mla_gather/gather_mla_cache_cuda.cu",),
        args=(("format", format_code), ("out_bytes", out_row_bytes)),
        target=arch,
        exports=(OP,),
    )


# Prebuilt CUDA variants: 576-dim rows (DeepSeek MLA 512 + 64) of bf16/fp16 copies, e4m3, e5m2, fp8_ds_mla.
CUDA_PREBUILD_VARIANTS = ((0, 1152), (1, 1152), (2, 1152), (DS_MLA_CODE, 1152))

# Argument names of the C++ binding, by position (for tvm-ffi's positional type errors).
_BINDING_ARGS = ("out", "kv_cache", "block_table", "cu_seq_lens", "seq_starts", "kv_cache_dtype", "scale", "scale")


@_DISPATCH.register("jit")
def _jit(device, variant):
    if device.type == "cpu":
        spec = cpu_spec()
    else:
        code, row, aligned = variant
        if not aligned:
            raise BackendUnavailable("the CUDA kernel needs 16-byte aligned output rows and 16-byte (per-tensor "
                                     "fp8: 8-byte) aligned cache entries")
        spec = cuda_spec(cuda_target(device), code, row)
    fn, info = jit_function(spec, OP)
    debug = device.type == "cuda" and debug_checks()

    def run(out, kv_cache, block_table, cu_seq_lens, seq_starts, kv_dtype, scale):
        scale_t, scale_v = _scale_args(scale, kv_dtype)
        args = (out, kv_cache, block_table, cu_seq_lens, seq_starts, _format(kv_dtype), scale_t, scale_v)
        if debug:  # JITKV_DEBUG=1: the Python checks, a CUDA scale tensor's value and cu_seq_lens (host syncs)
            _validate.mla_gather(out, kv_cache, block_table, cu_seq_lens, seq_starts, kv_dtype, scale, debug)
            reference.check_gather_rows(cu_seq_lens, out.shape[0], op=OP)
        try:
            fn(*args)
        except (TypeError, RuntimeError) as e:
            raise name_ffi_error(OP, e, _BINDING_ARGS, args) from None

    return run, info


@_DISPATCH.register("triton")
def _triton(device, variant):
    require_triton(device)
    from ..triton.mla_gather import gather_mla_cache_triton  # noqa: PLC0415

    debug = debug_checks()

    def run(out, kv_cache, block_table, cu_seq_lens, seq_starts, kv_dtype, scale):
        s = _validate.mla_gather(out, kv_cache, block_table, cu_seq_lens, seq_starts, kv_dtype, scale, debug)
        if debug:
            reference.check_gather_rows(cu_seq_lens, out.shape[0], op=OP)
        with torch.cuda.device(device):
            gather_mla_cache_triton(out, kv_cache, block_table, cu_seq_lens, seq_starts, FORMATS[kv_dtype], s)

    return run, {}


@_DISPATCH.register("torch")
def _torch(device, variant):
    debug = debug_checks()

    def run(out, kv_cache, block_table, cu_seq_lens, seq_starts, kv_dtype, scale):
        s = _validate.mla_gather(out, kv_cache, block_table, cu_seq_lens, seq_starts, kv_dtype, scale, debug)
        reference.gather_mla_cache(out, kv_cache, block_table, cu_seq_lens, seq_starts=seq_starts,
                                   kv_cache_dtype=kv_dtype, scale=s)

    return run, {}


def jit_specs(target: str) -> list[JitSpec]:
    """Specs ``prebuild``/``warmup`` build for a target ("cpu" or a CUDA arch)."""
    if target == "cpu":
        return [cpu_spec()]
    return [cuda_spec(target, code, row) for code, row in CUDA_PREBUILD_VARIANTS]


def reset() -> None:
    _DISPATCH.reset()
