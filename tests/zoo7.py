"""The models of test_authors_round7.py: Flax's own guides, as their authors wrote them (sizes cut
in the tests, not here), from google/flax@18f8f311c275d57f46d95e41b15aa97b454754c0. Classes the
guides all call ``Model`` (or ``Block``) are renamed by their guide and section, said at each.

- docs/guides/flax_fundamentals/rng_guide.md: "Managing RNG streams inside a training loop"
  (``SubModule``, ``Model`` -> ``RngLoopModel``, its ``update`` made by ``make_update``),
  "Using jax.jit" (``Model`` -> ``NoiseModel``: ``make_rng('params')`` inside ``apply``, a
  traced ``add_noise`` flag), the
  lifted ``nn.vmap`` (``Model`` -> ``VmapModel`` and ``BatchModel``) and ``nn.scan``
  (``ResidualMLPBlock``, ``ScanMLP``), and the sharp edge (``Leaf``, ``Node``, ``Model`` ->
  ``SharpEdgeModel``: no params at all, a stream named ``'rng'``);
- docs/guides/converting_and_upgrading/haiku_migration_guide.rst, the Flax side: "Handling State"
  (``Block`` -> ``BnBlock``, ``Model`` -> ``BnModel``, its ``train_step`` made by
  ``make_bn_train_step(model)``), "Using Multiple Methods" (``AutoEncoder``), "Lifted
  Transforms" (``RNNCell``, ``RNN``) and the top-level ``FooModule`` (a counter); its "Scan over
  layers" is linen_to_nnx.rst's Linen side, tests/helpers.py's ``ScanLayersMLP``, covered;
- docs/guides/model_inspection/model_surgery.md (``CNN`` -> ``SurgeryCNN``, ``surgery``: its
  flatten / normalize ``Dense_1/kernel`` / unflatten / freeze steps as one function);
- docs/guides/parallel_training/ensembling.rst, its Ensemble side (``make_ensemble``: its
  pmapped functions; its CNN, examples/mnist's, is ``SurgeryCNN`` less the last
  ``log_softmax``, under which its softmax and cross-entropy are the same: ``SurgeryCNN`` here);
- docs/guides/flax_sharp_bits.md (``MyModel``: the dropout mode a module attribute);
- docs/guides/training_techniques/lr_schedule.rst, its schedule side (``get_config``,
  ``compute_metrics``, ``create_learning_rate_fn``, ``train_step`` made by
  ``make_lr_train_step``, ``create_train_state``);
- docs_nnx/guides/surgery.md (``TwoLayerMLP``: its swapping, sharing, weight-tying and
  monkey-patching done in the tests, as the guide does them to a made model; its checkpoint
  surgery's ``ModifiedTwoLayerMLP`` and ``process_raw_dict``, its ``partial_init``);
- docs_nnx/guides/pytree.md (``Linear`` -> ``PytreeLinear`` and ``forward``: an nnx module as
  a jitted function's argument; ``nnx.Pytree``'s ``Linear`` -> ``DataLinear``, ``MLP`` ->
  ``DataMLP``, and ``Bar``);
- docs_nnx/guides/jax_and_nnx_transforms.rst, "Differences" (its two ``train_step`` s ->
  ``nnx_train_step`` and ``jax_train_step``);
- docs_nnx/migrating/haiku_to_flax.rst, its Flax NNX side (``Block``, ``Model``, ``train_step``,
  ``AutoEncoder``, ``RNNCell``, ``RNN``, ``FooModule`` prefixed ``Nnx``, ``train_step`` ->
  ``nnx_hk_train_step``; ``Counter``; its ``MLP`` of ``nnx.split_rngs`` / ``nnx.vmap`` /
  ``nnx.scan`` is nnx_toy_examples 06's ``ScanMLP``, in tests/zoo6.py);
- docs_nnx/guides/flax_gspmd.md (``DotReluDot``, ``MultiDotReluDot``, ``train_step`` ->
  ``gspmd_train_step``; its mesh is made in the test, with ``AxisType.Auto`` axes: the guide's
  ``jax.make_mesh((2, 4), ...)`` makes Explicit axes in the installed JAX 0.10, under which its
  own ``model(input)`` raises ShardingTypeError, contracting dims sharded).
"""

# ruff: noqa: E501 (the authors' code, as written)

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx, traverse_util
from flax.core import freeze
from jax.sharding import PartitionSpec as P


