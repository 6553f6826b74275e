"""``hybridize`` and ``shard``: a model (a linen, nnx or equinox module, or a pure function)
made a :class:`~symjax_mlp.Hybrid` (equinox never imported here), and run data-parallel."""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from symjax_mlp._errors import ConfigError
from symjax_mlp._hybrid.args import equinox_modules
from symjax_mlp._hybrid.hybrid import Hybrid
from symjax_mlp._hybrid.pure import PureModel, plain, refuse_nested_nnx_state
from symjax_mlp._hybrid.pure.linen_module import APPLY_FIXES, linen
from symjax_mlp._hybrid.pure.nnx_module import closed_module_error, held_values, nnx_module

_STAGED = (  # aot.md's stages: a Compiled's call raises jax's TypeError under any transform
    "hybridize() got a jax.stages.{kind} (jax.jit(f).trace(...).lower()...): it runs only at "
    "the shapes and dtypes it was lowered for, and JAX transforms none of it (no jax.grad, "
    "jax.vmap or export of it). Hybridize the function itself: sm.hybridize(f, params), f "
    "or jax.jit(f) taking (params, *inputs)."
)
_TAKES_NO = {  # why, and the fix
    "nnx": "the module carries its own state (nnx.Rngs, nnx.BatchStat). Write hybridize(module).",
    "eqx": "an equinox module's float arrays are its params, the rest is held static. Write "
    "hybridize(module); pass a key or an eqx.nn.State to each call.",
}
_EQX_HELD = (
    "{label}: the function holds an equinox {kind} (in its closure, a functools.partial's "
    "arguments or a global it reads), whose float arrays are params: hybridize(lambda _, x: "
    "f(x), {{}}) would bake them into the program, untrained, unexported. Give the module as "
    "the params: sm.hybridize(f, model), f called as f(model, *inputs)."
)
_EQX_PARAMS = (
    "{kind}: the params given (a {got}) do not fit the equinox {kind} the Hybrid was made of (its "
    "float arrays, combined with the rest held static): a module of another class or size. Pass "
    "its arrays, shaped as h.params: eqx.filter(model, eqx.is_inexact_array) of a {kind} built "
    "alike, or hybridize the other model."
)
_PENZAI = (
    "{label}: a penzai {kind} holds its Parameters as mutable variables, not as params: "
    "hybridize(lambda _, x: model(x), {{}}) would bake them into the program as they are now "
    "(h.params empty, the model's later training unseen). Unbind them, as penzai's "
    "jitting_and_sharding notebook does: unbound, params = pz.unbind_params(model, freeze=True); "
    "sm.hybridize(lambda p, x: unbound.stateless_call(p, x)[0], params). An artifact takes "
    "arrays: export a function of x that names its axes inside, pz.nx.wrap(x).tag(...)."
)

_KERAS = (
    "{label}: a Keras {kind} holds its weights as Keras Variables, not as params: "
    "hybridize(lambda _, x: model(x), {{}}) would bake them into the program as they are now "
    "(h.params empty, the model's later training unseen). Pass their values to its pure "
    "stateless_call, as keras-io's guide to a training loop in JAX does: variables = "
    "([v.value for v in model.trainable_variables], [v.value for v in "
    "model.non_trainable_variables]); sm.hybridize(lambda v, x: model.stateless_call(*v, x)[0], "
    "variables)."
)
#: the libraries whose ``Layer`` holds its weights as variables of its own, and what to do
_HOLDING_VARIABLES = (("penzai.nn.layer", _PENZAI), ("keras", _KERAS))

_PAIR = (
    " That is an (init, apply) pair of pure functions (Haiku's hk.transform, stax's): hybridize "
    "its apply, sm.hybridize(f.apply, params), with the params init returns (of "
    "hk.transform_with_state's (params, state), the params), and call h with apply's other "
    "arguments: h(None, x) where apply takes an rng (None or a key), h(state, None, x) with state."
)


