"""The QAdA criterion, the attention paths and the key moments, each held against an independent computation."""

import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import attention
from attention import DecodeAttention, HeadStats, kv_read_fraction, mixed_attention, reference_attention
from criterion import (TAU, Calibration, bulk_cap, check_tau, check_window, gaussian_form, gaussian_log_bulk,
                       load_labels, local_labels, oracle_labels, oracle_log_masses, qada_labels, save_labels,
                       static_labels, tau_logit)
from moments import (SHARED, SOURCES, FixedMoments, OnlineMoments, ReferenceKeys, bulk_end, make_moments, mean_cov,
                     model_identity, prompt_moments, random_words_text, reference_end, reference_words)
from pages import PageIndex

N_SINK, N_LOCAL = 16, 128


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def random_cov(Hkv, D, seed=0, scale=0.3):
    a = rand(Hkv, D, D, seed=seed) * scale / math.sqrt(D)
    return a @ a.transpose(1, 2) + 0.01 * torch.eye(D)


# --- criterion ---------------------------------------------------------------------------------------------


def test_gaussian_closed_form_matches_monte_carlo():
    """E[exp(q k / sqrt d)] for k ~ N(mu, Sigma) equals exp(mu_s + sigma_s^2 / 2) (Eq. 6)."""
    Hkv, G, D = 2, 3, 16
    mean, cov = rand(Hkv, D, seed=1) * 0.5, random_cov(Hkv, D, seed=2, scale=1.0)
    q = rand(Hkv * G, D, seed=3)
    n = 400_000
    chol = torch.linalg.cholesky(cov.double())  # (Hkv, D, D)
    keys = mean.double()[:, None] + (rand(Hkv, n, D, seed=4).double() @ chol.transpose(1, 2))  # (Hkv, n, D)
    qg = q.double().view(Hkv, G, D)
    mc = torch.logsumexp(qg @ keys.transpose(1, 2) / math.sqrt(D), -1) - math.log(n)  # (Hkv, G)
    closed = gaussian_log_bulk(q, gaussian_form(mean, cov), n_bulk=1).view(Hkv, G).double()
    assert (closed.exp() - mc.exp()).abs().max() / mc.exp().max() < 0.01
    assert closed.std() > 0.05  # the heads really differ, so the comparison is not trivial


def test_oracle_masses_match_brute_force():
    H, T = 5, 300
    scores = rand(H, T, seed=5) * 3
    log_local, log_bulk = oracle_log_masses(scores, N_SINK, N_LOCAL)
    for h in range(H):
        window = [i for i in range(T) if i < N_SINK or i >= T - (N_LOCAL - N_SINK)]
        a_local = sum(math.exp(float(scores[h, i])) for i in window)
        a_bulk = sum(math.exp(float(scores[h, i])) for i in range(T) if i not in window)
        assert len(window) == N_LOCAL
        assert math.isclose(float(log_local[h]), math.log(a_local), rel_tol=1e-5)
        assert math.isclose(float(log_bulk[h]), math.log(a_bulk), rel_tol=1e-5)


def test_oracle_masses_of_bf16_scores_are_taken_in_fp32():
    # a bf16 model's scores: their log masses summed in fp32 (in bf16 the sum of 300 exps keeps ~3 digits)
    scores = (rand(5, 300, seed=5) * 3).bfloat16()
    masses = oracle_log_masses(scores, N_SINK, N_LOCAL)
    for got, want in zip(masses, oracle_log_masses(scores.float(), N_SINK, N_LOCAL)):
        assert got.dtype == torch.float32 and torch.equal(got, want)


def test_at_tau_one_a_head_with_any_bulk_is_read():
    # the threshold log(tau / (1 - tau)) is inf at tau = 1: however far the window's mass is above the bulk's (here
    # e^1000 times), a head with a bulk is not local; one without a bulk (log A_bulk = -inf) is, per head and per
    # group. The "mean" rule's bulk share is an fp32 sigmoid, which reaches 0 at a ratio near e^-88 (local_labels)
    for r, rules in ((1000.0, (None, "all")), (50.0, ("mean",))):
        log_local, log_bulk = torch.tensor([[r, 0.0]]), torch.tensor([[0.0, -math.inf]])
        for tau in (1.0, torch.tensor([[1.0]], dtype=torch.float64)):
            for rule in rules:
                assert local_labels(log_local, log_bulk, tau, 2, rule).tolist() == [[False, True]]


def test_tau_range():
    for bad in (0.0, -0.1, 1.01, float("nan")):
        with pytest.raises(ValueError, match="tau"):
            check_tau(bad)
    for bad in ("0.5", True, None):  # a ValueError naming tau, not a TypeError of the comparison
        with pytest.raises(ValueError, match="tau must be a number in \\(0, 1\\]"):
            check_tau(bad)
    assert check_tau(1.0) == 1.0 and check_tau(1) == 1


def test_a_tensor_of_taus_gives_the_threshold_a_float_gives():
    """criterion.tau_logit of a batch's taus (the kernel's and the batched paths') is the float path's, rounded
    once to fp32: computed in fp32 it differs by an ulp for about a third of the taus, and a share at the threshold
    is then labelled by one path and not the other."""
    taus = torch.linspace(0.01, 0.99, 999)
    floats = torch.tensor([tau_logit(float(t)) for t in taus], dtype=torch.float32)
    assert tau_logit(taus).dtype == torch.float32 and torch.equal(tau_logit(taus), floats)
    assert tau_logit(torch.tensor([1.0])).item() == math.inf


def test_a_tensor_of_taus_gives_the_mean_rules_cap_a_float_gives():
    # criterion.bulk_cap of the float64 taus the batch paths and the kernel pass (kernel_thresholds) is the float
    # path's 1 - tau rounded once to fp32; rounding tau to fp32 first moves it by an ulp for about 40 % of the taus
    taus = torch.linspace(0.01, 0.99, 999, dtype=torch.float64)
    floats = torch.tensor([bulk_cap(float(t)) for t in taus], dtype=torch.float32)
    assert bulk_cap(taus).dtype == torch.float32 and torch.equal(bulk_cap(taus), floats)