# -- rng_guide.md, "Managing RNG streams inside a training loop", as written there --------------
class SubModule(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        # variables created using `self.param` will use `self.make_rng('params')`
        kernel = self.param("submodule_kernel", jax.random.normal, x.shape)
        x = x + kernel
        # `nn.Dropout` will use self.make_rng('dropout')
        x = nn.Dropout(0.2)(x, deterministic=not train)
        # `nn.Dense` will use self.make_rng('params')
        x = nn.Dense(3)(x)
        return x


class RngLoopModel(nn.Module):  # the guide's Model
    @nn.compact
    def __call__(self, x, train):
        # make kernel use `self.make_rng('other')`
        kernel = self.variable(
            "other_collection",
            "module_kernel",
            lambda: jax.random.normal(self.make_rng("other"), x.shape),
        )
        x = x + kernel.value  # `.value` will extract the underlying value of the variable
        x = SubModule()(x, train)
        # `nn.Dropout` will use self.make_rng('dropout')
        x = nn.Dropout(0.2)(x, deterministic=not train)
        # `nn.Dense` will use self.make_rng('params')
        x = nn.Dense(2)(x)
        return x


def make_update(module, x, y):
    """The guide's ``update`` (its globals ``module``, ``x``, ``y`` made arguments)."""

    def update(variables, rng):
        # we don't need to provide a 'params' or 'other' rng, as only 'dropout' rng will be used during training
        # split the rng to get a dropout_rng to be used for this training iteration,
        # and to get another rng key to be used for the next training iteration
        dropout_rng, next_rng = jax.random.split(rng)

        def loss(params):
            out = module.apply(
                {"params": params, "other_collection": variables["other_collection"]},
                x,
                train=True,
                rngs={"dropout": dropout_rng},
            )
            return jnp.mean((y - out) ** 2)

        grads = jax.grad(loss)(variables["params"])
        params = jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, variables["params"], grads)
        return {
            "params": params,
            "other_collection": variables["other_collection"],
        }, next_rng

    return update


# -- rng_guide.md, "Using jax.jit", as written there ---------------------------------------------
class NoiseModel(nn.Module):  # the guide's Model
    @nn.compact
    def __call__(self, x, add_noise):
        x = nn.Dense(1)(x)
        # use jnp.where for control flow; for more details see: https://jax.readthedocs.io/en/latest/errors.html#jax.errors.TracerBoolConversionError
        return jnp.where(add_noise, x + jax.random.normal(self.make_rng("params"), x.shape), x)


# -- rng_guide.md, "Lifted transforms": nn.vmap, as written there --------------------------------
class VmapModel(nn.Module):  # the guide's Model
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(2)(x)
        kernel = self.variable(
            "other_collection",
            "kernel",
            lambda: jax.random.normal(self.make_rng("other"), x.shape),
        )
        return x + kernel.value


BatchModel = nn.vmap(
    VmapModel,
    in_axes=0,
    out_axes=0,
    variable_axes={"params": 0, "other_collection": 0},
    split_rngs={"params": True, "other": True},
)


# -- rng_guide.md, "Lifted transforms": nn.scan, as written there --------------------------------
class ResidualMLPBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(features=2)(x)
        h = nn.relu(h)
        return x + h, None  # return an empty carry


ScanMLP = nn.scan(
    ResidualMLPBlock,
    variable_axes={"params": 0},
    variable_broadcast=False,
    split_rngs={"params": True},
    length=3,
)


# -- rng_guide.md, "Sharp edge - unintentionally generating the same values", as written there ---
class Leaf(nn.Module):
    def __call__(self, x):
        return x + jax.random.randint(self.make_rng("rng"), (), 0, 100)


class Node(nn.Module):
    leaf_name: str

    @nn.compact
    def __call__(self, x):
        return Leaf(name=self.leaf_name)(x)


class SharpEdgeModel(nn.Module):  # the guide's Model
    @nn.compact
    def __call__(self, x):
        return (
            Node(name="ab", leaf_name="cdef")(x),
            Node(name="abc", leaf_name="def")(x),
        )


# -- haiku_migration_guide.rst, "Handling State" (Flax), as written there ------------------------
class BnBlock(nn.Module):  # the guide's Block
    features: int

    @nn.compact
    def __call__(self, x, training: bool):
        x = nn.Dense(self.features)(x)
        x = nn.BatchNorm(momentum=0.99)(x, use_running_average=not training)
        x = jax.nn.relu(x)
        return x


