"""The trace log: what each trace of a Hybrid was specialised on, and why it traced again
(what changed against the nearest earlier trace); its budget and ``on_trace`` callbacks; the
errors a trace of the model raises (a tracer's, inputs the params do not fit) as ours."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from symjax_mlp._errors import (
    ConfigError,
    ControlFlowError,
    RetraceError,
    SignatureError,
    SymjaxError,
    first_line,
    message,
    refuse_two_devices,
)
from symjax_mlp._hybrid.args import (
    NOT_AN_INPUT,
    NOT_AN_INPUT_FIX,
    inputs_after,
    rebuild,
    signature,
)
from symjax_mlp._specs import TensorSpec, input_specs

TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,  # includes TracerBoolConversionError
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)

_CONTROL_FLOW_HELP = (
    "It runs eagerly (h.eager(x)), where every array has a value; compiled, only shapes and "
    "dtypes are known, so a Python `if`/`while` on an array, float(x), int(x) or np.asarray(x) "
    "cannot be decided. Stay symbolic:\n"
    "  - `if x > 0: a else b`       ->  jnp.where(x > 0, a, b) or jax.lax.cond\n"
    "  - `while cond(x): ...`       ->  jax.lax.while_loop / jax.lax.fori_loop\n"
    "  - np.asarray(x) / float(x)   ->  keep using jnp operations on x\n"
    "  - a setting passed as an array ->  pass it as a Python constant (static)\n"
    "  - a data-dependent shape (x[:n], jnp.zeros(n), jnp.nonzero(x)) -> pass n as a Python int "
    "or in sm.hybridize(..., static_argnames=('n',)) (one trace per value), give it a static "
    "size (jnp.nonzero(x, size=k)), mask with jnp.where, or pad to a fixed length.\n"
    "A Python `for` over a fixed range is fine: it unrolls into the graph."
)


def control_flow_error(name: str, e: Exception) -> ControlFlowError:
    """The :class:`~symjax_mlp.ControlFlowError` for JAX's tracer error ``e`` in ``name``."""
    said = f"{name}: Python needed a concrete value from a traced (symbolic) array while compiling"
    return ControlFlowError(f"{said}: {first_line(e, typed=True)}\n{_CONTROL_FLOW_HELP}")


_PARAM_SHAPE = (
    "{name}: the inputs ({inputs}) do not fit the params: param {param} has shape {have}, and "
    "these inputs make it {want}. {fix}"
)
_OTHER_INPUTS = (
    "The params were made for inputs of other shapes (model.init fixes each layer's input width): "
    "pass inputs of those shapes, or init the model again for these."
)
_TRANSPOSED = (  # a PyTorch user's weights, copied in as they are
    "It holds the transpose: a Dense kernel is (in, out), a torch.nn.Linear weight (out, in). "
    "Copying a PyTorch model's weights, pass each weight.T as its kernel."
)
_SYMBOLIC_WIDTH = (
    " A param's shape is fixed, so a dimension it depends on cannot be symbolic: in export's "
    "shapes=, write that dimension as its number, not as a name; or export with batch=None "
    "(the example's shapes, every dimension static)."
)
#: flax's ScopeParamShapeError, its parts: parameter, scope, shape expected, shape held
_SCOPE_PARAM_SHAPE = re.compile(
    r'parameter "(.+)" in "(.*)", the given initializer is expected to generate shape '
    r"(\(.*?\)), but the existing parameter it received has shape (\(.*?\))"
)
_PRODUCT = re.compile(
    r"dot_general requires contracting dimensions to have the same shape, got \((\w+),\) and "
    r"\((\d+),\)"
)
_EMPTY = (
    "{name}: the inputs ({inputs}) have a dimension of size 0 that a param's shape depends on "
    "(flax checks the shape with the param's initializer, which divided by it). The params "
    "were made for inputs of other shapes: pass inputs of those shapes (an empty batch is a "
    "leading dimension of 0, the others as the params were made for)."
)
_ARGUMENTS = "{name}: the call's arguments do not fit {whose} inputs ({inputs}): {error}. {fix}"
MODEL_FIX = "Pass them as the model takes them, without its params or self: h({call})."
_PRODUCT_SHAPE = (
    "{name}: the inputs ({inputs}) do not fit the params: a matrix product takes {got} from an "
    "input's last dimension where the params have {want} ({weights}). The params were made for "
    "inputs of other shapes: pass inputs of those shapes, or make the params again for these."
)


