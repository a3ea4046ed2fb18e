"""Content keys remembered between processes (docs/design.md §6, "Key memo").

A key hashes every file of a module's include closure (spec.py): at an engine's first calls that is a
few milliseconds per module, most of a warm start once every module is published. The first
configured cache layer that is trusted and writable keeps, per spec, its key beside what the key was
computed from:
- the (size, mtime_ns, ctime_ns, inode) of every file opened;
- the (inode, mtime_ns, ctime_ns) of the nearest existing dir above each include candidate found
  absent: creating the candidate adds an entry there (about 8 dirs a spec instead of 80 candidates;
  an entry added for another reason only costs a recomputation);
- the sha256 of each generated header.
A later process takes the key while all of them hold (git's index trusts the same stat fields);
otherwise (a file edited, replaced or moved, a header that would shadow an include, a changed
generated header, a memo unreadable or not trusted) it computes the key and rewrites the memo.
Nothing is memoized while a file or dir it records is younger than spec.py's racy window, within
which an edit may keep size and times.

Memo files: ``<layer>/keys/<readable name>_<id>.json``, the id hashing everything of the key that is
not a file's bytes (spec.fixed_components) and where the sources are. Without a writable layer each
process computes its keys."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import uuid
from pathlib import Path

from . import spec as spec_module
from .cache_dir import existing_write_layer, private_subdir, untrusted
from .spec import JitSpec

KEYS = "keys"


def key(spec: JitSpec) -> str:
    """``spec.key()``, from the memo when it still holds, else computed and remembered."""
    path = _memo_path(spec)
    if path is None:
        return spec.key()
    remembered = _valid_key(path)
    if remembered is not None:
        return remembered
    fresh = spec.key()
    with contextlib.suppress(OSError):
        _remember(spec, fresh, path)
    return fresh


def _memo_path(spec: JitSpec) -> str | None:
    layer = existing_write_layer()
    if layer is None:
        return None
    fixed = repr((sorted(spec.fixed_components().items()), str(spec.root), str(spec_module.CSRC)))
    return os.path.join(layer, KEYS, f"{spec.readable_name()}_{hashlib.sha256(fixed.encode()).hexdigest()[:16]}.json")


def _valid_key(path: str) -> str | None:
    """The memo's key if the memo is trusted and every recorded fact still holds, else None."""
    try:
        with open(path, "rb") as f:
            if untrusted(os.fstat(f.fileno())):
                return None
            memo = json.loads(f.read())
        for opened, sig in memo["opened"]:
            if list(_signature(os.stat(opened))) != sig:
                return None
        for parent, sig in memo["parents"]:
            if list(_dir_signature(os.stat(parent))) != sig:
                return None
        if any(spec_module.generated_sha256(inc) != sha for inc, sha in memo["generated"].items()):
            return None
        return memo["key"] if isinstance(memo["key"], str) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remember(spec: JitSpec, key: str, path: str) -> None:
    """Write the memo of ``key`` atomically, unless a file it depends on is younger than the racy
    window (or changed while the key was computed: its ctime is then recent too)."""
    opened, absent, generated = spec.lookups()
    sigs = [(p, _signature(os.stat(p))) for p in opened]
    parents = [(d, _dir_signature(os.stat(d))) for d in sorted({_existing_parent(p) for p in absent})]
    now = time.time_ns()
    if any(now - max(sig[1], sig[2]) <= spec_module.RACY_NS for _, sig in sigs + parents):
        return
    memo = {"key": key, "opened": sigs, "parents": parents, "generated": generated}
    keys = private_subdir(Path(path).parent.parent, KEYS)
    tmp = keys / f".{os.path.basename(path)}.{uuid.uuid4().hex}"
    try:
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _signature(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def _dir_signature(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_mtime_ns, st.st_ctime_ns


def _existing_parent(path: str) -> str:
    """The nearest dir above ``path`` that exists: creating ``path`` (or any dir on the way to it) adds
    an entry there, which moves its mtime."""
    parent = os.path.dirname(path)
    while not os.path.isdir(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    return parent
