"""The errors symjax_mlp raises (every one derives from :class:`SymjaxError`), the integer
and path reading its settings' checks share, and :class:`NoPickle`, pickle's refusal."""

from __future__ import annotations

import contextlib
import operator
import os
import re
import sys
import sysconfig
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any


class SymjaxError(Exception):
    """Base class of every error raised by symjax_mlp; catch this to catch them all.

    IPython and Jupyter show one as the frames of the code that called symjax_mlp (a cell's
    line) and the message, symjax_mlp's own frames hidden: a user error is no bug of ours to
    step through (``%xmode Verbose`` shows every frame)."""

    def _render_traceback_(self) -> list[str]:  # IPython's hook; plain Python shows them all
        shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
        if shell is None:
            return traceback.format_exception(self)
        if getattr(shell.InteractiveTB, "mode", "") == "Verbose":
            return shell.InteractiveTB.structured_traceback(type(self), self, self.__traceback__)
        return _shown(shell.InteractiveTB, self, set())


class ConfigError(SymjaxError, ValueError, TypeError):
    """An argument or setting is invalid (a size of 0, an unknown name, a wrong type); also a
    ``ValueError`` and a ``TypeError``, what Python itself would raise for it."""


class ArtifactError(SymjaxError):
    """An artifact directory is missing, corrupted, incompatible or cannot be written."""


class CheckpointError(SymjaxError):
    """A training checkpoint is missing, corrupted, or does not fit the run resuming from it."""


class SignatureError(SymjaxError, ValueError):
    """An input does not match the shape or dtype a compiled program or artifact expects."""


class EntryPointError(ConfigError, KeyError):
    """``m[name]`` of a loaded model for a name its artifact has no entry point of: a
    :class:`ConfigError`, and a ``KeyError`` as a mapping's missing key is."""

    def __str__(self) -> str:  # a KeyError would show its message quoted
        return str(self.args[0])


class PositionalInputsError(SignatureError, TypeError):
    """``m(x=x)``: a loaded model's inputs are positional; a :class:`SignatureError`, and a
    ``TypeError`` as Python's for an argument a function does not take."""


class RetraceError(SymjaxError):
    """A :class:`~symjax_mlp.Hybrid` traced more often than its ``max_traces`` budget allows."""


class RetraceWarning(UserWarning):
    """A :class:`~symjax_mlp.Hybrid` traced again for a new value of a Python number alone, or
    at each call for held state that grows (``sow`` outside ``nnx.capture``)."""


class ControlFlowError(SymjaxError, TypeError):
    """Python control flow or a host conversion was applied to a traced (symbolic) value."""


class DataError(SymjaxError, ValueError):
    """Training data is empty, misshapen, non-finite or has labels the model cannot predict."""


class DivergenceError(SymjaxError, FloatingPointError):
    """The training loss (or the parameters) became NaN or infinite.

    Attributes:
      step: the optimizer step whose loss was not finite (updates applied before it).
      epoch: the epoch it happened in (1-based).
      checkpoint: the last good checkpoint, kept on disk (``None`` without checkpoints).
    """

    def __init__(self, message: str, *, step: int, epoch: int, checkpoint: Path | None):
        super().__init__(message)
        self.step, self.epoch, self.checkpoint = step, epoch, checkpoint


class OverloadError(SymjaxError, RuntimeError):
    """A serving queue is full: the request was refused, not queued; retry it later."""


class DistributedError(SymjaxError, RuntimeError):
    """Another process of a multi-process run did not arrive, stalled or died; the message
    names it. Relaunch every process (``resume=True`` continues from the last checkpoint)."""


#: how a training checkpoint becomes an artifact, whose weights and program a load takes
EXPORT_CHECKPOINT = (
    "resume the run at the epochs it holds and export the result: symjax_mlp.training.train(..., "
    "checkpoint=DIR, resume=True).export(PATH) (TrainResult.export), or on the command line "
    "symjax-mlp train ... --checkpoint DIR --resume --export PATH"
)
CHECKPOINT_STATE = (  # given as an artifact's weights: then EXPORT_CHECKPOINT
    "{file} is a training checkpoint's state (its params, the optimizer's state and the rng, as "
    "train(checkpoint=DIR) writes them), not an artifact's weights. Pass the params.safetensors "
    "of an export of it; to get one, "
)


