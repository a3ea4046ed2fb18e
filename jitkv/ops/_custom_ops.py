"""torch.library registrations so the ops work under torch.compile(fullgraph=True).

Eager calls never go through these (the dispatcher costs ~15 µs a call); the public functions
route here only while compiling. The ops are defined from schema strings with ``torch.library.Library``
rather than the ``custom_op`` decorator: the decorator infers each schema from annotations and costs
about 4 ms per op at ``import jitkv`` (the warm-start budget), the schema strings well under 1 ms for all.
Every op mutates its destination and returns nothing; its Meta kernel (what fake tensors run) does nothing.
"""

from __future__ import annotations

import torch

from . import dsv4, indexer, mla, mla_gather, store_cache

_LIB = torch.library.Library("jitkv", "DEF")


def _nothing(*args) -> None:
    return None


def _register(name: str, schema: str, fn) -> None:
    """jitkv::<name><schema> -> (), running ``fn`` on every device."""
    _LIB.define(f"{name}{schema} -> ()")
    _LIB.impl(name, fn, "CompositeExplicitAutograd")
    _LIB.impl(name, _nothing, "Meta")


def _set_mla_kv_buffer(kv_buffer, loc, cache_k_nope, cache_k_rope, skip_slot, backend, kv_cache_dtype="auto",
                       scale_tensor=None, scale_value=-1.0):  # the dispatcher drops arguments equal to the schema's defaults
    scale = scale_tensor if scale_tensor is not None else (None if scale_value < 0 else scale_value)
    mla.set_mla_kv_buffer(kv_buffer, loc, cache_k_nope, cache_k_rope, kv_cache_dtype=kv_cache_dtype, scale=scale,
                          skip_slot=skip_slot, backend=backend)


def _store_cache(k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype, k_scale_tensor, k_scale_value,
                 v_scale_tensor, v_scale_value, loc_map, skip_slot, backend):
    k_scale = k_scale_tensor if k_scale_tensor is not None else (None if k_scale_value < 0 else k_scale_value)
    v_scale = v_scale_tensor if v_scale_tensor is not None else (None if v_scale_value < 0 else v_scale_value)
    store_cache.store_cache(
        k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale,
        loc_map=loc_map, skip_slot=skip_slot, backend=backend,
    )


def _quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size, backend):
    dsv4.quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size=block_size, backend=backend)


def _dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, backend):
    dsv4.dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, backend=backend)


def _indexer_k_quant_and_cache(k, kv_cache, slot_mapping, block_size, scale_fmt, backend):
    indexer.indexer_k_quant_and_cache(k, kv_cache, slot_mapping, block_size=block_size, scale_fmt=scale_fmt,
                                      backend=backend)


def _gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, block_size, backend):
    indexer.gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, block_size=block_size,
                                         backend=backend)


def _gather_mla_cache(out, kv_cache, block_table, cu_seq_lens, seq_starts, kv_cache_dtype, scale_tensor, scale_value,
                      backend):
    scale = scale_tensor if scale_tensor is not None else (None if scale_value < 0 else scale_value)
    mla_gather.gather_mla_cache(out, kv_cache, block_table, cu_seq_lens, seq_starts=seq_starts,
                                kv_cache_dtype=kv_cache_dtype, scale=scale, backend=backend)


_register(
    "set_mla_kv_buffer",
    "(Tensor(a!) kv_buffer, Tensor loc, Tensor cache_k_nope, Tensor cache_k_rope, int? skip_slot, str? backend, "
    "str kv_cache_dtype=\"auto\", Tensor? scale_tensor=None, float scale_value=-1.0)",
    _set_mla_kv_buffer,
)
_register(
    "store_cache",
    "(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, str kv_cache_dtype, "
    "Tensor? k_scale_tensor, float k_scale_value, Tensor? v_scale_tensor, float v_scale_value, Tensor? loc_map, "
    "int? skip_slot, str? backend)",
    _store_cache,
)
_register(
    "quantize_and_insert_k_cache",
    "(Tensor k, Tensor(a!) k_cache, Tensor slot_mapping, int block_size, str? backend)",
    _quantize_and_insert_k_cache,
)
_register(
    "dequantize_and_gather_k_cache",
    "(Tensor(a!) out, Tensor k_cache, Tensor seq_lens, Tensor? gather_lens, Tensor block_table, int block_size, "
    "int offset, str? backend)",
    _dequantize_and_gather_k_cache,
)
_register(
    "indexer_k_quant_and_cache",
    "(Tensor k, Tensor(a!) kv_cache, Tensor slot_mapping, int block_size, str? scale_fmt, str? backend)",
    _indexer_k_quant_and_cache,
)
_register(
    "gather_indexer_k_quant_cache",
    "(Tensor kv_cache, Tensor(a!) dst_k, Tensor(b!) dst_scale, Tensor block_table, Tensor cu_seq_lens, "
    "int block_size, str? backend)",
    _gather_indexer_k_quant_cache,
)
_register(
    "gather_mla_cache",
    "(Tensor(a!) out, Tensor kv_cache, Tensor block_table, Tensor cu_seq_lens, Tensor? seq_starts, str kv_cache_dtype, "
    "Tensor? scale_tensor, float scale_value, str? backend)",
    _gather_mla_cache,
)
