"""Round eleven of a stranger's attacks (session 59): the surfaces added since session 56
(train's init_from, hybridize of a module's method, the artifact commands on whole hostile
artifacts), each way in refused with a clear error of the library's. The rounds before:
test_stranger10.py, test_stranger9.py, test_checkpoint_stranger.py, test_init_from.py, ..."""

from __future__ import annotations

import hashlib
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file, save

import symjax_mlp as sm


@pytest.fixture(scope="module")
def tiny():
    """Three classes of 5 features, 4 steps of 16 per epoch."""
    x = np.random.default_rng(0).normal(size=(96, 5)).astype(np.float32)
    y = np.digitize(x[:, 0] + x[:, 1], [-0.5, 0.5]).astype(np.int32)
    return sm.training.Dataset(x[:64], y[:64], x[64:], y[64:], name="tiny")


@pytest.fixture(scope="module")
def written(tiny, tmp_path_factory):
    """A checkpoint directory of one epoch of ``sm.mlp((4, 3))`` on ``tiny``."""
    directory = tmp_path_factory.mktemp("written") / "ckpt"
    sm.training.train(sm.mlp((4, 3)), tiny, epochs=1, batch_size=16, checkpoint=directory)
    return directory


def _edited(written, to, edit):
    """A copy of ``written`` at ``to`` whose newest checkpoint's tensors ``edit`` changed, its
    manifest rewritten to agree (digest, shapes, dtypes): whole, as a stranger makes it."""
    shutil.copytree(written, to)
    (step,) = to.glob("step_*")
    tensors = load_file(step / "state.safetensors")
    edit(tensors)
    data = save(tensors)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"]["state.safetensors"] = hashlib.sha256(data).hexdigest()
    manifest["tensors"] = {n: {"shape": list(a.shape), "dtype": str(a.dtype)}
                           for n, a in tensors.items()}  # fmt: skip
    (step / "state.safetensors").write_bytes(data)
    (step / "manifest.json").write_text(json.dumps(manifest))
    return step


def _nan_weights(tensors):
    tensors["params/layers_1/kernel"][0, 0] = np.nan


@pytest.mark.slow  # a run of one epoch, then two that stop before their first step (~1-2 s)
def test_a_checkpoint_of_non_finite_weights_is_refused_at_the_start_not_trained_on(
    tiny, written, tmp_path
):
    """A checkpoint whose weights hold a NaN (edited, or saved by a script of save_checkpoint),
    all else agreeing: train(init_from=it, epochs=0) returned the NaN weights as a new run's,
    silently; with epochs, init_from and resume both stopped at the first step saying "training
    diverged ... Lower the learning rate, clip the gradients or check the data", none of which
    was the cause. Now refused before the first step, naming the tensor and what to do."""
    step = _edited(written, tmp_path / "nan", _nan_weights)
    with pytest.raises(sm.CheckpointError) as e:
        sm.training.train(sm.mlp((4, 3)), tiny, epochs=0, init_from=tmp_path / "nan")
    said = str(e.value)
    assert said.startswith(f"symjax_mlp.training.train(init_from='{tmp_path / 'nan'}'): {step}: ")
    assert "its params hold nan (params/layers_1/kernel)" in said, said
    assert "leave init_from out" in said and "diverged" not in said, said
    with pytest.raises(sm.CheckpointError) as e:
        sm.training.train(sm.mlp((4, 3)), tiny, epochs=2, batch_size=16,
                          checkpoint=tmp_path / "nan", resume=True)  # fmt: skip
    said = str(e.value)
    assert said.startswith(f"symjax_mlp.training.train: {step}: its params hold nan"), said
    assert "Resume from an older checkpoint" in said and "learning rate" not in said, said


