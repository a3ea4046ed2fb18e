"""vLLM's KV-cache writers on jitkv: ``reshape_and_cache_flash``, ``concat_and_cache_mla`` and the fused
MLA RoPE + cache write ``concat_and_cache_mla_rope_fused``; and its block swap ``swap_blocks``.

Same names, argument order and results as the CUDA ops vLLM registers under
``torch.ops._C_cache_ops`` (and wraps in ``vllm._custom_ops``), as read in vLLM's main branch in
2026: paged NHD or HND caches given as strided views, float32 tensor scales of one element or one
per KV head, stored = fp8(satfinite(x / scale)), slot < 0 skipped. Older vLLM releases passed
Python-float scales; those are accepted too.

Where vLLM and jitkv's own contract (docs/design.md §3) differ, the docstrings say which applies.
Errors come from jitkv's ops and name their arguments (k, v, k_cache, v_cache, slot_mapping for
``reshape_and_cache_flash``; kv_buffer, loc, k_nope, k_rope for ``concat_and_cache_mla``).
"""

from __future__ import annotations

import torch

from .. import checks, rope_set_mla_kv_buffer, set_mla_kv_buffer, store_cache, transfer_pages
from ..checks import dtype_name

__all__ = ["concat_and_cache_mla", "concat_and_cache_mla_rope_fused", "reshape_and_cache_flash", "swap_blocks"]

