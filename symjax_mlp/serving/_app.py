"""The HTTP server: an ASGI app (starlette) over a :class:`~symjax_mlp.serving.Batcher`.

- ``POST /predict``: JSON ``{"inputs": X}`` (nested lists, rows first), or
  ``{"inputs": {"args[0]": X0, ...}}`` by input name, answered ``{"outputs": Y}`` (a list for a
  tuple output); or a ``.npy`` body (``Content-Type: application/x-npy``, one input), answered
  with a ``.npy`` (an ``.npz`` of ``out0``, ``out1``, ... for a tuple). ``Server-Timing`` gives
  the request's queued/padded/compute/split milliseconds.
- ``GET /health`` (503 once closing, or ``"stuck"``: a batch running past ``request_timeout``),
  ``GET /metrics`` (Prometheus), ``GET /signature``.

Errors are JSON ``{"error": class, "message": ..., "model": name}``, counted on /metrics: 400 an
unreadable body, 406 outputs JSON cannot hold (complex: ask for a ``.npy``), 408 a body that
stopped arriving or came too slowly, 413 too large, 415 an unknown content type, 422 a
:class:`~symjax_mlp.SignatureError`, 503 a full queue or too many bytes in flight (both with
``Retry-After``), a batcher closed with ``cancel=True`` or a server that stopped before the answer,
500 the model raised (its message escaped, cut to 300 characters; the traceback is logged), 504 no
answer within request_timeout, 404/405 a wrong path or method. A message never names a path.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib
import os
import re
from collections.abc import Callable
from typing import Any

from symjax_mlp._artifact.format import printable
from symjax_mlp._errors import ConfigError, OverloadError, SignatureError
from symjax_mlp._load import load
from symjax_mlp._loaded import LoadedModel
from symjax_mlp.serving._batcher import Batcher
from symjax_mlp.serving._bodies import BadRequest, decode, to_json, to_npy
from symjax_mlp.serving._intake import Intake, Watch, check_limits
from symjax_mlp.serving._lane import LOG
from symjax_mlp.serving._requests import UNAWAITABLE, short
from symjax_mlp.serving._stats import METRIC_NAME, exposition

ENDPOINTS = "POST /predict, GET /health, GET /metrics, GET /signature"
_STOPPED = "the server stopped before the request was answered; retry it."
_LATE = (
    "the model did not answer within request_timeout={:g} s, so the request was cancelled (a batch "
    "that had started runs on). Retry later; if the model is this slow, raise request_timeout."
)
_ANSWERS = "/predict's answers and serve's refusals, by status code."
_HELD = ("Bytes held of bodies being read and of answers clients have not read (bounded by "
         "max_inflight_bytes).")  # fmt: skip
_TIMING = b"queued;dur=%.3f, padded;dur=%.3f, compute;dur=%.3f, split;dur=%.3f"
REFUSED = "symjax_mlp.refused"  # a scope's key: the status serve's server answered it with
# what a model's message may hold of the server's files, for a client: a traceback's frames
# (JAX's callbacks and checkify quote one) and paths: a word holding a separator before a name,
# with the words after it that hold one (spaces in a path); a quoted one whole. 1/2 is not.
_FRAMES = re.compile(r"Traceback \(most recent call last\):\n(?:[ \t].*(?:\n|$))*")
_W = r"[^\s\"'<>|,;()=\x00]"  # a word's character (\x00: the artifact's own path, see text())
_PATH = re.compile(
    rf"(?<![^\s\"'<>|,;(=\[{{])(?={_W}*[/\\][\w.~-])"  # a word's start; a separator in it
    rf"(?:file:|[/\\~]|\.\.?[/\\]|[A-Za-z]:[/\\]"  # absolute (/ ~ C:\ \\share file:), ./ ../
    rf"|(?={_W}*[/\\]{_W}*[/\\])(?={_W}*[A-Za-z])"  # two deep, a name (not 2024/01/02)
    rf"|(?={_W}*[/\\]{_W}*\.[A-Za-z]))"  # a file
    rf"{_W}*(?: +{_W}*[/\\][\w.~-]{_W}*)*"
)
_SCANNED = 1 << 16  # a message's characters scanned (300 shown): a model may echo a body
_ADDRESS = re.compile(r" at 0x[0-9A-Fa-f]+>")  # a repr's: the server's heap layout
_QUOTED = re.compile(r"(?<![^\s(=:\[{])(['\"])([^'\"\n]{1,300}?)\1")


def require(what: str = "the symjax_mlp server", extra: str = "serve", *modules: str) -> None:
    """Imports ``modules`` (default: starlette and uvicorn), else names the extra to install."""
    modules = modules or ("starlette", "uvicorn")
    try:
        for module in modules:
            importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{what} needs the optional packages {' and '.join(modules)} ({e}). Install them "
            f"with: pip install 'symjax_mlp[{extra}]'",
            name=e.name,
        ) from e


#: At shutdown, the most seconds a closing batcher's queued work is waited for.
DRAIN_SECONDS = 30.0


def drain(batcher: Batcher, cancel: bool = False) -> None:
    """Closes ``batcher`` within :data:`DRAIN_SECONDS`; a model still running is left behind."""
    try:
        batcher.close(cancel=cancel, timeout=DRAIN_SECONDS)
    except TimeoutError:
        said = "%s: the model is still running after %g s; stopping without it."
        LOG.error(said, batcher.name, DRAIN_SECONDS)


def create_app(
    batcher: Batcher,
    *,
    max_body_bytes: int = 64 * 2**20,
    body_timeout: float = 60.0,
    max_inflight_bytes: int | None = None,
    close_batcher: bool = True,
    prefix: str = "symjax_mlp",
    request_timeout: float = 60.0,
) -> Any:
    """The ASGI app serving ``batcher`` (a ``starlette.applications.Starlette``).

    The app bounds request bodies (size, pace, bytes in flight); heads and connections only
    :func:`serve` bounds. Under your own ``uvicorn.run(app)`` (which reads a head of any size at
    any pace), pass at least ``http="h11", h11_max_incomplete_event_size=65536`` and
    ``limit_concurrency=N``, behind a proxy with a header timeout; or call :func:`serve`.

    Args:
      batcher: the :class:`~symjax_mlp.serving.Batcher` that runs the requests.
      max_body_bytes: larger request bodies are refused with 413.
      body_timeout: a client that sends nothing of its body for this many seconds, or all of
        it slower than 500 bytes/s after the first ``body_timeout`` seconds (or not within 10
        of them), is answered 408 and closed (nginx's client_body_timeout, Apache's MinRate).
      max_inflight_bytes: the most bytes all request bodies being received and decoded, and
        (under :func:`serve`) answers waiting for a client to read them, may hold together
        (default: ``4 * max_body_bytes``); past it: 503 with ``Retry-After``.
      close_batcher: close the batcher when the app shuts down: it finishes queued work,
        waited for at most 30 s (a model that never returns is left behind).
      prefix: the metric names' prefix on ``/metrics`` (a Prometheus name).
      request_timeout: a request not answered within this many seconds is answered 504 and
        cancelled if its batch has not started (nginx's ``proxy_read_timeout``); while one
        batch runs longer, ``/health`` answers 503, status ``"stuck"``.

    Raises:
      ConfigError: ``batcher`` is not an open Batcher, a limit is not a number > 0,
        ``max_inflight_bytes < max_body_bytes`` or a row of ``batcher``, or ``prefix`` is no
        Prometheus name.
      ImportError: starlette or uvicorn is missing (``pip install 'symjax_mlp[serve]'``).

    Example:
      >>> import jax.numpy as jnp
      >>> import symjax_mlp as sm
      >>> h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
      >>> b = sm.serving.Batcher(h, example=jnp.ones((1, 3)), max_batch=4)
      >>> app = sm.serving.create_app(b)
      >>> sorted(r.path for r in app.routes)
      ['/health', '/metrics', '/predict', '/signature']
      >>> b.close()
    """
    if not isinstance(batcher, Batcher):
        hint = "Batcher(model)" if callable(batcher) else "Batcher(sm.load(path))"
        raise ConfigError(
            f"create_app: expected a symjax_mlp.serving.Batcher; got {type(batcher).__name__}. "
            f"Wrap the model first: create_app({hint})."
        )
    if batcher.closed:
        raise ConfigError(
            f"create_app({batcher.name}): the batcher is closed, so every request would fail; "
            "make a new one."
        )
    require()
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    if not isinstance(prefix, str) or not METRIC_NAME.fullmatch(prefix):
        raise ConfigError(  # else a /metrics that Prometheus cannot read (or lines injected)
            f"create_app: prefix must be a Prometheus metric name ({METRIC_NAME.pattern}); "
            f"got {prefix!r}. Pass e.g. prefix='my_model'."
        )
    by_code: collections.Counter[int] = collections.Counter()  # answers, on the one loop
    limits = max_body_bytes, body_timeout, max_inflight_bytes, batcher.specs  # a row in a body
    intake = Intake(*check_limits("create_app", *limits, request_timeout=request_timeout))
    waits, public = Watch(request_timeout), Public(batcher)

    def error(status: int, e: BaseException, headers: dict[str, str] | None = None) -> Response:
        by_code[status] += 1  # a 500's message is the model's (or a bug's): its text cut
        text = public.text(e) if status == 500 else public.scrub(str(e))
        kind = short(printable(type(e).__name__), 100)  # a class may be named by a model too
        return error_body(status, kind, text, public.name, headers)

    async def predict(scope: Any, receive: Any, send: Any) -> None:  # ASGI: see App below
        hold = [0]  # the bytes this request's body holds of the shared budget
        try:
            said = await answer(scope, receive, hold)
        except asyncio.CancelledError:  # the server stops first: a 503, not uvicorn's 500
            said = error(503, asyncio.CancelledError(_STOPPED))
        except BadRequest as e:  # an answer JSON cannot hold (complex): a 406, ask for .npy
            said = error(e.status, e)
        except Exception as e:  # a bug of ours: still the documented JSON body, counted
            LOG.error("%s: answering a request failed", public.name, exc_info=e)
            said = error(500, e)
        finally:
            intake.release(hold)
        await said(scope, receive, send)

    async def answer(scope: Any, receive: Any, hold: list[int]) -> Any:
        heads = dict(reversed(scope["headers"]))  # the first of a name, as starlette reads it
        try:
            body = await intake.read(receive, hold, heads.get(b"content-length", b""))
        except BadRequest as e:  # too large, too slow, too many: the rest is not read
            retry = {"Retry-After": "1"} if e.status == 503 else {}
            return error(e.status, e, {"Connection": "close", **retry})
        except ClientDisconnect:  # nobody to answer (499, as nginx counts it), or serve's 400
            by_code[scope.get(REFUSED, 499)] += 1
            return Response(status_code=499)
        try:
            media = heads.get(b"content-type", b"").decode("latin-1")
            inputs, as_npy = decode(batcher, body, media, heads, scope["headers"])
            del body
            intake.release(hold)  # decoded: the arrays are the queue's to bound (max_queue)
            request = batcher.asubmit(*inputs, alone=connections[0] == 1)  # done if alone
        except (BadRequest, SignatureError) as e:  # unreadable (its status), or not the model's
            return error(getattr(e, "status", 422), e)
        except OverloadError as e:
            return error(503, e, {"Retry-After": "1"})
        except Exception as e:  # closed: shutting down; else the client's bytes provoked it
            if isinstance(e, RuntimeError) and batcher.closed:
                return error(503, e)
            said = f"{type(e).__name__}: {public.text(e)}"
            return error(400, BadRequest(400, f"the body could not be read ({said})."))
        task = asyncio.current_task()  # one timer per loop for all: see _intake
        (deadlines := waits.on(task.get_loop())).set(task)
        try:
            out = await request
        except asyncio.CancelledError as e:
            late = deadlines.clear(task)  # cancelled by request_timeout's timer
            if late:
                task.uncancel()
            if task.cancelling():  # the server stops: not an answer
                raise
            if late:
                return error(504, TimeoutError(_LATE.format(request_timeout)))
            # close(cancel=True) dropped it (503), or the model raised CancelledError (500)
            if request.future.cancelled():
                return error(503, e)
            return failed(e, request)
        except BaseException as e:  # the model raised (SystemExit too: its batch's error)
            return failed(e, request)
        finally:
            if deadlines.clear(task):  # late as it ended: the cancel is taken back
                task.uncancel()
        data, kind = to_npy(out) if as_npy else to_json(out)
        t1, t2, t3, t4, rows, bucket, n = request.batch_record  # set before the result: Lane.settle
        took = ((t1 - request.t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t4 - t3) * 1e3)
        head = [  # as uvicorn takes it (starlette's Response copies, re-encodes each header)
            (b"content-length", b"%d" % len(data)), (b"content-type", kind.encode()),
            (b"server-timing", _TIMING % took),
            (b"x-batch", b"rows=%d; requests=%d; bucket=%d" % (rows, n, bucket)),
        ]  # fmt: skip

        async def ok(scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": head})
            await send({"type": "http.response.body", "body": data})

        by_code[200] += 1  # once the answer is made: what /metrics counts is what was sent
        return ok

    def failed(e: BaseException, request: Any) -> Response:
        """The 500 of a model that raised ``e`` (as it raised it, not the RuntimeError from it
        that an AsyncRequest hands on), logged with its traceback once per batch."""
        if type(e) is RuntimeError and isinstance(e.__cause__, UNAWAITABLE):
            e = e.__cause__
        if e is not logged[0]:  # a batch's requests, woken in one pass, share it: one log
            logged[0] = e  # until the pass ends (else it holds the batch's frames)
            asyncio.get_running_loop().call_soon(logged.__setitem__, 0, None)
            LOG.error(
                "%s: the model raised %s on a batch (this request's rows: %d); its requests are "
                "answered 500", public.name, printable(type(e).__name__), request.rows, exc_info=e,
            )  # fmt: skip
        return error(500, e)

    logged: list[BaseException | None] = [None]  # the error logged in this pass of the loop

    async def health(request: Request) -> Response:
        s = batcher.stats
        status = "closing" if batcher.closed else "stuck" if s.busy_s > request_timeout else "ok"
        body = {"status": status, "model": public.name, "queue_depth": s.queue_depth}
        body["completed"] = s.completed
        if status == "stuck":
            body["message"] = (
                f"a batch has run for {s.busy_s:.0f} s, past request_timeout={request_timeout:g} "
                "s: the model may never return; restart the server if it stays stuck."
            )
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def metrics(request: Request) -> Response:
        codes = [(f'{{code="{c}"}}', n) for c, n in sorted(by_code.items())]
        http = [("requests_total", "counter", _ANSWERS, codes)]
        http += [("held_bytes", "gauge", _HELD, intake.held)]
        text = batcher.stats.to_prometheus(f"{prefix}_batcher") + exposition(f"{prefix}_http", http)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def signature(request: Request) -> Response:
        return JSONResponse({
            "inputs": [s.to_json() for s in batcher.specs], "max_batch": batcher.max_batch,
            "buckets": list(batcher.buckets), "model": public.name,
            "params_as_constants": bool(getattr(batcher.model, "params_as_constants", False)),
            "merges": batcher.merges,  # False: each request runs alone, at its own rows
            "why_alone": short(public.scrub(batcher.why_alone)),
        })  # fmt: skip

    async def unrouted(request: Request, e: HTTPException) -> Response:
        """Starlette's own 404 and 405, in the documented JSON error body."""
        allowed = {"Allow": e.headers["Allow"]} if e.headers and "Allow" in e.headers else {}
        path = short(printable(public.scrub(request.url.path)))
        what = "a wrong method" if e.status_code == 405 else "a wrong path"
        if (bare := path.rstrip("/")) != path and any(r.path == bare for r in routes):
            what = f"drop the trailing slash: {bare}"
        said = f"no endpoint takes {request.method} {path} ({what}); the endpoints: {ENDPOINTS}."
        kind = "NotFound" if e.status_code == 404 else "MethodNotAllowed"
        return error_body(e.status_code, kind, said, public.name, allowed)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any):
        try:
            yield
        except asyncio.CancelledError:  # a second Ctrl-C: uvicorn stops now, in no error
            return
        if close_batcher:
            await asyncio.get_running_loop().run_in_executor(None, drain, batcher)

    # POST /predict goes straight to its endpoint, past starlette's layers (a Request each, its
    # middleware, routing), never past a user's (add_middleware); mounted, it is routed, as an
    # ASGI app (a staticmethod: no function)
    class App(Starlette):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            ours = scope["type"] == "http" and scope["path"] == "/predict"  # mounted: routed
            ours = ours and scope["method"] == "POST" and not scope.get("root_path")
            if ours and not self.user_middleware:
                return await predict(scope, receive, send)
            await super().__call__(scope, receive, send)

    routes = [Route("/predict", staticmethod(predict), methods=["POST"])]
    routes += [Route(f"/{f.__name__}", f, methods=["GET"]) for f in (health, metrics, signature)]
    app = App(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: unrouted})
    app.router.redirect_slashes = False  # POST /predict/: the JSON 404, not an empty 307
    app.state.answered, app.state.model, app.state.intake = by_code, public.name, intake  # serve's
    app.state.connections = connections = [0]  # serve's count (1: no other request can come)
    return app


