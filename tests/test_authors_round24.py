"""Code we did not write, round twenty-four (tests/zoo24.py; sources and commit there): OTT
(``ott-jax``), never run here before, over every feature (hybridize, ``h(x)`` equal to the
plain model, its graph, export + load + call equal, grads/Hessians over the loaded model, a
Batcher's answers) and the authors' own training.

- 100_soft_sort.ipynb: the tutorial's ``CNN`` (8 x 8 images here) under OTT's soft ranks
  (``soft_sort.ranks``, a Sinkhorn solve with a data-dependent stop): equal, its graph;
  their VJP (OTT's implicit differentiation through lineax) checks its answer in a host
  callback, so export(vjp_order=1) is refused, naming the callback and ``EQX_ON_ERROR``
  (it advised lax.scan and custom_vjp: fixed); exported without a VJP it loads (its loop
  allowed), equals, and a Batcher answers each row; under ``EQX_ON_ERROR=nan`` it exports
  with its VJP of order 1, and order 2 is refused naming lineax's failed assert (a raw
  AssertionError before: fixed). Three of the tutorial's ``train_step`` (its cross-entropy
  run, adam) through ``h.apply`` equal three through ``model.apply``, and its ``eval_step``
  of ``soft_error_loss`` too (the soft-error run's gradients fail in OTT itself here).
- 200_Monge_Gap.ipynb: the tutorial's map (``PotentialMLP``) over every feature; its fitting
  loss, the Sinkhorn divergence of the mapped batch to the target (``sinkdiv``), as a layer:
  exported with its while loop, which load() refuses until allowed, naming it; loaded, its
  values, Sinkhorn iteration counts (the stop) and grads equal OTT's for batches the export
  never saw; a Batcher refuses it (one number for a whole batch cannot be split by rows);
  three steps of the tutorial's ``fit_map`` (``MongeGapEstimator``, Monge gap regularizer)
  equal three of ours over ``h.apply``.
"""

import functools
import os
import re
import subprocess
import sys
import textwrap
import types
import warnings

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo24
from features import close, every_feature
from flax import linen as nn
from ott.geometry import costs, pointcloud
from ott.neural.methods import monge_gap
from ott.neural.networks import potentials
from ott.tools import sinkhorn_divergence, soft_sort

import symjax_mlp as sm

pytestmark = pytest.mark.slow  # each a compile of a Sinkhorn loop or more (~2 s or more)

# What a Sinkhorn solve's artifact does beyond an MLP's: its loop stops when converged.
SINKHORN_OPS = {"compute", "dynamic_slice", "dynamic_update_slice", "scatter", "while"}
TOL = {"rtol": 1e-4, "atol": 1e-4}  # a Sinkhorn solve's answers, to its own threshold


def _config():
    """The tutorial's config (cell 31) with 8 x 8 images."""
    config = types.SimpleNamespace(learning_rate=0.0005, height=8, width=8, n_channels=1)
    config.optimizer = optax.adamw(learning_rate=config.learning_rate, weight_decay=0.0001)
    return config


def _state(config, model):
    """The tutorial's ``create_train_state``: its ``initialized`` unpacks
    ``variables.pop("params")`` into two, as a FrozenDict's pop returns; flax returns dicts now
    (``model.init``), so it runs under the flag of its time, ``flax_return_frozendict``."""
    with flax.config.temp_flip_flag("return_frozendict", True):
        return zoo24.create_train_state(jax.random.key(0), config, model)


def _images(n=4, seed=0):
    """Images as the tutorial's MNIST loader hands them (pixels 0 to 255, as floats)."""
    image = jax.random.randint(jax.random.key(seed), (n, 8, 8, 1), 0, 256).astype(jnp.float32)
    label = jax.nn.one_hot(jax.random.randint(jax.random.key(seed + 1), (n,), 0, 10), 10)
    return {"image": image, "label": label}


# OTT's soft sort differentiates through lineax's NormalCG, which warns it is deprecated
NORMAL_CG = r"ignore:`NormalCG\(\.\.\.\)` is deprecated:DeprecationWarning"


