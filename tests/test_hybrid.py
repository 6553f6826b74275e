"""The Hybrid object: eager vs compiled, tracing made visible, control flow, threads."""

import copy
import inspect
import pickle
import re
import threading
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from flax import nnx
from helpers import ZOO

import symjax_mlp as sm
from symjax_mlp import RetraceWarning
from symjax_mlp.chapter import HybridNet


def _concurrent_net():
    return sm.HybridSequential(
        (sm.HybridConcurrent((sm.mlp((16, 8)), sm.Dense(5, activation="tanh"))), sm.Dense(3))
    )


class EagerAndCompiledAgree(chex.TestCase):
    """The same numerics under jax.jit and without it (chex variants), and via Hybrid."""

    def _check(self, net, x):
        variables = net.init(jax.random.key(1), x)
        h = sm.hybridize(net, variables)
        out = self.variant(h.fn)(h.params, x)
        expected = h.eager(x)
        chex.assert_trees_all_close(out, expected, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(h(x), expected, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(h.hybridize(False)(x), expected, rtol=1e-5, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_chapter_mlp(self):
        self._check(sm.mlp((256, 128, 2)), jax.random.normal(jax.random.key(0), (1, 512)))

    @chex.variants(with_jit=True, without_jit=True)
    def test_concurrent_net(self):
        self._check(_concurrent_net(), jax.random.normal(jax.random.key(0), (4, 12)))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(
        ((7,), 3, 1, "relu"),
        ((33, 1), 5, 9, "gelu"),
        ((64, 64, 10), 20, 2, "tanh"),
        ((1, 300, 4, 2), 2, 17, "silu"),
    )
    def test_random_shapes(self, sizes, width, batch, act):
        x = jax.random.normal(jax.random.key(width), (batch, width))
        self._check(sm.mlp(sizes, activation=act), x)


def test_hybridize_accepts_linen_nnx_and_functions(chapter):
    _, variables, h, x = chapter
    assert isinstance(h, sm.Hybrid) and h.params is variables

    lin = nnx.Linear(512, 2, rngs=nnx.Rngs(0))
    hn = sm.hybridize(lin)
    assert isinstance(hn.params, dict) and set(hn.params) == {"kernel", "bias"}
    np.testing.assert_allclose(hn(x), lin(x), rtol=1e-5)
    np.testing.assert_allclose(hn.eager(x), lin(x), rtol=1e-6)

    hf = sm.hybridize(lambda p, x: x * p["w"], {"w": jnp.float32(3)})
    np.testing.assert_allclose(hf(jnp.ones(2)), [3.0, 3.0])


def test_a_linen_model_given_variables_params_or_no_dict_says_what_to_pass(chapter):
    net, variables, h, x = chapter  # flax's ScopeCollectionNotFound / a TypeError, before
    no_params = r"no 'params' collection \(their keys: \['layers_0'.*not variables\['params'\]"
    with pytest.raises(sm.ConfigError, match=no_params):
        sm.hybridize(net, variables["params"])(x)
    with pytest.raises(sm.ConfigError, match=no_params):
        sm.hybridize(net, variables["params"]).eager(x)
    with pytest.raises(sm.ConfigError, match=no_params):
        h.apply(variables["params"], x)
    with pytest.raises(sm.ConfigError, match=r"the variables given are a NoneType, not the dict"):
        h.apply(None, x)
    np.testing.assert_array_equal(h.apply(variables, x), h(x))


def test_apply_of_params_not_shaped_as_the_models_names_them_not_the_models_raw_error():
    """h.apply(None, x) of a plain model raised its raw TypeError ('NoneType' object is not
    subscriptable), a dict of other keys its KeyError: named as the params given, the model's
    error quoted; params that fit but fail stay the model's own error."""
    h, x = sm.hybridize(lambda p, x: x * p["w"], {"w": jnp.float32(2)}, name="dbl"), jnp.ones(3)
    said = r"^dbl\.apply\(params, \.\.\.\): the params given, {}, do not fit the model's \({}\)"
    for params, got, diff in (
        (None, "None", r"missing \[\"params\['w'\]\"\], unexpected none"),
        ({"v": jnp.float32(2)}, "a dict", r"missing .*, unexpected \[\"params\['v'\]\"\]"),
    ):
        with pytest.raises(sm.ConfigError, match=said.format(got, diff)) as e:
            h.apply(params, x)
        assert "the model failed on them (" in str(e.value) and "h.apply(h.params, x)" in str(
            e.value
        )
    with pytest.raises(TypeError, match="mul got incompatible shapes"):  # they fit: its own
        h.apply({"w": jnp.ones(2)}, x)
    np.testing.assert_array_equal(h.apply(h.params, x), h(x))


def test_a_linen_model_given_another_models_params_names_the_one_missing(chapter):
    # a checkpoint of renamed layers: flax's ScopeParamNotFoundError / ScopeCollectionNotFound
    _, variables, h, x = chapter
    other = {"params": {"layers_0": variables["params"]["layers_0"]}}
    said = r"^HybridSequential: the variables given do not fit the model: Could not find parameter "
    with pytest.raises(sm.ConfigError, match=said + r"named \"kernel\" in scope \"/layers_1\""):
        h.replace(params=other)(x)
    with pytest.raises(sm.ConfigError, match=r"do not fit the model: Tried to access \"kernel\""):
        h.apply({"params": {}}, x)


def test_hybridize_rejects_bad_arguments(chapter):
    net, variables, h, _ = chapter
    with pytest.raises(TypeError, match="needs its variables"):
        sm.hybridize(net)
    with pytest.raises(TypeError, match="takes no params"):
        sm.hybridize(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), {})
    with pytest.raises(TypeError, match="needs params"):
        sm.hybridize(lambda p, x: x)
    with pytest.raises(TypeError, match="got int"):
        sm.hybridize(3, {})
    with pytest.raises(TypeError, match="already hybridized"):
        sm.hybridize(h, variables)
    with pytest.raises(ValueError, match="max_traces"):
        sm.hybridize(net, variables, max_traces=0)


def test_numpy_integers_and_bools_are_taken_as_settings_as_jax_jit_takes_them():
    """max_traces=np.int64(2), static_argnums=np.int64(1), compiled=np.bool_(True) were
    refused as no int (no bool): as jax.jit does, they are Python's int and bool."""
    settings = {"max_traces": np.int64(2), "static_argnums": (np.int64(1),)}
    h = sm.hybridize(lambda p, x, k: x * p * k, jnp.float32(2), **settings)
    assert (h.max_traces, h.static_argnums) == (2, frozenset({1})) and type(h.max_traces) is int
    assert h(jnp.ones(2), 3).tolist() == [6.0, 6.0] and h.trace_count == 1
    twin = h.replace(compiled=np.bool_(False), pad=np.bool_(True), static_argnums=np.int32(1))
    assert twin.compiled is False and twin.pad is True and twin.static_argnums == frozenset({1})
    for bad in (np.int64(0), np.float32(2), True):
        with pytest.raises(
            sm.ConfigError,
            match=r"max_traces must be a positive int or None; "
            r"got .*Pass e\.g\. max_traces=8",
        ):
            h.replace(max_traces=bad)
    with pytest.raises(sm.ConfigError, match=r"static_argnums=\(True,\)"):
        h.replace(static_argnums=(True,))


def test_replace_name_none_names_the_model_as_hybridize_does():
    """h.replace(name=None) of a module's Hybrid was named "__call__" (its method's name)."""
    from helpers import ZOO

    for case in ZOO:
        h = case.hybridize()
        assert h.replace(name=None).name == h.name, case.name


def test_data_mesh_takes_a_numpy_int_and_refuses_an_axis_of_no_str():
    """data_mesh(np.int64(1)) was refused as no device count; axis=3 made an axis named '3'."""
    mesh = sm.data_mesh(np.int64(1))
    assert dict(mesh.shape) == {"data": 1} and type(mesh.shape["data"]) is int
    with pytest.raises(sm.ConfigError, match=r"axis must be a str; got 3 \(int\)\. Pass e\.g\."):
        sm.data_mesh(1, axis=3)
    with pytest.raises(sm.ConfigError, match=r"data_mesh\(np\.True_\): JAX sees"):
        sm.data_mesh(np.True_)


def test_hybridize_false_returns_an_eager_twin(chapter):
    _, _, h, x = chapter
    calls = []
    h.on_trace(lambda x: calls.append(x))
    twin = h.hybridize(False)
    assert twin is not h and h.compiled and not twin.compiled
    twin(x)
    twin(x)
    assert twin.trace_count == 0 and len(calls) == 2  # eager: Python every call
    assert h.hybridize(True).compiled


def test_compiled_call_traces_once_per_signature(chapter):
    _, _, h, x = chapter
    h(x)
    h(x + 1)
    assert h.trace_count == 1
    h(jnp.ones((7, 512)))
    h(jnp.ones((7, 512)))
    assert h.trace_count == 2
    (first, second) = h.trace_log
    assert first.index == 0 and first.reason == "first call"
    assert first.signature == (sm.TensorSpec("args[0]", (1, 512), "float32", False),)
    assert second.reason == "args[0].shape changed from (1, 512) to (7, 512)"


def test_retrace_reasons_name_path_and_change():
    h = sm.hybridize(lambda p, x, y: x["a"] * y, {})
    h({"a": jnp.ones(3)}, jnp.ones(3))
    h({"a": jnp.ones(3, jnp.int32)}, jnp.ones(3))
    h({"a": jnp.ones(3)}, jnp.asarray(2.0))  # weakly typed, like a Python scalar in JAX
    h({"a": jnp.ones(3), "b": jnp.ones(1)}, jnp.ones(3))
    h({"a": jnp.ones(3)}, 2.0)  # a Python float is a static setting
    reasons = [e.reason for e in h.trace_log]
    assert reasons[1] == "args[0]['a'].dtype changed from float32 to int32"
    assert "args[1].shape changed from (3,) to ()" in reasons[2]
    assert "args[1].weak_type changed from False to True" in reasons[2]
    assert reasons[3].startswith("input tree structure changed")
    assert "args[1] (static) changed from (absent) to 2.0" in reasons[4]
    assert "args[0]['a']: float32[3]" in str(h.trace_log[0])
    assert "args[1]=2.0" in str(h.trace_log[4])


def test_a_python_number_retraced_per_value_is_warned_of_once_naming_it_and_the_fixes():
    """JAX's advi example called h(t) of a Python int: 12 traces for 12 calls, said by nothing
    but max_traces=. Now the retrace that only a number's value made warns once per Hybrid,
    naming it, jnp.asarray and static_argnums; a deliberate static, or a shape's change, not (a
    type's, 4 -> 4.0: test_zoo's test_settings_python_calls_equal_but_of_other_types...)."""
    f = lambda p, x, t, scale=1.0: x * p * scale + t  # noqa: E731
    h, x = sm.hybridize(f, jnp.float32(2)), jnp.ones(3)
    h(x, 0)
    h(jnp.ones(4), 1)  # a shape changed too: no warning
    with pytest.warns(RetraceWarning) as said:
        h(x, 2)
    assert re.search(r"Python number args\[1\] \(0 -> 2\).*jnp\.asarray\(\.\.\.\).*"
                     r"static_argnums=\(1,\)", str(said[0].message))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h(x, 3)  # once per Hybrid
        h.apply(h.params, x, 4)
        assert h.trace_count == 5
        s = sm.hybridize(f, jnp.float32(2), static_argnums=(1,), static_argnames=("scale",))
        for t in range(2):
            s(x, t, scale=t + 1.0)  # static on purpose: a trace per value, unwarned
        assert s.trace_count == 2
    k = sm.hybridize(f, jnp.float32(2))
    k(x, jnp.float32(0), scale=1.0)
    with pytest.warns(RetraceWarning, match=r"kwargs\['scale'\] \(1\.0 -> 0\.5\).*"
                      r"static_argnames=\('scale',\)"):  # fmt: skip
        k(x, jnp.float32(1), scale=0.5)


def test_the_retrace_warning_points_at_the_users_line_that_called_the_hybrid():
    """The RetraceWarning is raised while jax.jit traces, under JAX's frames and ours: its
    filename and line are the user's call, ``h(x, 1)``, here and inside a jitted function of
    the user's (before: a line of the library, stacklevel=2)."""
    h, x = sm.hybridize(lambda p, x, t: x * p + t, jnp.float32(2)), jnp.ones(3)
    h(x, 0)
    with pytest.warns(RetraceWarning) as said:
        line = inspect.currentframe().f_lineno + 1
        h(x, 1)
    assert (said[0].filename, said[0].lineno) == (__file__, line)
    g = sm.hybridize(lambda p, x, t: x * p + t, jnp.float32(2))
    g.apply(g.params, x, 0)
    with pytest.warns(RetraceWarning) as said:
        line = inspect.currentframe().f_lineno + 1
        jax.jit(lambda x: g.apply(g.params, x, 1))(x)
    assert (said[0].filename, said[0].lineno) == (__file__, line)


def test_max_traces_raises_with_the_explanation(chapter):
    net, variables, _, x = chapter
    h = sm.hybridize(net, variables, max_traces=1)
    h(x)
    with pytest.raises(sm.RetraceError, match=r"args\[0\].shape changed from \(1, 512\)") as info:
        h(jnp.ones((2, 512)))
    assert "max_traces=1" in str(info.value) and isinstance(info.value, sm.SymjaxError)
    assert h.trace_count == 1
    h(x)  # the traced signature still works


def test_on_trace_sees_tracers_once_and_eager_values_every_time(chapter):
    _, _, h, x = chapter
    seen = []

    def record(x):
        seen.append(x)

    assert h.on_trace(record) is record
    h(x)
    assert len(seen) == 1 and isinstance(seen[0], jax.core.Tracer)
    h(x)
    assert len(seen) == 1
    h.eager(x)
    h.eager(x)
    assert len(seen) == 3 and all(isinstance(s, jax.Array) for s in seen[1:])
    assert not any(isinstance(s, jax.core.Tracer) for s in seen[1:])
    with pytest.raises(TypeError, match="callable"):
        h.on_trace(3)


def test_the_chapters_hybridnet_printout(capsys):
    net = HybridNet()
    x = jax.random.normal(jax.random.key(0), (1, 3))
    h = sm.hybridize(net, net.init(jax.random.key(1), x))
    capsys.readouterr()

    expected = h.eager(x)
    eager = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in eager] == ["value x", "result "]
    assert "Tracer" not in "".join(eager) and "[[" in eager[0]

    np.testing.assert_allclose(h(x), expected, rtol=1e-6)
    first = capsys.readouterr().out.splitlines()
    assert len(first) == 2
    assert "Tracer(float32[1,3])" in first[0] and "Tracer(float32[1,4])" in first[1]

    np.testing.assert_allclose(h(x), expected, rtol=1e-6)
    assert capsys.readouterr().out == ""  # the compiled program has no print in it


def _if(p, x):
    if x.sum() > 0:
        return x
    return -x


def _while(p, x):
    while x.sum() < 10:
        x = x * 2
    return x


def _asarray(p, x):
    return jnp.asarray(np.asarray(x) + 1)


def _float(p, x):
    return x * float(x.sum())


@pytest.mark.parametrize("fn", [_if, _while, _asarray, _float])
def test_control_flow_on_traced_values_is_a_clear_error(fn):
    x = jnp.ones(3)
    h = sm.hybridize(fn, {})
    h.eager(x)  # imperative mode runs it fine
    for call in (h, h.lower, h.graph):
        with pytest.raises(sm.ControlFlowError) as info:
            call(x)
        msg = str(info.value)
        assert msg.startswith(f"{fn.__name__}:")
        assert "eager" in msg and "jnp.where" in msg and "jax.lax.fori_loop" in msg
        assert isinstance(info.value.__cause__, jax.errors.JAXTypeError)


def test_a_shape_error_naming_a_tracer_is_jaxs_not_a_control_flow_error():
    """``checkify.check`` of a vector (a model bug) is JAX's TypeError, as under jax.jit and
    eagerly ('takes a scalar pred ... JitTracer(bool[3])'); it was a ControlFlowError asking
    for a concrete value. A shape from a traced scalar (``jnp.zeros(n)``) stays one."""
    from jax.experimental import checkify

    def positive(p, x):
        checkify.check(x > 0, "x must be positive")
        return x

    x = jnp.ones(3)
    for call in (sm.hybridize(positive, {}), sm.hybridize(positive, {}).eager):
        with pytest.raises(TypeError, match=r"scalar pred") as info:
            call(x)
        assert not isinstance(info.value, sm.ControlFlowError)
    with pytest.raises(sm.ControlFlowError, match=r"concrete values"):
        sm.hybridize(lambda p, n: jnp.zeros(n), {})(jnp.int32(2))


def test_python_for_over_a_static_range_unrolls():
    def repeat(p, x):
        for _ in range(4):
            x = jnp.sin(x) + p
        return x

    h = sm.hybridize(repeat, jnp.float32(1))
    x = jnp.arange(3.0)
    np.testing.assert_allclose(h(x), h.eager(x), rtol=1e-6)
    counts = h.graph(x).primitive_counts
    assert counts["sin"] == 4 and counts["add"] == 4


def test_concurrent_first_calls_trace_once_and_agree(chapter):
    _, _, h, x = chapter
    barrier = threading.Barrier(8)
    results = [None] * 8

    def worker(i):
        barrier.wait()
        results[i] = np.asarray(h(x))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert h.trace_count == 1
    for r in results:
        np.testing.assert_array_equal(r, results[0])


def test_stages_are_exposed(chapter):
    _, _, h, x = chapter
    lowered = h.lower(x)
    assert isinstance(lowered, jax.stages.Lowered)
    assert "stablehlo.dot_general" in lowered.as_text()
    compiled = h.compile(x)
    assert isinstance(compiled, jax.stages.Compiled)
    assert "HloModule" in compiled.as_text()
    assert compiled.cost_analysis()["flops"] > 0
    assert compiled.memory_analysis().argument_size_in_bytes >= 4 * 164_482


def test_compile_partitions_its_arguments_once_and_is_refused_as_compile(monkeypatch):
    # h.compile(x) partitioned (walked, checked) its arguments twice: as compile, then as lower
    from symjax_mlp._hybrid import args, staged

    calls = []
    monkeypatch.setattr(
        staged, "partition", lambda *a, **k: calls.append(a) or args.partition(*a, **k)
    )
    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    assert "multiply" in h.compile(jnp.ones(3)).as_text() and len(calls) == 1
    with pytest.raises(sm.SignatureError, match=r"^<lambda>\.compile: the call's arguments"):
        h.compile(jnp.ones(3), jnp.ones(3))


# -- what other modules read of a Hybrid: its public names -------------------------------------
def test_inspect_signature_reads_what_a_call_takes(chapter):
    import inspect

    _, _, h, _ = chapter
    assert list(inspect.signature(h).parameters) == ["x"]  # the variables are not an input
    f = sm.hybridize(lambda p, x, *, scale=1.0: x * p, jnp.float32(2))
    assert str(inspect.signature(f)) == "(x, *, scale=1.0)"
    assert str(inspect.signature(f.replace(name="g"))) == "(x, *, scale=1.0)"
    assert "params" in inspect.signature(sm.Hybrid).parameters  # the class: its constructor


def test_a_hybrid_says_its_kind_its_pure_function_with_state_and_the_state_a_call_moves():
    class Net(nnx.Module):  # in training mode: BatchNorm's statistics, Dropout's rng stream
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.bn, self.drop = nnx.BatchNorm(2, rngs=rngs), nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.bn(x))

    h, x = sm.hybridize(Net(nnx.Rngs(0))), jnp.arange(6.0).reshape(3, 2)
    stats = ["state['bn']['mean']", "state['bn']['var']"]
    assert h.kind == "nnx" and h.moved_state(x) == [*stats, "state['drop']['rngs']['key']"]
    _, state = h.fn_with_state(h.params, h.state, x)  # un-jitted: no trace logged
    assert h.trace_count == 0 and jax.tree.structure(state) == jax.tree.structure(h.state)
    np.testing.assert_allclose(state["bn"]["mean"], h.apply(h.params, x)[1]["bn"]["mean"])
    plain = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    assert plain.kind == "plain" and plain.moved_state(x) == []
    np.testing.assert_allclose(plain.fn_with_state(plain.params, {}, x)[0], 2 * x)


