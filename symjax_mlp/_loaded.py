"""A loaded artifact: :class:`LoadedModel`, the callable :func:`~symjax_mlp.load` returns. A
call checks its inputs once per (shape, dtype) and runs what a runtime prepared."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import jax
import numpy as np

from symjax_mlp._artifact.format import (
    JAXEXPORT,
    caller,
    entry_names,
    entry_point,
    printable,
    program_file,
)
from symjax_mlp._artifact.reading import check_x64, thaw
from symjax_mlp._artifact.signature import Signature, as_array, is_array
from symjax_mlp._artifact.weights import param_paths
from symjax_mlp._errors import (
    ArtifactError,
    ConfigError,
    EntryPointError,
    NoPickle,
    PositionalInputsError,
    SignatureError,
    SymjaxError,
)
from symjax_mlp._export_options import shown
from symjax_mlp._hybrid.params import unflattenable
from symjax_mlp._hybrid.trace import TRACER_ERRORS
from symjax_mlp._npy import weak_refusal, weakly_typed
from symjax_mlp._runtimes.transforms import axes, forward_mode, forward_traced
from symjax_mlp._selftest import run_failed
from symjax_mlp._specs import array_types

_ARRAYS = array_types()


_NOT_APART = (
    "If it is one example (jax.vmap passes each without its batch dimension), this artifact "
    "takes none: its rows are not known to stay apart ({why}). Give it a batch of one: "
    "m(x[None])[0], under jax.vmap: jax.vmap(lambda x: m(x[None])[0])."
)


_NAN = (
    "{caller}: its output holds a NaN or an inf, found by jax_debug_nans / jax_debug_infs. An "
    "artifact is one compiled program, with no line of your model to point at: call the Hybrid "
    "it was exported from under the same flag (h(x) raises at your model's line)."
)


_OTHER_FIELDS = (
    "{caller}.apply(params, ...): params hold {given}, a static field (not traced: jit bakes it "
    "into the program), and the artifact's program was traced at {traced}. Export again from "
    "params that hold it (sm.export(sm.hybridize(fn, params), ...)), or pass the params the "
    "artifact was exported from by their paths (m.params). A lambda or a function made in a "
    "function is refused whichever it is: the manifest names all such alike."
)


class LoadedModel(NoPickle):
    """An artifact ready to call: checked, deserialized (JAX) or compiled (IREE).

    ``m(x)`` checks every input, by position, against :attr:`signature` (``SignatureError``,
    also for inputs passed by name) and runs the program with the artifact's params:
    ``jax.Array`` out (IREE: NumPy). It is never pickled: load it by path. A program failing at
    the call raises ``ArtifactError`` with JAX's error as ``__cause__``; one failing as it runs
    surfaces where the result is waited for: ``jax.block_until_ready(m(x))`` before
    ``np.asarray(y)``, which aborts on a failed result.

    Under the JAX runtime ``m`` is a JAX function (``jax.jit``, ``lax.map``/``scan``, a
    Hybrid); ``jax.grad`` needs ``export(..., vjp_order=1)``; forward mode (``jax.jvp``,
    ``jacfwd``, ``hessian``, ``linearize``) raises ``ConfigError``, of a jitted ``m`` too.
    ``jax.vmap(m)`` merges the mapped axis into the batch where rows stay apart
    (``manifest["rows"]``, checked against the program), and then ``m`` also takes one
    example; else it runs ``m`` once per example. ``m["embed"]`` is another entry point, over
    the same weights, checked alike on first use. ``m.apply(params, *inputs)`` runs it over
    other weights, for ``jax.vmap`` over an ensemble's and ``jax.grad`` with respect to them.

    Attributes:
      path: the artifact directory.
      manifest: the manifest as this entry point sees it (its signature, params, program
        files), read-only.
      signature: what the model takes and returns, symbolic dims by name.
      runtime: ``"jax"`` or ``"iree"``.
      entry: the name of this entry point.
      params_as_constants: whether its programs hold the weights as constants (``load``).
      allowed: what ``load(allow=...)`` let its programs hold past the default op check (a
        frozenset of its keys, e.g. ``{"while"}``), or ``None`` where nothing was checked
        (``trust=True``).
    """

    allowed: frozenset[str] | None = None

    def __init__(
        self, path: Path, manifest: Any, runtime: str, params: dict[str, Any],
        run: Callable[[list[Any]], list[Any]], opener: Any,  # _load's _Opener
    ) -> None:  # fmt: skip
        self.path, self.manifest = path, manifest
        self.signature = Signature.from_json(manifest["signature"])
        self.runtime, self.entry = runtime, entry_point(manifest)
        self._params, self._run, self._opener = params, run, opener
        self._file = printable(str(path / program_file(manifest, JAXEXPORT)))
        self._caller = caller(path, manifest)
        self._single_output = self.signature.output_kind == "array"
        self._checked: set[tuple[Any, ...]] = set()
        # the program itself, for arrays of a (shape, dtype) that ran through every check before
        direct, single = getattr(run, "direct", (None, None))
        self._direct = direct if single == self._single_output else None
        self._ready: set[tuple[Any, ...]] = set()  # their (shape, dtype)s
        self._cap = 256  # how many each holds (the weak type: _Typed's to check, before them)
        strong, ins = self.signature.strong, self.signature.inputs
        self._typed = [(i, s) for i, s in enumerate(ins) if s.weak_type or s.path in strong]

    def __new__(cls, path: Path, manifest: Any, *args: Any) -> LoadedModel:
        """A :class:`_Typed` where the weak type of an input changes the model's dtypes: only
        such artifacts' calls check it, chosen here, at load."""
        sig = manifest["signature"]
        typed = sig.get("strong") or any(s.get("weak_type") for s in sig["inputs"])
        return super().__new__(_Typed if typed and cls is LoadedModel else cls)

    _INSTEAD = "Pass its path, and load it where it runs: sm.load(m.path)."

    def __deepcopy__(self, memo: dict[int, Any]) -> LoadedModel:
        """A copy sharing the weights, which no call changes (``params`` is read-only)."""
        return self.__copy__()

    @property
    def metadata(self) -> dict[str, Any]:
        """The artifact's model card (``export(..., metadata=...)``), as JSON data."""
        return thaw(self.manifest.get("metadata", {}))

    @property
    def entries(self) -> tuple[str, ...]:
        """The artifact's entry points, the default first."""
        return entry_names(self.manifest)

    def __getitem__(self, name: str) -> LoadedModel:
        """The entry point ``name`` of the same artifact, over the same weights."""
        if name == self.entry:
            return self
        if name not in self.entries:
            raise EntryPointError(
                f'symjax_mlp.load("{printable(str(self.path))}") has no entry point '
                f"{printable(repr(name))}; it has {', '.join(self.entries)}."
            )
        return self._opener.open(name)

    @property
    def runner(self) -> Callable[[list[Any]], list[Any]]:
        """The runtime's call, ``runner([x, ...]) -> [out, ...]``, that ``m(x)`` makes once its
        inputs pass the checks, unchecked (what :func:`~symjax_mlp.timeit` takes as the floor)."""
        return self._run

    @property
    def params(self) -> dict[str, np.ndarray]:
        """The weights in use, ``{"params/layers_0/kernel": array, ...}`` (read-only arrays)."""
        views = {k: np.asarray(v).view() for k, v in self._params.items()}
        for view in views.values():
            view.flags.writeable = False
        return views

    def apply(self, params: Any, *inputs: jax.typing.ArrayLike) -> Any:
        """The program over ``params``, of :attr:`params`' names, shapes and dtypes, as
        ``m(*inputs)`` runs it over its own: a pure function of both, as ``h.apply`` is, for
        ``jax.vmap`` over stacked weights (an ensemble) and ``jax.grad`` with respect to them
        (needs ``export(..., vjp_order=1)``). JAX runtime, one device, weights not constants."""
        program = getattr(self._run, "program", None)
        if program is None:
            raise ConfigError(
                f"{self._caller}: m.apply runs the program over other weights, and this load "
                "cannot pass them (IREE, params_as_constants=True, or sharded over devices). "
                "Load it with runtime='jax' on one device, without params_as_constants."
            )
        own, given = self._params, params
        if not isinstance(params, Mapping) or set(params) != set(own):
            params = _by_path(params, self._caller)  # the tree of those paths, as h.params holds
        if params is None or set(params) != set(own):
            raise SignatureError(self._unlike(own, given, params))
        traced = self.manifest.get("static", {})  # a tree's static fields: as export traced them
        walk = params is not given and any(k.startswith("params") for k in traced)
        fields = {k: v for k, v in shown((), given).items() if k in traced} if walk else {}
        vague = ("<lambda>", "<locals>")  # named alike, whichever it is: never told apart
        if other := {k: v for k, v in fields.items() if traced[k] != v or any(map(v.count, vague))}:
            raise SignatureError(_OTHER_FIELDS.format(
                caller=self._caller, given=", ".join(f"{k}={v}" for k, v in other.items())[:400],
                traced=", ".join(f"{k}={traced[k]}" for k in other)[:400]))  # fmt: skip
        numbers = (bool, int, float, complex)  # Python's, as h.params may hold (gymnax's EnvParams)
        params = {n: jax.numpy.asarray(p) if type(p) in numbers else p for n, p in params.items()}
        for name, w in own.items():
            p = params[name]
            if not is_array(p):  # its .shape, .dtype or __array__ would be its own code's word
                raise SignatureError(
                    f"{self._caller}.apply(params, ...): params[{name!r}] is a "
                    f"{printable(type(p).__name__)[:80]}, not an array. Pass NumPy or JAX arrays "
                    "as m.params holds them."
                )
            shape, dtype = tuple(p.shape), p.dtype
            if shape != w.shape or dtype != w.dtype:
                raise SignatureError(
                    f"{self._caller}.apply(params, ...): params[{name!r}] is "
                    f"{dtype}{list(shape)}, the artifact's is {w.dtype}{list(w.shape)}. Pass "
                    f"arrays as m.params holds them (under jax.vmap, one set per call)."
                )
        inputs = self.signature.check(inputs, caller=self._caller)
        try:
            outs = program(dict(params), *inputs)
        except Exception as e:  # the program failed: XLA raised
            self._fail(e, inputs)
        return outs if self._single_output else tuple(outs)

    def __call__(self, *inputs: jax.typing.ArrayLike, **named: Any) -> Any:
        # hot path: concrete arrays of a (shape, dtype) that passed every check before go
        # straight to the program
        key = None
        if self._direct is not None and not named:
            key = tuple([(x.shape, x.dtype) if type(x) in _ARRAYS else None for x in inputs])
            if key in self._ready:
                try:
                    out = self._direct(*inputs)
                except Exception as e:  # the program failed: XLA raised
                    self._fail(e, inputs)
                return out if self._single_output else tuple(out)
        if named:  # Python's TypeError would name neither the inputs nor how to pass them
            raise PositionalInputsError(self._by_name(named, len(inputs)))
        if forward_traced(inputs):  # else JAX's TypeError, where jax.jit lowers it (if at all)
            raise ConfigError(forward_mode(self._caller, self.manifest.get("vjp_order", 0)))
        try:
            outs = self._outputs(inputs)
            if key is not None and None not in key and len(self._ready) < self._cap:
                self._ready.add(key)
        except SignatureError as wrong:  # one example (jax.vmap(m) per example) or wrong
            axes = self._example_axes(inputs)
            if axes is None:
                raise
            if isinstance(axes, str):  # one example, which this artifact cannot take
                raise SignatureError(f"{wrong} {_NOT_APART.format(why=axes)}") from None
            specs = self.signature.inputs  # a list of numbers as a batch takes it (float32)
            inputs = [as_array(x, s, self._caller) for x, s in zip(inputs, specs, strict=True)]
            try:
                outs = self._outputs(_at(inputs, axes[0], None))
            except SignatureError as inner:  # its dtype, else what was passed: one example
                raise (inner if " has dtype " in str(inner) else wrong) from None
            outs = _at(outs, axes[1], 0)
        return outs[0] if self._single_output else tuple(outs)

    def _example_axes(self, inputs: Any) -> tuple[list[Any], list[Any]] | str | None:
        """The batch axes in and out if ``inputs`` are one example and rows stay apart; why
        not, if one example where rows may not; else ``None``."""
        rows, sig = self.manifest.get("rows") or {}, self.manifest["signature"]
        if not rows.get("dim") or len(inputs) != len(sig["inputs"]):
            return None
        index = axes(sig["inputs"], rows["dim"])
        batched = [
            (x, s) for x, s, k in zip(inputs, sig["inputs"], index, strict=True) if k is not None
        ]
        try:  # a ragged list, a list of tracers: no example (the signature's error stands)
            if not batched or any(np.ndim(x) != len(s["shape"]) - 1 for x, s in batched):
                return None
        except (TypeError, ValueError):
            return None
        if not rows.get("independent"):
            return printable(str(rows.get("why") or "no verdict")[:200])
        return index, axes(sig["outputs"], rows["dim"])

    def _outputs(self, inputs: Any) -> list[Any]:
        # hot path: NumPy and JAX arrays of a (shape, dtype) checked before (at most 256)
        key = None
        for x in inputs:
            if type(x) not in _ARRAYS and not is_array(x):
                break
        else:
            key = tuple([(x.shape, x.dtype) for x in inputs])
        if key is None or key not in self._checked:
            inputs = self.signature.check(inputs, caller=self._caller)
            if key is not None and len(self._checked) < self._cap:
                self._checked.add(key)
        try:
            return self._run(list(inputs))
        except Exception as e:  # the program failed: XLA, IREE or jax.export raised
            self._fail(e, inputs)

    def _fail(self, e: Exception, inputs: Any) -> NoReturn:
        """Raises, in the handler of ``e`` that a call's program raised, ``e`` itself where it
        is ours or the caller's own tracing error, else an error naming the artifact."""
        tracing = isinstance(e, (*TRACER_ERRORS, jax.errors.UnexpectedTracerError))
        flagged = jax.config.jax_debug_nans or jax.config.jax_debug_infs  # the caller's check
        checked = isinstance(e, FloatingPointError) and flagged
        guards = (
            jax.config.jax_transfer_guard_host_to_device,
            jax.config.jax_transfer_guard_device_to_device,
        )
        guarded = any(str(g).startswith("disallow") for g in guards)  # the caller's transfer guard
        callers = tracing or checked or guarded
        if checked and self.runtime == "jax":  # (JAX's own: "consider opening a bug report")
            raise FloatingPointError(_NAN.format(caller=self._caller)) from e
        if isinstance(e, SymjaxError) or (callers and self.runtime == "jax"):
            raise  # ours, or the caller's own jax.jit code's, NaN check's or transfer guard's
        if tracing:
            raise ConfigError(
                f"{self._caller}: the {self.runtime} runtime runs outside JAX, so jax.jit, "
                "jax.vmap and jax.grad cannot trace it. Load it with runtime='jax'."
            ) from e
        check_x64(self.path, self.manifest, loaded=True)  # another thread's x64: not the file
        raise run_failed(self._caller, self._file, e, inputs) from e

    def _unlike(self, own: Mapping[str, Any], given: Any, named: Any) -> str:
        """The message refusing ``m.apply``'s ``given`` params (``named``: by their paths, or
        ``None``), naming the keys it has that ``m.params`` lacks and those it lacks."""
        got = sorted(given)[:4] if isinstance(given, Mapping) else type(given).__name__
        said = (
            f"{self._caller}.apply(params, ...): params must be a dict by the names of "
            f"m.params, {sorted(own)[:4]}..., or the tree whose paths they are (as h.params "
            f"holds it); got {printable(str(got))[:200]}."
        )
        if named is None:
            along = "stacked along a new first axis for jax.vmap"
            return f"{said} Pass m.params, or such a dict or tree ({along})."
        extra, missing = sorted(set(named) - set(own)), sorted(set(own) - set(named))
        if missing:
            said += f" It lacks {_few(missing)}."
        if extra:
            said += f" It has {_few(extra)}, not a weight of this model."
        if extra and not missing and isinstance(given, Mapping) and set(own) <= set(given):
            return f"{said} Pass the model's only: {{k: params[k] for k in m.params}}."
        if extra and not missing:
            return f"{said} Pass the tree without {'it' if len(extra) == 1 else 'them'}."
        return f"{said} Pass a dict or tree of m.params' paths, no more and no fewer."

    def _by_name(self, named: dict[str, Any], n: int) -> str:
        """The message refusing inputs passed by name (``m(x=x)``), ``n`` of them by position."""
        specs, keys = self.signature.inputs, list(named)
        got = ", ".join(printable(f"{k[:80]}=") for k in keys[:8])
        usable = not n and len(keys) == len(specs) == 1 and keys[0].isidentifier()
        example = ", ".join(keys if usable else [s.path for s in specs])  # m(x) for m(x=x)
        return (
            f"{self._caller}: got {got} by name, but a loaded model takes its inputs by "
            f"position: {len(specs)} of them, {', '.join(map(str, specs))}. Pass the arrays in "
            f"that order: m({example})."
        )

    def __repr__(self) -> str:
        return f"LoadedModel({str(self.path)!r}, runtime={self.runtime!r}, {self.signature})"