def _shown(tb_format: Any, e: BaseException, seen: set[int]) -> list[str]:
    """``e`` as IPython's ``tb_format`` shows it, and the exceptions it was raised from, each
    without the frames of symjax_mlp, JAX, Flax and the standard library between the cell's
    line and the model's (one raised by hand in a cell has none: it is shown whole); one it
    was raised from in those frames alone (a manifest's JSONDecodeError) is in its message.
    The chain is walked without recursion (a model's may be thousands long)."""
    blocks: list[list[str]] = []  # e's, the link, its cause's, ...: shown the other way round
    while True:
        kept, hidden = _kept(e.__traceback__)
        cause = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
        chain = e.__cause__, e.__context__, e.__suppress_context__
        try:  # IPython shows what e was raised from with every frame: each is shown here instead
            e.__cause__ = e.__context__ = None
            tb, offset = kept if hidden else e.__traceback__, 0 if seen else None  # (the cell's
            stb = tb_format.structured_traceback(type(e), e, tb, tb_offset=offset)  # runner: 1)
        finally:
            e.__cause__, e.__context__, e.__suppress_context__ = chain
        if hidden and getattr(tb_format, "mode", "") != "Minimal":  # (that one: the message alone)
            frames = f"{hidden} frame{'s' * (hidden > 1)}"
            stb[-1:-1] = [f"    [... {frames} of symjax_mlp, JAX, Flax and Python's own hidden: "
                          "%xmode Verbose shows them]"]  # fmt: skip
        blocks.append(stb)
        seen.add(id(e))
        if cause is None or id(cause) in seen or not _kept(cause.__traceback__)[0]:
            return [line for block in reversed(blocks) for line in block]
        blocks.append([
            "\nThe above exception was the direct cause of the following exception:\n"
            if e.__cause__ is not None
            else "\nDuring handling of the above exception, another exception occurred:\n"
        ])  # fmt: skip
        e = cause


def _kept(tb: TracebackType | None) -> tuple[TracebackType | None, int]:
    """``tb`` without the frames :func:`_hidden` hides (``None``: none left), and how many."""
    frames, hidden = [], 0
    while tb is not None:
        if _hidden(tb.tb_frame.f_code.co_filename):
            hidden += 1
        else:
            frames.append(tb)
        tb = tb.tb_next
    kept = None
    for t in reversed(frames):
        kept = TracebackType(kept, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return kept, hidden


def user_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel`` from its caller for the first frame outside
    symjax_mlp, JAX, Flax and the standard library (a trace runs under jax.jit's frames,
    ``train`` under its wrapper): the user's line, so that a notebook shows it under that
    cell, each time it is run; the command line's, which shows ours in one line. (Python
    3.12's ``skip_file_prefixes`` says it; we run 3.11.)"""
    import inspect

    here = inspect.currentframe()  # (None where Python keeps no frames: the caller's line)
    frame, level = (here.f_back if here is not None else None), 1
    while (
        frame is not None
        and _hidden(file := frame.f_code.co_filename)
        and not file.startswith(_CLI)
    ):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def _hidden(file: str) -> bool:  # a frame of symjax_mlp, JAX, Flax or the standard library
    found = [sys.modules[__name__.partition(".")[0]]] + [
        m for name in ("jax", "flax") if (m := sys.modules.get(name)) is not None
    ]
    dirs = tuple(os.path.join(os.path.dirname(os.path.abspath(m.__file__)), "") for m in found)
    return file.startswith(dirs) or (file.startswith(_STDLIB) and not file.startswith(_SITE))


_CLI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cli", "")
_STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "")
_SITE = tuple(  # the user's other libraries, under the stdlib's directory outside a venv
    os.path.join(sysconfig.get_paths()[k], "") for k in ("purelib", "platlib")
)


def as_int(x: Any) -> Any:
    """``x`` as an int if it is an integer of any kind (``np.int64``, a 0-d int array) but a
    bool; else ``x`` as it is, for the setting's check to refuse."""
    import numpy as np  # on first use: the CLI starts without it (a Ctrl-C then is handled)

    if isinstance(x, bool | np.bool_):
        return x
    try:
        return operator.index(x)
    except TypeError:
        return x


def as_bool(x: Any) -> Any:
    """``x`` as a bool if it is a NumPy bool (``np.True_``, what a sweep's array gives); else
    ``x`` as it is, for the setting's check to refuse (``1`` and ``"yes"`` are no bools)."""
    import numpy as np

    return bool(x) if isinstance(x, np.bool_) else x


def refuse_keywords(call: str, keywords: dict[str, Any], fix: str) -> None:
    """``f(h, x, train=False)`` where ``f`` takes the model's keywords as ``kwargs=``: a
    :class:`ConfigError` headed ``call`` (``"timeit(Net"``), with ``fix`` (``"timeit(model,
    x"``) completed by them. Python's own TypeError named neither ``kwargs=`` nor the fix."""
    if keywords:
        given = ", ".join(f"{k!r}: {v!r:.40}" for k, v in keywords.items())
        raise ConfigError(
            f"{call}, {'=..., '.join(keywords)}=...): takes no such keyword; the model's "
            f"keywords go in kwargs=, a dict: {fix}, kwargs={{{given}}})."
        )