def test_moved_state_runs_the_model_once_per_part_it_reads():
    """moved_state (a Batcher's check of a stateful Hybrid) ran the model three times: the new
    state's jaxpr, the output's (a held rng key), and jax.eval_shape for the new state's paths,
    which the first trace's shapes give. Now twice, once without a held rng key."""
    runs = []

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs, drop: bool) -> None:
            self.bn = nnx.BatchNorm(2, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs) if drop else (lambda y: y)

        def __call__(self, x):
            runs.append(x.shape)
            return self.drop(self.bn(x))

    x, stats = jnp.arange(6.0).reshape(3, 2), ["state['bn']['mean']", "state['bn']['var']"]
    for drop, moved in ((True, ["state['drop']['rngs']['key']"]), (False, [])):
        h = sm.hybridize(Net(nnx.Rngs(0), drop))
        runs.clear()
        assert h.moved_state(x) == [*stats, *moved] and len(runs) == 1 + drop


def test_fn_with_state_names_a_state_that_is_not_the_models():
    """A linen model's h.fn_with_state(params, None, x) raised "TypeError: 'NoneType' object
    is not iterable", a state of other collections "KeyError: 'batch_stats'", from inside the
    library; nnx's and h.apply_with_state's name what the state lacks. Now linen's do too."""
    h = next(c for c in ZOO if c.name == "linen_batchnorm").hybridize()
    x, says = jnp.ones((4, 5)), r"LinenBatchNorm\.fn_with_state\(params, state, \.\.\.\): the "
    for state, unexpected in ((None, "none"), ({"zzz": 1}, r"\[\"state\['zzz'\]\"\]")):
        with pytest.raises(sm.ConfigError, match=says + rf"state given .* unexpected {unexpected}"):
            h.fn_with_state(h.params, state, x)


