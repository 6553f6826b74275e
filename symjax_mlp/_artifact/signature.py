"""The call signature of an artifact: what it takes and returns, checked on every new shape.

Plain data, no JAX: checked before any array reaches a compiled program.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from symjax_mlp._artifact.format import printable
from symjax_mlp._errors import SignatureError, first_line
from symjax_mlp._npy import dtype_refused, weak_refusal
from symjax_mlp._specs import MASKED_INPUT, TensorSpec

MAX_SYMBOLIC = 2**31 - 1  # the largest size of a symbolic dimension a call may give
MAX_TRIES = 16  # batches admits_any tries: a stranger's numbers, each one's sizes_at passes


@dataclasses.dataclass(frozen=True)
class Signature:
    """What an artifact's function takes and returns (params excluded).

    Attributes:
      inputs: one :class:`TensorSpec` per positional input, ``args[0]``, ``args[1]``, ...
      outputs: one :class:`TensorSpec` per output array.
      output_kind: ``"array"`` (the function returns one array) or ``"tuple"``.
      batch: the name of the symbolic leading dimension (``"b"``), or ``None`` if every
        shape is static or the shapes came from per-input specs. A symbolic dimension is
        always ``>= 1``.
      constraints: further bounds on the symbolic dimensions, as ``jax.export`` writes them
        (``"t <= 1024"``); checked on every call.
      strong: the inputs that take only strongly typed values (``np.float32(2.0)``, a NumPy
        array), the model answering weakly typed ones (``2.0``, ``jnp.full(s, 2.0)``) otherwise.
    """

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    output_kind: str
    batch: str | None
    constraints: tuple[str, ...] = ()
    strong: tuple[str, ...] = ()

    def __str__(self) -> str:
        ins = ", ".join(map(str, self.inputs))
        outs = ", ".join(o.type for o in self.outputs)
        if self.output_kind == "tuple":
            outs = f"({outs})"
        bounds = [f"{n} >= 1" for n in _variables(self.inputs)] + list(self.constraints)
        where = f"  with {', '.join(bounds)}" if bounds else ""
        return f"({ins}) -> {outs}{where}"

    @property
    def format_version(self) -> int:
        """3 where a weak type or ``strong`` decides a call's dtypes, else 2: symjax_mlp 0.15
        and older read format 2, neither field, and answered such calls in other dtypes."""
        return 3 if self.strong or any(s.weak_type for s in self.inputs) else 2

    def to_json(self) -> dict[str, Any]:
        """The signature as JSON data, as the manifest stores it (:meth:`from_json` reads it)."""
        return {
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [s.to_json() for s in self.outputs],
            "output_kind": self.output_kind,
            "batch": self.batch,
            "constraints": list(self.constraints),
        } | ({"strong": list(self.strong)} if self.strong else {})

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Signature:
        """The signature :meth:`to_json` wrote, ``d`` (a manifest's ``"signature"``, whose
        fields ``check_schema`` checked)."""
        specs = [tuple(TensorSpec.from_json(s) for s in d[k]) for k in ("inputs", "outputs")]
        constraints, strong = tuple(d.get("constraints", ())), tuple(d.get("strong", ()))
        return cls(*specs, d["output_kind"], d.get("batch"), constraints, strong)

    def check(self, inputs: Sequence[Any], *, caller: str) -> list[Any]:
        """Checks a call's ``inputs``; returns them as arrays (JAX arrays are passed through).
        A refusal's message begins with ``caller``, the call's name (``"timeit(model)"``).

        Raises:
          SignatureError: wrong number of inputs, rank, shape, dtype, or a batch of 0.
        """
        if len(inputs) != len(self.inputs):
            want = ", ".join(map(str, self.inputs))
            raise SignatureError(
                f"{caller}: the artifact takes {len(self.inputs)} input(s) ({want}); "
                f"got {len(inputs)}. Call it as m({', '.join(s.path for s in self.inputs)})."
            )
        arrays = [as_array(x, spec, caller) for x, spec in zip(inputs, self.inputs, strict=True)]
        sizes: dict[str, tuple[str, int]] = {}
        for spec, x, given in zip(self.inputs, arrays, inputs, strict=True):  # given: as passed
            shape = tuple(x.shape)
            head = f"{caller}: input {spec.path} has shape {shape}"
            if len(shape) != len(spec.shape):
                if spec.dtype.startswith("key<") and str(x.dtype) != spec.dtype:  # PRNGKey's data
                    raise SignatureError(dtype_refused(caller, spec, x, given))
                want = len(spec.shape)
                hint = f"Pass an array of rank {want}."
                if want == len(shape) + 1 and tuple(spec.shape[1:]) == shape:
                    hint = "Add the batch dimension: x[None] (one row) or x.reshape(1, -1)."
                elif want == 2 < len(shape) and np.prod(shape[1:]) == spec.shape[1]:  # images
                    hint = f"Flatten each row to {spec.shape[1]} values: x.reshape(len(x), -1)."
                raise SignatureError(
                    f"{head}, rank {len(shape)}, but the artifact expects rank {want}: "
                    f"{self._expects(spec)}. {hint}"
                )
            for i, (got, dim) in enumerate(zip(shape, spec.shape, strict=True)):
                if got == dim:
                    continue
                at = f"{head} but the artifact expects {self._expects(spec)}: "
                at += f"{spec.path}.shape[{i}] is {got}"
                if isinstance(dim, int):
                    raise SignatureError(
                        f"{at}, not {dim}. Pass an array whose dimension {i} is {dim}."
                    )
                symbolic = type(got) is not int  # jax.export tracing a call: checked as it runs
                if not symbolic and got < 1:
                    raise SignatureError(
                        f"{at}, and a batch of {got} is rejected. Pass at least one row."
                    )
                if not symbolic and got > MAX_SYMBOLIC:  # else refinement fails (int32)
                    raise SignatureError(
                        f"{at}, past the {MAX_SYMBOLIC:,} a symbolic dimension may be (an "
                        "exported program computes it as an int32). Split the input: call it on "
                        f"at most {MAX_SYMBOLIC:,} at a time along that dimension."
                    )
                seen = sizes.setdefault(dim, (f"{spec.path}.shape[{i}]", got))
                if seen[1] != got:
                    raise SignatureError(
                        f"{caller}: {spec.path}.shape[{i}] is {got} but {seen[0]} is "
                        f"{seen[1]}; both are the symbolic dimension {dim} and must agree."
                    )
            if str(x.dtype) != spec.dtype:  # as text: bfloat16 and rng key types included
                raise SignatureError(dtype_refused(caller, spec, x, given))
            if why := weak_refusal(caller, spec, given, spec.path in self.strong):  # h: 2.0's
                raise SignatureError(why)  # dtypes are not np.float32(2.0)'s
        solved = self._check_terms(sizes, caller)
        known = {k: v for k, (_, v) in sizes.items() if type(v) is int}  # symbolic: unknown
        known |= solved
        for constraint in self.constraints:
            if not _holds(constraint, known):
                where = ", ".join(f"{k} = {v} ({p})" for k, (p, v) in sorted(sizes.items()))
                raise SignatureError(
                    f"{caller}: the inputs give {where}, but the artifact requires "
                    f"{constraint}. Pass inputs within that bound (split a longer one)."
                )
        return arrays

    def _check_terms(self, sizes: Mapping[str, tuple[str, int]], caller: str) -> dict[str, int]:
        """Refuses a dimension written as a term (``2*b``: jax.export writes ``t == 2*b`` so)
        whose size is not the term's at the sizes of the names in it (``b``); a name seen only
        in terms (``2*d``) is solved from the first, which must give a whole ``d >= 1``.
        Returns the names' sizes."""
        names = {k: v for k, (_, v) in sizes.items() if k.isidentifier() and type(v) is int}
        for dim, (at, got) in sizes.items():  # int sizes only: a symbolic one is jax's to check
            if dim.isidentifier() or type(got) is not int:
                continue
            used = list(dict.fromkeys(re.findall(r"[A-Za-z_]\w*", dim)))
            unknown = [n for n in used if n not in names]
            if len(unknown) == 1 and (solved := _solve(dim, unknown[0], got, names)) is not None:
                if solved < 1:  # "b + 15" given 10, "2*d" given 5
                    fits = [_evaluate(dim, {**names, unknown[0]: k}) for k in (1, 2, 3)]
                    raise SignatureError(
                        f"{caller}: input {at} is {got}, but the artifact requires {dim} for a "
                        f"whole {unknown[0]} >= 1 ({str(fits)[1:-1]}, ...). Pass an input whose "
                        f"{at} is one of those sizes."
                    )
                names[unknown[0]] = solved
                sizes = {**sizes, unknown[0]: (at, solved)}  # where it came from, for messages
                continue
            if (want := _evaluate(dim, names)) in (None, got):
                continue
            where = ", ".join(f"{n} = {names[n]}" for n in used)
            origin = ", ".join(sizes[n][0] for n in used)
            said = [c for c in self.constraints if _bare(dim) in map(_bare, _split(c)[1:])]
            rule = f"{said[0]}, so " if said else ""
            raise SignatureError(
                f"{caller}: input {at} is {got}, but the artifact requires {rule}{dim} = {want} "
                f"({where}, from {origin}). Pass inputs whose sizes agree: {at} = {want} for "
                f"{where}."
            )
        return names

    def _expects(self, spec: TensorSpec) -> str:
        names = _variables([spec])
        where = f" with {', '.join(names)} >= 1" if names else ""
        inner = ", ".join(map(str, spec.shape))
        return (f"({inner},)" if len(spec.shape) == 1 else f"({inner})") + where


