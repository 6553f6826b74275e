"""Every feature over the model zoo: linen and nnx, flags, state, rng, several inputs, pytrees.

For each model: compiled == eager == plain Flax after N calls (same rng, same state), static
settings retrace with a reason, gradients through ``h.apply`` equal ``jax.grad`` of plain
Flax, and the eval-mode model exports and loads back.
"""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import ZOO, Case, NnxModes, keyless, pure_state, reference_calls, zoo_artifact

import symjax_mlp as sm

N = 3
TOL = {"rtol": 2e-5, "atol": 2e-5}
IDS = [c.name for c in ZOO]


def _assert_trees_close(a, b):
    chex.assert_trees_all_close(keyless(a), keyless(b), **TOL)


@pytest.mark.parametrize("case", ZOO, ids=IDS)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_compiled_equals_eager_equals_plain_flax(case: Case, mode: str):
    settings = case.train if mode == "train" else case.eval
    want, want_state = reference_calls(case, N, settings)
    compiled, eager = case.hybridize(), case.hybridize()
    got = [compiled(*case.inputs(i), **settings) for i in range(N)]
    got_eager = [eager.eager(*case.inputs(i), **settings) for i in range(N)]
    _assert_trees_close(got, want)
    _assert_trees_close(got_eager, want)
    if want_state is not None and jax.tree.leaves(pure_state(want_state)):
        _assert_trees_close(compiled.state, want_state)
        _assert_trees_close(eager.state, want_state)
    assert compiled.trace_count == 1  # one signature, one setting: one trace for N calls
    assert compiled.stateful == case.stateful


@pytest.mark.parametrize("case", [c for c in ZOO if c.stateful and c.train], ids=lambda c: c.name)
def test_state_moves_in_train_mode(case: Case):
    h = case.hybridize()
    before = jax.tree.map(np.asarray, jax.tree.leaves(keyless(h.state)))
    first = h(*case.inputs(0), **case.train)
    second = h(*case.inputs(0), **case.train)  # same input: only the state differs
    after = jax.tree.map(np.asarray, jax.tree.leaves(keyless(h.state)))
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    if "dropout" in case.name:  # a new mask on every call, as eager Flax draws one
        assert not np.allclose(np.asarray(first), np.asarray(second))


@pytest.mark.parametrize("case", [c for c in ZOO if "dropout" in c.name], ids=lambda c: c.name)
def test_a_hybrid_draws_the_same_bits_with_threefry_unrolled(case: Case):
    """A Hybrid's programs lower threefry unrolled, with no ``while`` loop (JAX's CPU default
    is a rolled loop); ``jax.jit`` of the very same function outside a Hybrid still lowers as
    JAX does, and both draw the same masks."""
    h = case.hybridize()
    x = case.inputs(0)
    before = h.variables
    assert "stablehlo.while" not in h.lower(*x, **case.train).as_text()
    assert " while(" not in h.compile(*x, **case.train).as_text()  # XLA's optimized HLO
    plain = jax.jit(lambda variables, *a: h.fn(variables, *a, **case.train))
    if jax.default_backend() == "cpu":
        assert "stablehlo.while" in plain.lower(before, *x).as_text()
        assert " while(" in plain.lower(before, *x).compile().as_text()
    _assert_trees_close(h(*x, **case.train), plain(before, *x))


def test_the_nnx_module_reads_back_with_its_state():
    case = next(c for c in ZOO if c.name == "nnx_batchnorm")
    h = case.hybridize()
    for i in range(N):
        h(*case.inputs(i), train=True)
    module = h.module
    assert isinstance(module, nnx.Module)
    _, want_state = reference_calls(case, N, case.train)
    _assert_trees_close(nnx.state(module, nnx.Not(nnx.Param)), want_state)
    # the module read back computes what h computes
    x = case.inputs(9)[0]
    chex.assert_trees_all_close(module(x, train=False), h(x, train=False), **TOL)


def _switch(module, mode: str) -> None:
    module.train() if mode == "train" else module.eval()


