"""A micro-batcher: a stream of requests merged into a few pre-compiled batch shapes.

One executor lane runs one batch at a time. A request that finds it idle runs at once (``b(x)``
on the calling thread, ``submit`` on the batcher's thread, ``asubmit`` of a LoadedModel on the
event loop as its pass ends); requests that arrive meanwhile merge, in arrival order, into the
next batch, zero-padded to the smallest compiled bucket that holds it. A LoadedModel's batch of
one loop's requests runs on that loop too where its bucket last ran within a millisecond.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from symjax_mlp._artifact.format import NEEDS
from symjax_mlp._errors import ConfigError, OverloadError, RetraceError, refuse_keywords
from symjax_mlp._loaded import LoadedModel
from symjax_mlp._specs import TensorSpec
from symjax_mlp.serving._lane import Blocking, Lane, claim, clock
from symjax_mlp.serving._model import call_of, fixed_rows, typed_check
from symjax_mlp.serving._requests import (
    AsyncRequest,
    RequestCheck,
    RequestFuture,
    artifact_specs,
    bucket_sizes,
    check_count,
    example_specs,
    flag,
    row_size,
    seconds,
)
from symjax_mlp.serving._stats import BatcherStats

_KEYS = (
    "Batcher({path}): input {spec.path} is {spec.type}, typed rng keys, while a batcher merges "
    "the rows of many requests in NumPy buffers, which hold no key type. Serve the keys' data: "
    "export a function of jax.random.key_data(keys) (uint32 rows) that calls "
    "jax.random.wrap_key_data on it, or call the loaded model directly."
)
_BOUNDED = NEEDS - {"while"}  # allow= keys whose ops compute tensors from tensors, bounded


class Batcher:
    """Serves a model to many callers: concurrent requests become a few pre-compiled batches.

    A request is what the model takes, with a leading batch dimension of 1..``max_batch``
    rows: ``b(x)`` returns what ``model(x)`` would, as NumPy arrays (batched rows equal the
    same rows run alone up to float rounding; at one bucket, bit for bit).

    Merging and padding are exact only for a model that keeps its rows apart. An artifact
    whose manifest does not show that (``m.manifest["rows"]``) runs each request alone at its
    own rows, never merged nor padded: :attr:`merges` is then ``False`` and :attr:`why_alone`
    says why; with a static batch, a request must have exactly its rows. A Hybrid, a callable
    or an artifact written before manifests said so is merged and padded.

    If the model raises, every request of that batch gets the exception (``SystemExit`` too, as
    with a ``ThreadPoolExecutor``), and the batcher carries on; so it does with a RuntimeError
    if its outputs' kind, row shapes or dtypes are not those it had when the batcher was made.
    Inputs are read when their batch runs: do not change one in place before its result is back.

    Args:
      model: a :class:`~symjax_mlp.LoadedModel` (``sm.load(path)``; its signature says what
        a request takes), a :class:`~symjax_mlp.Hybrid` (with ``example``; a stateful one
        serves its inference with the state it holds now, which serving never moves), or any
        callable ``f(*batched_inputs) -> array or pytree of arrays`` treating rows
        independently.
      example: for a Hybrid or a callable: an input batch (an array, or a tuple of arrays
        for several inputs) giving each input's row shape and dtype. Not for a LoadedModel.
      max_batch: most rows in one model call (default 64, or a static artifact batch; where
        an artifact's constraints bound its batch, ``b <= 6``, the largest they admit up to it).
        Where requests merge, the default is fewer where 64 rows of inputs hold over 256 MiB:
        the largest power of two of rows within it (a row of 64 MiB: 4), each bucket being run
        on zeros when the batcher is made; pass ``max_batch=`` to warm up more.
      buckets: the batch sizes compiled ahead of time (default: powers of two up to
        ``max_batch``, and ``max_batch``); the largest must be ``max_batch``. Of an artifact,
        those its constraints admit (``b >= 2``: a request of 1 row is padded to 2, or, where
        it does not merge, refused). A batcher that does not merge compiles the smallest only.
      max_queue: most requests waiting; one more is refused with :class:`OverloadError`.
      name: shown in errors (default: the model's name or artifact path).
      kwargs: keyword settings passed to every call of a Hybrid or callable, e.g.
        ``{"train": False}`` for the batch-norm guide's ``MLP(x, train)``; given as the
        Batcher's own (``train=False``), a ConfigError naming ``kwargs=``.
      warm_up_timeout: most seconds the warm-up (each bucket compiled and run on zero rows, on
        the batcher's thread) may take (``None``: no limit); past it, a ``TimeoutError``.

    Raises:
      ConfigError: a Hybrid or callable without ``example`` (or whose signature does not take
        it and ``kwargs``), a LoadedModel with one; an nnx module in training mode; bad
        ``max_batch``/``buckets``/``max_queue``, or buckets an artifact's constraints refuse
        all of; an artifact whose batch is not its inputs' leading dimension; outputs not
        arrays per row, or whose rows differ between batch sizes (served alone, an artifact's
        outputs by its signature: the batch of static-size rows); a bad ``warm_up_timeout``.
      TimeoutError: the warm-up took longer than ``warm_up_timeout``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import symjax_mlp as sm
      >>> net, x = sm.mlp((4, 2)), jnp.ones((1, 3))
      >>> h = sm.hybridize(net, net.init(jax.random.key(0), x))
      >>> with sm.serving.Batcher(h, example=x, max_batch=8) as b:
      ...     y = b(np.ones((3, 3), np.float32))          # 3 rows, run at bucket 4
      ...     f = b.submit(np.ones((1, 3), np.float32))   # a concurrent.futures.Future
      ...     print(y.shape, f.result().shape, b.buckets, b.stats.padded_rows)
      (3, 2) (1, 2) (1, 2, 4, 8) 1
    """

    def __init__(
        self, model: Any, *, example: Any = None, max_batch: int | None = None,
        buckets: Sequence[int] | None = None, max_queue: int = 1024, name: str | None = None,
        kwargs: dict[str, Any] | None = None, warm_up_timeout: float | None = 300.0,
        **keywords: Any,
    ) -> None:  # fmt: skip
        refuse_keywords("Batcher(model", keywords, "Batcher(model, example=x")
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise ConfigError(
                f"Batcher(kwargs={kwargs!r}): pass a dict of keyword settings for every call, "
                "e.g. kwargs={'train': False}."
            )
        served, kwargs = model, dict(kwargs or {})  # what the lane calls
        alone = ""  # why each request must run alone, unpadded ("": they merge)
        if isinstance(model, LoadedModel):
            if example is not None or kwargs:
                given = "example=" if example is not None else "kwargs="
                raise ConfigError(
                    f"Batcher(LoadedModel, {given}): a loaded artifact carries its signature "
                    f"({model.signature}) and settings; drop {given}."
                )
            specs, static, alone, bound = artifact_specs(model)
            if key := next((s for s in specs if s.dtype.startswith("key<")), None):
                raise ConfigError(_KEYS.format(path=model.path, spec=key))  # else NumPy's
            name = name or str(model.path)
        elif callable(model):
            linen = sys.modules.get("flax.linen")  # never imported here
            owner = getattr(model, "__self__", model)  # a method's module: model.encode
            if linen is not None and isinstance(owner, linen.Module) and owner.scope is None:
                plain = owner is model or model.__name__ == "apply"  # else flax's, at warm-up
                run = "" if plain else f".{model.__name__}"
                how = f"lambda v, *xs: model.apply(v, *xs, method={run[1:]!r})" if run else "model"
                raise ConfigError(
                    f"Batcher({type(owner).__name__}{run}): a flax.linen module has no params of "
                    f"its own; hybridize it with its variables first: Batcher(sm.hybridize({how}, "
                    "variables), example=x)."
                )
            if example is None:
                raise ConfigError(
                    f"Batcher({type(model).__name__}): pass example=, an input batch (an array, "
                    "or a tuple of arrays for several inputs) that gives each input's row shape "
                    "and dtype, e.g. Batcher(h, example=x) with x of shape (1, features)."
                )
            specs, static, bound = example_specs(example), None, None
            name = name or getattr(model, "name", None) or getattr(model, "__name__", "model")
            served = call_of(model, example, kwargs, name)
        else:
            raise ConfigError(
                "Batcher(model): expected a LoadedModel (sm.load(path)), a Hybrid "
                f"(sm.hybridize(...)) or a callable; got {type(model).__name__}."
            )
        self.name = f"Batcher({name})"
        row = 0 if alone else row_size(specs)  # merged: a default max_batch within WARM_UP_BYTES
        self.buckets = bucket_sizes(self.name, max_batch, buckets, static, bound, row)
        self.max_batch = self.buckets[-1]
        self.max_queue = check_count(self.name, "max_queue", max_queue)
        wait = seconds(warm_up_timeout, f"Batcher({name}, warm_up_timeout")
        #: What one request takes: one spec per input, the batch dimension named ``b``.
        self.specs: tuple[TensorSpec, ...] = specs
        self.model = model
        #: Why each request runs alone at its own rows (``""``: requests merge): see above.
        self.why_alone: str = alone
        lane = Lane(served, specs, self.buckets, self.name, merges=not alone)
        strong = model.signature.strong if isinstance(model, LoadedModel) else ()
        self._check = typed_check(RequestCheck(specs, lane, static, alone, bound), strong)
        # Per event loop, this pass's asubmit (None: several), see _end_of_pass: run on the loop
        # only for an XLA program the checker bounded to tensor ops (no loop: /health answers).
        self._passes: dict[Any, AsyncRequest | None] = {}
        checked = getattr(model, "allowed", None) if isinstance(model, LoadedModel) else None
        self._on_loop = checked is not None and checked <= _BOUNDED
        try:
            self._thread, self._lane = lane.start(wait), lane
        except RetraceError as e:  # a Hybrid's max_traces=1, say: a trace per bucket
            n = len(self.buckets)
            e.add_note(f"{self.name} traces the model once per bucket, {self.buckets}: pass buckets"
                       f"=({self.max_batch},) (one trace), or max_traces >= {n}.")  # fmt: skip
            raise
        except ConfigError:  # its own cause named (outputs' rows that depend on the batch's)
            raise
        except Exception as e:  # an ensemble's rows, fixed by its params: named, as export does
            if (fixed := fixed_rows(self.name, model, example, lane.warming, self.buckets)) is None:
                raise
            raise fixed from e
        self._finalizer = weakref.finalize(self, lane.close, False)

    def _enqueue(self, request: Any, wake: bool = True) -> None:
        lane = self._lane
        with lane.lock:
            if lane.closing:
                lane.n.rejected["closed"] += 1
                said = f"{self.name} is closed: it takes no more requests; make a new one."
                raise RuntimeError(said)
            if len(lane.queue) >= self.max_queue:
                lane.n.rejected["overload"] += 1
                raise OverloadError(
                    f"{self.name}: the queue is full (max_queue={self.max_queue} requests "
                    "waiting), so the request was refused. Retry it later, send fewer requests "
                    "at once, or make a Batcher with a larger max_queue."
                )
            lane.n.requests += 1
            lane.queue.append(request)
            if wake and lane.idle:  # nobody runs the lane: wake its thread (a runner checks)
                lane.nudge()

    def submit(self, *inputs: Any) -> RequestFuture:
        """Queues one request; returns at once with a ``concurrent.futures.Future``.

        Its result is what ``model(*inputs)`` returns, as NumPy arrays; its ``timing`` is set
        before it. Done callbacks run on the batcher's thread between two batches: keep them
        short. Called in the model or a done callback, it runs the request at once, as ``b(x)``.

        Raises:
          SignatureError: the inputs do not fit :attr:`specs` (or have more than
            ``max_batch`` rows); nothing is queued.
          OverloadError: ``max_queue`` requests are already waiting.
          RuntimeError: the batcher is closed.
        """
        t0 = clock()
        arrays, rows = self._check(inputs)
        lane = self._lane
        future = RequestFuture(lane.futures)
        future.arrays, future.rows, future.t0 = arrays, rows, t0
        if threading.get_ident() in (lane.thread, lane.holder) and not lane.closing:
            lane.n.alone += 1  # in the model or a callback: queued, it would wait for the lane
            lane.run([future], rows)  # this thread holds (its result() for ever)
            return future
        self._enqueue(future)
        return future

    def run(self, *inputs: Any, timeout: float | None = None) -> Any:
        """Runs one request and waits for its result: ``b(x)`` is ``b.run(x)``.

        An idle batcher runs it on the calling thread; otherwise it joins the next batch (many
        threads serve faster with ``submit``: each blocked thread's wake-up is a GIL hand-off).

        Raises:
          SignatureError, OverloadError, RuntimeError: as :meth:`submit`.
          TimeoutError: no result after ``timeout`` seconds (the request still runs).
          ConfigError: ``timeout`` is not None or seconds >= 0 (checked before it is queued).
          Exception: what the model raised for the request's batch.
        """
        t0 = clock()
        wait = seconds(timeout, f"{self.name}.run(timeout")
        arrays, rows = self._check(inputs)
        lane, request = self._lane, Blocking(arrays, rows, t0)
        if lane.idle and not lane.queue and not lane.closing and claim(lane.idle):
            lane.holder = threading.get_ident()  # until release(): see close()
            try:
                if not lane.queue:  # run it here, with no lock held; else join the queue
                    return lane.run_alone(request)
            finally:
                lane.release()
        if threading.get_ident() in (lane.thread, lane.holder) and not lane.closing:
            return lane.run_alone(request)  # in the model or a callback: not wait for itself
        request.waiter = waiter = threading.Lock()
        waiter.acquire()
        self._enqueue(request)
        if not waiter.acquire(timeout=-1 if wait is None else wait):
            raise TimeoutError(
                f"{self.name}: no result after {timeout} s (the request is still queued or "
                "running); wait longer, or raise max_batch if the queue is long."
            )
        if request.error is not None:
            raise request.error
        return request.result

    __call__ = run

    def asubmit(self, *inputs: Any, alone: bool = False) -> AsyncRequest:
        """Queues one request from asyncio code: ``y = await b.asubmit(x)``.

        It checks and queues the request at once, like :meth:`submit`; the requests of one pass of
        the loop go to the batcher when the pass ends (a lone one on an idle batcher of a
        LoadedModel runs then, on the loop, if load checked its ops and allowed none beyond tensor
        ops: no while loop; at once, if ``alone=True``: none other can come this pass, as on a
        server's one connection). Cancelling it drops the request if its batch has not started.

        Raises:
          SignatureError, OverloadError: as :meth:`submit`; nothing is queued.
          RuntimeError: the batcher is closed, or no event loop runs on this thread (from
            plain threads, call ``b.submit(x)`` or ``b(x)``).
          ConfigError: ``alone`` is not True or False; nothing is queued.
        """
        t0 = clock()
        if alone is not False and alone is not True:  # 1, "no": refused, not taken as True
            alone = flag(alone, f"{self.name}.asubmit(alone")
        arrays, rows = self._check(inputs)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                f"{self.name}.asubmit(): no asyncio event loop runs on this thread. Call it in a "
                "coroutine (y = await b.asubmit(x)); from plain threads, call b.submit(x) or b(x)."
            ) from None
        request = AsyncRequest(arrays, rows, t0, loop.create_future())
        self._enqueue(request, wake=False)  # woken, or run here, when this pass ends
        passes = self._passes
        if loop in passes:
            passes[loop] = None  # more than one this pass: the batcher's thread runs them
        else:
            passes[loop] = request
            if alone:  # nothing can join it: the pass's end is now
                self._end_of_pass(loop)
            else:
                loop.call_soon(self._end_of_pass, loop)
        return request

    def _end_of_pass(self, loop: Any) -> None:
        """Runs the pass's requests on the loop where the lane is idle and that is cheaper than a
        hand-off (a lone request, or a quick bucket: ``ON_LOOP_SECONDS``); else wakes the thread."""
        lone, lane = self._passes.pop(loop), self._lane
        with lane.lock:
            q = lane.queue
            alone = lone is not None and len(q) == 1 and q[0] is lone
            if (
                not self._on_loop
                or (lone is not None and lone.future.cancelled())  # the thread drops it
                or not (alone or lane.quick(loop))
                or not claim(lane.idle)  # a batch runs: its runner takes the queue next
            ):
                if lane.idle:
                    lane.nudge()
                return
            lane.holder = threading.get_ident()
            if alone:
                q.popleft()  # counted among the queued requests, as run by the thread
            else:
                batch, rows = lane.take()
        try:
            if alone:  # what it raises, SystemExit too, reaches its awaiter
                lane.run([lone], lone.rows, loop)
            elif batch:  # else every one was cancelled
                lane.run(batch, rows, loop)
        finally:
            lane.release()

    @property
    def stats(self) -> BatcherStats:
        """A snapshot of the counters and timings (see :class:`BatcherStats`)."""
        lane = self._lane
        with lane.lock:
            busy_s = 0.0 if (since := lane.since) is None else clock() - since  # None: idle
            return lane.n.snapshot(len(lane.queue), busy=not lane.idle, busy_s=busy_s)

    @property
    def merges(self) -> bool:
        """Whether requests share model calls, zero-padded (``False``: see :attr:`why_alone`)."""
        return not self.why_alone

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._lane.closing

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Stops taking requests, then finishes what is queued (``cancel=True``: cancels it).

        Waits at most ``timeout`` seconds for that work (not when called by the model or a done
        callback); the thread then ends. Idempotent.

        Raises:
          TimeoutError: the work did not finish within ``timeout`` (the thread keeps going).
          ConfigError: ``cancel`` is not True or False, or ``timeout`` not None or >= 0.
        """
        cancel = flag(cancel, f"{self.name}.close(cancel")
        wait = seconds(timeout, f"{self.name}.close(timeout")
        self._lane.close(cancel)
        self._finalizer.detach()
        if threading.get_ident() in (self._lane.thread, self._lane.holder):
            return  # in a done callback, or in the model itself: the work ends after it
        self._thread.join(wait)
        if self._thread.is_alive():
            raise TimeoutError(
                f"{self.name}.close(timeout={timeout}): the queued work is still running; "
                "wait longer, or close(cancel=True) to drop what has not started."
            )

    def __enter__(self) -> Batcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"queue={len(self._lane.queue)}"
        state += "" if self.merges else f", merges=False ({self.why_alone})"
        ins = ", ".join(s.type for s in self.specs)
        return f"{self.name}: ({ins}), buckets={list(self.buckets)}, {state}"
