"""Stage 5 of the flow: an artifact directory to a callable model, no model source needed.

Every check runs before the bytes it guards reach a parser or a compiler; :class:`Guard`
bounds the module refined for each new input signature before it compiles. No pickle, no eval.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import importlib
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from symjax_mlp import _selftest as selftest
from symjax_mlp._artifact import checker, ops
from symjax_mlp._artifact.format import (
    JAXEXPORT,
    MLIRBC,
    PARAMS,
    entry_point,
    entry_view,
    printable,
    program_file,
)
from symjax_mlp._artifact.reading import USED, check_card, check_x64, freeze, read_artifact
from symjax_mlp._artifact.signature import Signature, admits_any, an
from symjax_mlp._artifact.weights import check_params, param_specs, read_safetensors_file
from symjax_mlp._compat import transformed
from symjax_mlp._errors import (
    ArtifactError,
    ConfigError,
    artifact_path,
    as_bool,
    user_stacklevel,
)
from symjax_mlp._hybrid.mesh import auto_mesh
from symjax_mlp._loaded import LoadedModel
from symjax_mlp._specs import TensorSpec

RUNTIMES = ("jax", "iree")


def load(
    path: str | os.PathLike[str],
    *,
    params: str | os.PathLike[str] | Any | None = None,
    runtime: str = "jax",
    mesh: Mesh | None = None,
    self_test: bool = True,
    trust: bool = False,
    allow: Iterable[str] | None = None,
    verify_signature: str | os.PathLike[str] | None = None,
    params_as_constants: bool = False,
) -> LoadedModel:
    """Loads an artifact written by :func:`export`; no model source code is needed.

    Checks, in order: the signature (``verify_signature``); the manifest, every sha256, the
    format, platform, device count and params; the program's ops against an allow-list. Only
    then does a runtime compile it. A stranger's artifact is a program: see RELIABILITY.md.
    The program holds the JAX settings it was exported under (the manifest's ``jax_config``, a
    matmul precision): this process's never change it, so where they differ load says nothing.

    Args:
      path: the artifact directory.
      params: other weights for the same param tree: a ``.safetensors`` file (such as
        another export's ``params.safetensors``) or a params pytree, used instead of the
        artifact's own, which is then never read; default: the artifact's.
      runtime: ``"jax"`` (XLA via ``jax.export``) or ``"iree"`` (IREE's llvm-cpu, needs the
        ``symjax_mlp[iree]`` extra).
      self_test: refuse a model that no longer reproduces its self-test vectors.
      mesh: for an artifact of a sharded Hybrid, a mesh of exactly its ``nr_devices``
        (default: the caller's mesh of that size, else the program's own over the first).
      trust: ``True`` skips the checks of the program's ops: for an artifact you trust as
        code you run.
      allow: what the program may do beyond an MLP's ops, by name, e.g.
        ``{"custom_call:lapack_spotrf_ffi"}``, ``{"while"}``, ``{"compute"}``; a refusal
        names what to allow.
      verify_signature: a public key's PEM file: refuse the artifact unless every file is what
        its owner signed with :func:`~symjax_mlp.sign` (needs ``symjax_mlp[sign]``); it then
        loads with the op groups its manifest ``needs``, and only those.
      params_as_constants: compile the weights into each program as constants (JAX runtime,
        one device): for serving latency.

    Returns:
      A callable :class:`LoadedModel` with ``.signature`` and ``.manifest``.

    Raises:
      ArtifactError: anything wrong with the artifact, naming the file and what to do (also
        at a call, if its program fails there).
      ConfigError: an unknown ``runtime`` or ``allow`` name, or ``trust``, ``self_test`` or
        ``params_as_constants`` not True or False.

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
    path = artifact_path("load", path)  # else pathlib's TypeError, os.stat's ValueError
    call = f'symjax_mlp.load("{path}"'  # each refusal below: the call, then the option given
    if runtime not in RUNTIMES:
        raise ConfigError(f"{call}, runtime={runtime!r}): expected 'jax' or 'iree'; pass one.")
    params_as_constants, trust, self_test = map(as_bool, (params_as_constants, trust, self_test))
    for option, value in (("params_as_constants", params_as_constants), ("trust", trust),
                          ("self_test", self_test)):  # fmt: skip
        if not isinstance(value, bool):  # trust="no" would skip every check; 1 == True too
            raise ConfigError(f"{call}, {option}={value!r}): expected True or False; pass one.")
    if params_as_constants and runtime != "jax":
        raise ConfigError(
            f"{call}, runtime={runtime!r}, params_as_constants=True): only the JAX runtime "
            "compiles the weights into its programs. Drop params_as_constants, or runtime='jax'."
        )
    allowed = ops.normalize_allow(allow, f"{call}, ")
    tree = isinstance(params, Mapping | list | tuple) or hasattr(params, "shape")
    tree = tree or jax.tree.structure(params).num_nodes > 1  # a pytree node: an equinox module
    if not (params is None or tree or isinstance(params, str | os.PathLike)):
        kind = type(params).__name__  # else a mismatch: "extra: params: int32[]"
        raise ConfigError(
            f"{call}, params={params!r}): got {an(kind)}; params= takes a .safetensors file "
            "(a str or pathlib.Path, e.g. another export's params.safetensors) or a params tree "
            "of arrays (as h.params or m.params give it). Pass one, or leave params out for the "
            "artifact's own weights."
        )
    if tree and (traced := _traced(params)):
        raise ConfigError(_TRACED.format(call=call, traced=traced))
    if not os.path.exists(path) and (file := next((p for p in path.parents if p.is_file()), None)):
        raise ArtifactError(
            f"{call}): {file} is a file, not a directory, so there is no "
            "artifact below it. Pass the directory written by symjax_mlp.export."
        )
    unchanged = None
    if verify_signature is not None:  # before any parser sees a byte
        from symjax_mlp._signing import check

        unchanged = check(path, verify_signature)
    modules = {}

    def confirm(manifest: Any, blobs: dict[str, Any]) -> None:  # before the weights are read
        if unchanged is not None:
            unchanged(manifest)  # what a parser reads is what was verified
        check_card(path, manifest)
        check_x64(path, manifest)
        importlib.import_module(f"symjax_mlp._runtimes.{runtime}").check_supported(path, manifest)
        from symjax_mlp._runtimes.jax import deserialize  # both runtimes: the module that runs

        view = entry_view(manifest, None)  # its params: all the manifest's, none it does not take
        modules.clear()  # a retry's manifest may name its entry points otherwise
        modules[entry_point(view)] = deserialize(path, view, blobs)

    keep, skip = (*USED, selftest.SELFTEST), () if params is None else (PARAMS,)  # not used
    manifest, blobs = read_artifact(path, keep=keep, skip=skip, confirm=confirm)
    if unchanged is not None:
        unchanged()  # what was read is what was verified
    _warn_if_expiring(path, manifest)
    mesh = _check_mesh(path, manifest, mesh)
    if params is None:
        found, source = blobs[PARAMS], path / PARAMS
    elif isinstance(params, (str, os.PathLike)):
        source = Path(os.path.realpath(params))  # the caller's own path: its links followed
        call = f"{call}, params={str(params)!r})"  # heads what is wrong
        try:
            found = read_safetensors_file(source)[0]
        except FileNotFoundError:
            raise ArtifactError(f"{call}: there is no such file.") from None
        except ArtifactError as e:  # the file's own check: not a regular file, not safetensors
            raise ArtifactError(f"{call}: {e}") from None
        source = f"{call}: {source}"
    else:
        source = f"{call}, params=...)"
        specs, arrays = param_specs(_nested(params), caller=source)
        found = {s.path: a for s, a in zip(specs, arrays, strict=True)}
    expected = [TensorSpec.from_json(p) for p in manifest["params"]]
    ordered = check_params(found, expected, file=source, own=params is None)
    self_test = self_test and params is None  # other weights give other outputs
    needs, signed = manifest.get("needs"), unchanged is not None  # the signer's word, if signed
    if signed:
        allowed |= frozenset(needs or ())
    opener = _Opener(path, manifest, runtime, blobs, mesh=mesh, trust=trust, allowed=allowed,
                     self_test=self_test, constants=params_as_constants, needs=needs,
                     signed=signed, modules=modules)  # fmt: skip
    return opener.open(None, ordered)


class _Opener:
    """Opens an artifact's entry points over its weights: the default one at load, each
    other one on first use (``m["embed"]``), checked alike, the weights placed once."""

    def __init__(self, path: Path, manifest: Any, runtime: str, blobs: dict[str, Any],
                 **options: Any) -> None:  # fmt: skip
        self.path, self.manifest, self.runtime, self.blobs = path, manifest, runtime, blobs
        self.options = options
        self.backend = importlib.import_module(f"symjax_mlp._runtimes.{runtime}")
        self.weights: dict[str, Any] = {}
        self.opened: dict[str, LoadedModel] = {}
        self.lock = threading.Lock()

    def open(self, entry: str | None, arrays: list[Any] | None = None) -> LoadedModel:
        # under a trace (sm.load inside jax.jit): weights and self-test concrete, not staged
        concrete = transformed() is not False and jax.ensure_compile_time_eval()
        with self.lock, concrete or contextlib.nullcontext():
            view = entry_view(self.manifest, entry)
            if (name := entry_point(view)) not in self.opened:
                self.opened[name] = self._open(view, arrays)
            return self.opened[name]

    def _open(self, view: dict[str, Any], arrays: list[Any] | None) -> LoadedModel:
        from symjax_mlp._artifact import rows  # MLIR's bindings, once needed
        from symjax_mlp._runtimes.jax import deserialize

        path, blobs, options = self.path, self.blobs, self.options
        if arrays is None:  # another entry point: its params among the placed weights
            arrays = [self.weights[p["path"]] for p in view["params"]]
        exported = options["modules"].pop(entry_point(view), None)  # load's, deserialized
        exported = exported or deserialize(path, view, blobs)  # both runtimes: the one that runs
        if not (options["self_test"] and program_file(view, selftest.SELFTEST) in blobs):
            check_admits(path, Signature.from_json(view["signature"]))  # else its vectors are
        guard = report = None
        if not options["trust"]:
            file = path / program_file(view, JAXEXPORT)
            digest = self.manifest["files"][file.name]["sha256"]
            report, vjp_sizes = checker.program(file, digest, exported)
            ops.check_main(report, exported, file=file)
            ops.check_claims(report, view, len(vjp_sizes), file=file)
            if hasattr(self.backend, "check_program"):
                self.backend.check_program(path / program_file(view, MLIRBC), report)
            ops.check(report, file=file, allow=options["allowed"], caller="load()",
                      needs=options["needs"], signed=options["signed"])  # fmt: skip
            if "compute" not in options["allowed"]:
                guard = Guard(file, digest, ((report.work, report.bytes_made), *vjp_sizes))
        view = rows.checked(view, report, exported)  # the program's word, not the manifest's
        baked = {"constants": True} if options["constants"] else {}  # (the JAX runtime's)
        run, weights = self.backend.runner(
            path, view, blobs, arrays, exported=exported, guard=guard,
            custom_calls=None if report is None else report.custom_calls, **baked,
        )  # fmt: skip
        if not self.weights:
            self.weights = weights  # on device for JAX: every entry point runs on these
            blobs.pop(PARAMS, None)
        if options["mesh"] is not None:
            run = functools.partial(_under, options["mesh"], run)
        model = LoadedModel(path, freeze(view), self.runtime, weights, run, self)
        model.params_as_constants = options["constants"]
        model.allowed = None if options["trust"] else frozenset(options["allowed"])
        if options["self_test"]:
            selftest.run(path, view, blobs, lambda xs: jax.tree.leaves(model(*xs)))
        return model


def check_admits(path: Path, signature: Signature) -> None:
    """Refuses an artifact whose signature's constraints no sizes satisfy: every call would be
    refused, each by one bound, never saying that nothing passes (self-test vectors, which
    must satisfy them, refuse it where they are checked)."""
    if not admits_any(signature):
        raise ArtifactError(
            f"{path / 'manifest.json'}: its signature {signature} admits no input: no sizes "
            f"satisfy {', '.join(signature.constraints)} together (each symbolic dimension "
            ">= 1), so every call would be refused. The artifact is corrupted or was edited; "
            "export it again."
        )


_TOO_MUCH = (
    "{file}: {inputs} {module} asks for about {amount:.3g} {unit}, more than {budget:.3g} (its "
    "own static {unit}, {static:,}, per input element, plus {bound:.3g}): its shapes grow with "
    "no relation to its inputs. Refused before anything compiles or runs it; pass "
    "allow={{'compute'}} (or trust=True) to load() if you trust it."
)


@dataclasses.dataclass(frozen=True)
class Guard:
    """Bounds a call's refined module (the program, or its VJP of ``order``) before it
    compiles: ``MAX_WORK`` element operations and ``MAX_BYTES`` bytes made, plus its static
    ``sizes`` (work, bytes; then each VJP's) per input element. ``refine()`` gives the module
    and its context; a verdict is remembered by sha256 and shapes."""

    file: Path
    digest: str
    sizes: tuple[tuple[int, int], ...]

    def __call__(self, refine: Callable[[], Any], n_inputs: int, shapes: Any, *,
                 order: int = 0, inputs: str | None = None) -> None:  # fmt: skip
        of = f" VJP {order}" if order else ""
        verdict = f"{self.digest}{of} fits {shapes!r} in {ops.MAX_WORK} ops, {ops.MAX_BYTES} B"
        if checker.remembered(verdict):
            return
        from symjax_mlp._artifact.walk import analyze_module  # MLIR's bindings, once needed

        refined, context = refine()
        with context:
            report = analyze_module(refined)
        sizes = self.sizes[min(order, len(self.sizes) - 1)]
        for amount, static, bound, unit in zip(
            (report.work, report.bytes_made), sizes, (ops.MAX_WORK, ops.MAX_BYTES),
            ("element operations", "bytes of tensors made"), strict=True,
        ):  # fmt: skip
            budget = bound + max(static, 1) * max(n_inputs, 1)
            if amount > budget:
                vjp = f"its VJP module of order {order} (what jax.grad of the loaded model runs)"
                raise ArtifactError(_TOO_MUCH.format(
                    file=self.file, inputs=inputs or f"for these inputs ({n_inputs:,} elements)",
                    module=vjp if order else "the program", amount=amount, unit=unit,
                    budget=budget, static=max(static, 1), bound=bound,
                ))  # fmt: skip
        checker.remember(verdict)


_TRACED = (
    "{call}, params=...): param {traced} is traced (load called inside jax.jit, jax.vmap or "
    "jax.grad over the weights): load reads weights once, as arrays. Load once, outside the "
    "transformation, and transform m.apply, the program as a pure function of its weights: "
    "jax.vmap(m.apply, in_axes=(0, None))(stacked, x) for an ensemble, "
    "jax.grad(lambda p: m.apply(p, x).sum())(m.params) to fine-tune (exported with "
    "vjp_order=1)."
)


def _traced(params: Any) -> str | None:
    """The path and type of the first traced leaf of ``params``, if one is."""
    for keys, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if isinstance(leaf, jax.core.Tracer):
            name = jax.tree_util.keystr(keys, simple=True, separator="/")
            return f"{printable(name)[:200]} ({leaf.aval.str_short()})"
    return None


def _nested(params: Any) -> Any:
    """A flat ``{"params/layers_0/kernel": array}`` (what ``m.params`` gives) as the tree whose
    paths those are; any other params as they are (``param_specs`` names what is wrong)."""
    keys = list(params) if isinstance(params, Mapping) else []
    if not all(isinstance(k, str) for k in keys) or not any("/" in k for k in keys):
        return params
    tree: dict[str, Any] = {}
    for key, value in params.items():
        *heads, last = key.split("/")
        node = tree
        for head in heads:
            node = node.setdefault(head, {})
            if not isinstance(node, dict):
                return params  # "a" and "a/b": no tree
        if last in node:
            return params
        node[last] = value
    return tree


def _check_mesh(path: Path, manifest: Any, mesh: Mesh | None) -> Mesh | None:
    if mesh is None:
        return None
    need = int(manifest["nr_devices"])
    if not isinstance(mesh, Mesh):
        raise ConfigError(f'symjax_mlp.load("{path}", mesh=...): got {mesh!r:.80}; '
                          f"pass a jax.sharding.Mesh of {need} device(s).")  # fmt: skip
    if mesh.size != need:
        raise ArtifactError(
            f'symjax_mlp.load("{path}"): the artifact was exported for {need} device(s), but '
            f"the mesh {dict(mesh.shape)} has {mesh.size}. jax.export programs run on the "
            f"device count they were exported for: pass a mesh of {need} devices, e.g. "
            f"sm.data_mesh({need}), or export again on a mesh of {mesh.size}."
        )
    return auto_mesh(mesh)


def _under(mesh: Mesh, run: Callable[[list[Any]], list[Any]], inputs: list[Any]) -> list[Any]:
    with jax.set_mesh(mesh):
        return run(inputs)


def _warn_if_expiring(path: Path, manifest: Any) -> None:
    """Warns when the artifact leaves ``jax.export``'s compatibility window within 30 days."""
    try:
        end = datetime.date.fromisoformat(str(manifest.get("compatible_until")))
    except ValueError:
        return
    if (left := (end - datetime.date.today()).days) <= 30:
        warnings.warn(
            f'symjax_mlp.load("{path}"): the artifact leaves jax.export\'s compatibility window '
            f"on {end} ({'in ' + str(left) + ' days' if left >= 0 else 'already'}): newer JAX "
            "releases may refuse it. Export it again from its source with this JAX.",
            FutureWarning,
            stacklevel=user_stacklevel(),  # the caller's line, through serve() or the CLI too
        )
