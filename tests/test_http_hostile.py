"""The HTTP server against clients that are slow, greedy or odd (issue 32, items 5, 7 and 8).

One ``symjax-mlp serve`` process with small limits, talked to over raw sockets on 127.0.0.1:
slow clients are answered 408 or 503 and dropped within the body timeout, a crowd of them holds
at most ``--max-inflight-bytes``, connections past ``--max-connections`` are refused at once,
JSON a cast cannot hold (10**400, booleans) is a 422 with the JSON error body, and no answer
names the artifact's path on the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import symjax_mlp as sm

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

BODY_TIMEOUT = 2.0
MAX_BODY = 2**20
MAX_INFLIGHT = 3 * 2**20
MAX_CONNECTIONS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    art = sm.chapter.export_mlp(tmp_path_factory.mktemp("hostile") / "secret_dir" / "mlp")
    cmd = [sys.executable, "-m", "symjax_mlp", "serve", str(art.path), "--host", "127.0.0.1"]
    cmd += ["--port", "0", "--max-batch", "4", "--body-timeout", str(BODY_TIMEOUT)]
    cmd += ["--max-body-bytes", str(MAX_BODY), "--max-inflight-bytes", str(MAX_INFLIGHT)]
    cmd += ["--max-connections", str(MAX_CONNECTIONS)]
    with _serving(cmd) as (proc, url):
        yield url, art.path, proc.pid


@contextlib.contextmanager
def _serving(cmd):
    """``symjax-mlp serve`` run by ``cmd``: the process and its URL, once it serves; at the
    end of the block, interrupted (unless it ended), then killed if it does not stop."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = None
    deadline = time.monotonic() + 120
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            if sel.select(timeout=0.5):
                found = re.search(r"(http://127\.0\.0\.1:\d+)", proc.stdout.readline())
                url = found and found.group(1)
    try:
        assert url, f"the server did not start: {proc.poll() and proc.communicate()[1][-3000:]}"
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def _port(url):
    return int(url.rsplit(":", 1)[1])


def _post(url, body, kind="application/json"):
    req = urllib.request.Request(
        url + "/predict", data=body, headers={"Content-Type": kind}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()


def _get(url, path):
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return r.read()


def _count(url, code):
    found = re.search(
        rf'http_requests_total\{{code="{code}"\}} (\d+)', _get(url, "/metrics").decode()
    )
    return int(found.group(1)) if found else 0


def _slow_client(url, promised, sent):
    """A socket that promised ``promised`` bytes of body, sent ``sent`` and went quiet."""
    s = socket.create_connection(("127.0.0.1", _port(url)), timeout=30)
    head = (
        f"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {promised}\r\n\r\n"
    )
    s.sendall(head.encode() + b"[" * sent)
    return s


def _answer(s, limit):
    """``(status, seconds until the server closed the connection)``."""
    start = time.monotonic()
    s.settimeout(limit)
    data = b""
    with contextlib.suppress(TimeoutError, ConnectionError):
        while chunk := s.recv(65536):
            data += chunk
    closed = time.monotonic() - start
    found = re.match(rb"HTTP/1\.1 (\d+)", data)
    return (int(found.group(1)) if found else None), closed


def _rss(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def test_slow_clients_are_dropped_and_hold_at_most_the_inflight_bound(server):
    """Item 5: 8 clients promise 1 MiB and send 600 kB: they held ~100 MB for ever before."""
    url, _, pid = server
    before = {c: _count(url, c) for c in (408, 503)}
    rss = _rss(pid)
    start = time.monotonic()
    clients = [_slow_client(url, MAX_BODY, 600_000) for _ in range(8)]
    try:
        time.sleep(0.5)  # all of it has arrived
        held = _rss(pid) - rss
        assert held < MAX_INFLIGHT + 16 * 2**20, held  # 4.8 MB sent; what is kept is bounded
        x = np.zeros((1, 512), np.float32)  # the server still answers the others
        assert _post(url, json.dumps({"inputs": x.tolist()}).encode())[0] == 200
        answers = [_answer(s, BODY_TIMEOUT + 20) for s in clients]
    finally:
        for s in clients:
            s.close()
    codes = sorted(code for code, _ in answers)
    assert set(codes) <= {408, 503} and 408 in codes and 503 in codes, codes
    # over the bound at once (503), the rest once they were quiet for body_timeout (408)
    assert max(t for _, t in answers) < BODY_TIMEOUT + 10
    assert time.monotonic() - start < BODY_TIMEOUT + 15
    assert _count(url, 408) - before[408] == codes.count(408)
    assert _count(url, 503) - before[503] == codes.count(503)
    # the budget was given back: a body as large as the bound allows is read again
    x = np.zeros((2, 512), np.float32)
    assert _post(url, json.dumps({"inputs": x.tolist()}).encode())[0] == 200


def test_a_timed_out_body_is_the_json_error_body(server):
    url, _, _ = server
    s = _slow_client(url, 1000, 10)
    try:
        s.settimeout(BODY_TIMEOUT + 20)
        data = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            while chunk := s.recv(65536):
                data += chunk
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    answer = json.loads(body)
    assert answer["error"] == "BadRequest" and "body_timeout=2" in answer["message"]


class _Body:
    """A request whose body comes as ``chunks``, each after its delay (``None``: never)."""

    def __init__(self, *chunks):
        self._chunks = list(chunks)

    async def receive(self):
        delay, chunk = self._chunks.pop(0)
        if delay is None:
            await asyncio.Event().wait()
        await asyncio.sleep(delay)
        return {"type": "http.request", "body": chunk, "more_body": bool(self._chunks)}


@pytest.mark.parametrize(("length", "status"), [(b"\xb2", None), (b"+9999", None), (b"9999", 413)])
def test_a_content_length_that_is_no_ascii_number_is_left_to_the_reads(length, status):
    """Content-Length: ² (latin-1, which an ASGI server may pass on) is a digit to str.isdigit
    but no int's: the 413 check's int() raised, a 500 with a traceback. The body's own size
    is checked as it is read."""
    from symjax_mlp.serving._app import BadRequest
    from symjax_mlp.serving._intake import Intake

    request = _Body((0.0, b"[[1, 2]]"))

    async def read():
        try:
            return await Intake(1000, 1.0, 4000).read(request.receive, [0], length)
        except BadRequest as e:
            return e.status

    assert asyncio.run(read()) == (status or b"[[1, 2]]")


def test_each_body_read_has_its_own_deadline_moved_on_as_chunks_arrive():
    """One timer watches every read on a loop: a quiet body is a 408 after body_timeout, while
    the reads beside it go on (slow chunks, each within the timeout, read whole); a cancel
    from elsewhere (the server stopping) stays a cancel; a second loop has a timer too."""
    from symjax_mlp.serving._app import BadRequest
    from symjax_mlp.serving._intake import Intake

    intake = Intake(1000, 0.2, 4000)

    async def read(request):
        hold = [0]
        try:
            return await intake.read(request.receive, hold)
        except BadRequest as e:
            return e.status
        finally:
            intake.release(hold)

    async def crowd():
        slow = _Body(*[(0.1, b"ab" * 50)] * 5)  # 0.5 s in all, at 1000 bytes/s
        quiet = _Body((0.0, b"a"), (None, b""))
        whole = _Body((0.0, b"abc"))
        start = time.monotonic()
        got = await asyncio.gather(read(slow), read(quiet), read(whole), read(_Body((0.3, b""))))
        return got, time.monotonic() - start

    for _ in range(2):  # each asyncio.run: a new loop
        got, took = asyncio.run(crowd())
        assert got == [b"ab" * 250, 408, b"abc", 408] and took < 5, (got, took)
        assert intake.held == 0 and intake._reads._last.due == {}

    async def stopped():
        task = asyncio.create_task(read(_Body((None, b""))))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(stopped())


def test_a_body_trickled_below_the_minimum_rate_is_a_408_however_often_it_sends():
    """A byte now and then, each within body_timeout, held a connection for hours (and
    max_connections such clients locked everyone out): the whole body must come within
    body_timeout + its size / MIN_BODY_RATE seconds, as Apache's mod_reqtimeout reads it. A
    client behind for a moment, then ahead, is read whole, and no timer is left behind."""
    from symjax_mlp.serving._app import BadRequest
    from symjax_mlp.serving._intake import MIN_BODY_RATE, Intake

    intake = Intake(10_000, 0.2, 40_000)

    async def read(request):
        hold = [0]
        try:
            got = await intake.read(request.receive, hold)
            await asyncio.sleep(0.3)  # past any deadline of the read: nothing cancels it
            return got
        except BadRequest as e:
            return e.status, str(e)
        finally:
            intake.release(hold)

    async def crowd():
        trickle = _Body(*[(0.15, b"[")] * 20)  # 7 bytes/s: 3 s, each byte within 0.2 s
        late = _Body((0.15, b"["), (0.02, b"1" * 500), (0.1, b"]"))  # behind, then ahead
        start = time.monotonic()
        return await asyncio.gather(read(trickle), read(late)), time.monotonic() - start

    ((status, said), late), took = asyncio.run(crowd())
    assert status == 408 and late == b"[" + b"1" * 500 + b"]" and took < 1.5, (said, took)
    assert said.startswith("the body came too slowly: 1 bytes in ") and (
        f"under {MIN_BODY_RATE} bytes/s after its first 0.2 s (body_timeout=0.2)" in said
    ), said
    assert intake.held == 0 and intake._reads._last.due == {}


def test_a_body_at_the_minimum_rate_still_ends_within_a_cap(monkeypatch):
    """A body trickled at MIN_BODY_RATE with a Content-Length near max_body_bytes held its
    connection for up to 37 h (64 MiB at 500 bytes/s; max_connections of them locked everyone
    out): however fast it comes, the whole body must end within MAX_BODY_TIMEOUTS x
    body_timeout (patched here to 3 x 0.2 s). A body ending within it is read whole."""
    from symjax_mlp.serving import _intake

    monkeypatch.setattr(_intake, "MAX_BODY_TIMEOUTS", 3, raising=False)
    intake = _intake.Intake(10_000, 0.2, 40_000)

    async def read(request):
        hold = [0]
        try:
            return await intake.read(request.receive, hold)
        except _intake.BadRequest as e:
            return e.status, str(e)
        finally:
            intake.release(hold)

    async def crowd():
        steady = _Body(*[(0.05, b"1" * 100)] * 20)  # 2000 bytes/s for 1 s: past 0.6 s
        start = time.monotonic()
        got = await asyncio.gather(read(steady), read(_Body(*[(0.05, b"1" * 100)] * 8)))
        return got, time.monotonic() - start

    ((status, said), quick), took = asyncio.run(crowd())
    assert status == 408 and quick == b"1" * 800 and took < 0.9, (said, took)
    assert said.startswith("the body took too long: ") and (
        " s, past 3 x (body_timeout=0.2). Send the whole body at once." in said
    ), said
    assert intake.held == 0 and intake._reads._last.due == {}


def test_refusals_before_the_app_are_counted_on_metrics(server):
    """A head too large (431), too slow (408, see the test of heads that never end) or no HTTP
    (400) was refused before the app saw it, and /metrics counted none of it: an operator saw
    nothing of an attack."""
    url, _, _ = server
    before = {code: _count(url, code) for code in (400, 431)}
    sent = [b"GARBAGE\r\n\r\n", b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 80_000]
    clients = [socket.create_connection(("127.0.0.1", _port(url)), timeout=30) for _ in sent]
    try:
        for s, data in zip(clients, sent, strict=True):
            s.sendall(data)
        codes = [_answer(s, BODY_TIMEOUT + 10)[0] for s in clients]
    finally:
        for s in clients:
            s.close()
    assert codes == [400, 431], codes
    assert [_count(url, code) - before[code] for code in (400, 431)] == [1, 1]


def test_connections_past_the_limit_are_refused_at_once(server):
    """Item 5: idle connections cannot queue requests for ever; once they go, it serves."""
    url, _, _ = server
    x = json.dumps({"inputs": np.zeros((1, 512), np.float32).tolist()}).encode()
    before = _count(url, 503)
    idle = [socket.create_connection(("127.0.0.1", _port(url))) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)
        start = time.monotonic()
        req = urllib.request.Request(url + "/predict", data=x, method="POST")
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(req, timeout=30)
        assert time.monotonic() - start < 10
        with caught.value as e:  # uvicorn's own 503 was text/plain "Service Unavailable"
            assert e.code == 503 and e.headers["Content-Type"] == "application/json"
            assert e.headers["Retry-After"] == "1"
            answer = json.loads(e.read())
        assert answer["error"] == "OverloadError", answer
        assert f"max_connections={MAX_CONNECTIONS}" in answer["message"], answer
        with pytest.raises(urllib.error.HTTPError) as caught:  # any path: counted too
            urllib.request.urlopen(url + "/health", timeout=30)
        with caught.value as e:
            assert e.code == 503
    finally:
        for s in idle:
            s.close()
    deadline, refused = time.monotonic() + 10, 2  # /predict's and /health's 503
    while (code := _post(url, x)[0]) != 200:
        assert time.monotonic() < deadline, "the closed connections were never released"
        refused += code == 503
        time.sleep(0.1)
    assert _count(url, 503) == before + refused


def test_connections_past_the_limit_are_refused_as_they_open_and_hold_no_head(server):
    """A connection past max_connections was read as any other (its head, up to 64 KiB, kept
    for body_timeout) and refused only once its request was parsed: 2000 of them held 128 MB of
    a server of max_connections=12. Now each is answered 503 as it opens, and what it sends is
    dropped as it comes (the close lingers, so a client that sent its request reads the 503)."""
    url, _, pid = server
    x = json.dumps({"inputs": np.zeros((1, 512), np.float32).tolist()}).encode()
    before, rss = _count(url, 503), _rss(pid)
    idle = [socket.create_connection(("127.0.0.1", _port(url))) for _ in range(MAX_CONNECTIONS)]
    past = []
    try:
        time.sleep(0.2)
        for _ in range(PAST):
            past.append(socket.create_connection(("127.0.0.1", _port(url)), timeout=30))
            with contextlib.suppress(ConnectionError):
                past[-1].sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 60_000)
        time.sleep(0.5)
        held = _rss(pid) - rss
        head, _, said = _answer_of(past[-1])
    finally:
        for s in idle + past:
            s.close()
    assert held < PAST * 2**14, held  # 16 KB a connection; a head each was 64 KB
    assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), head
    assert json.loads(said)["error"] == "OverloadError" and "max_connections=12" in str(said)
    deadline, refused = time.monotonic() + 10, PAST
    while (code := _post(url, x)[0]) != 200:
        assert time.monotonic() < deadline, "the closed connections were never released"
        refused += code == 503
        time.sleep(0.1)
    assert _count(url, 503) == before + refused


