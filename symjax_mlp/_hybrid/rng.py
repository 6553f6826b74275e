"""Threefry on CPU, unrolled in the programs a Hybrid compiles: the same bits, several times faster.

JAX lowers ``threefry2x32`` (its default PRNG's hash) on CPU as a rolled ``while`` loop,
which XLA's CPU runtime runs step by step, so a Dropout model at batch 1 spends more of a
call on its draws than on its arithmetic. The programs a Hybrid compiles get JAX's own
unrolled rule instead: the same hash, the same bits. The rule looks at the name of the module
being lowered: a Hybrid names its programs ``jit_<name>_hybrid`` (:func:`as_program`); every
other module lowers exactly as JAX registered it. Why it is safe, and the fallback: see
:func:`symjax_mlp._compat.install_unrolled_threefry`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from symjax_mlp._compat import install_unrolled_threefry

SUFFIX = "_hybrid"


def as_program(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` under the name a Hybrid gives its programs: ``jax.jit`` of it lowers a module
    named ``jit_<name>_hybrid``, which gets the unrolled threefry."""

    def program(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    program.__name__ = program.__qualname__ = f"{name}{SUFFIX}"
    return program


INSTALLED = install_unrolled_threefry(SUFFIX)
