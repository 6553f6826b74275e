"""A batcher's requests: what one takes, its check, and what the caller holds while it runs.

:class:`RequestCheck` checks each input's rank, row shape, dtype and rows, and looks up a NumPy
``(shape, dtype)`` that passed once. A :class:`RequestFuture` is a ``concurrent.futures.Future``
settled a whole batch at a time; an :class:`AsyncRequest` its asyncio counterpart."""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from symjax_mlp._artifact.signature import (
    CONVERSION_ERRORS,
    Signature,
    admits,
    an,
    as_array,
    not_an_array,
)
from symjax_mlp._compat import SharedLockFuture
from symjax_mlp._errors import ConfigError, SignatureError, as_bool, as_int
from symjax_mlp._hybrid.pure import is_key
from symjax_mlp._loaded import LoadedModel
from symjax_mlp._specs import TensorSpec, out_of_range, unfit_array
from symjax_mlp.serving._model import refuse_outputs
from symjax_mlp.serving._stats import Timed

#: what :meth:`AsyncRequest.fail` hands on as a RuntimeError from it (the cause: the model's)
UNAWAITABLE = (StopIteration, GeneratorExit, KeyboardInterrupt, SystemExit)


class AsyncRequest(Timed):
    """What :meth:`Batcher.asubmit` returns: await it for the result.

    Attributes:
      future: the ``asyncio.Future`` of the result, on the loop that called ``asubmit``
        (for ``asyncio.wait``, ``asyncio.shield``, ...).
      timing: the request's :class:`RequestTiming`, set before the result (``None`` until
        then, and for a request cancelled or failed before it ran).
      batch_record: what :attr:`timing` is read from, as the batcher sets it: its batch's clock
        readings and sizes, ``(t1, t2, t3, t4, rows, bucket, requests)`` (``None`` alike).
    """

    __slots__ = ("arrays", "batch_record", "future", "rows", "t0")

    def __init__(self, arrays: Sequence[Any], rows: int, t0: float, future: Any) -> None:
        self.arrays, self.rows, self.t0, self.future = arrays, rows, t0, future
        self.batch_record = None

    def __await__(self) -> Any:
        return self.future.__await__()

    def cancel(self) -> bool:
        """Drops the request if its batch has not started; ``False`` once it has a result."""
        return self.future.cancel()

    def fail(self, error: BaseException) -> None:
        """Settles it with ``error``; one an awaiter cannot be given (a StopIteration, which a
        future refuses; a GeneratorExit, which closes every coroutine up to the task; a
        KeyboardInterrupt or SystemExit, which asyncio raises out of the loop) as a RuntimeError
        from it, as a coroutine's."""
        if isinstance(error, UNAWAITABLE):
            try:
                what = repr(error)
            except BaseException:  # else on the loop, and the batch's awaiters never answered
                what = type(error).__name__
            wrapped = RuntimeError(f"the model raised {what}")
            wrapped.__cause__, error = error, wrapped
        self.future.set_exception(error)


class RequestFuture(SharedLockFuture, Timed):
    """What :meth:`Batcher.submit` returns: a ``concurrent.futures.Future`` of the result.

    Attributes:
      timing, batch_record: as :attr:`AsyncRequest.timing`, :attr:`AsyncRequest.batch_record`.
    """

    batch_record, rows, t0 = None, 0, 0.0  # the request (with its inputs) rides on the future
    arrays: Sequence[Any] = ()


_EXAMPLE = (
    "pass an array (a tuple of arrays for several inputs), each with the batch as leading "
    "dimension, e.g. x[None]."
)
_KEY = (
    "Batcher(example=...): input {i} is a typed rng key ({dtype}{shape}), which a batcher cannot "
    "merge into NumPy buffers. Serve a function closing over it: sm.hybridize(lambda params, x: "
    "model.apply(params, x, key), variables), example=x; for a key per row, a function of "
    "jax.random.key_data(keys) (uint32 rows) that calls jax.random.wrap_key_data on it."
)


