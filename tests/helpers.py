"""Shared test fixtures and helpers (imported by tests; never a test module itself).

``chapter`` is the chapter's MLP, hybridized, with its batch-1 input.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import symjax_mlp as sm

N_DEVICES = 8  # conftest.py starts JAX with this many virtual CPU devices
# A subprocess's warnings are errors, as the suite's are (pyproject.toml), but one: JAX writes
# a persistent-cache entry in place, and a process reading one that another is still writing
# warns and compiles anew (the suite's processes share one cache: conftest.py).
STRICT_WARNINGS = ("-W", "error", "-W", "ignore:Error reading persistent compilation cache entry")


def bounded(fn, seconds=120):
    """``fn()``'s result, or what it raised, raised; a test failure if it has not returned
    within ``seconds`` (a deadlock, a read that blocks)."""
    result = {}

    def run():
        try:
            result["out"] = fn()
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} did not return within {seconds}s: it hangs"
    if "error" in result:
        raise result["error"]
    return result["out"]


def made_once(tmp_path_factory, name: str, make) -> Path:
    """``<the run's directory>/name``, made by ``make(path)`` once in the test run: pytest-xdist's
    workers (each with its own module fixtures, its basetemp ``<the run's>/popen-gw<n>``) wait
    on one lock and find what the first made. ``make`` leaves the path whole or absent."""
    root = tmp_path_factory.getbasetemp()
    if root.name.startswith("popen-gw"):
        root = root.parent
    path = root / "made_once" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            make(path)
    return path


def zoo_artifact(tmp_path_factory, case, h=None) -> Path:
    """The run's one artifact of a zoo ``case``: its eval-mode model (``h``, or built from the
    case's seeds) exported on its first inputs, by whichever test and worker comes first."""

    def make(path: Path) -> None:
        sm.export(h or case.hybridize(), path, example=case.inputs(0), kwargs=case.eval)

    return made_once(tmp_path_factory, f"zoo/{case.name}", make)


def manifest_edited(src: Path, to: Path, edit) -> Path:
    """A copy of the artifact ``src`` at ``to``, its manifest changed in place by ``edit``: no
    file the manifest hashes is touched, so the copy is whole, as a stranger makes it (a
    signature copied with it no longer covers the manifest)."""
    shutil.copytree(src, to)
    manifest = json.loads((to / "manifest.json").read_text())
    edit(manifest)
    (to / "manifest.json").write_text(json.dumps(manifest))
    return to


@pytest.fixture
def chapter():
    """(net, variables, h, x): mlp((256, 128, 2)) on a (1, 512) float32 input."""
    net = sm.mlp((256, 128, 2))
    x = jax.random.normal(jax.random.key(0), (1, 512), jnp.float32)
    variables = net.init(jax.random.key(1), x)
    return net, variables, sm.hybridize(net, variables), x


def small(seed=0, sizes=(16, 3), features=8):
    """(h, x): a small MLP, hybridized, and a (2, features) float32 input."""
    net = sm.mlp(sizes)
    x = jax.random.normal(jax.random.key(100 + seed), (2, features), jnp.float32)
    return sm.hybridize(net, net.init(jax.random.key(seed), x)), x


def rand(batch, features=8, seed=0):
    """A (batch, features) float32 normal input."""
    return jax.random.normal(jax.random.key(seed), (batch, features), jnp.float32)


# -- a notebook: IPython as Jupyter's kernel runs it -------------------------------------------
@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    """An IPython shell as Jupyter's kernel runs one (its history in memory, no colours): a
    notebook's, for test_day_five.py and test_stranger14.py."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    before = os.environ.get("IPYTHONDIR")
    os.environ["IPYTHONDIR"] = str(tmp_path_factory.mktemp("ipython"))
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    sh = InteractiveShell.instance(config=config, colors="NoColor")
    sh.run_cell("import jax, jax.numpy as jnp, flax.linen as nn\nimport symjax_mlp as sm")
    yield sh
    InteractiveShell.clear_instance()
    if before is None:
        os.environ.pop("IPYTHONDIR", None)
    else:
        os.environ["IPYTHONDIR"] = before


def run_cell(sh, source: str) -> tuple[BaseException | None, str]:
    """Runs one cell: its error, and what the notebook shows under it."""
    from IPython.utils.capture import capture_output

    with capture_output() as shown:
        result = sh.run_cell(source, store_history=True)
    text = [shown.stdout, shown.stderr, *(o.data.get("text/plain", "") for o in shown.outputs)]
    return result.error_in_exec, "".join(text)


# -- the model zoo: ordinary Flax models, as researchers write them ------------------------------
import dataclasses  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import flax  # noqa: E402
import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402


class LinenBatchNorm(nn.Module):
    """Dense -> BatchNorm (batch statistics in train mode) -> relu -> Dense."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(3)(nn.relu(x))


class LinenDropout(nn.Module):
    """Dense -> Dropout (an rng stream in train mode) -> Dense, with a deterministic flag."""

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        x = nn.relu(nn.Dense(16)(x))
        x = nn.Dropout(0.5)(x, deterministic=deterministic)
        return nn.Dense(3)(x)


class LinenTwoInputs(nn.Module):
    """Two inputs of different widths, and a keyword scale."""

    @nn.compact
    def __call__(self, x, y, scale: float = 1.0):
        return (nn.Dense(4)(x) + nn.Dense(4)(y)) * scale


class LinenDict(nn.Module):
    """A dict in, a dict out."""

    @nn.compact
    def __call__(self, batch):
        h = nn.tanh(nn.Dense(8)(batch["x"]))
        return {"logits": nn.Dense(3)(h), "norm": jnp.sum(h * h, axis=-1)}


class LinenDepth(nn.Module):
    """A Python-int depth: how many of its hidden layers a call uses. The names sort apart
    as keys and as joined paths ("hidden" < "hidden-1", but "hidden-1/..." < "hidden/...")."""

    @nn.compact
    def __call__(self, x, depth: int = 3):
        layers = [nn.Dense(8, name=n) for n in ("hidden", "hidden-1", "hidden-2")]
        x = nn.Dense(8, name="stem")(x)
        for layer in layers[:depth]:
            x = nn.relu(layer(x))
        return nn.Dense(2, name="head")(x)


class NnxBatchNorm(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(5, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x, train: bool = False):
        return self.out(nnx.relu(self.norm(self.dense(x), use_running_average=not train)))


class NnxDropout(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(5, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x, deterministic: bool = True):
        return self.out(self.drop(nnx.relu(self.dense(x)), deterministic=deterministic))


class NnxModes(nnx.Module):
    """BatchNorm and Dropout switched as nnx has it: ``module.train()`` / ``module.eval()``
    (their ``use_running_average`` and ``deterministic`` attributes), not a call flag."""

    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(5, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.norm(self.dense(x)))))


class NnxTwoInputs(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(5, 4, rngs=rngs)
        self.b = nnx.Linear(2, 4, rngs=rngs)

    def __call__(self, x, y, scale: float = 1.0):
        return (self.a(x) + self.b(y)) * scale


class NnxDepth(nnx.Module):
    """12 hidden layers of one shape, in a list: paths "hidden/10" sort before "hidden/2"."""

    def __init__(self, rngs: nnx.Rngs):
        self.stem = nnx.Linear(5, 8, rngs=rngs)
        self.hidden = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(12)])
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x, depth: int = 3):
        x = self.stem(x)
        for layer in self.hidden[:depth]:
            x = nnx.relu(layer(x))
        return self.head(x)


def _scaled(params, x, scale=1.0):
    return jnp.tanh(x @ params["w"] + params["b"]) * scale


@dataclasses.dataclass(frozen=True)
class Case:
    """One model of the zoo: how to build it, call it in train and eval mode, and hybridize it.

    Attributes:
      name: the test id.
      kind: ``"linen"``, ``"nnx"`` or ``"fn"``.
      build: ``build() -> (model, params)`` (``params`` is ``None`` for nnx).
      inputs: ``inputs(seed) -> tuple`` of positional inputs.
      train: keyword settings of a training call (state moves, rng drawn).
      eval: keyword settings of an inference call (what export bakes in).
      rng: the linen ``rngs=`` stream keys, or ``None``.
      classes: a classifier's number of classes (what ``sm.training.train`` fits); 0 if the
        model is not one.
      logits: ``logits(out) -> logits``, a classifier's logits picked from its training call's
        output (the ResNet's train function returns ``(logits, new_model_state)``).
      allow: the ops its artifact holds that a default ``sm.load`` refuses (``allow=``), its
        VJP's among them (test_authors_matrix.py exports with ``vjp_order=1``).
      carry: ``carry() -> state``, an equinox state the caller threads through its calls,
        ``out, state = model(*inputs, state)``; ``None`` if it holds none.
      served: ``served() -> (model, params)``, the model as its authors run inference (nnx's
        ``module.eval()``, equinox's ``inference_mode``): what eval mode calls and exports;
        ``None`` if it is ``build()``'s. A setting that is callable is made anew for each run
        of calls (an ``nnx.Rngs`` the calls advance).
      wrt: an nnx model's filter of what it trains, as its authors' ``nnx.DiffState(0, wrt)``
        has it (``None``: ``nnx.Param``); the rest is its state.
      grows: its calls grow its state (a linen ``sow`` inside ``bridge.ToNNX`` appends to a
        tuple), so a compiled Hybrid traces each call anew, as ``nnx.jit`` does.
    """

    name: str
    kind: str
    build: Callable[[], tuple[Any, Any]]
    inputs: Callable[[int], tuple[Any, ...]]
    train: dict = dataclasses.field(default_factory=dict)
    eval: dict = dataclasses.field(default_factory=dict)
    rng: Any = None
    classes: int = 0
    logits: Callable[[Any], Any] = lambda out: out
    allow: frozenset = frozenset()
    carry: Callable[[], Any] | None = None
    served: Callable[[], tuple[Any, Any]] | None = None
    wrt: Any = None
    grows: bool = False

    @property
    def stateful(self) -> bool:
        return self.name in {
            "linen_batchnorm", "linen_dropout", "nnx_batchnorm", "nnx_dropout", "nnx_modes_eval"
        }  # fmt: skip

    def model(self, mode: str = "train") -> tuple[Any, Any]:
        """``(model, params)`` as ``mode`` calls it: ``served()``'s in eval mode, if any."""
        return self.served() if mode == "eval" and self.served else self.build()

    def carries(self, mode: str) -> bool:
        """Whether ``mode``'s calls thread an equinox state (``served()`` holds its own)."""
        return self.carry is not None and not (mode == "eval" and self.served)

    def settings(self, mode: str) -> dict:
        """``mode``'s keyword settings, each callable one made anew."""
        return {k: v() if callable(v) else v for k, v in getattr(self, mode).items()}

    def hybridize(self, mode: str = "train", **kw) -> sm.Hybrid:
        model, params = self.model(mode)
        if params is None:  # an nnx or equinox module
            return sm.hybridize(model, **kw)
        if self.rng is not None:
            kw.setdefault("rngs", self.rng)
        return sm.hybridize(model, params, **kw)


def _x(seed: int, shape=(4, 5)) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _linen(module: nn.Module, *example, **kw) -> Callable[[], tuple[Any, Any]]:
    def build():
        return module, module.init(jax.random.key(42), *example, **kw)

    return build


def _nnx(cls) -> Callable[[], tuple[Any, None]]:
    return lambda: (cls(nnx.Rngs(0, dropout=7)), None)


def _nnx_eval(cls) -> Callable[[], tuple[Any, None]]:
    def build():
        module = cls(nnx.Rngs(0, dropout=7))
        module.eval()
        return module, None

    return build


X, Y = _x(0), _x(1, (4, 2))
ZOO = (
    Case("linen_batchnorm", "linen", _linen(LinenBatchNorm(), X), lambda s: (_x(s),),
         train={"train": True}, eval={"train": False}),
    Case("linen_dropout", "linen", _linen(LinenDropout(), X), lambda s: (_x(s),),
         train={"deterministic": False}, eval={"deterministic": True}, rng=jax.random.key(3)),
    Case("linen_two_inputs", "linen", _linen(LinenTwoInputs(), X, Y),
         lambda s: (_x(s), _x(s + 100, (4, 2))), train={"scale": 2.0}),
    Case("linen_dict", "linen", _linen(LinenDict(), {"x": X}), lambda s: ({"x": _x(s)},)),
    Case("linen_depth", "linen", _linen(LinenDepth(), X), lambda s: (_x(s), 2),
         eval={}),
    Case("nnx_batchnorm", "nnx", _nnx(NnxBatchNorm), lambda s: (_x(s),),
         train={"train": True}, eval={"train": False}),
    Case("nnx_dropout", "nnx", _nnx(NnxDropout), lambda s: (_x(s),),
         train={"deterministic": False}, eval={"deterministic": True}),
    Case("nnx_modes_eval", "nnx", _nnx_eval(NnxModes), lambda s: (_x(s),)),
    Case("nnx_two_inputs", "nnx", _nnx(NnxTwoInputs), lambda s: (_x(s), _x(s + 100, (4, 2))),
         train={"scale": 2.0}),
    Case("nnx_depth", "nnx", _nnx(NnxDepth), lambda s: (_x(s), 11)),
    Case("fn_kwargs", "fn",
         lambda: (_scaled, {"w": np.full((5, 3), 0.1, np.float32), "b": np.zeros(3, np.float32)}),
         lambda s: (_x(s),), train={"scale": 3.0}),
)  # fmt: skip


def reference_calls(
    case: Case, n: int, settings: dict, mode: str = "train"
) -> tuple[list[Any], Any]:
    """``n`` calls of the plain Flax model (no symjax_mlp), carrying state by hand; the model
    ``mode`` calls (``served()``'s in eval mode, if any).

    Returns the outputs and the final state in the form ``Hybrid.state`` holds it: linen's
    mutable collections and rng streams, or the nnx module's non-Param state.
    """
    model, params = case.model(mode)
    outs = []
    if case.kind == "nnx":
        for i in range(n):
            outs.append(model(*case.inputs(i), **settings))
        return outs, nnx.state(model, nnx.Not(case.wrt or nnx.Param))
    if case.kind == "fn":
        return [model(params, *case.inputs(i), **settings) for i in range(n)], None
    variables, key = dict(params), case.rng
    mutable = [c for c in variables if c != "params"]
    for i in range(n):
        rngs = None
        if key is not None:
            key, sub = jax.random.split(key)
            rngs = {"dropout": sub}
        if mutable:
            out, updates = model.apply(
                variables, *case.inputs(i), rngs=rngs, mutable=mutable, **settings
            )
            variables = {**variables, **updates}
        else:
            out = model.apply(variables, *case.inputs(i), rngs=rngs, **settings)
        outs.append(out)
    state = {c: variables[c] for c in mutable}
    if key is not None:
        state["rngs"] = {"dropout": key}
    return outs, state


def pure_state(state):
    """An nnx State as a plain dict; any other tree as it is."""
    if isinstance(state, nnx.State):
        return nnx.to_pure_dict(state)
    return state


def keyless(tree):
    """``tree`` (an nnx State or pytree) with typed rng keys as their raw key data."""

    def data(v):
        return jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v

    return jax.tree.map(data, pure_state(tree))


# -- the authors' own models, as written in their guides (issue 33) ------------------------------
# Kept apart from ZOO: their flags have no defaults, so the ZOO-wide tests cannot call them bare.
from functools import cache, partial  # noqa: E402
from types import SimpleNamespace  # noqa: E402


class DropoutGuideModel(nn.Module):
    """flax docs/guides/dropout.rst: the mode flag has no default."""

    num_neurons: int

    @nn.compact
    def __call__(self, x, training: bool):
        x = nn.Dense(self.num_neurons)(x)
        x = nn.Dropout(rate=0.5, deterministic=not training)(x)
        return x


class BatchNormGuideMLP(nn.Module):
    """flax docs/guides/batch_norm.rst: ``MLP(x, train)``, the flag without a default."""

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(features=4)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.relu(x)
        x = nn.Dense(features=1)(x)
        return x


