"""The labelling rules: which heads may attend to the local window only, for the current query.

A head is *local* when the share of its attention mass on the local window I reaches tau. The window is the
first `n_sink` tokens plus the most recent `n_local - n_sink`: `n_local` is the paper's T_local (128), sinks included.

    oracle (paper Eq. 2):  A_local / (A_local + A_bulk)                                    >= tau
    QAdA   (paper Eq. 7):  A_local / (A_local + T_bulk * exp(mu_s + sigma_s^2 / 2))        >= tau

with A_local = sum_{i in I} exp(s_i), A_bulk = sum_{i not in I} exp(s_i), scores s = q K^T / sqrt(d),
mu_s = q mu_K / sqrt(d) and sigma_s^2 = q Sigma_K q^T / d (Eq. 6: the mean of exp(s) when keys are
Gaussian with mean mu_K and covariance Sigma_K). Everything is compared in log space, in fp32.
The static rule (paper appendix A) labels a fixed set of (layer, head) pairs from oracle statistics.

Per KV group (ours, beyond the paper): under grouped-query attention a KV head's cache is read whenever any
of its G query heads is long-context, so `local_labels` can decide once per KV head from the G shares (a `rule`),
and every query head of the group follows (all local, or all reading the whole cache).

Both rules meet in `local_labels`; Eq. 7 is `qada_labels`, written once and called by every path that decides.

Labels are data: boolean tensors, True = local.
"""

import json
import math
import numbers
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from model import read_json_object

TAU = 0.6  # the paper's threshold: its default for QAdA and the oracle, and appendix A's for static labels


def check_tau(tau: float) -> float:
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real):  # "0.5" from a caller in Python, say
        raise ValueError(f"tau must be a number in (0, 1], got {tau!r}")
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"tau must lie in (0, 1], got {tau}")
    return tau


def check_window(n_sink: int, n_local: int, names: tuple[str, str] = ("n_sink", "n_local")) -> None:
    """The window's sizes, as every caller takes them (`names`: how the caller spells them, --n-sink on a command
    line): integers, the sinks fewer than the window's tokens."""
    if not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in (n_sink, n_local)) \
            or not 0 <= n_sink < n_local:
        raise ValueError(f"need integers 0 <= {names[0]} < {names[1]}, got {n_sink!r} and {n_local!r}")


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


def bulk_cap(tau):
    """1 - tau, of a float or a tensor of taus: the most of a group's mass its bulk may hold, on average over the
    group's heads, for the "mean" rule to label the group local. Computed in float64, so that both paths compare
    with the same fp32 number (the kernel's is kernel_thresholds')."""
    if isinstance(tau, torch.Tensor):
        return (1 - tau.double()).float()
    return 1.0 - tau


def tau_logit(tau):
    """log(tau / (1 - tau)), of a float or a tensor of taus: the share A_local / (A_local + A_bulk) reaches tau exactly
    when log A_local - log A_bulk reaches this (inf at tau = 1)."""
    if isinstance(tau, torch.Tensor):  # computed in float64 as for a float, so both give the same fp32 threshold
        return tau.double().div(1 - tau.double()).log().float()
    return math.inf if tau == 1.0 else math.log(tau / (1.0 - tau))


GROUP_RULES = ("all", "mean")


