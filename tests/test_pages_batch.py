"""The page paths for a whole batch (attention.page_rows): a left-padded stack of rows of different lengths (one
within its window, one just above it) decoded step by step, held against each row's own path (BatchAttention's
row-by-row route): outputs, labels, KV read per KV head and the pages each head chose; then a tiny model decoding a
batch both ways, tokens and statistics."""

import pytest
import torch

import attention
import generate
from attention import BatchAttention, DecodeAttention, page_batchable, page_rows
from criterion import Calibration
from model import KVCache, load_model
from moments import FixedMoments, OnlineMoments
from pages import PageIndex, candidates
from tests.test_generate import make_tiny_dir
from tests.test_pages import D, H, HKV, N_LOCAL, N_SINK, prefilled

L = 2
LENGTHS = [301, N_LOCAL + 1, 20, 150]  # the longest, just above the window, within it, between; each grows 1 a step
STEPS = 3
DONE = 1  # the row marked done after the first step


def stacked(dtype, seed=0):
    """Queries (STEPS, L, B, H, 1, D) and the stacked cache k, v (L, B, Hkv, T, D) at the last step's length, each
    row left-padded with noise (which a row must never read). Row 3's queries are positive and its keys negative, so
    every bound of its pages is below zero: a padding page that scored 0 would beat every one of them."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(LENGTHS), max(LENGTHS) + STEPS
    q = torch.randn(STEPS, L, B, H, 1, D, generator=g) * torch.linspace(0.5, 2.0, H)[:, None, None]
    k, v = torch.randn(L, B, HKV, T, D, generator=g), torch.randn(L, B, HKV, T, D, generator=g)
    q[:, :, 3] = q[:, :, 3].abs()
    k[:, 3] = -k[:, 3].abs() - 0.5
    return q.to(dtype), k.to(dtype), v.to(dtype)


def starts():
    return [max(LENGTHS) - n for n in LENGTHS]


def calibration():
    """One correction for every row, random per layer and head; in layer 0 the first group is held local and the last
    long, so a row also ranks the pages of one group alone. (Which way the other labels go is each test's to show:
    rows of their own tau and of their own moments have tests of their own.)"""
    g = torch.Generator().manual_seed(7)
    a = torch.randn(L, H, generator=g) * 2
    a[0, :H // HKV], a[0, -(H // HKV):] = 50.0, -50.0
    return Calibration(a, torch.rand(L, H, generator=g) + 0.5, torch.rand(L, HKV, generator=g) + 0.5, {})


def attentions(method, budgets, correction):
    """One DecodeAttention per row, each with its own PageIndex (folded in on its first call), moments and tau."""
    P = attention.page_size(method)
    g = torch.Generator().manual_seed(5)
    out = []
    for budget, tau in zip(budgets, [0.6, 0.3, 0.8, 0.5]):
        moments = FixedMoments(torch.randn(L, HKV, D, generator=g) * 0.5,
                               torch.eye(D).expand(L, HKV, D, D) * 0.1 * torch.rand(L, HKV, 1, 1, generator=g), 100)
        unit = "budget_frac" if method.endswith("_frac") else "budget"
        inputs = dict(pages=PageIndex(None, P, N_SINK), tau=tau, moments=moments, calibration=correction,
                      **{unit: budget})
        out.append(DecodeAttention(method, N_SINK, N_LOCAL, inputs))
    return out


BUDGETS = {  # per row: none, a few pages (different per row), every candidate
    "none": ([0] * 4, [0.0] * 4),
    "small": ([32, 64, 16, 32], [0.2, 0.3, 0.5, 0.25]),
    "all": ([10_000] * 4, [1.0] * 4)}


@pytest.fixture
def chosen_spy(monkeypatch):
    """The pages chosen on each route: per call of the row's paged_attention, (T, (H, m) bool); per call of
    row_pages, (n, H, M) bool. The rows' own paths run in torch on any device (not decode_kernels.fused_pages on
    CUDA)."""
    monkeypatch.setattr(attention, "fused", lambda q: False)
    alone, together = [], []
    one, many = attention.paged_attention, attention.row_pages

    def spy_one(q, k, v, chosen, *args):
        alone.append((k.shape[1], chosen.clone()))
        return one(q, k, v, chosen, *args)

    def spy_many(*args):
        chosen, *rest = many(*args)
        together.append(chosen.flatten(1, 2).clone())  # (n, H, M)
        return chosen, *rest
    monkeypatch.setattr(attention, "paged_attention", spy_one)
    monkeypatch.setattr(attention, "row_pages", spy_many)
    return alone, together


def decode_both(method, budget, dtype, break_start=False):
    """STEPS decode steps of L layers on both routes; the DONE row ends after the first step. Returns the outputs
    (row by row, batched) per (step, layer), and the two routes' DecodeAttentions."""
    q, k, v = stacked(dtype)
    budgets = BUDGETS[budget][1 if method.endswith("_frac") else 0]
    correction = calibration()
    alone = BatchAttention(attentions(method, budgets, correction), start=starts(), batched=False)
    rows = attentions(method, budgets, correction)
    assert page_batchable(rows) and not page_batchable(alone.rows[:1] + [DecodeAttention("dense")])
    start = [starts()[0]] * 4 if break_start else starts()
    want, got = [], []
    for step in range(STEPS):
        T = max(LENGTHS) + step + 1
        live = [b for b in range(4) if step == 0 or b != DONE]
        alone.done[DONE] = step > 0
        for layer in range(L):
            qq, kk, vv = q[step, layer], k[layer, :, :, :T], v[layer, :, :, :T]
            want.append(alone(qq, kk, vv, layer))
            y = torch.zeros_like(qq) if len(live) < 4 else torch.empty_like(qq)
            got.append(page_rows(rows, qq, kk, vv, layer, live, start, y))
    return want, got, alone.rows, rows


