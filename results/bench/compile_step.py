"""A one-off measurement: does torch.compile of the whole decode step pay on this CPU?

    python results/bench/compile_step.py --threads 2 > results/bench/compile_step.md

The default model in bf16 on the shipped needle prompt; greedy decoding of 16 tokens, eager against
torch.compile(model.forward, dynamic=True), for dense and for QAdA (tau 0.6, random-words moments). QAdA's step
cannot be one graph: the labels' host sync decides which KV heads are read, so dynamo breaks the graph there, and the
cache's filled length (a Python int) makes it recompile until its cache limit. Prints ms per token (best of two
eager runs) and whether the tokens are identical.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from attention import build_attention  # noqa: E402
from weights.checkpoints import DEFAULT, load  # noqa: E402
from weights.downloads import cache_dir  # noqa: E402
from moments import ReferenceKeys  # noqa: E402


def main(threads: int, tokens: int) -> None:
    torch.set_num_threads(threads)
    model, tok = load(DEFAULT, dtype=torch.bfloat16, progress=False)
    root = Path(__file__).resolve().parents[1]
    ids = tok.encode_chat([{"role": "user", "content": (root / "examples/needle.txt").read_text()}])
    cache = model.new_cache(len(ids) + tokens)
    first = model.prefill(torch.tensor([ids]), cache).argmax(-1)  # (1,)
    n0, reference = cache.length, ReferenceKeys(model, tok, "random", root=cache_dir() / "moments", progress=False)
    compiled = torch.compile(model.forward, dynamic=True)

    def run(forward, method, n):
        cache.length = n0  # roll back to the prompt
        attention = build_attention(method, cache, tau=0.6, reference=reference) if method != "dense" else None
        token, out = first, []
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(n):
                token = forward(token[:, None], cache, attention).argmax(-1)
                out.append(int(token))
        return out, (time.perf_counter() - t0) / n

    print(f"{len(ids)} prompt tokens, {threads} threads, bf16, torch {torch.__version__}")
    for method in ("dense", "qada"):
        want, t_eager = run(model.forward, method, tokens)
        t0 = time.perf_counter()
        run(compiled, method, 4)  # compiles (and recompiles)
        warm = time.perf_counter() - t0
        got, t_comp = run(compiled, method, tokens)
        t_eager = min(t_eager, run(model.forward, method, tokens)[1])
        print(f"{method}: eager {1e3 * t_eager:.0f} ms/token, compiled {1e3 * t_comp:.0f} ms/token "
              f"(first 4 tokens with compiling: {warm:.0f} s); identical tokens: {got == want}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens timed per run (default: 16)")
    a = p.parse_args()
    main(a.threads, a.tokens)
