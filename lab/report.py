"""Tables and plots from a lab.sweep run folder: the paper's Fig. 4, 5e-g, 6a-c, 7, appendix C and Table 2.

    python -m lab.report results/ruler-4k

Reads RUN's records (lab.records.result_files: samples.jsonl.xz, or the plain files of a run in progress) and writes
into RUN:
    summary.csv       task x config: n, score (0-1), sparsity, KV-read fraction, answer tokens, decode time
    summary.md        the same as pivot tables, with the dense score and the local-window floor per task
    analysis.md       lossless sparsity and KV read with paired-bootstrap intervals, score / dense per configuration
                      with its interval, the KV-group rules against per-head QAdA, the paper's claims against ours
                      with intervals, QAdA against the oracle per layer,
                      agreement with the oracle by head decile and recall of long-context heads (App. C),
                      the Gaussian log-mass error (Table 2), the context-independent question (Fig. 6c),
                      the moments ablations (Fig. 5e-g); when page paths ran, QAdA + pages against Quest alone
    fig4_score_vs_sparsity.png, figKV_score_vs_kv_read.png (when the KV-group, page or peers' paths ran),
    fig5efg_moments_ablation.png (when the ablations ran), fig6a_sparsity_along_answer.png,
    fig6bc_sparsity_vs_tau.png, fig7_long_context_heads.png, figC_recall_long_context_heads.png
--out DIR writes them into DIR instead; --tasks that leave out some of the run's tasks write only there, from those
tasks' records alone (RUN's own files cover the whole run, summary.csv as the tables).
Averages over tasks use only the samples every compared config has finished, so a partial run compares like
with like. Sparsity = fraction of (decode step, layer, head) labelled local, averaged per sample. A damaged record
line stops the report with its file and line; --skip-damaged leaves it out and states how many at the top of
summary.md and analysis.md.
"""

import argparse
import csv
import math
import shlex
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from lab.cli import Parser, fail, named_twice
from lab.plots import plots
from lab.records import (ABLATIONS, MAIN_TAU, MATCHED, PEER_PATHS, DamagedRecord, common_indices, config_sort_key,
                        confusion, curves, differs, draw_picks, drawn_mean, group, head_counts, is_run_folder, label,
                        lossless_draws, lossless_table, matched_table, mean, mean_draws, measured_points,
                        method_configs, normalised, normalised_draws, or_none, page_methods, paired_scores,
                        paired_values, read_records, read_run, recall_rows, run_recall, static_oracle_freq,
                        summary_rows)
from lab.tasks import CTXFREE, TASKS as TASK_ORDER


def fmt(x, scale=1.0, digits=1):
    return "–" if x is None else f"{x * scale:.{digits}f}"


# ---------------------------------------------------------------------------------------------------------
# Summary


def damage_note(damaged: list[str]) -> list[str]:
    """The lines a table file states the damaged record lines left out with (--skip-damaged); none if none."""
    if not damaged:
        return []
    return [f"**{len(damaged)} damaged record line(s) left out** (--skip-damaged): " + "; ".join(damaged), ""]


def partial_note(info: dict | None, rows) -> list[str]:
    """The lines a table file states an unfinished sweep with, from its run.json `info` (read_run): the folder's last
    lab.sweep command started and did not finish, or a task of its settings has no record yet; none for a finished
    run or a folder without run.json (info None)."""
    if info is None:
        return []
    said = []
    last = (info.get("runs") or [{}])[-1]
    if "started" in last and "finished" not in last:  # lab.sweep enters "started" first, "finished" at its end
        said.append(f"the last sweep into this folder, started {last['started']}, did not finish")
    missing = [t for t in info["settings"].get("tasks", []) if not any(r["task"] == t for r in rows)]
    if missing:
        said.append(f"no record yet of {', '.join(missing)}")
    if not said:
        return []
    return [f"**A partial run**: {'; '.join(said)}. The tables cover what was decoded; the same lab.sweep command "
            "resumes it.", ""]


