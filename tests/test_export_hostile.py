"""Export as a stranger uses it: odd paths, odd param names, odd dtypes. Whatever exports loads
and gives the source model's answers; whatever cannot is refused at export, by name."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import symjax_mlp as sm
from symjax_mlp._npy import write_outputs


@pytest.mark.parametrize("key", ["a\nb", "tab\there", "nul\x00", "rtl\u202e", "__metadata__"])
def test_a_param_key_load_could_not_read_is_refused_at_export(tmp_path, key):
    h = sm.hybridize(lambda p, x: x @ p[key], {key: jnp.ones((3, 2))})
    with pytest.raises(sm.ConfigError, match=r"export\(<lambda>\): a param has the path"):
        sm.export(h, tmp_path / "a", example=jnp.ones((2, 3)))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("dtype_in", "dtype_out"),
    [("float8_e4m3fn", "float32"), ("float32", "float8_e5m2"), ("float32", "float4_e2m1fn"),
     ("uint4", "float32")],
)  # fmt: skip
def test_float8_and_int4_inputs_or_outputs_export_and_load(tmp_path, dtype_in, dtype_out):
    h = sm.hybridize(lambda p, x: x.astype(dtype_out) * p["s"].astype(dtype_out), {"s": 1.0})
    x = jnp.ones((2, 3), dtype_in)
    sm.export(h, tmp_path / "a", example=x)  # no self-test vectors: their file cannot hold them
    y = sm.load(tmp_path / "a")(x)
    assert y.dtype == dtype_out
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(h(x), np.float32))


def test_a_model_that_returns_an_rng_key_exports_loads_and_runs_from_the_cli(tmp_path):
    """The self-test compared the outputs as NumPy arrays, and NumPy has no key type: export
    raised JAX's TypeError; `symjax-mlp run` wrote none of them (a bug's traceback). The key
    is compared by its key data, carries no vectors (as a key input), and is written as them."""
    import jax

    from symjax_mlp.cli import main

    h = sm.hybridize(lambda p, x: (x * p, jax.random.fold_in(jax.random.key(7), 3)), 2.0)
    art = sm.export(h, tmp_path / "a", example=jnp.ones((2, 3)))
    assert str(art.signature.outputs[1].dtype).startswith("key")
    assert "selftest.safetensors" not in art.manifest["files"]
    y, key = sm.load(art.path)(jnp.ones((2, 3)))
    np.testing.assert_array_equal(y, np.full((2, 3), 2, np.float32))
    want = jax.random.key_data(h(jnp.ones((2, 3)))[1])
    np.testing.assert_array_equal(jax.random.key_data(key), want)
    np.save(tmp_path / "x.npy", np.ones((2, 3), np.float32))
    argv = ["run", str(art.path), "--input", str(tmp_path / "x.npy")]
    assert main([*argv, "--output", str(tmp_path / "y.npz")]) == 0
    with np.load(tmp_path / "y.npz") as out:
        np.testing.assert_array_equal(out["out1"], want)
        np.testing.assert_array_equal(out["out0"], np.full((2, 3), 2, np.float32))


def test_a_name_of_250_bytes_exports_and_writes_outputs(tmp_path):
    """A file name may have 255 bytes; the temporary sibling's suffix must not push it over."""
    h = sm.hybridize(lambda p, x: x * p["s"], {"s": 2.0})
    x = jnp.ones((2, 3))
    art = sm.export(h, tmp_path / ("a" * 250), example=x)
    np.testing.assert_array_equal(sm.load(art.path)(x), h(x))
    sm.export(h, art.path, example=x, overwrite=True)  # the old one swapped out beside it
    write_outputs(h(x), tmp_path / ("y" * 246 + ".npy"))
    assert np.load(tmp_path / ("y" * 246 + ".npy")).shape == (2, 3)
    assert sorted(p.name[0] for p in tmp_path.iterdir()) == ["a", "y"]  # no litter


