"""The laboratory (``scripts/benchmarks``, run by ``scripts/bench.py``): fields, structure, JSON
and its command line; never speeds.

Every run here uses tiny call counts and a tiny net so the file stays well under a minute.
``scripts/`` is on ``sys.path`` (conftest.py). Tests that need PyTorch are marked ``torch``
and skipped, saying so, where it is not installed; the figures' tests need matplotlib.
"""

import dataclasses
import inspect
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from benchmarks import (
    compare,
    devices,
    figures,
    per_request,
    run,
    scaling,
    stateful,
    timing,
    train_step,
)
from benchmarks import report as reports
from benchmarks.cli import main as lab_main
from helpers import made_once

import symjax_mlp as sm

SCRIPTS = Path(__file__).parent.parent / "scripts"


def needs_torch():
    """torch, or a skip that says why (the lab's PyTorch rows need the ``torch`` extra)."""
    return pytest.importorskip("torch", reason="the PyTorch rows need torch: pip install torch")


def needs_matplotlib():
    """matplotlib's image reader, or a skip that says why (the figures need the plot extra)."""
    return pytest.importorskip("matplotlib.image", reason="figures need matplotlib: [plot]")


TINY = {"sizes": (8, 2), "in_features": 16}


def tiny_benchmark(**kw):
    """The benchmark on a tiny net with the fewest calls; ``kw`` overrides."""
    fewest = {"calls": 2, "repeats": 1, "eager_chunks": 1, "stage_repeats": 1}
    off = {"peak": False, "train_step": False, "latency": False}  # the slow or spawning parts
    return run.benchmark(**(fewest | off | TINY | kw))


def test_timing_fields_and_stats():
    t = timing.time_calls(lambda: jnp.ones(3) + 1, name="add", calls=4, repeats=5, warmup=2)
    assert (t.name, t.calls, t.inputs_per_call, len(t.times)) == ("add", 4, 1, 5)
    assert all(s > 0 for s in t.times)
    assert t.min <= t.median <= max(t.times)
    assert t.per_call_min == pytest.approx(t.min / 4)
    assert t.spread == pytest.approx(t.median / t.min - 1) and t.spread >= 0
    lo, med = t.per_inputs(1000)
    assert lo == pytest.approx(t.min * 250) and med == pytest.approx(t.median * 250)
    d = t.to_dict()
    assert set(d) >= {"calls", "repeats", "times_s", "min_s", "median_s", "per_call_min_s"}
    assert d["spread"] == t.spread
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.calls = 1


def test_every_timed_call_is_synced():
    synced = []

    class Out:
        def block_until_ready(self):
            synced.append(1)
            return self

    timing.time_calls(Out, calls=3, repeats=5, warmup=2)
    assert len(synced) == 2 + 3 * 5  # warm-up calls and every timed call
    synced.clear()
    made = []
    t = timing.time_calls(lambda: made.append(1) or Out(), calls=3, repeats=5, pipelined=True)
    assert len(made) == 10 + 3 * 5 and len(synced) == 2 + 5  # one sync per loop: the last call
    assert t.pipelined and t.to_dict()["pipelined"]


def test_interleaved_order_and_inputs_per_call():
    order = []
    fns = {k: (lambda k=k: order.append(k)) for k in "abc"}
    t = timing.time_interleaved(fns, calls=1, repeats=4, warmup=1, inputs_per_call={"b": 10})
    # the warm-ups, then repeat r of each in turn, the turn rotating: each follows each other
    assert order == [*"abc", *"abc", *"bca", *"cab", *"abc"]
    assert list(t) == ["a", "b", "c"] and t["b"].inputs_per_call == 10


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="calls and repeats must be >= 1"):
        timing.time_calls(lambda: 0, calls=0)


def test_stages_are_timed_separately():
    s = timing.time_stages(lambda x: x * 2 + 1, jnp.ones(3), repeats=2)
    assert list(s) == ["trace", "lower", "compile"]
    assert all(len(t.times) == 2 and t.min > 0 for t in s.values())