def test_nnx_train_and_eval_switch_the_hybrid_as_they_switch_the_module():
    """nnx's own switch, ``module.train()`` / ``module.eval()`` after hybridize: each call
    runs in the module's mode as the plain module does, one trace per mode (flipping back
    reuses it), and the retrace names the attributes that changed."""
    model, ref = NnxModes(nnx.Rngs(0, dropout=7)), NnxModes(nnx.Rngs(0, dropout=7))
    h = sm.hybridize(model)
    modes = ["train", "train", "eval", "train", "eval", "eval"]
    for i, mode in enumerate(modes):
        _switch(model, mode), _switch(ref, mode)
        x = jax.random.normal(jax.random.key(i), (4, 5))
        _assert_trees_close(h(x), ref(x))
    _assert_trees_close(h.state, nnx.state(ref, nnx.Not(nnx.Param)))  # stats moved 3 times
    assert h.trace_count == 2
    reason = h.trace_log[1].reason
    assert "module.norm/use_running_average (static) changed from False to True" in reason
    assert "module.drop/deterministic (static) changed from False to True" in reason
    assert "deterministic=True" in str(h.trace_log[1]) and "use_bias" not in str(h.trace_log[1])
    # the other paths follow the module too: eager, apply, and a module read back
    x = jax.random.normal(jax.random.key(9), (4, 5))
    model.train(), ref.train()
    _assert_trees_close(h.eager(x), ref(x))
    model.eval(), ref.eval()
    out, _ = h.apply(h.params, x)
    _assert_trees_close(out, ref(x))
    _assert_trees_close(h.module(x), ref(x))
    assert h.trace_count == 3  # apply traced once, in eval mode
    # one module's attribute, as set_attributes sets it
    model.set_attributes(nnx.Dropout, deterministic=False)
    h(x)
    assert h.trace_log[-1].reason == (
        "module.drop/deterministic (static) changed from True to False"
    )


def test_an_nnx_module_exports_in_the_mode_it_is_in(tmp_path):
    model, ref = NnxModes(nnx.Rngs(0, dropout=7)), NnxModes(nnx.Rngs(0, dropout=7))
    h = sm.hybridize(model)
    x = jax.random.normal(jax.random.key(1), (4, 5))
    h(x)  # a training call first: its trace must not be what export reuses
    ref(x)
    assert h.training_mode(x) == ("drop/deterministic=False", "norm/use_running_average=False")
    with pytest.raises(sm.ConfigError, match=r"training mode \(drop/deterministic=False, norm/"):
        sm.export(h, tmp_path / "m", example=x, batch="b")  # as built: nnx's training mode
    assert not (tmp_path / "m").exists()
    model.eval(), ref.eval()
    assert h.training_mode(x) == ()
    sm.export(h, tmp_path / "m", example=x, batch="b")
    loaded = sm.load(tmp_path / "m")
    _assert_trees_close(loaded(x), ref(x))
    _assert_trees_close(loaded(x), loaded(x))  # no dropout: the same answer twice


@pytest.mark.parametrize("case", ZOO, ids=IDS)
def test_only_a_module_held_in_training_mode_is_in_training_mode(case: Case):
    """The zoo's models are switched by call flags (or are in eval mode): whatever their
    Dropout's and BatchNorm's attributes say, the flag decides, so none is held."""
    h = case.hybridize()
    assert h.training_mode(*case.inputs(0), **case.eval) == ()
    assert h.training_mode(*case.inputs(0), **case.train) == ()


def test_a_linen_dropout_without_rng_streams_says_how_to_give_them():
    case = next(c for c in ZOO if c.name == "linen_dropout")
    model, variables = case.build()
    h = sm.hybridize(model, variables)  # no rngs=
    with pytest.raises(sm.ConfigError, match=r'LinenDropout: .*"dropout".*rngs=jax.random.key'):
        h(*case.inputs(0), **case.train)
    assert h.trace_count == 0


