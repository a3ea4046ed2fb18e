"""Argument checks for the Python backends (triton, torch).

The jit backend runs the same rules in C++ (each family's argument parser: ``parse_params`` in
``csrc/mla/set_mla_kv_buffer.cuh``, the store_cache parser, the checks of ``csrc/dsv4/dsv4_cuda.cu``),
once per call, so its eager path makes no Python-side shape checks (C++ checks cost a fraction of a
microsecond where these cost microseconds); the tests run every bad input through every backend and expect the same
exception type and argument name. Checks C++ cannot make, or that only Python makes, run here for
the jit backend too: a tensor's device type (``unsupported_device``), a CPU scale tensor's value
(``scale_tensor_value``) and the DSv4 cache layout's semantics (``DSV4_K_CACHE.validate``).
Messages read ``"<op>: <argument>: <what was expected>, got <what>"``."""

from __future__ import annotations

import math

import torch

from ..layouts import DS_MLA_NOPE, DS_MLA_RECORD_BYTES, DS_MLA_ROPE, DS_MLA_TILE

INDEX_DTYPES = (torch.int32, torch.int64)
COPY_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)
FP8_SRC_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_CACHE = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPES = ("auto", *FP8_CACHE)


def tensor(op, name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def unsupported_device(op, name, t):
    """The ValueError for a tensor on a device jitkv does not run on (meta included)."""
    return ValueError(f"{op}: {name}: expected a CPU or CUDA tensor, got one on {t.device}")


def index(op, name, t, device, dest_name):
    tensor(op, name, t)
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{op}: {name}: expected dtype int32 or int64, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{op}: {name}: expected a 1-D tensor, got shape {list(t.shape)}")
    if t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(f"{op}: {name}: expected a contiguous tensor, got stride {t.stride(0)}")
    same_device(op, name, t, device, dest_name)
    return t


def same_device(op, name, t, device, dest_name):
    """``t`` on ``device``, the device of the destination ``dest_name``."""
    if t.device != device:
        raise ValueError(f"{op}: {name}: expected a tensor on {device} like {dest_name}, got one on {t.device}")


def same_dtype(op, name, t, want, want_from):
    if t.dtype != want:
        raise TypeError(f"{op}: {name}: expected dtype {want} (the dtype of {want_from}), got {t.dtype}")


def last_dim_contiguous(op, name, t):
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{op}: {name}: innermost dim must be contiguous (stride 1), got stride {t.stride(-1)}")


def rows_at_least(op, name, t, n, index_name):
    if t.shape[0] < n:
        raise ValueError(f"{op}: {name}: has {t.shape[0]} rows, fewer than {index_name}.numel() = {n}")


# Python floats the kernels' float32 rounding keeps finite and > 0 (as the C++ bindings check it).
_F32_ROUNDS_TO_ZERO = 2.0**-150
_F32_ROUNDS_TO_INF = 2.0**128 - 2.0**103


def scale_value(op, name, scale):
    """A Python-float scale must be finite and > 0 as float32 (there is no silent 1.0)."""
    s = float(scale)
    if not (_F32_ROUNDS_TO_ZERO < s < _F32_ROUNDS_TO_INF):  # NaN compares false
        raise ValueError(f"{op}: {name}: must be finite and > 0, got {scale!r}")
    return s


def scale_tensor_value(op, name, s):
    """Read a float32 scale tensor on the host: every value finite and > 0, else ValueError (naming
    ``name[i]`` for per-head scales; other dtypes are left to the structural checks). On CUDA this
    syncs, so callers do it only under JITKV_DEBUG=1, and it refuses (RuntimeError, before any CUDA
    work) during CUDA-graph capture."""
    if s.dtype != torch.float32:
        return
    if s.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{op}: JITKV_DEBUG=1 reads {name} on the host, which CUDA-graph capture does not "
                           "allow; capture without JITKV_DEBUG")
    if s.numel() == 1:
        scale_value(op, name, s.item())
        return
    for i, value in enumerate(s.reshape(-1).tolist()):
        scale_value(op, f"{name}[{i}]", value)