def test_a_snapshot_keeps_the_mode_and_state_a_later_switch_or_call_would_change():
    from flax import nnx
    from helpers import NnxModes, keyless

    plain = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    assert plain.snapshot() is plain  # nothing could change under it
    model = NnxModes(nnx.Rngs(0, dropout=7))
    model.eval()
    h = sm.hybridize(model, donate=True)
    x = jnp.arange(10.0).reshape(2, 5)
    snap = h.snapshot()
    assert snap is not h and snap.training_mode(x) == ()
    before = jax.tree.map(np.asarray, keyless(snap.state))
    model.train()  # h follows the module; the snapshot stays in eval mode
    assert h.training_mode(x) != () and snap.training_mode(x) == ()
    h(x)  # donates what h holds: the snapshot's state is its own
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, keyless(snap.state)), before)
    model.eval()  # the module itself, untouched by h's calls, in the snapshot's mode
    np.testing.assert_allclose(snap(x), model(x), rtol=1e-6)


@pytest.mark.parametrize("name", ["linen_batchnorm", "nnx_batchnorm", "fn_kwargs"])
def test_pickle_is_refused_saying_what_to_do_and_deepcopy_is_a_twin_of_its_own(name):
    """pickle.dumps(h) was Python's AttributeError on a local function, copy.deepcopy(h) its
    TypeError on a lock: now a refusal naming export, and a twin holding its own state."""
    from helpers import ZOO

    case = next(c for c in ZOO if c.name == name)
    h, xs = case.hybridize(), case.inputs(0)
    with pytest.raises(sm.ConfigError, match=r"pickle\.dumps\(.*never pickled.*sm\.export\("):
        pickle.dumps({"model": h})
    h(*xs, **case.train)
    twin, alias = copy.deepcopy(h), copy.copy(h)
    assert twin is not h and twin.trace_count == 0 and alias.trace_count == h.trace_count
    before = jax.tree.map(np.asarray, twin.state)
    want = h(*xs, **case.train)  # moves h's state (a BatchNorm's statistics), not the twin's
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, twin.state), before)
    chex.assert_trees_all_close(twin(*xs, **case.train), want, rtol=1e-6)
    chex.assert_trees_all_close(alias(*xs, **case.eval), h(*xs, **case.eval), rtol=1e-6)


