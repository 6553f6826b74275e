"""Run an artifact with JAX: ``load(path)`` (the default runtime).

``model.jaxexport`` is deserialized (no pickle), checked against the manifest and
``model.mlirbc``, and called through one ``jax.jit`` of ``Exported.call`` (:mod:`.transforms`).
A module loaded again in the process reuses its compilations; an export for N > 1 devices runs
under the caller's mesh of N devices, else a mesh of the first N.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from symjax_mlp._artifact import module
from symjax_mlp._artifact.format import JAXEXPORT, caller, program_file
from symjax_mlp._cache import refuse_shared_cache
from symjax_mlp._compat import skipping_lapack
from symjax_mlp._errors import ArtifactError, ConfigError
from symjax_mlp._hybrid.mesh import program_mesh
from symjax_mlp._runtimes.transforms import Program, forward_traced


def check_supported(path: Path, manifest: Mapping[str, Any]) -> None:
    """Refuses artifacts this JAX cannot run (calling convention, platform, device count), and
    a compilation cache that others may write (its entries are executables run as the model's)."""
    version = manifest["calling_convention_version"]
    lo = jax.export.minimum_supported_calling_convention_version
    hi = jax.export.maximum_supported_calling_convention_version
    if not lo <= version <= hi:  # an int: check_schema
        raise ArtifactError(
            f"{path / JAXEXPORT}: the artifact uses jax.export calling convention version "
            f"{version}, but jax {jax.__version__} loads versions {lo} to {hi} only: it is outside "
            f"JAX's compatibility window. {module.compatibility_note(manifest)}"
        )
    here = jax.export.default_export_platform()
    listed = tuple(manifest["platforms"])
    if here not in listed:
        raise ArtifactError(
            f"{path / 'manifest.json'}: the artifact was exported for {', '.join(listed)}, but "
            f"JAX here runs on {here}. Re-export it for this platform too, e.g. "
            f"export(h, path, example=x, platforms={(*listed, here)!r}, overwrite=True)."
        )
    need, have = manifest["nr_devices"], jax.device_count()
    if need > have:
        raise ArtifactError(
            f"{path / 'manifest.json'}: the artifact is sharded over {need} devices, but JAX "
            f"here sees {have} {here} device(s). Run it where {need} devices are visible, or "
            "re-export it unsharded."
        )
    refuse_shared_cache(f"load({str(path)!r})")


# sha256 of model.jaxexport -> (Exported, its Program, what made it), the most recent last
_CALLS: dict[str, tuple[Any, Program, Any]] = {}
_MAX_CALLS = 8


def deserialize(path: Path, manifest: Mapping[str, Any], blobs: Mapping[str, Any]) -> Any:
    """:func:`~symjax_mlp._artifact.module.deserialize`, of the module loaded before if any."""
    cached = _CALLS.get(manifest["files"][program_file(manifest, JAXEXPORT)]["sha256"])
    return module.deserialize(path, manifest, blobs, cached[0] if cached else None)


def runner(
    path: Path, manifest: Mapping[str, Any], blobs: Mapping[str, Any],
    params: Sequence[np.ndarray], *, exported: Any, guard: Callable[..., None] | None = None,
    custom_calls: Any = None, constants: bool = False,
) -> tuple[Callable[[list[Any]], list[Any]], dict[str, Any]]:  # fmt: skip
    """``run(inputs) -> [jax.Array, ...]`` and its weights (on device); ``guard`` checks each
    new input signature before XLA compiles it; ``constants``: the weights as XLA constants."""
    if constants and manifest["nr_devices"] != 1:
        raise ConfigError(
            f"load({str(path)!r}, params_as_constants=True): the artifact runs sharded over "
            f"{manifest['nr_devices']} devices, and its weights are placed on each; load it "
            "without params_as_constants."
        )
    key = manifest["files"][program_file(manifest, JAXEXPORT)]["sha256"]
    made = guard, manifest.get("rows"), caller(path, manifest)  # messages name this load
    cached = _CALLS.pop(key, None)  # the same module loaded again: reuse its compilations
    if not (cached and cached[0] is exported and cached[2] == made):
        cached = exported, Program(path, manifest, exported, guard), made
    _CALLS[key], program = cached, cached[1]
    while len(_CALLS) > _MAX_CALLS:
        _CALLS.pop(next(iter(_CALLS)))  # least recently loaded
    names = [p["path"] for p in manifest["params"]]
    # device_put, not jnp.asarray (which makes two copies): the arrays read from the file are
    # 64-byte aligned, so on CPU the device buffer is the host buffer, no copy at all
    weights = {n: jax.device_put(a) for n, a in zip(names, params, strict=True)}
    checked: set[Any] = set()  # (shape, dtype) of the inputs of each call the guard passed
    tree = exported.out_tree
    single = tree.num_leaves == 1 and tree.num_nodes == 1  # one array, not a tuple of one
    run = functools.partial(program.call, weights)
    if constants:  # the weights closed over: XLA constants
        run = jax.jit(lambda *inputs: program.fn(weights, *inputs))

    def call_checked(inputs: list[Any]) -> list[Any]:
        key = tuple([(x.shape, x.dtype) for x in inputs]) if guard else None  # not str(dtype)
        go = run
        for x in inputs:  # a loop, not any(...): no generator on every call
            if isinstance(x, Tracer):
                # traced inside jax.linearize (jax.linearize(jax.jit(m))): not the one jit, whose
                # cached trace linearize would reuse, but the program's own custom_vjp, whose
                # forward rule refuses linearize where inputs carry tangents (transforms.py)
                if forward_traced():
                    go = functools.partial(program.fn, weights)
                break
        if key is None or key in checked:
            out = go(*inputs)
        else:  # the first call of this signature: it compiles
            with skipping_lapack(custom_calls):
                if program.check(program.call, (weights, *inputs)) and len(checked) < 256:
                    checked.add(key)
                out = go(*inputs)
        return [out] if single else list(out)

    n = manifest["nr_devices"]
    if n == 1:  # a LoadedModel calls the program straight for arrays of a signature that ran
        call_checked.direct = run, single  # type: ignore[attr-defined]
        if not constants:  # m.apply(params, *inputs): the program over other weights
            call_checked.program = program.checked  # type: ignore[attr-defined]
        return call_checked, weights
    # the program's mesh over the first n devices (check_supported saw enough), unless the caller's
    mesh = program_mesh(exported, n)

    def run_sharded(inputs: list[Any]) -> list[Any]:
        try:
            current = jax.sharding.get_mesh()
        except ValueError:  # under a trace (jax.grad's): only the mesh set around it counts
            if jax.sharding.get_abstract_mesh().size == n:
                return call_checked(inputs)
            raise ConfigError(
                f"load({str(path)!r}): the artifact runs sharded over {n} devices, and under a "
                "transformation (jax.grad, jax.vmap) it needs the mesh set around it: "
                f"with jax.set_mesh(jax.make_mesh({mesh.axis_sizes}, {mesh.axis_names})): "
                "jax.grad(...)(x)."
            ) from None
        if not current.empty and current.size == n:
            try:
                return call_checked(inputs)
            except Exception as e:  # the caller's mesh (or load's mesh=), of another shape
                if current.axis_sizes == mesh.axis_sizes:
                    raise
                raise ConfigError(
                    f"load({str(path)!r}): the artifact's program is sharded over a mesh "
                    f"{dict(mesh.shape)} and runs on a mesh of that shape, not the "
                    f"{dict(current.shape)} set around the call (or passed as load's mesh=): "
                    f"pass mesh=jax.make_mesh({mesh.axis_sizes}, {mesh.axis_names}), or none."
                ) from e
        with jax.set_mesh(mesh):
            return call_checked(inputs)

    return run_sharded, weights