@pytest.mark.filterwarnings(NORMAL_CG)
def test_soft_ranks_of_the_cnn_exported_without_its_vjp(tmp_path):
    """``soft_sort.ranks`` of the tutorial's CNN logits, a Sinkhorn per row: ``h(x)`` equal, its
    graph. Its VJP (OTT's implicit differentiation, lineax's linear_solve) checks its answer in
    a host callback (equinox's), which no artifact can carry: export(vjp_order=1) is refused
    naming that callback and EQX_ON_ERROR (it named lax.scan and custom_vjp, which do not
    apply). Exported without its VJP, the loaded model (its loop allowed) equals OTT's on rows
    the export never saw, a Batcher answers each row's ranks, and jax.grad of it is refused."""
    model = zoo24.CNN(num_classes=10)
    state = _state(_config(), model)
    variables = {"params": state.params, **state.model_state}

    def ranks(v, x):
        return soft_sort.ranks(model.apply(v, x), axis=-1)

    h = sm.hybridize(ranks, variables)
    x = _images()["image"]
    want = ranks(variables, x)
    assert np.ptp(want) > 1  # ranks, not a constant
    close(h(x), want, **TOL)
    assert h.graph(x).flops > 0
    said = r"VJP of order 1 calls back into Python.*EQX_ON_ERROR=nan.*or export with vjp_order=0"
    with pytest.raises(sm.ConfigError, match=said):
        sm.export(h, tmp_path / "v", example=(x,), vjp_order=1)
    sm.export(h, tmp_path / "m", example=(x,), vjp_order=0)
    m = sm.load(tmp_path / "m", allow=SINKHORN_OPS | {"convolution", "gather", "reduce_window"})
    rows = _images(3, seed=7)["image"]
    close(m(np.asarray(rows)), ranks(variables, rows), **TOL)
    with sm.serving.Batcher(m, max_batch=4) as b:
        got = [b.submit(np.asarray(rows[i : i + 1])).result(30) for i in range(2)]
    close(np.concatenate(got), ranks(variables, rows[:2]), **TOL)
    with pytest.raises(sm.ConfigError, match=r"vjp_order=0"):
        jax.grad(lambda r: m(r).sum())(rows)


