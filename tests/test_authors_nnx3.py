"""Flax nnx as its authors write it, round three (google/flax@18f8f311c275d57f46d95e41b15aa97b454
754c0), sizes made tiny: docs_nnx/guides/performance.md's Model (its BatchNorm and Dropout
switched by constructor attributes, use_running_average=False and deterministic=False, its
Dropout drawing from the module's own nnx.Rngs) trained by ``nnx.Optimizer`` in an ``nnx.jit``
step, by ``nnx.cached_partial`` and by the guide's functional split/merge loop under ``jax.jit``;
examples/nnx_toy_examples/09_parameter_surgery.py's Classifier (a pretrained backbone assigned
after construction); 10_fsdp_and_optimizer.py's MLP (params sharded over a 2 x 4 mesh by their
``out_sharding`` metadata) trained by its own ``nnx.Pytree`` SGD. Each runs over the features
test_authors_matrix.py runs over MATRIX (its test functions, called here), or as its source runs.
"""

import copy
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_authors_matrix as matrix
from flax import nnx
from helpers import Case, _x, keyless
from jax.experimental import mesh_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_authors_matrix import exported, loaded  # noqa: F401 - the matrix's fixtures

import symjax_mlp as sm

pytestmark = pytest.mark.slow
TOL = {"rtol": 2e-5, "atol": 2e-5}


# -- docs_nnx/guides/performance.md, as written there -----------------------------------------
class Model(nnx.Module):
    def __init__(self, din, dmid, dout, rngs: nnx.Rngs):
        self.linear = nnx.Linear(din, dmid, rngs=rngs)
        self.bn = nnx.BatchNorm(dmid, use_running_average=False, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, deterministic=False, rngs=rngs)
        self.linear_out = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.dropout(self.bn(self.linear(x))))
        return self.linear_out(x)


def _performance(mode: str):
    def build():
        model = Model(2, 8, 3, rngs=nnx.Rngs(0))  # eager initialization
        if mode == "eval":
            model.eval()
        return model, None

    return build


# -- examples/nnx_toy_examples/09_parameter_surgery.py, as written there ----------------------
def load_pretrained():  # "lets pretend this function loads a pretrained model from a checkpoint"
    return nnx.Linear(16, 8, rngs=nnx.Rngs(0))


class Classifier(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.backbone = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
        self.head = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, x):
        x = self.backbone(x)
        x = nnx.relu(x)
        x = self.head(x)
        return x


def _surgery():
    model = Classifier(rngs=nnx.Rngs(42))
    model.backbone = load_pretrained()
    return model, None


# -- docs_nnx/guides/view.md, as written there: modes set by nnx.view, the views sharing the
# model's Variables (its eval view as the guide's first one sets it) --------------------------
class MyModel(nnx.Module):
    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, dropout_rate: float, *,
                 rngs: nnx.Rngs):  # fmt: skip
        self.lin1 = nnx.Linear(in_dim, hidden_dim, rngs=rngs)
        self.do = nnx.Dropout(dropout_rate)
        self.bn = nnx.BatchNorm(hidden_dim, rngs=rngs)
        self.lin2 = nnx.Linear(hidden_dim, out_dim, rngs=rngs)

    def __call__(self, x, *, rngs=None):
        x = nnx.relu(self.do(self.bn(self.lin1(x)), rngs=rngs))
        return self.lin2(x)


def _view(mode: str):
    def build():
        model = MyModel(16, 8, 2, 0.1, rngs=nnx.Rngs(0))
        if mode == "train":
            return nnx.view(model, deterministic=False), None
        return nnx.view(model, deterministic=True, use_running_average=True), None

    return build