def example_specs(example: Any) -> tuple[TensorSpec, ...]:
    arrays = example if isinstance(example, tuple) else (example,)
    if not arrays:
        raise ConfigError(f"Batcher(example=()): the example holds no input; {_EXAMPLE}")
    specs = []
    for i, x in enumerate(arrays):
        if is_key(x):  # else NumPy's "data type key<fry> not understood" (or "a scalar")
            raise ConfigError(_KEY.format(i=i, dtype=x.dtype, shape=list(x.shape)))
        if not (hasattr(x, "shape") and hasattr(x, "dtype") and len(x.shape)):
            scalar = hasattr(x, "shape") and hasattr(x, "dtype")  # (a memoryview has a shape)
            what = "a scalar" if scalar else an(type(x).__name__)  # an int, a Decimal
            raise ConfigError(f"Batcher(example=...): input {i} is {what}; {_EXAMPLE}")
        specs.append(TensorSpec(f"args[{i}]", ("b", *map(int, x.shape[1:])), str(x.dtype)))
    return tuple(specs)


_SHARED = (
    "Batcher({path}): input {spec.path} is {spec.type}, without the batch {batch!r}: one value "
    "shared by every row (a mask, weights), while a batcher merges the rows of every input of "
    "many requests. Serve a model with it fixed: export a function that closes over it (or "
    "takes it among the params), or call the loaded model directly."
)
_NO_ROWS = (
    "Batcher({path}): input {spec.path} is {spec.type}, but batching needs rows, and every "
    "input is a scalar: the model takes one value per call, none for a batcher to merge. Call "
    "the loaded model directly, or export a model of rows: jax.vmap of the function "
    "(sm.hybridize(jax.vmap(fn, in_axes=(None, 0)), params)), exported with its batch symbolic."
)
_SIZES = (
    "Batcher({path}): input {spec.path} is {spec.type}, but batching needs static sizes beside "
    "the batch {batch!r}, and its {are} symbolic: a batcher pads and merges the rows of many "
    "requests into one array. Call the loaded model directly (it takes any size there), or "
    "serve one artifact per size: exported with only the batch symbolic (export(..., "
    "batch='b') of an example at that size)."
)
_MIXED = "its manifest says that its rows are not independent"
MAX_BATCH = 1 << 16  # the most rows a batcher's model call may take (its largest bucket)
#: The most bytes of input rows in a batch of a batcher's default ``max_batch``: its warm-up
#: runs each bucket on zeros (256 MiB: serve's default ``max_inflight_bytes``, 4 bodies).
WARM_UP_BYTES = 256 * 2**20


def artifact_specs(model: LoadedModel) -> tuple[tuple[TensorSpec, ...], int | None, str, Any]:
    """An artifact's per-request specs, static batch (or ``None``), why each request runs alone
    (``""``: rows may merge), and ``(signature, "b")`` where constraints bound its batch."""
    sig = model.signature
    specs, static = [], set()
    leads = [spec.shape[0] if spec.shape else None for spec in sig.inputs]
    batch = sig.batch or next((d for d in leads if isinstance(d, str)), None)
    for spec, lead in zip(sig.inputs, leads, strict=True):
        if batch is not None and not isinstance(lead, str):
            raise ConfigError(_SHARED.format(path=model.path, spec=spec, batch=batch))
        rest = spec.shape[1:]
        if not any(s.shape for s in sig.inputs):  # all scalars: one value per call, no rows
            raise ConfigError(_NO_ROWS.format(path=model.path, spec=spec))
        sizes = sorted({d for d in rest if isinstance(d, str)})
        if isinstance(lead, str) and sizes:
            are = f"sizes {', '.join(sizes)} are" if len(sizes) > 1 else f"size {sizes[0]} is"
            raise ConfigError(_SIZES.format(path=model.path, spec=spec, batch=lead, are=are))
        if lead is None or sizes:
            raise ConfigError(
                f"Batcher({model.path}): input {spec.path} is {spec.type}, but batching needs "
                "the batch as leading dimension and static sizes elsewhere. Export the model "
                "with a symbolic batch: export(..., batch='b')."
            )
        if isinstance(lead, int):
            static.add(lead)
        specs.append(TensorSpec(spec.path, ("b", *rest), spec.dtype))
    if len(static) > 1:
        raise ConfigError(
            f"Batcher({model.path}): the inputs' leading dimensions {sig} disagree; batching "
            "needs one batch dimension shared by every input: call the loaded model directly."
        )
    fixed = static.pop() if static else None
    rows = model.manifest.get("rows") or {}  # a static batch never shows its rows apart
    why = "" if rows.get("independent", True) else rows.get("why") or _MIXED
    bound = (sig, batch) if batch and sig.constraints else None
    refuse_outputs(model.path, sig.outputs, batch if fixed is None else fixed, why)
    return tuple(specs), fixed, why, bound