def write_summary(out: Path, rows, tasks, notes: list[str] = (), name: str | None = None):
    srows = summary_rows(rows)
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(srows[0]))
        w.writeheader()
        for r in srows:
            w.writerow({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
    g = group(rows)
    configs = sorted({r["config"] for r in rows if r["task"] in tasks}, key=config_sort_key)
    lines = [f"# Summary of {name or out.name}", "",
             "Score = RULER string match x 100, averaged over samples. Sparsity = fraction of (decode step, layer, "
             "head) labelled local. KV read = fraction of KV entries read; for the oracle it is implied by its labels "
             "(what a path that skips by them would read): the oracle path itself reads every entry to find them. "
             "n = samples per task.", ""] + list(notes)
    # dense vs floor
    lines += ["## Dense score and the local-window floor per task", "",
              "| task | n | dense | local (floor) | dense tokens |",
              "|---|---|---|---|---|"]
    for t in tasks:
        d, l = g.get((t, "dense"), []), g.get((t, "local"), [])
        lines.append(f"| {t} | {len(d)} | {fmt(mean([r['score'] for r in d]), 100)} | "
                     f"{fmt(mean([r['score'] for r in l]), 100)} "
                     f"| {fmt(mean([r['n_new'] for r in d]))} |")
    # per-task score pivot (all finished samples) + averages over common samples. The ablations run on the first
    # samples only, the peers (lab.peers) on their own, and a configuration a sweep dropped part-way on the samples it
    # reached: each is averaged on its own samples (with dense's), not allowed to shrink the others' to them
    side = {r["config"] for r in rows if r["method"] in ABLATIONS or r.get("path") in PEER_PATHS}
    n = {c: sum(len(g.get((t, c), [])) for t in tasks) for c in configs}
    most = max((n[c] for c in configs if c not in side), default=0)
    side |= {c for c in configs if n[c] < most and c != "dense"}
    cur = curves(rows, tasks, [c for c in configs if c not in side])
    for c in side:
        cur.update(curves(rows, tasks, [c]))
    lines += ["", "## Score per task x config (all finished samples), and averages over the tasks' common samples", "",
              "Averages: over the samples that every config of the sweep has finished (the ablations, the peers of "
              "lab.peers and configs run on fewer samples than the most: each over its own samples and dense's there). "
              "avg norm. = mean over tasks of score / dense score; worst drop = largest dense - score "
              "over tasks.", "",
              "| config | " + "".join(f"{t} | " for t in tasks)
              + "avg score | avg norm. | worst drop | sparsity | KV read |",
              "|---|" + "---|" * (len(tasks) + 5)]
    for c in configs:
        cells = []
        for t in tasks:
            rs = g.get((t, c), [])
            cells.append(f"{fmt(mean([r['score'] for r in rs]), 100)} ({len(rs)})" if rs else "–")
        cv = cur.get(c)
        tail = ([fmt(cv["score"], 100), fmt(cv["norm"], 1, 2), fmt(cv["worst_drop"], 100), fmt(cv["sparsity"], 1, 3),
                 fmt(cv["kv_read"], 1, 3)] if cv else ["–"] * 5)
        lines.append(f"| {c} | " + " | ".join(cells) + " | " + " | ".join(tail) + " |")
    ctxfree = any(r["task"] == CTXFREE for r in rows)
    columns = tasks + [CTXFREE] * ctxfree  # the context-free samples' configs have a row here even without a task
    lines += ["", "## Sparsity per task x config", "", "| config | " + " | ".join(columns) + " |",
              "|---|" + "---|" * len(columns)]
    for c in sorted({r["config"] for r in rows if r["task"] in columns}, key=config_sort_key):
        lines.append(f"| {c} | " + " | ".join(fmt(mean([r["sparsity"] for r in g.get((t, c), [])]), 1, 3)
                                            for t in columns) + " |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return cur


# ---------------------------------------------------------------------------------------------------------
# Lossless sparsity with a paired bootstrap (records.lossless_table)


NONE = "none measured"  # no configuration of the method kept >= 0.95 of dense: no lossless point to state


def lossless_cells(r: dict) -> str:
    """'point | [lo, hi]' of a lossless_table row; the point "none measured" when no measured configuration was
    lossless on every sample (the interval stays: some draws of the samples may find one)."""
    point = f"{r['lossless']:.2f}" if r["found"] else NONE
    return f"{point} | [{r['lo']:.2f}, {r['hi']:.2f}]"


def write_lossless(out: Path, rows, tasks) -> list[str]:
    pages = page_methods(rows)  # curves over a page budget: on the KV-read axis only
    heads = [m for m in method_configs(rows, tasks) if m not in pages] if pages else None
    table = lossless_table(rows, tasks, methods=heads)
    lines = ["## Lossless sparsity (mean normalised score >= 0.95 of dense), paired bootstrap 95 % interval", "",
             "The highest measured sparsity up to which every point of the method keeps >= 0.95 of dense (mean over "
             "tasks of score / dense score, on the samples that dense and every configuration of the method finished). "
             "Interval: 2,000 bootstrap draws of the samples within each task, the same draw for dense and each "
             "configuration of the method (paired), each draw placing the configurations at the sparsity and KV read "
             "of its samples. Only measured points count: "
             "a method whose highest point is still lossless may go further.", ""]
    if pages:
        lines += ["The page paths (Quest, QAdA + pages, the page oracle) are curves over their page budget at a fixed "
                  "head sparsity: they are in the KV-read tables only.", ""]
    lines += ["| method | lossless sparsity | 95 % interval | KV read there | points | highest measured | samples |",
              "|---|---:|---|---:|---:|---:|---:|"]
    for r in table:
        lines.append(f"| {label(r['method'])} | {lossless_cells(r)} | "
                     f"{fmt(r['kv_read'], 1, 2)} | {r['points']} | {r['max_sparsity']:.2f} | {r['n']} |")
    lines += ["", "## Lossless KV-read fraction (grouped-query attention), paired bootstrap 95 % interval", "",
              "The same rule on the fraction of KV entries read (lower is better): the lowest measured read fraction "
              "down to which every point of the method keeps >= 0.95 of dense. For the oracles the read is implied by "
              "their labels.", "",
              "| method | lossless KV read | 95 % interval | head sparsity there | points | lowest measured "
              "| samples |",
              "|---|---:|---|---:|---:|---:|---:|"]
    for r in lossless_table(rows, tasks, axis="kv_read"):
        lines.append(f"| {label(r['method'])} | {lossless_cells(r)} | "
                     f"{fmt(r['sparsity'], 1, 2)} | {r['points']} | {r['min_kv_read']:.2f} | {r['n']} |")
    lines += ["", "## The same with the worst-task rule", "",
              "A point is lossless when its worst task keeps >= 0.95 of dense, instead of the mean over tasks (1,000 "
              "draws).", "",
              "| method | lossless sparsity | 95 % interval | lossless KV read | 95 % interval | samples |",
              "|---|---:|---|---:|---|---:|"]
    worst_kv = {r["method"]: r for r in lossless_table(rows, tasks, "kv_read", n_boot=1000, worst=True)}
    worst_sp = {r["method"]: r for r in lossless_table(rows, tasks, n_boot=1000, worst=True, methods=heads)}
    for m in list(worst_sp) + [m for m in worst_kv if m not in worst_sp]:  # the peers and page paths: KV read only
        r, k = worst_sp.get(m), worst_kv.get(m)
        lines.append(f"| {label(m)} | " + (lossless_cells(r) if r else " | ")
                     + " | " + (lossless_cells(k) if k else " | ")
                     + f" | {(r or k)['n']} |")
    diffs = kv_read_differences(rows, tasks)
    if diffs:
        lines += ["", "## Per KV group against per query head and static per KV head: lossless KV read, paired",
                  "", kv_read_differences.__doc__.split("\n\n")[0].replace("\n    ", " "), "",
                  "| method | lossless KV read | against | its lossless KV read | difference | 95 % interval "
                  "| samples |",
                  "|---|---:|---|---:|---:|---|---:|"]
        lines += diffs
    return lines


def score_table(points: dict[str, dict]) -> list[str]:
    """Every measured configuration as a point of Fig. 4: the mean over tasks of score / dense on the samples it and
    dense both finished, with a paired-bootstrap 95 % interval (1,000 draws of the samples within each task), and
    its head sparsity and KV read on those samples. Where samples are few, these intervals are the ones to quote."""
    lines = ["| config | head sparsity | KV read | score / dense | 95 % interval | samples |",
             "|---|---:|---:|---:|---|---:|"]
    for c, p in points.items():
        if c != "dense":  # the reference: 1 by construction
            lines.append(f"| {c} | {fmt(p['sparsity'], 1, 2)} | {fmt(p['kv_read'], 1, 2)} | {p['norm']:.2f} | "
                         f"[{p['lo']:.2f}, {p['hi']:.2f}] | {p['n']} |")
    return lines


def matched_tables(rows, tasks, n_boot: int = 1000) -> list[str]:
    """Score / dense of each method at matched head sparsity and at matched KV read, interpolated linearly between its
    two measured configurations around the target, with a paired-bootstrap 95 % interval (1,000 draws of the samples
    within each task, the configurations' sparsity and KV read redrawn with their scores), and the paired difference
    from static heads (RULER calibration) at the same target. Blank: the target lies outside the method's measured
    range."""
    pages = page_methods(rows)  # held against Quest alone in page_tables instead
    heads = [m for m in method_configs(rows, tasks) if m not in pages] if pages else None
    lines = []
    for axis, name in (("sparsity", "head sparsity"), ("kv_read", "KV read")):
        table = matched_table(rows, tasks, axis, against="static", n_boot=n_boot, methods=heads)
        if not table:
            continue
        targets = MATCHED[axis]
        cell = lambda v: "" if v is None else f"{v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}]"  # noqa: E731
        diff = lambda v: "" if v is None else f"{v[0]:+.2f} [{v[1]:+.2f}, {v[2]:+.2f}]"  # noqa: E731
        lines += [f"**At {name}** " + ", ".join(f"{t:g}" for t in targets) + " (score / dense; then minus static)", "",
                  "| method | " + " | ".join(f"@{t:g}" for t in targets) + " | "
                  + " | ".join(f"vs static @{t:g}" for t in targets)
                  + " | samples |", "|---|" + "---:|" * (2 * len(targets) + 1)]
        for r in table:
            lines.append(f"| {label(r['method'])} | " + " | ".join(cell(r[t]) for t in targets) + " | "
                         + " | ".join(diff(r.get(f"vs {t}")) for t in targets) + f" | {r['n']} |")
        lines.append("")
    return lines


PEER_TARGETS = (0.5, 0.25)  # KV-read fractions at which the peers are compared
PEER_AGAINST = ("qada_kv_cal", "qada_cal", "qada_kv", "qada_rw")  # the first of these present: what peers face


def peer_tables(rows, tasks, n_boot: int = 1000) -> list[str]:
    """Score / dense of every method at KV read 0.5 and 0.25, on the samples that every press configuration (and
    dense) finished (the configurations run on the most samples: others are named and left out), interpolated
    between each method's two measured configurations around the target, with a
    paired-bootstrap 95 % interval (the same draws for all) and the paired difference from the first of PEER_AGAINST
    that ran (calibrated QAdA per KV group). Then what each press costs: the fraction of the compressed span it keeps,
    the KV cache it holds while decoding, its own seconds at prefill (once per prompt) and the seconds per decoded
    token of a press decoded alone (its records with batch 1, where the run has some: transformers' eager decoding
    on the machine the run had, its question included for the context-only protocol). Blank: the target lies outside
    the method's measured range."""
    runs = Counter(r["config"] for r in rows if r.get("path") == "kvpress" and r["task"] in tasks)
    if not runs:
        return []
    most = max(runs.values())  # a grid widened or narrowed part way: the configurations run on fewer samples aside
    peer_cfgs = sorted((c for c in runs if runs[c] == most), key=config_sort_key)
    aside = sorted((c for c in runs if runs[c] < most), key=config_sort_key)
    idx = common_indices(group(rows), tasks, peer_cfgs + ["dense"])
    if not any(idx.values()):
        return ["No sample has every press configuration and dense: report the peers with the sweep whose samples "
                "they ran on (`python -m lab.report SWEEP --with PEERS`)."]
    common = [r for r in rows if r["task"] in tasks and r["index"] in idx[r["task"]] and r["config"] not in aside]
    against = next((m for m in PEER_AGAINST if any(r["method"] == m for r in common)), None)
    table = matched_table(common, tasks, "kv_read", PEER_TARGETS, against=against, n_boot=n_boot)
    cell = lambda v: "" if v is None else f"{v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}]"  # noqa: E731
    diff = lambda v: "" if v is None else f"{v[0]:+.2f} [{v[1]:+.2f}, {v[2]:+.2f}]"  # noqa: E731
    lines = [f"{sum(map(len, idx.values()))} samples ({', '.join(f'{t} {len(idx[t])}' for t in tasks)}); "
             f"differences against {label(against) if against else 'no QAdA run'}."
             + (f" Run on fewer samples, left out here: {', '.join(f'{c} ({runs[c]} runs)' for c in aside)}."
                if aside else ""), "",
             "| method | " + " | ".join(f"@{t:g}" for t in PEER_TARGETS) + " | "
             + " | ".join(f"minus {against or '–'} @{t:g}" for t in PEER_TARGETS) + " |",
             "|---|" + "---:|" * 2 * len(PEER_TARGETS)]
    for r in sorted(table, key=lambda r: config_sort_key(r["method"])):
        lines.append(f"| {label(r['method'])} | " + " | ".join(cell(r[t]) for t in PEER_TARGETS) + " | "
                     + " | ".join(diff(r.get(f"vs {t}")) for t in PEER_TARGETS) + " |")
    lines += ["", "| press config | kept of the compressed span | KV cache held, MiB | press s (once) "
              "| decode s / token (alone) | samples |", "|---|---:|---:|---:|---:|---:|"]
    g = group(common)
    for c in peer_cfgs:
        rs = [r for t in tasks for r in g.get((t, c), [])]
        alone = [r["decode_s"] / max(r["n_new"], 1) for r in rs if r.get("batch", 1) == 1]  # a batch's time is shared
        lines.append(f"| {c} | {mean([r['kv_kept'] for r in rs]):.3f} | "
                     f"{mean([r['kv_bytes'] for r in rs]) / 2**20:.1f} | "
                     f"{mean([r['compress_s'] for r in rs]):.2f} | "
                     f"{f'{mean(alone):.3f} ({len(alone)})' if alone else '–'} "
                     f"| {len(rs)} |")
    return lines


KV_COMPARISONS = (("qada_kv_all", "qada_rw"), ("qada_kv", "qada_rw"), ("qada_kv_all", "static_oracle_kv"),
                  ("qada_kv", "static_oracle_kv"), ("oracle_kv", "oracle"), ("qada_kv_all", "qada_kv"))


def kv_read_differences(rows, tasks, n_boot: int = 2000, seed: int = 0, pairs=KV_COMPARISONS) -> list[str]:
    """Each pair's lossless KV-read fractions on the samples both methods (and dense) finished, and the difference
    (first minus second: below 0, the first reads less at no loss) with a 95 % interval from the same bootstrap
    draws for both (paired)."""
    cfgs, lines = method_configs(rows, tasks), []
    for a, b in pairs:
        if a not in cfgs or b not in cfgs:
            continue
        res = lossless_draws(rows, tasks, {a: cfgs[a], b: cfgs[b]}, axis="kv_read", n_boot=n_boot, seed=seed)
        if not res or a not in res or b not in res:
            continue
        read_a, read_b = 1 - res[a]["point"], 1 - res[b]["point"]  # the draws hold 1 - the lossless read
        if not res[a]["found"] or not res[b]["found"]:  # a method with no lossless point: no difference to state
            shown = {m: f"{1 - res[m]['point']:.2f}" if res[m]["found"] else NONE for m in (a, b)}
            lines.append(f"| {label(a)} | {shown[a]} | {label(b)} | {shown[b]} | – | – | {res[a]['n']} |")
            continue
        diff = res[b]["boot"] - res[a]["boot"]
        lo, hi = float(np.percentile(diff, 2.5)), float(np.percentile(diff, 97.5))
        lines.append(f"| {label(a)} | {read_a:.2f} | {label(b)} | {read_b:.2f} | {read_a - read_b:+.2f} | "
                     f"[{lo:+.2f}, {hi:+.2f}] | {res[a]['n']} |")
    return lines


def config_differences(rows, tasks, pairs, header: str, n_boot: int = 2000, seed: int = 0) -> list[str]:
    """A markdown table (under `header`, a line of seven column names) of single configurations compared in pairs
    (first, second): each one's head sparsity / KV read and score / dense (mean over tasks) on the samples dense and
    every configuration finished, and first minus second with a paired-bootstrap 95 % interval (n_boot draws of the
    samples within each task, the same draw for both configurations and dense). For what the matched tables cannot
    say: a method with one measured point, or two configurations at (nearly) the same cost."""
    configs = sorted({c for pair in pairs for c in pair})
    scores = paired_scores(rows, tasks, configs)
    values = {f: paired_values(rows, scores, configs, f) for f in ("sparsity", "kv_read")}
    everyone = {t: np.arange(len(order)) for t, (order, _) in scores.items()}
    rng = np.random.default_rng(seed)
    draws = draw_picks(scores, n_boot, rng)
    n = sum(len(order) for order, _ in scores.values())

    def where(c: str) -> str:
        return " / ".join(f"{drawn_mean(v, everyone, c):.2f}" for v in values.values())

    lines = [header, "|---|---|---:|---:|---:|---|---:|"]
    for a, b in pairs:
        sa, sb = normalised(scores, everyone, a), normalised(scores, everyone, b)
        if sa is None or sb is None:  # dense scores 0 on every task: no ratio to compare
            lines.append(f"| {a} ({where(a)}) | {b} ({where(b)}) | – | – | – | | {n} |")
            continue
        pairs_drawn = zip(*(or_none(normalised_draws(scores, draws, c)) for c in (a, b)))
        diff = [x - y for x, y in pairs_drawn if x is not None and y is not None]  # draws where dense scored
        lo, hi = np.percentile(diff, [2.5, 97.5]) if diff else (math.nan, math.nan)  # as lab.records' intervals
        lines.append(f"| {a} ({where(a)}) | {b} ({where(b)}) | {sa:.2f} | {sb:.2f} | {sa - sb:+.2f} | "
                     f"[{lo:+.2f}, {hi:+.2f}] | {n} |")
    return lines


# ---------------------------------------------------------------------------------------------------------
# Page selection: QAdA + pages against Quest alone


PAGE_TARGETS = (0.2, 0.1, 0.05)  # KV-read fractions the page paths reach, compared at beside MATCHED's
PAGE_COMPARISONS = (("qada_pages", "quest"), ("qada_pages_p32", "quest_p32"), ("qada_pages_p64", "quest_p64"),
                    ("qada_pages_frac", "quest_frac"), ("qada_pages_sum", "quest"), ("qada_pages_sum", "qada_pages"),
                    ("qada_pages_share", "quest"), ("qada_pages_share", "qada_pages"),
                    ("qada_pages", "qada_kv_cal"), ("quest", "page_oracle"), ("quest_p32", "page_oracle_p32"),
                    ("quest_p64", "page_oracle_p64"))  # (first, second): the combination against each part of it
NEAREST = PAGE_COMPARISONS[:5]  # the combinations and Quest alone, at their configurations nearest in KV read


def quest_for(method: str, present) -> str | None:
    """Quest alone at the page size (or budget unit) of `method`, among the methods `present`, else Quest at
    pages of 16; None without Quest."""
    for suffix in ("_p32", "_p64", "_frac"):
        if method.endswith(suffix) and "quest" + suffix in present:
            return "quest" + suffix
    return "quest" if "quest" in present else None


def page_tables(rows, tasks, n_boot: int = 1000) -> list[str]:
    """Quest alone (every head reads its window and its top pages), calibrated QAdA per KV group with pages in its
    long-context groups (ours), the page oracle (analysis only: its read is implied by pages chosen from every score)
    and calibrated QAdA per KV group alone, each a curve over its page budget (QAdA alone: over tau). First score /
    dense at matched KV read (interpolated between a method's two measured configurations around the target, as
    above) and the paired difference from Quest alone at the same page size and read; then the lossless KV reads
    compared in pairs; then each combination's configuration and Quest's nearest to it in KV read, compared directly,
    for when their measured ranges of KV read do not meet. Paired-bootstrap 95 % intervals throughout (the same draws
    of the samples within each task for both methods and dense); blank: the target lies outside a method's range."""
    pages = page_methods(rows)
    cfgs = method_configs(rows, tasks)
    if not pages & set(cfgs):
        return []
    alone = next((m for m in PEER_AGAINST if m in cfgs and m not in pages), None)  # calibrated QAdA per KV group
    shown = [m for m in cfgs if m in pages or m == alone]
    targets = MATCHED["kv_read"] + PAGE_TARGETS
    table = []
    for q in dict.fromkeys(quest_for(m, cfgs) for m in shown):  # each Quest once, with the methods held against it
        group_ = [m for m in shown if quest_for(m, cfgs) == q]
        table += [dict(r, against=q) for r in matched_table(rows, tasks, "kv_read", targets, against=q, n_boot=n_boot,
                                                            methods=group_)]
    cell = lambda v: "" if v is None else f"{v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}]"  # noqa: E731
    diff = lambda v: "" if v is None else f"{v[0]:+.2f} [{v[1]:+.2f}, {v[2]:+.2f}]"  # noqa: E731
    lines = ["**At KV read** " + ", ".join(f"{t:g}" for t in targets) + " (score / dense; then minus Quest alone at "
             "the same page size)", "",
             "| method | " + " | ".join(f"@{t:g}" for t in targets) + " | Quest alone | "
             + " | ".join(f"minus Quest @{t:g}" for t in targets) + " | samples |",
             "|---|" + "---:|" * len(targets) + "---|" + "---:|" * (len(targets) + 1)]
    for r in sorted(table, key=lambda r: config_sort_key(r["method"])):
        lines.append(f"| {label(r['method'])} | " + " | ".join(cell(r[t]) for t in targets)
                     + f" | {r['against'] or '–'} | " + " | ".join(diff(r.get(f"vs {t}")) for t in targets)
                     + f" | {r['n']} |")
    diffs = kv_read_differences(rows, tasks, pairs=PAGE_COMPARISONS)
    if diffs:
        lines += ["", "**Lossless KV read, paired** (first minus second: below 0, the first reads less at no loss; "
                  "mean-over-tasks rule)", "",
                  "| method | lossless KV read | against | its lossless KV read | difference | 95 % interval "
                  "| samples |",
                  "|---|---:|---|---:|---:|---|---:|"] + diffs
    near = []
    for a, b in NEAREST:
        if a in cfgs and b in cfgs:
            kv = {c: mean([r["kv_read"] for r in rows if r["config"] == c and r["task"] in tasks])
                  for c in cfgs[a] + cfgs[b]}
            ca, cb = min(((x, y) for x in cfgs[a] for y in cfgs[b]), key=lambda p: (abs(kv[p[0]] - kv[p[1]]), p))
            if paired_scores(rows, tasks, [ca, cb]):
                near += config_differences(rows, tasks, [(ca, cb)], "", n_boot=2 * n_boot)[2:]
    if near:
        lines += ["", "**Nearest in KV read** (each combination's configuration and Quest's closest to it in mean KV "
                  "read; head sparsity / KV read in brackets; first minus second)", "",
                  "| combination | Quest alone | score / dense | Quest's | difference | 95 % interval | samples |",
                  "|---|---|---:|---:|---:|---|---:|"] + near
    return lines


# ---------------------------------------------------------------------------------------------------------
# The paper's claims against ours, each with a 95 % interval


def claims_table(rows, tasks, n_boot: int = 2000, seed: int = 0) -> list[str]:
    """Markdown: what the paper reports against what these records show, each with a 95 % bootstrap interval. A
    claim about a difference between methods uses lossless points on the samples every method in it finished, with
    the same draws for all (paired). Verdict: a value claim is "consistent" when the paper's figure or range meets
    our interval; a direction claim "holds" when the interval excludes 0 on the paper's side, is "reversed" when it
    excludes 0 on the other, and is "not resolved" otherwise. Where no configuration of a method was lossless, ours
    says "none measured"; the interval and verdict still come from the draws, which count a draw that finds no
    lossless point as 0."""
    g = group(rows)
    cfgs = method_configs(rows, tasks)
    claims = []  # (claim, where, paper's value, ours point, draws, kind: "value" (lo, hi) or "direction" 0, digits)

    def lossless(*methods):
        if not all(m in cfgs for m in methods):
            return None
        res = lossless_draws(rows, tasks, {m: cfgs[m] for m in methods}, n_boot=n_boot, seed=seed)
        return None if not res or not all(m in res for m in methods) else [res[m] for m in methods]

    for m, claim, where, paper in (("static_oracle", "static oracle heads: lossless head sparsity", "§4.1, Fig. 4",
                                    (0.6, 0.7)),
                                   ("oracle", "adaptive oracle: lossless head sparsity", "§1, Fig. 2, §4.1",
                                    (0.85, 0.9))):
        r = lossless(m)
        if r:
            claims.append((claim, where, f"{paper[0]:g}-{paper[1]:g}", r[0]["point"] if r[0]["found"] else None,
                           r[0]["boot"], paper, 2, "lower" if r[0]["open"] else None))
    for a, b, claim, where in (("oracle", "static_oracle", "adaptive oracle minus static oracle (lossless sparsity)",
                                "§4.1: ~+0.2"),
                               ("qada_rw", "static", "QAdA (random words) minus static heads",
                                "§4.2: QAdA outperforms static"),
                               ("qada_rw", "static_oracle", "QAdA (random words) minus static oracle",
                                "§4.2: matches it"),
                               ("qada_rw", "qada_prompt", "random-words moments minus the prompt's own",
                                "App. E: Option 2 better")):
        r = lossless(a, b)
        if r:
            paper = "≈ 0" if "matches" in where else "> 0"
            point = r[0]["point"] - r[1]["point"] if r[0]["found"] and r[1]["found"] else None
            # a minuend whose grid ended lossless makes the difference a lower bound, a subtrahend's an upper one
            bound = {(True, False): "lower", (False, True): "upper", (True, True): "neither"}.get(
                (r[0]["open"], r[1]["open"]))
            claims.append((claim, where, paper, point, r[0]["boot"] - r[1]["boot"],
                           None if paper == "≈ 0" else 0.0, 2, bound))
    tracked = [r for r in rows if r["task"] in tasks and r["config"] == f"qada_rw@{MAIN_TAU:g}" and "log_err" in r]
    for key, claim, paper in (("log_err", "Gaussian bulk estimate off by a factor (exp of the mean abs. log error)",
                               (2, 5)),
                              ("dist_local", "A_bulk and A_local differ by a factor (exp of the mean abs. log ratio)",
                               (15, 50))):
        for layers, which in ((slice(None), "every layer"), (slice(1, None), "layers 1 and up")):
            per_task = defaultdict(list)
            for r in tracked:  # (L, H) per run: its mean over decode steps
                heads = np.array(r[key], dtype=float)[layers]
                if heads.size:  # a one-layer model has no layers 1 and up: no claim, not a NaN
                    per_task[r["task"]].append(float(heads.mean()))
            if per_task:
                point, boot = mean_draws(per_task, n_boot, seed)
                claims.append((f"{claim}, {which} (qada_rw@{MAIN_TAU:g})", "App. C, Table 2", f"{paper[0]}-{paper[1]}",
                               float(np.exp(point)), np.exp(boot), paper, 1, None))
    freq = static_oracle_freq(g, tasks)
    for m in ("qada_prompt", "qada_rw"):  # the paper's appendix C uses the prompt's own moments (Option 1)
        per_task = defaultdict(list)
        for r in rows:
            if r["task"] in freq and r["config"] == f"{m}@{MAIN_TAU:g}" and "oracle_freq" in r and r.get("steps"):
                rec = run_recall(r, freq[r["task"]])
                if rec:
                    per_task[r["task"]].append(rec[0] - rec[1])
        if per_task:
            point, boot = mean_draws(per_task, n_boot, seed)
            claims.append((f"recall of the oracle's long-context heads, {m}@{MAIN_TAU:g} minus static oracle",
                           "App. C, Fig. 9", "> 0", point, boot, 0.0, 3, None))
    lines = ["| claim | paper | paper's figure | ours | 95 % interval | verdict |", "|---|---|---:|---:|---|---|"]
    for claim, where, paper, point, boot, ref, digits, bound in claims:
        lo, hi = float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))
        cell = NONE if point is None else {"lower": "≥ ", "upper": "≤ "}.get(bound, "") + f"{point:.{digits}f}"
        lines.append(f"| {claim} | {where} | {paper} | {cell} | [{lo:.{digits}f}, {hi:.{digits}f}] | "
                     f"{verdict(lo, hi, ref, bound)} |")
    if any(c[-1] for c in claims):
        lines += ["", "≥ (≤): the method (the one subtracted) was still lossless at its most saving measured "
                  "point, so the figure bounds the claim from below (above); a verdict the grid's end leaves open says "
                  "so."]
    return lines


def verdict(lo: float, hi: float, ref, bound: str | None = None) -> str:
    """Our interval [lo, hi] against the paper: ref (a, b) a value or range it reports, None "about equal" (a difference
    of 0), a number x "greater than x". `bound` "lower" ("upper"): ours only bounds the truth from below (above),
    a grid that ended lossless; "neither": it bounds it neither way. Only what the bound still decides is said."""
    if isinstance(ref, tuple):
        said = "below the paper" if hi < ref[0] else "above the paper" if lo > ref[1] else "consistent"
    elif ref is None:
        said = "consistent" if lo <= 0 <= hi else ("ours higher" if lo > 0 else "ours lower")
    else:
        said = "holds" if lo > ref else "reversed" if hi < ref else "not resolved"
    if bound is None or (bound == "lower" and said in ("above the paper", "ours higher", "holds")) or (
            bound == "upper" and said in ("below the paper", "ours lower", "reversed")):
        return said
    return "not resolved: the grid ends lossless"


def layer_disagreement(rows) -> list[str]:
    """Per layer, for tracked runs: QAdA against the oracle on the same queries (TP/FP/TN/FN, positive = local, and
    Cohen's kappa, – where both label every head alike), and the Gaussian log-mass estimate against the true bulk mass:
    mean |error| and mean signed error (estimate - truth; negative = bulk underestimated, so heads wrongly local). With
    the moments the run used, and, where recorded, with the exact moments of the prompt's bulk at that step: the gap
    between the two says how much of the error is the moments and how much the Gaussian shape. Every figure is a mean
    over (step, head), runs weighted by their steps; the last rows group layer 0 and the thirds of the other layers."""
    tracked = [r for r in rows if "oracle_freq" in r and r.get("steps")]
    if not tracked:
        return []
    S, q, o, b = head_counts(tracked)  # (L, H) step-weighted counts
    w = np.array([r["steps"] for r in tracked], dtype=float)
    L = q.shape[0]

    def row(name: str, layers: list[int]) -> str:
        def log_error(key: str) -> float | None:
            if not all(key in r for r in tracked):
                return None
            per_run = np.array([np.mean(np.array(r[key], dtype=float)[layers]) for r in tracked])
            return float((per_run * w).sum() / w.sum())
        TP, FP, TN, FN = confusion(q[layers].sum(), o[layers].sum(), b[layers].sum(), S * q[layers].size)
        po, pe = TP + TN, (TP + FP) * (TP + FN) + (TN + FN) * (TN + FP)
        kappa = (po - pe) / (1 - pe) if pe < 1 else None  # both label every head alike: agreement is all chance
        cells = [fmt(x, 1, 2) for x in (TP, FP, TN, FN, kappa, FP + TN, FN + TN)]
        cells += [fmt(log_error(k), 1, 2) for k in ("log_err", "log_bias", "log_err_exact", "log_bias_exact")]
        return f"| {name} | " + " | ".join(cells) + " |"

    lines = ["| layer | TP | FP | TN | FN | kappa | oracle long | QAdA long | abs log err | signed "
             "| abs err, exact moments | signed, exact |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [row(str(layer), [layer]) for layer in range(L)]
    third = (L - 1) / 3
    groups = [("**layer 0**", [0])] + [(f"**layer {lo}**" if hi == lo + 1 else f"**layers {lo}-{hi - 1}**",
                                         list(range(lo, hi))) for lo, hi in
                                        [(1, 1 + round(third)), (1 + round(third), 1 + round(2 * third)),
                                         (1 + round(2 * third), L)]]
    return lines + [row(name, layers) for name, layers in groups if layers]


# ---------------------------------------------------------------------------------------------------------
# Analysis tables


def agreement_by_decile(rows) -> list[str]:
    S, q, o, b = head_counts(rows)
    if not S:
        return ["(no tracked runs)"]
    order = np.argsort(-(o / S).ravel(), kind="stable")  # heads most often local (oracle) first
    lines = ["| head decile (by oracle local freq.) | oracle local freq. | TP | FP | TN | FN | accuracy |",
             "|---|---|---|---|---|---|---|"]
    # deciles; under ten heads (a tiny model) a row per head, labelled by its share of the heads (1 of 8: 0-12%),
    # not ten chunks of which some are empty (0 / 0, nan on every column) and the others labelled by decile
    n_rows = min(10, order.size)
    for d, chunk in enumerate(np.array_split(order, n_rows)):
        label = f"{100 * d // n_rows}-{100 * (d + 1) // n_rows}%"
        n = S * len(chunk)
        tp, fp, tn, fn = confusion(q.ravel()[chunk].sum(), o.ravel()[chunk].sum(), b.ravel()[chunk].sum(), n)
        lines.append(f"| {label} | {o.ravel()[chunk].sum() / n:.2f} | {tp:.3f} | {fp:.3f} | {tn:.3f} | {fn:.3f} "
                     f"| {tp + tn:.3f} |")
    n = S * q.size
    tp, fp, tn, fn = confusion(q.sum(), o.sum(), b.sum(), n)
    lines.append(f"| all | {o.sum() / n:.2f} | {tp:.3f} | {fp:.3f} | {tn:.3f} | {fn:.3f} | {tp + tn:.3f} |")
    return lines


def log_error_table(rows, oracle_freq_rank) -> list[str]:
    """Table 2: |log A_bulk - Gaussian estimate| and |log A_bulk - log A_local|, all heads and the most-local heads."""
    err = [np.array(r["log_err"]) for r in rows if "log_err" in r]
    dist = [np.array(r["dist_local"]) for r in rows if "log_err" in r]
    if not err:
        return ["(no tracked runs)"]
    err, dist = np.stack(err), np.stack(dist)  # (R, L, H)
    lines = ["| heads | log error, mean ± std | factor exp(mean) | dist. local, mean ± std |", "|---|---|---|---|"]
    for name, frac in (("all", 1.0), ("20% most often local", 0.2), ("10% most often local", 0.1)):
        k = max(1, round(frac * oracle_freq_rank.size))
        sel = np.zeros(oracle_freq_rank.size, bool)
        sel[oracle_freq_rank[:k]] = True
        sel = sel.reshape(err.shape[1:])
        e, d = err[:, sel].ravel(), dist[:, sel].ravel()
        lines.append(f"| {name} | {e.mean():.2f} ± {e.std():.2f} | {np.exp(e.mean()):.1f} "
                     f"| {d.mean():.2f} ± {d.std():.2f} |")
    return lines


RECALL_METHODS = ("qada_rw", "qada_prompt", "qada_prompt_online")  # the moment sources whose runs track the oracle


def recall_table(rr: list[dict]) -> list[str]:
    """Appendix C's recall of the oracle's long-context (step, head) pairs by QAdA and by static oracle labels at
    QAdA's own sparsity (`rr`: records.recall_rows), per task and configuration, then each configuration's plain mean
    over the tasks."""
    lines = ["", "## Recall of the oracle's long-context heads: QAdA vs static oracle labels at the same sparsity", "",
             "Positives here are the oracle's long-context (step, head) pairs on QAdA's decoding; the static oracle "
             f"labels the heads most often local under the oracle at tau {MAIN_TAU:g} on all of the task's evaluated "
             "prompts, at QAdA's sparsity.", "",
             "| task | config | QAdA sparsity | oracle sparsity | recall QAdA | recall static oracle |",
             "|---|---|---|---|---|---|"]
    keys = ("qada_sparsity", "oracle_sparsity", "recall_qada", "recall_static_oracle")
    for r in rr:
        lines.append(f"| {r['task']} | {r['config']} | " + " | ".join(f"{r[k]:.3f}" for k in keys) + " |")
    by_cfg = defaultdict(list)
    for r in rr:
        by_cfg[r["config"]].append(r)
    for c, rs in sorted(by_cfg.items(), key=lambda kv: config_sort_key(kv[0])):
        lines.append(f"| mean | {c} | " + " | ".join(f"{np.mean([r[k] for r in rs]):.3f}" for k in keys) + " |")
    return lines


def write_analysis(out: Path, rows, tasks, cur, points, rr, notes: list[str] = (), name: str | None = None):
    g = group(rows)
    task_rows = [r for r in rows if r["task"] in tasks]
    lines = [f"# Analysis of {name or out.name}", ""] + list(notes) + write_lossless(out, rows, tasks) + [""]
    lines += ["## Score / dense per configuration, paired bootstrap 95 % interval", "",
              score_table.__doc__.split("\n\n")[0].replace("\n    ", " "), ""] + score_table(points) + [""]
    lines += ["## Score / dense at matched head sparsity and KV read, paired bootstrap 95 % interval", "",
              matched_tables.__doc__.split("\n\n")[0].replace("\n    ", " "), ""] + matched_tables(rows, tasks)
    pages = page_tables(rows, tasks)
    if pages:
        lines += ["## Page selection: QAdA + pages against Quest alone, paired", "",
                  page_tables.__doc__.replace("\n    ", " "), ""] + pages + [""]
    peers = peer_tables(rows, tasks)
    if peers:
        lines += ["## Peers: kvpress's presses at matched KV read, on their common samples", "",
                  peer_tables.__doc__.split("\n\n")[0].replace("\n    ", " "), ""] + peers + [""]
    lines += ["## The paper's claims against ours", "",
              claims_table.__doc__.split("\n\n")[0].replace("\n    ", " "), ""]
    lines += claims_table(rows, tasks) + [""]
    for m in ("qada_rw", "qada_prompt"):  # random-words moments, then the prompt's own (fixed) where tracked
        per_layer = layer_disagreement([r for r in task_rows if r["config"] == f"{m}@{MAIN_TAU:g}"])
        if per_layer:
            lines += [f"## Why QAdA and the oracle disagree, per layer ({m}@{MAIN_TAU:g}, tracked runs)", "",
                      layer_disagreement.__doc__.split("\n\n")[0].replace("\n    ", " "), ""] + per_layer + [""]
    # agreement, App. C
    main = f"qada_rw@{MAIN_TAU:g}"
    tracked = [r for r in task_rows if r["config"] == main and "oracle_freq" in r]
    lines += [f"## QAdA vs oracle agreement ({main}, oracle at the same tau, on QAdA's own decoding; "
              "positive = local)", "",
              f"{len(tracked)} runs. Heads sorted by how often the oracle labels them local, in deciles of the "
              f"(layer, head) pairs. Fractions of all (step, head) pairs of the decile.", ""]
    lines += agreement_by_decile(tracked)
    lines += recall_table(rr)
    # Table 2
    oracle_runs = [r for r in task_rows if r["config"] == f"oracle@{MAIN_TAU:g}" and "local_freq" in r]
    rank_src = oracle_runs or tracked
    key = "local_freq" if oracle_runs else "oracle_freq"
    if rank_src:
        freq = np.mean([np.array(r[key]) for r in rank_src], 0).ravel()
        rank = np.argsort(-freq, kind="stable")
        lines += ["", f"## Gaussian log-mass error (Table 2), {main} runs", "",
                  "Per (run, layer, head): mean over decode steps of |log A_bulk - (log T_bulk + mu_s + sigma_s^2/2)| "
                  "(log error) and |log A_bulk - log A_local| (dist. local). Most-local heads ranked by the adaptive "
                  f"oracle's local frequency at tau {MAIN_TAU:g}.", ""]
        lines += log_error_table(tracked, rank)
    # context-independent question
    if any(r["task"] == CTXFREE for r in rows):
        lines += ["", "## Context-independent question (Fig. 6c): sparsity at the same tau", "",
                  "| config | RULER tasks (mean ± std over tasks) | context-independent | n ctxfree |",
                  "|---|---|---|---|"]
        for c in sorted({r["config"] for r in rows if r["task"] == CTXFREE}, key=config_sort_key):
            per = [mean([r["sparsity"] for r in g.get((t, c), [])]) for t in tasks]
            per = [p for p in per if p is not None]
            cf = [r["sparsity"] for r in g.get((CTXFREE, c), []) if r["sparsity"] is not None]
            lines.append(f"| {c} | {fmt(mean(per), 1, 3)} ± {fmt(float(np.std(per)) if per else None, 1, 3)} | "
                         f"{fmt(mean(cf), 1, 3)} | {len(cf)} |")
        for r in g.get((CTXFREE, f"qada_rw@{MAIN_TAU:g}"), [])[:1]:
            lines += ["", f"Example answer (qada_rw@{MAIN_TAU:g}): {r['pred'][:300]!r}"]
    # moments ablations on the ablation samples
    abl = sorted({r["config"] for r in task_rows if r["method"] in ("qada_word", "qada_long")}, key=config_sort_key)
    if abl:
        taus = sorted({r["threshold"] for r in task_rows if r["method"] in ("qada_word", "qada_long")})
        comp = [f"{m}@{t:g}" for t in taus
                for m in ("qada_rw", "qada_prompt", "qada_prompt_online", "qada_word", "qada_long")
                if any(r["config"] == f"{m}@{t:g}" for r in task_rows)]
        cv = curves(task_rows, tasks, comp + ["dense"])
        n = cv[comp[0]]["n"] if comp and comp[0] in cv else 0
        lines += ["", "## Moments ablations (Fig. 5e-g) on the samples that ran every one of them", "",
                  f"{n} samples in all. Normalised score = score / dense score per task, averaged over tasks.", "",
                  "| config | avg score | avg norm. | sparsity | " + " | ".join(tasks) + " |",
                  "|---|---|---|---|" + "---|" * len(tasks)]
        for c in ["dense"] + comp:
            if c in cv:
                v = cv[c]
                lines.append(f"| {c} | {fmt(v['score'], 100)} | {fmt(v['norm'], 1, 2)} | {fmt(v['sparsity'], 1, 3)} | "
                             + " | ".join(fmt(v["per_task"][t], 100) for t in tasks) + " |")
    (out / "analysis.md").write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------------------


SAME_RUN = ("length", "seed", "stop", "n_sink", "n_local", "model", "dtype")  # settings two folders must share to pair


def with_baseline(out: Path, rows: list[dict], other: Path, on_damage=None) -> list[dict]:
    """`rows` plus the records of the run folder `other` that `out` lacks (a configuration decoded in both: out's), on
    the samples `out` has decoded, so a sweep of new configurations, finished or not, or a peers run (lab.peers), is
    compared with an earlier one's on the same samples. The two runs must have decoded the same prompts the same way:
    the SAME_RUN settings both record must agree (a peers run has no window, so no n_sink or n_local). `on_damage`:
    as in lab.records.read_records."""
    for f in (out, other):
        if not (f / "run.json").is_file():
            raise ValueError(f"{f} has records but no run.json: --with cannot check that {out} and {other} decoded the "
                             "same samples (lab.sweep and lab.peers write run.json)")
    mine, theirs = (read_run(f)["settings"] for f in (out, other))
    clash = {k: (mine.get(k), theirs.get(k)) for k in SAME_RUN if k in mine and k in theirs
             and differs(k, mine[k], theirs[k])}
    missing = [k for k in ("length", "seed", "model") if k not in mine or k not in theirs]
    if clash or missing:
        raise ValueError(f"{out} and {other} are not runs of the same samples: {clash or missing}")
    have = {(r["task"], r["index"], r["config"]) for r in rows}
    samples = {(r["task"], r["index"]) for r in rows}
    return rows + [r for r in read_records(other, on_damage)
                   if (r["task"], r["index"]) in samples and (r["task"], r["index"], r["config"]) not in have]


def dropped_configs(folder: Path, rows) -> list[str]:
    """The configurations of folder/summary.csv, the tables there now, that `rows` have no record of: what an earlier
    report paired in with --with (or records since lost), which tables made from `rows` alone would drop."""
    path = folder / "summary.csv"
    if not path.is_file():
        return []
    try:
        with open(path, newline="") as f:
            before = {r.get("config") for r in csv.DictReader(f)} - {None}
    except (UnicodeDecodeError, csv.Error) as e:  # not a table of ours: what it held cannot be said, so not replaced
        raise ValueError(f"{path}: not readable as an earlier report's table ({e}); remove it to write the tables "
                         "anew, or give --out DIR") from None
    return sorted(before - {r["config"] for r in rows}, key=config_sort_key)


def report(out: str | Path, tasks: list[str] | None = None, baselines: list[str | Path] = (),
           skip_damaged: bool = False, to: str | Path | None = None) -> None:
    """The tables and plots of the run folder `out` (with the records of `baselines` paired in), written into `to`
    (default: `out`). `tasks` that leave out some of the run's are written only to another folder, with the records
    of those tasks alone: a run folder's own files cover the whole run. A damaged record line raises
    lab.records.DamagedRecord; with `skip_damaged` it is left out, and the count and places are printed and written
    at the top of summary.md and analysis.md. Both files name the command that rewrites them."""
    command = shlex.join(["python", "-m", "lab.report", str(out)] + [a for b in baselines for a in ("--with", str(b))]
                         + (["--tasks", ",".join(tasks)] if tasks else []) + (["--out", str(to)] if to else [])
                         + (["--skip-damaged"] if skip_damaged else []))
    out = Path(out)
    to = Path(to) if to is not None else out
    damaged = []
    on_damage = damaged.append if skip_damaged else None
    rows = read_records(out, on_damage)
    for other in baselines if rows else ():
        rows = with_baseline(out, rows, Path(other), on_damage)
    if damaged:
        print(f"warning: left out {len(damaged)} damaged record line(s) (--skip-damaged): {'; '.join(damaged[:3])}"
              + (" ... (all in summary.md)" if len(damaged) > 3 else ""), file=sys.stderr)
    if not rows:
        print(f"{out}: no results yet")
        return
    info = read_run(out) if (out / "run.json").is_file() else None
    run_tasks = info["settings"].get("tasks") if info else None
    whole = run_tasks or sorted({r["task"] for r in rows} - {CTXFREE})
    whole = [t for t in whole if any(r["task"] == t for r in rows)]
    if tasks is None:
        tasks = whole
    unknown = [t for t in tasks if not any(r["task"] == t for r in rows)]
    if unknown:
        raise ValueError(f"--tasks {','.join(unknown)}: no record of it in {out} (its tasks: "
                         f"{', '.join(sorted({r['task'] for r in rows}))})")
    left = [t for t in whole if t not in tasks]
    own = to.resolve() == out.resolve()  # the run's own tables, not another folder's
    if left and own:  # summary.md of some tasks beside the whole run's summary.csv
        raise ValueError(f"--tasks {','.join(tasks)} leaves out {','.join(left)}: {out}'s own tables cover the whole "
                         "run; give --out DIR, a folder other than the run's, for the tables of these tasks")
    if not own and is_run_folder(to):  # its tables are its own records'
        raise ValueError(f"--out {to} is another run's folder: its tables are of its own records; give a new folder")
    lost = dropped_configs(to, rows) if own else []
    if lost:  # committed tables made --with OTHER, rewritten without it
        named = ", ".join(lost[:3]) + (", ..." if len(lost) > 3 else "")
        raise ValueError(f"{to / 'summary.csv'} has {len(lost)} configuration(s) these records lack ({named}), paired "
                         "in by an earlier --with: give that --with again (summary.md names the command that wrote it), "
                         "or --out DIR for tables without them")
    partial = partial_note(info, rows)
    if partial:
        print(partial[0].replace("**", ""), file=sys.stderr)
    notes = [f"Written by `{command}`.", ""] + damage_note(damaged) + partial  # stated at the top of both files
    name = out.name
    if left:  # the subset's files hold its records alone, summary.csv too, and say whose they are
        rows = [r for r in rows if r["task"] in tasks or r["task"] == CTXFREE]
        name = f"{out.name}, tasks {', '.join(tasks)}"
        notes = [f"Records of {out} (`--tasks {','.join(tasks)}`): {', '.join(left)} left out.", ""] + notes
    to.mkdir(parents=True, exist_ok=True)
    cur = write_summary(to, rows, tasks, notes, name)
    points = measured_points(rows, tasks)  # the bootstrap behind both the table and Fig. 4
    # Appendix C: QAdA's tracked runs against the static oracle, the oracle's head frequencies on the task's prompts
    rr = recall_rows([r for r in rows if r["task"] in tasks and r["method"] in RECALL_METHODS],
                     static_oracle_freq(group(rows), tasks))
    write_analysis(to, rows, tasks, cur, points, rr, notes, name)
    plots(to, rows, tasks, cur, rr, points)
    print(f"tables and plots written to {to}")


def dense_table(root: str | Path, on_damage=None, tasks: list[str] | None = None, out: str | Path | None = None
                ) -> str:
    """Markdown: dense score per task in every lab.sweep run folder under `root` (a pilot's model x length grid),
    with the seconds per sample (prefill + decode), and the mean over tasks (`tasks` alone, when given). Writes
    dense.md too, into `out` (default: root). root/dense.md covers every task of its runs: the table of some of
    them needs an `out` of its own."""
    root = Path(root)
    runs, every = [], set()  # every: the tasks of any dense record, --tasks aside
    metas = sorted(root.glob("*/run.json"))
    if not metas:
        raise ValueError(f"{root}: no run folder in it (no */run.json); --dense-table takes a folder of run folders")
    for meta in metas:
        settings = read_run(meta.parent)["settings"]
        rows = [r for r in read_records(meta.parent, on_damage)
                if r.get("method") == "dense" and r.get("score") is not None]
        every.update(r["task"] for r in rows)
        rows = [r for r in rows if tasks is None or r["task"] in tasks]
        if rows:
            runs.append((settings.get("model") or "smollm2-135m", settings["length"], settings.get("dtype", "float32"),
                         rows, meta.parent.name))
    runs.sort(key=lambda run: (run[0], run[1]))
    runs, folders = [run[:4] for run in runs], [run[4] for run in runs]
    command = f"python -m lab.report --dense-table {shlex.quote(str(root))}" + (  # quoted: it is copied to rerun
        f" --tasks {','.join(tasks)}" if tasks else "")
    found = [t for t in TASK_ORDER if any(r["task"] == t for *_, rows in runs for r in rows)]
    missing = [t for t in tasks or () if t not in found]
    if missing:
        raise ValueError(f"--tasks {','.join(missing)}: no dense record of it in the run folders under {root}")
    left_out = [t for t in TASK_ORDER if t in every and t not in found]
    if left_out and (out is None or Path(out).resolve() == root.resolve()):  # not over the whole table
        raise ValueError(f"--tasks {','.join(tasks)} leaves out {','.join(left_out)}: {root / 'dense.md'} covers "
                         "every task; give --out DIR, another folder, for the table of these tasks")
    tasks = found
    names = [f"{m} {n // 1024}k" if n % 1024 == 0 else f"{m} {n}" for m, n, _, _ in runs]
    head = [f"{name} ({folder})" if names.count(name) > 1 else name for name, folder in zip(names, folders)]
    lines = ["# Dense score per task (x100, mean over n samples) and seconds per sample", "",
             f"`{command}`; dtype {', '.join(sorted({d for _, _, d, _ in runs}))}. "
             "s/sample = median of prefill + decode seconds, a batch's decoding whole for each of its samples (the "
             "wall-clock a sample waits).", "",
             "| task | " + " | ".join(head) + " |", "|---|" + "---|" * len(runs)]
    means = [[] for _ in runs]
    for t in tasks:
        cells = []
        for i, (*_, rows) in enumerate(runs):
            rs = [r for r in rows if r["task"] == t]
            if rs:
                m = float(np.mean([r["score"] for r in rs]))
                means[i].append(m)
                cells.append(f"{100 * m:.0f} ({len(rs)})")
            else:
                cells.append("–")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    lines.append("| **mean over tasks** | " + " | ".join(f"**{100 * np.mean(m):.0f}**" if m else "–" for m in means)
                 + " |")
    secs = [float(np.median([r["prefill_s"] + r["decode_s"] * r.get("batch", 1) for r in rows])) for *_, rows in runs]
    lines.append("| s/sample | " + " | ".join(f"{s:.0f}" for s in secs) + " |")
    text = "\n".join(lines) + "\n"
    to = Path(out) if out is not None else root
    to.mkdir(parents=True, exist_ok=True)
    (to / "dense.md").write_text(text)
    return text


def compare_runs(a: str | Path, b: str | Path, on_damage=None, tasks: list[str] | None = None) -> str:
    """Markdown: the records two run folders share (same task, sample and configuration, e.g. one run in fp32 and
    one in bf16; of `tasks` alone, when given): how often the answers are identical and the scores equal, each
    folder's mean score and sparsity on them, and how far sparsity and each head's local frequency move."""
    ra, rb = ({(r["task"], r["index"], r["config"]): r for r in read_records(folder, on_damage)
               if tasks is None or r["task"] in tasks} for folder in (a, b))
    missing = [t for t in tasks or () if not any(k[0] == t for k in ra.keys() & rb.keys())]
    if missing:
        raise ValueError(f"--tasks {','.join(missing)}: {a} and {b} share no record of it")
    for k in sorted(ra.keys() & rb.keys()):  # a pair is one prompt decoded twice, or the table compares nothing
        x, y = ra[k], rb[k]
        hashes = (x.get("ids_sha1"), y.get("ids_sha1"))  # where both records keep one
        if x.get("n_prompt") != y.get("n_prompt") or None not in hashes and hashes[0] != hashes[1]:
            raise ValueError(f"{a} and {b} did not decode the same prompts: {k[0]}#{k[1]} has {x.get('n_prompt')} "
                             f"prompt tokens in one, {y.get('n_prompt')} in the other (another length, seed or "
                             "tokenizer)" + (" and other ids" if x.get("n_prompt") == y.get("n_prompt") else ""))
    command = f"python -m lab.report {shlex.quote(str(a))} --compare {shlex.quote(str(b))}" + (  # a path with spaces
        f" --tasks {','.join(tasks)}" if tasks else "")
    na, nb = Path(a).name, Path(b).name
    lines = [f"# {na} vs {nb}", "", f"`{command}`", "",
             f"| config | records | identical answers | equal scores | mean score, {na} | mean score, {nb} "
             f"| mean sparsity, {na} | mean sparsity, {nb} | mean abs. sparsity diff | mean abs. head-frequency diff |",
             "|---|" + "---:|" * 9]
    for c in sorted({k[2] for k in ra.keys() & rb.keys()}, key=config_sort_key):
        keys = [k for k in ra.keys() & rb.keys() if k[2] == c]
        same = sum(ra[k]["pred"] == rb[k]["pred"] for k in keys)
        score = sum(ra[k]["score"] == rb[k]["score"] for k in keys)
        # score in a, in b, sparsity in a, in b: each over the records that have one (mean leaves None out)
        means = [mean([r[k][field] for k in keys]) for field in ("score", "sparsity") for r in (ra, rb)]
        sp = [abs(ra[k]["sparsity"] - rb[k]["sparsity"]) for k in keys
              if ra[k]["sparsity"] is not None and rb[k]["sparsity"] is not None]
        fq = [float(np.abs(np.array(ra[k]["local_freq"]) - np.array(rb[k]["local_freq"])).mean()) for k in keys
              if ra[k].get("local_freq") and rb[k].get("local_freq")]
        lines.append(f"| {c} | {len(keys)} | {same}/{len(keys)} | {score}/{len(keys)} | "
                     + " | ".join(fmt(m, 1, 3) for m in means) + f" | {fmt(mean(sp), 1, 4)} | {fmt(mean(fq), 1, 4)} |")
    return "\n".join(lines) + "\n"


def task_subset(text: str) -> list[str]:
    """--tasks: comma-separated names of the run's tasks (an argparse type); whether the records hold them is checked
    against the run. A task named twice is refused: its rows would show twice and count twice in every mean over
    tasks."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    twice = named_twice(names)
    if twice:
        raise argparse.ArgumentTypeError(f"names {twice} twice")
    return names


def main(argv=None) -> int:
    p = Parser(prog="python -m lab.report", description=__doc__.split("\n\n")[0])
    p.add_argument("run", metavar="RUN", help="run folder of lab.sweep (with --dense-table: a folder of run folders)")
    p.add_argument("--out", default=None, metavar="DIR", help="folder for the tables and figures, or "
                   "--dense-table's dense.md (default: RUN); needed for --tasks that leave out some of the run's, as "
                   "RUN's own cover the whole run")
    p.add_argument("--tasks", default=None, type=task_subset,
                   help="comma-separated subset of tasks (default: the run's; leaving some "
                   "out, written to --out DIR); with --compare or --dense-table, of those tables' tasks")
    p.add_argument("--dense-table", action="store_true", help="only the dense score per task of every run folder "
                   "under RUN (a pilot over models and lengths), written to RUN/dense.md (--out DIR: DIR/dense.md)")
    p.add_argument("--with", dest="baselines", action="append", default=[], metavar="OTHER", help="also the records "
                   "of the run folder OTHER (the same samples: an earlier sweep's baseline configurations, or the "
                   "peers of lab.peers), paired with RUN's; repeat for several")
    p.add_argument("--compare", default=None, metavar="OTHER", help="compare the records of RUN with those of the run "
                   "folder OTHER (e.g. fp32 against bf16)")
    p.add_argument("--skip-damaged", action="store_true", help="leave out record lines that are damaged (cut "
                   "mid-file, not a record, a compressed file cut short) and state how many, and where, on stderr and "
                   "in summary.md and analysis.md; without it a damaged line stops the report, naming its file and "
                   "line")
    a = p.parse(argv)
    if isinstance(a, int):  # --help, or a bad argument
        return a
    damaged = []
    on_damage = damaged.append if a.skip_damaged else None
    tasks = a.tasks or None  # '' is every task, as no --tasks
    try:
        for flag, given in (("--compare", a.compare), ("--dense-table", a.dense_table)):
            if given and a.baselines:  # --with pairs records for the tables of one run, which these do not write
                raise ValueError(f"--with is for one run's tables; {flag} reads no baseline")
        if a.compare and a.out:  # printed only; --dense-table writes dense.md, into --out where given
            raise ValueError("--out is for one run's tables; --compare writes none")
        if a.compare and a.dense_table:
            raise ValueError("--compare and --dense-table are two different tables: give one")
        if a.out and Path(a.out).exists() and not Path(a.out).is_dir():
            raise ValueError(f"--out {a.out} is a file; give a folder")
        for folder in [a.run] + ([a.compare] if a.compare else []) + a.baselines:
            if not Path(folder).is_dir():
                what = "a file, not a run folder" if Path(folder).exists() else "no such run folder"
                raise FileNotFoundError(f"{folder}: {what}")
            if not (a.dense_table and folder == a.run) and not is_run_folder(folder):
                raise ValueError(f"{folder} is not a run folder: no run.json and no samples*.jsonl[.xz] (lab.sweep "
                                 "--out writes them; for a folder of run folders: --dense-table)")
        if a.compare:
            print(compare_runs(a.run, a.compare, on_damage, tasks))
        elif a.dense_table:
            print(dense_table(a.run, on_damage, tasks, a.out))
        else:
            report(a.run, tasks, a.baselines, a.skip_damaged, a.out)
        if damaged:  # report() states its own
            print(f"warning: left out {len(damaged)} damaged record line(s) (--skip-damaged): {'; '.join(damaged)}",
                  file=sys.stderr)
    except DamagedRecord as e:
        return fail(f"{e}; --skip-damaged leaves damaged lines out and counts them")
    except (OSError, ValueError, KeyError) as e:  # bad input: one line
        return fail(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
