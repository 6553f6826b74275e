"""A researcher's day three, and a PyTorch user porting the chapter (session 59, Part D).

Day three: the model trained on day two (tests/test_day_two.py) goes to deployment, as README's
"Ship it", "Serve it" and "Run it outside Python" write it: exported with a symbolic batch,
signed with keys made as README says, handed to a colleague who loads it with
``verify_signature=``, inspects it, runs it on .npy files, serves it (HTTP with curl, Ray Serve),
compiles it with IREE, and loads it a month later under another config.

The port: the chapter's PyTorch code (``torch.jit.script``, its 1000-call benchmark,
``net.save``) done with symjax_mlp by someone who knows PyTorch.

Each cheap test is a stumble of those walks: it failed before its fix.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

import symjax_mlp as sm

ENV = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
CLI = [sys.executable, "-P", "-m", "symjax_mlp"]


def _port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _cli(cwd, *args, env=ENV) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True)


def _keys(d, name):
    """A P-256 key pair in PEM, ``d/name.pem`` and ``d/name.pub``, as cryptography writes it."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = d / f"{name}.pem", d / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))  # fmt: skip
    public.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))  # fmt: skip
    return private, public


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small MLP exported at a symbolic batch and signed; its Hybrid, input and keys."""
    d = tmp_path_factory.mktemp("day3")
    net, x = sm.mlp((4, 2)), jnp.ones((1, 3))
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    art = sm.export(h, d / "mlp", example=x, batch="b").path
    ours, theirs = _keys(d, "ours"), _keys(d, "theirs")
    sm.sign(art, ours[0])
    return art, h, x, ours, theirs


# ---------------------------------------------------------------- day three: the stumbles


@pytest.mark.slow  # the module's export and signing
def test_inspect_of_a_signed_artifact_says_so_and_how_to_check_it(small, tmp_path):
    """The colleague's `symjax-mlp inspect` of a signed artifact said nothing of model.sig (and
    counted the files without it): nothing told them it was signed, or how to check that."""
    art, *_ = small
    shown = str(sm.inspect(art))
    assert "signed     model.sig, not verified by inspect" in shown, shown
    assert "verify_signature=PUBLIC_KEY" in shown, shown
    unsigned = shutil.copytree(art, tmp_path / "mlp", ignore=shutil.ignore_patterns("model.sig"))
    assert "model.sig" not in str(sm.inspect(unsigned)), sm.inspect(unsigned)


@pytest.mark.slow  # the module's export and signing
def test_a_public_key_that_did_not_sign_it_is_named_another_key_not_an_edit(small):
    """The colleague given the wrong public key read "The artifact was changed after it was
    signed, or signed by someone else": they went looking for an edit that never happened.
    model-signing knows it is the key (its "Key mismatch"), and the message now says so."""
    art, _, x, ours, theirs = small
    with pytest.raises(sm.ArtifactError) as e:
        sm.load(art, verify_signature=theirs[1])
    said = str(e.value)
    assert "it was made with another key" in said and "theirs.pub" in said, said
    assert "changed after it was signed" not in said, said
    assert "Ask its author for that public key" in said, said
    np.testing.assert_array_equal(sm.load(art, verify_signature=ours[1])(x), sm.load(art)(x))


@pytest.mark.slow  # the module's export and signing
def test_a_float64_jax_array_under_x64_is_refused_saying_x64_made_it(small):
    """A month later, with jax_enable_x64 on, the colleague's `m(jnp.ones((2, 3)))` that ran
    before was refused as float64, with nothing saying why their array was float64 now."""
    art, *_ = small
    m = sm.load(art)
    with jax.enable_x64(True):
        with pytest.raises(sm.SignatureError) as e:
            m(jnp.ones((2, 3)))
        with pytest.raises(sm.SignatureError) as plain:
            m(np.ones((2, 3)))  # NumPy's float64 is not x64's doing
        assert m(jnp.ones((2, 3), jnp.float32)).shape == (2, 2)
    assert "jax_enable_x64 is on" in str(e.value) and "x.astype(np.float32)" in str(e.value)
    assert "jax_enable_x64" not in str(plain.value), plain.value


def test_the_folder_an_artifact_was_unpacked_into_names_the_artifact_inside(tmp_path):
    """The colleague unpacked `tar xf digits_mlp.tar` into `received/` and loaded `received`:
    "not a complete symjax_mlp artifact ... Export it again", which they cannot (no source)."""
    inner = tmp_path / "received" / "digits_mlp"
    inner.mkdir(parents=True)
    (inner / "manifest.json").write_text("{}")  # any artifact: the folder is what is named
    for look in (sm.load, sm.inspect):
        with pytest.raises(sm.ArtifactError) as e:
            look(tmp_path / "received")
        assert f"It holds one: pass {inner}." in str(e.value), e.value
        assert "Export it again" not in str(e.value), e.value
    (tmp_path / "empty").mkdir()
    with pytest.raises(sm.ArtifactError, match="Export it again"):
        sm.load(tmp_path / "empty")


def test_images_given_to_a_model_of_rows_are_told_to_flatten():
    """The digits model takes rows of 64 raw pixels; the colleague's images, (5, 8, 8) as
    sklearn's `digits.images` holds them or (5, 1, 8, 8) as a PyTorch loader gives them, were
    refused with "Pass an array of rank 2", not how to make one."""
    spec = {"path": "args[0]", "shape": ["b", 64], "dtype": "float32"}
    sig = sm.Signature.from_json({"inputs": [spec], "outputs": [{**spec, "shape": ["b", 10]}],
                                  "output_kind": "array", "batch": "b"})  # fmt: skip
    for shape in ((5, 8, 8), (5, 1, 8, 8)):
        with pytest.raises(sm.SignatureError) as e:
            sig.check([np.zeros(shape, np.float32)], caller="m")
        assert "Flatten each row to 64 values: x.reshape(len(x), -1)." in str(e.value), e.value
    with pytest.raises(sm.SignatureError) as other:  # 16 values a row: no reshape makes 64
        sig.check([np.zeros((5, 4, 4), np.float32)], caller="m")
    assert "Pass an array of rank 2." in str(other.value), other.value
    assert sig.check([np.zeros((5, 64), np.float32)], caller="m")[0].shape == (5, 64)


# ---------------------------------------------------------------- the port: the stumbles


def test_mlp_says_its_sizes_are_outputs_not_torchs_in_and_out():
    """The chapter's nn.Linear(512, 256), Linear(256, 128), Linear(128, 2), written as the
    widths it names, `sm.mlp((512, 256, 128, 2))`, runs without a word: a fourth layer, 512
    wide, on any input width. help(sm.mlp) said "output width of each layer", not that."""
    net, x = sm.mlp((8, 4, 3, 2)), jnp.ones((1, 8))  # as Linear(8, 4), (4, 3), (3, 2) read
    layers = jax.eval_shape(net.init, jax.random.key(0), x)["params"]  # shapes: no compile
    assert len(layers) == 4 and layers["layers_0"]["kernel"].shape == (8, 8)
    doc = " ".join(sm.mlp.__doc__.split())
    assert "torch.nn.Linear(in, out)" in doc and "is ``mlp((256, 128, 2))``" in doc, doc


def test_pytorch_names_on_a_hybrid_say_the_jax_way():
    """`h.eval()`, `h.state_dict()`, `h.save(...)`, `torch.no_grad()` habits: each was Python's
    bare "'Hybrid' object has no attribute 'eval'". They still are AttributeErrors (hasattr is
    False), now saying what to write instead; other missing names read as Python's."""
    net = sm.mlp((4, 2))
    shapes = jax.eval_shape(net.init, jax.random.key(0), jnp.ones((1, 3)))  # no compile
    h = sm.hybridize(net, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes))
    _names_say(h, {
        "eval": "h(x, train=False)",
        "train": "module.eval() and .train() switch it",
        "state_dict": "h.params",
        "parameters": "a torch.nn.Linear weight's transpose",
        "save": "sm.export(h, path, example=x)",
        "no_grad": "jax.grad of h.apply(params, x)",
        "forward": "h.eager(x)",
        "cuda": "jax.device_put(x, device)",
    })  # fmt: skip
    with pytest.raises(AttributeError) as e:
        h.no_such_thing  # noqa: B018
    assert str(e.value) == "'Hybrid' object has no attribute 'no_such_thing'", e.value


