"""The benchmark library: fields, structure, JSON and the CLI; never speeds.

Every run here uses tiny call counts and a tiny net so the file stays well under a minute.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import matplotlib.image
import pytest
import torch

from symjax_mlp import bench
from symjax_mlp.cli import main as cli_main

TINY = {"sizes": (8, 2), "in_features": 16}


def tiny_benchmark(**kw):
    """The benchmark on a tiny net with the fewest calls; ``kw`` overrides."""
    fewest = {"calls": 2, "repeats": 1, "eager_chunks": 1, "stage_repeats": 1}
    return bench.benchmark(**(fewest | {"peak": False, "train_step": False} | TINY | kw))


def test_public_names_are_pinned():
    assert bench.__all__ == [
        "CPU_NOTE",
        "BenchReport",
        "Row",
        "SweepPoint",
        "SweepReport",
        "Timing",
        "bench_devices",
        "benchmark",
        "environment",
        "format_devices",
        "format_report",
        "format_sweep",
        "measure_peak",
        "plot_sweep",
        "sweep",
        "time_calls",
        "time_interleaved",
        "time_stages",
        "time_train_step",
    ]
    assert isinstance(bench.CPU_NOTE, str) and bench.CPU_NOTE
    assert all(callable(getattr(bench, name)) for name in bench.__all__ if name != "CPU_NOTE")
    for cli_only in ("add_arguments", "main"):  # the command line lives in symjax_mlp.cli
        assert not hasattr(bench, cli_only)


def test_timing_fields_and_stats():
    t = bench.time_calls(lambda: jnp.ones(3) + 1, name="add", calls=4, repeats=5, warmup=2)
    assert (t.name, t.calls, t.inputs_per_call, len(t.times)) == ("add", 4, 1, 5)
    assert all(s > 0 for s in t.times)
    assert t.min <= t.median <= max(t.times)
    assert t.per_call_min == pytest.approx(t.min / 4)
    lo, med = t.per_inputs(1000)
    assert lo == pytest.approx(t.min * 250) and med == pytest.approx(t.median * 250)
    d = t.to_dict()
    assert set(d) >= {"calls", "repeats", "times_s", "min_s", "median_s", "per_call_min_s"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.calls = 1


def test_every_timed_call_is_synced():
    synced = []

    class Out:
        def block_until_ready(self):
            synced.append(1)
            return self

    bench.time_calls(Out, calls=3, repeats=5, warmup=2)
    assert len(synced) == 2 + 3 * 5  # warm-up calls and every timed call


def test_interleaved_order_and_inputs_per_call():
    order = []
    fns = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    t = bench.time_interleaved(fns, calls=1, repeats=3, warmup=1, inputs_per_call={"b": 10})
    assert order == ["a", "b"] + ["a", "b"] * 3  # warm-ups, then repeat r of each in turn
    assert list(t) == ["a", "b"] and t["b"].inputs_per_call == 10


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="calls and repeats must be >= 1"):
        bench.time_calls(lambda: 0, calls=0)


def test_stages_are_timed_separately():
    s = bench.time_stages(lambda x: x * 2 + 1, jnp.ones(3), repeats=2)
    assert list(s) == ["trace", "lower", "compile"]
    assert all(len(t.times) == 2 and t.min > 0 for t in s.values())


def test_environment_says_where_it_ran():
    env = bench.environment()
    for key in ("jax", "jaxlib", "flax", "python", "backend", "device", "device_kind"):
        assert isinstance(env[key], str) and env[key]
    assert env["cpu_count"] >= 1 and env["cpu_usable"] >= 1


@pytest.fixture(scope="module")
def report():
    """One run with every row that needs no extra framework: the artifact in JAX and IREE."""
    return tiny_benchmark(calls=4, repeats=2, eager_chunks=2, peak=True, peak_size=32)


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
        "vmap_vs_single_calls",
    }
    for t in report.targets.values():
        assert set(t) == {"value", "target", "met", "what"} and isinstance(t["met"], bool)


def test_report_text_starts_with_the_chapter_lines(report):
    lines = bench.format_report(report).splitlines()
    assert lines[0].startswith("Without hybridization: ") and lines[0].endswith(" sec")
    assert lines[1].startswith("With hybridization: ") and lines[1].endswith(" sec")
    text = "\n".join(lines)
    assert "hybridized (h)" in text and "AOT floor" in text and "ran on: " in text
    assert "what it means: " in text and "matmul rate" in text


def test_report_json_round_trips(report):
    d = json.loads(json.dumps(report.to_dict()))
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
    assert "note: " + note in bench.format_report(r)


def test_bad_compare_is_a_user_error():
    with pytest.raises(
        ValueError,
        match=r"benchmark\(compare=\('tensorflow',\)\): the frameworks to compare with are "
        r"\('torch',\); drop the others",
    ):
        bench.benchmark(compare=("tensorflow",))


def test_torch_rows_share_the_table():
    r = tiny_benchmark(artifact=False, compare=("torch",))
    keys = {row.key for row in r.rows}
    assert {"torch_eager", "torch_script", "torch_compile"} <= keys
    assert "torch_fastest_over_hybridized" in r.targets
    assert {"torch_script", "torch_compile"} <= set(r.stages)  # their compile times
    assert not any("differs" in n for n in r.notes)  # same weights, same outputs
    assert any(n.startswith(f"torch: {torch.__version__}, ") for n in r.notes)


def test_sweep_points_peak_and_plot(tmp_path):
    s = bench.sweep(
        batch_sizes=(1, 4), eager_max_batch=1, repeats=1, min_seconds=0, peak_size=32, **TINY
    )
    assert [(p.mode, p.batch) for p in s.points] == [
        ("hybridized", 1),
        ("eager", 1),
        ("hybridized", 4),
    ]
    assert s.peak_gflops > 0 and s.peak_size == 32
    p = s.points[-1]
    assert p.flops_per_call == 4 * s.points[0].flops_per_call > 0
    assert p.samples_per_s > 0 and p.gflops > 0
    d = json.loads(json.dumps(s.to_dict()))
    assert {"mode", "batch", "samples_per_s", "gflops", "fraction_of_peak"} <= set(d["points"][0])
    assert "matmul peak" in bench.format_sweep(s)
    png = Path(bench.plot_sweep(s, tmp_path / "sweep.png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(png).shape[:2] == (462, 1210)  # 11 x 4.2 in at 110 dpi


# The CLI runs the real benchmark, with the fewest calls: its options reach the run.
FEWEST_ARGV = ["--repeats", "1", "--eager-chunks", "1", "--stage-repeats", "1", "--no-peak"]


def test_cli_bench_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--calls", "4", "--sizes", "8,2", "--in-features", "16", *FEWEST_ARGV]
    argv += ["--no-train", "--compare", "torch", "--no-iree"]
    assert cli_main([*argv, "--quiet", "--json", str(out)]) == 0
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


def test_cli_bench_devices_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--calls", "2", "--sizes", "8,2", "--in-features", "16", *FEWEST_ARGV]
    argv += ["--no-artifact", "--no-train", "--devices", "1"]
    assert cli_main([*argv, "--quiet", "--json", str(out)]) == 0  # one device: in-process
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
    assert bench.format_devices(d) in text


def test_cli_bench_user_errors_exit_2(capsys):
    assert cli_main(["bench", "--sizes", "4,x"]) == 2
    assert cli_main(["bench", "--devices", "0"]) == 2
    assert "--devices must be an int >= 1; got '0'" in capsys.readouterr().err
    assert cli_main(["bench", "--calls", "0", "--quiet"]) == 2
    assert "must all be >= 1" in capsys.readouterr().err


def test_script_is_thin_and_runs_on_two_devices(tmp_path):
    script = Path(__file__).parent.parent / "scripts" / "bench.py"
    argv = ["--calls", "2", "--repeats", "1", "--eager-chunks", "1", "--sizes", "4,2"]
    argv += ["--in-features", "8", "--no-artifact", "--no-train", "--no-peak", "--devices", "2"]
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
    assert [r["devices"] for r in d["rows"]] == [1, 2] and d["note"] == bench.CPU_NOTE
    assert all(r["matches_1_device"] for r in d["rows"])
    table = lines[lines.index(next(t for t in lines if t.startswith("throughput against"))) :]
    assert "2 virtual CPU devices" in table[0]
    assert [t.split()[0] for t in table[2:4]] == ["1", "2"] and table[
        4
    ] == f"note: {bench.CPU_NOTE}"