def test_a_tensor_of_bulk_sizes_gives_the_estimate_an_int_gives():
    # one T_bulk per row of a batch (a tensor) against each row's int: log T_bulk taken in float64 then rounded, as
    # math.log's; an fp32 log differs by an ulp for some sizes (7, 47, 49, ...), and a label at the threshold flips.
    # q = 0 leaves log T_bulk alone in the estimate, so no matmul's rounding enters the comparison
    D = 8
    form = gaussian_form(rand(HKV, D, seed=1), random_cov(HKV, D, seed=2))
    n_bulk = torch.arange(1, 2001)
    rows = tuple(x.expand(len(n_bulk), *x.shape) for x in form)  # one form per row, as attention.stacked_forms
    batched = gaussian_log_bulk(torch.zeros(len(n_bulk), H, D), rows, n_bulk[:, None])
    ints = torch.stack([gaussian_log_bulk(torch.zeros(H, D), form, n) for n in n_bulk.tolist()])
    assert torch.equal(batched, ints)
    assert torch.equal(ints[:, 0], torch.tensor([math.log(n) for n in n_bulk.tolist()], dtype=torch.float32))
    many = torch.arange(1, 1 << 17)  # where the sizes an fp32 log rounds otherwise lie depends on torch's build
    rows = tuple(x[:1].expand(len(many), *x[:1].shape) for x in form)  # one KV head: one head per row
    batched = gaussian_log_bulk(torch.zeros(len(many), 1, D), rows, many[:, None])
    assert torch.equal(batched[:, 0], torch.tensor([math.log(n) for n in many.tolist()], dtype=torch.float32))


def test_the_window_sizes_every_caller_checks():
    """criterion.check_window, which DecodeAttention, generate.py, lab.sweep and the HF adapter call: integers with
    0 <= n_sink < n_local, in the caller's spelling."""
    for n_sink, n_local in ((16, 16), (-1, 128), (16.0, 128), (16, "128"), (True, 128)):
        with pytest.raises(ValueError, match="need integers 0 <= n_sink < n_local"):
            check_window(n_sink, n_local)
    with pytest.raises(ValueError, match="need integers 0 <= --n-sink < --n-local, got 200 and 128"):
        check_window(200, 128, ("--n-sink", "--n-local"))
    check_window(0, 1)
    check_window(16, 128)
    with pytest.raises(ValueError, match="n_sink < n_local"):
        DecodeAttention("local", n_sink=128, n_local=128)


def test_decode_attention_refuses_a_missing_input_and_a_bad_tau():
    """DecodeAttention, the Python entry that bypasses the CLI's checks: a path given no value for what it reads is
    refused naming it (not a KeyError), and so is a tau outside (0, 1]; what the path does not read is dropped."""
    moments = make_attention("qada").moments
    with pytest.raises(ValueError, match="the qada path reads tau; give --set tau=VALUE"):
        DecodeAttention("qada", N_SINK, N_LOCAL, dict(moments=moments))
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="tau must lie in"):
            DecodeAttention("qada", N_SINK, N_LOCAL, dict(tau=bad, moments=moments))
    att = DecodeAttention("local", N_SINK, N_LOCAL, dict(tau=1.5, moments=moments))
    assert att.inputs == {"n_sink": N_SINK, "n_local": N_LOCAL} and att.tau is None
    q, k, v = random_qkv(200)
    with pytest.raises(ValueError, match="decodes one row"):  # two rows are BatchAttention's
        att(q[None, :, None].expand(2, -1, -1, -1), k[None].expand(2, -1, -1, -1), v[None].expand(2, -1, -1, -1), 0)


def test_qada_labels_follow_the_local_share():
    """A head whose window scores dwarf the Gaussian bulk estimate is local, and the converse."""
    D, T = 8, 1000
    q = torch.zeros(2, D)
    mean, cov = torch.zeros(1, D), torch.zeros(1, D, D)  # bulk scores all 0: A_bulk = T_bulk
    window = torch.stack([torch.full((N_LOCAL,), 10.0), torch.zeros(N_LOCAL)]).logsumexp(-1)  # log A_local per head
    labels = qada_labels(q, window, gaussian_form(mean, cov), T - N_LOCAL, tau=0.6)
    assert labels.tolist() == [True, False]
    # head 1: share = 128 / 1000 exactly, so the threshold sits right there
    assert qada_labels(q, window, gaussian_form(mean, cov), T - N_LOCAL, tau=0.127)[1]
    assert not qada_labels(q, window, gaussian_form(mean, cov), T - N_LOCAL, tau=0.129)[1]


def eq7_share(q, window_keys, mean, cov, n_bulk):
    """Eq. 7's estimated local share for one query head, from the equation alone in float64 (no project
    function): A_local / (A_local + n_bulk exp(mu_s + sigma_s^2 / 2)), mu_s = q mu / sqrt d, sigma_s^2 = q S q / d."""
    d = q.shape[0]
    q = q.double()
    a_local = sum(math.exp(float(q @ key.double()) / math.sqrt(d)) for key in window_keys)
    mu_s = float(q @ mean.double()) / math.sqrt(d)
    sigma2 = float(q @ cov.double() @ q) / d
    return a_local / (a_local + n_bulk * math.exp(mu_s + sigma2 / 2))


