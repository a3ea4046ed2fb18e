"""store_cache: MHA/GQA K and V row scatter with optional FP8 quantize-on-write (docs/design.md §2-§4)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .. import checks, reference
from ..codes import FP8_DTYPES, FP8_MAX, KV_FORMATS, NO_SLOT, SRC_DTYPES, KvFormat, SrcDtype
from ..jit import JitSpec, cuda_arch
from ._op import BackendUnavailable, Op, jit_function, scale_args
from ._samples import rand, slots

__all__ = ["store_cache"]

OP = "store_cache"
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


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
            ``s % block_size``. Written in place; never copied or made contiguous. Two separate
            caches whose elements are distinct memory (no stride 0 in a written dim).
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
        skip_slot: an extra padding slot (an int), compared before ``loc_map``; None for none.
        backend: "jit", "triton", "torch" or None (auto; also ``JITKV_BACKEND``).

    Raises:
        TypeError: wrong dtype or non-tensor argument, a scale that is neither a number nor a tensor,
        a skip_slot that is not an int. ValueError: shape/device/layout mismatch, aliasing caches,
        unknown kv_cache_dtype, fp8 string vs cache dtype mismatch, a missing scale, a scale tensor
        of neither 1 element nor shape ``[H]``, or a scale that is not finite and > 0 (see k_scale).
        IndexError: slot (or loc_map entry) out of range — CPU always, CUDA under JITKV_DEBUG=1 (CUDA
        otherwise skips the row); nothing is written then.

    Algorithm: CPU — one serial range check, then per-row vector copies / fp32->fp8 conversion
    (AVX-512 or AVX2), OpenMP above a payload threshold, non-temporal stores for caches far larger
    than the LLC. CUDA — K and V in one launch with 16-byte vectors and hardware saturating fp8
    conversion: at small n a latency kernel (one vector per lane, all address math done while the slot
    load is in flight; fp8: K and V in separate warps), beyond it a bulk kernel (one warp per row, rows
    >= 2 KB split across warps); with per-head scales each lane divides by its vector's head's scale.
    Heads that are not a multiple of 16 bytes, and views whose base or used strides are not 16-byte
    aligned (the 16-byte build checks them and answers before launching), take the any-alignment build
    (the widest vector the call allows). Triton (one program per row) as the fallback.
    """
    STORE_CACHE.run(
        (k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, loc_map, skip_slot), backend
    )


# ---------------------------------------------------------------------------------------- checks


def check(k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, loc_map, skip_slot):
    """The arguments as the reference and Triton take them: [n', H, D] sources, [num_blocks,
    block_size, H, D] caches (flat caches get block_size 1), parsed scales."""
    return check_kv(OP, k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, loc_map, skip_slot)


