"""Timing your own model against its floor: the same program, AOT-compiled and called bare.

Each of the model and its floor is timed *synced* (every call waited for) and *pipelined* (one
wait per repeat); after a warm-up the four rows take turns, the order rotating each repeat."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from symjax_mlp._artifact.format import JAXEXPORT, caller, printable, program_file
from symjax_mlp._artifact.signature import sizes_at
from symjax_mlp._errors import ArtifactError, ConfigError, SignatureError, as_int, refuse_keywords
from symjax_mlp._hybrid.args import partition
from symjax_mlp._npy import draw
from symjax_mlp._reader import read_regular

_ROWS = ("synced", "pipelined", "compiled_synced", "compiled_pipelined")
_ARRAYS = (np.ndarray, np.generic, jax.Array)  # placed on the device; the rest are settings


def _is_array(a: Any) -> bool:
    """Placed on the device: an array or a NumPy number; a ``np.str_`` is a str, a setting."""
    return isinstance(a, _ARRAYS) and not isinstance(a, str | bytes)


_STATIC = (
    "timeit({call}, batch={batch}): the artifact has static shapes, "
    "({types}), so batch sizes nothing and it would time those shapes, not batch {batch}. Drop "
    "batch, or export with a symbolic batch: sm.export(h, path, example=x, batch='b')."
)
#: the heading of a refusal of inputs drawn at a batch (Signature.check's), and its fix
_DRAWN = "timeit({call}, batch={batch}): the inputs drawn at batch {batch} do not fit the artifact"
_DRAWN_FIX = "Pass a batch it accepts, or the inputs: timeit(model, x, ...)."
_TOO_LARGE = (  # no batch the caller passes is smaller
    "timeit({call}): its input {spec.path}, {spec.dtype}{shape} at the smallest batch its "
    "signature admits, is more than this process can hold in memory. That is no model's row: "
    "check what the artifact declares (its manifest's signature), or time it where it fits."
)
MAX_DRAWN = 2**24  # values per row of the batch timeit draws for an artifact: 64 MiB of float32
_TOO_MANY = (  # what its signature sizes, which a stranger writes: seconds to draw, hours to time
    "timeit({call}): the inputs it would draw for {sig} at batch {batch} hold {values:,} values "
    "(input {spec.path} the most: {spec.dtype}{shape}), more than the {cap:,} per row of the "
    "batch that timeit draws. That is no model's row: check what the artifact declares "
    "(symjax-mlp inspect), or pass inputs of your own: timeit(model, x)."
)
_BATCH_OF_ARGS = (
    "timeit({name}, *args, batch={batch}): batch sizes the inputs drawn for an artifact, and "
    "you passed the inputs, which are timed at their own shapes. Drop batch, or pass inputs "
    "of the batch you mean."
)
_JIT = "the same function, jax.jit(f).lower(...).compile(), called bare"
_JIT_STATE = _JIT + ", its state in and the new state out as the model's call"
_IREE = "the same IREE module, its runtime's call without LoadedModel's checks"


@dataclasses.dataclass(frozen=True)
class CallTiming:
    """Seconds per call of a model and of its AOT-compiled floor, one figure per repeat (read
    the min for the cost, the median for the noise).

    Attributes:
      name: what was timed (the Hybrid's name, or the artifact's path).
      calls: calls per repeat.
      dispatch: JAX's CPU dispatch, ``"async"`` (JAX's default) or ``"sync"``
        (:func:`symjax_mlp.serving.latency_mode`): it decides what a synced call costs.
      synced, pipelined: the model, every call waited for, or one wait per repeat.
      compiled_synced, compiled_pipelined: the same for the floor.
      floor: what the floor is, in words (:func:`timeit` says which).

    Example:
      >>> t = CallTiming("h", 10, "async", (2e-6,), (1e-6,), (1e-6,), (1e-6,))
      >>> t.min("synced"), t.over_compiled("synced")
      (2e-06, 2.0)
    """

    name: str
    calls: int
    dispatch: str
    synced: tuple[float, ...]
    pipelined: tuple[float, ...]
    compiled_synced: tuple[float, ...]
    compiled_pipelined: tuple[float, ...]
    floor: str = _JIT

    def _row(self, method: str, row: str, rows: tuple[str, ...] = _ROWS) -> tuple[float, ...]:
        if row not in rows:
            raise ConfigError(f"CallTiming.{method}({row!r}): the rows are {', '.join(rows)}.")
        return getattr(self, row)

    def min(self, row: str = "synced") -> float:
        """The fastest repeat's seconds per call of ``row``: the best estimate under noise."""
        return min(self._row("min", row))

    def median(self, row: str = "synced") -> float:
        """The median repeat's seconds per call of ``row``."""
        return statistics.median(self._row("median", row))

    def over_compiled(self, mode: str = "synced") -> float:
        """The model's min over the floor's in ``mode``, ``"synced"`` or ``"pipelined"``: 1.0 is
        no cost."""
        return min(self._row("over_compiled", mode, _ROWS[:2])) / self.min(f"compiled_{mode}")

    def to_dict(self) -> dict[str, Any]:
        """Every figure as JSON data: per row, its times, min and median (seconds per call)."""
        head = {"name": self.name, "calls": self.calls, "repeats": len(self.synced),
                "dispatch": self.dispatch, "floor": self.floor}  # fmt: skip
        rows = {row: {"times_s": list(getattr(self, row)), "min_s": self.min(row),
                      "median_s": self.median(row)} for row in _ROWS}  # fmt: skip
        return {**head, **rows, "over_compiled": {m: self.over_compiled(m) for m in _ROWS[:2]}}

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # a notebook shows the table, as print
        p.text(str(self))

    def __str__(self) -> str:
        lines = [
            f"{printable(self.name)}: {self.calls} calls x {len(self.synced)} repeats, per call, "
            f"JAX {self.dispatch} dispatch",
            f"{'':<22}{'min':>10}{'median':>10}{'min / compiled':>16}",
        ]
        for mode in ("synced", "pipelined"):
            for row, label in ((mode, f"model, {mode}"), (f"compiled_{mode}", f"compiled, {mode}")):
                ratio = f"{self.over_compiled(mode):>15.3f}x" if row == mode else ""
                low, mid = _seconds(self.min(row)), _seconds(self.median(row))
                lines.append(f"{label:<22}{low:>10}{mid:>10}{ratio}")
        lines.append(f"(compiled: {self.floor})")
        return "\n".join(lines)


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} µs"


