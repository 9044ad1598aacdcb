"""Attention-only decode speed of page selection on an NVIDIA GPU: QAdA + pages and Quest alone, both in the fused
kernel (decode_kernels.fused_pages), against the best dense and QAdA's head-level fused step
(decode_kernels.fused_qada), at the shapes of 7-8B models and long contexts.

    python -m lab.bench_pages_gpu --out runs/bench-gpu-pages             # the full grid (2 shapes x 32k/128k x 1/8/32)
    python -m lab.bench_pages_gpu --quick --out /tmp/pages               # Llama-3-8B, 32k, batch 1 and 8: < 2 min
    TRITON_INTERPRET=1 python -m lab.bench_pages_gpu --interpret-smoke --out /tmp/smoke   # CPU, tiny sizes

One layer's decode step in bf16 for B rows over a KV cache of T tokens laid out as model.KVCache lays it out (B, Hkv,
T_max, D), at Llama-3-8B's shapes (H 32 query heads, Hkv 8 KV heads, D 128) and Qwen2.5-7B's (28 / 4 / 128), with
the page statistics of its keys (pages of P tokens after the 16 sinks, min and max per KV head, as pages.PageIndex).
Each call is captured as one CUDA graph and its replays timed with CUDA events, the L2 cache flushed before each
(median ms); a decoder replaying its captured step runs it so. Columns:
  flash     SDPA with enable_gqa under the flash backend: FlashAttention's decoding;
  packed    SDPA with a group's query heads as the query positions of its KV head (each KV head read once);
  qada      decode_kernels.fused_qada with the labels fixed so that a fraction f of the (row, KV head) pairs is
            long-context (--fraction, default 0.35: calibrated group QAdA's lossless KV read on the research model);
  +pages    decode_kernels.fused_pages, QAdA + pages: the same labels, and a long group reads its window and the top
            budget // P pages of its group bound instead of its whole cache;
  quest     decode_kernels.fused_pages, Quest alone: every group long-context, each query head its own top pages, a
            KV head reading the union of its heads' pages;
  exact     +pages and quest again with the window's and the page bounds' products in exact fp32 ("ieee", EXACT:
            LOW off) instead of the default's tensor cores, and the share of query heads that attend to the same pages
            with the same label as at the default launch;
  choice    the choice of pages alone, decode_kernels.choose_pages (one kernel: each ranking's top pages and the KV
            head's list of them), in us, beside torch's topk of the same scores (what the choice took before).
On CUDA each step's kernels are also profiled (a second table: each kernel's device time per call, eager).
The labels come out of the real criterion: per (row, KV head) a bulk mean of +-100 along the group's queries (as
lab.bench.pattern_moments) puts its estimated bulk mass far above or below the window's; they are checked before
timing. "read" is the fraction of KV entries read per (row, KV head), counting as attention's page paths do (the
window, each page read, and one entry per candidate page whose statistics are scored), Quest's union measured on the
step itself; "x" is the speedup over the best dense, "bound" 1 / read. Keys and values are random, so which pages win
says nothing of accuracy (lab.sweep measures that); the step reads what a real one reads.

Before timing, a small case is held against the torch paths (attention.quest, attention.qada_pages, row by row) on the
compiled kernels, in fp32 and bf16, and one eager step of each kernel runs under
torch.cuda.set_sync_debug_mode("error"). Outputs in --out: pages.md (the table, the device, driver and versions, the
command) and pages.json. Without CUDA it exits with status 2 and one line, unless --interpret-smoke (tiny sizes
through Triton's interpreter, for the tests).
"""

import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attention
import decode_kernels
from criterion import Calibration, gaussian_form
from lab.bench import full_pattern, lengths_above_window
from lab.bench_gpu import kernel_us, launch, launch_change, named_us, setup_line
from lab.cli import Parser, at_least, fail, fresh_folder, ints, make_folder, note_replaced
from moments import FixedMoments
from pages import PageIndex, candidates, upper_bounds

