"""Real resource limits, set in child processes (never in the test process): a file-size limit
(RLIMIT_FSIZE: a write past it fails with EFBIG, as CPython ignores SIGXFSZ), a full or
read-only filesystem, no file descriptors left (RLIMIT_NOFILE), too little address space
(RLIMIT_AS). Each says which file, which limit and what to do; nothing half written is left
where a reader would take it; what was there before still loads, and a resume still works.

tests/test_crash_safety.py kills writers; tests/test_faults.py runs XLA out of memory at
load and at a call; the ENOSPC tests of tests/test_cli.py and tests/test_train_hostile.py
raise it from the write seam. These limits are the system's own.
"""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import symjax_mlp as sm

POSIX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's rlimits")


def _child(code: str, *args: str, timeout: float = 60) -> dict:
    """Runs ``code`` (which prints one JSON line last) in a new Python; its answer."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


_FSIZE = """
import json, os, resource, sys
from pathlib import Path
from symjax_mlp._errors import ArtifactError
from symjax_mlp._files import write_dir, write_output
path, out = Path(sys.argv[1]), Path(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))
said = {}
files = {"params.safetensors": b"p" * 100_000, "manifest.json": b"{}"}
try:
    write_dir(path, files, overwrite=True, check=lambda p, o: None, error=ArtifactError,
              what="the artifact")
except ArtifactError as e:
    said["dir"] = str(e)
try:
    write_output((out, b"y" * 30_000))
except Exception as e:
    said["output"] = str(e)
print(json.dumps(said))
"""


@POSIX
def test_a_file_size_limit_names_the_file_its_size_and_the_limit_to_raise(tmp_path):
    """Under ``ulimit -f``, an export said 'cannot write the artifact X: [Errno 27] File too
    large. Anything there before is unchanged.': no file named, nothing to do; an --output,
    'cannot write y.npy (File too large) ... Pass another path.': another path is as large."""
    art, out = tmp_path / "m", tmp_path / "y.npy"
    art.mkdir()
    (art / "manifest.json").write_text('{"before": 1}')
    out.write_bytes(b"what was there")
    said = _child(_FSIZE, str(art), str(out))
    assert said["dir"] == (
        f"cannot write the artifact {art} (its file params.safetensors, 100,000 bytes): File too "
        "large. Anything there before is unchanged. 100,000 bytes is more than the 20,000 bytes "
        "this process may write to a file (ulimit -f, RLIMIT_FSIZE): raise that limit (ulimit "
        "-f unlimited)."
    )
    assert said["output"] == (
        f"cannot write {out} (File too large); what each path held is unchanged. 30,000 bytes "
        "is more than the 20,000 bytes this process may write to a file (ulimit -f, "
        "RLIMIT_FSIZE): raise that limit (ulimit -f unlimited)."
    )
    assert sorted(os.listdir(tmp_path)) == ["m", "y.npy"]  # no temporary sibling left
    assert os.listdir(art) == ["manifest.json"] and out.read_bytes() == b"what was there"


_KEY = """
import json, resource, sys
if sys.argv[1] == "limited":
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, resource.RLIM_INFINITY))
from symjax_mlp._files import cache_secret, read_cached, write_cached
write_cached("ops", "entry", b"body")
print(json.dumps([cache_secret() is not None, read_cached("ops", "entry") == b"body"]))
"""


@POSIX
def test_a_cache_key_cut_short_by_a_full_disk_does_not_turn_the_cache_off(tmp_path):
    """The key signing cache entries was made and written in place: a write cut short (a full
    disk, ulimit -f) left 16 of its 32 bytes, and every later process found no key: no cache,
    the module checker's child started at every load, silently, for good."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    for run, cached in (("limited", [False, False]), ("free", [True, True])):
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(_KEY), run], env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout) == cached, run


def test_a_full_disk_exporting_says_to_free_space(tmp_path, monkeypatch):
    """ENOSPC exporting said '[Errno 28] No space left on device. Anything there before is
    unchanged.' and stopped: a checkpoint's said what to do, an artifact's nothing."""
    from symjax_mlp import _files

    def full(file, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_files, "write_file", full)
    with pytest.raises(sm.ArtifactError) as e:
        files, check = {"model.jaxexport": b"x" * 10}, lambda p, o: None
        _files.write_dir(tmp_path / "m", files, overwrite=False, check=check,
                         error=sm.ArtifactError, what="the artifact")  # fmt: skip
    assert str(e.value).endswith(
        "(its file model.jaxexport, 10 bytes): No space left on device. Anything there before "
        "is unchanged. Free space there (or raise this user's quota), or write to another "
        "filesystem."
    )
    assert os.listdir(tmp_path) == []