def test_a_static_setting_retraces_with_its_name_and_values():
    case = next(c for c in ZOO if c.name == "linen_batchnorm")
    h = case.hybridize(max_traces=2)
    x = case.inputs(0)[0]
    h(x, train=True)
    h(x, train=True)
    h(x, train=False)
    assert h.trace_count == 2
    assert h.trace_log[1].reason == "kwargs['train'] (static) changed from True to False"
    with pytest.raises(sm.RetraceError, match=r"kwargs\['depth'\] \(static\)"):
        h(x, train=False, depth=1)  # counts against the budget like any retrace


def test_positional_int_and_str_settings_are_static():
    h = sm.hybridize(lambda p, x, n, mode: x * n if mode == "mul" else x + n, {})
    x = jnp.ones(2)
    assert np.array_equal(h(x, 3, "mul"), [3.0, 3.0])
    assert np.array_equal(h(x, 3, "add"), [4.0, 4.0])
    assert h.trace_count == 2
    assert "args[2] (static) changed from 'mul' to 'add'" in h.trace_log[1].reason


def test_settings_python_calls_equal_but_of_other_types_are_traced_apart():
    """4 == 4.0 == True in Python (and they hash alike), so h(x, 4.0) once ran the program
    traced for h(x, 4): integer division where eager divides, an int where eager gives a
    bool, and no retrace logged."""
    k = sm.hybridize(lambda p, x, d: jnp.arange(6) // d if isinstance(d, int) else x / d, {})
    x = jnp.arange(6.0)
    assert k(x, 4).tolist() == [0, 0, 0, 0, 1, 1]
    np.testing.assert_array_equal(k(x, 4.0), k.eager(x, 4.0))
    assert k(x, 4.0).tolist() == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]
    assert k.trace_count == 2 and "changed from 4 to 4.0" in k.trace_log[1].reason
    g = sm.hybridize(lambda p, x, n: jnp.full((2,), n), {})
    assert g(x, 1).dtype == jnp.int32 and g(x, True).dtype == jnp.bool_
    t = sm.hybridize(lambda p, x, pair: jnp.asarray(pair), {})  # types inside a tuple, too
    assert t(x, (1, 2.0)).dtype == jnp.float32 and t(x, (1, 2)).dtype == jnp.int32
    assert k(x, 4).tolist() == [0, 0, 0, 0, 1, 1] and k.trace_count == 2  # cached, both


def test_the_trace_log_names_each_input_at_its_place_in_the_call():
    """Traced inputs were numbered among the traced ones only: in h(x, 3, y), y showed as
    args[1] (the static setting's place) and a change of y as "args[1].shape changed"."""
    h = sm.hybridize(lambda p, x, n, y: x * n + y.sum(), {})
    h(jnp.ones(2), 3, jnp.ones(4))
    h(jnp.ones(2), 3, jnp.ones(5))
    first, second = h.trace_log
    assert [s.path for s in first.signature] == ["args[0]", "args[2]"]
    assert second.reason == "args[2].shape changed from (4,) to (5,)"
    forced = sm.hybridize(lambda p, x, y: x + y, {}, static_argnums=0)
    forced(jnp.ones(2), jnp.ones(2))
    assert [s.path for s in forced.trace_log[0].signature] == ["args[1]"]


def test_static_options_of_the_wrong_kind_are_config_errors():
    """static_argnums=-1 (or "x") once selected nothing, in silence; 1.5 or None raised
    "'float' object is not iterable"."""
    fn = lambda p, x, m: x * m  # noqa: E731
    for bad in (-1, "x", 1.5, None, (0, True)):
        with pytest.raises(sm.ConfigError, match=r"static_argnums=.*ints from 0"):
            sm.hybridize(fn, {}, static_argnums=bad)
    for bad in (1, ("mode", 2), "not a name"):
        with pytest.raises(sm.ConfigError, match=r"static_argnames=.*keyword's name"):
            sm.hybridize(fn, {}, static_argnames=bad)
    h = sm.hybridize(fn, {}, static_argnums=[1], static_argnames="m")  # a list, a name: fine
    assert h.static_argnums == frozenset({1}) and h.static_argnames == frozenset({"m"})


