"""Export's trace of an entry point at the symbolic batch, and its refusals where the batch is
the cause: inputs of mixed leading dimensions, a model of one example, an ensemble's members."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Any

import jax

from symjax_mlp._errors import ConfigError, SignatureError, SymjaxError, first_line, message
from symjax_mlp._hybrid.jaxpr import walk
from symjax_mlp._hybrid.trace import TRACER_ERRORS
from symjax_mlp._npy import weakly_typed
from symjax_mlp._specs import TensorSpec, ensemble_member, shape_dims

_FAILS = (
    "export({name}, batch={batch!r}): with every input's leading dimension as the symbolic "
    "batch {batch!r} ({types}) the trace fails ({error}), while {traced}. "
)
_ONE_EXAMPLE = (
    "If the model takes one example, as every eqx.nn layer does, export a batched model, e.g. "
    "sm.hybridize(eqx.filter_vmap(model)) (jax.vmap for a function){static}{shared}."
)
_FIXED = (
    "Either the example is one example of the model, as eqx.nn layers take one (export "
    "sm.hybridize(eqx.filter_vmap(model)), jax.vmap for a function), or the model fixes its "
    "batch size to {lead} rows{how}. Or pass batch=None to export the example's static shapes."
)
_RESHAPE = (
    ", a reshape or a vmap of axis_size={lead} (make it take any number: x.reshape(-1, ...), no "
    "axis_size)"
)
_PYTHON_INT = (  # TypeError: '_DimExpr' object cannot be interpreted as an integer
    ", reading a dimension as a Python int (range(x.shape[0]) or range(len(x)) loops over its "
    "rows: loop with jax.vmap or lax.map instead); if its rows are another axis (jax.vmap(f, "
    "in_axes=1)), say which in shapes=, e.g. shapes=({spec!r},)"
)
_ENSEMBLE = (
    "Every param's leading dimension is the example's {lead} rows ({path}: {shape}): a model "
    "that maps its inputs' leading axis over its params' (an ensemble's members: eqx.filter_vmap "
    "of a stacked model, linen's nn.vmap with variable_axes={{'params': 0}}) takes that many "
    "rows, one per member, and no batch. Pass batch=None to export the example's static shapes."
)
_MIXED_BATCH = (
    "export({name}, batch={batch!r}): the example's inputs have leading dimensions {rows}; "
    "those unlike args[0]'s {lead} rows are taken as shared by every row (not batched), and "
    "then the trace fails ({error}). Give every batched input the same number of rows in "
    "example=, or pass shapes= to say which dimensions are the batch."
)
_RAW_KEY = (
    " args[0], a uint32[2], reads as a raw jax.random.PRNGKey (hk.transform's apply takes its "
    "rng there): one key for every row, not a batch of 2. Pass shapes={fix!r}, which keeps it "
    "whole and batches the rest."
)
_SHAPES_FAIL = (
    "export({name}, shapes=...): with the dimensions shapes= makes symbolic ({types}) the trace "
    "fails ({error}), while the example's own shapes trace"
)
_SHAPES = (
    ": the model takes one of them as a Python number (float(n), range(n), a size it caches "
    "by). Keep only the batch symbolic, e.g. shapes={fix}, or pass batch=None to export the "
    "example's static shapes."
)
_BOUNDED = (
    ": the model slices an array of a fixed size by it ({expr} in its shapes: {name} rows of a "
    "buffer {n} long, as a causal mask of n positions). Bound it: constraints={constraints} "
    "keeps {name} symbolic up to {n}."
)
_INCONCLUSIVE = (
    ": the model compares sizes that jax.export cannot decide for every size (a branch, a "
    "slice's bound, max or min of sizes). If it holds for every size you will call it with, "
    "say so, and the artifact checks it on each call: export(..., constraints={constraints!r}). "
    "Else compute the size with jax.export's dimension arithmetic (jax.core.max_dim, not "
    "max).{keep}"
)
_UNSOLVABLE = (
    "export({name}, shapes=...): a call gives each dimension variable by an input's "
    "size, and jax.export can only solve it from a dimension linear in that variable alone "
    "(b, 2*b, b + 15), not from {dims} ({error}). Name a variable for that size (shapes='n' "
    "for a*a) and take what the model needs from it."
)
_NO_BATCH = (
    "an input has no batch dimension (a mask or weights shared by every row, a raw "
    "jax.random.PRNGKey's uint32[2]), give it None in shapes=, e.g. shapes=({specs})"
)


def trace_batch(jitted: Any, p_structs: Any, stage: Any) -> tuple[Any, list[Any]]:
    """The (closed) jaxpr of ``stage``'s program (an ``_export_entry.Stage``) and its inputs'
    structs; a refusal names the fixes."""
    examples, batch = stage.examples, stage.batch
    symbolic = bool(batch) and not stage.per_input_shapes
    lead = examples[0].shape[:1] if examples else ()
    shared = [symbolic and x.shape[:1] != lead for x in examples]
    specs = [x if s else b for x, b, s in zip(examples, stage.in_specs, shared, strict=True)]
    try:
        return jitted.trace(p_structs, *specs).jaxpr, specs
    except (TypeError, ValueError, AssertionError, jax.errors.InconclusiveDimensionOperation) as e:
        # (an AssertionError: the model's own assert x.shape == (3, 2), as aot.md's g)
        shapes = stage.per_input_shapes  # the caller's symbolic dimensions
        if isinstance(e, (SymjaxError, *TRACER_ERRORS)) or not (symbolic or shapes):
            raise
        if isinstance(e, jax.errors.InconclusiveDimensionOperation) and not shapes:
            raise  # export names the batch
        error = e
    first = first_line(error)
    types = [TensorSpec(f"args[{i}]", shape_dims(x.shape), str(x.dtype)).type
             for i, x in enumerate(stage.in_specs)]  # fmt: skip
    if stage.per_input_shapes:  # (s > 6 inconclusive, or float(s))
        if not _traces(jitted, p_structs, examples):
            raise error  # not the shapes' doing: the model's own error
        head = _SHAPES_FAIL.format(name=stage.h.name, types=", ".join(types), error=first)
        fix = tuple(_batch_only(s, x) for s, x in zip(stage.in_specs, examples, strict=True))
        more = any(not isinstance(d, int) for x in stage.in_specs for d in x.shape[1:])
        if (compared := _compared(error)) is not None:  # as shape_poly.md adds it
            keep = (f" Keep only the batch symbolic, e.g. shapes={fix}, or pass batch=None to "
                    "export the example's static shapes.") if more else ""  # fmt: skip
            constraints = (*stage.constraints, compared)
            raise SignatureError(
                head + _INCONCLUSIVE.format(constraints=constraints, keep=keep)
            ) from None
        if more and (bound := _bounded(first)) is not None:  # x[:t] of a buffer: min(32, t)
            expr, name, n = bound
            constraints = (*stage.constraints, f"{name} <= {n}")
            said = _BOUNDED.format(expr=expr, name=name, n=n, constraints=constraints)
            raise SignatureError(head + said) from None
        if more:
            raise SignatureError(head + _SHAPES.format(fix=fix)) from None
        # only the batch symbolic: the model fixes its rows (it named this very shapes= as the fix)
        why = _ensemble(p_structs, lead) or _fixed(lead, examples, first)
        raise SignatureError(f"{head}. {why}") from None
    if any(shared):  # e.g. x (4, 3) and w (3,): w is no batch of 4 rows
        rows = {f"args[{i}]": x.shape[0] if x.shape else None for i, x in enumerate(examples)}
        said = _MIXED_BATCH.format(name=stage.h.name, batch=batch, rows=rows, lead=lead[0],
                                   error=first)  # fmt: skip
        if examples[0].shape == (2,) and str(examples[0].dtype) == "uint32":  # hk.transform's rng
            fix = (None, *(f"{batch}, ..." if x.shape else None for x in examples[1:]))
            said += _RAW_KEY.format(fix=fix)
        raise SignatureError(said) from None
    rows = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in examples]  # one example
    static, one = _traces(jitted, p_structs, examples), _traces(jitted, p_structs, rows)
    if not (static or one):
        raise error  # not the batch's doing: the model's own error
    head = _FAILS.format(
        name=stage.h.name, batch=batch, types=", ".join(types), error=first,
        traced="the example's own shapes trace" if static else "one row of it traces",
    )  # fmt: skip
    if static and (ensemble := _ensemble(p_structs, lead)) is not None:
        raise SignatureError(head + ensemble)
    spec = f"{batch}, {', '.join(map(str, examples[0].shape[1:]))}".strip(", ")
    specs = ", ".join([repr(spec)] + ["None"] * (len(examples) - 1))
    no_batch = "" if len(examples) < 2 else _NO_BATCH.format(specs=specs)
    if static and not one:  # (a key's data of 2 rows as the batch's: one row of it is no key)
        also = f" If {no_batch}." if no_batch else ""
        raise SignatureError(head + _fixed(lead, examples, first, batch) + also) from None
    raise SignatureError(
        head + _ONE_EXAMPLE.format(
            static=", or pass batch=None for the example's static shapes" if static else "",
            shared=f"; if {no_batch}" if no_batch else "",
        )
    ) from None  # fmt: skip


def _bounded(said: str) -> tuple[str, str, int] | None:
    """``min(32, t)`` in an error (a slice of a 32-long buffer by ``t``): it, ``t`` and 32."""
    found = re.search(r"min\((\d+), ([A-Za-z_]\w*)\)|min\(([A-Za-z_]\w*), (\d+)\)", said)
    if found is None:
        return None
    n, name = (found[1], found[2]) if found[1] else (found[4], found[3])
    return found[0], name, int(n)


def _compared(error: Exception) -> str | None:
    """The comparison jax.export found inconclusive, as a constraint (``"b >= mod(b, 3)"``)."""
    if not isinstance(error, jax.errors.InconclusiveDimensionOperation):
        return None
    said = re.search(r"comparison '([^']+)' (>=|<=|==|>|<) '([^']+)' is inconclusive", str(error))
    return None if said is None else " ".join(said.groups())


def unsolvable(name: str, error: Exception) -> SignatureError | None:
    """The refusal of ``shapes=`` whose dimension variables no input's size gives (``a*a``),
    where ``error`` (jax.export's ValueError) says so; else ``None``."""
    said = message(error)
    if not said.startswith("Cannot solve for values of dimension variables"):
        return None
    dims = re.findall(r"'([^']+)' for dimension size", said) or ["its dimensions"]
    first = said.split(". ")[0]
    return SignatureError(_UNSOLVABLE.format(name=name, dims=", ".join(dims), error=first))


def _fixed(lead: tuple[int, ...], examples: Sequence[Any], error: str, batch: str = "b") -> str:
    """:data:`_FIXED`, its cause a Python int read off the batch where ``error`` says so."""
    how = _RESHAPE.format(lead=lead[0])
    if "interpreted as an integer" in error and len(examples[0].shape) > 1:
        dims = [str(lead[0]), batch, *map(str, examples[0].shape[2:])]
        how = _PYTHON_INT.format(spec=", ".join(dims))
    return _FIXED.format(lead=lead[0], how=how)


#: what maps a program onto a mesh: a shard_map (by hand), a with_sharding_constraint (XLA's
#: partitioner, as jax.jit runs a model of arrays split over a mesh)
_ON_A_MESH = ("shard_map", "sharding_constraint")


def trace_placed(jitted: Any, p_structs: Any, stage: Any) -> tuple[Any, list[Any], Any, Any]:
    """:func:`trace_batch`'s jaxpr and inputs, the params' structs and where to stage them
    (a context manager's factory): with the shardings of arrays split over a mesh where the
    program runs on a mesh (a shard_map: each device takes its shard, FSDP's params; a
    with_sharding_constraint: model parallelism as jax.jit runs it), else as one device's
    program, as it was (its artifact loads on one device; a trace that fails with them fails
    here as it did), outside a ``jax.set_mesh`` of Explicit axes where it traces there (on
    that mesh its avals carry the mesh, and JAX builds no VJP of it: 'Length of device
    assignment 1 is not equal to the size of the mesh 8')."""
    if stage.placed or any(s.sharding is not None for s in stage.in_specs):
        try:
            jaxpr, specs = trace_batch(jitted, p_structs, stage)
            if _on_a_mesh(jaxpr):
                return jaxpr, specs, p_structs, contextlib.nullcontext
        except Exception:  # (a mesh of Explicit axes refuses some models' sharded trace)
            pass
    bare = {p: _bare(s) for p, s in p_structs.items()}
    stage = dataclasses.replace(stage, in_specs=[*map(_bare, stage.in_specs)],
                                examples=tuple(map(_bare, stage.examples)))  # fmt: skip
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types:
        off = functools.partial(jax.set_mesh, None)
        try:  # (a model of the mesh's names, a reshard to P('X'), a shard_map: staged there)
            with off():
                jaxpr, specs = trace_batch(jitted, bare, stage)
            if not _on_a_mesh(jaxpr):
                return jaxpr, specs, bare, off
        except Exception:
            pass
    jaxpr, specs = trace_batch(jitted, bare, stage)
    if axes := sorted({a for e, _ in walk(jaxpr) for a in _pending(e)}):
        raise ConfigError(_UNSPLIT.format(name=stage.h.name, axes=", ".join(axes)))
    return jaxpr, specs, bare, contextlib.nullcontext


def _on_a_mesh(jaxpr: Any) -> bool:
    """Whether the program needs its mesh: a shard_map or sharding constraint, or a value
    reduced or unreduced over a mesh axis (sharding-ad.md's ``reshard(w, P(reduced={'X'}))``:
    off its mesh, or with its inputs unsplit, JAX builds no VJP of it)."""
    return any(e.primitive.name in _ON_A_MESH or _pending(e) for e, _ in walk(jaxpr))


def _pending(eqn: Any) -> set[str]:
    """The mesh axes ``eqn``'s outputs are reduced or unreduced over."""
    specs = [getattr(getattr(v.aval, "sharding", None), "spec", None) for v in eqn.outvars]
    return {a for s in specs for a in (*getattr(s, "reduced", ()), *getattr(s, "unreduced", ()))}


_UNSPLIT = (
    "export({name}): the function reduces over the mesh's axes {axes} (a value reduced or "
    "unreduced there, as sharding-ad.md's jax.reshard(w, P(reduced={{'X'}}))), and JAX stages "
    "it only with the inputs split over that mesh, which it does for static shapes only (it "
    "splits no symbolic batch; unsplit, its VJP and shape checks fail). Export with "
    "batch=None and the example split over the mesh (jax.device_put(x, P('X', ...))), or "
    "replicate w instead (P(): the same values and grads)."
)


def split_over_mesh(x: Any) -> Any:
    """The sharding of a jax.Array split over a mesh's devices, else ``None`` (replicated, or
    on one device)."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):  # (export under a jit:
        return None  # refused later, by the tracer's conversion to NumPy, as it was)
    return None if x.sharding.is_fully_replicated else x.sharding


def placed_struct(shape: Any, x: Any, sharded: bool) -> jax.ShapeDtypeStruct:
    """``x``'s struct at ``shape``, with its sharding where it is split over a mesh and the
    shape static (JAX splits no symbolic dimension: 'does not evenly divide ... b'), and its
    weak type (:func:`weakly_typed`) where it is a scalar: the artifact records it, and its self
    test passes one as a Python number (an array traces strong, as ``h(np.asarray(x))`` does;
    where a weak one is answered otherwise, the artifact refuses it: :func:`weak_matters`)."""
    split = sharded and all(isinstance(d, int) for d in shape)
    sharding = split_over_mesh(x) if split else None
    weak = weakly_typed(x) and not shape
    return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding, weak_type=weak)


def weak_typed(signature: Any, fn: Any, params: Any, examples: Sequence[Any]) -> Any:
    """``signature`` with a scalar input weakly typed where it was and that matters, and
    ``strong`` the strongly typed ones where it matters (:func:`weak_matters`), arrays too; any
    other input takes both kinds alike (2.0 and np.float32(2.0)), as the model answers them.
    ``fn`` is traced again for each (its Python may pick a dtype from an input's kind alone,
    ``jnp.result_type(x, jnp.bfloat16)``, which no dtype of export's program shows)."""
    own = [o.dtype for o in signature.outputs]
    matters = weak_matters(fn, params, examples, own)
    ins = tuple(
        dataclasses.replace(s, weak_type=s.weak_type and s.path in matters)
        for s in signature.inputs
    )
    strong = tuple(s.path for s in ins if s.path in matters and not s.weak_type)
    return dataclasses.replace(signature, inputs=ins, strong=strong)


def weak_matters(fn: Any, params: Any, examples: Sequence[Any], own: Any) -> tuple[str, ...]:
    """The inputs (``args[i]``) whose weak type changes the dtypes ``fn(params, *examples)``
    answers in, ``own`` (a bfloat16 model times np.float32(2) answers float32, times 2.0 or a
    weak jnp.full(s, 2.0) bfloat16), or that it refuses: where the artifact takes only what it
    was exported at."""
    numbers = ((jax.numpy.complexfloating, 0j), (jax.numpy.floating, 0.0), (jax.numpy.integer, 0))

    def dtypes(xs: Sequence[Any]) -> list[str]:  # as a multiset: the order leaves come in
        return sorted(str(a.dtype) for a in jax.tree.leaves(jax.eval_shape(fn, params, *xs)))

    found, own = [], sorted(map(str, own))  # the export's own: one trace less
    for i, x in enumerate(examples):
        kind = next((n for t, n in numbers if jax.numpy.issubdtype(x.dtype, t)), None)
        if kind is None or (x.shape and x.dtype != jax.numpy.result_type(kind)):
            continue  # a weak array is of the default dtype (jnp.full(s, 2.0)'s float32)
        flip = jax.numpy.result_type(kind) if not x.weak_type else x.dtype  # (a Python number)
        flip = jax.ShapeDtypeStruct(x.shape, flip, weak_type=not x.weak_type)
        try:
            if dtypes([*examples[:i], flip, *examples[i + 1 :]]) != own:
                found.append(f"args[{i}]")
        except SignatureError:  # it refuses the other kind (a loaded model's m.apply): so does
            found.append(f"args[{i}]")  # its export, else answering it in the example's dtypes
        except Exception:  # the model takes no other there: nothing to refuse
            continue
    return tuple(found)


def _bare(s: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=s.weak_type)


def _ensemble(p_structs: Any, lead: tuple[int, ...]) -> str | None:
    """Why a model whose every param leads with the example's rows takes no batch, or ``None``."""
    if (member := ensemble_member({p: s.shape for p, s in p_structs.items()}, lead)) is None:
        return None
    return _ENSEMBLE.format(lead=lead[0], path=member[0], shape=member[1])


def _batch_only(spec: Any, example: Any) -> str | None:
    """``spec``'s shape with only its leading dimension symbolic, as shapes= writes it."""
    if not spec.shape or isinstance(spec.shape[0], int):
        return None  # no batch: shared by every row
    return ", ".join(map(str, (spec.shape[0], *example.shape[1:])))


def _traces(jitted: Any, p_structs: Any, inputs: Sequence[Any]) -> bool:
    try:
        jitted.trace(p_structs, *inputs)
    except Exception:
        return False
    return True
