"""Round fifteen of a stranger's attacks (session 62): ``train(init_from=...)`` of a
multi-process run's Orbax checkpoint someone downloaded "to fine-tune from". Each is a whole,
self-consistent checkpoint: the step directory, Orbax's metadata, the zarr arrays in OCDBT and
our meta with its sha256 recomputed, so only the hostile part is wrong. Each way in that got
through has a test failing without its fix; each surface that held keeps one test. The rounds
before: test_stranger14.py, ..., test_checkpoint_stranger.py (links, FIFOs, gigabyte files,
Orbax's own metadata, zarr dtypes and shapes on resume: not repeated here)."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

import symjax_mlp as sm
from symjax_mlp.training._orbax import OrbaxCheckpoints, orbax_weights
from symjax_mlp.training._resume import init_run
from symjax_mlp.training._state import digest, named_leaves

# Orbax's restore, a few times a test (~1 s each); a failed read leaves futures of its event loop
# unretrieved (asyncio logs them when collected): Orbax's, not an error of ours
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]
pytest.importorskip("orbax.checkpoint")
DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
KERNEL = "params/layers_0/kernel"  # item 00001, (12, 8) float32


@pytest.fixture(autouse=True)
def _collected():
    yield
    gc.collect()  # Orbax's unretrieved futures go under this test's filter


def _state(opt=None, dtype=np.float32, model=(8, 2)) -> sm.training.TrainState:
    opt = opt or optax.adam(0.1)
    params = sm.mlp(model).init(jax.random.key(0), np.zeros((1, 12), np.float32))["params"]
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    return sm.training.TrainState(params, opt.init(params), jax.random.key(3), step=4)


def _save(directory, state):
    store = OrbaxCheckpoints(directory, timeout=30, sharding=DEVICE)
    path = store.save(state, {"config": {}, "history": []})
    store.close()
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A multi-process run's checkpoint (Orbax) of ``_state()`` (adam): its step directory."""
    return _save(tmp_path_factory.mktemp("orbax") / "ck", _state())


@pytest.fixture
def copy(saved, tmp_path):
    return shutil.copytree(saved, tmp_path / "ck" / saved.name)


def _weights(path, like=None):
    """init_from's read of ``path`` into a new run of sgd (the model's checks passed)."""
    return orbax_weights(path, like or _state(optax.sgd(0.1)), lambda found, metadata: None)


def _meta(path, edit=None, arrays=None, sha=None):
    """Rewrites the step's meta with ``edit``, its sha256 ``sha`` or over ``arrays`` (name: what
    the restore reads; the saved state's for the others), as a forger recomputes it."""
    file = path / "meta" / "metadata"
    meta = json.loads(file.read_text())
    if edit is not None:
        edit(meta)
    leaves = {n: np.asarray(a) for n, a in named_leaves(_state()).items()}
    tensors = {n: {**leaves, **(arrays or {})}[n] for n, _, _ in meta["tensors"]}
    meta["sha256"] = sha or digest(tensors)
    file.write_text(json.dumps(meta))


def _ocdbt(path):
    import tensorstore as ts

    return ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path / 'state'}/"}).result()


def _zarray(store, key, **changes):
    meta = json.loads(store.read(f"{key}/.zarray".encode()).result().value)
    store.write(f"{key}/.zarray".encode(), json.dumps({**meta, **changes}).encode()).result()


def _chunk(values):
    """The zarr chunk (zstd, as Orbax writes it) of ``values``: its bytes."""
    import tensorstore as ts

    spec = {
        "driver": "zarr",
        "kvstore": {"driver": "memory"},
        "create": True,
        "store_data_equal_to_fill_value": True,
        "metadata": {"shape": values.shape, "chunks": values.shape, "dtype": values.dtype.str,
                     "compressor": {"id": "zstd", "level": 1}},
    }  # fmt: skip
    array = ts.open(spec).result()
    array.write(values).result()
    return array.kvstore.read("0" if values.ndim == 1 else "0.0").result().value


