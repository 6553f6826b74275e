"""Every private JAX, Flax and CPython internal the library uses, each section saying why, the
internal and its public fallback; :data:`INTERNALS` turns each off (``tests/test_compat.py``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import inspect
import logging
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

#: Whether each internal is used (``False``: its fallback); read at each use (the GIL's: once).
INTERNALS: dict[str, bool] = dict.fromkeys((
    "threefry", "lapack", "source_locations", "backend_started", "layer_scopes", "futures", "gil",
    "transformed", "linearizing", "constraints", "dispatch_cache", "transposes", "refusals",
), True)  # fmt: skip


# -- 1. threefry, unrolled on CPU in a Hybrid's programs ------------------------------------
# Why: on CPU JAX lowers threefry2x32 as a rolled `while` loop (on GPU and TPU unrolled);
# unrolled, dropout draws run and compile faster, the bits the same. Internal: jax._src.random's
# two lowering rules. Fallback: threefry lowers as JAX does by default.
def install_unrolled_threefry(suffix: str) -> bool:
    """Registers a CPU lowering of ``threefry2x32``, unrolled in modules named ``*<suffix>``
    (a Hybrid's programs), as JAX has it elsewhere; returns whether it was installed."""
    try:
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
        mine = INTERNALS["threefry"] and name.endswith(suffix)
        return (unrolled if mine else default)(ctx, *args, **params)

    mlir.register_lowering(threefry2x32_p, rule, platform="cpu")
    return True


# -- 2. JAX's LAPACK set-up, skipped for a module that calls no LAPACK kernel ---------------
# Why: JAX sets up LAPACK (importing scipy.linalg) before lowering any exported CPU module; a
# shorter cold start without it. Internal: jax._src.lax.linalg.initialize_lapack, wrapped, and
# jax._src.lib.lapack's kernel names. Fallback: the set-up runs for every module, as in JAX.
_LAPACK = threading.local()  # .skip: this thread compiles a module that calls no LAPACK


@functools.cache
def lapack_kernels() -> frozenset[str] | None:
    """JAX's LAPACK kernels' custom-call targets, its set-up made skippable (``None``: no such)."""
    try:  # jax 0.10: _ensure_backends_initialized calls linalg.initialize_lapack by name
        from jax._src.lax import linalg
        from jax._src.lib import lapack

        targets, set_up = frozenset(lapack._lapack.registrations()), linalg.initialize_lapack
    except (ImportError, AttributeError):
        return None

    def initialize_lapack() -> None:
        if not getattr(_LAPACK, "skip", False):
            set_up()

    linalg.initialize_lapack = initialize_lapack
    return targets


@contextlib.contextmanager
def skipping_lapack(custom_calls: Any) -> Iterator[None]:
    """Within the block, this thread skips JAX's LAPACK set-up if ``custom_calls`` (a module's
    targets) include none of its kernels; ``None`` (unknown): as the enclosing block has it."""
    kernels = lapack_kernels() if INTERNALS["lapack"] else None
    before = getattr(_LAPACK, "skip", False)
    if custom_calls is not None:
        _LAPACK.skip = kernels is not None and kernels.isdisjoint(custom_calls)
    try:
        yield
    finally:
        _LAPACK.skip = before


# -- 3. an export without this machine's source locations ----------------------------------
# Why: jax.export writes each op's Python source location (local paths); without them a model
# exports to the same bytes anywhere. Internal: jax._src.config.traceback_in_locations_limit
# and include_full_tracebacks_in_locations (off, JAX writes the user's frame whatever the
# limit), scoped to this thread (jax.config.update is global). Fallback: the locations stay.
@contextlib.contextmanager
def without_source_locations() -> Iterator[None]:
    """A block whose exports carry no Python source locations (where this JAX allows)."""
    config = sys.modules.get("jax._src.config") if INTERNALS["source_locations"] else None
    limit = getattr(config, "traceback_in_locations_limit", None)
    full = getattr(config, "include_full_tracebacks_in_locations", None)
    none = contextlib.nullcontext()  # (reusable)
    with none if limit is None else limit(0), none if full is None else full(True):
        yield


# -- 4. whether JAX's backend has started ---------------------------------------------------
# Why: latency_mode() sets a flag JAX reads only as its CPU backend starts; set too late, an
# error says so. Internal: jax._src.xla_bridge.backends_are_initialized (no public one in jax
# 0.10). Fallback: ``None`` (unknown): the flag is set, as before any JAX computation.
def backend_started() -> bool | None:
    """Whether JAX has started a backend (``None``: this JAX does not say)."""
    bridge = sys.modules.get("jax._src.xla_bridge") if INTERNALS["backend_started"] else None
    started = getattr(bridge, "backends_are_initialized", None)
    return None if started is None else bool(started())


# -- 5. a stateful Hybrid's call: whether it runs under a JAX transformation, its dispatch ---
# Why: it looks for tracers in its new state only under a transform (jit, grad, vmap): one check
# per call, not one per leaf; a signature whose first call gave up its trace (to trace unlocked)
# jaxlib dispatches by Python for good (~5x slower) unless dropped. Internal: jax._src.core's
# trace_ctx and eval_trace; jit's C++ _clear_cache (clear_cache drops the traces too). Fallback:
# ``None`` (unknown): every leaf is looked at; each call of such a signature by Python.
def transformed() -> bool | None:
    """Whether this thread runs under a JAX transformation (``None``: unknown)."""
    core = sys.modules.get("jax._src.core") if INTERNALS["transformed"] else None
    trace = getattr(getattr(core, "trace_ctx", None), "trace", None)
    return None if trace is None else trace is not getattr(core, "eval_trace", None)


def clear_dispatch_cache(jitted: Any) -> None:
    """Drops ``jitted``'s dispatch entries: each signature's next call is Python's, once (its
    trace and executable read from JAX's caches), then C++'s again."""
    if INTERNALS["dispatch_cache"] and (clear := getattr(jitted, "_clear_cache", None)):
        clear()


# -- 5b. whether forward mode (jax.linearize, jax.jvp, jax.jacfwd), not jax.vjp, traces a call -
# Why: a loaded model cannot run forward: refused as it traces, not by JAX's TypeError later.
# Internal: the caller's frames, jax.vjp's primals, custom_lin's bwd.f. Fallback: JAX's error.
def linearizing() -> Iterator[Any]:
    """Per jax.linearize, jvp, jacfwd (True) or vjp (its primals) calling us, innermost first."""
    frame = sys._getframe(1) if INTERNALS["linearizing"] else None
    while frame is not None:
        if (forward := _callers().get(frame.f_code)) is not None:
            yield forward or frame.f_locals.get("primals", ())
        frame = frame.f_back


@functools.cache
def _callers() -> dict[Any, bool]:
    import jax

    forward = [inspect.unwrap(f).__code__ for f in (jax.linearize, jax.jvp)]
    forward.append(jax.jacfwd(abs).__code__)  # the function it returns (unwrapped: abs)
    return {**dict.fromkeys(forward, True), inspect.unwrap(jax.vjp).__code__: False}


def backward_rule(bwd: Any) -> Any:  # the custom_vjp rule custom_lin's bwd wraps (None: unknown)
    return getattr(bwd, "f", None) if INTERNALS["linearizing"] else None


def transpose_rule(bwd: Any) -> tuple[Any, Any]:
    """The custom_vjp rule a custom_vjp_call's ``bwd`` wraps, and which of its outputs the
    call keeps where JAX's dead-code elimination wrapped it (``None``: all; rule ``None``:
    unknown)."""
    rule, used = backward_rule(bwd), None
    if rule is not None and rule.__name__ == "dce_bwd" and rule.__closure__:
        cells = dict(zip(rule.__code__.co_freevars, rule.__closure__, strict=True))
        if "bwd" in cells and "used_outs" in cells:
            rule = backward_rule(cells["bwd"].cell_contents)
            used = tuple(cells["used_outs"].cell_contents)
    return rule, used


# -- 5c. the shape constraints a program checks, read from its shape assertions -------------
# Why: jax.export serializes no constraints (b >= 2): the module checks them, each by a
# shape_assertion whose message names it; a manifest that drops one is refused at load. Internal:
# that message's wording. Fallback: ``None`` (unknown): the program refuses a call breaking one.
def constraint_named(message: str) -> str | None:
    """The constraint a shape assertion's (or its failure's) message names (``None``: none)."""
    found = INTERNALS["constraints"] and re.search(r"shape constraint (.+?)\. Expected", message)
    return found.group(1) if found else None


# -- 5d. a transpose rule for a primitive of JAX's (custom_vjp_call), where JAX has none ------
# Why: jax.linear_transpose of a loaded model's VJP (jaxopt's default implicit differentiation)
# transposes its custom_vjp_call, which JAX cannot. Internal: jax.interpreters.ad's table of
# transpose rules. Fallback: none added: JAX's NotImplementedError, as for any custom_vjp.
def add_transpose(primitive: Any, rule: Callable[..., Any]) -> bool:
    """Gives ``primitive`` the transpose ``rule`` where it has none, or ours (this library's:
    an earlier one); returns whether ``rule`` is now its rule. A rule JAX has (a later JAX's:
    the primitive is JAX's, not ours) is kept, never replaced."""
    from jax.interpreters import ad

    have = ad.primitive_transposes.get(primitive)
    ours = have is None or (getattr(have, "__module__", None) or "").startswith("symjax_mlp.")
    if INTERNALS["transposes"] and ours:
        ad.primitive_transposes[primitive] = rule
    return ad.primitive_transposes.get(primitive) is rule


# -- 5e. a loaded model's error where JAX refuses forward mode of a custom_vjp (custom_lin) ---
# Why: after a jax.grad, jax.jvp or linearize of jax.jit(m) reuses its trace: custom_lin's rules
# raise JAX's TypeError; wrapped (impl, batching, lowering), never replaced: another custom_vjp
# runs them as before. Internal: their tables (mlir._lowerings). Fallback: JAX's TypeError there.
def wrap_refusal(primitive: Any, refusal: Callable[[dict[str, Any]], Any]) -> None:
    """Has each rule ``primitive`` has raise ``refusal(params)`` first (once: ours are kept)."""
    from jax.interpreters import batching, mlir

    def wrap(r: Any) -> Any:
        return r if getattr(r, "func", None) is _refuse else functools.partial(_refuse, r, refusal)

    if "impl" in vars(primitive):  # else Primitive's NotImplementedError
        primitive.def_impl(wrap(primitive.impl))
    if primitive in (batchers := batching.fancy_primitive_batchers):
        batchers[primitive] = wrap(batchers[primitive])
    if lowering := mlir._lowerings.get(primitive):  # cacheable or not, as JAX has it
        mlir.register_lowering(primitive, wrap(lowering.rule), inline=lowering.inline)


def _refuse(rule: Any, refusal: Any, *args: Any, **params: Any) -> Any:
    if INTERNALS["refusals"] and (error := refusal(params)):
        raise error()
    return rule(*args, **params)


# -- 6. whether the GIL is on ----------------------------------------------------------------
# Why: the batcher reads a future's state without a lock where the GIL makes it atomic, one
# acquire fewer per request. Internal: sys._is_gil_enabled (CPython 3.13+; before, the GIL is
# always on). Fallback: ``False``: every such read takes the lock (right on any build).
def gil_enabled() -> bool:
    """Whether the GIL is on (``False`` when unknown: take the locks)."""
    check = getattr(sys, "_is_gil_enabled", lambda: True)
    return INTERNALS["gil"] and bool(check())


GIL = gil_enabled()  #: :func:`gil_enabled` at import, read on hot paths


# -- 7. futures settled a batch at a time ----------------------------------------------------
# Why: CPython's Future makes a Condition (an RLock) each; a batch's futures share one lock, are
# settled under one acquire, and wake only the callers blocked on them. Internal: Future's
# fields (_state, _result, _exception, _condition, _waiters, _done_callbacks,
# _invoke_callbacks) and concurrent.futures._base's states. Fallback: plain Futures.
try:
    from concurrent.futures import _base

    PENDING, RUNNING, FINISHED = _base.PENDING, _base.RUNNING, _base.FINISHED
    CANCELLED, CANCELLED_AND_NOTIFIED = _base.CANCELLED, _base.CANCELLED_AND_NOTIFIED
    _FUTURE_STATES = True
except (ImportError, AttributeError):  # pragma: no cover - another Python's layout
    CANCELLED = CANCELLED_AND_NOTIFIED = FINISHED = PENDING = RUNNING = ""
    _FUTURE_STATES = False
_DONE = frozenset((CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED))


class SharedLockFuture(concurrent.futures.Future):
    """A ``concurrent.futures.Future`` (for ``wait``, ``as_completed``, ``asyncio``) whose lock
    is shared by a batch's futures, started and settled with :func:`start_future`,
    :func:`finish_futures` and :func:`after_finish`; a plain Future with the internal off."""

    # The fields Future's methods read, as class defaults: a request sets only what changes.
    _state = PENDING
    _result: Any = None
    _exception: BaseException | None = None
    _wake: threading.Condition | None = None  # made when a caller first blocks on it
    _shared = False  # settled under the shared lock, by the internals

    def __init__(self, condition: threading.Condition | None = None) -> None:
        if not (_FUTURE_STATES and INTERNALS["futures"]):
            super().__init__()
            return
        # no super().__init__(): it would make a Condition (an RLock) per request
        self._shared = True
        self._condition = threading.Condition() if condition is None else condition
        self._waiters: list[Any] = []  # concurrent.futures.wait()'s
        self._done_callbacks: list[Callable[[Any], Any]] = []

    def _wait(self, timeout: float | None) -> None:
        """Waits (at most ``timeout`` s) until it finished; raises if cancelled or timed out."""
        state = self._state
        if not (GIL and state in _DONE):  # else settled: _result and _exception were set first
            with self._condition:
                if self._state not in _DONE:
                    if self._wake is None:
                        self._wake = threading.Condition(self._condition)
                    self._wake.wait_for(lambda: self._state in _DONE, timeout)
                state = self._state
        if state != FINISHED:
            raise concurrent.futures.CancelledError() if state in _DONE else TimeoutError()

    def result(self, timeout: float | None = None) -> Any:
        if not self._shared:
            return super().result(timeout)
        self._wait(timeout)
        if self._exception is not None:
            try:
                raise self._exception
            finally:
                self = None  # as concurrent.futures does: no reference cycle
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._shared:
            return super().exception(timeout)
        self._wait(timeout)
        return self._exception

    def cancel(self) -> bool:
        if not self._shared:
            return super().cancel()
        with self._condition:
            if self._state != PENDING:
                return self._state in (CANCELLED, CANCELLED_AND_NOTIFIED)
            self._state = CANCELLED
            if self._wake is not None:
                self._wake.notify_all()
        self._invoke_callbacks()
        return True

    def set_result(self, result: Any) -> None:
        if not self._shared:
            return super().set_result(result)
        self._settle(result, None)

    def set_exception(self, exception: BaseException | None) -> None:
        if not self._shared:
            return super().set_exception(exception)
        self._settle(None, exception)

    def _settle(self, result: Any, exception: BaseException | None) -> None:
        with self._condition:
            if self._state in _DONE:
                raise concurrent.futures.InvalidStateError(f"{self._state}: {self!r}")
            _finish(self, result, exception)
        self._invoke_callbacks()


def start_future(f: SharedLockFuture) -> bool:
    """``set_running_or_notify_cancel()`` (a shared future's lock held): ``False`` if cancelled."""
    if not f._shared:
        return f.set_running_or_notify_cancel()
    if f._state != PENDING:  # cancelled while queued
        if f._state == CANCELLED:
            f._state = CANCELLED_AND_NOTIFIED
            for w in f._waiters:
                w.add_cancelled(f)
        return False
    f._state = RUNNING
    return True


def finish_futures(
    futures: list[SharedLockFuture], results: list[Any] | None, error: BaseException | None
) -> None:
    """Settles the shared ones of started ``futures`` (their lock held), each with its result
    or all with ``error``; then call :func:`after_finish`, outside the lock."""
    for i, f in enumerate(futures):
        if f._shared:
            _finish(f, None if error is not None else results[i], error)


_FUTURES_LOG = logging.getLogger("concurrent.futures")  # where Future logs its callbacks'


def after_finish(
    futures: list[SharedLockFuture], results: list[Any] | None, error: BaseException | None
) -> None:
    """Outside the lock: the shared futures' done callbacks, the others settled one by one. A
    callback that raises (a ``BaseException`` too, which ``Future`` lets out) is logged: the
    batch's other callbacks and futures still run and settle."""
    for i, f in enumerate(futures):
        try:
            if f._shared:
                if f._done_callbacks:
                    _invoke_callbacks(f)
            elif error is None:
                f.set_result(results[i])
            else:
                f.set_exception(error)
        except BaseException:
            _FUTURES_LOG.exception("exception calling callback for %r", f)


def _invoke_callbacks(f: SharedLockFuture) -> None:
    for callback in f._done_callbacks:
        try:
            callback(f)
        except BaseException:
            _FUTURES_LOG.exception("exception calling callback for %r", f)


def _finish(f: SharedLockFuture, result: Any, exception: BaseException | None) -> None:
    """Settles a shared ``f`` (its lock is held); the caller then runs its done callbacks."""
    f._result, f._exception, f._state = result, exception, FINISHED
    for w in f._waiters:
        (w.add_result if exception is None else w.add_exception)(f)
    if f._wake is not None:
        f._wake.notify_all()
