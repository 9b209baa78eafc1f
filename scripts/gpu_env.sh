# Sourced by the GPU scripts (gpu_validate.sh, gpu_proof.sh), from the repository root: NVLink
# multicast off, the wheels the GPU image lacks (perfetto, orjson, pydantic, ...) installed from
# .whl/ when it was carried, and commviz installed in place.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# once per machine, under a lock: two GPU scripts may start side by side
exec 9>/tmp/commviz-gpu-env.lock && flock 9
if [ -d .whl ]; then
  [ -f /tmp/site/.commviz-wheels ] || { python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.commviz-wheels; } || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
[ -f /tmp/.commviz-installed ] || { python3 -m pip install -q --no-deps --no-build-isolation --no-index \
  -e . >/dev/null 2>&1; touch /tmp/.commviz-installed; }
flock -u 9