class SowCNN(nn.Module):
    """flax docs/guides/model_inspection/extracting_intermediates.rst: ``self.sow`` (smaller)."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=4, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        self.sow("intermediates", "features", x)
        x = nn.Dense(features=10)(x)
        x = nn.log_softmax(x)
        return x


class MixerMlpBlock(nn.Module):
    """google-research/vision_transformer vit_jax/models_mixer.py: ``MlpBlock``."""

    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(self.mlp_dim)(x)
        y = nn.gelu(y)
        return nn.Dense(x.shape[-1])(y)


class MixerBlock(nn.Module):
    """vit_jax/models_mixer.py: ``MixerBlock``."""

    tokens_mlp_dim: int
    channels_mlp_dim: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        y = jnp.swapaxes(y, 1, 2)
        y = MixerMlpBlock(self.tokens_mlp_dim, name="token_mixing")(y)
        y = jnp.swapaxes(y, 1, 2)
        x = x + y
        y = nn.LayerNorm()(x)
        return x + MixerMlpBlock(self.channels_mlp_dim, name="channel_mixing")(y)


class MlpMixer(nn.Module):
    """vit_jax/models_mixer.py: ``MlpMixer``, its flag keyword-only, ``*, train`` (einops'
    rearrange written as a reshape)."""

    patches: Any
    num_classes: int
    num_blocks: int
    hidden_dim: int
    tokens_mlp_dim: int
    channels_mlp_dim: int
    model_name: str | None = None

    @nn.compact
    def __call__(self, inputs, *, train):
        del train
        x = nn.Conv(self.hidden_dim, self.patches.size, strides=self.patches.size, name="stem")(
            inputs
        )
        x = x.reshape(x.shape[0], -1, x.shape[-1])  # 'n h w c -> n (h w) c'
        for _ in range(self.num_blocks):
            x = MixerBlock(self.tokens_mlp_dim, self.channels_mlp_dim)(x)
        x = nn.LayerNorm(name="pre_head_layer_norm")(x)
        x = jnp.mean(x, axis=1)
        if self.num_classes:
            x = nn.Dense(self.num_classes, kernel_init=nn.initializers.zeros, name="head")(x)
        return x


def mixer() -> MlpMixer:
    """A tiny MlpMixer for (n, 8, 8, 1) images."""
    patches = SimpleNamespace(size=(4, 4))
    return MlpMixer(patches, num_classes=10, num_blocks=1, hidden_dim=8, tokens_mlp_dim=4,
                    channels_mlp_dim=8)  # fmt: skip


def trained_head(variables):
    """``variables`` with their ``head`` kernel drawn, as after training: vit_jax initializes it
    to zeros (fine-tuning's start), which makes every logit 0 and every grad through them 0."""
    head = variables["params"]["head"]
    head = {**head, "kernel": jax.random.normal(jax.random.key(1), head["kernel"].shape)}
    return {**variables, "params": {**variables["params"], "head": head}}


def _mixer():
    return mixer(), trained_head(mixer().init(jax.random.key(42), IMAGES, train=False))


class TutorialCNN(nnx.Module):
    """flax docs_nnx/mnist_tutorial: the CNN, its dropout drawing from ``rngs`` passed in."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        x = self.linear2(x)
        return x


# -- flax docs_nnx/nnx_basics.md, as written there (google/flax@18f8f311c275d57f46d95e41b15aa97b
# 454754c0, https://github.com/google/flax/blob/main/docs_nnx/nnx_basics.md); sizes made tiny
class Linear(nnx.Module):
    """nnx_basics: a Linear of its own ``nnx.Param`` s."""

    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.w = nnx.Param(rngs.params.uniform((din, dout)))
        self.b = nnx.Param(jnp.zeros((dout,)))
        self.din, self.dout = din, dout

    def __call__(self, x: jax.Array):
        return x @ self.w + self.b[None]


class MLP(nnx.Module):
    """nnx_basics: Dropout and BatchNorm in training mode as attributes, the dropout's
    ``rngs`` a required argument of the call."""

    def __init__(self, din: int, dmid: int, dout: int, *, rngs: nnx.Rngs):
        self.linear1 = Linear(din, dmid, rngs=rngs)
        self.dropout = nnx.Dropout(rate=0.1, deterministic=False)
        self.bn = nnx.BatchNorm(dmid, use_running_average=False, rngs=rngs)
        self.linear2 = Linear(dmid, dout, rngs=rngs)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs):
        x = nnx.gelu(self.dropout(self.bn(self.linear1(x)), rngs=rngs))
        return self.linear2(x)


class LoraParam(nnx.Param):
    pass


class LoraLinear(nnx.Module):
    """nnx_basics' model surgery: a subclass of ``nnx.Param`` beside the wrapped Linear's."""

    def __init__(self, linear: Linear, rank: int, rngs: nnx.Rngs):
        self.linear = linear
        self.A = LoraParam(rngs.normal((linear.din, rank)))
        self.B = LoraParam(rngs.normal((rank, linear.dout)))

    def __call__(self, x: jax.Array):
        return self.linear(x) + x @ self.A @ self.B


class Count(nnx.Variable):
    pass


class StatefulLinear(nnx.Module):
    """nnx_basics: a custom ``nnx.Variable`` type, a uint32 count raised by every call."""

    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.w = nnx.Param(rngs.uniform((din, dout)))
        self.b = nnx.Param(jnp.zeros((dout,)))
        self.count = Count(jnp.array(0, dtype=jnp.uint32))

    def __call__(self, x: jax.Array):
        # the guide's `self.count.value += 1` warns in flax 0.12: its Counter's form
        self.count[...] += 1
        return x @ self.w + self.b


@nnx.vmap(in_axes=0, out_axes=0)
def create_model(rngs):
    """nnx_basics' scan over layers: a stack of MLPs, one per key (``MLP(10, 32, 10)``)."""
    return MLP(5, 8, 5, rngs=rngs)


@nnx.scan(in_axes=(0, 0, nnx.Carry), out_axes=nnx.Carry)
def forward(model: MLP, rngs: nnx.Rngs, x):
    """nnx_basics: each MLP of the stack applied in turn, its BatchNorm's statistics moved."""
    x = model(x, rngs)
    return x


def _lora(mode: str) -> Callable[[], tuple[Any, None]]:
    def build():
        rngs = nnx.Rngs(0)
        model = MLP(5, 16, 3, rngs=rngs)
        # Model surgery.
        model.linear1 = LoraLinear(model.linear1, 4, rngs=rngs)
        model.linear2 = LoraLinear(model.linear2, 4, rngs=rngs)
        if mode == "eval":
            model.eval()  # dropout off, the running statistics used
        return model, None

    return build


def stack_forward(model, x, rngs=None):
    """nnx_basics' ``forward(model, rngs, x)`` with ``x`` first: the inputs before the
    settings, as a Hybrid and an export take them (``rngs=None``: its eval mode)."""
    return forward(model, rngs, x)


def _stack(mode: str) -> Callable[[], tuple[Any, Any]]:
    """``(stack_forward, model)``: the guide's ``nnx.Rngs(0).fork(split=5)`` is
    ``nnx.Rngs(0).split(3)`` in flax 0.12 (fork's ``split=`` is deprecated)."""

    def build():
        model = create_model(nnx.Rngs(0).split(3))
        if mode == "eval":
            model.eval()
        return stack_forward, model

    return build


# -- flax docs_nnx/examples/minigpt.md (google/flax@18f8f311c275d57f46d95e41b15aa97b454754c0):
# its layers as written, less their tensor-parallel sharding (the ``kernel_metadata`` /
# ``bias_metadata`` / ``scale_metadata`` out_shardings, ``out_sharding=`` and ``reshard``: the
# guide's mesh is not set here); docstrings and comments shortened
class TransformerBlock(nnx.Module):
    """A single Transformer block: nnx.MultiHeadAttention (causal), Dropouts drawing from the
    rngs they hold, an ``nnx.Sequential`` MLP."""

    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, *, rngs: nnx.Rngs,
                 rate: float = 0.1):  # fmt: skip
        self.mha = nnx.MultiHeadAttention(num_heads=num_heads, in_features=embed_dim, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=rate, rngs=rngs)
        self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(in_features=embed_dim, out_features=ff_dim, rngs=rngs),
            nnx.relu,
            nnx.Linear(in_features=ff_dim, out_features=embed_dim, rngs=rngs),
            nnx.Dropout(rate=rate, rngs=rngs),
        )
        self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)

    # Apply the Transformer block to the input sequence.
    def __call__(self, inputs):
        # Instantiate the causal attention mask.
        attention_output = self.mha(inputs_q=inputs, is_causal=True, decode=False)
        attention_output = self.dropout1(attention_output)
        out1 = self.layer_norm1(inputs + attention_output)
        ffn_output = self.mlp(out1)
        return self.layer_norm2(out1 + ffn_output)


class TokenAndPositionEmbedding(nnx.Module):
    """Token embeddings (``nnx.Embed`` of int tokens) plus positional ones."""

    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
        self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

    def __call__(self, x):
        # Generate a sequence of positions for the input tokens.
        positions = jnp.arange(0, x.shape[1])[None, :]
        position_embedding = self.pos_emb(positions)
        token_embedding = self.token_emb(x)
        return token_embedding + position_embedding


class MiniGPT(nnx.Module):
    """A miniGPT: embeddings, an ``nnx.Sequential`` of TransformerBlocks, logits per token."""

    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, num_heads: int,
                 feed_forward_dim: int, num_transformer_blocks: int, rngs: nnx.Rngs):  # fmt: skip
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim, rngs=rngs)
        self.transformer_blocks = nnx.Sequential(*[TransformerBlock(
            embed_dim, num_heads, feed_forward_dim, rngs=rngs
        ) for _ in range(num_transformer_blocks)])  # fmt: skip
        self.output_layer = nnx.Linear(in_features=embed_dim, out_features=vocab_size, rngs=rngs)

    def __call__(self, inputs):
        x = self.embedding_layer(inputs)
        # Apply each transformer block sequentially to the embedded input
        x = self.transformer_blocks(x)
        return self.output_layer(x)


def _minigpt(mode: str) -> Callable[[], tuple[Any, None]]:
    def build():
        model = MiniGPT(8, 16, 8, 2, 16, 1, rngs=nnx.Rngs(0))
        if mode == "eval":
            model.eval()  # the Dropouts off
        return model, None

    return build


# -- equinox's examples (an optional dependency: without it these are None and the tests skip) --
try:
    import equinox as eqx
except ImportError:  # pragma: no cover - the test extra installs it
    eqx = None

if eqx is not None:

    class EqxCNN(eqx.Module):
        """equinox examples/mnist.ipynb: the CNN, one (1, 28, 28) image per call."""

        layers: list

        def __init__(self, key):
            key1, key2, key3, key4 = jax.random.split(key, 4)
            self.layers = [
                eqx.nn.Conv2d(1, 3, kernel_size=4, key=key1),
                eqx.nn.MaxPool2d(kernel_size=2),
                jax.nn.relu,
                jnp.ravel,
                eqx.nn.Linear(1728, 512, key=key2),
                jax.nn.sigmoid,
                eqx.nn.Linear(512, 64, key=key3),
                jax.nn.relu,
                eqx.nn.Linear(64, 10, key=key4),
                jax.nn.log_softmax,
            ]

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    class EqxStateful(eqx.Module):
        """equinox examples/stateful.ipynb: BatchNorm and SpectralNorm with ``eqx.nn.State``
        (``mode="batch"``, as equinox now asks)."""

        norm1: eqx.nn.BatchNorm
        spectral_linear: eqx.nn.SpectralNorm
        norm2: eqx.nn.BatchNorm
        linear1: eqx.nn.Linear
        linear2: eqx.nn.Linear

        def __init__(self, key):
            key1, key2, key3, key4 = jax.random.split(key, 4)
            self.norm1 = eqx.nn.BatchNorm(input_size=3, axis_name="batch", mode="batch")
            self.spectral_linear = eqx.nn.SpectralNorm(
                layer=eqx.nn.Linear(in_features=3, out_features=32, key=key1),
                weight_name="weight",
                key=key2,
            )
            self.norm2 = eqx.nn.BatchNorm(input_size=32, axis_name="batch", mode="batch")
            self.linear1 = eqx.nn.Linear(in_features=32, out_features=32, key=key3)
            self.linear2 = eqx.nn.Linear(in_features=32, out_features=3, key=key4)

        def __call__(self, x, state):
            x, state = self.norm1(x, state)
            x, state = self.spectral_linear(x, state)
            x = jax.nn.relu(x)
            x, state = self.norm2(x, state)
            x = self.linear1(x)
            x = jax.nn.relu(x)
            x = self.linear2(x)
            return x, state

    class EqxDropout(eqx.Module):
        """equinox's eqx.nn.Dropout docs: a ``key=`` per call, ``inference`` a field."""

        linear: eqx.nn.Linear
        dropout: eqx.nn.Dropout

        def __init__(self, key):
            self.linear = eqx.nn.Linear(5, 8, key=key)
            self.dropout = eqx.nn.Dropout(p=0.5)

        def __call__(self, x, *, key=None):
            return self.dropout(self.linear(x), key=key)

    class EqxRNN(eqx.Module):
        """equinox examples/train_rnn.ipynb: a GRU over a sequence, one sequence per call."""

        hidden_size: int
        cell: eqx.Module
        linear: eqx.nn.Linear
        bias: jax.Array

        def __init__(self, in_size, out_size, hidden_size, *, key):
            ckey, lkey = jax.random.split(key)
            self.hidden_size = hidden_size
            self.cell = eqx.nn.GRUCell(in_size, hidden_size, key=ckey)
            self.linear = eqx.nn.Linear(hidden_size, out_size, use_bias=False, key=lkey)
            self.bias = jnp.zeros(out_size)

        def __call__(self, input):
            hidden = jnp.zeros((self.hidden_size,))

            def f(carry, inp):
                return self.cell(inp, carry), None

            out, _ = jax.lax.scan(f, hidden, input)
            # sigmoid because we're performing binary classification
            return jax.nn.sigmoid(self.linear(out) + self.bias)

    class AttentionBlock(eqx.Module):
        """equinox examples/bert.ipynb: ``AttentionBlock`` (eqx.nn.MultiheadAttention, a
        sequence-level mask made a (heads, seq, seq) one)."""

        attention: eqx.nn.MultiheadAttention
        layernorm: eqx.nn.LayerNorm
        dropout: eqx.nn.Dropout
        num_heads: int = eqx.field(static=True)

        def __init__(self, hidden_size, num_heads, dropout_rate, attention_dropout_rate, key):
            self.num_heads = num_heads
            self.attention = eqx.nn.MultiheadAttention(
                num_heads=num_heads, query_size=hidden_size, use_query_bias=True,
                use_key_bias=True, use_value_bias=True, use_output_bias=True,
                dropout_p=attention_dropout_rate, key=key,
            )  # fmt: skip
            self.layernorm = eqx.nn.LayerNorm(shape=hidden_size)
            self.dropout = eqx.nn.Dropout(dropout_rate)

        def __call__(self, inputs, mask, enable_dropout: bool = False, key=None):
            if mask is not None:
                mask = self.make_self_attention_mask(mask)
            attention_key, dropout_key = (None, None) if key is None else jax.random.split(key)
            attention_output = self.attention(
                query=inputs, key_=inputs, value=inputs, mask=mask,
                inference=not enable_dropout, key=attention_key,
            )  # fmt: skip
            result = self.dropout(attention_output, inference=not enable_dropout, key=dropout_key)
            result = result + inputs
            return jax.vmap(self.layernorm)(result)

        def make_self_attention_mask(self, mask):
            mask = jnp.multiply(jnp.expand_dims(mask, axis=-1), jnp.expand_dims(mask, axis=-2))
            mask = jnp.expand_dims(mask, axis=-3)
            mask = jnp.repeat(mask, repeats=self.num_heads, axis=-3)
            return mask.astype(jnp.float32)

    class FeedForwardBlock(eqx.Module):
        """examples/bert.ipynb: ``FeedForwardBlock``, one token per call."""

        mlp: eqx.nn.Linear
        output: eqx.nn.Linear
        layernorm: eqx.nn.LayerNorm
        dropout: eqx.nn.Dropout

        def __init__(self, hidden_size, intermediate_size, dropout_rate, key):
            mlp_key, output_key = jax.random.split(key)
            self.mlp = eqx.nn.Linear(hidden_size, intermediate_size, key=mlp_key)
            self.output = eqx.nn.Linear(intermediate_size, hidden_size, key=output_key)
            self.layernorm = eqx.nn.LayerNorm(shape=hidden_size)
            self.dropout = eqx.nn.Dropout(dropout_rate)

        def __call__(self, inputs, enable_dropout: bool = True, key=None):
            hidden = jax.nn.gelu(self.mlp(inputs))
            output = self.dropout(self.output(hidden), inference=not enable_dropout, key=key)
            output += inputs
            return self.layernorm(output)

    class TransformerLayer(eqx.Module):
        """examples/bert.ipynb: ``TransformerLayer``, one (seq_len, hidden) sequence per
        call, its dropout switched by the keyword-only ``enable_dropout``."""

        attention_block: AttentionBlock
        ff_block: FeedForwardBlock

        def __init__(self, hidden_size, intermediate_size, num_heads, dropout_rate,
                     attention_dropout_rate, key):  # fmt: skip
            attention_key, ff_key = jax.random.split(key)
            self.attention_block = AttentionBlock(
                hidden_size, num_heads, dropout_rate, attention_dropout_rate, attention_key
            )
            self.ff_block = FeedForwardBlock(hidden_size, intermediate_size, dropout_rate, ff_key)

        def __call__(self, inputs, mask=None, *, enable_dropout: bool = False, key=None):
            attn_key, ff_key = (None, None) if key is None else jax.random.split(key)
            attention_output = self.attention_block(
                inputs, mask, enable_dropout=enable_dropout, key=attn_key
            )
            seq_len = inputs.shape[0]
            ff_keys = None if ff_key is None else jax.random.split(ff_key, num=seq_len)
            return jax.vmap(self.ff_block, in_axes=(0, None, 0))(
                attention_output, enable_dropout, ff_keys
            )

    # equinox docs/examples/vision_transformer.ipynb, as written there (patrick-kidger/equinox
    # @9336d820b2ef66b360fc6cb3611b3da5cefbb14d): einops' rearrange written as a reshape
    # (einops is not a dependency), the notebook's global `channels` a constant here
    import jax.random as jr
    from jaxtyping import Array, Float, PRNGKeyArray

    channels = 3

    class PatchEmbedding(eqx.Module):
        linear: eqx.nn.Embedding
        patch_size: int

        def __init__(
            self,
            input_channels: int,
            output_shape: int,
            patch_size: int,
            key: PRNGKeyArray,
        ):
            self.patch_size = patch_size

            self.linear = eqx.nn.Linear(
                self.patch_size**2 * input_channels,
                output_shape,
                key=key,
            )

        def __call__(
            self,
            x: Float[Array, "channels height width"],  # noqa: F722
        ) -> Float[Array, "num_patches embedding_dim"]:  # noqa: F722
            c, ph, pw = x.shape[0], self.patch_size, self.patch_size  # "c (h ph) (w pw) ->
            h, w = x.shape[1] // ph, x.shape[2] // pw  # (h w) (c ph pw)"
            x = x.reshape(c, h, ph, w, pw).transpose(1, 3, 0, 2, 4).reshape(h * w, c * ph * pw)
            x = jax.vmap(self.linear)(x)

            return x

    class VitAttentionBlock(eqx.Module):
        """The notebook's ``AttentionBlock`` (renamed: BERT's is ``AttentionBlock`` here)."""

        layer_norm1: eqx.nn.LayerNorm
        layer_norm2: eqx.nn.LayerNorm
        attention: eqx.nn.MultiheadAttention
        linear1: eqx.nn.Linear
        linear2: eqx.nn.Linear
        dropout1: eqx.nn.Dropout
        dropout2: eqx.nn.Dropout

        def __init__(
            self,
            input_shape: int,
            hidden_dim: int,
            num_heads: int,
            dropout_rate: float,
            key: PRNGKeyArray,
        ):
            key1, key2, key3 = jr.split(key, 3)

            self.layer_norm1 = eqx.nn.LayerNorm(input_shape)
            self.layer_norm2 = eqx.nn.LayerNorm(input_shape)
            self.attention = eqx.nn.MultiheadAttention(num_heads, input_shape, key=key1)

            self.linear1 = eqx.nn.Linear(input_shape, hidden_dim, key=key2)
            self.linear2 = eqx.nn.Linear(hidden_dim, input_shape, key=key3)
            self.dropout1 = eqx.nn.Dropout(dropout_rate)
            self.dropout2 = eqx.nn.Dropout(dropout_rate)

        def __call__(
            self,
            x: Float[Array, "num_patches embedding_dim"],  # noqa: F722
            enable_dropout: bool,
            key: PRNGKeyArray,
        ) -> Float[Array, "num_patches embedding_dim"]:  # noqa: F722
            input_x = jax.vmap(self.layer_norm1)(x)
            x = x + self.attention(input_x, input_x, input_x)

            input_x = jax.vmap(self.layer_norm2)(x)
            input_x = jax.vmap(self.linear1)(input_x)
            input_x = jax.nn.gelu(input_x)

            key1, key2 = jr.split(key, num=2)

            input_x = self.dropout1(input_x, inference=not enable_dropout, key=key1)
            input_x = jax.vmap(self.linear2)(input_x)
            input_x = self.dropout2(input_x, inference=not enable_dropout, key=key2)

            x = x + input_x

            return x

    class VisionTransformer(eqx.Module):
        patch_embedding: PatchEmbedding
        positional_embedding: jnp.ndarray
        cls_token: jnp.ndarray
        attention_blocks: list[VitAttentionBlock]
        dropout: eqx.nn.Dropout
        mlp: eqx.nn.Sequential
        num_layers: int

        def __init__(
            self,
            embedding_dim: int,
            hidden_dim: int,
            num_heads: int,
            num_layers: int,
            dropout_rate: float,
            patch_size: int,
            num_patches: int,
            num_classes: int,
            key: PRNGKeyArray,
        ):
            key1, key2, key3, key4, key5 = jr.split(key, 5)

            self.patch_embedding = PatchEmbedding(channels, embedding_dim, patch_size, key1)

            self.positional_embedding = jr.normal(key2, (num_patches + 1, embedding_dim))

            self.cls_token = jr.normal(key3, (1, embedding_dim))

            self.num_layers = num_layers

            self.attention_blocks = [
                VitAttentionBlock(embedding_dim, hidden_dim, num_heads, dropout_rate, key4)
                for _ in range(self.num_layers)
            ]

            self.dropout = eqx.nn.Dropout(dropout_rate)

            self.mlp = eqx.nn.Sequential(
                [
                    eqx.nn.LayerNorm(embedding_dim),
                    eqx.nn.Linear(embedding_dim, num_classes, key=key5),
                ]
            )

        def __call__(
            self,
            x: Float[Array, "channels height width"],  # noqa: F722
            enable_dropout: bool,
            key: PRNGKeyArray,
        ) -> Float[Array, "num_classes"]:  # noqa: F821, UP037
            x = self.patch_embedding(x)

            x = jnp.concatenate((self.cls_token, x), axis=0)

            x += self.positional_embedding[
                : x.shape[0]
            ]  # Slice to the same length as x, as the positional embedding may be longer.

            dropout_key, *attention_keys = jr.split(key, num=self.num_layers + 1)

            x = self.dropout(x, inference=not enable_dropout, key=dropout_key)

            for block, attention_key in zip(self.attention_blocks, attention_keys):  # noqa: B905
                x = block(x, enable_dropout, key=attention_key)

            x = x[0]  # Select the CLS token.
            x = self.mlp(x)

            return x


