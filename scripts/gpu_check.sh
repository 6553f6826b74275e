#!/usr/bin/env bash
# GPU check of the serving work (under 5 minutes on one GPU): what the CPU box cannot measure.
#
#   scripts/gpu_check.sh [OUT_DIR]      (default OUT_DIR: gpu_check_out)
#
# 1. The benchmark's batch-1 rows in both dispatch forms (JAX's default async dispatch and
#    sm.serving.latency_mode(); on a GPU the flag only concerns the CPU client, so the two
#    should agree), on the device and NumPy in/out, plus PyTorch eager / jit.script on CUDA
#    when torch sees the GPU.
# 2. The micro-batcher under 1, 8, 64 in-process clients.
# 3. XLA command buffers (CUDA graphs) compared on the JAX batch-1 rows, each arm in fresh
#    processes (XLA_FLAGS are read when the backend starts). jax 0.10.2's defaults are
#    --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN and
#    --xla_gpu_graph_min_graph_size=5 (a region needs 5 ops to become a graph, which a
#    3-layer MLP may not reach):
#      default   : no flags
#      off       : --xla_gpu_enable_command_buffer=      (empty list: no command buffers)
#      min1      : --xla_gpu_graph_min_graph_size=1      (default types, any region size)
#
# Everything is written to OUT_DIR (one JSON and one text table per step) and printed.
set -euo pipefail

# Every process allocates GPU memory on demand: the bench's parent and its fresh children
# (one per mode) share the GPU, and JAX's default grabs 75% of it per process.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

OUT="${1:-gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
# the laboratory, scripts/benchmarks, is imported from scripts/ (it is not installed)
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
STEP_TIMEOUT="${STEP_TIMEOUT:-200}"  # seconds per step; three steps stay under 5 minutes

echo "== device"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi
"$PY" - <<'EOF'
import jax
print("jax", jax.__version__, "backend", jax.default_backend(), "devices", jax.devices())
if jax.default_backend() != "gpu":
    raise SystemExit("gpu_check.sh: JAX sees no GPU (install jax[cuda12] or jax[cuda13]); stop.")
EOF

# run_bench NAME SECTIONS TORCH XLA_FLAGS: one bench_serving run, JSON + table into $OUT.
run_bench() {
  local name="$1" sections="$2" torch="$3" flags="$4"
  echo
  echo "== $name (XLA_FLAGS='${flags}')"
  NAME="$name" SECTIONS="$sections" TORCH="$torch" FLAGS="$flags" OUT="$OUT" \
    timeout "$STEP_TIMEOUT" "$PY" - <<'EOF'
import json, os
from benchmarks.serving import bench_serving, format_serving

flags = os.environ["FLAGS"]
env = {"XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()} if flags else None
result = bench_serving(
    sections=tuple(os.environ["SECTIONS"].split(",")),
    torch=os.environ["TORCH"] == "1",
    torch_modes=("torch_eager", "torch_script"),  # torch.compile's build is too slow here
    calls=1000,
    repeats=3,
    requests=2000,
    env=env,
    timeout=150,
    progress=lambda msg: print("  ..", msg, flush=True),
)
text = format_serving(result)
print(text)
base = os.path.join(os.environ["OUT"], os.environ["NAME"])
with open(base + ".json", "w") as f:
    json.dump(result, f, indent=2, default=str)
with open(base + ".txt", "w") as f:
    f.write(text + "\n")
EOF
}

# 1 + 2: batch-1 rows in both dispatch forms (and PyTorch), then the batcher.
run_bench latency_and_batcher "latency,batcher" 1 ""

# 3: command buffers, JAX rows only (each arm: two fresh processes, async and sync).
run_bench cmdbuf_default latency 0 ""
run_bench cmdbuf_off latency 0 "--xla_gpu_enable_command_buffer="
run_bench cmdbuf_min1 latency 0 "--xla_gpu_graph_min_graph_size=1"

echo
echo "== command buffers: JAX batch-1 p50 on the device (µs)"
OUT="$OUT" "$PY" - <<'EOF'
import json, os
out = os.environ["OUT"]
print(f"  {'arm':<16} {'dispatch':<8} {'device p50':>10} {'device p99':>10} {'numpy p50':>10}")
for arm in ("cmdbuf_default", "cmdbuf_off", "cmdbuf_min1"):
    with open(os.path.join(out, arm + ".json")) as f:
        rows = json.load(f)["latency"]["rows"]
    for r in rows:
        d, n = r["forms"]["device"], r["forms"]["numpy"]
        print(f"  {arm:<16} {r['dispatch']:<8} {d['p50_s'] * 1e6:>10.1f} "
              f"{d['p99_s'] * 1e6:>10.1f} {n['p50_s'] * 1e6:>10.1f}")
EOF
echo
echo "wrote $OUT/*.json and $OUT/*.txt"