def hybridize(
    model: Any,
    params: Any = None,
    *,
    name: str | None = None,
    max_traces: int | None = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    mutable: Sequence[str] | None = None,
    rngs: Any = None,
    donate: bool = False,
    params_as_constants: bool = False,
) -> Hybrid:
    """Binds a model to its params as a :class:`Hybrid`: one switch from eager to compiled.

    Args:
      model: a ``flax.linen.Module`` (``params``: its variables, as ``init`` returns them), a
        ``flax.nnx.Module`` (no ``params``: its state, every variable but its ``Param`` s, is
        split off once and carried across calls, with the variables a call adds, as ``nnx.jit``
        keeps them; one holding ``Param`` s only carries none, so a call that adds one is
        refused: call the module once before. ``module.eval()`` and ``module.train()`` switch
        the Hybrid too, one trace per mode, but its ``Param`` s are held as of this call: the
        module (or a view of it) trained in place or reseeded later leaves ``h(x)`` as it is,
        and its export, a Batcher of it, ``h.params`` and ``h.state`` are refused
        (``h.refresh()`` reads it again); one holding no ``Param``, as nnx's array
        leaves, has its float arrays as params), an ``equinox.Module`` (no ``params``: its float
        arrays are, as ``eqx.filter_grad`` takes them; its bool and int arrays are held with
        the rest, baked into the program), or any pure function ``fn(params, *args, **kwargs)``
        (an nnx or equinox module's method, ``model.encode``, runs as ``encode(model, *inputs)``,
        ``functools.partial(model.encode, k=v)`` as ``encode(model, *inputs, k=v)``; a linen
        module's is refused, naming ``model.apply(..., method=...)``).
      params: the variables or params; omitted for an nnx or equinox module. An nnx module (or
        ``nnx.Pytree``) as ``fn``'s params is split as its own Hybrid splits it; one inside the
        params (or given later to ``h.apply``, ``h.replace``) must hold ``Param`` s only.
      name: shown in trace logs and errors (default: the function or module class name).
      max_traces: a budget of traces; one more raises :class:`~symjax_mlp.RetraceError`.
      static_argnums, static_argnames: arguments static even when they are arrays, as in
        ``jax.jit`` (completed from the model's signature); Python settings are static anyway.
      mutable: a linen model's collections that a call updates, held across calls (default:
        every collection but ``"params"``); one the variables lack (``self.sow``'s) is returned
        fresh by each call, ``(out, {name: values})``, as ``model.apply`` returns it. Those it
        leaves out are params: a second trained collection (``nnx.bridge.to_linen``'s
        ``"LoRAParam"``) needs ``mutable=`` naming the others, e.g. ``mutable=["counts"]``.
      rngs: a linen model's rng streams, split anew on every call: a key (the ``"dropout"``
        stream), an int seed, or ``{"dropout": key, ...}``.
      donate: donate the held state to each ``h(x)`` call (never ``h.apply``, never your
        variables): arrays read from :attr:`Hybrid.state` are valid until the next call.
      params_as_constants: compile the params into ``h(x)``'s program as constants (as
        ``torch.jit.freeze`` does); ``h.apply``, ``h.eager``, ``h.graph`` and
        :func:`~symjax_mlp.export` still take them as inputs. Not with :meth:`Hybrid.shard`.

    Returns:
      A :class:`Hybrid`; ``h(x)`` is XLA-compiled, ``h.eager(x)`` imperative. ``h(x)`` returns
      once its program is dispatched (JAX's asynchronous dispatch; a PyTorch call on CPU returns
      when done): to time a loop of calls, wait for them (``jax.block_until_ready(h(x))`` on the
      last) or use :func:`~symjax_mlp.timeit`. A ``print`` in the model runs when it is traced,
      once per input signature, not on every call (``jax.debug.print`` does; export refuses it).

    Raises:
      TypeError: ``model`` is none of the above, or params are missing or superfluous.
      ConfigError: an nnx module inside ``params`` holds variables other than ``Param`` s
        (also raised by ``h.apply`` and ``h.replace(params=...)``). A call raises it where an
        nnx module's call removes a variable, or adds one to a module that held none.

    Example:
      >>> import jax.numpy as jnp
      >>> import symjax_mlp as sm
      >>> h = sm.hybridize(lambda p, x, scale=1.0: x * p["w"] * scale, {"w": jnp.float32(2)})
      >>> h(jnp.ones(2), scale=3.0)
      Array([6., 6.], dtype=float32)
    """
    if isinstance(model, Hybrid):
        raise ConfigError("hybridize() got a Hybrid; it is already hybridized. Use it directly.")
    if params is None and isinstance(model, functools.partial) and not model.args:
        f = model.func  # partial(model.encode, k=v), partial(model, k=v): as model.encode is
        if _flax_kind(owner := getattr(f, "__self__", f)) in ("nnx", "eqx"):
            name = name or (type(f).__name__ if f is owner else f.__name__)
            call = type(f).__call__ if f is owner else f.__func__
            model, params = functools.partial(call, **model.keywords), owner
    # a bound method (equinox's BoundMethod too); a staticmethod object has no __self__
    method = hasattr(model, "__self__") and hasattr(model, "__func__")
    owner = _flax_kind(model.__self__) if method else None
    if owner in ("nnx", "eqx") and params is None:  # model.encode: encode(model, *inputs)
        name, model, params = name or model.__name__, model.__func__, model.__self__
    elif owner == "linen" and model.__name__ != "apply":  # model.apply: fn(variables, *xs)
        # else called as encode(params, *inputs), outside model.apply
        said = f"{type(model.__self__).__name__}.{model.__name__}"
        raise ConfigError(
            f"hybridize({said}): a method of a flax.linen module runs only inside its apply. "
            + APPLY_FIXES["method"].format(value=repr(model.__name__))
        )
    kind, state = _flax_kind(model), None
    if kind == "eqx" and params is not None and _wraps_a_function(model):
        kind = None  # eqx.filter_vmap(f), eqx.filter_jit(f) of a function f(params, *inputs)
    if kind is not None:
        name = name or type(model).__name__
    if kind in _TAKES_NO and any(v is not None for v in (params, mutable, rngs)):
        raise ConfigError(f"hybridize({name}) takes no params, mutable or rngs: {_TAKES_NO[kind]}")
    if kind == "nnx":
        model, params, state = nnx_module(model)
    elif kind == "linen":
        if params is None:
            raise ConfigError(
                f"hybridize({name}) needs its variables: write "
                "hybridize(module, module.init(jax.random.key(0), x))."
            )
        model, linen_params, state = linen(model, params, mutable, rngs)
        params = params if not state else linen_params  # stateless: the very dict given
    elif kind == "eqx":
        model, params = _equinox(type(model).__call__, model)
    elif mutable is not None or rngs is not None:
        raise ConfigError(
            "hybridize(fn, params, mutable=/rngs=): those are settings of a flax.linen module. "
            "A pure function carries no state: return what changes and pass it back in."
        )
    elif isinstance(model, jax.stages.Lowered | jax.stages.Compiled):
        raise ConfigError(_STAGED.format(kind=type(model).__name__))
    elif not callable(model):
        pair = isinstance(model, tuple) and len(model) == 2 and all(map(callable, model))
        raise ConfigError(
            "hybridize() expects a flax.linen.Module with its variables, a flax.nnx.Module, or "
            f"a pure function fn(params, *inputs); got {type(model).__name__}."
            + (_PAIR if pair else "")
        )
    elif params is None:
        label = f"hybridize({name or getattr(model, '__name__', 'fn')})"
        if (closed := closed_module_error(label, model)) is not None:
            raise closed
        held = next((v for v in held_values(model) if _flax_kind(v) == "eqx"), None)
        if held is not None:  # (an eqx.nn.Sequential has a len)
            raise ConfigError(_EQX_HELD.format(label=label, kind=type(held).__name__))
        held = (model, getattr(model, "__self__", None), *held_values(model))  # (a method's)
        for library, said in _HOLDING_VARIABLES:
            layer = getattr(sys.modules.get(library), "Layer", None)
            if layer is not None and (found := [v for v in held if isinstance(v, layer)]):
                raise ConfigError(said.format(label=label, kind=type(found[0]).__name__))
        raise ConfigError(
            "hybridize(fn, params) needs params: fn is called as fn(params, *inputs). "
            "For a function without params write hybridize(lambda _, x: f(x), {})."
        )
    elif equinox_modules(params):
        model, params = _equinox(model, params)
    elif _flax_kind(params) == "nnx" or _nnx_pytree(params):  # BatchStats, counts carried
        model, params, state = nnx_module(params, model)
    else:
        refuse_nested_nnx_state("hybridize(fn, params)", params)
    return Hybrid(
        model, params, state=state, name=name, max_traces=max_traces, donate=donate,
        static_argnums=static_argnums, static_argnames=static_argnames,
        params_as_constants=params_as_constants,
    )  # fmt: skip


