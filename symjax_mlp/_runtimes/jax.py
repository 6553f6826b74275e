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

from symjax_mlp._artifact.format import JAXEXPORT, MLIRBC, caller, program_file, show
from symjax_mlp._compat import linearizing, skipping_lapack
from symjax_mlp._errors import ArtifactError, ConfigError
from symjax_mlp._runtimes.transforms import Program
from symjax_mlp._specs import shape_dims


def check_supported(path: Path, manifest: Mapping[str, Any]) -> None:
    """Refuses artifacts this JAX cannot run: calling convention, platform, device count."""
    version = manifest["calling_convention_version"]
    lo = jax.export.minimum_supported_calling_convention_version
    hi = jax.export.maximum_supported_calling_convention_version
    if not isinstance(version, int) or not lo <= version <= hi:
        raise ArtifactError(
            f"{path / JAXEXPORT}: the artifact uses jax.export calling convention version "
            f"{version}, but jax {jax.__version__} loads versions {lo} to {hi} only: it is outside "
            f"JAX's compatibility window. {compatibility_note(manifest)}"
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


def compatibility_note(manifest: Mapping[str, Any]) -> str:
    """The compatibility window, and how to re-export, for error messages."""
    made, created = (
        show(v)[1:-1] for v in (manifest["versions"].get("jax", "?"), manifest["created"])
    )
    return (
        f"The artifact was exported on {created} with jax {made}; this "
        f"is jax {jax.__version__}. jax.export guarantees that an artifact loads in JAX "
        "releases up to about 6 months newer than the one that exported it, not older ones "
        "and not beyond that window. To fix it, re-export: rebuild the model from its source, "
        "load its weights (params.safetensors is plain safetensors and still readable), and "
        f"call symjax_mlp.export(h, path, example=x, overwrite=True) under jax "
        f"{jax.__version__}; or load it with the exporting version "
        f"(pip install jax=={made} jaxlib=={made})."
    )


# sha256 of model.jaxexport -> (Exported, its Program, what made it), the most recent last
_CALLS: dict[str, tuple[Any, Program, Any]] = {}
_MAX_CALLS = 8


def deserialize(path: Path, manifest: Mapping[str, Any], blobs: Mapping[str, Any]) -> Any:
    """``model.jaxexport`` deserialized and checked against the manifest and ``model.mlirbc``."""
    file = program_file(manifest, JAXEXPORT)
    key = manifest["files"][file]["sha256"]
    cached = _CALLS.get(key)
    if cached:
        exported = cached[0]
    else:
        try:
            exported = jax.export.deserialize(blobs[file])
        except Exception as e:  # an unreadable module: most likely made by an incompatible JAX
            raise ArtifactError(
                f"{path / file}: jax.export could not deserialize it ({type(e).__name__}: "
                f"{str(e)[:300]}). {compatibility_note(manifest)}"
            ) from e
    _check_agrees(path, manifest, blobs, exported)
    return exported


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
                if next(linearizing(), False):
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
    if n == 1:
        return call_checked, weights
    # the mesh of the first n devices (check_supported saw enough), unless the caller set one
    mesh = jax.make_mesh(
        (n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n]
    )

    def run_sharded(inputs: list[Any]) -> list[Any]:
        try:
            current = jax.sharding.get_mesh()
        except ValueError:  # under a trace (jax.grad's): only the mesh set around it counts
            if jax.sharding.get_abstract_mesh().size == n:
                return call_checked(inputs)
            raise ConfigError(
                f"load({str(path)!r}): the artifact runs sharded over {n} devices, and under a "
                "transformation (jax.grad, jax.vmap) it needs the mesh set around it: "
                f"with jax.set_mesh(jax.make_mesh(({n},), ('data',))): jax.grad(...)(x)."
            ) from None
        if not current.empty and current.size == n:
            return call_checked(inputs)
        with jax.set_mesh(mesh):
            return call_checked(inputs)

    return run_sharded, weights


def _check_agrees(
    path: Path, manifest: Mapping[str, Any], blobs: Mapping[str, bytes], exported: Any
) -> None:
    """Checks that the module, the manifest and ``model.mlirbc`` are one program (checksums
    prove only that each file is what the manifest recorded)."""
    sig = manifest["signature"]
    n_dev = manifest["nr_devices"]
    jaxexport, mlirbc = program_file(manifest, JAXEXPORT), program_file(manifest, MLIRBC)
    symbolic = any(not isinstance(d, int) for a in exported.in_avals for d in a.shape)

    def types(specs: Any) -> list[tuple[tuple[Any, ...], str]]:
        return [(tuple(s["shape"]), s["dtype"]) for s in specs]

    params = sorted(manifest["params"], key=lambda p: p["path"])  # a dict flattens sorted
    want_in, want_out = types(params) + types(sig["inputs"]), types(sig["outputs"])
    got_in = [(shape_dims(a.shape), str(a.dtype)) for a in exported.in_avals]
    got_out = [(shape_dims(a.shape), str(a.dtype)) for a in exported.out_avals]
    names = dict.fromkeys((p["path"] for p in params), 0)
    in_tree = jax.tree.structure(((names, *[0] * len(sig["inputs"])), {}))
    n_out = len(sig["outputs"])
    out_tree = jax.tree.structure(0 if sig["output_kind"] == "array" else (0,) * n_out)
    all_names = [*names, *(s["path"] for s in sig["inputs"])]
    kept = list(exported.module_kept_var_idx)  # the inputs main() takes; IREE runs this list
    args = (["platform_index"] if len(exported.platforms) > 1 else []) + [
        all_names[i] if 0 <= i < len(all_names) else f"#{i}" for i in kept
    ]
    e, platforms = exported, list(manifest["platforms"])
    shardings = e.in_shardings_hlo + e.out_shardings_hlo
    checks = [
        (args == list(manifest["mlir_arguments"]) and kept == sorted(set(kept)),
         f"passes {args} to its StableHLO main, not {list(manifest['mlir_arguments'])}"),
        (e.in_tree == in_tree, f"takes {e.in_tree}, not {in_tree}"),
        (got_in == want_in, f"takes {got_in}, not {want_in}"),
        (e.out_tree == out_tree, f"returns {e.out_tree}, not {out_tree}"),
        (got_out == want_out, f"returns {got_out}, not {want_out}"),
        (list(e.platforms) == platforms, f"runs on {list(e.platforms)}, not {platforms}"),
        (e.nr_devices == n_dev, f"runs on {e.nr_devices} device(s), not {n_dev}"),
        (e.calling_convention_version == manifest["calling_convention_version"],
         f"has calling convention {e.calling_convention_version}"),
        (len(e.ordered_effects) == manifest.get("ordered_effects", 0),
         f"has {len(e.ordered_effects)} ordered effect(s)"),
        (bytes(e.mlir_module_serialized) == blobs[mlirbc],
         f"holds a StableHLO module other than {mlirbc}'s"),
        (not e.disabled_safety_checks, "was exported with jax.export's safety checks disabled "
         f"({', '.join(map(str, e.disabled_safety_checks))[:200]})"),
        (not e.unordered_effects, "has effects (host callbacks)"),
        (len(e.in_shardings_hlo) == len(e.in_avals) and len(e.out_shardings_hlo)
         == len(e.out_avals) and (n_dev > 1 or not any(shardings)),
         "has shardings that do not fit its inputs, outputs or device count"),
        (bool(e.uses_global_constants) == (symbolic or len(e.platforms) > 1),
         "says it uses global constants, which it does not (or the reverse)"),
    ]  # fmt: skip
    problems = [what for ok, what in checks if not ok]
    if problems:
        raise ArtifactError(
            f"{path / jaxexport} does not match {path / 'manifest.json'} and {mlirbc}: the module "
            + "; ".join(p if len(p) < 400 else p[:396] + "..." for p in problems)
            + ". The files come from different exports, or one was edited; export it again."
        )
