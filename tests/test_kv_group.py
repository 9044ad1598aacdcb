"""QAdA and the oracle decided per KV group (criterion.local_labels with a rule), held against the rules recomputed from
first principles in float64, and their outputs against the fp32 reference."""

import math

import pytest
import torch

from attention import DecodeAttention, kv_read_fraction, reference_attention
from criterion import Calibration, local_labels, static_labels
from moments import FixedMoments
from tests.test_qada import eq7_share, rand

N_SINK, N_LOCAL = 16, 128
HKV, G, D = 3, 4, 16
H = HKV * G


def heads(T, seed=0):
    """Query heads from flat to peaked, keys with a few recent matches, and moments that make the three groups
    differ (a small bulk estimate for group 0, a large one for group 2), so shares straddle many thresholds and
    a group's min and mean shares lie apart."""
    q = rand(H, D, seed=seed) * torch.linspace(0.3, 2.0, H)[:, None]
    k, v = rand(HKV, T, D, seed=seed + 1), rand(HKV, T, D, seed=seed + 2)
    k[:, -4:] += 2 * q.view(HKV, G, D)[:, :1]  # the first head of each group finds keys in its recent window
    a = rand(HKV, D, D, seed=seed + 3) * 0.35
    mean = rand(HKV, D, seed=seed + 4) * torch.tensor([0.1, 0.5, 1.0])[:, None]
    cov = (a @ a.mT + 0.05 * torch.eye(D)) * torch.tensor([0.2, 0.6, 1.0])[:, None, None]
    return q, k, v, mean, cov


def run(method, tau, q, k, v, mean, cov, **inputs):
    T = k.shape[1]
    moments = None if mean is None else FixedMoments(mean[None], cov[None], T - N_LOCAL)
    attn = DecodeAttention(method, N_SINK, N_LOCAL, dict(tau=tau, moments=moments, **inputs))
    y = attn(q[None, :, None], k[None], v[None], 0)[0, :, 0]
    return y, attn.stats.labels[-1][0]


def group_rule(shares, tau, rule):
    """(H,) labels from float64 shares: one decision per group of G consecutive query heads."""
    out = []
    for g in range(HKV):
        s = shares[g * G:(g + 1) * G].tolist()
        local = min(s) >= tau if rule == "all" else sum(s) / len(s) >= tau
        out += [local] * G
    return torch.tensor(out)


