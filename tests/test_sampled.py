"""The sampled estimate of the bulk mass (qada_sampled, ours): its positions, its estimate against brute force, the
oracle when every bulk key is drawn, the interval's direction, the skipping and the KV read it is charged."""

import math

import pytest
import torch

import attention
from attention import DecodeAttention, bulk_sample, kv_read_fraction, path_inputs, reference_attention
from criterion import oracle_labels, oracle_log_masses, sampled_log_bulk
from tests.test_kernel import no_nan_read

N_SINK, N_LOCAL = 16, 128


def qkv(H=6, Hkv=2, D=16, T=400, seed=0, spread=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(H, D, generator=g) * spread, torch.randn(Hkv, T, D, generator=g),
            torch.randn(Hkv, T, D, generator=g))


@pytest.mark.parametrize("T", [N_LOCAL + 1, N_LOCAL + 40, 1000, 4097])
def test_one_position_per_stratum_of_the_bulk(T):
    lo, hi = N_SINK, T - (N_LOCAL - N_SINK)
    m = 64
    pos = bulk_sample(T, N_SINK, N_LOCAL, m, layer=3)
    if hi - lo <= m:  # a small bulk is read whole
        assert pos.tolist() == list(range(lo, hi))
        return
    assert len(pos) == m and pos.unique().numel() == m
    edges = [lo + j * (hi - lo) // m for j in range(m + 1)]  # strata of floor(n/m) or ceil(n/m) positions
    assert all(edges[j] <= p < edges[j + 1] for j, p in enumerate(pos.tolist()))
    assert torch.equal(pos, bulk_sample(T, N_SINK, N_LOCAL, m, layer=3))  # no random state
    assert not torch.equal(pos, bulk_sample(T, N_SINK, N_LOCAL, m, layer=4))  # layers sample other phases


def test_the_estimate_is_the_mean_exp_of_the_sample_times_t_bulk():
    scores = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)) * 3
    n_bulk = 5000
    want = torch.log(scores.double().exp().mean(-1) * n_bulk)
    torch.testing.assert_close(sampled_log_bulk(scores, n_bulk).double(), want, atol=1e-5, rtol=0)
    e = scores.double().exp()
    upper = torch.log((e.mean(-1) + 2.0 * e.std(-1) / 8) * n_bulk)  # z = 2, sqrt(64) = 8
    torch.testing.assert_close(sampled_log_bulk(scores, n_bulk, z=2.0).double(), upper, atol=1e-5, rtol=0)
    big = scores + 500  # relative to the largest sampled score: no overflow
    torch.testing.assert_close(sampled_log_bulk(big, n_bulk), sampled_log_bulk(scores, n_bulk) + 500)


def test_a_sample_spread_past_fp32s_range_stays_finite():
    # exp relative to the largest sampled score: e^100 overflows fp32, e^-100 only underflows to 0
    scores = torch.tensor([[0.0, 100.0, 40.0]])
    e = scores.double().exp()
    for z, mean in ((0.0, e.mean(-1)), (2.0, e.mean(-1) + 2.0 * e.std(-1) / math.sqrt(3))):
        torch.testing.assert_close(sampled_log_bulk(scores, 1000, z).double(), (mean * 1000).log())


@pytest.mark.parametrize("rule", [None, "mean"])
def test_a_sample_of_the_whole_bulk_is_the_oracle(rule):
    """With at least as many samples as bulk keys every bulk key is read once: the true mass, the oracle's labels."""
    q, k, v = qkv(T=N_LOCAL + 50)
    k[1, 40] = q[3:].mean(0)  # a needle in group 1's bulk: a mix of local and long-context heads
    y, labels = attention.qada_sampled(q, k, v, layer=0, n_sink=N_SINK, n_local=N_LOCAL, tau=0.6, n_samples=64,
                                       rule=rule)
    scores = attention.all_scores(q, k)
    want = oracle_labels(scores, N_SINK, N_LOCAL, 0.6, k.shape[0], rule)
    assert labels.tolist() == want.tolist() and 0 < want.sum() < len(want)  # a mix, not a trivial case
    torch.testing.assert_close(y, reference_attention(q, k, v, labels, N_SINK, N_LOCAL), atol=2e-5, rtol=1e-4)
    log_local, log_bulk = oracle_log_masses(scores, N_SINK, N_LOCAL)
    idx = bulk_sample(k.shape[1], N_SINK, N_LOCAL, 64, 0)
    torch.testing.assert_close(sampled_log_bulk(attention.all_scores(q, k[:, idx]), len(idx)), log_bulk,
                               atol=1e-4, rtol=0)