IMAGES = _x(0, (2, 8, 8, 1))
#: the authors' linen models as a zoo (apart from ZOO: their flags have no defaults)
AUTHORS = (
    Case("dropout_guide", "linen", _linen(DropoutGuideModel(8), X, training=False),
         lambda s: (_x(s),), train={"training": True}, eval={"training": False},
         rng=jax.random.key(3), classes=8),
    Case("batch_norm_guide", "linen", _linen(BatchNormGuideMLP(), X, train=False),
         lambda s: (_x(s),), train={"train": True}, eval={"train": False}),
    Case("mixer", "linen", _mixer,
         lambda s: (_x(s, (2, 8, 8, 1)),), train={"train": True}, eval={"train": False},
         classes=10, allow=frozenset({"convolution"})),
)  # fmt: skip


# -- every family of issue 33, as its authors write it and run it: the matrix's cases -----------
def _tutorial_cnn(mode: str) -> Callable[[], tuple[Any, None]]:
    def build():
        module = TutorialCNN(rngs=nnx.Rngs(0))
        if mode == "eval":
            module.eval()  # the tutorial's evaluation mode: dropout off, running statistics
        return module, None

    return build


def _ints(seed: int, shape: tuple[int, ...], high: int) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 0, high, jnp.int32)


if eqx is not None:

    def state_batch(model, x, state):
        """equinox examples/stateful.ipynb: a batch through the model, the batch axis named
        for BatchNorm, one state shared by the batch."""
        run = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        return run(x, state)

    def evaluate(model, xs):
        """examples/stateful.ipynb: inference with the state held in the model (discarded)."""
        out, _ = jax.vmap(model)(xs)
        return out

    def keyed_batch(model, x, *, key=None):
        """A batch through a per-example model drawing dropout: a key per example, as
        examples/bert.ipynb splits them."""
        keys = None if key is None else jax.random.split(key, x.shape[0])
        return jax.vmap(model)(x, key=keys)

    def bert_batch(layer, inputs, mask, *, enable_dropout=False, key=None):
        """examples/bert.ipynb's training step: ``jax.vmap(functools.partial(model,
        enable_dropout=True))(inputs, key=keys)``."""
        keys = None if key is None else jax.random.split(key, inputs.shape[0])
        return jax.vmap(partial(layer, enable_dropout=enable_dropout))(inputs, mask, key=keys)

    def _stateful():
        return eqx.nn.make_with_state(EqxStateful)(jax.random.key(0))

    @cache
    def _stateful_trained():
        """``_stateful()`` after two batches, its state moved as after training (run once:
        eager equinox runs op by op; a module and its ``eqx.nn.State`` are immutable)."""
        model, state = _stateful()
        for i in range(2):
            _, state = state_batch(model, _x(50 + i, (4, 3)), state)
        return model, state

    def _stateful_served():
        model, state = _stateful_trained()
        return evaluate, eqx.Partial(eqx.nn.inference_mode(model), state=state)

    def vit_batch(model, images, *, enable_dropout=False, key=None):
        """vision_transformer.ipynb's calls: ``jax.vmap(functools.partial(model,
        enable_dropout=...))(images, key=jax.random.split(key, num=batch_size))``; its
        evaluation's fixed ``key`` when none is given (no dropout draws from it then)."""
        key = jr.key(2003) if key is None else key
        keys = jax.random.split(key, num=images.shape[0])
        return jax.vmap(partial(model, enable_dropout=enable_dropout))(images, key=keys)

    def _vit():
        return VisionTransformer(embedding_dim=8, hidden_dim=8, num_heads=2, num_layers=1,
                                 dropout_rate=0.1, patch_size=4, num_patches=4,
                                 num_classes=10, key=jr.key(2003))  # fmt: skip

    def _bert():
        return TransformerLayer(8, 16, 2, 0.1, 0.1, key=jax.random.key(0))

    def _bert_inputs(seed: int) -> tuple[jax.Array, jax.Array]:
        mask = (jnp.arange(6) < 6 - seed % 3).astype(jnp.int32)  # padding at the end
        return _x(seed, (4, 6, 8)), jnp.broadcast_to(mask, (4, 6))

    _EQX = (
        Case("eqx_mlp", "eqx",
             lambda: (eqx.filter_vmap(eqx.nn.MLP(5, 3, 8, 2, key=jax.random.key(0))), None),
             lambda s: (_x(s),), classes=3),
        Case("eqx_cnn", "eqx", lambda: (eqx.filter_vmap(EqxCNN(jax.random.key(0))), None),
             lambda s: (_x(s, (2, 1, 28, 28)),), classes=10,
             allow=frozenset({"convolution", "reduce_window", "select_and_scatter",
                              "real_dynamic_slice"})),
        Case("eqx_dropout", "eqx", lambda: (keyed_batch, EqxDropout(jax.random.key(0))),
             lambda s: (_x(s),), train={"key": jax.random.key(1)},
             served=lambda: (keyed_batch, eqx.nn.inference_mode(EqxDropout(jax.random.key(0))))),
        Case("eqx_stateful", "eqx", lambda: (state_batch, _stateful()[0]),
             lambda s: (_x(s, (4, 3)),), carry=lambda: _stateful()[1], served=_stateful_served),
        Case("eqx_rnn", "eqx",
             lambda: (eqx.filter_vmap(EqxRNN(2, 1, 16, key=jax.random.key(0))), None),
             lambda s: (_x(s, (4, 16, 2)),),
             allow=frozenset({"real_dynamic_slice", "dynamic_update_slice"})),
        Case("eqx_bert", "eqx", lambda: (bert_batch, _bert()), _bert_inputs,
             train={"enable_dropout": True, "key": jax.random.key(1)}),
        Case("eqx_vit", "eqx", lambda: (vit_batch, _vit()), lambda s: (_x(s, (2, 3, 8, 8)),),
             train={"enable_dropout": True, "key": jax.random.key(1)},
             eval={"enable_dropout": False}, classes=10,
             allow=frozenset({"real_dynamic_slice"})),
    )  # fmt: skip
else:  # pragma: no cover - the test extra installs equinox
    _EQX = ()


def init_random_params(scale, layer_sizes, rng=None):
    """JAX's examples/mnist_classifier_fromscratch.py: a list of ``(W, b)`` pairs, NumPy
    float64 (``rng`` a fixed ``npr.RandomState(0)`` there)."""
    rng = np.random.RandomState(0) if rng is None else rng
    pairs = zip(layer_sizes[:-1], layer_sizes[1:], strict=True)  # noqa: RUF007 (JAX's code)
    return [(scale * rng.randn(m, n), scale * rng.randn(n)) for m, n in pairs]


def predict(params, inputs):
    """examples/mnist_classifier_fromscratch.py: ``predict``, log-probabilities out."""
    activations = inputs
    for w, b in params[:-1]:
        outputs = jnp.dot(activations, w) + b
        activations = jnp.tanh(outputs)

    final_w, final_b = params[-1]
    logits = jnp.dot(activations, final_w) + final_b
    return logits - jax.scipy.special.logsumexp(logits, axis=1, keepdims=True)


# -- the JAX README's first example (jax-ml/jax@0018baf96ec58789df27bd512694efa19ee38092,
# README.md): per-example gradients, a jit of a vmap of a jit of a grad, params a list of pairs
# and two batched inputs in, a list of (W, b) pairs of per-example grads out; its `predict` and
# `loss` are `readme_predict` and `readme_loss` here (the from-scratch `predict` is above)
def readme_predict(params, inputs):
    for W, b in params:
        outputs = jnp.dot(inputs, W) + b
        inputs = jnp.tanh(outputs)  # inputs to the next layer
    return outputs  # no activation on last layer


def readme_loss(params, inputs, targets):
    preds = readme_predict(params, inputs)
    return jnp.sum((preds - targets) ** 2)


grad_loss = jax.jit(jax.grad(readme_loss))  # compiled gradient evaluation function
perex_grads = jax.jit(jax.vmap(grad_loss, in_axes=(None, 0, 0)))  # fast per-example grads


def flat_perex_grads(params, inputs, targets):
    """``perex_grads`` as export's refusal of its list of pairs says: its leaves, a tuple."""
    return tuple(jax.tree.leaves(perex_grads(params, inputs, targets)))


# -- flax examples/sst2/models.py, as written there (google/flax@18f8f311c275d57f46d95e41b15aa97b
# 454754c0): a bidirectional LSTM (nn.scan of an OptimizedLSTMCell) over int tokens, their int
# lengths a second input, `deterministic` merged from attribute and call (nn.merge_param), word
# dropout drawing `make_rng('dropout')`; its `MLP` is `Sst2MLP` here (nnx_basics' is `MLP`)
Array = jnp.ndarray


def sequence_mask(lengths: Array, max_length: int) -> Array:
    """Computes a boolean mask over sequence positions for each given length."""
    return jnp.arange(max_length)[None] < lengths[:, None]


@jax.vmap
def flip_sequences(inputs: Array, lengths: Array) -> Array:
    """Flips a sequence of inputs along the time dimension, the padding kept at the end."""
    # Note: since this function is vmapped, the code below is effectively for
    # a single example.
    max_length = inputs.shape[0]
    return jnp.flip(jnp.roll(inputs, max_length - lengths, axis=0), axis=0)


class WordDropout(nn.Module):
    """Applies word dropout to a batch of input IDs."""

    dropout_rate: float
    unk_idx: int
    deterministic: bool | None = None

    @nn.compact
    def __call__(self, inputs: Array, deterministic: bool | None = None):
        deterministic = nn.module.merge_param("deterministic", self.deterministic, deterministic)
        if deterministic or self.dropout_rate == 0.0:
            return inputs
        rng = self.make_rng("dropout")
        mask = jax.random.bernoulli(rng, p=self.dropout_rate, shape=inputs.shape)
        return jnp.where(mask, jnp.array([self.unk_idx]), inputs)


class Embedder(nn.Module):
    """Embeds batches of token IDs into feature space."""

    vocab_size: int
    embedding_size: int
    embedding_init: Callable[..., Array] = nn.initializers.normal(stddev=0.1)
    frozen: bool = False
    dropout_rate: float = 0.0
    word_dropout_rate: float = 0.0
    unk_idx: int | None = None
    deterministic: bool | None = None
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.embedding = self.param(
            "embedding", self.embedding_init, (self.vocab_size, self.embedding_size), self.dtype
        )
        self.dropout_layer = nn.Dropout(rate=self.dropout_rate)
        self.word_dropout_layer = WordDropout(
            dropout_rate=self.word_dropout_rate, unk_idx=self.unk_idx
        )

    def __call__(self, inputs: Array, deterministic: bool | None = None) -> Array:
        deterministic = nn.module.merge_param("deterministic", self.deterministic, deterministic)
        inputs = self.word_dropout_layer(inputs, deterministic=deterministic)
        embedded_inputs = self.embedding[inputs]

        # Keep the embeddings fixed at initial (e.g. pretrained) values.
        if self.frozen:
            embedded_inputs = jax.lax.stop_gradient(embedded_inputs)

        return self.dropout_layer(embedded_inputs, deterministic=deterministic)


