"""What an artifact's program may do: the ops, custom calls, loops and work a loader allows.

:func:`check` refuses, before anything compiles it, each :class:`Problem` the walk found (an
op outside :data:`ALLOWED_OPS`, a ``custom_call`` ``jax.export`` does not emit, a loop past
:data:`MAX_LOOP_TRIPS` or uncounted, recursion, control flow in a reducer, work or tensors past
the ``MAX_*`` bounds: ``"compute"``) unless the caller allows it by name (``allow={"while"}``,
``{"custom_call:NAME"}``). ``trust=True`` skips it all; a signed artifact is allowed the
:data:`NEEDS` its manifest declares.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax

from symjax_mlp._artifact.format import NEEDS, caller, printable
from symjax_mlp._compat import constraint_named
from symjax_mlp._errors import ArtifactError, ConfigError

# ops computing each element from the same element of each operand (rows keeps rows apart);
# reduce_precision: the VJP of jax.checkpoint with a policy rounds its saved residuals
ELEMENTWISE = frozenset(str.split("""
    abs add and atan2 bitcast_convert cbrt ceil clamp compare complex convert cosine divide
    exponential exponential_minus_one floor imag is_finite log log_plus_one logistic maximum
    minimum multiply negate not or power real reduce_precision remainder round_nearest_afz
    round_nearest_even rsqrt select shift_left shift_right_arithmetic shift_right_logical sign
    sine sqrt subtract tan tanh xor
"""))  # fmt: skip
# custom calls: allowed by target
ALLOWED_OPS = frozenset({"builtin.module", "func.func", "func.return", "func.call"}) | {
    f"stablehlo.{n}" for n in (*ELEMENTWISE, *str.split("""
    constant iota dynamic_iota get_dimension_size custom_call broadcast_in_dim
    dynamic_broadcast_in_dim reshape dynamic_reshape transpose concatenate slice pad reverse
    dot_general reduce return case if while optimization_barrier composite
"""))}  # fmt: skip
# ops calling a function of the module, by the attribute naming it: a composite runs its
# decomposition (jax.lax.erf exports as the composite "chlo.erf"), walked as any call's callee
CALLS = {"func.call": "callee", "stablehlo.composite": "decomposition"}
# ...but XLA and IREE run the op a "chlo." composite names (StableHLO's chlo-recompose-ops),
# whatever its decomposition does: these compute each element from the same one of their operand
CHLO_ELEMENTWISE = frozenset(
    f"chlo.{n}" for n in str.split("acos acosh asin asinh atanh cosh erf sinh")
)
ALLOWED_DIALECTS = ("sdy.",)  # Shardy's sharding annotations of sharded exports
JAX_CUSTOM_CALLS = frozenset(
    {"shape_assertion", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}
)  # what jax.export itself emits: symbolic-shape checks, sharding annotations
HOST_CALLBACKS = frozenset(str.split("""
    xla_python_cpu_callback xla_python_gpu_callback xla_ffi_python_cpu_callback
    xla_ffi_python_gpu_callback xla_ffi_partitioned_python_cpu_callback
    xla_ffi_partitioned_python_gpu_callback
"""))  # fmt: skip
# the keys of refusals that are no op's name (walk.py's, checker.py's)
CHECKS = frozenset(
    str.split("attribute call compute control_in_reducer module nesting recursion vjp")
)
MAX_LOOP_TRIPS = 1 << 16
MAX_ELEMENTS = 1 << 32
MAX_WORK = 1 << 32  # element operations: ~10-30 s of the slowest ops on one core
MAX_OPS = 1 << 16  # ops after inlining every call: XLA took 73 s, 3.7 GB to compile 5 * 2**17
MAX_NESTING = 64  # regions in regions, every call inlined; calls in calls (a model's: a few)
MAX_BYTES = 1 << 32  # bytes of all tensors the ops make, every call inlined, none reused


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing the module does that is refused by default."""

    key: str  # what allow= takes: "while", "custom_call:NAME", "compute", an op name
    what: str  # for the message


@dataclasses.dataclass(frozen=True)
class ModuleReport:
    """What a StableHLO module does: op counts, custom-call targets, work, problems."""

    counts: dict[str, int]
    custom_calls: dict[str, int]
    work: int  # element operations, dynamic dimensions counted as 1
    bytes_made: int  # bytes of all tensors the ops make, every call inlined, dynamic dims as 1
    problems: tuple[Problem, ...]
    ops: int = 0  # ops once every call is inlined (what a compiler compiles)
    # main's rows kept apart? (rows.analyze, which the child adds; not compared: not the ops')
    rows: dict[str, Any] | None = dataclasses.field(default=None, compare=False)
    # the MLIR types main takes and returns, {"ins": [...], "outs": [...]} (None: no main)
    main: dict[str, list[str]] | None = dataclasses.field(default=None, compare=False)
    # the messages of its shape assertions, each naming what it checks (the first 64, bounded)
    assertions: tuple[str, ...] = dataclasses.field(default=(), compare=False)


