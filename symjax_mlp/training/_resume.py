"""What a training checkpoint records of its run, so that resuming continues that run only.

Its config (seed, batch size, sha256 of its data, model and optimizer) must match. Fingerprints
never see code, so probes do: the model's logits with fixed params on a fixed input, and the
optimizer's next update for a fixed gradient (a schedule), each compared within a tolerance.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from symjax_mlp._artifact.format import printable
from symjax_mlp._errors import CheckpointError, ConfigError, user_stacklevel
from symjax_mlp.training._checkpoint import broken, older, read_checkpoint, starting_from
from symjax_mlp.training._data import Dataset
from symjax_mlp.training._optimizer import takes_value
from symjax_mlp.training._orbax import orbax_weights
from symjax_mlp.training._paths import check_path, check_strays, checkpoints, latest_checkpoint
from symjax_mlp.training._processes import RESUME
from symjax_mlp.training._spec import NnxSpec
from symjax_mlp.training._state import SHOWN, EpochRecord, TrainState, named_leaves
from symjax_mlp.training._step import ModelVars, apply_model

_CALLER = "symjax_mlp.training.train"
LOG = logging.getLogger("symjax_mlp.training")  # "resuming from ...", at INFO, once it is sure
PROBE = "model_probe"  # compared within a tolerance, not for equality
PROBE_TRAIN = "model_probe_train"  # the training call's (dropout with a fixed rng): the same
PROBE_ROWS = 2  # rows of the probe input
PROBE_VALUES = 256  # the most logits recorded
TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}
OPTIMIZER_PROBE = "optimizer_probe"  # in each checkpoint's metadata, not the run's config
_UPDATE_TOLERANCE = {"rtol": 1e-5, "atol": 1e-9}  # the same state and ops: bitwise on one
# machine; another's last bits (an update near 0 is a difference of near-equal terms) pass
_PLATEAU_STEPS = 48  # a value= optimizer's updates of a loss that stops improving at once
_NAN_INF = ("nan", "inf", "-inf")
_FLOAT_MAX = sys.float_info.max  # a Python float: an int compares with it exactly
_SHOWN = SHOWN.maxdict  # the settings a refusal shows (a manifest is anyone's JSON)
_NOT_THAT_RUN = (
    "Resuming would not continue that run; resume with {same}, or start over in an empty directory."
)
_NEW_RUN = (  # where the model is the same: its weights can start a run of other settings
    " Or carry on from its weights with this run's settings (a new optimizer, schedule or data): "
    "start a new run from them, init_from=DIR naming that directory and checkpoint=DIR another."
)
_NOT_THAT_MODEL = (
    "A new run starts from the weights of the model that wrote them: pass that model, or leave "
    "init_from out to train this one from its own initialisation."
)
_NO_CHECKPOINT = "{resume}: {where} holds no checkpoint yet; {start}"
_NON_FINITE = (  # train() stops at a non-finite loss or param: no run of it wrote these
    "{found}: its params hold {value} ({name}{more}): it was edited, or written by another "
    "program than train(), and a run from it diverges at its first step. {fix}"
)
_MODEL = ("num_features", "num_outputs", "model_sha256")  # what init_from's weights must fit
_FINGERPRINTED = {  # what a differing sha256 of the config stands for
    "data_sha256": "the training data, x_train and y_train",
    "model_sha256": "the model's configuration: its layers, widths or param shapes",
    "optimizer_sha256": "the optimizer: its kind, hyperparameters or schedule (or the "
    "jax_enable_x64 setting it computes in)",
}


def run_config(
    model: Any, spec: Any, params: Any, data: Dataset, optimizer: optax.GradientTransformation,
    *, seed: int, batch_size: int, num_outputs: int,
) -> dict[str, Any]:  # fmt: skip
    """What a checkpoint of this run must match to be resumed by it (JSON-able)."""
    return {
        "seed": seed,
        "batch_size": batch_size,
        "data": data.name,
        "data_sha256": _data_fingerprint(data),
        "num_features": data.num_features,
        "num_outputs": num_outputs,
        "model_sha256": _model_fingerprint(model, spec, params),
        "optimizer_sha256": _optimizer_fingerprint(optimizer),
        PROBE: model_probe(model, spec, params, data.x_train[:1]),
        PROBE_TRAIN: model_probe(model, spec, params, data.x_train[:1], train=True),
    }


def resume_run(
    checkpoint: str | os.PathLike | None,
    state: TrainState,
    config: dict[str, Any],
    *,
    resume: bool,
    store: Any,
    update: Callable[[TrainState], list[Any]],
    init_from: str | os.PathLike | None = None,
) -> tuple[TrainState, list[EpochRecord], Path | None]:
    """``(state, history, found)`` of the newest checkpoint (in ``store``, if given) if it
    continues the run of ``config``, else of a new run (from ``init_from``'s weights, if given:
    :func:`init_run`); ``update``: a state's :func:`optimizer_probe`."""
    found = None
    if checkpoint is not None:
        check_strays(checkpoint, _CALLER, orbax=store is not None)
        found = latest_checkpoint(checkpoint) if store is None else store.latest()
    if not found:
        if resume:  # a typo in its name trains from the start: said, not silent
            start = "training from the start" if init_from is None else "a new run, from init_from"
            where = printable(os.fspath(checkpoint))
            said = _NO_CHECKPOINT.format(resume=RESUME.get(), where=where, start=start)
            warnings.warn(said, stacklevel=user_stacklevel())
        return state if init_from is None else init_run(init_from, state, config), [], None
    if not resume:
        raise CheckpointError(
            f"{_CALLER}: {checkpoint} already holds checkpoints (newest: {found.name}). Pass "
            "resume=True to continue from it, or use an empty directory."
        )
    try:
        state, meta = (read_checkpoint if store is None else store.restore)(found, state)
        _check_finite(found, state)
    except CheckpointError as e:  # it names the checkpoint; train()'s messages name the call
        raise CheckpointError(f"{_CALLER}: {e}") from None
    _check_same_run(found, config, meta, state, update)
    history = [EpochRecord(**r) for r in meta.get("history", [])]  # checked as it was read
    ends = history[-1].step if history else 0
    if len(history) != state.epoch or (history and ends != state.step):
        raise broken(
            f"{_CALLER}: {found}",
            f"it records epoch {state.epoch} and step {state.step}, but its history has "
            f"{len(history)} epoch(s) ending at step {ends}: resuming would skip or repeat epochs",
        )
    LOG.info("resuming from %s", printable(os.fspath(found)))
    return state, history, found


