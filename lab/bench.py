"""Decode speed of QAdA against dense attention on this machine, and how close it comes to the ideal bound.

    python -m lab.bench                                  # both parts, the README's figures (2 CPU cores)
    python -m lab.bench --parts attention --quick        # a smoke run
    python -m lab.bench --parts e2e --e2e-methods qada@0.2,qada_kv@0.6 --dtype bfloat16   # the KV-group paths too
    python -m lab.bench --parts e2e --e2e-methods qada_pages@0.6:1024,quest:1024 --dtype bfloat16   # page paths
    python -m lab.bench --device cuda                    # on a GPU: synchronised timings, GPU time in profiles

The report states device, dtype, threads and the load average. Methods are timed interleaved (A, B, A, B, ...
with the order rotated every repeat) so that other load on the machine hits both alike, and every figure is a
median over repeats.

Part 1, attention only (paper section 3, Listing 1), fp32, one decode step of one prompt. Attention over
synthetic KV caches of T tokens, for three model shapes: SmolLM2-135M (H 9 query heads, Hkv 3 KV heads, D 64),
Qwen2.5-Coder-1.5B (H 12, Hkv 2, D 128) and Llama-3-8B (H 32, Hkv 8, D 128). What real decoding sees is a cold
cache: between two attention layers the model reads a layer of weights, between two steps all of them. So one
timed step runs a stack of L layers, each with its own cache laid out as model.KVCache lays it out (a
(Hkv, T + 1, D) buffer sliced to T), and the CPU caches are flushed (a 256 MB read) before every timed stack.
Timed per stack, reported per layer:
  dense      torch SDPA with enable_gqa over every layer's whole cache (`sdpa_gqa`);
  qada       attention.qada exactly as the model calls it: window attention (read in place from the cache),
             the Gaussian criterion (qada_labels) and full attention for the heads it labels long-context;
  criterion  qada's work before the full heads (window attention and its log mass, the Gaussian term, labels):
             the price of deciding, reported as a fraction of packed dense (below);
  packed     attention.dense, the project's dense path, as qada's full heads compute it (full_attention on every
             KV head: SDPA with a group's query heads as query positions, reading each KV head once where SDPA's
             enable_gqa reads it once per query head). A stronger baseline, reported beside the first.
The label pattern comes from the moments, so that the real criterion produces it: q and the keys are
random normal, the covariances random positive definite, and for each (layer, KV head) the bulk-key mean
points along the group's queries (a huge estimated bulk mass: long-context) or against them (local). The
labels are checked before timing. The KV-read fraction f of a stack is the share of its (layer, KV head)
pairs that read their whole cache; the others read only their n_local = 128 window entries. Reading the
cache is the cost of decode attention, so the ideal speedup over dense is 1 / (f + (1 - f) * 128 / T); the
"% of bound" column is the share of it reached (above 100% where qada's full heads read the cache more
efficiently than dense SDPA does). f = 1 shows the qada path at no saving.
Stacks: 20 layers for SmolLM2's shapes (60 KV heads), 10 for Qwen2.5-Coder-1.5B's (20), 5 for Llama-3-8B's (40),
so that f = 0.5 and 0.15 are met exactly. A per-stage and per-op profile of qada at f = 0.15 is written beside
the table.

Part 2, end to end (--model, default the project's default model; --dtype). Greedy decoding of needle-in-a-
haystack prompts sized to each length with the tokenizer (noise lines, one "special magic number" line at half
depth, the question, the chat template), a different needle per prompt. Each prompt is prefilled alone, once
(dense, reported separately); batch B decodes the first B prompts side by side in one left-padded cache
(model.KVCache.stack, attention.BatchAttention). Compared per (length, batch): packed dense (the model's own
decode, the best dense here), the all-local window (the floor: no long-context head at all) and each sparse
path of --e2e-methods (PATH@TAU, a page path PATH:BUDGET or PATH@TAU:BUDGET; random-words moments, sink 16,
window 128). Each first writes its greedy answers (32 tokens, untimed) to count the needles found; then they are
timed in interleaved rounds, every run rolling the cache back to the prompts and decoding the same 8 tokens per
row; ms per step (one token of every row) is the median over the rounds. Sparsity and KV-read fraction are the
method's over those tokens, averaged over rows (a page path's read counts its pages and the page bounds scored).
The bound is the speedup if the full heads cost their KV-read share of dense attention and deciding were free:
dense / (window-only + KV read * (dense - window-only)), from the measured non-attention time (the window-only run)
and the measured KV read. Lengths above the model's context use a RoPE theta override (--rope-theta) and moments
from a random-words prompt of that length (computed once, then cached in ~/.cache/qada/moments).

Outputs in --out (default: a new folder runs/bench/<time>, so that no run overwrites another's; results/bench/
holds the committed ones): per part its table (attention.md, end_to_end.md), where the time goes
(attention_profile.md, end_to_end_profile.md) and its rows (attention.json, end_to_end.json); speedup.png draws
every part in the folder, so the two parts may run apart into one --out.
"""

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import random
import statistics
import sys
import textwrap
import time
from pathlib import Path

import torch

import attention
import decode_kernels
from attention import BatchAttention, build_attention
from criterion import TAU, check_calibration, load_calibration, qada_labels, weights_probe
from generate import pick_device
from lab.calibrate import calibration_file
from lab.cli import (Parser, at_least, fail, fresh_folder, ints, make_folder, note_replaced, positive_float,
                     thread_count)
from model import KVCache, LlamaConfig
from moments import FixedMoments, ReferenceKeys
from weights.checkpoints import DEFAULT, DTYPES, load, resolve, shipped_calibration
from weights.downloads import cache_dir

N_SINK, N_LOCAL = 16, 128
SHAPES = {  # name: H, Hkv, D, and L, the layers in one timed stack
    "SmolLM2-135M": dict(H=9, Hkv=3, D=64, L=20),
    "Qwen2.5-Coder-1.5B": dict(H=12, Hkv=2, D=128, L=10),
    "Llama-3-8B": dict(H=32, Hkv=8, D=128, L=5),
}
FRACTIONS = (1.0, 0.5, 0.15, 0.0)
FLUSH_MB = 256
NEEDLE_TOKENS = 32  # the untimed greedy answer checked for the needle; the answer takes about 24
HAYSTACK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def ideal_speedup(f: float, T: int, n_local: int = N_LOCAL) -> float:
    """Dense reads T entries per KV head; a sparse step reads T for a fraction f of them, n_local for the rest."""
    return 1.0 / (f + (1 - f) * min(n_local, T) / T)