def scale(op, name, s, device, dest_name, debug=False, heads=None):
    """A Python-float scale (checked), or a float32 tensor on ``device`` of 1 element or, where the op
    takes per-head scales (``heads``), of shape ``[heads]``, whose values are checked on CPU, and on
    CUDA only with ``debug`` (JITKV_DEBUG=1: it syncs)."""
    if s is None:
        raise ValueError(f"{op}: {name}: required for an fp8 kv_cache_dtype (no default scale)")
    if isinstance(s, torch.Tensor):
        if s.dtype != torch.float32:
            raise TypeError(f"{op}: {name}: expected a float32 tensor, got {s.dtype}")
        if heads is not None and s.numel() != 1 and not (s.dim() == 1 and s.shape[0] == heads):
            raise ValueError(f"{op}: {name}: expected a 1-element tensor or [num_heads] = [{heads}] per-head "
                             f"scales, got shape {list(s.shape)}")
        if heads is None and s.numel() != 1:
            raise ValueError(f"{op}: {name}: expected a 1-element tensor, got {s.numel()} elements")
        same_device(op, name, s, device, dest_name)
        if s.is_cpu or debug:
            scale_tensor_value(op, name, s)
        return s
    if isinstance(s, (int, float)):
        return scale_value(op, name, s)
    raise TypeError(f"{op}: {name}: expected a float or a 1-element float32 tensor, got {type(s).__name__}")


# --------------------------------------------------------------------------------------------- MLA


def _row_view(op, name, t, width_name):
    """[S, W] or [S, 1, W] -> the 2-D [S, W] view."""
    if t.dim() == 3 and t.shape[1] == 1:
        t = t.select(1, 0)
    elif t.dim() != 2:
        raise ValueError(f"{op}: {name}: expected shape [rows, {width_name}] or [rows, 1, {width_name}], got {list(t.shape)}")
    last_dim_contiguous(op, name, t)
    return t


def mla(kv_buffer, loc, k_nope, k_rope):
    """Validate set_mla_kv_buffer arguments; return 2-D views (kv_buffer, k_nope, k_rope)."""
    op = "set_mla_kv_buffer"
    for name, t in (("kv_buffer", kv_buffer), ("k_nope", k_nope), ("k_rope", k_rope)):
        tensor(op, name, t)
    if kv_buffer.dtype not in COPY_DTYPES:
        raise TypeError(f"{op}: kv_buffer: expected dtype bf16, fp16, fp32, uint8 or float8, got {kv_buffer.dtype}")
    for name, t in (("k_nope", k_nope), ("k_rope", k_rope)):
        same_dtype(op, name, t, kv_buffer.dtype, "kv_buffer")
    buf, nope, rope = _mla_rows(op, kv_buffer, loc, k_nope, k_rope)
    if buf.shape[1] < nope.shape[1] + rope.shape[1]:
        raise ValueError(
            f"{op}: kv_buffer: row width {buf.shape[1]} is smaller than nope + rope = {nope.shape[1]} + {rope.shape[1]}"
        )
    return buf, nope, rope


def _mla_rows(op, kv_buffer, loc, k_nope, k_rope):
    """The checks every set_mla_kv_buffer format shares, after the dtypes: loc, one device, 2-D row
    views, at least loc.numel() source rows. Returns the views (kv_buffer, k_nope, k_rope)."""
    dev = kv_buffer.device
    index(op, "loc", loc, dev, "kv_buffer")
    for name, t in (("k_nope", k_nope), ("k_rope", k_rope)):
        same_device(op, name, t, dev, "kv_buffer")
    buf = _row_view(op, "kv_buffer", kv_buffer, "W")
    nope = _row_view(op, "k_nope", k_nope, "nope")
    rope = _row_view(op, "k_rope", k_rope, "rope")
    n = loc.numel()
    rows_at_least(op, "k_nope", nope, n, "loc")
    rows_at_least(op, "k_rope", rope, n, "loc")
    return buf, nope, rope


MLA_FP8_SRC_DTYPES = (torch.bfloat16, torch.float16)


