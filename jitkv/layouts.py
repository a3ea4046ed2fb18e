"""Record layouts and fp8 codes: the one place they are defined (docs/design.md §4, §5).

Python backends (the torch reference, Triton) import them; the C++/CUDA kernels receive them as build
arguments (``JitSpec`` args, ``-DJITKV_<NAME>``), so a layout change reaches every backend and every
cache key at once.
"""

from __future__ import annotations

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# kv_cache_dtype names accepted by the writers, and the fp8 dtype each stores.
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Codes of the cache formats in kernels' build arguments: 0 is a plain copy.
FP8_CODES = {None: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}

# DeepSeek-V4 FP8 K cache record (docs/design.md §5): per token 448 dims as e4m3, 64 dims as bf16,
# then 8 bytes of UE8M0 scales (7 groups of 64 dims + one zero byte); a block holds all its tokens'
# data, then all their scales.
DSV4_HEAD_DIM = 512
DSV4_NOPE = 448  # dims stored as e4m3, one UE8M0 scale per 64
DSV4_ROPE = 64  # dims stored as bf16
DSV4_DATA_BYTES = DSV4_NOPE + 2 * DSV4_ROPE  # 576
DSV4_SCALE_BYTES = 8  # 7 used + 1 zero byte
DSV4_TOKEN_BYTES = DSV4_DATA_BYTES + DSV4_SCALE_BYTES  # 584
DSV4_GROUP = 64

# vLLM's "fp8_ds_mla" MLA record (DeepSeek-V3.2 sparse MLA), 656 bytes per token: the 512 nope values
# as e4m3 in 4 tiles of 128, each tile's fp32 scale (amax / 448), then the 64 rope values as bf16:
# [512 B e4m3 | 16 B fp32 scales | 128 B bf16].
DS_MLA_NOPE = 512
DS_MLA_ROPE = 64
DS_MLA_TILE = 128
DS_MLA_TILES = DS_MLA_NOPE // DS_MLA_TILE  # 4
DS_MLA_SCALE_OFFSET = DS_MLA_NOPE  # 512
DS_MLA_ROPE_OFFSET = DS_MLA_SCALE_OFFSET + 4 * DS_MLA_TILES  # 528
DS_MLA_RECORD_BYTES = DS_MLA_ROPE_OFFSET + 2 * DS_MLA_ROPE  # 656
# Format code of the fp8_ds_mla record in kernels' build arguments (after FP8_CODES' per-tensor formats).
DS_MLA_CODE = 3