def fits(bound: tuple[Signature, str] | None, n: int) -> bool:
    """Whether the artifact admits a batch of ``n`` rows (``bound``: :func:`artifact_specs`')."""
    return bound is None or admits(bound[0], {bound[1]: n})


def row_size(specs: Sequence[TensorSpec]) -> int:
    """The bytes of one row of ``specs`` (a batcher's: ``b`` first, static sizes after)."""
    return sum(math.prod(s.shape[1:]) * np.dtype(s.dtype).itemsize for s in specs)


def default_batch(size: int, limit: int = 0) -> int:
    """64, or the largest power of two of rows of ``size`` bytes within ``limit`` bytes (0:
    :data:`WARM_UP_BYTES`), 1 at least: a 64 MiB row at 64 rows is 4 GiB of warm-up."""
    limit = limit or WARM_UP_BYTES
    return 64 if 64 * size <= limit else 1 << max(limit // max(size, 1), 1).bit_length() - 1


def bucket_sizes(
    name: str, max_batch: int | None, buckets: Sequence[int] | None, static: int | None,
    bound: Any = None, row: int = 0,
) -> tuple[int, ...]:  # fmt: skip
    """The batch sizes to compile, of those the artifact admits (``bound``: :func:`fits`); by
    default up to :func:`default_batch` of rows of ``row`` bytes."""
    if static is not None:
        if (max_batch not in (None, static)) or (buckets is not None and list(buckets) != [static]):
            raise ConfigError(
                f"{name}: the artifact was exported for a static batch of {static}, so every "
                f"model call runs {static} rows. Drop max_batch/buckets (or pass max_batch="
                f"{static}) to serve it so, one request of {static} rows at a time; to batch "
                f"freely, export it again with a symbolic batch (batch='b') {_WHERE}."
            )
        return (static,)
    max_batch = None if max_batch is None else check_count(name, "max_batch", max_batch)
    if buckets is not None:
        ok = isinstance(buckets, Iterable) and not isinstance(buckets, str)
        buckets = list(buckets) if ok else buckets
        ok = ok and buckets and all(type(as_int(b)) is int for b in buckets)
        buckets = [as_int(b) for b in buckets] if ok else buckets
        if not ok or min(buckets) < 1 or max_batch not in (None, max(buckets)):
            largest = f" whose largest is max_batch={max_batch}" if max_batch else ""
            raise ConfigError(
                f"{name}: buckets must be a tuple of ints >= 1{largest}, e.g. buckets=(1, 8, "
                f"64); got {buckets!r}."
            )
        max_batch = max(buckets)
    default, max_batch = max_batch is None, max_batch or default_batch(row)
    if max_batch > MAX_BATCH:  # every bucket is compiled and run once when the batcher is made
        raise ConfigError(
            f"{name}: max_batch={max_batch:,} rows is more than one model call may take here "
            f"({MAX_BATCH:,}); its buckets are compiled and run when the batcher is made. Pass "
            f"a max_batch <= {MAX_BATCH:,} (a few times the requests you expect at once)."
        )
    if buckets is None:  # powers of two, and max_batch
        max_batch = next((n for n in range(max_batch, 0, -1) if fits(bound, n)), max_batch)
        if default and not fits(bound, max_batch):  # its least batch over the bound: that one
            max_batch = next((n for n in range(max_batch, 65) if fits(bound, n)), max_batch)
        buckets = {*(1 << i for i in range(max_batch.bit_length())), max_batch}
    if not (kept := tuple(n for n in sorted(set(buckets)) if fits(bound, n))):
        raise ConfigError(
            f"{name}: none of buckets={tuple(sorted(set(buckets)))} is a batch size the artifact "
            f"admits ({', '.join(bound[0].constraints)}); pass buckets= (or max_batch=) within it."
        )
    return kept


_WHERE = "where the model takes one (not where it fixes its rows: an ensemble's members)"
_STATIC = (
    ": it has {rows} rows. The artifact was exported for a static batch of {static}, and "
    "its rows are not shown independent ({why}), so a request is never padded nor merged: pass "
    "exactly {static} rows, or export the model again with a symbolic batch (batch='b') "
    "{where}."
)
_NUMBERS = (bool, int, float, complex, list, tuple)  # Python's, not an array


class RequestCheck:
    """Checks requests against a batcher's specs: :meth:`check` gives their arrays and rows.
    Where rows mix (``why``), unpadded, a request has ``static`` rows, or as many as ``bound``'s."""

    def __init__(self, specs: Sequence[TensorSpec], lane: Any, static: int | None, why: str,
                 bound: Any = None):  # fmt: skip
        self.name, self.specs, self.lane, self.max_batch = lane.name, specs, lane, lane.max_batch
        self.static, self.why = static if why else None, why  # rows mix: never padded
        self.least = next(n for n in range(1, self.max_batch + 1) if not why or fits(bound, n))
        self.takes = f"b = {static}" if self.static else f"{self.least} <= b <= {self.max_batch}"
        # NumPy shapes (a tuple for several inputs) that passed, and their rows: see check()
        self.accepted: dict[Any, int] = {}
        self.dtypes = list(lane.dtypes)

    def check(self, inputs: tuple[Any, ...]) -> tuple[Sequence[Any], int]:
        """The request's arrays and rows; NumPy inputs of a shape seen before are looked up."""
        if len(inputs) == 1:
            x = inputs[0]
            if type(x) is np.ndarray and x.dtype is self.dtypes[0]:
                rows = self.accepted.get(x.shape)
                if rows is not None:
                    return inputs, rows
        elif (
            all(type(x) is np.ndarray for x in inputs) and [x.dtype for x in inputs] == self.dtypes
        ):
            rows = self.accepted.get(tuple([x.shape for x in inputs]))
            if rows is not None:
                return inputs, rows
        try:
            return self._read(inputs)
        except SignatureError:  # nothing queued: counted as refused
            with self.lane.lock:
                self.lane.n.rejected["signature"] += 1
            raise

    def _read(self, inputs: tuple[Any, ...]) -> tuple[Sequence[Any], int]:
        if len(inputs) != len(self.dtypes):
            want, paths = ", ".join(map(str, self.specs)), ", ".join(s.path for s in self.specs)
            raise SignatureError(
                f"{self.name}: a request takes {len(self.dtypes)} input(s) ({want}); got "
                f"{len(inputs)}. Pass each as its own argument: b.submit({paths}), b({paths})."
            )
        arrays, rows, numpy = [], None, True
        for i, x in enumerate(inputs):
            numpy = numpy and type(x) is np.ndarray
            if isinstance(x, _NUMBERS):  # as LoadedModel takes them: JAX's weak types
                x = as_array(x, self.specs[i], self.name)  # a ragged list: refused
            if type(x) is not np.ndarray and (
                error := unfit_array(self.name, f"input {self.specs[i].path}", x)
            ):
                raise error  # np.asarray would drop a mask, compute a np.matrix as a matrix
            try:
                a = x if type(x) is np.ndarray else np.asarray(x)  # read on the host anyway
            except CONVERSION_ERRORS as e:  # its __array__ raised (a table of mixed columns)
                raise not_an_array(x, self.specs[i], self.name, e) from None
            why = self._why(i, a, rows)
            if why:
                spec = self.specs[i]
                raise SignatureError(
                    f"{self.name}: input {spec.path} has shape {a.shape} and dtype {a.dtype}, "
                    f"but a request takes {spec.type} with {self.takes} rows{why}"
                )
            rows = a.shape[0]
            arrays.append(a)
        if numpy:
            shapes = tuple(a.shape for a in arrays)
            self.accepted[shapes[0] if len(shapes) == 1 else shapes] = rows
        return arrays, rows  # type: ignore[return-value]

    def _why(self, i: int, a: np.ndarray, rows: int | None) -> str:
        """Why input ``i`` is refused, the message's end (``""``: it is not)."""
        shape, dtype = self.lane.row_shapes[i], self.lane.dtypes[i]
        if a.ndim != len(shape) + 1:
            fix = "Add the batch dimension: x[None] (one row)" if a.shape == shape else ""
            fix = fix or f"Pass an array of rank {len(shape) + 1}"
            return f": rank {a.ndim}, not {len(shape) + 1}. {fix}."
        if a.shape[1:] != shape:
            return f": each row is {a.shape[1:]}, not {shape}. Pass rows of shape {shape}."
        if a.dtype != dtype:
            fix = f"it {held}. Send values in range" if (held := out_of_range(a, dtype)) else ""
            return f": {fix}." if fix else f". Cast it: x.astype(np.{dtype})."
        n = a.shape[0]
        if n < 1:
            return ": it has no rows. Pass at least one row."
        if self.static and n != self.static:
            return _STATIC.format(rows=n, static=self.static, why=self.why, where=_WHERE)
        if n < self.least:  # rows mix (self.why): never padded up to a size the artifact takes
            return f": it has {n} rows, and its rows mix: never padded. Pass {self.least} or more."
        if n > self.max_batch:
            return (
                f": it has {n} rows. Split it into requests of at most {self.max_batch} rows, "
                f"or make a Batcher with max_batch >= {n}."
            )
        if rows is not None and n != rows:
            return (
                f": it has {n} rows but {self.specs[0].path} has {rows}; the inputs of one "
                "request must have the same number of rows."
            )
        return ""


def short(text: str, limit: int = 300, more: int = 0) -> str:
    """``text`` cut to ``limit`` characters (``more``: cut before), as errors quote inputs."""
    more += max(len(text) - limit, 0)
    return text[:limit] + f"... ({more} more)" if more else text


def headed(where: str) -> str:
    """A refusal's heading: ``where`` and a colon, or none for ``""`` (a caller whose own line
    says where already, as the CLI's ``symjax-mlp serve: error:``)."""
    return f"{where}: " if where else ""


def check_count(where: str, option: str, value: Any) -> int:
    """``value`` as an int; refused unless it is an integer >= 1 (NumPy's too)."""
    count = as_int(value)
    if type(count) is not int or count < 1:
        raise ConfigError(f"{headed(where)}{option} must be an int >= 1; got {value!r}.")
    return count


def seconds(value: Any, given: str) -> float | None:
    """A timeout (seconds >= 0, or None: no limit) as threading waits on it: a float (not
    NumPy's, nor a Fraction), or None (past ``threading.TIMEOUT_MAX`` too: inf)."""
    bad = isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0
    if value is not None and bad:
        raise ConfigError(f"{given}={value!r}): pass seconds >= 0, or None for no limit.")
    return None if value is None or value >= threading.TIMEOUT_MAX else float(value)


def flag(value: Any, given: str) -> bool:
    """``value`` as a bool (NumPy's too); refused unless it is one (``1``, ``"yes"``: no bools)."""
    if not isinstance(value := as_bool(value), bool):
        raise ConfigError(f"{given}={value!r}): expected True or False.")
    return value
