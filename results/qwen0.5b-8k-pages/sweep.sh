#!/usr/bin/env bash
# Token-level page selection at 8k on the research model: Quest alone, calibrated QAdA per KV group with its
# long-context groups reading only their top pages (qada_pages, bounds combined by max), and the page oracle, at
# budgets of 32-4096 tokens beyond the window and pages of 16 and 32 tokens. The first 20 samples also ran pages of 64
# (Quest and QAdA + pages) and the sum of a group's bounds: neither beat pages of 16/32 with the max there (the
# folder's README), so later samples decode only the 42 configurations left, one batch per sample. The same six
# tasks, samples and seeds as results/qwen0.5b-8k-cal (its records are the paired baseline, calibrated QAdA per KV
# group alone among them), with the same in-family correction:
#   python -m lab.report results/qwen0.5b-8k-pages --with results/qwen0.5b-8k-cal --with results/qwen0.5b-8k-peers
# Two ranks of one thread each; rerun to resume. SAMPLES (default 30 per task) lets a run stop early at a whole
# number of samples per task, merged and ready to commit; a later run with more resumes from there.
set -euo pipefail
cd "$(dirname "$0")/../.."
# MALLOC_MMAP_THRESHOLD_: a fixed threshold, so that every allocation of 256 KB or more is its own mapping, returned
# on free. glibc's default raises the threshold to the largest block freed, after which the page oracle's per-step
# float32 copies of the keys, a few hundred bytes larger each step, came from the heap and were never reused: a 16k
# rank grew by ~1 GB per decode step to the 24 GiB limit (measured: 16.5 GB within 90 s of decoding; 4.5 GB with it).
export OMP_NUM_THREADS=1 MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=262144
exec torchrun --nproc-per-node 2 -m lab.sweep --model qwen2.5-coder-0.5b --dtype bfloat16 --threads 1 \
  --tasks niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multivalue,niah_multiquery \
  --length 8192 --samples "${SAMPLES:-30}" --stop eos --batch 42 \
  --methods dense,qada_kv_cal,quest,quest_p32,qada_pages,qada_pages_p32,page_oracle \
  --grid qada_kv_cal=0.6 --budgets 32,64,128,256,512,1024,2048,4096 --calibration results/calibration/qwen0.5b-8k-niah \
  --calib-samples 2 --ablations "" --ctxfree-samples 0 --track "" --no-report --out results/qwen0.5b-8k-pages
