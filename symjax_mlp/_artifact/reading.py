"""Reading an artifact directory back: every listed file checked, then an :class:`Artifact`.

Each file the manifest lists is read in bounded chunks and its sha256 compared before any
parser sees a byte; a read that raced an export (which swaps whole directories) starts over.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jax

from symjax_mlp._artifact import checker, jaxconfig
from symjax_mlp._artifact.format import (
    CORE_FILES,
    JAXEXPORT,
    MAX_HELD_BYTES,
    MLIRBC,
    PARAMS,
    entry_names,
    entry_view,
    printable,
    program_file,
    read_manifest,
)
from symjax_mlp._artifact.module import deserialize
from symjax_mlp._artifact.ops import ModuleReport, show_keys
from symjax_mlp._artifact.signature import Signature
from symjax_mlp._artifact.weights import read_safetensors_file
from symjax_mlp._errors import EXPORT_CHECKPOINT, ArtifactError, artifact_path
from symjax_mlp._files import MANIFEST, SIGNATURE
from symjax_mlp._reader import hash_regular, read_regular
from symjax_mlp._specs import TensorSpec

_CARD, _CARD_KEYS = 300, 50  # the characters of a card's key or value, its keys, __str__ shows

USED = (JAXEXPORT, MLIRBC, PARAMS)  # the files a loader reads into memory; others are hashed
#: The bytes of the listed files but the weights that a load reads or hashes: an export writes
#: modules and self-test vectors of at most MAX_HELD_BYTES each, an entry point's few
MAX_OTHER_BYTES = 4 * MAX_HELD_BYTES


@dataclasses.dataclass(frozen=True, repr=False)
class Artifact:
    """An exported model on disk: its directory and its (checked) manifest.

    ``repr`` is one line (a notebook shows it for ``sm.export(...)`` ending a cell);
    ``str(artifact)`` is the summary ``symjax-mlp inspect`` prints; run it with
    :func:`~symjax_mlp.load`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import symjax_mlp as sm
      >>> net, x = sm.mlp((4, 2)), jnp.ones((1, 3))
      >>> h = sm.hybridize(net, net.init(jax.random.key(0), x))
      >>> art = sm.export(h, getfixture("tmp_path") / "my_mlp", example=x)
      >>> art.signature.inputs[0].shape
      ('b', 3)
    """

    path: Path
    manifest: Mapping[str, Any]

    @property
    def signature(self) -> Signature:
        """The default entry point's :class:`~symjax_mlp.Signature`, symbolic dims by name."""
        return Signature.from_json(self.manifest["signature"])

    @property
    def entries(self) -> dict[str, Signature]:
        """Every entry point's signature, the default first (one entry for a single model)."""
        return {
            name: Signature.from_json(entry_view(self.manifest, name)["signature"])
            for name in entry_names(self.manifest)
        }

    @property
    def metadata(self) -> dict[str, Any]:
        """The model card given to :func:`~symjax_mlp.export` (``metadata=``), as JSON data."""
        return thaw(self.manifest.get("metadata", {}))

    @property
    def platforms(self) -> tuple[str, ...]:
        """The platforms the program was exported for (``export(platforms=)``), e.g.
        ``("cpu", "cuda")``; :func:`~symjax_mlp.load` refuses it on any other."""
        return tuple(self.manifest["platforms"])

    @property
    def jax_config(self) -> dict[str, Any]:
        """The process-wide JAX settings the program was exported under that write another
        program than JAX's defaults, e.g. ``{"jax_default_matmul_precision": "float32"}``
        (``{}``: none). The program holds them: a process that loads it runs it as written."""
        return thaw(self.manifest.get("jax_config", {}))

    @property
    def params(self) -> tuple[TensorSpec, ...]:
        """The param tree, flattened: one :class:`TensorSpec` per param, in call order."""
        return tuple(TensorSpec.from_json(p) for p in self.manifest["params"])

    @property
    def size_bytes(self) -> int:
        """Bytes of the artifact's files, manifest included (caches excluded)."""
        files = self.manifest["files"].values()
        return sum(f["bytes"] for f in files) + (self.path / MANIFEST).stat().st_size

    def to_json(self) -> dict[str, Any]:
        """The manifest as JSON data (dicts and lists), once its programs agree with it."""
        for entry in entry_names(self.manifest):
            self._read(entry)
        return thaw(self.manifest)

    def op_counts(self, entry: str | None = None) -> dict[str, int]:
        """How often each op occurs in the program of ``entry`` (default: the default entry
        point), most frequent first: ``{"stablehlo.dot_general": 2, ...}``."""
        return dict(self.program(entry).counts)

    def program(self, entry: str | None = None) -> ModuleReport:
        """What the program of ``entry`` (default: the default entry point) does: its ops,
        custom calls, work, and what :func:`~symjax_mlp.load` refuses without ``allow=`` or
        ``trust=True``. Raises :class:`ArtifactError` if a file changed since :func:`inspect`."""
        return self._read(entry)[1]

    def mlir_module(self, entry: str | None = None) -> str:
        """The StableHLO text of the program of ``entry`` that runs (``Exported.mlir_module()``
        of its module, read as :func:`~symjax_mlp.load` reads it): what to review. A
        ``model.mlir`` (earlier exports wrote one) is never read. Raises as :meth:`program`."""
        return self._read(entry)[0].mlir_module()

    def _read(self, entry: str | None) -> tuple[Any, ModuleReport]:
        """The program of ``entry`` deserialized and checked as load checks it; its report."""
        path, m = self.path, self.manifest
        try:
            view = entry_view(m, entry)
        except KeyError:
            have = ", ".join(entry_names(m))
            raise ArtifactError(f"{path} has no entry point {entry!r}; it has {have}.") from None
        names = [program_file(view, role) for role in (JAXEXPORT, MLIRBC)]
        blobs = read_files(path, m, keep=(JAXEXPORT, MLIRBC), only=names)
        exported = deserialize(path, view, blobs)  # checked against manifest and mlirbc
        file, digest = path / names[0], m["files"][names[0]]["sha256"]
        return exported, checker.program(file, digest, exported)[0]

    def __repr__(self) -> str:  # one line, as LoadedModel's: not the manifest's 2 kB
        names = entry_names(self.manifest)
        more = f", entries={list(names)}" if len(names) > 1 else ""
        return printable(f"Artifact({str(self.path)!r}, {self.signature}{more})")

    def __str__(self) -> str:
        m = self.manifest
        n_values = sum(math.prod(map(int, p.shape)) for p in self.params)
        kb = f"{size / 1e3:.1f} kB" if (size := self.size_bytes) < 1e6 else f"{size / 1e6:.2f} MB"
        lines = [
            f"artifact   {self.path}  ({len(m['files']) + 1} files, {kb}; "
            f"format {m['format']} v{m['format_version']})",
            f"function   {m['name']}  exported {m['created']}",
            f"signature  {self.signature}",
        ]
        if len(names := entry_names(m)) > 1:
            lines += [f"entries    {names[0]} (default): {self.signature}"]
            lines += [
                f"           {n} ({entry_view(m, n)['name']}): {sig}"
                for n, sig in list(self.entries.items())[1:]
            ]
        lines += [
            f"platforms  {', '.join(self.platforms)}   devices {m['nr_devices']}   "
            f"calling convention {m['calling_convention_version']}",
            "versions   " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
            f"jax config {jaxconfig.shown(self.jax_config)} (the export's; the program holds it)",
            f"params     {len(self.params)} tensors, {n_values:,} values",
        ]
        lines += [f"  {p}" for p in self.params]
        lines.append("mlir args  " + ", ".join(m["mlir_arguments"]))
        if until := m.get("compatible_until"):
            lines.append(f"loads in   JAX releases until {until} (jax.export window)")
        if tol := m.get("self_test_tolerance"):  # (check_schema's: two numbers)
            lines.append(f"self-test  load checks its outputs to rtol {tol['rtol']:g}, atol "
                         f"{tol['atol']:g} (export's self_test_tolerance)")  # fmt: skip
        card = m.get("metadata") or {}
        for key, value in list(card.items())[:_CARD_KEYS]:
            shown = value if isinstance(value, str) else json.dumps(thaw(value))
            cut = len(shown) - _CARD
            more = f"... ({cut:,} more: .metadata holds it whole)" if cut > 0 else ""
            lines.append(f"card       {key[:_CARD]}: {shown[:_CARD]}{more}")  # never megabytes
        if len(card) > _CARD_KEYS:
            lines.append(f"card       and {len(card) - _CARD_KEYS:,} more keys (in .metadata)")
        if (self.path / SIGNATURE).is_file():  # someone's signed artifact: say how to check it
            lines.append(f"signed     {SIGNATURE}, not verified by inspect: load(path, verify_"
                         "signature=PUBLIC_KEY) checks that it signs every file")  # fmt: skip
        lines.append("files      sha256")
        width = max(20, *map(len, m["files"]))
        for k, f in m["files"].items():
            text = "  (text, never read: mlir_module() prints the program)" * k.endswith(".mlir")
            lines.append(f"  {k:<{width}} {f['sha256'][:16]}...  {f['bytes']:>10,} B{text}")
        for entry in entry_names(m):
            program, file = self.program(entry), program_file(entry_view(m, entry), JAXEXPORT)
            lines.append(f"stablehlo  {sum(program.counts.values())} ops ({file}'s module)")
            lines += [f"  {name:<36} {n:>5}" for name, n in program.counts.items()]
            lines += [f"  custom_call @{n:<22} {k:>5}" for n, k in program.custom_calls.items()]
            if program.problems:
                keys = sorted({p.key for p in program.problems})
                lines.append(f"load       refuses it unless allow={show_keys(keys)} or trust=True:")
                lines += [f"  - {p.what}" for p in program.problems]
        # every string above may come from a stranger's manifest: no terminal escapes
        return "\n".join(printable(line) for line in lines)


