#!/bin/bash
# Confirmation points on Qwen2.5-Coder-1.5B at 8k (bf16): the 0.5B's lossless settings (oracle tau 0.2,
# QAdA random words 0.6, prompt moments 0.2, static 0.8) and a neighbour of the adaptive ones, on four tasks including
# variable tracking (which the 1.5B can do and the 0.5B cannot). qada_rw@0.6 is tracked for the per-layer analysis.
# One process; THREADS (default 1) sets its threads. Rerun to resume.
cd "$(dirname "$0")/../.."
# A fixed mmap threshold: freed blocks of 256 KB or more go back to the system (results/qwen0.5b-8k-pages/sweep.sh says why)
export OMP_NUM_THREADS=${THREADS:-1} MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=262144
exec python -m lab.sweep --model qwen2.5-coder-1.5b --dtype bfloat16 --threads ${THREADS:-1} \
  --tasks niah_single_2,niah_multikey_2,niah_multivalue,vt --length 8192 --samples 6 --stop eos --batch 12 \
  --methods dense,local,static,oracle,qada_rw,qada_prompt --sparsities 0.8 \
  --grid oracle=0.6,0.2 --grid qada_rw=0.7,0.6,0.4 --grid qada_prompt=0.2 \
  --track qada_rw --calib-samples 2 --ablations '' --ctxfree-samples 0 --no-report --out results/qwen1.5b-8k
