"""The key memo (jit/key_memo.py): a later process takes a spec's key without reading its sources, and
every change that changes the key, or where an include is found, makes it compute the key again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from jitkv.jit import key_memo
from jitkv.jit import spec as spec_module
from jitkv.tests.jit.test_build import CODES, _spec, _tree


@pytest.fixture
def settled(monkeypatch, tmp_path):
    """A cache layer, every file counted as settled (the tests' files are seconds old), and a count
    of the source reads that computing a key makes."""
    monkeypatch.setenv("JITKV_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir(mode=0o700)
    monkeypatch.setattr(spec_module, "RACY_NS", 0)
    monkeypatch.setattr(spec_module, "_SCANS", {})
    reads = []
    read_bytes = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self.name) or read_bytes(self))
    return reads


def _memos(tmp_path) -> list[Path]:
    return sorted((tmp_path / "cache" / key_memo.KEYS).glob("*.json"))


def test_a_later_process_takes_the_key_without_reading_a_source(tmp_path, settled, monkeypatch):
    spec = _spec(_tree(tmp_path / "src"))
    key = key_memo.key(spec)
    assert key == spec.key() and len(_memos(tmp_path)) == 1
    monkeypatch.setattr(spec_module, "_SCANS", {})  # a new process has read nothing
    settled.clear()
    assert key_memo.key(spec) == key and settled == []


def test_an_edit_that_keeps_the_size_gives_the_new_key(tmp_path, settled):
    root = _tree(tmp_path / "src")
    spec = _spec(root)
    old = key_memo.key(spec)
    _tree(root, delta=7)
    new = key_memo.key(spec)
    assert new != old and new == spec.key()
    assert key_memo.key(spec) == new  # remembered again


def test_a_header_that_would_shadow_an_include_gives_the_new_key(tmp_path, settled):
    """jitkv/check.h is found in jitkv's own include dir; the same name under the spec's root comes
    first in the search order, so the closure, and the key, change."""
    root = _tree(tmp_path / "src")
    spec = _spec(root)
    old = key_memo.key(spec)
    (root / "include" / "jitkv").mkdir(parents=True)
    (root / "include" / "jitkv" / "check.h").write_text("#pragma once\n#include <cstdint>\n")
    spec_module._find_include.cache_clear()  # a new process: where headers are is looked up again
    assert dict(spec.closure())["include/jitkv/check.h"] == root / "include" / "jitkv" / "check.h"
    assert key_memo.key(spec) == spec.key() != old


def test_a_changed_generated_header_gives_the_new_key(tmp_path, settled, monkeypatch):
    from jitkv import codes

    root = _tree(tmp_path / "src", body=CODES)
    spec = _spec(root)
    old = key_memo.key(spec)
    monkeypatch.setitem(spec_module.GENERATED, "jitkv/codes.h", lambda: codes.header() + "// changed\n")
    spec_module._generated.cache_clear()
    try:
        assert key_memo.key(spec) == spec.key() != old
    finally:
        monkeypatch.undo()
        spec_module._generated.cache_clear()


@pytest.mark.parametrize("damage", ["group-writable", "garbage", "wrong types"])
def test_a_memo_not_trusted_or_unreadable_is_not_used(tmp_path, settled, damage):
    spec = _spec(_tree(tmp_path / "src"))
    key = key_memo.key(spec)
    (memo,) = _memos(tmp_path)
    forged = json.loads(memo.read_text())
    forged["key"] = "0" * 64
    if damage == "group-writable":
        memo.write_text(json.dumps(forged))
        memo.chmod(0o664)
    elif damage == "garbage":
        memo.write_text("{not json")
    else:
        memo.write_text(json.dumps({**forged, "opened": 3}))
    assert key_memo.key(spec) == key


def test_sources_younger_than_the_racy_window_are_not_remembered(tmp_path, settled, monkeypatch):
    monkeypatch.setattr(spec_module, "RACY_NS", 3_000_000_000)
    spec = _spec(_tree(tmp_path / "src"))
    assert key_memo.key(spec) == spec.key() and _memos(tmp_path) == []


def test_without_a_writable_layer_the_key_is_computed(tmp_path, settled):
    spec = _spec(_tree(tmp_path / "src"))
    (tmp_path / "cache").chmod(0o500)
    try:
        assert key_memo.key(spec) == spec.key()
        assert not (tmp_path / "cache" / key_memo.KEYS).exists()
    finally:
        (tmp_path / "cache").chmod(0o700)


def test_the_memo_names_what_it_checks(tmp_path, settled):
    """Opened files by the path they were found at; for the candidates tried before them, the dirs
    where creating one would add an entry (the includer's own dir comes first in the search)."""
    root = _tree(tmp_path / "src")
    key_memo.key(_spec(root))
    (memo,) = _memos(tmp_path)
    record = json.loads(memo.read_text())
    opened = [p for p, _ in record["opened"]]
    assert str(root / "tiny" / "add.cpp") in opened and str(root / "tiny" / "delta.h") in opened
    assert any(p.endswith(os.path.join("jitkv", "check.h")) for p in opened)
    parents = [p for p, _ in record["parents"]]
    assert str(root / "tiny") in parents and str(root) in parents  # tiny/jitkv/ and include/ are absent
