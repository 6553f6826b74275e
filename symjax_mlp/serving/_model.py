"""What a batcher calls (:func:`call_of`) and what it returns: arrays of rows, checked on the
warm-up's batches (refused when the batcher is made, naming the output), then each batch's
against the warm-up's (a batch whose outputs changed fails its requests only).
"""

from __future__ import annotations

import functools
import inspect
import traceback
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from symjax_mlp._cache import refuse_shared_cache
from symjax_mlp._errors import ConfigError, SignatureError
from symjax_mlp._hybrid.hybrid import Hybrid
from symjax_mlp._hybrid.staged import refuse_trained_in_place
from symjax_mlp._npy import weak_refusal, weakly_typed
from symjax_mlp._specs import by_place, ensemble_member, keyword_arrays


def warmed(name: str, out: Any, bucket: int, first: tuple | None) -> tuple[list, Any, tuple]:
    """A warm-up's outputs at ``bucket`` rows: their (path, NumPy array) leaves, their tree, and
    ``first`` (the first bucket, the outputs' kind shown), refused unless of that kind."""
    leaf = Iterator.__instancecheck__  # a generator: numpy() refuses it, JAX warns
    pairs, tree = jax.tree_util.tree_flatten_with_path(out, is_leaf=leaf)
    pairs = [(path, numpy(name, path, y, bucket)) for path, y in pairs]
    if not pairs:  # every request answered None, say
        raise ConfigError(
            f"{name}: the model returned no array for a batch of {bucket} rows (it "
            f"returned {out!r}). Serve a model that returns its outputs: an array, or a "
            "pytree of arrays, with one row per input row."
        )
    each = ", ".join(f"{y.dtype}{list(y.shape[1:])}" for _, y in pairs)
    kind = f"{tree} of rows {each}"  # what a batch's outputs are, shown
    if first and first[1] != kind:
        raise ConfigError(
            f"{name}: the outputs for a batch of {bucket} rows are {kind}, "
            f"but for a batch of {first[0]}, {first[1]}, while a request is "
            "answered from a batch of any size. Serve a model whose outputs' rows do not "
            "depend on the batch's size."
        )
    return pairs, tree, first or (bucket, kind)


def numpy(name: str, path: Any, y: Any, bucket: int) -> np.ndarray:
    """A warm-up's output leaf as NumPy, one row per input row (else a ConfigError)."""
    what = f"of type {type(y).__name__}, which NumPy reads as Python objects,"
    try:
        if (host := np.asarray(y)).dtype != object:
            if host.ndim and len(host) == bucket:
                return host
            what = f"of shape {host.shape}"
    except Exception as e:  # its __array__ raised, or a typed PRNG key's (its str may too)
        said = traceback.format_exception_only(e)[-1].strip()[:300]
        what = f"of type {type(y).__name__}, which NumPy cannot read as an array ({said}),"
    out = f"out{jax.tree_util.keystr(path)}"
    raise ConfigError(_PER_ROW.format(name=name, out=out, what=what, bucket=bucket)) from None


_PER_ROW = (
    "{name}: output {out} is {what} for a batch of {bucket}, but batching needs per-row "
    "outputs: arrays of numbers with the batch ({bucket}) as leading dimension. Serve a model "
    "that returns one result per input row (reduce over rows afterwards)."
)


def unlike(lane: Any, out: Any, rows: int) -> RuntimeError | None:
    """Why ``out``, a batch of ``rows`` rows, is unlike the warm-up's (``None``: an equal dtype)."""
    bucket, host = lane.bucket_of[rows], lane.to_host(out)
    leaves, tree = jax.tree_util.tree_flatten_with_path(host)
    if (lane.single and not isinstance(out, jax.Array | np.ndarray)) or tree != lane.tree:
        want = "an array" if lane.single else f"outputs {lane.tree}"
        return RuntimeError(
            f"{lane.name}: the model returned a value of type {type(out).__name__} for a "
            f"batch of {bucket} rows, where it returned {want} when the batcher was made; it "
            "must return outputs of the same kind for every batch, one row per input row."
        )
    for (path, y), (shape, dtype) in zip(leaves, lane.want[rows], strict=True):
        if y.shape != shape or y.dtype != dtype:
            path = f" out{jax.tree_util.keystr(path)}" if path else ""  # one array: no path
            return RuntimeError(
                f"{lane.name}: the model returned an output{path} of shape {y.shape} for a "
                f"batch of {bucket} rows, dtype {y.dtype}; it must return one row per input "
                f"row, of shape {shape} and dtype {dtype} as when the batcher was made."
            )
    return None


_TRAINING = (
    "Batcher({name}): {what}, where a batch's rows are normalised together and dropped at "
    "random, so a request's answer would depend on the others{fix}"
)
_INFERENCE = "the settings of its inference call, e.g. kwargs={'train': False}."


def typed_check(requests: Any, strong: tuple[str, ...]) -> Any:
    """``requests.check`` (a RequestCheck's), first refusing a weakly typed array (a JAX one:
    ``jnp.full(s, 2.0)``) at the ``strong`` inputs, where a loaded model takes only strongly
    typed ones: the batcher reads each request as NumPy, strongly typed, where the model
    answers it in other dtypes. The check itself where none is: no work per request."""
    typed = [(i, s) for i, s in enumerate(requests.specs) if s.path in strong]
    if not typed:
        return requests.check

    def check(inputs: tuple[Any, ...]) -> tuple[Any, int]:
        for i, spec in typed:
            if i < len(inputs) and weakly_typed(inputs[i]):
                with requests.lane.lock:
                    requests.lane.n.rejected["signature"] += 1
                raise SignatureError(str(weak_refusal(requests.name, spec, inputs[i], True)))
        return requests.check(inputs)

    return check


