"""An artifact's program: ``model.jaxexport`` deserialized and checked to be one program with
the manifest and ``model.mlirbc``; the compatibility note of a module this JAX cannot run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from symjax_mlp._artifact.format import JAXEXPORT, MLIRBC, program_file, show
from symjax_mlp._errors import ArtifactError
from symjax_mlp._specs import shape_dims


def compatibility_note(manifest: Mapping[str, Any]) -> str:
    """The compatibility window, and how to re-export, for error messages."""
    made = show(manifest["versions"].get("jax", "?"))[1:-1]
    created = show(manifest["created"])[1:-1]
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


def deserialize(
    path: Path, manifest: Mapping[str, Any], blobs: Mapping[str, Any], exported: Any = None
) -> Any:
    """``model.jaxexport`` deserialized (unless ``exported``, its module loaded before) and
    checked against the manifest and ``model.mlirbc``."""
    file = program_file(manifest, JAXEXPORT)
    if exported is None:
        try:
            exported = jax.export.deserialize(blobs[file])
        except Exception as e:  # an unreadable module: most likely made by an incompatible JAX
            raise ArtifactError(
                f"{path / file}: jax.export could not deserialize it ({type(e).__name__}: "
                f"{str(e)[:300]}). {compatibility_note(manifest)}"
            ) from e
    _check_agrees(path, manifest, blobs, exported)
    return exported


def mlir_arguments(exported: Any, names: Sequence[str]) -> list[str]:
    """The arguments of ``exported``'s StableHLO main, by the names of its inputs."""
    return (["platform_index"] if len(exported.platforms) > 1 else []) + [
        names[i] if 0 <= i < len(names) else f"#{i}" for i in exported.module_kept_var_idx
    ]


def _check_agrees(
    path: Path, manifest: Mapping[str, Any], blobs: Mapping[str, bytes], exported: Any
) -> None:
    """Checks that the module, the manifest and ``model.mlirbc`` are one program (checksums
    prove only that each file is what the manifest recorded)."""
    sig, n_dev = manifest["signature"], manifest["nr_devices"]
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
    kept = list(exported.module_kept_var_idx)  # the inputs main() takes; IREE runs this list
    args = mlir_arguments(exported, [*names, *(s["path"] for s in sig["inputs"])])
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
