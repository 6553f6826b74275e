"""SIGKILL during export, at random points: the artifact at the path is always a whole one.

Each run starts a process that exports in a loop (alternating two models over the same path)
and SIGKILLs it at a random moment: half of the runs from outside, anywhere in an export
(mostly while tracing and lowering), half from a timer inside the process, at a random point
of its write (the temporary sibling's files, the manifest, fsync, the swap, removing the
previous artifact): a window of milliseconds no outside kill could aim at. After every kill
the artifact at the path loads and gives exactly one of the models' outputs, and any
temporary sibling the dead export left either fails to load or is a complete artifact of one
of them (it is never partial). The next export clears the dead export's siblings.

``tests/test_export.py`` kills one export at a chosen point (half of params written); this
kills many at random ones.
"""

import json
import random
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
from helpers import STRICT_WARNINGS

import symjax_mlp as sm

RUNS = 14  # sized for CI (2 cores, the suite under 10 minutes); each run starts a process
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


def _lane(path, runs, rng, outputs, x, report):
    try:
        for i in range(runs):  # odd runs: killed inside the write, even: from outside
            aim = rng.random() if i % 2 else None
            report.append(_kill_one_export(path, aim, rng, outputs, x))
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
    reports = [[] for _ in paths]
    lanes = [
        threading.Thread(
            target=_lane, args=(p, RUNS // LANES, random.Random(rng.random()), outputs, x, r)
        )
        for p, r in zip(paths, reports, strict=True)
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
