"""Code we did not write, round thirteen: Flax's and Equinox's docs where no round looked, as
their authors wrote them, each wrapped only where it must be to run here (sizes cut, a ``...``
filled in, each said where it is done), for tests/test_authors_round13.py.

google/flax at 18f8f311c275d57f46d95e41b15aa97b454754c0:

- docs_nnx/why.rst: ``Model`` (Linear, BatchNorm, Dropout) and its ``train_step``; the linen
  and nnx ``AutoEncoder`` (its ``encode`` method); ``Block`` and the LoRA surgery
  (``LoraParam``, ``LoraLinear``, ``nnx.iter_graph``); ``Weights``, ``create_weights`` and
  ``vector_dot`` under ``nnx.vmap``; ``WeightStack`` (``nnx.vmap`` on ``__init__`` and
  ``__call__``, ``out_axes=1``).
- docs_nnx/guides/filters_guide.md: ``Foo``, ``SpecialParam``, ``Bar`` and its ``split``.
- docs/guides/flax_fundamentals/arguments.md: ``MyDropout`` (``nn.merge_param``) and
  ``ResidualModel`` (a dropout template passed down).
- docs/guides/flax_fundamentals/setup_or_nncompact.rst: ``MLP`` both ways.
- flax/nnx/nn/recurrent.py: ``Bidirectional``'s docstring (two ``RNN`` s of a ``GRUCell``).

patrick-kidger/equinox at 9336d820b2ef66b360fc6cb3611b3da5cefbb14d:

- docs/pattern.md: ``AbstractInterpolation``, ``AbstractPolynomialInterpolation`` (an
  ``eqx.AbstractVar``, ``__check_init__``) and ``CubicInterpolation``.
- docs/faq.md: the non-trainable ``buffer`` by ``jax.lax.stop_gradient``; ``rollout`` of an
  MLP by ``eqx.partition``/``eqx.combine`` in a ``jax.lax.scan``.
- equinox/_errors.py (``error_if``'s docstring), equinox/_ad.py (``filter_custom_jvp``'s
  docstring), equinox/_module/_field.py (``field(converter=...)`` and ``static=True``'s).
"""

import abc
from functools import partial
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from jax import random
from jaxtyping import Array

# --- flax docs_nnx/why.rst ---------------------------------------------------------------------


class Model(nnx.Module):
    def __init__(self, din, dmid, dout, rngs: nnx.Rngs):
        self.linear = nnx.Linear(din, dmid, rngs=rngs)
        self.bn = nnx.BatchNorm(dmid, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.linear_out = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.dropout(self.bn(self.linear(x))))
        return self.linear_out(x)


@nnx.jit  # Automatic state management for JAX transforms.
def train_step(model, optimizer, x, y):
    def loss_fn(model):
        y_pred = model(x)  # call methods directly
        return ((y_pred - y) ** 2).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)  # in-place updates

    return loss


Encoder = lambda: nn.Dense(10)  # noqa: E731 - as the guide writes them
Decoder = lambda: nn.Dense(2)  # noqa: E731


class LinenAutoEncoder(nn.Module):  # the guide's linen ``AutoEncoder``
    def setup(self):
        self.encoder = Encoder()
        self.decoder = Decoder()

    def __call__(self, x) -> jax.Array:
        return self.decoder(self.encoder(x))

    def encode(self, x) -> jax.Array:
        return self.encoder(x)


NnxEncoder = lambda rngs: nnx.Linear(2, 10, rngs=rngs)  # noqa: E731 - the guide's ``Encoder``
NnxDecoder = lambda rngs: nnx.Linear(10, 2, rngs=rngs)  # noqa: E731


class AutoEncoder(nnx.Module):
    def __init__(self, rngs):
        self.encoder = NnxEncoder(rngs)
        self.decoder = NnxDecoder(rngs)

    def __call__(self, x) -> jax.Array:
        return self.decoder(self.encoder(x))

    def encode(self, x) -> jax.Array:
        return self.encoder(x)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(5, 10, rngs=rngs)
        self.bn = nnx.BatchNorm(10, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.dropout(self.bn(self.linear(x))))


class LoraParam(nnx.Param):
    pass


class LoraLinear(nnx.Module):
    def __init__(self, linear, rank, rngs):
        self.linear = linear
        self.A = LoraParam(random.normal(rngs(), (linear.in_features, rank)))
        self.B = LoraParam(random.normal(rngs(), (rank, linear.out_features)))

    def __call__(self, x: jax.Array):
        return self.linear(x) + x @ self.A @ self.B


