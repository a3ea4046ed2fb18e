"""Every op's Triton kernel under TRITON_INTERPRET=1 on its sample call (runs on the CPU, so CI
exercises them without a GPU): the bytes of the torch reference over its whole destinations. Each
family's own interpreter cases (edge values, layouts) are in its test file."""

from __future__ import annotations

import pytest
import torch

from jitkv.ops import OPS
from jitkv.tests.triton.interpreter import run_under_interpreter

TRITON_OPS = [name for name, op in OPS.items() if op.triton is not None]


def every_sample_call():
    """Run by test_every_triton_kernel_on_its_sample_call under TRITON_INTERPRET=1."""
    from jitkv.tests.conftest import assert_bitwise

    for name in TRITON_OPS:
        op = OPS[name]
        args = op.sample("cpu", torch.Generator().manual_seed(0))
        want = {**args, **{d: args[d].clone() for d in op.destinations}}
        op.reference(**want)
        checked = op.check(*op.args_of(args))
        op.triton_kernel()(*checked)
        for d in op.destinations:
            assert_bitwise(args[d], want[d])


@pytest.mark.skipif(not TRITON_OPS, reason="no op has a Triton kernel")
def test_every_triton_kernel_on_its_sample_call():
    run_under_interpreter(f"{__name__}:every_sample_call")
