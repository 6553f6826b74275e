"""Hostile artifacts that are consistent: every file agrees with every other, every checksum
matches, only the program (or the weights) is what a stranger chose.

:func:`resign` writes a copy of an artifact whose StableHLO module is edited as text: the
module is parsed, serialized as a StableHLO portable artifact (what ``jax.export`` writes),
put into a re-serialized ``model.jaxexport``, and every checksum in the manifest updated. So
the loader sees exactly what an attacker with ``jax.export`` and a text editor can make.

:data:`PROGRAMS` are such edits (a host callback, a LAPACK call with a result buffer smaller
than its input, recursion, a loop of 2**31 steps, a tensor of 10**10 elements, ...), each a
function of the module's text; :func:`hostile_exports` makes the ones ``sm.export`` itself can
write (a ``while_loop`` with a huge bound, ``jnp.linalg``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

JAXEXPORT, MLIRBC, MANIFEST = "model.jaxexport", "model.mlirbc", "manifest.json"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def module_text(art: Path) -> str:
    """The StableHLO text of an artifact's module, without locations."""
    import jax

    exported = jax.export.deserialize(bytearray((art / JAXEXPORT).read_bytes()))
    return _strip_locations(exported.mlir_module())


def _strip_locations(text: str) -> str:
    text = re.sub(r" loc\((?:[^()]|\([^()]*\))*\)", "", text)
    return "\n".join(line for line in text.splitlines() if not line.startswith("#loc"))


def serialize_module(text: str) -> bytes:
    """StableHLO text as a portable artifact (VHLO bytecode), as ``jax.export`` writes it."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import _jax
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import stablehlo as hlo

    with jax_mlir.make_ir_context():
        module = ir.Module.parse(text)
        target = hlo.get_version_from_compatibility_requirement(
            hlo.StablehloCompatibilityRequirement.WEEK_4
        )
        return bytes(_jax.mlir.serialize_portable_artifact(module, target, True))


def resign(
    src: Path, dst: Path, *, module: bytes | None = None, files: dict[str, bytes] | None = None,
    manifest: Callable[[dict], None] | None = None, **fields,
) -> Path:  # fmt: skip
    """A copy of ``src`` at ``dst`` with a new module (and ``Exported`` fields), other file
    contents and manifest edits, every checksum updated: consistent, and hostile."""
    import jax

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    exported = jax.export.deserialize(bytearray((src / JAXEXPORT).read_bytes()))
    new = dict(files or {})
    if module is not None or fields:
        if module is not None:
            fields["mlir_module_serialized"] = module
            new[MLIRBC] = module
        forged = dataclasses.replace(exported, **fields)
        new[JAXEXPORT] = bytes(forged.serialize())
    m = json.loads((src / MANIFEST).read_text())
    for name, data in new.items():
        (dst / name).write_bytes(data)
        m["files"][name] = {"sha256": _sha(data), "bytes": len(data)}
    if manifest is not None:
        manifest(m)
    (dst / MANIFEST).write_text(json.dumps(m, indent=2))
    return dst


def forge(src: Path, dst: Path, edit: Callable[[str], str]) -> Path:
    """``src`` with its module's text edited by ``edit``, consistent and re-signed."""
    text = edit(module_text(src))
    return resign(src, dst, module=serialize_module(text))


# -- hostile programs: edits of a static-shape MLP module ----------------------------------------
# The base is sm.mlp((4, 2)) on (2, 3) float32 inputs exported with batch=None; its @relu
# function takes and returns tensor<2x4xf32>.
RELU_OUT = re.compile(r"(    %(\d+) = stablehlo\.maximum %arg0, %(\w+) : tensor<2x4xf32>\n)")


def in_relu(text: str, body: str) -> str:
    """Inserts ``body`` into @relu, whose result then goes through ``%hostile``."""
    head, sep, tail = text.partition("func.func private @relu(")
    m = RELU_OUT.search(tail)
    assert sep and m, "not the base MLP module"
    result = f"%{m.group(2)}"
    tail = tail.replace(m.group(1), m.group(1) + body.replace("%IN", result), 1)
    tail = tail.replace(f"return {result} :", "return %hostile :", 1)
    return head + sep + tail


