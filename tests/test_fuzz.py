"""Loader fuzzing, and what an artifact can never do: escape its directory, allocate what its
manifest declares, run code, or return a different answer.

The fuzz cases run in worker processes (the ``tests/fuzzing`` package: its driver starts
``python -m fuzzing.worker``), so a crash is a counted signal, not a dead test run. Six
targets: ``loader`` (a real artifact mutated every way), ``entries`` (the same, on an artifact
of two entry points, every entry point called), ``hostile`` (consistent artifacts a stranger
made: forged programs, crafted weights, planted files), ``checkpoint``, ``bodies`` and
``regions`` (the checker's accounting of nested regions). CI runs
``SYMJAX_FUZZ_CASES`` loader cases (default 500), ``SYMJAX_FUZZ_ENTRY_CASES`` (400),
``SYMJAX_FUZZ_HOSTILE_CASES`` (150), ``SYMJAX_FUZZ_CHECKPOINT_CASES`` (200),
``SYMJAX_FUZZ_BODY_CASES`` (2000) and ``SYMJAX_FUZZ_REGION_CASES`` (250) in one worker
process each (``SYMJAX_FUZZ_WORKERS``), about 20 CPU-seconds in all: enough for every family
of every target (each test asserts that it met them all), a smoke test of the fuzzers; the
release run, documented in RELIABILITY.md, is::

    SYMJAX_FUZZ_CASES=20000 SYMJAX_FUZZ_HOSTILE_CASES=12000 SYMJAX_FUZZ_CHECKPOINT_CASES=8000 \
        SYMJAX_FUZZ_BODY_CASES=20000 SYMJAX_FUZZ_REGION_CASES=20000 \
        SYMJAX_FUZZ_ENTRY_CASES=20000 SYMJAX_FUZZ_WORKERS=2 pytest tests/test_fuzz.py -k fuzzed -s
"""

import hashlib
import json
import os
import pickle
import shutil
import signal
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from fuzzing.driver import fuzz
from helpers import small

import symjax_mlp as sm

CASES = int(os.environ.get("SYMJAX_FUZZ_CASES", "500"))
ENTRY_CASES = int(os.environ.get("SYMJAX_FUZZ_ENTRY_CASES", "400"))
HOSTILE_CASES = int(os.environ.get("SYMJAX_FUZZ_HOSTILE_CASES", "150"))
CHECKPOINT_CASES = int(os.environ.get("SYMJAX_FUZZ_CHECKPOINT_CASES", "200"))
BODY_CASES = int(os.environ.get("SYMJAX_FUZZ_BODY_CASES", "2000"))  # ~1 ms each
REGION_CASES = int(os.environ.get("SYMJAX_FUZZ_REGION_CASES", "250"))  # ~40 ms each
SEED = int(os.environ.get("SYMJAX_FUZZ_SEED", "0"))
# One worker process per run in the suite: the same cases, seed and outcomes as two would give,
# for one JAX start in place of two (the six runs: 27 -> 19 CPU-s); xdist already keeps the
# cores busy. A release run may set more (the driver splits the cases into contiguous ranges).
WORKERS = int(os.environ.get("SYMJAX_FUZZ_WORKERS", "1"))


# -- the fuzz run -------------------------------------------------------------------------------
def _fuzzed(tmp_path, cases: int, target: str) -> dict:
    """A fuzz run of ``target``: every case refused or unchanged (both seen), nothing run from
    the artifacts; its summary."""
    summary = fuzz(tmp_path, cases=cases, seed=SEED, workers=WORKERS, target_name=target)
    print("\n" + json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=2))
    failures = summary["failures"]
    assert failures == [], f"{len(failures)} failing case(s):\n" + "\n".join(
        f"  case {f['case']}: {f['outcome']} after {f.get('notes')}: "
        f"{f.get('detail', f.get('returncode', ''))!s:.400}\n    {f['reproduce']}"
        for f in failures[:20]
    )
    assert not summary["code_executed"]
    counts = summary["counts"]
    assert sum(counts.values()) == cases and set(counts) <= {"rejected", "same"}
    assert counts["rejected"] > cases // 2 and counts.get("same", 0) > 0
    return summary


