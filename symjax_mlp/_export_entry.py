"""One entry point of an export: a :class:`~symjax_mlp.Hybrid` staged for ``jax.export``. With
``batch="b"``, an input whose leading dimension differs from ``args[0]``'s is shared by every
row (static), never the batch (the artifact would refuse its example)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from symjax_mlp._artifact.rows import verdict
from symjax_mlp._artifact.signature import Signature
from symjax_mlp._artifact.weights import check_paths, param_specs
from symjax_mlp._compat import without_source_locations
from symjax_mlp._errors import ArtifactError, ConfigError, SignatureError, first_line
from symjax_mlp._export_batch import (
    placed_struct,
    split_over_mesh,
    trace_placed,
    unsolvable,
    weakly_typed,
)
from symjax_mlp._export_example import calls_back, unguaranteed
from symjax_mlp._hybrid.args import MODEL_ERRORS, not_data, partition, rebuild
from symjax_mlp._hybrid.hybrid import Hybrid
from symjax_mlp._hybrid.jaxpr import forwarded, input_dependent, walk
from symjax_mlp._hybrid.mesh import constrained
from symjax_mlp._hybrid.params import refuse_donated
from symjax_mlp._hybrid.pure import is_key
from symjax_mlp._hybrid.staged import refuse_trained_in_place
from symjax_mlp._hybrid.trace import TRACER_ERRORS, control_flow_error, unbindable
from symjax_mlp._specs import (
    TensorSpec,
    array_kwargs_error,
    input_structs,
    keyword_arrays,
    shape_dims,
    unserializable,
)

_TRAINING = (
    "export({name}): the nnx module is in training mode ({settings}, as built), which changes "
    "its program: the artifact would drop units with one fixed key and normalise each batch by "
    "its own statistics. Call module.eval() before export() (module.train() to train on)."
)
_FIXED_KEY = (
    "export({name}): the program draws random numbers from the rng stream{s} {streams} that "
    "{holder}, which an artifact can only bake in: every call would {same}. {mode}ake the key "
    "an input: export {fix} with example=({xs}, jax.random.key_data(key)) and shapes=({specs}, "
    "None) (the key is shared by every row){part}."
)
_LINEN_KEY = (
    "sm.hybridize(lambda params, {xs}, key: model.apply(params, {xs}{kw}, rngs={rngs}), variables)"
)
_PLAIN_KEY = "sm.hybridize(lambda params, {xs}, key: ..., params), drawing from {key}"
_NNX_KEY = (
    "sm.hybridize(lambda model, {xs}, key: (nnx.reseed(model, {rngs}), model({xs}{kw}))[1], model)"
)
_CARRIED = (
    "export({name}): each call writes the {what} that the next call reads, but an artifact "
    "carries no state between calls: it would bake that state in as it is now, and every call "
    "would start from there. {mode}xport one step as a function of that state, taking its "
    "arrays as inputs and returning (out, *the new ones){step}."
)
_LINEN_STEP = (
    ": with leaves, tree = jax.tree.flatten(variables[{c!r}]), export sm.hybridize(lambda p, "
    "x, *state: (lambda out, new: (out, *jax.tree.leaves(new)))(*model.apply({{'params': p, "
    "{c!r}: jax.tree.unflatten(tree, state)}}, x{kw}, mutable=[{c!r}])), variables['params']) "
    "with example=(x, *leaves) and batch=None"
)
_MODES = {"train": False, "training": False, "deterministic": True, "is_training": False}


@dataclasses.dataclass(frozen=True)
class Stage:
    """One entry point, ready to export: its Hybrid, settings, inputs and stored params."""

    h: Hybrid
    static: Any
    in_specs: list[jax.ShapeDtypeStruct]
    specs: list[TensorSpec]  # its params, sorted by path
    host_params: list[np.ndarray]
    fn: Callable[..., Any]  # fn(params by path, *inputs)
    batch: str | None
    per_input_shapes: bool
    constraints: tuple[str, ...]
    examples: tuple[jax.ShapeDtypeStruct, ...] = ()  # the example's own (static) shapes
    placed: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # params' shardings
    baked_keys: bool = False  # rng keys h holds, baked in as constants
    streams: tuple[str, ...] = ()  # the rng streams a call moves (split or counted)
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # settings given
    weak: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # params jit traces
    # weakly typed (a Python float), as h holds them


def stage(
    h: Hybrid, batch: str | None, *, example: Any, kwargs: Mapping[str, Any] | None,
    shapes: Sequence[str | None] | None, constraints: Sequence[str],
) -> Stage:  # fmt: skip
    """``h`` ready for ``jax.export``: checked, its inputs as structs, its params as stored."""
    refuse_trained_in_place(h, f"export({h.name})", "the artifact would hold")
    refuse_donated(f"export({h.name})", h.params)  # (a bare RuntimeError from JAX)
    given = tuple(example) if isinstance(example, (tuple, list)) else (example,)
    kw = dict(kwargs or {})
    static, examples, array_kwargs = partition(
        given, kw, h.static_argnums, h.static_argnames, caller=f"export({h.name})"
    )
    if array_kwargs:  # the example's settings by place too, by the names its places have
        params = list(getattr(h.__signature__, "parameters", {}).values())[: len(given)]
        kept = {params[k].name: v for k, v, _ in static if isinstance(k, int) and k < len(params)
                and params[k].kind is params[k].POSITIONAL_OR_KEYWORD}  # fmt: skip
        kept |= {k: v for k, v in kw.items() if k not in array_kwargs}
        raise SignatureError(array_kwargs_error(h.name, [*array_kwargs], len(examples), kept))
    names, placed = keyword_arrays(h.__signature__, len(examples), kw)  # more arrays than places
    if names:
        raise SignatureError(array_kwargs_error(h.name, names, placed, kw, h.__signature__))
    e_g = "" if (mode := _mode(h, kw)) is None else f", e.g. kwargs={mode}"
    fix = f"Pass its inputs as example= and its settings as kwargs={e_g}."
    args = rebuild(static, examples, {})[0]  # checked here: the trace's refusal names h's call
    if unbound := unbindable(f"export({h.name})", h, args, kw, skip=0, fix=fix):
        raise unbound
    if training := h.training_mode(*given, **kw):  # once they bind (else its trace refuses)
        raise ConfigError(_TRAINING.format(name=h.name, settings=", ".join(training)))
    if shapes is not None and len(shapes) == len(given) != len(examples):  # a spec per setting
        raise ConfigError(_setting_specs(h.name, tuple(shapes), given, static))
    placed = {k: v for k, v, _ in static if isinstance(k, int)}  # hk's None rng among them
    in_specs = input_structs(examples, batch, shapes, tuple(constraints), h.name, placed)
    stored, fn, baked = _exportable(h)
    streams = _moved(h, static, examples, kw)
    specs, host_params = param_specs(stored)  # as jax.export traces them
    # arrays split over a mesh, as a shard_map or jit takes them (see trace_placed); a sharded
    # Hybrid's (h.shard) own constraints place its inputs
    mine, leaves = h.mesh is None, jax.tree.leaves(stored)
    placed = {s.path: p for s, x in zip(specs, leaves, strict=True)
              if mine and (p := split_over_mesh(x)) is not None}  # fmt: skip
    in_specs = [placed_struct(s.shape, x, mine) for s, x in zip(in_specs, examples, strict=True)]
    weak = {s.path: x for s, x in zip(specs, leaves, strict=True) if weakly_typed(x)}
    treedef, paths = jax.tree.structure(stored), tuple(s.path for s in specs)
    fn = constrained(h.mesh, h.axis, fn) if h.mesh is not None else fn
    check_paths(f"export({h.name})", paths)

    def model(params: dict[str, jax.Array], *inputs: jax.Array) -> Any:
        args, kw = rebuild(static, inputs, {})
        return fn(jax.tree.unflatten(treedef, [params[p] for p in paths]), *args, **kw)

    # Stored sorted by path; the model rebuilds its tree in flatten order (paths), which
    # differs for lists of 11+ layers ('10' < '2') and keys below '/' ('proj-out' < 'proj/.').
    order = sorted(range(len(specs)), key=lambda i: specs[i].path)
    return Stage(h, static, in_specs, [specs[i] for i in order], [host_params[i] for i in order],
                 model, batch, shapes is not None, (*constraints,),
                 tuple(placed_struct(x.shape, x, mine) for x in examples),
                 placed, baked, streams, kw, weak)  # fmt: skip


_CLOSED_REF = (
    "export({name}): the function closes over a jax.Ref (jax.new_ref's mutable array), state "
    "that lives in this process, and an artifact carries none (jax.export fails on it: 'Too "
    "many leaves for PyTreeDef'). Pass its value in as an input or a param (ref[...]), or keep "
    "the Ref's update outside the exported function."
)


def export_program(
    stage: Stage, own: Mapping[str, tuple[TensorSpec, Any]], platforms: tuple[str, ...]
) -> tuple[Any, Signature, dict[str, Any], Any]:
    """``jax.export`` of one entry point (params by path), its signature, rows verdict and the
    closed jaxpr it traced (params, *inputs): the one trace of the model's Python it ran."""
    h = stage.h
    p_structs = {p: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=stage.placed.get(p),
                                         weak_type=p in stage.weak)
                 for p, (_, a) in sorted(own.items())}  # fmt: skip
    jitted, jaxpr = jax.jit(stage.fn), None
    try:
        with without_source_locations():  # reproducible bytes: no path of this machine inside
            jaxpr, in_specs, p_structs, where = trace_placed(jitted, p_structs, stage)
            outs = [v.aval for v in jaxpr.outvars]
            named = {f"args[{i}]": x for i, x in enumerate(in_specs)}
            named |= {"out" if len(outs) == 1 else f"out[{i}]": a for i, a in enumerate(outs)}
            if (odd := unserializable(h.name, named)) is not None:
                raise odd  # else jax's raw KeyError from serialize, or its lowering's error
            if any(isinstance(v.aval, jax.ref.AbstractRef) for v in jaxpr.constvars):
                raise ConfigError(_CLOSED_REF.format(name=h.name))  # jax.export's raw ValueError
            with where():  # where it traced (export reuses that trace)
                exported = jax.export.export(jitted, platforms=platforms)(p_structs, *in_specs)
    except TRACER_ERRORS as e:
        raise control_flow_error(h.name, e) from e
    except RuntimeError:  # e.g. std::bad_cast from a host callback's lowering
        eqns = [eqn for eqn, _ in walk(jaxpr)] if jaxpr is not None else []
        if (called := calls_back(h.name, eqns)) is None:
            raise
        raise called from None
    except jax.errors.InconclusiveDimensionOperation as e:
        raise SignatureError(
            f"export({h.name}, batch={stage.batch!r}): the function needs a concrete value of "
            f"the symbolic batch {stage.batch!r} ({first_line(e)}). Keep the batch "
            "symbolic (use x.shape[0] only inside jnp operations, reshape with -1), or export "
            "static shapes with batch=None."
        ) from e
    except MODEL_ERRORS as e:  # raised on an input no array (example=(x, "abc")): named as h's
        if (unsolved := unsolvable(h.name, e) or unguaranteed(h.name, e)) is not None:
            raise unsolved from None  # shapes=('a*a',): jax.export's raw ValueError
        given = rebuild(stage.static, stage.examples, {})  # the settings in their places
        if (named := not_data(f"export({h.name})", e, *given)) is None:
            raise
        raise named from None
    if stage.baked_keys and _draws_a_constant_key(jaxpr):
        raise ConfigError(_fixed_key(stage))
    out_kind, ins = _output_kind(exported, h), exported.in_avals[len(p_structs) :]
    outs = [_spec("out" if out_kind == "array" else f"out[{i}]", a)
            for i, a in enumerate(exported.out_avals)]  # fmt: skip
    args = [_spec(f"args[{i}]", a, a.weak_type) for i, a in enumerate(ins)]  # as jit traced
    batch = None if stage.per_input_shapes else stage.batch
    signature = Signature(tuple(args), tuple(outs), out_kind, batch, stage.constraints)
    names = [*p_structs, *(s.path for s in signature.inputs)]
    if len(set(names)) != len(names) or "platform_index" in names:
        raise ArtifactError(f"export({h.name}): param paths collide with input names: {names}")
    lead = signature.inputs[0].shape[:1] if signature.inputs else ()
    dim = signature.batch or next((d for d in lead if isinstance(d, str)), None)
    return exported, signature, verdict(exported, dim), jaxpr


