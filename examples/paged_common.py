"""What the paged-KV decode examples share: block tables and per-forward metadata, the decode loop
around a Hugging Face causal LM's own modules, the jitkv timer, the HF reference and the CLI.

A subclass of ``PagedEngine`` owns its KV pool and implements ``attention``: rotate q and k and write
the new K/V rows with one jitkv op, then attend over the pages through the block table. Everything else
(embeddings, norms, MLP, lm_head, and the rotary table, read once from the model's rotary module) is the
model's own modules, called on a flat batch of tokens.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch

import jitkv


@dataclass
class Batch:
    """One forward's tokens, flattened over requests: every prompt token at prefill (ragged, no
    padding), one token per request at decode. T tokens, B requests, C the longest context."""

    tokens: torch.Tensor  # [T] token ids
    positions: torch.Tensor  # [T] position of each token in its request
    req: torch.Tensor  # [T] request of each token
    slots: torch.Tensor  # [T] cache slot that receives each token's K/V row
    ctx_slots: torch.Tensor  # [B, C] slot of every context position of each request
    mask: torch.Tensor  # [T, C] token t attends context position c of its request iff c <= positions[t]
    last: torch.Tensor  # [B] index of each request's last token in T (its logits give the next token)


class BlockTable:
    """Pages for a set of requests. Blocks come off a free list in random order, one block whenever
    a request's length crosses a block boundary, so a request's pages are scattered over the pool
    and only the table says where its position p lives: slot = table[req, p // bs] * bs + p % bs."""

    def __init__(self, num_requests: int, num_blocks: int, block_size: int, gen: torch.Generator):
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_size = block_size
        self.table = torch.full((num_requests, num_blocks), -1, dtype=torch.int64)
        self.lens = [0] * num_requests  # tokens each request has in the cache (after this forward)
        self.num_blocks_of = [0] * num_requests

    def _grow(self, req: int, length: int) -> None:
        while self.num_blocks_of[req] * self.block_size < length:
            if not self.free:
                raise RuntimeError("KV pool exhausted: pass a larger num_blocks")
            self.table[req, self.num_blocks_of[req]] = self.free.pop()
            self.num_blocks_of[req] += 1

    def admit(self, req: int, length: int) -> torch.Tensor:
        """Pages for request ``req`` holding ``length`` tokens whose K/V arrive from elsewhere (a
        prefill on another GPU): its block ids, in position order, [ceil(length / block_size)]."""
        self._grow(req, length)
        self.lens[req] = length
        return self.pages(req)

    def pages(self, req: int) -> torch.Tensor:
        """Request ``req``'s block ids in position order (int64, on the host)."""
        return self.table[req, : self.num_blocks_of[req]].clone()

    def batch(self, new_tokens: list[list[int]], device: torch.device) -> Batch:
        """Append new_tokens[b] to request b and describe the forward that processes them.

        Metadata is built on the host and copied once, as serving engines do; the kernels then need
        no host sync."""
        bs = self.block_size
        req, pos, last = [], [], []
        for b, toks in enumerate(new_tokens):
            start = self.lens[b]
            self._grow(b, start + len(toks))
            req += [b] * len(toks)
            pos += range(start, start + len(toks))
            last.append(len(req) - 1)
            self.lens[b] = start + len(toks)
        req_t, pos_t = torch.tensor(req), torch.tensor(pos)
        ctx = torch.arange(max(self.lens))
        # Table entries past a request's last block are -1; clamped to a real slot, they are only
        # ever read at masked positions.
        ctx_slots = self.table[:, ctx // bs].clamp(min=0) * bs + ctx % bs
        batch = Batch(
            tokens=torch.tensor([t for toks in new_tokens for t in toks]),
            positions=pos_t,
            req=req_t,
            slots=self.table[req_t, pos_t // bs] * bs + pos_t % bs,
            ctx_slots=ctx_slots,
            mask=ctx[None, :] <= pos_t[:, None],
            last=torch.tensor(last),
        )
        return Batch(**{name: t.to(device) for name, t in vars(batch).items()})


class JitkvTimer:
    """Time spent in jitkv calls, wrapped as ``timer(jitkv.op, *args)``.

    CPU: the ops run synchronously on the calling thread, so perf_counter around a call is its
    whole cost. CUDA: the launch returns before the kernel runs, so a host clock would miss the
    kernel; instead a pair of CUDA events is recorded around each call on the current stream and read
    after the loop's final synchronize. The pair spans the stream time from just before the call's
    kernel to just after it; when the GPU waits on the host (this tiny model is launch-bound) that
    includes the call's host-side dispatch and launch, i.e. what the op costs the step. Events
    avoid a synchronize per call, which would stall the pipeline and inflate the step time the
    share is taken of."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self._host_s = 0.0
        self._events = []

    def __call__(self, fn, *args, **kwargs):
        self.calls += 1
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self._events.append((start, end))
            return out
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self._host_s += time.perf_counter() - t0
        return out

    def seconds(self) -> float:
        """Total so far; on CUDA only once the recorded work has completed (synchronize first)."""
        return self._host_s + sum(s.elapsed_time(e) for s, e in self._events) / 1e3


@dataclass
class DecodeStats:
    tokens: int  # tokens produced by the decode loop (prefill's first token excluded)
    seconds: float  # wall time of the decode loop
    jitkv_seconds: float  # time inside jitkv calls during the decode loop
    jitkv_calls: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PagedEngine:
    """Greedy decoding of a decoder-only HF model (``model.model.layers`` of pre-norm blocks with
    ``self_attn`` and ``mlp``) over a paged KV pool of ``num_blocks`` blocks of ``block_size`` slots.

    Subclasses allocate the pool in ``__init__`` as ``self.pools`` (a layer-first pool
    ``[layers, num_blocks, block_size, ...]`` or a tuple of them, the layout of jitkv's page
    transfers) and implement ``attention``."""

    def __init__(self, model, *, num_blocks: int, block_size: int, seed: int = 0):
        self.model = model
        self.device = model.device
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Each generate() draws a fresh block order, so a run never finds the previous run's rows
        # at the slots it reads.
        self._block_order = torch.Generator().manual_seed(seed)
        self.timer = JitkvTimer(self.device)
        self.cos_sin_cache = cos_sin_cache(model)

    def attention(self, layer: int, attn, x: torch.Tensor, batch: Batch):
        """Self-attention of layer ``layer`` (its HF module ``attn``) for x [T, hidden]: RoPE at
        ``batch.positions`` from ``self.cos_sin_cache``. Returns [T, hidden]."""
        raise NotImplementedError

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """The next token of every request: [B] greedy argmax."""
        inner = self.model.model
        h = inner.embed_tokens(batch.tokens)
        for i, layer in enumerate(inner.layers):
            h = h + self.attention(i, layer.self_attn, layer.input_layernorm(h), batch)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        # Only each request's last token needs logits (as HF generate computes them).
        logits = self.model.lm_head(inner.norm(h[batch.last]))
        return logits.argmax(-1)

    def generate(self, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], DecodeStats]:
        """``steps`` greedy tokens for each prompt: one prefill of all prompts in one ragged batch,
        then ``steps - 1`` batched decode forwards. Each call starts with an empty pool."""
        pages = BlockTable(len(prompts), self.num_blocks, self.block_size, self._block_order)
        nxt = self.forward(pages.batch(prompts, self.device)).tolist()
        self.timer.reset()
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.decode(pages, nxt, steps)
        _sync(self.device)
        seconds = time.perf_counter() - t0
        stats = DecodeStats(len(prompts) * (steps - 1), seconds, self.timer.seconds(), self.timer.calls)
        return out, stats

    def decode(self, pages: BlockTable, first: list[int], steps: int) -> list[list[int]]:
        """Each request of ``pages`` from its first token ``first[b]`` (its prompt's K/V already in the
        pool): ``steps - 1`` batched decode forwards, ``steps`` tokens per request."""
        out = [[t] for t in first]
        nxt = first
        for _ in range(steps - 1):
            # .tolist() is the loop's one host sync per step: the engine needs the tokens to
            # build the next batch's metadata on the host.
            nxt = self.forward(pages.batch([[t] for t in nxt], self.device)).tolist()
            for seq, t in zip(out, nxt):
                seq.append(t)
        return out


@torch.inference_mode()
def cos_sin_cache(model) -> torch.Tensor:
    """[max_position_embeddings, rotary dim]: cos half then sin half, the table the jitkv rope ops read,
    from the model's own rotary module (HF repeats each frequency in both halves; one half of each is the
    table), in the model's dtype."""
    positions = torch.arange(model.config.max_position_embeddings, device=model.device)[None]
    cos, sin = model.model.rotary_emb(torch.empty(0, device=model.device, dtype=model.dtype), positions)
    half = cos.shape[-1] // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1)


def blocks_needed(prompts: list[list[int]], steps: int, block_size: int) -> int:
    return sum(math.ceil((len(p) + steps) / block_size) for p in prompts)


def random_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """The reference: HF ``generate`` with greedy search and its default (dynamic) cache, one prompt
    at a time (batch 1, no padding), so nothing about our batching or paging is assumed."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False)
    new = out[0, len(prompt) :].tolist()
    if len(new) != steps:  # the examples' configs have no EOS token, so generate never stops early
        raise RuntimeError(f"HF generate stopped after {len(new)} of {steps} tokens")
    return new


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_args(description: str, argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", choices=("cpu", "cuda"), default=default_device())
    p.add_argument("--steps", type=int, default=16, help="tokens generated per prompt (default 16)")
    p.add_argument("--prompt-lens", default="5,12,3,9", help="comma-separated prompt lengths, one batch")
    p.add_argument("--block-size", type=int, default=4, help="tokens per KV block (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts and block order")
    # A model this small gains nothing from intra-op threads, and on a busy machine the thread
    # pool's barriers make the step time depend on other processes (measured: up to 100x slower
    # with 2 threads on 2 shared cores, steady with 1).
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    args.prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    if min(args.steps, *args.prompt_lens, args.block_size, args.threads) < 1:
        p.error("--steps, --prompt-lens, --block-size and --threads must be positive")
    return args


def run(build_model, engine_cls, ops: tuple[str, ...], description: str, argv=None) -> int:
    """The examples' main: build the model, decode with the engine, compare with HF, report.
    Returns the exit status: 0 if every prompt's tokens equal HF's, 1 otherwise."""
    args = parse_args(description, argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(build_model, engine_cls, ops, args)
    finally:  # main() may be called from a longer-lived process (the tests)
        torch.set_num_threads(threads)


def _run(build_model, engine_cls, ops, args) -> int:
    device = torch.device(args.device)
    model = build_model(args.seed).to(device)
    prompts = random_prompts(args.prompt_lens, model.config.vocab_size, args.seed)
    # Twice the blocks the prompts need, so that their pages are scattered over a sparse pool.
    num_blocks = 2 * blocks_needed(prompts, args.steps, args.block_size)
    engine = engine_cls(model, num_blocks=num_blocks, block_size=args.block_size, seed=args.seed)

    # The first run builds jitkv's kernels for these shapes (JIT, cached on disk) and warms torch;
    # the second is the one timed and compared.
    engine.generate(prompts, min(args.steps, 2))
    tokens, stats = engine.generate(prompts, args.steps)

    ok = True
    print(
        f"{type(model).__name__} on {device}, float32, {len(prompts)} prompts in one batch, "
        f"block size {args.block_size}, {num_blocks} blocks in random order"
    )
    for prompt, got in zip(prompts, tokens):
        ref = hf_greedy(model, prompt, args.steps)
        ok &= got == ref
        verdict = "matches HF generate" if got == ref else f"MISMATCH, HF generate gives {ref}"
        print(f"  prompt of {len(prompt):3d} tokens -> {got}  {verdict}")
    if stats.tokens:
        # backend_info is keyed by the device as the op saw it: "cpu" or "cuda:<index>".
        key = (
            "cpu"
            if device.type == "cpu"
            else f"cuda:{torch.cuda.current_device() if device.index is None else device.index}"
        )
        backends = ", ".join(f"{op}: {jitkv.backend_info()[op][key]['backend']}" for op in ops)
        print(
            f"decode loop: {stats.tokens} tokens in {stats.seconds * 1e3:.1f} ms = "
            f"{stats.tokens / stats.seconds:.0f} tokens/s; jitkv ops {stats.jitkv_seconds / stats.seconds:.1%} "
            f"of step time ({stats.jitkv_calls} calls, {stats.jitkv_seconds / stats.jitkv_calls * 1e6:.1f} us "
            f"each; {backends})"
        )
    print("all prompts match HF generate" if ok else "MISMATCH with HF generate")
    return 0 if ok else 1
