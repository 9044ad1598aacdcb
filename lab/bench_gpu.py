"""Decode speed on an NVIDIA GPU at the shapes the paper targets: attention alone at 7-8B-model shapes and long
contexts, and a random-weight Llama-3-8B end to end, each against the best dense decoding torch offers there.

    python -m lab.bench_gpu                                        # both parts, the committed tables (H100: ~3 min)
    TRITON_INTERPRET=1 python -m lab.bench_gpu --parts attention --lengths 300 --batches 1,2 --quick   # CPU smoke run

Part 1, attention only: one layer's decode step in bf16, B rows over a KV cache of T tokens laid out as
model.KVCache lays it out, at the shapes of Llama-3-8B (H 32 query heads, Hkv 8 KV heads, D 128) and Qwen2.5-7B
(28 / 4 / 128). Each call is timed alone with the GPU's L2 flushed before it (triton.testing.do_bench; median ms),
replayed from a CUDA graph where it can be captured (no host work between launches, as a decoder that captures its
step runs it):
  flash      SDPA with enable_gqa under the flash backend: FlashAttention's decoding, which splits each head's
             context across thread blocks when the grid is small (graph);
  packed     SDPA with a group's query heads as the query positions of its KV head (each KV head read once), the
             backend torch picks: the model's dense decode on the CPU and for large batches (graph);
  torch      attention.BatchAttention's qada rows on the torch path (QADA_KERNEL=torch): the batched decision, then
             mixed_attention per row (a host read of the labels per row and layer: eager only);
  fused      the same BatchAttention on the fused kernel (QADA_KERNEL=triton): decision, then split-context attention
             of the long-context groups merged by each group's last split, two launches, nothing read back to the
             host (eager, and graph).
The label pattern comes out of the real criterion, as in lab.bench: per (row, KV head) the moments' mean points along
the group's queries (the bulk outweighs the window: long-context) or against them (local), so that a share f of the
(row, KV head) pairs reads its cache; the labels are checked before timing, and at f = 1 both paths' outputs
against packed dense. The bound is the speedup over the best dense if only the cache read counted:
1 / (f + (1 - f) * 128 / T); speedup and % of bound are the fused graph's. "decision" is the fused graph at f = 0
(window, decision and the grid of split programs that return at once) over the best dense.

Part 2, end to end: generate.py's own decode loops, imported and called as run_batch calls them, on a decoder with
random weights at Llama-3-8B's shapes (32 layers, 128k vocabulary), bf16, its KV cache filled with random keys and
values to T = 32k (no prefill: decode time does not depend on the values), batch 8, and batch 32 with 8 of the 32
layers (a 32-layer batch-32 cache needs 137 GB). ms per decode step (one token of every row): "eager" is
generate.decode_batch, "graph" generate.decode_static, which replays one CUDA graph per view (generate.graph_view),
as --cuda-graphs auto does; the median over n steps of one run, each step timed on the host from one read of its
tokens to the next (the loop reads them to end its rows), the first step (a graph's capture) left out: eager
n = --steps, graph n = 4 --steps, with the quartiles of its steps. --capacity sets the cache's T_max (default just
enough): the steps at T = T_max / 2 or T_max / 8 replay a graph whose view is graph_view's, not the capacity. Methods:
  dense      generate's dense: eager, DecodeAttention("dense") per row (one prompt: SDPA on the filled cache);
             graph, decode_kernels.fused_dense over the graph's view (the split kernel alone, every group read, T read
             on the device);
  kv F       qada_cal on the fused kernel with a correction that fixes the labels (b = 0, a = +-50), so that a
             share F of the (layer, KV head) pairs is long-context for every row: the decision is computed as always,
             the labels are those of a static choice at the KV read QAdA reaches on the research model (kv 1.0: every
             group read, the fused kernel's dense);
  qada       QAdA's own decision (Option 1: the random cache's own bulk moments), whatever KV read it reaches;
  kv 0.35 + pages B   qada_pages: the same fixed labels at 0.35, each long-context group reading its window and its
             top pages of 16 under a budget of B tokens (--e2e-budget, default 1024), chosen by Quest's bound from
             each row's page statistics (pages.PageIndex, built from the cache, kept current by the step);
  quest B    Quest alone at the same budget: every query head its own top pages, a KV head the union of its heads';
  dense again   dense once more, after the rows above: how far the machine drifted while they ran;
  compiled: dense, kv 0.35, kv 0.0   with --compiled, those rows again with the model's norms, RoPE and MLP
             compiled (model.Llama.compile_pointwise, generate.py --compile on), the first of them paying the
             compile in its untimed runs; their speedups and bounds against the compiled dense and floor.
The bound is dense / (floor + f * (dense - floor)) with floor the all-local step (kv 0), as lab.bench has it.
The step decode_static captures runs once eagerly under torch.cuda.set_sync_debug_mode("error"): "host syncs" says
whether one was met.

Part 3, --parts kernels (not in "all"): where a fused step's time goes, Llama-3-8B shapes at each --lengths and
--batches, KV read 0, 0.3 and 1, the step as generate's static loop calls it (static_step: the two kernels, T in a
device tensor). Each kernel's device time per step from torch.profiler over 20 eager steps run back to back (any
small torch operation by its CUDA kernel's name), their sum, and the step replayed from a CUDA graph as part 1 times
it, with decode_kernels.split_size's split and with each of SPLITS (context positions per split program; batch 1 fills
the GPU only with small ones). The graph's time exceeds the sum by the gaps between its kernels, and by the L2 being
flushed before each timed replay, not before each profiled step: at KV read 0 the step's data fit in L2, so there
the difference is mostly gaps, and at read 1 it is mostly the cache read from memory. A graph of one layer's step
also pays the launch's fixed cost, which a decoder's graph of all its layers spreads over them: at KV read 0 and
0.3 the step of STACK layers, each its own cache and forms, is captured in one graph too (stacked_step), and its
time given per layer.
At KV read 0.3 (0.25 at batch 1) the window kernel (its device time) and the split kernel (the step's graph time)
are also timed at other launches (WINDOW_VARIANTS, SPLIT_VARIANTS: warps, tiles, precision, pipeline depth), each with
the largest change of the output.

Outputs in --out (default: a new runs/bench-gpu/<time> folder): attention.md and end_to_end_<T>k.md (the tables with
the device, driver and torch versions and the command; end_to_end_<T>k_of_<T_max>k.md with --capacity; kernels.md),
their rows as JSON, and speedup.png.
"""

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

