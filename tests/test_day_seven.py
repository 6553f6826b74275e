"""A researcher's day seven (session 62, Part H): the upgrade (``pip install -U symjax_mlp``).

Their disk holds artifacts exported, checkpoints written and artifacts signed by earlier
releases, kept here as golden files under ``tests/data/releases/<version>/``, each written by
that release's commit (its ``symjax_mlp`` package, run with this repository's pinned JAX 0.10.2,
jaxlib 0.10.2, flax 0.12.8, optax and orbax; the manifests' ``versions.symjax_mlp`` says 0.16.0
for all three, the version an editable install of the working tree reported):

- ``0.9.0/``: commit 1b49123 (Release 0.9.0);
- ``0.14.0/``: commit 0bdf695 (Release 0.14.0);
- ``0.16.0/``: commit c8de88c (Release 0.16.0).

Each holds what ``tests/data/releases/write_release.py`` (its models, data and settings; the
test imports them) wrote with that commit's package: ``mlp`` (``sm.mlp((8, 3))``, signed by
the key whose public half is ``releases/pub.pem``), ``two`` (a BatchNorm model of two inputs,
its running statistics exported), ``strong`` and ``weak`` (a bfloat16 weight times a scalar
input, exported at ``np.float32(1.5)`` and at ``jnp.asarray(1.5)``; 0.14.0's export at the weak
one failed its own self-test, so it has none), ``tolerance`` (``self_test_tolerance=1e-3``,
0.16.0 only), ``ckpt`` (a one-process run's checkpoints after epochs 1 and 2, ``blocks=2``)
and ``orbax`` (a two-process run's Orbax checkpoint after epoch 2, the same settings). Every
expected answer is computed here from the weights in those files, never written down.

To regenerate one (or add a release), with a P-256 key pair whose public half replaces
``pub.pem`` (``openssl ecparam -name prime256v1 -genkey -noout -out key.pem``; re-sign or
regenerate every release then)::

    git worktree add /tmp/wt-0.16 c8de88c
    python tests/data/releases/write_release.py /tmp/wt-0.16 tests/data/releases/0.16.0 key.pem
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax.traverse_util import flatten_dict, unflatten_dict

import symjax_mlp as sm
from symjax_mlp._artifact.format import FORMAT_VERSION

RELEASES = Path(__file__).parent / "data" / "releases"
sys.path.insert(0, str(RELEASES))
from write_release import RUN, data, scalar, two  # noqa: E402  (the models the golden files hold)

VERSIONS = sorted(
    (p.name for p in RELEASES.iterdir() if p.is_dir()), key=lambda v: tuple(map(int, v.split(".")))
)
PUB = RELEASES / "pub.pem"
X = ((np.arange(12) % 7 - 3) / 4).astype(np.float32).reshape(3, 4)
Z = np.array([[1.0], [2.0], [-0.5]], np.float32)
S = np.ones((2, 3), np.float32)


def _weights(path: Path) -> dict:
    """An artifact's or a checkpoint's tensors, read by safetensors itself, as a tree."""
    name = "params.safetensors" if (path / "params.safetensors").exists() else "state.safetensors"
    return unflatten_dict(safetensors.numpy.load_file(path / name), sep="/")


def _load(path: Path, **kw):
    """``sm.load``, its FutureWarning that the golden file nears jax.export's 6-month window
    kept quiet: the answers are what this test checks (JAX itself refuses one too old)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "the artifact leaves jax.export", FutureWarning)
        return sm.load(path, **kw)