@pytest.mark.parametrize("T", [N_LOCAL + 1, 300])
def test_qada_path_labels_equal_eq7_written_plainly(T):
    """The qada path's labels on random heads equal Eq. 7 recomputed from first principles, at many tau.
    The data are scaled so that mu_s and sigma_s^2 / 2 both move shares across the thresholds: halving or
    doubling either term, or scaling the mean by 1/d instead of 1/sqrt(d), changes some labels."""
    Hkv, G, D = 2, 8, 16
    q = rand(Hkv * G, D, seed=3) * torch.linspace(0.3, 2.0, Hkv * G)[:, None]  # heads from flat to peaked
    k = rand(Hkv, T, D, seed=4)
    v = rand(Hkv, T, D, seed=5)
    a = rand(Hkv, D, D, seed=6) * 0.35
    mean, cov = rand(Hkv, D, seed=7) * 0.8, a @ a.mT + 0.05 * torch.eye(D)
    window = list(range(N_SINK)) + list(range(T - (N_LOCAL - N_SINK), T))
    shares = torch.tensor([eq7_share(q[h], k[h // G, window], mean[h // G], cov[h // G], T - N_LOCAL)
                           for h in range(Hkv * G)])
    straddled = 0
    for tau in torch.linspace(0.05, 0.95, 19).tolist():
        attn = DecodeAttention("qada", N_SINK, N_LOCAL,
                               dict(tau=tau, moments=FixedMoments(mean[None], cov[None], T - N_LOCAL)))
        attn(q[None, :, None], k[None], v[None], 0)
        near = (shares - tau).abs() < 1e-5  # fp32 against fp64: either way is right
        got, want = attn.stats.labels[-1][0], shares >= tau
        assert torch.equal(got[~near], want[~near]), tau
        straddled += 0 < int(want.sum()) < Hkv * G
    assert straddled >= 6  # the heads straddle many thresholds, so the comparison has teeth


# --- attention paths ---------------------------------------------------------------------------------------

H, HKV, D = 6, 2, 32


def random_qkv(T, seed=0, dtype=torch.float32):
    return (rand(H, D, seed=seed, dtype=dtype), rand(HKV, T, D, seed=seed + 1, dtype=dtype),
            rand(HKV, T, D, seed=seed + 2, dtype=dtype))


def make_attention(method, tau=0.6, static_local=None, L=1, T=None):
    moments = FixedMoments(rand(L, HKV, D, seed=9) * 0.1, random_cov(HKV, D, seed=10)[None].repeat(L, 1, 1, 1), 1000)
    if static_local is None:
        static_local = torch.zeros(L, H, dtype=torch.bool)
    identity = Calibration(torch.zeros(L, H), torch.ones(L, H), None, {})  # qada_cal as qada
    pages = PageIndex(None, attention.page_size(method) or 16, N_SINK)  # the page paths' (tests/test_pages.py)
    return DecodeAttention(method, N_SINK, N_LOCAL, dict(tau=tau, moments=moments, static_local=static_local,
                                                         calibration=identity, pages=pages, budget=64,
                                                         budget_frac=0.1))


def call(attn, q, k, v, layer=0):
    return attn(q[None, :, None], k[None], v[None], layer)[0, :, 0]


@pytest.mark.parametrize("T", [1, 17, N_LOCAL - 1, N_LOCAL])
@pytest.mark.parametrize("method", list(attention.PATHS))
def test_every_path_is_dense_when_the_context_fits_the_window(method, T):
    q, k, v = random_qkv(T, seed=T)
    dense = call(make_attention("dense"), q, k, v)
    got = call(make_attention(method, static_local=torch.ones(1, H, dtype=torch.bool)), q, k, v)
    assert (got - dense).abs().max() < 1e-5


@pytest.mark.parametrize("T", [N_LOCAL + 1, 300, 2000])
def test_tau_one_is_dense(T):
    q, k, v = random_qkv(T, seed=T)
    attn = make_attention("qada", tau=1.0)
    got = call(attn, q, k, v)
    assert not attn.stats.labels[-1][0].any()
    assert (got - call(make_attention("dense"), q, k, v)).abs().max() < 1e-5


@pytest.mark.parametrize("T", [N_LOCAL + 1, 700])
def test_all_local_is_the_local_path_and_static_zero_is_dense(T):
    q, k, v = random_qkv(T, seed=T)
    local = call(make_attention("local"), q, k, v)
    all_local = call(make_attention("static", static_local=torch.ones(1, H, dtype=torch.bool)), q, k, v)
    assert (all_local - local).abs().max() < 1e-6
    static0 = call(make_attention("static", static_local=torch.zeros(1, H, dtype=torch.bool)), q, k, v)
    assert (static0 - call(make_attention("dense"), q, k, v)).abs().max() < 1e-5
    assert (local - static0).abs().max() > 1e-3  # the window really differs from dense here


@pytest.mark.parametrize("method", list(attention.PATHS))
def test_every_path_answers_in_the_caches_dtype(method):
    """The model's next matmul takes the cache's dtype: a path that computes in fp32 (the oracle's reference) casts
    back. Past the window, so that every path decides and reads its bulk."""
    q, k, v = random_qkv(300, seed=5, dtype=torch.bfloat16)
    y = call(make_attention(method), q, k, v)
    assert y.dtype == torch.bfloat16 and y.isfinite().all()


def test_static_reads_the_labels_of_the_layer_it_decodes():
    # layer 0 all long-context, layer 1 all local: a static path that read layer 0's labels at every layer is dense
    q, k, v = random_qkv(300, seed=4)
    static_local = torch.stack([torch.zeros(H, dtype=torch.bool), torch.ones(H, dtype=torch.bool)])  # (L, H)
    attn = make_attention("static", static_local=static_local, L=2)
    y0, y1 = call(attn, q, k, v, layer=0), call(attn, q, k, v, layer=1)
    assert [labels.tolist() for labels in attn.stats.labels[0]] == static_local.tolist()
    assert (y0 - call(make_attention("dense"), q, k, v)).abs().max() < 1e-5
    assert (y1 - call(make_attention("local"), q, k, v)).abs().max() < 1e-6


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("T", [N_LOCAL + 1, 257, 1500])
@pytest.mark.parametrize("pattern", [0, 1, 2, 3])
def test_mixed_attention_equals_fp32_reference(T, pattern, dtype, tol):
    q, k, v = random_qkv(T, seed=pattern, dtype=dtype)
    local = [torch.zeros(H, dtype=torch.bool), torch.ones(H, dtype=torch.bool),
             torch.tensor([1, 1, 1, 0, 1, 1], dtype=torch.bool),  # group 0 fully local: its cache is skipped
             rand(H, seed=T) > 0][pattern]
    got = mixed_attention(q, k, v, local, N_SINK, N_LOCAL)
    ref = reference_attention(q, k, v, local, N_SINK, N_LOCAL)
    assert got.dtype == dtype
    assert (got.float() - ref).abs().max() < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])  # bf16: scores rounded to 8 bits
@pytest.mark.parametrize("T", [1, N_LOCAL - 1, N_LOCAL, N_LOCAL + 1, 700])
def test_window_attention_mass_equals_float64_logsumexp(T, dtype, tol):
    """window_attention's log A_local (taken from its log_softmax) equals the log-sum-exp of the window's scores
    computed in float64 from the cache, and its output equals the fp32 reference with every head local."""
    q, k, v = random_qkv(T, seed=T, dtype=dtype)
    q = q * torch.linspace(0.2, 4.0, H, dtype=dtype)[:, None]  # flat to peaked heads, so the first sink's weight varies
    y, log_local = attention.window_attention(q, k, v, N_SINK, N_LOCAL)
    window = [i for i in range(T) if i < N_SINK or i >= T - (N_LOCAL - N_SINK)]
    scores = torch.stack([q[h].double() @ k[h // (H // HKV), window].double().T for h in range(H)]) / math.sqrt(D)
    assert log_local.dtype == torch.float32
    torch.testing.assert_close(log_local.double(), scores.logsumexp(-1), rtol=tol, atol=tol)
    ref = attention.reference_attention(q, k, v, torch.ones(H, dtype=torch.bool), N_SINK, N_LOCAL)
    torch.testing.assert_close(y.float(), ref, rtol=0, atol=30 * tol)


@pytest.mark.parametrize("T", [N_LOCAL + 1, 900])
def test_qada_path_equals_reference_with_its_own_labels(T):
    q, k, v = random_qkv(T, seed=3)
    k[:, -5:] += 3 * q.view(HKV, 3, D)[:, :1]  # some heads find their keys in the recent window
    for tau in (0.05, 0.3, 0.6, 0.9):
        attn = make_attention("qada", tau=tau)
        got = call(attn, q, k, v)
        labels = attn.stats.labels[-1][0]
        assert (got - reference_attention(q, k, v, labels, N_SINK, N_LOCAL)).abs().max() < 1e-5


def test_static_labels_pick_the_most_often_local_heads(tmp_path):
    freq = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.8, 0.3]])
    assert static_labels(freq, 0.0).sum() == 0
    assert static_labels(freq, 1 / 3).tolist() == [[True, False, False], [False, True, False]]
    assert static_labels(freq, 1.0).all()
    # the nearest count of heads: 0.7 of 6 is 4.2 -> 4, 0.75 of 6 is 4.5 -> 4 (half to even), 0.8 of 6 is 4.8 -> 5
    assert [int(static_labels(freq, f).sum()) for f in (0.7, 0.75, 0.8)] == [4, 4, 5]
    save_labels(tmp_path / "labels.json", freq, {"tau": 0.6, "model": "x"})
    labels, settings = load_labels(tmp_path / "labels.json", 0.5)
    assert settings == {"tau": 0.6, "model": "x"} and labels.sum() == 3 and labels[0, 0] and labels[1, 1]
    with pytest.raises(FileNotFoundError):
        load_labels(tmp_path / "missing.json", 0.5)
    (tmp_path / "other.json").write_text('{"settings": {}}')  # some other JSON: the entry it lacks, named in words
    with pytest.raises(ValueError, match="other.json is not a static labels file: it has no 'local_freq' entry$"):
        load_labels(tmp_path / "other.json", 0.5)
    for bad in (-0.25, 1.5):  # lab.sweep and lab.records call it directly: -0.25 made all but 2 heads local
        with pytest.raises(ValueError, match="static sparsity must lie in"):
            static_labels(freq, bad)