@pytest.mark.parametrize("path", [b"my_mlp", "a\x00b", 3, None])
def test_a_path_that_is_no_str_or_has_a_nul_is_a_config_error(path):
    h = sm.hybridize(lambda p, x: x * p["s"], {"s": 2.0})
    with pytest.raises(sm.ConfigError, match=r"symjax_mlp\.export\(\.\.\., path=.*a str or a"):
        sm.export(h, path, example=jnp.ones((2, 3)))


def _pem(key, tmp_path, name, password=None):
    from cryptography.hazmat.primitives import serialization as pem

    crypt = pem.BestAvailableEncryption(password) if password else pem.NoEncryption()
    file = tmp_path / name
    file.write_bytes(key.private_bytes(pem.Encoding.PEM, pem.PrivateFormat.PKCS8, crypt))
    public = tmp_path / f"{name}.pub"
    public.write_bytes(
        key.public_key().public_bytes(pem.Encoding.PEM, pem.PublicFormat.SubjectPublicKeyInfo)
    )
    return file, public


def test_signing_again_with_a_wrong_key_keeps_the_signature_and_names_the_key(tmp_path):
    """An RSA, Ed25519, encrypted or public key is a ConfigError naming what the file holds
    (an AttributeError from model-signing before), and the artifact's signature stays."""
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    h = sm.hybridize(lambda p, x: x * p["s"], {"s": 2.0})
    art = sm.export(h, tmp_path / "a", example=jnp.ones((2, 3))).path
    ours, public = _pem(ec.generate_private_key(ec.SECP256R1()), tmp_path, "ours")
    sm.sign(art, ours)
    signature = (art / "model.sig").read_bytes()
    wrong = {
        "an RSAPrivateKey": _pem(rsa.generate_private_key(65537, 2048), tmp_path, "rsa")[0],
        "an Ed25519PrivateKey": _pem(ed25519.Ed25519PrivateKey.generate(), tmp_path, "ed")[0],
        "no PEM private key": public,
        "no PEM private key .*encrypted": _pem(
            ec.generate_private_key(ec.SECP256R1()), tmp_path, "locked", b"pw"
        )[0],
    }
    for got, key in wrong.items():
        with pytest.raises(sm.ConfigError, match=rf"sign\(private_key=.*holds {got}.*private key"):
            sm.sign(art, key)
        assert (art / "model.sig").read_bytes() == signature
    sm.verify_signature(art, public)
    assert sorted(p.name for p in art.iterdir() if p.name.startswith(".")) == []


def test_a_signing_interrupted_as_it_writes_keeps_the_signature_there_before(tmp_path, monkeypatch):
    import model_signing.signing
    from cryptography.hazmat.primitives.asymmetric import ec

    h = sm.hybridize(lambda p, x: x * p["s"], {"s": 2.0})
    art = sm.export(h, tmp_path / "a", example=jnp.ones((2, 3))).path
    ours, public = _pem(ec.generate_private_key(ec.SECP256R1()), tmp_path, "ours")
    sm.sign(art, ours)
    signature = (art / "model.sig").read_bytes()

    def half_written(self, model_path, signature_path):
        Path(signature_path).write_bytes(b'{"half')
        raise KeyboardInterrupt

    monkeypatch.setattr(model_signing.signing.Config, "sign", half_written)
    with pytest.raises(KeyboardInterrupt):
        sm.sign(art, ours)
    assert (art / "model.sig").read_bytes() == signature
    sm.verify_signature(art, public)


def test_a_model_that_branches_on_the_batch_size_is_refused_not_exported_wrong(tmp_path):
    """With a symbolic batch, Python's `x.shape[0] == 1` is False: the artifact took the other
    branch and gave [0, 0, 0] where the model gives [2, 2, 2] on the very example."""

    def squeeze_one(p, x):
        return x * p["s"] if x.shape[0] == 1 else x * 0.0

    h = sm.hybridize(squeeze_one, {"s": 2.0})
    x = jnp.ones((1, 3))
    with pytest.raises(sm.SignatureError, match=r"export\(squeeze_one\): the exported program "
                       r"does not give the model's results at the example's shapes "
                       r"\(float32\[1, 3\]\).*batch=None"):  # fmt: skip
        sm.export(h, tmp_path / "a", example=x)
    assert list(tmp_path.iterdir()) == []
    art = sm.export(h, tmp_path / "a", example=x, batch=None)  # the fix it names
    np.testing.assert_array_equal(sm.load(art.path)(x), h(x))