def test_environment_says_where_it_ran():
    env = timing.environment()
    for key in ("jax", "jaxlib", "flax", "python", "backend", "device", "device_kind", "cpu_model"):
        assert isinstance(env[key], str) and env[key]
    assert env["cpu_count"] >= 1 and env["cpu_usable"] >= 1


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One run with every row that needs no extra framework: the artifact in JAX and IREE;
    made once in the test run, pytest-xdist's workers reading the first one's."""

    def make(path):
        made = tiny_benchmark(calls=4, repeats=2, eager_chunks=2, peak=True, peak_size=32,
                              latency=True)  # fmt: skip
        assert sm.serving.dispatch_mode() == "async"  # the process that ran it: left as it was
        path.write_bytes(pickle.dumps(made))

    return pickle.loads(made_once(tmp_path_factory, "bench_report.pickle", make).read_bytes())


def test_report_rows_and_headline(report):
    keys = [r.key for r in report.rows]
    assert keys[:5] == ["eager", "flax_eager", "jnp_eager", "hybridized", "floor"]
    assert keys[-2:] == ["vmap", "batch"]
    assert report.rows[0].speedup == pytest.approx(1.0)
    assert all(r.speedup > 0 for r in report.rows)
    assert report.row("eager").timing.calls * len(report.row("eager").timing.times) == 4
    assert report.row("hybridized").timing.calls == 4
    assert report.row("vmap").timing.inputs_per_call == 4
    assert report.without_s == pytest.approx(sum(report.row("eager").timing.times))
    assert report.with_s == pytest.approx(report.row("hybridized").timing.median)
    assert set(report.stages) >= {"trace", "lower", "compile", "first_call"}
    assert report.extra["peak"]["size"] == 32 and report.extra["peak"]["gflops"] > 0
    traces = report.extra["traces"]  # one trace per input shape, none while timing
    assert traces["count"] >= 2 and not any("same signature" in e for e in traces["log"])
    assert set(report.targets) >= {
        "hybridized_vs_eager",
        "hybridized_over_floor",
        "hybridized_over_floor_pipelined",
        "vmap_vs_single_calls",
    }
    piped = report.extra["pipelined"]  # the JAX rows again, one sync per repeat
    assert set(piped) == {"hybridized", "floor", "artifact_jax"} & {r.key for r in report.rows}
    assert all(t["pipelined"] and t["calls"] == 4 for t in piped.values())
    assert not report.row("hybridized").timing.pipelined
    for t in report.targets.values():
        assert set(t) == {"value", "target", "met", "what"} and isinstance(t["met"], bool)


def test_the_latency_mode_row_runs_h_with_synchronous_dispatch_in_its_own_process(report):
    row = report.row("hybridized_latency")
    assert row.label == "h, latency mode (own process)"
    assert row.timing.calls == 4 and len(row.timing.times) == 2 and not row.timing.pipelined
    assert report.extra["latency_mode"] == {"dispatch": "sync", "traces": 1}  # never retraced
    assert sm.serving.dispatch_mode() == "async"  # this process, and the run's (the fixture)
    text = reports.format_report(report)
    per = row.timing.per_call_min
    hyb = report.row("hybridized").timing.per_call_min
    assert "latency mode (sm.serving.latency_mode(): synchronous dispatch" in text
    assert f"{hyb / per:.2f}x faster than h here." in text  # no torch rows in this run
    assert report.env["dispatch"] == "async" and ", JAX async dispatch" in text
    assert "torch_fastest_over_latency_mode" not in report.targets


@pytest.mark.slow  # (the README suite: within 10 minutes on 2 cores)
def test_a_benchmark_run_in_latency_mode_says_so():
    """Run from a process already in latency mode, the table's own rows are synchronous: the
    report says which dispatch it ran in, and does not claim a hand-off it did not pay."""
    code = (
        "import symjax_mlp as sm; sm.serving.latency_mode(); from benchmarks import report, run; "
        "r = run.benchmark(calls=2, repeats=1, eager_chunks=1, stage_repeats=1, sizes=(8, 2), "
        "in_features=16, peak=False, train_step=False, artifact=False); "
        "print(r.env['dispatch']); print(report.format_report(r))"
    )
    env = dict(os.environ, PYTHONPATH=str(SCRIPTS))
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=env,
    ).stdout
    assert out.startswith("sync\n")
    assert "This process runs in latency mode too (synchronous dispatch)" in out
    assert "waits for JAX's dispatch thread" not in out and ", JAX sync dispatch" in out


def test_a_latency_row_that_fails_or_differs_is_skipped_with_a_note(monkeypatch):
    class Broken:
        def __init__(self, **kw):
            raise RuntimeError("the process died")

    monkeypatch.setattr(run, "LatencyRow", Broken)
    r = tiny_benchmark(artifact=False, latency=True)
    assert r.row("hybridized_latency") is None and "latency_mode" not in r.extra
    assert "latency-mode row skipped: the process died" in r.notes

    closed = []

    class Wrong:  # a child whose model is not the parent's
        dispatch, traces, x, out = "sync", 1, np.zeros((1, 16), np.float32), np.ones((1, 2))

        def __init__(self, **kw):
            pass

        def close(self):
            closed.append(True)

    monkeypatch.setattr(run, "LatencyRow", Wrong)
    r = tiny_benchmark(artifact=False, latency=True)
    assert r.row("hybridized_latency") is None and closed == [True]
    (note,) = [n for n in r.notes if "latency-mode" in n]
    assert note.startswith("latency-mode row skipped: its output [[1.0, 1.0]] differs from h's")


def test_a_latency_row_process_that_fails_says_why():
    from benchmarks.remote import LatencyRow

    with pytest.raises(RuntimeError, match=r"(?s)its process failed \(exit 1\):.*'no_such'"):
        LatencyRow(sizes=(4, 2), in_features=8, activation="no_such", seed=0, timeout=60)


def test_remote_rows_are_interleaved_with_the_others():
    order = []

    def local():
        order.append("local")
        return jnp.ones(2)

    def remote(calls):
        order.append(("remote", calls))
        return 0.5

    t = timing.time_interleaved(
        {"local": local}, calls=3, repeats=2, warmup=1, remote={"far": remote}
    )
    assert list(t) == ["local", "far"] and t["far"].times == (0.5, 0.5)
    # the remote row is never warmed up here (it warms itself), and each repeat asks it once
    assert order == ["local"] + ["local"] * 3 + [("remote", 3), ("remote", 3)] + ["local"] * 3


def test_report_text_starts_with_the_chapter_lines(report):
    lines = reports.format_report(report).splitlines()
    assert lines[0].startswith("Without hybridization: ") and lines[0].endswith(" sec")
    assert lines[1].startswith("With hybridization: ") and lines[1].endswith(" sec")
    text = "\n".join(lines)
    assert "hybridized (h)" in text and "AOT floor" in text and "ran on: " in text
    assert "what it means: " in text and "matmul rate" in text
    assert "pipelined, one sync per repeat" in text
    piped = report.extra["pipelined"]  # which sentence: as this run's own figures say
    if piped["hybridized"]["per_call_min_s"] > piped["floor"]["per_call_min_s"]:
        assert "h's own Python costs" in text
    else:
        assert "h was the faster of the two here" in text


def test_report_json_round_trips(report):
    d = json.loads(json.dumps(report.to_dict()))
    assert d["schema"] == 1  # documented in the module docstring of benchmarks.report
    assert d["chapter"]["calls"] == 4
    assert {r["key"] for r in d["rows"]} >= {"eager", "hybridized", "floor", "vmap"}
    assert d["env"]["backend"] and d["env"]["cpu_count"] >= 1
    assert d["config"]["sizes"] == [8, 2]


def test_artifact_rows_are_present_with_iree_installed(report):
    keys = [r.key for r in report.rows]
    assert keys[5:7] == ["artifact_jax", "artifact_iree"]  # after the floor, before vmap
    assert report.row("artifact_iree").label == "loaded artifact (IREE, CPU)"
    assert {"export", "load_jax", "load_iree"} <= set(report.stages)
    assert "artifact_over_hybridized" in report.targets
    assert not any("skipped" in n for n in report.notes)


def test_missing_iree_drops_its_row_with_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "iree.compiler", None)  # `import iree.compiler` fails
    monkeypatch.setitem(sys.modules, "iree.runtime", None)
    r = tiny_benchmark()
    keys = {row.key for row in r.rows}
    assert "artifact_jax" in keys and "artifact_iree" not in keys
    assert "load_iree" not in r.stages
    (note,) = [n for n in r.notes if "IREE" in n]
    assert note.startswith("artifact (IREE) row skipped: ArtifactError: ")
    assert "pip install 'symjax_mlp[iree]'" in note  # the note says what to do
    assert "note: " + note in reports.format_report(r)


def test_bad_compare_is_a_user_error():
    with pytest.raises(
        ValueError,
        match=r"benchmark\(compare=\('tensorflow',\)\): the frameworks to compare with are "
        r"\('torch',\); drop the others",
    ):
        run.benchmark(compare=("tensorflow",))


@pytest.mark.torch
def test_torch_rows_share_the_table():
    torch = needs_torch()
    r = tiny_benchmark(artifact=False, compare=("torch",), latency=True)
    keys = {row.key for row in r.rows}
    assert {"torch_eager", "torch_script", "torch_compile"} <= keys
    wanted = {"torch_fastest_over_hybridized", "torch_fastest_over_latency_mode"}
    assert wanted <= set(r.targets), r.notes
    latency = r.targets["torch_fastest_over_latency_mode"]
    keys = ("torch_eager", "torch_script", "torch_compile")
    fastest = min(keys, key=lambda k: r.row(k).timing.per_input_min)
    assert latency["value"] == pytest.approx(
        r.row(fastest).timing.per_input_min / r.row("hybridized_latency").timing.per_input_min
    )
    text = reports.format_report(r)
    assert f"than {r.row(fastest).label} (PyTorch's fastest here)" in text
    # async dispatch against PyTorch is reported; the per-request targets are latency mode's
    assert r.targets["torch_fastest_over_hybridized"]["met"] is None
    assert re.search(r"torch_fastest_over_hybridized +\d+\.\d+  \(no target\) reported", text)
    assert {"torch_script", "torch_compile"} <= set(r.stages)  # their compile times
    assert not any("differs" in n for n in r.notes)  # same weights, same outputs
    assert any(n.startswith(f"torch: {torch.__version__}, ") for n in r.notes)


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    """A sweep of batches 1 and 4, made once in the test run (as ``report``)."""

    def make(path):
        sweep = scaling.sweep(
            batch_sizes=(1, 4), eager_max_batch=1, repeats=2, min_seconds=0, peak_size=32, **TINY
        )
        path.write_bytes(pickle.dumps(sweep))

    return pickle.loads(made_once(tmp_path_factory, "bench_sweep.pickle", make).read_bytes())


def test_sweep_points_peak_and_json(tiny_sweep):
    s = tiny_sweep
    assert [(p.mode, p.batch) for p in s.points] == [
        ("hybridized", 1),
        ("eager", 1),
        ("hybridized", 4),
    ]
    assert s.peak_gflops > 0 and s.peak_size == 32
    p = s.points[-1]
    assert p.flops_per_call == 4 * s.points[0].flops_per_call > 0
    assert p.samples_per_s > 0 and p.gflops > 0
    assert p.seconds_per_example == pytest.approx(p.timing.per_call_min / 4)
    assert p.seconds_per_example <= p.seconds_per_example_median
    assert s.floor_seconds_per_example == pytest.approx(s.flops_per_example / (s.peak_gflops * 1e9))
    d = json.loads(json.dumps(s.to_dict()))
    assert d["schema"] == 1
    assert {"mode", "batch", "samples_per_s", "gflops", "fraction_of_peak"} <= set(d["points"][0])
    assert {"seconds_per_example_min", "seconds_per_example_median", "median_s"} <= set(
        d["points"][0]
    )
    text = scaling.format_sweep(s)
    assert "matmul peak" in text and "compute floor" in text and "median" in text


def svg_text(path):
    """The text of an SVG figure (its labels are kept as text, not as glyph outlines)."""
    return Path(path).read_text()


def test_sweep_figure_reads_like_a_paper_figure(tiny_sweep, tmp_path):
    written = figures.plot_sweep(tiny_sweep, tmp_path / "sweep")
    png, svg = map(Path, written)
    assert (png.name, svg.name) == ("sweep.png", "sweep.svg")  # PNG and SVG, one drawing
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert needs_matplotlib().imread(png).shape[:2] == (720, 1440)  # 12 x 6 in at 120 dpi
    text = svg_text(svg)
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    for shown in (
        "batch size (examples per call, log scale)",  # axes with units
        "seconds per example (log scale)",
        "achieved GFLOP/s (log scale)",
        "compute floor: ",  # the machine's limits, as lines
        "measured matmul rate ",
        "hybridized: fastest repeat",  # min and median, the band between
        "hybridized: median (shaded)",
        "eager: fastest repeat",
        "of 2 repeats",  # the caption: repeats, machine, versions
        tiny_sweep.env["cpu_model"],
        f"{tiny_sweep.env['cpu_usable']} of {tiny_sweep.env['cpu_count']} cores usable",
        f"jax {tiny_sweep.env['jax']}",
        f"symjax_mlp {tiny_sweep.env['symjax_mlp']}",
    ):
        assert shown in text, shown
    assert " µs" in text  # the time ticks carry their unit
    # a path with an image suffix names the same pair; formats pick the files
    (pdf,) = figures.plot_sweep(tiny_sweep, tmp_path / "again.png", formats=("pdf",))
    assert pdf == str(tmp_path / "again.pdf") and Path(pdf).read_bytes()[:4] == b"%PDF"


def test_degenerate_sweeps_are_refused(tiny_sweep, tmp_path):
    for batch_sizes in ((), (0, 4), (2, 2)):
        with pytest.raises(sm.ConfigError, match="pass distinct batch sizes >= 1"):
            scaling.sweep(batch_sizes=batch_sizes)
    one = dataclasses.replace(tiny_sweep, points=tiny_sweep.points[:2])  # batch 1 only
    with pytest.raises(sm.ConfigError, match="a curve needs at least 2"):
        figures.plot_sweep(one, tmp_path / "one")
    assert not list(tmp_path.iterdir())  # no empty plot written


# The CLI runs the real benchmark, with the fewest calls: its options reach the run.
FEWEST_ARGV = ["--repeats", "1", "--eager-chunks", "1", "--stage-repeats", "1", "--no-peak"]
FEWEST_ARGV += ["--no-per-request", "--no-latency"]  # their own tests; each starts a process


@pytest.mark.torch
def test_cli_bench_writes_json(tmp_path, capsys):
    needs_torch()
    out = tmp_path / "bench.json"
    argv = ["--calls", "4", "--sizes", "8,2", "--in-features", "16", *FEWEST_ARGV]
    argv += ["--no-train", "--compare", "torch", "--no-iree"]
    assert lab_main([*argv, "--quiet", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("Without hybridization: ")
    assert captured.err == ""  # --quiet: no progress display
    d = json.loads(out.read_text())
    assert {"chapter", "rows", "stages", "targets", "traces", "env", "config", "notes"} <= set(d)
    assert {"jax", "flax", "backend", "device_kind", "cpu_count"} <= set(d["env"])
    assert d["chapter"]["calls"] == d["config"]["calls"] == 4
    assert d["config"]["sizes"] == [8, 2] and d["config"]["compare"] == ["torch"]
    keys = {r["key"] for r in d["rows"]}
    assert {"torch_eager", "torch_script", "torch_compile"} <= keys  # --compare torch
    assert "artifact_jax" in keys and "artifact_iree" not in keys  # artifact on, --no-iree
    assert "train_step" not in d and "peak" not in d  # --no-train, --no-peak
    assert d["schema"] == 1 and d["config"]["quick"] is False
    assert "QUICK RUN" not in captured.out


def test_cli_bench_devices_table_and_json(tmp_path, capsys):
    needs_matplotlib()
    out = tmp_path / "bench.json"
    argv = ["--calls", "2", "--sizes", "8,2", "--in-features", "16", *FEWEST_ARGV]
    argv += ["--no-artifact", "--no-train", "--devices", "1", "--devices-out", str(tmp_path / "d")]
    assert lab_main([*argv, "--quiet", "--json", str(out)]) == 0  # one device: in-process
    d = json.loads(out.read_text())["devices"]
    assert d["n_devices"] == 1 and not d["in_subprocess"]
    assert d["sizes"] == [8, 2] and d["in_features"] == 16 and d["note"]
    (row,) = d["rows"]
    assert set(row) >= {
        "devices",
        "inference_examples_per_s",
        "train_examples_per_s",
        "inference_speedup",
        "compile_seconds",
        "max_abs_diff",
        "matches_1_device",
    }
    assert row["devices"] == 1 and row["inference_speedup"] == 1.0
    assert row["max_abs_diff"] == 0.0 and row["matches_1_device"] is True
    assert row["inference_examples_per_s"] > 0 and row["train_examples_per_s"] > 0
    text = capsys.readouterr().out
    assert "throughput against device count (global batch 4096, mlp(8, 2) on 16" in text
    assert f"note: {d['note']}" in text
    assert scaling.format_devices(d) in text
    assert f"wrote {tmp_path / 'd.png'}, {tmp_path / 'd.svg'}" in text  # the figure, both formats
    assert "examples per second (log scale)" in svg_text(tmp_path / "d.svg")


def test_cli_bench_user_errors_exit_2(capsys):
    assert lab_main(["--sizes", "4,x"]) == 2
    assert lab_main(["--devices", "0"]) == 2
    assert "--devices must be an int >= 1; got '0'" in capsys.readouterr().err
    assert lab_main(["--calls", "0", "--quiet"]) == 2
    assert "--calls must be an int >= 1; got '0'" in capsys.readouterr().err


def test_script_is_thin_and_runs_on_two_devices(tmp_path):
    needs_matplotlib()
    script = SCRIPTS / "bench.py"
    argv = ["--calls", "2", "--repeats", "1", "--eager-chunks", "1", "--sizes", "4,2"]
    argv += ["--in-features", "8", "--no-artifact", "--no-train", "--no-peak", "--devices", "2"]
    argv += ["--no-per-request", "--no-latency"]  # their own processes, tested above and below
    argv += ["--devices-out", str(tmp_path / "devices")]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2")  # 2 virtual devices
    proc = subprocess.run(
        [sys.executable, str(script), *argv, "--json", str(tmp_path / "b.json")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("With hybridization: ")
    assert "[bench" in proc.stderr  # the progress display
    d = json.loads((tmp_path / "b.json").read_text())["devices"]
    assert [r["devices"] for r in d["rows"]] == [1, 2] and d["note"] == devices.CPU_NOTE
    assert all(r["matches_1_device"] for r in d["rows"])
    table = lines[lines.index(next(t for t in lines if t.startswith("throughput against"))) :]
    assert "2 virtual CPU devices" in table[0]
    assert [t.split()[0] for t in table[2:4]] == ["1", "2"] and table[
        4
    ] == f"note: {devices.CPU_NOTE}"
    assert (tmp_path / "devices.png").is_file() and (tmp_path / "devices.svg").is_file()


# -- a newcomer's first hour: --quick, usage errors, figures, --diff, digits, --help ----------
@pytest.mark.slow  # a benchmark run (~5-6 s): CI runs it with `-m slow`
def test_quick_run_is_a_first_look_and_says_so(tmp_path, capsys):
    out = tmp_path / "quick.json"
    argv = ["--quick", "--sizes", "8,2", "--in-features", "16", "--quiet"]
    assert lab_main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith("Without hybridization: ") and lines[2] == ""
    assert lines[3].startswith("QUICK RUN (--quick): 50 calls, 5 repeats; skipped IREE, ")
    assert "run without --quick" in lines[3]
    d = json.loads(out.read_text())
    c = d["config"]
    assert (c["quick"], c["calls"], c["repeats"], c["eager_chunks"], c["stage_repeats"]) == (
        True,
        50,
        5,
        5,
        2,
    )
    assert (c["iree"], c["train_step"], c["peak"]) == (False, False, False)  # the slow sections
    keys = {r["key"] for r in d["rows"]}
    assert "artifact_jax" in keys and "artifact_iree" not in keys
    assert "train_step" not in d and "peak" not in d
    assert not any("skipped" in n for n in d["notes"])  # not tried, so nothing failed
    per = d["per_request"]  # on by default, in quick runs too
    assert per["config"]["calls"] == 50 and not per["config"]["rivals"]
    assert "Per request, against floors measured in the same run" in text


def test_quick_settings_yield_to_the_callers():
    r = tiny_benchmark(quick=True, calls=4, repeats=None, peak=True, peak_size=32, artifact=False)
    assert (r.config["calls"], r.config["repeats"], r.config["quick"]) == (4, 5, True)
    assert "peak" in r.extra  # asked for, so measured
    banner = reports.format_report(r).splitlines()[3]
    assert "skipped IREE, the training step (ask with --iree, --train)." in banner
    assert "peak" not in banner


def test_degenerate_sweep_is_a_usage_error_before_any_work(capsys):
    for argv, says in (
        (["--sweep-max", "1"], "--sweep-min 1 --sweep-max 1 gives 1 batch size(s) [1]"),
        (["--sweep-min", "64", "--sweep-max", "100"], "gives 1 batch size(s) [64]"),
        (["--sweep-min", "100", "--sweep-max", "10"], "gives 0 batch size(s) []"),
    ):
        assert lab_main(["--sweep", *argv, "--quiet"]) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == ""  # refused before the benchmark ran
        (line,) = captured.err.splitlines()  # one line
        assert line.startswith("bench: error: ") and says in line
        assert "a sweep needs at least 2 powers of two in the range" in line
    for bad in ("0", "-4", "x"):
        assert lab_main(["--sweep", "--sweep-max", bad]) == 2
        assert f"--sweep-max must be an int >= 1; got '{bad}'" in capsys.readouterr().err


def devices_result(virtual):
    rows = [
        {"devices": k, "inference_examples_per_s": 1e5 * k**0.5, "train_examples_per_s": 4e4 * k}
        | {"matches_1_device": True}
        for k in (1, 2, 4)
    ]
    note = devices.CPU_NOTE if virtual else "real devices: rows show data-parallel scaling"
    return {"backend": "cpu" if virtual else "gpu", "device_kind": "cpu", "n_devices": 4}, {
        "virtual_cpu_devices": virtual,
        "note": note,
        "batch": 64,
        "sizes": [8, 2],
        "in_features": 16,
        "repeats": 3,
        "train_steps": 2,
        "rows": rows,
    }


def test_devices_figure_says_virtual_devices_show_correctness(tmp_path):
    needs_matplotlib()
    env = timing.environment()
    head, body = devices_result(virtual=True)
    png, svg = figures.plot_devices(head | body, tmp_path / "devices", env=env)
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = svg_text(svg)
    for shown in (
        "devices (log scale)",
        "examples per second (log scale)",
        "inference: ideal linear scaling",
        "every device count matches the 1-device result",
        "correctness,",  # on the axes: virtual CPU devices share the host's cores
        "Note: CPU virtual devices share this machine",  # and in the caption
        env["cpu_model"],
        f"jax {env['jax']}",
    ):
        assert shown in text, shown
    head, body = devices_result(virtual=False)
    (svg,) = figures.plot_devices(head | body, tmp_path / "real", env=env, formats=("svg",))
    assert "not scaling" not in svg_text(svg)


def test_training_figure_from_a_result_its_dict_or_its_history(tmp_path):
    needs_matplotlib()
    result = sm.training.train(sm.mlp((16, 10)), epochs=2)
    png, svg = figures.plot_training(result, tmp_path / "train.png")
    assert (Path(png).name, Path(svg).name) == ("train.png", "train.svg")
    text = svg_text(svg)
    for shown in (
        "epoch",
        "mean training loss per epoch",
        "accuracy after the epoch (%)",
        "train split",
        "test split",
        f"training: 2 epochs, final test accuracy {result.test_accuracy:.2%}",
        f"{result.step} steps, compiled step (jit)",
        timing.environment()["cpu_model"],
    ):
        assert shown in text, shown
    for i, source in enumerate((result.to_dict(), result.history, json.loads(json.dumps(
        result.to_dict()["history"]
    )))):  # fmt: skip
        (out,) = figures.plot_training(source, tmp_path / f"again{i}", formats=("svg",))
        assert "final test accuracy" in svg_text(out)
    with pytest.raises(sm.ConfigError, match="nothing to plot"):
        figures.plot_training([], tmp_path / "empty")


def run_json(path, rows, stages=(), **config):
    """A synthetic benchmark JSON: ``rows`` maps key -> (min, median, repeats) per input."""
    d = {
        "schema": 1,
        "rows": [
            {
                "key": key,
                "label": key,
                "per_1000_inputs_min_s": lo * 1000,
                "per_1000_inputs_median_s": med * 1000,
                "repeats": reps,
            }
            for key, (lo, med, reps) in rows.items()
        ],
        "stages": {
            k: {"min_s": lo, "median_s": med, "repeats": reps} for k, (lo, med, reps) in stages
        },
        "config": {"calls": 1000, "quick": False} | config,
        "env": {"cpu_model": "test CPU", "jax": "0.10.2"},
    }
    path.write_text(json.dumps(d))
    return str(path)


def test_diff_tells_a_regression_from_noise(tmp_path, capsys):
    old = run_json(
        tmp_path / "old.json",
        {
            "hybridized": (1.0e-6, 1.01e-6, 5),  # quiet row
            "floor": (1.0e-6, 1.30e-6, 5),  # noisy row: 30% spread
            "eager": (10e-6, 10.1e-6, 5),
            "artifact_jax": (1.0e-6, 1.05e-6, 5),  # 5% spread
            "vmap": (1e-7, 1e-7, 5),
        },
        stages=[("compile", (0.2, 0.2, 1))],
    )
    new = run_json(
        tmp_path / "new.json",
        {
            "hybridized": (1.2e-6, 1.21e-6, 5),  # 20% slower, beyond a 2% band: a regression
            "floor": (1.2e-6, 1.25e-6, 5),  # 20% slower, within its 30% band: noise
            "eager": (5e-6, 5.05e-6, 5),  # 2x faster
            "artifact_jax": (1.05e-6, 1.06e-6, 5),  # exactly at its 5% band: noise
            "batch": (1e-7, 1e-7, 5),
        },
        stages=[("compile", (0.3, 0.3, 1))],  # one repeat: no noise estimate
        calls=50,
        quick=True,
    )
    out = tmp_path / "diff.json"
    assert lab_main(["--diff", old, new, "--json", str(out)]) == 0
    text, wrote = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    assert wrote == f"wrote {out}"
    assert "Without hybridization" not in text  # compares, does not benchmark
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line[:1].isalpha()}
    assert rows["hybridized"][-3:] == ["1.200", "±2.0%", "SLOWER"]
    assert rows["floor"][-3:] == ["1.200", "±30.0%", "noise"]
    assert rows["eager"][-3:] == ["0.500", "±2.0%", "faster"]
    assert rows["artifact_jax"][-3:] == ["1.050", "±5.0%", "noise"]
    assert "stage: compile" in text and "? 1 repeat" in text
    assert "only in the old run: row vmap" in text and "only in the new run: row batch" in text
    assert "the runs differ in settings (calls 1000 -> 50; quick False -> True)" in text
    assert text.rstrip().endswith(
        "1 slower beyond the noise (hybridized), 1 faster, 2 within the noise, "
        "1 without a noise estimate (1 repeat)."
    )
    d = json.loads(out.read_text())
    verdicts = {c["key"]: c["verdict"] for c in d["changes"]}
    assert verdicts == {
        "hybridized": "slower",
        "floor": "noise",
        "eager": "faster",
        "artifact_jax": "noise",
        "compile": "unknown",
    }
    c = compare.compare_runs(old, new)
    assert [ch.key for ch in c.regressions] == ["hybridized"]
    assert c.changes[0].ratio == pytest.approx(1.2) and c.changes[0].noise == pytest.approx(0.02)
    assert compare.format_comparison(c) == text


def test_diff_refuses_what_it_cannot_read(tmp_path, capsys):
    good = run_json(tmp_path / "good.json", {"hybridized": (1e-6, 1e-6, 5)})
    future = tmp_path / "future.json"
    future.write_text(json.dumps({"schema": 2, "rows": []}))
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    edited = json.loads(Path(good).read_text())
    edited["rows"][0]["per_1000_inputs_min_s"] = None  # JSON that parses, not a run's rows
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    (tmp_path / "rows.json").write_text(json.dumps({"schema": 1, "rows": "x"}))
    for bad, says in (
        (future, "schema 2; this symjax_mlp reads schema 1"),
        (tmp_path / "missing.json", "no such file"),
        (tmp_path / "broken.json", "not a readable JSON file"),
        (tmp_path / "other.json", "not a benchmark run"),
        (tmp_path / "edited.json", "a row, stage or sweep point is not what"),
        (tmp_path / "rows.json", "a row, stage or sweep point is not what"),
    ):
        assert lab_main(["--diff", good, str(bad)]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("bench: error: ") and says in line, line
    legacy = json.loads(Path(good).read_text())
    del legacy["schema"]  # a file from before the schema reads, with a note
    c = compare.compare_runs(good, legacy)
    assert c.changes[0].verdict == "noise" and "has no schema field" in c.notes[0]


def test_a_run_compared_with_itself_is_noise(report):
    c = compare.compare_runs(report.to_dict(), json.loads(json.dumps(report.to_dict())))
    assert {ch.section for ch in c.changes} == {"row", "stage"}
    assert {ch.key for ch in c.changes if ch.section == "row"} == {r.key for r in report.rows}
    assert all(ch.ratio == 1.0 for ch in c.changes)
    assert {ch.verdict for ch in c.changes} <= {"noise", "unknown"} and not c.regressions


TARGET_LINE = re.compile(r"^  (\w+) +(\d+\.\d{3})  \(target (>=|<=) ([\d.]+)\) (met|MISSED)$")


def target_lines(report):
    lines = reports.format_report(report).splitlines()
    start = lines.index("targets (measured in this run):") + 1
    return [TARGET_LINE.match(line) for line in lines[start : start + len(report.targets)]]


def test_target_lines_never_contradict_their_digits(report):
    for m in target_lines(report):
        assert m, "a target line with 3 decimals"
        value, op, bound = float(m[2]), m[3], float(m[4])
        assert (m[5] == "met") == (value >= bound if op == ">=" else value <= bound)
        assert report.targets[m[1]]["met"] == (m[5] == "met")
    for value, shown, mark in ((1.1504, "1.150", "met"), (1.1506, "1.151", "MISSED")):
        t = {"value": value, "target": "<= 1.15", "met": value <= 1.15, "what": ""}
        (m,) = target_lines(dataclasses.replace(report, targets={"hybridized_over_floor": t}))
        assert (m[2], m[5]) == (shown, mark)


def test_every_bench_option_shows_its_default(capsys):
    assert lab_main(["--help"]) == 0
    text = capsys.readouterr().out
    entries: list[str] = []
    for line in text[text.index("options:") :].splitlines()[1:]:
        if line.startswith("  -"):
            entries.append(line)
        elif line.startswith("   ") and entries:
            entries[-1] += " " + line.strip()
    entries = [" ".join(e.split()) for e in entries if not e.startswith("  -h, --help")]
    assert len(entries) >= 20
    for entry in entries:
        assert "(default: " in entry, entry
    by_option = {e.split()[0].rstrip(","): e for e in entries}
    assert "(default: 1000; --quick: 50)" in by_option["--calls"]
    assert "(default: on; --quick: off)" in by_option["--iree"]
    assert "--compare" in by_option["--diff"] and "--diff" in by_option["--compare"]


@pytest.mark.torch
def test_the_serving_latency_twins_compute_the_jax_model():
    needs_torch()
    from benchmarks import latency as _latency

    net = {"sizes": (16, 2), "in_features": 8, "activation": "relu", "seed": 3}
    _, jax_forms = _latency._jax_latency(dispatch="async", constants=True, **net)
    want = jax_forms["numpy"]()
    for mode in ("torch_eager", "torch_script", "torch_freeze"):
        meta, forms = _latency._torch_latency(mode=mode, threads=1, **net)
        assert meta()["mode"] == mode
        np.testing.assert_allclose(forms["numpy"](), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(forms["device"]().numpy(), want, rtol=1e-5, atol=1e-6)


# -- moved from the library's tests with the laboratory: the training step, devices, state ----
def test_time_train_step_reports_both_rates():
    """On a tiny net (compiling the default one costs seconds); the defaults are pinned apart."""
    r = train_step.time_train_step(steps=3, eager_steps=2, sizes=(8, 2), in_features=16)
    assert set(r) == {
        "compiled_steps_per_s",
        "eager_steps_per_s",
        "speedup",
        "compile_seconds",
        "steps",
        "eager_steps",
        "batch_size",
        "in_features",
        "sizes",
        "backend",
        "device",
    }
    assert r["compiled_steps_per_s"] > 0 and r["eager_steps_per_s"] > 0
    assert r["speedup"] == pytest.approx(r["compiled_steps_per_s"] / r["eager_steps_per_s"])
    assert (r["steps"], r["eager_steps"], r["sizes"], r["in_features"]) == (3, 2, [8, 2], 16)
    defaults = inspect.signature(train_step.time_train_step).parameters
    assert defaults["sizes"].default == (128, 64, 10) and defaults["batch_size"].default == 64


@pytest.mark.slow  # a benchmark section (~5-6 s): CI runs it with `-m slow`
def test_bench_devices_reports_rows_and_says_cpu_is_correctness_only():
    small = {"sizes": (16, 4), "in_features": 12, "batch": 64, "repeats": 2, "train_steps": 2}
    note = devices.CPU_NOTE
    assert "correctness" in note and "not how it scales" in note
    here = devices.bench_devices(2, **small)  # 2 of the 8 visible: runs in this process
    assert not here["in_subprocess"] and [r["devices"] for r in here["rows"]] == [1, 2]
    more = devices.bench_devices(16, **small)  # more than visible: 16 CPU devices, a subprocess
    assert more["in_subprocess"] and [r["devices"] for r in more["rows"]] == [1, 2, 4, 8, 16]
    for res in (here, more):
        assert res["virtual_cpu_devices"] and res["note"] == note
    for row in here["rows"] + more["rows"]:
        assert row["matches_1_device"], row
        assert row["inference_examples_per_s"] > 0 and row["train_examples_per_s"] > 0


def test_stateful_rows_carry_state_the_same_way():
    rows = stateful.bench_stateful(calls=3, repeats=2, in_features=8)
    assert list(rows) == ["linen BatchNorm (train)", "nnx Dropout", "nnx Dropout (unsafe_rbg)"]
    assert list(rows["linen BatchNorm (train)"]) == ["hybrid", "h.apply", "by hand", "compiled"]
    assert sorted(rows["nnx Dropout"]) == ["by hand", "compiled", "h.apply", "hybrid", "nnx.jit"]
    for model in rows.values():
        assert all(t.calls == 3 and len(t.times) == 2 for t in model.values())
    lines = stateful.format_stateful(rows).splitlines()
    assert "vs h.apply" in lines[1] and len(lines) == 2 + sum(len(m) for m in rows.values())


# -- per request, against floors measured in the same run -------------------------------------
def test_per_request_rows_floors_and_targets():
    r = per_request.bench_per_request(sizes=(8, 2), in_features=16, calls=5, repeats=2)
    keys = ["dispatch_floor", "aot_constants", "aot_constants_init", "aot_arguments", "h",
            "h_constants", "artifact_jax"]  # fmt: skip
    assert list(r["rows"]) == keys and r["skipped"] == {} and r["notes"] == []
    assert r["dispatch"] == "sync"  # its own fresh process, in latency mode
    assert r["traces"] == {"h": 1, "h_constants": 1}  # compiled once each, never retraced
    for row in r["rows"].values():
        assert len(row["per_call_s"]) == 2 and 0 < row["min_s"] <= row["median_s"]
        assert row["spread"] == pytest.approx(row["median_s"] / row["min_s"] - 1)
    rows, f = r["rows"], r["floors"]
    assert f["dispatch_s"] == rows["dispatch_floor"]["min_s"]
    assert f["compute_s"] == pytest.approx(rows["aot_constants"]["min_s"] - f["dispatch_s"])
    assert f["left_s"] == pytest.approx(rows["h"]["min_s"] - rows["aot_constants"]["min_s"])
    names = [t["name"] for t in r["targets"]]
    assert names == [
        "h_over_aot_constants",
        "h_over_aot_arguments",
        "h_constants_over_aot_constants",
    ]
    t = r["targets"][0]
    assert t["value"] == round(rows["h"]["min_s"] / rows["aot_constants"]["min_s"], 3)
    assert t["target"] == "<= 1.15" and t["met"] == (t["value"] <= 1.15)
    text = per_request.format_per_request(r)
    assert text.startswith("Per request, against floors measured in the same run")
    assert "JAX sync dispatch" in text and "dispatch floor " in text
    assert "(target <= 1.05)" in text
    json.dumps(r)


@pytest.mark.slow  # three compiles (init, the Adam step, h): ~0.6 s
def test_the_benchmarks_net_has_a_trained_models_params_not_its_init():
    """At init every bias is zero, which XLA folds out of the params-as-constants floor (no
    add) and never out of h(x)'s program: the benchmarks time the params as a trained model
    has them (one Adam step), the init ones only in the per-request table's 'at init' row."""
    from benchmarks.calls import chapter_init, chapter_net

    h, variables, x = chapter_net((8, 2), 16, "relu", 0)
    _, init, x0 = chapter_init((8, 2), 16, "relu", 0)
    np.testing.assert_array_equal(x, x0)
    assert h.params is variables
    for layer, at_init in init["params"].items():
        assert not np.any(np.asarray(at_init["bias"]))  # zeros at init
        trained = variables["params"][layer]
        assert np.all(np.asarray(trained["bias"]) != 0)  # every one moved off zero
        assert np.all(np.asarray(trained["kernel"]) != np.asarray(at_init["kernel"]))


