"""How many times ``sm.export`` runs the model's Python (session 64). The chapter's point of a
hybridized block: its ``print`` runs on the tracing call only. An export ran it three times
(the symbolic batch, a trace with each input's weak type flipped, the self-test's model at the
example's shapes). At static shapes the self-test now uses export's own trace: twice, export's
and the weak types' (which no dtype of the program can stand in for: the model's Python may
pick a dtype from an input's kind); a symbolic batch runs it a third time at the example's
shapes, where the self-test checks the program against the model (sm.export's docstring lists
what else runs it again). Each artifact is the same, byte for byte, as before."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import symjax_mlp as sm

pytestmark = pytest.mark.slow  # exports: ~0.5 s each


@pytest.fixture(scope="module")
def mlp():
    """The chapter's MLP on rows of 16 (variables, x)."""
    net = sm.mlp((32, 2))
    x = jax.random.normal(jax.random.key(0), (2, 16), jnp.float32)
    return net, net.init(jax.random.key(1), x), x


def _printing(net, shapes):
    def model(variables, x):
        print("traced at", x.shape)  # the chapter's print: a Python side effect of each trace
        shapes.append(x.shape)
        return net.apply(variables, x)

    return model


def test_a_static_export_runs_the_models_python_twice(tmp_path, mlp, capsys):
    net, variables, x = mlp
    shapes = []
    h = sm.hybridize(_printing(net, shapes), variables)
    art = sm.export(h, tmp_path / "m", example=x, batch=None)
    assert shapes == [(2, 16)] * 2  # export's, the weak type's (it ran 3 times)
    assert capsys.readouterr().out.count("traced at") == 2
    np.testing.assert_allclose(sm.load(art.path)(x), h(x), rtol=1e-6)  # (h's own trace)


def test_chex_assert_max_traces_holds_over_a_static_export(tmp_path, mlp):
    import chex

    net, variables, x = mlp
    twice = chex.assert_max_traces(lambda v, x: net.apply(v, x), n=2)
    sm.export(sm.hybridize(twice, variables), tmp_path / "m", example=x, batch=None)
    # (it raised "Function '<lambda>' is traced > 2 times!" from the self-test's trace)
    thrice = chex.assert_max_traces(lambda v, x: net.apply(v, x), n=3)
    sm.export(sm.hybridize(thrice, variables), tmp_path / "b", example=x)  # a symbolic batch


def test_a_symbolic_batch_runs_it_again_at_the_examples_shapes(tmp_path, mlp, capsys):
    net, variables, x = mlp
    shapes = []
    sm.export(sm.hybridize(_printing(net, shapes), variables), tmp_path / "m", example=x)
    assert len(shapes) == 3 and capsys.readouterr().out.count("traced at") == 3
    assert not isinstance(shapes[0][0], int)  # jax.export's trace, at the symbolic batch
    assert shapes[2] == (2, 16)  # the self-test's model, where a branch on a shape shows


def test_a_weak_scalar_is_traced_flipped_only_where_its_dtypes_can_change(tmp_path, mlp):
    """A float32 model answers a weak 2.0 and np.float32(2.0) alike: traced flipped (a scalar
    is, whatever its trace's dtypes: the model's Python may pick a dtype by its kind), and not
    recorded weak. A bfloat16 model answers them in bfloat16 and float32: traced flipped, the
    input recorded weakly typed (format 3)."""
    net, variables, x = mlp
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16), variables)
    opts = {"shapes": ("b, ...", None)}
    cases = [(variables, x, 4, None), (half, x.astype(jnp.bfloat16), 3, True)]  # (x flipped too)
    for params, rows, traces, weak in cases:
        shapes = []

        def model(p, x, s, shapes=shapes):
            shapes.append(x.shape)
            return net.apply(p, x) * s

        h = sm.hybridize(model, params)
        art = sm.export(h, tmp_path / str(weak), example=(rows, jnp.asarray(2.0)), **opts)
        assert len(shapes) == traces
        scale = art.manifest["signature"]["inputs"][1]
        assert scale.get("weak_type") is weak
        m = sm.load(art.path)
        assert m(rows, 2.0).dtype == h(rows, jnp.asarray(2.0)).dtype


def test_the_static_self_test_compares_the_program_with_the_models_trace(
    tmp_path, mlp, monkeypatch
):
    """With one trace, the model's answers at the example's shapes are that trace's, run by
    jit, not the exported program's answers to itself: a program that answers otherwise (here
    every exported program, shifted by one) is refused, as a retrace refused it."""
    net, variables, x = mlp
    call = jax.export.Exported.call

    def shifted(self, *args, **kwargs):
        return jax.tree.map(lambda y: y + 1, call(self, *args, **kwargs))

    monkeypatch.setattr(jax.export.Exported, "call", shifted)
    h = sm.hybridize(lambda v, x: net.apply(v, x), variables)
    with pytest.raises(sm.SignatureError, match="does not give the model's results"):
        sm.export(h, tmp_path / "m", example=x, batch=None)
    assert not (tmp_path / "m").exists()


def test_a_scalar_whose_kind_picks_a_dtype_in_python_is_recorded(tmp_path):
    """A model that picks its output dtype in Python from a scalar's kind
    (``jnp.result_type(s, jnp.bfloat16)``) holds no op of the other dtype: its trace alone
    showed nothing, and the loaded model answered a Python 2.0 in float32 where ``h(x, 2.0)``
    answers bfloat16, silently. The scalar is traced flipped: the artifact takes only the kind
    it was exported at."""

    def model(p, x, s):
        return (x * p["w"]).astype(jnp.result_type(s, jnp.bfloat16))

    h = sm.hybridize(model, {"w": jnp.ones((3,), jnp.float32)})
    x = jnp.ones((2, 3), jnp.float32)
    assert h(x, 2.0).dtype == jnp.bfloat16 and h(x, np.float32(2.0)).dtype == jnp.float32
    art = sm.export(h, tmp_path / "m", example=(x, np.float32(2.0)), batch=None)
    m = sm.load(art.path)
    assert m(x, np.float32(2.0)).dtype == jnp.float32
    with pytest.raises(sm.SignatureError, match="strongly typed float32 scalar"):
        m(x, 2.0)


def test_a_weak_array_whose_kind_picks_a_dtype_in_python_is_recorded(tmp_path):
    """As for a scalar: a model picking its dtype in Python from an array input's weak type
    (``jnp.result_type(x, jnp.bfloat16)``) answered a weak ``jnp.full(s, 1.0)`` in float32
    loaded, where ``h`` answers bfloat16, silently (the weak types read from export's trace
    alone, unreleased). The array is traced flipped: the artifact takes only the strong kind."""

    def model(p, x):
        return (x @ p["w"]).astype(jnp.result_type(x, jnp.bfloat16))

    h = sm.hybridize(model, {"w": jnp.ones((3, 2), jnp.float32)})
    strong, weak = jnp.ones((4, 3), jnp.float32), jnp.full((4, 3), 1.0)
    assert h(strong).dtype == jnp.float32 and h(weak).dtype == jnp.bfloat16
    m = sm.load(sm.export(h, tmp_path / "m", example=strong).path)
    assert m(strong).dtype == jnp.float32
    with pytest.raises(sm.SignatureError, match="strongly typed float32"):
        m(weak)
