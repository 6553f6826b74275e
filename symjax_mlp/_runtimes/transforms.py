"""The exported program under JAX's transforms (:class:`Program`), and the module the guard
checks for a call (:func:`refined`).

``Exported.call`` has no batching rule; ``custom_vmap`` gives it one. Where export recorded that
rows stay apart (``rows``, checked against the module at load) and every mapped input has the
batch dimension, the mapped axis merges into it (``(n, b, ...)`` to ``(n * b, ...)``) and the
program runs once; anywhere else once per example (``jax.lax.map``), vmap's own meaning. A
``custom_vjp`` runs the artifact's VJP module for ``jax.grad``, checked first; forward mode is
refused as it traces, else where JAX refuses it (:func:`refusing_forward`); a VJP module's call
(linear in its cotangents) transposes by the next order's (:func:`transposing`). Inside
``jax.shard_map`` its outputs vary along the mesh axes its inputs vary along (:func:`varying`),
and a cotangent is summed over the devices where its input is the same on each (:func:`summed`).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.custom_batching import custom_vmap
from jax.interpreters.ad import JVPTracer

from symjax_mlp._artifact.format import JAXEXPORT, caller, program_file
from symjax_mlp._artifact.reading import check_x64
from symjax_mlp._artifact.signature import Signature, admits
from symjax_mlp._compat import add_transpose, backward_rule, linearizing, transpose_rule
from symjax_mlp._errors import ArtifactError, ConfigError
from symjax_mlp._selftest import refine_shapes


def refined(
    path: Path, manifest: Mapping[str, Any], fn: Any, args: Sequence[Any], *,
    module: str = "the module", custom_calls: Any = None,
) -> Any:  # fmt: skip
    """The StableHLO of ``jax.jit(fn)(*args)``, every shape refined to ``args``', and its MLIR
    context; ``module`` names what ``fn`` calls, for messages."""
    from jax.interpreters import mlir as jax_mlir

    shapes = [tuple(a.shape) for a in args if not isinstance(a, Mapping)]  # not the params
    try:
        refined_bytes = refine_shapes(fn, args, custom_calls)
    except Exception as e:  # MLIR raises plain exceptions; jax.export ValueErrors
        check_x64(path, manifest, loaded=True)  # another thread's x64: not the artifact's fault
        raise _unresolved(path / program_file(manifest, JAXEXPORT), module, shapes, e) from None
    context = jax_mlir.make_ir_context()
    with context:
        return jax_mlir.ir.Module.parse(refined_bytes), context


def _unresolved(file: Path, module: str, shapes: list, e: Exception) -> ArtifactError:
    """Why refinement refused ``shapes``: JAX's reason (a constraint the manifest lost, which
    load did not find in the program), the source locations MLIR adds, lines of ours, dropped."""
    said = re.sub(r"(\S+\.py:\d+:\d+: (error|note): )|Module shape refinement failed: ", "", str(e))
    return ArtifactError(
        f"{file}: the shapes of {module} cannot be resolved for inputs {shapes} "
        f"({type(e).__name__}: {said.splitlines()[0][:300]}). Export the model again; an "
        "artifact you did not export was made otherwise than export writes one: do not run it."
    )


_NO_VJP = (
    "{caller}: jax.grad of the loaded model runs the artifact's VJP module of order {order}, "
    "and it was exported without one (vjp_order={have}). Export it again with "
    "vjp_order={order}: sm.export(h, path, example=x, vjp_order={order}).{loop}"
)
_LOOP = (  # needs "while": a loop JAX may not reverse-differentiate (export then refuses it)
    " Its program holds a while loop (a lax.while_loop, or a fori_loop with traced bounds), and "
    "JAX cannot reverse-differentiate one that carries what jax.grad differentiates: that export "
    "then refuses it, naming the loop. Make it a lax.scan (or a fori_loop with static bounds) "
    "first."
)


_FORWARD = (
    "{caller}: jax.jvp, jax.jacfwd, jax.hessian and jax.linearize differentiate forward, and "
    "a loaded model differentiates in reverse mode only: jax.export serializes VJP modules, and "
    "this artifact holds {held}, so jax.grad, jax.vjp and jax.jacrev work up to that order. Use "
    "jax.jacrev (a Hessian is jax.jacrev(jax.jacrev(f))){again}."
)
_AGAIN = (
    ", or export again from the model's source with the order a Hessian needs: "
    "sm.export(h, path, example=x, vjp_order=2)"
)


def forward_mode(caller: str, vjp_order: int) -> str:
    """The message refusing forward-mode differentiation of a loaded model."""
    held = (
        f"them up to order {vjp_order}" if vjp_order else "none (it was exported with vjp_order=0)"
    )
    return _FORWARD.format(caller=caller, held=held, again=_AGAIN if vjp_order < 2 else "")


_TRANSPOSE = (
    "{caller}: jax.linear_transpose of the loaded model's VJP of order {order} (jaxopt's "
    "default implicit differentiation, solve_normal_cg, transposes one) runs its VJP module of "
    "order {next}, and the artifact holds them up to order {have}. Export it again with "
    "vjp_order={next}: sm.export(h, path, example=x, vjp_order={next}), or solve without a "
    "transpose where the system is symmetric (a Hessian: jaxopt's optimality of a loss's "
    "gradient): implicit_diff_solve=jaxopt.linear_solve.solve_cg."
)


_NO_RULE = "Transpose rule (for reverse-mode differentiation) for 'custom_vjp_call' not implemented"


@functools.cache
def transposing() -> None:
    """Gives ``custom_vjp_call`` a transpose rule where the custom_vjp is a loaded model's
    (:meth:`Program.transposed`); another keeps JAX's NotImplementedError. Where JAX has a rule
    of its own (a later JAX), it is kept: :func:`~symjax_mlp._compat.add_transpose`."""
    from jax.extend.core.primitives import custom_vjp_call_p
    from jax.interpreters import ad

    def transpose(cts: Any, *args: Any, bwd: Any, num_consts: int, **params: Any) -> Any:
        found, used = transpose_rule(bwd)
        rule = getattr(found, "transpose", None)
        if rule is None or any(ad.is_undefined_primal(a) for a in args[:num_consts]):
            raise NotImplementedError(_NO_RULE)  # JAX's own words where it has no rule
        return [None] * num_consts + rule(cts, used, *args[num_consts:])

    add_transpose(custom_vjp_call_p, transpose)


@functools.cache
def refusing_forward() -> None:
    """Has JAX raise a loaded model's refusal (its backward rule's ``forward_error``) where it
    refuses forward mode of a custom_vjp, as it runs, batches or lowers its linearized call:
    the check in ``forward`` runs once per trace, and JAX reuses one a jax.grad made. Another
    custom_vjp gets JAX's TypeError: :func:`~symjax_mlp._compat.wrap_refusal`."""
    from jax.extend.core.primitives import custom_lin_p

    from symjax_mlp._compat import wrap_refusal

    wrap_refusal(
        custom_lin_p, lambda params: getattr(backward_rule(params["bwd"]), "forward_error", None)
    )


