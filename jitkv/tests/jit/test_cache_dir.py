"""Where builds go when a cache dir is unusable: one warning in every process, naming the dir, why, and
where builds go instead; jitkv's warnings name the caller's line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from jitkv.jit import cache_dir
from jitkv.tests.jit.conftest import child_env, needs_root, run_py

HINT = "Set JITKV_CACHE_DIR to a directory you own and may write, or prebuild with 'python -m jitkv prebuild'."

# A new process looks up published artifacts (as every op's first call does), then asks where builds go;
# prints both and the warnings raised.
LOOKUP = """
    import json, warnings
    from jitkv.jit import JitUnavailable, cache_dir
    from jitkv.jit.cache_dir import lookup_layers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layers = [str(p) for p in lookup_layers()]
        try:
            builds = cache_dir()
        except JitUnavailable as e:
            builds = f"JitUnavailable: {e}"
    print("RESULT " + json.dumps({"layers": layers, "builds": builds, "warnings": [str(w.message) for w in caught]}))
"""


def _lookup(cache, tmp_path) -> dict:
    res = run_py(LOOKUP, cache, TMPDIR=str(tmp_path))
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.split("RESULT ", 1)[1])


def _file(path):
    path.write_text("not a directory")
    return path


def _dir(path, mode):
    path.mkdir()
    os.chmod(path, mode)
    return path


def _immutable(path):
    """A dir even root may not write (its owner write bit is set): chattr +i, undone by the fixture."""
    _dir(path, 0o755)
    res = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"chattr +i: {res.stderr.strip()}")
    return path


def _foreign(path):
    os.chown(_dir(path, 0o755), 65534, 65534)
    return path


# Each way a configured cache dir can be unusable: (make it under tmp_path, why the warning gives).
UNUSABLE = {
    "a file in its path": (lambda t: _file(t / "file") / "cache", "cannot be created: {tmp}/file is not a directory"),
    "a file": (lambda t: _file(t / "file"), "is ignored: not a directory"),
    "no owner write bit": (lambda t: _dir(t / "ro", 0o555), "is read-only (its owner has no write bit: mode 555)"),
    "not writable": (lambda t: _immutable(t / "immutable"), f"is not writable by uid {os.geteuid()}"),
    "another owner": (lambda t: _foreign(t / "foreign"), "is ignored: owned by uid 65534"),
    "group-writable": (lambda t: _dir(t / "open", 0o775), "is ignored: group/world-writable (mode 775)"),
}
ROOT_ONLY = {"not writable", "another owner"}  # chattr +i and chown need root


@pytest.fixture(params=[pytest.param(k, marks=[needs_root] if k in ROOT_ONLY else []) for k in UNUSABLE])
def unusable(request, tmp_path):
    """(an unusable cache dir, why) of each kind."""
    make, why = UNUSABLE[request.param]
    path = make(tmp_path)
    yield path, why.format(tmp=tmp_path)
    if request.param == "not writable":
        subprocess.run(["chattr", "-i", str(path)], check=True)  # else tmp_path cannot be removed


def test_unusable_cache_dir_warns_in_every_process(unusable, tmp_path):
    layer, why = unusable
    fallback = tmp_path / f"jitkv-{os.geteuid()}"
    want = f"jitkv: cache dir {layer} {why}; builds go to {fallback}. {HINT}"
    for process in ("first", "second"):  # the second finds the temp dir the first created
        out = _lookup(layer, tmp_path)
        assert out["warnings"] == [want], (process, out)
        assert out["builds"] == str(fallback) and str(fallback) in out["layers"], (process, out)
    assert fallback.stat().st_mode & 0o777 == 0o700


def test_refused_layer_before_a_writable_one_names_where_builds_go(tmp_path):
    refused, writable = _dir(tmp_path / "open", 0o777), tmp_path / "rw"
    want = f"jitkv: cache dir {refused} is ignored: group/world-writable (mode 777); builds go to {writable}"
    for process in ("first", "second"):
        out = _lookup([refused, writable], tmp_path)
        assert out["warnings"] == [want] and out["builds"] == str(writable), (process, out)
        assert out["layers"] == [str(writable)], (process, out)


def test_refused_temp_dir_is_one_warning_naming_the_layer(tmp_path):
    layer, fallback = _file(tmp_path / "file") / "cache", _file(tmp_path / f"jitkv-{os.geteuid()}")
    listing = f"cache dir {layer} cannot be created: {tmp_path / 'file'} is not a directory"
    out = _lookup(layer, tmp_path)
    assert out["warnings"] == [
        f"jitkv: {listing}; refusing temp cache dir {fallback}: not a directory; "
        "jit kernels that are not prebuilt fall back"
    ], out
    assert (
        out["builds"]
        == f"JitUnavailable: no usable cache dir: {listing}; temp cache dir {fallback} refused (not a directory)"
        and out["layers"] == []
    ), out


def test_cache_dir_warning_names_the_callers_file(tmp_path, monkeypatch):
    monkeypatch.setenv("JITKV_CACHE_DIR", str(_file(tmp_path / "file") / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the fallback: under tmp_path, not /tmp
    with pytest.warns(RuntimeWarning, match="cannot be created") as caught:
        cache_dir()
    assert [w.filename for w in caught] == [__file__]


def test_import_time_warning_names_the_import_line(tmp_path):
    app = tmp_path / "app.py"
    app.write_text("import os\nimport jitkv\n")
    res = subprocess.run(
        [sys.executable, str(app)],
        capture_output=True,
        text=True,
        env=child_env(tmp_path / "cache", JITKV_LOG_LEVEL="bogus"),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr.startswith(
        f"{app}:2: RuntimeWarning: jitkv: JITKV_LOG_LEVEL='bogus' is not a logging level; using INFO\n"
    ), res.stderr


def test_importing_the_test_helpers_creates_nothing(tmp_path):
    """Child processes import jitkv.tests.conftest for its helpers: only pytest's hooks make the session's
    scratch dir."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {
        k: v
        for k, v in child_env(tmp_path, TMPDIR=str(scratch)).items()
        if k not in ("JITKV_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
    }
    code = "import os, jitkv.tests.conftest; print(os.environ.get('JITKV_CACHE_DIR'))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "None\n" and list(scratch.iterdir()) == []
