"""What an artifact carries: shapes, a model card, gradients, every input type; same bytes twice.

Every test is a round trip: export, then load (in this process) and call.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import io
import json
import os
import pickle
import re
import shutil
import sys
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from helpers import ZOO, bounded

import symjax_mlp as sm

TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """``(h, x, art)``: the MLP most tests export, its input and its artifact, exported once
    per worker. A test only reads ``art``; one that edits it edits a copy (shutil.copytree)."""
    net, x = sm.mlp((8, 3)), jnp.ones((2, 5))
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    return h, x, sm.export(h, tmp_path_factory.mktemp("mlp") / "m", example=x)


@pytest.fixture(scope="module")
def loaded(mlp):
    """``mlp``'s artifact loaded, once per worker: for tests that only call it."""
    return sm.load(mlp[2].path)


def assert_public_class(error):
    """``error``'s class has a public name, found under it in its module (a traceback showed
    ``symjax_mlp._loaded._NoEntryPoint``), and a docstring saying what it is."""
    kind = type(error)
    assert not any(part.startswith("_") for part in kind.__qualname__.split(".")), kind
    assert getattr(sys.modules[kind.__module__], kind.__qualname__) is kind and kind.__doc__


def test_the_same_model_exports_to_the_same_bytes_and_no_local_path(mlp, tmp_path):
    h, x, a = mlp
    b = sm.export(h, tmp_path / "b", example=x)
    for name in a.manifest["files"]:
        assert (a.path / name).read_bytes() == (b.path / name).read_bytes(), name
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (a.path, b.path))
    for m in (ma, mb):
        m.pop("created")
    assert ma == mb
    here = (
        str(tmp_path),
        str(a.path.parent),
        __file__,
        str(__import__("pathlib").Path(sm.__file__).parent),
    )
    for file in a.path.iterdir():
        data = file.read_bytes()
        for path in here:
            assert path.encode() not in data, f"{file.name} holds {path}"


def test_a_model_card_travels_in_the_manifest_inspect_and_safetensors(mlp, tmp_path):
    h, x, _ = mlp
    card = {"labels": ["a", "b", "c"], "license": "Apache-2.0", "metrics": {"accuracy": 0.9}}
    art = sm.export(h, tmp_path / "m", example=x, metadata=card)
    assert dict(sm.inspect(art.path).to_json()["metadata"]) == card
    assert "card       license: Apache-2.0" in str(sm.inspect(art.path))
    with safetensors.safe_open(art.path / "params.safetensors", "np") as f:
        header = f.metadata()
    assert header["license"] == "Apache-2.0" and json.loads(header["labels"]) == ["a", "b", "c"]
    with pytest.raises(sm.ConfigError, match=r"metadata=.*JSON"):
        sm.export(h, tmp_path / "n", example=x, metadata={"w": np.ones(2)})
    assert not (tmp_path / "n").exists()


def test_a_deeply_nested_manifest_is_an_artifact_error_not_a_recursion_error(mlp, tmp_path):
    """json.loads reads 600 levels that the manifest's freeze() then recursed through until
    RecursionError; nesting is bounded (32 levels) at read, and at export for a model card."""
    h, x, _ = mlp
    deep: object = "leaf"
    for _ in range(600):
        deep = [deep]
    with pytest.raises(sm.ConfigError, match=r"nests more than 31 levels deep"):
        sm.export(h, tmp_path / "n", example=x, metadata={"deep": deep})
    assert not (tmp_path / "n").exists()
    art = sm.export(h, tmp_path / "m", example=x, metadata={"ok": [[[["four levels"]]]]})
    manifest = json.loads((art.path / "manifest.json").read_text())
    manifest["metadata"]["deep"] = deep
    (art.path / "manifest.json").write_text(json.dumps(manifest))
    for read in (sm.inspect, sm.load):
        with pytest.raises(sm.ArtifactError, match=r"nests its JSON more than 32 levels deep"):
            read(art.path)


def test_the_compatibility_window_is_recorded_shown_and_warned_about(mlp, tmp_path):
    h, x, art = mlp
    created = datetime.datetime.fromisoformat(art.manifest["created"]).date()
    until = datetime.date.fromisoformat(art.manifest["compatible_until"])
    assert (until - created).days == 180
    assert f"until {until}" in str(art)
    # an artifact 20 days from the end of its window: load warns, and still loads
    path = shutil.copytree(art.path, tmp_path / "m")
    manifest = json.loads((path / "manifest.json").read_text())
    soon = datetime.date.today() + datetime.timedelta(days=20)
    manifest["compatible_until"] = soon.isoformat()
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(FutureWarning, match=r"compatibility window.*in 20 days"):
        m = sm.load(path)
    chex.assert_trees_all_close(m(x), h(x), **TOL)


def test_shape_specs_per_input_with_constraints(tmp_path):
    def fn(p, x, seq):  # x: (b, 5); seq: (b, t) with t <= 8
        return x @ p["w"] + jnp.sum(seq, axis=-1, keepdims=True)

    h = sm.hybridize(fn, {"w": jnp.ones((5, 3))})
    example = (jnp.ones((2, 5)), jnp.ones((2, 4)))
    art = sm.export(h, tmp_path / "m", example=example, shapes=("b, 5", "b, t"),
                    constraints=("t <= 8",))  # fmt: skip
    assert art.signature.inputs[1].shape == ("b", "t")
    assert "t <= 8" in str(art.signature)
    m = sm.load(art.path)
    for b, t in ((1, 1), (3, 8)):
        x, seq = jnp.ones((b, 5)), jnp.ones((b, t))
        chex.assert_trees_all_close(m(x, seq), h(x, seq), **TOL)
    with pytest.raises(sm.SignatureError, match=r"t = 9.*requires t <= 8"):
        m(jnp.ones((1, 5)), jnp.ones((1, 9)))
    with pytest.raises(sm.SignatureError, match="must agree"):
        m(jnp.ones((2, 5)), jnp.ones((3, 4)))


