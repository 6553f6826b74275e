"""The models of test_authors_round8.py: JAX's own notebooks, as their authors wrote them, from
jax-ml/jax@cec06d116c05f0d52adfceee3d3b730fdbcb0ce5 (sizes as written there: already tiny).

- docs/notebooks/Custom_derivative_rules_for_Python_code.md: "Example: Numerical stability"
  (``log1pexp``, its ``jax.custom_jvp`` by ``defjvp``), "Example: Enforcing a differentiation
  convention" (``f`` -> ``sqrt_ratio``, its ``defjvps`` convenience version), "Example:
  Gradient clipping" (``clip_gradient``, a ``jax.custom_vjp``, and ``clip_sin``) and "Example:
  Implicit function differentiation of iterative implementations" (``fixed_point``, a
  ``custom_vjp`` with ``nondiff_argnums`` over a ``lax.while_loop``, ``newton_sqrt``). The
  notebook has functions, not models: ``custom_dense`` (ours, said there) puts each in a
  one-layer net's activation, as a user would.
- docs/notebooks/vmapped_log_probs.md: Bayesian logistic regression, its data (``np.random``
  seed 10009, 100 points, 10 features), ``log_joint`` (the jitted version, scale 10),
  ``batched_log_joint``, ``elbo``, ``normal_sample``; ``matplotlib`` (its plots) left out.
- docs/notebooks/Distributed_arrays_and_automatic_parallelization.md, from the commit before
  its removal (jax-ml/jax@220f0751106a31289082d7d0060eff2a8d3facfc), "Examples: neural
  networks": ``predict`` -> ``dist_predict``, ``loss`` -> ``dist_loss``, ``init_layer``,
  ``init_model``; its sizes (784, 8192 x3, 10; batch 8192) cut in the test.
- docs/notebooks/autodiff_cookbook.md, "Gradients" and "Jacobians and Hessians": ``sigmoid``,
  ``predict``, its toy ``inputs``/``targets``, ``loss2``, ``predict_dict``, the reverse-over-
  reverse ``hvp``; its ``random.split`` draws of ``W`` and ``b`` as ``cookbook_params``.

From google/flax@18f8f311c275d57f46d95e41b15aa97b454754c0:

- docs/guides/flax_fundamentals/state_params.rst: ``BiasAdderWithRunningMean`` and its
  ``update_step`` (made by ``make_update_step(tx)``: its ``tx`` is defined after it there), the
  ``vmap``-across-the-batch ``MLP`` (-> ``StateMLP``: ``BatchNorm(axis_name='batch')``) and its
  ``update_step`` (``make_vmap_update_step(tx)``).
- docs/developer_notes/lift.md (the lifting guide): ``MLP`` (-> ``LiftMLP``), ``ManualVmapMLP``,
  ``LinenVmapMLP``, ``StatefulMLP`` and ``LinenStatefulVmapMLP`` (whose ``init`` as the guide
  writes it, with no ``train``, raises in Flax, as does any call: ``nn.vmap`` here passes no
  keyword ``train`` on to ``StatefulMLP``, the guide's own limitation).
- docs/guides/converting_and_upgrading/rnncell_upgrade_guide.rst, its New side: the first
  ``SimpleLSTM`` (-> ``CarrySimpleLSTM``: a scanned ``OptimizedLSTMCell`` taking the carry) and
  the idiomatic ``SimpleLSTM`` (its carry made in ``__call__``); sizes cut in the tests.
- docs/guides/flax_fundamentals/flax_basics.md: its linear regression (``mse`` made by
  ``make_mse(model)``, ``update_params``, the data as ``regression_data()``), ``ExplicitMLP``,
  ``SimpleMLP``, ``SimpleDense``, its ``BiasAdderWithRunningMean`` (-> ``BasicsBiasAdder``:
  ``decay``, ``x - mean + bias``) and its jitted ``update_step`` (-> ``basics_update_step``,
  ``tx`` and ``apply_fn`` static).
- docs/guides/converting_and_upgrading/optax_update_guide.rst, its optax side: each section's
  ``tx`` (``optax_guide_txs``: sgd, chain, Adam with decayed weights, clipping, a schedule, the
  masked kernels/biases of ``ModelParamTraversal``) and its ``train_step``
  (``make_optax_train_step(tx, loss)``: its ``loss`` is a stub there, ``jnp.array(0.)``).
- docs/developer_notes/module_lifecycle.rst: ``MLP`` (-> ``LifecycleMLP``), ``CompactScaledMLP``,
  ``CorrectModule`` and its hidden ``init_fn``, ``Partial`` and the second ``Foo`` (an
  ``nn.vmap`` of a method given a ``Partial`` closing over a Dense).
- docs/guides/training_techniques/use_checkpointing.md: its "Save checkpoints" bundle (a
  ``TrainState`` of ``nn.Dense(3)`` after one update, a config, data) as ``checkpoint_bundle()``;
  its Orbax save and restore (with and without a target) are run in the test.
"""