def check_init_from(directory: Any, checkpoint: Any) -> None:
    """Refuses an ``init_from`` that is not a path, that the run's ``checkpoint`` directory is,
    holds or is inside, or that holds a stray newer than its newest checkpoint."""
    caller = f"{_CALLER}(init_from={printable(str(directory))[:200]!r})"
    check_path(directory, caller)
    homes = [os.path.realpath(p) for p in (directory, checkpoint) if p is not None]
    if len(homes) == 2 and os.path.commonpath(homes) in homes:
        raise ConfigError(
            f"{caller}: checkpoint={printable(os.fspath(checkpoint))!r} is, holds or is inside "
            "that directory: the new run would write its checkpoints among the ones it starts "
            "from, and prune them. Pass checkpoint=DIR another directory (or none)."
        )
    orbax = bool(checkpoints(Path(directory), orbax=True)) and not checkpoints(Path(directory))
    check_strays(directory, caller, orbax, reading=True)  # a newer step that is none: passed over


def init_run(directory: str | os.PathLike, state: TrainState, config: dict[str, Any]) -> TrainState:
    """A new run's first ``state`` with the params (and model state) of the newest checkpoint
    in ``directory`` (or of that checkpoint), refused unless the model of ``config`` wrote it;
    the optimizer's state, rng, step and epoch stay ``state``'s."""

    def same_model(found: Path, meta: dict) -> None:
        _check_model(found, config, meta, "", keys=_MODEL, then=_NOT_THAT_MODEL)
        read.append(found)

    caller, read = f"{_CALLER}(init_from={printable(os.fspath(directory))[:200]!r})", []
    try:  # a multi-process run's (Orbax), or a one-process run's
        with starting_from():  # a broken one's fix: another checkpoint, not an older one of it
            found = orbax_weights(Path(directory), state, same_model)
            state = found or read_checkpoint(Path(directory), state, weights=same_model)[0]
            _check_finite(read[0], state)
    except CheckpointError as e:  # it names the checkpoint; train()'s messages name the call
        raise CheckpointError(f"{caller}: {e}") from None
    return state