def _flax_kind(model: Any) -> str | None:
    """``"nnx"``, ``"linen"``, ``"eqx"`` or ``None``, importing neither flax nor equinox."""
    flax_nnx, flax_linen = sys.modules.get("flax.nnx"), sys.modules.get("flax.linen")
    if flax_nnx is not None and isinstance(model, flax_nnx.Module):
        return "nnx"
    if flax_linen is not None and isinstance(model, flax_linen.Module):
        return "linen"
    eqx = sys.modules.get("equinox")
    return "eqx" if eqx is not None and isinstance(model, eqx.Module) else None


def _nnx_pytree(params: Any) -> bool:
    """Whether ``params`` is an ``nnx.Pytree`` (pytree.md's: its arrays are data, not Variables),
    split as an nnx module is; an ``nnx.Rngs`` is refused as params, as before."""
    nnx = sys.modules.get("flax.nnx")
    pytree = getattr(nnx, "Pytree", None)
    return pytree is not None and isinstance(params, pytree) and not isinstance(params, nnx.Rngs)


def _wraps_a_function(module: Any) -> bool:
    """Whether an equinox module is a function's transform (``eqx.filter_vmap(f)``, as equinox's
    ensembles are called), holding no array: not a model (``eqx.nn.Identity()`` holds none)."""
    eqx = sys.modules["equinox"]
    wraps = callable(getattr(module, "__wrapped__", None))
    return wraps and not jax.tree.leaves(eqx.filter(module, eqx.is_array))