def inspect(path: str | os.PathLike[str]) -> Artifact:
    """Reads an artifact's manifest and checks every file's sha256; deserializes nothing.

    Args:
      path: an artifact directory written by :func:`~symjax_mlp.export`.

    Returns:
      The :class:`Artifact`; ``print(inspect(path))`` shows its summary.

    Raises:
      ConfigError: ``path`` is no str or ``pathlib.Path`` (``None``, an int).
      ArtifactError: the directory is missing, incomplete or corrupted.
    """
    path = artifact_path("inspect", path)
    return Artifact(path, freeze(read_artifact(path, keep=())[0]))


def freeze(x: Any) -> Any:
    if isinstance(x, dict):
        return MappingProxyType({k: freeze(v) for k, v in x.items()})
    if isinstance(x, list):
        return tuple(freeze(v) for v in x)
    return x


def thaw(x: Any) -> Any:
    """A frozen manifest back to plain JSON data (dicts and lists)."""
    if isinstance(x, Mapping):
        return {k: thaw(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return [thaw(v) for v in x]
    return x


def check_card(path: Path, manifest: Any) -> None:
    """Refuses a model card holding a number JSON has not (``1e400`` reads as inf), as export
    refuses to write one."""
    todo = [(manifest.get("metadata", {}), "metadata")]
    while todo:  # depth first, in the card's order, without recursion
        value, at = todo.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise ArtifactError(
                f'symjax_mlp.load("{printable(str(path))}"): its model card\'s '
                f"{printable(at[:200])} is {value}, a number JSON cannot hold (export refuses "
                "it; the manifest was edited or written by another tool). Export it again, or "
                "load an artifact whose card holds finite numbers."
            )
        if isinstance(value, dict | list):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            todo += reversed([(v, f"{at}[{k!r}]") for k, v in items])


def check_x64(path: Path, manifest: Any, *, loaded: bool = False) -> None:
    """Refuses 64-bit tensors where JAX runs without x64 (it would make them 32-bit);
    ``loaded``: at a call of the model, which was loaded where x64 was on."""
    if jax.config.jax_enable_x64:
        return
    specs = [*manifest["params"]]
    for view in (manifest, *manifest.get("entries", {}).values()):
        specs += [*view["signature"]["inputs"], *view["signature"]["outputs"]]
    if wide := sorted({s["dtype"] for s in specs} & {"float64", "int64", "uint64", "complex128"}):
        raise ArtifactError(
            f'symjax_mlp.load("{path}"): the artifact holds {", ".join(wide)} tensors, and JAX '
            f"here runs without 64-bit types (it would make them 32-bit). {_X64[loaded]} before "
            "JAX starts (JAX_ENABLE_X64=1, or jax.config.update('jax_enable_x64', True)), or "
            "export the model in 32-bit types."
        )


_X64 = {
    False: "Enable them",
    True: "It was loaded with them on: a `with jax.enable_x64(True)` block holds only in the "
    "thread that entered it, so call the model inside one in this thread too, or enable them "
    "for every thread",
}


def read_files(
    path: Path, manifest: Mapping[str, Any], *, keep: tuple[str, ...] = USED,
    only: Sequence[str] | None = None, skip: tuple[str, ...] = (),
    confirm: Callable[..., None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Checks the size and sha256 of each listed file (or ``only``) but ``skip`` before a parser
    sees it; the bytes of those in ``keep``; then ``confirm``, then params' tensors, if kept."""
    listed = manifest["files"]  # plain file names: check_schema
    views = [entry_view(manifest, e) for e in entry_names(manifest)]
    keep = tuple({program_file(v, role) for v in views for role in keep} - {None})
    if lacking := sorted(set(CORE_FILES) - set(listed)):
        raise ArtifactError(f"{path / MANIFEST} does not list {', '.join(lacking)}; corrupted.")
    blobs, names = {}, set(listed if only is None else only) - set(skip)
    others = {name: listed[name]["bytes"] for name in names - {PARAMS}}
    if (total := sum(others.values())) > MAX_OTHER_BYTES:  # sparse files, or one under many names
        most = ", ".join(
            f"{n} {others[n]:,}" for n in sorted(others, key=lambda n: (-others[n], n))[:3]
        )
        raise ArtifactError(
            f"{path / MANIFEST} lists {len(others)} files besides {PARAMS} of {total:,} bytes in "
            f"all (the largest: {most}), more than the {MAX_OTHER_BYTES:,} a load reads, "
            "where an export writes each entry point's module and self-test vectors, each under "
            f"{MAX_HELD_BYTES + 1:,} bytes: such files (sparse, or linked under many names) "
            "would keep every load hashing for hours. Nothing was read; export the model again."
        )
    for name in [*sorted(names - {PARAMS}), None, *(names & {PARAMS})]:
        if name is None:  # every other file checked, no weight read yet
            confirm and confirm(manifest, blobs)
            continue
        file, size, digest = path / name, listed[name]["bytes"], listed[name]["sha256"]
        try:
            if name == PARAMS and name in keep:  # tensors straight from the file, as declared
                want = [TensorSpec.from_json(p) for p in manifest["params"]]
                blobs[name], _ = read_safetensors_file(
                    file, size=size, sha256=digest, expected=want
                )
            elif name in keep:  # bounded before a byte is held
                blobs[name] = read_regular(file, size=size, limit=MAX_HELD_BYTES, sha256=digest,
                                           error=ArtifactError)  # fmt: skip
            else:
                hash_regular(file, size=size, sha256=digest, error=ArtifactError)
        except FileNotFoundError:
            raise ArtifactError(
                f"{file} is missing (the manifest lists it). The artifact is incomplete: "
                "restore the file or export again."
            ) from None
    return blobs


def read_artifact(path: Path, **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Reads the manifest, then every file, checked (``options``: :func:`read_files`'); retried
    if ``path`` was replaced meanwhile (the directory's inode tells that from a corruption)."""
    for attempt in range(3):
        before = _identity(path)
        try:
            manifest = read_manifest(path)
            return manifest, read_files(path, manifest, **options)
        except ArtifactError:
            if (message := _checkpoint(path)) is not None:
                raise ArtifactError(message) from None
            if attempt == 2 or _identity(path) == before:
                raise


_CHECKPOINT = (
    "{path} is {what}, not an artifact (what symjax_mlp.export writes). To get one, "
    + EXPORT_CHECKPOINT
    + "."
)


def _checkpoint(path: Path) -> str | None:
    """Why ``path`` is no artifact, if it is or holds training checkpoints (ours: step_*;
    Orbax's: <n>/ with its marker)."""
    try:
        names = os.listdir(path)
    except OSError:
        return None
    if "_CHECKPOINT_METADATA" in names or {MANIFEST, "state.safetensors"} <= set(names):
        what = "a training checkpoint (one step of a run, as train(checkpoint=DIR) writes)"
        return _CHECKPOINT.format(path=printable(str(path)), what=what)
    for n in names:
        step = n.startswith("step_") and n[5:].isdecimal() and len(n) >= 13
        if step or (n.isdecimal() and os.path.exists(path / n / "_CHECKPOINT_METADATA")):
            what = "a directory of training checkpoints, as train(checkpoint=DIR) writes"
            return _CHECKPOINT.format(path=printable(str(path)), what=what)
    return None


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino
