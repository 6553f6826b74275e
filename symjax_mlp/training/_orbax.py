"""Checkpoints of a multi-process run: Orbax, asynchronous, with our manifest on top.

A save copies the arrays on their devices; a writer thread hands the copy to Orbax, which
commits ``<dir>/<step>`` once every process has written. A save made while the one before it
is still committing is superseded (process 0 decides for all); a run's last is always written.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import math
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from symjax_mlp._artifact.format import printable
from symjax_mlp._errors import CheckpointError
from symjax_mlp._files import exhausted
from symjax_mlp.training._checkpoint import broken, check_manifest, evaluated_weights
from symjax_mlp.training._paths import (
    COMMITTED,
    check_directory,
    check_own,
    checkpoints,
    entries,
    step_name,
)
from symjax_mlp.training._state import (
    SHOWN,
    TrainState,
    check_fit,
    check_others,
    declared,
    digest,
    named_leaves,
    specs,
    started_from,
    state_of,
)

_HEADER = {"format": "symjax_mlp.orbax_checkpoint"}
#: Saves handed to the writer thread and not yet to Orbax, each a device copy of the state:
#: past it, a save waits (Orbax's blocking part of a save: its barriers and host copies).
_QUEUED = 2
_MAX_ENTRIES = 100_000  # in one step's directory: its arrays' data files are a few per process
_MAX_READ_WHOLE = 64 << 20  # a file Orbax reads whole (JSON, OCDBT's manifest)


def _local(a: Any) -> Any:
    """This process's copy of a replicated array (a NumPy value as it is)."""
    return a.addressable_data(0) if isinstance(a, jax.Array) else a


def _key(i: int, name: str) -> str:
    """The Orbax item of tensor ``i`` (names hold '/'), the rng outside the mesh."""
    return "rng" if name == "rng" else f"{i:05d}"


def _is_key(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jax.dtypes.prng_key)


@jax.jit
def _pack(leaves: list[Any]) -> tuple[dict[str, jax.Array], list[jax.Array]]:
    """New buffers of ``leaves`` (their own are donated next) in one dispatch, whose every
    output array costs what a copy does: one flat array per dtype, and each PRNG key."""
    groups: dict[str, list[Any]] = {}
    for a in leaves:
        if not _is_key(a.dtype):
            groups.setdefault(str(a.dtype), []).append(a.ravel())
    keys = [jnp.copy(a) for a in leaves if _is_key(a.dtype)]
    return {dtype: jnp.concatenate(group) for dtype, group in groups.items()}, keys


def _unpack(specs: list[tuple], packed: tuple[dict[str, jax.Array], list]) -> list[jax.Array]:
    """The leaves of ``specs`` (shape, dtype, sharding) :func:`_pack` packed, bitwise: sliced on
    the host (a compiled slicing's compile held up the first saves), put back with its sharding."""
    flat, keys = packed
    host, keys = {dtype: np.asarray(_local(a)) for dtype, a in flat.items()}, iter(keys)
    at, leaves = dict.fromkeys(host, 0), []
    for shape, dtype, sharding in specs:
        if _is_key(dtype):
            leaves.append(next(keys))
            continue
        size, start = math.prod(shape), at[str(dtype)]
        part = host[str(dtype)][start : start + size].reshape(shape)
        leaves.append(jax.make_array_from_callback(shape, sharding, lambda i, p=part: p[i]))
        at[str(dtype)] += size
    return leaves


def check_files(path: Path, others: bool = False) -> None:
    """Refuses a step of over ``_MAX_ENTRIES`` entries, anything but directories and regular
    files (Orbax follows a link out and blocks on a FIFO), or a file read whole (all but the
    arrays' data, in ``d/``) past ``_MAX_READ_WHOLE`` bytes; ``others``: another run's step
    (init_from's), refused where another user may write (:func:`check_own`)."""

    def refuse(error: OSError) -> None:
        raise broken(path, f"{error.filename} cannot be read ({error.strerror})")

    found = [path]
    for root, dirs, files in os.walk(path, onerror=refuse):  # links are listed, not followed
        found += (Path(root, name) for name in dirs + files)
        if len(found) > _MAX_ENTRIES:
            raise broken(path, f"it holds over {_MAX_ENTRIES:,} files, more than a save writes")
    for entry in found:
        st = os.lstat(entry)
        if stat.S_ISLNK(st.st_mode):
            what = (
                f"a symlink to {printable(os.readlink(entry))}: a checkpoint is read from its "
                "own files (Orbax would read, and prune, what it points to)"
            )
        elif stat.S_ISREG(st.st_mode):
            if entry.parent.name == "d" or st.st_size <= _MAX_READ_WHOLE:
                continue
            what = f"{st.st_size:,} bytes, more than a save writes there ({_MAX_READ_WHOLE:,})"
        elif stat.S_ISDIR(st.st_mode):
            continue
        else:
            what = "neither a file nor a directory (a FIFO, socket or device)"
        raise broken(path, f"{printable(str(entry))} is {what}")  # its name: anyone's
    if others:  # a resume's are the run's own, in the folder its user chose to write in
        check_own(path, found)
    if (marker := path / COMMITTED).is_file():  # regular and bounded, now: Orbax parses it
        try:
            ok = isinstance(json.loads(marker.read_bytes()), dict)
        except (ValueError, RecursionError):  # not JSON, or nested past Python's recursion
            ok = False
        if not ok:
            raise broken(path, f"{marker} is not a JSON object, as Orbax writes it")


