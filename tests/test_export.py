"""Portable artifacts: every test exports, then loads (or inspects) what it exported."""

import builtins
import errno
import hashlib
import json
import marshal
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from helpers import rand, small
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import symjax_mlp as sm
import symjax_mlp._files as files_seam  # the documented write seam
from symjax_mlp.cli import main

CORE = {"manifest.json", "model.jaxexport", "model.mlirbc", "params.safetensors"}
FILES = CORE | {"selftest.safetensors"}  # and the self-test vectors, where export can run them


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """A small MLP exported with a symbolic batch, and its Hybrid."""
    h, x = small()
    return sm.export(h, tmp_path_factory.mktemp("a") / "mlp", example=x), h


def litter(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# -- export and load ----------------------------------------------------------------------------
def test_chapter_net_round_trip_for_batch_1_7_1000(tmp_path):
    net = sm.mlp((256, 128, 2))
    x = rand(1, 512)
    h = sm.hybridize(net, net.init(jax.random.key(1), x))
    art = sm.export(h, tmp_path / "net", example=x, batch="b")
    assert {p.name for p in art.path.iterdir()} == FILES
    assert litter(tmp_path) == []
    m = sm.load(tmp_path / "net")
    for batch in (1, 7, 1000):  # one artifact, any batch size
        xb = rand(batch, 512, seed=batch)
        y = m(xb)
        assert isinstance(y, jax.Array) and y.shape == (batch, 2)
        np.testing.assert_allclose(np.asarray(y), np.asarray(h(xb)), rtol=1e-6, atol=0)


def test_an_input_refused_once_is_refused_at_every_call(art):
    """A call of arrays of a (shape, dtype) that ran before goes straight to the program: one
    that was refused must never count as run (float64 for float32, a row of another width)."""
    m = sm.load(art[0].path)
    x = np.ones((3, 8), np.float32)
    np.testing.assert_allclose(m(x), m(x))  # the second straight to the program
    for bad in (x.astype(np.float64), np.ones((3, 5), np.float32)):
        for _ in range(3):
            with pytest.raises(sm.SignatureError):
                m(bad)


def test_load_params_as_constants_compiles_the_weights_into_the_program(art):
    art, _ = art
    plain, baked = sm.load(art.path), sm.load(art.path, params_as_constants=True)
    assert baked.params_as_constants and not plain.params_as_constants
    for batch in (1, 5):  # each batch size its own program, the symbolic batch kept
        xb = rand(batch, 8, seed=batch)
        np.testing.assert_array_equal(np.asarray(baked(xb)), np.asarray(plain(xb)))
    for w in baked._params.values():  # its programs hold the weights: they still run
        w.delete()
    np.testing.assert_array_equal(np.asarray(baked(rand(5, 8, seed=5))), plain(rand(5, 8, seed=5)))
    with pytest.raises(sm.ConfigError, match="only the JAX runtime compiles the weights"):
        sm.load(art.path, runtime="iree", params_as_constants=True)
    with pytest.raises(sm.ConfigError, match="expected True or False"):
        sm.load(art.path, params_as_constants="yes")


@pytest.mark.parametrize("option", ["trust", "self_test", "params_as_constants"])
def test_load_refuses_a_switch_that_is_not_a_bool(art, option):
    art, _ = art  # trust="no" is truthy: it skipped every check of the program
    with pytest.raises(sm.ConfigError, match=rf", {option}='no'\): expected True or False"):
        sm.load(art.path, **{option: "no"})
    for value in (1, 0):  # 1 == True: taken, where export and hybridize refuse it
        with pytest.raises(sm.ConfigError, match=rf", {option}={value}\): expected True"):
            sm.load(art.path, **{option: value})
    sm.load(art.path, **{option: np.True_ if option != "trust" else np.False_})  # NumPy's bool
    with pytest.raises(sm.ConfigError, match=r'^symjax_mlp\.load\(".+", allow=3\): expected names'):
        sm.load(art.path, allow=3)  # an option's refusal, as trust='no' is


def test_manifest_records_the_contract(art):
    art, h = art
    m = sm.load(art.path)
    manifest = json.loads((art.path / "manifest.json").read_text())
    assert manifest == sm.Artifact(m.path, m.manifest).to_json() == art.to_json()
    assert manifest["format"] == "symjax_mlp.artifact" and manifest["format_version"] == 2
    assert manifest["platforms"] == ["cpu"] and manifest["nr_devices"] == 1
    assert manifest["calling_convention_version"] >= 9
    assert manifest["versions"]["jax"] == jax.__version__
    assert {"jaxlib", "flax", "symjax_mlp"} <= set(manifest["versions"])
    assert manifest["created"].endswith("+00:00")
    assert manifest["signature"] == {
        "inputs": [{"path": "args[0]", "shape": ["b", 8], "dtype": "float32"}],
        "outputs": [{"path": "out", "shape": ["b", 3], "dtype": "float32"}],
        "output_kind": "array",
        "batch": "b",
        "constraints": [],
    }
    assert str(m.signature) == "(args[0]: float32[b, 8]) -> float32[b, 3]  with b >= 1"
    assert [p["path"] for p in manifest["params"]] == [
        "params/layers_0/bias",
        "params/layers_0/kernel",
        "params/layers_1/bias",
        "params/layers_1/kernel",
    ]
    assert set(manifest["files"]) == FILES - {"manifest.json"}
    for name, entry in manifest["files"].items():
        data = (art.path / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    # the weights are plain safetensors, one tensor per param path
    weights = safetensors.numpy.load_file(art.path / "params.safetensors")
    kernel = h.params["params"]["layers_0"]["kernel"]
    np.testing.assert_array_equal(weights["params/layers_0/kernel"], kernel)
    # the params are inputs of the exported module, not constants folded into it
    text = art.mlir_module()
    assert "tensor<8x16xf32>" in text.split("func.func public @main", 1)[1].split("{", 1)[0]
    assert manifest["mlir_arguments"][-1] == "args[0]"


def test_inspect_reports_signature_versions_and_op_counts(art):
    art, _ = art
    info = sm.inspect(art.path)
    counts = info.op_counts()
    assert counts["stablehlo.dot_general"] == 2 and counts["stablehlo.custom_call"] == 1
    assert info.size_bytes == sum(p.stat().st_size for p in art.path.iterdir())
    text = str(info)
    assert "float32[b, 8]" in text and "jax " + jax.__version__ in text
    assert "stablehlo.dot_general" in text and "params/layers_1/kernel: float32[16, 3]" in text
    assert sm.load(art.path)(rand(2)).shape == (2, 3)


def test_fresh_process_loads_without_the_model_source(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "secret_model_xyz.py").write_text(
        textwrap.dedent(
            """
            import flax.linen as nn, jax.numpy as jnp

            class SecretNet(nn.Module):
                @nn.compact
                def __call__(self, x):
                    h = jnp.tanh(nn.Dense(32, name="hidden")(x))
                    return nn.Dense(4, name="head")(h) * 2.0
            """
        )
    )
    sys.path.insert(0, str(src))
    try:
        import secret_model_xyz

        net = secret_model_xyz.SecretNet()
        x = rand(1, 6)
        h = sm.hybridize(net, net.init(jax.random.key(0), x))
        sm.export(h, tmp_path / "art", example=x)
    finally:
        sys.path.remove(str(src))
        sys.modules.pop("secret_model_xyz", None)
    shutil.rmtree(src)  # the source (and its bytecode cache) is gone
    # verify() loads the artifact in a fresh process (cwd: a temporary directory), where the
    # module that defined SecretNet exists nowhere
    report = sm.verify(tmp_path / "art", reference=h, batches=(1, 7, 1000), rtol=1e-6, atol=0)
    assert report.ok, str(report)
    assert [c.batch for c in report.checks] == [1, 7, 1000]
    assert report.reference == "SecretNet"


# -- atomic writes ------------------------------------------------------------------------------
def test_existing_path_needs_overwrite(tmp_path):
    h1, x = small(seed=1)
    h2, _ = small(seed=2)
    sm.export(h1, tmp_path / "m", example=x)
    with pytest.raises(sm.ArtifactError, match=r"already exists.*overwrite=True"):
        sm.export(h2, tmp_path / "m", example=x)
    np.testing.assert_array_equal(sm.load(tmp_path / "m")(x), h1(x))  # untouched
    sm.export(h2, tmp_path / "m", example=x, overwrite=True)
    np.testing.assert_array_equal(sm.load(tmp_path / "m")(x), h2(x))
    assert litter(tmp_path) == [] and [p.name for p in tmp_path.iterdir()] == ["m"]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(sm.ArtifactError, match="not an artifact"):
        sm.export(h2, tmp_path / "notes", example=x, overwrite=True)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_export_killed_mid_write_leaves_previous_artifact(tmp_path):
    h1, x = small(seed=1)
    sm.export(h1, tmp_path / "m", example=x)
    before = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}
    script = textwrap.dedent(
        """
        import sys, time
        import jax, jax.numpy as jnp
        import symjax_mlp as sm
        import symjax_mlp._files as files_seam

        def stall(file, data):  # write half of the weights, then wait to be killed
            if file.name == "params.safetensors":
                with open(file, "wb") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                open("writing", "w").close()
                time.sleep(60)
            with open(file, "wb") as f:
                f.write(data)

        files_seam.write_file = stall
        net = sm.mlp((16, 3))
        x = jnp.ones((2, 8))
        h = sm.hybridize(net, net.init(jax.random.key(9), x))
        sm.export(h, "m", example=x, overwrite=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (tmp_path / "writing").exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the export never started writing"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    proc.stderr.close()
    half_written = [n for n in litter(tmp_path) if n.startswith(".m.tmp-")]
    assert len(half_written) == 1  # it died inside the temporary sibling ...
    assert not (tmp_path / half_written[0] / "manifest.json").exists()
    after = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}
    assert after == before  # ... and the previous artifact is intact and loadable
    np.testing.assert_array_equal(sm.load(tmp_path / "m")(x), h1(x))
    h2, _ = small(seed=2)
    sm.export(h2, tmp_path / "m", example=x, overwrite=True)
    assert litter(tmp_path) == []  # a successful export clears the dead export's litter
    np.testing.assert_array_equal(sm.load(tmp_path / "m")(x), h2(x))


def test_write_failure_keeps_previous_artifact(tmp_path, monkeypatch):
    h1, x = small(seed=1)
    h2, _ = small(seed=2)
    sm.export(h1, tmp_path / "m", example=x)
    real = files_seam.write_file

    def disk_full(file, data):
        if file.name == "model.mlirbc":
            raise OSError(28, "No space left on device")
        real(file, data)

    monkeypatch.setattr(files_seam, "write_file", disk_full)
    with pytest.raises(sm.ArtifactError, match=r"cannot write the artifact .*No space left"):
        sm.export(h2, tmp_path / "m", example=x, overwrite=True)
    assert litter(tmp_path) == []
    np.testing.assert_array_equal(sm.load(tmp_path / "m")(x), h1(x))


def test_a_directory_that_takes_no_new_entry_is_named_not_a_temporary_name(tmp_path, monkeypatch):
    # it read "cannot write the artifact m: [Errno 30] Read-only file system: '.m.new-1-ab'"
    h, x = small()

    def read_only(path, tmp):
        raise OSError(errno.EROFS, "Read-only file system", str(path.parent / ".m.new-1-ab"))

    monkeypatch.setattr(files_seam, "_locked_dir", read_only)
    with pytest.raises(sm.ArtifactError) as e:
        sm.export(h, tmp_path / "m", example=x)
    said = str(e.value)
    assert f"Read-only file system in {tmp_path}, so nothing was written" in said, said
    assert ".m.new" not in said and "directory this user may write" in said
    assert not (tmp_path / "m").exists()


def test_failed_export_leaves_no_litter(tmp_path):
    _, x = small()
    h = sm.hybridize(lambda p, x: {"a": x * p["w"]}, {"w": jnp.ones(8)})
    with pytest.raises(sm.SignatureError, match=r"returns .*array or a flat tuple"):
        sm.export(h, tmp_path / "m", example=x)
    h = sm.hybridize(lambda p, x: (x * p["w"], x.sum(-1)), {"w": jnp.ones(8)})
    with pytest.raises(sm.SignatureError, match=r"args\[0\] is a (Python )?list"):
        sm.export(h, tmp_path / "m", example=([1.0],))
    with pytest.raises(sm.SignatureError, match=r"concrete value of the symbolic batch 'b'"):
        sm.export(sm.hybridize(lambda p, x: x * int(x.shape[0]), {}), tmp_path / "m", example=x)
    branchy = sm.hybridize(lambda p, x: x if x.sum() > 0 else -x, {})
    with pytest.raises(sm.ControlFlowError, match=r"jnp.where"):
        sm.export(branchy, tmp_path / "m", example=x)
    assert list(tmp_path.iterdir()) == []
    sm.export(h, tmp_path / "m", example=x)
    y, s = sm.load(tmp_path / "m")(x)
    np.testing.assert_array_equal(y, x * 1.0)
    np.testing.assert_allclose(s, x.sum(-1), rtol=1e-6)


# -- load-time checks ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(FILES - {"manifest.json"}))
def test_corrupted_file_is_rejected_before_deserializing(art, tmp_path, monkeypatch, name):
    art, _ = art
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in art.path.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    data = bytearray((copy / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / name).write_bytes(bytes(data))

    def must_not_run(deserialize):  # the corrupted bytes; an intact file may be read first
        def guarded(blob, *args, **kwargs):  # (in a fresh process: nothing of it remembered)
            if bytes(blob) == bytes(data):
                raise AssertionError("a corrupted file reached a deserializer")
            return deserialize(blob, *args, **kwargs)

        return guarded

    monkeypatch.setattr(jax.export, "deserialize", must_not_run(jax.export.deserialize))
    monkeypatch.setattr(safetensors, "deserialize", must_not_run(safetensors.deserialize))
    with pytest.raises(sm.ArtifactError, match=rf"{name} is corrupted: its sha256"):
        sm.load(copy)
    with pytest.raises(sm.ArtifactError, match=rf"{name} is corrupted"):
        sm.inspect(copy)
    (copy / name).unlink()
    with pytest.raises(sm.ArtifactError, match=rf"{name} is missing"):
        sm.load(copy)


def edited(art_path, tmp_path, **changes):
    copy = tmp_path / "edited"
    copy.mkdir()
    for p in art_path.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest.update(changes)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def test_load_below_a_regular_file_says_it_is_a_file(tmp_path):
    # it said the path does not exist
    (tmp_path / "afile").write_text("not a directory")
    with pytest.raises(sm.ArtifactError, match=r"afile/sub.*afile is a file, not a directory.*"
                       r"Pass the directory written by symjax_mlp.export"):  # fmt: skip
        sm.load(tmp_path / "afile" / "sub")


def test_missing_or_foreign_manifest(art, tmp_path):
    art, _ = art
    with pytest.raises(sm.ArtifactError, match="does not exist"):
        sm.load(tmp_path / "nowhere")
    copy = edited(art.path, tmp_path)
    (copy / "manifest.json").unlink()
    with pytest.raises(sm.ArtifactError, match=r"manifest.json is missing.*not a complete"):
        sm.load(copy)
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(sm.ArtifactError, match="not valid JSON"):
        sm.load(copy)
    assert sm.load(art.path)(rand(1)).shape == (1, 3)


def test_files_of_different_exports_do_not_mix(art, tmp_path):
    art, _ = art
    h, x = small(sizes=(5, 3))
    other = sm.export(h, tmp_path / "other", example=x)
    blob = (other.path / "model.jaxexport").read_bytes()
    files = art.to_json()["files"]
    files["model.jaxexport"] = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    copy = edited(art.path, tmp_path, files=files)
    (copy / "model.jaxexport").write_bytes(blob)  # checksums agree, contents do not
    with pytest.raises(sm.ArtifactError, match=r"model.jaxexport does not match .*manifest"):
        sm.load(copy)


def test_newer_format_version_is_refused(art, tmp_path):
    art, _ = art
    copy = edited(art.path, tmp_path, format_version=4)  # format 3: weak types (test_day_seven)
    with pytest.raises(sm.ArtifactError, match=r"format version 4.*pip install -U symjax_mlp"):
        sm.load(copy)
    assert sm.load(art.path)(rand(1)).shape == (1, 3)


def test_outside_the_compatibility_window_says_how_to_reexport(art, tmp_path, monkeypatch):
    art, _ = art
    copy = edited(
        art.path,
        tmp_path,
        calling_convention_version=3,
        created="2023-01-05T10:00:00+00:00",
        versions={"jax": "0.4.1", "jaxlib": "0.4.1"},
    )
    monkeypatch.setattr(jax.export, "deserialize", pytest.fail)
    with pytest.raises(sm.ArtifactError) as e:
        sm.load(copy)
    msg = str(e.value)
    assert "model.jaxexport" in msg and "calling convention version 3" in msg
    assert "2023-01-05" in msg and "0.4.1" in msg and "about 6 months" in msg
    assert "re-export" in msg and "overwrite=True" in msg
    monkeypatch.undo()
    assert sm.load(art.path)(rand(1)).shape == (1, 3)


def test_platform_not_exported_for_is_refused(tmp_path):
    h, x = small()
    art = sm.export(h, tmp_path / "gpu", example=x, platforms=("cuda",))  # on a CPU machine
    assert art.platforms == ("cuda",)
    assert "stablehlo.dot_general" in sm.inspect(art.path).op_counts()
    with pytest.raises(sm.ArtifactError, match=r"exported for cuda.*runs on cpu.*platforms="):
        sm.load(art.path)
    with pytest.raises(ValueError, match=r"a GPU is 'cuda' or 'rocm'"):
        sm.export(h, tmp_path / "gpu2", example=x, platforms=("gpu",))


def test_multi_platform_export_runs_here(tmp_path):
    h, x = small()
    art = sm.export(h, tmp_path / "both", example=x, platforms=("cpu", "cuda"))
    assert art.manifest["mlir_arguments"][0] == "platform_index"
    assert sm.inspect(art.path).op_counts()["stablehlo.dot_general"] == 4  # one per platform
    m = sm.load(art.path)
    for batch in (1, 5):
        xb = rand(batch, seed=batch)
        np.testing.assert_allclose(m(xb), h(xb), rtol=1e-6, atol=0)


def test_more_devices_than_present_is_refused(art, tmp_path):
    art, _ = art
    copy = edited(art.path, tmp_path, nr_devices=jax.device_count() + 1)
    with pytest.raises(sm.ArtifactError, match=r"sharded over \d+ devices.*sees \d+ cpu device"):
        sm.load(copy)


# -- call-time checks ---------------------------------------------------------------------------
def test_calls_are_checked(art):
    art, h = art
    m = sm.load(art.path)
    cases = [
        (jnp.ones((3, 7)), r"args\[0\] has shape \(3, 7\) but the artifact expects \(b, 8\)"),
        (jnp.ones((1, 1, 8)), r"shape \(1, 1, 8\), rank 3.*expects rank 2: \(b, 8\)"),
        (jnp.ones((0, 8)), r"args\[0\].shape\[0\] is 0, and a batch of 0 is rejected"),
        (np.ones((2, 8)), r"args\[0\] has dtype float64 .* float32\[b, 8\].*astype"),
    ]
    for bad, message in cases:
        with pytest.raises(sm.SignatureError, match=message):
            m(bad)
    with pytest.raises(sm.SignatureError, match=r"takes 1 input\(s\).*got 2"):
        m(rand(1), rand(1))
    np.testing.assert_allclose(m(rand(4)), h(rand(4)), rtol=1e-6)
    np.testing.assert_allclose(m(rand(1)[0]), h(rand(1))[0], rtol=1e-6)  # one example


def test_static_batch_and_several_inputs(tmp_path):
    def fn(p, x, y):
        return x @ p["w"], (y * p["s"]).sum(-1)

    h = sm.hybridize(fn, {"w": jnp.ones((8, 2)), "s": jnp.float32(3)})
    x, y = rand(3), rand(3, 5)
    art = sm.export(h, tmp_path / "static", example=(x, y), batch=None)
    assert art.signature.inputs[1].shape == (3, 5) and art.signature.output_kind == "tuple"
    m = sm.load(art.path)
    for got, want in zip(m(x, y), h(x, y), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(sm.SignatureError, match=r"args\[0\].shape\[0\] is 4, not 3"):
        m(rand(4), rand(4, 5))
    sm.export(h, tmp_path / "poly", example=(x, y), batch="n")
    m = sm.load(tmp_path / "poly")
    assert m(rand(6), rand(6, 5))[0].shape == (6, 2)
    with pytest.raises(sm.SignatureError, match=r"args\[1\].shape\[0\] is 5 but args\[0\]"):
        m(rand(6), rand(5, 5))


def test_an_input_whose_example_rows_differ_is_never_made_the_batch(tmp_path):
    # x + y.mean(0) also traces with y as (b, 3): the artifact then refused its own example
    h = sm.hybridize(lambda p, x, y: x * p + y.mean(0), jnp.float32(2))
    x, y = rand(2, 3), rand(5, 3)
    art = sm.export(h, tmp_path / "m", example=(x, y))
    assert [s.shape for s in art.signature.inputs] == [("b", 3), (5, 3)]
    m = sm.load(art.path)
    np.testing.assert_allclose(m(x, y), h(x, y), rtol=1e-6)
    np.testing.assert_allclose(m(rand(7, 3), y), h(rand(7, 3), y), rtol=1e-6)
    add = sm.hybridize(lambda p, x, y: x * p + y.sum(-1, keepdims=True), jnp.float32(2))
    with pytest.raises(
        sm.SignatureError,
        match=r"leading dimensions \{'args\[0\]': 2, 'args\[1\]': 3\}.*same number of rows",
    ):
        sm.export(add, tmp_path / "m2", example=(x, rand(3, 4)))
    assert not (tmp_path / "m2").exists()


# -- safety -------------------------------------------------------------------------------------
def test_no_pickle_or_eval_on_the_load_path(tmp_path, monkeypatch):
    h, x = small(seed=3, sizes=(12, 5))
    sm.export(h, tmp_path / "m", example=x)
    # Warm up process-wide one-time imports that are not ours (scipy's LAPACK, pulled in by
    # jax.export on the first CPU call, builds namedtuples with eval) on a different model.
    h0, _ = small(seed=4, sizes=(3,))
    sm.export(h0, tmp_path / "warm", example=x)
    sm.load(tmp_path / "warm")(x)

    def forbidden(*args, **kwargs):
        raise AssertionError("pickle/marshal/eval/exec called on the load path")

    for module, name in [
        (pickle, "load"),
        (pickle, "loads"),
        (pickle, "Unpickler"),
        (marshal, "loads"),
        (builtins, "eval"),
        (builtins, "exec"),
    ]:
        monkeypatch.setattr(module, name, forbidden)
    with pytest.raises(AssertionError):
        pickle.loads(pickle.dumps(1))
    m = sm.load(tmp_path / "m")
    got = m(x)
    monkeypatch.undo()
    np.testing.assert_allclose(got, h(x), rtol=1e-6)


# -- swapping weights ---------------------------------------------------------------------------
def test_params_swap_and_tree_mismatch(tmp_path):
    h1, x = small(seed=1)
    h2, _ = small(seed=2)
    sm.export(h1, tmp_path / "one", example=x)
    sm.export(h2, tmp_path / "two", example=x)
    m = sm.load(tmp_path / "one", params=tmp_path / "two" / "params.safetensors")
    np.testing.assert_allclose(m(x), h2(x), rtol=1e-6, atol=0)
    np.testing.assert_allclose(sm.load(tmp_path / "one", params=h2.params)(x), h2(x), rtol=1e-6)

    weights = safetensors.numpy.load_file(tmp_path / "two" / "params.safetensors")
    (tmp_path / "three").mkdir()  # a deeper MLP's weights: a third layer
    deeper = {**weights, "params/layers_2/kernel": np.ones((3, 3), np.float32)}
    deeper["params/layers_2/bias"] = np.ones(3, np.float32)
    safetensors.numpy.save_file(deeper, tmp_path / "three" / "params.safetensors")
    with pytest.raises(sm.ArtifactError) as e:
        sm.load(tmp_path / "one", params=str(tmp_path / "three" / "params.safetensors"))
    msg = str(e.value)
    assert "three/params.safetensors does not match the artifact's param tree" in msg
    assert "0 missing, 2 extra" in msg and "extra:   params/layers_2/kernel" in msg

    weights["params/Dense_9/kernel"] = weights.pop("params/layers_1/kernel")
    safetensors.numpy.save_file(weights, tmp_path / "renamed.safetensors")
    with pytest.raises(sm.ArtifactError, match=r"renamed to params/Dense_9/kernel\?"):
        sm.load(tmp_path / "one", params=tmp_path / "renamed.safetensors")
    weights["params/layers_1/kernel"] = weights.pop("params/Dense_9/kernel")[:, :2]
    safetensors.numpy.save_file(weights, tmp_path / "narrow.safetensors")
    with pytest.raises(
        sm.ArtifactError, match=r"layers_1/kernel is float32\[16, 2\] .* expects float32\[16, 3\]"
    ):
        sm.load(tmp_path / "one", params=tmp_path / "narrow.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(sm.ArtifactError, match=r"junk\.safetensors is not a valid safetensors"):
        sm.load(tmp_path / "one", params=tmp_path / "junk.safetensors")


@pytest.mark.parametrize("params", [3, 2.5, True, b"params.safetensors", object()])
def test_params_of_no_path_or_tree_are_refused_naming_what_params_takes(tmp_path, params):
    # load(params=3) was a param-tree mismatch ("extra: params: int32[]")
    h, x = small()
    sm.export(h, tmp_path / "m", example=x)
    with pytest.raises(
        sm.ConfigError,
        match=rf"^symjax_mlp\.load\(.*, params=.*\): got an? {type(params).__name__}; params= "
        r"takes a \.safetensors file \(a str or pathlib\.Path, .*\) or a params tree of arrays",
    ):
        sm.load(tmp_path / "m", params=params)


def test_bfloat16_params_round_trip(tmp_path):
    h = sm.hybridize(lambda p, x: x @ p["w"], {"w": jnp.full((8, 2), 0.5, jnp.bfloat16)})
    x = rand(3).astype(jnp.bfloat16)
    art = sm.export(h, tmp_path / "bf16", example=x)
    assert art.params[0].dtype == "bfloat16"
    np.testing.assert_array_equal(np.asarray(sm.load(art.path)(x)), np.asarray(h(x)))


def test_scalar_inputs_and_outputs_load_and_pass_their_self_test(tmp_path):
    """A rank-0 input and a rank-0 output: the self-test vectors keep their rank (they were
    once stored 1-d, and the default load refused what export had just written)."""
    h = sm.hybridize(lambda p, x, t: jnp.mean(x @ p) / t, jnp.full((8, 2), 0.5, jnp.float32))
    x, t = rand(3), jnp.float32(2.0)
    art = sm.export(h, tmp_path / "scalar", example=(x, t), batch=None)
    vectors = safetensors.numpy.load_file(art.path / "selftest.safetensors")
    assert vectors["args[1]"].shape == () and vectors["out[0]"].shape == ()
    y = sm.load(art.path)(x, t)  # the self-test runs and passes
    assert np.shape(y) == () and np.allclose(y, h(x, t), rtol=1e-6)


def test_two_params_with_one_path_are_refused(tmp_path):
    """Two leaves whose keys print alike would share one tensor of params.safetensors."""

    @jax.tree_util.register_pytree_with_keys_class
    class Twins:
        def __init__(self, a, b):
            self.a, self.b = a, b

        def tree_flatten_with_keys(self):
            key = jax.tree_util.DictKey("w")
            return ((key, self.a), (key, self.b)), None

        @classmethod
        def tree_unflatten(cls, _, children):
            return cls(*children)

    h = sm.hybridize(lambda p, x: x @ p.a + x @ p.b, Twins(jnp.ones((8, 2)), jnp.zeros((8, 2))))
    with pytest.raises(sm.ConfigError, match=r"two params share the path 'w'"):
        sm.export(h, tmp_path / "twins", example=rand(2))
    assert not (tmp_path / "twins").exists()


# -- verify and the CLI -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batches": 3}, r"verify\(batches=3\): pass a tuple of batch sizes >= 1"),
        ({"batches": ["a"]}, r"verify\(batches=\('a',\)\)"),
        ({"batches": [True]}, r"verify\(batches=\(True,\)\)"),
        ({"atol": -1}, r"verify\(atol=-1\): pass a number >= 0"),
        ({"rtol": float("nan")}, r"verify\(rtol=nan\)"),
        ({"rtol": "x"}, r"verify\(rtol='x'\)"),
        ({"reference": "x"}, r"verify\(reference='x'\): pass what to compare with"),
        ({"trust": "no"}, r"verify\(trust='no'\): expected True or False"),
        ({"trust": 1}, r"verify\(trust=1\): expected True or False"),
    ],
)
def test_verify_refuses_bad_options_before_it_runs(art, options, message):
    art, _ = art
    with pytest.raises(sm.ConfigError, match=message):
        sm.verify(art.path, **options)
    with pytest.raises(sm.ConfigError, match=r"verify\(m.path\), not the loaded model"):
        sm.verify(sm.load(art.path))


def test_verify_fails_against_a_different_model(art):
    art, _ = art
    wrong, _ = small(seed=5)
    report = sm.verify(art.path, reference=wrong, batches=(2, 3))
    assert not report.ok and report.load_seconds["jax"] > 0
    assert [(c.runtime, c.batch, c.ok) for c in report.checks] == [
        ("jax", 2, False),
        ("jax", 3, False),
    ]
    assert "FAIL jax   batch     2" in str(report) and "differs beyond tolerance" in str(report)


def test_verify_draws_inputs_for_per_input_shapes_and_rng_keys(tmp_path):
    """Symbolic sizes past the batch (``shapes=("b, 5", "b, t")``) and an rng-key input:
    honest exports that verify once crashed on (int("b"), np.dtype("key<fry>")). One model
    takes both, so one fresh process verifies them."""

    def noisy(p, k, x, s):
        return x @ p + jnp.sum(s, -1, keepdims=True) + jax.random.normal(k, (x.shape[0], 3))

    h = sm.hybridize(noisy, jnp.ones((5, 3)))
    art = sm.export(h, tmp_path / "seq", example=(jax.random.key(0), rand(2, 5), rand(2, 4)),
                    shapes=(None, "b, 5", "b, t"))  # fmt: skip
    report = sm.verify(art.path, reference=h, batches=(1, 3))
    assert report.ok, report
    assert [c.batch for c in report.checks] == [1, 3]


@pytest.mark.parametrize(
    "shape, dtype, error, message",
    [
        ([2**40, 2**40], "float32", sm.ArtifactError, r"even at batch 1, more than verify draws"),
        ([2, 2**25], "float32", sm.ArtifactError, r"asks for 268,435,456 bytes"),
        ([2, 3], "evil", sm.ArtifactError, r"dtype 'evil', which names no array type"),
        (["b", 2**17], "float32", sm.ConfigError, r"pass smaller batches"),
    ],
)  # fmt: skip
def test_verify_bounds_what_a_manifest_makes_it_draw(art, tmp_path, shape, dtype, error, message):
    """verify draws its inputs from the manifest's signature before the fresh process's load
    compares it with the module: a stranger's manifest must not choose gigabytes (once 768
    MiB of memory and 256 MiB of disk for a [2, 2**25] input) or crash it."""
    src, _ = art
    edited = tmp_path / "edited"
    shutil.copytree(src.path, edited)
    m = json.loads((edited / "manifest.json").read_text())
    m["signature"]["inputs"][0].update(shape=shape, dtype=dtype)
    m["signature"]["batch"] = shape[0] if isinstance(shape[0], str) else None  # as export has it
    (edited / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(error, match=message):
        sm.verify(edited, batches=(1, 7, 128))


def test_cli_export_inspect_run(tmp_path, capsys):
    path = str(tmp_path / "cli")
    args = ["export", path, "--sizes", "8,2", "--in-features", "4", "--platforms", "cpu,cuda"]
    assert main(args) == 0
    assert "(args[0]: float32[b, 4]) -> float32[b, 2]" in capsys.readouterr().out
    assert main(args) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "platforms  cpu, cuda" in out and "stablehlo.dot_general" in out
    assert main(["inspect", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["platforms"] == ["cpu", "cuda"]
    x = np.asarray(rand(5, 4))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "bad.npy", x.astype(np.float64))
    y = str(tmp_path / "y.npy")
    assert main(["run", path, "--input", str(tmp_path / "x.npy"), "--output", y]) == 0
    net = sm.mlp((8, 2))
    h = sm.hybridize(net, net.init(jax.random.key(0), jnp.zeros((1, 4))))
    np.testing.assert_allclose(np.load(y), h(x), rtol=1e-6)
    assert main(["run", path, "--input", str(tmp_path / "bad.npy"), "--output", y]) == 2
    assert "holds float64[5, 4] but the artifact expects float32" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert main(["export", str(tmp_path / "s"), "--sizes", "3", "--batch", "4"]) == 0
    assert sm.inspect(tmp_path / "s").signature.inputs[0].shape == (4, 512)
    assert main(["export", str(tmp_path / "t"), "--batch", "0"]) == 2


def test_public_names():
    for name in ("export", "load", "verify", "inspect", "Artifact", "LoadedModel"):
        assert name in sm.__all__ and hasattr(sm, name)


def test_a_64_bit_artifact_where_jax_runs_without_x64_says_to_enable_it(tmp_path):
    # its float64 weights would be made float32 and its program fail as "corrupted"
    net, x = sm.mlp((4, 2)), np.ones((2, 3))
    with jax.enable_x64(True):
        variables = jax.tree.map(lambda a: a.astype(np.float64), net.init(jax.random.key(0), x))
        h = sm.hybridize(net, variables)
        sm.export(h, tmp_path / "m", example=jnp.asarray(x, jnp.float64))
        assert sm.load(tmp_path / "m")(x).dtype == np.float64
        # the fresh process of verify has 64-bit types as this one has them
        assert sm.verify(tmp_path / "m", reference=h, batches=(2,)).ok
    with pytest.raises(sm.ArtifactError, match=r"holds float64 tensors.*JAX_ENABLE_X64=1"):
        sm.load(tmp_path / "m")


def test_python_numbers_take_the_artifact_dtype_as_jax_weak_types_do(tmp_path):
    # np.asarray made them float64/int64, which a float32 artifact refused ("has dtype float64")
    h = sm.hybridize(lambda p, x, s: x * p * s, jnp.float32(2))
    x = jnp.ones((2, 3))
    m = sm.load(sm.export(h, tmp_path / "m", example=(x, jnp.float32(3)), batch=None).path)
    for s in (3.0, 3):
        np.testing.assert_array_equal(m(x, s), h(x, jnp.float32(3)))
    np.testing.assert_array_equal(m([[1.0, 1, 1]] * 2, 3), h(x, jnp.float32(3)))
    for s, dtype in ((True, "bool"), (1e40, "float64"), (np.float64(3), "float64")):
        with pytest.raises(sm.SignatureError, match=rf"args\[1\] has dtype {dtype} .*float32\[\]"):
            m(x, s)  # a bool, an overflow, a NumPy float64: as before


def test_a_complex_input_and_output_export_load_and_run_from_the_cli(tmp_path):
    """Export refused complex inputs and outputs: "its self-test file stores no complex
    numbers, so load would refuse it", untrue once load read complex64 vectors and compared
    both parts. The artifact loads, passes its self-test, and runs from the CLI."""
    params = {"w": (jnp.arange(6.0).reshape(3, 2) + 1j).astype(jnp.complex64)}
    h = sm.hybridize(lambda p, z: jnp.tanh(z @ p["w"]) * (1 - 2j), params)
    z = (jnp.ones((2, 3)) * (1 + 0.5j)).astype(jnp.complex64)
    art = sm.export(h, tmp_path / "c", example=z)
    assert str(art.signature) == "(args[0]: complex64[b, 3]) -> complex64[b, 2]  with b >= 1"
    assert "selftest.safetensors" in art.manifest["files"]
    np.testing.assert_allclose(sm.load(art.path)(z), h(z), rtol=1e-6)
    np.save(tmp_path / "z.npy", np.asarray(z))
    argv = ["run", str(art.path), "--input", str(tmp_path / "z.npy")]
    assert main([*argv, "--output", str(tmp_path / "y.npy")]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), h(z), rtol=1e-6)


def test_export_compiles_one_program_for_its_self_test_and_the_check_against_the_model(tmp_path):
    # the self-test vectors, the exported program and the model at the example's shapes were
    # three XLA compiles; the check against the model still runs
    compiles, listening = [], [True]

    def listen(event, seconds, **kwargs):
        if listening[0] and event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    net, x = sm.mlp((5, 2)), jnp.ones((3, 7))
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        art = sm.export(h, tmp_path / "m", example=x)
    finally:
        listening[0] = False
    assert len(compiles) == 1
    assert "selftest.safetensors" in art.manifest["files"]
    np.testing.assert_allclose(sm.load(art.path)(x), h(x), rtol=1e-6)


@pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated")  # (the example's layer)
def test_a_model_taking_its_array_keyword_only_is_told_a_wrapper_that_exports(tmp_path):
    """flax's nlp_seq tagger, ``__call__(self, *, inputs, train)``: export(h, example=x,
    kwargs={"train": False}) failed in the trace telling h(inputs=inputs, train=train), and
    export(h, example=(), kwargs={"inputs": x, ...}) told sm.hybridize(lambda params, x, inputs:
    Tagger(params, x, inputs=inputs), params): neither exports. Both name h.apply's wrapper."""
    from helpers import tagger

    model, variables, x = tagger()
    h = sm.hybridize(model, variables)
    fix = (
        "export sm.hybridize(lambda params, inputs: h.apply(params, inputs=inputs, train=False), "
        "h.params) with example=inputs, and call the artifact with it by place"
    )
    with pytest.raises(sm.SignatureError, match=r"^export\(Tagger\): the model takes inputs by "
                       r"keyword only \(\*, inputs, train\), but an artifact's") as e:  # fmt: skip
        sm.export(h, tmp_path / "m", example=x, kwargs={"train": False})
    assert fix in str(e.value) and "bake" not in str(e.value)
    with pytest.raises(sm.SignatureError, match=r"kwargs\['inputs'\] is an array") as e:
        sm.export(h, tmp_path / "m", example=(), kwargs={"inputs": x, "train": False})
    assert fix in str(e.value)
    w = sm.hybridize(lambda params, inputs: h.apply(params, inputs=inputs, train=False), h.params)
    sm.export(w, tmp_path / "m", example=x)  # as it says
    want = h(inputs=x, train=False)
    np.testing.assert_allclose(sm.load(tmp_path / "m", allow={"gather"})(x), want, rtol=1e-5)