def test_an_unbatched_second_input(tmp_path):
    h = sm.hybridize(lambda p, x, bias: x @ p + bias, jnp.ones((5, 3)))
    art = sm.export(h, tmp_path / "m", example=(jnp.ones((2, 5)), jnp.ones(3)),
                    shapes=("b, 5", None))  # fmt: skip
    assert art.signature.inputs[1].shape == (3,)
    m = sm.load(art.path)
    chex.assert_trees_all_close(m(jnp.ones((7, 5)), jnp.ones(3)), h(jnp.ones((7, 5)), jnp.ones(3)))


def test_inputs_passed_by_name_are_refused_naming_the_inputs_and_their_order(mlp, loaded, tmp_path):
    """m(x=x), as a Flax model is called: Python's TypeError named neither the inputs nor how to
    pass them; now a SignatureError that is a TypeError still."""
    m, x = loaded, mlp[1]
    for call in (lambda: m(x=x), lambda: jax.jit(m)(x=x)):
        with pytest.raises(
            sm.SignatureError,
            match=r"got x= by name.*by position: 1 of them, "
            r"args\[0\]: float32\[b, \d+\]\. Pass .* in that order: m\(x\)\.",
        ):
            call()
    two = sm.hybridize(lambda p, x, y: x @ p + y, jnp.ones((5, 3)))
    art = sm.export(two, tmp_path / "two", example=(jnp.ones((2, 5)), jnp.ones((2, 3))))
    with pytest.raises(
        TypeError,
        match=r"got y= by name.*args\[0\]: float32\[b, 5\], "
        r"args\[1\]: float32\[b, 3\]\. .*m\(args\[0\], args\[1\]\)",
    ) as caught:
        sm.load(art.path)(jnp.ones((2, 5)), y=jnp.ones((2, 3)))
    assert_public_class(caught.value)  # was symjax_mlp._loaded._ByName


def test_pickle_of_a_loaded_model_is_refused_saying_to_load_it_where_it_runs(mlp, loaded):
    """Python's TypeError on a mappingproxy, for pickle and copy.deepcopy alike, once."""
    m, x = loaded, mlp[1]
    with pytest.raises(
        sm.ConfigError,
        match=r"pickle\.dumps\(symjax_mlp\.load\(.*never "
        r"pickled.*load it where it runs: sm\.load\(m\.path\)",
    ):
        pickle.dumps([m])
    for twin in (copy.deepcopy(m), copy.copy(m)):
        assert twin is not m and twin.path == m.path
        np.testing.assert_array_equal(twin(x), m(x))


def test_the_weights_a_loaded_model_shows_load_back_as_other_weights(mlp, loaded):
    """m.params' flat {"params/layers_0/kernel": ...} passed to load(params=...) was refused:
    "param key 'params/layers_0/bias' ... contains '/'. Rename it." (a name load() chose)."""
    (h, x, art), m = mlp, loaded
    path = art.path
    chex.assert_trees_all_close(sm.load(path, params=m.params)(x), m(x))
    doubled = {k: jnp.asarray(v) * 2 for k, v in m.params.items()}
    want = h.replace(params=jax.tree.map(lambda a: a * 2, h.params))(x)
    chex.assert_trees_all_close(sm.load(path, params=doubled)(x), want, **TOL)
    with pytest.raises(sm.ArtifactError, match=r"\(2 missing, 0 extra\)"):
        sm.load(path, params=dict(list(m.params.items())[:2]))
    # the caller's own NumPy arrays, changed after load, do not change it: JAX on CPU aliased a
    # writeable array at a 64-byte boundary (the JAX runtime followed it, IREE's copy did not)
    mine = {k: _at_64_bytes(v) for k, v in m.params.items()}
    kept = sm.load(path, params=mine)
    for v in mine.values():
        v *= 2
    chex.assert_trees_all_close(kept(x), m(x))