def test_a_stateful_call_under_grad_holds_no_tracer_of_any_leaf():
    # under jax.grad a leaf with no tangent (a counter) comes back concrete and the others
    # traced: the call is refused as a whole, not held with a tracer that breaks every later call
    import flax.linen as nn

    class Counted(nn.Module):
        @nn.compact
        def __call__(self, x):
            count = self.variable("stats", "a_count", lambda: jnp.zeros((), jnp.int32))
            mean = self.variable("stats", "b_mean", lambda: jnp.zeros(x.shape[-1]))
            count.value = count.value + 1
            mean.value = 0.9 * mean.value + 0.1 * x.mean(0)
            return nn.Dense(2)(x)

    model, x = Counted(), jnp.ones((3, 4))
    variables = model.init(jax.random.key(0), x)
    h = sm.hybridize(model, variables)
    with pytest.raises(sm.ControlFlowError, match=r"inside a JAX transformation.*h\.apply"):
        jax.grad(lambda x: h(x).sum())(x)
    chex.assert_trees_all_close(h.state, {"stats": variables["stats"]})  # not moved
    out, state = model.apply(variables, x, mutable=["stats"])
    chex.assert_trees_all_close(h(x), out, rtol=1e-6, atol=1e-6)  # the next call runs
    chex.assert_trees_all_close(h.state, state, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("call", ["call", "apply", "graph"])
def test_a_python_value_returned_is_refused_with_its_path_not_jaxs_internal_name(call):
    # before: JAX's TypeError naming the library's '<lambda>_hybrid at hybrid.py:129'
    h = sm.hybridize(lambda p, x: {"y": x * p, "label": "cat"}, jnp.float32(2))
    x = jnp.ones(3)
    assert h.eager(x)["label"] == "cat"  # eagerly, as the model does
    run = {"call": h, "apply": lambda x: h.apply(h.params, x), "graph": h.graph}[call]
    with pytest.raises(sm.ConfigError, match=r"type str at out\['label'\].*outside the model"):
        run(x)


@pytest.mark.parametrize("bad", [{1, 2}, object()], ids=type)
def test_an_input_neither_array_nor_setting_is_refused_naming_its_type(bad):
    # before: JAX's TypeError giving the program's path (args[3]), not the caller's
    h = sm.hybridize(lambda p, x, extra: x * p, jnp.float32(2))
    for run in (h, lambda *a: h.apply(h.params, *a), h.lower, h.graph):
        match = rf"args\[1\]\[0\] is of type {type(bad).__name__}, which a comp"
        with pytest.raises(sm.ConfigError, match=match):
            run(jnp.ones(3), (bad,))


def test_nnx_params_of_other_names_are_refused_not_matched_by_place():
    # before: nnx.merge matched the leaves by place: {'bias2', 'scale'} set the bias silently
    h = sm.hybridize(nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
    x, renamed = jnp.ones((4, 3)), {"bias2": jnp.ones(3), "scale": jnp.ones(3)}
    with pytest.raises(sm.ConfigError, match=r"missing \[\"params\['bias'\]\"\], unexpected"):
        h.replace(params=renamed)(x)
    with pytest.raises(sm.ConfigError, match=r"missing \[\"state\['var'\]\"\]"):
        h.apply_with_state(h.params, {"mean": jnp.zeros(3)}, x)
    as_state = nnx.state(nnx.BatchNorm(3, rngs=nnx.Rngs(0)), nnx.Param)  # an nnx.State fits
    np.testing.assert_allclose(h.apply(as_state, x)[0], h(x))


def test_a_static_nan_or_negative_zero_keys_its_own_trace_as_eagerly():
    # before: -0.0 == 0.0 reused 0.0's program (x / -0.0 gave inf, eagerly -inf), and each
    # new float('nan') (nan != nan) missed the cache: a trace per call
    h = sm.hybridize(lambda p, x, d=1.0, t=(1.0,): x / d * t[0], {})
    x = jnp.ones(2)
    with pytest.warns(RetraceWarning, match=r"kwargs\['d'\] \(0\.0 -> -0\.0\)"):
        for d, t in ((0.0, (1.0,)), (-0.0, (1.0,)), (1.0, (-0.0,))):
            np.testing.assert_array_equal(h(x, d=d, t=t), h.eager(x, d=d, t=t))
    assert "kwargs['d'] (static) changed from 0.0 to -0.0" in h.trace_log[1].reason
    count = h.trace_count
    for _ in range(3):
        assert np.isnan(h(x, d=float("nan"), t=(float("nan"),))).all()
    assert h.trace_count == count + 1


def test_static_argnames_naming_a_positional_only_input_says_to_mark_it_by_place():
    # before: "names ['x'], but the model's inputs are (x, y). Name one of those"
    def model(p, x, /, y):
        return x * y

    with pytest.raises(
        sm.ConfigError, match=r"'x', which is positional-only.*static_argnums=\(0,\)"
    ):
        sm.hybridize(model, {}, static_argnames="x")
    h = sm.hybridize(model, {}, static_argnums=0)
    assert h(2.0, y=jnp.ones(2)).tolist() == [2.0, 2.0]


def test_an_input_tree_with_none_or_int_keys_traces_and_keys_of_two_types_are_refused():
    h = sm.hybridize(lambda p, tree: jax.tree.map(lambda a: a * p, tree), jnp.float32(2))
    out = h({"a": jnp.ones(2), "b": None})  # before: refused as if None were the model
    assert out["b"] is None
    chex.assert_trees_all_close(out["a"], jnp.full(2, 2.0))
    chex.assert_trees_all_close(h({1: jnp.ones(2), 2: jnp.ones(3)})[2], jnp.full(3, 2.0))
    # before: JAX's "ValueError: Comparator raised exception while sorting pytree dictionary keys"
    for run in (h, h.lower, h.graph):
        with pytest.raises(
            sm.ConfigError, match=r"args\[0\]\[1\] is a dict whose keys \(int, str\)"
        ):
            run((jnp.ones(2), {1: jnp.ones(2), "a": jnp.ones(3)}))


@pytest.mark.parametrize("keyword", ["method", "mutable", "rngs"])
def test_a_linen_models_keyword_named_as_an_apply_option_reaches_the_model(keyword):
    # it was passed to model.apply beside the library's own options: a flax error, or a
    # TypeError for a keyword given twice; a user's names are theirs
    import flax.linen as nn

    class Scaled(nn.Module):
        @nn.compact
        def __call__(self, x, **options):
            return nn.Dense(2)(x) * options[keyword]

    model, x = Scaled(), jnp.ones((1, 3))
    variables = model.init(jax.random.key(0), method=lambda m: m(x, **{keyword: 1.0}))
    h = sm.hybridize(model, variables)
    want = model.apply(variables, method=lambda m: m(x, **{keyword: 3.0}))
    chex.assert_trees_all_close(h(x, **{keyword: 3.0}), want, rtol=1e-6)
    chex.assert_trees_all_close(h.eager(x, **{keyword: 3.0}), want, rtol=1e-6)


def test_an_equinox_module_of_non_array_leaves_given_as_an_input_is_refused_naming_its_path():
    # one walk refuses it with the leaf's path (it named only the argument: kwargs['mod'])
    import equinox as eqx

    mlp = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))  # its activations are leaves
    h = sm.hybridize(lambda p, x, mod: mod["a"](x) * p, jnp.float32(2))
    with pytest.raises(sm.ConfigError, match=r"kwargs\['mod'\]\['a'\] is an equinox module"):
        h(jnp.ones(3), mod={"a": mlp})
    arrays, static = eqx.partition(mlp, eqx.is_array)
    h = sm.hybridize(lambda p, x, a: eqx.combine(a, static)(x) * p, jnp.float32(2))
    chex.assert_trees_all_close(h(jnp.ones(3), arrays), mlp(jnp.ones(3)) * 2, rtol=1e-6)