CASES = (
    Case("nnx_performance", "nnx", _performance("train"), lambda s: (_x(s, (4, 2)),),
         served=_performance("eval")),
    Case("nnx_surgery", "nnx", _surgery, lambda s: (_x(s, (4, 16)),), classes=10),
    Case("nnx_view", "nnx", _view("train"), lambda s: (_x(s, (4, 16)),),
         train={"rngs": lambda: nnx.Rngs(5)}, served=_view("eval")),
)  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_matrix_feature(case, exported, loaded, tmp_path, monkeypatch):  # noqa: F811
    for mode in ("train", "eval") if case.served else ("train",):
        matrix.test_compiled_equals_eager_equals_the_plain_framework(case, mode)
    matrix.test_grads_through_apply_equal_the_frameworks(case)
    matrix.test_stage_and_graph_count_the_same_layers(case)
    if case.classes:
        matrix.test_a_classifier_trains_or_is_refused_naming_a_fix_that_trains(case)
    matrix.test_export_loads_in_jax_and_iree_as_the_source(case, exported, tmp_path, monkeypatch)
    matrix.test_a_batcher_on_the_artifact_and_on_the_hybrid_gives_the_direct_rows(case, loaded)
    matrix.test_vmap_and_grad_over_the_loaded_model_equal_the_sources(case, loaded)
    matrix.test_timeit_times_the_hybrid_and_the_loaded_model(case, loaded)


# -- performance.md's nnx.Optimizer step, its nnx.cached_partial and its functional loop ------
@nnx.jit  # <== currently slow
def train_step(model, optimizer, metrics, x, y):
    def loss_fn(model):
        y_pred = model(x)  # call methods directly
        return ((y_pred - y) ** 2).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)  # in-place updates
    metrics.update(loss=loss)

    return loss


def _guide_objects():
    model = Model(2, 8, 3, rngs=nnx.Rngs(0))  # eager initialization
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    return model, optimizer, metrics


XY = _x(1, (4, 2)), _x(2, (4, 3))


def test_a_cached_partial_is_refused_naming_the_module_given_to_the_hybrid():
    """``sm.hybridize(nnx.cached_partial(f, model))`` was refused as a function wanting params,
    naming ``hybridize(lambda _, x: f(x), {})``, whose first call raised flax's raw
    TraceContextError (the cached module's Variables, written from inside the compiled call)."""
    model, optimizer, metrics = _guide_objects()
    forward = nnx.jit(lambda m, x: m(x))
    with pytest.raises(sm.ConfigError, match=r"closes over an nnx Model .*cached_partial.*"
                       r"sm\.hybridize\(f, model\)"):  # fmt: skip
        sm.hybridize(nnx.cached_partial(forward, model))
    with pytest.raises(sm.ConfigError, match=r"closes over an nnx Model"):
        sm.hybridize(nnx.cached_partial(train_step, model, optimizer, metrics))
    h = sm.hybridize(lambda _, x: nnx.cached_partial(forward, model)(x), {})  # the old advice
    with pytest.raises(sm.ConfigError, match=r"wrote an nnx Variable made outside .*"
                       r"TraceContextError.*sm\.hybridize\(f, model\)"):  # fmt: skip
        h(XY[0])
    want = Model(2, 8, 3, rngs=nnx.Rngs(0))
    h = sm.hybridize(forward, model)  # as it says: the module's state carried
    for _ in range(2):
        chex.assert_trees_all_close(h(XY[0]), want(XY[0]), **TOL)
    want_state = nnx.state(want, nnx.Not(nnx.Param))
    chex.assert_trees_all_close(keyless(h.state), keyless(want_state), **TOL)


def test_a_jit_of_a_module_is_refused_naming_the_module_itself():
    """``sm.hybridize(nnx.jit(model))`` (or ``jax.jit(model)``) was refused as a function
    wanting params, naming ``hybridize(lambda _, x: f(x), {})``; it names the module's own
    Hybrid, which is jit-compiled already, and that runs as the module does."""
    model, _, _ = _guide_objects()
    for jitted in (nnx.jit(model), jax.jit(model)):
        with pytest.raises(sm.ConfigError, match=r"fn is nnx\.jit \(or jax\.jit\) of an nnx "
                           r"Model.*sm\.hybridize\(model\)"):  # fmt: skip
            sm.hybridize(jitted)
    chex.assert_trees_all_close(sm.hybridize(model)(XY[0]), model(XY[0]), **TOL)