# ruff: noqa: B007, E731, E741, RUF059 (the authors' code, as written)

import functools
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np
import optax
import scipy as sp
from flax.training import train_state
from jax import custom_jvp, custom_vjp, random, vjp
from jax.lax import while_loop


# -- Custom_derivative_rules_for_Python_code.md, "Numerical stability", as written there ---------
@custom_jvp
def log1pexp(x):
    return jnp.log(1.0 + jnp.exp(x))


@log1pexp.defjvp
def log1pexp_jvp(primals, tangents):
    (x,) = primals
    (x_dot,) = tangents
    ans = log1pexp(x)
    ans_dot = (1 - 1 / (1 + jnp.exp(x))) * x_dot
    return ans, ans_dot


# -- "Enforcing a differentiation convention", its convenience wrapper version (f -> sqrt_ratio)
@custom_jvp
def sqrt_ratio(x):
    return x / (1 + jnp.sqrt(x))


sqrt_ratio.defjvps(lambda t, ans, x: ((jnp.sqrt(x) + 2) / (2 * (jnp.sqrt(x) + 1) ** 2)) * t)


# -- "Gradient clipping", as written there -----------------------------------------------------
@custom_vjp
def clip_gradient(lo, hi, x):
    return x  # identity function


def clip_gradient_fwd(lo, hi, x):
    return x, (lo, hi)  # save bounds as residuals


def clip_gradient_bwd(res, g):
    lo, hi = res
    return (None, None, jnp.clip(g, lo, hi))  # use None to indicate zero cotangents for lo and hi


clip_gradient.defvjp(clip_gradient_fwd, clip_gradient_bwd)


def clip_sin(x):
    x = clip_gradient(-0.75, 0.75, x)
    return jnp.sin(x)


# -- "Implicit function differentiation of iterative implementations", its custom_vjp version --
@partial(custom_vjp, nondiff_argnums=(0,))
def fixed_point(f, a, x_guess):
    def cond_fun(carry):
        x_prev, x = carry
        return jnp.abs(x_prev - x) > 1e-6

    def body_fun(carry):
        _, x = carry
        return x, f(a, x)

    _, x_star = while_loop(cond_fun, body_fun, (x_guess, f(a, x_guess)))
    return x_star


def fixed_point_fwd(f, a, x_init):
    x_star = fixed_point(f, a, x_init)
    return x_star, (a, x_star)


def fixed_point_rev(f, res, x_star_bar):
    a, x_star = res
    _, vjp_a = vjp(lambda a: f(a, x_star), a)
    (a_bar,) = vjp_a(fixed_point(partial(rev_iter, f), (a, x_star, x_star_bar), x_star_bar))
    return a_bar, jnp.zeros_like(x_star)


def rev_iter(f, packed, u):
    a, x_star, x_star_bar = packed
    _, vjp_x = vjp(lambda x: f(a, x), x_star)
    return x_star_bar + vjp_x(u)[0]


fixed_point.defvjp(fixed_point_fwd, fixed_point_rev)