def error_body(status: int, kind: str, message: str, model: str, headers: Any = None) -> Any:
    """The JSON error body of every refusal (the app's; serve's, before the app), for starlette."""
    from starlette.responses import JSONResponse

    return JSONResponse({"error": kind, "message": message, "model": model}, status, headers)


def load_entry(artifact: Any, entry: str | None = None, **options: Any) -> LoadedModel:
    """``load(artifact, **options)`` at its entry point ``entry`` (``None``: its default)."""
    model = load(artifact, **options)
    return model if entry is None else model[entry]


def model_name(model: LoadedModel) -> str:
    """Its name for clients: the manifest's (cut), and the entry point's if several."""
    name = short(printable(str(model.manifest.get("name") or "model")), 100)
    return name + (f"[{model.entry!r}]" if len(model.entries) > 1 else "")


class Public:
    """What a client may see of the model: its name, never the server's path to it."""

    def __init__(self, batcher: Batcher) -> None:
        model, self.name = batcher.model, batcher.name
        self._paths: re.Pattern[str] | None = None
        if isinstance(model, LoadedModel):
            given = str(model.path)
            forms = {given, os.path.abspath(given), os.path.realpath(given)}
            forms |= {printable(f) for f in forms}
            # a bare name (serve a, serve .) only where quoted, as Batcher(a): not "a readable"
            self._paths = re.compile("|".join(
                re.escape(f) if os.sep in f else rf"(?<=[(\"']){re.escape(f)}(?=[)\"'/])"
                for f in sorted((f for f in forms if f), key=len, reverse=True)
            ))  # fmt: skip
            self._name = model_name(model)
            self.name = self.scrub(batcher.name)

    def scrub(self, text: str) -> str:
        """``text`` with each form of the artifact's server path as its name; no memory address."""
        text = _ADDRESS.sub(">", text)
        return text if self._paths is None else self._paths.sub(lambda _: self._name, text)

    def text(self, e: BaseException) -> str:
        """``e``'s message for a client: scrubbed, escaped (:func:`printable`), cut to 300."""
        try:
            text = str(e)
        except BaseException as failed:  # its __str__ raised: e's class still names it
            text = f"(its message could not be read: its __str__ raised {type(failed).__name__})"
        own = self._name if self._paths is not None else ""  # its files: {name}/weights.npz
        cut = max(len(text) - _SCANNED, 0)
        text = _ADDRESS.sub(">", text[:_SCANNED].replace("\x00", "\\x00"))
        text = _FRAMES.sub("", self._paths.sub("\x00", text) if own else text)
        text = _QUOTED.sub(lambda m: f"{m[1]}<path>{m[1]}" if _PATH.search(m[2]) else m[0], text)
        text = _PATH.sub(lambda m: "<path>" + m[0][len(m[0].rstrip(".:")) :], text)  # keep a "."
        return short(printable(text.replace("\x00", own) if own else text), more=cut)


def print_ready(artifact: Any) -> Callable[[str], None]:
    """``serve``'s default ``ready``: prints the URL it serves ``artifact`` on."""
    return lambda url: print(printable(f"serving {artifact} on {url} ({ENDPOINTS})"), flush=True)
