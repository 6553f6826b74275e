"""The same artifact outside JAX: IREE from Python, and IREE's native tools with no Python."""

import hashlib
import importlib
import json
import shutil
import subprocess
from pathlib import Path

import chex
import flax.linen as nn
import iree.compiler
import iree.runtime
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from fuzzing import forge
from helpers import ZOO, zoo_artifact
from iree.compiler.tools.binaries import find_tool

import symjax_mlp as sm
import symjax_mlp._runtimes.iree as iree_rt  # the cache file name: vmfb_cache_key
from symjax_mlp import _files  # the cache location: cache_dir
from symjax_mlp import _selftest as selftest  # vectors: an artifact without them
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


@pytest.fixture(autouse=True)
def user_cache(tmp_path, monkeypatch):
    """Each test its own per-user cache (``$XDG_CACHE_HOME``): none runs what another built."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    assert _files.cache_dir("iree") == tmp_path / "xdg-cache" / "symjax_mlp" / "iree"
    return _files.cache_dir("iree")


@pytest.fixture
def compiles(monkeypatch):
    """Records ``(module, flags)`` of each call of iree.compiler.compile_str (the only place
    IREE compiles)."""
    calls = []
    real = iree.compiler.compile_str

    def counting(module, **kwargs):
        calls.append((bytes(module), kwargs.get("extra_args")))
        return real(module, **kwargs)

    monkeypatch.setattr(iree.compiler, "compile_str", counting)
    return calls


@pytest.fixture
def executed(monkeypatch):
    """Records the bytes of every compiled module IREE is handed to run."""
    modules = []
    real = iree.runtime.VmModule.copy_buffer

    def recording(instance, buffer):
        modules.append(bytes(buffer))
        return real(instance, buffer)

    monkeypatch.setattr(iree.runtime.VmModule, "copy_buffer", staticmethod(recording))
    return modules


def cache_names(compiles):
    """The user's cache entry of each module compiled: keyed by the module's own sha256."""
    return [iree_rt.vmfb_cache_key(hashlib.sha256(m).hexdigest()) for m, _ in compiles]


def declarations(executed):
    """``main``'s declaration in each compiled module IREE ran: its shapes, static or not."""
    instance, found, ran = iree.runtime.VmInstance(), [], list(executed)
    for vmfb in ran:
        module = iree.runtime.VmModule.copy_buffer(instance, vmfb)
        main = module.lookup_function("main")  # (the module must outlive it)
        found.append(main.reflection["iree.abi.declaration"])
    del executed[len(ran) :]  # read here, not run
    return found


def listing(directory):
    return {p.name: p.read_bytes() for p in directory.iterdir()}


@pytest.mark.parametrize(
    ("constraint", "example"), [("t >= 4", (3, 5)), ("t == 2*b", (2, 4))], ids=["ge", "eq"]
)
def test_a_constrained_artifact_loads_in_iree_at_its_self_tests_shapes(
    tmp_path, compiles, constraint, example
):
    """IREE compiled its first module at every symbolic dim 2, which `t >= 4` refuses: load
    failed ("the shapes of the module cannot be resolved"). It compiles the self-test's
    shapes, the example's where the constraints refuse 2, and runs the self-test there."""
    h = sm.hybridize(lambda p, x: x * p + x.mean(axis=1, keepdims=True), jnp.float32(2))
    art = sm.export(h, tmp_path / "m", example=jnp.ones(example), shapes=("b, t",),
                    constraints=(constraint,))  # fmt: skip
    m = sm.load(art.path, runtime="iree")
    assert len(compiles) == 1  # the self-test's module, at the example's shapes
    x = np.asarray(jax.random.normal(jax.random.key(0), example), np.float32)
    np.testing.assert_allclose(m(x), np.asarray(h(x)), **TOL)
    assert len(compiles) == 1


