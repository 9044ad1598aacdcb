"""Calibration on prompts the evaluation never sees: static head labels from oracle statistics (paper App. A), and
the correction of QAdA's Gaussian estimate that calibrated QAdA reads (ours: criterion.Calibration).

    python -m lab.calibrate --tasks niah_single_1,fwe --length 4096 --samples 4 --out results/static_labels
    python -m lab.calibrate --qada --tasks fwe,vt --length 8192 --samples 3 --dtype bfloat16 --out CAL_DIR
    python -m lab.calibrate --qada --tasks fwe,vt --hf MODEL_OR_FOLDER --out CAL_DIR   # run by transformers

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

Files of the same settings in --out are reused; labels, masses or corrections of other settings (another model,
length, tasks ...) are refused, before the model loads where they can be told apart by then, unless --force.
"""

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from attention import N_SAMPLES, all_scores, build_attention, bulk_sample, dense
from criterion import (CALIBRATION_KINDS, TAU, Calibration, check_weights, gaussian_log_bulk, load_calibration,
                       load_local_freq, oracle_log_masses, sampled_log_bulk, save_calibration, save_labels,
                       weights_probe)
from generate import check_context, decode, pick_device
from lab.cli import Parser, at_least, fail, interrupted, named_twice, thread_count
from lab.tasks import TASKS, make_sample
from moments import SOURCES, ReferenceKeys, make_moments, reference_words
from model import read_config
from weights.checkpoints import DEFAULT, DTYPES, MODELS, load, model_dir, resolve, user_path
from weights.downloads import cache_dir
from weights.tokenizer import Tokenizer


