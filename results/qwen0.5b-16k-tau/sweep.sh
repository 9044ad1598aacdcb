#!/usr/bin/env bash
# Does the group decision recover at 16k with a higher tau? Calibrated QAdA per KV group (the in-family correction
# fitted at 8k, as in results/qwen0.5b-16k-pages) at tau 0.6-0.9, with dense beside it, on the task where it loses
# there: niah_multivalue, the same ten samples and seeds. The combination with pages (qada_pages) decides as this rule
# does at tau 0.6, so where this rule is lossless, the combination's pages are what remains to lose. Beside it the
# group oracle (oracle_kv: the same mean-share rule on the true masses) at the same taus: where the rule itself is
# lossless at 16k, whatever the estimate. SAMPLES (default 10) stops early at whole samples.
#   bash results/qwen0.5b-16k-tau/sweep.sh && python -m lab.report results/qwen0.5b-16k-tau
# Two ranks of one thread each; rerun to resume. Memory and the mmap threshold: as results/qwen0.5b-16k-pages/sweep.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=262144
exec torchrun --nproc-per-node 2 -m lab.sweep --model qwen2.5-coder-0.5b --dtype bfloat16 --threads 1 \
  --tasks niah_multivalue --length 16384 --samples "${SAMPLES:-10}" --stop eos --batch 8 \
  --methods dense,qada_kv_cal,oracle_kv --grid qada_kv_cal=0.6,0.7,0.8,0.9 --grid oracle_kv=0.6,0.7,0.8,0.9 \
  --calibration results/calibration/qwen0.5b-8k-niah \
  --calib-samples 2 --ablations "" --ctxfree-samples 0 --track "" --no-report --out results/qwen0.5b-16k-tau
