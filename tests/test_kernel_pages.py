"""Page selection on the device (decode_kernels.fused_pages) against the torch page paths, attention.qada_pages and
attention.quest: for a batch of left-padded rows of different lengths, the same labels, the same chosen pages (held
against Quest's bound recomputed by its definition in float64) and the same output; the split programs read the
chosen pages' bulk positions and nothing else (counted, and a cache poisoned with NaN everywhere else); a planted
needle's page is chosen; and one step over the cache's capacity launches the same whatever T. On a machine without
CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py), on CPU tensors."""

import inspect
import json
import math
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import attention
import decode_kernels
from criterion import Calibration
from decode_kernels import fused_pages, fused_qada
from lab import bench_pages_gpu, kernel_resources
from lab.kernel_resources import compile_launches, nvidia_backend
from moments import FixedMoments, bulk_end
from pages import PageIndex, candidates, page_count, stacked
from tests.test_kernel import Launch, Recorded
from tests.test_pages import brute_pages, calibrations, moments_of, shares_by_hand, split, top

triton = pytest.importorskip("triton")

H, HKV, D = 6, 2, 16
G = H // HKV
N_SINK, N_LOCAL = 4, 32
# every kernel a step launches (test_graph_decode's graph emulation records these too)
KERNELS = ("_window_decide_kernel", "_page_bound_kernel", "_page_select_kernel",
           "_split_attention_kernel")
# Rows of a batch, (first position, context length): a long context not a multiple of any page, one just past the
# window (a single candidate page, reaching into the window), one in between, and one within the window.
ROWS = [(0, 301), (9, N_LOCAL + 1), (20, 150), (3, 20)]
T_MAX = 330  # the views run past every row's filled length: T comes from the device tensor `length`


def batch(seed=0, rows=ROWS, T_max=T_MAX, dtype=torch.float32):
    """q (n, H, D) and a cache (n, Hkv, T_max, D); each row's first position, filled length (int32) and context."""
    g = torch.Generator().manual_seed(seed)
    n = len(rows)
    q = torch.randn(n, H, D, generator=g) * 1.5
    k, v = torch.randn(n, HKV, T_max, D, generator=g), torch.randn(n, HKV, T_max, D, generator=g)
    start = torch.tensor([s for s, _ in rows], dtype=torch.int32)
    length = torch.tensor([s + t for s, t in rows], dtype=torch.int32)
    return q.to(dtype), k.to(dtype), v.to(dtype), start, length


def row_view(x, i, start, length):
    """Row i's filled context (Hkv, T, D), the view a torch path is given."""
    return x[i, :, int(start[i]):int(length[i])]


def page_bounds(k, start, length, P):
    """Each row's pages.PageIndex min and max keys, (n, Hkv, NP, D), padded past the row's pages (never candidates)
    to the pages of the cache's capacity."""
    NP = math.ceil((k.shape[2] - N_SINK) / P)
    lo, hi = torch.zeros(k.shape[0], HKV, NP, D, dtype=k.dtype), torch.zeros(k.shape[0], HKV, NP, D, dtype=k.dtype)
    for i in range(k.shape[0]):
        row_lo, row_hi = PageIndex(None, P, N_SINK).bounds(0, row_view(k, i, start, length))
        lo[i, :, :row_lo.shape[1]], hi[i, :, :row_hi.shape[1]] = row_lo, row_hi
    return lo, hi


def combine_of(method):
    """How the registry entry `method` combines a group's bounds: its `combine` keyword, from its name."""
    return "sum" if "sum" in method else "share" if "share" in method else "max"


def run_kernel(method, q, k, v, start, length, P, budget, calibration=None, tau=0.3, budget_frac=None, **kw):
    """fused_pages as `method` (an attention.PATHS page entry) runs it: Quest alone, or calibrated QAdA + pages."""
    n = q.shape[0]
    rows = torch.arange(n, dtype=torch.int32)
    common = dict(length=length, budget=budget, budget_frac=budget_frac, block_n=max(32, P), **kw)
    if method.startswith("quest"):
        return fused_pages(q, k, v, rows, start, N_SINK, N_LOCAL, page_bounds(k, start, length, P), P, **common)
    forms = [moments_of(row_view(k, i, start, length)).quadratic_form(0, None) for i in range(n)]
    A, b = torch.stack([f[0] for f in forms]), torch.stack([f[1] for f in forms])
    return fused_pages(q, k, v, rows, start, N_SINK, N_LOCAL, page_bounds(k, start, length, P), P, form=(A, b),
                       tau=torch.full((n,), tau, dtype=torch.float64), correction=calibration.layer(0),
                       combine=combine_of(method), **common)


def run_torch(method, q, k, v, P, budget, calibration=None, tau=0.3, budget_frac=None):
    """The torch path on one row's views: (y, labels, read)."""
    inputs = dict(layer=0, n_sink=N_SINK, n_local=N_LOCAL, pages=PageIndex(None, P, N_SINK), budget=budget,
                  budget_frac=budget_frac, page_size=P)
    if method.startswith("quest"):
        return attention.quest(q, k, v, **inputs)
    return attention.qada_pages(q, k, v, **inputs, tau=tau, moments=moments_of(k), calibration=calibration,
                                combine=combine_of(method))


def pages_by_hand(method, q, k, P, n_read, labels):
    """(H, m) bool: the pages each query head attends to, from Quest's bound by its definition in float64 on the
    keys themselves: each head's own top n_read (Quest), or its group's, heads' bounds combined, for a long group."""
    T = k.shape[1]
    m = candidates(T, N_SINK, N_LOCAL, P)
    lo, hi = brute_pages(k.double(), N_SINK, P)
    qd = q.double().view(HKV, G, 1, D)
    bound = torch.maximum(qd * lo[:, None, :m], qd * hi[:, None, :m]).sum(-1)  # (Hkv, G, m)
    if n_read <= 0 or m == 0:
        return torch.zeros(H, m, dtype=torch.bool)
    if method.startswith("quest"):
        return top(bound.view(H, m), n_read)
    if "share" in method:  # each head's bound as a share of the window's true mass plus every page at its bound
        bound = shares_by_hand(q, k, P).view(HKV, G, m)
    group = bound.sum(1) if "sum" in method else bound.amax(1)  # (Hkv, m)
    long = ~labels.view(HKV, G)[:, 0]
    return (top(group, n_read) & long[:, None]).repeat_interleave(G, 0)


def bulk_read_by_hand(chosen, T, P):
    """Bulk positions each KV head reads: those of the union of its heads' chosen pages (H, m), up to the bulk's end."""
    end = bulk_end(T, N_SINK, N_LOCAL)
    size = torch.tensor([min(P, end - (N_SINK + j * P)) for j in range(chosen.shape[1])], dtype=torch.long)
    return (chosen.view(HKV, G, -1).any(1).long() * size).sum(1)  # (Hkv,)


