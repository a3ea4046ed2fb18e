"""Greedy decoding of a tiny random Llama (GQA) with RoPE and its K/V write in one call,
``jitkv.rope_store_cache``, into a paged cache; the tokens are checked against ``transformers``' own
``generate``.

    python examples/llama_paged_decode.py [--device cpu|cuda] [--steps N]

The engine (``LlamaPagedEngine``) runs the HF model's modules (embeddings, norms, q/k/v/o
projections, MLP, lm_head) on a flat batch of tokens from prompts of different lengths. Per layer,
``rope_store_cache`` rotates q in place and k at the tokens' positions (the cos/sin table read once from
the model's rotary module) and scatters the rotated K and V rows into
``[num_blocks, block_size, num_kv_heads, head_dim]`` caches at
``slot = block_table[req, pos // block_size] * block_size + pos % block_size``; attention gathers each
request's context back through its block table. One attention path serves prefill (all prompt tokens,
causal) and decode (one token per request).
"""

from __future__ import annotations

import sys

import torch
from paged_common import Batch, PagedEngine, run
from transformers import LlamaConfig, LlamaForCausalLM

import jitkv


def build_model(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama with GQA (4 query heads over 2 KV heads of 32), random weights, no download.
    initializer_range 0.2 instead of 0.02: at the default the random model soon repeats one
    token, so the comparison would barely depend on attention; at 0.2 its tokens keep changing and
    the top-2 logit margins stay around 1e-2, far above float32 rounding. No EOS token, so HF
    generate runs every step."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().eval()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Batch, scale: float):
    """Causal GQA attention of q [T, Hq, D] over paged caches [num_blocks, block_size, Hkv, D].

    Each token reads its request's context through the block table (``batch.ctx_slots`` holds the
    slot of every context position) and masks positions after its own. Query head h uses KV head
    h // (Hq / Hkv). Returns [T, Hq * D]."""
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    slots = batch.ctx_slots[batch.req]  # [T, C]
    k = k_cache.flatten(0, 1)[slots]  # [T, C, Hkv, D]
    v = v_cache.flatten(0, 1)[slots]
    q = q.view(t, hkv, hq // hkv, d)
    scores = torch.einsum("tkgd,tckd->tkgc", q, k) * scale
    scores = scores.masked_fill(~batch.mask[:, None, None, :], float("-inf"))
    return torch.einsum("tkgc,tckd->tkgd", scores.softmax(-1), v).reshape(t, hq * d)


class LlamaPagedEngine(PagedEngine):
    def __init__(self, model, *, num_blocks: int, block_size: int, seed: int = 0):
        super().__init__(model, num_blocks=num_blocks, block_size=block_size, seed=seed)
        cfg = model.config
        shape = (cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        gen = torch.Generator().manual_seed(seed)

        # The pool starts as random garbage, not zeros: a read of a slot nobody wrote (a wrong
        # block or offset) then changes the tokens instead of passing unnoticed.
        def garbage():
            return torch.randn(shape, generator=gen).to(model.device, model.dtype)

        # One layer-first pool per K and V, [layers, num_blocks, block_size, Hkv, D] (the layout
        # jitkv.transfer_pages and pack_pages move pages of, see pd_handoff.py); each layer's cache
        # is a view of it.
        self.pools = (garbage(), garbage())
        self.k_cache, self.v_cache = (list(pool.unbind(0)) for pool in self.pools)

    def attention(self, layer, attn, x, batch):
        t = x.shape[0]
        q = attn.q_proj(x).view(t, -1, attn.head_dim)
        k = attn.k_proj(x).view(t, -1, attn.head_dim)
        v = attn.v_proj(x).view(t, -1, attn.head_dim)
        # q rotated in place; rotated k and v into the paged caches (HF's Llama rotates NeoX halves).
        self.timer(
            jitkv.rope_store_cache,
            q,
            k,
            v,
            self.k_cache[layer],
            self.v_cache[layer],
            batch.slots,
            batch.positions,
            self.cos_sin_cache,
            is_neox=True,
        )
        out = paged_attention(q, self.k_cache[layer], self.v_cache[layer], batch, attn.scaling)
        return attn.o_proj(out)


def main(argv=None) -> int:
    return run(build_model, LlamaPagedEngine, ("rope_store_cache",), __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
