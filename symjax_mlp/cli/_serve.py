"""``symjax-mlp serve ARTIFACT --port N``: an artifact over HTTP (with ``--ray``, on Ray Serve
replicas), served until SIGINT or SIGTERM. Once the model is compiled it calls ``gc.freeze()``:
Python's full collections, which pause every request in flight, need not walk JAX again.
"""

from __future__ import annotations

import argparse
import gc

from symjax_mlp.cli import _args
from symjax_mlp.cli._args import count, port, positive

#: the options passed to ``serve`` (with ``--ray``, ``serve_on_ray``) under their own names
_BOTH = (
    "host port runtime max_batch max_queue max_body_bytes body_timeout max_inflight_bytes "
    "entry params_as_constants warm_up_timeout "
)
_SERVE = _BOTH + "max_connections log_level request_timeout"
_RAY = _BOTH + "replicas dispatch"
#: the options only one of the two servers has (by --ray): refused with the other
_ONLY = {
    False: ("replicas", "replica_cpus", "ray_address"),
    True: ("max_connections", "log_level", "request_timeout"),
}
_DEFAULTS = {
    "log_level": "warning",
    "max_connections": 1000,
    "request_timeout": 60.0,
    "replicas": 2,
    "replica_cpus": 1.0,
}


_HELP = "serve an artifact over HTTP (JSON and .npy), with a micro-batcher underneath"
_MORE = (
    ".\nEndpoints: POST /predict, GET /health, GET /metrics, GET /signature. Needs the "
    'symjax_mlp[serve] extra.\nA /predict body is JSON, {"inputs": [[...], ...]} (rows first; '
    '{"inputs": {"args[0]": ..., ...}} by name), or .npy bytes (application/x-npy).'
)
_OPTIONS = (
    ("path", {"help": "the artifact directory (symjax-mlp export)"}),
    ("--host", {"default": "127.0.0.1", "help": "the address to listen on"}),
    ("--port", {"type": port, "default": 8000, "help": "the port (0: any free port)"}),
    ("--runtime", {"choices": ("jax", "iree"), "default": "jax", "help": "how to run it"}),
    ("--max-batch", {"type": count, "help": "most rows per model call (None: 64, or the "
     "artifact's static batch)"}),
    ("--max-queue", {"type": count, "default": 1024, "help": "waiting requests"}),
    ("--warm-up-timeout", {"type": positive, "default": 300.0, "metavar": "SECONDS", "help":
     "the most the batcher's warm-up (each batch size compiled, run on zero rows) may take "
     "before serving is refused (inf: no limit)"}),
    ("--max-body-bytes", {"type": count, "default": 64 * 2**20, "metavar": "BYTES", "help":
     "larger request bodies are refused (413)"}),
    ("--body-timeout", {"type": positive, "default": 60.0, "metavar": "SECONDS", "help": "a "
     "client that sends nothing of its body for this long, or all of it slower than 500 bytes/s "
     "past this long, or not all of it within 10 times this long, is answered 408 and dropped; "
     "one that reads nothing of its answer for this long, dropped"}),
    ("--max-inflight-bytes", {"type": count, "metavar": "BYTES", "help": "the most bytes all "
     "request bodies in flight, and answers their clients have not read, may hold (503 past "
     "it; None: 4 times --max-body-bytes)"}),
    ("--request-timeout", {"type": positive, "metavar": "SECONDS", "help": "a request the model "
     "has not answered in this long is answered 504; /health answers 503 while a batch runs "
     f"longer (default: {_DEFAULTS['request_timeout']:g})"}),
    ("--max-connections", {"type": count, "help": "the most connections at once (503 past "
     "it, as a connection opens; "
     f"default: {_DEFAULTS['max_connections']})"}),
    ("--dispatch", {"choices": ("sync", "async"), "default": "sync", "help": "JAX's CPU "
     "dispatch: sync is the latency mode (calls run on the calling thread)"}),
    ("--params-as-constants", {"action": "store_true", "help": "compile the weights into each "
     "bucket's program (JAX runtime, one device): a call passes only its inputs"}),
    ("--entry", {"help": "the entry point to serve (default: the artifact's default)"}),
    *_args.TRUST,
    ("--log-level", {"help": f"uvicorn's log level (default: {_DEFAULTS['log_level']})"}),
    ("--ray", {"action": "store_true", "help": "serve it as Ray Serve replicas, each a batcher, "
     "behind Ray's HTTP proxy on --host/--port (the symjax_mlp[ray] extra), each answering on "
     "Ray's own event loop (RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 in its environment); "
     "--max-connections and --log-level are uvicorn's: refused with it"}),
    ("--replicas", {"type": count, "help": "with --ray: replicas (default: "
     f"{_DEFAULTS['replicas']})"}),
    ("--replica-cpus", {"type": positive, "help": "with --ray: the CPUs Ray reserves for each "
     f"replica (Ray's num_cpus; default: {_DEFAULTS['replica_cpus']:g})"}),
    ("--ray-address", {"metavar": "ADDRESS", "help": "with --ray: the Ray cluster to join "
     "(ray.init's address: auto, local, HOST:PORT; None: Ray's own rule, RAY_ADDRESS or a "
     "cluster running here, else a new one)"}),
)  # fmt: skip


def run(args: argparse.Namespace) -> None:
    """Serves ``args.path`` until interrupted (exit 0 after a clean shutdown)."""
    from symjax_mlp.serving import serve
    from symjax_mlp.serving._app import print_ready
    from symjax_mlp.serving._server import bind

    given = [f"--{o.replace('_', '-')}" for o in _ONLY[args.ray] if getattr(args, o) is not None]
    if given:  # an option the other server has: it would be ignored, in silence
        raise argparse.ArgumentTypeError(
            f"{', '.join(given)}: {'not' if args.ray else 'only'} with --ray; "
            f"{'drop it' if args.ray else 'add --ray, or drop it'}"
        )
    for option, default in _DEFAULTS.items():  # None until here: given, or not
        if getattr(args, option) is None:
            setattr(args, option, default)
    if args.dispatch == "sync":
        _args.sync_dispatch()
    say = print_ready(args.path)

    def ready(url: str) -> None:
        gc.freeze()  # loaded and compiled: see the module's docstring
        say(url)

    # where="": the CLI's "symjax-mlp serve: error:" says where already
    if args.ray and args.port == 0:  # Ray's proxy takes a port number: a free one, here
        with bind(args.host, 0, where="") as s:  # a host not this machine's: a ConfigError
            args.port = s.getsockname()[1]
    options = _args.keywords(args, _RAY if args.ray else _SERVE) | _args.load_options(args)
    if args.ray:
        from symjax_mlp.serving._ray import serve_on_ray

        options["ray_actor_options"] = {"num_cpus": args.replica_cpus}
        serve_on_ray(args.path, ready=say, address=args.ray_address, **options)
    else:
        serve(args.path, ready=ready, where="", **options)
    print("symjax-mlp serve: shut down cleanly", flush=True)


COMMAND = (_HELP, run, _OPTIONS, _MORE)  # see _run.COMMAND
