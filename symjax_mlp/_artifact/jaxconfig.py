"""The process-wide JAX settings (``jax.config``) that change the program ``jax.export`` writes
for one model and one input: which they are, what an export records of them, what a manifest
may hold there.

A library's import may set one for the whole process (dynamax's sets
``jax_default_matmul_precision`` to ``"float32"``: every later export writes its ``dot_general``
ops with ``precision = [HIGHEST, HIGHEST]``). An export keeps the program its process computes
and records each such setting not at JAX's default in the manifest's ``jax_config``, so that
other bytes come with their reason, and a re-export with those settings writes the same bytes.
The program is self-contained: loading it where the settings differ runs it as written.

Settings that only refuse a model (``jax_numpy_dtype_promotion="strict"``,
``jax_numpy_rank_promotion="raise"``) write nothing else; the calling convention has its own
field; source locations are never written (:func:`~symjax_mlp._compat.without_source_locations`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any


@functools.cache
def _precisions() -> frozenset[str]:
    import jax  # where a manifest is read (``import symjax_mlp`` imports no JAX)

    names = jax.lax.DotAlgorithmPreset.__members__
    return frozenset({"default", "high", "highest", "bfloat16", "tensorfloat32", "float32", *names})


def _precision(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= 64 and v in _precisions()


def _flag(v: Any) -> bool:
    return isinstance(v, bool)


def _among(names: frozenset[str]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, str) and v in names


def _offset(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


#: name: (JAX's default, the other values that write what it writes, what a manifest may hold)
SETTINGS: dict[str, tuple[Any, tuple[Any, ...], Callable[[Any], bool]]] = {
    "jax_default_matmul_precision": (None, ("default", "bfloat16"), _precision),
    "jax_default_prng_impl": ("threefry2x32", (), _among(frozenset({"threefry2x32", "rbg",
                                                                     "unsafe_rbg"}))),
    "jax_enable_x64": (False, (), _flag),  # an int64 loop counter in a float32 model
    "jax_threefry_partitionable": (True, (), _flag),  # the bits jax.random draws
    "jax_random_seed_offset": (0, (), _offset),
    "jax_high_dynamic_range_gumbel": (False, (), _flag),
    "jax_softmax_custom_jvp": (False, (), _flag),
    "jax_scan3": (False, (), _flag),  # JAX's experimental rewrites of scan, remat, constants
    "jax_remat3": (False, (), _flag),
    "jax_use_simplified_jaxpr_constants": (False, (), _flag),
    "eager_constant_folding": (False, (), _flag),
}  # fmt: skip

SCHEMA = (
    "an object of the JAX settings an export ran under (" + ", ".join(SETTINGS) + "), each "
    "as jax.config holds it (a newer symjax_mlp may record more: pip install -U symjax_mlp)"
)


def recorded() -> dict[str, Any]:
    """This thread's settings among :data:`SETTINGS` that write another program than JAX's
    defaults (``{}`` in a fresh process), as JSON data, in :data:`SETTINGS`' order."""
    import jax

    values = jax.config.values  # this thread's (a `with jax.enable_x64(True)` block's too)
    return {
        name: value
        for name, (default, same, _) in SETTINGS.items()
        if (value := values.get(name, default)) != default and value not in same
    }


def valid(x: Any) -> bool:
    """Whether ``x`` is what a manifest may record: known settings, each a value JAX takes."""
    return isinstance(x, dict) and all(
        isinstance(k, str) and k in SETTINGS and SETTINGS[k][2](v) for k, v in x.items()
    )


def shown(settings: Mapping[str, Any]) -> str:
    """``name=value, ...``, as a report prints them (``"JAX's defaults"`` for none)."""
    return ", ".join(f"{k}={v}" for k, v in settings.items()) or "JAX's defaults"