class SimpleLSTM(nn.Module):
    """A simple unidirectional LSTM."""

    hidden_size: int

    @partial(
        nn.transforms.scan,
        variable_broadcast="params",
        in_axes=1,
        out_axes=1,
        split_rngs={"params": False},
    )
    @nn.compact
    def __call__(self, carry, x):
        return nn.OptimizedLSTMCell(self.hidden_size)(carry, x)

    def initialize_carry(self, input_shape):
        # Use fixed random key since default state init fn is just zeros.
        return nn.OptimizedLSTMCell(self.hidden_size, parent=None).initialize_carry(
            jax.random.key(0), input_shape
        )


class SimpleBiLSTM(nn.Module):
    """A simple bi-directional LSTM."""

    hidden_size: int

    def setup(self):
        self.forward_lstm = SimpleLSTM(self.hidden_size)
        self.backward_lstm = SimpleLSTM(self.hidden_size)

    def __call__(self, embedded_inputs, lengths):
        # Forward LSTM.
        initial_state = self.forward_lstm.initialize_carry(embedded_inputs[:, 0].shape)
        _, forward_outputs = self.forward_lstm(initial_state, embedded_inputs)

        # Backward LSTM.
        reversed_inputs = flip_sequences(embedded_inputs, lengths)
        initial_state = self.backward_lstm.initialize_carry(reversed_inputs[:, 0].shape)
        _, backward_outputs = self.backward_lstm(initial_state, reversed_inputs)
        backward_outputs = flip_sequences(backward_outputs, lengths)

        # Concatenate the forward and backward representations.
        outputs = jnp.concatenate([forward_outputs, backward_outputs], -1)
        return outputs


class Sst2MLP(nn.Module):
    """sst2's ``MLP``: a simple Multilayer perceptron with 1 hidden layer."""

    hidden_size: int
    output_size: int
    activation: Callable[..., Any] = nn.tanh
    dropout_rate: float = 0.0
    output_bias: bool = False
    deterministic: bool | None = None

    def setup(self):
        self.intermediate_layer = nn.Dense(self.hidden_size)
        self.output_layer = nn.Dense(self.output_size, use_bias=self.output_bias)
        self.dropout_layer = nn.Dropout(rate=self.dropout_rate)

    def __call__(self, inputs: Array, deterministic: bool | None = None):
        deterministic = nn.module.merge_param("deterministic", self.deterministic, deterministic)
        hidden = self.intermediate_layer(inputs)
        hidden = self.activation(hidden)
        hidden = self.dropout_layer(hidden, deterministic=deterministic)
        output = self.output_layer(hidden)
        return output


class KeysOnlyMlpAttention(nn.Module):
    """Computes MLP-based attention scores based on keys alone, without a query."""

    hidden_size: int

    @nn.compact
    def __call__(self, keys: Array, mask: Array) -> Array:
        hidden = nn.Dense(self.hidden_size, name="keys", use_bias=False)(keys)
        energy = nn.tanh(hidden)
        scores = nn.Dense(1, name="energy", use_bias=False)(energy)
        scores = scores.squeeze(-1)  # New shape: <float32>[batch_size, seq_len].
        scores = jnp.where(mask, scores, -jnp.inf)  # Using exp(-inf) = 0 below.
        scores = nn.softmax(scores, axis=-1)

        # Captures the scores if 'intermediates' is mutable, otherwise does nothing.
        self.sow("intermediates", "attention", scores)

        return scores


class AttentionClassifier(nn.Module):
    """A classifier that uses attention to summarize the inputs."""

    hidden_size: int
    output_size: int
    dropout_rate: float = 0.0
    deterministic: bool | None = None

    def setup(self):
        self.dropout_layer = nn.Dropout(rate=self.dropout_rate)
        self.keys_only_mlp_attention = KeysOnlyMlpAttention(hidden_size=self.hidden_size)
        self.mlp = Sst2MLP(
            hidden_size=self.hidden_size,
            output_size=self.output_size,
            output_bias=False,
            dropout_rate=self.dropout_rate,
        )

    def __call__(
        self, encoded_inputs: Array, lengths: Array, deterministic: bool | None = None
    ) -> Array:
        deterministic = nn.module.merge_param("deterministic", self.deterministic, deterministic)
        encoded_inputs = self.dropout_layer(encoded_inputs, deterministic=deterministic)

        # Compute attention. attention.shape: <float32>[batch_size, seq_len].
        mask = sequence_mask(lengths, encoded_inputs.shape[1])
        attention = self.keys_only_mlp_attention(encoded_inputs, mask)

        # Summarize the inputs by taking their weighted sum using attention scores.
        context = jnp.expand_dims(attention, 1) @ encoded_inputs
        context = context.squeeze(1)  # <float32>[batch_size, encoded_inputs_size]
        context = self.dropout_layer(context, deterministic=deterministic)

        # Make the final prediction from the context vector (the summarized inputs).
        logits = self.mlp(context, deterministic=deterministic)
        return logits


class TextClassifier(nn.Module):
    """A Text Classification model."""

    embedding_size: int
    hidden_size: int
    vocab_size: int
    output_size: int

    dropout_rate: float
    word_dropout_rate: float
    unk_idx: int = 1
    deterministic: bool | None = None

    def setup(self):
        self.embedder = Embedder(
            vocab_size=self.vocab_size,
            embedding_size=self.embedding_size,
            dropout_rate=self.dropout_rate,
            word_dropout_rate=self.word_dropout_rate,
            unk_idx=self.unk_idx,
        )
        self.encoder = SimpleBiLSTM(hidden_size=self.hidden_size)
        self.classifier = AttentionClassifier(
            hidden_size=self.hidden_size,
            output_size=self.output_size,
            dropout_rate=self.dropout_rate,
        )

    def embed_token_ids(self, token_ids: Array, deterministic: bool | None = None) -> Array:
        deterministic = nn.module.merge_param("deterministic", self.deterministic, deterministic)
        return self.embedder(token_ids, deterministic=deterministic)

    def logits_from_embedded_inputs(
        self, embedded_inputs: Array, lengths: Array, deterministic: bool | None = None
    ) -> Array:
        deterministic = nn.module.merge_param("deterministic", self.deterministic, deterministic)
        encoded_inputs = self.encoder(embedded_inputs, lengths)
        return self.classifier(encoded_inputs, lengths, deterministic=deterministic)

    def __call__(
        self, token_ids: Array, lengths: Array, deterministic: bool | None = None
    ) -> Array:
        """Embeds the token IDs, encodes them, and classifies with attention."""
        embedded_inputs = self.embed_token_ids(token_ids, deterministic=deterministic)
        logits = self.logits_from_embedded_inputs(
            embedded_inputs, lengths, deterministic=deterministic
        )
        return logits


def _sst2_inputs(seed: int) -> tuple[jax.Array, jax.Array]:
    """(token ids (4, 6) of a vocabulary of 16, their lengths 1..6), padding 0 past each."""
    lengths = jax.random.randint(jax.random.key(seed + 7), (4,), 1, 7, jnp.int32)
    ids = _ints(seed, (4, 6), 16)
    return jnp.where(jnp.arange(6)[None] < lengths[:, None], ids, 0), lengths


def _sst2() -> TextClassifier:
    return TextClassifier(embedding_size=8, hidden_size=8, vocab_size=16, output_size=2,
                          dropout_rate=0.5, word_dropout_rate=0.2)  # fmt: skip


# -- flax examples/seq2seq/models.py, as written there (google/flax@18f8f311c275d57f46d95e41b15a
# a97b454754c0): nn.RNN over an LSTMCell (seq_lengths, return_carry) and over a custom
# nn.RNNCellBase that samples a token from its own "lstm" rng stream at every step, in training
# (teacher forcing) and decoding alike
LSTMCarry = tuple[Array, Array]


class DecoderLSTMCell(nn.RNNCellBase):
    """DecoderLSTM Module wrapped in a lifted scan transform."""

    features: int
    teacher_force: bool
    vocab_size: int

    @nn.compact
    def __call__(
        self, carry: tuple[LSTMCarry, Array], x: Array
    ) -> tuple[tuple[LSTMCarry, Array], tuple[Array, Array]]:
        """Applies the DecoderLSTM model."""
        lstm_state, last_prediction = carry
        if not self.teacher_force:
            x = last_prediction
        lstm_state, y = nn.LSTMCell(self.features)(lstm_state, x)
        logits = nn.Dense(features=self.vocab_size)(y)
        # Sample the predicted token using a categorical distribution over the
        # logits.
        categorical_rng = self.make_rng("lstm")
        predicted_token = jax.random.categorical(categorical_rng, logits)
        # Convert to one-hot encoding.
        prediction = jax.nn.one_hot(predicted_token, self.vocab_size, dtype=jnp.float32)

        return (lstm_state, prediction), (logits, prediction)

    @property
    def num_feature_axes(self) -> int:
        return 1


class Seq2seq(nn.Module):
    """Sequence-to-sequence class using encoder/decoder architecture."""

    teacher_force: bool
    hidden_size: int
    vocab_size: int
    eos_id: int = 1

    @nn.compact
    def __call__(self, encoder_inputs: Array, decoder_inputs: Array) -> tuple[Array, Array]:
        """Applies the seq2seq model: (logits, one-hot predictions) per decoded step."""
        # Encode inputs.
        encoder = nn.RNN(nn.LSTMCell(self.hidden_size), return_carry=True, name="encoder")
        decoder = nn.RNN(
            DecoderLSTMCell(decoder_inputs.shape[-1], self.teacher_force, self.vocab_size),
            split_rngs={"params": False, "lstm": True},
            name="decoder",
        )

        seq_lengths = self.get_seq_lengths(encoder_inputs)

        encoder_state, _ = encoder(encoder_inputs, seq_lengths=seq_lengths)
        logits, predictions = decoder(
            decoder_inputs[:, :-1],
            initial_carry=(encoder_state, decoder_inputs[:, 0]),
        )

        return logits, predictions

    def get_seq_lengths(self, inputs: Array) -> Array:
        """Get segmentation mask for inputs."""
        # undo one-hot encoding
        inputs = jnp.argmax(inputs, axis=-1)
        # calculate sequence lengths
        seq_lengths = jnp.argmax(inputs == self.eos_id, axis=-1)

        return seq_lengths


def seq2seq_inputs(seed: int, vocab: int = 5) -> tuple[jax.Array, jax.Array]:
    """One-hot (encoder, decoder) inputs, (4, 4, vocab) and (4, 3, vocab): the encoder's
    ends with the eos token (1), as the example's queries do."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    queries = jax.random.randint(k1, (4, 4), 2, vocab).at[:, 3].set(1)
    answers = jax.random.randint(k2, (4, 3), 2, vocab)
    return jax.nn.one_hot(queries, vocab), jax.nn.one_hot(answers, vocab)


# -- flax examples/lm1b/models.py, as written there (google/flax@18f8f311c275d57f46d95e41b15aa97b
# 454754c0; docstrings shortened): its params boxed by nn.with_logical_partitioning, the mode a
# config (deterministic, decode) of a frozen struct.dataclass, a causal and padding mask made
# from int tokens, a fixed sinusoidal position table; `Decoder` is `LmDecoder` here
@flax.struct.dataclass
class TransformerConfig:
    """Global hyperparameters used to minimize obnoxious kwarg plumbing."""

    vocab_size: int
    output_vocab_size: int
    share_embeddings: bool = False
    logits_via_embedding: bool = False
    dtype: Any = jnp.float32
    emb_dim: int = 512
    num_heads: int = 8
    num_layers: int = 6
    qkv_dim: int = 512
    mlp_dim: int = 2048
    max_len: int = 2048
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    deterministic: bool = False
    decode: bool = False
    kernel_init: Callable = nn.initializers.xavier_uniform()
    bias_init: Callable = nn.initializers.normal(stddev=1e-6)
    posemb_init: Callable | None = None


def shift_right(x, axis=1):
    """Shift the input to the right by padding and slicing on axis."""
    pad_widths = [(0, 0)] * len(x.shape)
    pad_widths[axis] = (1, 0)
    padded = jnp.pad(x, pad_widths, mode="constant", constant_values=x.dtype.type(0))
    return jax.lax.dynamic_slice_in_dim(padded, 0, padded.shape[axis] - 1, axis)


def shift_inputs(x, segment_ids=None, axis=1):
    """Shift inputs and replace EOS by 0 for packed inputs."""
    shifted = shift_right(x, axis=axis)
    # For packed targets, the first shifted token of a new sequence is made
    # 0, rather than being the EOS token for the last sequence.
    if segment_ids is not None:
        shifted *= segment_ids == shift_right(segment_ids, axis=axis)
    return shifted


def sinusoidal_init(max_len=2048, min_scale=1.0, max_scale=10000.0):
    """1D Sinusoidal Position Embedding Initializer."""

    def init(key, shape, dtype=np.float32):
        """Sinusoidal init."""
        del key, dtype
        d_feature = shape[-1]
        pe = np.zeros((max_len, d_feature), dtype=np.float32)
        position = np.arange(0, max_len)[:, np.newaxis]
        scale_factor = -np.log(max_scale / min_scale) / (d_feature // 2 - 1)
        div_term = min_scale * np.exp(np.arange(0, d_feature // 2) * scale_factor)
        pe[:, : d_feature // 2] = np.sin(position * div_term)
        pe[:, d_feature // 2 : 2 * (d_feature // 2)] = np.cos(position * div_term)
        pe = pe[np.newaxis, :, :]  # [1, max_len, d_feature]
        return jnp.array(pe)

    return init


class AddPositionEmbs(nn.Module):
    """Adds (optionally learned) positional embeddings to the inputs."""

    config: TransformerConfig
    decode: bool = False

    @nn.compact
    def __call__(self, inputs, inputs_positions=None):
        config = self.config
        # inputs.shape is (batch_size, seq_len, emb_dim)
        assert inputs.ndim == 3, "Number of dimensions should be 3, but it is: %d" % inputs.ndim  # noqa: UP031  # noqa: UP031  # noqa: UP031
        length = inputs.shape[1]
        pos_emb_shape = (1, config.max_len, inputs.shape[-1])
        if config.posemb_init is None:
            # Use a fixed (non-learned) sinusoidal position embedding.
            pos_embedding = sinusoidal_init(max_len=config.max_len)(None, pos_emb_shape, None)
        else:
            pos_embedding = self.param("pos_embedding", config.posemb_init, pos_emb_shape)
        pe = pos_embedding[:, :length, :]

        # We use a cache position index for tracking decoding position.
        if self.decode:
            is_initialized = self.has_variable("cache", "cache_index")
            cache_index = self.variable(
                "cache", "cache_index", lambda: jnp.array(0, dtype=jnp.uint32)
            )
            if is_initialized:
                i = cache_index.value
                cache_index.value = i + 1
                _, _, df = pos_embedding.shape
                pe = jax.lax.dynamic_slice(pos_embedding, jnp.array((0, i, 0)), (1, 1, df))
        if inputs_positions is None:
            # normal unpacked case:
            return inputs + pe
        else:
            # for packed data we need to use known position indices:
            return inputs + jnp.take(pe[0], inputs_positions, axis=0)


class MlpBlock(nn.Module):
    """Transformer MLP / feed-forward block."""

    config: TransformerConfig
    out_dim: int | None = None

    @nn.compact
    def __call__(self, inputs):
        config = self.config
        actual_out_dim = inputs.shape[-1] if self.out_dim is None else self.out_dim
        x = nn.Dense(
            config.mlp_dim,
            dtype=config.dtype,
            kernel_init=nn.with_logical_partitioning(config.kernel_init, ("embed", "mlp")),
            bias_init=nn.with_logical_partitioning(config.bias_init, ("mlp",)),
        )(inputs)
        x = nn.relu(x)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        output = nn.Dense(
            actual_out_dim,
            dtype=config.dtype,
            kernel_init=nn.with_logical_partitioning(config.kernel_init, ("mlp", "embed")),
            bias_init=nn.with_logical_partitioning(config.bias_init, ("embed",)),
        )(x)
        output = nn.Dropout(rate=config.dropout_rate)(output, deterministic=config.deterministic)
        return output


class EncoderDecoder1DBlock(nn.Module):
    """Transformer encoder-decoder layer."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, decoder_mask=None, encoder_decoder_mask=None):
        config = self.config

        # Decoder block.
        assert inputs.ndim == 3
        x = nn.LayerNorm(
            dtype=config.dtype,
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
        )(inputs)
        x = nn.MultiHeadDotProductAttention(
            num_heads=config.num_heads,
            dtype=config.dtype,
            qkv_features=config.qkv_dim,
            kernel_init=nn.with_logical_partitioning(config.kernel_init, ("embed", "kv")),
            bias_init=nn.with_logical_partitioning(config.bias_init, ("embed",)),
            use_bias=False,
            broadcast_dropout=False,
            dropout_rate=config.attention_dropout_rate,
            deterministic=config.deterministic,
            decode=config.decode,
        )(x, mask=decoder_mask)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        x = x + inputs

        # MLP block.
        z = nn.LayerNorm(
            dtype=config.dtype,
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
        )(x)
        z = MlpBlock(config=config)(z)

        return x + z


