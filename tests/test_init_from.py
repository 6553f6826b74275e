"""What Part E's day two left open (session 58, Part H): carrying on from a checkpoint's
weights with a new optimizer (``train(init_from=DIR)``, ``--init-from``), a resume that finds
nothing, a relaunch said in the CLI's words, and two requests curl users send."""

from __future__ import annotations

import hashlib
import io
import json
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import LinenBatchNorm, NnxBatchNorm

import symjax_mlp as sm
from symjax_mlp.serving import _bodies
from symjax_mlp.training import _processes


@pytest.fixture(scope="module")
def tiny():
    """Three classes of 5 features (the helpers' models), 4 steps of 16 per epoch."""
    x = np.random.default_rng(0).normal(size=(96, 5)).astype(np.float32)
    y = np.digitize(x[:, 0] + x[:, 1], [-0.5, 0.5]).astype(np.int32)
    return sm.training.Dataset(x[:64], y[:64], x[64:], y[64:], name="tiny")


def _files(directory):
    """Every file under ``directory``, by path, as its sha256: what a run must leave as it is."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _same(a, b):
    return jax.tree.all(jax.tree.map(lambda u, v: np.array_equal(u, v), a, b))


@pytest.mark.slow  # six short runs of a small model (5-10 s)
def test_a_new_run_starts_from_a_checkpoints_weights_and_batch_stats_with_a_fresh_optimizer(
    tiny, tmp_path
):
    """A resume with another learning rate is refused (rightly): there was then no way through
    train() to carry on from a linen checkpoint's weights with a new optimizer or schedule."""
    old = tmp_path / "old"
    run = {"batch_size": 16, "seed": 1}
    first = sm.training.train(LinenBatchNorm(), tiny, epochs=2, checkpoint=old, **run)
    kept = _files(old)
    with pytest.raises(sm.CheckpointError) as e:  # the refusal names the way through
        sm.training.train(LinenBatchNorm(), tiny, epochs=3, checkpoint=old, resume=True,
                          learning_rate=1e-2, **run)  # fmt: skip
    assert "start over in an empty directory" in str(e.value), e.value
    assert "init_from=DIR naming that directory and checkpoint=DIR another" in str(e.value)

    tx = optax.adam(1e-2)
    start = sm.training.train(LinenBatchNorm(), tiny, epochs=0, init_from=old, optimizer=tx)
    assert _same(start.params, first.params) and _same(start.model_state, first.model_state)
    assert (start.step, start.epoch, start.resumed_from) == (0, 0, None)
    fresh = tx.init(first.params)  # adam's count, mu and nu: zeros, not the old run's
    assert _same(start.opt_state, fresh), start.opt_state

    new = sm.training.train(LinenBatchNorm(), tiny, epochs=1, init_from=old / "step_00000008",
                            optimizer=tx, checkpoint=tmp_path / "new", **run)  # fmt: skip
    assert (new.step, new.epoch, new.checkpoint.name) == (4, 1, "step_00000004")
    assert not _same(new.params, first.params)  # trained on, by the new optimizer
    again = {"init_from": old, "optimizer": tx, "resume": True, **run}  # a relaunchable run:
    with pytest.warns(UserWarning, match="holds no checkpoint yet; a new run, from init_from"):
        start = sm.training.train(LinenBatchNorm(), tiny, epochs=0, checkpoint=tmp_path / "a",
                                  **again)  # fmt: skip
    assert _same(start.params, first.params)  # from init_from, then from its own checkpoints
    resumed = sm.training.train(LinenBatchNorm(), tiny, epochs=1, checkpoint=tmp_path / "new",
                                **again)  # fmt: skip
    assert (resumed.resumed_from.name, resumed.step) == ("step_00000004", 4)

    with pytest.raises(sm.CheckpointError) as e:  # another model's weights
        sm.training.train(sm.mlp((8, 3)), tiny, epochs=0, init_from=old)
    said = str(e.value)
    assert said.startswith(f"symjax_mlp.training.train(init_from='{old}'): "), said
    assert "the model's configuration" in said and "pass that model" in said, said
    assert _files(old) == kept  # read, never written


