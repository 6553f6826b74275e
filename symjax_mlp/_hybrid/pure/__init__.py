"""Each kind of model as a pure ``call(params, state, args, kwargs) -> (out, state)``: a linen
module's state is its mutable collections and rng streams, an nnx module's (:mod:`.nnx_module`)
every variable but its params; an nnx module's mode (its submodules' attributes) keys traces."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax

from symjax_mlp._errors import ConfigError, first_line
from symjax_mlp._hybrid import trace as _trace
from symjax_mlp._hybrid.args import ModuleSetting, inputs_after, unwalkable

#: ``(module's watch list, settings)``: what a trace of that nnx module runs with
PINNED: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "symjax_mlp_nnx_settings", default=None
)


@dataclasses.dataclass(frozen=True)
class PureModel:
    """A model as a pure function ``call(params, state, args, kwargs) -> (out, new_state)``."""

    call: Callable[..., tuple[Any, Any]]
    stateful: bool
    kind: str = "plain"
    module: Any = None
    target: Any = None  # what the inputs go to, params (or self) first: for its signature
    #: an nnx module's settings (its submodules' bool attributes) as they are now, and names
    settings: Callable[[], tuple] | None = None
    setting_names: tuple[str, ...] = ()
    _watch: Any = None  # what pins this model's settings (its own, not another model's)
    source: Any = None  # the module the user gave, never an input of its own Hybrid
    #: ``(caller, kwargs) -> None``, raising for keywords a call of the model never takes
    #: (linen ``apply``'s own, :mod:`.linen_module`)
    refuse_keywords: Callable[[str, Any], None] = lambda caller, kwargs: None
    #: ``(params, quick) -> list[str]``: an nnx module's Variables that it holds now in place of
    #: those it was hybridized with (none for params given since), :mod:`.nnx_module`
    trained: Callable[[Any], list[str]] | None = None
    #: ``(variables, keywords) -> call | None``: a linen model's ``model.apply`` as Flax runs
    #: it, the variables' collections the call's state (``mutable=`` Flax's; ``(result,
    #: None)``), for variables holding collections the Hybrid holds as state (``h.apply``'s),
    #: or given apply's ``mutable=``/``rngs=`` (``keywords``) where it holds none; else ``None``
    given_state: Callable[..., Callable[..., tuple[Any, None]] | None] = lambda v, k=False: None

    @contextlib.contextmanager
    def pinned(self, values: tuple) -> Iterator[None]:
        """Within the block, :attr:`call` runs with these settings."""
        token = None if self.settings is None else PINNED.set((self._watch, values))
        try:
            yield
        finally:
            if token is not None:
                PINNED.reset(token)

    @property
    def name(self) -> str:
        """A Hybrid's default name: the function's; for a module's ``__call__``, the class of
        the module given (else of the one defining it)."""
        name = getattr(self.target, "__name__", type(self.target).__name__)
        if name != "__call__":
            return name
        owner = getattr(self.target, "__qualname__", "").rpartition(".")[0].rpartition(".")[2]
        return type(self.source).__name__ if self.source is not None else owner or name

    def parameters(self) -> list[inspect.Parameter] | None:
        """The inputs' parameters (params or ``self`` dropped), or ``None``."""
        try:
            return inputs_after(self.target, 1)
        except (TypeError, ValueError):  # a builtin, a C callable: no signature to read
            return None

    def inference(self, name: str) -> Callable[..., Any]:
        """``f(variables, *args, **kwargs) -> out``; ``variables`` is ``{"params": p,
        "state": s}`` for a stateful model, else the params."""

        def model(variables: Any, *args: Any, **kwargs: Any) -> Any:
            with _trace.symbolic(name):  # a shape from a traced array named, in export too
                if not self.stateful:
                    return self.call(variables, {}, args, kwargs)[0]
                return self.call(variables["params"], variables["state"], args, kwargs)[0]

        model.__name__ = name
        return model


def plain(fn: Callable[..., Any]) -> PureModel:
    def call(params, state, args, kwargs):
        try:
            return fn(params, *args, **kwargs), state
        except TypeError as e:  # named as the Hybrid is: an equinox module's class, not __call__
            if (unfit := _trace.unfit_call(model.name, e, fn, params, args, kwargs)) is None:
                raise
            raise unfit from None

    model = PureModel(call, stateful=False, target=fn)  # its name heads call's errors
    return model


class StateAdded(ConfigError):
    """A call of an nnx module that held only Params added variables: ``model``, the module
    as a stateful model, holds them (a Hybrid's call then turns stateful, as ``nnx.jit``)."""

    def __init__(self, message: str, model: PureModel) -> None:
        super().__init__(message)
        self.model = model


