"""Linen as large-model code writes it, over every feature test_authors_matrix.py runs over
MATRIX (its test functions, called here, as tests/test_authors_wmt.py calls them): flax's
"Scale up Flax Modules on multiple devices" guide (docs/guides/parallel_training/
flax_on_pjit.md) -- its ``DotReluDot`` / ``MLP``, params boxed by ``nn.with_partitioning``
(``nn.Partitioned``), activations pinned by ``with_sharding_constraint`` over its 2x4
``('data', 'model')`` mesh, hybridized boxed (as the guide inits it) and unboxed
(``nn.meta.unbox``) -- and tied weights: lm1b's ``logits_via_embedding`` (``nn.Embed.attend``),
``nn.share_scope``'s LoRA and ``nn.map_variables``'s causal Dense (their docstrings)."""

from collections.abc import Callable
from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_authors_matrix as matrix
from flax import linen as nn
from flax.training import train_state
from helpers import LM1B, Case, TransformerLM, _ints, _x
from jax.experimental import mesh_utils
from jax.lax import with_sharding_constraint
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from test_authors_matrix import exported, loaded  # noqa: F401 - the matrix's fixtures

import symjax_mlp as sm

# -- google/flax@18f8f311c275d57f46d95e41b15aa97b454754c0
# docs/guides/parallel_training/flax_on_pjit.md, as written there (the guide's 8 fake devices
# are conftest.py's)
device_mesh = mesh_utils.create_device_mesh((2, 4))
mesh = Mesh(devices=device_mesh, axis_names=("data", "model"))


def mesh_sharding(pspec: PartitionSpec) -> NamedSharding:
    return NamedSharding(mesh, pspec)


class DotReluDot(nn.Module):
    depth: int
    dense_init: Callable = nn.initializers.xavier_normal()

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(
            self.depth,
            kernel_init=nn.with_partitioning(self.dense_init, (None, "model")),
            use_bias=False,  # or overwrite with `bias_init`
        )(x)

        y = jax.nn.relu(y)
        # Force a local sharding annotation.
        y = with_sharding_constraint(y, mesh_sharding(PartitionSpec("data", "model")))

        W2 = self.param(
            "W2", nn.with_partitioning(self.dense_init, ("model", None)), (self.depth, x.shape[-1])
        )

        z = jnp.dot(y, W2)
        # Force a local sharding annotation.
        z = with_sharding_constraint(z, mesh_sharding(PartitionSpec("data", None)))

        # Return a tuple to conform with the API `flax.linen.scan` as shown in the cell below.
        return z, None


class MLP(nn.Module):
    num_layers: int
    depth: int
    use_scan: bool

    @nn.compact
    def __call__(self, x):
        if self.use_scan:
            x, _ = nn.scan(
                DotReluDot,
                length=self.num_layers,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                metadata_params={nn.PARTITION_NAME: None},
            )(self.depth)(x)
        else:
            for _i in range(self.num_layers):
                x, _ = DotReluDot(self.depth)(x)
        return x


class LogicalDotReluDot(nn.Module):
    depth: int
    dense_init: Callable = nn.initializers.xavier_normal()

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(
            self.depth,
            kernel_init=nn.with_logical_partitioning(self.dense_init, ("embed", "hidden")),
            use_bias=False,  # or overwrite with `bias_init`
        )(x)

        y = jax.nn.relu(y)
        # Force a local sharding annotation.
        y = with_sharding_constraint(y, mesh_sharding(PartitionSpec("data", "model")))

        W2 = self.param(
            "W2",
            nn.with_logical_partitioning(self.dense_init, ("hidden", "embed")),
            (self.depth, x.shape[-1]),
        )

        z = jnp.dot(y, W2)
        # Force a local sharding annotation.
        z = nn.with_logical_constraint(z, ("batch", "embed"))
        return z, None


class LogicalMLP(nn.Module):
    num_layers: int
    depth: int
    use_scan: bool

    @nn.compact
    def __call__(self, x):
        if self.use_scan:
            x, _ = nn.scan(
                LogicalDotReluDot,
                length=self.num_layers,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                metadata_params={nn.PARTITION_NAME: "layer"},
            )(self.depth)(x)
        else:
            for _i in range(self.num_layers):
                x, _ = LogicalDotReluDot(self.depth)(x)
        return x


def init_fn(k, x, model, optimizer):
    variables = model.init(k, x)  # Initialize the model.
    state = train_state.TrainState.create(  # Create a `TrainState`.
        apply_fn=model.apply, params=variables["params"], tx=optimizer
    )
    return state


# -- google/flax@18f8f311c275d57f46d95e41b15aa97b454754c0 flax/linen/module.py, share_scope's
# docstring, as written there
class DenseLoRA(nn.Module):
    base: nn.Dense
    rank: int

    def setup(self):
        nn.share_scope(self, self.base)

    @nn.compact
    def __call__(self, x: jax.Array):
        din, dout = x.shape[-1], self.base.features
        A = self.param("A", nn.zeros_init(), (din, self.rank))
        B = self.param("B", nn.zeros_init(), (self.rank, dout))
        return self.base(x) + x @ A @ B


