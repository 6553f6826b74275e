"""The artifacts a fuzz run is built on, and what a worker knows of them.

:func:`make` writes the original artifact (a tiny MLP), another export to mix files from, the
input, the bait files an escape would read and a pickle payload; :class:`Context` is a
worker's view of them: the original's bytes and output, and the scratch directory each case
is mutated in (:func:`case_rng` seeds it).
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
from pathlib import Path
from typing import ClassVar

MANIFEST, JAXEXPORT, MLIRBC, PARAMS, SELFTEST = (
    "manifest.json",
    "model.jaxexport",
    "model.mlirbc",
    "params.safetensors",
    "selftest.safetensors",
)
FILES = (MANIFEST, JAXEXPORT, MLIRBC, PARAMS, SELFTEST)
DATA = FILES[1:]


# -- the original artifact ---------------------------------------------------------------------
def make(out: Path) -> None:
    """Writes ``out/original`` (a tiny MLP), ``out/other`` (another export), ``out/x.npy``,
    the bait files an escape would read, and a pickle payload that would touch a marker."""
    import symjax_mlp as sm

    out.mkdir(parents=True, exist_ok=True)
    x = example()
    for name, net, variables in mlps(x):
        sm.export(sm.hybridize(net, variables), out / name, example=x, overwrite=True)
    finish(out, out, x, FILES)


def example():
    """The input every case is called with: (3, 3) float32."""
    import jax
    import numpy as np

    return np.asarray(jax.random.normal(jax.random.key(7), (3, 3)), np.float32)


def mlps(x) -> list[tuple[str, object, dict]]:
    """``(name, net, variables)`` of the original's MLP and of another export's."""
    import jax

    import symjax_mlp as sm

    # (3, 3, 2) on 3 features: two (3, 3) kernels and two (3,) biases, so that a swap of
    # same-shaped params passes every shape check and only the names can tell them apart.
    made = []
    for name, act, seed in (("original", "tanh", 0), ("other", "relu", 1)):
        net = sm.mlp((3, 3, 2), activation=act)
        made.append((name, net, net.init(jax.random.key(seed), x)))
    return made


def finish(out: Path, base: Path, x, files: tuple[str, ...]) -> None:
    """Writes what a target's originals in ``base`` need beside them: ``base/x.npy``, the bait
    files an escape would read (``base/bait``), and ``out``'s pickle payload, which would touch
    the marker ``out/PWNED``."""
    import numpy as np

    np.save(base / "x.npy", x)
    bait = base / "bait"
    bait.mkdir(exist_ok=True)
    for f in files:
        shutil.copy(base / "original" / f, bait / f)
    marker = out / "PWNED"

    class Payload:  # unpickling it would create the marker: loading must never unpickle
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (out / "payload.pkl").write_bytes(pickle.dumps(Payload()))


# -- one case ----------------------------------------------------------------------------------
def case_rng(seed: int, case: int) -> random.Random:
    """The one source of randomness of case ``case`` of run ``seed``."""
    return random.Random(f"symjax-fuzz:{seed}:{case}")


class Context:
    """What a worker knows: the original artifact, its output, and the scratch directory.

    A target over other originals (:mod:`fuzzing.entries`) subclasses it: where ``make`` wrote
    them (``ROOT``, under ``out``), their files, and what the oracle compares (``outputs``).
    """

    ROOT = ""  # the originals' directory, under out
    FILES, DATA = FILES, DATA  # the original's files; all but the manifest
    MODULES: ClassVar[dict[str, str]] = {JAXEXPORT: MLIRBC}  # each .jaxexport: its module's file

    def __init__(self, out: Path, work: Path):
        import numpy as np

        import symjax_mlp as sm

        self.out, self.work = out.resolve(), work.resolve()
        base = self.out / self.ROOT
        self.original, self.other, self.bait = base / "original", base / "other", base / "bait"
        self.case = self.work / "case"
        self.marker = self.out / "PWNED"
        self.inputs = base / "x.npy"
        self.x = np.load(self.inputs)
        self.blobs = {f: (self.original / f).read_bytes() for f in self.FILES}
        self.other_blobs = {f: (self.other / f).read_bytes() for f in self.FILES}
        self.manifest = json.loads(self.blobs[MANIFEST])
        self.reference = sm.load(self.original)
        self.expected = self.outputs(self.reference)
        self.work.mkdir(parents=True, exist_ok=True)
        for f in self.FILES:  # bait for "../NAME" from the case directory
            (self.work / f).write_bytes(self.blobs[f])

    def outputs(self, model):
        """What the oracle compares: the output of a loaded model on the input."""
        return host(model(self.x))

    def reset(self) -> None:
        if self.case.is_symlink() or self.case.is_file():
            self.case.unlink()
        elif self.case.exists():
            shutil.rmtree(self.case)
        self.case.mkdir()
        for f in self.FILES:
            (self.case / f).write_bytes(self.blobs[f])

    def expected_for_params(self, data: bytes):
        """The output for re-signed weights, read by safetensors' own NumPy reader (None: that
        reader rejects them, or they do not fit the model, so loading must fail)."""
        import safetensors.numpy

        try:
            flat = safetensors.numpy.load(data)
        except Exception:
            return None
        want = {p["path"]: (tuple(p["shape"]), p["dtype"]) for p in self.manifest["params"]}
        got = {k: (tuple(v.shape), str(v.dtype)) for k, v in flat.items()}
        if got != want:
            return None
        tree: dict = {}
        for path, value in flat.items():
            node = tree
            *parents, leaf = path.split("/")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        import symjax_mlp as sm

        return self.outputs(sm.load(self.original, params=tree))


def host(y):
    import numpy as np

    if isinstance(y, tuple):
        return ("tuple", tuple(np.asarray(a) for a in y))
    return (type(y).__name__, (np.asarray(y),))


def same(a, b, *, nan_equal: bool = False) -> bool:
    import numpy as np

    if a[0] != b[0] or len(a[1]) != len(b[1]):
        return False
    for u, v in zip(a[1], b[1], strict=True):
        if u.shape != v.shape or u.dtype != v.dtype:
            return False
        if nan_equal:
            if not np.array_equal(u, v, equal_nan=True):
                return False
        elif u.tobytes() != v.tobytes():
            return False
    return True
