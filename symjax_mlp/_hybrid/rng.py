"""Threefry on CPU, unrolled in the programs a Hybrid compiles: the same bits, several times faster.

JAX hashes with ``threefry2x32`` for its default PRNG (``jax.random.key``, ``nnx.Rngs``,
linen's ``make_rng``). On GPU and TPU it lowers the hash's 20 rounds unrolled; on CPU it
lowers them as a rolled ``while`` loop of five steps, to keep compile times down for programs
with many random draws. XLA's CPU runtime runs each loop step as a separate step of its own
executor, so a Dropout model pays tens of µs per draw at batch 1, more than its arithmetic.
Measured on the nnx Dropout MLP (512 -> 256 -> 128 -> 2, two dropout draws, 2-core CPU):
about 440 µs per synced call rolled and 85-125 µs unrolled, and the unrolled program compiled
in 0.26 s against 0.59 s. Both are the same hash, so the bits are the same
(``test_a_hybrid_draws_the_same_bits_with_threefry_unrolled``).

So the programs a Hybrid compiles get JAX's own unrolled rule on CPU. The rule installed here
looks at the name of the module being lowered: a Hybrid names its programs
``jit_<name>_hybrid`` (:func:`as_program`); every other module gets the rule JAX registered,
unchanged, so code outside this library lowers exactly as before. A program with very many
draws compiles somewhat slower unrolled (50 draws: 6.5 s against 5.3 s) and still runs faster.

The two rules are JAX internals (``jax._src.random.threefry2x32``); on a JAX without them
nothing is installed and a Hybrid lowers threefry as JAX does by default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SUFFIX = "_hybrid"


def as_program(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` under the name a Hybrid gives its programs: ``jax.jit`` of it lowers a module
    named ``jit_<name>_hybrid``, which gets the unrolled threefry."""

    def program(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    program.__name__ = program.__qualname__ = f"{name}{SUFFIX}"
    return program


def _install() -> bool:
    try:  # no public way to choose this lowering (jax 0.10)
        from jax._src.random import threefry2x32 as threefry
        from jax.extend.random import threefry2x32_p
        from jax.interpreters import mlir

        unrolled = threefry._threefry2x32_lowering_rule
        default = threefry._threefry2x32_cpu_lowering_rule
    except (ImportError, AttributeError):
        return False

    def rule(ctx: Any, *args: Any, **params: Any) -> Any:
        module = ctx.module_context.module.operation
        name = module.attributes["sym_name"].value if "sym_name" in module.attributes else ""
        return (unrolled if name.endswith(SUFFIX) else default)(ctx, *args, **params)

    mlir.register_lowering(threefry2x32_p, rule, platform="cpu")
    return True


INSTALLED = _install()