def _timed(h):
    return lambda *a: sm.timeit(h, *a, calls=1, repeats=1, warmup=1)


@pytest.mark.parametrize("path", ["call", "eager", "lower", "graph", "apply", "timeit", "export"])
def test_an_input_the_params_do_not_fit_is_one_signature_error_on_every_path(path, tmp_path):
    # each was flax's raw ScopeParamShapeError ("the given initializer is expected to ...")
    net, x = sm.mlp((16, 3)), jnp.ones((2, 8))
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    run = {"call": h, "eager": h.eager, "lower": h.lower, "graph": h.graph,
           "apply": lambda a: h.apply(h.params, a), "timeit": _timed(h),
           "export": lambda a: sm.export(h, tmp_path / "a", example=a)}[path]  # fmt: skip
    with pytest.raises(
        sm.SignatureError,
        match=r"^HybridSequential: the inputs \(args\[0\]: float32\[(2|b), 7\]\) do not fit the "
        r"params: param layers_0/kernel has shape \(8, 16\), and these inputs make it \(7, 16\)"
        r"\. The params were made for inputs of other shapes .* init the model again for these\.",
    ):
        run(jnp.ones((2, 7)))
    assert h.trace_count == 0 and not (tmp_path / "a").exists()


@pytest.mark.parametrize("path", ["call", "eager", "timeit"])
def test_a_shape_dtype_struct_given_to_a_call_points_to_graph_and_lower(path):
    # h.eager(spec) was float()'s TypeError, h(spec) jax.jit's 'not a valid JAX type'
    net, x = sm.mlp((16, 3)), jnp.ones((2, 8))
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    run = {"call": h, "eager": h.eager, "timeit": _timed(h)}[path]
    caller = "HybridSequential.eager" if path == "eager" else "HybridSequential"
    with pytest.raises(
        sm.SignatureError,
        match=rf"^{caller}: args\[0\] is a jax\.ShapeDtypeStruct \(float32\[2, 8\]\), a shape "
        r"and dtype without values.* jnp\.zeros\(\(2, 8\), jnp\.float32\); .*HybridSequential"
        r"\.graph\(spec\) .*HybridSequential\.lower\(spec\)",
    ):
        run(jax.ShapeDtypeStruct((2, 8), jnp.float32))
    with pytest.raises(sm.SignatureError, match=r"kwargs\['y'\]\['k'\] is a jax\.ShapeDtype"):
        sm.hybridize(lambda p, x, y: x, {}).eager(x, y={"k": jax.ShapeDtypeStruct((), "int32")})
    with pytest.raises(sm.SignatureError, match=r"args\[0\]\[1\] is a jax\.ShapeDtype"):
        spec = jax.ShapeDtypeStruct((2,), "int32")  # the first named, as the caller reads
        sm.hybridize(lambda p, x, y: x, {}).eager((x, spec), spec)
    assert h.lower(jax.ShapeDtypeStruct((2, 8), jnp.float32)).as_text()  # staging takes one


