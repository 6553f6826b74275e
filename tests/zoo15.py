"""Code we did not write, round fifteen: Equinox's docstring examples no round ran, as their
authors wrote them, each wrapped only where it must be to run here (a ``...`` filled in, sizes
cut, each said where it is done), for tests/test_authors_round15.py.

patrick-kidger/equinox at 9336d820b2ef66b360fc6cb3611b3da5cefbb14d:

- equinox/nn/_conv.py, ``ConvTranspose``'s FAQ: the exact transpose of a convolution, its
  weight set by ``eqx.tree_at`` (``eqx.Conv(...)`` / ``eqx.ConvTranspose(...)`` filled with
  ``eqx.nn.Conv1d`` / ``eqx.nn.ConvTranspose1d``).
- equinox/nn/_normalisation.py, ``LayerNorm``'s FAQ: statistics over every dimension but the
  first, by ``jax.vmap(layer)(array)``.
- equinox/_vmap_pmap.py, ``filter_vmap``'s first example: ``f`` and ``g`` (its ensembles ran
  in zoo7eqx.py and tests/helpers.py).
- equinox/_tree.py, ``tree_at``'s surgery example (an MLP's last layer replaced).
- equinox/_ad.py, ``filter_custom_vjp``'s usage (its ``...`` filled: ``vjp_arg["w"] *
  sin(x)``, a gradient of its own for ``w``).

equinox has no example of ``MultiheadAttention`` (a mask, a dropout key), ``Dropout`` with its
key, or the 1d pools, ``Embedding`` and ``MLP(use_final_bias=False)``: ``Attention``,
``Pooled`` and ``NoFinalBias`` below are ours, built as those layers' docstrings say they are
called.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array

# --- equinox/nn/_conv.py, ConvTranspose's FAQ ------------------------------------------------


def exact_transpose(key):
    """The FAQ's ``cnn_t``: the transpose of ``cnn`` (both without bias, so it is exact)."""
    k1, k2 = jr.split(key)
    cnn = eqx.nn.Conv1d(3, 4, 3, stride=2, use_bias=False, key=k1)  # the FAQ's eqx.Conv(...)
    cnn_t = eqx.nn.ConvTranspose1d(4, 3, 3, stride=2, use_bias=False, key=k2)
    cnn_t = eqx.tree_at(lambda x: x.weight, cnn_t, jnp.flip(cnn.weight,
                        axis=tuple(range(2, cnn.weight.ndim))).swapaxes(0, 1))  # fmt: skip
    return cnn, cnn_t


# --- equinox/nn/_normalisation.py, LayerNorm's FAQ -------------------------------------------


def layer_norm_but_first(layer, array):
    """The FAQ's ``array = jax.vmap(layer)(array)`` (``layer = LayerNorm(...)`` the caller's),
    a row at a time."""
    array = jax.vmap(layer)(array)
    return array


# --- equinox/_vmap_pmap.py, filter_vmap's first example ----------------------------------------


@eqx.filter_vmap
def f(x, y):
    return x + y


@eqx.filter_vmap(in_axes=(None, 1))
def g(x, y):
    return x + y


# --- equinox/_tree.py, tree_at's surgery -----------------------------------------------------


def surgery(key):
    """The example's ``new_mlp`` (``eqx.nn.MLP(...)``, ``eqx.nn.Linear(...)`` sized here)."""
    k1, k2 = jr.split(key)
    mlp = eqx.nn.MLP(3, 2, 8, 2, key=k1)
    new_linear = eqx.nn.Linear(8, 5, key=k2)
    get_last_layer = lambda m: m.layers[-1]  # noqa: E731 - as the docstring writes it
    new_mlp = eqx.tree_at(get_last_layer, mlp, new_linear)
    return mlp, new_mlp


# --- equinox/_ad.py, filter_custom_vjp's usage -----------------------------------------------


