"""The artifact's on-disk contract: its file names, ``manifest.json`` and its schema.

Everything here is plain data (JSON) and runs before any bytes reach a deserializer: reading
and schema-checking the manifest, the format version, JAX's compatibility window, and what
counts as an artifact directory that an export may replace.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from symjax_mlp._errors import ArtifactError
from symjax_mlp._files import MANIFEST, read_regular

FORMAT = "symjax_mlp.artifact"
FORMAT_VERSION = 1
JAXEXPORT, MLIRBC, MLIR, PARAMS = (
    "model.jaxexport",
    "model.mlirbc",
    "model.mlir",
    "params.safetensors",
)
CORE_FILES = (JAXEXPORT, MLIRBC, MLIR, PARAMS)
MAX_MANIFEST_BYTES = 64 << 20  # a manifest is a few kB; refuse to read gigabytes of one
MAX_PARAMS = 65_536  # param tensors (and inputs, outputs) an artifact may have
MAX_FILES = 1_024  # files a manifest may list
MAX_CONSTRAINT_CHARS = 256
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


def read_manifest(path: Path) -> dict[str, Any]:
    """Reads and schema-checks ``path/manifest.json``. Raises :class:`ArtifactError`."""
    if not path.is_dir():
        what = "is a file, not an artifact directory" if path.exists() else "does not exist"
        raise ArtifactError(f"{path} {what}. Pass the directory written by symjax_mlp.export.")
    file = path / MANIFEST
    try:
        manifest = json.loads(read_regular(file, limit=MAX_MANIFEST_BYTES, error=ArtifactError))
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
        ("signature.constraints", lambda: sig.get("constraints", []), _constraints,
         f"a list of at most 64 constraints such as \"t <= 1024\" ({MAX_CONSTRAINT_CHARS} "
         "characters at most)"),
        ("params", lambda: m["params"], _tensors(False),
         _TENSORS + f" with distinct paths, at most {MAX_PARAMS:,} of them"),
        ("mlir_arguments", lambda: m["mlir_arguments"], _str_list, "a list of names"),
        ("files", lambda: m["files"], _files, "an object {file name: {sha256, bytes}} naming "
         f"at most {MAX_FILES:,} plain files inside the artifact, each with 64 lowercase hex "
         "digits and a size"),
        ("metadata", lambda: m.get("metadata", {}), lambda v: isinstance(v, dict), "an object"),
        ("vjp_order", lambda: m.get("vjp_order", 0), lambda v: _size(v) and v <= 8,
         "an int from 0 to 8"),
        ("compatible_until", lambda: m.get("compatible_until", ""), _is_str, "a date"),
        ("static", lambda: m.get("static", {}), _str_dict, "an object of strings"),
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


def _constraints(x: Any) -> bool:
    return _str_list(x) and len(x) <= 64 and all(0 < len(c) <= MAX_CONSTRAINT_CHARS for c in x)


def _platforms(x: Any) -> bool:
    return _str_list(x) and len(x) > 0 and len(set(x)) == len(x)


def _tensors(symbolic: bool) -> Callable[[Any], bool]:
    def dim_ok(d: Any) -> bool:
        return _size(d) or (symbolic and _is_str(d) and d != "")

    def ok(x: Any) -> bool:
        return (
            isinstance(x, list)
            and len(x) <= MAX_PARAMS
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
    return (
        isinstance(x, dict)
        and len(x) <= MAX_FILES
        and all(
            is_file_name(name)
            and isinstance(e, dict)
            and _is_str(e.get("sha256"))
            and _SHA256.fullmatch(e["sha256"]) is not None
            and _size(e.get("bytes"))
            for name, e in x.items()
        )
    )


def is_file_name(name: str) -> bool:
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


def printable(text: str) -> str:
    """``text`` with every character a terminal could act on escaped (``\\x1b``, ``\\u202e``).

    Control characters (escape sequences, carriage returns, backspaces), and the other
    characters Python's ``repr`` escapes (bidirectional overrides, ...), are shown as their
    escapes: a manifest from a stranger can print nothing but text.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


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


def check_target(path: Path, overwrite: bool) -> None:
    """Raises unless an export may write ``path``: absent, or an artifact and ``overwrite``."""
    if not path.exists() and not path.is_symlink():
        return
    if not overwrite:
        raise ArtifactError(
            f"{path} already exists; export does not replace it silently. Pass "
            "overwrite=True to replace it, or choose another path."
        )
    if path.is_symlink() or not path.is_dir():
        raise ArtifactError(f"{path} exists and is not a directory; refusing to replace it.")
    if any(path.iterdir()) and not (path / MANIFEST).exists():
        raise ArtifactError(
            f"{path} is a non-empty directory without {MANIFEST}, so not an artifact; "
            "refusing to replace it even with overwrite=True. Choose another path."
        )
