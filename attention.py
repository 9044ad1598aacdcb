"""Decode-time attention paths: dense, local, oracle, static and QAdA (paper sections 2-3, Listing 1).

Every path has one signature, `path(q, k, v, ctx) -> (y, local)`, for one layer and one decoded token of
batch size 1: q (H, D) is the rotated query, k and v (Hkv, T, D) are the layer's filled KV cache, y (H, D)
is the attention output and local (H,) bool the label (True = the head attended to its local window only).
`SparseAttention` picks the path in one place and is what the model calls for each decode step.

The savings are real: `mixed_attention` computes the window attention for every head (it is tiny), and full
attention only for the long-context heads, reading a KV head's full cache only when at least one query head
of its group needs it. `reference_attention` is the explicit fp32 computation the tests hold it against.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from criterion import (check_tau, gaussian_log_bulk, oracle_labels, oracle_log_masses, qada_labels, window_mask,
                       window_slices)


@dataclass
class LayerContext:
    """What a path may need besides q, k, v."""
    layer: int
    n_sink: int
    n_local: int
    tau: float
    moments: object | None = None  # .layer(layer, k) -> (mean, cov); .gaussian(layer, k) -> (A, b): moments.py
    static_local: torch.Tensor | None = None  # (L, H) bool, for static


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_sink: int, n_local: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (H, D) over the local window of the cache k, v (Hkv, T, D): output (H, D), scores (H, W).

    The window is read in place as its two slices, sinks and recent tokens, each a view of the cache: only
    the (H, W) scores are concatenated, never keys or values."""
    H, D = q.shape
    Hkv = k.shape[0]
    qg = q.view(Hkv, H // Hkv, D)  # (Hkv, G, D)
    parts = window_slices(k.shape[1], n_sink, n_local)
    # torch.bmm (not @, whose reshapes cost more than the product at these sizes) and the scale in place
    scores = [torch.bmm(qg, k[:, s].transpose(1, 2)) for s in parts]  # (Hkv, G, W_part) each
    scores = (torch.cat(scores, -1) if len(scores) > 1 else scores[0]).float().mul_(1 / math.sqrt(D))
    p = scores.softmax(-1).to(v.dtype)  # (Hkv, G, W)
    y, start = None, 0
    for s in parts:
        p_part, start = p[..., start:start + s.stop - s.start], start + s.stop - s.start
        y = torch.bmm(p_part, v[:, s]) if y is None else y.baddbmm_(p_part, v[:, s])  # (Hkv, G, D)
    return y.view(H, D), scores.view(H, -1)


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of q (n, G, D) over n KV heads' whole caches k, v (n, T, D): (n, G, D).

    The G query heads of a group are handed to SDPA as G query positions of one head, so each KV head is
    read once (SDPA with enable_gqa reads it once per query head). k and v are views of the cache: SDPA
    reads them in place, nothing is copied. No mask: the decoded token sees every cached position.
    SDPA on the CPU shares its work out by heads, so a lone KV head would keep one thread busy and the
    others idle; it is computed instead as two matrix products, which BLAS spreads over every thread."""
    if q.shape[0] == 1 and q.device.type == "cpu" and torch.get_num_threads() > 1:
        scores = torch.mm(q[0], k[0].T).float().mul_(1 / math.sqrt(q.shape[-1]))  # (G, T)
        return torch.mm(scores.softmax(-1).to(v.dtype), v[0])[None]  # (1, G, D)
    return F.scaled_dot_product_attention(q[None], k[None], v[None])[0]  # (1, n, G, D) -> (n, G, D)


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive True flags: [T, T, F, T] -> [(0, 2), (3, 4)]."""
    runs = []
    for i, flag in enumerate(flags):
        if flag and runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        elif flag:
            runs.append((i, i + 1))
    return runs


def mixed_attention(q, k, v, local, n_sink, n_local, y_window=None):
    """Window attention for heads labelled local, full attention for the others; only the needed KV heads are read.

    q (H, D), k/v (Hkv, T, D), local (H,) bool; y_window (H, D), the window output if already computed.
    A KV head is read in full when any query head of its group is long-context; consecutive such KV heads
    share one SDPA call on a slice of the cache (a view, never a copy)."""
    H, D = q.shape
    Hkv, T, _ = k.shape
    G = H // Hkv
    if y_window is None:
        y_window, _ = window_attention(q, k, v, n_sink, n_local)
    if T <= n_local:
        return y_window
    is_local = local.tolist()  # the one host sync per layer: the labels decide what is read
    runs = _runs([not all(is_local[g * G:(g + 1) * G]) for g in range(Hkv)])
    if not runs:
        return y_window
    y = y_window.clone()
    qg, yg = q.view(Hkv, G, D), y.view(Hkv, G, D)  # (Hkv, G, D)
    for a, b in runs:
        yg[a:b] = full_attention(qg[a:b], k[a:b], v[a:b])
    if any(any(is_local[a * G:b * G]) for a, b in runs):
        y = torch.where(local[:, None], y_window, y)  # local heads of a group read in full keep the window
    return y


def reference_attention(q, k, v, local, n_sink, n_local):
    """The same result computed plainly in fp32: every score, window heads masked to the window."""
    H, D = q.shape
    Hkv, T, _ = k.shape
    in_window = window_mask(T, n_sink, n_local, q.device)
    keep = in_window[None, :] | ~local[:, None]  # (H, T)
    weights = all_scores(q, k).masked_fill(~keep, -math.inf).softmax(-1)  # (H, T)
    return torch.bmm(weights.view(Hkv, H // Hkv, T), v.float()).view(H, D)


# ---------------------------------------------------------------------------------------------------------
# The paths


def dense(q, k, v, ctx: LayerContext):
    y = F.scaled_dot_product_attention(q[None, :, None], k[None], v[None], enable_gqa=True)  # (1, H, 1, D)
    return y[0, :, 0], torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)


def local(q, k, v, ctx: LayerContext):
    y, _ = window_attention(q, k, v, ctx.n_sink, ctx.n_local)
    return y, torch.ones(q.shape[0], dtype=torch.bool, device=q.device)


def all_scores(q, k):
    """Every score s = q K^T / sqrt(d) in fp32, (H, T): what the oracle (analysis only) needs. A group's query
    heads share one product with their KV head (no per-head copy of the keys)."""
    Hkv, T, D = k.shape
    qg = q.float().view(Hkv, -1, D)  # (Hkv, G, D)
    return torch.bmm(qg, k.float().transpose(1, 2)).view(-1, T) / math.sqrt(D)


def oracle(q, k, v, ctx: LayerContext):
    """Eq. 2 needs every score, so this path saves nothing: it is for analysis."""
    scores = all_scores(q, k)
    labels = oracle_labels(scores, ctx.n_sink, ctx.n_local, ctx.tau)
    return reference_attention(q, k, v, labels, ctx.n_sink, ctx.n_local).to(q.dtype), labels


def static(q, k, v, ctx: LayerContext):
    labels = ctx.static_local[ctx.layer].to(q.device)
    return mixed_attention(q, k, v, labels, ctx.n_sink, ctx.n_local), labels


def qada(q, k, v, ctx: LayerContext):
    """Listing 1: window scores, the Gaussian bulk estimate, then full attention for long-context heads only."""
    y_window, window_scores = window_attention(q, k, v, ctx.n_sink, ctx.n_local)
    form = ctx.moments.gaussian(ctx.layer, k)  # Eq. 6's (A, b): q A q^T + q b = mu_s + sigma_s^2 / 2
    labels = qada_labels(q, window_scores, form, k.shape[1], ctx.n_local, ctx.tau)
    return mixed_attention(q, k, v, labels, ctx.n_sink, ctx.n_local, y_window), labels


PATHS = {"dense": dense, "local": local, "oracle": oracle, "static": static, "qada": qada}


# ---------------------------------------------------------------------------------------------------------
# Statistics


@dataclass
class HeadStats:
    """Labels of every (decode step, layer, query head), and on request the oracle's beside them."""
    n_local: int = 128
    track_oracle: bool = False
    labels: list = field(default_factory=list)  # per step: list over layers of (H,) bool
    oracle: list = field(default_factory=list)
    log_masses: list = field(default_factory=list)  # per step: list over layers of (3, H): local, bulk, gaussian
    lengths: list = field(default_factory=list)  # T per step

    def record(self, layer: int, T: int, local, oracle_local=None, log_masses=None):
        if layer == 0:
            self.labels.append([]), self.oracle.append([]), self.log_masses.append([]), self.lengths.append(T)
        self.labels[-1].append(local)
        if oracle_local is not None:
            self.oracle[-1].append(oracle_local)
            self.log_masses[-1].append(log_masses)

    def label_tensor(self) -> torch.Tensor:
        """(S, L, H) bool on the CPU."""
        return torch.stack([torch.stack(step) for step in self.labels]).cpu()

    def oracle_tensor(self) -> torch.Tensor:
        return torch.stack([torch.stack(step) for step in self.oracle]).cpu()

    def summary(self, n_kv_heads: int) -> dict:
        return summarize(self.label_tensor(), torch.tensor(self.lengths), n_kv_heads, self.n_local,
                         self.oracle_tensor() if self.track_oracle and self.oracle else None)


def kv_read_fraction(labels: torch.Tensor, lengths: torch.Tensor, n_kv_heads: int, n_local: int) -> float:
    """Fraction of KV entries read: a KV head reads its whole cache (T) unless every query head of its
    group is local, then only min(T, n_local). labels (S, L, H) bool, lengths (S,)."""
    S, L, H = labels.shape
    group_local = labels.view(S, L, n_kv_heads, H // n_kv_heads).all(-1)  # (S, L, Hkv)
    T = lengths.double()[:, None, None]
    read = torch.where(group_local, T.clamp(max=n_local), T)
    return float(read.sum() / (T * torch.ones_like(read)).sum())


def summarize(labels: torch.Tensor, lengths: torch.Tensor, n_kv_heads: int, n_local: int,
              oracle: torch.Tensor | None = None) -> dict:
    """Query-head sparsity, KV-read fraction and per-layer sparsity; agreement counts with the oracle if given."""
    if labels.numel() == 0:
        return {"steps": 0, "sparsity": None, "kv_read": None, "layer_sparsity": []}
    out = {"steps": labels.shape[0], "sparsity": float(labels.double().mean()),
           "kv_read": kv_read_fraction(labels, lengths, n_kv_heads, n_local),
           "layer_sparsity": labels.float().mean((0, 2)).tolist()}
    if oracle is not None:  # positive = local, as in the paper's appendix C
        out["agreement"] = {"TP": int((labels & oracle).sum()), "FP": int((labels & ~oracle).sum()),
                            "TN": int((~labels & ~oracle).sum()), "FN": int((~labels & oracle).sum())}
    return out


# ---------------------------------------------------------------------------------------------------------


@dataclass
class SparseAttention:
    """The decode-time attention the model calls: `method` chooses the path for every layer."""
    method: str = "qada"
    tau: float = 0.6
    n_sink: int = 16
    n_local: int = 128  # window size T_local, sinks included
    moments: object | None = None
    static_local: torch.Tensor | None = None
    stats: HeadStats | None = None

    def __post_init__(self):
        if self.method not in PATHS:
            raise ValueError(f"unknown method {self.method!r}; choose from {', '.join(PATHS)}")
        check_tau(self.tau)
        if not 0 <= self.n_sink < self.n_local:
            raise ValueError(f"need 0 <= n_sink < n_local, got n_sink={self.n_sink}, n_local={self.n_local}")
        if self.method == "qada" and self.moments is None:
            raise ValueError("qada needs key moments (moments.py)")
        if self.method == "static" and self.static_local is None:
            raise ValueError("static needs labels (criterion.static_labels)")
        if self.stats is None:
            self.stats = HeadStats(self.n_local)

    def __call__(self, q, k, v, layer: int) -> torch.Tensor:
        """q (1, H, 1, D), k/v (1, Hkv, T, D) -> (1, H, 1, D)."""
        if q.shape[0] != 1:
            raise ValueError("sparse decoding supports batch size 1")
        _, H, _, D = q.shape
        q1, k1, v1 = q.view(H, D), k.squeeze(0), v.squeeze(0)
        ctx = LayerContext(layer, self.n_sink, self.n_local, self.tau, self.moments, self.static_local)
        y, labels = PATHS[self.method](q1, k1, v1, ctx)
        oracle_local = log_masses = None
        if self.stats.track_oracle:  # analysis: every score, the true masses beside the Gaussian estimate
            oracle_local, log_masses = self.oracle_view(q1, k1, ctx)
        self.stats.record(layer, k1.shape[1], labels, oracle_local, log_masses)
        return y.view(1, H, 1, D)

    def oracle_view(self, q, k, ctx):
        scores = all_scores(q, k)
        log_local, log_bulk = oracle_log_masses(scores, ctx.n_sink, ctx.n_local)
        labels = oracle_labels(scores, ctx.n_sink, ctx.n_local, ctx.tau)
        T = k.shape[1]
        if ctx.moments is not None and T > ctx.n_local:
            mean, cov = ctx.moments.layer(ctx.layer, k)
            log_gauss = gaussian_log_bulk(q, mean, cov, T - ctx.n_local)
        else:
            log_gauss = torch.full_like(log_local, math.nan)
        return labels, torch.stack([log_local, log_bulk, log_gauss])