_NO_FILES = """
import json, os, resource, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from symjax_mlp._artifact.checker import Checker
from symjax_mlp._errors import CheckpointError
from symjax_mlp._files import write_dir
from symjax_mlp.cli import main
held = []
def exhaust():
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
said = {}
exhaust()
try:
    Checker().report(b"module", file=Path("m/model.jaxexport"))
except Exception as e:
    said["checker"] = [type(e).__name__, str(e)]
try:
    write_dir(Path(sys.argv[1]) / "step_1", {"a": b""}, overwrite=False,
              check=lambda p, o: None, error=CheckpointError)
except CheckpointError as e:
    said["dir"] = str(e)
said["cli"] = main(["run", *sys.argv[1:3], "--output", sys.argv[3]])  # imports on: none left
for fd in held:
    os.close(fd)
print(json.dumps(said))
"""


@POSIX
def test_no_file_descriptor_left_is_said_as_the_limit_not_as_a_bug(tmp_path):
    """Out of descriptors, the module checker's start was a raw OSError ('[Errno 24] Too many
    open files') out of load and export, and the CLI printed a traceback and 'this is a bug in
    symjax_mlp'."""
    (tmp_path / "m").mkdir()
    np.save(tmp_path / "x.npy", np.ones(3, np.float32))
    args = [str(tmp_path / "m"), "--input=" + str(tmp_path / "x.npy"), str(tmp_path / "y.npy")]
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_NO_FILES), *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    said = json.loads(done.stdout.splitlines()[-1])
    limit = ("This process has open all the 64 files it may (ulimit -n, RLIMIT_NOFILE): raise "
             "that limit, or open fewer files or connections at once.")  # fmt: skip
    assert said["checker"] == [
        "ArtifactError",
        "m/model.jaxexport: the module checker, the child process that reads StableHLO for the "
        "loader, cannot be started (Too many open files); nothing was compiled. " + limit,
    ]
    assert said["dir"] == (  # was '... Write it in a directory this user may write, or make
        # that one writable.'
        f"cannot write {tmp_path / 'm' / 'step_1'}: Too many open files in {tmp_path / 'm'}, so "
        "nothing was written. " + limit
    )
    assert os.listdir(tmp_path / "m") == []
    assert said["cli"] == 2 and "Traceback" not in done.stderr and "bug" not in done.stderr
    assert done.stderr.startswith("symjax-mlp run: error: ") and "Too many open" in done.stderr
    assert done.stderr.strip().endswith(limit) and len(done.stderr.splitlines()) == 1


def test_an_input_that_cannot_be_opened_for_want_of_descriptors_is_not_blamed(
    tmp_path, monkeypatch
):
    """Out of descriptors, --input x.npy 'is not a readable .npy array ([Errno 24] Too many
    open files); write one with np.save(file, x)': the file was fine, and rewriting it no fix."""
    from symjax_mlp import _npy

    np.save(tmp_path / "x.npy", np.ones(3, np.float32))

    def no_files(*args, **kwargs):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(_npy, "open", no_files, raising=False)
    with pytest.raises(sm.SignatureError) as e:
        _npy.read_npy(tmp_path / "x.npy", what="--input x.npy")
    said = str(e.value)
    assert said.startswith("--input x.npy cannot be opened (Too many open files): nothing is "
                           "wrong with it. This process has open all the ")  # fmt: skip
    assert "np.save" not in said and "ulimit -n" in said


class _ShortWrites(io.BytesIO):
    """A stream at a file-size limit: a write takes what fits, the next one fails."""

    name, limit = "<stdout>", 4096

    def write(self, data):
        if self.tell() >= self.limit:
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        return super().write(bytes(data)[: self.limit - self.tell()])