_OPS = {"<=": operator.le, ">=": operator.ge, "==": operator.eq, "<": operator.lt, ">": operator.gt}


def _holds(constraint: str, sizes: Mapping[str, int]) -> bool:
    """Evaluates ``"t <= 1024"`` or ``"b >= 2*t"`` at the call's sizes (unknown names: True)."""
    op, left, right = _split(constraint)
    a, b = (sizes[t] if t in sizes else _evaluate(t, sizes) for t in (left, right))
    return not op or a is None or b is None or _OPS[op](a, b)


_FLIPPED = {"<=": ">=", ">=": "<=", "==": "==", "<": ">", ">": "<"}


def sizes_at(signature: Signature, batch: int) -> dict[str, int] | None:
    """Sizes of the symbolic dimensions for inputs drawn at ``batch`` (verify, timeit): the
    batch dimension (``signature.batch``, else the first symbolic one) is ``batch``; each other
    one is ``batch`` too, moved where a constraint sets or bounds it (``t == 2*b``, ``t >= 4``).
    ``None`` where the constraints refuse ``batch`` itself: no drawn inputs would be admitted."""
    dims = list(dict.fromkeys(d for s in signature.inputs for d in s.shape if isinstance(d, str)))
    names = list(dict.fromkeys(n for d in dims for n in re.findall(r"[A-Za-z_]\w*", d)))
    lead = signature.batch if signature.batch in names else names[0] if names else None
    sizes: dict[str, int] = dict.fromkeys(names, batch)
    for _ in range(min(len(names), len(signature.constraints)) + 1):  # each may settle one
        moved = False
        for constraint in signature.constraints:
            op, left, right = _split(constraint)
            for name, other, rel in ((left, right, op), (right, left, _FLIPPED.get(op, op))):
                bound = _evaluate(other, sizes)
                if name == lead or name not in sizes or bound is None:
                    continue
                now = sizes[name]
                want = {">=": max(now, bound), ">": max(now, bound + 1), "==": bound}.get(rel)
                want = {"<=": min(now, bound), "<": min(now, bound - 1)}.get(rel, want)
                if want is not None and want >= 1 and want != now:
                    sizes[name], moved = want, True
        if not moved:
            break
    for dim in dims:  # jax.export writes a dimension an equality sets as its term: "2*b"
        if (size := _evaluate(dim, sizes)) is None or size < 1:
            return None
        sizes[dim] = size
    admitted = all(_holds(c, sizes) for c in signature.constraints)
    return sizes if admitted else None


