"""The optimizer as training calls it, checked on shapes before the first step: one of another
form is a ConfigError naming ``optimizer.init`` or ``optimizer.update``, never a raw error from
inside a step. :func:`only` restricts it to the params train()'s ``wrt`` selects."""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from symjax_mlp._errors import ConfigError, first_line, user_stacklevel
from symjax_mlp._hybrid.pure.nnx_module import trainable
from symjax_mlp._hybrid.trace import TRACER_ERRORS
from symjax_mlp.training._state import digest

_INIT_RAISED = (
    "{caller}: optimizer.init(params) raised {kind}: {e!s:.200}. train() passes the model's "
    "params as they are, {tree!s:.200}; use an optimizer that takes them, or write the loop with "
    "train_step."
)
_NOT_ARRAYS = (
    "{caller}: optimizer.init(params) returned a state whose {where} is a {kind}; an optimizer "
    "state holds arrays and numbers only: each step carries it through jit, each checkpoint "
    "stores it. Keep other values out of the state (in the optimizer's closure)."
)
_UPDATE_FORM = (
    "{caller}: optimizer.update(grads, opt_state, params) returned {got}; expected (updates, "
    "opt_state), the updates a tree like the gradients, as optax's transformations return. "
    "Make update return that pair."
)
_UPDATE_RAISED = (
    "{caller}: optimizer.update(grads, opt_state, params) raised {kind}: {e!s:.300}, traced on "
    "the params' shapes before the first step. Fix the optimizer (its update of a gradient "
    "like the params), or pass one such as optax.adam(1e-3)."
)
_EXTRA_ARGS = (
    "{caller}: the optimizer's update raised TypeError: {error}. The training step calls "
    "optimizer.update(grads, opt_state, params{given}) and nothing more; an optimizer that "
    "needs more (optax.lbfgs: grad= and value_fn=, for its line search) runs in a loop of your "
    "own, e.g. optax's lbfgs example with optax.value_and_grad_from_state. Pass an optimizer "
    "such as optax.adam(1e-3), optax.sgd(0.1) or one taking value= (reduce_on_plateau)."
)
_UNSTEPPED_RAISED = "{caller}: optimizer.update(grads, opt_state, params) raised {e}. "
#: optimizers whose update needs what train()'s step does not give, by their state's type
_UNSTEPPED = {
    optax.LookaheadState: (
        "optax.lookahead updates optax.LookaheadParams (fast and slow params), not the model's "
        "params that train() passes. Train its fast optimizer alone (optimizer=optax.adam(...)), "
        "or write optax's lookahead_mnist loop over h.apply with "
        "optax.LookaheadParams.init_synced(params), its slow params the trained model."
    ),
    optax.contrib.DifferentiallyPrivateAggregateState: (
        "optax.contrib.dpsgd clips each example's gradient: it needs per-example gradients (a "
        "batch axis first, jax.vmap of jax.grad), and train() computes the batch's gradient. "
        "Write the loop of optax's differentially_private_sgd example over h.apply."
    ),
    optax.contrib.SophiaState: (
        "optax.contrib.sophia estimates the Hessian by calling obj_fn=, the loss of the params, "
        "which train()'s step does not pass. Write optax's loop over h.apply, "
        "tx.update(grads, state, params, obj_fn=loss), or pass an optimizer such as optax.adam."
    ),
}
_STATE_MOVED = (
    "{caller}: the optimizer's update returned a state unlike the one it was given ({was} -> "
    "{got}). A compiled step needs the same structure, shapes and dtypes at every step, and a "
    "checkpoint restores init's. Make update return a state like init's (cast with .astype)."
)

_WRT_NONE = (
    "{caller}: wrt={wrt!r} selects none of the {n} params of {model} ({paths}): every step "
    "would leave them as they are. Pass a filter that selects those to train: an nnx filter "
    "(nnx.LoRAParam, nnx.PathContains('head')) or a function (path, value) -> bool, path the "
    "param's names, e.g. lambda path, _: path[0] == 'head'."
)
_WRT_KIND = (
    "{caller}: wrt must be an nnx filter (a Variable type such as nnx.LoRAParam, "
    "nnx.PathContains('head'), nnx.All/nnx.Any of them) or a function (path, value) -> bool; "
    "got {wrt!r:.100} ({e}). Pass e.g. wrt=nnx.LoRAParam, or wrt=None to train every param."
)


