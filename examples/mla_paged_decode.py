"""Greedy decoding of a tiny random DeepSeek-V3 (MLA) with RoPE and its compressed KV write in one call,
``jitkv.rope_set_mla_kv_buffer``, into a paged cache; the tokens are checked against ``transformers``' own
``generate``.

    python examples/mla_paged_decode.py [--device cpu|cuda] [--steps N]

MLA caches one row per token for all heads: the normalized latent ``kv_c`` (kv_lora_rank) and the
rotated shared key ``k_pe`` (qk_rope_head_dim). Per layer, ``rope_set_mla_kv_buffer`` rotates the
queries' ``q_pe`` in place and ``k_pe`` at the tokens' positions and scatters ``[kv_c | rope(k_pe)]`` rows
into a ``[num_blocks * block_size, kv_lora_rank + qk_rope_head_dim]`` buffer at
``slot = block_table[req, pos // block_size] * block_size + pos % block_size`` (blocks in random order),
and attention reads each request's rows back through its block table. DeepSeek's interleaved rope
(``rope_interleave``) is GPT-J's pairs; HF computes it on a de-interleaved copy, so its rotated values
come out permuted, the same permutation for q and k: the scores are the same sums in another order.

Attention is computed in the absorbed form, straight on the cached rows. Per head h, kv_b_proj
holds W_UK[h] (latent -> key nope part) and W_UV[h] (latent -> value). Since
``q_nope . (W_UK[h] kv_c) = (W_UK[h]^T q_nope) . kv_c``, the query is moved into latent space once
per token, ``[W_UK^T q_nope | q_pe]``, and its dot with a cached row ``[kv_c | k_pe]`` is the full
score; the softmax-weighted sum of the rows' ``kv_c`` is up-projected by W_UV[h] once per token.
Nothing is expanded per context position (the up-projecting form would run kv_b_proj over the
whole context at every step), and the attention is MQA with one shared head of the row's width,
the form serving kernels use for MLA decode.
"""

from __future__ import annotations

import sys

import torch
from paged_common import Batch, PagedEngine, run
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

import jitkv


def build_model(seed: int = 0) -> DeepseekV3ForCausalLM:
    """A 2-layer DeepSeek-V3 with 4 heads, q_lora_rank 48, kv_lora_rank 32, rope 16, nope 32,
    v 32, random weights, no download. first_k_dense_replace = num_hidden_layers makes every MLP
    dense (no MoE: the example is about the KV cache; a MoE layer would go through the same
    ``layer.mlp`` call). initializer_range 0.2 and no EOS token for the reasons given in
    llama_paged_decode.build_model."""
    config = DeepseekV3Config(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        first_k_dense_replace=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(config).float().eval()


def paged_mla_attention(q_nope, q_pe, kv_buffer, w_uk, w_uv, batch: Batch, scale: float):
    """Causal absorbed MLA attention over a paged latent buffer.

    q_nope [T, H, nope], q_pe [T, H, rope]; kv_buffer [num_slots, r + rope] rows ``[kv_c | k_pe]``;
    w_uk [H, nope, r], w_uv [H, v, r] (kv_b_proj's weight split per head). Returns [T, H * v]."""
    t = q_nope.shape[0]
    r = w_uk.shape[-1]
    q = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)  # [T, H, r + rope]
    rows = kv_buffer[batch.ctx_slots[batch.req]]  # [T, C, r + rope]
    scores = torch.einsum("thk,tck->thc", q, rows) * scale
    scores = scores.masked_fill(~batch.mask[:, None, :], float("-inf"))
    latent = torch.einsum("thc,tcr->thr", scores.softmax(-1), rows[..., :r])  # [T, H, r]
    return torch.einsum("thr,hvr->thv", latent, w_uv).reshape(t, -1)


class MlaPagedEngine(PagedEngine):
    def __init__(self, model, *, num_blocks: int, block_size: int, seed: int = 0):
        super().__init__(model, num_blocks=num_blocks, block_size=block_size, seed=seed)
        cfg = model.config
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        shape = (cfg.num_hidden_layers, num_blocks, block_size, width)
        gen = torch.Generator().manual_seed(seed)
        # Random garbage rather than zeros, so that a read of a slot nobody wrote changes the tokens.
        # One layer-first pool [layers, num_blocks, block_size, width] (the layout jitkv.transfer_pages
        # and pack_pages move pages of, see pd_handoff.py); each layer's buffer is a view of it.
        self.pools = torch.randn(shape, generator=gen).to(model.device, model.dtype)
        self.kv_buffer = [pool.view(num_blocks * block_size, width) for pool in self.pools.unbind(0)]
        # Views of each layer's kv_b_proj weight [H * (nope + v), r], split per head.
        self.w_uk, self.w_uv = [], []
        for layer in model.model.layers:
            attn = layer.self_attn
            nope, v = attn.qk_nope_head_dim, attn.v_head_dim
            w_uk, w_uv = attn.kv_b_proj.weight.view(attn.num_heads, nope + v, attn.kv_lora_rank).split([nope, v], dim=1)
            self.w_uk.append(w_uk)
            self.w_uv.append(w_uv)

    def attention(self, layer, attn, x, batch):
        t = x.shape[0]
        nope, rope = attn.qk_nope_head_dim, attn.qk_rope_head_dim
        q = attn.q_proj(x) if attn.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        q_nope, q_pe = q.view(t, -1, nope + rope).split([nope, rope], dim=-1)
        kv_c, k_pe = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, rope], dim=-1)
        kv_c = attn.kv_a_layernorm(kv_c)
        # q_pe (a view into q) rotated in place; [kv_c | rope(k_pe)] into the buffer.
        self.timer(
            jitkv.rope_set_mla_kv_buffer,
            self.kv_buffer[layer],
            batch.slots,
            kv_c,
            k_pe,
            batch.positions,
            self.cos_sin_cache,
            is_neox=not attn.config.rope_interleave,
            q_pe=q_pe,
        )
        out = paged_mla_attention(
            q_nope, q_pe, self.kv_buffer[layer], self.w_uk[layer], self.w_uv[layer], batch, attn.scaling
        )
        return attn.o_proj(out)


def main(argv=None) -> int:
    return run(build_model, MlaPagedEngine, ("rope_set_mla_kv_buffer",), __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