def _moved(h: Hybrid, static: Any, examples: tuple, kw: Mapping[str, Any]) -> tuple[str, ...]:
    """The rng streams a call on ``examples`` moves; other state it reads and writes is refused
    (an artifact carries none) where the output reads it (a decode cache) or the inputs move
    it (batch statistics), not where it only counts calls."""
    if not h.stateful:
        return ()

    def step(params: Any, state: Any, *xs: Any) -> Any:
        args, kwargs = rebuild(static, xs, {})
        return h.fn_with_state(params, state, *args, **kwargs)

    try:
        closed, (out, new) = jax.make_jaxpr(step, return_shape=True)(h.params, h.state, *examples)
    except Exception:  # export's own trace then names what is wrong
        return ()
    jaxpr, flat = closed.jaxpr, jax.tree_util.tree_flatten_with_path(h.state)[0]
    paths, n, k = [_names(p) for p, _ in flat], len(jax.tree.leaves(h.params)), len(flat)
    ins = dict(zip(paths, jaxpr.invars[n : n + k], strict=True))
    outs = jaxpr.outvars[: len(jax.tree.leaves(out))]
    news = zip([_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(new)[0]],
               jaxpr.outvars[len(outs) :], forwarded(jaxpr)[len(outs) :], strict=True)  # fmt: skip
    from_inputs, keys = _reach(jaxpr, jaxpr.invars[n + k :]), _key_paths(h.state)
    carried, streams = [], set()
    for p, v, given in news:  # given: the input an output hands back as is (an nnx.jit's)
        passed = given is not None and jaxpr.invars[given] is ins.get(p)
        if p not in ins or passed or len(read := _reach(jaxpr, [ins[p]])) == 1:
            continue  # new, passed through, or never read
        if (stream := _stream(p, keys)) is not None:
            streams.add(stream)
        elif id(v) in from_inputs or any(id(o) in read for o in outs):
            carried.append(p)
    if carried:
        raise ConfigError(_carried(h, carried, kw))
    return tuple(sorted(streams))