def _check_finite(found: Path, state: TrainState) -> None:
    """Refuses a checkpoint whose params (a model's state too) hold a NaN or an infinity."""
    leaves = {n: jnp.asarray(a) for n, a in named_leaves(state).items() if n.startswith("params/")}
    bad = [
        (name, a) for name, a in leaves.items()
        if jnp.issubdtype(a.dtype, jnp.inexact) and not jnp.isfinite(a).all()
    ]  # fmt: skip
    if bad:
        name, a = bad[0]
        value = np.asarray(a.ravel()[jnp.argmin(jnp.isfinite(a.ravel()))]).item()
        more = f", and {len(bad) - 1} more tensor(s)" if len(bad) > 1 else ""
        what = {"found": found, "value": value, "name": printable(name[:200]), "more": more}
        raise CheckpointError(_NON_FINITE.format(**what, fix=older()))


def _check_same_run(found: Path, config: dict, meta: dict, state: TrainState, update) -> None:
    """Refuses a checkpoint of another run: its config, its model probes or the optimizer's next
    update from its ``state`` differ from this run's."""
    then = _NOT_THAT_RUN.format(same="the same settings")
    _check_model(found, config, meta, f"{_CALLER}: ", keys=None, then=then)
    differs = bool(meta.get(OPTIMIZER_PROBE)) and probe_difference(  # []: none was measured
        meta[OPTIMIZER_PROBE], update(state), "updates", _UPDATE_TOLERANCE
    )
    if differs:
        raise CheckpointError(
            f"{_CALLER}: {found} was written by an optimizer that updates otherwise at its step "
            f"{state.step}: from its saved state, for a fixed gradient, {differs} from this "
            "optimizer's. Its kind and state are the same, but a learning-rate schedule or a "
            "hyperparameter is not. "
            + _NOT_THAT_RUN.format(same="the optimizer that wrote it")
            + _NEW_RUN
        )


def _check_model(
    found: Path, config: dict, meta: dict, heading: str, *, keys: tuple | None, then: str
) -> None:
    """Refuses a checkpoint whose recorded config differs from ``config`` in ``keys`` (every
    setting: ``None``) or whose model probes differ; ``then``: what to do instead."""
    recorded = meta.get("config", {})
    probes = (PROBE, PROBE_TRAIN)  # compared within a tolerance, below
    every = sorted(set(config) | set(recorded)) if keys is None else keys  # one's alone differs
    changed = [k for k in every if k not in probes and recorded.get(k) != config.get(k)]
    if changed:
        was, now = ({k: given.get(k) for k in changed[:_SHOWN]} for given in (recorded, config))
        what = "; ".join(_FINGERPRINTED.get(k) or printable(k[:80]) for k in changed[:_SHOWN])
        what += f"; and {len(changed) - _SHOWN} more" if len(changed) > _SHOWN else ""
        new_run = _NEW_RUN if keys is None and not set(changed) & set(_MODEL) else ""
        raise CheckpointError(
            f"{heading}{found} was written with {SHOWN.repr(was)}, but this run has "
            f"{SHOWN.repr(now)} (what differs: {what}). {then}{new_run}"
        )
    for where, key in ((recorded, PROBE), (recorded, PROBE_TRAIN), (meta, OPTIMIZER_PROBE)):
        probe = where.get(key, [])  # numbers, "nan", "inf" or "-inf"
        if not isinstance(probe, list) or not all(
            type(v) is float or (type(v) is int and abs(v) <= _FLOAT_MAX) or v in _NAN_INF
            for v in probe  # an int past float64's range: float() raised OverflowError
        ):
            raise broken(f"{heading}{found}", f"its metadata's {key} is not a list of numbers")
    # a checkpoint written before the probe was recorded has none: its config still matched
    differs = (probe_difference(recorded[k], config[k]) for k in probes if k in recorded)
    if differs := next(filter(None, differs), None):
        then = then if keys else _NOT_THAT_RUN.format(same="the model that wrote it")
        raise CheckpointError(
            f"{heading}{found} was written by a model that computes something else: with fixed "
            f"weights on a fixed input, {differs} from this model's. Its class, name and "
            "parameter shapes are the same, but its __call__ is not (another activation, scale, "
            f"dropout rate or order of layers). {then}"
        )


