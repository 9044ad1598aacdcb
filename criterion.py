"""The labelling rules: which heads may attend to the local window only, for the current query.

A head is *local* when the share of its attention mass on the local window I (the first `n_sink` tokens
plus the most recent `n_local - n_sink`) reaches tau:

    oracle (paper Eq. 2):  A_local / (A_local + A_bulk)                                    >= tau
    QAdA   (paper Eq. 7):  A_local / (A_local + T_bulk * exp(mu_s + sigma_s^2 / 2))        >= tau

with A_local = sum_{i in I} exp(s_i), A_bulk = sum_{i not in I} exp(s_i), scores s = q K^T / sqrt(d),
mu_s = q mu_K / sqrt(d) and sigma_s^2 = q Sigma_K q^T / d (Eq. 6: the mean of exp(s) when keys are
Gaussian with mean mu_K and covariance Sigma_K). Everything is compared in log space, in fp32.
The static rule (paper appendix A) labels a fixed set of (layer, head) pairs from oracle statistics.

Per KV group (ours, beyond the paper): under grouped-query attention a KV head's cache is read whenever any
of its G query heads is long-context, so `group_labels` decides once per KV head from the G shares, and every
query head of the group follows (all local, or all reading the whole cache).

Labels are data: boolean tensors, True = local.
"""

import json
import math
import os
from pathlib import Path

import torch


def check_tau(tau: float) -> float:
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"tau must lie in (0, 1], got {tau}")
    return tau


def window_slices(T: int, n_sink: int, n_local: int) -> list[slice]:
    """The local window of a context of T positions as slices: the first n_sink and the last n_local - n_sink.

    When T <= n_local the window is the whole context (there is no bulk)."""
    if T <= n_local:
        return [slice(0, T)]
    return [s for s in (slice(0, n_sink), slice(T - (n_local - n_sink), T)) if s.stop > s.start]


def window_mask(T: int, n_sink: int, n_local: int, device=None) -> torch.Tensor:
    """(T,) bool, True on the local window."""
    pos = torch.arange(T, device=device)
    return (pos < n_sink) | (pos >= T - (n_local - n_sink))


def local_logit(tau: float) -> float:
    """log(tau / (1 - tau)): the share A_local / (A_local + A_bulk) reaches tau exactly when
    log A_local - log A_bulk reaches this (one subtraction and one comparison per head; inf at tau = 1)."""
    return math.inf if tau == 1.0 else math.log(tau / (1.0 - tau))


def share_rule(log_local: torch.Tensor, log_bulk: torch.Tensor, tau: float) -> torch.Tensor:
    """The labelling rule shared by oracle and QAdA, from the two log masses: (H,) bool.
    With no bulk (log_bulk = -inf) every head is local, even at tau = 1."""
    return (log_local - log_bulk) >= local_logit(tau)


GROUP_RULES = ("all", "mean")