def test_static_argnums_force_an_array_static():
    def f(p, x, table):
        return x * int(table[0])  # needs the concrete value of `table`

    h = sm.hybridize(f, {}, static_argnums=1)  # args[1] of the call, as the trace log names it
    assert np.array_equal(h(jnp.ones(2), np.array([4])), [4.0, 4.0])
    with pytest.raises(sm.ControlFlowError):
        sm.hybridize(f, {})(jnp.ones(2), np.array([4]))


def test_static_argnames_hold_for_an_input_passed_by_place_too():
    """static_argnames=("table",) was honoured only for table=...: h(x, table) traced the
    array, and int(table[0]) raised ControlFlowError. As in jax.jit, the model's signature now
    maps names to places and back, for a function, a linen and an nnx module."""

    def f(p, x, table):
        return x * int(table[0])

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x, table):
            return x * int(table[0])

    class Nnx(nnx.Module):
        def __call__(self, x, table):
            return x * int(table[0])

    x = jnp.ones((1, 2))
    for h in (
        sm.hybridize(f, {}, static_argnames="table"),
        sm.hybridize(Linen(), {"params": {}}, static_argnames="table"),
        sm.hybridize(Nnx(), static_argnames="table"),
        sm.hybridize(f, {}, static_argnums=1),  # and a place is static when passed by name
    ):
        assert h.static_argnums == {1} and h.static_argnames == {"table"}
        assert np.array_equal(h(x, np.array([4])), [[4.0, 4.0]])
        assert np.array_equal(h(x, table=np.array([3])), [[3.0, 3.0]])
    with pytest.raises(sm.ConfigError, match=r"names \['tabel'\].*inputs are \(x, table\)"):
        sm.hybridize(f, {}, static_argnames="tabel")
    loose = sm.hybridize(lambda p, x, **kw: x * int(kw["t"][0]), {}, static_argnames="t")
    assert np.array_equal(loose(x, t=np.array([2])), [[2.0, 2.0]])  # **kwargs: any name


def test_kwargs_arrays_are_traced():
    h = sm.hybridize(lambda p, x, mask=None: x if mask is None else x * mask, {})
    x = jnp.ones(3)
    assert np.array_equal(h(x, mask=jnp.array([1.0, 0.0, 1.0])), [1.0, 0.0, 1.0])
    assert np.array_equal(h(x, mask=jnp.array([0.0, 0.0, 1.0])), [0.0, 0.0, 1.0])
    assert h.trace_count == 1
    assert [s.path for s in h.trace_log[0].signature] == ["args[0]", "kwargs['mask']"]


@pytest.mark.parametrize("case", ZOO, ids=IDS)
def test_grad_through_apply_equals_plain_flax(case: Case):
    model, params = case.build()
    h = case.hybridize()
    xs, settings = case.inputs(0), case.train if not case.stateful else case.eval

    def loss_h(p):
        out = h.apply(p, *xs, **settings)
        out = out[0] if h.stateful else out
        return sum(jnp.sum(o**2) for o in jax.tree.leaves(out))

    got = jax.grad(loss_h)(h.params)
    assert jax.tree.structure(got) == jax.tree.structure(h.params)
    # plain Flax's grads, jitted (op by op, each op compiled alone, they cost a third more)
    if case.kind == "nnx":
        graphdef, p, rest = nnx.split(model, nnx.Param, ...)

        def loss_ref(p):
            out = nnx.merge(graphdef, p, rest)(*xs, **settings)
            return sum(jnp.sum(o**2) for o in jax.tree.leaves(out))

        want = nnx.to_pure_dict(jax.jit(jax.grad(loss_ref))(p))
    elif case.kind == "linen":
        collections = {c: v for c, v in params.items() if c != "params"}

        def loss_ref(p):
            out = model.apply({**p, **collections}, *xs, **settings)
            return sum(jnp.sum(o**2) for o in jax.tree.leaves(out))

        want = jax.jit(jax.grad(loss_ref))({"params": params["params"]})
    else:

        def loss_ref(p):
            return sum(jnp.sum(o**2) for o in jax.tree.leaves(model(p, *xs, **settings)))

        want = jax.jit(jax.grad(loss_ref))(params)
    chex.assert_trees_all_close(got, want, **TOL)
    assert any(e.entry == "apply" for e in h.trace_log)


