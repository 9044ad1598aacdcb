#!/usr/bin/env bash
# Is the 16k shortfall the 8k correction's? Calibrated QAdA per KV group and QAdA + pages at 16k with the affine
# correction fitted at 16k (results/calibration/qwen0.5b-16k-niah: the six niah generators, 2 prompts each, seed 1,
# never an evaluated prompt), on the same three tasks, samples and seeds as results/qwen0.5b-16k-pages, dense beside
# it in the same batch (the paired baseline):
#   python -m lab.calibrate --qada --model qwen2.5-coder-0.5b --dtype bfloat16 --threads 2 --length 16384 --samples 2 \
#     --seed 1 --max-new-tokens 24 \
#     --tasks niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multivalue,niah_multiquery \
#     --out results/calibration/qwen0.5b-16k-niah
#   bash results/qwen0.5b-16k-cal16/sweep.sh
#   python -m lab.report results/qwen0.5b-16k-cal16 && python results/qwen0.5b-16k-cal16/paired.py
# (the report alone: --with the pages folder would file its 8k-correction runs of the same names under these
# configurations; paired.py sets them beside, renamed)
# One batch of eight rows per sample: dense, the group rule at tau 0.6 and 0.7, the group oracle at tau 0.6 (the same
# rule on the true masses: what no correction can beat), the combination (tau 0.6) at budgets of 512-4096 tokens
# beyond the window with pages of 16 (the 8k correction's runs of both are in
# results/qwen0.5b-16k-pages, on the same samples). TASKS (default: all three) and SAMPLES (default 10 per task) let a
# run stop early at whole samples; a later run with more resumes from there. Two ranks of one thread each; rerun to
# resume. Memory and the mmap threshold: as results/qwen0.5b-16k-pages/sweep.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=262144
exec torchrun --nproc-per-node 2 -m lab.sweep --model qwen2.5-coder-0.5b --dtype bfloat16 --threads 1 \
  --tasks "${TASKS:-niah_single_2,niah_multikey_1,niah_multivalue}" \
  --length 16384 --samples "${SAMPLES:-10}" --stop eos --batch 8 \
  --methods dense,qada_kv_cal,oracle_kv,qada_pages \
  --grid qada_kv_cal=0.6,0.7 --grid oracle_kv=0.6 --budgets 512,1024,2048,4096 \
  --calibration results/calibration/qwen0.5b-16k-niah \
  --calib-samples 2 --ablations "" --ctxfree-samples 0 --track "" --no-report --out results/qwen0.5b-16k-cal16
