"""Prefill on one GPU, decode on another: each request's KV pages of every layer packed into one buffer by
``jitkv.pack_pages``, sent with ``torch.distributed`` (NCCL send/recv), unpacked by ``jitkv.unpack_pages``
into the decode GPU's pool under its own block table; the tokens are checked against ``transformers``'
greedy ``generate``.

    python examples/pd_handoff.py [--model llama|mla] [--device cuda|cpu] [--steps N]
    python examples/pd_handoff.py --bench [--bench-tokens 32768]

Two processes: this one is the prefill rank (``cuda:0``), a spawned one the decode rank (``cuda:1``); on CPU
both run on the host and talk through the gloo backend. Both build the same tiny random-weight model (the
engines of ``llama_paged_decode`` and ``mla_paged_decode``, one seed, so the same weights). The prefill
rank runs the batched prefill into its pool, whose blocks come off its free list in one random order, and
sends each request as a header (prompt length, first token) and its pages in the pack format
``[pages, K, layers, *page]`` (docs/design.md §2). The decode rank takes blocks for the request from its
own free list, in another random order, unpacks into them, and runs the decode loop; its tokens go back
to the prefill rank, which compares them with HF generate. NCCL moves every byte between the GPUs; jitkv
packs and unpacks.

``--bench`` times the handoff of one request of ``--bench-tokens`` tokens for two KV geometries
(Llama-3-8B: 32 layers, K and V of 8 x 128 bf16 per token, 16-token pages; DeepSeek-V3: 61 layers, 576 bf16
per token, 64-token pages), its pages scattered over pools of twice their count: pack, send and unpack in
one piece, and pipelined in chunks (a prefix of pages is a prefix of the pack buffer, so chunk i is sent
while chunk i + 1 is packed, and unpacked while chunk i + 1 arrives), against NCCL's send of the same
bytes already contiguous. Wall time from a barrier to a barrier after both ranks synchronized, median
of ``--bench-reps``. The decode rank checks its pages bitwise against the source pages (rebuilt there
from the same seed) after every timed method.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import socket
import sys
import time

import llama_paged_decode
import mla_paged_decode
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from paged_common import BlockTable, blocks_needed, hf_greedy, random_prompts

import jitkv

PREFILL, DECODE = 0, 1
MODELS = {
    "llama": (llama_paged_decode.build_model, llama_paged_decode.LlamaPagedEngine),
    "mla": (mla_paged_decode.build_model, mla_paged_decode.MlaPagedEngine),
}
# --bench geometries: (layers, page shape [tokens, ...], pools: 2 for K and V, 1 for MLA rows)
GEOMETRIES = {
    "Llama-3-8B MHA: 32 layers, K and V 8 x 128 bf16, 16-token pages": (32, (16, 8, 128), 2),
    "DeepSeek-V3 MLA: 61 layers, 576 bf16, 64-token pages": (61, (64, 576), 1),
}


def pack_buffer(pools, num_pages: int) -> torch.Tensor:
    """An empty pack buffer for ``num_pages`` pages of ``pools`` (a layer-first pool ``[L, P, *page]`` or
    a tuple of K of them) on their device: ``[num_pages, L, *page]`` or ``[num_pages, K, L, *page]``."""
    first = pools[0] if isinstance(pools, tuple) else pools
    per_page = ((len(pools),) if isinstance(pools, tuple) else ()) + (first.shape[0], *first.shape[2:])
    return torch.empty((num_pages, *per_page), dtype=first.dtype, device=first.device)


def as_tuple(pools) -> tuple:
    return pools if isinstance(pools, tuple) else (pools,)


# ------------------------------------------------------------------------------------------ ranks


def init_rank(rank: int, device_type: str, port: int) -> torch.device:
    """Join the two-rank group (NCCL on GPUs, gloo on CPU); returns this rank's device."""
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
        device_id=device if device.type == "cuda" else None,
    )
    return device


def decode_rank(args: argparse.Namespace, port: int) -> None:
    """The spawned process: the decode rank."""
    torch.set_num_threads(args.threads)
    device = init_rank(DECODE, args.device, port)
    try:
        bench(DECODE, device, args) if args.bench else decode(device, args)
    finally:
        dist.destroy_process_group()


def make_engine(args, device, seed):
    build_model, engine_cls = MODELS[args.model]
    model = build_model(args.seed).to(device)
    num_blocks = 2 * blocks_needed([[0] * n for n in args.prompt_lens], args.steps, args.block_size)
    return engine_cls(model, num_blocks=num_blocks, block_size=args.block_size, seed=seed)


