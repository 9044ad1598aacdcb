"""Page statistics of the keys: per layer, KV head and page of P tokens, the element-wise min and max of its keys, from
which Quest bounds every score in the page (Tang et al. 2024, Quest, arXiv 2406.10774, section 3):

    q . k  <=  sum_d max(q_d min_d, q_d max_d)  =  q+ . max + q- . min        for every key k of the page
                                                 (q+ = max(q, 0), q- = min(q, 0), element-wise)

What the pages cover. Pages tile the positions after the window's sinks, page j = [n_sink + j P, n_sink + (j + 1) P):
the sinks are never in a page, and a page is never cut by them. The index holds every page up to the newest key, the
one being filled included; which pages a path may choose is `candidates`' business: the pages that start in the bulk
[n_sink, T - (n_local - n_sink)). The last of them may reach into the window's recent part (the window moves one
position per decoded token); its bound is over all its keys, a superset of its bulk keys, so still an upper bound, and
when chosen it is read, and counted, for its bulk positions only (`page_positions`): no position is read twice.

Memory: 2 vectors of D per page of P keys per KV head, 2/P of the keys (1/8 at P = 16; 1/P of keys and values), in
the cache's dtype (a min and a max are exact in any dtype). Upkeep: `bounds` calls `update`, which folds in the keys
appended since the last call: the part-filled page in place, then whole pages at once (a prefill's); decoding appends
one key per step, which updates the page being filled in place, O(D).
Decoding from fixed device buffers (a CUDA graph) keeps a batch's statistics in one stacked copy instead (`stacked`,
twice the memory while it decodes), which each step updates on the device (decode_kernels.fused_pages' `fold`: the
window kernel folds the key just appended into its page).

`PageIndex` is an input of the page paths (attention.quest, attention.qada_pages), as moments.KeyMoments is of qada:
built from the prefilled cache, then following the cache from the `k` (Hkv, T, D) it is handed each step.
"""

import math
import numbers

import torch

from moments import bulk_end

PAGE_SIZE = 16  # Quest's page of 16 tokens