def test_an_output_to_stdout_cut_short_is_an_error_not_exit_0():
    """``symjax-mlp run --output - > y.npy`` under ``ulimit -f 4``: BufferedWriter took 4096 of
    the 8320 bytes (a short write), nothing looked at the count, and it exited 0 ('wrote stdout:
    float32[4, 512]') with half a .npy written."""
    from symjax_mlp._npy import write_outputs

    stream = _ShortWrites()
    with pytest.raises(sm.ConfigError) as e:
        write_outputs(np.ones((4, 512), np.float32), stream)
    assert str(e.value).startswith(
        "cannot write <stdout> (File too large): it got at most the first 4,096 of the 8,320 "
        "bytes, so what is there is incomplete. "
    )
    whole = io.BytesIO()
    write_outputs(np.ones((4, 512), np.float32), whole)
    assert np.load(io.BytesIO(whole.getvalue())).shape == (4, 512)


def test_json_to_stdout_cut_short_is_an_error_not_exit_0(monkeypatch):
    """``symjax-mlp inspect ART --json > m.json`` under ``ulimit -f 1``: exit 0, and 1024 of the
    1699 bytes of JSON (Python's text stdout takes a short write for all of it)."""
    from symjax_mlp.cli._args import emit_json

    buffer = _ShortWrites()
    text = io.TextIOWrapper(buffer, encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", text)
    with pytest.raises(sm.ConfigError, match=r"^cannot write <stdout> \(File too large\): it got "
                       r"at most the first 4,096 of the 8,[0-9]{3} bytes"):  # fmt: skip
        emit_json({"x": "y" * 8_000}, "-")
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(whole := io.BytesIO(), encoding="utf-8"))
    emit_json({"x": "y" * 8_000}, "-")
    assert json.loads(whole.getvalue()) == {"x": "y" * 8_000}


class _ShortLine(_ShortWrites):
    """A stream at a file-size limit 16 bytes in: a line's write takes what fits, then fails."""

    limit = 16


@pytest.mark.slow  # an export, a load: 0.4 s warm, 2 s in a fresh process
def test_the_clis_text_to_stdout_cut_short_is_an_error_not_exit_0(monkeypatch, tmp_path, capsys):
    """``symjax-mlp inspect ART > a.txt`` (or ``run``'s "wrote y.npy: ...") at a file-size
    limit: Python's print took a short write for all of its text and exited 0, the text cut;
    only ``--json -`` and ``--output -`` were checked. Now all of it, or exit 2 saying so."""
    from symjax_mlp.cli import main

    art = sm.chapter.export_mlp(tmp_path / "m").path  # the chapter's, as other tests export
    np.save(tmp_path / "x.npy", np.ones((1, 512), np.float32))
    run = ["run", str(art), "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npy")]
    for argv in (run, ["inspect", str(art)]):
        stdout = io.TextIOWrapper(short := _ShortLine(), encoding="utf-8")
        monkeypatch.setattr(sys, "stdout", stdout)
        assert main(argv) == 2
        said = f"symjax-mlp {argv[0]}: error: cannot write <stdout> (File too large): it got at "
        assert said in capsys.readouterr().err
        assert len(short.getvalue()) == 16
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(whole := io.BytesIO(), encoding="utf-8"))
    assert main(["inspect", str(art)]) == 0  # all of it
    assert whole.getvalue().decode() == f"{sm.inspect(art)}\n"


class _Heads:
    files = 1 << 62


@pytest.mark.parametrize(("soft", "hard"), [(64, 64), (64, 1 << 20)])
def test_serve_fits_its_connections_to_the_open_file_limit(monkeypatch, soft, hard):
    """``symjax-mlp serve`` under ``ulimit -n 64`` (max_connections 1000): past ~50 connections
    each new client was accepted and closed by uvloop (a reset), /health too, and nothing was
    logged. Now the soft limit is raised as far as the hard one lets, and where that is short
    the 503 comes first (refusals lingering only while descriptors are left), said once."""
    import resource
    import warnings

    from symjax_mlp.serving import _fds

    limits = [(soft, hard)]
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits[-1])
    monkeypatch.setattr(resource, "setrlimit", lambda which, value: limits.append(value))
    monkeypatch.setattr(_fds, "_open_now", lambda: 8)
    heads = _Heads()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fits = _fds.room(heads, 1000, "serve")
    if hard == 64:  # nothing to raise: 20 connections, 40 with the refusals lingering
        assert (fits, heads.files, limits) == (20, 40, [(64, 64)])
        assert [str(w.message) for w in caught] == [
            "serve: max_connections=1000, but this process may open only 64 files (ulimit -n; "
            "8 open now): past 20 connections, a client gets the 503, where it would be reset. "
            "For 1000, raise ulimit -n to 2024."
        ]
    else:
        assert (fits, limits[-1], caught) == (1000, (2024, 1 << 20), [])