def test_per_request_targets_name_pytorchs_fastest_and_the_others():
    def row(label, lo, med):
        return {"label": label, "min_s": lo, "median_s": med, "spread": med / lo - 1}

    rows = {
        "dispatch_floor": row("x + 1", 5e-6, 5e-6),
        "aot_constants": row("AOT", 10e-6, 10.5e-6),
        "aot_arguments": row("AOT, params as arguments", 11.6e-6, 11.7e-6),
        "h": row("h(x)", 12e-6, 12.2e-6),
        "h_constants": row("h(x), constants", 10.4e-6, 10.4e-6),
        "torch_freeze": row("torch.jit.freeze", 20e-6, 22e-6),
        "torch_eager": row("PyTorch eager", 30e-6, 30e-6),
        "onnxruntime": row("ONNX Runtime", 9e-6, 9e-6),
    }
    targets = {t["name"]: t for t in per_request.per_request_targets(rows)}
    assert targets["h_over_aot_constants"]["value"] == 1.2
    assert targets["h_over_aot_constants"]["met"] is False
    assert targets["h_over_aot_arguments"]["met"] is True  # 1.034: the same calling convention
    assert targets["h_constants_over_aot_constants"]["met"] is True  # 1.04
    fastest = targets["fastest_torch_over_h"]
    assert fastest["value"] == round(20 / 10.4, 3) and fastest["met"] is True
    assert fastest["band"] == pytest.approx(0.1)  # torch_freeze's spread, the larger
    assert fastest["what"].startswith("torch.jit.freeze (PyTorch's fastest) / h(x), constants")
    other = targets["fastest_other_over_h"]
    assert other["target"] == "reported" and other["met"] is None


