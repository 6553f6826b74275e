"""``sm.timeit`` and ``symjax-mlp bench DIR``: a model timed against its AOT-compiled floor.

Fields, structure and messages; never speeds (the laboratory, ``scripts/bench.py``, reads
those).
"""

import dataclasses
import json
import re

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


def test_a_hybrid_against_its_floor(hybrid, monkeypatch):
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
    monkeypatch.setattr(sm.serving, "dispatch_mode", lambda: "sync")  # as in latency mode
    assert sm.timeit(h, x, calls=1, repeats=1).dispatch == "sync"  # read as it times


@pytest.fixture
def seen(monkeypatch):
    """The output of every function timeit times (the model's and the floor's), in order, as
    NumPy arrays (a stateful floor's: ``(out, new_state)``)."""
    import symjax_mlp._timeit as timeit_module

    outputs, real = [], timeit_module._loop

    def loop(fn, calls, pipelined):
        outputs.append(jax.tree.map(np.asarray, fn()))
        return real(fn, calls, pipelined)

    monkeypatch.setattr(timeit_module, "_loop", loop)
    return outputs


def test_the_floor_computes_what_the_model_computes(hybrid, seen):
    """What is timed as the floor is the same function on the same params (with params as
    constants, too): its output equals the model's."""
    h, x = hybrid
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


def test_inputs_a_hybrid_refuses_are_refused_before_any_timing(hybrid):
    h, _ = hybrid  # was JAX's raw TypeError from device_put
    with pytest.raises(sm.SignatureError, match=r"timeit\(tiny\): input args\[0\] .*<U1.*astype"):
        sm.timeit(h, np.array([["a"]]), calls=1, repeats=1, warmup=1)


def test_another_librarys_array_is_named_with_its_conversion(hybrid):
    """h(torch_tensor) said 'an input (or a leaf of a tuple/dict input) is of type
    torch.Tensor', no path, and offered jnp.asarray(list(...)) for a generator."""

    class Tensor:  # as jit meets torch's: a shape and a dtype, no __jax_array__
        __module__, __qualname__, shape, dtype = "torch", "Tensor", (1, 4), np.dtype(np.float32)

    h, x = hybrid
    for call, args, at in (
        (h, (Tensor(),), r"tiny: args\[0\]"),
        (h, ((x, Tensor()),), r"tiny: args\[0\]\[1\]"),
        (lambda *a: sm.timeit(h, *a, calls=1, repeats=1, warmup=1), (Tensor(),), "timeit"),
    ):
        with pytest.raises(sm.ConfigError, match=rf"{at}.* is a torch\.Tensor, .*np\.asarray\("):
            call(*args)
    with pytest.raises(sm.ConfigError, match=r"jax\.dlpack\.from_dlpack\(args\[0\]\)"):
        h(Tensor())


def test_numpy_and_jax_integer_counts_are_their_ints(hybrid, tmp_path):
    """timeit(h, x, calls=np.int64(3)) was refused: 'must be >= 1; got calls=np.int64(3)';
    a NumPy bool is still refused."""
    h, x = hybrid
    t = sm.timeit(h, x, calls=np.int64(3), repeats=jnp.int32(2), warmup=np.uint8(1))
    assert (t.calls, len(t.synced)) == (3, 2) and type(t.calls) is int
    art = sm.export(h, tmp_path / "m", example=x, batch="b")
    assert sm.timeit(sm.load(art.path), calls=2, repeats=1, batch=np.int16(4)).calls == 2
    with pytest.raises(sm.ConfigError, match=r"got calls=np\.True_, .*each is an int"):
        sm.timeit(h, x, calls=np.bool_(True))


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


# a fresh process (~7 s in the suite): its parts run in the default run, cheaper: the CLI calls
# latency_mode for --dispatch sync (the test below), latency_mode in a fresh process makes
# dispatch sync (test_serving.py), and a timing reports dispatch_mode() (above)
@pytest.mark.slow
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