def test_a_model_that_fixes_its_batch_size_is_refused_not_exported_claiming_any(tmp_path):
    """A reshape to the example's 4 rows traced at the symbolic batch: the artifact said
    float32[b, 6] with b >= 1 and ran only at b = 4 (at 2 rows, a load-time error saying
    "Export the model again"; a Batcher's buckets failed at warm-up)."""

    def fixed(p, x):
        return (x.reshape(4, 2, 3) * p["s"]).sum(1)

    h, x = sm.hybridize(fixed, {"s": 2.0}), jnp.ones((4, 6))
    with pytest.raises(sm.SignatureError, match=r"export\(fixed\): the exported program's "
                       r"signature, \(args\[0\]: float32\[b, 6\]\).*admits float32\[2, 6\].*"
                       r"refuses them.*batch=None"):  # fmt: skip
        sm.export(h, tmp_path / "a", example=x)
    assert list(tmp_path.iterdir()) == []
    art = sm.export(h, tmp_path / "a", example=x, batch=None)  # the fix it names
    np.testing.assert_array_equal(sm.load(art.path)(x), h(x))


def test_a_vmap_of_a_fixed_size_is_refused_naming_both_readings_of_its_example(tmp_path):
    """The trace fails at the symbolic batch and at one row: the refusal offered only the
    one-example reading (eqx.filter_vmap), for a model that fixes its batch instead."""

    def vm(p, x):
        return jax.vmap(lambda r: r * p["s"], axis_size=4)(x)

    with pytest.raises(sm.SignatureError, match=r"filter_vmap.*fixes its batch size to 4 "
                       r"rows, a reshape or a vmap of axis_size=4.*batch=None"):  # fmt: skip
        sm.export(sm.hybridize(vm, {"s": 2.0}), tmp_path / "a", example=jnp.ones((4, 6)))


def test_a_raw_prng_key_of_as_many_rows_as_the_batch_is_refused_naming_none_in_shapes(tmp_path):
    """A raw ``jax.random.PRNGKey`` (uint32[2]) beside 2 rows is read as batched, as a typed
    key's refusal (a scalar) names ``shapes=(..., None)``; this one named only batch=None and a
    model fixing its rows."""

    def noisy(p, x, k):
        return x * p + jax.random.normal(jax.random.wrap_key_data(k), x.shape)

    h, x, key = sm.hybridize(noisy, jnp.float32(2)), jnp.ones((2, 3)), jax.random.PRNGKey(0)
    with pytest.raises(sm.SignatureError, match=r"fixes its batch size to 2 rows.*If an input "
                       r"has no batch dimension.*PRNGKey.*shapes=\('b, 3', None\)\.$"):  # fmt: skip
        sm.export(h, tmp_path / "a", example=(x, key))
    assert list(tmp_path.iterdir()) == []


def test_a_model_that_raises_at_its_examples_shapes_is_not_exported_unchecked(tmp_path):
    """It traces with a symbolic batch and raises at the example's concrete one: the check
    against the model was skipped (any ValueError there was taken for the artifact's
    constraint) and the export written; now the model's own error stops it."""

    def symbolic_only(p, x):
        if isinstance(x.shape[0], int):
            raise ValueError("this model takes only a symbolic batch")
        return x * p["s"]

    h = sm.hybridize(symbolic_only, {"s": 2.0})
    with pytest.raises(ValueError, match="takes only a symbolic batch"):
        sm.export(h, tmp_path / "a", example=jnp.ones((2, 3)))
    assert list(tmp_path.iterdir()) == []