def checked_optimizer(
    optimizer: optax.GradientTransformation | None, learning_rate: Any, caller: str
) -> optax.GradientTransformation:
    """The optimizer to use: ``optax.adam(learning_rate)`` by default."""
    lr = learning_rate  # a sweep's jnp.logspace(...)[i], a 0-d array: its float
    if np.ndim(lr) == 0 and jnp.issubdtype(getattr(lr, "dtype", int), jnp.floating):
        lr = float(lr)
    number = isinstance(lr, numbers.Real) and not isinstance(lr, bool) and 0 < lr < math.inf
    lr = float(lr) if number else lr  # a Fraction: optax multiplies it with arrays
    if not (lr is None or number or callable(lr)):  # optax takes a schedule too
        raise ConfigError(
            f"{caller}: learning_rate must be a number > 0 (e.g. 1e-3) or an optax schedule; "
            f"got {lr!r}."
        )
    if optimizer is None:
        optimizer = optax.adam(1e-3 if lr is None else lr)
    elif lr is not None:
        raise ConfigError(
            f"{caller}: learning_rate sets the default adam only; with an explicit optimizer, "
            f"give it the learning rate instead, e.g. optax.sgd({lr!r})."
        )
    if isinstance(optimizer, optax.MultiSteps):  # a wrapper whose transformation is a method
        optimizer = optimizer.gradient_transformation()
    if not isinstance(optimizer, optax.GradientTransformation):
        raise ConfigError(
            f"{caller}: optimizer must be an optax.GradientTransformation such as "
            f"optax.adam(1e-3); got {type(optimizer).__name__}."
        )
    return optimizer


def init_state(optimizer: optax.GradientTransformation, params: Any, caller: str) -> Any:
    """``optimizer.init(params)``, refused unless it is arrays and :func:`check_update` passes."""
    try:
        opt_state = optimizer.init(params)
    except Exception as e:  # an optimizer of another params form (optax.lookahead's)
        if isinstance(e, jax.errors.JaxRuntimeError):  # out of memory: not the optimizer's kind
            raise
        what = {"caller": caller, "kind": type(e).__name__, "e": e, "tree": _like(params)}
        raise ConfigError(_INIT_RAISED.format(**what)) from e
    array = jax.Array | np.ndarray | np.generic | numbers.Number
    leaves = jax.tree_util.tree_leaves_with_path(opt_state)
    if (odd := next(((p, a) for p, a in leaves if not isinstance(a, array)), None)) is not None:
        where, kind = jax.tree_util.keystr(odd[0]), type(odd[1]).__name__
        raise ConfigError(_NOT_ARRAYS.format(caller=caller, where=where, kind=kind))
    check_update(optimizer, params, opt_state, caller)
    return opt_state


def update(optimizer: Any, grads: Any, opt_state: Any, params: Any, loss: Any, caller: str):
    """``optimizer.update(grads, opt_state, params)`` (``value=`` the loss for one taking extra
    arguments); one needing more, or returning other than updates and a state like ``opt_state``
    (jit would trace again), is a ConfigError."""
    kw = {"value": loss} if takes_value(optimizer) else {}
    try:  # optax's own arithmetic (adam's Python floats and int32 count) under its promotion
        with jax.numpy_dtype_promotion("standard"):  # rules: strict mode is for the model's code
            out = optimizer.update(grads, opt_state, params, **kw)
    except TRACER_ERRORS:  # Python control flow on a traced value: JAX's own error says it
        raise
    except TypeError as e:
        given = ", value=loss" if kw else ""
        raise ConfigError(
            _EXTRA_ARGS.format(caller=caller, error=f"{e!s:.300}", given=given)
        ) from None
    if not (isinstance(out, tuple | list) and len(out) == 2):  # else the step's unpacking error
        size = f" of {len(out)}" if isinstance(out, tuple | list) else ""
        raise ConfigError(_UPDATE_FORM.format(caller=caller, got=f"a {type(out).__name__}{size}"))
    try:  # the updates as optax.apply_updates takes them: a tree like the gradients
        jax.tree.map(lambda *_: None, grads, out[0])
    except (TypeError, ValueError):
        trees = f"{jax.tree.structure(out[0])!s:.200} for {jax.tree.structure(grads)!s:.200}"
        raise ConfigError(
            _UPDATE_FORM.format(caller=caller, got=f"updates of another tree, {trees}")
        ) from None
    if (was := _like(opt_state)) != (got := _like(out[1])):
        raise ConfigError(
            _STATE_MOVED.format(caller=caller, was=f"{was!s:.300}", got=f"{got!s:.300}")
        )
    return out


def takes_value(optimizer: Any) -> bool:
    """Whether ``optimizer.update`` takes ``value=``: an extra-args transformation's that names
    it or takes ``**extra_args`` (optax.contrib.sam's takes neither: its example passes none)."""
    if not isinstance(optimizer, optax.GradientTransformationExtraArgs):
        return False
    try:
        accepted = inspect.signature(optimizer.update).parameters.values()
    except (TypeError, ValueError):  # no signature to read: as optax's own chain passes it
        return True
    return any(p.name == "value" or p.kind is p.VAR_KEYWORD for p in accepted)


