"""Hybridizable MLP building blocks: pure ``flax.linen`` modules with plain-dict params."""

from __future__ import annotations

import numbers
import reprlib
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from symjax_mlp._errors import ConfigError, SignatureError

#: Elementwise activations from :mod:`jax.nn` that a :class:`Dense` layer accepts by name.
ACTIVATIONS: tuple[str, ...] = (
    "celu", "elu", "gelu", "hard_sigmoid", "hard_silu", "hard_swish", "hard_tanh", "leaky_relu",
    "log_sigmoid", "mish", "relu", "relu6", "selu", "sigmoid", "silu", "soft_sign", "softplus",
    "sparse_plus", "squareplus", "swish", "tanh",
)  # fmt: skip


def activation_fn(name: str | None, call: str = "Dense") -> Callable[[jax.Array], jax.Array]:
    """The :mod:`jax.nn` activation called ``name`` (``None``: the identity)."""
    if name is None:
        return lambda x: x
    if not isinstance(name, str) or name not in ACTIVATIONS:
        raise ConfigError(
            f"symjax_mlp.{call}(activation={name!r}): unknown activation {name!r}; expected None "
            f"or one of: {', '.join(ACTIVATIONS)}."
        )
    return getattr(jax.nn, name)


class Dense(nn.Dense):
    """``flax.linen.Dense`` followed by an optional activation named from :mod:`jax.nn`.

    Example:
      >>> layer = Dense(4, activation="relu")
      >>> variables = layer.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> layer.apply(variables, jnp.ones((1, 3))).shape
      (1, 4)
    """

    activation: str | None = None

    def __post_init__(self) -> None:
        activation_fn(self.activation)  # refused at construction, not at the first call
        if not _width(self.features):
            raise ConfigError(
                f"symjax_mlp.Dense(features={self.features!r}): the output width is a positive "
                "int, e.g. Dense(256)."
            )
        _check_dtype("Dense", self.dtype)
        _check_dtype("Dense", self.param_dtype, "param_dtype")
        super().__post_init__()

    def __call__(self, inputs: jax.Array) -> jax.Array:
        if (got := _no_array(inputs)) is not None:  # else "the input is a scalar", below
            raise SignatureError(
                f"symjax_mlp.Dense({self.features}): the input is {got}, not an array; a Dense "
                "layer maps the last axis of an array. Pass an array of shape (batch, features), "
                "e.g. jnp.zeros((1, n)) for one example of n features."
            )
        if not jnp.ndim(inputs):  # else flax's IndexError: tuple index out of range
            raise SignatureError(
                f"symjax_mlp.Dense({self.features}): the input is a scalar (shape ()), and a Dense "
                "layer maps the last axis of its input. Pass an array of shape (batch, features), "
                "e.g. jnp.reshape(x, (1, 1)) for one example of one feature."
            )
        return activation_fn(self.activation)(super().__call__(inputs))


def _no_array(x: Any) -> str | None:
    """What ``x`` is, in words, if no array can be read from it (None, a str, a dict, ...);
    ``None`` for an array, a number or a list of them (``jnp.ndim`` reads any as 0-d)."""
    if isinstance(x, jax.Array | np.ndarray | np.generic | numbers.Number | list | tuple):
        return None
    if hasattr(x, "__jax_array__") or hasattr(x, "__array__"):
        return None
    return "None" if x is None else f"a {type(x).__name__} ({reprlib.repr(x)})"


def _check_dtype(call: str, dtype: Any, field: str = "dtype") -> None:
    """Refuses a ``dtype`` that is no floating type when built (else at init: NumPy's
    "data type not understood", flax's "Dtype must be inexact")."""
    try:
        inexact = dtype is None or jnp.issubdtype(jnp.dtype(dtype), jnp.inexact)
    except TypeError:
        inexact = False
    if not inexact:
        raise ConfigError(
            f"symjax_mlp.{call}({field}={dtype!r}): the dtype the layers "
            f"{'compute in' if field == 'dtype' else 'keep their params in'} is a floating type; "
            f"pass e.g. {field}=jnp.bfloat16, or None (the inputs' dtype)."
        )


def _check_layers(cls: str, field: str, items: Any) -> None:
    """Refuses what is no sequence of layers when built, not deep in ``init``."""
    seq = isinstance(items, Sequence) and not isinstance(items, str | bytes)
    if seq and not items:
        raise ConfigError(
            f"symjax_mlp.{cls}({field}={items!r}): expected at least one "
            f"{'layer' if field == 'layers' else 'branch'}; got an empty sequence. Write e.g. "
            f"{cls}((Dense(4), Dense(2)))."
        )
    if bad := [item for item in items if not callable(item)] if seq else [items]:
        raise ConfigError(
            f"symjax_mlp.{cls}({field}=...): expected a sequence of modules (or callables such as "
            f"nn.relu); got {bad[0]!r} ({type(bad[0]).__name__}). Write e.g. "
            f"{cls}((Dense(4), Dense(2)))."
        )