class BnModel(nn.Module):  # the guide's Model
    dmid: int
    dout: int

    @nn.compact
    def __call__(self, x, training: bool):
        x = BnBlock(self.dmid)(x, training)
        x = nn.Dense(self.dout)(x)
        return x


def make_bn_train_step(model):
    """The guide's ``train_step`` (its global ``model`` made an argument)."""
    import optax

    def train_step(params, batch_stats, inputs, labels):
        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": batch_stats},
                inputs,
                training=True,  # <== inputs
                mutable="batch_stats",
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, updates["batch_stats"]

        grads, batch_stats = jax.grad(loss_fn, has_aux=True)(params)
        params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

        return params, batch_stats

    return train_step


# -- haiku_migration_guide.rst, "Using Multiple Methods" (Flax), as written there ----------------
class AutoEncoder(nn.Module):
    embed_dim: int
    output_dim: int

    def setup(self):
        self.encoder = nn.Dense(self.embed_dim)
        self.decoder = nn.Dense(self.output_dim)

    def encode(self, x):
        return self.encoder(x)

    def decode(self, x):
        return self.decoder(x)

    def __call__(self, x):
        x = self.encode(x)
        x = self.decode(x)
        return x


# -- haiku_migration_guide.rst, "Lifted Transforms" (Flax), as written there ---------------------
class RNNCell(nn.Module):
    hidden_size: int

    @nn.compact
    def __call__(self, carry, x):
        x = jnp.concatenate([carry, x], axis=-1)
        x = nn.Dense(self.hidden_size)(x)
        x = jax.nn.relu(x)
        return x, x

    def initial_state(self, batch_size: int):
        return jnp.zeros((batch_size, self.hidden_size))


class RNN(nn.Module):
    hidden_size: int

    @nn.compact
    def __call__(self, x):
        rnn = nn.scan(
            RNNCell,
            variable_broadcast="params",
            split_rngs={"params": False},
            in_axes=1,
            out_axes=1,
        )(self.hidden_size)
        carry = rnn.initial_state(x.shape[0])
        carry, y = rnn(carry, x)
        return y


# -- haiku_migration_guide.rst, "Top-level Haiku functions vs top-level Flax modules" ------------
class FooModule(nn.Module):
    @nn.compact
    def __call__(self, x):
        counter = self.variable("counter", "count", lambda: jnp.ones((), jnp.int32))
        multiplier = self.param("multiplier", nn.initializers.ones_init(), [1], x.dtype)
        output = x + multiplier * counter.value
        if not self.is_initializing():  # otherwise model.init() also increases it
            counter.value += 1
        return output


# -- model_surgery.md, "Surgery with Flax Modules", as written there -----------------------------
class SurgeryCNN(nn.Module):  # the guide's CNN
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(features=256)(x)
        x = nn.relu(x)
        x = nn.Dense(features=10)(x)
        x = nn.log_softmax(x)
        return x


def surgery(params):
    """The guide's steps on ``params``: flatten, normalize ``Dense_1/kernel``, unflatten, freeze."""
    # Get a flattened key-value list.
    flat_params = traverse_util.flatten_dict(params, sep="/")
    # Somehow modify a layer
    dense_kernel = flat_params["Dense_1/kernel"]
    flat_params["Dense_1/kernel"] = dense_kernel / jnp.linalg.norm(dense_kernel)
    # Unflatten.
    unflat_params = traverse_util.unflatten_dict(flat_params, sep="/")
    # Refreeze.
    unflat_params = freeze(unflat_params)
    return unflat_params


# -- docs_nnx/guides/surgery.md, as written there ------------------------------------------------
class TwoLayerMLP(nnx.Module):
    def __init__(self, dim, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(dim, dim, rngs=rngs)
        self.linear2 = nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, x):
        x = self.linear1(x)
        return self.linear2(x)


# -- docs_nnx/guides/pytree.md, as written there ---------------------------------------------------
class PytreeLinear(nnx.Module):  # the guide's first Linear
    def __init__(self, din, dout, rngs: nnx.Rngs):
        self.din, self.dout = din, dout
        self.kernel = nnx.Param(rngs.normal((din, dout)))


def forward(weights, x):  # the guide's @jax.jit forward, unjitted: the Hybrid compiles it
    return x @ weights.kernel


class DataLinear(nnx.Pytree):  # the guide's nnx.Pytree Linear
    def __init__(self, din: int, dout: int):
        self.din = nnx.static(din)
        self.dout = nnx.static(dout)
        self.w = nnx.data(jnp.ones((din, dout)))
        self.b = nnx.data(jnp.zeros((dout,)))


