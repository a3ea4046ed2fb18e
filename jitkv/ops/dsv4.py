"""DeepSeek-V4 FP8 K cache (docs/design.md §5): the layout descriptor, the quantize-and-insert writer and
the dequantize-and-gather reader."""

from __future__ import annotations

import torch

from .. import layouts, reference
from ..jit import JitSpec
from . import _validate
from ._common import cuda_target, debug_checks, device_index, jit_function, name_ffi_error, require_triton
from ._dispatch import BackendUnavailable, Dispatcher

WRITE_OP = "quantize_and_insert_k_cache"
GATHER_OP = "dequantize_and_gather_k_cache"
# No CPU kernel: on CPU the torch reference is the implementation, not a fallback.
_WRITE = Dispatcher(WRITE_OP, order={"cpu": ("torch",)})
_GATHER = Dispatcher(GATHER_OP, order={"cpu": ("torch",)})


class DSv4KCacheLayout(layouts.PagedRecordLayout):
    """The 584-byte-per-token DeepSeek-V4 FP8 K cache record and its paged block layout.

    Per token: dims 0..447 as e4m3 (448 B) + dims 448..511 as bf16 (128 B) = 576 B of data, and 8 B
    of UE8M0 scales (one per 64 nope dims, 8th byte 0). A block holds all token data first (token t
    at ``t * 576``), then all scales (token t at ``block_size * 576 + t * 8``): ``block_size * 584``
    bytes, then any padding up to the block stride. A cache is uint8 ``[num_blocks, W]`` with
    ``block_size * 584 <= W < (block_size + 1) * 584`` (so W gives the block size; jitkv and vLLM
    allocate W = ``block_stride(block_size)`` = ``block_size * 584`` for even block sizes), or a
    ``[num_blocks, block_size, 584]`` view of one. The block stride is ``stride(0)``: any multiple of
    16 bytes (the kernels' vector alignment) from ``block_size * 584`` up; kernels use ``stride(0)``
    and ``scale_offset(block_size)`` and touch only the first ``block_size * 584`` bytes of a block."""

    head_dim = layouts.DSV4_HEAD_DIM
    nope_dim = layouts.DSV4_NOPE
    rope_dim = layouts.DSV4_ROPE
    group_size = layouts.DSV4_GROUP
    data_bytes = layouts.DSV4_DATA_BYTES
    scale_bytes = layouts.DSV4_SCALE_BYTES
    token_bytes = layouts.DSV4_TOKEN_BYTES
    name = "DSV4_K_CACHE"
    cache_arg = "k_cache"
    data_offset = 0
    alignment = 16  # bytes: base pointer and block stride

    def scale_offset(self, block_size: int) -> int:
        """Bytes from a block's start to its scale region."""
        return block_size * self.data_bytes

    def block_stride(self, block_size: int) -> int:
        """The block stride ``allocate`` uses by default, the smallest a cache may have: block_size * 584
        rounded up to 16 bytes (37,376 at block_size 64, as vLLM allocates). A larger stride, e.g. one
        padded to a multiple of 576, measured no faster on an H100 (writer n = 1 ... 65,536 and gather
        1 x 32,768 within 0.05 us)."""
        return super().block_stride(block_size)


DSV4_K_CACHE = DSv4KCacheLayout()


def quantize_and_insert_k_cache(k, k_cache, slot_mapping, *, block_size=64, backend=None):
    """Quantize K rows into the DeepSeek-V4 FP8 K cache: token ``slot_mapping[i]`` gets ``k[i]``.

    Args:
        k: ``[n', 512]`` bf16, n' >= n = slot_mapping.numel() (extra rows never read); last dim
            contiguous, any row stride.
        k_cache: uint8 cache of ``DSV4_K_CACHE`` layout for ``block_size``: ``[num_blocks, W]`` with
            ``block_size * 584 <= W < (block_size + 1) * 584`` (jitkv's padded blocks or vLLM's
            unpadded ones) or a ``[num_blocks, block_size, 584]`` view; block stride ``stride(0)`` a
            multiple of 16 and >= ``block_size * 584``. Written in place.
        slot_mapping: ``[n]`` int32/int64; slot s is block ``s // block_size``, row
            ``s % block_size``; slot < 0 is skipped; slot >= num_blocks * block_size is never
            written (CPU raises IndexError first).
        block_size: tokens per block.

    Per 64 nope dims: UE8M0 scale 2^e with e the smallest integer such that 448 * 2^e >=
    max(amax, 1e-4) (exact, via frexp); dims stored as e4m3(clamp(x / 2^e, ±448)), round to nearest
    even; dims 448..511 copied as bf16; the 8th scale byte written 0.

    Raises TypeError/ValueError for bad arguments (ValueError when ``block_size`` does not match
    ``k_cache``'s layout), IndexError as above.

    Algorithm: CUDA — one warp per token, 16-byte loads, warp-shuffle amax, hardware e4m3
    conversion, 16-byte stores; Triton fallback (integer-exact conversion); torch reference on CPU.
    """
    if torch.compiler.is_compiling():
        return torch.ops.jitkv.quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size, backend)
    _get(_WRITE, device_index(WRITE_OP, "k_cache", k_cache), backend, k)(k, k_cache, slot_mapping, block_size)


def dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset=0, *, backend=None):
    """Gather each request's last tokens from the DeepSeek-V4 FP8 K cache, dequantized to bf16.

    For request r, the last ``gather_lens[r]`` tokens (``gather_lens=None``: all ``seq_lens[r]``):
    position ``p = seq_lens[r] - gather_len + i`` comes from block ``block_table[r, p // block_size]``,
    row ``p % block_size``, and is written to ``out[r, offset + i, :]``. Positions whose block-table
    entry is < 0 (or >= num_blocks, or past the table's width) give zero rows; rows at or past
    ``out.shape[1]`` are not written. The rope dims are bit-exact; nope dims are e4m3 * 2^(scale-127),
    exact in bf16.

    Args:
        out: ``[num_reqs, max_tokens, 512]`` bf16, last dim contiguous.
        k_cache: uint8 cache of ``DSV4_K_CACHE`` layout for ``block_size`` (as for
            ``quantize_and_insert_k_cache``).
        seq_lens, gather_lens: ``[num_reqs]`` int32 (gather_lens may be None).
        block_table: ``[num_reqs, max_blocks]`` int32.
        block_size: tokens per block. offset: first row of ``out`` written (>= 0).

    Raises TypeError/ValueError for bad arguments (ValueError when ``block_size`` does not match
    ``k_cache``'s layout).

    Algorithm: CUDA — one warp per token, block-table lookup once per token, several 16-byte loads
    in flight, exact power-of-two scaling, 16-byte stores, grid sized from num_reqs * max_tokens;
    Triton fallback; torch reference on CPU.
    """
    if torch.compiler.is_compiling():
        return torch.ops.jitkv.dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table,
                                                            block_size, offset, backend)
    _get(_GATHER, device_index(GATHER_OP, "out", out), backend, out)(out, k_cache, seq_lens, gather_lens,
                                                                       block_table, block_size, offset)


# ------------------------------------------------------------------------------------ validation


def _check_bf16_rows(op, name, t, dev, ndim, shape_desc):
    """A bf16 tensor of ``ndim`` dims whose last dim is 512 and contiguous, on ``dev``."""
    _validate.tensor(op, name, t)
    _validate.same_device(op, name, t, dev, "k_cache")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{op}: {name}: expected dtype bfloat16, got {t.dtype}")
    if t.dim() != ndim or t.shape[-1] != 512:
        raise ValueError(f"{op}: {name}: expected shape {shape_desc}, got {list(t.shape)}")
    _validate.last_dim_contiguous(op, name, t)


def _check_write(k, k_cache, slot_mapping, block_size):
    op = WRITE_OP
    DSV4_K_CACHE.validate(k_cache, block_size, op)
    dev = k_cache.device
    _validate.index(op, "slot_mapping", slot_mapping, dev, "k_cache")
    _check_bf16_rows(op, "k", k, dev, 2, "[n', 512]")
    _validate.rows_at_least(op, "k", k, slot_mapping.numel(), "slot_mapping")


def _check_gather(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset):
    op = GATHER_OP
    DSV4_K_CACHE.validate(k_cache, block_size, op)
    dev = k_cache.device
    _check_bf16_rows(op, "out", out, dev, 3, "[num_reqs, max_tokens, 512]")
    num_reqs = out.shape[0]
    for name, t in (("seq_lens", seq_lens), ("gather_lens", gather_lens)):
        if t is None and name == "gather_lens":
            continue
        _validate.index(op, name, t, dev, "k_cache")
        if t.dtype != torch.int32:
            raise TypeError(f"{op}: {name}: expected dtype int32, got {t.dtype}")
        if t.shape[0] != num_reqs:
            raise ValueError(f"{op}: {name}: expected {num_reqs} entries (out.shape[0]), got {t.shape[0]}")
    _validate.tensor(op, "block_table", block_table)
    _validate.same_device(op, "block_table", block_table, dev, "k_cache")
    if block_table.dtype != torch.int32:
        raise TypeError(f"{op}: block_table: expected dtype int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != num_reqs:
        raise ValueError(f"{op}: block_table: expected shape [{num_reqs}, max_blocks], got {list(block_table.shape)}")
    _validate.last_dim_contiguous(op, "block_table", block_table)
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"{op}: offset: expected an int >= 0, got {offset!r}")