def _data_fingerprint(data: Dataset) -> str:
    digest = hashlib.sha256()
    for a in (data.x_train, data.y_train):
        digest.update(str(a.shape).encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()


def _model_fingerprint(model: Any, spec: Any, params: Any) -> str:
    """The model's configuration (its repr: layers, widths, activations) and param tree."""
    tree = jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), params)
    if isinstance(spec, NnxSpec):  # its eval-mode graphdef (layers, widths, rates), no addresses
        graph = repr(nnx.graphdef(spec.module(spec.params, spec.state)))
        config = re.sub(r"0x[0-9a-f]+", "0x", graph)
    else:
        config = repr(model)
    return hashlib.sha256(f"{config}|{tree}".encode()).hexdigest()


def _optimizer_fingerprint(optimizer: optax.GradientTransformation) -> str:
    """The optimizer's first two updates of a fixed small problem (its closures cannot be read);
    of one whose update needs ``value=`` (reduce_on_plateau), its first ``_PLATEAU_STEPS`` of
    a constant loss: when and how far it scales its updates (patience, factor, cooldown)."""
    w = {"w": jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)}
    g = {"w": jnp.cos(jnp.arange(8, dtype=jnp.float32))}
    digest = hashlib.sha256(type(optimizer).__name__.encode())
    plateau = functools.partial(optimizer.update, value=jnp.float32(1.0))
    for update, steps in ((optimizer.update, 2), (jax.jit(plateau), _PLATEAU_STEPS)):
        with contextlib.suppress(Exception):  # one that cannot run on a toy tree: its type
            opt_state, seen = optimizer.init(w), []
            for _ in range(steps):  # (compiled: op by op, each plateau step takes 0.2 s)
                updates, opt_state = update(g, opt_state, w)
                seen.append(np.asarray(updates["w"], np.float32).tobytes())
            digest.update(b"".join(seen))
            break
        if not takes_value(optimizer):
            break
    return digest.hexdigest()


