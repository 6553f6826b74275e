"""A stranger's checkpoint directory: whole, self-consistent checkpoints (hashes recomputed,
so only the hostile part is wrong) that point outside their directory, declare what the model
does not hold, or are named or sized to wedge a resume. Each is refused with a
``CheckpointError`` naming what and what to do, before anything outside it is read or deleted.
"""

from __future__ import annotations

import gc
import json
import os
import shutil

import jax
import numpy as np
import optax
import pytest

import symjax_mlp as sm
from symjax_mlp.training import _orbax
from symjax_mlp.training._orbax import OrbaxCheckpoints

# a failed Orbax read leaves futures of its event loop unretrieved (asyncio logs them when they
# are collected): Orbax's, not an error of ours
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
RUN = {"epochs": 1, "batch_size": 16}
DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


@pytest.fixture(autouse=True)
def _collected():
    """Orbax's unretrieved futures (the error's traceback holds them) go at this test's end,
    under its filter, not in the next test's."""
    yield
    gc.collect()


@pytest.fixture(scope="module")
def tiny():
    x = np.random.default_rng(0).normal(size=(96, 12)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32)
    return sm.training.Dataset(x[:64], y[:64], x[64:], y[64:], name="tiny")


def _state(dtype=np.float32) -> sm.training.TrainState:
    params = sm.mlp((8, 2)).init(jax.random.key(0), np.zeros((1, 12), np.float32))["params"]
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    return sm.training.TrainState(params, optax.sgd(0.1).init(params), jax.random.key(3), step=4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A multi-process run's checkpoint (Orbax) of ``_state()``: its step directory."""
    store = OrbaxCheckpoints(tmp_path_factory.mktemp("orbax") / "ck", timeout=30, sharding=DEVICE)
    path = store.save(_state(), {"config": {}, "history": []})
    store.close()
    return path


@pytest.fixture
def copy(saved, tmp_path):
    """A copy of ``saved`` in a checkpoint directory of its own, and another outside it."""
    shutil.copytree(saved, tmp_path / "outside" / saved.name)
    return shutil.copytree(saved, tmp_path / "ck" / saved.name), tmp_path / "outside" / saved.name


def _restore(path):
    store = OrbaxCheckpoints(path.parent, timeout=30, sharding=DEVICE)
    try:
        return store.restore(path, _state())
    finally:
        store.close()


@pytest.fixture
def orbax(monkeypatch):
    """``orbax(directory)``: train() of one process saves and resumes a multi-process run's
    checkpoints (Orbax) in ``directory`` from now on."""
    from symjax_mlp.training import _loop

    processes = _loop._processes

    def use(directory):
        def orbax_processes(*args, **kwargs):
            programs, _, watch = processes(*args, **{**kwargs, "checkpoint": None})
            return programs, OrbaxCheckpoints(directory, timeout=30, sharding=DEVICE), watch

        monkeypatch.setattr(_loop, "_processes", orbax_processes)

    return use


def _train(tiny, directory, **kw):
    return sm.training.train(sm.mlp((8, 2)), tiny, checkpoint=directory, **{**RUN, **kw})


def _link(entry, to):
    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    entry.symlink_to(to)


def _big(entry):
    with open(entry, "r+b") as f:  # sparse: a gigabyte on no disk, Orbax would read it all
        f.truncate(1 << 30)


HOSTILE = {  # what is done to the step; what the refusal says of which entry
    "state is a link out": (lambda p, out: _link(p / "state", out / "state"), "state is a symlink"),
    "meta is a link out": (
        lambda p, out: _link(p / "meta" / "metadata", out / "meta" / "metadata"),
        "metadata is a symlink",
    ),
    "arrays' data are a link out": (
        lambda p, out: _link(p / "state" / "ocdbt.process_0" / "d", out / "state"),
        "d is a symlink",
    ),
    "meta is a FIFO": (
        lambda p, out: (os.unlink(p / "meta" / "metadata"), os.mkfifo(p / "meta" / "metadata")),
        "metadata is neither a file nor a directory (a FIFO",
    ),
    "meta is a gigabyte": (
        lambda p, out: _big(p / "meta" / "metadata"),
        "metadata is 1,073,741,824 bytes, more than a save writes",
    ),
    "Orbax's own metadata is a gigabyte": (
        lambda p, out: _big(p / "_CHECKPOINT_METADATA"),
        "_CHECKPOINT_METADATA is 1,073,741,824 bytes",
    ),
}


@pytest.mark.parametrize("hostile", HOSTILE)
def test_an_orbax_step_whose_files_lead_out_block_or_bloat_is_refused_before_reading(copy, hostile):
    """Orbax and TensorStore followed a link out of the checkpoint directory (the restore
    passed: the files out there were whole), would block on a FIFO, and read a gigabyte of
    JSON whole (300 MB of meta took 900 MB and 2.4 s)."""
    path, outside = copy
    forge, says = HOSTILE[hostile]
    forge(path, outside)
    with pytest.raises(sm.CheckpointError) as e:
        _restore(path)
    assert f"{path}: {path}" in str(e.value) and says in str(e.value), str(e.value)
    assert "Resume from an older checkpoint" in str(e.value)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[" * 10**5 + "]" * 10**5, "_CHECKPOINT_METADATA is not a JSON object"),
        ("[1, 2]", "_CHECKPOINT_METADATA is not a JSON object"),
        ('{"item_handlers": 5}', r"Orbax cannot read its steps' metadata \(ValueError"),
    ],
    ids=["nested", "a list", "a field of another type"],
)
def test_an_orbax_steps_own_metadata_edited_is_a_checkpoint_error(copy, text, says):
    """Orbax's CheckpointManager reads each step's _CHECKPOINT_METADATA as it starts: train()
    raised its RecursionError or ValueError, naming no checkpoint."""
    path, _ = copy
    (path / "_CHECKPOINT_METADATA").write_text(text)
    with pytest.raises(sm.CheckpointError, match=says) as e:
        _restore(path)
    assert str(path.parent) in str(e.value) and "remove" in str(e.value).lower()


def test_an_orbax_step_of_more_files_than_a_save_writes_is_refused(copy, monkeypatch):
    path, _ = copy
    monkeypatch.setattr(_orbax, "_MAX_ENTRIES", 12)
    with pytest.raises(sm.CheckpointError, match="holds over 12 files, more than a save writes"):
        _restore(path)


def _zarray(path, key, **changes):
    """Rewrites array ``key``'s zarr metadata in the step's OCDBT database, as a forger would."""
    import tensorstore as ts

    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path / 'state'}/"}).result()
    meta = json.loads(store.read(f"{key}/.zarray".encode()).result().value)
    store.write(f"{key}/.zarray".encode(), json.dumps({**meta, **changes}).encode()).result()


@pytest.mark.parametrize(
    "changes",
    [
        {"dtype": "bfloat16"},
        {"dtype": "<c8"},
        {"dtype": "<i4"},  # the same bytes, read as ints: their sha256 tells
        {"dtype": "|O", "compressor": None},
        {"shape": [12, 16 * 10**12]},  # a bomb, declared
        {"chunks": [4 * 10**9, 16]},
    ],
)
def test_orbax_array_metadata_declaring_another_dtype_or_a_bomb_is_refused(copy, changes):
    path, _ = copy
    _zarray(path, "00001", **changes)  # the first kernel, not zeros
    with pytest.raises(sm.CheckpointError, match=r"its arrays (cannot be read|are not the ones)"):
        _restore(path)


def _tree(path, edit):
    """Rewrites the step's Orbax tree metadata (state/_METADATA) with ``edit``."""
    file = path / "state" / "_METADATA"
    meta = json.loads(file.read_text())
    edit(meta)
    file.write_text(json.dumps(meta))


def _outside_key(meta):
    tree = meta["tree_metadata"]
    value = tree.pop("('00000',)")
    value["key_metadata"][0]["key"] = "../../../outside/4/state/00000"
    tree["('../../../outside/4/state/00000',)"] = value


@pytest.mark.parametrize(
    "edit",
    [
        _outside_key,  # a key naming a path out of the directory: the tree no longer fits
        lambda meta: meta.update(use_ocdbt=False, use_zarr3=True),  # another layout
        lambda meta: meta["tree_metadata"]["('00001',)"]["value_metadata"].update(
            value_type="scalar", skip_deserialize=True
        ),
    ],
    ids=["key out of the directory", "another layout", "another value type"],
)
def test_orbax_tree_metadata_naming_paths_out_or_other_layouts_is_refused(copy, edit):
    """TensorStore's file driver refuses a key holding '..' or a leading '/' (an OCDBT data
    file named so included); Orbax builds each array's kvstore from the directory, never from
    the checkpoint's metadata, and refuses a tree other than the one asked for."""
    path, _ = copy
    _tree(path, edit)
    with pytest.raises(sm.CheckpointError, match=r"its arrays cannot be read"):
        _restore(path)


