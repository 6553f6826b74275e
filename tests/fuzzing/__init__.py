"""The loader fuzzer: mutate an artifact, load it, call it, and classify what happened.

Every case is a pure function of ``(seed, case)``: it copies the original artifact, applies
one or a few mutations, runs ``sm.load(path)(x)`` and reports one JSON line. The outcomes:

- ``rejected``: a :class:`symjax_mlp.SymjaxError` subclass (the artifact is refused: fine);
- ``same``: it loaded and returned bit-for-bit the original output (a harmless change: fine);
- ``foreign``: any other exception (a bug: the loader must say what is wrong);
- ``wrong``: it loaded and returned something else (a bug: a silent wrong answer);
- ``escaped``: it loaded although the case reads a file outside the artifact directory;
- ``executed``: something in the artifact ran as code (a marker file appeared);
- ``crash`` / ``hang``: the worker process died on a signal / a case ran past its timeout
  (set by the driver, which restarts the worker at the next case).

Plain modules, never collected by pytest (``tests/test_fuzz.py`` drives them). Six targets,
each a ``make``, a ``Context`` and a ``run_case`` (:func:`fuzzing.worker.target`):

- ``loader``: :mod:`fuzzing.cases` (the artifacts a run is built on, and what a worker knows
  of them) and :mod:`fuzzing.mutations` (how one case's files are mutated);
- ``entries``: :mod:`fuzzing.entries`, the same on an artifact of two entry points, with
  mutations of its ``entries`` and ``entry`` fields, and every entry point called;
- ``hostile``: :mod:`fuzzing.hostile`, whole consistent artifacts a stranger could make (with
  :mod:`fuzzing.forge`: forged programs, re-signed so that every checksum matches), mutated
  cheaply; ``regressions/`` holds modules it found that crashed or hung StableHLO's reader;
- ``checkpoint``: :mod:`fuzzing.checkpoints`, training checkpoints mutated and restored;
- ``bodies``: :mod:`fuzzing.bodies`, HTTP request bodies broken and read as ``POST /predict``
  reads them;
- ``regions``: :mod:`fuzzing.regions`, random nestings of reduce, while, call and case whose
  work is just under or over the checker's bound: refused exactly when over;

and :mod:`fuzzing.worker` (the worker process: runs cases, classifies them, one JSON line
each), :mod:`fuzzing.driver` (starts the workers, restarts them after a crash or a hang, and
sums up).

Usage, from the repository root (release runs: ``--cases 20000 --seed 1``, RELIABILITY.md)::

    PYTHONPATH=tests python -m fuzzing fuzz OUT --target hostile --cases 500 --seed 0
    PYTHONPATH=tests python -m fuzzing show OUT --target hostile --seed 0 --case 123
    PYTHONPATH=tests python -m fuzzing.worker OUT SEED FIRST STOP TARGET  # the driver's workers
"""