def test_the_interval_only_makes_heads_long_context():
    q, k, v = qkv(H=16, Hkv=4, T=3000, seed=2)
    kw = dict(layer=1, n_sink=N_SINK, n_local=N_LOCAL, tau=0.05, n_samples=32)  # about half local
    _, plain = attention.qada_sampled(q, k, v, **kw)
    _, careful = attention.qada_sampled(q, k, v, **kw, z=3.0)
    assert (careful <= plain).all() and careful.sum() < plain.sum()
    # a bulk of one key (T = n_local + 1) samples one score: no spread to bound, the plain estimate (its sd was NaN,
    # and every head long-context)
    one = torch.randn(4, 1)
    assert torch.equal(sampled_log_bulk(one, 1, z=2.0), sampled_log_bulk(one, 1))
    assert sampled_log_bulk(one, 1).isfinite().all()


def test_the_upper_entry_decides_on_the_upper_end_of_the_interval():
    # the registry's qada_sampled_upper is the sampled estimate at z = 2, not the plain one under another name
    q, k, v = qkv(H=16, Hkv=4, T=3000, seed=2)
    kw = dict(layer=1, n_sink=N_SINK, n_local=N_LOCAL, tau=0.05)
    _, upper = attention.PATHS["qada_sampled_upper"](q, k, v, **kw)
    _, plain = attention.PATHS["qada_sampled"](q, k, v, **kw)
    _, at_2 = attention.qada_sampled(q, k, v, **kw, n_samples=attention.N_SAMPLES, z=2.0)
    assert torch.equal(upper, at_2) and not torch.equal(upper, plain)


