"""DeepSeek-V3.2 sparse-attention indexer K cache (docs/design.md §5.1): the layout descriptor, the
quantize-and-insert writer and the gather back to contiguous values and scales."""

from __future__ import annotations

import torch

from .. import layouts, reference
from ..jit import JitSpec
from ..layouts import (
    INDEXER_HEAD_DIM,
    INDEXER_QUANT_BLOCK,
    INDEXER_SCALE_BYTES,
    INDEXER_TOKEN_BYTES,
)
from . import _validate
from ._common import cuda_target, debug_checks, device_index, jit_function, name_ffi_error, require_triton
from ._dispatch import BackendUnavailable, Dispatcher

WRITE_OP = "indexer_k_quant_and_cache"
GATHER_OP = "gather_indexer_k_quant_cache"
_WRITE = Dispatcher(WRITE_OP)
_GATHER = Dispatcher(GATHER_OP)
SCALE_FMTS = {None: 0, "ue8m0": 1}  # scale_fmt -> the bindings' code


class IndexerKCacheLayout(layouts.PagedRecordLayout):
    """The 132-byte-per-token DeepSeek-V3.2 indexer K cache and its paged block layout (vLLM's
    ``indexer_k_quant_and_cache`` cache, sglang's NSA ``index_k_with_scale_buffer``).

    Per token: the 128-dim key as e4m3 (128 B) and one fp32 scale (4 B; one quant block of 128 values).
    A block of ``block_size`` tokens holds all values first (token t at byte ``t * 128``), then all
    scales (token t at ``block_size * 128 + t * 4``)::

        block b: | t0: 128 B e4m3 | t1 | ... | t(bs-1) | s0: fp32 | s1 | ... | s(bs-1) | padding |
                 0                                     bs*128                bs*132      stride(0)

    A cache is uint8 ``[num_blocks, W]`` with ``block_size * 132 <= W < (block_size + 1) * 132`` (so W
    gives the block size), or vLLM's ``[num_blocks, block_size, 132]`` view of the same bytes (only the
    block's first bytes are "token rows" there: the view's row t is not token t's record). The block
    stride is ``stride(0)``: a multiple of 4 from ``block_size * 132`` up; ``allocate`` rounds
    ``block_size * 132`` up to 16 (8448 at block_size 64, as vLLM and sglang allocate), the alignment
    the CUDA kernels need (other views run the Triton kernels)."""

    head_dim = INDEXER_HEAD_DIM
    quant_block_size = INDEXER_QUANT_BLOCK
    data_bytes = INDEXER_HEAD_DIM
    scale_bytes = INDEXER_SCALE_BYTES
    token_bytes = INDEXER_TOKEN_BYTES
    name = "INDEXER_K_CACHE"
    cache_arg = "kv_cache"
    data_offset = 0
    alignment = INDEXER_SCALE_BYTES  # bytes: base pointer and block stride (fp32 scales)

    def scale_offset(self, block_size: int) -> int:
        """Bytes from a block's start to its scales."""
        return block_size * self.data_bytes

    def values(self, kv_cache, block_size: int) -> torch.Tensor:
        """The float8_e4m3fn ``[num_blocks, block_size, 128]`` view of a cache's values."""
        nb, stride = kv_cache.shape[0], kv_cache.stride(0)
        return kv_cache.as_strided((nb, block_size, self.head_dim), (stride, self.head_dim, 1)).view(torch.float8_e4m3fn)

    def scales(self, kv_cache, block_size: int) -> torch.Tensor:
        """The float32 ``[num_blocks, block_size]`` view of a cache's scales."""
        nb, stride = kv_cache.shape[0], kv_cache.stride(0)
        rows = kv_cache.as_strided((nb, block_size, self.scale_bytes), (stride, self.scale_bytes, 1),
                                   kv_cache.storage_offset() + self.scale_offset(block_size))
        return rows.view(torch.float32).squeeze(-1)


