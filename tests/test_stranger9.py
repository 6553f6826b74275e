"""Round nine of a stranger's attacks (session 57): whole, self-consistent hostile inputs
that reach past every integrity check, each refused with a clear error of the library's.
The rounds before: test_export_hostile.py, test_security.py, test_http_hostile.py,
test_serving_hostile.py, test_checkpoint_stranger.py, test_signing_stranger.py, ..."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import io
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import symjax_mlp as sm


def _asgi_post(app, body: bytes, headers: dict[bytes, bytes]) -> tuple[int, bytes]:
    """``POST /predict`` of ``body`` with ``headers`` straight into the ASGI ``app``: its
    status and answer (no server: the app's own reading of the request)."""
    sent: list[dict] = []
    given = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return given.pop(0) if given else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    head = [(b"content-length", b"%d" % len(body)), *headers.items()]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/predict", "raw_path": b"/predict", "query_string": b"",
        "root_path": "", "headers": head, "client": ("127.0.0.1", 1), "server": ("x", 80),
    }  # fmt: skip
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], data


@pytest.fixture(scope="module")
def app():
    model = lambda x: x * 2  # noqa: E731
    with sm.serving.Batcher(model, example=np.zeros((1, 4), np.float32), max_batch=4) as b:
        yield sm.serving.create_app(b, close_batcher=False)


@pytest.mark.parametrize("kind", ["application/json", "application/x-npy"])
def test_a_compressed_body_is_a_415_naming_its_content_encoding(app, kind):
    """A body sent with Content-Encoding: gzip (as a client compressing its requests sends it)
    was read as it came: a 400 "not valid JSON ('utf-8' codec can't decode byte 0x8b)", or
    "does not begin with .npy's magic string", naming neither the encoding nor what to send.
    Now a 415 that names the Content-Encoding and says to send the body as it is;
    ``identity`` (no coding) is read as before."""
    x = np.ones((1, 4), np.float32)
    if kind == "application/json":
        body = json.dumps({"inputs": x.tolist()}).encode()
    else:
        np.save(buffer := io.BytesIO(), x)
        body = buffer.getvalue()
    type_ = {b"content-type": kind.encode()}
    for coding in (b"gzip", b"br", b"identity, gzip"):
        code, raw = _asgi_post(app, gzip.compress(body), {**type_, b"content-encoding": coding})
        said = json.loads(raw)
        assert code == 415, (code, said)
        assert f"Content-Encoding '{coding.decode()}'" in said["message"], said
        assert "does not decode; send it as it is, without Content-Encoding" in said["message"]
    code, raw = _asgi_post(app, body, {**type_, b"content-encoding": b"Identity"})
    assert code == 200, (code, raw)


def test_a_checkpoints_config_of_megabytes_or_escapes_is_shown_cut_and_escaped(tmp_path):
    """A checkpoint's manifest is anyone's JSON: the settings it records (metadata.config)
    were shown whole and its keys raw in the refusal of a resume with other settings. A value of
    10 MB made a message of 10 MB (300,000 keys: 13 MB), a key holding \\x1b[31m coloured the
    terminal. Now six settings are shown, each cut, keys escaped, and the rest counted."""
    from symjax_mlp.training import save_checkpoint
    from symjax_mlp.training._resume import resume_run

    state = _state({"w": jnp.ones((2,), jnp.float32)})
    config = {"seed": 0}
    hostile = {"a": "s" * 10**5, "\x1b[31mred": 1, **{f"k{i}": i for i in range(2000)}}
    save_checkpoint(tmp_path, state, metadata={"config": hostile})
    with pytest.raises(sm.CheckpointError, match="was written with") as e:
        resume_run(tmp_path, state, config, resume=True, store=None, update=lambda s: [])
    said, n = str(e.value), len(str(e.value))
    assert n < 1500 and "\x1b" not in said[:1500], (n, said[:1500])
    assert "'a': 'sssss" in said and "'a': None" in said and "; and 1997 more)" in said, said
    assert "what differs: \\x1b[31mred; a; k0; k1; k10; k100; and" in said, said


def _state(params):
    from symjax_mlp.training import TrainState

    return TrainState(params, optax.sgd(0.1).init(params), jax.random.key(0), step=0, epoch=0)


