"""QAdA's decode step fused on the GPU: the decision and its skipping in two Triton kernels per layer, for a batch of
rows, with nothing read back to the host (the same labels and output as attention.qada, up to fp32 rounding).

Two kernels, each a fixed grid:
  1. per (row, KV head), `_window_decide_kernel`: the window's attention and log mass for the G query heads together,
     Eq. 6's Gaussian term, the calibration's correction, the threshold of Eq. 7, and the group's flag "read the cache";
     it writes the output of every head whose output is its window's (the local ones), so a local group is done here
     (with WINDOW_LAUNCH's FORM_APART, per (row, KV head, part): the window and slices of the form side by side);
  2. per (row, KV head, split of the context), `_split_attention_kernel`: flash-decoding's partial attention, a program
     returning at once when its group reads no cache (every head local), so that group's cache is never read. The
     merge of the splits by their log-sum-exp has no launch of its own: the group's last split program to finish
     does it (a count per group, taken atomically), and writes the long-context heads' output.

`fused_dense` is dense decoding in the split kernel alone, every group read (the static decode loop's dense step).

`fused_pages` is token-level page selection (attention.quest, attention.qada_pages) in the same kernels: QAdA's
long-context groups, or every group for Quest alone, read their window and their chosen pages only. A third kernel,
`_page_bound_kernel`, scores the candidate pages by Quest's bound from the page statistics (pages.PageIndex); a
fourth, `_page_select_kernel`, picks the top ones under the budget and makes each KV head's list of them (for Quest,
whose query heads choose their own, their union); the split programs then walk a list of page numbers instead of a
range.
The step's upkeep rides in the same launches: the window kernel folds the key just appended into its page's
statistics, and the kernels count the KV entries they load.

The kernels read the filled length T and each row's first position from device memory, and their grids and
compile-time constants depend on the cache's capacity only (fused_qada's `length`), and the page budget: one step
captured in a CUDA graph can be replayed as the cache fills, with T a device tensor advanced in place.

`fused` says when the qada and page paths take it (attention.run_path, attention.BatchAttention). Triton is optional:
CUDA builds of torch bring it, and the torch paths need nothing of it. On CPU tensors the kernels run under Triton's
interpreter (TRITON_INTERPRET=1, read when they are defined), which is how the tests run them
(tests/test_kernel.py, tests/test_kernel_pages.py). The interpreter says nothing of registers: a change to a kernel
is compiled for the GPU too, `python -m lab.kernel_resources` with the GPU machine's Triton, its table held to
results/bench-gpu/kernel_resources.md: one more reduction in a kernel can push a launch the benchmark times into
spills.

The file is not kernels.py: that is the import name of Hugging Face's `kernels` package, which transformers imports,
and a module of that name here would take its place (tests/test_layout.py).
"""

import math
import os
import struct

import torch

try:  # the fused kernel's compiler: optional, CUDA builds of torch bring it; the torch paths need nothing of it
    import triton
    import triton.language as tl
except ImportError:
    triton = None
try:  # programmatic dependent launch (SM90 and later; SPLIT_LAUNCH's PDL), absent from older Triton
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter runs the kernels (the tests)

from criterion import GROUP_RULES, Correction, bulk_cap, tau_logit
from pages import candidates, group_ranking, page_count, pages_upto

RULES = {None: 0, "mean": 1, "all": 2}  # criterion.local_labels' rules, as the kernel's constexpr
assert set(RULES) == {None, *GROUP_RULES}
# How the window kernel is launched: warps per program, the loads its loops keep in flight (num_stages, Triton's
# default; 1: none ahead), its tiles (window positions, columns of the quadratic form; capped by the
# window and the head dim), tl.dot's precision for the fp32 quadratic form ("ieee": exact fp32 products), LOW, how
# many times its two loops are unrolled (1: not), whether the form (Eq. 6) is computed before the window rather
# than after it (FORM_FIRST), or beside it by programs of its own, one per BLOCK_D columns (FORM_APART: the two
# halves of the kernel's time at once, on multiprocessors that the small grids of batch 1 and 8 leave idle);
# lab.bench_gpu --parts kernels times the alternatives beside it and lab.kernel_resources says the registers each
# takes.
WINDOW_LAUNCH = dict(num_warps=4, num_stages=3, BLOCK_W=32, BLOCK_D=32, PRECISION="ieee", LOW=True, UNROLL=1,
                     FORM_FIRST=False, FORM_APART=False)
# LOW: with a bf16 or fp16 query and cache, the window's products (WINDOW_LAUNCH) and the page bounds' (BOUND_LAUNCH)
# on tensor cores in the stored dtype, in place of "ieee" fp32 products that do not use them (on an H200 the window
# kernel took 33-35 us at 32k so, 10-12 us with LOW). The products are exact in fp32 either way; their sums are not
# in the same order nor IEEE-rounded at each step, and the window's p is rounded to the cache's dtype for the values,
# so a label or a page within fp32 rounding of its threshold may flip. The GPU suite holds the labels and the chosen
# pages to the torch paths' with it on (bf16 tests) and off (fp32 tests, where it does not apply).
BOUND_LAUNCH = dict(num_warps=4, LOW=True)
# How the split kernel is launched: the positions of a tile (block_n's default), warps per program, the depth of
# Triton's software pipeline over the tiles (Triton's own defaults), and PDL: programmatic dependent launch (Hopper
# and later), the split grid scheduled while the window kernel before it still runs, each program waiting
# (griddepcontrol.wait) for the window kernel's writes before it reads the decision: the gap between the two launches
# gone from the step; and SPREAD: the grid's programs dealt out to the long-context groups alone (fused_qada and
# fused_dense's contiguous ranges), so that a step where few groups read cuts each of them finer, into up to SPREAD
# times the splits of a fixed split size (0: the fixed splits). lab.bench_gpu --parts kernels times the others.
SPLIT_LAUNCH = dict(BLOCK_N=64, num_warps=4, num_stages=3, PDL=False, SPREAD=0)
MERGE_CHUNK = 8  # the split results a group's merge loads at once (the split kernel's epilogue)
LAUNCHES = {"window": WINDOW_LAUNCH, "bound": BOUND_LAUNCH, "split": SPLIT_LAUNCH}


def set_launch(changes: dict) -> None:
    """Launch the kernels otherwise from now on: changes {"window" | "bound" | "split": {key: value}} into LAUNCHES'
    configs, checked first (check_launch: nothing changes if it raises). How a GPU session times and tests a launch
    before it becomes the default (tests/conftest.py's QADA_TEST_LAUNCH, lab.bench_gpu's --launch)."""
    check_launch(changes)
    for name, change in changes.items():
        LAUNCHES[name].update(change)


def check_launch(changes) -> None:
    """ValueError unless `changes` is a launch change set_launch takes: names of LAUNCHES, each with keys its config
    has and values of their types."""
    if not isinstance(changes, dict):
        raise ValueError(f"a launch change is a mapping of {', '.join(LAUNCHES)} to changes; got {changes!r}")
    for name, change in changes.items():
        config = LAUNCHES.get(name)
        if config is None:
            raise ValueError(f"a launch change names {', '.join(LAUNCHES)}; got {name!r}")
        if not isinstance(change, dict) or not set(change) <= set(config):
            raise ValueError(f"the {name} launch takes {', '.join(config)}; got {change}")
        for key, value in change.items():
            if type(value) is not type(config[key]):
                raise ValueError(f"the {name} launch's {key} takes a {type(config[key]).__name__}, got {value!r}")


def kernel_choice() -> str:
    """QADA_KERNEL, checked: auto (the default, also when set empty), triton or torch (see fused)."""
    choice = os.environ.get("QADA_KERNEL") or "auto"
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"QADA_KERNEL takes auto, triton or torch; got {choice!r}")
    return choice


def check_kernel(asked: str = "QADA_KERNEL=triton") -> None:
    """QADA_KERNEL checked where a command or the Hugging Face adapter starts, before anything loads (fused reads it
    at every step): ValueError with one line when it names no choice, or asks for the kernel where it cannot run
    (`asked`: how it was asked for, --kernel triton on generate's command line)."""
    if kernel_choice() != "triton":
        return
    if triton is None:
        raise ValueError(f"{asked}: triton is not installed (pip install triton)")
    if not torch.cuda.is_available() and not INTERPRETED:
        raise ValueError(f"{asked}: no CUDA; on the CPU the kernel runs only under Triton's interpreter "
                         "(TRITON_INTERPRET=1)")


def fused(q: torch.Tensor) -> bool:
    """Whether the qada paths, the page paths and the static loop's dense take the fused kernels: QADA_KERNEL=triton
    forces it (on CPU tensors it needs Triton's interpreter, TRITON_INTERPRET=1), QADA_KERNEL=torch forces the torch
    path, and auto (the default) takes the kernel on CUDA tensors when triton is installed."""
    choice = kernel_choice()
    if choice == "triton" and triton is None:
        raise RuntimeError("QADA_KERNEL=triton, but triton is not installed (pip install triton)")
    D = q.shape[-1]
    kernel_dim = D >= 16 and D & (D - 1) == 0  # tl.dot's smallest tile and tl.arange's powers of two
    if choice == "triton" and not kernel_dim and not INTERPRETED:
        raise ValueError(f"QADA_KERNEL=triton: the kernel takes head dims that are powers of two from 16, not {D}")
    return choice == "triton" or (choice == "auto" and q.is_cuda and triton is not None and kernel_dim)