import decode_kernels
from attention import (BatchAttention, DecodeAttention, HeadStats, StaticAttention, page_size, path_inputs,
                       qada_rule)
from criterion import TAU, Calibration
from generate import decode_batch, decode_static, graph_view, pick_device, step_attention, step_clock
from lab.bench import full_pattern, ideal_speedup, lengths_above_window, pattern_moments, qada_kernel
from lab.cli import Parser, at_least, fail, fresh_folder, ints, make_folder, note_replaced
from model import KVCache, Llama, LlamaConfig
from moments import FixedMoments, bulk_end, mean_cov
from pages import PAGE_SIZE, PageIndex

N_SINK, N_LOCAL = 16, 128
SHAPES = {"Llama-3-8B": dict(H=32, Hkv=8, D=128), "Qwen2.5-7B": dict(H=28, Hkv=4, D=128)}
FRACTIONS = (1.0, 0.5, 0.3, 0.15, 0.0)
LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=5e5,
                        max_position_embeddings=131072)
E2E_FRACTIONS = (1.0, 0.45, 0.35, 0.15, 0.0)  # 0.45 / 0.35: calibrated QAdA's lossless KV read, per head / per group
E2E_PAGES_F = 0.35  # the page rows' long-context share: QAdA per KV group's lossless read on the research model
GRAPH_STEPS = 4  # the graph loop times this many times --steps (replays are cheap; their quartiles say the spread)
COMPILED = "compiled: "  # --compiled's rows: dense, kv E2E_PAGES_F and kv 0.0 again, the model's pointwise compiled


def capacity_needed(T: int, steps: int) -> int:
    """Cache positions an end-to-end setup from context T fills: the graph loop's GRAPH_STEPS * steps, and a few."""
    return T + GRAPH_STEPS * steps + 8


def graph_ms(fn, device: torch.device, quick: bool = False) -> float:
    """timed_ms of fn captured as one CUDA graph (what a decoder replaying its step runs); as timed_ms off CUDA."""
    if device.type != "cuda":
        return timed_ms(fn, device, quick)
    return timed_ms(graphed(fn, lambda: None, device), device, quick)


def timed_ms(fn, device: torch.device, quick: bool = False) -> float:
    """Median ms of fn: on CUDA with triton's do_bench (L2 flushed before every call), else wall-clock."""
    if device.type == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=5 if quick else 10, rep=20 if quick else 60, return_mode="median")
    fn()
    times = []
    for _ in range(2 if quick else 3):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------------------
# Part 1: attention only


class Layer:
    """One layer's decode state for B rows at context T: q (B, H, 1, D), a KV cache, and what gives each pattern."""

    def __init__(self, H: int, Hkv: int, D: int, B: int, T: int, device: torch.device, dtype=torch.bfloat16):
        torch.manual_seed(0)
        G = H // Hkv
        self.k = torch.randn(B, Hkv, T + 1, D, device=device, dtype=dtype)[:, :, :T]  # room for the step's token
        self.v = torch.randn(B, Hkv, T + 1, D, device=device, dtype=dtype)[:, :, :T]
        self.q = torch.randn(B, H, 1, D, device=device, dtype=dtype)
        qg = self.q.float().view(B, Hkv, G, D).sum(2)
        self.direction = qg / qg.norm(dim=-1, keepdim=True)  # (B, Hkv, D): each group's queries
        a = torch.randn(Hkv, D, D, device=device) * 0.3 / math.sqrt(D)
        self.cov = a @ a.transpose(-1, -2) + 0.01 * torch.eye(D, device=device)  # (Hkv, D, D)
        self.H, self.Hkv, self.D, self.B, self.T, self.G = H, Hkv, D, B, T, G

    def attention(self, full: torch.Tensor) -> BatchAttention:
        """qada rows whose criterion labels the (row, KV head) pairs of full (B, Hkv) long-context, the rest local."""
        return BatchAttention([DecodeAttention("qada", N_SINK, N_LOCAL, dict(tau=TAU, moments=pattern_moments(
            self.direction[b][None], self.cov[None], full[b][None], self.T - N_LOCAL))) for b in range(self.B)])

    def packed(self):
        return F.scaled_dot_product_attention(self.q.view(self.B, self.Hkv, self.G, self.D), self.k, self.v)

    def flash(self):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(self.q, self.k, self.v, enable_gqa=True)

    def check(self, batch: BatchAttention, full: torch.Tensor) -> None:
        """One step: the labels are the pattern's; with every head long-context the output is dense's."""
        y = batch(self.q, self.k, self.v, 0)
        labels = torch.stack([row.stats.labels[-1][0] for row in batch.rows]).cpu()  # (B, H)
        if not torch.equal(labels, ~full.repeat_interleave(self.G, 1)):
            raise RuntimeError("the synthetic moments did not produce the intended label pattern")
        if full.all():
            torch.testing.assert_close(y.view(self.B, self.Hkv, self.G, self.D), self.packed(), rtol=2e-2, atol=2e-2)


