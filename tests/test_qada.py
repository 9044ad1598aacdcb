"""The QAdA criterion, the attention paths and the key moments, each held against an independent computation."""

import math

import pytest
import torch

import attention
from attention import HeadStats, SparseAttention, kv_read_fraction, mixed_attention, reference_attention
from criterion import (check_tau, gaussian_form, gaussian_log_bulk, load_labels, oracle_log_masses, qada_labels, save_labels,
                       static_labels)
from moments import FixedMoments, PromptMoments, load_or_compute_random_words_moments, mean_cov

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
    closed = gaussian_log_bulk(q, mean, cov, n_bulk=1).view(Hkv, G).double()
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


def test_tau_range():
    for bad in (0.0, -0.1, 1.01, float("nan")):
        with pytest.raises(ValueError, match="tau"):
            check_tau(bad)
    assert check_tau(1.0) == 1.0


def test_qada_labels_follow_the_local_share():
    """A head whose window scores dwarf the Gaussian bulk estimate is local, and the converse."""
    D, T = 8, 1000
    q = torch.zeros(2, D)
    mean, cov = torch.zeros(1, D), torch.zeros(1, D, D)  # bulk scores all 0: A_bulk = T_bulk
    window = torch.stack([torch.full((N_LOCAL,), 10.0), torch.zeros(N_LOCAL)])
    labels = qada_labels(q, window, gaussian_form(mean, cov), T, N_LOCAL, tau=0.6)
    assert labels.tolist() == [True, False]
    # head 1: share = 128 / 1000 exactly, so the threshold sits right there
    assert qada_labels(q, window, gaussian_form(mean, cov), T, N_LOCAL, tau=0.127)[1]
    assert not qada_labels(q, window, gaussian_form(mean, cov), T, N_LOCAL, tau=0.129)[1]


def test_qada_labels_equal_the_share_rule_on_random_heads():
    """The fast form (precomputed A, b; log-mass difference against logit(tau)) gives the labels of Eq. 7
    written plainly: log A_local - log(A_local + T_bulk exp(mu_s + sigma_s^2 / 2)) >= log tau."""
    Hkv, G, D, T = 4, 3, 16, 900
    q = rand(Hkv * G, D, seed=3)
    window = rand(Hkv * G, N_LOCAL, seed=4) * 2
    a = rand(Hkv, D, D, seed=5) * 0.3
    mean, cov = rand(Hkv, D, seed=6) * 0.5, a @ a.mT
    log_local = window.logsumexp(-1)
    log_gauss = gaussian_log_bulk(q, mean, cov, T - N_LOCAL)
    share = log_local - torch.logaddexp(log_local, log_gauss)
    moments = FixedMoments(mean[None], cov[None], T - N_LOCAL)
    for tau in torch.linspace(0.05, 0.95, 19).tolist():
        got = qada_labels(q, window, moments.gaussian(0, None), T, N_LOCAL, tau)
        assert torch.equal(got, share >= math.log(tau)), tau
    assert 0 < int((share >= math.log(0.5)).sum()) < Hkv * G  # the heads straddle the thresholds


# --- attention paths ---------------------------------------------------------------------------------------

H, HKV, D = 6, 2, 32


def random_qkv(T, seed=0, dtype=torch.float32):
    return rand(H, D, seed=seed, dtype=dtype), rand(HKV, T, D, seed=seed + 1, dtype=dtype), rand(HKV, T, D, seed=seed + 2, dtype=dtype)


def make_attention(method, tau=0.6, static_local=None, L=1, T=None):
    moments = FixedMoments(rand(L, HKV, D, seed=9) * 0.1, random_cov(HKV, D, seed=10)[None].repeat(L, 1, 1, 1), 1000)
    if static_local is None:
        static_local = torch.zeros(L, H, dtype=torch.bool)
    return SparseAttention(method, tau, N_SINK, N_LOCAL, moments=moments, static_local=static_local)


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
    save_labels(tmp_path / "labels.json", freq, {"tau": 0.6, "model": "x"})
    labels, settings = load_labels(tmp_path / "labels.json", 0.5)
    assert settings == {"tau": 0.6, "model": "x"} and labels.sum() == 3 and labels[0, 0] and labels[1, 1]
    with pytest.raises(FileNotFoundError):
        load_labels(tmp_path / "missing.json", 0.5)


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