@pytest.mark.slow  # an IREE compile (~1.3 s)
def test_without_self_test_vectors_iree_compiles_a_dimension_term_at_its_value(
    tmp_path, monkeypatch, compiles
):
    """An artifact with no self-test vectors: IREE drew its first module's shapes with each
    symbolic dim 2, which ``"b + 15"`` refuses (b = -13): load failed ("the shapes of the
    module cannot be resolved"). It draws them as export does: 17 rows (b = 2)."""
    h = sm.hybridize(lambda p, x: x[0:16] * p, jnp.float32(2))
    x = np.arange(20, dtype=np.float32)
    sm.export(h, tmp_path / "m", example=(x,), shapes=("b + 15",))
    monkeypatch.setattr(selftest, "vectors", lambda *_: None)  # none, as for an rng-key input
    m = sm.load(tmp_path / "m", runtime="iree", allow={"gather"})
    np.testing.assert_allclose(m(x[:17]), 2 * x[:16], **TOL)
    assert len(compiles) == 1  # 17 rows: the module load compiled


def test_iree_matches_jax_with_a_static_module_per_input_shape_cached_per_user(
    chapter, compiles, executed, user_cache
):
    art, h = chapter
    before = listing(art.path)
    m = sm.load(art.path, runtime="iree")  # compiles the self-test's shapes (batch 2) at once
    assert len(compiles) == 1 and "--iree-llvmcpu-target-cpu=host" in compiles[0][1]
    jax_model = sm.load(art.path)
    for batch in (1, 1000, 1):  # 1 again: the module compiled for it, not another
        x = rand(batch, seed=batch)
        y = m(x)
        assert isinstance(y, np.ndarray) and y.shape == (batch, 2) and y.dtype == np.float32
        np.testing.assert_allclose(y, np.asarray(jax_model(x)), **TOL)
        np.testing.assert_allclose(y, np.asarray(h(x)), **TOL)
    assert len(compiles) == 3  # one static module per batch size: 2, 1, 1000
    shapes = [d.split("%input6: ")[1].split(")")[0] for d in declarations(executed)]
    assert shapes == [f"tensor<{b}x512xf32>" for b in (2, 1, 1000)]
    assert not [d for d in declarations(executed) if "?" in d]
    # the cache: one file per module, in the user's cache directory, none in the artifact
    names = cache_names(compiles)
    assert sorted(p.name for p in user_cache.iterdir()) == sorted(names)  # no temporary litter
    assert len(set(names)) == 3 and all(n.endswith(".vmfb") for n in names)
    assert listing(art.path) == before
    # cached: a fresh load compiles none of them again; the artifact is as exported
    again = sm.load(art.path, runtime="iree")
    for batch in (1, 1000):
        np.testing.assert_allclose(again(rand(batch)), h(rand(batch)), **TOL)
    assert len(compiles) == 3
    assert sm.inspect(art.path).op_counts()["stablehlo.dot_general"] == 3
    np.testing.assert_allclose(sm.load(art.path)(rand(3)), h(rand(3)), rtol=1e-6)
    # a cache entry for another module, IREE version or CPU has another name: left alone
    other = user_cache / f"{'0' * 64}.vmfb"
    other.write_bytes(b"stale")
    sm.load(art.path, runtime="iree")
    assert len(compiles) == 3 and other.read_bytes() == b"stale"
    assert listing(art.path) == before