if triton is not None:

    @triton.jit
    def _form_columns(q, q_rows, h_ok, A, b, g, j0, sab, sah, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      PRECISION: tl.constexpr):
        # BLOCK_D columns from j0 of Eq. 6's quadratic term, q A[:, j] . q[:, j] for a group's heads (G_PAD,); q
        # (G_PAD, D) fp32, q_rows its heads' rows in memory
        d = tl.arange(0, D)
        j = j0 + tl.arange(0, BLOCK_D)
        a_cols = tl.load(A + b * sab + g * sah + d[:, None] * D + j[None, :])  # (D, BLOCK_D) fp32
        q_j = tl.load(q_rows + j[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)  # (G_PAD, BLOCK_D)
        return tl.sum(tl.dot(q, a_cols, input_precision=PRECISION) * q_j, 1)

    @triton.jit
    def _bulk_exponent(q, q_rows, h_ok, A, BV, CS, SUMS, b, g, sab, sah, sbb, sbh, D: tl.constexpr,
                       BLOCK_D: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr, UNROLL: tl.constexpr,
                       FROM_PARTS: tl.constexpr = False):
        # Eq. 6 for a group's heads, q A q^T + q b (G_PAD,), its quadratic term summed BLOCK_D columns at a time in
        # column order: computed here, or with FROM_PARTS read back, each BLOCK_D columns' sum from its own
        # program (WINDOW_LAUNCH's FORM_APART), at SUMS (G_PAD,) pointers to each head's D // BLOCK_D sums. The same
        # additions in the same order either way: the same bits. The small loads first, so that their reads overlap
        # the form's.
        d = tl.arange(0, D)
        bv = tl.load(BV + b * sbb + g * sbh + d)
        scale = 1.0
        if HAS_SCALE:  # the variance term (q A q^T: A is Sigma / 2D) scaled per KV head
            scale = tl.load(CS + g)
        quad = tl.zeros((q.shape[0],), tl.float32)
        if FROM_PARTS:
            for c in tl.static_range(D // BLOCK_D):
                quad += tl.load(SUMS + c, mask=h_ok, other=0.0, cache_modifier=".cg")  # from L2, not a stale L1
        else:
            for j0 in tl.range(0, D, BLOCK_D, loop_unroll_factor=UNROLL):
                quad += _form_columns(q, q_rows, h_ok, A, b, g, j0, sab, sah, D, BLOCK_D, PRECISION)
        return quad * scale + tl.sum(q * bv[None, :], 1)

    @triton.jit
    def _softmax_block(q, kt, vt, keep, m, l_sum, acc, sm_scale, LOW: tl.constexpr, PRECISION: tl.constexpr,
                       EMPTY_OK: tl.constexpr):
        # One tile of the online softmax that both attention loops run: the scores of q (G_PAD, D) against keys kt
        # (BLOCK, D) where keep (G_PAD or 1, BLOCK) says, folded into the running max m, sum l_sum (G_PAD,) and output
        # acc (G_PAD, D), fp32, with the tile's values vt; returns the three. LOW (a bf16 / fp16 query and cache):
        # tensor-core products of the stored values, exact in fp32, and p rounded to the values' dtype, as flash
        # attention does; else fp32 products at PRECISION ("ieee": exact, not TF32). EMPTY_OK: a head may have no
        # score yet (a list of pages), so the exponents are taken against 0, not -inf - -inf = NaN.
        if LOW:
            s = tl.dot(q, tl.trans(kt)) * sm_scale  # (G_PAD, BLOCK)
        else:
            s = tl.dot(q, tl.trans(kt.to(tl.float32)), input_precision=PRECISION) * sm_scale
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = m_new
        if EMPTY_OK:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_use)
        p = tl.exp(s - m_use[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if LOW:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision=PRECISION)
        return m_new, l_sum, acc

    @triton.jit
    def _window_attention(q, q_stored, K, V, Y_WIN, LOG_LOCAL, b, g, h, h_ok, row, start, T, n_ctx, sm_scale, skb, skh,
                          skt, svb, svh, svt, H: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                          N_SINK: tl.constexpr, N_LOCAL: tl.constexpr, W_PAD: tl.constexpr, BLOCK_W: tl.constexpr,
                          PRECISION: tl.constexpr, LOW: tl.constexpr, UNROLL: tl.constexpr):
        # A group's attention to its window, the first N_SINK and the last N_LOCAL - N_SINK positions (or the whole
        # context if shorter), in blocks of BLOCK_W with a running softmax: small tiles keep the program in registers.
        # LOW (WINDOW_LAUNCH's, where the query and cache are one 16-bit dtype) and PRECISION as _softmax_block
        # says, the split kernel's products; either way the labels are the torch path's up to how the sums are
        # ordered and rounded. Its output and log mass written to Y_WIN and LOG_LOCAL (G_PAD, D), (G_PAD,), and
        # returned.
        d = tl.arange(0, D)
        short = n_ctx <= N_LOCAL
        m = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_sum = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D), tl.float32)
        q_dot = q  # the scores' query: fp32, or the stored one where the products run on tensor cores
        if LOW:
            q_dot = q_stored
        # UNROLL (WINDOW_LAUNCH's): this loop's and the form's unrolled so many times, their loads issued together
        for w0 in tl.range(0, W_PAD, BLOCK_W, loop_unroll_factor=UNROLL):  # block 0 holds position 0: m finite
            w = w0 + tl.arange(0, BLOCK_W)
            pos = tl.where(short | (w < N_SINK), start + w, T - N_LOCAL + w)
            w_ok = tl.where(short, w < n_ctx, w < N_LOCAL)
            kw = tl.load(K + row * skb + g * skh + pos[:, None] * skt + d[None, :], mask=w_ok[:, None], other=0.0)
            vw = tl.load(V + row * svb + g * svh + pos[:, None] * svt + d[None, :], mask=w_ok[:, None], other=0.0)
            m, l_sum, acc = _softmax_block(q_dot, kw, vw, w_ok[None, :], m, l_sum, acc, sm_scale, LOW, PRECISION,
                                           False)
        y = acc / l_sum[:, None]  # (G_PAD, D)
        log_local = m + tl.log(l_sum)
        tl.store(Y_WIN + (b * H + g * G + h)[:, None] * D + d[None, :], y, mask=h_ok[:, None])
        tl.store(LOG_LOCAL + b * H + g * G + h, log_local, mask=h_ok)
        return y, log_local

    @triton.jit
    def _window_decide_kernel(Q, K, V, ROWS, START, LENGTH, A, BV, BULK_CAP, TAU_LOGIT, CA, CB, CS, Y_WIN, LOG_LOCAL,
                              LABELS, READ, Y, ARRIVED, LO, HI, COUNTS, HISTORY, STEP, sm_scale, sqb, sqh, skb, skh,
                              skt, svb, svh, svt, sab, sah, sbb, sbh, syb, syh, slb, slh, slp, shb, shh, shp, sts,
                              H: tl.constexpr,
                              HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                              N_SINK: tl.constexpr, N_LOCAL: tl.constexpr,
                              W_PAD: tl.constexpr, RULE: tl.constexpr, HAS_CAL: tl.constexpr, HAS_SCALE: tl.constexpr,
                              BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, LEN_PER_ROW: tl.constexpr,
                              DECIDE: tl.constexpr, BY_ROW: tl.constexpr, PRECISION: tl.constexpr,
                              LOW: tl.constexpr, FOLD: tl.constexpr = False, PAGE: tl.constexpr = 1,
                              COUNT: tl.constexpr = False, PDL: tl.constexpr = False, UNROLL: tl.constexpr = 1,
                              HAS_HISTORY: tl.constexpr = False, FORM_FIRST: tl.constexpr = False,
                              FORM_SUMS=None, FORM_APART: tl.constexpr = False):
        if PDL:  # the split grid after this one may be scheduled now; its programs wait for this grid's writes
            gdc_launch_dependents()
        b, g = tl.program_id(0), tl.program_id(1)
        # FORM_APART (WINDOW_LAUNCH's, where the kernel decides): 1 + D // BLOCK_D programs per (row, KV head), the
        # window's (part 0) and one per BLOCK_D columns of Eq. 6's form (a quarter of its 64 KB at Llama-3-8B's head
        # dim and the default tiles), side by side, each writing its results to memory; the last to finish reads the
        # others' back and decides. Else one program does it all, one part after the other.
        tl.static_assert(DECIDE or not FORM_APART, "FORM_APART needs a form: Quest alone has none")
        # the cache row of this program's query, in 64 bits: row * skb passes 2^31 elements where a layer's cache
        # does (4 GiB in bf16: batch 32 at 64k, Llama-3-8B shapes), and an i32 product would wrap into another
        # layer's keys
        row = tl.load(ROWS + b).to(tl.int64)
        start = tl.load(START + b)
        T = tl.load(LENGTH + b * LEN_PER_ROW)  # the filled length, from device memory (one for all rows, or each's)
        n_ctx = T - start
        h = tl.arange(0, G_PAD)
        h_ok = h < G
        d = tl.arange(0, D)
        q_rows = Q + b * sqb + (g * G + h)[:, None] * sqh
        q_stored = tl.load(q_rows + d[None, :], mask=h_ok[:, None], other=0.0)  # (G_PAD, D)
        q = q_stored.to(tl.float32)
        sums = FORM_SUMS
        if FORM_APART:
            sums = FORM_SUMS + (b * H + g * G + h) * (D // BLOCK_D)  # (G_PAD,): each head's sums of the columns
            if tl.program_id(2) == 0:
                _window_attention(q, q_stored, K, V, Y_WIN, LOG_LOCAL, b, g, h, h_ok, row, start, T, n_ctx, sm_scale,
                                  skb, skh, skt, svb, svh, svt, H, G, G_PAD, D, N_SINK, N_LOCAL, W_PAD, BLOCK_W,
                                  PRECISION, LOW, UNROLL)
            else:  # part c + 1: the form's columns [c BLOCK_D, (c + 1) BLOCK_D), its sum kept for the decision
                c = tl.program_id(2) - 1
                tl.store(sums + c, _form_columns(q, q_rows, h_ok, A, b, g, c * BLOCK_D, sab, sah, D, BLOCK_D,
                                                  PRECISION), mask=h_ok)
        else:
            if DECIDE and FORM_FIRST:  # (WINDOW_LAUNCH's) Eq. 6 before the window: the form's reads, which need no
                expo = _bulk_exponent(q, q_rows, h_ok, A, BV, CS, sums, b, g, sab, sah, sbb, sbh, D, BLOCK_D,
                                      HAS_SCALE, PRECISION, UNROLL)  # row, start with the program, overlapping T's
            y, log_local = _window_attention(q, q_stored, K, V, Y_WIN, LOG_LOCAL, b, g, h, h_ok, row, start, T,
                                             n_ctx, sm_scale, skb, skh, skt, svb, svh, svt, H, G, G_PAD, D, N_SINK,
                                             N_LOCAL, W_PAD, BLOCK_W, PRECISION, LOW, UNROLL)
        short = n_ctx <= N_LOCAL
        if tl.program_id(2) == 0:  # the window's part: the step's upkeep
            if COUNT:  # (fused_pages' with_read) the entries read, as each kernel loads them: the window's first
                tl.store(COUNTS + b * HKV + g, tl.minimum(n_ctx, N_LOCAL).to(tl.int64))
            if FOLD:  # (fused_pages' fold) the key appended at T - 1 into its page's min and max (LO, HI), in place:
                # what pages.PageIndex.update does on the host, here with no launch of its own; a key among the sinks
                # has no page, and folding a key twice leaves what once does (a graph's warm-up repeats a step)
                rel = T - 1 - start - N_SINK
                if rel >= 0:
                    # in fp32: exact for any stored dtype (Triton's interpreter mis-orders 16-bit floats in tl.minimum)
                    key = tl.load(K + row * skb + g * skh + (T - 1) * skt + d).to(tl.float32)  # (D,)
                    lo_at = LO + b * slb + g * slh + (rel // PAGE) * slp + d
                    hi_at = HI + b * shb + g * shh + (rel // PAGE) * shp + d
                    tl.store(lo_at, tl.minimum(tl.load(lo_at).to(tl.float32), key).to(LO.dtype.element_ty))
                    tl.store(hi_at, tl.maximum(tl.load(hi_at).to(tl.float32), key).to(HI.dtype.element_ty))
        if FORM_APART:  # the last part to finish decides, with the others' results read back from L2 (.cg): the
            # barrier orders this program's stores before the count's release; the count is zero at the launch
            # (fused_qada's `arrived`) and the decision zeroes it again
            tl.debug_barrier()
            if tl.atomic_add(ARRIVED + b * HKV + g, 1, sem="acq_rel", scope="gpu") != D // BLOCK_D:
                return
            y = tl.load(Y_WIN + (b * H + g * G + h)[:, None] * D + d[None, :], mask=h_ok[:, None], other=0.0,
                        cache_modifier=".cg")
            log_local = tl.load(LOG_LOCAL + b * H + g * G + h, mask=h_ok, other=0.0, cache_modifier=".cg")
        if not DECIDE:  # Quest alone: no decision, every head long-context; the cache read past a short window
            local = tl.zeros((G_PAD,), tl.int32) != 0
            group_reads = n_ctx > N_LOCAL
        else:
            if FORM_APART or not FORM_FIRST:  # (FORM_APART's sums, whatever FORM_FIRST says)
                expo = _bulk_exponent(q, q_rows, h_ok, A, BV, CS, sums, b, g, sab, sah, sbb, sbh, D, BLOCK_D,
                                      HAS_SCALE, PRECISION, UNROLL, FROM_PARTS=FORM_APART)
            # Eq. 7: log A_bulk = log T_bulk + the exponent, corrected, against the threshold
            log_bulk = expo + tl.log(tl.maximum(n_ctx - N_LOCAL, 1).to(tl.float32))
            if HAS_CAL:
                ca = tl.load(CA + g * G + h, mask=h_ok, other=0.0)
                cb = tl.load(CB + g * G + h, mask=h_ok, other=1.0)
                log_bulk = log_local - (ca + cb * (log_local - log_bulk))
            r = log_local - log_bulk
            local = r >= tl.load(TAU_LOGIT + b)  # criterion.tau_logit's: both paths compare with the same fp32 number
            if RULE == 1:  # "mean": the group's mean share >= tau, as its mean bulk share <= 1 - tau (criterion's);
                # at tau = 1 (a cap of 0) every head local on its own, as a bulk share past fp32's range is 0: there
                # a long-context head adds 1 to the sum, in the one reduction (a second one costs registers)
                cap = tl.load(BULK_CAP + b)
                bulk_share = 1.0 / (1.0 + tl.exp(r)) + tl.where(cap <= 0, tl.where(local, 0.0, 1.0), 0.0)
                mean_ok = tl.sum(tl.where(h_ok, bulk_share, 0.0), 0) / G <= cap
                local = (tl.zeros((G_PAD,), tl.int32) + mean_ok.to(tl.int32)) != 0
            if RULE == 2:  # "all": every head of the group, every head follows
                n_long = tl.sum(tl.where(h_ok & ~local, 1, 0), 0)
                local = (tl.zeros((G_PAD,), tl.int32) + n_long) == 0
            local = local | (tl.zeros((G_PAD,), tl.int32) + short.to(tl.int32) != 0)  # no bulk: all exact on the window
            group_reads = tl.sum(tl.where(h_ok & ~local, 1, 0), 0) > 0
        tl.store(LABELS + b * H + g * G + h, local.to(tl.int8), mask=h_ok)
        if HAS_HISTORY:  # and into a record of every step's labels, at the step STEP holds (fused_qada's `history`)
            tl.store(HISTORY + tl.load(STEP) * sts + b * H + g * G + h, local.to(tl.int8), mask=h_ok)
        tl.store(READ + b * HKV + g, group_reads.to(tl.int8))
        # The heads whose output is the window's (local, or in a group that reads no cache) are written here, in the
        # output's dtype; the split programs write the others. Their group's arrival count starts at 0 for them.
        y_b = b
        if BY_ROW:  # the output's row is the cache row's: the result lands in the caller's tensor
            y_b = row
        window_only = local | (tl.zeros((G_PAD,), tl.int32) + group_reads.to(tl.int32) == 0)
        tl.store(Y + y_b * syb + (g * G + h)[:, None] * syh + d[None, :], y.to(Y.dtype.element_ty),
                 mask=(h_ok & window_only)[:, None])
        tl.store(ARRIVED + b * HKV + g, 0)

    @triton.jit
    def _split_attention_kernel(Q, K, V, ROWS, START, LENGTH, READ, LABELS, Y_WIN, LOG_LOCAL, O_PART, M_PART, L_PART,
                                ARRIVED, Y, N_SPLITS, sm_scale, sqb, sqh, skb, skh, skt, svb, svh, svt, syb, syh,
                                PAGE_IDS, PAGE_HEADS, N_VALID, COUNTS, spb, sph,
                                H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                                D: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, LOW: tl.constexpr,
                                LEN_PER_ROW: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
                                N_SINK: tl.constexpr, N_LOCAL: tl.constexpr, PER_HEAD: tl.constexpr,
                                COUNT: tl.constexpr, BY_ROW: tl.constexpr, G_MERGE: tl.constexpr,
                                CHUNK: tl.constexpr, PDL: tl.constexpr = False, SPREAD: tl.constexpr = 0,
                                BH_PAD: tl.constexpr = 1):
        # Two ways to walk the context. A contiguous range (fused_qada): SPLIT positions from the row's start. A list
        # of pages (fused_pages, PAGED): SPLIT entries of the (row, KV head)'s list of chosen pages, BLOCK_N // PAGE
        # pages per tile, each page's bulk positions only; with PER_HEAD each entry carries the bits of the query
        # heads that chose it (Quest: a head attends to its own pages of the union its KV head reads).
        b, g, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if PDL:  # launched before the window kernel ended: its decision, window and zeroed counts visible after this
            gdc_wait()
        if SPREAD:  # (a contiguous range only) the grid's programs dealt out to the long groups alone, per of each:
            # the k-th long group (in row-major order of the flags) gets programs [k per, (k + 1) per), its context cut
            # into per pieces, and their partial results at those slots; with few long groups, each is cut finer, into
            # at most SPREAD times the fixed splits
            pairs = tl.arange(0, BH_PAD)  # the (row, KV head) pairs, row-major
            long = tl.load(READ + pairs, mask=pairs < tl.num_programs(0) * HKV, other=0) != 0  # (BH_PAD,)
            n_long = tl.sum(long.to(tl.int32), 0)
            per = tl.minimum(tl.num_programs(0) * HKV * N_SPLITS // tl.maximum(n_long, 1), SPREAD * N_SPLITS)
            pid = (b * HKV + g) * N_SPLITS + sp
            k = pid // per
            if k >= n_long:  # no long group left for this program (or none at all)
                return
            sp = pid % per
            pair = tl.sum(tl.where(long & (tl.cumsum(long.to(tl.int32), 0) == k + 1), pairs, 0), 0)  # the k-th
            b, g = pair // HKV, pair % HKV
        elif tl.load(READ + b * HKV + g) == 0:  # a group whose output is its window's: its cache is not read
            return
        T = tl.load(LENGTH + b * LEN_PER_ROW)
        start = tl.load(START + b)
        if PAGED:
            n_valid = tl.load(N_VALID + b * HKV + g)  # the list's chosen entries
            # the programs that run: those holding chosen pages, and at least the first, which merges the window
            # alone when no page was chosen (a budget under a page, say)
            n_used = tl.maximum(tl.cdiv(n_valid, SPLIT), 1)
            e0 = sp * SPLIT
            n_tiles = tl.cdiv(tl.maximum(tl.minimum(n_valid - e0, SPLIT), 0), BLOCK_N // PAGE)
            bulk_end = tl.maximum(T - start - (N_LOCAL - N_SINK), N_SINK)  # moments.bulk_end in the row's positions
        elif SPREAD:
            size = tl.cdiv(tl.cdiv(T - start, per), BLOCK_N) * BLOCK_N  # a piece: whole tiles
            n_used = tl.cdiv(T - start, size)
            lo = start + sp * size
            hi = tl.minimum(lo + size, T)
            n_tiles = size // BLOCK_N
        else:
            n_used = tl.cdiv(T - start, SPLIT)  # the splits holding filled positions (the grid covers the capacity)
            lo = start + sp * SPLIT
            hi = tl.minimum(lo + SPLIT, T)
            n_tiles = SPLIT // BLOCK_N  # a fixed trip count; the tail of the context is masked
        if sp >= n_used:  # past the filled length or the chosen pages: nothing to read or write
            return
        row = tl.load(ROWS + b).to(tl.int64)  # 64 bits, as the window kernel's
        h = tl.arange(0, G_PAD)
        h_ok = h < G
        d = tl.arange(0, D)
        if SPREAD:
            base = k * per * G  # the slots dealt to this long group, G rows per piece
        else:
            base = (b * HKV + g) * N_SPLITS * G  # this (row, KV head)'s partial results, G rows per split
        m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D), tl.float32)
        n_read = 0
        q = tl.load(Q + b * sqb + (g * G + h)[:, None] * sqh + d[None, :], mask=h_ok[:, None], other=0.0)
        if not LOW:
            q = q.to(tl.float32)
        for i in range(n_tiles):
            if PAGED:
                t = tl.arange(0, BLOCK_N)
                e = e0 + i * (BLOCK_N // PAGE) + t // PAGE  # (BLOCK_N,) each position's entry in the list
                e_ok = e < tl.minimum(n_valid, e0 + SPLIT)
                page = tl.load(PAGE_IDS + b * spb + g * sph + e, mask=e_ok, other=0)
                ctx = N_SINK + page * PAGE + t % PAGE  # the position in the row's context (pages.page_positions)
                ok = e_ok & (ctx < bulk_end)  # the last candidate's part in the window is the window's, not read again
                offs = start + ctx
                keep = ok[None, :]  # (1 or G_PAD, BLOCK_N): which (head, position) scores count
                if PER_HEAD:
                    bits = tl.load(PAGE_HEADS + b * spb + g * sph + e, mask=e_ok, other=0)
                    keep = keep & (((bits[None, :] >> h[:, None]) & 1) != 0)
            else:
                offs = lo + i * BLOCK_N + tl.arange(0, BLOCK_N)
                ok = offs < hi
                keep = ok[None, :]
            kt = tl.load(K + row * skb + g * skh + offs[:, None] * skt + d[None, :], mask=ok[:, None], other=0.0)
            vt = tl.load(V + row * svb + g * svh + offs[:, None] * svt + d[None, :], mask=ok[:, None], other=0.0)
            if COUNT:  # the bulk positions this program loaded
                n_read += tl.sum(ok.to(tl.int32), 0)
            # exact fp32 products where not LOW; with PAGED a head may have no page of its own yet
            m_i, l_i, acc = _softmax_block(q, kt, vt, keep, m_i, l_i, acc, sm_scale, LOW, "ieee", PAGED)
        part = base + sp * G + h  # (G_PAD,): this split's rows, the padding's not stored
        tl.store(M_PART + part, m_i, mask=h_ok)
        tl.store(L_PART + part, l_i, mask=h_ok)
        tl.store(O_PART + part[:, None] * D + d[None, :], acc, mask=h_ok[:, None])
        if COUNT:  # added to the group's count of the entries read (the window kernel began it)
            tl.atomic_add(COUNTS + b * HKV + g, n_read.to(tl.int64))

        # The merge, by the group's last program to finish (no launch of its own): each program counts itself in
        # once its partial results are stored; the one that counts last reads them all back from L2 (.cg: not from
        # its own L1, which may hold stale lines) and writes the long heads' output. The barrier orders every
        # thread's stores before the count's release; the count was zero before this launch (the window kernel
        # zeroes it, or the previous launch's merging program left it so: fused_dense's kept flags).
        tl.debug_barrier()
        if tl.atomic_add(ARRIVED + b * HKV + g, 1, sem="acq_rel", scope="gpu") != n_used - 1:
            return
        tl.store(ARRIVED + b * HKV + g, 0)  # all counted: zero again for the next launch (fused_dense's flags)
        # The group's splits are read CHUNK at a time, (CHUNK, G_MERGE) tiles: independent loads in flight together,
        # not a chain of one load per split on the step's critical path (with G_MERGE rows, no tl.dot's 16), in one
        # pass: a running max, the sums so far rescaled as it grows (each split's results loaded once).
        hm = tl.arange(0, G_MERGE)
        hm_ok = hm < G
        c = tl.arange(0, CHUNK)
        if PAGED:  # the window as the first part, of mass exp(log_local): its output times 1 at that max
            m = tl.load(LOG_LOCAL + b * H + g * G + hm, mask=hm_ok, other=0.0)
            l_sum = tl.full((G_MERGE,), 1.0, tl.float32)
            acc = tl.load(Y_WIN + (b * H + g * G + hm)[:, None] * D + d[None, :], mask=hm_ok[:, None], other=0.0)
        else:
            m = tl.full((G_MERGE,), float("-inf"), tl.float32)
            l_sum = tl.zeros((G_MERGE,), tl.float32)
            acc = tl.zeros((G_MERGE, D), tl.float32)
        for s0 in range(0, n_used, CHUNK):
            cell = base + (s0 + c)[:, None] * G + hm[None, :]  # (CHUNK, G_MERGE)
            cell_ok = ((s0 + c) < n_used)[:, None] & hm_ok[None, :]
            m_s = tl.load(M_PART + cell, mask=cell_ok, other=float("-inf"), cache_modifier=".cg")
            l_s = tl.load(L_PART + cell, mask=cell_ok, other=0.0, cache_modifier=".cg")
            o = tl.load(O_PART + cell[:, :, None] * D + d[None, None, :], mask=cell_ok[:, :, None], other=0.0,
                        cache_modifier=".cg")  # (CHUNK, G_MERGE, D)
            m_new = tl.maximum(m, tl.max(m_s, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no part with a score yet: not -inf - -inf
            alpha = tl.exp(m - m_use)  # the sums so far, to the new max (0 while they are empty)
            scale = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_use[None, :]))  # (CHUNK, G_MERGE)
            l_sum = l_sum * alpha + tl.sum(l_s * scale, 0)
            acc = acc * alpha[:, None] + tl.sum(o * scale[:, :, None], 0)
            m = m_new
        is_long = tl.load(LABELS + b * H + g * G + hm, mask=hm_ok, other=1) == 0
        y_b = b
        if BY_ROW:  # the output's row is the cache row's: the result lands in the caller's tensor
            y_b = row
        out = Y + y_b * syb + (g * G + hm)[:, None] * syh + d[None, :]
        write = hm_ok & is_long  # a padded or local head read nothing: its empty sum is not divided (0/0)
        l_sum = tl.where(write, l_sum, 1.0)
        tl.store(out, (acc / l_sum[:, None]).to(Y.dtype.element_ty), mask=write[:, None])

    @triton.jit
    def _page_bound_kernel(Q, LO, HI, START, LENGTH, READ, N_READ, SCORES, COUNTS, sqb, sqh, slb, slh, slp, shb, shh,
                           shp, ssb, ssr, W, H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                           D: tl.constexpr, PAGE: tl.constexpr, N_SINK: tl.constexpr, N_LOCAL: tl.constexpr,
                           BLOCK_P: tl.constexpr, PER_HEAD: tl.constexpr, COMBINE: tl.constexpr,
                           LEN_PER_ROW: tl.constexpr, LOW: tl.constexpr, COUNT: tl.constexpr = False,
                           N_READ_ALL: tl.constexpr = -1, FRAC_BITS: tl.constexpr = 0):
        # Quest's bound of BLOCK_P candidate pages for the G heads of a (row, KV head): sum_d max(q_d min_d, q_d max_d)
        # = q+ . max + q- . min (pages.upper_bounds), unscaled, in exact fp32 products as the torch path ranks them:
        # "ieee" tl.dot, or with LOW (a 16-bit query and statistics) tensor-core products of the stored values, which
        # are exact in fp32 as well (their sums are not in the same order nor IEEE-rounded at each step).
        # A page that is no candidate (past the row's bulk, a local group, no budget) scores -inf; when the budget
        # covers every candidate, each scores 0 and no statistic is read (attention.top_pages reads none then).
        b, g, pb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n_ctx = tl.load(LENGTH + b * LEN_PER_ROW) - tl.load(START + b)
        m = tl.cdiv(tl.maximum(n_ctx - (N_LOCAL - N_SINK), N_SINK) - N_SINK, PAGE)  # pages.candidates
        if N_READ_ALL >= 0:  # a budget in tokens: every row's pages, a constant
            n_read = N_READ_ALL
        else:  # a budget_frac's, each row's own: floor(budget_frac T) // P in float64 as pages.page_count, the
            # fraction's float64 bits a constant (a float constexpr would be rounded to fp32); kept for the choice
            frac = tl.full((1,), FRAC_BITS, tl.int64).to(tl.float64, bitcast=True)
            n_read = tl.sum((tl.floor(n_ctx.to(tl.float64) * frac).to(tl.int32) // PAGE), 0)
            if (g == 0) & (pb == 0):
                tl.store(N_READ + b, n_read)
        h = tl.arange(0, G_PAD)
        h_ok = h < G
        p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        n_cand = tl.where((n_read > 0) & (tl.load(READ + b * HKV + g) != 0), m, 0)  # none for a local group
        cand = p < n_cand  # (BLOCK_P,)
        need = p < tl.where(n_read < m, n_cand, 0)  # the statistics decide something: read them
        if COUNT:  # one entry per page whose statistics are read, added to the group's count of the entries read
            tl.atomic_add(COUNTS + b * HKV + g, tl.sum(need.to(tl.int64), 0))
        score = tl.zeros((G_PAD, BLOCK_P), tl.float32)
        if tl.sum(need.to(tl.int32), 0) > 0:
            d = tl.arange(0, D)
            q = tl.load(Q + b * sqb + (g * G + h)[:, None] * sqh + d[None, :], mask=h_ok[:, None], other=0.0)
            lo = tl.load(LO + b * slb + g * slh + p[:, None] * slp + d[None, :], mask=need[:, None], other=0.0)
            hi = tl.load(HI + b * shb + g * shh + p[:, None] * shp + d[None, :], mask=need[:, None], other=0.0)
            if LOW:  # (G_PAD, D) in the stored dtype, its positive and negative parts
                zero = tl.zeros_like(q)  # (tl.maximum and tl.minimum return fp32 for 16-bit tiles in Triton 3.6)
                q_pos, q_neg = tl.maximum(q, zero).to(hi.dtype), tl.minimum(q, zero).to(lo.dtype)  # exact: q's own
                bound = tl.dot(q_pos, tl.trans(hi)) + tl.dot(q_neg, tl.trans(lo))
            else:
                q = q.to(tl.float32)
                bound = tl.dot(tl.maximum(q, 0.0), tl.trans(hi.to(tl.float32)), input_precision="ieee")
                bound += tl.dot(tl.minimum(q, 0.0), tl.trans(lo.to(tl.float32)), input_precision="ieee")
            # bound: (G_PAD, BLOCK_P)
            score = tl.where(need[None, :], bound, 0.0)
        score = tl.where(cand[None, :], score, float("-inf"))
        if PER_HEAD:  # Quest: each query head ranks its own pages
            tl.store(SCORES + b * ssb + (g * G + h)[:, None] * ssr + p[None, :], score,
                     mask=h_ok[:, None] & (p < W)[None, :])
        else:  # one ranking per group: its heads' bounds combined, by max (COMBINE 0) or sum (1)
            if COMBINE == 0:
                group = tl.max(tl.where(h_ok[:, None], score, float("-inf")), 0)
            else:
                group = tl.sum(tl.where(h_ok[:, None], score, 0.0), 0)
            tl.store(SCORES + b * ssb + g * ssr + p, group, mask=p < W)

    @triton.jit
    def _page_select_kernel(SCORES, N_READ, IDS, HEADS, N_VALID, n_sel, W, U, ssb, ssr, HKV: tl.constexpr,
                            G: tl.constexpr, R_PAD: tl.constexpr, W_PAD: tl.constexpr, PER_HEAD: tl.constexpr,
                            RANKED: tl.constexpr):
        # The pages one (row, KV head) reads, from its candidates' scores (-inf: no candidate): each ranking's k best
        # finite ones, k = n_sel, or with RANKED the row's n_read (at most n_sel). One ranking, or with PER_HEAD
        # (Quest) one per query head of the group, the list then their union, each page with the bits of the heads
        # that chose it. Written in page order, each page once; entries from n_valid to U: no page (W), no head.
        # The k-th best score is found by bisection on the scores' bits, all rankings at once: a float's bits, the
        # rest flipped where the sign is set, order as signed integers as the floats do; at most 32 halvings of the
        # int32 range leave the largest t with at least k keys >= t, which is the k-th key. Ties at t go to the
        # lowest pages.
        b, g = tl.program_id(0), tl.program_id(1)
        w = tl.arange(0, W_PAD)
        r = tl.arange(0, R_PAD)
        n_rank = G if PER_HEAD else 1
        at = SCORES + b * ssb + (g * n_rank + r)[:, None] * ssr + w[None, :]
        score = tl.load(at, mask=(r < n_rank)[:, None] & (w < W)[None, :], other=float("-inf"))  # (R_PAD, W_PAD)
        score = tl.where(score == 0.0, 0.0, score)  # -0.0 as +0.0: equal floats, which their bits would not tie
        bits = score.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # >> of a signed int is arithmetic: all ones where negative
        k = n_sel
        if RANKED:
            k = tl.minimum(tl.load(N_READ + b), n_sel)
        finite = score > float("-inf")
        lo = tl.full((R_PAD,), -2147483648, tl.int64)  # at least k keys >= lo (every key is)
        hi = tl.full((R_PAD,), 2147483648, tl.int64)  # fewer than k keys >= hi (none is)
        # A ranking is done once exactly k keys are >= its lo: those k are its choice, with no tie to break (more
        # halvings, while others go on, keep it so). The loop ends when all are: on distinct scores after about
        # log2(W) and a few halvings, not 32. A ranking whose candidates all fit, or a padding row
        # (r >= n_rank), is done from the start: where all are, lo stays below every key.
        done = (r >= n_rank) | (tl.sum(finite.to(tl.int32), 1) <= k)
        halvings = 0
        while (halvings < 32) & (tl.min(done.to(tl.int32), 0) == 0):
            mid = (lo + hi) >> 1
            count = tl.sum((key >= mid.to(tl.int32)[:, None]).to(tl.int32), 1)
            up = count >= k
            lo = tl.where(up, mid, lo)
            hi = tl.where(up, hi, mid)
            done = done | (count == k)
            halvings += 1
        t = lo.to(tl.int32)[:, None]  # the k-th key, or below it with exactly k keys above; -2^31 where all fit
        above = key > t
        tie = key == t
        room = k - tl.sum(above.to(tl.int32), 1)  # (R_PAD,): the ties that still fit
        chose = (above | (tie & (tl.cumsum(tie.to(tl.int32), 1) <= room[:, None]))) & finite
        heads = tl.sum(tl.where(chose, (1 << r)[:, None], 0), 0)  # (W_PAD,) int32: the bits of the heads that chose
        chosen = heads != 0
        slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
        n_valid = tl.sum(chosen.to(tl.int32), 0)
        out = (b * HKV + g) * U
        rest = (w >= n_valid) & (w < U)
        tl.store(IDS + out + slot, w.to(tl.int64), mask=chosen)
        tl.store(IDS + out + w, tl.full((W_PAD,), W, tl.int64), mask=rest)
        if PER_HEAD:
            tl.store(HEADS + out + slot, heads, mask=chosen)
            tl.store(HEADS + out + w, tl.zeros((W_PAD,), tl.int32), mask=rest)
        tl.store(N_VALID + b * HKV + g, n_valid)


def tensor_cores(q: torch.Tensor, *stored: torch.Tensor) -> bool:
    """Whether products of q and the stored operands can run on tensor cores in their own dtype, exactly: one 16-bit
    dtype for all, compiled (the interpreter multiplies 16-bit tiles wrongly). The split kernel's products always
    do where they can."""
    same = all(x.dtype == q.dtype for x in stored)
    return same and q.dtype in (torch.bfloat16, torch.float16) and not INTERPRETED


def low(config: dict, q: torch.Tensor, *stored: torch.Tensor) -> bool:
    """Whether a launch config's LOW applies: asked for, and tensor_cores allows it."""
    return config["LOW"] and tensor_cores(q, *stored)


def pdl(q: torch.Tensor) -> bool:
    """Whether the split kernel is launched programmatically dependent on the window kernel (SPLIT_LAUNCH's PDL):
    asked for, compiled (not the interpreter) by a Triton that has it, on a GPU of compute capability 9 or later."""
    return (SPLIT_LAUNCH["PDL"] and gdc_wait is not None and not INTERPRETED and q.is_cuda
            and torch.cuda.get_device_capability(q.device)[0] >= 9)


def window_launch(w_pad: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decide: bool = True) -> dict:
    """WINDOW_LAUNCH for a window padded to w_pad positions and query q: tiles no larger than the window and the head
    dim, LOW where it applies, FORM_APART where the kernel decides (Quest alone has no form)."""
    launch = dict(WINDOW_LAUNCH)
    launch["BLOCK_W"], launch["BLOCK_D"] = min(launch["BLOCK_W"], w_pad), min(launch["BLOCK_D"], q.shape[-1])
    launch["LOW"] = low(WINDOW_LAUNCH, q, k, v)
    launch["FORM_APART"] = launch["FORM_APART"] and decide
    return launch


def caller_buffer(name: str, x: torch.Tensor, shape: tuple, dtype: torch.dtype, what: str = "") -> torch.Tensor:
    """x, a caller's buffer that the kernels write in place (fused_qada's `arrived`, fused_pages' `read_out`):
    ValueError unless it is contiguous, of `shape` and `dtype`."""
    if x.shape != shape or x.dtype != dtype or not x.is_contiguous():
        raise ValueError(f"{name}: a contiguous {shape} {str(dtype).removeprefix('torch.')} tensor{what}, got "
                         f"{x.dtype} {tuple(x.shape)}")
    return x


def window_buffers(launch: dict, B: int, H: int, Hkv: int, D: int, arrived: torch.Tensor | None, dummy: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """What the window kernel's launch needs beyond the step's own buffers: the groups' arrival counts (B, Hkv) int32
    it hands the split kernel, FORM_APART's sums of the form's columns (B, H, D // BLOCK_D) fp32 (else `dummy`), and
    the programs it runs per group. With FORM_APART 1 + D // BLOCK_D, which count themselves in the same counts, so
    these must be zero at the launch: the caller's `arrived` (kept from call to call: both kernels leave it at zero,
    and a static loop needs no fill per step), else a new zeroed one. Without it one program, which zeroes them
    itself."""
    apart = launch["FORM_APART"]
    parts = 1 + (D // launch["BLOCK_D"] if apart else 0)
    sums = torch.empty(B, H, parts - 1, device=dummy.device, dtype=torch.float32) if apart else dummy
    if arrived is not None:
        return caller_buffer("arrived", arrived, (B, Hkv), torch.int32, " at zero"), sums, parts
    make = torch.zeros if apart else torch.empty
    return make(B, Hkv, device=dummy.device, dtype=torch.int32), sums, parts


def split_launch(G: int) -> dict:
    """The split kernel's launch options both of its callers share (attend_ranges, fused_pages): the merge's tiles
    for G heads per group, and SPLIT_LAUNCH's warps and pipeline depth."""
    return dict(G_MERGE=triton.next_power_of_2(G), CHUNK=MERGE_CHUNK, num_warps=SPLIT_LAUNCH["num_warps"],
                num_stages=SPLIT_LAUNCH["num_stages"])


def split_size(n_programs: int, T_max: int, device: torch.device, block_n: int = 64) -> int:
    """Context positions per split program, for a context of up to T_max positions (the views fused_qada is given: the
    filled length, or the cache's capacity): at least 16 splits per group, 32 where the groups are too few for 16 each
    to give four programs per multiprocessor, and fewer than twice that (the split rounded down to a power of two: a
    capacity a little past 32k, as a static loop's views are, splits as 32k does, not in half as many). Measured on an
    H200 at 32k (results/bench-gpu/h200/kernels.md): more, smaller splits lose more to each program's fixed cost and to
    the last program's merge than they gain in parallelism (batch 1: 512 positions 111 us, 1024 93 us, 2048 90 us per
    layer at KV read 1; batch 8: 4096 332 us, 2048 311 us). A power of two from 256 (whole blocks of block_n): the split
    is a compile-time constant of the kernel, so eager steps over a context growing from 8k to 128k compile a few
    variants, not one per step, and a captured step over a fixed capacity one."""
    slots = 4 * (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8)
    per_group = min(32, max(16, triton.cdiv(slots, n_programs)))
    return max(256, block_n, 1 << max(T_max // per_group, 1).bit_length() - 1)


def filled_length(length: torch.Tensor | None, B: int, T_max: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """The kernels' LENGTH, checked: `length` as given (int32, 1 or B elements on the device), or T_max in a device
    tensor when the views end at the filled length; and LEN_PER_ROW, a constexpr: row b reads LENGTH[b * it]."""
    if length is None:
        length = torch.full((1,), T_max, dtype=torch.int32, device=device)
    if length.dtype != torch.int32 or length.device != device or length.numel() not in (1, B):
        raise ValueError(f"length: an int32 tensor of 1 or {B} elements on {device}, got {length.dtype} "
                         f"{tuple(length.shape)} on {length.device}")
    return length, int(length.numel() == B > 1)


def float64_bits(x: float) -> int:
    """x's IEEE float64 bits as a signed integer, which a kernel bitcasts back: a float constant at full precision."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def kernel_thresholds(tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tau (n,) float64 -> the kernel's thresholds, criterion.bulk_cap(tau) (the "mean" rule's) and
    criterion.tau_logit(tau), both (n,) fp32: a caller that decides every layer with the same taus makes them once
    instead of launching their arithmetic per layer."""
    return bulk_cap(tau.double()), tau_logit(tau.double())


def form_operands(form) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' quadratic forms (A (n, Hkv, D, D), b (n, Hkv, D)) as the window kernel reads them: fp32, each row's
    block contiguous, any stride between rows kept (0: one form broadcast over the rows, attention.stacked_forms,
    read once for all of them rather than copied per row)."""
    return tuple(x if x.dtype == torch.float32 and x[0].is_contiguous() else x.float().contiguous() for x in form)


def history_operands(history, B: int, H: int, dummy: torch.Tensor) -> tuple:
    """The window kernel's HISTORY, STEP, its stride over steps and HAS_HISTORY, from fused_qada's or fused_pages'
    `history`: (labels (S, B, H) bool or int8, each step's (B, H) block contiguous; step (1,) int64, on the device),
    or None (dummies, off)."""
    if history is None:
        return dummy, dummy, 0, False
    labels, step = history
    if (labels.dtype not in (torch.bool, torch.int8) or labels.shape[1:] != (B, H) or labels.stride()[1:] != (H, 1)
            or step.dtype != torch.int64 or step.numel() != 1):
        raise ValueError(f"history: labels (S, {B}, {H}) bool or int8, each step's block contiguous, and a (1,) int64 "
                         f"step; got {labels.dtype} {tuple(labels.shape)} strides {labels.stride()}, {step.dtype} "
                         f"{tuple(step.shape)}")
    return labels.view(torch.int8), step, labels.stride(0), True


def _launch_checks(q: torch.Tensor, out: torch.Tensor | None, name: str) -> None:
    """What the three fused entry points (fused_qada, fused_dense, fused_pages) need before any launch: triton, and
    the head dim contiguous in q and out."""
    if triton is None:
        raise RuntimeError("the fused kernel needs triton (pip install triton); the torch path runs without it")
    if q.stride(-1) != 1 or (out is not None and out.stride(-1) != 1):
        raise ValueError(f"{name} reads q and writes its output with unit stride over the head dim")


def attend_ranges(q, k, v, rows, start, length, len_per_row: int, read, labels, arrived, y, split: int, block_n: int,
                  by_row: bool, mark_unread: bool = False, after_window: bool = False) -> torch.Tensor:
    """The split kernel over each row's contiguous context [start, T), for the groups `read` marks (B, Hkv), each head
    whose label is 0 merged into y by its group's last program: fused_qada's second launch, fused_dense's only one.
    arrived (B, Hkv) int32 must be zero (the kernel leaves it so). Returns the partial max scores (B, Hkv, n_splits,
    G); with mark_unread +inf where no split program wrote (the tests' count of the splits that read).
    `after_window`: launched right after the window kernel, programmatically dependent on it where pdl(q) says so (the
    window kernel launched likewise)."""
    B, H, D = q.shape
    Hkv = k.shape[1]
    G, n_splits = H // Hkv, triton.cdiv(k.shape[2], split)
    f32 = torch.float32
    o_part = torch.empty(B, Hkv, n_splits, G, D, device=q.device, dtype=f32)
    m_part = torch.empty(B, Hkv, n_splits, G, device=q.device, dtype=f32)
    if mark_unread:
        m_part.fill_(math.inf)  # what no split program writes: a max score is finite, -inf or NaN
    l_part = torch.empty(B, Hkv, n_splits, G, device=q.device, dtype=f32)
    dummy = m_part  # never read off PAGED: the window's part and the page lists
    _split_attention_kernel[(B, Hkv, n_splits)](
        q, k, v, rows, start, length, read, labels, dummy, dummy, o_part, m_part, l_part, arrived, y, n_splits,
        1 / math.sqrt(D), q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), y.stride(0), y.stride(1), dummy, dummy, dummy, dummy, 0, 0,
        H=H, HKV=Hkv, G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, SPLIT=split, BLOCK_N=block_n,
        LOW=tensor_cores(q, k, v), LEN_PER_ROW=len_per_row, PAGED=False, PAGE=1, N_SINK=0, N_LOCAL=0,
        PER_HEAD=False, COUNT=False, BY_ROW=by_row, SPREAD=SPLIT_LAUNCH["SPREAD"],
        BH_PAD=triton.next_power_of_2(B * Hkv), **split_launch(G),
        **(dict(PDL=True, launch_pdl=True) if after_window and pdl(q) else {}))
    return m_part


def fused_qada(q, k, v, rows, start, n_sink: int, n_local: int, form, tau, rule: str | None = None,
               correction: Correction | None = None, length: torch.Tensor | None = None, split: int | None = None,
               block_n: int | None = None, count_reads: bool = False, history=None, arrived=None, out=None):
    """QAdA for one layer and n rows in two Triton kernels: the same labels and output as the `qada` path of each
    row, up to fp32 rounding. q (n, H, D), any strides but the last; k, v (B, Hkv, T_max, D), views of the cache (any
    stride over T), of which row rows[i] is query i's (integers, (n,)); start (n,), each row's first filled position
    (left padding); form: each row's (A (n, Hkv, D, D), b (n, Hkv, D)) fp32; tau (n,), float64 so that the threshold
    is criterion.tau_logit's, or kernel_thresholds(tau); rule as criterion.local_labels; correction: one layer's
    criterion.Correction (Calibration.layer()). Returns y (n, H, D) in q's dtype and labels (n, H) bool, on
    the device; with `out` (B, H, D), any strides but the last, query i's output is written to out[rows[i]] in out's
    dtype instead and out is returned. With `count_reads` (for tests) also the splits of each (row, KV head)
    that read the cache, (n, Hkv). `split`: context positions per program (default split_size's for T_max);
    `block_n`: positions per tile (default SPLIT_LAUNCH's).

    `length`: the filled length T, an int32 device tensor, 0-d or (1,) for every row or (n,) for each query's row;
    the views may then run to the cache's capacity T_max > T (model.KVCache's whole buffer), and nothing the kernels
    are launched with changes as T grows: one step captured in a CUDA graph is replayed as the cache fills, T advanced
    in place. Without it, T is the views' own length (T_max), put into a device tensor here.

    `history`: (record (S, n, H) bool or int8, step (1,) long), the labels also written at record[step], the step read
    from device memory: a static decode loop's record of every step's labels, with no launch of its own.

    `arrived`: (n, Hkv) int32 at zero, the groups' arrival counts, which the kernels leave at zero: a caller's buffer
    kept from call to call, so that WINDOW_LAUNCH's FORM_APART needs no zeroed one each call (window_buffers). It must
    be zero: with FORM_APART a count left at k > 0 would have a part decide before the others' results are in, and
    every later call would go on deciding early."""
    _launch_checks(q, out, "fused_qada")
    B, H, D = q.shape
    Hkv, T_max = k.shape[1], k.shape[2]
    G = H // Hkv
    G_pad = max(16, triton.next_power_of_2(G))  # tl.dot's smallest tile
    dev, f32 = q.device, torch.float32
    length, len_per_row = filled_length(length, B, T_max, dev)
    # The grid and the split size come from the capacity T_max, not from T: the split is a compile-time constant (the
    # inner loop's trip count) and a captured graph replays one grid, so neither may follow T from step to step.
    # Programs past the filled length load three integers and return at once: up to 64 idle programs per (row, KV
    # head), a fraction of a wave of launch slots. The larger cost is parallelism: at T = T_max / 8 only one in eight
    # of a group's programs read, so a small batch fills the GPU less than splits sized for T would; a few graphs,
    # one per bucket of capacities, bound that.
    if count_reads and SPLIT_LAUNCH["SPREAD"]:
        raise ValueError("count_reads counts each group's own splits, which SPLIT_LAUNCH's SPREAD deals out")
    block_n = block_n or SPLIT_LAUNCH["BLOCK_N"]
    split = split or split_size(B * Hkv, T_max, q.device, block_n)
    if split % block_n:
        raise ValueError(f"split {split} must be a multiple of block_n {block_n}")
    A, bvec = form_operands(form)
    y_win = torch.empty(B, H, D, device=dev, dtype=f32)
    log_local = torch.empty(B, H, device=dev, dtype=f32)
    labels = torch.empty(B, H, device=dev, dtype=torch.int8)
    read = torch.empty(B, Hkv, device=dev, dtype=torch.int8)
    ca, cb, cs = (correction.a, correction.b, correction.s) if correction is not None else (None, None, None)
    cap, tau_lgt = tau if isinstance(tau, tuple) else kernel_thresholds(tau)
    dummy = log_local  # never read: HAS_CAL / HAS_SCALE are off
    sm_scale = 1 / math.sqrt(D)
    w_pad = max(16, triton.next_power_of_2(n_local))
    y = torch.empty(B, H, D, device=dev, dtype=q.dtype) if out is None else out
    launch = window_launch(w_pad, q, k, v)
    arrived, form_sums, parts = window_buffers(launch, B, H, Hkv, D, arrived, dummy)
    record, step, sts, has_history = history_operands(history, B, H, dummy)
    _window_decide_kernel[(B, Hkv, parts)](
        q, k, v, rows, start, length, A, bvec, cap, tau_lgt, ca if ca is not None else dummy,
        cb if cb is not None else dummy, cs if cs is not None else dummy, y_win, log_local, labels, read, y, arrived,
        dummy, dummy, dummy, record, step, sm_scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), A.stride(0), A.stride(1), bvec.stride(0), bvec.stride(1), y.stride(0),
        y.stride(1), 0, 0, 0, 0, 0, 0, sts, H=H, HKV=Hkv, G=G, G_PAD=G_pad, D=D, N_SINK=n_sink, N_LOCAL=n_local,
        W_PAD=w_pad, RULE=RULES[rule], HAS_CAL=ca is not None, HAS_SCALE=cs is not None, LEN_PER_ROW=len_per_row,
        DECIDE=True, BY_ROW=out is not None, PDL=pdl(q), HAS_HISTORY=has_history, FORM_SUMS=form_sums, **launch)
    m_part = attend_ranges(q, k, v, rows, start, length, len_per_row, read, labels, arrived, y, split, block_n,
                           out is not None, mark_unread=count_reads, after_window=True)
    labels = labels.view(torch.bool)  # 0 / 1 bytes reinterpreted, no launch
    if count_reads:  # a split that read the cache wrote its max score
        return y, labels, (m_part[..., 0] != math.inf).sum(-1)
    return y, labels


def dense_flags(B: int, H: int, Hkv: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the split kernel reads in place of a decision, for fused_dense: every group reads (B, Hkv) int8, every
    head long-context (B, H) int8, and the groups' arrival counts (B, Hkv) int32 at zero, which the kernel leaves at
    zero again: made once, they serve every call (fused_qada's window kernel writes its own each call)."""
    return (torch.ones(B, Hkv, device=device, dtype=torch.int8), torch.zeros(B, H, device=device, dtype=torch.int8),
            torch.zeros(B, Hkv, device=device, dtype=torch.int32))


def fused_dense(q, k, v, rows, start, length: torch.Tensor | None = None, split: int | None = None,
                block_n: int | None = None, flags: tuple | None = None, out=None):
    """Dense decoding attention for one layer and n rows in the split kernel alone: every group reads its whole
    context, [start, T), in split programs merged by each group's last one (flash-decoding). q, k, v, rows, start,
    length, split and out as fused_qada's; returns y (n, H, D) in q's dtype, or `out`. What a static decode loop's
    dense step runs on the GPU (attention.StaticAttention): T read from device memory, so one captured step replays
    as the cache fills, and the grid covers the capacity, where SDPA would be given the whole view and a mask, one
    program per (row, KV head) (model.dense_decode's packed layout). `flags`: dense_flags(n, H, Hkv), kept by a
    caller that decodes step after step, so that a step is this one launch (default: made here, three small fills)."""
    _launch_checks(q, out, "fused_dense")
    B, H, D = q.shape
    Hkv, T_max, dev = k.shape[1], k.shape[2], q.device
    length, len_per_row = filled_length(length, B, T_max, dev)
    block_n = block_n or SPLIT_LAUNCH["BLOCK_N"]
    split = split or split_size(B * Hkv, T_max, dev, block_n)
    if split % block_n:
        raise ValueError(f"split {split} must be a multiple of block_n {block_n}")
    read, labels, arrived = flags if flags is not None else dense_flags(B, H, Hkv, dev)
    y = torch.empty(B, H, D, device=dev, dtype=q.dtype) if out is None else out
    attend_ranges(q, k, v, rows, start, length, len_per_row, read, labels, arrived, y, split, block_n, out is not None)
    return y


# ---------------------------------------------------------------------------------------------------------
# Page selection on the device: the long-context groups read their window and their chosen pages only


def fused_pages(q, k, v, rows, start, n_sink: int, n_local: int, bounds, page_size: int, budget: int | None = None,
                budget_frac: float | None = None, form=None, tau=None, correction: Correction | None = None,
                combine: str = "max", length: torch.Tensor | None = None, split: int | None = None,
                block_n: int | None = None, fold: bool = False, with_read: bool = False, inspect: bool = False,
                history=None, read_out=None, arrived=None, out=None):
    """Token-level page selection for one layer and n rows, on the device with nothing read back to the host: the same
    labels and output as attention.qada_pages (given `form` and `tau`) or attention.quest (`form` None) of each row, up
    to fp32 rounding. q, k, v, rows, start, length and out as fused_qada's; `bounds` = (lo, hi), each (n, Hkv, NP, D):
    query i's row's pages.PageIndex min and max keys, page j the positions [start_i + n_sink + j P, ... + P) of the
    cache (PageIndex.bounds of the row's own view, or pages.stacked's buffers), NP at least the candidates of a
    context of T_max (pages.candidates), with `fold` every page of T_max (pages.pages_upto); page_size P a power of
    two dividing block_n; `budget` tokens or `budget_frac` of each row's T, one of them (pages.page_count). Four
    steps, each a fixed grid:

      1. per (row, KV head), `_window_decide_kernel`: the window, and QAdA's decision as qada_kv_cal takes it (rule
         "mean", `correction`: Calibration.layer()); for Quest no decision, every group long-context; with `fold`,
         also the key each row appended at T - 1 folded into its page's min and max in `bounds`, in place (the
         static loop's pages.stacked buffers, kept current step by step);
      2. per (row, KV head, block of pages), `_page_bound_kernel`: the long groups' candidate pages scored by Quest's
         bound, per query head (Quest) or per group, its heads' bounds combined by `combine` ("max" or "sum"; for
         "share", pages.page_shares of each head's bounds against its window's mass, then their max, in torch);
      3. per (row, KV head), `_page_select_kernel` (choose_pages): the top budget // P pages of each ranking, and
         the KV head's list of the pages it reads, each once, in page order (Quest: the union of its heads', each
         page with the heads that chose it);
      4. per (row, KV head, split of that list), `_split_attention_kernel` walking page numbers instead of a range,
         so a long group reads its chosen pages' bulk positions and no others; its last program to finish merges
         them, the window's output as one more part.

    Why the choice is a kernel and not torch's topk: topk took 21-33 us per layer on an H200 (Llama-3-8B at 32k,
    batch 1 and 8), more than any kernel of QAdA + pages' step, for rankings of some two thousand candidates, plus
    the operations that count its finite picks or make Quest's union. One program per (row, KV head) holds its
    rankings in registers and finds each k-th score in at most 32 halvings of a count, the union and the count in the
    same pass. The scoring is Triton because torch could score the long groups' pages up to T only after reading
    the labels and T back to the host, or else score every group's pages up to the capacity.

    The grids and every launch's values depend on T_max, the budget and P only (a budget_frac's on T_max's pages): with
    `length`, one step captured in a CUDA graph is replayed as the cache fills. Returns y (n, H, D) (or `out`) and
    labels (n, H) bool; with `with_read` also the KV entries each (row, KV head) read (n, Hkv) int64, the torch
    paths' third value, counted by the kernels as they load them: the window's positions, one entry per candidate
    page whose statistics were scored, and the chosen pages' bulk positions; with `inspect` (for tests) also the
    pages each query head attends to (n, H, W) bool (W the candidates at T_max). `split`: list entries (pages) per
    program, a multiple of block_n // P (default: enough programs to fill the GPU, as split_size). `history` as
    fused_qada's: the labels also written at a step read from device memory. `read_out`: with `with_read`, the
    (n, Hkv) int64 tensor the kernels count into and which is returned (a caller's buffer, kept from step to step so
    that a static loop records it once per step rather than copying each layer's; default: a new one). `arrived` as
    fused_qada's."""
    _launch_checks(q, out, "fused_pages")
    B, H, D = q.shape
    Hkv, T_max = k.shape[1], k.shape[2]
    G, P = H // Hkv, page_size
    block_n = block_n or max(SPLIT_LAUNCH["BLOCK_N"], P)
    if P & (P - 1) or block_n % P:
        raise ValueError(f"page_size {P} must be a power of two dividing block_n {block_n}")
    quest = form is None
    if quest and G > 31:
        raise ValueError(f"Quest in the kernel marks a page's heads in an int32: at most 31 heads per group, got {G}")
    if combine not in ("max", "sum", "share"):
        raise ValueError(f"combine takes max, sum or share, got {combine!r}")
    G_pad = max(16, triton.next_power_of_2(G))
    dev, f32 = q.device, torch.float32
    length, len_per_row = filled_length(length, B, T_max, dev)
    lo, hi = bounds
    W = candidates(T_max, n_sink, n_local, P)  # the pages a context of the capacity may choose from
    NP = pages_upto(T_max, n_sink, P) if fold else W  # fold writes the page of a key up to T_max
    if lo.shape[2] < NP or hi.shape != lo.shape:
        raise ValueError(f"bounds: (n, Hkv, NP, D) min and max keys with NP >= {NP} pages, got {tuple(lo.shape)} and "
                         f"{tuple(hi.shape)}")
    # pages each group (Quest: each head) reads: budget // P, or floor(budget_frac T) // P of each row's own T
    n_max = page_count(T_max, P, budget, budget_frac)  # at the capacity: the most any row reads
    n_read = None  # a budget in tokens: every row n_max, a constant of the bound kernel
    if budget_frac is not None:  # each row's, written by the bound kernel for the choice
        n_read = torch.empty(B, dtype=torch.int32, device=dev)
    n_sel = min(n_max, W)

    # 1. the window, and which groups read pages
    y_win = torch.empty(B, H, D, device=dev, dtype=f32)
    log_local = torch.empty(B, H, device=dev, dtype=f32)
    labels = torch.empty(B, H, device=dev, dtype=torch.int8)
    read = torch.empty(B, Hkv, device=dev, dtype=torch.int8)
    dummy = log_local  # never read where a constexpr turns it off
    if quest:
        A = bvec = cap = tau_lgt = dummy
        ca = cb = cs = None
    else:
        A, bvec = form_operands(form)
        cap, tau_lgt = tau if isinstance(tau, tuple) else kernel_thresholds(tau)
        ca, cb, cs = (correction.a, correction.b, correction.s) if correction is not None else (None, None, None)
    sm_scale = 1 / math.sqrt(D)
    w_pad = max(16, triton.next_power_of_2(n_local))
    y = torch.empty(B, H, D, device=dev, dtype=q.dtype) if out is None else out
    launch = window_launch(w_pad, q, k, v, decide=not quest)
    arrived, form_sums, parts = window_buffers(launch, B, H, Hkv, D, arrived, dummy)
    # with_read: the KV entries each (row, KV head) read, counted by the kernels as they load them (the window kernel
    # sets it: its window; the bound kernel adds the statistics it scores, the split kernel the bulk positions)
    counts = dummy
    if read_out is not None and not with_read:
        raise ValueError("read_out is counted into with with_read only")
    if with_read:
        counts = torch.empty(B, Hkv, device=dev, dtype=torch.int64) if read_out is None else \
            caller_buffer("read_out", read_out, (B, Hkv), torch.int64)
    record, step, sts, has_history = history_operands(history, B, H, dummy)
    _window_decide_kernel[(B, Hkv, parts)](
        q, k, v, rows, start, length, A, bvec, cap, tau_lgt, ca if ca is not None else dummy,
        cb if cb is not None else dummy, cs if cs is not None else dummy, y_win, log_local, labels, read, y, arrived,
        lo, hi, counts, record, step, sm_scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), A.stride(0) if not quest else 0, A.stride(1) if not quest else 0,
        bvec.stride(0) if not quest else 0, bvec.stride(1) if not quest else 0, y.stride(0), y.stride(1),
        lo.stride(0), lo.stride(1), lo.stride(2), hi.stride(0), hi.stride(1), hi.stride(2), sts,
        H=H, HKV=Hkv, G=G, G_PAD=G_pad, D=D, N_SINK=n_sink, N_LOCAL=n_local, W_PAD=w_pad,
        RULE=RULES["mean"], HAS_CAL=ca is not None, HAS_SCALE=cs is not None, LEN_PER_ROW=len_per_row,
        DECIDE=not quest, BY_ROW=out is not None, FOLD=fold, PAGE=P, COUNT=with_read, HAS_HISTORY=has_history,
        FORM_SUMS=form_sums, **launch)

    # 2. and 3. the long groups' candidate pages scored, the top ones chosen
    if n_sel > 0:
        per_head = quest or combine == "share"  # share: each head's bounds out, combined below with its window's mass
        scores = torch.empty(B, H if per_head else Hkv, W, device=dev, dtype=f32)
        block_p = min(64, max(16, triton.next_power_of_2(W)))
        _page_bound_kernel[(B, Hkv, triton.cdiv(W, block_p))](
            q, lo, hi, start, length, read, n_read if n_read is not None else dummy, scores, counts, q.stride(0),
            q.stride(1), lo.stride(0), lo.stride(1), lo.stride(2), hi.stride(0), hi.stride(1), hi.stride(2),
            scores.stride(0), scores.stride(1), W, H=H, HKV=Hkv, G=G, G_PAD=G_pad, D=D, PAGE=P, N_SINK=n_sink,
            N_LOCAL=n_local, BLOCK_P=block_p, PER_HEAD=per_head, COMBINE=int(combine == "sum"),
            LEN_PER_ROW=len_per_row, COUNT=with_read, N_READ_ALL=n_max if n_read is None else -1,
            FRAC_BITS=0 if budget_frac is None else float64_bits(budget_frac),
            num_warps=BOUND_LAUNCH["num_warps"], LOW=low(BOUND_LAUNCH, q, lo, hi))
        if combine == "share" and not quest:  # one ranking per group: the most any head's share could be (n, Hkv, W)
            scores = group_ranking(scores.view(B * Hkv, G, W), combine, log_local.view(B * Hkv, G), P,
                                   sm_scale).view(B, Hkv, W)
        ids, heads, n_valid = choose_pages(scores, n_read, n_sel, Hkv, ranked=budget_frac is not None)
    else:  # less than a page of budget, or no bulk at the capacity: the window only
        ids = torch.zeros(B, Hkv, 1, dtype=torch.int64, device=dev)
        heads, n_valid = None, torch.zeros(B, Hkv, dtype=torch.int32, device=dev)

    # 4. the chosen pages read in splits of the list, merged with the window
    tile_pages = block_n // P
    split = split or page_split(B * Hkv, ids.shape[2], tile_pages, dev)
    if split % tile_pages:
        raise ValueError(f"split {split} (pages) must be a multiple of block_n // page_size = {tile_pages}")
    n_splits = triton.cdiv(ids.shape[2], split)
    o_part = torch.empty(B, Hkv, n_splits, G, D, device=dev, dtype=f32)
    m_part = torch.empty(B, Hkv, n_splits, G, device=dev, dtype=f32)
    l_part = torch.empty(B, Hkv, n_splits, G, device=dev, dtype=f32)
    if inspect:  # (tests) what no split program writes is NaN: a merge that read it would say so
        for x in (o_part, m_part, l_part):
            x.fill_(math.nan)
    _split_attention_kernel[(B, Hkv, n_splits)](
        q, k, v, rows, start, length, read, labels, y_win, log_local, o_part, m_part, l_part, arrived, y, n_splits,
        sm_scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), y.stride(0), y.stride(1), ids, heads if heads is not None else ids, n_valid, counts,
        ids.stride(0), ids.stride(1), H=H, HKV=Hkv, G=G, G_PAD=G_pad, D=D, SPLIT=split, BLOCK_N=block_n,
        LOW=tensor_cores(q, k, v), LEN_PER_ROW=len_per_row, PAGED=True, PAGE=P,
        N_SINK=n_sink, N_LOCAL=n_local, PER_HEAD=heads is not None, COUNT=with_read, BY_ROW=out is not None,
        **split_launch(G))
    result = (y, labels.view(torch.bool))
    if with_read:
        result += (counts,)
    if inspect:
        result += (chosen_mask(ids, heads, n_valid, G, W),)
    return result


def choose_pages(scores: torch.Tensor, n_read: torch.Tensor | None, n_sel: int, Hkv: int, ranked: bool = True):
    """The pages each (row, KV head) reads, from the candidates' scores (n, R, W) (-inf: not a candidate): the
    n_read (n,) highest finite ones of each ranking, R = Hkv rankings (one per group) or H (one per query head:
    Quest), n_sel >= n_read the budget's pages at the capacity. Returns page numbers ids (n, Hkv, U), of which the
    first n_valid (n, Hkv) are read, each once, in page order, and per entry the bits of the query heads that chose
    it (n, Hkv, U) int32, or None when a group's heads all read its pages. One launch of _page_select_kernel per
    call, with fixed shapes: nothing is read back to the host. `ranked` False: every ranking takes its n_sel (a budget
    in tokens; n_read is not read and None will do)."""
    n, R, W = scores.shape
    if scores.dtype != torch.float32 or scores.stride(2) != 1:
        raise ValueError(f"choose_pages reads fp32 scores with unit stride over each ranking, got {scores.dtype} "
                         f"with strides {scores.stride()}")
    per_head = R != Hkv
    G, dev = R // Hkv, scores.device
    U = min(G * n_sel, W) if per_head else n_sel
    ids = torch.empty(n, Hkv, U, dtype=torch.int64, device=dev)
    heads = torch.empty(n, Hkv, U, dtype=torch.int32, device=dev) if per_head else None
    n_valid = torch.empty(n, Hkv, dtype=torch.int32, device=dev)
    r_pad, w_pad = triton.next_power_of_2(G) if per_head else 1, triton.next_power_of_2(W)
    # the unread pointers (N_READ unranked, HEADS of a group) are any int32 tensor; the (R_PAD, W_PAD) tile spreads
    # over more warps at long contexts (W 8k at 128k) rather than more registers per thread
    _page_select_kernel[(n, Hkv)](scores, n_read if ranked else n_valid, ids, heads if per_head else n_valid, n_valid,
                                  n_sel, W, U, scores.stride(0), scores.stride(1), HKV=Hkv, G=G, R_PAD=r_pad,
                                  W_PAD=w_pad, PER_HEAD=per_head, RANKED=ranked,
                                  num_warps=min(16, max(4, r_pad * w_pad // 1024)))
    return ids, heads, n_valid


def chosen_mask(ids: torch.Tensor, heads: torch.Tensor | None, n_valid: torch.Tensor, G: int, W: int) -> torch.Tensor:
    """choose_pages' lists as the pages each query head attends to, (n, H, W) bool (for tests and reports)."""
    n, Hkv, U = ids.shape
    valid = torch.arange(U, device=ids.device) < n_valid[..., None]  # (n, Hkv, U)
    bits = heads if heads is not None else torch.full_like(ids, (1 << G) - 1)
    mine = (bits[:, :, None] >> torch.arange(G, device=ids.device)[:, None]) & 1  # (n, Hkv, G, U)
    mine = mine * valid[:, :, None]
    mask = torch.zeros(n, Hkv, G, W + 1, dtype=torch.long, device=ids.device)
    mask.scatter_add_(3, ids.clamp(max=W)[:, :, None].expand(-1, -1, G, -1), mine.long())
    return (mask[..., :W] > 0).view(n, Hkv * G, W)


def page_split(n_programs: int, U: int, tile_pages: int, device: torch.device) -> int:
    """Pages per split program for lists of up to U pages: enough programs that the long groups fill
    the GPU (at most 64 per group), a power of two of whole tiles (tile_pages pages each)."""
    slots = 4 * (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8)
    per_group = min(64, triton.cdiv(slots, n_programs))
    return max(tile_pages, triton.next_power_of_2(triton.cdiv(U, per_group)))