def _hybrid_floor(h: Any, kwargs: Any, args: tuple[Any, ...]) -> Callable[[], Any]:
    """``jax.jit`` of ``h``'s pure function, AOT-compiled (a stateful one's returns its state)."""
    if h.mesh is not None:
        raise ConfigError(
            f"timeit({h.name}): the Hybrid runs sharded over a mesh; time it unsharded "
            "(h.replace(mesh=None)), whose floor is one device's program."
        )
    given, tree = jax.tree.flatten((args, kwargs))  # arrays by keyword are inputs too

    def flat(params: Any, state: Any, arrays: list[Any]) -> Any:  # Python settings closed over
        placed = iter(arrays)
        leaves = [next(placed) if _is_array(leaf) else leaf for leaf in given]
        inputs, kw = jax.tree.unflatten(tree, leaves)
        if not h.stateful:
            return h.fn(params, *inputs, **kw)
        return h.fn_with_state(params, state, *inputs, **kw)  # h.fn drops the new state

    arrays = [leaf for leaf in given if _is_array(leaf)]
    return _compiled(flat, h.params, [h.state, arrays], h.params_as_constants)  # state: an input


def _loaded_floor(m: Any, inputs: list[Any]) -> Callable[[], Any]:
    """The program the load checked, on the checked and placed ``inputs``."""
    if m.manifest.get("nr_devices", 1) != 1:
        raise ConfigError(
            f'timeit(symjax_mlp.load("{m.path}")): the artifact runs sharded over '
            f"{m.manifest['nr_devices']} devices; time an artifact exported for one device."
        )
    if m.runtime != "jax":  # its runtime's own call: a JAX program is no floor of IREE's
        run, single = m.runner, m.signature.output_kind == "array"
        return (lambda: run(inputs)[0]) if single else (lambda: tuple(run(inputs)))
    file = program_file(m.manifest, JAXEXPORT)
    size, digest = (m.manifest["files"][file][k] for k in ("bytes", "sha256"))
    data = read_regular(m.path / file, size=size, sha256=digest, error=ArtifactError)
    weights = {name: jax.device_put(a) for name, a in m.params.items()}
    return _compiled(jax.export.deserialize(data).call, weights, inputs, m.params_as_constants)


def _compiled(fn: Any, weights: Any, args: list[Any], constants: bool) -> Callable[[], Any]:
    """``fn(weights, *args)`` AOT-compiled and called bare (``constants``: the weights closed
    over, XLA constants, as the model holds them)."""
    args = list(args) if constants else [weights, *args]
    compiled = jax.jit((lambda *a: fn(weights, *a)) if constants else fn).lower(*args).compile()
    return lambda: compiled(*args)