def _damage(data: bytes, how: str) -> bytes:
    if how == "flipped":
        b = bytearray(data)
        b[len(b) // 2] ^= 0xFF
        return bytes(b)
    if how == "truncated":
        return data[: len(data) // 2]
    if how == "empty":
        return b""
    if how == "stamped":  # another module, stamped with its sha256 but not this user's key
        body = _damage(data, "flipped").partition(b"\n")[2]
        return hashlib.sha256(body).hexdigest().encode() + b"\n" + body
    return b"\x7fELF not a vmfb" * 64  # "junk"


@pytest.fixture(scope="module")
def built(chapter, tmp_path_factory):
    """``$XDG_CACHE_HOME`` as a first IREE load of the chapter left it: the user's key and the
    entry of the self-test's module (batch 2). Each damage below starts from a copy."""
    home = tmp_path_factory.mktemp("built")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(home))
        sm.load(chapter[0].path, runtime="iree")
    return home


@pytest.mark.parametrize("how", ["flipped", "truncated", "empty", "junk", "stamped"])
def test_a_damaged_cache_entry_is_compiled_again_never_trusted(
    chapter, built, compiles, user_cache, how
):
    art, h = chapter
    shutil.copytree(built, user_cache.parent.parent, dirs_exist_ok=True)  # modes, too
    sm.load(art.path, runtime="iree")
    assert compiles == []  # as it was built: trusted
    (cache,) = user_cache.iterdir()  # the self-test's module (batch 2)
    good = cache.read_bytes()
    cache.write_bytes(_damage(good, how))
    m = sm.load(art.path, runtime="iree")
    assert cache_names(compiles) == [cache.name]  # the damaged entry was not run: compiled again
    x = rand(2, seed=2)
    np.testing.assert_allclose(m(x), np.asarray(h(x)), **TOL)
    assert cache.read_bytes() != _damage(good, how)  # and the cache holds the new build
    np.testing.assert_allclose(sm.load(art.path, runtime="iree")(rand(2)), h(rand(2)), **TOL)
    assert len(compiles) == 1


def test_compiled_code_planted_in_the_artifact_is_never_run(
    chapter, tmp_path, compiles, executed, user_cache
):
    """A .vmfb (and a matching .sha256 stamp) in the artifact directory is never loaded:
    compiled code only comes from the user's own cache, keyed by the module's sha256."""
    art, h = chapter
    copy = shutil.copytree(art.path, tmp_path / "art")
    # a real, loadable .vmfb of another program taking the same arguments (the same weights,
    # its output negated): if it ran, every answer would be wrong
    evil = sm.hybridize(lambda p, x: -h.fn(p, x), h.params)
    assert not np.allclose(evil(rand(2)), h(rand(2)), **TOL)
    other = sm.export(evil, tmp_path / "evil", example=rand(1))
    assert other.manifest["mlir_arguments"] == art.manifest["mlir_arguments"]
    sm.load(other.path, runtime="iree")
    planted_vmfb = executed[-1]  # its static module at the self-test's batch
    sm.load(copy, runtime="iree")
    real = cache_names(compiles)[-1]  # the very name the user's cache gives the real one
    for entry in user_cache.iterdir():
        entry.unlink()
    module_sha = hashlib.sha256((copy / "model.mlirbc").read_bytes()).hexdigest()
    names = [
        real,
        iree_rt.vmfb_cache_key(module_sha),
        f"model.iree-{iree_rt.iree_version()}.llvm-cpu-x86_64-0000000000.vmfb",
        "model.vmfb",
    ]
    planted = {}
    for name in names:
        planted[name] = planted_vmfb
        stamp = " ".join([hashlib.sha256(planted_vmfb).hexdigest(), module_sha])
        planted[f"{name}.sha256"] = " ".join([stamp, *iree_rt.compile_flags()]).encode()
    planted["junk.vmfb"] = b"\x7fELF" + bytes(range(256)) * 16
    planted["junk.vmfb.sha256"] = hashlib.sha256(planted["junk.vmfb"]).hexdigest().encode()
    for name, data in planted.items():
        (copy / name).write_bytes(data)
    compiles.clear()
    executed.clear()
    for attempt in range(2):  # compiled into an empty cache, then from the cache
        m = sm.load(copy, runtime="iree")
        for batch in (1, 7):
            x = rand(batch, seed=batch)
            np.testing.assert_allclose(m(x), np.asarray(h(x)), **TOL)
        assert len(compiles) == 3, attempt  # batches 2 (the self-test's), 1 and 7
        assert sorted(p.name for p in user_cache.iterdir()) == sorted(cache_names(compiles))
        assert user_cache.joinpath(real).read_bytes() != planted_vmfb
    assert executed and not [b for b in executed if b in planted.values()]
    for name, data in planted.items():  # untouched
        assert (copy / name).read_bytes() == data, name
    assert sm.inspect(copy).op_counts()["stablehlo.dot_general"] == 3  # the extra files: no harm


def test_iree_checks_shapes_and_dtypes_itself(chapter):
    art, _ = chapter
    m = sm.load(art.path, runtime="iree")  # IREE erases jax's shape assertions
    assert "custom_call" in art.mlir_module()
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
    np.testing.assert_allclose(m(x[:2]), np.asarray(h(x[:2])), **TOL)  # the self-test's batch


@pytest.mark.parametrize("case", [c for c in ZOO if c.name != "linen_dict"], ids=lambda c: c.name)
def test_every_zoo_model_runs_under_iree_as_under_jax(case, tmp_path_factory):
    """Each zoo model's artifact (eval mode), loaded (its self-test passing) and run on two
    inputs of 2 rows, in the module the load compiled for its self-test. A module per further
    batch size is the same program at another static shape: the chapter's, the rank-above-2
    and the results tests compile those (a batch of 1 here cost a compile per model, a third
    of this test's CPU). The artifact is tests/test_zoo.py's, exported once in the run."""

    path = zoo_artifact(tmp_path_factory, case)
    m, want = sm.load(path, runtime="iree"), sm.load(path)
    for seed in (1, 2):
        arrays = [x[:2] for x in case.inputs(seed) if hasattr(x, "shape")]
        chex.assert_trees_all_close(m(*arrays), want(*arrays), rtol=2e-5, atol=2e-5)


class Flatten(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x.reshape((x.shape[0], -1)))


class Tokens(nn.Module):
    """A Dense on (b, t, d), then self-attention over t."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8)(x))
        return nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(x).mean(axis=1)


class PaddedPool(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.max_pool(nn.Conv(4, (3, 3))(x), (2, 2), strides=(2, 2), padding="SAME")
        return nn.Dense(3)(x.reshape((x.shape[0], -1)))


@pytest.mark.parametrize(
    ("model", "shape", "allow"),
    [
        (Flatten(), (2, 3, 4), None),
        (Tokens(), (2, 5, 6), None),
        (PaddedPool(), (2, 7, 7, 3), {"convolution", "reduce_window"}),
    ],
    ids=["flatten", "dense_and_attention_on_b_t_d", "padded_max_pool"],
)
def test_inputs_of_rank_above_2_run_under_iree_with_a_symbolic_batch(
    model, shape, allow, tmp_path, executed
):
    """IREE cannot compile the dynamic reshape of a symbolic batch: every module it runs is
    static, one per batch size (the self-test's 2, then 1), and matches JAX."""
    x = jax.random.normal(jax.random.key(0), shape)
    h = sm.hybridize(model, model.init(jax.random.key(1), x))
    art = sm.export(h, tmp_path / "m", example=x)
    assert art.signature.batch == "b"
    m, want = sm.load(art.path, runtime="iree", allow=allow), sm.load(art.path, allow=allow)
    xb = jax.random.normal(jax.random.key(1), (1, *shape[1:]))
    np.testing.assert_allclose(m(xb), want(xb), rtol=1e-5, atol=3e-6)
    assert len(executed) == 2 and not [d for d in declarations(executed) if "?" in d]


def test_threads_share_a_loaded_model_under_iree(chapter):
    """Calls from several threads, of several batch sizes at once, each get their own rows."""
    import concurrent.futures

    art, h = chapter
    m = sm.load(art.path, runtime="iree")
    xs = [rand(1 + i % 3, seed=i) for i in range(24)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        ys = list(pool.map(m, xs))
    for x, y in zip(xs, ys, strict=True):
        np.testing.assert_allclose(y, np.asarray(h(x)), **TOL)


def test_iree_results_are_the_callers_own_arrays(tmp_path):
    """Several inputs and results, of several shapes and dtypes, some of them an input or a
    weight passed through: each call's results are fresh writable arrays, never IREE's
    buffers (which the next call reuses or the weights live in)."""

    def fn(p, x, y):
        return x, p["w"], jnp.tanh(x @ p["w"]) + y, jnp.argmax(x, axis=1)

    p = {"w": rand(5, 3, seed=1)}
    h = sm.hybridize(fn, p)
    art = sm.export(h, tmp_path / "m", example=(rand(4, 5), rand(4, 3, seed=2)))
    m = sm.load(art.path, runtime="iree")
    first = m(rand(2, 5, seed=3), rand(2, 3, seed=4))
    kept = [np.array(y) for y in first]
    for batch in (2, 1, 2):  # the same static module again, and another one
        x, y = rand(batch, 5, seed=5 + batch), rand(batch, 3, seed=6 + batch)
        got = m(x, y)
        assert [np.asarray(g).dtype for g in got] == [np.float32] * 3 + [np.int32]
        chex.assert_trees_all_close(got, tuple(np.asarray(w) for w in h(x, y)), **TOL)
    for y, k in zip(first, kept, strict=True):  # untouched by the calls since
        assert isinstance(y, np.ndarray) and y.flags.writeable
        np.testing.assert_array_equal(y, k)
    first[1][...] = 0  # a result written to: the model's weights are not
    np.testing.assert_allclose(m(rand(2, 5), rand(2, 3))[1], p["w"], **TOL)


def test_a_float16_model_passes_its_self_test_under_iree(tmp_path):
    """IREE rounds a float16 model's outputs a float16 ulp away from XLA's; the self-test's
    tolerance is in the output's own epsilons (a float32 tolerance refused it)."""
    import flax.linen as nn

    class Half(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(16, dtype=jnp.float16, param_dtype=jnp.float16)(x))
            return nn.Dense(3, dtype=jnp.float16, param_dtype=jnp.float16)(x)

    x = rand(4, 5).astype(jnp.float16)
    net = Half()
    h = sm.hybridize(net, net.init(jax.random.key(1), x))
    art = sm.export(h, tmp_path / "half", example=x)
    y = sm.load(art.path, runtime="iree")(x[:2])  # the self-test runs, under IREE (batch 2)
    eps = float(jnp.finfo(jnp.float16).eps)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(h(x[:2]), np.float32),
                               rtol=4 * eps, atol=4 * eps)  # fmt: skip


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
    # JAX can, once the native kernel is allowed by name (refused by default: a LAPACK kernel
    # trusts the buffer sizes the module declares)
    with pytest.raises(sm.ArtifactError, match=r"allow=\{'custom_call:lapack_spotrf_ffi'\}"):
        sm.load(tmp_path / "linalg")
    m = sm.load(tmp_path / "linalg", allow={"custom_call:lapack_spotrf_ffi"})
    np.testing.assert_allclose(m(x), h(x), rtol=1e-5)
    assert compiles == []  # refused up front, no fallback and no compile attempt

    manifest = json.loads((tmp_path / "cuda" / "manifest.json").read_text())
    manifest["platforms"], manifest["nr_devices"] = ["cpu"], 2
    (tmp_path / "cuda" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sm.ArtifactError, match=r"sharded over 2 devices; IREE runs single"):
        sm.load(tmp_path / "cuda", runtime="iree")
    manifest["nr_devices"], manifest["ordered_effects"] = 1, 1
    (tmp_path / "cuda" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sm.ArtifactError, match=r"ordered effects.*IREE cannot run"):
        sm.load(tmp_path / "cuda", runtime="iree")
    # an rng-key input: IREE's buffers cannot hold one (it was a TypeError from NumPy)
    h = sm.hybridize(lambda p, key, x: x * p + jax.random.normal(key, x.shape), jnp.float32(2))
    sm.export(h, tmp_path / "key", example=(jax.random.key(0), x), batch=None)
    with pytest.raises(sm.ArtifactError, match=r"args\[0\] are JAX rng keys.*runtime='jax'"):
        sm.load(tmp_path / "key", runtime="iree")
    assert compiles == []


def test_iree_compile_failure_is_an_artifact_error(tmp_path, compiles):
    # a consistent artifact (every checksum right, model.mlirbc the module of model.jaxexport)
    # whose program IREE cannot compile: an outfeed, which load refuses unless trusted
    src, _ = forge.base(tmp_path / "base")
    art = forge.forge(src, tmp_path / "m", forge.infeed)
    with pytest.raises(
        sm.ArtifactError, match=r"(?s)stablehlo.outfeed.*allow=\{'create_token', 'outfeed'\}"
    ):
        sm.load(art, runtime="iree")
    assert compiles == []  # refused before anything compiled it
    with pytest.raises(sm.ArtifactError, match=r"model.mlirbc: IREE .* could not compile"):
        sm.load(art, runtime="iree", trust=True)  # IREE's own diagnostic surfaces
    assert len(compiles) == 1
    # a model.mlirbc that is not model.jaxexport's module never reaches IREE, trusted or not
    bad = b"module { func.func @main() { stablehlo.bogus_op } }"
    forge.resign(art, tmp_path / "mixed", files={"model.mlirbc": bad})
    for runtime in ("iree", "jax"):
        with pytest.raises(sm.ArtifactError, match=r"StableHLO module other than model.mlirbc"):
            sm.load(tmp_path / "mixed", runtime=runtime, trust=True)
    assert len(compiles) == 1


def native(path):
    with open(path, "rb") as f:
        assert f.read(4) == b"\x7fELF", f"{path} is not a native executable"
    return str(path)


def test_no_python_iree_compile_and_iree_run_module(chapter, tmp_path):
    """The README recipe: IREE's native tools only; .npy files in, .npy out; a static export
    (the batch it runs), on the local-sync driver."""
    _, h = chapter
    x = np.asarray(rand(7, seed=3))
    art = sm.export(h, tmp_path / "static", example=x, batch=None)
    iree_compile = native(find_tool("iree-compile"))
    runtime_dir = importlib.import_module("iree._runtime_libs").__path__[0]
    iree_run = native(f"{runtime_dir}/iree-run-module")
    # packaging step (any safetensors reader will do): one .npy per argument of main
    weights = safetensors.numpy.load_file(art.path / "params.safetensors")
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
            "--device=local-sync",
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


def test_the_readme_recipe_uses_the_loaders_flags_and_driver():
    """The README's "Run it outside Python" recipe compiles with the flags the loader uses
    and runs on its driver (``local-sync``): the speed the benchmark's IREE rows show."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme[readme.index("### Run it outside Python") :]
    recipe = section[section.index("```bash") : section.index("\n```\n")]
    command = recipe[recipe.index("iree-compile") :].replace("\\\n", " ")
    command = command[: command.index("\n")].split()
    assert command[1:-3] == iree_rt.compile_flags()
    assert iree_rt.DRIVER == "local-sync" and f"--device={iree_rt.DRIVER}" in recipe


@pytest.mark.slow  # both runtimes compiled (~5-6 s): CI runs it with `-m slow`
def test_cli_verify_compares_runtimes(chapter, capsys):
    art, _ = chapter
    assert main(["verify", str(art.path), "--runtime", "jax", "--runtime", "iree"]) == 0
    out = capsys.readouterr().out
    assert "verify" in out and "OK" in out
    assert out.count("ok   iree") == 3 and out.count("ok   jax") == 3


def test_iree_refuses_an_unknown_mlir_argument(chapter, tmp_path):
    art, _ = chapter
    copy = shutil.copytree(art.path, tmp_path / "edited")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["mlir_arguments"][0] = "params/not_there"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sm.ArtifactError, match="not_there"):
        sm.load(copy, runtime="iree")


def test_the_benchmark_times_the_same_vmfb_natively_and_holds_the_iree_targets(chapter, tmp_path):
    """The benchmark's native row runs the .vmfb the loaded model runs at batch 1, in
    iree-benchmark-module; the IREE targets apply where their rows were made."""
    from benchmarks import iree_native, per_request

    art, h = chapter
    x = np.asarray(rand(1, seed=5))
    with iree_native.recording() as vmfbs:
        m = sm.load(art.path, runtime="iree")
        np.testing.assert_allclose(m(x), h(x), **TOL)
    assert "tensor<1x512xf32>" in iree_native.declaration(vmfbs[-1])
    run = iree_native.native_row(vmfbs[-1], art.path, x, tmp_path / "native")
    assert callable(run) and run(20) > 0  # seconds for 20 calls, on the tool's own clock
    refused = iree_native.native_row(vmfbs[0], art.path, x, tmp_path / "other")  # batch 2
    assert refused.startswith("main's arguments are not the weights then the input")

    def row(lo):
        return {"label": "row", "min_s": lo, "median_s": lo, "spread": 0.0}

    rows = {k: row(10e-6) for k in ("dispatch_floor", "aot_constants", "aot_arguments", "h")}
    rows["h_constants"] = row(10e-6)
    names = [t["name"] for t in per_request.per_request_targets(rows)]
    assert not [n for n in names if "iree" in n]  # not asked: no IREE targets
    rows |= {"artifact_iree": row(16e-6), "artifact_iree_native": row(13e-6)}
    targets = {t["name"]: t for t in per_request.per_request_targets(rows)}
    assert targets["iree_over_h"]["value"] == 1.6 and targets["iree_over_h"]["met"] is False
    native = targets["iree_native_over_aot_arguments"]
    assert native["value"] == 1.3 and native["target"] == "<= 1.2" and native["met"] is False


@pytest.mark.slow  # (the README suite: within 10 minutes on 2 cores)
def test_the_per_request_table_has_both_iree_rows_and_their_targets():
    """``bench_per_request(iree=True)``: the IREE rows (from Python, and the same .vmfb in
    iree-benchmark-module) are timed in the same process as h(x), interleaved with it, and the
    table shows them with their targets."""
    from benchmarks import per_request

    r = per_request.bench_per_request(sizes=(8, 2), in_features=16, calls=5, repeats=2, iree=True)
    assert r["skipped"] == {} and r["notes"] == []  # made here, and IREE answers as h does
    rows = r["rows"]
    assert list(rows)[-2:] == ["artifact_iree", "artifact_iree_native"]
    assert all(len(rows[k]["per_call_s"]) == 2 for k in ("h", "artifact_iree"))
    targets = {t["name"]: t for t in r["targets"]}
    iree = targets["iree_over_h"]
    assert iree["target"] == "<= 1.5"
    assert iree["value"] == round(rows["artifact_iree"]["min_s"] / rows["h"]["min_s"], 3)
    assert targets["iree_native_over_aot_arguments"]["target"] == "<= 1.2"
    text = per_request.format_per_request(r)
    for label in ("loaded artifact (IREE)", "the same .vmfb, iree-benchmark-module"):
        assert label in text
    assert "iree_over_h" in text and "iree_native_over_aot_arguments" in text


def test_iree_refuses_int4_inputs_up_front_not_as_a_corrupted_artifact(tmp_path, compiles):
    """IREE's runtime has no buffer type for int4 (NumPy keeps one a byte): load compiled, then
    its self-test failed as "the artifact ... is corrupted, was edited ... Export it again"."""
    import ml_dtypes

    h = sm.hybridize(lambda p, x: x.astype(jnp.float32) * p, jnp.float32(2))
    x = np.ones((2, 3), ml_dtypes.int4)
    sm.export(h, tmp_path / "m", example=x)
    with pytest.raises(sm.ArtifactError, match=r"args\[0\] is int4.*runtime='jax'"):
        sm.load(tmp_path / "m", runtime="iree")
    assert compiles == []
    np.testing.assert_array_equal(sm.load(tmp_path / "m")(x), h(x))
