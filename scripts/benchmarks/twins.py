"""The same MLP outside Flax, on Flax's params: plain ``jax.numpy``, and PyTorch.

:func:`mlp_jnp` is the benchmark's ``jnp_eager`` row (op-by-op dispatch without Flax's module
machinery). :func:`torch_mlp` is the PyTorch twin (an ``nn.Sequential`` with the same
weights), which :func:`torch_rows` runs eager, ``torch.jit.script``'ed and ``torch.compile``'d
with the same threads and device, and the serving benchmark's latency rows in their own
processes; torch is imported only there, so the rest of the benchmark runs without it
(``symjax_mlp[torch]``).
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import symjax_mlp as sm
from benchmarks.timing import Timing, usable_cores


def act(name: str | None) -> Callable[[jax.Array], jax.Array]:
    """The :mod:`jax.nn` activation ``name`` (``None``: the identity), as ``sm.mlp`` takes it."""
    if name is None:
        return lambda x: x
    if name not in sm.ACTIVATIONS:
        raise sm.ConfigError(f"unknown activation {name!r}; expected one of {sm.ACTIVATIONS}")
    return getattr(jax.nn, name)


def dense_layers(variables: Any) -> list[tuple[Any, Any]]:
    """``(kernel, bias)`` of each ``Dense`` layer of an :func:`~symjax_mlp.mlp`, in order."""
    layers = variables["params"]
    names = sorted(layers, key=lambda k: int(k.rsplit("_", 1)[1]))  # layers_10 after layers_9
    return [(layers[name]["kernel"], layers[name]["bias"]) for name in names]


def mlp_jnp(variables: Any, x: jax.Array, activation: str | None) -> jax.Array:
    """The MLP as plain jax.numpy on Flax's params: op-by-op dispatch without Flax."""
    layers = dense_layers(variables)
    for i, (kernel, bias) in enumerate(layers):
        x = x @ kernel + bias
        if i < len(layers) - 1:
            x = act(activation)(x)
    return x


def torch_mlp(variables: Any, activation: str | None) -> Any:
    """The PyTorch twin of ``sm.mlp(...)`` with ``variables``: an ``nn.Sequential`` of
    ``nn.Linear`` and the activation, in eval mode on the CPU.

    Raises:
      ImportError: torch is not installed.
      ConfigError: no PyTorch twin for ``activation``.
    """
    import torch  # optional extra: symjax_mlp[torch]

    acts = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh, "sigmoid": torch.nn.Sigmoid}
    acts |= {"gelu": functools.partial(torch.nn.GELU, approximate="tanh"), "silu": torch.nn.SiLU}
    if activation not in acts:
        raise sm.ConfigError(
            f"no PyTorch twin for activation {activation!r}; the twins have {sorted(acts)}"
        )
    layers = dense_layers(variables)
    modules: list[Any] = []
    for i, (kernel, bias) in enumerate(layers):
        kernel = np.array(kernel)  # writable copies: torch shares memory
        lin = torch.nn.Linear(*kernel.shape)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(kernel.T.copy()))
            lin.bias.copy_(torch.from_numpy(np.array(bias)))
        modules.append(lin)
        if i < len(layers) - 1:
            modules.append(acts[activation]())
    return torch.nn.Sequential(*modules).eval()


def torch_rows(
    variables: Any, x: jax.Array, activation: str | None, notes: list[str], stages: dict
) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[Any], Any]], Callable[[], None]]:
    """PyTorch eager / jit.script / compile with the same weights, threads and device.

    Appends what it used (version, threads, device) and any mode it had to skip to ``notes``,
    and the one-off cost of ``jit.script`` and ``compile`` (first call included) to ``stages``.

    Returns:
      The timed callables, their syncs, and a function that restores torch's thread count
      (set to JAX's for the comparison).

    Raises:
      ImportError: torch is not installed.
      ConfigError: no PyTorch twin for ``activation`` (a ValueError).
    """
    import torch  # optional extra: symjax_mlp[torch]

    gpu = jax.default_backend() == "gpu" and torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    net = torch_mlp(variables, activation).to(device)
    old_threads = torch.get_num_threads()
    if not gpu:
        threads = usable_cores()
        torch.set_num_threads(threads)  # XLA:CPU's intra-op pool uses every usable core
        notes.append(f"torch: {torch.__version__}, {threads} threads, device cpu")
    else:
        notes.append(f"torch: {torch.__version__}, device {torch.cuda.get_device_name()}")
    tx = torch.from_numpy(np.array(x)).to(device)
    sync = (lambda _: torch.cuda.synchronize()) if gpu else (lambda _: None)
    modes = {"torch_eager": net}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jit.script is deprecated in torch 2.x; still timed
        for key, make in (("torch_script", torch.jit.script), ("torch_compile", torch.compile)):
            try:
                t0 = time.perf_counter()
                modes[key] = make(net)
                modes[key](tx)  # torch.compile compiles on the first call
                stages[key] = Timing(key, 1, (time.perf_counter() - t0,))
            except Exception as e:  # e.g. no C++ compiler for inductor: keep the other rows
                notes.append(f"{key} row skipped: {type(e).__name__}: {str(e)[:200]}")
    want = np.asarray(mlp_jnp(variables, x, activation))
    got = net(tx).detach().cpu().numpy()
    if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
        notes.append(f"torch output differs from JAX by {np.abs(got - want).max():.2e}")

    def nograd(m: Any) -> Callable[[], Any]:
        def call() -> Any:
            with torch.no_grad():
                return m(tx)

        return call

    fns = {key: nograd(m) for key, m in modes.items()}
    return fns, dict.fromkeys(fns, sync), lambda: torch.set_num_threads(old_threads)
