"""Decode-time attention paths: dense, local, oracle, static and QAdA (paper sections 2-3, Listing 1); QAdA and the
oracle decided per KV group, QAdA with a calibrated estimate and QAdA with the bulk mass estimated from sampled keys
(ours: criterion.local_labels' group rules, criterion.Calibration, criterion.sampled_log_bulk); token-level page
selection, Quest (Tang et al. 2024) alone and inside calibrated QAdA's long-context groups (ours), over pages.py.

Reading order: `qada` (Listing 1) -> criterion.qada_labels (Eq. 7) -> moments.KeyMoments.quadratic_form (Eq. 6) ->
`window_attention` and `mixed_attention` (what is read). decode_kernels.py is the same decode step fused in Triton.

A path is one function `path(q, k, v, **inputs) -> (y, labels)` for one layer and one decoded token of one row:
q (H, D) is the rotated query, k and v (Hkv, T, D) are the layer's filled KV cache, y (H, D) is the attention
output and labels (H,) bool say which heads attended to their local window only (True = local). The KV read is then
implied by the labels (kv_read_fraction: a KV head reads its window when all its query heads are local, else all T).
A path that reads something else (pages) returns a third value, `read` (Hkv,): the KV entries it read per KV head
(a key and its value one entry, a key alone half), which HeadStats counts instead. Its keyword-only parameters
without a default name what else it reads; the ones used here:

    layer          the layer index
    n_sink         sink tokens at the start of the window
    n_local        the window's size, the paper's T_local, sinks included
    tau            the local-share threshold of Eq. 2 / Eq. 7
    moments        moments.KeyMoments: the bulk keys' Gaussian (qada)
    static_local   (L, H) bool labels fixed for every query (static)
    calibration    criterion.Calibration: a correction of Eq. 7 per layer and head (qada_cal)
    n_samples      bulk keys sampled per KV head to estimate the bulk mass (qada_sampled; its entries fix 64)
    pages          pages.PageIndex: each page's min and max keys (quest, qada_pages; build_attention makes it)
    budget         tokens a page path reads beyond the window, as budget // P whole pages (quest, qada_pages, ...)
    budget_frac    the same as a fraction of the context T (the *_frac entries, which fix budget to None)

A new path may read a new input: it is one more keyword, which DecodeAttention passes through by name (the CLIs
set it with `--set NAME=VALUE`). A keyword with a default is a setting its PATHS entry fixes (functools.partial).

`PATHS` is the one list of methods: the CLI and the research harness take their names from it, and a new method is
one function plus one entry. `run_path` runs one row's step (a qada or page path on the fused kernels where that
applies), `DecodeAttention` is what the model calls at each decode step, `build_attention` makes one for a prefilled
prompt, and `BatchAttention` runs one per row of a batch. `StaticAttention` is the same rows' step with every input in
fixed device buffers, the step generate.decode_static replays from CUDA graphs.
"""

import inspect
import math
from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.nn.functional as F

from criterion import (TAU, check_tau, check_window, corrected_log_bulk, gaussian_form, gaussian_log_bulk,
                       local_labels, oracle_labels, oracle_log_masses, qada_labels, sampled_log_bulk, window_mask,
                       window_slices)
from decode_kernels import dense_flags, fused, fused_dense, fused_pages, fused_qada, kernel_thresholds
from moments import FixedMoments, KeyMoments, OnlineMoments, ReferenceKeys, bulk_end, make_moments, mean_cov
from pages import PAGE_SIZE, PageIndex, candidates, group_ranking, page_count, page_positions, stacked, upper_bounds

# ---------------------------------------------------------------------------------------------------------
# The paths


def dense(q, k, v):
    """Every head reads the whole cache; each KV head once for its G query heads (the best dense we have)."""
    H, D = q.shape
    y = full_attention(q.view(k.shape[0], -1, D), k, v)  # (Hkv, G, D), not contiguous from CUDA's SDPA
    return y.reshape(H, D), torch.zeros(H, dtype=torch.bool, device=q.device)


def local(q, k, v, *, n_sink, n_local):
    """Every head on its window: the floor every method is measured against."""
    y, _ = window_attention(q, k, v, n_sink, n_local)
    return y, torch.ones(q.shape[0], dtype=torch.bool, device=q.device)


def oracle(q, k, v, *, n_sink, n_local, tau, rule=None):
    """Eq. 2 needs every score, so this path reads the whole cache and saves nothing: it is for analysis.
    With a `rule`, one decision per KV group from the true shares (criterion.local_labels)."""
    labels = oracle_labels(all_scores(q, k), n_sink, n_local, tau, k.shape[0], rule)
    return reference_attention(q, k, v, labels, n_sink, n_local).to(q.dtype), labels


def static(q, k, v, *, layer, n_sink, n_local, static_local):
    """A fixed set of (layer, head) pairs is local for every query (paper appendix A)."""
    labels = static_local[layer].to(q.device)
    return mixed_attention(q, k, v, labels, n_sink, n_local), labels


def qada(q, k, v, *, layer, n_sink, n_local, tau, moments, rule=None, correction=None):
    """Listing 1: the window's scores, the Gaussian estimate of the bulk (Eq. 7), then full attention for the
    long-context heads only. With a `rule`, one decision per KV group (ours): a group labelled long-context reads
    its KV head once for all G query heads, a local group reads its window only. `correction`: qada_cal's.
    (run_path takes the same step fused, decode_kernels.fused_qada, where decode_kernels.fused says so.)"""
    y_window, log_local = window_attention(q, k, v, n_sink, n_local)
    T = k.shape[1]
    if T <= n_local:  # no bulk: the window is the whole context, every head is exact and local
        return y_window, torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    form = moments.quadratic_form(layer, k)  # Eq. 6's (A, b): q A q^T + q b = mu_s + sigma_s^2 / 2
    labels = qada_labels(q, log_local, form, T - n_local, tau, rule, correction)
    return mixed_attention(q, k, v, labels, n_sink, n_local, y_window), labels


def qada_cal(q, k, v, *, layer, n_sink, n_local, tau, moments, calibration, rule=None):
    """QAdA with its estimate corrected per layer and head by calibration data (ours: criterion.Calibration, fitted
    by lab.calibrate on prompts whose true masses are known)."""
    return qada(q, k, v, layer=layer, n_sink=n_sink, n_local=n_local, tau=tau, moments=moments, rule=rule,
                correction=calibration.layer(layer))


def qada_sampled(q, k, v, *, layer, n_sink, n_local, tau, n_samples, z=0.0, rule=None, correction=None):
    """Beyond the Gaussian (ours): A_bulk estimated from n_samples bulk keys, one from each of n_samples equal strata
    of the bulk (bulk_sample), instead of from the keys' moments (criterion.sampled_log_bulk; z > 0 decides on the
    upper end of its interval). Reading m keys of dimension D costs what the Gaussian's q A q^T costs when m = D, and
    it is counted: a local group reads its window and the sampled keys (HeadStats.decision_read). `correction`:
    qada_sampled_cal's."""
    y_window, log_local = window_attention(q, k, v, n_sink, n_local)
    T = k.shape[1]
    if T <= n_local:  # no bulk: the window is the whole context
        return y_window, torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    idx = bulk_sample(T, n_sink, n_local, n_samples, layer, q.device)  # (m,)
    log_bulk = sampled_log_bulk(all_scores(q, k[:, idx]), T - n_local, z)  # the sampled keys' scores (H, m)
    if correction is not None:
        log_bulk = corrected_log_bulk(log_local, log_bulk, correction)
    labels = local_labels(log_local, log_bulk, tau, k.shape[0], rule)
    return mixed_attention(q, k, v, labels, n_sink, n_local, y_window), labels


def qada_sampled_cal(q, k, v, *, layer, n_sink, n_local, tau, n_samples, calibration, rule=None):
    """The sampled estimate with an affine correction per layer and head (ours: a Calibration of kind "sampled",
    fitted by lab.calibrate on the same estimate where the true masses are known)."""
    return qada_sampled(q, k, v, layer=layer, n_sink=n_sink, n_local=n_local, tau=tau, n_samples=n_samples, rule=rule,
                        correction=calibration.layer(layer))


# Token-level page selection. A page path returns a third value, the KV entries it read per KV head (Hkv,):
# its window, the bulk tokens of the pages read, and the page statistics read to choose them (a page's min and max,
# 2 key-sized vectors, half an entry each: 1 entry per page scored). HeadStats counts that instead of the labels' read.


def quest(q, k, v, *, layer, n_sink, n_local, pages, budget, budget_frac, page_size=PAGE_SIZE):
    """Quest (Tang et al. 2024, arXiv 2406.10774, section 3), on our window: each query head reads its window plus the
    page_count pages (budget // P: `budget` tokens, or a fraction `budget_frac` of T) of highest upper bound
    sum_d max(q_d min_d, q_d max_d) (pages.upper_bounds, from the PageIndex `pages`). Quest ranks pages per head; under
    GQA a KV head holds one cache for its G query heads, so it reads the union of their pages (up to G budgets) and
    each head attends to its own pages only. No head is window-only: labels all False."""
    y_window, log_local = window_attention(q, k, v, n_sink, n_local)
    H, T = q.shape[0], k.shape[1]
    m = candidates(T, n_sink, n_local, page_size)
    chosen, scored = top_pages(lambda: upper_bounds(q, *index_bounds(pages, page_size, n_sink, layer, k, m)), m,
                               page_count(T, page_size, budget, budget_frac), H, q.device)  # (H, m)
    y, page_read = paged_attention(q, k, v, chosen, y_window, log_local, n_sink, n_local, page_size)
    read = min(T, n_local) + page_read + scored * chosen.shape[1]  # (Hkv,): window, pages, every candidate's bound
    return y, torch.zeros(H, dtype=torch.bool, device=q.device), read


