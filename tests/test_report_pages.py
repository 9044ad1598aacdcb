"""lab.report on the page paths, from hand-built records (no model): the combination (qada_pages) against
Quest alone at matched KV read with a paired interval, their rows and names in the lossless tables, figKV, what
the figures draw of the records, and an analysis without page paths left as it was."""

import json
from pathlib import Path

import numpy as np
import pytest

from lab import records, report

TASKS = ["a", "b"]
MARGIN = (0.1, 0.3, 0.2, 0.2)  # what the better of two page paths adds to the other's score, per sample: mean 0.2


def rec(task, index, config, score, kv_read, sparsity=0.0, kind=None):
    method, _, thr = config.partition("@")
    return {"task": task, "index": index, "config": config, "method": method, "path": method,
            "threshold": float(thr) if thr else None, "threshold_kind": kind, "score": score, "sparsity": sparsity,
            "kv_read": kv_read, "n_new": 3, "decode_s": 0.1, "pred": ""}


def dominated(better: str, worse: str) -> list[dict]:
    """Two page paths at the same three KV reads (0.05, 0.1, 0.2; budgets 128, 512, 2048), `worse` scoring 0.3, 0.5
    and 0.7 of dense on every sample, `better` the same plus MARGIN[i] on sample i of each task."""
    rows = []
    for task in TASKS:
        for i, m in enumerate(MARGIN):
            rows.append(rec(task, i, "dense", 1.0, 1.0))
            for budget, kv, score in ((128, 0.05, 0.3), (512, 0.1, 0.5), (2048, 0.2, 0.7)):
                rows.append(rec(task, i, f"{worse}@{budget}", score, kv, kind="budget"))
                rows.append(rec(task, i, f"{better}@{budget}", score + m, kv, 0.6, kind="budget"))
    return rows


def interval(cell: str) -> tuple[float, float, float]:
    """'+0.20 [+0.12, +0.28]' -> (0.2, 0.12, 0.28)."""
    point, rest = cell.split(" [")
    lo, hi = rest.rstrip("]").split(", ")
    return float(point), float(lo), float(hi)


def page_row(lines: list[str], method: str) -> dict[str, str]:
    """page_tables' matched table: the row of `method` as {column: cell}."""
    start = next(i for i, line in enumerate(lines) if line.startswith("| method | @"))
    end = next((i for i in range(start, len(lines)) if not lines[i]), len(lines))
    head, *table = lines[start:end]
    (row,) = [line for line in table if line.startswith(f"| {records.label(method)} | ")]
    cols = [c.strip() for c in head.strip("|").split("|")]
    return dict(zip(cols, (c.strip() for c in row.strip("|").split("|"))))


@pytest.mark.parametrize("better,worse,sign", [("qada_pages", "quest", 1), ("quest", "qada_pages", -1)])
def test_the_combination_minus_quest_at_matched_read_by_hand(better, worse, sign):
    """At every KV read both measured (0.05 and 0.2 at the ends, 0.1 on a point, 0.15 between two), the paired
    difference is the mean margin, +0.2 for qada_pages over quest; swapped, -0.2. Draws redraw the samples, so the
    interval spans what a draw's margins average to (0.1 to 0.3) and, the margin being positive on every sample,
    stays off 0; it is not a single point. Outside the measured reads (0.25 and up): blank."""
    rows = dominated(better, worse)
    (row,) = records.matched_table(rows, TASKS, "kv_read", (0.05, 0.1, 0.15, 0.2, 0.25), against="quest",
                                   methods=["qada_pages"], n_boot=300)
    for t in (0.05, 0.1, 0.15, 0.2):
        point, lo, hi = row[f"vs {t}"]
        assert point == pytest.approx(sign * 0.2)
        near, far = sorted((sign * lo, sign * hi))  # on the better one's side: 0 is outside
        assert 0.1 - 1e-9 <= near < 0.2 < far <= 0.3 + 1e-9
    assert row[0.25] is None and row["vs 0.25"] is None
    # the report's table: the same difference under "minus Quest", quest's own row without one
    lines = report.page_tables(rows, TASKS, n_boot=300)
    cells = page_row(lines, "qada_pages")
    assert cells["Quest alone"] == "quest"
    for t in ("0.2", "0.1", "0.05"):
        point, lo, hi = interval(cells[f"minus Quest @{t}"])
        assert point == pytest.approx(sign * 0.2) and (lo > 0 if sign > 0 else hi < 0)
    assert cells["minus Quest @0.6"] == cells["minus Quest @0.25"] == ""  # outside the measured reads
    quest = page_row(lines, "quest")
    assert quest["@0.1"].startswith("0.50 [0.50, 0.50]" if worse == "quest" else "0.70 [")
    assert all(quest[f"minus Quest @{t}"] == "" for t in ("0.6", "0.5", "0.4", "0.25", "0.2", "0.1", "0.05"))


