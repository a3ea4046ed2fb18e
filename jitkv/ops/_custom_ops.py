"""torch.library registrations so the ops work under torch.compile(fullgraph=True).

Eager calls never go through these (the dispatcher costs ~15 µs a call); the public functions
route here only while compiling."""

from __future__ import annotations

from typing import Optional

import torch

from . import dsv4, mla, store_cache


@torch.library.custom_op("jitkv::set_mla_kv_buffer", mutates_args=("kv_buffer",))
def _set_mla_kv_buffer(
    kv_buffer: torch.Tensor,
    loc: torch.Tensor,
    cache_k_nope: torch.Tensor,
    cache_k_rope: torch.Tensor,
    skip_slot: Optional[int],
    backend: Optional[str],
    kv_cache_dtype: str = "auto",
    scale_tensor: Optional[torch.Tensor] = None,
    scale_value: float = -1.0,
) -> None:
    scale = scale_tensor if scale_tensor is not None else (None if scale_value < 0 else scale_value)
    mla.set_mla_kv_buffer(kv_buffer, loc, cache_k_nope, cache_k_rope, kv_cache_dtype=kv_cache_dtype, scale=scale,
                          skip_slot=skip_slot, backend=backend)


@_set_mla_kv_buffer.register_fake
def _(kv_buffer, loc, cache_k_nope, cache_k_rope, skip_slot, backend, kv_cache_dtype="auto", scale_tensor=None,
      scale_value=-1.0) -> None:
    return None


@torch.library.custom_op("jitkv::store_cache", mutates_args=("k_cache", "v_cache"))
def _store_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale_tensor: Optional[torch.Tensor],
    k_scale_value: float,
    v_scale_tensor: Optional[torch.Tensor],
    v_scale_value: float,
    loc_map: Optional[torch.Tensor],
    skip_slot: Optional[int],
    backend: Optional[str],
) -> None:
    k_scale = k_scale_tensor if k_scale_tensor is not None else (None if k_scale_value < 0 else k_scale_value)
    v_scale = v_scale_tensor if v_scale_tensor is not None else (None if v_scale_value < 0 else v_scale_value)
    store_cache.store_cache(
        k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale,
        loc_map=loc_map, skip_slot=skip_slot, backend=backend,
    )


@_store_cache.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype, k_scale_tensor, k_scale_value, v_scale_tensor,
      v_scale_value, loc_map, skip_slot, backend) -> None:
    return None


@torch.library.custom_op("jitkv::quantize_and_insert_k_cache", mutates_args=("k_cache",))
def _quantize_and_insert_k_cache(
    k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int, backend: Optional[str]
) -> None:
    dsv4.quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size=block_size, backend=backend)


@_quantize_and_insert_k_cache.register_fake
def _(k, k_cache, slot_mapping, block_size, backend) -> None:
    return None


@torch.library.custom_op("jitkv::dequantize_and_gather_k_cache", mutates_args=("out",))
def _dequantize_and_gather_k_cache(
    out: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: Optional[torch.Tensor],
    block_table: torch.Tensor,
    block_size: int,
    offset: int,
    backend: Optional[str],
) -> None:
    dsv4.dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, backend=backend)


@_dequantize_and_gather_k_cache.register_fake
def _(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, backend) -> None:
    return None
