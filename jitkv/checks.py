"""Argument checks every op family builds its own from (docs/design.md §3.8).

Each raises ``TypeError`` or ``ValueError`` whose message reads ``"<op>: <argument>: <what was
expected>, got <what>"``, naming the argument by its keyword, before any kernel runs. Dtypes are
spelled as torch's without the ``torch.`` prefix (``bfloat16``), as the C++ parsers print them.
The families' own rules (shapes of their records, their scale kinds) live with the families.
"""

from __future__ import annotations

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
COPY_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the C++ parsers' spelling)."""
    return str(dtype).removeprefix("torch.")


def dtype_names(dtypes) -> str:
    """``"bfloat16, float16 or float32"``."""
    names = [dtype_name(d) for d in dtypes]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def tensor(op, name, t):
    """``t`` if it is a torch.Tensor on a device jitkv runs on, else TypeError / ValueError."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name}: expected a torch.Tensor, got {type(t).__name__}")
    if not (t.is_cpu or t.is_cuda):
        raise unsupported_device(op, name, t)
    return t


def optional_tensor(op, name, t):
    return None if t is None else tensor(op, name, t)


def unsupported_device(op, name, t):
    """The ValueError for a tensor on a device jitkv does not run on (meta included)."""
    return ValueError(f"{op}: {name}: expected a CPU or CUDA tensor, got one on {t.device}")


def integer(op, name, value, *, minimum=None):
    """An int (not a bool), at least ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{op}: {name}: expected an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{op}: {name}: expected an int >= {minimum}, got {value}")
    return value


def skip_slot(op, value):
    """None or an int."""
    return None if value is None else integer(op, "skip_slot", value)


def choice(op, name, value, allowed):
    """One of ``allowed`` (a str option such as kv_cache_dtype)."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{op}: {name}: expected one of {', '.join(map(str, allowed))}, got {value!r}")
    return value


def dtype(op, name, t, allowed, what=""):
    """``t.dtype`` in ``allowed`` (TypeError naming them otherwise); ``what`` says why, e.g. " (the
    dtype of k)"."""
    if t.dtype not in allowed:
        raise TypeError(f"{op}: {name}: expected dtype {dtype_names(allowed)}{what}, got {dtype_name(t.dtype)}")


def index(op, name, t, device, dest_name):
    """A 1-D dense int32/int64 tensor on ``device``, the device of ``dest_name``."""
    tensor(op, name, t)
    dtype(op, name, t, INDEX_DTYPES)
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
    dtype(op, name, t, (want,), f" (the dtype of {want_from})")


def last_dim_contiguous(op, name, t):
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{op}: {name}: innermost dim must be contiguous (stride 1), got stride {t.stride(-1)}")


def rows_at_least(op, name, t, n, index_name):
    if t.shape[0] < n:
        raise ValueError(f"{op}: {name}: expected at least {n} rows ({index_name}.numel()), got {t.shape[0]}")


def written(op, name, t):
    """A destination whose elements are distinct memory: no stride 0 in a dim of size > 1 (an
    ``expand()``ed cache would make every slot one row). The C++ parsers check the same
    (jitkv/check.h check_written)."""
    for d in range(t.dim()):
        if t.stride(d) == 0 and t.shape[d] > 1:
            raise ValueError(
                f"{op}: {name}: dim {d} of size {t.shape[d]} has stride 0: its rows would alias "
                "(an expand()ed view?); expected a tensor whose elements are distinct memory"
            )


def disjoint(op, name, t, other_name, other):
    """Two destinations that share no byte (``k_cache is v_cache`` would write V over K)."""
    if t.untyped_storage().data_ptr() != other.untyped_storage().data_ptr() or not _extents_meet(t, other):
        return
    if t.dtype == other.dtype and t.shape == other.shape and t.stride() == other.stride():
        if not _offset_reachable(t, other.storage_offset() - t.storage_offset()):
            return  # e.g. the K and V halves of one [num_blocks, 2, ...] allocation
    raise ValueError(f"{op}: {name}: shares memory with {other_name}; expected two separate caches")


