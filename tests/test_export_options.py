"""export()'s options are checked before any work: a bad one is a clear error, nothing is
written, and the good spellings round-trip."""

import numpy as np
import pytest
from helpers import ZOO, rand, small

import symjax_mlp as sm
from symjax_mlp.cli import main

SHAPES = ("b, 8",)  # small()'s input


@pytest.mark.parametrize(
    "options, error, message",
    [
        pytest.param({"batch": "n", "shapes": SHAPES}, sm.ConfigError,
                     r"batch='n', shapes=\('b, 8',\)\): pass one of them.*Keep shapes=",
                     id="batch-beside-shapes"),
        pytest.param({"batch": None, "shapes": SHAPES}, sm.ConfigError,
                     r"batch=None, .*drop shapes= for static shapes", id="none-beside-shapes"),
        pytest.param({"overwrite": "no"}, sm.ConfigError, r"overwrite='no'\): pass True",
                     id="overwrite-str"),
        pytest.param({"overwrite": 1}, sm.ConfigError, r"overwrite=1\): pass True .* or False",
                     id="overwrite-int"),
        pytest.param({"platforms": "cpu"}, sm.ConfigError,
                     r"platforms='cpu'\): pass a tuple .*its characters.*platforms=\('cpu',\)",
                     id="platforms-str"),
        pytest.param({"shapes": "b, 8"}, sm.ConfigError,
                     r"shapes='b, 8'\): pass a tuple of shape specs.*shapes=\('b, 512',\)",
                     id="shapes-str"),
        pytest.param({"shapes": SHAPES, "constraints": "b <= 8"}, sm.ConfigError,
                     r"constraints='b <= 8'\): pass a tuple of constraints.*\('t <= 1024',\)",
                     id="constraints-str"),
        pytest.param({"shapes": (8,)}, sm.ConfigError, r"shapes=\(8,\)\): pass a tuple of shape",
                     id="shapes-int"),
        pytest.param({"shapes": SHAPES, "constraints": ("t <= 8",)}, sm.ConfigError,
                     r"'t <= 8' names 't', which no spec .* uses \(they name b\)",
                     id="constraint-unknown-dim"),
        pytest.param({"constraints": ("b <= 8",)}, sm.ConfigError,
                     r"constraints name the dimensions of shapes=", id="constraints-no-shapes"),
        pytest.param({"example": None}, sm.SignatureError,
                     r"example=None\): .*pass an array.*jnp.zeros", id="example-none"),
        pytest.param({"platforms": None}, sm.ConfigError,
                     r"platforms=None\): pass a tuple of platform names", id="platforms-none"),
        pytest.param({"platforms": ("gpu",)}, sm.ConfigError,
                     r"platforms=\('gpu',\)\): name each platform once.*'cuda' or 'rocm'",
                     id="platform-unknown"),
        pytest.param({"platforms": ("cpu", "cpu")}, sm.ConfigError, r"name each platform once",
                     id="platform-twice"),
        pytest.param({"kwargs": {"bogus": 1}}, sm.ConfigError,
                     r"kwargs=\{'bogus': \.\.\.\}\): the model takes no keyword 'bogus'; its "
                     r"inputs are \(x\)", id="kwargs-unknown"),
        pytest.param({"kwargs": [("train", False)]}, sm.ConfigError,
                     r"pass a dict of keyword settings", id="kwargs-not-dict"),
        pytest.param({"vjp_order": -1}, sm.ConfigError, r"vjp_order=-1\): pass an int >= 0",
                     id="vjp-negative"),
        pytest.param({"vjp_order": True}, sm.ConfigError, r"vjp_order=True\): pass an int",
                     id="vjp-bool"),
        pytest.param({"vjp_order": "1"}, sm.ConfigError, r"vjp_order='1'\): pass an int",
                     id="vjp-str"),
        pytest.param({"batch": "max"}, sm.ConfigError,
                     r"batch='max'\): pass a name such as 'b' for a symbolic batch \(not '_' or a "
                     r"function",
                     id="batch-a-spec-function"),  # a bare ValueError from jax.export
        pytest.param({"shapes": SHAPES, "constraints": ("b <= 99999999999999999999",)},
                     sm.ConfigError, r"'b <= 9+' holds 9+, past the sizes jax.export computes",
                     id="constraint-past-int64"),  # was jax.export's raw OverflowError
        pytest.param({"vjp_order": 9}, sm.ConfigError,
                     r"vjp_order=9\): an artifact carries gradients up to order 8",
                     id="vjp-past-what-load-reads"),  # load refused it; 50 never ended
        pytest.param({"metadata": ["cat", "dog"]}, sm.ConfigError,
                     r"metadata=\.\.\.\): pass a dict with str keys.*got list", id="metadata-list"),
        pytest.param({"metadata": "card"}, sm.ConfigError, r"pass a dict with str keys.*got str",
                     id="metadata-str"),
    ],
)  # fmt: skip
def test_bad_option_is_refused_and_writes_nothing(tmp_path, options, error, message):
    h, x = small()
    with pytest.raises(error, match=message):
        sm.export(h, tmp_path / "m", **{"example": x, **options})
    assert list(tmp_path.iterdir()) == []  # neither the artifact nor a temporary sibling