def forward_traced(xs: Sequence[Any] | None = None) -> bool:
    """Whether jax.jvp (jacfwd, hessian) or jax.linearize traces the arrays ``xs`` (``None``:
    the call), under any other tracer; a jax.vjp does where jax.jvp traces its primals
    (jax.hessian of jax.jit(f)), else the caller outside it says."""
    verdict = None if xs is None else _traced(xs)
    if verdict is not None:  # concrete inputs, on every call: no frame walk
        return verdict
    for outer in linearizing():
        verdict = outer if isinstance(outer, bool) else _traced(jax.tree.leaves(outer))
        if verdict is not None:
            return verdict
    return False


def _traced(xs: Sequence[Any]) -> bool | None:
    """Whether jax.jvp traces one of ``xs`` (``None``: linearize's or vjp's tangents only)."""
    found = False
    for x in xs:  # arrays, on every call: no config read
        while isinstance(x, Tracer):
            if isinstance(x, JVPTracer):  # without direct linearize jax.grad makes them too
                return bool(jax.config.jax_use_direct_linearize)
            found = found or hasattr(x, "tangent")  # jax.linearize's or jax.vjp's
            x = getattr(x, "primal", getattr(x, "val", None))  # linearize's, vmap's
    return None if found else False


class Program:
    """``fn(weights, *inputs)``, the program as the module says, and ``call``, its one jit."""

    def __init__(self, path: Path, manifest: Mapping[str, Any], exported: Any, guard: Any):
        self.path, self.manifest, self.guard = path, manifest, guard
        self.caller = caller(path, manifest)
        self.signature = Signature.from_json(manifest["signature"])
        self.fn = self.wrap(exported)
        self.call = jax.jit(self.fn)

    def check(self, fn: Any, args: Sequence[Any], n: int | None = None, order: int = 0) -> bool:
        """Has the guard check ``fn``'s module refined for ``args`` (weights: a dict; ``n``:
        the input element count); ``False`` if trusted or traced symbolically (checked later)."""
        shapes = tuple((tuple(x.shape), str(x.dtype)) for x in args if not isinstance(x, Mapping))
        if self.guard is None or not all(isinstance(d, int) for s, _ in shapes for d in s):
            return False
        structs = [  # the weights as they are, unless traced
            x if isinstance(x, Mapping) and not any(isinstance(v, Tracer) for v in x.values())
            else jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), x)
            for x in args
        ]  # fmt: skip
        what = f"its VJP module of order {order}" if order else "the module"
        n = sum(math.prod(s) for s, _ in shapes) if n is None else n
        refine = functools.partial(refined, self.path, self.manifest, fn, structs, module=what)
        self.guard(refine, n, shapes, order=order)
        return True

    def wrap(
        self, module: Any, order: int = 0, n: int | None = None, linear_from: int = 0
    ) -> Callable[..., Any]:
        """``module.call`` (the program, or its VJP module of ``order``, linear in its inputs
        from ``linear_from`` on: the cotangents) as the class says."""

        def run(*args: Any) -> Any:  # varying along the mesh axes of its inputs
            return varying(module.call(*args), varies(args))

        batched, vjp_order = custom_vmap(run), self.manifest.get("vjp_order", 0)
        batched.def_vmap(self.merge if order == 0 else functools.partial(_one_by_one, batched))

        @jax.custom_vjp
        def call(*args: Any) -> Any:
            return batched(*args)

        def forward(*args: Any) -> tuple[Any, Any]:  # call, not batched: jax.grad of jax.grad
            # jax.linearize(jax.jit(m)): jit traced m before linearize (no input showed it);
            # refused here, not as its linear function runs (refusing_forward, after a grad)
            if forward_traced():
                raise ConfigError(forward_mode(self.caller, vjp_order))
            return call(*args), args

        def backward(args: Any, cts: Any) -> Any:
            if not module.has_vjp():
                have, loop = self.manifest.get("vjp_order", 0), self.manifest.get("needs", ())
                loop = _LOOP if "while" in loop else ""
                said = _NO_VJP.format(caller=self.caller, order=order + 1, have=have, loop=loop)
                raise ConfigError(said)
            vjp = module.vjp()
            primals, cts = jax.tree.leaves(args), jax.tree.leaves(cts)
            expected = vjp.in_avals[len(primals) :]
            if len(expected) != len(cts):
                raise ArtifactError(
                    f"{self.path / program_file(self.manifest, JAXEXPORT)}: its VJP module of "
                    f"order {order + 1} takes {len(vjp.in_avals)} inputs, not the "
                    f"{len(primals)} primals and {len(cts)} cotangents jax.grad passes it. It "
                    "was edited; export it again."
                )
            cts = [  # float0 where the module expects it (integer outputs), as jax.export does
                np.zeros(c.shape, jax.dtypes.float0) if a.dtype == jax.dtypes.float0 else c
                for c, a in zip(cts, expected, strict=True)
            ]
            vjp_args = [*primals, *cts]
            m = sum(math.prod(x.shape) for x in jax.tree.leaves(args[1:])) if n is None else n
            self.check(vjp.call, vjp_args, m, order + 1)
            out = self.wrap(vjp, order + 1, m, len(primals))(*vjp_args)
            out = jax.tree.unflatten(jax.tree.structure(args), jax.tree.leaves(out))
            return jax.tree.map(summed, out, tuple(args))

        call.defvjp(forward, backward)
        refused = functools.partial(ConfigError, forward_mode(self.caller, vjp_order))
        backward.forward_error = refused  # type: ignore[attr-defined]
        if order:  # a VJP module (linear in its cotangents); the program has no transpose
            backward.transpose = functools.partial(  # type: ignore[attr-defined]
                self.transposed, call, order, linear_from
            )
        refusing_forward()
        transposing()
        return call

    def transposed(
        self, call: Any, order: int, linear_from: int, cts: Any, used: Any, *args: Any
    ) -> Any:
        """``call``'s transpose rule: ``call`` (the VJP module of ``order``) is linear in its
        inputs from ``linear_from`` on, and their cotangents for ``cts`` (of the outputs
        ``used``; ``None``: all) are the ones the VJP module of ``order + 1`` gives (at 0)."""
        from jax.interpreters import ad

        undefined = [ad.is_undefined_primal(a) for a in args]
        have = self.manifest.get("vjp_order", 0)
        if any(undefined[:linear_from]):  # a primal, in which it is not linear: JAX's words
            raise NotImplementedError(_NO_RULE)
        if order + 1 > have:
            said = _TRANSPOSE.format(caller=self.caller, order=order, next=order + 1, have=have)
            raise ConfigError(said)
        fixed = [jnp.zeros(a.aval.shape, a.aval.dtype) if u else a
                 for a, u in zip(args, undefined, strict=True)]  # fmt: skip
        linear = lambda *c: jax.tree.leaves(call(*fixed[:linear_from], *c))  # noqa: E731
        outs, pull = jax.vjp(linear, *fixed[linear_from:])
        given = iter(cts)
        cts = [ad.instantiate_zeros(next(given)) if used is None or kept else jnp.zeros_like(y)
               for y, kept in zip(outs, used or outs, strict=True)]  # fmt: skip
        out = pull(cts)
        tail = [c if u else None for c, u in zip(out, undefined[linear_from:], strict=True)]
        return [None] * linear_from + tail

    def checked(self, *args: Any) -> Any:
        """``call(*args)`` once the guard has checked the module for ``args``' shapes."""
        self.check(self.call, args)
        return self.call(*args)

    def merge(self, size: int, mapped: list[Any], weights: Any, *inputs: Any) -> Any:
        """The program's ``jax.vmap`` rule: ``size`` rows of each input joined to its batch."""
        rows, sig = self.manifest.get("rows") or {}, self.manifest["signature"]
        ins, outs = (axes(sig[k], rows.get("dim")) for k in ("inputs", "outputs"))
        lone = [on and k is None for k, on in zip(ins, mapped[1:], strict=True)]
        apart = rows.get("independent") and not any(lone)  # and each mapped input has rows
        apart = apart and not any(jax.tree.leaves(mapped[0]))  # one program: one set of weights
        if apart:  # and the merged batch is one the program takes (b <= 3: not 4 rows of 2)
            n = next(x.shape[k + on] for k, x, on in zip(ins, inputs, mapped[1:], strict=True)
                     if k is not None)  # fmt: skip
            apart = size == 0 or admits(self.signature, {rows["dim"]: size * n})
        if not apart:  # vmap's meaning without merging: one call per example
            return _one_by_one(self.checked, size, mapped, weights, *inputs)
        if size == 0:  # no example: what one gives, less it (a batch of 0 the module refuses)

            def one(x: Any, on: bool) -> Any:
                return jnp.zeros((1, *x.shape[1:]), x.dtype) if on else x

            out, batched = self.merge(1, mapped, *jax.tree.map(one, [weights, *inputs], mapped))
            return jax.tree.map(lambda y, on: y[:0] if on else y, out, batched), batched
        merged = []
        for k, x, on in zip(ins, inputs, mapped[1:], strict=True):
            if k is not None:  # (size, ..., b, ...) -> (..., size * b, ...)
                x = jnp.moveaxis(x if on else jnp.broadcast_to(x, (size, *x.shape)), 0, k)
                x = x.reshape(*x.shape[:k], -1, *x.shape[k + 2 :])
            merged.append(x)
        self.check(self.call, (weights, *merged))
        out, split, single = self.call(weights, *merged), [], sig["output_kind"] == "array"
        for k, y in zip(outs, [out] if single else out, strict=True):
            y = y if k is None else y.reshape(*y.shape[:k], size, -1, *y.shape[k + 1 :])
            split.append(y if k is None else jnp.moveaxis(y, k, 0))
        batched = [k is not None for k in outs]
        return (split[0], batched[0]) if single else (tuple(split), tuple(batched))


