"""DeepSeek-V4 FP8 K cache (docs/design.md §5): the layout descriptor, the quantize-and-insert writer and
the dequantize-and-gather reader."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import checks, layouts, reference
from ..codes import Dsv4
from ..jit import JitSpec, cuda_arch
from ._op import BackendUnavailable, Op, jit_function
from ._samples import index, rand, slots

__all__ = ["DSV4_K_CACHE", "dequantize_and_gather_k_cache", "quantize_and_insert_k_cache"]

WRITE_OP = "quantize_and_insert_k_cache"
GATHER_OP = "dequantize_and_gather_k_cache"


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

    head_dim = Dsv4.HEAD_DIM
    nope_dim = Dsv4.NOPE
    rope_dim = Dsv4.ROPE
    group_size = Dsv4.GROUP
    data_bytes = Dsv4.DATA_BYTES
    scale_bytes = Dsv4.SCALE_BYTES
    token_bytes = Dsv4.TOKEN_BYTES
    name = "DSV4_K_CACHE"
    cache_arg = "k_cache"
    data_offset = 0
    alignment = 16  # bytes: base pointer and block stride

    def scale_offset(self, block_size: int) -> int:
        """Bytes from a block's start to its scale region."""
        return block_size * self.data_bytes

    def block_stride(self, block_size: int) -> int:
        """The block stride ``allocate`` uses by default, the smallest a cache may have: block_size * 584
        rounded up to 16 bytes (37,376 at block_size 64, as vLLM allocates); a larger stride measured no
        faster (docs/performance.md, ``DSV4_K_CACHE.block_stride``)."""
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
    QUANTIZE_AND_INSERT_K_CACHE.run((k, k_cache, slot_mapping, block_size), backend)


def dequantize_and_gather_k_cache(
    out, k_cache, seq_lens, gather_lens, block_table, block_size, offset=0, *, backend=None
):
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
    DEQUANTIZE_AND_GATHER_K_CACHE.run((out, k_cache, seq_lens, gather_lens, block_table, block_size, offset), backend)


# ---------------------------------------------------------------------------------------- checks


def _bf16_rows(op, name, t, dev, ndim, shape_desc):
    """A bf16 tensor of ``ndim`` dims whose last dim is 512 and contiguous, on ``dev``."""
    checks.tensor(op, name, t)
    checks.same_device(op, name, t, dev, "k_cache")
    checks.dtype(op, name, t, (torch.bfloat16,))
    if t.dim() != ndim or t.shape[-1] != Dsv4.HEAD_DIM:
        raise ValueError(f"{op}: {name}: expected shape {shape_desc}, got {list(t.shape)}")
    checks.last_dim_contiguous(op, name, t)


def check_write(k, k_cache, slot_mapping, block_size):
    op = WRITE_OP
    DSV4_K_CACHE.validate(k_cache, block_size, op)
    dev = k_cache.device
    checks.index(op, "slot_mapping", slot_mapping, dev, "k_cache")
    _bf16_rows(op, "k", k, dev, 2, "[n', 512]")
    checks.rows_at_least(op, "k", k, slot_mapping.numel(), "slot_mapping")
    return k, k_cache, slot_mapping, block_size


def debug_check_write(k, k_cache, slot_mapping, block_size):
    """JITKV_DEBUG=1 on CUDA: every slot's range on the host (the kernels skip an out-of-range one)."""
    reference.check_slots(slot_mapping, k_cache.shape[0] * block_size, op=WRITE_OP)


def check_gather(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset):
    op = GATHER_OP
    DSV4_K_CACHE.validate(k_cache, block_size, op)
    dev = k_cache.device
    _bf16_rows(op, "out", out, dev, 3, "[num_reqs, max_tokens, 512]")
    checks.written(op, "out", out)
    num_reqs = out.shape[0]
    for name, t in (("seq_lens", seq_lens), ("gather_lens", gather_lens)):
        if t is None and name == "gather_lens":
            continue
        checks.index(op, name, t, dev, "k_cache")
        checks.dtype(op, name, t, (torch.int32,))
        if t.shape[0] != num_reqs:
            raise ValueError(f"{op}: {name}: expected {num_reqs} entries (out.shape[0]), got {t.shape[0]}")
    checks.tensor(op, "block_table", block_table)
    checks.same_device(op, "block_table", block_table, dev, "k_cache")
    checks.dtype(op, "block_table", block_table, (torch.int32,))
    if block_table.dim() != 2 or block_table.shape[0] != num_reqs:
        raise ValueError(f"{op}: block_table: expected shape [{num_reqs}, max_blocks], got {list(block_table.shape)}")
    checks.last_dim_contiguous(op, "block_table", block_table)
    checks.integer(op, "offset", offset, minimum=0)
    return out, k_cache, seq_lens, gather_lens, block_table, block_size, offset