def test_quest_alone_at_the_same_page_size():
    assert [report.quest_for(m, {"quest", "quest_p32"}) for m in ("qada_pages", "qada_pages_p32", "qada_pages_p64",
                                                                 "page_oracle_p32", "qada_pages_sum", "qada_kv_cal")] \
        == ["quest", "quest_p32", "quest", "quest_p32", "quest", "quest"]
    assert report.quest_for("qada_pages", {"qada_pages"}) is None


def pages_run() -> list[dict]:
    """Dense, calibrated QAdA per KV group (one point), Quest (lossless down to a read of 0.4), QAdA + pages
    (down to 0.11) and the page oracle (everywhere: down to 0.05), four samples of two tasks, every sample alike."""
    grid = {"quest": [(128, 0.1, 0.5), (512, 0.2, 0.9), (2048, 0.4, 1.0)],
            "qada_pages": [(128, 0.05, 0.8), (512, 0.11, 1.0), (2048, 0.2, 1.0)],
            "page_oracle": [(128, 0.05, 1.0), (512, 0.1, 1.0), (2048, 0.2, 1.0)]}
    rows = []
    for task in TASKS:
        for i in range(4):
            rows += [rec(task, i, "dense", 1.0, 1.0), rec(task, i, "qada_kv_cal@0.6", 1.0, 0.35, 0.65, "tau")]
            rows += [rec(task, i, f"{m}@{b}", score, kv, 0.65 if m == "qada_pages" else 0.0, "budget")
                     for m, points in grid.items() for b, kv, score in points]
    return rows


def write_run(folder, rows):
    folder.mkdir(parents=True)
    settings = dict(tasks=TASKS, length=400, seed=42, stop="eos", n_sink=4, n_local=64, model="m", dtype="float32")
    (folder / "run.json").write_text(json.dumps({"settings": settings}))
    records.write_records(folder / "samples.jsonl.xz", rows)


