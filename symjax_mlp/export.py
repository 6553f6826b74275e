"""Export a :class:`~symjax_mlp.Hybrid` to a portable StableHLO artifact, and load it back.

``export`` runs ``jax.export`` on the Hybrid's pure function with the params as *inputs* (not
constants), so the weights live in a separate, cross-language ``params.safetensors`` and can be
swapped at load. ``load`` needs none of the model's Python source: it checks the manifest,
every file's sha256, the format version, platforms, device count and the params against the
param tree, and only then deserializes (JAX) or compiles (IREE).
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import os
import platform as _platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from symjax_mlp.artifact import Artifact, check_target, freeze, write_dir
from symjax_mlp.errors import ArtifactError, SignatureError
from symjax_mlp.hybrid import _TRACER_ERRORS, Hybrid
from symjax_mlp.manifest import (
    FORMAT,
    FORMAT_VERSION,
    JAXEXPORT,
    MLIR,
    MLIRBC,
    PARAMS,
    Signature,
    TensorSpec,
    read_artifact,
    sha256,
    shape_dims,
)
from symjax_mlp.weights import check_params, decode_params, encode_params, param_specs

__all__ = ["LoadedModel", "export", "export_mlp", "load"]

RUNTIMES = ("jax", "iree")
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")  # what jax.export lowers for


def export(
    h: Hybrid,
    path: str | os.PathLike[str],
    *,
    example: jax.typing.ArrayLike | Sequence[jax.typing.ArrayLike],
    batch: str | None = "b",
    platforms: Sequence[str] = ("cpu",),
    overwrite: bool = False,
) -> Artifact:
    """Exports ``h`` as a portable artifact directory (StableHLO + safetensors + manifest).

    Args:
      h: the :class:`~symjax_mlp.Hybrid` to export; its params become inputs of the exported
        function and are written to ``params.safetensors``. A :class:`~symjax_mlp.Sharded`
        exports its sharded program (see :meth:`~symjax_mlp.Sharded.export`).
      path: the artifact directory. Written atomically: a temporary sibling, manifest last,
        then renamed into place.
      example: an input array, or a tuple of input arrays; only shapes and dtypes are used.
      batch: the name of a symbolic leading dimension shared by every input (one artifact
        serves any batch size >= 1), or ``None`` to export the example's static shapes.
      platforms: the JAX platforms to lower for, e.g. ``("cpu", "cuda")``; no device of
        those platforms is needed to export.
      overwrite: replace an existing artifact at ``path``.

    Returns:
      The :class:`~symjax_mlp.Artifact`.

    Raises:
      ArtifactError: ``path`` exists (without ``overwrite``) or cannot be written.
      SignatureError: ``example`` is not an array or a tuple of arrays, or the output is not.

    Example:
      >>> h = sm.hybridize(net, net.init(jax.random.key(0), x))
      >>> art = sm.export(h, "my_mlp", example=x, platforms=("cpu", "cuda"))
      >>> sm.load("my_mlp")(x).shape
      (1, 2)
    """
    from symjax_mlp.distributed import Sharded  # distributed imports export; avoid a cycle

    if isinstance(h, Sharded):  # records the mesh: nr_devices = mesh.size
        return h.export(
            path, example=example, batch=batch, platforms=platforms, overwrite=overwrite
        )
    if not isinstance(h, Hybrid):
        raise TypeError(
            f"export() expects a Hybrid; got {type(h).__name__}. Write "
            "sm.export(sm.hybridize(model, variables), path, example=x)."
        )
    path = Path(path)
    examples = tuple(example) if isinstance(example, (tuple, list)) else (example,)
    in_specs = _input_structs(examples, batch)
    platforms = tuple(platforms)
    unknown = [p for p in platforms if p not in PLATFORMS]
    if unknown or not platforms or len(set(platforms)) != len(platforms):
        raise ValueError(
            f"export(platforms={platforms!r}): name each platform once, from {PLATFORMS} "
            "(a GPU is 'cuda' or 'rocm')."
        )
    check_target(path, overwrite)  # fail before the work, not after it
    specs, host_params = param_specs(h.params)
    treedef = jax.tree.structure(h.params)
    fn, paths = h.fn, [s.path for s in specs]

    # The params go in as a dict keyed by path, so the module's own input tree names every
    # param and load binds weights by name (an edited manifest cannot swap two of one shape).
    def model(params: dict[str, jax.Array], *inputs: jax.Array) -> Any:
        return fn(jax.tree.unflatten(treedef, [params[p] for p in paths]), *inputs)

    model.__name__ = "model"
    order = sorted(range(len(specs)), key=lambda i: specs[i].path)  # a dict flattens sorted
    specs, host_params = [specs[i] for i in order], [host_params[i] for i in order]
    p_structs = {
        s.path: jax.ShapeDtypeStruct(a.shape, a.dtype)
        for s, a in zip(specs, host_params, strict=True)
    }
    try:
        exported = jax.export.export(jax.jit(model), platforms=platforms)(p_structs, *in_specs)
    except _TRACER_ERRORS as e:
        raise h._control_flow_error(e) from e
    except jax.errors.InconclusiveDimensionOperation as e:
        raise SignatureError(
            f"export({h.name}, batch={batch!r}): the function needs a concrete value of the "
            f"symbolic batch {batch!r} ({str(e).splitlines()[0]}). Keep the batch symbolic "
            "(use x.shape[0] only inside jnp operations, reshape with -1), or export static "
            "shapes with batch=None."
        ) from e
    out_leaves = jax.tree.leaves(exported.out_avals)
    out_kind = _output_kind(exported, h)
    signature = Signature(
        tuple(
            TensorSpec(f"args[{i}]", shape_dims(a.shape), str(a.dtype))
            for i, a in enumerate(exported.in_avals[len(specs) :])
        ),
        tuple(
            TensorSpec(
                "out" if out_kind == "array" else f"out[{i}]", shape_dims(a.shape), str(a.dtype)
            )
            for i, a in enumerate(out_leaves)
        ),
        out_kind,
        batch,
    )
    names = [s.path for s in specs] + [s.path for s in signature.inputs]
    if len(set(names)) != len(names) or "platform_index" in names:
        raise ArtifactError(f"export({h.name}): param paths collide with input names: {names}")
    mlir_args = (["platform_index"] if len(platforms) > 1 else []) + [
        names[i] for i in exported.module_kept_var_idx
    ]
    files = {
        JAXEXPORT: bytes(exported.serialize()),
        MLIRBC: bytes(exported.mlir_module_serialized),
        MLIR: exported.mlir_module().encode(),
        PARAMS: encode_params(specs, host_params),
    }
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "name": h.name,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": _versions(),
        "platforms": list(platforms),
        "nr_devices": exported.nr_devices,
        "calling_convention_version": exported.calling_convention_version,
        "ordered_effects": len(exported.ordered_effects),
        "signature": signature.to_json(),
        "params": [s.to_json() for s in specs],
        "mlir_arguments": mlir_args,
        "files": {k: {"sha256": sha256(v), "bytes": len(v)} for k, v in files.items()},
    }
    write_dir(path, files, manifest, overwrite=overwrite)
    return Artifact(path, freeze(manifest))


def export_mlp(
    path: str | os.PathLike[str],
    *,
    sizes: Sequence[int] = (256, 128, 2),
    in_features: int = 512,
    activation: str = "relu",
    seed: int = 0,
    batch: str | int = "b",
    platforms: Sequence[str] = ("cpu",),
    overwrite: bool = False,
) -> Artifact:
    """Exports the chapter's MLP (``mlp(sizes)`` on ``in_features`` inputs, initialised from
    ``seed``): what ``symjax-mlp export`` runs.

    Args:
      batch: a name for a symbolic batch dimension, or an int for a static batch size.
      Others: as in :func:`~symjax_mlp.mlp` and :func:`export`.
    """
    from symjax_mlp.hybrid import hybridize
    from symjax_mlp.models import mlp

    static = isinstance(batch, int) and not isinstance(batch, bool)
    x = jax.numpy.zeros((batch if static else 1, in_features), jax.numpy.float32)
    net = mlp(tuple(sizes), activation=activation)
    h = hybridize(net, net.init(jax.random.key(seed), x))
    return export(
        h,
        path,
        example=x,
        batch=None if static else batch,
        platforms=platforms,
        overwrite=overwrite,
    )


def _input_structs(examples: tuple[Any, ...], batch: str | None) -> list[jax.ShapeDtypeStruct]:
    if batch is not None and (not isinstance(batch, str) or not batch.isidentifier()):
        raise ValueError(f"export(batch={batch!r}): pass a name such as 'b', or None.")
    dim = jax.export.symbolic_shape(batch)[0] if batch else None
    structs = []
    for i, x in enumerate(examples):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise SignatureError(
                f"export(example=...): args[{i}] is a {type(x).__name__}; pass an array (or a "
                "tuple of arrays), e.g. example=jnp.zeros((1, 512), jnp.float32)."
            )
        shape = tuple(x.shape)
        if dim is not None:
            if not shape:
                raise SignatureError(
                    f"export(example=...): args[{i}] is a scalar, so it has no batch dimension "
                    f"for batch={batch!r}. Pass batch=None for static shapes."
                )
            shape = (dim, *shape[1:])
        structs.append(jax.ShapeDtypeStruct(shape, x.dtype))
    return structs


def _output_kind(exported: Any, h: Hybrid) -> str:
    out_tree = exported.out_tree
    if out_tree.num_leaves == 1 and out_tree == jax.tree.structure(0):
        return "array"
    if out_tree.num_nodes == out_tree.num_leaves + 1 and (
        out_tree == jax.tree.structure((0,) * out_tree.num_leaves)
    ):
        return "tuple"
    raise SignatureError(
        f"export({h.name}): the function returns {out_tree}; an artifact returns an array or a "
        "flat tuple of arrays (what every runtime, IREE included, can hand back). Return "
        "tuple(jax.tree.leaves(out)) from the function you export."
    )


def _versions() -> dict[str, str]:
    import jaxlib

    def dist(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    return {
        "symjax_mlp": dist("symjax_mlp"),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": dist("flax"),
        "numpy": np.__version__,
        "python": _platform.python_version(),
    }


# -- loading ----------------------------------------------------------------------------------
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

    Returns:
      A callable :class:`LoadedModel` with ``.signature`` and ``.manifest``.

    Raises:
      ArtifactError: anything wrong with the artifact, naming the file and what to do.

    Example:
      >>> m = sm.load("my_mlp")
      >>> m(x).shape, str(m.signature)
      ((1, 2), '(args[0]: float32[b, 512]) -> float32[b, 2]  with b >= 1')
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"load(runtime={runtime!r}): expected one of {RUNTIMES}.")
    path = Path(path)
    manifest, blobs = read_artifact(path)
    expected = [TensorSpec.from_json(p) for p in manifest["params"]]
    backend = importlib.import_module(f"symjax_mlp.runtimes.{runtime}")
    backend.check_supported(path, manifest)
    if params is None:
        found, source = decode_params(blobs[PARAMS], file=path / PARAMS), path / PARAMS
    elif isinstance(params, (str, os.PathLike)):
        source = Path(params)
        try:
            data = source.read_bytes()
        except OSError as e:
            raise ArtifactError(f"load(params={str(source)!r}): cannot read it: {e}") from e
        found = decode_params(data, file=source)
    else:
        specs, arrays = param_specs(params)
        found, source = {s.path: a for s, a in zip(specs, arrays, strict=True)}, "params="
    ordered = check_params(found, expected, file=source)
    run = backend.runner(path, manifest, blobs, ordered)
    weights = dict(zip([s.path for s in expected], ordered, strict=True))
    return LoadedModel(path, freeze(manifest), runtime, weights, run)
