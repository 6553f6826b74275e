"""The refusals of an export's example item that is no array: an equinox State, a container of
arrays (a dict, a tuple or list: a ``batch`` of ``(x, y)``), anything else; and of a function
calling back into Python, or into a kernel JAX will not export; each naming what exports."""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from symjax_mlp._errors import ConfigError, SignatureError, message

_EQX_STATE = (
    "export(example=...): args[{i}] is an equinox eqx.nn.State, which an artifact's inputs "
    "(arrays) cannot carry. Export the model with its state held in it, as equinox runs "
    "inference: inference_model = eqx.Partial(eqx.nn.inference_mode(model), state=state); "
    "export(sm.hybridize(lambda m, x: jax.vmap(m)(x)[0], inference_model), path, example=x)."
)

_CONTAINER_INPUT = (
    "export({name}, example=...): args[{i}] is {what}, but an artifact's inputs are positional "
    "arrays (what every runtime, IREE included, passes). Export a function that takes its arrays "
    "by place and rebuilds the {kind}, where d is that {kind}: leaves, tree = jax.tree.flatten(d); "
    "sm.hybridize(lambda params, {head}*xs: h.apply(params, {call}"
    "jax.tree.unflatten(tree, xs{cut}){tail}), h.params) with example={example}, "
    "and call the artifact with the arrays in that order. An artifact returns an array or a "
    "flat tuple of arrays: where the model returns a tree too (a carry with its outputs), wrap "
    "that call as tuple(jax.tree.leaves(h.apply(...)))."
)
_NAMED_ARRAY = (
    " A penzai NamedArray's tree holds its axes' sizes, so rebuilt so it fixes the batch at the "
    "example's rows (export with batch=None); for any batch, export a function of the "
    "positional array that names one row's axes inside, under jax.vmap: lambda p, x: "
    "jax.vmap(lambda r: h.apply(p, pz.nx.wrap(r).tag(...)).unwrap(...))(x)."
)
_HALIAX = (
    " A haliax NamedArray's tree holds its axes (hax.Axis, each with its size), so rebuilt so it "
    "fixes the batch at the example's rows (export with batch=None); for any batch, export a "
    "function of the positional array that names its axes inside: lambda p, x: "
    "h.apply(p, hax.named(x, ('batch', ...))).array."
)

_HIJAX_INPUT = (
    "export(example=...): args[{i}] is a {kind}, a value of a jax.experimental.hijax type, and "
    "an artifact's inputs are arrays that any caller can pass (a Hybrid takes a {kind}, as "
    "jax.jit does). Export a function taking the arrays it is made from and making the {kind} "
    "inside (hijax-types.md's quantize(w) of float weights w), and call the artifact with those "
    "arrays."
)


def _container(x: Any) -> tuple[str, str] | None:
    """``(what x is, its kind)`` if ``x`` is a dict of str keys, or a tuple, list or registered
    pytree (custom_pytrees.md's dataclass) of arrays (any depth); else ``None``."""
    if isinstance(x, Mapping) and x and all(isinstance(k, str) for k in x):
        return f"a dict with keys {list(x)}", "dict"
    leaves = jax.tree.leaves(x)
    if not leaves or leaves[0] is x or not all(hasattr(a, "shape") for a in leaves):
        return None
    kind, arrays = type(x).__name__, f"{len(leaves)} array{'s' * (len(leaves) > 1)}"
    pytree = "" if isinstance(x, tuple | list) else " (a registered pytree)"
    return f"a {kind}{pytree} of {arrays}", kind


def tree_of_arrays(x: Any) -> bool:
    """Whether ``x`` is a registered pytree holding arrays, no array itself though it may have
    a ``shape`` and a ``dtype`` (haliax's NamedArray: its shape a dict of its axes' sizes)."""
    leaves = jax.tree.leaves(x)
    return bool(leaves) and leaves[0] is not x


def hijax_value(x: Any) -> bool:
    """Whether ``x`` is a value of a type registered with ``jax.experimental.hijax``
    (hijax-types.md's QArray), which ``jax.jit`` traces as it traces an array."""
    if (hijax := sys.modules.get("jax.experimental.hijax")) is None:  # none registered
        return False
    try:
        return isinstance(jax.typeof(x), hijax.HiType)
    except (TypeError, ValueError):  # no JAX type (a __jax_array__'s: JAX 0.10 refuses it)
        return False