def test_static_labels_break_ties_by_layer_then_head():
    # a stable sort: of heads equally often local, the first in (layer, head) order; an unstable one picks others
    # from 32 heads on (torch's CPU sort), and the same frequencies would give other labels than the run they came from
    freq = torch.full((4, 8), 0.5)
    freq[3, 7] = 0.9
    labels = static_labels(freq, 9 / 32)
    assert labels[3, 7] and labels[0].all() and labels.sum() == 9
    groups = static_labels(torch.full((4, 8), 0.5), 0.25, n_kv_heads=8)  # 32 KV heads of one query head each
    assert groups[0].all() and groups.sum() == 8


# --- statistics ----------------------------------------------------------------------------------------------


def test_kv_read_fraction_counts_gqa_groups():
    # 2 steps, 1 layer, 6 query heads in 2 groups of 3; T = 1280 so a local KV head reads 128 / 1280 = 0.1.
    labels = torch.tensor([[[1, 1, 1, 1, 1, 0]], [[1, 1, 1, 1, 1, 1]]], dtype=torch.bool)
    lengths = torch.tensor([1280, 1280])
    # step 0: group 0 skipped (0.1), group 1 read (1); step 1: both skipped (0.1, 0.1)
    assert math.isclose(kv_read_fraction(labels, lengths, 2, 128), (0.1 + 1 + 0.1 + 0.1) / 4)
    # a context inside the window reads everything whatever the labels
    assert math.isclose(kv_read_fraction(labels, torch.tensor([100, 100]), 2, 128), 1.0)
    stats = HeadStats(128)
    for step in range(2):
        stats.record(0, 1280, labels[step, 0])
    s = stats.summary(2)
    assert s["sparsity"] == pytest.approx(11 / 12) and s["layer_sparsity"] == [pytest.approx(11 / 12)]


def test_the_first_steps_keep_the_reads_of_those_steps_only():
    # integrations/transformers.py reports a row that ended early through HeadStats.first: a page path's reads are cut
    # where its labels and lengths are, or the KV read counts the steps decoded after the answer ended
    stats = HeadStats(N_LOCAL)
    for step, T in enumerate((400, 401, 402)):
        stats.record(0, T, torch.zeros(H, dtype=torch.bool), read=torch.full((HKV,), 100 * (step + 1)))
    first = stats.first(2)
    assert first.lengths == [400, 401] and first.read_tensor().shape == (2, 1, HKV)
    assert first.summary(HKV)["kv_read"] == pytest.approx((100 + 200) / (400 + 401))


def test_reads_reported_at_some_steps_only_leave_the_kv_read_to_the_labels():
    # a step without a reported read (a path that reports none, or a step recorded without one) makes the reported
    # reads unusable: the KV read is then the one the labels imply, over every step
    stats = HeadStats(N_LOCAL)
    labels = torch.tensor([True] * 3 + [False] * 3)  # group 0 local, group 1 long
    for T, read in ((400, None), (401, torch.full((HKV,), 7))):
        stats.record(0, T, labels, read=read)
    assert stats.read_tensor() is None
    assert stats.summary(HKV)["kv_read"] == pytest.approx((N_LOCAL + 400 + N_LOCAL + 401) / (2 * 400 + 2 * 401))


def test_the_first_steps_keep_the_oracles_agreement_of_those_steps_only():
    stats = HeadStats(N_LOCAL, track_oracle=True)
    local, long = torch.ones(H, dtype=torch.bool), torch.zeros(H, dtype=torch.bool)
    for oracle in (local, long, long):  # the path's labels all local: agreeing at step 0, not after
        stats.record(0, 400, local, oracle, torch.zeros(4, H))
    first = stats.first(1)
    assert first.summary(HKV)["agreement"] == {"TP": H, "FP": 0, "TN": 0, "FN": 0}
    assert stats.summary(HKV)["agreement"] == {"TP": H, "FP": 2 * H, "TN": 0, "FN": 0}
    assert len(first.log_masses) == 1


