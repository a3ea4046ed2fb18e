"""Codes and record constants shared by Python and the kernels: the one place each is written.

The C++/CUDA kernels include ``jitkv/codes.h``, generated from this module by ``header()``: every JIT
build writes it into its include path, and the cache key hashes its text like any source's
(``jitkv/jit/spec.py``), so changing a code or a record layout here changes it for every backend and
every artifact at once. Names follow one rule on both sides: ``KvFormat.DS_MLA`` is
``jitkv::codes::KvFormat::kDsMla``, ``DsMla.ROPE_OFFSET`` is ``jitkv::codes::DsMla::kRopeOffset``.
"""

from __future__ import annotations

import enum
import struct

import torch

# ---------------------------------------------------------------------------------------- codes


class KvFormat(enum.IntEnum):
    """What a writer stores (``kv_cache_dtype``) or a reader decodes: a bitwise copy, fp8 with a
    per-tensor or per-head scale, or vLLM's 656-byte fp8_ds_mla record (docs/design.md §4)."""

    COPY = 0
    E4M3 = 1
    E5M2 = 2
    DS_MLA = 3


class SrcDtype(enum.IntEnum):
    """The element type of a quantizing kernel's sources (NONE: the kernel copies bytes)."""

    NONE = 0
    BF16 = 1
    F16 = 2
    F32 = 3


class ScaleFmt(enum.IntEnum):
    """How the indexer K cache writer stores its per-token scale (docs/design.md §5.1)."""

    FP32 = 0
    UE8M0 = 1


class Status(enum.IntEnum):
    """What a binding returns. NEEDS_ANY_ALIGNMENT: a 16-byte build was given a view it cannot
    address, and launched nothing (the op then runs the any-alignment build). COPY_ENGINES /
    SM_KERNEL: transfer_pages' SM binding / copy-engine binding was given host ids of pages the other
    mechanism takes, and copied nothing (the op then runs the other binding). PER_POOL: a (K, V) tuple
    whose pools differ in page size or layer count, which one launch cannot move; nothing copied (the
    op then moves each pool alone)."""

    DONE = 0
    NEEDS_ANY_ALIGNMENT = 1
    COPY_ENGINES = 2
    PER_POOL = 3
    SM_KERNEL = 4


class RopeQ(enum.IntEnum):
    """What the rope ops do with the queries (docs/design.md §9): no queries (MLA without q_pe),
    rotated in place, written to ``q_out`` in q's dtype, or to an fp8 ``q_out`` (e4m3 / e5m2) with
    ``q_scale``."""

    NONE = 0
    IN_PLACE = 1
    COPY = 2
    E4M3 = 3
    E5M2 = 4


class MlaKernel(enum.IntEnum):
    """The set_mla_kv_buffer copy module's kernel: AUTO is the measured choice; the others are forced
    (tests, the benchmark's per-kernel rows)."""

    AUTO = 0
    TMA = 1
    VECTOR = 2
    LATENCY = 3


class MlaFp8Kernel(enum.IntEnum):
    """The set_mla_kv_buffer fp8 module's kernel, as MlaKernel."""

    AUTO = 0
    SPLIT = 1
    ROW = 2
    GENERIC = 3
    LANES = 4


# A binding's "no scale given" (a Python-float scale is > 0) and "no skip slot" (slots < 0 are
# padding anyway).
MISSING_SCALE = -1.0
NO_SLOT = -1

# kv_cache_dtype names: the format each stores, and the torch dtype of a per-tensor fp8 format.
KV_FORMATS = {
    "auto": KvFormat.COPY,
    "fp8": KvFormat.E4M3,
    "fp8_e4m3": KvFormat.E4M3,
    "fp8_e5m2": KvFormat.E5M2,
    "fp8_ds_mla": KvFormat.DS_MLA,
}
FP8_DTYPES = {KvFormat.E4M3: torch.float8_e4m3fn, KvFormat.E5M2: torch.float8_e5m2}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SRC_DTYPES = {torch.bfloat16: SrcDtype.BF16, torch.float16: SrcDtype.F16, torch.float32: SrcDtype.F32}

# ------------------------------------------------------------------------------- record layouts


class DsMla:
    """vLLM's "fp8_ds_mla" MLA record (DeepSeek-V3.2 sparse MLA), 656 bytes per token: the 512 nope
    values as e4m3 in 4 tiles of 128, each tile's fp32 scale (amax / 448), then the 64 rope values as
    16-bit floats: ``[512 B e4m3 | 16 B fp32 scales | 128 B rope]``."""

    NOPE = 512
    ROPE = 64
    TILE = 128
    TILES = NOPE // TILE
    SCALE_OFFSET = NOPE
    ROPE_OFFSET = SCALE_OFFSET + 4 * TILES
    BYTES = ROPE_OFFSET + 2 * ROPE
    FP8_MAX = 448.0  # e4m3: a tile's scale is amax / FP8_MAX