def newton_sqrt(a):
    update = lambda a, x: 0.5 * (x + a / x)
    return fixed_point(update, a, a)


def custom_dense(activation):
    """Ours, not the notebook's: ``fn(params, x) = activation(x @ w + b)``, a one-layer net whose
    activation is one of the notebook's functions (``newton_sqrt`` is scalar: vmapped)."""

    def fn(params, x):
        return activation(x @ params["w"] + params["b"])

    return fn


# -- vmapped_log_probs.md, as written there (matplotlib's plots left out) ----------------------
np.random.seed(10009)

num_features = 10
num_points = 100

true_beta = np.random.randn(num_features).astype(jnp.float32)
all_x = np.random.randn(num_points, num_features).astype(jnp.float32)
y = (np.random.rand(num_points) < sp.special.expit(all_x.dot(true_beta))).astype(jnp.int32)


@jax.jit
def log_joint(beta):
    result = 0.0
    # Note that no `axis` parameter is provided to `jnp.sum`.
    result = result + jnp.sum(jsp.stats.norm.logpdf(beta, loc=0.0, scale=10.0))
    result = result + jnp.sum(-jnp.log(1 + jnp.exp(-(2 * y - 1) * jnp.dot(all_x, beta))))
    return result


batched_log_joint = jax.jit(jax.vmap(log_joint))


def elbo(beta_loc, beta_log_scale, epsilon):
    beta_sample = beta_loc + jnp.exp(beta_log_scale) * epsilon
    return jnp.mean(batched_log_joint(beta_sample), 0) + jnp.sum(
        beta_log_scale - 0.5 * np.log(2 * np.pi)
    )


elbo = jax.jit(elbo)
elbo_val_and_grad = jax.jit(jax.value_and_grad(elbo, argnums=(0, 1)))


def normal_sample(key, shape):
    """Convenience function for quasi-stateful RNG."""
    new_key, sub_key = random.split(key)
    return new_key, random.normal(sub_key, shape)


normal_sample = jax.jit(normal_sample, static_argnums=(1,))


# -- autodiff_cookbook.md, "Gradients", as written there ----------------------------------------
def sigmoid(x):
    return 0.5 * (jnp.tanh(x / 2) + 1)


# Outputs probability of a label being true.
def predict(W, b, inputs):
    return sigmoid(jnp.dot(inputs, W) + b)


# Build a toy dataset.
inputs = jnp.array(
    [[0.52, 1.12, 0.77], [0.88, -1.08, 0.15], [0.52, 0.06, -1.30], [0.74, -2.49, 1.39]]
)
targets = jnp.array([True, True, False, True])


def loss2(params_dict):
    preds = predict(params_dict["W"], params_dict["b"], inputs)
    label_probs = preds * targets + (1 - preds) * (1 - targets)
    return -jnp.sum(jnp.log(label_probs))


def hvp(f, x, v):
    return jax.grad(lambda x: jnp.vdot(jax.grad(f)(x), v))(x)


def predict_dict(params, inputs):
    return predict(params["W"], params["b"], inputs)


def cookbook_params():
    """The cookbook's ``key, W_key, b_key = random.split(key, 3)`` draws."""
    key = random.key(0)
    key, W_key, b_key = random.split(key, 3)
    return {"W": random.normal(W_key, (3,)), "b": random.normal(b_key, ())}


# -- docs/guides/flax_fundamentals/state_params.rst, as written there ---------------------------
class BiasAdderWithRunningMean(nn.Module):
    momentum: float = 0.9

    @nn.compact
    def __call__(self, x):
        is_initialized = self.has_variable("batch_stats", "mean")
        mean = self.variable("batch_stats", "mean", jnp.zeros, x.shape[1:])
        bias = self.param("bias", lambda rng, shape: jnp.zeros(shape), x.shape[1:])
        if is_initialized:
            mean.value = self.momentum * mean.value + (1.0 - self.momentum) * jnp.mean(
                x, axis=0, keepdims=True
            )
        return mean.value + bias


