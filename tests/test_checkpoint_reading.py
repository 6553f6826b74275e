"""What session 59's Part E closed in reading a checkpoint: a foreign checkpoint's header is
checked against the run's own state before a byte of its tensors is held (a sparse file that
declares a gigabyte costs nothing), and a new run's start (``init_from``) reads the weights
only, never another optimizer's state."""

from __future__ import annotations

import hashlib
import json
import os
import tracemalloc

import jax
import numpy as np
import optax
import pytest
from helpers import small

import symjax_mlp as sm
from symjax_mlp.training._checkpoint import read_checkpoint

GIB = 1 << 30


def _state() -> sm.training.TrainState:
    params = sm.mlp((8, 2)).init(jax.random.key(0), np.zeros((1, 12), np.float32))["params"]
    return sm.training.TrainState(params, optax.adam(0.1).init(params), jax.random.key(3), step=4)


def _declaring(step, name, shape, *, hashed=False):
    """``step``'s state.safetensors rewritten to declare ``name`` as float32 of ``shape`` (its
    bytes a hole: a sparse file), the manifest's record of it updated (its sha256 if
    ``hashed``): a self-consistent checkpoint whose only fault is that tensor."""
    file, manifest_file = step / "state.safetensors", step / "manifest.json"
    raw = file.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8 : 8 + size]), raw[8 + size :]
    header.pop("__metadata__", None)
    order = sorted(header, key=lambda n: header[n]["data_offsets"][0])
    new, chunks, at = {}, {}, 0
    for n in order:
        info = header[n]
        old = data[slice(*info["data_offsets"])]
        info = {"dtype": "F32", "shape": list(shape)} if n == name else info
        nbytes = int(np.prod(info["shape"])) * 4 if n == name else len(old)
        new[n] = {**info, "data_offsets": [at, at + nbytes]}
        chunks[at] = None if n == name else old
        at += nbytes
    text = json.dumps(new).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        base = f.tell()
        for offset, chunk in chunks.items():
            if chunk is not None:
                f.seek(base + offset)
                f.write(chunk)
    os.truncate(file, base + at)
    manifest = json.loads(manifest_file.read_text())
    manifest["tensors"][name] = {"shape": list(shape), "dtype": "float32"}
    if hashed:
        sha = hashlib.sha256()
        with open(file, "rb") as f:
            while block := f.read(1 << 20):
                sha.update(block)
        manifest["files"]["state.safetensors"] = sha.hexdigest()
    manifest_file.write_text(json.dumps(manifest))