def test_serializing_tensors_without_the_memory_is_a_memory_error_not_an_abort():
    """safetensors builds its bytes in Rust: under RLIMIT_AS it aborted the process ('memory
    allocation of 201326760 bytes failed', SIGABRT) or raised pyo3's PanicException ('PyObject
    pointer is null', a BaseException no ``except Exception`` takes) out of export and
    save_checkpoint. The room is asked first; a panic for want of it is a MemoryError."""
    from symjax_mlp._artifact.weights import serialized

    with pytest.raises(MemoryError, match=r"^out of memory serializing 562,949,953,421,312 "):
        serialized(lambda: b"", 1 << 49)  # more than any machine maps: refused, not tried

    PanicException = type("PanicException", (BaseException,), {})  # pyo3's, by its name

    def panics():
        raise PanicException("PyObject pointer is null")

    with pytest.raises(MemoryError, match=r"ulimit -v\), and write them again\.$"):
        serialized(panics, 8)
    assert serialized(lambda: b"abc", 3) == b"abc"


def test_a_checkpoint_directory_on_a_read_only_file_system_says_so(tmp_path, monkeypatch):
    """On a read-only mount, 'this user may not write to X; make it writable': no user may,
    and no chmod makes it writable (root too, where chmod 555 would not stop it)."""
    from symjax_mlp.training import _paths

    class ReadOnly:  # what statvfs says of a file system mounted ro
        f_flag = os.ST_RDONLY

    monkeypatch.setattr(_paths.os, "access", lambda path, mode: False)  # as it says there
    monkeypatch.setattr(_paths.os, "statvfs", lambda path: ReadOnly)
    with pytest.raises(sm.CheckpointError) as e:
        _paths.check_directory(tmp_path / "ck", "symjax_mlp.training.train")
    said = str(e.value)
    assert f"'{tmp_path}' is on a read-only file system; pass a path on a writable one." in said
    assert "make it writable" not in said


def test_the_resume_probe_holds_its_leaf_not_six_times_it(monkeypatch):
    """train()'s resume probe set each float leaf to a cos pattern made whole in float64: three
    arrays of 8 bytes a parameter at once, six times a float32 leaf. Under RLIMIT_AS a model of
    a 64 MiB leaf that trained with 600 MiB to spare failed with 300 ('Unable to allocate 128.
    MiB ... float64', in _resume._fixed). Now it is made in chunks, bitwise the same values."""
    import math
    import tracemalloc

    import jax.numpy as jnp

    from symjax_mlp.training import _resume

    def whole(a, i, state):  # what it was
        fan_in = math.prod(a.shape[:-1]) if a.ndim >= 2 else 1
        pattern = np.cos(np.arange(a.size, dtype=np.float64) * 0.7 + i)
        pattern = pattern / 2 + 1 if state else pattern / math.sqrt(fan_in)
        return np.asarray(jnp.asarray(pattern.reshape(a.shape), a.dtype))

    monkeypatch.setattr(_resume, "_CHUNK", 1000)  # leaves over several chunks
    leaves = {"w": jnp.zeros((33, 129)), "b": jnp.zeros((2, 3, 411), jnp.bfloat16)}
    for state in (False, True):
        got = _resume._fixed(leaves, state=state)
        for i, name in enumerate(sorted(leaves)):  # jax.tree.flatten's order
            want = whole(leaves[name], i, state)
            assert np.asarray(got[name]).tobytes() == want.tobytes(), (name, state)
    monkeypatch.undo()
    big = jnp.zeros((1024, 2048))  # 8 MiB
    tracemalloc.start()
    try:
        _resume._fixed({"w": big})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2.5 * big.nbytes, peak  # it was 4 times: 32 MiB of float64 at once