def test_a_symlink_to_a_signed_artifact_is_named_as_a_link_with_its_target(tmp_path):
    from cryptography.hazmat.primitives.asymmetric import ec

    h = sm.hybridize(lambda p, x: x * p["s"], {"s": 2.0})
    art = sm.export(h, tmp_path / "a", example=jnp.ones((2, 3))).path
    ours, public = _pem(ec.generate_private_key(ec.SECP256R1()), tmp_path, "ours")
    sm.sign(art, ours)
    (tmp_path / "link").symlink_to(art)
    said = rf"link\", \w+=\.\.\.\): the path is a symbolic link; .*points to: '{art}'"
    with pytest.raises(sm.ArtifactError, match=said):  # it said 'not an artifact directory'
        sm.load(tmp_path / "link", verify_signature=public)
    with pytest.raises(sm.ArtifactError, match=said):
        sm.sign(tmp_path / "link", ours)
    sm.load(art, verify_signature=public)


def test_a_dict_input_says_how_to_export_the_model_that_takes_it(tmp_path):
    """linen_dict of the zoo takes {"x": x}: the refusal names the keys and the wrapper."""
    from helpers import ZOO

    case = next(c for c in ZOO if c.name == "linen_dict")
    said = r"LinenDict, example=\.\.\.\): args\[0\] is a dict with keys \['x'\].*tree\.unflatten"
    with pytest.raises(sm.SignatureError, match=said):
        sm.export(case.hybridize("eval"), tmp_path / "a", example=case.inputs(0))
    assert list(tmp_path.iterdir()) == []


def test_overwrite_never_deletes_a_directory_that_holds_more_than_an_artifact(tmp_path):
    """A web app's manifest.json made a project directory look like an artifact: overwrite=True
    replaced it, and index.html was gone."""
    h = sm.hybridize(lambda p, x: x * p["s"], {"s": 2.0})
    x = jnp.ones((2, 3))
    app = tmp_path / "app"
    app.mkdir()
    (app / "manifest.json").write_text('{"name": "my pwa"}')
    (app / "index.html").write_text("<html>mine</html>")
    with pytest.raises(sm.ArtifactError, match=r"holds index\.html, manifest\.json, which no"):
        sm.export(h, app, example=x, overwrite=True)
    assert (app / "index.html").read_text() == "<html>mine</html>"
    art = sm.export(h, tmp_path / "art", example=x).path
    (art / "notes.txt").write_text("mine")
    with pytest.raises(sm.ArtifactError, match=r"holds notes\.txt, which no symjax_mlp artifact"):
        sm.export(h, art, example=x, overwrite=True)
    (art / "notes.txt").unlink()
    sm.export(h, art, example=x, overwrite=True)  # an artifact, signed or not, is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app", "art"]


def test_a_target_export_cannot_write_is_named_for_what_it_is(tmp_path):
    """A symlink to a directory with overwrite=True was 'exists and is not a directory'; a path
    below a file was '[Errno 17] File exists'; neither message had the export(...) prefix."""
    h, x = sm.hybridize(lambda _, x: x * 2, {}), jnp.ones((2, 3))
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for target, overwrite, says in (
        ("afile/sub", False, "afile is a file, not a directory"),
        ("afile/sub/deeper", False, "afile is a file, not a directory"),
        ("dangling/sub", False, "dangling is a symlink to nothing, not a directory"),
        ("link", True, f"link is a symlink to {tmp_path / 'real'}; overwrite=True replaces an"),
        ("link", False, "link already exists"),
        ("afile", True, "afile is not a directory; overwrite=True replaces an"),
    ):
        path = tmp_path / target
        with pytest.raises(sm.ArtifactError) as e:
            sm.export(h, path, example=x, overwrite=overwrite)
        assert str(e.value).startswith(f'symjax_mlp.export("{path}"): '), str(e.value)
        assert says in str(e.value) and "Errno" not in str(e.value), str(e.value)
    assert (tmp_path / "afile").read_text() == "mine" and list((tmp_path / "real").iterdir()) == []


