"""Reading an artifact directory back: every listed file checked, then an :class:`Artifact`.

Each file the manifest lists is read in bounded chunks and its sha256 compared before any
parser sees a byte; a read that raced an export (which swaps whole directories) starts over.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from symjax_mlp._artifact.checker import analyze
from symjax_mlp._artifact.format import (
    CORE_FILES,
    JAXEXPORT,
    MLIRBC,
    PARAMS,
    entry_names,
    entry_view,
    printable,
    program_file,
    read_manifest,
)
from symjax_mlp._artifact.ops import ModuleReport, show_keys
from symjax_mlp._artifact.signature import Signature
from symjax_mlp._artifact.weights import read_safetensors_file
from symjax_mlp._errors import ArtifactError
from symjax_mlp._files import MANIFEST, hash_regular, read_regular
from symjax_mlp._specs import TensorSpec

USED = (JAXEXPORT, MLIRBC, PARAMS)  # the files a loader reads into memory; others are hashed


@dataclasses.dataclass(frozen=True)
class Artifact:
    """An exported model on disk: its directory and its (checked) manifest.

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
        return tuple(self.manifest["platforms"])

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
        """The manifest as plain JSON data (dicts and lists)."""
        return thaw(self.manifest)

    def op_counts(self, entry: str | None = None) -> dict[str, int]:
        """How often each op occurs in the program that runs (``model.jaxexport``'s StableHLO
        module, every region; not ``model.mlir``, the text for people), most frequent first.

        Raises:
          ArtifactError: a file changed since :func:`inspect`, or the two modules differ.
        """
        return dict(self.program(entry).counts)

    def program(self, entry: str | None = None) -> ModuleReport:
        """What the program of ``entry`` (default: the default entry point) does: its ops,
        custom calls, work, and what :func:`~symjax_mlp.load` refuses without ``allow=`` or
        ``trust=True``."""
        import jax

        files = self.manifest["files"]
        try:
            view = entry_view(self.manifest, entry)
        except KeyError:
            raise ArtifactError(
                f"{self.path} has no entry point {entry!r}; it has "
                f"{', '.join(entry_names(self.manifest))}."
            ) from None
        jaxexport, mlirbc = program_file(view, JAXEXPORT), program_file(view, MLIRBC)

        def read(name: str) -> bytearray:
            try:
                size, digest = files[name]["bytes"], files[name]["sha256"]
                return read_regular(self.path / name, size=size, sha256=digest, error=ArtifactError)
            except (FileNotFoundError, KeyError):
                raise ArtifactError(f"{self.path / name} is missing; inspect it again.") from None

        module, data = read(mlirbc), read(jaxexport)
        try:
            exported = jax.export.deserialize(data)
        except Exception as e:  # flatbuffers and JAX raise what they raise
            raise ArtifactError(
                f"{self.path / jaxexport}: jax.export could not deserialize it ({e})."
            ) from e
        if bytes(exported.mlir_module_serialized) != module:
            raise ArtifactError(
                f"{self.path / jaxexport} holds a StableHLO module other than {mlirbc}'s: the "
                "files come from different exports, or one was edited. Export it again."
            )
        return analyze(module, file=self.path / mlirbc)

    def __str__(self) -> str:
        m = self.manifest
        n_values = sum(math.prod(map(int, p.shape)) for p in self.params)
        size = self.size_bytes
        kb = f"{size / 1e3:.1f} kB" if size < 1e6 else f"{size / 1e6:.2f} MB"
        lines = [
            f"artifact   {self.path}  ({len(m['files']) + 1} files, {kb}; "
            f"format {m['format']} v{m['format_version']})",
            f"function   {m['name']}  exported {m['created']}",
            f"signature  {self.signature}",
        ]
        names = entry_names(m)
        if len(names) > 1:
            lines += [f"entries    {names[0]} (default): {self.signature}"]
            lines += [
                f"           {n} ({entry_view(m, n)['name']}): {sig}"
                for n, sig in list(self.entries.items())[1:]
            ]
        lines += [
            f"platforms  {', '.join(self.platforms)}   devices {m['nr_devices']}   "
            f"calling convention {m['calling_convention_version']}",
            "versions   " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
            f"params     {len(self.params)} tensors, {n_values:,} values",
        ]
        lines += [f"  {p}" for p in self.params]
        lines.append("mlir args  " + ", ".join(m["mlir_arguments"]))
        if m.get("compatible_until"):
            lines.append(
                f"loads in   JAX releases until {m['compatible_until']} (jax.export window)"
            )
        for key, value in (m.get("metadata") or {}).items():
            shown = value if isinstance(value, str) else json.dumps(thaw(value))
            lines.append(f"card       {key}: {shown}")
        lines.append("files      sha256")
        width = max(20, *map(len, m["files"]))
        for k, f in m["files"].items():
            lines.append(f"  {k:<{width}} {f['sha256'][:16]}...  {f['bytes']:>10,} B")
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
      ArtifactError: the directory is missing, incomplete or corrupted.
    """
    path = Path(path)
    manifest, _ = read_artifact(path, keep=())
    return Artifact(path, freeze(manifest))


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


def read_files(
    path: Path, manifest: Mapping[str, Any], *, keep: tuple[str, ...] = USED
) -> dict[str, Any]:
    """Checks the size and sha256 of every file the manifest lists before anyone parses it;
    returns the bytes of the files in ``keep`` (``params.safetensors``: its tensors)."""
    listed = manifest["files"]  # plain file names: check_schema
    views = [entry_view(manifest, e) for e in entry_names(manifest)]
    keep = tuple({program_file(v, role) for v in views for role in keep} - {None})
    if lacking := sorted(set(CORE_FILES) - set(listed)):
        raise ArtifactError(
            f"{path / MANIFEST} does not list {', '.join(lacking)}; it is corrupted."
        )
    blobs = {}
    for name, entry in listed.items():
        file, size, digest = path / name, entry["bytes"], entry["sha256"]
        try:
            if name == PARAMS and name in keep:  # tensors straight from the file, hashed
                blobs[name] = read_safetensors_file(file, size=size, sha256=digest)[0]
            elif name in keep:
                blobs[name] = read_regular(file, size=size, sha256=digest, error=ArtifactError)
            else:
                hash_regular(file, size=size, sha256=digest, error=ArtifactError)
        except FileNotFoundError:
            raise ArtifactError(
                f"{file} is missing (the manifest lists it). The artifact is incomplete: "
                "restore the file or export again."
            ) from None
    return blobs


def read_artifact(
    path: Path, *, keep: tuple[str, ...] = USED
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Reads the manifest, then every file, checked; retried if ``path`` was replaced meanwhile
    (the directory's inode tells that from a corruption)."""
    for attempt in range(3):
        before = _identity(path)
        try:
            manifest = read_manifest(path)
            return manifest, read_files(path, manifest, keep=keep)
        except ArtifactError:
            if attempt == 2 or _identity(path) == before:
                raise


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino
