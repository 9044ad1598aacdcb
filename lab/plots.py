"""The paper's figures from a lab.sweep run folder's records (Fig. 4 with intervals, figKV, 6a-c, 7, appendix C's
recall), drawn by lab.report: markers only where measured, error bars where there are intervals.
"""

from pathlib import Path

import numpy as np

from lab.records import (ABLATIONS, LOSSLESS, MAIN_TAU, PEER_PATHS, config_sort_key, curves, group, is_tau, label, mean,
                         page_methods)
from lab.tasks import CTXFREE

# Each configuration of records.ORDER in its colour and marker; any other method gets a colour picked by its name.
COLOR = {"dense": "black", "local": "gray", "random": "tab:brown", "static": "tab:green", "static_oracle": "tab:olive",
         "oracle": "tab:blue", "qada_rw": "tab:purple", "qada_prompt": "tab:pink", "qada_prompt_online": "tab:cyan",
         "qada_word": "tab:orange",
         "qada_long": "tab:red", "static_kv": "darkgreen", "static_oracle_kv": "darkorange", "oracle_kv": "navy",
         "qada_kv": "magenta", "qada_kv_all": "indigo", "snapkv": "crimson", "snapkv_ctx": "salmon",
         "expected_attention": "teal", "expected_attention_ctx": "turquoise", "knorm": "goldenrod",
         "streaming_llm": "dimgray", "hf_dense": "black", "qada_cal": "sienna", "qada_cal_transfer": "chocolate",
         "qada_kv_cal": "darkgoldenrod", "qada_kv_all_cal": "darkred", "qada_kv_cal_transfer": "olivedrab",
         "qada_kv_all_cal_transfer": "darkslategray", "quest": "royalblue", "quest_p32": "cornflowerblue",
         "quest_p64": "lightsteelblue", "quest_frac": "steelblue", "qada_pages": "red", "qada_pages_p32": "orangered",
         "qada_pages_p64": "lightsalmon", "qada_pages_sum": "darkviolet", "qada_pages_share": "deeppink",
         "qada_pages_frac": "firebrick", "page_oracle": "limegreen", "page_oracle_p32": "yellowgreen",
         "page_oracle_p64": "palegreen", "qada_cal_offset": "peru", "qada_cal_scale": "tan",
         "qada_cal_quantile": "rosybrown", "qada_sampled": "mediumseagreen", "qada_kv_sampled": "darkcyan",
         "qada_sampled_upper": "cadetblue", "qada_sampled_cal": "slateblue", "qada_sampled_cal_transfer": "mediumpurple",
         "qada_kv_sampled_cal": "orchid", "qada_kv_sampled_cal_transfer": "plum", "knorm_ctx": "khaki",
         "streaming_llm_ctx": "silver"}
MARKER = {"dense": "s", "local": "s", "random": "v", "static": "^", "static_oracle": "x", "oracle": "o", "qada_rw": "D",
          "qada_prompt": "P", "qada_prompt_online": "X", "static_kv": "<", "static_oracle_kv": "+", "oracle_kv": "h",
          "qada_kv": "*", "qada_kv_all": "d", "quest": "s", "quest_p32": "s", "quest_p64": "s", "quest_frac": "s",
          "qada_pages": "*", "qada_pages_p32": "*", "qada_pages_p64": "*", "qada_pages_sum": "X",
          "qada_pages_share": "P", "qada_pages_frac": "*", "page_oracle": "o", "page_oracle_p32": "o",
          "page_oracle_p64": "o"}


def color(method: str) -> str:
    """A known method's colour, or one of a spare palette picked by the name (stable from run to run), none of them a
    known method's."""
    spare = ("gold", "lightcoral", "sandybrown", "mediumvioletred", "darkkhaki", "lightseagreen", "hotpink",
             "saddlebrown")
    return COLOR.get(method) or spare[sum(map(ord, method)) % len(spare)]