class DataMLP(nnx.Pytree):  # the guide's nnx.Pytree MLP
    def __init__(self, num_layers, dim):
        self.num_layers = nnx.static(num_layers)
        self.layers = nnx.data([DataLinear(dim, dim) for _ in range(num_layers)])


class Bar(nnx.Pytree):
    def __init__(self, x, use_bias: bool):
        self.x = nnx.data(x)  # constrain inputs (e.g. user could pass Array or float)
        self.y = nnx.data(42)  # force types that are not data by default
        self.ls = nnx.List([jnp.array(i) for i in range(3)])  # use nnx.List for lists of data
        self.bias = nnx.data(None)  # optional values that can be data
        if use_bias:
            self.bias = nnx.Param(jnp.array(0.0))


# -- docs_nnx/guides/jax_and_nnx_transforms.rst, "Differences", as written there ------------------
@nnx.jit
def nnx_train_step(model, x, y):  # the guide's Flax NNX train_step
    def loss_fn(model):
        return ((model(x) - y) ** 2).mean()

    grads = nnx.grad(loss_fn)(model)
    params = nnx.state(model, nnx.Param)
    params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    nnx.update(model, params)


@jax.jit
def jax_train_step(graphdef, state, x, y):  # the guide's JAX train_step
    def loss_fn(graphdef, state):
        model = nnx.merge(graphdef, state)
        return ((model(x) - y) ** 2).mean()

    grads = jax.grad(loss_fn, argnums=1)(graphdef, state)

    model = nnx.merge(graphdef, state)
    params = nnx.state(model, nnx.Param)
    params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    nnx.update(model, params)
    return nnx.split(model)


# -- docs_nnx/guides/flax_gspmd.md, as written there ----------------------------------------------
class DotReluDot(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth,
            depth,
            kernel_init=nnx.with_partitioning(init_fn, (None, "model")),
            use_bias=False,  # or use `bias_init` to give it annotation too
            rngs=rngs,
        )
        self.w2 = nnx.Param(
            init_fn(rngs.params(), (depth, depth)),  # RNG key and shape for W2 creation
            sharding=("model", None),
        )

    def __call__(self, x: jax.Array):
        y = self.dot1(x)
        y = jax.nn.relu(y)
        y = jax.lax.with_sharding_constraint(y, P("data", "model"))
        z = jnp.dot(y, self.w2[...])
        return z


class MultiDotReluDot(nnx.Module):
    def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs):
        # Annotate the additional axis with sharding=None, meaning it will be
        # replicated across all devices.
        @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: None})
        def create_sublayers(r):
            return DotReluDot(depth, r)

        self.layers = create_sublayers(rngs.fork(split=num_layers))

    def __call__(self, x):
        def scan_over_layers(x, layer):
            return layer(x), None

        x, _ = jax.lax.scan(scan_over_layers, x, self.layers)
        return x