def test_soft_sort_tutorial_steps_through_h_apply():
    """Three of the tutorial's ``train_step`` of its cross-entropy run (cell 35: adam), jitted
    as its loop jits them, ``h.apply`` as the apply_fn, equal three with ``model.apply``: the
    metrics each step and the params; its ``eval_step`` of ``soft_error_loss`` (soft ranks;
    ``train=False, mutable=False``) too. (Its soft-error run, gradients of soft ranks, fails
    in OTT itself here: lineax's NormalCG returns NaN, ``jax.grad`` of ``soft_error_loss``
    raises with ``model.apply`` as with ``h.apply``.)"""
    config = _config()
    config.optimizer = optax.adam(learning_rate=config.learning_rate)
    model = zoo24.CNN(num_classes=10)
    state = _state(config, model)
    h = sm.hybridize(model.apply, {"params": state.params, **state.model_state})
    step = functools.partial(
        zoo24.train_step, loss_fn=zoo24.cross_entropy_loss, optimizer=config.optimizer
    )
    theirs = jax.jit(functools.partial(step, model.apply))
    ours = jax.jit(functools.partial(step, h.apply))
    mine, their = state, state
    for i in range(3):
        batch = _images(seed=i)
        mine, got = ours(state=mine, batch=batch)
        their, want = theirs(state=their, batch=batch)
        close(got, want, **TOL)
    close(mine.params, their.params, **TOL)
    assert int(mine.step) == 3
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), mine.params, state.params)
    assert max(jax.tree.leaves(moved)) > 0
    batch = _images(seed=9)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`NormalCG", DeprecationWarning)
        close(
            zoo24.eval_step(h.apply, zoo24.soft_error_loss, mine, batch),
            zoo24.eval_step(model.apply, zoo24.soft_error_loss, their, batch),
            **TOL,
        )


def _map():
    """The Monge gap tutorial's map, its params as ``MongeGapEstimator`` makes them."""
    model = potentials.PotentialMLP(dim_hidden=[32, 64, 32], is_potential=False, act_fn=nn.gelu)
    state = model.create_train_state(jax.random.key(0), optax.adam(1e-3), 2)
    return state.apply_fn, state.params


def _batches(n=16):
    train, _, _ = zoo24.tutorial_samplers(train_batch_size=n, valid_batch_size=n)
    return next(train.source_iter), next(train.target_iter)


def test_monge_gap_map_every_feature(tmp_path):
    """The tutorial's map (``PotentialMLP``, ``is_potential=False``) over every feature."""
    apply_fn, params = _map()
    x, _ = _batches()
    h = sm.hybridize(lambda p, x: apply_fn({"params": p}, x), params)
    every_feature(tmp_path, h, lambda r: apply_fn({"params": params}, r), x)


def test_sinkhorn_divergence_layer_exported_with_its_loop(tmp_path):
    """The tutorial's fitting loss of the mapped batch as a model of the batch: the
    divergence and its Sinkhorn iterations. Exported (a symbolic batch), load() refuses the
    while loop and names what to allow; allowed, the loaded model's divergence, iteration
    count and grads equal OTT's on batches the export never saw, whose solves stop after
    other counts (the stop is the data's, kept). A Batcher refuses it: one number for the
    whole batch, which requests' rows cannot share."""
    apply_fn, params = _map()
    x, y = _batches()
    eps = 0.1 * pointcloud.PointCloud(y).mean_cost_matrix

    def fitting(p, x):
        div, out = sinkhorn_divergence.sinkdiv(
            apply_fn({"params": p}, x), y, epsilon=eps, static_b=True
        )
        return div, out.n_iters[0]  # its solve of x against y

    h = sm.hybridize(fitting, params)
    close(h(x), fitting(params, x), **TOL)
    sm.export(h, tmp_path / "m", example=(x,), vjp_order=1)
    said = r"(?s)a while loop whose trip count is not a constant.*pass allow=\{[^}]*'while'"
    with pytest.raises(sm.ArtifactError, match=said):
        sm.load(tmp_path / "m")
    m = sm.load(tmp_path / "m", allow=SINKHORN_OPS)
    counts = set()
    for rows in (x[:5], 3.0 * x):
        got, want = m(np.asarray(rows)), fitting(params, rows)
        close(got, want, **TOL)
        counts.add(int(got[1]))
        grad = lambda f, rows=rows: jax.grad(lambda r: f(r)[0])(rows)  # noqa: E731
        close(grad(m), grad(lambda r: fitting(params, r)), **TOL)
    assert len(counts) > 1  # the loop stopped where each batch's solve converged
    with pytest.raises(
        sm.ConfigError,
        match=r"output out\[0\] is float32\[\], but a batcher needs outputs of 'b' rows",
    ):
        sm.serving.Batcher(m)


def test_monge_gap_fit_map_equals_ours(monkeypatch):
    """Three steps of the tutorial's ``fit_map`` (``MongeGapEstimator``, the Sinkhorn
    divergence as fitting loss, the Monge gap of the squared Euclidean cost as regularizer,
    16 points a batch) equal three adam steps of that loss over ``h.apply``, on the same
    batches (fit_map first draws a target batch, then a source batch, for its epsilons)."""
    for name, value in zip(
        ("train_dataset", "valid_dataset"),
        zoo24.tutorial_samplers(train_batch_size=16, valid_batch_size=16),
        strict=False,
    ):
        monkeypatch.setattr(zoo24, name, value)
    theirs, logs = zoo24.fit_map(costs.SqEuclidean(), num_train_iters=3)
    apply_fn, params = _map()
    h = sm.hybridize(lambda p, x: apply_fn({"params": p}, x), params)
    train, _, _ = zoo24.tutorial_samplers(train_batch_size=16, valid_batch_size=16)
    y = next(train.target_iter)
    eps_fit = 0.1 * pointcloud.PointCloud(y).mean_cost_matrix
    eps_reg = 0.01 * pointcloud.PointCloud(next(train.source_iter), y).mean_cost_matrix

    def loss(p, source, target):
        mapped = h.apply(p, source)
        fit = sinkhorn_divergence.sinkdiv(mapped, target, epsilon=eps_fit, static_b=True)[0]
        return fit + monge_gap.monge_gap_from_samples(
            source, mapped, cost_fn=costs.SqEuclidean(), epsilon=eps_reg
        )

    tx = optax.adam(1e-3)
    p, opt = h.params, tx.init(h.params)
    for _ in range(3):
        grads = jax.grad(loss)(p, next(train.source_iter), next(train.target_iter))
        updates, opt = tx.update(grads, opt, p)
        p = optax.apply_updates(p, updates)
    close(p, theirs.params, **TOL)
    assert int(theirs.step) == 3 and len(logs["eval"]["total_loss"]) == 2  # steps 0 and 2


def test_soft_ranks_under_eqx_on_error_nan_as_the_refusal_says(tmp_path):
    """As the refusal above says, under ``EQX_ON_ERROR=nan`` (a process: equinox reads it when
    imported) soft ranks export with their VJP of order 1, and the loaded model's ranks equal
    OTT's; order 2 is refused, naming lineax's failed assert and ``vjp_order=1`` (its
    AssertionError, a tuple of JAX's internal values for a message, went out raw)."""
    script = textwrap.dedent(
        f"""
        import sys, warnings; sys.path.insert(0, {os.path.dirname(__file__)!r})
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        import jax, numpy as np, zoo24
        from ott.tools import soft_sort
        import symjax_mlp as sm
        ranks = lambda w, x: soft_sort.ranks(x * w, axis=-1)
        w, x = np.float32(2.0), jax.random.normal(jax.random.key(0), (4, 10))
        h = sm.hybridize(ranks, w)
        sm.export(h, sys.argv[1], example=(x,), vjp_order=1)
        m = sm.load(sys.argv[1], allow={sorted(SINKHORN_OPS | {"gather", "real_dynamic_slice"})!r})
        np.testing.assert_allclose(m(np.asarray(x[:3])), ranks(w, x[:3]), rtol=1e-4, atol=1e-4)
        try:
            sm.export(h, sys.argv[1] + "2", example=(x,), vjp_order=2)
        except sm.ConfigError as e:
            print(e)
        """
    )
    env = {**os.environ, "EQX_ON_ERROR": "nan"}
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "m")], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    said = r"VJP of order 2 \(an assert failed in lineax/_operator\.py, line \d+\).*vjp_order=1"
    assert re.search(said, run.stdout), run.stdout