N_SINK, N_LOCAL = 16, 128
SHAPES = {"Llama-3-8B": dict(H=32, Hkv=8, D=128), "Qwen2.5-7B": dict(H=28, Hkv=4, D=128)}
SMOKE_SHAPES = {"tiny": dict(H=8, Hkv=2, D=16)}


# ---------------------------------------------------------------------------------------------------------
# One layer's decode state


class Layer:
    """q (B, H, D), a KV cache (B, Hkv, T, D) in bf16 with its page statistics (B, Hkv, NP, D), and the quadratic
    forms that label a fraction f of the (row, KV head) pairs long-context."""

    def __init__(self, H: int, Hkv: int, D: int, B: int, T: int, P: int, f: float, device: torch.device,
                 dtype=torch.bfloat16, seed: int = 0):
        torch.manual_seed(seed)
        self.H, self.Hkv, self.D, self.B, self.T, self.P, self.G = H, Hkv, D, B, T, P, H // Hkv
        self.k = torch.randn(B, Hkv, T, D, device=device, dtype=dtype)
        self.v = torch.randn(B, Hkv, T, D, device=device, dtype=dtype)
        self.q = torch.randn(B, H, D, device=device, dtype=dtype)
        n_pages = (T - N_SINK) // P  # whole pages; the last part-filled one, if any, as PageIndex has it
        pages = self.k[:, :, N_SINK:N_SINK + n_pages * P].unflatten(2, (n_pages, P))  # (B, Hkv, n, P, D)
        lo, hi = pages.amin(3), pages.amax(3)
        if N_SINK + n_pages * P < T:
            tail = self.k[:, :, N_SINK + n_pages * P:]
            lo, hi = torch.cat([lo, tail.amin(2, keepdim=True)], 2), torch.cat([hi, tail.amax(2, keepdim=True)], 2)
        self.bounds = (lo.contiguous(), hi.contiguous())
        self.full = full_pattern(B, Hkv, f).to(device)  # (B, Hkv): the long-context pairs
        qg = self.q.float().view(B, Hkv, self.G, D).sum(2)
        direction = qg / qg.norm(dim=-1, keepdim=True)
        mean = 100.0 * (self.full.float() * 2 - 1)[..., None] * direction  # (B, Hkv, D)
        self.form = gaussian_form(mean, torch.zeros(B, Hkv, D, D, device=device))
        self.tau = decode_kernels.kernel_thresholds(torch.full((B,), 0.5, dtype=torch.float64, device=device))
        self.rows = torch.arange(B, dtype=torch.int32, device=device)
        self.start = torch.zeros(B, dtype=torch.int32, device=device)
        self.length = torch.full((1,), T, dtype=torch.int32, device=device)

    def flash(self):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(self.q[:, :, None], self.k, self.v, enable_gqa=True)

    def packed(self):
        return F.scaled_dot_product_attention(self.q.view(self.B, self.Hkv, self.G, self.D), self.k, self.v)

    def qada(self):
        return decode_kernels.fused_qada(self.q, self.k, self.v, self.rows, self.start, N_SINK, N_LOCAL, self.form,
                                         self.tau, "mean", length=self.length)

    def pages(self, budget: int, quest: bool, inspect: bool = False):
        qada = {} if quest else dict(form=self.form, tau=self.tau)
        return decode_kernels.fused_pages(self.q, self.k, self.v, self.rows, self.start, N_SINK, N_LOCAL, self.bounds,
                                          self.P, budget=budget, length=self.length, inspect=inspect, **qada)

    def check_labels(self, labels: torch.Tensor, quest: bool = False) -> None:
        want = torch.zeros_like(labels) if quest else ~self.full.repeat_interleave(self.G, 1)
        if not torch.equal(labels, want):
            raise RuntimeError("the synthetic moments did not produce the intended label pattern")

    def read(self, budget: int, quest: bool) -> float:
        """The KV entries read per (row, KV head) over T: window, pages (Quest's union measured), scored statistics."""
        m = candidates(self.T, N_SINK, N_LOCAL, self.P)
        _, labels, chosen = self.pages(budget, quest, inspect=True)
        self.check_labels(labels, quest)
        union = chosen.view(self.B, self.Hkv, self.G, -1).any(2).sum(-1).double()  # (B, Hkv) pages
        scored = m if 0 < budget // self.P < m else 0  # attention.top_pages scores only when it decides
        long = union.new_ones(union.shape) if quest else self.full.double()
        per_pair = N_LOCAL + long * (union * self.P + scored)  # the last page's window part counted: an upper bound
        return float(per_pair.mean() / self.T)