def artifact_path(call: str, path: Any) -> Path:
    """``path`` as a ``Path``; refused, ``symjax_mlp.<call>(path)`` named, unless it is a str or
    an ``os.PathLike`` of one without a NUL character (else pathlib's or os's raw error)."""
    text = os.fspath(path) if isinstance(path, str | os.PathLike) else None
    if isinstance(text, str) and "\x00" not in text:
        return Path(text)
    got = "a path holding a NUL byte" if isinstance(text, str) else "a value of type "
    raise ConfigError(
        f"symjax_mlp.{call}({ascii(path)[:200]}): expected the directory written by "
        "symjax_mlp.export, as a str or a pathlib.Path; got "
        f"{got}{'' if isinstance(text, str) else type(path).__name__}."
    )


def message(error: BaseException) -> str:
    """``str(error)``, or that its ``__str__`` raised: a model's error, read to say what it
    means, is raised as it is, never replaced by the one its message raised."""
    try:
        return str(error)
    except Exception as failed:
        return f"(its message could not be read: its __str__ raised {type(failed).__name__})"


def first_line(error: BaseException, most: int | None = None, *, typed: bool = False) -> str:
    """The first line of ``error``'s :func:`message` without its final period, after its type's
    name where ``typed`` (``TypeError: ...``), at most ``most`` characters; its type's name
    where it says nothing."""
    line = next(iter(message(error).strip().splitlines()), "").rstrip(".")
    name = type(error).__name__
    return ((f"{name}: {line}" if typed else line) if line else name)[:most]


def unbound_axis(error: BaseException) -> str | None:
    """The axis name a collective reduced over that no transform binds (a
    ``BatchNorm(axis_name=...)`` outside ``jax.pmap``): read from JAX's ``NameError``, which
    says ``unbound axis name: batch``; ``None`` for any other error."""
    if not isinstance(error, NameError):
        return None
    found = re.search(r"unbound axis name: ([^\s.]+)", message(error))
    return found[1] if found else None


_UNBOUND = (
    "{name}: the model reduces over the axis name {axis!r} (a BatchNorm(axis_name={axis!r}), a "
    "lax.pmean), which only a transform mapping over it binds (jax.pmap, with which Flax's "
    "examples train; jax.vmap); a Hybrid's call binds none, nor does the model's own call. To "
    "reduce over the whole batch (what jax.pmap gives on one device), hybridize a function "
    "binding it:\n{fix}\nor call it with the setting that turns the reduction off (train=False "
    "in Flax's examples)."
)
_BIND = "in_axes=None, out_axes=None, axis_name={axis!r}, axis_size=1"
_BINDS = {  # by the kind of model: a function of what hybridize was given
    "linen": "  def train_apply(variables, {xs}):\n      apply = functools.partial(model.apply"
    "{options})\n      return jax.vmap(apply, {bind})(variables, {xs})\n  h = sm.hybridize("
    "train_apply, variables)",
    "nnx": "  def bound(module, {xs}):\n      run = nnx.vmap(lambda m, {xs}: {call}, {bind})\n"
    "      return run(module, {xs})\n  h = sm.hybridize(bound, module)",
    "eqx": "  def bound(model, {xs}):\n      run = jax.vmap(lambda {xs}: {call}, {bind})\n"
    "      return run({xs})\n  h = sm.hybridize(bound, model)",
    "plain": "  def bound(params, {xs}):\n      run = jax.vmap(functools.partial(fn{options}), "
    "{bind})\n      return run(params, {xs})\n  h = sm.hybridize(bound, params)",
}


def unbound_axis_error(
    model: Any, name: str, axis: str, state: Any, args: tuple, kwargs: dict
) -> ConfigError:
    """The :class:`ConfigError` of a Hybrid's ``model`` (its pure model: ``kind``, ``target``,
    ``source``) reducing over ``axis``, which no transform binds: the function binding it
    that it needs, by the kind of model."""
    options = [f", {k}={v!r}" for k, v in kwargs.items() if isinstance(v, (bool, int, str))]
    if model.kind == "linen" and (mutable := [c for c in state if c != "rngs"]):
        options.insert(0, f", mutable={mutable}")
    xs, options = "x" if len(args) == 1 else "*xs", "".join(options)
    call = f"m({xs}{options})" if model.target is type(model.source).__call__ else f"fn(m, {xs})"
    if model.kind == "eqx":  # the module's own call (functools.wraps'), or a function of it
        own = getattr(model.target, "__name__", "") == "__call__"
        call = f"model({xs}{options})" if own else f"fn(model, {xs}{options})"
    fix = _BINDS.get(model.kind, _BINDS["plain"])
    fix = fix.format(xs=xs, options=options, call=call, bind=_BIND.format(axis=axis))
    return ConfigError(_UNBOUND.format(name=name, axis=axis, fix=fix))