class LmDecoder(nn.Module):
    """lm1b's ``Decoder``: Transformer Model Decoder for sequence to sequence translation."""

    config: TransformerConfig
    shared_embedding: Any = None

    @nn.compact
    def __call__(self, inputs, inputs_positions=None, inputs_segmentation=None,
                 decoder_mask=None, encoder_decoder_mask=None):  # fmt: skip
        config = self.config
        assert inputs.ndim == 2  # (batch, len)

        # Target Embedding
        if self.shared_embedding is None:
            output_embed = nn.Embed(
                num_embeddings=config.output_vocab_size,
                features=config.emb_dim,
                embedding_init=nn.with_logical_partitioning(
                    nn.initializers.normal(stddev=1.0), ("vocab", "embed")
                ),
            )
        else:
            output_embed = self.shared_embedding

        y = inputs.astype("int32")
        if not config.decode:
            y = shift_inputs(y, segment_ids=inputs_segmentation)
        y = output_embed(y)
        y = AddPositionEmbs(config=config, decode=config.decode, name="posembed_output")(
            y, inputs_positions=inputs_positions
        )
        y = nn.Dropout(rate=config.dropout_rate)(y, deterministic=config.deterministic)

        y = y.astype(config.dtype)

        # Target-Input Decoder
        for lyr in range(config.num_layers):
            y = EncoderDecoder1DBlock(config=config, name=f"encoderdecoderblock_{lyr}")(
                y, decoder_mask=decoder_mask, encoder_decoder_mask=encoder_decoder_mask
            )
        y = nn.LayerNorm(
            dtype=config.dtype,
            name="encoderdecoder_norm",
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
        )(y)

        # Decoded Logits
        if config.logits_via_embedding:
            # Use the transpose of embedding matrix for logit transform.
            logits = output_embed.attend(y.astype(jnp.float32))
            # Correctly normalize pre-softmax logits for this shared case.
            logits = logits / jnp.sqrt(y.shape[-1])
        else:
            logits = nn.Dense(
                config.output_vocab_size,
                dtype=config.dtype,
                kernel_init=nn.with_logical_partitioning(config.kernel_init, ("embed", "vocab")),
                bias_init=nn.with_logical_partitioning(config.bias_init, ("vocab",)),
                name="logitdense",
            )(y)
        return logits


class TransformerLM(nn.Module):
    """Transformer pure decoder stack for language modelling."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, inputs_positions=None, inputs_segmentation=None):
        config = self.config

        # Make padding attention masks.
        if config.decode:
            # for fast autoregressive decoding we use no decoder mask
            decoder_mask = None
        else:
            decoder_mask = nn.combine_masks(
                nn.make_attention_mask(inputs > 0, inputs > 0, dtype=config.dtype),
                nn.make_causal_mask(inputs, dtype=config.dtype),
            )

        # Add segmentation block-diagonal attention masks if using segmented data.
        if inputs_segmentation is not None:
            decoder_mask = nn.combine_masks(
                decoder_mask,
                nn.make_attention_mask(
                    inputs_segmentation, inputs_segmentation, jnp.equal, dtype=config.dtype
                ),
            )

        logits = LmDecoder(config=config, shared_embedding=None, name="decoder")(
            inputs,
            inputs_positions=inputs_positions,
            inputs_segmentation=inputs_segmentation,
            decoder_mask=decoder_mask,
            encoder_decoder_mask=None,
        )
        return logits.astype(self.config.dtype)


#: lm1b's train_config, tiny; its eval_config is train_config.replace(deterministic=True)
LM1B = TransformerConfig(vocab_size=16, output_vocab_size=16, emb_dim=8, num_heads=2,
                         num_layers=1, qkv_dim=8, mlp_dim=16, max_len=16)  # fmt: skip


@cache
def _lm1b_variables():
    """lm1b's train.py: ``jax.jit(m.init)`` of the eval model on int32 ones."""
    model = TransformerLM(LM1B.replace(deterministic=True))
    return jax.jit(model.init)(jax.random.key(0), jnp.ones((2, 8), jnp.int32))


def _lm1b(mode: str) -> Callable[[], tuple[Any, Any]]:
    config = LM1B if mode == "train" else LM1B.replace(deterministic=True)
    return lambda: (TransformerLM(config), _lm1b_variables())


# -- flax examples/nlp_seq/models.py, as written there (google/flax@1191b8af89396d4e2443a15898
# becd8ed5021242; docstrings shortened): a sequence tagger whose call takes its tokens and its
# flag keyword-only, `__call__(self, *, inputs, train)`, as train.py applies it (`inputs=inputs,
# train=True, rngs={'dropout': ...}`); `TransformerConfig`, `sinusoidal_init`, `AddPositionEmbs`,
# `MlpBlock`, `Encoder1DBlock`, `Transformer` are `Tagger...` here (lm1b's hold those names)
@flax.struct.dataclass
class TaggerConfig:
    """Global hyperparameters used to minimize obnoxious kwarg plumbing."""

    vocab_size: int
    output_vocab_size: int
    dtype: Any = jnp.float32
    emb_dim: int = 512
    num_heads: int = 8
    num_layers: int = 6
    qkv_dim: int = 512
    mlp_dim: int = 2048
    max_len: int = 2048
    dropout_rate: float = 0.3
    attention_dropout_rate: float = 0.3
    kernel_init: Callable = nn.initializers.xavier_uniform()
    bias_init: Callable = nn.initializers.normal(stddev=1e-6)
    posemb_init: Callable | None = None


def tagger_sinusoidal_init(max_len=2048):
    """1D Sinusoidal Position Embedding Initializer."""

    def init(key, shape, dtype=np.float32):
        """Sinusoidal init."""
        del key, dtype
        d_feature = shape[-1]
        pe = np.zeros((max_len, d_feature), dtype=np.float32)
        position = np.arange(0, max_len)[:, np.newaxis]
        div_term = np.exp(np.arange(0, d_feature, 2) * -(np.log(10000.0) / d_feature))
        pe[:, 0::2] = np.sin(position * div_term)
        pe[:, 1::2] = np.cos(position * div_term)
        pe = pe[np.newaxis, :, :]  # [1, max_len, d_feature]
        return jnp.array(pe)

    return init


class TaggerPositionEmbs(nn.Module):
    """Adds (optionally learned) positional embeddings to the inputs."""

    config: TaggerConfig

    @nn.compact
    def __call__(self, inputs):
        config = self.config
        # inputs.shape is (batch_size, seq_len, emb_dim)
        assert inputs.ndim == 3, "Number of dimensions should be 3, but it is: %d" % inputs.ndim  # noqa: UP031  # noqa: UP031
        length = inputs.shape[1]
        pos_emb_shape = (1, config.max_len, inputs.shape[-1])
        if config.posemb_init is None:
            # Use a fixed (non-learned) sinusoidal position embedding.
            pos_embedding = tagger_sinusoidal_init(max_len=config.max_len)(
                None, pos_emb_shape, None
            )
        else:
            pos_embedding = self.param("pos_embedding", config.posemb_init, pos_emb_shape)
        pe = pos_embedding[:, :length, :]
        return inputs + pe


class TaggerMlpBlock(nn.Module):
    """Transformer MLP / feed-forward block."""

    config: TaggerConfig
    out_dim: int | None = None

    @nn.compact
    def __call__(self, inputs, deterministic=True):
        config = self.config
        actual_out_dim = inputs.shape[-1] if self.out_dim is None else self.out_dim
        x = nn.Dense(config.mlp_dim, dtype=config.dtype, kernel_init=config.kernel_init,
                     bias_init=config.bias_init)(inputs)  # fmt: skip
        x = nn.elu(x)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=deterministic)
        output = nn.Dense(actual_out_dim, dtype=config.dtype, kernel_init=config.kernel_init,
                          bias_init=config.bias_init)(x)  # fmt: skip
        output = nn.Dropout(rate=config.dropout_rate)(output, deterministic=deterministic)
        return output


class TaggerEncoderBlock(nn.Module):
    """Transformer encoder layer."""

    config: TaggerConfig

    @nn.compact
    def __call__(self, inputs, deterministic):
        config = self.config

        # Attention block.
        assert inputs.ndim == 3
        x = nn.LayerNorm(dtype=config.dtype)(inputs)
        x = nn.SelfAttention(
            num_heads=config.num_heads,
            dtype=config.dtype,
            qkv_features=config.qkv_dim,
            kernel_init=config.kernel_init,
            bias_init=config.bias_init,
            use_bias=False,
            broadcast_dropout=False,
            dropout_rate=config.attention_dropout_rate,
            deterministic=deterministic,
        )(x)

        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=deterministic)
        x = x + inputs

        # MLP block.
        y = nn.LayerNorm(dtype=config.dtype)(x)
        y = TaggerMlpBlock(config=config)(y, deterministic=deterministic)
        return x + y


class Tagger(nn.Module):
    """Transformer Model for sequence tagging."""

    config: TaggerConfig

    @nn.compact
    def __call__(self, *, inputs, train):
        assert inputs.ndim == 2  # (batch, len)

        config = self.config

        x = inputs.astype("int32")
        x = nn.Embed(num_embeddings=config.vocab_size, features=config.emb_dim, name="embed")(x)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=not train)
        x = TaggerPositionEmbs(config)(x)

        for _ in range(config.num_layers):
            x = TaggerEncoderBlock(config)(x, deterministic=not train)

        x = nn.LayerNorm(dtype=config.dtype)(x)
        logits = nn.Dense(config.output_vocab_size, kernel_init=config.kernel_init,
                          bias_init=config.bias_init)(x)  # fmt: skip
        return logits


def tagger() -> tuple[Tagger, Any, jax.Array]:
    """``(model, variables, inputs)``: a one-layer tagger of 16 tokens into 5 tags, its
    variables as train.py inits them (``inputs=`` a batch, ``train=False``), 2 sentences of 6."""
    config = TaggerConfig(vocab_size=16, output_vocab_size=5, emb_dim=8, num_heads=2,
                          num_layers=1, qkv_dim=8, mlp_dim=16, max_len=8)  # fmt: skip
    model, inputs = Tagger(config), _ints(0, (2, 6), 16)
    return model, model.init(jax.random.key(1), inputs=inputs, train=False), inputs


# -- flax examples/nnx_toy_examples/05_vae.py, as written there (google/flax@18f8f311c275d57f46d
# 95e41b15aa97b454754c0): the encoder holds its nnx.Rngs and draws `self.rngs.noise()` in every
# call, and sets a new `Loss` variable there (the train step `nnx.pop`s it)
class Loss(nnx.Variable):
    pass


