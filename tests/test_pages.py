"""Token-level page selection: the page statistics against brute force, each page path against an fp32
softmax over exactly the positions it should choose (chosen here again, from the keys themselves), a planted needle,
dense when the budget covers everything, the KV read by hand, and the CLIs (generate.py, a tiny lab.sweep)."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

import attention
import generate
from attention import PATHS, DecodeAttention, dense
from criterion import Calibration, save_calibration, window_mask
from lab import records, report, sweep
from model import KVCache
from moments import FixedMoments, bulk_end
from pages import PageIndex, candidates, page_count, page_positions, page_shares, pages_upto, stacked, upper_bounds
from tests.test_generate import make_tiny_dir, write_prompt

H, HKV, D = 6, 2, 16
G = H // HKV
N_SINK, N_LOCAL = 4, 32
PAGE_PATHS = [m for m in PATHS if attention.page_size(m) is not None]


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def qkv(T, seed=0, dtype=torch.float32):
    return rand(H, D, seed=seed, dtype=dtype), rand(HKV, T, D, seed=seed + 1, dtype=dtype), rand(
        HKV, T, D, seed=seed + 2, dtype=dtype)


# --- the page statistics -----------------------------------------------------------------------------------


def brute_pages(k, n_sink, P):
    """Min and max (Hkv, n, D) of the keys k (Hkv, T, D) of each page [n_sink + j P, n_sink + (j + 1) P), one by one."""
    T = k.shape[1]
    starts = range(n_sink, T, P)
    lo = [torch.stack([k[h, s:min(s + P, T)].amin(0) for s in starts]) if T > n_sink else k.new_zeros(0, D)
          for h in range(k.shape[0])]
    hi = [torch.stack([k[h, s:min(s + P, T)].amax(0) for s in starts]) if T > n_sink else k.new_zeros(0, D)
          for h in range(k.shape[0])]
    return torch.stack(lo), torch.stack(hi)


def prefilled(k, max_len):
    """A model.KVCache (2 layers, batch 1) whose row 0 holds k (Hkv, T, D) in every layer (layer 1 doubled)."""
    cfg = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=k.shape[0], head_dim=k.shape[2])
    cache = KVCache(cfg, max_len, dtype=k.dtype)
    T = k.shape[1]
    cache.k[0, 0, :, :T], cache.k[1, 0, :, :T], cache.length = k, 2 * k, T
    return cache


# awkward lengths: no page, shorter than a page, exactly a page, a page + 1, several pages and a part
@pytest.mark.parametrize("P", [4, 16])
@pytest.mark.parametrize("pages,plus", [(0, 1 - N_SINK), (0, 0), (0, 1), (1, -1), (1, 0), (1, 1), (3, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_bounds_equal_brute_force_at_prefill_key_by_key_and_in_chunks(P, pages, plus, dtype):
    T = N_SINK + pages * P + plus  # within the sinks, no page, part of one, a page - 1, a page, a page + 1, several
    k = rand(HKV, T + 2 * P + 3, D, seed=T, dtype=dtype)  # the cache grows past T while decoding
    at_once = PageIndex(prefilled(k[:, :T], k.shape[1]), P, N_SINK)
    for layer, scale in ((0, 1), (1, 2)):
        lo, hi = at_once.bounds(layer, scale * k[:, :T])
        want = brute_pages(scale * k[:, :T], N_SINK, P)
        assert lo.shape == hi.shape == (HKV, math.ceil(max(T - N_SINK, 0) / P), D)
        assert torch.equal(lo, want[0]) and torch.equal(hi, want[1])  # a min and a max are exact in any dtype
    one_by_one, chunks = PageIndex(None, P, N_SINK), PageIndex(None, P, N_SINK)
    for t in range(1, k.shape[1] + 1):  # decoding: the page being filled updated in place, then the next one started
        lo, hi = one_by_one.bounds(0, k[:, :t])
        want = brute_pages(k[:, :t], N_SINK, P)
        assert torch.equal(lo, want[0]) and torch.equal(hi, want[1]), t
        lo, hi = at_once.bounds(0, k[:, :t]) if t >= T else (lo, hi)  # the prefilled index follows the cache too
        assert torch.equal(lo, want[0]) and torch.equal(hi, want[1]), t
    for t in (3, 3 + P // 2, 2 * P + 5, k.shape[1]):  # several keys at once, from the middle of a page
        lo, hi = chunks.bounds(0, k[:, :t])
        want = brute_pages(k[:, :t], N_SINK, P)
        assert torch.equal(lo, want[0]) and torch.equal(hi, want[1]), t
    with pytest.raises(ValueError, match="rolled back"):
        chunks.bounds(0, k[:, :k.shape[1] - 1])


def test_a_page_index_of_a_batchs_row_holds_that_rows_keys():
    """PageIndex(cache, row=b) folds in row b of a batch's cache at once, not row 0 (the bench indexes each row)."""
    T = N_SINK + 3 * 4 + 2
    k = rand(2, 2, HKV, T, D, seed=8)  # (L, B, Hkv, T, D): two rows of other keys
    for row in (0, 1):
        index = PageIndex(SimpleNamespace(k=k, length=T, max_len=T), 4, N_SINK, row=row)
        for layer in (0, 1):
            lo, hi = index.bounds(layer, k[layer, row])  # the length folded in already: nothing left to catch up
            want = brute_pages(k[layer, row], N_SINK, 4)
            assert torch.equal(lo, want[0]) and torch.equal(hi, want[1])


