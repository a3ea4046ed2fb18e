"""gather_mla_cache: the paged MLA cache's tokens of each request into contiguous rows, copied or
dequantized (vLLM's cp_gather_cache / gather_and_maybe_dequant_cache; docs/design.md §2)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import checks, reference
from ..codes import FP8_DTYPES, KV_FORMATS, DsMla, KvFormat
from ..jit import JitSpec, cuda_arch
from ._op import BackendUnavailable, Op, jit_function, scale_args
from ._samples import index, rand

__all__ = ["gather_mla_cache"]

OP = "gather_mla_cache"
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla")


def gather_mla_cache(
    out, kv_cache, block_table, cu_seq_lens, *, seq_starts=None, kv_cache_dtype="auto", scale=None, backend=None
):
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
    ValueError where it decreases or where requests start below row 0 or end past ``out``; on CUDA
    otherwise a decreasing cu_seq_lens is the caller's error (rows it maps to several requests get one
    of them).

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
            - "fp8_ds_mla": vLLM's 656-byte DeepSeek record (uint8, ``W == 656``; ``jitkv.codes.DsMla``)
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
        format mismatch, an unknown kv_cache_dtype, a missing or invalid scale, a cu_seq_lens that
        decreases or reaches outside out (CPU; CUDA under JITKV_DEBUG=1). Nothing is written when
        anything is raised.

    Algorithm: CUDA — one warp per 2 output rows (4 warps per CTA, the grid from out.shape[0]):
    lanes 0-1 find their row's request (binary search over cu_seq_lens), position and block-table
    entry; then the warp issues all 16-byte (fp8: 8-byte) loads of both entries before converting
    (fp8 in registers: e4m3 through the hardware f16 conversion on sm_89+, e5m2 as the high byte of
    an fp16; times the scale; bf16 round) and storing 16-byte vectors. CPU — the same rule per row,
    vector copies, fp8 through vector conversions (AVX-512 or AVX2) or a 256-entry float table, OpenMP
    above a payload threshold. Triton (16 rows per program, integer-exact fp8 decode) as the fallback.
    """
    GATHER_MLA_CACHE.run((out, kv_cache, block_table, cu_seq_lens, seq_starts, kv_cache_dtype, scale), backend)


# ---------------------------------------------------------------------------------------- checks