def test_bad_option_leaves_an_existing_artifact_untouched(tmp_path):
    h, x = small(seed=1)
    sm.export(h, tmp_path / "m", example=x)
    before = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}
    other, _ = small(seed=2)
    with pytest.raises(sm.ConfigError, match=r"platforms='cpu'"):
        sm.export(other, tmp_path / "m", example=x, overwrite=True, platforms="cpu")
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == before


def test_unknown_keyword_guesses_the_one_meant(tmp_path):
    h = next(c for c in ZOO if c.name == "fn_kwargs").hybridize()
    x = rand(3, 5)
    with pytest.raises(sm.ConfigError, match=r"no keyword 'scael'.*Did you mean 'scale'\?"):
        sm.export(h, tmp_path / "m", example=x, kwargs={"scael": 2.0})
    assert list(tmp_path.iterdir()) == []
    art = sm.export(h, tmp_path / "m", example=x, kwargs={"scale": 2.0})
    np.testing.assert_allclose(sm.load(art.path)(x), h(x, scale=2.0), rtol=1e-6)


def test_good_spellings_round_trip(tmp_path):
    """Lists for tuples, and the default batch named beside shapes= (what a caller that
    always passes batch="b", such as TrainResult.export, sends) are accepted."""
    h, x = small()
    art = sm.export(h, tmp_path / "m", example=x, batch="b", shapes=["b, 8"],
                    constraints=["b <= 64"], platforms=["cpu"], overwrite=False,
                    metadata={"labels": ["a", "b", "c"]}, vjp_order=0)  # fmt: skip
    assert art.signature.constraints == ("b <= 64",) and art.platforms == ("cpu",)
    m = sm.load(art.path)
    for batch in (1, 5):
        xb = rand(batch, seed=batch)
        np.testing.assert_allclose(m(xb), h(xb), rtol=1e-6)