def test_a_local_group_reads_only_its_window_and_the_sampled_keys(monkeypatch):
    """Group 0's bulk is NaN except at the sampled positions (the keys there: values are not read to decide), and its
    queries point away from its keys, so it is local; the output must stay finite and equal the window's."""
    no_nan_read(monkeypatch)
    H, Hkv, D, T = 6, 2, 16, 600
    q, k, v = qkv(H, Hkv, D, T, seed=3)
    k[0] = k[0] * 0.1
    k[0, N_SINK:T - (N_LOCAL - N_SINK)] -= 3 * q[:H // Hkv].mean(0)  # group 0's bulk scores far below its window's
    k[1, 200] = q[H // Hkv:].mean(0) * 2  # group 1: a needle no window holds
    idx = bulk_sample(T, N_SINK, N_LOCAL, 64, 0)
    bulk = torch.zeros(T, dtype=torch.bool)
    bulk[N_SINK:T - (N_LOCAL - N_SINK)] = True
    unsampled = bulk.clone()
    unsampled[idx] = False
    k[0, unsampled], v[0, bulk] = math.nan, math.nan
    att = DecodeAttention("qada_kv_sampled", N_SINK, N_LOCAL, dict(tau=0.6))
    y = att(q[None, :, None], k[None], v[None], 0)[0, :, 0]
    labels = att.stats.labels[0][0]
    G = H // Hkv
    assert labels[:G].all() and not labels[G:].any()
    assert torch.isfinite(y).all()
    clean_k, clean_v = torch.nan_to_num(k), torch.nan_to_num(v)
    torch.testing.assert_close(y, reference_attention(q, clean_k, clean_v, labels, N_SINK, N_LOCAL), atol=2e-5,
                               rtol=1e-4)
    # charged: the window and 64 keys (32 entries of key and value) for the local group, the whole cache for the other
    assert att.stats.summary(Hkv)["kv_read"] == pytest.approx((N_LOCAL + 32 + T) / (2 * T))


def test_registered_with_what_it_reads():
    assert path_inputs("qada_sampled") == ("layer", "n_sink", "n_local", "tau")
    assert attention.decision_read("qada_sampled") == 32 and attention.decision_read("qada_cal") == 0
    labels = torch.ones(1, 1, 4, dtype=torch.bool)  # one step, one layer, 4 heads on 2 KV heads, all local
    assert kv_read_fraction(labels, torch.tensor([1000]), 2, 128, 32.0) == pytest.approx(160 / 1000)
    assert kv_read_fraction(labels, torch.tensor([150]), 2, 128, 32.0) == pytest.approx((128 + 11) / 150)  # 22 keys
    assert path_inputs("qada_sampled_upper") == path_inputs("qada_sampled")  # z is its entry's setting


def test_the_sweep_charges_the_sampled_keys(monkeypatch):
    """lab.sweep's records count what deciding read, as the CLI's report does."""
    from lab import sweep
    stats = attention.HeadStats(N_LOCAL, decision_read=32.0)
    for T in (600, 601):
        stats.record(0, T, torch.tensor([True, True, False, False]))
    rec = sweep.head_stats(stats, 2, N_LOCAL)
    assert rec["kv_read"] == pytest.approx(stats.summary(2)["kv_read"])
    assert rec["kv_read"] == pytest.approx(((N_LOCAL + 32 + 600) + (N_LOCAL + 32 + 601)) / (2 * 600 + 2 * 601))


# ---------------------------------------------------------------------------------------------------------
# qada_sampled_cal: the sampled estimate with its own affine correction (a Calibration of kind "sampled")


def sampled_cal_logit(q, k, layer, a, b, n_samples=64):
    """The calibrated log ratio of the sampled estimate from the equations alone, in float64 (no project function
    but the sample's positions): r = log A_local - log(T_bulk mean_j exp(s_j)) over the sampled bulk keys, then
    a + b r per query head."""
    H, D = q.shape
    Hkv, T, _ = k.shape
    window = list(range(N_SINK)) + list(range(T - (N_LOCAL - N_SINK), T))
    idx = bulk_sample(T, N_SINK, N_LOCAL, n_samples, layer).tolist()
    out = torch.empty(H, dtype=torch.float64)
    for h in range(H):
        kh = k[h // (H // Hkv)].double()
        s = kh @ q[h].double() / math.sqrt(D)  # (T,)
        log_local = math.log(sum(math.exp(s[i]) for i in window))
        log_bulk = math.log((T - N_LOCAL) * sum(math.exp(s[i]) for i in idx) / len(idx))
        out[h] = a[h] + b[h] * (log_local - log_bulk)
    return out


def test_calibrated_sampled_labels_equal_the_equation_in_float64_per_layer():
    """Each layer's own correction, with its sign: the labels of qada_sampled_cal at every layer equal the equation's,
    on a mix of local and long-context heads."""
    from criterion import Calibration
    L, H, Hkv, D, T = 3, 8, 2, 16, 700
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(L, H, generator=g) * 2, torch.rand(L, H, generator=g) * 1.5
    cal = Calibration(a, b, None, {"kind": "sampled", "estimate": "sampled"})
    agree, local = 0, 0
    for layer in range(L):
        for seed in range(6):
            q, k, v = qkv(H, Hkv, D, T, seed=10 * layer + seed, spread=1.0)
            for tau in (0.2, 0.5, 0.8):
                _, got = attention.PATHS["qada_sampled_cal"](q, k, v, layer=layer, n_sink=N_SINK, n_local=N_LOCAL,
                                                             tau=tau, calibration=cal)
                want = sampled_cal_logit(q, k, layer, a[layer].double(), b[layer].double())
                clear = (want - math.log(tau / (1 - tau))).abs() > 1e-4
                assert torch.equal(got[clear], (want >= math.log(tau / (1 - tau)))[clear]), (layer, seed, tau)
                agree, local = agree + int(clear.sum()), local + int(got.sum())
    assert agree > 400 and 0.2 < local / agree < 0.8  # both kinds of label, most heads clear of rounding


def test_the_sampled_fit_recovers_a_known_correction_and_is_kept_apart():
    """lab.calibrate's kind "sampled" is the affine fit of the true log ratio on the sampled estimate's (the masses'
    fifth row); a Gaussian path refuses its file, and a sampled path a Gaussian one."""
    from criterion import Calibration, check_calibration
    from lab import calibrate
    g = torch.Generator().manual_seed(0)
    N, L, H = 300, 2, 4
    n_bulk = torch.randint(500, 8000, (N,), generator=g).double()
    log_local = torch.randn(N, L, H, generator=g) + 8
    sampled = torch.randn(N, L, H, generator=g) + 9  # the sampled estimate of log A_bulk
    a0, b0 = torch.tensor([[0.5, -1.0, 2.0, 0.0], [1.5, 0.3, -0.7, 1.0]]), torch.tensor([[0.9, 0.5, 1.2, 0.1],
                                                                                           [0.8, 1.0, 0.7, 0.3]])
    r = a0 + b0 * (log_local - sampled)
    gauss = torch.randn(N, L, 2, H, generator=g)  # mu_s and sigma_s^2 / 2: no part in this fit
    masses = torch.cat([log_local[:, :, None], (log_local - r)[:, :, None], gauss, sampled[:, :, None]], 2)
    a, b, s = calibrate.fit_calibration(masses, n_bulk, 2, "sampled")
    assert s is None
    torch.testing.assert_close(a, a0.float(), atol=1e-3, rtol=0)
    torch.testing.assert_close(b, b0.float(), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="no sampled estimate"):
        calibrate.fit_calibration(masses[:, :, :4], n_bulk, 2, "sampled")
    c = Calibration(a, b, None, {"estimate": "sampled", "n_sink": N_SINK, "n_local": N_LOCAL})
    check_calibration(c, "s.json", L, H, 2, N_SINK, N_LOCAL, "prompt", attention.bulk_estimate("qada_sampled_cal"))
    with pytest.raises(ValueError, match="corrects the sampled estimate"):
        check_calibration(c, "s.json", L, H, 2, N_SINK, N_LOCAL, None, attention.bulk_estimate("qada_cal"))
    with pytest.raises(ValueError, match="corrects the gaussian estimate"):
        check_calibration(Calibration(a, b, None, {}), "g.json", L, H, 2, N_SINK, N_LOCAL, None,
                          attention.bulk_estimate("qada_kv_sampled_cal"))
    assert attention.decision_read("qada_kv_sampled_cal") == 32
