"""Two GPUs: every op on cuda:1 while cuda:0 is current (the reference's bytes, the current device
left alone), tensors on two GPUs (ValueError naming both), and two ranks sharing one cold cache dir
(one build, both correct). Skipped unless two CUDA devices are present."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from jitkv.jit import cuda_arch
from jitkv.ops import OPS
from jitkv.tests.conftest import assert_bitwise
from jitkv.tests.op_calls import BACKENDS, DESTINATIONS, HOME, OP_NAMES, expected, make_args, run, tensor_names

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
CASES = [(op, b) for op in OP_NAMES for b in BACKENDS["cuda"][op]]


@pytest.mark.parametrize("op,backend", CASES)
def test_op_on_the_second_gpu(op, backend):
    torch.cuda.set_device(0)
    args = make_args(op, "cuda:1")
    want = expected(op, args)
    run(op, args, backend)
    assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    for d, w in zip(DESTINATIONS[op], want):
        assert_bitwise(args[d], w)


@pytest.mark.parametrize("op,backend", CASES)
def test_tensors_on_two_gpus_named(op, backend):
    """Each argument in turn on cuda:1, the rest on cuda:0: ValueError naming it and the tensor whose
    device it must share, nothing written."""
    home = HOME[op]
    for name in tensor_names(make_args(op, "cpu")):
        args = make_args(op, "cuda:0")
        before = {d: args[d].clone() for d in DESTINATIONS[op]}
        args[name] = args[name].to("cuda:1")
        if name == home:  # then the first argument checked against it is named
            pattern = rf"{op}: \w+: expected a tensor on cuda:1 like {home}, got one on cuda:0$"
        else:
            pattern = rf"{op}: {name}: expected a tensor on cuda:0 like {home}, got one on cuda:1$"
        with pytest.raises(ValueError, match=pattern):
            run(op, args, backend)
        torch.cuda.synchronize()
        for d, t in before.items():
            if d != name:
                assert_bitwise(args[d], t)


def _rank(rank, out_dir, barrier):
    """One rank: its own GPU, every op on the jit backend (where it has one) against the reference; the jitkv log lines
    and the result go to out_dir/rank<r>.json."""
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("jitkv").addHandler(handler)
    torch.cuda.set_device(rank)
    errors = []
    barrier.wait()  # both ranks reach the cold cache together
    for op in OP_NAMES:
        args = make_args(op, f"cuda:{rank}")
        want = expected(op, args)
        run(op, args, "jit" if "jit" in BACKENDS["cuda"][op] else None)  # an op with no CUDA kernel yet runs its order
        torch.cuda.synchronize()
        for d, w in zip(DESTINATIONS[op], want):
            if not torch.equal(args[d].view(torch.uint8), w.view(torch.uint8)):
                errors.append(f"{op}: {d} differs from the reference")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"errors": errors, "log": lines}))


def test_two_ranks_share_one_cold_cache(tmp_path, monkeypatch):
    caps = {torch.cuda.get_device_capability(i) for i in range(2)}
    if len(caps) != 1:
        pytest.skip("the two GPUs differ in architecture: each would build its own artifact")
    cache = tmp_path / "cache"
    monkeypatch.setenv("JITKV_CACHE_DIR", str(cache))  # inherited by the spawned ranks
    monkeypatch.delenv("JITKV_DEBUG", raising=False)
    mp = torch.multiprocessing
    mp.spawn(_rank, args=(str(tmp_path), mp.get_context("spawn").Barrier(2)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["errors"] == [] and ranks[1]["errors"] == []
    # "jitkv: building <module> in <artifact dir>": each artifact built once, by whichever rank took
    # its lock first; the other rank loaded what that one published.
    built = sorted(
        Path(line.rsplit(" in ", 1)[1]).name for r in ranks for line in r["log"] if line.startswith("jitkv: building ")
    )
    artifacts = sorted(p.name for p in cache.iterdir() if (p / "manifest.json").is_file())
    assert built == artifacts, (built, artifacts)
    # Every op with a CUDA kernel built one of its own modules (an artifact dir starts with its
    # module's name), and nothing else was built.
    arch = cuda_arch(torch.device("cuda", 0))
    modules = {op: {s.op for s in OPS[op].specs(arch)} for op in OP_NAMES if "jit" in BACKENDS["cuda"][op]}
    owner = {a: {op for op, names in modules.items() if any(a.startswith(f"{n}_") for n in names)} for a in artifacts}
    assert all(owner.values()), owner
    assert set().union(*owner.values()) == set(modules), owner
    assert not any((cache / "staging").iterdir())