@pytest.mark.parametrize("case", [c for c in ZOO if c.kind != "linen"], ids=lambda c: c.name)
def test_an_nnx_module_or_function_given_inputs_its_weights_do_not_fit_names_them(case):
    # each was JAX's raw TypeError, "dot_general requires contracting dimensions to have ..."
    h = case.hybridize("eval")
    bad = (jnp.ones((4, 7)), *case.inputs(0)[1:])
    for run in (h, h.eager):
        with pytest.raises(
            sm.SignatureError,
            match=r"^\w+: the inputs \(args\[0\]: float32\[4, 7\].*\) do not fit the params: a "
            r"matrix product takes 7 from an input's last dimension where the params have 5 "
            r"\([\w/]*(kernel|w) \(5, \d+\)\)\. .*make the params again for these\.",
        ):
            run(*bad, **case.settings("eval"))
    assert h.trace_count == 0


def test_an_equinox_module_given_inputs_its_weights_do_not_fit_names_them_and_itself():
    """equinox's Linear computes weight @ x, so JAX's error reads the other way round ("got
    (5,) and (7,)"): h(x), h.eager and h.fn_with_state raised it raw. And its messages were
    headed "__call__:" (its method's name), not the Hybrid's "MLP"."""
    import equinox as eqx

    h = sm.hybridize(eqx.nn.MLP(5, 3, 8, 2, key=jax.random.key(0)))
    for run in (h, h.eager, lambda x: h.fn_with_state(h.params, h.state, x)):
        with pytest.raises(
            sm.SignatureError,
            match=r"^MLP: the inputs \(args\[0\]: float32\[7\]\) do not fit the params: a matrix "
            r"product takes 7 from an input's last dimension where the params have 5 \(layers/0/"
            r"weight \(8, 5\)\)\.",
        ):
            run(jnp.ones(7))
    with pytest.raises(sm.SignatureError, match=r"^MLP: the call's arguments do not fit"):
        h(jnp.ones(5), 3)


def test_a_matrix_product_of_the_params_alone_keeps_the_models_own_error():
    params = {"a": jnp.ones((2, 3)), "b": jnp.ones((4, 5))}
    h = sm.hybridize(lambda p, x: (p["a"] @ p["b"]).sum() * x, params)
    with pytest.raises(TypeError, match="dot_general requires contracting") as e:
        h(jnp.ones((2, 2)))
    assert not isinstance(e.value, sm.SymjaxError)


@pytest.mark.parametrize("kind", ["linen", "nnx", "fn"])
@pytest.mark.parametrize(
    ("args", "kwargs", "said"),
    [(3, {}, "too many positional arguments"), (0, {}, "missing a required argument: '{x}'"),
     (1, {"nope": 1}, "got an unexpected keyword argument 'nope'")],
)  # fmt: skip
def test_arguments_that_do_not_bind_to_the_models_inputs_are_named_with_its_inputs(
    kind, args, kwargs, said
):
    # each was Python's raw TypeError from inside flax or jax.jit ("__call__() takes 2 ...")
    x = jnp.ones((2, 5))
    if kind == "linen":
        net = sm.mlp((3,))
        h, name = sm.hybridize(net, net.init(jax.random.key(0), x)), "HybridSequential"
    elif kind == "nnx":
        h, name = sm.hybridize(nnx.Linear(5, 3, rngs=nnx.Rngs(0))), "Linear"
    else:
        h, name = sm.hybridize(lambda p, x: x @ p, jnp.ones((5, 3))), "<lambda>"
    inputs = "x" if kind != "nnx" else "inputs"
    for run in (h, h.eager):
        with pytest.raises(
            sm.SignatureError,
            match=rf"^{re.escape(name)}: the call's arguments do not fit the model's inputs "
            rf"\({inputs}.*\): {said.format(x=inputs)}\. Pass them as the model takes them",
        ):
            run(*[x] * args, **kwargs)


@pytest.mark.parametrize("path", ["call", "eager", "export"])
def test_an_input_of_width_zero_is_named_not_a_zero_division(path, tmp_path):
    # flax checks a param's shape with its initializer: lecun_normal divided by the width 0
    net, x = sm.mlp((16, 3)), jnp.ones((2, 8))
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    export = lambda a: sm.export(h, tmp_path / "a", example=a, batch=None)  # noqa: E731
    run = {"call": h, "eager": h.eager, "export": export}[path]
    with pytest.raises(
        sm.SignatureError,
        match=r"^HybridSequential: the inputs \(args\[0\]: float32\[2, 0\]\) have a dimension "
        r"of size 0 that a param's shape depends on",
    ):
        run(jnp.ones((2, 0)))
    assert h(jnp.ones((0, 8))).shape == (0, 3)  # an empty batch runs


def test_a_param_that_is_no_array_or_number_is_refused_by_path_when_made():
    # its first call was jax.jit's raw TypeError ('Error interpreting argument to
    # <function <lambda>_hybrid at 0x...> as an abstract array'), naming args[1][0]
    params = {"w": jnp.ones((8, 3)), "act": "relu"}
    with pytest.raises(sm.ConfigError, match=r"^<lambda>: params\['act'\] is a str, which a "):
        sm.hybridize(lambda p, x: x @ p["w"], params)
    h = sm.hybridize(lambda p, x: x @ p["w"], params, params_as_constants=True)
    assert h(jnp.ones((2, 8))).shape == (2, 3)  # baked in: the function reads it in Python
    # 2**70 was jit's raw OverflowError naming 'args[1]', a generator JAX's DeprecationWarning
    huge = r"^<lambda>: params\['n'\] is the Python int 1180591620717411303424, past int32's"
    for odd, said in ((2**70, huge), ((v for v in (1.0,)), r"params\['n'\] is a generator, ")):
        with pytest.raises(sm.ConfigError, match=said):
            sm.hybridize(lambda p, x: x * p["n"], {"n": odd})