def make_update_step(tx):
    """state_params.rst's first ``update_step`` (its ``tx``, defined below it there, passed in)."""

    def update_step(apply_fn, x, opt_state, params, state):
        def loss(params):
            y, updated_state = apply_fn({"params": params, **state}, x, mutable=list(state.keys()))
            l = ((x - y) ** 2).sum()  # Replace with your loss here.
            return l, updated_state

        (l, updated_state), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state)  # Defined below.
        params = optax.apply_updates(params, updates)
        return opt_state, params, updated_state

    return update_step


class StateMLP(nn.Module):  # the guide's "vmap accross the batch dimension" MLP
    hidden_size: int
    out_size: int

    @nn.compact
    def __call__(self, x, train=False):
        norm = partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            axis_name="batch",  # Name batch dim
        )
        x = nn.Dense(self.hidden_size)(x)
        x = norm()(x)
        x = nn.relu(x)
        x = nn.Dense(self.hidden_size)(x)
        x = norm()(x)
        x = nn.relu(x)
        y = nn.Dense(self.out_size)(x)
        return y


def make_vmap_update_step(tx):
    """state_params.rst's second ``update_step``: the loss vmapped with ``axis_name='batch'``."""

    def update_step(apply_fn, x_batch, y_batch, opt_state, params, state):
        def batch_loss(params):
            def loss_fn(x, y):
                pred, updated_state = apply_fn(
                    {"params": params, **state}, x, mutable=list(state.keys())
                )
                return (pred - y) ** 2, updated_state

            loss, updated_state = jax.vmap(
                loss_fn,
                out_axes=(0, None),  # Do not vmap `updated_state`.
                axis_name="batch",  # Name batch dim
            )(x_batch, y_batch)  # vmap only `x`, `y`, but not `state`.
            return jnp.mean(loss), updated_state

        (loss, updated_state), grads = jax.value_and_grad(batch_loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state)  # Defined below.
        params = optax.apply_updates(params, updates)
        return opt_state, params, updated_state, loss

    return update_step


# -- docs/developer_notes/lift.md, as written there ---------------------------------------------
class LiftMLP(nn.Module):  # the guide's MLP
    @nn.compact
    def __call__(self, xs):
        h = nn.Dense(4, name="hidden")(xs)
        h = nn.relu(h)
        return nn.Dense(1, name="out")(h)


class ManualVmapMLP(nn.Module):
    @nn.compact
    def __call__(self, xs):
        mlp = LiftMLP(parent=None)
        init_fn = lambda rng, xs: jax.vmap(mlp.init, in_axes=0)(random.split(rng, xs.shape[0]), xs)[
            "params"
        ]
        apply_fn = jax.vmap(mlp.apply, in_axes=0)
        mlp_params = self.param("mlp", init_fn, xs)
        return apply_fn({"params": mlp_params}, xs)


class LinenVmapMLP(nn.Module):
    @nn.compact
    def __call__(self, xs):
        VmapMLP = nn.vmap(
            LiftMLP, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=0
        )
        return VmapMLP(name="mlp")(xs)


class StatefulMLP(nn.Module):
    @nn.compact
    def __call__(self, x, *, train):
        h = nn.Dense(4, name="hidden")(x)
        h = nn.BatchNorm(axis_name="batch")(h, use_running_average=not train)
        h = nn.relu(h)
        return nn.Dense(1, name="out")(h)


class LinenStatefulVmapMLP(nn.Module):
    @nn.compact
    def __call__(self, xs, *, train):
        VmapMLP = nn.vmap(
            StatefulMLP,
            variable_axes={"params": 0, "batch_stats": 0},
            split_rngs={"params": True},
            in_axes=0,
        )
        return VmapMLP(name="mlp")(xs, train=train)


