"""An nnx module changed in place after ``sm.hybridize`` (nnx's own loop: ``nnx.Optimizer``,
``model.kernel[...] = ...``, ``nnx.update``, ``nnx.reseed``, a BatchNorm's statistics): the
Hybrid holds its Variables as of hybridize, so ``h(x)`` runs those (its hot path reads no
module: a read of the module's Variables cost 1.15x to 4x a call), and everything that would
hand the old ones on as the module's (``h.params``, ``h.state``, ``h.module``, ``h.eager``,
``h.graph``, export, a Batcher) is refused, naming what changed and ``h.refresh()``, which
reads the module again. An rng stream's draws (its count) and what a call sows are no change.
"""

import copy

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import symjax_mlp as sm

X = jnp.ones((2, 4))
TOL = {"atol": 1e-6, "rtol": 1e-6}
REFUSED = r"nnx module holds other {} \({}.*\) than the Hybrid was made of.*h = h\.refresh\(\)"


def _step(model):
    """One step of nnx's own loop: the module's Params written in place."""
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    optimizer.update(model, nnx.grad(lambda m: (m(X) ** 2).sum())(model))


class _Dropped(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))

    def __call__(self, x):
        return self.dropout(self.linear(x))


@pytest.mark.slow
def test_after_nnx_optimizer_the_hybrids_params_state_graph_module_and_eager_are_refused():
    """The lead's reproduction: h(x) kept the weights of hybridize while model(x) moved, and
    h.params, h.graph, h.eager gave the old ones as the module's, silently."""
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    h = sm.hybridize(model)
    before = h(X)
    _step(model)
    assert not np.allclose(model(X), before)
    chex.assert_trees_all_close(h(X), before)  # the hot path: the Variables as of hybridize
    said = REFUSED.format("Params", r"\['bias'\], \['kernel'\]")
    for read, what in [
        (lambda: h.params, "params"), (lambda: h.state, "state"), (lambda: h.graph(X), "graph"),
        (lambda: h.module, "params"), (lambda: h.eager(X), "params"),
        (lambda: h.variables, "params"),
    ]:  # fmt: skip
        with pytest.raises(sm.ConfigError, match=rf"^Linear\.{what}: the {said}"):
            read()
    assert h.trained_in_place() == ["['bias']", "['kernel']"]


def test_refresh_reads_the_module_again_keeping_settings_and_callbacks():
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    h = sm.hybridize(model, name="net", max_traces=3)
    seen = h.on_trace(lambda *a: None)
    model.kernel[...] = jnp.zeros((4, 2))  # a PyTorch-style write
    fresh = h.refresh()
    chex.assert_trees_all_close(fresh(X), model(X), **TOL)
    chex.assert_trees_all_close(fresh.params, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    assert (fresh.name, fresh.max_traces, fresh._log.callbacks) == ("net", 3, [seen])
    model.bias[...] = jnp.ones(2)  # and it follows on: refused again, refreshed again
    with pytest.raises(sm.ConfigError, match=r"^net\.params: .*\(\['bias'\]\)"):
        _ = fresh.params
    chex.assert_trees_all_close(fresh.refresh()(X), model(X), **TOL)


def test_refresh_of_a_function_over_a_module_calls_the_function():
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    h = sm.hybridize(lambda m, x: 2 * m(x), model)
    nnx.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)))
    with pytest.raises(sm.ConfigError, match=r"^<lambda>\.state: "):
        _ = h.state
    chex.assert_trees_all_close(h.refresh()(X), 2 * model(X), **TOL)


def test_refresh_of_params_given_is_refused_naming_replace():
    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    with pytest.raises(sm.ConfigError, match=r"^<lambda>\.refresh\(\): .*h\.replace\(params="):
        h.refresh()


@pytest.mark.slow
def test_reseed_is_refused_but_a_draw_is_not():
    model = _Dropped()
    h = sm.hybridize(model)
    h(X)
    model(X)  # a draw moves the module's count, not its stream: h draws from its own
    assert h.trained_in_place() == []
    _ = h.params, h.state  # read as they are
    nnx.reseed(model, dropout=7)
    said = REFUSED.format("Variables", r"state\['dropout'\]\['rngs'\]\['key'\]")
    with pytest.raises(sm.ConfigError, match=rf"^_Dropped\.state: the {said}"):
        _ = h.state
    fresh = h.refresh()
    chex.assert_trees_all_close(fresh(X), model(X), **TOL)  # the same draw


@pytest.mark.slow
def test_batchnorm_statistics_moved_by_the_modules_own_call_are_refused():
    model = nnx.Sequential(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
    h = sm.hybridize(model)
    h(X)  # the Hybrid's own call moves its own statistics, not the module's
    assert h.trained_in_place() == []
    model(X + jnp.arange(4.0))
    with pytest.raises(sm.ConfigError, match=r"\(state\['layers'\]\[1\]\['mean'\], "):
        _ = h.state


def test_deepcopy_before_and_replace_after_keep_the_old_and_apply_takes_its_params():
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    h = sm.hybridize(model)
    frozen, params = copy.deepcopy(h), h.params
    _step(model)
    chex.assert_trees_all_close(frozen.params, params)  # its own copies: never refused
    twin = h.replace(params=jax.tree.map(jnp.copy, params))  # the way out, not refused
    chex.assert_trees_all_close(twin(X), h.apply(params, X), **TOL)
    with pytest.raises(sm.ConfigError, match=r"copy\.deepcopy\(h\) before you change"):
        _ = h.params  # while the Hybrid itself says which way out


@pytest.mark.slow
def test_export_and_batcher_of_a_reseeded_module_are_refused_and_refresh_exports(tmp_path):
    """nnx.reseed changed only a stream's key, which export and a Batcher did not look at."""
    model = _Dropped()
    h = sm.hybridize(model)
    nnx.reseed(model, dropout=7)
    model.eval()  # (a setting, no Variable: the Hybrid follows it)
    said = r"state\['dropout'\]\['rngs'\]\['key'\]"
    with pytest.raises(sm.ConfigError, match=rf"^export\(_Dropped\): .*\({said}\)"):
        sm.export(h, tmp_path / "m", example=X)
    assert not (tmp_path / "m").exists()
    with pytest.raises(sm.ConfigError, match=rf"^Batcher\(.*\): .*\({said}\)"):
        sm.serving.Batcher(h, example=X)
    sm.export(h.refresh(), tmp_path / "m", example=X)
    chex.assert_trees_all_close(sm.load(tmp_path / "m")(np.asarray(X)), model(X), **TOL)


def test_a_sharded_hybrid_of_a_module_trained_in_place_is_refused():
    """A mesh's Hybrid holds replicas of the params: they were taken for other params given,
    and its export wrote the Params of hybridize, silently."""
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    h = sm.hybridize(model).shard()
    model.bias[...] = jnp.ones(2)
    assert h.trained_in_place() == ["['bias']"]
    with pytest.raises(sm.ConfigError, match=r"^Linear\.params: .*\(\['bias'\]\)"):
        _ = h.params