def test_a_checkpoint_of_tensors_named_in_megabytes_is_refused_in_a_few_lines(tmp_path):
    """A checkpoint whose state.safetensors names tensors the model lacks was refused with five
    names, each whole: its header may hold 100 MB of them, a message of as many (a name of 5 MB:
    5 MB, checked with train(resume=True)). Now six at most, each cut (100 KB names here)."""
    from symjax_mlp.training import restore_checkpoint, save_checkpoint

    names = {"\x1b[31m" + "n" * 10**5: jnp.ones(1), **{f"t{i}": jnp.ones(1) for i in range(200)}}
    save_checkpoint(tmp_path, _state(names))
    with pytest.raises(sm.CheckpointError, match="does not fit this model") as e:
        restore_checkpoint(tmp_path, _state({"w": jnp.ones(1)}))
    said, n = str(e.value), len(str(e.value))
    assert n < 1500 and "\x1b" not in said[:1500], (n, said[:1500])
    assert "missing tensors ['params/w'], unexpected tensors ['params/\\x1b[31mnnnn" in said, said
    assert "nnn...nnn" in said and "nnn', 'params/t0', 'params/t1'," in said, said
    assert "'params/t101', ...]. Resume" in said, said


def test_an_orbax_steps_file_names_reach_its_refusal_escaped(tmp_path):
    """An Orbax step's entries are named by whoever wrote the directory: a FIFO named
    ``\\x1b[31m...`` (or a symlink pointing at such a name) was quoted raw in the refusal, and
    ``symjax-mlp train`` printed it, colouring the terminal. Now each is escaped."""
    from symjax_mlp.training._orbax import check_files

    step = tmp_path / "5"
    step.mkdir()
    os.mkfifo(step / "\x1b[31mfifo")
    with pytest.raises(sm.CheckpointError) as e:
        check_files(step)
    assert "\x1b" not in str(e.value) and "5/\\x1b[31mfifo is neither a file" in str(e.value)
    os.unlink(step / "\x1b[31mfifo")
    (step / "link").symlink_to("\x1b]0;title\x07")
    with pytest.raises(sm.CheckpointError) as e:
        check_files(step)
    assert "\x1b" not in str(e.value) and "a symlink to \\x1b]0;title\\x07:" in str(e.value)


def test_an_npy_input_replaced_by_a_fifo_after_it_was_checked_never_blocks(tmp_path):
    """``symjax-mlp run`` checks each --input is a regular file as it parses its options, then
    loads the artifact (seconds), then reads them: a file replaced by a FIFO in between (the
    directory changing under it) blocked the run for ever in open(). The read now opens
    without blocking and refuses what is no regular file, naming it."""
    from helpers import bounded

    from symjax_mlp._npy import read_npy

    fifo = tmp_path / "x.npy"
    os.mkfifo(fifo)
    try:
        with pytest.raises(sm.SignatureError) as e:
            bounded(lambda: read_npy(fifo, what="x.npy"), seconds=10)
    finally:  # without the fix: the blocked open is given a writer, and ends
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert str(e.value) == (
        "x.npy is not a regular file (a FIFO, device or directory); nothing was read from it. "
        "Pass a .npy file."
    )
    with pytest.raises(sm.SignatureError, match=r"x\.npy is not a regular file"):
        read_npy(tmp_path, what="x.npy")  # a directory: was "[Errno 21] Is a directory"


def test_an_npy_header_past_numpys_limit_is_refused_in_one_line_never_advising_pickle():
    """A .npy whose header is over the 10,000 bytes np.load reads (a crafted one; a dtype of
    thousands of fields) was refused in NumPy's three lines, telling the client or the user
    of ``run`` to 'fully trust the .npy file using allow_pickle=True'. Now one line of ours."""
    from symjax_mlp._npy import read_npy

    x = np.zeros(1, dtype=[(f"f{i}", "<f4") for i in range(2000)])
    np.save(buffer := io.BytesIO(), x)
    with pytest.raises(sm.SignatureError) as e:
        read_npy(buffer.getvalue(), what="x.npy")
    said = str(e.value)
    assert "\n" not in said and "pickle" not in said, said
    assert said.startswith("x.npy is not a readable .npy array: its header has 34,998 bytes, ")
    np.save(buffer := io.BytesIO(), np.ones(2, np.float32))  # an array of numbers: read
    np.testing.assert_array_equal(read_npy(buffer.getvalue(), what="x.npy"), np.ones(2))