def test_the_index_grows_past_the_capacity_it_was_made_with():
    k = rand(HKV, 200, D, seed=1)
    index = PageIndex(prefilled(k[:, :20], 21), 4, N_SINK)  # room for the cache's 21 positions only
    lo, hi = index.bounds(0, k)
    assert torch.equal(lo, brute_pages(k, N_SINK, 4)[0]) and torch.equal(hi, brute_pages(k, N_SINK, 4)[1])
    for size in (0, -4):  # pages of no positions: a ZeroDivisionError, or bounds of nonsense
        with pytest.raises(ValueError, match=f"page_size must be at least 1, got {size}"):
            PageIndex(None, size, N_SINK)


def test_the_index_is_made_with_room_for_its_cache_and_doubles_it_when_outgrown():
    """Made from a cache, the index holds room for the cache's max_len, so decoding into it never reallocates; past
    its room (a transformers prompt sizes the cache to the prompt) it doubles, so a context growing key by key
    reallocates O(log T) times, not once per new page (O(T^2) copying)."""
    k = rand(HKV, 1000, D, seed=5)

    def reallocations(index):  # decode key by key to 1000 positions, counting when the tensors move
        moves, last = 0, index.lo[0].data_ptr()
        for t in range(21, 1001):
            index.bounds(0, k[:, :t])
            moves, last = moves + (index.lo[0].data_ptr() != last), index.lo[0].data_ptr()
        return moves

    assert reallocations(PageIndex(prefilled(k[:, :20], 1000), 1, N_SINK)) == 0
    # from 16 pages of one position to 996: doubled 6 times
    assert reallocations(PageIndex(prefilled(k[:, :20], 20), 1, N_SINK)) == math.ceil(math.log2(996 / 16))


def test_a_page_of_one_position_is_its_key():
    k = rand(HKV, 40, D, seed=4)
    lo, hi = PageIndex(None, 1, N_SINK).bounds(0, k)  # page_size 1 is a valid page, Quest's bound then exact
    assert torch.equal(lo, k[:, N_SINK:]) and torch.equal(hi, k[:, N_SINK:])


def test_a_context_within_the_sinks_has_no_pages():
    # never a negative count: 3 positions under 16 sinks in pages of 4 are 0 pages, not ceil(-13 / 4) = -3
    assert [pages_upto(T, 16, 4) for T in (0, 3, 11, 16, 17, 20, 21)] == [0, 0, 0, 0, 1, 1, 2]
    lo, hi = stacked([PageIndex(None, 4, 16)], 0, rand(1, HKV, 3, D), [0], 3)  # a batch's buffers of 3 positions
    assert lo.shape == hi.shape == (1, HKV, 0, D)


