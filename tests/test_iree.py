"""The same artifact outside JAX: IREE from Python, and IREE's native tools with no Python."""

import importlib
import json
import subprocess

import iree.compiler
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from iree.compiler.tools.binaries import find_tool
from symjax_mlp.runtimes import iree as iree_rt

import symjax_mlp as sm
from symjax_mlp.cli import main

TOL = {"rtol": 1e-5, "atol": 1e-5}


def rand(batch, features=512, seed=0):
    return jax.random.normal(jax.random.key(seed), (batch, features), jnp.float32)


@pytest.fixture(scope="module")
def chapter(tmp_path_factory):
    """The chapter's net, exported for cpu with a symbolic batch, and its Hybrid."""
    net = sm.mlp((256, 128, 2))
    h = sm.hybridize(net, net.init(jax.random.key(1), rand(1)))
    return sm.export(h, tmp_path_factory.mktemp("iree") / "net", example=rand(1)), h


@pytest.fixture
def compiles(monkeypatch):
    """Counts calls of iree.compiler.compile_str (the only place IREE compiles)."""
    calls = []
    real = iree.compiler.compile_str

    def counting(*args, **kwargs):
        calls.append(kwargs.get("extra_args"))
        return real(*args, **kwargs)

    monkeypatch.setattr(iree.compiler, "compile_str", counting)
    return calls