def _inputs(m: Any, given: tuple[Any, ...], batch: int) -> tuple[Any, ...]:
    """``given``, or inputs drawn for the artifact's signature at ``batch`` as its constraints
    admit, checked as it takes them; drawn ones out of its bounds are the batch's fault."""
    call = caller(m.path, m.manifest)  # symjax_mlp.load("path"), with its entry point
    if given:
        return tuple(m.signature.check(given, caller=f"timeit({call})"))
    rng, inputs, specs = np.random.default_rng(0), [], m.signature.inputs
    if batch != 1 and not any(isinstance(d, str) for s in specs for d in s.shape):
        raise ConfigError(_STATIC.format(call=call, batch=batch, types=", ".join(map(str, specs))))
    drawn = _DRAWN.format(call=call, batch=batch)
    if (sizes := sizes_at(m.signature, batch)) is None:
        reason = f"it takes {m.signature}, whose constraints refuse batch {batch}."
        raise SignatureError(f"{drawn}: {reason} {_DRAWN_FIX}")
    shapes = [tuple(sizes[d] if isinstance(d, str) else d for d in s.shape) for s in specs]
    if (values := sum(map(math.prod, shapes))) > MAX_DRAWN * batch:  # a stranger's manifest's
        big = max(range(len(specs)), key=lambda i: math.prod(shapes[i]))
        raise ConfigError(_TOO_MANY.format(
            call=call, batch=batch, sig=m.signature, values=values, cap=MAX_DRAWN,
            spec=specs[big], shape=list(shapes[big])))  # fmt: skip
    for spec, shape in zip(specs, shapes, strict=True):
        try:
            inputs.append(draw(rng, shape, spec.dtype))
        except TypeError:
            raise ConfigError(
                f"timeit({call}): its input {spec.path} is a {spec.dtype}, "
                "for which no input is drawn; pass the inputs: timeit(model, x, ...)."
            ) from None
        except (MemoryError, ValueError):  # ValueError: more bytes than an array may have
            if batch > 1 and any(isinstance(d, str) for d in spec.shape):
                raise ConfigError(
                    f"timeit({call}, batch={batch}): its input {spec.path} "
                    f"at that batch, {spec.dtype}{list(shape)}, is more than this process can "
                    "hold in memory; pass a smaller batch."
                ) from None
            raise ConfigError(_TOO_LARGE.format(call=call, spec=spec, shape=list(shape))) from None
    try:  # its refusal headed as drawn at the batch, then the batch's fix
        return tuple(m.signature.check(inputs, caller=drawn))
    except SignatureError as e:
        raise SignatureError(f"{e} {_DRAWN_FIX}") from None


def _loop(fn: Callable[[], Any], calls: int, pipelined: bool) -> float:
    sync, out, t0 = jax.block_until_ready, None, time.perf_counter()
    for _ in range(calls):
        out = fn() if pipelined else sync(fn())
    if pipelined:
        sync(out)
    return (time.perf_counter() - t0) / calls


