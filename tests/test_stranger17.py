"""Round seventeen of a stranger's attacks (session 64): whole, self-consistent hostile inputs
against what sixteen rounds left. An artifact listing sparse files under many names (hard
links), every size and sha256 right, which load, ``inspect`` and ``serve`` hashed for hours; a
FIFO planted in the name of an export's temporary sibling, which export opened and waited on
for ever; a checkpoint declaring gigabytes of optimizer state, which ``init_from`` hashed; a
client pipelining requests, which ``serve`` (uvicorn over httptools) parsed and queued without
end; two ``Content-Encoding`` lines. Each way in that got through has a test
failing without its fix; each surface that held keeps one test showing it (an artifact
directory that is a FIFO, a file or a device; chunk sizes past 2**64 or never sent; a request
split byte by byte; ``Expect: 100-continue`` with a body past the limit). The rounds before:
test_stranger16.py, ..., test_stranger9.py, test_http_hostile.py (slow clients, heads past 64
KiB, trailers, ``Content-Length`` forms, upgrades, a gzip body), test_security.py,
test_signing_stranger.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from helpers import bounded

import symjax_mlp as sm
from symjax_mlp.cli import main
from symjax_mlp.training._resume import init_run

MB = 1 << 20
S3 = np.arange(6, dtype=np.float32).reshape(2, 3)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """The chapter's MLP exported, and its answer to one row of 0.5 (from a load of it)."""
    path = sm.chapter.export_mlp(tmp_path_factory.mktemp("s17") / "mlp").path
    x = np.full((1, 512), 0.5, np.float32)
    return path, np.asarray(sm.load(path)(x))


