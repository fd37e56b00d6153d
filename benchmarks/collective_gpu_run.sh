#!/usr/bin/env bash
# The issue-5 GPU run in one go (2 GPUs, e.g. nvidia-h200-x2): build the CUDA/NVSHMEM library
# with CMake, run the 2-process GPU test, then the collective benchmark. Logs and results go
# to ${OUT:-/tmp/magi_native_gpu}. Usage: bash benchmarks/collective_gpu_run.sh [bench args]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/magi_native_gpu}; mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo PYTHONUNBUFFERED=1
PY=${PY:-python3}
NV=$($PY -c "import nvidia.nvshmem as m; print(list(m.__path__)[0])")
export LD_LIBRARY_PATH=$NV/lib:${LD_LIBRARY_PATH:-}
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvidia-smi topo -m
  $PY -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
  pip show nvidia-nvshmem-cu13 2>/dev/null | head -2; nvcc --version | tail -1; } 2>&1 | tee "$OUT/env.log"
t0=$(date +%s)
{ cmake -S . -B build/native -G Ninja -DMAGI_JAX_CUDA=ON -DPython_EXECUTABLE="$(command -v $PY)" \
  && cmake --build build/native && cp build/native/_magi_native_*.so magi_jax/; } > "$OUT/build.log" 2>&1
echo "build rc=$? in $(( $(date +%s) - t0 ))s"; tail -3 "$OUT/build.log"; ls -la magi_jax/*.so
t0=$(date +%s)
timeout 110 $PY -m pytest -q -p no:cacheprovider tests/native/test_native_gpu.py -x 2>&1 | tee "$OUT/gpu_test.log" | tail -40
echo "gpu test rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 ))s"
timeout 190 $PY benchmarks/collective_bench.py --out "$OUT" --budget-s 90 "$@" 2>&1 | grep -v "^[WI][0-9]\{4\} " | tee "$OUT/bench.log" | tail -60
echo "bench rc=${PIPESTATUS[0]}"