PAST = 400


_POST = b"POST /predict HTTP/1.1\r\nHost: x\r\n"


@pytest.mark.parametrize(
    ("request_", "says"),
    [
        (b"GARBAGE\r\n\r\n", "Invalid method encountered"),
        (_POST + b"Content-Length: -5\r\n\r\n", "Invalid character in Content-Length"),
        (_POST + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n", "Duplicate Content-Length"),
        (_POST + b"Content-Length: " + b"9" * 30 + b"\r\n\r\n", "Content-Length overflow"),
        (
            _POST + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
            "Transfer-Encoding can't",
        ),
        (_POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", "Invalid character in chunk size"),
    ],
    ids=["garbage", "negative_length", "two_lengths", "huge_length", "length_and_chunked", "chunk"],
)
def test_a_request_that_is_not_http_is_the_json_400(server, request_, says):
    """uvicorn answered these itself, in text/plain: "Invalid HTTP request received.", the
    JSON 400 said so too: not what was wrong (a Content-Length that lies, a chunk's size)."""
    url, _, _ = server
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=30) as s:
        s.sendall(request_)
        data = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            while chunk := s.recv(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, data
    answer = json.loads(body)
    assert answer["error"] == "BadRequest" and "not HTTP/1.1" in answer["message"], answer
    pytest.importorskip("httptools")  # h11 words them its own way
    assert f"reads ({says}" in answer["message"], answer


def test_max_connections_of_one_serves_a_lone_client():
    """uvicorn's limit_concurrency counts the asking connection: limit_concurrency=1 (serve's
    max_connections=1) answered every request 503, even the only one."""
    from symjax_mlp.serving._server import bounded_heads, limited

    with sm.serving.Batcher(lambda x: x, example=np.zeros((1, 2), np.float32)) as b:
        app = sm.serving.create_app(b, close_batcher=False)
        heads = bounded_heads(5.0, app)
        app = limited(app, heads, 1)
        with _in_thread(app, http=heads) as url:
            body = json.dumps({"inputs": [[1.0, 2.0]]}).encode()
            for _ in range(2):  # the connection of the first has gone
                code, raw = _post(url, body)
                assert code == 200 and json.loads(raw) == {"outputs": [[1.0, 2.0]]}, raw
            with socket.create_connection(("127.0.0.1", _port(url))):  # a second one: 503
                time.sleep(0.3)
                code, raw = _post(url, body)
            assert code == 503 and json.loads(raw)["error"] == "OverloadError", raw


def test_max_connections_and_the_apps_lone_request_read_one_count_of_connections():
    """serve counted its open connections twice, moved at the same lines: its protocol's (for
    max_connections and the 503 past it) and its app's (a request alone on its server runs at
    once). Now there is one, the app's, which the protocol moves and both read."""
    from symjax_mlp.serving._server import bounded_heads, limited

    with sm.serving.Batcher(lambda x: x, example=np.zeros((1, 2), np.float32)) as b:
        app = sm.serving.create_app(b, close_batcher=False)
        heads, count = bounded_heads(5.0, app), app.state.connections
        assert heads.connections is count and not hasattr(heads, "open")
        body = json.dumps({"inputs": [[1.0, 2.0]]}).encode()
        with _in_thread(limited(app, heads, 2), http=heads) as url:
            address = ("127.0.0.1", _port(url))
            with socket.create_connection(address), socket.create_connection(address):
                _until(lambda: count[0] == 2, f"{count[0]} connections counted, not 2")
                code, raw = _post(url, body)  # a third: past max_connections=2, as it opens
                assert code == 503, raw
                assert "has 3 connections open, past max_connections=2" in raw.decode(), raw
            _until(lambda: count[0] == 0, f"{count[0]} connections counted once all closed")
            assert _post(url, body) == (200, b'{"outputs":[[1.0,2.0]]}')
            _until(lambda: count[0] == 0, "the answered connection was never counted closed")
            count[0] = 2  # as the app reads it: a request alone, or one of two (test_serving)
            code, raw = _post(url, body)  # 3 now: past max_connections=2, as it opens
            assert code == 503 and "has 3 connections open" in raw.decode(), raw


def test_a_model_raising_cancelled_error_and_a_cancelling_close_are_json_answers():
    """The app re-raised every CancelledError as its own: uvicorn answered a text/plain 500
    and logged a traceback, for a model that raised it (alone or batched: now the JSON 500)
    and for the requests that close(cancel=True) dropped (now the JSON 503)."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    gate, entered = threading.Event(), threading.Event()

    def model(x):
        if (x[:, 0] == 9).any():
            entered.set()
            assert gate.wait(30), "the test never opened the gate"
        if (x[:, 0] == 7).any():
            raise asyncio.CancelledError("boom")
        return x * 2

    def busy(b):  # the lane waits at the gate once this returns
        entered.clear()
        future = b.submit(np.full((1, 2), 9, np.float32))
        assert entered.wait(30), "the gated request never ran"
        return future

    def queued(b, n):
        deadline = time.monotonic() + 30
        while b.stats.queue_depth < n:
            assert time.monotonic() < deadline, "the requests never queued"
            time.sleep(0.02)

    def body(v):
        return json.dumps({"inputs": [[v, 0.0]]}).encode()

    boom = {"error": "CancelledError", "message": "boom", "model": "Batcher(model)"}
    with (
        sm.serving.Batcher(model, example=np.zeros((1, 2), np.float32), max_batch=4) as b,
        _in_thread(sm.serving.create_app(b, close_batcher=False), lifespan="off") as url,
        ThreadPoolExecutor(2) as pool,
    ):
        code, raw = _post(url, body(7.0))  # alone: run on the loop
        assert code == 500 and json.loads(raw) == boom, raw
        gated = busy(b)
        posts = [pool.submit(_post, url, body(v)) for v in (7.0, 1.0)]
        queued(b, 2)
        gate.set()  # the two run as one batch, which raises
        assert [(c, json.loads(raw)) for c, raw in (p.result(30) for p in posts)] == [
            (500, boom)
        ] * 2
        gated.result(30)
        gate.clear()
        gated = busy(b)
        posts = [pool.submit(_post, url, body(1.0)) for _ in range(2)]
        queued(b, 2)
        closer = threading.Thread(target=b.close, kwargs={"cancel": True})
        closer.start()
        try:
            for code, raw in (p.result(30) for p in posts):
                assert code == 503 and "closed with cancel=True" in json.loads(raw)["message"]
        finally:
            gate.set()
            closer.join(30)
        gated.result(30)


@contextlib.contextmanager
def _wide(send_timeout, rows=8, **limits):
    """serve's protocol over a model answering 80 kB a row (8 rows: 1.3 MB of JSON), answers
    left unread dropped after ``send_timeout`` s: its URL, protocol class and app's intake."""
    from symjax_mlp.serving._server import bounded_heads

    def wide(x):
        return np.repeat(x, 10_000, axis=1)

    with sm.serving.Batcher(wide, example=np.zeros((1, 2), np.float32), max_batch=rows) as b:
        app = sm.serving.create_app(b, close_batcher=False, **limits)
        heads = bounded_heads(send_timeout, app=app)
        with _in_thread(app, sndbuf=2**15, http=heads) as url:
            yield url, heads, app.state.intake


def _reader(url, rcvbuf=4096):
    """A connection whose receive buffer is ``rcvbuf`` bytes (set before the window is)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect(("127.0.0.1", _port(url)))
    return s


def _until(done, what, limit=20.0):
    deadline = time.monotonic() + limit
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


_WIDE = json.dumps({"inputs": [[1.5, 2.5]] * 8}).encode()
_WIDE_POST = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(_WIDE)


def test_a_client_that_reads_no_answer_is_dropped_within_the_timeout():
    """A client that pipelines requests and never reads the answers held its connection (and
    megabytes of answers) for ever: nginx's send_timeout. Now it is dropped once it has taken
    nothing of them for body_timeout seconds (head_timeout here), and their bytes given back."""
    with _wide(1.0) as (url, heads, intake), _reader(url) as s:
        s.settimeout(2)
        with contextlib.suppress(TimeoutError, ConnectionError):
            for _ in range(100):  # more answers than the buffers between us hold
                s.sendall(_WIDE_POST + _WIDE)
        _until(lambda: intake.held, "no answer waited for the client")  # nothing is read here
        start = time.monotonic()
        _until(lambda: not heads.connections[0], "the connection was never dropped")
        assert time.monotonic() - start < 10 and intake.held == 0
        code, raw = _post(url, _WIDE)  # the others are served
        assert code == 200 and len(json.loads(raw)["outputs"]) == 8


def _held_on_metrics(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return int(re.search(r"^symjax_mlp_http_held_bytes (\d+)$", r.read().decode(), re.M)[1])


def test_answers_left_unread_count_in_the_inflight_bytes_until_they_go():
    """Clients asking for a 1.3 MB answer and reading none held connections x answer bytes in
    write buffers: max_inflight_bytes bounded bodies only. Now the bytes waiting for a client
    count as bodies do: a body past the bound is the 503 with Retry-After, and every byte is
    given back as the clients go (closed, or dropped by the send timeout)."""
    with _wide(1.0, max_body_bytes=2**16, max_inflight_bytes=2**20) as (url, heads, intake):
        for _ in range(2):
            clients = [_reader(url) for _ in range(4)]
            for s in clients:
                s.sendall(_WIDE_POST + _WIDE)
            _until(lambda: intake.held > 2**20, f"the answers held {intake.held} bytes")
            assert _held_on_metrics(url) > 2**20  # what /metrics shows an operator
            req = urllib.request.Request(url + "/predict", data=_WIDE, method="POST")
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(req, timeout=30)
            with refused.value as e:
                assert e.code == 503 and e.headers["Retry-After"] == "1"
                assert "answers" in json.loads(e.read())["message"]
            for s in clients[:2]:  # the others are dropped unread
                s.close()
            _until(lambda: heads.connections[0] == 0, "the unread clients were never dropped")
            assert intake.held == 0 and _held_on_metrics(url) == 0
            for s in clients[2:]:
                s.close()
        assert _post(url, _WIDE)[0] == 200


def test_a_client_reading_a_large_answer_slowly_but_steadily_gets_all_of_it():
    """The send timer was armed once, as an answer began to wait, and dropped the client
    head_timeout later however steadily it read: nginx's send_timeout is the time between two
    reads. A client taking a 2.6 MB answer at 2 MB/s, over 2 x head_timeout, gets all of it."""
    x = np.arange(64, dtype=np.float32).reshape(32, 2)
    buf = io.BytesIO()
    np.save(buf, x)
    npy = buf.getvalue()
    post = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-npy\r\n"
    with _wide(0.5, rows=32) as (url, _, _), _reader(url, 2**16) as s:
        s.sendall(post + b"Content-Length: %d\r\n\r\n%s" % (len(npy), npy))
        data, start = b"", time.monotonic()
        while not (body := data.partition(b"\r\n\r\n")[2]) or len(body) < 2_560_128:
            chunk = s.recv(2**15)
            assert chunk, f"dropped after {len(data)} bytes, {time.monotonic() - start:.1f} s"
            data += chunk
            time.sleep(0.015)  # at most 2 MB/s: 80 reads, 1.2 s at least
        took = time.monotonic() - start
    assert data.startswith(b"HTTP/1.1 200") and len(body) == 2_560_128 and took > 2 * 0.5, took
    np.testing.assert_array_equal(np.load(io.BytesIO(body)), np.repeat(x, 10_000, axis=1))


def test_a_pipelined_request_after_a_malformed_one_logs_no_traceback(caplog):
    """Requests, then bytes that are not HTTP, in one send: uvicorn answered the 400 and closed
    the connection, and the answers of the requests before it, written after, raised into the
    app (uvloop): a logged "Exception in ASGI application" traceback per such client."""
    import logging

    from symjax_mlp.serving._server import bounded_heads

    body = json.dumps({"inputs": [[1.0, 2.0]]}).encode()
    head = f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    with (
        sm.serving.Batcher(lambda x: x, example=np.zeros((1, 2), np.float32)) as b,
        caplog.at_level(logging.ERROR, logger="uvicorn.error"),
        _in_thread(
            app := sm.serving.create_app(b, close_batcher=False),
            http=bounded_heads(5.0, app),
            log_level="error",
            log_config=None,  # the records reach caplog
        ) as url,
    ):
        for n in (1, 5, 20):
            with socket.create_connection(("127.0.0.1", _port(url)), timeout=30) as s:
                s.sendall((head.encode() + body) * n + b"GARBAGE\r\n\r\n")
                with contextlib.suppress(TimeoutError, ConnectionError):
                    while s.recv(65536):
                        pass
        assert _post(url, body)[0] == 200
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


def test_a_second_interrupt_answers_what_is_in_flight_and_prints_no_traceback(tmp_path):
    """A second Ctrl-C while a request was in flight: its client got uvicorn's text/plain 500,
    and the terminal two tracebacks (the request's and the app's lifespan, cancelled)."""
    art = sm.chapter.export_mlp(tmp_path / "mlp", sizes=(2,), in_features=2)
    cmd = [sys.executable, "-m", "symjax_mlp", "serve", str(art.path), "--port", "0"]
    with _serving([*cmd, "--body-timeout", "60"]) as (proc, url):
        s = _slow_client(url, 1000, 10)  # half a body: the shutdown waits for it
        try:
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
            time.sleep(1)
            assert proc.poll() is None, "the first interrupt did not wait for the request"
            proc.send_signal(signal.SIGINT)
            code, _ = _answer(s, 30)
        finally:
            s.close()
        _, err = proc.communicate(timeout=60)
    assert code == 503 and proc.returncode == 0, (code, err)
    assert "Traceback" not in err, err


@contextlib.contextmanager
def _in_thread(app, sndbuf=None, **config):
    """``app`` served by uvicorn on a thread of this process: its URL, until the block ends;
    ``sndbuf``: its connections' kernel send buffer (else grown to MBs, so writes never wait)."""
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, **{"log_level": "critical", **config}))
    sock = socket.socket()
    if sndbuf:  # accepted connections inherit it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_a_body_past_the_limit_sent_whole_reads_its_413_not_a_reset(server):
    """The 413 was sent and the connection closed with the body unread: the client (urllib,
    which sends the whole body first) got a connection reset instead. Now the close lingers."""
    url, _, _ = server
    for size in (8 * MAX_BODY, 32 * MAX_BODY):
        code, raw = _post(url, b"[" * size)
        assert code == 413 and "max_body_bytes" in json.loads(raw)["message"], raw
    x = json.dumps({"inputs": np.zeros((1, 512), np.float32).tolist()}).encode()
    assert _post(url, x)[0] == 200