# ---------------------------------------------------------------------------------------------------------
# Timing


class Timer:
    """Interleaved timing of several callables, with the CPU caches flushed before each call."""

    def __init__(self, device: torch.device, flush: bool = True):
        self.device = device
        self.flush_buf = torch.ones(FLUSH_MB << 18, device=device) if flush else None  # FLUSH_MB of fp32

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def once(self, fn) -> float:
        if self.flush_buf is not None:
            self.flush_buf.sum()  # evicts the last call's data from the caches
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def interleaved(self, fns: dict, repeats: int) -> dict:
        """Median seconds of each fn, over `repeats` rounds that run them all, in an order rotated each round."""
        names = list(fns)
        for name in names:  # warm-up: first-call allocations, lazy initialisations
            fns[name]()
        times = {name: [] for name in names}
        for r in range(repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(self.once(fns[name]))
        return {name: statistics.median(ts) for name, ts in times.items()}


# ---------------------------------------------------------------------------------------------------------
# Part 1: attention only


def full_pattern(L: int, Hkv: int, f: float) -> torch.Tensor:
    """(L, Hkv) bool, True where the KV head reads its whole cache: round(f * L * Hkv) pairs, evenly spread."""
    n, n_full = L * Hkv, round(f * L * Hkv)
    full = torch.zeros(n, dtype=torch.bool)
    full[[int((i + 0.5) * n / n_full) for i in range(n_full)]] = True
    return full.view(L, Hkv)


def pattern_moments(direction: torch.Tensor, cov: torch.Tensor, full: torch.Tensor, n_bulk: int) -> FixedMoments:
    """Moments under which qada labels a KV group long-context exactly where full (..., Hkv) is True: a bulk mean of
    +-100 along the group's query direction (..., Hkv, D) puts the estimated bulk mass e^50 or so above or below the
    window's, whatever the keys."""
    sign = full.to(direction.device).float() * 2 - 1
    return FixedMoments(100.0 * sign[..., None] * direction, cov, n_bulk)


class Stack:
    """L layers of synthetic decode state at context T: q, a KV cache, and moments giving each label pattern."""

    def __init__(self, H: int, Hkv: int, D: int, L: int, T: int, device: torch.device, seed: int = 0):
        torch.manual_seed(seed)
        cfg = LlamaConfig(hidden_size=H * D, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=Hkv,
                          head_dim=D)
        cache = KVCache(cfg, T + 1, device=device)  # room for the step's own token, as in decoding
        cache.k.normal_(), cache.v.normal_()
        cache.length = T
        self.kv = [(cache.k[i, 0, :, :T], cache.v[i, 0, :, :T]) for i in range(L)]  # views (Hkv, T, D)
        self.q = torch.randn(L, H, D, device=device)
        a = torch.randn(L, Hkv, D, D, device=device) * 0.3 / math.sqrt(D)
        self.cov = a @ a.transpose(-1, -2) + 0.01 * torch.eye(D, device=device)  # (L, Hkv, D, D)
        qg = self.q.view(L, Hkv, H // Hkv, D).sum(2)  # (L, Hkv, D): the direction of each group's queries
        self.direction = qg / qg.norm(dim=-1, keepdim=True)
        self.H, self.Hkv, self.D, self.L, self.T = H, Hkv, D, L, T

    def moments(self, full: torch.Tensor) -> FixedMoments:
        """Moments under which qada labels a group long-context exactly where full (L, Hkv) is True."""
        return pattern_moments(self.direction, self.cov, full, self.T - N_LOCAL)

    def run(self, method: str, moments=None):
        """Every layer through the path registered as `method` (attention.PATHS), given what it reads; or through a
        function of q, k, v alone (a dense baseline outside the registry)."""
        if callable(method):
            return [method(self.q[i], *self.kv[i])[0] for i in range(self.L)]
        names = attention.path_inputs(method)
        given = dict(n_sink=N_SINK, n_local=N_LOCAL, tau=TAU, moments=moments)
        kw = {n: given[n] for n in names if n != "layer"}
        if "layer" in names:
            return [attention.run_path(method, self.q[i], *self.kv[i], layer=i, **kw)[0] for i in range(self.L)]
        return [attention.run_path(method, self.q[i], *self.kv[i], **kw)[0] for i in range(self.L)]

    def criterion(self, moments):
        """What qada does before its full heads: window attention and its log mass, the Gaussian term, labels."""
        out = []
        for i, (k, v) in enumerate(self.kv):
            y_window, log_local = attention.window_attention(self.q[i], k, v, N_SINK, N_LOCAL)
            out.append(qada_labels(self.q[i], log_local, moments.quadratic_form(i, k), self.T - N_LOCAL, TAU))
        return out

    def check(self, full: torch.Tensor, moments) -> None:
        """The criterion labels exactly the pattern; with every head long, qada equals dense."""
        G = self.H // self.Hkv
        labels = torch.stack(self.criterion(moments)).cpu()  # (L, H)
        if not torch.equal(labels, ~full.repeat_interleave(G, 1).cpu()):
            raise RuntimeError("the synthetic moments did not produce the intended label pattern")
        if full.all():
            for a, b in zip(self.run("qada", moments), self.run("dense")):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def sdpa_gqa(q, k, v):
    """Dense attention as SDPA's enable_gqa computes it: each KV head read once per query head (on the CPU)."""
    y = torch.nn.functional.scaled_dot_product_attention(q[None, :, None], k[None], v[None], enable_gqa=True)
    return y[0, :, 0], None


@contextlib.contextmanager
def qada_kernel(choice: str):
    """The qada paths called inside take `choice` (decode_kernels.fused: "torch" or "triton"); restored on the way
    out."""
    old = os.environ.get("QADA_KERNEL")
    os.environ["QADA_KERNEL"] = choice
    try:
        yield
    finally:
        os.environ.pop("QADA_KERNEL") if old is None else os.environ.update(QADA_KERNEL=old)


def with_kernel(choice: str, fn):
    """fn run with the qada paths on `choice`."""
    def run():
        with qada_kernel(choice):
            return fn()
    return run


def bench_attention(lengths, repeats: int, device: torch.device, timer: Timer) -> list[dict]:
    """qada on the torch path, and on CUDA with triton also the fused kernel (column fused), against dense."""
    rows = []
    kernel = device.type == "cuda" and decode_kernels.triton is not None
    for shape, dims in SHAPES.items():
        for T in lengths:
            stack = Stack(**dims, T=T, device=device)
            fns = {"dense": lambda: stack.run(sdpa_gqa), "packed": lambda: stack.run("dense")}
            patterns = {f: full_pattern(stack.L, stack.Hkv, f) for f in FRACTIONS}
            moments = {f: stack.moments(p) for f, p in patterns.items()}
            for f in FRACTIONS:
                stack.check(patterns[f], moments[f])
                fns[f] = with_kernel("torch", lambda m=moments[f]: stack.run("qada", m))
                if kernel:
                    fns[f"fused {f}"] = with_kernel("triton", lambda m=moments[f]: stack.run("qada", m))
            fns["criterion"] = lambda: stack.criterion(moments[0.15])
            t = timer.interleaved(fns, repeats)
            for f in FRACTIONS:
                f_got = float(patterns[f].float().mean())
                speedup, ideal = t["dense"] / t[f], ideal_speedup(f_got, T)
                rows.append(dict(shape=shape, T=T, f=f_got, dense_ms=1e3 * t["dense"] / stack.L,
                                 qada_ms=1e3 * t[f] / stack.L, speedup=speedup, ideal=ideal,
                                 of_bound=speedup / ideal, criterion=t["criterion"] / t["packed"],
                                 packed_ms=1e3 * t["packed"] / stack.L, speedup_packed=t["packed"] / t[f],
                                 of_bound_packed=t["packed"] / t[f] / ideal,
                                 # None (null in the JSON, "–" in the table): no fused kernel timed off CUDA
                                 fused_ms=1e3 * t[f"fused {f}"] / stack.L if kernel else None,
                                 fused_of_bound=t["packed"] / t[f"fused {f}"] / ideal if kernel else None))
                print(format_row(ATTENTION_COLUMNS, rows[-1]), flush=True)
            del stack, fns
    return rows


def compiled_decision(T: int):
    """qada's decision (window_attention, then qada_labels) through torch.compile at a fixed context T. An upper bound
    on what compiling buys: decoding changes T every step (dynamic shapes or a recompile), and the labels' host sync
    before the full heads ends the graph in any case."""
    def decide(q, k, v, A, b):
        y_window, log_local = attention.window_attention(q, k, v, N_SINK, N_LOCAL)
        return y_window, qada_labels(q, log_local, (A, b), T - N_LOCAL, TAU)
    return torch.compile(decide, dynamic=False, fullgraph=True)


def profile_qada(T: int, repeats: int, device: torch.device, timer: Timer, f: float = 0.15,
                 compile_decision: bool = False) -> str:
    """Markdown: qada's stages timed apart (cold caches, like the main table), then torch.profiler's ops. With
    `compile_decision`, the decision under torch.compile beside the eager one."""
    from torch.profiler import profile
    out = []
    for shape, dims in SHAPES.items():
        stack = Stack(**dims, T=T, device=device)
        full = full_pattern(stack.L, stack.Hkv, f)
        moments = stack.moments(full)
        G = stack.H // stack.Hkv
        local = (~full).repeat_interleave(G, 1).to(device)  # (L, H)
        pre = []  # inputs of each stage, computed once
        for i, (k, v) in enumerate(stack.kv):
            y_window, log_local = attention.window_attention(stack.q[i], k, v, N_SINK, N_LOCAL)
            pre.append((y_window, log_local, moments.quadratic_form(i, k)))

        def stage(fn):
            return lambda: [fn(i, *stack.kv[i], *pre[i]) for i in range(stack.L)]

        q = stack.q
        stages = {
            "window attention and its log mass (window_attention)": stage(
                lambda i, k, v, *_: attention.window_attention(q[i], k, v, N_SINK, N_LOCAL)),
            "Gaussian term + labels (qada_labels)": stage(
                lambda i, k, v, yw, log_local, form: qada_labels(q[i], log_local, form, T - N_LOCAL, TAU)),
            "deciding, eager (both above)": stage(lambda i, k, v, yw, log_local, form: qada_labels(
                q[i], attention.window_attention(q[i], k, v, N_SINK, N_LOCAL)[1], form, T - N_LOCAL, TAU)),
            "full heads (mixed_attention)": stage(lambda i, k, v, yw, *_: attention.mixed_attention(
                q[i], k, v, local[i], N_SINK, N_LOCAL, yw)),
            "qada, whole": lambda: stack.run("qada", moments),
            "packed dense": lambda: stack.run("dense"),
        }
        if compile_decision:
            decide = compiled_decision(T)
            for i, (k, v) in enumerate(stack.kv):  # compiles once (every layer has the same shapes), checked
                y_window, labels = decide(q[i], k, v, *pre[i][2])
                torch.testing.assert_close(y_window, pre[i][0], rtol=1e-4, atol=1e-5)
                assert torch.equal(labels, qada_labels(q[i], pre[i][1], pre[i][2], T - N_LOCAL, TAU))
            stages["deciding, torch.compile (fixed T)"] = stage(lambda i, k, v, yw, log_local, form:
                                                                decide(q[i], k, v, *form))
        t = timer.interleaved(stages, repeats)
        ideal_full = t["packed dense"] * f  # the full heads' share of the dense read
        out += [f"### {shape} shapes, T = {T}, f = {f}: qada's stages (us per layer, cold caches)", "",
                "| stage | us / layer | % of packed dense |", "|---|---:|---:|"]
        for name, s in t.items():
            out.append(f"| {name} | {1e6 * s / stack.L:.0f} | {100 * s / t['packed dense']:.1f} |")
        out.append(f"| *f x packed dense: the full heads' ideal cost* | {1e6 * ideal_full / stack.L:.0f} | "
                   f"{100 * f:.1f} |")
        with profile() as prof:
            for _ in range(3):
                stack.run("qada", moments)
        out += ["", "torch.profiler, the qada stack run 3 times (profiler overhead included), per layer:", ""]
        out += top_ops(prof, device, 3 * stack.L, "layer", 12, scale=1.0, unit="us")
        out.append("")
        del stack, stages, pre
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# Part 2: end to end


def needle_prompt(tok, n_tokens: int, seed: int = 0) -> tuple[list[int], str]:
    """Chat-template ids of a needle-in-a-haystack prompt of at most n_tokens (as close as whole lines allow), and
    the needle's value."""
    rng = random.Random(seed)
    key = (f"{rng.choice(['quiet', 'amber', 'rapid', 'hollow', 'gentle'])}-"
           f"{rng.choice(['harbor', 'falcon', 'meadow', 'lantern'])}")
    value = str(rng.randrange(1_000_000, 10_000_000))
    needle = f"One of the special magic numbers for {key} is: {value}."

    def ids(n_lines: int) -> list[int]:
        lines = [HAYSTACK] * n_lines
        lines.insert(n_lines // 2, needle)
        text = ("A special magic number is hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the number afterwards.\n" + "\n".join(lines)
                + f"\nWhat is the special magic number for {key} mentioned in the provided text?")
        if not tok.has_chat_template:  # a base model: the raw text
            return tok.encode(text, add_special_tokens=True)
        return tok.encode_chat([{"role": "user", "content": text}])

    per_line = (len(ids(101)) - len(ids(1))) / 100
    n_lines = max(1, int((n_tokens - len(ids(1))) / per_line) + 1)
    while len(out := ids(n_lines)) > n_tokens and n_lines > 1:
        n_lines -= 1
    return out, value


def decode_timed(model, cache, n_prompt: int, logits, n_new: int, attn) -> tuple[float, list[list[int]]]:
    """Roll the cache back to the prompt(s) and decode n_new greedy tokens for every row (EOS not checked, so
    every run does the same work); seconds per decode step and each row's tokens. The cache is left rolled back
    too: a batch-1 cache is later stacked into the larger batches, which must not see this run's tokens."""
    cache.length = n_prompt
    token, outs = logits.argmax(-1), [[] for _ in range(logits.shape[0])]  # (B,)
    sync = (lambda: torch.cuda.synchronize(model.device)) if model.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(n_new):
        for out, t in zip(outs, token.tolist()):
            out.append(t)
        token = model.decode_step(token, cache, attn).argmax(-1)
    sync()
    seconds = (time.perf_counter() - t0) / n_new
    cache.length = n_prompt
    return seconds, outs


def parse_methods(text: str) -> list[tuple[str, str, dict]]:
    """"qada@0.6,qada_pages@0.6:1024,quest:1024,quest_frac:0.05" -> [(label, path, inputs), ...]: the sparse paths
    timed end to end, each PATH@TAU for a path that reads tau, PATH:BUDGET for a page path (tokens beyond the
    window, or for a *_frac path a fraction of T), both for a path that reads both."""
    out = []
    for item in text.split(","):
        label = item.strip()
        rest, _, budget = label.partition(":")
        name, _, tau = rest.partition("@")
        reads = attention.path_inputs(name) if name in attention.PATHS else ()
        unit = next((b for b in ("budget", "budget_frac") if b in reads), None)
        if (not ("tau" in reads or unit) or bool(tau) != ("tau" in reads) or bool(budget) != bool(unit)
                or "page_oracle" in name):  # the page oracle reads every score: analysis only, nothing to time
            raise ValueError(f"--e2e-methods takes PATH@TAU items of a path that reads tau, PATH:BUDGET of a page "
                             f"path, PATH@TAU:BUDGET of one that reads both; got {item!r}")
        inputs = {}
        if tau:
            try:
                inputs["tau"] = float(tau)
            except ValueError:
                inputs["tau"] = math.nan
            if not 0 < inputs["tau"] <= 1:  # NaN fails too; a tau of 0 would fail only after the dense timing
                raise ValueError(f"--e2e-methods {item!r}: TAU takes a number in (0, 1]")
        if unit == "budget":
            P = attention.page_size(name)
            if not budget.isdigit() or int(budget) < P:  # budget // P pages: below one page it times the window alone
                raise ValueError(f"--e2e-methods {item!r}: BUDGET takes a whole number of tokens, at least one page "
                                 f"({P})")
            inputs["budget"] = int(budget)
        elif unit:
            try:
                inputs["budget_frac"] = float(budget)
            except ValueError:
                inputs["budget_frac"] = math.nan
            if not 0 < inputs["budget_frac"] <= 1:
                raise ValueError(f"--e2e-methods {item!r}: BUDGET of a *_frac path takes a fraction of T in (0, 1]")
        out.append((label, name, inputs))
    return out


def prefill_file(model, ids: list[int], folder: Path) -> Path:
    """Where `prefilled` keeps the prompt `ids`' KV cache in `folder`: keyed by the model, its dtype, device type and
    RoPE base, and the ids."""
    key = json.dumps([str(model.model_dir), str(model.dtype), model.device.type, model.cfg.rope_theta, ids])
    return Path(folder) / f"{hashlib.sha1(key.encode()).hexdigest()[:20]}.pt"


def prefilled(model, ids: list[int], extra: int, folder: Path | None) -> tuple[KVCache, torch.Tensor, float]:
    """A batch-1 cache of the prompt `ids` with room for `extra` more positions, the prefill's last logits (1, V)
    and its seconds. With a `folder`, the filled keys and values are kept there on disk (`prefill_file`) and read
    back instead of prefilled again (a 32k prefill takes minutes on a CPU; the seconds reported are those of the
    prefill that made the file)."""
    path = prefill_file(model, ids, folder) if folder is not None else None
    cache = model.new_cache(len(ids) + extra)
    if path is not None and path.is_file():
        saved = torch.load(path, map_location=cache.k.device, weights_only=True)
        cache.k[:, :, :, :len(ids)], cache.v[:, :, :, :len(ids)] = saved["k"], saved["v"]  # (L, 1, Hkv, n, D)
        cache.length = len(ids)
        return cache, saved["first"], saved["seconds"]
    t0 = time.perf_counter()
    first = model.prefill(torch.tensor([ids], device=model.device), cache)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    seconds = time.perf_counter() - t0
    if path is not None:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        torch.save({"k": cache.k[:, :, :, :len(ids)].clone(), "v": cache.v[:, :, :, :len(ids)].clone(), "first": first,
                    "seconds": seconds}, tmp)
        os.replace(tmp, path)
    return cache, first, seconds


def bench_end_to_end(model_name: str, lengths, batches, methods, repeats: int, n_new: int, device: torch.device,
                     dtype: torch.dtype, rope_theta: float, profile_at: int | None = None,
                     calibration: str | None = None, prefill_cache: Path | None = None,
                     prefill_only: bool = False) -> tuple[list[dict], str]:
    """One row per (length, batch, sparse method): ms per decode step of the method, of packed dense (the model's
    own decode, the best dense we have) and of the window only, in interleaved rounds; the bound from the measured
    non-attention time (the window-only run) and the method's measured KV-read fraction. A method that reads a
    calibration (qada_cal, ...) reads `calibration` (default: the one the model ships); prompts are prefilled through
    `prefill_cache` (`prefilled`); `prefill_only` fills that cache and the reference keys, and times nothing (the
    prefills may then run beside other work, the timed run alone later)."""
    rows, models, profile = [], {}, ""
    correction = None
    if any("calibration" in attention.path_inputs(m) for _, m, _ in methods):
        calibration = calibration or shipped_calibration(model_name)
        if calibration is None:
            raise ValueError(f"{model_name} ships no calibration: give --calibration FILE for the qada_cal methods")
        correction = load_calibration(calibration, device)
        estimates = {attention.bulk_estimate(m) for _, m, _ in methods if "calibration" in attention.path_inputs(m)}
        if len(estimates) > 1:
            raise ValueError("one calibration file corrects one estimate: bench the sampled and the Gaussian "
                             "calibrated methods apart")
        estimate = estimates.pop()

    def model_for(theta):
        if theta not in models:
            models[theta] = load(model_name, device, dtype, rope_theta=theta)
        return models[theta]

    for T in lengths:
        model, tok = model_for(None)
        if T > model.cfg.max_position_embeddings:
            model, tok = model_for(rope_theta)
        if correction is not None:
            cfg = model.cfg
            check_calibration(correction, calibration, cfg.num_hidden_layers, cfg.num_attention_heads,
                              cfg.num_key_value_heads, N_SINK, N_LOCAL, "random-words", estimate, weights_probe(model))
        reference = ReferenceKeys(model, tok, n_max=max(T, model.cfg.max_position_embeddings),
                                  root=cache_dir() / "moments")
        prompts = [needle_prompt(tok, T - NEEDLE_TOKENS, seed=b) for b in range(max(batches))]  # different needles
        if prefill_only:  # the files and the reference keys only: no cache held, none read back
            for ids, _ in prompts:
                if not prefill_file(model, ids, prefill_cache).is_file():
                    prefilled(model, ids, NEEDLE_TOKENS + 1, prefill_cache)
            reference.for_prompt(max(len(ids) for ids, _ in prompts), N_SINK, N_LOCAL)
            continue
        caches, firsts, prefill_s = [], [], []
        for ids, _ in prompts:  # each prompt prefilled alone, once; batch B takes the first B
            cache, first, seconds = prefilled(model, ids, NEEDLE_TOKENS + 1, prefill_cache)
            caches.append(cache)
            firsts.append(first)
            prefill_s.append(seconds)
        for B in batches:
            if B == 1:
                cache = caches[0]
            else:  # left-padded rows; the batch-1 caches stay as they are (the stack copies them)
                cache = KVCache.stack(caches[:B], NEEDLE_TOKENS + 1)
            logits, n = torch.cat(firsts[:B]), cache.length

            def build(method, inputs):  # through the one builder, one attention per prompt on its own cache
                atts = [build_attention(method, c, reference=reference, n_sink=N_SINK, n_local=N_LOCAL,
                                        calibration=correction, **inputs) for c in caches[:B]]
                return atts[0] if B == 1 else BatchAttention(atts, start=cache.start.tolist())

            make = {"dense": lambda: None, "local": lambda: build("local", {})}  # None: the model's packed dense
            make |= {label: (lambda m=m, inputs=inputs: build(m, inputs)) for label, m, inputs in methods}
            # The answers, untimed (and a warm-up): how many rows still find their needle?
            found = {}
            for name in make:
                outs = decode_timed(model, cache, n, logits, NEEDLE_TOKENS, make[name]())[1]
                found[name] = sum(value in tok.decode(o) for o, (_, value) in zip(outs, prompts))
            times, stats = {name: [] for name in make}, {}
            for r in range(repeats):  # short runs, interleaved, so that load bursts hit every method alike
                for name in list(make)[r % len(make):] + list(make)[:r % len(make)]:
                    attn = make[name]()
                    times[name].append(decode_timed(model, cache, n, logits, n_new, attn)[0])
                    if name not in ("dense", "local") and name not in stats:  # greedy: every run decodes alike
                        per_row = [a.stats.summary(model.cfg.num_key_value_heads)
                                   for a in getattr(attn, "rows", [attn])]
                        stats[name] = (statistics.mean(x["sparsity"] for x in per_row),
                                       statistics.mean(x["kv_read"] for x in per_row))
            ms = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
            for name, _, _ in methods:
                sparsity, kv_read = stats[name]
                # If the full heads cost exactly their share of dense attention and deciding were free:
                bound = ms["dense"] / (ms["local"] + kv_read * (ms["dense"] - ms["local"]))
                rows.append(dict(T=n, batch=B, theta=f"{model.cfg.rope_theta:g}", prefill_s=sum(prefill_s[:B]),
                                 method=name, dense_ms=ms["dense"], local_ms=ms["local"], ms=ms[name],
                                 speedup=ms["dense"] / ms[name], bound=bound, of_bound=ms["dense"] / ms[name] / bound,
                                 sparsity=sparsity, kv_read=kv_read, needle=f"{found['dense']}/{B}, {found[name]}/{B}"))
                print(format_row(E2E_COLUMNS, rows[-1]), flush=True)
            if T == profile_at and B == 1:
                profile = profile_decode(model, cache, n, logits, make, model_name)
            del cache
        del caches
    return rows, profile


def self_time(event, device: torch.device) -> float:
    """An op's own time in us: on the GPU where it runs there, else on the CPU."""
    return event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total


def top_ops(prof, device: torch.device, n: int, per: str, rows: int, scale: float, unit: str) -> list[str]:
    """Markdown rows of the profiler's heaviest ops by self time, per `per` (n of them were profiled)."""
    ops = sorted(prof.key_averages(), key=lambda e: -self_time(e, device))[:rows]
    return ([f"| op | calls / {per} | self {unit} / {per} |", "|---|---:|---:|"]
            + [f"| {e.key} | {e.count / n:.1f} | {self_time(e, device) * scale / n:.2f} |" for e in ops])


def profile_decode(model, cache, n_prompt: int, logits, make: dict, model_name: str, steps: int = 8) -> str:
    """Markdown: torch.profiler's heaviest ops of a decode step, per method (self time per token)."""
    from torch.profiler import profile
    out = [f"### End to end, {model_name}, prompt of {n_prompt} tokens: the heaviest ops of a decode step", ""]
    for name, new in make.items():
        with profile() as prof:
            s, _ = decode_timed(model, cache, n_prompt, logits, steps, new())
        total = sum(self_time(e, model.device) for e in prof.key_averages()) / steps
        out += [f"{name}: {1e3 * s:.1f} ms per token under the profiler, {total / 1e3:.1f} ms of op self time", ""]
        out += top_ops(prof, model.device, steps, "token", 8, scale=1e-3, unit="ms") + [""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# Report

ATTENTION_COLUMNS = [("shape", "shapes", "{}"), ("T", "T", "{}"), ("f", "f (KV read)", "{:.2f}"),
                     ("dense_ms", "dense ms", "{:.3f}"), ("packed_ms", "packed dense ms", "{:.3f}"),
                     ("qada_ms", "qada ms", "{:.3f}"), ("speedup", "speedup", "{:.2f}x"), ("ideal", "ideal", "{:.2f}x"),
                     ("of_bound", "% of bound", "{:.0%}"), ("speedup_packed", "speedup vs packed", "{:.2f}x"),
                     ("of_bound_packed", "% of bound vs packed", "{:.0%}"),
                     ("criterion", "criterion / packed", "{:.1%}"), ("fused_ms", "fused kernel ms", "{:.3f}"),
                     ("fused_of_bound", "fused % of bound vs packed", "{:.0%}")]
E2E_COLUMNS = [("T", "prompt tokens", "{}"), ("batch", "batch", "{}"), ("theta", "RoPE theta", "{}"),
               ("prefill_s", "prefill s", "{:.1f}"), ("method", "method", "{}"),
               ("dense_ms", "packed dense ms/step", "{:.1f}"), ("local_ms", "window-only ms/step", "{:.1f}"),
               ("ms", "method ms/step", "{:.1f}"), ("speedup", "speedup", "{:.2f}x"), ("bound", "bound", "{:.2f}x"),
               ("of_bound", "% of bound", "{:.0%}"), ("sparsity", "sparsity", "{:.2f}"),
               ("kv_read", "KV read", "{:.2f}"), ("needle", "needles found dense, method", "{}")]


def format_row(columns, row) -> str:
    return "| " + " | ".join("–" if row[key] is None else fmt.format(row[key]) for key, _, fmt in columns) + " |"


def table(columns, rows) -> str:
    head = "| " + " | ".join(title for _, title, _ in columns) + " |"
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"
    return "\n".join([head, rule] + [format_row(columns, r) for r in rows])


def plot(att_rows, e2e_rows, path: Path, setup: str, e2e_model: str = "") -> None:
    """Speedup vs context length: measured (solid) beside the ideal bound (dashed), one panel per part."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    panels = [s for s in SHAPES if any(r["shape"] == s for r in att_rows)] + (["e2e"] if e2e_rows else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(max(6.5, 5 * len(panels)), 4.6), squeeze=False)
    colors = dict(zip(FRACTIONS, ["tab:gray", "tab:blue", "tab:red", "tab:green"]))
    for ax, panel in zip(axes[0], panels):
        if panel == "e2e":
            cmap = plt.get_cmap("tab10")
            for i, key in enumerate(dict.fromkeys((r["method"], r["batch"]) for r in e2e_rows)):
                rs = [r for r in e2e_rows if (r["method"], r["batch"]) == key]
                Ts = [r["T"] for r in rs]
                ax.plot(Ts, [r["speedup"] for r in rs], "o-", color=cmap(i), label=f"{key[0]}, batch {key[1]}")
                ax.plot(Ts, [r["bound"] for r in rs], "o--", color=cmap(i), mfc="none", alpha=0.8)
                for r in rs:
                    ax.annotate(f"f={r['kv_read']:.2f}", (r["T"], r["speedup"]), textcoords="offset points",
                                xytext=(0, 7), ha="center", fontsize=7, color=cmap(i))
            ax.set_title(f"End to end: {e2e_model} decode\n(dashed: bound at the measured KV read)", fontsize=9)
            ax.legend(fontsize=8, loc="best")
        else:
            rows = [r for r in att_rows if r["shape"] == panel]
            Ts = sorted({r["T"] for r in rows})
            for f in FRACTIONS:
                fr = [r for r in rows if abs(r["f"] - f) < 0.02]
                ax.plot([r["T"] for r in fr], [r["speedup"] for r in fr], "o-", color=colors[f])
                ax.plot([r["T"] for r in fr], [r["ideal"] for r in fr], "--", color=colors[f], alpha=0.8)
                if f == 0.15:
                    ax.plot([r["T"] for r in fr], [r["speedup_packed"] for r in fr], "^-.", color=colors[f], mfc="none")
            ax.set_yscale("log")
            ax.set_title(f"Attention only: {panel} shapes")
            handles = [Line2D([], [], color=colors[f], marker="o", label=f"f = {f:g}") for f in FRACTIONS]
            handles += [Line2D([], [], color="k", ls="-", label="measured"),
                        Line2D([], [], color="k", ls="--", label="ideal bound"),
                        Line2D([], [], color=colors[0.15], ls="-.", marker="^", mfc="none",
                               label="f = 0.15 vs packed dense")]
            ax.legend(handles=handles, fontsize=8, loc="upper left")
        Ts = sorted({r["T"] for r in (e2e_rows if panel == "e2e" else att_rows)})
        ax.set_xscale("log", base=2)
        ax.set_xticks(Ts, [f"{T / 1024:.0f}k" if T >= 1024 else str(T) for T in Ts])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("context length T (tokens)")
        ax.set_ylabel("speedup over packed dense" if panel == "e2e" else "speedup over dense (torch SDPA)")
        ax.axhline(1, color="k", lw=0.6)
        ax.grid(True, which="both", alpha=0.3)
    title = f"QAdA decode speedup over dense attention: {setup}"
    fig.suptitle(textwrap.fill(title, max(75, 60 * len(panels))), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_part(out: Path, part: str, setup: str, rows: list[dict], profile: str, **extra) -> None:
    """A part's profile (PART_profile.md) and rows (PART.json) beside its table (PART.md)."""
    (out / f"{part}_profile.md").write_text(f"Profiles, {setup}.\n\n{profile}")
    (out / f"{part}.json").write_text(json.dumps({"setup": setup, "rows": rows, **extra}, indent=1))


def load_average() -> str:
    """The 1-minute load average and the core count: other processes' load is part of every timing."""
    return f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores" if hasattr(os, "getloadavg") else "n/a"


def setup_line(device: torch.device, dtype: str = "float32") -> str:
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return f"{device.type} ({where}), {dtype}, torch {torch.__version__}"


def lengths_above_window(text: str) -> list[int]:
    """--lengths (an argparse type): comma-separated context lengths, each above the window (no bulk to estimate
    else: the criterion's log of T_bulk would fail)."""
    values = [int(x) for x in ints(text).split(",") if x.strip()]
    if min(values) <= N_LOCAL:
        raise argparse.ArgumentTypeError(f"each length must exceed the window ({N_LOCAL}), got {text!r}")
    return values


def run(device: str | None, threads: int | None, repeats: int | None, parts: str, lengths: str | None,
        quick: bool, decode_tokens: int, rope_theta: float, out: str | None, model: str, batches: str, e2e_methods: str,
        dtype: str, compile_decision: bool, calibration: str | None = None, prefill_cache: str | None = None,
        prefill_only: bool = False) -> int:
    """Both parts, or one (`parts`), written into `out` (None: a fresh folder runs/bench/<time>); the arguments as
    main's flags (lengths, batches, e2e_methods: comma-separated text). Returns the exit status."""
    t_start = time.perf_counter()
    try:  # bad input: one line, before anything runs
        device = torch.device(pick_device(device))
        methods, batch_sizes = parse_methods(e2e_methods), [int(b) for b in ints(batches).split(",") if b.strip()]
        given = lengths_above_window(lengths) if lengths else None
        if prefill_only and not prefill_cache:
            raise ValueError("--prefill-only fills --prefill-cache DIR: give it one")
        if prefill_only and parts != "e2e":
            raise ValueError("--prefill-only is for the end-to-end part: give --parts e2e")
        calibration = calibration_for(methods, calibration, model if parts in ("e2e", "all") else None)
        decode_kernels.check_kernel()
        if out is not None and Path(out).exists() and not Path(out).is_dir():
            raise ValueError(f"--out {out} is a file; give a folder")
        if parts in ("e2e", "all"):  # a model that is not to be had: said now, not after the attention part's minutes
            resolve(model, progress=False)
        if threads:
            torch.set_num_threads(threads)
        if prefill_cache:  # a folder that cannot be made: said before minutes of prefill, not after
            make_folder(prefill_cache, "--prefill-cache")
        out = make_folder(out if out is not None else fresh_folder("runs/bench"))  # the last check: made once all pass
    except (OSError, ValueError, argparse.ArgumentTypeError) as e:
        return fail(e)
    setup = setup_line(device)
    if not prefill_only:
        note_replaced(out, [name for part, name in (("attention", "attention"), ("e2e", "end_to_end"))
                            if parts in (part, "all")], "tables")
    att_lengths = given or ([2048, 8192] if quick else [2048, 4096, 8192, 16384, 32768])
    e2e_lengths = given or ([2048] if quick else [2048, 4096, 8192, 16384])
    att_repeats, e2e_repeats = repeats or (3 if quick else 5), repeats or (2 if quick else 6)
    print(f"# {setup}; load average {load_average()}")
    if parts in ("attention", "all"):
        timer = Timer(device)
        print(f"\n## Attention only: ms per layer and decode step, median of {att_repeats} interleaved repeats\n")
        print(table(ATTENTION_COLUMNS, []))
        att_rows = bench_attention(att_lengths, att_repeats, device, timer)
        (out / "attention.md").write_text(f"Attention only, {setup}: ms per layer and decode step, median of "
                                          f"{att_repeats} interleaved repeats.\n\n"
                                          f"{table(ATTENTION_COLUMNS, att_rows)}\n")
        prof = profile_qada(8192 if 8192 in att_lengths else att_lengths[-1], att_repeats, device, timer,
                            compile_decision=compile_decision)
        write_part(out, "attention", setup, att_rows, prof)
        del timer
    if parts in ("e2e", "all"):
        e2e_setup = setup_line(device, dtype)
        if not prefill_only:
            print(f"\n## End to end: {model} ({dtype}) decode ms per step, median of {e2e_repeats} interleaved "
                  f"repeats of {decode_tokens} tokens; load average {load_average()}\n")
            print(table(E2E_COLUMNS, []))
        try:
            e2e_rows, prof = bench_end_to_end(model, e2e_lengths, batch_sizes, methods, e2e_repeats, decode_tokens,
                                              device, DTYPES[dtype], rope_theta,
                                              profile_at=8192 if 8192 in e2e_lengths else e2e_lengths[-1],
                                              calibration=calibration,
                                              prefill_cache=Path(prefill_cache) if prefill_cache else None,
                                              prefill_only=prefill_only)
        except (OSError, ValueError) as e:  # a calibration that is missing or does not fit: one line
            print(f"error: {e}", file=sys.stderr)
            return 2
        if prefill_only:
            print(f"prefilled {', '.join(map(str, e2e_lengths))} into {prefill_cache} in "
                  f"{time.perf_counter() - t_start:.0f} s")
            return 0
        write_part(out, "end_to_end", e2e_setup, e2e_rows, prof, model=model)
        past = any(r["theta"] == f"{rope_theta:g}" for r in e2e_rows)  # said only where a length went past it
        rope = f"; RoPE theta {rope_theta:g} above the model's context" if past else ""
        (out / "end_to_end.md").write_text(
            f"End to end, {model}, {e2e_setup}: decode ms per step (a step decodes one token of every row), median of "
            f"{e2e_repeats} interleaved repeats of {decode_tokens} tokens; rows of a batch are different "
            f"prompts{rope}; load average {load_average()} at the end.\n\n"
            f"{table(E2E_COLUMNS, e2e_rows)}\n")
    # The plot draws every part in the folder: a part run alone keeps the other's last results beside it.
    done = {part: json.loads((out / f"{part}.json").read_text()) for part in ("attention", "end_to_end")
            if (out / f"{part}.json").is_file()}
    plot(done.get("attention", {}).get("rows", []), done.get("end_to_end", {}).get("rows", []), out / "speedup.png",
         " | ".join(d["setup"] for d in done.values()), done.get("end_to_end", {}).get("model", model))
    print(f"\nload average {load_average()}; wrote {out}/ in {time.perf_counter() - t_start:.0f} s")
    return 0


def calibration_for(methods: list[tuple[str, str, dict]], calibration: str | None, model: str | None = None
                    ) -> str | None:
    """The calibration file the end-to-end methods read, from --calibration: a file as given, or in a folder of
    lab.calibrate --qada the file of the estimate they correct (affine.json, sampled.json); None leaves the default
    (the model's shipped one) to bench_end_to_end, which `model` (the end-to-end part's, None when it does not run)
    must then have. One-line errors, before anything runs: the file's window and estimate checked here, its heads
    once the model loads."""
    readers = [m for _, m, _ in methods if "calibration" in attention.path_inputs(m)]
    if calibration is not None and not readers:
        raise ValueError(f"--calibration {calibration}: no method of --e2e-methods reads a calibration (qada_cal ... "
                         "do)")
    if not readers:
        return None
    if calibration is None:
        if model is not None and shipped_calibration(model) is None:  # now, not after the attention part's minutes
            raise ValueError(f"{model} ships no calibration: give --calibration FILE for the qada_cal methods")
        return None
    estimates = {attention.bulk_estimate(m) for m in readers}
    if len(estimates) > 1:
        raise ValueError("one calibration file corrects one estimate: bench the sampled and the Gaussian calibrated "
                         "methods apart")
    if Path(calibration).is_dir():  # a folder's file is checked as a file given is
        kind = "sampled" if next(iter(estimates)) == "sampled" else "affine"
        calibration = str(calibration_file(calibration, kind, "--calibration", ", ".join(dict.fromkeys(readers))))
    elif not Path(calibration).is_file():
        raise FileNotFoundError(f"--calibration {calibration}: no such file or folder")
    check_calibration(load_calibration(calibration), calibration, None, None, None, N_SINK, N_LOCAL, "random-words",
                      attention.bulk_estimate(readers[0]))
    return calibration


# the flags that only one part reads: flag -> (its argument's name, the part)
PART_FLAGS = {"--compile": ("compile_decision", "attention"), "--decode-tokens": ("decode_tokens", "e2e"),
              "--rope-theta": ("rope_theta", "e2e"), "--model": ("model", "e2e"), "--batches": ("batches", "e2e"),
              "--e2e-methods": ("e2e_methods", "e2e"), "--dtype": ("dtype", "e2e"),
              "--calibration": ("calibration", "e2e"), "--prefill-cache": ("prefill_cache", "e2e")}


def main(argv=None) -> int:
    p = Parser(prog="python -m lab.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--repeats", type=at_least(1), default=None, help="timed repeats per method (default: 5 attention, "
                   "6 end to end)")
    p.add_argument("--parts", default="all", choices=["attention", "e2e", "all"],
                   help="which part to run (default: all)")
    p.add_argument("--lengths", type=ints, default=None, help="comma-separated context lengths for both parts "
                   "(default: 2048..32768 attention, 2048..16384 end to end)")
    p.add_argument("--quick", action="store_true", help="a smoke run: fewer lengths and repeats")
    p.add_argument("--decode-tokens", type=at_least(1), default=8, help="tokens decoded per method and timed repeat, "
                   "end to end (default: 8)")
    p.add_argument("--rope-theta", type=positive_float, default=4e5, help="RoPE base for end-to-end lengths above the "
                   "model's context (default: 4e5)")
    p.add_argument("--out", default=None, help="output folder (default: a new folder runs/bench/<time>, so that no run "
                   "overwrites another's; results/bench holds the committed tables, and two parts run apart draw one "
                   "figure only in one folder given here)")
    p.add_argument("--model", default=DEFAULT, help=f"end-to-end model: a name, folder or hub id (default: {DEFAULT})")
    p.add_argument("--batches", type=ints, default="1,8",
                   help="end-to-end batch sizes, each row a different prompt (default: 1,8)")
    p.add_argument("--e2e-methods", default="qada@0.6", help="sparse paths timed end to end, PATH@TAU,... (e.g. "
                   "qada@0.2,qada_kv@0.6: each at the tau where it keeps the score; a page path with its budget, "
                   "quest:1024, qada_pages@0.6:1024, quest_frac:0.05; default: qada@0.6)")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="end-to-end weights and KV cache (default: float32)")
    p.add_argument("--compile", dest="compile_decision", action="store_true", help="profile also qada's decision "
                   "under torch.compile (inductor: needs a C++ compiler on the CPU, ~20 s per shape to compile)")
    p.add_argument("--calibration", default=None, metavar="FILE|DIR", help="the correction the qada_cal methods read, "
                   "end to end: a file, or a folder of lab.calibrate --qada (its affine.json, or sampled.json for the "
                   "sampled estimate); default: the one the model ships, weights/calibration/")
    p.add_argument("--prefill-cache", default=None, metavar="DIR", help="keep each prompt's prefilled KV cache in DIR "
                   "and read it back on a later run instead of prefilling again (about 0.4 GB per 32k prompt of the "
                   "default model in bf16)")
    p.add_argument("--prefill-only", action="store_true", help="fill --prefill-cache (and the reference keys) for "
                   "--lengths and exit, timing nothing: the prefills may run beside other work, the timed run later")
    args = p.parse(argv)
    if isinstance(args, int):  # --help, or a bad argument
        return args
    left_out = {"attention": "e2e", "e2e": "attention", "all": None}[args.parts]
    unread = [flag for flag, (dest, part) in PART_FLAGS.items()
              if part == left_out and getattr(args, dest) != p.get_default(dest)]
    if unread:  # a flag of the part that does not run would do nothing, silently
        return fail(f"{unread[0]} is for the {'end-to-end' if left_out == 'e2e' else 'attention'} part, which --parts "
                    f"{args.parts} leaves out")
    return run(**vars(args))


if __name__ == "__main__":
    sys.exit(main())