def _extents_meet(a, b) -> bool:
    """Whether the byte ranges spanned by ``a`` and ``b`` intersect."""

    def extent(t):
        lo = hi = t.data_ptr()
        for size, stride in zip(t.shape, t.stride()):
            if size == 0:
                return 0, 0
            span = (size - 1) * stride * t.element_size()
            lo, hi = (lo + span, hi) if span < 0 else (lo, hi + span)
        return lo, hi + t.element_size()

    (a_lo, a_hi), (b_lo, b_hi) = extent(a), extent(b)
    return a_lo < b_hi and b_lo < a_hi


def _offset_reachable(t, delta) -> bool:
    """Whether two views of ``t``'s shape and strides whose offsets differ by ``delta`` elements share an
    element: ``delta = sum(c_d * stride_d)`` with ``|c_d| < size_d``. Exact where each stride exceeds
    the span of the smaller ones (every layout jitkv takes); any other layout counts as sharing."""
    dims = sorted((abs(st), sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    span = 0
    for stride, size in dims:
        if stride <= span:
            return True
        span += (size - 1) * stride
    return _reach(delta, dims)


def _reach(delta, dims) -> bool:
    if not dims:
        return delta == 0
    (stride, size), rest = dims[-1], dims[:-1]
    span = sum((sz - 1) * st for st, sz in rest)
    return any(
        abs(c) < size and abs(delta - c * stride) <= span and _reach(delta - c * stride, rest)
        for c in {delta // stride, -(-delta // stride)}
    )


# Python floats the kernels' float32 rounding keeps finite and > 0 (as the C++ bindings check it).
_F32_ROUNDS_TO_ZERO = 2.0**-150
_F32_ROUNDS_TO_INF = 2.0**128 - 2.0**103


def scale_value(op, name, scale):
    """A Python-number scale (int or float, not a bool or a str), finite and > 0 as float32: there is
    no silent 1.0."""
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"{op}: {name}: expected a float or a float32 tensor, got {type(scale).__name__}")
    s = float(scale)
    if not (_F32_ROUNDS_TO_ZERO < s < _F32_ROUNDS_TO_INF):  # NaN compares false
        raise ValueError(f"{op}: {name}: must be finite and > 0, got {scale!r}")
    return s


def scale_tensor_value(op, name, s):
    """Read a float32 scale tensor on the host: every value finite and > 0, else ValueError (naming
    ``name[i]`` for several scales). On CUDA this syncs, so callers do it only under JITKV_DEBUG=1,
    and it refuses (RuntimeError, before any CUDA work) during CUDA-graph capture."""
    if s.dtype != torch.float32:
        return
    if s.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{op}: JITKV_DEBUG=1 reads {name} on the host, which CUDA-graph capture does not "
            "allow; capture without JITKV_DEBUG"
        )
    if s.numel() == 1:
        scale_value(op, name, s.item())
        return
    for i, value in enumerate(s.reshape(-1).tolist()):
        scale_value(op, f"{name}[{i}]", value)


def scale(op, name, s, device, dest_name, *, heads=None):
    """A Python-number scale (checked), or a float32 tensor on ``device`` of 1 element or, where the op
    takes per-head scales (``heads``), of shape ``[heads]``; a CPU tensor's values are checked here, a
    CUDA tensor's only by ``scale_tensor_value`` under JITKV_DEBUG=1 (it syncs)."""
    if s is None:
        raise ValueError(f"{op}: {name}: required for an fp8 kv_cache_dtype (no default scale)")
    if not isinstance(s, torch.Tensor):
        return scale_value(op, name, s)
    tensor(op, name, s)
    if s.dtype != torch.float32:
        raise TypeError(f"{op}: {name}: expected a float32 tensor, got {dtype_name(s.dtype)}")
    if heads is not None and s.numel() != 1 and not (s.dim() == 1 and s.shape[0] == heads):
        raise ValueError(
            f"{op}: {name}: expected a 1-element tensor or [num_heads] = [{heads}] per-head "
            f"scales, got shape {list(s.shape)}"
        )
    if heads is None and s.numel() != 1:
        raise ValueError(f"{op}: {name}: expected a 1-element tensor, got {s.numel()} elements")
    same_device(op, name, s, device, dest_name)
    if s.is_cpu:
        scale_tensor_value(op, name, s)
    return s