class _Typed(LoadedModel):
    """A loaded model some of whose inputs take only weakly typed values (a scalar exported at
    a Python number) or only strongly typed ones (``signature.strong``: NumPy's, not 2.0 or
    jnp.full(s, 2.0)), the model answering the other kind in other dtypes. A call checks their
    weak type first; then a (shape, dtype) checked before is all, as for any loaded model."""

    def __call__(self, *inputs: jax.typing.ArrayLike, **named: Any) -> Any:
        if len(inputs) == len(self.signature.inputs):
            for i, spec in self._typed:
                if weakly_typed(inputs[i]) != spec.weak_type:
                    raise SignatureError(str(weak_refusal(self._caller, spec, inputs[i], True)))
        return super().__call__(*inputs, **named)


_Typed.__name__ = _Typed.__qualname__ = "LoadedModel"  # as its user knows it (pickle's refusal)


def _at(xs: list[Any], axes: list[int | None], index: int | None) -> list[Any]:
    """Each ``x`` indexed by ``index`` at its axis (``None``: a new axis); as is where none."""
    return [
        x if k is None else x[(slice(None),) * k + (index,)] for x, k in zip(xs, axes, strict=True)
    ]


def _few(keys: list[str]) -> str:
    """Up to four of ``keys``, quoted, and how many more."""
    more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
    return ", ".join(printable(repr(k))[:80] for k in keys[:4]) + more


def _by_path(tree: Any, caller: str) -> dict[str, Any] | None:
    """``tree``'s leaves by the paths an artifact names params by; ``None`` where two leaves
    share one or a key cannot be named (``{"a/b": x, "a": {"b": y}}``, an empty key). Refuses
    a tree JAX cannot flatten: one holding itself (JAX recurses until the interpreter breaks)
    or a dict of keys of several types (JAX sorts them)."""
    if why := unflattenable(tree):
        raise SignatureError(
            f"{caller}.apply(params, ...): params {why}, which JAX cannot flatten. Pass "
            "m.params, or a dict or tree of arrays by its paths."
        )
    try:
        named = list(param_paths(tree))
    except ArtifactError:
        return None
    out = dict(named)
    return out if len(out) == len(named) else None