def figure_scores(out: Path, tasks, methods, points, peers=(), pages=()):
    """Fig. 4 with intervals: normalised score (95 % paired-bootstrap interval) against head sparsity and against
    the fraction of KV entries read, a marker per measured configuration; and, when the KV-group or page paths ran,
    the same for them beside their per-query-head counterparts (figKV), with the page paths (Quest, QAdA + pages, the
    page oracle: a curve over their page budget, on the KV-read panel only) and the peers' presses (kvpress,
    dash-dotted; KV read only: a press has no head sparsity) where their records joined the report."""
    import matplotlib.pyplot as plt
    configs = {m: [c for c in points if c.split("@")[0] == m] for m in methods}  # points come in config order

    def panel(ax, ms, x):
        for m in ms:
            if x == "sparsity" and m in pages:  # a page budget moves the KV read, not the head sparsity
                continue
            pts = sorted((p[x], p["norm"], p["lo"], p["hi"]) for p in (points[c] for c in configs[m])
                         if p and p[x] is not None)
            if not pts:
                continue
            xs, ys, lo, hi = map(np.array, zip(*pts))
            ax.errorbar(xs, ys, yerr=[ys - lo, hi - ys], color=color(m), label=label(m), marker=MARKER.get(m, "o"),
                        ms=5, lw=0.8, capsize=2, alpha=0.85, ls="--" if m in kv else "-." if m in peers else "-")
        ax.axhline(LOSSLESS, color="gray", ls=":", lw=1)
        ax.set_xlabel({"sparsity": "head sparsity (fraction of query heads local)",
                       "kv_read": "fraction of KV entries read (implied for the oracles)"}[x])
        ax.set_ylabel("normalised score (score / dense), 95 % CI")
        ax.grid(alpha=0.3)

    n = max((p["n"] for p in points.values() if p), default=0)
    paper = [m for m in methods if "_kv" not in m and m not in peers and m not in pages]  # per query head
    kv = [m for m in methods if "_kv" in m and m not in peers and m not in pages]  # per KV group, calibrated included
    figs = [("fig4_score_vs_sparsity.png", paper, "Score vs sparsity and KV read")]
    if kv or peers or pages:  # the KV-group variants beside the per-query-head methods they refine, pages, presses
        per_head = [m for m in ("static_oracle", "oracle", "qada_rw", "qada_cal") if m in methods]
        figs.append(("figKV_score_vs_kv_read.png", per_head + kv + list(pages) + list(peers),
                     "KV-group criteria vs per-query-head ones" + (", page selection" if pages else "")
                     + (" and kvpress's presses" if peers else "")))
    for name, ms, title in figs:
        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        for ax, x in zip(axes, ("sparsity", "kv_read")):
            panel(ax, ms, x)
        axes[1].invert_xaxis()  # left to right: more saved in both panels
        if axes[0].get_legend_handles_labels()[0]:  # no finished pair with dense yet: nothing to label
            axes[0].legend(fontsize=7, loc="lower left")
        if any(m in peers or m in pages for m in ms) and axes[1].get_legend_handles_labels()[0]:  # only here
            axes[1].legend(fontsize=7, loc="lower left")
        fig.suptitle(f"{title} ({len(tasks)} tasks, up to {n} samples per point; dotted: {LOSSLESS} of dense)")
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)