def composite_key(name: str) -> str:
    """The key refusing a composite named ``name`` ("": none, it is a call of its
    decomposition): a "chlo." name runs as the op it names, whatever its decomposition does
    ("chlo.top_k" sorts, "chlo.ragged_dot" picks each row's weights by its place in the batch,
    a forged identity decomposition aside), unless that op is elementwise."""
    if not name.startswith("chlo.") or name in CHLO_ELEMENTWISE:
        return ""
    return "sort" if name == "chlo.top_k" else name


def normalize_allow(allow: Iterable[str] | None, call: str = "load(") -> frozenset[str]:
    """``allow=`` as keys: ``"while"``, ``"stablehlo.while"`` and ``"op:while"`` are one key.
    Anything but names, or a name that no refusal can have (``"whiel"``), is a
    :class:`ConfigError` headed ``call`` (the call as far as its options, e.g.
    ``'symjax_mlp.load("dir", '``)."""
    if allow is None:
        return frozenset()
    items = (allow,) if isinstance(allow, str) else allow
    items = tuple(items) if isinstance(items, Iterable) else (None,)
    if not all(isinstance(i, str) and i for i in items):
        raise ConfigError(
            f"{call}allow={allow!r}): expected names such as 'while' or 'custom_call:NAME', "
            "in a set or list, e.g. allow={'while'}."
        )
    keys = frozenset(item.removeprefix("op:").removeprefix("stablehlo.") for item in items)
    for key in sorted(keys):
        if not (key in CHECKS or key in _op_names() or _open_ended(key)):
            guess = difflib.get_close_matches(key, [*CHECKS, *_op_names()], n=1)
            fix = f"Did you mean {guess[0]!r}?" if guess else "Pass the names a refusal gives."
            raise ConfigError(
                f"{call}allow={show_keys(items)[:300]}): {key[:100]!r} names nothing load() "
                f"refuses. Expected a check ({', '.join(sorted(CHECKS))}), a StableHLO op "
                "('while', 'gather', ...), an op of another dialect ('chlo.erf') or "
                f"'custom_call:NAME'. {fix}"
            )
    return keys


@functools.cache
def _op_names() -> frozenset[str]:
    """The StableHLO ops this JAX parses, without ``stablehlo.``."""
    from jax.extend.mlir.dialects import stablehlo

    names = (getattr(c, "OPERATION_NAME", "") for c in vars(stablehlo).values())
    return frozenset(n.removeprefix("stablehlo.") for n in names if isinstance(n, str) and n)


def _open_ended(key: str) -> bool:
    """A custom call's target or another dialect's op: any name."""
    head, dot, tail = key.partition(".")
    return (key.startswith("custom_call:") and key != "custom_call:") or bool(head and dot and tail)


def needs(report: ModuleReport) -> list[str]:
    """What of :data:`NEEDS` the program of ``report`` does: what its export declares."""
    return sorted({p.key for p in report.problems} & NEEDS)


def check(report: ModuleReport, *, file: Path, allow: frozenset[str], caller: str,
          needs: list[str] | None = None, signed: bool = False) -> None:  # fmt: skip
    """Raises :class:`ArtifactError` for each problem of ``report`` not in ``allow``;
    ``needs``: what the manifest declares (``None``: it has no such field)."""
    refused = [p for p in report.problems if p.key not in allow]
    if not refused:
        return
    keys = sorted({p.key for p in refused})
    wanted = sorted({p.key for p in report.problems})  # with those allow= already let through
    declared = show_keys(needs or ())
    if signed and needs is not None and NEEDS.intersection(keys):
        note = (f"It is signed, and its manifest declares that it needs {declared}, less than "
                "its program does: refused as inconsistent (an export records exactly what "
                "it needs; the manifest was edited before signing, or written by another "
                "symjax_mlp version).\n")  # fmt: skip
    elif needs and not signed:
        note = (f"Its manifest declares that it needs {declared}: if you trust its source, "
                "have it signed (symjax_mlp.sign) and pass verify_signature=<its public key>, "
                "which allows just those.\n")  # fmt: skip
    else:
        note = ""
    lines = "\n".join(f"  - {p.what}" for p in refused[:12])
    more = f"\n  ... and {len(refused) - 12} more" if len(refused) > 12 else ""
    raise ArtifactError(
        f"{file}: {caller} refuses to compile this module; it does what an MLP artifact "
        f"never needs:\n{lines}{more}\n{note}If you trust whoever made the artifact as you trust "
        f"code you run, pass allow={show_keys(wanted)} (just these) or trust=True (anything) to "
        f"{caller}. An untrusted artifact is untrusted code: run it in a sandbox."
    )


