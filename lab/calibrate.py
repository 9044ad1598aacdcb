"""Calibration on prompts the evaluation never sees: static head labels from oracle statistics (paper App. A), and
the correction of QAdA's Gaussian estimate that calibrated QAdA reads (ours: criterion.Calibration).

    python -m lab.calibrate --tasks niah_single_1,fwe --length 4096 --samples 4 --out results/static_labels
    python -m lab.calibrate --qada --tasks fwe,vt --length 8192 --samples 3 --dtype bfloat16 --out CAL_DIR

Per calibration prompt: a dense prefill, then greedy decoding under the adaptive oracle (Eq. 2, tau 0.6, as the
paper's appendix A does for RULER), counting per (layer, head) the fraction of decode steps labelled local.
Writes one file per task (`TASK.json`, the task's own prompts: the *static oracle* labels) and `ruler.json`,
the mean over the tasks (the *static* labels), each loadable with criterion.load_labels(path, sparsity).
Calibration prompts use a task seed different from the evaluation's, so static labels never see the
evaluated prompts.

With --qada: per calibration prompt, a dense prefill and dense greedy decoding, recording at every step, layer and
head the true log masses of the window and the bulk beside the two terms of QAdA's Gaussian estimate (Eq. 6,
mu_s and sigma_s^2 / 2, from the moments QAdA would use: --moments) and qada_sampled's estimate from 64 sampled bulk
keys (for the calibration curves' comparison). `masses.pt` keeps them per prompt (a rerun
computes only the prompts it lacks), and every kind of criterion.CALIBRATION_KINDS is fitted from them into
`KIND.json`, each loadable with criterion.load_calibration. The fits are per (layer, head), on every decode step
of every prompt.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from attention import N_SAMPLES, all_scores, build_attention, bulk_sample, dense
from criterion import (CALIBRATION_KINDS, TAU, Calibration, gaussian_exponent, load_local_freq, oracle_log_masses,
                       sampled_log_bulk, save_calibration, save_labels)
from generate import decode, pick_device
from lab.tasks import TASKS, make_sample
from moments import SOURCES, ReferenceKeys, make_moments, reference_words
from weights.checkpoints import DEFAULT, DTYPES, load
from weights.downloads import cache_dir


@torch.inference_mode()
def oracle_frequency(model, tok, task: str, length: int, samples: int, seed: int, max_new_tokens: int,
                     n_sink: int = 16, n_local: int = 128, tau: float = TAU) -> tuple[torch.Tensor, int]:
    """(L, H) fraction of decode steps each head is local under the oracle, over `samples` prompts; and the steps."""
    counts, steps = 0, 0
    for i in range(samples):
        sample = make_sample(task, i, length, tok, seed)
        ids = tok.encode(sample.prompt)
        cache = model.new_cache(len(ids) + max_new_tokens)
        logits = model.prefill(torch.tensor([ids], device=model.device), cache)
        att = build_attention("oracle", cache, tau=tau, n_sink=n_sink, n_local=n_local)
        decode(model, cache, logits, min(max_new_tokens, sample.max_new_tokens), att, tok.eos_ids)
        if att.stats.labels:
            labels = att.stats.label_tensor()  # (S, L, H)
            counts, steps = counts + labels.double().sum(0), steps + labels.shape[0]
    if steps == 0:
        raise ValueError(f"calibration on {task} decoded no step (every answer ended at once)")
    return (counts / steps).float(), steps


def ensure(model, tok, tasks: list[str], folder: Path, length: int, samples: int, seed: int, max_new_tokens: int,
           n_sink: int = 16, n_local: int = 128, progress: bool = True,
           ruler_tasks: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Oracle local frequencies per task and their mean over `ruler_tasks` (default: tasks) as "ruler", read from
    `folder` or calibrated and saved."""
    ruler_tasks = list(ruler_tasks or tasks)
    tasks = list(dict.fromkeys(tasks + ruler_tasks))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for task in tasks:
        settings = dict(task=task, length=length, samples=samples, seed=seed, max_new_tokens=max_new_tokens,
                        tau=TAU, n_sink=n_sink, n_local=n_local, model=str(model.model_dir))
        path = folder / f"{task}.json"
        if path.is_file():
            freq, old = load_local_freq(path)
            if {k: old.get(k) for k in settings} == settings:
                out[task] = freq
                continue
        t0 = time.perf_counter()
        if progress:
            print(f"calibrating static labels on {task} ({samples} prompts, seed {seed})...", file=sys.stderr)
        freq, steps = oracle_frequency(model, tok, task, length, samples, seed, max_new_tokens, n_sink, n_local)
        save_labels(path, freq, dict(settings, steps=steps, seconds=round(time.perf_counter() - t0, 1)))
        out[task] = freq
    mean = torch.stack([out[t] for t in ruler_tasks]).mean(0)
    save_labels(folder / "ruler.json", mean, dict(tasks=ruler_tasks, length=length, samples=samples, seed=seed, tau=TAU,
                                                   n_sink=n_sink, n_local=n_local, model=str(model.model_dir)))
    out["ruler"] = mean
    return out