def prefill(device, args) -> int:
    """The prefill rank: prefill every prompt, hand each request to the decode rank, compare its tokens
    with HF generate. Returns the exit status."""
    engine = make_engine(args, device, args.seed)
    prompts = random_prompts(args.prompt_lens, engine.model.config.vocab_size, args.seed)
    table = BlockTable(len(prompts), engine.num_blocks, args.block_size, torch.Generator().manual_seed(args.seed))
    first = engine.forward(table.batch(prompts, device))
    for b, prompt in enumerate(prompts):
        pages = table.pages(b).to(device)
        buf = pack_buffer(engine.pools, len(pages))
        jitkv.pack_pages(engine.pools, pages, buf)
        dist.send(torch.cat([torch.tensor([len(prompt)], device=device), first[b : b + 1]]), DECODE)
        dist.send(buf, DECODE)
    tokens = torch.empty((len(prompts), args.steps), dtype=torch.int64, device=device)
    dist.recv(tokens, DECODE)

    ok = True
    model = engine.model
    print(
        f"{type(model).__name__}: prefill on {device}, decode on the other rank, {len(prompts)} requests, "
        f"block size {args.block_size}, each request's pages in one pack buffer over "
        f"{dist.get_backend()} (pack format {list(pack_buffer(engine.pools, 1).shape[1:])} per page)"
    )
    for prompt, got in zip(prompts, tokens.tolist()):
        ref = hf_greedy(model, prompt, args.steps)
        ok &= got == ref
        verdict = "matches HF generate" if got == ref else f"MISMATCH, HF generate gives {ref}"
        print(f"  prompt of {len(prompt):3d} tokens -> {got}  {verdict}")
    print("all requests match HF generate" if ok else "MISMATCH with HF generate")
    return 0 if ok else 1


def decode(device, args) -> None:
    """The decode rank: receive each request's pages into blocks of its own, decode, send the tokens."""
    # Another seed: other garbage in the pool and another block order than the prefill rank's.
    engine = make_engine(args, device, args.seed + 1)
    table = BlockTable(
        len(args.prompt_lens), engine.num_blocks, args.block_size, torch.Generator().manual_seed(args.seed + 1)
    )
    first = []
    for b in range(len(args.prompt_lens)):
        header = torch.empty(2, dtype=torch.int64, device=device)
        dist.recv(header, PREFILL)
        length, token = header.tolist()
        pages = table.admit(b, length).to(device)
        buf = pack_buffer(engine.pools, len(pages))
        dist.recv(buf, PREFILL)
        if not args.drop_kv:
            jitkv.unpack_pages(buf, engine.pools, pages)
        first.append(token)
    dist.send(torch.tensor(engine.decode(table, first, args.steps), device=device), PREFILL)


# ------------------------------------------------------------------------------------------ bench


def bench(rank: int, device: torch.device, args) -> int:
    """Both ranks run this; the prefill rank prints the table. Returns the exit status (1 if a check
    on the decode rank failed)."""
    rows, ok = [], True
    for name, (layers, page, npools) in GEOMETRIES.items():
        row, good = bench_geometry(rank, device, args, layers, page, npools)
        rows.append({"geometry": name, **row})
        ok &= good
    if rank == PREFILL:
        print_bench(rows, device, args)
    return 0 if ok else 1


