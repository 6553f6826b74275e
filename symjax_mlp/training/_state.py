"""A training run's state: :class:`TrainState` and its :class:`EpochRecord` s, the counts its
settings are, and the state as named tensors (``params/<key path>``, ``opt_state/...``, ``rng``;
a typed PRNG key as its key data), the layout both checkpoint formats store."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import operator
import reprlib
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from symjax_mlp._artifact.format import printable
from symjax_mlp._errors import CheckpointError, ConfigError


@dataclasses.dataclass(frozen=True)
class EpochRecord:
    """One epoch of the history: mean training loss and accuracies after it."""

    epoch: int
    step: int
    loss: float
    train_accuracy: float
    test_accuracy: float
    seconds: float


RECORD = typing.get_type_hints(EpochRecord)  # its fields, as a manifest checks them
#: a checkpoint's names, shapes and settings as a message shows them (``SHOWN.repr(x)``): six
#: at most, each cut; its files are anyone's (names of megabytes, thousands of settings)
SHOWN = reprlib.Repr()
SHOWN.maxlist = SHOWN.maxdict = SHOWN.maxtuple = 6
SHOWN.maxstring = SHOWN.maxother = 100


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a training run needs to continue exactly, as a pytree.

    Attributes:
      params: the model parameters (the ``"params"`` collection).
      opt_state: the optax optimizer state.
      rng: a typed PRNG key; split once per epoch for the shuffle.
      step, epoch: optimizer updates applied and epochs completed so far.
    """

    params: Any
    opt_state: Any
    rng: jax.Array
    step: int = dataclasses.field(default=0, metadata={"static": True})
    epoch: int = dataclasses.field(default=0, metadata={"static": True})


def is_count(x: Any, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _name(prefix: str, path: Any) -> str:
    return prefix + "/" + jax.tree_util.keystr(path, simple=True, separator="/")


def _is_key(leaf: Any) -> bool:
    """A typed PRNG key (optax.noisy_sgd's state holds one): stored as its key data."""
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def digest(tensors: dict[Any, Any]) -> str:
    """A sha256 of ``tensors`` (name -> array, host copies): their names, shapes, dtypes and
    bytes, in order."""
    sha = hashlib.sha256()
    for name, a in tensors.items():
        host = np.ascontiguousarray(np.asarray(a))
        sha.update(f"{name}|{host.shape}|{host.dtype}|".encode())
        sha.update(host.tobytes())
    return sha.hexdigest()


def named_leaves(state: TrainState) -> dict[str, Any]:
    """A checkpoint's tensors: ``{key path: leaf}`` of params and optimizer state, and ``rng``."""
    tensors: dict[str, Any] = {}
    for prefix in ("params", "opt_state"):
        for path, leaf in jax.tree_util.tree_leaves_with_path(getattr(state, prefix)):
            name = _name(prefix, path)
            if name in tensors:
                raise CheckpointError(
                    f"two leaves of the training state are both named {name!r}; rename the "
                    "dict keys that contain '/' so every leaf has its own checkpoint name."
                )
            tensors[name] = jax.random.key_data(leaf) if _is_key(leaf) else leaf
    tensors["rng"] = jax.random.key_data(state.rng)
    return tensors


def state_of(arrays: dict[str, Any], like: TrainState, manifest: dict[str, Any]) -> TrainState:
    """The state of ``arrays`` (as :func:`named_leaves` names them) in ``like``'s structure."""

    def leaf(a: Any, like_leaf: Any) -> Any:
        if not _is_key(like_leaf):
            return a
        return jax.random.wrap_key_data(a, impl=jax.random.key_impl(like_leaf))

    def tree(prefix: str, like_tree: Any) -> Any:
        paths, treedef = jax.tree_util.tree_flatten_with_path(like_tree)
        leaves = [leaf(arrays[_name(prefix, p)], like_leaf) for p, like_leaf in paths]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    rng = jax.random.wrap_key_data(np.asarray(arrays["rng"]), impl=jax.random.key_impl(like.rng))
    params, opt_state = tree("params", like.params), tree("opt_state", like.opt_state)
    return TrainState(params, opt_state, rng, step=manifest["step"], epoch=manifest["epoch"])


def started_from(arrays: dict[str, Any], like: TrainState) -> TrainState:
    """A new run's first state: ``like`` (a fresh one) with the params (model state too) of
    ``arrays`` (as :func:`named_leaves` names them), at step and epoch 0."""
    fresh = {n: a for n, a in named_leaves(like).items() if not n.startswith("params/")}
    mine = {n: jnp.asarray(a) for n, a in arrays.items() if n.startswith("params/")}
    return state_of({**mine, **fresh}, like, {"step": 0, "epoch": 0})


def check_fit(path: Any, stored: dict[str, tuple], wanted: dict[str, tuple]) -> None:
    """Refuses a checkpoint whose tensors (``{name: (shape, dtype)}``) are not ``wanted``'s."""
    missing, extra = sorted(set(wanted) - set(stored)), sorted(set(stored) - set(wanted))
    if missing or extra:
        raise CheckpointError(
            f"{path} does not fit this model and optimizer: missing tensors "
            f"{SHOWN.repr(missing)}, unexpected tensors {SHOWN.repr(extra)}. Resume with the "
            "model and optimizer that wrote it."
        )
    for name, (shape, dtype) in wanted.items():
        got_shape, got_dtype = stored[name]  # Orbax's: as its meta's JSON says, anyone's
        if tuple(got_shape) != tuple(shape) or str(got_dtype) != str(dtype):
            got_dtype = printable(str(got_dtype)[:40])
            fix = (  # the same model in another dtype, or another model
                f"The checkpoint holds {got_dtype} values: build the params and optimizer state "
                f"in {got_dtype} (the model's param_dtype, the same jax_enable_x64 setting), as "
                "the run that wrote it did."
                if tuple(got_shape) == tuple(shape)
                else "The checkpoint was written for another model or feature width; resume with "
                "the same ones."
            )
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {SHOWN.repr(tuple(got_shape))} and dtype "
                f"{got_dtype}, but this model expects shape {tuple(shape)} and dtype {dtype}. {fix}"
            )


