#!/usr/bin/env bash
# kvpress's presses on the 8k sweep's own samples (results/qwen0.5b-8k: the same six tasks, seeds and prompts, each
# prompt's token count checked against its records), through transformers in a virtual environment of their own
# (kvpress pins transformers < 5.3); the control, hf_dense, on the first 2 samples per task. Reported with:
# python -m lab.report results/qwen0.5b-8k-cal --with results/qwen0.5b-8k --with results/qwen0.5b-8k-peers.
# Rerun to resume; THREADS sets torch's threads. The first 7 samples also ran question-aware ratio 0.25 and the
# context-only ratios 0.75 and 0.9 (the report names them and leaves them out of the matched table).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ ! -x .venv-peers/bin/python ]; then
  python -m venv --system-site-packages .venv-peers
  .venv-peers/bin/python -m pip install --quiet -r lab/requirements-peers.txt
fi
export OMP_NUM_THREADS=${THREADS:-2}
exec .venv-peers/bin/python -m lab.peers --model qwen2.5-coder-0.5b --dtype bfloat16 --threads "${THREADS:-2}" \
  --tasks niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multivalue,niah_multiquery \
  --length 8192 --samples "${SAMPLES:-15}" --presses snapkv,expected_attention --ratios 0.5,0.75,0.9 \
  --context-ratios 0.5 --dense-samples 2 --pair results/qwen0.5b-8k --out results/qwen0.5b-8k-peers
