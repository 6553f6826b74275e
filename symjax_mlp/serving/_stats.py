"""A batcher's counters: the running tallies, the snapshot a reader gets, one request's timing.

Whoever runs a batch appends one tuple of timestamps to a deque (no lock); the tallies are
folded from it, vectorized, when the stats are read or every few thousand batches.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from symjax_mlp._errors import ConfigError

#: Upper bounds (seconds) of the request-latency histogram in :attr:`BatcherStats.latency`.
LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25,
    0.5, 1.0, 2.5,
)  # fmt: skip
STAGES = ("queued", "padded", "compute", "split")
_PADDED = "Zero rows added to reach a compiled batch size."
_STAGES = "Seconds per stage of completed requests (batch stages counted per request)."
#: What Prometheus takes as a metric name (a prefix of ours too).
METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


@dataclasses.dataclass(frozen=True, slots=True)
class RequestTiming:
    """Where one request's time went, in seconds; the last three are its batch's.

    Attributes:
      queued: from the call (or ``submit``) to its batch starting.
      padded: assembling the batch: stacking the requests, zero-filling the padding rows.
      compute: the model call, results on the host (synced).
      split: cutting the results into one per request.
      rows: the request's rows.
      batch_rows: the real rows of its batch (all its requests).
      batch_requests: the requests merged into its batch.
      bucket: the compiled batch size it ran at (``bucket - batch_rows`` padding rows); its
        own rows where the batcher does not merge (:attr:`Batcher.merges`).
    """

    queued: float
    padded: float
    compute: float
    split: float
    rows: int
    batch_rows: int
    batch_requests: int
    bucket: int

    @property
    def total(self) -> float:
        """Seconds from the call to the result."""
        return self.queued + self.padded + self.compute + self.split


class Timed:
    """A request's ``timing``: set by the lane, ``batch_record``, before its result is."""

    __slots__ = ()
    batch_record: tuple | None  # its batch's (t1, t2, t3, t4, rows, bucket, requests)
    rows: int
    t0: float

    @property
    def timing(self) -> RequestTiming | None:
        """The request's :class:`RequestTiming` (``None`` until its batch ran)."""
        if (batch := self.batch_record) is None:
            return None
        t1, t2, t3, t4, real, bucket, n = batch  # its real rows, bucket and requests
        return RequestTiming(t1 - self.t0, t2 - t1, t3 - t2, t4 - t3, self.rows, real, n, bucket)