@torch.inference_mode()
def oracle_frequency(model, tok, task: str, length: int, samples: int, seed: int, max_new_tokens: int,
                     n_sink: int = 16, n_local: int = 128, tau: float = TAU, progress: bool = False
                     ) -> tuple[torch.Tensor, int]:
    """(L, H) fraction of decode steps each head is local under the oracle, over `samples` prompts; and the steps.
    `progress`: a line per prompt on stderr, as --qada's."""
    counts, steps = 0, 0
    for i in range(samples):
        t0 = time.perf_counter()
        sample = make_sample(task, i, length, tok, seed)
        ids = tok.encode(sample.prompt)
        cache = model.new_cache(len(ids) + max_new_tokens)
        logits = model.prefill(torch.tensor([ids], device=model.device), cache)
        att = build_attention("oracle", cache, tau=tau, n_sink=n_sink, n_local=n_local)
        decode(model, cache, logits, min(max_new_tokens, sample.max_new_tokens), att, tok.eos_ids)
        if att.stats.labels:
            labels = att.stats.label_tensor()  # (S, L, H)
            counts, steps = counts + labels.double().sum(0), steps + labels.shape[0]
        if progress:
            print(f"{task}#{i}: {len(att.stats.labels)} steps, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if steps == 0:
        raise ValueError(f"calibration on {task} decoded no step (every answer ended at once)")
    return (counts / steps).float(), steps


def task_names(text: str) -> list[str]:
    """--tasks: comma-separated names of lab.tasks.TASKS (an argparse type)."""
    names = [t for t in text.split(",") if t]
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown task {unknown[0]!r}; choose from {', '.join(TASKS)}")
    twice = named_twice(names)
    if twice:  # its samples would count twice in every average, and in a calibration's fit
        raise argparse.ArgumentTypeError(f"names {twice} twice")
    return names


def some_tasks(text: str) -> list[str]:
    """lab.calibrate's --tasks: task_names, at least one (a calibration is fitted on some)."""
    names = task_names(text)
    if not names:
        raise argparse.ArgumentTypeError(f"names no task, got {text!r}; give comma-separated names, e.g. fwe,vt")
    return names


def open_fraction(text: str) -> float:
    """--eps: a number in (0, 1) (an argparse type)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must lie in (0, 1), got {text!r}")
    return value


def planned_model(name: str | None) -> str | None:
    """The folder `load(name)` will give model.model_dir, as the files' settings record it, where it is known before
    loading (a named model, a local folder); None for a hub id."""
    name = name or DEFAULT
    if name in MODELS:
        return str(model_dir(name))
    return str(user_path(name)) if user_path(name).is_dir() else None


def differences(old: dict, want: dict) -> str:
    """The first settings `old` holds otherwise than `want`, as "key: old there, new asked"; "" if none. The model is
    told by its folder's name: files record the folder as it was on the machine that made them, and the same model in
    another machine's cache (another home or QADA_CACHE) is the same model; its weights are told by weights_probe."""
    def model(path: str) -> tuple[bool, str]:  # through transformers (--hf) or ours, and the folder's name
        return path.startswith("transformers:"), Path(path.removeprefix("transformers:")).name

    def same(key, a, b):
        if key == "model" and isinstance(a, str) and isinstance(b, str):
            return model(a) == model(b)
        return a == b
    diff = [f"{k}: {old.get(k)!r} there, {v!r} asked" for k, v in want.items() if not same(k, old.get(k), v)]
    return "; ".join(diff[:2])


def check_labels(folder: Path, tasks: list[str], ruler_tasks: list[str], common: dict, force: bool = False,
                 hint: str = "--force replaces them, or give another --out") -> None:
    """That writing static labels into `folder` replaces none of other settings: each TASK.json and ruler.json there
    must hold the settings asked for (`common`: length, samples, seed, max_new_tokens, tau, n_sink, n_local and, once
    known, model). ValueError with one line otherwise, unless `force`."""
    ruler = {k: v for k, v in common.items() if k != "max_new_tokens"}
    for path, want in [(Path(folder) / f"{t}.json", dict(task=t, **common)) for t in tasks] + [
            (Path(folder) / "ruler.json", dict(tasks=ruler_tasks, **ruler))]:
        if force or not path.is_file():
            continue
        try:
            _, old = load_local_freq(path)
        except ValueError as e:
            raise ValueError(f"{e}; {hint}") from None
        if differences(old, want):
            raise ValueError(f"{path} holds static labels of other settings ({differences(old, want)}); {hint}")


def same_labels(path: Path, settings: dict) -> tuple[torch.Tensor, dict] | None:
    """The local frequencies of the labels file `path` and its settings if it holds `settings`; None if not,
    unreadable or absent."""
    try:
        freq, old = load_local_freq(path)
    except (OSError, ValueError):
        return None
    return None if differences(old, settings) else (freq, old)


def ensure(model, tok, tasks: list[str], folder: Path, length: int, samples: int, seed: int, max_new_tokens: int,
           n_sink: int = 16, n_local: int = 128, progress: bool = True,
           ruler_tasks: list[str] | None = None, force: bool = False,
           hint: str = "--force replaces them, or give another --out") -> dict[str, torch.Tensor]:
    """Oracle local frequencies per task and their mean over `ruler_tasks` (default: tasks) as "ruler", read from
    `folder` or calibrated and saved. Files of other settings are refused (check_labels) unless `force`."""
    ruler_tasks = list(ruler_tasks or tasks)
    tasks = list(dict.fromkeys(tasks + ruler_tasks))
    folder = Path(folder)
    common = dict(length=length, samples=samples, seed=seed, max_new_tokens=max_new_tokens, tau=TAU, n_sink=n_sink,
                  n_local=n_local, model=str(model.model_dir))
    check_labels(folder, tasks, ruler_tasks, common, force, hint)  # before a file is written
    folder.mkdir(parents=True, exist_ok=True)
    out, probe = {}, weights_probe(model)
    probed = set()  # the tasks whose file records the weights (one kept from before probes does not)
    for task in tasks:
        settings = dict(task=task, **common)
        path = folder / f"{task}.json"
        kept = same_labels(path, settings)
        if kept is not None:
            check_weights(kept[1], path, probe, "holds the oracle's statistics of")  # the same folder, new weights
            out[task] = kept[0]
            if "weights_probe" in kept[1]:
                probed.add(task)
            continue
        t0 = time.perf_counter()
        if progress:
            print(f"calibrating static labels on {task} ({samples} prompts, seed {seed})...", file=sys.stderr)
        freq, steps = oracle_frequency(model, tok, task, length, samples, seed, max_new_tokens, n_sink, n_local,
                                       progress=progress)
        save_labels(path, freq, dict(settings, steps=steps, seconds=round(time.perf_counter() - t0, 1),
                                     weights_probe=probe))
        out[task] = freq
        probed.add(task)
    mean = torch.stack([out[t] for t in ruler_tasks]).mean(0)
    # the probe where every task's file has one: a rerun over files from before probes rewrites ruler.json unchanged
    save_labels(folder / "ruler.json", mean, dict(tasks=ruler_tasks, length=length, samples=samples, seed=seed, tau=TAU,
                                                   n_sink=n_sink, n_local=n_local, model=str(model.model_dir),
                                                   **({"weights_probe": probe} if probed >= set(ruler_tasks) else {})))
    out["ruler"] = mean
    return out


def label_frequencies(given: str | Path, L: int, H: int, probe: list[float] | None = None) -> torch.Tensor:
    """The oracle local frequencies (L, H) of a static labels file (lab.calibrate's TASK.json or ruler.json),
    checked against the model's heads and, given its criterion.weights_probe, its weights; one-line errors."""
    freq, settings = load_local_freq(given)
    if tuple(freq.shape) != (L, H):
        raise ValueError(f"{given} holds labels of {tuple(freq.shape)} heads; the model has ({L}, {H})")
    if probe is not None:
        check_weights(settings, given, probe, "holds the oracle's statistics of")
    return freq


def calibration_file(given: str | Path, kind: str, flag: str = "--calibration", readers: str = "") -> Path:
    """The file of the correction `kind` (criterion.CALIBRATION_KINDS) that `given` names: a file of that kind itself,
    or KIND.json in a folder of lab.calibrate --qada. FileNotFoundError or ValueError with one line naming what the
    folder or file holds otherwise. `readers`: the methods that read it, for the message."""
    given, who = Path(given), f" ({readers} reads it)" if readers else ""
    if given.is_dir():
        path = given / f"{kind}.json"
        if path.is_file():
            return path
        have = sorted(p.stem for p in given.glob("*.json") if p.stem in CALIBRATION_KINDS)
        raise FileNotFoundError(f"{flag} {given}: the folder holds no {kind}.json{who}; "
                                + (f"it holds {', '.join(have)}" if have else
                                   "python -m lab.calibrate --qada --out DIR writes one per kind"))
    if given.is_file():
        have = load_calibration(given).settings.get("kind")  # a file that is no calibration: one line
        if have not in (None, kind):
            raise ValueError(f"{flag} {given} holds the {have} correction, not the {kind} one{who}; give the folder "
                             f"lab.calibrate --qada wrote, or its {kind}.json")
        return given
    raise FileNotFoundError(f"{flag} {given}: no such file or folder")


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
            mu = gaussian_log_bulk(q1, (torch.zeros_like(A), b), 1)  # q mu_K / sqrt(d) (T_bulk 1: log 1 = 0)
            half_var = gaussian_log_bulk(q1, (A, torch.zeros_like(b)), 1)  # q Sigma_K q^T / 2d
            idx = bulk_sample(T, self.n_sink, self.n_local, self.n_samples, layer, k1.device)
            sampled = sampled_log_bulk(all_scores(q1, k1[:, idx]), T - self.n_local)
            self.steps[-1].append(torch.stack([log_local, log_bulk, mu, half_var, sampled]).cpu())
        return dense(q1, k1, v1)[0].view(1, H, 1, D)

    def masses(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, L, 5, H) and each step's T_bulk (S,); S is 0 when no step went past the window ((0, 0, 5, 0) then)."""
        masses = torch.stack([torch.stack(s) for s in self.steps]) if self.steps else torch.zeros(0, 0, 5, 0)
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
        estimate = log_n + mu + half_var  # gaussian_log_bulk, from its two terms
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


MASSES_KEYS = ("length", "seed", "max_new_tokens", "moments_source", "n_sink", "n_local", "model", "dtype")
FIT_KEYS = ("tasks", "samples") + MASSES_KEYS  # what a KIND.json is fitted from, besides eps for the quantile kind


def read_masses(path: Path, settings: dict, force: bool = False) -> dict | None:
    """The record in masses.pt ({"settings", "prompts"}) when it holds masses of `settings` (MASSES_KEYS: those given);
    None when there is none, or when `force` lets an unreadable one or one of other settings be replaced. ValueError
    with one line otherwise."""
    if not path.is_file():
        return None
    try:
        data = torch.load(path, weights_only=True)
        cause = None if isinstance(data, dict) and isinstance(data.get("settings"), dict) and isinstance(
            data.get("prompts"), dict) else "not a dict of settings and prompts"
    except Exception as e:  # a cut or corrupt file fails in zipfile, pickle or torch, each its own way
        cause = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0].split('. ')[0]}"
    if cause:
        if force:
            return None
        raise ValueError(f"{path}: unreadable masses ({cause}); --force records them again, or give another --out")
    diff = differences(data["settings"], {k: settings[k] for k in MASSES_KEYS if k in settings})
    if diff and not force:
        raise ValueError(f"{path} holds masses of other settings ({diff}); --force replaces them, or give another "
                         "--out")
    return None if diff else data