def bench_geometry(rank, device, args, layers, page, npools):
    n = math.ceil(args.bench_tokens / page[0])
    ids = torch.Generator().manual_seed(2)
    src_pages, dst_pages = torch.randperm(2 * n, generator=ids)[:n], torch.randperm(2 * n, generator=ids)[:n]
    src_pages, dst_pages = src_pages.to(device), dst_pages.to(device)
    src = pools_of(device, layers, 2 * n, page, npools, seed=3)  # the prefill pool; rebuilt on decode to check
    dst = pools_of(device, layers, 2 * n, page, npools, seed=4) if rank == DECODE else None
    buf = pack_buffer(src, n)
    flat = torch.empty(buf.numel() * buf.element_size(), dtype=torch.uint8, device=device)

    def contiguous():
        dist.send(flat, DECODE) if rank == PREFILL else dist.recv(flat, PREFILL)

    def one_piece():
        if rank == PREFILL:
            jitkv.pack_pages(src, src_pages, buf, max_sms=args.bench_max_sms)
            dist.send(buf, DECODE)
        else:
            dist.recv(buf, PREFILL)
            jitkv.unpack_pages(buf, dst, dst_pages, max_sms=args.bench_max_sms)

    def pipelined(chunks):
        bounds = [n * i // chunks for i in range(chunks + 1)]
        spans = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
        # A tag per chunk: gloo matches messages by tag (NCCL by order). Each work is waited once.
        if rank == PREFILL:
            works = []
            for tag, (a, b) in enumerate(spans):
                jitkv.pack_pages(src, src_pages[a:b], buf[a:b], max_sms=args.bench_max_sms)
                works.append(dist.isend(buf[a:b], DECODE, tag=tag))
            for work in works:
                work.wait()
        else:
            # Every receive posted first: a receive posted after an unpack would wait for it.
            works = [dist.irecv(buf[a:b], PREFILL, tag=tag) for tag, (a, b) in enumerate(spans)]
            for (a, b), work in zip(spans, works):
                work.wait()
                jitkv.unpack_pages(buf[a:b], dst, dst_pages[a:b], max_sms=args.bench_max_sms)

    methods = [("send, contiguous", contiguous, False), ("pack + send + unpack", one_piece, True)]
    methods += [(f"pipelined, {c} chunks", lambda c=c: pipelined(c), True) for c in args.bench_chunks]
    row, ok = {"bytes": flat.numel(), "pages": n}, True
    for label, fn, moves_pages in methods:
        if rank == DECODE and moves_pages:
            for pool in as_tuple(dst):
                pool[:, dst_pages] = torch.randn_like(pool[:, dst_pages])  # fresh poison per method
        row[label] = median_seconds(device, fn, args.bench_reps)
        if moves_pages:
            ok &= pages_arrived(rank, device, src, dst, src_pages, dst_pages, label)
    return row, ok


def pools_of(device, layers, pages, page, npools, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    made = tuple(
        torch.randn((layers, pages, *page), generator=gen, device=device, dtype=torch.bfloat16) for _ in range(npools)
    )
    return made if npools > 1 else made[0]


def pages_arrived(rank, device, src, dst, src_pages, dst_pages, label) -> bool:
    """On the decode rank, whether every moved page equals its source page bitwise; the verdict is
    shared with the prefill rank."""
    ok = torch.tensor([1], device=device)
    if rank == DECODE:
        same = all(torch.equal(d[:, dst_pages], s[:, src_pages]) for s, d in zip(as_tuple(src), as_tuple(dst)))
        ok.fill_(int(same))
    dist.broadcast(ok, DECODE)
    if not ok.item() and rank == PREFILL:
        print(f"MISMATCH: {label}: the decode pool's pages differ from the source pages")
    return bool(ok.item())


def median_seconds(device, fn, reps) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda *a: None
    times = []
    for _ in range(reps + 1):  # the first is a warm-up (communicator set-up, first launches)
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync(device)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[reps // 2]


def print_bench(rows, device, args) -> None:
    names = [torch.cuda.get_device_name(i) for i in (0, 1)] if device.type == "cuda" else ["cpu", "cpu"]
    link = ""
    if device.type == "cuda":
        link = f", peer access {'yes' if torch.cuda.can_device_access_peer(0, 1) else 'no'}"
    sms = "every SM" if args.bench_max_sms is None else f"{args.bench_max_sms} SMs"
    print(
        f"handoff of one {args.bench_tokens}-token request: {names[0]} -> {names[1]}{link}, "
        f"backend {dist.get_backend()}, pack and unpack on {sms}"
    )
    methods = [k for k in rows[0] if k not in ("geometry", "bytes", "pages")]
    base = methods[0]
    print("| geometry | MiB | pages | " + " | ".join(methods) + " |")
    print("|---|---|---|" + "---|" * len(methods))
    for row in rows:
        cells = [f"{row[base] * 1e3:.2f} ms ({row['bytes'] / row[base] / 1e9:.1f} GB/s)"]
        cells += [f"{row[m] * 1e3:.2f} ms ({row[m] / row[base]:.2f}x)" for m in methods[1:]]
        print(f"| {row['geometry']} | {row['bytes'] / 2**20:.0f} | {row['pages']} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"devices": names, "tokens": args.bench_tokens, "rows": rows}, f, indent=1)


# ------------------------------------------------------------------------------------------ main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.device_count() >= 2 else "cpu")
    p.add_argument("--model", choices=tuple(MODELS), default="llama")
    p.add_argument("--steps", type=int, default=16, help="tokens generated per prompt (default 16)")
    p.add_argument("--prompt-lens", default="5,12,3,9", help="comma-separated prompt lengths")
    p.add_argument("--block-size", type=int, default=4, help="tokens per KV block (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank (default 1)")
    p.add_argument(
        "--drop-kv",
        action="store_true",
        help="receive the pages but do not unpack them: the decode rank attends over its pool's garbage and "
        "the tokens differ from HF generate (shows that the match depends on the handoff)",
    )
    p.add_argument("--bench", action="store_true", help="time the handoff instead of decoding")
    p.add_argument("--bench-tokens", type=int, default=32768)
    p.add_argument("--bench-chunks", default="8,32", help="chunk counts of the pipelined handoff")
    p.add_argument("--bench-reps", type=int, default=5)
    p.add_argument(
        "--bench-max-sms", type=int, help="SMs of the pack and unpack kernels (default: every SM, jitkv's default)"
    )
    p.add_argument("--json", help="--bench: also write the rows here")
    args = p.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        p.error(f"--device cuda needs two GPUs, found {torch.cuda.device_count()}")
    args.prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    args.bench_chunks = [int(c) for c in args.bench_chunks.split(",")]
    if min(args.steps, *args.prompt_lens, args.block_size, args.threads, args.bench_tokens, *args.bench_chunks) < 1:
        p.error("--steps, --prompt-lens, --block-size, --threads, --bench-tokens and --bench-chunks must be positive")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    port = free_port()
    child = mp.get_context("spawn").Process(target=decode_rank, args=(args, port))
    child.start()
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        device = init_rank(PREFILL, args.device, port)
        try:
            status = bench(PREFILL, device, args) if args.bench else prefill(device, args)
        finally:
            dist.destroy_process_group()
    finally:
        torch.set_num_threads(threads)
        child.join()
    if child.exitcode != 0:
        print(f"the decode rank exited with status {child.exitcode}")
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
