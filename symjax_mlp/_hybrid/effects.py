"""A probabilistic program's effect handlers around a trace. NumPyro's ``numpyro.sample`` (and
``param``, ``deterministic``, ``plate``, ``factor``) sends a message down a stack of handlers
(``seed``, ``substitute``, ``trace``, ``condition``, ...) that lives in Python, outside JAX. A
Hybrid traces its function once and reuses the program: a handler entered outside it sees the
function's sites on the trace only (the draw's key or a substituted value baked in, the trace
holding tracers), and never on a later call, which draws the same numbers again with no site.
So while a Hybrid traces under handlers entered outside it, the first message that would reach
them is refused; handlers entered inside the function (``Predictive``, ``seed`` around the
model there) handle their sites within the program, as ``jax.jit`` needs. Nothing is done
where NumPyro is not imported or no handler is active (the usual trace). NumPyro's stack is
one list for every thread: another thread's model, its sites and its handlers, pass by."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any

from symjax_mlp._errors import ConfigError

_OUTER_HANDLERS = (
    "{name}: NumPyro's {kind} site {site!r} inside the Hybrid's function reaches effect "
    "handlers entered outside the Hybrid ({handlers}). A Hybrid traces its function once and "
    "reuses the program: those handlers would see the site on this first call only (its key "
    "or value baked into the program) and never again, later calls drawing the same numbers "
    "with no site in their trace. Keep the sites outside the Hybrid and hybridize the "
    "deterministic part over what they draw, e.g. w = numpyro.sample('w', ...); out = "
    "h.apply({{'w': w}}, x); or hybridize the whole program with its handlers inside, e.g. "
    "sm.hybridize(lambda p, key, x: Predictive(model, p, batch_ndims=0)(key, x), params)."
)


def outer_handlers(name: str) -> Any:
    """A context for one trace of the Hybrid ``name``: where NumPyro handlers are active, a
    handler innermost of them that refuses any message reaching it (a ConfigError)."""
    primitives = sys.modules.get("numpyro.primitives")
    stack = getattr(primitives, "_PYRO_STACK", None)  # numpyro's handler stack (a list)
    if not stack:  # numpyro not imported, or no handler entered: no site can escape
        return contextlib.nullcontext()
    handlers = ", ".join(dict.fromkeys(type(h).__name__ for h in reversed(stack)))

    tracing = threading.get_ident()

    class Edge(primitives.Messenger):  # entered last, it is the first handler outside the trace
        def process_message(self, msg: dict) -> None:
            if threading.get_ident() != tracing:  # another thread's model: not this trace's
                return
            kind, site = msg.get("type"), msg.get("name")
            raise ConfigError(
                _OUTER_HANDLERS.format(name=name, kind=kind, site=site, handlers=handlers)
            )

        def __exit__(self, *exc: object) -> None:  # itself only: the stack is every thread's
            if self in stack:
                stack.remove(self)

    return Edge()
