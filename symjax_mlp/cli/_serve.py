"""``symjax-mlp serve ARTIFACT --port N``: an artifact over HTTP, a micro-batcher underneath.

With ``--ray``, the same app on Ray Serve replicas behind Ray's HTTP proxy. The handler
switches JAX to :func:`~symjax_mlp.serving.latency_mode` first (``--dispatch async`` keeps
JAX's default), serves until SIGINT or SIGTERM and exits 0 after a clean shutdown. Once the
model is compiled it calls ``gc.freeze()``, so that Python's full collections, which pause
every request in flight, need not walk JAX and the model again.
"""

from __future__ import annotations

import argparse
import gc

from symjax_mlp.cli._args import add_trust_options, keywords, load_options, positive

#: the options passed to :func:`~symjax_mlp.serving.serve` under their own names
_SERVE = (
    "host port runtime max_batch max_queue max_body_bytes body_timeout max_inflight_bytes "
    "max_connections log_level entry params_as_constants"
)


#: the options passed to ``ray_app`` (``--ray``) under their own names
_RAY = (
    "host port runtime max_batch max_queue max_body_bytes body_timeout max_inflight_bytes "
    "entry params_as_constants replicas dispatch"
)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(
            f"--port must be an int from 0 to 65535 (0: any free port); got {text!r}"
        )
    return int(text)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Declares ``serve`` and its options on the CLI's subcommands."""
    help = "serve an artifact over HTTP (JSON and .npy), with a micro-batcher underneath"
    p = sub.add_parser(
        "serve",
        help=help,
        description=help + ". Endpoints: POST /predict, GET /health, GET /metrics, "
        "GET /signature. Needs the symjax_mlp[serve] extra.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("path", help="the artifact directory (symjax-mlp export)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=_port, default=8000, help="the port (0: any free port)")
    p.add_argument("--runtime", choices=("jax", "iree"), default="jax", help="how to run it")
    p.add_argument(
        "--max-batch",
        type=positive("--max-batch"),
        default=None,
        help="most rows per model call (None: 64, or the artifact's static batch)",
    )
    p.add_argument(
        "--max-queue", type=positive("--max-queue"), default=1024, help="waiting requests"
    )
    p.add_argument(
        "--max-body-bytes",
        type=positive("--max-body-bytes"),
        default=64 * 2**20,
        metavar="BYTES",
        help="larger request bodies are refused (413)",
    )
    p.add_argument(
        "--body-timeout",
        type=positive("--body-timeout", float),
        default=60.0,
        metavar="SECONDS",
        help="a client that sends nothing of its body for this long is answered 408 and dropped",
    )
    p.add_argument(
        "--max-inflight-bytes",
        type=positive("--max-inflight-bytes"),
        default=None,
        metavar="BYTES",
        help="the most bytes all request bodies in flight may hold (503 past it; None: 4 times "
        "--max-body-bytes)",
    )
    p.add_argument(
        "--max-connections",
        type=positive("--max-connections"),
        default=1000,
        help="the most connections at once (503 past it)",
    )
    p.add_argument(
        "--dispatch",
        choices=("sync", "async"),
        default="sync",
        help="JAX's CPU dispatch: sync is the latency mode (calls run on the calling thread)",
    )
    p.add_argument(
        "--params-as-constants",
        action="store_true",
        help="compile the weights into each bucket's program (JAX runtime, one device): "
        "a call passes only its inputs",
    )
    p.add_argument("--entry", help="the entry point to serve (default: the artifact's default)")
    add_trust_options(p)
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")
    p.add_argument(
        "--ray",
        action="store_true",
        help="serve it as Ray Serve replicas, each a batcher, behind Ray's HTTP proxy on "
        "--host/--port (the symjax_mlp[ray] extra); --max-connections and --log-level are "
        "uvicorn's and do not apply",
    )
    p.add_argument(
        "--replicas", type=positive("--replicas"), default=2, help="with --ray: replicas"
    )
    p.add_argument(
        "--replica-cpus",
        type=positive("--replica-cpus", float),
        default=1.0,
        help="with --ray: the CPUs Ray reserves for each replica (Ray's num_cpus)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="with --ray: the Ray cluster to join (ray.init's address: auto, local, "
        "HOST:PORT; None: Ray's own rule, RAY_ADDRESS or a cluster running here, else a new one)",
    )
    p.set_defaults(handler=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Serves ``args.path`` until interrupted; returns 0 after a clean shutdown."""
    from symjax_mlp.serving import latency_mode, serve
    from symjax_mlp.serving._app import _bind, _print_ready

    if args.dispatch == "sync":
        latency_mode()  # before anything starts JAX's CPU backend
    say = _print_ready(args.path)

    def ready(url: str) -> None:
        gc.freeze()  # loaded and compiled: see the module's docstring
        say(url)

    if args.ray:
        from symjax_mlp.serving._ray import serve_on_ray

        if args.port == 0:  # Ray's proxy takes a port number: a free one, found here
            with _bind(args.host, 0) as s:  # a host not this machine's: a ConfigError
                args.port = s.getsockname()[1]
        options = keywords(args, _RAY)
        options["ray_actor_options"] = {"num_cpus": args.replica_cpus}
        serve_on_ray(
            args.path, ready=say, address=args.ray_address, **options, **load_options(args)
        )
    else:
        serve(args.path, ready=ready, **keywords(args, _SERVE), **load_options(args))
    print("symjax-mlp serve: shut down cleanly", flush=True)
    return 0