def test_an_export_inside_an_artifact_is_refused_and_writes_nothing(tmp_path):
    # it wrote the new artifact among the outer one's files (and overwrite of the outer one
    # would delete it); a symlink into the artifact is seen through
    h, x = sm.hybridize(lambda p, x: x * p["s"], {"s": 2.0}), jnp.ones((2, 3))
    outer = sm.export(h, tmp_path / "outer", example=x).path
    (tmp_path / "link").symlink_to(outer)
    before = sorted(p.name for p in outer.iterdir())
    for path in (outer / "sub", outer / "a" / "b", tmp_path / "link" / "sub"):
        with pytest.raises(sm.ArtifactError, match=r"outer is an artifact, and an artifact is "):
            sm.export(h, path, example=x)
    assert sorted(p.name for p in outer.iterdir()) == before
    (tmp_path / "web").mkdir()
    (tmp_path / "web" / "manifest.json").write_text('{"name": "another tool\'s"}')
    sm.export(h, tmp_path / "web" / "model", example=x)  # not an artifact: written there


@pytest.mark.parametrize(
    ("shapes", "constraints"),
    [(("b, 3",), ("b <= 0",)), (("b, 3",), ("b >= 5", "b <= 3")), (("b, t",), ("t <= 0",)),
     (("b, t",), ("t == 2*b", "t <= 1"))],
)  # fmt: skip
def test_constraints_no_size_satisfies_are_refused_at_export(tmp_path, shapes, constraints):
    # it exported an artifact no input could call (load refused every shape)
    h = sm.hybridize(lambda p, x: x * p["s"], {"s": 2.0})
    with pytest.raises(sm.ConfigError, match=r"no input could call the artifact: every symbol"):
        sm.export(h, tmp_path / "a", example=jnp.ones((2, 3)), shapes=shapes,
                  constraints=constraints)  # fmt: skip
    assert list(tmp_path.iterdir()) == []
    art = sm.export(h, tmp_path / "b", example=jnp.ones((2, 3)), shapes=("b, 3",),
                    constraints=("b <= 1",))  # fmt: skip
    np.testing.assert_array_equal(
        sm.load(art.path)(np.ones((1, 3), np.float32)), 2 * np.ones((1, 3))
    )


def test_an_artifact_whose_constraints_admit_no_input_is_refused_at_load(tmp_path, capsys):
    """A manifest of constraints no size satisfies ("b >= 5", "b <= 3") and no self-test
    vectors (which refuse it) loaded, then refused each call by one bound: "requires b >= 5"
    at b = 2, "requires b <= 3" at b = 5, never that nothing passes."""
    import json

    from symjax_mlp.cli import main

    h = sm.hybridize(lambda p, x: x * p["s"], {"s": 2.0})
    art = sm.export(h, tmp_path / "a", example=jnp.ones((2, 3))).path
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["signature"]["constraints"] = ["b >= 5", "b <= 3"]
    del manifest["files"]["selftest.safetensors"]
    (art / "selftest.safetensors").unlink()
    (art / "manifest.json").write_text(json.dumps(manifest))
    says = r"manifest.json: its signature .* admits no input: no sizes satisfy b >= 5, b <= 3"
    for self_test in (True, False):
        with pytest.raises(sm.ArtifactError, match=says):
            sm.load(art, self_test=self_test)
    assert main(["verify", str(art)]) == 2
    assert re.search(says, capsys.readouterr().err)


def _dropping_a_constraint(tmp_path):
    """An artifact of a program requiring b >= 2 and b <= 3 whose manifest lists b <= 3 only."""
    import json

    h = sm.hybridize(lambda p, x: x * p["s"], {"s": 2.0})
    art = sm.export(h, tmp_path / "a", example=jnp.ones((2, 3)), shapes=("b, 3",),
                    constraints=("b >= 2", "b <= 3")).path  # fmt: skip
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["signature"]["constraints"] = ["b <= 3"]
    (art / "manifest.json").write_text(json.dumps(manifest))
    return art