def group_labels(log_local: torch.Tensor, log_bulk: torch.Tensor, tau: float, n_kv_heads: int, rule: str
                 ) -> torch.Tensor:
    """One decision per KV head for its G query heads, from their log masses (H,): (H,) bool, constant per group.

    With share_h = A_local,h / (A_local,h + A_bulk,h), a group is local when
        rule "all":   min_h share_h >= tau      every query head would be local on its own (share_rule)
        rule "mean":  mean_h share_h >= tau     (1 / G) sum_h share_h >= tau
    "all" reads exactly the KV entries that per-query-head labels read (a KV head is read unless all its query heads
    are local) but then gives every head of a read group its full attention, at no extra read. "mean" bounds the
    group's average error: head h's window-only output differs from its full output by
    y_full - y_window = (1 - share_h) (y_bulk - y_window), so the group's mean error is at most
    (1 - mean share) * max_h |y_bulk,h - y_window,h| <= (1 - tau) * that; one head far below tau can be carried
    by the others, which is what lets a group skip its cache more often than "all"."""
    H = log_local.shape[0]
    if rule == "all":
        group_local = share_rule(log_local, log_bulk, tau).view(n_kv_heads, -1).all(-1)  # (Hkv,)
    elif rule == "mean":
        share = torch.sigmoid(log_local - log_bulk)  # 1 when there is no bulk (log_bulk = -inf)
        group_local = share.view(n_kv_heads, -1).mean(-1) >= tau  # (Hkv,)
    else:
        raise ValueError(f"unknown group rule {rule!r}; choose from {', '.join(GROUP_RULES)}")
    return group_local.repeat_interleave(H // n_kv_heads)


def oracle_log_masses(scores: torch.Tensor, n_sink: int, n_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log A_local and log A_bulk (H,) from every score (H, T); bulk is -inf when T <= n_local."""
    scores = scores.float()
    in_window = window_mask(scores.shape[-1], n_sink, n_local, scores.device)
    log_local = scores.masked_fill(~in_window, -math.inf).logsumexp(-1)
    log_bulk = scores.masked_fill(in_window, -math.inf).logsumexp(-1)
    return log_local, log_bulk


def oracle_labels(scores: torch.Tensor, n_sink: int, n_local: int, tau: float) -> torch.Tensor:
    """Eq. 2 from every score (H, T): (H,) bool."""
    return share_rule(*oracle_log_masses(scores, n_sink, n_local), tau)


def gaussian_form(mean: torch.Tensor, cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 6 as a quadratic form in the query, mu_s + sigma_s^2 / 2 = q A q^T + q b, with A = cov / 2d and
    b = mean / sqrt(d), in fp32: (A (..., D, D), b (..., D)). Fixed moments compute it once, not per step."""
    D = mean.shape[-1]
    return cov.float() / (2 * D), mean.float() / math.sqrt(D)


def gaussian_exponent(q: torch.Tensor, form: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """mu_s + sigma_s^2 / 2 = q A q^T + q b for the query q (H, D), with the bulk keys' `gaussian_form` (A, b) per KV
    head, shared by its G = H / Hkv query heads: (H,) in fp32."""
    A, b = form
    H, D = q.shape
    qg = q.float().view(A.shape[0], -1, D)  # (Hkv, G, D)
    return (torch.baddbmm(b[:, None, :], qg, A) * qg).sum(-1).view(H)  # (q A + b) . q


def gaussian_log_mass(q: torch.Tensor, form: tuple[torch.Tensor, torch.Tensor], n_bulk: int) -> torch.Tensor:
    """Eqs. 5-6: the estimated log A_bulk = log(n_bulk * E[exp(s)]) = log n_bulk + mu_s + sigma_s^2 / 2, (H,)."""
    return gaussian_exponent(q, form) + math.log(n_bulk)


def gaussian_log_bulk(q: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor, n_bulk: int) -> torch.Tensor:
    """log(T_bulk * E[exp(q k / sqrt(d))]) for k ~ N(mean, cov), Eqs. 5-6; (H,).

    q (H, D); mean (Hkv, D) and cov (Hkv, D, D) per KV head, shared by its G = H / Hkv query heads."""
    return gaussian_log_mass(q, gaussian_form(mean, cov), n_bulk)


def qada_labels(q: torch.Tensor, log_local: torch.Tensor, form: tuple[torch.Tensor, torch.Tensor],
                T: int, n_local: int, tau: float) -> torch.Tensor:
    """Eq. 7 from the query (H, D), the log of its window mass (H,) and the bulk keys' `gaussian_form`: (H,) bool.

    share_rule with the estimated log A_bulk = log T_bulk + mu_s + sigma_s^2 / 2, the constant log T_bulk moved to
    the threshold's side: the same comparison, one op fewer per layer on the decoding path.
    A context no longer than the window has no bulk: every head is exact on its window, so local."""
    if T <= n_local:
        return torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    return (log_local - gaussian_exponent(q, form)) >= local_logit(tau) + math.log(T - n_local)


# ---------------------------------------------------------------------------------------------------------
# Static labels (paper appendix A): the alpha fraction of (layer, head) pairs most often labelled local by
# the oracle on calibration prompts are local for every query.


def static_labels(local_freq: torch.Tensor, sparsity: float, n_kv_heads: int | None = None) -> torch.Tensor:
    """(L, H) bool: the round(sparsity * L * H) pairs with the highest local frequency (L, H).

    With n_kv_heads, whole KV groups instead (DuoAttention's granularity, so that head sparsity is read
    bandwidth): the round(sparsity * L * Hkv) KV heads whose query heads have the highest mean local frequency."""
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"static sparsity must lie in [0, 1], got {sparsity}")
    L, H = local_freq.shape
    if n_kv_heads is not None:
        group_freq = local_freq.float().view(L, n_kv_heads, H // n_kv_heads).mean(-1)  # (L, Hkv)
        return static_labels(group_freq, sparsity).repeat_interleave(H // n_kv_heads, dim=1)
    n = round(sparsity * local_freq.numel())
    labels = torch.zeros(local_freq.numel(), dtype=torch.bool)
    # A stable sort on a fixed order makes ties reproducible.
    order = torch.sort(local_freq.flatten().float().cpu(), descending=True, stable=True).indices
    labels[order[:n]] = True
    return labels.view(local_freq.shape)


def save_labels(path: str | Path, local_freq: torch.Tensor, settings: dict) -> None:
    """Save oracle local frequencies (L, H) with the settings that produced them, as JSON. Written to a temporary
    file and renamed, so that a reader (another rank of a torchrun sweep) never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({"settings": settings, "local_freq": local_freq.tolist()}, indent=1))
    os.replace(tmp, path)


def load_labels(path: str | Path, sparsity: float) -> tuple[torch.Tensor, dict]:
    """Static labels (L, H) at `sparsity` from a file written by save_labels, and its settings."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"static labels file {path} not found (make one with calibrate.py)")
    try:
        data = json.loads(path.read_text())
        local_freq = torch.tensor(data["local_freq"], dtype=torch.float32)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a static labels file: {e}") from None
    return static_labels(local_freq, sparsity), data["settings"]
