"""The artifact's contract: ``manifest.json``, checksums and the call signature.

Everything here is plain data (JSON, bytes) and runs before any bytes reach a deserializer:
reading and checking the manifest, sha256 of every file, the format version and JAX's
compatibility window, and the shapes and dtypes of each call. Both runtimes (JAX and IREE)
share these checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from symjax_mlp.errors import ArtifactError, SignatureError

__all__ = ["Signature", "TensorSpec"]

FORMAT = "symjax_mlp.artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
JAXEXPORT, MLIRBC, MLIR, PARAMS = (
    "model.jaxexport",
    "model.mlirbc",
    "model.mlir",
    "params.safetensors",
)
CORE_FILES = (JAXEXPORT, MLIRBC, MLIR, PARAMS)
_REQUIRED = (
    "format",
    "format_version",
    "name",
    "created",
    "versions",
    "platforms",
    "nr_devices",
    "calling_convention_version",
    "signature",
    "params",
    "mlir_arguments",
    "files",
)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One array in the artifact's contract: a path, a shape (ints and symbolic names), a dtype.

    Example:
      >>> str(TensorSpec("args[0]", ("b", 512), "float32"))
      'args[0]: float32[b, 512]'
    """

    path: str
    shape: tuple[int | str, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.path}: {self.type}"

    @property
    def type(self) -> str:
        """``float32[b, 512]``: the dtype and the shape, symbolic dimensions by name."""
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TensorSpec:
        return cls(str(d["path"]), tuple(d["shape"]), str(d["dtype"]))


@dataclasses.dataclass(frozen=True)
class Signature:
    """What an artifact's function takes and returns (params excluded).

    Attributes:
      inputs: one :class:`TensorSpec` per positional input, ``args[0]``, ``args[1]``, ...
      outputs: one :class:`TensorSpec` per output array.
      output_kind: ``"array"`` (the function returns one array) or ``"tuple"``.
      batch: the name of the symbolic leading dimension (``"b"``), or ``None`` if every
        shape is static. A symbolic dimension is always ``>= 1``.
    """

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    output_kind: str
    batch: str | None

    def __str__(self) -> str:
        ins = ", ".join(map(str, self.inputs))
        outs = ", ".join(o.type for o in self.outputs)
        if self.output_kind == "tuple":
            outs = f"({outs})"
        where = f"  with {self.batch} >= 1" if self.batch else ""
        return f"({ins}) -> {outs}{where}"

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [s.to_json() for s in self.outputs],
            "output_kind": self.output_kind,
            "batch": self.batch,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Signature:
        return cls(
            tuple(TensorSpec.from_json(s) for s in d["inputs"]),
            tuple(TensorSpec.from_json(s) for s in d["outputs"]),
            str(d["output_kind"]),
            d.get("batch"),
        )

    def check(self, inputs: Sequence[Any], *, caller: str) -> list[Any]:
        """Checks a call's inputs; returns them as arrays (JAX arrays are passed through).

        Raises:
          SignatureError: wrong number of inputs, rank, shape, dtype, or a batch of 0.
        """
        if len(inputs) != len(self.inputs):
            want = ", ".join(map(str, self.inputs))
            raise SignatureError(
                f"{caller}: the artifact takes {len(self.inputs)} input(s) ({want}); "
                f"got {len(inputs)}. Call it as m({', '.join(s.path for s in self.inputs)})."
            )
        arrays = [
            x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x) for x in inputs
        ]
        sizes: dict[str, tuple[str, int]] = {}
        for spec, x in zip(self.inputs, arrays, strict=True):
            shape = tuple(x.shape)
            if len(shape) != len(spec.shape):
                raise SignatureError(
                    f"{caller}: input {spec.path} has shape {shape}, rank {len(shape)}, but the "
                    f"artifact expects rank {len(spec.shape)}: {self._expects(spec)}. "
                    + _rank_hint(spec.shape, shape)
                )
            for i, (got, dim) in enumerate(zip(shape, spec.shape, strict=True)):
                if got == dim:
                    continue
                if isinstance(dim, int):
                    raise SignatureError(
                        f"{caller}: input {spec.path} has shape {shape} but the artifact expects "
                        f"{self._expects(spec)}: {spec.path}.shape[{i}] is {got}, not {dim}. "
                        f"Pass an array whose dimension {i} is {dim}."
                    )
                if got < 1:
                    raise SignatureError(
                        f"{caller}: input {spec.path} has shape {shape} but the artifact expects "
                        f"{self._expects(spec)}: {spec.path}.shape[{i}] is {got}, and a batch of "
                        f"{got} is rejected. Pass at least one row."
                    )
                seen = sizes.setdefault(dim, (f"{spec.path}.shape[{i}]", got))
                if seen[1] != got:
                    raise SignatureError(
                        f"{caller}: {spec.path}.shape[{i}] is {got} but {seen[0]} is "
                        f"{seen[1]}; both are the symbolic dimension {dim} and must agree."
                    )
            if x.dtype != spec.dtype:
                raise SignatureError(
                    f"{caller}: input {spec.path} has dtype {np.dtype(x.dtype)} but the "
                    f"artifact expects {spec.type}. Cast it: x.astype(np.{spec.dtype})."
                )
        return arrays

    def _expects(self, spec: TensorSpec) -> str:
        names = sorted({d for d in spec.shape if isinstance(d, str)})
        where = f" with {', '.join(names)} >= 1" if names else ""
        return _shape_text(spec.shape) + where