def callback(text: str) -> str:
    """A host callback: calls whatever Python function is registered at index 0 here."""
    return in_relu(text, (
        "    %hostile = stablehlo.custom_call @xla_ffi_python_cpu_callback(%IN) "
        "{backend_config = \"\", has_side_effect = true, "
        "mhlo.backend_config = {index = 0 : ui64}} : (tensor<2x4xf32>) -> tensor<2x4xf32>\n"
    ))  # fmt: skip


def lapack_small_result(text: str) -> str:
    """LAPACK getrf (LU) of a 512x512 matrix into result buffers sized for 1x1."""
    return in_relu(text, (
        "    %big = stablehlo.broadcast_in_dim %IN, dims = [] "
        ": (tensor<f32>) -> tensor<512x512xf32>\n"
        "    %lu:3 = stablehlo.custom_call @lapack_sgetrf_ffi(%big) {api_version = 4 : i32, "
        "operand_layouts = [dense<[0, 1]> : tensor<2xindex>], result_layouts = [dense<[0, 1]> "
        ": tensor<2xindex>, dense<0> : tensor<1xindex>, dense<> : tensor<0xindex>]} : "
        "(tensor<512x512xf32>) -> (tensor<1x1xf32>, tensor<1xi32>, tensor<i32>)\n"
        "    %hostile = stablehlo.broadcast_in_dim %lu#0, dims = [0, 1] "
        ": (tensor<1x1xf32>) -> tensor<2x4xf32>\n"
    ).replace("%IN", "%cst"))  # fmt: skip


def unknown_custom_call(text: str) -> str:
    return in_relu(text, (
        "    %hostile = stablehlo.custom_call @my_native_kernel(%IN) {api_version = 4 : i32} "
        ": (tensor<2x4xf32>) -> tensor<2x4xf32>\n"
    ))  # fmt: skip


def recursion(text: str) -> str:
    """@relu calls itself: XLA's inliner never finishes (a segfault, once)."""
    return in_relu(text, (
        "    %hostile = func.call @relu(%IN) : (tensor<2x4xf32>) -> tensor<2x4xf32>\n"
    ))  # fmt: skip


def endless_loop(text: str) -> str:
    """A counted loop of 2**31 - 1 steps."""
    return in_relu(text, (
        "    %c0 = stablehlo.constant dense<0> : tensor<i32>\n"
        "    %c1 = stablehlo.constant dense<1> : tensor<i32>\n"
        "    %cmax = stablehlo.constant dense<2147483646> : tensor<i32>\n"
        "    %w:2 = stablehlo.while(%i = %c0, %v = %IN) : tensor<i32>, tensor<2x4xf32>\n"
        "    cond {\n"
        "      %p = stablehlo.compare LT, %i, %cmax, SIGNED "
        ": (tensor<i32>, tensor<i32>) -> tensor<i1>\n"
        "      stablehlo.return %p : tensor<i1>\n"
        "    } do {\n"
        "      %n = stablehlo.add %i, %c1 : tensor<i32>\n"
        "      %v2 = stablehlo.add %v, %v : tensor<2x4xf32>\n"
        "      stablehlo.return %n, %v2 : tensor<i32>, tensor<2x4xf32>\n"
        "    }\n"
        "    %hostile = stablehlo.add %w#1, %IN : tensor<2x4xf32>\n"
    ))  # fmt: skip


