"""What a Hybrid's ``jax.jit`` traces: the model on a partitioned call ``(static, leaves,
...)``, with the module settings its key holds, every trace logged; nnx objects given come back
mutated, as eager nnx leaves them. Programs named ``jit_<name>_hybrid`` lower their CPU
``threefry2x32`` unrolled (``_compat.install_unrolled_threefry``).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax
import numpy as np

from symjax_mlp._compat import install_unrolled_threefry
from symjax_mlp._errors import ConfigError, SignatureError
from symjax_mlp._hybrid.args import ModuleSetting, rebuild
from symjax_mlp._hybrid.graph import Graph
from symjax_mlp._hybrid.held import HeldState
from symjax_mlp._hybrid.jaxpr import input_dependent
from symjax_mlp._hybrid.pure import PureModel, refuse_nested_nnx_state
from symjax_mlp._hybrid.trace import TraceLog, symbolic
from symjax_mlp._specs import array_types

PROGRAM_SUFFIX = "_hybrid"
_TWICE = (
    "{caller}: the same nnx Variable ({kind}) is reached more than once among the inputs "
    "(passed twice, or inside two objects); a compiled call would mutate copies apart and keep "
    "one. Pass it once."
)
_SHARDED = (
    "{caller}: an nnx object (an Rngs, a Variable or a module) among the inputs of a sharded "
    "Hybrid, which splits every input by rows. Call it without the mesh "
    "(h.replace(mesh=None)), or keep the object in the model."
)
install_unrolled_threefry(PROGRAM_SUFFIX)


@dataclasses.dataclass(frozen=True, eq=False)
class TracedModel:
    """A Hybrid's model as its compiled paths trace it; ``constants``: the flat params a
    baked program closes over (XLA constants), or ``None``."""

    model: PureModel
    treedef: Any
    constants: list[Any] | None
    held: HeldState
    log: TraceLog

    def call(
        self, static: Any, params: Any, state: Any, dyn: Any, dyn_kw: Any, settings=None
    ) -> tuple[Any, Any]:
        """``(out, new_state)`` on a partitioned call, with the module settings its static key
        holds (or ``settings``)."""
        if settings is None:  # the module settings the static key holds
            settings = tuple(v for k, v, _ in static if type(k) is ModuleSetting)
        with self.model.pinned(settings), symbolic(self.log.name):
            result = self.model.call(params, state, *rebuild(static, dyn, dyn_kw))
        returned(result[0], self.log.name)
        return result

    def staged(
        self, static: Any, leaves: Any, state: Any, dyn: Any, dyn_kw: Any, part: int,
        settings: tuple | None = None,
    ) -> Any:  # fmt: skip
        """The jaxpr of the output (``part`` 0) or new state (1), its invars the state's leaves,
        then the inputs'."""
        params = self.params(leaves)

        def staged(state: Any, dyn: Any, dyn_kw: Any) -> Any:
            return self.call(static, params, state, dyn, dyn_kw, settings)[part]

        return jax.make_jaxpr(staged)(state, dyn, dyn_kw).jaxpr

    def sees_rows(self, static: Any, leaves: Any, dyn: Any, dyn_kw: Any) -> bool:
        """Whether a call's new state depends on its inputs (BatchNorm's statistics)."""
        jaxpr = self.staged(static, leaves, self.held.tree, dyn, dyn_kw, 1)
        return any(input_dependent(jaxpr, jaxpr.invars[len(self.held.leaves) :]))

    def keeps_state(self, static: Any, leaves: Any, dyn: Any, dyn_kw: Any) -> bool:
        """Whether a call returns the held state as given (an eval-mode call): one a JAX
        transform may run, with no new state to hold."""
        jaxpr = self.staged(static, leaves, self.held.tree, dyn, dyn_kw, 1)
        return jaxpr.outvars == jaxpr.invars[: len(jaxpr.outvars)]

    def params(self, leaves: list[Any]) -> Any:
        """A call's params: ``leaves``, or the constants a baked program closes over (JAX
        stages them as XLA constants)."""
        return jax.tree.unflatten(self.treedef, self.constants or leaves)

    def run(self, static: Any, leaves: Any, state: Any, dyn: Any, dyn_kw: Any, entry: str):
        """One trace: its budget enforced before, logged after; ``h.apply``'s
        (``entry="apply"``) returns ``out``, the new state (and given values)."""
        if entry == "apply":  # once per trace: the params h.apply was given
            refuse_nested_nnx_state(f"{self.log.name}.apply(params, ...)", leaves)
        params = leaves if entry == "apply" else self.params(leaves)
        given = variables_in((dyn, dyn_kw))  # copies of the caller's nnx Variables
        event = self.log.begin(static, dyn, dyn_kw, entry)
        try:
            result = self.call(static, params, state, dyn, dyn_kw)
        except BaseException:
            self.log.end(None)
            raise
        self.log.end(event)
        return (*result, [v.get_value() for v in given]) if given else result

    def stateless(self, static: Any, leaves: list[Any], /, *dyn: Any, **dyn_kw: Any) -> Any:
        """``h(x)`` of a stateless model: ``out`` (and the given nnx Variables' values)."""
        out, _, *given = self.run(static, leaves, self.held.tree, dyn, dyn_kw, "call")
        return (out, *given) if given else out

    def stateful(
        self, static: Any, leaves: list[Any], held: list[Any], dyn: Any, dyn_kw: Any
    ) -> Any:
        """``h(x)`` of a stateful model: ``out``, the new flat state (and given values)."""
        self.held.tracing()  # traced unlocked, callbacks run unlocked
        state = self.held.unflatten(held)
        out, new_state, *given = self.run(static, leaves, state, dyn, dyn_kw, "call")
        return out, self.held.flatten(new_state), *given

    def graph(self, static: Any, params: Any, state: Any, dyn: Any, dyn_kw: Any) -> Graph:
        """The un-jitted model staged on a partitioned call (not logged)."""
        call, name = self.model.call, self.log.name

        def staged(params: Any, dyn: Any, dyn_kw: Any) -> Any:
            with symbolic(name):
                out = call(params, state, *rebuild(static, dyn, dyn_kw))[0]
            return returned(out, name)

        staged.__name__, staged.__qualname__ = name, f"{name}{PROGRAM_SUFFIX}"  # errors: ours
        return Graph.traced(staged, name, params, dyn, dyn_kw)  # params: any pytree, a list too


