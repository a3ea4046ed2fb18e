"""Triton fallback of set_mla_kv_buffer: kv_buffer[loc[i], :nope | nope:nope+rope] = k_nope[i] | k_rope[i].

One program per row with BLOCK = next_power_of_2(nope + rope) lanes: lanes below `nope` load from
k_nope, the next `rope` lanes from k_rope (masked loads, so a row whose nope/rope boundary falls
inside a vector, e.g. 528 + 128 bytes, needs no special case), and one masked store writes the row.
A slot < 0, == skip_slot or >= num_slots masks every load and store off. Strides are runtime values
and addresses are 64-bit. Data is copied as same-width integers (bitwise; float8 included).
"""

import torch
import triton
import triton.language as tl

# Same-width integer views: a bitwise copy, and Triton never sees float8 pointers.
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _set_mla_kv_buffer_kernel(
    kv_ptr,
    loc_ptr,
    nope_ptr,
    rope_ptr,
    kv_stride,
    nope_stride,
    rope_stride,
    num_slots,
    skip_slot,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + row).to(tl.int64)
    keep = (slot >= 0) & (slot != skip_slot) & (slot < num_slots)
    # A skipped row gets an empty row end, so every load and store below is masked off.
    end = tl.where(keep, NOPE + ROPE, 0)
    offs = tl.arange(0, BLOCK)
    in_nope = offs < NOPE
    nope = tl.load(nope_ptr + row * nope_stride + offs, mask=offs < tl.minimum(end, NOPE))
    rope = tl.load(rope_ptr + row * rope_stride + (offs - NOPE), mask=(offs >= NOPE) & (offs < end))
    tl.store(kv_ptr + slot * kv_stride + offs, tl.where(in_nope, nope, rope), mask=offs < end)

def set_mla_kv_buffer_triton(kv_buffer, loc, k_nope, k_rope, skip_slot=-1):
    """Row scatter on already-validated views: kv_buffer [S, W], loc [n] int32/int64,
    k_nope [n', nope], k_rope [n', rope] (n' >= n, last dims contiguous, one dtype)."""
    n = loc.numel()
    if n == 0:
        return
    bits = _BITS_DTYPE[kv_buffer.element_size()]
    nope, rope = k_nope.shape[-1], k_rope.shape[-1]
    block = triton.next_power_of_2(nope + rope)
    _set_mla_kv_buffer_kernel[(n,)](
        kv_buffer.view(bits),
        loc,
        k_nope.view(bits),
        k_rope.view(bits),
        kv_buffer.stride(0),
        k_nope.stride(0),
        k_rope.stride(0),
        kv_buffer.shape[0],
        skip_slot,
        NOPE=nope,
        ROPE=rope,
        BLOCK=block,
        num_warps=max(1, min(8, block // 256)),
    )