_NESTED_NNX = (
    "{caller}: params{path} is an nnx {kind} holding {held} variables, which its calls change "
    "(BatchNorm's statistics, Dropout's rng counts); inside the params every compiled call "
    "would drop that change, silently. Pass the module as the params, hybridize(fn, module), "
    "which carries that state across calls, and the rest as arguments (h(x, scale)) or as the "
    "module's attributes."
)


def refuse_nested_nnx_state(caller: str, params: Any) -> None:
    """Refuses an nnx module (or ``nnx.Rngs``) inside plain params that holds variables other
    than ``Param`` s: a compiled call would drop what it changes in them. Plain arrays
    (``nnx.data``, pytree.md's ``nnx.Pytree`` s) are leaves of the params, as any pytree's."""
    if (nnx := sys.modules.get("flax.nnx")) is None:  # flax not imported: no nnx module exists
        return
    graph = getattr(nnx, "Pytree", nnx.Module)  # nnx.Rngs too, where flax has nnx.Pytree

    def is_node(x: Any) -> bool:  # (an iterator: a leaf, which JAX warns of; refused later)
        return isinstance(x, graph) or unwalkable(x)

    nodes = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_node)
    for path, leaf in (node for node in nodes[0] if isinstance(node[1], graph)):
        held = nnx.state(leaf, nnx.Not(nnx.Param))
        variables = jax.tree.leaves(held, is_leaf=lambda v: isinstance(v, nnx.Variable))
        variables = [v for v in variables if isinstance(v, nnx.Variable)]  # (not nnx.data's)
        if kinds := ", ".join(sorted({type(v).__name__ for v in variables})):
            where, kind = jax.tree_util.keystr(path), type(leaf).__name__
            raise ConfigError(_NESTED_NNX.format(caller=caller, path=where, kind=kind, held=kinds))


def leaf_paths(trees: tuple[Any, Any]) -> list[str]:
    """Each leaf's path: ``params['bias']``, ``state['mean']`` (an nnx.State's too)."""
    named = zip(("params", "state"), trees, strict=True)
    flat = [(n, jax.tree_util.tree_flatten_with_path(t)[0]) for n, t in named]
    paths = (n + jax.tree_util.keystr(k) for n, leaves in flat for k, _ in leaves)
    return [p.removesuffix(".value") for p in paths]


def path_diff(expected: list[str], got: list[str]) -> str:
    """What the paths expected and given differ in: a few each way."""
    lacking = [p for p in expected if p not in set(got)][:5]
    extra = [p for p in got if p not in set(expected)][:5]
    if not (lacking or extra):
        return f"the same paths in another order: {got[:5]}, expected {expected[:5]}"
    return f"missing {lacking or 'none'}, unexpected {extra or 'none'}"


_REFIT = (
    "{caller}: the state given does not fit the model's: {diff}. Pass a tree shaped as h.state "
    "(its arrays' values changed){tail}."
)


def refit(caller: str, held: Any, state: Any, tail: str = "") -> Any:
    """``state`` in the ``held`` one's tree, refused unless its leaves' paths are the same."""
    if unfit := unfit_state(caller, held, state, tail):
        raise unfit
    return jax.tree.unflatten(jax.tree.structure(held), jax.tree.leaves(state))


def unfit_state(caller: str, held: Any, state: Any, tail: str = "") -> ConfigError | None:
    """The error for a ``state`` whose leaves' paths are not the ``held`` one's, else None."""
    expected, got = leaf_paths(({}, held)), leaf_paths(({}, state))
    diff = None if got == expected else path_diff(expected, got)
    return diff and ConfigError(_REFIT.format(caller=caller, diff=diff, tail=tail))


_NONE_PARAMS = (
    "{caller}: got None, but a Hybrid's model is called with its params. Pass a tree shaped as "
    "h.params (its arrays' values changed), or leave params out to keep these; a function that "
    "reads none takes {{}}."
)


def refuse_new_params(name: str, kind: str, held: Any, params: Any) -> None:
    """The checks of ``h.replace(params=...)`` on the Hybrid ``name`` of ``kind``, holding
    ``held``: params of None (as ``hybridize(fn, None)``), an nnx state nested in them, an
    equinox layer of another size (:func:`refuse_resized`)."""
    if params is None:
        raise ConfigError(_NONE_PARAMS.format(caller=f"{name}.replace(params=None)"))
    refuse_nested_nnx_state(f"{name}.replace(params=...)", params)
    refuse_resized(f"{name}.replace(params=...)", kind, held, params)


_UNFIT_PARAMS = (
    "{caller}: the params given, {got}, do not fit the model's ({diff}), and the model failed on "
    "them ({error}). Pass a tree shaped as h.params (its arrays' values changed): "
    "h.apply(h.params, x)."
)