def test_quests_bound_is_its_definition_and_bounds_every_score_of_the_page():
    k, q = rand(HKV, 150, D, seed=2), rand(H, D, seed=3)
    lo, hi = brute_pages(k, N_SINK, 8)
    got = upper_bounds(q, lo, hi)  # (H, n)
    qd, lo64, hi64 = q.double().view(HKV, G, 1, D), lo.double()[:, None], hi.double()[:, None]
    want = torch.maximum(qd * lo64, qd * hi64).sum(-1).view(H, -1)  # sum_d max(q_d min_d, q_d max_d)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    scores = torch.einsum("hgd,htd->hgt", q.view(HKV, G, D), k).reshape(H, -1)[:, N_SINK:]  # q . k, unscaled
    n = lo.shape[1]
    per_page = torch.nn.functional.pad(scores, (0, n * 8 - scores.shape[1]), value=-math.inf).view(H, n, 8).amax(-1)
    assert (got >= per_page - 1e-5).all()


@pytest.mark.parametrize("P", [4, 16])
@pytest.mark.parametrize("T", [N_LOCAL - 1, N_LOCAL, N_LOCAL + 1, N_LOCAL + 5, N_LOCAL + 16, 200])
def test_the_candidate_pages_and_the_window_hold_every_position_once(P, T):
    """Pages start after the sinks; the last candidate may reach into the window's recent part, which is then read
    with the window only: window and candidate pages partition the context."""
    m = candidates(T, N_SINK, N_LOCAL, P)
    pos, read = page_positions(torch.arange(m), T, N_SINK, N_LOCAL, P)
    pages = pos[read].tolist()
    window = window_mask(T, N_SINK, N_LOCAL).nonzero().flatten().tolist()
    assert sorted(pages + window) == list(range(T))  # each position once: in a page or in the window
    assert m == (0 if T <= N_LOCAL else math.ceil((bulk_end(T, N_SINK, N_LOCAL) - N_SINK) / P))


def test_page_count_takes_tokens_or_a_fraction_of_the_context():
    assert page_count(1000, 16, 512, None) == 32 and page_count(1000, 16, 520.0, None) == 32
    assert page_count(1000, 16, None, 0.1) == 6 and page_count(1000, 16, 15, None) == 0  # 100 tokens; less than a page
    assert page_count(1599, 16, None, 0.1) == 9 and page_count(1600, 16, None, 0.1) == 10  # floor(159.9) = 159 tokens
    for budget, frac in ((None, None), (512, 0.1), (-16, None), (12.5, None), (None, 1.5)):
        with pytest.raises(ValueError):
            page_count(1000, 16, budget, frac)


# --- the paths against an fp32 softmax over the positions they should choose -------------------------------


def fp32_on(q, k, v, keep):
    """Attention in fp32 over exactly the positions keep (H, T) bool of each head."""
    scores = torch.einsum("hgd,htd->hgt", q.float().view(HKV, G, D), k.float()).reshape(H, -1) / math.sqrt(D)
    w = scores.masked_fill(~keep, -math.inf).softmax(-1).view(HKV, G, -1)
    return torch.bmm(w, v.float()).view(H, D)


def keep_of(chosen, T, P):
    """(H, T) bool: the window and the bulk positions of each head's chosen pages (H, m) bool."""
    keep = window_mask(T, N_SINK, N_LOCAL)[None].repeat(H, 1)
    for pos in range(N_SINK, bulk_end(T, N_SINK, N_LOCAL)):
        keep[:, pos] = chosen[:, (pos - N_SINK) // P]
    return keep


def top(scores, n):
    """(rows, m) bool: the n highest of each row of scores (rows, m); every one when n >= m."""
    if n >= scores.shape[1]:
        return torch.ones_like(scores, dtype=torch.bool)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, scores.topk(n, dim=1).indices, True)


def bounds_by_hand(q, k, P):
    """Quest's bound (H, m) in float64 from the keys of each candidate page, by its definition."""
    m = candidates(k.shape[1], N_SINK, N_LOCAL, P)
    lo, hi = brute_pages(k.double(), N_SINK, P)
    qd = q.double().view(HKV, G, 1, D)
    return torch.maximum(qd * lo[:, None, :m], qd * hi[:, None, :m]).sum(-1).view(H, m)


