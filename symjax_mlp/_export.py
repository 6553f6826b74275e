"""Stage 3 of the flow: a :class:`~symjax_mlp.Hybrid` to a portable StableHLO artifact: each
entry point staged by :mod:`symjax_mlp._export_entry`, one weight file, written atomically."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.metadata
import json
import os
import platform as _platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.extend.core import jaxpr_as_fun

from symjax_mlp import _export_options as options
from symjax_mlp import _selftest as selftest
from symjax_mlp._artifact import jaxconfig
from symjax_mlp._artifact.format import (
    FORMAT,
    JAXEXPORT,
    MANIFEST,
    MAX_HELD_BYTES,
    MLIRBC,
    PARAMS,
    SELFTEST,
    check_target,
    entry_files,
    printable,
)
from symjax_mlp._artifact.module import mlir_arguments
from symjax_mlp._artifact.reading import Artifact, freeze
from symjax_mlp._artifact.signature import Signature, admits_any, sizes_at
from symjax_mlp._artifact.weights import encode
from symjax_mlp._cache import refuse_shared_cache
from symjax_mlp._errors import (
    ArtifactError,
    ConfigError,
    as_bool,
    as_int,
    refuse_keywords,
)
from symjax_mlp._export_batch import weak_typed
from symjax_mlp._export_entry import Stage, export_program, stage
from symjax_mlp._export_gather import refuse_clamped_gathers
from symjax_mlp._export_options import check_options, serialized, tolerance_option
from symjax_mlp._files import sha256, write_dir
from symjax_mlp._hybrid.hybrid import Hybrid
from symjax_mlp._reader import read_regular
from symjax_mlp._signing import SIGNATURE
from symjax_mlp._specs import TensorSpec

COMPATIBILITY_WINDOW = datetime.timedelta(days=180)  # jax.export: JAX loads it for 6 months


def export(
    h: Hybrid | Mapping[str, Hybrid],
    path: str | os.PathLike[str],
    *,
    example: jax.typing.ArrayLike | Sequence[jax.typing.ArrayLike],
    batch: str | None = "b",
    platforms: Sequence[str] = ("cpu",),
    overwrite: bool = False,
    kwargs: Mapping[str, Any] | None = None,
    shapes: Sequence[str | None] | None = None,
    constraints: Sequence[str] = (),
    metadata: Mapping[str, Any] | None = None,
    vjp_order: int = 0,
    self_test_tolerance: float | Mapping[str, float] | None = None,
    **keywords: Any,
) -> Artifact:
    """Exports ``h`` as a portable artifact directory (StableHLO + safetensors + manifest).

    The model's Python runs as ``jax.export`` traces it (a ``print`` in it prints then), and
    again for each of these: an input of a Python number's dtype (float32, int32, or a scalar),
    once with its weak type flipped, since the model's Python may pick a dtype from an input's
    kind (``jnp.result_type(x, jnp.bfloat16)``), which no dtype of the program shows; a
    symbolic dimension (``batch``, the default, or ``shapes=``), once at the example's shapes,
    where the self-test checks the program against the model's own answers (a model branching
    on a shape, ``if x.shape[0] == 1``, takes another branch at a symbolic one; at static
    shapes export's own trace is the model's answer); a stateful model (batch statistics, rng
    streams), once with its state, to find what a call moves; an nnx module not in eval mode,
    twice, to tell whether its mode changes the program.

    Args:
      h: the :class:`~symjax_mlp.Hybrid` to export (its params go to ``params.safetensors``),
        or a dict of entry points over that one file, ``{"predict": h, "embed": h_embed}``,
        the first the default; ``example``, ``kwargs``, ``shapes`` and ``constraints`` may
        then be dicts by name.
      path: the artifact directory, written atomically; two exports of one model write the
        same bytes where ``SOURCE_DATE_EPOCH`` (reproducible-builds.org) dates the manifest
        (and starts its 6-month ``compatible_until`` window: pin a recent time, a commit's).
      example: an input array, or a tuple of them; only shapes and dtypes are used. Python
        settings in it (``(x, 2)`` for a depth) are baked into the export.
      batch: the name of a symbolic leading dimension shared by every input (any batch size
        >= 1), or ``None`` for the example's static shapes.
      platforms: the JAX platforms to lower for, e.g. ``("cpu", "cuda")`` (no device needed).
      overwrite: replace an existing artifact at ``path``.
      kwargs: keyword settings baked into the export, e.g. ``{"train": False}``; given as
        export's own (``train=False``), a ConfigError naming ``kwargs=``.
      shapes: instead of ``batch``, a ``jax.export`` shape spec per input, e.g.
        ``("b, t", "512")`` (``None``: the example's static shape); names are shared.
      constraints: ``jax.export`` constraints on those names, e.g. ``("t <= 1024",)``.
      metadata: a model card, JSON data (labels, metrics, license), kept in the manifest and
        in ``params.safetensors``'s ``__metadata__``.
      vjp_order: the orders of gradients the artifact carries (``1``: ``jax.grad`` works).
      self_test_tolerance: how far load lets the outputs of the self-test vectors move (rtol
        and atol; ``{"rtol": r, "atol": a}`` apart), at most ``0.1``: a model whose answer moves
        within its own tolerance (an adaptive ODE solver's rtol) on another machine or jaxlib.

    Returns:
      The :class:`~symjax_mlp.Artifact`.

    Raises:
      ConfigError: an option is invalid (checked before any work).
      ArtifactError: ``path`` exists (without ``overwrite``) or cannot be written.
      SignatureError: ``example`` (or the output) is not an array or a tuple of arrays.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import symjax_mlp as sm
      >>> net, x = sm.mlp((4, 2)), jnp.ones((1, 3))
      >>> h = sm.hybridize(net, net.init(jax.random.key(0), x))
      >>> path = getfixture("tmp_path") / "my_mlp"
      >>> art = sm.export(h, path, example=x, platforms=("cpu", "cuda"))
      >>> sm.load(art.path)(x).shape
      (1, 2)
    """
    text = os.fspath(path) if isinstance(path, str | os.PathLike) else None
    if not isinstance(text, str) or "\x00" in text:
        raise ConfigError(
            f"symjax_mlp.export(..., path={path!r}): the artifact directory is a str or a "
            "pathlib.Path without a NUL character; pass one, e.g. 'my_mlp'."
        )
    if not text:  # Path("") is the working directory
        raise ArtifactError("export: the path is ''; pass the artifact directory to write.")
    refuse_keywords("export(h", keywords, "sm.export(h, path, example=x")
    vjp_order = as_int(vjp_order)  # a sweep's np.int64: an int (a bool stays refused)
    overwrite = as_bool(overwrite)  # np.True_: True, as train and a Hybrid take it
    points, settings, platforms, meta = check_options(
        h, batch, platforms, example=example, kwargs=kwargs, shapes=shapes,
        constraints=constraints, overwrite=overwrite, metadata=metadata, vjp_order=vjp_order,
    )  # fmt: skip
    tolerance = tolerance_option(self_test_tolerance)  # None: load's default
    created = options.created_at()  # SOURCE_DATE_EPOCH's, checked before any work
    path, names = Path(path), list(points)
    staged = [stage(points[n], batch, **{k: v[i] for k, v in settings.items()})
              for i, n in enumerate(names)]  # fmt: skip
    shared = _shared_params(names, staged)
    _check_target(path, overwrite)  # fail before the work, not after it
    files: dict[str, bytes] = {}
    programs, needs = [], set()
    for i, (name, entry) in enumerate(zip(names, staged, strict=True)):
        # the default entry point takes every weight; the others their own
        own = shared if i == 0 else {s.path: shared[s.path] for s in entry.specs}
        exported, signature, rows, jaxpr = export_program(entry, own, platforms)
        params = {p: entry.weak.get(p, a) for p, (_, a) in own.items()}  # the model's, weak too
        signature = weak_typed(signature, entry.fn, params, entry.examples)
        refuse_clamped_gathers(entry.h.name, jaxpr, vjp_order)
        if not admits_any(signature, [n for x in entry.examples for n in x.shape]):
            raise ConfigError(
                _NOTHING_ADMITTED.format(name=entry.h.name, constraints=entry.constraints,
                                         inputs=", ".join(map(str, signature.inputs)))
            )  # fmt: skip
        roles = entry_files(name) if i else {r: r for r in (JAXEXPORT, MLIRBC, SELFTEST)}
        files[roles[JAXEXPORT]] = serialized(exported, vjp_order, entry.h.name, signature.inputs)
        needs.update(_needs(files[roles[JAXEXPORT]], path / roles[JAXEXPORT]))
        files[roles[MLIRBC]] = bytes(exported.mlir_module_serialized)
        with selftest.flags_off():  # (else jax.debug_nans raised for the vectors' NaN)
            vectors = _self_test_vectors(exported, signature, params, entry, jaxpr)
        if vectors is None or len(vectors) > MAX_HELD_BYTES:  # more than load holds
            del roles[SELFTEST]
        else:
            files[roles[SELFTEST]] = vectors
        programs.append(
            {
                "name": entry.h.name,
                "signature": signature.to_json(),
                "format_version": signature.format_version,  # 3 where weak types decide
                "rows": rows,
                "params": sorted(own),
                "mlir_arguments": mlir_arguments(
                    exported, [*own, *(s.path for s in signature.inputs)]
                ),
                "static": options.shown(entry.static, entry.h.variables),
                "program_files": roles,
                "nr_devices": exported.nr_devices,
                "calling_convention_version": exported.calling_convention_version,
                "ordered_effects": len(exported.ordered_effects),
            }
        )
    for key in _DEVICES:  # an artifact's entry points share its devices
        values = {n: p[key] for n, p in zip(names, programs, strict=True)}
        if len(set(values.values())) > 1:
            raise ConfigError(
                f"export(): the entry points differ in {key} ({values}); an artifact's entry "
                "points run on one set of devices. Shard them alike (or not at all)."
            )
    specs = [shared[p][0] for p in sorted(shared)]
    mirror = {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}
    tensors = {p: shared[p][1] for p in sorted(shared)}
    files[PARAMS] = encode(tensors, {**mirror, "format": "symjax_mlp.params"})
    main = programs[0]
    manifest = {
        "format": FORMAT,
        "format_version": max(p["format_version"] for p in programs),
        "name": main["name"],
        "created": created.isoformat(timespec="seconds"),
        "compatible_until": (created + COMPATIBILITY_WINDOW).date().isoformat(),
        "vjp_order": vjp_order,
        **({"self_test_tolerance": tolerance} if tolerance else {}),
        "metadata": meta,
        "versions": _versions(),
        **({"jax_config": c} if (c := jaxconfig.recorded()) else {}),  # what shaped the program
        "platforms": list(platforms),
        **{k: main[k] for k in (*_DEVICES, "signature", "rows")},
        "params": [s.to_json() for s in specs],
        **{k: main[k] for k in ("mlir_arguments", "static")},
        **({"needs": sorted(needs)} if needs else {}),  # what a signed artifact loads with
        "files": {k: {"sha256": sha256(v), "bytes": len(v)} for k, v in files.items()},
    }
    if len(names) > 1:
        manifest["entry"] = names[0]
        manifest["entries"] = {
            name: {k: p[k] for k in ENTRY_FIELDS}
            for name, p in zip(names[1:], programs[1:], strict=True)
        }
    files[MANIFEST] = (json.dumps(manifest, indent=2) + "\n").encode()
    write_dir(path, files, overwrite=overwrite, check=_check_target, error=ArtifactError,
              what="the artifact")  # fmt: skip
    return Artifact(path, freeze(manifest))


def _check_target(path: Path, overwrite: bool) -> None:
    """``check_target``, and a directory replaced only while it holds an artifact's files and
    nothing else: another tool's manifest.json, or the user's own files, are never deleted."""
    check_target(path, overwrite)
    above = Path(os.path.realpath(path.parent))  # through symlinks and '..'
    if outer := next((p for p in (above, *above.parents) if _listed(p) is not None), None):
        raise ArtifactError(_INSIDE.format(path=printable(str(path)), outer=printable(str(outer))))
    if not (overwrite and path.is_dir() and (path / MANIFEST).exists()):
        return
    if extra := sorted(set(os.listdir(path)) - (_listed(path) or set())):
        raise ArtifactError(
            f"symjax_mlp.export({str(path)!r}, overwrite=True): the directory holds "
            f"{', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''}, which no symjax_mlp "
            "artifact there lists (another tool's manifest.json, or files of yours), and "
            "overwrite would delete them. Move them out, or choose another path."
        )


_NOTHING_ADMITTED = (
    "export({name}, constraints={constraints}): no input could call the artifact: every "
    "symbolic dimension of its inputs ({inputs}) is >= 1, and no sizes satisfy the constraints "
    "together. Fix the one that refuses every size (a '<=' meant as '>=', a bound below 1), "
    "or drop it."
)
_INSIDE = (
    'symjax_mlp.export("{path}"): {outer} is an artifact, and an artifact is never written '
    "inside another (the outer one's checks and copies would not cover it, and replacing the "
    "outer one would delete it). Choose a path outside it, beside it in its parent directory."
)


def _listed(path: Path) -> set[str] | None:
    """The files of the symjax_mlp artifact at ``path``, its manifest too; ``None`` if there
    is none (no manifest.json, or another tool's)."""
    if not (path / MANIFEST).is_file():
        return None
    try:
        manifest = json.loads(read_regular(path / MANIFEST, limit=64 << 20, error=ArtifactError))
        ours = manifest["format"] == FORMAT
        return {MANIFEST, SIGNATURE, *manifest["files"]} if ours else None
    except (ArtifactError, ValueError, TypeError, KeyError):  # not JSON, not a dict, no files
        return None


def _needs(data: bytes, file: Path) -> list[str]:
    """What the program needs beyond a loader's defaults, by the loader's own checker."""
    from symjax_mlp._artifact import checker, ops

    try:
        exported = jax.export.deserialize(bytearray(data))
        return ops.needs(checker.program(file, sha256(data), exported)[0])
    except ArtifactError:  # the checker refuses to read it: it declares nothing
        return []


_DEVICES = ("nr_devices", "calling_convention_version", "ordered_effects")
ENTRY_FIELDS = ("name", "signature", "rows", "params", "mlir_arguments", "static", "program_files")


def _shared_params(names: list[str], staged: list[Stage]) -> dict[str, tuple[TensorSpec, Any]]:
    """Every entry point's params by path, one tensor per path: the one weight file."""
    shared: dict[str, tuple[TensorSpec, Any]] = {}
    owner: dict[str, str] = {}
    for name, entry in zip(names, staged, strict=True):
        for spec, array in zip(entry.specs, entry.host_params, strict=True):
            if spec.path in shared:
                (other, known) = shared[spec.path]
                if other != spec or not np.array_equal(known, array):
                    what = f"{other.type} and {spec.type}" if other != spec else "the same shape"
                    raise ConfigError(
                        f"export(): entry points {owner[spec.path]!r} and {name!r} both have a "
                        f"param {spec.path}, with different values ({what}), but one weight "
                        "file holds one tensor per path. Build both Hybrids from the same "
                        "variables (linen's method=, or functions of the same params)."
                    )
                continue
            shared[spec.path], owner[spec.path] = (spec, array), name
    return shared


def _self_test_vectors(
    exported: Any, signature: Signature, params: Mapping[str, Any], entry: Stage, jaxpr: Any
) -> bytes | None:
    """Seeded inputs and what the exported program gives for them, where it runs here, once
    it gives the model's own results at the example's shapes: all in one compiled program.
    The model's are its export trace's (``jaxpr``) where that was at those shapes; else (a
    symbolic dimension) its Python runs there again: where it branches on a shape, it shows."""
    here = jax.export.default_export_platform()
    # each dimension variable at BATCH, a dimension at its term's value there ("b + 15": 17)
    sizes = sizes_at(dataclasses.replace(signature, constraints=()), selftest.BATCH)
    xs = selftest.drawn(signature.inputs, sizes=sizes)
    symbolic = any(isinstance(d, str) for s in signature.inputs for d in s.shape)
    if xs is not None and exported.nr_devices != 1 and symbolic:
        selftest.check_resolves(entry.h.name, exported, params, xs)  # (its vectors skipped)
    if xs is None or here not in exported.platforms or exported.nr_devices != 1:
        return None
    at = selftest.drawn(entry.examples, seed=1)
    at = None if at is None or any(x.size == 0 for x in at) else at
    if at is not None:  # a weakly typed scalar example (2.0) as the model and program take it
        at = [jax.numpy.asarray(a.item()) if e.weak_type and not a.shape else a
              for e, a in zip(entry.examples, at, strict=True)]  # fmt: skip

    model, traced = entry.fn, [(a.shape, a.dtype) for a in jaxpr.in_avals[len(params) :]]
    if at is not None and traced == [(x.shape, x.dtype) for x in at]:  # static: one trace
        model = functools.partial(_run, jaxpr_as_fun(jaxpr))

    def programs(params: Any, xs: Any, at: Any) -> Any:
        both = None if at is None else (exported.call(params, *at), model(params, *at))
        return exported.call(params, *xs), both

    refuse_shared_cache(f"export({entry.h.name})")  # compiled through JAX's cache
    try:
        outs, both = jax.jit(programs)(params, xs, at)
    except jax.errors.JaxRuntimeError as e:  # out of memory: this machine's, not the model's
        selftest.out_of_memory(f"export({entry.h.name})", e, " in the self-test export runs")
        raise
    except (ValueError, TypeError):  # a shape the program's constraints refuse, or the model
        # The drawn shapes (each symbolic dim 2) may break a constraint (t >= 4): then the
        # vectors are drawn at the example's shapes, which the constraints admit (if small);
        # the example's may break one too: then no comparison. Run again with what the
        # program takes: a model that raises there raises as it did.
        at = at if at is not None and selftest.refusal(exported.call, params, at) is None else None
        small = at is not None and sum(x.nbytes for x in at) <= selftest.MAX_INPUT_BYTES
        if (refused := selftest.refusal(exported.call, params, xs)) is not None:
            selftest.claims_more(entry.h.name, signature, xs, refused)
        xs = xs if refused is None else at if small else None
        if xs is None and at is None:
            return None
        outs, both = jax.jit(programs)(params, at if xs is None else xs, at)
    if both is not None:
        selftest.against_source(entry.h.name, *both, at, symbolic)
    if xs is None or any(str(s.dtype).startswith("key") for s in signature.outputs):
        return None  # (as for an rng-key input: a vector file holds no key)
    compute = selftest.narrowest(exported.mlir_module())
    return selftest.encode(xs, [np.asarray(y) for y in jax.tree.leaves(outs)], compute)


def _run(traced: Any, params: Any, *xs: Any) -> Any:
    """A traced program (``jaxpr_as_fun``) of params by path and inputs, called as export's."""
    return traced(*jax.tree.leaves((params, xs)))


def _versions() -> dict[str, str]:
    def dist(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    return {"symjax_mlp": dist("symjax_mlp"), "jax": jax.__version__, "jaxlib": dist("jaxlib"),
            "flax": dist("flax"), "numpy": np.__version__,
            "python": _platform.python_version()}  # fmt: skip
