"""examples/: the paged-KV decode engines give transformers' greedy tokens (HF generate, one prompt
at a time) for a batch of prompts of different lengths, with K/V written by jitkv ops."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

import jitkv
from jitkv.tests.conftest import gpu

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if not (EXAMPLES / "paged_common.py").is_file():
    pytest.skip("examples/ is not next to this jitkv (an installed copy)", allow_module_level=True)

# (example module, engine class, the jitkv op it writes with)
CASES = [
    ("llama_paged_decode", "LlamaPagedEngine", "rope_store_cache"),
    ("qwen3_paged_decode", "Qwen3PagedEngine", "rope_store_cache"),
    ("mla_paged_decode", "MlaPagedEngine", "rope_set_mla_kv_buffer"),
]
DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]
PROMPT_LENS = [5, 12, 3, 9]  # crosses block boundaries at block size 4
STEPS = 6


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as the examples' main() uses (see its --threads): on a busy machine the
    default pool makes these tiny models' steps wait on other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def load():
    """Imports an example by module name (the examples import their shared paged_common from
    their own dir, as they do when run as scripts)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLES))
        yield importlib.import_module


@pytest.fixture(scope="module")
def reference(load):
    """(model, prompts, HF generate's tokens) per example and device, computed once per module."""
    made = {}

    def get(name, device):
        if (name, device) not in made:
            common, example = load("paged_common"), load(name)
            model = example.build_model(0).to(device)
            prompts = common.random_prompts(PROMPT_LENS, model.config.vocab_size, seed=0)
            made[name, device] = model, prompts, [common.hf_greedy(model, p, STEPS) for p in prompts]
        return made[name, device]

    return get


def _decode(load, reference, name, engine_name, device):
    model, prompts, expected = reference(name, device)
    engine_cls = getattr(load(name), engine_name)
    num_blocks = 2 * load("paged_common").blocks_needed(prompts, STEPS, 4)
    tokens, stats = engine_cls(model, num_blocks=num_blocks, block_size=4, seed=0).generate(prompts, STEPS)
    return tokens, stats, expected, model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "engine_name", "op"), CASES)
def test_engine_matches_hf_generate(load, reference, name, engine_name, op, device):
    tokens, stats, expected, model = _decode(load, reference, name, engine_name, device)
    assert tokens == expected
    assert stats.tokens == len(PROMPT_LENS) * (STEPS - 1)
    assert stats.jitkv_calls == model.config.num_hidden_layers * (STEPS - 1)
    assert 0 < stats.jitkv_seconds < stats.seconds


@pytest.mark.parametrize(("name", "engine_name", "op"), CASES)
def test_tokens_depend_on_the_jitkv_writes(load, reference, name, engine_name, op, monkeypatch):
    """With the op a no-op the engines attend over the pool's initial garbage and the tokens
    differ: the equality above is decided by what jitkv wrote where."""
    monkeypatch.setattr(jitkv, op, lambda *args, **kwargs: None)
    tokens, _, expected, _ = _decode(load, reference, name, engine_name, "cpu")
    assert tokens != expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "engine_name", "op"), CASES)
def test_main(load, name, engine_name, op, device, capsys):
    assert load(name).main(["--device", device, "--steps", "3", "--prompt-lens", "6,2"]) == 0
    out = capsys.readouterr().out
    assert out.count("matches HF generate") == 2
    assert "tokens/s" in out and f"{op}: " in out


# examples/pd_handoff.py: prefill in this process, decode in a spawned one, each request's pages packed,
# sent (gloo on CPU, NCCL on two GPUs) and unpacked under another block order.
HANDOFF_DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")),
]
HANDOFF_ARGS = ["--steps", "4", "--prompt-lens", "6,9,2", "--block-size", "4"]


@pytest.mark.parametrize("device", HANDOFF_DEVICES)
@pytest.mark.parametrize("model", ["llama", "mla"])
def test_handoff_matches_hf_generate(load, model, device, capsys):
    assert load("pd_handoff").main(["--device", device, "--model", model, *HANDOFF_ARGS]) == 0
    assert capsys.readouterr().out.count("matches HF generate") == 3


def test_handoff_tokens_depend_on_the_unpacked_pages(load, capsys):
    """Pages received but not unpacked: the decode rank attends over its own pool's garbage."""
    assert load("pd_handoff").main(["--device", "cpu", "--drop-kv", *HANDOFF_ARGS]) == 1
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize("device", HANDOFF_DEVICES)
def test_handoff_bench_moves_every_page(load, device, capsys):
    """The benchmark's methods each leave the decode pool's pages equal to the source pages (checked
    there) and print a row per geometry."""
    argv = ["--device", device, "--bench", "--bench-tokens", "256", "--bench-reps", "1", "--bench-chunks", "3"]
    assert load("pd_handoff").main(argv) == 0
    out = capsys.readouterr().out
    assert "MISMATCH" not in out and out.count("| Llama-3-8B") == 1 and out.count("| DeepSeek-V3") == 1
