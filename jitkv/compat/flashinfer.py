"""FlashInfer's paged-cache append and fused RoPE + FP8 + append on jitkv: ``append_paged_kv_cache``,
``append_paged_mla_kv_cache`` and ``rope_quantize_fp8_append_paged_kv_cache``.

Same names, argument order and results as ``flashinfer.page`` and ``flashinfer.rope`` (flashinfer-python
0.7.2.post1), run on ``jitkv.store_cache`` / ``jitkv.rope_store_cache``.

FlashInfer's page table: token i of the batch belongs to request ``b = batch_indices[i]`` (b < 0: a
padding token, not written) at ``positions[i]`` of it; its page is ``kv_indices[kv_indptr[b] +
positions[i] // page_size]``, its row ``positions[i] % page_size`` (csrc/include/jitkv/page_table.h).
On CUDA each shim is one launch: a build of store_cache's kernels (16-byte heads), of
rope_store_cache's (up to 8,192 tokens) or of rope_set_mla_kv_buffer's (the MLA form) that walks the
table itself (prebuilt for head_dim 128 bf16 copies, bf16 -> e4m3 RoPE and DeepSeek's 512 + 64 e4m3 MLA
rows; other shapes build on first call, outside graph capture). Otherwise the
shims turn the table into jitkv's slots (``page * page_size + row``) on the indices' device, with no
host sync (graph-safe), then write: on CUDA by one kernel (csrc/compat/page_slots_cuda.cu, built on
first call like every jitkv module and prebuilt with them), elsewhere, or where that module cannot be
built (one warning says why), by a dozen torch index ops that give the same slots. A request past
``kv_indptr`` or a page past ``kv_indices`` is clamped into it (FlashInfer reads past the table;
nothing of jitkv writes outside the caches).

FlashInfer's FP8 scales multiply: stored = fp8(satfinite(x * quant_scale)). jitkv divides (docs/design.md
§4), so the shims pass ``1 / quant_scale``: the bytes are FlashInfer's whenever quant_scale is a power of
two (1.0 included); otherwise x / fp32(1 / quant_scale) can differ from x * quant_scale in the last bit
of the float32 quotient, which changes an fp8 code only where that bit decides a rounding tie.
"""

from __future__ import annotations

import operator

import torch

from .. import checks, rope_set_mla_kv_buffer, rope_store_cache, store_cache
from .._warn import warn
from ..jit import CaptureBuildError, JitUnavailable
from ..ops import rope
from ..ops import store_cache as store_cache_op
from ..ops._op import RESET_HOOKS, BackendUnavailable, debug_checks, forced_backend

__all__ = [
    "append_paged_kv_cache",
    "append_paged_mla_kv_cache",
    "page_slots",
    "rope_quantize_fp8_append_paged_kv_cache",
]

LAYOUTS = ("NHD", "HND")
_FORMATS = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def page_slots(batch_indices, positions, kv_indices, kv_indptr, page_size):
    """jitkv slots ``[n]`` (int64; -1 for padding tokens) of FlashInfer's page-table indexing (the
    module docstring), computed on the indices' device without a host sync.

    Args:
        batch_indices, positions: ``[n]`` integer tensors (FlashInfer's int32, or int64).
        kv_indices ``[m]``, kv_indptr ``[requests + 1]``: integer tensors on the same device.
        page_size: rows per page, a positive int.

    Raises:
        TypeError: an index that is not an integer tensor, a page_size that is not an int.
        ValueError: an index that is not 1-D, positions of another length than batch_indices, an empty
        kv_indptr, page_size < 1, indices on different devices.
    """
    page_size = _check_page_table(batch_indices, positions, kv_indices, kv_indptr, page_size)
    return _page_slots(batch_indices, positions, kv_indices, kv_indptr, page_size)


def _page_slots(batch_indices, positions, kv_indices, kv_indptr, page_size):
    """page_slots of a checked table (page_size an int)."""
    fn = _page_slots_kernel(batch_indices.device) if batch_indices.is_cuda else None
    if fn is not None:
        slots = torch.empty(batch_indices.shape[0], dtype=torch.int64, device=batch_indices.device)
        fn(*(_int32_or_64(t) for t in (batch_indices, positions, kv_indices, kv_indptr)), slots, page_size)
        return slots
    return page_slots_torch(batch_indices, positions, kv_indices, kv_indptr, page_size)


