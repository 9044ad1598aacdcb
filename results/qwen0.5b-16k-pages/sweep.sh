#!/usr/bin/env bash
# Token-level page selection at 16k on the research model: Quest alone and calibrated QAdA per KV group with its
# long-context groups reading only their top pages (qada_pages, bounds combined by max), at pages of 16 and 32, and the
# page oracle, at budgets of 128-4096 tokens beyond the window. The grid is the 8k sweep's (results/qwen0.5b-8k-pages)
# less what it settled there: pages of 64 and the sum of bounds (neither better), budgets of 32 and 64 (far below
# lossless for every selector). That halves a sample's decoding; at 16k a sample takes ~10 min on one rank, ~6-7 of
# them its prefill.
# The same three tasks, samples and seeds as results/qwen0.5b-16k (dense and calibrated QAdA per KV group alone are
# decoded again here, the paired baseline), with the same in-family correction:
#   python -m lab.report results/qwen0.5b-16k-pages --with results/qwen0.5b-16k
# Two ranks of one thread each; rerun to resume. SAMPLES (default 10 per task) lets a run stop early at a whole
# number of samples per task, merged and ready to commit; a later run with more resumes from there.
# --batch 8: at 16k a decoded row holds ~0.2 GB of KV cache; 48 rows per rank were killed for memory, and 16 left the
# two ranks thrashing at the 24 GiB limit after an hour (both before the fixed mmap threshold below).
set -euo pipefail
cd "$(dirname "$0")/../.."
# MALLOC_MMAP_THRESHOLD_: a fixed threshold, so that every allocation of 256 KB or more is its own mapping, returned
# on free. glibc's default raises the threshold to the largest block freed, after which the page oracle's per-step
# float32 copies of the keys, a few hundred bytes larger each step, came from the heap and were never reused: a 16k
# rank grew by ~1 GB per decode step to the 24 GiB limit (measured: 16.5 GB within 90 s of decoding; 4.5 GB with it).
export OMP_NUM_THREADS=1 MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=262144
exec torchrun --nproc-per-node 2 -m lab.sweep --model qwen2.5-coder-0.5b --dtype bfloat16 --threads 1 \
  --tasks niah_single_2,niah_multikey_1,niah_multivalue \
  --length 16384 --samples "${SAMPLES:-10}" --stop eos --batch 8 \
  --methods dense,qada_kv_cal,quest,quest_p32,qada_pages,qada_pages_p32,page_oracle \
  --grid qada_kv_cal=0.6 --budgets 128,256,512,1024,2048,4096 --calibration results/calibration/qwen0.5b-8k-niah \
  --calib-samples 2 --ablations "" --ctxfree-samples 0 --track "" --no-report --out results/qwen0.5b-16k-pages