def test_a_client_that_half_closes_after_its_request_is_answered(server):
    """shutdown(SHUT_WR) after the whole request (nc -N): the answer was lost, as uvicorn
    closed the connection on the client's FIN. One whose body (or head) was cut short of its
    Content-Length (or last chunk) was dropped unanswered: now the JSON 400 says so."""
    url, path, _ = server
    x = np.random.default_rng(5).standard_normal((2, 512)).astype(np.float32)
    body = json.dumps({"inputs": x.tolist()}).encode()
    head = f"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n"
    chunked = (
        b"POST /predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n[[1,2\r\n"
    )
    for sent in (head.encode() + body, head.encode() + body[:-10], chunked, head[:20].encode()):
        s = socket.create_connection(("127.0.0.1", _port(url)), timeout=30)
        try:
            s.sendall(sent)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(BODY_TIMEOUT + 10)
            data = b""
            with contextlib.suppress(ConnectionError):
                while chunk := s.recv(65536):
                    data += chunk
        finally:
            s.close()
        status, _, answer = data.partition(b"\r\n\r\n")
        if sent != head.encode() + body:
            assert status.startswith(b"HTTP/1.1 400"), data
            said = json.loads(answer)["message"]
            assert said.startswith("the client ended the request (shut down its sending side)")
            assert ("in its headers" in said) == (sent == head[:20].encode()), said
            continue
        assert status.startswith(b"HTTP/1.1 200"), data
        want = np.asarray(sm.load(path)(x))
        np.testing.assert_allclose(json.loads(answer)["outputs"], want, rtol=1e-5, atol=1e-6)