def _reach(jaxpr: Any, sources: Sequence[Any]) -> set[int]:
    """The ids of ``sources`` and of the outputs computed from them, followed into calls, loop
    carries and branches (a step count a scan carries beside the rows is not computed from them)."""
    deps = input_dependent(jaxpr, sources)
    return {id(v) for v in sources} | {id(v) for v, d in zip(jaxpr.outvars, deps, strict=True) if d}


def _names(path: Any) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _stream(path: tuple[str, ...], keys: set[tuple[str, ...]]) -> str | None:
    """The rng stream a state leaf belongs to: linen's ``rngs/<stream>`` key, nnx's
    ``<stream>/key`` or ``<stream>/count``; ``None`` for other state."""
    if len(path) > 1 and path[-1] in ("key", "count") and (*path[:-1], "key") in keys:
        return path[-2]
    return path[-1] if path in keys else None


def _mode(h: Hybrid, kw: Mapping[str, Any]) -> dict[str, Any] | None:
    """A linen model's settings in inference mode, where its call takes a mode flag."""
    names = list(h.__signature__.parameters) if h.kind == "linen" and h.__signature__ else []
    flag = next((f for f in names if f in _MODES), None)
    if flag is None or kw.get(flag) == _MODES[flag]:
        return None
    return {**kw, flag: _MODES[flag]}


