"""The path, shape, dtype and weak type of an array a Hybrid traced or an artifact takes (a
dimension may be a name, ``"b"``); an export's input structs, from its example and its specs."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from symjax_mlp._errors import ConfigError, SignatureError
from symjax_mlp._export_example import not_an_array, tree_of_arrays


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One array: a path, a shape (ints and symbolic names), a dtype, and JAX's weak type.

    Example:
      >>> from symjax_mlp import TensorSpec
      >>> str(TensorSpec("args[0]", ("b", 512), "float32"))
      'args[0]: float32[b, 512]'
    """

    path: str
    shape: tuple[int | str, ...]
    dtype: str
    weak_type: bool = False

    def __str__(self) -> str:
        weak = " (weak)" if self.weak_type else ""
        return f"{self.path}: {self.type}{weak}"

    @property
    def type(self) -> str:
        """``float32[b, 512]``: the dtype and the shape, symbolic dimensions by name."""
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"

    def to_json(self) -> dict[str, Any]:
        """``{"path", "shape", "dtype"}`` as JSON data, ``"weak_type": true`` if weak."""
        d = {"path": self.path, "shape": list(self.shape), "dtype": self.dtype}
        return d | {"weak_type": True} if self.weak_type else d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TensorSpec:
        """The spec :meth:`to_json` wrote, ``d``; a ``KeyError`` if a field is missing (a
        manifest's: checked, each weak type where an export writes one, by its schema)."""
        return cls(d["path"], tuple(d["shape"]), d["dtype"], d.get("weak_type", False))


def shape_dims(shape: Sequence[Any]) -> tuple[int | str, ...]:
    """A JAX shape as spec dims: ints stay, symbolic dimensions become their names."""
    return tuple(d if isinstance(d, int) else str(d) for d in shape)


_UNSERIALIZABLE = (
    "export({name}): {path} is {type}, which jax.export cannot serialize. An artifact's inputs "
    "and outputs are bool, int4 to int64, uint4 to uint64 or floats (float4_e2m1fn, the float8 "
    "types, bfloat16, float16 to float64). Cast it to {cast}: give an input as {cast} (cast it "
    "back to {dtype} inside the model if it must be), return an output as out.astype(jnp.{cast})."
)


def input_specs(args: Any, kwargs: Any) -> list[TensorSpec]:
    """A spec of each array leaf of a call's ``(args, kwargs)``, by path: for a message."""
    leaves = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
    return [
        TensorSpec(("args" if p[0].idx == 0 else "kwargs") + jax.tree_util.keystr(p[1:]),
                   shape_dims(x.shape), str(x.dtype))
        for p, x in leaves if hasattr(x, "shape") and hasattr(x, "dtype")
    ]  # fmt: skip


def ensemble_member(shapes: Mapping[str, Any], rows: tuple) -> tuple[str, tuple] | None:
    """The first ``(path, shape)`` of the params' ``shapes`` if every one leads with ``rows``,
    the example's: an ensemble's members, one per row, which take no batch; else ``None``."""
    if not rows or not shapes or any(tuple(s[:1]) != tuple(rows) for s in shapes.values()):
        return None
    return next(iter(shapes.items()))


def unserializable(name: str, structs: Mapping[str, Any]) -> SignatureError | None:
    """The :class:`~symjax_mlp.SignatureError` for the first of ``structs`` (by path) whose
    dtype ``jax.export`` cannot serialize (int2, uint1); ``None`` if it can serialize them all."""
    for path, x in structs.items():
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) or _serializable(x.dtype):
            continue  # an rng key's dtype is extended: serialized as its kind
        dtype = np.dtype(x.dtype)
        kinds = [("float16", jnp.floating), ("uint8", jnp.unsignedinteger), ("int8", jnp.integer)]
        cast = next((c for c, kind in kinds if jnp.issubdtype(dtype, kind)), "complex64")
        spec = TensorSpec(path, shape_dims(x.shape), str(dtype))
        return SignatureError(
            _UNSERIALIZABLE.format(name=name, path=path, type=spec.type, cast=cast, dtype=dtype)
        )
    return None