# -------------------------------------------------------------------------------------- variants


class Variant(NamedTuple):
    """Whether the bf16 rows (k, or out) suit the CUDA kernels' 16-byte vectors: a 16-byte aligned base
    and row strides that are multiples of 8 elements. An unaligned view falls back like any
    unavailable backend (Triton, then torch), recorded in backend_info and warned about once."""

    aligned: bool


def _vector_aligned(t) -> tuple:
    return (t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1]),)


def _write_variant(k, k_cache, slot_mapping, block_size) -> tuple:
    return _vector_aligned(k)


def _gather_variant(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset) -> tuple:
    return _vector_aligned(out)


# ------------------------------------------------------------------------------------------- jit


def cuda_spec(arch: str) -> JitSpec:
    """The CUDA module of both ops, built for the record of jitkv/codes.py (codes.Dsv4)."""
    return JitSpec("dsv4_cuda", ("dsv4/dsv4_cuda.cu",), target=arch, exports=(WRITE_OP, GATHER_OP))


def specs(target: str) -> list[JitSpec]:
    return [] if target == "cpu" else [cuda_spec(target)]


def _jit_factory(name):
    """The CUDA binding checks every argument but the layout's semantics (the block size a cache
    holds, its block stride), which ``DSV4_K_CACHE.validate`` checks first; it keeps the guards that
    keep the kernels inside the tensors."""
    block_size_at = 3 if name == WRITE_OP else 5

    def factory(device, variant):
        if not variant.aligned:
            rows = "k" if name == WRITE_OP else "out"
            raise BackendUnavailable(
                f"{rows}: the CUDA kernels need a 16-byte aligned base and row strides that are multiples of 8 elements"
            )
        fn, info = jit_function(cuda_spec(cuda_arch(device)), name)

        def run(*args):
            DSV4_K_CACHE.validate(args[1], args[block_size_at], name)
            fn(*args)

        return OPS_OF[name].with_debug_checks(device, run), info

    return factory


# ------------------------------------------------------------------------------ sample and bench


def _sample_cache(device, gen):
    return DSV4_K_CACHE.allocate(4, 64, device).copy_(
        rand((4, DSV4_K_CACHE.block_stride(64)), torch.uint8, device, gen)
    )


def sample_write(device, gen=None) -> dict:
    return dict(
        k=rand((8, 512), torch.bfloat16, device, gen),
        k_cache=_sample_cache(device, gen),
        slot_mapping=slots(256, 8, torch.int64, device, gen),
        block_size=64,
    )


def sample_gather(device, gen=None) -> dict:
    return dict(
        out=rand((2, 100, 512), torch.bfloat16, device, gen),
        k_cache=_sample_cache(device, gen),
        seq_lens=index([90, 200], device=device),
        gather_lens=index([70, 100], device=device),
        block_table=index([[2, 0, 3, 1], [1, 3, 0, 2]], device=device),
        block_size=64,
        offset=0,
    )