def check_kv(op, k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, loc_map, skip_slot):
    """``check`` for op ``op``: the KV-write contract (docs/design.md §3) of every op that writes K and V
    rows as store_cache does (jitkv/ops/rope.py too); errors name op."""
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        checks.tensor(op, name, t)
    checks.choice(op, "kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    dev = k_cache.device
    checks.index(op, "slot_mapping", slot_mapping, dev, "k_cache")
    if loc_map is not None:
        checks.index(op, "loc_map", loc_map, dev, "k_cache")
    checks.skip_slot(op, skip_slot)
    n = slot_mapping.numel()
    checks.same_dtype(op, "v", v, k.dtype, "k")
    h = _num_heads(op, ((k, False), (k_cache, True), (v, False), (v_cache, True)))
    views = []
    for src_name, src, cache_name, cache in (("k", k, "k_cache", k_cache), ("v", v, "v_cache", v_cache)):
        checks.same_device(op, src_name, src, dev, "k_cache")
        checks.same_device(op, cache_name, cache, dev, "k_cache")
        _dtypes(op, src_name, src, cache_name, cache, kv_cache_dtype)
        views.append(_pair_views(op, src_name, src, cache_name, cache, n, h))
    (kv, kcv), (vv, vcv) = views
    checks.written(op, "k_cache", k_cache)
    checks.written(op, "v_cache", v_cache)
    checks.disjoint(op, "k_cache", k_cache, "v_cache", v_cache)
    if kcv.shape[0] * kcv.shape[1] != vcv.shape[0] * vcv.shape[1]:
        raise ValueError(
            f"{op}: v_cache: expected {kcv.shape[0] * kcv.shape[1]} slots (as k_cache), got "
            f"{vcv.shape[0] * vcv.shape[1]} (shape {list(v_cache.shape)})"
        )
    if kv_cache_dtype != "auto":
        k_scale = checks.scale(op, "k_scale", k_scale, dev, "k_cache", heads=h)
        v_scale = checks.scale(op, "v_scale", v_scale, dev, "k_cache", heads=h)
    return kv, vv, kcv, vcv, slot_mapping, kv_cache_dtype, k_scale, v_scale, loc_map, skip_slot


def debug_check(k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, loc_map, skip_slot):
    """JITKV_DEBUG=1 on CUDA: device scales' values, then every slot's range, on the host."""
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if kv_cache_dtype != "auto" and isinstance(s, torch.Tensor):
            checks.scale_tensor_value(OP, name, s)
    reference.check_slots(
        slot_mapping, k_cache.shape[0] * k_cache.shape[1], skip_slot=skip_slot, loc_map=loc_map, op=OP
    )


def _num_heads(op, tensors):
    """H from every tensor that has a head dim (3-D sources, 3-D/4-D caches); they must agree."""
    h, first = None, None
    for (t, is_cache), name in zip(tensors, ("k", "k_cache", "v", "v_cache")):
        if t.dim() == 3 or (is_cache and t.dim() == 4):
            if h is None:
                h, first = t.shape[-2], name
            elif t.shape[-2] != h:
                raise ValueError(f"{op}: {name}: expected {h} heads like {first}, got {t.shape[-2]}")
    return 1 if h is None else h


def _dtypes(op, src_name, src, cache_name, cache, kv_cache_dtype):
    if kv_cache_dtype == "auto":
        checks.dtype(op, src_name, src, checks.COPY_DTYPES)
        checks.same_dtype(op, cache_name, cache, src.dtype, src_name + ", kv_cache_dtype='auto' copies")
        return
    want = FP8_DTYPES[KV_FORMATS[kv_cache_dtype]]
    checks.dtype(op, src_name, src, tuple(SRC_DTYPES), " (fp8 quantize-on-write)")
    if cache.dtype in FP8_MAX and cache.dtype != want:
        raise ValueError(
            f"{op}: {cache_name}: dtype {checks.dtype_name(cache.dtype)} does not match "
            f"kv_cache_dtype={kv_cache_dtype!r}"
        )
    if cache.dtype not in (want, torch.uint8):
        raise ValueError(
            f"{op}: kv_cache_dtype: {kv_cache_dtype!r} needs a {checks.dtype_name(want)} or uint8 "
            f"{cache_name}, got {checks.dtype_name(cache.dtype)}"
        )


def _pair_views(op, src_name, src, cache_name, cache, n, h):
    """Bring a (source, cache) pair to [n', H, D] and [num_blocks, block_size, H, D] views."""
    if src.dim() not in (2, 3):
        raise ValueError(f"{op}: {src_name}: expected shape [tokens, H, D] or [tokens, H*D], got {list(src.shape)}")
    if cache.dim() not in (2, 3, 4):
        raise ValueError(
            f"{op}: {cache_name}: expected shape [slots, H, D], [slots, H*D] or [num_blocks, "
            f"block_size, H, D], got {list(cache.shape)}"
        )
    checks.last_dim_contiguous(op, src_name, src)
    checks.last_dim_contiguous(op, cache_name, cache)
    checks.rows_at_least(op, src_name, src, n, "slot_mapping")
    src_row = math.prod(src.shape[1:])
    cache_row = math.prod(cache.shape[-2:]) if cache.dim() >= 3 else cache.shape[1]
    if src_row != cache_row or src_row % h:
        raise ValueError(
            f"{op}: {cache_name}: row of {cache_row} elements does not match {src_name}'s {src_row} ({h} heads)"
        )
    d = src_row // h
    src_v = src if src.dim() == 3 else src.view(src.shape[0], h, d)
    if cache.dim() == 4:
        return src_v, cache
    return src_v, cache.unsqueeze(1) if cache.dim() == 3 else cache.view(cache.shape[0], 1, h, d)


# -------------------------------------------------------------------------------------- variants


class Variant(NamedTuple):
    """The CUDA build a call runs: ``k_head_bytes``/``v_head_bytes`` (cache bytes per head, 0 and 0:
    the any-alignment build, whose vector width is picked per call), the source dtype of a quantizing
    build (NONE for a copy), the cache format, and ``aligned``: the 16-byte build, whose binding answers
    Status.NEEDS_ANY_ALIGNMENT, before anything runs, to a view it cannot address."""

    k_head_bytes: int
    v_head_bytes: int
    src_dtype: SrcDtype
    kv_format: KvFormat
    aligned: bool

    def any_alignment(self) -> tuple:
        """The fields of the any-alignment build of the same sources and format."""
        return (0, 0, self.src_dtype, self.kv_format, False)


_COPY_FIELDS = (0, 0, SrcDtype.NONE, KvFormat.COPY, False)
# Enum members the variant reads on every CUDA call, as module globals: a member read through its
# class costs 50-100 ns on Python 3.11 (a global 8 ns; docs/performance.md "variant reads").
_NO_SRC = SrcDtype.NONE


def variant(k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, loc_map, skip_slot) -> tuple:
    """The fields of the CUDA Variant for these arguments, read on every CUDA call. Head bytes are
    those of the cache: caches with a head dim (3-D flat, 4-D paged) give head_dim as their last dim,
    read once from each shape (both caches have one element size, else the binding raises). Arguments
    this cannot read go to the any-alignment build, whose binding raises the precise error."""
    try:
        kv = KV_FORMATS[kv_cache_dtype]
        ks, vs = k_cache.shape, v_cache.shape
        if len(ks) > 2 and len(vs) > 2:
            es = k_cache.element_size()
            kb, vb = ks[-1] * es, vs[-1] * es
        else:
            kb, vb = _head_bytes_any_layout(k, k_cache, v, v_cache)
        src = SRC_DTYPES.get(k.dtype, _NO_SRC) if kv else _NO_SRC
    except (AttributeError, KeyError, TypeError, ZeroDivisionError):
        return _COPY_FIELDS
    if (kb | vb) % 16 == 0 and kb > 0 and vb > 0:
        return (kb, vb, src, kv, True)
    return (0, 0, src, kv, False)


def _head_bytes_any_layout(k, k_cache, v, v_cache) -> tuple[int, int]:
    h = 1
    for t, is_cache in ((k, False), (k_cache, True), (v, False), (v_cache, True)):
        if t.dim() == 3 or (is_cache and t.dim() == 4):
            h = t.shape[-2]
            break
    return math.prod(k.shape[1:]) // h * k_cache.element_size(), math.prod(v.shape[1:]) // h * v_cache.element_size()


# ------------------------------------------------------------------------------------------- jit

COPY_ENTRY = "store_cache_copy"  # the binding's kv_cache_dtype "auto" entry point: 7 arguments instead of 12
TABLE_ENTRY = "store_cache_table"  # a page-table build's only entry point (table_runner)


def cpu_spec() -> JitSpec:
    return JitSpec("store_cache_cpu", ("store_cache/store_cache_cpu.cpp",), exports=(OP, COPY_ENTRY))


def cuda_spec(
    arch: str,
    k_head_bytes: int,
    v_head_bytes: int,
    src_dtype: int,
    kv_format: int,
    *,
    pdl: bool = True,
    page_table: bool = False,
) -> JitSpec:
    """The CUDA module for caches of ``k_head_bytes``/``v_head_bytes`` per head (0 and 0: the
    any-alignment build), sources of ``src_dtype`` (a SrcDtype; NONE for a copy) and the cache format
    ``kv_format`` (a KvFormat); ``pdl=False`` launches without programmatic dependent launch;
    ``page_table=True`` (16-byte copies only): the build that reads FlashInfer's page table itself
    (table_runner)."""
    return JitSpec(
        "store_cache_cuda",
        ("store_cache/store_cache_cuda.cu",),
        args=(
            ("k_head_bytes", k_head_bytes),
            ("v_head_bytes", v_head_bytes),
            ("src_dtype", int(src_dtype)),
            ("kv_dtype", int(kv_format)),
            ("pdl", int(pdl)),
            ("page_table", int(page_table)),
        ),
        target=arch,
        exports=(TABLE_ENTRY,) if page_table else (OP, COPY_ENTRY),
    )


# Prebuilt CUDA variants: bf16/fp16 head_dim 64, 128, 256 copies; bf16 -> e4m3 at 128; any alignment; and
# the page-table build of the bf16 head_dim 128 copy (FlashInfer's append_paged_kv_cache shim).
CUDA_PREBUILD = (
    (128, 128, SrcDtype.NONE, KvFormat.COPY),
    (256, 256, SrcDtype.NONE, KvFormat.COPY),
    (512, 512, SrcDtype.NONE, KvFormat.COPY),
    (128, 128, SrcDtype.BF16, KvFormat.E4M3),
    (0, 0, SrcDtype.NONE, KvFormat.COPY),
)
CUDA_TABLE_PREBUILD = ((256, 256, SrcDtype.NONE, KvFormat.COPY),)


def specs(target: str) -> list[JitSpec]:
    if target == "cpu":
        return [cpu_spec()]
    return [cuda_spec(target, *fields) for fields in CUDA_PREBUILD] + [
        cuda_spec(target, *fields, page_table=True) for fields in CUDA_TABLE_PREBUILD
    ]


def table_runner(device, v: Variant):
    """A runner of store_cache's CUDA build that reads FlashInfer's page table itself (jitkv/page_table.h),
    for copies (kv_cache_dtype "auto") of a 16-byte Variant: run(k, v, k_cache, v_cache, batch_indices,
    positions, kv_indices, kv_indptr, page_size) writes k and v at the table's slots and returns None, or
    True where the build cannot address the views (nothing written). Raises BackendUnavailable for a
    variant it cannot take (a quantizing or any-alignment one); a build's JitUnavailable or
    CaptureBuildError propagates."""
    if v.kv_format != KvFormat.COPY or not v.aligned:
        raise BackendUnavailable(f"{OP}: the page-table build copies rows of 16-byte heads")
    spec = cuda_spec(cuda_arch(device), v.k_head_bytes, v.v_head_bytes, _NO_SRC, KvFormat.COPY, page_table=True)
    fn = jit_function(spec, TABLE_ENTRY)[0]

    def run(k, v, k_cache, v_cache, batch_indices, positions, kv_indices, kv_indptr, page_size):
        return True if fn(k, v, k_cache, v_cache, batch_indices, positions, kv_indices, kv_indptr, page_size) else None

    return run


def _jit(device, variant):
    if device.type == "cpu":
        spec, retry = cpu_spec(), None
    else:
        spec = cuda_spec(
            cuda_arch(device), variant.k_head_bytes, variant.v_head_bytes, variant.src_dtype, variant.kv_format
        )
        retry = variant.any_alignment() if variant.aligned else None
    fn, info = jit_function(spec, OP)
    copy_fn, _ = jit_function(spec, COPY_ENTRY)
    if device.type == "cuda":
        info["alignment"] = "16 bytes" if variant.aligned else "any (vector width per call)"

    def run(k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, loc_map, skip_slot):
        """Returns ``retry`` when a 16-byte build answered Status.NEEDS_ANY_ALIGNMENT (its only other
        answer is DONE, 0), before launching anything."""
        skip = NO_SLOT if skip_slot is None else skip_slot
        if kv_cache_dtype == "auto":  # the common case: no scales to look at
            status = copy_fn(k, v, k_cache, v_cache, slot_mapping, loc_map, skip)
        else:
            ks, ks_value = scale_args(OP, "k_scale", k_scale)
            vs, vs_value = scale_args(OP, "v_scale", v_scale)
            status = fn(
                k, v, k_cache, v_cache, slot_mapping, loc_map, skip, _format(kv_cache_dtype), ks, vs, ks_value, vs_value
            )
        return retry if status else None

    return STORE_CACHE.with_debug_checks(device, run), info


def _format(kv_cache_dtype) -> int:
    kv = KV_FORMATS.get(kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None
    if kv is None or kv == KvFormat.DS_MLA:
        checks.choice(OP, "kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    return int(kv)


# ------------------------------------------------------------------------------ sample and bench


def sample(device, gen=None) -> dict:
    """bf16 into e4m3 caches with device scales, int32 slots."""
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    return dict(
        k=rand((8, 2, 64), bf16, device, gen),
        v=rand((8, 2, 64), bf16, device, gen),
        k_cache=rand((32, 2, 64), e4m3, device, gen),
        v_cache=rand((32, 2, 64), e4m3, device, gen),
        slot_mapping=slots(32, 8, torch.int32, device, gen),
        kv_cache_dtype="fp8_e4m3",
        k_scale=torch.tensor([0.5], device=device),
        v_scale=torch.tensor([2.0], device=device),
    )


def _bench_cpu(h, num_slots=65536) -> list:
    """[65536, 8, 128] caches (bf16: 256 MB for K and V, far past an LLC), each call writing slots no
    recent call wrote (``h.fresh_slots``), as an engine's new tokens do: bf16 against torch indexing,
    e4m3 against the torch reference and against the bf16 copy of the same rows ("× floor": timed in
    alternation, the median of the rounds' ratios); a 1.2 GB cache against the copy bandwidth."""
    rows = []
    shape = (num_slots, 8, 128)
    kc, vc = rand(shape, torch.bfloat16), rand(shape, torch.bfloat16)
    case = f"[{num_slots},8,128]"
    for n in h.sizes((1, 7, 133, 4096)):
        k, v, idx = rand((n, 8, 128), torch.bfloat16), rand((n, 8, 128), torch.bfloat16), h.fresh_slots(num_slots, n)

        def torch_index():
            i = idx()
            kc[i] = k
            vc[i] = v

        rows += h.rows(
            OP,
            f"{case} bf16",
            n,
            2 * 2 * k.numel() * 2,
            [("torch index", torch_index), ("jitkv jit", lambda: store_cache(k, v, kc, vc, idx()))],
        )
    e4m3 = torch.float8_e4m3fn
    kc8, vc8 = rand(shape, torch.bfloat16).to(e4m3), rand(shape, torch.bfloat16).to(e4m3)
    for n in h.sizes((133, 1024, 4096)):
        k, v, idx = rand((n, 8, 128), torch.bfloat16), rand((n, 8, 128), torch.bfloat16), h.fresh_slots(num_slots, n)
        per_head = dict(k_scale=torch.linspace(0.5, 1.5, 8), v_scale=torch.linspace(0.25, 2.0, 8))
        for fmt, scales in (("bf16->e4m3", dict(k_scale=0.5, v_scale=0.25)), ("bf16->e4m3 per-head", per_head)):
            kw = dict(kv_cache_dtype="fp8_e4m3", **scales)
            rows += h.rows(
                OP + " fp8",
                f"{case} {fmt}",
                n,
                2 * k.numel() * 3,
                [
                    ("torch reference", lambda: reference.store_cache(k, v, kc8, vc8, idx(), **kw)),
                    ("jitkv jit", lambda: store_cache(k, v, kc8, vc8, idx(), **kw)),
                    ("bf16 copy (jitkv jit)", lambda: store_cache(k, v, kc, vc, idx()), 2 * 2 * k.numel() * 2),
                ],
                floor="bf16 copy (jitkv jit)",
            )
    return rows if h.quick else rows + _bench_cpu_large(h)


def _bench_cpu_large(h, num_rows=1 << 20, n=65536) -> list:
    """K and V caches of 512 Ki rows x 1152 B (1.2 GB together), far larger than the LLC."""
    half = num_rows // 2
    kc, vc = rand((half, 576), torch.bfloat16), rand((half, 576), torch.bfloat16)
    k, v, idx = rand((n, 576), torch.bfloat16), rand((n, 576), torch.bfloat16), slots(half, n)

    def torch_index():
        kc[idx] = k
        vc[idx] = v

    return h.rows(
        OP,
        "1.2 GB cache, 1152 B rows",
        n,
        2 * 2 * k.numel() * 2,
        [("torch index", torch_index), ("jitkv jit", lambda: store_cache(k, v, kc, vc, idx))],
        min_time=1.0,
    )


STORE_NS = (1, 2, 4, 16, 64, 256, 1024, 4096, 16384, 131072)


def _bench_gpu(h, ns=STORE_NS) -> list:
    """H=8, D=128 K and V rows into flat caches: bf16 copies, then bf16 -> e4m3 with one scale per side
    or one per head (vLLM's per-head quantization). The fp8 sweeps time the bf16 copy of the same rows
    in the same case list ("bf16 copy (jitkv auto)", with its own bytes), the reference their ratio is
    taken against."""
    slots_per_layer, layers = 1 << 18, h.layers  # 8 heads x 128 bf16 K and V: 1 GB per layer, 8 GB (+ 4 GB fp8)

    def caches(dtype):
        return [torch.empty(slots_per_layer, 8, 128, device="cuda").normal_().to(dtype) for _ in range(2 * layers)]

    bf16_caches = caches(torch.bfloat16)
    rows = []
    for label, cache_dtype, kv_dtype, scales in (
        ("bf16", torch.bfloat16, "auto", 0),
        ("bf16->fp8 e4m3", torch.float8_e4m3fn, "fp8_e4m3", 1),
        ("bf16->fp8 e4m3 per-head", torch.float8_e4m3fn, "fp8_e4m3", 8),
    ):
        both = bf16_caches if kv_dtype == "auto" else caches(cache_dtype)
        kcs, vcs = both[:layers], both[layers:]
        kw = (
            {}
            if kv_dtype == "auto"
            else dict(
                kv_cache_dtype=kv_dtype,
                k_scale=torch.linspace(0.5, 1.5, scales, device="cuda"),
                v_scale=torch.linspace(0.25, 2.0, scales, device="cuda"),
            )
        )
        for n in h.sizes(ns):
            ks = [rand((n, 8, 128), torch.bfloat16, "cuda") for _ in range(layers)]
            vs = [rand((n, 8, 128), torch.bfloat16, "cuda") for _ in range(layers)]
            sms = [torch.randperm(slots_per_layer, device="cuda")[:n] for _ in range(layers)]

            def torch_index(i):
                if kv_dtype == "auto":
                    kcs[i][sms[i]] = ks[i]
                    vcs[i][sms[i]] = vs[i]
                else:
                    kcs[i][sms[i]] = reference.quantize_fp8(ks[i], cache_dtype, kw["k_scale"])
                    vcs[i][sms[i]] = reference.quantize_fp8(vs[i], cache_dtype, kw["v_scale"])

            cases = [("torch index", torch_index)]
            if kv_dtype != "auto":
                cases.append(
                    (
                        "bf16 copy (jitkv auto)",
                        lambda i: store_cache(ks[i], vs[i], bf16_caches[i], bf16_caches[layers + i], sms[i]),
                        2 * n * 1024 * 4,
                    )
                )
            cases += [
                (name, lambda i, b=b: store_cache(ks[i], vs[i], kcs[i], vcs[i], sms[i], backend=b, **kw))
                for name, b in (("jitkv auto", None), ("triton", "triton"))
            ]
            rows += h.rows(OP, f"H8 D128 K+V {label}", n, 2 * n * 1024 * (2 + kcs[0].element_size()), cases)
            ks = vs = sms = None  # free them before the next size allocates (closures read the names)
        both = kcs = vcs = None  # free them before the next size allocates (closures read the names)
    return rows


STORE_CACHE = Op(
    store_cache,
    schema=(
        "(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, *, "
        'str kv_cache_dtype="auto", Scale? k_scale=None, Scale? v_scale=None, Tensor? loc_map=None, '
        "int? skip_slot=None)"
    ),
    home="k_cache",
    check=check,
    debug_check=debug_check,
    variant=variant,
    variant_type=Variant,
    specs=specs,
    reference=reference.store_cache,
    triton="store_cache_triton",
    sample=sample,
    bench_cpu=_bench_cpu,
    bench_gpu=_bench_gpu,
)
STORE_CACHE.backend("jit")(_jit)