@pytest.mark.slow  # three short runs of a small nnx model (2-4 s)
def test_an_nnx_run_starts_from_a_checkpoint_without_the_module_in_memory(tiny, tmp_path):
    """For nnx, only result.model carried the weights on: gone with the process."""
    sm.training.train(NnxBatchNorm(nnx.Rngs(0)), tiny, epochs=1, checkpoint=tmp_path, seed=3)
    first = sm.training.train(NnxBatchNorm(nnx.Rngs(0)), tiny, epochs=1, seed=3)
    start = sm.training.train(NnxBatchNorm(nnx.Rngs(7)), tiny, epochs=0, init_from=tmp_path,
                              optimizer=optax.sgd(0.1))  # fmt: skip
    assert _same(start.params, first.params) and _same(start.model_state, first.model_state)


def test_init_from_the_runs_own_checkpoint_directory_is_refused_before_any_work(tmp_path):
    """The new run would write its checkpoints among the ones it starts from, and prune them."""
    for checkpoint in (tmp_path, tmp_path / "new"):
        with pytest.raises(sm.ConfigError, match="is, holds or is inside that directory"):
            sm.training.train(epochs=0, init_from=tmp_path, checkpoint=checkpoint)


def test_init_from_orbax_checkpoints_passes_over_no_uncommitted_save_as_resume_does(tmp_path):
    """init_from reads a multi-process run's Orbax checkpoints (it refused them all, once:
    tests/test_multiprocess.py reads a real run's); a save never committed, newer than the newest
    committed one, is refused before any work, as a resume refuses it, not passed over."""
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "_CHECKPOINT_METADATA").write_text("{}")  # a committed Orbax save
    (tmp_path / "16" / "state").mkdir(parents=True)  # its save killed before Orbax committed it
    with pytest.raises(
        sm.CheckpointError, match=r"16 is a directory without _CHECKPOINT_METADATA \(an Orbax save"
    ) as e:
        sm.training.train(epochs=0, init_from=tmp_path)
    assert re.search(
        r"pass it over for \S+/8, an older one.* or another of its steps", str(e.value)
    )


@pytest.mark.slow  # a run of no epochs: the model traced, its probes compiled (0.7-1.2 s)
def test_resume_with_a_directory_holding_no_checkpoint_warns_that_it_starts_over(tiny, tmp_path):
    """train(checkpoint=typo, resume=True) trained from scratch as silently as a resume."""
    typo = tmp_path / "ckpy"
    with pytest.warns(UserWarning) as said:
        sm.training.train(sm.mlp((4, 3)), tiny, epochs=0, checkpoint=typo, resume=True)
    assert [str(w.message) for w in said] == [
        f"resume=True: {typo} holds no checkpoint yet; training from the start"
    ]


def test_a_lost_peer_is_told_to_relaunch_in_the_callers_words(monkeypatch):
    """`symjax-mlp train --coordinator ...` told its user to relaunch with resume=True."""

    class Client:
        def key_value_set(self, *args, **kwargs):
            pass

    said = []
    monkeypatch.setattr(_processes, "_client", Client)
    monkeypatch.setattr(_processes, "end", said.append)
    lost = jax.errors.JaxRuntimeError("UNAVAILABLE: [gloo] Connection closed by peer")
    for words in ("resume=True", "--resume"):
        token = _processes.RESUME.set(words)
        watch = _processes.Watchdog("run", 60, "symjax-mlp train")
        _processes.RESUME.reset(token)
        try:
            with watch(7):
                raise lost
        finally:
            watch.close()
    assert [f"Relaunch every process with {w} to" in s for w, s in zip(
        ("resume=True", "--resume"), said, strict=True)] == [True, True], said  # fmt: skip


def test_an_empty_json_batch_is_said_to_hold_no_rows():
    """{"inputs": []} was told it "holds lists nested 1 deep ... send lists nested 2 deep"."""
    batcher = sm.serving.Batcher(lambda x: x, example=np.zeros((1, 2), np.float32), max_batch=2)
    with batcher as b, pytest.raises(sm.SignatureError) as e:
        _bodies.decode(b, b'{"inputs": []}', "application/json")
    said = str(e.value)
    assert "input args[0] holds no rows (an empty list)" in said, said
    assert "send at least one row, lists nested 2 deep" in said, said


