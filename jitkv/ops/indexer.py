"""DeepSeek-V3.2 sparse-attention indexer K cache (docs/design.md §5.1): the layout descriptor, the
quantize-and-insert writer and the gather back to contiguous values and scales."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import checks, layouts, reference
from ..codes import Indexer, ScaleFmt
from ..jit import JitSpec, cuda_arch
from ._op import BackendUnavailable, Op, jit_function
from ._samples import index, rand, slots

__all__ = ["INDEXER_K_CACHE", "gather_indexer_k_quant_cache", "indexer_k_quant_and_cache"]

WRITE_OP = "indexer_k_quant_and_cache"
GATHER_OP = "gather_indexer_k_quant_cache"
SCALE_FMTS = {None: ScaleFmt.FP32, "ue8m0": ScaleFmt.UE8M0}  # scale_fmt -> the bindings' code


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

    head_dim = Indexer.HEAD_DIM
    quant_block_size = Indexer.QUANT_BLOCK
    data_bytes = Indexer.HEAD_DIM
    scale_bytes = Indexer.SCALE_BYTES
    token_bytes = Indexer.TOKEN_BYTES
    name = "INDEXER_K_CACHE"
    cache_arg = "kv_cache"
    data_offset = 0
    alignment = Indexer.SCALE_BYTES  # bytes: base pointer and block stride (fp32 scales)

    def scale_offset(self, block_size: int) -> int:
        """Bytes from a block's start to its scales."""
        return block_size * self.data_bytes

    def values(self, kv_cache, block_size: int) -> torch.Tensor:
        """The float8_e4m3fn ``[num_blocks, block_size, 128]`` view of a cache's values."""
        nb, stride = kv_cache.shape[0], kv_cache.stride(0)
        return kv_cache.as_strided((nb, block_size, self.head_dim), (stride, self.head_dim, 1)).view(
            torch.float8_e4m3fn
        )

    def scales(self, kv_cache, block_size: int) -> torch.Tensor:
        """The float32 ``[num_blocks, block_size]`` view of a cache's scales."""
        nb, stride = kv_cache.shape[0], kv_cache.stride(0)
        rows = kv_cache.as_strided(
            (nb, block_size, self.scale_bytes),
            (stride, self.scale_bytes, 1),
            kv_cache.storage_offset() + self.scale_offset(block_size),
        )
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
    line and a 4-byte scale per token; CPU — slots resolved first, then vector conversion per token,
    OpenMP above a payload threshold; Triton fallback (integer-exact conversion); torch reference.
    """
    INDEXER_K_QUANT_AND_CACHE.run((k, kv_cache, slot_mapping, block_size, scale_fmt), backend)


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
    GATHER_INDEXER_K_QUANT_CACHE.run((kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, block_size), backend)


# ---------------------------------------------------------------------------------------- checks


def _scale_fmt_code(scale_fmt) -> int:
    try:
        return int(SCALE_FMTS[scale_fmt])
    except (KeyError, TypeError):
        raise ValueError(f"{WRITE_OP}: scale_fmt: expected None or 'ue8m0', got {scale_fmt!r}") from None


def check_write(k, kv_cache, slot_mapping, block_size, scale_fmt):
    op = WRITE_OP
    INDEXER_K_CACHE.validate(kv_cache, block_size, op)
    dev = kv_cache.device
    checks.index(op, "slot_mapping", slot_mapping, dev, "kv_cache")
    checks.tensor(op, "k", k)
    checks.same_device(op, "k", k, dev, "kv_cache")
    checks.dtype(op, "k", k, (torch.bfloat16, torch.float16))
    if k.dim() != 2 or k.shape[1] != Indexer.HEAD_DIM:
        raise ValueError(f"{op}: k: expected shape [n', {Indexer.HEAD_DIM}], got {list(k.shape)}")
    checks.last_dim_contiguous(op, "k", k)
    checks.rows_at_least(op, "k", k, slot_mapping.numel(), "slot_mapping")
    _scale_fmt_code(scale_fmt)
    return k, kv_cache, slot_mapping, block_size, scale_fmt


def debug_check_write(k, kv_cache, slot_mapping, block_size, scale_fmt):
    """JITKV_DEBUG=1 on CUDA: every slot's range on the host (the kernels skip an out-of-range one)."""
    reference.check_slots(slot_mapping, kv_cache.shape[0] * block_size, op=WRITE_OP)


