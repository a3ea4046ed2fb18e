"""Deployable: no compiler, layered and read-only caches, relocation, integrity, trust, warm start."""

from __future__ import annotations

import warnings

import pytest

from jitkv.tests.jit.conftest import run_py

# ------------------------------------------------------------------------------------- log level


def test_bad_log_level_env_warns_and_import_works(tmp_path):
    res = run_py("import logging, jitkv; print('LEVEL', logging.getLogger('jitkv').level)", tmp_path, JITKV_LOG_LEVEL="bogus")
    assert res.returncode == 0, res.stderr
    assert "LEVEL 20" in res.stdout and res.stderr.count("JITKV_LOG_LEVEL") == 1, res.stderr


@pytest.mark.parametrize("value, level", [("10", 10), ("debug", 10), ("Warning", 30), (" error ", 40)])
def test_log_level_env_values(value, level):
    import jitkv  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jitkv._log_level(value) == level