def test_a_json_zero_or_negative_for_an_e8m0_input_is_said_to_be_outside_its_range():
    """float8_e8m0fnu (MX scales) holds powers of two only, no zero and no negative number:
    a JSON 0 or -2 for it was refused as 'beyond its range (largest 1.701e+38)', which 0 is
    not. Now its range is said whole, and why."""
    import ml_dtypes

    from symjax_mlp.serving._bodies import decode

    e8m0 = ml_dtypes.float8_e8m0fnu
    with sm.serving.Batcher(lambda x: x, example=np.ones((1, 2), e8m0), max_batch=2) as b:
        for row in ("[0, 1]", "[-2, 1]"):
            with pytest.raises(sm.SignatureError) as e:
                decode(b, f'{{"inputs": [{row}]}}'.encode(), "application/json")
            assert "holds numbers outside float8_e8m0fnu's range, 5.877e-39 to 1.701e+38 (it " in (
                str(e.value)
            )
        [x], _ = decode(b, b'{"inputs": [[0.5, 4]]}', "application/json")
        assert x.dtype == e8m0 and x.astype(np.float32).tolist() == [[0.5, 4.0]]


@pytest.mark.parametrize("where", ["config", "metadata"])
def test_a_checkpoints_probe_holding_an_int_past_float64_is_a_checkpoint_error(tmp_path, where):
    """A resume compares the model's and the optimizer's probes (logits, updates) with those
    the checkpoint's manifest records, anyone's JSON: an integer of 400 digits among them was
    taken as a number and raised float()'s OverflowError from train(resume=True) (symjax-mlp
    train: a traceback, exit 1). Now the checkpoint is refused as edited."""
    from symjax_mlp.training import save_checkpoint
    from symjax_mlp.training._resume import resume_run

    state = _state({"w": jnp.ones((2,), jnp.float32)})
    config = {"seed": 0, "model_probe": [0.5, 1.5]}
    if where == "config":
        meta = {"config": {"seed": 0, "model_probe": [10**400, 1.5]}}
    else:
        meta = {"config": config, "optimizer_probe": [10**400]}
    save_checkpoint(tmp_path, state, metadata=meta)
    with pytest.raises(sm.CheckpointError, match="probe is not a list of numbers; the checkpoint"):
        resume_run(tmp_path, state, config, resume=True, store=None, update=lambda s: [0.0])


def test_a_checkpoints_history_of_an_int_past_float64_is_refused_not_carried_on(tmp_path):
    """A checkpoint's history (its manifest: anyone's JSON) holding a loss of 10**400 was read
    as a number: resumed, the run carried it into its result, its next checkpoint and
    ``symjax-mlp train --json`` (a 401-digit "loss"). Now the checkpoint is refused as edited,
    as a NaN there is; and a save of such a history is refused before it is written."""
    from symjax_mlp.training import restore_checkpoint, save_checkpoint

    state = _state({"w": jnp.ones((2,), jnp.float32)})
    record = dict(epoch=1, step=0, loss=0.5, train_accuracy=1.0, test_accuracy=1.0, seconds=1.0)
    save_checkpoint(tmp_path, state, metadata={"history": [record]})
    manifest = tmp_path / "step_00000000" / "manifest.json"
    edited = json.loads(manifest.read_text())
    edited["metadata"]["history"][0]["loss"] = 10**400
    manifest.write_text(json.dumps(edited))
    with pytest.raises(sm.CheckpointError, match=r"the field\(s\) metadata.history are missing"):
        restore_checkpoint(tmp_path, state)
    with pytest.raises(sm.ConfigError, match="restore_checkpoint would refuse"):
        save_checkpoint(tmp_path / "b", state, metadata={"history": [{**record, "loss": 10**400}]})


def test_a_tensors_dtype_an_orbax_meta_names_reaches_the_refusal_cut_and_escaped():
    """An Orbax step's meta (JSON, anyone's) names each tensor's shape and dtype, which the
    refusal of a tensor that does not fit quoted whole and raw: a dtype of 1 MB, a shape of
    100,000 dimensions, a \\x1b[31m. Now cut and escaped (a dtype as it was: float16)."""
    from symjax_mlp.training._state import check_fit

    wanted = {"params/w": ((2,), "float32")}
    hostile = {"params/w": ((1,) * 10**5, "\x1b[31m" + "x" * 10**6)}
    with pytest.raises(sm.CheckpointError) as e:
        check_fit("ck/4", hostile, wanted)
    said, n = str(e.value), len(str(e.value))
    assert n < 1000 and "\x1b" not in said, (n, said[:1000])
    assert said.startswith("ck/4: tensor 'params/w' has shape (1, 1, 1, 1, 1, 1, ...) and dtype ")
    assert "dtype \\x1b[31mxxx" in said, said
    with pytest.raises(sm.CheckpointError, match="The checkpoint holds float16 values: build"):
        check_fit("ck/4", {"params/w": ((2,), "float16")}, wanted)