def bench_attention(lengths, batches, device: torch.device, quick: bool) -> list[dict]:
    rows = []
    for shape, dims in SHAPES.items():
        for T in lengths:
            for B in batches:
                rows += bench_layer(shape, Layer(**dims, B=B, T=T, device=device), device, quick)
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the layer's cache is gone: up to 17 GB at 128k, batch 32
    return rows


def bench_layer(shape: str, layer: Layer, device: torch.device, quick: bool) -> list[dict]:
    """One table row per KV-read fraction of FRACTIONS, for one shape, T and B."""
    dense = {"packed": graph_ms(layer.packed, device, quick)}
    try:
        layer.flash()
        dense["flash"] = graph_ms(layer.flash, device, quick)
    except RuntimeError:  # no flash backend here (a torch without it)
        dense["flash"] = math.nan
    best = min(t for t in dense.values() if not math.isnan(t))
    kv_gb = 2 * layer.k.numel() * layer.k.element_size() / 1e9  # keys and values of every row
    rows, times = [], {}
    for f in FRACTIONS:
        full = full_pattern(layer.B, layer.Hkv, f)
        batch = layer.attention(full)
        step = lambda: batch(layer.q, layer.k, layer.v, 0)  # noqa: E731
        for choice, name in (("torch", "torch"), ("triton", "fused")):
            with qada_kernel(choice):
                layer.check(batch, full)
                times[name, f] = timed_ms(step, device, quick)
                if choice == "triton":  # and replayed as a CUDA graph: the launches' host work gone
                    times["graph", f] = graph_ms(step, device, quick)
            for row in batch.rows:  # the statistics of the timed calls are not needed
                row.stats = HeadStats(N_LOCAL)
        f_got = float(full.float().mean())
        ideal = ideal_speedup(f_got, layer.T)
        rows.append(dict(shape=shape, T=layer.T, B=layer.B, f=f_got, flash_ms=dense["flash"], packed_ms=dense["packed"],
                         dense_GBps=kv_gb / best * 1e3, torch_ms=times["torch", f], fused_ms=times["fused", f],
                         graph_ms=times["graph", f], speedup=best / times["graph", f], ideal=ideal,
                         of_bound=best / times["graph", f] / ideal, eager_of_bound=best / times["fused", f] / ideal,
                         torch_of_bound=best / times["torch", f] / ideal))
    for row in rows:
        row["decision"] = times["graph", 0.0] / best
        print(format_row(ATTENTION_COLUMNS, row), flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------------
# Part 2: end to end


def random_llama(cfg: LlamaConfig, device: torch.device, dtype=torch.bfloat16) -> Llama:
    """A Llama of cfg's shapes with random weights (std 0.02, norms at 1), made on the device in dtype."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Llama(cfg)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    return model.eval()


def fixed_labels(cfg: LlamaConfig, f: float, device) -> Calibration:
    """A correction that labels a share f of the (layer, KV head) pairs long-context whatever the estimate says."""
    full = full_pattern(cfg.num_hidden_layers, cfg.num_key_value_heads, f)  # (L, Hkv)
    G = cfg.num_attention_heads // cfg.num_key_value_heads
    a = torch.where(full.repeat_interleave(G, 1), -50.0, 50.0).to(device)  # (L, H): r = a, far from any threshold
    return Calibration(a, torch.zeros_like(a), None, {"kind": "fixed labels", "f": f})


def bulk_moments(cache: KVCache, T: int) -> FixedMoments:
    """Option 1 on row 0's random keys, a layer at a time (moments.prompt_moments at once would hold every layer's
    bulk in fp32 twice: 34 GB at 128k)."""
    end = bulk_end(T, N_SINK, N_LOCAL)
    mean, cov = zip(*(mean_cov(cache.k[i, 0, :, N_SINK:end]) for i in range(cache.k.shape[0])))
    return FixedMoments(torch.stack(mean), torch.stack(cov), end - N_SINK)


def step_ms(decode, reset, n: int) -> tuple[float, float, float]:
    """ms per decode step of decode(k, finished), a generate.py loop decoding k new tokens of every row, whose stop rule
    `finished` it calls for each row once a step's tokens are read back to the host (a sync: the step is done): the
    host's clock at the first such call of each step gives one interval per step, and its median and quartiles over
    the n steps after the first, which pays a graph's capture (the steps the tables time replay it). One run: the
    capture's cost, which pairs of runs were meant to cancel, never enters. An untimed run of 2 tokens first compiles
    what the loop launches; reset() rolls the cache back to T before each run."""
    stamps, clock = step_clock()  # tokens each row holds -> when the step that gave the last was read
    reset()
    decode(2)
    reset()
    decode(n + 3, clock)  # (the loop asks no stop rule about a row's last token: it has ended anyway)
    ms = [1e3 * (stamps[i + 1] - stamps[i]) for i in range(2, n + 2)]  # token i + 1: step i, step 1 the capture
    q1, median, q3 = statistics.quantiles(ms, n=4) if n > 1 else ms * 3
    return median, q1, q3


def graphed(step, reset, device: torch.device):
    """step captured as one CUDA graph (after warm-up on a side stream, as torch's documentation does it)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            reset()
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    reset()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def sync_free(step) -> str:
    """Whether one eager step reads anything back to the host (torch's sync debug mode raises if it does)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return "none"
    except RuntimeError as e:
        return str(e).splitlines()[0][:80]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def bench_end_to_end(T: int, setups, device: torch.device, n: int, capacity: int | None = None,
                     budget: int = 1024, compiled: bool = False) -> list[dict]:
    rows = []
    for B, L in setups:
        with qada_kernel("triton"):
            rows += bench_setup(T, B, L, device, n, capacity, budget, compiled)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the setup's model and cache are gone: up to 50 GB
    return rows


def bench_setup(T: int, B: int, L: int, device: torch.device, n: int, capacity: int | None = None,
                budget: int = 1024, compiled: bool = False) -> list[dict]:
    """Every method of one setup (batch B, L layers of Llama-3-8B) decoding from context T, its cache holding
    `capacity` positions (default: just enough), through generate.py's own loops: decode_batch (eager) and
    decode_static (replayed from CUDA graphs, one per view). A table row each; with `compiled`, dense, kv
    E2E_PAGES_F and kv 0.0 again after them with the model's norms, RoPE and MLP compiled (generate.py --compile on),
    each speedup and bound against the compiled dense and floor."""
    cfg = LlamaConfig(**{**LLAMA3_8B.__dict__, "num_hidden_layers": L})
    model = random_llama(cfg, device)
    capacity = max(capacity or 0, capacity_needed(T, n))
    cache = KVCache(cfg, capacity, B, device=device, dtype=torch.bfloat16)
    cache.k.normal_(), cache.v.normal_()
    cache.length = T
    moments = bulk_moments(cache, T)
    first = torch.randn(B, cfg.vocab_size, device=device)  # a prefill's last logits: any will do

    def reset():
        cache.length = T

    def attentions(method: str, f: float | None) -> list[DecodeAttention]:
        inputs = {} if method == "dense" else dict(tau=TAU, moments=moments, budget=budget)  # what a path reads
        if f is not None:
            inputs["calibration"] = fixed_labels(cfg, f, device)
        def row_inputs(b: int) -> dict:  # a page path's own index for each row, fresh for each run (it restarts at T)
            if "pages" not in path_inputs(method):
                return dict(inputs)
            return {**inputs, "pages": PageIndex(cache, page_size(method), N_SINK, row=b)}
        return [DecodeAttention(method, N_SINK, N_LOCAL, row_inputs(b)) for b in range(B)]

    def loop(method: str, f: float | None, graphs: bool, made: list):
        def decode(k: int = 2, finished=None):  # generate.py's loop as run_batch calls it (made: the rows, for their
            rows = attentions(method, f)        # statistics; finished: its stop rule, step_ms's clock)
            made[:] = rows
            if graphs:
                return decode_static(model, cache, first, k, rows, finished=finished, capture=device.type == "cuda")
            return decode_batch(model, cache, first, k, rows[0] if B == 1 else BatchAttention(rows), finished=finished)
        return decode

    def one_step(method: str, f: float | None, check):  # check(step): the step decode_static captures, eagerly
        reset()  # then set up as decode_static does, outside the step (fix and release read the host)
        rows = attentions(method, f)
        cache.fix()
        try:
            static = StaticAttention.of(rows, cache, 1, cfg.num_attention_heads)
            token = torch.zeros(B, dtype=torch.long, device=device)
            hook = step_attention(static, cfg.head_dim, device)  # as decode_static hands it to the model
            return check(lambda: model.decode_step(token, cache, hook))
        finally:
            cache.release()

    # dense again after the eager modules' rows: how far the machine drifted over them (its speedup is against the
    # first dense); then the compiled rows, the model compiled once before the first of them
    methods = [("dense", "dense", None), *((f"kv {f}", "qada_cal", f) for f in E2E_FRACTIONS), ("qada", "qada", None),
               (f"kv {E2E_PAGES_F} + pages {budget}", "qada_pages", E2E_PAGES_F), (f"quest {budget}", "quest", None),
               ("dense again", "dense", None)]
    if compiled:
        again = ("dense", f"kv {E2E_PAGES_F}", "kv 0.0")
        methods += [(f"{COMPILED}{name}", method, f) for name, method, f in methods if name in again]
    out = {}
    for name, method, f in methods:
        if name.startswith(COMPILED) and not any(r.startswith(COMPILED) for r in out):
            torch._dynamo.reset()  # graphs of this setup's shapes, as a fresh generate.py --compile on compiles them,
            model.compile_pointwise()  # not an earlier setup's made dynamic in the batch
        made = []
        reset()
        loop(method, f, True, made)()  # one step at T + 1: its labels give the KV read (and kernels are compiled)
        kv_read = made[0].stats.summary(cfg.num_key_value_heads)["kv_read"]
        eager, *_ = step_ms(loop(method, f, False, made), reset, n)
        logits_ok = bool(one_step(method, f, lambda step: torch.isfinite(step()).all()))
        syncs = one_step(method, f, sync_free) if device.type == "cuda" else ""
        try:
            graph, q1, q3 = step_ms(loop(method, f, True, made), reset, GRAPH_STEPS * n)
        except RuntimeError as e:  # a capture that fails is a finding, not a crash of the whole table
            graph = q1 = q3 = math.nan
            syncs = "; ".join(filter(None, (syncs, "capture: " + str(e).splitlines()[0])))[:120]
        out[name] = dict(B=B, L=L, T=T, capacity=capacity, view=graph_view(T + 1, capacity), method=name,
                         kv_read=kv_read, eager_ms=eager, graph_ms=graph, graph_q1=q1, graph_q3=q3,
                         graph_quartiles=math.nan if math.isnan(q1) else f"{q1:.2f}-{q3:.2f}", host_syncs=syncs,
                         logits_ok=logits_ok)
    for mode in ("eager", "graph"):
        for r in out.values():
            family = COMPILED if r["method"].startswith(COMPILED) else ""
            dense, floor = out[f"{family}dense"][f"{mode}_ms"], out[f"{family}kv 0.0"][f"{mode}_ms"]
            bound = dense / (floor + r["kv_read"] * (dense - floor))
            r[f"{mode}_speedup"] = dense / r[f"{mode}_ms"]
            r[f"{mode}_of_bound"] = r[f"{mode}_speedup"] / bound
    for r in out.values():
        print(format_row(E2E_COLUMNS, r), flush=True)
    return list(out.values())


# ---------------------------------------------------------------------------------------------------------
# Part 3: where a fused step's time goes


SPLITS = (256, 512, 1024, 2048, 4096)  # context positions per split program, timed beside split_size's own choice


@contextmanager
def fixed_split(split: int):
    """decode_kernels.split_size answering `split` inside the block: the fused step's split programs at a chosen
    size."""
    chosen = decode_kernels.split_size
    decode_kernels.split_size = lambda *args, **kwargs: split
    try:
        yield
    finally:
        decode_kernels.split_size = chosen


def kernel_us(step, device: torch.device, n: int = 20) -> dict[str, float]:
    """Each CUDA kernel's device time per call of step() (us, by kernel name), from torch.profiler over n calls run
    back to back."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize(device)
    return {e.key: e.device_time_total / n for e in prof.key_averages() if e.device_time_total > 0}


def named_us(per_kernel: dict[str, float]) -> str:
    """kernel_us's times as a table cell, the longest first."""
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])
    return "; ".join(f"{name[:60]} {us:.1f}" for name, us in top)