METHODS = ["quest", "qada_pages", "qada_pages_sum", "qada_pages_share", "quest_p32", "qada_pages_frac"]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("method", METHODS)
def test_page_rows_decode_each_row_as_its_own_path(chosen_spy, method, budget, dtype, tol):
    want, got, alone, rows = decode_both(method, budget, dtype)
    for call, (w, y) in enumerate(zip(want, got)):
        torch.testing.assert_close(y.float(), w.float(), rtol=0, atol=tol)
        assert (call < L) != (y[DONE] == 0).all()  # zeros once the row is done
    for a, b in zip(alone, rows):
        assert b.stats.lengths == a.stats.lengths
        assert torch.equal(b.stats.label_tensor(), a.stats.label_tensor())
        assert torch.equal(b.stats.read_tensor(), a.stats.read_tensor())  # window, pages, candidates scored
    labels = torch.cat([a.stats.label_tensor().flatten() for a in rows]).float()
    if "qada" in method:
        assert 0.1 < labels.mean() < 0.9  # groups of both kinds: the decision matters
    # the pages: row by row, each call of paged_attention in row order (a qada_pages row within its window makes
    # none); batched, one (n, H, M) per layer, a row's pages past its own candidates never chosen
    alone_chosen, together = chosen_spy
    calls = iter(alone_chosen)
    for step in range(STEPS):
        live = [b for b in range(4) if step == 0 or b != DONE]
        for layer in range(L):
            chosen = together.pop(0)
            for i, b in enumerate(live):
                T = LENGTHS[b] + step + 1
                m = candidates(T, N_SINK, N_LOCAL, attention.page_size(method))
                assert not chosen[i, :, m:].any()
                if "qada" in method and T <= N_LOCAL:
                    continue
                T_alone, want_chosen = next(calls)
                assert T_alone == T and torch.equal(chosen[i, :, :m], want_chosen)
    if budget == "small":
        assert any(c.any() and not c.all() for _, c in alone_chosen)  # pages ranked, not all or none


