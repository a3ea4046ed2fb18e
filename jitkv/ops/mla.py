"""set_mla_kv_buffer: MLA ``[nope | rope]`` row scatter, copied or quantized to FP8 (docs/design.md §2, §4)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import checks, reference
from ..codes import FP8_DTYPES, KV_FORMATS, NO_SLOT, DsMla, KvFormat, MlaFp8Kernel, MlaKernel, SrcDtype
from ..jit import JitSpec, cuda_arch
from ._op import Op, jit_function, scale_args
from ._samples import rand, slots

__all__ = ["set_mla_kv_buffer"]

OP = "set_mla_kv_buffer"
FP8_ENTRY = "set_mla_kv_buffer_fp8"  # the fp8 modules' entry point (the CPU module exports both)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla")
FP8_SRC_DTYPES = (torch.bfloat16, torch.float16)


def set_mla_kv_buffer(
    kv_buffer, loc, cache_k_nope, cache_k_rope, *, kv_cache_dtype="auto", scale=None, skip_slot=None, backend=None
):
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
            - "fp8_ds_mla": vLLM's 656-byte DeepSeek record (``jitkv.codes.DsMla``), nope 512 and rope
              64 values, bf16 or fp16, kv_buffer uint8 with W >= 656::

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
        TypeError: wrong dtype, a non-tensor argument, a scale that is neither a number nor a tensor, a
        skip_slot that is not an int. ValueError: shape, device or layout mismatch, an unknown
        kv_cache_dtype, a buffer dtype the format does not write, a missing or invalid scale (or one
        given to "fp8_ds_mla"). IndexError: an out-of-range slot (CPU, or CUDA under JITKV_DEBUG=1);
        nothing is written then.

    Algorithm: CPU — one pass over rows with vector copies or fp8 conversions (AVX-512 or AVX2),
    OpenMP above a payload threshold, non-temporal stores when the buffer dwarfs the LLC. CUDA — for
    16-byte aligned rows a latency kernel: one warp per row (one per 16-byte register of the row up to
    32 rows; fp8: the same up to 32 rows for e4m3 / e5m2, then two warps per row up to 8 rows per SM)
    issues the slot load and the row's 16-byte loads together after the programmatic-dependent-launch
    wait (SM90+), lets the next kernel launch, then stores if the slot is kept (padding rows' sources
    are read, never written); fp8 divides with a branch-free exact reciprocal division and converts
    with cvt.satfinite, fp8_ds_mla reduces each tile's amax with redux.sync. Other views take a bulk
    (copy) or generic (fp8) kernel that reads the slot first. A TMA bulk-store copy variant (sm_90a)
    is built but only runs when forced: it measured no faster. Triton (one program per row) as the
    fallback.
    """
    SET_MLA_KV_BUFFER.run((kv_buffer, loc, cache_k_nope, cache_k_rope, kv_cache_dtype, scale, skip_slot), backend)


# ---------------------------------------------------------------------------------------- checks


def check(kv_buffer, loc, cache_k_nope, cache_k_rope, kv_cache_dtype, scale, skip_slot):
    """The arguments as the reference and Triton take them: 2-D [rows, width] views, the parsed scale
    (None for "auto" and fp8_ds_mla)."""
    return check_rows(OP, kv_buffer, loc, cache_k_nope, cache_k_rope, kv_cache_dtype, scale, skip_slot)