@pytest.mark.slow  # the module's export and signing
def test_pytorch_names_on_a_loaded_model_say_the_jax_way(small):
    """The same names on the loaded model, where they differ: it runs as exported."""
    m = sm.load(small[0])
    _names_say(m, {"eval": "as it was exported", "state_dict": "m.params",
                   "backward": "vjp_order=1", "forward": "call it: m(x)"})  # fmt: skip
    with pytest.raises(AttributeError) as e:
        m.save  # noqa: B018
    assert str(e.value) == "'LoadedModel' object has no attribute 'save'", e.value


def _names_say(obj, says):
    for name, hint in says.items():
        assert not hasattr(obj, name), name
        with pytest.raises(AttributeError) as e:
            getattr(obj, name)
        assert hint in str(e.value) and e.value.name == name, (name, str(e.value))


@pytest.mark.slow  # two traces that fail: a compile's cost under load
def test_pytorch_weights_copied_as_they_are_are_named_as_the_transpose():
    """A torch.nn.Linear weight is (out, in); copied into a Dense kernel (in, out) as it is, the
    call said "The params were made for inputs of other shapes ... init the model again": the
    user's inputs were right. It now names the transpose and weight.T."""
    net, x = sm.mlp((8, 2)), jnp.ones((1, 5))
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    as_torch = jax.tree.map(lambda a: a.T if a.ndim == 2 else a, h.params)  # weight = kernel.T
    with pytest.raises(sm.SignatureError) as e:
        h.replace(params=as_torch)(x)
    said = str(e.value)
    assert "has shape (8, 5), and these inputs make it (5, 8)" in said, said
    assert "It holds the transpose" in said and "weight.T" in said, said
    assert "made for inputs of other shapes" not in said, said
    with pytest.raises(sm.SignatureError) as other:  # inputs of another width: as it was
        h(jnp.ones((1, 4)))
    assert "made for inputs of other shapes" in str(other.value), other.value