def test_interleaved_rows_can_pause_between_repeats(monkeypatch):
    slept = []
    monkeypatch.setattr(timing.time, "sleep", slept.append)
    timing.time_interleaved({"a": lambda: 1, "b": lambda: 2}, calls=1, repeats=3, pause=0.01)
    assert slept == [0.01] * 6


@pytest.mark.slow
def test_the_http_rows_answer_every_request_and_say_where_a_lone_requests_time_goes():
    """``--serving``'s HTTP section, tiny: serve, both bare endpoints and serve's ceiling (the
    bare one answering the model's outputs) answer every request, the ratios are computed in
    the run, and the lone-request probe reports serve's own Server-Timing stages beside the
    artifact's call hot, after an idle CPU and after a spin."""
    from benchmarks.http_rows import http_rows
    from benchmarks.serving import format_serving

    env = {"PYTHONPATH": os.pathsep.join([str(SCRIPTS), *sys.path])}
    h = http_rows(
        sizes=(8, 2), in_features=16, activation="relu", seed=0, clients=[1], requests=20,
        max_batch=4, env=env, timeout=300, say=lambda _: None, rounds=1,
    )  # fmt: skip
    assert {r["body"] for r in h["rows"]} == {"json", "npy"} and h["server_exit_code"] == 0
    for r in [*h["rows"], *h["bare"], *h["bare_stdlib"], *h["ceiling"]]:
        assert r["errors"] == 0 and r["n"] == 20 and r["throughput_rps"] > 0, r
    json_row = next(r for r in h["rows"] if r["body"] == "json")
    assert json_row["vs_bare"] == json_row["throughput_rps"] / h["bare"][0]["throughput_rps"]
    assert json_row["vs_ceiling"] == json_row["throughput_rps"] / h["ceiling"][0]["throughput_rps"]
    lone = h["lone"]
    assert "idle_probe_error" not in lone, lone
    for key in ("served_queued_s", "served_compute_s", "call_hot_s", "call_after_sleep_s",
                "call_after_spin_s"):  # fmt: skip
        assert 0 < lone[key] < 1, (key, lone)
    shown = format_serving({"http": h})
    assert "a lone client's request: the model's call" in shown
    assert "serve's ceiling" in shown and "against its ceiling" in shown


