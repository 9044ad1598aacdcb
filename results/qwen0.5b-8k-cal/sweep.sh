#!/usr/bin/env bash
# Calibrated QAdA at 8k on the research model: the same six tasks, samples and seeds as results/qwen0.5b-8k (whose
# dense, static, oracle and QAdA records are the paired baseline: python -m lab.report results/qwen0.5b-8k-cal
# --with results/qwen0.5b-8k), with the corrections of results/calibration/ (fitted on prompts of task seed 1, the
# evaluation's is 42; the transfer ones on other task families). Two ranks of one thread each; rerun to resume.
set -euo pipefail
cd "$(dirname "$0")/../.."
# A fixed mmap threshold: freed blocks of 256 KB or more go back to the system (results/qwen0.5b-8k-pages/sweep.sh says why)
export OMP_NUM_THREADS=1 MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=262144
exec torchrun --nproc-per-node 2 -m lab.sweep --model qwen2.5-coder-0.5b --dtype bfloat16 --threads 1 \
  --tasks niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multivalue,niah_multiquery \
  --length 8192 --samples 30 --stop eos --batch 40 \
  --methods dense,qada_cal,qada_cal_offset,qada_cal_scale,qada_cal_quantile,qada_cal_transfer,qada_kv_cal,qada_kv_all_cal,qada_kv_cal_transfer \
  --grid qada_cal=0.7,0.6,0.5,0.4,0.3,0.2,0.15,0.1,0.05 \
  --grid qada_cal_offset=0.6,0.4,0.2,0.1 --grid qada_cal_scale=0.6,0.4,0.2,0.1 \
  --grid qada_cal_quantile=0.6,0.4,0.2,0.1 --grid qada_cal_transfer=0.6,0.4,0.2,0.1 \
  --grid qada_kv_cal=0.8,0.6,0.5,0.4,0.3,0.2 --grid qada_kv_all_cal=0.4,0.2,0.1,0.05,0.02 \
  --grid qada_kv_cal_transfer=0.6,0.4,0.3 \
  --calibration results/calibration/qwen0.5b-8k-niah --calibration-transfer results/calibration/qwen0.5b-8k-other \
  --calib-samples 2 --ablations "" --ctxfree-samples 0 --track "" --no-report --out results/qwen0.5b-8k-cal
