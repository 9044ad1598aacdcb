"""The sampled estimate against the Gaussian one at equal decision cost, configuration by configuration: each pair
uses the same kind of correction (fitted on the same calibration prompts) and the same tau, so both sit at nearly the
same head sparsity and KV read, and the difference is the estimator's. Score / dense is the mean over the six tasks;
the interval is a paired bootstrap (2,000 draws of the samples within each task, the same draw for both configurations
and dense). The Gaussian configurations' records come from results/qwen0.5b-8k-cal (the same samples and seeds).

    python results/qwen0.5b-8k-sampled/paired.py     # -> paired.md beside this file
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from lab.records import read_records  # noqa: E402
from lab.report import config_differences, with_baseline  # noqa: E402

TASKS = ["niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multivalue", "niah_multiquery"]
PAIRS = [  # (sampled, Gaussian): the same correction kind and tau
    ("qada_sampled_cal@0.3", "qada_cal@0.3"),
    ("qada_sampled_cal@0.2", "qada_cal@0.2"),
    ("qada_sampled_cal@0.15", "qada_cal@0.15"),
    ("qada_sampled_cal@0.1", "qada_cal@0.1"),
    ("qada_sampled_cal_transfer@0.2", "qada_cal_transfer@0.2"),   # both fitted on the other task families
    ("qada_sampled_cal_transfer@0.1", "qada_cal_transfer@0.1"),
    ("qada_kv_sampled_cal@0.6", "qada_kv_cal@0.6"),               # per KV group, the group's mean share
    ("qada_kv_sampled_cal@0.5", "qada_kv_cal@0.5"),
]


def main() -> None:
    rows = with_baseline(HERE, read_records(HERE), HERE.parent / "qwen0.5b-8k-cal")
    lines = config_differences(rows, TASKS, PAIRS, "| sampled (head sparsity / KV read) | Gaussian (head sparsity / "
                               "KV read) | score / dense, sampled | Gaussian | difference | 95 % interval | samples |")
    (HERE / "paired.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
