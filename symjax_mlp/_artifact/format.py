"""The artifact's on-disk contract: its file names, ``manifest.json`` and its schema, checked
before any bytes reach a deserializer."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from symjax_mlp._artifact import jaxconfig
from symjax_mlp._errors import ArtifactError
from symjax_mlp._files import MANIFEST, looked_up
from symjax_mlp._reader import depth, read_regular, too_many_values

FORMAT = "symjax_mlp.artifact"
FORMAT_VERSION = 3  # 3: Signature.format_version; 1: before 0.5, with model.mlir (read as 2)
JAXEXPORT = "model.jaxexport"
MLIRBC = "model.mlirbc"
MLIR = "model.mlir"  # text that earlier exports wrote beside the module: listed, never read
PARAMS = "params.safetensors"
SELFTEST = "selftest.safetensors"
CORE_FILES = (JAXEXPORT, MLIRBC, PARAMS)
PROGRAM_FILES = (JAXEXPORT, MLIRBC)  # what each entry point has of its own
_ENTRY_ROLES = (*PROGRAM_FILES, SELFTEST, MLIR)  # the same, its self-test, an earlier text
MAX_ENTRIES = 64
RESERVED_ENTRY_NAMES = frozenset({"model", "params", "selftest", "manifest"})
MAX_MANIFEST_BYTES = 64 << 20  # a manifest is a few kB; refuse to read gigabytes of one
MAX_HELD_BYTES = (1 << 31) - 1  # a file load holds whole: a module (a FlatBuffer) or vectors
MAX_PARAMS = 65_536  # param tensors (and inputs, outputs) an artifact may have
MAX_FILES = 1_024  # files a manifest may list
MAX_CONSTRAINT_CHARS = 256
MAX_VJP_ORDER = 8  # orders of gradients an artifact may carry (each doubles its program)
MAX_TOLERANCE = 0.1  # a self-test's rtol and atol: 10% still refuses other weights or programs
MAX_DEPTH = 32  # JSON nesting of a manifest; json.loads reads deeper than Python recursion
VALUES_PER_TENSOR = 64  # JSON values a manifest or safetensors header may have per tensor
_SHA256 = re.compile(r"[0-9a-f]{64}")
_UNDECODED = re.compile("[\udc80-\udcff]+")  # os.fsdecode's stand-ins for bytes not decoded
NEEDS = frozenset({  # what "needs" may name: ops computing tensors from tensors, and loops
    "while", "convolution", "reduce_window", "select_and_scatter", "gather", "scatter", "sort",
    "dynamic_slice", "dynamic_update_slice", "real_dynamic_slice", "dynamic_pad", "map", "fft",
    "dynamic_gather", "dynamic_conv", "triangular_solve", "rng_bit_generator", "cholesky",
    "reduce_precision", "real", "imag", "complex", "popcnt", "count_leading_zeros"})  # fmt: skip


def read_manifest(path: Path) -> dict[str, Any]:
    """Reads and schema-checks ``path/manifest.json``. Raises :class:`ArtifactError`."""
    looked_up(path)
    if not path.is_dir():
        what = "is a file, not an artifact directory" if path.exists() else "does not exist"
        fix = "the directory written by symjax_mlp.export"
        if path.is_symlink() and not path.exists():
            what = "is a symbolic link that leads to no directory (a loop, or a missing target)"
        elif path.exists() and (path.parent / MANIFEST).is_file():  # chapter_mlp/manifest.json
            at = "'.' (the working directory)" if path.parent == Path(".") else str(path.parent)
            fix = f"its directory, {printable(at)}"
        raise ArtifactError(f"{printable(str(path))} {what}. Pass {fix}.")
    file = path / MANIFEST
    try:
        data = read_regular(file, limit=MAX_MANIFEST_BYTES, error=ArtifactError)
        if message := too_many_values(data, VALUES_PER_TENSOR * MAX_PARAMS):
            raise ArtifactError(f"{file} {message}; it is corrupted or crafted.")
        manifest = json.loads(data, object_pairs_hook=unique_pairs)
    except FileNotFoundError:
        inner = next(path.glob(f"*/{MANIFEST}"), None)  # an archive unpacked into path holds it
        fix = f"It holds one: pass {printable(str(inner.parent))}." if inner else "Export it again."
        raise ArtifactError(
            f"{file} is missing: {path} is not a complete symjax_mlp artifact (the manifest is "
            f"written last, so an export that did not finish has none). {fix}"
        ) from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ArtifactError(f"{file} is not valid JSON ({e}); the artifact is corrupted.") from e
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{file} holds a JSON {type(manifest).__name__}, not an object.")
    if depth(manifest, MAX_DEPTH) > MAX_DEPTH:
        raise ArtifactError(
            f"{file} nests its JSON more than {MAX_DEPTH} levels deep (a manifest nests about 5, "
            "a model card a few more); it is corrupted or crafted."
        )
    if manifest.get("format") != FORMAT:
        raise ArtifactError(
            f"{file}: format is {show(manifest.get('format'))}, not {FORMAT!r}: this directory "
            "was not written by symjax_mlp.export."
        )
    version = manifest.get("format_version")
    if not is_int(version) or version > FORMAT_VERSION or version < 1:
        raise ArtifactError(
            f"{file}: format version {show(version)}; this symjax_mlp reads format versions 1 "
            f"to {FORMAT_VERSION}. An artifact from a newer symjax_mlp needs that version: "
            "pip install -U symjax_mlp."
        )
    check_schema(manifest, file=file)
    return manifest


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; ``ValueError`` for a key given twice (which
    parsers read differently: Python keeps the last, others the first)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the key {show(twice)} is given twice")
    return out


# -- the manifest's schema: checked before any field is used -----------------------------------
def check_schema(manifest: Mapping[str, Any], *, file: Path) -> None:
    """Checks the type (and range) of every field a loader reads; an :class:`ArtifactError`
    names the field, what it holds and what a manifest has there."""
    m, M = manifest, _MISSING
    rules: list[tuple[str, Any, Callable[[Any], bool], str]] = [
        ("name", m.get("name", M), _is_str, "a string"),
        ("created", m.get("created", M), _is_str, "a string"),
        ("versions", m.get("versions", M), _str_dict, "an object of version strings"),
        ("platforms", m.get("platforms", M), _platforms, "a list of distinct platform names"),
        ("nr_devices", m.get("nr_devices", M), lambda v: is_int(v) and v >= 1, "an int >= 1"),
        ("calling_convention_version", m.get("calling_convention_version", M), is_int, "an int"),
        ("ordered_effects", m.get("ordered_effects", 0), is_size, "an int >= 0"),
        *_program_rules(m, ""),
        ("params", m.get("params", M), _tensors(False),
         _TENSORS + f" with distinct paths, at most {MAX_PARAMS:,} of them"),
        ("files", m.get("files", M), _files, "an object {file name: {sha256, bytes}} naming "
         f"at most {MAX_FILES:,} plain files inside the artifact, each with 64 lowercase hex "
         "digits and a size"),
        ("needs", m.get("needs", []), lambda v: v == [] or (_platforms(v) and set(v) <= NEEDS),
         'a list of distinct op groups such as "convolution" or "while" (format.NEEDS)'),
        ("metadata", m.get("metadata", {}), lambda v: isinstance(v, dict), "an object"),
        ("vjp_order", m.get("vjp_order", 0), lambda v: is_size(v) and v <= MAX_VJP_ORDER,
         f"an int from 0 to {MAX_VJP_ORDER}"),
        ("compatible_until", m.get("compatible_until", ""), _is_str, "a date"),
        ("self_test_tolerance", m.get("self_test_tolerance", {"rtol": 0, "atol": 0}), tolerance,
         f'{{"rtol": r, "atol": a}}, each a number from 0 to {MAX_TOLERANCE}'),
        ("entry", m.get("entry", "main"), is_entry_name, "an entry point name"),
        ("jax_config", m.get("jax_config", {}), jaxconfig.valid, jaxconfig.SCHEMA),
        ("entries", m.get("entries", {}),
         lambda v: isinstance(v, dict) and len(v) < MAX_ENTRIES
         and all(is_entry_name(k) and isinstance(e, dict) for k, e in v.items())
         and m.get("entry", "main") not in v,
         f"an object of at most {MAX_ENTRIES - 1} named entry points, the default not among them"),
    ]  # fmt: skip
    entries = m.get("entries", {})
    for name, entry in entries.items() if isinstance(entries, dict) else ():
        if not isinstance(entry, dict):
            break  # the rule on "entries" reports it first
        rules += [
            (f"entries.{name}.name", entry.get("name", M), _is_str, "a string"),
            *_program_rules(entry, f"entries.{name}."),
            (f"entries.{name}.params", entry.get("params", M),
             lambda v: _str_list(v) and len(set(v)) == len(v)
             and set(v) <= {p["path"] for p in m["params"]},  # checked above: a list of dicts
             "a list of distinct param paths, each in params"),
            (f"entries.{name}.program_files", entry.get("program_files", M),
             lambda v: isinstance(v, dict) and set(PROGRAM_FILES) <= set(v) <= set(_ENTRY_ROLES)
             and all(_is_str(f) and f in m["files"] and f != PARAMS for f in v.values())
             and len(set(v.values())) == len(v),
             f"an object naming the entry's own {', '.join(PROGRAM_FILES)} (and "
             f"{SELFTEST}), each a distinct file listed in files, not {PARAMS}"),
        ]  # fmt: skip
    for field, value, ok, want in rules:
        if value is _MISSING or not ok(value):
            raise ArtifactError(
                f"{file}: {field} is {show(value)}, but a symjax_mlp manifest has {want} "
                "there; the artifact is corrupted or was edited. Export it again."
            )
    for at, e in (("", m), *((f"entries.{k}.", e) for k, e in m.get("entries", {}).items())):
        for d in e["signature"]["inputs"]:  # (weak: a scalar, the rule on inputs says)
            if d.get("weak_type") and (d["dtype"] == "bool" or d["dtype"].startswith("key<")):
                raise ArtifactError(  # else every call refused, asked for a Python number
                    f"{file}: {at}signature's input {d['path']} is {d['dtype']}[] marked "
                    "weak_type: true, which no export writes (JAX types only Python ints, "
                    "floats and complex numbers weakly); the artifact is corrupted or was "
                    "edited. Export it again."
                )


_TENSORS = "a list of {path, shape, dtype} (each dimension a size below 2**63, or a name)"

_MISSING = type("_Missing", (), {"__repr__": lambda self: "(missing)"})()


def _program_rules(m: Mapping[str, Any], prefix: str) -> list[tuple[str, Any, Any, str]]:
    """The rules on what one entry point's program takes and returns."""
    sig = m.get("signature", _MISSING)
    s = sig if isinstance(sig, dict) else {}
    return [
        (f"{prefix}signature", sig, lambda v: isinstance(v, dict), "an object"),
        (f"{prefix}signature.inputs", s.get("inputs"), _tensors(True), _TENSORS),
        (f"{prefix}signature.outputs", s.get("outputs"), _tensors(True), _TENSORS),
        (f"{prefix}signature.output_kind", s.get("output_kind"),
         lambda v: v == "tuple" or (v == "array" and len(s["outputs"]) == 1),
         '"tuple", or "array" with one output'),
        (f"{prefix}signature.batch", s.get("batch"), lambda v: v is None or (_is_str(v) and [
            i["shape"][:1] for i in s["inputs"][:1]] in ([], [[v]])),  # what a Batcher merges
         "the name args[0]'s shape begins with, or null"),
        (f"{prefix}signature.strong", s.get("strong", []), lambda v: v == [] or (_platforms(v)
         and set(v) <= {i["path"] for i in s["inputs"] if not i.get("weak_type")}), "input paths"),
        (f"{prefix}signature.constraints", s.get("constraints", []),
         lambda v: _str_list(v) and len(v) <= 64
         and all(0 < len(c) <= MAX_CONSTRAINT_CHARS for c in v),
         f"a list of at most 64 constraints such as \"t <= 1024\" ({MAX_CONSTRAINT_CHARS} "
         "characters at most)"),
        (f"{prefix}mlir_arguments", m.get("mlir_arguments", _MISSING), _str_list,
         "a list of names"),
        (f"{prefix}static", m.get("static", {}), _str_dict, "an object of strings"),
        (f"{prefix}rows", m.get("rows"), _rows,
         '{"dim": a name or null, "independent": true or false, "why": a reason} (or none)'),
    ]  # fmt: skip