def test_a_baked_python_int_past_jaxs_int_is_named_by_path_where_jax_converts_it():
    """Baked (params_as_constants=True), 2**70 was JAX's raw OverflowError ('argument path is
    y') at the first call; it is refused by path then, not when made: a model may use a baked
    int in Python arithmetic, which JAX never converts."""
    h = sm.hybridize(lambda p, x: x * p["n"], {"n": 2**70}, params_as_constants=True)
    said = (
        r"^<lambda>: params\['n'\] is the Python int 1180591620717411303424, past int32's range "
        r".*, which JAX could not make an array of where the model computed with it "
        r"\(OverflowError: .*\); baked in \(params_as_constants=True\), .* float\(\.\.\.\)"
    )
    for run in (h, h.eager):
        with pytest.raises(sm.ConfigError, match=said):
            run(jnp.ones(2))
    h = sm.hybridize(lambda p, x: x * (p["n"] // 2**60), {"n": 2**70}, params_as_constants=True)
    assert h(jnp.ones(2)).tolist() == [1024.0, 1024.0]  # Python's arithmetic: the model's
    # h.graph traces the params (every layer shown): JAX's raw OverflowError there, named now
    said = r"^<lambda>\.graph: params\['n'\] is the Python int 1180591620717411303424, past "
    with pytest.raises(sm.ConfigError, match=said) as caught:
        h.graph(jnp.ones(2))
    assert caught.value.__context__ is None  # (no OverflowError chained to it)


def test_apply_of_params_holding_a_generator_is_refused_by_path_without_jaxs_warning():
    # JAX's DeprecationWarning ("'generator' is treated as a leaf in PyTree", an error in a
    # later JAX, and under -W error) came first, from h.apply's check of the params' leaves
    h, x = sm.hybridize(lambda p, x: x * p["w"], {"w": jnp.float32(2)}), jnp.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (as pytest's config has it; a shown one may come first)
        odd = (v for v in (1.0,))
        for params, at in (({"w": odd}, r"\['w'\]"), ([iter([1.0])], r"\[0\]")):
            with pytest.raises(sm.ConfigError, match=rf"^<lambda>\.apply: params{at} is a \w+, "):
                h.apply(params, x)
    np.testing.assert_array_equal(h.apply({"w": jnp.float32(3)}, x), [3.0, 3.0])


def test_replace_of_params_none_is_refused_naming_what_to_pass():
    # it was taken: the next call raised the model's raw TypeError ("'NoneType' object is not
    # subscriptable"; an equinox model's, "unsupported operand type(s) for @"), as
    # hybridize(fn, None) is refused
    h = sm.hybridize(lambda p, x: x * p["w"], {"w": jnp.float32(2)}, name="dbl")
    with pytest.raises(
        sm.ConfigError,
        match=r"^dbl\.replace\(params=None\): got None, but a Hybrid's model is called with its "
        r"params\. Pass a tree shaped as h\.params .* a function that reads none takes \{\}\.$",
    ):
        h.replace(params=None)
    assert h.replace(params={"w": jnp.float32(3)})(jnp.ones(2)).tolist() == [3.0, 3.0]


@pytest.mark.parametrize(
    ("args", "kwargs", "said"),
    [(1, {}, "missing a required argument: 'b'"), (3, {}, "too many positional arguments"),
     (2, {"c": 1.0}, "got an unexpected keyword argument 'c'")],
)  # fmt: skip
def test_stage_given_arguments_that_do_not_bind_names_the_functions_inputs(args, kwargs, said):
    # each was Python's own TypeError from the user's function ("fn() missing 1 required ...")
    def fn(a, b):
        return a + b

    with pytest.raises(
        sm.SignatureError,
        match=rf"^stage\(fn\): the call's arguments do not fit fn's inputs \(a, b\): {said}\. "
        r"Pass them as fn takes them: stage\(fn\)\(a, b\)\.$",
    ):
        sm.stage(fn)(*[jnp.float32(1)] * args, **kwargs)
    with pytest.raises(sm.SignatureError, match=r"^stage\(Linear\): .* \(inputs.*\): missing"):
        sm.stage(nnx.Linear(5, 3, rngs=nnx.Rngs(0)))()
    assert sm.stage(fn)(jnp.float32(1), b=jnp.float32(2)).primitive_counts["add"] == 1


def test_stage_keeps_a_type_error_the_function_raises_itself():
    def fn(a):
        raise TypeError("mine")

    with pytest.raises(TypeError, match=r"^mine") as e:
        sm.stage(fn)(jnp.float32(1))
    assert not isinstance(e.value, sm.SymjaxError)


@pytest.mark.parametrize(
    ("bad", "said"), [(None, "None"), ("x", r"a str \('x'\)"), ({"a": 1}, r"a dict \(.*\)")]
)
@pytest.mark.parametrize("path", ["call", "eager", "apply"])
def test_an_input_that_is_no_array_is_named_not_called_a_scalar(bad, said, path):
    # h(None) and h("x") were Dense's "the input is a scalar (shape ())"
    net, x = sm.mlp((16, 3)), jnp.ones((2, 8))
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    run = {"call": h, "eager": h.eager, "apply": lambda a: net.apply(h.params, a)}[path]
    with pytest.raises(
        sm.SignatureError,
        match=rf"^symjax_mlp\.Dense\(16\): the input is {said}, not an array; a Dense layer maps "
        r"the last axis of an array\. Pass an array of shape \(batch, features\)",
    ):
        run(bad)
    with pytest.raises(sm.SignatureError, match=r"the input is a scalar \(shape \(\)\)"):
        run(3.0)  # a number is an array of no axes
    assert run(np.ones((1, 8))).shape == (1, 3)


@pytest.mark.filterwarnings("ignore:shape requires ndarray:DeprecationWarning")  # flax's, of None
@pytest.mark.parametrize("kind", ["linen", "nnx", "fn"])
def test_a_str_none_or_dict_where_an_array_goes_is_named_not_a_raw_flax_or_jax_error(kind):
    # h("abc") was flax's IndexError ('tuple index out of range'), nnx's TypeError ("Value
    # 'abc' with dtype <U3 is not a valid JAX array type") or Python's ("unsupported operand")
    import flax.linen as nn

    class TwoDense(nn.Module):  # as Flax's README writes a model
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.relu(nn.Dense(4)(x)))

    x = jnp.ones((2, 3))
    if kind == "linen":
        dense = lambda n, m: {"kernel": jnp.ones((n, m)), "bias": jnp.zeros(m)}  # noqa: E731
        h = sm.hybridize(TwoDense(), {"params": {"Dense_0": dense(4, 2), "Dense_1": dense(3, 4)}})
    elif kind == "nnx":
        h = sm.hybridize(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
    else:
        h = sm.hybridize(lambda p, x: x @ p, jnp.ones((3, 2)))
    bads = [
        ("abc", r"a Python str \('abc'\)"),
        (None, "None"),
        ({"a": x}, r"a Python dict \(keys \['a'\]\)"),
    ]
    runs = [(bad, run) for bad in bads for run in (h, h.eager)]
    runs += [(bads[0], lambda a: h.apply(h.params, a)), (bads[1], h.graph), (bads[2], h.compile)]
    for (bad, said), run in runs:
        with pytest.raises(
            sm.SignatureError,
            match=rf"^{re.escape(h.name)}: args\[0\] is {said}, not an array, and the model "
            r"raised on it \(\w+: .+\)\. If args\[0\] is data, pass an array",
        ):
            run(bad)
    assert h(x).shape == (2, 2) and h.trace_count == 1
    if kind == "fn":  # a number by keyword is a setting: the model's error is its own
        g = sm.hybridize(lambda p, x, n=1: x[:n] * p, jnp.float32(2))
        with pytest.raises(TypeError, match="cannot be interpreted as an integer") as e:
            g(x, n=1.0)
        assert not isinstance(e.value, sm.SymjaxError)
        with pytest.raises(sm.SignatureError, match=r"^<lambda>: kwargs\['n'\] is a Python str"):
            g(x, n="1")


@pytest.mark.parametrize("dtype", [object, str])
def test_a_numpy_array_of_str_or_objects_is_named_not_jits_error_on_the_programs_path(dtype):
    # h(df.values) of a table with a text column was jax.jit's TypeError naming
    # '<function <lambda>_hybrid at 0x...>' and its path args[2], or 'an input of type ndarray'
    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    bad = np.array([[1.5, "a"]], dtype=dtype)
    runs = [(h, "args[0]"), (h.eager, "args[0]"), (lambda a: h.apply(h.params, a), "args[0]")]
    runs += [(h.graph, "args[0]"), (lambda a: h(x=a), "kwargs['x']"), (lambda a: h((a,)), None)]
    for run, path in runs:
        path = re.escape(path or "args[0][0]")
        with pytest.raises(
            sm.SignatureError,
            match=rf"^<lambda>(\.eager|\.apply)?: input {path} is a NumPy array of dtype "
            rf"{re.escape(str(bad.dtype))}, which XLA cannot compute on",
        ):
            run(bad)
    with pytest.raises(sm.SignatureError) as e:
        h(bad)
    assert e.value.__suppress_context__  # jit's raw error on the program's path not shown
    assert h(bad[:, :1].astype(np.float32)).shape == (1, 1)


def test_params_and_an_input_committed_to_two_devices_are_named_with_the_fix():
    # jax.jit's ValueError naming the program's paths: 'args[1][0] of <lambda>_hybrid' (h.eager
    # and a hybridize(False) twin: JAX's 'incompatible devices ... argument y of multiply')
    d0, d1 = jax.devices()[:2]
    h = sm.hybridize(lambda p, x: x * p, jax.device_put(jnp.float32(2), d0))
    x = jax.device_put(jnp.ones(3), d1)
    for run in (h, lambda a: h.apply(h.params, a), lambda a: h(x=a), h.lower, h.eager,
                h.hybridize(False)):  # fmt: skip
        with pytest.raises(
            sm.ConfigError,
            match=r"^<lambda>(\.eager)?: a call's arrays are committed to two devices \(ids [01] "
            r"and [01], cpu\).*h\.replace\(params=jax\.device_put\(h\.params, device\)\)\.$",
        ) as e:
            run(x)
        assert e.value.__suppress_context__  # jit's raw error not shown
    assert h(jax.device_put(x, d0)).devices() == {d0}


def test_a_big_endian_array_as_a_fits_file_gives_it_is_refused_naming_the_cast(tmp_path):
    # h(x) of a '>f4' array was jax.jit's TypeError on the program's args[2] (or ran, once a
    # float32 call had traced: a wrong answer), export(example=x) JAX's "not a valid dtype ..."
    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    x = np.arange(3, dtype=">f4")
    said = r"input args\[0\] is a NumPy array of dtype >f4, which XLA cannot compute on \(its bytes"
    for run in (h, h.eager, lambda a: sm.export(h, tmp_path / "a", example=a, batch=None)):
        with pytest.raises(
            sm.SignatureError, match=said + r".*Convert it: x\.astype\(np\.float32\)"
        ):
            run(x)
    g = h.replace()  # traced on float32 first: jit's fast path took x, its bytes read as ours
    np.testing.assert_array_equal(g(x.astype(np.float32)), 2 * x)
    with pytest.raises(sm.SignatureError, match=said):  # was [0, 0, 0]
        g(x)
    with pytest.raises(sm.SignatureError, match=r"^<lambda>: params is a NumPy array of dtype >f4"):
        sm.hybridize(lambda p, x: x * p, x)  # its weights, as its first call's jit error
    np.testing.assert_array_equal(
        g.apply(2 * x.astype(np.float32), x.astype(np.float32)), 2 * x * x
    )
    with pytest.raises(sm.SignatureError, match=r"^<lambda>\.apply: params is a NumPy array"):
        g.apply(x, x.astype(np.float32))  # was [0., 0., 0.] (after the call above)


def test_a_list_input_is_told_to_pass_that_input_as_an_array_not_all_the_args():
    # the fix said "Pass jnp.asarray(args)" (the path cut at its first '['): all the inputs
    h = sm.hybridize(lambda p, x, y=None: x * p, jnp.float32(2))
    with pytest.raises(sm.SignatureError, match=r"Pass jnp\.asarray\(args\[0\]\), or a tuple"):
        h([[1.0, 2.0]])
    with pytest.raises(sm.SignatureError, match=r"Pass tuple\(kwargs\['y'\]\) to trace it"):
        h(jnp.ones(2), y=[jnp.ones(2)])


def test_the_trace_log_shows_in_a_cell_as_its_events_print():
    """``h.trace_log`` as a notebook cell's last line showed a tuple of TraceEvent reprs (every
    TensorSpec's fields, one long line); it shows what ``for e in h.trace_log: print(e)``
    prints (README), one trace a line, in IPython's display and repr alike."""
    from IPython.lib.pretty import pretty

    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    assert repr(h.trace_log) == "()"
    h(jnp.ones((1, 3)))
    h(jnp.ones((8, 3)))
    printed = "\n".join(str(e) for e in h.trace_log)
    assert printed.count("\n") == 1 and "args[0].shape changed from (1, 3) to (8, 3)" in printed
    assert pretty(h.trace_log) == repr(h.trace_log) == printed
    assert h.trace_log == tuple(h.trace_log) and h.trace_log[-1].index == 1


def test_a_call_with_settings_seen_before_takes_the_hot_path_and_answers_the_same(monkeypatch):
    """``h(x, train=False)`` (a linen model's flag) read its keywords on the slow path at every
    call, twice the time of ``h(x)``: a call whose settings (bools, strs, None) an earlier call
    gave goes straight to the program; a setting passed by place, or an int, still does not."""
    import flax.linen as nn

    from symjax_mlp._hybrid.staged import Staged

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False, scale=1):
            x = nn.Dropout(0.5, deterministic=not train)(nn.Dense(4)(x))
            return x * scale

    x, net = jnp.ones((2, 3)), Net()
    variables = net.init(jax.random.key(0), x)
    h = sm.hybridize(net, variables)
    read, partition = [], Staged._partition
    monkeypatch.setattr(Staged, "_partition", lambda *a, **k: read.append(1) or partition(*a, **k))
    want = net.apply(variables, x, train=False)
    for _ in range(3):
        chex.assert_trees_all_close(h(x, train=False), want)
    assert len(read) == 1 and h.trace_count == 1  # the first call's, then none
    chex.assert_trees_all_close(h(x, False), want)  # by place: read each call
    chex.assert_trees_all_close(h(x, False), want)
    assert len(read) == 3
    chex.assert_trees_all_close(h(x, train=False, scale=2), want * 2)  # an int: read each call
    chex.assert_trees_all_close(h(x, train=False, scale=True), want)  # not scale=1's entries
    assert len(read) == 5 and h.trace_count == 4
