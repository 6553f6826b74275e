"""What a Hybrid's ``jax.jit`` traces: the model on a partitioned call, every trace logged.

A call reaches the model as ``(static, leaves, ...)``: the static key (Python settings and an
nnx module's modes, :mod:`~symjax_mlp._hybrid.args`), the flat params, and the traced inputs.
:class:`TracedModel` rebuilds the call, runs the model with the module settings its key holds,
and records the trace in the Hybrid's :class:`~symjax_mlp._hybrid.trace.TraceLog` once the model
traced without error. Its methods are the functions a Hybrid jits: :meth:`stateless`,
:meth:`stateful` (the held state passed flat and taken back flat) and :meth:`apply` (the pure
form, which takes the params and state as trees).
"""

from __future__ import annotations

from typing import Any

import jax

from symjax_mlp._hybrid import objects
from symjax_mlp._hybrid.args import rebuild
from symjax_mlp._hybrid.graph import Graph
from symjax_mlp._hybrid.held import HeldState
from symjax_mlp._hybrid.modes import settings_in
from symjax_mlp._hybrid.pure import PureModel
from symjax_mlp._hybrid.trace import TraceLog


class TracedModel:
    """A Hybrid's model as its compiled paths trace it.

    Attributes:
      model: the model, called purely.
      treedef: the params' tree structure (the compiled calls pass them flat).
      constants: the flat params a baked program closes over (XLA constants), or ``None``.
      held: the Hybrid's held state.
      log: the Hybrid's trace log.
    """

    def __init__(
        self,
        model: PureModel,
        treedef: Any,
        constants: list[Any] | None,
        held: HeldState,
        log: TraceLog,
    ) -> None:
        self.model, self.treedef, self.constants = model, treedef, constants
        self.held, self.log = held, log

    def call(
        self, static: Any, params: Any, state: Any, dyn: Any, dyn_kw: Any, settings=None
    ) -> tuple[Any, Any]:
        """``(out, new_state)`` of the model on a partitioned call, run with the module
        settings its static key holds (what the trace is keyed on), or with ``settings``."""
        with self.model.pinned(settings_in(static) if settings is None else settings):
            return self.model.call(params, state, *rebuild(static, dyn, dyn_kw))

    def staged(
        self, static: Any, params: Any, state: Any, dyn: Any, dyn_kw: Any, part: int,
        settings: tuple | None = None,
    ) -> Any:  # fmt: skip
        """The jaxpr of the model's output (``part`` 0) or new state (1) on a partitioned
        call, ``params`` and ``state`` as constants (the inputs are its only ``invars``)."""

        def staged(dyn: Any, dyn_kw: Any) -> Any:
            return self.call(static, params, state, dyn, dyn_kw, settings)[part]

        return jax.make_jaxpr(staged)(dyn, dyn_kw).jaxpr

    def run(self, static: Any, leaves: Any, state: Any, dyn: Any, dyn_kw: Any, entry: str):
        """One trace: logged (and its budget enforced) before, committed after."""
        event = self.log.begin(static, dyn, dyn_kw, entry)
        if entry == "apply":
            params = leaves
        else:  # a baked call closes over the params: JAX stages them as constants
            baked = self.constants is not None
            params = jax.tree.unflatten(self.treedef, self.constants if baked else leaves)
        given = objects.variables_in((dyn, dyn_kw))  # copies of the caller's nnx Variables
        result = self.call(static, params, state, dyn, dyn_kw)
        self.log.commit(event)
        return (*result, objects.values(given)) if given else result

    def stateless(self, static: Any, leaves: list[Any], /, *dyn: Any, **dyn_kw: Any) -> Any:
        """``h(x)`` of a stateless model: the output (and the values of the nnx Variables it
        was given, if any: ``(out, values)``)."""
        out, _, *given = self.run(static, leaves, self.held.tree, dyn, dyn_kw, "call")
        return (out, *given) if given else out

    def stateful(
        self, static: Any, leaves: list[Any], held: list[Any], dyn: Any, dyn_kw: Any
    ) -> Any:
        """``h(x)`` of a stateful model: the output and the new state, flat (and the values
        of the nnx Variables it was given, if any)."""
        state = self.held.unflatten(held)
        out, new_state, *given = self.run(static, leaves, state, dyn, dyn_kw, "call")
        return out, self.held.flatten(new_state), *given

    def apply(self, static: Any, params: Any, state: Any, dyn: Any, dyn_kw: Any) -> Any:
        """``h.apply(params, x)``: the output and the new state, as trees (and the values of
        the nnx Variables it was given, if any)."""
        return self.run(static, params, state, dyn, dyn_kw, "apply")

    def graph(
        self, name: str, static: Any, params: Any, state: Any, dyn: Any, dyn_kw: Any
    ) -> Graph:
        """The un-jitted model staged on a partitioned call, as a :class:`~symjax_mlp.Graph`
        (every layer shows; not a trace of the compiled paths, so not logged)."""
        call = self.model.call

        def staged(params: Any, dyn: Any, dyn_kw: Any) -> Any:
            args, kwargs = rebuild(static, dyn, dyn_kw)
            return call(params, state, args, kwargs)[0]

        staged.__name__ = name
        return Graph.traced(staged, name, params, dyn, dyn_kw)  # params: any pytree, a list too