def _rows(x: Any) -> bool:
    return x is None or (isinstance(x, dict) and set(x) == {"dim", "independent", "why"}
                         and (x["dim"] is None or _name(x["dim"])) and _name(x["why"])
                         and len(x["why"]) <= 1000 and isinstance(x["independent"], bool)
                         and x["independent"] == (x["why"] == ""))  # fmt: skip


def is_entry_name(x: Any) -> bool:
    """A name an entry point may have (its files are named by it)."""
    ok = _is_str(x) and x.isidentifier() and x.isascii() and len(x) <= 64
    return ok and x not in RESERVED_ENTRY_NAMES


def tolerance(x: Any) -> bool:
    """A self-test's tolerance: its rtol and atol, each a number from 0 to MAX_TOLERANCE (a
    stranger's inf or 1e9 would let any output pass; NaN fails ``<=``)."""
    return isinstance(x, dict) and set(x) == {"rtol", "atol"} and all(
        isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= MAX_TOLERANCE
        for v in x.values())  # fmt: skip


def _is_str(x: Any) -> bool:
    return isinstance(x, str)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_size(x: Any) -> bool:
    return is_int(x) and x >= 0


def _name(x: Any) -> bool:
    """A string a message may show as is: 4096 characters at most, none of what a terminal
    acts on (``\\x1b``)."""
    return isinstance(x, str) and len(x) <= 4096 and x.isprintable()