def lora_block(seed: int = 0) -> Block:
    """The guide's surgery: every ``nnx.Linear`` of a ``Block`` wrapped in a ``LoraLinear``."""
    rngs = nnx.Rngs(seed)
    model = Block(rngs)

    for path, module in nnx.iter_graph(model):  # noqa: B007 - as the guide writes it
        if isinstance(module, nnx.Module):
            for name, value in vars(module).items():
                if isinstance(value, nnx.Linear):
                    setattr(module, name, LoraLinear(value, rank=5, rngs=rngs))
    return model


class Weights(nnx.Module):
    def __init__(self, kernel: jax.Array, bias: jax.Array):
        self.kernel, self.bias = nnx.Param(kernel), nnx.Param(bias)


def create_weights(seed: jax.Array):
    return Weights(
        kernel=random.uniform(random.key(seed), (2, 3)),
        bias=jnp.zeros((3,)),
    )


def vector_dot(weights: Weights, x: jax.Array):
    assert weights.kernel.ndim == 2, "Batch dimensions not allowed"
    assert x.ndim == 1, "Batch dimensions not allowed"
    return x @ weights.kernel + weights.bias


def stacked_dot(weights, x):
    """The guide's ``y = nnx.vmap(vector_dot, in_axes=(0, 0), out_axes=1)(weights, x)``."""
    return nnx.vmap(vector_dot, in_axes=(0, 0), out_axes=1)(weights, x)


class WeightStack(nnx.Module):
    @nnx.vmap(in_axes=(0, 0), out_axes=0)
    def __init__(self, seed: jax.Array):
        self.kernel = nnx.Param(random.uniform(random.key(seed), (2, 3)))
        self.bias = nnx.Param(jnp.zeros((3,)))

    @nnx.vmap(in_axes=(0, 0), out_axes=1)
    def __call__(self, x: jax.Array):
        assert self.kernel.ndim == 2, "Batch dimensions not allowed"
        assert x.ndim == 1, "Batch dimensions not allowed"
        return x @ self.kernel + self.bias


# --- flax docs_nnx/guides/filters_guide.md -----------------------------------------------------


class Foo(nnx.Module):
    def __init__(self):
        self.a = nnx.Param(0)
        self.b = nnx.BatchStat(True)


KeyPath = tuple[nnx.graph.Key, ...]


def split(node, *filters):
    graphdef, state = nnx.graph.flatten(node)
    predicates = [nnx.filterlib.to_predicate(f) for f in filters]
    flat_states: list[dict[KeyPath, Any]] = [{} for p in predicates]

    for path, value in state:
        for i, predicate in enumerate(predicates):
            if predicate(path, value):
                flat_states[i][path] = value
                break
        else:
            raise ValueError(f"No filter matched {path = } {value = }")

    states: tuple[nnx.GraphState, ...] = tuple(
        nnx.State.from_flat_path(flat_state) for flat_state in flat_states
    )
    return graphdef, *states


class SpecialParam(nnx.Param):
    pass


class Bar(nnx.Module):
    def __init__(self):
        self.a = nnx.Param(0)
        self.b = SpecialParam(0)


def net_foo(foo, x):
    """Ours: rows scaled by ``Foo``'s int Param, kept where its bool BatchStat says."""
    return jnp.where(foo.b.get_value(), x * (foo.a + 2), x)


def net_bar(bar, x):
    """Ours: rows through ``Bar``'s Param and SpecialParam (ints, as the guide makes them)."""
    return x * (bar.a + 1) + bar.b


# --- flax docs/guides/flax_fundamentals/arguments.md -------------------------------------------


class MyDropout(nn.Module):
    drop_rate: float
    deterministic: Optional[bool] = None  # noqa: UP045 - as the guide writes it

    @nn.compact
    def __call__(self, x, deterministic=None):
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        # ... (the guide's; ours: linen's Dropout with the merged setting)
        return nn.Dropout(rate=self.drop_rate)(x, deterministic=deterministic)


class ResidualBlock(nn.Module):
    """Ours: the guide's ``ResidualBlock(dropout=dropout, ...)``, a Dense then its template."""

    dropout: Any

    @nn.compact
    def __call__(self, x):
        return self.dropout()(nn.relu(nn.Dense(x.shape[-1])(x)))


class ResidualModel(nn.Module):
    drop_rate: float

    @nn.compact
    def __call__(self, x, *, train):
        dropout = partial(MyDropout, drop_rate=self.drop_rate, deterministic=not train)
        for i in range(3):  # noqa: B007 - the guide's range(10), cut
            x += ResidualBlock(dropout=dropout)(x)
        return x


# --- flax docs/guides/flax_fundamentals/setup_or_nncompact.rst ---------------------------------


