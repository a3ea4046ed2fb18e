"""Devices jitkv does not run on: a tensor on meta (or any device but CPU and CUDA), in any argument of
any op on any backend, raises ValueError naming the argument and the device before anything runs."""

from __future__ import annotations

import pytest

from jitkv.tests.conftest import DEVICES, assert_bitwise
from jitkv.tests.op_calls import BACKENDS, DESTINATIONS, OP_NAMES, make_args, run, tensor_names

CASES = [(d, op, b) for d in DEVICES for op in OP_NAMES for b in BACKENDS[d][op]]


@pytest.mark.parametrize("device,op,backend", CASES)
def test_meta_tensor_named(device, op, backend):
    for name in tensor_names(make_args(op, "cpu")):
        args = make_args(op, device)
        before = {d: args[d].clone() for d in DESTINATIONS[op]}
        args[name] = args[name].to("meta")
        with pytest.raises(ValueError, match=rf"{op}: {name}: expected a .*, got one on meta$"):
            run(op, args, backend)
        for d, t in before.items():
            if d != name:
                assert_bitwise(args[d], t)