def _str_list(x: Any) -> bool:
    return isinstance(x, list) and all(map(_name, x))


def _str_dict(x: Any) -> bool:
    return isinstance(x, dict) and all(map(_is_str, x.values()))


def _platforms(x: Any) -> bool:
    return _str_list(x) and len(x) > 0 and len(set(x)) == len(x)


def _tensors(symbolic: bool) -> Callable[[Any], bool]:
    def ok(x: Any) -> bool:  # a weak type: an input's, a scalar's (a Python number's)
        return isinstance(x, list) and len(x) <= MAX_PARAMS and all(
            isinstance(d, dict) and isinstance(d.get("shape"), list)
            and all(_name(d.get(k)) and d[k] != "" for k in ("path", "dtype"))
            and all((is_size(n) and n < 1 << 63) or (symbolic and _name(n) and n != "")
                    for n in d["shape"]) and (d.get("weak_type", False) is False or (
                        symbolic and d["shape"] == [] and d["weak_type"] is True)) for d in x
        ) and len({d["path"] for d in x}) == len(x)  # fmt: skip

    return ok


def _files(x: Any) -> bool:
    return isinstance(x, dict) and len(x) <= MAX_FILES and all(
        is_file_name(name) and isinstance(e, dict) and _is_str(e.get("sha256"))
        and _SHA256.fullmatch(e["sha256"]) is not None and is_size(e.get("bytes"))
        for name, e in x.items()
    )  # fmt: skip