class PageIndex:
    """Element-wise min and max of the keys of every page of `page_size` positions after the first `n_sink`, per layer
    and KV head; row `row` of `cache` (a prefilled model.KVCache, that row filled from position 0) folded in at once
    when given, else on the first call."""

    def __init__(self, cache=None, page_size: int = PAGE_SIZE, n_sink: int = 16, row: int = 0):
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.page_size, self.n_sink = page_size, n_sink
        self.lo, self.hi = {}, {}  # per layer: (Hkv, capacity in pages, D), the first `count` positions folded in
        self.count = {}  # per layer: positions [n_sink, count) folded in
        self.capacity = None if cache is None else self.n_pages(cache.max_len)
        if cache is not None:
            for layer in range(cache.k.shape[0]):
                self.update(layer, cache.k[layer, row, :, :cache.length])  # (Hkv, T, D)

    def n_pages(self, T: int) -> int:
        """Pages that hold the positions [n_sink, T): the last one may be part-filled (pages_upto)."""
        return pages_upto(T, self.n_sink, self.page_size)

    def update(self, layer: int, k: torch.Tensor) -> None:
        """Fold in the keys of k (Hkv, T, D) at the positions not yet folded in: first those of the part-filled page,
        in place, then whole pages, then a new part-filled page."""
        P, T = self.page_size, k.shape[1]
        have = self.count.get(layer, self.n_sink)
        if T < have and have > self.n_sink:
            raise ValueError(f"the KV cache holds {T} positions, fewer than the {have} this page index folded in "
                             "(rolled back?); make a new PageIndex")
        if T <= have:
            return
        self._reserve(layer, k, self.n_pages(T))
        lo, hi = self.lo[layer], self.hi[layer]
        pos = have
        if (pos - self.n_sink) % P:  # the page being filled: its min and max updated in place, O(D) per key
            j = (pos - self.n_sink) // P
            end = min(T, self.n_sink + (j + 1) * P)
            lo[:, j] = torch.minimum(lo[:, j], k[:, pos:end].amin(1))
            hi[:, j] = torch.maximum(hi[:, j], k[:, pos:end].amax(1))
            pos = end
        if pos < T:  # whole pages at once (prefill), then what is left starts a new page
            j, n_full = (pos - self.n_sink) // P, (T - pos) // P
            if n_full:
                pages = k[:, pos:pos + n_full * P].unflatten(1, (n_full, P))  # (Hkv, n_full, P, D)
                lo[:, j:j + n_full], hi[:, j:j + n_full] = pages.amin(2), pages.amax(2)
                pos, j = pos + n_full * P, j + n_full
            if pos < T:
                lo[:, j], hi[:, j] = k[:, pos:T].amin(1), k[:, pos:T].amax(1)
        self.count[layer] = T

    def _reserve(self, layer: int, k: torch.Tensor, n: int) -> None:
        """Room for n pages in layer's tensors: allocated for the cache's length when known, doubled when outgrown."""
        held = self.lo[layer].shape[1] if layer in self.lo else 0
        if n <= held:
            return
        size = max(n, self.capacity or 0, 2 * held)
        Hkv, _, D = k.shape
        lo = torch.full((Hkv, size, D), math.inf, dtype=k.dtype, device=k.device)
        hi = torch.full((Hkv, size, D), -math.inf, dtype=k.dtype, device=k.device)
        if held:
            lo[:, :held], hi[:, :held] = self.lo[layer], self.hi[layer]
        self.lo[layer], self.hi[layer] = lo, hi

    def bounds(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The min and max (Hkv, n_pages(T), D) of every page of the layer's cache k (Hkv, T, D), brought up to date."""
        self.update(layer, k)
        if layer not in self.lo:  # no page yet: the context ends within the sinks
            empty = k.new_zeros(k.shape[0], 0, k.shape[2])
            return empty, empty
        n = self.n_pages(k.shape[1])
        return self.lo[layer][:, :n], self.hi[layer][:, :n]


def stacked(indexes: list[PageIndex], layer: int, k: torch.Tensor, start: list[int], T: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The min and max keys of B rows' page indexes, (B, Hkv, NP, D) each, for a cache k (B, Hkv, capacity, D) whose
    row b is filled over [start[b], T) (NP: the capacity's pages): row b's index brought up to date with its keys
    (PageIndex.bounds), then empty pages (min +inf, max -inf), which decoding fills in place
    (decode_kernels.fused_pages' `fold`). Fixed-size buffers that a captured decode step updates and reads
    (attention.StaticAttention); the rows' own indexes are not kept current meanwhile (a later eager call catches them
    up from where they stopped)."""
    B, Hkv, capacity, D = k.shape
    lo = torch.full((B, Hkv, indexes[0].n_pages(capacity), D), math.inf, dtype=k.dtype, device=k.device)
    hi = torch.full_like(lo, -math.inf)
    for b, index in enumerate(indexes):
        row_lo, row_hi = index.bounds(layer, k[b, :, start[b]:T])  # (Hkv, n, D)
        lo[b, :, :row_lo.shape[1]], hi[b, :, :row_hi.shape[1]] = row_lo, row_hi
    return lo, hi


def upper_bounds(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Quest's bound on every score of each page, sum_d max(q_d lo_d, q_d hi_d), for queries q (H, D) and the pages'
    min and max (Hkv, n, D) shared by the G = H / Hkv query heads of a KV head: (H, n) in fp32, unscaled (the bound on
    q . k, not on q . k / sqrt(D): the ranking is the same). Written as two products, q+ . max + q- . min, so each
    page's statistics are read once for the group, with no (G, n, D) temporary."""
    Hkv, n, D = lo.shape
    qg = q.float().view(Hkv, -1, D)  # (Hkv, G, D)
    out = torch.bmm(qg.clamp(min=0), hi.float().transpose(1, 2))  # (Hkv, G, n)
    return out.baddbmm_(qg.clamp(max=0), lo.float().transpose(1, 2)).view(-1, n)


def page_shares(bounds: torch.Tensor, log_local: torch.Tensor, page_size: int, scale: float) -> torch.Tensor:
    """The `share` combination's per-head score: the log of the share of its attention each head could give a page,
    were every score of the page at its bound, against the window's true mass plus every page at its bound. bounds
    (n, G, m) on q . k (upper_bounds), log_local (n, G) the window's log mass, scale 1 / sqrt(D). Ranking a group's
    pages by the max of these asks which page some head needs most, each head on its own scale: a head whose window
    holds its mass, or whose logits are large on every page, does not crowd out a retrieval head's few pages, as it can
    under the max of the raw bounds."""
    log_mass = bounds * scale + math.log(page_size)  # (n, G, m): each page's mass, were its P scores at the bound
    total = torch.logaddexp(log_local, log_mass.logsumexp(-1))  # (n, G)
    return log_mass - total[..., None]


def group_ranking(bounds: torch.Tensor, combine: str, log_local: torch.Tensor, page_size: int, scale: float
                  ) -> torch.Tensor:
    """One ranking of pages per group from its heads' bounds (n, G, m): their max, their sum, or ("share") the max of
    page_shares against the heads' window log masses log_local (n, G). (n, m)."""
    if combine == "share":
        bounds = page_shares(bounds, log_local, page_size, scale)
    return bounds.sum(1) if combine == "sum" else bounds.amax(1)


def pages_upto(T: int, n_sink: int, page_size: int) -> int:
    """Pages that hold the positions [n_sink, T) of a context: the last one may be part-filled."""
    return math.ceil(max(T - n_sink, 0) / page_size)


def candidates(T: int, n_sink: int, n_local: int, page_size: int) -> int:
    """How many pages a path may choose from in a context of T: those that start in the bulk (0 when there is none)."""
    return math.ceil(max(bulk_end(T, n_sink, n_local) - n_sink, 0) / page_size)


def page_count(T: int, page_size: int, budget: float | None, budget_frac: float | None) -> int:
    """Pages a head (or a long-context group) reads beyond its window: budget // P, the budget given in tokens
    (`budget`) or as a fraction of the context (`budget_frac`: floor(budget_frac T) tokens). Exactly one is given."""
    if (budget is None) == (budget_frac is None):
        raise ValueError("give a page budget in tokens (budget) or as a fraction of the context (budget_frac), "
                         f"one of them; got budget={budget}, budget_frac={budget_frac}")
    number = budget if budget is not None else budget_frac
    if isinstance(number, bool) or not isinstance(number, numbers.Real):  # --set budget=true or =abc: no number
        raise ValueError(f"{'budget' if budget is not None else 'budget_frac'} is a number, got {number!r}")
    if budget is not None:
        if not (float(budget).is_integer() and budget >= 0):
            raise ValueError(f"budget is a number of tokens >= 0, got {budget}")
        return int(budget) // page_size
    if not 0 <= budget_frac <= 1:
        raise ValueError(f"budget_frac is a fraction of the context in [0, 1], got {budget_frac}")
    return math.floor(budget_frac * T) // page_size


def page_positions(pages: torch.Tensor, T: int, n_sink: int, n_local: int, page_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache positions of pages (..., m) (page numbers) and which of them to read (..., m P) bool: a page's
    positions in the bulk, so none of the window's recent part (the last candidate may reach into it) is read twice.
    Positions not to read are clamped into the cache, so that a gather stays in bounds, and the mask leaves them
    out of the attention and of the entries counted as read (the torch paths gather them with the rest; the
    kernel's masked loads skip them)."""
    offset = torch.arange(page_size, device=pages.device)
    pos = (n_sink + pages[..., None] * page_size + offset).flatten(-2)  # (..., m P)
    return pos.clamp(max=T - 1), pos < bulk_end(T, n_sink, n_local)