def local_labels(log_local: torch.Tensor, log_bulk: torch.Tensor, tau, n_kv_heads: int | None = None,
                 rule: str | None = None) -> torch.Tensor:
    """The one labelling rule of oracle and QAdA, from the two log masses (..., H): (..., H) bool, True = local.

    rule None: per query head, share_h = A_local,h / (A_local,h + A_bulk,h) >= tau, compared in log space.
    With no bulk (log_bulk = -inf) every head is local, even at tau = 1. `tau` is a float, or a tensor that
    broadcasts against (..., H) per head and (..., Hkv) per group (one tau per row of a batch: (B, 1)).

    Per KV group (ours): one decision for the G = H / Hkv query heads of a KV head, which every head then follows:
        rule "all":   min_h share_h >= tau      every query head would be local on its own
        rule "mean":  mean_h share_h >= tau     (1 / G) sum_h share_h >= tau, compared as (1 / G) sum_h (1 - share_h)
                                                <= 1 - tau, which stays exact where the shares near 1
    "all" reads exactly the KV entries that per-query-head labels read (a KV head is read unless all its query heads
    are local) but then gives every head of a read group its full attention, at no extra read. "mean" bounds the
    group's average error: head h's window-only output differs from its full output by
    y_full - y_window = (1 - share_h) (y_bulk - y_window), so the group's mean error is at most
    (1 - mean share) * max_h |y_bulk,h - y_window,h| <= (1 - tau) * that; one head far below tau can be carried
    by the others, which is what lets a group skip its cache more often than "all"."""
    if rule is None:
        return (log_local - log_bulk) >= tau_logit(tau)
    if rule not in GROUP_RULES:
        raise ValueError(f"unknown group rule {rule!r}; choose from {', '.join(GROUP_RULES)}")
    *lead, H = log_local.shape
    every_head = local_labels(log_local, log_bulk, tau).view(*lead, n_kv_heads, -1).all(-1)  # (..., Hkv)
    if rule == "all":
        group_local = every_head
    else:
        # mean share >= tau as mean bulk share <= 1 - tau: a share near 1 rounds to 1 in fp32 (from r = 16.6 on),
        # a bulk share near 0 does not until fp32 runs out (r ~ 103). Past that it is 0 and meets a cap of 0, so at
        # tau = 1 the rule is what it means there, every share 1: every head local on its own, as with "all"
        bulk_share = torch.sigmoid(log_bulk - log_local)  # 0 when there is no bulk (log_bulk = -inf)
        cap = bulk_cap(tau)
        group_local = (bulk_share.view(*lead, n_kv_heads, -1).mean(-1) <= cap) & ((cap > 0) | every_head)
    return group_local.repeat_interleave(H // n_kv_heads, dim=-1)


def oracle_log_masses(scores: torch.Tensor, n_sink: int, n_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log A_local and log A_bulk (H,) from every score (H, T); bulk is -inf when T <= n_local."""
    scores = scores.float()
    in_window = window_mask(scores.shape[-1], n_sink, n_local, scores.device)
    log_local = scores.masked_fill(~in_window, -math.inf).logsumexp(-1)
    log_bulk = scores.masked_fill(in_window, -math.inf).logsumexp(-1)
    return log_local, log_bulk


def oracle_labels(scores: torch.Tensor, n_sink: int, n_local: int, tau: float, n_kv_heads: int | None = None,
                  rule: str | None = None) -> torch.Tensor:
    """Eq. 2 from every score (H, T): (H,) bool; per KV group with a `rule` (local_labels)."""
    return local_labels(*oracle_log_masses(scores, n_sink, n_local), tau, n_kv_heads, rule)


def gaussian_form(mean: torch.Tensor, cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 6 as a quadratic form in the query, mu_s + sigma_s^2 / 2 = q A q^T + q b, with A = cov / 2d and
    b = mean / sqrt(d), in fp32: (A (..., D, D), b (..., D)). Fixed moments compute it once, not per step."""
    D = mean.shape[-1]
    return cov.float() / (2 * D), mean.float() / math.sqrt(D)


def gaussian_log_bulk(q: torch.Tensor, form: tuple[torch.Tensor, torch.Tensor], n_bulk) -> torch.Tensor:
    """Eqs. 5-7's Gaussian estimate of the bulk's log mass, the one place it is computed:
        log A_bulk ~= log(T_bulk E[exp(s)]) = log T_bulk + mu_s + sigma_s^2 / 2 = log T_bulk + q A q^T + q b
    for queries q (..., H, D) and the bulk keys' `gaussian_form` per KV head, A (..., Hkv, D, D) and b (..., Hkv, D),
    each shared by its G = H / Hkv query heads: (..., H) in fp32. `n_bulk` is T_bulk, an int or a tensor that
    broadcasts against (..., H) (one per row of a batch: (B, 1))."""
    A, b = form
    *lead, H, D = q.shape
    qg = q.float().reshape(-1, H // A.shape[-3], D)  # (N Hkv, G, D)
    qA_b = torch.baddbmm(b.reshape(-1, 1, D), qg, A.reshape(-1, D, D))  # (N Hkv, G, D): q A + b
    log_n = n_bulk.double().log().float() if isinstance(n_bulk, torch.Tensor) else math.log(n_bulk)
    return (qA_b * qg).sum(-1).view(*lead, H) + log_n


def sampled_log_bulk(scores: torch.Tensor, n_bulk, z: float = 0.0) -> torch.Tensor:
    """Beyond the Gaussian (ours): log A_bulk estimated from the scores (..., H, m) of m bulk keys, one taken from each
    of m (nearly) equal strata of the bulk, as log T_bulk + log mean_j exp(s_j): (..., H). A stratified, quasi-random
    estimate that assumes nothing of the keys' distribution; what it misses is a rare key far above the rest (a needle
    no stratum drew). With z > 0, the upper end of a normal interval on that mean, mean + z sd / sqrt(m) (sd the
    sample's), so that a head whose sample is uncertain is labelled long-context."""
    scores = scores.float()
    m = scores.shape[-1]
    top = scores.amax(-1, keepdim=True)  # exp relative to the largest sampled score: no overflow
    e = (scores - top).exp()
    mean = e.mean(-1)
    if z > 0 and m > 1:
        mean = mean + z * e.std(-1) / math.sqrt(m)
    log_n = n_bulk.double().log().float() if isinstance(n_bulk, torch.Tensor) else math.log(n_bulk)
    return mean.log() + top.squeeze(-1) + log_n


class Correction(NamedTuple):
    """One layer's correction of Eq. 7 (ours: Calibration.layer): the variance term sigma_s^2 / 2 scaled by s per KV
    head, then the estimated log ratio r = log A_local - log A_bulk mapped to a + b r per query head."""
    a: torch.Tensor  # (H,)
    b: torch.Tensor  # (H,)
    s: torch.Tensor | None  # (Hkv,), or None: the variance term as it is


def qada_labels(q: torch.Tensor, log_local: torch.Tensor, form: tuple[torch.Tensor, torch.Tensor], n_bulk, tau,
                rule: str | None = None, correction: Correction | None = None) -> torch.Tensor:
    """Eq. 7, the only place it is written: local_labels with the window's true log mass log_local (..., H) and the
    Gaussian estimate of the bulk's from the query q (..., H, D) and the bulk keys' `gaussian_form`: (..., H) bool.
    Per query head (rule None, the paper's) or per KV group (rule "all" or "mean", ours). decode_kernels.fused_qada
    computes the same in one Triton kernel, held to this by tests/test_kernel.py. `correction` (ours): calibrated
    QAdA's, fitted on calibration prompts where the true r is known."""
    if correction is not None and correction.s is not None:
        form = (form[0] * correction.s[..., None, None], form[1])  # A = Sigma_K / 2d scaled per KV head
    log_bulk = gaussian_log_bulk(q, form, n_bulk)
    if correction is not None:
        log_bulk = corrected_log_bulk(log_local, log_bulk, correction)
    return local_labels(log_local, log_bulk, tau, form[0].shape[-3], rule)


def corrected_log_bulk(log_local: torch.Tensor, log_bulk: torch.Tensor, correction: Correction) -> torch.Tensor:
    """The calibrated estimate (ours): the estimated log ratio r = log A_local - log A_bulk (..., H) mapped to a + b r
    by one layer's correction, returned as the log bulk mass that gives that ratio (its s is qada_labels' to apply)."""
    return log_local - (correction.a + correction.b * (log_local - log_bulk))


# ---------------------------------------------------------------------------------------------------------
# Calibrated QAdA (ours): on this project's research model the Gaussian estimate is biased per (layer, head)
# (too low in the late layers, far too high in layer 0), and the window and bulk masses differ only ~7x, so the
# bias flips labels. A correction fitted where the true masses are known (lab.calibrate) removes it.

CALIBRATION_KINDS = ("offset", "scale", "affine", "quantile", "sampled")


@dataclass
class Calibration:
    """A correction of Eq. 7 per layer and head: the variance term of Eq. 6 scaled by s per KV head, then the log
    ratio r mapped to a + b r per query head (qada_labels). Each kind fits some of these and leaves the others:
        offset     a = the median of r - r_est, b = 1        the estimate's bias
        scale      s by least squares on log A_bulk          the variance term alone (a = 0, b = 1)
        affine     a, b by least squares of r on r_est       contains static heads (b = 0) and QAdA (a = 0, b = 1)
        quantile   a = the eps-quantile of r - r_est, b = 1  at most a fraction eps of a head's calibration steps
                                                             has a true ratio below the corrected one
        sampled    affine, of qada_sampled's estimate       the estimate from sampled keys instead (its settings'
                                                             "estimate" is "sampled"; the others' "gaussian")"""
    a: torch.Tensor  # (L, H)
    b: torch.Tensor  # (L, H)
    s: torch.Tensor | None  # (L, Hkv), or None: the variance term as it is
    settings: dict  # how it was fitted: kind, model, dtype, moments source, window, prompts; its operating points

    def operating_tau(self, method: str) -> float | None:
        """The tau at which the path `method` (an attention.PATHS name) was lossless with this correction on its
        evaluation, stored in settings["operating_tau"] beside the evidence ("operating_evidence"); None if the file
        states none for it. The CLIs run a calibrated path there unless --tau is given."""
        return self.settings.get("operating_tau", {}).get(method)

    def to(self, device) -> "Calibration":
        return Calibration(self.a.to(device), self.b.to(device), None if self.s is None else self.s.to(device),
                           self.settings)

    def layer(self, layer: int) -> Correction:
        return Correction(self.a[layer], self.b[layer], None if self.s is None else self.s[layer])

    @property
    def estimate(self) -> str:
        """The estimate it corrects: "gaussian" (Eq. 6) or "sampled" (qada_sampled's); files before the sampled
        estimate existed corrected the Gaussian."""
        return self.settings.get("estimate", "gaussian")


def save_calibration(path: str | Path, calibration: Calibration) -> None:
    """A Calibration as JSON, written to a temporary file and renamed."""
    path = Path(path)
    c = calibration
    data = {"settings": c.settings, "a": c.a.tolist(), "b": c.b.tolist(), "s": None if c.s is None else c.s.tolist()}
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def load_calibration(path: str | Path, device=None) -> Calibration:
    """A Calibration from a file of save_calibration, its tensors on `device`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration file {path} not found (make one with python -m lab.calibrate --qada)")
    data = read_json_object(path, "a calibration file")
    if "local_freq" in data:
        raise ValueError(f"{path} holds static labels (python -m lab.calibrate), not a QAdA correction (python -m "
                         "lab.calibrate --qada)")
    try:
        a, b = (torch.tensor(data[k], dtype=torch.float32, device=device) for k in ("a", "b"))
        s = None if data["s"] is None else torch.tensor(data["s"], dtype=torch.float32, device=device)
        settings = dict(data["settings"])
    except KeyError as e:
        raise ValueError(f"{path} is not a calibration file: it has no {e} entry") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a calibration file: {e}") from None
    if a.dim() != 2 or a.shape != b.shape or (s is not None and (s.dim() != 2 or s.shape[0] != a.shape[0])):
        raise ValueError(f"{path} is not a calibration file: a, b (L, H) and s (L, Hkv) do not match")
    if not all(bool(x.isfinite().all()) for x in (a, b) + (() if s is None else (s,))):
        # a NaN correction would label every head long-context (NaN >= threshold is False): nothing saved, silently
        raise ValueError(f"{path} holds values that are not finite numbers (NaN or inf); refit it with "
                         "python -m lab.calibrate --qada")
    taus = settings.get("operating_tau", {})
    if not isinstance(taus, dict) or not all(isinstance(t, (int, float)) and 0 < t <= 1 for t in taus.values()):
        raise ValueError(f"{path}: its operating_tau must map method names to taus in (0, 1]")
    return Calibration(a, b, s, settings)


def check_settings_window(settings: dict, name, n_sink: int | None, n_local: int | None, made: str) -> None:
    """That a file `name` saved with `settings` (a correction, static labels) was made with the window it is used with;
    ValueError with one line, "{name} {made} n_local 128, not 64", otherwise. What is None, or absent from the
    settings, is not checked."""
    for key, value in (("n_sink", n_sink), ("n_local", n_local)):
        if value is not None and settings.get(key, value) != value:
            raise ValueError(f"{name} {made} {key} {settings[key]}, not {value}")


def weights_probe(model: torch.nn.Module) -> list[float]:
    """Eight weights of the first layer's k_proj and eight of the last's, spread over each matrix: enough to tell two
    checkpoints of one shape apart (a correction or static labels hold for the weights they were fitted on, stored as
    settings["weights_probe"]). Hugging Face's parameter names, which model.Llama mirrors, so the same checkpoint run
    by transformers gives the same probe."""
    k_proj = {int(m[1]): p for n, p in model.named_parameters()
              if (m := re.search(r"layers\.(\d+)\.self_attn\.k_proj\.weight$", n))}
    if not k_proj:
        raise ValueError(f"{type(model).__name__} has no layers.N.self_attn.k_proj weights to tell its checkpoint by")
    probe = []
    for w in (k_proj[min(k_proj)], k_proj[max(k_proj)]):
        if w.is_meta:  # offloaded by accelerate's device_map: the values live in its hooks (the adapter brings them in)
            raise ValueError("the k_proj weights a weights_probe reads are on the meta device (offloaded), with no "
                             "values to tell the checkpoint by")
        flat = w.detach().flatten()
        picks = torch.linspace(0, flat.numel() - 1, 8, device=flat.device).long()
        probe += [float(f"{x:.6g}") for x in flat[picks].float().tolist()]  # once per file or run, not per step
    return probe


def check_weights(settings: dict, name, probe: list[float], made: str) -> None:
    """That a file `name` saved with `settings` was fitted on the weights whose weights_probe is `probe`; ValueError
    with one line otherwise, "{name} {made} other weights than this model's ...". Equal within 1 % per weight, so
    that the same checkpoint loaded in another dtype (bf16 rounds by up to 0.4 %) passes and a quantized copy does
    not. A file saved without a probe is not checked."""
    fitted = settings.get("weights_probe")
    if fitted is None:
        return
    if not isinstance(fitted, list) or not all(isinstance(x, (int, float)) for x in fitted):
        raise ValueError(f"{name}: its weights_probe must be a list of numbers (criterion.weights_probe)")
    if len(fitted) != len(probe) or any(abs(a - b) > 0.01 * max(abs(a), abs(b)) + 1e-6 for a, b in zip(fitted, probe)):
        model = Path(str(settings.get("model", "another model"))).name
        command = "python -m lab.calibrate" + (" --qada" if "kind" in settings else "")  # a correction has a kind
        raise ValueError(f"{name} {made} other weights than this model's (those of {model}); fit one for this model "
                         f"with {command}")


def check_calibration(c: Calibration, name, L: int | None, H: int | None, Hkv: int | None, n_sink: int | None,
                      n_local: int | None, moments_source: str | None = None, estimate: str | None = None,
                      probe: list[float] | None = None) -> None:
    """That the correction `c` (from file `name`) fits a model of (L, H) heads on Hkv KV heads, the window it is used
    with and, if given, the moments and the estimate (attention.bulk_estimate) it corrects and the weights (their
    weights_probe) it was fitted on; ValueError with one line otherwise. What is None is not checked (a CLI checks the
    file before the model is loaded, the heads and weights after)."""
    if L is not None and (tuple(c.a.shape) != (L, H) or (c.s is not None and tuple(c.s.shape) != (L, Hkv))):
        raise ValueError(f"{name} corrects {tuple(c.a.shape)} heads; the model has ({L}, {H}) on {Hkv} KV heads")
    if probe is not None:
        check_weights(c.settings, name, probe, "was fitted on")
    check_settings_window(c.settings, name, n_sink, n_local, "was fitted with")
    if estimate is not None and c.estimate != estimate:
        raise ValueError(f"{name} corrects the {c.estimate} estimate of the bulk mass, this method decides with the "
                         f"{estimate} one (kind 'sampled' corrects the sampled estimate, every other kind the "
                         "Gaussian)")
    if c.estimate == "sampled":
        return  # the sampled estimate reads no moments
    fitted = c.settings.get("moments_source", "random-words")
    if moments_source is not None and fitted != moments_source:
        raise ValueError(f"{name} corrects the {fitted} moments' estimate; run it with those moments (--moments "
                         f"{fitted}; moments={fitted!r} in the transformers adapter)")


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
    labels = torch.zeros(local_freq.numel(), dtype=torch.bool, device=local_freq.device)
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


def load_local_freq(path: str | Path) -> tuple[torch.Tensor, dict]:
    """The oracle local frequencies (L, H) of a file written by save_labels, and its settings."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"static labels file {path} not found (make one with python -m lab.calibrate)")
    data = read_json_object(path, "a static labels file")
    if "a" in data and "b" in data:
        raise ValueError(f"{path} holds a QAdA correction (python -m lab.calibrate --qada), not static labels (python "
                         "-m lab.calibrate)")
    try:
        local_freq, settings = torch.tensor(data["local_freq"], dtype=torch.float32), dict(data["settings"])
    except KeyError as e:
        raise ValueError(f"{path} is not a static labels file: it has no {e} entry") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a static labels file: {e}") from None
    if local_freq.dim() != 2:
        raise ValueError(f"{path} is not a static labels file: local_freq holds {local_freq.dim()} dimensions, not "
                         "(L, H)")
    if not bool(((local_freq >= 0) & (local_freq <= 1)).all()):
        # a NaN sorts above every frequency: its head would be the first labelled local, silently
        raise ValueError(f"{path} holds local frequencies outside [0, 1] (or NaN); refit it with python -m "
                         "lab.calibrate")
    return local_freq, settings


def check_labels_window(settings: dict, name, n_sink: int | None, n_local: int | None) -> None:
    """That static labels saved with `settings` (file `name`) count the oracle's local heads over the window they are
    used with (check_settings_window)."""
    check_settings_window(settings, name, n_sink, n_local, "holds the oracle's statistics with")


def load_labels(path: str | Path, sparsity: float) -> tuple[torch.Tensor, dict]:
    """Static labels (L, H) at `sparsity` from a file written by save_labels, and its settings."""
    local_freq, settings = load_local_freq(path)
    return static_labels(local_freq, sparsity), settings