def test_rows_that_start_elsewhere_read_their_own_window_and_pages():
    """Every row read from the first row's start (its padding then counted as its context): outputs differ."""
    want, got, _, _ = decode_both("quest", "small", torch.float32, break_start=True)
    assert max((y - w).abs().max() for w, y in zip(want, got)) > 1e-2


@pytest.mark.parametrize("method", ["quest", "qada_pages"])
def test_a_row_shorter_than_its_sinks_reads_each_of_its_positions_once(monkeypatch, method):
    """A row of fewer positions than N_SINK (a prompt of two tokens): its gathered sinks run past the cache's end,
    clamped onto its last position, and are masked out there; its attention is full attention over its own two
    positions, as its own path gives it (LENGTHS' shortest row holds more than the sinks)."""
    monkeypatch.setattr(attention, "fused", lambda q: False)
    g = torch.Generator().manual_seed(11)
    lengths, T = [60, 2], 60
    q = torch.randn(2, H, 1, D, generator=g)
    k, v = torch.randn(2, HKV, T, D, generator=g), torch.randn(2, HKV, T, D, generator=g)
    start = [T - n for n in lengths]
    rows = attentions(method, [16, 16], calibration())[:2]
    y = page_rows(rows, q, k, v, 0, [0, 1], start, torch.empty_like(q))
    full = attention.reference_attention(q[1, :, 0], k[1, :, -2:], v[1, :, -2:], torch.zeros(H, dtype=torch.bool),
                                         N_SINK, N_LOCAL)
    torch.testing.assert_close(y[1, :, 0], full, rtol=0, atol=1e-5)
    alone = BatchAttention(attentions(method, [16, 16], calibration())[:2], start=start, batched=False)(q, k, v, 0)
    torch.testing.assert_close(y, alone, rtol=0, atol=1e-5)


def test_a_row_exactly_the_windows_length_and_rows_of_their_own_tau_decide_as_alone(monkeypatch):
    """Two rows of one context at tau 0.05 and 0.95, and a row of exactly N_LOCAL positions (no bulk: every head local
    and nothing read past its window, however its Gaussian term would decide): page_rows gives each row the output,
    labels and KV read of its own path."""
    monkeypatch.setattr(attention, "fused", lambda q: False)
    g = torch.Generator().manual_seed(12)
    lengths, T = [90, 90, N_LOCAL], 90
    q = torch.randn(3, H, 1, D, generator=g)
    k, v = torch.randn(3, HKV, T, D, generator=g), torch.randn(3, HKV, T, D, generator=g)
    q[1], k[1], v[1] = q[0], k[0], v[0]
    start = [T - n for n in lengths]

    def rows():
        out = attentions("qada_pages", [16, 16, 16], calibration())[:3]
        for a, tau in zip(out, (0.05, 0.95, 0.95)):
            a.inputs["tau"] = tau
        return out
    together, alone = rows(), BatchAttention(rows(), start=start, batched=False)
    for layer in range(L):  # layer 0's correction fixes two groups whatever tau (calibration); layer 1's does not
        y = page_rows(together, q, k, v, layer, [0, 1, 2], start, torch.empty_like(q))
        torch.testing.assert_close(y, alone(q, k, v, layer), rtol=0, atol=1e-5)
    for a, b in zip(alone.rows, together):
        assert torch.equal(b.stats.label_tensor(), a.stats.label_tensor())
        assert torch.equal(b.stats.read_tensor(), a.stats.read_tensor())
    labels = [a.stats.label_tensor()[0, 1] for a in alone.rows]
    assert not torch.equal(labels[0], labels[1]) and labels[2].all()  # the taus decide apart