_RETURNED = (
    "{name}: the model returned a value of type {kind} at out{path}, which a compiled call "
    "cannot return (XLA gives back arrays; Python numbers come back as arrays). Return arrays "
    "(in tuples, dicts or registered pytrees: jax.tree_util.register_dataclass), and keep a "
    "Python value (a label, a str) outside the model."
)
_OUT_LEAVES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def returned(out: Any, name: str) -> Any:
    """``out``, once each leaf is one a compiled call returns (checked per trace)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if not isinstance(leaf, _OUT_LEAVES):
            path = jax.tree_util.keystr(path)
            raise ConfigError(_RETURNED.format(name=name, kind=type(leaf).__name__, path=path))
    return out


def variables_in(tree: Any) -> list[Any]:
    """The nnx ``Variable`` s in ``tree``, in flattening order."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:  # no nnx object can exist
        return []
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [v for v in leaves if isinstance(v, nnx.Variable)]


def given(dyn: Any, dyn_kw: Any, caller: str, sharded: bool = False) -> list[Any]:
    """The caller's Variables among a call's traced inputs; refused twice, or if sharded."""
    if all(type(a) in _ARRAYS for a in (*dyn, *dyn_kw.values())):  # the usual call: no walk
        return []
    found = variables_in((dyn, dyn_kw))
    if found and sharded:
        raise ConfigError(_SHARDED.format(caller=caller))
    if len({id(v) for v in found}) != len(found):
        twice = next(v for i, v in enumerate(found) if any(v is w for w in found[:i]))
        raise SignatureError(_TWICE.format(caller=caller, kind=type(twice).__name__))
    return found


_ARRAYS = array_types()
_OUTER = (
    "{caller}: the nnx {kind} given (an nnx.Rngs advances per draw) was made outside the JAX "
    "transform the call runs under (jax.grad, jax.vmap, ...), so nnx cannot write the new "
    "value into it (TraceContextError). Make it inside the transformed function from a key "
    "split each step, jax.grad(lambda p: loss(h.apply(p, x, rngs=nnx.Rngs(key))))(h.params), "
    "or use nnx.grad."
)


def write_back(variables: list[Any], new: list[Any], caller: str = "Hybrid") -> None:
    """Sets the caller's ``variables`` to a compiled call's ``new`` values."""
    for v, value in zip(variables, new, strict=True):
        try:
            v.set_value(value)
        except Exception as e:  # looked up only here: this runs on every stateful call
            outer = getattr(sys.modules.get("flax.errors"), "TraceContextError", ())
            if not isinstance(e, outer):
                raise
            raise ConfigError(_OUTER.format(caller=caller, kind=type(v).__name__)) from None
