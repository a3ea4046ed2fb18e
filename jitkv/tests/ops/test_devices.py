"""Devices jitkv does not run on: a tensor on meta (or any device but CPU and CUDA), in any argument of
any op on any backend, raises ValueError naming the argument and the device before anything runs."""

from __future__ import annotations

import pytest

from jitkv.tests.conftest import DEVICES, assert_bitwise
from jitkv.tests.op_calls import BACKENDS, DESTINATIONS, HOME, OP_NAMES, make_args, run, tensor_names

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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OP_NAMES)
def test_meta_home_after_a_call(device, op):
    """Op.run picks the device from the home's get_device() alone (-1 for meta as for the CPU), so a meta
    home meets the runner an earlier CPU call made: it still gets the op's ValueError naming it, and
    nothing else is written."""
    run(op, make_args(op, "cpu"))  # the CPU runner exists now
    args = make_args(op, device)
    home = HOME[op]
    before = {d: args[d].clone() for d in DESTINATIONS[op] if d != home}
    args[home] = args[home].to("meta")
    with pytest.raises(ValueError, match=rf"{op}: {home}: expected a .*, got one on meta$"):
        run(op, args)
    for d, t in before.items():
        assert_bitwise(args[d], t)