def check(out, kv_cache, block_table, cu_seq_lens, seq_starts, kv_cache_dtype, scale):
    """The checks of csrc/mla_gather/gather_mla_cache.cuh, in its order; the arguments with the parsed
    scale (None unless a per-tensor fp8 format)."""
    for name, t in (("out", out), ("kv_cache", kv_cache), ("block_table", block_table), ("cu_seq_lens", cu_seq_lens)):
        checks.tensor(OP, name, t)
    checks.choice(OP, "kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    dev = out.device
    checks.same_device(OP, "kv_cache", kv_cache, dev, "out")
    checks.index(OP, "cu_seq_lens", cu_seq_lens, dev, "out")
    if seq_starts is not None:
        checks.index(OP, "seq_starts", seq_starts, dev, "out")
    checks.same_device(OP, "block_table", block_table, dev, "out")
    fmt = KV_FORMATS[kv_cache_dtype]
    _dtypes(out, kv_cache, kv_cache_dtype, fmt)
    if kv_cache.dim() != 3:
        raise ValueError(f"{OP}: kv_cache: expected shape [num_blocks, block_size, W], got {list(kv_cache.shape)}")
    checks.last_dim_contiguous(OP, "kv_cache", kv_cache)
    if out.dim() != 2:
        raise ValueError(f"{OP}: out: expected shape [total_tokens, D], got {list(out.shape)}")
    checks.last_dim_contiguous(OP, "out", out)
    checks.written(OP, "out", out)
    _widths(out.shape[1], kv_cache.shape[2], fmt)
    num_reqs = cu_seq_lens.numel() - 1
    if num_reqs < 0:
        raise ValueError(f"{OP}: cu_seq_lens: expected num_reqs + 1 >= 1 entries, got 0")
    checks.dtype(OP, "block_table", block_table, checks.INDEX_DTYPES)
    if block_table.dim() != 2:
        raise ValueError(f"{OP}: block_table: expected shape [num_reqs, max_blocks], got {list(block_table.shape)}")
    checks.last_dim_contiguous(OP, "block_table", block_table)
    for name, t in (("block_table", block_table), ("seq_starts", seq_starts)):
        if t is not None and t.shape[0] < num_reqs:
            raise ValueError(
                f"{OP}: {name}: expected at least {num_reqs} rows (cu_seq_lens.numel() - 1), got {t.shape[0]}"
            )
    if fmt in FP8_DTYPES:
        scale = checks.scale(OP, "scale", scale, dev, "out")
    else:
        scale = None
    return out, kv_cache, block_table, cu_seq_lens, seq_starts, kv_cache_dtype, scale


def debug_check(out, kv_cache, block_table, cu_seq_lens, seq_starts, kv_cache_dtype, scale):
    """JITKV_DEBUG=1 on CUDA: a device scale's value, then cu_seq_lens against out, on the host."""
    if isinstance(scale, torch.Tensor):
        checks.scale_tensor_value(OP, "scale", scale)
    reference.check_gather_rows(cu_seq_lens, out.shape[0], op=OP)


def _dtypes(out, kv_cache, kv_cache_dtype, fmt):
    if fmt == KvFormat.COPY:
        checks.dtype(OP, "kv_cache", kv_cache, checks.COPY_DTYPES)
        checks.same_dtype(OP, "out", out, kv_cache.dtype, "kv_cache, kv_cache_dtype='auto' copies")
        return
    want = FP8_DTYPES.get(fmt)
    if kv_cache.dtype not in (want, torch.uint8):
        need = "a uint8" if want is None else f"a {checks.dtype_name(want)} or uint8"
        raise ValueError(
            f"{OP}: kv_cache_dtype: {kv_cache_dtype!r} needs {need} kv_cache, got {checks.dtype_name(kv_cache.dtype)}"
        )
    checks.dtype(OP, "out", out, (torch.bfloat16,), f" (kv_cache_dtype={kv_cache_dtype!r} dequantizes to bf16)")


def _widths(d, w, fmt):
    """Output row width d against the cache entry width w."""
    if fmt == KvFormat.DS_MLA:
        if w != DsMla.BYTES:
            raise ValueError(
                f"{OP}: kv_cache: expected entries of {DsMla.BYTES} bytes (the fp8_ds_mla record), got {w}"
            )
        want = DsMla.NOPE + DsMla.ROPE
    else:
        want = w
    if d != want:
        raise ValueError(f"{OP}: out: expected rows of {want} elements (kv_cache's entries), got {d}")


# -------------------------------------------------------------------------------------- variants


class Variant(NamedTuple):
    """The CUDA module a call runs: the format, the output row bytes, and whether the views suit its
    vectors (16-byte output rows and stores; cache loads of 16 bytes, per-tensor fp8: 8). An unaligned
    view falls back like any unavailable backend (Triton, then torch; warned once)."""

    kv_format: KvFormat
    out_row_bytes: int
    aligned: bool


# An output row the module serves when the arguments' own shapes say nothing (the binding then raises
# the precise error before anything runs).
_ANY_ROW_BYTES = 2 * (DsMla.NOPE + DsMla.ROPE)


def variant(out, kv_cache, block_table, cu_seq_lens, seq_starts, kv_cache_dtype, scale) -> tuple:
    """The fields of the CUDA Variant, read on every CUDA call. Arguments the binding refuses anyway
    (ranks, strides) go to it for its precise error."""
    fmt = KV_FORMATS.get(kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None
    if fmt is None:
        checks.choice(OP, "kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    if (
        out.dim() != 2
        or kv_cache.dim() != 3
        or (out.stride(1) != 1 and out.shape[1] > 1)
        or (kv_cache.stride(2) != 1 and kv_cache.shape[2] > 1)
    ):
        return (fmt, _ANY_ROW_BYTES, True)
    oes, ces = out.element_size(), kv_cache.element_size()
    row = out.shape[1] * oes
    cache_align = 8 if fmt in FP8_DTYPES else 16
    aligned = (
        row > 0
        and row % 16 == 0
        and out.data_ptr() % 16 == 0
        and out.stride(0) * oes % 16 == 0
        and kv_cache.data_ptr() % cache_align == 0
        and kv_cache.stride(0) * ces % cache_align == 0
        and kv_cache.stride(1) * ces % cache_align == 0
    )
    return (fmt, row, True) if aligned else (fmt, _ANY_ROW_BYTES, False)


# ------------------------------------------------------------------------------------------- jit


def cpu_spec() -> JitSpec:
    return JitSpec("mla_gather_cpu", ("mla_gather/gather_mla_cache_cpu.cpp",), exports=(OP,))


def cuda_spec(arch: str, kv_format: int, out_row_bytes: int) -> JitSpec:
    """The CUDA module for one format (a KvFormat) and output rows of ``out_row_bytes``."""
    return JitSpec(
        "mla_gather_cuda",
        ("mla_gather/gather_mla_cache_cuda.cu",),
        args=(("format", int(kv_format)), ("out_bytes", out_row_bytes)),
        target=arch,
        exports=(OP,),
    )


# Prebuilt CUDA variants: 576-dim rows (DeepSeek MLA 512 + 64) of bf16/fp16 copies, e4m3, e5m2, fp8_ds_mla.
CUDA_PREBUILD = ((KvFormat.COPY, 1152), (KvFormat.E4M3, 1152), (KvFormat.E5M2, 1152), (KvFormat.DS_MLA, 1152))


def specs(target: str) -> list[JitSpec]:
    if target == "cpu":
        return [cpu_spec()]
    return [cuda_spec(target, fmt, row) for fmt, row in CUDA_PREBUILD]


def _jit(device, variant):
    if device.type == "cpu":
        spec = cpu_spec()
    else:
        if not variant.aligned:
            raise BackendUnavailable(
                "the CUDA kernel needs 16-byte aligned output rows and 16-byte (per-tensor "
                "fp8: 8-byte) aligned cache entries"
            )
        spec = cuda_spec(cuda_arch(device), variant.kv_format, variant.out_row_bytes)
    fn, info = jit_function(spec, OP)

    def run(out, kv_cache, block_table, cu_seq_lens, seq_starts, kv_cache_dtype, scale):
        fmt = KV_FORMATS.get(kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None
        if fmt is None:
            checks.choice(OP, "kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
        s, s_value = scale_args(OP, "scale", scale) if fmt in FP8_DTYPES else (None, -1.0)
        fn(out, kv_cache, block_table, cu_seq_lens, seq_starts, int(fmt), s, s_value)

    return GATHER_MLA_CACHE.with_debug_checks(device, run), info


# ------------------------------------------------------------------------------ sample and bench


def sample(device, gen=None) -> dict:
    """fp8 e4m3 with a tensor scale; request 1 runs past its table (zero rows), rows 45+ untouched."""
    return dict(
        out=rand((50, 576), torch.bfloat16, device, gen),
        kv_cache=rand((6, 16, 576), torch.float8_e4m3fn, device, gen),
        block_table=index([[3, 0, 5], [1, 2, 4]], device=device),
        cu_seq_lens=index([0, 20, 45], torch.int64, device),
        seq_starts=index([5, 30], device=device),
        kv_cache_dtype="fp8_e4m3",
        scale=torch.tensor([0.37], device=device),
    )


def _bench_cpu(h, reqs=4, tokens=1024, block_size=64) -> list:
    """reqs x tokens of 576 bf16 from random blocks, copied and from fp8_e4m3, against the reference."""
    rows = []
    nblk = tokens // block_size
    table = torch.randperm(2 * reqs * nblk)[: reqs * nblk].view(reqs, nblk).int()
    cu = torch.arange(0, (reqs + 1) * tokens, tokens, dtype=torch.int32)
    out = torch.empty(reqs * tokens, 576, dtype=torch.bfloat16)
    for fmt, cache in (
        ("auto", rand((2 * reqs * nblk, block_size, 576), torch.bfloat16)),
        ("fp8_e4m3", rand((2 * reqs * nblk, block_size, 576), torch.float8_e4m3fn)),
    ):
        kw = dict(kv_cache_dtype=fmt, scale=0.5 if fmt != "auto" else None)
        rows += h.rows(
            OP,
            f"{reqs} req x {tokens}, {fmt}",
            reqs * tokens,
            reqs * tokens * 576 * (cache.element_size() + 2),
            [
                ("torch reference", lambda: reference.gather_mla_cache(out, cache, table, cu, **kw)),
                ("jitkv jit", lambda: gather_mla_cache(out, cache, table, cu, **kw)),
            ],
        )
    return rows


def _bench_gpu(h) -> list:
    """16 requests x 4096 tokens (a chunked prefill's cached prefix) from random blocks of 64 tokens:
    576 bf16 copied, and the fp8_ds_mla record dequantized to 576 bf16."""
    reqs, tokens, bs, blocks_per_layer, layers = 16, 4096, 64, 2048, h.layers  # 2 x the gathered tokens per layer
    nblk, dims = tokens // bs, DsMla.NOPE + DsMla.ROPE
    cu = torch.arange(0, (reqs + 1) * tokens, tokens, dtype=torch.int32, device="cuda")
    rows = []
    for label, fmt, width in (
        (f"{dims} bf16 -> bf16", "auto", 2 * dims),
        (f"fp8_ds_mla -> {dims} bf16", "fp8_ds_mla", DsMla.BYTES),
    ):
        caches = [
            torch.empty(blocks_per_layer, bs, width, dtype=torch.uint8, device="cuda").random_(0, 256)
            for _ in range(layers)
        ]
        if fmt == "auto":
            caches = [c.view(torch.bfloat16) for c in caches]
        else:  # finite tile scales (random bytes would hold NaNs and infinities)
            for c in caches:
                scales = torch.rand(blocks_per_layer, bs, DsMla.TILES, device="cuda")
                c[..., DsMla.SCALE_OFFSET : DsMla.ROPE_OFFSET] = scales.view(torch.uint8)
        tables = [
            torch.randperm(blocks_per_layer, device="cuda")[: reqs * nblk].view(reqs, nblk).int() for _ in range(layers)
        ]
        outs = [torch.empty(reqs * tokens, dims, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
        moved = reqs * tokens * (width + 2 * dims) + reqs * nblk * 4
        cases = [
            (
                "torch reference",
                lambda i: reference.gather_mla_cache(outs[i], caches[i], tables[i], cu, kv_cache_dtype=fmt),
            )
        ]
        cases += [
            (name, lambda i, b=b: gather_mla_cache(outs[i], caches[i], tables[i], cu, kv_cache_dtype=fmt, backend=b))
            for name, b in (("jitkv auto", None), ("triton", "triton"))
        ]
        rows += h.rows(OP, f"{reqs} req x {tokens}, {label}", reqs * tokens, moved, cases, eager=("torch reference",))
        caches = tables = outs = None  # free them before the next size allocates (closures read the names)
    return rows


GATHER_MLA_CACHE = Op(
    gather_mla_cache,
    schema=(
        "(Tensor(a!) out, Tensor kv_cache, Tensor block_table, Tensor cu_seq_lens, *, Tensor? seq_starts=None, "
        'str kv_cache_dtype="auto", Scale? scale=None)'
    ),
    home="out",
    check=check,
    debug_check=debug_check,
    variant=variant,
    variant_type=Variant,
    specs=specs,
    reference=reference.gather_mla_cache,
    triton="gather_mla_cache_triton",
    sample=sample,
    bench_cpu=_bench_cpu,
    bench_gpu=_bench_gpu,
)
GATHER_MLA_CACHE.backend("jit")(_jit)
