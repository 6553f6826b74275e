"""Round eleven of a stranger's attacks (session 59): the surfaces added since session 56
(train's init_from, hybridize of a module's method, the artifact commands on whole hostile
artifacts), each way in refused with a clear error of the library's. The rounds before:
test_stranger10.py, test_stranger9.py, test_checkpoint_stranger.py, test_init_from.py, ..."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
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
