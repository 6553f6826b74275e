"""SIGKILL during export, at random points: the artifact at the path is always a whole one.

Each run starts a process that exports in a loop (alternating two models over the same path)
and SIGKILLs it at a random moment: half of the runs from outside, anywhere in an export
(mostly while tracing and lowering), half from a timer inside the process, at a point of its
write (the temporary sibling's files, the manifest, fsync, the swap, removing the previous
artifact): a window of milliseconds no outside kill could aim at. The aimed kills spread over
the write, one at random in each of its ``RUNS / 2`` equal slices. After every kill
the artifact at the path loads and gives exactly one of the models' outputs, and any
temporary sibling the dead export left either fails to load or is a complete artifact of one
of them (it is never partial). The next export clears the dead export's siblings.

``tests/test_export.py`` kills one export at a chosen point (half of params written); this
kills many at random ones. Last, what other users and other containers leave: a cache
directory others can write, an op report planted there, another container's live export.
"""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading

import jax.extend.mlir as jex
import numpy as np
import pytest
from helpers import STRICT_WARNINGS

import symjax_mlp as sm
from symjax_mlp import _files
from symjax_mlp._artifact import checker

RUNS = 8  # sized for CI's `-m slow` run (2 cores); each run starts a process
LANES = 2  # runs in parallel, each lane on its own artifact path
MODELS = textwrap.dedent(
    """
    import numpy as np
    import symjax_mlp as sm

    def model(seed):  # NumPy-drawn params: no init program to compile in every process
        rng = np.random.default_rng(seed)

        def dense(i, o):
            kernel = rng.normal(0, 0.3, (i, o)).astype(np.float32)
            return {"kernel": kernel, "bias": rng.normal(0, 0.3, (o,)).astype(np.float32)}

        params = {"layers_0": dense(64, 512), "layers_1": dense(512, 3)}  # 130 kB of weights
        return sm.hybridize(sm.mlp((512, 3)), {"params": params})

    x = np.linspace(-1, 1, 2 * 64, dtype=np.float32).reshape(2, 64)
    """
)
# Exports models 2 and 3 in turn, forever. After four timed exports it prints "go"; if AIM (a
# fraction) is set, the next export's write (from its first file through the manifest, fsync,
# swap and removal of the previous artifact) starts a timer that SIGKILLs the process AIM of
# the way through it: a kill from outside cannot aim at a window of a few milliseconds. The
# write is timed through the documented seam, symjax_mlp._files.write_file: its first call in
# an export is the start of the write, the export's return its end.
LOOP = MODELS + textwrap.dedent(
    """
    import os, signal, threading, time
    import symjax_mlp._files as files_seam
    write_file, marks = files_seam.write_file, {}

    def timed_write_file(file, data):
        if marks.get("start") is None:  # this export's first file: its write begins
            marks["start"] = time.perf_counter()
            if marks.get("armed"):  # AIM of the way through a write of the median duration
                delay = AIM * sorted(durations)[len(durations) // 2]
                threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        write_file(file, data)

    files_seam.write_file = timed_write_file
    models, durations, i = (model(2), model(3)), [], 0
    while True:
        if i == 4:
            print("go", flush=True)
            marks["armed"] = AIM is not None
        marks["start"] = None
        sm.export(models[i % 2], PATH, example=x, overwrite=True)
        durations.append(time.perf_counter() - marks["start"])
        i += 1
    """
)


def _siblings(path):
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def _lane(path, aims, rng, outputs, x, report):
    try:
        for aim in aims:  # a run killed from outside, then one killed inside the write
            for a in (None, aim):
                report.append(_kill_one_export(path, a, rng, outputs, x))
    except BaseException as e:  # reported, and failed on, in the test's thread
        report.append(f"{type(e).__name__}: {e}")


