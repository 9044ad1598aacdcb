"""Generate from a prompt file with dense, local, oracle, static, QAdA or page-selection (Quest, QAdA + pages)
decode-time attention.

    python generate.py --prompt examples/needle.txt --tau 0.6
    python generate.py --prompt a.txt b.txt c.txt --tau 0.6      # three prompts decoded as one batch

Prefill is always dense; the chosen method labels every (layer, head) for every decoded token. The report
gives load time, prompt tokens, prefill time, decode speed, peak memory, the fraction of heads labelled
local (sparsity) and the fraction of KV entries actually read. On CUDA, dense (the split kernel alone), the qada
paths and the page paths (Quest, QAdA + pages) on the fused kernels decode from fixed device buffers, one step
captured as a CUDA graph per bucket of lengths and replayed (decode_static; --cuda-graphs off: the eager loop,
decode_batch, which the CPU always runs). --compile on compiles the model's norms, RoPE and MLP for decoding
(model.Llama.compile_pointwise), the attention left as it is.
"""

import argparse
import inspect
import json
import math
import os
import re
import resource
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

import decode_kernels
from attention import (ANALYSIS_ONLY, PATHS, BatchAttention, StaticAttention, build_attention, bulk_estimate,
                       missing_inputs, path_inputs, static_refusal)
from criterion import (TAU, Calibration, check_calibration, check_labels_window, check_tau, check_weights,
                       check_window, load_calibration, load_labels, weights_probe)
from model import KVCache, read_config
from moments import SOURCES, ReferenceKeys, reference_words
from weights.checkpoints import DEFAULT, DTYPES, MODELS, load, resolve, shipped_calibration, user_path
from weights.downloads import cache_dir


GRAPH_CHOICES = ("auto", "off")  # --cuda-graphs
COMPILE_CHOICES = ("off", "on")  # --compile
STATIC_SPARSITY = 0.5  # --method static's share of local heads when --static-sparsity is not given
WINDOW = {"n_sink": 16, "n_local": 128}  # the paper's, --n-sink and --n-local's defaults


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None, generator=None) -> torch.Tensor:
    """Next token (B,) from logits (B, V): greedy at temperature 0."""
    if temperature == 0:
        return logits.argmax(-1)
    # in float64 and from the row's max down: a tiny temperature underflows fp32 (a logit over it then inf or NaN);
    # relative to the max the best token's logit stays 0 and the others' go at worst to -inf
    logits = logits.double()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@torch.inference_mode()
def decode_batch(model, cache, logits, max_new_tokens: int, attention=None, eos_ids=(), temperature: float = 0.0,
                 top_k: int | None = None, generator=None, progress: bool = False, finished=None) -> list[list[int]]:
    """Decode every row of a batch (last logits (B, V)) in lockstep until each has ended: an EOS, max_new_tokens,
    or the optional stop rule `finished(new_ids) -> bool`. A row decodes as it would alone; with a BatchAttention
    an ended row is no longer attended (its cache is not read). The rows share each step's weight reads, which
    dominate a decode step on a CPU, so B rows cost far less than B runs. Once half the rows have ended, the batch
    goes on with the others only (their cache rows copied out): the ended rows no longer cost the linear layers."""
    outs = [[] for _ in range(logits.shape[0])]
    live = list(range(len(outs)))  # the original row of each row of the current batch
    done = attention.done if isinstance(attention, BatchAttention) else [False] * len(outs)
    steps = tqdm(range(max_new_tokens), desc="decode", unit="tok", leave=False, disable=not progress)
    for _ in steps:
        tokens = sample(logits, temperature, top_k, generator)  # (B,)
        for j, t in enumerate(tokens.tolist()):
            if not done[j]:
                out = outs[live[j]]
                out.append(t)
                done[j] = t in eos_ids or len(out) == max_new_tokens or bool(finished and finished(out))
        if all(done):
            break
        keep = [j for j, d in enumerate(done) if not d]
        if len(keep) <= len(done) // 2:  # compact: a copy of the cache rows left, at most log2(B) times
            cache, tokens, live = cache.select_rows(keep), tokens[keep], [live[j] for j in keep]
            if isinstance(attention, BatchAttention):
                attention = attention.select(keep)
                done = attention.done
            else:
                done = [False] * len(keep)
        logits = model.decode_step(tokens, cache, attention)
    return outs


# ---------------------------------------------------------------------------------------------------------
# The same loop with the step replayed from CUDA graphs (gpt-fast's decode loop: a static cache, the position a device
# tensor, one step captured and replayed)