# The window kernel's launches timed beside decode_kernels.WINDOW_LAUNCH at KV read 0.3: warps, and tile sizes (window
# positions, form columns) down to one tile of each. At batch 1 and 8 its 8 and 64 programs leave the GPU mostly
# idle, so a program's time is its loops' sequential steps: on an H200 the window took ~5 us of its ~10 and the form
# the rest (Quest's window kernel, which does not decide, against QAdA's: h200/pages), and tiles of 64 (2 + 2 steps,
# not 4 + 4) were the fastest. The form in tiles of 64 alone isolates that half. FORM_FIRST computes the form before
# the window, so that its reads start with the program; FORM_APART in programs of its own, one per tile of columns,
# beside the window's, the last to finish deciding (at the default tiles and in tiles of 64). QAdA's window kernel,
# the one timed here, spills at none of these under Triton 3.6 (lab.kernel_resources; FORM_FIRST with tiles of 64
# spills 2.8 KB, so it is not timed). The benchmark's labels are too clear-cut to flip; the table gives the largest
# change of the step's output instead.
# (Tiles of 16, the form at tf32 or tf32x3, LOW off, and 2 warps lost on an H200: results/bench-gpu/h200/kernels.md.)
WINDOW_VARIANTS = [dict(num_warps=8), dict(BLOCK_W=64, BLOCK_D=64), dict(BLOCK_W=32, BLOCK_D=64),
                   dict(BLOCK_W=64, BLOCK_D=64, num_warps=8), dict(BLOCK_W=128, BLOCK_D=64, num_warps=8),
                   dict(BLOCK_W=128, BLOCK_D=128, num_warps=8), dict(FORM_FIRST=True), dict(FORM_APART=True),
                   dict(FORM_APART=True, BLOCK_W=64, BLOCK_D=64)]


@contextmanager
def launch(config: dict, **change):
    """A kernel's launch config (decode_kernels.WINDOW_LAUNCH, BOUND_LAUNCH, SPLIT_LAUNCH) with `change` inside the
    block."""
    kept = dict(config)
    config.update(change)
    try:
        yield
    finally:
        config.clear()
        config.update(kept)


# The split kernel's launches timed beside decode_kernels.SPLIT_LAUNCH at the same read: positions per tile, warps per
# program, pipeline depth, programmatic dependent launch, programs dealt out to the long groups. Timed as the whole
# step's graph with the L2 flushed: at batch 1 the long groups' cache would fit in L2 across back-to-back eager steps.
SPLIT_VARIANTS = [dict(BLOCK_N=128), dict(num_warps=8), dict(num_stages=4), dict(PDL=True), dict(SPREAD=2),
                  dict(SPREAD=8)]


def launch_variants(step, config: dict, changes: list[dict], timer) -> str:
    """timer(step) (us) with a kernel's launch `config` (decode_kernels.WINDOW_LAUNCH, SPLIT_LAUNCH) changed as each of
    `changes` says, and the largest change of the step's output against the default launch's (a variant that fails
    to compile says so)."""
    cells = []
    want = step().float()
    for change in changes:
        label = ",".join(f"{k.lower().replace('block_w', 'w').replace('block_d', 'd')}={v}" for k, v in change.items())
        try:
            with launch(config, **change):
                diff = float((step().float() - want).abs().max())
                us = timer(step)
            cells.append(f"{label}: {us:.1f} (|dy| {diff:.0e})")
        except Exception as e:  # noqa: BLE001 (a launch the compiler refuses is a finding, not a crash of the table)
            cells.append(f"{label}: failed ({type(e).__name__})")
    return "; ".join(cells)