def test_oracle_agreement_counts():
    attn = make_attention("qada", tau=0.5)
    attn.stats.track_oracle = True
    for seed in range(4):
        q, k, v = random_qkv(600, seed=seed)
        k[:, -3:] += 4 * q.view(HKV, 3, D)[:, :1]
        call(attn, q, k, v)
    s = attn.stats.summary(HKV)
    a = s["agreement"]
    assert sum(a.values()) == 4 * H
    assert a["TP"] + a["FP"] == round(s["sparsity"] * 4 * H)
    oracle = attn.stats.oracle_tensor()
    assert a["TP"] + a["FN"] == int(oracle.sum())


# --- moments -------------------------------------------------------------------------------------------------


def test_mean_cov_matches_torch_cov():
    keys = rand(3, 500, 8, seed=0) * 2 + 5
    mean, cov = mean_cov(keys)
    for h in range(3):
        ref = torch.cov(keys[h].double().T, correction=0)
        assert (cov[h].double() - ref).abs().max() < 1e-4
        assert (mean[h].double() - keys[h].double().mean(0)).abs().max() < 1e-5


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
    """Option 1 after many decode steps equals mean/cov recomputed from scratch over the bulk keys."""
    T0, steps = 200, 150
    ids = torch.randint(0, 101, (1, T0), generator=torch.Generator().manual_seed(0))
    cache = tiny.new_cache(T0 + steps + 1)
    logits = tiny.prefill(ids, cache)
    moments = PromptMoments(cache, N_SINK, N_LOCAL)
    attn = SparseAttention("qada", 0.6, N_SINK, N_LOCAL, moments=moments)
    for _ in range(steps):
        logits = tiny.decode_step(logits.argmax(-1), cache, attn)
    T = cache.length
    for layer in range(tiny.cfg.num_hidden_layers):
        bulk = cache.k[layer, 0, :, N_SINK:T - (N_LOCAL - N_SINK)].double()  # (Hkv, N, D)
        assert int(moments.count[layer]) == bulk.shape[1] == T - N_LOCAL
        mean, cov = moments.layer(layer, cache.k[layer, 0, :, :T])
        for h in range(bulk.shape[0]):
            assert (mean[h].double() - bulk[h].mean(0)).abs().max() < 1e-5
            assert (cov[h].double() - torch.cov(bulk[h].T, correction=0)).abs().max() < 1e-5


def test_decoding_with_tau_one_equals_dense(tiny):
    ids = torch.randint(0, 101, (1, 300), generator=torch.Generator().manual_seed(1))
    outs = {}
    for method in ("dense", "qada"):
        cache = tiny.new_cache(340)
        logits = tiny.prefill(ids, cache)
        attn = None if method == "dense" else SparseAttention("qada", 1.0, moments=PromptMoments(cache))
        seq = []
        for _ in range(30):
            token = logits.argmax(-1)
            seq.append(int(token))
            logits = tiny.decode_step(token, cache, attn)
        outs[method] = seq
    assert outs["qada"] == outs["dense"]


def test_random_words_moments_cache(tiny, tmp_path):
    tok = WordTokenizer()
    kwargs = dict(cache_root=tmp_path, progress=False, n_tokens=400, seed=0)
    first = load_or_compute_random_words_moments(tiny, tok, **kwargs)
    files = list(tmp_path.glob("*.pt"))
    assert len(files) == 1
    again = load_or_compute_random_words_moments(tiny, tok, **kwargs)
    assert torch.equal(first.mean, again.mean) and torch.equal(first.cov, again.cov)
    assert first.ends[-1] == 400 and len(first.ends) == 32
    # the moments at a checkpoint are those of the first keys of one forward pass
    other_seed = load_or_compute_random_words_moments(tiny, tok, **dict(kwargs, seed=1))
    assert len(list(tmp_path.glob("*.pt"))) == 2 and not torch.equal(first.mean, other_seed.mean)
    tiny.cfg.rope_theta, saved = 1e6, tiny.cfg.rope_theta
    try:  # a changed RoPE setting changes the keys: never served the old file
        other_theta = load_or_compute_random_words_moments(tiny, tok, **kwargs)
    finally:
        tiny.cfg.rope_theta = saved
    assert len(list(tmp_path.glob("*.pt"))) == 3 and other_theta.settings != first.settings
    # T - 1024 rule, and short prompts fall back to the shortest checkpoint
    assert first.for_prompt(100).n_keys == first.ends[0] - 16
    assert first.for_prompt(1024 + 300).n_keys == max(e for e in first.ends if e <= 300) - 16