def uncounted_loop(text: str) -> str:
    """A loop that runs while its value is finite (v <- v * v + 2: 8 steps from 0 to inf):
    its trip count is data."""
    return in_relu(text, (
        "    %w = stablehlo.while(%v = %IN) : tensor<2x4xf32>\n"
        "    cond {\n"
        "      %z = stablehlo.constant dense<0.0> : tensor<f32>\n"
        "      %r = stablehlo.reduce(%v init: %z) applies stablehlo.add across dimensions = [0, 1] "
        ": (tensor<2x4xf32>, tensor<f32>) -> tensor<f32>\n"
        "      %p = stablehlo.is_finite %r : (tensor<f32>) -> tensor<i1>\n"
        "      stablehlo.return %p : tensor<i1>\n"
        "    } do {\n"
        "      %two = stablehlo.constant dense<2.0> : tensor<2x4xf32>\n"
        "      %sq = stablehlo.multiply %v, %v : tensor<2x4xf32>\n"
        "      %v2 = stablehlo.add %sq, %two : tensor<2x4xf32>\n"
        "      stablehlo.return %v2 : tensor<2x4xf32>\n"
        "    }\n"
        "    %hostile = stablehlo.add %w, %IN : tensor<2x4xf32>\n"
    ))  # fmt: skip


def huge_compute(text: str) -> str:
    """10**10 elements summed: under a minute of work from a module of a few hundred bytes."""
    return in_relu(text, (
        "    %big = stablehlo.iota dim = 0 : tensor<100000x100000xf32>\n"
        "    %z = stablehlo.constant dense<0.0> : tensor<f32>\n"
        "    %s = stablehlo.reduce(%big init: %z) applies stablehlo.add across dimensions = [0, 1] "
        ": (tensor<100000x100000xf32>, tensor<f32>) -> tensor<f32>\n"
        "    %sb = stablehlo.broadcast_in_dim %s, dims = [] : (tensor<f32>) -> tensor<2x4xf32>\n"
        "    %hostile = stablehlo.add %IN, %sb : tensor<2x4xf32>\n"
    ))  # fmt: skip


def call_explosion(text: str) -> str:
    """40 functions each calling the next twice: 2**40 inlined copies of one op."""
    funcs = []
    for i in range(40):
        callee = f"@boom{i + 1}" if i < 39 else None
        body = (
            f"    %a = func.call {callee}(%arg0) : (tensor<2x4xf32>) -> tensor<2x4xf32>\n"
            f"    %b = func.call {callee}(%a) : (tensor<2x4xf32>) -> tensor<2x4xf32>\n"
            if callee else "    %b = stablehlo.add %arg0, %arg0 : tensor<2x4xf32>\n"
        )  # fmt: skip
        funcs.append(
            f"  func.func private @boom{i}(%arg0: tensor<2x4xf32>) -> tensor<2x4xf32> {{\n"
            f"{body}    return %b : tensor<2x4xf32>\n  }}\n"
        )
    text = in_relu(text, (
        "    %hostile = func.call @boom0(%IN) : (tensor<2x4xf32>) -> tensor<2x4xf32>\n"
    ))  # fmt: skip
    return text[: text.rindex("}")] + "".join(funcs) + "}\n"


def _reduced(n: int, body: str) -> str:
    """@relu's result plus the sum of ``iota(n)`` by a reducer whose body is ``body`` (its
    arguments ``%a``, ``%b``; its result ``%r``)."""
    return (
        f"    %big = stablehlo.iota dim = 0 : tensor<{n}xf32>\n"
        "    %z = stablehlo.constant dense<0.0> : tensor<f32>\n"
        '    %s = "stablehlo.reduce"(%big, %z) ({\n'
        "    ^bb0(%a: tensor<f32>, %b: tensor<f32>):\n"
        f"{body}"
        '      "stablehlo.return"(%r) : (tensor<f32>) -> ()\n'
        f"    }}) {{dimensions = array<i64: 0>}} : (tensor<{n}xf32>, tensor<f32>) -> tensor<f32>\n"
        "    %sb = stablehlo.broadcast_in_dim %s, dims = [] : (tensor<f32>) -> tensor<2x4xf32>\n"
        "    %hostile = stablehlo.add %IN, %sb : tensor<2x4xf32>\n"
    )