def _kinds(summary) -> set[str]:
    return {k.split(":")[0] for k in summary["families"]}


@pytest.mark.slow  # a fuzz run (~5-12 s): CI runs it with `-m slow`
def test_fuzzed_artifacts_are_refused_or_load_unchanged(tmp_path):
    summary = _fuzzed(tmp_path, CASES, "loader")
    assert _kinds(summary) == {"raw", "resigned", "manifest", "text"}
    assert summary["max_rss_mb"] < 1024  # no worker allocated anything a manifest declared


@pytest.mark.slow  # a fuzz run (~5-12 s): CI runs it with `-m slow`
def test_fuzzed_entry_points_are_refused_or_run_their_own_program(tmp_path):
    """Every entry point of a mutated two-entry artifact, ``m[name](x)``: refused, or what the
    original entry point whose program it runs gave."""
    summary = _fuzzed(tmp_path, ENTRY_CASES, "entries")
    assert _kinds(summary) == {"raw", "resigned", "manifest", "text", "entry", "entry-text"}
    assert summary["max_rss_mb"] < 1024


@pytest.mark.slow  # a fuzz run (~5-12 s): CI runs it with `-m slow`
def test_fuzzed_hostile_artifacts_are_refused_or_run_their_benign_program(tmp_path):
    summary = _fuzzed(tmp_path, HOSTILE_CASES, "hostile")
    assert summary["largest_listed_file_mb"] == 64  # among them: hashed in chunks, never held
    assert summary["max_rss_mb"] < 1024


def test_fuzzed_checkpoints_are_refused_or_restore_what_they_hold(tmp_path):
    summary = _fuzzed(tmp_path, CHECKPOINT_CASES, "checkpoint")
    kinds = {f"checkpoint-{k}" for k in ("raw", "resigned", "crafted", "manifest", "text")}
    assert _kinds(summary) == kinds


def test_fuzzed_http_bodies_are_refused_or_read_as_sent(tmp_path):
    """Request bodies as POST /predict reads them: a 4xx's error, or the values sent (10**400
    and JSON booleans were a plain-text 500 and 1.0/0.0)."""
    summary = _fuzzed(tmp_path, BODY_CASES, "bodies")
    families = ("valid", "value", "structure", "bytes", "type")
    assert _kinds(summary) == {f"body-{k}" for k in families}


@pytest.mark.slow  # a fuzz run (~5-12 s): CI runs it with `-m slow`
def test_fuzzed_region_nestings_are_refused_exactly_when_over_the_bound(tmp_path):
    """Random nestings of reduce, while, call and case just under or over the work bound: the
    checker charges each region as often as XLA runs it (a reduce's body was charged once)."""
    summary = _fuzzed(tmp_path, REGION_CASES, "regions")
    edges = ("under", "over", "near", "edge", "edge+1")
    assert _kinds(summary) == {f"regions-{k}" for k in edges}


@pytest.mark.slow  # a fuzz run (~5-12 s): CI runs it with `-m slow`
def test_the_fuzz_driver_sees_crashes_hangs_and_wrong_outputs(tmp_path, monkeypatch):
    """The zeros above mean something: sabotaged cases are each caught and attributed."""
    monkeypatch.setenv("SYMJAX_FUZZ_SELFTEST", "1=crash,3=hang,4=foreign,6=wrong")
    summary = fuzz(tmp_path, cases=8, seed=SEED, workers=1, timeout=3)
    failed = {f["case"]: f for f in summary["failures"]}
    assert {c: f["outcome"] for c, f in failed.items()} == {
        1: "crash",
        3: "hang",
        4: "foreign",
        6: "wrong",
    }
    assert failed[1]["returncode"] == -signal.SIGSEGV and failed[1]["notes"]
    assert sum(summary["counts"].values()) == 8  # restarted after the crash and the hang