# ---------------------------------------------------------------------------------------------------------
# QAdA's correction (ours)


class MassRecorder:
    """The decode hook of a calibration prompt: dense attention, and at each step the true log masses of the window
    and the bulk beside the Gaussian estimate's two terms and the sampled estimate (qada_sampled's, `n_samples` keys),
    all (H,) per layer."""

    def __init__(self, moments, n_sink: int, n_local: int, n_samples: int = N_SAMPLES):
        self.moments, self.n_sink, self.n_local, self.n_samples = moments, n_sink, n_local, n_samples
        # per decode step: (L, 5, H) [log A_local, log A_bulk, mu_s, sigma_s^2 / 2, sampled log A_bulk]
        self.steps, self.n_bulk = [], []

    def __call__(self, q, k, v, layer: int) -> torch.Tensor:
        """q (1, H, 1, D), k/v (1, Hkv, T, D) -> (1, H, 1, D)."""
        _, H, _, D = q.shape
        q1, k1, v1 = q.view(H, D), k[0], v[0]
        T = k1.shape[1]
        if T > self.n_local:
            if layer == 0:
                self.steps.append([]), self.n_bulk.append(T - self.n_local)
            log_local, log_bulk = oracle_log_masses(all_scores(q1, k1), self.n_sink, self.n_local)
            A, b = self.moments.quadratic_form(layer, k1)
            mu = gaussian_exponent(q1, (torch.zeros_like(A), b))  # q mu_K / sqrt(d)
            half_var = gaussian_exponent(q1, (A, torch.zeros_like(b)))  # q Sigma_K q^T / 2d
            idx = bulk_sample(T, self.n_sink, self.n_local, self.n_samples, layer, k1.device)
            sampled = sampled_log_bulk(all_scores(q1, k1[:, idx]), T - self.n_local)
            self.steps[-1].append(torch.stack([log_local, log_bulk, mu, half_var, sampled]).cpu())
        return dense(q1, k1, v1)[0].view(1, H, 1, D)

    def masses(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, L, 5, H) and each step's T_bulk (S,)."""
        masses = torch.stack([torch.stack(s) for s in self.steps])
        return masses, torch.tensor(self.n_bulk, dtype=torch.float64, device="cpu")