def _carried(h: Hybrid, paths: list[tuple[str, ...]], kw: Mapping[str, Any]) -> str:
    linen = h.kind == "linen"
    names = sorted({p[0] if linen else "/".join(p) for p in paths})
    quoted = ", ".join(map(repr, names))
    what = f"{'collection' if linen else 'variable'}{'s' * (len(names) > 1)} {quoted}"
    mode = _mode(h, kw)
    mode = "E" if mode is None else f"Export the inference mode: kwargs={mode}. Else e"
    settings = "".join(f", {k}={v!r}" for k, v in kw.items())
    step = _LINEN_STEP.format(c=names[0], kw=settings) if linen and len(names) == 1 else ""
    return _CARRIED.format(name=h.name, what=what, mode=mode, step=step)


def _fixed_key(stage: Stage) -> str:
    """The refusal of a baked rng key, naming its streams and a fix for that kind of model."""
    h, n = stage.h, len(stage.examples)
    keys = _key_paths(h.variables)  # where no call moved a stream: the keys h holds
    streams = stage.streams or tuple(sorted({_stream(p, keys) or p[-1] for p in keys}))
    xs = "x" if n == 1 else ", ".join(f"x{i}" for i in range(n))
    kw = "".join(f", {k}={v!r}" for k, v in stage.kwargs.items())
    key, many = "jax.random.wrap_key_data(key)", f"{list(streams)}, jax.random.split"
    split = f"dict(zip({many}(jax.random.wrap_key_data(key), {len(streams)})))"
    if h.kind == "nnx":
        rngs = f"{streams[0]}={key}" if len(streams) == 1 else f"**{split}"
        fix, holder = _NNX_KEY.format(xs=xs, kw=kw, rngs=rngs), "the module's nnx.Rngs holds"
        part = (", or export a part that draws nothing (sm.hybridize(lambda model, z: "
                "model.generate(z), model) for a VAE's sampler)")  # fmt: skip
    elif h.kind == "linen":
        rngs = f"{{{streams[0]!r}: {key}}}" if len(streams) == 1 else split
        fix, holder, part = _LINEN_KEY.format(xs=xs, kw=kw, rngs=rngs), "the Hybrid holds", ""
    else:  # a function's params (or an equinox module) hold the key
        fix, holder, part = _PLAIN_KEY.format(xs=xs, key=key), "its params hold", ""
    mode = _mode(h, stage.kwargs)
    return _FIXED_KEY.format(
        name=h.name, s="s" * (len(streams) > 1), streams=", ".join(map(repr, streams)),
        holder=holder, fix=fix, xs=xs, specs=", ".join(["'b, ...'"] * n), part=part,
        same="drop the same units" if streams == ("dropout",) else "draw the same numbers",
        mode="M" if mode is None else f"Export the inference mode: kwargs={mode}. Else m",
    )  # fmt: skip


