"""Code we did not write, round sixteen, as its authors wrote it (sizes shrunk), for
tests/test_authors_round16.py.

- JAX's docs/new_docs/301/sharding-ad.md (jax-ml/jax at
  cec06d116c05f0d52adfceee3d3b730fdbcb0ce5), "Autodiff and sharding": the data-parallel
  ``loss``, ``loss2`` (its weights cast to ``reduced={'X'}``, so their gradients come back
  unreduced), ``loss_fanout`` and the capstone's ``predict`` (a ``lax.scan`` over layers),
  ``loss3`` and the microbatch ``step`` accumulating unreduced gradients.
- Felix Köhler's simple_FNO_in_JAX.ipynb (Ceyron/FNO-in-JAX at
  a850e80bc654d848c25d3b82197912ad31628515): ``SpectralConv1d`` (``jnp.fft.rfft``, complex
  weights on the lowest modes, ``jnp.fft.irfft``), ``FNOBlock1d``, ``FNO1d`` and ``loss_fn``,
  as written there; the notebook's Burgers data (a .mat download) is left out.
"""

from typing import Callable, List  # noqa: UP035 - as written there

import equinox as eqx
import jax
import jax.numpy as jnp

# --- jax docs/new_docs/301/sharding-ad.md ---------------------------------------------------


def loss(w, x):
    return jnp.sum((x @ w) ** 2)


def loss2(w, x):
    w = jax.reshard(w, jax.P(None, None, reduced={"X"}))
    return jnp.sum((x @ w) ** 2)


def loss_fanout(w, x1, x2):
    w = jax.reshard(w, jax.P(None, None, reduced={"X"}))
    return jnp.sum(x1 @ w) + jnp.sum(x2 @ w)


def predict(stacked_ws, xs):  # stacked_ws: [layer, features, features]
    def apply_layer(xs, w):
        return jnp.tanh(xs @ w), None

    final_xs, _ = jax.lax.scan(apply_layer, xs, stacked_ws)
    return final_xs


def make_step(predict):
    """The capstone's ``loss3`` and ``step``, over the ``predict`` given (the docs' own, or a
    Hybrid's ``apply``)."""

    def loss3(stacked_ws, batch):
        return jnp.sum(predict(stacked_ws, batch) ** 2)

    @jax.jit
    def step(stacked_ws, xs):  # xs: [microbatch, batch@X, features]
        def microbatch_step(grad_acc, xs_mb):
            grads = jax.grad(loss3)(stacked_ws, xs_mb)
            # ws are reduced, so grads are unreduced -- and we can check it!
            assert jax.typeof(grads).sharding.spec.unreduced == {"X"}
            return grad_acc + grads, None

        grad_acc = jax.reshard(jnp.zeros_like(stacked_ws), jax.P(unreduced={"X"}))
        grad_acc, _ = jax.lax.scan(microbatch_step, grad_acc, xs)
        grads = jax.reshard(grad_acc, jax.P())  # the one AllReduce
        ws = jax.reshard(stacked_ws, jax.P())  # free: full copies already
        return ws - 0.01 * grads

    return step


# --- Ceyron/FNO-in-JAX simple_FNO_in_JAX.ipynb ----------------------------------------------


class SpectralConv1d(eqx.Module):
    real_weights: jax.Array
    imag_weights: jax.Array
    in_channels: int
    out_channels: int
    modes: int

    def __init__(
        self,
        in_channels,
        out_channels,
        modes,
        *,
        key,
    ):
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.modes = modes

        scale = 1.0 / (in_channels * out_channels)

        real_key, imag_key = jax.random.split(key)
        self.real_weights = jax.random.uniform(
            real_key,
            (in_channels, out_channels, modes),
            minval=-scale,
            maxval=+scale,
        )
        self.imag_weights = jax.random.uniform(
            imag_key,
            (in_channels, out_channels, modes),
            minval=-scale,
            maxval=+scale,
        )

    def complex_mult1d(
        self,
        x_hat,
        w,
    ):
        return jnp.einsum("iM,ioM->oM", x_hat, w)

    def __call__(
        self,
        x,
    ):
        channels, spatial_points = x.shape  # noqa: RUF059

        # shape of x_hat is (in_channels, spatial_points//2+1)
        x_hat = jnp.fft.rfft(x)
        # shape of x_hat_under_modes is (in_channels, self.modes)
        x_hat_under_modes = x_hat[:, : self.modes]
        weights = self.real_weights + 1j * self.imag_weights
        # shape of out_hat_under_modes is (out_channels, self.modes)
        out_hat_under_modes = self.complex_mult1d(x_hat_under_modes, weights)

        # shape of out_hat is (out_channels, spatial_points//2+1)
        out_hat = jnp.zeros((self.out_channels, x_hat.shape[-1]), dtype=x_hat.dtype)
        out_hat = out_hat.at[:, : self.modes].set(out_hat_under_modes)

        out = jnp.fft.irfft(out_hat, n=spatial_points)

        return out


class FNOBlock1d(eqx.Module):
    spectral_conv: SpectralConv1d
    bypass_conv: eqx.nn.Conv1d
    activation: Callable

    def __init__(
        self,
        in_channels,
        out_channels,
        modes,
        activation,
        *,
        key,
    ):
        spectral_conv_key, bypass_conv_key = jax.random.split(key)
        self.spectral_conv = SpectralConv1d(
            in_channels,
            out_channels,
            modes,
            key=spectral_conv_key,
        )
        self.bypass_conv = eqx.nn.Conv1d(
            in_channels,
            out_channels,
            1,  # Kernel size is one
            key=bypass_conv_key,
        )
        self.activation = activation

    def __call__(
        self,
        x,
    ):
        return self.activation(self.spectral_conv(x) + self.bypass_conv(x))


class FNO1d(eqx.Module):
    lifting: eqx.nn.Conv1d
    fno_blocks: List[FNOBlock1d]  # noqa: UP006 - as written there
    projection: eqx.nn.Conv1d

    def __init__(
        self,
        in_channels,
        out_channels,
        modes,
        width,
        activation,
        n_blocks=4,
        *,
        key,
    ):
        key, lifting_key = jax.random.split(key)
        self.lifting = eqx.nn.Conv1d(
            in_channels,
            width,
            1,
            key=lifting_key,
        )

        self.fno_blocks = []
        for i in range(n_blocks):  # noqa: B007
            key, subkey = jax.random.split(key)
            self.fno_blocks.append(
                FNOBlock1d(
                    width,
                    width,
                    modes,
                    activation,
                    key=subkey,
                )
            )

        key, projection_key = jax.random.split(key)
        self.projection = eqx.nn.Conv1d(
            width,
            out_channels,
            1,
            key=projection_key,
        )

    def __call__(
        self,
        x,
    ):
        x = self.lifting(x)

        for fno_block in self.fno_blocks:
            x = fno_block(x)

        x = self.projection(x)

        return x


def loss_fn(model, x, y):
    y_pred = jax.vmap(model)(x)
    loss = jnp.mean(jnp.square(y_pred - y))
    return loss