def _same(got, want):
    """``got`` has ``want``'s dtype and, bit for bit, its values."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.asarray(g).dtype == np.asarray(w).dtype, (g, w)
        np.testing.assert_array_equal(np.asarray(g, np.float64), np.asarray(w, np.float64))


def _leaves(tree) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in flatten_dict(tree, sep="/").items()}


@pytest.fixture(params=VERSIONS)
def release(request) -> Path:
    return RELEASES / request.param


def test_every_release_kept_here_has_its_files():
    """The golden files are the test: a release directory lost or emptied fails here, not by
    parametrizing over nothing."""
    assert {"0.9.0", "0.14.0", "0.16.0"} <= set(VERSIONS)
    for v in VERSIONS:
        held = {p.name for p in (RELEASES / v).iterdir()}
        assert {"mlp", "two", "strong", "ckpt", "orbax"} <= held, v


@pytest.mark.slow  # a load or a run, compiled: seconds
def test_an_old_mlp_answers_as_its_weights_do_through_load_apply_and_a_batcher(release):
    """An MLP an older release exported loads with today's code and answers, bit for bit and
    in its dtype, what today's Hybrid of the weights in its params.safetensors answers."""
    variables = _weights(release / "mlp")
    h = sm.hybridize(sm.mlp((8, 3)), variables)
    m = _load(release / "mlp")
    want = h(X)
    _same(m(X), want)
    _same(m.apply(m.params, X), want)
    with sm.serving.Batcher(m, max_batch=4) as b:
        _same(b(X), want)


@pytest.mark.slow  # a load or a run, compiled: seconds
def test_an_old_signed_artifact_verifies_and_one_changed_file_is_refused(release, tmp_path):
    """model-signing's signature an older release wrote verifies with today's code (and the
    needs it recorded are allowed); a copy with one weight changed is refused in one line."""
    m = _load(release / "mlp", verify_signature=PUB)
    _same(m(X), sm.hybridize(sm.mlp((8, 3)), _weights(release / "mlp"))(X))
    copy = shutil.copytree(release / "mlp", tmp_path / "mlp")
    data = bytearray((copy / "params.safetensors").read_bytes())
    data[-1] ^= 1
    (copy / "params.safetensors").write_bytes(bytes(data))
    with pytest.raises(sm.ArtifactError) as e:
        _load(copy, verify_signature=PUB)
    assert "params.safetensors" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow  # a load or a run, compiled: seconds
def test_an_old_two_input_model_with_state_answers_as_its_weights_do(release):
    """A BatchNorm model of two inputs (its running statistics in the artifact) answers as
    today's Hybrid of the params and batch_stats in the artifact's file does, bit for bit."""
    tree = _weights(release / "two")
    variables = {"params": tree["params"]["params"], **tree["state"]}
    h = sm.hybridize(two(), variables)
    _same(_load(release / "two")(X, Z), h(X, Z, train=False))


@pytest.mark.slow  # a load or a run, compiled: seconds
def test_an_old_scalar_input_answers_as_its_release_did_or_as_h_does(release):
    """A bfloat16 weight times a scalar input. 0.16.0 recorded the scalar's weak type
    (``strong``, ``weak_type``): today's code answers the kind it was exported at as h does
    and refuses the other, whose dtypes h answers otherwise. Earlier releases recorded neither,
    and nothing in such a manifest says which the model meant: it answers both kinds in the
    dtypes its program was traced at (the manifest's outputs), as that release did."""
    for name, example in (("strong", np.float32(1.5)), ("weak", jnp.asarray(1.5))):
        if not (release / name).exists():
            continue  # 0.14.0 failed its own self-test exporting at a weak scalar
        h = sm.hybridize(scalar, _weights(release / name))
        m = _load(release / name)
        other = 1.5 if name == "strong" else np.float32(1.5)
        if m.signature.strong or any(i.weak_type for i in m.signature.inputs):
            _same(m(S, example), h(S, example))
            assert h(S, other)[0].dtype != h(S, example)[0].dtype
            with pytest.raises(sm.SignatureError, match=r"input args\[1\]"):
                m(S, other)
        else:
            traced = m.signature.outputs[0].dtype == "bfloat16"  # at a weak scalar
            want = h(S, jnp.asarray(1.5) if traced else np.float32(1.5))
            _same(m(S, example), want)
            _same(m(S, other), want)


