"""Greedy decoding of a tiny random Qwen3 (GQA with QK-norm) with its attention prologue in one call,
``jitkv.rope_store_cache`` (per-head RMSNorm of q and k, RoPE, K/V write), into a paged cache; the tokens
are checked against ``transformers``' own ``generate``.

    python examples/qwen3_paged_decode.py [--device cpu|cuda] [--steps N]

Qwen3 normalizes every query and key head (``q_norm`` / ``k_norm``, an RMSNorm over head_dim) before
RoPE. Per layer, ``rope_store_cache`` takes the projections as they come, with the norms' weights and
epsilon: q is normed and rotated in place, k normed, rotated and written with v into
``[num_blocks, block_size, num_kv_heads, head_dim]`` caches at the tokens' slots (as in
``llama_paged_decode``). jitkv sums the squares in a fixed order (docs/design.md §9) where HF's mean
reduces in torch's order, so a normed value can differ in its last float32 bit; the tokens still match.
"""

from __future__ import annotations

import sys

import torch
from llama_paged_decode import LlamaPagedEngine, paged_attention
from paged_common import run
from transformers import Qwen3Config, Qwen3ForCausalLM

import jitkv


def build_model(seed: int = 0) -> Qwen3ForCausalLM:
    """A 2-layer Qwen3 with 4 query heads over 2 KV heads of 32 dims, random weights (norm weights too,
    so the norms matter), no download; initializer_range 0.2 and no EOS token as in
    llama_paged_decode.build_model."""
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.5, 1.5)
    return model


class Qwen3PagedEngine(LlamaPagedEngine):
    """The Llama engine's pool and attention, with Qwen3's QK-norm fused into the one jitkv call."""

    def attention(self, layer, attn, x, batch):
        t = x.shape[0]
        q = attn.q_proj(x).view(t, -1, attn.head_dim)
        k = attn.k_proj(x).view(t, -1, attn.head_dim)
        v = attn.v_proj(x).view(t, -1, attn.head_dim)
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
            q_norm_weight=attn.q_norm.weight,
            k_norm_weight=attn.k_norm.weight,
            eps=attn.q_norm.variance_epsilon,
        )
        out = paged_attention(q, self.k_cache[layer], self.v_cache[layer], batch, attn.scaling)
        return attn.o_proj(out)


def main(argv=None) -> int:
    return run(build_model, Qwen3PagedEngine, ("rope_store_cache",), __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