def plots(out: Path, rows, tasks, cur, rr, points):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    g = group(rows)
    task_rows = [r for r in rows if r["task"] in tasks]
    methods = sorted({c.split("@")[0] for c in cur} - set(ABLATIONS), key=config_sort_key)

    peers = [m for m in methods if any(r["method"] == m and r.get("path") in PEER_PATHS for r in rows)]
    budgeted = page_methods(rows)
    pages = [m for m in methods if m in budgeted]
    figure_scores(out, tasks, methods, points, peers, pages)

    # Fig. 6b: sparsity vs tau with spread across tasks; Fig. 6c: per task + context-independent
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, m in enumerate(m for m in methods if is_tau(rows, m)):
        cs = sorted([c for c in cur if c.split("@")[0] == m], key=config_sort_key)
        if cs:
            x = [float(c.split("@")[1]) for c in cs]
            y, s = np.array([cur[c]["sparsity"] for c in cs]), np.array([cur[c]["sparsity_std"] for c in cs])
            axes[0].errorbar(x, y, yerr=s, color=color(m), label=label(m), marker="o", capsize=3)
            dy = 6 - 12 * i  # the score labels of each method on a line of their own
            for xi, yi, c in zip(x, y, cs):
                if cur[c]["norm"] is not None:
                    axes[0].annotate(f"{cur[c]['norm']:.2f}", (xi, yi), textcoords="offset points", xytext=(5, dy),
                                     fontsize=7, color=color(m))
    axes[0].set_title("sparsity vs tau (±std over tasks; numbers: normalised score)")
    cmap = plt.get_cmap("tab10")
    cs = sorted({r["config"] for r in rows if r["method"] == "qada_rw"}, key=config_sort_key)
    x = [float(c.split("@")[1]) for c in cs]
    for i, t in enumerate(tasks + [CTXFREE]):
        y = [mean([r["sparsity"] for r in g.get((t, c), [])]) for c in cs]
        if any(v is not None for v in y):
            axes[1].plot(x, [np.nan if v is None else v for v in y], marker="o",
                         color="green" if t == CTXFREE else cmap(i), lw=3 if t == CTXFREE else 1.2,
                         label="context-independent" if t == CTXFREE else t)
    axes[1].set_title("QAdA (random words) sparsity per task")
    for ax in axes:
        ax.set_xlabel("tau")
        ax.set_ylabel("sparsity")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "fig6bc_sparsity_vs_tau.png", dpi=120)
    plt.close(fig)

    # Fig. 7: per-(layer, head) long-context frequency
    panels = [(t_label, cfg, sel) for t_label, sel in (("RULER tasks", tasks), ("context-independent", [CTXFREE]))
              for cfg in (f"oracle@{MAIN_TAU:g}", f"qada_rw@{MAIN_TAU:g}")]
    panels = [p for p in panels if any(r["config"] == p[1] and r["task"] in p[2] and "local_freq" in r for r in rows)]
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels) + 1, 6.5), squeeze=False,
                                 gridspec_kw=dict(wspace=0.35))
        for ax, (t_label, cfg, sel) in zip(axes[0], panels):
            freq = np.mean([np.array(r["local_freq"]) for r in rows
                            if r["config"] == cfg and r["task"] in sel and "local_freq" in r], 0)
            im = ax.imshow(100 * (1 - freq), aspect="auto", cmap="viridis", vmin=0, vmax=100, origin="lower")
            ax.set_title(f"{label(cfg.split('@')[0])}\ntau {cfg.split('@')[1]}, {t_label}", fontsize=9)
            ax.set_xlabel("query head")
            ax.set_ylabel("layer")
            ax.set_xticks(range(freq.shape[1]))
        fig.colorbar(im, ax=axes[0].tolist(), label="% of decode steps labelled long-context")
        fig.savefig(out / "fig7_long_context_heads.png", dpi=120, bbox_inches="tight")
        plt.close(fig)

    # Fig. 6a: sparsity along the generated answer, per task
    cfgs = [f"oracle@{MAIN_TAU:g}", f"qada_rw@{MAIN_TAU:g}"]
    show = [t for t in tasks if any(g.get((t, c)) for c in cfgs)]
    if show:
        cols = min(3, len(show))
        rws = (len(show) + cols - 1) // cols
        fig, axes = plt.subplots(rws, cols, figsize=(4.5 * cols, 3.2 * rws), squeeze=False)
        for ax, t in zip(axes.ravel(), show):
            for c, field, ls, name in [(cfgs[0], "step_sparsity", "-", label("oracle")),
                                       (cfgs[1], "step_sparsity", "-", label("qada_rw")),
                                       (cfgs[1], "oracle_step_sparsity", ":", "oracle on QAdA's decoding")]:
                seqs = [r[field] for r in g.get((t, c), []) if r.get(field)]
                if not seqs:
                    continue
                color_ = color("oracle" if field == "oracle_step_sparsity" else c.split("@")[0])
                n = max(map(len, seqs))
                m = np.array([np.nanmean([s[i] for s in seqs if len(s) > i]) for i in range(n)])
                sd = np.array([np.nanstd([s[i] for s in seqs if len(s) > i]) for i in range(n)])
                cnt = np.array([sum(len(s) > i for s in seqs) for i in range(n)])
                keep = cnt >= max(2, len(seqs) // 4)
                xs = np.arange(1, n + 1)[keep]
                ax.plot(xs, m[keep], ls, color=color_, label=name)
                if ls == "-":
                    ax.fill_between(xs, (m - sd)[keep], (m + sd)[keep], color=color_, alpha=0.2)
            ax.set_title(t, fontsize=9)
            ax.set_xlabel("decode step")
            ax.set_ylabel("sparsity")
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
        for ax in axes.ravel()[len(show):]:
            ax.axis("off")
        if axes[0, 0].get_legend_handles_labels()[0]:  # records without per-step sparsity: no curve to label
            axes[0, 0].legend(fontsize=8)
        fig.suptitle(f"Sparsity along the answer, tau {MAIN_TAU:g} (mean ± std over samples)")
        fig.tight_layout()
        fig.savefig(out / "fig6a_sparsity_along_answer.png", dpi=120)
        plt.close(fig)

    # Fig. 5e-g: moments ablations
    comp_methods = ("qada_rw", "qada_prompt", "qada_prompt_online", "qada_word", "qada_long")
    abl = [c for c in {r["config"] for r in task_rows} if c.split("@")[0] in ("qada_word", "qada_long")]
    if abl:
        taus = sorted({float(c.split("@")[1]) for c in abl})
        comp = [f"{m}@{t:g}" for m in comp_methods for t in taus if any(r["config"] == f"{m}@{t:g}" for r in task_rows)]
        cv = curves(task_rows, tasks, comp + ["dense"])
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for m in comp_methods:
            # a score / dense exists only where dense scored: a run whose dense scored 0 on every task has none
            cs = [c for c in comp if c.startswith(m + "@") and c in cv and cv[c]["norm"] is not None]
            if cs:
                ax.plot([cv[c]["sparsity"] for c in cs], [cv[c]["norm"] for c in cs], marker="o", color=color(m),
                        label=label(m))
                for c in cs:
                    ax.annotate(c.split("@")[1], (cv[c]["sparsity"], cv[c]["norm"]), textcoords="offset points",
                                xytext=(3, 4), fontsize=7)
        ax.set_xlabel("sparsity")
        ax.set_ylabel("normalised score (score / dense)")
        ax.set_title(f"Moments ablations ({cv[comp[0]]['n'] if comp and comp[0] in cv else 0} samples in common; "
                     "labels: tau)", fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # no point drawn: nothing to label
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "fig5efg_moments_ablation.png", dpi=120)
        plt.close(fig)

    # App. C: recall of long-context heads vs sparsity
    if rr:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for i, t in enumerate(sorted({r["task"] for r in rr})):
            rs = sorted([r for r in rr if r["task"] == t and r["config"].startswith("qada_rw")],
                        key=lambda r: r["qada_sparsity"])
            if rs:
                ax.plot([r["qada_sparsity"] for r in rs], [r["recall_qada"] for r in rs], "-o", color=cmap(i),
                        label=f"{t} QAdA")
                ax.plot([r["qada_sparsity"] for r in rs], [r["recall_static_oracle"] for r in rs], "--x", color=cmap(i),
                        label=f"{t} static oracle")
        ax.set_xlabel("sparsity of QAdA (static oracle matched to it)")
        ax.set_ylabel("recall of oracle long-context (step, head) pairs")
        ax.set_title("Recall of long-context heads (oracle at the same tau)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(out / "figC_recall_long_context_heads.png", dpi=120)
        plt.close(fig)