def orbax_weights(
    path: Path, like: TrainState, check: Callable[[Path, dict], None]
) -> TrainState | None:
    """:meth:`OrbaxCheckpoints.weights` of ``path``, an Orbax step or a directory of Orbax
    checkpoints only (its newest committed); ``None`` for any other path (step_* checkpoints)."""
    step = path if path.name.isdigit() and path.name == step_name(int(path.name), True) else None
    if step is not None and not (step / COMMITTED).is_file():
        if not (step / "meta").exists():
            return None  # no Orbax step: the step_* reader names what it is
        raise broken(step, f"it has no {COMMITTED}: its save was never committed")
    if step is None and (checkpoints(path) or not checkpoints(path, orbax=True)):
        return None
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    reader = OrbaxCheckpoints(
        path if step is None else path.parent, timeout=60, sharding=sharding, read_only=True
    )
    try:
        newest = reader.latest() if step is None else step
        return reader.weights(newest, like, check)
    finally:
        reader.manager.close()


class OrbaxCheckpoints:
    """An Orbax ``CheckpointManager`` of ``directory``: async saves, the newest two kept."""

    def __init__(
        self, directory: str | Path, *, timeout: int, sharding: Any, read_only: bool = False
    ):  # read_only: another run's, read (init_from), not written or cleaned up
        import orbax.checkpoint as ocp

        self.ocp, self.directory = ocp, Path(directory).absolute()
        self.sharding = sharding  # where restored arrays go: replicated over the run's mesh
        if not read_only:  # train checked it before compiling: a link planted since, refused
            check_directory(self.directory, "symjax_mlp.training.train")
            self.directory.mkdir(parents=True, exist_ok=True)  # each process: Orbax will not
        for _, step, _ in entries(self.directory, orbax=True):  # the manager reads them all
            if step.is_dir() or step.is_symlink():  # a file: check_strays names it
                check_files(step, others=read_only)
        # every process named: Orbax's barriers are then the coordinator's (with the timeout),
        # not a collective each
        processes = ocp.options.MultiprocessingOptions(
            active_processes=set(range(jax.process_count()))
        )
        writes = {
            "max_to_keep": 2,
            "enable_background_delete": True,  # the old step's deletion is off the commit
            "save_decision_policy": ocp.checkpoint_managers.ContinuousCheckpointingPolicy(),
            "cleanup_tmp_directories": True,  # a save a killed process left unfinished
        }
        options = ocp.CheckpointManagerOptions(
            create=False,
            read_only=read_only,
            enable_async_checkpointing=not read_only,
            async_options=ocp.AsyncOptions(timeout_secs=timeout),
            multiprocessing_options=processes,
            **({"save_interval_steps": 0} if read_only else writes),
        )
        # jax.Array's default handler also writes an ArrayMetadata store, whose directory the
        # other processes poll, slowing each commit; our manifest holds what it would
        types = ocp.type_handlers
        kept = [(t, types.get_type_handler(t)) for t in types.supported_types() if t != jax.Array]
        arrays = types.create_type_handler_registry(*kept, (jax.Array, types.ArrayHandler()))
        handler = ocp.PyTreeCheckpointHandler(
            multiprocessing_options=processes, type_handler_registry=arrays
        )
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for args in (ocp.args.PyTreeSave, ocp.args.PyTreeRestore):
            registry.add("state", args, handler)
        try:  # it reads every step's _CHECKPOINT_METADATA, each a JSON object (check_files)
            self.manager = ocp.CheckpointManager(
                self.directory, options=options, handler_registry=registry
            )
        except Exception as e:  # a field of the wrong type: Orbax's ValueError
            raise CheckpointError(
                f"{self.directory}: Orbax cannot read its steps' metadata ({type(e).__name__}: "
                f"{str(e)[:200]}): a step's {COMMITTED} was edited or corrupted. Remove that "
                "step's directory (a resume picks the newest left), or use another directory."
            ) from None
        self.waits: list[float] = []  # how long each save held up the steps
        self.superseded: list[int] = []  # the steps of saves not written: one was committing
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "symjax_mlp-save")
        self._pending: collections.deque = collections.deque()  # (step, its write's future)

    def latest(self) -> Path | None:
        step = self.manager.latest_step()
        return None if step is None else self.directory / str(step)

    def save(
        self, state: TrainState, metadata: dict[str, Any], *, last: bool = False,
        derived: Callable[[TrainState], dict[str, Any]] | None = None,
    ) -> Path:  # fmt: skip
        """Writes ``state`` as ``<dir>/<state.step>`` from a device copy, superseded if the one
        before is still committing unless ``last``; waits while ``_QUEUED`` are queued; a failed
        one raises at the next. ``derived(copy)``: more metadata, made on the writer thread."""
        t0 = time.perf_counter()
        self._finish(keep=_QUEUED - 1)
        leaves, tree = jax.tree.flatten((state.params, state.opt_state))
        specs = [(a.shape, a.dtype, a.sharding) for a in leaves]
        x64 = jax.config.jax_enable_x64  # this thread's: jax.enable_x64(True) is one thread's
        copied = (tree, specs, _pack(leaves), state.rng, x64)  # the rng is not donated
        step, epoch = int(state.step), int(state.epoch)
        write = self._thread.submit(self._write, step, epoch, copied, metadata, last, derived)
        self._pending.append((step, write))
        self.waits.append(time.perf_counter() - t0)
        return self.directory / str(step)

    def _write(
        self, step: int, epoch: int, copied: tuple, metadata: dict, last: bool, derived: Any
    ) -> bool:
        """Hands the state ``save`` packed to Orbax; whether it is written (else superseded)."""
        tree, specs, packed, rng, x64 = copied
        with jax.enable_x64(x64):  # its float64 state made float32 on this thread, else
            state = TrainState(*jax.tree.unflatten(tree, _unpack(specs, packed)), rng)
            metadata = metadata if derived is None else {**metadata, **derived(state)}
            tensors = named_leaves(state)
            tensors["rng"] = np.asarray(_local(tensors["rng"]))  # this process's: not on the mesh
            meta = {
                **_HEADER,
                "step": step,
                "epoch": epoch,
                "tensors": [[n, list(a.shape), str(a.dtype)] for n, a in tensors.items()],
                "sha256": digest({n: _local(a) for n, a in tensors.items()}),
                "metadata": metadata,
            }
            items = {_key(i, n): a for i, (n, a) in enumerate(tensors.items())}
            args = self.ocp.args
            return self.manager.save(  # every process asks; process 0's answer holds for all
                step,
                args=args.Composite(state=args.PyTreeSave(items), meta=args.JsonSave(meta)),
                force=last,
            )

    def _finish(self, keep: int = 0) -> None:
        """Waits until at most ``keep`` saves are queued; a failed one raises here."""
        pending = self._pending
        while pending and (pending[0][1].done() or len(pending) > keep):
            step, write = pending.popleft()
            with self._writing():
                if not write.result():
                    self.superseded.append(step)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A write that failed on the disk (TensorStore's error, an OSError) a CheckpointError
        saying why and what to do; any other error as raised."""
        try:
            yield
        except Exception as e:
            code = re.search(r"os_error_code='(\d+)'", str(e))
            if not isinstance(e, OSError) and code is None:
                raise
            number = e.errno if isinstance(e, OSError) else int(code[1])
            fix = exhausted(OSError(number, "")) or "Check that this user may write it."
            raise CheckpointError(
                f"symjax_mlp.training.train: a checkpoint in {self.directory} could not be "
                f"written ({type(e).__name__}: {str(e)[:400]}); the newest whole one is kept. "
                f"{fix} Then train(resume=True) continues from it."
            ) from e

    def restore(self, path: Path, like: TrainState) -> tuple[TrainState, dict]:
        """Reads ``path`` into the structure of ``like``, each array replicated."""
        meta, stored = self._meta(path)
        wanted = named_leaves(like)
        check_fit(path, stored, specs(wanted))
        targets = {n: a if n == "rng" else (a.shape, a.dtype) for n, a in wanted.items()}
        arrays = self._arrays(path, meta, targets, self.sharding)
        return state_of(arrays, like, meta), meta.get("metadata", {})

    def weights(
        self, path: Path, like: TrainState, check: Callable[[Path, dict], None]
    ) -> TrainState:
        """A new run's start (``init_from``) from ``path``, written by any number of processes:
        ``like`` with the params (model state too) ``path`` holds, each on this process's first
        device, once ``check(path, metadata)`` has passed; its optimizer's may be another's."""
        meta, stored = self._meta(path)
        check(path, meta.get("metadata", {}))
        leaves = named_leaves(like)
        wanted = {n: a for n, a in leaves.items() if n.startswith("params/") or n == "rng"}
        check_fit(path, {n: s for n, s in stored.items() if n in wanted or n[:7] == "params/"},
                  specs(wanted))  # fmt: skip
        try:  # every tensor, as saved: the sha256 over all says whether they are whole
            targets = {
                n: np.zeros(shape, dtype) if n == "rng" else declared(shape, dtype)
                for n, (shape, dtype) in stored.items()
            }
        except (TypeError, ValueError) as e:  # anyone's JSON: a shape or dtype of no array
            what = f"its meta item declares a tensor no array can be ({type(e).__name__}: {e})"
            raise broken(path, what[:400]) from None
        check_others(path, {n: t for n, t in targets.items() if n not in wanted}, wanted)
        local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        arrays = evaluated_weights(
            {n: _local(a) for n, a in self._arrays(path, meta, targets, local).items()}
        )  # a schedule-free run's eval params, as train() reported them
        return started_from(arrays, like)

    def _meta(self, path: Path) -> tuple[dict, dict[str, tuple]]:
        """``path``'s meta item, checked, and its tensors' ``{name: (shape, dtype)}``."""
        args, step = self.ocp.args, int(path.name)
        try:
            meta = self.manager.restore(step, args=args.Composite(meta=args.JsonRestore()))["meta"]
            stored = {n: (tuple(s), d) for n, s, d in meta["tensors"]}
            if "sha256" not in meta:  # (_arrays compares it)
                raise KeyError("sha256")
        except Exception as e:  # missing, truncated or edited JSON: the reader's own error
            what = f"its meta item is missing or malformed ({type(e).__name__}: {str(e)[:200]})"
            raise broken(path, what) from None
        check_manifest(path / "meta", meta, _HEADER, step)
        return meta, stored

    def _arrays(self, path: Path, meta: dict, targets: dict[str, Any], sharding: Any) -> dict:
        """The tensors of ``targets`` (``rng``: its NumPy value; others: ``(shape, dtype)``) as
        ``path`` holds them, placed by ``sharding``; refused unless their sha256 is recorded."""
        args, step = self.ocp.args, int(path.name)
        target = {
            _key(i, n): t if n == "rng" else jax.ShapeDtypeStruct(*t, sharding=sharding)
            for i, (n, t) in enumerate(targets.items())
        }
        restore = args.PyTreeRestore(
            target, restore_args=self.ocp.checkpoint_utils.construct_restore_args(target)
        )
        try:
            items = self.manager.restore(step, args=args.Composite(state=restore))["state"]
        except Exception as e:  # a truncated or missing array file: tensorstore's error
            what = f"its arrays cannot be read ({type(e).__name__}: {str(e)[:300]})"
            raise broken(path, what) from None
        arrays = {n: items[_key(i, n)] for i, n in enumerate(targets)}
        for name, a in arrays.items():  # Orbax returns a value of state/checkpoint as it is
            want = (targets[name].shape, targets[name].dtype) if name == "rng" else targets[name]
            got = (getattr(a, "shape", None), getattr(a, "dtype", None))
            if got != want:
                got = f"{got[0]} {got[1]}" if got[1] else f"a {type(a).__name__} {SHOWN.repr(a)}"
                what = f"its tensor {printable(name)[:200]} was read as {got}, not as the {want[0]}"
                raise broken(path, f"{what} {want[1]} its meta declares (as every save writes)")
        if digest({n: _local(a) for n, a in arrays.items()}) != meta["sha256"]:
            raise broken(path, "its arrays are not the ones saved (their sha256 differs)")
        return arrays

    def close(self) -> None:
        """Waits for the last save to commit (a failed one raises), then releases the manager."""
        try:
            self._finish()
        finally:
            self._thread.shutdown()
            with self._writing():
                self.manager.close()  # waits for Orbax's last commit