def _peak(call):
    """``call()``'s result (or the exception it raised) and the most NumPy held meanwhile."""
    tracemalloc.start()
    try:
        try:
            out = call()
        except Exception as e:  # returned for the test to check
            out = e
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", ["params/layers_0/kernel", "opt_state/0/mu/layers_0/kernel"])
def test_a_checkpoint_declaring_a_gigabyte_tensor_is_refused_before_it_is_read(tmp_path, name):
    """restore_checkpoint (and resume, through it) allocated each declared tensor and read the
    file before comparing shapes with the run's: a sparse file declaring a gigabyte (up to this
    machine's memory) took a gigabyte, and its read's time, to be refused."""
    step = sm.training.save_checkpoint(tmp_path, _state())
    _declaring(step, name, (GIB // 4 // 8, 8))
    like = _state()
    err, peak = _peak(lambda: sm.training.restore_checkpoint(tmp_path, like))
    assert peak < GIB // 16, f"{peak:,} bytes held to refuse it"
    assert isinstance(err, sm.CheckpointError), err
    assert name in str(err) and "this model expects shape" in str(err)


def test_a_new_runs_start_reads_the_weights_not_another_optimizers_state(tmp_path):
    """init_from read every tensor of the checkpoint, the optimizer's too, to keep its params:
    a checkpoint of another optimizer with a large state cost its size in memory."""
    step = sm.training.save_checkpoint(tmp_path, _state())
    _declaring(step, "opt_state/0/mu/layers_0/kernel", (1 << 20, 8), hashed=True)  # 32 MiB
    like = _state()
    got, peak = _peak(lambda: read_checkpoint(step, like, weights=lambda *_: None))
    assert not isinstance(got, Exception), got
    assert jax.tree.all(jax.tree.map(np.array_equal, got[0].params, _state().params))
    assert peak < (1 << 25) // 4, f"{peak:,} bytes held to read the weights"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``(h, artifact path)``: small()'s MLP exported."""
    h, x = small()
    return h, sm.export(h, tmp_path_factory.mktemp("exported") / "m", example=x).path


@pytest.mark.slow  # an export and a load (2-3 s)
def test_a_checkpoints_state_passed_as_an_artifacts_weights_says_how_to_export_it(
    tmp_path, exported
):
    """load(params=...) (``symjax-mlp run --params``) of a checkpoint's state.safetensors listed
    its optimizer's tensors as extras and said to use another export's params.safetensors,
    which the user, holding a checkpoint, has none of."""
    h, artifact = exported
    params = h.variables["params"]
    state = sm.training.TrainState(params, optax.adam(0.1).init(params), jax.random.key(0))
    step = sm.training.save_checkpoint(tmp_path / "ck", state)
    with pytest.raises(sm.ArtifactError) as e:
        sm.load(artifact, params=step / "state.safetensors")
    said = str(e.value)
    assert "training checkpoint's state" in said and "resume=True).export(PATH)" in said
    assert "another export" not in said


def _stray(directory, kind):
    """``directory/step_00000009``, a ``kind`` ("symlink" to another run's step, or "file"):
    named like a step newer than the checkpoints beside it, but none."""
    newest = directory / "step_00000009"
    if kind == "symlink":
        (elsewhere := directory.parent / "elsewhere" / "step_00000009").mkdir(parents=True)
        newest.symlink_to(elsewhere)
    else:
        newest.write_text("")
    return newest


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_restoring_a_directory_whose_newest_step_is_no_checkpoint_is_refused_naming_it(
    tmp_path, kind
):
    """restore_checkpoint(DIR) passed over a newer step_* that is a symlink or a file and read
    the older checkpoint beside it, silently (resume and init_from refuse it)."""
    sm.training.save_checkpoint(tmp_path / "ck", _state())
    newest = _stray(tmp_path / "ck", kind)
    with pytest.raises(sm.CheckpointError) as e:
        sm.training.restore_checkpoint(tmp_path / "ck", _state())
    said = str(e.value)
    assert said.startswith(f"symjax_mlp.training.restore_checkpoint: {newest} is a {kind}"), said
    assert "would pass it over for" in said and "step_00000004" in said, said
    assert sm.training.restore_checkpoint(tmp_path / "ck" / "step_00000004", _state())[0].step == 4


@pytest.mark.slow  # two train() starts (2-3 s)
def test_init_from_an_artifact_or_past_a_stray_step_is_refused_in_its_own_words(tmp_path, exported):
    """train(init_from=...) of an exported artifact said "Resume from a checkpoint train()
    wrote", and of a directory whose newest step_* is no checkpoint "a resume would pass it
    over": a new run's start is no resume."""
    x = np.random.default_rng(0).normal(size=(32, 8)).astype(np.float32)
    data = sm.training.Dataset(x[:16], np.arange(16) % 3, x[16:], np.arange(16) % 3, name="t")
    run = {"epochs": 0, "batch_size": 8}
    with pytest.raises(sm.CheckpointError) as e:
        sm.training.train(sm.mlp((16, 3)), data, init_from=exported[1], **run)
    said = str(e.value)
    assert "not a symjax_mlp checkpoint" in said and "A new run starts from" in said, said
    assert "Resume" not in said, said
    sm.training.save_checkpoint(tmp_path / "ck", _state())
    _stray(tmp_path / "ck", "symlink")
    with pytest.raises(sm.CheckpointError) as e:
        sm.training.train(sm.mlp((16, 3)), data, init_from=tmp_path / "ck", **run)
    said = str(e.value)
    assert "would pass it over for" in said and "a resume" not in said, said


@pytest.mark.slow  # three short runs (4-6 s)
def test_resuming_reduce_on_plateau_with_another_patience_or_factor_is_refused(tmp_path):
    """The optimizer's fingerprint ran its update without value=, which reduce_on_plateau needs:
    it recorded the optimizer's type only, and the probe of its next update sees no plateau
    setting, so a resume with another patience or factor went through, silently."""
    x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    y = (np.arange(64) % 3).astype(np.int32)
    data = sm.training.Dataset(x[:48], y[:48], x[48:], y[48:], name="t")

    def run(patience, factor, resume=False):
        plateau = optax.contrib.reduce_on_plateau(patience=patience, factor=factor)
        return sm.training.train(
            sm.mlp((16, 3)), data, optimizer=optax.chain(optax.adam(1e-2), plateau), epochs=1,
            batch_size=16, checkpoint=tmp_path, resume=resume,
        )  # fmt: skip

    run(3, 0.5)
    for patience, factor in ((4, 0.5), (3, 0.1)):
        with pytest.raises(sm.CheckpointError, match="the optimizer: its kind, hyperparameters"):
            run(patience, factor, resume=True)
    assert run(3, 0.5, resume=True).history[-1].epoch == 1  # the same optimizer: resumed


@pytest.mark.slow  # two short CLI runs (3-5 s)
def test_the_cli_says_resuming_from_what_train_resumes_not_what_it_listed(tmp_path, capsys):
    """The CLI listed the checkpoint directory itself and said "resuming from" its newest before
    train() had looked at it: a checkpoint of another run was said resumed, then refused. It
    is train()'s line now (its logger's, at INFO), said once the checkpoint is checked."""
    from symjax_mlp.cli import main

    argv = ["train", "--epochs", "1", "--checkpoint", str(tmp_path / "ck")]
    assert main([*argv, "--sizes", "8,10"]) == 0
    capsys.readouterr()
    assert main([*argv, "--sizes", "9,10", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "written for another model" in err and "resuming from" not in err, err
    assert main([*argv, "--sizes", "8,10", "--resume"]) == 0
    assert f"resuming from {tmp_path / 'ck' / 'step_00000023'}\n" in capsys.readouterr().err