#: init_from reads another run's optimizer state for its sha256 only: at most ``_TIMES`` the
#: params' tensors and bytes (optax's optimizers keep a few copies of them), or ``_FLOOR`` bytes
_TIMES, _FLOOR = 16, 64 << 20


def check_others(path: Any, others: dict[str, tuple], params: dict[str, Any]) -> None:
    """Refuses another run's optimizer state (``others``: its declared ``(shape, dtype)``) past
    ``_TIMES`` its ``params``' tensors or bytes (a few kilobytes may declare terabytes)."""
    size = sum(math.prod(s) * d.itemsize for s, d in others.values())
    mine = sum(math.prod(s) * np.dtype(d).itemsize for s, d in specs(params).values())
    if len(others) > _TIMES * len(params) or size > max(_TIMES * mine, _FLOOR):
        raise CheckpointError(
            f"{path}: besides the params, it declares {len(others):,} tensors of {size:,} bytes "
            f"of optimizer state, more than any optimizer keeps for {len(params):,} tensors of "
            f"{mine:,} bytes ({_TIMES} times them, or {_FLOOR:,} bytes): it was not written as "
            "saved. Start from another checkpoint, or leave init_from out."
        )


def declared(shape: Any, dtype: Any) -> tuple[tuple, Any]:
    """``(shape, dtype)`` of a tensor a checkpoint's meta declares (a PRNG key's dtype by its
    name: an optimizer's state may hold one); a TypeError or ValueError for a shape or dtype no
    array has."""
    dims = tuple(operator.index(d) for d in shape)  # a TypeError for a str, a float
    if any(d < 0 for d in dims):
        raise ValueError(f"shape {dims} has a negative dimension")
    keys = _key_dtypes()
    return dims, keys[dtype] if dtype in keys else jnp.dtype(dtype)


@functools.cache
def _key_dtypes() -> dict[str, Any]:
    keys = [jax.random.key(0, impl=k).dtype for k in ("threefry2x32", "rbg", "unsafe_rbg")]
    return {str(k): k for k in keys}


def specs(tensors: dict[str, Any]) -> dict[str, tuple]:
    """``{name: (shape, dtype)}``; a Python number's as save_checkpoint stores it."""
    arrays = {n: a if hasattr(a, "dtype") else np.asarray(a) for n, a in tensors.items()}
    return {name: (tuple(a.shape), str(a.dtype)) for name, a in arrays.items()}


def check_state(state: Any, caller: str) -> None:
    """Refuses anything but a :class:`TrainState` whose ``rng`` is a PRNG key."""
    try:
        ok = isinstance(state, TrainState) and jax.random.key_data(state.rng) is not None
    except TypeError:
        ok = False
    if not ok:
        got = type(state).__name__
        got = f"a TrainState whose rng is {state.rng!r}" if got == "TrainState" else f"a {got}"
        raise ConfigError(
            f"{caller}: the state must be a TrainState(params, opt_state, rng, step=, epoch=) "
            f"with rng a PRNG key; got {got}. Wrap yours: TrainState(params, opt_state, "
            "jax.random.key(seed), step=step)."
        )


def eval_point(y: Any, z: Any, b1: Any) -> Any:
    """A schedule-free run's eval params ``x`` from the point its gradients are taken at, ``y``,
    and its ``z`` (as ``optax.contrib.schedule_free_eval_params``), in ``y``'s dtype."""
    return ((y - (1.0 - b1) * z) / b1).astype(y.dtype)
