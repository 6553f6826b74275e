"""Run an artifact with JAX: ``load(path)`` (the default runtime).

``model.jaxexport`` is deserialized with ``jax.export.deserialize`` (flatbuffers, no pickle),
checked against the manifest and ``model.mlirbc`` (names, shapes, dtypes, trees, platforms,
devices, the StableHLO bytes), and called through one ``jax.jit`` of ``Exported.call``, with
the params as a dict of device arrays keyed by param path (the module's own input tree names
them, so weights are bound by name). XLA compiles once per input shape, and a module loaded
again in the same process (same sha256) reuses the compilations. An artifact exported for
N > 1 devices runs under the caller's mesh of N devices, else a mesh of the first N.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from symjax_mlp._artifact.format import (
    JAXEXPORT,
    MLIRBC,
    check_calling_convention,
    compatibility_note,
)
from symjax_mlp._errors import ArtifactError
from symjax_mlp._specs import shape_dims


def check_supported(path: Path, manifest: Mapping[str, Any]) -> None:
    """Refuses artifacts this JAX cannot run: calling convention, platform, device count."""
    check_calling_convention(manifest, file=path / JAXEXPORT)
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


# sha256 of model.jaxexport -> (Exported, its jitted call), most recently loaded last.
_CALLS: dict[str, tuple[Any, Callable[..., Any]]] = {}
_MAX_CALLS = 8


def runner(
    path: Path,
    manifest: Mapping[str, Any],
    blobs: Mapping[str, bytes],
    params: Sequence[np.ndarray],
) -> Callable[[list[Any]], list[Any]]:
    """Deserializes ``model.jaxexport`` and returns ``run(inputs) -> [jax.Array, ...]``."""
    key = manifest["files"][JAXEXPORT]["sha256"]
    cached = _CALLS.pop(key, None)  # the same module loaded again: reuse its compilations
    if cached:
        exported, call = cached
    else:
        try:
            exported = jax.export.deserialize(bytearray(blobs[JAXEXPORT]))
        except Exception as e:  # an unreadable module: most likely made by an incompatible JAX
            raise ArtifactError(
                f"{path / JAXEXPORT}: jax.export could not deserialize it ({type(e).__name__}: "
                f"{e}). {compatibility_note(manifest)}"
            ) from e
        call = jax.jit(exported.call)
    _check_agrees(path, manifest, blobs, exported)
    _CALLS[key] = exported, call
    while len(_CALLS) > _MAX_CALLS:
        _CALLS.pop(next(iter(_CALLS)))  # least recently loaded
    names = [p["path"] for p in manifest["params"]]
    weights = {n: jax.numpy.asarray(a) for n, a in zip(names, params, strict=True)}
    n = manifest["nr_devices"]
    if n == 1:

        def run(inputs: list[Any]) -> list[Any]:
            return jax.tree.leaves(call(weights, *inputs))

        return run
    # A sharded export runs on exactly n devices: under the caller's mesh of n devices (as
    # load(path, mesh=...) sets one), else under a mesh of the first n (check_supported saw enough).
    mesh = jax.make_mesh(
        (n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n]
    )

    def run_sharded(inputs: list[Any]) -> list[Any]:
        current = jax.sharding.get_mesh()
        if not current.empty and current.size == n:
            return jax.tree.leaves(call(weights, *inputs))
        with jax.set_mesh(mesh):
            return jax.tree.leaves(call(weights, *inputs))

    return run_sharded


def _check_agrees(
    path: Path, manifest: Mapping[str, Any], blobs: Mapping[str, bytes], exported: Any
) -> None:
    """Checks the deserialized module against the manifest and ``model.mlirbc``.

    Each file's checksum only proves that file is what the manifest recorded; this proves the
    files belong together: the module takes the listed params (by name), inputs and outputs
    (shapes and dtypes), on the listed platforms and devices, and is the very StableHLO of
    ``model.mlirbc`` (so both runtimes run one program).
    """
    sig = manifest["signature"]

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
    checks = [
        (
            args == list(manifest["mlir_arguments"]) and kept == sorted(set(kept)),
            f"passes {args} to its StableHLO main, not {list(manifest['mlir_arguments'])}",
        ),
        (exported.in_tree == in_tree, f"takes {exported.in_tree}, not {in_tree}"),
        (got_in == want_in, f"takes {got_in}, not {want_in}"),
        (exported.out_tree == out_tree, f"returns {exported.out_tree}, not {out_tree}"),
        (got_out == want_out, f"returns {got_out}, not {want_out}"),
        (
            list(exported.platforms) == list(manifest["platforms"]),
            f"runs on {list(exported.platforms)}, not {list(manifest['platforms'])}",
        ),
        (
            exported.nr_devices == manifest["nr_devices"],
            f"runs on {exported.nr_devices} device(s), not {manifest['nr_devices']}",
        ),
        (
            exported.calling_convention_version == manifest["calling_convention_version"],
            f"has calling convention {exported.calling_convention_version}",
        ),
        (
            len(exported.ordered_effects) == manifest.get("ordered_effects", 0),
            f"has {len(exported.ordered_effects)} ordered effect(s)",
        ),
        (
            bytes(exported.mlir_module_serialized) == blobs[MLIRBC],
            f"holds a StableHLO module other than {MLIRBC}'s",
        ),
    ]
    problems = [what for ok, what in checks if not ok]
    if problems:
        raise ArtifactError(
            f"{path / JAXEXPORT} does not match {path / 'manifest.json'} and {MLIRBC}: the module "
            + "; ".join(problems)
            + ". The files come from different exports, or one was edited; export it again."
        )