@pytest.mark.slow  # train() runs (0.8-4 s)
def test_an_orbax_step_named_otherwise_than_a_save_names_it_is_refused_not_passed_over(
    tiny, tmp_path, orbax
):
    """Orbax reads step 4 from '4' only: a run resumed with '00004' there (a copy, a stranger's
    rename) trained from scratch beside it, though resume=True and a checkpoint were given."""
    orbax(tmp_path)
    _train(tiny, tmp_path)
    os.rename(tmp_path / "4", tmp_path / "00004")
    epochs = []
    with pytest.raises(sm.CheckpointError) as e:
        _train(tiny, tmp_path, epochs=2, resume=True, on_epoch=epochs.append)
    assert f"{tmp_path / '00004'} is a directory whose name no save writes (step 4's is 4)" in str(
        e.value
    )
    assert "Remove it" in str(e.value) and epochs == []
    os.rename(tmp_path / "00004", tmp_path / "4")
    assert _train(tiny, tmp_path, epochs=2, resume=True).step == 8


@pytest.mark.slow  # train() runs (0.8-4 s)
def test_an_older_orbax_step_that_is_a_symlink_is_refused_before_training(tiny, tmp_path, orbax):
    """Orbax prunes the steps past the newest two through their names: the run trained every
    epoch, then failed with shutil's OSError ('Cannot call rmtree on a symbolic link'); its
    manager read the linked step's metadata as it started."""
    ck, outside = tmp_path / "ck", tmp_path / "outside"
    orbax(ck)
    _train(tiny, ck)
    shutil.copytree(ck / "4", outside / "1")
    (ck / "1").symlink_to(outside / "1")
    epochs = []
    with pytest.raises(sm.CheckpointError) as e:
        _train(tiny, ck, epochs=3, resume=True, on_epoch=epochs.append)
    assert f"{ck / '1'}: {ck / '1'} is a symlink to {outside / '1'}: a checkpoint" in str(e.value)
    assert epochs == []
    assert sorted(os.listdir(outside / "1")) == sorted(os.listdir(ck / "4"))  # untouched


# -- one process: our own format -------------------------------------------------------------
@pytest.mark.parametrize("text", ["gigabyte", "nested"])
def test_a_manifest_of_a_gigabyte_or_deeply_nested_is_refused_quickly(tmp_path, text):
    path = sm.training.save_checkpoint(tmp_path, _state())
    manifest = path / "manifest.json"
    if text == "gigabyte":
        _big(manifest)
    else:
        manifest.write_text("[" * 10**6 + "]" * 10**6)
    says = "more than" if text == "gigabyte" else "not valid JSON"
    with pytest.raises(sm.CheckpointError, match=says):
        sm.training.restore_checkpoint(tmp_path, _state())


@pytest.mark.parametrize("dtype", [jax.numpy.bfloat16, np.int32, np.complex64])
def test_a_checkpoint_of_another_dtype_than_the_models_is_refused(tmp_path, dtype):
    sm.training.save_checkpoint(tmp_path, _state(dtype))
    with pytest.raises(sm.CheckpointError, match=r"expects shape \(8,\) and dtype float32"):
        sm.training.restore_checkpoint(tmp_path, _state())


@pytest.mark.slow  # train() runs (0.8-4 s)
def test_entries_named_like_no_step_are_left_alone_and_a_nine_digit_step_is_refused(tiny, tmp_path):
    """``step_-1`` and ``step_1e9`` are no step's names: the resume passes them over and leaves
    them; ``step_000000009`` is step 9 under a name no save writes: refused, as Orbax's."""
    _train(tiny, tmp_path)
    for name in ("step_-1", "step_1e9"):
        shutil.copytree(tmp_path / "step_00000004", tmp_path / name)
    assert _train(tiny, tmp_path, epochs=2, resume=True).step == 8
    assert {"step_-1", "step_1e9"} <= set(os.listdir(tmp_path))
    os.rename(tmp_path / "step_00000008", tmp_path / "step_000000009")
    with pytest.raises(sm.CheckpointError, match="step 9's is step_00000009"):
        _train(tiny, tmp_path, epochs=3, resume=True)