def check_against_torch(method, P, budget, calibration=None, budget_frac=None, seed=0, rows=ROWS,
                        dtype=torch.float32, **kw):
    """The batch through the kernel, each row through the torch path: labels, chosen pages, output and read."""
    q, k, v, start, length = batch(seed, rows, dtype=dtype)
    y, labels, read, chosen = run_kernel(method, q, k, v, start, length, P, budget, calibration,
                                         budget_frac=budget_frac, with_read=True, inspect=True, **kw)
    W = candidates(T_MAX, N_SINK, N_LOCAL, P)
    assert chosen.shape == (len(rows), H, W)
    for i in range(len(rows)):
        kk, vv = row_view(k, i, start, length), row_view(v, i, start, length)
        T = kk.shape[1]
        want_y, want_labels, want_read = run_torch(method, q[i], kk, vv, P, budget, calibration,
                                                   budget_frac=budget_frac)
        assert torch.equal(labels[i], want_labels), i
        assert read[i].tolist() == want_read.tolist(), i  # what HeadStats counts, as the torch path reports it
        n_read = page_count(T, P, budget, budget_frac)
        want = pages_by_hand(method, q[i], kk, P, n_read, want_labels)
        m = want.shape[1]
        assert torch.equal(chosen[i, :, :m], want) and not chosen[i, :, m:].any(), i
        # counted in the kernels as they load: the window, each candidate's statistics where they decide something
        # (for a group that reads), the chosen pages' bulk positions
        scored = m if 0 < n_read < m else 0
        reads = ~want_labels.view(HKV, G).all(1)  # (Hkv,): the groups that read
        assert torch.equal(read[i], min(T, N_LOCAL) + scored * reads + bulk_read_by_hand(want, T, P)), i
        tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(y[i], want_y, **tol)
    return labels, chosen


# --- the kernel against the torch paths ----------------------------------------------------------------------


@pytest.mark.parametrize("P", [16, 32, 64])
@pytest.mark.parametrize("budget", [0, 1, 3, 1000], ids=["none", "a-page", "three-pages", "everything"])
@pytest.mark.parametrize("method", ["quest", "qada_pages", "qada_pages_sum", "qada_pages_share"])
def test_a_batch_of_rows_equals_the_torch_path(method, P, budget):
    """Budgets in pages: none (the window only), one page, three, and more than any row holds (dense). QAdA + pages
    with a correction that makes group 0 local and group 1 long-context in every row: a local group reads no page."""
    labels, chosen = check_against_torch(method, P, budget * P if budget < 1000 else 10_000, split(True))
    n_long = sum(1 for s, t in ROWS if t > N_LOCAL)
    if method == "quest":  # every row past its window reads pages, none labelled local
        assert not labels.any() and int(chosen.any(-1).sum()) == (H * n_long if budget else 0)
    else:  # group 0 local in every row; group 1 long-context where the row has a bulk
        assert int(labels.sum()) == G * n_long + H * (len(ROWS) - n_long)


@pytest.mark.parametrize("method", ["quest", "qada_pages", "qada_pages_share"])
def test_a_bf16_batch_chooses_the_pages_of_the_exact_bound(method):
    """A bf16 query and cache, as a GPU decodes: there the window's and the bounds' products run on tensor cores
    (decode_kernels.WINDOW_LAUNCH and BOUND_LAUNCH, LOW), exact in fp32 like the interpreter's ieee products, so the
    labels and the chosen pages are still those of Quest's bound in float64, and the output is the torch path's within
    bf16 rounding."""
    check_against_torch(method, 16, 3 * 16, split(True), dtype=torch.bfloat16)


@pytest.mark.parametrize("method", ["quest", "qada_pages"])
def test_a_merge_over_several_chunks_of_splits(method, monkeypatch):
    """Each long group's pages in splits of two (one tile of block_n // P pages), merged with the window two splits
    at a time (MERGE_CHUNK): up to 18 pages in 9 splits, 5 chunks, the last one partial."""
    monkeypatch.setattr(decode_kernels, "MERGE_CHUNK", 2)
    check_against_torch(method, 16, 10_000, split(True), split=2)


@pytest.mark.parametrize("method", ["qada_pages", "qada_pages_sum", "qada_pages_share"])
@pytest.mark.parametrize("which", [0, 2], ids=["as-qada", "mean-and-all-disagree"])
def test_qada_pages_decides_as_the_torch_path_with_other_corrections(method, which):
    """Eq. 7 uncorrected (the data decide) and a correction whose mean share rule disagrees with the all-local one."""
    check_against_torch(method, 16, 48, calibrations()[which], seed=3)


@pytest.mark.parametrize("method", ["quest", "qada_pages"])
@pytest.mark.parametrize("frac", [0.1, 0.5, 0.32])
def test_a_budget_as_a_fraction_of_each_rows_context(method, frac):
    """budget_frac: each row reads floor(frac T) // P pages of its own T, the grid set by the capacity's, counted in
    float64 as pages.page_count counts them (0.32 of the 150-token row is 48 tokens, three pages; in float32, 47.99)."""
    check_against_torch(method, 16, None, split(True), budget_frac=frac, seed=4)


def test_a_budget_share_is_counted_in_float64():
    """0.7 of a 1440-token context is 1007.99999999999993 tokens in float64, 62 pages of 16, as pages.page_count
    counts; a float32 product rounds it to 1008, 63 pages. Every head of both rows (Quest: each head its own pages)
    chooses 62."""
    rows = [(0, 1440), (7, 1440)]  # (first position, context): both of 1440 positions
    q, k, v, start, length = batch(4, rows, T_max=1450)
    _, _, chosen = run_kernel("quest", q, k, v, start, length, 16, None, budget_frac=0.7, inspect=True)
    assert page_count(1440, 16, None, 0.7) == 62
    assert chosen.sum(-1).tolist() == [[62] * H] * 2


@pytest.mark.parametrize("method", ["quest", "qada_pages"])
def test_a_budget_that_covers_everything_is_dense(method):
    """Every group long-context (tau 1) and every page read: attention over the whole context, the read every bulk
    position."""
    q, k, v, start, length = batch(5)
    y, labels, read = run_kernel(method, q, k, v, start, length, 32, 10_000, calibrations()[0], tau=1.0,
                                 with_read=True)
    for i, (s, t) in enumerate(ROWS):
        kk, vv = row_view(k, i, start, length), row_view(v, i, start, length)
        torch.testing.assert_close(y[i], attention.dense(q[i], kk, vv)[0], atol=2e-5, rtol=1e-4)
        if t > N_LOCAL:
            assert not labels[i].any() and read[i].tolist() == [t] * HKV  # the window and every bulk position


