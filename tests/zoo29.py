"""Code we did not write, round twenty-nine: intermediates, as their authors capture them, for
tests/test_authors_round29.py.

google/flax at 18f8f311c275d57f46d95e41b15aa97b454754c0:

- docs/guides/model_inspection/extracting_intermediates.rst (linen): ``CNN`` (the same code
  as model_surgery.md's, tests/zoo7.py's ``SurgeryCNN``: taken from there), ``SowCNN``,
  ``SowCNN2`` and its jitted ``init``/``predict`` (renamed ``sow_init``/``sow_predict``), the
  ``capture_intermediates`` section's ``predict`` (renamed ``capture_predict``) and its
  filters ``filter_Dense``/``filter_encodings``, the section's ``Model`` that sows ``c``
  (renamed ``SowModel``) with its filtered ``predict`` (renamed ``filtered_predict``), and
  "Extracting gradients of intermediate values": ``Model`` with ``perturb`` (renamed
  ``PerturbModel``; ``model = PerturbModel()`` as the guide makes it) and ``loss_fn``.
- tests/nnx/integration_test.py, ``test_intermediates_example``: its ``Linear`` (a class
  inside the test there, here at module level), read with ``nnx.pop(model, nnx.Intermediate)``.
- examples/nnx_toy_examples/05_vae.py: ``train_step`` (its ``loss_fn`` pops the encoder's
  ``Loss`` variable); the file's ``Loss``, ``Encoder``, ``Decoder`` and ``VAE`` are
  tests/helpers.py's, taken from the same file at the same commit. Left out: the MNIST data
  (``datasets``), the training loop and the plotting.

Ours: the files' two spaces of indent are made four (``ruff format``), the code is as written.
"""

# ruff: noqa: E731 (the authors' code, as written)

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import zoo7
from flax import nnx
from helpers import VAE, Loss

# --- docs/guides/model_inspection/extracting_intermediates.rst ---------------------------------


CNN = zoo7.SurgeryCNN  # the guide's CNN: model_surgery.md's, the same code (tests/zoo7.py)


class SowCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        self.sow("intermediates", "features", x)  #!
        x = nn.Dense(features=256)(x)
        x = nn.relu(x)
        x = nn.Dense(features=10)(x)
        x = nn.log_softmax(x)
        return x


class SowCNN2(nn.Module):
    @nn.compact
    def __call__(self, x):
        mod = SowCNN(name="SowCNN")
        return mod(x) + mod(x)  # Calling same module instance twice.


@jax.jit
def sow_init(key, x):
    variables = SowCNN2().init(key, x)
    # By default the 'intermediates' collection is not mutable during init.
    # So variables will only contain 'params' here.
    return variables


@jax.jit
def sow_predict(variables, x):
    # If mutable='intermediates' is not specified, then .sow() acts as a noop.
    output, mod_vars = SowCNN2().apply(variables, x, mutable="intermediates")
    features = mod_vars["intermediates"]["SowCNN"]["features"]
    return output, features


@jax.jit
def capture_predict(variables, x):
    y, state = CNN().apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
    intermediates = state["intermediates"]
    fin = jax.tree_util.tree_map(lambda xs: jnp.all(jnp.isfinite(xs)), intermediates)
    return y, fin


filter_Dense = lambda mdl, method_name: isinstance(mdl, nn.Dense)
filter_encodings = lambda mdl, method_name: method_name == "encode"


class SowModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        a = nn.Dense(4)(x)  # Dense_0
        b = nn.Dense(4)(x)  # Dense_1
        c = a + b
        self.sow("intermediates", "c", c)  # store intermediate c #!
        d = nn.Dense(4)(c)  # Dense_2
        return d


@jax.jit
def filtered_predict(params, x):
    # filter specifically for only the Dense_0 and Dense_2 layer #!
    filter_fn = lambda mdl, method_name: (
        isinstance(mdl.name, str) and (mdl.name in {"Dense_0", "Dense_2"})
    )  #!
    return SowModel().apply({"params": params}, x, capture_intermediates=filter_fn)  #!


class PerturbModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8)(x))
        x = self.perturb("hidden", x)
        x = nn.Dense(2)(x)
        x = self.perturb("logits", x)
        return x


model = PerturbModel()


def loss_fn(params, perturbations, x, y):
    y_pred = model.apply({"params": params, "perturbations": perturbations}, x)
    return jnp.mean((y_pred - y) ** 2)


# --- tests/nnx/integration_test.py (test_intermediates_example) --------------------------------


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        key = rngs.params()
        self.w = nnx.Param(jax.random.uniform(key, (din, dout)))
        self.b = nnx.Param(jnp.zeros((dout,)))

    def __call__(self, x):
        y = x @ self.w + self.b[None]
        self.y = nnx.Intermediate(y)
        return y


# --- examples/nnx_toy_examples/05_vae.py --------------------------------------------------------


@nnx.jit
def train_step(model: VAE, optimizer: nnx.Optimizer, x: jax.Array):
    def loss_fn(model: VAE):
        logits = model(x)
        losses = nnx.pop(model, Loss)
        kl_loss = sum(jax.tree_util.tree_leaves(losses), 0.0)
        reconstruction_loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, x))
        loss = reconstruction_loss + 0.1 * kl_loss
        return loss

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)

    return loss