INDEXER_K_CACHE = IndexerKCacheLayout()


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, *, block_size, scale_fmt=None, backend=None):
    """Quantize 128-dim indexer keys into the indexer K cache: token ``slot_mapping[i]`` gets ``k[i]``.

    vLLM: ``ops.indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size=128, scale_fmt)``
    (the quant block is the whole key, fixed by the layout; its block size is ``kv_cache.shape[1]``).

    Args:
        k: ``[n', 128]`` bf16 or fp16, n' >= n = slot_mapping.numel() (extra rows never read); last dim
            contiguous, any row stride.
        kv_cache: uint8 cache of ``INDEXER_K_CACHE`` layout for ``block_size``: ``[num_blocks, W]`` with
            ``block_size * 132 <= W < (block_size + 1) * 132`` or vLLM's ``[num_blocks, block_size, 132]``;
            block stride ``stride(0)`` a multiple of 4 and >= ``block_size * 132``. Written in place.
        slot_mapping: ``[n]`` int32/int64; slot s is block ``s // block_size``, row ``s % block_size``;
            slot < 0 is skipped; slot >= num_blocks * block_size is never written (CPU raises IndexError
            first; CUDA skips it, or raises on the host under JITKV_DEBUG=1).
        block_size: tokens per block.
        scale_fmt: None (scale = amax / 448) or "ue8m0" (rounded up to a power of two).

    Per token: amax = max |x| over the 128 values, NaN values ignored (as vLLM); scale = max(amax, 1e-4)
    / 448, a true fp32 division; "ue8m0": the smallest power of two >= that scale, exactly (vLLM computes
    ``exp2f(ceilf(log2f(s)))``, whose rounding can give the power of two below a scale a few ulps above
    one). Stored: e4m3(clamp(x / scale, ±448)) rounded to nearest even (NaN: 0x7F on CUDA, its sign kept
    on CPU, as torch), and the scale's 4 bytes.

    Raises TypeError/ValueError for bad arguments (ValueError when ``block_size`` does not match
    ``kv_cache``'s layout, or for an unknown ``scale_fmt``), IndexError as above.

    Algorithm: CUDA — half a warp per token (16 lanes x 16-byte loads), the slot and the row loaded
    together after the PDL wait, a 4-shuffle amax, hardware saturating e4m3 conversion, one 128-byte
    line and a 4-byte scale per token; CPU — slots resolved first, then AVX-512 conversion per token,
    OpenMP above a payload threshold; Triton fallback (integer-exact conversion); torch reference.
    """
    if torch.compiler.is_compiling():
        return torch.ops.jitkv.indexer_k_quant_and_cache(k, kv_cache, slot_mapping, block_size, scale_fmt, backend)
    _call(_WRITE, device_index(WRITE_OP, "kv_cache", kv_cache), backend,
          (k, kv_cache, slot_mapping, block_size, _scale_fmt_code(scale_fmt)), _VECTOR_VIEWS["write"], _check_write)


def gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, *, block_size, backend=None):
    """Gather requests' tokens from the indexer K cache into contiguous values and scales (vLLM's
    ``cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)``).

    Row t of ``dst_k`` / ``dst_scale`` belongs to the request b with ``cu_seq_lens[b] <= t <
    cu_seq_lens[b + 1]``; it receives the bytes of that request's token ``i = t - cu_seq_lens[b]``, in
    block ``block_table[b, i // block_size]``, row ``i % block_size``. A block-table entry < 0 or >=
    num_blocks, or a token past the table's width, gives zero bytes; rows no request covers (before
    ``cu_seq_lens[0]``, at or past ``cu_seq_lens[-1]``: dst may be an allocation upper bound) are not
    written. ``cu_seq_lens`` must be non-decreasing (rows are unspecified otherwise).

    Args:
        kv_cache: uint8 cache of ``INDEXER_K_CACHE`` layout for ``block_size``.
        dst_k: ``[T, 128]`` uint8 or float8_e4m3fn, last dim contiguous; the e4m3 values.
        dst_scale: ``[T]`` or ``[T, 1]`` float32, or vLLM's ``[T, 4]`` uint8; the fp32 scale's bytes.
        block_table: ``[batch, max_blocks]`` int32, last dim contiguous.
        cu_seq_lens: ``[batch + 1]`` int32.
        block_size: tokens per block.

    Raises TypeError/ValueError for bad arguments. No host sync: graph-safe.

    Algorithm: CUDA — 8 lanes per token (16-byte loads and stores), each lane finds its request by a
    binary search over cu_seq_lens; CPU — the same per row, memcpy; Triton fallback; torch reference.
    """
    if torch.compiler.is_compiling():
        return torch.ops.jitkv.gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens,
                                                            block_size, backend)
    _call(_GATHER, device_index(GATHER_OP, "kv_cache", kv_cache), backend,
          (kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, block_size), _VECTOR_VIEWS["gather"], _check_gather)


def _scale_fmt_code(scale_fmt) -> int:
    try:
        return SCALE_FMTS[scale_fmt]
    except (KeyError, TypeError):
        raise ValueError(f"{WRITE_OP}: scale_fmt: expected None or 'ue8m0', got {scale_fmt!r}") from None


def _aligned(t, bytes_: int) -> bool:
    """Base and row stride (of more than one row) multiples of ``bytes_``. A non-tensor or a tensor whose
    last dim is not contiguous counts as aligned: it is bad input, which the binding names."""
    if not isinstance(t, torch.Tensor) or (t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1):
        return True
    return t.data_ptr() % bytes_ == 0 and (t.dim() == 0 or t.shape[0] <= 1 or t.stride(0) * t.element_size() % bytes_ == 0)


# The views the CUDA kernels' vectors need, per op: (argument position, name, bytes).
_VECTOR_VIEWS = {
    "write": ((1, "kv_cache", 16), (0, "k", 16)),
    "gather": ((0, "kv_cache", 16), (1, "dst_k", 16), (2, "dst_scale", 4)),
}


def _call(dispatcher, index, backend, args, views, check):
    """Run the op on a device index. On CUDA the variant is the first view the CUDA kernels cannot take
    (16-byte vectors; 4-byte scales), decided here from the arguments: such a view runs on Triton, then
    torch, recorded in backend_info and warned about once. Arguments with such a view are checked
    first (``check``), so bad input raises its own error whatever backend would take it."""
    if index < 0:
        dispatcher.get_cpu(backend)(*args)
        return
    bad = next((f"{name}: the CUDA kernels need a {n}-byte aligned base and row stride"
                for at, name, n in views if not _aligned(args[at], n)), None)
    if bad is not None:
        check(*args)
    dispatcher.get_cuda(index, backend, () if bad is None else (bad,))(*args)


# ------------------------------------------------------------------------------------ validation


def _check_write(k, kv_cache, slot_mapping, block_size, scale_fmt):
    op = WRITE_OP
    INDEXER_K_CACHE.validate(kv_cache, block_size, op)
    dev = kv_cache.device
    _validate.index(op, "slot_mapping", slot_mapping, dev, "kv_cache")
    _validate.tensor(op, "k", k)
    _validate.same_device(op, "k", k, dev, "kv_cache")
    if k.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{op}: k: expected dtype bfloat16 or float16, got {k.dtype}")
    if k.dim() != 2 or k.shape[1] != INDEXER_HEAD_DIM:
        raise ValueError(f"{op}: k: expected shape [n', {INDEXER_HEAD_DIM}], got {list(k.shape)}")
    _validate.last_dim_contiguous(op, "k", k)
    _validate.rows_at_least(op, "k", k, slot_mapping.numel(), "slot_mapping")


def _int32(op, name, t, dev, rank, shape):
    _validate.tensor(op, name, t)
    _validate.same_device(op, name, t, dev, "kv_cache")
    if t.dtype != torch.int32:
        raise TypeError(f"{op}: {name}: expected dtype int32, got {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"{op}: {name}: expected shape {shape}, got {list(t.shape)}")
    _validate.last_dim_contiguous(op, name, t)


def _check_gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, block_size):
    op = GATHER_OP
    INDEXER_K_CACHE.validate(kv_cache, block_size, op)
    dev = kv_cache.device
    _validate.tensor(op, "dst_k", dst_k)
    _validate.same_device(op, "dst_k", dst_k, dev, "kv_cache")
    if dst_k.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise TypeError(f"{op}: dst_k: expected dtype uint8 or float8_e4m3fn, got {dst_k.dtype}")
    if dst_k.dim() != 2 or dst_k.shape[1] != INDEXER_HEAD_DIM:
        raise ValueError(f"{op}: dst_k: expected shape [num_tokens, {INDEXER_HEAD_DIM}], got {list(dst_k.shape)}")
    _validate.last_dim_contiguous(op, "dst_k", dst_k)
    _check_dst_scale(op, dst_scale, dev, dst_k.shape[0])
    _int32(op, "block_table", block_table, dev, 2, "[batch, max_blocks]")
    _int32(op, "cu_seq_lens", cu_seq_lens, dev, 1, "[batch + 1]")
    if cu_seq_lens.shape[0] != block_table.shape[0] + 1:
        raise ValueError(f"{op}: cu_seq_lens: expected {block_table.shape[0] + 1} entries (block_table.shape[0] + 1), "
                         f"got {cu_seq_lens.shape[0]}")