def test_the_guides_functional_loop_hybridized_trains_as_jax_jit():
    """performance.md's jax_train_step over nnx.split((model, optimizer, metrics)): the state
    (Params, adam's moments, BatchStats, the Dropout's rng key and count, the metric's sums)
    the Hybrid's params, as the refusal above names it."""
    graphdef, state = nnx.split(_guide_objects())

    def jax_train_step(graphdef, state, x, y):
        model, optimizer, metrics = nnx.merge(graphdef, state)

        def loss_fn(model):
            y_pred = model(x)  # call methods directly
            return ((y_pred - y) ** 2).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        metrics.update(loss=loss)

        state = nnx.state((model, optimizer, metrics))
        return loss, state

    h = sm.hybridize(lambda state, x, y: jax_train_step(graphdef, state, x, y), state)
    step = jax.jit(jax_train_step, static_argnums=0)
    got, want = state, state
    for _ in range(3):
        loss, got = h.apply(got, *XY)
        want_loss, want = step(graphdef, want, *XY)
        chex.assert_trees_all_close(loss, want_loss, **TOL)
    chex.assert_trees_all_close(*(keyless(s) for s in (got, want)), **TOL)
    _, _, metrics = nnx.merge(graphdef, got)  # nnx.update's objects, trained
    assert int(metrics.loss.count[...]) == 3


# -- examples/nnx_toy_examples/10_fsdp_and_optimizer.py, as written there (over conftest's 8
# CPU devices; the plots and the 10,000 steps left out) ---------------------------------------
@dataclasses.dataclass(unsafe_hash=True)
class MeshRules:
    embed: str | None = None
    mlp: str | None = None
    data: str | None = None

    def __call__(self, *keys: str) -> tuple[str, ...]:
        return tuple(getattr(self, key) for key in keys)


mesh_rules = MeshRules(embed=None, mlp="model", data="data")


class MLP(nnx.Module):
    def __init__(self, din, dmid, dout, rngs: nnx.Rngs):
        self.w1 = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (din, dmid)),
                            out_sharding=mesh_rules("embed", "mlp"))  # fmt: skip
        self.b1 = nnx.Param(jnp.zeros((dmid,)), out_sharding=mesh_rules("mlp"))
        self.w2 = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (dmid, dout)),
                            out_sharding=mesh_rules("embed", "mlp"))  # fmt: skip

    def __call__(self, x: jax.Array):
        return nnx.relu(x @ self.w1 + self.b1) @ self.w2


class SGDState(nnx.Variable):
    pass


class SGD(nnx.Pytree):
    def __init__(self, params: nnx.State, lr, decay=0.9):
        def init_optimizer_state(variable: nnx.Variable):
            return SGDState(jnp.zeros_like(variable[...]), **variable.get_metadata())

        self.lr = lr
        self.params = nnx.data(params)
        self.momentum: nnx.State = nnx.data(jax.tree.map(
            init_optimizer_state, self.params, is_leaf=lambda x: isinstance(x, nnx.Variable)
        ))  # fmt: skip
        self.decay = decay

    def update(self, grads: nnx.State):
        def update_fn(params: nnx.Variable, momentum: SGDState, grad: nnx.Variable):
            momentum[...] = self.decay * momentum[...] + (1 - self.decay) * grad[...]
            params[...] -= self.lr * momentum[...]

        jax.tree.map(update_fn, self.params, self.momentum, grads,
                     is_leaf=lambda x: isinstance(x, nnx.Variable))  # fmt: skip


@nnx.jit
def create_model():
    model = MLP(1, 8, 1, rngs=nnx.Rngs(0))
    optimizer = SGD(nnx.variables(model, nnx.Param), 0.01, decay=0.9)
    return model, optimizer