# ---------------------------------------------------------------------------------------------------------
# Timing


def graphed(fn, device: torch.device):
    """fn captured as one CUDA graph after a warm-up on a side stream (torch's recipe); its replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def timed_ms(fn, device: torch.device, reps: int) -> float:
    """Median ms of fn replayed from a CUDA graph, timed with CUDA events, the L2 cache flushed before each call (a
    write of 256 MB, more than any L2); on the CPU (the smoke run) wall-clock of fn itself."""
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    replay = graphed(fn, device)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)
    begin = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(3):
        replay()
    for i in range(reps):
        flush.zero_()
        begin[i].record()
        replay()
        end[i].record()
    torch.cuda.synchronize(device)
    return statistics.median(b.elapsed_time(e) for b, e in zip(begin, end))


def sync_free(fn, device: torch.device) -> bool:
    """Whether one eager call reads nothing back to the host (torch's sync debug mode raises if it does)."""
    if device.type != "cuda":
        return True
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return True
    except RuntimeError:
        return False
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---------------------------------------------------------------------------------------------------------
# The check against the torch paths, and the table


def self_check(device: torch.device, dims: dict, P: int) -> list[str]:
    """fused_pages on the compiled kernels against attention.quest and attention.qada_pages row by row: two rows
    (the second left-padded) of a context past a few thousand tokens, fp32 and bf16, a budget of 8 pages; returns one
    line per case (max error), raises if an output, a label or a chosen page differs."""
    H, Hkv, D, G = dims["H"], dims["Hkv"], dims["D"], dims["H"] // dims["Hkv"]
    lines = []
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        T, pad = 3000 if device.type == "cuda" else 400, 7
        g = torch.Generator().manual_seed(1)
        q = torch.randn(2, H, D, generator=g).to(device, dtype)
        k, v = (torch.randn(2, Hkv, T, D, generator=g).to(device, dtype) for _ in range(2))
        start = torch.tensor([0, pad], dtype=torch.int32, device=device)
        NP = math.ceil((T - N_SINK) / P)
        lo = torch.zeros(2, Hkv, NP, D, device=device, dtype=dtype)
        hi = torch.zeros(2, Hkv, NP, D, device=device, dtype=dtype)
        for i in range(2):
            row_lo, row_hi = PageIndex(None, P, N_SINK).bounds(0, k[i, :, int(start[i]):])
            lo[i, :, :row_lo.shape[1]], hi[i, :, :row_hi.shape[1]] = row_lo, row_hi
        moments = [FixedMoments(k[i, :, int(start[i]):].float().mean(1)[None], 0.01 * torch.eye(D, device=device)
                                .expand(1, Hkv, D, D), 1000) for i in range(2)]
        forms = [m.quadratic_form(0, None) for m in moments]
        form = (torch.stack([f[0] for f in forms]), torch.stack([f[1] for f in forms]))
        tau = torch.tensor([0.3, 0.3], dtype=torch.float64, device=device)
        calibration = fixed_calibration(H, G, device)
        rows = torch.arange(2, dtype=torch.int32, device=device)
        for name in ("quest", "qada_pages"):
            qada = {} if name == "quest" else dict(form=form, tau=tau, correction=calibration.layer(0))
            y, labels, chosen = decode_kernels.fused_pages(q, k, v, rows, start, N_SINK, N_LOCAL, (lo, hi), P,
                                                           budget=8 * P, inspect=True, **qada)
            err = 0.0
            for i in range(2):
                kk, vv = k[i, :, int(start[i]):], v[i, :, int(start[i]):]
                common = dict(layer=0, n_sink=N_SINK, n_local=N_LOCAL, pages=PageIndex(None, P, N_SINK),
                              budget=8 * P, budget_frac=None, page_size=P)
                if name == "quest":
                    want_y, want_labels, _ = attention.quest(q[i], kk, vv, **common)
                else:
                    want_y, want_labels, _ = attention.qada_pages(q[i], kk, vv, **common, tau=0.3,
                                                                  moments=moments[i], calibration=calibration)
                m = candidates(kk.shape[1], N_SINK, N_LOCAL, P)
                bounds = upper_bounds(q[i], *attention.index_bounds(common["pages"], P, N_SINK, 0, kk, m))  # (H, m)
                if not torch.equal(labels[i], want_labels):
                    raise RuntimeError(f"self-check {name} {dtype}: labels differ from the torch path's")
                picked = chosen[i].float()
                if name == "quest" and dtype == torch.float32:  # each head's own top pages: the highest bounds
                    mine = torch.where(picked[:, :m] > 0, bounds, math.inf).amin(1)
                    others = torch.where(picked[:, :m] > 0, -math.inf, bounds).amax(1)
                    if not (mine >= others - 1e-4).all() or int(picked[:, :m].sum()) != H * 8 or picked[:, m:].any():
                        raise RuntimeError("self-check quest: a chosen page bounds lower than one left out")
                err = max(err, float((y[i].float() - want_y.float()).abs().max()))
            if not err <= tol:
                raise RuntimeError(f"self-check {name} {dtype}: output differs from the torch path's by {err:.2e}")
            lines.append(f"self-check {name} {str(dtype).removeprefix('torch.')} T={T}: max |y - torch| {err:.1e}")
    return lines


def fixed_calibration(H: int, G: int, device: torch.device):
    """A correction that labels KV group 0 local and the others long-context whatever the query (b = 0, a = +-10)."""
    a = torch.tensor([10.0] * G + [-10.0] * (H - G), device=device)
    return Calibration(a[None], torch.zeros(1, H, device=device), None, {})


COLUMNS = [("shape", "shape", "{}"), ("T", "T", "{}"), ("B", "B", "{}"), ("budget", "budget", "{}"),
           ("flash_ms", "flash ms", "{:.3f}"), ("packed_ms", "packed ms", "{:.3f}"),
           ("qada_read", "qada read", "{:.3f}"), ("qada_ms", "qada ms", "{:.3f}"), ("qada_x", "qada x", "{:.2f}"),
           ("pages_read", "+pages read", "{:.3f}"), ("pages_ms", "+pages ms", "{:.3f}"),
           ("pages_x", "+pages x", "{:.2f}"), ("pages_bound", "+pages bound", "{:.1f}"),
           ("quest_read", "quest read", "{:.3f}"), ("quest_ms", "quest ms", "{:.3f}"), ("quest_x", "quest x", "{:.2f}"),
           ("pages_vs_quest", "+pages / quest", "{:.2f}"), ("no_sync", "no host sync", "{}"),
           ("pages_exact_ms", "+pages ms, exact", "{:.3f}"), ("pages_exact_same", "+pages same pages", "{:.3f}"),
           ("quest_exact_ms", "quest ms, exact", "{:.3f}"), ("quest_exact_same", "quest same pages", "{:.3f}"),
           ("pages_choice_us", "+pages choice us", "{:.1f}"), ("pages_topk_us", "+pages topk us", "{:.1f}"),
           ("quest_choice_us", "quest choice us", "{:.1f}"), ("quest_topk_us", "quest topk us", "{:.1f}")]


def bench(shapes: dict, lengths: list[int], batches: list[int], budgets: list[int], f: float, P: int,
          device: torch.device, reps: int) -> list[dict]:
    rows = []
    for shape, dims in shapes.items():
        for T in lengths:
            for B in batches:
                layer = Layer(**dims, B=B, T=T, P=P, f=f, device=device)
                dense = {"flash": math.nan, "packed": timed_ms(layer.packed, device, reps)}
                try:
                    layer.flash()
                    dense["flash"] = timed_ms(layer.flash, device, reps)
                except RuntimeError:  # no flash backend here (a CPU, or a torch without it)
                    pass
                best = min(t for t in dense.values() if not math.isnan(t))
                layer.check_labels(layer.qada()[1])
                qada_ms = timed_ms(layer.qada, device, reps)
                f_got = float(layer.full.float().mean())
                qada_read = f_got + (1 - f_got) * N_LOCAL / T
                for budget in budgets:
                    r = dict(shape=shape, T=T, B=B, budget=budget, P=P, f=f_got, flash_ms=dense["flash"],
                             packed_ms=dense["packed"], qada_read=qada_read, qada_ms=qada_ms, qada_x=best / qada_ms)
                    for name, quest in (("pages", False), ("quest", True)):
                        step = lambda quest=quest, budget=budget: layer.pages(budget, quest)  # noqa: E731
                        r[f"{name}_read"] = layer.read(budget, quest)
                        r[f"{name}_ms"] = timed_ms(step, device, reps)
                        r[f"{name}_x"] = best / r[f"{name}_ms"]
                        r[f"{name}_bound"] = 1 / r[f"{name}_read"]
                        r[f"{name}_sync_free"] = sync_free(step, device)
                        r[f"{name}_kernels"] = named_us(kernel_us(step, device)) if device.type == "cuda" else ""
                        r[f"{name}_exact_ms"], r[f"{name}_exact_same"] = exact_launch(layer, step, budget, quest,
                                                                                      device, reps)
                        r[f"{name}_choice_us"], r[f"{name}_topk_us"] = choice_us(layer, budget, quest, device, reps)
                    r["pages_vs_quest"] = r["quest_ms"] / r["pages_ms"]
                    r["no_sync"] = "yes" if sync_free(layer.qada, device) and r["pages_sync_free"] and \
                        r["quest_sync_free"] else "NO"
                    rows.append(r)
                    print(format_row(r), flush=True)
                del layer
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # up to 17 GB of cache at 128k, batch 32
    return rows


EXACT = dict(window=dict(LOW=False), bound=dict(LOW=False))  # the launches timed beside the default


def exact_launch(layer: Layer, step, budget: int, quest: bool, device: torch.device, reps: int) -> tuple[float, float]:
    """The step with the window's and the bounds' products in exact fp32, off the tensor cores (EXACT:
    decode_kernels.WINDOW_LAUNCH and BOUND_LAUNCH with LOW off): its ms, and the share of query heads that attend to the
    same pages with the same labels as at the default launch. NaN for a launch that fails to compile."""
    _, labels, chosen = layer.pages(budget, quest, inspect=True)
    try:
        with (launch(decode_kernels.WINDOW_LAUNCH, **EXACT["window"]),
              launch(decode_kernels.BOUND_LAUNCH, **EXACT["bound"])):
            _, exact_labels, exact_chosen = layer.pages(budget, quest, inspect=True)
            ms = timed_ms(step, device, reps)
    except Exception as e:  # noqa: BLE001 (a launch the compiler refuses is a finding, not a crash of the table)
        print(f"the exact launch failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        return math.nan, math.nan
    same = (chosen == exact_chosen).all(-1) & (labels == exact_labels)  # (B, H)
    return ms, float(same.float().mean())


def choice_us(layer: Layer, budget: int, quest: bool, device: torch.device, reps: int) -> tuple[float, float]:
    """The choice of pages alone, us: decode_kernels.choose_pages (one _page_select_kernel: each ranking's top budget //
    P pages and the KV head's list of them) beside torch.topk of the same scores, which it replaced (topk alone: without
    the count of its finite picks or Quest's union that came after it). The scores are random, -inf outside the long
    groups' candidates, as the bound kernel leaves them; both take time by the shapes, not the values."""
    W = candidates(layer.T, N_SINK, N_LOCAL, layer.P)
    n_sel = min(budget // layer.P, W)
    if n_sel == 0:
        return math.nan, math.nan
    R = layer.H if quest else layer.Hkv
    scores = torch.randn(layer.B, R, W, device=device, generator=torch.Generator(device=device).manual_seed(0))
    long = torch.ones_like(layer.full) if quest else layer.full  # (B, Hkv)
    scores.masked_fill_(~long.repeat_interleave(R // layer.Hkv, 1)[..., None], -math.inf)
    select = lambda: decode_kernels.choose_pages(scores, None, n_sel, layer.Hkv, ranked=False)  # noqa: E731
    topk = lambda: scores.topk(n_sel, dim=-1, sorted=not quest)  # noqa: E731 (Quest's union took them unsorted)
    return 1e3 * timed_ms(select, device, reps), 1e3 * timed_ms(topk, device, reps)


def format_row(r: dict) -> str:
    """A table row; n/a for what was not measured (NaN: a launch that failed to compile, no page to choose), as
    lab.bench_gpu's tables write it."""
    return "| " + " | ".join("n/a" if isinstance(r[key], float) and math.isnan(r[key]) else fmt.format(r[key])
                             for key, _, fmt in COLUMNS) + " |"


def write(out: Path, rows: list[dict], checks: list[str], device: torch.device, argv: list[str], f: float,
          P: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    header = "| " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    lines = [f"# Page selection in the fused kernel: attention only, one layer, bf16, pages of {P}", "",
             f"`python -m lab.bench_pages_gpu {shlex.join(argv)}`", "", setup_line(device), "",
             f"Labels fixed: a fraction {f} of the (row, KV head) pairs long-context (qada and +pages); quest: every "
             "pair. read: KV entries read per (row, KV head) over T (window, pages, scored statistics); x: speedup "
             "over the best of flash and packed dense; bound: 1 / read. CUDA graphs replayed, CUDA events, L2 "
             "flushed, median. exact: the window's and the bounds' products in exact fp32 off the tensor cores "
             "(decode_kernels.WINDOW_LAUNCH and BOUND_LAUNCH with LOW off); same pages: the share of query heads whose "
             "pages and label are the default launch's. choice us: the choice of pages alone "
             "(decode_kernels.choose_pages), beside torch's topk of the same scores, which it replaced.", "",
             *checks, "", header,
             "|" + "---|" * len(COLUMNS),
             *(format_row(r) for r in rows), ""]
    if any(r["pages_kernels"] for r in rows):  # profiled on CUDA only
        lines += ["Where a call's time goes: each kernel's device us per call, eager (torch.profiler over 20 calls run "
                  "back to back; the small torch operations by their CUDA kernels' names).", "",
                  "| shape | T | B | budget | path | each kernel's device us |", "|---|---|---|---|---|---|",
                  *(f"| {r['shape']} | {r['T']} | {r['B']} | {r['budget']} | {path} | {r[f'{name}_kernels']} |"
                    for r in rows for name, path in (("pages", "+pages"), ("quest", "quest"))), ""]
    (out / "pages.md").write_text("\n".join(lines))
    (out / "pages.json").write_text(json.dumps(rows, indent=1) + "\n")


DEFAULTS = {"lengths": "32768,131072", "batches": "1,8,32", "budgets": "1024,2048", "reps": 30}  # what --quick and
# --interpret-smoke set otherwise


def main(argv=None) -> int:
    p = Parser(prog="python -m lab.bench_pages_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for pages.md and pages.json (default: a new "
                   "runs/bench-gpu-pages/<time> folder)")
    p.add_argument("--lengths", type=lengths_above_window, default=None, help="context lengths T, each above the "
                   f"window (default {DEFAULTS['lengths']})")
    p.add_argument("--batches", type=ints, default=None, help=f"batch sizes (default {DEFAULTS['batches']})")
    p.add_argument("--budgets", type=ints, default=None, help=f"page budgets in tokens (default {DEFAULTS['budgets']})")
    p.add_argument("--page-size", type=int, default=16, choices=(16, 32, 64), help="tokens per page")
    p.add_argument("--fraction", type=float, default=0.35, help="share of long-context (row, KV head) pairs")
    p.add_argument("--reps", type=at_least(1), default=None, help=f"timed replays per measurement (default "
                   f"{DEFAULTS['reps']})")
    p.add_argument("--quick", action="store_true", help="Llama-3-8B only, 32k, batch 1 and 8, budget 1024, 10 reps "
                   "(under 2 minutes on an H100)")
    p.add_argument("--launch", type=launch_change, default={}, help="the kernels launched otherwise, as "
                   "decode_kernels.set_launch takes it, in JSON (lab.bench_gpu's --launch): '{\"window\": {\"LOW\": "
                   "false}, \"bound\": {\"LOW\": false}}' times the products in exact fp32 (default: the kernels' own)")
    p.add_argument("--interpret-smoke", action="store_true", help="tiny sizes on the CPU through Triton's interpreter "
                   "(needs TRITON_INTERPRET=1): the code paths and the self-check, no meaningful times")
    args = p.parse(argv)
    if isinstance(args, int):  # --help, or a bad argument
        return args
    if not 0 <= args.fraction <= 1:
        return fail(f"--fraction takes a share in [0, 1], got {args.fraction}")
    preset = [flag for flag, on in (("--quick", args.quick), ("--interpret-smoke", args.interpret_smoke)) if on]
    given = [f"--{name}" for name in DEFAULTS if getattr(args, name) is not None]
    if len(preset) == 2:
        return fail("--quick and --interpret-smoke each set the sizes: give one")
    if preset and given:  # the preset's sizes would silently replace the ones given
        return fail(f"{preset[0]} sets {', '.join(given)} itself: leave {'it' if len(given) == 1 else 'them'} out, "
                    f"or {preset[0]} out")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():  # said now, not after the timings
        return fail(f"--out {args.out} is a file; give a folder")
    if decode_kernels.triton is None:
        return fail("no triton (pip install triton)")
    smoke = args.interpret_smoke
    if smoke and not decode_kernels.INTERPRETED:
        return fail("--interpret-smoke runs the kernels through Triton's interpreter: set TRITON_INTERPRET=1")
    if not smoke and not torch.cuda.is_available():
        return fail("no CUDA here; --interpret-smoke (with TRITON_INTERPRET=1) runs the code paths on the CPU")
    try:  # said now, not after the timings; made once every other check has passed
        out = make_folder(args.out or fresh_folder("runs/bench-gpu-pages"))
    except ValueError as e:
        return fail(e)
    note_replaced(out, ["pages"])
    decode_kernels.set_launch(args.launch)
    device = torch.device("cpu" if smoke else "cuda")
    lengths = args.lengths or lengths_above_window(DEFAULTS["lengths"])
    batches, budgets = ([int(x) for x in (getattr(args, name) or DEFAULTS[name]).split(",")]
                        for name in ("batches", "budgets"))
    shapes, reps = SHAPES, args.reps or DEFAULTS["reps"]
    if args.quick:
        shapes, lengths, batches, budgets, reps = {"Llama-3-8B": SHAPES["Llama-3-8B"]}, [32768], [1, 8], [1024], 10
    if smoke:
        shapes, lengths, batches, budgets, reps = SMOKE_SHAPES, [600], [1, 2], [4 * args.page_size], 1
    checks = self_check(device, next(iter(shapes.values())), args.page_size)
    print("\n".join(checks), flush=True)
    rows = bench(shapes, lengths, batches, budgets, args.fraction, args.page_size, device, reps)
    write(out, rows, checks, device, list(sys.argv[1:] if argv is None else argv), args.fraction, args.page_size)
    print(f"wrote {out / 'pages.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
