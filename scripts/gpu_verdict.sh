#!/usr/bin/env bash
# The verdict on NCCL in one device call, `bash scripts/gpu_verdict.sh [2x|4x]` (default 2x):
# 2x (issue 23, 2 GPUs): tests/test_gpu_verdict.py launches every scenario of
# tests/jobs/broken_step.py; 4x (issue 33, 4 GPUs): tests/test_gpu_verdict_4x.py those of
# tests/jobs/broken_mesh.py (groups that chain; commviz status asked live). Each scenario is
# launched as a user does (commviz launch, all at once) and checks
# each verdict against torch's Flight Recorder analyzer; then torch's analyzer (fr_trace) is run
# again on each run's dumps for the log, and the run dirs (records, journals, stacks, Flight
# Recorder dumps, the launch's logs and output; profiling is off, so no traces) are packed with
# the job as it ran and where this checkout was, for tests/fixtures/gpu/verdict-2xh100. gpu_tests.log, scenarios.log and
# verdict_runs.tgz go to $OUT (the device tool's result folder) or /tmp/commviz-verdict.
# Wheels missing on the GPU image are taken from .whl/ (scripts/gpu_validate.sh says how).
set -uo pipefail
cd "$(dirname "$0")/.."
dest=${OUT:-/tmp/commviz-verdict}
mkdir -p "$dest"
source scripts/gpu_env.sh
timeout 60 python3 -c "import torch, commviz; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name())" | tee "$dest/env.log"
case ${1:-2x} in
  2x) test=tests/test_gpu_verdict.py; runs_name=gpu_verdict; job=tests/jobs/broken_step.py ;;
  4x) test=tests/test_gpu_verdict_4x.py; runs_name=gpu_verdict_4x; job=tests/jobs/broken_mesh.py ;;
  *) echo "usage: gpu_verdict.sh [2x|4x]" >&2; exit 2 ;;
esac
keep=/tmp/verdict-keep
runs=$keep/$runs_name
rm -rf "$keep"
echo "== GPU tests at ${SECONDS}s"
COMMVIZ_GPU_KEEP=$keep timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  -o addopts= -rA "$test" 2>&1 | tail -120 | tee "$dest/gpu_tests.log"
echo "== Flight Recorder's analyzer at ${SECONDS}s"
for run in "$runs"/*/; do
  name=$(basename "$run")
  echo "=== $name: the launch said"
  grep -v '^\[' "$run/stdout.txt" | tail -40
  echo "=== $name: files"
  ls "$run" "$run/flight_recorder" 2>&1 | tr '\n' ' '; echo
  echo "=== $name: fr_trace"
  timeout 60 python3 -m torch.distributed.flight_recorder.fr_trace "$run/flight_recorder" \
    --allow-incomplete-ranks 2>&1 | tail -40
done >"$dest/scenarios.log" 2>&1
timeout 20 nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv >>"$dest/scenarios.log" 2>&1
cp "$job" "$runs/" 2>/dev/null
pwd >"$runs/repo.txt"            # the CPU test makes these paths its own checkout's
tar czf "$dest/verdict_runs.tgz" -C "$runs" --exclude='attempt_*' . 2>&1
ls -la "$dest"
echo "== done at ${SECONDS}s"