def test_an_nnx_module_exported_without_its_flag_is_told_the_export_fix(tmp_path):
    """export(h, example=x) of an nnx module taking train= said "Pass them as the model takes
    them, without its params or self: h(x, train=train)": its training-mode probe traced the
    call first; now the arguments are checked first, as for a linen model."""
    from flax import nnx

    class Flagged(nnx.Module):
        def __init__(self):
            self.dense, self.drop = nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.Dropout(0.5)

        def __call__(self, x, *, train: bool):
            return self.drop(self.dense(x), deterministic=not train, rngs=nnx.Rngs(1))

    h, x = sm.hybridize(Flagged()), jnp.ones((2, 3))
    with pytest.raises(
        sm.SignatureError,
        match=r"^export\(Flagged\): the call's arguments do not fit the model's inputs \(x, \*, "
        r"train\): missing a required argument: 'train'\. Pass its inputs as example= and its "
        r"settings as kwargs=\.$",
    ):
        sm.export(h, tmp_path / "m", example=x)


def test_complex64_params_export_and_load(tmp_path):
    """A model with complex64 params (which training checkpoints and resumes) was refused by
    export: "param w has dtype complex64, which safetensors cannot store. Cast it (to float32,
    int32, ...)": untrue (safetensors stores complex64), and the cast drops the imaginary part.
    Now its artifact loads and runs, with its own weights and with others."""
    params = {"w": (jnp.arange(6.0).reshape(3, 2) + 1j).astype(jnp.complex64)}
    h, x = sm.hybridize(lambda p, x: jnp.abs(x @ p["w"]), params), jnp.ones((2, 3))
    m = sm.load(sm.export(h, tmp_path / "m", example=x).path)
    np.testing.assert_allclose(m(x), h(x), rtol=1e-6)
    assert m.params["w"].dtype == np.complex64
    doubled = sm.load(m.path, params={"w": m.params["w"] * 2})
    np.testing.assert_allclose(doubled(x), 2 * h(x), rtol=1e-6)