def test_a_head_that_never_comes_or_never_ends_is_closed_within_the_body_timeout(server):
    """Connections that sent nothing, or a header line now and then, were kept for ever (and
    max_connections of them shut everyone out): nginx's client_header_timeout."""
    url, _, _ = server
    before = _count(url, 408)
    quiet = socket.create_connection(("127.0.0.1", _port(url)))
    dribbling = socket.create_connection(("127.0.0.1", _port(url)))
    try:
        dribbling.sendall(b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        start = time.monotonic()
        dribbling.settimeout(0.5)
        data = b""
        while not data and time.monotonic() - start < BODY_TIMEOUT + 10:
            with contextlib.suppress(TimeoutError):
                dribbling.sendall(b"X-More: 1\r\n")
                data = dribbling.recv(65536)
        assert data.startswith(b"HTTP/1.1 408"), data
        answer = json.loads(data.partition(b"\r\n\r\n")[2])
        assert answer["error"] == "BadRequest" and "headers did not arrive" in answer["message"]
        code, closed = _answer(quiet, BODY_TIMEOUT + 10)
        assert code is None and closed < BODY_TIMEOUT + 5  # closed, with nothing to say
    finally:
        quiet.close()
        dribbling.close()
    assert _count(url, 408) == before + 1  # the 408 is counted on /metrics (it was not)


def test_a_head_past_64_kib_is_431_and_not_held(server):
    """A 100 MB header was read into memory whole (uvicorn over httptools has no limit)."""
    url, _, pid = server
    rss = _rss(pid)
    s = socket.create_connection(("127.0.0.1", _port(url)), timeout=30)
    try:
        s.sendall(b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        with contextlib.suppress(ConnectionError):
            for _ in range(100):
                s.sendall(b"a" * 2**20)
        _, closed = _answer(s, 30)  # the 431 may be lost to the reset of what is unread
    finally:
        s.close()
    assert closed < 10 and _rss(pid) - rss < 32 * 2**20
    s = socket.create_connection(("127.0.0.1", _port(url)), timeout=30)
    try:
        s.sendall(b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 80_000)
        code, _ = _answer(s, 30)
    finally:
        s.close()
    assert code == 431
    x = json.dumps({"inputs": np.zeros((1, 512), np.float32).tolist()}).encode()
    req = urllib.request.Request(
        url + "/predict", data=x, method="POST",
        headers={"Content-Type": "application/json", "X-Pad": "a" * 60_000},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as r:  # a long head under the bound is read
        assert r.status == 200


def test_a_head_sent_while_the_request_before_it_runs_is_bounded_too():
    """The next request's head, sent while the model ran on the one before it, was read into
    memory at any size (39 MB in 2.5 s here) and never timed: the connection reads no more
    until that answer is sent (as uvicorn over h11 does), then bounds the head as any."""
    from symjax_mlp.serving._server import bounded_heads

    def slow(x):
        if (x[:, 0] == 7).any():
            time.sleep(0.5)
        return x

    body = json.dumps({"inputs": [[7.0, 0.0]]}).encode()
    head = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    with (
        sm.serving.Batcher(slow, example=np.zeros((1, 2), np.float32)) as b,
        _in_thread(
            app := sm.serving.create_app(b, close_batcher=False), http=bounded_heads(5.0, app)
        ) as url,
        socket.create_connection(("127.0.0.1", _port(url)), timeout=30) as s,
    ):
        s.sendall(head + body)
        time.sleep(0.2)  # the model runs
        s.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 80_000)
        data = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            while chunk := s.recv(65536):
                data += chunk
    assert re.findall(rb"HTTP/1\.1 (\d+)", data) == [b"200", b"431"], data[-300:]


def test_a_chunked_bodys_trailer_fields_are_bounded_as_a_head():
    """Trailer fields after a chunked body's last chunk were read into memory at any size (45
    MB in 3 s here) until body_timeout: past 64 KiB they are a 431, as a head is."""
    from symjax_mlp.serving._server import bounded_heads

    head = b"POST /predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    with (
        sm.serving.Batcher(lambda x: x, example=np.zeros((1, 2), np.float32)) as b,
        _in_thread(
            app := sm.serving.create_app(b, close_batcher=False, body_timeout=2.0),
            http=bounded_heads(2.0, app),
        ) as url,
        socket.create_connection(("127.0.0.1", _port(url)), timeout=30) as s,
    ):
        s.sendall(head + b"5\r\n[[1,2\r\n")
        time.sleep(0.1)  # that chunk is read: what follows holds no body
        s.sendall(b"0\r\nX-Trailer: " + b"a" * 80_000)
        head, _, said = _answer_of(s)
    assert head.startswith(b"HTTP/1.1 431") and b"trailers) passed 65536 bytes" in said, head


@pytest.mark.parametrize(
    ("inputs", "says"),
    [
        ([[10**400] + [0.0] * 511], "beyond float32's range"),  # an OverflowError: a text 500
        ([[1.5] * 511 + [10**400]], "beyond float32's range"),
        ([[True] + [0.0] * 511], "JSON booleans"),  # was taken as 1.0
        ([[False] * 512], "JSON booleans"),  # was taken as 0.0
    ],
)
def test_json_numbers_no_float_holds_and_booleans_are_422_and_counted(server, inputs, says):
    """Item 7."""
    url, _, _ = server
    before = _count(url, 422)
    code, raw = _post(url, json.dumps({"inputs": inputs}).encode())
    assert code == 422, raw
    answer = json.loads(raw)
    assert answer["error"] == "SignatureError" and says in answer["message"], answer
    assert _count(url, 422) == before + 1


def test_a_number_literal_past_float64_is_422_not_infinity(server):
    """1e400 (a number, not the Infinity literal) was read as inf and answered 200 with NaN
    outputs, where 1e39 is refused as past float32."""
    url, _, _ = server
    zeros = b", 0" * 511
    for number in (b"1e400", b"-1e400", b"1" + b"0" * 400 + b".5"):
        code, raw = _post(url, b'{"inputs": [[' + number + zeros + b"]]}")
        assert code == 422, raw
        answer = json.loads(raw)
        assert answer["error"] == "SignatureError" and "beyond float64" in answer["message"]
    code, raw = _post(url, b'{"inputs": [[-Infinity' + zeros + b"]]}")  # the literal: a float
    assert code == 200, raw


@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "stdlib"])
def test_json_bodies_read_the_same_by_either_parser(monkeypatch, fast):
    """A float input's body is parsed by orjson, and whatever orjson refuses (NaN, Infinity,
    10**400) by the standard library; an int input's always by the latter (orjson reads an
    integer past 64 bits as a float). Both read the same values: 2**64 among floats is a
    float32 number (it was refused as past float64), 10**400 and strings are refused, and an
    int input takes -2**63 but not -2**63 - 1 (which orjson would round to -2**63)."""
    import json as stdlib

    from symjax_mlp.serving import _bodies

    if not fast:
        monkeypatch.setattr(_bodies, "_fast_loads", stdlib.loads)
    h = sm.hybridize(lambda p, x: x, np.float32(0))
    with sm.serving.Batcher(h, example=np.zeros((1, 4), np.float32), max_batch=2) as b:
        for row in ([1.5, 2**64, 1e-50, -0.0], [1.5, 2**64, float("nan"), -0.0]):
            [x], _ = _bodies.decode(b, stdlib.dumps({"inputs": [row]}).encode(), "")
            np.testing.assert_array_equal(x, np.array([row], np.float32))
            assert x.dtype == np.float32 and np.signbit(x[0, 3])
        with pytest.raises(sm.SignatureError, match="beyond float32's range"):
            _bodies.decode(b, b'{"inputs": [[1.5, 1' + b"0" * 400 + b", 0, 0]]}", "")
        for text in (b'[["1.5", 2, 0, 0]]', b'{"args[0]": [["1.5", 2, 0, 0]]}'):
            with pytest.raises(sm.SignatureError, match=r'holds strings \("1.5"\)'):  # not 1.5
                _bodies.decode(b, b'{"inputs": ' + text + b"}", "")
    h = sm.hybridize(lambda p, x: x, np.int64(0))
    with sm.serving.Batcher(h, example=np.zeros((1, 1), np.int64), max_batch=2) as b:
        [x], _ = _bodies.decode(b, b'{"inputs": [[-9223372036854775808]]}', "")
        assert x.dtype == np.int64 and x[0, 0] == -(2**63)
        with pytest.raises(sm.SignatureError, match="outside int64's range"):
            _bodies.decode(b, b'{"inputs": [[-9223372036854775809]]}', "")


@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "stdlib"])
def test_json_answers_are_the_standard_librarys_text_by_either_writer(monkeypatch, fast):
    """An answer is written by orjson where its text is the standard library's, else by the
    latter: NaN (orjson: null), |x| < 1e-4 (orjson: 0.00001 and 1e-8, Python: 1e-05 and 1e-08),
    an int past 64 bits; float16 to float64, bfloat16, ints and bools, tuples of outputs."""
    import json as stdlib

    import ml_dtypes

    from symjax_mlp.serving import _bodies

    if not fast:
        monkeypatch.setattr(_bodies, "_fast_dumps", None)
    rng = np.random.default_rng(0)
    special = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-5, 5e-5, 1e-4, 1e16, 1e22, 10.00001]
    outs = [np.array([special]), np.array([[2**64, -1]], object), (np.ones((1, 2)), np.ones(1))]
    for dtype in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16, np.int64, np.bool_):
        for e in range(-320, 308, 7):
            with np.errstate(all="ignore"):
                outs.append((rng.standard_normal((2, 3)) * 10.0**e).astype(dtype))
    for out in outs:
        leaves = [out] if isinstance(out, np.ndarray) else list(out)
        outputs = out.tolist() if isinstance(out, np.ndarray) else [y.tolist() for y in leaves]
        want = stdlib.dumps({"outputs": outputs}, separators=(",", ":")).encode()
        assert _bodies.to_json(out) == (want, "application/json")


def test_no_answer_names_the_artifacts_path_on_the_server(server):
    """Item 8: a client sees the model's name, never where it lies on the server."""
    url, path, _ = server
    answers = [
        _post(url, json.dumps({"inputs": [[1.0, 2.0]]}).encode())[1],  # 422, names the model
        _post(url, json.dumps({"inputs": {"x": [[0.0] * 512]}}).encode())[1],
        _post(url, b"[", "application/x-npy")[1],
        _get(url, "/health"),
        _get(url, "/signature"),
    ]
    for raw in answers:
        text = raw.decode()
        assert "secret_dir" not in text and str(path) not in text, text
    assert json.loads(answers[0])["message"].startswith("Batcher(")
    name = sm.load(path).manifest["name"]
    assert json.loads(answers[3])["model"] == f"Batcher({name})"


def test_public_hides_every_form_of_the_path_of_a_users_batcher(tmp_path, monkeypatch):
    """Item 8, for an app over a Batcher the user made (named by its path by default)."""
    from symjax_mlp.serving._app import Public

    art = sm.chapter.export_mlp(tmp_path / "deep" / "mlp")
    monkeypatch.chdir(tmp_path)
    with sm.serving.Batcher(sm.load("deep/mlp"), max_batch=2) as b:
        public = Public(b)
        assert "deep" in b.name and "deep" not in public.name
        for text in (f'symjax_mlp.load("{art.path}"): x', 'symjax_mlp.load("deep/mlp"): x'):
            assert "deep" not in public.scrub(text)
        with pytest.raises(sm.SignatureError) as e:
            b.submit(np.zeros((1, 3), np.float32))
        assert "deep" not in public.scrub(str(e.value))


@pytest.mark.parametrize("given", ["a", "."])
def test_public_hides_a_bare_relative_path_without_garbling_the_messages(tmp_path, given):
    """serve a (or serve . in the artifact's directory): every "a" (or ".") of every message
    was replaced by the model's name ("the body is not HybridSequential reHybridSequential...")."""
    from symjax_mlp.serving._app import Public

    art = sm.chapter.export_mlp(tmp_path / "a")
    with (
        contextlib.chdir(tmp_path if given == "a" else art.path),
        sm.serving.Batcher(sm.load(given), max_batch=2) as b,
    ):
        public = Public(b)
        name = sm.load(given).manifest["name"]
        assert public.name == f"Batcher({name})"
        text = "the body is not a readable .npy array; write one with np.save(file, x)."
        assert public.scrub(text) == text
        with pytest.raises(sm.SignatureError) as e:
            b.submit(np.zeros((1, 3), np.float32))
        said = public.scrub(str(e.value))
        assert said.startswith(f"Batcher({name}): input args[0] has shape (1, 3)"), said
        assert public.scrub(f'load("{given}"): no; {art.path}/manifest.json') == (
            f'load("{name}"): no; {name}/manifest.json'
        )


def test_create_app_refuses_limits_that_are_not_positive():
    import jax.numpy as jnp

    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    with sm.serving.Batcher(h, example=np.ones((1, 3), np.float32), max_batch=2) as b:
        bads = ({"body_timeout": 0}, {"max_inflight_bytes": -1}, {"max_body_bytes": True})
        for bad in (*bads, {"max_body_bytes": None}):  # None: a TypeError from 4 * None
            with pytest.raises(sm.ConfigError, match=rf"{next(iter(bad))} must be a number > 0"):
                sm.serving.create_app(b, close_batcher=False, **bad)
        # a body past max_inflight_bytes was a 503 with Retry-After, whenever it was retried
        with pytest.raises(sm.ConfigError, match="max_inflight_bytes=1000 is less than"):
            sm.serving.create_app(b, max_body_bytes=2000, max_inflight_bytes=1000)
        # limits as small as one row (3 float32: 12 bytes) are taken; smaller: test_stranger16
        sm.serving.create_app(b, close_batcher=False, max_body_bytes=12, max_inflight_bytes=12)


def test_create_app_refuses_a_metrics_prefix_prometheus_cannot_read():
    """Any prefix was taken: '-' or a space made /metrics unreadable, a newline forged lines."""
    import jax.numpy as jnp

    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    with sm.serving.Batcher(h, example=np.ones((1, 3), np.float32), max_batch=2) as b:
        for bad in ("my-model", "x 1\nforged_total 9", 7):
            with pytest.raises(sm.ConfigError, match=r"prefix must be a Prometheus metric name"):
                sm.serving.create_app(b, close_batcher=False, prefix=bad)
        sm.serving.create_app(b, close_batcher=False, prefix="my_model:v2")


class _Fatal(BaseException):
    """A BaseException of the user's own."""


@pytest.mark.parametrize(
    "kind", [KeyboardInterrupt, SystemExit, GeneratorExit, StopIteration, _Fatal]
)
def test_a_model_raising_a_base_exception_is_the_json_500_and_counted(kind):
    """The batcher hands SystemExit and KeyboardInterrupt to the request, as any error; the
    app let them through to uvicorn: a text/plain 500, a traceback, no count on /metrics.
    GeneratorExit, StopIteration and a BaseException of the user's own: the same."""

    def model(x):
        if (x[:, 0] == 7).any():
            raise kind("boom")
        return x * 2

    with sm.serving.Batcher(model, example=np.zeros((1, 4), np.float32), max_batch=4) as b:
        app = sm.serving.create_app(b, close_batcher=False)
        with _in_thread(app, lifespan="off") as url:
            code, raw = _post(url, json.dumps({"inputs": [[7.0, 0.0, 0.0, 0.0]]}).encode())
            assert code == 500 and json.loads(raw) == {
                "error": kind.__name__,
                "message": "boom",
                "model": "Batcher(model)",
            }
            code, raw = _post(url, json.dumps({"inputs": [[1.0, 0.0, 0.0, 0.0]]}).encode())
            assert code == 200 and json.loads(raw) == {"outputs": [[2.0, 0.0, 0.0, 0.0]]}
            assert _count(url, 500) == 1


class _Unreadable(Exception):
    def __str__(self):
        raise ValueError("no text")


_LongName = type("\x1b[31mEvil" + "N" * 1000, (Exception,), {})


@pytest.mark.parametrize(
    ("raised", "error", "says"),
    [
        (RuntimeError("x" * 10**6), "RuntimeError", "x" * 300 + "... (999700 more)"),
        (ValueError("bad \x1b[2J\u202e row\n"), "ValueError", "bad \\x1b[2J\\u202e row\\n"),
        (_Unreadable(), "_Unreadable", "its __str__ raised ValueError"),
        (_LongName("x"), "\\x1b[31mEvil" + "N" * 88 + "... (912 more)", "x"),
    ],
    ids=["long", "escapes", "unreadable", "long class name"],
)
def test_a_model_error_500_is_cut_escaped_and_names_the_models_class(raised, error, says):
    """A model's message went into the 500 whole (1 MB asked: 1 MB answered), with the escape
    sequences a terminal runs; one whose __str__ raised was a 500 naming that ValueError; a
    class name of 1,000 characters was the error field whole."""

    def model(x):
        if (x[:, 0] == 7).any():
            raise raised
        return x * 2

    with sm.serving.Batcher(model, example=np.zeros((1, 4), np.float32), max_batch=4) as b:
        app = sm.serving.create_app(b, close_batcher=False)
        with _in_thread(app, lifespan="off") as url:
            code, raw = _post(url, json.dumps({"inputs": [[7.0, 0.0, 0.0, 0.0]]}).encode())
    body = json.loads(raw)
    assert code == 500 and body["error"] == error, raw[:400]
    assert says in body["message"] and len(body["message"]) < 400, body["message"][:400]


def test_a_model_of_complex_outputs_is_told_to_ask_for_npy(caplog):
    """JSON has no complex numbers: the 500 said 'Object of type complex is not JSON
    serializable', as a bug of ours would, without the way to get the answer (a .npy). It is
    the client's to fix: a 406 (Not Acceptable) saying how, and no traceback in the log."""

    def model(x):
        return x.astype(np.complex64)

    with sm.serving.Batcher(model, example=np.zeros((1, 2), np.float32), max_batch=2) as b:
        app = sm.serving.create_app(b, close_batcher=False)
        with _in_thread(app, lifespan="off") as url:
            code, raw = _post(url, json.dumps({"inputs": [[1.0, 2.0]]}).encode())
            said = json.loads(raw)
            assert code == 406 and "Content-Type: application/x-npy" in said["message"], said
            assert said["error"] == "BadRequest"
            assert not [r for r in caplog.records if r.exc_info], caplog.text  # no bug of ours
            buf = io.BytesIO()
            np.save(buf, np.ones((1, 2), np.float32))
            code, raw = _post(url, buf.getvalue(), "application/x-npy")
            assert code == 200 and np.load(io.BytesIO(raw)).dtype == np.complex64


@pytest.mark.parametrize(
    ("dtype", "bad", "says"),
    [
        ("bfloat16", "1e39", "beyond bfloat16's range"),  # was cast to inf in silence
        ("float8_e4m3fn", "1000", "beyond float8_e4m3fn's range"),  # to NaN
        ("float8_e5m2", "1e39", "beyond float8_e5m2's range"),  # np.finfo's ValueError: a 400
        ("float4_e2m1fn", "7", "beyond float4_e2m1fn's range"),  # clamped to 6 in silence
        ("float4_e2m1fn", "-1e6", "beyond float4_e2m1fn's range"),  # to -6
        ("float4_e2m1fn", "NaN", "holds NaN or Infinity, which float4_e2m1fn cannot"),  # to -0
        ("float4_e2m1fn", "-Infinity", "holds NaN or Infinity, which float4_e2m1fn"),  # -6
        ("int4", "20", "outside int4's range"),  # wrapped to 4
        ("uint4", "-1", "outside uint4's range"),  # wrapped to 15
    ],
)
def test_json_numbers_an_ml_dtypes_input_cannot_hold_are_refused(dtype, bad, says):
    """bfloat16, float8 and int4 are "V" to NumPy: the range checks of JSON numbers skipped
    them, and np.finfo refuses them."""
    import ml_dtypes

    from symjax_mlp.serving import _bodies

    kind = getattr(ml_dtypes, dtype)
    h = sm.hybridize(lambda p, x: x, np.float32(0))
    with sm.serving.Batcher(h, example=np.zeros((1, 2), kind), max_batch=2) as b:
        [x], _ = _bodies.decode(b, b'{"inputs": [[1, 2], [3, 0]]}', "")  # in range: read
        assert x.dtype == kind and x.tolist() == [[1, 2], [3, 0]]
        with pytest.raises(sm.SignatureError, match=says):
            _bodies.decode(b, b'{"inputs": [[' + bad.encode() + b", 0]]}", "")


@pytest.mark.parametrize(
    ("method", "path", "code", "allow"),
    [
        ("GET", "/predict", 405, "POST"),
        ("POST", "/health", 405, "GET, HEAD"),
        ("GET", "/x", 404, None),
        ("POST", "/predict/", 404, None),  # was starlette's 307 with an empty body
        ("GET", "/health/", 404, None),  # was a 307 that urllib followed
    ],
)
def test_a_wrong_path_or_method_is_the_json_error_body(server, method, path, code, allow):
    """Starlette answered these itself, in text/plain: the one error body a client did not
    get as documented (JSON with "error" and "message"). A trailing slash is a wrong path too,
    the message naming the route (a 307 lost a POST's body to many clients)."""
    url, _, _ = server
    req = urllib.request.Request(
        url + path, data=b"{}" if method == "POST" else None, method=method
    )
    with pytest.raises(urllib.error.HTTPError) as caught, urllib.request.urlopen(req, timeout=30):
        pass
    e = caught.value
    with e:
        body = json.loads(e.read())
    assert e.code == code and e.headers["Content-Type"] == "application/json"
    allowed = e.headers.get("Allow")  # starlette's order is a set's
    assert (allowed and set(allowed.split(", "))) == (allow and set(allow.split(", ")))
    assert body["error"] == ("NotFound" if code == 404 else "MethodNotAllowed")
    assert f"no endpoint takes {method} {path}" in body["message"]
    assert "POST /predict" in body["message"]
    if path.endswith("/"):
        assert f"drop the trailing slash: {path[:-1]}" in body["message"]


def _blocking_batcher():
    """A Batcher over a callable that blocks on a request of 9s until ``release`` is set:
    ``(batcher, entered, release)``; ``entered`` is set once the model is blocked."""
    import threading

    release, entered = threading.Event(), threading.Event()

    def model(x):
        if (x == 9).any():
            entered.set()
            release.wait(60)
        return x * 2

    b = sm.serving.Batcher(model, example=np.zeros((1, 2), np.float32), max_batch=2)
    return b, entered, release


def test_a_model_that_blocks_never_stalls_the_server_loop():
    """A lone request ran the model on the server's event loop: a user's callable that blocked
    (here, on an Event) stopped /health, every timeout and the graceful stop with it. A user's
    Python runs on the batcher's thread now; the loop answers meanwhile. So it does after a
    pass of one request (where an artifact's next request runs at once, on the loop)."""
    import concurrent.futures

    from helpers import bounded

    b, entered, release = _blocking_batcher()
    body = json.dumps({"inputs": [[9.0, 9.0]]}).encode()
    app = sm.serving.create_app(b)
    with _in_thread(app) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert _post(url, json.dumps({"inputs": [[1.0, 1.0]]}).encode())[0] == 200  # alone
        pending = pool.submit(_post, url, body)
        try:
            assert entered.wait(30), "the request never reached the model"
            health = json.loads(bounded(lambda: _get(url, "/health"), 10))
            assert health["status"] == "ok" and health["queue_depth"] == 0
        finally:
            release.set()
        code, raw = pending.result(30)
    assert code == 200 and json.loads(raw)["outputs"] == [[18.0, 18.0]]