@functools.cache
def _serializable(dtype: Any) -> bool:
    """Whether ``jax.export`` serializes ``dtype``, probed once: the identity exported on it."""
    try:
        jax.export.export(jax.jit(lambda x: x))(jax.ShapeDtypeStruct((1,), dtype)).serialize()
    except Exception:  # KeyError (int2), TypeError (complex32), ValueError (uint1), ...
        return False
    return True


def array_types() -> frozenset[type]:
    """The concrete array types a hot path may take as they are: ``np.ndarray`` and every class
    below ``jax.Array`` (a tracer is not one), found without creating an array (which would
    start JAX's backend)."""
    types, todo = {np.ndarray}, [jax.Array]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in types:
                types.add(sub)
                todo.append(sub)
    return frozenset(types)


#: A NumPy masked array given as an input, refused by a Hybrid's call and a loaded model's
#: (neither JAX nor an artifact has a mask: it would be dropped without a word).
MASKED_INPUT = (
    "{caller}: input {path} is a NumPy masked array, and a compiled program has no mask: it "
    "would compute on the masked entries' hidden values as if they were data. Fill them with "
    "the value that means 'missing' to your model, x.filled(value) (e.g. x.filled(0.0)), or "
    "pass np.asarray(x) to use the data under the mask as it is."
)
_UNFIT_ARRAY = (
    "{caller}: {path} is {what} of dtype {dtype}, which XLA cannot compute on ({why}). "
    "Convert it: {fix}."
)
_MATRIX = (
    "{caller}: {path} is a np.matrix, whose * is a matrix product (and ** a matrix power), so "
    "the model's x * w means one thing run eagerly and another compiled (an array's elementwise "
    "product). Pass np.asarray(x)."
)
_NO_NUMBERS = "it takes bool, int, float and complex numbers"
_KINDS = {"S": "O", "U": "O", "m": "M"}  # bytes and str as objects, durations as datetimes
_UNFIT = {  # by dtype kind: why, and the fix
    "O": (_NO_NUMBERS, "x.astype(np.float32) (a table's text columns encoded first)"),
    "M": (_NO_NUMBERS, "x.astype(np.int64) (a count of its unit: days, seconds) or a float of it"),
    "V": (_NO_NUMBERS, "x.view(np.float32) where its bytes are float32s, or pass its fields"),
    "f": ("JAX's widest float is float64", "x.astype(np.float32)"),
    "c": ("JAX's widest complex is complex128", "x.astype(np.complex64)"),
}


def unfit_array(caller: str, path: str, x: Any) -> SignatureError | None:
    """The :class:`~symjax_mlp.SignatureError` for ``x`` at ``path`` (``"input args[0]"``) if
    it is a NumPy array or scalar no JAX array holds: masked, a ``np.matrix``, of no numbers
    (str, objects: a table's ``df.values``; datetimes, raw bytes: ``np.void``), of a float
    wider than float64 (``np.longdouble``), or of bytes in the other order (big-endian, a FITS
    file's); else ``None``. A ``np.str_`` (``np.bytes_``) is a str: a Python setting, no array."""
    if not isinstance(x, (np.ndarray, np.generic)) or isinstance(x, (str, bytes)):
        return None
    if isinstance(x, np.ma.MaskedArray):  # a program has no mask: it would compute on the data
        return SignatureError(MASKED_INPUT.format(caller=caller, path=path.removeprefix("input ")))
    if isinstance(x, np.matrix):
        return SignatureError(_MATRIX.format(caller=caller, path=path))
    dtype, kind = x.dtype, _KINDS.get(x.dtype.kind, x.dtype.kind)
    wide = kind in "fc" and dtype.itemsize > (8 if kind == "f" else 16)  # float128, complex256
    if kind in "OM" or dtype.type is np.void or wide:  # (bfloat16's kind is "V" too: no void)
        why, fix = _UNFIT[kind]
    elif not dtype.isnative:
        why = "its bytes are in the other byte order than this machine's"
        fix = f"x.astype(np.{dtype.newbyteorder('=').name}), in this machine's order"
    else:
        return None
    what = (
        "a NumPy array" if isinstance(x, np.ndarray) else f"a NumPy scalar, np.{type(x).__name__},"
    )
    return SignatureError(
        _UNFIT_ARRAY.format(caller=caller, path=path, what=what, dtype=dtype, why=why, fix=fix)
    )