class Encoder(nnx.Module):
    def __init__(self, din: int, dmid: int, dout: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.linear_mean = nnx.Linear(dmid, dout, rngs=rngs)
        self.linear_std = nnx.Linear(dmid, dout, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape((x.shape[0], -1))  # flatten
        x = self.linear1(x)
        x = jax.nn.relu(x)

        mean = self.linear_mean(x)
        std = jnp.exp(self.linear_std(x))

        self.kl_loss = Loss(
            jnp.mean(0.5 * jnp.mean(-jnp.log(std**2) - 1.0 + std**2 + mean**2, axis=-1))
        )
        key = self.rngs.noise()
        z = mean + std * jax.random.normal(key, mean.shape)
        return z


class Decoder(nnx.Module):
    def __init__(self, din: int, dmid: int, dout: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.linear2 = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, z: jax.Array) -> jax.Array:
        z = self.linear1(z)
        z = jax.nn.relu(z)
        logits = self.linear2(z)
        return logits


class VAE(nnx.Module):
    def __init__(self, din: int, hidden_size: int, latent_size: int,
                 output_shape: tuple[int, ...], *, rngs: nnx.Rngs):  # fmt: skip
        self.output_shape = output_shape
        self.encoder = Encoder(din, hidden_size, latent_size, rngs=rngs)
        self.decoder = Decoder(latent_size, hidden_size, int(np.prod(output_shape)), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        z = self.encoder(x)
        logits = self.decoder(z)
        logits = jnp.reshape(logits, (-1, *self.output_shape))
        return logits

    def generate(self, z):
        logits = self.decoder(z)
        logits = jnp.reshape(logits, (-1, *self.output_shape))
        return nnx.sigmoid(logits)


def _vae() -> tuple[VAE, None]:
    return VAE(din=16, hidden_size=8, latent_size=4, output_shape=(4, 4),
               rngs=nnx.Rngs(0, noise=1)), None  # fmt: skip


def _binary(seed: int) -> jax.Array:
    """(4, 4, 4) images of 0s and 1s, as the example binarizes MNIST."""
    return (_x(seed, (4, 4, 4)) > 0).astype(jnp.float32)


if eqx is not None:
    # equinox docs/examples/score_based_diffusion.ipynb, as written there (patrick-kidger/
    # equinox@9336d820b2ef66b360fc6cb3611b3da5cefbb14d): einops written as reshape, transpose
    # and broadcast_to (einops is not a dependency); the model of (t, y), one image per call,
    # a time t per image
    class DiffusionMixerBlock(eqx.Module):
        """The notebook's ``MixerBlock`` (renamed: vit_jax's is ``MixerBlock`` here)."""

        patch_mixer: eqx.nn.MLP
        hidden_mixer: eqx.nn.MLP
        norm1: eqx.nn.LayerNorm
        norm2: eqx.nn.LayerNorm

        def __init__(self, num_patches, hidden_size, mix_patch_size, mix_hidden_size, *, key):
            tkey, ckey = jr.split(key, 2)
            self.patch_mixer = eqx.nn.MLP(
                num_patches, num_patches, mix_patch_size, depth=1, key=tkey
            )
            self.hidden_mixer = eqx.nn.MLP(
                hidden_size, hidden_size, mix_hidden_size, depth=1, key=ckey
            )
            self.norm1 = eqx.nn.LayerNorm((hidden_size, num_patches))
            self.norm2 = eqx.nn.LayerNorm((num_patches, hidden_size))

        def __call__(self, y):
            y = y + jax.vmap(self.patch_mixer)(self.norm1(y))
            y = y.T  # einops.rearrange(y, "c p -> p c")
            y = y + jax.vmap(self.hidden_mixer)(self.norm2(y))
            y = y.T  # einops.rearrange(y, "p c -> c p")
            return y

    class Mixer2d(eqx.Module):
        conv_in: eqx.nn.Conv2d
        conv_out: eqx.nn.ConvTranspose2d
        blocks: list
        norm: eqx.nn.LayerNorm
        t1: float

        def __init__(self, img_size, patch_size, hidden_size, mix_patch_size,
                     mix_hidden_size, num_blocks, t1, *, key):  # fmt: skip
            input_size, height, width = img_size
            assert (height % patch_size) == 0
            assert (width % patch_size) == 0
            num_patches = (height // patch_size) * (width // patch_size)
            inkey, outkey, *bkeys = jr.split(key, 2 + num_blocks)

            self.conv_in = eqx.nn.Conv2d(
                input_size + 1, hidden_size, patch_size, stride=patch_size, key=inkey
            )
            self.conv_out = eqx.nn.ConvTranspose2d(
                hidden_size, input_size, patch_size, stride=patch_size, key=outkey
            )
            self.blocks = [
                DiffusionMixerBlock(
                    num_patches, hidden_size, mix_patch_size, mix_hidden_size, key=bkey
                )
                for bkey in bkeys
            ]
            self.norm = eqx.nn.LayerNorm((hidden_size, num_patches))
            self.t1 = t1

        def __call__(self, t, y):
            t = jnp.array(t / self.t1)
            _, height, width = y.shape
            t = jnp.broadcast_to(t, (1, height, width))  # einops.repeat(t, "-> 1 h w", ...)
            y = jnp.concatenate([y, t])
            y = self.conv_in(y)
            _, patch_height, patch_width = y.shape
            y = y.reshape(y.shape[0], -1)  # einops.rearrange(y, "c h w -> c (h w)")
            for block in self.blocks:
                y = block(y)
            y = self.norm(y)
            y = y.reshape(y.shape[0], patch_height, patch_width)  # "c (h w) -> c h w"
            return self.conv_out(y)

    def _diffusion():
        """The notebook's ``jax.vmap(model)(t, y)`` of its batch loss, a tiny Mixer2d."""
        model = Mixer2d((1, 4, 4), patch_size=2, hidden_size=8, mix_patch_size=8,
                        mix_hidden_size=8, num_blocks=1, t1=10.0, key=jr.key(5678))  # fmt: skip
        return eqx.filter_vmap(model), None

    def _diffusion_inputs(seed: int) -> tuple[jax.Array, jax.Array]:
        """(t, y): a time in [0, t1) per image, and (4, 1, 4, 4) images."""
        t = jax.random.uniform(jax.random.key(seed + 9), (4,), minval=0.0, maxval=10.0)
        return t, _x(seed, (4, 1, 4, 4))

    # equinox docs/examples/deep_convolutional_gan.ipynb, as written there (patrick-kidger/
    # equinox@9336d820b2ef66b360fc6cb3611b3da5cefbb14d): its BatchNorms' mode="ema" written out
    # (the notebook leaves it unspecified, which defaults to "ema" and now warns)
    class Generator(eqx.Module):
        layers: list[eqx.nn.ConvTranspose2d | eqx.nn.BatchNorm | Callable]

        def __init__(
            self,
            input_shape: int,
            output_shape: tuple[int, int, int],
            key: jax.Array,
        ):
            keys = jr.split(key, 5)

            height, width, channels = output_shape  # noqa: RUF059 (the notebook's code)

            self.layers = [
                eqx.nn.ConvTranspose2d(
                    in_channels=input_shape,
                    out_channels=width * 8,
                    kernel_size=4,
                    stride=1,
                    padding=0,
                    use_bias=False,
                    key=keys[0],
                ),
                eqx.nn.BatchNorm(input_size=width * 8, axis_name="batch", mode="ema"),
                jax.nn.relu,
                eqx.nn.ConvTranspose2d(
                    in_channels=width * 8,
                    out_channels=width * 4,
                    kernel_size=4,
                    stride=2,
                    padding=1,
                    use_bias=False,
                    key=keys[1],
                ),
                eqx.nn.BatchNorm(input_size=width * 4, axis_name="batch", mode="ema"),
                jax.nn.relu,
                eqx.nn.ConvTranspose2d(
                    in_channels=width * 4,
                    out_channels=width * 2,
                    kernel_size=4,
                    stride=2,
                    padding=1,
                    use_bias=False,
                    key=keys[2],
                ),
                eqx.nn.BatchNorm(input_size=width * 2, axis_name="batch", mode="ema"),
                jax.nn.relu,
                eqx.nn.ConvTranspose2d(
                    in_channels=width * 2,
                    out_channels=width,
                    kernel_size=4,
                    stride=2,
                    padding=1,
                    use_bias=False,
                    key=keys[3],
                ),
                eqx.nn.BatchNorm(input_size=width, axis_name="batch", mode="ema"),
                jax.nn.relu,
                eqx.nn.ConvTranspose2d(
                    in_channels=width,
                    out_channels=channels,
                    kernel_size=4,
                    stride=2,
                    padding=1,
                    use_bias=False,
                    key=keys[4],
                ),
                jax.nn.tanh,
            ]

        def __call__(self, x, state):
            for layer in self.layers:
                if isinstance(layer, eqx.nn.BatchNorm):
                    x, state = layer(x, state)
                else:
                    x = layer(x)

            return x, state

    @cache
    def _generator():
        """The notebook's generator, (latent, 1, 1) noise to a (1, 64, 64) image, its channels
        (the image width times 8, 4, 2, 1) those of a width-2 image; ``eqx.nn.State(generator)``
        its state, as the notebook makes it (one generator: a state is keyed by its layers)."""
        generator = Generator(input_shape=4, output_shape=(64, 2, 1), key=jr.key(2003))
        return generator, eqx.nn.State(generator)

    @cache
    def _generator_trained_state():
        """``_generator()``'s state after two batches, moved as after training (run once:
        eager equinox runs op by op, a second each; an ``eqx.nn.State`` is immutable)."""
        generator, state = _generator()
        for i in range(2):
            _, state = state_batch(generator, _x(60 + i, (4, 4, 1, 1)), state)
        return state

    def _generator_served():
        generator, state = _generator()[0], _generator_trained_state()
        return evaluate, eqx.Partial(eqx.nn.inference_mode(generator), state=state)

    _EQX_MORE = (
        Case("eqx_diffusion", "eqx", _diffusion, _diffusion_inputs,
             allow=frozenset({"convolution", "real_dynamic_slice"})),
        # eqx.nn.State(generator) leaves each "ema" BatchNorm's bool `first_time` in the model
        Case("eqx_gan", "eqx", lambda: (state_batch, _generator()[0]),
             lambda s: (_x(s, (4, 4, 1, 1)),), carry=lambda: _generator()[1],
             served=_generator_served, allow=frozenset({"convolution"})),
    )  # fmt: skip
else:  # pragma: no cover - the test extra installs equinox
    _EQX_MORE = ()


from collections.abc import Sequence  # noqa: E402

from jax.example_libraries import stax  # noqa: E402
from jax.example_libraries.stax import Dense, FanOut, LogSoftmax, Relu, Softplus  # noqa: E402

# -- flax examples/imagenet/models.py, as written there (google/flax@18f8f311c275d57f46d95e41b1
# 5aa97b454754c0): ResNet V1.5, its convs and BatchNorms `partial`s passed to each block, each
# BatchNorm reducing over `axis_name='batch'` (train.py runs its step under jax.pmap(axis_name=
# 'batch'); eval_step calls it with train=False, mutable=False); ResNet18 at one stage of one
# block (as the file's own _ResNet1, "used for testing only"), 8x8 images
ModuleDef = Any


class ResNetBlock(nn.Module):
    """ResNet block."""

    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(
        self,
        x,
    ):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)

        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)

        return self.act(residual + y)


class ResNet(nn.Module):
    """ResNetV1.5."""

    stage_sizes: Sequence[int]
    block_cls: ModuleDef
    num_classes: int
    num_filters: int = 64
    dtype: Any = jnp.float32
    act: Callable = nn.relu
    conv: ModuleDef = nn.Conv

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = partial(self.conv, use_bias=False, dtype=self.dtype)
        norm = partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            axis_name="batch",
        )

        x = conv(
            self.num_filters,
            (7, 7),
            (2, 2),
            padding=[(3, 3), (3, 3)],
            name="conv_init",
        )(x)
        x = norm(name="bn_init")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = self.block_cls(
                    self.num_filters * 2**i,
                    strides=strides,
                    conv=conv,
                    norm=norm,
                    act=self.act,
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        x = jnp.asarray(x, self.dtype)
        return x


ResNet18 = partial(ResNet, stage_sizes=[2, 2, 2, 2], block_cls=ResNetBlock)
#: train.py's create_model (half_precision=False: float32)
RESNET = ResNet18(stage_sizes=[1], num_filters=4, num_classes=10, dtype=jnp.float32)


@cache
def resnet_variables():
    """train.py's ``initialized``: ``jax.jit(model.init)`` on ones, the model's dtype."""
    return jax.jit(RESNET.init)({"params": jax.random.key(0)}, jnp.ones((1, 8, 8, 3)))


def resnet_train_apply(variables, images):
    """train.py's training call, ``state.apply_fn(variables, images, mutable=['batch_stats'])``
    under ``jax.pmap(axis_name='batch')``, with the axis bound over the whole batch as
    ``sm.hybridize(RESNET, variables)(images)`` says to (jax.pmap on one device: the same)."""
    apply = partial(RESNET.apply, mutable=["batch_stats"])
    return jax.vmap(apply, in_axes=None, out_axes=None, axis_name="batch", axis_size=1)(
        variables, images
    )


# -- flax examples/vae (linen), as written there (google/flax@18f8f311c275d57f46d95e41b15aa97b454
# 754c0): models.py's VAE takes its PRNG key as an argument of __call__ (`z_rng`) and draws the
# latent from it (no rng stream); train.py's train_step applies it as `model.apply({'params':
# params}, batch, z_rng)`, its eval_f through `nn.apply(eval_model, model)`, `vae.generate(z)`
# among them. Renamed: `VaeEncoder`, `VaeDecoder`, `LinenVAE` (05_vae.py's nnx ones are above);
# Dense(500) is Dense(8), 784 (28 * 28) is 16 (4 * 4)
class VaeEncoder(nn.Module):
    """VAE Encoder."""

    latents: int

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="fc1")(x)
        x = nn.relu(x)
        mean_x = nn.Dense(self.latents, name="fc2_mean")(x)
        logvar_x = nn.Dense(self.latents, name="fc2_logvar")(x)
        return mean_x, logvar_x


class VaeDecoder(nn.Module):
    """VAE Decoder."""

    @nn.compact
    def __call__(self, z):
        z = nn.Dense(8, name="fc1")(z)
        z = nn.relu(z)
        z = nn.Dense(16, name="fc2")(z)
        return z


class LinenVAE(nn.Module):
    """Full VAE model."""

    latents: int = 20

    def setup(self):
        self.encoder = VaeEncoder(self.latents)
        self.decoder = VaeDecoder()

    def __call__(self, x, z_rng):
        mean, logvar = self.encoder(x)
        z = reparameterize(z_rng, mean, logvar)
        recon_x = self.decoder(z)
        return recon_x, mean, logvar

    def generate(self, z):
        return nn.sigmoid(self.decoder(z))


def reparameterize(rng, mean, logvar):
    std = jnp.exp(0.5 * logvar)
    eps = jax.random.normal(rng, logvar.shape)
    return mean + eps * std


def vae_model(latents):
    """models.py's ``model(latents)``."""
    return LinenVAE(latents=latents)


@jax.vmap
def kl_divergence(mean, logvar):
    return -0.5 * jnp.sum(1 + logvar - jnp.square(mean) - jnp.exp(logvar))


@jax.vmap
def binary_cross_entropy_with_logits(logits, labels):
    logits = nn.log_sigmoid(logits)
    return -jnp.sum(labels * logits + (1.0 - labels) * jnp.log(-jnp.expm1(logits)))


def compute_metrics(recon_x, x, mean, logvar):
    bce_loss = binary_cross_entropy_with_logits(recon_x, x).mean()
    kld_loss = kl_divergence(mean, logvar).mean()
    return {"bce": bce_loss, "kld": kld_loss, "loss": bce_loss + kld_loss}


def vae_loss_fn(params, batch, z_rng, latents):
    """train.py's train_step's ``loss_fn`` (its batch, z_rng and latents taken from there)."""
    recon_x, mean, logvar = vae_model(latents).apply({"params": params}, batch, z_rng)

    bce_loss = binary_cross_entropy_with_logits(recon_x, batch).mean()
    kld_loss = kl_divergence(mean, logvar).mean()
    loss = bce_loss + kld_loss
    return loss


def eval_f(params, images, z, z_rng, latents):
    """Evaluation function."""

    def eval_model(vae):
        recon_images, mean, logvar = vae(images, z_rng)
        comparison = jnp.concatenate(
            [
                images[:8].reshape(-1, 4, 4, 1),
                recon_images[:8].reshape(-1, 4, 4, 1),
            ]
        )

        generate_images = vae.generate(z)
        generate_images = generate_images.reshape(-1, 4, 4, 1)
        metrics = compute_metrics(recon_images, images, mean, logvar)
        return metrics, comparison, generate_images

    return nn.apply(eval_model, vae_model(latents))({"params": params})


@cache
def vae_params():
    """train.py's ``models.model(config.latents).init(key, init_data, rng)['params']`` (jitted:
    faster)."""
    rng, key = jax.random.split(jax.random.key(0))
    return jax.jit(vae_model(4).init)(key, jnp.ones((4, 16), jnp.float32), rng)["params"]


# -- JAX examples/mnist_classifier.py, as written there (jax-ml/jax@cec06d116c05f0d52adfceee3d3b
# 730fdbcb0ce5): stax.serial's (init, apply) pair, the params a list with one tuple per layer,
# empty for Relu and LogSoftmax; `init_random_params, predict` are `stax_init, stax_predict`
# here (the from-scratch example's are above), Dense(1024) is Dense(16)
stax_init, stax_predict = stax.serial(
    Dense(16), Relu,
    Dense(16), Relu,
    Dense(10), LogSoftmax)  # fmt: skip


def stax_params():
    """The example's ``_, init_params = init_random_params(rng, (-1, 28 * 28))``."""
    return stax_init(jax.random.key(0), (-1, 16))[1]


# -- JAX examples/differentially_private_sgd.py, as written there (jax-ml/jax@085f5173589959ab088
# 640d5cc461ce7cfe6bf87): `private_grad(params, batch, rng, l2_norm_clip, noise_multiplier,
# batch_size)`, a (images, labels) tuple and a raw PRNGKey in, Python numbers for its settings,
# per-example grads clipped under a vmap and summed, noise drawn; its list and tuple in
# jnp.linalg.norm and jnp.amax wrapped in jnp.array (jax 0.10 refuses them); its
# `init_random_params, predict, loss` are `dp_init, dp_predict, dp_loss` here; its channels 2
# (16 and 32), Dense(32) Dense(4), its 28x28 images 16x16
dp_init, dp_predict = stax.serial(
    stax.Conv(2, (8, 8), padding="SAME", strides=(2, 2)),
    stax.Relu,
    stax.MaxPool((2, 2), (1, 1)),
    stax.Conv(2, (4, 4), padding="VALID", strides=(2, 2)),
    stax.Relu,
    stax.MaxPool((2, 2), (1, 1)),
    stax.Flatten,
    stax.Dense(4),
    stax.Relu,
    stax.Dense(10),
)


def dp_loss(params, batch):
    inputs, targets = batch
    logits = dp_predict(params, inputs)
    logits = stax.logsoftmax(logits)  # log normalize
    return -jnp.mean(jnp.sum(logits * targets, 1))  # cross entropy loss


def private_grad(params, batch, rng, l2_norm_clip, noise_multiplier, batch_size):
    """Return differentially private gradients for params, evaluated on batch."""

    def _clipped_grad(params, single_example_batch):
        """Evaluate gradient for a single-example batch and clip its grad norm."""
        grads = jax.grad(dp_loss)(params, single_example_batch)

        nonempty_grads, tree_def = jax.tree_util.tree_flatten(grads)
        total_grad_norm = jnp.linalg.norm(
            jnp.array([jnp.linalg.norm(neg.ravel()) for neg in nonempty_grads])
        )
        divisor = jax.lax.stop_gradient(jnp.amax(jnp.array((total_grad_norm / l2_norm_clip, 1.0))))
        normalized_nonempty_grads = [g / divisor for g in nonempty_grads]
        return jax.tree_util.tree_unflatten(tree_def, normalized_nonempty_grads)

    px_clipped_grad_fn = jax.vmap(partial(_clipped_grad, params))
    std_dev = l2_norm_clip * noise_multiplier
    noise_ = lambda n: n + std_dev * jax.random.normal(rng, n.shape)  # noqa: E731
    normalize_ = lambda n: n / float(batch_size)  # noqa: E731
    tree_map = jax.tree_util.tree_map
    sum_ = lambda n: jnp.sum(n, 0)  # aggregate  # noqa: E731
    aggregated_clipped_grads = tree_map(sum_, px_clipped_grad_fn(batch))
    noised_aggregated_clipped_grads = tree_map(noise_, aggregated_clipped_grads)
    normalized_noised_aggregated_clipped_grads = tree_map(
        normalize_, noised_aggregated_clipped_grads
    )
    return normalized_noised_aggregated_clipped_grads


def shape_as_image(images, labels, dummy_dim=False):
    target_shape = (-1, 1, 16, 16, 1) if dummy_dim else (-1, 16, 16, 1)
    return jnp.reshape(images, target_shape), labels


def dp_batch(seed: int, n: int = 4) -> tuple[jax.Array, jax.Array]:
    """``shape_as_image(*next(batches), dummy_dim=True)``: n 16x16 images, one-hot labels."""
    labels = jax.nn.one_hot(jnp.arange(seed, seed + n) % 10, 10)
    return shape_as_image(_x(seed, (n, 256)), labels, dummy_dim=True)


# -- JAX examples/mnist_vae.py, as written there (jax-ml/jax@cec06d116c05f0d52adfceee3d3b730fdbc
# b0ce5): stax's FanOut and parallel make the encoder's params nested tuples, empty ones among
# them; `elbo(rng, params, images)` takes its key first and the params second, and its images
# are binarized by random.bernoulli (bool); Dense(512) is Dense(8), 10 latents 4, 28 * 28 is 16
def gaussian_kl(mu, sigmasq):
    """KL divergence from a diagonal Gaussian to the standard Gaussian."""
    return -0.5 * jnp.sum(1.0 + jnp.log(sigmasq) - mu**2.0 - sigmasq)


def gaussian_sample(rng, mu, sigmasq):
    """Sample a diagonal Gaussian."""
    return mu + jnp.sqrt(sigmasq) * jax.random.normal(rng, mu.shape)


def bernoulli_logpdf(logits, x):
    """Bernoulli log pdf of data x given logits."""
    return -jnp.sum(jnp.logaddexp(0.0, jnp.where(x, -1.0, 1.0) * logits))


def elbo(rng, params, images):
    """Monte Carlo estimate of the negative evidence lower bound."""
    enc_params, dec_params = params
    mu_z, sigmasq_z = encode(enc_params, images)
    logits_x = decode(dec_params, gaussian_sample(rng, mu_z, sigmasq_z))
    return bernoulli_logpdf(logits_x, images) - gaussian_kl(mu_z, sigmasq_z)


encoder_init, encode = stax.serial(
    Dense(8), Relu,
    Dense(8), Relu,
    FanOut(2),
    stax.parallel(Dense(4), stax.serial(Dense(4), Softplus)),
)  # fmt: skip

decoder_init, decode = stax.serial(
    Dense(8), Relu,
    Dense(8), Relu,
    Dense(16),
)  # fmt: skip


def stax_vae_params():
    """The example's ``init_params = init_encoder_params, init_decoder_params``."""
    enc_init_rng, dec_init_rng = jax.random.split(jax.random.key(2))
    _, init_encoder_params = encoder_init(enc_init_rng, (4, 16))
    _, init_decoder_params = decoder_init(dec_init_rng, (4, 4))
    return init_encoder_params, init_decoder_params


def binarized(seed: int) -> jax.Array:
    """The example's ``binarize_batch``: ``random.bernoulli(rng, batch)`` of [0, 1] images."""
    images = jax.random.uniform(jax.random.key(seed), (4, 16))
    return jax.random.bernoulli(jax.random.key(seed + 1000), images)


# -- flax docs_nnx/guides/randomness.md, as written there (google/flax@06611168e74d63a990067b8ae
# 8272206a5f270fb): "Split random state", a dropout mask per row from an nnx.Rngs split over
# the batch and an nnx.vmap; sizes made tiny (Linear(5, 3) for Linear(20, 10))
class SplitRngsModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(5, 3, rngs=rngs)
        self.drop = nnx.Dropout(0.1)

    def __call__(self, x, rngs):
        return nnx.relu(self.drop(self.linear(x), rngs=rngs))


@nnx.vmap(in_axes=(None, 0, 0), out_axes=0)
def model_forward(model, x, rngs):
    return model(x, rngs=rngs)


def _split_rngs(mode: str) -> Callable[[], tuple[Any, Any]]:
    """``(model_forward, model)``: the guide's ``Model(rngs=nnx.Rngs(0))``; eval mode its
    dropout off (``model.eval()``), the rngs then ``None``."""

    def build():
        model = SplitRngsModel(rngs=nnx.Rngs(0))
        if mode == "eval":
            model.eval()
        return model_forward, model

    return build


# the same guide: "Transforming implicit state", recurrent dropout in an nnx.scan; its
# ``class Count(nnx.Variable)`` is nnx_basics' above; sizes made tiny (din 3, dout 4)
class RNNCell(nnx.Module):
    def __init__(self, din, dout, rngs):
        self.linear = nnx.Linear(dout + din, dout, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs, rng_collection="recurrent_dropout")
        self.dout = dout
        self.count = Count(jnp.array(0, jnp.uint32))

    def __call__(self, h, x) -> tuple[jax.Array, jax.Array]:
        h = self.drop(h)  # Recurrent dropout.
        y = nnx.relu(self.linear(jnp.concatenate([h, x], axis=-1)))
        self.count[...] = self.count[...] + 1
        return y, y

    def initial_state(self, batch_size: int):
        return jnp.zeros((batch_size, self.dout))


@nnx.jit
def rnn_forward(cell: RNNCell, x: jax.Array):
    h = cell.initial_state(batch_size=x.shape[0])
    graphdef, rngs, state = nnx.split(cell, "recurrent_dropout", ...)

    # Broadcast the 'recurrent_dropout' PRNG state to have the same mask on every step.
    @nnx.scan(in_axes=(None, nnx.Carry, 1), out_axes=(nnx.Carry, 1))
    def unroll(rngs, mutable, x) -> tuple[jax.Array, jax.Array]:
        state, h = mutable
        cell = nnx.merge(graphdef, rngs, state)
        h, y = cell(h, x)
        return (state, h), y

    _, y = unroll(rngs, (state, h), x)
    return y


def _rnn_cell(mode: str) -> Callable[[], tuple[Any, Any]]:
    """``(rnn_forward, cell)``: the guide's ``RNNCell(8, 16, nnx.Rngs(params=0,
    recurrent_dropout=1))``; eval mode its dropout off (``cell.eval()``)."""

    def build():
        cell = RNNCell(3, 4, nnx.Rngs(params=0, recurrent_dropout=1))
        if mode == "eval":
            cell.eval()
        return rnn_forward, cell

    return build


if eqx is not None:
    import jax.random as jrandom
    import jax.tree_util as jtu

    def _frozen_layer():
        """equinox docs/examples/frozen_layer.ipynb, as written there (patrick-kidger/equinox@
        76d697c1dbad528ef24868c369a0b74c1be153e4): its model and ``filter_spec`` (the last
        layer trained, the rest frozen), the prediction of its loss, ``static_model`` closed
        over: ``(predict, diff_model)``."""
        data_key, loader_key, model_key = jrandom.split(jrandom.PRNGKey(5678), 3)  # noqa: RUF059
        width_size, depth = 8, 1
        # Step 1
        model = eqx.nn.MLP(in_size=1, out_size=1, width_size=width_size, depth=depth, key=model_key)

        # Step 2
        filter_spec = jtu.tree_map(lambda _: False, model)
        filter_spec = eqx.tree_at(
            lambda tree: (tree.layers[-1].weight, tree.layers[-1].bias),
            filter_spec,
            replace=(True, True),
        )
        diff_model, static_model = eqx.partition(model, filter_spec)

        def predict(diff_model, x):  # the loss's, up to its pred_y
            model = eqx.combine(diff_model, static_model)
            pred_y = jax.vmap(model)(x)
            return pred_y

        return predict, diff_model

    _EQX_FROZEN = (Case("eqx_frozen", "eqx", _frozen_layer, lambda s: (_x(s, (4, 1)),)),)
else:  # pragma: no cover - the test extra installs equinox
    _EQX_FROZEN = ()


# -- flax examples/ppo/models.py, as written there (google/flax@1191b8af89396d4e2443a15898becd8
# ed5021242): the actor-critic of its Atari agent, uint8 frames in, (log-probabilities, value)
# out; its frames (84, 84, 4) made (12, 12, 4)
class ActorCritic(nn.Module):
    """Class defining the actor-critic model."""

    num_outputs: int

    @nn.compact
    def __call__(self, x):
        """Define the convolutional network architecture.

        Architecture originates from "Human-level control through deep reinforcement
        learning.", Nature 518, no. 7540 (2015): 529-533.
        Note that this is different than the one from  "Playing atari with deep
        reinforcement learning." arxiv.org/abs/1312.5602 (2013)

        Network is used to both estimate policy (logits) and expected state value;
        in other words, hidden layers' params are shared between policy and value
        networks, see e.g.:
        github.com/openai/baselines/blob/master/baselines/ppo1/cnn_policy.py
        """
        dtype = jnp.float32
        x = x.astype(dtype) / 255.0
        x = nn.Conv(
            features=32,
            kernel_size=(8, 8),
            strides=(4, 4),
            name="conv1",
            dtype=dtype,
        )(x)
        x = nn.relu(x)
        x = nn.Conv(
            features=64,
            kernel_size=(4, 4),
            strides=(2, 2),
            name="conv2",
            dtype=dtype,
        )(x)
        x = nn.relu(x)
        x = nn.Conv(
            features=64,
            kernel_size=(3, 3),
            strides=(1, 1),
            name="conv3",
            dtype=dtype,
        )(x)
        x = nn.relu(x)
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nn.Dense(features=512, name="hidden", dtype=dtype)(x)
        x = nn.relu(x)
        logits = nn.Dense(features=self.num_outputs, name="logits", dtype=dtype)(x)
        policy_log_probabilities = nn.log_softmax(logits)
        value = nn.Dense(features=1, name="value", dtype=dtype)(x)
        return policy_log_probabilities, value


def atari_frames(seed: int) -> jax.Array:
    """Two stacks of 4 uint8 frames, as the example's preprocessing gives them."""
    return _ints(seed, (2, 12, 12, 4), 256).astype(jnp.uint8)


# -- google-research/vision_transformer vit_jax/models_vit.py, as written there (google-research/
# vision_transformer@c6de1e5378c9831a8477feb30994971bdc409e46; docstrings shortened): dropout in
# the attention, the MLP and after the position embedding, all off by `deterministic=not train`
# of a keyword-only `train`; a class token tiled over the batch; a `pre_logits` Dense + tanh of
# `representation_size`; its `transformer` config a dict splatted into the encoder (a ConfigDict
# there). Its ResNet root (for `resnet` not None: R50+ViT) is left out. `AddPositionEmbs`,
# `MlpBlock`, `Encoder`, `VisionTransformer` are `Vit...` here (lm1b's, 05_vae's and
# equinox's hold those names); `VitTransformer` is the file's `VisionTransformer`
class IdentityLayer(nn.Module):
    """Identity layer, convenient for giving a name to an array."""

    @nn.compact
    def __call__(self, x):
        return x


class VitAddPositionEmbs(nn.Module):
    """Adds learned positional embeddings to the inputs."""

    posemb_init: Callable[[Any, tuple[int], Any], Any]
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, inputs):
        # inputs.shape is (batch_size, seq_len, emb_dim).
        assert inputs.ndim == 3, "Number of dimensions should be 3, but it is: %d" % inputs.ndim  # noqa: UP031
        pos_emb_shape = (1, inputs.shape[1], inputs.shape[2])
        pe = self.param("pos_embedding", self.posemb_init, pos_emb_shape, self.param_dtype)
        return inputs + pe


