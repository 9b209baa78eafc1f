#!/usr/bin/env bash
# torchtitan's own Trainer on the GPU machine under commviz (scripts/gpu_titan.py), each layout
# the GPUs allow, then every run merged and checked by scripts/gpu_proof.py (NCCL kernels named,
# records against torch's Flight Recorder, origins, lanes, verify). torchtitan 0.2.2 and what it
# imports that the GPU image lacks come from .whl/ (scripts/gpu_env.sh).
# Usage: bash scripts/gpu_titan.sh [STEPS]  (logs to $OUT or /tmp/commviz-titan)
set -uo pipefail
cd "$(dirname "$0")/.."
dest=${OUT:-/tmp/commviz-titan}
mkdir -p "$dest"
source scripts/gpu_env.sh
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
steps=${1:-4}
runs=/tmp/cvtitan
rm -rf "$runs" && mkdir -p "$runs"
common=(--training.steps="$steps" --training.local_batch_size=2 --training.seq_len=256
        --model.flavor=debugmodel_flex_attn --metrics.log_freq=1 --checkpoint.no-enable
        --lr_scheduler.warmup_steps=1 --job.dump_folder=/tmp/cvtitan-dump)
run_titan() {  # NAME NPROC FLAGS...: one torchtitan run, its output in $runs/NAME.log
  local name=$1 n=$2; shift 2
  TORCH_FR_BUFFER_SIZE=20000 timeout "${RUN_TIMEOUT:-240}" python3 -m torch.distributed.run --nproc_per_node "$n" \
    scripts/gpu_titan.py "$runs/$name" "${common[@]}" "$@" >"$runs/$name.log" 2>&1
  echo "titan $name: rc $?" | tee -a "$dest/titan.log"
  timeout 120 python3 -m commviz merge "$runs/$name" >>"$runs/$name.log" 2>&1
  echo "merge $name: rc $?" | tee -a "$dest/titan.log"
  tail -40 "$runs/$name.log" >"$dest/$name.tail.log"
  [ "${PACK:-0}" = 1 ] && (cd "$runs" && tar czf "$dest/$name.tgz" --exclude='*.pftrace' --exclude='matched_*' --exclude=plots "$name")
}
python3 -c "import torch, torchtitan; print('torch', torch.__version__, 'torchtitan', torchtitan.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$dest/titan.log"
python3 -c "from commviz.record import boundary; print('boundary kernel build:', boundary.prebuild() or 'ok')"
only=${ONLY:-}   # ONLY="name ...": just those layouts
titan() {  # a layout not in ONLY is skipped
  if [ -n "$only" ] && [[ " $only " != *" $1 "* ]]; then return; fi
  run_titan "$@"
}
if [ "$gpus" -ge 4 ]; then
  titan fsdp_tp 4 --parallelism.data_parallel_shard_degree=2 --parallelism.tensor_parallel_degree=2 \
    --activation_checkpoint.mode=full --compile.enable
  titan pp_tp_1f1b 4 --parallelism.pipeline_parallel_degree=2 --parallelism.tensor_parallel_degree=2 \
    --parallelism.data_parallel_shard_degree=1 --parallelism.pipeline_parallel_schedule=1F1B
  COMMVIZ_GPUTIME=off titan pp_tp_1f1b_nogputime 4 --parallelism.pipeline_parallel_degree=2 \
    --parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1 \
    --parallelism.pipeline_parallel_schedule=1F1B
  titan pp_tp_interleaved 4 --parallelism.pipeline_parallel_degree=2 --parallelism.tensor_parallel_degree=2 \
    --parallelism.data_parallel_shard_degree=1 --parallelism.pipeline_parallel_schedule=Interleaved1F1B \
    --parallelism.pipeline_parallel_layers_per_stage=2
else
  titan fsdp 2 --parallelism.data_parallel_shard_degree=2 --activation_checkpoint.mode=full --compile.enable
  titan tp 2 --parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1
  titan pp_1f1b 2 --parallelism.pipeline_parallel_degree=2 --parallelism.data_parallel_shard_degree=1 \
    --parallelism.pipeline_parallel_schedule=1F1B
  titan pp_interleaved 2 --parallelism.pipeline_parallel_degree=2 --parallelism.data_parallel_shard_degree=1 \
    --parallelism.pipeline_parallel_schedule=Interleaved1F1B --parallelism.pipeline_parallel_layers_per_stage=2
fi
for f in "$runs"/*.log; do echo "== $f"; tail -25 "$f"; done >"$dest/titan_tails.log"
timeout 200 python3 scripts/gpu_proof.py "$runs"/*/ 2>&1 | tee "$dest/titan_proof.log"
timeout 60 python3 scripts/titan_origins.py "$runs"/*/ 2>&1 | tee "$dest/titan_origins.log"
(cd "$runs" && tar czf "$dest/titan_runs.tgz" --exclude='*.pftrace' --exclude='matched_*' --exclude='plots' */ *.log)