def test_cli_bench_in_latency_mode_where_jax_ran_already_is_one_line(hybrid, tmp_path, capsys):
    """main(["bench", ..., "--dispatch", "sync"]) in a process where JAX had run printed
    latency_mode's RuntimeError as a traceback, 'this is a bug in symjax_mlp'."""
    h, x = hybrid
    art = sm.export(h, tmp_path / "m", example=x, batch="b").path  # JAX has run here
    assert main(["bench", str(art), "--calls", "2", "--dispatch", "sync"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("symjax-mlp bench: error: --dispatch sync: latency_mode(): JAX's")
    assert "in a fresh process" in err and "Traceback" not in err and "bug" not in err


def test_inputs_are_drawn_for_every_dtype_an_artifact_takes(tmp_path, capsys):
    """Integers, bools, bfloat16 and a PRNG key: bench (which cannot pass inputs) times them,
    where it once refused every input that was not a NumPy number."""

    def f(params, i, b, h, key):
        noise = jax.random.normal(key, h.shape, jnp.float32)
        return jnp.where(b, i[:, None] * params["w"] + h.astype(jnp.float32) + noise, 0.0)

    model = sm.hybridize(f, {"w": jnp.ones((3,))}, name="mixed")
    example = (
        jnp.zeros((2,), jnp.int32),
        jnp.ones((2, 3), bool),
        jnp.ones((2, 3), jnp.bfloat16),
        jax.random.key(0),
    )
    shapes = ("b", "b, 3", "b, 3", None)
    art = sm.export(model, tmp_path / "m", example=example, shapes=shapes).path
    check_fields(sm.timeit(sm.load(art), batch=3, calls=2, repeats=1, warmup=1), 2, 1)
    assert main(["bench", str(art), "--calls", "2", "--repeats", "1", "--batch", "5"]) == 0
    assert capsys.readouterr().out.startswith(f"{art}: 2 calls x 1 repeats")


def test_a_batch_that_sizes_nothing_is_refused(hybrid, tmp_path, capsys):
    """batch=8 on an artifact of static shapes, or with the inputs passed, once timed other
    shapes than the batch asked for, without a word."""
    h, x = hybrid
    art = sm.export(h, tmp_path / "m", example=jnp.ones((3, 4)), batch=None).path
    m = sm.load(art)
    says = r"static shapes, \(args\[0\]: float32\[3, 4\]\), so batch sizes nothing .* Drop batch"
    with pytest.raises(sm.ConfigError, match=says):
        sm.timeit(m, batch=8, calls=1, repeats=1, warmup=1)
    check_fields(sm.timeit(m, calls=1, repeats=1, warmup=1), 1, 1)  # its own shapes
    assert main(["bench", str(art), "--batch", "8", "--calls", "1", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "batch=8): the artifact has static shapes" in err
    assert err.endswith("\nsymjax-mlp bench: on the command line, batch= is --batch\n"), err
    with pytest.raises(sm.ConfigError, match=r"timeit\(tiny, \*args, batch=4\): batch sizes"):
        sm.timeit(h, x, batch=4, calls=1, repeats=1, warmup=1)


def _batchnorm():
    """``(x, h)``: a Dense then a BatchNorm (``train=`` its mode), its statistics held."""
    import flax.linen as nn

    class BatchNorm(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            return nn.BatchNorm(use_running_average=not train, momentum=0.5)(nn.Dense(3)(x))

    x = jnp.arange(20.0).reshape(4, 5)
    net = BatchNorm()
    return x, sm.hybridize(net, net.init(jax.random.key(0), x), mutable=["batch_stats"])


def test_a_hybrids_keyword_arguments_and_its_state(tmp_path, seen):
    """kwargs= reach the model and its floor alike (timeit once had no way to pass them); a
    stateful model is timed on a copy, where timing once ran its BatchNorm statistics on."""
    x, h = _batchnorm()
    before = jax.tree.map(np.asarray, h.state)
    check_fields(sm.timeit(h, x, kwargs={"train": False}, calls=2, repeats=1, warmup=1), 2, 1)
    for out in seen:  # the floor's: (out, new_state)
        out = out[0] if isinstance(out, tuple) else out
        np.testing.assert_allclose(out, np.asarray(h(x, train=False)), rtol=1e-6)
    sm.timeit(h, x, kwargs={"train": True}, calls=2, repeats=1, warmup=1)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, h.state), before)
    with pytest.raises(sm.ConfigError, match=r"kwargs are the model's keyword arguments, a dict"):
        sm.timeit(h, x, kwargs=[("train", False)])
    art = sm.export(h, tmp_path / "m", example=x, kwargs={"train": False}).path
    with pytest.raises(sm.ConfigError, match=r"a loaded artifact takes no keyword arguments"):
        sm.timeit(sm.load(art), kwargs={"train": False})


def test_an_entry_point_is_named_in_its_timing(hybrid, tmp_path):
    """m["embed"] was once reported under the artifact's path alone, as its default entry."""
    h, x = hybrid
    embed = sm.hybridize(lambda p, x: x @ p["w"], {"w": jnp.ones((4, 3))}, name="embed")
    m = sm.load(sm.export({"main": h, "embed": embed}, tmp_path / "m", example=x).path)
    assert sm.timeit(m, calls=1, repeats=1, warmup=1).name == str(m.path)
    t = sm.timeit(m["embed"], calls=1, repeats=1, warmup=1)
    assert t.name == f"{m.path}['embed']" and str(t).startswith(f"{m.path}['embed']: 1 calls")
    named = re.escape(
        f"timeit(symjax_mlp.load(\"{m.path}\")['embed']): input args[0] has shape (2, 5)"
    )
    with pytest.raises(sm.SignatureError, match=named):  # its inputs refused naming the entry
        sm.timeit(m["embed"], jnp.ones((2, 5)), calls=1, repeats=1, warmup=1)


def test_cli_bench_times_the_entry_point_asked_for(hybrid, tmp_path, capsys):
    """bench --entry, as run and serve have it: bench once timed the default entry only."""
    h, x = hybrid
    embed = sm.hybridize(lambda p, x: x @ p["w"], {"w": jnp.ones((4, 3))}, name="embed")
    art = sm.export({"main": h, "embed": embed}, tmp_path / "m", example=x).path
    argv = ["bench", str(art), "--calls", "1", "--repeats", "1"]
    assert main([*argv, "--entry", "embed"]) == 0
    assert capsys.readouterr().out.startswith(f"{art}['embed']: 1 calls x 1 repeats")
    assert main([*argv, "--entry", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no entry point 'nope'; it has main, embed." in err


def test_python_settings_stay_settings_and_inputs_are_arrays(hybrid, tmp_path, monkeypatch, seen):
    """h(x, 3) with a Python depth: timeit once placed the 3 on the device as an array, which
    the model could not take as its setting; a loaded model's list input was converted on every
    timed call, where the call, not the copy, is timed."""
    h = sm.hybridize(lambda p, x, depth: jnp.tile(x, depth) * p, jnp.float32(2), name="depth")
    x = jnp.ones((2, 3))
    for model in (h, h.replace(params_as_constants=True)):
        seen.clear()
        check_fields(sm.timeit(model, x, 3, calls=1, repeats=1, warmup=1), 1, 1)
        assert len(seen) == 6 and all(out.shape == (2, 9) for out in seen)
    net, _ = hybrid
    m = sm.load(sm.export(net, tmp_path / "m", example=jnp.ones((1, 4))).path)
    given, call = [], type(m).__call__

    def spy(self, *inputs):
        given.append(inputs)
        return call(self, *inputs)

    monkeypatch.setattr(type(m), "__call__", spy)
    sm.timeit(m, [[1.0, 2.0, 3.0, 4.0]], calls=1, repeats=1, warmup=1)
    assert given and all(isinstance(x, jax.Array) for inputs in given for x in inputs)


def test_the_floor_of_a_load_with_params_as_constants_holds_them_so(hybrid, tmp_path, monkeypatch):
    """load(..., params_as_constants=True) compiles the weights in; its floor once took them as
    arguments, a different program than the model it was the floor of."""
    h, x = hybrid
    art = sm.export(h, tmp_path / "m", example=x).path
    lowered, real_jit = [], jax.jit

    def jit(fn, *a, **kw):
        jitted = real_jit(fn, *a, **kw)

        class Spy:
            def lower(self, *args):
                lowered.append(args)
                return jitted.lower(*args)

        return Spy()

    for constants in (False, True):
        m = sm.load(art, params_as_constants=constants)
        lowered.clear()
        monkeypatch.setattr(jax, "jit", jit)
        check_fields(sm.timeit(m, calls=1, repeats=1, warmup=1), 1, 1)
        monkeypatch.setattr(jax, "jit", real_jit)
        assert len(lowered) == 1
        assert any(isinstance(a, dict) for a in lowered[0]) is not constants  # the weights


def test_drawn_inputs_out_of_the_artifacts_bounds_blame_the_batch(tmp_path, capsys):
    """bench --batch 16 on an artifact that takes b <= 8 once told the user to pass inputs within
    the bound, which bench cannot; the message now names the batch that drew them. (A bound on
    another dimension, t <= 8, draws t = 8 at batch 16: test_export_verify.py.)"""
    h = sm.hybridize(lambda p, x: x.sum(-1), {}, name="sum")
    shapes, bound = ("b, t",), ("b <= 8",)
    art = sm.export(h, tmp_path / "m", example=jnp.ones((2, 5)), shapes=shapes, constraints=bound)
    m = sm.load(art.path)
    says = r"batch=16\): the inputs drawn at batch 16 do not fit .*b <= 8"
    with pytest.raises(sm.SignatureError, match=says):
        sm.timeit(m, batch=16, calls=1, repeats=1, warmup=1)
    check_fields(sm.timeit(m, batch=8, calls=1, repeats=1, warmup=1), 1, 1)
    named = rf'^timeit\(symjax_mlp\.load\("{re.escape(str(m.path))}"\)\): the inputs give b = 9'
    with pytest.raises(sm.SignatureError, match=named):  # the model named, as its call names it
        sm.timeit(m, jnp.ones((9, 2)), calls=1, repeats=1, warmup=1)  # passed: as it was
    assert main(["bench", str(art.path), "--batch", "16", "--calls", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "Pass a batch it accepts" in err
    assert err.endswith("\nsymjax-mlp bench: on the command line, batch= is --batch\n"), err


def test_the_floor_of_a_stateful_hybrid_updates_the_state_as_its_call_does(seen):
    """A BatchNorm in training mode: the timed call computes the new running statistics and
    holds them; the floor was h.fn, which returns the output alone, so XLA dropped the update
    and the floor did less work than the call it is the floor of. Now the floor takes the state
    and returns the new one, and the timing says so."""
    x, h = _batchnorm()
    out, state = h.apply_with_state(h.params, h.state, x, train=True)
    for model in (h, h.replace(params_as_constants=True)):
        seen.clear()
        t = sm.timeit(model, x, kwargs={"train": True}, calls=1, repeats=1, warmup=1)
        floors = [o for o in seen if isinstance(o, tuple)]
        assert len(seen) == 6 and len(floors) == 3  # its warm-up and its two rows
        for got, new_state in floors:
            np.testing.assert_allclose(got, out, rtol=1e-6)
            jax.tree.map(np.testing.assert_allclose, new_state, jax.tree.map(np.asarray, state))
        assert "its state in and the new state out" in t.floor and t.to_dict()["floor"] == t.floor
        assert str(t).splitlines()[-1] == f"(compiled: {t.floor})"
    t = sm.timeit(sm.hybridize(lambda p, x: x * p, jnp.float32(2)), x, calls=1, repeats=1)
    assert t.floor == "the same function, jax.jit(f).lower(...).compile(), called bare"


def test_the_floor_of_an_iree_load_is_the_iree_module_not_a_jax_program(
    hybrid, tmp_path, monkeypatch, seen
):
    """sm.load(path, runtime='iree') was timed against the artifact's program compiled by JAX:
    two runtimes, a ratio of nothing. Its floor is now the IREE module, called without the
    LoadedModel's checks; no JAX program is compiled for it, and the timing says which."""
    pytest.importorskip("iree.runtime")
    h, x = hybrid
    art = sm.export(h, tmp_path / "m", example=x).path
    m = sm.load(art, runtime="iree")
    lowered, real_jit = [], jax.jit
    monkeypatch.setattr(jax, "jit", lambda *a, **kw: lowered.append(a) or real_jit(*a, **kw))
    t = sm.timeit(m, np.asarray(x), calls=1, repeats=1, warmup=1)
    monkeypatch.setattr(jax, "jit", real_jit)
    assert lowered == [] and "IREE module" in t.floor and t.to_dict()["floor"] == t.floor
    assert len(seen) == 6
    for out in seen:  # the model's and the floor's alike
        np.testing.assert_allclose(out, np.asarray(m(np.asarray(x))), rtol=1e-5)
    assert "IREE" not in sm.timeit(sm.load(art), calls=1, repeats=1, warmup=1).floor


def test_the_floor_of_a_loaded_model_is_the_module_it_loaded(hybrid, tmp_path):
    """The floor read model.jaxexport again, unchecked: a file replaced since load was timed as
    the floor of the model that runs another module. Now it must be the one the load checked."""
    h, x = hybrid
    art = sm.export(h, tmp_path / "m", example=x).path
    net = sm.mlp((8, 2), activation="tanh")  # the same shapes, another program
    other = sm.hybridize(net, net.init(jax.random.key(1), x), name="tiny")
    swapped = sm.export(other, tmp_path / "o", example=x).path / "model.jaxexport"
    m = sm.load(art)
    (art / "model.jaxexport").write_bytes(swapped.read_bytes())
    with pytest.raises(sm.ArtifactError, match=r"model.jaxexport is corrupted"):
        sm.timeit(m, calls=1, repeats=1, warmup=1)


@pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated")  # (the example's layer)
def test_a_model_taking_its_arrays_by_keyword_is_timed_on_them():
    """flax's nlp_seq tagger takes ``(*, inputs, train)``: ``timeit(h, kwargs={"inputs": x,
    ...})`` was refused, telling ``timeit(h, x)``, which the model refuses."""
    from helpers import tagger

    model, variables, x = tagger()
    h = sm.hybridize(model, variables)
    t = sm.timeit(h, kwargs={"inputs": x, "train": False}, calls=3, repeats=2, warmup=1)
    assert len(t.synced) == len(t.compiled_synced) == 2 and t.calls == 3