@pytest.mark.ray
@pytest.mark.xdist_group("ray")
def test_the_ray_rows_reach_both_apps_by_handle_and_through_rays_http_proxy():
    """``--ray``'s section, tiny, in its own process (its own local cluster): every row is
    there, every HTTP request through Ray's proxy was answered 200 by our app and by the bare
    endpoint in a replica, and each target names its bar."""
    pytest.importorskip("ray.serve", reason="needs the ray extra: pip install 'symjax_mlp[ray]'")
    code = (
        "import json; from benchmarks.ray_rows import bench_ray, format_ray; "
        "r = bench_ray(sizes=(16, 2), in_features=8, lone_calls=5, rounds=1, http_requests=16, "
        "inflight=4, seconds=0.3); print(format_ray(r)); print(json.dumps(r))"
    )
    env = dict(os.environ, PYTHONPATH=str(SCRIPTS))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    *text, last = proc.stdout.strip().splitlines()
    r = json.loads(last)
    assert r["lone"]["ours"]["p50_s"] > 0 and r["lone"]["noop"]["p50_s"] > 0
    assert r["lone"]["noop_one_loop"]["p50_s"] > 0 and "over the no-op on one loop" in proc.stdout
    for c in ("1", "16"):
        for app in ("ours", "bare"):
            row = r["http"][c][app]
            assert row["errors"] == 0 and row["requests_per_s"] > 0, (c, app, row)
    assert {r["inflight_1"]["replicas"], r["inflight_2"]["replicas"]} == {1, 2}
    bars = {t["what"]: t["target"] for t in r["targets"]}
    assert bars["Ray HTTP, 1 client(s): ours over the bare endpoint (req/s)"] == ">= 0.85"
    assert bars["Ray HTTP, 16 client(s): ours over the bare endpoint (req/s)"] == ">= 0.9"
    assert len(bars) == 4
    shown = "\n".join(text)
    assert "HTTP through Ray's proxy" in shown and "16 client(s), bare endpoint" in shown


def test_the_futures_client_keeps_going_when_requests_are_answered_as_submitted():
    """A Batcher whose lane is idle answers a lone request in its caller, so the future is done
    before its callback is added: the client recursed through callbacks to Python's limit and
    hung ``--serving`` (its child waited for ever)."""
    import concurrent.futures

    from benchmarks.batcher import _futures
    from helpers import bounded

    class Inline:  # every request answered as it is submitted
        def submit(self, x):
            f = concurrent.futures.Future()
            f.set_result(x)
            return f

    lat, wall = bounded(lambda: _futures(Inline(), [np.zeros(1)], c=1, requests=5000), 60)
    assert len(lat) == 5000 and wall > 0