def unfit_params(caller: str, held: Any, params: Any, error: BaseException) -> ConfigError | None:
    """The error naming ``params`` that are not shaped as the ``held`` treedef's, for a model
    that failed on them (``error``, its own: ``p["w"]`` of None); else None (they fit)."""
    expected = leaf_paths((jax.tree.unflatten(held, [0] * held.num_leaves), {}))
    got = leaf_paths((params, {}))
    if got == expected:
        return None
    kind = "None" if params is None else f"a {type(params).__name__}"
    diff, said = path_diff(expected, got), first_line(error, 200, typed=True)
    return ConfigError(_UNFIT_PARAMS.format(caller=caller, got=kind, diff=diff, error=said))


_RESIZED = (
    "{caller}: params{path} is shaped {got}, where the equinox module's is {held}: the Hybrid "
    "holds the module's sizes with the rest of it (static, as eqx.partition splits it), so new "
    "params keep its shapes. For a module of another size, hybridize it: sm.hybridize("
    "new_model); for new values of this one, pass eqx.filter(model, eqx.is_inexact_array) of "
    "one built alike."
)


def refuse_resized(caller: str, kind: str, held: Any, params: Any) -> None:
    """Refuses an equinox module's (``kind`` ``"eqx"``) params holding a leaf shaped otherwise
    than the ``held`` one at its path (a layer of another size), by path and shapes."""
    if kind != "eqx":
        return
    flat = jax.tree_util.tree_flatten_with_path
    shapes = {jax.tree_util.keystr(p): getattr(x, "shape", None) for p, x in flat(held)[0]}
    for path, leaf in flat(params)[0]:
        at = jax.tree_util.keystr(path)
        if at in shapes and (got := getattr(leaf, "shape", None)) != shapes[at]:
            said = _RESIZED.format(caller=caller, path=at, got=got, held=shapes[at])
            raise ConfigError(said)


def mode_settings(model: PureModel, values: tuple, *, train: bool) -> tuple:
    """An nnx module's settings ``values`` as ``module.train()`` or ``eval()`` would set them."""
    pairs = zip(model.setting_names, values, strict=True)
    return tuple(
        (not train) if n.rpartition("/")[2] in _trace.MODE_ATTRIBUTES else v for n, v in pairs
    )


def is_key(leaf: Any) -> bool:
    """Whether ``leaf`` is a typed rng key (``jax.random.key``)."""
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def state_structure(state: Any) -> tuple[Any, tuple[str | None, ...]]:
    """The state's treedef and, per leaf, its rng key impl (``None``: not a key)."""
    leaves, treedef = jax.tree.flatten(state)
    return treedef, tuple(jax.random.key_impl(leaf) if is_key(leaf) else None for leaf in leaves)


def unwrap_keys(leaves: list[Any], impls: tuple[str | None, ...]) -> list[Any]:
    return [x if i is None else jax.random.key_data(x) for x, i in zip(leaves, impls, strict=True)]


def wrap_keys(raw: list[Any], impls: tuple[str | None, ...]) -> list[Any]:
    pairs = zip(raw, impls, strict=True)
    return [r if i is None else jax.random.wrap_key_data(r, impl=i) for r, i in pairs]


class ModuleModes:
    """The settings of a Hybrid's nnx ``model`` as they are ``now()``, read at each call."""

    def __init__(self, model: PureModel, now: Callable[[], tuple] | None = None) -> None:
        self.model = model
        self.now = model.settings if now is None else now
        self._names = tuple(map(ModuleSetting, model.setting_names))
        self._keyed: dict[tuple, tuple] = {}  # settings -> their static entries, once per mode

    def fixed(self) -> ModuleModes:
        """These modes, fixed as they are now (``module.train()`` later does not switch them)."""
        values = self.now()
        return ModuleModes(self.model, lambda: values)

    def key(self, static: tuple) -> tuple:
        """``static`` and the settings as they are now: what a trace is keyed on."""
        if (entries := self._keyed.get(values := self.now())) is None:
            pairs = zip(self._names, values, strict=True)
            entries = self._keyed[values] = tuple((k, v, type(v)) for k, v in pairs)
        return static + entries

    def training(self, program: Callable[[tuple], str]) -> tuple[str, ...]:
        """The settings holding the module in training mode, ``"path=value"``, where flipping
        them changes ``program(settings)``."""
        now = self.now()
        evaluating = mode_settings(self.model, now, train=False)
        if now == evaluating or program(now) == program(evaluating):
            return ()
        pairs = zip(self.model.setting_names, now, evaluating, strict=True)
        return tuple(f"{n}={v}" for n, v, e in pairs if v != e)
