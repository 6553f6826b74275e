"""``sm.timeit`` and ``symjax-mlp bench DIR``: a model timed against its AOT-compiled floor.

Fields, structure and messages; never speeds (the laboratory, ``scripts/bench.py``, reads
those).
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import symjax_mlp as sm
from symjax_mlp.cli import main

ROWS = ("synced", "pipelined", "compiled_synced", "compiled_pipelined")


@pytest.fixture(scope="module")
def hybrid():
    net = sm.mlp((8, 2))
    x = jnp.ones((1, 4), jnp.float32)
    return sm.hybridize(net, net.init(jax.random.key(0), x), name="tiny"), x


def check_fields(t, calls, repeats):
    assert t.calls == calls and t.dispatch in ("async", "sync")
    for row in ROWS:
        times = getattr(t, row)
        assert len(times) == repeats and all(s > 0 for s in times)
        assert t.min(row) == min(times) <= t.median(row) <= max(times)
    for mode in ("synced", "pipelined"):
        assert t.over_compiled(mode) == pytest.approx(t.min(mode) / t.min(f"compiled_{mode}"))


def test_a_hybrid_against_its_floor(hybrid):
    h, x = hybrid
    t = sm.timeit(h, x, calls=5, repeats=3, warmup=2)
    check_fields(t, 5, 3)
    assert t.name == "tiny" and t.dispatch == sm.serving.dispatch_mode()
    assert h.trace_count == 1  # compiled once, never retraced while timed
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.calls = 1
    d = json.loads(json.dumps(t.to_dict()))
    assert (d["name"], d["calls"], d["repeats"]) == ("tiny", 5, 3)
    assert d["synced"]["times_s"] == list(t.synced) and d["synced"]["min_s"] == t.min()
    assert set(d["over_compiled"]) == {"synced", "pipelined"}
    assert not any("target" in k for k in d)  # thresholds are the benchmark's business
    lines = str(t).splitlines()
    assert lines[0] == "tiny: 5 calls x 3 repeats, per call, JAX async dispatch"
    assert [line.split(",")[0] for line in lines[2:6]] == ["model", "compiled"] * 2
    assert f"{t.over_compiled():.3f}x" in lines[2]


def test_the_floor_computes_what_the_model_computes(hybrid, monkeypatch):
    """What is timed as the floor is the same function on the same params (with params as
    constants, too): its output equals the model's."""
    import symjax_mlp._timeit as timeit_module

    h, x = hybrid
    seen = []
    real = timeit_module._loop

    def loop(fn, calls, pipelined):
        seen.append(np.asarray(fn()))
        return real(fn, calls, pipelined)

    monkeypatch.setattr(timeit_module, "_loop", loop)
    for model in (h, h.replace(params_as_constants=True)):
        seen.clear()
        sm.timeit(model, x, calls=1, repeats=1, warmup=1)
        assert len(seen) == 2 + 4
        for out in seen:
            np.testing.assert_allclose(out, np.asarray(h(x)), rtol=1e-6)


def test_a_loaded_artifact_with_inputs_drawn_for_its_signature(hybrid, tmp_path):
    h, x = hybrid
    sm.export(h, tmp_path / "m", example=x, batch="b")
    m = sm.load(tmp_path / "m")
    t = sm.timeit(m, calls=3, repeats=2, warmup=1, batch=4)
    check_fields(t, 3, 2)
    assert t.name == str(m.path)
    check_fields(sm.timeit(m, np.ones((2, 4), np.float32), calls=2, repeats=1, warmup=1), 2, 1)
    with pytest.raises(sm.SignatureError):
        sm.timeit(m, np.ones((2, 5), np.float32), calls=2, repeats=1)


def test_what_it_cannot_time_is_refused_with_the_fix(hybrid):
    h, x = hybrid
    for kw, says in (
        ({"calls": 0}, "calls, repeats, warmup and batch must be >= 1; got calls=0"),
        ({"repeats": 0}, "repeats=0"),
        ({"calls": True}, r"got calls=True, .*each is an int"),  # timed one call
        ({"calls": 2.5}, r"got calls=2\.5, .*each is an int"),  # a TypeError from range()
        ({"warmup": "3"}, r"warmup='3'"),
    ):
        with pytest.raises(sm.ConfigError, match=says):
            sm.timeit(h, x, **kw)
    with pytest.raises(sm.ConfigError, match=r"pass the inputs to time it on: timeit\(h, x\)"):
        sm.timeit(h)
    with pytest.raises(sm.ConfigError, match=r"it times a Hybrid .* or a LoadedModel"):
        sm.timeit(lambda x: x, x)
    with pytest.raises(sm.ConfigError, match="runs sharded over a mesh"):
        sm.timeit(h.shard(sm.data_mesh(2)), jnp.ones((2, 4)))
    t = sm.timeit(h, x, calls=1, repeats=1, warmup=1)
    with pytest.raises(sm.ConfigError, match="the rows are synced, pipelined"):
        t.min("fastest")
    with pytest.raises(
        sm.ConfigError,
        match=r"over_compiled\(.compiled_synced.\): the rows are synced, pipelined\.$",
    ):
        t.over_compiled("compiled_synced")


def test_cli_bench_times_an_artifact(hybrid, tmp_path, capsys):
    h, x = hybrid
    art = sm.export(h, tmp_path / "m", example=x, batch="b").path
    argv = ["bench", str(art), "--calls", "3", "--repeats", "2"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{art}: 3 calls x 2 repeats, per call, JAX async dispatch"
    assert "compiled: the same function" in lines[-1]
    assert main([*argv, "--batch", "8", "--json", str(tmp_path / "t.json")]) == 0
    d = json.loads((tmp_path / "t.json").read_text())
    assert (d["calls"], d["repeats"], d["dispatch"]) == (3, 2, "async")
    assert all(len(d[row]["times_s"]) == 2 for row in ROWS)
    assert main(["bench", str(tmp_path / "nope")]) == 2
    assert "symjax-mlp bench: error: " in capsys.readouterr().err
    assert main(["bench", str(art), "--calls", "0"]) == 2
    assert "--calls: must be an int >= 1" in capsys.readouterr().err


def test_cli_bench_in_latency_mode_runs_in_its_own_process(hybrid, tmp_path):
    import subprocess
    import sys

    h, x = hybrid
    art = sm.export(h, tmp_path / "m", example=x, batch="b").path
    cmd = [sys.executable, "-m", "symjax_mlp", "bench", str(art), "--calls", "2"]
    out = subprocess.run(
        [*cmd, "--repeats", "1", "--dispatch", "sync", "--json", "-"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert json.loads(out)["dispatch"] == "sync"
