"""Run records of lab.sweep and the statistics drawn from them: reading the rank files, configuration names and
order, means over the samples every compared configuration finished, the lossless point with a paired bootstrap,
and the oracle-agreement counts of tracked runs. lab.report writes tables from these, lab.plots figures.
"""

import hashlib
import lzma
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from criterion import TAU, static_labels
from weights.checkpoints import model_key


# The order and names in which tables and figures list the configurations the paper compares; any other name (a new
# path of attention.PATHS, a new method of lab.sweep) is listed too, after these, under its own name.
ORDER = ("dense", "local", "random", "static", "static_oracle", "oracle", "qada_rw", "qada_prompt",
         "qada_prompt_online",
         "qada_word", "qada_long", "static_kv", "static_oracle_kv", "oracle_kv", "qada_kv", "qada_kv_all",
         "qada_cal", "qada_cal_transfer", "qada_cal_offset", "qada_cal_scale", "qada_cal_quantile", "qada_kv_cal",
         "qada_kv_all_cal", "qada_kv_cal_transfer", "qada_kv_all_cal_transfer", "qada_sampled", "qada_kv_sampled",
         "qada_sampled_upper", "qada_sampled_cal", "qada_sampled_cal_transfer", "qada_kv_sampled_cal",
         "qada_kv_sampled_cal_transfer", "quest", "quest_p32", "quest_p64", "quest_frac", "qada_pages",
         "qada_pages_p32", "qada_pages_p64", "qada_pages_sum", "qada_pages_share", "qada_pages_frac", "page_oracle",
         "page_oracle_p32", "page_oracle_p64",
         "hf_dense", "snapkv", "expected_attention", "knorm", "streaming_llm", "snapkv_ctx",
         "expected_attention_ctx", "knorm_ctx", "streaming_llm_ctx")
LABEL = {"dense": "dense", "local": "local (all heads)", "random": "random heads", "static": "static (RULER)",
         "static_oracle": "static oracle", "oracle": "adaptive oracle", "qada_rw": "QAdA (random words)",
         "qada_prompt": "QAdA (current prompt, fixed)", "qada_prompt_online": "QAdA (current prompt, online; ours)",
         "qada_word": "QAdA (one repeated word)",
         "qada_long": "QAdA (longer random-words prompt)", "static_kv": "static per KV head (RULER)",
         "static_oracle_kv": "static oracle per KV head", "oracle_kv": "adaptive oracle per KV group (mean share)",
         "qada_kv": "QAdA per KV group (mean share; ours)", "qada_kv_all": "QAdA per KV group (all local; ours)",
         "qada_cal": "QAdA calibrated (affine; ours)", "qada_cal_transfer": "QAdA calibrated on other tasks (affine)",
         "qada_cal_offset": "QAdA calibrated (offset)", "qada_cal_scale": "QAdA calibrated (variance scale)",
         "qada_cal_quantile": "QAdA calibrated (conservative quantile)",
         "qada_kv_cal": "QAdA calibrated per KV group (mean share)",
         "qada_kv_all_cal": "QAdA calibrated per KV group (all local)",
         "qada_kv_cal_transfer": "QAdA calibrated on other tasks per KV group (mean share)",
         "qada_kv_all_cal_transfer": "QAdA calibrated on other tasks per KV group (all local)",
         "qada_sampled": "QAdA, bulk mass from 64 sampled keys (ours)",
         "qada_kv_sampled": "QAdA per KV group, bulk mass from 64 sampled keys (ours)",
         "qada_sampled_upper": "QAdA, bulk mass from 64 sampled keys, upper end of its interval (ours)",
         "qada_sampled_cal": "QAdA, 64 sampled keys, calibrated (affine; ours)",
         "qada_sampled_cal_transfer": "QAdA, 64 sampled keys, calibrated on other tasks (affine)",
         "qada_kv_sampled_cal": "QAdA per KV group, 64 sampled keys, calibrated (mean share)",
         "qada_kv_sampled_cal_transfer": "QAdA per KV group, 64 sampled keys, calibrated on other tasks (mean share)",
         "quest": "Quest (pages of 16 by key bounds, every head)", "quest_p32": "Quest, pages of 32",
         "quest_p64": "Quest, pages of 64", "quest_frac": "Quest, budget a fraction of T",
         "qada_pages": "QAdA per KV group + pages of 16 (group bound max; ours)",
         "qada_pages_p32": "QAdA per KV group + pages of 32 (max; ours)",
         "qada_pages_p64": "QAdA per KV group + pages of 64 (max; ours)",
         "qada_pages_sum": "QAdA per KV group + pages of 16 (group bound sum; ours)",
         "qada_pages_share": "QAdA per KV group + pages of 16 (max of the heads' shares; ours)",
         "qada_pages_frac": "QAdA per KV group + pages, budget a fraction of T (max; ours)",
         "page_oracle": "page oracle, pages of 16 (true masses; analysis only)",
         "page_oracle_p32": "page oracle, pages of 32 (analysis only)",
         "page_oracle_p64": "page oracle, pages of 64 (analysis only)",
         "hf_dense": "dense through transformers (the peers' control)",
         "snapkv": "kvpress SnapKV (question in the press)",
         "expected_attention": "kvpress ExpectedAttention (question in the press)",
         "knorm": "kvpress Knorm (question in the press)", "streaming_llm": "kvpress StreamingLLM",
         "snapkv_ctx": "kvpress SnapKV (context only)",
         "expected_attention_ctx": "kvpress ExpectedAttention (context only)",
         "knorm_ctx": "kvpress Knorm (context only)", "streaming_llm_ctx": "kvpress StreamingLLM (context only)"}