# -- fixed: what init_from read of another run's optimizer ---------------------------------------
_UNDER_AS = """
import json, resource, sys
import jax, numpy as np, optax
import symjax_mlp as sm
from pathlib import Path
from symjax_mlp.training._orbax import orbax_weights
params = sm.mlp((8, 2)).init(jax.random.key(0), np.zeros((1, 12), np.float32))["params"]
like = sm.training.TrainState(params, optax.sgd(0.1).init(params), jax.random.key(3))
def status(field):  # this process's own: ru_maxrss keeps the parent's peak across exec
    lines = open("/proc/self/status").read().splitlines()
    return next(int(l.split()[1]) << 10 for l in lines if l.startswith(field + ":"))
vm, rss = status("VmSize"), status("VmRSS")
resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
try:
    orbax_weights(Path(sys.argv[1]), like, lambda found, metadata: None)
    said = "read"
except Exception as e:
    said = f"{type(e).__name__}: {e}"
print(json.dumps([said, status("VmHWM") - rss]))  # its peak resident memory, grown
"""


def test_init_from_an_orbax_step_declaring_256_mb_of_optimizer_state_reads_none_of_it(copy):
    """init_from reads another run's optimizer state for the sha256 alone, every tensor as its
    meta declares: 92 KB of zstd chunks of zeros declaring adam's mu a gigabyte took 20 s and
    3.5 GB (under RLIMIT_AS: 'its arrays cannot be read'); a few MB declare terabytes. Here a
    quarter of that, under RLIMIT_AS of 512 MiB more than the process holds."""
    rows = 1 << 16  # 2**26 float32: 256 MiB, in 64 chunks of 4 MiB of zeros
    name, zeros = "opt_state/0/mu/layers_0/kernel", _chunk(np.zeros((1024, 1024), np.float32))
    store = _ocdbt(copy)
    _zarray(store, "00006", shape=[rows, 1024], chunks=[1024, 1024])
    store.delete_range(_key_range(b"00006/0")).result()
    for i in range(rows // 1024):
        store.write(f"00006/{i}.0".encode(), zeros).result()

    def declare(meta):
        meta["tensors"][6][1] = [rows, 1024]

    sha = hashlib.sha256()  # digest()'s, of a gigabyte of zeros, streamed as a forger would
    for n, a in named_leaves(_state()).items():
        shape, a = ((rows, 1024), None) if n == name else (np.shape(a), np.asarray(a))
        sha.update(f"{n}|{shape}|{np.dtype(np.float32 if a is None else a.dtype)}|".encode())
        for _ in range(rows // 1024 if a is None else 1):
            sha.update(bytes(4 << 20) if a is None else a.tobytes())
    _meta(copy, declare, sha=sha.hexdigest())
    assert sum(f.stat().st_size for f in copy.rglob("*") if f.is_file()) < 1 << 20
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_UNDER_AS), str(copy)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said, grew = json.loads(done.stdout.splitlines()[-1])
    assert said.startswith(f"CheckpointError: {copy}: besides the params, it declares 9 tensors")
    assert "of 268,436,052 bytes of optimizer state, more than any optimizer keeps" in said
    assert "leave init_from out" in said and grew < 256 << 20, (said, grew)


def _key_range(prefix):
    import tensorstore as ts

    return ts.KvStore.KeyRange(prefix, prefix[:-1] + bytes([prefix[-1] + 1]))


def test_init_from_an_orbax_step_of_more_optimizer_tensors_than_any_optimizer_keeps(tmp_path):
    """A meta of tens of megabytes lists a million scalars, each an Orbax item read (a few
    hundred microseconds each): init_from read every one. 81 for 4 params and the rng, past
    16 times them, show the bound."""
    params = _state().params
    scalars = {f"s{i:03d}": jax.numpy.zeros(()) for i in range(81)}
    path = _save(tmp_path / "ck", sm.training.TrainState(params, scalars, jax.random.key(3), 4))
    with pytest.raises(sm.CheckpointError, match=r"it declares 81 tensors of 324 bytes of opt"):
        _weights(path)


@pytest.mark.parametrize("read", ["init_from", "resume"])
def test_a_value_orbax_takes_from_a_legacy_file_in_place_of_a_tensor_is_refused(copy, read):
    """Orbax reads ``state/checkpoint`` (its legacy msgpack tree) whenever it is there, and
    returns a value it holds in place of the array, as it is: a Python float 7.0 became the
    new run's (8,) bias, a scalar the model broadcast (the sha256, over the float, matched)."""
    from orbax.checkpoint import msgpack_utils

    leaves = {n: np.asarray(a) for n, a in named_leaves(_state()).items()}
    tree = {f"{i:05d}": leaves[n] for i, n in enumerate(leaves)}
    tree["00000"] = 7.0  # params/layers_0/bias
    (copy / "state" / "checkpoint").write_bytes(msgpack_utils.msgpack_serialize(tree))
    _meta(copy, arrays={"params/layers_0/bias": np.asarray(7.0)})
    with pytest.raises(sm.CheckpointError) as e:
        if read == "init_from":
            _weights(copy)
        else:
            store = OrbaxCheckpoints(copy.parent, timeout=30, sharding=DEVICE)
            try:
                store.restore(copy, _state())
            finally:
                store.close()
    said = "its tensor params/layers_0/bias was read as a float 7.0, not as the (8,) float32 its"
    assert said in str(e.value), str(e.value)


# -- held: one test per surface -----------------------------------------------------------------
def _inflating(path):
    """The kernel's chunk is 4 MiB of zeros in 150 bytes, where its (12, 8) float32 are 384."""
    _ocdbt(path).write(b"00001/0.0", _chunk(np.zeros((1024, 1024), np.float32))).result()


def _one_element_chunks(path):
    """The kernel in 96 chunks of one element, each compressed (read as the saved one)."""
    store, kernel = _ocdbt(path), np.asarray(named_leaves(_state())[KERNEL])
    _zarray(store, "00001", chunks=[1, 1])
    for (i, j), v in np.ndenumerate(kernel):
        store.write(f"00001/{i}.{j}".encode(), _chunk(np.full((1, 1), v))).result()


def _nan_chunk(path):
    """The kernel's chunk of NaNs (a forger's NaN fill value, written), the sha256 over them."""
    nan = np.full((12, 8), np.nan, np.float32)
    _ocdbt(path).write(b"00001/0.0", _chunk(nan)).result()
    _meta(path, arrays={KERNEL: nan})


def _declared(dtype):
    def declare(path):
        _meta(path, lambda meta: meta["tensors"][6].__setitem__(2, dtype))  # adam's mu

    return declare


@pytest.mark.parametrize(
    ("forge", "says"),
    [
        (_inflating, "its arrays cannot be read"),
        (_one_element_chunks, None),
        (_nan_chunk, r"its params hold nan \(params/layers_0/kernel\)"),
        (_declared("O"), r"its arrays cannot be read \(ValueError: .*Unsupported data type"),
        (_declared("[('a', '<f4')]"), "declares a tensor no array can be"),
        (_declared("V4"), "its arrays cannot be read"),
    ],
    ids=[
        "a zstd chunk inflating 10000x",
        "chunks of one element",
        "NaN where a param is",
        "an object dtype",
        "a structured dtype",
        "a void dtype",
    ],
)
def test_held_zarr_chunks_that_inflate_split_hold_nan_or_declare_objects(copy, forge, says):
    """TensorStore refuses a chunk decoding to more than its shape; a checkpoint in chunks of
    one element reads as saved (its reads bounded by the model's shape, or by init_from's bound
    on the optimizer's state); NaN params are refused by init_from's check of them; NumPy's
    object, structured or void dtypes declared are no array Orbax reads."""
    forge(copy)
    if says is None:
        got = _weights(copy).params["layers_0"]["kernel"]
        assert np.array_equal(got, named_leaves(_state())[KERNEL])
        return
    with pytest.raises(sm.CheckpointError, match=says) as e:
        init_run(copy, _state(optax.sgd(0.1)), {})  # init_from's whole check (the model's: {})
    assert str(copy) in str(e.value)


def _duplicate_sha(text):  # the arrays' sha256 first, then a forged one: the last is read
    good = json.loads(text)["sha256"]
    return text.replace(f'"sha256": "{good}"', f'"sha256": "{good}", "sha256": "{"0" * 64}"')


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda t: "[" * 10**5 + "]" * 10**5, r"missing or malformed \(RecursionError"),
        (lambda t: t.replace('"step": 4', '"step": NaN'), r"field\(s\) step are missing"),
        (_duplicate_sha, "their sha256 differs"),
        (None, "is 100,000,000 bytes, more than a save writes"),
    ],
    ids=["nested 10**5 deep", "a NaN literal", "duplicate keys", "100 MB"],
)
def test_held_a_meta_nested_deep_of_100_mb_with_nan_or_duplicate_keys(copy, edit, says):
    """One parser reads the meta (Python's json, in Orbax's JsonRestore and ours alike): a
    duplicate key's last value is the one checked and used; its size is bounded first."""
    file = copy / "meta" / "metadata"
    if edit is None:
        with open(file, "r+b") as f:  # sparse
            f.truncate(100_000_000)
    else:
        file.write_text(edit(file.read_text()))
    with pytest.raises(sm.CheckpointError, match=says):
        _weights(copy)