def test_rows_of_their_own_moments_decide_as_alone(monkeypatch):
    """Two rows of one context, one tau and one correction, the second with other key moments (a larger mean and
    covariance): page_rows decides each with its own moments, as its path alone does, and the two label apart."""
    monkeypatch.setattr(attention, "fused", lambda q: False)
    g = torch.Generator().manual_seed(12)
    T, start = 300, [0, 0]
    q = torch.randn(2, H, 1, D, generator=g)
    k, v = torch.randn(2, HKV, T, D, generator=g), torch.randn(2, HKV, T, D, generator=g)
    q[1], k[1], v[1] = q[0], k[0], v[0]

    def rows():
        out = attentions("qada_pages", [16, 16], calibration())[:2]
        for a in out:
            a.inputs["tau"] = 0.5
        m = out[0].inputs["moments"]
        out[1].inputs["moments"] = FixedMoments(m.mean * 4, m.cov * 10, 100)
        return out
    together, alone = rows(), BatchAttention(rows(), start=start, batched=False)
    for layer in range(L):
        torch.testing.assert_close(page_rows(together, q, k, v, layer, [0, 1], start, torch.empty_like(q)),
                                   alone(q, k, v, layer), rtol=0, atol=1e-5)
    for a, b in zip(alone.rows, together):
        assert torch.equal(b.stats.label_tensor(), a.stats.label_tensor())
        assert torch.equal(b.stats.read_tensor(), a.stats.read_tensor())
    labels = [a.stats.label_tensor()[0, 1] for a in alone.rows]
    assert not torch.equal(labels[0], labels[1])  # the moments decide apart


def test_rows_decode_together_only_on_one_entry_window_and_calibration_with_fixed_moments():
    """page_rows takes the first row's entry, window and calibration for every row and reads fixed moments: a row that
    differs in any, or tracks the oracle (every score, row by row), keeps the rows on their own paths."""
    correction = calibration()
    rows = attentions("qada_pages", BUDGETS["small"][0], correction)
    assert page_batchable(rows)
    inputs = rows[1].inputs
    tracked = attentions("qada_pages", BUDGETS["small"][0], correction)[1]
    tracked.stats.track_oracle = True
    growing = OnlineMoments(prefilled(torch.randn(HKV, 60, D, generator=torch.Generator().manual_seed(1)), 100),
                            N_SINK, N_LOCAL)
    for odd in (attentions("qada_pages_sum", BUDGETS["small"][0], correction)[1],  # another entry
                DecodeAttention("qada_pages", N_SINK, 2 * N_LOCAL, inputs),  # another window
                DecodeAttention("qada_pages", N_SINK, N_LOCAL, inputs | dict(calibration=calibration())),  # its own
                DecodeAttention("qada_pages", N_SINK, N_LOCAL, inputs | dict(moments=growing)),
                tracked):
        assert not page_batchable(rows[:1] + [odd] + rows[2:])


