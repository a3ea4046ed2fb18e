"""Bad input a new user meets, on every backend of every device present: a TypeError / ValueError
naming the argument by its keyword, before anything is written, with one dtype spelling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jitkv
from jitkv.tests.conftest import DEV_BACKENDS, assert_bitwise, rand, slots


def _store_args(device):
    bf16 = torch.bfloat16
    return dict(
        k=rand((4, 2, 64), bf16, device),
        v=rand((4, 2, 64), bf16, device),
        k_cache=rand((32, 2, 64), bf16, device),
        v_cache=rand((32, 2, 64), bf16, device),
        slot_mapping=slots(32, 4, torch.int64, device),
    )


def _fp8(a):
    e4m3 = torch.float8_e4m3fn
    a.update(
        k_cache=a["k_cache"].to(e4m3),
        v_cache=a["v_cache"].to(e4m3),
        kv_cache_dtype="fp8_e4m3",
        k_scale=0.5,
        v_scale=0.5,
    )
    return a


STORE_CACHE = [  # (case, change to the arguments, exception, message after "store_cache: ")
    (
        "expanded k_cache",
        lambda a: a.update(k_cache=a["k_cache"][:1].expand(32, 2, 64)),
        ValueError,
        r"k_cache: dim 0 of size 32 has stride 0",
    ),
    (
        "k_cache is v_cache",
        lambda a: a.update(v_cache=a["k_cache"]),
        ValueError,
        r"k_cache: shares memory with v_cache",
    ),
    (
        "v_cache overlaps k_cache",
        lambda a: a.update(k_cache=a["k_cache"][:31], v_cache=a["k_cache"][1:]),
        ValueError,
        r"k_cache: shares memory with v_cache",
    ),
    (
        "k_scale a numeric str",
        lambda a: _fp8(a).update(k_scale="1.0"),
        TypeError,
        r"k_scale: expected a float or a float32 tensor, got str",
    ),
    (
        "k_scale a str",
        lambda a: _fp8(a).update(k_scale="abc"),
        TypeError,
        r"k_scale: expected a float or a float32 tensor, got str",
    ),
    (
        "k_scale a bool",
        lambda a: _fp8(a).update(k_scale=True),
        TypeError,
        r"k_scale: expected a float or a float32 tensor, got bool",
    ),
    (
        "slot_mapping a list",
        lambda a: a.update(slot_mapping=[1, 2, 3, 4]),
        TypeError,
        r"slot_mapping: expected a torch.Tensor, got list",
    ),
    ("k None", lambda a: a.update(k=None), TypeError, r"k: expected a torch.Tensor, got NoneType"),
    ("skip_slot a float", lambda a: a.update(skip_slot=1.5), TypeError, r"skip_slot: expected an int, got float"),
    (
        "k a numpy array",
        lambda a: a.update(k=a["k"].float().cpu().numpy()),
        TypeError,
        r"k: expected a torch.Tensor, got ndarray",
    ),
    (
        "v dtype",
        lambda a: a.update(v=a["v"].float()),
        TypeError,
        r"v: expected dtype bfloat16 \(the dtype of k\), got float32$",
    ),
]


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("case", STORE_CACHE, ids=[c[0] for c in STORE_CACHE])
def test_store_cache(device, backend, case):
    _, change, exc, message = case
    args = _store_args(device)
    caches = {name: args[name].clone() for name in ("k_cache", "v_cache")}
    change(args)
    caches = {name: args[name].clone() if isinstance(args[name], torch.Tensor) else None for name in caches}
    with pytest.raises(exc, match=rf"^store_cache: {message}"):
        jitkv.store_cache(**args, backend=backend)
    for name, before in caches.items():
        if before is not None and args[name].stride() == before.stride():
            assert_bitwise(args[name], before)


def _mla_args(device):
    bf16 = torch.bfloat16
    return dict(
        kv_buffer=rand((64, 576), bf16, device),
        loc=slots(64, 4, torch.int64, device),
        cache_k_nope=rand((4, 512), bf16, device),
        cache_k_rope=rand((4, 64), bf16, device),
    )


MLA = [
    (
        "cache_k_nope dtype",
        lambda a: a.update(cache_k_nope=a["cache_k_nope"].half()),
        TypeError,
        r"cache_k_nope: expected dtype bfloat16 \(the dtype of kv_buffer\), got float16$",
    ),
    (
        "cache_k_rope too few rows",
        lambda a: a.update(cache_k_rope=a["cache_k_rope"][:2]),
        ValueError,
        r"cache_k_rope: expected at least 4 rows",
    ),
    (
        "expanded kv_buffer",
        lambda a: a.update(kv_buffer=a["kv_buffer"][:1].expand(64, 576)),
        ValueError,
        r"kv_buffer: dim 0 of size 64 has stride 0",
    ),
    ("loc a list", lambda a: a.update(loc=[1, 2, 3, 4]), TypeError, r"loc: expected a torch.Tensor, got list"),
    (
        "scale a str",
        lambda a: a.update(kv_cache_dtype="fp8_e4m3", kv_buffer=a["kv_buffer"].view(torch.uint8)[:, :576], scale="0.5"),
        TypeError,
        r"scale: expected a float or a float32 tensor, got str",
    ),
]


@pytest.mark.parametrize("device,backend", DEV_BACKENDS)
@pytest.mark.parametrize("case", MLA, ids=[c[0] for c in MLA])
def test_set_mla_kv_buffer(device, backend, case):
    _, change, exc, message = case
    args = _mla_args(device)
    change(args)
    before = args["kv_buffer"].clone()
    with pytest.raises(exc, match=rf"^set_mla_kv_buffer: {message}"):
        jitkv.set_mla_kv_buffer(**args, backend=backend)
    if args["kv_buffer"].stride(0):
        assert_bitwise(args["kv_buffer"], before)


@pytest.mark.parametrize("backend", ["jit", "torch"])
def test_gather_mla_cache_out_too_small_cpu(backend):
    """A too-small out is bad input (a ValueError naming out), raised before anything is written."""
    cache = rand((4, 8, 576), torch.bfloat16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    out = rand((20, 576), torch.bfloat16)
    before = out.clone()
    with pytest.raises(ValueError, match=r"^gather_mla_cache: out: has 20 rows, but the requests end at row 21"):
        jitkv.gather_mla_cache(out, cache, table, torch.tensor([0, 10, 21]), backend=backend)
    assert_bitwise(out, before)


def test_numpy_is_not_a_tensor_even_where_a_binding_would_take_it():
    """A numpy array the CPU binding could read through DLPack still counts as no tensor where it is
    the op's home (its device decides the backend)."""
    args = _store_args("cpu")
    args["k_cache"] = np.zeros((32, 2, 64), dtype=np.float32)
    with pytest.raises(TypeError, match=r"^store_cache: k_cache: expected a torch.Tensor, got ndarray"):
        jitkv.store_cache(**args)