class _LazyParam(nnx.Module):
    """Makes a Param on its first call, drawn from the rngs it keeps (a lazy layer)."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(2, 3, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        if not hasattr(self, "shift"):
            self.shift = nnx.Param(jax.random.normal(self.rngs.params(), (3,)))
        return self.linear(x) + self.shift


@pytest.mark.slow  # a refused trace, then a compile (~1 s)
def test_a_module_making_a_param_in_its_call_is_refused_not_drawn_anew_each_call():
    """An nnx module whose call makes a Param (lazily, on its first): the module keeps it and
    answers alike from then on, but its Hybrid held no such Param, so each h(x) made it anew
    from the next draw of the rng it carries: three calls, three answers, silently (h.params
    without it: trained by nothing, exported by nothing). Refused now, saying what to do."""
    x = jnp.ones((1, 2))
    with pytest.raises(sm.ConfigError) as e:
        sm.hybridize(_LazyParam(nnx.Rngs(0)))(x)
    said = str(e.value)
    assert said.startswith("_LazyParam: the call made the Params ['shift'] of the nnx module"), said
    assert "Create them in __init__, or call the module once (model(x)) before" in said, said
    model = _LazyParam(nnx.Rngs(0))
    first = model(x)  # the fix it names: then the Hybrid holds it, and answers as the module
    h = sm.hybridize(model)
    assert "shift" in h.params
    np.testing.assert_allclose(h(x), first, rtol=1e-6)
    np.testing.assert_allclose(h(x), model(x), rtol=1e-6)


@pytest.mark.slow  # an export, a load, the command line (~1-2 s)
def test_timing_an_artifact_whose_fixed_input_no_memory_holds_never_says_pass_a_smaller_batch(
    tmp_path, capsys
):
    """An artifact of a fixed input of 2**40 rows (whole: its program, manifest and weights
    agree): ``timeit`` and ``symjax-mlp bench --trust`` said "pass a smaller batch" (the CLI:
    "batch= is --batch") though it was drawn at batch 1 and no batch changes its shape."""
    from symjax_mlp.cli import main

    h = sm.hybridize(lambda p, x: x @ p, jnp.ones((8, 3)))
    big = jax.ShapeDtypeStruct((1 << 40, 8), jnp.float32)
    art = sm.export(h, tmp_path / "a", example=big, batch=None)
    with pytest.raises(sm.ConfigError) as e:
        sm.timeit(sm.load(art.path, trust=True))
    said = str(e.value)
    assert said.startswith(f'timeit(symjax_mlp.load("{art.path}")): the inputs it would draw')
    assert "float32[1099511627776, 8]" in said and "pass inputs of your own" in said  # round 16
    assert "smaller batch" not in said, said
    assert main(["bench", str(art.path), "--trust", "--calls", "1", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert "smaller batch" not in err and "--batch" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("stray", ["symlink", "file"])
def test_init_from_a_directory_whose_newest_step_is_no_checkpoint_is_refused_naming_it(
    tmp_path, stray
):
    """init_from a directory whose newest step_* is a symlink (to another run's checkpoint, say)
    or a file: it was passed over, and the new run started, silently, from the older checkpoint
    beside it (where none was, "holds no step_* checkpoint" though one was named there). A
    resume refuses it (check_strays); init_from does now, before any work, naming it."""
    elsewhere = tmp_path / "elsewhere" / "step_00000009"
    elsewhere.mkdir(parents=True)
    (tmp_path / "ckpt" / "step_00000004").mkdir(parents=True)  # refused before it is read
    newest = tmp_path / "ckpt" / "step_00000009"
    newest.symlink_to(elsewhere) if stray == "symlink" else newest.write_text("")
    with pytest.raises(sm.CheckpointError) as e:
        sm.training.train(epochs=0, init_from=tmp_path / "ckpt")
    said = str(e.value)
    assert said.startswith(f"symjax_mlp.training.train(init_from='{tmp_path / 'ckpt'}'): "), said
    assert f"{newest} is a {stray}, not a checkpoint directory" in said, said
    assert "newer than step_00000004" in said, said


def test_a_staticmethod_object_is_hybridized_as_the_function_it_holds():
    """``sm.hybridize(Model.__dict__["apply"], params)``, a staticmethod object (callable since
    Python 3.10): hybridize took it for a bound method, as it has a ``__func__``, and raised
    AttributeError: 'staticmethod' object has no attribute '__self__'."""

    def scale(p, x):
        return x * p

    h = sm.hybridize(staticmethod(scale), jnp.float32(2))
    np.testing.assert_array_equal(h.eager(jnp.ones(2)), scale(jnp.float32(2), jnp.ones(2)))


@pytest.mark.slow  # an export, inspected twice (~1-3 s)
def test_inspect_shows_a_model_card_of_megabytes_cut_and_says_where_it_is_whole(tmp_path, capsys):
    """An artifact whose card (export's metadata=) holds a value of a megabyte, or thousands of
    keys: ``symjax-mlp inspect`` (``str(sm.inspect(path))``) printed all of it, a line of a
    megabyte to the terminal; every other manifest string a message shows is cut."""
    from symjax_mlp.cli import main

    card = {"inputs": "x" * 1_000_000, **{f"k{i}": i for i in range(60)}}
    h = sm.hybridize(lambda p, x: x @ p, jnp.ones((4, 3)))
    art = sm.export(h, tmp_path / "a", example=jnp.ones((2, 4)), metadata=card)
    shown = str(sm.inspect(art.path))
    assert len(shown) < 20_000, len(shown)
    assert "card       inputs: " + "x" * 300 + "... (999,700 more: .metadata holds it whole)" in (
        shown
    )
    assert "card       k48: 48\n" in shown and "k49" not in shown, shown
    assert "card       and 11 more keys (in .metadata)" in shown
    assert sm.inspect(art.path).metadata == card  # the card itself, whole
    assert main(["inspect", str(art.path)]) == 0
    assert len(capsys.readouterr().out) < 20_000


@pytest.mark.slow  # two short runs per model (~2-4 s)
@pytest.mark.parametrize("stateful", [False, True], ids=["mlp", "batchnorm"])
def test_init_from_a_schedule_free_run_starts_from_the_weights_it_reported(
    tiny, tmp_path, stateful
):
    """A schedule-free run (optax.contrib.schedule_free_adamw) reports and exports its eval
    params, but its checkpoint holds the point its gradients were taken at: init_from (a new
    run with another optimizer) started, silently, from those, not from the weights the run
    reported, tested and exported. Now from its eval params, as ``result.params`` holds them."""
    from helpers import LinenBatchNorm

    model = LinenBatchNorm if stateful else lambda: sm.mlp((4, 3))
    run = {"epochs": 2, "batch_size": 16, "optimizer": optax.contrib.schedule_free_adamw(1e-2)}
    first = sm.training.train(model(), tiny, checkpoint=tmp_path, **run)
    start = sm.training.train(model(), tiny, epochs=0, init_from=tmp_path,
                              optimizer=optax.adam(1e-3))  # fmt: skip
    for was, now in zip(jax.tree.leaves(first.params), jax.tree.leaves(start.params), strict=True):
        np.testing.assert_allclose(now, was, rtol=1e-6, atol=1e-7)
    assert start.test_accuracy == first.test_accuracy