def _equinox(fn: Any, tree: Any) -> tuple[PureModel, Any]:
    """``(fn', arrays)``: ``tree``'s float arrays (what ``eqx.filter_grad`` takes), and ``fn``
    on them combined with the rest of ``tree``, held static (its int and bool arrays: constants)."""
    eqx = sys.modules["equinox"]
    arrays, static = eqx.partition(tree, eqx.is_inexact_array)

    @functools.wraps(fn)
    def combined(params: Any, /, *args: Any, **kwargs: Any) -> Any:
        try:
            model = eqx.combine(params, static)
        except ValueError as e:  # JAX's "pytree structure error: different types at key path"
            kind = type(tree).__name__
            raise ConfigError(_EQX_PARAMS.format(kind=kind, got=type(params).__name__)) from e
        return fn(model, *args, **kwargs)

    return dataclasses.replace(plain(combined), kind="eqx"), arrays


def shard(h: Hybrid, mesh: Mesh | None = None, *, axis: str = "data", pad: bool = True) -> Hybrid:
    """Runs ``h`` data-parallel over ``mesh``: batch split over ``axis``, params replicated.

    Args:
      h: the :class:`Hybrid`.
      mesh: a ``jax.sharding.Mesh`` (default: :func:`~symjax_mlp.data_mesh`, every device).
      axis: the mesh axis the batch is split over.
      pad: take a batch that does not divide over the shards (``False``: raise
        :class:`~symjax_mlp.SignatureError`): it goes in whole and XLA splits it unevenly
        inside the program, its output replicated; exact for any model (a batch mean,
        BatchNorm's statistics in training: nothing is padded).

    Returns:
      ``h.shard(mesh)``: its result equals ``h``'s up to float rounding.

    Raises:
      ConfigError: ``h`` is not a Hybrid, or ``axis`` is not an axis of ``mesh``.

    Example:
      >>> import jax.numpy as jnp
      >>> import symjax_mlp as sm
      >>> h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
      >>> s = sm.shard(h, sm.data_mesh(1))
      >>> s(jnp.ones((3, 2))).shape, s.n_shards
      ((3, 2), 1)
    """
    if not isinstance(h, Hybrid):
        raise ConfigError(
            f"shard() expects a Hybrid; got {type(h).__name__}. Write "
            "shard(sm.hybridize(model, variables), mesh)."
        )
    return h.shard(mesh, axis=axis, pad=pad)
