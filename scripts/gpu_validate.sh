#!/usr/bin/env bash
# Everything commviz checks on a GPU machine, in one go: the GPU tests (graphed collectives vs
# the profiler's eager metadata, bus bandwidth beside CUDA events; those needing more GPUs than
# there are skip), the 2-GPU launch config with CUDA graphs (every graphed NCCL kernel
# annotated?) where there are 2 GPUs, and the GPU benchmarks.
# Logs go to $OUT (the device tool's result folder) or /tmp/commviz-gpu.
# Wheels missing on the GPU image (perfetto, orjson, pydantic, ...) are taken from .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/commviz-gpu}
mkdir -p "$out"
source scripts/gpu_env.sh
export PATH=$HOME/.local/bin:$PATH
cv="python3 -m commviz"
python3 -c "import torch, commviz; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'commviz', commviz.__file__)" | tee "$out/env.log"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
nproc=$(( gpus < 2 ? gpus : 2 ))
python3 -c "from commviz.record import boundary; print('boundary kernel build:', boundary.prebuild() or 'ok')" | tee -a "$out/env.log"

step() { echo "== $1"; }
step "GPU tests"
timeout 300 python3 -m pytest -q -m gpu -s -p no:cacheprovider tests 2>&1 | tail -40 | tee "$out/gpu_tests.log"
if [ "$gpus" -ge 2 ]; then
  step "launch configs/gpu-2x-graphs.yaml"
  rm -rf /tmp/cvruns
  timeout 240 $cv launch configs/gpu-2x-graphs.yaml --set output.dir=/tmp/cvruns \
    --set output.run_name=graphed 2>&1 | tail -40 | tee "$out/launch.log"
  timeout 120 python3 scripts/check_annotated.py /tmp/cvruns/graphed 2>&1 | tee "$out/annotated.log"
fi
step "benchmarks"
timeout 170 python3 -m torch.distributed.run --nproc_per_node "$nproc" scripts/bench_graph_overhead.py --out "$out/bench_graph_overhead.json" 2>&1 | tail -30 | tee "$out/bench_graph_overhead.log"
for arrival in boxed unboxed; do
  timeout 100 python3 scripts/bench_overhead.py --device cuda --arrival $arrival 2>&1 | tail -12 \
    | tee "$out/bench_overhead_cuda_$arrival.log"
done
tar czf "$out/gpu_run.tgz" -C /tmp/cvruns graphed 2>/dev/null
echo "== done"
