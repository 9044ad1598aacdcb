#!/bin/bash
# The 8k sweep on the research model (Qwen2.5-Coder-0.5B, bf16), with the KV-group paths; two ranks of one thread
# each. Rerun to resume.
cd "$(dirname "$0")/../.."
# A fixed mmap threshold: freed blocks of 256 KB or more go back to the system (results/qwen0.5b-8k-pages/sweep.sh says why)
export OMP_NUM_THREADS=1 MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=262144  # two ranks of ~7 GB each: 72 rows of an 8k cache are 7.2 GB, so a sample decodes as two batches
exec torchrun --nproc-per-node 2 -m lab.sweep --model qwen2.5-coder-0.5b --dtype bfloat16 --threads 1 \
  --tasks niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multivalue,niah_multiquery \
  --length 8192 --samples 30 --stop eos --batch 36 \
  --methods dense,local,random,static,static_oracle,oracle,qada_rw,qada_prompt,static_oracle_kv,oracle_kv,qada_kv,qada_kv_all \
  --sparsities 0.5,0.6,0.7,0.8,0.85,0.9,0.95 \
  --grid oracle=0.8,0.7,0.6,0.4,0.2,0.1,0.05,0.02,0.005 \
  --grid qada_rw=0.8,0.7,0.6,0.4,0.2,0.1,0.05,0.02,0.005 \
  --grid qada_prompt=0.6,0.2,0.1,0.05,0.01 --grid oracle_kv=0.8,0.6,0.5,0.4,0.2 \
  --grid qada_kv=0.9,0.8,0.7,0.6,0.4,0.3,0.2,0.1 --grid qada_kv_all=0.8,0.6,0.4,0.2,0.05,0.02 \
  --track qada_rw,qada_prompt --calib-samples 2 \
  --ablations '' --ctxfree-samples 0 --no-report --out results/qwen0.5b-8k