def qada_pages(q, k, v, *, layer, n_sink, n_local, tau, moments, calibration, pages, budget, budget_frac,
               combine="max", page_size=PAGE_SIZE):
    """Calibrated QAdA with Quest's pages inside its long-context groups (ours). The group decides as qada_kv_cal does
    (mean share rule, Eq. 7 corrected); a local group reads its window only; a long-context group reads its window
    plus the page_count pages of highest group bound, shared by its G query heads (its cache is read once for all).

    `combine` says how the heads' bounds make the group's: "max" (the default) ranks a page by the head that bounds it
    highest, so a page that one head of the group needs (a retrieval head beside heads that look elsewhere) is kept:
    a head's mass on a page grows as exp(bound), so the group's total mass on it is dominated by its largest bound.
    "sum" adds the bounds (logits): it multiplies the heads' exp(bound), ranking pages that every head likes, and can
    outvote one head's needle; it is the other registry entry (qada_pages_sum). "share" ranks by the max over heads of
    pages.page_shares, each head's bound as a share of its window's mass and every page at its bound
    (qada_pages_share; measured: no better than the max)."""
    y_window, log_local = window_attention(q, k, v, n_sink, n_local)
    H, D = q.shape
    Hkv, T, _ = k.shape
    if T <= n_local:  # no bulk: the window is the whole context, every head exact and local
        return y_window, torch.ones(H, dtype=torch.bool, device=q.device), torch.full((Hkv,), T, device=q.device)
    labels = qada_labels(q, log_local, moments.quadratic_form(layer, k), T - n_local, tau, "mean",
                         calibration.layer(layer))  # (H,): one decision per group, as qada_kv_cal
    long = ~labels.view(Hkv, -1)[:, 0]  # (Hkv,)
    n_long = int(long.sum())  # a host sync, as the [long] masks below: the torch path reads its labels on the host
    m = candidates(T, n_sink, n_local, page_size)
    chosen = torch.zeros(Hkv, m, dtype=torch.bool, device=q.device)
    scored = False
    if n_long:  # the long groups' bounds only: a local group reads no page statistics

        def group_bounds():  # (n_long, m): the heads' bounds combined per group
            lo, hi = index_bounds(pages, page_size, n_sink, layer, k, m)
            b = upper_bounds(q.view(Hkv, -1, D)[long].reshape(-1, D), lo[long], hi[long]).view(n_long, -1, m)
            return group_ranking(b, combine, log_local.view(Hkv, -1)[long], page_size, 1 / math.sqrt(D))

        chosen[long], scored = top_pages(group_bounds, m, page_count(T, page_size, budget, budget_frac), n_long,
                                         q.device)
    chosen = chosen.repeat_interleave(H // Hkv, 0)  # (H, m): each head of a group reads the group's pages
    y, page_read = paged_attention(q, k, v, chosen, y_window, log_local, n_sink, n_local, page_size)
    read = min(T, n_local) + page_read + (scored * m) * long  # (Hkv,): statistics for the long groups only
    return y, labels, read


def page_oracle(q, k, v, *, n_sink, n_local, budget, budget_frac, page_size=PAGE_SIZE):
    """Analysis only: each query head reads its window plus the page_count pages of largest true attention mass (the
    log-sum-exp of each page's bulk scores), which needs every score: the best page selection there is for a head at
    that budget, so the room Quest's bound leaves. Under GQA, as quest: a KV head reads the union of its heads'
    pages."""
    y_window, log_local = window_attention(q, k, v, n_sink, n_local)
    H, T = q.shape[0], k.shape[1]
    m = candidates(T, n_sink, n_local, page_size)
    chosen, _ = top_pages(lambda: page_masses(all_scores(q, k), n_sink, n_local, page_size), m,
                          page_count(T, page_size, budget, budget_frac), H, q.device)
    y, page_read = paged_attention(q, k, v, chosen, y_window, log_local, n_sink, n_local, page_size)
    return y, torch.zeros(H, dtype=torch.bool, device=q.device), min(T, n_local) + page_read  # read implied


N_SAMPLES = 64  # bulk keys the sampled estimate reads per KV head: at head dim 64, the Gaussian's q A q^T cost
PATHS = {"dense": dense, "local": local, "oracle": oracle, "static": static, "qada": qada,
         "oracle_kv": partial(oracle, rule="mean"), "qada_kv": partial(qada, rule="mean"),
         "qada_kv_all": partial(qada, rule="all"), "qada_cal": qada_cal, "qada_kv_cal": partial(qada_cal, rule="mean"),
         "qada_kv_all_cal": partial(qada_cal, rule="all"),
         "qada_sampled": partial(qada_sampled, n_samples=N_SAMPLES),
         "qada_kv_sampled": partial(qada_sampled, n_samples=N_SAMPLES, rule="mean"),
         "qada_sampled_upper": partial(qada_sampled, n_samples=N_SAMPLES, z=2.0),
         "qada_sampled_cal": partial(qada_sampled_cal, n_samples=N_SAMPLES),
         "qada_kv_sampled_cal": partial(qada_sampled_cal, n_samples=N_SAMPLES, rule="mean"),
         # page paths: the entry fixes the budget's unit (tokens or a fraction of T) and P; the amount is an input
         "quest": partial(quest, budget_frac=None), "quest_frac": partial(quest, budget=None),
         "qada_pages": partial(qada_pages, budget_frac=None), "qada_pages_frac": partial(qada_pages, budget=None),
         "qada_pages_sum": partial(qada_pages, budget_frac=None, combine="sum"),
         "qada_pages_share": partial(qada_pages, budget_frac=None, combine="share"),
         "page_oracle": partial(page_oracle, budget_frac=None)}
PATHS |= {f"{name}_p{P}": partial(PATHS[name], page_size=P)  # the page sizes measured beside Quest's 16
          for name in ("quest", "qada_pages", "page_oracle") for P in (32, 64)}
# Paths that compute every score to find their labels: the KV-read fraction of those labels is implied, not saved.
ANALYSIS_ONLY = ("oracle", "oracle_kv", "page_oracle", "page_oracle_p32", "page_oracle_p64")


def path_inputs(method: str) -> tuple[str, ...]:
    """What the path registered as `method` reads: its keyword-only parameters without a default."""
    if method not in PATHS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(PATHS)}")
    return tuple(p.name for p in inspect.signature(PATHS[method]).parameters.values()
                 if p.kind == p.KEYWORD_ONLY and p.default is p.empty)


def missing_inputs(method: str, inputs: dict, supplied=("layer",)) -> list[str]:
    """What the path registered as `method` reads that is neither in `inputs` nor among what its caller makes itself
    (`supplied`), in the path's order. The page budget the path reads, where `inputs` gives it, is checked here too (a
    number page_count takes), so that a caller says both before a long prefill, not at the first decode step."""
    reads = path_inputs(method)
    budget = {name: inputs.get(name) for name in ("budget", "budget_frac") if name in reads}
    if any(value is not None for value in budget.values()):  # what the path does not read is not its to check
        page_count(1, 1, budget.get("budget"), budget.get("budget_frac"))
    return [name for name in reads if name not in supplied and inputs.get(name) is None]


def decision_read(method: str) -> float:
    """KV entries a local group of the path registered as `method` reads beyond its window to decide, counted in
    entries of key and value: a sampled estimate reads n_samples keys (half an entry each), the Gaussian none."""
    return getattr(PATHS[method], "keywords", {}).get("n_samples", 0) / 2


def page_size(method: str) -> int | None:
    """The page size P of the path registered as `method` (the setting its entry fixes, else its default), None for a
    path without pages: build_attention makes its PageIndex at this P."""
    p = inspect.signature(PATHS[method]).parameters.get("page_size")
    return None if p is None else p.default


def bulk_estimate(method: str) -> str:
    """The bulk-mass estimate the path registered as `method` decides with, which a calibration it reads must
    correct (criterion.check_calibration): "sampled" (bulk keys) or "gaussian" (Eq. 6)."""
    return "sampled" if "n_samples" in getattr(PATHS[method], "keywords", {}) else "gaussian"


def qada_rule(method: str) -> tuple[bool, str | None]:
    """Whether the path registered as `method` is `qada` or `qada_cal`, and the KV-group rule its entry fixes (None:
    per head). run_path hands such a row to the fused kernel, and BatchAttention decides for a whole batch of such
    rows at once."""
    path = PATHS[method]
    fixed = path.keywords if isinstance(path, partial) else {}
    return getattr(path, "func", path) in (qada, qada_cal), fixed.get("rule")


