"""Round thirteen of a stranger's attacks (session 61): whole, self-consistent inputs on surfaces
no round reached. JAX's persistent compilation cache (``jax_compilation_cache_dir``,
JAX_COMPILATION_CACHE_DIR): an entry is a serialized executable, native code that XLA runs as
the program whose cache key names it. Then two processes exporting to one path at once, and an
Orbax step's sharding file. Each way in that got through has a test failing without its fix;
each surface that held keeps one test showing it. The rounds before: test_stranger12.py,
test_stranger11.py, ..., test_security.py, test_checker_limits.py."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import symjax_mlp as sm

X = np.ones((1, 8), np.float32)
X3 = np.ones((3, 8), np.float32)

# one process of JAX with the cache at argv[2]: load argv[1], call it on (3, 8) ones; prints the
# answer and which cache entries the call wrote (a new signature: the program JAX compiles)
_RUN = """
import json, os, sys
import numpy as np, symjax_mlp as sm
folder, seen = sys.argv[2], set(os.listdir(sys.argv[2]))
m = sm.load(sys.argv[1])
before = set(os.listdir(folder))
y = np.asarray(m(np.ones((3, 8), np.float32)))
print(json.dumps({"y": y.tolist(), "new": sorted(set(os.listdir(folder)) - before)}))
"""


def _artifacts(tmp_path):
    """The victim (the chapter's ReLU MLP) and the stranger's program of the same signature
    (the same layers, no ReLU): two artifacts, and the victim's true answer."""
    out = {}
    for name, activation in (("victim", "relu"), ("stranger", None)):
        net = sm.mlp((4, 2), activation=activation)
        h = sm.hybridize(net, net.init(jax.random.key(0), jnp.asarray(X)))
        out[name] = sm.export(h, tmp_path / name, example=X).path
        out[name + "_y"] = np.asarray(h(X3))
    return out


@contextlib.contextmanager
def _cache_at(folder):
    """JAX's compilation cache set to ``folder`` in this process, then as it was. JAX settled
    at the process's first compilation whether it uses a cache: the folder is checked, not read."""
    jax.block_until_ready(jax.jit(lambda v: v + 1)(1.0))
    old = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    try:
        jax.config.update("jax_enable_compilation_cache", True)  # (CI's slow run turns it off)
        jax.config.update("jax_compilation_cache_dir", str(folder))
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", old[0])
        jax.config.update("jax_enable_compilation_cache", old[1])


def _run(art, cache, **env):
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache), **env}
    env["JAX_ENABLE_COMPILATION_CACHE"] = "true"  # (CI runs the slow tests with it off)
    r = subprocess.run(
        [sys.executable, "-c", _RUN, str(art), str(cache)],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    return r, (json.loads(r.stdout.splitlines()[-1]) if r.returncode == 0 else None)


@pytest.mark.slow  # five fresh processes (~20 s)
def test_a_compilation_cache_others_may_write_is_never_read(tmp_path):
    """JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache, a folder every user may write (as /tmp
    guides suggest): a stranger who ran the victim's public artifact under the same JAX knows
    the cache key of its program, and puts there the executable of a program of their own with
    the same signature. ``load`` checked the artifact (hash, ops, self-test on its own
    vectors) and then ran the stranger's native code as the model: a silent wrong answer for
    every new input shape. It is refused at load now, naming the folder and what to do."""
    made = _artifacts(tmp_path)
    cache = tmp_path / "jax_cache"
    cache.mkdir(mode=0o700)
    keys = {}
    for name in ("stranger", "victim"):  # the stranger learns both keys under the same path
        r, got = _run(made[name], cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        assert got is not None, r.stderr[-2000:]
        np.testing.assert_allclose(got["y"], made[name + "_y"], rtol=1e-5)
        (keys[name],) = [k for k in got["new"] if k.startswith("jit_call")]
    assert not np.allclose(made["victim_y"], made["stranger_y"])  # the plant would show
    (cache / keys["victim"]).write_bytes((cache / keys["stranger"]).read_bytes())
    cache.chmod(0o777)  # the folder anyone may write, where that entry was put

    r, got = _run(made["victim"], cache)
    assert got is None, f"the planted executable ran as the model: {got}"
    assert "ConfigError" in r.stderr and "jax_compilation_cache_dir" in r.stderr, r.stderr[-2000:]
    assert f"others may write in {cache} (mode 777)" in r.stderr
    assert "JAX_COMPILATION_CACHE_DIR" in r.stderr.splitlines()[-1]  # what to do

    shared = tmp_path / "shared"  # a private cache inside a folder others may write: swappable
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    (shared / "cache").mkdir(mode=0o700)
    r, got = _run(made["victim"], shared / "cache")
    assert got is None and f"others may write in {shared} (mode 777)" in r.stderr, r.stderr


@pytest.mark.slow  # two fresh processes (~8 s)
def test_a_damaged_entry_in_ones_own_cache_is_compiled_again(tmp_path):
    """Held: entries cut short (a writer killed, another process writing them) or bytes that
    are no executable (a whole zlib stream and time header over random bytes), in one's own
    private cache: JAX warns and compiles again, no crash, the model's own answer."""
    made = _artifacts(tmp_path)
    cache = tmp_path / "jax_cache"
    cache.mkdir(mode=0o700)
    r, got = _run(made["victim"], cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    assert got is not None, r.stderr[-2000:]
    for i, entry in enumerate(sorted(cache.glob("jit_*-cache"))):
        raw = entry.read_bytes()
        exe = np.random.default_rng(i).bytes(len(zlib.decompress(raw)) - 4)
        entry.write_bytes(raw[: len(raw) // 2] if i % 2 else zlib.compress(bytes(4) + exe))
    r, got = _run(made["victim"], cache)
    assert got is not None, r.stderr[-2000:]
    np.testing.assert_allclose(got["y"], made["victim_y"], rtol=1e-5)
    assert "Error reading persistent compilation cache entry" in r.stderr


@pytest.mark.slow  # an export (~0.6 s)
def test_a_private_cache_below_a_sticky_folder_such_as_tmp_loads(tmp_path):
    """Held (no false alarm): a cache folder of one's own (0700, made by load if missing) in a
    folder every user may write but not rename in (sticky, as /tmp); while one others may write
    is refused in this process too."""
    net = sm.mlp((2,))
    h = sm.hybridize(net, net.init(jax.random.key(0), jnp.asarray(X)))
    art = sm.export(h, tmp_path / "m", example=X).path
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    with _cache_at(sticky / "jax_cache"):
        assert sm.load(art)(X).shape == (1, 2)
        assert oct((sticky / "jax_cache").stat().st_mode & 0o777) == oct(0o700)
        (sticky / "jax_cache").chmod(0o707)
        with pytest.raises(sm.ConfigError, match=r"others may write in .*jax_cache \(mode 707\)"):
            sm.load(art)


# one process: waits for argv[2] to appear, then exports the chapter's MLP of seed argv[1] once
# to art0 (no overwrite), then three times to art1 (overwrite); prints what it made and refused
_EXPORT = """
import json, os, sys, time
import jax, jax.numpy as jnp, symjax_mlp as sm
net, x, go = sm.mlp((4, 2)), jnp.ones((1, 8)), sys.argv[2]
h = sm.hybridize(net, net.init(jax.random.key(int(sys.argv[1])), x))
while not os.path.exists(go):
    time.sleep(0.001)
made, refused = [0, 0], []
for i, n in enumerate((1, 3)):
    for _ in range(n):
        try:
            sm.export(h, os.path.join(os.path.dirname(go), f"art{i}"), example=x, overwrite=i == 1)
            made[i] += 1
        except sm.ArtifactError as e:
            refused.append(str(e))
print(json.dumps([made, refused]))
"""


@pytest.mark.slow  # two fresh processes at once (~15 s on 2 cores)
def test_two_processes_exporting_to_one_path_at_once_leave_one_whole_artifact(tmp_path):
    """Held: two processes export to the same path at the same moment. Without overwrite, one
    export is made and the other refused ("already exists"), never two half-artifacts mixed;
    with overwrite, the last rename wins and what is left loads whole (its self-test passes)
    and answers as one of the two models; no temporary sibling is left behind."""
    answers = []
    for seed in (0, 1):
        net = sm.mlp((4, 2))
        answers.append(sm.hybridize(net, net.init(jax.random.key(seed), jnp.asarray(X)))(X))
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _EXPORT, str(seed), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (0, 1)
    ]
    go.touch()
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    (made0, refused0), (made1, refused1) = (json.loads(o) for o, _ in outs)
    assert sorted([made0[0], made1[0]]) == [0, 1] and made0[1] == made1[1] == 3, outs
    (refusal,) = refused0 + refused1
    assert "art0 already exists; export does not replace it silently" in refusal
    for art in ("art0", "art1"):
        y = np.asarray(sm.load(tmp_path / art)(X))
        assert any(np.allclose(y, a, rtol=1e-6) for a in answers), (y, answers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art0", "art1", "go"]


def test_training_refuses_a_compilation_cache_others_may_write_before_any_step(tmp_path):
    """The same cache under ``symjax-mlp train`` and ``sm.training.train``: a planted
    executable of the training step would run as the step (the weights it returns, native
    code), as the model's did under load. Refused before any step, in the same words."""
    from symjax_mlp import training

    shared = tmp_path / "jax_cache"
    shared.mkdir()
    shared.chmod(0o777)
    with _cache_at(shared), pytest.raises(sm.ConfigError, match=r"^symjax_mlp.training.train: "):
        training.train(epochs=1, checkpoint=str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow  # an Orbax save and two restores (~3 s)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Orbax's futures
def test_an_orbax_steps_sharding_file_naming_devices_that_do_not_exist_is_not_followed(tmp_path):
    """Held: a multi-process run's Orbax step whose ``state/_sharding`` names a device this
    machine lacks (a TPU core 977), or is no JSON at all: the restore places the arrays by the
    run's own sharding, never by the file's, and reads the same weights."""
    import optax

    from symjax_mlp.training._orbax import OrbaxCheckpoints

    here = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = sm.mlp((8, 2)).init(jax.random.key(0), np.zeros((1, 12), np.float32))["params"]
    state = sm.training.TrainState(params, optax.sgd(0.1).init(params), jax.random.key(3), step=4)
    store = OrbaxCheckpoints(tmp_path / "ck", timeout=30, sharding=here)
    step = store.save(state, {"config": {}, "history": []})
    store.close()
    sharding = step / "state" / "_sharding"
    assert "cpu:0" in sharding.read_text()
    for text in (sharding.read_text().replace("cpu:0", "tpu:977"), "{" * 100_000):
        sharding.write_text(text)
        store = OrbaxCheckpoints(tmp_path / "ck", timeout=30, sharding=here)
        try:
            got, _ = store.restore(store.latest(), state)
        finally:
            store.close()
        for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(params), strict=True):
            np.testing.assert_array_equal(a, b)
            assert a.sharding == here


@pytest.mark.slow  # an export and two runs (~2 s)
@pytest.mark.skipif(getattr(os, "geteuid", lambda: 1)() != 0, reason="plants another user's link")
def test_run_does_not_follow_a_link_another_user_planted_in_a_sticky_folder(tmp_path, capsys):
    """``symjax-mlp run ... --output /tmp/y.npy`` where another user made /tmp/y.npy a link to
    one of your files: run followed it (realpath, then a sibling renamed over the target), so
    the file the link named was replaced with .npy bytes, silently, even where the kernel's
    protected_symlinks refuses np.save's plain open of that link. Refused now, naming the link
    and its owner; the file is untouched. A link of one's own is followed, as before."""
    from symjax_mlp.cli import main

    net = sm.mlp((2,))
    h = sm.hybridize(net, net.init(jax.random.key(0), jnp.asarray(X)))
    art = sm.export(h, tmp_path / "m", example=X).path
    np.save(tmp_path / "x.npy", X)
    sticky, mine = tmp_path / "tmp", tmp_path / "precious.txt"
    sticky.mkdir()
    sticky.chmod(0o1777)
    mine.write_text("precious")
    (sticky / "y.npy").symlink_to(mine)
    os.chown(sticky / "y.npy", 65534, 65534, follow_symlinks=False)  # nobody's link
    run = ["run", str(art), "--input", str(tmp_path / "x.npy"), "--output"]
    assert main([*run, str(sticky / "y.npy")]) == 2
    err = capsys.readouterr().err
    assert f"{sticky / 'y.npy'} is a link that user id 65534 made in a folder anyone may" in err
    assert mine.read_text() == "precious" and os.listdir(sticky) == ["y.npy"]
    (sticky / "own.npy").symlink_to(mine)  # this user's own link in the same folder
    assert main([*run, str(sticky / "own.npy")]) == 0
    np.testing.assert_allclose(np.load(mine), h(X), rtol=1e-6)


# Session 61, part H: what part C left open


@pytest.mark.slow  # six refusals, one compile (~4 s)
def test_hybrids_exports_batchers_and_sharded_steps_refuse_a_cache_others_may_write(tmp_path):
    """Beyond load and train, every compilation of ours read the shared cache unchecked: a
    Hybrid's first call (h(x), h.compile), DataParallel, export's self-test (its vectors are
    what load checks later), a Batcher's warm-up, shard_step. A planted entry there would
    silently change h(x). Each is refused where it first compiles, naming the folder; the
    Hybrid made before the folder changed is refused too (the check runs at its trace)."""
    from symjax_mlp import serving, training

    net = sm.mlp((2,))
    params = net.init(jax.random.key(0), jnp.asarray(X))
    h = sm.hybridize(net, params)
    shared = tmp_path / "jax_cache"
    shared.mkdir()
    shared.chmod(0o777)
    why = rf"JAX's compilation cache, .*others may write in {shared} \(mode 777\)"
    with _cache_at(shared):
        cases = {
            "h(x)": lambda: h(X),
            "compile": lambda: sm.hybridize(net, params).compile(X),
            "shard": lambda: sm.shard(sm.hybridize(net, params))(X),
            "export": lambda: sm.export(h, tmp_path / "m", example=X),
            "batcher": lambda: serving.Batcher(lambda v: v + 1, example=X),
            "shard_step": lambda: training.shard_step(lambda p, o, x, y, w: (p, o, 0.0)),
        }
        for what, call in cases.items():
            with pytest.raises(sm.ConfigError, match=why):
                call()
            assert not (tmp_path / "m").exists(), what
    np.testing.assert_allclose(h(X), net.apply(params, X), rtol=1e-6)  # its own folder again


def _planted_ck(tmp_path):
    """``(sticky, theirs)``: a folder anyone may write (sticky, as /tmp) holding ``ck``, a link
    that user nobody (65534) made to ``theirs``, an empty folder."""
    sticky, theirs = tmp_path / "tmp", tmp_path / "theirs"
    sticky.mkdir()
    sticky.chmod(0o1777)
    theirs.mkdir()
    (sticky / "ck").symlink_to(theirs)
    os.chown(sticky / "ck", 65534, 65534, follow_symlinks=False)  # nobody's link
    return sticky, theirs


@pytest.mark.skipif(getattr(os, "geteuid", lambda: 1)() != 0, reason="plants another user's link")
def test_checkpoints_do_not_follow_a_link_another_user_planted_in_a_sticky_folder(tmp_path):
    """``save_checkpoint("/tmp/ck", ...)`` or ``train(checkpoint="/tmp/ck")`` (multi-process
    runs: Orbax's directory, resolved) where another user made /tmp/ck a link to a folder of
    their choosing: ours wrote the run's weights there, and pruned (keep=) the step_* folders
    it found there. Refused now, naming the link and its owner, before any step; nothing is
    written where it leads. A link of one's own is followed, as before."""
    import optax

    from symjax_mlp import training

    sticky, theirs = _planted_ck(tmp_path)
    p = {"w": jnp.zeros(2)}
    state = training.TrainState(p, optax.sgd(0.1).init(p), jax.random.key(0), step=3)
    planted = rf"{sticky / 'ck'} is a link that user id 65534 made in a folder anyone may write"
    with pytest.raises(sm.CheckpointError, match=planted):
        training.save_checkpoint(sticky / "ck", state)
    with pytest.raises(sm.CheckpointError, match=rf"^symjax_mlp.training.train: .*{planted}"):
        training.train(epochs=1, checkpoint=str(sticky / "ck"))
    assert os.listdir(theirs) == []
    (sticky / "own").symlink_to(theirs)  # this user's own link in the same folder
    assert training.save_checkpoint(sticky / "own", state).parent == sticky / "own"
    assert os.listdir(theirs) == ["step_00000003"]


# one process started with JAX's cache at argv[2] (shared): a first computation (JAX opens that
# folder), load argv[1] refused; the cache set to argv[3], private, as the refusal says; load
# again and call on (3, 8) ones: prints the answer
_SWITCH = """
import json, sys
import jax, numpy as np, symjax_mlp as sm
jax.block_until_ready(jax.numpy.ones(3) * 2)
try:
    sm.load(sys.argv[1])
    raise SystemExit("not refused")
except sm.ConfigError:
    pass
jax.config.update("jax_compilation_cache_dir", sys.argv[3])
y = np.asarray(sm.load(sys.argv[1])(np.ones((3, 8), np.float32)))
print(json.dumps({"y": y.tolist()}))
"""


@pytest.mark.slow  # three fresh processes (~12 s)
def test_a_cache_folder_changed_after_jax_opened_one_is_the_one_read(tmp_path):
    """JAX opens its cache folder at the process's first compilation and keeps it, whatever is
    set since. A notebook started with JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache ran a
    computation, load refused that cache, the user pointed jax_compilation_cache_dir at a
    private folder as the refusal says: load checked the new folder and passed, and JAX read
    the shared one, running the stranger's planted executable as the model, silently (its key
    names the folder set: a guessable one, as $HOME/.cache/jax, the refusal's example). Now JAX
    is made to open the folder checked (its public reset_cache): the model's own answer."""
    made = _artifacts(tmp_path)
    shared, private = tmp_path / "jax_cache", tmp_path / "mine"
    private.mkdir(mode=0o700)
    keys = {}  # a key names the folder set (XLA's autotune cache below it): the private one
    for name in ("stranger", "victim"):
        r, got = _run(made[name], private, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        assert got is not None, r.stderr[-2000:]
        (keys[name],) = [k for k in got["new"] if k.startswith("jit_call")]
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    (shared / keys["victim"]).write_bytes((private / keys["stranger"]).read_bytes())
    for entry in private.iterdir():
        entry.unlink()
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(shared)}
    env["JAX_ENABLE_COMPILATION_CACHE"] = "true"  # (CI runs the slow tests with it off)
    r = subprocess.run(
        [sys.executable, "-c", _SWITCH, str(made["victim"]), str(shared), str(private)],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    y = json.loads(r.stdout.splitlines()[-1])["y"]
    assert not np.allclose(y, made["stranger_y"]), "the planted executable ran as the model"
    np.testing.assert_allclose(y, made["victim_y"], rtol=1e-5)


@pytest.mark.slow  # Orbax's import (~1 s)
@pytest.mark.skipif(getattr(os, "geteuid", lambda: 1)() != 0, reason="plants another user's link")
def test_orbaxs_store_refuses_a_link_planted_after_trains_check(tmp_path):
    """A multi-process train(checkpoint="/tmp/ck") checked /tmp/ck before it compiled and agreed
    with the other processes (seconds, minutes for a large model), then made it where Orbax
    writes: another user who made /tmp/ck a link in between had every process's checkpoints
    written, and pruned, in their folder. The store refuses the link where it makes the
    directory, naming it and its owner; their folder stays empty."""
    from symjax_mlp.training._orbax import OrbaxCheckpoints

    sticky, theirs = _planted_ck(tmp_path)
    here = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(sm.CheckpointError, match=r"ck is a link that user id 65534 made"):
        OrbaxCheckpoints(sticky / "ck", timeout=30, sharding=here)
    assert os.listdir(theirs) == []


@pytest.mark.slow  # a Batcher, three refusals (~1.2 s)
def test_a_cache_folder_made_others_after_its_first_check_is_refused_at_the_next_compile(
    tmp_path,
):
    """A private cache, checked when a Hybrid first traced (and a Batcher, a shard_step, an
    export were made), then ``chmod o+w`` (a shared-machine setup script, a teammate's
    ``chmod -R``): the check had passed once for that folder in this process, so a Hybrid's
    new shape, a new Batcher and a new shard_step read and wrote executables there unchecked
    (load and train check each time). Each compilation checks again now; ``h(x)`` of a shape
    already compiled runs no check (its trace is not run)."""
    from symjax_mlp import serving, training

    h = sm.hybridize(lambda p, x: x * p["w"], {"w": jnp.ones(8)})
    folder = tmp_path / "jax_cache"
    folder.mkdir(mode=0o700)
    with _cache_at(folder):
        h(X)
        serving.Batcher(lambda v: v + 1, example=X).close()
        folder.chmod(0o777)
        np.testing.assert_allclose(h(X), X)  # compiled before: nothing read from the cache
        why = rf"JAX's compilation cache, .*others may write in {folder} \(mode 777\)"
        for call in (
            lambda: h(X3),
            lambda: serving.Batcher(lambda v: v + 2, example=X),
            lambda: training.shard_step(lambda p, o, x, y, w: (p, o, 0.0)),
        ):
            with pytest.raises(sm.ConfigError, match=why):
                call()


def test_files_xla_reads_kernels_or_autotuning_back_from_are_checked_as_the_cache(
    tmp_path, monkeypatch
):
    """``XLA_FLAGS=--xla_gpu_kernel_cache_file=/tmp/kernels`` (or an autotuning cache, a PTX
    file in place of XLA's own): XLA reads compiled kernels, or which kernel each fusion runs,
    back from there; a folder anyone may write was read unchecked, as JAX's own cache was.
    Refused as that cache is, naming the flag; so is JAX's autotuning folder inside a private
    cache made others'. A flag XLA only writes to (``--xla_dump_to``) is not checked."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    flags = os.environ.get("XLA_FLAGS", "")
    h = sm.hybridize(lambda p, x: x * p["w"], {"w": jnp.ones(8)})
    monkeypatch.setenv("XLA_FLAGS", f"{flags} --xla_dump_to={shared}/dump")
    np.testing.assert_allclose(h(X), X)
    for flag in ("xla_gpu_kernel_cache_file", "xla_gpu_per_fusion_autotune_cache_dir"):
        monkeypatch.setenv("XLA_FLAGS", f"{flags} --{flag}={shared}/k")
        with pytest.raises(sm.ConfigError, match=rf"XLA_FLAGS' --{flag}='{shared}/k'.*777"):
            h(np.ones((4, 8), np.float32))
    monkeypatch.setenv("XLA_FLAGS", flags)

    folder = tmp_path / "jax_cache"
    folder.mkdir(mode=0o755)
    (folder / "xla_gpu_per_fusion_autotune_cache_dir").mkdir(mode=0o777)
    (folder / "xla_gpu_per_fusion_autotune_cache_dir").chmod(0o777)
    with _cache_at(folder), pytest.raises(sm.ConfigError, match=r"JAX's cache, as --xla_gpu_"):
        h(np.ones((5, 8), np.float32))


def test_a_remote_cache_that_cannot_be_checked_is_warned_of_once(monkeypatch):
    """``jax_compilation_cache_dir=gs://bucket/jax``: whether others may write in a bucket
    cannot be checked from here, and it was trusted in silence. A warning, once per process
    per cache, says so (a team's cache of a TPU pod is JAX's own advice: not refused)."""
    from symjax_mlp._cache import refuse_shared_cache

    old = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    try:
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", "gs://bucket-a/jax")
        with pytest.warns(UserWarning, match=r"'gs://bucket-a/jax', is remote: whether others"):
            refuse_shared_cache("h")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            refuse_shared_cache("h")  # once
    finally:
        jax.config.update("jax_compilation_cache_dir", old[0])
        jax.config.update("jax_enable_compilation_cache", old[1])
        refuse_shared_cache("h")  # JAX opens the cache it had at its next compilation