def page_slots_torch(batch_indices, positions, kv_indices, kv_indptr, page_size):
    """``page_slots`` by torch index ops on the indices' device (unchecked): its form off CUDA, and the
    reference of its kernel."""
    b, pos = batch_indices.long(), positions.long()
    if kv_indices.numel() == 0:
        return torch.full_like(b, -1)
    entry = kv_indptr.long().index_select(0, b.clamp(0, kv_indptr.numel() - 1)) + torch.div(
        pos, page_size, rounding_mode="floor"
    )
    page = kv_indices.long().index_select(0, entry.clamp(0, kv_indices.numel() - 1))
    return torch.where(b >= 0, page * page_size + pos.remainder(page_size), -1)


def _check_page_table(batch_indices, positions, kv_indices, kv_indptr, page_size) -> int:
    """Raises page_slots' errors; returns page_size as an int (any integer type is taken)."""
    device = None  # batch_indices', checked first
    for name, t in (
        ("batch_indices", batch_indices),
        ("positions", positions),
        ("kv_indices", kv_indices),
        ("kv_indptr", kv_indptr),
    ):
        if not isinstance(t, torch.Tensor) or t.dtype not in _INTEGER_DTYPES:
            raise TypeError(f"page_slots: {name}: expected an integer tensor, got {_kind(t)}")
        if t.dim() != 1:
            raise ValueError(f"page_slots: {name}: expected a 1-D tensor, got shape {list(t.shape)}")
        if device is None:
            device = t.device
        else:
            checks.same_device("page_slots", name, t, device, "batch_indices")
    if positions.shape[0] != batch_indices.shape[0]:
        raise ValueError(
            f"page_slots: positions: expected {batch_indices.shape[0]} entries (batch_indices'), "
            f"got {positions.shape[0]}"
        )
    if kv_indptr.numel() == 0:
        raise ValueError("page_slots: kv_indptr: expected at least 1 entry, got 0")
    if isinstance(page_size, bool) or not hasattr(page_size, "__index__"):
        raise TypeError(f"page_slots: page_size: expected an int, got {type(page_size).__name__}")
    page_size = operator.index(page_size)
    if page_size < 1:
        raise ValueError(f"page_slots: page_size: expected >= 1, got {page_size}")
    return page_size


# The integer dtypes an index may have (the page table is checked on every call: a set lookup is cheap).
_INTEGER_DTYPES = frozenset(
    (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64)
)


def _kind(t):
    """What a non-integer index is: its dtype, spelled as jitkv.checks spells dtypes, or its type."""
    return f"dtype {checks.dtype_name(t.dtype)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _int32_or_64(t):
    """t as the kernel reads it: contiguous int32 or int64."""
    return (t if t.dtype in (torch.int32, torch.int64) else t.long()).contiguous()


_KERNELS: dict = {}  # CUDA device index -> the page_slots function, or None where it cannot be built


def page_slots_spec(arch: str):
    """The CUDA module of ``page_slots`` for a CUDA arch (prebuilt with the ops' modules)."""
    from ..jit import JitSpec

    return JitSpec("page_slots_cuda", ("compat/page_slots_cuda.cu",), target=arch, exports=("page_slots",))