# ---------------------------------------------------------------------------------------------------------
# What is read: the window, and the full cache only for the KV heads some query head needs (the saving is
# real). Plain torch, readable and tuned for the CPU.


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_sink: int, n_local: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (H, D) over the local window of the cache k, v (Hkv, T, D): the output (H, D) and the log of
    the window's attention mass, log A_local = log sum_{i in I} exp(s_i) (H,), in fp32. The products q.k are the
    cache dtype's, as an eager matmul gives them (rounded to bf16 in a bf16 cache), then scaled and reduced in fp32;
    the fused kernel keeps them in fp32, so in bf16 the two paths' labels differ near the threshold.

    The window is read in place as its two slices, sinks and recent tokens, each a view of the cache: only
    the (H, W) scores are concatenated, never keys or values. Deciding costs a few eager ops per layer, each a
    few microseconds on the CPU whatever its size, so the count matters: one log_softmax gives both the weights
    (its exp) and the mass, since log A_local = s_0 - log p_0 for any window position, here its first."""
    H, D = q.shape
    Hkv = k.shape[0]
    qg = q.view(Hkv, H // Hkv, D)  # (Hkv, G, D)
    parts = window_slices(k.shape[1], n_sink, n_local)
    # torch.bmm (not @, whose reshapes cost more than the product at these sizes) and the scale in place
    scores = [torch.bmm(qg, k[:, s].transpose(1, 2)) for s in parts]  # (Hkv, G, W_part) each
    scores = (torch.cat(scores, -1) if len(scores) > 1 else scores[0]).float().mul_(1 / math.sqrt(D))
    log_p = scores.log_softmax(-1)  # (Hkv, G, W)
    p = log_p.exp().to(v.dtype)
    y, start = None, 0
    for s in parts:
        p_part, start = p[..., start:start + s.stop - s.start], start + s.stop - s.start
        y = torch.bmm(p_part, v[:, s]) if y is None else y.baddbmm_(p_part, v[:, s])  # (Hkv, G, D)
    log_local = scores[..., 0] - log_p[..., 0]  # (Hkv, G)
    return y.view(H, D), log_local.view(H)


def mixed_attention(q, k, v, labels, n_sink, n_local, y_window=None):
    """Window attention for heads labelled local, full attention for the others; only the needed KV heads are read.

    q (H, D), k/v (Hkv, T, D), labels (H,) bool; y_window (H, D), the window output if already computed.
    A KV head is read in full when any query head of its group is long-context; consecutive such KV heads
    share one SDPA call on a slice of the cache (a view, never a copy)."""
    H, D = q.shape
    Hkv, T, _ = k.shape
    G = H // Hkv
    if y_window is None:
        y_window, _ = window_attention(q, k, v, n_sink, n_local)
    if T <= n_local:
        return y_window
    flags = labels.tolist()  # the one host sync per layer: the labels decide what is read
    runs = _runs([not all(flags[g * G:(g + 1) * G]) for g in range(Hkv)])
    if not runs:
        return y_window
    y = y_window.clone()
    qg, yg = q.view(Hkv, G, D), y.view(Hkv, G, D)  # (Hkv, G, D)
    for a, b in runs:
        yg[a:b] = full_attention(qg[a:b], k[a:b], v[a:b])
    if any(any(flags[a * G:b * G]) for a, b in runs):
        y = torch.where(labels[:, None], y_window, y)  # local heads of a group read in full keep the window
    return y


def top_pages(bounds, m: int, n_read: int, rows: int, device=None) -> tuple[torch.Tensor, bool]:
    """Which of the m candidate pages each of `rows` rows (query heads, or groups) reads: the n_read of highest
    bounds() (rows, m), called only when it decides something; (rows, m) bool, and whether the bounds were computed
    (and so their statistics read). With n_read >= m every page is read and none scored: the path is then dense."""
    if n_read <= 0 or m == 0:
        return torch.zeros(rows, m, dtype=torch.bool, device=device), False
    if n_read >= m:
        return torch.ones(rows, m, dtype=torch.bool, device=device), False
    scores = bounds()  # (rows, m)
    chosen = torch.zeros(rows, m, dtype=torch.bool, device=device)
    return chosen.scatter_(1, scores.topk(n_read, dim=1).indices, True), True


def paged_attention(q, k, v, chosen, y_window, log_local, n_sink, n_local, page_size):
    """Attention of q (H, D) over its window and the bulk positions of its chosen pages (H, m) bool, given the window's
    output y_window (H, D) and log mass log_local (H,) (window_attention's): y (H, D), and the bulk tokens read per KV
    head (Hkv,), the union of its query heads' pages (pages.page_positions: a page's positions in the window's recent
    part are the window's, not read again).

    Only the KV heads with a page chosen are read: each gathers its union's keys and values, padded to the longest
    union (U pages), and each query head attends to its own pages among them (a mask). The pages' output and log mass
    then merge with the window's by their masses: y = s y_window + (1 - s) y_pages, s = A_local / (A_local + A_pages),
    which is softmax attention over window and pages together."""
    H, D = q.shape
    Hkv, T, _ = k.shape
    G = H // Hkv
    chosen = chosen.to(q.device).view(Hkv, G, -1)  # (Hkv, G, m)
    union = chosen.any(1)  # (Hkv, m): the pages each KV head reads
    read = torch.zeros(Hkv, dtype=torch.long, device=q.device)
    active = union.any(1).nonzero().flatten()  # KV heads with a page to read: a host sync (U below is another)
    if active.numel() == 0:
        return y_window, read
    n_pages = union[active].sum(1)  # (a,)
    U = int(n_pages.max())
    ids = union[active].to(torch.uint8).sort(dim=1, descending=True, stable=True).indices[:, :U]  # (a, U) page numbers
    pos, in_bulk = page_positions(ids, T, n_sink, n_local, page_size)  # (a, U P)
    in_bulk &= (torch.arange(U, device=q.device) < n_pages[:, None]).repeat_interleave(page_size, 1)  # not padding
    row = torch.zeros_like(active)  # the one row of k[None]: those positions read, no copy of the cache
    k_pages, v_pages = (cache_gather(x[None], row, active, pos) for x in (k, v))  # (a, U P, D): what is read
    mine = chosen[active].gather(2, ids[:, None].expand(-1, G, -1)).repeat_interleave(page_size, 2)  # (a, G, U P)
    keep = mine & in_bulk[:, None]
    qa = q.view(Hkv, G, D)[active]  # (a, G, D)
    scores = torch.bmm(qa, k_pages.transpose(1, 2)).float().mul_(1 / math.sqrt(D)).masked_fill_(~keep, -math.inf)
    log_pages = scores.logsumexp(-1)  # (a, G): -inf for a head of the group with no page of its own
    # in place, as rows_paged_attention: exp(-inf - (finite)) = 0 for a position not read
    p = scores.sub_(log_pages.clamp(min=torch.finfo(torch.float32).min)[..., None]).exp_()
    y_pages = torch.bmm(p.to(v.dtype), v_pages).float()  # (a, G, D)
    s = torch.sigmoid(log_local.view(Hkv, G)[active] - log_pages)[..., None]  # (a, G, 1): 1 with no page
    y = y_window.clone()
    y.view(Hkv, G, D)[active] = (s * y_window.view(Hkv, G, D)[active].float() + (1 - s) * y_pages).to(y.dtype)
    read[active] = in_bulk.sum(1)
    return y, read


def index_bounds(pages: PageIndex, page_size: int, n_sink: int, layer: int, k: torch.Tensor, m: int):
    """The min and max (Hkv, m, D) of the m candidate pages, from the PageIndex a path reads (brought up to date with
    its cache k), which must hold pages of the path's own size counted from its own sinks (else page j would cover
    other positions than the path's candidate j)."""
    if why := index_mismatch(pages, page_size, n_sink):
        raise ValueError(why)
    lo, hi = pages.bounds(layer, k)
    return lo[:, :m], hi[:, :m]


def index_mismatch(pages: PageIndex, page_size: int, n_sink: int) -> str | None:
    """Why the page index cannot serve a path reading pages of `page_size` after `n_sink` sinks, or None."""
    if (pages.page_size, pages.n_sink) != (page_size, n_sink):
        return (f"a page index holds pages of {pages.page_size} tokens after {pages.n_sink} sinks; the path reads "
                f"pages of {page_size} after {n_sink}")
    return None


# The page paths for B rows of a left-padded stacked cache at once (BatchAttention's rows): what each row's own path
# does, in a constant number of eager ops and at most two host syncs per layer, where each row's own path takes ~30
# small ops and a few syncs.


def page_batchable(rows: list) -> bool:
    """Whether page_rows can decode these rows together: every row a DecodeAttention on the same quest or qada_pages
    entry (any budget unit, P or combine), one window (n_sink, n_local), fixed moments and one calibration, and no
    oracle tracked beside (its statistics read every score, row by row)."""
    first = rows[0] if rows else None
    if not isinstance(first, DecodeAttention) or page_kind(first.method) is None:
        return False
    return all(isinstance(a, DecodeAttention) and a.method == first.method and not a.stats.track_oracle
               and (a.n_sink, a.n_local) == (first.n_sink, first.n_local)
               and a.inputs.get("calibration") is first.inputs.get("calibration")
               and (a.moments is None or isinstance(a.moments, FixedMoments)) for a in rows)


def stacked_forms(forms: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's quadratic forms of n rows, each (A (Hkv, D, D), b (Hkv, D)), as (n, Hkv, D, D) and (n, Hkv, D)
    fp32 on `device`: where every row has the same form (the same moments object: Option 2 for prompts of one
    length, moments.ReferenceKeys.bulk_moments) one copy broadcast over the rows, so that the window kernel reads it
    once for all of them (a row stride of 0) and no copy per row is made; else one stacked copy per row."""
    A0, b0 = forms[0]
    if all(A is A0 and b is b0 for A, b in forms):
        A0, b0 = A0.float().to(device), b0.float().to(device)
        return A0[None].expand(len(forms), *A0.shape), b0[None].expand(len(forms), *b0.shape)
    return tuple(torch.stack([f[i] for f in forms]).float().to(device) for i in (0, 1))


def page_rows(rows: list, q, k, v, layer: int, live: list[int], start: list[int], y: torch.Tensor) -> torch.Tensor:
    """The live rows' page path (page_batchable: one quest or qada_pages entry for all), for all of them at once: q
    (B, H, 1, D), k/v (B, Hkv, T, D) the stacked cache, row b filled from start[b] on; writes y (B, H, 1, D) at the
    live rows and records each row's labels and read as its own path would.

    Row b's context is its view k[b, :, start[b]:] of T_b = T - start[b] positions. Its window (its sinks after its
    padding, the recent positions every row shares) is gathered as in BatchAttention.qada_rows (row_windows); for
    qada_pages, criterion.qada_labels decides for every row at once (mean rule, each row its own moments, T_bulk and
    tau, one correction). Each row's pages are ranked by its own PageIndex's bounds (row_pages), padded across rows
    to the longest row's candidates with padding that is never chosen, and one gathered attention reads the chosen
    pages of every (row, KV head) that has any and merges them with the window (rows_paged_attention)."""
    B, H, _, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    first, n = rows[live[0]], len(live)
    n_sink, n_local = first.n_sink, first.n_local
    lengths = [T - start[b] for b in live]  # each row's own T
    idx = torch.tensor(live, device=q.device)  # (n,) the live rows' places in the batch
    first_pos = torch.tensor([start[b] for b in live], device=q.device)  # (n,)
    qs = q[idx, :, 0]  # (n, H, D)
    y_window, log_local = row_windows(qs, k, v, idx, first_pos, min(lengths) <= n_local, n_sink, n_local)

    labels = torch.zeros(n, H, dtype=torch.bool, device=q.device)  # Quest labels no head window-only
    if page_kind(first.method) is qada_pages:
        forms = [rows[b].moments.quadratic_form(layer, k) for b in live]  # FixedMoments: one (A, b) per row
        A, b_ = stacked_forms(forms, q.device)  # (n, Hkv, D, D), (n, Hkv, D)
        tau = torch.tensor([[rows[b].tau] for b in live], dtype=torch.float64, device=q.device)  # (n, 1)
        n_bulk = torch.tensor([[max(t - n_local, 1)] for t in lengths], device=q.device)  # (n, 1); none: see below
        correction = first.inputs["calibration"].layer(layer)
        labels = qada_labels(qs, log_local, (A, b_), n_bulk, tau, "mean", correction)  # (n, H)
        labels |= torch.tensor([[t <= n_local] for t in lengths], device=q.device)  # no bulk: every head local
    long = ~labels.view(n, Hkv, -1)[..., 0]  # (n, Hkv): the groups that may read pages (Quest: all)

    chosen, pairs, scored = row_pages(rows, qs, k, layer, live, start, lengths, long, log_local)  # (n, Hkv, G, M)
    y_rows, page_read = rows_paged_attention(qs, k, v, idx, first_pos, chosen, pairs, y_window, log_local, n_sink,
                                             n_local, page_size(first.method))
    y[idx, :, 0] = y_rows.to(y.dtype)
    window = torch.tensor([[min(t, n_local)] for t in lengths], device=q.device)  # (n, 1)
    read = window + page_read + scored[:, None] * long  # (n, Hkv): window, pages, one entry per candidate scored
    for i, b in enumerate(live):
        rows[b].stats.record(layer, lengths[i], labels[i], read=read[i])
    return y


def row_windows(qs, k, v, idx, first_pos, short: bool, n_sink: int, n_local: int):
    """Each live row's window attention at once, window_attention's output (n, H, D) and log mass (n, H): qs (n, H, D)
    the rows' queries, idx (n,) their places in the stacked cache k, v (B, Hkv, T, D), first_pos (n,) their first
    filled positions. The W = n_local window positions of each row (its sinks, then the recent ones) are gathered
    into one (n Hkv, W, D) copy. `short`: some row has no more than W positions; its window is then its whole
    context, and the gathered positions before its first or past the last are masked out."""
    n, H, D = qs.shape
    Hkv, T = k.shape[1], k.shape[2]
    dev = qs.device
    sinks = first_pos[:, None] + torch.arange(n_sink, device=dev)  # (n, n_sink)
    recent = torch.arange(T - (n_local - n_sink), T, device=dev).expand(n, -1)  # (n, W - n_sink)
    pos = torch.cat([sinks, recent], 1).clamp(0, T - 1)  # (n, W)
    b, h = idx.repeat_interleave(Hkv), torch.arange(Hkv, device=dev).repeat(n)  # (n Hkv,) each
    kw, vw = (cache_gather(x, b, h, pos.repeat_interleave(Hkv, 0)) for x in (k, v))  # (n Hkv, W, D)
    scores = torch.bmm(qs.reshape(n * Hkv, -1, D), kw.transpose(1, 2)).float().mul_(1 / math.sqrt(D))  # (n Hkv, G, W)
    if short:  # a sink past the row's last position, a recent one in its padding or among its sinks: not its own
        valid = torch.cat([sinks < T, recent >= first_pos[:, None] + n_sink], 1)  # (n, W)
        scores.masked_fill_(~valid.repeat_interleave(Hkv, 0)[:, None], -math.inf)
    log_local = scores.logsumexp(-1)  # (n Hkv, G)
    p = scores.sub_(log_local[..., None]).exp_().to(vw.dtype)
    return torch.bmm(p, vw).view(n, H, D), log_local.view(n, H)


def row_pages(rows: list, qs, k, layer: int, live: list[int], start: list[int], lengths: list[int], long, log_local
              ) -> tuple[torch.Tensor, list[tuple[int, int]], torch.Tensor]:
    """Which candidate pages each live row's query heads read, as its own path chooses them: (n, Hkv, G, M) bool, M
    the most candidates of any row; the (row, KV head) pairs that read any, and the candidates each row scored (n,).
    qs (n, H, D) the queries, long (n, Hkv) bool the groups that may read pages (the host sync of qada_pages),
    log_local (n, H) the windows' log masses (the share combination's).

    A row reads under its own page_count: none, every candidate, or the top ones by Quest's bound, per query head
    (quest) or per long-context group with the heads' bounds combined by max, sum or share (qada_pages). The bounds come
    from each row's own PageIndex, brought up to date with its view k[b, :, start[b]:] (only where they rank pages,
    as in its path, and only for its groups that read), each row's bounds computed from its own index by
    upper_bounds (which converts that row's statistics to float32), then padded and ranked together: copying every
    ranked pair's statistics into one padded buffer first cost more than the products on the CPU. A row's pages past
    its own candidates are padding at -inf: it ranks n_read < m pages, so each one it takes is a real page."""
    n, H, D = qs.shape
    Hkv = k.shape[1]
    G, dev = H // Hkv, qs.device
    method = rows[live[0]].method
    path, P, kind = PATHS[method], page_size(method), page_kind(method)
    n_sink, n_local = rows[live[0]].n_sink, rows[live[0]].n_local
    m = [candidates(t, n_sink, n_local, P) for t in lengths]
    given = [path.keywords | rows[b].inputs for b in live]  # a row's budget, or the fraction its entry reads
    n_read = [min(page_count(t, P, g.get("budget"), g.get("budget_frac")), mi) for t, g, mi in zip(lengths, given, m)]
    long = long.tolist() if kind is qada_pages else [[True] * Hkv] * n  # the host sync: which groups read
    pairs = [(i, h) for i in range(n) if n_read[i] for h in range(Hkv) if long[i][h]]  # (row, KV head) that read
    M = max(m)
    chosen = torch.zeros(n, Hkv, G, M, dtype=torch.bool, device=dev)
    every = [(i, h) for i, h in pairs if n_read[i] == m[i]]  # a budget that covers every candidate: none ranked
    if every:
        r, h = (torch.tensor(x, device=dev) for x in zip(*every))
        chosen[r, h] = (torch.arange(M, device=dev) < torch.tensor([m[i] for i, _ in every], device=dev)[:, None]
                        )[:, None]  # (a, 1, M) for the G heads
    ranked = [(i, h) for i, h in pairs if n_read[i] < m[i]]
    if ranked:
        Mr = max(m[i] for i, _ in ranked)
        qg = qs.view(n, Hkv, G, D)
        parts = []  # each ranking row's bounds (c, G, Mr), from its own index
        for i in dict.fromkeys(i for i, _ in ranked):  # each ranking row once, in order
            heads = [h for ii, h in ranked if ii == i]
            b = live[i]
            lo_b, hi_b = index_bounds(rows[b].inputs["pages"], P, rows[b].n_sink, layer, k[b, :, start[b]:],
                                      m[i])  # (Hkv, m, D)
            if len(heads) == Hkv:
                bound = upper_bounds(qs[i], lo_b, hi_b)  # (H, m)
            else:  # a head at a time, on views of the index
                bound = torch.cat([upper_bounds(qg[i, h], lo_b[h:h + 1], hi_b[h:h + 1]) for h in heads])
            # a row's pages past its own candidates: padding no head chooses
            parts.append(F.pad(bound.view(len(heads), G, m[i]), (0, Mr - m[i]), value=-math.inf))
        bounds = torch.cat(parts)  # (p, G, Mr)
        r, h = (torch.tensor(x, device=dev) for x in zip(*ranked))  # (p,) each
        if kind is qada_pages:  # one ranking per group, (p, 1, Mr)
            bounds = group_ranking(bounds, path.keywords.get("combine", "max"), log_local.view(n, Hkv, G)[r, h], P,
                                   1 / math.sqrt(D))[:, None]
        K = max(n_read[i] for i, _ in ranked)
        top = bounds.topk(K, dim=-1).indices  # (p, G or 1, K), highest first
        take = torch.arange(K, device=dev) < torch.tensor([n_read[i] for i, _ in ranked], device=dev)[:, None]
        picked = torch.zeros_like(bounds, dtype=torch.bool).scatter_(-1, top, take[:, None].expand_as(top))
        chosen[r, h, :, :Mr] = picked  # (p, G or 1, Mr): a group's pages for each of its heads
    scored = torch.tensor([m[i] if 0 < n_read[i] < m[i] else 0 for i in range(n)], device=dev)  # (n,)
    return chosen, pairs, scored


def rows_paged_attention(qs, k, v, idx, first_pos, chosen, pairs: list[tuple[int, int]], y_window, log_local,
                         n_sink: int, n_local: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_attention for the live rows of a stacked cache at once: the rows' attention over their windows and the
    bulk positions of their chosen pages (n, Hkv, G, M), given the windows' output y_window (n, H, D) and log mass
    log_local (n, H): y (n, H, D), and the bulk tokens read per (row, KV head) (n, Hkv).

    Only the (row, KV head) `pairs` with a page chosen are read: each gathers the keys and values of the union of its
    query heads' pages, padded to the longest union (U pages), a row's page j at its positions first_pos + n_sink +
    j P on; then one masked softmax over all pairs, merged with the window by their masses (as paged_attention)."""
    n, H, D = qs.shape
    Hkv, T = k.shape[1], k.shape[2]
    G, dev = H // Hkv, qs.device
    read = torch.zeros(n, Hkv, dtype=torch.long, device=dev)
    if not pairs:
        return y_window, read
    r, h = (torch.tensor(x, device=dev) for x in zip(*pairs))  # (a,) each
    mine = chosen[r, h]  # (a, G, M)
    union = mine.any(1)  # (a, M)
    n_pages = union.sum(1)  # (a,)
    U = int(n_pages.max())  # a host sync (Quest's union of G heads' pages is known only here)
    ids = union.to(torch.uint8).sort(dim=1, descending=True, stable=True).indices[:, :U]  # (a, U) page numbers
    offset = torch.arange(page_size, device=dev)
    pos = (first_pos[r, None, None] + n_sink + ids[..., None] * page_size + offset).flatten(1)  # (a, U P)
    in_bulk = (pos < T - (n_local - n_sink)) & (torch.arange(U, device=dev) < n_pages[:, None]).repeat_interleave(
        page_size, 1)  # a page's bulk positions (the window's recent part is the window's), and no padding page
    pos = pos.clamp(max=T - 1)  # positions not to read stay in the cache; masked out
    k_pages, v_pages = (cache_gather(x, idx[r], h, pos) for x in (k, v))  # (a, U P, D): what is read
    keep = mine.gather(2, ids[:, None].expand(-1, G, -1)).repeat_interleave(page_size, 2) & in_bulk[:, None]
    qa = qs.view(n, Hkv, G, D)[r, h]  # (a, G, D)
    scores = torch.bmm(qa, k_pages.transpose(1, 2)).float().mul_(1 / math.sqrt(D)).masked_fill_(~keep, -math.inf)
    log_pages = scores.logsumexp(-1)  # (a, G): -inf for a head of the pair with no page of its own
    # in place, few passes over the (a, G, U P) scores: exp(-inf - (finite)) = 0 for a position not read
    p = scores.sub_(log_pages.clamp(min=torch.finfo(torch.float32).min)[..., None]).exp_()
    y_pages = torch.bmm(p.to(v.dtype), v_pages).float()  # (a, G, D)
    s = torch.sigmoid(log_local.view(n, Hkv, G)[r, h] - log_pages)[..., None]  # (a, G, 1): 1 with no page
    y = y_window.view(n, Hkv, G, D)
    y[r, h] = (s * y[r, h].float() + (1 - s) * y_pages).to(y.dtype)  # y_window is ours to write into
    read[r, h] = in_bulk.sum(1)
    return y.view(n, H, D), read


def cache_gather(x: torch.Tensor, b: torch.Tensor, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The positions pos (a, N) of the (row b, KV head h) pairs (a,) each of x (B, Hkv, T, D), a view of the cache:
    (a, N, D), a copy. A cache position is a row of D contiguous values, so x is read as those rows and one
    index_select copies each position whole; advanced indexing, x[b, h, pos], copies value by value (~5x slower on
    the CPU at 14k positions of 64 bf16 values). A view whose positions are not such rows is indexed plainly."""
    a, N = pos.shape
    D = x.shape[-1]
    s0, s1, s2, s3 = x.stride()
    if s3 != 1 or s2 != D or s0 % D or s1 % D:
        return x[b[:, None], h[:, None], pos]
    rows = x.as_strided(((x.shape[0] - 1) * s0 // D + (x.shape[1] - 1) * s1 // D + x.shape[2], D), (D, 1))
    index = (b * (s0 // D) + h * (s1 // D))[:, None] + pos  # (a, N) row numbers
    return rows.index_select(0, index.flatten()).view(a, N, D)


# ---------------------------------------------------------------------------------------------------------
# The other torch helpers: full attention (a lone KV head's context split between CPU threads), every score (the
# oracle's), the sampled estimate's bulk keys, and the explicit fp32 reference the tests hold the paths against


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of q (n, G, D) over n KV heads' whole caches k, v (n, T, D): (n, G, D).

    The G query heads of a group are handed to SDPA as G query positions of one head, so each KV head is
    read once (SDPA with enable_gqa reads it once per query head). k and v are views of the cache: SDPA
    reads them in place, nothing is copied. No mask: the decoded token sees every cached position.
    SDPA on the CPU shares its work out by heads, so a lone KV head would keep one thread busy and the
    others idle; its context is split between the threads instead (split_context_attention)."""
    threads = torch.get_num_threads()
    if q.shape[0] == 1 and q.device.type == "cpu" and threads > 1 and k.shape[1] >= 2 * threads:
        return split_context_attention(q, k, v, threads)
    return F.scaled_dot_product_attention(q[None], k[None], v[None])[0]  # (1, n, G, D) -> (n, G, D)


def split_context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: int) -> torch.Tensor:
    """One KV head's attention, q (1, G, D) over k, v (1, T, D), its context cut into `chunks` slices that SDPA's CPU
    kernel attends side by side, one per thread (the split-KV of flash-decoding): (1, G, D).

    Slice i holds positions [i s, i s + h), s = T // chunks, h = T - (chunks - 1) s: views of the cache, as SDPA's
    "heads". When chunks does not divide T a slice shares h - s positions with the one before, masked out of it.
    Each slice's output is normalised by its own mass; the kernel also returns its log-sum-exp, and a softmax over
    those gives each slice's share of the total mass: the weights that merge the slices into exact attention.
    Public SDPA returns no log-sum-exp, so this calls the CPU kernel that SDPA itself dispatches to."""
    _, T, D = k.shape
    G = q.shape[1]
    s = T // chunks
    h = T - (chunks - 1) * s

    def slices(x):  # (1, chunks, h, D), a view
        return x.as_strided((1, chunks, h, D), (0, s * x.stride(1), x.stride(1), x.stride(2)))

    mask = None
    if h > s:
        mask = torch.zeros(1, chunks, 1, h, dtype=q.dtype, device=q.device)
        mask[:, 1:, :, :h - s] = -math.inf  # the positions each slice shares with the one before
    y, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.expand(chunks, G, D)[None], slices(k), slices(v), attn_mask=mask)[:2]  # (1, chunks, G, D), (1, chunks, G)
    share = lse[0].float().softmax(0)  # (chunks, G)
    return (y[0].float() * share[..., None]).sum(0, keepdim=True).to(q.dtype)  # (1, G, D)


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive True flags: [T, T, F, T] -> [(0, 2), (3, 4)]."""
    runs = []
    for i, flag in enumerate(flags):
        if flag and runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        elif flag:
            runs.append((i, i + 1))
    return runs


def all_scores(q, k):
    """Every score s = q K^T / sqrt(d) in fp32, (H, T): what the oracle (analysis only) needs. A group's query
    heads share one product with their KV head (no per-head copy of the keys)."""
    Hkv, T, D = k.shape
    qg = q.float().view(Hkv, -1, D)  # (Hkv, G, D)
    return torch.bmm(qg, k.float().transpose(1, 2)).view(-1, T) / math.sqrt(D)


def page_masses(scores: torch.Tensor, n_sink: int, n_local: int, page_size: int) -> torch.Tensor:
    """The true log attention mass of each candidate page's bulk positions, from every score (H, T): (H, m) (analysis
    only: page_oracle's ranking)."""
    H, T = scores.shape
    m = candidates(T, n_sink, n_local, page_size)
    bulk = scores[:, n_sink:bulk_end(T, n_sink, n_local)]  # (H, T_bulk)
    padded = F.pad(bulk, (0, m * page_size - bulk.shape[1]), value=-math.inf)  # the last page's window part left out
    return padded.view(H, m, page_size).logsumexp(-1)


