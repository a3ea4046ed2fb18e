"""What an install brings: the base install works without Triton (a CPU-only install does not pull it),
and the test extra brings what README's test command needs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = REPO / "pyproject.toml"


def _project():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    if not PYPROJECT.is_file():
        pytest.skip("an installed copy: no pyproject.toml beside the package")
    return tomllib.loads(PYPROJECT.read_text())["project"]


def _names(requirements):
    return {re.match(r"[A-Za-z0-9_.\-]+", r).group(0).lower() for r in requirements}


def test_triton_is_an_extra_not_a_dependency():
    project = _project()
    extras = project["optional-dependencies"]
    assert "triton" not in _names(project["dependencies"])
    assert _names(extras["triton"]) == {"triton"}
    # README's test command runs the Triton kernels under the interpreter, which needs numpy.
    assert {"pytest", "numpy"} <= _names(extras["test"]) and "jitkv[triton]" in extras["test"]


def test_plot_is_an_extra_the_tests_bring():
    extras = _project()["optional-dependencies"]
    assert "matplotlib" not in _names(_project()["dependencies"]) and _names(extras["plot"]) == {"matplotlib"}
    assert "jitkv[plot]" in extras["test"]


WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # import triton raises ImportError, as on an install without it
import torch
import jitkv
from jitkv import DSV4_K_CACHE
import jitkv.__main__, jitkv.benchmark.__main__, jitkv.benchmark.cpu  # noqa: F401
bf16 = torch.bfloat16
buf, nope, rope = torch.zeros(16, 576, dtype=bf16), torch.ones(2, 512, dtype=bf16), torch.ones(2, 64, dtype=bf16)
jitkv.set_mla_kv_buffer(buf, torch.tensor([3, 5]), nope, rope)
k, kc = torch.ones(2, 2, 64, dtype=torch.bfloat16), torch.zeros(8, 2, 64, dtype=torch.bfloat16)
jitkv.store_cache(k, k, kc, kc.clone(), torch.tensor([1, 6]))
cache = DSV4_K_CACHE.allocate(2, 4, "cpu")
jitkv.quantize_and_insert_k_cache(torch.ones(2, 512, dtype=torch.bfloat16), cache, torch.tensor([0, 7]), block_size=4)
out = torch.zeros(1, 8, 512, dtype=torch.bfloat16)
seq, table = torch.tensor([8], dtype=torch.int32), torch.tensor([[0, 1]], dtype=torch.int32)
jitkv.dequantize_and_gather_k_cache(out, cache, seq, None, table, 4)
assert buf[3].bool().all() and kc[6].bool().all() and out[0, 0].bool().all() and out[0, 7].bool().all()
assert jitkv.__main__.main(["info"]) == 0
print("OK", "triton" in sys.modules and sys.modules["triton"] is None)
"""


def test_works_without_triton(tmp_path):
    """Every op on CPU, ``python -m jitkv info`` and the CPU benchmark's imports, with triton absent."""
    env = {
        **os.environ,
        "JITKV_CACHE_DIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WITHOUT_TRITON)], capture_output=True, text=True, env=env, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "OK True" in res.stdout