def reduce_call_bomb(text: str) -> str:
    """A 2**24-element reduce whose body calls a 2**16-element function: charged once, it
    was 3.4e7 element operations; XLA runs it per element (~4e12)."""
    text = in_relu(text, _reduced(1 << 24, (
        "      %c = func.call @bomb(%a) : (tensor<f32>) -> tensor<f32>\n"
        "      %r = stablehlo.add %c, %b : tensor<f32>\n"
    )))  # fmt: skip
    bomb = (
        "  func.func private @bomb(%x: tensor<f32>) -> tensor<f32> {\n"
        "    %v = stablehlo.broadcast_in_dim %x, dims = [] : (tensor<f32>) -> tensor<65536xf32>\n"
        "    %z = stablehlo.constant dense<0.0> : tensor<f32>\n"
        "    %s = stablehlo.reduce(%v init: %z) applies stablehlo.add across dimensions = [0] "
        ": (tensor<65536xf32>, tensor<f32>) -> tensor<f32>\n"
        "    return %s : tensor<f32>\n  }\n"
    )
    return text[: text.rindex("}")] + bomb + "}\n"


def loop_in_reducer(text: str) -> str:
    """A counted loop of 4 steps inside a reduce's body: XLA's CPU compiler aborted
    (SIGABRT) at the self-test."""
    return in_relu(text, _reduced(8, (
        "      %c0 = stablehlo.constant dense<0> : tensor<i32>\n"
        '      %w:2 = "stablehlo.while"(%c0, %a) ({\n'
        "      ^bb0(%i: tensor<i32>, %v: tensor<f32>):\n"
        "        %lim = stablehlo.constant dense<4> : tensor<i32>\n"
        "        %p = stablehlo.compare LT, %i, %lim, SIGNED : "
        "(tensor<i32>, tensor<i32>) -> tensor<i1>\n"
        '        "stablehlo.return"(%p) : (tensor<i1>) -> ()\n'
        "      }, {\n"
        "      ^bb0(%i: tensor<i32>, %v: tensor<f32>):\n"
        "        %one = stablehlo.constant dense<1> : tensor<i32>\n"
        "        %n = stablehlo.add %i, %one : tensor<i32>\n"
        "        %v2 = stablehlo.add %v, %b : tensor<f32>\n"
        '        "stablehlo.return"(%n, %v2) : (tensor<i32>, tensor<f32>) -> ()\n'
        "      }) : (tensor<i32>, tensor<f32>) -> (tensor<i32>, tensor<f32>)\n"
        "      %r = stablehlo.add %w#1, %b : tensor<f32>\n"
    )))  # fmt: skip


def infeed(text: str) -> str:
    """An op outside the allow-list that talks to the host."""
    return in_relu(text, (
        "    %tok = stablehlo.create_token : !stablehlo.token\n"
        "    %tok2 = \"stablehlo.outfeed\"(%IN, %tok) {outfeed_config = \"\"} "
        ": (tensor<2x4xf32>, !stablehlo.token) -> !stablehlo.token\n"
        "    %hostile = stablehlo.add %IN, %IN : tensor<2x4xf32>\n"
    ))  # fmt: skip


HUGE_CONSTANT = "    %hs = stablehlo.constant dense<[100000, 100000]> : tensor<2xi32>\n"
HUGE_PAST_BATCH_2 = (  # (100000 * (b - 2)**2, 100000): nothing at b = 2, 10**10 at b = 3
    "    %two = stablehlo.constant dense<2> : tensor<i32>\n"
    "    %k = stablehlo.constant dense<100000> : tensor<i32>\n"
    "    %k1 = stablehlo.constant dense<100000> : tensor<1xi32>\n"
    "    %d = stablehlo.subtract %arg0, %two : tensor<i32>\n"
    "    %d2 = stablehlo.multiply %d, %d : tensor<i32>\n"
    "    %rows = stablehlo.multiply %d2, %k : tensor<i32>\n"
    "    %rows1 = stablehlo.reshape %rows : (tensor<i32>) -> tensor<1xi32>\n"
    "    %hs = stablehlo.concatenate %rows1, %k1, dim = 0 "
    ": (tensor<1xi32>, tensor<1xi32>) -> tensor<2xi32>\n"
)