def optimizer_probe(optimizer: optax.GradientTransformation) -> Callable[[Any, Any], list]:
    """``probe(params, opt_state)``: the update from ``opt_state`` for a fixed gradient, sampled
    per leaf, as JSON (``[]``: an optimizer that needs more than a gradient); compiled once."""

    @jax.jit
    def sampled(gradient: Any, opt_state: Any, params: Any) -> list[jax.Array]:
        kw = {"value": jnp.float32(1.0)} if takes_value(optimizer) else {}  # reduce_on_plateau
        updates, _ = optimizer.update(gradient, opt_state, params, **kw)
        leaves = [jnp.stack([u.real, u.imag], -1) if jnp.iscomplexobj(u) else u
                  for u in jax.tree.leaves(updates)]  # fmt: skip
        k = max(1, PROBE_VALUES // max(1, len(leaves)))
        at = [np.linspace(0, u.size - 1, min(k, u.size)).astype(int) for u in leaves]
        return [u.ravel()[i] for u, i in zip(leaves, at, strict=True) if u.size]

    gradient: list[Any] = []  # made once (most of a probe's time): a run's shapes stay

    def probe(params: Any, opt_state: Any) -> list:
        trainable = params.params if isinstance(params, ModelVars) else params
        gradient[:] = gradient or [_fixed(trainable)]
        for run in (sampled, sampled.__wrapped__):  # op by op: one that cannot be compiled
            try:
                flat = run(gradient[0], opt_state, trainable)
                break
            except Exception:  # e.g. one that needs a value= (optax.contrib.reduce_on_plateau)
                continue
        else:
            return []
        values = np.concatenate([[], *(np.asarray(u, np.float64) for u in flat)])
        return [float(v) if math.isfinite(v) else str(v) for v in values]

    return probe


def model_probe(
    model: Any, spec: Any, params: Any, example: np.ndarray, *, train: bool = False
) -> list[Any]:
    """The model's logits on the probe (of a training call when ``train``: its dropout rng is
    the fixed one ``params`` holds), as JSON (floats; ``"nan"``/``"inf"``/``"-inf"``)."""
    stateful = isinstance(params, ModelVars)
    fixed = _fixed(params.params if stateful else params)
    state = _fixed(params.state, state=True, rng=train) if stateful else None
    probe_params = ModelVars(fixed, state) if stateful else fixed
    shape, dtype = (PROBE_ROWS, *np.shape(example)[1:]), np.asarray(example).dtype
    n = np.arange(math.prod(shape))
    x = (np.cos(n * 1.3) if jnp.issubdtype(dtype, jnp.floating) else n % 3).reshape(shape)
    x = x.astype(dtype)
    logits = jax.jit(lambda p, x: apply_model(model, spec, p, x, train=train)[0])(probe_params, x)
    flat = np.asarray(logits, np.float64).ravel()[:PROBE_VALUES]
    return [float(f"{v:.7g}") if math.isfinite(v) else str(v) for v in flat.tolist()]


def probe_difference(
    recorded: Any, probe: list[Any], what: str = "logits", tolerance: dict = TOLERANCE
) -> str | None:
    """How ``probe`` differs from the ``recorded`` one, or ``None`` if within ``tolerance``."""
    want = np.array([float(v) for v in recorded], np.float64)
    got = np.array([float(v) for v in probe], np.float64)
    if want.shape != got.shape:
        return f"it gave {want.size} {what}, this one gives {got.size}"
    if np.allclose(got, want, equal_nan=True, **tolerance):
        return None
    with np.errstate(invalid="ignore"):
        err = np.nanmax(np.where(got == want, 0.0, np.abs(got - want)))
    return f"its {what} differ by up to {err:.3g}"


def _fixed(params: Any, *, state: bool = False, rng: bool = False) -> Any:
    """Each float leaf a fixed pattern of an initialiser's scale (a ``state`` leaf's: [0.5, 1.5]);
    with ``rng``, every other leaf zeros (a dropout key, its count)."""
    leaves, treedef = jax.tree.flatten(params)
    out = []
    for i, a in enumerate(map(jnp.asarray, leaves)):
        if jnp.issubdtype(a.dtype, jnp.floating):
            fan_in = math.prod(a.shape[:-1]) if a.ndim >= 2 else 1
            a = jnp.asarray(_pattern(a.size, i, state, fan_in, a.dtype).reshape(a.shape))
        elif rng and jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            zeros = jnp.zeros_like(jax.random.key_data(a))
            a = jax.random.wrap_key_data(zeros, impl=jax.random.key_impl(a))
        elif rng:
            a = jnp.zeros_like(a)
        out.append(a)
    return jax.tree.unflatten(treedef, out)


_CHUNK = 1 << 18  # elements of a pattern made at once (2 MiB of float64)


def _pattern(size: int, i: int, state: bool, fan_in: int, dtype: Any) -> np.ndarray:
    """``cos(0.7 k + i)`` for ``k < size``, scaled, made in float64 a chunk at a time and cast
    to ``dtype``: no float64 array the leaf's size (out of memory, for a model that fits)."""
    out = np.empty(size, dtype)
    for start in range(0, size, _CHUNK):
        p = np.cos(np.arange(start, min(start + _CHUNK, size), dtype=np.float64) * 0.7 + i)
        out[start : start + p.size] = p / 2 + 1 if state else p / math.sqrt(fan_in)
    return out