# vLLM's MLA cache formats (concat_and_cache_mla's kv_cache_dtype).
MLA_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla")


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """Write K and V rows into paged caches, as vLLM's ``reshape_and_cache_flash``.

    ``key_cache[s // block_size, s % block_size] = quant(key[i])`` for ``s = slot_mapping[i]``, same
    for V, where ``quant`` is a bitwise copy ("auto") or ``fp8(satfinite(x / scale))``.

    Args:
        key, value: ``[n', num_heads, head_size]`` bf16/fp16/fp32, n' >= n = ``slot_mapping.numel()``
            (vLLM pads sources for CUDA graphs; rows past n are never read). Any token stride (views
            of a fused qkv tensor); head and element dims contiguous.
        key_cache, value_cache: ``[num_blocks, block_size, num_heads, head_size]`` in vLLM's logical
            NHD shape. vLLM allocates HND caches physically as ``[num_blocks, num_heads, block_size,
            head_size]`` and passes the permuted view, and takes K and V as ``unbind`` views of one
            ``[num_blocks, 2, ...]`` or ``[2, num_blocks, ...]`` allocation: any such strided view is
            written in place, never copied. dtype: the source dtype for "auto"; float8_e4m3fn,
            float8_e5m2 or uint8 (vLLM's byte storage) for fp8.
        slot_mapping: ``[n]`` int64 (vLLM's type) or int32 (also accepted). Slot < 0 is padding and is
            skipped, as in vLLM.
        kv_cache_dtype: "auto", "fp8" or "fp8_e4m3" (e4m3fn, max 448), "fp8_e5m2" (max 57344).
        k_scale, v_scale: float32 tensors on the cache's device, 1 element (any shape) or
            ``[num_heads]`` (one scale per KV head), or Python floats; ignored for "auto". vLLM
            divides by the scale (stored = fp8(satfinite(x / scale)), dequantized = stored * scale),
            which is jitkv's convention too, so scales pass through unchanged.

    Raises:
        TypeError, ValueError: from ``jitkv.store_cache`` (wrong dtype, shape, device or layout,
            unknown kv_cache_dtype, a scale that is not finite and > 0); ValueError here when
            k_scale and v_scale differ in size or have neither 1 nor num_heads elements.
        IndexError: a slot >= num_blocks * block_size, on CPU (nothing is written then). vLLM does
            not check (an out-of-bounds write); jitkv's CUDA kernels skip such rows instead, or raise
            on the host under ``JITKV_DEBUG=1``.

    K and V go in one launch, per-head scales included (passed to ``jitkv.store_cache`` as
    ``[num_heads]`` tensors).
    """
    if kv_cache_dtype == "auto":
        store_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    heads = _per_head_scales(key, k_scale, v_scale)
    if heads is None:
        store_cache(
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            kv_cache_dtype=kv_cache_dtype,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        return
    store_cache(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        kv_cache_dtype=kv_cache_dtype,
        k_scale=k_scale.reshape(heads),
        v_scale=v_scale.reshape(heads),
    )


def _per_head_scales(key, k_scale, v_scale):
    """num_heads when the scales hold one value per KV head, None for one-element scales; vLLM's
    rule: both the same size, 1 or num_heads."""
    sizes = [s.numel() if isinstance(s, torch.Tensor) else 1 for s in (k_scale, v_scale)]
    if sizes == [1, 1]:
        return None
    heads = key.shape[1] if isinstance(key, torch.Tensor) and key.dim() == 3 else None
    if sizes[0] != sizes[1] or sizes[0] != heads:
        raise ValueError(
            f"reshape_and_cache_flash: k_scale: expected k_scale and v_scale of 1 or num_heads = {heads} elements "
            f"each, got {sizes[0]} and {sizes[1]}"
        )
    return heads


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale):
    """Write MLA rows ``[kv_c | k_pe]`` into a paged cache, as vLLM's ``concat_and_cache_mla``.

    ``kv_cache[s // block_size, s % block_size] = cat(kv_c[i], k_pe[i])`` for ``s = slot_mapping[i]``.

    Args:
        kv_c: ``[n', kv_lora_rank]``, k_pe: ``[n', pe_dim]`` (or ``[n', 1, pe_dim]``), n' >= n =
            ``slot_mapping.numel()``; any row stride, last dim contiguous; the cache's dtype.
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + pe_dim]``, the row width exactly
            ``kv_lora_rank + pe_dim`` as vLLM requires; blocks packed (``stride(0) == block_size *
            stride(1)``), so the cache is one ``[num_blocks * block_size, W]`` row view. Written in
            place.
        slot_mapping: ``[n]`` int64 (vLLM's type) or int32. Slot < 0 is padding and is skipped.
        kv_cache_dtype: "auto" (a bitwise copy); "fp8" or "fp8_e4m3", "fp8_e5m2": each value stored as
            fp8(satfinite(x / scale)) into a uint8 or float8 cache of the same width; "fp8_ds_mla":
            vLLM's 656-byte DeepSeek record (512 nope values as e4m3 in 4 tiles of 128, each tile's
            fp32 scale, then the 64 rope values as 16-bit floats) into a uint8 ``[..., 656]`` cache.
        scale: float32 tensor of one element (vLLM's ``_k_scale``) or a float, for "fp8"/"fp8_e4m3"/
            "fp8_e5m2"; ignored for "auto" and "fp8_ds_mla" (whose scales are per tile), as in vLLM.

    Raises:
        ValueError: any other kv_cache_dtype; a cache that is not 3-D, whose row width is not
            kv_lora_rank + pe_dim, or whose blocks are not packed; and the ValueError/TypeError of
            ``jitkv.set_mla_kv_buffer`` (dtype, device, shape, layout).
        IndexError: a slot >= num_blocks * block_size, on CPU (nothing is written); vLLM does not
            check, jitkv's CUDA kernels skip the row (``JITKV_DEBUG=1``: raise on the host).
    """
    if kv_cache_dtype not in MLA_DTYPES:
        raise ValueError(
            f"concat_and_cache_mla: kv_cache_dtype: expected one of {', '.join(MLA_DTYPES)}, got {kv_cache_dtype!r}"
        )
    rows = _paged_rows(kv_cache)
    if kv_cache_dtype == "auto":
        _require_full_width(rows, kv_c, k_pe)
        set_mla_kv_buffer(rows, slot_mapping, kv_c, k_pe)
    elif kv_cache_dtype == "fp8_ds_mla":
        set_mla_kv_buffer(rows, slot_mapping, kv_c, k_pe, kv_cache_dtype="fp8_ds_mla")
    else:
        _require_full_width(rows, kv_c, k_pe)
        fmt = "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype
        set_mla_kv_buffer(rows, slot_mapping, kv_c, k_pe, kv_cache_dtype=fmt, scale=scale)