def shares_by_hand(q, k, P):
    """The share combination's per-head page scores (H, m) in float64: log of a page's mass were its P scores at
    Quest's bound, over the window's true mass plus every candidate page's mass at its bound."""
    T = k.shape[1]
    scores = torch.einsum("hgd,htd->hgt", q.double().view(HKV, G, D), k.double()).reshape(H, T) / math.sqrt(D)
    log_local = scores[:, window_mask(T, N_SINK, N_LOCAL)].logsumexp(-1)  # (H,)
    log_mass = bounds_by_hand(q, k, P) / math.sqrt(D) + math.log(P)  # (H, m)
    return log_mass - torch.logaddexp(log_local, log_mass.logsumexp(-1))[:, None]


@pytest.mark.parametrize("P", [16, 32])
def test_page_shares_are_their_definition(P):
    """pages.page_shares against shares_by_hand, from the same float64 bounds and the window's true log mass: a page's
    P scores at its bound weigh P times one score, against the window (so a missing log P moves every share)."""
    T = 301
    q, k, _ = qkv(T, seed=3)
    scores = torch.einsum("hgd,htd->hgt", q.double().view(HKV, G, D), k.double()).reshape(H, T) / math.sqrt(D)
    log_local = scores[:, window_mask(T, N_SINK, N_LOCAL)].logsumexp(-1)  # (H,)
    got = page_shares(bounds_by_hand(q, k, P).view(HKV, G, -1), log_local.view(HKV, G), P, 1 / math.sqrt(D))
    torch.testing.assert_close(got.reshape(H, -1), shares_by_hand(q, k, P), rtol=0, atol=1e-9)


def read_by_hand(chosen, T, P, scored, long=None):
    """Entries each KV head reads: its window, the bulk positions of its heads' pages (union), and 1 entry (a min and
    a max, half an entry each) per candidate page when the pages were scored; a local group (long False) its window."""
    m = candidates(T, N_SINK, N_LOCAL, P)
    union = keep_of(chosen, T, P).view(HKV, G, T).any(1)
    read = union.sum(1) + (m if scored else 0)
    return read if long is None else torch.where(long, read, min(T, N_LOCAL))


def calibrations(L=1):
    """Corrections for L layers: as QAdA itself (a = 0, b = 1); one that makes group 0 local and group 1 long-context
    whatever the query (split); and one where the mean share rule and the all-local rule disagree: shares (1, 1, 0) and
    (0, 0, 1) per group, so at tau 0.3 the mean rule labels both groups local, the all rule neither."""
    mixed = torch.tensor([10.0, 10.0, -10.0, -10.0, -10.0, 10.0]).expand(L, H).clone()
    return [Calibration(torch.zeros(L, H), torch.ones(L, H), None, {}), split(True, L),
            Calibration(mixed, torch.zeros(L, H), None, {})]


def split(first_local, L=1):
    """A correction that labels KV group 0 local and group 1 long-context (or the other way round), whatever the
    query: b = 0 and a = +-10, a corrected log ratio of +-10 (a share of 1 or 0)."""
    a = torch.tensor([10.0] * G + [-10.0] * G) * (1 if first_local else -1)
    return Calibration(a.expand(L, H).clone(), torch.zeros(L, H), None, {})


def moments_of(k):
    return FixedMoments(k.float().mean(1)[None], (0.1 * torch.eye(D)).expand(1, HKV, D, D), 1000)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("P", [4, 16])
@pytest.mark.parametrize("T", [20, N_LOCAL, N_LOCAL + 1, N_LOCAL + 7, 301])
@pytest.mark.parametrize("budget", [0, 8, 40, 10_000])
def test_quest_attends_to_its_window_and_each_heads_top_pages(dtype, tol, P, T, budget):
    q, k, v = qkv(T, seed=T + P, dtype=dtype)
    index = PageIndex(None, P, N_SINK)
    y, labels, read = attention.quest(q, k, v, layer=0, n_sink=N_SINK, n_local=N_LOCAL, pages=index, budget=budget,
                                      budget_frac=None, page_size=P)
    n = budget // P
    m = candidates(T, N_SINK, N_LOCAL, P)
    chosen = top(bounds_by_hand(q, k, P), n) if n else torch.zeros(H, m, dtype=torch.bool)
    assert not labels.any()  # Quest labels no head window-only
    assert (y.float() - fp32_on(q, k, v, keep_of(chosen, T, P))).abs().max() < tol
    assert torch.equal(read, read_by_hand(chosen, T, P, 0 < n < m))