@nnx.jit
def fsdp_train_step(model: MLP, optimizer: SGD, x, y):
    def loss_fn(model):
        y_pred = model(x)
        return jnp.mean((y - y_pred) ** 2)

    loss, grad = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(grad)
    return loss


def test_the_fsdp_mlp_runs_differentiates_trains_and_exports_sharded(tmp_path):
    mesh = jax.sharding.Mesh(mesh_utils.create_device_mesh((2, 4)), ("data", "model"))
    with jax.set_mesh(mesh):
        model, optimizer = create_model()
    X = np.linspace(-2, 2, 8, dtype=np.float32)[:, None]
    x, y = jax.device_put((X, 0.8 * X**2 + 0.1), NamedSharding(mesh, P("data")))
    h = sm.hybridize(model)
    assert h.params["w1"].sharding.spec == P(None, "model")  # held as nnx placed them
    for call in (h, h.eager):
        chex.assert_trees_all_close(call(x), model(x), **TOL)
    grads = jax.grad(lambda p: jnp.mean((y - h.apply(p, x)) ** 2))(h.params)
    want = nnx.grad(lambda m: jnp.mean((y - m(x)) ** 2))(model)
    chex.assert_trees_all_close(grads, nnx.to_pure_dict(want), **TOL)
    before = h(x)
    losses = [float(fsdp_train_step(model, optimizer, x, y)) for _ in range(3)]
    assert losses[-1] < losses[0]
    chex.assert_trees_all_close(h(x), before)  # the Hybrid holds the params it was given
    trained = h.replace(params=nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    chex.assert_trees_all_close(trained(x), model(x), **TOL)
    sm.export(trained, tmp_path / "m", example=x)
    chex.assert_trees_all_close(sm.load(tmp_path / "m")(X), np.asarray(model(x)), **TOL)


# -- examples/nnx_toy_examples/01_functional_api.py, as written there (its jax.jit train_step
# raises flax's TraceContextError on flax 0.12: the counts jit rebuilds are written inside
# jax.grad's trace; its test_step and the merge it does by hand run) ---------------------------
class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.uniform(rngs.params(), (din, dout)))
        self.b = nnx.Param(jnp.zeros((dout,)))

    def __call__(self, x):
        return x @ self.w[...] + self.b[...]


class Count(nnx.Variable[nnx.A]):
    pass


class FunctionalMLP(nnx.Module):  # the example's MLP
    def __init__(self, din, dhidden, dout, *, rngs: nnx.Rngs):
        self.count = Count(jnp.array(0))
        self.linear1 = Linear(din, dhidden, rngs=rngs)
        self.linear2 = Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x):
        self.count[...] += 1
        return self.linear2(jax.nn.relu(self.linear1(x) * 0.5))


def test_counts_made_outside_jax_grad_are_refused_naming_a_copy_made_inside():
    """h.apply(p, counts, x) of the example's merge by hand, its counts (an nnx.State of Count)
    made outside jax.grad: the refusal said '(an nnx.Rngs advances per draw)' and named
    rngs=nnx.Rngs(key), which a Count is not."""
    graphdef, params, counts = nnx.split(
        FunctionalMLP(din=1, dhidden=8, dout=1, rngs=nnx.Rngs(0)), nnx.Param, Count
    )

    def test_step(params: nnx.State, counts: nnx.State, batch):
        x, y = batch
        model = nnx.merge(graphdef, params, counts)
        y_pred = model(x)
        loss = jnp.mean((y - y_pred) ** 2)
        return {"loss": loss}

    h, batch = sm.hybridize(test_step, params), (XY[0][:, :1], XY[1][:, :1])
    chex.assert_trees_all_close(h(counts, batch), jax.jit(test_step)(params, counts, batch))
    assert int(counts["count"][...]) == 1  # written back, as eager nnx leaves it

    def loss(p, counts):
        return h.apply(p, counts, batch)["loss"]

    with pytest.raises(sm.ConfigError, match=r"nnx Count given was made outside .*"
                       r"nnx\.clone\(state\) inside the loss") as e:  # fmt: skip
        jax.grad(loss)(h.params, counts)
    assert "nnx.Rngs" not in str(e.value)
    got = jax.grad(lambda p: loss(p, nnx.clone(counts)))(h.params)  # as it says
    want = jax.grad(lambda p: test_step(p, nnx.clone(counts), batch)["loss"])(params)
    chex.assert_trees_all_close(got, want, **TOL)