def admits(signature: Signature, sizes: Mapping[str, int]) -> bool:
    """Whether ``sizes`` of symbolic dimensions (``{"b": 8}``) satisfy every constraint and fit
    a call (:data:`MAX_SYMBOLIC`): where ``jax.vmap`` may merge examples into one batch."""
    if any(type(n) is not int for n in sizes.values()):  # symbolic: jax.export tracing vmap
        return not signature.constraints  # a bound it may break as it runs: one by one
    fits = all(0 < n <= MAX_SYMBOLIC for n in sizes.values())
    return fits and all(_holds(c, sizes) for c in signature.constraints)


def admits_any(signature: Signature, tries: Sequence[int] = ()) -> bool:
    """Whether some sizes of the symbolic dimensions satisfy the constraints (each >= 1): the
    batch tried at 1, 2, ``tries`` and each number of the constraints and beside it (where a
    bound's interval ends). ``True`` for a dimension beyond :func:`sizes_at`'s arithmetic, or
    where the first ``MAX_TRIES`` of those batches admit nothing and there are more."""
    dims = {d for s in signature.inputs for d in s.shape if isinstance(d, str)}
    ones = {n: 1 for d in dims for n in re.findall(r"[A-Za-z_]\w*", d)}
    if not signature.constraints or any(_evaluate(d, ones) is None for d in dims):
        return True
    numbers = {int(n) for c in signature.constraints for n in re.findall(r"\d+", c)}
    tries = {1, 2, *tries, *(n + d for n in numbers for d in (-1, 0, 1))} - {-1, 0}
    for b in sorted(tries)[:MAX_TRIES]:
        if (sizes := sizes_at(signature, b)) is None:
            continue
        for c in signature.constraints:  # a name jax.export replaced by its term (t == 2*b)
            op, left, right = _split(c)
            if op == "==" and left not in sizes and (v := _evaluate(right, sizes)) is not None:
                sizes[left] = v
        if all(_holds(c, sizes) for c in signature.constraints):
            return True
    return len(tries) > MAX_TRIES  # not all tried: the calls refuse what their bounds do


