"""A stranger's artifact under JAX's transforms: a manifest that lies about its rows.

``jax.vmap`` over a loaded model merges the mapped axis into the batch and runs the program
once, right only where the program keeps rows apart. The manifest says so (``rows``), and a
stranger can say it of a program that mixes rows, every checksum made to match
(``fuzzing.forge.resign``): load believes the claim only where the StableHLO module shows it,
and else vmap runs one call per example (``jax.lax.map``), the answer vmap means.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fuzzing import forge

import symjax_mlp as sm

TOL = {"rtol": 1e-5, "atol": 1e-5}
_FORGED = "its manifest says that it does, but its StableHLO module does not show it"


def _xs(*shape, seed=1):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _claims_independent(m):
    m["rows"].update(independent=True, why="")


MIXING = {  # programs that mix rows, each of ops load() allows; what the module shows
    "mean": (lambda p, x: (x - x.mean(0)) @ p, "reduce reduces over the batch axis"),
    "softmax-over-batch": (lambda p, x: jax.nn.softmax(x @ p, axis=0), "reduce reduces over"),
    "reverse": (lambda p, x: jax.lax.rev(x, (0,)) @ p, "reverse moves rows"),
    "row-index": (lambda p, x: (x + jnp.arange(x.shape[0])[:, None]) @ p, "a row index"),
    "reshape": (lambda p, x: x.reshape(5, -1).T @ p, "reshapes across the batch axis"),
    "batch-size": (lambda p, x: (x * x.shape[0]) @ p, "function of the batch size"),
    "gram": (lambda p, x: (x @ x.T) @ x @ p, "two batch axes"),
}


@pytest.mark.parametrize("name", sorted(MIXING))
def test_a_forged_rows_claim_never_merges_rows(tmp_path, name):
    fn, shown = MIXING[name]
    h = sm.hybridize(fn, _xs(5, 3))
    src = sm.export(h, tmp_path / "src", example=jnp.ones((4, 5))).path
    art = forge.resign(src, tmp_path / "forged", manifest=_claims_independent)
    xs = _xs(3, 4, 5)
    merged = h(xs.reshape(12, 5)).reshape(3, 4, 3)  # what believing the claim would give
    for m in (sm.load(art), sm.load(art, trust=True)):  # trusted: read in this process
        assert m.manifest["rows"]["independent"] is False
        assert m.manifest["rows"]["why"].startswith(_FORGED) and shown in m.manifest["rows"]["why"]
        want = jnp.stack([m(x) for x in xs])  # each slice a whole call, as vmap means
        chex.assert_trees_all_close(jax.vmap(m)(xs), want, jax.lax.map(m, xs), **TOL)
        chex.assert_trees_all_close(jax.jit(jax.vmap(m))(xs), jax.vmap(h)(xs), **TOL)
        assert not np.allclose(jax.vmap(m)(xs), merged, **TOL)  # not merged
        with pytest.raises(sm.SignatureError, match="rank 1"):
            m(xs[0, 0])  # one example: the model's rows are not its to guess


def test_a_claim_over_two_symbolic_dimensions_is_not_shown_so_maps_per_example(tmp_path):
    # the module's dynamic dimensions are all taken for the batch: one more is not shown
    h = sm.hybridize(lambda p, x: x.sum(1) @ p, _xs(5, 3))
    art = sm.export(h, tmp_path / "m", example=jnp.ones((2, 4, 5)), shapes=("b, t, 5",))
    m = sm.load(art.path)
    assert m.manifest["rows"]["independent"] is False
    assert "more than one dynamic" in m.manifest["rows"]["why"]
    xs = _xs(3, 2, 4, 5)
    chex.assert_trees_all_close(jax.vmap(m)(xs), jnp.stack([m(x) for x in xs]), **TOL)


def test_honest_claims_are_shown_by_the_module(tmp_path):
    # what export found in the jaxpr, the module shows: the merged path, as before
    fns = [
        lambda p, x: jax.nn.softmax(x @ p, axis=1),
        lambda p, x: jnp.where(x > 0, x, 0.0).reshape(x.shape[0], 5, 1).reshape(-1, 5) @ p,
        lambda p, x: jnp.argmax(x, axis=1)[:, None] * (x @ p),
    ]
    for i, fn in enumerate(fns):
        h = sm.hybridize(fn, _xs(5, 3))
        m = sm.load(sm.export(h, tmp_path / str(i), example=jnp.ones((4, 5))).path)
        assert m.manifest["rows"] == {"dim": "b", "independent": True, "why": ""}
        xs = _xs(3, 4, 5)
        chex.assert_trees_all_close(jax.vmap(m)(xs), jax.vmap(h)(xs), **TOL)


_DOT = "    %0 = stablehlo.dot_general %arg5, "
_EDITS = {  # the module of an honest MLP on (b, 3), edited: its manifest still says rows apart
    "reverse": "    %e = stablehlo.reverse %arg5, dims = [0] : tensor<?x3xf32>\n",
    "first-row": (
        "    %s = stablehlo.slice %arg5 [0:1, 0:3] : (tensor<?x3xf32>) -> tensor<1x3xf32>\n"
        "    %b = stablehlo.reshape %arg0 : (tensor<i32>) -> tensor<1xi32>\n"
        "    %c3 = stablehlo.constant dense<3> : tensor<1xi32>\n"
        "    %bc = stablehlo.concatenate %b, %c3, dim = 0 : (tensor<1xi32>, tensor<1xi32>) -> "
        "tensor<2xi32>\n"
        "    %e = stablehlo.dynamic_broadcast_in_dim %s, %bc, dims = [0, 1] : "
        "(tensor<1x3xf32>, tensor<2xi32>) -> tensor<?x3xf32>\n"
    ),
}


@pytest.mark.parametrize("edit", sorted(_EDITS))
def test_a_module_edited_to_mix_rows_under_an_honest_manifest(tmp_path, edit):
    src, _ = forge.base(tmp_path / "src", batch="b")

    def mix(text):
        assert _DOT in text, "not the base MLP module"
        return text.replace(_DOT, _EDITS[edit] + _DOT.replace("%arg5", "%e"), 1)

    art = forge.forge(src, tmp_path / "forged", mix)
    m = sm.load(art, self_test=False)  # its self-test vectors: the stranger's to write too
    assert m.manifest["rows"]["independent"] is False
    xs = _xs(2, 4, 3)
    assert m.manifest["rows"]["why"].startswith(_FORGED)
    want = jnp.stack([m(x) for x in xs])  # the module as edited, one call per example
    chex.assert_trees_all_close(jax.vmap(m)(xs), want, jax.lax.map(m, xs), **TOL)


_MAX = "    %3 = stablehlo.maximum %arg1, %2 : tensor<?x4xf32>\n"
_RAGGED = (  # row 0 times the first group's weights (1), the rows after it in no group (0)
    "    %w = stablehlo.constant dense<1.0> : tensor<2x4x4xf32>\n"
    "    %g = stablehlo.constant dense<[1, 0]> : tensor<2xi64>\n"
    '    %3 = stablehlo.composite "chlo.ragged_dot" %arg1, %w, %g {composite_attributes = '
    '{precision_config = ["DEFAULT", "DEFAULT"], ragged_dot_dimension_numbers = ['
    "dense<> : tensor<0xi64>, dense<> : tensor<0xi64>, dense<1> : tensor<1xi64>, "
    "dense<1> : tensor<1xi64>, dense<0> : tensor<1xi64>, dense<0> : tensor<1xi64>]}, "
    "decomposition = @same, version = 1 : i32} : "
    "(tensor<?x4xf32>, tensor<2x4x4xf32>, tensor<2xi64>) -> tensor<?x4xf32>\n"
)
_SAME = (  # what the checker and the rows analysis read: the operand, row by row
    "  func.func private @same(%x: tensor<?x4xf32>, %w: tensor<2x4x4xf32>, "
    "%g: tensor<2xi64>) -> tensor<?x4xf32> {\n    return %x : tensor<?x4xf32>\n  }\n"
)


@pytest.mark.slow
def test_a_composite_run_as_the_op_it_names_is_refused_and_never_merges_rows(tmp_path):
    """A composite "chlo.ragged_dot" whose decomposition returns its operand: IREE runs the
    ragged dot it names, which gives each row the weights of its place in the batch (here:
    row 0 some, the rows after it none), while the checker and the rows analysis read the
    decomposition. It loaded, its manifest's rows claim kept, and a merged batch answered
    zeros for every request but the first. Refused by default; allowed by name, its rows are
    not shown apart, so a Batcher runs each request alone."""
    src, _ = forge.base(tmp_path / "src", batch="b")

    def ragged(text):
        assert _MAX in text, "not the base MLP module"
        text = text.replace(_MAX, _RAGGED, 1)
        return text[: text.rindex("}")] + _SAME + "}\n"

    art = forge.forge(src, tmp_path / "forged", ragged)
    for runtime in ("jax", "iree"):
        with pytest.raises(sm.ArtifactError, match=r"allow=\{'chlo.ragged_dot'\}"):
            sm.load(art, self_test=False, runtime=runtime)
    m = sm.load(art, self_test=False, runtime="iree", allow={"chlo.ragged_dot"})
    assert m.manifest["rows"]["independent"] is False
    assert "'chlo.ragged_dot' runs as the op it names" in m.manifest["rows"]["why"]
    xs = np.asarray(_xs(4, 1, 3))
    with sm.serving.Batcher(m, max_batch=4) as b:
        assert not b.merges and "runs as the op it names" in b.why_alone
        ys = [f.result(60) for f in [b.submit(x) for x in xs]]
    for x, y in zip(xs, ys, strict=True):  # each its own call: its row is row 0, not zeros
        np.testing.assert_allclose(y, m(x), **TOL)
        assert np.abs(y).sum() > 0