def test_apply_returns_the_new_state_of_a_stateful_model_and_holds_nothing():
    case = next(c for c in ZOO if c.name == "linen_batchnorm")
    h = case.hybridize()
    x = case.inputs(0)[0]
    model, variables = case.build()
    before = jax.tree.leaves(h.state)  # (h.state is a new dict at each read: its arrays held)
    out, new = h.apply(h.params, x, train=True)
    assert all(a is b for a, b in zip(jax.tree.leaves(h.state), before, strict=True))  # held
    ref_out, ref_updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    chex.assert_trees_all_close(out, ref_out, **TOL)
    chex.assert_trees_all_close(new["batch_stats"], ref_updates["batch_stats"], **TOL)
    # the pure form chains: feeding the new state back gives the second step
    out2, _ = h.apply_with_state(h.params, new, x, train=True)
    ref2, _ = model.apply({**variables, **ref_updates}, x, train=True, mutable=["batch_stats"])
    chex.assert_trees_all_close(out2, ref2, **TOL)


def test_optax_drives_apply():
    import optax

    case = next(c for c in ZOO if c.name == "linen_two_inputs")
    h = case.hybridize()
    xs = case.inputs(0)
    opt = optax.sgd(0.1)
    params, state = h.params, opt.init(h.params)

    def loss(p):
        return jnp.mean(h.apply(p, *xs) ** 2)

    first = loss(params)
    for _ in range(5):
        grads = jax.grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    assert loss(params) < first
    assert h.trace_count <= 2  # the grad trace and the plain one: not one per step


def test_grad_vmap_and_outer_jit_over_a_stateless_hybrid(chapter):
    _, _, h, x = chapter
    g = jax.grad(lambda x: h(x).sum())(x)
    assert g.shape == x.shape and np.isfinite(np.asarray(g)).all()
    xs = jnp.stack([x[0]] * 5)[:, None, :]
    chex.assert_trees_all_close(jax.vmap(h)(xs)[:, 0], h(xs[:, 0]), **TOL)
    chex.assert_trees_all_close(jax.jit(lambda x: h(x) * 2)(x), h(x) * 2, **TOL)


def test_a_stateful_hybrid_under_jit_says_to_use_apply():
    case = next(c for c in ZOO if c.name == "nnx_batchnorm")
    h = case.hybridize()
    with pytest.raises(sm.ControlFlowError, match=r"h\.apply\(h\.params, x\)"):
        jax.jit(lambda x: h(x, train=True))(case.inputs(0)[0])


def test_donate_reuses_the_state_buffers():
    case = next(c for c in ZOO if c.name == "linen_batchnorm")
    h = case.hybridize(donate=True)
    old = jax.tree.leaves(h.state)[0]
    h(*case.inputs(0), train=True)
    h(*case.inputs(1), train=True)
    assert old.is_deleted()  # the first call's input state was donated to XLA
    _, want = reference_calls(case, 2, case.train)
    _assert_trees_close(h.state, want)  # donation changes buffers, not results
    assert h.trace_count == 1


def _deleted(tree) -> list[str]:
    leaves = jax.tree_util.tree_leaves_with_path(pure_state(tree))
    return [jax.tree_util.keystr(path) for path, leaf in leaves if leaf.is_deleted()]