def _paged_slots(n: int, block_size: int, num_blocks: int) -> torch.Tensor:
    """n slots filling whole blocks (in random block order) position by position."""
    blocks = torch.randperm(num_blocks, device="cuda")[: (n + block_size - 1) // block_size]
    return (blocks[:, None] * block_size + torch.arange(block_size, device="cuda")).flatten()[:n]


def _bench_gpu(h) -> list:
    """The gather of whole requests and the writer into random unique token slots and into whole pages,
    against the torch reference; 307 MB of cache per layer."""
    bs, blocks_per_layer, layers = 64, 8192, h.layers
    caches = [DSV4_K_CACHE.allocate(blocks_per_layer, bs, "cuda").random_(0, 256) for _ in range(layers)]
    rows = []
    for reqs, k_len in h.sizes(((1, 512), (1, 2048), (1, 8192), (1, 32768), (16, 4096))):
        nblk = k_len // bs
        tables = [
            torch.randperm(blocks_per_layer, device="cuda")[: reqs * nblk].view(reqs, nblk).int() for _ in range(layers)
        ]
        seq = torch.full((reqs,), k_len, dtype=torch.int32, device="cuda")
        outs = [torch.empty(reqs, k_len, 512, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
        moved = reqs * k_len * (584 + 1024) + reqs * nblk * 4
        cases = [
            (
                "torch reference",
                lambda i: reference.dequantize_and_gather_k_cache(outs[i], caches[i], seq, None, tables[i], bs),
            )
        ]
        cases += [
            (
                name,
                lambda i, b=b: dequantize_and_gather_k_cache(outs[i], caches[i], seq, None, tables[i], bs, backend=b),
            )
            for name, b in (("jitkv auto", None), ("triton", "triton"))
        ]
        rows += h.rows(GATHER_OP, f"{reqs} req x {k_len}", reqs * k_len, moved, cases, eager=("torch reference",))
        outs = tables = None  # free them before the next size allocates (closures read the names)
    for n in h.sizes((1, 16, 128, 4096, 65536)):
        ks = [rand((n, 512), torch.bfloat16, "cuda") for _ in range(layers)]
        # Random unique token slots (the worst case: most 8-byte scale writes share their 32-byte
        # sector with no other write), and whole pages in random order (a prefill's paged slots).
        token_slots = [torch.randperm(blocks_per_layer * bs, device="cuda")[:n] for _ in range(layers)]
        page_slots = [_paged_slots(n, bs, blocks_per_layer) for _ in range(layers)]
        cases = [
            (
                "torch reference",
                lambda i: reference.quantize_and_insert_k_cache(ks[i], caches[i], token_slots[i], block_size=bs),
            )
        ]
        for kind, sms in (("", token_slots), (", paged slots", page_slots)):
            cases += [
                (
                    name + kind,
                    lambda i, b=b, sms=sms: quantize_and_insert_k_cache(
                        ks[i], caches[i], sms[i], block_size=bs, backend=b
                    ),
                )
                for name, b in (("jitkv auto", None), ("triton", "triton"))
            ]
        rows += h.rows(WRITE_OP, "block_size 64", n, n * (1024 + 584), cases, eager=("torch reference",))
        ks = token_slots = page_slots = None  # free them before the next size allocates (closures read the names)
    return rows


# No CPU kernel: on CPU the torch reference is the implementation, not a fallback.
_ORDER = {"cpu": ("torch",)}
QUANTIZE_AND_INSERT_K_CACHE = Op(
    quantize_and_insert_k_cache,
    schema="(Tensor k, Tensor(a!) k_cache, Tensor slot_mapping, *, int block_size=64)",
    home="k_cache",
    check=check_write,
    debug_check=debug_check_write,
    variant=_write_variant,
    variant_type=Variant,
    specs=specs,
    reference=reference.quantize_and_insert_k_cache,
    triton="quantize_and_insert_k_cache_triton",
    sample=sample_write,
    bench_gpu=_bench_gpu,
    backends=_ORDER,
)
DEQUANTIZE_AND_GATHER_K_CACHE = Op(
    dequantize_and_gather_k_cache,
    schema=(
        "(Tensor(a!) out, Tensor k_cache, Tensor seq_lens, Tensor? gather_lens, "
        "Tensor block_table, int block_size, int offset=0)"
    ),
    home="k_cache",
    check=check_gather,
    variant=_gather_variant,
    variant_type=Variant,
    specs=specs,
    reference=reference.dequantize_and_gather_k_cache,
    triton="dequantize_and_gather_k_cache_triton",
    sample=sample_gather,
    backends=_ORDER,
)
OPS_OF = {op.name: op for op in (QUANTIZE_AND_INSERT_K_CACHE, DEQUANTIZE_AND_GATHER_K_CACHE)}
for _op in OPS_OF.values():
    _op.backend("jit")(_jit_factory(_op.name))