# -- escapes, allocations, code -----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """An artifact with two (3, 3) kernels (only their names tell them apart), and its output."""
    h, x = small(sizes=(3, 3, 2), features=3)
    path = tmp_path_factory.mktemp("tiny") / "art"
    sm.export(h, path, example=x)
    return path, x, np.asarray(sm.load(path)(x))


def _copy(art: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(art, copy)
    return copy


def _edit(copy: Path, edit) -> None:
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))


def _resign(copy: Path, name: str, data: bytes) -> None:
    """Replaces a file *and* records its new checksum, so the bytes reach a deserializer."""
    (copy / name).write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    _edit(copy, lambda m: m["files"].update({name: {"sha256": digest, "bytes": len(data)}}))


def _opened(monkeypatch) -> list[str]:
    """Records every path os.open is asked for (lexically: links are not resolved)."""
    seen, real = [], os.open

    def spy(path, *args, **kwargs):
        seen.append(os.path.abspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    return seen


def _relist(copy: Path, old: str, new: str) -> None:
    _edit(copy, lambda m: m["files"].__setitem__(new, m["files"].pop(old)))


ESCAPES = {
    "dot-dot name": lambda c, bait: _relist(c, "model.mlirbc", "../model.mlirbc"),
    "absolute name": lambda c, bait: _relist(c, "model.mlirbc", str(bait)),
    "dot-dot inside a name": lambda c, bait: _relist(c, "model.mlirbc", "x/../../model.mlirbc"),
    "relative symlink": lambda c, bait: (
        (c / "model.mlirbc").unlink(),
        (c / "model.mlirbc").symlink_to("../model.mlirbc"),
    ),
    "absolute symlink": lambda c, bait: (
        (c / "model.mlirbc").unlink(),
        (c / "model.mlirbc").symlink_to(bait),
    ),
    "extra absolute entry": lambda c, bait: _edit(
        c,
        lambda m: m["files"].update(
            {
                str(bait): {
                    "sha256": hashlib.sha256(bait.read_bytes()).hexdigest(),
                    "bytes": len(bait.read_bytes()),
                }
            }
        ),
    ),
}


@pytest.mark.parametrize("how", sorted(ESCAPES))
def test_paths_in_an_artifact_cannot_escape_its_directory(tiny, tmp_path, monkeypatch, how):
    art, _, _ = tiny
    copy = _copy(art, tmp_path)
    bait = tmp_path / "model.mlirbc"  # the very bytes the manifest records, waiting outside
    shutil.copy(art / "model.mlirbc", bait)
    ESCAPES[how](copy, bait)
    seen = _opened(monkeypatch)
    for read in (sm.load, sm.inspect):
        with pytest.raises(sm.ArtifactError, match=r"not a file name|plain files|symbolic link"):
            read(copy)
    monkeypatch.undo()
    assert seen and not [p for p in seen if not p.startswith(str(copy) + os.sep)]


def _safetensors_header(copy: Path, shape: list[int]) -> bytes:
    """params.safetensors whose first tensor claims ``shape`` (over the same 12 data bytes)."""
    data = (copy / "params.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["params/layers_0/bias"]["shape"] = shape
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


SPARSE = ("model.jaxexport", "model.mlirbc", "selftest.safetensors")
ENORMOUS = {
    "param shape": lambda c: _edit(c, lambda m: m["params"][1].update(shape=[2**40, 2**40])),
    "input shape": lambda c: _edit(
        c, lambda m: m["signature"]["inputs"][0].update(shape=[2**62, 3])
    ),
    "output shape": lambda c: _edit(
        c, lambda m: m["signature"]["outputs"][0].update(shape=["b", 2**63])
    ),
    "file size": lambda c: _edit(c, lambda m: m["files"]["params.safetensors"].update(bytes=2**40)),
    "safetensors header": lambda c: _resign(
        c, "params.safetensors", _safetensors_header(c, [2**40, 2**40])
    ),
    "both": lambda c: (
        _edit(c, lambda m: m["params"][0].update(shape=[2**31, 2**31])),
        _resign(c, "params.safetensors", _safetensors_header(c, [2**31, 2**31])),
    ),
    # files load holds whole, sparse: 2 GiB of nothing on disk (a module is less: a FlatBuffer)
    **{f"{name} of 2 GiB": lambda c, name=name: _sparse(c, name, 2**31) for name in SPARSE},
    "params.safetensors of 8 TiB": lambda c: _sparse(c, "params.safetensors", 2**43, tensor=True),
    "a tensor of 64 MiB the manifest lacks": lambda c: _resign(
        c, "params.safetensors", _with_tensor(c / "params.safetensors", "junk", 2**26)
    ),
}


def _with_tensor(file: Path, name: str, size: int) -> bytes:
    """``file``'s safetensors bytes with one more tensor, of ``size`` zero bytes, at the end."""
    data = file.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    end = len(data) - 8 - n
    header[name] = {"dtype": "U8", "shape": [size], "data_offsets": [end, end + size]}
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :] + bytes(size)


def _sparse(copy: Path, name: str, size: int, tensor: bool = False) -> None:
    """``name`` as a sparse file of ``size`` bytes, listed with that size (``tensor``: a
    safetensors file whose one tensor's bytes fill it, valid as far as its header tells)."""
    if tensor:
        header = json.dumps({"a": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}})
        (copy / name).write_bytes(len(header).to_bytes(8, "little") + header.encode())
        size += 8 + len(header)
    os.truncate(copy / name, size)
    _edit(copy, lambda m: m["files"][name].update(bytes=size))