def is_file_name(name: str) -> bool:
    """A plain name of a file directly inside the artifact directory: no path, no escape."""
    return (
        name not in ("", ".", "..", MANIFEST)
        and name.isprintable()  # no NUL, no terminal escape in messages naming it
        and not any(c in name for c in ("/", "\\"))
        and os.path.basename(name) == name
        and len(name.encode("utf-8", "surrogatepass")) <= 255
    )


def show(value: Any) -> str:
    """``repr(value)``, cut at 80 characters, without terminal escapes."""
    return printable(text if len(text := repr(value)) <= 80 else text[:77] + "...")


def printable(text: str) -> str:
    """``text`` with what a terminal could act on (``\\x1b``, ``\\u202e``) as ``repr`` escapes;
    bytes a path's locale could not decode (``\\udcc3\\udcbc``) as UTF-8 (``ü``) or ``\\xe9``."""
    if text.isprintable():
        return text
    text = _UNDECODED.sub(lambda m: os.fsencode(m[0]).decode(errors="backslashreplace"), text)
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# -- entry points: the default one is the manifest's top level, with the model.* files; each other
# one (manifest["entries"][name]) has its own program files, signature and param subset
_PROGRAM_FIELDS = ("name", "signature", "mlir_arguments", "static")


def entry_point(view: Mapping[str, Any]) -> str:
    """The name of the entry point an :func:`entry_view` describes."""
    return view.get("entry_point", view.get("entry", "main"))