def test_held_init_from_maps_weights_by_path_and_refuses_other_paths_or_dtypes(tmp_path):
    """A checkpoint of another model whose shapes all match but whose paths differ, or of this
    one in float64 or int32, is refused naming the tensors (never read by position: a silent
    wrong start); two paths of one shape each get their own weights."""
    two = {"a": jax.numpy.full((8,), 1.0), "b": jax.numpy.full((8,), 2.0)}
    path = _save(tmp_path / "two", sm.training.TrainState(two, (), jax.random.key(3), step=4))
    zero = jax.tree.map(np.zeros_like, two)
    like = sm.training.TrainState(zero, (), jax.random.key(0))
    assert jax.tree.map(np.array_equal, _weights(path, like).params, two) == {"a": True, "b": True}
    renamed = sm.training.TrainState({"b": zero["a"], "c": zero["b"]}, (), jax.random.key(0))
    with pytest.raises(sm.CheckpointError, match=r"missing tensors \['params/c'\], unexpected"):
        _weights(path, renamed)
    for dtype in (np.float64, np.int32):
        with jax.enable_x64(dtype == np.float64):
            path = _save(tmp_path / np.dtype(dtype).name, _state(dtype=dtype))
        with pytest.raises(sm.CheckpointError, match=f"dtype {np.dtype(dtype)}, but this model"):
            _weights(path)


