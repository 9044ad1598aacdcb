"""The correction fitted at 16k against the one fitted at 8k, on the same 16k samples, configuration by
configuration; and the group rule on its estimate against the same rule on the true masses (the group oracle).
The 8k correction's runs are results/qwen0.5b-16k-pages' (renamed here with "_8k"), decoded in other batches from the
same prompts; dense is this folder's. Score / dense is the mean over the tasks both folders have finished, then
over each task alone; the interval a paired bootstrap (2,000 draws of the samples within each task, the same draw
for both and dense). Then, per configuration, how its answers that score below dense's lose: most continue the first
value with a description ("1. 9262740: This is a magic number ...") instead of the next value, and run out of new
tokens before the last.

    python results/qwen0.5b-16k-cal16/paired.py     # -> paired.md beside this file
"""

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from lab.records import read_records  # noqa: E402
from lab.report import config_differences  # noqa: E402

EIGHT_K = HERE.parent / "qwen0.5b-16k-pages"  # the same samples, decoded with the 8k correction
RENAMED = {"qada_kv_cal@0.6", "qada_pages@1024", "qada_pages@2048", "qada_pages@4096"}
PAIRS = [  # (first, second): what each comparison asks
    ("qada_kv_cal@0.6", "qada_kv_cal_8k@0.6"),      # the group rule: 16k correction against 8k
    ("qada_pages@1024", "qada_pages_8k@1024"),      # the combination, the same
    ("qada_pages@2048", "qada_pages_8k@2048"),
    ("qada_pages@4096", "qada_pages_8k@4096"),
    ("qada_kv_cal@0.6", "oracle_kv@0.6"),           # the estimate against the true masses, the same rule and tau
    ("oracle_kv@0.6", "dense"),                     # what the rule itself loses at tau 0.6
    ("qada_kv_cal@0.7", "qada_kv_cal@0.6"),         # a higher tau, the 16k correction
]


DESCRIBES = re.compile(r"^\W*1\.\s*\d+\s*:")  # "1. 9262740: ..." (a listed value, then prose about it)


def failure_modes(rows) -> list[str]:
    """Per configuration: the answers scoring below dense's on the same sample, and how many of them describe the
    first value instead of listing the next."""
    dense = {(r["task"], r["index"]): r["score"] for r in rows if r["config"] == "dense"}
    lines = ["| configuration | answers | below dense | of them describing the first value |", "|---|---:|---:|---:|"]
    for config in sorted({r["config"] for r in rows}):
        mine = [r for r in rows if r["config"] == config and (r["task"], r["index"]) in dense]
        lost = [r for r in mine if r["score"] < dense[r["task"], r["index"]]]
        described = sum(bool(DESCRIBES.match(r["pred"])) for r in lost)
        lines.append(f"| {config} | {len(mine)} | {len(lost)} | {described} |")
    return lines


def main() -> None:
    rows = read_records(HERE)
    samples = {(r["task"], r["index"]) for r in rows}
    tasks = sorted({t for t, _ in samples})
    for r in read_records(EIGHT_K):
        if (r["task"], r["index"]) in samples and r["config"] in RENAMED:
            method, threshold = r["config"].split("@")
            rows.append(dict(r, config=f"{method}_8k@{threshold}"))
    header = ("| first (head sparsity / KV read) | second | score / dense, first | second | difference | 95 % interval "
              "| samples |")
    lines = []
    for group in [tasks] + [[t] for t in tasks] if len(tasks) > 1 else [tasks]:  # every task, then each alone
        mine = [r for r in rows if r["task"] in group]
        lines += [f"Tasks: {', '.join(group)}.", "", *config_differences(mine, group, PAIRS, header), ""]
    lines += ["How the answers below dense's lose (every task):", ""]
    lines += failure_modes(rows)
    (HERE / "paired.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