def _key_paths(tree: Any) -> set[tuple[str, ...]]:
    return {_names(p) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if is_key(x)}


def _draws_a_constant_key(jaxpr: Any) -> bool:
    """Whether the program draws random bits and reads a key it closes over (a baked one)."""
    if not any(e.primitive.name == "random_bits" for e, _ in walk(jaxpr)):
        return False
    read = {id(v) for e in jaxpr.eqns for v in e.invars}
    return any(id(v) in read and is_key(v.aval) for v in jaxpr.constvars)


def _spec(path: str, x: Any, weak: bool = False) -> TensorSpec:
    return TensorSpec(path, shape_dims(x.shape), str(x.dtype), weak)


def _exportable(h: Hybrid) -> tuple[Any, Callable[..., Any], bool]:
    """What an export stores, the function of it, and whether rng keys are baked in."""
    tree, fn = h.variables, h.fn
    leaves, treedef = jax.tree.flatten(tree)
    keys = {i: x for i, x in enumerate(leaves) if is_key(x)}
    if not keys:
        return tree, fn, False
    stored = jax.tree.unflatten(treedef, [None if i in keys else x for i, x in enumerate(leaves)])

    def with_keys(stored: Any, *args: Any, **kwargs: Any) -> Any:
        slots = jax.tree.leaves(stored, is_leaf=lambda x: x is None)
        full = [keys.get(i, x) for i, x in enumerate(slots)]
        return fn(jax.tree.unflatten(treedef, full), *args, **kwargs)

    return stored, with_keys, True


_FLAT_MODULE = (
    "Return tuple(jax.tree.leaves(out)) from a function of the module's apply, exported with the "
    "same example= and kwargs=: "
    "sm.hybridize(lambda params, *xs, **kw: tuple(jax.tree.leaves(h.apply(params, *xs, **kw)"
    "{out})), h.params){why}; the loaded model returns the leaves of {tree} in order "
    "(jax.tree.unflatten of that structure rebuilds it)."
)
#: A stateful Hybrid's apply returns (out, new_state): the artifact returns out alone.
_STATEFUL_OUT = "[0]", " (h.apply returns (out, new_state): [0] is the output, no state)"


def _setting_specs(name: str, shapes: tuple, given: tuple, static: tuple) -> str:
    places = [k for k, *_ in static if isinstance(k, int)]
    settings = ", ".join(f"args[{i}] ({given[i]!r})" for i in places)
    kept = tuple(s for i, s in enumerate(shapes) if i not in places)
    are = "are settings" if len(places) > 1 else "is a setting"
    return (
        f"export({name}, shapes={shapes!r}): one spec per input array, and the example has "
        f"{len(given) - len(places)}: {settings} {are}, baked into the export, no input of the "
        f"artifact. Pass shapes={kept!r}."
    )


def _output_kind(exported: Any, h: Hybrid) -> str:
    out_tree = exported.out_tree
    if out_tree == jax.tree.structure(0):
        return "array"
    if out_tree == jax.tree.structure((0,) * out_tree.num_leaves):
        return "tuple"
    fix = "Return tuple(jax.tree.leaves(out)) from the function you export."
    tree = str(out_tree)  # (checkify's Error: 1,300 characters, of tracebacks' addresses)
    tree = tree if len(tree) <= 300 else f"{tree[:240]}... ({out_tree.num_leaves} arrays)"
    if h.kind in ("nnx", "linen", "eqx"):  # a module's output: no function of the user's to edit
        out, why = _STATEFUL_OUT if h.stateful else ("", "")
        fix = _FLAT_MODULE.format(tree=tree, out=out, why=why)
    raise SignatureError(
        f"export({h.name}): the function returns {tree}; an artifact returns an array or a "
        f"flat tuple of arrays (what every runtime, IREE included, can hand back). {fix}"
    )