class VitMlpBlock(nn.Module):
    """Transformer MLP / feed-forward block."""

    mlp_dim: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    out_dim: int | None = None
    dropout_rate: float = 0.1
    kernel_init: Callable[..., Any] = nn.initializers.xavier_uniform()
    bias_init: Callable[..., Any] = nn.initializers.normal(stddev=1e-6)

    @nn.compact
    def __call__(self, inputs, *, deterministic):
        actual_out_dim = inputs.shape[-1] if self.out_dim is None else self.out_dim
        x = nn.Dense(features=self.mlp_dim, dtype=self.dtype, param_dtype=self.param_dtype,
                     kernel_init=self.kernel_init, bias_init=self.bias_init)(inputs)  # fmt: skip
        x = nn.gelu(x)
        x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)
        output = nn.Dense(features=actual_out_dim, dtype=self.dtype,
                          param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                          bias_init=self.bias_init)(x)  # fmt: skip
        output = nn.Dropout(rate=self.dropout_rate)(output, deterministic=deterministic)
        return output


class Encoder1DBlock(nn.Module):
    """Transformer encoder layer."""

    mlp_dim: int
    num_heads: int
    dtype: Any = jnp.float32
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, inputs, *, deterministic):
        # Attention block.
        assert inputs.ndim == 3, f"Expected (batch, seq, hidden) got {inputs.shape}"
        x = nn.LayerNorm(dtype=self.dtype)(inputs)
        x = nn.MultiHeadDotProductAttention(
            dtype=self.dtype, kernel_init=nn.initializers.xavier_uniform(),
            broadcast_dropout=False, deterministic=deterministic,
            dropout_rate=self.attention_dropout_rate, num_heads=self.num_heads)(x, x)  # fmt: skip
        x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)
        x = x + inputs

        # MLP block.
        y = nn.LayerNorm(dtype=self.dtype)(x)
        y = VitMlpBlock(mlp_dim=self.mlp_dim, dtype=self.dtype, dropout_rate=self.dropout_rate)(
            y, deterministic=deterministic
        )
        return x + y


class VitEncoder(nn.Module):
    """Transformer Model Encoder for sequence to sequence translation."""

    num_layers: int
    mlp_dim: int
    num_heads: int
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    add_position_embedding: bool = True

    @nn.compact
    def __call__(self, x, *, train):
        assert x.ndim == 3  # (batch, len, emb)

        if self.add_position_embedding:
            x = VitAddPositionEmbs(
                posemb_init=nn.initializers.normal(stddev=0.02),  # from BERT.
                name="posembed_input",
            )(x)
            x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=not train)

        # Input Encoder
        for lyr in range(self.num_layers):
            x = Encoder1DBlock(
                mlp_dim=self.mlp_dim,
                dropout_rate=self.dropout_rate,
                attention_dropout_rate=self.attention_dropout_rate,
                name=f"encoderblock_{lyr}",
                num_heads=self.num_heads,
            )(x, deterministic=not train)
        encoded = nn.LayerNorm(name="encoder_norm")(x)

        return encoded


class VitTransformer(nn.Module):
    """VisionTransformer."""

    num_classes: int
    patches: Any
    transformer: Any
    hidden_size: int
    resnet: Any | None = None
    representation_size: int | None = None
    classifier: str = "token"
    head_bias_init: float = 0.0
    encoder: type[nn.Module] = VitEncoder
    model_name: str | None = None

    @nn.compact
    def __call__(self, inputs, *, train):
        x = inputs
        # (Possibly partial) ResNet root: left out here (`resnet` is None).
        n, h, w, c = x.shape

        # We can merge s2d+emb into a single conv; it's the same.
        x = nn.Conv(features=self.hidden_size, kernel_size=self.patches.size,
                    strides=self.patches.size, padding="VALID", name="embedding")(x)  # fmt: skip

        # Here, x is a grid of embeddings.

        # (Possibly partial) Transformer.
        if self.transformer is not None:
            n, h, w, c = x.shape
            x = jnp.reshape(x, [n, h * w, c])

            # If we want to add a class token, add it here.
            if self.classifier in ["token", "token_unpooled"]:
                cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
                cls = jnp.tile(cls, [n, 1, 1])
                x = jnp.concatenate([cls, x], axis=1)

            x = self.encoder(name="Transformer", **self.transformer)(x, train=train)

        if self.classifier == "token":
            x = x[:, 0]
        elif self.classifier == "gap":
            x = jnp.mean(x, axis=list(range(1, x.ndim - 1)))  # (1,) or (1,2)
        elif self.classifier in ["unpooled", "token_unpooled"]:
            pass
        else:
            raise ValueError(f"Invalid classifier={self.classifier}")

        if self.representation_size is not None:
            x = nn.Dense(features=self.representation_size, name="pre_logits")(x)
            x = nn.tanh(x)
        else:
            x = IdentityLayer(name="pre_logits")(x)

        if self.num_classes:
            x = nn.Dense(features=self.num_classes, name="head",
                         kernel_init=nn.initializers.zeros,
                         bias_init=nn.initializers.constant(self.head_bias_init))(x)  # fmt: skip
        return x


def vit() -> VitTransformer:
    """A tiny ViT for (n, 8, 8, 1) images: 4 patches of 4x4 and a class token, hidden 16, one
    layer (vit_jax/configs/models.py's ViT-Ti/16 with every size cut down)."""
    transformer = {"mlp_dim": 16, "num_heads": 2, "num_layers": 1,
                   "attention_dropout_rate": 0.1, "dropout_rate": 0.1}  # fmt: skip
    return VitTransformer(num_classes=10, patches=SimpleNamespace(size=(4, 4)),
                          transformer=transformer, hidden_size=16, representation_size=8,
                          model_name="ViT-tiny")  # fmt: skip


@cache
def vit_variables():
    """train.py's ``jax.jit(init_model)()``, ``model.init(key, ones, train=False)``, its head
    as after training (:func:`trained_head`)."""
    init = lambda: vit().init(jax.random.key(0), jnp.ones((2, 8, 8, 1)), train=False)  # noqa: E731
    return trained_head(jax.jit(init)())


# -- flax docs_nnx/guides/bridge_guide.md, as written there (google/flax@18f8f311c275d57f46d95e
# 41b15aa97b454754c0): "NNX variable types vs. Linen collections", both directions. Linen ->
# NNX: a linen module of three collections (a counter it raises, what it sows) inside
# ``bridge.ToNNX``, made by ``bridge.lazy_init`` and called ``model(x, mutable=True)``; its
# ``setup`` reads the guide's global ``x`` (here ``BRIDGE_X``). NNX -> Linen: an nnx module of a
# Param, an ``nnx.LoRA`` (linen collection "LoRAParam") and a registered ``Count``
# (renamed ``BridgeCount``: nnx_basics' ``Count`` is above) as ``bridge.to_linen``
BRIDGE_X = _x(42, (2, 4))


class LinenMultiCollections(nn.Module):
    out_dim: int

    def setup(self):
        self.w = self.param("w", nn.initializers.lecun_normal(), (BRIDGE_X.shape[-1], self.out_dim))
        self.b = self.param("b", nn.zeros_init(), (self.out_dim,))
        self.count = self.variable("counter", "count", lambda: jnp.zeros((), jnp.int32))

    def __call__(self, x):
        if not self.is_initializing():
            self.count.value += 1
        y = x @ self.w + self.b
        self.sow("intermediates", "dot_sum", jnp.sum(y))
        return y