_TWO_DEVICES = (
    "{name}: a call's arrays are committed to two devices (ids {a} and {b}, {platform}): the "
    "params and an input (or two inputs), each put there by jax.device_put; a call (each op of an "
    "eager one) runs on one device. Put the inputs where the params are, jax.device_put(x, "
    "device), or move the params: h.replace(params=jax.device_put(h.params, device))."
)


def refuse_two_devices(name: str, error: BaseException) -> None:
    """Raises the :class:`ConfigError` for JAX's ``ValueError`` on arrays committed to different
    devices ('Received incompatible devices for jitted computation'), not after it (``from
    None``); returns for any other error."""
    text = message(error)
    found = re.findall(r"device ids \[([\d, ]+)\] on platform (\w+)", text)
    if isinstance(error, SymjaxError) or "incompatible devices" not in text or not found[1:]:
        return
    (a, platform), (b, _) = found[:2]
    raise ConfigError(_TWO_DEVICES.format(name=name, a=a, b=b, platform=platform.lower())) from None


@contextlib.contextmanager
def one_device(name: str) -> Iterator[None]:
    """The block's JAX ``ValueError`` on arrays committed to two devices (an eager op's, as
    jit's) as :func:`refuse_two_devices` raises it; any other error as it is."""
    try:
        yield
    except ValueError as e:
        refuse_two_devices(name, e)
        raise


_NO_PICKLE = (
    "pickle.dumps({name}): a {kind} holds compiled programs and locks, and is never pickled "
    "(nor sent to another process, which pickles it). {instead}"
)


_MODES = "a linen model's flag is an argument of the call, h(x, train=False); an nnx module's "
_WEIGHTS = "a dict of arrays by layer; a Dense kernel is (in, out), a torch.nn.Linear weight's "
_TAPE = "JAX records no tape: a call computes no gradients, and none is kept; "
#: PyTorch's names a Hybrid and a loaded model lack, and their own ways: (names, h's, m's)
_TORCH = (
    (("eval", "train"), f"it has no mode of its own: {_MODES}module.eval() and .train() switch it",
     "it runs as it was exported: one program, its settings fixed at export"),
    (("state_dict", "parameters", "named_parameters", "load_state_dict"),
     f"its weights are h.params, {_WEIGHTS}transpose; new ones: h.replace(params=...)",
     "its weights are m.params, by name; other weights: load(path, params=...), or "
     "m.apply(params, x) under jax.vmap and jax.grad"),
    (("no_grad", "zero_grad", "requires_grad_", "backward", "detach"),
     f"{_TAPE}take them with jax.grad of h.apply(params, x) over params",
     f"{_TAPE}jax.grad(lambda x: m(x).sum())(x) takes them (export with vjp_order=1), "
     "of its weights jax.grad(lambda p: m.apply(p, x).sum())(m.params)"),
    (("save",), "sm.export(h, path, example=x) writes what sm.load(path) runs with no source "
     "(as torch.jit.save and torch.jit.load)", None),
    (("forward",), "call it: h(x) compiled, h.eager(x) op by op", "call it: m(x)"),
    (("to", "cuda", "cpu"), "JAX places arrays, not models: jax.device_put(x, device); "
     "h.shard(mesh) runs it over several devices", None),
)  # fmt: skip
TORCH_NAMES = {n: {"Hybrid": h, "LoadedModel": m} for names, h, m in _TORCH for n in names}


class NoPickle:
    """A base of a :class:`Hybrid` and a loaded model: ``pickle`` refuses them, saying what to
    do instead (``_INSTEAD``); ``copy.copy`` shares their fields (``deepcopy``: their own); a
    name PyTorch's modules have and they lack says what to use (:data:`TORCH_NAMES`)."""

    _INSTEAD = ""

    def __getattr__(self, name: str) -> Any:  # only a name not found: never on a call's path
        kind = type(self).__name__
        how = TORCH_NAMES.get(name, {}).get(kind)
        said = f"'{kind}' object has no attribute '{name}'"
        raise AttributeError(f"{said}; {how}" if how else said, name=name, obj=self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        kind = type(self).__name__
        name = getattr(self, "_caller", getattr(self, "name", kind))  # a loaded model's load()
        raise ConfigError(_NO_PICKLE.format(name=name, kind=kind, instead=self._INSTEAD))

    def __copy__(self) -> Any:
        (twin := object.__new__(type(self))).__dict__.update(self.__dict__)
        return twin
