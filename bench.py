"""Decode speed of QAdA against dense attention on this machine, and how close it comes to the ideal bound.

    python bench.py                                  # both parts, the README's figures (~7 min, 2 CPU cores)
    python bench.py --parts attention --quick        # a smoke run
    python bench.py --device cuda                    # on a GPU: synchronised timings, GPU time in profiles

Everything runs in fp32, batch size 1, one decoded token at a time; the report states device and threads.
Methods are timed interleaved (A, B, A, B, ... with the order rotated every repeat) so that other load on
the machine hits both alike, and every figure is a median over repeats.

Part 1, attention only (paper section 3, Listing 1). One decode step of attention over synthetic KV caches
of T tokens, for two model shapes: the embedded SmolLM2-135M (H 9 query heads, Hkv 3 KV heads, D 64) and
Llama-3-8B (H 32, Hkv 8, D 128). What real decoding sees is a cold cache: between two attention layers the
model reads a layer of weights, between two steps all of them. So one timed step runs a stack of L layers,
each with its own cache laid out as model.KVCache lays it out (a (Hkv, T + 1, D) buffer sliced to T), and
the CPU caches are flushed (a 256 MB read) before every timed stack. Timed per stack, reported per layer:
  dense      torch SDPA with enable_gqa over every layer's whole cache (`sdpa_gqa`);
  qada       attention.qada exactly as the model calls it: window attention (read in place from the cache),
             the Gaussian criterion (qada_labels) and full attention for the heads it labels long-context;
  criterion  qada's work before the full heads (window attention and scores, the Gaussian term, labels):
             the price of deciding, reported as a fraction of dense;
  packed     attention.dense, the project's dense path, as qada's full heads compute it (full_attention on every KV head:
             SDPA with a group's query heads as query positions, reading each KV head once where SDPA's
             enable_gqa reads it once per query head). A stronger baseline, reported beside the first.
The label pattern comes from the moments, so that the real criterion produces it: q and the keys are
random normal, the covariances random positive definite, and for each (layer, KV head) the bulk-key mean
points along the group's queries (a huge estimated bulk mass: long-context) or against them (local). The
labels are checked before timing. The KV-read fraction f of a stack is the share of its (layer, KV head)
pairs that read their whole cache; the others read only their n_local = 128 window entries. Reading the
cache is the cost of decode attention, so the ideal speedup over dense is 1 / (f + (1 - f) * 128 / T); the
"% of bound" column is the share of it reached (above 100% where qada's full heads read the cache more
efficiently than dense SDPA does). f = 1 shows the qada path at no saving.
Stacks: 20 layers for SmolLM2's shapes (60 KV heads), 5 for Llama-3-8B's (40 KV heads), so that f = 0.5 and
0.15 are met exactly. A per-stage and per-op profile of qada at f = 0.15 is written beside the table.

Part 2, end to end. Greedy decoding of the embedded model (30 layers, context 8192) on a needle-in-a-
haystack prompt sized to each length with the tokenizer (noise lines, one "special magic number" line at
half depth, the question, the chat template). Prefill (dense, reported separately) is done once per length.
Four decode-time attentions are compared: dense (SDPA, enable_gqa), packed dense (the model's own), QAdA (tau 0.6,
random-words moments, sink 16, window 128) and the all-local window (the floor: decoding with no
long-context head at all). Each first writes its greedy answer (32 tokens, untimed) to check the needle;
then they are timed in interleaved rounds, every run rolling the cache back to the prompt
(cache.length = n) and decoding the same 8 tokens; ms/token is the median over the rounds. Sparsity
(fraction of query heads labelled local) and KV-read fraction are QAdA's over those timed tokens. The
bound is the speedup if qada's full heads cost their KV-read share of dense attention and deciding were
free: dense / (window-only + KV read * (dense - window-only)). Lengths above the model's context use a RoPE
theta override (--rope-theta, default 4e5 = 4x SmolLM2's 1e5) and moments from a random-words prompt of
that length (computed once, ~2 prefills' time, then cached in ~/.cache/qada/moments).

Outputs in bench_results/: attention.md, end_to_end.md, profile.md (where the time goes), results.json
and speedup.png.
"""

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import attention
from attention import build_attention, keyword_inputs
from checkpoints import load
from criterion import qada_labels
from model import KVCache, LlamaConfig
from moments import FixedMoments, ReferenceKeys