@pytest.mark.slow  # a load or a run, compiled: seconds
def test_an_old_self_test_tolerance_is_read_as_written(tmp_path):
    """0.16.0's ``self_test_tolerance`` is what today's load checks the self-test with: an
    artifact whose self-test vectors moved within it loads, one past it is refused."""
    src = RELEASES / "0.16.0" / "tolerance"
    manifest = json.loads((src / "manifest.json").read_text())
    assert manifest["self_test_tolerance"] == {"rtol": 1e-3, "atol": 1e-3}
    m = _load(src)
    _same(m(X), sm.hybridize(sm.mlp((8, 3)), _weights(src))(X))
    assert dict(m.manifest["self_test_tolerance"]) == manifest["self_test_tolerance"]


@pytest.mark.slow  # a load or a run, compiled: seconds
def test_resuming_an_old_checkpoint_continues_as_the_old_run_did(release, tmp_path):
    """A checkpoint an older release wrote after epoch 1, resumed by today's code to epoch 2,
    gives bit for bit the params and optimizer state that release's own run reached (its
    epoch-2 checkpoint, kept beside it)."""
    steps = sorted((release / "ckpt").iterdir())
    assert [p.name for p in steps] == ["step_00000002", "step_00000004"]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(steps[0], ckpt / steps[0].name)
    result = sm.training.train(sm.mlp((8, 3)), data(), checkpoint=ckpt, resume=True, **RUN)
    want = _weights(steps[1])
    got = _leaves({"params": result.params})
    assert got.keys() == {"params/" + k for k in _leaves(want["params"])}
    _same(got, {"params/" + k: v for k, v in _leaves(want["params"]).items()})
    _same(result.opt_state[0].mu, want["opt_state"]["0"]["mu"])


@pytest.mark.slow  # a load or a run, compiled: seconds
def test_init_from_an_old_orbax_checkpoint_takes_its_weights(release, tmp_path):
    """A two-process run's Orbax checkpoint an older release wrote starts a one-process run of
    today's code (``init_from``): at epoch 0 its params are bit for bit the one-process run's
    of the same settings (``blocks=2``), and its export answers as they do."""
    run = {**RUN, "epochs": 0}
    result = sm.training.train(sm.mlp((8, 3)), data(), init_from=release / "orbax", **run)
    want = _weights(release / "ckpt" / "step_00000004")["params"]
    _same(_leaves(result.params), _leaves(want))
    m = _load(result.export(tmp_path / "m").path)
    _same(m(X), sm.hybridize(sm.mlp((8, 3)), {"params": want})(X))


@pytest.mark.slow  # a load or a run, compiled: seconds
def test_an_export_whose_weak_types_decide_its_dtypes_is_format_3_for_older_readers(tmp_path):
    """Today's export wrote such an artifact as format 2, which symjax_mlp 0.9 to 0.15 read
    too: ignoring ``signature.strong`` and ``weak_type``, they answered m(x, 1.5) in float32
    where the model answers bfloat16 (and a float32 scalar in bfloat16 for a weak one), in
    silence. It is format 3 now, which they refuse ("pip install -U symjax_mlp"); an artifact
    without such an input stays format 2, which they load as before."""
    h = sm.hybridize(scalar, {"w": jnp.arange(1, 4, dtype=jnp.bfloat16)})
    for name, example in (("strong", np.float32(1.5)), ("weak", jnp.asarray(1.5))):
        path = sm.export(h, tmp_path / name, example=(S, example), batch=None).path
        assert json.loads((path / "manifest.json").read_text())["format_version"] == 3
        _same(sm.load(path)(S, example), h(S, example))
    assert FORMAT_VERSION == 3
    net = sm.mlp((8, 3))
    plain = sm.hybridize(net, net.init(jax.random.key(0), X))
    path = sm.export(plain, tmp_path / "plain", example=X).path
    assert json.loads((path / "manifest.json").read_text())["format_version"] == 2