def varies(xs: Any) -> frozenset[str]:
    """The mesh axes along which one of ``xs`` varies inside ``jax.shard_map`` (none outside)."""
    axes: set[str] = set()
    for x in jax.tree.leaves(xs):
        axes.update(getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", ()))
    return frozenset(axes)


def varying(ys: Any, axes: frozenset[str]) -> Any:
    """``ys`` typed as varying along ``axes``: ``Exported.call`` types its outputs as the same
    on every device, and ``jax.shard_map`` then took one device's output for all of them
    (``out_specs=P()``) where the model's own outputs are refused, and jax.grad failed."""

    def one(y: Any) -> Any:
        missing = tuple(sorted(axes - varies(y)))
        return jax.lax.pcast(y, missing, to="varying") if missing else y

    return jax.tree.map(one, ys) if axes else ys


def summed(ct: Any, primal: Any) -> Any:
    """``ct``, the cotangent of ``primal`` from every device, summed along the mesh axes along
    which it varies and ``primal`` does not (the transpose of using one value on each)."""
    extra = tuple(sorted(varies(ct) - varies(primal)))
    return jax.lax.psum(ct, extra) if extra and ct.dtype != jax.dtypes.float0 else ct


def axes(specs: Any, dim: str | None) -> list[int | None]:
    """Each spec's axis of the batch dimension ``dim`` (``None``: it has none)."""
    return [s["shape"].index(dim) if dim in s["shape"] else None for s in specs]


def _one_by_one(fn: Callable[..., Any], size: int, mapped: list[Any], *args: Any) -> Any:
    """A ``jax.vmap`` rule that runs ``fn`` once per mapped element (``jax.lax.map``)."""
    leaves, tree = jax.tree.flatten(list(args))
    on = tree.flatten_up_to(list(mapped))

    def one(xs: list[Any]) -> Any:
        it = iter(xs)
        return fn(*tree.unflatten([next(it) if o else a for a, o in zip(leaves, on, strict=True)]))

    out = jax.lax.map(one, [a for a, o in zip(leaves, on, strict=True) if o])
    return out, jax.tree.map(lambda _: True, out)