def test_oracle_labels_and_agreement_equal_brute_force():
    """The tracked oracle labels equal Eq. 2 from every score in float64, and the agreement counts are those
    of QAdA's labels against these independent oracle labels."""
    attn = make_attention("qada", tau=0.5)
    attn.stats.track_oracle = True
    want_oracle = []
    for seed in range(4):
        q, k, v = random_qkv(600, seed=seed)
        k[:, -3:] += 4 * q.view(HKV, 3, D)[:, :1]
        call(attn, q, k, v)
        window = set(range(N_SINK)) | set(range(600 - (N_LOCAL - N_SINK), 600))
        step = []
        for h in range(H):
            s = [float(q[h].double() @ k[h // 3, i].double()) / math.sqrt(D) for i in range(600)]
            a_local = sum(math.exp(x) for i, x in enumerate(s) if i in window)
            step.append(a_local / sum(math.exp(x) for x in s) >= 0.5)
        want_oracle.append(step)
    oracle = attn.stats.oracle_tensor()[:, 0]  # (steps, H)
    want = torch.tensor(want_oracle, device="cpu")  # the statistics are kept on the CPU
    assert torch.equal(oracle, want)
    assert 0 < int(want.sum()) < want.numel()  # both labels occur
    labels = attn.stats.label_tensor()[:, 0]
    a = attn.stats.summary(HKV)["agreement"]
    assert a == {"TP": int((labels & want).sum()), "FP": int((labels & ~want).sum()),
                 "TN": int((~labels & ~want).sum()), "FN": int((~labels & want).sum())}


def test_the_tracked_log_masses_are_the_equations_in_float64():
    """oracle_view's four rows, from which lab.sweep takes Table 2's errors of the Gaussian estimate: the window's and
    the bulk's true log masses, the path's Gaussian estimate (its moments, T_bulk = T - n_local) and the Gaussian of
    this step's own bulk keys (sinks and window left out), each log T_bulk + q mu / sqrt(d) + q S q / 2d written
    plainly; and the oracle's labels at the path's tau, not criterion.TAU."""
    T, tau = 600, 0.25
    q, k, v = random_qkv(T, seed=5)
    q = q * torch.linspace(0.5, 2.5, H)[:, None]  # flat to peaked heads: shares on both sides of tau and TAU
    attn = make_attention("qada", tau=tau)
    attn.stats.track_oracle = True
    call(attn, q, k, v)
    window = list(range(N_SINK)) + list(range(T - (N_LOCAL - N_SINK), T))
    bulk = list(range(N_SINK, T - (N_LOCAL - N_SINK)))
    want = torch.empty(4, H, dtype=torch.float64)
    for h in range(H):
        qh, kh = q[h].double(), k[h // (H // HKV)].double()
        s = kh @ qh / math.sqrt(D)
        want[0, h], want[1, h] = s[window].logsumexp(0), s[bulk].logsumexp(0)
        path_moments = attn.moments.mean[0, h // (H // HKV)].double(), attn.moments.cov[0, h // (H // HKV)].double()
        own_moments = kh[bulk].mean(0), torch.cov(kh[bulk].T, correction=0)
        for row, (mu, cov) in ((2, path_moments), (3, own_moments)):
            want[row, h] = math.log(T - N_LOCAL) + qh @ mu / math.sqrt(D) + qh @ cov @ qh / (2 * D)
    torch.testing.assert_close(attn.stats.log_masses[0][0].double(), want, atol=1e-4, rtol=1e-5)
    shares = torch.sigmoid(want[0] - want[1])
    assert torch.equal(attn.stats.oracle_tensor()[0, 0], shares >= tau) and 0 < int((shares >= tau).sum()) < H
    assert ((shares >= tau) != (shares >= TAU)).any()  # the two thresholds label some head differently


@pytest.mark.parametrize("T", [N_LOCAL - 1, N_LOCAL])
def test_the_tracked_masses_of_a_context_within_the_window_have_no_bulk(T):
    """No bulk keys: the oracle labels every head local, the bulk's true mass is 0 and neither Gaussian estimate
    exists (NaN), rather than moments of no keys asked for."""
    q, k, v = random_qkv(T, seed=T)
    attn = make_attention("qada", tau=0.5)
    attn.stats.track_oracle = True
    call(attn, q, k, v)
    masses = attn.stats.log_masses[0][0]
    assert attn.stats.oracle_tensor()[0, 0].all() and (masses[1] == -math.inf).all()
    assert masses[2:].isnan().all() and masses[0].isfinite().all()


# --- moments -------------------------------------------------------------------------------------------------


def test_mean_cov_matches_torch_cov():
    keys = rand(3, 500, 8, seed=0) * 2 + 5
    mean, cov = mean_cov(keys)
    for h in range(3):
        ref = torch.cov(keys[h].double().T, correction=0)
        assert (cov[h].double() - ref).abs().max() < 1e-4
        assert (mean[h].double() - keys[h].double().mean(0)).abs().max() < 1e-5


def test_mean_cov_of_a_half_precision_cache_is_fp32_and_of_no_keys_refused():
    """A bf16 cache's keys give fp32 moments, equal to float64 ones of the same keys (summed in bf16 they are off by
    ~0.5 %); no keys at all is an error, not NaN moments."""
    keys = (rand(3, 500, 8, seed=1) * 2 + 5).bfloat16()
    mean, cov = mean_cov(keys)
    assert mean.dtype == cov.dtype == torch.float32
    for h in range(3):
        assert (mean[h].double() - keys[h].double().mean(0)).abs().max() < 1e-5
        assert (cov[h].double() - torch.cov(keys[h].double().T, correction=0)).abs().max() < 1e-4
    with pytest.raises(ValueError, match="moments of no keys"):
        mean_cov(torch.zeros(2, 0, 8))


class WordTokenizer:
    """A stand-in tokenizer for the tiny random model: one id per word."""

    def __init__(self, vocab=101):
        self.vocab = vocab

    def encode(self, text, add_special_tokens=False):
        return [sum(map(ord, w)) % self.vocab for w in text.split()]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from model import load_model
    from tests.test_model import save_tiny
    path = tmp_path_factory.mktemp("tiny")
    save_tiny("llama-gqa", path)
    return load_model(str(path))


def test_online_moments_equal_float64_recomputation(tiny):
    """Option 1 online (ours) after many decode steps equals mean/cov recomputed from scratch over the bulk keys."""
    T0, steps = 200, 150
    ids = torch.randint(0, 101, (1, T0), generator=torch.Generator().manual_seed(0))
    cache = tiny.new_cache(T0 + steps + 1)
    logits = tiny.prefill(ids, cache)
    moments = OnlineMoments(cache, N_SINK, N_LOCAL)
    attn = DecodeAttention("qada", N_SINK, N_LOCAL, dict(tau=0.6, moments=moments))
    for _ in range(steps):
        logits = tiny.decode_step(logits.argmax(-1), cache, attn)
    T = cache.length
    for layer in range(tiny.cfg.num_hidden_layers):
        bulk = cache.k[layer, 0, :, N_SINK:T - (N_LOCAL - N_SINK)].double()  # (Hkv, N, D)
        assert moments.count[layer] == bulk.shape[1] == T - N_LOCAL
        mean, cov = moments.mean_cov(layer, cache.k[layer, 0, :, :T])
        for h in range(bulk.shape[0]):
            assert (mean[h].double() - bulk[h].mean(0)).abs().max() < 1e-5
            assert (cov[h].double() - torch.cov(bulk[h].T, correction=0)).abs().max() < 1e-5


def test_online_moments_refuse_a_cache_rolled_back_and_make_moments_its_inputs(tiny, tmp_path):
    """A cache shorter than the keys OnlineMoments absorbed (a caller that rolled it back) is refused, not read as
    moments of keys no longer there; make_moments names an unknown source and Option 2 without its reference;
    random-words-full takes the whole reference prompt's bulk, whatever the prompt's length (Fig. 5g's ablation)."""
    ids = torch.randint(0, 101, (1, 400), generator=torch.Generator().manual_seed(0))
    cache = tiny.new_cache(400)
    tiny.prefill(ids, cache)
    moments = OnlineMoments(cache, N_SINK, N_LOCAL)
    moments.mean_cov(0, cache.k[0, 0, :, :400])
    with pytest.raises(ValueError, match="rolled back"):
        moments.mean_cov(0, cache.k[0, 0, :, :350])
    with pytest.raises(ValueError, match="unknown moments source 'bogus'"):
        make_moments("bogus", cache)
    with pytest.raises(ValueError, match="'random-words' needs the reference prompt's keys"):
        make_moments("random-words", cache, None)
    reference = ReferenceKeys(tiny, WordTokenizer(), n_max=2048, root=tmp_path, progress=False)
    assert make_moments("random-words-full", cache, reference).n_keys == len(reference.ids) - N_SINK == 2048 - N_SINK
    assert make_moments("random-words", cache, reference).n_keys == N_LOCAL - N_SINK  # 400 tokens: the floor


def test_moments_count_their_bulk_keys_and_refuse_a_cache_one_position_shorter():
    # a cache of T positions: prompt_moments' bulk is [n_sink, T - (n_local - n_sink)); OnlineMoments refuses a cache
    # rolled back by a single position (a rejected draft token), not only by many
    T = 300
    cache = SimpleNamespace(k=rand(2, 1, HKV, T, D, seed=6), length=T)
    bulk = bulk_end(T, N_SINK, N_LOCAL) - N_SINK
    assert prompt_moments(cache, N_SINK, N_LOCAL).n_keys == bulk == T - N_LOCAL
    online = OnlineMoments(cache, N_SINK, N_LOCAL)
    online.mean_cov(0, cache.k[0, 0, :, :T])
    with pytest.raises(ValueError, match="rolled back"):
        online.mean_cov(0, cache.k[0, 0, :, :T - 1])


def float64_moments(x):
    """Keys x (Hkv, n, D) -> their mean (Hkv, D) and population covariance (Hkv, D, D), by torch.cov in float64."""
    x = x.double()
    return x.mean(1), torch.stack([torch.cov(h.T, correction=0) for h in x])


@pytest.mark.parametrize("T0", [5, N_LOCAL, N_LOCAL + 1, N_LOCAL + 2, 300])
def test_prompt_and_online_moments_are_row_0s_bulk_from_every_prompt_length(T0):
    """prompt_moments and OnlineMoments read row 0 of the cache, and OnlineMoments, started from a prompt with no bulk,
    a bulk of one or two keys or a long one, equals float64 moments of the bulk recomputed at every length."""
    end = max(T0, N_LOCAL) + 20
    k = rand(2, 2, HKV, end, D, seed=T0)  # (L, B, Hkv, max_len, D): row 1 holds other keys, never to be read
    cache = SimpleNamespace(k=k, length=T0)

    def bulk(layer, T):  # row 0's bulk keys
        return float64_moments(k[layer, 0, :, N_SINK:bulk_end(T, N_SINK, N_LOCAL)])

    fixed = prompt_moments(cache, N_SINK, N_LOCAL)
    assert (fixed is None) == (T0 <= N_LOCAL)
    for layer in range(2 if fixed is not None else 0):
        for got, want in zip(fixed.mean_cov(layer, None), bulk(layer, T0)):
            assert (got.double() - want).abs().max() < 1e-5
    online = OnlineMoments(cache, N_SINK, N_LOCAL)
    for T in range(T0, end + 1):  # one key more per step, as decoding appends them
        for layer in range(2):
            got = online.mean_cov(layer, k[layer, 0, :, :T])
            if T > N_LOCAL:  # before, no bulk: nothing to compare
                for g, want in zip(got, bulk(layer, T)):
                    assert (g.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("source", ["prompt", "prompt-online"])
def test_option_1_moments_take_the_window_they_are_given(source):
    """make_moments hands its n_sink and n_local to Option 1, fixed or online: a window of 4 + 28 leaves the bulk
    [4, T - 28), and the moments are those of its keys (the default window's would be of [16, T - 112))."""
    T = 200
    cache = SimpleNamespace(k=rand(1, 1, HKV, T, D, seed=7), length=T)
    mean, cov = make_moments(source, cache, None, 4, 32).mean_cov(0, cache.k[0, 0])
    want_mean, want_cov = float64_moments(cache.k[0, 0, :, 4:T - 28])
    assert (mean.double() - want_mean).abs().max() < 1e-5
    assert (cov.double() - want_cov).abs().max() < 1e-5


def test_the_random_words_are_the_same_in_every_process():
    # the reference prompt is drawn from a sorted word list: a set's order changes with the string hash seed, so
    # another process (another rank, a later run) would draw other words and compute other moments
    root = Path(__file__).resolve().parent.parent
    code = "from moments import random_words_text; print(random_words_text(30, 0))"
    texts = {subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(texts) == 1 and len(texts.pop().split()) == 30


def test_prompt_moments_stay_those_of_the_prefill(tiny):
    """Option 1 as the paper runs it: the moments QAdA reads after many steps are the prefilled prompt's
    bulk moments (float64 recomputation), not those of the grown context."""
    T0, steps = 200, 60
    ids = torch.randint(0, 101, (1, T0), generator=torch.Generator().manual_seed(2))
    cache = tiny.new_cache(T0 + steps + 1)
    logits = tiny.prefill(ids, cache)
    bulk = cache.k[:, 0, :, N_SINK:T0 - (N_LOCAL - N_SINK)].double()  # (L, Hkv, N, D) at prefill
    attn = DecodeAttention("qada", N_SINK, N_LOCAL,
                           dict(tau=0.6, moments=make_moments("prompt", cache, None, N_SINK, N_LOCAL)))
    for _ in range(steps):
        logits = tiny.decode_step(logits.argmax(-1), cache, attn)
    grown = cache.k[:, 0, :, N_SINK:cache.length - (N_LOCAL - N_SINK)].double()
    for layer in range(tiny.cfg.num_hidden_layers):
        mean, cov = attn.moments.mean_cov(layer, cache.k[layer, 0, :, :cache.length])
        assert (mean.double() - bulk[layer].mean(-2)).abs().max() < 1e-5
        assert (mean.double() - grown[layer].mean(-2)).abs().max() > 1e-3  # the grown bulk differs
        for h in range(bulk.shape[1]):
            assert (cov[h].double() - torch.cov(bulk[layer, h].T, correction=0)).abs().max() < 1e-5


@pytest.mark.parametrize("option", ["prompt", "prompt-online", "random-words"])
@pytest.mark.parametrize("T0", [5, N_LOCAL - 2, N_LOCAL, N_LOCAL + 1])
def test_short_prompts_decode_past_the_window_with_every_moments_option(tiny, tmp_path, option, T0):
    """A prompt no longer than the window (no bulk at prefill) decodes into a context longer than it. At tau
    0.99 a bulk of a few keys beside a 128-key window already makes heads long-context."""
    ids = torch.randint(0, 101, (1, T0), generator=torch.Generator().manual_seed(T0))
    steps = N_LOCAL + 20 - T0
    cache = tiny.new_cache(T0 + steps + 1)
    logits = tiny.prefill(ids, cache)
    reference = ReferenceKeys(tiny, WordTokenizer(), n_max=2048, root=tmp_path, progress=False)
    attn = DecodeAttention("qada", N_SINK, N_LOCAL,
                           dict(tau=0.99, moments=make_moments(option, cache, reference, N_SINK, N_LOCAL)))
    for _ in range(steps):
        logits = tiny.decode_step(logits.argmax(-1), cache, attn)
    labels = attn.stats.label_tensor()  # (S, L, H)
    lengths = torch.tensor(attn.stats.lengths, device="cpu")  # beside the labels, on the CPU
    assert labels[lengths <= N_LOCAL].all()  # no bulk yet: every head exact on its window
    assert not labels[lengths > N_LOCAL + 5].all()  # then the criterion decides (some heads long-context)


def test_decoding_with_tau_one_equals_dense(tiny):
    ids = torch.randint(0, 101, (1, 300), generator=torch.Generator().manual_seed(1))
    outs = {}
    for method in ("dense", "qada"):
        cache = tiny.new_cache(340)
        logits = tiny.prefill(ids, cache)
        attn = (DecodeAttention("qada", inputs=dict(tau=1.0, moments=prompt_moments(cache))) if method == "qada"
                else None)
        seq = []
        for _ in range(30):
            token = logits.argmax(-1)
            seq.append(int(token))
            logits = tiny.decode_step(token, cache, attn)
        outs[method] = seq
    assert outs["qada"] == outs["dense"]


def test_reference_keys_follow_the_exact_rule_and_run_only_as_far_as_needed(tiny, tmp_path):
    """Option 2: the moments for a prompt of T positions are those of the reference prompt's keys at
    [n_sink, T - 1024), equal to a fresh forward pass over just that prefix (the model is causal); the
    reference pass runs only as far as the prompts need, and a longer prompt extends it."""
    tok = WordTokenizer()
    ref = ReferenceKeys(tiny, tok, n_max=4096, root=tmp_path, progress=False)
    T = 1500
    m = ref.for_prompt(T, N_SINK, N_LOCAL)
    assert m.n_keys == T - 1024 - N_SINK and ref.passes == 1 and ref.length == 1024  # 476 rounded up to 1024
    cache = tiny.new_cache(T - 1024)
    tiny.prefill(torch.tensor([ref.ids[:T - 1024]]), cache)  # the prefix alone
    bulk = cache.k[:, 0, :, N_SINK:T - 1024].double()  # (L, Hkv, N, D)
    assert (m.mean.double() - bulk.mean(-2)).abs().max() < 1e-4
    for layer in range(bulk.shape[0]):
        for h in range(bulk.shape[1]):
            assert (m.cov[layer, h].double() - torch.cov(bulk[layer, h].T, correction=0)).abs().max() < 1e-4
    ref.for_prompt(2000, N_SINK, N_LOCAL)  # 976 keys: within what was computed
    ref.ensure(ref.length)  # exactly what was computed
    assert ref.passes == 1
    assert ref.for_prompt(3200, N_SINK, N_LOCAL).n_keys == 3200 - 1024 - N_SINK
    assert ref.passes == 2 and ref.length == 3072
    again = ReferenceKeys(tiny, tok, n_max=4096, root=tmp_path, progress=False)  # from the disk cache
    assert again.length == 3072 and torch.equal(again.for_prompt(1500).mean, m.mean) and again.passes == 0
    other_seed = ReferenceKeys(tiny, tok, seed=1, n_max=4096, root=tmp_path, progress=False)
    assert other_seed.length == 0  # another prompt: never served these keys
    tiny.cfg.rope_theta, saved = 1e6, tiny.cfg.rope_theta
    try:  # a changed RoPE setting changes the keys: never served the old file
        assert ReferenceKeys(tiny, tok, n_max=4096, root=tmp_path, progress=False).length == 0
    finally:
        tiny.cfg.rope_theta = saved


def test_the_reference_pass_says_so_on_stderr(tiny, tmp_path, capsys):
    """With progress on, the reference pass's line goes to stderr, as its progress bar: stdout is the answer's."""
    ReferenceKeys(tiny, WordTokenizer(), n_max=2048, root=tmp_path, progress=True).for_prompt(1500, N_SINK, N_LOCAL)
    out, err = capsys.readouterr()
    assert out == "" and "computing reference keys" in err


def test_one_reference_file_serves_every_context_length(tiny, tmp_path):
    """The reference prompt of a shorter context is a prefix of a longer one's, so the keys a context of 2048
    computed serve a context of 4096 (and one of 1100) from the disk, with no pass; another tokenizer's ids are
    never served them."""
    tok = WordTokenizer()
    short = ReferenceKeys(tiny, tok, n_max=2048, root=tmp_path, progress=False)
    m = short.for_prompt(2000, N_SINK, N_LOCAL)  # 976 keys: a pass of 1024
    assert short.passes == 1 and len(list(tmp_path.iterdir())) == 1
    for n_max in (4096, 1100):
        other = ReferenceKeys(tiny, tok, n_max=n_max, root=tmp_path, progress=False)
        assert other.ids == ReferenceKeys(tiny, tok, n_max=n_max, progress=False).ids  # its own context's prompt
        assert other.length == 1024 and torch.equal(other.for_prompt(2000, N_SINK, N_LOCAL).mean, m.mean)
        assert other.passes == 0
        if sys.platform == "linux":  # the file is mapped, not read whole: a longer context's costs only what is used
            assert str(other.path) in Path("/proc/self/maps").read_text()
    longer = ReferenceKeys(tiny, tok, n_max=4096, root=tmp_path, progress=False)
    longer.for_prompt(3200, N_SINK, N_LOCAL)  # needs 2176 keys: a pass of 3072, which replaces the file
    assert longer.passes == 1 and ReferenceKeys(tiny, tok, n_max=2048, root=tmp_path, progress=False).length == 3072
    with pytest.raises(ValueError, match="has 2048 positions"):
        ReferenceKeys(tiny, tok, n_max=2048, root=tmp_path, progress=False).ensure(2049)
    assert ReferenceKeys(tiny, WordTokenizer(vocab=97), n_max=4096, root=tmp_path, progress=False).length == 0


def test_option_2_moments_follow_the_prompts_length_not_the_caches_room(tiny, tmp_path):
    """make_moments' Option 2 takes the prompt's length (cache.length), not the room a cache is made with for the
    tokens to come (max_len, as generate makes it)."""
    reference = ReferenceKeys(tiny, WordTokenizer(), n_max=4096, root=tmp_path, progress=False)
    cache = SimpleNamespace(length=1500, max_len=3000)  # Option 2 reads none of the prompt's own keys
    assert make_moments("random-words", cache, reference).n_keys == reference_end(1500, N_SINK, N_LOCAL) - N_SINK


def test_each_moments_source_reads_its_own_reference_prompt(tiny):
    """reference_words names the prompt a source reads: random words for random-words(-full), one word repeated for
    one-word, none for the prompt's own keys (prompt, prompt-online)."""
    for source in SOURCES:
        words = reference_words(source)
        assert (words is None) == source.startswith("prompt")
        if words is not None:
            ids = ReferenceKeys(tiny, WordTokenizer(), words, n_max=200, progress=False).ids
            assert (len(set(ids)) == 1) == (source == "one-word")


def test_a_context_not_a_multiple_of_the_round_holds_only_its_own_reference_keys(tiny, tmp_path):
    """A context of 1100 positions rounds its pass up to 2048 but runs it over its 1100 ids only, so it holds 1100
    keys, not positions past the prompt's end; the file it writes serves them again."""
    ref = ReferenceKeys(tiny, WordTokenizer(), n_max=1100, root=tmp_path, progress=False)
    assert ref.ensure(1100).shape[2] == ref.length == len(ref.ids) == 1100
    assert ReferenceKeys(tiny, WordTokenizer(), n_max=1100, root=tmp_path, progress=False).length == 1100


class BosWordTokenizer(WordTokenizer):
    """WordTokenizer with a BOS id first when special tokens are asked for, as a real tokenizer adds one."""

    BOS = 100

    def encode(self, text, add_special_tokens=False):
        return [self.BOS] * add_special_tokens + super().encode(text)


@pytest.mark.parametrize("words", ["random", "the"])
def test_the_reference_prompt_is_encoded_with_its_special_tokens(tiny, words):
    """The reference prompt's ids are its words encoded as a prompt is, BOS first, cut at the context: the random
    words of its seed, or the one word repeated."""
    tok = BosWordTokenizer()
    ref = ReferenceKeys(tiny, tok, words, seed=3, n_max=300, progress=False)
    text = random_words_text(600, 3) if words == "random" else " ".join([words] * 600)
    assert ref.ids == [tok.BOS] + WordTokenizer().encode(text)[:299]


def test_a_reference_file_of_other_settings_or_ids_is_never_served(tiny, tmp_path):
    """A file at a reference's path is served only when its settings and ids are the reference's own: the name is a
    hash of the settings, so one copied or renamed there (another seed's) would otherwise serve other keys."""
    tok = WordTokenizer()
    ref = ReferenceKeys(tiny, tok, n_max=2048, root=tmp_path, progress=False)

    def served(settings, ids):  # plant a file of 1024 positions at ref's path, then read it as a new object would
        torch.save({"settings": settings, "ids": torch.tensor(ids[:1024], dtype=torch.int32),
                    "keys": torch.zeros(2, 2, 1024, 8)}, ref.path)
        return ReferenceKeys(tiny, tok, n_max=2048, root=tmp_path, progress=False).length == 1024

    assert served(ref.settings, ref.ids)  # its own: served (what the other two are held against)
    assert not served({**ref.settings, "seed": 1}, ref.ids)
    assert not served(ref.settings, [(i + 1) % 101 for i in ref.ids])


def test_model_identity_changes_with_the_weights_files_the_config_and_the_dtype(tmp_path):
    """model_identity (a reference file's name) is the same for a copy of a model's folder and differs when a weights
    file's name, size (past the first MiB, which is all it reads) or first bytes differ, or the config, or the dtype."""
    head = bytes(range(256)) * 4096  # 1 MiB: what model_identity reads of each file

    def identity(files, config=b"{}", dtype=torch.bfloat16):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "config.json").write_bytes(config)
        for name, data in files.items():
            (folder / name).write_bytes(data)
        cfg = SimpleNamespace(rope_theta=1e4, rope_scaling=None)
        return model_identity(SimpleNamespace(model_dir=str(folder), cfg=cfg, dtype=dtype))

    base = identity({"model.safetensors": head + b"tail"})
    assert identity({"model.safetensors": head + b"tail"}) == base
    others = [identity({"model.safetensors": head + b"a longer tail"}),
              identity({"model.safetensors": b"x" + head[1:] + b"tail"}),
              identity({"other.safetensors": head + b"tail"}),
              identity({"model.safetensors": head + b"tail"}, config=b'{"hidden_size": 8}'),
              identity({"model.safetensors": head + b"tail"}, dtype=torch.float32)]
    assert all(other != base for other in others)


def test_prompts_of_one_length_share_their_option_2_moments(tiny, tmp_path):
    """ReferenceKeys.for_prompt gives prompts of one length one moments object (a batch then reads one form per
    layer, attention.stacked_forms), another length its own, and keeps only the last SHARED."""
    ref = ReferenceKeys(tiny, WordTokenizer(), n_max=4096, root=tmp_path, progress=False)
    m = ref.for_prompt(1500, N_SINK, N_LOCAL)
    assert ref.for_prompt(1500, N_SINK, N_LOCAL) is m and ref.for_prompt(1501, N_SINK, N_LOCAL) is not m
    other_sinks = ref.for_prompt(1500, 2 * N_SINK, N_LOCAL)  # the same end, fewer keys past the sinks: its own
    assert other_sinks is not m and other_sinks.n_keys == m.n_keys - N_SINK
    for T in range(1502, 1502 + SHARED):
        ref.for_prompt(T, N_SINK, N_LOCAL)
    assert len(ref.shared) == SHARED and ref.for_prompt(1500, N_SINK, N_LOCAL) is not m


@pytest.mark.parametrize("T,end", [(5, N_LOCAL), (N_LOCAL, N_LOCAL), (N_LOCAL + 1, N_LOCAL), (600, N_LOCAL),
                                   (1024 + 200, 200), (1024 + N_LOCAL + 1, N_LOCAL + 1), (8192, 8192 - 1024)])
def test_reference_end(T, end):
    """T - 1024, but at least T_local positions."""
    assert reference_end(T, N_SINK, N_LOCAL) == end


@pytest.mark.parametrize("n_sink,n_local", [(N_SINK, N_LOCAL), (4, 2048)])
def test_reference_end_never_shrinks_and_keeps_below_the_bulk_where_it_can(n_sink, n_local):
    """A longer prompt never takes fewer reference keys, never fewer than the window's n_local - n_sink, and never more
    than its own bulk has once that bulk holds n_local - n_sink (with a window of 2048 the cap binds past T - 1024)."""
    ends = [reference_end(T, n_sink, n_local) for T in range(1, 4 * n_local + 2048)]
    assert all(a <= b for a, b in zip(ends, ends[1:]))
    assert min(ends) == n_local
    for T, end in enumerate(ends, start=1):
        own = bulk_end(T, n_sink, n_local)
        if own >= n_local:
            assert end <= own
        if n_local <= T - 1024 <= own:  # the paper's rule where it applies
            assert end == T - 1024


def test_a_share_exactly_at_tau_is_local():
    """Eq. 2's >=: all scores equal (q = 0), so the window's share is exactly n_local / T = 1/2; at tau = 1/2 every head
    is local, just above it none is."""
    T = 2 * N_LOCAL
    q, k = torch.zeros(H, D), rand(HKV, T, D)
    scores = attention.all_scores(q, k)
    assert oracle_labels(scores, N_SINK, N_LOCAL, 0.5).all()
    assert not oracle_labels(scores, N_SINK, N_LOCAL, 0.5 + 1e-6).any()