# -- docs/guides/converting_and_upgrading/rnncell_upgrade_guide.rst, its New side ---------------
class CarrySimpleLSTM(nn.Module):  # the guide's first (minimal-change) SimpleLSTM
    @functools.partial(
        nn.transforms.scan,
        variable_broadcast="params",
        in_axes=1,
        out_axes=1,
        split_rngs={"params": False},
    )
    @nn.compact
    def __call__(self, carry, x):
        features = carry[0].shape[-1]
        return nn.OptimizedLSTMCell(features)(carry, x)

    @staticmethod
    def initialize_carry(batch_dims, hidden_size):
        return nn.OptimizedLSTMCell(hidden_size, parent=None).initialize_carry(
            jax.random.key(0), (*batch_dims, hidden_size)
        )


class SimpleLSTM(nn.Module):  # the guide's idiomatic SimpleLSTM
    features: int

    def setup(self):
        self.scan_cell = nn.transforms.scan(
            nn.OptimizedLSTMCell,
            variable_broadcast="params",
            in_axes=1,
            out_axes=1,
            split_rngs={"params": False},
        )(self.features)

    @nn.compact
    def __call__(self, x):
        carry = self.scan_cell.initialize_carry(jax.random.key(0), x[:, 0].shape)
        return self.scan_cell(carry, x)[1]  # only return the output


# -- docs/guides/flax_fundamentals/flax_basics.md, as written there -----------------------------
def make_mse(model):
    """flax_basics' ``mse`` (over its global ``model``, passed in)."""

    # Same as JAX version but using model.apply().
    @jax.jit
    def mse(params, x_batched, y_batched):
        # Define the squared loss for a single pair (x,y)
        def squared_error(x, y):
            pred = model.apply(params, x)
            return jnp.inner(y - pred, y - pred) / 2.0

        # Vectorize the previous to compute the average of the loss on all samples.
        return jnp.mean(jax.vmap(squared_error)(x_batched, y_batched), axis=0)

    return mse


@jax.jit
def update_params(params, learning_rate, grads):
    params = jax.tree_util.tree_map(lambda p, g: p - learning_rate * g, params, grads)
    return params


def regression_data():
    """flax_basics' fake data: ``(true_params, x_samples, y_samples)``."""
    # Set problem dimensions.
    n_samples = 20
    x_dim = 10
    y_dim = 5

    # Generate random ground truth W and b.
    key = random.key(0)
    k1, k2 = random.split(key)
    W = random.normal(k1, (x_dim, y_dim))
    b = random.normal(k2, (y_dim,))
    # Store the parameters in a FrozenDict pytree.
    true_params = flax.core.freeze({"params": {"bias": b, "kernel": W}})

    # Generate samples with additional noise.
    key_sample, key_noise = random.split(k1)
    x_samples = random.normal(key_sample, (n_samples, x_dim))
    y_samples = jnp.dot(x_samples, W) + b + 0.1 * random.normal(key_noise, (n_samples, y_dim))
    return true_params, x_samples, y_samples


class ExplicitMLP(nn.Module):
    features: Sequence[int]

    def setup(self):
        # we automatically know what to do with lists, dicts of submodules
        self.layers = [nn.Dense(feat) for feat in self.features]
        # for single submodules, we would just write:
        # self.layer1 = nn.Dense(feat1)

    def __call__(self, inputs):
        x = inputs
        for i, lyr in enumerate(self.layers):
            x = lyr(x)
            if i != len(self.layers) - 1:
                x = nn.relu(x)
        return x


class SimpleMLP(nn.Module):
    features: Sequence[int]

    @nn.compact
    def __call__(self, inputs):
        x = inputs
        for i, feat in enumerate(self.features):
            x = nn.Dense(feat, name=f"layers_{i}")(x)
            if i != len(self.features) - 1:
                x = nn.relu(x)
            # providing a name is optional though!
            # the default autonames would be "Dense_0", "Dense_1", ...
        return x


class SimpleDense(nn.Module):
    features: int
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, inputs):
        kernel = self.param(
            "kernel",
            self.kernel_init,  # Initialization function
            (inputs.shape[-1], self.features),
        )  # shape info.
        y = jnp.dot(inputs, kernel)
        bias = self.param("bias", self.bias_init, (self.features,))
        y = y + bias
        return y


