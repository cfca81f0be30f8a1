#!/usr/bin/env bash
# The inner-loop benchmark on a lent GPU machine (the `device` tool): installs the daemon's
# wheels carried in .whl/, then measures eager and compiled bf16 at the built-in 126M size,
# bare and inside `swarmd join` (SIZES overrides the bare-only sizes). Logs go to $OUT.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
python3 -c "import torch, trio, swarmd.node.cli; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
timeout 150 python3 benchmarks/inner_loop.py --device cuda --sizes ${SIZES:-125m} \
  --daemon 125m --repeats 1 --steps 30 --warmup 5 --daemon-seconds 45 --progress-interval 5 \
  --inner-steps 100 2>&1 | tee "$OUT/eager.txt"
timeout 200 python3 benchmarks/inner_loop.py --device cuda --compile --sizes 125m \
  --daemon 125m --repeats 1 --steps 30 --warmup 5 --daemon-seconds 60 --progress-interval 5 \
  --inner-steps 100 2>&1 | tee "$OUT/compiled.txt"