def timeit(
    model: Any,
    *args: Any,
    batch: int = 1,
    calls: int = 1000,
    repeats: int = 7,
    warmup: int = 50,
    kwargs: Mapping[str, Any] | None = None,
    **keywords: Any,
) -> CallTiming:
    """Times ``model(*args)`` against its floor: the same function, AOT-compiled, called bare.

    The floor of a Hybrid is ``jax.jit`` of its ``fn`` (a stateful one's takes the state and
    returns the new one, as its call does); of a LoadedModel, the program it loaded, run in JAX,
    or its IREE module called without the model's checks. The inputs are placed on the device
    first (the call is timed, not the copy); a stateful Hybrid is timed on a copy of its state.

    Args:
      model: a Hybrid (unsharded) or a LoadedModel (of one device).
      *args: the inputs, as you would call ``model``; a LoadedModel's may be left out, to be
        drawn for its signature (normal floats, integers 0 or 1, random bools, PRNG keys).
      batch: the batch of drawn inputs, where the artifact has a symbolic dimension; its other
        ones are ``batch`` too, or as its constraints set or bound them (``t == 2*b``).
      calls: calls per repeat.
      repeats: repeats of each row (5 or more give a min and a median worth reading).
      warmup: untimed calls of each row first (at least one: the first call compiles).
      kwargs: a Hybrid's keyword arguments (``{"train": False}``); the floor closes over them.
      **keywords: none: ``timeit(h, x, train=False)`` is refused, naming ``kwargs=``.

    Returns:
      A :class:`CallTiming`; ``print()`` it for a table.

    Raises:
      ConfigError: a count below 1, a sharded model, neither a Hybrid nor a LoadedModel, no
        inputs for a Hybrid, a ``batch`` that sizes nothing, or kwargs for a LoadedModel; a
        model's keyword passed as timeit's own; inputs to draw of more than ``MAX_DRAWN``
        values per row of the batch (what a stranger's signature may ask).
      SignatureError: ``args`` do not fit the artifact's signature.

    Example:
      >>> import jax, jax.numpy as jnp, symjax_mlp as sm
      >>> net, x = sm.mlp((8, 2)), jnp.ones((1, 4))
      >>> h = sm.hybridize(net, net.init(jax.random.key(0), x))
      >>> t = sm.timeit(h, x, calls=10, repeats=3)
      >>> len(t.synced), t.calls, t.over_compiled() > 0
      (3, 10, True)
    """
    from symjax_mlp._hybrid.hybrid import Hybrid
    from symjax_mlp._loaded import LoadedModel
    from symjax_mlp.serving import dispatch_mode

    calls, repeats, warmup, batch = counts = [as_int(n) for n in (calls, repeats, warmup, batch)]
    if any(not isinstance(n, int) or isinstance(n, bool) for n in counts) or min(counts) < 1:
        raise ConfigError(
            f"timeit: calls, repeats, warmup and batch must be >= 1; got calls={calls!r}, "
            f"repeats={repeats!r}, warmup={warmup!r}, batch={batch!r}; each is an int."
        )
    if not isinstance(model, Hybrid | LoadedModel):
        raise ConfigError(
            f"timeit: got a {type(model).__name__}; it times a Hybrid (sm.hybridize(...)) or a "
            "LoadedModel (sm.load(path)). For any other function, wrap it: "
            "sm.hybridize(lambda params, x: f(x), {})."
        )
    name = model.name if not (loaded := isinstance(model, LoadedModel)) else str(model.path)
    if loaded and model.entry != model.entries[0]:  # m["embed"]: named so
        name = f"{model.path}[{model.entry!r}]"
    if args and batch != 1:
        raise ConfigError(_BATCH_OF_ARGS.format(name=name, batch=batch))
    refuse_keywords(f"timeit({name}", keywords, "timeit(model, x")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ConfigError(
            f"timeit({name}, kwargs={kwargs!r}): kwargs are the model's keyword arguments, a "
            "dict by name, e.g. kwargs={'train': False}."
        )
    if kwargs and loaded:  # its settings were baked at export
        raise ConfigError(
            f"timeit({name}, kwargs={{{', '.join(map(repr, kwargs))}: ...}}): a loaded artifact "
            "takes no keyword arguments; its settings were fixed at export "
            "(sm.export(h, path, example=x, kwargs={...})). Drop kwargs."
        )
    if loaded:
        args = _inputs(model, args, batch)
    elif not args and not any(map(_is_array, jax.tree.leaves(dict(kwargs)))):
        raise ConfigError(f"timeit({name}): pass the inputs to time it on: timeit(h, x).")
    else:  # refused as its call refuses them (a str array), before device_put meets them
        nums, names = model.static_argnums, model.static_argnames
        partition(args, dict(kwargs), nums, names, caller=f"timeit({name})", own=(model,))
    stateful = not loaded and model.stateful  # timed on a copy: its own state stays as it was
    timed = model.replace(state=model.state) if stateful else model
    said = _JIT_STATE if stateful else _IREE if loaded and model.runtime != "jax" else _JIT
    put = lambda a: jax.device_put(a) if _is_array(a) else a  # noqa: E731
    placed, kwargs = jax.tree.map(put, (args, dict(kwargs)))
    call = lambda: timed(*placed, **kwargs)  # noqa: E731
    _loop(call, warmup, pipelined=False)  # inputs it refuses: refused as its calls do
    floor = _loaded_floor(model, list(placed)) if loaded else _hybrid_floor(model, kwargs, placed)
    _loop(floor, warmup, pipelined=False)
    order = [(fn, piped) for piped in (False, True) for fn in (call, floor)]  # synced first
    seconds: dict[Any, list[float]] = {turn: [] for turn in order}
    for r in range(repeats):  # the order rotating each repeat
        for fn, piped in order[r % 4 :] + order[: r % 4]:
            seconds[fn, piped].append(_loop(fn, calls, piped))
    times = (tuple(seconds[fn, piped]) for fn in (call, floor) for piped in (False, True))
    return CallTiming(name, calls, dispatch_mode(), *times, floor=said)