def unfit_input(name: str, error: Exception, args: Any, kwargs: Any) -> SignatureError | None:
    """The :class:`~symjax_mlp.SignatureError` for flax's ``ScopeParamShapeError``: the
    inputs (by path, shape, dtype) that do not fit a param's shape; ``None`` if unparsed."""
    if (found := _SCOPE_PARAM_SHAPE.search(message(error))) is None:
        return None
    param, scope, want, have = found.groups()
    inputs = ", ".join(map(str, input_specs(args, kwargs))) or "none"
    fix = _OTHER_INPUTS + (_SYMBOLIC_WIDTH if re.search(r"[A-Za-z_]", want) else "")
    if have != want and re.findall(r"\w+", have) == re.findall(r"\w+", want)[::-1]:
        fix = _TRANSPOSED
    return SignatureError(
        _PARAM_SHAPE.format(name=name, inputs=inputs, have=have, want=want,
                            param=f"{scope.strip('/')}/{param}".lstrip("/"), fix=fix)
    )  # fmt: skip


def unbindable(
    name: str, target: Any, args: Any, kwargs: Any, *, skip: int = 1, fix: str = MODEL_FIX,
    whose: str = "the model's",
) -> SignatureError | None:  # fmt: skip
    """The :class:`~symjax_mlp.SignatureError` for arguments that do not bind to ``target``'s
    inputs after its first ``skip`` (params, ``self``); ``None`` if they bind or it has no
    signature. ``fix`` may name ``{call}``: the required inputs, as ``a, b, key=key``."""
    try:
        given = inputs_after(target, skip)
        inputs = inspect.Signature([p.replace(annotation=p.empty) for p in given])
    except (TypeError, ValueError):  # no signature to read
        return None
    try:
        inputs.bind(*args, **kwargs)
    except TypeError as e:
        need = [p for p in given if p.default is p.empty]
        call = [p.name for p in need if p.kind <= p.POSITIONAL_OR_KEYWORD]
        call += [f"{p.name}={p.name}" for p in need if p.kind == p.KEYWORD_ONLY]
        return SignatureError(
            _ARGUMENTS.format(name=name, whose=whose, inputs=str(inputs)[1:-1], error=e,
                              fix=fix.replace("{call}", ", ".join(call)))
        )  # fmt: skip
    return None


def unfit_call(
    name: str, error: Exception, target: Any, params: Any, args: Any, kwargs: Any
) -> SignatureError | None:
    """The :class:`~symjax_mlp.SignatureError` for a model's ``TypeError``: arguments not binding
    (:func:`unbindable`), or an input's last dimension unlike a weight's first (equinox's: last);
    for flax's ``ZeroDivisionError``, an input with a dimension of size 0 (a param's initializer
    divided by it), else its ``ScopeParamShapeError`` (:func:`unfit_input`); or ``None``."""
    if isinstance(error, ZeroDivisionError):
        specs = input_specs(args, kwargs)
        if not any(0 in s.shape for s in specs):
            return None
        return SignatureError(_EMPTY.format(name=name, inputs=", ".join(map(str, specs))))
    if not isinstance(error, TypeError):
        return unfit_input(name, error, args, kwargs)
    if (unbound := unbindable(name, target, args, kwargs)) is not None:
        return unbound
    if (found := _PRODUCT.search(message(error))) is None:
        return None
    specs = input_specs(args, kwargs)  # x @ w (flax); w @ x (equinox's Linear): axis -1
    for got, want, axis in ((found[1], found[2], 0), (found[2], found[1], -1)):
        weights = [  # got: a size, or a symbolic dimension's name
            f"{jax.tree_util.keystr(p, simple=True, separator='/')} {tuple(x.shape)}"
            for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
            if len(getattr(x, "shape", ())) >= 2 and str(x.shape[axis]) == want
        ]
        if weights and any(s.shape and str(s.shape[-1]) == got for s in specs):
            listed = ", ".join(weights[:3]) + (", ..." if weights[3:] else "")
            inputs = ", ".join(map(str, specs))
            return SignatureError(
                _PRODUCT_SHAPE.format(name=name, inputs=inputs, got=got, want=want, weights=listed)
                + ("" if got.isdigit() else _SYMBOLIC_WIDTH)
            )
    return None


#: jax.jit's refusal of an input of a Hybrid's program (its path is the program's, not yours)
_UNTRACEABLE = re.compile(
    r"_hybrid at 0x[0-9a-f]+> as an abstract array\. "
    r"The problematic value is of type <class '([^']+)'>"
)
_CONCRETE = re.compile(r"concrete|static|(Tracer\(|Traced<)(\w+\()?~?\w+\[\]")  # see symbolic