PAGE_KINDS = ("budget", "budget_frac")  # the threshold kinds of the page paths (quest, qada_pages, page_oracle, ...)
PEER_PATHS = ("kvpress", "transformers")  # lab.peers' records: presses that drop entries at prefill, and its dense
ABLATIONS = ("qada_word", "qada_long")
MAIN_TAU = TAU  # the paper's tau: the head maps, agreement and log-error tables read the runs at it


def result_files(out: Path) -> list[Path]:
    """The run's record files: samples.jsonl.xz (a finished run, compressed), then samples.jsonl and the
    samples.K.jsonl of the shards or ranks of a sweep in progress (lab.sweep)."""
    out = Path(out)
    return sorted(out.glob("samples*.jsonl.xz")) + sorted(out.glob("samples*.jsonl"))


class DamagedRecord(ValueError):
    """A record file that is not what lab.sweep writes; the message names the file, the line and the cause."""


KEYS = {"task": str, "index": int, "config": str}  # what every record holds: lab.sweep's resume and merge key


def record(line: bytes) -> tuple[dict | None, str | None]:
    """One line of a record file: (the record, None), or (None, why it is not one)."""
    try:
        text = line.decode().removeprefix("\ufeff")  # a byte-order mark (an editor's) is no damage
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text (byte {e.start + 1})"
    try:
        r = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"not a JSON line, cut short or mangled ({e})"
    if not isinstance(r, dict):
        return None, f"a JSON {type(r).__name__} ({text.strip()[:20]}), not a record (an object of task, index, config)"
    missing = [k for k, t in KEYS.items() if not isinstance(r.get(k), t) or isinstance(r.get(k), bool)]
    return (None, f"a record without a valid {', '.join(missing)}") if missing else (r, None)


def file_records(path: Path, on_damage=None) -> tuple[list[dict], int]:
    """The records of one file of result_files and its size in bytes as read. A damaged line (cut mid-file, not JSON,
    not a record) or compressed data that end early or do not decompress raise DamagedRecord ("FILE:LINE: cause"), or
    with `on_damage` are handed to it as that text and left out. The last line of a plain file without its newline
    is a record being written (or torn by a kill): left out, not damage; the sweep decodes it again."""
    path = Path(path)
    data = path.read_bytes()
    size, broken = len(data), None
    if path.suffix == ".xz":  # written whole and renamed into place: any fault is damage
        d, parts, pos = lzma.LZMADecompressor(), [], 0
        try:
            while pos < len(data) and not d.eof:  # in chunks: what precedes a fault is kept
                parts.append(d.decompress(data[pos:pos + (1 << 20)]))
                pos += 1 << 20
            if not d.eof:
                broken = "an empty file" if not data else "the compressed data end early (the file was cut short)"
            elif d.unused_data or pos < len(data):
                broken = "bytes after the end of the compressed data"
        except lzma.LZMAError as e:
            broken = f"not readable as xz ({e})"
        data = b"".join(parts)
        lines = data.split(b"\n")
        tail = lines.pop()  # after the last newline: nothing in a whole file
    else:
        lines = data.split(b"\n")
        lines.pop()  # after the last newline: nothing, or a record still being written
        tail = b""
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        r, why = record(line)
        if r is not None:
            rows.append(r)
        elif on_damage is None:
            raise DamagedRecord(f"{path}:{n}: {why}")
        else:
            on_damage(f"{path}:{n}: {why}")
    if broken or tail:
        why = f"{path}:{len(lines) + 1}: {broken or 'a last line without its end'} ({len(lines)} whole lines before it)"
        if on_damage is None:
            raise DamagedRecord(why)
        on_damage(why)
    return rows, size