def _shape_text(shape: Sequence[int | str]) -> str:
    inner = ", ".join(map(str, shape))
    return f"({inner},)" if len(shape) == 1 else f"({inner})"


def _rank_hint(want: Sequence[int | str], got: tuple[int, ...]) -> str:
    if len(want) == len(got) + 1 and tuple(want[1:]) == got:
        return "Add the batch dimension: x[None] (one row) or x.reshape(1, -1)."
    return f"Pass an array of rank {len(want)}."


# -- files and checksums ---------------------------------------------------------------------
def shape_dims(shape: Sequence[Any]) -> tuple[int | str, ...]:
    """A JAX shape as manifest dims: ints stay, symbolic dimensions become their names."""
    return tuple(d if isinstance(d, int) else str(d) for d in shape)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_manifest(path: Path) -> dict[str, Any]:
    """Reads and schema-checks ``path/manifest.json``. Raises :class:`ArtifactError`."""
    if not path.is_dir():
        what = "is a file, not an artifact directory" if path.exists() else "does not exist"
        raise ArtifactError(f"{path} {what}. Pass the directory written by symjax_mlp.export.")
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_bytes())
    except FileNotFoundError:
        raise ArtifactError(
            f"{file} is missing: {path} is not a complete symjax_mlp artifact (the manifest is "
            "written last, so an export that did not finish has none). Export it again."
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{file} is not valid JSON ({e}); the artifact is corrupted.") from e
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{file} holds a JSON {type(manifest).__name__}, not an object.")
    if manifest.get("format") != FORMAT:
        raise ArtifactError(
            f"{file}: format is {manifest.get('format')!r}, not {FORMAT!r}: this directory was "
            "not written by symjax_mlp.export."
        )
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise ArtifactError(
            f"{file}: format version {version!r}; this symjax_mlp reads format version "
            f"{FORMAT_VERSION}. An artifact from a newer symjax_mlp needs that version: "
            "pip install -U symjax_mlp."
        )
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise ArtifactError(f"{file} lacks the field(s) {', '.join(missing)}; it is corrupted.")
    return manifest


def read_files(path: Path, manifest: Mapping[str, Any]) -> dict[str, bytes]:
    """Reads every file the manifest lists and checks its sha256 before anyone parses it."""
    listed = manifest["files"]
    if set(CORE_FILES) - set(listed):
        lacking = ", ".join(sorted(set(CORE_FILES) - set(listed)))
        raise ArtifactError(f"{path / MANIFEST} does not list {lacking}; it is corrupted.")
    blobs = {}
    for name, entry in listed.items():
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise ArtifactError(f"{path / MANIFEST} lists {name!r}, which is not a file name.")
        try:
            data = (path / name).read_bytes()
        except FileNotFoundError:
            raise ArtifactError(
                f"{path / name} is missing (the manifest lists it). The artifact is incomplete: "
                "restore the file or export again."
            ) from None
        digest = sha256(data)
        if digest != entry["sha256"]:
            raise ArtifactError(
                f"{path / name} is corrupted: its sha256 is {digest[:16]}... but the manifest "
                f"records {entry['sha256'][:16]}... ({len(data)} bytes; {entry['bytes']} "
                "expected). Nothing was deserialized. Restore the file or export again."
            )
        blobs[name] = data
    return blobs


# -- compatibility ----------------------------------------------------------------------------
def compatibility_note(manifest: Mapping[str, Any]) -> str:
    """The compatibility window, and how to re-export, for error messages."""
    import jax

    made = manifest.get("versions", {}).get("jax", "?")
    return (
        f"The artifact was exported on {manifest.get('created', '?')} with jax {made}; this "
        f"is jax {jax.__version__}. jax.export guarantees that an artifact loads in JAX "
        "releases up to about 6 months newer than the one that exported it, not older ones "
        "and not beyond that window. To fix it, re-export: rebuild the model from its source, "
        "load its weights (params.safetensors is plain safetensors and still readable), and "
        f"call symjax_mlp.export(h, path, example=x, overwrite=True) under jax "
        f"{jax.__version__}; or load it with the exporting version "
        f"(pip install jax=={made} jaxlib=={made})."
    )


def check_calling_convention(manifest: Mapping[str, Any], *, file: Path) -> None:
    """Rejects calling-convention versions this JAX cannot load, before deserializing."""
    import jax

    version = manifest["calling_convention_version"]
    lo = jax.export.minimum_supported_calling_convention_version
    hi = jax.export.maximum_supported_calling_convention_version
    if not isinstance(version, int) or not lo <= version <= hi:
        raise ArtifactError(
            f"{file}: the artifact uses jax.export calling convention version {version}, but "
            f"jax {jax.__version__} loads versions {lo} to {hi} only: it is outside JAX's "
            f"compatibility window. {compatibility_note(manifest)}"
        )