def _int32(op, name, t, dev, rank, shape):
    checks.tensor(op, name, t)
    checks.same_device(op, name, t, dev, "kv_cache")
    checks.dtype(op, name, t, (torch.int32,))
    if t.dim() != rank:
        raise ValueError(f"{op}: {name}: expected shape {shape}, got {list(t.shape)}")
    checks.last_dim_contiguous(op, name, t)


def check_gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, block_size):
    op = GATHER_OP
    INDEXER_K_CACHE.validate(kv_cache, block_size, op)
    dev = kv_cache.device
    checks.tensor(op, "dst_k", dst_k)
    checks.same_device(op, "dst_k", dst_k, dev, "kv_cache")
    checks.dtype(op, "dst_k", dst_k, (torch.uint8, torch.float8_e4m3fn))
    if dst_k.dim() != 2 or dst_k.shape[1] != Indexer.HEAD_DIM:
        raise ValueError(f"{op}: dst_k: expected shape [num_tokens, {Indexer.HEAD_DIM}], got {list(dst_k.shape)}")
    checks.last_dim_contiguous(op, "dst_k", dst_k)
    _check_dst_scale(op, dst_scale, dev, dst_k.shape[0])
    for name, t in (("dst_k", dst_k), ("dst_scale", dst_scale)):
        checks.written(op, name, t)
    _int32(op, "block_table", block_table, dev, 2, "[batch, max_blocks]")
    _int32(op, "cu_seq_lens", cu_seq_lens, dev, 1, "[batch + 1]")
    if cu_seq_lens.shape[0] != block_table.shape[0] + 1:
        raise ValueError(
            f"{op}: cu_seq_lens: expected {block_table.shape[0] + 1} entries (block_table.shape[0] + 1), "
            f"got {cu_seq_lens.shape[0]}"
        )
    return kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, block_size


def _check_dst_scale(op, s, dev, num_tokens):
    checks.tensor(op, "dst_scale", s)
    checks.same_device(op, "dst_scale", s, dev, "kv_cache")
    checks.dtype(op, "dst_scale", s, (torch.float32, torch.uint8))
    if s.dtype == torch.float32:
        ok = s.dim() in (1, 2) and s.shape[0] == num_tokens and (s.dim() == 1 or s.shape[1] == 1)
    else:
        ok = s.dim() == 2 and s.shape[0] == num_tokens and s.shape[1] == Indexer.SCALE_BYTES
    if not ok:
        raise ValueError(
            f"{op}: dst_scale: expected shape [T] or [T, 1] (float32) or [T, {Indexer.SCALE_BYTES}] "
            f"(uint8) with T = dst_k.shape[0] = {num_tokens}, got {list(s.shape)}"
        )
    checks.last_dim_contiguous(op, "dst_scale", s)


# -------------------------------------------------------------------------------------- variants


class Variant(NamedTuple):
    """The first argument whose view the CUDA kernels' vectors cannot take (a 16-byte aligned base and
    row stride; 4-byte for dst_scale), or "" when every view suits them. Such a view runs on Triton,
    then torch, recorded in backend_info and warned about once."""

    misaligned: str


def _aligned(t, bytes_: int) -> bool:
    """Base and row stride (of more than one row) multiples of ``bytes_``. A tensor whose last dim is not
    contiguous counts as aligned: it is bad input, which the binding names."""
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        return True
    return t.data_ptr() % bytes_ == 0 and (
        t.dim() == 0 or t.shape[0] <= 1 or t.stride(0) * t.element_size() % bytes_ == 0
    )


def _write_variant(k, kv_cache, slot_mapping, block_size, scale_fmt) -> tuple:
    return (next((name for name, t in (("kv_cache", kv_cache), ("k", k)) if not _aligned(t, 16)), ""),)


def _gather_variant(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, block_size) -> tuple:
    views = (("kv_cache", kv_cache, 16), ("dst_k", dst_k, 16), ("dst_scale", dst_scale, 4))
    return (next((name for name, t, n in views if not _aligned(t, n)), ""),)


# ------------------------------------------------------------------------------------------- jit


def cpu_spec() -> JitSpec:
    return JitSpec("indexer_cpu", ("indexer/indexer_k_cache_cpu.cpp",), exports=(WRITE_OP, GATHER_OP))


def cuda_spec(arch: str) -> JitSpec:
    return JitSpec("indexer_cuda", ("indexer/indexer_k_cache_cuda.cu",), target=arch, exports=(WRITE_OP, GATHER_OP))


def specs(target: str) -> list[JitSpec]:
    return [cpu_spec()] if target == "cpu" else [cuda_spec(target)]


def _jit_factory(name):
    """The bindings check every argument (csrc/indexer/indexer_k_cache.cuh); a misaligned view (the
    CUDA variant) is refused here, before any build."""

    def factory(device, variant):
        if variant is not None and variant.misaligned:
            bytes_ = 4 if variant.misaligned == "dst_scale" else 16
            raise BackendUnavailable(
                f"{variant.misaligned}: the CUDA kernels need a {bytes_}-byte aligned base and row stride"
            )
        spec = cpu_spec() if device.type == "cpu" else cuda_spec(cuda_arch(device))
        fn, info = jit_function(spec, name)
        if name == WRITE_OP:

            def run(k, kv_cache, slot_mapping, block_size, scale_fmt):
                fn(k, kv_cache, slot_mapping, block_size, _scale_fmt_code(scale_fmt))
        else:
            run = fn
        return OPS_OF[name].with_debug_checks(device, run), info

    return factory


# ------------------------------------------------------------------------------ sample and bench


def _sample_cache(device, gen):
    return INDEXER_K_CACHE.allocate(4, 64, device).copy_(
        rand((4, INDEXER_K_CACHE.block_stride(64)), torch.uint8, device, gen)
    )


def sample_write(device, gen=None) -> dict:
    return dict(
        k=rand((8, 128), torch.bfloat16, device, gen),
        kv_cache=_sample_cache(device, gen),
        slot_mapping=slots(256, 8, torch.int64, device, gen),
        block_size=64,
        scale_fmt="ue8m0",
    )


def sample_gather(device, gen=None) -> dict:
    return dict(
        kv_cache=_sample_cache(device, gen),
        dst_k=rand((100, 128), torch.float8_e4m3fn, device, gen),
        dst_scale=rand((100, 4), torch.uint8, device, gen),
        block_table=index([[2, 0, 3, 1], [1, 3, 0, 2]], device=device),
        cu_seq_lens=index([0, 70, 95], device=device),
        block_size=64,
    )