def _page_slots_kernel(device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _KERNELS:
        from ..jit import JitUnavailable, cuda_arch, get_function

        try:
            _KERNELS[index] = get_function(page_slots_spec(cuda_arch(device)), "page_slots")
        except JitUnavailable as e:
            _KERNELS[index] = None
            warn(f"jitkv.compat.flashinfer: the page_slots kernel is unavailable ({e}); torch index ops make the slots")
    return _KERNELS[index]


_TABLE_BUILDS: dict = {}  # (op name, CUDA device index, variant fields) -> its page-table build's runner, or None
RESET_HOOKS.append(_TABLE_BUILDS.clear)  # decided once, as the ops decide their backends: jitkv.ops.reset()
# Above this many tokens each K/V thread's walk of the table costs more than page_slots' launch: on an H200
# the one launch against the two, FlashInfer's case (docs/performance.md "FlashInfer page slots"), measured
# 0.95x at n = 4096, 0.99x at 8192 and 1.01x at 16384. Re-measure: both forms at those n.
_PAGED_MAX_TOKENS = 8192
_INT32_MAX = 2**31 - 1  # the largest page size the kernels' 32-bit page division takes
# What a page-table build's variant or binding raises for a call it refuses (_table_call).
_REFUSALS = (AttributeError, IndexError, KeyError, TypeError, ValueError, RuntimeError)
_MLA = rope.ROPE_SET_MLA_KV_BUFFER
# The ops' argument names in schema order (the public functions take most of them by keyword only).
_NAMES = {op.name: tuple(p.name for p in op.params) for op in (rope.ROPE_STORE_CACHE, _MLA)}


def _rope_store(
    table, q, k, v, k_cache, v_cache, pos_ids, cos_sin_cache, is_neox, rotary_dim, q_out, fmt, q_scale, kv_scale
):
    """rope_store_cache (into q_out, fp8 caches of format ``fmt``) at the slots of FlashInfer's page
    table ``table`` (_on_table; its page-table build up to _PAGED_MAX_TOKENS tokens)."""
    args = (q, k, v, k_cache, v_cache, table[0], pos_ids, cos_sin_cache, is_neox, rotary_dim, None, None, 1e-6)
    args += (q_out, q_scale, None, fmt, kv_scale, kv_scale, None, None)
    _on_table(rope.ROPE_STORE_CACHE, rope.paged_runner, rope_store_cache, 5, table, args, _PAGED_MAX_TOKENS)


def _on_table(op, make, fn, slot_at, table, args, max_tokens=None, more=()):
    """``fn``, op's public function, at the slots of FlashInfer's page table ``table`` = (batch_indices,
    positions, kv_indices, kv_indptr, page_size): ``args`` are op's arguments in schema order, the table's
    batch_indices at ``slot_at``, its slot index. On CUDA one launch where _table_ran runs op's build that
    reads the table itself; else page_slots' slots, then fn."""
    if not _table_ran(op, make, slot_at, table, args, max_tokens, more):
        head, tail = args[:slot_at], args[slot_at + 1 :]
        fn(**dict(zip(_NAMES[op.name], (*head, _page_slots(*table[:4], _check_page_table(*table)), *tail))))


def _table_ran(op, make, slot_at, table, args, max_tokens=None, more=(), checked=None) -> bool:
    """Whether op's build that reads FlashInfer's page table itself (``make``: ops/rope.py paged_runner,
    mla_paged_runner) ran op's arguments ``args`` (_on_table's; ``more``: the build's arguments after the
    table; ``checked``: makes the arguments op's check takes in their place, None: args): wherever the op would
    run its CUDA kernel (no backend forced but jit; not under JITKV_DEBUG=1, whose host checks take
    slots; _table_build), for a page size the kernels' 32-bit division takes, up to max_tokens tokens
    (None: any), where that kernel takes the call. Nothing is written where it did not. The binding checks
    the table (_table_call: page_slots' errors where it refuses it)."""
    page_size = _page_size(table)
    if not (args[0].is_cuda and page_size <= _INT32_MAX and isinstance(table[0], torch.Tensor)):
        return False
    if max_tokens is not None and table[0].shape[0] > max_tokens:
        return False
    head, tail = args[:slot_at], args[slot_at + 1 :]

    def call(run, batch_indices, positions, kv_indices, kv_indptr):
        return run(*head, batch_indices, *tail, table=(positions, kv_indices, kv_indptr, page_size, *more))

    return _table_call(op, make, args[0].device, args, slot_at, table, call, checked)


def _page_size(table) -> int:
    """The page size of FlashInfer's ``table`` as an int: a Python int as given (the bindings check it and
    the table), any other value checked with the table here (_check_page_table)."""
    return table[4] if type(table[4]) is int else _check_page_table(*table)


def _table_call(op, make, device, args, slot_at, table, call, checked=None) -> bool:
    """Whether op's page-table build on device (``make(device, Variant)`` builds it: _table_build) ran a
    call of op's arguments ``args`` (schema order, the table's batch_indices at ``slot_at``) with
    FlashInfer's ``table``: ``call(fn, batch_indices, positions, kv_indices, kv_indptr)`` runs it and
    returns whether the build declined (nothing written). The binding checks the table itself
    (cuda/paged.cuh parse_page_table) and takes contiguous int32 / int64 entries: where the variant or the
    binding refuses the call, page_slots' check of the table, then op's check of ``checked()`` (None: args)
    raise first, naming the argument, as page_slots and the op do (ops/_op.py); a table they take that the
    binding does not (other integer dtypes, strides) is passed again as the kernels read it
    (_int32_or_64). The common call pays no check in Python."""
    try:
        return _table_try(op, make, device, args, table[:4], call)
    except _REFUSALS:
        _check_page_table(*table)
        entries = tuple(_int32_or_64(t) for t in table[:4])
        given = args if checked is None else checked()
        op.check(*given[:slot_at], entries[0], *given[slot_at + 1 :])
        if all(e is t for e, t in zip(entries, table)):
            raise
    return _table_try(op, make, device, (*args[:slot_at], entries[0], *args[slot_at + 1 :]), entries, call)


def _table_try(op, make, device, args, entries, call) -> bool:
    """_table_call's one try, with the table's four ``entries``."""
    fn = _table_build(op, device, op.variant(*args), make)
    return fn is not None and not call(fn, *entries)


def _table_build(op, device, key, make):
    """The runner of op's page-table build for the variant of fields ``key`` on device (``make(device,
    op.variant_type(*key))`` builds it; keyed by the fields, as the ops key their runners), made once;
    None where there is none: where the op would not run its CUDA kernel (a backend forced
    but jit, or JITKV_DEBUG=1, whose host checks take slots; read once, as the ops read them, until
    jitkv.ops.reset()), a variant the kernel cannot take, or a build that is unavailable (one warning
    says why). A build refused under graph capture is made on a later call."""
    at = (op.name, device.index, key)
    if at not in _TABLE_BUILDS:
        if debug_checks() or forced_backend(None) not in (None, "jit"):
            _TABLE_BUILDS[at] = None
            return None
        try:
            _TABLE_BUILDS[at] = make(device, op.variant_type(*key))
        except CaptureBuildError:  # not built yet, and a graph is being captured: built on a later call
            return None
        except BackendUnavailable:
            _TABLE_BUILDS[at] = None
        except JitUnavailable as e:
            _TABLE_BUILDS[at] = None
            name = op.name
            warn(f"jitkv.compat.flashinfer: {name}'s page-table build is unavailable ({e}); page_slots makes the slots")
    return _TABLE_BUILDS[at]


def _append(table, k, v, k_cache, v_cache, checked=False):
    """store_cache's copy of k and v (``[n, H, D]``) at the slots of FlashInfer's page table ``table`` =
    (batch_indices, positions, kv_indices, kv_indptr, page_size). On CUDA one launch: store_cache's build
    that reads the table itself (ops/store_cache.py table_runner; its binding checks the table:
    _table_call), where the op would run its CUDA kernel and that build takes the views; else page_slots'
    slots, then store_cache. checked: the caller ran _check_page_table on the table (page_size its int),
    which is then not checked again here."""
    if not checked and type(table[4]) is not int:
        table, checked = (*table[:4], _check_page_table(*table)), True
    page_size = table[4]
    tensor = isinstance(table[0], torch.Tensor)
    if k_cache.is_cuda and tensor and table[0].device == k_cache.device and page_size <= _INT32_MAX:
        args = (k, v, k_cache, v_cache, table[0], "auto", None, None, None, None)

        def call(fn, batch_indices, positions, kv_indices, kv_indptr):
            return fn(k, v, k_cache, v_cache, batch_indices, positions, kv_indices, kv_indptr, page_size)

        if _table_call(store_cache_op.STORE_CACHE, store_cache_op.table_runner, k_cache.device, args, 4, table, call):
            return
    store_cache(k, v, k_cache, v_cache, _page_slots(*table[:4], page_size if checked else _check_page_table(*table)))


def _tensors(op, required, optional=()):
    """TypeError naming the first of ``required`` ((name, value) pairs) that is not a torch.Tensor, or of
    ``optional`` that is neither None nor one: the arguments a shim reads before an op checks them.
    isinstance only, not checks.tensor: the ops check devices, and this runs on every call (seven
    checks.tensor calls cost 1.7 µs on the 2-core build host, these 0.75; timeit both)."""
    for name, t in required:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name}: expected a torch.Tensor, got {type(t).__name__}")
    for name, t in optional:
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name}: expected a torch.Tensor or None, got {type(t).__name__}")


