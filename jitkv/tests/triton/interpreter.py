"""Running Triton kernels under TRITON_INTERPRET=1 (on the CPU, so CI exercises them without a GPU).

Each run is a subprocess: the interpreter is chosen when @triton.jit decorates, at import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def run_under_interpreter(target: str) -> None:
    """Call ``module:function`` (no arguments; it asserts) in a new process with TRITON_INTERPRET=1.
    Skips without triton and numpy (the interpreter computes with numpy; the test extra installs both)."""
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    module, function = target.split(":")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    code = f"import {module} as m; m.{function}(); print('OK')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]