def _bench_cpu(h) -> list:
    """The writer (ue8m0) into a cache of 2^15 blocks (277 MB, far past an LLC), each call writing slots
    no recent call wrote (``h.fresh_slots``), and the gather of one request, against the torch
    reference."""
    bs, nb = 64, 1 << 15
    cache = INDEXER_K_CACHE.allocate(nb, bs, "cpu").random_(0, 256)
    rows = []
    for n in h.sizes((1, 133, 4096)):
        k, sm = rand((n, 128), torch.bfloat16), h.fresh_slots(nb * bs, n)
        kw = dict(block_size=bs, scale_fmt="ue8m0")
        rows += h.rows(
            WRITE_OP,
            "bf16, block_size 64, ue8m0",
            n,
            n * (2 * 128 + 132),
            [
                ("torch reference", lambda: reference.indexer_k_quant_and_cache(k, cache, sm(), **kw)),
                ("jitkv jit", lambda: indexer_k_quant_and_cache(k, cache, sm(), **kw)),
            ],
        )
    for n in h.sizes((2048, 16384)):
        table = torch.randperm(nb)[: n // bs].int()[None]
        cu = torch.tensor([0, n], dtype=torch.int32)
        args = (cache, torch.empty(n, 128, dtype=torch.uint8), torch.empty(n, dtype=torch.float32), table, cu)
        rows += h.rows(
            GATHER_OP,
            "1 request",
            n,
            n * 2 * 132,
            [
                ("torch reference", lambda: reference.gather_indexer_k_quant_cache(*args, block_size=bs)),
                ("jitkv jit", lambda: gather_indexer_k_quant_cache(*args, block_size=bs)),
            ],
        )
    return rows


def _bench_gpu(h) -> list:
    """The writer (bf16 keys, ue8m0 scales as the model runs it, and plain fp32 scales) into random unique
    token slots, and the gather of whole requests; 138 MB of cache per layer."""
    bs, blocks_per_layer, layers = 64, 16384, h.layers
    caches = [INDEXER_K_CACHE.allocate(blocks_per_layer, bs, "cuda").random_(0, 256) for _ in range(layers)]
    rows = []
    for n in h.sizes((1, 2, 16, 128, 1024, 4096, 65536)):
        ks = [rand((n, 128), torch.bfloat16, "cuda") for _ in range(layers)]
        sms = [torch.randperm(blocks_per_layer * bs, device="cuda")[:n] for _ in range(layers)]

        def write(i, backend=None, fmt="ue8m0"):
            indexer_k_quant_and_cache(ks[i], caches[i], sms[i], block_size=bs, scale_fmt=fmt, backend=backend)

        cases = [
            (
                "torch reference",
                lambda i: reference.indexer_k_quant_and_cache(
                    ks[i], caches[i], sms[i], block_size=bs, scale_fmt="ue8m0"
                ),
            ),
            ("jitkv auto", write),
            ("triton", lambda i: write(i, "triton")),
            ("jitkv auto, fp32 scales", lambda i: write(i, fmt=None)),
        ]
        rows += h.rows(
            WRITE_OP, "bf16, block_size 64, ue8m0", n, n * (2 * 128 + 132), cases, eager=("torch reference",)
        )
        ks = sms = None  # free them before the next size allocates (closures read the names)
    for reqs, length in h.sizes(((1, 2048), (1, 32768), (16, 4096))):
        nblk, tokens = length // bs, reqs * length
        tables = [
            torch.randperm(blocks_per_layer, device="cuda")[: reqs * nblk].view(reqs, nblk).int() for _ in range(layers)
        ]
        cu = (torch.arange(reqs + 1, device="cuda") * length).int()
        dst_k = [torch.empty(tokens, 128, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(layers)]
        dst_scale = [torch.empty(tokens, 4, dtype=torch.uint8, device="cuda") for _ in range(layers)]

        def gather(i, backend=None):
            gather_indexer_k_quant_cache(
                caches[i], dst_k[i], dst_scale[i], tables[i], cu, block_size=bs, backend=backend
            )

        cases = [
            (
                "torch reference",
                lambda i: reference.gather_indexer_k_quant_cache(
                    caches[i], dst_k[i], dst_scale[i], tables[i], cu, block_size=bs
                ),
            ),
            ("jitkv auto", gather),
            ("triton", lambda i: gather(i, "triton")),
        ]
        rows += h.rows(
            GATHER_OP,
            f"{reqs} req x {length}",
            tokens,
            tokens * 2 * 132 + reqs * nblk * 4,
            cases,
            eager=("torch reference",),
        )
        tables = dst_k = dst_scale = None  # free them before the next size allocates (closures read the names)
    return rows


INDEXER_K_QUANT_AND_CACHE = Op(
    indexer_k_quant_and_cache,
    schema="(Tensor k, Tensor(a!) kv_cache, Tensor slot_mapping, *, int block_size, str? scale_fmt=None)",
    home="kv_cache",
    check=check_write,
    debug_check=debug_check_write,
    variant=_write_variant,
    variant_type=Variant,
    specs=specs,
    reference=reference.indexer_k_quant_and_cache,
    triton="indexer_k_quant_and_cache_triton",
    sample=sample_write,
    bench_cpu=_bench_cpu,
    bench_gpu=_bench_gpu,
)
GATHER_INDEXER_K_QUANT_CACHE = Op(
    gather_indexer_k_quant_cache,
    schema=(
        "(Tensor kv_cache, Tensor(a!) dst_k, Tensor(b!) dst_scale, "
        "Tensor block_table, Tensor cu_seq_lens, *, int block_size)"
    ),
    home="kv_cache",
    check=check_gather,
    variant=_gather_variant,
    variant_type=Variant,
    specs=specs,
    reference=reference.gather_indexer_k_quant_cache,
    triton="gather_indexer_k_quant_cache_triton",
    sample=sample_gather,
)
OPS_OF = {op.name: op for op in (INDEXER_K_QUANT_AND_CACHE, GATHER_INDEXER_K_QUANT_CACHE)}
for _op in OPS_OF.values():
    _op.backend("jit")(_jit_factory(_op.name))
