"""The transfer section's baselines that are no jitkv op: vLLM swap_blocks' per-block cudaMemcpyAsync
loop (csrc/benchmark/block_memcpy_cuda.cu) and a GEMM's slowdown beside each transfer mechanism."""

from __future__ import annotations

import torch

import jitkv
from jitkv import codes

from .common import Row

GEMM = 4096  # a bf16 GEMM of GEMM^3: about 0.2 ms on an H100, a forward pass's largest kernels
GEMMS = 30  # GEMMs timed on the side stream
TRANSFERS = 120  # transfers queued beside them: more than the GEMMs' time, so that they overlap it all


def block_memcpy_spec(arch: str):
    from jitkv.jit import JitSpec

    return JitSpec("block_memcpy_cuda", ("benchmark/block_memcpy_cuda.cu",), target=arch, exports=("block_memcpy",))


def block_memcpy(src, dst, src_pages, dst_pages, device: int) -> None:
    """vLLM swap_blocks' loop: one cudaMemcpyAsync per (page, layer), ids on the host."""
    spec = block_memcpy_spec(jitkv.jit.cuda_arch(torch.device("cuda", device)))
    jitkv.jit.get_function(spec, "block_memcpy")(src, dst, src_pages, dst_pages, device)


def gemm_slowdown_rows(pools, transfer_pages, copy_engine) -> list[Row]:
    """The GEMM loop's µs on a side stream alone and while host -> device transfers of 64 MHA pages of
    16 tokens (K and V, 1024 tokens, 4 MiB) run on the current stream, by mechanism; "vs torch" is
    the GEMM alone over the GEMM beside the transfers (1.0: no slowdown)."""
    dev = tuple(d for d, _ in pools)
    host = tuple(h for _, h in pools)
    n = 64
    sp_h = torch.randperm(host[0].shape[1])[:n]
    dp_h = torch.randperm(dev[0].shape[1])[:n]
    sp_d, dp_d = sp_h.cuda(), dp_h.cuda()
    device = dev[0].device
    flat_h = torch.empty(n * 2 * 16 * 8 * 128 * 2, dtype=torch.uint8).pin_memory()
    flat_d = torch.empty_like(flat_h, device="cuda")
    ce = (copy_engine(device, device.index) or (None,))[0]
    mechanisms = [
        ("GEMM alone", None),
        ("beside torch contiguous pinned copy_", lambda: flat_d.copy_(flat_h, non_blocking=True)),
        (
            f"beside jitkv SM kernel (GPU ids, {codes.Transfer.LINK_SMS} SMs)",
            lambda: transfer_pages(host, dev, sp_d, dp_d),
        ),
    ]
    if ce is not None:
        mechanisms.append(
            (
                "beside jitkv copy engines (host ids)",
                lambda: ce(host[0], dev[0], host[1], dev[1], sp_h, dp_h, device.index, 0),
            )
        )
    a = torch.randn(GEMM, GEMM, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(GEMM, GEMM, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    rows, alone = [], None
    for name, transfer in mechanisms:
        us = min(_gemm_us(a, b, side, transfer) for _ in range(3))
        alone = us if alone is None else alone
        rows.append(Row("transfer_pages", f"bf16 GEMM {GEMM}^3 x {GEMMS} on a side stream", 0, name, us, 0, alone))
    return rows


def _gemm_us(a, b, side, transfer) -> float:
    """µs per GEMM of GEMMS on ``side``, with TRANSFERS calls of ``transfer`` queued on the current
    stream at the same time (both streams wait for the GPU to be idle first)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        start.record()
        for _ in range(GEMMS):
            torch.mm(a, b)
        end.record()
    if transfer is not None:
        for _ in range(TRANSFERS):
            transfer()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / GEMMS