def test_complex_constants_in_the_program_and_its_vjp_load(tmp_path):
    """An artifact whose program or VJP module holds a complex constant (a complex64 model's
    own ``* (1 + 2j)``; the cotangent 1 + 0j of its VJP) was refused by load: "the StableHLO
    module cannot be checked (TypeError: Can't cast unknown element type ...complex<f32>)".
    The checker read every attribute; it now reads only those it checks. Then the VJP's ops
    real, imag and complex (any complex model's gradient has them) were refused as ops an MLP
    never needs: they are elementwise, allowed as abs and multiply are."""
    params = {"w": (jnp.arange(6.0).reshape(3, 2) + 1j).astype(jnp.complex64)}
    h = sm.hybridize(lambda p, x: jnp.abs(x @ p["w"] * (1 + 2j)), params)
    x = jnp.ones((2, 3))
    m = sm.load(sm.export(h, tmp_path / "m", example=x, vjp_order=1).path)
    np.testing.assert_allclose(m(x), h(x), rtol=1e-6)
    grad = jax.grad(lambda f, x: f(x).sum(), argnums=1)
    np.testing.assert_allclose(grad(m, x), grad(h, x), rtol=1e-5)


def test_complex_weights_for_real_params_are_not_told_to_cast_away_their_imaginary_part(tmp_path):
    """load(path, params=complex weights) of a model of real params said "Cast them:
    x.astype(np.float32) for each": a cast that drops the imaginary parts (NumPy warns). They
    are another model's weights, and it says so; real weights for complex params may cast.
    And the message is headed by the call, as every load message, not "params=:"."""
    x = jnp.ones((2, 3))
    real = sm.export(
        sm.hybridize(lambda p, x: x @ p["w"], {"w": jnp.ones((3, 2))}), tmp_path / "r", example=x
    )
    tree, file = {"w": np.ones((3, 2), np.complex64)}, tmp_path / "c.safetensors"
    safetensors.numpy.save_file(tree, file)
    for params, shown in ((tree, "..."), (file, repr(str(file)))):
        with pytest.raises(
            sm.ArtifactError,
            match=r"complex64\[3, 2\] but .*float32\[3, 2\]\. Use weights of the same architecture",
        ) as e:
            sm.load(real.path, params=params)
        said = str(e.value)  # the call first, as every load message (it was "params=: param w")
        assert said.startswith(f'symjax_mlp.load("{real.path}", params={shown}): '), said
        assert "astype" not in said and "params=:" not in said, said