def test_cache_gather_copies_each_pairs_positions_from_a_cache_of_any_layout():
    """The positions of (row, KV head) pairs, as advanced indexing copies them: from a cache sliced to its filled length
    (each position a row of D contiguous values, read through one index_select) and from a layout whose positions are
    no such rows (the head dim not innermost)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, HKV, 50, D, generator=g)
    b, h, pos = torch.tensor([2, 0, 1]), torch.tensor([1, 1, 0]), torch.randint(0, 40, (3, 7), generator=g)
    for view in (x[:, :, :40], x.transpose(2, 3).contiguous().transpose(2, 3)[:, :, :40]):
        assert torch.equal(attention.cache_gather(view, b, h, pos), view[b[:, None], h[:, None], pos])


@pytest.mark.parametrize("method", ["quest", "qada_pages"])
def test_host_reads_per_layer_do_not_grow_with_the_batch(monkeypatch, method):
    """The host syncs of page_rows (a tensor read into Python, or a shape that depends on values) are the same at 1
    row as at 4: which groups are long-context (qada_pages), and the most pages a (row, KV head) pair reads."""
    counts = []
    for n_rows in (1, 4):
        reads = []
        for name in ("__int__", "__float__", "__bool__", "item", "tolist", "nonzero"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name,
                                lambda self, *a, _o=original, _n=name, **kw: reads.append(_n) or _o(self, *a, **kw))
        q, k, v = stacked(torch.float32)
        rows = attentions(method, BUDGETS["small"][0], calibration())
        live = list(range(n_rows))
        page_rows(rows, q[0, 0], k[0, :, :, :max(LENGTHS) + 1], v[0, :, :, :max(LENGTHS) + 1], 0, live, starts(),
                  torch.zeros_like(q[0, 0]))
        monkeypatch.undo()
        counts.append(reads)
    assert counts[0] == counts[1] == (["__int__"] if method == "quest" else ["tolist", "__int__"])


# --- a tiny model decoding a batch through page_rows ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(make_tiny_dir(tmp_path_factory.mktemp("tiny_pages_batch"))))


def routed(monkeypatch):
    """Counts BatchAttention's calls of page_rows (the live rows of each); the rows' own paths run in torch on any
    device (not decode_kernels.fused_pages, which BatchAttention leaves to each row's run_path)."""
    monkeypatch.setattr(attention, "fused", lambda q: False)
    calls, original = [], attention.page_rows

    def spy(rows, q, k, v, layer, live, *args):
        calls.append(len(live))
        return original(rows, q, k, v, layer, live, *args)
    monkeypatch.setattr(attention, "page_rows", spy)
    return calls


@pytest.mark.parametrize("method,budget", [("quest", 32), ("qada_pages", 32), ("qada_pages_sum", 48)])
def test_a_model_decodes_a_batch_through_page_rows_as_row_by_row(tiny, monkeypatch, method, budget):
    """Four prompts (one within the window, one just above it) decoded in one stacked cache, rows ending at different
    steps: the same tokens, labels, KV read and lengths batched (page_rows) and row by row."""
    n_sink, n_local, n_new = 4, 16, 10
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 100, (1, n), generator=g) for n in (150, 17, 9, 97)]
    cfg = tiny.cfg
    Hq, Hk, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gc = torch.Generator().manual_seed(8)
    correction = Calibration(torch.randn(cfg.num_hidden_layers, Hq, generator=gc) * 2,
                             torch.rand(cfg.num_hidden_layers, Hq, generator=gc) + 0.5, None, {})
    calls = routed(monkeypatch)

    def run(batched):  # finished: the stop rule set below
        caches = [tiny.new_cache(p.shape[1] + n_new) for p in prompts]
        firsts = [tiny.prefill(p, c) for p, c in zip(prompts, caches)]
        gm = torch.Generator().manual_seed(9)
        atts = [attention.build_attention(method, c, n_sink=n_sink, n_local=n_local, tau=0.5, budget=budget,
                                          calibration=correction,
                                          moments=FixedMoments(torch.randn(cfg.num_hidden_layers, Hk, Dh, generator=gm),
                                                               torch.eye(Dh).expand(cfg.num_hidden_layers, Hk, Dh, Dh),
                                                               100))
                for c in caches]
        stack = KVCache.stack(caches, n_new)
        batch = BatchAttention(atts, start=stack.start.tolist(), batched=batched)
        tokens = generate.decode_batch(tiny, stack, torch.cat(firsts), n_new, batch, finished=finished)
        return tokens, atts

    finished = None
    free, _ = run(False)
    stops = [free[0][:4], free[2][:7]]  # rows 0 and 2 end early: the batch marks them done, then compacts
    finished = lambda ids: ids in stops  # noqa: E731
    alone_tokens, alone = run(False)
    assert not calls  # batched=False: the row-by-row route only
    batched_tokens, rows = run(True)
    assert batched_tokens == alone_tokens and sorted(map(len, alone_tokens)) == [4, 7, n_new, n_new]
    assert calls and max(calls) == 4 and min(calls) < 4  # the batched route ran, with a done row and after compacting
    for a, b in zip(alone, rows):
        assert b.stats.lengths == a.stats.lengths
        assert torch.equal(b.stats.label_tensor(), a.stats.label_tensor())
        assert torch.equal(b.stats.read_tensor(), a.stats.read_tensor())
    if "qada" in method:
        labels = torch.cat([a.stats.label_tensor().flatten() for a in rows]).float()
        assert 0.05 < labels.mean() < 0.95
