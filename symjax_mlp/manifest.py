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
import re
import stat
from collections.abc import Callable, Mapping, Sequence
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
MAX_MANIFEST_BYTES = 64 << 20  # a manifest is a few kB; refuse to read gigabytes of one
_SHA256 = re.compile(r"[0-9a-f]{64}")
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
        manifest = json.loads(read_regular(file, limit=MAX_MANIFEST_BYTES))
    except FileNotFoundError:
        raise ArtifactError(
            f"{file} is missing: {path} is not a complete symjax_mlp artifact (the manifest is "
            "written last, so an export that did not finish has none). Export it again."
        ) from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ArtifactError(f"{file} is not valid JSON ({e}); the artifact is corrupted.") from e
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{file} holds a JSON {type(manifest).__name__}, not an object.")
    if manifest.get("format") != FORMAT:
        raise ArtifactError(
            f"{file}: format is {_show(manifest.get('format'))}, not {FORMAT!r}: this directory "
            "was not written by symjax_mlp.export."
        )
    version = manifest.get("format_version")
    if not _is_int(version) or version > FORMAT_VERSION or version < 1:
        raise ArtifactError(
            f"{file}: format version {_show(version)}; this symjax_mlp reads format version "
            f"{FORMAT_VERSION}. An artifact from a newer symjax_mlp needs that version: "
            "pip install -U symjax_mlp."
        )
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise ArtifactError(f"{file} lacks the field(s) {', '.join(missing)}; it is corrupted.")
    check_schema(manifest, file=file)
    return manifest