def test_a_server_stops_though_its_model_never_returns(monkeypatch, caplog):
    """At shutdown the app closed its batcher with no timeout: a model that never returned held
    the server's stop for ever (a second Ctrl-C too). It waits DRAIN_SECONDS, says so, stops."""
    import threading

    import uvicorn

    from symjax_mlp.serving import _app

    monkeypatch.setattr(_app, "DRAIN_SECONDS", 0.5)
    b, entered, release = _blocking_batcher()
    server = uvicorn.Server(uvicorn.Config(sm.serving.create_app(b), log_level="critical"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    try:
        with caplog.at_level("ERROR", logger="symjax_mlp.serving"):
            thread.start()
            stuck = b.submit(np.full((1, 2), 9, np.float32))
            assert entered.wait(30), "the request never reached the model"
            server.should_exit = True  # uvicorn's shutdown, then the app's lifespan
            thread.join(20)
            assert not thread.is_alive(), "the server's stop waited for the model"
        assert "still running after 0.5 s" in caplog.text
        assert b.closed and not stuck.done()
    finally:
        release.set()
        sock.close()
    assert stuck.result(30).tolist() == [[18.0, 18.0]]  # left running, never lost


def _health(url):
    """``(status code, JSON body)`` of ``GET /health``, a 503 included."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


def test_a_model_that_never_answers_is_a_504_and_health_says_stuck():
    """A model that blocked for ever held its HTTP clients for ever, and /health said ok. Past
    request_timeout a request is answered 504 (one queued behind is dropped, never run), and
    /health is 503 "stuck" while that batch runs on; once it returns, ok again."""
    import concurrent.futures

    b, entered, release = _blocking_batcher()
    app = sm.serving.create_app(b, close_batcher=False, request_timeout=0.5)
    with (
        b,
        _in_thread(app, lifespan="off") as url,
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):
        try:
            stuck = pool.submit(_post, url, json.dumps({"inputs": [[9.0, 9.0]]}).encode())
            assert entered.wait(30), "the request never reached the model"
            queued = pool.submit(_post, url, json.dumps({"inputs": [[1.0, 1.0]]}).encode())
            for code, raw in (stuck.result(30), queued.result(30)):
                body = json.loads(raw)
                assert code == 504 and body["error"] == "TimeoutError", raw
                assert "did not answer within request_timeout=0.5 s" in body["message"]
                assert "raise request_timeout" in body["message"]
            code, health = _health(url)
            assert code == 503 and health["status"] == "stuck", health
            assert "a batch has run for" in health["message"]
            assert _count(url, 504) == 2
        finally:
            release.set()
        deadline = time.monotonic() + 30
        while b.stats.completed < 1:  # the stuck batch, released: done, its answer dropped
            assert time.monotonic() < deadline, "the released batch never finished"
            time.sleep(0.02)
        assert _health(url)[0] == 200
        assert _post(url, json.dumps({"inputs": [[1.0, 2.0]]}).encode())[0] == 200
    assert b.stats.cancelled == 1  # the queued request: dropped, not run after its 504


def test_create_app_takes_numpy_numbers_and_refuses_a_bad_request_timeout():
    """A limit of np.int64 (what arithmetic on sizes gives) was refused as not a number."""
    b, _, _ = _blocking_batcher()
    with b:
        sm.serving.create_app(b, close_batcher=False, max_body_bytes=np.int64(2**20))
        for bad in (0, -1.0, float("nan"), "60", True):
            with pytest.raises(sm.ConfigError, match=r"request_timeout must be a number > 0"):
                sm.serving.create_app(b, close_batcher=False, request_timeout=bad)


def test_a_model_error_is_logged_with_its_traceback_naming_the_model(caplog):
    """A model's failure reached only the client, cut to 300 characters: the server's log had
    nothing. Each failed batch is logged at ERROR with its traceback, naming the model: once
    for a batch of several requests (each answered 500), and again for the next batch."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    gate, entered = threading.Event(), threading.Event()

    def broken(x):
        if (x[:, 0] == 9).any():
            entered.set()
            assert gate.wait(30), "the test never opened the gate"
        if (x[:, 0] == 7).any():
            raise RuntimeError("boom " + "x" * 1000)
        return x * 2

    seven = json.dumps({"inputs": [[7.0, 0.0]]}).encode()
    with (
        sm.serving.Batcher(broken, example=np.zeros((1, 2), np.float32), max_batch=2) as b,
        caplog.at_level("ERROR", logger="symjax_mlp.serving"),
        _in_thread(sm.serving.create_app(b, close_batcher=False), lifespan="off") as url,
        ThreadPoolExecutor(2) as pool,
    ):
        assert _post(url, seven)[0] == 500  # alone
        busy = b.submit(np.full((1, 2), 9, np.float32))
        assert entered.wait(30), "the gated request never ran"
        posts = [pool.submit(_post, url, seven) for _ in range(2)]
        deadline = time.monotonic() + 30
        while b.stats.queue_depth < 2:
            assert time.monotonic() < deadline, "the requests never queued"
            time.sleep(0.02)
        gate.set()  # the two run as one batch, which raises
        assert [p.result(30)[0] for p in posts] == [500, 500]
        busy.result(30)
        assert _post(url, json.dumps({"inputs": [[1.0, 0.0]]}).encode())[0] == 200
    records = [r for r in caplog.records if r.name == "symjax_mlp.serving"]
    assert len(records) == 2, caplog.text  # the lone request's batch, and the batch of two
    for r in records:
        assert r.levelname == "ERROR" and r.exc_info and r.exc_info[0] is RuntimeError
        assert "Batcher(broken): the model raised RuntimeError on a batch" in r.getMessage()
    assert "x" * 1000 in caplog.text and "in broken" in caplog.text  # the whole traceback


def test_a_model_errors_log_cuts_each_message_and_keeps_the_traceback(caplog):
    """A model echoing a body in its message (64 MB allowed) had all of it written to the log,
    on the event loop, each failing batch: each message of the traceback is cut to 4096
    characters, saying how many more, and the frames and the chain are kept."""

    def echo(x):
        if (x[:, 0] == 7).any():
            try:
                raise KeyError("k" * 2**20)
            except KeyError as e:
                raise ValueError("v" * 2**20) from e
        return x

    body = json.dumps({"inputs": [[7.0, 0.0]]}).encode()
    with (
        sm.serving.Batcher(echo, example=np.zeros((1, 2), np.float32)) as b,
        caplog.at_level("ERROR", logger="symjax_mlp.serving"),
        _in_thread(sm.serving.create_app(b, close_batcher=False), lifespan="off") as url,
    ):
        assert _post(url, body)[0] == 500
    (record,) = [r for r in caplog.records if r.name == "symjax_mlp.serving"]
    assert record.exc_info[0] is ValueError and len(caplog.text) < 16_000, len(caplog.text)
    for kind, letter in (("ValueError", "v"), ("KeyError", "k")):
        cut = len(f"{kind}: ") + 2**20 + 2 * (kind == "KeyError") + 1 - 4096  # 'k...k'\n
        assert f"{letter * 20}... ({cut} more)" in caplog.text, caplog.text[-300:]
    assert "in echo" in caplog.text and "direct cause of the following" in caplog.text


def test_signature_cuts_a_manifests_why_alone_as_other_manifest_text(tmp_path):
    """A stranger's manifest says why its rows mix in up to 1000 characters: /signature sent
    them all, where every other text from a manifest is cut to 300."""
    import jax.numpy as jnp

    h = sm.hybridize(lambda p, x: x - x.mean(0, keepdims=True) + p, jnp.float32(0.5))
    path = sm.export(h, tmp_path / "mix", example=jnp.ones((4, 3))).path
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["rows"]["why"] = "because " + "y" * 992
    (path / "manifest.json").write_text(json.dumps(manifest))
    with sm.serving.Batcher(sm.load(path)) as b:
        assert len(b.why_alone) == 1000
        with _in_thread(sm.serving.create_app(b, close_batcher=False), lifespan="off") as url:
            why = json.loads(_get(url, "/signature"))["why_alone"]
    assert why == "because " + "y" * 292 + "... (700 more)"


def test_a_json_body_naming_a_key_twice_is_refused_not_read_as_one_parser_would():
    """{"inputs": A, "inputs": B} was answered for B in silence (Python's json takes the last
    key, other parsers the first: a proxy that checked A let B through); by name, too."""
    from symjax_mlp.serving import _bodies

    h = sm.hybridize(lambda p, x: x, np.float32(0))
    with sm.serving.Batcher(h, example=np.zeros((1, 2), np.float32), max_batch=2) as b:
        for body in (
            b'{"inputs": [[1, 2]], "inputs": [[3, 4]]}',
            b'{"inputs": [[1, 2]], "inp\\u0075ts": [[3, 4]]}',  # the same key, escaped
            b'{"inputs": {"args[0]": [[1, 2]], "args[0]": [[3, 4]]}}',
        ):
            with pytest.raises(_bodies.BadRequest, match=r"names \"(inputs|args\[0\])\" 2 times"):
                _bodies.decode(b, body, "application/json")
        [x], _ = _bodies.decode(b, b'{"inputs": [[1, 2]], "model": "mlp"}', "")  # other keys
        assert x.tolist() == [[1.0, 2.0]]


def _refusal(dtype: type, inputs: str) -> str:
    """The SignatureError of a JSON body ``{"inputs": inputs}`` to a (b, 2) ``dtype`` input."""
    from symjax_mlp.serving import _bodies

    h = sm.hybridize(lambda p, x: x, dtype(0))
    with (
        sm.serving.Batcher(h, example=np.zeros((1, 2), dtype), max_batch=2) as b,
        pytest.raises(sm.SignatureError) as e,
    ):
        _bodies.decode(b, b'{"inputs": ' + inputs.encode() + b"}", "")
    return str(e.value)


@pytest.mark.parametrize(
    ("dtype", "inputs", "says"),
    [
        (np.int32, "[[NaN, 2]]", "numbers that are not integers (nan)"),  # was "float64 values"
        (np.int32, "[[1.5, 2]]", "numbers that are not integers (1.5)"),
        (np.int32, '[["1", "2"]]', 'strings ("1")'),  # was "<U1 values"
        (np.float32, "[[null, 2]]", "holds null, but"),  # was "object values"
        (np.float32, '[[{"a": 1}, "x"]]', 'holds strings ("x"), but'),
        (np.float32, '[[{"a": 1}, null]]', "holds null and objects, but"),
    ],
)
def test_json_values_no_number_input_takes_are_named_in_jsons_words(dtype, inputs, says):
    """The 422 named NumPy's dtype of what the client sent (<U1, object): a JSON client sent
    strings, null or objects, and cannot know what those are."""
    said = _refusal(dtype, inputs)
    assert says in said and f"takes {np.dtype(dtype).name}[b, 2]" in said
    assert "send integers" in said or "send numbers" in said


@pytest.mark.parametrize(
    ("inputs", "says"),
    [
        ("[[null, 0]]", "[null]"),  # was [None, 0], Python's words
        ('[["yes", true]]', '["yes"]'),  # was ['yes', 'True']: NumPy's strings, the true one
        ("[[true, 2], [1, 3]]", "[2, 3]"),  # was [1, 2, 1, 3]: the true as 1, the 1s too
        ("[[NaN, 0.5]]", "[NaN, 0.5]"),  # was [nan, 0.5]
    ],
)
def test_a_bool_inputs_422_names_what_it_holds_in_jsons_words(inputs, says):
    said = _refusal(np.bool_, inputs)
    assert f"holds values other than true and false ({says})" in said, said
    assert "takes bool[b, 2]; send JSON booleans" in said


@pytest.mark.parametrize(
    ("inputs", "says"),
    [
        ("[1, 2]", "holds lists nested 1 deep, but the model takes float32[b, 2], a list of "
         "rows; wrap the one row in a list, [[...]], a batch of one."),  # was x[None]
        ("5", "holds a number, but the model takes float32[b, 2], a list of rows; send lists "
         "nested 2 deep, rows first."),  # was 'Pass an array of rank 2'
        ("[[[1, 2]]]", "holds lists nested 3 deep, but"),
        ("[" * 99 + "1" + "]" * 99, "holds lists nested 99 deep, but"),  # "not a rectangular
        # array (... would exceed the maximum number of dimension of 64.)": NumPy's words
    ],
)  # fmt: skip
def test_a_json_body_nested_unlike_rows_is_a_422_in_jsons_words(inputs, says):
    said = _refusal(np.float32, inputs)
    assert says in said, said


def test_a_manifests_long_name_is_cut_in_every_message(tmp_path):
    """A manifest's name (4096 characters allowed) named the model in every error message and
    on /health whole: 4 KB in each 422, as in the server's log."""
    h = sm.hybridize(lambda p, x: x * p, np.float32(2))
    path = sm.export(h, tmp_path / "long", example=np.ones((1, 2), np.float32)).path
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["name"] = "n" * 4096
    (path / "manifest.json").write_text(json.dumps(manifest))
    with sm.serving.Batcher(sm.load(path), max_batch=2) as b:
        app = sm.serving.create_app(b, close_batcher=False)
        with _in_thread(app, lifespan="off") as url:
            code, raw = _post(url, b'{"inputs": [[1, 2, 3]]}')
            health = json.loads(_get(url, "/health"))
    name = "n" * 100 + "... (3996 more)"
    assert code == 422 and f"Batcher({name}): input args[0]" in json.loads(raw)["message"]
    assert health["model"] == f"Batcher({name})"


def test_expect_100_continue_and_head_requests_are_answered_by_serve(server):
    """A client that waits for "100 Continue" before its body (curl does, for a large one), and
    a HEAD request, whose answer has no body, are answered."""
    url, _, _ = server
    body = json.dumps({"inputs": np.zeros((1, 512), np.float32).tolist()}).encode()
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=10) as s:
        s.sendall(
            b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        assert s.recv(4096).startswith(b"HTTP/1.1 100 Continue\r\n")
        s.sendall(body)
        answer = b""
        while not answer.endswith(b"}"):
            answer += s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200") and b'"outputs"' in answer
        s.sendall(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")


_LEAKS = {  # what a model's failure said, by row: each form of a server path a message holds
    1: "cannot open /home/alice/models/w.npz (errno 2)",
    2: "read C:\\Users\\alice\\w.npz failed, and D:/alice/w.npz",
    3: "see file:///srv/alice/w.npz or ~/alice/w.npz or ~alice/w.npz",
    4: "share \\\\fileserver\\alice\\w.npz is gone",
    5: "INTERNAL: CpuCallback error calling callback: Traceback (most recent call last):\n  File"
    ' "/usr/lib/python3.11/site-packages/jax/cb.py", line 3, in f\n    boom()\n'
    "ValueError: bad row at '/opt/alice/w.npz'",
}


def test_a_model_failures_500_names_the_model_and_no_server_path():
    """A model's message went to the client as it was (cut to 300): a traceback in it (JAX's
    pure_callback, checkify, XLA's errors) or a path named the server's files (site-packages,
    a home, a share). The 500 names the model, the class and what went wrong; no path."""

    def model(x):
        row = int(x[0, 0])
        if row in _LEAKS:
            raise ValueError(_LEAKS[row])
        return x * 2

    with sm.serving.Batcher(model, example=np.zeros((1, 2), np.float32), max_batch=2) as b:
        app = sm.serving.create_app(b, close_batcher=False)
        with _in_thread(app, lifespan="off") as url:
            answers = [_post(url, json.dumps({"inputs": [[k, 0.0]]}).encode()) for k in _LEAKS]
            npy = io.BytesIO()
            np.save(npy, np.array([[1.0, 0.0]], np.float32))
            answers.append(_post(url, npy.getvalue(), "application/x-npy"))
    for code, raw in answers:
        body = json.loads(raw)
        assert code == 500 and body["error"] == "ValueError", raw
        assert body["model"] == "Batcher(model)", raw
        for leak in ("alice", "site-packages", "fileserver", "/usr", "file:", "line 3"):
            assert leak not in body["message"], body["message"]
    says = [json.loads(raw)["message"] for _, raw in answers]
    assert says[0] == says[-1] == "cannot open <path> (errno 2)", says
    assert says[1] == "read <path> failed, and <path>", says
    assert says[2] == "see <path> or <path> or <path>", says
    assert says[4] == (
        "INTERNAL: CpuCallback error calling callback: ValueError: bad row at '<path>'"
    ), says


def test_a_hybrids_callback_failure_is_a_500_without_the_servers_paths(tmp_path):
    """pure_callback, jax.debug.callback and checkify fail in XLA's JaxRuntimeError, whose
    message holds the Python traceback of the callback: every file of the server's venv."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import checkify

    where = str(tmp_path / "alice" / "w.npz")

    def boom(x):
        if (np.asarray(x) >= 5).any():  # not the warm-up's zeros
            raise OSError(f"no such file: {where}")
        return x

    def f(p, x):
        y = jax.pure_callback(boom, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return y * p

    def g(p, x):
        jax.debug.callback(boom, x)
        return x * p

    def c(p, x):
        checkify.check(jnp.all(x < 5), "x must be under 5")
        return x * p

    def checked(x):
        err, out = checkify.checkify(jax.jit(lambda x: c(2.0, x)))(x)
        err.throw()
        return out

    example = np.zeros((1, 2), np.float32)
    for fn in (sm.hybridize(f, jnp.float32(2)), sm.hybridize(g, jnp.float32(2)), checked):
        with sm.serving.Batcher(fn, example=example, max_batch=2) as b:
            app = sm.serving.create_app(b, close_batcher=False)
            with _in_thread(app, lifespan="off") as url:
                code, raw = _post(url, json.dumps({"inputs": [[9.0, 0.0]]}).encode())
        body = json.loads(raw)
        assert code == 500 and body["model"].startswith("Batcher("), raw
        said = body["message"]
        assert "alice" not in said and "site-packages" not in said and ".py" not in said, said
        assert "no such file: <path>" in said or "x must be under 5" in said, said


def test_a_body_that_fails_in_an_unforeseen_way_is_a_400_without_the_servers_paths(monkeypatch):
    """A body's read that raised what no check foresaw was a 400 quoting the error's repr: a
    path of the server's in it (a library's file, a home) went to the client."""
    from symjax_mlp.serving import _app

    def decode(*_):
        raise OSError("cannot map /home/alice/.cache/numpy/x.bin")

    with sm.serving.Batcher(lambda x: x, example=np.zeros((1, 2), np.float32)) as b:
        app = sm.serving.create_app(b, close_batcher=False)
        monkeypatch.setattr(_app, "decode", decode)
        with _in_thread(app, lifespan="off") as url:
            code, raw = _post(url, json.dumps({"inputs": [[1.0, 0.0]]}).encode())
    assert code == 400 and json.loads(raw) == {
        "error": "BadRequest",
        "message": "the body could not be read (OSError: cannot map <path>).",
        "model": "Batcher(<lambda>)",
    }, raw


def test_every_error_body_of_serve_names_the_model(server):
    """A 404/405, the server's own 400/431 (before the app) and its 503 (too many connections)
    named no model: a client of several served models could not tell which one refused."""
    from symjax_mlp.serving._server import limited

    url, path, _ = server
    name = f"Batcher({sm.load(path).manifest['name']})"
    answers = []
    for request_ in (b"GARBAGE", b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close"):
        with socket.create_connection(("127.0.0.1", _port(url)), timeout=30) as s:
            s.sendall(request_ + b"\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            answers.append(data.partition(b"\r\n\r\n")[2])
    with sm.serving.Batcher(lambda x: x, example=np.zeros((1, 2), np.float32)) as b:
        heads = type("Heads", (), {"connections": [0]})
        with _in_thread(limited(sm.serving.create_app(b, close_batcher=False), heads, 0)) as u:
            answers.append(_post(u, json.dumps({"inputs": [[1.0, 0.0]]}).encode())[1])
    models = [json.loads(raw)["model"] for raw in answers]
    assert models == [name, name, "Batcher(<lambda>)"], answers
    for raw in answers:  # one writer: the same bytes for the same fields, as the app's own
        assert (
            raw == json.dumps(json.loads(raw), ensure_ascii=False, separators=(",", ":")).encode()
        )


def test_a_500_names_a_file_of_the_artifact_by_the_models_name_and_hides_others(tmp_path):
    """A served artifact's failure naming its own files says them under the model's name (the
    client knows it); any other path of the server's, a symlinked one too, reads <path>."""
    from symjax_mlp.serving._app import Public

    art = sm.chapter.export_mlp(tmp_path / "real" / "mlp")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with sm.serving.Batcher(sm.load(tmp_path / "link" / "mlp"), max_batch=2) as b:
        public, name = Public(b), sm.load(art.path).manifest["name"]
        said = public.text(OSError(f"{art.path}/weights.npz: bad; see {tmp_path}/other.txt"))
    assert said == f"{name}/weights.npz: bad; see <path>", said


_HIDDEN = {  # what a model's message said: what its 500 says (a relative path, a spaced one)
    "venv/lib/python3.11/site-packages/jax/x.py failed": "<path> failed",
    "cannot read ./secret/dir/file.py: no": "cannot read <path>: no",
    "see ../secret/w.npz.": "see <path>.",
    "in secret/dir/w.bin": "in <path>",
    "read /srv/My Models/w.npz and C:\\Program Files\\x\\y.dll": "read <path> and <path>",
    "no such file: '/srv/My Models/weights' (errno 2)": "no such file: '<path>' (errno 2)",
    'File "lib/x.py", line 3, in f': 'File "<path>", line 3, in f',
}
_KEPT = (  # a user's own words with a slash: not paths
    "expected 1/2 of the batch, in m/s",
    "rows/s fell; and/or the input/output was 3/4 of 1.5/2.",
    "the model's input 'm/s' isn't one",
    "a / b, or x //  y",
    "rows of 2024/01/02 and 1/2/3",
)


def test_a_500_hides_relative_and_spaced_paths_and_keeps_a_users_slashes():
    """Only absolute paths were hidden: venv/lib/..., ./secret/dir/file.py and the part of a
    path after a space (/srv/My Models/...) reached the client. A word with a separator that is
    absolute, relative, two deep or names a file is a path, with the words after it that hold
    one and all of a quoted one; 1/2, m/s and and/or are the user's."""
    from symjax_mlp.serving._app import Public

    public = Public(sm.serving.Batcher(lambda x: x, example=np.zeros((1, 2), np.float32)))
    said = {text: public.text(ValueError(text)) for text in (*_HIDDEN, *_KEPT)}
    assert said == {**_HIDDEN, **{text: text for text in _KEPT}}, said
    for leak in ("secret", "site-packages", "Models", "Program", "weights"):
        assert not any(leak in text for text in said.values()), said


def test_a_websocket_upgrade_is_answered_in_the_json_error_body(server):
    """serve has no websocket endpoint, yet uvicorn took the handshake: a 403 with no body (a
    websocket parser open to strangers). The upgrade is now plain HTTP: the JSON 405."""
    url, _, _ = server
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=30) as s:
        s.sendall(
            b"GET /predict HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        head, _, body = _answer_of(s)
    assert head.startswith(b"HTTP/1.1 405"), head
    assert json.loads(body)["error"] == "MethodNotAllowed", body


def test_a_post_asking_to_upgrade_is_told_its_body_was_not_read(server):
    """A POST with Upgrade and Connection: upgrade headers had its body taken as the new
    protocol's bytes by the HTTP parser, and dropped: its 400 said "the body is not valid JSON
    (Expecting value: ... char 0)". A GET asking to upgrade (curl --http2) is answered as ever."""
    url, _, _ = server
    body = json.dumps({"inputs": np.zeros((1, 512), np.float32).tolist()}).encode()
    upgrade = b"Upgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: AAMA\r\n"
    said = []
    for head in (b"POST /predict", b"GET /health"):
        with socket.create_connection(("127.0.0.1", _port(url)), timeout=30) as s:
            length = b"Content-Length: %d\r\n" % len(body) if head.startswith(b"POST") else b""
            s.sendall(head + b" HTTP/1.1\r\nHost: x\r\n" + upgrade + length + b"\r\n" + body)
            said.append(_answer_of(s))
    assert said[0][0].startswith(b"HTTP/1.1 400"), said[0]
    assert "asks to switch protocols (Upgrade: h2c)" in json.loads(said[0][2])["message"]
    assert said[1][0].startswith(b"HTTP/1.1 200"), said[1]


def test_a_400_the_server_sends_within_a_request_is_counted_400_not_499(server):
    """A body cut short by its client's shutdown, and a POST asking to upgrade, were answered
    400 by the server, which /metrics counted as 499 (the client closed): it counts what it
    sent."""
    url, _, _ = server
    before = {code: _count(url, code) for code in (400, 499)}
    body = json.dumps({"inputs": np.zeros((1, 512), np.float32).tolist()}).encode()
    head = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(body)
    for sent in (
        head + b"\r\n" + body[:-10],
        head + b"Upgrade: h2c\r\nConnection: Upgrade\r\n\r\n",
    ):
        with socket.create_connection(("127.0.0.1", _port(url)), timeout=30) as s:
            s.sendall(sent + body if b"Upgrade" in sent else sent)
            s.shutdown(socket.SHUT_WR)
            assert _answer_of(s)[0].startswith(b"HTTP/1.1 400")
    deadline = time.monotonic() + 3  # the app counts once its request task sees the close
    while _count(url, 400) < before[400] + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [_count(url, code) - before[code] for code in (400, 499)] == [2, 0]


def test_requests_pipelined_before_bytes_that_are_not_http_are_answered_first(server):
    """Two requests, then garbage, in one send: the parser's 400 went out at once and the two
    answers were dropped, so a client took the 400 for its first request's answer. Now the
    answers come in order, then the 400, then the connection closes."""
    url, _, _ = server
    body = json.dumps({"inputs": np.zeros((1, 512), np.float32).tolist()}).encode()
    one = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=30) as s:
        s.sendall((one + body) * 2 + b"GARBAGE\r\n\r\n")
        s.shutdown(socket.SHUT_WR)  # its end too, at once: the 400 still comes
        data = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            while chunk := s.recv(65536):
                data += chunk
    assert re.findall(rb"HTTP/1\.1 (\d+)", data) == [b"200", b"200", b"400"], data
    assert b"Invalid method encountered" in data or b"httptools" not in sys.modules, data


def _answer_of(s):
    """The first answer on socket ``s``: ``(head, _, body)`` as ``bytes.partition`` gives."""
    data = b""
    with contextlib.suppress(TimeoutError, ConnectionError):
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            if not (chunk := s.recv(65536)):
                break
            data += chunk
    return data.partition(b"\r\n\r\n")


def test_no_error_message_shows_a_memory_address_or_a_whole_content_type():
    """A .npy header holding a call was refused quoting "<ast.Call object at 0x7f...>", the
    server's heap layout (a model's errors quote such reprs too); a Content-Type of 60 KB went
    into its 415 whole."""
    from symjax_mlp.serving import _bodies
    from symjax_mlp.serving._app import Public

    with sm.serving.Batcher(lambda x: x, example=np.zeros((1, 2), np.float32)) as b:
        public = Public(b)
        for message, shown in (
            ("line 1: <ast.Call object at 0x7f8491923fd0>", "line 1: <ast.Call object>"),
            ("bad <function f at 0x7F84919>; byte 0xff", "bad <function f>; byte 0xff"),
        ):
            assert public.text(ValueError(message)) == public.scrub(message) == shown
        with pytest.raises(_bodies.BadRequest) as e:
            _bodies.decode(b, b"{}", "text/" + "a" * 60000)
    assert e.value.status == 415 and len(str(e.value)) < 400, str(e.value)[:400]


def test_a_500_scans_the_start_of_a_huge_message_only_and_counts_the_rest(monkeypatch):
    """A model that echoes a request in its message (64 MB of body allowed) held the event
    loop, every client waiting, ~0.1 s a MB while all of it was scanned for paths, to show 300
    characters: now the first 64 Ki are scanned, and "(N more)" still counts the rest."""
    from symjax_mlp.serving import _app

    scanned = []

    class Recorded:
        def __init__(self, pattern):
            self.pattern = pattern

        def sub(self, repl, text):
            scanned.append(len(text))
            return self.pattern.sub(repl, text)

    monkeypatch.setattr(_app, "_PATH", Recorded(_app._PATH))
    with sm.serving.Batcher(lambda x: x, example=np.zeros((1, 2), np.float32)) as b:
        said = _app.Public(b).text(ValueError("0.5, " * 2_000_000))
    assert said == "0.5, " * 60 + "... (9999700 more)", said[-40:]
    assert scanned and max(scanned) <= 2**16, scanned


@pytest.mark.parametrize("dtype", [np.float32, np.bool_])
def test_a_json_string_in_a_body_costs_its_size_not_four_times_over(dtype):
    """A body of one long string ({"inputs": "aaa..."}, 60 MB) held ~10 times its size, as a
    NumPy array of 4 bytes a character and copies of it for the message, and the event loop
    for seconds: strings are refused before NumPy reads them."""
    import tracemalloc

    from symjax_mlp.serving import _bodies

    text = "a" * 2**22
    h = sm.hybridize(lambda p, x: x, dtype(0))
    body = json.dumps({"inputs": [[1, text]]}).encode()
    with sm.serving.Batcher(h, example=np.zeros((1, 2), dtype), max_batch=2) as b:
        tracemalloc.start()
        try:
            with pytest.raises(sm.SignatureError) as e:
                _bodies.decode(b, body, "")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 3 * len(text), peak  # its str twice (JSON parsed twice, keys checked)
    shown = f'(["{"a" * 40}..."])' if dtype is np.bool_ else f'("{"a" * 39}... (4194266 more))'
    assert shown in str(e.value), str(e.value)


def test_a_body_naming_its_inputs_is_not_walked_for_booleans_it_cannot_hold(monkeypatch):
    """The check for JSON booleans among the numbers looked for an "r" or an "a" in the body,
    which every input name (args[0]) holds: each request naming its inputs had its numbers
    walked in Python (~3 ms for 64 rows of 512). true and false are still refused."""
    from symjax_mlp.serving import _bodies, _values

    walked, first = [], _values._first
    monkeypatch.setattr(_values, "_first", lambda v, k, *a: walked.append(k) or first(v, k, *a))
    ex = (np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32))
    with sm.serving.Batcher(lambda x, y: x + y, example=ex, max_batch=2) as b:
        for x, bad in (("[[1, 2]]", False), ("[[NaN, 2]]", False), ("[[true, 2]]", True)):
            for pair in ((x, "[[3, 4]]"), ("[[3, 4]]", x.replace("true", "false"))):
                body = '{"inputs": {"args[0]": ' + pair[0] + ', "args[1]": ' + pair[1] + "}}"
                with pytest.raises(sm.SignatureError) if bad else contextlib.nullcontext():
                    _bodies.decode(b, body.encode(), "")
            assert (walked != []) == bad, (x, walked)


