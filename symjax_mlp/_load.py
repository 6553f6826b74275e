"""Stage 5 of the flow: an artifact directory to a callable model, no model source needed.

``load`` checks, in this order and before any bytes reach a deserializer: the manifest, the
sha256 of every file, the format version, the platform, the device count, and the params
against the manifest's param tree. Then a runtime (:mod:`symjax_mlp._runtimes`) deserializes
the ``jax.export`` module (JAX) or compiles ``model.mlirbc`` (IREE). Nothing here uses pickle
or eval.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from symjax_mlp import _selftest as selftest
from symjax_mlp._artifact.format import PARAMS
from symjax_mlp._artifact.reading import freeze, read_artifact
from symjax_mlp._artifact.signature import Signature
from symjax_mlp._artifact.weights import check_params, decode_params, param_specs
from symjax_mlp._errors import ArtifactError, ConfigError
from symjax_mlp._files import read_regular
from symjax_mlp._hybrid.mesh import auto_mesh
from symjax_mlp._specs import TensorSpec

RUNTIMES = ("jax", "iree")


class LoadedModel:
    """An artifact ready to call: checked, deserialized (JAX) or compiled (IREE).

    ``m(x)`` checks every input against :attr:`signature` (raising
    :class:`~symjax_mlp.SignatureError`) and runs the exported program with the artifact's
    params. The JAX runtime returns ``jax.Array``; the IREE runtime returns NumPy arrays.

    Attributes:
      path: the artifact directory.
      manifest: the manifest, read-only.
      signature: what the model takes and returns, symbolic dims by name.
      runtime: ``"jax"`` or ``"iree"``.
    """

    def __init__(
        self,
        path: Path,
        manifest: Any,
        runtime: str,
        params: dict[str, np.ndarray],
        run: Callable[[list[Any]], list[Any]],
    ) -> None:
        self.path = path
        self.manifest = manifest
        self.signature = Signature.from_json(manifest["signature"])
        self.runtime = runtime
        self._params = params
        self._run = run
        self._caller = f'symjax_mlp.load("{path}")'
        self._single_output = self.signature.output_kind == "array"
        self._checked: set[tuple[Any, ...]] = set()

    @property
    def params(self) -> dict[str, np.ndarray]:
        """The weights in use, ``{"params/layers_0/kernel": array, ...}`` (read-only arrays)."""
        return dict(self._params)

    def __call__(self, *inputs: jax.typing.ArrayLike) -> Any:
        # Hot path: a (shape, dtype) signature that passed the check once needs no second
        # check; only arrays (things with .shape and .dtype) are remembered, at most 256.
        try:
            key = tuple((x.shape, x.dtype) for x in inputs)
        except AttributeError:
            key = None
        if key is None or key not in self._checked:
            inputs = self.signature.check(inputs, caller=self._caller)
            if key is not None and len(self._checked) < 256:
                self._checked.add(key)
        outs = self._run(inputs)
        return outs[0] if self._single_output else tuple(outs)

    def __repr__(self) -> str:
        return f"LoadedModel({str(self.path)!r}, runtime={self.runtime!r}, {self.signature})"


def load(
    path: str | os.PathLike[str],
    *,
    params: str | os.PathLike[str] | Any | None = None,
    runtime: str = "jax",
    mesh: Mesh | None = None,
    self_test: bool = True,
) -> LoadedModel:
    """Loads an artifact written by :func:`export`; no model source code is needed.

    Checks, in this order and before any bytes reach a deserializer: the manifest, the sha256
    of every file, the format version, the platform, the device count, and the params against
    the manifest's param tree. Then it deserializes the ``jax.export`` module (JAX) or compiles
    ``model.mlirbc`` (IREE). Nothing here uses pickle or eval.

    Args:
      path: the artifact directory.
      params: other weights for the same param tree: a ``.safetensors`` file (for example
        another export's ``params.safetensors``) or a params pytree; default: the artifact's.
      runtime: ``"jax"`` (XLA via ``jax.export``) or ``"iree"`` (IREE's llvm-cpu, needs the
        ``symjax_mlp[iree]`` extra).
      self_test: run the artifact's self-test vectors (the inputs it was exported with and
        the outputs they gave) and refuse a model that no longer reproduces them.
      mesh: for an artifact exported from a sharded Hybrid: a mesh of exactly its
        ``nr_devices`` devices to run on (default: the caller's mesh of that size, else the
        first ``nr_devices`` devices).

    Returns:
      A callable :class:`LoadedModel` with ``.signature`` and ``.manifest``.

    Raises:
      ArtifactError: anything wrong with the artifact, naming the file and what to do.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import symjax_mlp as sm
      >>> net, x = sm.mlp((4, 2)), jnp.ones((1, 3))
      >>> h = sm.hybridize(net, net.init(jax.random.key(0), x))
      >>> art = sm.export(h, getfixture("tmp_path") / "m", example=x)
      >>> m = sm.load(art.path)
      >>> m(x).shape, str(m.signature)
      ((1, 2), '(args[0]: float32[b, 3]) -> float32[b, 2]  with b >= 1')
    """
    if runtime not in RUNTIMES:
        raise ConfigError(f"load(runtime={runtime!r}): expected one of {RUNTIMES}.")
    path = Path(path)
    manifest, blobs = read_artifact(path)
    _warn_if_expiring(path, manifest)
    expected = [TensorSpec.from_json(p) for p in manifest["params"]]
    backend = importlib.import_module(f"symjax_mlp._runtimes.{runtime}")
    backend.check_supported(path, manifest)
    mesh = _check_mesh(path, manifest, mesh)
    if params is None:
        found, source = decode_params(blobs[PARAMS], file=path / PARAMS), path / PARAMS
    elif isinstance(params, (str, os.PathLike)):
        source = Path(params)
        try:
            data = read_regular(source, error=ArtifactError)
        except FileNotFoundError:
            raise ArtifactError(f"load(params={str(source)!r}): there is no such file.") from None
        found = decode_params(data, file=source)
    else:
        specs, arrays = param_specs(params)
        found, source = {s.path: a for s, a in zip(specs, arrays, strict=True)}, "params="
    ordered = check_params(found, expected, file=source)
    run = backend.runner(path, manifest, blobs, ordered)
    if mesh is not None:
        run = _under(mesh, run)
    if self_test and params is None:  # other weights give other outputs, by design
        selftest.run(path, manifest, blobs, run)
    weights = dict(zip([s.path for s in expected], ordered, strict=True))
    return LoadedModel(path, freeze(manifest), runtime, weights, run)


def _check_mesh(path: Path, manifest: Any, mesh: Mesh | None) -> Mesh | None:
    need = int(manifest["nr_devices"])
    if mesh is None:
        return None
    if not isinstance(mesh, Mesh):
        raise ConfigError(f"load(mesh=...) expects a jax.sharding.Mesh; got {type(mesh).__name__}.")
    if mesh.size != need:
        raise ArtifactError(
            f'symjax_mlp.load("{path}"): the artifact was exported for {need} device(s), but '
            f"the mesh {dict(mesh.shape)} has {mesh.size}. jax.export programs run on the "
            f"device count they were exported for: pass a mesh of {need} devices, e.g. "
            f"sm.data_mesh({need}), or export again on a mesh of {mesh.size}."
        )
    return auto_mesh(mesh)


def _under(mesh: Mesh, run: Callable[[list[Any]], list[Any]]) -> Callable[..., list[Any]]:
    def run_on_mesh(inputs: list[Any]) -> list[Any]:
        with jax.set_mesh(mesh):
            return run(inputs)

    return run_on_mesh


def _warn_if_expiring(path: Path, manifest: Any, *, days: int = 30) -> None:
    """Warns when the artifact leaves ``jax.export``'s compatibility window within ``days``."""
    import datetime
    import warnings

    until = manifest.get("compatible_until")
    try:
        end = datetime.date.fromisoformat(str(until))
    except ValueError:
        return  # older artifacts record no window; the calling convention check still runs
    left = (end - datetime.date.today()).days
    if left <= days:
        warnings.warn(
            f'symjax_mlp.load("{path}"): the artifact leaves jax.export\'s compatibility window '
            f"on {end} ({'in ' + str(left) + ' days' if left >= 0 else 'already'}): newer JAX "
            "releases may refuse it. Export it again from its source with this JAX.",
            FutureWarning,
            stacklevel=3,
        )