@pytest.mark.parametrize(
    ("dtype", "value", "became"),
    [(np.float64, 1e39, "inf"), (np.int64, 2**40, "wrapped"), (np.complex128, 1e39j, "inf")],
)
def test_64_bit_weights_past_the_32_bit_range_are_refused_not_narrowed_in_silence(
    tmp_path, dtype, value, became
):
    """load(path, params=tree) narrows 64-bit weights to what JAX computes in with x64 off:
    1e39 became inf and 2**40 wrapped to 0, with only NumPy's RuntimeWarning (or nothing), and
    the model answered with them. Values that fit still narrow, as JAX narrows them."""
    kind = np.dtype(dtype)
    w = jnp.ones((3, 2), jax.dtypes.canonicalize_dtype(kind))
    h = sm.hybridize(lambda p, x: x.astype(p["w"].dtype) @ p["w"], {"w": w})
    m = sm.export(h, tmp_path / "m", example=jnp.ones((2, 3)))
    fits = np.full((3, 2), 2, dtype)
    np.testing.assert_array_equal(
        sm.load(m.path, params={"w": fits})(np.ones((1, 3), np.float32)), 2 * h(jnp.ones((1, 3)))
    )
    bad = fits.copy()
    bad[1, 0] = value
    with pytest.raises(sm.ArtifactError) as e:
        sm.load(m.path, params={"w": bad})
    said = str(e.value)
    assert said.startswith(f'symjax_mlp.load("{m.path}", params=...): param w is {kind}'), said
    assert f"beyond {w.dtype}'s range" in said and f"({became})" in said, said