def check_update(optimizer: Any, params: Any, opt_state: Any, caller: str) -> None:
    """:func:`update`'s refusals before a step runs, its update traced on shapes only; any other
    error of the optimizer's a ConfigError naming it, as ``optimizer.init``'s."""
    try:
        jax.eval_shape(
            lambda p, s: update(optimizer, p, s, p, jnp.float32(0), caller), params, opt_state
        )
    except TRACER_ERRORS:  # Python control flow: an eager step runs it
        pass
    except ConfigError:
        raise
    except Exception as e:
        why = next((_UNSTEPPED[type(s)] for s in states(opt_state, tuple(_UNSTEPPED))), None)
        if why is not None:
            said = _UNSTEPPED_RAISED.format(caller=caller, e=first_line(e, 200, typed=True))
            raise ConfigError(said + why) from e
        raise ConfigError(_UPDATE_RAISED.format(caller=caller, e=e, kind=type(e).__name__)) from e


def states(opt_state: Any, kinds: type | tuple[type, ...]) -> list[Any]:
    """The states of ``kinds`` anywhere in ``opt_state`` (in a chain's, a multi_transform's)."""
    found = jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, kinds))
    return [s for s in found if isinstance(s, kinds)]


def _like(tree: Any) -> Any:  # its structure, each leaf as its dtype and shape
    return jax.tree.map(lambda a: f"{jnp.result_type(a)}{list(jnp.shape(a))}", tree)


def only(optimizer: Any, wrt: Any, model: Any, params: Any, caller: str) -> tuple[Any, list]:
    """``(optimizer over the params wrt selects, their paths)``, the others' updates zero and
    their state none, as ``nnx.Optimizer(model, tx, wrt=...)`` keeps; ``wrt`` filters an nnx
    module's variables, or a linen model's params by path (a tuple of names) and array."""
    keystr, leaves = jax.tree_util.keystr, jax.tree_util.tree_leaves_with_path
    try:
        if isinstance(model, nnx.Module):  # nnx's own filter semantics, on its Variables
            picked = nnx.to_pure_dict(nnx.state(model, nnx.All(trainable(model), wrt)))
            chosen = {keystr(p) for p, _ in leaves(picked)}
        else:
            test = nnx.filterlib.to_predicate(wrt)
            chosen = {keystr(p) for p, a in leaves(params) if test(_names(p), a)}
    except Exception as e:  # not a filter: nnx's TypeError/ValueError, or the function's own
        error = f"{type(e).__name__}: {e}"
        raise ConfigError(_WRT_KIND.format(caller=caller, wrt=wrt, e=error)) from e
    paths = {keystr(p): "/".join(map(str, _names(p))) for p, _ in leaves(params)}
    if not (trained := [path for key, path in paths.items() if key in chosen]):
        what = {"caller": caller, "wrt": wrt, "n": len(paths), "model": type(model).__name__}
        shown = ", ".join(list(paths.values())[:6]) + (", ..." if len(paths) > 6 else "")
        raise ConfigError(_WRT_NONE.format(**what, paths=shown))
    labels = jax.tree_util.tree_map_with_path(
        lambda p, _: "trained" if keystr(p) in chosen else "frozen", params
    )
    transforms = {"trained": optimizer, "frozen": optax.set_to_zero()}
    return optax.multi_transform(transforms, labels), trained


def _names(path: tuple) -> tuple:  # a key path's names, as nnx's filters see an nnx state's
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


_NOTHING_MOVED = (
    "{caller}: after epoch {epoch} ({steps} steps) every param is bitwise as it was: the optimizer "
    "updated none. Either the gradients are zero (a loss that does not depend on the params: "
    "a classifier of one class), or the optimizer zeroes them: an optax.multi_transform whose "
    "labels freeze every param (labels by isinstance on an nnx module's params: the optimizer "
    "gets them as plain arrays, no Variable types), a learning rate of 0. Select the params "
    "to train with wrt= (wrt=nnx.LoRAParam), or label them by path."
)


class Moved:
    """Whether a run's first update moved any param: ``Moved(params)`` hashes them before it
    (they are donated to its first step), :meth:`check` after, warning if none moved."""

    def __init__(self, params: Any) -> None:
        self.before = self.digest(params)

    def check(self, params: Any, opt_state: Any, record: Any, caller: str) -> bool:
        """Whether it is decided: not while an optax.MultiSteps has yet to apply its first
        update (fewer steps so far than its every_k_schedule), which moves nothing."""
        if self.before != self.digest(params):
            return True
        if any(int(s.gradient_step) == 0 for s in states(opt_state, optax.MultiStepsState)):
            return False
        warnings.warn(
            _NOTHING_MOVED.format(caller=caller, epoch=record.epoch, steps=record.step),
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
        return True

    @staticmethod
    def digest(params: Any) -> str:
        return digest(dict(enumerate(jax.tree.leaves(params))))