def test_a_numpy_int_vjp_order_is_an_order(tmp_path):
    """for order in np.arange(3): export(..., vjp_order=order) was refused: 'pass an int'."""
    import jax

    h, x = small()
    art = sm.export(h, tmp_path / "m", example=x, vjp_order=np.int64(1))
    assert art.manifest["vjp_order"] == 1 and type(art.manifest["vjp_order"]) is int
    m = sm.load(art.path)
    grad = jax.grad(lambda v: m(v).sum())(x)
    np.testing.assert_allclose(grad, jax.grad(lambda v: h(v).sum())(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(sm.ConfigError, match=r"vjp_order=np.True_\): pass an int"):
        sm.export(h, tmp_path / "b", example=x, vjp_order=np.bool_(True))


def test_a_numpy_bool_overwrite_is_a_bool(tmp_path):
    """export(overwrite=np.True_) was refused ('pass True ... or False'); train takes it."""
    h, x = small()
    sm.export(h, tmp_path / "m", example=x, overwrite=np.False_)
    art = sm.export(h, tmp_path / "m", example=x, overwrite=np.True_)
    np.testing.assert_allclose(sm.load(art.path)(x), h(x), rtol=1e-6)
    with pytest.raises(sm.ArtifactError, match="already exists"):
        sm.export(h, tmp_path / "m", example=x, overwrite=np.False_)


def test_a_model_card_of_numpy_and_jax_scalars_is_stored_as_their_numbers(tmp_path):
    """metadata={'accuracy': np.float32(acc)} was refused: 'Object of type float32 is not JSON
    serializable'; a scalar is the number it holds (an array is still refused, NaN too)."""
    import jax.numpy as jnp

    h, x = small()
    card = {"accuracy": np.float32(0.5), "epochs": np.int64(3), "ok": np.bool_(True),
            "loss": jnp.float32(0.25), "n": np.array(7)}  # fmt: skip
    art = sm.export(h, tmp_path / "m", example=x, metadata=card)
    want = {"accuracy": 0.5, "epochs": 3, "ok": True, "loss": 0.25, "n": 7}
    assert art.metadata == sm.load(art.path).metadata == want
    assert [type(v) for v in art.metadata.values()] == [float, int, bool, float, int]
    for bad, says in (({"a": np.arange(3)}, "ndarray is not JSON"),
                      ({"a": np.float32("nan")}, "Out of range float")):  # fmt: skip
        with pytest.raises(sm.ConfigError, match=says):
            sm.export(h, tmp_path / "bad", example=x, metadata=bad)


def test_cli_export_names_its_flag(tmp_path, capsys):
    path = str(tmp_path / "cli")
    args = ["export", path, "--sizes", "3", "--in-features", "4"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 2  # the shell's fix is a flag, the library's a keyword
    err = capsys.readouterr().err
    assert "already exists" in err and "overwrite=True is --overwrite" in err  # message as written
    assert main([*args, "--overwrite"]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "gpu"), "--platforms", "gpu"]) == 2
    assert "a GPU is 'cuda' or 'rocm'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli"]


