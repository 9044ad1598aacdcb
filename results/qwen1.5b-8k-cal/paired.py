"""Paired differences between single configurations of the 1.5B confirmation, at (nearly) the same head sparsity or
KV read: the report's matched table interpolates between two measured points of each method, and static heads have
one point here. Score / dense is the mean over the four tasks; the interval is a paired bootstrap (2,000 draws of
the samples within each task, the same draw for both configurations and dense).

    python results/qwen1.5b-8k-cal/paired.py     # -> paired.md beside this file
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from lab.records import read_records  # noqa: E402
from lab.report import config_differences  # noqa: E402

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


def main() -> None:
    lines = config_differences(read_records(HERE), TASKS, PAIRS, "| ours (head sparsity / KV read) | against | "
                               "score / dense, ours | against | difference | 95 % interval | samples |")
    (HERE / "paired.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