def _check_dst_scale(op, s, dev, num_tokens):
    _validate.tensor(op, "dst_scale", s)
    _validate.same_device(op, "dst_scale", s, dev, "kv_cache")
    if s.dtype not in (torch.float32, torch.uint8):
        raise TypeError(f"{op}: dst_scale: expected dtype float32 or uint8, got {s.dtype}")
    if s.dtype == torch.float32:
        ok = s.dim() in (1, 2) and s.shape[0] == num_tokens and (s.dim() == 1 or s.shape[1] == 1)
    else:
        ok = s.dim() == 2 and s.shape[0] == num_tokens and s.shape[1] == INDEXER_SCALE_BYTES
    if not ok:
        raise ValueError(f"{op}: dst_scale: expected shape [T] or [T, 1] (float32) or [T, {INDEXER_SCALE_BYTES}] "
                         f"(uint8) with T = dst_k.shape[0] = {num_tokens}, got {list(s.shape)}")
    _validate.last_dim_contiguous(op, "dst_scale", s)


def _host_range_check(k, kv_cache, slot_mapping, block_size, scale_fmt):
    """JITKV_DEBUG=1: raise IndexError for a slot past the cache (GPU kernels would skip it)."""
    reference.check_slots(slot_mapping, kv_cache.shape[0] * block_size, op=WRITE_OP)


# -------------------------------------------------------------------------------------- backends

def cpu_spec() -> JitSpec:
    return JitSpec("indexer_cpu", ("indexer/indexer_k_cache_cpu.cpp",), exports=(WRITE_OP, GATHER_OP))


def cuda_spec(arch: str) -> JitSpec:
    return JitSpec("indexer_cuda", ("indexer/indexer_k_cache_cuda.cu",), target=arch, exports=(WRITE_OP, GATHER_OP))


_WRITE_ARGS = ("k", "kv_cache", "slot_mapping", "block_size", "scale_fmt")
_GATHER_ARGS = ("kv_cache", "dst_k", "dst_scale", "block_table", "cu_seq_lens", "block_size")


def _jit_factory(op, arg_names):
    """The bindings check every argument (csrc/indexer/indexer_k_cache.cuh); a CUDA variant other than
    the default is a view the vector kernels cannot take, named by its reason (see ``_call``)."""

    def factory(device, variant):
        if variant:
            raise BackendUnavailable(variant[0])
        spec = cpu_spec() if device.type == "cpu" else cuda_spec(cuda_target(device))
        fn, info = jit_function(spec, op)
        debug = device.type == "cuda" and op == WRITE_OP and debug_checks()

        def run(*args):
            if debug:
                _check_write(*args)
                _host_range_check(*args)
            try:
                fn(*args)
            except (TypeError, RuntimeError) as e:
                raise name_ffi_error(op, e, arg_names, args) from None

        return run, info

    return factory


_WRITE.register("jit")(_jit_factory(WRITE_OP, _WRITE_ARGS))
_GATHER.register("jit")(_jit_factory(GATHER_OP, _GATHER_ARGS))


@_WRITE.register("triton")
def _write_triton(device, variant):
    require_triton(device)
    from ..triton.indexer import indexer_k_quant_and_cache_triton  # noqa: PLC0415

    debug = debug_checks()

    def run(k, kv_cache, slot_mapping, block_size, scale_fmt):
        _check_write(k, kv_cache, slot_mapping, block_size, scale_fmt)
        if debug:
            _host_range_check(k, kv_cache, slot_mapping, block_size, scale_fmt)
        with torch.cuda.device(device):
            indexer_k_quant_and_cache_triton(k, kv_cache, slot_mapping, block_size, scale_fmt == SCALE_FMTS["ue8m0"])

    return run, {}


@_GATHER.register("triton")
def _gather_triton(device, variant):
    require_triton(device)
    from ..triton.indexer import gather_indexer_k_quant_cache_triton  # noqa: PLC0415

    def run(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, block_size):
        _check_gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, block_size)
        with torch.cuda.device(device):
            gather_indexer_k_quant_cache_triton(kv_cache, dst_k.view(torch.uint8), reference.indexer_scale_bytes(dst_scale),
                                                block_table, cu_seq_lens, block_size)

    return run, {}


@_WRITE.register("torch")
def _write_torch(device, variant):
    def run(k, kv_cache, slot_mapping, block_size, scale_fmt):
        _check_write(k, kv_cache, slot_mapping, block_size, scale_fmt)
        reference.indexer_k_quant_and_cache(k, kv_cache, slot_mapping, block_size=block_size,
                                            scale_fmt="ue8m0" if scale_fmt == SCALE_FMTS["ue8m0"] else None)

    return run, {}


@_GATHER.register("torch")
def _gather_torch(device, variant):
    def run(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, block_size):
        _check_gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, block_size)
        reference.gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, block_size=block_size)

    return run, {}


def jit_specs(target: str) -> list[JitSpec]:
    return [cpu_spec()] if target == "cpu" else [cuda_spec(target)]


def reset() -> None:
    _WRITE.reset()
    _GATHER.reset()