def test_held_orbax_chooses_no_code_a_checkpoint_names(copy):
    """Orbax finds an item's handler by the name its step's metadata records only when a
    restore names no items (ours name theirs, from our own registry), and its tree's value
    types by the targets we give (its tree's value_type unread): a step naming a module to
    import for its items, an item of its own and its arrays' type reads as saved, importing
    nothing. No pickle anywhere; its msgpack file: test_a_value_orbax_takes_from_a_legacy_file."""
    file = copy / "_CHECKPOINT_METADATA"
    meta = json.loads(file.read_text())
    meta["item_handlers"] = {"state": "evil_p62g.Handler", "evil": "evil_p62g.Handler"}
    file.write_text(json.dumps(meta))
    (copy / "evil").mkdir()
    (copy / "evil" / "_METADATA").write_text('{"tree_metadata": {}}')
    tree = copy / "state" / "_METADATA"
    tree.write_text(tree.read_text().replace('"jax.Array"', '"evil_p62g.Array"'))
    got = _weights(copy)
    assert np.array_equal(got.params["layers_0"]["kernel"], named_leaves(_state())[KERNEL])
    assert not [m for m in sys.modules if m.startswith("evil_p62g")]
    assert os.listdir(copy / "evil") == ["_METADATA"]


# -- found on the way -----------------------------------------------------------------------
def test_an_orbax_save_under_jax_enable_x64_keeps_the_float64_state(tmp_path):
    """``with jax.enable_x64(True):`` is one thread's setting, and Orbax's saves are made on a
    writer thread: a float64 run's checkpoint held float32 (1 + 2**-40 written as 1.0), its
    sha256 over those, and its resume was refused as a checkpoint of another dtype."""
    with jax.enable_x64(True):
        params = {"w": jax.numpy.full((3,), 1 + 2**-40, jax.numpy.float64)}
        state = sm.training.TrainState(params, (), jax.random.key(0), step=1)
        path = _save(tmp_path / "ck", state)
        store = OrbaxCheckpoints(path.parent, timeout=30, sharding=DEVICE)
        try:
            got, _ = store.restore(path, state)
        finally:
            store.close()
    w = np.asarray(got.params["w"])
    assert w.dtype == np.float64 and w[0] == 1 + 2**-40


# -- part J: a checkpoint folder a stranger can still write ------------------------------------
def _refused_for_others(path, says):
    with pytest.raises(sm.CheckpointError) as e:
        init_run(path, _state(optax.sgd(0.1)), {})
    said = str(e.value)
    assert f"is not yours alone: {says}" in said, said
    assert "cp -r" in said and "start from the copy (init_from=" in said, said  # what to do