class SetupMLP(nn.Module):  # the guide's ``MLP`` "Using setup"
    def setup(self):
        # Submodule names are derived by the attributes you assign to. In this
        # case, "dense1" and "dense2". This follows the logic in PyTorch.
        self.dense1 = nn.Dense(32)
        self.dense2 = nn.Dense(32)

    def __call__(self, x):
        x = self.dense1(x)
        x = nn.relu(x)
        x = self.dense2(x)
        return x


class CompactMLP(nn.Module):  # the guide's ``MLP`` "Using nn.compact"
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, name="dense1")(x)
        x = nn.relu(x)
        x = nn.Dense(32, name="dense2")(x)
        return x


# --- flax/nnx/nn/recurrent.py, Bidirectional's docstring --------------------------------------


def bidirectional():
    """The docstring's ``layer``."""
    # Define forward and backward RNNs
    forward_rnn = nnx.RNN(nnx.GRUCell(in_features=3, hidden_features=4, rngs=nnx.Rngs(0)))
    backward_rnn = nnx.RNN(nnx.GRUCell(in_features=3, hidden_features=4, rngs=nnx.Rngs(0)))

    # Create Bidirectional layer
    layer = nnx.Bidirectional(forward_rnn=forward_rnn, backward_rnn=backward_rnn)
    return layer


# --- equinox docs/pattern.md -------------------------------------------------------------------


class AbstractInterpolation(eqx.Module):
    @abc.abstractmethod
    def __call__(self, x: Array) -> Array:
        raise NotImplementedError


class AbstractPolynomialInterpolation(AbstractInterpolation):
    coeffs: eqx.AbstractVar[Array]

    def __check_init__(self):
        if not jnp.issubdtype(self.coeffs.dtype, jnp.floating):
            raise ValueError("Coefficients must be floating-point!")

    def degree(self) -> int:
        return len(self.coeffs)

    def __call__(self, x: Array) -> Array:
        return jnp.polyval(self.coeffs, x)


class CubicInterpolation(AbstractPolynomialInterpolation):
    coeffs: Array

    def __init__(self, ts: Array, xs: Array):
        self.coeffs = jnp.polyfit(ts, xs, 3)  # the guide's ``...  # some implementation``


# --- equinox docs/faq.md -----------------------------------------------------------------------


class BufferModel(eqx.Module):  # the FAQ's ``Model``
    buffer: Array
    param: Array

    def __call__(self, x):
        return self.param * x + jax.lax.stop_gradient(self.buffer)


def rollout(mlp, xs):
    arr, static = eqx.partition(mlp, eqx.is_array)

    def step(carry, x):
        mlp = eqx.combine(carry, static)
        val = mlp(x)
        carry, _ = eqx.partition(mlp, eqx.is_array)
        return carry, [val]

    _, scan_out = jax.lax.scan(step, arr, xs)
    return scan_out


# --- equinox/_errors.py, equinox/_ad.py, equinox/_module/_field.py docstrings ------------------


@jax.jit
def f(x):
    x = eqx.error_if(x, x < 0, "x must be >= 0")
    # ...use x in your computation...
    return x


def net_checked(p, x):
    """Ours: the docstring's ``f`` of scaled rows."""
    return f(x * p["w"])


class Checked(eqx.Module):
    """Ours: ``error_if``'s docstring ``f`` (``x = error_if(x, x < 0, "x must be >= 0")``)
    before an MLP over the rows."""

    mlp: eqx.nn.MLP

    def __call__(self, x):
        x = eqx.error_if(x, x < 0, "x must be >= 0")
        return jax.vmap(self.mlp)(x)


@eqx.filter_custom_jvp
def call(x, y, *, fn):
    return fn(x, y)


@call.def_jvp
def call_jvp(primals, tangents, *, fn):
    x, y = primals
    tx, ty = tangents
    # `y` is not differentiated below, so it has a symbolic zero tangent,
    # represented as a `None`.
    assert ty is None
    primal_out = call(x, y, fn=fn)
    tangent_out = 2 * tx
    return primal_out, tangent_out


def net_call(p, x):
    """Ours: ``call(x @ w, y, fn=lambda a, b: a + b)``, the docstring's ``fn``."""
    return call(x @ p["w"], jnp.asarray(2.0), fn=lambda a, b: a + b)


class MyModule(eqx.Module):
    """The docstrings' two ``MyModule``s in one: ``foo`` converted, ``static_field`` static;
    ``__call__`` ours."""

    foo: Array = eqx.field(converter=jax.numpy.asarray)
    static_field: int = eqx.field(static=True, default=2)

    def __call__(self, x):
        return self.foo * x**self.static_field