HOST_SCALES = [
    ("store_cache", "k_scale"),
    ("store_cache", "v_scale"),
    ("gather_mla_cache", "scale"),
    ("rope_store_cache", "q_scale"),
    ("rope_store_cache", "k_scale"),
]


@pytest.mark.parametrize("op_name,name", HOST_SCALES)
def test_cpu_bindings_check_host_scale_values(op_name, name):
    """The CPU jit bindings read a host scale tensor's values themselves (the op's wrapper leaves them to
    the binding): its CPU runner, called without the op's Python check, raises a ValueError naming the
    scale (the element, for per-head scales) before anything is written."""
    op = jitkv.ops.OPS[op_name]
    kw = op.sample(torch.device("cpu"), torch.Generator().manual_seed(0))
    kw[name] = kw[name].clone()
    kw[name].view(-1)[-1] = float("nan")
    before = {d: kw[d].clone() for d in op.destinations if isinstance(kw.get(d), torch.Tensor)}
    index = r"\[\d+\]" if kw[name].numel() > 1 else ""
    with pytest.raises(ValueError, match=rf"^{op_name}: {name}{index}: must be finite and > 0, got nan"):
        op.runner(torch.device("cpu"), "jit")(*op.args_of(kw))
    for d, b in before.items():
        assert_bitwise(kw[d], b)


def _rope_mla_args(device):
    a = _mla_args(device)
    return dict(
        kv_buffer=a["kv_buffer"],
        loc=a["loc"],
        kv_c=a["cache_k_nope"],
        k_pe=a["cache_k_rope"],
        positions=torch.randint(0, 16, (4,), device=device),
        cos_sin_cache=rand((16, 64), torch.float32, device),
        is_neox=False,
    )


@pytest.mark.parametrize("op_name,make", [("set_mla_kv_buffer", _mla_args), ("rope_set_mla_kv_buffer", _rope_mla_args)])
def test_mla_bindings_check_a_host_scale(op_name, make):
    """The MLA ops' CPU bindings read a host scale tensor themselves, as
    test_cpu_bindings_check_host_scale_values."""
    op = jitkv.ops.OPS[op_name]
    args = make("cpu")
    args.update(kv_buffer=args["kv_buffer"].view(torch.uint8)[:, :576], kv_cache_dtype="fp8_e4m3")
    args["scale"] = torch.tensor([0.0])
    before = args["kv_buffer"].clone()
    with pytest.raises(ValueError, match=rf"^{op_name}: scale: must be finite and > 0, got 0"):
        op.runner(torch.device("cpu"), "jit")(*op.args_of(args))
    assert_bitwise(args["kv_buffer"], before)