def test_the_guides_optimizer_step_trains_h_module_and_replace_gives_the_hybrid_it():
    """performance.md's nnx.Optimizer step over h.module: a module rebuilt at each read, trained
    in place as the guide trains its model; the Hybrid holds its own params and state until
    h.replace gives it the trained module's (Params, BatchStats, the Dropout's rng)."""
    h = sm.hybridize(Model(2, 8, 3, rngs=nnx.Rngs(0)))
    model, before = h.module, jax.tree.map(np.asarray, h.params)
    assert model is not h.module
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    losses = [float(train_step(model, optimizer, metrics, *XY)) for _ in range(3)]
    assert losses[-1] < losses[0]
    chex.assert_trees_all_close(h.params, before)  # the Hybrid's own
    assert not np.allclose(model.linear.kernel[...], before["linear"]["kernel"])
    params, state = (nnx.to_pure_dict(nnx.state(model, f)) for f in (nnx.Param, nnx.Not(nnx.Param)))
    trained = h.replace(params=params, state=state)
    for _ in range(2):  # train mode: Dropout draws from the trained module's stream, as it does
        chex.assert_trees_all_close(trained(XY[0]), model(XY[0]), **TOL)


def test_a_hybrid_of_a_view_trained_in_place_is_refused_at_export_naming_replace(tmp_path):
    """view.md's loop: train_step over the train view, the eval view sharing its Variables.
    A Hybrid made of the eval view before training holds its params as of sm.hybridize; its
    export wrote the untrained ones (loss 1.76 every epoch where eval_step fell to 0.98)."""
    rngs = nnx.Rngs(0)
    x, y = rngs.normal((16, 16)), rngs.normal((16, 2))
    model = MyModel(16, 8, 2, 0.1, rngs=rngs)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    train_model = nnx.view(model, deterministic=False)  # training view
    eval_model = nnx.view(model, deterministic=True, use_running_average=True)

    @nnx.jit
    def train_step(model, optimizer, x, y, rngs):
        def loss_fn(model, rngs):
            return ((model(x, rngs=rngs) - y) ** 2).mean()

        grads = nnx.grad(loss_fn)(model, rngs)
        optimizer.update(model, grads)

    h = sm.hybridize(eval_model)
    assert h.trained_in_place() == []
    train_step(train_model, optimizer, x, y, rngs)
    assert "['lin1']['kernel']" in h.trained_in_place()
    head = r"holds other Variables \(\['bn'\]\['bias'\], .* and 5 more\) .*trained in place since"
    with pytest.raises(sm.ConfigError, match=head + r" sm\.hybridize.*h\.replace\(params="):
        sm.export(h, tmp_path / "m", example=x)
    assert not (tmp_path / "m").exists()
    with pytest.raises(sm.ConfigError, match=r"^Batcher\(.*\): .*" + head):  # nor served
        sm.serving.Batcher(h, example=x)
    params = nnx.to_pure_dict(nnx.state(eval_model, nnx.Param))
    trained = h.replace(params=params, state=nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))
    sm.export(trained, tmp_path / "m", example=x)  # as it says
    chex.assert_trees_all_close(sm.load(tmp_path / "m")(np.asarray(x)), eval_model(x), **TOL)
    as_hybridized = copy.deepcopy(h)  # as it says: its own copies, whatever the module does
    assert as_hybridized.trained_in_place() == []
    with pytest.raises(sm.ConfigError, match=r"^MyModel\.params: .*h = h\.refresh\(\)"):
        _ = h.params  # the old ones, read as if they were the module's