@pytest.mark.parametrize("method", ["quest", "qada_pages"])
@pytest.mark.parametrize("P", [16, 64])
def test_a_planted_needle_s_page_is_chosen(method, P):
    """One bulk key far along head 0's query, one page of budget: the needle's page is read, and head 0's output is
    then its value, which the window alone misses."""
    rows = [(0, 400), (7, 300)]
    q, k, v, start, length = batch(13, rows, T_max=410)
    needles = [150, 90]  # positions in each row's context
    for i, pos in enumerate(needles):
        k[i, 0, int(start[i]) + pos] = 4 * math.sqrt(D) * q[i, 0] / q[i, 0].norm()
    y, labels, chosen = run_kernel(method, q, k, v, start, length, P, P, split(False), tau=0.5, inspect=True)
    for i, pos in enumerate(needles):
        assert chosen[i, 0, (pos - N_SINK) // P] and int(chosen[i, 0].sum()) == 1
        kk, vv = row_view(k, i, start, length), row_view(v, i, start, length)
        assert (y[i, 0] - vv[0, pos]).abs().max() < 0.05
        y_local, _ = attention.local(q[i], kk, vv, n_sink=N_SINK, n_local=N_LOCAL)
        assert (y_local[0] - vv[0, pos]).abs().max() > 0.3


@pytest.mark.parametrize("P, dtype", [(4, torch.float32), (4, torch.bfloat16), (16, torch.float32)])
def test_the_step_folds_each_appended_key_into_its_page(P, dtype):
    """pages.stacked, then fused_pages with `fold` step by step, the static decode loop's page statistics: rows
    left-padded to different first positions (one prompt still within its sinks, one ending on a page's last key, one
    mid-page), their indexes up to date, behind the cache or never filled; the key each step appended at the device
    length folded into its own row's page by the window kernel; after every step each row's pages equal brute force
    over its filled part, the pages past it still empty, and a step run twice (a graph's warm-up) leaves what once
    does. An index ahead of the cache is refused, and so are bounds that hold the candidate pages only: a key up to
    the capacity folds into a page past them."""
    B, capacity = 3, 60
    prompt = [N_SINK - 1, N_SINK + 2 * P, 19]  # each row's prompt length
    T0 = N_SINK + 2 * P + 7
    start = [T0 - t for t in prompt]  # right-aligned, as KVCache.stack leaves them
    g = torch.Generator().manual_seed(P)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    k, v = (torch.randn(B, HKV, capacity, D, generator=g).to(dtype) for _ in range(2))
    indexes = [PageIndex(None, P, N_SINK) for _ in range(B)]
    indexes[0].bounds(0, k[0, :, start[0]:T0])  # up to date
    indexes[1].bounds(0, k[1, :, start[1]:T0 - P - 1])  # behind: the keys after it are folded in by stacked
    lo, hi = stacked(indexes, 0, k, start, T0)  # the third: never filled
    assert lo.shape == (B, HKV, math.ceil((capacity - N_SINK) / P), D)
    first, rows = torch.tensor(start, dtype=torch.int32), torch.arange(B, dtype=torch.int32)
    for T in range(T0, min(capacity, T0 + 2 * P + 2) + 1):  # every row across a page's end
        if T > T0:
            for _ in range(2):  # a graph's warm-up runs the step twice
                fused_pages(q, k, v, rows, first, N_SINK, N_LOCAL, (lo, hi), P, budget=P,
                            length=torch.tensor([T], dtype=torch.int32), fold=True)
        for b in range(B):
            want_lo, want_hi = brute_pages(k[b, :, start[b]:T], N_SINK, P)
            n = want_lo.shape[1]
            assert torch.equal(lo[b, :, :n], want_lo) and torch.equal(hi[b, :, :n], want_hi), (T, b)
            assert (lo[b, :, n:] == math.inf).all() and (hi[b, :, n:] == -math.inf).all(), (T, b)
    with pytest.raises(ValueError, match="rolled back"):  # the indexes now hold up to T0; a cache at T0 - 1 is behind
        stacked(indexes, 0, k, start, T0 - 1)
    W = candidates(capacity, N_SINK, N_LOCAL, P)
    with pytest.raises(ValueError, match=f"NP >= {lo.shape[2]} pages"):
        fused_pages(q, k, v, rows, first, N_SINK, N_LOCAL, (lo[:, :, :W], hi[:, :, :W]), P, budget=P, fold=True)


# --- what is read ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["quest", "qada_pages"])
def test_nothing_but_the_window_and_the_chosen_pages_is_read(method):
    """Every cache position that is neither in a row's window nor in a page its KV head chose (a local group's whole
    bulk, the pages not chosen, the padding and the positions past T) is NaN, which any read would carry into the
    output: the output is finite and the clean cache's."""
    P = 16
    q, k, v, start, length = batch(7)
    y, labels, chosen = run_kernel(method, q, k, v, start, length, P, 4 * P, split(True), inspect=True)
    k_bad, v_bad = torch.full_like(k, math.nan), torch.full_like(v, math.nan)
    for i, (s, t) in enumerate(ROWS):
        window = attention.window_mask(t, N_SINK, N_LOCAL)
        union = chosen[i].view(HKV, G, -1).any(1)  # (Hkv, W)
        for h in range(HKV):
            keep = window.clone()
            for pos in range(N_SINK, bulk_end(t, N_SINK, N_LOCAL)):
                keep[pos] |= bool(union[h, (pos - N_SINK) // P])
            k_bad[i, h, s:s + t][keep], v_bad[i, h, s:s + t][keep] = k[i, h, s:s + t][keep], v[i, h, s:s + t][keep]
    pages = page_bounds(k, start, length, P)  # the statistics of the clean keys, as the index holds them
    y_bad, labels_bad = fused_pages(q, k_bad, v_bad, torch.arange(len(ROWS), dtype=torch.int32), start, N_SINK,
                                    N_LOCAL, pages, P, budget=4 * P, length=length, block_n=32,
                                    **({} if method == "quest" else qada_inputs(k, start, length, split(True))))
    assert torch.isfinite(y_bad).all() and torch.equal(labels_bad, labels)
    assert torch.equal(y_bad, y)  # masked loads: what is not read adds exactly nothing


def qada_inputs(k, start, length, calibration, tau=0.3):
    forms = [moments_of(row_view(k, i, start, length)).quadratic_form(0, None) for i in range(k.shape[0])]
    return dict(form=(torch.stack([f[0] for f in forms]), torch.stack([f[1] for f in forms])),
                tau=torch.full((k.shape[0],), tau, dtype=torch.float64), correction=calibration.layer(0))


@pytest.mark.parametrize("method", ["quest", "qada_pages"])
def test_the_entries_read_are_counted_into_a_callers_buffer_whatever_it_held(method):
    """fused_pages' read_out (the static loop's buffer of the step, reused every step): the kernels count into it, the
    window kernel setting what the others add to, and it is what the call returns."""
    q, k, v, start, length = batch(3)
    want = run_kernel(method, q, k, v, start, length, 16, 48, split(True), with_read=True)[2]
    held = torch.full((len(ROWS), HKV), 10**6, dtype=torch.int64)  # a previous step's, or anything
    got = run_kernel(method, q, k, v, start, length, 16, 48, split(True), with_read=True, read_out=held)[2]
    assert got is held and torch.equal(held, want)


@pytest.mark.parametrize("per_head", [True, False], ids=["quest", "groups"])
@pytest.mark.parametrize("ranked", [False, True], ids=["tokens", "fraction"])
def test_the_chosen_pages_are_each_rankings_best_listed_once_in_page_order(ranked, per_head):
    """decode_kernels.choose_pages, one ranking per query head (Quest) or per group: each KV head's list is the set of
    pages its rankings chose, by hand from the scores (each ranking's n_read best finite ones, ties to the lower page;
    every n_sel with a budget in tokens), in page order, each with the bits of exactly the heads that chose it (Quest);
    past the list, no page (W) and no head. Rows with few candidates, none, more chosen pages than one head's budget,
    and equal scores across the cut, zeros of both signs among them."""
    g = torch.Generator().manual_seed(5)
    n, W, n_sel = 5, 37, 6
    R = H if per_head else HKV
    scores = torch.randn(n, R, W, generator=g)
    scores[0, :, 9:] = -math.inf  # 9 candidates
    scores[1] = -math.inf  # a local row: none
    scores[2, :, 4:] = -math.inf  # fewer candidates than n_sel
    scores[3, :, [2, 5, 11, 30]] = 5.0  # four best, tied
    scores[3, :, [7, 8, 20, 21, 33]] = torch.tensor([0.0, -0.0, 0.0, -0.0, 0.0])  # five equal, across every cut
    # from 5 to 8 (a zero's sign is no order), the rest below them
    scores[3, :, [0, 1, 3, 4]] = -3.0 - torch.rand(R, 4, generator=g)
    scores[3, :, 34:] = -math.inf
    others = [p for p in range(34) if p not in (0, 1, 2, 3, 4, 5, 7, 8, 11, 20, 21, 30, 33)]
    scores[3, :, others] = -5.0 - torch.rand(R, len(others), generator=g)
    n_read = torch.tensor([6, 6, 3, 5, 2] if ranked else [6] * n, dtype=torch.int32)
    ids, heads, n_valid = decode_kernels.choose_pages(scores, n_read, n_sel, HKV, ranked=ranked)
    U = ids.shape[2]
    assert U == (min(G * n_sel, W) if per_head else n_sel) and (heads is None) != per_head
    per_kv = R // HKV
    for b in range(n):
        for kv in range(HKV):
            chose = {}  # page -> the bits of the rankings that chose it
            for j in range(per_kv):
                row = scores[b, kv * per_kv + j]
                order = row.argsort(descending=True, stable=True)[:int(n_read[b])]
                for p in [int(p) for p in order if row[p] > -math.inf]:
                    chose[p] = chose.get(p, 0) | 1 << j
            m = int(n_valid[b, kv])
            assert m == len(chose), (b, kv)
            assert ids[b, kv, :m].tolist() == sorted(chose), (b, kv)
            assert ids[b, kv, m:].tolist() == [W] * (U - m)
            if per_head:
                assert heads[b, kv, :m].tolist() == [chose[p] for p in sorted(chose)]
                assert heads[b, kv, m:].tolist() == [0] * (U - m)
    assert n_valid[3].tolist() == [int(n_read[3])] * HKV  # the ties cut to fit, not all of them taken


def test_choose_pages_lists_no_more_pages_than_the_rankings_have_and_refuses_strided_scores():
    """Quest's lists hold at most the W candidate pages, however many its G rankings' budgets add up to (G n_sel
    above W here); scores without unit stride over the pages, or not fp32, are one line before the launch."""
    scores = torch.randn(2, H, 5, generator=torch.Generator().manual_seed(1))
    ids, heads, n_valid = decode_kernels.choose_pages(scores, torch.full((2,), 4, dtype=torch.int32), 4, HKV)
    assert ids.shape == heads.shape == (2, HKV, 5) and n_valid.tolist() == [[5] * HKV] * 2  # G * 4 > 5: all of them
    for bad in (scores.transpose(1, 2).contiguous().transpose(1, 2), scores.double()):
        with pytest.raises(ValueError, match="^choose_pages reads fp32 scores with unit stride over each ranking"):
            decode_kernels.choose_pages(bad, None, 4, HKV, ranked=False)


def test_page_split_fills_a_gpu_with_whole_tiles(monkeypatch):
    """Pages per split program: at most 64 programs a group where the GPU has room for more (132 multiprocessors, one
    long group), a power of two, never less than a tile (few pages on many groups)."""
    cpu = torch.device("cpu")  # counts 8 multiprocessors: 32 slots
    assert decode_kernels.page_split(8, 10, 16, cpu) == 16  # 4 programs a group would take 4 pages each
    assert decode_kernels.page_split(1, 1000, 16, cpu) == 32  # 32 programs of 32 pages
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    assert decode_kernels.page_split(1, 4096, 16, torch.device("cuda")) == 64  # 64 programs, not 528


def test_the_kernel_path_reads_nothing_back_to_the_host(monkeypatch):
    """With the kernels stubbed out, every Tensor method that reads a value back to the host raises, and both modes
    still go through: the choice of pages and the count of what was read stay on the device."""
    q, k, v, start, length = batch(1)
    pages = page_bounds(k, start, length, 16)
    inputs = qada_inputs(k, start, length, split(True))
    launches = []
    for name in KERNELS:
        monkeypatch.setattr(decode_kernels, name, Launch(launches))

    def no_sync(*args, **kwargs):
        raise AssertionError("a value was read back to the host")
    for method in ("tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, method, no_sync)
    rows = torch.arange(len(ROWS), dtype=torch.int32)
    for extra in ({}, inputs):
        for budget in (dict(budget=48), dict(budget_frac=0.2)):
            fused_pages(q, k, v, rows, start, N_SINK, N_LOCAL, pages, 16, length=length, with_read=True, **budget,
                        **extra)
    assert len(launches) == 16  # four kernels each: window, bounds, choice, split


@pytest.mark.parametrize("method", ["quest", "qada_pages"])
@pytest.mark.parametrize("budget", [dict(budget=48), dict(budget_frac=0.3)], ids=["tokens", "fraction"])
def test_a_step_over_the_capacity_launches_the_same_whatever_T(method, budget, monkeypatch):
    """The filled lengths in a device tensor, advanced in place by one: the kernels get the same grids, Python
    values and buffers (temporaries by dtype, shape and strides), so one captured step replays as the cache fills; and
    each step's output is what the rows' views sliced to T give."""
    q, k, v, start, length = batch(9)
    P = 16
    pages = page_bounds(k, start, length + 1, P)  # the index after the next key, as a step finds it
    extra = {} if method == "quest" else qada_inputs(k, start, length, split(True))
    rows = torch.arange(len(ROWS), dtype=torch.int32)
    launches = []
    named = {x.data_ptr(): name for name, x in dict(q=q, k=k, v=v, rows=rows, start=start, length=length,
                                                       lo=pages[0], hi=pages[1]).items()}
    for name in KERNELS:
        monkeypatch.setattr(decode_kernels, name, Recorded(getattr(decode_kernels, name), launches, named))
    outputs = []
    for step in range(2):
        y, labels = fused_pages(q, k, v, rows, start, N_SINK, N_LOCAL, pages, P, length=length, block_n=32, **budget,
                                **extra)
        outputs.append((y.clone(), labels.clone(), length.clone()))
        length.add_(1)
    n = len(KERNELS)  # window, bounds, choice, split
    assert len(launches) == 2 * n and launches[:n] == launches[n:]
    monkeypatch.undo()
    for y, labels, lengths in outputs:
        for i in range(len(ROWS)):
            end = int(lengths[i])
            sliced = fused_pages(q[i:i + 1], k[i:i + 1, :, :end], v[i:i + 1, :, :end], rows[:1] * 0,
                                 start[i:i + 1], N_SINK, N_LOCAL, tuple(x[i:i + 1] for x in pages), P, block_n=32,
                                 **budget, **one_row(extra, i))
            torch.testing.assert_close(y[i], sliced[0][0], atol=2e-6, rtol=1e-5)
            assert torch.equal(labels[i], sliced[1][0])
    assert not torch.equal(outputs[0][0], outputs[1][0])


def one_row(qada, i):
    """qada_inputs' of row i alone (empty for Quest)."""
    if not qada:
        return {}
    A, b = qada["form"]
    return dict(form=(A[i:i + 1], b[i:i + 1]), tau=qada["tau"][i:i + 1], correction=qada["correction"])


@pytest.mark.parametrize("method", ["quest", "qada_pages"])
def test_queries_in_another_order_than_the_cache_rows_write_their_rows_of_out(method):
    """rows maps query i to cache row rows[i] (BatchAttention's live rows); with `out` its result lands in
    out[rows[i]]: the same as the rows in order, bit for bit."""
    q, k, v, start, length = batch(11)
    P, n = 16, len(ROWS)
    pages = page_bounds(k, start, length, P)
    extra = {} if method == "quest" else qada_inputs(k, start, length, split(True))
    rows = torch.arange(n, dtype=torch.int32)
    y, labels = fused_pages(q, k, v, rows, start, N_SINK, N_LOCAL, pages, P, budget=48, length=length, block_n=32,
                            **extra)
    order = torch.tensor([2, 0, 3, 1])
    out = torch.full_like(q, math.nan)
    picked = {} if method == "quest" else dict(form=tuple(x[order] for x in extra["form"]), tau=extra["tau"][order],
                                                 correction=extra["correction"])
    got, labels_got = fused_pages(q[order], k, v, order.int(), start[order], N_SINK, N_LOCAL,
                                  tuple(x[order] for x in pages), P, budget=48, length=length[order], block_n=32,
                                  out=out, **picked)
    assert got is out and torch.equal(out, y) and torch.equal(labels_got, labels[order])


def test_bad_arguments_are_refused():
    q, k, v, start, length = batch(0)
    rows = torch.arange(len(ROWS), dtype=torch.int32)
    pages = page_bounds(k, start, length, 16)
    with pytest.raises(ValueError, match="power of two"):
        fused_pages(q, k, v, rows, start, N_SINK, N_LOCAL, pages, 24, budget=48)
    with pytest.raises(ValueError, match="NP >="):
        fused_pages(q, k, v, rows, start, N_SINK, N_LOCAL, (pages[0][:, :, :3], pages[1][:, :, :3]), 16, budget=48)
    with pytest.raises(ValueError, match="one of them"):
        fused_pages(q, k, v, rows, start, N_SINK, N_LOCAL, pages, 16, budget=48, budget_frac=0.1)
    with pytest.raises(ValueError, match="combine"):
        fused_pages(q, k, v, rows, start, N_SINK, N_LOCAL, pages, 16, budget=48, combine="mean")
    with pytest.raises(ValueError, match="read_out"):
        fused_pages(q, k, v, rows, start, N_SINK, N_LOCAL, pages, 16, budget=48, with_read=True,
                    read_out=torch.zeros(len(ROWS), HKV, dtype=torch.int32))


# --- the tensor-core launches, compiled for a GPU without one -------------------------------------------------


@pytest.mark.skipif(nvidia_backend() is None, reason="this Triton has no NVIDIA backend or finds no ptxas")
@pytest.mark.parametrize("method", ["quest", "qada_pages", "qada_pages_frac", "qada", "qada-pdl", "qada-unroll",
                                    "qada-spread", "qada-form-first", "qada-form-apart", "qada_pages-form-apart"])
def test_the_tensor_core_launches_compile_for_a_gpu(method, monkeypatch):
    """The launches a GPU runs with a bf16 query and cache (decode_kernels.WINDOW_LAUNCH and BOUND_LAUNCH with LOW, the
    split kernel on tensor cores) compile for an H100 here, where the interpreter never runs them: the bounds' LOW form
    once failed to compile on the GPU only (tl.maximum of a bf16 tile gives fp32 in Triton 3.6, and tl.dot refuses mixed
    operands). Each kernel of the step is captured at its real launch and compiled from it; "qada-pdl" as an H100 with
    decode_kernels.SPLIT_LAUNCH's PDL launches it (griddepcontrol, which the interpreter cannot run), "qada-unroll" with
    the window kernel's loops unrolled (WINDOW_LAUNCH's UNROLL, which the interpreter ignores), "qada-spread" with the
    split programs dealt out to the long groups (SPLIT_LAUNCH's SPREAD), "qada-form-first" with the form computed
    before the window (WINDOW_LAUNCH's FORM_FIRST), "-form-apart" beside it, by programs of their own (FORM_APART:
    an acquire-release count says which part is the last to finish, the one that decides); the page steps as the
    static loop runs them, the appended key folded into its page and the entries read counted (int64 atomic adds);
    and each with the labels written into a record of every step at a device step index, as the static loop has
    them written; "_frac" with a budget_frac, each row's page count worked out in float64 by the bound kernel."""
    launches = []
    for name in KERNELS:
        monkeypatch.setattr(decode_kernels, name, Launch(launches, getattr(decode_kernels, name)))
    monkeypatch.setattr(decode_kernels, "INTERPRETED", False)  # tensor_cores: what a GPU would launch
    monkeypatch.setitem(decode_kernels.WINDOW_LAUNCH, "LOW", True)  # whatever QADA_TEST_LAUNCH says
    monkeypatch.setitem(decode_kernels.BOUND_LAUNCH, "LOW", True)
    monkeypatch.setattr(decode_kernels, "pdl", lambda q: method == "qada-pdl")
    monkeypatch.setitem(decode_kernels.WINDOW_LAUNCH, "UNROLL", 4 if method == "qada-unroll" else 1)
    monkeypatch.setitem(decode_kernels.SPLIT_LAUNCH, "SPREAD", 4 if method == "qada-spread" else 0)
    monkeypatch.setitem(decode_kernels.WINDOW_LAUNCH, "FORM_FIRST", method == "qada-form-first")
    apart = method.endswith("-form-apart")
    monkeypatch.setitem(decode_kernels.WINDOW_LAUNCH, "FORM_APART", apart)
    method = method.replace("qada_pages-form-apart", "qada_pages")  # its step as qada_pages', FORM_APART set above
    q, k, v, start, length = batch(0, dtype=torch.bfloat16)
    history = (torch.zeros(3, len(ROWS), H, dtype=torch.bool), torch.ones(1, dtype=torch.long))  # as the static loop
    if method.startswith("qada-") or method == "qada":
        rows = torch.arange(len(ROWS), dtype=torch.int32)
        A, b = torch.zeros(len(ROWS), HKV, D, D), torch.zeros(len(ROWS), HKV, D)
        fused_qada(q, k, v, rows, start, N_SINK, N_LOCAL, (A, b), torch.full((len(ROWS),), 0.5, dtype=torch.float64),
                   length=length, block_n=32, history=history)
    else:
        budget = dict(budget=None, budget_frac=0.3) if method.endswith("_frac") else dict(budget=48)
        run_kernel(method, q, k, v, start, length, 16, calibration=split(True), fold=True, with_read=True,
                   history=history, **budget)
    assert [kernel.fn.__name__ for kernel, *_ in launches] == \
        [n for n in KERNELS if not method.startswith("qada") or method.startswith("qada_pages") or
         n not in ("_page_bound_kernel", "_page_select_kernel")]
    assert all(kwargs.get("LOW") is True for kernel, *_, kwargs in launches  # the products' kernels
               if kernel.fn.__name__ != "_page_select_kernel")
    assert all(kwargs.get("PDL", False) == (method == "qada-pdl") for *_, kwargs in launches)
    window = next(launch for launch in launches if launch[0].fn.__name__ == "_window_decide_kernel")
    assert window[3]["FORM_APART"] == apart and (window[1][2] > 1) == apart  # the launch asked for, its grid's parts
    status, errors = compile_launches(launches)
    assert status == 0, errors[-3000:]


def test_a_launch_is_compiled_as_the_jit_specializes_it_on_a_gpu():
    """lab.kernel_resources.specs marks what Triton's JIT marks at a launch: a 16-byte aligned tensor and an int
    divisible by 16 as such, an int of 1 as a constant, an unaligned view and other ints as neither. Compiled without
    these, the window kernel's loop was not software-pipelined (its bf16 loads not provably 4-byte aligned, no
    asynchronous copies), and its registers and spills differed from the GPU's."""
    kernel, grid, args, kwargs = kernel_resources.step_launches()["qada"][0]
    names = list(inspect.signature(kernel.fn).parameters)
    values = dict(zip(names, args)) | kwargs
    name, signature, constexprs, aligned, options = kernel_resources.specs([(kernel, grid, args, kwargs)])[0]
    assert name == "_window_decide_kernel" and values["skt"] == 128 and {"K", "V", "Q", "skt"} <= set(aligned)
    assert signature["K"] == "*bf16" and signature["skt"] == "i32" and "skt" not in constexprs
    values.update(K=values["K"].view(-1)[1:], skt=1, svt=7)  # a view one element in, a unit and an odd stride
    name, signature, constexprs, aligned, options = kernel_resources.specs([(kernel, grid, (), values)])[0]
    assert "K" not in aligned and "V" in aligned and "svt" not in aligned and signature["svt"] == "i32"
    assert signature["skt"] == "constexpr" and constexprs["skt"] == 1


def test_a_captured_step_takes_the_launch_asked_for_and_puts_the_kernels_back():
    """step_launches with the window kernel's launch changed compiles that launch: its options (warps, pipeline
    stages) as asked, the other kernels' as they were, tensor cores on; a constexpr the launch leaves out is
    specialized to its default. recorded puts decode_kernels' kernels and its interpreter flag back, also when the
    step raises."""
    names = ("_window_decide_kernel", "_split_attention_kernel", "_page_bound_kernel", "_page_select_kernel",
             "INTERPRETED")
    before = {name: getattr(decode_kernels, name) for name in names}
    with pytest.raises(RuntimeError, match="stopped"):
        with kernel_resources.recorded([]):
            raise RuntimeError("stopped")
    assert {name: getattr(decode_kernels, name) for name in names} == before
    default = kernel_resources.specs(kernel_resources.step_launches()["qada"])
    changed = kernel_resources.specs(kernel_resources.step_launches(dict(num_stages=1, num_warps=8))["qada"])
    assert [s[0] for s in changed] == ["_window_decide_kernel", "_split_attention_kernel"]
    assert default[0][2]["LOW"] is True  # bf16 products on tensor cores, as compiled (the interpreter has them off)
    assert changed[0][4] == {"num_warps": 8, "num_stages": 1} != default[0][4] and changed[1] == default[1]
    assert {name: getattr(decode_kernels, name) for name in names} == before
    kernel, _, args, kwargs = kernel_resources.step_launches()["qada"][0]
    params = inspect.signature(kernel.fn).parameters
    left = [n for n, p in params.items() if n not in dict(zip(params, args)) | kwargs and p.default is not p.empty]
    specialized = {n: default[0][2][n] for n in left if n in default[0][2]}  # the constexprs among them
    assert specialized and specialized == {n: params[n].default for n in specialized}


@pytest.mark.skipif(nvidia_backend() is None, reason="this Triton has no NVIDIA backend or finds no ptxas")
def test_the_kernels_resources_are_read_from_their_compile_for_a_gpu(tmp_path, monkeypatch, capsys):
    """lab.kernel_resources: each kernel of the two fused steps at the default launch, and both steps' window kernel
    at each launch the GPU benchmark times beside it (here one), compiled for sm_90 and its registers read
    from the cubin. The default launches spill nothing: a change to a kernel that makes one spill to local memory is
    a slower GPU step found here, without a GPU (with the installed Triton; the H200 machine's has its own table).
    Where results/bench-gpu holds a table of the installed Triton, its default rows are these."""
    monkeypatch.setattr("lab.bench_gpu.WINDOW_VARIANTS", [dict(num_stages=1)])
    assert kernel_resources.main(["--out", str(tmp_path)]) == 0
    rows = [line.split(" | ") for line in (tmp_path / "kernel_resources.md").read_text().splitlines()
            if line.startswith("| _")]
    steps = ["_window_decide_kernel", "_page_bound_kernel", "_page_select_kernel", "_split_attention_kernel"]
    assert [(r[0][2:], r[1], r[2]) for r in rows] == [
        ("_window_decide_kernel", "qada", "default"), ("_split_attention_kernel", "qada", "default")] + [
        (name, "qada_pages", "default") for name in steps] + [
        ("_window_decide_kernel", step, '{"num_stages": 1}') for step in ("qada", "qada_pages")]
    assert all(0 < int(r[3]) <= 255 and int(r[4].rstrip(" |")) >= 0 for r in rows)  # registers, stack bytes
    assert [int(r[4].rstrip(" |")) for r in rows if r[2] == "default"] == [0] * 6
    # The committed table of this Triton, if there is one, is the kernels as they are: a kernel change that moves a
    # default launch's registers or spills is found here, and the tables are made again
    root = Path(__file__).resolve().parent.parent
    for committed in sorted((root / "results" / "bench-gpu").glob("**/kernel_resources.md")):
        text = committed.read_text()
        if f"triton {triton.__version__};" in text:
            assert [line for line in text.splitlines() if '| default |' in line] == [
                " | ".join(r) for r in rows if r[2] == "default"], (
                f"{committed.relative_to(root)} is not the kernels as they are: make it again (its command is in "
                "it), and the other Triton's tables beside it (lab/kernel_resources.py says how)")


# --- the GPU benchmark's script ----------------------------------------------------------------------------


# lab.bench_pages_gpu fixes its labels with a = +-10, whose fp32 exp overflows to inf on purpose: numpy under the
# interpreter warns of it, a GPU does not
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.skipif(not decode_kernels.INTERPRETED, reason="the smoke run is the interpreter's")
def test_the_gpu_benchmark_runs_at_tiny_sizes_through_the_interpreter(tmp_path, capsys, monkeypatch):
    """lab.bench_pages_gpu --interpret-smoke: its self-check against the torch paths passes and its table is written,
    without --out to a new runs/bench-gpu-pages/<time> folder (never into results/), so the script a GPU session runs
    has run before; without CUDA and without the flag it stops in one line."""
    monkeypatch.chdir(tmp_path)
    assert bench_pages_gpu.main(["--interpret-smoke"]) == 0
    out, = (tmp_path / "runs" / "bench-gpu-pages").iterdir()
    assert not (tmp_path / "results").exists()
    table = (out / "pages.md").read_text()
    assert "self-check quest float32" in table and table.count("| tiny | 600 |") == 2
    assert len(json.loads((out / "pages.json").read_text())) == 2
    if not torch.cuda.is_available():
        capsys.readouterr()
        assert bench_pages_gpu.main(["--quick", "--out", str(tmp_path / "gpu")]) == 2
        assert capsys.readouterr().err.startswith("error: no CUDA here; --interpret-smoke") and \
            not (tmp_path / "gpu").exists()


def test_the_gpu_benchmark_writes_n_a_for_what_it_did_not_measure():
    """A NaN cell of lab.bench_pages_gpu's table (an exact launch that failed to compile, a budget of no page) reads
    n/a, as in lab.bench_gpu's tables, not nan; the other cells keep their formats."""
    row = {key: 1.0 for key, _, _ in bench_pages_gpu.COLUMNS} | {"shape": "tiny", "no_sync": "yes"}
    row["pages_exact_ms"] = math.nan
    cells = bench_pages_gpu.format_row(row).strip("| ").split(" | ")
    assert len(cells) == len(bench_pages_gpu.COLUMNS) and cells.count("n/a") == 1 and "nan" not in cells
    assert cells[[key for key, _, _ in bench_pages_gpu.COLUMNS].index("pages_exact_ms")] == "n/a"


@pytest.mark.skipif(not decode_kernels.INTERPRETED, reason="--interpret-smoke is the interpreter's")
@pytest.mark.parametrize("launch", [None, '{"window": {"LOW": false}, "bound": {"LOW": false}}'])
def test_the_gpu_benchmark_checks_and_times_the_launch_given(tmp_path, monkeypatch, capsys, launch):
    """lab.bench_pages_gpu --launch, as lab.bench_gpu's: the kernels launched otherwise from the self-check on (the
    products in exact fp32 of results/bench-gpu/h200/exact-products), the command in the table as typed; the defaults
    without it. A second run into the folder says that it replaces the table there."""
    for name in ("window", "bound"):  # set_launch changes these in place: copies, put back after the test
        monkeypatch.setitem(decode_kernels.LAUNCHES, name, dict(decode_kernels.LAUNCHES[name]))
    seen = []
    monkeypatch.setattr(bench_pages_gpu, "self_check", lambda *args: seen.append(
        [decode_kernels.LAUNCHES[name]["LOW"] for name in ("window", "bound")]) or [])
    monkeypatch.setattr(bench_pages_gpu, "bench", lambda *args: seen.append("timed") or [])
    argv = ["--interpret-smoke", "--out", str(tmp_path)] + (["--launch", launch] if launch else [])
    assert bench_pages_gpu.main(argv) == 0
    assert seen == [[launch is None] * 2, "timed"]
    assert f"`python -m lab.bench_pages_gpu {shlex.join(argv)}`" in (tmp_path / "pages.md").read_text()  # as typed
    if launch:
        assert f"--launch '{launch}'" in (tmp_path / "pages.md").read_text()
    assert "note: " not in capsys.readouterr().err
    assert bench_pages_gpu.main(argv) == 0
    assert f"note: {tmp_path} holds an earlier run's pages table; this run replaces it" in capsys.readouterr().err


@pytest.mark.skipif(not decode_kernels.INTERPRETED, reason="the self-check's CPU run is the interpreter's")
@pytest.mark.parametrize("fault", ["output", "labels", "pages", "fewer pages"])
def test_the_gpu_benchmark_self_check_refuses_a_kernel_that_disagrees(fault, monkeypatch):
    """lab.bench_pages_gpu.self_check raises when fused_pages' output, a label (the qada_pages case), or Quest's
    chosen pages (each head's moved one candidate on: some page chosen bounds lower than one left out; or the first
    head's dropped: fewer than the budget's) differ from the torch paths'."""
    real = decode_kernels.fused_pages

    def faulty(*args, **kwargs):
        y, labels, chosen = real(*args, **kwargs)
        if fault == "output":
            y = y + 1e-2
        elif fault == "labels" and "form" in kwargs:
            labels = ~labels
        elif fault == "pages":
            m = candidates(args[2].shape[2], bench_pages_gpu.N_SINK, bench_pages_gpu.N_LOCAL, args[8])
            chosen = torch.cat([chosen[..., :m].roll(1, -1), chosen[..., m:]], -1)
        elif fault == "fewer pages":
            chosen = chosen.clone()
            chosen[:, 0] = False
        return y, labels, chosen
    monkeypatch.setattr(decode_kernels, "fused_pages", faulty)
    message = {"output": "output differs", "labels": "qada_pages .* labels differ"}.get(fault,
                                                                                        "a chosen page bounds lower")
    with pytest.raises(RuntimeError, match=message):
        bench_pages_gpu.self_check(torch.device("cpu"), bench_pages_gpu.SMOKE_SHAPES["tiny"], 16)


# lab.bench_pages_gpu fixes its labels with a = +-10, whose fp32 exp overflows to inf on purpose: numpy under the
# interpreter warns of it, a GPU does not
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.skipif(not decode_kernels.INTERPRETED, reason="the benchmark's CPU run is the interpreter's")
def test_the_gpu_benchmark_table_reads_and_ratios(monkeypatch):
    """lab.bench_pages_gpu.bench at a tiny shape, each call timed by a fake clock (flash the faster dense): every x is
    the best dense over its own time, every bound 1 / its read, +pages / quest quest's time over +pages'; qada reads
    its long groups whole and the window of the others; +pages at half the groups long reads, per (row, KV head),
    the window and for a long group budget // P pages and one entry per candidate page; Quest, the window and the
    union of its heads' pages, as attention.quest counts them (up to the window's part of a last candidate page), and
    with a budget past every candidate, each candidate page and no statistics."""
    ticks = iter(range(1, 1000))
    monkeypatch.setattr(bench_pages_gpu, "timed_ms", lambda fn, device, reps: 0.5 if getattr(
        fn, "__name__", "") == "flash" else float(next(ticks)))
    T, P, budget, cpu = 300, 16, 32, torch.device("cpu")
    r, = bench_pages_gpu.bench(bench_pages_gpu.SMOKE_SHAPES, [T], [1], [budget], 0.5, P, cpu, 1)
    assert r["packed_ms"] == 1.0 and r["qada_ms"] == 2.0 and r["pages_ms"] != r["quest_ms"]
    for name in ("qada", "pages", "quest"):
        assert r[f"{name}_x"] == pytest.approx(0.5 / r[f"{name}_ms"])
    assert r["pages_bound"] == pytest.approx(1 / r["pages_read"]) and r["quest_bound"] == pytest.approx(
        1 / r["quest_read"])
    assert r["pages_vs_quest"] == pytest.approx(r["quest_ms"] / r["pages_ms"])
    m = candidates(T, bench_pages_gpu.N_SINK, bench_pages_gpu.N_LOCAL, P)
    assert r["qada_read"] == pytest.approx((0.5 * T + 0.5 * 128) / T)
    assert r["pages_read"] == pytest.approx((128 + 0.5 * (budget + m)) / T)
    layer = bench_pages_gpu.Layer(**bench_pages_gpu.SMOKE_SHAPES["tiny"], B=1, T=T, P=P, f=0.5, device=cpu)
    common = dict(layer=0, n_sink=bench_pages_gpu.N_SINK, n_local=bench_pages_gpu.N_LOCAL,
                  pages=PageIndex(None, P, bench_pages_gpu.N_SINK), budget=budget, budget_frac=None, page_size=P)
    quest_read = float(attention.quest(layer.q[0], layer.k[0], layer.v[0], **common)[2].double().mean()) / T
    assert quest_read <= r["quest_read"] <= quest_read + (P - 1) / T and r["quest_read"] > r["pages_read"]
    assert layer.read(P * m, quest=True) == pytest.approx((128 + m * P) / T)


@pytest.mark.parametrize("method", ["quest", "qada_pages", "qada_pages_sum", "qada_pages_share", "quest_p32",
                                    "qada_pages_frac"])
def test_run_path_dispatches_a_page_path_to_the_kernel(method, monkeypatch):
    """attention.run_path sends a page path (any registry entry of quest or qada_pages: page size, budget unit,
    combination of bounds) to decode_kernels.fused_pages under QADA_KERNEL=triton, with the same labels, read and output
    as the torch path it replaces; a context within the window stays torch; the registered path itself is torch."""
    calls = []
    real = attention.fused_pages
    monkeypatch.setattr(attention, "fused_pages", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    q, k, v, start, length = batch(seed=5)
    q, k, v = q[0], row_view(k, 0, start, length), row_view(v, 0, start, length)  # (H, D), (Hkv, 301, D)
    P = attention.page_size(method)
    budget = {"budget_frac": 0.2} if method.endswith("_frac") else {"budget": 3 * P}
    given = dict(layer=0, n_sink=N_SINK, n_local=N_LOCAL, tau=0.5, moments=moments_of(k),  # one group local, one long
                 calibration=calibrations()[1], pages=PageIndex(None, P, N_SINK), **budget)
    inputs = {name: given[name] for name in attention.path_inputs(method)}
    monkeypatch.setenv("QADA_KERNEL", "torch")
    want_y, want, want_read = attention.run_path(method, q, k, v, **inputs)
    monkeypatch.setenv("QADA_KERNEL", "triton")
    assert all(torch.equal(a, b) for a, b in zip(attention.PATHS[method](q, k, v, **inputs), (want_y, want, want_read)))
    attention.run_path(method, q, k[:, :N_LOCAL], v[:, :N_LOCAL], **inputs)
    assert calls == []
    y, labels, read = attention.run_path(method, q, k, v, **inputs)
    assert len(calls) == 1 and ("form" in calls[0]) == method.startswith("qada")
    assert calls[0].get("combine", "max") == combine_of(method)
    assert torch.equal(labels, want) and torch.equal(read.long(), want_read.long())
    if method.startswith("qada"):
        assert 0 < int(labels.sum()) < len(labels)  # a local group and a long one: both kinds of row
    torch.testing.assert_close(y, want_y, atol=2e-5, rtol=1e-4)


def test_run_path_gives_the_page_kernel_its_layers_pages_moments_and_correction(monkeypatch):
    """At layer 1 of two (layer 0's keys already in the page index, its moments, then its correction, labelling every
    head local), run_path's page kernel reads, labels and attends as the torch path at layer 1, over a bulk that ends
    one key into its last page: a budget of a few pages ranks layer 1's own pages, a budget of all reads that key."""
    T = N_LOCAL + 16 * 16 + 1  # the bulk: 16 pages of 16 and one key
    assert candidates(T, N_SINK, N_LOCAL, 16) == candidates(T - 1, N_SINK, N_LOCAL, 16) + 1
    g = torch.Generator().manual_seed(5)
    q = torch.randn(H, D, generator=g) * 1.5
    k, v = torch.randn(2, HKV, T, D, generator=g), torch.randn(2, HKV, T, D, generator=g)
    mean = torch.stack([-3 * q.view(HKV, G, D).mean(1), k[1].mean(1)])  # layer 0's bulk far below its window
    cov = torch.eye(D).expand(2, HKV, D, D) * 0.1
    identity = Calibration(torch.zeros(2, H), torch.ones(2, H), None, {})
    layer_0_local = Calibration(torch.tensor([[10.0] * H, [0.0] * H]), torch.ones(2, H), None, {})
    for moments, calibration, budget in ((FixedMoments(mean, cov, 1000), identity, 48),
                                         (FixedMoments(mean[[1, 1]], cov, 1000), layer_0_local, 10_000)):
        inputs = dict(n_sink=N_SINK, n_local=N_LOCAL, tau=0.5, moments=moments, calibration=calibration,
                      pages=PageIndex(None, 16, N_SINK), budget=budget)
        inputs["pages"].bounds(0, k[0])  # layer 0's pages in the index (a local group's step scores none)
        monkeypatch.setenv("QADA_KERNEL", "torch")
        _, at_0, _ = attention.run_path("qada_pages", q, k[0], v[0], layer=0, **inputs)
        want_y, want, want_read = attention.run_path("qada_pages", q, k[1], v[1], layer=1, **inputs)
        monkeypatch.setenv("QADA_KERNEL", "triton")
        y, labels, read = attention.run_path("qada_pages", q, k[1], v[1], layer=1, **inputs)
        assert at_0.all() and not want.any()
        assert torch.equal(labels, want) and torch.equal(read.long(), want_read.long())
        torch.testing.assert_close(y, want_y, atol=2e-5, rtol=1e-4)
    assert (want_read == T).all()  # every candidate page read, the one-key page too
