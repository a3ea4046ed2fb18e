"""Helpers of the build-core tests: child processes with their own cache layers and environment."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

# A process that cannot find a compiler: nvcc hidden from PATH and CUDA_HOME/CUDA_PATH, CXX missing.
NO_COMPILER = {
    "PATH": "/nonexistent",
    "CUDA_HOME": "/nonexistent",
    "CUDA_PATH": "/nonexistent",
    "CXX": "/nonexistent/c++",
}

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="creates files owned by another uid (needs root)")


def child_env(cache, **env) -> dict:
    """The environment of a child process whose cache layers are ``cache`` (a path or a list)."""
    layers = os.pathsep.join(map(str, cache)) if isinstance(cache, (list, tuple)) else str(cache)
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "JITKV_CACHE_DIR": layers, "PYTHONPATH": pythonpath, **env}


def run_py(code: str, cache, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=child_env(cache, **env),
        timeout=300,
    )


def run_cli(*args: str, cache, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jitkv", *args], capture_output=True, text=True, env=child_env(cache, **env), timeout=600
    )
