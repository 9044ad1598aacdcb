#!/usr/bin/env bash
# Calibrated QAdA confirmed on Qwen2.5-Coder-1.5B at 8k: the 0.5B's best calibrated settings and neighbours on the
# four tasks of results/qwen1.5b-8k (variable tracking among them), 12 samples each (seed 42, as every sweep here).
# First the model's own corrections (the 0.5B's do not fit its heads), task seed 1, never evaluated: one on the
# evaluated tasks' generators, one on other task families (none of the four); both resume. Then the sweep:
#   python -m lab.report results/qwen1.5b-8k-cal --with results/qwen1.5b-8k
# Two ranks of one thread each for the sweep; rerun to resume.
set -euo pipefail
cd "$(dirname "$0")/../.."
# A fixed mmap threshold: freed blocks of 256 KB or more go back to the system (results/qwen0.5b-8k-pages/sweep.sh says why)
export MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=262144
python -m lab.calibrate --qada --model qwen2.5-coder-1.5b --dtype bfloat16 --threads 2 --length 8192 --samples 3 \
  --seed 1 --max-new-tokens 24 --tasks niah_single_2,niah_multikey_2,niah_multivalue,vt \
  --out results/calibration/qwen1.5b-8k-eval-tasks
python -m lab.calibrate --qada --model qwen2.5-coder-1.5b --dtype bfloat16 --threads 2 --length 8192 --samples 3 \
  --seed 1 --max-new-tokens 24 --tasks fwe,cwe,qa_1,qa_2 --out results/calibration/qwen1.5b-8k-other
export OMP_NUM_THREADS=1
exec torchrun --nproc-per-node 2 -m lab.sweep --model qwen2.5-coder-1.5b --dtype bfloat16 --threads 1 \
  --tasks niah_single_2,niah_multikey_2,niah_multivalue,vt --length 8192 --samples 12 --stop eos --batch 16 \
  --methods dense,static,oracle,qada_rw,qada_cal,qada_cal_transfer,qada_kv_all_cal,qada_kv_cal \
  --sparsities 0.8 --grid oracle=0.2 --grid qada_rw=0.6 --grid qada_cal=0.3,0.2,0.15 \
  --grid qada_cal_transfer=0.3,0.2 --grid qada_kv_all_cal=0.3,0.2 --grid qada_kv_cal=0.6 \
  --calibration results/calibration/qwen1.5b-8k-eval-tasks --calibration-transfer results/calibration/qwen1.5b-8k-other \
  --calib-samples 2 --ablations "" --ctxfree-samples 0 --track "" --no-report --out results/qwen1.5b-8k-cal