# -- end to end, in processes that import JAX: under -m slow
_WRITERS = """
import json, os, resource, subprocess, sys
import numpy as np
import symjax_mlp as sm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
art, ck, key, x, y = sys.argv[1:6]
d = sm.training.load_digits()
tiny = sm.training.Dataset(d.x_train[:64], d.y_train[:64], d.x_test[:32], d.y_test[:32],
                           name="tiny", num_classes=10)
train = lambda epochs: sm.training.train(data=tiny, epochs=epochs, checkpoint=ck, resume=True)
big = sm.hybridize(lambda p, x: x @ p, np.ones((64, 512), np.float32))
train(2)
said = {}
resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, resource.RLIM_INFINITY))
for name, call in (("export", lambda: sm.export(big, art, example=np.ones((4, 64), np.float32),
                                                overwrite=True)),
                   ("train", lambda: train(4)), ("sign", lambda: sm.sign(art, key))):
    if name == "sign":  # a signature: 2 kB
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000, resource.RLIM_INFINITY))
    try:
        call()
    except Exception as e:
        said[name] = [type(e).__name__, str(e)]
resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, resource.RLIM_INFINITY))
run = subprocess.run(["symjax-mlp", "run", art, "--input", x, "--output", y], text=True,
                     capture_output=True)
said["run"] = [run.returncode, run.stderr]
with open(y + ".out", "wb") as out:  # --output -: stdout, a file
    run = subprocess.run(["symjax-mlp", "run", art, "--input", x, "--output", "-"], stdout=out,
                         stderr=subprocess.PIPE, text=True)
said["stdout"] = [run.returncode, run.stderr]
os.unlink(y + ".out")
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
said["steps"] = sorted(os.listdir(ck))
said["resumed"] = len(train(4).history)
said["loads"] = float(np.asarray(sm.load(art)(np.ones((2, 3), np.float32)))[0, 0])
sm.verify_signature(art, key + ".pub")
print(json.dumps(said))
"""


@POSIX
@pytest.mark.slow  # processes importing JAX and training (~15 s)
def test_export_checkpoint_run_and_sign_under_a_real_file_size_limit(tmp_path):
    """Under RLIMIT_FSIZE, each writer names its file and the limit; the artifact, checkpoints,
    output and signature there before are whole, and load, resume and verify."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    art, ck = tmp_path / "m", tmp_path / "ck"
    x = np.ones((2, 3), np.float32)
    sm.export(sm.hybridize(lambda p, x: x * p, np.float32(2)), art, example=x)
    k = ec.generate_private_key(ec.SECP256R1())
    key = tmp_path / "key.pem"
    key.write_bytes(k.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))  # fmt: skip
    pub = k.public_key().public_bytes(serialization.Encoding.PEM,
                                      serialization.PublicFormat.SubjectPublicKeyInfo)  # fmt: skip
    (tmp_path / "key.pem.pub").write_bytes(pub)
    sm.sign(art, key)
    np.save(tmp_path / "x.npy", np.ones((20_000, 3), np.float32))  # its output: 240 kB
    y = tmp_path / "y.npy"
    y.write_bytes(b"before")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    args = [str(art), str(ck), str(key), str(tmp_path / "x.npy"), str(y)]
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_WRITERS), *args], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    limit = "than the 50,000 bytes this process may write to a file (ulimit -f, RLIMIT_FSIZE)"
    kind, text = said["export"]
    assert kind == "ArtifactError" and "(its file params.safetensors, 131,200 bytes)" in text
    assert limit in text and "Anything there before is unchanged" in text
    kind, text = said["train"]
    assert kind == "CheckpointError" and "its file state.safetensors" in text and limit in text
    assert text.endswith("train(resume=True) continues from the newest checkpoint there.")
    assert said["sign"][0] == "ArtifactError" and "nothing was signed" in said["sign"][1]
    assert said["run"][0] == 2 and limit in said["run"][1] and "Traceback" not in said["run"][1]
    assert y.read_bytes() == b"before"
    code, err = said["stdout"]  # was exit 0, 'wrote stdout', and 49,152 of its 240,128 bytes
    assert code == 2 and "cannot write <stdout> (File too large): it got at most the first " in err
    assert "of the 240,128 bytes, so what is there is incomplete." in err and limit in err
    assert said["steps"] == ["step_00000001", "step_00000002"] and said["resumed"] == 4
    assert said["loads"] == 2.0  # the artifact there before, whole, and its signature verifies
    assert sorted(os.listdir(tmp_path)) == ["ck", "key.pem", "key.pem.pub", "m", "x.npy", "y.npy"]


_UNDER_AS = """
import json, resource, sys
import jax, jax.numpy as jnp, optax
from symjax_mlp.training import TrainState, save_checkpoint
def vm():
    status = open("/proc/self/status").read().splitlines()
    return next(int(l.split()[1]) << 10 for l in status if l.startswith("VmSize"))