@eqx.filter_custom_vjp
def fn(vjp_arg, *args, **kwargs):
    # `vjp_arg` is some PyTree of arbitrary Python objects.
    # `args`, `kwargs` contain arbitrary Python objects.
    (x,) = args  # the docstring's ``...`` (ours to the return)
    out = vjp_arg["w"] * jnp.sin(x)
    return out  # some PyTree of arbitrary Python objects.


@fn.def_fwd
def fn_fwd(perturbed, vjp_arg, *args, **kwargs):
    # `perturbed` is a pytree with the same structure as `vjp_arg`. Every leaf is
    # either `True` or `False`, indicating whether that leaf is being
    # differentiated. (All leaves that are not floating-point arrays will
    # necessarily have `False`. Some floating-point arrays might happen not to be
    # differentiated either.)
    out, residuals = fn(vjp_arg, *args, **kwargs), args  # the docstring's ``...``
    # Should return `out` as before. `residuals` can be any collection of JAX
    # arrays you want to keep around for the backward pass.
    return out, residuals


@fn.def_bwd
def fn_bwd(residuals, grad_obj, perturbed, vjp_arg, *args, **kwargs):
    # `grad_obj` will have `None` as the gradient for any leaves of `out` that were
    # not differentiated.
    (x,) = residuals  # the docstring's ``...``: twice the true gradient, to tell it apart
    grad_vjp_arg = {"w": 2.0 * (grad_obj * jnp.sin(x)).sum(0)}
    # `grad_vjp_arg` should be a pytree with the same structure as `vjp_arg`.
    # It can have `None` leaves to indicate that that argument has zero gradient.
    # (E.g. if the leaf was not a JAX array.)
    return grad_vjp_arg


# --- ours: MultiheadAttention with a mask and a dropout key; Dropout's key --------------------


class Attention(eqx.Module):
    """Self-attention over a sequence, ``mask`` its ``(query, key)`` mask; with a ``key``
    (as equinox passes keys, by keyword) its dropouts run unless ``eqx.nn.inference_mode``
    turned them off; without one they do not (``inference=True``, as
    ``MultiheadAttention.__call__`` takes it)."""

    mha: eqx.nn.MultiheadAttention
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        self.mha = eqx.nn.MultiheadAttention(2, 8, dropout_p=0.5, key=key)
        self.dropout = eqx.nn.Dropout(0.25)

    def __call__(self, x: Array, mask: Array, *, key=None) -> Array:
        k1, k2 = (None, None) if key is None else jr.split(key)
        inference = True if key is None else None  # None: the layer's own (inference_mode's)
        y = self.mha(x, x, x, mask=mask, key=k1, inference=inference)
        return self.dropout(y, key=k2, inference=inference)


# --- ours: Embedding, the 1d pools, GroupNorm, MLP(use_final_bias=False) ----------------------


class Pooled(eqx.Module):
    """Token ids embedded, convolved, pooled (max, avg, adaptive max), group-normed, then an
    MLP without its final bias; one sequence at a time."""

    embedding: eqx.nn.Embedding
    conv: eqx.nn.Conv1d
    pools: eqx.nn.Sequential
    norm: eqx.nn.GroupNorm
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2, k3 = jr.split(key, 3)
        self.embedding = eqx.nn.Embedding(10, 4, key=k1)
        self.conv = eqx.nn.Conv1d(4, 6, 3, key=k2)
        self.pools = eqx.nn.Sequential([
            eqx.nn.MaxPool1d(2, 2), eqx.nn.AvgPool1d(2, 1, padding=1), eqx.nn.AdaptiveMaxPool1d(3)
        ])  # fmt: skip
        self.norm = eqx.nn.GroupNorm(2, 6)
        self.mlp = eqx.nn.MLP(18, 2, 8, 2, use_final_bias=False, key=k3)

    def __call__(self, tokens: Array) -> Array:
        x = jax.vmap(self.embedding)(tokens).T  # (channels, length)
        x = self.norm(self.pools(self.conv(x)))
        return self.mlp(x.reshape(-1))
