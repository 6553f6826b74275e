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

All the logic lives in :mod:`symjax_mlp.bench`; this script is ``symjax-mlp bench``, with the
same options and exit codes (0 ok, 2 a usage error, 1 a bug).
"""

import sys

from symjax_mlp.cli import run

if __name__ == "__main__":
    run(["bench", *sys.argv[1:]])