def _summed(shape: str, out: str, dims: str, kind: str) -> str:
    """Lines that sum an iota of the dynamic shape ``%hs`` (made by ``shape``) into ``%s``
    and add it to ``out`` (of ``kind``, whose dynamic shape is ``dims``) as ``%hostile``."""
    return shape + (
        "    %big = stablehlo.dynamic_iota %hs, dim = 0 : (tensor<2xi32>) -> tensor<?x?xf32>\n"
        "    %z = stablehlo.constant dense<0.0> : tensor<f32>\n"
        "    %s = stablehlo.reduce(%big init: %z) applies stablehlo.add across dimensions = [0, 1] "
        ": (tensor<?x?xf32>, tensor<f32>) -> tensor<f32>\n"
        f"    %sb = stablehlo.dynamic_broadcast_in_dim %s, {dims}, dims = [] "
        f": (tensor<f32>, tensor<2xi32>) -> {kind}\n"
        f"    %hostile = stablehlo.add {out}, %sb : {kind}\n"
    )


def dynamic_huge(text: str, shape: str = HUGE_CONSTANT) -> str:
    """For the symbolic base: a tensor whose dynamic shape is the constant (100000, 100000),
    which only shape refinement at the call makes static (so no load-time bound sees it).
    ``shape``: lines that make that shape ``%hs`` (``tensor<2xi32>``; ``%arg0`` is ``b``)."""
    head, sep, tail = text.partition("func.func private @relu(")
    m = re.search(r"    %(\d+) = stablehlo\.maximum %arg1, %(\d+) : tensor<\?x4xf32>\n", tail)
    dims = re.search(r"%(\d+) = stablehlo\.concatenate [^\n]*-> tensor<2xi32>", tail)
    assert sep and m and dims, "not the symbolic base MLP module"
    out = f"%{m.group(1)}"
    body = _summed(shape, out, f"%{dims.group(1)}", "tensor<?x4xf32>")
    tail = tail.replace(m.group(0), m.group(0) + body, 1)
    tail = tail.replace(f"return {out} :", "return %hostile :", 1)
    return head + sep + tail


def huge_past_batch_2(text: str) -> str:
    """:func:`dynamic_huge` of shape (100000 * (b - 2)**2, 100000): empty for the self-test's
    batch of 2, 10**10 elements for a batch of 3 (a shape that grows with the batch)."""
    return dynamic_huge(text, HUGE_PAST_BATCH_2)


def vjp_dynamic_huge(text: str) -> str:
    """For the VJP module of the symbolic base (``vjp_order=1``): :func:`dynamic_huge`'s
    tensor added to the cotangent of the input, the last result of its wrapped main."""
    head, sep, tail = text.partition("func.func private @_wrapped_jax_export_main(")
    m = re.search(r"\n    return ([^\n]*), (%\w+) : [^\n]*, tensor<\?x(\d+)xf32>\n", tail)
    assert sep and m, "not the VJP module of the symbolic base MLP"
    kind = f"tensor<?x{m.group(3)}xf32>"
    dims = (
        f"    %cw = stablehlo.constant dense<{m.group(3)}> : tensor<1xi32>\n"
        "    %bw = stablehlo.reshape %arg0 : (tensor<i32>) -> tensor<1xi32>\n"
        "    %dims = stablehlo.concatenate %bw, %cw, dim = 0 "
        ": (tensor<1xi32>, tensor<1xi32>) -> tensor<2xi32>\n"
    )
    body = dims + _summed(HUGE_CONSTANT, m.group(2), "%dims", kind)
    ret = m.group(0).replace(f", {m.group(2)} :", ", %hostile :")
    tail = tail.replace(m.group(0), "\n" + body + ret.removeprefix("\n"), 1)
    return head + sep + tail