class BasicsBiasAdder(nn.Module):  # flax_basics' BiasAdderWithRunningMean
    decay: float = 0.99

    @nn.compact
    def __call__(self, x):
        # easy pattern to detect if we're initializing via empty variable tree
        is_initialized = self.has_variable("batch_stats", "mean")
        ra_mean = self.variable("batch_stats", "mean", lambda s: jnp.zeros(s), x.shape[1:])
        bias = self.param("bias", lambda rng, shape: jnp.zeros(shape), x.shape[1:])
        if is_initialized:
            ra_mean.value = self.decay * ra_mean.value + (1.0 - self.decay) * jnp.mean(
                x, axis=0, keepdims=True
            )

        return x - ra_mean.value + bias


@partial(jax.jit, static_argnums=(0, 1))
def basics_update_step(tx, apply_fn, x, opt_state, params, state):  # its update_step
    def loss(params):
        y, updated_state = apply_fn({"params": params, **state}, x, mutable=list(state.keys()))
        l = ((x - y) ** 2).sum()
        return l, updated_state

    (l, state), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state)
    params = optax.apply_updates(params, updates)
    return opt_state, params, state


# -- docs/guides/converting_and_upgrading/optax_update_guide.rst, its optax side ----------------
def optax_guide_txs(params, schedule=lambda step: 0.1 / (1 + step)):
    """The guide's optax transformations, by section (its testsetup's ``learning_rate, momentum,
    weight_decay, grad_clip_norm``; ``schedule``, undefined there, passed in)."""
    learning_rate, momentum, weight_decay, grad_clip_norm = 0.1, 0.9, 1e-3, 1.0
    kernels = flax.traverse_util.ModelParamTraversal(lambda p, _: "kernel" in p)
    biases = flax.traverse_util.ModelParamTraversal(lambda p, _: "bias" in p)
    all_false = jax.tree_util.tree_map(lambda _: False, params)
    kernels_mask = kernels.update(lambda _: True, all_false)
    biases_mask = biases.update(lambda _: True, all_false)
    return {
        "sgd": optax.sgd(learning_rate, momentum),
        "chain": optax.chain(
            optax.trace(decay=momentum),
            # Note that `optax.apply_updates()` simply adds the final updates to the
            # parameters, so we must make sure to flip the sign here for gradient descent.
            optax.scale(-learning_rate),
        ),
        "adam_decay": optax.chain(
            optax.scale_by_adam(),
            optax.add_decayed_weights(weight_decay),
            # params -= learning_rate * (adam(grads) + params * weight_decay)
            optax.scale(-learning_rate),
        ),
        "clip": optax.chain(
            optax.clip_by_global_norm(grad_clip_norm),
            optax.trace(decay=momentum),
            optax.scale(-learning_rate),
        ),
        "schedule": optax.chain(
            optax.trace(decay=momentum),
            # Note that we still want a negative value for scaling the updates!
            optax.scale_by_schedule(lambda step: -schedule(step)),
        ),
        "masked": optax.chain(
            optax.trace(decay=momentum),
            optax.masked(optax.scale(-learning_rate), kernels_mask),
            optax.masked(optax.scale(-learning_rate * 0.1), biases_mask),
        ),
    }


def make_optax_train_step(tx, loss, with_params=False):
    """The guide's ``train_step`` (its ``tx`` and ``loss`` passed in; ``with_params``: as its
    weight-decay section's note says, "you'll need to specify `params`": ``tx.update(grads,
    opt_state, params)``)."""

    @jax.jit
    def train_step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        if with_params:
            updates, opt_state = tx.update(grads, opt_state, params)
        else:
            updates, opt_state = tx.update(grads, opt_state)
        params = optax.apply_updates(params, updates)
        return params, opt_state

    return train_step


