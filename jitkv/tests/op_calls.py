"""The every-op tables of the tests, read from the op registry (``jitkv.ops.OPS``): each op's sample
call with fresh random arguments, its home and destination tensors, its backends per device. Slots are
unique and in range, so the CPU reference raises for nothing."""

from __future__ import annotations

import torch

from jitkv.ops import OPS

OP_NAMES = tuple(OPS)
HOME = {name: op.home for name, op in OPS.items()}  # the tensor whose device the others must share
DESTINATIONS = {name: op.destinations for name, op in OPS.items()}
BACKENDS = {device: {name: op.order[device] for name, op in OPS.items()} for device in ("cpu", "cuda")}


def make_args(op, device):
    """Keyword arguments of ``op``'s sample call on ``device``."""
    return OPS[op].sample(device)


def tensor_names(args):
    return [k for k, v in args.items() if isinstance(v, torch.Tensor)]


def run(op, args, backend=None):
    OPS[op].fn(**args, backend=backend)


def expected(op, args):
    """The destinations after the torch reference ran on clones of them (same device)."""
    args = {**args, **{d: args[d].clone() for d in DESTINATIONS[op]}}
    OPS[op].reference(**args)
    return [args[d] for d in DESTINATIONS[op]]