def not_an_array(name: str, i: int, x: Any, n: int, placed: Any = None) -> SignatureError:
    """The refusal of ``x``, no array, at ``args[i]`` of ``n`` inputs: a container of arrays
    (nested, or among others: decoding's cache, a ``batch``) names a function taking its leaves
    by place, the others around them, and the settings ``placed`` ({place in the call: value},
    hk.transform_with_state's ``None`` rng) in their places."""
    placed = placed or {}
    if type(x).__module__.startswith("equinox") and type(x).__name__ == "State":
        return SignatureError(_EQX_STATE.format(i=i))
    if (container := _container(x)) is None:
        if hijax_value(x):  # (QArray)
            return SignatureError(_HIJAX_INPUT.format(i=i, kind=type(x).__name__))
        return SignatureError(
            f"export(example=...): args[{i}] is a {type(x).__name__}; pass an array (or a "
            "tuple of arrays), e.g. example=jnp.zeros((1, 512), jnp.float32)."
        )
    k, it = len(jax.tree.leaves(x)), iter(range(n))
    full = [repr(placed[a]) if a in placed else next(it) for a in range(n + len(placed))]
    at = full.index(i)  # the call's arguments: the arrays' numbers, the settings' reprs
    head = "".join(f"x{j}, " for j in range(i))
    call = "".join(f"{a if isinstance(a, str) else f'x{a}'}, " for a in full[:at])
    after = full[at + 1 :]
    if any(isinstance(a, str) for a in after):  # a setting after it: each in its place
        tail = "".join(f", {a if isinstance(a, str) else f'xs[{k + a - i - 1}]'}" for a in after)
    else:
        tail = f", *xs[{k}:]" if after else ""
    cut = f"[:{k}]" if after else ""
    later = "".join(f", x{j}" for j in range(i + 1, n))
    example = f"({head}*leaves{later})" if n > 1 else "tuple(leaves)"
    what, kind = container
    said = _CONTAINER_INPUT.format(name=name, i=at, what=what, kind=kind, head=head, cut=cut,
                                   tail=tail, example=example, call=call)  # fmt: skip
    if type(x).__module__.startswith("penzai") and hasattr(x, "named_axes"):
        said += _NAMED_ARRAY
    elif type(x).__module__.startswith("haliax") and hasattr(x, "axes"):
        said += _HALIAX
    return SignatureError(said)


_EQX_CHECKS = (
    " Here it is equinox's runtime check (eqx.error_if, or an eqx layer's own): set the "
    "environment variable EQX_ON_ERROR=off (no check) or EQX_ON_ERROR=nan (NaN outputs where "
    "it fails; export with batch=None) before equinox is imported."
)


def calls_back(name: str, eqns: Sequence[Any]) -> ConfigError | None:
    """The refusal of a traced function calling back into Python (``pure_callback``,
    ``io_callback``, ``jax.debug.print``'s ``debug_print``), given its equations (nested ones
    too); ``None`` if it makes no such call."""
    names = {e.primitive.name for e in eqns}
    if not (callbacks := sorted(n for n in names if "callback" in n or n.startswith("debug_"))):
        return None
    # equinox's error_if: the host callback's raising function is equinox's
    raising = [getattr(e.params.get("callback"), "callback_func", None) for e in eqns]
    checks = any(getattr(f, "__module__", "").startswith("equinox") for f in raising)
    return ConfigError(
        f"export({name}): the function calls back into Python ({', '.join(callbacks)}), and an "
        "artifact carries no Python: it runs where your code is not. Compute it with jnp/lax "
        "operations, or keep that step (a jax.debug.print too) outside the exported function."
        + (_EQX_CHECKS if checks else "")
    )


_UNGUARANTEED = (
    "export({name}): the function calls the kernel(s) {targets}, which jax.export refuses to "
    "write: JAX gives them no compatibility guarantee (another jaxlib may lack or change them), "
    "so no artifact can carry them.{ormqr} Compute that step with operations whose kernels JAX "
    "guarantees (jnp.linalg.qr, svd, cholesky, solve), or keep it outside the exported function."
)
_ORMQR = (
    " ormqr is jax.lax.linalg.ormqr's, as lineax's QR solver calls it (optimistix's "
    "LevenbergMarquardt's by default; AutoLinearSolver's for a matrix not square): give the "
    "solver linear_solver=lx.SVD() or lx.Normal(lx.Cholesky()), which export."
)


def unguaranteed(name: str, error: Exception) -> ConfigError | None:
    """The refusal of a function calling custom-call kernels jax.export will not serialize,
    where ``error`` (jax.export's ValueError) says so; else ``None``."""
    said = message(error)
    if not said.startswith("Cannot serialize code with custom calls whose targets have no"):
        return None
    targets = sorted(set(re.findall(r"custom_call @([\w.$]+)", said))) or ["(unnamed)"]
    ormqr = _ORMQR if any("ormqr" in t for t in targets) else ""
    return ConfigError(_UNGUARANTEED.format(name=name, targets=", ".join(targets), ormqr=ormqr))