@torch.inference_mode()
def prompt_masses(model, tok, reference, task: str, index: int, length: int, seed: int, max_new_tokens: int,
                  moments_source: str, n_sink: int, n_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MassRecorder's record of one calibration prompt, decoded densely up to max_new_tokens."""
    sample = make_sample(task, index, length, tok, seed)
    ids = tok.encode(sample.prompt)
    cache = model.new_cache(len(ids) + max_new_tokens)
    logits = model.prefill(torch.tensor([ids], device=model.device), cache)
    recorder = MassRecorder(make_moments(moments_source, cache, reference, n_sink, n_local), n_sink, n_local)
    decode(model, cache, logits, min(max_new_tokens, sample.max_new_tokens), recorder, tok.eos_ids)
    return recorder.masses()


def fit_calibration(masses: torch.Tensor, n_bulk: torch.Tensor, n_kv_heads: int, kind: str, eps: float = 0.05
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The correction of `kind` (criterion.Calibration) per (layer, head) from every step's masses (N, L, >= 4, H) and
    T_bulk (N,): a (L, H), b (L, H), s (L, Hkv) or None. r is the true log ratio log A_local - log A_bulk, r_est
    Eq. 7's estimate of it (kind "sampled": qada_sampled's, the masses' fifth row)."""
    m = masses.double()
    log_local, log_bulk, mu, half_var = m[:, :, :4].unbind(2)  # (N, L, H) each
    log_n = n_bulk.to(m.device).double().log()[:, None, None]
    if kind == "sampled":
        if m.shape[2] < 5:
            raise ValueError("these masses hold no sampled estimate (recorded before it existed): record them again")
        estimate = m[:, :, 4]
    else:
        estimate = log_n + mu + half_var  # estimated_log_bulk, from its two terms
    r, r_est = log_local - log_bulk, log_local - estimate
    N, L, H = r.shape
    ones, s = torch.ones(L, H, dtype=torch.float64, device=m.device), None
    if kind == "offset":
        a, b = (r - r_est).median(0).values, ones
    elif kind == "quantile":
        a, b = torch.quantile(r - r_est, eps, dim=0), ones
    elif kind in ("affine", "sampled"):
        x, y = r_est - r_est.mean(0), r - r.mean(0)
        b = ((x * y).sum(0) / (x * x).sum(0).clamp(min=1e-12)).clamp(min=0)  # a larger estimate never lowers r
        a = r.mean(0) - b * r_est.mean(0)
    elif kind == "scale":  # log A_bulk - log T_bulk - mu_s = s sigma_s^2 / 2, least squares per KV head
        G = H // n_kv_heads
        x, y = half_var.reshape(N, L, n_kv_heads, G), (log_bulk - log_n - mu).reshape(N, L, n_kv_heads, G)
        s = ((x * y).sum((0, 3)) / (x * x).sum((0, 3)).clamp(min=1e-12)).clamp(min=0)  # (L, Hkv)
        a, b = torch.zeros(L, H, dtype=torch.float64, device=m.device), ones
    else:
        raise ValueError(f"unknown calibration kind {kind!r}; choose from {', '.join(CALIBRATION_KINDS)}")
    return a.float(), b.float(), None if s is None else s.float()


def calibrate_qada(model, tok, tasks: list[str], folder: Path, length: int, samples: int, seed: int,
                   max_new_tokens: int, moments_source: str = "random-words", n_sink: int = 16, n_local: int = 128,
                   eps: float = 0.05, progress: bool = True) -> dict[str, Calibration]:
    """Record the masses of every calibration prompt `folder`/masses.pt lacks, then fit and write every kind."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    settings = dict(tasks=tasks, length=length, samples=samples, seed=seed, max_new_tokens=max_new_tokens,
                    moments_source=moments_source, n_sink=n_sink, n_local=n_local, model=str(model.model_dir),
                    dtype=str(model.dtype).removeprefix("torch."))
    path = folder / "masses.pt"
    data = torch.load(path, weights_only=True) if path.is_file() else {"settings": settings, "prompts": {}}
    keep = ("length", "seed", "max_new_tokens", "moments_source", "n_sink", "n_local", "model", "dtype")
    if {k: data["settings"].get(k) for k in keep} != {k: settings[k] for k in keep}:
        raise ValueError(f"{path} holds masses of other settings; use another --out")
    words = reference_words(moments_source)
    reference = ReferenceKeys(model, tok, words, root=cache_dir() / "moments", progress=progress) if words else None
    for task in tasks:
        for i in range(samples):
            kept = data["prompts"].get(f"{task}#{i}")
            if kept is not None and kept[0].shape[2] == 5:  # 4 rows: recorded before the sampled estimate, so again
                continue
            t0 = time.perf_counter()
            data["prompts"][f"{task}#{i}"] = prompt_masses(model, tok, reference, task, i, length, seed,
                                                           max_new_tokens, moments_source, n_sink, n_local)
            torch.save(data, path)  # after every prompt: a rerun resumes
            if progress:
                print(f"{task}#{i}: {len(data['prompts'][f'{task}#{i}'][1])} steps, {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr)
    chosen = [data["prompts"][f"{t}#{i}"] for t in tasks for i in range(samples)]
    masses, n_bulk = torch.cat([m for m, _ in chosen]), torch.cat([n for _, n in chosen])
    out = {}
    for kind in CALIBRATION_KINDS:
        a, b, s = fit_calibration(masses, n_bulk, model.cfg.num_key_value_heads, kind, eps)
        extra = {"eps": eps} if kind == "quantile" else {"n_samples": N_SAMPLES} if kind == "sampled" else {}
        out[kind] = Calibration(a, b, s, dict(settings, kind=kind, estimate="sampled" if kind == "sampled" else
                                              "gaussian", steps=int(masses.shape[0]), **extra))
        save_calibration(folder / f"{kind}.json", out[kind])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="folder for TASK.json and ruler.json (with --qada: masses.pt and "
                   "KIND.json)")
    p.add_argument("--tasks", required=True, help="comma-separated tasks")
    p.add_argument("--length", type=int, default=4096, help="prompt + answer token budget")
    p.add_argument("--samples", type=int, default=4, help="calibration prompts per task")
    p.add_argument("--seed", type=int, default=1, help="task seed (keep it different from the evaluation's 42)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="decode steps per prompt at most (oracle; dense "
                   "with --qada)")
    p.add_argument("--model", default=None, help="a named offline model (weights.checkpoints), a model folder or a hub id "
                   f"(default: {DEFAULT})")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and KV cache dtype")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--qada", action="store_true", help="fit QAdA's correction (criterion.Calibration) instead of "
                   "static labels: masses.pt and one KIND.json per kind")
    p.add_argument("--moments", dest="moments_source", default="random-words", choices=SOURCES,
                   help="with --qada: the moments whose Gaussian estimate is corrected")
    p.add_argument("--eps", type=float, default=0.05, help="with --qada: the quantile kind's fraction of calibration "
                   "steps allowed a true log ratio below the corrected one")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        if not 0 < a.eps < 1:
            raise ValueError(f"--eps must lie in (0, 1), got {a.eps}")
        if a.samples < 1:
            raise ValueError(f"--samples must be at least 1, got {a.samples}")
        unknown = [t for t in a.tasks.split(",") if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown task {unknown[0]!r}; choose from {', '.join(TASKS)}")
        net, tok = load(a.model, device=pick_device(a.device), dtype=DTYPES[a.dtype])
        if a.qada:
            fits = calibrate_qada(net, tok, a.tasks.split(","), Path(a.out), a.length, a.samples, a.seed,
                                  a.max_new_tokens, a.moments_source, eps=a.eps)
            for kind, c in fits.items():
                print(f"{kind:9s} a {float(c.a.mean()):+.2f} (mean), b {float(c.b.mean()):.2f} (mean)"
                      + ("" if c.s is None else f", s {float(c.s.mean()):.2f} (mean)"))
            return 0
        freqs = ensure(net, tok, a.tasks.split(","), Path(a.out), a.length, a.samples, a.seed, a.max_new_tokens)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, f in freqs.items():
        print(f"{name:16s} mean local frequency {float(f.mean()):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