def _at_64_bytes(a):
    """A writeable copy of ``a`` starting at a 64-byte boundary (where JAX on CPU aliases it)."""
    raw = np.empty(a.nbytes + 64, np.uint8)
    at = -raw.ctypes.data % 64
    out = raw[at : at + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def test_weights_given_by_a_symbolic_link_load_and_no_file_is_named_as_params(
    mlp, loaded, tmp_path
):
    """params= a link to a .safetensors file was refused: "loading never follows a link (it
    could point out of the directory ...)", of the user's own path; /dev/zero or a directory
    had load's own check beside the reader's (two messages); a file that is no safetensors, or
    none, was named without the call. Now one check, its message after the call."""
    (_, x, art), m = mlp, loaded
    os.symlink(art.path / "params.safetensors", tmp_path / "latest.safetensors")
    chex.assert_trees_all_close(sm.load(art.path, params=tmp_path / "latest.safetensors")(x), m(x))
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    for bad, says in (
        ("/dev/zero", "/dev/zero is not a regular file (a directory, FIFO or device)"),
        (tmp_path, f"{tmp_path} is not a regular file"),
        (tmp_path / "fifo", "fifo is not a regular file"),  # never blocks
        (tmp_path / "junk.safetensors", "junk.safetensors is not a valid safetensors file"),
        (tmp_path / "absent.safetensors", "there is no such file"),
    ):
        with pytest.raises(sm.ArtifactError) as e:
            bounded(lambda bad=bad: sm.load(art.path, params=bad), 20)
        said = str(e.value)  # the call first, as every load message, then one check's words
        assert said.startswith(f'symjax_mlp.load("{art.path}", params={str(bad)!r}): '), said
        assert says in said and "no regular file" not in said, said


def test_weights_of_another_dtype_are_refused_with_the_cast_not_another_architecture(
    mlp, loaded, tmp_path
):
    """float16 weights of the right shapes were told 'Use weights of the same architecture'."""
    path = mlp[2].path
    halves = {k: v.astype(np.float16) for k, v in loaded.params.items()}
    safetensors.numpy.save_file(halves, tmp_path / "half.safetensors")
    for params in (halves, tmp_path / "half.safetensors"):
        with pytest.raises(sm.ArtifactError) as e:
            sm.load(path, params=params)
        said = str(e.value)
        assert "is float16[" in said and "but the artifact expects float32[" in said, said
        assert "Cast them: x.astype(np.float32) for each." in said and "architecture" not in said
    with pytest.raises(sm.ArtifactError, match=r"Use weights of the same architecture"):
        sm.load(path, params={k: v[..., :1] for k, v in halves.items()})


@pytest.mark.parametrize("call", ["load", "inspect", "verify"])
@pytest.mark.parametrize("path", [3, None, b"/tmp/m", "/tmp/m\x00"])
def test_a_path_of_no_str_or_pathlike_is_refused_naming_what_was_given(path, call):
    """load(None) was pathlib's TypeError, load("a\x00") os.stat's ValueError; inspect's were
    the same raw errors, and verify named inspect, which it calls."""
    with pytest.raises(
        sm.ConfigError,
        match=rf"^symjax_mlp\.{call}\(.*\): expected the directory written by symjax_mlp\."
        r"export, as a str or a pathlib\.Path; got a (value of type|path hold)",
    ):
        getattr(sm, call)(path)


def test_grad_of_a_loaded_model(mlp, tmp_path):
    h, x, _ = mlp
    art = sm.export(h, tmp_path / "m", example=x, vjp_order=1)
    m = sm.load(art.path)
    got = jax.grad(lambda x: m(x).sum())(x)
    want = jax.grad(lambda x: h(x).sum())(x)
    chex.assert_trees_all_close(got, want, **TOL)
    assert sm.inspect(art.path).manifest["vjp_order"] == 1


def test_single_array_params_and_rng_key_inputs(tmp_path):
    h = sm.hybridize(lambda p, x: x * p, jnp.float32(3))
    art = sm.export(h, tmp_path / "scalar", example=jnp.ones((2, 2)))
    assert [p.path for p in art.params] == ["params"]
    chex.assert_trees_all_close(sm.load(art.path)(jnp.ones((4, 2))), jnp.full((4, 2), 3.0))

    noisy = sm.hybridize(lambda p, key, x: x * p + jax.random.normal(key, x.shape), jnp.float32(1))
    art = sm.export(noisy, tmp_path / "key", example=(jax.random.key(0), jnp.ones((2, 3))),
                    batch=None)  # fmt: skip
    key, m = jax.random.key(7), sm.load(art.path)
    chex.assert_trees_all_close(m(key, jnp.ones((2, 3))), noisy(key, jnp.ones((2, 3))))
    wrap = re.escape("Wrap it: jax.random.wrap_key_data(x, impl='threefry2x32').")
    with pytest.raises(sm.SignatureError, match=r"args\[0\] is uint32\[2\], raw key data.*" + wrap):
        m(jax.random.PRNGKey(7), jnp.ones((2, 3)))  # was "Pass an array of rank 0"


def test_an_input_for_rng_keys_given_no_typed_key_is_told_how_to_make_one():
    """A key input given a uint32 seed, another impl's key or floats is told the call that
    makes keys of the artifact's impl (it was "Cast it: x.astype(jnp.key<fry>)", no code);
    a raw key's data (jax.random.PRNGKey's, split too) the call that wraps it."""
    fry = sm.Signature((sm.TensorSpec("keys", ("b",), "key<fry>"),), (), "array", "b")
    rbg = sm.Signature((sm.TensorSpec("key", (), "key<rbg>"),), (), "array", None)
    make = re.escape("jax.random.key(seed, impl='threefry2x32') (from raw uint32 key data: "
                     "jax.random.wrap_key_data(data, impl='threefry2x32')).")  # fmt: skip
    for x in (np.uint32([3, 4]), jax.random.split(jax.random.key(0, impl="rbg"), 2), [1.0]):
        with pytest.raises(sm.SignatureError, match=r"expects key<fry>\[b\].*no cast.*" + make):
            fry.check([x], caller="m")
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    with pytest.raises(sm.SignatureError, match=r"is uint32\[4, 2\], raw key data"):
        fry.check([keys], caller="m")
    with pytest.raises(
        sm.SignatureError, match=r"is uint32\[2\] but .*impl 'rbg'.*key\(seed, impl='rbg'\)"
    ):
        rbg.check([jax.random.PRNGKey(0)], caller="m")  # rbg's data is uint32[4]: no wrap
    typed = jax.random.wrap_key_data(keys, impl="threefry2x32")  # as advised: admitted
    assert fry.check([typed], caller="m")[0] is typed


def test_an_entry_point_without_self_test_vectors_loads_with_the_self_test_on(tmp_path):
    """An entry point that takes an rng key gets no vectors; it must not be checked against
    the default entry point's (it was: a SignatureError on an honest export)."""
    x = jnp.ones((2, 4))
    scale = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    noise = sm.hybridize(lambda p, k: jax.random.normal(k, (2, 4)) * p, jnp.float32(2))
    art = sm.export({"scale": scale, "noise": noise}, tmp_path / "m", batch=None,
                    example={"scale": x, "noise": jax.random.key(0)})  # fmt: skip
    assert "noise.selftest.safetensors" not in art.manifest["files"]
    m = sm.load(art.path)  # self_test=True by default
    key = jax.random.key(1)
    chex.assert_trees_all_close(m["noise"](key), noise(key))
    chex.assert_trees_all_close(m(x), 2 * x)


def test_an_nnx_model_holding_a_dropout_rng_exports(tmp_path):
    case = next(c for c in ZOO if c.name == "nnx_dropout")
    h = case.hybridize()
    x = case.inputs(0)[0]
    art = sm.export(h, tmp_path / "m", example=x, kwargs=case.eval)
    chex.assert_trees_all_close(sm.load(art.path)(x), h(x, **case.eval), **TOL)


def test_a_host_callback_is_refused_at_export(tmp_path):
    def f(p, x):
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jax.pure_callback(lambda a: np.asarray(a) * 2, shape, x) * p

    h = sm.hybridize(f, jnp.float32(2))
    with pytest.raises(sm.ConfigError, match=r"calls back into Python \(pure_callback\)"):
        sm.export(h, tmp_path / "m", example=jnp.ones((2, 3)))
    assert not (tmp_path / "m").exists()


def test_a_bfloat16_input_error_names_a_cast_that_exists(tmp_path):
    h = sm.hybridize(lambda p, x: x * p, jnp.bfloat16(2))
    art = sm.export(h, tmp_path / "m", example=jnp.ones((2, 2), jnp.bfloat16))
    m = sm.load(art.path)
    assert m(jnp.ones((1, 2), jnp.bfloat16)).dtype == jnp.bfloat16
    with pytest.raises(sm.SignatureError, match=r"x\.astype\(jnp\.bfloat16\)"):
        m(np.ones((1, 2), np.float32))


def test_loading_imports_no_flax_optax_or_training(mlp):
    import subprocess
    import sys

    art = mlp[2]
    code = (
        "import sys, numpy as np, symjax_mlp as sm\n"
        f"m = sm.load({str(art.path)!r})\n"
        "m(np.ones((3, 5), np.float32))\n"
        "print(sorted({k.split('.')[0] for k in sys.modules} & {'flax', 'optax', 'chex'}))\n"
        "print(sorted(k for k in sys.modules if k.startswith('symjax_mlp.training')))\n"
        "print('scipy.linalg' in sys.modules)\n"  # JAX's LAPACK set-up: skipped, none called
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "[]", "False"]


def test_a_module_that_calls_lapack_still_gets_jax_lapack_set_up(tmp_path):
    """The LAPACK set-up is skipped only for modules that call none of its kernels: a solve
    (LAPACK kernels on CPU), allowed by name, loads and runs right in a fresh process."""
    import subprocess
    import sys

    a = np.array([[4.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 2.0]], np.float32)
    h = sm.hybridize(lambda p, x: jnp.linalg.solve(p, x.T).T, jnp.asarray(a))
    art = sm.export(h, tmp_path / "m", example=jnp.ones((2, 3)))
    with pytest.raises(sm.ArtifactError, match="lapack") as refused:
        sm.load(art.path)
    allow = set(re.findall(r"custom_call:lapack_\w+", str(refused.value)))
    others = set(re.findall(r"the op ([\w.]+)", str(refused.value)))
    allow |= {o.removeprefix("stablehlo.") for o in others}
    code = (
        "import sys, numpy as np, symjax_mlp as sm\n"
        f"m = sm.load({str(art.path)!r}, allow={sorted(allow)!r})\n"
        "np.save(sys.stdout.buffer, np.asarray(m(np.eye(3, dtype=np.float32)[:2])))\n"
        "print('scipy.linalg' in sys.modules, file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    got = np.load(io.BytesIO(done.stdout))
    np.testing.assert_allclose(got, np.linalg.solve(a, np.eye(3)[:2].T).T, rtol=1e-5)
    assert done.stderr.decode().split()[-1] == "True"  # the set-up ran: scipy's LAPACK


def test_self_test_vectors_run_at_load_and_catch_a_changed_model(mlp, loaded, tmp_path):
    import hashlib
    import time

    h, x, art = mlp
    assert "selftest.safetensors" in art.manifest["files"]
    t0 = time.perf_counter()
    sm.load(art.path)  # runs them: a model that reproduces its vectors loads
    assert time.perf_counter() - t0 < 30
    # a consistent artifact whose weights were swapped (checksums recomputed): refused at load
    path = shutil.copytree(art.path, tmp_path / "m")
    weights = loaded.params
    doubled = {k: np.asarray(v) * 2 for k, v in weights.items()}
    other = sm.export(h.replace(params=jax.tree.map(lambda a: a * 2, h.params)),
                      tmp_path / "other", example=x)  # fmt: skip
    planted = (other.path / "params.safetensors").read_bytes()
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "params.safetensors").write_bytes(planted)
    manifest["files"]["params.safetensors"] = {
        "sha256": hashlib.sha256(planted).hexdigest(),
        "bytes": len(planted),
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sm.ArtifactError, match="no longer reproduces its self-test"):
        sm.load(path)
    m = sm.load(path, self_test=False)  # to inspect it anyway
    chex.assert_trees_all_close(m(x), h.replace(params=jax.tree.map(lambda a: a * 2, h.params))(x))
    assert set(doubled) == set(weights)


class _EncoderHead(__import__("flax").linen.Module):
    """A model with a second method: ``embed`` is the encoder alone."""

    def setup(self):
        import flax.linen as nn

        self.enc, self.head = nn.Dense(8), nn.Dense(3)

    def embed(self, x):
        return jax.nn.relu(self.enc(x))

    def decode(self, z):
        return self.head(z)

    def __call__(self, x):
        return self.decode(self.embed(x))


def _entry_points():
    net, x = _EncoderHead(), jnp.ones((2, 5))
    v = net.init(jax.random.key(0), x)
    points = {
        "predict": sm.hybridize(net, v),
        "embed": sm.hybridize(lambda p, x: net.apply(p, x, method="embed"), v),
        "decode": sm.hybridize(lambda p, z: net.apply(p, z, method="decode"), v),
    }
    return points, {"predict": x, "embed": x, "decode": jnp.ones((2, 8))}


def test_several_entry_points_share_one_weight_file(tmp_path):
    points, examples = _entry_points()
    art = sm.export(points, tmp_path / "m", example=examples, metadata={"labels": [1, 2, 3]},
                    vjp_order=1)  # fmt: skip
    names = sorted(p.name for p in art.path.iterdir())
    assert [n for n in names if n.endswith(".safetensors") and "selftest" not in n] == [
        "params.safetensors"
    ]
    assert {"embed.jaxexport", "decode.mlirbc", "embed.selftest.safetensors"} <= set(names)
    assert list(art.entries) == ["predict", "embed", "decode"]
    assert art.entries["decode"].inputs[0].shape == ("b", 8)
    text = str(sm.inspect(art.path))
    assert "embed (<lambda>): (args[0]: float32[b, 5]) -> float32[b, 8]" in text
    assert "ops (decode.jaxexport's module)" in text
    for runtime in ("jax", "iree"):
        m = sm.load(art.path, runtime=runtime)
        assert m.entries == ("predict", "embed", "decode") and m.entry == "predict"
        assert m["predict"] is m and m["embed"] is m["embed"]
        assert m.metadata == {"labels": [1, 2, 3]}
        for name, h in points.items():  # decode at a batch its load did not compile
            x = jnp.full((7 if name == "decode" else 2, examples[name].shape[1]), 0.5)
            chex.assert_trees_all_close(m[name](x), h(x), **TOL)
        with pytest.raises(KeyError, match=r"no entry point .nope.; it has predict, embed") as e:
            m["nope"]
        assert isinstance(e.value, sm.ConfigError)
        assert_public_class(e.value)  # was symjax_mlp._loaded._NoEntryPoint
    m = sm.load(art.path)
    for k, w in m.params.items():  # one copy of the weights, whatever the entry point
        assert np.shares_memory(w, m["embed"].params[k]), k
    x = jnp.ones((3, 5))
    got = jax.grad(lambda x: m["embed"](x).sum())(x)
    chex.assert_trees_all_close(got, jax.grad(lambda x: points["embed"](x).sum())(x), **TOL)


def test_entry_points_with_their_own_params_take_only_those(tmp_path):
    x = jnp.ones((2, 4))
    a = sm.hybridize(lambda p, x: x @ p["a"], {"a": jnp.ones((4, 2))})
    b = sm.hybridize(lambda p, x: x * p["b"], {"b": jnp.full((4,), 2.0)})
    art = sm.export({"first": a, "second": b}, tmp_path / "m", example=x)
    assert [p.path for p in art.params] == ["a", "b"]  # the one weight file holds both
    assert art.manifest["entries"]["second"]["params"] == ("b",)
    m = sm.load(art.path)
    chex.assert_trees_all_close(m(x), a(x))
    chex.assert_trees_all_close(m["second"](x), b(x))
    assert set(m["second"].params) == {"b"}
    # one path, two values: refused, nothing written
    clash = sm.hybridize(lambda p, x: x * p["b"], {"b": jnp.full((4,), 3.0)})
    with pytest.raises(
        sm.ConfigError, match=r"'second' and 'third' both have a param b, with different values "
        r"\(the same shape\)"  # it named the same float32[4] twice
    ):  # fmt: skip
        sm.export({"first": a, "second": b, "third": clash}, tmp_path / "n", example=x)
    for bad in ("model", "_private", "two words", ""):
        with pytest.raises(sm.ConfigError, match="entry point's name is a Python identifier"):
            sm.export({"first": a, bad: b}, tmp_path / "n", example=x)
    with pytest.raises(sm.ConfigError, match="names every entry point, first, second"):
        sm.export({"first": a, "second": b}, tmp_path / "n", example={"first": x})
    with pytest.raises(sm.ConfigError, match="a Hybrid or a dict of them"):
        sm.export([a, b], tmp_path / "n", example=x)
    with pytest.raises(sm.ConfigError, match="a Hybrid or a dict of them; got an empty dict"):
        sm.export({}, tmp_path / "n", example=x)  # it said 'got dict'
    assert not (tmp_path / "n").exists()


def test_an_entry_point_is_checked_like_the_default_before_it_runs(tmp_path):
    """A stranger's artifact: a harmless default and an entry point with an unbounded loop
    (a whole, consistent export). Loading is lazy per entry point; using it is refused."""
    x = jnp.ones((2, 4))
    ok = sm.hybridize(lambda p, x: x * p, jnp.float32(2))

    def spin(p, x):
        return jax.lax.while_loop(lambda c: c[0] < 10**6, lambda c: (c[0] + 1, c[1] * p), (0, x))[1]

    art = sm.export({"ok": ok, "spin": sm.hybridize(spin, jnp.float32(2))}, tmp_path / "m",
                    example=x)  # fmt: skip
    m = sm.load(art.path)
    chex.assert_trees_all_close(m(x), 2 * x)
    with pytest.raises(
        sm.ArtifactError, match=r"(?s)spin\.jaxexport.*a while loop of 1,000,000 iterations"
    ):
        m["spin"]
    assert "while" in str(sm.inspect(art.path))


def test_a_tampered_entry_point_is_refused(tmp_path):
    points, examples = _entry_points()
    art = sm.export(points, tmp_path / "m", example=examples)
    file = art.path / "manifest.json"
    good = json.loads(file.read_text())

    def load_with(edit):
        manifest = json.loads(json.dumps(good))
        edit(manifest)
        file.write_text(json.dumps(manifest))
        return sm.load(art.path)

    # the embed entry point pointed at the default's program: its module is not its signature
    def swap(m):
        m["entries"]["embed"]["program_files"]["model.jaxexport"] = "model.jaxexport"
        m["entries"]["embed"]["program_files"]["model.mlirbc"] = "model.mlirbc"

    with pytest.raises(sm.ArtifactError, match="does not match"):
        load_with(swap)["embed"]
    edits = {
        "program_files": lambda m: m["entries"]["embed"]["program_files"].update(
            {"model.jaxexport": "../x"}
        ),
        "params": lambda m: m["entries"]["embed"]["params"].append("params/nope"),
        "entries": lambda m: m["entries"].update({"predict": m["entries"]["embed"]}),
        "signature": lambda m: m["entries"]["decode"].pop("signature"),
    }
    for field, edit in edits.items():
        with pytest.raises(sm.ArtifactError, match=rf"{field}.*corrupted or was edited"):
            load_with(edit)
    # an unlisted file named as an entry's program
    (art.path / "extra.jaxexport").write_bytes(b"x")
    with pytest.raises(sm.ArtifactError, match="program_files"):
        load_with(lambda m: m["entries"]["embed"]["program_files"].update(
            {"model.jaxexport": "extra.jaxexport"}))  # fmt: skip


def test_vmap_over_a_loaded_model_is_refused_with_the_fix(mlp, loaded):
    h, m = mlp[0], loaded
    # per example (5,): one example, as the source function takes it
    chex.assert_trees_all_close(jax.vmap(m)(jnp.ones((4, 5))), h(jnp.ones((4, 5))), **TOL)
    with pytest.raises(sm.SignatureError, match=r"shape \(\), rank 0.*Pass an array of rank 2"):
        jax.vmap(m)(jnp.ones((4,)))  # per scalar: not an example
    chex.assert_trees_all_close(m(jnp.ones((4, 5))), h(jnp.ones((4, 5))), **TOL)


@pytest.mark.parametrize(
    ("card", "where"),
    [({"a\nb": 1}, "a key of metadata"), ({"text": "line 1\nline 2"}, r"metadata\['text'\]"),
     ({"x": ["ok", "\x1b[2J"]}, r"metadata\['x'\]\[1\]"),
     ({"x": {"y": "nul\x00"}}, r"metadata\['x'\]\['y'\]"),
     ({"rtl": "abc\u202e"}, r"metadata\['rtl'\]"), ({"x": {"\t": 1}}, r"a key of metadata\['x'\]")],
)  # fmt: skip
def test_a_model_card_with_control_characters_is_refused_at_export(tmp_path, card, where):
    """A newline, ESC, NUL or bidi override in a card's key or string was stored as given and
    printed by inspect and messages: refused at export, naming where, nothing written."""
    h = sm.hybridize(lambda _, x: x * 2, {})
    want = rf"metadata=\.\.\.\): {where}.*control character.*Store printable text: a multi-line"
    with pytest.raises(sm.ConfigError, match=want):
        sm.export(h, tmp_path / "a", example=jnp.ones((2, 3)), metadata=card)
    assert list(tmp_path.iterdir()) == []
    ok = {"text": ["line 1", "line 2"], "name": "café ✓ 模型"}  # printable unicode stays
    art = sm.export(h, tmp_path / "b", example=jnp.ones((2, 3)), metadata=ok)
    assert sm.inspect(art.path).metadata == ok


def test_inspect_prints_a_model_card_of_terminal_escapes_escaped(tmp_path, capsys):
    """An artifact made elsewhere may hold a card of terminal escapes (export refuses them):
    inspect printed its keys and values as the terminal would act on them."""
    from symjax_mlp.cli import main

    h = sm.hybridize(lambda _, x: x * 2, {})
    card = {"\x1b[2J": "x\x1b[31m\u202e", "nested": {"\x1b]0;t\x07": ["\x1b[1m"]}}
    art = sm.export(h, tmp_path / "a", example=jnp.ones((2, 3)))
    manifest = json.loads((art.path / "manifest.json").read_text())
    (art.path / "manifest.json").write_text(json.dumps({**manifest, "metadata": card}))
    assert sm.inspect(art.path).metadata == card  # read as stored, shown escaped
    assert sm.load(art.path).metadata == card
    for argv in (["inspect", str(art.path)], ["inspect", str(art.path), "--json", "-"]):
        assert main(argv) == 0
        out = "".join(capsys.readouterr())
        assert not any(c in out for c in "\x1b\x07\u202e"), argv
        assert "2J" in out and "31m" in out, argv


def test_a_training_checkpoint_given_as_an_artifact_says_how_to_export_one(tmp_path, capsys):
    """A checkpoint directory or a step of it was 'not written by symjax_mlp.export' (or 'not
    a complete artifact: export it again'), with no word of the checkpoint or the way out."""
    from symjax_mlp.cli import main

    x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    data = sm.training.Dataset(x[:24], y[:24], x[24:], y[24:])
    run = {"epochs": 1, "batch_size": 8, "checkpoint": tmp_path / "ckpt"}
    done = sm.training.train(sm.mlp((4, 2)), data, **run)
    orbax = tmp_path / "orbax" / "3"  # a multi-process run's layout: <step>/ and its marker
    orbax.mkdir(parents=True)
    (orbax / "_CHECKPOINT_METADATA").write_text("{}")
    for path, what in ((tmp_path / "ckpt", "a directory of training checkpoints"),
                       (done.checkpoint, "a training checkpoint"),
                       (orbax.parent, "a directory of training checkpoints"),
                       (orbax, "a training checkpoint")):  # fmt: skip
        for read in (sm.load, sm.inspect):
            with pytest.raises(sm.ArtifactError) as e:
                read(path)
            said = str(e.value)
            assert said.startswith(f"{path} is {what}"), said
            assert "train(..., checkpoint=DIR, resume=True).export(PATH)" in said
            assert "symjax-mlp train ... --checkpoint DIR --resume --export PATH" in said
        assert main(["inspect", str(path)]) == 2
        assert what in capsys.readouterr().err
    # the way out it names: the run as it is, exported
    art = sm.training.train(sm.mlp((4, 2)), data, **run, resume=True).export(tmp_path / "m")
    assert sm.load(art.path)(x[:2]).shape == (2, 2)


def test_a_symbolic_dimension_past_int32_is_refused_naming_the_limit(loaded):
    # it reached the program: an ArtifactError, 'the shapes of the module cannot be resolved'
    m = loaded
    with pytest.raises(
        sm.SignatureError,
        match=r"args\[0\]\.shape\[0\] is 2147483648, past the 2,147,483,647 a symbolic "
        r"dimension may be .* Split the input",
    ):
        jax.eval_shape(m, jax.ShapeDtypeStruct((2**31, 5), jnp.float32))
    top = jax.ShapeDtypeStruct((2**31 - 1, 5), jnp.float32)
    assert jax.eval_shape(m, top).shape == (2**31 - 1, 3)


def test_a_shape_dtype_struct_given_to_a_loaded_model_points_to_eval_shape(loaded):
    m = loaded
    spec = jax.ShapeDtypeStruct((2, 5), jnp.float32)
    with pytest.raises(
        sm.SignatureError,
        match=r"args\[0\] is a jax\.ShapeDtypeStruct, not a NumPy or JAX array; .* For the "
        r"output's shape and dtype without values, jax\.eval_shape\(m, spec\)\.$",
    ):
        m(spec)
    assert jax.eval_shape(m, spec).shape == (2, 3)


def test_none_given_to_a_loaded_model_is_named_none_not_a_nonetype(loaded):
    # the message read "input args[0] is a NoneType, not a NumPy or JAX array"
    m = loaded
    with pytest.raises(
        sm.SignatureError,
        match=r"input args\[0\] is None, not a NumPy or JAX array; the artifact expects "
        r"float32\[b, 5\]\. Pass a np\.ndarray or jax\.Array\.$",
    ):
        m(None)


def test_an_object_given_to_a_loaded_model_is_an_object_with_what_to_pass(loaded):
    # the message read "input args[0] is a object"
    for given, kind in ((object(), "an object"), (..., "an ellipsis"), (b"x", "a bytes")):
        with pytest.raises(
            sm.SignatureError,
            match=rf"input args\[0\] is {kind}, not a NumPy or JAX array; the artifact expects "
            r"float32\[b, 5\]\. Pass a np\.ndarray or jax\.Array\.$",
        ):
            loaded(given)


def test_loads_option_refusals_name_the_call_and_the_path(mlp):
    # they read "load(runtime='foo'): expected one of ('jax', 'iree')." with no path
    path = mlp[2].path
    for options, says in (
        ({"runtime": "foo"}, r"runtime='foo'\): expected 'jax' or 'iree'; pass one\.$"),
        ({"trust": "no"}, r"trust='no'\): expected True or False; pass one\.$"),
        ({"runtime": "iree", "params_as_constants": True}, r"runtime='iree', params_as_const"),
        ({"mesh": 3}, r"mesh=\.\.\.\): got 3; pass a jax\.sharding\.Mesh of 1 device"),
    ):
        with pytest.raises(
            sm.ConfigError, match=rf'^symjax_mlp\.load\("{re.escape(str(path))}", {says}'
        ):
            sm.load(path, **options)


def test_values_beyond_an_inputs_dtype_are_told_so_at_load_batcher_and_run(tmp_path, capsys):
    """m([[10**40, 1]]) of a float32 artifact (np.array([[1e300]]) too, -1 for a uint8 input)
    was told to cast it, x.astype(np.float32), which makes inf (or wraps): each entry point
    says what it holds, the range the dtype holds and to pass values in range."""
    from symjax_mlp.cli import main

    h = sm.hybridize(lambda p, x, n: x * p + n, 2.0)
    ok = (np.ones((1, 2), np.float32), np.ones((1, 2), np.uint8))
    art = sm.export(h, tmp_path / "m", example=ok)
    m = sm.load(art.path)
    floats = r"beyond float32's range \(largest 3.403e\+38\), which a cast makes inf \({} among"
    cases = [
        ((np.array([[1e300, 1]]), ok[1]), floats.format(r"1e\+300")),
        (([[10**40, 1]], ok[1]), floats.format(r"1e\+40")),
        (
            (ok[0], [[-1, 2]]),
            r"outside uint8's range \[0, 255\], which a cast wraps \(-1 among them\)",
        ),
    ]
    with sm.serving.Batcher(m, max_batch=2) as b:
        for call in (m, b):
            for xs, says in cases:
                with pytest.raises(sm.SignatureError, match=says) as e:
                    call(*xs)
                assert "astype" not in str(e.value) and "in range" in str(e.value), e.value
    with pytest.raises(sm.SignatureError, match=r"Cast it: x\.astype\(np\.float32\)"):
        m(np.ones((1, 2)), ok[1])  # in range: a cast it is
    np.save(tmp_path / "x.npy", np.array([[1e300, 1]]))
    np.save(tmp_path / "n.npy", ok[1])
    inputs = ["--input", str(tmp_path / "x.npy"), "--input", str(tmp_path / "n.npy")]
    assert main(["run", str(art.path), *inputs, "--output", str(tmp_path / "y.npy")]) == 2
    err = capsys.readouterr().err
    assert re.search(floats.format(r"1e\+300"), err) and "astype" not in err, err


def test_other_weights_load_without_reading_the_artifacts_own(mlp, loaded, tmp_path):
    """load(path, params=other) read, hash-checked and held the artifact's own
    params.safetensors, then dropped it: swapping weights paid for reading weights never used.
    Now that file is never opened: garbage or gone, the model loads with the weights given."""
    (_, x, art), m = mlp, loaded
    path, own = shutil.copytree(art.path, tmp_path / "m"), tmp_path / "m" / "params.safetensors"
    shutil.copy(own, tmp_path / "w.safetensors")
    own.write_bytes(b"garbage")  # its hash no longer matches: a read of it is refused
    chex.assert_trees_all_close(sm.load(path, params=m.params)(x), m(x))
    own.unlink()
    chex.assert_trees_all_close(sm.load(path, params=tmp_path / "w.safetensors")(x), m(x))
    with pytest.raises(sm.ArtifactError, match=r"params\.safetensors is missing"):
        sm.load(path)  # its own weights: read and checked


def test_a_file_inside_an_artifact_names_its_directory_to_pass(mlp, capsys, monkeypatch):
    """``symjax-mlp inspect chapter_mlp/manifest.json`` said "is a file, not an artifact
    directory" and left the user to guess which directory that is."""
    from symjax_mlp.cli import main

    art = mlp[2]
    assert main(["inspect", str(art.path / "manifest.json")]) == 2
    err = capsys.readouterr().err
    assert f"is a file, not an artifact directory. Pass its directory, {art.path}.\n" in err
    monkeypatch.chdir(art.path)
    with pytest.raises(sm.ArtifactError, match=r"Pass its directory, '\.' \(the working dir"):
        sm.load("params.safetensors")


def test_a_path_of_bytes_the_locale_cannot_decode_is_shown_as_utf8_or_byte_escapes(
    tmp_path, capsys
):
    """Under LC_ALL=C (PYTHONUTF8=0) os.fsdecode gives chapter_ü as "chapter_\\udcc3\\udcbc",
    and messages showed those escapes of lone surrogates, which no user recognises or types."""
    from symjax_mlp._artifact.format import printable
    from symjax_mlp.cli import main

    cases = {
        "chapter_\udcc3\udcbc": "chapter_ü",  # UTF-8 bytes: their text
        "caf\udce9/m": "caf\\xe9/m",  # not UTF-8 (Latin-1): the bytes, escaped
        "\udce2\udc80\udcae\udcc2\udc9b\udcc3": "\\u202e\\x9b\\xc3",  # decoded, still escaped
        "\ud800 \x1b[2J é": "\\ud800 \\x1b[2J é",  # not from bytes, and terminal escapes: as before
    }
    for given, shown in cases.items():
        assert printable(given) == shown and shown.encode("utf-8"), given
    assert main(["inspect", "chapter_\udcc3\udcbc"]) == 2
    err = capsys.readouterr().err
    assert "error: chapter_ü does not exist." in err and "\\udc" not in err, err
    art = tmp_path / "chapter_ü"
    art.mkdir()
    (art / "manifest.json").write_text("{}")
    with pytest.raises(sm.ArtifactError) as e:  # its own path too, not only the CLI's argv
        sm.load(tmp_path / "chapter_\udcc3\udcbc" / "manifest.json")
    said = f"{art}/manifest.json is a file, not an artifact directory. Pass its directory, {art}."
    assert str(e.value) == said


@pytest.mark.slow  # a server's load and warm-up (~1 s)
def test_the_compatibility_warning_is_charged_to_the_callers_line(mlp, tmp_path):
    """An expiring artifact served from a script (sm.serving.serve) had load's FutureWarning
    charged to symjax_mlp/serving/_app.py (a fixed stacklevel counted from load's caller), a
    line of ours under the user's cell; it is the caller's line, as sm.load's is."""
    from symjax_mlp import serving

    path = shutil.copytree(mlp[2].path, tmp_path / "m")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["compatible_until"] = "2000-01-01"
    (path / "manifest.json").write_text(json.dumps(manifest))

    class Served(Exception):
        pass

    def ready(url):
        raise Served(url)

    for call in (lambda: sm.load(path), lambda: serving.serve(path, port=0, ready=ready)):
        with warnings.catch_warnings(record=True) as caught, contextlib.suppress(Served):
            warnings.simplefilter("always")
            call()
        said = [w.filename for w in caught if "compatibility window" in str(w.message)]
        assert said == [__file__], said