def test_a_constraint_the_manifest_drops_is_refused_at_load(tmp_path, capsys):
    """The program's b >= 2, dropped from manifest.json: load passed it (its self-test, at b =
    2, satisfies it), and only a call at b = 1 found out, in the program."""
    from symjax_mlp.cli import main

    art = _dropping_a_constraint(tmp_path)
    says = (
        r'symjax_mlp\.load\(".*a"\): its program, model\.jaxexport, requires b >= 2, which '
        r"manifest\.json's signature does not list \(it lists b <= 3\).* export the model again"
    )
    with pytest.raises(sm.ArtifactError, match=says):
        sm.load(art)
    np.save(tmp_path / "x.npy", np.ones((1, 3), np.float32))
    argv = ["run", str(art), "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(says, err) and "Traceback" not in err and not (tmp_path / "y").exists()


def test_a_batch_the_manifest_names_that_args_0_does_not_lead_with_is_refused(tmp_path):
    """signature.batch, the dimension a Batcher merges requests along and bounds by the
    constraints, was any name: 'zzz' beside args[0] (b, 3) with b <= 3 loaded, and
    Batcher(m, max_batch=8) compiled b = 4 and failed ('the inputs give b = 4')."""
    import json

    h = sm.hybridize(lambda p, x: x @ p, jnp.ones((3, 2)))
    art = sm.export(h, tmp_path / "a", example=jnp.ones((2, 3)), shapes=("b, 3",),
                    constraints=("b <= 3",)).path  # fmt: skip
    manifest = json.loads((art / "manifest.json").read_text())
    for batch in ("zzz", 3):
        manifest["signature"]["batch"] = batch
        (art / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(sm.ArtifactError, match=r"signature\.batch is .*, but a symjax_mlp "
                           r"manifest has the name args\[0\]'s shape begins with"):  # fmt: skip
            sm.load(art)


def test_a_name_given_two_sizes_in_shapes_is_refused_with_the_spec_meant(tmp_path):
    # 'b, b' for a (2, 8) example was flax's raw ScopeParamShapeError (kernel of shape (b, 16))
    net, x = sm.mlp((16, 3)), jnp.ones((2, 8))
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    with pytest.raises(
        sm.SignatureError,
        match=r"shapes=\('b, b',\)\): the specs name 'b' at args\[0\]\.shape\[0\] and "
        r"args\[0\]\.shape\[1\], where the example has sizes 2 and 8.* 'b, b' -> 'b, 8'\.$",
    ):
        sm.export(h, tmp_path / "a", example=x, shapes=("b, b",))
    with pytest.raises(sm.SignatureError, match=r"args\[1\]\.shape\[0\].*'b, 8' -> '3, 8'"):
        sm.export(sm.hybridize(lambda p, x, y: x.sum() + y.sum(), {}), tmp_path / "a",
                  example=(x, jnp.ones((3, 8))), shapes=("b, 8", "b, 8"))  # fmt: skip
    with pytest.raises(
        sm.SignatureError, match=r"args\[0\]: float32\[b, c\]\) do not fit the params: param "
        r"layers_0/kernel has shape \(8, 16\), and these inputs make it \(c, 16\).*its number"
    ):  # fmt: skip
        sm.export(h, tmp_path / "a", example=x, shapes=("b, c",))
    from flax import nnx

    with pytest.raises(  # an nnx module's: JAX's raw dot_general TypeError, 'got (c,) and (8,)'
        sm.SignatureError, match=r"float32\[b, c\]\) do not fit the params: a matrix product "
        r"takes c from an input's last dimension where the params have 8 .*its number"
    ):  # fmt: skip
        sm.export(sm.hybridize(nnx.Linear(8, 3, rngs=nnx.Rngs(0))), tmp_path / "a", example=x,
                  shapes=("b, c",))  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_a_spec_ending_in_dots_takes_the_examples_other_dimensions(tmp_path):
    # 'b, ...' (what the message for a baked rng key suggests) was jax's syntax error
    net, x = sm.mlp((16, 3)), jnp.ones((2, 8))
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    art = sm.export(h, tmp_path / "a", example=x, shapes=("b, ...",))
    assert art.signature.inputs[0].shape == ("b", 8)
    x5 = jnp.arange(40.0).reshape(5, 8)
    np.testing.assert_allclose(sm.load(art.path)(x5), h(x5), rtol=1e-6)


def test_a_static_shape_too_large_to_draw_exports_without_self_test_vectors(tmp_path):
    # its self-test inputs were drawn at that shape: NumPy's raw MemoryError (64 TiB)
    net = sm.mlp((16, 3))
    h = sm.hybridize(net, net.init(jax.random.key(0), jnp.ones((2, 8))))
    big = jax.ShapeDtypeStruct((1 << 40, 8), jnp.float32)
    art = sm.export(h, tmp_path / "a", example=big, batch=None)
    assert art.signature.inputs[0].shape == (1 << 40, 8)
    assert "selftest.safetensors" not in art.manifest["files"]


def test_self_test_vectors_larger_than_load_holds_are_not_written(tmp_path, monkeypatch):
    """load holds a file of at most MAX_HELD_BYTES (2 GiB) whole and refuses a larger one;
    vectors past it (an output of gigabytes per row) would make the export unloadable."""
    import symjax_mlp._export as exporting

    h = sm.hybridize(lambda p, x: x @ p, jnp.ones((3, 2)))
    monkeypatch.setattr(exporting, "MAX_HELD_BYTES", 64)  # these vectors take more
    art = sm.export(h, tmp_path / "a", example=jnp.ones((2, 3)))
    assert "selftest.safetensors" not in art.manifest["files"]
    monkeypatch.undo()
    np.testing.assert_array_equal(sm.load(art.path)(jnp.ones((2, 3))), 3 * jnp.ones((2, 2)))


@pytest.mark.parametrize("dtype", ["int2", "uint2", "int1", "uint1", "float6_e2m3fn"])
@pytest.mark.parametrize("where", ["args[0]", "out"])
def test_a_dtype_jax_export_cannot_serialize_is_a_signature_error_naming_it(tmp_path, dtype, where):
    # int2 was jax's raw KeyError: dtype(int2) from serialize; uint1 a raw lowering ValueError
    import ml_dtypes

    odd = getattr(ml_dtypes, dtype)
    if where == "out":
        h, x = sm.hybridize(lambda p, x: (x * p).astype(odd), jnp.float32(0)), np.zeros((2, 3))
    else:
        h, x = sm.hybridize(lambda p, x: x.astype(jnp.float32) * p, jnp.float32(2)), None
        x = np.zeros((2, 3), odd)
    kind = "float16" if dtype.startswith("float") else "uint8" if dtype[0] == "u" else "int8"
    with pytest.raises(
        sm.SignatureError,
        match=rf"^export\(<lambda>\): {re.escape(where)} is {dtype}\[b, 3\], which jax\.export "
        r"cannot serialize\. An artifact's inputs and outputs are bool, int4 to int64, uint4 to "
        rf"uint64 or floats .* Cast it to {kind}",
    ):
        sm.export(h, tmp_path / "a", example=x)
    assert not (tmp_path / "a").exists()


def test_the_self_test_compares_complex_outputs_by_both_parts():
    """load's self-test compared outputs in float64, which keeps a complex value's real part
    only (with NumPy's ComplexWarning): an artifact whose program's imaginary parts differ
    from its vectors' (load reads complex64 vectors) passed it. Both parts are compared now,
    a NaN in either part named with the complex value where it differs."""
    from symjax_mlp._selftest import difference

    want = np.array([[1 + 1j, 2 + 2j]], np.complex64)
    assert difference(want.copy(), want) is None
    assert difference(want + 1e-7j, want) is None  # within the tolerance
    assert "differs from what it gave at export by up to 1" in difference(want + 1j, want)
    nan = want.copy()
    nan[0, 1] = complex(2, np.nan)
    said = difference(nan, want)
    assert said.startswith("is (2+nanj) at index (0, 1), where it gave (2+2j) at export (1 "), said
    assert difference(nan, nan.copy()) is None  # NaN equals NaN, part by part