def check_main(report: ModuleReport, exported: Any, *, file: Path, what: str = "") -> None:
    """Raises :class:`ArtifactError` where the module's ``main`` takes or returns other types
    than ``exported``'s avals say: JAX calls it as they say, and reads a result of another
    type as theirs, in silence. ``what``: which module, for the message (a VJP's)."""
    if report.main is None:  # no main: the module is refused for that
        return
    kept = [exported.in_avals[i] for i in exported.module_kept_var_idx]
    tokens = len(exported.ordered_effects)  # first, then main's own; a platform index before
    for verb, got, avals, extra in (
        ("takes", report.main["ins"], kept, tokens + (len(exported.platforms) > 1)),
        ("returns", report.main["outs"], exported.out_avals, tokens),
    ):
        want = [mlir_type(a) for a in avals]
        tail = got[extra:]
        if len(got) != len(want) + extra:
            said = f"{len(got)} values, but {file.name} says {len(want) + extra}"
        elif bad := [
            i for i, (w, g) in enumerate(zip(want, tail, strict=True)) if w not in (None, g)
        ]:
            a, i = avals[bad[0]], bad[0]
            said = (
                f"{printable(tail[i][:100])} as its {'argument' if verb == 'takes' else 'result'} "
                f"{i}, but {file.name} says {want[i]} ({a.dtype}[{', '.join(map(str, a.shape))}])"
            )
        else:
            continue
        raise ArtifactError(
            f"{file}: its StableHLO main{what} {verb} {said}, as JAX would call it. The module "
            "computes something other than what its export declares: the artifact was edited. "
            "Refused; export it again."
        )


def check_claims(report: ModuleReport, view: Any, vjp_orders: int, *, file: Path) -> None:
    """Raises :class:`ArtifactError` where the manifest's entry point ``view`` says other than
    its module: a constraint the module checks (``b >= 2``) unlisted, which calls the manifest
    admits would break in the program (read where this JAX's messages name them); or a
    ``vjp_order`` other than the ``vjp_orders`` it holds, which jax.grad's messages name."""
    listed = view["signature"].get("constraints", [])
    have, head = {re.sub(r"\s+", "", c) for c in listed}, caller(file.parent, view)
    for message in report.assertions:
        if (rule := constraint_named(message)) and re.sub(r"\s+", "", rule) not in have:
            raise ArtifactError(
                f"{head}: its program, {file.name}, requires {printable(rule[:200])}, which "
                f"manifest.json's signature does not list (it lists "
                f"{', '.join(map(printable, listed)) or 'no constraint'}): calls it admits "
                "would be refused by the program. The manifest was edited or comes from another "
                "export; export the model again."
            )
    if (claimed := view.get("vjp_order", 0)) != vjp_orders:
        raise ArtifactError(
            f"{head}: its manifest says vjp_order={claimed}, but its program, {file.name}, holds "
            f"VJP modules up to order {vjp_orders}. The manifest was edited or comes from "
            "another export; export the model again (with the vjp_order jax.grad needs)."
        )


_ELEMENTS = {"bool": "i1", "bfloat16": "bf16", "complex64": "complex<f32>",
             "complex128": "complex<f64>"}  # fmt: skip


def mlir_type(aval: Any) -> str | None:
    """``tensor<?x3xf32>`` for ``float32[b, 3]``: the type MLIR prints for ``aval`` (``None``
    for an element type not spelt here); rng keys as their data (``key<fry>[2]``: ``2x2xui32``)."""
    shape = tuple(aval.shape)
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        aval = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), aval.dtype))
        shape += tuple(aval.shape)
    name, dims = str(aval.dtype), "".join(f"{d}x" if type(d) is int else "?x" for d in shape)
    if found := re.fullmatch(r"(u?)(int|float)(2|4|8|16|32|64)", name):
        unsigned, kind, bits = found.groups()
        element = f"{unsigned and 'u'}{kind[0]}{bits}"
    elif found := re.fullmatch(r"float(4|8)_(e\d+m\d+\w*)", name):  # f8E4M3FN, f4E2M1FN
        element = f"f{found[1]}{found[2].upper()}"
    else:
        element = _ELEMENTS.get(name)
    return f"tensor<{dims}{element}>" if element else None


def show_keys(keys: Iterable[str]) -> str:
    """``{'a', 'b'}``, sorted (a set's own repr is in hash order)."""
    return "{" + ", ".join(repr(k) for k in sorted(keys)) + "}"