def no_ds_mla_scale(op, scale):
    if scale is not None:
        raise ValueError(f"{op}: scale: kv_cache_dtype=\"fp8_ds_mla\" computes one scale per {DS_MLA_TILE}-value "
                         f"tile; expected None, got {type(scale).__name__}")


def mla_fp8(kv_buffer, loc, k_nope, k_rope, kv_cache_dtype, scale_arg, debug=False):
    """Validate set_mla_kv_buffer arguments for an fp8 kv_cache_dtype (a known name); return 2-D views
    (kv_buffer, k_nope, k_rope) and the scale (None for fp8_ds_mla). ``debug`` as for ``scale``."""
    op = "set_mla_kv_buffer"
    for name, t in (("kv_buffer", kv_buffer), ("k_nope", k_nope), ("k_rope", k_rope)):
        tensor(op, name, t)
    if k_nope.dtype not in MLA_FP8_SRC_DTYPES:
        raise TypeError(f"{op}: k_nope: fp8 quantize-on-write takes bfloat16 or float16 sources, got {k_nope.dtype}")
    same_dtype(op, "k_rope", k_rope, k_nope.dtype, "k_nope")
    ds = kv_cache_dtype == "fp8_ds_mla"
    allowed = (torch.uint8,) if ds else (torch.uint8, FP8_CACHE[kv_cache_dtype])
    if kv_buffer.dtype not in allowed:
        raise ValueError(f"{op}: kv_buffer: kv_cache_dtype={kv_cache_dtype!r} writes a "
                         f"{' or '.join(str(d) for d in allowed)} buffer, got {kv_buffer.dtype}")
    buf, nope, rope = _mla_rows(op, kv_buffer, loc, k_nope, k_rope)
    if ds:
        for name, t, want in (("k_nope", nope, DS_MLA_NOPE), ("k_rope", rope, DS_MLA_ROPE)):
            if t.shape[1] != want:
                raise ValueError(f"{op}: {name}: fp8_ds_mla takes rows of {want} values, got {t.shape[1]}")
        if buf.shape[1] < DS_MLA_RECORD_BYTES:
            raise ValueError(f"{op}: kv_buffer: row width {buf.shape[1]} is smaller than the {DS_MLA_RECORD_BYTES}-byte "
                             "fp8_ds_mla record")
        no_ds_mla_scale(op, scale_arg)
        return buf, nope, rope, None
    if buf.shape[1] < nope.shape[1] + rope.shape[1]:
        raise ValueError(
            f"{op}: kv_buffer: row width {buf.shape[1]} is smaller than nope + rope = {nope.shape[1]} + {rope.shape[1]}"
        )
    return buf, nope, rope, scale(op, "scale", scale_arg, kv_buffer.device, "kv_buffer", debug)


# --------------------------------------------------------------------------------------- store_cache


def store_cache(k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, loc_map, debug=False):
    """Validate store_cache arguments; return (k, v, k_cache, v_cache) as [n', H, D] sources and
    [num_blocks, block_size, H, D] caches (flat caches get block_size 1), plus the parsed scales.
    ``debug`` (JITKV_DEBUG=1) also reads CUDA scale tensors on the host (see ``scale``)."""
    op = "store_cache"
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        tensor(op, name, t)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"{op}: kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    dev = k_cache.device
    index(op, "slot_mapping", slot_mapping, dev, "k_cache")
    if loc_map is not None:
        index(op, "loc_map", loc_map, dev, "k_cache")
    n = slot_mapping.numel()
    if v.dtype != k.dtype:
        raise TypeError(f"{op}: v: expected dtype {k.dtype} (the dtype of k), got {v.dtype}")
    h = _num_heads(op, (("k", k), ("k_cache", k_cache), ("v", v), ("v_cache", v_cache)))
    views = []
    for src_name, src, cache_name, cache in (("k", k, "k_cache", k_cache), ("v", v, "v_cache", v_cache)):
        same_device(op, src_name, src, dev, "k_cache")
        same_device(op, cache_name, cache, dev, "k_cache")
        _dtypes(op, src_name, src, cache_name, cache, kv_cache_dtype)
        views.append(_pair_views(op, src_name, src, cache_name, cache, n, h))
    (kv, kcv), (vv, vcv) = views
    scales = (None, None)
    if kv_cache_dtype != "auto":
        scales = (scale(op, "k_scale", k_scale, dev, "k_cache", debug, heads=h),
                  scale(op, "v_scale", v_scale, dev, "k_cache", debug, heads=h))
    return kv, vv, kcv, vcv, scales