_FOREIGN = (
    "{caller}: {path} is a {kind}, another library's array, which a compiled JAX call cannot "
    "take. Convert it: np.asarray({path}) ({path}.detach().cpu().numpy() for a torch tensor on a "
    "GPU or that requires grad), or jax.dlpack.from_dlpack({path}), which shares its memory."
)


def array_like(x: Any) -> bool:
    """Whether ``x`` has a ``shape`` and a ``dtype``; an object whose ``__getattr__`` raises
    another error for them (the JAX training cookbook's ``dot_dict``: a KeyError) has not."""
    try:
        return hasattr(x, "shape") and hasattr(x, "dtype")
    except Exception:  # whatever a user's __getattr__ raises
        return False


def foreign_array(caller: str, path: str, x: Any) -> ConfigError | None:
    """The :class:`~symjax_mlp.ConfigError` for ``x`` at ``path`` if, no JAX or NumPy array,
    it has a shape and dtype: another library's (torch's, TensorFlow's), which jit cannot take."""
    if isinstance(x, type) or not array_like(x):
        return None  # (a type: np.float32 has both, as descriptors)
    kind = f"{type(x).__module__}.{type(x).__qualname__}"
    return ConfigError(_FOREIGN.format(caller=caller, path=path, kind=kind))


def cast_to(dtype: str) -> str:
    """``dtype`` as a cast names it: ``np.float32``, ``jnp.bfloat16`` (ml_dtypes'). Looked up,
    never ``getattr(np, ...)``: a stranger's manifest may name ``object`` (NumPy warns)."""
    numpys = getattr(np.sctypeDict.get(dtype), "__module__", None) == "numpy"  # not ml_dtypes'
    return f"{'np' if numpys else 'jnp'}.{dtype}"


