#!/usr/bin/env bash
# The GPU proof on NCCL, `bash scripts/gpu_proof.sh [2x|4x]` (default 2x): every config of the
# set launched as a user would (2x: configs/gpu-2x-*.yaml; 4x: configs/gpu-4x-*.yaml and
# tp-dp-4gpu.yaml), the graphed ones beside their eager twins (cuda_graphs off),
# scripts/gpu_proof.py on each run (NCCL kernels named, rightly; records against torch's Flight
# Recorder dumps; origins; one comm lane per group; cross-rank links within a group; verify),
# then the GPU tests but the verdict scenarios' (scripts/gpu_verdict.sh runs those). The runs' inputs
# (traces, records, Flight Recorder dumps) are packed for tests/fixtures. proof.log and gpu_tests.log go to $OUT (the device tool's result folder, at most
# 8 files come back) or /tmp/commviz-proof, with everything else packed in proof.tgz.
# Wheels missing on the GPU image are taken from .whl/ (scripts/gpu_validate.sh says how).
set -uo pipefail
cd "$(dirname "$0")/.."
dest=${OUT:-/tmp/commviz-proof}
out=/tmp/commviz-proof-work                    # logs and packs, packed into $dest at the end
rm -rf "$out" && mkdir -p "$out" "$dest"
source scripts/gpu_env.sh
python3 -c "import torch, commviz; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name())" | tee "$out/env.log"
python3 -c "from commviz.record import boundary; print('boundary kernel build:', boundary.prebuild() or 'ok')" | tee -a "$out/env.log"
runs=/tmp/cvproof
rm -rf "$runs" && mkdir -p "$runs"
launch() {  # NAME CONFIG [--set ...]: one run, its output in $runs/NAME.log
  local name=$1 cfg=$2; shift 2
  timeout "${LAUNCH_TIMEOUT:-200}" python3 -m commviz launch "configs/$cfg.yaml" --set "output.dir=$runs" \
    --set "output.run_name=$name" "$@" >"$runs/$name.log" 2>&1
  echo "launch $name: rc $?" | tee -a "$out/launch.log"
}
case ${1:-2x} in
  2x)  # four jobs at a time (each 2 ranks on the 2 GPUs): correctness, not timing
    launch ddp gpu-2x-ddp & launch ddp-hook gpu-2x-ddp-hook & launch fsdp2 gpu-2x-fsdp2 & launch tp gpu-2x-tp & wait
    launch pp-gpipe gpu-2x-pp-gpipe & launch pp-1f1b gpu-2x-pp-1f1b & launch p2p-ring gpu-2x-p2p-ring &
    launch compiled gpu-2x-compiled & wait
    launch p2p-graphed gpu-2x-p2p-graphed & launch p2p-graphed-eager gpu-2x-p2p-graphed --set workload.cuda_graphs=false &
    launch graphs gpu-2x-graphs & launch graphs-eager gpu-2x-graphs --set workload.cuda_graphs=false & wait
    proven=("$runs"/{ddp,ddp-hook,fsdp2,tp,pp-gpipe,pp-1f1b,p2p-ring,compiled} "$runs/p2p-graphed=$runs/p2p-graphed-eager"
            "$runs/graphs=$runs/graphs-eager" "$runs/p2p-graphed-eager" "$runs/graphs-eager") ;;
  4x)  # three or four jobs at a time (each 4 ranks on the 4 GPUs)
    launch ddp gpu-4x-ddp & launch fsdp-tp gpu-4x-fsdp-tp & launch hsdp gpu-4x-hsdp & launch experts gpu-4x-experts & wait
    launch pp-1f1b gpu-4x-pp-1f1b & launch pp-interleaved gpu-4x-pp-interleaved & launch tp-dp tp-dp-4gpu &
    launch tp-dp-eager tp-dp-4gpu --set workload.cuda_graphs=false & wait
    proven=("$runs"/{ddp,fsdp-tp,hsdp,experts,pp-1f1b,pp-interleaved} "$runs/tp-dp=$runs/tp-dp-eager" "$runs/tp-dp-eager") ;;
  *) echo "usage: gpu_proof.sh [2x|4x]" >&2; exit 2 ;;
esac
echo "launches done at ${SECONDS}s" | tee -a "$out/launch.log"
for f in "$runs"/*.log; do echo "== $f"; tail -6 "$f"; done >"$out/launch_tails.log"
timeout 150 python3 scripts/gpu_proof.py "${proven[@]}" 2>&1 | tee "$out/proof.log"
(cd "$runs" && tar czf "$out/proof_runs.tgz" --exclude='*.pftrace' --exclude='matched_*' \
  --exclude='comm_*' --exclude='plots' --exclude='*.png' */ *.log)
# END: seconds this script may take in all (a device call's limit); later steps get what is left
end=${END:-100000}
left() { local t=$(( end - SECONDS - 10 )); echo $(( t < $1 ? t : $1 )); }
if [ "${TESTS:-1}" = 1 ]; then   # TESTS=0: the proof alone
  echo "== GPU tests at ${SECONDS}s"
  rm -rf /tmp/keep
  OUT=$out COMMVIZ_GPU_KEEP=/tmp/keep timeout "$(left "${TEST_TIMEOUT:-240}")" python3 -m pytest -q -m gpu -p no:cacheprovider \
    -o addopts= --ignore tests/test_gpu_verdict.py --ignore tests/test_gpu_verdict_4x.py tests 2>&1 | tail -60 | tee "$out/gpu_tests.log"
  [ -d /tmp/keep ] && tar czf "$out/gpu_keep.tgz" -C /tmp/keep .
fi
if [ "${BENCH:-1}" = 1 ] && [ "$(left 150)" -gt 60 ]; then
  echo "== graph overhead (2 ranks, real NCCL kernels in the graph) at ${SECONDS}s"
  timeout "$(left 150)" python3 -m torch.distributed.run --nproc_per_node 2 scripts/bench_graph_overhead.py \
    --out "$out/bench_graph_overhead.json" 2>&1 | tail -30 | tee "$out/bench_graph_overhead.log"
fi
if [ "${BENCH:-1}" = 1 ] && [ "$(left 120)" -gt 40 ]; then
  echo "== per-call cost (1 GPU, boxed; a short run: 11 rounds of 1,000 calls) at ${SECONDS}s"
  timeout "$(left 120)" python3 scripts/bench_overhead.py --device cuda --arrival boxed \
    --batches 11 --calls 1000 2>&1 | tail -12 \
    | tee "$out/bench_overhead_cuda_boxed.log"
fi
cp "$out/proof.log" "$out/gpu_tests.log" "$dest/" 2>/dev/null
tar czf "$dest/proof.tgz" -C "$out" .
echo "== done at ${SECONDS}s"