def _num_heads(op, named):
    """H from every tensor that has a head dim (3-D sources, 3-D/4-D caches); they must agree."""
    h, first = None, None
    for name, t in named:
        has_heads = t.dim() == 3 or (t.dim() == 4 and name.endswith("cache"))
        if has_heads:
            if h is None:
                h, first = t.shape[-2], name
            elif t.shape[-2] != h:
                raise ValueError(f"{op}: {name}: expected {h} heads like {first}, got {t.shape[-2]}")
    return 1 if h is None else h


def _dtypes(op, src_name, src, cache_name, cache, kv_cache_dtype):
    if kv_cache_dtype == "auto":
        if src.dtype not in COPY_DTYPES:
            raise TypeError(f"{op}: {src_name}: expected dtype bf16, fp16, fp32, uint8 or float8, got {src.dtype}")
        same_dtype(op, cache_name, cache, src.dtype, src_name + " (kv_cache_dtype='auto' copies)")
        return
    want = FP8_CACHE[kv_cache_dtype]
    if src.dtype not in FP8_SRC_DTYPES:
        raise TypeError(f"{op}: {src_name}: fp8 quantize-on-write takes bf16, fp16 or fp32 sources, got {src.dtype}")
    if cache.dtype in FP8_CACHE.values() and cache.dtype != want:
        raise ValueError(f"{op}: {cache_name}: dtype {cache.dtype} does not match kv_cache_dtype={kv_cache_dtype!r}")
    if cache.dtype not in (want, torch.uint8):
        raise ValueError(
            f"{op}: kv_cache_dtype: {kv_cache_dtype!r} needs a {want} or uint8 {cache_name}, got {cache.dtype}"
        )


def _pair_views(op, src_name, src, cache_name, cache, n, h):
    """Bring a (source, cache) pair to [n', H, D] and [num_blocks, block_size, H, D] views."""
    if src.dim() not in (2, 3):
        raise ValueError(f"{op}: {src_name}: expected shape [tokens, H, D] or [tokens, H*D], got {list(src.shape)}")
    if cache.dim() not in (2, 3, 4):
        raise ValueError(
            f"{op}: {cache_name}: expected shape [slots, H, D], [slots, H*D] or [num_blocks, block_size, H, D], "
            f"got {list(cache.shape)}"
        )
    last_dim_contiguous(op, src_name, src)
    last_dim_contiguous(op, cache_name, cache)
    rows_at_least(op, src_name, src, n, "slot_mapping")
    src_row = math.prod(src.shape[1:])
    cache_row = math.prod(cache.shape[-2:]) if cache.dim() >= 3 else cache.shape[1]
    if src_row != cache_row or src_row % h:
        raise ValueError(
            f"{op}: {cache_name}: row of {cache_row} elements does not match {src_name}'s {src_row} "
            f"({h} heads)"
        )
    d = src_row // h
    src_v = src if src.dim() == 3 else src.view(src.shape[0], h, d)
    if cache.dim() == 4:
        cache_v = cache
    elif cache.dim() == 3:
        cache_v = cache.unsqueeze(1)
    else:
        cache_v = cache.view(cache.shape[0], 1, h, d)
    return src_v, cache_v


# ---------------------------------------------------------------------------------------- mla_gather

# kv_cache_dtype of gather_mla_cache: the per-tensor fp8 formats, plus vLLM's 656-byte fp8_ds_mla record.
GATHER_CACHE_DTYPES = ("auto", *FP8_CACHE, "fp8_ds_mla")