def test_init_from_an_orbax_checkpoint_others_may_write_is_refused_before_orbax_opens_it(copy):
    """Orbax (TensorStore) opens a step's files by their names seconds after ``check_files``
    passed them: whoever may write the step's folders (a shared lab folder, a download folder
    others write) swaps one for a FIFO in between, and init_from hung for ever. A folder others
    may write, in the checkpoint or above it, or a file of another user's, is refused before
    Orbax reads anything; a resume reads the run's own folder, where its user chose to write."""
    directory = copy.parent
    for folder in (copy / "state" / "ocdbt.process_0" / "d", directory):
        folder.chmod(0o777)
        _refused_for_others(directory, f"others may write in {folder} (mode 777)")
        _refused_for_others(copy, f"others may write in {folder} (mode 777)")  # its step alone
        folder.chmod(0o755)
    if os.geteuid() == 0:  # (CI runs as root) a file of another user's: it may write it
        os.chown(copy / "_CHECKPOINT_METADATA", 65534, 65534)
        _refused_for_others(directory, f"{copy}/_CHECKPOINT_METADATA belongs to user id 65534")
        os.chown(copy / "_CHECKPOINT_METADATA", 0, 0)
    assert _weights(copy).step == 0  # the same files, now the user's alone
    directory.chmod(0o777)
    store = OrbaxCheckpoints(directory, timeout=30, sharding=DEVICE)
    try:
        assert store.restore(copy, _state())[0].step == 4  # a resume: the run's own folder
    finally:
        store.close()


_FIFO_INIT_FROM = """
import os, shutil, sys
import jax, numpy as np, optax
import symjax_mlp as sm
from symjax_mlp.training._resume import init_run

params = {"w": np.arange(3.0, dtype=np.float32)}
state = sm.training.TrainState(params, optax.adam(0.1).init(params), jax.random.key(0), step=3)
path = sm.training.save_checkpoint(os.path.join(sys.argv[1], "ck"), state)
for name in ("manifest.json", "state.safetensors"):
    fifo = os.path.join(sys.argv[1], name, path.name)
    shutil.copytree(path, fifo)
    os.unlink(os.path.join(fifo, name))
    os.mkfifo(os.path.join(fifo, name))
    try:
        init_run(fifo, state, {})
    except sm.CheckpointError as e:
        print(e)
"""


def test_held_init_from_of_our_own_checkpoint_with_a_fifo_in_place_of_a_file(tmp_path):
    """A one-process run's checkpoint is read file by file, each opened once with O_NOFOLLOW |
    O_NONBLOCK, checked by fstat and read up to the size fstat gave (one byte more is 'changed
    while it was read'): a FIFO swapped in after any check is refused at once, never waited on."""
    done = subprocess.run([sys.executable, "-c", _FIFO_INIT_FROM, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    said = done.stdout.splitlines()
    assert len(said) == 2, done.stdout + done.stderr[-2000:]
    for line, name in zip(said, ("manifest.json", "state.safetensors"), strict=True):
        assert f"{name}/step_00000003/{name}" in line and "Resume from" not in line, line
        assert "is not a regular file (a directory, FIFO or device); nothing was read" in line


def test_init_from_of_a_broken_checkpoint_says_to_start_from_another_not_to_resume(copy, tmp_path):
    """``broken()``'s fix was a resume's ('Resume from an older checkpoint ... or start over in
    an empty directory'), said by init_from's refusals too: a new run starts from another
    checkpoint, or from the model's own initialisation, and has no older one of its own."""
    meta = copy / "meta" / "metadata"
    meta.write_text(meta.read_text()[:-5])
    with pytest.raises(sm.CheckpointError) as e:
        init_run(copy, _state(optax.sgd(0.1)), {})
    said = str(e.value)
    assert "its meta item is missing or malformed" in said and "Resume" not in said, said
    assert said.endswith("or leave init_from out to train from the model's own initialisation.")
    params = {"w": np.arange(3.0, dtype=np.float32)}
    state = sm.training.TrainState(params, (), jax.random.key(0), step=3)
    path = sm.training.save_checkpoint(tmp_path / "own", state)
    with open(path / "state.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 1)
    with pytest.raises(sm.CheckpointError, match="Start from another checkpoint") as e:
        init_run(path, state, {})
    assert "Resume" not in str(e.value), e.value