def _host_range_check(k, k_cache, slot_mapping, block_size):
    """JITKV_DEBUG=1: raise IndexError for a slot past the cache (GPU kernels would skip it)."""
    reference.check_slots(slot_mapping, k_cache.shape[0] * block_size, op=WRITE_OP)


def _flat(k_cache):
    """The 2-D [num_blocks, block_stride] uint8 view Triton kernels take."""
    if k_cache.dim() == 2:
        return k_cache
    stride = k_cache.stride(0)
    return k_cache.as_strided((k_cache.shape[0], stride), (stride, 1))


# -------------------------------------------------------------------------------------- backends


def cuda_spec(arch: str) -> JitSpec:
    """The CUDA module of both ops, built for the record of jitkv/codes.py (codes.Dsv4)."""
    return JitSpec("dsv4_cuda", ("dsv4/dsv4_cuda.cu",), target=arch, exports=(WRITE_OP, GATHER_OP))


_WRITE_ARGS = ("k", "k_cache", "slot_mapping", "block_size")
_GATHER_ARGS = ("out", "k_cache", "seq_lens", "gather_lens", "block_table", "block_size", "offset")


def _vector_aligned(t) -> bool:
    """The CUDA kernels move 16-byte vectors: base 16-byte aligned, row strides multiples of 8 bf16."""
    return isinstance(t, torch.Tensor) and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])


def _get(dispatcher, index, backend, bf16_rows):
    """The op for a device index; on CUDA the variant is whether the bf16 rows (k or out) suit the
    CUDA kernels' 16-byte vectors: an unaligned view falls back like any unavailable backend
    (Triton, then torch), recorded in backend_info and warned about once."""
    if index < 0:
        return dispatcher.get_cpu(backend)
    aligned = not isinstance(bf16_rows, torch.Tensor) or _vector_aligned(bf16_rows)  # the binding names a non-tensor
    return dispatcher.get_cuda(index, backend, (aligned,))


def _jit_factory(op, arg_names):
    """The CUDA binding checks every argument but the layout's semantics (the block size a cache
    holds, its block stride), which ``DSV4_K_CACHE.validate`` checks first; it keeps the guards that
    keep the kernels inside the tensors."""
    block_size_at = arg_names.index("block_size")
    rows = arg_names[0]

    def factory(device, variant):
        if device.type == "cuda" and variant != (True,):
            raise BackendUnavailable(f"{rows}: the CUDA kernels need a 16-byte aligned base and row strides that "
                                     "are multiples of 8 elements")
        fn, info = jit_function(cuda_spec(cuda_target(device)), op)
        debug = op == WRITE_OP and debug_checks()

        def run(*args):
            DSV4_K_CACHE.validate(args[1], args[block_size_at], op)
            if debug:
                _host_range_check(*args)
            try:
                fn(*args)
            except (TypeError, RuntimeError) as e:
                raise name_ffi_error(op, e, arg_names, args) from None

        return run, info

    return factory


@_WRITE.register("triton")
def _write_triton(device, variant):
    require_triton(device)
    from ..triton.dsv4 import quantize_and_insert_k_cache_triton  # noqa: PLC0415

    debug = debug_checks()

    def run(k, k_cache, slot_mapping, block_size):
        _check_write(k, k_cache, slot_mapping, block_size)
        if debug:
            _host_range_check(k, k_cache, slot_mapping, block_size)
        with torch.cuda.device(device):
            quantize_and_insert_k_cache_triton(k, _flat(k_cache), slot_mapping, block_size)

    return run, {}


@_GATHER.register("triton")
def _gather_triton(device, variant):
    require_triton(device)
    from ..triton.dsv4 import dequantize_and_gather_k_cache_triton  # noqa: PLC0415

    def run(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset):
        _check_gather(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset)
        with torch.cuda.device(device):
            dequantize_and_gather_k_cache_triton(out, _flat(k_cache), seq_lens, gather_lens, block_table, block_size, offset)

    return run, {}


@_WRITE.register("torch")
def _write_torch(device, variant):
    def run(k, k_cache, slot_mapping, block_size):
        _check_write(k, k_cache, slot_mapping, block_size)
        reference.quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size=block_size)

    return run, {}


@_GATHER.register("torch")
def _gather_torch(device, variant):
    def run(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset):
        _check_gather(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset)
        reference.dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset)

    return run, {}


_WRITE.register("jit")(_jit_factory(WRITE_OP, _WRITE_ARGS))
_GATHER.register("jit")(_jit_factory(GATHER_OP, _GATHER_ARGS))


def jit_specs(target: str) -> list[JitSpec]:
    return [] if target == "cpu" else [cuda_spec(target)]


def reset() -> None:
    _WRITE.reset()
    _GATHER.reset()