def test_a_checkpoint_manifest_of_one_json_string_is_quoted_escaped(tmp_path):
    """A checkpoint's manifest.json of one JSON string (not an object) was quoted raw in its
    refusal: "\\u001b[31m" there reached the terminal as \\x1b[31m. Now escaped."""
    from symjax_mlp.training import restore_checkpoint, save_checkpoint

    state = _state({"w": jnp.ones((2,), jnp.float32)})
    save_checkpoint(tmp_path, state)
    (tmp_path / "step_00000000" / "manifest.json").write_text(json.dumps("\x1b[31mred"))
    with pytest.raises(sm.CheckpointError) as e:
        restore_checkpoint(tmp_path, state)
    assert "\x1b" not in str(e.value) and "(its manifest holds \\x1b[31mred)" in str(e.value)


class _Endless(io.RawIOBase):
    """A stream that never ends: ``head``, then zeros for ever (``/dev/zero``, a stranger's
    server); counts what was read of it."""

    def __init__(self, head: bytes = b""):
        self.head, self.taken = head, 0

    def readable(self):
        return True

    def readinto(self, buffer):
        n = len(buffer)
        chunk = (self.head[self.taken :] + bytes(n))[:n]
        buffer[:n] = chunk
        self.taken += n
        return n


def test_run_reads_an_endless_stdin_no_further_than_its_npy_header_says():
    """``symjax-mlp run --input -`` read stdin to its end: one that never ends (< /dev/zero, a
    stranger's server piped in) was read until memory ran out. Now its first MiB and, past it,
    only the bytes its .npy header declares and one more (so a second array is refused), none
    where it declares more than this machine's memory."""
    from symjax_mlp._npy import read_npy, read_stream

    np.save(buffer := io.BytesIO(), np.ones((2**19, 1), np.float32))  # 2 MiB, then zeros
    head = buffer.getvalue()
    stream = _Endless(head)
    data = read_stream(io.BufferedReader(stream), what="stdin", memory=2**40)
    assert len(data) == len(head) + 1 and stream.taken <= len(head) + 2 * io.DEFAULT_BUFFER_SIZE
    with pytest.raises(sm.SignatureError, match=r"stdin has more bytes after its array \(float32"):
        read_npy(data, what="stdin")
    stream = _Endless()  # no .npy at all: its first MiB, then what it is
    with pytest.raises(sm.SignatureError, match=r"does not begin with \.npy's magic string"):
        read_npy(read_stream(stream, what="stdin", memory=2**40), what="stdin")
    assert stream.taken == 1 << 20
    huge = head[:128].replace(b"(524288, 1)", b"(%d, 1)" % 10**15)
    with pytest.raises(sm.SignatureError, match=r"more than this machine's memory \(2,000 by"):
        read_stream(_Endless(huge), what="stdin", memory=2000)
    got = read_npy(read_stream(io.BytesIO(head), what="-", memory=2**40), what="-")
    np.testing.assert_array_equal(got, np.ones((2**19, 1), np.float32))


@pytest.mark.slow  # an export (1-2 s)
def test_run_given_an_endless_stdin_refuses_it_in_one_line(tmp_path, monkeypatch, capsys):
    """The command itself: ``symjax-mlp run ART --input - < /dev/zero`` (here a stream of a
    .npy header then zeros for ever) read until memory ran out; now it exits 2 in one line."""
    from symjax_mlp.cli import main

    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    art = sm.export(h, tmp_path / "a", example=jnp.ones((2, 3), jnp.float32))
    np.save(buffer := io.BytesIO(), np.ones((2, 3), np.float32))
    stream = _Endless(buffer.getvalue())
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BufferedReader(stream)))
    argv = ["run", str(art.path), "--input", "-", "--output", str(tmp_path / "y.npy")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stdin has more bytes after its array" in err, err
    assert stream.taken <= (1 << 20) + 2 * io.DEFAULT_BUFFER_SIZE
