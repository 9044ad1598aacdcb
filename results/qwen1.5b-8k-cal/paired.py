"""Paired differences between single configurations of the 1.5B confirmation, at (nearly) the same head sparsity or
KV read: the report's matched table interpolates between two measured points of each method, and static heads have
one point here. Score / dense is the mean over the four tasks; the interval is a paired bootstrap (2,000 draws of
the samples within each task, the same draw for both configurations and dense).

    python results/qwen1.5b-8k-cal/paired.py     # -> paired.md beside this file
"""

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from lab.records import drawn_mean, normalised, paired_scores, paired_values, read_records  # noqa: E402

TASKS = ["niah_single_2", "niah_multikey_2", "niah_multivalue", "vt"]
PAIRS = [  # (ours, against): what each comparison asks
    ("qada_cal_transfer@0.3", "static@0.8"),     # head sparsity 0.80 both
    ("qada_cal@0.3", "static@0.8"),              # 0.83 against 0.80
    ("qada_cal@0.2", "oracle@0.2"),              # 0.87 against 0.86: the correction against the true masses
    ("qada_cal_transfer@0.2", "oracle@0.2"),     # 0.85 against 0.86
    ("qada_cal@0.2", "qada_rw@0.6"),             # calibrated against the paper's QAdA at its 0.5B lossless tau
    ("qada_kv_all_cal@0.2", "oracle@0.2"),       # KV read 0.38 against 0.46
    ("qada_kv_all_cal@0.3", "static@0.8"),       # KV read 0.49 against 0.53
]


def main(n_boot: int = 2000, seed: int = 0) -> None:
    rows = read_records(HERE)
    configs = sorted({c for pair in PAIRS for c in pair})
    scores = paired_scores(rows, TASKS, configs)
    values = {f: paired_values(rows, scores, configs, f) for f in ("sparsity", "kv_read")}
    everyone = {t: np.arange(len(order)) for t, (order, _) in scores.items()}
    rng = np.random.default_rng(seed)
    draws = [{t: rng.integers(0, len(order), len(order)) for t, (order, _) in scores.items()} for _ in range(n_boot)]

    def where(c: str) -> str:
        return " / ".join(f"{drawn_mean(v, everyone, c):.2f}" for v in values.values())

    lines = ["| ours (head sparsity / KV read) | against | score / dense, ours | against | difference | 95 % interval |"
             " samples |", "|---|---|---:|---:|---:|---|---:|"]
    for ours, other in PAIRS:
        diff = [normalised(scores, d, ours) - normalised(scores, d, other) for d in draws]
        lo, hi = np.percentile(diff, [2.5, 97.5])  # as lab.records' intervals
        a, b = normalised(scores, everyone, ours), normalised(scores, everyone, other)
        n = sum(len(order) for order, _ in scores.values())
        lines.append(f"| {ours} ({where(ours)}) | {other} ({where(other)}) | {a:.2f} | {b:.2f} | {a - b:+.2f} | "
                     f"[{lo:+.2f}, {hi:+.2f}] | {n} |")
    (HERE / "paired.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
