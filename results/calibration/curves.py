"""Calibration curves: QAdA's estimate of log A_bulk against the true one, per layer, before and after each kind of
correction, on prompts the calibration never saw; and what each criterion drops at matched head sparsity.

    python results/calibration/curves.py results/calibration/qwen0.5b-8k-niah results/calibration/qwen0.5b-8k-other
    python results/calibration/curves.py FIT_A FIT_B --out DIR     # curves.md and curves.png in DIR instead

Each folder is one made by `python -m lab.calibrate --qada` (masses.pt and KIND.json). The corrections of the first
are scored on the masses of the second and the other way round; writes curves.md and curves.png beside this file
(the committed pair of the two 8k folders, and no other), or in --out.
"Dropped mass" at head sparsity x: the threshold on each criterion's log ratio that labels a fraction x of the
(step, layer, head) triples local, then the mean true bulk share 1 - A_local / (A_local + A_bulk) of those labelled
local (what their window-only output leaves out), over all triples; a proxy, the decoding sweeps give the scores.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from criterion import CALIBRATION_KINDS, corrected_log_bulk, load_calibration  # noqa: E402

HERE = Path(__file__).resolve().parent


def load_masses(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.load(folder / "masses.pt", weights_only=True)
    return (torch.cat([m for m, _ in data["prompts"].values()]).double(),
            torch.cat([n for _, n in data["prompts"].values()]).double())


def estimates(masses, n_bulk, folder: Path) -> dict[str, torch.Tensor]:
    """Estimated log A_bulk (N, L, H) of plain QAdA and of each correction fitted in `folder`."""
    log_local, _, mu, half_var = masses[:, :, :4].unbind(2)
    log_n = n_bulk.log()[:, None, None]
    out = {"QAdA (Gaussian)": log_n + mu + half_var}
    for kind in CALIBRATION_KINDS:
        c = load_calibration(folder / f"{kind}.json")
        if c.estimate == "sampled":
            if masses.shape[2] > 4:  # recorded with qada_sampled's estimate (64 bulk keys)
                out["sampled, 64 keys"] = masses[:, :, 4]
                out["sampled + affine"] = corrected_log_bulk(log_local, masses[:, :, 4], c.layer(slice(None)))
            continue
        G = masses.shape[-1] // (c.s.shape[-1] if c.s is not None else 1)
        s = c.s.double().repeat_interleave(G, -1) if c.s is not None else 1.0
        out[f"{kind}"] = corrected_log_bulk(log_local, log_n + mu + s * half_var, c.layer(slice(None)))
    return out


def dropped(log_local, log_bulk_true, log_bulk_est, sparsity: float) -> float:
    r_est = (log_local - log_bulk_est).flatten()
    share_out = torch.sigmoid(log_bulk_true - log_local).flatten()  # the true bulk share
    k = max(1, round(sparsity * r_est.numel()))
    local = torch.zeros_like(r_est, dtype=torch.bool)
    local[r_est.argsort(descending=True)[:k]] = True  # the most local-looking triples
    return float((share_out * local).sum() / r_est.numel())


def main(fit_a: str, fit_b: str, out: Path = HERE) -> None:
    folders = [Path(fit_a), Path(fit_b)]
    command = f"python results/calibration/curves.py {fit_a} {fit_b}" + (f" --out {out}" if out != HERE else "")
    lines = ["# Calibration curves", "", f"`{command}`", "",
             "Error of the estimated log A_bulk (estimate - true, natural log) on prompts the correction never saw, "
             "mean over decode steps and heads; per layer in the second table. Positive: the bulk is overestimated "
             "(heads wrongly long-context), negative: underestimated (heads wrongly local).", ""]
    figures = []
    for fit, held in (folders, folders[::-1]):
        masses, n_bulk = load_masses(held)
        log_local, log_bulk = masses[:, :, 0], masses[:, :, 1]
        est = estimates(masses, n_bulk, fit)
        figures.append((fit.name, held.name, log_bulk, est))
        lines += [f"## Fitted on {fit.name}, scored on {held.name} ({masses.shape[0]} steps)", "",
                  "| estimate | mean error | mean abs error | layers 1+ abs error | dropped mass @0.8 | @0.85 | @0.9 |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        oracle = [dropped(log_local, log_bulk, log_bulk, x) for x in (0.8, 0.85, 0.9)]
        lines.append("| adaptive oracle (true masses) | 0 | 0 | 0 | " + " | ".join(f"{d:.3f}" for d in oracle) + " |")
        for name, e in est.items():
            err = e - log_bulk
            lines.append(f"| {name} | {float(err.mean()):+.2f} | {float(err.abs().mean()):.2f} | "
                         f"{float(err[:, 1:].abs().mean()):.2f} | "
                         + " | ".join(f"{dropped(log_local, log_bulk, e, x):.3f}" for x in (0.8, 0.85, 0.9)) + " |")
        L = log_bulk.shape[1]
        lines += ["", "| layer | " + " | ".join(est) + " |", "|---:|" + "---:|" * len(est)]
        for layer in range(L):
            lines.append(f"| {layer} | " + " | ".join(f"{float((e - log_bulk)[:, layer].mean()):+.2f}"
                                                       for e in est.values()) + " |")
        lines.append("")
    out.mkdir(parents=True, exist_ok=True)
    (out / "curves.md").write_text("\n".join(lines) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    layers = [0, 6, 12, 18, 23]
    fig, axes = plt.subplots(len(figures), len(layers), figsize=(3 * len(layers), 3 * len(figures)), squeeze=False)
    for row, (fit, held, log_bulk, est) in enumerate(figures):
        for col, layer in enumerate(layers):
            ax = axes[row][col]
            true = log_bulk[:, layer].flatten()
            for name, color in (("QAdA (Gaussian)", "0.6"), ("affine", "tab:blue"), ("sampled + affine", "tab:orange")):
                if name not in est:
                    continue
                ax.scatter(true, est[name][:, layer].flatten(), s=2, alpha=0.3, color=color,
                           label=name if col == 0 else None)
            lo, hi = float(true.min()), float(true.max())
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
            ax.set_title(f"layer {layer}" + (f"\nfit {fit}, scored on {held}" if col == 0 else ""), fontsize=8)
            ax.set_xlabel("true log A_bulk", fontsize=8)
            if col == 0:
                ax.set_ylabel("estimated log A_bulk", fontsize=8)
                ax.legend(fontsize=7, markerscale=4)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="calibration curves of two lab.calibrate --qada folders, each scored on "
                                "the other's masses")
    p.add_argument("fit_a")
    p.add_argument("fit_b")
    p.add_argument("--out", type=Path, default=None, help="folder for curves.md and curves.png (default: beside "
                   "this script, for the committed pair only)")
    args = p.parse_args()
    committed = [HERE / "qwen0.5b-8k-niah", HERE / "qwen0.5b-8k-other"]
    if args.out is None:  # the committed curves are rewritten only by the command that made them
        if [Path(f).resolve() for f in (args.fit_a, args.fit_b)] != [f.resolve() for f in committed]:
            p.error("beside this script are the committed curves of qwen0.5b-8k-niah and qwen0.5b-8k-other; give "
                    "--out DIR for other folders")
        args.out = HERE
    for folder in (args.fit_a, args.fit_b):
        if not (Path(folder) / "masses.pt").is_file():
            p.error(f"{folder} holds no masses.pt (made by python -m lab.calibrate --qada)")
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out} is a file; give a folder")
    try:  # a folder cut short holds masses.pt but not every KIND.json: load_calibration names the missing one
        main(args.fit_a, args.fit_b, args.out)
    except FileNotFoundError as e:
        p.error(str(e))