def _kill_one_export(path, aim, rng, outputs, x):
    proc = subprocess.Popen(
        [sys.executable, *STRICT_WARNINGS, "-c", f"PATH, AIM = {str(path)!r}, {aim!r}\n{LOOP}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=path.parent,
    )
    try:
        if proc.stdout.readline() != "go\n":
            return f"the export loop did not start: {proc.stderr.read()[-2000:]}"
        # from outside: within the next exports (each takes about 0.1 s); aimed: it kills itself
        proc.wait(timeout=rng.uniform(0, 0.2) if aim is None else 60)
    except subprocess.TimeoutExpired:
        pass
    finally:
        proc.kill()  # SIGKILL, if it is still alive
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    left = _siblings(path)

    def which(p):
        y = np.asarray(sm.load(p)(x)).tobytes()
        return outputs.index(y) if y in outputs else "an unknown output"

    entry = {"aim": aim, "returncode": proc.returncode, "which": which(path), "siblings": []}
    sm.inspect(path)  # every checksum holds
    for sibling in left:
        try:
            entry["siblings"].append(f"complete {which(sibling)}")
        except sm.ArtifactError:
            entry["siblings"].append("refused")
    return entry


@pytest.mark.slow  # 8 processes killed mid-export (~12 s); CI runs it with `-m slow`
def test_sigkill_during_export_never_leaves_a_partial_artifact(tmp_path):
    namespace = {}
    exec(MODELS, namespace)
    model, x = namespace["model"], namespace["x"]
    outputs = [np.asarray(model(seed)(x)).tobytes() for seed in (1, 2, 3)]
    paths = [tmp_path / f"lane{i}" / "m" for i in range(LANES)]
    for path in paths:
        path.parent.mkdir()
        sm.export(model(1), path, example=x)  # the artifact there before the first kill
    rng = random.Random(0)
    aimed = RUNS // 2  # spread over the write, from its first file to the old artifact's removal
    aims = [(k + rng.random()) / aimed for k in range(aimed)]
    reports = [[] for _ in paths]
    lanes = [
        threading.Thread(
            target=_lane, args=(p, aims[i::LANES], random.Random(rng.random()), outputs, x, r)
        )
        for i, (p, r) in enumerate(zip(paths, reports, strict=True))
    ]
    for lane in lanes:
        lane.start()
    for lane in lanes:
        lane.join()
    runs = [entry for report in reports for entry in report]
    print("\n" + "\n".join(map(json.dumps, runs)))
    assert len(runs) == RUNS and all(isinstance(e, dict) for e in runs), runs
    assert all(e["returncode"] == -signal.SIGKILL for e in runs)  # killed, not finished
    assert {e["which"] for e in runs} <= {0, 1, 2}  # a whole artifact of a known model
    siblings = [s for e in runs for s in e["siblings"]]
    assert set(siblings) <= {"refused", "complete 0", "complete 1", "complete 2"}, siblings
    assert any(e["siblings"] for e in runs)  # some kills did land inside the write
    for path in paths:  # the next export removes what the dead ones left behind
        sm.export(model(2), path, example=x, overwrite=True)
        assert _siblings(path) == []
        assert np.asarray(sm.load(path)(x)).tobytes() == outputs[1]


# -- what other users and other containers left: caches and temporary siblings ---------------
def test_a_cache_directory_others_can_write_or_own_is_not_used(tmp_path, monkeypatch):
    """As pip: a cache directory (or a symjax_mlp one above it) that another user owns or
    anyone else can write is not used; the caller sees no cache, not an error."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    ops = _files.cache_dir("ops")
    assert ops == tmp_path / "xdg" / "symjax_mlp" / "ops" and ops.stat().st_mode & 0o777 == 0o700
    assert len(_files.cache_secret()) == 32
    assert (ops.parent / "key").stat().st_mode & 0o777 == 0o600
    for d in (ops.parent, ops):
        d.chmod(0o777)  # planted by anyone: not ours
        assert _files.cache_dir("ops").is_relative_to(os.devnull)
        assert not _files.cache_dir("ops").parent.is_dir()
        d.chmod(0o700)
    assert _files.cache_dir("ops") == ops
    monkeypatch.setattr(os, "getuid", lambda: os.stat(ops).st_uid + 1)  # another user's
    assert _files.cache_dir("ops").is_relative_to(os.devnull) and _files.cache_secret() is None


def test_a_relative_xdg_cache_home_is_ignored_as_the_xdg_spec_says(tmp_path, monkeypatch):
    """XDG_CACHE_HOME=cache made a symjax_mlp cache below whatever directory a process ran in
    (the spec: a relative path is invalid, ignored); ~/.cache is used instead."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    for relative in ("cache", "./cache", ""):
        monkeypatch.setenv("XDG_CACHE_HOME", relative)
        assert _files.cache_dir("ops") == tmp_path / "home" / ".cache" / "symjax_mlp" / "ops"
    assert not (tmp_path / "cache").exists()


def test_an_op_report_planted_in_the_cache_is_not_trusted(tmp_path, monkeypatch):
    """A well-formed report for a module with a host callback, planted under the public key
    (the module's sha256, jaxlib's version, the checker's source) by this very user: without
    this user's secret key it is not trusted, and the module is checked again."""
    from jax.extend.mlir import ir
    from jax.interpreters import mlir as jax_mlir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    text = (
        "module @m {\n  func.func public @main(%x: tensor<2xf32>) -> tensor<2xf32> {\n"
        "    %y = stablehlo.custom_call @xla_python_cpu_callback(%x) : (tensor<2xf32>) -> "
        "tensor<2xf32>\n    return %y : tensor<2xf32>\n  }\n}\n"
    )
    with jax_mlir.make_ir_context():
        data = bytes(jex.serialize_portable_artifact(ir.Module.parse(text), "1.0.0"))
    clean = {"counts": {"func.func": 1}, "custom_calls": {}, "work": 1, "problems": []}
    entry = _files.cache_dir("ops") / checker._cache_key(_files.sha256(data))
    for planted in (json.dumps(clean).encode(), b"0" * 64 + b"\n" + json.dumps(clean).encode()):
        entry.write_bytes(planted)
        report = checker.analyze(data, file=tmp_path / "m")
        assert [p.key for p in report.problems] == ["custom_call:xla_python_cpu_callback"]
    checker.remember("verdict")  # and what this user wrote is trusted, not a planted copy
    assert checker.remembered("verdict")
    (_files.cache_dir("ops") / checker._cache_key("forged")).write_bytes(b"forged")
    assert not checker.remembered("forged")
    monkeypatch.setattr(checker.CHECKER, "report", None)  # cached now: never called
    assert checker.analyze(data, file=tmp_path / "m") == report


HOLD = (
    "import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDONLY)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(120)\n"
)


def test_a_temporary_sibling_whose_pid_looks_dead_but_is_locked_is_left_alone(tmp_path):
    """Two containers exporting to one volume: the other's pid is dead in this PID namespace,
    but it holds its temporary directory's lock while it writes, so it is left alone; once
    it is gone (the lock released), the next export removes what it left."""
    path = tmp_path / "art"
    theirs = tmp_path / f".art.tmp-{(1 << 22) + 1}-0123abcd"  # a pid above any pid_max
    theirs.mkdir()
    (theirs / "params.safetensors").write_bytes(b"half")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(theirs)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        _files.write_dir(path, {"a": b"1"}, overwrite=False, check=lambda *_: None, error=Exception)
        _files.remove_stale(path)
        assert (theirs / "params.safetensors").read_bytes() == b"half"
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    _files.write_dir(path, {"a": b"2"}, overwrite=True, check=lambda *_: None, error=Exception)
    assert not theirs.exists() and _siblings(path) == []
    assert (path / "a").read_bytes() == b"2"