@pytest.mark.parametrize("case", [c for c in ZOO if c.stateful], ids=lambda c: c.name)
def test_donate_consumes_only_buffers_the_hybrid_made(case: Case):
    model, variables = case.build()
    if case.kind == "nnx":
        given, h = nnx.state(model), sm.hybridize(model, donate=True)
    else:
        given = {"variables": variables, "rngs": case.rng}
        h = sm.hybridize(model, variables, rngs=case.rng, donate=True)
    held = jax.tree.leaves(pure_state(h.state))
    module = h.module  # an nnx module built from the state: it outlives the next call
    for i in range(N):
        h(*case.inputs(i), **case.train)
    assert any(leaf.is_deleted() for leaf in held)  # the Hybrid's own state was donated
    assert _deleted(given) == []  # the caller's variables, keys and nnx module were not
    _, want_state = reference_calls(case, N, case.train)
    _assert_trees_close(h.state, want_state)
    # the caller's model still runs on its own untouched variables, as plain Flax
    x = case.inputs(0)
    fresh, _ = reference_calls(case, 1, case.eval)
    if case.kind == "nnx":
        _assert_trees_close(model(*x, **case.eval), fresh[0])
        _assert_trees_close(module(*x, **case.eval), fresh[0])  # built before the calls
    else:
        _assert_trees_close(model.apply(variables, *x, **case.eval), fresh[0])


def test_apply_of_a_donating_hybrid_consumes_nothing_it_is_given():
    case = next(c for c in ZOO if c.name == "linen_batchnorm")
    h, plain = case.hybridize(donate=True), case.hybridize()
    x = case.inputs(0)[0]
    out, state = h.apply(h.params, x, train=True)  # the README's pure form
    h.apply_with_state(h.params, state, x, train=True)  # consumes neither
    assert _deleted(h.params) == [] and _deleted(state) == [] and _deleted(h.state) == []
    want, want_state = plain.apply(plain.params, x, train=True)
    chex.assert_trees_all_close((out, state), (want, want_state), **TOL)
    chex.assert_trees_all_close(h(x, train=True), plain(x, train=True), **TOL)  # h still runs
    twin = h.replace(donate=False)  # holds a copy, not the buffers h's next call consumes
    h(x, train=True)
    chex.assert_trees_all_close(twin(x, train=True), want, **TOL)


def test_a_hybrid_is_frozen_and_replace_stays_in_sync(chapter):
    _, variables, h, x = chapter
    with pytest.raises(AttributeError, match=r"h = h\.replace\(params=\.\.\.\)"):
        h.params = variables
    doubled = jax.tree.map(lambda a: a * 2, variables)
    h2 = h.replace(params=doubled)
    chex.assert_trees_all_close(h2(x), h2.eager(x), **TOL)
    assert not np.allclose(np.asarray(h2(x)), np.asarray(h(x)))
    with pytest.raises(TypeError, match="not a setting"):
        h.replace(weights=doubled)


def test_a_failed_trace_is_neither_counted_nor_logged(chapter):
    _, _, h, x = chapter
    h = h.replace(max_traces=1)
    with pytest.raises(sm.SignatureError, match="511"):
        h(jnp.ones((1, 511)))  # wrong width: refused while tracing
    assert h.trace_count == 0
    h(x)
    assert h.trace_count == 1 and h.trace_log[0].reason == "first call"


def test_reason_is_against_the_nearest_earlier_trace():
    h = sm.hybridize(lambda p, x: x * 2, {})
    h(jnp.ones((1, 3)))
    h(jnp.ones((5, 4), jnp.int32))
    h(jnp.ones((5, 4)))  # one change from the second trace, two from the first
    assert h.trace_log[2].reason == "args[0].dtype changed from int32 to float32"
    h(jnp.ones((5, 4), jnp.int32))
    assert h.trace_count == 3  # a cache hit: no fourth trace


def test_a_python_list_is_refused_as_an_input_type(chapter):
    _, _, h, _ = chapter
    with pytest.raises(sm.SignatureError, match=r"args\[0\] is a Python list.*jnp\.asarray"):
        h([[1.0] * 512])


