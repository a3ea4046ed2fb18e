"""One small call of each op with fresh random arguments, for tests that run every op the same way
(devices, processes). Slots are unique and in range, so the CPU reference raises for nothing."""

from __future__ import annotations

import torch

import jitkv
from jitkv import DSV4_K_CACHE, INDEXER_K_CACHE, reference
from jitkv.tests.conftest import rand, slots

OPS = ("set_mla_kv_buffer", "store_cache", "quantize_and_insert_k_cache", "dequantize_and_gather_k_cache",
       "indexer_k_quant_and_cache", "gather_indexer_k_quant_cache", "gather_mla_cache")
HOME = {"set_mla_kv_buffer": "kv_buffer", "store_cache": "k_cache", "quantize_and_insert_k_cache": "k_cache",
        "dequantize_and_gather_k_cache": "k_cache", "indexer_k_quant_and_cache": "kv_cache",
        "gather_indexer_k_quant_cache": "kv_cache", "gather_mla_cache": "out"}  # the tensor whose device the others must share
DESTINATIONS = {"set_mla_kv_buffer": ("kv_buffer",), "store_cache": ("k_cache", "v_cache"),
                "quantize_and_insert_k_cache": ("k_cache",), "dequantize_and_gather_k_cache": ("out",),
                "indexer_k_quant_and_cache": ("kv_cache",), "gather_indexer_k_quant_cache": ("dst_k", "dst_scale"),
                "gather_mla_cache": ("out",)}
BACKENDS = {"cpu": {"set_mla_kv_buffer": ("jit", "torch"), "store_cache": ("jit", "torch"),
                    "quantize_and_insert_k_cache": ("torch",), "dequantize_and_gather_k_cache": ("torch",),
                    "indexer_k_quant_and_cache": ("jit", "torch"), "gather_indexer_k_quant_cache": ("jit", "torch"),
                    "gather_mla_cache": ("jit", "torch")},
            "cuda": {op: ("jit", "triton", "torch") for op in OPS}}


def make_args(op, device):
    """Keyword arguments of ``op`` on ``device``; store_cache quantizes to fp8 with tensor scales."""
    bf16 = torch.bfloat16
    if op == "set_mla_kv_buffer":
        return dict(kv_buffer=rand((64, 576), bf16, device), loc=slots(64, 8, torch.int64, device),
                    cache_k_nope=rand((8, 512), bf16, device), cache_k_rope=rand((8, 64), bf16, device))
    if op == "store_cache":
        return dict(k=rand((8, 2, 64), bf16, device), v=rand((8, 2, 64), bf16, device),
                    k_cache=rand((32, 2, 64), torch.float8_e4m3fn, device),
                    v_cache=rand((32, 2, 64), torch.float8_e4m3fn, device), slot_mapping=slots(32, 8, torch.int32, device),
                    kv_cache_dtype="fp8_e4m3", k_scale=torch.tensor([0.5], device=device),
                    v_scale=torch.tensor([2.0], device=device))
    if op.startswith(("indexer", "gather_indexer")):
        return _indexer_args(op, device)
    if op == "gather_mla_cache":  # fp8 e4m3 with a tensor scale, request 1 past its table (zero rows), rows 45+ untouched
        return dict(out=rand((50, 576), bf16, device), kv_cache=rand((6, 16, 576), torch.float8_e4m3fn, device),
                    block_table=torch.tensor([[3, 0, 5], [1, 2, 4]], dtype=torch.int32, device=device),
                    cu_seq_lens=torch.tensor([0, 20, 45], device=device),
                    seq_starts=torch.tensor([5, 30], dtype=torch.int32, device=device), kv_cache_dtype="fp8_e4m3",
                    scale=torch.tensor([0.37], device=device))
    cache = DSV4_K_CACHE.allocate(4, 64, device).random_(0, 256)
    if op == "quantize_and_insert_k_cache":
        return dict(k=rand((8, 512), bf16, device), k_cache=cache, slot_mapping=slots(256, 8, torch.int64, device),
                    block_size=64)
    return dict(out=rand((2, 100, 512), bf16, device), k_cache=cache,
                seq_lens=torch.tensor([90, 200], dtype=torch.int32, device=device),
                gather_lens=torch.tensor([70, 100], dtype=torch.int32, device=device),
                block_table=torch.tensor([[2, 0, 3, 1], [1, 3, 0, 2]], dtype=torch.int32, device=device),
                block_size=64, offset=0)


def _indexer_args(op, device):
    cache = INDEXER_K_CACHE.allocate(4, 64, device).random_(0, 256)
    if op == "indexer_k_quant_and_cache":
        return dict(k=rand((8, 128), torch.bfloat16, device), kv_cache=cache,
                    slot_mapping=slots(256, 8, torch.int64, device), block_size=64, scale_fmt="ue8m0")
    return dict(kv_cache=cache, dst_k=rand((100, 128), torch.float8_e4m3fn, device),
                dst_scale=rand((100, 4), torch.uint8, device),
                block_table=torch.tensor([[2, 0, 3, 1], [1, 3, 0, 2]], dtype=torch.int32, device=device),
                cu_seq_lens=torch.tensor([0, 70, 95], dtype=torch.int32, device=device), block_size=64)


def tensor_names(args):
    return [k for k, v in args.items() if isinstance(v, torch.Tensor)]


def message_name(name):
    """How errors name an argument (set_mla_kv_buffer's cache_k_nope/cache_k_rope: k_nope/k_rope)."""
    return name.removeprefix("cache_")


def run(op, args, backend=None):
    getattr(jitkv, op)(**args, backend=backend)


def expected(op, args):
    """The destinations after the torch reference ran on clones of them (same device)."""
    args = {**args, **{d: args[d].clone() for d in DESTINATIONS[op]}}
    getattr(reference, op)(**args)
    return [args[d] for d in DESTINATIONS[op]]