def static_step(batch: BatchAttention, layer: Layer):
    """The fused step as generate's static loop calls it (attention.StaticAttention): decode_kernels.fused_qada on the
    rows' stacked forms and thresholds, T in a device tensor made once, the output written into a buffer: the two
    kernels and nothing around them (BatchAttention's eager call also makes T a device tensor, one small launch per
    layer). batch must have run once (its cache of the rows' forms)."""
    (A, b, _, thresholds, start, rows), = batch.cached.values()
    length = torch.full((1,), layer.T, dtype=torch.int32, device=layer.q.device)
    rows, start = rows.int(), start.int()
    y = torch.empty_like(layer.q)
    arrived = torch.zeros(len(rows), layer.Hkv, dtype=torch.int32, device=layer.q.device)  # the loop's, kept at zero
    rule = qada_rule(batch.rows[0].method)[1]
    return lambda: decode_kernels.fused_qada(layer.q[:, :, 0], layer.k, layer.v, rows, start, N_SINK, N_LOCAL, (A, b),
                                             thresholds, rule, None, length=length, arrived=arrived, out=y[:, :, 0])[0]


STACK = 4  # layers, each its own cache and forms, in one graph for the kernels table's per-layer graph time


def stacked_step(layers: list, full: torch.Tensor):
    """The fused step of each of `layers` (Layer, each its own queries, cache and forms) at the labels of full, one
    after another, as a decoder's graph replays a model's layers, where a graph of one layer's step pays the launch's
    fixed cost for that step alone. Returns the callable, which returns each layer's output."""
    steps = []
    for layer in layers:
        batch = layer.attention(full)
        layer.check(batch, full)  # one eager step: the labels are the pattern's, and the rows' forms cached
        steps.append(static_step(batch, layer))
    return lambda: [step() for step in steps]


def bench_kernels(T: int, B: int, device: torch.device) -> list[dict]:
    """Rows of the kernels table (the module's docstring, part 3) for Llama-3-8B shapes at T and B."""
    rows = []
    layer = Layer(**SHAPES["Llama-3-8B"], B=B, T=T, device=device)
    stack = [layer] + [Layer(**SHAPES["Llama-3-8B"], B=B, T=T, device=device) for _ in range(STACK - 1)]
    for f in (0.0, 0.3, 1.0):
        full = full_pattern(B, layer.Hkv, f)
        batch = layer.attention(full)
        with qada_kernel("triton"):
            layer.check(batch, full)
            step = static_step(batch, layer)
            per_kernel = kernel_us(step, device)
            graph = graph_ms(step, device)
            by_split = {}
            for split in SPLITS:  # the same step at each split size, for the choice split_size makes
                with fixed_split(split):
                    by_split[split] = 1e3 * graph_ms(step, device)
            stacked = math.nan  # where the targets are read: deciding alone (read 0), and read 0.3
            if f < 1:
                stacked = 1e3 * graph_ms(stacked_step(stack, full), device) / STACK
            window = split_launches = ""
            if 0 < f < 1:
                window = launch_variants(step, decode_kernels.WINDOW_LAUNCH, WINDOW_VARIANTS, lambda fn: kernel_us(
                    fn, device).get("_window_decide_kernel", math.nan))
                pdl = torch.cuda.get_device_capability(device)[0] >= 9  # else decode_kernels.pdl launches it without
                split_launches = launch_variants(step, decode_kernels.SPLIT_LAUNCH,
                                                 [v for v in SPLIT_VARIANTS if pdl or "PDL" not in v],
                                                 lambda fn: 1e3 * graph_ms(fn, device))
        for row in batch.rows:
            row.stats = HeadStats(N_LOCAL)
        rows.append(dict(T=T, B=B, f=float(full.float().mean()), device_us=sum(per_kernel.values()),
                         graph_us=1e3 * graph, stacked_us=stacked,
                         split=decode_kernels.split_size(B * layer.Hkv, T, device),
                         splits=", ".join(f"{s}: {us:.1f}" for s, us in by_split.items()),
                         kernels=named_us(per_kernel), window=window, split_launches=split_launches))
        print(format_row(KERNEL_COLUMNS, rows[-1]), flush=True)
    del layer, stack
    torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------------------
# Tables and the figure


ATTENTION_COLUMNS = [("shape", "shape", "{}"), ("T", "T", "{}"), ("B", "B", "{}"), ("f", "KV read", "{:.2f}"),
                     ("flash_ms", "flash ms", "{:.3f}"), ("packed_ms", "packed ms", "{:.3f}"),
                     ("dense_GBps", "dense GB/s", "{:.0f}"), ("torch_ms", "torch ms", "{:.3f}"),
                     ("fused_ms", "fused eager ms", "{:.3f}"), ("graph_ms", "fused graph ms", "{:.3f}"),
                     ("speedup", "fused speedup", "{:.2f}x"), ("ideal", "bound", "{:.2f}x"),
                     ("of_bound", "fused % of bound", "{:.0%}"), ("eager_of_bound", "eager % of bound", "{:.0%}"),
                     ("torch_of_bound", "torch % of bound", "{:.0%}"), ("decision", "decision / dense", "{:.1%}")]
