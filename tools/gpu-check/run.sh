#!/usr/bin/env bash
# The GPU checks, run on a lent GPU machine (CI has none): the tests marked `gpu` and the single-rank
# megatron tests, which take megatron's CUDA path there (NCCL, the model on the device, offload measured).
# Prepared here by prepare.sh; on the machine, from the repo root: bash tools/gpu-check/run.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src "$PWD"/apps/*/src | paste -sd:)
export RELAX_SGLANG_SRC=$PWD/.gpu/sglang PYTHONUNBUFFERED=1
log=${OUT:-/tmp}/gpu-check.log
{
  nvidia-smi -L
  python3 -c "import torch, transformers, megatron.core, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'megatron-core', megatron.core.__version__, 'peft', peft.__version__)"
  python3 -m pytest -p no:cacheprovider -q -m gpu -rs \
    packages/relax-core/tests/test_dcs_gpu.py packages/relax-core/tests/test_offload.py \
    packages/relax-rollout/tests/engines/test_sglang_tensor_gpu.py packages/relax-core/tests/test_lora_gpu.py
  python3 -m pytest -p no:cacheprovider -q packages/relax-train/tests/backends/megatron/test_backend.py \
    -k "${MEGATRON_TESTS:-test_log_probs_and_a_training_step or moe_log_probs or offload or checkpoint_round_trip or one-rank}"
} 2>&1 | tee "$log"
