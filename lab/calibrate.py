"""Static head labels from oracle statistics: how often each (layer, head) is local on calibration prompts (App. A).

    python -m lab.calibrate --tasks niah_single_1,fwe --length 4096 --samples 4 --out results/static_labels

Per calibration prompt: a dense prefill, then greedy decoding under the adaptive oracle (Eq. 2, tau 0.6, as the
paper's appendix A does for RULER), counting per (layer, head) the fraction of decode steps labelled local.
Writes one file per task (`TASK.json`, the task's own prompts: the *static oracle* labels) and `ruler.json`,
the mean over the tasks (the *static* labels), each loadable with criterion.load_labels(path, sparsity).
Calibration prompts use a task seed different from the evaluation's, so static labels never see the
evaluated prompts.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from attention import build_attention
from criterion import TAU, save_labels
from generate import decode
from lab.tasks import make_sample
from weights.checkpoints import DEFAULT, load


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


def load_freq(path: Path) -> tuple[torch.Tensor, dict]:
    data = json.loads(Path(path).read_text())
    return torch.tensor(data["local_freq"], dtype=torch.float32), data["settings"]


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
            freq, old = load_freq(path)
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="folder for TASK.json and ruler.json")
    p.add_argument("--tasks", required=True, help="comma-separated tasks")
    p.add_argument("--length", type=int, default=4096, help="prompt + answer token budget")
    p.add_argument("--samples", type=int, default=4, help="calibration prompts per task")
    p.add_argument("--seed", type=int, default=1, help="task seed (keep it different from the evaluation's 42)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="oracle decode steps per prompt at most")
    p.add_argument("--model", default=None, help="a named offline model (weights.checkpoints), a model folder or a hub id "
                   f"(default: {DEFAULT})")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="weights and KV cache dtype")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    net, tok = load(a.model, dtype=getattr(torch, a.dtype))
    freqs = ensure(net, tok, a.tasks.split(","), Path(a.out), a.length, a.samples, a.seed, a.max_new_tokens)
    for name, f in freqs.items():
        print(f"{name:16s} mean local frequency {float(f.mean()):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
