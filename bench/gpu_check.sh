#!/usr/bin/env bash
# The one device check for a lent GPU: the CUDA kernel tests (every strategy, the batched
# one through the driver's cuMemcpyBatchAsync included), the data-plane simulation on CUDA,
# and the GPU kernel benchmark (the page/blocks grid with each strategy and vLLM's batched op
# per shape, then the vLLM-shaped jobs against vLLM's op). Run from the repository root on
# the GPU machine:
#   OUT=/some/dir bash bench/gpu_check.sh
# Pure-Python dependencies the GPU image lacks (transitions, graphviz) travel as wheels in
# .whl/ (see bench/RESULTS.md for how they were fetched). Logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/kvspec-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvspec-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/kvspec-site:$PWD
else
    export PYTHONPATH=$PWD
fi
status=0
{ date -u; nvidia-smi -L; nproc
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.get_device_name())"
  python3 -c "from kernels import cudriver as d; op = d.batch_copy()
print('batched copy:', f'{op.symbol}, driver {op.driver_version}' if op else d.unavailable_reason())"
} 2>&1 | tee "$OUT/machine.txt"
python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/test_kernels_cuda.py \
    tests/test_kernels_batch.py 2>&1 | tee "$OUT/cuda_tests.txt" || status=1
python3 -c "import sys; from statemachine.cli import main; sys.exit(main(sys.argv[1:]))" \
    simulate --seed 1 --device cuda --no-progress 2>&1 | tee "$OUT/simulate_cuda.txt" || status=1
timeout "${BENCH_TIMEOUT:-300}" python3 bench/kernels.py --device cuda \
    --budget "${BENCH_BUDGET:-180}" 2>&1 | tee "$OUT/bench_cuda.txt" || status=1
exit $status