@jax.jit
def gspmd_train_step(model, optimizer, x, y):  # the guide's train_step
    def loss_fn(model: DotReluDot):
        y_pred = model(x)
        return jnp.mean((y_pred - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return model, loss


# -- docs/guides/parallel_training/ensembling.rst, its Ensemble side, as written there -----------
def make_ensemble(cnn_apply, init_shape=(1, 28, 28, 1)):
    """The guide's pmapped ``create_train_state``, ``apply_model``, ``update_model`` and
    ``train_epoch``; ``cnn_apply`` is its ``CNN().apply`` (a Hybrid's ``h.apply`` in its
    place), ``init_shape`` its ``[1, 28, 28, 1]``."""
    import functools

    import numpy as np
    import optax
    from flax import jax_utils
    from flax.training import train_state

    @functools.partial(jax.pmap, static_broadcasted_argnums=(1, 2))
    def create_train_state(rng, learning_rate, momentum):
        cnn = SurgeryCNN()
        params = cnn.init(rng, jnp.ones(init_shape))["params"]
        tx = optax.sgd(learning_rate, momentum)
        return train_state.TrainState.create(apply_fn=cnn.apply, params=params, tx=tx)

    @functools.partial(jax.pmap, axis_name="ensemble")
    def apply_model(state, images, labels):
        def loss_fn(params):
            logits = cnn_apply({"params": params}, images)
            one_hot = jax.nn.one_hot(labels, 10)
            loss = optax.softmax_cross_entropy(logits=logits, labels=one_hot).mean()
            return loss, logits

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, logits), grads = grad_fn(state.params)
        probs = jax.lax.pmean(jax.nn.softmax(logits), axis_name="ensemble")
        accuracy = jnp.mean(jnp.argmax(probs, -1) == labels)
        return grads, loss, accuracy

    @jax.pmap
    def update_model(state, grads):
        return state.apply_gradients(grads=grads)

    def train_epoch(state, train_ds, batch_size, rng):
        train_ds_size = len(train_ds["image"])
        steps_per_epoch = train_ds_size // batch_size

        perms = jax.random.permutation(rng, len(train_ds["image"]))
        perms = perms[: steps_per_epoch * batch_size]
        perms = perms.reshape((steps_per_epoch, batch_size))

        epoch_loss = []
        epoch_accuracy = []

        for perm in perms:
            batch_images = jax_utils.replicate(train_ds["image"][perm, ...])
            batch_labels = jax_utils.replicate(train_ds["label"][perm, ...])
            grads, loss, accuracy = apply_model(state, batch_images, batch_labels)
            state = update_model(state, grads)
            epoch_loss.append(jax_utils.unreplicate(loss))
            epoch_accuracy.append(jax_utils.unreplicate(accuracy))
        train_loss = np.mean(epoch_loss)
        train_accuracy = np.mean(epoch_accuracy)
        return state, train_loss, train_accuracy

    return create_train_state, apply_model, update_model, train_epoch


# -- docs/guides/flax_sharp_bits.md, "flax.linen.Dropout layer and randomness", as written there --
class MyModel(nn.Module):
    num_neurons: int
    training: bool

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.num_neurons)(x)
        # Set the dropout layer with a rate of 50% .
        # When the `deterministic` flag is `True`, dropout is turned off.
        x = nn.Dropout(rate=0.5, deterministic=not self.training)(x)
        return x


# -- docs/guides/training_techniques/lr_schedule.rst, its schedule side, as written there (its
# config an ml_collections.ConfigDict, not installed here: a SimpleNamespace; its CNN
# examples/mnist's, SurgeryCNN here as in ensembling.rst) -----------------------------------------
def get_config():
    """Get the default hyperparameter configuration."""
    from types import SimpleNamespace

    config = SimpleNamespace()
    config.learning_rate = 0.001
    config.momentum = 0.9
    config.batch_size = 128
    config.num_epochs = 10
    config.warmup_epochs = 2
    config.train_ds_size = 128
    return config


def compute_metrics(logits, labels):
    import optax

    one_hot = jax.nn.one_hot(labels, 10)
    loss = jnp.mean(optax.softmax_cross_entropy(logits, one_hot))
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    metrics = {
        "loss": loss,
        "accuracy": accuracy,
    }
    return metrics


def create_learning_rate_fn(config, base_learning_rate, steps_per_epoch):
    """Creates learning rate schedule."""
    import optax

    warmup_fn = optax.linear_schedule(
        init_value=0.0,
        end_value=base_learning_rate,
        transition_steps=config.warmup_epochs * steps_per_epoch,
    )
    cosine_epochs = max(config.num_epochs - config.warmup_epochs, 1)
    cosine_fn = optax.cosine_decay_schedule(
        init_value=base_learning_rate, decay_steps=cosine_epochs * steps_per_epoch
    )
    schedule_fn = optax.join_schedules(
        schedules=[warmup_fn, cosine_fn], boundaries=[config.warmup_epochs * steps_per_epoch]
    )
    return schedule_fn


def make_lr_train_step(apply):
    """The guide's ``train_step``; ``apply`` is its ``CNN().apply``."""
    import functools

    import optax

    @functools.partial(jax.jit, static_argnums=2)
    def train_step(state, batch, learning_rate_fn):
        def loss_fn(params):
            logits = apply({"params": params}, batch["image"])
            one_hot = jax.nn.one_hot(batch["label"], 10)
            loss = jnp.mean(optax.softmax_cross_entropy(logits, one_hot))
            return loss, logits

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, logits), grads = grad_fn(state.params)
        new_state = state.apply_gradients(grads=grads)
        metrics = compute_metrics(logits, batch["label"])
        lr = learning_rate_fn(state.step)
        metrics["learning_rate"] = lr
        return new_state, metrics

    return train_step


def create_train_state(rng, config, learning_rate_fn, init_shape=(1, 28, 28, 1)):
    """Creates initial `TrainState`."""
    import optax
    from flax.training import train_state

    cnn = SurgeryCNN()
    params = cnn.init(rng, jnp.ones(init_shape))["params"]
    tx = optax.sgd(learning_rate_fn, config.momentum)
    return train_state.TrainState.create(apply_fn=cnn.apply, params=params, tx=tx)