class Model(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array):
        dense = nn.Dense(10)  # base scope
        return DenseLoRA(dense, rank=2)(x)  # reuse the base scope


# -- google/flax@18f8f311c275d57f46d95e41b15aa97b454754c0 flax/linen/transforms.py,
# map_variables's docstring, as written there
class CausalDense(nn.Module):
    """A dense layer that masks the weights such that the output is
    causal, i.e. output i only depends on input <= i.
    """

    features: int

    def apply_mask(self, variables):
        return (
            jax.tree_util.tree_map(jnp.triu, variables) if not self.is_initializing() else variables
        )

    def setup(self):
        # temporary class
        _CausalDense = nn.map_variables(
            nn.Dense, "params", self.apply_mask, init=self.is_initializing()
        )
        self.dense = _CausalDense(features=self.features, use_bias=False)

    def __call__(self, x):
        return self.dense(x)


# ---------------------------------------------------------------------------------------------
def _init(model, *example, unbox=False):
    """The guide's ``model.init(k, x)`` (boxed), or its ``nn.meta.unbox`` of it."""

    def build():
        variables = model.init(jax.random.key(0), *example)
        return model, nn.meta.unbox(variables) if unbox else variables

    return build


X8 = jnp.ones((8, 8))  # the guide's x: (BATCH, DEPTH), tiny
TIED = LM1B.replace(logits_via_embedding=True)
CASES = (
    Case("pjit_mlp", "linen", _init(MLP(2, 8, False), X8), lambda s: (_x(s, (8, 8)),), classes=8),
    Case("pjit_mlp_scan", "linen", _init(MLP(2, 8, True), X8), lambda s: (_x(s, (8, 8)),),
         classes=8,
         allow=frozenset({"dynamic_slice", "dynamic_update_slice", "real_dynamic_slice"})),
    Case("pjit_mlp_unboxed", "linen", _init(MLP(2, 8, False), X8, unbox=True),
         lambda s: (_x(s, (8, 8)),)),
    Case("lm1b_tied", "linen", _init(TransformerLM(TIED.replace(deterministic=True)),
                                     jnp.ones((2, 8), jnp.int32)),
         lambda s: (_ints(s, (2, 8), 16),),
         allow=frozenset({"gather", "scatter", "real_dynamic_slice"})),
    Case("share_scope_lora", "linen", _init(Model(), jnp.ones((1, 5))), lambda s: (_x(s),),
         classes=10),
    Case("map_variables_causal", "linen", _init(CausalDense(5), jnp.ones((1, 5))),
         lambda s: (_x(s),), classes=5),
)  # fmt: skip
IDS = [c.name for c in CASES]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_compiled_equals_eager_equals_flax(case):
    matrix.test_compiled_equals_eager_equals_the_plain_framework(case, "train")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_grads_stage_and_graph(case):
    matrix.test_grads_through_apply_equal_the_frameworks(case)
    matrix.test_stage_and_graph_count_the_same_layers(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_export_load_batcher_vmap_grad_and_timeit(case, exported, loaded, tmp_path, monkeypatch):  # noqa: F811
    if case.name.startswith("pjit"):  # its program holds the 2x4 mesh's shardings
        h, path = exported(case)
        with pytest.raises(sm.ArtifactError, match="sharded over 8 devices; IREE runs single"):
            sm.load(path, runtime="iree")
        m = sm.load(path, allow=set(case.allow) or None)  # on the mesh it was exported for
        xs = case.inputs(1)
        chex.assert_trees_all_close(m(*map(np.asarray, xs)), h(*xs), **matrix.TOL)
        with jax.set_mesh(mesh):  # under jax.vmap/jax.grad, the mesh set around it
            matrix.test_vmap_and_grad_over_the_loaded_model_equal_the_sources(case, loaded)
        matrix.test_a_batcher_on_the_artifact_and_on_the_hybrid_gives_the_direct_rows(case, loaded)
        assert sm.timeit(h, *xs, calls=2, repeats=1, warmup=1).calls == 2
        with pytest.raises(sm.ConfigError, match="runs sharded over 8 devices; time an artifact"):
            sm.timeit(m, *map(np.asarray, xs))
        return
    matrix.test_export_loads_in_jax_and_iree_as_the_source(case, exported, tmp_path, monkeypatch)
    matrix.test_a_batcher_on_the_artifact_and_on_the_hybrid_gives_the_direct_rows(case, loaded)
    matrix.test_vmap_and_grad_over_the_loaded_model_equal_the_sources(case, loaded)
    matrix.test_timeit_times_the_hybrid_and_the_loaded_model(case, loaded)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.classes], ids=lambda c: c.name)
def test_trains(case):
    """The guide's MLP pins its activations to its mesh: its params came back from the first
    step placed there, and the second step's trace was a RetraceError naming two identical
    signatures; now traced once more, for that placement, and no more."""
    matrix.test_a_classifier_trains_or_is_refused_naming_a_fix_that_trains(case)
    if case.name == "pjit_mlp":
        run = sm.training.train(case.build()[0], matrix._dataset(case), epochs=2, batch_size=4)
        assert run.trace_count == 2 and jax.tree.leaves(run.params)[0].sharding.mesh == mesh