KERNEL_COLUMNS = [("T", "T", "{}"), ("B", "B", "{}"), ("f", "KV read", "{:.2f}"),
                  ("device_us", "kernels' device us", "{:.1f}"), ("graph_us", "graph us", "{:.1f}"),
                  ("stacked_us", f"graph us per layer, {STACK} layers in one graph", "{:.1f}"),
                  ("split", "split_size", "{}"), ("splits", "graph us at each split size", "{}"),
                  ("kernels", "each kernel's device us per step (eager)", "{}"),
                  ("window", "window kernel us at other launches (read 0.3)", "{}"),
                  ("split_launches", "graph us at other split kernel launches (read 0.3)", "{}")]
E2E_COLUMNS = [("B", "B", "{}"), ("L", "layers", "{}"), ("T", "T", "{}"), ("capacity", "capacity", "{}"),
               ("view", "graph view", "{}"), ("method", "method", "{}"),
               ("kv_read", "KV read", "{:.2f}"), ("eager_ms", "eager ms", "{:.2f}"),
               ("eager_speedup", "eager speedup", "{:.2f}x"), ("eager_of_bound", "eager % of bound", "{:.0%}"),
               ("graph_ms", "graph ms", "{:.2f}"), ("graph_quartiles", "graph ms, quartiles", "{}"),
               ("graph_speedup", "graph speedup", "{:.2f}x"), ("graph_of_bound", "graph % of bound", "{:.0%}"),
               ("host_syncs", "host syncs", "{}")]


def format_row(columns, row) -> str:
    cells = []
    for key, _, fmt in columns:
        value = row.get(key, math.nan)
        cells.append("n/a" if isinstance(value, float) and math.isnan(value) else fmt.format(value))
    return "| " + " | ".join(cells) + " |"


def table(columns, rows) -> str:
    head = "| " + " | ".join(title for _, title, _ in columns) + " |"
    rule = "|" + "|".join("---" if fmt == "{}" else "---:" for _, _, fmt in columns) + "|"
    return "\n".join([head, rule] + [format_row(columns, r) for r in rows])


def setup_line(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        driver = os.popen("nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null").read().strip()
        gpu = (f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB), driver {driver or '?'}, "
               f"CUDA {torch.version.cuda}")
    else:
        gpu = f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads"
    triton_version = decode_kernels.triton.__version__ if decode_kernels.triton is not None else "none"
    return f"{gpu}; torch {torch.__version__}, triton {triton_version}, Python {platform.python_version()}"