@dataclasses.dataclass(frozen=True)
class BatcherStats:
    """A snapshot of a :class:`Batcher`'s counters (see :attr:`Batcher.stats`).

    Attributes:
      requests: requests accepted (queued or run).
      completed: requests that got their result.
      failed: requests whose batch raised (each got the exception).
      cancelled: requests cancelled before they ran (``future.cancel()``, ``close(cancel=True)``).
      rejected: requests refused at submit; ``rejected_by``: per reason (``"signature"``,
        ``"overload"``, ``"closed"``).
      batches: model calls; ``batches_by_bucket`` counts them per batch size run (a compiled
        bucket, or a request's own rows where the batcher does not merge).
      rows: real rows computed; ``padded_rows`` the zero rows added to reach a bucket.
      queue_depth: requests waiting now; ``busy``: whether a batch is running now, and
        ``busy_s`` for how many seconds it has run (0.0 when none runs).
      seconds: per stage (``queued``, ``padded``, ``compute``, ``split``), the sum over
        completed requests.
      latency: ``(upper bound in seconds, completed requests at most that slow)`` per
        :data:`LATENCY_BUCKETS` entry, cumulative, as a Prometheus histogram.
      latency_sum: total seconds of the completed requests, call to result.
    """

    requests: int
    completed: int
    failed: int
    cancelled: int
    rejected: int
    rejected_by: dict[str, int]
    batches: int
    batches_by_bucket: dict[int, int]
    rows: int
    padded_rows: int
    queue_depth: int
    busy: bool
    busy_s: float
    seconds: dict[str, float]
    latency: tuple[tuple[float, int], ...]
    latency_sum: float

    @property
    def mean_batch_rows(self) -> float:
        """Real rows per model call (0.0 before the first)."""
        return self.rows / self.batches if self.batches else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Every counter as JSON data, with :attr:`mean_batch_rows`."""
        return {**dataclasses.asdict(self), "mean_batch_rows": self.mean_batch_rows}

    def to_prometheus(self, prefix: str = "symjax_mlp_batcher") -> str:
        """The counters in Prometheus' text exposition format (version 0.0.4), each metric's
        name beginning with ``prefix`` (a Prometheus metric name): ``{prefix}_rows_total``, ...

        Example:
          >>> import jax.numpy as jnp
          >>> import symjax_mlp as sm
          >>> h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
          >>> with sm.serving.Batcher(h, example=jnp.ones((1, 3)), max_batch=2) as b:
          ...     _ = b(jnp.ones((1, 3)))
          ...     text = b.stats.to_prometheus()
          >>> [line for line in text.splitlines() if line.startswith("symjax_mlp_batcher_rows")]
          ['symjax_mlp_batcher_rows_total 1']
        """
        if not isinstance(prefix, str) or not METRIC_NAME.fullmatch(prefix):
            raise ConfigError(
                f"symjax_mlp.serving.BatcherStats.to_prometheus(prefix={prefix!r}): a Prometheus "
                f"metric name is {METRIC_NAME.pattern}; pass e.g. prefix='my_model'."
            )
        c, g = "counter", "gauge"
        rejected = [(f'{{reason="{k}"}}', v) for k, v in sorted(self.rejected_by.items())]
        buckets = [(f'{{bucket="{k}"}}', v) for k, v in sorted(self.batches_by_bucket.items())]
        stages = [(f'_sum{{stage="{k}"}}', v) for k, v in self.seconds.items()]
        stages += [(f'_count{{stage="{k}"}}', self.completed) for k in self.seconds]
        hist = [(f'_bucket{{le="{_number(le)}"}}', n) for le, n in self.latency]
        hist += [('_bucket{le="+Inf"}', self.completed), ("_sum", self.latency_sum)]
        hist += [("_count", self.completed)]
        metrics = [  # name, type, help, value or [(labels, value)]
            ("requests_total", c, "Requests accepted.", self.requests),
            ("completed_total", c, "Requests that got their result.", self.completed),
            ("failed_total", c, "Requests whose batch raised.", self.failed),
            ("cancelled_total", c, "Requests cancelled before they ran.", self.cancelled),
            ("rejected_total", c, "Requests refused at submit, by reason.", rejected),
            ("batches_total", c, "Model calls.", self.batches),
            ("bucket_batches_total", c, "Model calls per compiled batch size.", buckets),
            ("rows_total", c, "Real rows computed.", self.rows),
            ("padded_rows_total", c, _PADDED, self.padded_rows),
            ("queue_depth", g, "Requests waiting now.", self.queue_depth),
            ("busy", g, "1 while a batch runs.", int(self.busy)),
            ("busy_seconds", g, "Seconds the batch running now has run.", self.busy_s),
            ("stage_seconds", "summary", _STAGES, stages),
            ("request_seconds", "histogram", "Seconds from call to result.", hist),
        ]
        return exposition(prefix, metrics)


def exposition(prefix: str, metrics: list[tuple[str, str, str, Any]]) -> str:
    """Prometheus text of ``(name, type, help, value or [(labels, value)])`` per metric."""
    lines: list[str] = []
    for name, kind, help, samples in metrics:
        samples = samples if isinstance(samples, list) else [("", samples)]
        lines += [f"# HELP {prefix}_{name} {help}", f"# TYPE {prefix}_{name} {kind}"]
        lines += [f"{prefix}_{name}{labels} {_number(v)}" for labels, v in samples]
    return "\n".join(lines) + "\n"


def _number(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class Counters:
    """A lane's running tallies (its lock held to read or fold them)."""

    def __init__(self, buckets: Sequence[int]) -> None:
        self.requests = self.completed = self.failed = self.cancelled = 0
        self.alone = 0  # requests run on their callers' threads (the rest: in `requests`)
        self.batches = self.rows = self.padded_rows = 0
        self.rejected = dict.fromkeys(("signature", "overload", "closed"), 0)
        self.by_bucket = collections.Counter(dict.fromkeys(buckets, 0))
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)  # per bucket, the last: slower
        self.latency_sum = 0.0
        # Per batch run, appended by whoever runs it (no lock): Lane.compute's timing record
        self.pending: collections.deque[tuple] = collections.deque()

    def fold(self) -> None:
        """Counts the batches in ``pending`` (the lane's lock is held)."""
        pending, latencies, s = self.pending, [], self.seconds
        while pending:
            t0, t1, t2, t3, t4, rows, bucket = pending.popleft()
            self.batches += 1
            self.rows += rows
            self.padded_rows += bucket - rows
            self.by_bucket[bucket] += 1
            ts = [t4 - t0] if type(t0) is float else [t4 - t for t in t0]
            k, total = len(ts), sum(ts)
            latencies += ts
            self.completed += k
            self.latency_sum += total
            s["queued"] += total - k * (t4 - t1)
            s["padded"] += k * (t2 - t1)
            s["compute"] += k * (t3 - t2)
            s["split"] += k * (t4 - t3)
        if latencies:
            where = np.searchsorted(LATENCY_BUCKETS, latencies)  # as bisect_left: le=
            for i, n in enumerate(np.bincount(where, minlength=len(self.latency)).tolist()):
                self.latency[i] += n

    def snapshot(self, queue_depth: int, busy: bool, busy_s: float) -> BatcherStats:
        """The tallies, ``pending`` folded in, as a :class:`BatcherStats`."""
        self.fold()
        same = ("completed", "failed", "cancelled", "batches", "rows", "padded_rows")
        return BatcherStats(
            requests=self.requests + self.alone,
            rejected=sum(self.rejected.values()),
            rejected_by=dict(self.rejected),
            batches_by_bucket=dict(self.by_bucket),
            queue_depth=queue_depth,
            busy=busy,
            busy_s=busy_s,
            seconds=dict(self.seconds),
            latency=tuple(zip(LATENCY_BUCKETS, itertools.accumulate(self.latency), strict=False)),
            latency_sum=self.latency_sum,
            **{name: getattr(self, name) for name in same},
        )