def forge_vjp(src: Path, dst: Path, edit: Callable[[str], str]) -> Path:
    """``src`` (exported with ``vjp_order=1``) with the text of its VJP module edited by
    ``edit``, consistent and re-signed: the module that runs forward (``model.mlirbc``) is
    unchanged; ``model.jaxexport`` carries the edited VJP, which ``jax.grad`` runs."""
    import jax

    exported = jax.export.deserialize(bytearray((src / JAXEXPORT).read_bytes()))
    vjp = exported.vjp()
    text = edit(_strip_locations(vjp.mlir_module()))
    forged_vjp = dataclasses.replace(vjp, mlir_module_serialized=serialize_module(text))
    forged = dataclasses.replace(exported, _get_vjp=lambda _: forged_vjp)
    return resign(src, dst, files={JAXEXPORT: bytes(forged.serialize(vjp_order=1))})


def harmless(text: str) -> str:
    """An allowed edit: the output plus itself (a model, just not the exported one)."""
    return in_relu(text, "    %hostile = stablehlo.add %IN, %IN : tensor<2x4xf32>\n")


PROGRAMS: dict[str, Callable[[str], str]] = {
    "callback": callback,
    "lapack_small_result": lapack_small_result,
    "unknown_custom_call": unknown_custom_call,
    "recursion": recursion,
    "endless_loop": endless_loop,
    "uncounted_loop": uncounted_loop,
    "huge_compute": huge_compute,
    "call_explosion": call_explosion,
    "outfeed": infeed,
    "reduce_call_bomb": reduce_call_bomb,
    "loop_in_reducer": loop_in_reducer,
}
REFUSED_AS = {  # the allow= key each one is refused by
    "callback": "custom_call:xla_ffi_python_cpu_callback",
    "lapack_small_result": "custom_call:lapack_sgetrf_ffi",
    "unknown_custom_call": "custom_call:my_native_kernel",
    "recursion": "recursion",
    "endless_loop": "while",
    "uncounted_loop": "while",
    "huge_compute": "compute",
    "call_explosion": "compute",
    "outfeed": "outfeed",
    "reduce_call_bomb": "compute",
    "loop_in_reducer": "control_in_reducer",
}


def base(out: Path, *, batch: str | None = None, vjp_order: int = 0):
    """The MLP every program edits (static shapes; ``batch="b"``: the symbolic one for
    :func:`dynamic_huge`; ``vjp_order=1``: with the VJP module :func:`forge_vjp` edits), and
    its input: ``(path, x)``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import symjax_mlp as sm

    net = sm.mlp((4, 2))
    x = jnp.asarray(np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3))
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    art = sm.export(h, out, example=x, batch=batch, vjp_order=vjp_order, overwrite=True)
    return art.path, np.asarray(x)


def hostile_exports(out: Path) -> dict[str, Path]:
    """Hostile artifacts ``sm.export`` writes itself (jax.export checks nothing of these)."""
    import jax
    import jax.numpy as jnp

    import symjax_mlp as sm

    x = jnp.ones((2, 3), jnp.float32)

    def endless(p, x):  # 2**31 - 1 steps once x[0, 0] > 100 (export's self-test: 0 steps)
        bound = jnp.where(x[0, 0] > 100, 2**31 - 1, 0)

        def body(c):
            return c[0] + 1, c[1] * p["w"]

        return jax.lax.while_loop(lambda c: c[0] < bound, body, (0, x))[1]

    def data_loop(p, x):  # a loop whose trip count is data
        return jax.lax.while_loop(lambda v: jnp.sum(v) < 1e30, lambda v: v * p["w"] + 1, x)

    def linalg(p, x):  # LAPACK custom calls, which jax.export allows
        return jnp.linalg.inv(x.T @ x + p["w"] * jnp.eye(3))

    made = {}
    for name, fn in (("export_endless", endless), ("export_data_loop", data_loop),
                     ("export_linalg", linalg)):  # fmt: skip
        h = sm.hybridize(fn, {"w": jnp.float32(1.5)})
        made[name] = sm.export(h, out / name, example=x, batch=None, overwrite=True).path
    return made
