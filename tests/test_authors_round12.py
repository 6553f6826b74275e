"""Code we did not write, round twelve: the jax.export guide's own examples (tests/zoo12.py;
sources and commit there), through our artifact, which is jax.export: hybridize, export (the
guide's symbolic shapes and constraints as ``shapes=``/``constraints=``), load, call equal,
grads and vmap over the loaded model, a Batcher's answers or its refusal, and every feature
(tests/features.py) where a model keeps its rows apart.

- export.md: ``2 * x * x`` over every feature and the guide's ``callee`` (96.0); ``7 * x**3``
  with ``vjp_order=3`` differentiates three times (0.21, 4.2, 42.0), the fourth refused naming
  ``vjp_order=4``; ``lax.cos`` for ``['tpu']`` alone is refused at load naming the platforms
  to add, for ``['tpu', 'cpu', 'cuda']`` it runs; the 1000 ``jnp.cos`` too.
- shape_poly.md: ``concatenate`` of ``"a, b"`` (``f32[a, 2*b]``), ``f1`` of ``"a, ..."``,
  the flatten to ``4*b`` and the average over the batch (a Batcher refuses both), the batch
  size as a value (a Batcher answers each request as its own call), the three outputs,
  ``x[0:16]`` of ``"b + 15"`` (was refused at export: its sizes drawn at 2, not 17), the
  constrained ``x[:x.shape[1], :16]``, ``slice_in_dim`` by ``mod(b, 3)`` and the inconclusive
  branch (refusals now name the guide's constraint), ``my_top_k`` with ``k`` from a ``(0, k)``
  array, ``"b, b, 2*d"`` called with an odd size (was an ArtifactError saying to export
  again), ``(a * a,)`` (was jax's raw ValueError) and the ``"(b, _, _)"`` placeholder (was
  refused as a syntax error).
- aot.md: a ``jax.stages.Traced`` hybridizes; a ``Lowered`` or ``Compiled`` is refused naming
  the function (a Compiled was taken, each call jax's TypeError); ``g``'s own shape assert at
  the symbolic batch is refused naming its rows (was a bare AssertionError).
- Common_Gotchas_in_JAX.md: the ``.at`` updates and ``nansum_2`` over every feature; a read
  past the end (``x[:, 11]`` of 10 columns) with gradients at a symbolic batch is refused (the
  loaded model's grad was silently zero at the clamped entry), ``mode='clip'`` works.
- automatic-differentiation.md: four derivatives of ``f`` through ``vjp_order=4``.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo12
from features import close, every_feature
from jax import random

import symjax_mlp as sm

P = {"s": jnp.float32(1.0)}


def _x(shape, seed=0):
    return jax.random.normal(random.key(seed), shape)


# --- export.md -----------------------------------------------------------------------------


@pytest.mark.slow
def test_export_guide_square_over_every_feature_and_its_callee(tmp_path):
    """``f(x) = 2 * x * x`` of rows: every feature; the guide's ``callee`` of the loaded model
    (a scalar export, as the guide's) is 96.0, under jax.jit too."""
    x = _x((5, 3))
    h = sm.hybridize(zoo12.scaled(zoo12.f_square), P)
    every_feature(tmp_path / "rows", h, zoo12.f_square, x)
    sm.export(h, tmp_path / "scalar", example=(jnp.float32(1.0),), batch=None)
    m = sm.load(tmp_path / "scalar")
    close(zoo12.callee(m, 1.0), jnp.float32(96.0))
    close(jax.jit(lambda y: zoo12.callee(m, y))(1.0), jnp.float32(96.0))


@pytest.mark.slow
def test_export_guide_three_levels_of_vjp_and_the_fourth_refused(tmp_path):
    """``7 * x * x * x`` exported with ``vjp_order=3``: the guide's 0.007, 0.21, 4.2 and 42.0;
    a fourth ``jax.grad`` is refused naming ``vjp_order=4`` (jax: 'No VJP is available')."""
    h = sm.hybridize(zoo12.scaled(zoo12.f_cube), P)
    sm.export(h, tmp_path / "m", example=(jnp.float32(1.0),), batch=None, vjp_order=3)
    m = sm.load(tmp_path / "m")
    g = jax.grad
    for f, want in ((m, 0.007), (g(m), 0.21), (g(g(m)), 4.2), (g(g(g(m))), 42.0)):
        close(f(0.1), jnp.float32(want), rtol=1e-5, atol=1e-6)
    with pytest.raises(sm.ConfigError, match=r"order 4.*vjp_order=3.*vjp_order=4"):
        g(g(g(g(m))))(0.1)


@pytest.mark.slow
def test_export_guide_platforms(tmp_path):
    """``lax.cos`` for ``['tpu']`` only: load refuses it here naming the platforms to export
    for (jax: 'lowered for platforms ('tpu',) but it is used on ('cpu',)'); for ``['tpu',
    'cpu', 'cuda']`` it runs, grads and a Batcher too; the 1000 ``jnp.cos`` for three
    platforms equals the plain function."""
    h = sm.hybridize(zoo12.net_cos, P)
    sm.export(h, tmp_path / "tpu", example=(jnp.float32(1.0),), batch=None, platforms=("tpu",))
    with pytest.raises(sm.ArtifactError, match=r"exported for tpu.*platforms=\('tpu', 'cpu'\)"):
        sm.load(tmp_path / "tpu")
    x = _x((4,))
    sm.export(h, tmp_path / "multi", example=(x,), platforms=("tpu", "cpu", "cuda"), vjp_order=1)
    m = sm.load(tmp_path / "multi")
    close(m(np.float32([1.0])), jnp.cos(jnp.float32([1.0])))
    close(jax.grad(lambda r: m(r).sum())(x), -jnp.sin(x))
    with sm.serving.Batcher(m, max_batch=4) as b:
        close(b.submit(np.asarray(x[:1])).result(30), jnp.cos(x[:1]))
    h = sm.hybridize(zoo12.scaled(zoo12.f_largish), P)
    sm.export(h, tmp_path / "largish", example=(x,), platforms=("cpu", "tpu", "cuda"))
    close(sm.load(tmp_path / "largish")(np.asarray(x[:3])), zoo12.f_largish(x[:3]))


# --- shape_poly.md -------------------------------------------------------------------------


@pytest.mark.slow
def test_concatenate_of_a_b_and_over_every_feature(tmp_path):
    """``f`` of ``"a, b"``: the signature's output is ``[a, 2*b]`` as the guide's
    ``out_avals``; it answers (3, 4) and (2, 5), grads and vmap equal; a Batcher refuses the
    symbolic ``b`` naming the direct call. With only the batch symbolic, every feature."""
    h = sm.hybridize(zoo12.scaled(zoo12.f_concat), P)
    x = _x((3, 4))
    sm.export(h, tmp_path / "ab", example=(x,), shapes=("a, b",), vjp_order=1)
    m = sm.load(tmp_path / "ab", allow={"real_dynamic_slice"})
    assert str(m.signature.outputs[0]) == "out: float32[a, 2*b]"
    for r in (x, _x((2, 5), 1)):
        close(m(r), zoo12.f_concat(r))
        close(jax.grad(lambda a: (m(a) ** 2).sum())(r), 4 * r)
    xs = _x((3, 2, 5), 2)
    close(jax.vmap(m)(xs), jax.vmap(zoo12.f_concat)(xs))
    with pytest.raises(sm.ConfigError, match=r"its size b is symbolic.*Call the loaded model"):
        sm.serving.Batcher(m)
    every_feature(tmp_path / "b", h, zoo12.f_concat, _x((5, 4), 3), allow={"real_dynamic_slice"})


@pytest.mark.slow
def test_f1_of_a_and_the_flatten_and_average_a_batcher_refuses(tmp_path):
    """``f1(x, y)`` of ``"a, ..."`` answers any ``a`` (its Batcher too); the flatten of
    ``"b, 4"`` returns ``[4*b]`` and the average over the batch ``[4]``: both answer the
    guide's values, and a Batcher, which splits answers by rows, refuses each."""
    h = sm.hybridize(zoo12.scaled(zoo12.f1), P)
    x, y = np.ones((3, 1), np.float32), np.ones((3, 4), np.float32)
    sm.export(h, tmp_path / "f1", example=(x, y), shapes=("a, ...", "a, ..."))
    m = sm.load(tmp_path / "f1")
    assert [str(s) for s in m.signature.inputs] == [
        "args[0]: float32[a, 1]",
        "args[1]: float32[a, 4]",
    ]
    close(m(x[:2], 2 * y[:2]), np.full((2, 4), 3.0, np.float32))
    with sm.serving.Batcher(m, max_batch=4) as b:
        close(b.submit(x[:1], y[:1]).result(30), np.full((1, 4), 2.0, np.float32))
    for name, fn, want in (
        ("flatten", zoo12.flatten, r"output out is float32\[4\*b\]"),
        ("average", zoo12.average, r"output out is float32\[4\].*reduces over the batch"),
    ):
        r = jnp.arange(12, dtype=jnp.float32).reshape((3, 4))
        sm.export(sm.hybridize(zoo12.scaled(fn), P), tmp_path / name, example=(r,))
        m = sm.load(tmp_path / name)
        close(m(r), fn(r))
        close(m(r[:2]), fn(r[:2]))
        with pytest.raises(sm.ConfigError, match=want):
            sm.serving.Batcher(m)
    close(m(jnp.arange(12, dtype=jnp.float32).reshape((3, 4))), jnp.float32([4, 5, 6, 7]))


@pytest.mark.slow
def test_the_batch_size_as_a_value(tmp_path):
    """``jnp.array(x.shape[0]) + x``: the loaded model answers ``[3, 4, 5]`` for
    ``arange(3)`` as the guide's ``exp.call``, and 5 + x for 5 rows; a Batcher answers each
    request as its own call (1 + x for one row), never as part of a merged batch; grads,
    vmap and Hessians equal. The three outputs of ``x.shape[0]`` are the guide's."""
    h = sm.hybridize(zoo12.scaled(zoo12.size_plus), P)
    x = jnp.arange(3, dtype=jnp.float32)
    sm.export(h, tmp_path / "m", example=(x,), vjp_order=2)
    m = sm.load(tmp_path / "m")
    close(m(x), jnp.float32([3, 4, 5]))
    close(m(jnp.arange(5.0)), jnp.arange(5.0) + 5)
    with sm.serving.Batcher(m, max_batch=4) as b:
        got = [b.submit(np.float32([i])) for i in range(3)]
        close([g.result(30) for g in got], [np.float32([1.0 + i]) for i in range(3)])
    xs = _x((2, 3))
    close(jax.vmap(m)(xs), jax.vmap(zoo12.size_plus)(xs))
    close(
        jax.grad(lambda r: (m(r) ** 2).sum())(x),
        jax.grad(lambda r: (zoo12.size_plus(r) ** 2).sum())(x),
    )
    hess = lambda f: jax.jacrev(jax.jacrev(lambda r: (f(r) ** 3).sum()))(x)  # noqa: E731
    close(hess(m), hess(zoo12.size_plus))
    sm.export(sm.hybridize(lambda p, r: zoo12.three(r), {}), tmp_path / "three",
              example=(jnp.ones((3,), jnp.int32),))  # fmt: skip
    three = sm.load(tmp_path / "three")
    assert str(three.signature).endswith("-> (float32[], int32[5], float32[b])  with b >= 1")
    got = three(jnp.ones((3,), jnp.int32))
    close(got, (jnp.float32(8.0), jnp.int32([3, 2, 1, 0, -1]), jnp.full(3, 4.14112, jnp.float32)))


@pytest.mark.slow  # an export (0.3 s warm, 1.8 s cold)
def test_the_guides_placeholder_specs(tmp_path):
    """shape_poly.md's ``("(b, _, _)", None)``: ``_`` takes one dimension from the example, as
    jax.export does (it was refused: 'spec contains ... but no like shape was given', the
    example's shape passed only for ``...``)."""
    h = sm.hybridize(lambda p, x, w: (x @ w) * p, jnp.float32(1))
    art = sm.export(h, tmp_path / "m", example=(jnp.ones((4, 3, 2)), jnp.ones(2)),
                    shapes=("(b, _, _)", None))  # fmt: skip
    assert str(art.signature).startswith("(args[0]: float32[b, 3, 2], args[1]: float32[2])")


@pytest.mark.slow
def test_b_plus_15_exports_and_a_shorter_input_is_refused_by_name(tmp_path):
    """``x[0:16]`` of ``"b + 15"``: export drew its self-test inputs at size 2 (each symbolic
    dimension 2, not b = 2) and refused the guide's own example (the program refused them);
    now it exports, answers 17 and 40 rows, and its grads equal; 10 rows (b = -5) is refused
    naming the sizes it takes (was an ArtifactError saying to export again)."""
    h = sm.hybridize(zoo12.scaled(zoo12.first_16), P)
    x = _x((20,))
    sm.export(h, tmp_path / "m", example=(x,), shapes=("b + 15",), vjp_order=1)
    m = sm.load(tmp_path / "m", allow={"gather", "scatter"})
    assert str(m.signature).startswith("(args[0]: float32[b + 15]) -> float32[16]  with b >= 1")
    for r in (x[:17], _x((40,), 1)):
        close(m(r), r[:16])
        close(
            jax.grad(lambda a: (m(a) ** 2).sum())(r), jnp.where(jnp.arange(r.size) < 16, 2 * r, 0)
        )
    with pytest.raises(
        sm.SignatureError, match=r"is 10, .*b \+ 15 for a whole b >= 1 \(16, 17, 18"
    ):
        m(np.ones(10, np.float32))


@pytest.mark.slow
def test_explicit_constraints_a_ge_b_and_b_ge_16(tmp_path):
    """``x[:x.shape[1], :16]`` with ``constraints=("a >= b", "b >= 16")``, as the guide: it
    answers (20, 18) and (18, 18), grads equal, and each bound a call breaks is named."""
    h = sm.hybridize(zoo12.scaled(zoo12.square_16), P)
    x = _x((20, 16))
    sm.export(h, tmp_path / "m", example=(x,), shapes=("a, b",), constraints=("a >= b", "b >= 16"),
              vjp_order=1)  # fmt: skip
    m = sm.load(tmp_path / "m", allow={"dynamic_gather", "scatter"})
    for r in (_x((20, 18), 1), _x((18, 18), 2)):
        close(m(r), zoo12.square_16(r))
        close(jax.grad(lambda a: m(a).sum())(r), jax.grad(lambda a: zoo12.square_16(a).sum())(r))
    with pytest.raises(sm.SignatureError, match=r"requires a >= b"):
        m(np.ones((10, 18), np.float32))
    with pytest.raises(sm.SignatureError, match=r"requires b >= 16"):
        m(np.ones((20, 8), np.float32))


@pytest.mark.slow
def test_inconclusive_comparisons_name_the_guides_constraint(tmp_path):
    """``slice_in_dim(x, 0, x.shape[0] % 3)`` and the branch on ``x.shape[0] + 1 >=
    x.shape[1]``: refused naming ``constraints=('b >= mod(b, 3)',)`` and ``('a + 1 >= b',)``,
    the guide's fix (was: a model that fixes its batch size, or one taking a size as a Python
    number); exported so, they answer as the plain functions, and a call breaking the
    branch's constraint is refused."""
    h = sm.hybridize(zoo12.scaled(zoo12.slice_mod), P)
    x = _x((5,))
    with pytest.raises(sm.SignatureError, match=re.escape("constraints=('b >= mod(b, 3)',)")):
        sm.export(h, tmp_path / "refused", example=(x,), shapes=("b",))
    sm.export(h, tmp_path / "mod", example=(x,), shapes=("b",), constraints=("b >= mod(b, 3)",))
    m = sm.load(tmp_path / "mod", allow={"real_dynamic_slice"})
    for n in (5, 7, 6):
        close(m(_x((n,), n)), zoo12.slice_mod(_x((n,), n)))
    h = sm.hybridize(zoo12.net_branch, P)
    x = _x((4, 4))
    with pytest.raises(sm.SignatureError, match=re.escape("constraints=('a + 1 >= b',)")):
        sm.export(h, tmp_path / "refused", example=(x,), shapes=("a, b",))
    sm.export(h, tmp_path / "branch", example=(x,), shapes=("a, b",), constraints=("a + 1 >= b",))
    m = sm.load(tmp_path / "branch")
    close(m(_x((3, 4), 1)), zoo12.net_branch(P, _x((3, 4), 1)))
    with pytest.raises(sm.SignatureError, match=r"requires a \+ 1 >= b"):
        m(np.ones((3, 5), np.float32))


@pytest.mark.slow
def test_top_k_static_and_k_from_an_empty_array(tmp_path):
    """``my_top_k`` with ``k = 3`` baked in (static) and ``my_top_k_with_dimensions`` whose
    ``k`` comes from a ``(0, k)`` input under ``k <= 10``: the guide's ``[[9, 8, 7], ...]``,
    another k after export, grads to the chosen entries, and ``k = 11`` refused by name."""
    want = np.int32([[9, 8, 7], [19, 18, 17], [29, 28, 27], [39, 38, 37]])
    h = sm.hybridize(lambda p, k, x: zoo12.my_top_k(k, x), {})
    sm.export(h, tmp_path / "static", example=(3, zoo12.x_top), batch=None)
    close(sm.load(tmp_path / "static", allow={"sort"})(zoo12.x_top), want)
    h = sm.hybridize(zoo12.net_top_k_dims, P)
    x = zoo12.x_top.astype(np.float32)
    sm.export(h, tmp_path / "k", example=(np.zeros((0, 3), np.float32), x), shapes=("0, k", None),
              constraints=("k <= 10",), vjp_order=1)  # fmt: skip
    m = sm.load(tmp_path / "k", allow={"custom_call:stablehlo.dynamic_top_k", "scatter"})
    assert str(m.signature.outputs[0]) == "out: float32[4, k]"
    close(m(np.zeros((0, 3), np.float32), x), want.astype(np.float32))
    close(m(np.zeros((0, 5), np.float32), x), x[:, ::-1][:, :5])
    g = jax.grad(lambda r: m(np.zeros((0, 2), np.float32), r).sum())(x)
    close(g, (x >= x[:, 8:9]).astype(np.float32))
    with pytest.raises(sm.SignatureError, match=r"requires k <= 10"):
        m(np.zeros((0, 11), np.float32), x)


@pytest.mark.slow  # an export and a load (0.4 s warm, 3 s cold)
def test_b_b_2d_names_an_odd_size_as_the_callers(tmp_path):
    """``f(x) = x`` of ``"b, b, 2*d"``, called with the guide's ``(3, 3, 5)``: refused as the
    caller's input, naming the sizes ``2*d`` takes (was an ArtifactError, 'the shapes of the
    module cannot be resolved ... Export the model again'); ``(3, 3, 4)`` answers, and ``(3,
    2, 4)`` is refused naming ``b``."""
    h = sm.hybridize(zoo12.scaled(zoo12.f_identity), P)
    sm.export(h, tmp_path / "m", example=(np.ones((3, 3, 4), np.float32),), shapes=("b, b, 2*d",))
    m = sm.load(tmp_path / "m")
    assert str(m.signature).endswith("with b >= 1, d >= 1")
    want = (
        r"args\[0\]\.shape\[2\] is 5, but the artifact requires 2\*d for a whole d >= 1 \(2, 4, 6"
    )
    with pytest.raises(sm.SignatureError, match=want):
        m(np.ones((3, 3, 5), np.float32))
    close(m(np.ones((3, 3, 6), np.float32)), np.ones((3, 3, 6), np.float32))
    with pytest.raises(sm.SignatureError, match="symbolic dimension b and must agree"):
        m(np.ones((3, 2, 4), np.float32))


def test_a_times_a_is_refused_naming_a_variable(tmp_path):
    """``x.shape[0]`` of ``(a * a,)``: jax.export cannot solve ``a`` from ``a^2``; export
    raised jax's raw ValueError, now a SignatureError naming the unsolvable dimension."""
    h = sm.hybridize(lambda p, x: zoo12.size_of(x) * p["s"], P)
    with pytest.raises(sm.SignatureError, match=r"not from a\^2 \(Cannot solve .*shapes='n'"):
        sm.export(h, tmp_path / "m", example=(np.ones(4, np.float32),), shapes=("a*a",))


# --- aot.md --------------------------------------------------------------------------------


def test_aot_stages_handed_to_hybridize():
    """The guide's ``f`` as ``jax.jit(f).trace(x, y)``: a Traced hybridizes and answers as
    ``f``; its ``.lower()`` and ``.lower().compile()`` are refused naming the function itself
    (the Compiled was taken, and every call raised jax's TypeError, 'Cannot apply JAX
    transformations to a function lowered and compiled for a particular signature')."""
    net = lambda p, x: zoo12.f_aot(x, p)  # noqa: E731 - y, the guide's 4, as the param
    x, p = jnp.ones((3, 2)), jnp.float32(4)
    traced = jax.jit(net).trace(p, x)
    close(sm.hybridize(traced, p)(x), zoo12.f_aot(x, p))
    for stage in (traced.lower(), traced.lower().compile()):
        kind = type(stage).__name__
        with pytest.raises(sm.ConfigError, match=rf"got a jax\.stages\.{kind} .*sm\.hybridize\(f"):
            sm.hybridize(stage, p)


@pytest.mark.slow
def test_aot_g_asserting_its_shape_exports_static_and_maps(tmp_path):
    """``g`` asserts its input is (3, 2): with the batch symbolic the assert fails, which
    export raised bare (``AssertionError``, no message); now refused naming its 3 rows and
    ``batch=None``. Exported so, ``jax.vmap`` of the loaded model over ``zs`` is the guide's
    ``jax.vmap(g_jit)(zs)``, where ``jax.vmap(g_aot)`` raises."""
    h = sm.hybridize(lambda p, x: zoo12.g(x) * p, jnp.float32(1))
    z, zs = zoo12.make_z(3, 2), zoo12.make_z(4, 3, 2)
    with pytest.raises(sm.SignatureError, match=r"fails \(AssertionError\).*3 rows.*batch=None"):
        sm.export(h, tmp_path / "m", example=(z,))
    sm.export(h, tmp_path / "m", example=(z,), batch=None)
    want = jnp.float32([[1, 5, 9], [13, 17, 21], [25, 29, 33], [37, 41, 45]])
    close(jax.vmap(sm.load(tmp_path / "m"))(zs), want)
    close(jax.vmap(jax.jit(zoo12.g))(zs), want)


# --- Common_Gotchas_in_JAX.md --------------------------------------------------------------


@pytest.mark.slow
def test_gotchas_in_place_updates(tmp_path):
    """The guide's ``.at[1, :].set`` and ``.at[::2, 3:].add`` over a batch: every feature (its
    scatters loaded by ``allow=``)."""
    p = {"set": jnp.float32(1.0), "add": jnp.float32(7.0)}
    arrays = _x((4, 5, 6), 1)
    h = sm.hybridize(zoo12.net_updates, p)
    every_feature(tmp_path / "at", h, lambda r: zoo12.net_updates(p, r), arrays,
                  allow={"scatter", "gather", "dynamic_gather"})  # fmt: skip


@pytest.mark.slow
def test_gotchas_nansum_2_over_rows_with_nans(tmp_path):
    """``nansum_2`` per row of rows holding NaNs: every feature (NaN-free answers and grads,
    zero at the NaNs, as JAX's); the guide's ``nansum`` (a boolean mask) is JAX's own
    NonConcreteBooleanIndexError, as under jax.jit."""
    x = _x((5, 3)).at[1, 1].set(jnp.nan).at[3, 0].set(jnp.nan)
    ref = jax.vmap(zoo12.nansum_2)
    h = sm.hybridize(lambda p, r: ref(r * p), jnp.float32(1))
    m = every_feature(tmp_path, h, ref, x)
    assert not np.isnan(np.asarray(m(np.asarray(x)))).any()
    with pytest.raises(jax.errors.NonConcreteBooleanIndexError):
        sm.hybridize(lambda p, r: zoo12.nansum(r * p), jnp.float32(1))(x)


def test_gotchas_read_past_the_end_refused_where_its_gradient_would_be_lost(tmp_path):
    """``x[:, 11]`` of 10 columns reads the last (clamped, as the guide's
    ``jnp.arange(10)[11]``): at a symbolic batch jax.export stages a gather whose VJP drops
    that entry, and the loaded model's grad was silently zero there (JAX's: the param's);
    now export refuses it with gradients, naming in-bounds indices and mode='clip'."""
    p, x = {"s": jnp.float32(1.5)}, _x((5, 10))
    h = sm.hybridize(zoo12.net_out_of_bounds, p)
    with pytest.raises(sm.SignatureError, match=r"dimension 1 of \(b, 10\) at 11.*clamps to 9.*"
                       r"x\[\.\.\., 9\].*mode='clip'"):  # fmt: skip
        sm.export(h, tmp_path / "grads", example=(x,), vjp_order=1)


@pytest.mark.slow
def test_gotchas_reads_past_the_end_without_gradients_and_the_clamp_asked_for(tmp_path):
    """Without gradients the read past the end exports and reads 9 and NaN (mode='fill') as
    the guide; ``.at[:, 11].get(mode='clip')``, as the refusal names: every feature, its grads
    the clamped column's (the loaded model's equal JAX's)."""
    p, x = {"s": jnp.float32(1.5)}, _x((5, 10))
    allow = {"gather", "dynamic_gather", "dynamic_slice", "scatter"}
    sm.export(sm.hybridize(zoo12.net_out_of_bounds, p), tmp_path / "m", example=(x,))
    got = sm.load(tmp_path / "m", allow=allow)(x[:2])
    close(got[:, 0], 1.5 * x[:2, 9])
    assert np.isnan(np.asarray(got[:, 1])).all()
    h = sm.hybridize(zoo12.net_clipped, p)
    every_feature(tmp_path / "clip", h, lambda r: zoo12.net_clipped(p, r), x, allow=allow)


# --- automatic-differentiation.md ----------------------------------------------------------


@pytest.mark.slow
def test_four_derivatives_through_a_vjp_order_4_artifact(tmp_path):
    """The guide's ``f`` and ``d4fdx = grad(grad(grad(grad(f))))``: exported with
    ``vjp_order=4``, the loaded model's value and four derivatives at 1.0 are the guide's
    (1, 4, 10, 6, 0)."""
    h = sm.hybridize(lambda p, x: zoo12.f_poly(x * p), jnp.float32(1))
    sm.export(h, tmp_path / "m", example=(jnp.float32(1.0),), batch=None, vjp_order=4)
    m, g = sm.load(tmp_path / "m"), jax.grad
    got = [f(1.0) for f in (m, g(m), g(g(m)), g(g(g(m))), g(g(g(g(m)))))]
    close(got, [jnp.float32(v) for v in (1.0, 4.0, 10.0, 6.0, 0.0)])