# -- docs_nnx/migrating/haiku_to_flax.rst, its Flax NNX side, as written there (its classes
# prefixed Nnx, apart from the linen guide's) -------------------------------------------------------
class NnxBlock(nnx.Module):  # "Basic Module definition"'s Block
    def __init__(self, in_features: int, out_features: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(in_features, out_features, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        x = self.linear(x)
        x = self.dropout(x)
        x = jax.nn.relu(x)
        return x


class NnxModel(nnx.Module):  # its Model
    def __init__(self, din: int, dmid: int, dout: int, rngs: nnx.Rngs):
        self.block = NnxBlock(din, dmid, rngs=rngs)
        self.linear = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, x):
        x = self.block(x)
        x = self.linear(x)
        return x


@nnx.jit
def nnx_hk_train_step(model, inputs, labels):  # its train_step
    import optax

    def loss_fn(model):
        logits = model(
            inputs,  # <== inputs
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    grads = nnx.grad(loss_fn)(model)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    nnx.update(model, nnx.merge_state(params, rest))


class NnxAutoEncoder(nnx.Module):  # "Using multiple methods"
    def __init__(self, in_dim: int, embed_dim: int, output_dim: int, rngs):
        self.encoder = nnx.Linear(in_dim, embed_dim, rngs=rngs)
        self.decoder = nnx.Linear(embed_dim, output_dim, rngs=rngs)

    def encode(self, x):
        return self.encoder(x)

    def decode(self, x):
        return self.decoder(x)


class NnxRNNCell(nnx.Module):  # "Transformations"
    def __init__(self, input_size, hidden_size, rngs):
        self.linear = nnx.Linear(hidden_size + input_size, hidden_size, rngs=rngs)
        self.hidden_size = hidden_size

    def __call__(self, carry, x):
        x = jnp.concatenate([carry, x], axis=-1)
        x = self.linear(x)
        x = jax.nn.relu(x)
        return x, x

    def initial_state(self, batch_size: int):
        return jnp.zeros((batch_size, self.hidden_size))


class NnxRNN(nnx.Module):
    def __init__(self, input_size: int, hidden_size: int, rngs: nnx.Rngs):
        self.hidden_size = hidden_size
        self.cell = NnxRNNCell(input_size, self.hidden_size, rngs=rngs)

    def __call__(self, x):
        scan_fn = lambda carry, cell, x: cell(carry, x)  # noqa: E731
        carry = self.cell.initial_state(x.shape[0])
        carry, y = nnx.scan(scan_fn, in_axes=(nnx.Carry, None, 1), out_axes=(nnx.Carry, 1))(
            carry, self.cell, x
        )
        return y


class Counter(nnx.Variable):  # "Top-level Haiku functions vs top-level Flax modules"
    pass


class NnxFooModule(nnx.Module):
    def __init__(self, rngs):
        self.counter = Counter(jnp.ones((), jnp.int32))
        self.multiplier = nnx.Param(
            nnx.initializers.ones(
                rngs.params(),
                [
                    1,
                ],
                jnp.float32,
            )
        )

    def __call__(self, x):
        output = x + self.multiplier * self.counter.value
        self.counter.value += 1
        return output


# -- docs_nnx/guides/surgery.md, "Checkpoint surgery", as written there ---------------------------
class ModifiedTwoLayerMLP(nnx.Module):
    def __init__(self, dim, rngs: nnx.Rngs):
        self.layer1 = nnx.Linear(dim, dim, rngs=rngs)  # no longer linear1!
        self.layer2 = nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, x):
        x = self.layer1(x)
        return self.layer2(x)


def process_raw_dict(raw_state_dict):
    flattened = nnx.traversals.flatten_mapping(raw_state_dict)
    # Cut the '.value' postfix on every leaf path.
    flattened = {
        (path[:-1] if path[-1] == "value" else path): value for path, value in flattened.items()
    }
    return nnx.traversals.unflatten_mapping(flattened)


# -- docs_nnx/guides/surgery.md, "Memory-efficient partial initialization", as written there ------
@nnx.jit(donate_argnums=0)
def partial_init(old_state, rngs):
    model = TwoLayerMLP(4, rngs=rngs)
    # Create a new state.
    model.linear1 = nnx.LoRALinear(4, 4, lora_rank=3, rngs=rngs)
    # Add the existing state.
    nnx.update(model, old_state)
    return model