@pytest.mark.slow  # an 8-device export, its load and compile: 1.6 s
def test_params_split_over_a_mesh_under_a_sharding_constraint_are_staged_split(tmp_path):
    """Params split over a (data, model) mesh (jax.device_put on a NamedSharding) of a model that
    pins its activations by with_sharding_constraint, as JAX's sharded-computation doc writes
    model parallelism: the artifact, a program over the mesh's 8 devices, takes each param
    split as the live call does (before: staged whole, every device holding every param). It
    loads and answers as the Hybrid. A model that maps nothing onto a mesh exports one
    device's program, as before (test_authors_round7eqx's fsdp test)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    split = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    w1, w2 = rand(16, 32, seed=1), rand(32, 16, seed=2)
    params = {
        "w1": jax.device_put(w1, split(None, "model")),
        "w2": jax.device_put(w2, split("model")),
    }

    def model(p, x):
        y = jax.lax.with_sharding_constraint(jax.nn.relu(x @ p["w1"]), split("data", "model"))
        return y @ p["w2"]

    x, h = rand(8, 16), sm.hybridize(model, params)
    art = sm.export(h, tmp_path / "m", example=x)
    exported = jax.export.deserialize(bytearray((art.path / "model.jaxexport").read_bytes()))
    assert art.manifest["nr_devices"] == 8 and None not in exported.in_shardings_hlo[:2]
    np.testing.assert_allclose(sm.load(art.path)(np.asarray(x)), h(x), rtol=1e-5, atol=1e-5)