def check_rows(
    op, kv_buffer, loc, k_nope, k_rope, kv_cache_dtype, scale, skip_slot, names=("cache_k_nope", "cache_k_rope")
):
    """``check`` for op ``op``, whose nope and rope sources are named ``names``: the MLA row write of
    every op that writes rows as set_mla_kv_buffer does (jitkv/ops/rope.py too)."""
    nope_name, rope_name = names
    for name, t in (("kv_buffer", kv_buffer), (nope_name, k_nope), (rope_name, k_rope)):
        checks.tensor(op, name, t)
    checks.choice(op, "kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    checks.skip_slot(op, skip_slot)
    fmt = KV_FORMATS[kv_cache_dtype]
    if fmt == KvFormat.COPY:
        checks.dtype(op, "kv_buffer", kv_buffer, checks.COPY_DTYPES)
        checks.same_dtype(op, nope_name, k_nope, kv_buffer.dtype, "kv_buffer")
        checks.same_dtype(op, rope_name, k_rope, kv_buffer.dtype, "kv_buffer")
    else:
        checks.dtype(op, nope_name, k_nope, FP8_SRC_DTYPES, " (fp8 quantize-on-write)")
        checks.same_dtype(op, rope_name, k_rope, k_nope.dtype, nope_name)
        allowed = (torch.uint8,) if fmt == KvFormat.DS_MLA else (torch.uint8, FP8_DTYPES[fmt])
        if kv_buffer.dtype not in allowed:
            raise ValueError(
                f"{op}: kv_buffer: kv_cache_dtype={kv_cache_dtype!r} writes a "
                f"{' or '.join(checks.dtype_name(d) for d in allowed)} buffer, got "
                f"{checks.dtype_name(kv_buffer.dtype)}"
            )
    buf, nope, rope = _rows(op, names, kv_buffer, loc, k_nope, k_rope)
    if fmt == KvFormat.DS_MLA:
        _check_ds_mla(op, names, buf, nope, rope, scale)
        scale = None
    else:
        if buf.shape[1] < nope.shape[1] + rope.shape[1]:
            raise ValueError(
                f"{op}: kv_buffer: row width {buf.shape[1]} is smaller than nope + rope = "
                f"{nope.shape[1]} + {rope.shape[1]}"
            )
        if fmt != KvFormat.COPY:
            scale = checks.scale(op, "scale", scale, kv_buffer.device, "kv_buffer")
    checks.written(op, "kv_buffer", buf)
    return buf, loc, nope, rope, kv_cache_dtype, scale, skip_slot


def debug_check(kv_buffer, loc, cache_k_nope, cache_k_rope, kv_cache_dtype, scale, skip_slot):
    """JITKV_DEBUG=1 on CUDA: a device scale's value, then every slot's range, on the host."""
    if isinstance(scale, torch.Tensor):
        checks.scale_tensor_value(OP, "scale", scale)
    reference.check_slots(loc, kv_buffer.shape[0], skip_slot=skip_slot, name="loc", op=OP)


def row_view(op, name, t, width_name):
    """[S, W] or [S, 1, W] -> the 2-D [S, W] view."""
    if t.dim() == 3 and t.shape[1] == 1:
        t = t.select(1, 0)
    elif t.dim() != 2:
        raise ValueError(
            f"{op}: {name}: expected shape [rows, {width_name}] or [rows, 1, {width_name}], got {list(t.shape)}"
        )
    checks.last_dim_contiguous(op, name, t)
    return t


def _rows(op, names, kv_buffer, loc, k_nope, k_rope):
    """The checks every format shares, after the dtypes: loc, one device, 2-D row views, at least
    loc.numel() source rows."""
    dev = kv_buffer.device
    checks.index(op, "loc", loc, dev, "kv_buffer")
    for name, t in zip(names, (k_nope, k_rope)):
        checks.same_device(op, name, t, dev, "kv_buffer")
    buf = row_view(op, "kv_buffer", kv_buffer, "W")
    nope = row_view(op, names[0], k_nope, "nope")
    rope = row_view(op, names[1], k_rope, "rope")
    for name, t in zip(names, (nope, rope)):
        checks.rows_at_least(op, name, t, loc.numel(), "loc")
    return buf, nope, rope


def _check_ds_mla(op, names, buf, nope, rope, scale):
    for name, t, want in zip(names, (nope, rope), (DsMla.NOPE, DsMla.ROPE)):
        if t.shape[1] != want:
            raise ValueError(f"{op}: {name}: fp8_ds_mla takes rows of {want} values, got {t.shape[1]}")
    if buf.shape[1] < DsMla.BYTES:
        raise ValueError(
            f"{op}: kv_buffer: row width {buf.shape[1]} is smaller than the {DsMla.BYTES}-byte fp8_ds_mla record"
        )
    if scale is not None:
        raise ValueError(
            f'{op}: scale: kv_cache_dtype="fp8_ds_mla" computes one scale per {DsMla.TILE}-value '
            f"tile; expected None, got {type(scale).__name__}"
        )


# -------------------------------------------------------------------------------------- variants


class Variant(NamedTuple):
    """The CUDA module a call runs: the source bytes of a row's nope and rope parts, the format (COPY:
    the copy module, else an fp8 writer), and the fp8 writer's source dtype (NONE for a copy)."""

    nope_bytes: int
    rope_bytes: int
    kv_format: KvFormat
    src_dtype: SrcDtype


_FP8_SRC = {torch.bfloat16: SrcDtype.BF16, torch.float16: SrcDtype.F16}
# Enum members the variant reads on every CUDA call, as module globals: a member read through its
# class costs 50-100 ns on Python 3.11 (a global 8 ns; docs/performance.md "variant reads").
_COPY, _DS_MLA, _NO_SRC = KvFormat.COPY, KvFormat.DS_MLA, SrcDtype.NONE


def variant(kv_buffer, loc, cache_k_nope, cache_k_rope, kv_cache_dtype, scale, skip_slot) -> tuple:
    """The fields of the CUDA Variant, read on every CUDA call (fp8_ds_mla: the record's widths; a
    binding names any other width). Arguments it cannot read raise (Op.run then raises the check's error)."""
    if kv_cache_dtype == "auto":
        return (
            cache_k_nope.shape[-1] * cache_k_nope.element_size(),
            cache_k_rope.shape[-1] * cache_k_rope.element_size(),
            _COPY,
            _NO_SRC,
        )
    fmt, src = KV_FORMATS[kv_cache_dtype], _FP8_SRC[cache_k_nope.dtype]
    if fmt == _DS_MLA:
        return (2 * DsMla.NOPE, 2 * DsMla.ROPE, fmt, src)
    return (2 * cache_k_nope.shape[-1], 2 * cache_k_rope.shape[-1], fmt, src)


# ------------------------------------------------------------------------------------------- jit


def cpu_spec() -> JitSpec:
    return JitSpec("mla_cpu", ("mla/set_mla_kv_buffer_cpu.cpp",), exports=(OP, FP8_ENTRY))


def cuda_spec(
    arch: str,
    nope_bytes: int,
    rope_bytes: int,
    *,
    kernel: str = "auto",
    pdl: bool = True,
    kv_format: int = KvFormat.COPY,
    src_dtype: int = SrcDtype.NONE,
) -> JitSpec:
    """The CUDA module for rows of ``nope_bytes + rope_bytes`` source bytes: the copy (``kv_format``
    COPY, exports set_mla_kv_buffer), or the writer of an fp8 format (with ``src_dtype`` BF16 or F16;
    exports set_mla_kv_buffer_fp8). ``kernel`` (an MlaKernel / MlaFp8Kernel name, lower case) forces
    one kernel (a call it cannot run raises ValueError), ``pdl=False`` launches without programmatic
    dependent launch."""
    kernels = MlaFp8Kernel if kv_format else MlaKernel
    args = (
        ("nope_bytes", nope_bytes),
        ("rope_bytes", rope_bytes),
        ("kernel", int(kernels[kernel.upper()])),
        ("pdl", int(pdl)),
    )
    if kv_format:
        args += (("kv_format", int(kv_format)), ("src_dtype", int(src_dtype)))
        return JitSpec("mla_cuda", ("mla/set_mla_kv_buffer_fp8_cuda.cu",), args=args, target=arch, exports=(FP8_ENTRY,))
    return JitSpec("mla_cuda", ("mla/set_mla_kv_buffer_cuda.cu",), args=args, target=arch, exports=(OP,))


# Byte layouts prebuilt for CUDA: DeepSeek/Kimi bf16 512+64, fp8 528+128 and 512+64; quantizing bf16
# 512+64 to e4m3 and to the fp8_ds_mla record.
CUDA_PREBUILD = (
    (1024, 128, KvFormat.COPY, SrcDtype.NONE),
    (656, 0, KvFormat.COPY, SrcDtype.NONE),
    (528, 128, KvFormat.COPY, SrcDtype.NONE),
    (512, 64, KvFormat.COPY, SrcDtype.NONE),
    (1024, 128, KvFormat.E4M3, SrcDtype.BF16),
    (1024, 128, KvFormat.DS_MLA, SrcDtype.BF16),
)


def specs(target: str) -> list[JitSpec]:
    if target == "cpu":
        return [cpu_spec()]
    return [cuda_spec(target, nope, rope, kv_format=fmt, src_dtype=src) for nope, rope, fmt, src in CUDA_PREBUILD]


def _jit(device, variant):
    if device.type == "cpu":
        spec = cpu_spec()
    else:
        spec = cuda_spec(
            cuda_arch(device),
            variant.nope_bytes,
            variant.rope_bytes,
            kv_format=variant.kv_format,
            src_dtype=variant.src_dtype,
        )
    copy = fp8 = None
    if device.type == "cpu" or variant.kv_format == KvFormat.COPY:
        copy, info = jit_function(spec, OP)
    if device.type == "cpu" or variant.kv_format != KvFormat.COPY:
        fp8, info = jit_function(spec, FP8_ENTRY)
    if device.type == "cuda":
        info["path"] = (
            "latency kernel for 16-byte aligned rows, else the bulk vector kernel"
            if copy
            else "fp8 kernel for 16-byte aligned sources (e4m3 / e5m2: one vector per lane up to 32 rows; "
            "then two warps per row up to 8 rows per SM, else one), else the generic fp8 kernel"
        )

    def run(kv_buffer, loc, cache_k_nope, cache_k_rope, kv_cache_dtype, scale, skip_slot):
        skip = NO_SLOT if skip_slot is None else skip_slot
        if kv_cache_dtype == "auto":
            copy(kv_buffer, loc, cache_k_nope, cache_k_rope, skip)
            return
        fmt = KV_FORMATS.get(kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None
        if fmt is None:
            checks.choice(OP, "kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
        s, s_value = scale_args(OP, "scale", scale)  # the binding refuses one given to fp8_ds_mla
        fp8(kv_buffer, loc, cache_k_nope, cache_k_rope, skip, int(fmt), s, s_value)

    return SET_MLA_KV_BUFFER.with_debug_checks(device, run), info


# ------------------------------------------------------------------------------ sample and bench


def sample(device, gen=None) -> dict:
    bf16 = torch.bfloat16
    return dict(
        kv_buffer=rand((64, 576), bf16, device, gen),
        loc=slots(64, 8, torch.int64, device, gen),
        cache_k_nope=rand((8, 512), bf16, device, gen),
        cache_k_rope=rand((8, 64), bf16, device, gen),
    )


def _bench_cpu(h, num_slots=1 << 18) -> list:
    """512+64 bf16 rows into a 2^18-row buffer (302 MB bf16, far past an LLC), each call writing slots
    no recent call wrote (``h.fresh_slots``), against torch indexing, and quantized to e4m3 /
    fp8_ds_mla against the torch reference."""
    rows = []
    buf = rand((num_slots, 576), torch.bfloat16)
    for n in h.sizes((1, 133, 4096)):
        nope, rope, loc = rand((n, 512), torch.bfloat16), rand((n, 64), torch.bfloat16), h.fresh_slots(num_slots, n)

        def torch_index():
            i = loc()
            buf[i, :512] = nope
            buf[i, 512:] = rope

        rows += h.rows(
            OP,
            "512+64 bf16",
            n,
            2 * n * 1152,
            [("torch index", torch_index), ("jitkv jit", lambda: set_mla_kv_buffer(buf, loc(), nope, rope))],
        )
    for fmt, width in (("fp8_e4m3", 576), ("fp8_ds_mla", 656)):
        buf8 = rand((num_slots, width), torch.uint8)
        kw = dict(kv_cache_dtype=fmt, scale=None if fmt == "fp8_ds_mla" else 0.37)
        for n in h.sizes((1, 133, 4096)):
            nope, rope, loc = rand((n, 512), torch.bfloat16), rand((n, 64), torch.bfloat16), h.fresh_slots(num_slots, n)
            rows += h.rows(
                OP,
                f"512+64 bf16 -> {fmt}",
                n,
                n * (1152 + width),
                [
                    ("torch reference", lambda: reference.set_mla_kv_buffer(buf8, loc(), nope, rope, **kw)),
                    ("jitkv jit", lambda: set_mla_kv_buffer(buf8, loc(), nope, rope, **kw)),
                ],
            )
    return rows


MLA_NS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 2048, 4096, 16384, 65536, 262144)


def _bench_gpu(h) -> list:
    return _bench_gpu_copy(h) + _bench_gpu_fp8(h)


def _bench_gpu_copy(h, ns=MLA_NS) -> list:
    """512+64 bf16 rows into 8 layers of 2^19-row buffers (4.8 GB): the op, each forced kernel, Triton,
    and an L2-warm source (as when the layer's previous kernel has just produced it)."""
    rows_per_layer, layers = 1 << 19, h.layers
    bufs = [torch.empty(rows_per_layer, 576, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(layers)]
    arch = cuda_arch(torch.device("cuda"))
    kernel = {k: jit_function(cuda_spec(arch, 1024, 128, kernel=k), OP)[0] for k in ("latency", "vector", "tma")}
    rows = []
    for n in h.sizes(ns):
        nope = [rand((n, 512), torch.bfloat16, "cuda") for _ in range(layers)]
        rope = [rand((n, 64), torch.bfloat16, "cuda") for _ in range(layers)]
        # The last slot is never written, so that passing it as skip_slot changes no byte: the kernel
        # then takes its 64-bit parameter block (MlaArgs) instead of the compact one.
        locs = [torch.randperm(rows_per_layer - 1, device="cuda")[:n] for _ in range(layers)]
        skip = rows_per_layer - 1

        def torch_index(i):
            bufs[i][locs[i], :512] = nope[i]
            bufs[i][locs[i], 512:] = rope[i]

        cases = [
            ("torch index", torch_index),
            ("jitkv auto", lambda i: set_mla_kv_buffer(bufs[i], locs[i], nope[i], rope[i])),
            ("jit latency", lambda i: kernel["latency"](bufs[i], locs[i], nope[i], rope[i], -1)),
            ("jit latency, 80-byte block", lambda i: kernel["latency"](bufs[i], locs[i], nope[i], rope[i], skip)),
            ("jit vector (bulk)", lambda i: kernel["vector"](bufs[i], locs[i], nope[i], rope[i], -1)),
            ("jit TMA", lambda i: kernel["tma"](bufs[i], locs[i], nope[i], rope[i], -1)),
            ("triton", lambda i: set_mla_kv_buffer(bufs[i], locs[i], nope[i], rope[i], backend="triton")),
            ("jitkv auto, L2-warm source", lambda i: set_mla_kv_buffer(bufs[i], locs[i], nope[0], rope[0])),
            (
                "triton, L2-warm source",
                lambda i: set_mla_kv_buffer(bufs[i], locs[i], nope[0], rope[0], backend="triton"),
            ),
        ]
        rows += h.rows(OP, "512+64 bf16", n, 2 * n * 1152, cases)
        nope = rope = locs = None  # free them before the next size allocates (closures read the names)
    return rows


FP8_CEILING_N = 16384  # where the fp8 rows also get graph-timed contiguous copies


def _bench_gpu_fp8(h, ns=MLA_NS) -> list:
    """bf16 512+64 rows quantized to e4m3 (a device scale) and to the 656-byte fp8_ds_mla record. The
    first row of each n is the bf16 copy at the same n, so "vs torch" reads bf16 µs / fp8 µs; at
    FP8_CEILING_N also contiguous copies of the same bytes: uint8 (read = write = half the bytes) and,
    for e4m3, the bf16 -> e4m3 conversion copy_ (read 1152 B, write 576 B per row), under graph replay
    like the rows."""
    rows_per_layer, layers = 1 << 19, h.layers
    copy_bufs = [torch.empty(rows_per_layer, 576, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(layers)]
    arch = cuda_arch(torch.device("cuda"))
    scale = torch.tensor([0.37], device="cuda")
    rows = []
    for fmt, width, buf_dtype in (("fp8_e4m3", 576, torch.float8_e4m3fn), ("fp8_ds_mla", 656, torch.uint8)):
        bufs = [
            torch.empty(rows_per_layer, width, dtype=torch.uint8, device="cuda").random_(0, 256).view(buf_dtype)
            for _ in range(layers)
        ]
        code, fmt_scale = int(KV_FORMATS[fmt]), None if fmt == "fp8_ds_mla" else scale
        kinds = ("split", "row", "generic") if fmt == "fp8_ds_mla" else ("lanes", "split", "row", "generic")
        kernel = {
            k: jit_function(cuda_spec(arch, 1024, 128, kernel=k, kv_format=code, src_dtype=SrcDtype.BF16), FP8_ENTRY)[0]
            for k in kinds
        }
        for n in h.sizes(ns):
            nope = [rand((n, 512), torch.bfloat16, "cuda") for _ in range(layers)]
            rope = [rand((n, 64), torch.bfloat16, "cuda") for _ in range(layers)]
            locs = [torch.randperm(rows_per_layer, device="cuda")[:n] for _ in range(layers)]
            moved = n * (1152 + width)
            kw = dict(kv_cache_dtype=fmt, scale=fmt_scale)
            cases = (
                [
                    (
                        "bf16 copy (jitkv auto)",
                        lambda i: set_mla_kv_buffer(copy_bufs[i], locs[i], nope[i], rope[i]),
                        n * 2 * 1152,
                    ),
                    ("jitkv auto", lambda i: set_mla_kv_buffer(bufs[i], locs[i], nope[i], rope[i], **kw)),
                ]
                + [
                    (
                        f"jit {k}",
                        lambda i, k=k: kernel[k](bufs[i], locs[i], nope[i], rope[i], -1, code, fmt_scale, -1.0),
                    )
                    for k in kernel
                ]
                + [
                    ("triton", lambda i: set_mla_kv_buffer(bufs[i], locs[i], nope[i], rope[i], backend="triton", **kw)),
                ]
            )
            if n == FP8_CEILING_N:
                cases += h.contiguous_copies(moved, n if fmt == "fp8_e4m3" else 0)
            rows += h.rows(OP, f"512+64 bf16 -> {fmt}", n, moved, cases)
            nope = rope = locs = None  # free them before the next size allocates (closures read the names)
        bufs = None  # free them before the next size allocates (closures read the names)
    return rows


SET_MLA_KV_BUFFER = Op(
    set_mla_kv_buffer,
    schema=(
        '(Tensor(a!) kv_buffer, Tensor loc, Tensor cache_k_nope, Tensor cache_k_rope, *, str kv_cache_dtype="auto", '
        "Scale? scale=None, int? skip_slot=None)"
    ),
    home="kv_buffer",
    check=check,
    debug_check=debug_check,
    variant=variant,
    variant_type=Variant,
    specs=specs,
    reference=reference.set_mla_kv_buffer,
    triton="set_mla_kv_buffer_triton",
    sample=sample,
    bench_cpu=_bench_cpu,
    bench_gpu=_bench_gpu,
)
SET_MLA_KV_BUFFER.backend("jit")(_jit)
