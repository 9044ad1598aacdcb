"""Max against sum for combining a KV group's page bounds (qada_pages, qada_pages_sum), at a KV read of 0.10, on the
samples the sum ran on (the first 19: three of each task, four of niah_single_2): score / dense interpolated at that
read, with paired-bootstrap 95 % intervals and the paired difference (lab.records.matched_table, as analysis.md's
page table). Run from the repository root:

    python results/qwen0.5b-8k-pages/max_vs_sum.py > results/qwen0.5b-8k-pages/max_vs_sum.md
"""

import sys
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
sys.path.insert(0, str(FOLDER.parents[1]))
from lab.records import label, matched_table, read_records  # noqa: E402

rows = read_records(FOLDER)
tasks = sorted({r["task"] for r in rows})
ran = {(r["task"], r["index"]) for r in rows if r["method"] == "qada_pages_sum"}
rows = [r for r in rows if (r["task"], r["index"]) in ran]
table = matched_table(rows, tasks, "kv_read", (0.1,), against="qada_pages", methods={"qada_pages", "qada_pages_sum"})
print(f"{len(ran)} samples ({', '.join(f'{t} {sum(1 for x in ran if x[0] == t)}' for t in tasks)}); score / dense at "
      "a KV read of 0.10, pages of 16\n")
print("| method | @0.1 | minus max @0.1 |\n|---|---:|---:|")
for r in sorted(table, key=lambda r: r["method"]):
    v, d = r[0.1], r.get("vs 0.1")
    print(f"| {label(r['method'])} | {v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}] | "
          + (f"{d[0]:+.2f} [{d[1]:+.2f}, {d[2]:+.2f}]" if d else "") + " |")