def _paged_rows(kv_cache, op="concat_and_cache_mla"):
    """``[num_blocks, block_size, W]`` as the ``[num_blocks * block_size, W]`` view jitkv writes:
    slot s is row s."""
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"{op}: kv_cache: expected a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dim() != 3:
        raise ValueError(
            f"{op}: kv_cache: expected shape [num_blocks, block_size, kv_lora_rank + pe_dim], "
            f"got {list(kv_cache.shape)}"
        )
    num_blocks, block_size, width = kv_cache.shape
    try:
        return kv_cache.view(num_blocks * block_size, width)
    except RuntimeError:
        raise ValueError(
            f"{op}: kv_cache: blocks must be packed (stride(0) == block_size * stride(1)), "
            f"got strides {kv_cache.stride()} for shape {list(kv_cache.shape)}"
        ) from None


def _require_full_width(rows, kv_c, k_pe, op="concat_and_cache_mla"):
    """vLLM writes exactly kv_lora_rank + pe_dim columns and refuses a wider cache row."""
    if not (isinstance(kv_c, torch.Tensor) and isinstance(k_pe, torch.Tensor)):
        return  # set_mla_kv_buffer raises the TypeError
    width = kv_c.shape[-1] + k_pe.shape[-1]
    if rows.shape[1] != width:
        raise ValueError(
            f"{op}: kv_cache: expected a row width of kv_lora_rank + pe_dim = {kv_c.shape[-1]} + "
            f"{k_pe.shape[-1]} = {width}, got {rows.shape[1]}"
        )


# vLLM's fused MLA RoPE + cache write dispatches on these (its DISPATCH_BY_KV_CACHE_DTYPE).
ROPE_MLA_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def concat_and_cache_mla_rope_fused(
    positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_dtype, kv_cache_scale
):
    """RoPE on q_pe and k_pe in place, then the MLA rows ``[kv_c | rope(k_pe)]`` written into a paged
    cache, as vLLM's ``concat_and_cache_mla_rope_fused`` (DeepseekScalingRotaryEmbedding + concat_and_cache_mla).

    Args:
        positions: ``[>= num_tokens]`` int64 (vLLM's type) or int32.
        q_pe: ``[num_tokens, num_q_heads, rot_dim]``, rotated in place (every token, padding included).
        k_pe: ``[num_tokens, rot_dim]``, rotated in place; kv_c ``[num_tokens, kv_lora_rank]``; one dtype
            (bf16, fp16, fp32), any row stride, last dim contiguous.
        cos_sin_cache: ``[max_position, rot_dim]``, cos half then sin half, in q_pe's dtype (vLLM's) or float32.
        is_neox: NeoX halves (True) or GPT-J pairs (False: DeepSeek).
        slot_mapping: ``[num_tokens]`` int64 or int32; a slot < 0 is padding (its row is not written).
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + rot_dim]``, blocks packed, written in place.
        kv_cache_dtype: "auto" (the cache in q_pe's dtype), "fp8"/"fp8_e4m3", "fp8_e5m2" (uint8 or float8
            cache; stored = fp8(satfinite(x / kv_cache_scale))).
        kv_cache_scale: float32 tensor of one element (or a float), used by the fp8 formats.

    Where vLLM and jitkv differ: vLLM rotates in the model dtype (each product and sum rounded to bf16 /
    fp16) and quantizes the rounded rope values; jitkv rotates in float32 with one rounding per store and
    quantizes the float32 result (docs/design.md §9), so rotated values can differ in their last bit. vLLM
    leaves k_pe of padding tokens unrotated; jitkv rotates every token's k_pe (neither is read).

    Raises:
        ValueError: another kv_cache_dtype (vLLM's kernel has no fp8_ds_mla), a cache that is not 3-D, not
            ``kv_lora_rank + rot_dim`` wide or whose blocks are not packed; and the TypeError / ValueError of
            ``jitkv.rope_set_mla_kv_buffer`` (named as its arguments: kv_cache is ``kv_buffer``,
            slot_mapping is ``loc``). IndexError: a slot or position out of range, on CPU (CUDA under
            ``JITKV_DEBUG=1``), before anything is written; vLLM does not check.
    """
    if kv_cache_dtype not in ROPE_MLA_DTYPES:
        raise ValueError(
            f"concat_and_cache_mla_rope_fused: kv_cache_dtype: expected one of "
            f"{', '.join(ROPE_MLA_DTYPES)}, got {kv_cache_dtype!r}"
        )
    rows = _paged_rows(kv_cache, "concat_and_cache_mla_rope_fused")
    _require_full_width(rows, kv_c, k_pe, "concat_and_cache_mla_rope_fused")
    checks.tensor("rope_set_mla_kv_buffer", "k_pe", k_pe)  # the op checks its k_pe_out (vLLM's k_pe) first
    fp8 = kv_cache_dtype != "auto"
    rope_set_mla_kv_buffer(
        rows,
        slot_mapping,
        kv_c,
        k_pe,
        positions,
        cos_sin_cache,
        is_neox=is_neox,
        q_pe=q_pe,
        k_pe_out=k_pe,
        kv_cache_dtype="fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype,
        scale=kv_cache_scale if fp8 else None,
    )