p = {"w": jnp.ones((1024, 1024 * 48))}  # 192 MiB
state = TrainState(p, optax.sgd(0.1).init(p), jax.random.key(0), step=1)
resource.setrlimit(resource.RLIMIT_AS, (vm() + (100 << 20), resource.RLIM_INFINITY))
try:
    save_checkpoint(sys.argv[1], state)
    said = None
except MemoryError as e:
    said = str(e)
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print(json.dumps(said))
"""


@POSIX
@pytest.mark.slow  # a process importing JAX, 200 MB of tensors (~5 s)
def test_a_checkpoint_without_the_memory_to_serialize_is_a_memory_error(tmp_path):
    """Under RLIMIT_AS with room for the state but not for its safetensors bytes twice, saving
    aborted the process (Rust's 'memory allocation of 201326760 bytes failed'): exit -6."""
    code = textwrap.dedent(_UNDER_AS)
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    assert said.startswith("out of memory serializing 201,326,") and "ulimit -v" in said, said
    assert os.listdir(tmp_path / "ck") == []


_ORBAX_HEAD = """
import dataclasses, json, os, resource, sys
import jax, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from symjax_mlp.training import TrainState
from symjax_mlp.training._orbax import OrbaxCheckpoints
where = sys.argv[1]
replicated = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), PartitionSpec())
p = {"w": jax.random.normal(jax.random.key(1), (256, 256))}  # 256 kB, incompressible
state = TrainState(p, optax.adam(0.1).init(p), jax.random.key(0), step=1)
"""
_ORBAX = """
store = OrbaxCheckpoints(where, timeout=60, sharding=replicated)
store.save(state, {})
store._finish()
store.manager.wait_until_finished()
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))
said = {}
try:
    store.save(dataclasses.replace(state, step=2), {}, last=True)
    store.close()
except Exception as e:
    said["save"] = [type(e).__name__, str(e)]
said["left"] = sorted(os.listdir(where))
print(json.dumps(said))
"""
# relaunched, as after a real failure: the failed save's own writes may still be landing in its
# temporary directory after the error (TensorStore's, not awaited by Orbax), which a save in
# the same process would race with
_ORBAX_RELAUNCH = """
said = {}
again = OrbaxCheckpoints(where, timeout=60, sharding=replicated)
said["restored"] = int(again.restore(again.latest(), state)[0].step)
again.save(dataclasses.replace(state, step=2), {}, last=True)
again.close()
said["after"] = sorted(os.listdir(where))
print(json.dumps(said))
"""


@POSIX
@pytest.mark.slow  # two processes importing JAX and Orbax (~20 s)
def test_a_multi_process_runs_orbax_save_past_a_file_size_limit_is_a_checkpoint_error(tmp_path):
    """A multi-process run's Orbax save under RLIMIT_FSIZE raised TensorStore's ValueError
    ('OUT_OF_RANGE: Error writing ... File too large [os_error_code='27']') out of train():
    no CheckpointError, nothing to do. The step before stays the newest, and resumes."""
    said = _child(_ORBAX_HEAD + _ORBAX, str(tmp_path / "ck"), timeout=300)
    said |= _child(_ORBAX_HEAD + _ORBAX_RELAUNCH, str(tmp_path / "ck"), timeout=300)
    kind, text = said["save"]
    assert kind == "CheckpointError" and text.startswith(
        f"symjax_mlp.training.train: a checkpoint in {tmp_path / 'ck'} could not be written "
        "(ValueError: OUT_OF_RANGE: "
    )
    assert text.endswith(
        "the newest whole one is kept. The file is more than the 20,000 bytes this process may "
        "write to a file (ulimit -f, RLIMIT_FSIZE): raise that limit (ulimit -f unlimited). "
        "Then train(resume=True) continues from it."
    )
    assert said["left"] == ["1", "2.orbax-checkpoint-tmp"]  # Orbax's, never taken for a step
    assert said["restored"] == 1 and said["after"] == ["1", "2"]


@POSIX
@pytest.mark.slow  # a server under ulimit -n 64 and 200 clients (~8 s)
def test_a_server_out_of_descriptors_answers_503_and_serves_after_the_flood(tmp_path):
    import socket

    art = sm.chapter.export_mlp(tmp_path / "mlp")
    limit = "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)); "
    serve = "from symjax_mlp.cli import run; run()"
    cmd = [sys.executable, "-c", limit + serve, "serve", str(art.path), "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = line.split(" on ")[1].split()[0]
        port = int(url.rsplit(":", 1)[1])
        flood = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(200)]
        with pytest.raises(urllib.error.HTTPError) as caught:  # was a ConnectionResetError
            urllib.request.urlopen(url + "/health", timeout=10)
        with caught.value as e:
            assert e.code == 503 and json.loads(e.read())["error"] == "OverloadError"
        for s in flood:
            s.close()
        deadline = time.monotonic() + 20  # refusals linger 2 s
        while _status(url + "/health") != 200:
            assert time.monotonic() < deadline, "the server did not serve again"
            time.sleep(0.2)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err
    assert "warning: max_connections=1000, but this process may open only 64 files" in err


def _status(url: str) -> int | str:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:
        return repr(e)


@pytest.mark.slow  # a small model's export, load and a server's warm-up (~5 s)
def test_the_open_file_limits_warning_is_charged_to_the_callers_line(monkeypatch, tmp_path):
    """serve()'s warning that ``ulimit -n`` holds fewer connections than max_connections is
    charged to the line that called serve (the CLI's, shown in one line, as the ulimit test
    above reads it), found by walking out of the library: a fixed stacklevel drifts as soon as
    serve's body moves into a helper."""
    import resource
    import warnings

    import jax
    import jax.numpy as jnp

    from symjax_mlp import serving

    net, x = sm.mlp((3, 2)), jnp.ones((2, 4))
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    art = sm.export(h, tmp_path / "m", example=x).path  # one batch size: one warm-up
    monkeypatch.setattr(resource, "getrlimit", lambda which: (64, 64))

    class Served(Exception):
        pass

    def ready(url):
        raise Served(url)

    with warnings.catch_warnings(record=True) as caught, pytest.raises(Served):
        warnings.simplefilter("always")
        serving.serve(art, port=0, ready=ready)
    said = [w.filename for w in caught if "ulimit -n" in str(w.message)]
    assert said == [__file__], said


_EXPORT_UNDER_AS = """
import json, resource, sys
import jax.numpy as jnp, numpy as np, symjax_mlp as sm
def vm():
    status = open("/proc/self/status").read().splitlines()
    return next(int(l.split()[1]) << 10 for l in status if l.startswith("VmSize"))
h = sm.hybridize(lambda p, x: x[:, :1] * p["w"] * jnp.ones((1, 2**27)), {"w": jnp.ones(())})
resource.setrlimit(resource.RLIMIT_AS, (vm() + (1280 << 20), resource.RLIM_INFINITY))
try:
    sm.export(h, sys.argv[1], example=np.ones((1, 8), np.float32))
    said = None
except Exception as e:
    said = [type(e).__name__, str(e)]
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print(json.dumps(said))
"""


@POSIX
@pytest.mark.slow  # a process importing JAX, 1.5 GB of outputs refused (~5 s)
def test_export_whose_self_test_runs_out_of_memory_says_so_not_a_raw_runtime_error(tmp_path):
    """A model whose output is 512 MiB a row, exported under RLIMIT_AS without room for what
    its self-test computes (two drawn rows and the example's, the program's and the model's):
    export raised jaxlib's raw JaxRuntimeError ('RESOURCE_EXHAUSTED: Out of memory allocating
    536870912 bytes.') through JAX's frames, as if export itself had failed. An ArtifactError
    now says the program ran out of memory in export's self-test and what to do; nothing is
    written."""
    said = _child(_EXPORT_UNDER_AS, str(tmp_path / "m"), timeout=120)
    assert said[0] == "ArtifactError", said
    assert said[1].startswith("export(<lambda>): its program ran out of memory in the self-test")
    assert "RESOURCE_EXHAUSTED" in said[1] and "more memory is available" in said[1]
    assert not (tmp_path / "m").exists()