def entry_names(manifest: Mapping[str, Any]) -> tuple[str, ...]:
    """The artifact's entry points, the default first."""
    return (manifest.get("entry", "main"), *manifest.get("entries", {}))


def entry_view(manifest: Mapping[str, Any], name: str | None = None) -> dict[str, Any]:
    """The manifest as one entry point sees it (``None``: the default): its name, signature,
    program files and the params it takes, over the artifact's shared fields."""
    default = manifest.get("entry", "main")
    view = {k: v for k, v in manifest.items() if k not in ("program_files", "entry_point")}
    if name is None or name == default:
        return view  # the manifest itself
    entry = manifest.get("entries", {}).get(name)
    if entry is None:
        raise KeyError(name)
    used = set(entry["params"])
    return (
        view
        | {k: entry[k] for k in _PROGRAM_FIELDS if k in entry}
        | {
            "rows": entry.get("rows"),  # its own verdict, never the default's
            "entry_point": name,
            "params": [p for p in manifest["params"] if p["path"] in used],
            "program_files": dict(entry["program_files"]),
        }
    )


def caller(path: Path, view: Mapping[str, Any]) -> str:
    """``symjax_mlp.load("path")["entry"]``, messages' prefix for calls of an entry point."""
    many = len(entry_names(view)) > 1
    return f'symjax_mlp.load("{printable(str(path))}")' + (f"[{entry_point(view)!r}]" * many)


def program_file(view: Mapping[str, Any], role: str) -> str | None:
    """The file an entry point keeps as ``role`` (``model.jaxexport``, ...): the role itself
    for the default entry point and shared files; ``None`` where it has none (a self-test)."""
    files = view.get("program_files")
    return role if files is None or role not in _ENTRY_ROLES else files.get(role)


def entry_files(name: str) -> dict[str, str]:
    """The files an export writes for a (non-default) entry point named ``name``."""
    return {role: f"{name}.{role.removeprefix('model.')}" for role in _ENTRY_ROLES[:-1]}


def check_target(path: Path, overwrite: bool) -> None:
    """Raises unless export may write ``path``: new below a directory, or an artifact to replace."""
    looked_up(path)
    call = f'symjax_mlp.export("{printable(str(path))}")'
    if not os.path.lexists(path):
        above = next((p for p in path.parents if os.path.lexists(p)), path.parent)
        if not above.is_dir():
            what = "a file" if above.exists() else "a symlink to nothing"
            raise ArtifactError(f"{call}: {above} is {what}, not a directory. Choose a path "
                                "below a directory.")  # fmt: skip
        return
    if not overwrite:
        raise ArtifactError(
            f"{call}: {path} already exists; export does not replace it silently. Pass "
            "overwrite=True to replace it, or choose another path."
        )
    if path.is_symlink() or not path.is_dir():
        what = f"a symlink to {os.readlink(path)}" if path.is_symlink() else "not a directory"
        raise ArtifactError(f"{call}: {path} is {what}; overwrite=True replaces an artifact "
                            "directory, never a link or a file. Choose another path.")  # fmt: skip
    if any(path.iterdir()) and not (path / MANIFEST).exists():
        raise ArtifactError(
            f"{call}: {path} is a non-empty directory without {MANIFEST}, so not an artifact; "
            "refusing to replace it even with overwrite=True. Choose another path."
        )