@pytest.mark.parametrize("what", sorted(ENORMOUS))
def test_enormous_declared_shapes_are_never_allocated(tiny, tmp_path, what):
    art, _, _ = tiny
    copy = _copy(art, tmp_path)
    ENORMOUS[what](copy)
    tracemalloc.start()
    try:
        with pytest.raises(sm.ArtifactError):
            sm.load(copy)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"loading allocated {peak / 1e6:.0f} MB"


def test_loading_never_runs_code_from_the_artifact(tiny, tmp_path):
    art, x, y = tiny
    marker = tmp_path / "PWNED"
    code = f"open({str(marker)!r}, 'w').close()\n"
    copy = _copy(art, tmp_path)
    modules = ("sitecustomize", "usercustomize", "__init__", "__main__", "jax", "numpy")
    for name in (*modules, "safetensors", "symjax_mlp", "model"):
        (copy / f"{name}.py").write_text(code)
    evil = (copy / "model.py").read_bytes()

    def hostile(m):
        m["name"], m["created"], m["versions"]["jax"] = code, f"{{{code}}}", f"$({code})"
        m["files"]["model.py"] = {"sha256": hashlib.sha256(evil).hexdigest(), "bytes": len(evil)}

    _edit(copy, hostile)
    before = set(sys.modules)
    np.testing.assert_array_equal(sm.load(copy)(x), y)  # read as bytes, checksummed, unused

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    _resign(copy, "params.safetensors", pickle.dumps(Payload()))
    with pytest.raises(sm.ArtifactError, match="not a valid safetensors file"):
        sm.load(copy)
    assert not marker.exists()
    new = [module for name, module in sys.modules.items() if name not in before]
    assert not [m for m in new if str(getattr(m, "__file__", "")).startswith(str(copy))]


# -- each bug the fuzzer found, pinned -----------------------------------------------------------
def _swap_kernel_names(m):
    kernels = [p for p in m["params"] if p["shape"] == [3, 3]]
    kernels[0]["path"], kernels[1]["path"] = kernels[1]["path"], kernels[0]["path"]