@pytest.mark.slow
def test_the_guides_logical_mlp_runs_trains_exports_and_shards_as_flax(tmp_path):
    """The guide's logical half: ``LogicallyPartitioned`` params placed over the mesh by
    ``nn.get_partition_spec`` / ``nn.logical_to_mesh_sharding`` (its ``logical_jit_init_fn``),
    applied under its mesh and rules; grads come back boxed as flax's do; its train_step with
    ``h.apply`` for ``model.apply`` moves the state as flax's."""
    rules = (("batch", "data"), ("hidden", "model"))
    k, x_sharding = jax.random.key(0), mesh_sharding(PartitionSpec("data", None))
    x, model, optimizer = (
        jax.device_put(_x(5, (8, 8)), x_sharding),
        LogicalMLP(2, 8, False),
        optax.adam(1e-3),
    )
    abstract = jax.eval_shape(partial(init_fn, model=model, optimizer=optimizer), k, x)
    sharding = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    init = jax.jit(init_fn, static_argnums=(2, 3), out_shardings=sharding,
                   in_shardings=(mesh_sharding(PartitionSpec()), x_sharding))  # fmt: skip
    state = init(k, x, model, optimizer)
    h = sm.hybridize(model, {"params": state.params})
    is_box = lambda a: isinstance(a, nn.LogicallyPartitioned)  # noqa: E731

    def train_step(apply, state, x):
        grads = jax.grad(lambda p: apply({"params": p}, x).sum())(state.params)
        return state.apply_gradients(grads=grads), grads

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        want = model.apply({"params": state.params}, x)
        chex.assert_trees_all_close(h(x), want, **matrix.TOL)
        chex.assert_trees_all_close(h.eager(x), want, **matrix.TOL)
        new, grads = jax.jit(partial(train_step, model.apply))(state, x)
        got_new, got = jax.jit(partial(train_step, h.apply))(state, x)
    assert all(map(is_box, jax.tree.leaves(got, is_leaf=is_box)))  # boxed, as flax's
    chex.assert_trees_all_close(got, grads, **matrix.TOL)
    chex.assert_trees_all_close(got_new.params, new.params, **matrix.TOL)
    sm.export(h, tmp_path / "m", example=np.ones((8, 8), np.float32))
    m = sm.load(tmp_path / "m")
    chex.assert_trees_all_close(m(np.asarray(x)), want, **matrix.TOL)
    assert sorted(m.params) == sorted(f"{p}/value" for p in _paths(nn.unbox(h.params)))
    chex.assert_trees_all_close(sm.shard(h, mesh)(x), want, **matrix.TOL)


def _paths(tree):
    return ["/".join(str(k.key) for k in path) for path, _ in jax.tree.leaves_with_path(tree)]


@pytest.mark.slow
def test_a_mesh_of_its_devices_but_not_its_shape_is_refused_naming_the_programs(exported):  # noqa: F811
    """Its program runs on its 2x4 mesh only: on a mesh of 8 of another shape (load's mesh=,
    or one set around the call) the ArtifactError said it was corrupted; export it again."""
    h, path = exported(CASES[0])
    x = np.asarray(CASES[0].inputs(1)[0])
    chex.assert_trees_all_close(sm.load(path, mesh=mesh)(x), h(x), **matrix.TOL)
    fix = r"\{'data': 2, 'model': 4\}.*not the \{'data': 8\}.*\(\(2, 4\), \('data', 'model'\)\)"
    with pytest.raises(sm.ConfigError, match=fix):
        sm.load(path, mesh=sm.data_mesh(8))(x)
    m = sm.load(path)
    with jax.set_mesh(sm.data_mesh(8)), pytest.raises(sm.ConfigError, match=fix):
        m(x)
    chex.assert_trees_all_close(m(x), h(x), **matrix.TOL)  # on its own mesh again
    # under jax.jit, the mesh to set around it: it named a 1-D one, on which it fails
    with pytest.raises(sm.ConfigError, match=r"jax\.make_mesh\(\(2, 4\), \('data', 'model'\)\)"):
        jax.jit(m)(x)
    want = h(x)
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"))):  # as it says: Explicit axes
        chex.assert_trees_all_close(jax.jit(m)(x), want, **matrix.TOL)


@pytest.mark.slow
def test_the_guides_mlp_shards_over_its_mesh_and_exports_sharded(tmp_path):
    """``sm.shard`` over the guide's 2x4 mesh (batch over 'data'), boxed params: as flax, and
    its artifact loads on that mesh by default."""
    model, variables = CASES[0].build()
    x = np.asarray(_x(7, (8, 8)))
    want = model.apply(variables, x)  # eager flax under set_mesh unboxes by a constraint: raises
    s = sm.shard(sm.hybridize(model, variables), mesh)
    chex.assert_trees_all_close(s(x), want, **matrix.TOL)
    sm.export(s, tmp_path / "m", example=x)
    chex.assert_trees_all_close(sm.load(tmp_path / "m")(x), want, **matrix.TOL)