# -- docs/developer_notes/module_lifecycle.rst, as written there --------------------------------
class LifecycleMLP(nn.Module):  # the guide's MLP
    # 1. Attribute annotations
    hidden_size: int
    out_size: int

    # 2. The ``setup`` method
    def setup(self):
        self.hidden = nn.Dense(self.hidden_size)
        self.out = nn.Dense(self.out_size)

    # 3. User methods
    def __call__(self, x):
        a = self.hidden(x)
        h = nn.relu(a)
        return self.out(h)


class CompactScaledMLP(nn.Module):
    hidden_size: int
    out_size: int

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones_init(), x.shape[-1:])
        x *= scale[None]
        a = nn.Dense(self.hidden_size)(x)
        h = nn.relu(a)
        return nn.Dense(self.out_size)(h)


class CorrectModule(nn.Module):
    @nn.compact
    def __call__(self, x, mode):
        encoder = nn.Dense(8)
        decoder = nn.Dense(4)
        if mode == "encode":
            return encoder(x)
        elif mode == "decode":
            return decoder(x)


def init_fn(mdl):
    x = jax.numpy.ones((3, 2))
    z = mdl(x, "encode")
    return mdl(z, "decode")


class Partial(flax.struct.PyTreeNode):
    fn: Callable = flax.struct.field(pytree_node=False)
    args: Iterable[Any]

    def __call__(self, *args, **kwargs):
        return self.fn(*(tuple(self.args) + args), **kwargs)


class Foo(nn.Module):  # the guide's second Foo (its closure a Partial)
    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(x.shape[-1])
        fn = lambda mdl, x: mdl(x) + 1
        vmap_inner = nn.vmap(
            Foo.inner, in_axes=0, variable_axes={"params": 0}, split_rngs={"params": True}
        )
        return vmap_inner(self, x, Partial(fn, [dense]))

    def inner(self, x, fn):
        for i in range(3):
            x = fn(x)
        return x


# -- docs/guides/training_techniques/use_checkpointing.md, "Save checkpoints", as written there --
def checkpoint_bundle():
    """The guide's ``ckpt`` (and its ``model``, ``variables``, ``x1``, ``tx``)."""
    # A simple model with one linear layer.
    key1, key2 = random.split(random.key(0))
    x1 = random.normal(key1, (5,))  # A simple JAX array.
    model = nn.Dense(features=3)
    variables = model.init(key2, x1)

    # Flax's TrainState is a pytree dataclass and is supported in checkpointing.
    # Define your class with `@flax.struct.dataclass` decorator to make it compatible.
    tx = optax.sgd(learning_rate=0.001)  # An Optax SGD optimizer.
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx)
    # Perform a simple gradient update similar to the one during a normal training workflow.
    state = state.apply_gradients(grads=jax.tree_util.tree_map(jnp.ones_like, state.params))

    # Some arbitrary nested pytree with a dictionary and a NumPy array.
    config = {"dimensions": np.array([5, 3])}

    # Bundle everything together.
    ckpt = {"model": state, "config": config, "data": [x1]}
    return ckpt, model, variables, x1, tx


# -- Distributed_arrays_and_automatic_parallelization.md, "Examples: neural networks" -----------
def dist_predict(params, inputs):  # its predict
    for W, b in params:
        outputs = jnp.dot(inputs, W) + b
        inputs = jnp.maximum(outputs, 0)
    return outputs


def dist_loss(params, batch):  # its loss
    inputs, targets = batch
    predictions = dist_predict(params, inputs)
    return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))


def init_layer(key, n_in, n_out):
    k1, k2 = jax.random.split(key)
    W = jax.random.normal(k1, (n_in, n_out)) / jnp.sqrt(n_in)
    b = jax.random.normal(k2, (n_out,))
    return W, b


def init_model(key, layer_sizes, batch_size):
    key, *keys = jax.random.split(key, len(layer_sizes))
    params = list(map(init_layer, keys, layer_sizes[:-1], layer_sizes[1:]))

    key, *keys = jax.random.split(key, 3)
    inputs = jax.random.normal(keys[0], (batch_size, layer_sizes[0]))
    targets = jax.random.normal(keys[1], (batch_size, layer_sizes[-1]))

    return params, (inputs, targets)