@pytest.mark.parametrize("T", [N_LOCAL + 1, 301])
@pytest.mark.parametrize("frac", [0.0, 0.2, 1.0])
def test_a_budget_as_a_fraction_of_the_context_is_that_many_tokens(T, frac):
    q, k, v = qkv(T, seed=7)
    common = dict(layer=0, n_sink=N_SINK, n_local=N_LOCAL)
    y, _, read = PATHS["quest_frac"](q, k, v, **common, pages=PageIndex(None, 16, N_SINK), budget_frac=frac)
    y2, _, read2 = PATHS["quest"](q, k, v, **common, pages=PageIndex(None, 16, N_SINK), budget=math.floor(frac * T))
    assert torch.equal(y, y2) and torch.equal(read, read2)


@pytest.mark.parametrize("T", [N_LOCAL + 1, N_LOCAL + 7, 301])
@pytest.mark.parametrize("method", ["qada_pages", "qada_pages_sum", "qada_pages_share", "qada_pages_p32"])
@pytest.mark.parametrize("budget", [16, 64, 10_000])
@pytest.mark.parametrize("tau", [0.3, 1.0])
def test_qada_pages_decides_as_qada_kv_cal_and_reads_the_groups_top_pages(T, method, budget, tau):
    q, k, v = qkv(T, seed=T)
    P = attention.page_size(method)
    for calibration in calibrations():
        inputs = dict(layer=0, n_sink=N_SINK, n_local=N_LOCAL, tau=tau, moments=moments_of(k), calibration=calibration)
        y, labels, read = PATHS[method](q, k, v, **inputs, pages=PageIndex(None, P, N_SINK), budget=budget)
        _, want = PATHS["qada_kv_cal"](q, k, v, **inputs)
        assert torch.equal(labels, want)  # the decision is qada_kv_cal's
        long = ~labels.view(HKV, G)[:, 0]  # (Hkv,)
        bound = bounds_by_hand(q, k, P).view(HKV, G, -1)
        if "share" in method:
            bound = shares_by_hand(q, k, P).view(HKV, G, -1)
        group = bound.amax(1) if "sum" not in method else bound.sum(1)  # (Hkv, m)
        n, m = budget // P, group.shape[1]
        chosen = (top(group, n) & long[:, None]).repeat_interleave(G, 0)  # the group's pages, for each of its heads
        assert (y - fp32_on(q, k, v, keep_of(chosen, T, P))).abs().max() < 1e-5
        assert torch.equal(read, read_by_hand(chosen, T, P, 0 < n < m, long))


