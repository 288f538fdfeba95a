#!/bin/bash
# Device side of the GPU check (benchmarks/notes/gpu22.md): runtime-only TVM + tvm_ffi from .gpu/, then
# gpu_run.py (tvmfuse vs stock: numbers + device time) and gpu_torch.py (torch baselines) on .gpu/art.tar.xz.
# Made by benchmarks/gpu_bundle.sh; run there as: bash benchmarks/gpu_device.sh  (SKIP_TORCH=1, ONLY=a,b)
set -u
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv
python3 -V
mkdir -p /tmp/site /tmp/gpu
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 3
tar xJf .gpu/site.tar.xz -C /tmp/site || exit 4
tar xJf .gpu/art.tar.xz -C /tmp/gpu || exit 5
CUDART=$(ldconfig -p | awk '/libcudart\.so\.13/{print $NF; exit}')
[ -z "$CUDART" ] && CUDART=$(find /usr/local /opt /usr/lib -name 'libcudart.so.13*' 2>/dev/null | head -1)
echo "cudart: $CUDART"
[ -n "$CUDART" ] && export LD_LIBRARY_PATH=$(dirname "$CUDART"):${LD_LIBRARY_PATH:-}
echo "setup $(( $(date +%s) - T0 )) s"
( export PYTHONPATH=/tmp/site TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1
  timeout ${GPU_RUN_TIMEOUT:-300} python3 benchmarks/gpu_run.py /tmp/gpu/art --repeat ${REPEAT:-20} ${ONLY:+--only $ONLY} > $OUT/gpu_run.log 2>&1
  echo "gpu_run rc $? at $(( $(date +%s) - T0 )) s" )
tail -45 $OUT/gpu_run.log
sleep 2
[ "${SKIP_TORCH:-0}" = 1 ] || PYTHONUNBUFFERED=1 timeout ${TORCH_TIMEOUT:-200} python3 benchmarks/gpu_torch.py /tmp/gpu/art ${ONLY:+--only $ONLY} \
  --compile ${COMPILE:-elementwise_chain,layernorm_softmax,rmsnorm,transformer_block} > $OUT/gpu_torch.log 2>&1
echo "gpu_torch rc $? total $(( $(date +%s) - T0 )) s"
tail -32 $OUT/gpu_torch.log
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv
