"""A linen module as a pure call: its collections, those a call writes held as its state with
its rng streams (split anew by each call); ``apply``'s own keywords in a call refused."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from symjax_mlp._errors import ConfigError
from symjax_mlp._hybrid import trace as _trace
from symjax_mlp._hybrid.pure import PureModel, is_key

_RNGS = "rngs"  # where a linen model's rng streams live in its state
_NOT_VARIABLES = (
    "{caller}: the variables given are a {got}, not the dict that {name}.init returns "
    "({{'params': ...}}). Pass it: hybridize(model, model.init(key, x)), h.apply(variables, x)."
)
_NO_PARAMS = (
    "{name}: the variables given have no 'params' collection (their keys: {keys}), so flax "
    "finds no weights ({error}). Pass the whole dict {name}.init returns, not variables['params']."
)
_OTHER_PARAMS = (
    "{name}: the variables given do not fit the model: {error}. They are another model's, or "
    "its layers under other names: pass what {name}.init returns (shaped as h.params)."
)
_HELD_GIVEN = (
    "{name}: the params given hold {clash}, which the Hybrid holds as its state (what a call "
    "writes) and passes each call itself: the given values would be ignored. Pass the params "
    "alone, shaped as h.params ({{'params': variables['params']}}), and give a state with "
    "h.apply_with_state(params, state, x) (state shaped as h.state) or h.replace(state=...); "
    "h.apply(variables, x) takes them as model.apply does."
)
_NO_RNG = (
    "{name}: {error}, and the Hybrid holds the rng streams {streams}. Give a linen model's "
    "streams once, split anew by each call: sm.hybridize(model, variables, "
    "rngs=jax.random.key(0)) for 'dropout', or rngs={{'name': key, ...}}."
)
_GIVEN_NO_RNG = (
    "{name}.apply: {error}. Variables holding the state run as model.apply runs them, the rng "
    "streams given each call: h.apply(variables, x, mutable=[...], rngs={{'dropout': key}}), a "
    "new key each step."
)
#: a stream given to apply and dropped on the way: by the Hybrid's call and by training's
LIFTED_RNG = (
    "{name}: {error}, though {giver} passes apply the stream {stream!r}: a lifted transform "
    "inside the model (nn.scan, nn.vmap) passes on only the rng streams its split_rngs names. "
    "Name it there, e.g. split_rngs={{'params': True, {stream!r}: True}} (a key per step; "
    "False: one key shared by the steps)."
)
#: linen ``model.apply``'s own keywords (``APPLY_FIXES``' keys, what to do with each), given to
#: a call of a Hybrid of the module
_APPLY_KEYWORD = (
    "{caller}: {key}= is {name}.apply's own keyword, not an input of {name}.__call__ "
    "({inputs}), which a Hybrid of the module runs. {fix}"
)
APPLY_FIXES = {
    "method": "To run {value}, hybridize a function of the params that applies it: "
    "sm.hybridize(lambda params, *xs: model.apply({{'params': params}}, *xs, method={value}), "
    "variables['params']); a collection it writes (a decode cache) is then an argument and a "
    "result of that function: model.apply({{'params': params, 'cache': cache}}, *xs, "
    "method={value}, mutable=['cache']).",
    "mutable": "The Hybrid holds the collections its calls write (all but 'params', or those "
    "sm.hybridize(model, variables, mutable=[...]) names) and passes each call the last's; "
    "h.apply({{'params': params, **state}}, x, mutable=[...]) takes a state and mutable= as "
    "model.apply does.",
    "rngs": "The Hybrid holds its rng streams, split anew by each call: give them once, "
    "sm.hybridize(model, variables, rngs={{'dropout': key}}); for a key per call, hybridize "
    "sm.hybridize(lambda variables, x, key: model.apply(variables, x, rngs={{'dropout': key}}), "
    "variables).",
    "capture_intermediates": "For its layers' outputs, pass it to h.apply as to model.apply: "
    "h.apply(variables, x, capture_intermediates=True, mutable=['intermediates']) (variables "
    "holding the state, if the Hybrid holds one), or hybridize sm.hybridize(lambda variables, "
    "x: model.apply(variables, x, capture_intermediates=True, mutable=['intermediates']), "
    "variables).",
}


_FLAX_OWN = ("mutable", "rngs", "capture_intermediates")  # what h.apply passes model.apply


def linen(model: Any, variables: Any, mutable: Sequence[str] | None, rngs: Any) -> tuple:
    from flax.errors import (
        InvalidRngError,
        ScopeCollectionNotFound,
        ScopeParamNotFoundError,
        ScopeParamShapeError,
    )

    name, got = type(model).__name__, type(variables).__name__
    if not isinstance(variables, Mapping):
        caller = f"hybridize({name}, variables)"
        raise ConfigError(_NOT_VARIABLES.format(caller=caller, name=name, got=got))
    collections = list(variables)
    if mutable is None:  # every collection but the params, as model.apply has it
        mutable = tuple(c for c in collections if c != "params")
    if isinstance(mutable, str) or _RNGS in collections or _RNGS in mutable:
        raise ConfigError(
            f"hybridize({name}, mutable={mutable!r}): name the mutable collections in a list, "
            f"as in mutable=['batch_stats'] (none called {_RNGS!r})."
        )
    mutable = tuple(mutable)
    sown = tuple(c for c in mutable if c not in collections)  # each call returns these fresh
    params = {c: variables[c] for c in collections if c not in mutable}
    state = {c: variables[c] for c in mutable if c not in sown}
    if rngs is not None:
        state[_RNGS] = streams = dict(rngs) if isinstance(rngs, Mapping) else {"dropout": rngs}
        for stream, key in streams.items():
            if isinstance(key, int) and not isinstance(key, bool):
                streams[stream] = jax.random.key(key)
            elif not is_key(key):
                raise ConfigError(
                    f"hybridize(rngs=...): stream {stream!r} is a {type(key).__name__}; pass a "
                    "typed key (jax.random.key(0)) or an int seed, or a dict {'dropout': key, ...}."
                )

    def call(params, state, args, kwargs):
        if not isinstance(params, Mapping):  # h.apply(None, x), h.replace(params=[...])
            got = type(params).__name__
            raise ConfigError(_NOT_VARIABLES.format(caller=name, name=name, got=got))
        if clash := [c for c in mutable if c in params and c not in sown]:  # (model.apply's)
            raise ConfigError(_HELD_GIVEN.format(name=name, clash=clash))
        state, streams = dict(state), state.get(_RNGS, {})
        pairs = {n: jax.random.split(k) for n, k in streams.items()}
        keys = {n: k[1] for n, k in pairs.items()} or None
        if streams:  # split anew by every call
            state[_RNGS] = {n: k[0] for n, k in pairs.items()}
        variables = {**params, **{c: state[c] for c in mutable if c not in sown}}

        def run(m: Any) -> Any:  # the args inside: no keyword of the model's is taken
            return m(*args, **kwargs)

        try:
            out, updates = model.apply(variables, rngs=keys, mutable=list(mutable), method=run)
        except (ScopeCollectionNotFound, ScopeParamNotFoundError) as e:  # another's variables
            error, keys = str(e).split(" (")[0].rstrip("."), sorted(map(str, variables))
            if "params" in variables or "params" in mutable:  # (else: variables["params"] given)
                raise ConfigError(_OTHER_PARAMS.format(name=name, error=error)) from None
            raise ConfigError(_NO_PARAMS.format(name=name, error=error, keys=keys)) from None
        except InvalidRngError as e:
            error, streams = str(e).split(" (")[0], sorted(streams)
            if (held := re.search(r'needs PRNG for "([^"]+)"', error)) and held[1] in streams:
                giver = "the Hybrid's call"
                lifted = LIFTED_RNG.format(name=name, error=error, giver=giver, stream=held[1])
                raise ConfigError(lifted) from None
            raise ConfigError(_NO_RNG.format(name=name, error=error, streams=streams)) from None
        except (ScopeParamShapeError, ZeroDivisionError, TypeError) as e:
            target = type(model).__call__
            if (unfit := _trace.unfit_call(name, e, target, variables, args, kwargs)) is None:
                raise
            raise unfit from None
        if sown:
            updates = dict(updates)
            out = out, {c: updates.pop(c, {}) for c in sown}
        return out, {**state, **updates}

    def flax_apply(variables, state, args, kwargs):  # h.apply's, of variables holding state
        kwargs = dict(kwargs)  # model.apply's mutable= and rngs= (none: Flax's, no held keys,
        writes, keys = kwargs.pop("mutable", False), kwargs.pop("rngs", None)  # never re-drawn)
        capture = kwargs.pop("capture_intermediates", False)  # (its layers' outputs: Flax's)

        def run(m: Any) -> Any:
            return m(*args, **kwargs)

        try:
            out = model.apply(variables, rngs=keys, mutable=writes, method=run,
                              capture_intermediates=capture)  # fmt: skip
            return out, None
        except InvalidRngError as e:  # (the held streams are h(x)'s and h.apply(params, x)'s)
            error = str(e).split(" (")[0]
            raise ConfigError(_GIVEN_NO_RNG.format(name=name, error=error)) from None

    # apply's mutable=, rngs= and capture_intermediates= are Flax's where the Hybrid holds no
    # state, unless __call__ takes them itself (names them, or takes **kwargs)
    own = inspect.signature(type(model).__call__).parameters.values()
    free = not state and not any(p.kind is p.VAR_KEYWORD or p.name in _FLAX_OWN
                                 for p in own)  # fmt: skip

    def given_state(variables: Any, keywords: bool = False) -> Any:
        held = (c for c in mutable if c not in sown)
        if isinstance(variables, Mapping) and (any(c in variables for c in held) or
                                               (keywords and free)):  # fmt: skip
            return flax_apply
        return None

    refuse = functools.partial(refuse_apply_keywords, model)
    pure = PureModel(call, bool(state), "linen", model, type(model).__call__, source=model,
                     refuse_keywords=refuse, given_state=given_state)  # fmt: skip
    return pure, params, state


def refuse_apply_keywords(module: Any, caller: str, kwargs: Mapping[str, Any]) -> None:
    """Refuses linen ``apply``'s own keywords (``method=``, ``mutable=``, ``rngs=``) in a
    call of a Hybrid of ``module``, unless its ``__call__`` takes them (names them, or takes
    ``**kwargs``: a user's names are theirs). ``bridge.to_linen``'s module passes its
    ``**kwargs`` on to an nnx module, where ``rngs=`` means nnx's: refused there too."""
    if not (given := APPLY_FIXES.keys() & kwargs.keys()):
        return
    params = list(inspect.signature(type(module).__call__).parameters.values())[1:]
    from flax.nnx import bridge  # (imported by flax.linen's users only)

    if not isinstance(module, bridge.ToLinen) and any(p.kind is p.VAR_KEYWORD for p in params):
        return
    for key in sorted(given - {p.name for p in params}):
        name, value = type(module).__name__, kwargs[key]
        value = f"{name}.{value.__name__}" if hasattr(value, "__name__") else repr(value)
        inputs = ", ".join(map(str, params))
        fix = APPLY_FIXES[key].format(value=value)
        said = _APPLY_KEYWORD.format(caller=caller, key=key, name=name, inputs=inputs, fix=fix)
        raise ConfigError(said)