def check_fits(folder: Path, settings: dict, eps: float, force: bool = False) -> None:
    """That writing the corrections (KIND.json) into `folder` replaces none fitted with other settings (FIT_KEYS:
    those given; eps for the quantile kind): ValueError with one line otherwise, unless `force`."""
    for kind in CALIBRATION_KINDS:
        path = Path(folder) / f"{kind}.json"
        if force or not path.is_file():
            continue
        try:
            old = load_calibration(path).settings
        except ValueError as e:
            raise ValueError(f"{e}; --force replaces it, or give another --out") from None
        want = {k: settings[k] for k in FIT_KEYS if k in settings} | ({"eps": eps} if kind == "quantile" else {})
        if differences(old, want):
            raise ValueError(f"{path} holds a correction fitted with other settings ({differences(old, want)}); "
                             "--force refits it, or give another --out")


def calibrate_qada(model, tok, tasks: list[str], folder: Path, length: int, samples: int, seed: int,
                   max_new_tokens: int, moments_source: str = "random-words", n_sink: int = 16, n_local: int = 128,
                   eps: float = 0.05, progress: bool = True, force: bool = False) -> dict[str, Calibration]:
    """Record the masses of every calibration prompt `folder`/masses.pt lacks, then fit and write every kind. Masses
    and corrections of other settings in `folder` are refused (read_masses, check_fits) unless `force`."""
    folder = Path(folder)
    settings = dict(tasks=tasks, length=length, samples=samples, seed=seed, max_new_tokens=max_new_tokens,
                    moments_source=moments_source, n_sink=n_sink, n_local=n_local, model=str(model.model_dir),
                    dtype=str(model.dtype).removeprefix("torch."))
    path = folder / "masses.pt"
    check_fits(folder, settings, eps, force)
    probe = weights_probe(model)  # the weights fitted on: another checkpoint of this shape is refused
    data = read_masses(path, settings, force) or {"settings": dict(settings, weights_probe=probe), "prompts": {}}
    check_weights(data["settings"], path, probe, "holds the masses of")  # the same folder, new weights
    folder.mkdir(parents=True, exist_ok=True)
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
    chosen = [(m, n) for m, n in chosen if len(n)]  # a prompt whose decoding never left the window adds no step
    if not chosen:
        raise ValueError(f"no decode step of the calibration prompts went past the window ({n_local} tokens): nothing "
                         "to fit; give a longer --length or more --max-new-tokens")
    masses, n_bulk = torch.cat([m for m, _ in chosen]), torch.cat([n for _, n in chosen])
    # the probe of masses recorded with one: a refit from masses recorded before probes rewrites its files unchanged
    out, fitted_on = {}, {"weights_probe": probe} if "weights_probe" in data["settings"] else {}
    for kind in CALIBRATION_KINDS:
        a, b, s = fit_calibration(masses, n_bulk, model.cfg.num_key_value_heads, kind, eps)
        extra = {"eps": eps} if kind == "quantile" else {"n_samples": N_SAMPLES} if kind == "sampled" else {}
        out[kind] = Calibration(a, b, s, dict(settings, kind=kind, estimate="sampled" if kind == "sampled" else
                                              "gaussian", steps=int(masses.shape[0]), **fitted_on, **extra))
        save_calibration(folder / f"{kind}.json", out[kind])
    return out