def bulk_sample(T: int, n_sink: int, n_local: int, m: int, layer: int, device=None) -> torch.Tensor:
    """(m,) positions of the bulk [n_sink, T - (n_local - n_sink)), one in each of m strata of (nearly) equal size
    (every position when the bulk has no more than m), placed within its stratum by a low-discrepancy offset fixed
    per layer and stratum: no random state, so a rerun reads the same keys, and the layers sample other phases."""
    lo, hi = n_sink, bulk_end(T, n_sink, n_local)
    if hi - lo <= m:
        return torch.arange(lo, hi, device=device)
    edges = lo + torch.arange(m + 1, device=device) * (hi - lo) // m  # integer strata [edges[j], edges[j + 1])
    j = torch.arange(m, device=device, dtype=torch.float64)
    offset = torch.frac((j + 1) * 0.6180339887498949 + layer * 0.4142135623730951)  # golden and silver ratios
    return edges[:-1] + (offset * (edges[1:] - edges[:-1])).long()


def reference_attention(q, k, v, labels, n_sink, n_local):
    """The same result computed plainly in fp32: every score, window heads masked to the window."""
    H, D = q.shape
    Hkv, T, _ = k.shape
    in_window = window_mask(T, n_sink, n_local, q.device)
    keep = in_window[None, :] | ~labels.to(q.device)[:, None]  # (H, T)
    weights = all_scores(q, k).masked_fill(~keep, -math.inf).softmax(-1)  # (H, T)
    return torch.bmm(weights.view(Hkv, H // Hkv, T), v.float()).view(H, D)


# ---------------------------------------------------------------------------------------------------------
# What the model calls at each decode step


def run_path(method: str, q, k, v, **inputs) -> tuple[torch.Tensor, ...]:
    """One row's decode step through the path registered as `method`, given what it reads (path_inputs, layer
    included): (y, labels), or (y, labels, read) from a path that reports its read. A qada path (qada_rule) with a
    bulk to decide on takes the fused kernel where decode_kernels.fused says so: the same labels and output, decided and
    skipped on the device with nothing read back to the host; so does a page path (page_kind), its pages chosen and
    gathered there (decode_kernels.fused_pages)."""
    is_qada, rule = qada_rule(method)
    if is_qada and fused(q) and k.shape[1] > inputs["n_local"]:
        layer, calibration = inputs["layer"], inputs.get("calibration")
        A, b = inputs["moments"].quadratic_form(layer, k)  # (Hkv, D, D), (Hkv, D)
        zero, tau = _one_row(q.device, inputs["tau"])
        y, labels = fused_qada(q[None], k[None], v[None], zero, zero, inputs["n_sink"], inputs["n_local"],
                               (A[None], b[None]), tau, rule, None if calibration is None else calibration.layer(layer))
        return y[0], labels[0]
    if page_kind(method) and fused(q) and k.shape[1] > inputs["n_local"]:
        return fused_page_step(method, q, k, v, **inputs)
    return PATHS[method](q, k, v, **inputs)


def _one_row(device: torch.device, tau: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A single row as the fused kernels take a batch: row 0 of the cache, filled from position 0, and its tau in
    float64 (kernel_thresholds makes the fp32 thresholds from it as criterion does)."""
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    return zero, None if tau is None else torch.full((1,), tau, dtype=torch.float64, device=device)


def page_kind(method: str):
    """quest or qada_pages when the path registered as `method` is one of them (any page size, budget unit or
    combination of bounds), the page paths decode_kernels.fused_pages runs; else None."""
    path = getattr(PATHS[method], "func", PATHS[method])  # a registry entry is the function or a partial of it
    return path if path in (quest, qada_pages) else None


def page_options(method: str, inputs: dict) -> dict:
    """decode_kernels.fused_pages' page settings for the page path registered as `method`, given the inputs it reads:
    its page_size, its budget (tokens) or budget_frac, and how a group combines its heads' bounds (Quest ignores it)."""
    return dict(page_size=page_size(method), budget=inputs.get("budget"), budget_frac=inputs.get("budget_frac"),
                combine=getattr(PATHS[method], "keywords", {}).get("combine", "max"))


def fused_page_step(method: str, q, k, v, *, layer, n_sink, n_local, pages, budget=None, budget_frac=None, tau=None,
                    moments=None, calibration=None):
    """One row's step of a page path (Quest alone, or QAdA + pages) in decode_kernels.fused_pages: the same labels,
    pages and read as the torch path, the choice and the gather on the device. (y, labels, read) as the path returns
    them."""
    options = page_options(method, dict(budget=budget, budget_frac=budget_frac))
    P = options["page_size"]
    lo, hi = index_bounds(pages, P, n_sink, layer, k, candidates(k.shape[1], n_sink, n_local, P))  # (Hkv, m, D)
    zero, tau = _one_row(q.device, tau)
    decide = {}
    if page_kind(method) is qada_pages:  # QAdA's group decision, as qada_kv_cal takes it
        A, b = moments.quadratic_form(layer, k)
        decide = dict(form=(A[None], b[None]), tau=tau, correction=calibration.layer(layer))
    y, labels, read = fused_pages(q[None], k[None], v[None], zero, zero, n_sink, n_local, (lo[None], hi[None]),
                                  **options, with_read=True, **decide)
    return y[0], labels[0], read[0]


@dataclass
class DecodeAttention:
    """The decode-time attention of path `method` for every layer of one row, with what the path reads."""
    method: str = "qada"
    n_sink: int = 16
    n_local: int = 128  # the window's size T_local, sinks included
    inputs: dict = field(default_factory=dict)  # what else the path reads, by keyword: tau, moments, static_local, ...
    stats: "HeadStats | None" = None
    exact: OnlineMoments | None = None  # analysis: the current bulk's own moments, by Welford's update (oracle_view)

    def __post_init__(self):
        check_window(self.n_sink, self.n_local)
        reads = path_inputs(self.method)
        given = dict(self.inputs, n_sink=self.n_sink, n_local=self.n_local)
        missing = missing_inputs(self.method, given)
        if missing:
            raise ValueError(f"the {self.method} path reads {', '.join(missing)}; give "
                             + ", ".join(f"--set {m}=VALUE" for m in missing) + " on the command line (in Python: "
                             "build_attention's keywords)")
        self.with_layer = "layer" in reads
        self.inputs = {name: given[name] for name in reads if name != "layer"}  # exactly what the path reads
        if "tau" in self.inputs:
            check_tau(self.inputs["tau"])
        if self.inputs.get("pages") is not None and (why := index_mismatch(self.inputs["pages"],
                                                                           page_size(self.method), self.n_sink)):
            raise ValueError(why)  # here, not at the first step that scores pages: that may come late or never
        if self.stats is None:
            self.stats = HeadStats(self.n_local, decision_read=decision_read(self.method))

    @property
    def tau(self) -> float | None:
        return self.inputs.get("tau")

    @property
    def moments(self) -> KeyMoments | None:
        return self.inputs.get("moments")

    def __call__(self, q, k, v, layer: int) -> torch.Tensor:
        """q (1, H, 1, D), k/v (1, Hkv, T, D) -> (1, H, 1, D)."""
        if q.shape[0] != 1:
            raise ValueError("DecodeAttention decodes one row; BatchAttention runs one per row of a batch")
        _, H, _, D = q.shape
        q1, k1, v1 = q.view(H, D), k.squeeze(0), v.squeeze(0)
        y, labels, *read = run_path(self.method, q1, k1, v1, **self.inputs,
                                    **({"layer": layer} if self.with_layer else {}))  # read: a page path's (Hkv,)
        oracle_local = log_masses = None
        if self.stats.track_oracle:  # analysis: every score, the true masses beside the Gaussian estimate
            oracle_local, log_masses = self.oracle_view(q1, k1, layer)
        self.stats.record(layer, k1.shape[1], labels, oracle_local, log_masses, *read)
        return y.reshape(1, H, 1, D)

    def oracle_view(self, q, k, layer: int):
        """The oracle's labels (at the path's tau, else criterion.TAU) and the log masses (4, H): local, true bulk,
        the Gaussian estimate of the bulk from the path's moments, and from the exact moments of this step's bulk
        keys (which separates error in the moments from error in the Gaussian shape)."""
        scores = all_scores(q, k)
        log_local, log_bulk = oracle_log_masses(scores, self.n_sink, self.n_local)
        labels = oracle_labels(scores, self.n_sink, self.n_local, self.tau or TAU)
        T = k.shape[1]
        log_gauss = log_exact = torch.full_like(log_local, math.nan)
        if T > self.n_local:
            # The same moments either way; the update costs O(d^2) per step where the direct form costs O(T d^2)
            if self.exact is not None:
                exact = self.exact.mean_cov(layer, k)
            else:
                exact = mean_cov(k[:, self.n_sink:bulk_end(T, self.n_sink, self.n_local)])  # bulk (Hkv, T - n_local, D)
            log_exact = gaussian_log_bulk(q, gaussian_form(*exact), T - self.n_local)
            if self.moments is not None:
                log_gauss = gaussian_log_bulk(q, self.moments.quadratic_form(layer, k), T - self.n_local)
        return labels, torch.stack([log_local, log_bulk, log_gauss, log_exact])


@dataclass
class BatchAttention:
    """Decode-time attention for B rows side by side: B prompts in a stacked cache (model.KVCache.stack), or one
    prompt under B configurations (lab/sweep.py). Row b attends with rows[b], its own DecodeAttention (path, labels,
    statistics), on its own query and the filled part of its own cache, from start[b] on (after the left padding),
    so a row reads a KV head only when that row needs it. Rows marked `done` (their answer has ended) are skipped:
    their outputs are zeros and their cache is not read.

    When every row runs the same `qada` or `qada_cal` path (qada_rule) with fixed moments (and one calibration), the
    decision is taken for all rows at once (qada_rows): one window pass and one Gaussian term for the batch instead of
    one per row, each row with its own moments, context length and tau; each row's full heads are then read on its
    own (or every row in decode_kernels.fused_qada). Likewise every row on one page path (page_batchable: quest or
    qada_pages, any entry) takes its step in page_rows, all rows' windows, decisions and pages at once. `batched=False`
    keeps the row-by-row path, which the tests hold the batched ones to."""
    rows: list[DecodeAttention]
    start: list[int] | None = None  # per row, the first filled position of the cache; None: every row from 0
    done: list[bool] = field(default_factory=list)
    batched: bool = True

    def __post_init__(self):
        self.done = self.done or [False] * len(self.rows)
        if self.start is not None and len(self.start) != len(self.rows):
            raise ValueError(f"{len(self.rows)} rows but {len(self.start)} start positions")
        first = self.rows[0] if self.rows else None
        # one qada path with fixed moments for every row, one window, nothing tracked
        self.all_qada = self.batched and isinstance(first, DecodeAttention) and qada_rule(first.method)[0] and all(
            isinstance(a, DecodeAttention) and a.method == first.method and isinstance(a.moments, FixedMoments)
            and a.inputs.get("calibration") is first.inputs.get("calibration") and not a.stats.track_oracle
            and (a.n_sink, a.n_local) == (first.n_sink, first.n_local) for a in self.rows)
        self.all_pages = self.batched and page_batchable(self.rows)  # one page path for every row: page_rows
        self.cached = {}  # (layer, live rows) -> their quadratic forms stacked, taus and first positions

    def __call__(self, q, k, v, layer: int) -> torch.Tensor:
        """q (B, H, 1, D), k/v (B, Hkv, T, D) -> (B, H, 1, D)."""
        if q.shape[0] != len(self.rows):
            raise ValueError(f"a batch of {q.shape[0]} rows for {len(self.rows)} attentions")
        live = [b for b in range(len(self.rows)) if not self.done[b]]
        y = torch.empty_like(q) if len(live) == len(self.rows) else torch.zeros_like(q)  # every live row is written
        start = self.start or [0] * len(self.rows)
        if self.all_qada and live and all(k.shape[2] - start[b] > self.rows[b].n_local for b in live):
            return self.qada_rows(q, k, v, layer, live, start, y)
        if self.all_pages and live and not fused(q):  # on the fused kernel each row's page step is fused (run_path)
            return page_rows(self.rows, q, k, v, layer, live, start, y)
        for b in live:
            s = start[b]
            y[b:b + 1] = self.rows[b](q[b:b + 1], k[b:b + 1, :, s:], v[b:b + 1, :, s:], layer)  # views, no copy
        return y

    def qada_rows(self, q, k, v, layer: int, live: list[int], start: list[int], y: torch.Tensor) -> torch.Tensor:
        """The live rows' `qada` path, deciding for all of them at once. Each row's window (its own sinks after its
        padding, the recent positions every row shares) is gathered into one (n Hkv, W, D) batch, a copy of
        W = n_local positions per row, and goes through window_attention as a context that is all window; then
        criterion.qada_labels decides for the n rows together, each with its own moments, T_bulk and tau."""
        B, H, _, D = q.shape
        T = k.shape[2]
        first, n = self.rows[live[0]], len(live)
        n_sink, n_local = first.n_sink, first.n_local
        key = (layer, tuple(live))
        if key not in self.cached:
            forms = [self.rows[b].moments.quadratic_form(layer, k) for b in live]
            self.cached = {kk: c for kk, c in self.cached.items() if kk[1] == key[1]}  # rows that ended are gone
            tau = torch.tensor([[self.rows[b].tau] for b in live], dtype=torch.float64, device=q.device)  # (n, 1)
            self.cached[key] = (*stacked_forms(forms, q.device),  # (n, Hkv, D, D), (n, Hkv, D)
                                tau, kernel_thresholds(tau[:, 0]),  # the kernel's fp32 thresholds
                                torch.tensor([start[b] for b in live], device=q.device),  # (n,)
                                torch.tensor(live, device=q.device))  # made once per set of live rows, not per step
        A, b_, tau, thresholds, first_pos, rows = self.cached[key]
        calibration = first.inputs.get("calibration")  # qada_cal: one correction for every row
        correction = calibration.layer(layer) if calibration is not None else None
        if fused(q):  # every live row in the two kernels, each reading its own cache row from its own start
            qs = q[:, :, 0] if n == B else q[rows, :, 0]  # (n, H, D): a view when every row is live
            _, labels = fused_qada(qs, k, v, rows, first_pos, n_sink, n_local, (A, b_), thresholds,
                                   qada_rule(first.method)[1], correction, out=y[:, :, 0])  # into y at rows
            for i, b in enumerate(live):
                self.rows[b].stats.record(layer, T - start[b], labels[i])
            return y
        sinks = first_pos[:, None] + torch.arange(n_sink, device=q.device)  # (n, n_sink)
        recent = slice(T - (n_local - n_sink), T)

        def window(x):  # (B, Hkv, T, D) -> (n Hkv, W, D): each live row's sinks, then the recent positions
            return torch.cat([x[rows[:, None], :, sinks].transpose(1, 2), x[rows, :, recent]], 2).view(-1, n_local, D)

        qs = q[rows, :, 0]  # (n, H, D)
        y_window, log_local = window_attention(qs.reshape(n * H, D), window(k), window(v), n_sink, n_local)
        n_bulk = (T - n_local - first_pos[:, None]).float()  # (n, 1): each row's T_bulk
        labels = qada_labels(qs, log_local.view(n, H), (A, b_), n_bulk, tau, qada_rule(first.method)[1],
                             correction)  # (n, H)
        y_window = y_window.view(n, H, D)
        for i, b in enumerate(live):
            s = start[b]
            y[b, :, 0] = mixed_attention(qs[i], k[b, :, s:], v[b, :, s:], labels[i], n_sink, n_local, y_window[i])
            self.rows[b].stats.record(layer, T - s, labels[i])
        return y

    def select(self, keep: list[int]) -> "BatchAttention":
        """The same attentions (statistics keep accumulating in them) for the rows `keep` only."""
        start = None if self.start is None else [self.start[b] for b in keep]
        return BatchAttention([self.rows[b] for b in keep], start, [self.done[b] for b in keep], self.batched)


def build_attention(method: str, cache, *, n_sink: int = 16, n_local: int = 128, moments_source: str = "random-words",
                    reference: ReferenceKeys | None = None, track_oracle: bool = False, **inputs) -> DecodeAttention:
    """The decode-time attention of `method` for the prompt prefilled in `cache` (row 0). `inputs` are what the path
    reads by keyword (tau, static_local, a new path's own); what it does not read is dropped. A path that reads
    `moments` gets them from `moments_source` (moments.SOURCES; Option 2 reads `reference`, the reference prompt's
    keys) unless `inputs` hands it a KeyMoments; a path that reads `pages` gets a pages.PageIndex of the prompt's keys.
    `track_oracle` records the oracle's labels and masses beside."""
    reads = path_inputs(method)
    if "moments" in reads and "moments" not in inputs:
        inputs["moments"] = make_moments(moments_source, cache, reference, n_sink, n_local)
    if "pages" in reads and "pages" not in inputs:  # the prefilled keys' pages, at the path's own page size
        inputs["pages"] = PageIndex(cache, page_size(method), n_sink)
    exact = OnlineMoments(cache, n_sink, n_local) if track_oracle else None
    return DecodeAttention(method, n_sink, n_local, {k: v for k, v in inputs.items() if k in reads},
                           HeadStats(n_local, track_oracle, decision_read(method)), exact)


# ---------------------------------------------------------------------------------------------------------
# The decode step a CUDA graph captures: every input in fixed-size device buffers


def static_refusal(rows: list[DecodeAttention]) -> str | None:
    """Why the rows' attention cannot run from fixed device buffers (StaticAttention), or None when it can: dense, one
    fused qada path (qada_rule) or one page path (page_kind: Quest, QAdA + pages) at one budget for every row, with
    fixed moments, nothing tracked beside."""
    first = rows[0]
    if first.method != "dense" and not qada_rule(first.method)[0] and page_kind(first.method) is None:
        return (f"the {first.method} path decides on the host (dense, the fused qada paths and the page paths run from "
                "fixed buffers)")
    for a in rows:
        # one correction object for every row, as BatchAttention batches them (== would compare its tensors)
        if ((a.method, a.n_sink, a.n_local) != (first.method, first.n_sink, first.n_local)
                or a.inputs.get("calibration") is not first.inputs.get("calibration")):
            return "the rows run different paths"
        if (a.inputs.get("budget"), a.inputs.get("budget_frac")) != (
                first.inputs.get("budget"), first.inputs.get("budget_frac")):
            return "the rows read different page budgets"
        if a.stats.track_oracle:
            return "the oracle's statistics are tracked beside (they read every score on the host)"
        if a.moments is not None and not isinstance(a.moments, FixedMoments):
            return f"the moments change every step ({type(a.moments).__name__})"
    return None  # a row's page index is its path's own: DecodeAttention refuses any other when it is built


@dataclass
class StaticAttention:
    """The decode-time attention of B rows with everything a step reads in fixed-size device buffers, so that the
    step reads no host value that changes and one CUDA graph, captured once, replays every step (gpt-fast's
    decode_one_token, with QAdA inside): each row's quadratic forms, its tau's thresholds, the correction's layers,
    each row's first position, the cache's filled length (model.KVCache's static mode `filled`, advanced by the
    model), and a labels buffer that each step's window kernel writes at a device step index (the kernels'
    `history`) instead of appending to Python lists.

    The qada paths run decode_kernels.fused_qada on views that reach past the filled length (the cache's `view`), T read
    from `length`: a local group's cache is still not read. The page paths run decode_kernels.fused_pages on the same
    views, with every row's page statistics stacked in one buffer per layer (pages.stacked), into which each step's
    window kernel folds the key it appended (fused_pages' `fold`), and the entries each (row, KV head) read counted by
    the kernels into one step's buffer (fused_pages' `read_out`), copied into a record beside the labels once per step.
    Dense (where decode_kernels.fused says the kernel runs; else generate.step_attention gives the model its own dense
    decoding instead of this) runs decode_kernels.fused_dense on the same views, every group read and no decision, its
    labels all False (decode_kernels.dense_flags, made once). BatchAttention's rows keep their statistics: `stats` hands
    each row its live steps once decoding is over."""
    method: str
    n_sink: int
    n_local: int
    rule: str | None
    forms: list  # per layer: (A (B, Hkv, D, D), b (B, Hkv, D)) fp32, each row's Eq. 6 form
    thresholds: tuple  # decode_kernels.kernel_thresholds of the rows' taus, (B,) each
    corrections: list  # per layer: criterion.Correction, or None
    rows: torch.Tensor  # (B,) int32: query b reads cache row b
    start: torch.Tensor  # (B,) int32: each row's first filled position
    length: torch.Tensor  # (1,) int32: the filled length T, the cache's `filled`
    labels: torch.Tensor  # (S, L, B, H) bool: every step's labels, zeros until written
    step: torch.Tensor  # (1,) long: the step being decoded, advanced after the last layer
    pages: list = field(default_factory=list)  # page paths, per layer: (lo, hi) (B, Hkv, NP, D), kept current
    page: dict = field(default_factory=dict)  # page paths: fused_pages' page_size, budget or budget_frac, combine
    reads: torch.Tensor | None = None  # page paths: (S, L, B, Hkv) int64, the KV entries each step read
    # page paths: (L, B, Hkv) int64, this step's, each layer's counted into its row by the kernels (read_out), copied
    # into `reads` after the last layer
    read_now: torch.Tensor | None = None
    flags: tuple = ()  # dense: decode_kernels.dense_flags, one set for every layer and step (left as found)
    # the rest: (B, Hkv) int32 arrival counts at zero, which the kernels leave so for the next layer and step
    arrived: torch.Tensor | None = None

    @classmethod
    def of(cls, rows: list[DecodeAttention], cache, steps: int, n_heads: int) -> "StaticAttention":
        """The buffers of B rows (static_refusal must say None) decoding from `cache` (model.KVCache in static mode:
        its filled length `filled` a device tensor; its rows left-padded from cache.start), for up to `steps` steps."""
        why = static_refusal(rows) or (None if cache.filled is not None else "the cache is not in static mode (fix)")
        if why:
            raise ValueError(f"no static decode step: {why}")
        first, dev, B = rows[0], cache.k.device, len(rows)
        L, Hkv = cache.k.shape[0], cache.k.shape[2]
        kind = page_kind(first.method)
        forms, thresholds, corrections, rule, pages, page, reads, read_now = [], (), [], None, [], {}, None, None
        if first.method != "dense" and kind is not quest:  # the paths that decide: a form and a tau per row
            rule = qada_rule(first.method)[1]
            for layer in range(L):  # one stack per layer, made once: a step only indexes the list
                forms.append(stacked_forms([a.moments.quadratic_form(layer, None) for a in rows], dev))
            thresholds = kernel_thresholds(torch.tensor([a.tau for a in rows], dtype=torch.float64, device=dev))
            calibration = first.inputs.get("calibration")
            corrections = [None if calibration is None else calibration.layer(layer) for layer in range(L)]
        starts = [0] * B if cache.start is None else cache.start.tolist()
        if kind is not None:
            pages = [stacked([a.inputs["pages"] for a in rows], layer, cache.k[layer], starts, cache.length)
                     for layer in range(L)]
            page = page_options(first.method, first.inputs)
            reads = torch.zeros(steps, L, B, Hkv, dtype=torch.long, device=dev)
            read_now = torch.zeros(L, B, Hkv, dtype=torch.long, device=dev)
        flags = dense_flags(B, n_heads, Hkv, dev) if first.method == "dense" else ()
        arrived = None if first.method == "dense" else torch.zeros(B, Hkv, dtype=torch.int32, device=dev)
        return cls(first.method, first.n_sink, first.n_local, rule, forms, thresholds, corrections,
                   torch.arange(B, dtype=torch.int32, device=dev),
                   torch.tensor(starts, dtype=torch.int32, device=dev), cache.filled,
                   torch.zeros(steps, L, B, n_heads, dtype=torch.bool, device=dev),
                   torch.zeros(1, dtype=torch.long, device=dev), pages, page, reads, read_now, flags, arrived)

    def __call__(self, q, k, v, layer: int) -> torch.Tensor:
        """q (B, H, 1, D), k/v (B, Hkv, view, D), views of the static cache past its filled length -> (B, H, 1, D)."""
        y = torch.empty_like(q)
        if self.method == "dense":  # every group read: the labels stay all False
            fused_dense(q[:, :, 0], k, v, self.rows, self.start, length=self.length, flags=self.flags,
                        out=y[:, :, 0])
            if layer == self.labels.shape[1] - 1:
                self.step.add_(1)
            return y
        decide = {}  # QAdA's inputs, for the paths that decide (Quest does not)
        if self.forms:
            decide = dict(form=self.forms[layer], tau=self.thresholds, correction=self.corrections[layer])
        history = (self.labels[:, layer], self.step)  # the window kernel writes the labels at the device step index
        if self.pages:  # the key just appended into its page's statistics, then the chosen pages read
            fused_pages(q[:, :, 0], k, v, self.rows, self.start, self.n_sink, self.n_local, self.pages[layer],
                        **self.page, **decide, length=self.length, fold=True, with_read=True, history=history,
                        read_out=self.read_now[layer], arrived=self.arrived, out=y[:, :, 0])
            if layer == self.labels.shape[1] - 1:  # every layer counted: the step's reads recorded in one copy
                self.reads.index_copy_(0, self.step, self.read_now[None])
        else:
            fused_qada(q[:, :, 0], k, v, self.rows, self.start, self.n_sink, self.n_local, decide["form"],
                       decide["tau"], self.rule, decide["correction"], length=self.length, history=history,
                       arrived=self.arrived, out=y[:, :, 0])  # (B, H, D): written into y in place
        if layer == self.labels.shape[1] - 1:
            self.step.add_(1)
        return y

    def stats(self, rows: list[DecodeAttention], steps: list[int], lengths: list[list[int]]) -> None:
        """Hand row b its first steps[b] steps' labels (and a page path's reads), at the context lengths lengths[b]
        (one read of each buffer): the steps it decoded before it ended; what it decoded after (into a discarded
        slot) is dropped."""
        S = max(steps, default=0)
        labels = self.labels[:S].cpu()  # (S, L, B, H)
        reads = None if self.reads is None else self.reads[:S].cpu()  # (S, L, B, Hkv)
        for b, (a, n) in enumerate(zip(rows, steps)):
            a.stats.extend(labels[:n, :, b], lengths[b][:n], None if reads is None else reads[:n, :, b])


# ---------------------------------------------------------------------------------------------------------
# Statistics


@dataclass
class HeadStats:
    """Labels of every (decode step, layer, query head), and on request the oracle's beside them; the entries read
    per KV head when the path reports them (a page path's third value)."""
    n_local: int = 128
    track_oracle: bool = False
    decision_read: float = 0.0  # KV entries a local group reads beyond its window to decide (attention.decision_read)
    labels: list = field(default_factory=list)  # per step: list over layers of (H,) bool
    oracle: list = field(default_factory=list)
    log_masses: list = field(default_factory=list)  # per step: list over layers of (4, H): oracle_view's
    lengths: list = field(default_factory=list)  # T per step
    reads: list = field(default_factory=list)  # per step: list over layers of (Hkv,) entries read, if reported

    def record(self, layer: int, T: int, labels, oracle_labels=None, log_masses=None, read=None):
        if layer == 0:
            self.labels.append([]), self.oracle.append([]), self.log_masses.append([]), self.lengths.append(T)
            self.reads.append([])
        self.labels[-1].append(labels)
        if oracle_labels is not None:
            self.oracle[-1].append(oracle_labels)
            self.log_masses[-1].append(log_masses)
        if read is not None:
            self.reads[-1].append(read)

    def extend(self, labels: torch.Tensor, lengths: list[int], reads: torch.Tensor | None = None) -> None:
        """Steps recorded elsewhere (StaticAttention's buffers), as record would have kept them: labels (S, L, H), T
        of each step, and the entries read (S, L, Hkv) when the path reports them."""
        for i, (step, T) in enumerate(zip(labels, lengths)):
            self.labels.append(list(step.unbind(0))), self.oracle.append([]), self.log_masses.append([])
            self.reads.append([] if reads is None else list(reads[i].unbind(0))), self.lengths.append(T)

    def label_tensor(self) -> torch.Tensor:
        """(S, L, H) bool on the CPU; S = 0 when no decode step ran (the first token ended the answer)."""
        return stack_steps(self.labels)

    def oracle_tensor(self) -> torch.Tensor:
        return stack_steps(self.oracle)

    def read_tensor(self) -> torch.Tensor | None:
        """(S, L, Hkv) entries read, float64 on the CPU, when the path reported them at every step; else None."""
        if not self.reads or not all(self.reads):
            return None
        return stack_steps(self.reads).double()

    def first(self, n: int) -> "HeadStats":
        """These statistics up to decode step n, the steps after it left out (a row that ended there but was decoded on,
        as transformers decodes a batch's finished rows)."""
        return replace(self, labels=self.labels[:n], oracle=self.oracle[:n], log_masses=self.log_masses[:n],
                       lengths=self.lengths[:n], reads=self.reads[:n])

    def summary(self, n_kv_heads: int) -> dict:
        return summarize(self.label_tensor(), torch.tensor(self.lengths, device="cpu"), n_kv_heads, self.n_local,
                         self.oracle_tensor() if self.track_oracle and self.oracle else None, self.decision_read,
                         self.read_tensor())


def stack_steps(steps: list) -> torch.Tensor:
    """Per step, per layer (H,) tensors -> (S, L, H) on the CPU, (0, 0, 0) bool for no step."""
    if not steps:
        return torch.zeros(0, 0, 0, dtype=torch.bool)
    return torch.stack([torch.stack(step) for step in steps]).cpu()


def kv_read_fraction(labels: torch.Tensor, lengths: torch.Tensor, n_kv_heads: int, n_local: int,
                     decision_read: float = 0.0) -> float:
    """Fraction of KV entries read: a KV head reads its whole cache (T) unless every query head of its
    group is local, then only its window, min(T, n_local), and what deciding read of its bulk (decision_read entries,
    at most the bulk's keys). labels (S, L, H) bool, lengths (S,)."""
    S, L, H = labels.shape
    group_local = labels.view(S, L, n_kv_heads, H // n_kv_heads).all(-1)  # (S, L, Hkv)
    T = lengths.to(labels.device).double()[:, None, None]
    # a decision that reads bulk keys reads at most the bulk's T - n_local keys (half an entry each: no values)
    local_read = n_local + torch.minimum((T - n_local).clamp(min=0) / 2, torch.full_like(T, decision_read))
    read = torch.where(group_local, torch.minimum(T, local_read), T)
    return float(read.sum() / (T * torch.ones_like(read)).sum())


def reported_read_fraction(reads: torch.Tensor, lengths: torch.Tensor) -> float:
    """Fraction of KV entries read from what the path reported, reads (S, L, Hkv) entries, over the S steps' T (S,)
    entries per KV head held."""
    T = lengths.to(reads.device).double()[:, None, None]
    return float(reads.double().sum() / (T * torch.ones_like(reads, dtype=torch.float64)).sum())


def summarize(labels: torch.Tensor, lengths: torch.Tensor, n_kv_heads: int, n_local: int,
              oracle: torch.Tensor | None = None, decision_read: float = 0.0, reads: torch.Tensor | None = None
              ) -> dict:
    """Query-head sparsity, KV-read fraction and per-layer sparsity; agreement counts with the oracle if given. The
    KV read is the paths' own report `reads` (S, L, Hkv) when given, else implied by the labels (kv_read_fraction)."""
    if labels.numel() == 0:
        return {"steps": 0, "sparsity": None, "kv_read": None, "layer_sparsity": []}
    kv_read = (kv_read_fraction(labels, lengths, n_kv_heads, n_local, decision_read) if reads is None
               else reported_read_fraction(reads, lengths))
    out = {"steps": labels.shape[0], "sparsity": float(labels.double().mean()), "kv_read": kv_read,
           "layer_sparsity": labels.float().mean((0, 2)).tolist()}
    if oracle is not None:  # positive = local, as in the paper's appendix C
        out["agreement"] = {"TP": int((labels & oracle).sum()), "FP": int((labels & ~oracle).sum()),
                            "TN": int((~labels & ~oracle).sum()), "FN": int((~labels & oracle).sum())}
    return out
