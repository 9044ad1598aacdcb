#!/bin/bash
# The second length: 4k on the research model (Qwen2.5-Coder-0.5B, bf16), 15 samples per task, the 8k grid
# without the KV-group paths (run at 8k only). Two ranks of one thread each; rerun to resume.
# QAdA's tau 0.95 and 0.9 were added after the first 63 samples: at 4k its highest tau, 0.8, sits at 0.59 sparsity
# and was not clearly lossless (0.97 of dense [0.92, 1.01]); a resumed run decodes the new points for every sample.
cd "$(dirname "$0")/../.."
# A fixed mmap threshold: freed blocks of 256 KB or more go back to the system (results/qwen0.5b-8k-pages/sweep.sh says why)
export OMP_NUM_THREADS=1 MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=262144
exec torchrun --nproc-per-node 2 -m lab.sweep --model qwen2.5-coder-0.5b --dtype bfloat16 --threads 1 \
  --tasks niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multivalue,niah_multiquery \
  --length 4096 --samples 15 --stop eos --batch 36 \
  --methods dense,local,random,static,static_oracle,oracle,qada_rw,qada_prompt \
  --sparsities 0.5,0.6,0.7,0.8,0.85,0.9,0.95 \
  --grid oracle=0.8,0.7,0.6,0.4,0.2,0.1,0.05,0.02,0.005 \
  --grid qada_rw=0.95,0.9,0.8,0.7,0.6,0.4,0.2,0.1,0.05,0.02,0.005 \
  --grid qada_prompt=0.6,0.2,0.1,0.05,0.01 \
  --track qada_rw,qada_prompt --calib-samples 2 \
  --ablations '' --ctxfree-samples 0 --no-report --out results/qwen0.5b-4k
