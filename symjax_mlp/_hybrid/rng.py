"""Threefry on CPU, unrolled in the programs a Hybrid compiles: the same bits, several times faster.

JAX hashes with ``threefry2x32`` for its default PRNG (``jax.random.key``, ``nnx.Rngs``,
linen's ``make_rng``). On GPU and TPU it lowers the hash's 20 rounds unrolled; on CPU it
lowers them as a rolled ``while`` loop of five steps, to keep compile times down for programs
with many random draws. XLA's CPU runtime runs each loop step as a separate step of its own
executor, so a Dropout model at batch 1 spends more of a call on its draws than on its
arithmetic; unrolled, the same program runs several times faster and compiles faster (the
benchmark's stateful rows). Both are the same hash, so the bits are the same
(``test_a_hybrid_draws_the_same_bits_with_threefry_unrolled``).

So the programs a Hybrid compiles get JAX's own unrolled rule on CPU. The rule installed here
looks at the name of the module being lowered: a Hybrid names its programs
``jit_<name>_hybrid`` (:func:`as_program`); every other module gets the rule JAX registered,
unchanged, so code outside this library lowers exactly as before. A program with very many
draws compiles somewhat slower unrolled, and still runs faster.

The two rules are JAX internals (:func:`symjax_mlp._compat.install_unrolled_threefry`); on a
JAX without them nothing is installed and a Hybrid lowers threefry as JAX does by default.
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