N_SINK, N_LOCAL, TAU = 16, 128, 0.6
SHAPES = {  # name: H, Hkv, D, and L, the layers in one timed stack
    "SmolLM2-135M": dict(H=9, Hkv=3, D=64, L=20),
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
        sign = full.to(self.q.device).float() * 2 - 1  # +1: the bulk outweighs the window by e^50 or so
        return FixedMoments(100.0 * sign[..., None] * self.direction, self.cov, self.T - N_LOCAL)

    def run(self, path, moments=None):
        """Every layer through `path` (a function of attention.PATHS' form), given what it reads."""
        names = keyword_inputs(path)
        given = dict(n_sink=N_SINK, n_local=N_LOCAL, tau=TAU, moments=moments)
        kw = {n: given[n] for n in names if n != "layer"}
        if "layer" in names:
            return [path(self.q[i], *self.kv[i], layer=i, **kw)[0] for i in range(self.L)]
        return [path(self.q[i], *self.kv[i], **kw)[0] for i in range(self.L)]

    def criterion(self, moments):
        """What qada does before its full heads: window attention and scores, the Gaussian term, labels."""
        out = []
        for i, (k, v) in enumerate(self.kv):
            y_window, scores = attention.window_attention(self.q[i], k, v, N_SINK, N_LOCAL)
            out.append(qada_labels(self.q[i], scores, moments.quadratic_form(i, k), self.T, N_LOCAL, TAU))
        return out

    def check(self, full: torch.Tensor, moments) -> None:
        """The criterion labels exactly the pattern; with every head long, qada equals dense."""
        G = self.H // self.Hkv
        labels = torch.stack(self.criterion(moments)).cpu()  # (L, H)
        if not torch.equal(labels, ~full.repeat_interleave(G, 1)):
            raise RuntimeError("the synthetic moments did not produce the intended label pattern")
        if full.all():
            for a, b in zip(self.run(attention.qada, moments), self.run(attention.dense)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def sdpa_gqa(q, k, v):
    """Dense attention as SDPA's enable_gqa computes it: each KV head read once per query head (on the CPU)."""
    y = torch.nn.functional.scaled_dot_product_attention(q[None, :, None], k[None], v[None], enable_gqa=True)
    return y[0, :, 0], None


def bench_attention(lengths, repeats: int, device: torch.device, timer: Timer) -> list[dict]:
    rows = []
    for shape, dims in SHAPES.items():
        for T in lengths:
            stack = Stack(**dims, T=T, device=device)
            fns = {"dense": lambda: stack.run(sdpa_gqa), "packed": lambda: stack.run(attention.dense)}
            patterns = {f: full_pattern(stack.L, stack.Hkv, f) for f in FRACTIONS}
            moments = {f: stack.moments(p) for f, p in patterns.items()}
            for f in FRACTIONS:
                stack.check(patterns[f], moments[f])
                fns[f] = lambda m=moments[f]: stack.run(attention.qada, m)
            fns["criterion"] = lambda: stack.criterion(moments[0.15])
            t = timer.interleaved(fns, repeats)
            for f in FRACTIONS:
                f_got = float(patterns[f].float().mean())
                speedup, ideal = t["dense"] / t[f], ideal_speedup(f_got, T)
                rows.append(dict(shape=shape, T=T, f=f_got, dense_ms=1e3 * t["dense"] / stack.L,
                                 qada_ms=1e3 * t[f] / stack.L, speedup=speedup, ideal=ideal,
                                 of_bound=speedup / ideal, criterion=t["criterion"] / t["dense"],
                                 packed_ms=1e3 * t["packed"] / stack.L, speedup_packed=t["packed"] / t[f],
                                 of_bound_packed=t["packed"] / t[f] / ideal))
                print(format_row(ATTENTION_COLUMNS, rows[-1]), flush=True)
            del stack, fns
    return rows


def profile_qada(T: int, repeats: int, device: torch.device, timer: Timer, f: float = 0.15) -> str:
    """Markdown: qada's stages timed apart (cold caches, like the main table), then torch.profiler's ops."""
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
            y_window, scores = attention.window_attention(stack.q[i], k, v, N_SINK, N_LOCAL)
            pre.append((y_window, scores, moments.quadratic_form(i, k)))

        def stage(fn):
            return lambda: [fn(i, *stack.kv[i], *pre[i]) for i in range(stack.L)]

        q = stack.q
        stages = {
            "window attention and scores (window_attention)": stage(
                lambda i, k, v, *_: attention.window_attention(q[i], k, v, N_SINK, N_LOCAL)),
            "Gaussian term + labels (qada_labels)": stage(
                lambda i, k, v, yw, s, form: qada_labels(q[i], s, form, T, N_LOCAL, TAU)),
            "full heads (mixed_attention)": stage(lambda i, k, v, yw, *_: attention.mixed_attention(
                q[i], k, v, local[i], N_SINK, N_LOCAL, yw)),
            "qada, whole": lambda: stack.run(attention.qada, moments),
            "dense": lambda: stack.run(sdpa_gqa),
        }
        t = timer.interleaved(stages, repeats)
        ideal_full = t["dense"] * f  # the full heads' share of the dense read
        out += [f"### {shape} shapes, T = {T}, f = {f}: qada's stages (us per layer, cold caches)", "",
                "| stage | us / layer | % of dense |", "|---|---:|---:|"]
        for name, s in t.items():
            out.append(f"| {name} | {1e6 * s / stack.L:.0f} | {100 * s / t['dense']:.1f} |")
        out.append(f"| *f x dense: the full heads' ideal cost* | {1e6 * ideal_full / stack.L:.0f} | {100 * f:.1f} |")
        with profile() as prof:
            for _ in range(3):
                stack.run(attention.qada, moments)
        out += ["", "torch.profiler, the qada stack run 3 times (profiler overhead included), per layer:", ""]
        out += top_ops(prof, device, 3 * stack.L, "layer", 12, scale=1.0, unit="us")
        out.append("")
        del stack, stages, pre
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# Part 2: end to end


def needle_prompt(tok, n_tokens: int, seed: int = 0) -> tuple[list[int], str]:
    """Chat-template ids of a needle-in-a-haystack prompt of at most n_tokens (as close as whole lines allow)."""
    rng = random.Random(seed)
    key = f"{rng.choice(['quiet', 'amber', 'rapid', 'hollow', 'gentle'])}-{rng.choice(['harbor', 'falcon', 'meadow', 'lantern'])}"
    value = str(rng.randrange(1_000_000, 10_000_000))
    needle = f"One of the special magic numbers for {key} is: {value}."

    def ids(n_lines: int) -> list[int]:
        lines = [HAYSTACK] * n_lines
        lines.insert(n_lines // 2, needle)
        text = ("A special magic number is hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the number afterwards.\n" + "\n".join(lines)
                + f"\nWhat is the special magic number for {key} mentioned in the provided text?")
        return tok.encode_chat([{"role": "user", "content": text}])

    per_line = (len(ids(101)) - len(ids(1))) / 100
    n_lines = max(1, int((n_tokens - len(ids(1))) / per_line) + 1)
    while len(out := ids(n_lines)) > n_tokens and n_lines > 1:
        n_lines -= 1
    return out, value


def sdpa_gqa_decode(q, k, v, layer: int):
    """`sdpa_gqa` in the model's decode_attention form: q (1, H, 1, D), k/v (1, Hkv, T, D) -> (1, H, 1, D)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def decode_timed(model, cache, n_prompt: int, logits, n_new: int, attn) -> tuple[float, list[int]]:
    """Roll the cache back to the prompt and decode n_new greedy tokens; seconds per token and the tokens."""
    cache.length = n_prompt
    token, out = logits.argmax(-1), []
    sync = (lambda: torch.cuda.synchronize(model.device)) if model.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(n_new):
        out.append(int(token[0]))
        token = model.decode_step(token, cache, attn).argmax(-1)
    sync()
    return (time.perf_counter() - t0) / n_new, out


def bench_end_to_end(lengths, repeats: int, n_new: int, device: torch.device, rope_theta: float,
                     profile_at: int | None = None) -> tuple[list[dict], str]:
    rows, models, profile = [], {}, ""

    def model_for(theta):
        if theta not in models:
            models[theta] = load("smollm2-135m", device, rope_theta=theta)  # the model of the tables below
        return models[theta]

    for T in lengths:
        model, tok = model_for(None)
        if T > model.cfg.max_position_embeddings:
            model, tok = model_for(rope_theta)
        reference = ReferenceKeys(model, tok, n_max=max(T, model.cfg.max_position_embeddings))
        ids, value = needle_prompt(tok, T - NEEDLE_TOKENS)
        n = len(ids)
        cache = model.new_cache(n + NEEDLE_TOKENS + 1)
        t0 = time.perf_counter()
        logits = model.prefill(torch.tensor([ids], device=device), cache)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        prefill_s = time.perf_counter() - t0
        def build(method):  # through the one builder, for the prompt (the cache rolled back to it)
            cache.length = n
            return build_attention(method, cache, tau=TAU, reference=reference, n_sink=N_SINK, n_local=N_LOCAL)

        make = {"dense": lambda: sdpa_gqa_decode, "packed": lambda: None,  # None: the model's own (packed) dense
                "qada": lambda: build("qada"), "local": lambda: build("local")}
        # The answer, untimed (and a warm-up): does each method still find the needle?
        found = {name: value in tok.decode(decode_timed(model, cache, n, logits, NEEDLE_TOKENS, make[name]())[1])
                 for name in make}
        times, stats = {name: [] for name in make}, []
        for r in range(repeats):  # short runs, interleaved, so that load bursts hit every method alike
            for name in list(make)[r % len(make):] + list(make)[:r % len(make)]:
                attn = make[name]()
                times[name].append(decode_timed(model, cache, n, logits, n_new, attn)[0])
                if name == "qada":
                    stats.append(attn.stats.summary(model.cfg.num_key_value_heads))
        ms = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
        sparsity, kv_read = stats[0]["sparsity"], stats[0]["kv_read"]  # greedy: every run decodes the same tokens
        # If the full heads cost exactly their share of dense attention and deciding were free:
        bound = {m: ms[m] / (ms["local"] + kv_read * (ms[m] - ms["local"])) for m in ("dense", "packed")}
        rows.append(dict(T=n, theta=f"{model.cfg.rope_theta:g}", prefill_s=prefill_s, dense_ms=ms["dense"],
                         packed_ms=ms["packed"], qada_ms=ms["qada"], local_ms=ms["local"],
                         speedup=ms["dense"] / ms["qada"], bound=bound["dense"],
                         speedup_packed=ms["packed"] / ms["qada"], bound_packed=bound["packed"],
                         sparsity=sparsity, kv_read=kv_read,
                         needle="/".join("yes" if found[m] else "no" for m in ("dense", "qada"))))
        print(format_row(E2E_COLUMNS, rows[-1]), flush=True)
        if T == profile_at:
            profile = profile_decode(model, cache, n, logits, make, T)
        del cache
    return rows, profile


def self_time(event, device: torch.device) -> float:
    """An op's own time in us: on the GPU where it runs there, else on the CPU."""
    return event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total


def top_ops(prof, device: torch.device, n: int, per: str, rows: int, scale: float, unit: str) -> list[str]:
    """Markdown rows of the profiler's heaviest ops by self time, per `per` (n of them were profiled)."""
    ops = sorted(prof.key_averages(), key=lambda e: -self_time(e, device))[:rows]
    return ([f"| op | calls / {per} | self {unit} / {per} |", "|---|---:|---:|"]
            + [f"| {e.key} | {e.count / n:.1f} | {self_time(e, device) * scale / n:.2f} |" for e in ops])


def profile_decode(model, cache, n_prompt: int, logits, make: dict, T: int, steps: int = 8) -> str:
    """Markdown: torch.profiler's heaviest ops of a decode step, per method (self time per token)."""
    from torch.profiler import profile
    out = [f"### End to end, SmolLM2-135M, prompt of {n_prompt} tokens: the heaviest ops of a decode step", ""]
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
                     ("of_bound_packed", "% of bound vs packed", "{:.0%}"), ("criterion", "criterion / dense", "{:.1%}")]
E2E_COLUMNS = [("T", "prompt tokens", "{}"), ("theta", "RoPE theta", "{}"), ("prefill_s", "prefill s", "{:.1f}"),
               ("dense_ms", "dense ms/tok", "{:.1f}"), ("packed_ms", "packed dense ms/tok", "{:.1f}"),
               ("qada_ms", "qada ms/tok", "{:.1f}"), ("local_ms", "window-only ms/tok", "{:.1f}"),
               ("speedup", "speedup", "{:.2f}x"), ("bound", "bound", "{:.2f}x"),
               ("speedup_packed", "speedup vs packed", "{:.2f}x"), ("bound_packed", "bound vs packed", "{:.2f}x"),
               ("sparsity", "sparsity", "{:.2f}"), ("kv_read", "KV read", "{:.2f}"), ("needle", "needle found dense/qada", "{}")]


def format_row(columns, row) -> str:
    return "| " + " | ".join(fmt.format(row[key]) for key, _, fmt in columns) + " |"


def table(columns, rows) -> str:
    head = "| " + " | ".join(title for _, title, _ in columns) + " |"
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"
    return "\n".join([head, rule] + [format_row(columns, r) for r in rows])


def plot(att_rows, e2e_rows, path: Path, setup: str) -> None:
    """Speedup vs context length: measured (solid) beside the ideal bound (dashed), one panel per part."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    panels = [s for s in SHAPES if any(r["shape"] == s for r in att_rows)] + (["e2e"] if e2e_rows else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    colors = dict(zip(FRACTIONS, ["tab:gray", "tab:blue", "tab:red", "tab:green"]))
    for ax, panel in zip(axes[0], panels):
        if panel == "e2e":
            Ts = [r["T"] for r in e2e_rows]
            ax.plot(Ts, [r["speedup"] for r in e2e_rows], "o-", color="tab:purple", label="qada (tau 0.6)")
            ax.plot(Ts, [r["bound"] for r in e2e_rows], "o--", color="tab:purple", mfc="none",
                    label="bound at qada's KV read")
            ax.plot(Ts, [r["speedup_packed"] for r in e2e_rows], "^-.", color="tab:orange",
                    label="qada vs packed dense")
            ax.plot(Ts, [r["dense_ms"] / r["local_ms"] for r in e2e_rows], "s:", color="k", mfc="none",
                    label="window only (f = 0)")
            for r in e2e_rows:
                ax.annotate(f"f={r['kv_read']:.2f}", (r["T"], r["speedup"]), textcoords="offset points",
                            xytext=(0, 7), ha="center", fontsize=8)
            ax.set_title("End to end: SmolLM2-135M decode")
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
        ax.set_ylabel("speedup over dense (torch SDPA)")
        ax.axhline(1, color="k", lw=0.6)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"QAdA decode speedup over dense attention: {setup}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_average() -> str:
    """The 1-minute load average and the core count: other processes' load is part of every timing."""
    return f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores" if hasattr(os, "getloadavg") else "n/a"


def setup_line(device: torch.device) -> str:
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return f"{device.type} ({where}), fp32, torch {torch.__version__}"


def main(device: str | None, threads: int | None, repeats: int | None, parts: str, lengths: str | None,
         quick: bool, decode_tokens: int, rope_theta: float, out: str) -> int:
    t_start = time.perf_counter()
    if threads:
        torch.set_num_threads(threads)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    setup = setup_line(device)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    given = [int(x) for x in lengths.split(",")] if lengths else None
    att_lengths = given or ([2048, 8192] if quick else [2048, 4096, 8192, 16384, 32768])
    e2e_lengths = given or ([2048] if quick else [2048, 4096, 8192, 16384])
    att_repeats, e2e_repeats = repeats or (3 if quick else 5), repeats or (2 if quick else 6)
    print(f"# {setup}; load average {load_average()}")
    att_rows, e2e_rows, profiles = [], [], []
    if parts in ("attention", "all"):
        timer = Timer(device)
        print(f"\n## Attention only: ms per layer and decode step, median of {att_repeats} interleaved repeats\n")
        print(table(ATTENTION_COLUMNS, []))
        att_rows = bench_attention(att_lengths, att_repeats, device, timer)
        (out / "attention.md").write_text(f"Attention only, {setup}: ms per layer and decode step, median of "
                                          f"{att_repeats} interleaved repeats.\n\n{table(ATTENTION_COLUMNS, att_rows)}\n")
        profiles.append(profile_qada(8192 if 8192 in att_lengths else att_lengths[-1], att_repeats, device, timer))
        del timer
    if parts in ("e2e", "all"):
        print(f"\n## End to end: SmolLM2-135M decode ms per token, median of {e2e_repeats} interleaved repeats "
              f"of {decode_tokens} tokens\n")
        print(table(E2E_COLUMNS, []))
        e2e_rows, prof = bench_end_to_end(e2e_lengths, e2e_repeats, decode_tokens, device, rope_theta,
                                          profile_at=8192 if 8192 in e2e_lengths else e2e_lengths[-1])
        profiles.append(prof)
        (out / "end_to_end.md").write_text(
            f"End to end, {setup}: decode ms per token, median of {e2e_repeats} interleaved repeats of {decode_tokens} tokens; "
            f"RoPE theta {rope_theta:g} above 8192 tokens.\n\n{table(E2E_COLUMNS, e2e_rows)}\n")
    (out / "profile.md").write_text(f"Profiles, {setup}.\n\n" + "\n".join(profiles))
    (out / "results.json").write_text(json.dumps({"setup": setup, "attention": att_rows, "end_to_end": e2e_rows}, indent=1))
    plot(att_rows, e2e_rows, out / "speedup.png", setup)
    print(f"\nload average {load_average()}; wrote {out}/ (attention.md, end_to_end.md, profile.md, speedup.png) "
          f"in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per method (default: 5 attention, 6 end to end)")
    p.add_argument("--parts", default="all", choices=["attention", "e2e", "all"], help="which part to run (default: all)")
    p.add_argument("--lengths", default=None, help="comma-separated context lengths for both parts "
                   "(default: 2048..32768 attention, 2048..16384 end to end)")
    p.add_argument("--quick", action="store_true", help="a smoke run: fewer lengths, repeats and tokens")
    p.add_argument("--decode-tokens", type=int, default=8, help="tokens decoded per method and timed repeat, end to end (default: 8)")
    p.add_argument("--rope-theta", type=float, default=4e5, help="RoPE base for end-to-end lengths above the model's context (default: 4e5)")
    p.add_argument("--out", default="bench_results", help="output folder (default: bench_results)")
    sys.exit(main(**vars(p.parse_args())))