def test_iree_matches_jax_and_caches_the_vmfb(chapter, compiles):
    art, h = chapter
    m = sm.load(art.path, runtime="iree")
    assert len(compiles) == 1 and "--iree-llvmcpu-target-cpu=host" in compiles[0]
    jax_model = sm.load(art.path)
    for batch in (1, 7, 1000):
        x = rand(batch, seed=batch)
        y = m(x)
        assert isinstance(y, np.ndarray) and y.shape == (batch, 2) and y.dtype == np.float32
        np.testing.assert_allclose(y, np.asarray(jax_model(x)), **TOL)
        np.testing.assert_allclose(y, np.asarray(h(x)), **TOL)
    cache = art.path / iree_rt.vmfb_cache_name()
    assert cache.exists() and iree_rt.iree_version() in cache.name and "llvm-cpu" in cache.name
    # cached: no second compile; the extra files do not break the artifact's checksums
    sm.load(art.path, runtime="iree")
    assert len(compiles) == 1
    assert sm.inspect(art.path).op_counts()["stablehlo.dot_general"] == 3
    np.testing.assert_allclose(sm.load(art.path)(rand(3)), h(rand(3)), rtol=1e-6)
    # a corrupted cache is detected and rebuilt, never run
    data = bytearray(cache.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cache.write_bytes(bytes(data))
    m = sm.load(art.path, runtime="iree")
    assert len(compiles) == 2
    np.testing.assert_allclose(m(rand(2)), np.asarray(h(rand(2))), **TOL)
    # a cache for another IREE version or CPU has another name and is left alone
    other = art.path / "model.iree-0.0.1.llvm-cpu-x86_64-0000000000.vmfb"
    other.write_bytes(b"stale")
    sm.load(art.path, runtime="iree")
    assert len(compiles) == 2 and other.read_bytes() == b"stale"
    other.unlink()


def test_iree_checks_shapes_and_dtypes_itself(chapter):
    art, _ = chapter
    m = sm.load(art.path, runtime="iree")  # IREE erases jax's shape assertions
    assert "custom_call" in (art.path / "model.mlir").read_text()
    with pytest.raises(sm.SignatureError, match=r"args\[0\].shape\[0\] is 0, and a batch of 0"):
        m(np.zeros((0, 512), np.float32))
    with pytest.raises(sm.SignatureError, match=r"args\[0\] has shape \(2, 500\).*\(b, 512\)"):
        m(np.zeros((2, 500), np.float32))
    with pytest.raises(sm.SignatureError, match=r"dtype float64"):
        m(np.zeros((2, 512)))
    assert m(np.zeros((2, 512), np.float32)).shape == (2, 2)


def test_iree_runs_a_multi_platform_export(tmp_path):
    net = sm.mlp((16, 3))
    x = rand(4, 8)
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    art = sm.export(h, tmp_path / "both", example=x, platforms=("cuda", "cpu"))
    assert art.manifest["mlir_arguments"][0] == "platform_index"
    m = sm.load(art.path, runtime="iree")  # passes the index of "cpu" (1 here)
    np.testing.assert_allclose(m(x), np.asarray(h(x)), **TOL)


def test_iree_refuses_what_it_cannot_run(tmp_path, compiles):
    net = sm.mlp((4,))
    x = rand(2, 3)
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    sm.export(h, tmp_path / "cuda", example=x, platforms=("cuda",))
    with pytest.raises(sm.ArtifactError, match=r"exported for cuda only.*'cpu'"):
        sm.load(tmp_path / "cuda", runtime="iree")

    def gram_cholesky(p, x):
        return jnp.linalg.cholesky(x @ x.T + p["eps"] * jnp.eye(x.shape[0]))

    h = sm.hybridize(gram_cholesky, {"eps": jnp.float32(1.0)})
    sm.export(h, tmp_path / "linalg", example=x, batch=None)
    with pytest.raises(sm.ArtifactError, match=r"lapack_spotrf_ffi.*runtime='jax'"):
        sm.load(tmp_path / "linalg", runtime="iree")
    np.testing.assert_allclose(sm.load(tmp_path / "linalg")(x), h(x), rtol=1e-5)  # JAX can
    assert compiles == []  # refused up front, no fallback and no compile attempt

    manifest = json.loads((tmp_path / "cuda" / "manifest.json").read_text())
    manifest["platforms"], manifest["nr_devices"] = ["cpu"], 2
    (tmp_path / "cuda" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sm.ArtifactError, match=r"sharded over 2 devices; IREE runs single"):
        sm.load(tmp_path / "cuda", runtime="iree")


def test_iree_compile_failure_is_an_artifact_error(tmp_path, compiles):
    h = sm.hybridize(lambda p, x: x * p["w"], {"w": jnp.ones(3)})
    art = sm.export(h, tmp_path / "m", example=rand(1, 3))
    # a module IREE rejects, with a consistent checksum: IREE's own diagnostic must surface
    bad = b"module { func.func @main() { stablehlo.bogus_op } }"
    (art.path / "model.mlirbc").write_bytes(bad)
    manifest = json.loads((art.path / "manifest.json").read_text())
    manifest["files"]["model.mlirbc"] = {"sha256": sm.manifest.sha256(bad), "bytes": len(bad)}
    (art.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sm.ArtifactError, match=r"model.mlirbc: IREE .* could not compile"):
        sm.load(art.path, runtime="iree")
    assert len(compiles) == 1
    with pytest.raises(sm.ArtifactError, match=r"StableHLO module other than model.mlirbc"):
        sm.load(art.path)  # JAX refuses it too: its module is not model.mlirbc (one program)


def native(path):
    with open(path, "rb") as f:
        assert f.read(4) == b"\x7fELF", f"{path} is not a native executable"
    return str(path)


def test_no_python_iree_compile_and_iree_run_module(chapter, tmp_path):
    """The README recipe: IREE's native tools only; .npy files in, .npy out."""
    art, h = chapter
    iree_compile = native(find_tool("iree-compile"))
    runtime_dir = importlib.import_module("iree._runtime_libs").__path__[0]
    iree_run = native(f"{runtime_dir}/iree-run-module")
    # packaging step (any safetensors reader will do): one .npy per argument of main
    weights = safetensors.numpy.load_file(art.path / "params.safetensors")
    x = np.asarray(rand(7, seed=3))
    inputs = []
    for i, name in enumerate(art.manifest["mlir_arguments"]):
        np.save(tmp_path / f"arg{i}.npy", x if name == "args[0]" else weights[name])
        inputs.append(f"--input=@{tmp_path / f'arg{i}.npy'}")
    vmfb = tmp_path / "net.vmfb"
    flags = iree_rt.compile_flags()
    subprocess.run(
        [iree_compile, *flags, str(art.path / "model.mlirbc"), "-o", str(vmfb)],
        check=True,
        capture_output=True,
    )
    run = subprocess.run(
        [
            iree_run,
            "--device=local-task",
            f"--module={vmfb}",
            "--function=main",
            *inputs,
            f"--output=@{tmp_path / 'y.npy'}",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    assert "EXEC @main" in run.stdout
    y = np.load(tmp_path / "y.npy")
    assert y.shape == (7, 2)
    np.testing.assert_allclose(y, np.asarray(h(jnp.asarray(x))), **TOL)


def test_cli_verify_compares_runtimes(chapter, capsys):
    art, _ = chapter
    assert main(["verify", str(art.path), "--runtime", "jax", "--runtime", "iree"]) == 0
    out = capsys.readouterr().out
    assert "verify" in out and "OK" in out
    assert out.count("ok   iree") == 3 and out.count("ok   jax") == 3


def test_iree_refuses_an_unknown_mlir_argument(chapter, tmp_path):
    art, _ = chapter
    import shutil

    copy = shutil.copytree(art.path, tmp_path / "edited")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["mlir_arguments"][0] = "params/not_there"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sm.ArtifactError, match="not_there"):
        sm.load(copy, runtime="iree")