@pytest.mark.parametrize("T", [300, 700])
@pytest.mark.parametrize("method,rule", [("qada_kv", "mean"), ("qada_kv_all", "all")])
def test_qada_kv_labels_equal_the_group_rule_written_plainly(T, method, rule):
    """Each group's label is the rule applied to Eq. 7's shares of its query heads, computed from the equation
    alone; the two rules differ on some thresholds, so the test tells them apart."""
    q, k, v, mean, cov = heads(T)
    window = list(range(N_SINK)) + list(range(T - (N_LOCAL - N_SINK), T))
    shares = torch.tensor([eq7_share(q[h], k[h // G, window], mean[h // G], cov[h // G], T - N_LOCAL)
                           for h in range(H)],
                          dtype=torch.float64)
    mixed = differ = 0
    for tau in torch.linspace(0.02, 0.98, 49).tolist():
        _, got = run(method, tau, q, k, v, mean, cov)
        want = group_rule(shares, tau, rule)
        near = group_rule(shares - 1e-5, tau, rule) != group_rule(shares + 1e-5, tau, rule)  # fp32 vs fp64 ties
        assert torch.equal(got[~near], want[~near]), tau
        mixed += 0 < int(want.sum()) < H
        differ += not torch.equal(group_rule(shares, tau, "all"), group_rule(shares, tau, "mean"))
    assert mixed >= 3 and differ >= 6


def test_an_unknown_group_rule_is_refused():
    """A misspelt rule fell through to one of the others, silently."""
    with pytest.raises(ValueError, match="unknown group rule 'any'; choose from"):
        local_labels(torch.zeros(2, 4), torch.zeros(2, 4), 0.6, 2, rule="any")


def test_oracle_kv_labels_equal_mean_true_share():
    """The group oracle: a group is local when its heads' mean true share (every score, float64) reaches tau."""
    T = 500
    q, k, v, _, _ = heads(T, seed=11)
    window = set(range(N_SINK)) | set(range(T - (N_LOCAL - N_SINK), T))
    shares = []
    for h in range(H):
        s = [float(q[h].double() @ k[h // G, i].double()) / math.sqrt(D) for i in range(T)]
        shares.append(sum(math.exp(x) for i, x in enumerate(s) if i in window) / sum(math.exp(x) for x in s))
    shares = torch.tensor(shares, dtype=torch.float64)
    mixed = 0
    for tau in (0.1, 0.3, 0.5, 0.7, 0.9):
        y, got = run("oracle_kv", tau, q, k, v, None, None)
        want = group_rule(shares, tau, "mean")
        assert torch.equal(got, want), tau
        mixed += 0 < int(want.sum()) < H
        assert (y - reference_attention(q, k, v, want, N_SINK, N_LOCAL)).abs().max() < 1e-5
    assert mixed >= 2


@pytest.mark.parametrize("calibrated,plain", [("qada_cal", "qada"), ("qada_kv_cal", "qada_kv"),
                                              ("qada_kv_all_cal", "qada_kv_all"), ("qada_sampled_cal", "qada_sampled"),
                                              ("qada_kv_sampled_cal", "qada_kv_sampled")])
def test_a_calibrated_entry_under_the_identity_correction_is_its_plain_twin(calibrated, plain):
    """a = 0, b = 1 and the variance term as it is leave Eq. 7 (or the sampled estimate) unchanged: each calibrated
    registry entry then labels and reads as the entry it corrects, so it decides with the same group rule. The rules
    differ at these thresholds (per head, mean, all), so a twin with another rule is told apart."""
    T = 700
    q, k, v, mean, cov = heads(T)
    identity = Calibration(torch.zeros(1, H), torch.ones(1, H), None, {})
    differ = 0
    for tau in torch.linspace(0.1, 0.9, 9).tolist():
        y, labels = run(calibrated, tau, q, k, v, mean, cov, calibration=identity)
        y_plain, labels_plain = run(plain, tau, q, k, v, mean, cov)
        assert torch.equal(labels, labels_plain) and torch.equal(y, y_plain), tau
        others = ("qada_sampled", "qada_kv_sampled") if "sampled" in plain else ("qada", "qada_kv", "qada_kv_all")
        differ += len({tuple(run(other, tau, q, k, v, mean, cov)[1].tolist()) for other in others}) == len(others)
    assert differ  # a tau where every rule labels otherwise


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("method", ["qada_kv", "qada_kv_all"])
def test_qada_kv_output_equals_fp32_reference_and_skips_local_groups(method, dtype, tol):
    """The output equals the explicit fp32 computation with the path's own labels, and a group labelled local
    never reads its bulk: NaN written there does not reach the output."""
    T = 700
    q, k, v, mean, cov = heads(T)
    seen = set()
    for tau in (0.1, 0.3, 0.5, 0.7):
        qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
        y, labels = run(method, tau, qd, kd, vd, mean, cov)
        ref = reference_attention(qd, kd, vd, labels, N_SINK, N_LOCAL)
        assert y.dtype == dtype and (y.float() - ref).abs().max() < tol
        group_local = labels.view(HKV, G)[:, 0]
        assert torch.equal(labels.view(HKV, G), group_local[:, None].expand(HKV, G))  # one label per group
        k_nan, v_nan = kd.clone(), vd.clone()
        k_nan[group_local, N_SINK:T - (N_LOCAL - N_SINK)] = math.nan
        v_nan[group_local, N_SINK:T - (N_LOCAL - N_SINK)] = math.nan
        y_nan, labels_nan = run(method, tau, qd, k_nan, v_nan, mean, cov)
        assert torch.equal(labels_nan, labels) and torch.equal(y_nan, y)
        seen.add(int(group_local.sum()))
    assert len(seen) >= 2  # the thresholds give different numbers of local groups


def test_qada_kv_all_reads_what_per_head_qada_reads():
    """The "all" rule reads exactly the KV entries per-query-head labels read, and gives every head of a read group
    its full attention (per-head QAdA keeps the window for that group's local heads)."""
    T = 600
    q, k, v, mean, cov = heads(T)
    full = reference_attention(q, k, v, torch.zeros(H, dtype=torch.bool), N_SINK, N_LOCAL)
    partly = 0
    for tau in torch.linspace(0.1, 0.9, 9).tolist():
        _, per_head = run("qada", tau, q, k, v, mean, cov)
        y, grouped = run("qada_kv_all", tau, q, k, v, mean, cov)
        lengths = torch.tensor([T])
        assert kv_read_fraction(grouped[None, None], lengths, HKV, N_LOCAL) == kv_read_fraction(
            per_head[None, None], lengths, HKV, N_LOCAL)
        read = ~grouped
        assert torch.allclose(y[read], full[read], atol=1e-5)
        partly += bool((per_head & read).any())  # a local head of a read group: the two paths differ there
    assert partly >= 2


@pytest.mark.parametrize("rule", [None, "all", "mean"])
def test_at_tau_1_only_a_group_without_bulk_is_local(rule):
    """tau = 1 asks for the whole mass: whichever rule decides, a group is local only where its bulk is empty, also
    where every share rounds to 1 in fp32 (a bulk e^-20 of the window's mass) and where the bulk's share is past fp32's
    range (e^-120, a share of 0 to "mean"); just below 1 such a group is local. A float tau and a tensor of one tau per
    row decide alike."""
    log_local = torch.tensor([20.0] * G + [3.0] * G + [0.0] * G)  # (H,): three groups
    log_bulk = torch.tensor([0.0] * G + [-math.inf] * G + [0.0] * G)
    at_1, below_1 = [False] * G + [True] * G + [False] * G, [True] * 2 * G + [False] * G
    assert local_labels(log_local, log_bulk, 1.0, HKV, rule).tolist() == at_1
    assert local_labels(log_local, log_bulk, 1 - 1e-7, HKV, rule).tolist() == below_1
    taus = torch.tensor([[1.0], [1 - 1e-7]], dtype=torch.float64)  # (B, 1): a batch's rows
    assert local_labels(log_local.expand(2, H), log_bulk.expand(2, H), taus, HKV, rule).tolist() == [at_1, below_1]
    far, some = torch.full((H,), 120.0), torch.zeros(H)
    assert local_labels(far, some, 1.0, HKV, rule).tolist() == [False] * H
    assert local_labels(far.expand(2, H), some.expand(2, H), taus, HKV, rule).tolist() == [[False] * H, [True] * H]


def test_static_labels_per_kv_head_take_whole_groups_by_mean_frequency():
    freq = torch.tensor([[0.9, 0.1, 0.6, 0.6],    # group means (0.5, 0.6), maxima (0.9, 0.6)
                         [0.2, 0.3, 1.0, 0.8]])   # group means (0.25, 0.9)
    assert static_labels(freq, 0.25, n_kv_heads=2).tolist() == [[False, False, False, False],
                                                                 [False, False, True, True]]
    # by mean: groups (1, 1) and (0, 1); by maximum it would be (1, 1) and (0, 0); per head (1, 2) and (0, 0)
    assert static_labels(freq, 0.5, n_kv_heads=2).tolist() == [[False, False, True, True], [False, False, True, True]]
    assert static_labels(freq, 0.25).tolist() == [[True, False, False, False], [False, False, True, False]]
    assert static_labels(freq, 1.0, n_kv_heads=2).all() and not static_labels(freq, 0.0, n_kv_heads=2).any()
