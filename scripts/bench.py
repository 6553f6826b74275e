"""The chapter's benchmark: 1000 calls of the MLP, eager vs hybridized, and much more.

    python scripts/bench.py                    # about a minute on 2 cores
    python scripts/bench.py --quick            # a first look in seconds
    python scripts/bench.py --compare torch    # PyTorch eager / jit.script / compile too
    python scripts/bench.py --sweep            # batch 1..65536 vs the matmul peak (JSON, PNG, SVG)
    python scripts/bench.py --devices 8        # sharded throughput on 1, 2, 4, 8 devices
    python scripts/bench.py --serving          # per-request latency, the batcher, the server
    python scripts/bench.py --stateful         # BatchNorm / Dropout models vs jit by hand
    python scripts/bench.py --coldstart        # a fresh process: import, load, first call
    python scripts/bench.py --json bench.json  # every figure (schema 1), versions, device
    python scripts/bench.py --diff old.json new.json  # per-row ratios with noise bands

The laboratory lives in ``scripts/benchmarks/`` (not installed with the library, written on
its public API only); this script is its entry. Exit codes: 0 ok, 2 a usage error, 1 a bug.
To time your own artifact against its AOT floor, the library has ``symjax-mlp bench DIR``.
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import benchmarks`
    from benchmarks.cli import run

    run(sys.argv[1:])