def test_hybridize_says_a_call_returns_before_it_is_done_and_print_runs_per_trace():
    """The chapter's benchmark times `for i in range(1000): net(x)`; ported as it is, the loop
    times JAX's dispatch (a call returns before its result is computed), which no docstring
    said; nor that a `print` in the model runs once per trace, where TorchScript's runs on
    every call (the walk below shows both)."""
    doc = " ".join(sm.hybridize.__doc__.split())
    assert "jax.block_until_ready(h(x))" in doc and "asynchronous dispatch" in doc, doc
    assert "once per input signature, not on every call" in doc and "jax.debug.print" in doc


# ---------------------------------------------------------------- the walks


def _wait_for(url: str, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"{url} never answered")


@pytest.fixture(scope="module")
def handed_over(tmp_path_factory):
    """Day three's morning, as README writes it: train and export (a symbolic batch), keys by
    openssl, sm.sign; then the artifact copied to a colleague's directory with the public key."""
    if shutil.which("openssl") is None:
        pytest.skip("README's keys are made with openssl, which is not installed")
    ours, theirs = tmp_path_factory.mktemp("researcher"), tmp_path_factory.mktemp("colleague")
    done = _cli(ours, "train", "--epochs", "1", "--sizes", "16,10", "--export", "digits_mlp",
                "--quiet")  # fmt: skip
    assert done.returncode == 0, done.stderr
    for cmd in (
        ["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "key.pem"],
        ["openssl", "ec", "-in", "key.pem", "-pubout", "-out", "pub.pem"],
    ):
        subprocess.run(cmd, cwd=ours, check=True, capture_output=True)  # fmt: skip
    assert sm.sign(ours / "digits_mlp", ours / "key.pem") == ours / "digits_mlp" / "model.sig"
    shutil.copytree(ours / "digits_mlp", theirs / "digits_mlp")
    shutil.copy(ours / "pub.pem", theirs / "pub.pem")
    from sklearn.datasets import load_digits

    np.save(theirs / "x.npy", load_digits().data[:5].astype(np.float32))  # raw pixels
    np.save(theirs / "x64.npy", load_digits().data[:5])  # as sklearn gives them: float64
    return theirs


@pytest.mark.slow
def test_day_three_the_colleague_loads_inspects_runs_serves_and_compiles(handed_over):
    """The colleague's afternoon: load with verify_signature=, inspect, `run` on .npy files,
    `serve` with curl as README shows it, IREE where it is installed."""
    d = handed_over
    m = sm.load(d / "digits_mlp", verify_signature=d / "pub.pem")
    x = np.load(d / "x.npy")
    want = np.asarray(m(x))
    assert want.shape == (5, 10) and m.metadata["inputs"].startswith("raw features")
    shown = _cli(d, "inspect", "digits_mlp")
    assert "with b >= 1" in shown.stdout and "signed     model.sig" in shown.stdout, shown
    ran = _cli(d, "run", "digits_mlp", "--input", "x.npy", "--output", "y.npy",
               "--verify-signature", "pub.pem")  # fmt: skip
    assert ran.returncode == 0 and "wrote y.npy: float32[5, 10]" in ran.stdout, ran.stderr
    np.testing.assert_allclose(np.load(d / "y.npy"), want, rtol=1e-6, atol=1e-6)
    wide = _cli(d, "run", "digits_mlp", "--input", "x64.npy", "--output", "y64.npy")
    assert wide.returncode == 2 and "x.astype(np.float32)" in wide.stderr, wide.stderr
    assert "Traceback" not in wide.stderr, wide.stderr

    port = _port()
    serve = [*CLI, "serve", "digits_mlp", "--port", port, "--verify-signature", "pub.pem"]
    server = subprocess.Popen(serve, cwd=d, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _wait_for(f"http://127.0.0.1:{port}/health", server)
        url = f"localhost:{port}/predict"
        body = json.dumps({"inputs": x[:2].tolist()})
        curl = ["curl", "-s", "-H", "Content-Type: application/json", "-d", body, url]
        if shutil.which("curl"):
            got = json.loads(subprocess.run(curl, capture_output=True, check=True).stdout)
            np.testing.assert_allclose(got["outputs"], want[:2], rtol=1e-5, atol=1e-5)
            npy = ["curl", "-s", "-H", "Content-Type: application/x-npy", "--data-binary",
                   "@x.npy", url]  # fmt: skip
            out = subprocess.run(npy, cwd=d, capture_output=True, check=True).stdout
            np.testing.assert_allclose(np.load(io.BytesIO(out)), want, rtol=1e-5, atol=1e-5)
    finally:
        server.send_signal(signal.SIGINT)
        err = server.communicate(timeout=60)[1]
    assert server.returncode == 0 and "Traceback" not in err, err

    try:
        import iree.runtime
    except ImportError:
        return
    iree = sm.load(d / "digits_mlp", runtime="iree", verify_signature=d / "pub.pem")
    np.testing.assert_allclose(np.asarray(iree(x)), want, rtol=1e-5, atol=1e-5)


_A_MONTH_LATER = """
import sys, jax, jax.numpy as jnp, numpy as np, symjax_mlp as sm
m = sm.load("digits_mlp", verify_signature="pub.pem")
np.save(sys.argv[1], np.asarray(m(np.load("x.npy"))))
try:
    m(jnp.asarray(np.load("x.npy").tolist()))  # Python floats: float64 under x64
except sm.SignatureError as e:
    print(e)
"""


@pytest.mark.slow
def test_day_three_a_month_later_under_another_config(handed_over):
    """A month later: x64 on, four devices, jax_enable_checks; the same answers, and a jnp
    array that x64 made float64 refused saying so."""
    d = handed_over
    want = np.asarray(sm.load(d / "digits_mlp")(np.load(d / "x.npy")))
    for i, config in enumerate(({"JAX_ENABLE_X64": "1"}, {"JAX_NUM_CPU_DEVICES": "4"},
                                {"JAX_ENABLE_CHECKS": "1", "JAX_ENABLE_X64": "1"})):  # fmt: skip
        later = [sys.executable, "-P", "-c", _A_MONTH_LATER, f"later{i}.npy"]
        done = subprocess.run(later, cwd=d, env={**ENV, **config}, capture_output=True, text=True)
        assert done.returncode == 0, (config, done.stderr)
        np.testing.assert_allclose(np.load(d / f"later{i}.npy"), want, rtol=1e-6, atol=1e-6)
        x64 = config.get("JAX_ENABLE_X64") == "1"
        assert ("jax_enable_x64 is on" in done.stdout) == x64, (config, done.stdout)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.xdist_group("ray")
def test_day_three_two_ray_serve_replicas_answer_as_serve_does(handed_over):
    """README: `symjax-mlp serve DIR --ray --replicas 2` (`--replica-cpus 0.5` on a small
    machine), the same endpoints and bodies as `serve`, the signature checked by each."""
    pytest.importorskip("ray.serve")
    d, port = handed_over, _port()
    want = np.asarray(sm.load(d / "digits_mlp")(np.load(d / "x.npy")))
    serve = [*CLI, "serve", "digits_mlp", "--ray", "--replicas", "2", "--replica-cpus", "0.5",
             "--port", port, "--verify-signature", "pub.pem"]  # fmt: skip
    env = {**ENV, "RAY_AUTH_MODE": "disabled"}
    server = subprocess.Popen(serve, cwd=d, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _wait_for(f"http://127.0.0.1:{port}/health", server, seconds=240)  # one replica up
        assert "serving digits_mlp on" in server.stdout.readline()  # both: serve runs them
        body = json.dumps({"inputs": np.load(d / "x.npy").tolist()}).encode()
        ask = urllib.request.Request(f"http://127.0.0.1:{port}/predict", body,
                                     {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(ask, timeout=60) as answer:
            got = json.loads(answer.read())["outputs"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    finally:
        server.send_signal(signal.SIGINT)
        err = server.communicate(timeout=120)[1]
    assert server.returncode == 0, err


_NO_SOURCE = """
import sys, numpy as np, symjax_mlp as sm
m = sm.load("my_mlp")
print(m.signature)
np.save("y.npy", np.asarray(m(np.load("x.npy"))))
"""


@pytest.mark.slow
def test_the_chapters_pytorch_code_ported(tmp_path, capsys):
    """The chapter's PyTorch steps, ported: get_net(), a (1, 512) input, scripting (here
    hybridize), 1000 batch-1 calls timed (waiting for the last), print on tracing only, a
    Python `if` on a value, and `net.save('my_mlp')` loaded where the model's source is not."""
    net = sm.mlp((256, 128, 2))  # nn.Sequential(Linear(512, 256), ReLU, ..., Linear(128, 2))
    x = jax.random.normal(jax.random.key(0), (1, 512))  # torch.randn(size=(1, 512))
    h = sm.hybridize(net, net.init(jax.random.key(1), x))
    assert x.dtype == h(x).dtype == jnp.float32  # float32, as torch's default
    np.testing.assert_allclose(h(x), h.eager(x), rtol=1e-5, atol=1e-6)
    t0 = time.perf_counter()
    for _ in range(1000):
        y = h(x)
    jax.block_until_ready(y)  # what hybridize's docstring says to do; torch's CPU call waits
    assert time.perf_counter() > t0 and h.trace_count == 1  # 1000 calls, one trace

    hn = sm.chapter.HybridNet()
    hh = sm.hybridize(hn, hn.init(jax.random.key(0), jnp.ones((1, 3))))
    capsys.readouterr()
    hh(jnp.ones((1, 3))), hh(jnp.ones((1, 3)))
    assert capsys.readouterr().out.count("\n") == hh.trace_count * 2  # x and the hidden layer

    def branchy(p, v):
        return v * p if v.sum() > 0 else -v  # fine in TorchScript, which scripts the `if`

    hb = sm.hybridize(branchy, jnp.float32(2))
    np.testing.assert_array_equal(hb.eager(jnp.ones(3)), 2 * jnp.ones(3))
    with pytest.raises(sm.ControlFlowError, match=r"jnp\.where\(x > 0, a, b\) or jax\.lax\.cond"):
        hb(jnp.ones(3))

    art = sm.export(h, tmp_path / "my_mlp", example=x)  # net.save('my_mlp'): any batch size
    assert "b >= 1" in str(art.signature)
    xs = np.asarray(jax.random.normal(jax.random.key(2), (3, 512)))
    np.save(tmp_path / "x.npy", xs)
    done = subprocess.run([sys.executable, "-P", "-c", _NO_SOURCE], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), h(xs), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.torch
def test_the_same_weights_in_torch_answer_the_same(small):
    """The PyTorch user checks the port against their own model: torch.nn.Linear takes the
    kernel transposed; copied so, torch and the Hybrid agree; copied back from a state_dict as
    it is, the call names the transpose (above)."""
    torch = pytest.importorskip("torch")
    net, x = sm.mlp((256, 128, 2)), jnp.ones((1, 512))
    h = sm.hybridize(net, net.init(jax.random.key(1), x))
    layers = [torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
              torch.nn.ReLU(), torch.nn.Linear(128, 2)]  # fmt: skip
    tnet = torch.nn.Sequential(*layers).eval()
    with torch.no_grad():
        for i, linear in zip(range(3), tnet[::2], strict=True):
            p = h.params["params"][f"layers_{i}"]
            linear.weight.copy_(torch.from_numpy(np.asarray(p["kernel"]).T.copy()))
            linear.bias.copy_(torch.from_numpy(np.array(p["bias"])))
        want = tnet(torch.from_numpy(np.array(x))).numpy()
    np.testing.assert_allclose(h(x), want, rtol=1e-4, atol=1e-5)
    state = {k: v.numpy() for k, v in tnet.state_dict().items()}
    back = {"params": {f"layers_{i}": {"kernel": state[f"{2 * i}.weight"].T,
                                       "bias": state[f"{2 * i}.bias"]}
                       for i in range(3)}}  # fmt: skip
    np.testing.assert_allclose(h.replace(params=back)(x), want, rtol=1e-4, atol=1e-5)