def _variables(specs: Sequence[TensorSpec]) -> list[str]:
    """The dimension variables of ``specs``' shapes, sorted: ``b`` and ``d`` of ``(b, 2*d)``
    (``mod`` of ``mod(b, 3)`` is no variable)."""
    dims = [d for s in specs for d in s.shape if isinstance(d, str)]
    return sorted({n for d in dims for n in re.findall(r"[A-Za-z_]\w*\b(?!\s*\()", d)})


def _solve(term: str, name: str, size: int, sizes: Mapping[str, int]) -> int | None:
    """The ``name`` at which ``term`` (linear in it, as jax.export solves) is ``size``:
    ``None`` where it is not linear; not whole, or below 1, as 0 (no such ``name`` >= 1)."""
    at = [_evaluate(term, {**sizes, name: k}) for k in (0, 1, 2)]
    if None in at or at[1] - at[0] != at[2] - at[1] or at[1] == at[0]:
        return None
    n, rest = divmod(size - at[0], at[1] - at[0])
    return 0 if rest else n


def _bare(term: str) -> str:
    return "".join(term.split())


def _split(constraint: str) -> tuple[str, str, str]:
    for op in _OPS:  # "<=" before "<"
        left, sep, right = constraint.partition(op)
        if sep:
            return op, left.strip(), right.strip()
    return "", "", ""


_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluate(term: str, sizes: Mapping[str, int]) -> int | None:
    """``"2*b + 1"`` at ``sizes``; ``None`` for a term beyond integers, names, ``+ - *``."""

    def value(node: ast.AST) -> int | None:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            return sizes.get(node.id)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            v = value(node.operand)
            return None if v is None else -v
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            a, b = value(node.left), value(node.right)
            return None if a is None or b is None else _ARITHMETIC[type(node.op)](a, b)
        return None

    try:  # a manifest's constraint is at most MAX_CONSTRAINT_CHARS: no deep tree
        return value(ast.parse(term, mode="eval").body) if term else None
    except (SyntaxError, ValueError, RecursionError):
        return None