@pytest.mark.parametrize("negative", [False, True])
@pytest.mark.parametrize("T", [N_LOCAL + 1, 301])
@pytest.mark.parametrize("budget", [8, 16, 48])
def test_the_page_oracle_reads_each_heads_pages_of_largest_true_mass(T, budget, negative):
    """Its ranking counts a page's bulk positions only: a key in the window's part of the last candidate page (planted
    along head 0's query) must not make that page head 0's. With every score below zero, the last page's positions past
    the bulk must add nothing either (a padding position at score 0 would outweigh a whole page)."""
    q, k, v = qkv(T, seed=5)
    if negative:
        q, k = q.abs(), -k.abs() - 0.5
    k[0, bulk_end(T, N_SINK, N_LOCAL) + 1] = 4 * q[0]
    y, labels, read = PATHS["page_oracle"](q, k, v, n_sink=N_SINK, n_local=N_LOCAL, budget=budget)
    scores = torch.einsum("hgd,htd->hgt", q.double().view(HKV, G, D), k.double()).reshape(H, T) / math.sqrt(D)
    m = candidates(T, N_SINK, N_LOCAL, 16)
    mass = torch.stack([scores[:, N_SINK + 16 * j:min(N_SINK + 16 * (j + 1), bulk_end(T, N_SINK, N_LOCAL))]
                        .logsumexp(-1) for j in range(m)], 1)  # (H, m): each page's bulk, by hand
    chosen = top(mass, budget // 16)
    assert (y - fp32_on(q, k, v, keep_of(chosen, T, 16))).abs().max() < 1e-5
    assert torch.equal(read, read_by_hand(chosen, T, 16, False))  # what its labels imply; it reads every score


def page_inputs(method, T, k):
    P = attention.page_size(method)
    return dict(layer=0, n_sink=N_SINK, n_local=N_LOCAL, tau=1.0, moments=moments_of(k), calibration=calibrations()[0],
                pages=PageIndex(None, P, N_SINK), budget=10 * T, budget_frac=1.0)


@pytest.mark.parametrize("T", [N_LOCAL + 1, 301])
@pytest.mark.parametrize("method", PAGE_PATHS)
def test_a_budget_that_covers_everything_is_dense(T, method):
    """At tau 1 every qada_pages group is long-context; with every page read nothing is scored, so the read is T."""
    q, k, v = qkv(T, seed=11)
    inputs = page_inputs(method, T, k)
    y, labels, read = PATHS[method](q, k, v, **{n: inputs[n] for n in attention.path_inputs(method)})
    assert (y - dense(q, k, v)[0]).abs().max() < 1e-5
    assert read.tolist() == [T] * HKV and not labels.any()


@pytest.mark.parametrize("T", [1, N_SINK + 1, N_LOCAL])
@pytest.mark.parametrize("method", PAGE_PATHS)
def test_a_context_inside_the_window_is_read_once(T, method):
    """No bulk: every page path reads the T entries held per KV head, whatever its budget (T, not its window's n_local:
    the KV read of a short context is then 1, a dense path's)."""
    q, k, v = qkv(T, seed=19)
    inputs = page_inputs(method, T, k) | dict(budget=16, budget_frac=0.5, tau=0.6)
    y, _, read = PATHS[method](q, k, v, **{n: inputs[n] for n in attention.path_inputs(method)})
    assert (y - dense(q, k, v)[0]).abs().max() < 1e-5
    assert read.tolist() == [T] * HKV


@pytest.mark.parametrize("method", ["quest", "qada_pages", "page_oracle"])
def test_a_planted_needle_s_page_is_chosen(method):
    """One bulk key far along head 0's query, one page of budget: the needle's page must be read, and head 0's output
    is then its value; a local window alone misses it. (Random pages, or top pages over the wrong positions, fail.)"""
    T, needle = 400, 150
    q, k, v = qkv(T, seed=13)
    k[0, needle] = 4 * math.sqrt(D) * q[0] / q[0].norm()  # score 4 sqrt(D) |q_0| / sqrt(D) over the others' ~N(0, 1)
    inputs = page_inputs(method, T, k) | dict(budget=16, tau=0.5, calibration=split(False))  # head 0's group long
    y, labels, read = PATHS[method](q, k, v, **{n: inputs[n] for n in attention.path_inputs(method)})
    assert (y[0] - v[0, needle]).abs().max() < 0.05
    y_local, _ = attention.local(q, k, v, n_sink=N_SINK, n_local=N_LOCAL)
    assert (y_local[0] - v[0, needle]).abs().max() > 0.3


@pytest.mark.parametrize("T", [N_LOCAL + 1, 301])
def test_the_window_is_read_too(T):
    """A key in the recent window far along head 1's query: with no page budget every page path still finds it."""
    q, k, v = qkv(T, seed=17)
    k[0, T - 3] = 4 * math.sqrt(D) * q[1] / q[1].norm()
    for method in ("quest", "page_oracle", "qada_pages"):
        inputs = page_inputs(method, T, k) | dict(budget=0)
        y, _, _ = PATHS[method](q, k, v, **{n: inputs[n] for n in attention.path_inputs(method)})
        assert (y[1] - v[0, T - 3]).abs().max() < 0.05, method


def test_a_page_index_of_another_page_size_or_sinks_is_refused():
    """An index of other pages than the path's candidates (another size, or counted from other sinks: page j would
    cover other positions) is refused by every page path, not read as if it were the path's own."""
    q, k, v = qkv(200)
    with pytest.raises(ValueError, match="pages of 16 tokens after 4 sinks; the path reads pages of 32 after 4"):
        PATHS["quest_p32"](q, k, v, layer=0, n_sink=N_SINK, n_local=N_LOCAL, pages=PageIndex(None, 16, N_SINK),
                           budget=64)
    for method in ("quest", "qada_pages"):
        inputs = page_inputs(method, 200, k) | dict(pages=PageIndex(None, 16, N_SINK + 1), budget=32, budget_frac=None)
        with pytest.raises(ValueError, match=f"pages of 16 tokens after {N_SINK + 1} sinks; the path reads pages of "
                                             f"16 after {N_SINK}"):
            PATHS[method](q, k, v, **{n: inputs[n] for n in attention.path_inputs(method)})
        # and by the attention that would hold it, when it is built: its groups may all stay local for many steps,
        # scoring no page
        with pytest.raises(ValueError, match=f"pages of 16 tokens after {N_SINK + 1} sinks"):
            DecodeAttention(method, N_SINK, N_LOCAL, inputs)
    DecodeAttention("quest", N_SINK, N_LOCAL, page_inputs("quest", 200, k) | dict(pages=PageIndex(None, 16, N_SINK)))


def test_a_page_size_entry_reads_the_pages_its_name_says():
    """quest_p64 and its like: the page size the entry fixes (build_attention makes its PageIndex at it) is its name's,
    and its path reads pages of that size; the other entries read Quest's 16."""
    sized = {m: int(m.rsplit("_p", 1)[1]) for m in PAGE_PATHS if m.rsplit("_p", 1)[-1].isdigit()}
    assert sorted(sized.values()) == [32, 32, 32, 64, 64, 64]
    assert all(attention.page_size(m) == 16 for m in PAGE_PATHS if m not in sized)
    q, k, v = qkv(301)
    for method, P in sized.items():
        assert attention.page_size(method) == P
        inputs = page_inputs(method, 301, k) | dict(budget=2 * P, pages=PageIndex(None, P, N_SINK))
        y, _, read = PATHS[method](q, k, v, **{n: inputs[n] for n in attention.path_inputs(method)})
        base = PATHS[method.rsplit("_p", 1)[0]]
        want, _, want_read = base(q, k, v, **{n: inputs[n] for n in attention.path_inputs(method)}, page_size=P)
        assert torch.equal(y, want) and torch.equal(read, want_read), method


# --- the KV read through DecodeAttention and HeadStats ----------------------------------------------------


@pytest.mark.parametrize("method", ["quest", "qada_pages"])
def test_the_kv_read_is_what_the_path_read_step_by_step(method):
    """Decoding 6 steps on 2 layers from a prompt of 150, the index following the growing cache: the reported KV read
    is the pages, the window and the statistics read, summed by hand over steps, layers and KV heads, over the entries
    held; not what the labels alone imply (Quest labels no head local, which would say 1)."""
    T0, steps, L, P, budget = 150, 6, 2, 16, 32
    q_all, k_all, v_all = qkv(T0 + steps, seed=19)
    k_all = torch.stack([k_all, 0.5 * k_all])  # (L, Hkv, T, D): another cache per layer
    v_all = torch.stack([v_all, v_all.flip(1)])
    calibration = split(True, L)
    cache = SimpleNamespace(k=k_all[:, None, :, :T0], length=T0, max_len=T0 + steps)
    att = DecodeAttention(method, N_SINK, N_LOCAL, dict(pages=PageIndex(cache, P, N_SINK), budget=budget, tau=0.5,
                                                        calibration=calibration,
                                                        moments=FixedMoments(torch.zeros(L, HKV, D),
                                                                             torch.eye(D).expand(L, HKV, D, D), 100)))
    read = held = 0
    for s in range(steps):
        T = T0 + s + 1
        for layer in range(L):
            q = q_all * (layer + 1) + s
            k, v = k_all[layer, :, :T], v_all[layer, :, :T]
            att(q[None, :, None], k[None], v[None], layer)
            m = candidates(T, N_SINK, N_LOCAL, P)
            bound = bounds_by_hand(q, k, P)
            if method == "quest":
                chosen, long = top(bound, budget // P), None
            else:  # group 0 local, group 1 long-context (the correction's +-10)
                long = torch.tensor([False, True])
                chosen = (top(bound.view(HKV, G, m).amax(1), budget // P) & long[:, None]).repeat_interleave(G, 0)
            read += int(read_by_hand(chosen, T, P, True, long).sum())
            held += HKV * T
    summary = att.stats.summary(HKV)
    assert summary["kv_read"] == pytest.approx(read / held, abs=1e-12)
    assert summary["sparsity"] == (0.0 if method == "quest" else 0.5)
    implied = attention.kv_read_fraction(att.stats.label_tensor(), torch.tensor(att.stats.lengths), HKV, N_LOCAL)
    assert summary["kv_read"] < implied  # the labels alone would count a long group's whole cache


# --- the CLIs ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_dir(tmp_path_factory.mktemp("tiny_pages"))


@pytest.fixture
def built(monkeypatch):
    runs, make = [], generate.build_attention

    def spy(*args, **kwargs):
        runs.append(make(*args, **kwargs))
        return runs[-1]
    monkeypatch.setattr(generate, "build_attention", spy)
    return runs


def test_generate_runs_quest_and_prints_the_kv_read_it_reported(tiny_dir, tmp_path, capsys, built):
    prompt = str(write_prompt(tmp_path, 300))
    argv = ["--prompt", prompt, "--model", str(tiny_dir), "--method", "quest", "--max-new-tokens", "5"]
    assert generate.main(argv + ["--set", "budget=512"]) == 0  # 512 tokens cover the whole bulk: read as dense
    assert "KV entries read 1.000" in capsys.readouterr().out
    assert generate.main(argv + ["--set", "budget=32", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert generate.main(argv + ["--set", "budget=32"]) == 0  # the text report prints the share the JSON holds
    assert f"KV entries read {r['kv_read']:.3f}" in capsys.readouterr().out and r["kv_read"] < 0.9
    att = built[-1]
    reads = att.stats.read_tensor()  # (4 steps, 2 layers, 2 KV heads)
    assert reads.shape == (4, 2, 2) and att.stats.lengths == [301, 302, 303, 304]
    assert r["kv_read"] == pytest.approx(float(reads.sum()) / (4 * sum(att.stats.lengths)), abs=1e-12)
    m = [candidates(T, 16, 128, 16) for T in att.stats.lengths]  # 11 candidate pages; 2 chosen per head
    assert all(128 + mm < x <= 128 + 4 * 16 + mm for step, mm in zip(reads.tolist(), m) for layer in step
               for x in layer)  # the window, the union of 2 query heads' 2 pages, the statistics
    assert generate.main(argv) == 2 and "the quest path reads budget" in capsys.readouterr().err  # one line


def test_a_tiny_sweep_runs_quest_and_qada_pages_on_a_budget_grid(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    calibration = tmp_path / "affine.json"
    save_calibration(calibration, Calibration(torch.zeros(2, 4), torch.ones(2, 4), None,
                                              {"kind": "affine", "moments_source": "random-words"}))
    out = tmp_path / "run"
    argv = ["--out", str(out), "--tasks", "fwe", "--length", "400", "--samples", "1", "--methods",
            "dense,quest,qada_pages,page_oracle", "--budgets", "32,64", "--grid", "page_oracle=32", "--calibration",
            str(calibration), "--ablations", "", "--ctxfree-samples", "0", "--track", "", "--model", str(tiny_dir),
            "--no-report"]
    assert sweep.main(argv) == 0
    found = {r["config"]: r for r in records.read_records(out)}
    assert set(found) == {"dense", "quest@32", "quest@64", "qada_pages@32", "qada_pages@64", "page_oracle@32"}
    for key in ("quest@32", "quest@64", "qada_pages@32"):
        assert found[key]["threshold_kind"] == "budget" and found[key]["kv_read"] < 1
    assert found["quest@32"]["kv_read"] < found["quest@64"]["kv_read"] and found["quest@32"]["sparsity"] == 0
    assert found["page_oracle@32"]["kv_read_implied"]
    report.report(out)
    summary = (out / "summary.md").read_text()
    row = next(line for line in summary.splitlines() if line.startswith("| quest@32 |"))
    assert f"{found['quest@32']['kv_read']:.3f}" in row  # the KV read column
    assert sweep.main(argv[:2] + ["--grid", "quest=0.5"] + argv[2:]) == 2  # a budget grid takes tokens