def keyword_arrays(signature: Any, n: int, given: Mapping[str, Any]) -> tuple[list[str], int]:
    """Where ``n`` arrays by place outnumber the positional parameters of ``signature`` (an
    ``inspect.Signature``): the keyword-only ones without a default, not in ``given``, that the
    rest are meant for (flax nlp_seq's ``(*, inputs, train)``), and how many it takes by place."""
    params = list(getattr(signature, "parameters", {}).values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return [], n
    placed = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    free = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    return [k for k in free if k not in given][: max(n - placed, 0)], min(n, placed)


def by_place(
    names: list[str], placed: int, settings: Mapping[str, Any], hybrid: bool = True
) -> tuple[str, str]:
    """A Hybrid ``h`` (``hybrid=False``: a function ``model``) taking ``placed`` arrays by place
    and ``names`` by keyword, ``settings`` fixed, as code of a function taking them all by place,
    and the example it takes: ``("sm.hybridize(lambda params, inputs: h.apply(params,
    inputs=inputs, train=False), h.params)", "inputs")``."""
    xs = ["x"] if placed == 1 else [f"x{i}" for i in range(placed)]
    places = ", ".join([*xs, *names])
    kept = [f"{k}={v!r}" for k, v in settings.items() if k not in names]
    passed = ", ".join([*xs, *(f"{k}={k}" for k in names), *kept])
    example = places if len(xs) + len(names) == 1 else f"({places})"
    if not hybrid:
        return f"lambda {places}: model({passed})", example
    return f"sm.hybridize(lambda params, {places}: h.apply(params, {passed}), h.params)", example


def array_kwargs_error(
    name: str, names: list[str], placed: int, settings: Mapping[str, Any], signature: Any = None
) -> str:
    """The refusal of arrays given as keywords, or (``signature``) that the model takes by
    keyword only, naming the wrapper that gives them places."""
    them, (code, example) = "it" if len(names) == 1 else "them", by_place(names, placed, settings)
    if signature is None:  # given in kwargs=
        got = ", ".join(f"kwargs[{n!r}]" for n in names)
        are = "is an array" if them == "it" else "are arrays"
        head = f"export({name}, kwargs=...): {got} {are}"
    else:
        head = f"export({name}): the model takes {', '.join(names)} by keyword only {signature}"
    bake = "; or bake a Python setting (True, 3, 'relu') instead" if signature is None else ""
    return (
        f"{head}, but an artifact's inputs are positional. Give {them} a place: export {code} "
        f"with example={example}, and call the artifact with {them} by place{bake}."
    )


def input_structs(
    examples: tuple[Any, ...], batch: str | None, shapes: Sequence[str | None] | None,
    constraints: tuple[str, ...], name: str, placed: Any = None,
) -> list[jax.ShapeDtypeStruct]:  # fmt: skip
    """The inputs' structs: the leading dimension ``batch``, or the ``shapes`` specs."""
    for i, x in enumerate(examples):
        if not array_like(x) or tree_of_arrays(x):  # (haliax's NamedArray has both)
            raise not_an_array(name, i, x, len(examples), placed)
    if shapes is None:
        dim = jax.export.symbolic_shape(batch)[0] if batch else None
        for i, x in enumerate(examples):
            if dim is not None and not x.shape:  # a key each call passes, a setting
                fix = tuple(f"{batch}, ..." if y.shape else None for y in examples)
                raise SignatureError(
                    f"export(example=...): args[{i}] is a scalar, so it has no batch dimension "
                    f"for batch={batch!r}. Pass shapes={fix!r}, which keeps it whole and "
                    "batches the rest, or batch=None for static shapes."
                )
        specs = [None if dim is None else (dim, *x.shape[1:]) for x in examples]
    else:
        specs = _specs(examples, tuple(shapes), constraints, name)
    pairs = zip(examples, specs, strict=True)
    return [jax.ShapeDtypeStruct(tuple(x.shape) if d is None else d, x.dtype) for x, d in pairs]


def _specs(examples: tuple[Any, ...], shapes: tuple, constraints: tuple, name: str) -> list:
    """Each input's ``jax.export`` shape spec (``None``: static), all in one scope."""
    if len(shapes) != len(examples):
        raise ConfigError(
            f"export({name}, shapes={shapes!r}): one spec per input; the example has "
            f"{len(examples)} input(s)."
        )
    try:
        scope = jax.export.SymbolicScope(constraints)
        specs = [  # like: '...' and '_' stand for the example's own dimensions ('b, ...')
            s if s is None else jax.export.symbolic_shape(s, scope=scope, like=_like(s, x))
            for s, x in zip(shapes, examples, strict=True)
        ]
    except (ValueError, TypeError) as e:
        raise ConfigError(
            f"export({name}, shapes={shapes!r}, constraints={constraints!r}): "
            f"{str(e).rstrip('.')}. Write specs "
            "as jax.export does, e.g. 'b, 512', and constraints such as 't <= 1024'."
        ) from None
    for i, (x, dims) in enumerate(zip(examples, specs, strict=True)):
        if dims is not None and (
            len(dims) != len(x.shape)
            or any(isinstance(d, int) and d != n for d, n in zip(dims, x.shape, strict=True))
        ):
            raise SignatureError(
                f"export({name}, shapes=...): args[{i}] has shape {tuple(x.shape)}, which the "
                f"spec {shapes[i]!r} does not describe. Give a spec of rank {len(x.shape)} "
                "whose numbers match the example."
            )
    seen: dict[str, tuple[str, int]] = {}  # a name's first place and the example's size there
    for i, (x, dims) in enumerate(zip(examples, specs, strict=True)):
        for k, (d, n) in enumerate(zip(dims or x.shape, x.shape, strict=True)):
            if str(d).isidentifier() and seen.setdefault(str(d), (f"{i}].shape[{k}", n))[1] != n:
                fix = ", ".join(str(n) if j == k else str(e) for j, e in enumerate(dims))
                at, size = seen[str(d)]
                raise SignatureError(
                    _ONE_SIZE.format(name=name, shapes=shapes, dim=str(d), at=at, size=size,
                                     i=i, k=k, n=n, spec=shapes[i], fix=fix)
                )  # fmt: skip
    return specs


def _like(spec: str, x: Any) -> tuple[int, ...] | None:
    """The example's shape where ``spec`` takes dimensions from it: ``...`` (the rest) or ``_``
    (one, shape_poly.md's ``"(b, _, _)"``)."""
    placeholder = "..." in spec or "_" in (d.strip(" ()") for d in spec.split(","))
    return tuple(x.shape) if placeholder and hasattr(x, "shape") else None


_ONE_SIZE = (
    "export({name}, shapes={shapes!r}): the specs name {dim!r} at args[{at}] and "
    "args[{i}].shape[{k}], where the example has sizes {size} and {n}; a name is one size, "
    "shared by every place it appears. Give args[{i}].shape[{k}] its number or its own name: "
    "{spec!r} -> {fix!r}."
)


def beyond_range(want: Any) -> str:
    """What an input (an array, a JSON body) holds past a float dtype's range, said."""
    info = ml_dtypes.finfo(want)
    if float(info.min) > 0:  # float8_e8m0fnu: powers of two, none zero or negative (0 and -2 were
        # said to be past its largest)
        return (
            f"numbers outside {want}'s range, {float(info.min):.4g} to {float(info.max):.4g} "
            "(it holds no zero and no negative number)"
        )
    return f"numbers beyond {want}'s range (largest {float(info.max):.4g})"


def out_of_range(a: Any, dtype: Any) -> str:
    """What NumPy array ``a`` holds that a cast to ``dtype`` would make inf or wrap, said
    (``"holds integers outside uint8's range [0, 255], which a cast wraps (-1 among them)"``);
    ``""`` where it holds none, or ``a`` is a JAX array. Error paths only: it reads every value."""
    if not isinstance(a, (np.ndarray, np.generic)):
        return ""
    with contextlib.suppress(TypeError, ValueError, OverflowError), np.errstate(over="ignore"):
        want = np.dtype(getattr(ml_dtypes, str(dtype), None) or dtype)
        held = a[np.isfinite(a)] if a.dtype.kind == "f" else np.ravel(a)  # NaN, inf: in range
        low, high = held.min(initial=0), held.max(initial=0)  # Python's ints past int64 too
        if want.kind in "iu" and a.dtype.kind in "iuO":
            info = ml_dtypes.iinfo(want)
            if low < info.min or high > info.max:
                v = low if low < info.min else high
                return (
                    f"holds integers outside {want}'s range [{info.min}, {info.max}], which a "
                    f"cast wraps ({_number(v)} among them)"
                )
        elif want.kind != "c" and max(-low, high) > float(ml_dtypes.finfo(want).max):
            v = low if -low > high else high
            return f"holds {beyond_range(want)}, which a cast makes inf ({_number(v)} among them)"
    return ""


def _number(v: Any) -> str:
    """A number short: ``1e+40`` for 10**40 (a float's form: an int of thousands of digits is
    past float64), ``-1`` for -1."""
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.4g}"
    digits = str(abs(int(v)))
    if len(digits) <= 16:
        return str(int(v))
    tail = digits[1:4].rstrip("0")
    return f"{'-' if v < 0 else ''}{digits[0]}{'.' + tail if tail else ''}e+{len(digits) - 1}"