class Dsv4:
    """The DeepSeek-V4 FP8 K cache record (docs/design.md §5), 584 bytes per token: 448 dims as e4m3,
    64 dims as bf16, then 8 bytes of UE8M0 scales (7 groups of 64 dims and a zero byte); a block
    holds all its tokens' data, then all their scales."""

    HEAD_DIM = 512
    NOPE = 448  # dims stored as e4m3, one UE8M0 scale per GROUP
    ROPE = 64  # dims stored as bf16
    GROUP = 64
    DATA_BYTES = NOPE + 2 * ROPE
    SCALE_BYTES = 8
    TOKEN_BYTES = DATA_BYTES + SCALE_BYTES


class Indexer:
    """The DeepSeek-V3.2 sparse-attention indexer K cache record (docs/design.md §5.1), 132 bytes per
    token: the 128-dim key as e4m3 and one fp32 scale (one quant block of 128 values); a block holds
    all its tokens' values, then all their scales."""

    HEAD_DIM = 128
    QUANT_BLOCK = 128
    SCALE_BYTES = 4
    TOKEN_BYTES = HEAD_DIM + SCALE_BYTES
    FP8_MAX = 448.0  # e4m3: scale = max(amax, AMAX_MIN) / FP8_MAX
    AMAX_MIN = 1e-4


class RopeNorm:
    """Which heads a rope_store_cache CUDA module norms (its JitSpec arg ``norms``, a sum of these bits;
    docs/design.md §9)."""

    Q = 1
    K = 2


# ------------------------------------------------------------------------ kernel launch constants


class Transfer:
    """transfer_pages' SM copy kernel (docs/design.md §2): the SMs it takes by default for a copy with a
    host pool (the link bounds it and a few SMs saturate the link; it must leave the forward pass its
    SMs). A copy inside the GPU takes every SM. Host ids go in a launch's parameter block (int32 pairs),
    the smallest that holds them: INLINE_PAIRS_SMALL pairs (512 bytes), INLINE_PAIRS_MID (8 KiB) or
    INLINE_PAIRS (31.25 KiB; CUDA takes 32,764 bytes), more in launches of INLINE_PAIRS (the host
    copies a block per launch: a 31.25 KiB one costs it microseconds more than a 512-byte one)."""

    LINK_SMS = 4
    INLINE_PAIRS_SMALL = 64
    INLINE_PAIRS_MID = 1024
    INLINE_PAIRS = 4000


_ENUMS = (KvFormat, SrcDtype, ScaleFmt, Status, RopeQ, MlaKernel, MlaFp8Kernel)
_RECORDS = (DsMla, Dsv4, Indexer, RopeNorm, Transfer)
# Constants whose C++ type is float (the kernels compute in fp32); every other record constant is an int.
_FLOATS = {"FP8_MAX", "AMAX_MIN"}

# --------------------------------------------------------------------------------- the header


def cpp_name(name: str) -> str:
    """``DS_MLA`` -> ``kDsMla``, ``ROPE_OFFSET`` -> ``kRopeOffset``; a word with a digit keeps its case
    (``E4M3`` -> ``kE4M3``, ``FP8_MAX`` -> ``kFP8Max``)."""
    return "k" + "".join(w if any(c.isdigit() for c in w) else w.capitalize() for w in name.split("_"))


def _float_literal(value: float) -> str:
    """The float32 nearest ``value`` as an exact hex literal (what ``constexpr float x = value;`` holds)."""
    mantissa, exponent = struct.unpack("f", struct.pack("f", value))[0].hex().split("p")
    return f"{mantissa.rstrip('0').rstrip('.')}p{exponent}f"


def _enum(cls) -> list[str]:
    values = ", ".join(f"{cpp_name(m.name)} = {int(m)}" for m in cls)
    return [f"enum class {cls.__name__} : int32_t {{ {values} }};"]


def _record(cls) -> list[str]:
    lines = [f"struct {cls.__name__} {{"]
    for name, value in vars(cls).items():
        if name.isupper():
            kind, text = ("float", _float_literal(value)) if name in _FLOATS else ("int", str(int(value)))
            lines.append(f"  static constexpr {kind} {cpp_name(name)} = {text};")
    return [*lines, "};"]


def header() -> str:
    """The text of ``jitkv/codes.h``."""
    lines = [
        "// Generated from jitkv/codes.py by jitkv.codes.header() for every JIT build; do not edit.",
        "#pragma once",
        "",
        "#include <cstdint>",
        "",
        "namespace jitkv {",
        "namespace codes {",
        "",
    ]
    for cls in _ENUMS:
        lines += _enum(cls)
    lines += ["", f"constexpr double kMissingScale = {MISSING_SCALE!r};", f"constexpr int64_t kNoSlot = {NO_SLOT};", ""]
    for cls in _RECORDS:
        lines += [*_record(cls), ""]
    return "\n".join([*lines, "}  // namespace codes", "}  // namespace jitkv", ""])
