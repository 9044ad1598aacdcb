#!/usr/bin/env bash
# Long context, where skipping pays: calibrated QAdA against dense at 16k on the research model, three of the 8k
# sweep's tasks, 10 samples each, with the corrections fitted at 8k (results/calibration/: does a correction fitted
# at one length hold at twice it?). The paper's QAdA and the adaptive oracle beside, at their 8k lossless points.
#   python -m lab.report results/qwen0.5b-16k
# Two ranks of one thread each (a 16k prefill takes minutes per rank); rerun to resume.
set -euo pipefail
cd "$(dirname "$0")/../.."
# A fixed mmap threshold: freed blocks of 256 KB or more go back to the system (results/qwen0.5b-8k-pages/sweep.sh says why)
export OMP_NUM_THREADS=1 MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=262144
exec torchrun --nproc-per-node 2 -m lab.sweep --model qwen2.5-coder-0.5b --dtype bfloat16 --threads 1 \
  --tasks niah_single_2,niah_multikey_1,niah_multivalue --length 16384 --samples 10 --stop eos --batch 8 \
  --methods dense,oracle,qada_rw,qada_cal_transfer,qada_kv_all_cal,qada_kv_cal \
  --grid oracle=0.2 --grid qada_rw=0.6 --grid qada_cal_transfer=0.2,0.1 --grid qada_kv_all_cal=0.2 \
  --grid qada_kv_cal=0.6 \
  --calibration results/calibration/qwen0.5b-8k-niah --calibration-transfer results/calibration/qwen0.5b-8k-other \
  --calib-samples 2 --ablations "" --ctxfree-samples 0 --track "" --no-report --out results/qwen0.5b-16k