def _to_nnx() -> tuple[Any, None]:
    """The guide's ``bridge.lazy_init(bridge.ToNNX(LinenMultiCollections(3), rngs=nnx.Rngs(0)),
    x)``."""
    model = nnx.bridge.ToNNX(LinenMultiCollections(3), rngs=nnx.Rngs(0))
    return nnx.bridge.lazy_init(model, BRIDGE_X), None


@nnx.register_variable_name("counts", overwrite=True)
class BridgeCount(nnx.Variable):
    pass


class NNXMultiCollections(nnx.Module):
    def __init__(self, din, dout, rngs):
        self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (din, dout)))
        self.lora = nnx.LoRA(din, 3, dout, rngs=rngs)
        self.count = BridgeCount(jnp.array(0))

    def __call__(self, x):
        # the guide's `.value` warns in flax 0.12 (as in nnx_basics' Count above): `[...]`
        self.count[...] += 1
        return (x @ self.w[...]) + self.lora(x)


@cache
def _to_linen() -> tuple[Any, Any]:
    """The guide's ``model = bridge.to_linen(NNXMultiCollections, 4, 3)`` and its
    ``model.init({'params': pkey, 'dropout': dkey}, x)``."""
    xkey, pkey, dkey = jax.random.split(jax.random.key(0), 3)  # noqa: RUF059 (the guide's)
    model = nnx.bridge.to_linen(NNXMultiCollections, 4, 3)
    return model, model.init({"params": pkey, "dropout": dkey}, BRIDGE_X)


# -- flax examples/nnx_toy_examples/07_array_leaves.py, as written there (google/flax@18f8f311c2
# 75d57f46d95e41b15aa97b454754c0): an nnx module whose weights are plain jax arrays, not
# Params, and a plain-array count its call raises; trained with ``nnx.DiffState(0, is_param)``
# (``dhidden=32`` made 8)
class ArrayLinear(nnx.Module):
    """The example's ``Linear`` (renamed: nnx_basics' is ``Linear`` above)."""

    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.w = jax.random.normal(rngs.params(), (din, dout))
        self.b = jnp.zeros((dout,))

    def __call__(self, x):
        return x @ self.w + self.b


class ArrayMLP(nnx.Module):
    """The example's ``MLP`` (renamed: nnx_basics' is ``MLP`` above)."""

    def __init__(self, din, dhidden, dout, *, rngs: nnx.Rngs):
        self.count = jnp.array(0)
        self.linear1 = ArrayLinear(din, dhidden, rngs=rngs)
        self.linear2 = ArrayLinear(dhidden, dout, rngs=rngs)

    def __call__(self, x):
        self.count += 1
        return self.linear2(nnx.relu(self.linear1(x)))


def is_param(path, value):
    key = path[-1]
    return key == "w" or key == "b"


# -- flax docs/linen_intro.md, "JAX transformations inside modules: Vmap", as written there
# (google/flax@18f8f311c275d57f46d95e41b15aa97b454754c0): a multi-head attention made from a
# single-head one by nn.vmap (the heads' params stacked, variable_axes={'params': 0}, a dropout
# mask per head, split_rngs) and vmapped again over the batch (the params broadcast); the
# guide's (3, 13, 64) inputs made (4, 3, 4), its init model(train=False), its apply
# model(train=True) with rngs={'dropout': key}
from typing import Optional  # noqa: E402

from jax import lax  # noqa: E402


class RawDotProductAttention(nn.Module):
    attn_dropout_rate: float = 0.1
    train: bool = False

    @nn.compact
    def __call__(self, query, key, value, bias=None, dtype=jnp.float32):
        assert key.ndim == query.ndim
        assert key.ndim == value.ndim

        n = query.ndim
        attn_weights = lax.dot_general(query, key, (((n - 1,), (n - 1,)), ((), ())))
        if bias is not None:
            attn_weights += bias
        norm_dims = tuple(range(attn_weights.ndim // 2, attn_weights.ndim))
        attn_weights = jax.nn.softmax(attn_weights, axis=norm_dims)
        attn_weights = nn.Dropout(self.attn_dropout_rate)(
            attn_weights, deterministic=not self.train
        )
        attn_weights = attn_weights.astype(dtype)

        contract_dims = (tuple(range(n - 1, attn_weights.ndim)), tuple(range(0, n - 1)))
        y = lax.dot_general(attn_weights, value, (contract_dims, ((), ())))
        return y


class DotProductAttention(nn.Module):
    qkv_features: Optional[int] = None  # noqa: UP045 (the guide's)
    out_features: Optional[int] = None  # noqa: UP045
    train: bool = False

    @nn.compact
    def __call__(self, inputs_q, inputs_kv, bias=None, dtype=jnp.float32):
        qkv_features = self.qkv_features or inputs_q.shape[-1]
        out_features = self.out_features or inputs_q.shape[-1]

        QKVDense = partial(nn.Dense, features=qkv_features, use_bias=False, dtype=dtype)
        query = QKVDense(name="query")(inputs_q)
        key = QKVDense(name="key")(inputs_kv)
        value = QKVDense(name="value")(inputs_kv)

        y = RawDotProductAttention(train=self.train)(query, key, value, bias=bias, dtype=dtype)

        y = nn.Dense(features=out_features, dtype=dtype, name="out")(y)
        return y


class MultiHeadDotProductAttention(nn.Module):
    qkv_features: Optional[int] = None  # noqa: UP045
    out_features: Optional[int] = None  # noqa: UP045
    batch_axes: Sequence[int] = (0,)
    num_heads: int = 1
    broadcast_dropout: bool = False
    train: bool = False

    @nn.compact
    def __call__(self, inputs_q, inputs_kv, bias=None, dtype=jnp.float32):
        qkv_features = self.qkv_features or inputs_q.shape[-1]
        out_features = self.out_features or inputs_q.shape[-1]

        # Make multiheaded attention from single-headed dimension.
        Attn = nn.vmap(
            DotProductAttention,
            in_axes=(None, None, None),
            out_axes=2,
            axis_size=self.num_heads,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": not self.broadcast_dropout},
        )

        # Vmap across batch dimensions.
        for axis in reversed(sorted(self.batch_axes)):
            Attn = nn.vmap(
                Attn,
                in_axes=(axis, axis, axis),
                out_axes=axis,
                variable_axes={"params": None},
                split_rngs={"params": False, "dropout": False},
            )

        # Run the vmap'd class on inputs.
        y = Attn(
            qkv_features=qkv_features // self.num_heads,
            out_features=out_features,
            train=self.train,
            name="attention",
        )(inputs_q, inputs_kv, bias)

        return y.mean(axis=-2)


def _vmap_attention(train: bool) -> Callable[[], tuple[Any, Any]]:
    """The guide's ``functools.partial(MultiHeadDotProductAttention, broadcast_dropout=False,
    num_heads=2, batch_axes=(0,))``: ``model(train=train)``, its variables
    ``model(train=False).init({'params': key2}, x, x)``."""
    model = partial(MultiHeadDotProductAttention, broadcast_dropout=False, num_heads=2,
                    batch_axes=(0,))  # fmt: skip

    def build():
        x = _x(0, (4, 3, 4))
        return model(train=train), model(train=False).init({"params": jax.random.key(2)}, x, x)

    return build


def _qkv(seed: int) -> tuple[jax.Array, jax.Array]:
    """The guide's ``apply(init_variables, x, x)``: one array as the queries and the keys."""
    x = _x(seed, (4, 3, 4))
    return x, x


if eqx is not None:
    # equinox docs/tricks.md, "Ensembling", as written there (patrick-kidger/equinox@9336d820b2e
    # f66b360fc6cb3611b3da5cefbb14d): an ensemble of MLPs made by eqx.filter_vmap of their
    # init, called in eqx.filter_vmap: each member on its own rows (evaluate_per_ensemble);
    # eight members made four
    @eqx.filter_vmap
    def make_ensemble(key):
        return eqx.nn.MLP(2, 2, 2, 2, key=key)

    @eqx.filter_vmap
    def evaluate_per_ensemble(model, x):
        return model(x)

    @cache
    def ensemble():
        """``(evaluate_per_ensemble, mlp_ensemble)``, made once; not in MATRIX: its inputs'
        leading axis is its members' (4), no batch (test_authors_matrix.py tests it apart)."""
        key = jax.random.PRNGKey(0)
        keys = jax.random.split(key, 4)
        return evaluate_per_ensemble, make_ensemble(keys)


# -- flax docs_nnx/migrating/linen_to_nnx.rst, "Scan over layers", its Linen side as written
# there (google/flax@18f8f311c275d57f46d95e41b15aa97b454754c0): nn.scan of a Block of Dense
# and Dropout, params stacked (variable_axes={'params': 0}); its split_rngs names 'params'
# only, so the scan drops the 'dropout' stream a training call gives apply (flax raises
# InvalidRngError). ``Block`` and ``MLP`` renamed (nnx_basics' ``MLP`` is above); 64 features
# and 5 layers made 4 and 3
class ScanLayersBlock(nn.Module):
    features: int
    training: bool

    @nn.compact
    def __call__(self, x, _):
        x = nn.Dense(self.features)(x)
        x = nn.Dropout(0.5)(x, deterministic=not self.training)
        x = jax.nn.relu(x)
        return x, None


class ScanLayersMLP(nn.Module):
    features: int
    num_layers: int

    @nn.compact
    def __call__(self, x, training: bool):
        ScanBlock = nn.scan(
            ScanLayersBlock, variable_axes={"params": 0}, split_rngs={"params": True},
            length=self.num_layers)  # fmt: skip

        y, _ = ScanBlock(self.features, training)(x, None)
        return y


@cache
def scan_layers() -> tuple[ScanLayersMLP, Any, jax.Array]:
    """``(model, variables, x)``: the guide's ``MLP(64, num_layers=5)``, its variables."""
    model, x = ScanLayersMLP(4, num_layers=3), _x(0, (4, 4))
    return model, jax.jit(partial(model.init, training=False))(jax.random.key(0), x), x


#: every family of issue 33 as its authors write it: linen (AUTHORS), the nnx tutorial's CNN
#: (an nnx.Rngs passed to each call), JAX's from-scratch MNIST classifier (NumPy float64
#: params, a list of pairs), equinox's examples (a module, or a function of one), Flax's
#: sst2 and lm1b examples, equinox's score-based diffusion model, Flax's imagenet ResNet (its
#: training call the refusal's fix: train.py's pmap axis bound; its eval call train.py's), JAX's
#: stax MNIST classifier (params a list of tuples, empty ones for Relu and LogSoftmax), Flax's
#: bridge guide both ways (a linen module in nnx by bridge.ToNNX, an nnx one in linen by
#: bridge.to_linen), nnx's array leaves (plain jax arrays as weights, no Param), linen_intro's
#: multi-head attention of nn.vmap (heads' params stacked, a dropout rng split per head)
MATRIX = (
    *AUTHORS,
    Case("tutorial_cnn", "nnx", _tutorial_cnn("train"), lambda s: (_x(s, (2, 28, 28, 1)),),
         train={"rngs": lambda: nnx.Rngs(5)}, served=_tutorial_cnn("eval"), classes=10,
         allow=frozenset({"convolution", "reduce_window"})),
    Case("jax_fromscratch", "fn", lambda: (predict, init_random_params(0.1, (5, 8, 3))),
         lambda s: (_x(s),), classes=3),
    Case("nnx_lora", "nnx", _lora("train"), lambda s: (_x(s),),
         train={"rngs": lambda: nnx.Rngs(5)}, eval={"rngs": None}, served=_lora("eval"),
         classes=3),
    Case("nnx_count", "nnx", lambda: (StatefulLinear(5, 3, rngs=nnx.Rngs(0)), None),
         lambda s: (_x(s),)),
    Case("nnx_scan", "nnx", _stack("train"), lambda s: (_x(s),),
         train={"rngs": lambda: nnx.Rngs(5).split(3)}, eval={"rngs": None},
         served=_stack("eval"),
         allow=frozenset({"dynamic_slice", "dynamic_update_slice", "real_dynamic_slice"})),
    Case("nnx_minigpt", "nnx", _minigpt("train"), lambda s: (_ints(s, (2, 8), 16),),
         served=_minigpt("eval"), allow=frozenset({"gather", "scatter"})),
    *_EQX,
    Case("sst2", "linen", _linen(_sst2(), *_sst2_inputs(0), deterministic=True), _sst2_inputs,
         train={"deterministic": False}, eval={"deterministic": True}, rng=jax.random.key(3),
         allow=frozenset({"gather", "scatter", "real_dynamic_slice", "dynamic_update_slice"})),
    Case("lm1b", "linen", _lm1b("train"), lambda s: (_ints(s, (2, 8), 16),),
         rng=jax.random.key(3), served=_lm1b("eval"),
         allow=frozenset({"gather", "scatter", "real_dynamic_slice"})),
    *_EQX_MORE,
    Case("resnet", "fn", lambda: (resnet_train_apply, resnet_variables()),
         lambda s: (_x(s, (2, 8, 8, 3)),), eval={"train": False, "mutable": False},
         served=lambda: (RESNET.apply, resnet_variables()), classes=10,
         logits=lambda out: out[0],  # train.py's loss_fn: logits, new_model_state = ...
         allow=frozenset({"convolution", "reduce_window", "select_and_scatter",
                          "real_dynamic_slice"})),
    Case("stax_mnist", "fn", lambda: (stax_predict, stax_params()), lambda s: (_x(s, (4, 16)),),
         classes=10),
    *_EQX_FROZEN,
    Case("nnx_rnn_dropout", "nnx", _rnn_cell("train"), lambda s: (_x(s, (2, 5, 3)),),
         served=_rnn_cell("eval"),
         allow=frozenset({"real_dynamic_slice", "dynamic_update_slice"})),
    Case("ppo", "linen", _linen(ActorCritic(num_outputs=6), atari_frames(0)),
         lambda s: (atari_frames(s),), allow=frozenset({"convolution"})),
    Case("nnx_split_rngs", "nnx", _split_rngs("train"), lambda s: (_x(s),),
         train={"rngs": lambda: nnx.Rngs(1).split(4)}, eval={"rngs": None},
         served=_split_rngs("eval")),
    Case("jax_readme", "fn", lambda: (perex_grads, init_random_params(0.1, (5, 8, 3))),
         lambda s: (_x(s), _x(s + 7, (4, 3))),
         served=lambda: (flat_perex_grads, init_random_params(0.1, (5, 8, 3)))),
    Case("vit", "linen", lambda: (vit(), vit_variables()), lambda s: (_x(s, (2, 8, 8, 1)),),
         train={"train": True}, eval={"train": False}, rng=jax.random.key(3), classes=10,
         allow=frozenset({"convolution", "dynamic_gather", "scatter", "real_dynamic_slice"})),
    Case("bridge_to_nnx", "nnx", _to_nnx, lambda s: (_x(s, (4, 4)),),
         train={"mutable": True}, eval={"mutable": True}, grows=True),
    # to_linen builds the nnx module anew in each apply: its initializers' erf (a composite,
    # "chlo.erf") in the artifact
    Case("bridge_to_linen", "linen", _to_linen, lambda s: (_x(s, (4, 4)),)),
    Case("nnx_array_leaves", "nnx",
         lambda: (ArrayMLP(din=1, dhidden=8, dout=1, rngs=nnx.Rngs(0)), None),
         lambda s: (_x(s, (4, 1)),), wrt=is_param),
    Case("linen_vmap_attention", "linen", _vmap_attention(True), _qkv, rng=jax.random.key(3),
         served=_vmap_attention(False)),
)  # fmt: skip


def calls(case: Case, fn: Callable[..., Any], mode: str, n: int) -> tuple[list[Any], Any, dict]:
    """``n`` calls of ``fn`` (a Hybrid, or the plain model) on ``case``'s inputs in ``mode``:
    the outputs, the equinox state threaded through them (or ``None``), and the settings
    (an ``nnx.Rngs`` among them as the calls left it)."""
    settings, state = case.settings(mode), case.carry() if case.carries(mode) else None
    outs = []
    for i in range(n):
        if state is None:
            outs.append(fn(*case.inputs(i), **settings))
        else:
            out, state = fn(*case.inputs(i), state, **settings)
            outs.append(out)
    return outs, state, settings


def plain_calls(case: Case, mode: str, n: int) -> tuple[list[Any], Any, dict]:
    """:func:`calls` of the plain Flax, nnx or equinox model (no symjax_mlp); the state is
    what :func:`reference_calls` gives for linen, the nnx module's non-Param state for nnx,
    the threaded state for equinox."""
    if case.kind == "linen":
        settings = case.settings(mode)
        outs, state = reference_calls(case, n, settings, mode)
        return outs, state, settings
    model, params = case.model(mode)
    fn = model if params is None else partial(model, params)
    outs, state, settings = calls(case, fn, mode, n)
    if case.kind == "nnx":  # the module, or the module a function takes (nnx_scan)
        state = nnx.state(model if params is None else params, nnx.Not(case.wrt or nnx.Param))
    return outs, state, settings