def graph_view(T: int, capacity: int) -> int:
    """How far a static step's views reach at context T (the filled length during the step): T rounded up to a
    multiple of a sixteenth of the power of two at or above it (at least 256), at most the capacity. One graph is
    captured per view, a few per generation (a generation of 1,000 tokens from 32k crosses one boundary), and a view
    reaches less than an eighth or 256 positions past T: the kernels' split programs past T return at once (dense
    without the kernel reads the view whole, masked past T)."""
    grain = max(256, (1 << max(T - 1, 1).bit_length()) // 16)
    return min(capacity, -(-T // grain) * grain)


@torch.inference_mode()
def decode_static(model, cache, logits, max_new_tokens: int, rows: list, eos_ids=(), temperature: float = 0.0,
                  top_k: int | None = None, generator=None, progress: bool = False, finished=None,
                  capture: bool = False) -> list[list[int]]:
    """decode_batch's loop, each step from fixed device buffers: the cache in static mode (model.KVCache.fix), the
    rows' DecodeAttentions (`rows`, each row's statistics kept in them) as one attention.StaticAttention, the token a
    device buffer. With `capture` (CUDA), the first step at each view (graph_view) runs as warm-up on a side stream
    and is captured as a CUDA graph; every later step at that view is one replay. Without, the same step runs
    eagerly (what the tests hold against decode_batch on the CPU).

    Rows that end keep decoding into a discarded slot (their tokens and statistics dropped): a graph's shapes are
    fixed, so the batch is not compacted as decode_batch's is (with temperature > 0 the random draws then differ
    from decode_batch's once it compacts). The host reads each step's tokens, as decode_batch does, to end rows."""
    B = logits.shape[0]
    outs, done = [[] for _ in range(B)], [False] * B
    start = None if cache.start is None else cache.start.tolist()
    T0 = cache.length
    cache.fix()
    cfg = model.cfg
    static = StaticAttention.of(rows, cache, max(max_new_tokens - 1, 1), cfg.num_attention_heads)
    hook = step_attention(static, cfg.head_dim, logits.device)
    token = torch.zeros(B, dtype=torch.long, device=logits.device)  # (B,): the step's input
    graphs = {}  # view -> (replay, the logits it writes)

    def step():  # reads the buffers above only: what a graph captures
        return model.decode_step(token, cache, hook)

    def rewind():  # undoes a step's advances; running it again rewrites the same entries
        cache.filled.sub_(1)
        if hook is not None:
            static.step.sub_(1)

    n = 0  # decode steps run
    try:
        for _ in tqdm(range(max_new_tokens), desc="decode", unit="tok", leave=False, disable=not progress):
            tokens = sample(logits, temperature, top_k, generator)  # (B,)
            for j, t in enumerate(tokens.tolist()):
                if not done[j]:
                    outs[j].append(t)
                    done[j] = t in eos_ids or len(outs[j]) == max_new_tokens or bool(finished and finished(outs[j]))
            if all(done):
                break
            token.copy_(tokens)
            cache.view = graph_view(T0 + n + 1, cache.max_len)  # host bookkeeping: which graph, not read by the step
            if not capture:
                logits = step()
            elif cache.view in graphs:
                graphs[cache.view][0]()
                logits = graphs[cache.view][1]
            else:  # the graphs share one memory pool: they never run at once, and a view is never left for an earlier
                pool = next(iter(graphs.values()))[2] if graphs else None
                graphs[cache.view] = captured(step, rewind, logits.device, pool)
                logits = graphs[cache.view][1]
            n += 1
    finally:
        cache.release()
    lengths = [[T0 + 1 + s - (start[b] if start else 0) for s in range(n)] for b in range(B)]  # T per step, per row
    static.stats(rows, [max(len(out) - 1, 0) for out in outs], lengths)
    return outs


def step_clock() -> tuple[dict[int, float], Callable[[list[int]], bool]]:
    """(read_at, clock): `clock` a stop rule for decode_batch and decode_static (their `finished`) that ends no row,
    asked once a step's tokens are on the host, and notes in read_at {new tokens a row holds: when the step that made
    the last was read back} (the first row asked): one time per step, with no sync of its own (how run_batch and
    lab.bench_gpu time the steps)."""
    read_at = {}

    def clock(new_ids: list[int]) -> bool:
        read_at.setdefault(len(new_ids), time.perf_counter())
        return False

    return read_at, clock


def step_attention(static: StaticAttention, head_dim: int, device: torch.device) -> StaticAttention | None:
    """The decode attention a static step hands the model: `static`, except for dense where the kernel does not run
    (decode_kernels.fused), which gets None, the model's own (SDPA over the whole view, masked past T)."""
    if static.method == "dense" and not decode_kernels.fused(torch.empty(1, head_dim, device=device)):
        return None
    return static


def captured(step, rewind, device: torch.device, pool=None):
    """step() captured as one CUDA graph (in memory pool `pool`, None: its own): (replay, its output, its pool).
    Warm-up first, on a side stream (torch's recipe): the step runs, is rewound and runs again, which leaves its
    effects as one real step's; the capture itself runs nothing."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
        rewind()
        out = step()
    torch.cuda.current_stream(device).wait_stream(side)
    out.record_stream(torch.cuda.current_stream(device))  # read there below: not to be reused by the side stream first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        static_out = step()
    static_out.copy_(out)  # the warm-up's logits, where the graph will write
    return graph.replay, static_out, graph.pool()


def decode(model, cache, logits, max_new_tokens: int, attention=None, eos_ids=(), temperature: float = 0.0,
           top_k: int | None = None, generator=None, progress: bool = False) -> list[int]:
    """Decode one prompt (last logits (1, V)) up to max_new_tokens; stops after an EOS."""
    return decode_batch(model, cache, logits, max_new_tokens, attention, eos_ids, temperature, top_k, generator,
                        progress)[0]


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux: the process peak


def check_context(length: int, cfg, flag: str, hint: str | None = None) -> None:
    """ValueError with one line where `length` tokens reach past the model's trained context (cfg: model.LlamaConfig):
    positions the model never saw, which it reads as garbage, quietly. A config's rope_scaling says how far the model
    reaches itself. `hint`: what the command offers instead (default: a length within the context). lab.sweep and
    lab.calibrate hold their --length to it too."""
    trained = cfg.max_position_embeddings
    if length > trained and not cfg.rope_scaling:
        raise ValueError(f"{flag} {length} exceeds the model's trained context of {trained}; "
                         + (hint or f"give at most {trained}"))


def input_file(path: str, flag: str, default_name: str) -> Path:
    """The file behind --calibration or --static-labels: the file itself, or `default_name` inside a folder that
    lab.calibrate wrote (lab.sweep takes such folders; both CLIs take either)."""
    p = user_path(path)
    if p.is_dir():
        if not (p / default_name).is_file():
            qada = " --qada" if flag == "--calibration" else ""
            raise ValueError(f"{flag} {p}: a folder, but it holds no {default_name} (give the file itself, or a "
                             f"folder written by python -m lab.calibrate{qada})")
        return p / default_name
    if not p.exists():
        raise FileNotFoundError(f"{flag} {p}: no such file or folder")
    return p


def read_calibration(path: str, method: str, flag: str = "--calibration") -> Calibration:
    """QAdA's correction for `method` from a file, or from a folder of lab.calibrate --qada (the file of the estimate
    the method corrects: sampled.json for the sampled bulk, affine.json for the moments'), its path kept in its
    settings for the report and the checks."""
    name = "sampled.json" if bulk_estimate(method) == "sampled" else "affine.json"
    file = input_file(path, flag, name)
    correction = load_calibration(file)
    correction.settings["file"] = str(file)
    return correction


def read_sources(method: str, static_labels: str | None, static_sparsity: float, calibration: str | None,
                 moments_source: str, n_sink: int, n_local: int) -> dict:
    """The files the path reads besides the prompt, read and checked before any model is loaded: QAdA's correction
    (lab.calibrate --qada) and static labels (lab.calibrate), as build_attention's keywords (on the CPU), and the
    labels' settings (static_settings, which fit_sources checks and drops)."""
    inputs = path_inputs(method)
    correction = static_local = static_settings = None
    if "calibration" in inputs:
        correction = read_calibration(calibration, method)
        check_calibration(correction, correction.settings["file"], None, None, None, n_sink, n_local, moments_source,
                          bulk_estimate(method))
    if "static_local" in inputs:
        path = input_file(static_labels, "--static-labels", "ruler.json")
        static_local, static_settings = load_labels(path, static_sparsity)
        # the oracle's statistics of another window: refused
        check_labels_window(static_settings, path, n_sink, n_local)
        static_settings["file"] = str(path)
    return {"static_local": static_local, "calibration": correction, "static_settings": static_settings}


def fit_sources(sources: dict, model, static_labels: str | None) -> dict:
    """read_sources' tensors checked against the loaded model's heads and weights (a file fitted on another
    checkpoint of the same shape is refused: criterion.weights_probe), and moved to its device."""
    cfg = model.cfg
    L, H, Hkv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    out = dict(sources)
    static_settings = out.pop("static_settings")
    if sources["calibration"] is not None:
        c = sources["calibration"]
        check_calibration(c, c.settings["file"], L, H, Hkv, None, None, probe=weights_probe(model))
        out["calibration"] = c.to(model.device)
    if sources["static_local"] is not None:
        if tuple(sources["static_local"].shape) != (L, H):
            raise ValueError(f"{static_labels} labels {tuple(sources['static_local'].shape)} heads; this model has "
                             f"({L}, {H})")
        check_weights(static_settings, static_settings["file"], weights_probe(model),
                      "holds the oracle's statistics of")
        out["static_local"] = sources["static_local"].to(model.device)
    return out


def default_tau(method: str, calibration) -> tuple[float | None, str]:
    """The tau a path runs at when --tau is not given, and where it comes from: a calibrated path at the operating
    point stored with its correction (where that correction was lossless on its evaluation), any other path that
    reads tau at the paper's criterion.TAU."""
    if "tau" not in path_inputs(method):
        return None, ""
    stored = calibration.operating_tau(method) if calibration is not None else None
    if stored is not None:
        return stored, "the calibration's operating point"
    if calibration is not None:
        return TAU, (f"the paper's default; {Path(calibration.settings['file']).name} states no operating point for "
                     f"{method}")
    return TAU, "the paper's default"


def check_args(max_new_tokens: int, tau: float | None, n_sink: int, n_local: int, temperature: float,
               top_k: int | None, static_sparsity: float | None, rope_theta: float | None, max_context: int | None,
               threads: int | None, method: str, moments_source: str | None, static_labels: str | None,
               calibration: str | None, inputs: dict, cuda_graphs: str = "auto", compiled: str = "off",
               model: str | None = None, seed: int | None = None, **_) -> None:
    """Validate the flags before anything is loaded; ValueError carries one clear line. `calibration` and `tau` are
    what the user gave (None: not given)."""
    if method not in PATHS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(PATHS)}")
    reads = path_inputs(method)
    if tau is not None:
        if "tau" not in reads:
            raise ValueError(f"--tau: the {method} path has no threshold (it reads {', '.join(reads) or 'nothing'})")
        check_tau(tau)
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    check_window(n_sink, n_local, ("--n-sink", "--n-local"))
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {top_k}")
    if top_k is not None and temperature == 0:
        raise ValueError("--top-k samples among the k most likely tokens: it needs --temperature > 0 (0 is greedy)")
    if seed is not None and not 0 <= seed < 2 ** 64:  # what torch.Generator.manual_seed takes
        raise ValueError(f"--seed must lie in [0, 2**64), got {seed}")
    if seed is not None and temperature == 0:  # greedy decoding draws nothing: a seed would be ignored
        raise ValueError("--seed seeds the sampling: it needs --temperature > 0 (0 is greedy)")
    if model is not None and not model.strip():
        raise ValueError("--model is empty: give a named model, a model folder or a hub id (or leave it out)")
    if static_sparsity is not None and "static_local" not in reads:
        raise ValueError(f"--static-sparsity: the {method} path reads no static labels (--method static does)")
    if static_sparsity is not None and not 0 <= static_sparsity <= 1:
        raise ValueError(f"--static-sparsity must lie in [0, 1], got {static_sparsity}")
    if rope_theta is not None and not (math.isfinite(rope_theta) and rope_theta > 0):
        raise ValueError(f"--rope-theta must be a positive number, got {rope_theta}")
    if max_context is not None and max_context <= max_new_tokens:
        raise ValueError(f"--max-context must exceed --max-new-tokens ({max_new_tokens}): it bounds prompt + "
                         f"generation, got {max_context}")
    if threads is not None and not 1 <= threads <= (os.cpu_count() or 1):  # torch crashes far above the cores
        raise ValueError(f"--threads must lie in [1, {os.cpu_count() or 1}] (this machine's CPUs), got {threads}")
    if cuda_graphs not in GRAPH_CHOICES:
        raise ValueError(f"--cuda-graphs takes {' or '.join(GRAPH_CHOICES)}, got {cuda_graphs!r}")
    if compiled not in COMPILE_CHOICES:
        raise ValueError(f"--compile takes {' or '.join(COMPILE_CHOICES)}, got {compiled!r}")
    if moments_source is not None and "moments" not in reads:
        raise ValueError(f"--moments: the {method} path reads no key moments (the Gaussian estimate's paths do: "
                         "qada, qada_kv*, their _cal and qada_pages*)")
    if calibration is not None and "calibration" not in reads:
        raise ValueError(f"--calibration: the {method} path reads no calibration (the calibrated paths do: "
                         "qada*_cal and qada_pages*)")
    if static_labels is not None and "static_local" not in reads:
        raise ValueError(f"--static-labels: the {method} path reads no static labels (--method static does)")
    if "static_local" in reads and static_labels is None:
        raise ValueError(f"--method {method} needs --static-labels FILE (made by python -m lab.calibrate)")
    unread = [name for name in inputs if name not in reads]
    if unread:
        raise ValueError(f"--set {unread[0]}: the {method} path does not read it (it reads "
                         f"{', '.join(reads) or 'nothing'})")
    missing = missing_inputs(method, inputs, FROM_FLAGS)  # and a page budget that is no number (--set budget=true)
    if missing:  # said before a long prompt's prefill, not at the first decode step
        raise ValueError(f"the {method} path reads {', '.join(missing)}; give "
                         + ", ".join(f"--set {name}={SET_EXAMPLES.get(name, 'VALUE')}" for name in missing))


def graph_refusal(cuda_graphs: str, device: torch.device, rows: list, prompt_lengths: list[int], model) -> str | None:
    """Why the decode loop does not run through CUDA graphs (one line for the report), or None when it does: with
    --cuda-graphs auto, on CUDA, for dense, and for the qada paths and the page paths (Quest, QAdA + pages) on the
    fused kernels with fixed moments (the paths that decide on the device; attention.static_refusal says why not the
    others)."""
    if cuda_graphs == "off":
        return "--cuda-graphs off"
    if device.type != "cuda":
        return f"no CUDA device ({device.type}); the eager loop runs"
    why = static_refusal(rows)
    if why:
        return why
    if rows[0].method != "dense":
        probe = torch.empty(1, model.cfg.head_dim, device=device)
        if not decode_kernels.fused(probe):
            return (f"the {rows[0].method} path takes the torch path here (QADA_KERNEL=torch, no triton, or a head dim "
                    "that is not a power of two from 16)")
        if min(prompt_lengths) <= rows[0].n_local:
            return f"a prompt fits in the window ({rows[0].n_local} tokens): its first steps take the torch path"
    return None


def compiler_missing(device: torch.device) -> str | None:
    """Why --compile on cannot run on `device`, or None: torch.compile writes Triton kernels for a GPU and C++ for the
    CPU, which a C++ compiler on PATH must build."""
    if device.type == "cuda" and decode_kernels.triton is None:
        return "--compile on: on CUDA torch.compile needs triton (pip install triton)"
    cxx = os.environ.get("CXX", "g++")  # the compiler inductor calls
    if device.type == "cpu" and not shutil.which(cxx):
        return f"--compile on: on the CPU torch.compile needs a C++ compiler ({cxx}, or $CXX), and it is not on PATH"
    return None


def pick_device(device: str | None) -> str:
    """--device checked: cpu, cuda or cuda:N. The default is cuda if available (cuda:LOCAL_RANK under torchrun),
    else cpu; a bare "cuda" under torchrun is cuda:LOCAL_RANK too, so the ranks do not share one GPU."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = "cpu" if device == "cpu:0" else device  # torch's name for the one CPU device
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"--device takes cpu, cuda or cuda:N; got {device!r}")
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine has no CUDA (torch {torch.__version__})")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


BUILT = {"layer": "the layer is each call's own", "pages": "the page index is built from the prompt's keys"}
# what a path reads that the command gives it without --set: BUILT, the window, the threshold and the files of flags
FROM_FLAGS = {*BUILT, "n_sink", "n_local", "tau", "moments", "calibration", "static_local"}
SET_EXAMPLES = {"budget": "TOKENS (the page tokens a head may read beside its window, e.g. 1024)",
                "budget_frac": "SHARE (the same as a share of the context, e.g. 0.1)"}


def parse_inputs(items: list[str], reserved: set[str] = frozenset()) -> dict:
    """--set NAME=VALUE items -> {NAME: VALUE}, each VALUE read as JSON when it parses (0.3, 2, true, [1, 2]) and as a
    string otherwise. A name with a flag of its own or that the command sets (`reserved`) is refused, so no input is
    set twice, and so is one that the decode loop makes itself (BUILT)."""
    inputs = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"--set takes NAME=VALUE, got {item!r}")
        if name in BUILT:
            raise ValueError(f"--set {name}: {BUILT[name]}, not set")
        if name in reserved:
            raise ValueError(f"--set {name}: not set with --set ({name} has a flag of its own, or the command sets "
                             "it)")
        if name in inputs:
            raise ValueError(f"--set {name} is given twice")
        try:
            inputs[name] = json.loads(text)
        except json.JSONDecodeError:
            inputs[name] = text
    return inputs


def read_prompts(files: list[str]) -> list[tuple[str, str]]:
    """(name, text) of every prompt: a UTF-8 text file (or pipe; "-" standard input, named <stdin>) is one prompt; a
    .jsonl file holds one per line, each a JSON string or an object with a "prompt" field (its other fields are
    ignored: the flags set every row's decoding). FileNotFoundError/ValueError carry one clear line."""
    if files.count("-") > 1:
        raise ValueError("--prompt - is given twice: standard input holds one prompt")
    if "-" in files and sys.stdin is None:
        raise ValueError("--prompt -: this process has no standard input")
    prompts = []
    for f in files:
        path = Path("<stdin>" if f == "-" else f)
        if f != "-" and not path.exists():
            raise FileNotFoundError(f"prompt file {path} not found")
        if f != "-" and not (path.is_file() or path.is_fifo()):  # a pipe: --prompt <(...) or /dev/stdin from one
            raise ValueError(f"prompt file {path} is not a regular file or a pipe (- reads standard input)")
        data = sys.stdin.buffer.read() if f == "-" else path.read_bytes()
        if b"\0" in data:
            raise ValueError(f"prompt file {path} holds NUL bytes: a binary file, not text")
        try:
            text = data.decode("utf-8-sig")  # a byte-order mark, which some editors write, is not part of the prompt
        except UnicodeDecodeError as e:
            raise ValueError(f"prompt file {path} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); "
                             "convert it, e.g. iconv -t UTF-8") from None
        if path.suffix.lower() != ".jsonl":
            prompts.append((str(path), text))
            continue
        for i, line in enumerate(text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028 and the like
            line = line.removesuffix("\r")
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompt = item if isinstance(item, str) else item["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path} line {i}: expected a JSON string or an object with a \"prompt\" "
                                 "field") from None
            if not isinstance(prompt, str):
                raise ValueError(f"{path} line {i}: \"prompt\" must be a string, got {type(prompt).__name__}")
            try:  # JSON's \ud83d escapes may leave a lone UTF-16 surrogate, which no tokenizer takes
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"{path} line {i}: the prompt holds a lone UTF-16 surrogate escape "
                                 f"(\\u{ord(prompt[e.start]):04x} at character {e.start}), not text") from None
            prompts.append((f"{path}:{i}", prompt))
    for name, text in prompts:
        if not text.strip():
            raise ValueError(f"prompt {name} is empty")
    if not prompts:
        raise ValueError(f"no prompt in {', '.join(files)}")
    return prompts


def run_batch(prompts: list[str], model: str | None = None, max_new_tokens: int = 64, chat: bool = True,
              device: str | None = None, dtype: str = "float32", rope_theta: float | None = None,
              max_context: int | None = None, seed: int | None = None, temperature: float = 0.0,
              top_k: int | None = None, method: str = "qada", tau: float | None = None,
              moments_source: str | None = None,
              n_sink: int = WINDOW["n_sink"], n_local: int = WINDOW["n_local"], static_labels: str | None = None,
              static_sparsity: float | None = None, calibration: str | None = None, threads: int | None = None,
              progress: bool = True, cuda_graphs: str = "auto", compiled: str = "off", **inputs) -> list[dict]:
    """Everything the CLI does for the prompt files `prompts`, decoded as one batch: a report per prompt.

    Each prompt is prefilled alone into its own cache and gets its own attention (labels, moments, statistics);
    then the caches are stacked left-padded (model.KVCache.stack) and every row decodes in lockstep. `inputs` are
    more of what the path reads, by name (a new path's own; the CLI's --set NAME=VALUE). `tau` None: the method's
    own operating point (default_tau); `moments_source` None: a correction's own, else random-words. `cuda_graphs`
    "auto": on CUDA, decode_static replays the step from CUDA graphs where graph_refusal finds nothing against it.
    `compiled` "on": the model's norms, RoPE and MLP are compiled before decoding (Llama.compile_pointwise; prefill
    and the reference moments run eagerly before it). Every flag and file is checked before the model is loaded."""
    check_args(**locals())
    named = read_prompts(prompts)
    if "calibration" in path_inputs(method) and calibration is None:
        calibration = shipped_calibration(model or DEFAULT)
        if calibration is None:
            ships = [name for name in MODELS if shipped_calibration(name)]
            raise ValueError(f"--method {method} needs --calibration FILE (made by python -m lab.calibrate --qada) for "
                             f"{model or DEFAULT}; the named models that ship one ({', '.join(ships)}) use it by "
                             "default")
        shipped = load_calibration(calibration).estimate
        if shipped != bulk_estimate(method):  # said as a missing flag: the user gave no file to blame
            raise ValueError(f"--method {method} corrects the {bulk_estimate(method)} estimate of the bulk mass; "
                             f"{model or DEFAULT} ships a correction of the {shipped} one only: give --calibration "
                             "DIR, a folder of python -m lab.calibrate --qada (its sampled.json)")
    sources = read_sources(method, static_labels, STATIC_SPARSITY if static_sparsity is None else static_sparsity,
                           calibration, moments_source, n_sink, n_local)
    if moments_source is None:  # a correction fixes the moments it corrects; else the paper's default, Option 2
        c = sources["calibration"]
        moments_source = c.settings.get("moments_source", "random-words") if c is not None else "random-words"
    tau, tau_from = (tau, "given") if tau is not None else default_tau(method, sources["calibration"])
    device = torch.device(pick_device(device))
    if compiled == "on" and (why := compiler_missing(device)):
        raise ValueError(why)
    if threads:
        torch.set_num_threads(threads)
    seed = 0 if seed is None and temperature > 0 else seed  # greedy: None, no draw to seed
    torch.manual_seed(seed or 0)
    times = {}
    t0 = time.perf_counter()
    folder = resolve(model, progress)  # fetched or converted on first use; its config is checked before its weights
    cfg = read_config(folder)
    if max_context and rope_theta is None:  # a RoPE base given is the user's own reach past the trained context
        check_context(max_context, cfg, "--max-context", "past it give --rope-theta too (the paper: 2e6 for 32k)")
    max_context = max_context or cfg.max_position_embeddings
    if "n_local" in path_inputs(method) and n_local >= max_context:
        raise ValueError(f"--n-local {n_local} leaves no bulk in a context of at most {max_context} tokens "
                         "(--max-context, default the model's)")
    net, tok = load(str(folder), device, DTYPES[dtype], rope_theta, progress)
    times["load_s"] = time.perf_counter() - t0
    sources = fit_sources(sources, net, static_labels)
    t0 = time.perf_counter()
    words = reference_words(moments_source) if "moments" in path_inputs(method) else None
    reference = ReferenceKeys(net, tok, words, n_max=max_context, root=cache_dir() / "moments",
                              progress=progress) if words else None
    times["moments_s"], times["prefill_s"] = time.perf_counter() - t0, 0.0

    rows, caches = [], []  # per prompt: (ids, last logits, prefill seconds, attention); its prefilled cache
    for name, text in named:
        if chat and tok.has_chat_template:
            ids = tok.encode_chat([{"role": "user", "content": text}])
        else:
            ids = tok.encode(text, add_special_tokens=True)
        if len(ids) + max_new_tokens > max_context:
            raise ValueError(f"prompt {name} is {len(ids)} tokens + {max_new_tokens} new tokens, longer than the "
                             f"context of {max_context} (--max-context, default the model's; past the model's, with "
                             "--rope-theta)")
        cache = net.new_cache(len(ids) + max_new_tokens)
        t0 = time.perf_counter()
        logits = net.prefill(torch.tensor([ids], device=device), cache, progress=progress)
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()  # Option 2's reference pass runs here the first time a prompt needs it
        att = build_attention(method, cache, n_sink=n_sink, n_local=n_local, moments_source=moments_source, tau=tau,
                              reference=reference, **sources, **inputs)
        times["moments_s"] += time.perf_counter() - t0
        times["prefill_s"] += prefill_s
        rows.append((ids, logits, prefill_s, att))
        caches.append(cache)

    if len(rows) == 1:
        (_, logits, _, attention), cache = rows[0], caches[0]
    else:  # one batch: left-padded rows, each attended by its own attention on its own part of the cache
        cache = KVCache.stack(caches, max_new_tokens)
        logits = torch.cat([r[1] for r in rows])  # (B, V)
        attention = BatchAttention([r[3] for r in rows], start=cache.start.tolist())
    del caches  # the stack holds the prompts now (the attentions keep moments, not caches)
    generator = torch.Generator(device).manual_seed(seed or 0)
    refusal = graph_refusal(cuda_graphs, device, [r[3] for r in rows], [len(r[0]) for r in rows], net)
    if compiled == "on":
        net.compile_pointwise()  # compiles at the first step, inside the decode time
    read_at, clock = step_clock()
    t0 = time.perf_counter()
    if refusal is None:  # the first step at each view includes its capture
        new = decode_static(net, cache, logits, max_new_tokens, [r[3] for r in rows], tok.eos_ids, temperature, top_k,
                            generator, progress, finished=clock, capture=device.type == "cuda")
    else:
        new = decode_batch(net, cache, logits, max_new_tokens, attention, tok.eos_ids, temperature, top_k, generator,
                           progress, finished=clock)
    end = time.perf_counter()
    times["decode_s"] = end - t0
    # the batch's decode steps, which the rows share: each row's first token came from its prefill's logits. The
    # first step is timed apart: on a GPU it compiles the kernels (and captures the first graph), seconds that a
    # longer generation spreads thinner; the speed is the steps' after it (or the first's, when it is the only one)
    steps = max(len(n) for n in new) - 1
    first_s = (read_at.get(2, end) - t0) if steps else None
    step_s = (end - read_at[2]) / (steps - 1) if steps > 1 else first_s

    reports = []
    for (name, _), (ids, _, prefill_s, att), out in zip(named, rows, new):
        stats = att.stats.summary(net.cfg.num_key_value_heads)
        reports.append({
            "prompt": name, "text": tok.decode(out), "method": method, "tau": att.tau,
            "tau_from": tau_from if att.tau is not None else None,
            "moments": moments_source if att.moments is not None else None,
            "calibration": sources["calibration"].settings["file"] if "calibration" in att.inputs else None,
            # the rest of what the path read, as numbers (window, budget, ...), and what decides the tokens besides:
            # two runs that differ only there are told apart by their records, not their outcomes alone
            "inputs": {name: value for name, value in att.inputs.items()
                       if name != "tau" and isinstance(value, (bool, int, float, str))},
            "static_labels": ({"file": static_labels, "sparsity": STATIC_SPARSITY if static_sparsity is None
                               else static_sparsity} if "static_local" in att.inputs else None),
            "sampling": {"temperature": temperature, "top_k": top_k, "seed": seed},
            # the prompt as the model saw it: a model without a chat template gets the raw text, chat or not
            "prompt_format": ("chat template" if chat and tok.has_chat_template else
                              "raw text (no chat template)" if chat else "raw text (--no-chat)"),
            "max_context": max_context, "rope_theta": rope_theta,
            "model": str(net.model_dir), "device": str(device), "dtype": dtype, "load_s": round(times["load_s"], 2),
            "moments_s": round(times["moments_s"], 2), "batch": len(rows), "prompt_tokens": len(ids),
            "prefill_s": round(prefill_s, 2), "batch_prefill_s": round(times["prefill_s"], 2),
            "decode_s": round(times["decode_s"], 2), "new_tokens": len(out),
            # per row (a step decodes every live row at once), over the decode steps after the first: None when
            # none ran
            "decode_tok_s": round(1 / step_s, 2) if step_s else None,
            "decode_ms_per_token": round(1000 * step_s, 1) if steps else None,
            "decode_first_step_ms": round(1000 * first_s, 1) if steps else None,
            "peak_memory_mb": round(peak_memory_mb(device)), "sparsity": stats["sparsity"], "kv_read": stats["kv_read"],
            "decode_steps": stats["steps"], "layer_sparsity": stats.get("layer_sparsity"), "new_token_ids": out,
            "cuda_graphs": "on: one graph per bucket of lengths" if refusal is None else f"off: {refusal}",
            "compiled": compiled == "on",
        })
    return reports


def run(prompt: str, model: str | None = None, **kwargs) -> dict:
    """One prompt file (see run_batch): its report as a dict."""
    return run_batch([prompt], model, **kwargs)[0]


def inputs_said(inputs: dict) -> str:
    """", NAME VALUE" for each input a path read as a number or a word (a page budget, the window), as the reports
    name them after the method: tau is said apart, and the paper's window goes unsaid."""
    return "".join(f", {name} {value}" for name, value in inputs.items()
                   if name != "tau" and isinstance(value, (bool, int, float, str)) and value != WINDOW.get(name))


def print_report(r: dict) -> None:
    if r["batch"] > 1:
        print(f"=== {r['prompt']} ({r['batch']} prompts decoded as one batch)")
    print(r["text"])
    print("-" * 72)
    sparsity = "n/a" if r["sparsity"] is None else f"{r['sparsity']:.3f}"
    kv = "n/a" if r["kv_read"] is None else f"{r['kv_read']:.3f}"
    print(f"method {r['method']}" + (f" at tau {r['tau']} ({r['tau_from']})" if r["tau"] is not None else "")
          + (f", {r['moments']} moments" if r["moments"] else "")
          + (f", calibration {Path(r['calibration']).name}" if r.get("calibration") else "")
          + (f", static labels {r['static_labels']['file']} at sparsity {r['static_labels']['sparsity']}"
             if r["static_labels"] else "")
          + inputs_said(r["inputs"])
          + f" | {r['device']} {r['dtype']}"
          # what else moves the tokens, where given (--json holds every setting, --max-context's too)
          + (f", RoPE theta {r['rope_theta']:g}" if r["rope_theta"] is not None else "")
          + (f", sampled at temperature {r['sampling']['temperature']:g}"
             + (f" top-k {r['sampling']['top_k']}" if r["sampling"]["top_k"] else "")
             + f" seed {r['sampling']['seed']}" if r["sampling"]["temperature"] else "")
          + f" | peak memory {r['peak_memory_mb']} MB")
    if r["decode_ms_per_token"] is None:  # one new token, from the prefill's logits
        speed = "no decode step"
    else:
        per_step = f", a step of all {r['batch']} rows" if r["batch"] > 1 else ""
        speed = "n/a" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}"
        speed = (f"{speed} tok/s ({r['decode_ms_per_token']:.0f} ms/token{per_step}; the first step "
                 f"{r['decode_first_step_ms']:.0f} ms)")
    new = f"{r['new_tokens']} new token" + "s" * (r["new_tokens"] != 1)
    fmt = " (raw text: the model has no chat template)" if r["prompt_format"] == "raw text (no chat template)" else ""
    print(f"prompt {r['prompt_tokens']} tokens{fmt} | {new}, {speed}")
    prefill = r["batch_prefill_s"] if r["batch"] > 1 else r["prefill_s"]
    total = r["load_s"] + r["moments_s"] + prefill + r["decode_s"]
    print(f"decode loop: CUDA graphs {r['cuda_graphs']}"
          + (" | norms, RoPE and MLP compiled (the first steps compile)" if r["compiled"] else ""))
    print(f"time {total:.1f} s: load {r['load_s']:.1f} s | reference moments {r['moments_s']:.1f} s | prefill "
          f"{prefill:.1f} s{' (all prompts)' if r['batch'] > 1 else ''} | decode {r['decode_s']:.1f} s")
    implied = " (what its choice implies; the oracle path itself reads every entry)" if r["method"] in ANALYSIS_ONLY \
        else ""
    if r["decode_steps"]:
        print(f"heads labelled local (sparsity) {sparsity} | KV entries read {kv}{implied}")
    else:
        print("no decode step ran for this prompt (its one token came from the prefill): no heads labelled")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", required=True, nargs="+", action="extend", metavar="FILE",
                   help="UTF-8 text file holding the prompt (the user turn when chatting; - reads standard input); "
                        "several files, or a .jsonl file of prompts (one JSON string or {\"prompt\": ...} per line, "
                        "other fields ignored: these flags set every row), decode as one batch with a report each")
    p.add_argument("--model", default=None, help=f"a named offline model ({', '.join(MODELS)}; default {DEFAULT}), "
                   "a Hugging Face model folder or a hub id")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default: %(default)s)")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="send the raw text, without the chat template")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="weights and KV cache dtype (default: %(default)s)")
    p.add_argument("--rope-theta", type=float, default=None, help="override the RoPE base (the paper uses 2e6 for 32k)")
    p.add_argument("--max-context", type=int, default=None, help="longest prompt + generation allowed (default: the "
                   "model's)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: 0; with --temperature)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (the default)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--method", default="qada", choices=list(PATHS), help="decode-time attention path (default: "
                   "%(default)s, the paper's; qada_cal is the recommended one, see README)")
    p.add_argument("--tau", type=float, default=None, help="local-mass threshold in (0, 1] of the paths that read one "
                   f"(default: the method's own: a calibrated path's stored operating point, else the paper's {TAU})")
    p.add_argument("--moments", dest="moments_source", default=None, choices=SOURCES,
                   help="the key moments of the paths that read them: random-words (Option 2, the paper's), prompt "
                        "(Option 1: the prompt's own, fixed after prefill), prompt-online (Option 1 updated every "
                        "step; ours), one-word, random-words-full (ablations); see moments.py (default: the ones a "
                        "calibrated path's correction was fitted with, else random-words)")
    p.add_argument("--n-sink", type=int, default=None, help="sink tokens at the start of the window (default: "
                   f"{WINDOW['n_sink']})")
    p.add_argument("--n-local", type=int, default=None, help="the window's size (the paper's T_local), sinks included "
                   f"(default: {WINDOW['n_local']})")
    p.add_argument("--static-labels", default=None, metavar="FILE_OR_DIR", help="oracle statistics for --method "
                   "static: a file, or a folder of python -m lab.calibrate (its ruler.json)")
    p.add_argument("--static-sparsity", type=float, default=None, help="fraction of heads made local by --method "
                   f"static (default: {STATIC_SPARSITY})")
    p.add_argument("--calibration", default=None, metavar="FILE_OR_DIR", help="QAdA's correction for the calibrated "
                   "paths (qada*_cal, qada_pages*): a file, or a folder of python -m lab.calibrate --qada (its "
                   "affine.json; sampled.json for the sampled paths); default: the one a named model ships with")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="an input the path reads by NAME that has no flag of its own: the page budget of quest, "
                        "qada_pages and page_oracle (budget=TOKENS or budget_frac=SHARE, no default), or a new path's "
                        "(repeatable)")
    p.add_argument("--kernel", default=None, choices=("auto", "triton", "torch"), help="the qada and page "
                   "paths' decode step: the fused Triton kernel (auto: on CUDA when triton is installed) or the torch "
                   "path; sets QADA_KERNEL (default: as set there, else auto)")
    p.add_argument("--cuda-graphs", default="auto", metavar="{auto,off}", help="auto: on CUDA, decode through CUDA "
                   "graphs (one step captured per bucket of lengths, replayed) for dense, the qada paths and the page "
                   "paths on the fused kernels; the report says when it is off and why (default: %(default)s)")
    p.add_argument("--compile", dest="compiled", default="off", metavar="{off,on}", help="on: torch.compile the "
                   "model's norms, RoPE and MLP for decoding, each one fused kernel where eager launches 2-8 (a "
                   "dense bf16 step: 16 launches per layer in place of 38); the first step compiles (seconds), and "
                   "the eager loop once more when a batch shrinks; needs a C++ compiler on the CPU (default: "
                   "%(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt, a line each, instead of "
                   "the text and report")
    p.error = lambda message: p.exit(2, f"error: {message} (see --help)\n")  # one line, not the usage block
    try:
        args = vars(p.parse_args(argv))
    except SystemExit as e:  # --help (0) or a bad argument (2, its line printed): main returns the status
        return e.code
    as_json = args.pop("json")
    kernel = args.pop("kernel")
    if kernel:
        os.environ["QADA_KERNEL"] = kernel  # read by decode_kernels.fused at every step
    try:
        decode_kernels.check_kernel("--kernel triton" if kernel else "QADA_KERNEL=triton")
        window = {name: args.pop(name) for name in ("n_sink", "n_local")}
        given = {name: n for name, n in window.items() if n is not None}  # the others: run_batch's, the paper's
        if given and "n_sink" not in path_inputs(args["method"]):  # dense: a window it would not use
            raise ValueError(f"--{next(iter(given)).replace('_', '-')}: the {args['method']} path has no window (it "
                             "reads every entry)")
        own = set(inspect.signature(run_batch).parameters) - {"inputs"}  # its flags', and prompts and progress
        inputs = parse_inputs(args.pop("set"), reserved=own | {"moments", "static_local", "reference"})
        reports = run_batch(args.pop("prompt"), **args, **given, **inputs,
                            progress=sys.stderr.isatty())  # bars on stderr: --json's stdout stays clean
    except (OSError, ValueError) as e:  # bad input: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    for r in reports:  # --json: one object per line (JSONL when several prompts)
        if as_json:
            print(json.dumps(r))
        else:
            print_report(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