def _other_module(copy):
    other = copy.parent / "other"
    h, x = small(seed=7, sizes=(3, 3, 2), features=3)
    sm.export(sm.hybridize(lambda p, x: h.fn(p, x) * 2, h.params), other, example=x)
    _resign(copy, "model.jaxexport", (other / "model.jaxexport").read_bytes())


def _flip_module(copy):
    blob = bytearray((copy / "model.jaxexport").read_bytes())
    start = bytes(blob).find((copy / "model.mlirbc").read_bytes())
    blob[start + 1000] ^= 0x10
    _resign(copy, "model.jaxexport", bytes(blob))


def _replace(copy, name, make):
    (copy / name).unlink()
    make(copy / name)


FOUND = {  # what the loader did before the fix -> now
    "output_kind array->tuple (returned a tuple)": lambda c: _edit(
        c, lambda m: m["signature"].update(output_kind="tuple")
    ),
    "jaxexport of another model, re-signed (ran it)": _other_module,
    "jaxexport's StableHLO flipped, re-signed (JaxRuntimeError at call)": _flip_module,
    "output dtype edited (a lying signature)": lambda c: _edit(
        c, lambda m: m["signature"]["outputs"][0].update(dtype="float16")
    ),
    "FIFO (hung forever)": lambda c: _replace(c, "params.safetensors", os.mkfifo),
    "symlink to /dev/zero (read until out of memory)": lambda c: _replace(
        c, "model.mlirbc", lambda f: f.symlink_to("/dev/zero")
    ),
    "directory (IsADirectoryError)": lambda c: _replace(c, "manifest.json", Path.mkdir),
    "deep JSON (RecursionError)": lambda c: (c / "manifest.json").write_text("[" * 10**5),
    "NUL in a file name (ValueError)": lambda c: _relist(c, "model.mlirbc", "model.mlirbc\x00"),
    "300-char file name (OSError)": lambda c: _relist(c, "model.mlirbc", "a" * 300),
    "sha256 an int (TypeError)": lambda c: _edit(
        c, lambda m: m["files"]["model.mlirbc"].update(sha256=12)
    ),
    "nr_devices a string (TypeError)": lambda c: _edit(c, lambda m: m.update(nr_devices="1")),
    "platforms null (TypeError)": lambda c: _edit(c, lambda m: m.update(platforms=None)),
    "param entry a list (TypeError)": lambda c: _edit(c, lambda m: m["params"].append([3])),
    "files a list (AttributeError)": lambda c: _edit(c, lambda m: m.update(files=[])),
    "signature without inputs (KeyError)": lambda c: _edit(
        c, lambda m: m["signature"].pop("inputs")
    ),
}


@pytest.mark.parametrize("bug", sorted(FOUND))
def test_each_loader_bug_the_fuzzer_found_is_an_artifact_error_now(tiny, tmp_path, bug):
    art, x, _ = tiny
    copy = _copy(art, tmp_path)
    FOUND[bug](copy)
    with pytest.raises(sm.ArtifactError) as info:
        sm.load(copy)(x)
    assert str(copy) in str(info.value)


def test_params_are_bound_by_name_so_swapped_names_change_nothing(tiny, tmp_path):
    """Two (3, 3) kernels trading names in the manifest once swapped the weights silently."""
    art, x, y = tiny
    copy = _copy(art, tmp_path)
    _edit(copy, _swap_kernel_names)
    np.testing.assert_array_equal(sm.load(copy)(x), y)
    _edit(copy, lambda m: m["params"].reverse())  # nor does the order of the entries
    np.testing.assert_array_equal(sm.load(copy)(x), y)
    _edit(copy, lambda m: m["params"][0].update(path="params/layers_9/bias"))
    with pytest.raises(sm.ArtifactError, match=r"jaxexport does not match .*params/layers_9/b"):
        sm.load(copy)