def main(argv=None) -> int:
    p = Parser(prog="python -m lab.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for TASK.json and ruler.json (with --qada: masses.pt and "
                   "KIND.json); what it holds from other settings is refused unless --force")
    p.add_argument("--tasks", required=True, type=some_tasks, help="comma-separated tasks")
    p.add_argument("--length", type=at_least(1), default=4096, help="prompt + answer token budget, at most the "
                   "model's trained context (further where its config has rope_scaling)")
    p.add_argument("--samples", type=at_least(1), default=4, help="calibration prompts per task")
    p.add_argument("--seed", type=int, default=1, help="task seed (keep it different from the evaluation's 42)")
    # the first new token comes from the prefill, so 1 would decode no step and fail only after every prompt
    p.add_argument("--max-new-tokens", type=at_least(2), default=32, help="new tokens per prompt at most, the first "
                   "from the prefill, each after it a decode step (oracle; dense with --qada)")
    p.add_argument("--model", default=None, help="a named offline model (weights.checkpoints), a model folder or a "
                   f"hub id (default: {DEFAULT})")
    p.add_argument("--hf", default=None, metavar="MODEL_OR_FOLDER", help="instead of --model: the model (named, a "
                   "folder or a hub id) run by transformers, its attention through integrations/transformers.py")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and KV cache dtype")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--qada", action="store_true", help="fit QAdA's correction (criterion.Calibration) instead of "
                   "static labels: masses.pt and one KIND.json per kind")
    p.add_argument("--moments", dest="moments_source", default=None, choices=SOURCES,
                   help="with --qada: the moments whose Gaussian estimate is corrected (default: random-words)")
    p.add_argument("--eps", type=open_fraction, default=None, help="with --qada: the quantile kind's fraction of "
                   "calibration steps allowed a true log ratio below the corrected one (default: 0.05)")
    p.add_argument("--force", action="store_true", help="replace the labels, masses or corrections of other settings "
                   "that --out holds (without it they are refused, and files of the same settings are reused)")
    a = p.parse(argv)
    if isinstance(a, int):  # --help, or a bad argument
        return a
    out = Path(a.out)
    try:
        unused = [flag for flag, value in (("--moments", a.moments_source), ("--eps", a.eps)) if value is not None]
        if unused and not a.qada:  # the oracle's labels read neither
            raise ValueError(f"{unused[0]} sets how --qada fits its correction; without --qada it is unused")
        a.moments_source, a.eps = a.moments_source or "random-words", 0.05 if a.eps is None else a.eps
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is a file; give a folder")
        if a.hf is not None and a.model is not None:
            raise ValueError("give --model or --hf, not both")
        device = pick_device(a.device)
        # What --out holds is checked before the model loads (the model's folder where it is known by then).
        planned = planned_model(a.hf or a.model)
        known = {} if planned is None else {"model": f"transformers:{planned}" if a.hf else planned}
        if a.qada:
            settings = dict(tasks=a.tasks, length=a.length, samples=a.samples, seed=a.seed,
                            max_new_tokens=a.max_new_tokens, moments_source=a.moments_source, n_sink=16, n_local=128,
                            dtype=a.dtype, **known)
            check_fits(out, settings, a.eps, a.force)
            read_masses(out / "masses.pt", settings, a.force)
        else:
            check_labels(out, a.tasks, a.tasks, dict(length=a.length, samples=a.samples, seed=a.seed,
                                                     max_new_tokens=a.max_new_tokens, tau=TAU, n_sink=16, n_local=128,
                                                     **known), a.force)
        folder = resolve(a.hf or a.model)
        check_context(a.length, read_config(folder), "--length")  # its config alone, before the weights load
        tok = Tokenizer.from_dir(folder)  # the tokenizer either way loads (ours, of the folder)
        for task in a.tasks:  # a length too short for a task: said now, not after the weights load and --out is made
            make_sample(task, 0, a.length, tok, a.seed)
        if a.threads:
            torch.set_num_threads(a.threads)
        if a.hf is not None:  # transformers is an extra: imported only when asked for
            try:
                from integrations.transformers import load as load_hf
            except ImportError as e:
                raise ValueError(f"--hf runs the model with transformers: {e}") from None
            net, tok = load_hf(a.hf, device=device, dtype=DTYPES[a.dtype])
        else:
            net, tok = load(a.model, device=device, dtype=DTYPES[a.dtype])
        if a.qada:
            fits = calibrate_qada(net, tok, a.tasks, out, a.length, a.samples, a.seed, a.max_new_tokens,
                                  a.moments_source, eps=a.eps, force=a.force)
            for kind, c in fits.items():
                print(f"{kind:9s} a {float(c.a.mean()):+.2f} (mean), b {float(c.b.mean()):.2f} (mean)"
                      + ("" if c.s is None else f", s {float(c.s.mean()):.2f} (mean)"))
            return 0
        freqs = ensure(net, tok, a.tasks, out, a.length, a.samples, a.seed, a.max_new_tokens, force=a.force)
    except (OSError, ValueError) as e:
        return fail(e)
    except KeyboardInterrupt:
        return interrupted()
    for name, f in freqs.items():
        print(f"{name:16s} mean local frequency {float(f.mean()):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
