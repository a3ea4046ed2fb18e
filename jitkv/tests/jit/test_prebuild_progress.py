"""python -m jitkv prebuild: its progress bar stays whole while jitkv logs the builds."""

from __future__ import annotations

import logging
import sys

from jitkv.prebuild import _AboveBars, _progress
from jitkv.tests.jit.conftest import run_py

ONE = """
#include <tvm/ffi/function.h>
int one() { return 1; }
TVM_FFI_DLL_EXPORT_TYPED_FUNC(one, one);
"""

# The prebuild command of a new process, with one small module to build; prints the jitkv logger's
# handlers before and after it.
PREBUILD_ONE = """
    import importlib, logging
    from pathlib import Path
    from jitkv.__main__ import main
    from jitkv.jit import JitSpec
    spec = JitSpec("one", ("one.cpp",), exports=("one",), root=Path({root!r}))
    importlib.import_module("jitkv.prebuild").specs_for = lambda target: [spec]  # jitkv.prebuild: the function
    before = logging.getLogger("jitkv").handlers[:]
    status = main(["prebuild"])
    print("HANDLERS", logging.getLogger("jitkv").handlers == before, "STATUS", status)
"""


def test_build_lines_print_above_the_bar(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "one.cpp").write_text(ONE)
    res = run_py(PREBUILD_ONE.format(root=str(tmp_path / "src")), tmp_path / "cache")
    assert res.returncode == 0, res.stderr
    assert "HANDLERS True STATUS 0" in res.stdout, res.stdout
    # What a terminal shows of each line: the text after its last carriage return.
    shown = [line.rsplit("\r", 1)[-1] for line in res.stderr.split("\n")]
    logged = [line for line in shown if "jitkv: buil" in line]
    assert [line.split(" one ")[0] for line in logged] == ["jitkv: building", "jitkv: built"], res.stderr
    assert "jitkv prebuild: 100%" in res.stderr


def test_bar_swaps_only_the_terminal_handler_and_restores_it(tmp_path, monkeypatch):
    terminal, to_file = logging.StreamHandler(sys.stderr), logging.FileHandler(tmp_path / "log")
    terminal.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("jitkv")
    monkeypatch.setattr(logger, "handlers", [terminal, to_file])
    try:
        with _progress(1):
            above, kept = logger.handlers
            assert type(above) is _AboveBars and (above.stream, above.formatter) == (sys.stderr, terminal.formatter)
            assert kept is to_file
        assert logger.handlers == [terminal, to_file]
    finally:
        to_file.close()