@contextlib.contextmanager
def symbolic(name: str) -> Iterator[None]:
    """JAX's tracer errors in the block as :func:`control_flow_error`, and its TypeError of a
    tracer for a value it needs (x[:n]: 'concrete', 'static', a traced scalar; not checkify's
    'takes a scalar pred' of a vector, the model's); arrays on two devices named."""
    try:
        yield
    except TRACER_ERRORS as e:
        raise control_flow_error(name, e) from e
    except (IndexError, TypeError, ValueError) as e:
        refuse_two_devices(name, e)  # jit's ValueError
        if isinstance(e, SymjaxError) or not isinstance(e, IndexError | TypeError):
            raise
        if kind := _UNTRACEABLE.search(message(e)):
            at, what = "an input (or a leaf of a tuple/dict input)", f"of type {kind[1]}"
            error = NOT_AN_INPUT.format(caller=name, path=at, what=what, fix=NOT_AN_INPUT_FIX)
            raise ConfigError(error) from None
        if not _CONCRETE.search(said := message(e)) or not ("Tracer(" in said or "Traced<" in said):
            raise
        raise control_flow_error(name, e) from e


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """One trace of a :class:`~symjax_mlp.Hybrid`: the input signature, and why it (re)traced.

    Attributes:
      index: 0 for the first trace, 1 for the first retrace, ...
      signature: one :class:`~symjax_mlp.TensorSpec` per traced input leaf (not the params).
      tree: the traced inputs' tree structure, as text.
      reason: ``"first call"`` or what changed against the nearest earlier trace, e.g.
        ``"args[0].shape changed from (1, 512) to (7, 512)"``, or the variables a call added.
      static: the static (Python) arguments it was specialised on, ``(path, repr(value))``.
      entry: ``"call"`` (``h(x)``) or ``"apply"`` (``h.apply(params, x)``).
    """

    index: int
    signature: tuple[TensorSpec, ...]
    tree: str
    reason: str
    static: tuple[tuple[str, str], ...] = ()
    entry: str = "call"

    def __str__(self) -> str:
        static = [f"{k}={v}" for k, v in self.static if _shown(k)]
        sig = ", ".join([*map(str, self.signature), *static])
        where = "" if self.entry == "call" else f" ({self.entry})"
        return f"trace #{self.index}{where} [{sig}]: {self.reason}"


class TraceEvents(tuple):
    """``h.trace_log``: its :class:`TraceEvent` s, oldest first, shown one a line (in a
    notebook's cell too) as ``print(event)`` prints each, not as the fields of each."""

    def __repr__(self) -> str:
        return "\n".join(map(str, self)) if self else "()"


#: what nnx's ``Module.train()`` and ``eval()`` set: the module settings a trace's line shows
MODE_ATTRIBUTES = ("deterministic", "use_running_average")


def _shown(path: str) -> bool:
    return not path.startswith("module.") or path.rpartition("/")[2] in MODE_ATTRIBUTES


def _changed(old: Sequence[TensorSpec], new: Sequence[TensorSpec]) -> list[str]:
    """Each field that changed: ``args[0].shape changed from (1, 512) to (7, 512)``."""
    return [
        f"{n.path}.{f} changed from {getattr(o, f)} to {getattr(n, f)}"
        for o, n in zip(old, new, strict=True)
        for f in ("shape", "dtype", "weak_type")
        if getattr(o, f) != getattr(n, f)
    ]


def explain(
    sig: tuple[TensorSpec, ...], tree: str, events: Sequence[TraceEvent], static=(), added=()
) -> str:
    """Why ``(sig, tree, static)`` traced again: what differs from the nearest earlier trace."""
    if not events:
        return "first call"

    def distance(e: TraceEvent) -> int:  # by field: (5, 3) float32 is nearer (2, 3) float32
        if e.tree != tree:
            return 1 << 30
        return len(_changed(e.signature, sig)) + len(set(e.static) ^ set(static))

    old = min(reversed(events), key=distance)
    moved = [f"input tree structure changed from {old.tree} to {tree}"]
    changes = _changed(old.signature, sig) if old.tree == tree else moved
    was, now = dict(old.static), dict(static)
    changes += [
        f"{p} (static) changed from {was.get(p, '(absent)')} to {now.get(p, '(absent)')}"
        for p in sorted(set(was) | set(now))
        if was.get(p) != now.get(p)
    ]
    changes += [f"the held state grew: the last call added {', '.join(added)}"] if added else []
    return "; ".join(changes) or _SAME


_SAME = (  # jax.jit's cache no longer held the program: nothing in the inputs changed
    "same signature traced again (jax.clear_caches() emptied JAX's caches, a jax.config setting "
    "such as jax_enable_x64 changed, or a static argument is a new object at each call)"
)
_RETRACE = (
    "{name}: trace #{index} would exceed max_traces={budget}. Why it retraced: {reason}.\n"
    "  Earlier traces:\n  {history}\nCall it with one shape and dtype (pad the batch, cast "
    "once) and fixed settings, or raise max_traces if each is intended (after "
    "jax.clear_caches(), each signature traces once more)."
)
_REENTERED = (
    "{name}: an on_trace callback called the Hybrid on inputs that trace it again (or ran it "
    "eagerly), which runs the callback again, without end. A callback may read the Hybrid "
    "(h.state, h.trace_log) and call it on inputs already traced; make other calls after the "
    "call that traced returns."
)


class TraceLog:
    """The traces of one Hybrid's compiled paths, each run in :meth:`tracing` and logged once
    it succeeded; ``callbacks`` are shared by the Hybrids ``replace`` makes."""

    def __init__(self, name: str, max_traces: int | None) -> None:
        self.name, self.max_traces = name, max_traces
        self.callbacks: list[Callable[..., Any]] = []
        self._events: list[TraceEvent] = []
        self._held: frozenset[str] = frozenset()  # the state paths the last trace logged had
        self._lock, self._under_way = threading.Lock(), 0  # _under_way: traces begun, not ended
        self._running = threading.local()  # this thread runs the callbacks

    @property
    def events(self) -> TraceEvents:
        return TraceEvents(self._events)

    def follow(self, earlier: TraceLog, traced: bool) -> None:
        """Goes on from ``earlier`` (a Hybrid's, turned stateful); if ``traced``, the retrace
        of the trace the turning call failed in runs no callback again."""
        self._events, self._held, self.callbacks = earlier._events, earlier._held, earlier.callbacks
        self._running.ran = getattr(earlier._running, "failed", None) if traced else None

    def add(self, callback: Callable[..., Any]) -> None:
        if not callable(callback):
            raise ConfigError(f"on_trace expects a callable; got {type(callback).__name__}.")
        self.callbacks.append(callback)

    def run_callbacks(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Runs each callback; one that traces (or eagerly runs) this Hybrid again is refused."""
        if getattr(self._running, "on", False):
            raise ConfigError(_REENTERED.format(name=self.name))
        self._running.on = True
        try:
            for callback in self.callbacks:
                callback(*args, **kwargs)
        except RecursionError as e:  # jax.jit's, for a call on the very inputs being traced
            raise ConfigError(_REENTERED.format(name=self.name)) from e
        finally:
            self._running.on = False

    def tracing(self, static: Any, dyn: Any, dyn_kw: Any, entry: str, held=()) -> Any:
        """One trace in the block (of a state of paths ``held``), its event given: callbacks run
        first, a RetraceError past the budget (racing traces counted), logged if it succeeds;
        under ``jax.disable_jit()`` a run op by op, as ``h.eager``'s: no trace, its event None."""
        if jax.config.jax_disable_jit:  # (this thread's): neither logged nor counted
            self.run_callbacks(*rebuild(static, dyn, dyn_kw))
            return contextlib.nullcontext()
        sig, tree, shown = signature(dyn, dyn_kw, static)
        with self._lock:
            added = [p for p in held if self._events and p not in self._held][:5]
            reason = explain(sig, tree, self._events, shown, added)
            n = len(self._events) + self._under_way
            event = TraceEvent(n, sig, tree, reason, shown, entry)
            if self.max_traces is not None and n >= self.max_traces:
                history = "\n  ".join(map(str, self._events))
                raise RetraceError(
                    _RETRACE.format(name=self.name, index=event.index, budget=self.max_traces,
                                    reason=reason, history=history)
                )  # fmt: skip
            self._under_way += 1
        return _Trace(self, event, (sig, tree, shown, entry), lambda: rebuild(static, dyn, dyn_kw),
                      frozenset(held))  # fmt: skip

    def _begin(self, key: Any, call: Callable[[], Any]) -> None:
        if self._running.__dict__.pop("ran", None) != key:  # follow's
            self.run_callbacks(*call())

    def _end(self, event: TraceEvent, key: Any, held: frozenset[str], failed: bool) -> None:
        if failed:
            self._running.failed = key
        with self._lock:
            self._under_way -= 1
            if not failed:
                self._events.append(dataclasses.replace(event, index=len(self._events)))
                self._held = held


class _Trace:
    """:meth:`TraceLog.tracing`'s block: a class, not a generator, so that what a callback
    raises reaches the caller as it is (a generator's ``StopIteration`` became a RuntimeError)."""

    def __init__(self, log: TraceLog, event: TraceEvent, key: Any, call: Any, held: Any) -> None:
        self.log, self.event, self.key, self.call, self.held = log, event, key, call, held

    def __enter__(self) -> TraceEvent:
        try:
            self.log._begin(self.key, self.call)
        except BaseException:
            self.log._end(self.event, self.key, self.held, failed=True)
            raise
        return self.event

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        self.log._end(self.event, self.key, self.held, failed=kind is not None)
