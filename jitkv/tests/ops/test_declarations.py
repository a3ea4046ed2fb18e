"""Every op's declaration (jitkv/ops/_op.py Op) against what it declares: its schema is its public
signature, its sample call writes the reference's bytes on every backend, torch.compile traces it,
and the registry is what jitkv exports and prebuilds."""

from __future__ import annotations

import inspect

import pytest
import torch

import jitkv
from jitkv.ops import OPS
from jitkv.prebuild import specs_for
from jitkv.tests.conftest import DEVICES, assert_bitwise
from jitkv.tests.op_calls import expected

NAMES = list(OPS)


@pytest.mark.parametrize("name", NAMES)
def test_schema_is_the_public_signature(name):
    """The declared schema names the public function's parameters, in order, with its defaults and
    keyword-only marker; ``backend`` is the function's last parameter, keyword-only, default None."""
    op = OPS[name]
    params = list(inspect.signature(op.fn).parameters.values())
    assert params[-1].name == "backend" and params[-1].kind is inspect.Parameter.KEYWORD_ONLY
    assert params[-1].default is None
    assert [p.name for p in params[:-1]] == [p.name for p in op.params]
    for p, declared in zip(params[:-1], op.params):
        want = None if p.default is inspect.Parameter.empty else repr(p.default).replace("'", '"')
        assert declared.default == want, (p.name, declared.default, want)
    parts = [part.strip() for part in op.schema.strip()[1:-1].split(",")]
    star = parts.index("*") if "*" in parts else len(parts)
    first_keyword = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.KEYWORD_ONLY), len(params))
    assert star == first_keyword
    assert op.home in [p.name for p in op.params if p.is_tensor]
    assert op.destinations and all(d in [p.name for p in op.params if p.is_tensor] for d in op.destinations)


def test_jitkv_exports_every_op():
    for name, op in OPS.items():
        assert getattr(jitkv, name) is op.fn and name in jitkv.__all__
        assert op.fn.__doc__ and "Raises" in op.fn.__doc__ and "Algorithm" in op.fn.__doc__, name


def test_prebuild_builds_every_ops_specs_once():
    """Each op's specs once, and on CUDA the FlashInfer shims' page_slots module."""
    from jitkv.compat.flashinfer import page_slots_spec

    for target in ("cpu", "9.0a"):
        specs = specs_for(target)
        compat = set() if target == "cpu" else {page_slots_spec(target)}
        assert len(specs) == len(set(specs))
        assert set(specs) == {s for op in OPS.values() for s in op.specs(target)} | compat


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_sample_call_on_every_backend(device, name):
    op = OPS[name]
    for backend in op.order[device]:
        args = op.sample(device, torch.Generator().manual_seed(1))
        want = expected(name, args)
        op.fn(**args, backend=backend)
        for d, w in zip(op.destinations, want):
            assert_bitwise(args[d], w)


@pytest.mark.parametrize("name", NAMES)
def test_torch_compile_fullgraph(name):
    """Under torch.compile(fullgraph=True) the call goes through the registered custom op."""
    op = OPS[name]
    args = op.sample("cpu", torch.Generator().manual_seed(2))
    want = expected(name, args)
    torch._dynamo.reset()  # `call` below is one code object for every op: past 8 ops its recompile limit fails

    @torch.compile(fullgraph=True, backend="eager")
    def call(**kw):
        op.fn(**kw)

    call(**args)
    for d, w in zip(op.destinations, want):
        assert_bitwise(args[d], w)
    declared = torch._C.parse_schema(f"jitkv::{name}{op.custom_op_schema()}")
    assert str(getattr(torch.ops.jitkv, name).default._schema) == str(declared)


@pytest.mark.parametrize("name", [n for n in NAMES if OPS[n].order["cpu"][0] == "jit"])
def test_backend_info_names_the_cpu_kernel_path(name):
    """A CPU jit module says which kernel path it was built for, as toolchain.cpu_isa() picks it."""
    from jitkv.jit.toolchain import cpu_isa

    op = OPS[name]
    op.fn(**op.sample("cpu"))
    info = jitkv.backend_info(name)["cpu"]
    assert info["backend"] == "jit" and info["isa"] == cpu_isa()


@pytest.mark.parametrize("name", [n for n in NAMES if OPS[n].variant_type is not None])
def test_variant_fields_make_the_variant(name):
    """The per-call key is exactly the typed variant's fields, and the variant is what backend_info
    records for a CUDA call."""
    op = OPS[name]
    args = op.args_of(op.sample("cpu", torch.Generator().manual_seed(3)))
    variant = op.variant_type(*op.variant(*args))
    assert tuple(getattr(variant, f) for f in variant._fields) == op.variant(*args)