def _pair(op, paged_kv_cache, what="a (k_cache, v_cache) pair of torch.Tensors"):
    """(k_cache, v_cache) of a pair of tensors, else TypeError naming paged_kv_cache (``what``: expected)."""
    pair = isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2
    if not pair or not all(isinstance(c, torch.Tensor) for c in paged_kv_cache):
        raise TypeError(f"{op}: paged_kv_cache: expected {what}, got {_described(paged_kv_cache)}")
    return paged_kv_cache


def _described(x):
    """A bad paged_kv_cache's type, with its items' types where it is a tuple or list."""
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {', '.join(type(c).__name__ for c in x) or 'nothing'}"
    return type(x).__name__


def _nhd(cache, layout):
    """A paged cache as jitkv's logical [pages, page_size, H, D] view (HND given as stored)."""
    return cache.transpose(1, 2) if layout == "HND" else cache


def _unpack(paged_kv_cache, layout):
    """(k_cache, v_cache) of a (k, v) pair or one 5-D [pages, 2, ...] tensor, as logical NHD views."""
    if layout not in LAYOUTS:
        raise ValueError(f"append_paged_kv_cache: kv_layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    if isinstance(paged_kv_cache, torch.Tensor):
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            raise ValueError(
                f"append_paged_kv_cache: paged_kv_cache: expected a (k_cache, v_cache) pair or a "
                f"[pages, 2, ...] tensor, got shape {list(paged_kv_cache.shape)}"
            )
        paged_kv_cache = paged_kv_cache.unbind(1)
    what = "a (k_cache, v_cache) pair of torch.Tensors or a [pages, 2, ...] tensor"
    k_cache, v_cache = _pair("append_paged_kv_cache", paged_kv_cache, what)
    return _nhd(k_cache, layout), _nhd(v_cache, layout)


def append_paged_kv_cache(
    append_key,
    append_value,
    batch_indices,
    positions,
    paged_kv_cache,
    kv_indices,
    kv_indptr,
    kv_last_page_len,
    kv_layout="NHD",
):
    """Append K/V rows to a paged cache: token i to row ``positions[i] % page_size`` of page
    ``kv_indices[kv_indptr[batch_indices[i]] + positions[i] // page_size]`` (batch_indices < 0: not written).

    Args:
        append_key, append_value: ``[nnz, H, D]``, the caches' dtype (a bitwise copy).
        batch_indices, positions: ``[nnz]`` int32 (FlashInfer's) or int64.
        paged_kv_cache: ``(k_cache, v_cache)``, each ``[pages, page_size, H, D]`` (NHD) or ``[pages, H,
            page_size, D]`` (HND), or one ``[pages, 2, ...]`` tensor.
        kv_indices, kv_indptr: the page table (int32 / int64); kv_last_page_len: accepted, not needed to
            address a row.
        kv_layout: "NHD" or "HND".

    Raises:
        ValueError: an unknown kv_layout or a cache tensor that is not 5-D; and the errors of
        ``jitkv.store_cache`` (k, v, k_cache, v_cache, slot_mapping: the slots made from the page table).
        TypeError: a paged_kv_cache that is neither a pair of tensors nor a tensor.
        IndexError: a slot past the cache (CPU; CUDA under JITKV_DEBUG=1).
    """
    k_cache, v_cache = _unpack(paged_kv_cache, kv_layout)
    table = (batch_indices, positions, kv_indices, kv_indptr, k_cache.shape[1])
    _append(table, append_key, append_value, k_cache, v_cache)


def append_paged_mla_kv_cache(
    append_ckv, append_kpe, batch_indices, positions, ckv_cache, kpe_cache, kv_indices, kv_indptr, kv_last_page_len
):
    """Append MLA rows: ``ckv_cache[page, row] = append_ckv[i]``, ``kpe_cache[page, row] = append_kpe[i]``
    with page and row from the page table as ``append_paged_kv_cache``.

    Args:
        append_ckv: ``[nnz, ckv_dim]``; append_kpe ``[nnz, kpe_dim]``; the caches' dtype.
        ckv_cache: ``[pages, page_size, ckv_dim]``; kpe_cache ``[pages, page_size, kpe_dim]`` (separate
            tensors, or column views of one buffer).

    Raises:
        TypeError: an argument here that is not a tensor; and the errors of ``jitkv.store_cache`` (the
        latent and rope parts are its k and v, one head each).
    """
    named = (("append_ckv", append_ckv), ("append_kpe", append_kpe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache))
    _tensors("append_paged_mla_kv_cache", named)
    table = (batch_indices, positions, kv_indices, kv_indptr, ckv_cache.shape[1])
    _append(table, append_ckv.unsqueeze(1), append_kpe.unsqueeze(1), ckv_cache.unsqueeze(2), kpe_cache.unsqueeze(2))


def _joined(a, b):
    """[..., wa + wb] view of two tensors when b's columns follow a's in memory (``x[..., :r]``,
    ``x[..., r:]`` of one tensor; b None or of no columns: a), else None."""
    if b is None or b.shape[-1] == 0:
        return a
    if (
        a.dtype != b.dtype
        or a.shape[:-1] != b.shape[:-1]
        or a.stride() != b.stride()
        or b.data_ptr() != a.data_ptr() + a.shape[-1] * a.element_size()
    ):
        return None
    return a.as_strided((*a.shape[:-1], a.shape[-1] + b.shape[-1]), a.stride(), a.storage_offset())


def _join(a, b):
    """a and b as one [..., wa + wb] tensor: a view when they are adjacent, else a copy."""
    joined = _joined(a, b)
    return joined if joined is not None else torch.cat([a, b], dim=-1)


def _q_outputs(first, second, first_out, second_out, dtype):
    """(q_out [nnz, H, w1 + w2] the op writes as [first | second], the (first_out, second_out) returned,
    whether they are copies of q_out's columns to write back: _write_back); second None: no columns."""
    w = first.shape[-1]
    shape = (*first.shape[:-1], w + (second.shape[-1] if second is not None else 0))
    if first_out is None and second_out is None:
        q_out = torch.empty(shape, dtype=dtype, device=first.device)
        return q_out, (q_out[..., :w], q_out[..., w:]), False
    first_out = first_out if first_out is not None else torch.empty_like(first, dtype=dtype)
    if second_out is None:
        second_out = torch.empty((*shape[:-1], shape[-1] - w), dtype=dtype, device=first.device)
    joined = _joined(first_out, second_out)
    if joined is not None:
        return joined, (first_out, second_out), False
    q_out = torch.empty(shape, dtype=dtype, device=first.device)
    return q_out, (first_out, second_out), True


def _write_back(q_out, outs):
    """The (first_out, second_out) copies from q_out's columns [first | second]."""
    w = outs[0].shape[-1]
    outs[0].copy_(q_out[..., :w])
    outs[1].copy_(q_out[..., w:])


def _mla_rows(ckv_cache, kpe_cache):
    """``[pages * page_size, nope + rope]``: set_mla_kv_buffer's kv_buffer rows when kpe_cache's columns
    follow ckv_cache's in one buffer (the engines' MLA cache seen as two views), else None."""
    joined = _joined(ckv_cache, kpe_cache) if ckv_cache.shape[-1] and kpe_cache.shape[-1] else None
    return None if joined is None else _flat_rows(joined)


def _flat_rows(cache):
    """A ``[pages, page_size, w]`` cache as ``[pages * page_size, w]`` rows, None where its pages are not
    page_size rows apart (no one row stride)."""
    try:
        return cache.view(-1, cache.shape[-1])
    except RuntimeError:
        return None


def _mla_args(kv_buffer, loc, k_nope, k_rope, pos_ids, cos_sin_cache, is_neox, q_rope, q_nope, q_out, fmt, scales):
    """rope_set_mla_kv_buffer's arguments in schema order: rows ``kv_buffer`` at ``loc``, q_out = [q_nope |
    rope(q_rope)], fp8 format ``fmt``, scales = (q_scale, kv_scale)."""
    args = (kv_buffer, loc, k_nope, k_rope, pos_ids, cos_sin_cache, is_neox, q_rope, q_nope, q_out)
    return args + (scales[0], None, fmt, scales[1], None)


def _rope_mla(op, table, ckv_cache, kpe_cache, *args):
    """rope_set_mla_kv_buffer (_mla_args' arguments after loc) into FlashInfer's MLA caches at the slots of
    its page table ``table``, by its page-table build at any token count (only the row's threads, kv_c's
    and k_pe's lanes, walk the table, not the query heads'): the column views of one buffer are its
    kv_buffer rows (_on_table), separate caches its kv_buffer and kpe_rows (_rope_mla_apart where that
    build does not run). Raises op's ValueError for caches neither form takes (_check_apart)."""
    rows = _mla_rows(ckv_cache, kpe_cache)
    if rows is not None:
        args = _mla_args(rows, table[0], *args)
        _on_table(_MLA, rope.mla_paged_runner, rope_set_mla_kv_buffer, 1, table, args, more=(None,))
        return
    _check_apart(op, ckv_cache, kpe_cache)
    ckv_rows, kpe_rows = _flat_rows(ckv_cache), _flat_rows(kpe_cache)
    if ckv_rows is not None and kpe_rows is not None:
        width = ckv_cache.shape[-1] + kpe_cache.shape[-1]

        def checked():  # the op's rows are [ckv | kpe]
            return _mla_args(ckv_rows.new_empty((1, width)), table[0], *args)

        mla_args = _mla_args(ckv_rows, table[0], *args)
        if _table_ran(_MLA, rope.mla_paged_runner, 1, table, mla_args, more=(kpe_rows,), checked=checked):
            return
    table = (*table[:4], _check_page_table(*table))  # its errors before the op writes q_out
    _rope_mla_apart(table, ckv_cache, kpe_cache, *args)


def _check_apart(op, ckv_cache, kpe_cache):
    """Raises ValueError, before anything is written, for MLA caches that _rope_mla_apart cannot take:
    the column views of one buffer whose pages are not page_size rows apart (no one row stride for
    rope_set_mla_kv_buffer), or caches that share memory otherwise."""
    if _joined(ckv_cache, kpe_cache) is not None:
        raise ValueError(
            f"{op}: paged_kv_cache: the ckv and kpe views of one buffer need its pages page_size rows apart "
            f"(one row stride); got a page stride of {ckv_cache.stride(0)} and a row stride of {ckv_cache.stride(1)}"
        )
    checks.disjoint(op, "paged_kv_cache[1]", kpe_cache, "paged_kv_cache[0]", ckv_cache)


def _rope_mla_apart(table, ckv_cache, kpe_cache, *args):
    """_rope_mla for separate caches where its page-table build does not run (args: _mla_args' after loc;
    the table checked by the caller, its page_size an int): rope_set_mla_kv_buffer writes token t's row
    [ckv | kpe] into row t of a scratch buffer and q_out, then store_cache's append copies the two parts
    into their pages (_append; padding tokens are not written). On CUDA three launches (the scratch rows'
    indices, the op, the append), the rows' bytes once more through memory."""
    n, nope = table[0].shape[0], ckv_cache.shape[-1]
    rows = torch.empty((n, nope + kpe_cache.shape[-1]), dtype=ckv_cache.dtype, device=ckv_cache.device)
    mla_args = _mla_args(rows, torch.arange(n, device=rows.device), *args)
    rope_set_mla_kv_buffer(**dict(zip(_NAMES[rope.MLA_OP], mla_args)))
    k, v = rows[:, :nope].unsqueeze(1), rows[:, nope:].unsqueeze(1)
    _append(table, k, v, ckv_cache.unsqueeze(2), kpe_cache.unsqueeze(2), checked=True)


def rope_quantize_fp8_append_paged_kv_cache(
    q_rope,
    k_rope,
    q_nope,
    k_nope,
    v,
    cos_sin_cache,
    pos_ids,
    paged_kv_cache,
    kv_indices,
    kv_indptr,
    batch_indices,
    positions,
    is_neox=True,
    quantize_dtype=None,
    quant_scale_q=1.0,
    quant_scale_kv=1.0,
    page_size=16,
    kv_layout="NHD",
    q_rope_out=None,
    q_nope_out=None,
    enable_pdl=False,
):
    """RoPE on the rope parts of q and k, FP8 quantization of Q, K (and V), and K/V appended to a paged
    FP8 cache, as FlashInfer's ``rope_quantize_fp8_append_paged_kv_cache``. Returns ``(q_rope_out,
    q_nope_out)``.

    MHA / GQA (k_rope 3-D): a K head is ``[rope(k_rope) | k_nope]`` (rotated dims first), V ``[nnz, Hk,
    rope + nope]``; ``paged_kv_cache = (k_cache, v_cache)`` in NHD or HND. MLA (k_rope 2-D ``[nnz, rope]``,
    k_nope ``[nnz, nope]``, v None): ``paged_kv_cache = (ckv_cache [pages, page_size, nope], kpe_cache
    [pages, page_size, rope])``: ``jitkv.rope_set_mla_kv_buffer`` writes the rows and both query parts
    (the returned outputs are then views of one ``[nnz, Hq, nope + rope]`` tensor, or those given, copied
    into only where they are not adjacent in that order), in one launch on CUDA, whether the two caches
    are the column views of one ``[pages, page_size, nope + rope]`` buffer (the engines' MLA cache) or
    two tensors (where that build does not run: into scratch rows that store_cache's append copies into
    the pages).

    Args:
        q_rope ``[nnz, Hq, rope]``, q_nope ``[nnz, Hq, nope]`` (None: no nope dims), k_rope, k_nope, v: bf16
            or fp16 (one dtype).
        cos_sin_cache: ``[max_pos, rope]`` float32, cos half then sin half; pos_ids ``[nnz]`` its rows.
        kv_indices, kv_indptr, batch_indices, positions: the page table (module docstring).
        is_neox: NeoX halves (True) or GPT-J pairs (False).
        quantize_dtype: float8_e4m3fn or float8_e5m2 (None: q_rope_out's, q_nope_out's, else e4m3).
        quant_scale_q, quant_scale_kv: FlashInfer's multiplying scales (floats; module docstring).
        page_size: rows per page; kv_layout: "NHD" or "HND" (MHA only).
        q_rope_out, q_nope_out: outputs (allocated when None); enable_pdl: accepted, not used.

    Written: each token's Q (both parts) as fp8(satfinite(q * quant_scale_q)) after RoPE; K and V rows of
    tokens with ``batch_indices >= 0``. Each value is rotated in float32 with one rounding and no fused
    multiply-add (docs/design.md §9); FlashInfer's kernel may contract the rotation into an FMA. On CUDA
    one launch, the page table read in the kernel (module docstring).

    Raises:
        ValueError: a cos_sin_cache that is not float32, a quantize_dtype that is not fp8, caches of another
        dtype or rank (MLA: rows of other widths than k_nope's and k_rope's; caches that share memory other
        than as the column views of one buffer whose pages are page_size rows apart), V given for MLA or
        missing for MHA; and the errors of ``page_slots``, ``jitkv.rope_store_cache`` and
        ``jitkv.rope_set_mla_kv_buffer``.
        TypeError: q_rope, k_rope, cos_sin_cache, q_nope, k_nope or the q outputs not tensors (the optional
        ones None), a paged_kv_cache that is no pair of tensors.
        IndexError: a position or slot out of range (CPU; CUDA under JITKV_DEBUG=1).
    """
    op = "rope_quantize_fp8_append_paged_kv_cache"
    _tensors(
        op,
        (("q_rope", q_rope), ("k_rope", k_rope), ("cos_sin_cache", cos_sin_cache)),
        (("q_nope", q_nope), ("k_nope", k_nope), ("q_rope_out", q_rope_out), ("q_nope_out", q_nope_out)),
    )
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"{op}: cos_sin_cache: expected float32 (FlashInfer's), got {cos_sin_cache.dtype}")
    if quantize_dtype is None:
        given = q_rope_out if q_rope_out is not None else q_nope_out
        quantize_dtype = given.dtype if given is not None else torch.float8_e4m3fn
    if quantize_dtype not in _FORMATS:
        raise ValueError(
            f"{op}: quantize_dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {quantize_dtype}"
        )
    mla = k_rope.dim() == 2
    if mla and k_nope is None:
        k_nope = k_rope.new_empty(*k_rope.shape[:-1], 0)
    k_cache, v_cache = _pair(op, paged_kv_cache)
    for name, cache in (("paged_kv_cache[0]", k_cache), ("paged_kv_cache[1]", v_cache)):
        if cache.dtype != quantize_dtype or cache.dim() != (3 if mla else 4):
            raise ValueError(
                f"{op}: {name}: expected a {3 if mla else 4}-D {quantize_dtype} cache, got "
                f"{cache.dtype} {list(cache.shape)}"
            )
    if mla == (v is not None):
        raise ValueError(f"{op}: v: " + ("MLA takes no V (pass None)" if mla else "GQA/MHA needs V, got None"))
    if mla:  # the ops take wider rows (padding after them): FlashInfer's widths are the parts'
        for name, cache, part, part_name in (("0", k_cache, k_nope, "k_nope"), ("1", v_cache, k_rope, "k_rope")):
            if cache.shape[-1] != part.shape[-1]:
                raise ValueError(
                    f"{op}: paged_kv_cache[{name}]: expected rows of {part.shape[-1]} values like {part_name}, "
                    f"got {cache.shape[-1]}"
                )
    table = (batch_indices, positions, kv_indices, kv_indptr, page_size)
    fmt, q_scale, kv_scale = _FORMATS[quantize_dtype], 1.0 / quant_scale_q, 1.0 / quant_scale_kv
    if mla and q_nope is not None and q_nope.shape[-1]:  # rope_set_mla_kv_buffer: rows and both query parts
        q_out, (q_nope_out, q_rope_out), copy_back = _q_outputs(q_nope, q_rope, q_nope_out, q_rope_out, quantize_dtype)
        args = (k_nope, k_rope, pos_ids, cos_sin_cache, is_neox, q_rope, q_nope, q_out, fmt, (q_scale, kv_scale))
        _rope_mla(op, table, k_cache, v_cache, *args)
        if copy_back:
            _write_back(q_out, (q_nope_out, q_rope_out))
        return q_rope_out, q_nope_out
    q_out, returned, copy_back = _q_outputs(q_rope, q_nope, q_rope_out, q_nope_out, quantize_dtype)
    if mla:
        # No nope columns: the rope part rides as a one-head K beside an empty one-head V.
        r = q_rope.shape[-1]
        _rope_store(
            table,
            q_rope,
            k_rope.unsqueeze(1),
            k_nope.unsqueeze(1),
            v_cache.unsqueeze(2),
            k_cache.unsqueeze(2),
            pos_ids,
            cos_sin_cache,
            is_neox,
            r,
            q_out[..., :r],
            fmt,
            q_scale,
            kv_scale,
        )
    else:
        _rope_store(
            table,
            _join(q_rope, q_nope),
            _join(k_rope, k_nope),
            v,
            _nhd(k_cache, kv_layout),
            _nhd(v_cache, kv_layout),
            pos_ids,
            cos_sin_cache,
            is_neox,
            q_rope.shape[-1],
            q_out,
            fmt,
            q_scale,
            kv_scale,
        )
    if copy_back:
        _write_back(q_out, returned)
    return returned