def plot(att_rows, path: Path, setup: str) -> None:
    """Fused and torch-path speedup over the best dense against the KV read, one panel per shape and length."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = list(dict.fromkeys(r["shape"] for r in att_rows))
    lengths = sorted({r["T"] for r in att_rows})
    fig, axes = plt.subplots(len(shapes), len(lengths), figsize=(3.4 * len(lengths), 3.0 * len(shapes)), squeeze=False,
                             sharey=True)
    for ax, (shape, T) in zip(axes.flat, [(s, T) for s in shapes for T in lengths]):
        for B in sorted({r["B"] for r in att_rows}):
            rs = sorted((r for r in att_rows if (r["shape"], r["T"], r["B"]) == (shape, T, B)), key=lambda r: r["f"])
            line, = ax.plot([r["f"] for r in rs], [r["speedup"] for r in rs], "o-", label=f"fused, B {B}")
            ax.plot([r["f"] for r in rs], [r["speedup"] * r["torch_of_bound"] / r["of_bound"] for r in rs], "x:",
                    color=line.get_color(), label=f"torch path, B {B}")
        fs = [i / 50 for i in range(51)]
        ax.plot(fs, [ideal_speedup(f, T) for f in fs], "k--", lw=0.8, label="bound")
        ax.axhline(1, color="grey", lw=0.5)
        ax.set_yscale("log")
        ax.set_title(f"{shape}, T {T // 1024}k", fontsize=9)
        ax.set_xlabel("KV read")
    for row in axes:
        row[0].set_ylabel("speedup over the best dense")
    axes[0][-1].legend(fontsize=6)
    fig.suptitle(setup, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write(out: Path, part: str, setup: str, columns, rows, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{part}.json").write_text(json.dumps(dict(setup=setup, command=command, rows=rows), indent=1))
    (out / f"{part}.md").write_text(f"{setup}\n\n`{command}`\n\n{table(columns, rows)}\n")


def int_list(text: str) -> list[int]:
    """--batches (an argparse type): comma-separated integers >= 1."""
    return [int(x) for x in ints(text).split(",") if x.strip()]


def launch_change(text: str) -> dict:
    """An argparse type: a launch change for decode_kernels.set_launch, in JSON, checked (main applies it)."""
    try:
        change = json.loads(text)
        decode_kernels.check_launch(change)
    except ValueError as e:  # json's errors are ValueErrors too
        raise argparse.ArgumentTypeError(str(e)) from None
    return change


def setups(text: str) -> list[tuple[int, int]]:
    """--e2e (an argparse type): BATCHxLAYERS,... with both at least 1."""
    try:
        out = [tuple(int(x) for x in s.split("x")) for s in text.split(",")]
    except ValueError:
        out = []
    if not out or not all(len(s) == 2 and min(s) > 0 for s in out):
        raise argparse.ArgumentTypeError(f"takes BATCHxLAYERS,..., for example 8x32,32x8; got {text!r}")
    return out


def main(argv=None) -> int:
    p = Parser(prog="python -m lab.bench_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda, cuda:1, ... (default: cuda if available; the attention part "
                                                  "runs on the CPU too, under TRITON_INTERPRET=1)")
    p.add_argument("--parts", default="all", choices=["attention", "e2e", "kernels", "all"],
                   help="which part to run (default: all: attention and e2e; kernels: each kernel's device time in a "
                   "fused step, at --lengths and --batches)")
    p.add_argument("--lengths", type=lengths_above_window, default="8192,32768,131072",
                   help="attention part: context lengths (default: 8k, 32k, 128k)")
    p.add_argument("--batches", type=int_list, default="1,8,32", help="attention part: batch sizes (default: 1,8,32)")
    p.add_argument("--e2e-length", type=at_least(N_LOCAL + 1), default=32768, help="end to end: context length "
                   "(default: 32768)")
    p.add_argument("--e2e", type=setups, default="8x32,32x8", help="end to end: BATCHxLAYERS setups (default: "
                   "8x32,32x8)")
    p.add_argument("--capacity", type=at_least(N_LOCAL + 2), default=None, help="end to end: the KV cache's capacity "
                   "in positions, T_max (default: T + 4 steps + 8, just enough); --e2e-length 16384 --capacity 32768 "
                   "times the steps at T_max / 2")
    p.add_argument("--e2e-budget", type=at_least(PAGE_SIZE), default=1024, help="end to end: the page rows' budget "
                   "in tokens beyond the window (default: 1024)")
    p.add_argument("--steps", type=at_least(1), default=10, help="end to end: timed steps per method, eager (the "
                   "graph loop: 4 times as many) (default: 10)")
    p.add_argument("--compiled", action="store_true", help="end to end: the dense, kv 0.35 and all-local rows again "
                   "with the model's norms, RoPE and MLP compiled (generate.py --compile on), in the same table")
    p.add_argument("--launch", type=launch_change, default={}, help="the kernels launched otherwise, as "
                   "decode_kernels.set_launch takes it, in JSON: '{\"split\": {\"SPREAD\": 8}}' times a launch end to "
                   "end before it is adopted (default: the kernels' own)")
    p.add_argument("--quick", action="store_true", help="fewer timed calls")
    p.add_argument("--out", default=None, help="output folder (default: a new folder runs/bench-gpu/<time>, so that no "
                   "run overwrites another's; results/bench-gpu holds the committed tables)")
    args = p.parse(argv)
    if isinstance(args, int):  # --help, or a bad argument
        return args
    lengths, batches = args.lengths, args.batches
    try:  # what this machine lacks: one line, exit 2
        need = capacity_needed(args.e2e_length, args.steps)
        if args.capacity is not None and args.capacity < need:  # it would be raised, under the file name given
            raise ValueError(f"--capacity {args.capacity} holds fewer positions than --e2e-length {args.e2e_length} "
                             f"and the steps timed after it take ({need})")
        device = torch.device(pick_device(args.device))
        if decode_kernels.triton is None:
            raise ValueError("the fused kernel needs triton (pip install triton)")
        if device.type != "cuda" and args.parts != "attention":
            raise ValueError(f"the {'kernels' if args.parts == 'kernels' else 'end-to-end'} part needs a GPU: no "
                             "CUDA on this machine (--parts attention runs on the CPU under TRITON_INTERPRET=1)")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":  # read when the kernels are defined
            raise ValueError("no CUDA here; the fused kernel runs on the CPU only under TRITON_INTERPRET=1")
        out = make_folder(args.out if args.out is not None else fresh_folder("runs/bench-gpu"))  # before any timing
    except ValueError as e:
        return fail(e)
    e2e_name = f"end_to_end_{args.e2e_length // 1024}k" + (f"_of_{args.capacity // 1024}k" if args.capacity else "")
    note_replaced(out, {"attention": ["attention"], "e2e": [e2e_name], "all": ["attention", e2e_name],
                        "kernels": ["kernels"]}[args.parts])
    decode_kernels.set_launch(args.launch)
    setup = setup_line(device)
    command = "python -m lab.bench_gpu " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(setup, flush=True)
    if args.parts in ("attention", "all"):
        print(table(ATTENTION_COLUMNS, []), flush=True)
        rows = []
        for T in lengths:  # written after each length: a run cut off keeps what it measured
            rows += bench_attention([T], batches, device, args.quick)
            write(out, "attention", setup, ATTENTION_COLUMNS, rows, command)
            plot(rows, out / "speedup.png", setup)
    if args.parts in ("e2e", "all"):
        print(table(E2E_COLUMNS, []), flush=True)
        rows = []
        for one in args.e2e:  # written after each setup: a later one that fails keeps the earlier rows
            rows += bench_end_to_end(args.e2e_length, [one], device, args.steps, args.capacity, args.e2e_budget,
                                     args.compiled)
            write(out, e2e_name, setup, E2E_COLUMNS, rows, command)
    if args.parts == "kernels":
        print(table(KERNEL_COLUMNS, []), flush=True)
        rows = []
        for T in lengths:  # written after each length and batch: a run cut off keeps what it measured
            for B in batches:
                rows += bench_kernels(T, B, device)
                write(out, "kernels", setup, KERNEL_COLUMNS, rows, command)
    print(f"wrote {out}/", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
