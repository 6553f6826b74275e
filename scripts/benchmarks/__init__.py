"""The laboratory: the chapter's benchmark, measured honestly, on symjax_mlp's public API.

Not installed with the library and not importable as ``symjax_mlp.*``: ``python
scripts/bench.py`` puts ``scripts/`` on ``sys.path`` and runs :mod:`benchmarks.cli`. Every
module imports ``symjax_mlp`` and its public sub-packages only (``tests/test_layout.py``
fails on a ``symjax_mlp._*`` import here); a private name the lab needs is a public API the
library lacks. The targets (``<= 1.15``, ``>= 10``) live here, never in the library.

Every timed call is synced, warmed up and repeated; compared rows are timed interleaved;
tracing, lowering and compiling are timed apart from steady-state calls. One concept a
module:

- :mod:`~benchmarks.timing`: the timer (:class:`~benchmarks.timing.Timing`,
  :func:`~benchmarks.timing.time_interleaved`) and where it ran
  (:func:`~benchmarks.timing.environment`);
- :mod:`~benchmarks.run` the chapter's table, :mod:`~benchmarks.report` its rows, targets
  and JSON (``"schema": 1``), :mod:`~benchmarks.twins` the same MLP in plain jax.numpy and
  PyTorch, :mod:`~benchmarks.remote` its latency-mode row in a fresh process;
- :mod:`~benchmarks.scaling` (batch-size sweep, matmul peak), :mod:`~benchmarks.devices`,
  :mod:`~benchmarks.figures` (PNG and SVG; what they share, :mod:`~benchmarks.plotting`),
  :mod:`~benchmarks.train_step`;
- serving: :mod:`~benchmarks.serving` (the entry) and :mod:`~benchmarks.serving_report` (the
  targets, the text) over
  :mod:`~benchmarks.latency`, :mod:`~benchmarks.batcher` and :mod:`~benchmarks.http_rows`,
  on :mod:`~benchmarks.calls` (one call at a time) and :mod:`~benchmarks.children` (fresh
  processes);
- per request: :mod:`~benchmarks.per_request` (h(x) in latency mode against floors measured
  in the same process, its targets) over :mod:`~benchmarks.rivals` (what a user would pick
  instead: PyTorch's modes, AOTInductor, ONNX Runtime);
- :mod:`~benchmarks.stateful`, :mod:`~benchmarks.coldstart`, :mod:`~benchmarks.compare`
  (``--diff``), and :mod:`~benchmarks.cli` (the command line) with
  :mod:`~benchmarks.options` (its options).
"""
