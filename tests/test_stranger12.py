"""Round twelve of a stranger's attacks (session 60): whole, self-consistent inputs against what
session 59 added (transfer guards, '/' in param keys, hijax types, checkpoint headers), hostile
but well-formed StableHLO, HTTP clients and models that raise anything. Each way in that got
through has a test failing without its fix; each surface that held keeps one test showing it.
The rounds before: test_stranger11.py, test_stranger10.py, test_stranger9.py, test_security.py,
test_checker_limits.py, test_http_hostile.py, test_raises_anything.py, ..."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import symjax_mlp as sm

X = np.ones((2, 3), np.float32)


def _linear(p, x):
    return x @ p["net/~/linear"]["w"] + p["net/~/linear"]["b"]


def _haiku(**more):
    """Params as Haiku names them (a key holding '/'), and ``more`` keys beside them."""
    w, b = np.arange(6, dtype=np.float32).reshape(3, 2), np.ones(2, np.float32)
    return {"net/~/linear": {"w": w, "b": b}, **more}


@pytest.mark.slow  # three exports (~1 s)
@pytest.mark.parametrize("key", ["x/", "a//b", "/x"])
def test_a_param_key_whose_path_holds_an_empty_part_is_refused_at_export(key, tmp_path):
    """Export took a key holding '/' (Haiku's) since session 59, and with it 'x/' or 'a//b':
    it wrote the artifact, whose own ``m.params`` ``load(params=...)`` then refused ("has an
    empty key"), so its weights could never be given back. Refused at export, as the empty
    key always was; Haiku's own names still export and reload."""
    h = sm.hybridize(_linear, _haiku(**{key: np.zeros(1, np.float32)}))
    with pytest.raises(sm.ArtifactError, match=rf"param path '{key}' has an empty key"):
        sm.export(h, tmp_path / "empty", example=X)
    assert not (tmp_path / "empty").exists()
    art = sm.export(sm.hybridize(_linear, _haiku()), tmp_path / "haiku", example=X).path
    m = sm.load(art)
    np.testing.assert_allclose(sm.load(art, params=m.params)(X), _linear(_haiku(), X))


@pytest.mark.slow  # verify runs a fresh process (~3 s)
def test_verify_runs_its_own_inputs_under_a_global_transfer_guard(tmp_path, monkeypatch):
    """transfer-guard.rst's global ``jax_transfer_guard="disallow"`` (and JAX_TRANSFER_GUARD in
    the environment, which verify's fresh process inherits): verify drew its own NumPy inputs
    and gave them to the reference and the loaded model, so it raised JAX's "Disallowed
    host-to-device transfer" (or reported the fresh process failing) for a sound artifact.
    Its inputs and outputs are verify's own to move, as load's self-test vectors are."""
    net = sm.mlp((4, 2))
    x = jnp.ones((2, 3), jnp.float32)
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    art = sm.export(h, tmp_path / "m", example=x, batch="b").path
    monkeypatch.setenv("JAX_TRANSFER_GUARD", "disallow")
    jax.config.update("jax_transfer_guard", "disallow")
    try:
        reports = [sm.verify(art, reference, batches=(1, 7)) for reference in (None, h)]
    finally:
        jax.config.update("jax_transfer_guard", None)
    assert all(r.ok for r in reports), [str(r) for r in reports]
    assert [len(r.checks) for r in reports] == [2, 2]


@pytest.mark.slow  # the Hybrid's call over a QArray compiles (~0.5 s)
def test_a_hijax_input_to_export_is_told_to_pass_the_arrays_it_is_made_from(tmp_path):
    """A Hybrid takes a value of a ``jax.experimental.hijax`` type (hijax-types.md's QArray) as
    an input since session 59; given to export as an example it was told "args[1] is a QArray;
    pass an array, e.g. example=jnp.zeros((1, 512), jnp.float32)", no way on for such a model.
    Now it names the hijax type and the arrays to pass, as the refusal of such a param does."""
    import zoo17

    q = zoo17.quantize(jnp.arange(6, dtype=jnp.float32).reshape(3, 2))
    h = sm.hybridize(lambda _, x, q: x @ zoo17.dequantize(q), {})
    np.testing.assert_allclose(h(X, q), X @ zoo17.dequantize(q))  # the Hybrid takes it
    with pytest.raises(sm.SignatureError) as e:
        sm.export(h, tmp_path / "q", example=(X, q))
    said = str(e.value)
    assert said.startswith("export(example=...): args[1] is a QArray, a value of a "), said
    assert "jax.experimental.hijax type" in said and "quantize(w)" in said, said
    assert "512" not in said and not (tmp_path / "q").exists()


@pytest.mark.slow  # an export and its load (~1 s)
def test_a_weakly_typed_example_exports_as_the_model_takes_it(tmp_path):
    """Export traces a weakly typed example as jit does since session 59 (a bfloat16 model
    times jnp.asarray(2.0) stays bfloat16), but its self-test ran the model on drawn float32
    arrays, strong, which promote to float32: every such export was refused as "the exported
    program does not give the model's results ... Do not ship it; report it". The model is
    compared at a weakly typed value, as the program was traced."""
    params = {"w": jnp.arange(1, 4, dtype=jnp.bfloat16)}
    h = sm.hybridize(lambda p, x: p["w"] * x, params)
    weak = jnp.asarray(1.5)
    assert jax.typeof(weak).weak_type and h(weak).dtype == jnp.bfloat16
    art = sm.export(h, tmp_path / "m", example=weak, batch=None).path
    got = sm.load(art)(1.5)  # (a float32 array: refused, test_one_answer)
    assert got.dtype == jnp.bfloat16  # the artifact's answer: the model's at a weak 1.5
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(h(weak), np.float32))


@pytest.fixture(scope="module")
def loaded_mlp(tmp_path_factory):
    """``sm.mlp((4, 2))`` on rows of 3, exported at a symbolic batch: its path, its answer to X."""
    net = sm.mlp((4, 2))
    h = sm.hybridize(net, net.init(jax.random.key(0), jnp.ones((2, 3), jnp.float32)))
    art = sm.export(h, tmp_path_factory.mktemp("mlp") / "m", example=X, batch="b").path
    return art, np.asarray(h(X))


@pytest.fixture
def disallowed():
    """transfer-guard.rst's global ``jax.config.update("jax_transfer_guard", "disallow")``."""
    jax.config.update("jax_transfer_guard", "disallow")
    try:
        yield
    finally:
        jax.config.update("jax_transfer_guard", None)


def test_run_moves_its_files_arrays_itself_under_a_transfer_guard(loaded_mlp, disallowed, tmp_path):
    """``symjax-mlp run`` with JAX_TRANSFER_GUARD=disallow (or a global guard in-process): the
    arrays it reads from .npy files are its own to move, yet it printed JAX's traceback
    ("Disallowed host-to-device transfer") and "this is a bug in symjax_mlp"."""
    from symjax_mlp.cli import main

    art, want = loaded_mlp
    np.save(tmp_path / "x.npy", X)
    x, y = str(tmp_path / "x.npy"), str(tmp_path / "y.npy")
    assert main(["run", str(art), "--input", x, "--output", y]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-6)


def test_a_batcher_runs_a_lone_call_and_one_on_an_event_loop_under_a_transfer_guard(
    loaded_mlp, disallowed
):
    """A Batcher served its thread's batches under a global "disallow" (session 59), not the
    ones that run elsewhere: ``b(x)`` in the caller's thread, and a quick batch on the event
    loop that awaits it, which is every request of ``symjax-mlp serve`` under
    JAX_TRANSFER_GUARD=disallow: each raised, or was answered 500, with JAX's "Disallowed
    host-to-device transfer". The rows are the batcher's own to move, as its thread's are."""
    import asyncio

    art, want = loaded_mlp
    want = want[:1]
    with sm.serving.Batcher(sm.load(art), max_batch=4) as b:
        np.testing.assert_allclose(b(X[:1]), want, rtol=1e-6)

        async def awaited():
            return [await b.asubmit(X[:1]) for _ in range(3)]  # the lone ones run on the loop

        for got in asyncio.run(awaited()):
            np.testing.assert_allclose(got, want, rtol=1e-6)
        assert b.stats.requests == 4, b.stats


# -- 2. well-formed, hostile StableHLO: refused before XLA compiles, quickly, memory bounded -----
def _in_symbolic_relu(text: str, lines: str) -> str:
    """``lines`` (reading ``%OUT``, the symbolic MLP's first ReLU, of ``tensor<?x4xf32>``;
    ``%arg0`` is the batch ``b``) put after it, whose ``%hostile`` @relu returns instead."""
    head, sep, tail = text.partition("func.func private @relu(")
    found = re.search(r"    %(\d+) = stablehlo\.maximum %arg1, %(\d+) : tensor<\?x4xf32>\n", tail)
    assert sep and found, "not the symbolic base MLP module"
    out = f"%{found.group(1)}"
    tail = tail.replace(found.group(0), found.group(0) + lines.replace("%OUT", out), 1)
    return head + sep + tail.replace(f"return {out} :", "return %hostile :", 1)


def _splat(text: str) -> str:
    """A constant declared of 10**10 elements, given one value (a splat): 40 GB from 20 bytes;
    forge's huge_compute with its iota made that constant."""
    from fuzzing import forge

    kind = "tensor<100000x100000xf32>"
    iota, splat = f"stablehlo.iota dim = 0 : {kind}", f"stablehlo.constant dense<1.0> : {kind}"
    return forge.huge_compute(text).replace(iota, splat)


def _host_function(text: str) -> str:
    """A ``custom_call`` naming the host callback of JAX before its FFI one."""
    from fuzzing import forge

    return forge.in_relu(text, (
        "    %hostile = stablehlo.custom_call @xla_python_cpu_callback(%IN) {backend_config = "
        '"140000000000000", has_side_effect = true} : (tensor<2x4xf32>) -> tensor<2x4xf32>\n'
    ))  # fmt: skip


def _loop_of_b_trips(text: str) -> str:
    """A while loop of ``b`` trips (the batch a caller chooses), each over the whole batch."""
    return _in_symbolic_relu(text, (
        "    %c0 = stablehlo.constant dense<0> : tensor<i32>\n"
        "    %w:2 = stablehlo.while(%i = %c0, %v = %OUT) : tensor<i32>, tensor<?x4xf32>\n"
        "    cond {\n"
        "      %p = stablehlo.compare LT, %i, %arg0, SIGNED "
        ": (tensor<i32>, tensor<i32>) -> tensor<i1>\n"
        "      stablehlo.return %p : tensor<i1>\n"
        "    } do {\n"
        "      %c1 = stablehlo.constant dense<1> : tensor<i32>\n"
        "      %n = stablehlo.add %i, %c1 : tensor<i32>\n"
        "      %v2 = stablehlo.add %v, %v : tensor<?x4xf32>\n"
        "      stablehlo.return %n, %v2 : tensor<i32>, tensor<?x4xf32>\n"
        "    }\n"
        "    %hostile = stablehlo.add %w#1, %OUT : tensor<?x4xf32>\n"
    ))  # fmt: skip


def _negative_once_bound(text: str) -> str:
    """A tensor of shape (b - 10, 4): well-formed, and negative at every batch below 10."""
    from fuzzing import forge

    return forge.dynamic_huge(text, (
        "    %ten = stablehlo.constant dense<10> : tensor<i32>\n"
        "    %k1 = stablehlo.constant dense<4> : tensor<1xi32>\n"
        "    %d = stablehlo.subtract %arg0, %ten : tensor<i32>\n"
        "    %rows1 = stablehlo.reshape %d : (tensor<i32>) -> tensor<1xi32>\n"
        "    %hs = stablehlo.concatenate %rows1, %k1, dim = 0 "
        ": (tensor<1xi32>, tensor<1xi32>) -> tensor<2xi32>\n"
    ))  # fmt: skip


HOSTILE = {  # edit, symbolic base?, what the refusal says
    "splat of 10**10": (_splat, False, "a tensor of 10,000,000,000 elements in stablehlo.constant"),
    "host function": (_host_function, False, "'custom_call:xla_python_cpu_callback'"),
    "loop of b trips": (_loop_of_b_trips, True, "a while loop whose trip count is not a constant"),
    "negative once bound": (_negative_once_bound, True, "an artifact you did not export was made"),
}


@pytest.mark.slow  # two exports, four forged artifacts, a fresh process loading them (~10 s)
def test_well_formed_hostile_programs_are_refused_before_compiling_in_bounded_memory(tmp_path):
    """Whole artifacts whose StableHLO is well-formed but hostile (a constant declared of 10**10
    elements and given one, a custom_call naming a host function, a loop whose trip count is the
    caller's batch, a shape negative once the batch is bound): ``load`` and ``bench`` refuse
    each with an ArtifactError naming it, before XLA compiles, in a fresh process whose peak
    memory stays that of an import of JAX (measured, not timed: a generous bound)."""
    from fuzzing import forge

    bases = {s: forge.base(tmp_path / f"base{s}", batch="b" if s else None)[0] for s in (0, 1)}
    arts = [str(forge.forge(bases[sym], tmp_path / name.replace(" ", "_"), edit))
            for name, (edit, sym, _) in HOSTILE.items()]  # fmt: skip
    code = (
        "import json, re, sys, time\nimport symjax_mlp as sm\n"
        "from symjax_mlp.cli import main\nsaid = []\nfor art in sys.argv[1:]:\n"
        "    t0 = time.perf_counter()\n    try:\n        sm.load(art)\n"
        "        said.append('loaded')\n    except sm.ArtifactError as e:\n"
        "        said.append(str(e))\n"
        "    said.append(main(['bench', art, '--calls', '1', '--repeats', '1']))\n"
        "    said.append(time.perf_counter() - t0)\n"
        # VmHWM: this process's peak, where ru_maxrss keeps the forking process's (an xdist
        # worker's, gigabytes after a run of slow tests) across exec
        "peak = int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1])\n"
        "print(json.dumps([said, peak]))\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}  # no verdict remembered before
    done = subprocess.run([sys.executable, "-c", code, *arts], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    said, peak_kib = json.loads(done.stdout.strip().splitlines()[-1])
    for i, (name, (_, _, says)) in enumerate(HOSTILE.items()):
        refusal, bench_rc, seconds = said[3 * i : 3 * i + 3]
        assert says in refusal and arts[i] in refusal, (name, refusal)
        assert "incompatible" in refusal or "negative" not in name, refusal  # [-8, 4]: JAX's
        assert bench_rc == 2 and f"{arts[i]}" in done.stderr, (name, done.stderr[-2000:])
        assert seconds < 60, (name, seconds)  # a compile of 10**10 elements: minutes, 40 GB
    assert peak_kib < 1_500_000, peak_kib  # KiB; an import of JAX and the checks: ~0.4 GB


# -- surfaces that held: one test each -----------------------------------------------------------
class Fatal(BaseException):
    """A BaseException of the caller's own."""


def test_a_batchers_future_callbacks_raising_anything_leave_it_serving():
    """Done callbacks that raise a BaseException of the caller's, SystemExit, KeyboardInterrupt
    or GeneratorExit (which ``concurrent.futures`` lets out of the thread that settles the
    future): every future of the batch still settles, and the next requests are served."""
    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    with sm.serving.Batcher(h, example=X[:1], max_batch=4) as b:
        for kind in (Fatal, SystemExit, KeyboardInterrupt, GeneratorExit):

            def raising(_, kind=kind):
                raise kind("from a done callback")

            futures = [b.submit(X[:1]) for _ in range(3)]
            for f in futures:
                f.add_done_callback(raising)
            for f in futures:
                np.testing.assert_allclose(f.result(timeout=30), 2 * X[:1])
            np.testing.assert_allclose(b(X[:1]), 2 * X[:1])
        assert b.stats.failed == 0, b.stats


@pytest.mark.slow  # a run of one epoch, then two refusals (~1-2 s)
def test_a_checkpoint_header_declaring_a_tensor_past_its_file_is_refused_unread(tmp_path):
    """A checkpoint whose safetensors header declares a kernel of 2**40 elements whose bytes
    lie past the file's end, its manifest rewritten to agree (digest, shapes): init_from and
    resume refuse it as a CheckpointError naming the file, before any tensor is held."""
    import hashlib
    import shutil
    import struct

    x = np.random.default_rng(0).normal(size=(96, 5)).astype(np.float32)
    y = np.digitize(x[:, 0] + x[:, 1], [-0.5, 0.5]).astype(np.int32)
    data = sm.training.Dataset(x[:64], y[:64], x[64:], y[64:], name="tiny")
    sm.training.train(sm.mlp((4, 3)), data, epochs=1, batch_size=16, checkpoint=tmp_path / "w")
    shutil.copytree(tmp_path / "w", tmp_path / "big")
    (step,) = (tmp_path / "big").glob("step_*")
    raw = (step / "state.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    kernel = header["params/layers_1/kernel"]
    start = kernel["data_offsets"][0]
    kernel.update(shape=[1 << 20, 1 << 20], data_offsets=[start, start + (1 << 42)])
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    forged = struct.pack("<Q", len(head)) + head + raw[8 + n :]
    (step / "state.safetensors").write_bytes(forged)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"]["state.safetensors"] = hashlib.sha256(forged).hexdigest()
    manifest["tensors"]["params/layers_1/kernel"]["shape"] = [1 << 20, 1 << 20]
    (step / "manifest.json").write_text(json.dumps(manifest))
    for kwargs in ({"epochs": 0, "init_from": tmp_path / "big"},
                   {"epochs": 2, "checkpoint": tmp_path / "big", "resume": True}):  # fmt: skip
        with pytest.raises(sm.CheckpointError, match=re.escape(str(step / "state.safetensors"))):
            sm.training.train(sm.mlp((4, 3)), data, batch_size=16, **kwargs)


@pytest.mark.slow  # an export, a signature (~1 s)
def test_inspect_of_a_signed_artifact_whose_card_a_stranger_wrote_is_cut_and_escaped(
    tmp_path, capsys
):
    """A stranger's signed artifact whose manifest card (written past export's checks, then
    signed: every digest agrees) holds 2 MB, terminal escapes and a bell in keys and values:
    ``symjax-mlp inspect`` prints it cut and escaped, and says it is signed, unverified."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from symjax_mlp.cli import main

    pytest.importorskip("model_signing")
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())  # fmt: skip
    (tmp_path / "k.pem").write_bytes(pem)
    h = sm.hybridize(lambda p, x: x @ p, jnp.ones((3, 2)))
    art = sm.export(h, tmp_path / "a", example=X, metadata={"inputs": "rows"}).path
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["metadata"] = {"inputs": "\x1b[2J" + "x" * 2_000_000,
                            **{f"k\x1b]0;{i}\x07": "\x07" for i in range(100)}}  # fmt: skip
    (art / "manifest.json").write_text(json.dumps(manifest))
    sm.sign(art, tmp_path / "k.pem")
    assert main(["inspect", str(art)]) == 0
    shown = capsys.readouterr().out
    assert len(shown) < 20_000 and "\x1b" not in shown and "\x07" not in shown, len(shown)
    assert "signed     model.sig, not verified by inspect" in shown


@pytest.mark.slow  # a serve process (~5 s)
def test_serve_refuses_a_short_body_past_the_cap_deep_json_and_reads_a_long_number(loaded_mlp):
    """``symjax-mlp serve`` against a Content-Length past --max-body-bytes with a short body
    (413 at once, nothing waited for), JSON of 10**6 nested lists (400, read by no recursive
    parser), a number of 10**6 digits (read, and answered as the model answers it); the
    server's memory after them stays where it was, and it answers the next request."""
    import socket

    from test_http_hostile import _port, _rss, _serving

    art, want = loaded_mlp
    x = np.asarray([[5 / 9, 1, 1]], np.float32)
    cmd = [sys.executable, "-m", "symjax_mlp", "serve", str(art), "--host", "127.0.0.1",
           "--port", "0", "--max-body-bytes", str(4 << 20)]  # fmt: skip
    with _serving(cmd) as (proc, url):

        def ask(raw):
            with socket.create_connection(("127.0.0.1", _port(url)), timeout=30) as s:
                s.sendall(raw)
                got = b""
                while chunk := s.recv(65536):
                    got += chunk
            status, _, body = got.partition(b"\r\n\r\n")
            return int(status.split()[1]), json.loads(body)

        def post(body):
            head = ("POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")  # fmt: skip
            return ask(head.encode() + body)

        before = _rss(proc.pid)
        short = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        status, said = ask(short + b"Content-Length: 99999999999\r\n\r\n[[1,2,3]]")
        assert status == 413 and "99999999999 bytes" in said["message"], said
        status, said = post(b"[" * 10**6 + b"]" * 10**6)
        assert status == 400 and "nests JSON lists or objects too deep" in said["message"], said
        long = b"0." + b"5" * (10**6 - 1)  # 0.555... to a million digits: 5/9
        status, said = post(b'{"inputs": [[' + long + b", 1, 1]]}")
        assert status == 200, said
        np.testing.assert_allclose(said["outputs"], sm.load(art)(x), rtol=1e-5)
        status, said = post(json.dumps({"inputs": X[:1].tolist()}).encode())
        np.testing.assert_allclose(said["outputs"], want[:1], rtol=1e-5)
        assert _rss(proc.pid) - before < 64 << 20  # no body of megabytes held after its answer