def is_array(x: Any) -> bool:
    """A NumPy array or scalar, or a JAX array (a tracer under the caller's ``jax.jit`` too);
    not a masked array, which :meth:`Signature.check` refuses on every call."""
    if isinstance(x, (np.ndarray, np.generic)):
        return not isinstance(x, np.ma.MaskedArray)
    jax = sys.modules.get("jax")  # no JAX imported: no JAX array can exist
    return jax is not None and isinstance(x, jax.Array)


def as_array(x: Any, spec: TensorSpec, caller: str) -> Any:
    """``x`` as an array: arrays pass, Python numbers and lists convert (:func:`_weak`), any
    other object (a torch tensor, a masked array) is refused by its type."""
    if isinstance(x, np.ma.MaskedArray):
        raise SignatureError(MASKED_INPUT.format(caller=caller, path=spec.path))
    if is_array(x):
        return x
    kind = f"{type(x).__module__}.{type(x).__qualname__}".removeprefix("builtins.")
    if isinstance(x, (bool, int, float, complex, list, tuple)):
        try:
            return _weak(np.asarray(x), spec)
        except CONVERSION_ERRORS as e:
            raise not_an_array(x, spec, caller, e) from None
    hint = ""
    if kind.startswith("torch."):
        hint = " Convert it: x.detach().cpu().numpy() (or jax.dlpack.from_dlpack(x))."
    elif hasattr(x, "__array__"):
        hint = " Convert it: np.asarray(x)."
    elif kind == "jax.ShapeDtypeStruct":  # a shape without values: what eval_shape traces
        hint = " For the output's shape and dtype without values, jax.eval_shape(m, spec)."
    raise SignatureError(
        f"{caller}: input {spec.path} is {'None' if x is None else an(kind)}, not "
        f"a NumPy or JAX array; the artifact expects {spec.type}. Pass a np.ndarray or "
        f"jax.Array.{hint}"
    )


#: what ``np.asarray`` raises on an object that is no array (a ragged list; 2**70 in a list of
#: floats; an ``__array__`` that raises, a table's of mixed columns)
CONVERSION_ERRORS = (ValueError, TypeError, OverflowError)


def not_an_array(x: Any, spec: TensorSpec, caller: str, error: Exception) -> SignatureError:
    """The refusal of input ``x``, which ``np.asarray`` could not make an array of ``spec``'s."""
    kind = f"{type(x).__module__}.{type(x).__qualname__}".removeprefix("builtins.")
    why = first_line(error, 200)
    return SignatureError(
        f"{caller}: input {spec.path} is {an(kind)} that is not an array ({why}); the "
        f"artifact expects {spec.type}. Pass a NumPy or JAX array of that shape."
    )


def an(kind: str) -> str:
    """``kind`` with its article, printable: an object, an int, a str."""
    return f"a{'n' * (kind[:1] in tuple('aeiou'))} {printable(kind)}"


def _weak(a: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """Python numbers (a scalar, a list of them) in the artifact's dtype, as JAX's weakly typed
    scalars take one: a bool only bool, an int any number type it fits, a float a float or
    complex one; else ``a`` as NumPy made it (64-bit), for the dtype check to refuse."""
    want = getattr(np, spec.dtype, None) if spec.dtype != "bool" else np.bool_
    want = np.dtype(getattr(ml_dtypes, spec.dtype, want) or "V")
    kind = want.kind if want.kind != "V" else "f" if "float" in want.name else want.name[:1]
    if kind not in {"b": "b", "i": "iufc", "f": "fc", "c": "c"}.get(a.dtype.kind, ""):
        return a
    with np.errstate(over="ignore", invalid="ignore"):
        b = a.astype(want)
    fits = np.array_equal(np.isfinite(b), np.isfinite(a)) if kind in "fc" else np.array_equal(b, a)
    return b if fits else a  # 1e40 in float32, 300 in int8: refused as NumPy made them