def mla_gather(out, kv_cache, block_table, cu_seq_lens, seq_starts, kv_cache_dtype, scale_, debug=False):
    """Validate gather_mla_cache arguments (the checks of csrc/mla_gather/gather_mla_cache.cuh, in its
    order); returns the parsed scale (None unless a per-tensor fp8 format)."""
    op = "gather_mla_cache"
    for name, t in (("out", out), ("kv_cache", kv_cache), ("block_table", block_table), ("cu_seq_lens", cu_seq_lens)):
        tensor(op, name, t)
    if kv_cache_dtype not in GATHER_CACHE_DTYPES:
        raise ValueError(f"{op}: kv_cache_dtype: expected one of {', '.join(GATHER_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    dev = out.device
    same_device(op, "kv_cache", kv_cache, dev, "out")
    index(op, "cu_seq_lens", cu_seq_lens, dev, "out")
    if seq_starts is not None:
        index(op, "seq_starts", seq_starts, dev, "out")
    same_device(op, "block_table", block_table, dev, "out")
    _gather_dtypes(op, out, kv_cache, kv_cache_dtype)
    if kv_cache.dim() != 3:
        raise ValueError(f"{op}: kv_cache: expected shape [num_blocks, block_size, W], got {list(kv_cache.shape)}")
    last_dim_contiguous(op, "kv_cache", kv_cache)
    if out.dim() != 2:
        raise ValueError(f"{op}: out: expected shape [total_tokens, D], got {list(out.shape)}")
    last_dim_contiguous(op, "out", out)
    _gather_widths(op, out.shape[1], kv_cache.shape[2], kv_cache_dtype)
    num_reqs = cu_seq_lens.numel() - 1
    if num_reqs < 0:
        raise ValueError(f"{op}: cu_seq_lens: expected num_reqs + 1 >= 1 entries, got 0")
    if block_table.dtype not in INDEX_DTYPES:
        raise TypeError(f"{op}: block_table: expected dtype int32 or int64, got {block_table.dtype}")
    if block_table.dim() != 2:
        raise ValueError(f"{op}: block_table: expected shape [num_reqs, max_blocks], got {list(block_table.shape)}")
    last_dim_contiguous(op, "block_table", block_table)
    for name, t in (("block_table", block_table), ("seq_starts", seq_starts)):
        if t is not None and t.shape[0] < num_reqs:
            raise ValueError(f"{op}: {name}: expected at least {num_reqs} rows (cu_seq_lens.numel() - 1), got {t.shape[0]}")
    if kv_cache_dtype in FP8_CACHE:
        return scale(op, "scale", scale_, dev, "out", debug)
    return None


def _gather_dtypes(op, out, kv_cache, kv_cache_dtype):
    if kv_cache_dtype == "auto":
        if kv_cache.dtype not in COPY_DTYPES:
            raise TypeError(f"{op}: kv_cache: expected dtype bf16, fp16, fp32, uint8 or float8, got {kv_cache.dtype}")
        same_dtype(op, "out", out, kv_cache.dtype, "kv_cache (kv_cache_dtype='auto' copies)")
        return
    want = FP8_CACHE.get(kv_cache_dtype)
    if kv_cache.dtype not in (want, torch.uint8):
        need = "a uint8" if want is None else f"a {want} or uint8"
        raise ValueError(f"{op}: kv_cache_dtype: {kv_cache_dtype!r} needs {need} kv_cache, got {kv_cache.dtype}")
    if out.dtype != torch.bfloat16:
        raise TypeError(f"{op}: out: expected dtype torch.bfloat16 (kv_cache_dtype={kv_cache_dtype!r} dequantizes to "
                        f"bf16), got {out.dtype}")


def _gather_widths(op, d, w, kv_cache_dtype):
    """Output row width d against the cache entry width w."""
    if kv_cache_dtype == "fp8_ds_mla":
        if w != DS_MLA_RECORD_BYTES:
            raise ValueError(f"{op}: kv_cache: expected entries of {DS_MLA_RECORD_BYTES} bytes (the fp8_ds_mla record), got {w}")
        want = DS_MLA_NOPE + DS_MLA_ROPE
    else:
        want = w
    if d != want:
        raise ValueError(f"{op}: out: expected rows of {want} elements (kv_cache's entries), got {d}")