def test_a_npy_body_whose_newlines_curl_d_stripped_is_told_data_binary():
    """`curl -H 'Content-Type: application/x-npy' -d @x.npy` strips the file's newlines: the
    answer said "not a readable .npy array (EOF ...)"; without -H, the 415 said to send JSON."""
    buf = io.BytesIO()
    np.save(buf, np.arange(12, dtype=np.float32).reshape(6, 2))
    stripped = buf.getvalue().replace(b"\n", b"").replace(b"\r", b"")
    curl = {b"user-agent": b"curl/8.5.0"}
    with sm.serving.Batcher(lambda x: x, example=np.zeros((1, 2), np.float32), max_batch=8) as b:
        said = {}
        for name, body, kind, heads in [
            ("curl", stripped, _bodies.NPY, curl),
            ("python", stripped, _bodies.NPY, {b"user-agent": b"python-requests/2.32"}),
            ("form", stripped, "application/x-www-form-urlencoded", curl),
            ("not npy", b"\x00" * 80, _bodies.NPY, curl),
        ]:
            with pytest.raises(_bodies.BadRequest) as e:
                _bodies.decode(b, body, kind, heads)
            said[name] = (e.value.status, str(e.value))
    hint = "with curl, send the file with --data-binary @FILE (-d strips its newlines)"
    assert said["curl"][0] == 400 and "not a readable .npy array" in said["curl"][1]
    assert hint in said["curl"][1], said
    assert "--data-binary" not in said["python"][1] + said["not npy"][1], said
    assert said["form"][0] == 415, said
    assert "-H 'Content-Type: application/x-npy' (-d alone sends a form) and send the file " \
        "with --data-binary" in said["form"][1], said  # fmt: skip


@pytest.mark.slow  # three short CLI runs (3.5 s)
def test_the_cli_starts_a_new_run_from_a_checkpoint_with_init_from(tmp_path, capsys):
    """`symjax-mlp train --resume --learning-rate 0.01` is refused; its advice, init_from=DIR,
    is --init-from DIR on the command line, which trains on from that checkpoint's weights."""
    from symjax_mlp.cli import main

    old, argv = tmp_path / "old", ["train", "--sizes", "8,10", "--epochs", "1", "--quiet"]
    assert main([*argv, "--checkpoint", str(old)]) == 0
    kept = _files(old)
    capsys.readouterr()
    assert main([*argv, "--checkpoint", str(old), "--resume", "--learning-rate", "0.01"]) == 2
    err = capsys.readouterr().err
    assert "init_from= is --init-from DIR" in err and "checkpoint=DIR is --checkpoint DIR" in err
    out = tmp_path / "run.json"
    assert (
        main([*argv, "--init-from", str(old), "--learning-rate", "0.01", "--json", str(out)]) == 0
    )
    assert json.loads(out.read_text())["step"] == 23 and _files(old) == kept


@pytest.mark.slow  # two short CLI runs and an export (3 s)
def test_the_cli_exports_a_checkpoints_weights_with_epochs_0(tmp_path):
    """`symjax-mlp train --init-from DIR --epochs 0 --export ART`: a checkpoint's weights shipped
    from the shell, as train(epochs=0, init_from=DIR).export(path) ships them (--epochs was an
    int >= 1, so the shell had to train one more epoch first)."""
    from safetensors.numpy import load_file

    import symjax_mlp as sm
    from symjax_mlp.cli import main

    old, art, argv = tmp_path / "old", tmp_path / "art", ["train", "--sizes", "8,10", "--quiet"]
    assert main([*argv, "--epochs", "1", "--checkpoint", str(old)]) == 0
    assert main([*argv, "--epochs", "0", "--init-from", str(old), "--export", str(art)]) == 0
    (state,) = old.glob("step_*/state.safetensors")
    saved = {k: v for k, v in load_file(state).items() if k.startswith("params/")}
    shipped = sm.load(art).params
    assert len(saved) == len(shipped) == 4
    for name, w in saved.items():  # the checkpoint's own names
        np.testing.assert_array_equal(np.asarray(shipped[name]), w)