def test_an_answer_is_one_write_its_head_with_its_body():
    """uvicorn wrote an answer's head and its body apart: two sends, two segments for the
    client to read, for every request. serve's connections send them together; a HEAD's
    answer, which has no body, and a 404 still go out whole."""
    from symjax_mlp.serving._server import bounded_heads

    writes = []

    class Spy:  # the connection's transport, its writes recorded
        def __init__(self, transport):
            self._t = transport

        def __getattr__(self, name):
            return getattr(self._t, name)

        def write(self, data):
            writes.append(data)
            self._t.write(data)

    def spied(app):  # serve's protocol for ``app``, its connections spied on
        class Spied(bounded_heads(5.0, app)):
            def connection_made(self, transport):
                super().connection_made(Spy(transport))

        return Spied

    body = json.dumps({"inputs": [[1.0, 2.0]]}).encode()
    post = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with (
        sm.serving.Batcher(lambda x: x, example=np.zeros((1, 2), np.float32)) as b,
        _in_thread(app := sm.serving.create_app(b, close_batcher=False), http=spied(app)) as url,
        socket.create_connection(("127.0.0.1", _port(url)), timeout=30) as s,
    ):
        for path in (b"POST /predict", b"HEAD /health", b"GET /nowhere"):
            request = post if path == b"POST /predict" else path + b" HTTP/1.1\r\nHost: x\r\n\r\n"
            n = len(writes)
            s.sendall(request)
            deadline = time.monotonic() + 10
            while len(writes) == n and time.monotonic() < deadline:
                s.recv(65536)
    assert [w[:12] for w in writes] == [b"HTTP/1.1 200", b"HTTP/1.1 200", b"HTTP/1.1 404"]
    assert writes[0].endswith(b'\r\n\r\n{"outputs":[[1.0,2.0]]}'), writes[0]