class HybridSequential(nn.Module):
    """Runs ``layers`` one after the other, each on the previous one's output."""

    layers: Sequence[nn.Module]

    def __post_init__(self) -> None:
        _check_layers("HybridSequential", "layers", self.layers)
        super().__post_init__()

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x`` through the layers in turn: the last one's output."""
        for layer in self.layers:
            x = layer(x)
        return x


class HybridConcurrent(nn.Module):
    """Feeds the same input to every branch and concatenates their outputs along ``axis``.

    Example:
      >>> cat = HybridConcurrent((Dense(3), Dense(5)))
      >>> variables = cat.init(jax.random.key(0), jnp.ones((2, 4)))
      >>> cat.apply(variables, jnp.ones((2, 4))).shape
      (2, 8)
    """

    branches: Sequence[nn.Module]
    axis: int = -1

    def __post_init__(self) -> None:
        _check_layers("HybridConcurrent", "branches", self.branches)
        if not isinstance(self.axis, numbers.Integral) or isinstance(self.axis, bool | np.bool_):
            raise ConfigError(
                f"symjax_mlp.HybridConcurrent(axis={self.axis!r}): axis is the int the branches' "
                "outputs are concatenated along, e.g. axis=-1 (the features)."
            )
        super().__post_init__()

    def __call__(self, x: jax.Array) -> jax.Array:
        """Every branch's output on ``x``, concatenated along ``axis``."""
        outs = [branch(x) for branch in self.branches]
        rank = outs[0].ndim
        if not rank:
            raise ConfigError(
                f"symjax_mlp.HybridConcurrent(axis={self.axis}): the branches' outputs are "
                f"scalars (shapes {[tuple(o.shape) for o in outs]}), which have no axis to join "
                "along. Make each branch return an array of rank >= 1, e.g. x.sum(-1)."
            )
        if not -rank <= self.axis < rank:
            raise ConfigError(
                f"symjax_mlp.HybridConcurrent(axis={self.axis}): the branches' outputs have rank "
                f"{rank} (shapes {[tuple(o.shape) for o in outs]}), so axis must be in "
                f"[{-rank}, {rank - 1}]; e.g. axis=-1 (the features)."
            )
        off = {o.shape[: self.axis % rank] + o.shape[self.axis % rank + 1 :] for o in outs}
        if len(off) > 1 or len({o.ndim for o in outs}) > 1:  # else JAX's TypeError, unnamed
            raise ConfigError(
                f"symjax_mlp.HybridConcurrent(axis={self.axis}): the branches' outputs have shapes "
                f"{[tuple(o.shape) for o in outs]}; joined along axis {self.axis}, they must "
                "agree in rank and every other axis. Join them where they differ (e.g. axis=-1, "
                "the features), or make the branches agree."
            )
        return jnp.concatenate(outs, axis=self.axis)


def mlp(
    sizes: Sequence[int], *, activation: str | None = "relu", dtype: jnp.dtype | None = None
) -> HybridSequential:
    """Builds a multilayer perceptron: ``Dense`` layers of ``sizes``, ``activation`` between
    (none after the last); the input width comes from the data at ``init``.

    Args:
      sizes: output width of each layer, at least one positive int. No layer is given its
        input width (as ``torch.nn.Linear(in, out)`` is): the chapter's 512 -> 256 -> 128 -> 2
        is ``mlp((256, 128, 2))``; ``mlp((512, 256, 128, 2))`` is four layers, the first 512
        wide.
      activation: name of a :mod:`jax.nn` activation (see :data:`ACTIVATIONS`) or ``None``.
      dtype: computation dtype of every layer (``None``: from the inputs).

    Raises:
      ValueError: an empty ``sizes``, a non-positive width, an unknown activation or a
        ``dtype`` that is no floating type.

    Example:
      >>> net = mlp((256, 128, 2))
      >>> variables = net.init(jax.random.key(0), jnp.ones((1, 512)))
      >>> net.apply(variables, jnp.ones((1, 512))).shape
      (1, 2)
    """
    return build_mlp(sizes, activation, dtype, "mlp")


def build_mlp(sizes: Any, activation: Any, dtype: Any, call: str) -> HybridSequential:
    """:func:`mlp`, its refusals headed ``symjax_mlp.{call}(`` (``chapter.chapter_mlp``)."""
    widths = isinstance(sizes, Sequence | np.ndarray) and not isinstance(sizes, str)
    if not (widths and len(sizes) and all(map(_width, sizes))):
        raise ConfigError(
            f"symjax_mlp.{call}(sizes={sizes!r}): pass the layers' widths as a sequence of "
            "positive ints, e.g. mlp((256, 128, 2)) (one layer: mlp((2,)))."
        )
    activation_fn(activation, call)  # refused even where only the last layer (none) would use it
    _check_dtype(call, dtype)
    acts = (activation,) * (len(sizes) - 1) + (None,)
    layers = (Dense(int(s), activation=a, dtype=dtype) for s, a in zip(sizes, acts, strict=True))
    return HybridSequential(tuple(layers))


def _width(n: Any) -> bool:
    """A positive int (a NumPy int too), not a bool."""
    return isinstance(n, numbers.Integral) and not isinstance(n, bool | np.bool_) and n > 0
