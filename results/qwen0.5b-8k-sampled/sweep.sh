#!/usr/bin/env bash
# The bulk mass from 64 sampled keys instead of the Gaussian, at 8k on the research model: raw (qada_sampled) and with
# its own affine correction (kind "sampled" of results/calibration/: fitted on the evaluated tasks' generators, and
# on other task families for the transfer), per head and per KV group. The same six tasks, samples and seeds as
# results/qwen0.5b-8k and results/qwen0.5b-8k-cal, whose records are the paired baseline:
#   python -m lab.report results/qwen0.5b-8k-sampled --with results/qwen0.5b-8k --with results/qwen0.5b-8k-cal
# Two ranks of one thread each; rerun to resume.
set -euo pipefail
cd "$(dirname "$0")/../.."
# A fixed mmap threshold: freed blocks of 256 KB or more go back to the system (results/qwen0.5b-8k-pages/sweep.sh says why)
export OMP_NUM_THREADS=1 MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=262144
exec torchrun --nproc-per-node 2 -m lab.sweep --model qwen2.5-coder-0.5b --dtype bfloat16 --threads 1 \
  --tasks niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multivalue,niah_multiquery \
  --length 8192 --samples 30 --stop eos --batch 40 \
  --methods dense,qada_sampled,qada_sampled_cal,qada_sampled_cal_transfer,qada_kv_sampled_cal \
  --grid qada_sampled=0.95,0.9,0.8,0.7,0.6 --grid qada_sampled_cal=0.6,0.4,0.3,0.2,0.15,0.1 \
  --grid qada_sampled_cal_transfer=0.6,0.4,0.2,0.1 --grid qada_kv_sampled_cal=0.8,0.6,0.5,0.4 \
  --calibration results/calibration/qwen0.5b-8k-niah --calibration-transfer results/calibration/qwen0.5b-8k-other \
  --calib-samples 2 --ablations "" --ctxfree-samples 0 --track "" --no-report --out results/qwen0.5b-8k-sampled