def _sparse_links(src, dst, size, names):
    """A copy of the artifact ``src`` listing ``names`` more files: one sparse file of ``size``
    zero bytes (no block on disk) under each name, a hard link each; sizes and sha256 right."""
    art = shutil.copytree(src, dst)
    digest, zeros = hashlib.sha256(), bytes(MB)
    for _ in range(size // MB):
        digest.update(zeros)
    manifest = json.loads((art / "manifest.json").read_text())
    with open(art / names[0], "wb") as f:
        f.truncate(size)
    for name in names:
        if name != names[0]:
            os.link(art / names[0], art / name)
        manifest["files"][name] = {"sha256": digest.hexdigest(), "bytes": size}
    (art / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return art


@pytest.mark.slow  # an export, 64 MiB hashed once here: ~2 s
def test_an_artifact_listing_sparse_files_under_many_names_is_refused_before_any_is_hashed(
    mlp, tmp_path, monkeypatch, capsys
):
    """A 64 MiB sparse file (no block on disk) listed under 129 names, hard links, every size
    and sha256 right: 8 GiB that load, ``inspect`` and ``serve`` hashed before anything else
    (2 s a GiB here: a terabyte under 1,024 names, the manifest's most, is weeks), then loaded.
    The files a load reads or hashes but the weights are now bounded by what an export writes
    (8 GiB), before a byte is read; at the bound's edge they are hashed and load as before."""
    from symjax_mlp._artifact import reading

    hashed = []  # each file the load hashed, by name
    hash_regular = reading.hash_regular
    monkeypatch.setattr(
        reading,
        "hash_regular",
        lambda file, **k: hashed.append(file.name) or hash_regular(file, **k),
    )
    names = [f"z{i}" for i in range(129)]
    art = _sparse_links(mlp[0], tmp_path / "links", 64 * MB, names)
    assert os.stat(art / "z0").st_nlink == 129 and os.stat(art / "z0").st_blocks == 0
    with pytest.raises(sm.ArtifactError) as e:
        bounded(lambda: sm.load(art), 60)
    said, listed = str(e.value), json.loads((art / "manifest.json").read_text())["files"]
    total = sum(f["bytes"] for name, f in listed.items() if name != "params.safetensors")
    assert said.startswith(f"{art / 'manifest.json'} lists 132 files besides params.safetensors")
    assert f"of {total:,} bytes" in said and "largest: z0 67,108,864, z1 67,108,864" in said, said
    assert "sparse, or linked under many names" in said and "\n" not in said, said
    assert hashed == []  # nothing read: the refusal comes from the manifest alone
    assert main(["inspect", str(art)]) == 2
    err = capsys.readouterr().err
    assert "lists 132 files besides" in err and "Traceback" not in err, err
    # two of the names listed (128 MiB), under the bound: each hashed, and the model loads
    for name in names[2:]:
        os.unlink(art / name)
        del listed[name]
    (art / "manifest.json").write_text(json.dumps({**json.loads(
        (art / "manifest.json").read_text()), "files": listed}))  # fmt: skip
    x = np.full((1, 512), 0.5, np.float32)
    np.testing.assert_array_equal(np.asarray(sm.load(art)(x)), mlp[1])
    assert {"z0", "z1"} <= set(hashed)  # each listed file hashed, as before


def test_a_protocol_queues_at_most_max_pipelined_requests_of_a_read():
    """uvicorn's httptools protocol parses all it reads at once and queues every request in
    it: 256 KiB of 18-byte requests were 14,563 queued requests (2 kB each, 30 MB), and it read
    again after each answer. serve's protocol queues at most MAX_PIPELINED; the parser stops at
    the next, and its refusal, a 429, names the bound and what to do."""
    uvicorn = pytest.importorskip("uvicorn")
    pytest.importorskip("httptools")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    from symjax_mlp.serving._fds import MAX_PIPELINED, Pipeline

    written = []

    class Transport(asyncio.Transport):  # what a protocol asks of its connection
        def get_extra_info(self, name, default=None):
            return ("127.0.0.1", 1) if name in ("peername", "sockname") else default

        def write(self, data):
            written.append(data)

        def is_closing(self):
            return False

        def pause_reading(self):
            pass

        def resume_reading(self):
            pass

        def close(self):  # uvicorn's own 400, for the parser's error
            pass

    async def app(scope, receive, send):
        await asyncio.Event().wait()  # the first request runs until the test ends

    async def feed():
        config = uvicorn.Config(app, http="httptools", log_level="critical")
        config.load()
        p = HttpToolsProtocol(config, ServerState(), app_state={})
        p.pipeline = Pipeline(p, 64 * 2**10)
        p.connection_made(Transport())
        one = b"GET / HTTP/1.1\r\n\r\n"
        p.data_received(one * (256 * 2**10 // len(one)))
        queued, newest = len(p.pipeline), p.cycle
        for task in list(p.tasks):
            task.cancel()
        await asyncio.sleep(0)
        return queued, newest is p.pipeline[0][0], p.pipeline.refusal

    queued, newest, refusal = asyncio.run(feed())
    assert queued == MAX_PIPELINED and newest  # the newest queued is answered, then the 429
    assert refusal[0] == 429 and f"past the {MAX_PIPELINED} requests" in refusal[1], refusal
    assert "Read each answer before sending more" in refusal[1]


_PID = [0]  # the module's serve process, once started


@pytest.fixture(scope="module")
def served(mlp):
    """``symjax-mlp serve`` of the MLP with small limits: its port, until the module ends."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    cmd = [sys.executable, "-m", "symjax_mlp", "serve", str(mlp[0]), "--port", "0"]
    cmd += ["--body-timeout", "2", "--max-body-bytes", str(MB), "--max-batch", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _PID[0] = proc.pid  # its memory is read (test_64_kib_of_header_fields_...)
        line = bounded(proc.stdout.readline, 120)
        found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert found, f"serve did not start: {line!r} {proc.poll() and proc.stderr.read()}"
        yield int(found.group(1)), mlp[1]
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=60)
        proc.kill()


def _exchange(port, sends, pause=0.0):
    """What the server answered to ``sends`` (bytes each), read until it closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with contextlib.suppress(ConnectionError):
            for data in sends:
                s.sendall(data)
                time.sleep(pause)
        got = b""
        with contextlib.suppress(ConnectionError):
            while chunk := s.recv(MB):
                got += chunk
    return got


def _answers(got):
    """``[(status, JSON body)]`` of the answers in ``got``, in order."""
    out, rest = [], got
    while head := re.match(rb"HTTP/1\.1 (\d+) [^\r]*\r\n(.*?)\r\n\r\n", rest, re.S):
        size = int(re.search(rb"content-length: (\d+)", head.group(2), re.I).group(1))
        body = rest[head.end() : head.end() + size]
        out.append((int(head.group(1)), json.loads(body)))
        rest = rest[head.end() + size :]
    assert rest == b"", rest[:200]
    return out


_ROW = json.dumps({"inputs": [[0.5] * 512]}).encode()
_POST = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
_HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.slow  # a serve process: ~10 s to start, shared by the module's tests
def test_requests_pipelined_past_the_bound_get_their_answers_then_one_429(served):
    """A client sending requests ahead of their answers (HTTP pipelining) and not reading them
    grew serve without end: uvicorn parsed every request of each read, queued them (2 kB each,
    for 33 bytes sent) and read again after each answer: three clients that sent 4 MiB each held
    +350 MB within 8 s, growing on. Now serve queues 32: 2,000 pipelined requests get 33
    answers in order, then a 429 naming the bound, and nothing more of them is read. 16
    pipelined predictions are each answered, in order, as one alone is."""
    port, want = served
    answers = _answers(bounded(lambda: _exchange(port, [_HEALTH * 2000]), 120))
    assert [s for s, _ in answers] == [200] * 33 + [429], [s for s, _ in answers][-3:]
    said = answers[-1][1]["message"]
    assert "more than 32 requests ahead of their answers (HTTP pipelining)" in said, said
    assert "Read each answer before sending more, or open more connections." in said
    metrics = _exchange(port, [b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"])
    assert b'http_requests_total{code="429"} 1\n' in metrics  # counted as the server's others
    post = _POST + b"Content-Length: %d\r\n\r\n%s" % (len(_ROW), _ROW)
    last = _POST + b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_ROW), _ROW)
    answers = _answers(bounded(lambda: _exchange(port, [post * 15 + last]), 120))
    assert [s for s, _ in answers] == [200] * 16
    for _, body in answers:
        np.testing.assert_array_equal(np.asarray(body["outputs"], np.float32), want)


@pytest.mark.slow  # the module's serve process
def test_two_content_encoding_lines_are_one_list_and_a_gzip_among_them_is_the_415(served):
    """``Content-Encoding: identity`` then ``Content-Encoding: gzip`` (RFC 9110: one list,
    ``identity, gzip``) was read as its first line: the gzip body got "not valid JSON ('utf-8'
    codec ...)", the answer session 57 fixed for one line. Now the lines are one list: the 415
    names the encoding; two lines of identity are read as the body it is."""
    port, want = served
    body = gzip.compress(_ROW)
    twice = b"Content-Encoding: identity\r\nContent-Encoding: gzip\r\nConnection: close\r\n"
    sent = _POST + twice + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    [(status, answer)] = _answers(bounded(lambda: _exchange(port, [sent]), 60))
    assert status == 415 and "Content-Encoding 'identity,gzip'" in answer["message"], answer
    plain = b"Content-Encoding: identity\r\nContent-Encoding: identity\r\nConnection: close\r\n"
    sent = _POST + plain + b"Content-Length: %d\r\n\r\n%s" % (len(_ROW), _ROW)
    [(status, answer)] = _answers(bounded(lambda: _exchange(port, [sent]), 60))
    assert status == 200 and np.array_equal(np.asarray(answer["outputs"], np.float32), want)


@pytest.mark.slow  # the module's serve process; a body that stops: the 2 s body timeout
def test_chunk_sizes_past_2_to_the_64_or_never_sent_are_bounded(served):
    """Held. A chunk size past 2**64 is the JSON 400 naming the overflow; one of 2**64 - 1 whose
    bytes stop coming is the 408 at the body timeout; the chunked body sent whole is answered."""
    port, want = served
    chunked = _POST + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    [(status, answer)] = _answers(_exchange(port, [chunked + b"10000000000000000\r\n[[1"]))
    assert status == 400 and "Chunk size overflow" in answer["message"], answer
    sent = [chunked + b"ffffffffffffffff\r\n" + b"[" * 4000]
    [(status, answer)] = _answers(bounded(lambda: _exchange(port, sent), 60))
    assert status == 408 and "after 4000 bytes" in answer["message"], answer
    whole = chunked + b"%x\r\n%s\r\n0\r\n\r\n" % (len(_ROW), _ROW)
    [(status, answer)] = _answers(_exchange(port, [whole]))
    assert status == 200 and np.array_equal(np.asarray(answer["outputs"], np.float32), want)


@pytest.mark.slow  # the module's serve process; 300 one-byte sends
def test_a_request_split_byte_by_byte_is_answered_as_sent_whole(served):
    """Held. A request's head and body sent one byte a segment (TCP_NODELAY) is read as the
    same request: the same answer as sent whole."""
    port, want = served
    row = json.dumps({"inputs": [[0.5] * 512]}, separators=(",", ":")).encode()
    sent = _POST + b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(row), row)
    head, body = sent[:150], sent[150:]
    pieces = [head[i : i + 1] for i in range(len(head))] + [body[:-150]]
    pieces += [body[-150:][i : i + 1] for i in range(150)]
    [(status, answer)] = _answers(bounded(lambda: _exchange(port, pieces, 0.001), 60))
    assert status == 200 and np.array_equal(np.asarray(answer["outputs"], np.float32), want)


@pytest.mark.slow  # the module's serve process
def test_expect_100_continue_for_a_body_past_the_limit_is_413_and_never_invited(served):
    """Held. ``Expect: 100-continue`` with a Content-Length past max_body_bytes: the 413 at once,
    no ``100 Continue`` sent first, so the client never sends the body."""
    port, _ = served
    ask = _POST + b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % (64 * MB)
    got = bounded(lambda: _exchange(port, [ask]), 60)
    assert b"100 Continue" not in got
    [(status, answer)] = _answers(got)
    assert status == 413 and "more than max_body_bytes=1048576" in answer["message"], answer


@pytest.mark.slow  # an export: ~1 s
def test_a_fifo_planted_in_the_name_of_an_exports_temporary_sibling_never_blocks_it(tmp_path):
    """An export (and a checkpoint's save) removes what writers that died left beside its
    target, ``.NAME.tmp-PID-HEX`` of no live PID, opening each to try its lock: a FIFO planted
    under such a name, by anyone who may write the folder (/tmp), blocked that open for ever,
    the artifact written: export never returned. A sibling that is no directory is no writer's:
    left, unopened; the export returns and loads; a dead writer's directory is still removed."""
    dead = 4_194_305  # above Linux's largest pid_max: no process has it
    fifo, left = tmp_path / f".m.tmp-{dead}-0", tmp_path / f".m.tmp-{dead}-1"
    os.mkfifo(fifo)
    left.mkdir()
    h = sm.hybridize(lambda p, x: x * p["w"], {"w": np.float32(3.0)})
    try:
        path = bounded(lambda: sm.export(h, tmp_path / "m", example=S3).path, 120)
    finally:  # a reader blocked in the FIFO's open (without the fix) is let go
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert fifo.exists() and not left.exists()
    np.testing.assert_array_equal(np.asarray(sm.load(path)(S3)), 3 * S3)


def _run(optimizer):
    """A run's first state: a (12 -> 8 -> 2) MLP's params, ``optimizer``'s state of them."""
    params = sm.mlp((8, 2)).init(jax.random.key(0), np.zeros((1, 12), np.float32))["params"]
    return sm.training.TrainState(params, optimizer.init(params), jax.random.key(3), step=4)


@pytest.mark.slow  # two saves, two starts: ~5 s
def test_init_from_a_checkpoint_declaring_gigabytes_of_optimizer_state_hashes_none_of_it(
    tmp_path,
):
    """init_from reads another run's params and only hashes its optimizer state: a checkpoint
    of ours (one process) declaring gigabytes of it in a sparse tail, sha256 right, was hashed
    whole (2 GiB: 6.6 s here; up to the machine's memory: minutes, where an Orbax one's was
    bounded in session 62). Now it is refused by its header, as an Orbax one is, past 16 times
    the params' tensors or bytes (or 64 MiB: 128 MiB here); adam's state starts a run."""
    sm.training.save_checkpoint(tmp_path / "adam", _run(optax.adam(0.1)))
    started = init_run(tmp_path / "adam", _run(optax.sgd(0.1)), {})  # held: adam's is read
    assert started.step == 0 and jax.tree.structure(started.opt_state) == jax.tree.structure(
        _run(optax.sgd(0.1)).opt_state
    )
    path = sm.training.save_checkpoint(tmp_path / "ck", _run(optax.adam(0.1)))
    file, big = path / "state.safetensors", 128 * MB
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    header["opt_state/zz"] = {
        "dtype": "U8",
        "shape": [big],
        "data_offsets": [len(data), len(data) + big],
    }
    head = json.dumps(header).encode()
    head = struct.pack("<Q", len(head) + -len(head) % 8) + head + b" " * (-len(head) % 8)
    with open(file, "wb") as f:
        f.write(head + data)
        f.truncate(len(head) + len(data) + big)  # a sparse tail: no block on disk
    digest = hashlib.sha256(head + data)
    for _ in range(big // MB):
        digest.update(bytes(MB))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["state.safetensors"] = digest.hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sm.CheckpointError) as e:
        init_run(tmp_path / "ck", _run(optax.sgd(0.1)), {})
    said = str(e.value)
    assert f"{path}: besides the params, it declares 11 tensors of 134,218,7" in said, said
    assert "more than any optimizer keeps for 4 tensors" in said and "leave init_from out" in said


@pytest.mark.parametrize("kind", ["fifo", "file", "device"])
def test_an_artifact_path_that_is_a_fifo_a_file_or_a_device_is_refused_unopened(tmp_path, kind):
    """Held. A FIFO (whose ``open`` would block), a plain file or ``/dev/zero`` given as the
    artifact directory: an ArtifactError naming it, nothing opened."""
    path = {"fifo": tmp_path / "fifo", "file": tmp_path / "file", "device": "/dev/zero"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "file":
        path.write_text("{}")
    with pytest.raises(sm.ArtifactError, match="is a file, not an artifact directory"):
        bounded(lambda: sm.load(path), 60)


def _rss(pid):
    """The resident bytes of process ``pid`` now (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


@pytest.mark.slow  # the module's serve process
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
def test_64_kib_of_header_fields_is_431_at_the_101st_and_not_held(served):
    """A head of 4-byte header lines (``a:b``) within serve's 64 KiB held ~15,000 (name, value)
    tuples a connection (~2 MB of Python objects for 60 KiB sent) until the body timeout, and
    ``max_inflight_bytes`` counts bodies: 40 such connections held +56 MB here, 1,000 (the
    default max_connections) gigabytes. Now a request's head holds at most 100 fields (Apache's
    LimitRequestFields): the 101st is a 431 naming the bound, the fields dropped, counted on
    /metrics; a head of 100 fields, and one of 20, are answered as before."""
    port, want = served
    metrics = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    before = int(
        re.search(rb'code="431"\} (\d+)', _exchange(port, [metrics]) + b'code="431"} 0')[1]
    )
    lines = b"GET /health HTTP/1.1\r\n" + b"a:b\r\n" * (60 * 2**10 // 5)  # never ended
    socks, rss = [], _rss(_PID[0])
    try:
        for _ in range(40):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=30))
            socks[-1].sendall(lines)
        _exchange(port, [_HEALTH.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")])
        grown = _rss(_PID[0]) - rss  # within the 2 s body timeout: what the 40 heads hold
        got = []
        for s in socks:
            data = b""
            with contextlib.suppress(ConnectionError):
                while chunk := s.recv(MB):
                    data += chunk
            got.append(data)
    finally:
        for s in socks:
            s.close()
    assert grown < 16 * MB, f"+{grown / MB:.0f} MB for 40 heads of 4-byte fields"
    statuses = [_answers(g)[0] for g in got]
    assert {s for s, _ in statuses} == {431}, statuses[:2]
    said = statuses[0][1]["message"]
    assert "past the 100 this server reads; send at most 100." in said, said
    after = int(re.search(rb'code="431"\} (\d+)', _exchange(port, [metrics]))[1])
    assert after - before == 40
    # a whole head of 101 fields (one read), pipelined after a request: that one answered first
    head = _POST + b"Content-Length: %d\r\n" % len(_ROW)  # 3 fields
    many = head + b"".join(b"x-%d: v\r\n" % i for i in range(98)) + b"\r\n" + _ROW
    answers = _answers(bounded(lambda: _exchange(port, [_HEALTH + many]), 60))
    assert [s for s, _ in answers] == [200, 431], answers
    assert "came with 101 header lines (or trailers)" in answers[1][1]["message"], answers[1]
    for n in (96, 16):  # with the 3 and Connection: 100 fields, and 20
        fields = b"".join(b"x-%d: v\r\n" % i for i in range(n)) + b"Connection: close\r\n"
        sent = head + fields + b"\r\n" + _ROW
        [(status, answer)] = _answers(bounded(lambda s=sent: _exchange(port, [s]), 60))
        assert status == 200 and np.array_equal(np.asarray(answer["outputs"], np.float32), want)


@pytest.mark.slow  # the module's serve process
def test_a_transfer_coding_but_chunked_is_501_naming_it(served):
    """``Transfer-Encoding: gzip, chunked`` (or ``gzip`` and ``chunked`` on two lines): httptools
    undid the chunks and passed the gzip bytes as the body, answered 400 "not valid JSON". RFC
    9112 (6.1) asks a 501 for a transfer coding the server does not understand (a 415 is for a
    Content-Encoding, which the body carries end to end): the 501 names the codings. Chunked
    alone, in any case, is read as before."""
    port, want = served
    body = gzip.compress(_ROW)
    chunks = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    for codings in (b"Transfer-Encoding: gzip, chunked\r\n",
                    b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n"):  # fmt: skip
        sent = _POST + codings + b"Connection: close\r\n\r\n" + chunks
        [(status, answer)] = _answers(bounded(lambda s=sent: _exchange(port, [s]), 60))
        assert status == 501 and "Transfer-Encoding 'gzip" in answer["message"], answer
        assert "undoes only chunked" in answer["message"], answer
    plain = b"%x\r\n%s\r\n0\r\n\r\n" % (len(_ROW), _ROW)
    sent = _POST + b"Transfer-Encoding: Chunked\r\nConnection: close\r\n\r\n" + plain
    [(status, answer)] = _answers(bounded(lambda: _exchange(port, [sent]), 60))
    assert status == 200 and np.array_equal(np.asarray(answer["outputs"], np.float32), want)