def read_records(out: Path, on_damage=None) -> list[dict]:
    """Every record of the run's files, in result_files' order, each (task, index, config) once, the first read: a
    merge stopped before it removed the plain files it merged leaves their records in samples.jsonl.xz too, as
    lab.sweep.merge keeps the first (file_records: a damaged line raises DamagedRecord, or goes to `on_damage` and is
    left out)."""
    rows = {}
    for path in result_files(out):
        for r in file_records(path, on_damage)[0]:
            rows.setdefault((r["task"], r["index"], r["config"]), r)
    return list(rows.values())


def differs(key: str, a, b) -> bool:
    """Whether two runs' values of the setting `key` differ: a model by the model it names (weights.checkpoints.
    model_key: `--model m` and `--model ./m` are one), anything else by its value. Stricter than lab.calibrate's
    differences, which tells a model by its folder's name alone: its files carry a weights probe, a sweep's run.json
    none, so two folders of one name elsewhere stay two models here."""
    if key == "model" and isinstance(a, str) and isinstance(b, str):
        return model_key(a) != model_key(b)
    return a != b


def read_run(out: Path) -> dict:
    """OUT/run.json, which lab.sweep writes: {"settings": {...}, "runs": [...]}; ValueError naming the file and the
    cause when it is not that."""
    path = Path(out) / "run.json"
    try:
        info = json.loads(path.read_bytes().decode().removeprefix("\ufeff"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: damaged, not JSON ({e}); restore it from the run's copy or history") from None
    if not isinstance(info, dict) or not isinstance(info.get("settings"), dict):
        raise ValueError(f"{path}: no \"settings\" object (damaged, or not written by lab.sweep); restore it")
    runs, tasks = info.get("runs", []), info["settings"].get("tasks", [])
    if not (isinstance(runs, list) and all(isinstance(r, dict) for r in runs)
            and isinstance(tasks, list) and all(isinstance(t, str) for t in tasks)):
        raise ValueError(f"{path}: \"runs\" is no list of objects or settings.tasks no list of task names (damaged); "
                         "restore it")
    return info


def write_run(out: Path, info: dict) -> None:
    """OUT/run.json (read_run's), whole or not at all: written to a temporary file and renamed, so that a shard
    reading it while another writes sees the old file or the new one."""
    path = Path(out) / "run.json"
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, path)


def is_run_folder(out: Path) -> bool:
    """Whether `out` holds a run of lab.sweep or lab.peers: run.json or record files."""
    return (Path(out) / "run.json").is_file() or bool(result_files(out))


def ids_hash(ids: list[int]) -> str:
    """A prompt's token ids as a short hash, kept in every record: two runners pair only on the same ids."""
    return hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()


def write_records(path: Path, records: list[dict]) -> Path:
    """Records as xz-compressed JSON lines (a fifth of gzip's size smaller on these records), written to a temporary
    file and renamed into place; the same records give the same bytes."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(lzma.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    os.replace(tmp, path)
    return path


def config_sort_key(cfg: str):
    method, _, thr = cfg.partition("@")
    return (ORDER.index(method) if method in ORDER else len(ORDER)), method, float(thr or 0)


def label(method: str) -> str:
    return LABEL.get(method, method)


def is_tau(rows, method: str) -> bool:
    """Whether `method`'s threshold is a tau (its records say so)."""
    return any(r.get("threshold_kind") == "tau" for r in rows if r["method"] == method)


def page_methods(rows) -> set[str]:
    """The methods whose threshold is a page budget (their records' threshold_kind): a curve over their budgets, on
    the KV-read axis only (Quest's head sparsity is 0 at every budget, qada_pages' that of its fixed tau)."""
    return {r["method"] for r in rows if r.get("threshold_kind") in PAGE_KINDS}


def mean(xs):
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


# ---------------------------------------------------------------------------------------------------------
# Means over the samples every compared configuration finished


def group(rows):
    """{(task, config): [rows]}."""
    g = defaultdict(list)
    for r in rows:
        g[r["task"], r["config"]].append(r)
    return g


def summary_rows(rows) -> list[dict]:
    out = []
    for (task, cfg), rs in sorted(group(rows).items(), key=lambda kv: (kv[0][0], config_sort_key(kv[0][1]))):
        out.append({"task": task, "config": cfg, "method": rs[0]["method"], "threshold": rs[0]["threshold"],
                    "n": len(rs),
                    "score": mean([r["score"] for r in rs]), "sparsity": mean([r["sparsity"] for r in rs]),
                    "kv_read": mean([r["kv_read"] for r in rs]), "new_tokens": mean([r["n_new"] for r in rs]),
                    "decode_s": mean([r["decode_s"] for r in rs])})
    return out


def common_indices(g, tasks, configs) -> dict[str, set]:
    """Per task, the sample indices that every config in `configs` has finished."""
    out = {}
    for t in tasks:
        sets = [{r["index"] for r in g.get((t, c), [])} for c in configs]
        out[t] = set.intersection(*sets) if sets else set()
    return out


def task_means(g, tasks, cfg, idx, field="score"):
    """Per task, the mean of `field` over the samples in idx[task]; None where missing."""
    out = {}
    for t in tasks:
        vals = [r[field] for r in g.get((t, cfg), []) if r["index"] in idx[t] and r[field] is not None]
        out[t] = float(np.mean(vals)) if vals else None
    return out


def curves(rows, tasks, configs):
    """Per config over the tasks' common samples: mean score, mean normalised score (score / dense), worst drop,
    mean sparsity, sparsity std across tasks, kv read."""
    g = group(rows)
    idx = common_indices(g, tasks, configs + ["dense"])
    dense = task_means(g, tasks, "dense", idx)
    out = {}
    for c in configs:
        sc, sp, kv = (task_means(g, tasks, c, idx), task_means(g, tasks, c, idx, "sparsity"),
                      task_means(g, tasks, c, idx, "kv_read"))
        ts = [t for t in tasks if sc[t] is not None]
        if not ts:
            continue
        norm = [sc[t] / dense[t] for t in ts if dense[t]]
        out[c] = {"score": np.mean([sc[t] for t in ts]), "norm": np.mean(norm) if norm else None,
                  "worst_drop": max((dense[t] - sc[t] for t in ts if dense[t] is not None), default=None),
                  "sparsity": mean([sp[t] for t in ts]),
                  "sparsity_std": (float(np.std(spt)) if (spt := [sp[t] for t in ts if sp[t] is not None])
                                   else None),
                  "kv_read": mean([kv[t] for t in ts]), "n": sum(len(idx[t]) for t in ts), "per_task": sc,
                  "per_task_sparsity": sp}
    return out


# ---------------------------------------------------------------------------------------------------------
# Lossless sparsity with a paired bootstrap over the samples


LOSSLESS = 0.95  # a configuration is lossless when its mean normalised score is at least this fraction of dense
ROUNDING = 1e-9  # a mean of ratios that is 0.95 exactly (19 of 20) can land an ulp below it in floating point


def is_lossless(norm: float | None) -> bool:
    """Whether a normalised score (score / dense) keeps LOSSLESS of dense, up to floating-point rounding."""
    return norm is not None and norm >= LOSSLESS - ROUNDING


def paired_scores(rows, tasks, configs):
    """{task: (indices, {config: scores})} over the samples that dense and every config have finished, so that a
    bootstrap draws the same samples for every method (paired)."""
    g = group(rows)
    idx = common_indices(g, tasks, list(configs) + ["dense"])
    out = {}
    for t in tasks:
        order = sorted(idx[t])
        if order:
            by = {c: {r["index"]: r["score"] for r in g[t, c]} for c in list(configs) + ["dense"]}
            out[t] = (order, {c: np.array([by[c][i] for i in order], dtype=float) for c in by})
    return out


def paired_values(rows, scores: dict, configs, field: str) -> dict[str, dict[str, np.ndarray]]:
    """{task: {config: `field` per sample}} in the sample order of `scores` (paired_scores); NaN where a record has
    none (an answer that ended at its first token has no sparsity)."""
    g = group(rows)
    out = {}
    for t, (order, _) in scores.items():
        by = {c: {r["index"]: r[field] for r in g[t, c]} for c in configs}
        out[t] = {c: np.array([np.nan if by[c][i] is None else by[c][i] for i in order], dtype=float) for c in configs}
    return out


def draw_picks(scores: dict, n_boot: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """n_boot draws of the samples within each task of `scores` (paired_scores), {task: (n_boot, n_t)}, what
    drawn_means and normalised_draws take: drawn from `rng` draw by draw and task by task, the order the tables'
    intervals have always been drawn in, so that a seed gives the same intervals."""
    picks = {t: np.empty((n_boot, len(i)), dtype=np.int64) for t, (i, _) in scores.items()}
    for j in range(n_boot):
        for t, (i, _) in scores.items():
            picks[t][j] = rng.integers(0, len(i), len(i))
    return picks


def mean_over_tasks(per_task: list[np.ndarray], worst: bool = False) -> np.ndarray:
    """Each draw's mean over tasks (with `worst` their minimum), (n_draws,) from a (n_draws,) array per task, of the
    tasks whose value is not NaN (NaN where none is): what np.mean of each draw's list of task values gives, bit for
    bit, as the tables' intervals were first computed one draw at a time."""
    m = np.stack(per_task, axis=1) if per_task else np.empty((0, 0))  # (n_draws, n_tasks), each row contiguous
    valid = ~np.isnan(m)
    out = np.full(m.shape[0], np.nan)
    whole = valid.all(1) & (m.shape[1] > 0)
    out[whole] = m[whole].min(1) if worst else m[whole].mean(1)
    for j in np.flatnonzero(~whole & valid.any(1)):  # a task sits out of this draw: the others, in their order
        row = m[j][valid[j]]
        out[j] = row.min() if worst else row.mean()
    return out


def drawn_means(values: dict[str, dict[str, np.ndarray]], picks: dict[str, np.ndarray], config: str) -> np.ndarray:
    """Per draw (picks: draw_picks), the mean over tasks of `config`'s mean value (paired_values) on the draw's
    samples of each task. A task whose picked samples all lack the value (each answer ended at its first token) sits
    out of that draw's mean, as paired_mean leaves it out of the point; NaN only when every task does."""
    per_task = []
    for t, v in values.items():
        x = v[config][picks[t]]  # (n_draws, n_t)
        missing = np.isnan(x)
        with np.errstate(invalid="ignore"):  # 0 / 0: every picked sample lacks the value, NaN
            per_task.append(np.where(missing, 0.0, x).sum(1) / (~missing).sum(1))
    return mean_over_tasks(per_task)


def drawn_mean(values: dict[str, dict[str, np.ndarray]], pick: dict, config: str) -> float:
    """drawn_means of one draw ({task: sample indices})."""
    return float(drawn_means(values, {t: np.asarray(p)[None] for t, p in pick.items()}, config)[0])


def paired_mean(g, scores: dict, config: str, field: str) -> float | None:
    """Mean over tasks of `config`'s mean `field` on the paired samples of `scores` (paired_scores)."""
    idx = {t: set(i) for t, (i, _) in scores.items()}
    return mean(list(task_means(g, list(scores), config, idx, field).values()))


def normalised_draws(scores: dict, picks: dict[str, np.ndarray], config: str, worst: bool = False) -> np.ndarray:
    """Per draw (picks: draw_picks), the mean over tasks of (config's mean score / dense's mean score) on the draw's
    samples of each task, or with `worst` the lowest task's; tasks where dense scores 0 on the draw are left out, NaN
    where every task is."""
    per_task = []
    for t, (_, sc) in scores.items():
        d, c = sc["dense"][picks[t]].mean(1), sc[config][picks[t]].mean(1)  # (n_draws,) each
        with np.errstate(invalid="ignore", divide="ignore"):
            per_task.append(np.where(d > 0, c / d, np.nan))
    return mean_over_tasks(per_task, worst)


def normalised(scores: dict, picks: dict, config: str, worst: bool = False) -> float | None:
    """normalised_draws of one draw ({task: sample indices}); None where dense scores 0 on every task."""
    v = normalised_draws(scores, {t: np.asarray(p)[None] for t, p in picks.items()}, config, worst)[0]
    return None if np.isnan(v) else float(v)


def or_none(values: np.ndarray) -> list[float | None]:
    """An array of draws as floats, None where NaN (no value): as the points' curves take them."""
    return [None if v != v else v for v in values.tolist()]


def lossless_sparsity(curve: list[tuple[float, float | None]]) -> float:
    """The highest sparsity up to which every measured point keeps >= LOSSLESS of dense: curve is [(sparsity,
    normalised score)] of one method. 0 when even its least sparse point loses."""
    best = 0.0
    for sp, norm in sorted(curve):
        if not is_lossless(norm):
            break
        best = sp
    return best


def method_configs(rows, tasks) -> dict[str, list[str]]:
    """{method: its configurations, in config_sort_key's order} measured on the tasks, dense, local and the peers'
    dense control aside."""
    methods = defaultdict(list)
    for c in {r["config"] for r in rows if r["task"] in tasks and r["method"] not in ("dense", "local", "hf_dense")}:
        methods[c.split("@")[0]].append(c)
    return {m: sorted(methods[m], key=config_sort_key) for m in sorted(methods, key=config_sort_key)}


def lossless_draws(rows, tasks, configs: dict[str, list[str]], axis: str = "sparsity", n_boot: int = 2000,
                   seed: int = 0, worst: bool = False) -> dict[str, dict] | None:
    """Each method's lossless point (configs: {method: its configurations}) and n_boot bootstrap values of it, all on
    the samples that dense and every listed configuration finished, with the same draws (samples resampled within
    each task): paired between a method's configurations and dense, and between methods, so that differences of
    methods have intervals too. axis "kv_read": the point is 1 - the lowest lossless KV-read fraction. `worst`: a point
    is lossless when its worst task keeps >= LOSSLESS of dense, instead of the mean over tasks. "found": whether the
    method's least saving configuration is lossless, so that a lossless point was measured (else the point is 0, as
    in the draws that find none); "at": the configurations at the point, none when not found; "open": whether the
    point is the method's most saving one, so that the grid ended before the method lost (a lower bound)."""
    all_cfgs = [c for cs in configs.values() for c in cs]
    scores = paired_scores(rows, tasks, all_cfgs)
    if not scores:
        return None
    g = group(rows)
    rng = np.random.default_rng(seed)
    full = {t: np.arange(len(i)) for t, (i, _) in scores.items()}
    draws = draw_picks(scores, n_boot, rng)
    values = paired_values(rows, scores, all_cfgs, axis)
    sign = 1 if axis == "sparsity" else -1  # higher = saves more: sparsity, or 1 - KV read
    out = {}
    for m, cs in configs.items():
        sparsity = {c: paired_mean(g, scores, c, "sparsity") for c in cs}
        kv = {c: paired_mean(g, scores, c, "kv_read") for c in cs}
        if any((sparsity if axis == "sparsity" else kv)[c] is None for c in cs):  # a press has no head sparsity
            continue
        x = sparsity if axis == "sparsity" else {c: 1 - kv[c] for c in cs}
        curve = sorted((x[c], normalised(scores, full, c, worst)) for c in cs)
        point = lossless_sparsity(curve)
        found = is_lossless(curve[0][1])  # its least saving point lossless: a point found
        # each draw places the configurations where their drawn samples put them, and scores them there
        where = {c: ((1 - sign) / 2 + sign * drawn_means(values, draws, c)).tolist() for c in cs}
        norms = {c: or_none(normalised_draws(scores, draws, c, worst)) for c in cs}
        boot = np.array([lossless_sparsity([(where[c][j], norms[c][j]) for c in cs]) for j in range(n_boot)])
        out[m] = {"point": point, "boot": boot, "found": found, "at": [c for c in cs if x[c] == point] if found else [],
                  "open": found and point == curve[-1][0],  # its most saving point lossless: it may go further
                  "sparsity": sparsity, "kv_read": kv, "n": sum(len(i) for i, _ in scores.values())}
    return out


def progress(items, what: str):
    """`items` (methods) behind a progress bar on stderr: a large run's report draws its paired bootstraps for a
    minute (results/qwen0.5b-8k-cal's on one core), which would print nothing until its end."""
    items = list(items)
    return tqdm(items, desc=what, unit="method", file=sys.stderr, leave=False, dynamic_ncols=True, disable=not items)


def lossless_table(rows, tasks, axis: str = "sparsity", n_boot: int = 2000, seed: int = 0, worst: bool = False,
                   methods=None) -> list[dict]:
    """Per method: its lossless sparsity and a paired-bootstrap 95 % interval over samples (resampled within each
    task, the same draw for dense and every configuration of the method, each draw placing the configurations at the
    sparsity or KV read of its samples), with the mean KV-read fraction there.
    axis "kv_read": the lowest lossless KV-read fraction instead (the saving 1 - kv_read in place of sparsity), what
    sets decode time under grouped-query attention. `methods`: only these (default every method)."""
    out = []
    for m, cs in progress(method_configs(rows, tasks).items(), f"lossless {axis}"):
        if methods is not None and m not in methods:
            continue
        res = lossless_draws(rows, tasks, {m: cs}, axis, n_boot, seed, worst)  # each on all the samples it finished
        if not res or m not in res:
            continue
        r = res[m]
        lo, hi = float(np.percentile(r["boot"], 2.5)), float(np.percentile(r["boot"], 97.5))
        at = r["at"][0] if r["found"] else None
        row = {"method": m, "found": r["found"], "lossless": r["point"], "lo": lo, "hi": hi,
               "kv_read": r["kv_read"][at] if at else None,
               "sparsity": r["sparsity"][at] if at else None, "points": len(cs),
               "max_sparsity": max(r["sparsity"].values(), key=lambda v: -1 if v is None else v),
               "min_kv_read": min(r["kv_read"].values()), "n": r["n"]}
        if axis == "kv_read":  # back to a read fraction: lower is better, the interval flips
            row.update(lossless=1 - r["point"], lo=1 - hi, hi=1 - lo)
        out.append(row)
    return out


def score_points(rows, tasks, config: str, n_boot: int = 1000, seed: int = 0) -> dict | None:
    """One measured point of a configuration: mean over tasks of its score / dense score on the samples both
    finished, with a paired-bootstrap 95 % interval (samples redrawn within each task, the same draw for dense),
    and its mean sparsity and KV-read fraction on those samples."""
    scores = paired_scores(rows, tasks, [config])
    full = {t: np.arange(len(i)) for t, (i, _) in scores.items()}
    norm = normalised(scores, full, config) if scores else None
    if norm is None:
        return None
    rng = np.random.default_rng(seed)
    draws = draw_picks(scores, n_boot, rng)
    boot = [b for b in or_none(normalised_draws(scores, draws, config)) if b is not None]
    g = group(rows)
    return {"norm": norm, "lo": float(np.percentile(boot, 2.5)), "hi": float(np.percentile(boot, 97.5)),
            "sparsity": paired_mean(g, scores, config, "sparsity"),
            "kv_read": paired_mean(g, scores, config, "kv_read"),
            "n": sum(len(i) for i, _ in scores.values())}


def measured_points(rows, tasks) -> dict[str, dict]:
    """score_points for every configuration the tasks ran (dense included, the ablations left out), in config order:
    computed once per report, read by analysis.md's table and by Fig. 4."""
    configs = sorted({r["config"] for r in rows if r["task"] in tasks and r["method"] not in ABLATIONS},
                     key=config_sort_key)
    return {c: p for c in configs if (p := score_points(rows, tasks, c))}


# where methods are compared at equal cost
MATCHED = {"sparsity": (0.7, 0.8, 0.85, 0.9), "kv_read": (0.6, 0.5, 0.4, 0.25)}


def matched_draws(rows, tasks, configs: dict[str, list[str]], axis: str, targets, n_boot: int = 2000, seed: int = 0
                  ) -> dict[str, np.ndarray] | None:
    """Each method's score / dense at each target of `axis` (head sparsity or KV-read fraction), interpolated linearly
    between its two measured configurations around the target: (1 + n_boot, len(targets)) per method, row 0 on every
    sample, the others on bootstrap draws (samples redrawn within each task, the same draw for every method and dense,
    so differences are paired). Each draw recomputes the configurations' mean sparsity or KV read with their scores,
    so the interval holds the uncertainty of where a configuration sits as well as of what it scores. NaN where a
    target lies outside a method's measured range."""
    all_cfgs = [c for cs in configs.values() for c in cs]
    scores = paired_scores(rows, tasks, all_cfgs)
    if not scores:
        return None
    x = paired_values(rows, scores, all_cfgs, axis)
    rng = np.random.default_rng(seed)
    drawn = draw_picks(scores, n_boot, rng)
    picks = {t: np.vstack([np.arange(len(i)), drawn[t]]) for t, (i, _) in scores.items()}  # row 0: every sample
    out = {}
    for m, cs in configs.items():
        where = {c: drawn_means(x, picks, c).tolist() for c in cs}
        norms = {c: or_none(normalised_draws(scores, picks, c)) for c in cs}
        table = np.full((1 + n_boot, len(targets)), np.nan)
        for j in range(1 + n_boot):
            pts = sorted((where[c][j], norms[c][j]) for c in cs)
            xs, ys = np.array([p[0] for p in pts]), np.array([np.nan if p[1] is None else p[1] for p in pts])
            for k, target in enumerate(targets):
                if len(xs) and xs[0] <= target <= xs[-1]:
                    table[j, k] = np.interp(target, xs, ys)
        out[m] = table
    return out


def matched_table(rows, tasks, axis: str, targets=None, against: str | None = None, n_boot: int = 2000, seed: int = 0,
                  methods=None) -> list[dict]:
    """Per method (dense and local aside; with `methods`, only those): score / dense at each target of `axis` with its
    95 % interval, and with `against` (a method) the paired difference from it at the same target."""
    targets = targets or MATCHED[axis]
    configs = method_configs(rows, tasks)
    measured = {r["config"] for r in rows if r.get(axis) is not None}
    configs = {m: cs for m, cs in configs.items() if set(cs) <= measured}  # a press has no head sparsity
    out = []
    for m, cs in progress(configs.items(), f"score / dense at matched {axis}"):
        if methods is not None and m not in methods:
            continue
        pair = ({m: cs} if against is None or against == m or against not in configs
                else {m: cs, against: configs[against]})
        res = matched_draws(rows, tasks, pair, axis, targets, n_boot, seed)  # each method on the samples it finished
        if not res:
            continue
        row = {"method": m,
               "n": sum(len(i) for i, _ in paired_scores(rows, tasks, [c for v in pair.values() for c in v]).values())}
        for k, target in enumerate(targets):
            v = res[m][:, k]
            row[target] = None if np.isnan(v[0]) else (float(v[0]), *np.nanpercentile(v[1:], [2.5, 97.5]).tolist())
            if against in res and m != against:
                d = res[m][:, k] - res[against][:, k]
                row[f"vs {target}"] = (None if np.isnan(d[0])
                                       else (float(d[0]), *np.nanpercentile(d[1:], [2.5, 97.5]).tolist()))
        out.append(row)
    return out


def mean_draws(values: dict[str, list[float]], n_boot: int = 2000, seed: int = 0) -> tuple[float, np.ndarray]:
    """The mean over tasks of each task's mean value, and its bootstrap draws (values resampled within each task)."""
    vals = {t: np.array(v, dtype=float) for t, v in values.items() if v}
    rng = np.random.default_rng(seed)
    boot = [np.mean([v[rng.integers(0, len(v), len(v))].mean() for v in vals.values()]) for _ in range(n_boot)]
    return float(np.mean([v.mean() for v in vals.values()])), np.array(boot)


# ---------------------------------------------------------------------------------------------------------
# Agreement with the oracle (tracked runs)


def head_counts(rows):
    """Step-weighted per-(layer, head) counts over tracked records: steps, qada local, oracle local, both local."""
    S = q = o = b = 0
    for r in rows:
        if "oracle_freq" not in r:
            continue
        s = r["steps"]
        S, q = S + s, q + s * np.array(r["local_freq"])
        o, b = o + s * np.array(r["oracle_freq"]), b + s * np.array(r["both_freq"])
    return S, q, o, b


def confusion(q: float, o: float, b: float, n: float) -> tuple[float, float, float, float]:
    """TP, FP, TN, FN as fractions of n (step, head) pairs (positive = local), from head_counts' sums over them:
    QAdA local q, oracle local o, both local b."""
    tp, fp, fn = b / n, (q - b) / n, (o - b) / n
    return tp, fp, max(1 - tp - fp - fn, 0.0), fn  # the clamp: float round-off of step-weighted frequencies


def recall_rows(rows, static_freq: dict) -> list[dict]:
    """Recall of the oracle's long-context (head, step) pairs: QAdA vs static oracle labels at QAdA's sparsity."""
    out = []
    by = defaultdict(list)
    for r in rows:
        if "oracle_freq" in r and r["task"] in static_freq:
            by[r["task"], r["config"]].append(r)
    for (task, cfg), rs in sorted(by.items(), key=lambda kv: (kv[0][0], config_sort_key(kv[0][1]))):
        S, q, o, b = head_counts(rs)
        long_oracle = S - o  # per head: steps the oracle says long-context
        if long_oracle.sum() == 0:
            continue
        tn = S - q - o + b  # both long
        sparsity = q.sum() / (S * q.size)
        static = static_labels(torch.tensor(static_freq[task], device="cpu"), float(sparsity)).numpy()
        out.append({"task": task, "config": cfg, "qada_sparsity": float(sparsity),
                    "oracle_sparsity": float(o.sum() / (S * q.size)),
                    "recall_qada": float(tn.sum() / long_oracle.sum()),
                    "recall_static_oracle": float(long_oracle[~static].sum() / long_oracle.sum())})
    return out


def static_oracle_freq(g, tasks) -> dict[str, list]:
    """Per task, how often the adaptive oracle (tau MAIN_TAU) labels each (layer, head) local over all the task's
    evaluated prompts, step-weighted: the paper's static oracle (appendix C) ranks heads by it."""
    out = {}
    for t in tasks:
        rs = [r for r in g.get((t, f"oracle@{MAIN_TAU:g}"), []) if r.get("local_freq")]
        if rs:
            out[t] = (sum(r["steps"] * np.array(r["local_freq"]) for r in rs) / sum(r["steps"] for r in rs)).tolist()
    return out


def run_recall(r, static_freq: list) -> tuple[float, float] | None:
    """One tracked run: the share of the oracle's long-context (step, head) pairs that QAdA labelled long, and that
    static-oracle labels at the run's own sparsity leave long (appendix C); None if the oracle never needed one."""
    S = r["steps"]
    q, o, b = (S * np.array(r[k]) for k in ("local_freq", "oracle_freq", "both_freq"))
    long_oracle = S - o  # (L, H): steps the oracle needs the whole context
    if long_oracle.sum() <= 0:
        return None
    static = static_labels(torch.tensor(static_freq, device="cpu"), float(q.sum() / (S * q.size))).numpy()
    return float((S - q - o + b).sum() / long_oracle.sum()), float(long_oracle[~static].sum() / long_oracle.sum())