def test_data_dependent_shapes_are_control_flow_errors_with_the_fix():
    take = sm.hybridize(lambda p, x, n: x[: int(n)], {})
    with pytest.raises(sm.ControlFlowError, match="static size"):
        take(jnp.ones(5), jnp.asarray(2))
    nonzero = sm.hybridize(lambda p, x: jnp.nonzero(x)[0], {})
    with pytest.raises(sm.ControlFlowError, match=r"jnp\.nonzero\(x, size=k\)"):
        nonzero(jnp.ones(5))
    with pytest.raises(sm.ControlFlowError):
        sm.stage(lambda x: jnp.nonzero(x)[0])(jnp.ones(5))


@pytest.mark.parametrize("case", ZOO, ids=IDS)
def test_stage_and_graph_take_the_same_arguments(case: Case):
    h = case.hybridize()
    g = h.graph(*case.inputs(0), **case.eval)
    assert g.name == h.name and g.primitive_counts
    assert h.trace_count == 0


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(case) -> (Hybrid, Artifact)``: the case's eval-mode model, exported once in
    the run for the two tests below that load it and tests/test_iree.py's (by whichever
    pytest-xdist worker comes first: each builds its Hybrid from the same seeds)."""
    done = {}

    def export(case: Case):
        if case.name not in done:
            h = case.hybridize()
            done[case.name] = h, sm.inspect(zoo_artifact(tmp_path_factory, case, h))
        return done[case.name]

    return export


@pytest.mark.parametrize("case", ZOO, ids=IDS)
def test_export_and_load_in_eval_mode(case: Case, exported, tmp_path):
    xs = case.inputs(0)
    if case.name == "linen_dict":  # an artifact's inputs are positional arrays: refused clearly
        with pytest.raises(sm.SignatureError, match=r"args\[0\] is a dict"):
            sm.export(case.hybridize(), tmp_path / case.name, example=xs)
        assert not (tmp_path / case.name).exists()
        return
    arrays = tuple(x for x in xs if hasattr(x, "shape"))
    h, art = exported(case)
    m = sm.load(art.path)
    want = h(*xs, **case.eval)
    chex.assert_trees_all_close(m(*arrays), want, **TOL)
    baked = sm.load(art.path, params_as_constants=True)  # the weights compiled in
    chex.assert_trees_all_close(baked(*arrays), want, **TOL)
    # the same model as the second entry point of a two-entry artifact: one weight file
    two = sm.export({"first": h, "second": h}, tmp_path / "two", example=xs, kwargs=case.eval)
    assert [p.path for p in two.params] == [p.path for p in art.params]
    chex.assert_trees_all_close(sm.load(two.path)["second"](*arrays), want, **TOL)


@pytest.mark.parametrize("case", [c for c in ZOO if c.name != "linen_dict"], ids=lambda c: c.name)
def test_a_batcher_serves_each_exported_model_row_for_row(case: Case, exported):
    """Each zoo model's artifact (eval mode) behind a Batcher: blocking calls, futures and
    asyncio requests (one at a time, run on the loop, and gathered, run as one batch) of 1-3
    rows each get the rows the artifact gives them alone; a baked load (params as constants,
    what ``symjax-mlp serve --params-as-constants`` serves) as well."""
    import asyncio

    path = exported(case)[1].path
    m = sm.load(path)
    arrays = [np.asarray(x) for x in case.inputs(0) if hasattr(x, "shape")]
    requests = [[a[i:j] for a in arrays] for i, j in ((0, 1), (1, 4), (2, 4), (3, 4))]
    wants = [m(*r) for r in requests]

    async def awaited(b):
        alone = [await b.asubmit(*r) for r in requests]  # one at a time: each on the loop
        return alone + await asyncio.gather(*(b.asubmit(*r) for r in requests))  # batched

    for served in (m, sm.load(path, params_as_constants=True)):
        with sm.serving.Batcher(served, max_batch=4) as b:
            got = [b(*requests[0])]
            got += [f.result(30) for f in [b.submit(*r) for r in requests[1:]]]
            got += asyncio.run(awaited(b))
        for want, y in zip(wants * 3, got, strict=True):
            chex.assert_trees_all_close(y, want, **TOL)


def test_a_call_that_changes_the_state_structure_says_to_use_apply():
    import flax.linen as nn

    class Sows(nn.Module):
        @nn.compact
        def __call__(self, x):
            self.sow("intermediates", "h", x)  # one more leaf per call
            return nn.Dense(2)(x)

    model, x = Sows(), jnp.ones((1, 3))
    variables = model.init(jax.random.key(0), x, mutable=True)  # with "intermediates"
    h = sm.hybridize(model, variables, mutable=["intermediates"])
    with pytest.raises(sm.ConfigError, match=r"structure of the model's state(.|\n)*h\.apply"):
        h(x)
    _, state = h.apply(h.params, x)  # the pure form returns the state the call made
    assert len(state["intermediates"]["h"]) == 2


@pytest.mark.parametrize("case", ZOO, ids=IDS)
def test_params_as_constants_calls_equal_plain_flax_and_pass_no_params(case: Case):
    want, want_state = reference_calls(case, N, case.train)
    baked, plain = case.hybridize(params_as_constants=True), case.hybridize()
    got = [baked(*case.inputs(i), **case.train) for i in range(N)]
    _assert_trees_close(got, want)
    if want_state is not None and jax.tree.leaves(pure_state(want_state)):
        _assert_trees_close(baked.state, want_state)  # the state still moves, as an input
    passed = len(jax.tree.leaves(baked.lower(*case.inputs(0), **case.train).args_info))
    unbaked = len(jax.tree.leaves(plain.lower(*case.inputs(0), **case.train).args_info))
    assert passed == unbaked - len(jax.tree.leaves(plain.params))  # no param is an input
    assert baked.replace(name="again").params_as_constants and baked.trace_count == 1


def test_params_as_constants_cannot_be_sharded(chapter):
    _, _, h, x = chapter
    baked = h.replace(params_as_constants=True)
    with pytest.raises(sm.ConfigError, match=r"h.replace\(params_as_constants=False\).shard"):
        baked.shard()
    np.testing.assert_array_equal(baked(x), h(x))  # and unsharded, the same numbers


def test_settings_of_the_wrong_type_are_config_errors():
    """h.hybridize("no") compiled (a truthy string), replace(pad="x") and donate="x" passed,
    name=3 raised "__name__ must be set to a string object" deep inside."""
    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    for call, setting in (
        (lambda: h.hybridize("no"), "compiled"),
        (lambda: h.replace(compiled=1), "compiled"),
        (lambda: h.replace(pad="x"), "pad"),
        (lambda: h.replace(donate="x"), "donate"),
        (lambda: h.replace(params_as_constants=0), "params_as_constants"),
        (lambda: h.replace(name=3), "name"),
        (lambda: h.shard(axis=3), "axis"),
        (lambda: sm.hybridize(lambda p, x: x, {}, donate="yes"), "donate"),
    ):
        with pytest.raises(sm.ConfigError, match=rf"^{setting} must be a (bool|str); got "):
            call()
    assert h.hybridize(False).compiled is False and h.replace(name="m").name == "m"


def test_a_retrace_on_a_large_static_array_says_which_array_changed():
    """Two static arrays that NumPy prints alike (``[0., 0., 0., ..., 0.]``) read as "same
    signature traced again": the reason compared printed forms."""
    h = sm.hybridize(lambda p, x, table: x * float(table[-1]), {}, static_argnums=1)
    a, b = np.zeros(2000, np.float32), np.zeros(2000, np.float32)
    b[1000] = 1.0  # a different array, printed alike
    h(jnp.ones(2), a)
    h(jnp.ones(2), b)
    h(jnp.ones(2), np.array([3.0]))
    reason = h.trace_log[1].reason
    assert reason.startswith("args[1] (static) changed from array(shape=(2000,), dtype=float32")
    assert reason.count("sha256=") == 2 and len(set(reason.split("sha256=")[1:])) == 2
    assert "changed from" in h.trace_log[2].reason and "array([3.]" in h.trace_log[2].reason