def call_of(model: Any, example: Any, kwargs: dict[str, Any], name: str) -> Any:
    """What a batcher calls for a Hybrid (its inference as of now) or a callable, ``kwargs``
    fixed; refused where its signature does not take them and the example's inputs."""
    refuse_shared_cache(f"Batcher({name})")  # its warm-up compiles through JAX's cache
    arrays = example if isinstance(example, tuple) else (example,)
    try:
        signature = inspect.signature(model)
    except (TypeError, ValueError):  # no signature to read (a builtin's)
        signature = None
    try:
        signature is None or signature.bind(*arrays, **kwargs)
    except TypeError as e:  # a flag with no default, an array by keyword only: name the fix
        given, n = f" and kwargs={kwargs}" if kwargs else "", len(arrays)
        names, placed = keyword_arrays(signature, n, kwargs)
        code, places = by_place(names, placed, kwargs, isinstance(model, Hybrid))
        fix = (
            f"A request's arrays go by place: serve a function taking {', '.join(names)} so, "
            f"Batcher({code}, example={places})."
            if names
            else "Pass kwargs= of the settings it takes, e.g. kwargs={'train': False}, and an "
            "example of one array per input (a tuple for several)."
        )
        raise ConfigError(
            f"Batcher({name}): a request calls the model with the example's {n} input"
            f"{'s' * (n > 1)}{given}, but {e}; its signature is {signature}. {fix}"
        ) from None
    if not isinstance(model, Hybrid):
        return functools.partial(model, **kwargs) if kwargs else model
    if training := model.training_mode(*arrays, **kwargs):
        what = (
            f"the nnx module is in training mode ({', '.join(training)}: the mode it is built in)"
        )
        raise ConfigError(_TRAINING.format(name=name, what=what, fix=". Call module.eval()."))
    refuse_trained_in_place(model, f"Batcher({name})", "the batcher would serve")
    h = model.snapshot()  # its module's mode and state as of now, whatever model does later
    if not h.stateful:
        return functools.partial(h, **kwargs) if kwargs else h
    params, state = h.params, h.state
    if moved := h.moved_state(*arrays, **kwargs):  # Dropout, BatchNorm
        what = f"with kwargs={kwargs} a call is in training mode ({', '.join(moved[:4])} move)"
        fix = " (and a server holds its state: each batch would drop the same units). Pass "
        raise ConfigError(_TRAINING.format(name=name, what=what, fix=fix + _INFERENCE))

    def inference(*xs: Any) -> Any:
        return h.apply_with_state(params, state, *xs, **kwargs)[0]

    inference.__name__ = h.name
    return inference


_FIXED_ROWS = (
    "{name}: the model raised warming up on a batch of {bucket} rows (zeros), and every param "
    "leads with the example's {rows} rows ({path}: {shape}): a model that maps its inputs' "
    "rows over its params' (an ensemble, one member per row: nnx.vmap or eqx.filter_vmap over "
    "stacked params) takes {rows} rows, one per member, never a batch of another size, while "
    "a batcher pads and merges requests into batches of {buckets} rows. Serve one whole input "
    "of {rows} rows per request, a batch of them on a new leading axis: "
    "Batcher(jax.vmap(h), example=x[None]); or call h(x) as it is."
)


def fixed_rows(name: str, model: Any, example: Any, bucket: int, buckets: tuple) -> Any:
    """The ConfigError for a Hybrid that raised at ``bucket`` rows while every param leads
    with the example's rows (``None`` otherwise): the warm-up's error path, never a request's."""
    if not isinstance(model, Hybrid):
        return None
    first = (example if isinstance(example, tuple) else (example,))[:1]
    rows = np.shape(first[0])[:1] if first else ()
    params = jax.tree_util.tree_leaves_with_path(model.params)
    shapes = {jax.tree_util.keystr(p, simple=True, separator="/"): np.shape(a) for p, a in params}
    if rows == (bucket,) or (member := ensemble_member(shapes, rows)) is None:
        return None
    what = {"name": name, "bucket": bucket, "rows": rows[0], "buckets": buckets}
    return ConfigError(_FIXED_ROWS.format(**what, path=member[0], shape=member[1]))


_GROWN = (
    "Batcher({path}): output {spec.path} is {spec.type}, but a batcher needs outputs of "
    "{batch!r} rows of static sizes ({dtype}[{batch}, ...]): each request runs alone at its own "
    "rows ({why}), answered by the row shapes of one warm-up batch. Call the loaded model "
    "directly (it answers any batch), or export a model with one output row per input row (a "
    "covariance's diagonal, say)."
)


def refuse_outputs(path: Any, outputs: Any, batch: int | str | None, why: str) -> None:
    """Refuses an artifact's outputs no batcher serves, as its warm-up would, before its
    max_batch is checked (which no value of serves it): a static ``batch``'s not that many
    rows; with requests run alone (``why``), a symbolic one's not its rows of static sizes
    (its warm-up runs one batch size only, so no other checks them)."""
    alone = bool(why) and isinstance(batch, str)
    if not (alone or isinstance(batch, int)):
        return
    for spec in outputs:
        symbolic = any(isinstance(d, str) for d in spec.shape[1:])  # a size of its own
        if tuple(spec.shape[:1]) == (batch,) and not (alone and symbolic):
            continue
        if alone:
            what = {"path": path, "spec": spec, "why": why, "batch": batch, "dtype": spec.dtype}
            raise ConfigError(_GROWN.format(**what))
        what = {"out": spec.path, "what": f"of shape {tuple(spec.shape)}", "bucket": batch}
        raise ConfigError(_PER_ROW.format(name=f"Batcher({path})", **what))