def test_cli_train_export_names_its_flag(tmp_path, capsys):
    """symjax-mlp train --export onto an existing artifact is refused before training, the
    library's message followed by the shell's flag."""
    path = str(tmp_path / "cli")
    assert main(["export", path, "--sizes", "3", "--in-features", "4"]) == 0
    capsys.readouterr()
    assert main(["train", "--epochs", "1", "--export", path, "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert "already exists" in err and "overwrite=True is --overwrite" in err  # message as written
    assert "test accuracy" not in out  # refused before training


def test_a_constraint_the_drawn_self_test_shapes_break_exports_checked_against_the_model(tmp_path):
    """The self-test vectors are drawn with every symbolic dim 2: under `t >= 4` the program
    refused them and export failed with JAX's raw ValueError; then it exported no vectors. They
    are drawn at the example's shapes instead, which the constraints admit, and load runs them.
    Still compared with the model at the example's shapes."""
    import hashlib
    import json

    import jax.numpy as jnp
    import safetensors.numpy

    opts = {"shapes": ("b, t",), "constraints": ("t >= 4",)}
    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    art = sm.export(h, tmp_path / "m", example=jnp.ones((3, 5)), **opts)
    vectors = safetensors.numpy.load_file(art.path / "selftest.safetensors")
    assert vectors["args[0]"].shape == vectors["out[0]"].shape == (3, 5)
    x = rand(3, 6)
    np.testing.assert_array_equal(sm.load(art.path)(x), h(x))
    out = vectors["out[0]"].copy()
    out[1, 2] += 0.5  # one value changed: the message shows it, as a user judges a defect
    wrong = safetensors.numpy.save({**vectors, "out[0]": out})
    (art.path / "selftest.safetensors").write_bytes(wrong)  # listed as it is: load runs it
    manifest = json.loads((art.path / "manifest.json").read_text())
    manifest["files"]["selftest.safetensors"] = {"sha256": hashlib.sha256(wrong).hexdigest(),
                                                 "bytes": len(wrong)}  # fmt: skip
    (art.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sm.ArtifactError, match=r"reproduces its self-test: out\[0\]") as e:
        sm.load(art.path)
    # it said "by up to 0.5 (tolerance rtol 0.0001, atol 1e-05)": not where, nor the values
    got, allow = vectors["out[0]"][1, 2], 1e-5 + 1e-4 * abs(float(out[1, 2]))
    assert (
        f"worst at index (1, 2): it is {got}, where it gave {out[1, 2]} at export, off by 0.5 "
        f"where rtol 0.0001 and atol 1e-05 allow {allow:.3g}. The weights"
    ) in str(e.value)
    branch = sm.hybridize(lambda p, x: x * p if x.shape[1] == 5 else x * 0, jnp.float32(2))
    with pytest.raises(sm.SignatureError, match="does not give the model's results"):
        sm.export(branch, tmp_path / "b", example=jnp.ones((2, 5)), **opts)


def test_a_call_breaking_an_equality_constraint_is_a_signature_error_naming_it(tmp_path):
    """jax.export writes `t == 2*b` into the shapes (args[1]: (b, 2*b)), which the check
    compared with nothing: a call with t != 2*b reached the program and failed as an
    ArtifactError ("the shapes of the module cannot be resolved"). A SignatureError now, naming
    the input, the constraint and the size to pass; other wrong shapes keep theirs."""
    import jax.numpy as jnp

    h = sm.hybridize(lambda p, *xs: sum(x.sum(axis=1) for x in xs) * p, jnp.float32(2))
    art = sm.export(h, tmp_path / "m", example=(jnp.ones((2, 3)), jnp.ones((2, 4))),
                    shapes=("b, 3", "b, t"), constraints=("t == 2*b",))  # fmt: skip
    m = sm.load(art.path)
    want = r"input args\[1\]\.shape\[1\] is 5, but the artifact requires t == 2\*b, so 2\*b = 6"
    with pytest.raises(sm.SignatureError, match=want + r".*Pass .*args\[1\]\.shape\[1\] = 6"):
        m(rand(3, 3), rand(3, 5))
    with pytest.raises(sm.SignatureError, match=r"symbolic dimension b and must agree"):
        m(rand(2, 3), rand(3, 6))
    with pytest.raises(sm.SignatureError, match=r"args\[0\]\.shape\[1\] is 4, not 3"):
        m(rand(3, 4), rand(3, 6))
    x, t = rand(3, 3), rand(3, 6)
    np.testing.assert_allclose(m(x, t), h(x, t), rtol=1e-6)


def test_a_length_slicing_a_fixed_buffer_names_the_constraint_that_keeps_it_symbolic(tmp_path):
    """A model that slices a buffer of fixed size by a symbolic length (GPT-2's causal mask of
    n_positions, ``mask[:t, :t]``, shapes min(32, t)): export said it takes the length as a
    Python number and to drop it from shapes=; it names ``constraints=('t <= 32',)``, with
    which the artifact takes any length up to 32."""
    import jax.numpy as jnp

    mask = jnp.tril(jnp.ones((32, 32)))
    h = sm.hybridize(lambda p, x: x @ mask[: x.shape[1], : x.shape[1]] * p, jnp.float32(2))
    x = jnp.ones((2, 5))
    with pytest.raises(sm.SignatureError) as e:
        sm.export(h, tmp_path / "a", example=x, shapes=("b, t",))
    assert "min(32, t) in its shapes" in str(e.value)
    assert "constraints=('t <= 32',) keeps t symbolic up to 32" in str(e.value)
    assert "Python number" not in str(e.value)
    m = sm.load(sm.export(h, tmp_path / "b", example=x, shapes=("b, t",),
                          constraints=("t <= 32",)).path, allow={"dynamic_gather"})  # fmt: skip
    np.testing.assert_allclose(m(rand(3, 7)), h(rand(3, 7)), rtol=1e-6)