def read_regular(file: Path, *, size: int | None = None, limit: int | None = None) -> bytes:
    """Reads one file of an artifact: a regular file, never a link, FIFO or device.

    It is opened without following a symbolic link (an artifact never holds one: a link could
    point out of the directory, or at ``/dev/zero``) and without blocking, and its size is
    checked against ``size`` (the manifest's record) or ``limit`` before a byte is read.

    Raises:
      FileNotFoundError: ``file`` does not exist (callers say what that means).
      ArtifactError: anything else that makes it unreadable or not what was recorded.
    """
    flags = os.O_RDONLY
    for name in ("O_NOFOLLOW", "O_NONBLOCK", "O_CLOEXEC", "O_BINARY"):
        flags |= getattr(os, name, 0)
    try:
        fd = os.open(file, flags)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:  # ELOOP: a symlink; ValueError: a NUL in the name
        if os.path.islink(file):
            raise ArtifactError(
                f"{file} is a symbolic link; an artifact's files are regular files inside its "
                "directory and loading never follows a link. Replace it by the file it points "
                "to, or export again."
            ) from None
        raise ArtifactError(f"{file} cannot be read: {e}") from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ArtifactError(
                f"{file} is not a regular file (a directory, FIFO or device); the artifact is "
                "corrupted. Restore the file or export again."
            )
        if size is not None and info.st_size != size:
            raise ArtifactError(
                f"{file} is corrupted: it has {info.st_size} bytes but the manifest records "
                f"{size}. Nothing was deserialized. Restore the file or export again."
            )
        if limit is not None and info.st_size > limit:
            raise ArtifactError(
                f"{file} has {info.st_size} bytes, more than the {limit} a symjax_mlp artifact's "
                "manifest can have; it is not one. Export it again."
            )
        data = bytearray()
        while len(data) <= info.st_size:  # one read more than the size, to see it ends there
            chunk = os.read(fd, info.st_size + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as e:
        raise ArtifactError(f"{file} cannot be read: {e}") from e
    finally:
        os.close(fd)
    if len(data) != info.st_size:
        raise ArtifactError(f"{file} changed while it was read; load it again.")
    return bytes(data)


# -- the manifest's schema: checked before any field is used -----------------------------------
def check_schema(manifest: Mapping[str, Any], *, file: Path) -> None:
    """Checks the type (and range, where one matters) of every field a loader reads.

    Raises:
      ArtifactError: naming the field, what it holds and what a manifest has there.
    """
    m, sig = manifest, manifest["signature"]
    rules: list[tuple[str, Callable[[], Any], Callable[[Any], bool], str]] = [
        ("name", lambda: m["name"], _is_str, "a string"),
        ("created", lambda: m["created"], _is_str, "a string"),
        ("versions", lambda: m["versions"], _str_dict, "an object of version strings"),
        ("platforms", lambda: m["platforms"], _platforms, "a list of distinct platform names"),
        ("nr_devices", lambda: m["nr_devices"], _count, "an int >= 1"),
        ("calling_convention_version", lambda: m["calling_convention_version"], _is_int, "an int"),
        ("ordered_effects", lambda: m.get("ordered_effects", 0), _size, "an int >= 0"),
        ("signature", lambda: sig, lambda v: isinstance(v, dict), "an object"),
        ("signature.inputs", lambda: sig.get("inputs"), _tensors(True), _TENSORS),
        ("signature.outputs", lambda: sig.get("outputs"), _tensors(True), _TENSORS),
        ("signature.output_kind", lambda: sig.get("output_kind"),
         lambda v: v == "tuple" or (v == "array" and len(sig["outputs"]) == 1),
         '"tuple", or "array" with one output'),
        ("signature.batch", lambda: sig.get("batch"), lambda v: v is None or _is_str(v),
         "a name or null"),
        ("params", lambda: m["params"], _tensors(False), _TENSORS + " with distinct paths"),
        ("mlir_arguments", lambda: m["mlir_arguments"], _str_list, "a list of names"),
        ("files", lambda: m["files"], _files, "an object {file name: {sha256, bytes}} naming "
         "plain files inside the artifact, each with 64 lowercase hex digits and a size"),
    ]  # fmt: skip
    for field, get, ok, want in rules:
        value = get()
        if not ok(value):
            raise ArtifactError(
                f"{file}: {field} is {_show(value)}, but a symjax_mlp manifest has {want} "
                "there; the artifact is corrupted or was edited. Export it again."
            )


_TENSORS = "a list of {path, shape, dtype} (each dimension a size >= 0 or a name)"


def _is_str(x: Any) -> bool:
    return isinstance(x, str)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _size(x: Any) -> bool:
    return _is_int(x) and x >= 0


def _count(x: Any) -> bool:
    return _is_int(x) and x >= 1


def _str_list(x: Any) -> bool:
    return isinstance(x, list) and all(map(_is_str, x))


def _str_dict(x: Any) -> bool:
    return isinstance(x, dict) and all(map(_is_str, x.values()))


def _platforms(x: Any) -> bool:
    return _str_list(x) and len(x) > 0 and len(set(x)) == len(x)


def _tensors(symbolic: bool) -> Callable[[Any], bool]:
    def dim_ok(d: Any) -> bool:
        return _size(d) or (symbolic and _is_str(d) and d != "")

    def ok(x: Any) -> bool:
        return (
            isinstance(x, list)
            and all(
                isinstance(d, dict)
                and all(_is_str(d.get(k)) and d[k] != "" for k in ("path", "dtype"))
                and isinstance(d.get("shape"), list)
                and all(map(dim_ok, d["shape"]))
                for d in x
            )
            and len({d["path"] for d in x}) == len(x)
        )

    return ok


def _files(x: Any) -> bool:
    return isinstance(x, dict) and all(
        _is_file_name(name)
        and isinstance(e, dict)
        and _is_str(e.get("sha256"))
        and _SHA256.fullmatch(e["sha256"]) is not None
        and _size(e.get("bytes"))
        for name, e in x.items()
    )


def _is_file_name(name: str) -> bool:
    """A plain name of a file directly inside the artifact directory: no path, no escape."""
    return (
        name not in ("", ".", "..", MANIFEST)
        and not any(c in name for c in ("/", "\\", "\x00"))
        and os.path.basename(name) == name
        and len(name.encode("utf-8", "surrogatepass")) <= 255
    )


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def read_files(path: Path, manifest: Mapping[str, Any]) -> dict[str, bytes]:
    """Reads every file the manifest lists and checks its sha256 before anyone parses it."""
    listed = manifest["files"]
    if set(CORE_FILES) - set(listed):
        lacking = ", ".join(sorted(set(CORE_FILES) - set(listed)))
        raise ArtifactError(f"{path / MANIFEST} does not list {lacking}; it is corrupted.")
    blobs = {}
    for name, entry in listed.items():
        if not _is_file_name(name):
            raise ArtifactError(f"{path / MANIFEST} lists {name!r}, which is not a file name.")
        try:
            data = read_regular(path / name, size=entry["bytes"])
        except FileNotFoundError:
            raise ArtifactError(
                f"{path / name} is missing (the manifest lists it). The artifact is incomplete: "
                "restore the file or export again."
            ) from None
        digest = sha256(data)
        if digest != entry["sha256"]:
            raise ArtifactError(
                f"{path / name} is corrupted: its sha256 is {digest[:16]}... but the manifest "
                f"records {entry['sha256'][:16]}... ({len(data)} bytes). Nothing was "
                "deserialized. Restore the file or export again."
            )
        blobs[name] = data
    return blobs


def read_artifact(path: Path, *, attempts: int = 3) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Reads the manifest, then every file, checked; retried if ``path`` was replaced meanwhile.

    An export swaps a whole new directory into ``path``. A reader that read the old manifest
    and then a new file would see a checksum mismatch that is no corruption; the directory's
    identity (its inode) tells the two apart, and the read starts over on the new artifact.
    """
    for attempt in range(attempts):
        before = _identity(path)
        try:
            manifest = read_manifest(path)
            return manifest, read_files(path, manifest)
        except ArtifactError:
            if attempt + 1 == attempts or _identity(path) == before:
                raise


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


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
