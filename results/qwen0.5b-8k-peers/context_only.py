"""kvpress's usual protocol (the context compressed, the question after it) has one ratio on every sample here, so the
report's matched table, which interpolates between two measured points, leaves it out. Its score against our dense
on the same samples, with a bootstrap interval over the samples:

    python results/qwen0.5b-8k-peers/context_only.py     # -> context_only.md beside this file
"""

import json
import lzma
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = ("snapkv_ctx@0.5", "expected_attention_ctx@0.5", "snapkv@0.5", "expected_attention@0.5")


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in lzma.open(path, "rt")]


def main() -> None:
    dense = {(r["task"], r["index"]): r["score"] for r in records(HERE.parent / "qwen0.5b-8k" / "samples.jsonl.xz")
             if r["config"] == "dense"}
    peers = records(HERE / "samples.jsonl.xz")
    lines = ["| press config | samples | KV read | score | our dense | score / dense | 95 % interval |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for config in CONFIGS:
        rs = [r for r in peers if r["config"] == config]
        s, d = [r["score"] for r in rs], [dense[r["task"], r["index"]] for r in rs]
        rng = random.Random(0)
        draws = sorted(sum(s[i] for i in idx) / sum(d[i] for i in idx)
                       for idx in ([rng.randrange(len(s)) for _ in s] for _ in range(2000)))
        kv = sum(r["kv_read"] for r in rs) / len(rs)
        lines.append(f"| {config} | {len(rs)} | {kv:.3f} | {sum(s) / len(s):.3f} | {sum(d) / len(d):.3f} | "
                     f"{sum(s) / sum(d):.2f} | [{draws[50]:.2f}, {draws[1949]:.2f}] |")
    (HERE / "context_only.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
