"""RoPE as the engines document it, written out per token in float32 (each product rounded, then the sum:
torch's eager ops), for the compat shims' tests: the engines' references, not jitkv's."""

from __future__ import annotations

import torch


def rotate(x, position, cos_sin_cache, is_neox, rot=None):
    """x [..., D] (one token) rotated over its first ``rot`` dims at ``position``, float32 out."""
    row = cos_sin_cache[int(position)].float()
    rot = rot or row.shape[0]
    cos, sin = row[: rot // 2], row[rot // 2 : rot]
    y = x.float().clone()
    if is_neox:
        a, b = y[..., : rot // 2].clone(), y[..., rot // 2 : rot].clone()
        y[..., : rot // 2] = a * cos - b * sin
        y[..., rot // 2 : rot] = b * cos + a * sin
    else:
        a, b = y[..., 0:rot:2].clone(), y[..., 1:rot:2].clone()
        y[..., 0:rot:2] = a * cos - b * sin
        y[..., 1:rot:2] = b * cos + a * sin
    return y


def table(max_pos, rot, dtype=torch.float32):
    """[max_pos, rot]: cos half then sin half of the standard frequencies."""
    inv = 1.0 / 10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv
    return torch.cat([angles.cos(), angles.sin()], dim=1).to(dtype)