def swap_blocks(src, dst, block_size_in_bytes, block_mapping):
    """Copy whole cache blocks between two caches of one layer, as vLLM's ``swap_blocks``.

    For each row ``(s, d)`` of ``block_mapping``: block d of ``dst`` = block s of ``src``, all
    ``block_size_in_bytes`` bytes of it. vLLM uses it to swap blocks between the GPU cache and a
    pinned CPU cache (and GPU to GPU), once per K and V cache of each layer.

    Args:
        src, dst: one layer's cache ``[num_blocks, ...]`` (vLLM passes ``kv_cache[0]`` / ``[1]`` of a
            ``[2, num_blocks, block_size, heads, head_size]`` allocation), one dtype and block shape,
            each block dense. On one CUDA device, or one of them a pinned CPU tensor, or both CPU.
        block_size_in_bytes: the bytes of one block; must equal ``src[0]``'s bytes (vLLM addresses
            block i at ``data_ptr + i * block_size_in_bytes``; jitkv follows the tensors' own block
            stride, the same address for the dense caches vLLM allocates).
        block_mapping: ``[N, 2]`` int64 (vLLM's) or int32 pairs (src block, dst block), on the CPU as
            vLLM keeps it (then blocks of 64 KiB or more go to the copy engines, no SM, as vLLM's
            own cudaMemcpyAsync per block, and smaller ones to jitkv's SM kernel with the pairs in its
            launch; see ``transfer_pages``), or on the CUDA cache's device.

    Where vLLM and jitkv differ, jitkv's contract (docs/design.md §3) applies: a pair with a negative
    block is skipped (vLLM has no padding value and never sends one); a block past its cache raises
    IndexError before anything is copied when block_mapping is on the CPU, and is skipped when it is
    on a GPU (vLLM does not check).

    Raises:
        TypeError, ValueError: block_mapping not an ``[N, 2]`` int32/int64 tensor, block_size_in_bytes
        not the block's bytes; the errors of ``jitkv.transfer_pages`` (src, dst, their dtypes, shapes
        and devices, an unpinned CPU cache beside a GPU one).
        IndexError: a block past its cache (block_mapping on the CPU; on a GPU under ``JITKV_DEBUG=1``).
    """
    op = "swap_blocks"
    for name, t in (("src", src), ("dst", dst), ("block_mapping", block_mapping)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name}: expected a torch.Tensor, got {type(t).__name__}")
    if block_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: block_mapping: expected dtype int32 or int64, got {dtype_name(block_mapping.dtype)}")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"{op}: block_mapping: expected shape [N, 2], got {list(block_mapping.shape)}")
    for name, t in (("src", src), ("dst", dst)):
        if t.dim() < 1:
            raise ValueError(f"{op}: {name}: expected a cache [num_blocks, ...], got shape {list(t.shape)}")
    block = src[0].numel() * src.element_size() if src.shape[0] else None
    if isinstance(block_size_in_bytes, bool) or not isinstance(block_size_in_bytes, int):
        raise TypeError(f"{op}: block_size_in_bytes: expected an int, got {type(block_size_in_bytes).__name__}")
    if block is not None and block_size_in_bytes != block:
        raise ValueError(
            f"{op}: block_size_in_bytes: expected {block} (the bytes of src[0]), got {block_size_in_bytes}"
        )
    transfer_pages(
        src.unsqueeze(0), dst.unsqueeze(0), block_mapping[:, 0].contiguous(), block_mapping[:, 1].contiguous()
    )