def section(text: str, title: str) -> list[str]:
    """The lines of analysis.md under the heading that starts with `title`, up to the next one."""
    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(f"## {title}"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def test_the_page_paths_get_rows_and_names_in_the_lossless_tables(tmp_path, monkeypatch):
    """By hand: Quest is lossless down to a KV read of 0.4, QAdA + pages to 0.11, the page oracle to 0.05 (every
    sample alike: the intervals are points); they are in the KV-read tables under their names (the page oracle as
    analysis only), not in the head-sparsity one; the page section compares them in pairs; figKV draws their curves
    on its KV-read panel, Fig. 4 does not."""
    from matplotlib.figure import Figure
    drawn, savefig = {}, Figure.savefig

    def keep_curves(fig, path, **kwargs):  # each figure's curves, per panel, by their labels
        drawn[Path(path).name] = [ax.get_legend_handles_labels()[1] for ax in fig.axes]
        return savefig(fig, path, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep_curves)
    out = tmp_path / "run"
    write_run(out, pages_run())
    report.report(out)
    text = (out / "analysis.md").read_text()
    quest, qada_pages, oracle = (records.label(m) for m in ("quest", "qada_pages", "page_oracle"))
    assert "analysis only" in oracle and quest != "quest" and qada_pages != "qada_pages"
    kv = section(text, "Lossless KV-read fraction")
    assert f"| {quest} | 0.40 | [0.40, 0.40] | 0.00 | 3 | 0.10 | 8 |" in kv
    assert f"| {qada_pages} | 0.11 | [0.11, 0.11] | 0.65 | 3 | 0.05 | 8 |" in kv
    assert f"| {oracle} | 0.05 | [0.05, 0.05] | 0.00 | 3 | 0.05 | 8 |" in kv
    heads = section(text, "Lossless sparsity")
    assert not [line for line in heads if any(f"| {m} |" in line for m in (quest, qada_pages, oracle))]
    assert "The page paths (Quest, QAdA + pages, the page oracle) are curves over their page budget at a fixed head " \
        "sparsity: they are in the KV-read tables only." in heads  # the note that says why they are not here
    assert f"| {records.label('qada_kv_cal')} | 0.65 |" in "\n".join(heads)
    worst = section(text, "The same with the worst-task rule")
    assert f"| {qada_pages} |  |  | 0.11 | [0.11, 0.11] | 8 |" in worst  # a page path: KV read only
    pages = section(text, "Page selection")
    assert f"| {qada_pages} | 0.11 | {quest} | 0.40 | -0.29 | [-0.29, -0.29] | 8 |" in pages
    assert f"| {quest} | 0.40 | {oracle} | 0.05 | +0.35 | [+0.35, +0.35] | 8 |" in pages
    assert f"| {qada_pages} | 0.11 | {records.label('qada_kv_cal')} | 0.35 | -0.24 | [-0.24, -0.24] | 8 |" in pages
    # nearest in KV read: qada_pages@2048 and quest@512 both read 0.2; 1.0 against 0.9 of dense
    assert "| qada_pages@2048 (0.65 / 0.20) | quest@512 (0.00 / 0.20) | 1.00 | 0.90 | +0.10 | [+0.10, +0.10] | 8 |" \
        in pages
    # matched: at 0.2 qada_pages keeps 1.0, quest 0.9; at 0.1 Quest's lowest point, 0.5, and qada_pages
    # interpolated between 0.05 and 0.11: 0.8 + 0.2 * 5/6
    cells = page_row(pages, "qada_pages")
    assert (cells["@0.2"], cells["minus Quest @0.2"]) == ("1.00 [1.00, 1.00]", "+0.10 [+0.10, +0.10]")
    assert interval(cells["minus Quest @0.1"])[0] == pytest.approx(0.8 + 0.2 * 5 / 6 - 0.5, abs=0.005)
    # the group decision alone (the combination's ceiling) has its row too, held against Quest at pages of 16
    assert page_row(pages, "qada_kv_cal")["Quest alone"] == "quest"
    assert (out / "figKV_score_vs_kv_read.png").is_file() and (out / "fig4_score_vs_sparsity.png").is_file()
    heads, reads = drawn["figKV_score_vs_kv_read.png"]
    assert heads == [records.label("qada_kv_cal")]  # a page budget moves the read, not the head sparsity
    assert reads == [records.label(m) for m in ("qada_kv_cal", "quest", "qada_pages", "page_oracle")]
    assert not {quest, qada_pages, oracle} & {c for panel in drawn["fig4_score_vs_sparsity.png"] for c in panel}
    assert records.label("qada_kv_cal") not in {c for panel in drawn["fig4_score_vs_sparsity.png"] for c in panel}


def test_the_figures_draw_the_records_values(tmp_path, monkeypatch):
    """What the figures draw, against the records by hand: Fig. 4's and figKV's error bars end at the interval's
    ends (every sample alike: points, so no bar), a page path's curve holds its own points, an ablation is drawn
    in neither (nor in Fig. 6b); Fig. 7 shades each head by the percent of steps it was long-context, 100 minus
    its local percent; Fig. 6a draws a decode step only where at least two answers reached it."""
    from matplotlib.axes import Axes
    drawn = {"errorbar": [], "imshow": [], "plot": []}
    for name in drawn:
        def keep(ax, *args, _name=name, _draw=getattr(Axes, name), **kwargs):
            drawn[_name].append((args, kwargs))
            return _draw(ax, *args, **kwargs)
        monkeypatch.setattr(Axes, name, keep)
    rows = []
    for task in TASKS:
        for i in range(4):  # head (0, 0) labelled local at every step, (0, 1) at none, ...; answers of 3, 1, 1, 1 steps
            rows += [rec(task, i, "dense", 1.0, 1.0), rec(task, i, "oracle@0.6", 1.0, 0.5, 0.5, "tau") | {
                "local_freq": [[1.0, 0.0], [0.25, 0.75]], "steps": 3 if i == 0 else 1,
                "step_sparsity": [0.5, 0.5, 0.5] if i == 0 else [0.1]}]
            rows += [rec(task, i, "quest@128", 1.0, 0.1, kind="budget"), rec(task, i, "quest_p32@128", 1.0, 0.3,
                                                                               kind="budget"),
                     rec(task, i, "qada_word@0.6", 1.0, 0.5, 0.5, "tau")]  # an ablation: Fig. 5e-g's alone
    out = tmp_path / "run"
    write_run(out, rows)
    report.report(out)
    bars = [np.asarray(kwargs["yerr"]) for _, kwargs in drawn["errorbar"] if kwargs["label"] == records.label("oracle")]
    assert len(bars) == 5 and not any(bar.any() for bar in bars)  # Fig. 4's and figKV's two panels, Fig. 6b's spread
    # figKV, drawn for the page paths alone: each page path's curve of its own points (quest's not quest_p32's)
    assert [list(args[0]) for args, kwargs in drawn["errorbar"] if kwargs["label"] == records.label("quest")] == [[0.1]]
    assert records.label("qada_word") not in {kwargs["label"] for _, kwargs in drawn["errorbar"]}
    (image,), _ = drawn["imshow"][0]
    assert image.tolist() == [[0.0, 100.0], [75.0, 25.0]]
    oracle = [args for args, kwargs in drawn["plot"] if kwargs.get("label") == records.label("oracle")]
    assert [(list(x), list(y)) for x, y, *_ in oracle] == [([1], [pytest.approx(0.2)])] * 2  # one panel per task


def test_without_page_paths_the_analysis_is_as_before(tmp_path):
    """Head-level methods only: no page section and no page note. With page paths added on the same samples, every
    line of that analysis is still there, in order: the page paths only add rows and sections."""
    rows = []
    for task in TASKS:
        for i in range(4):
            rows.append(rec(task, i, "dense", 1.0, 1.0))
            rows += [rec(task, i, f"static@{sp}", score, 1 - sp, sp, "sparsity")
                     for sp, score in ((0.5, 1.0), (0.8, 0.9 if i else 0.5))]
            rows += [rec(task, i, f"qada_kv_cal@{tau}", score, kv, sp, "tau")
                     for tau, sp, kv, score in ((0.4, 0.6, 0.45, 1.0), (0.8, 0.9, 0.15, 1.0 if i else 0.0))]
    write_run(tmp_path / "before" / "run", rows)
    report.report(tmp_path / "before" / "run")
    before = (tmp_path / "before" / "run" / "analysis.md").read_text()
    assert "Page selection" not in before and "page budget" not in before
    page_rows = [r for r in pages_run() if r["method"] in ("quest", "qada_pages")]
    write_run(tmp_path / "after" / "run", rows + page_rows)
    report.report(tmp_path / "after" / "run")
    after = (tmp_path / "after" / "run" / "analysis.md").read_text()
    assert "## Page selection" in after and "page budget" in after
    assert before.split("\n")[2] == f"Written by `python -m lab.report {tmp_path / 'before' / 'run'}`."
    rest = iter(after.split("\n")[3:])  # each names its own folder
    missing = [line for line in before.split("\n")[3:] if not any(line == other for other in rest)]
    assert missing == []


def test_a_method_with_no_lossless_point_says_so():
    """A method none of whose configurations keeps 0.95 of dense has no lossless point: the tables say "none
    measured" where they would state a read (the no-saving end, 1.00, was never measured; the interval stays), and
    the paired lossless comparison states no difference; a method with one keeps its number."""
    rows = dominated("qada_pages", "quest")  # quest: 0.3-0.7 of dense at every read, never lossless
    for task in TASKS:  # qada_pages lossless at its top budget: 0.7 + margin >= 0.95 is not enough; lift it
        for r in rows:
            if r["config"] == "qada_pages@2048":
                r["score"] = 1.0
    kv = {r["method"]: r for r in records.lossless_table(rows, TASKS, axis="kv_read", n_boot=50)}
    assert not kv["quest"]["found"] and kv["qada_pages"]["found"] and kv["qada_pages"]["lossless"] == pytest.approx(0.2)
    lines = report.write_lossless(Path("unused"), rows, TASKS)
    quest, ours = (f"| {records.label(m)} | " for m in ("quest", "qada_pages"))
    quest_rows, our_rows = ([line for line in lines if line.startswith(m)] for m in (quest, ours))
    assert len(quest_rows) == len(our_rows) == 2  # the KV-read table and the worst-task table
    assert all("| none measured | [1.00, 1.00] |" in line for line in quest_rows)  # no draw finds one either
    assert all("| 0.20 | [0.20, 0.20] |" in line for line in our_rows)
    (paired,) = [line for line in report.kv_read_differences(rows, TASKS, n_boot=50, pairs=[("qada_pages", "quest")])]
    assert "none measured" in paired and "| – | – |" in paired and "0.20" in paired
    # a point at the no-saving end (a budget reading everything: KV read 1.00) that loses is no lossless point either
    rows += [rec(task, i, "quest@99999", 0.8, 1.0, kind="budget") for task in TASKS for i in range(len(MARGIN))]
    kv = {r["method"]: r for r in records.lossless_table(rows, TASKS, axis="kv_read", n_boot=50)}
    assert not kv["quest"]["found"] and kv["quest"]["kv_read"] is None


def test_a_press_is_drawn_on_the_kv_read_panel_only(tmp_path, monkeypatch):
    """A kvpress press has no head sparsity (None in its points): figKV draws its points against the KV read and
    leaves it out of the sparsity panel, where a None would fail the sort of its points."""
    from matplotlib.axes import Axes

    from lab import plots
    drawn = []
    monkeypatch.setattr(Axes, "errorbar", lambda ax, xs, ys, **kwargs: drawn.append((kwargs["label"], list(xs))))
    point = dict(norm=0.9, lo=0.8, hi=1.0, n=4)
    points = {"snapkv@0.25": dict(point, sparsity=None, kv_read=0.25), "snapkv@0.5": dict(point, sparsity=None,
              kv_read=0.5), "oracle@0.6": dict(point, sparsity=0.6, kv_read=0.4)}
    plots.figure_scores(tmp_path, TASKS, ["oracle", "snapkv"], points, peers=("snapkv",))
    assert (tmp_path / "figKV_score_vs_kv_read.png").is_file()
    assert [xs for label, xs in drawn if label == records.label("snapkv")] == [[0.25, 0.5]]  # figKV's KV-read panel
    assert [xs for label, xs in drawn if label == records.label("oracle")] == [[0.6], [0.4], [0.6], [0.4]]
