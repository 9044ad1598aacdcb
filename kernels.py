"""QAdA's decode step fused on the GPU: the decision and its skipping in three Triton kernels per layer, for a batch of
rows, with nothing read back to the host (the same labels and output as attention.qada, up to fp32 rounding).

Three kernels, each a fixed grid:
  1. per (row, KV head), `_window_decide_kernel`: the window's attention and log mass for the G query heads together,
     Eq. 6's Gaussian term, the calibration's correction, the threshold of Eq. 7, and the group's flag "read the cache";
  2. per (row, KV head, split of the context), `_split_attention_kernel`: flash-decoding's partial attention, a program
     returning at once when its group is local, so a local group's cache is never read;
  3. per (row, KV head), `_merge_kernel`: the splits merged by their log-sum-exp, the window's output kept for the
     local heads.

The kernels read the filled length T and each row's first position from device memory, and their grids and
compile-time constants depend on the cache's capacity only (fused_qada's `length`): one step captured in a CUDA graph
can be replayed as the cache fills, with T a device tensor advanced in place.

`fused` says when the qada paths take it (attention.run_path, attention.BatchAttention). Triton is optional: CUDA
builds of torch bring it, and the torch paths need nothing of it. On CPU tensors the kernels run under Triton's
interpreter (TRITON_INTERPRET=1, read when they are defined), which is how the tests run them
(tests/test_kernel.py).
"""

import math
import os

import torch

try:  # the fused kernel's compiler: optional, CUDA builds of torch bring it; the torch paths need nothing of it
    import triton
    import triton.language as tl
except ImportError:
    triton = None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter runs the kernels (the tests)

from criterion import GROUP_RULES, Correction, tau_logit

RULES = {None: 0, "mean": 1, "all": 2}  # criterion.local_labels' rules, as the kernel's constexpr
assert set(RULES) == {None, *GROUP_RULES}


def fused(q: torch.Tensor) -> bool:
    """Whether the qada paths take the fused kernel: QADA_KERNEL=triton forces it (on CPU tensors it needs Triton's
    interpreter, TRITON_INTERPRET=1), QADA_KERNEL=torch forces the torch path, and auto (the default) takes the kernel
    on CUDA tensors when triton is installed."""
    choice = os.environ.get("QADA_KERNEL", "auto")
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"QADA_KERNEL takes auto, triton or torch; got {choice!r}")
    if choice == "triton" and triton is None:
        raise RuntimeError("QADA_KERNEL=triton, but triton is not installed (pip install triton)")
    D = q.shape[-1]
    kernel_dim = D >= 16 and D & (D - 1) == 0  # tl.dot's smallest tile and tl.arange's powers of two
    if choice == "triton" and not kernel_dim and not INTERPRETED:
        raise ValueError(f"QADA_KERNEL=triton: the kernel takes head dims that are powers of two from 16, not {D}")
    return choice == "triton" or (choice == "auto" and q.is_cuda and triton is not None and kernel_dim)


if triton is not None:

    @triton.jit
    def _window_decide_kernel(Q, K, V, ROWS, START, LENGTH, A, BV, TAU, TAU_LOGIT, CA, CB, CS, Y_WIN, LOG_LOCAL,
                              LABELS, READ, sm_scale, sqb, sqh, skb, skh, skt, svb, svh, svt, sab, sah, sbb, sbh,
                              H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                              D: tl.constexpr, N_SINK: tl.constexpr, N_LOCAL: tl.constexpr, W_PAD: tl.constexpr,
                              RULE: tl.constexpr, HAS_CAL: tl.constexpr, HAS_SCALE: tl.constexpr,
                              BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, LEN_PER_ROW: tl.constexpr):
        b, g = tl.program_id(0), tl.program_id(1)
        row = tl.load(ROWS + b)  # the cache row of this program's query
        start = tl.load(START + b)
        T = tl.load(LENGTH + b * LEN_PER_ROW)  # the filled length, from device memory (one for all rows, or each's)
        n_ctx = T - start
        h = tl.arange(0, G_PAD)
        h_ok = h < G
        d = tl.arange(0, D)
        q_rows = Q + b * sqb + (g * G + h)[:, None] * sqh
        q = tl.load(q_rows + d[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)  # (G_PAD, D)
        # The window, the first N_SINK and the last N_LOCAL - N_SINK positions (or the whole context if shorter), in
        # blocks of BLOCK_W with a running softmax: small tiles keep the program in registers. Exact fp32 products
        # (not TF32), so that the labels are the torch path's.
        short = n_ctx <= N_LOCAL
        m = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_sum = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D), tl.float32)
        for w0 in range(0, W_PAD, BLOCK_W):  # block 0 holds position 0, so m is finite after it
            w = w0 + tl.arange(0, BLOCK_W)
            pos = tl.where(short | (w < N_SINK), start + w, T - N_LOCAL + w)
            w_ok = tl.where(short, w < n_ctx, w < N_LOCAL)
            kw = tl.load(K + row * skb + g * skh + pos[:, None] * skt + d[None, :], mask=w_ok[:, None], other=0.0)
            vw = tl.load(V + row * svb + g * svh + pos[:, None] * svt + d[None, :], mask=w_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(kw.to(tl.float32)), input_precision="ieee") * sm_scale  # (G_PAD, BLOCK_W)
            s = tl.where(w_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, vw.to(tl.float32), input_precision="ieee")
            m = m_new
        y = acc / l_sum[:, None]  # (G_PAD, D)
        log_local = m + tl.log(l_sum)
        tl.store(Y_WIN + (b * H + g * G + h)[:, None] * D + d[None, :], y, mask=h_ok[:, None])
        tl.store(LOG_LOCAL + b * H + g * G + h, log_local, mask=h_ok)
        # Eq. 6: q A q^T + q b, with A read BLOCK_D columns at a time
        quad = tl.zeros((G_PAD,), tl.float32)
        for j0 in range(0, D, BLOCK_D):
            j = j0 + tl.arange(0, BLOCK_D)
            a_cols = tl.load(A + b * sab + g * sah + d[:, None] * D + j[None, :])  # (D, BLOCK_D) fp32
            q_j = tl.load(q_rows + j[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)  # (G_PAD, BLOCK_D)
            quad += tl.sum(tl.dot(q, a_cols, input_precision="ieee") * q_j, 1)
        if HAS_SCALE:  # the variance term (q A q^T: A is Sigma / 2D) scaled per KV head
            quad = quad * tl.load(CS + g)
        bv = tl.load(BV + b * sbb + g * sbh + d)
        expo = quad + tl.sum(q * bv[None, :], 1)
        # Eq. 7: log A_bulk = log T_bulk + the exponent, corrected, against the threshold
        log_bulk = expo + tl.log(tl.maximum(n_ctx - N_LOCAL, 1).to(tl.float32))
        if HAS_CAL:
            ca = tl.load(CA + g * G + h, mask=h_ok, other=0.0)
            cb = tl.load(CB + g * G + h, mask=h_ok, other=1.0)
            log_bulk = log_local - (ca + cb * (log_local - log_bulk))
        tau = tl.load(TAU + b)
        r = log_local - log_bulk
        local = r >= tl.load(TAU_LOGIT + b)  # criterion.tau_logit's, so both paths compare with the same fp32 number
        if RULE == 1:  # "mean": the group's mean share, every head follows
            share = tl.where(h_ok, 1.0 / (1.0 + tl.exp(-r)), 0.0)
            local = (tl.zeros((G_PAD,), tl.int32) + (tl.sum(share, 0) / G >= tau).to(tl.int32)) != 0
        if RULE == 2:  # "all": every head of the group, every head follows
            n_long = tl.sum(tl.where(h_ok & ~local, 1, 0), 0)
            local = (tl.zeros((G_PAD,), tl.int32) + n_long) == 0
        local = local | (tl.zeros((G_PAD,), tl.int32) + short.to(tl.int32) != 0)  # no bulk: all exact on the window
        tl.store(LABELS + b * H + g * G + h, local.to(tl.int8), mask=h_ok)
        tl.store(READ + b * HKV + g, (tl.sum(tl.where(h_ok & ~local, 1, 0), 0) > 0).to(tl.int8))

    @triton.jit
    def _split_attention_kernel(Q, K, V, ROWS, START, LENGTH, READ, O_PART, M_PART, L_PART, N_SPLITS, sm_scale,
                                sqb, sqh, skb, skh, skt, svb, svh, svt,
                                H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                                D: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, LOW: tl.constexpr,
                                LEN_PER_ROW: tl.constexpr):
        b, g, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        T = tl.load(LENGTH + b * LEN_PER_ROW)
        lo = tl.load(START + b) + sp * SPLIT
        if lo >= T:  # a split past the filled length (the grid covers the capacity): nothing to read or write
            return
        if tl.load(READ + b * HKV + g) == 0:  # a local group: its cache is not read
            return
        row = tl.load(ROWS + b)
        h = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        part = ((b * HKV + g) * N_SPLITS + sp) * G_PAD + h  # (G_PAD,) rows of this split's partial results
        hi = tl.minimum(lo + SPLIT, T)
        m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D), tl.float32)
        q = tl.load(Q + b * sqb + (g * G + h)[:, None] * sqh + d[None, :], mask=(h < G)[:, None], other=0.0)
        if not LOW:
            q = q.to(tl.float32)
        for i in range(SPLIT // BLOCK_N):  # a fixed trip count; the tail of the context is masked
            offs = lo + i * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = offs < hi
            kt = tl.load(K + row * skb + g * skh + offs[:, None] * skt + d[None, :], mask=ok[:, None], other=0.0)
            vt = tl.load(V + row * svb + g * svh + offs[:, None] * svt + d[None, :], mask=ok[:, None], other=0.0)
            if LOW:  # bf16 / fp16 cache: tensor-core products of the stored values, fp32 sums (as flash attention)
                s = tl.dot(q, tl.trans(kt)) * sm_scale
            else:  # exact fp32 products, not TF32
                s = tl.dot(q, tl.trans(kt.to(tl.float32)), input_precision="ieee") * sm_scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if LOW:
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            m_i = m_new
        tl.store(M_PART + part, m_i)
        tl.store(L_PART + part, l_i)
        tl.store(O_PART + part[:, None] * D + d[None, :], acc)

    @triton.jit
    def _merge_kernel(Y_WIN, LABELS, READ, O_PART, M_PART, L_PART, Y, ROWS, START, LENGTH, syb, syh,
                      N_SPLITS, H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                      D: tl.constexpr, SPLIT: tl.constexpr, BY_ROW: tl.constexpr, LEN_PER_ROW: tl.constexpr):
        b, g = tl.program_id(0), tl.program_id(1)
        h = tl.arange(0, G_PAD)
        h_ok = h < G
        d = tl.arange(0, D)
        rows = (b * H + g * G + h)[:, None] * D + d[None, :]
        y = tl.load(Y_WIN + rows, mask=h_ok[:, None], other=0.0)
        if tl.load(READ + b * HKV + g) != 0:
            base = (b * HKV + g) * N_SPLITS * G_PAD
            # the splits that hold filled positions, the ones that ran (a split past them adds exactly nothing)
            n_used = (tl.load(LENGTH + b * LEN_PER_ROW) - tl.load(START + b) + SPLIT - 1) // SPLIT
            m = tl.full((G_PAD,), float("-inf"), tl.float32)
            for sp in range(0, n_used):
                m = tl.maximum(m, tl.load(M_PART + base + sp * G_PAD + h))
            l_sum = tl.zeros((G_PAD,), tl.float32)
            acc = tl.zeros((G_PAD, D), tl.float32)
            for sp in range(0, n_used):
                m_s = tl.load(M_PART + base + sp * G_PAD + h)
                scale = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m))
                l_sum += tl.load(L_PART + base + sp * G_PAD + h) * scale
                acc += tl.load(O_PART + (base + sp * G_PAD + h)[:, None] * D + d[None, :]) * scale[:, None]
            local = tl.load(LABELS + b * H + g * G + h, mask=h_ok, other=1) != 0
            y = tl.where(local[:, None], y, acc / l_sum[:, None])
        y_b = b
        if BY_ROW:  # the output's row is the cache row's: the result lands in the caller's tensor
            y_b = tl.load(ROWS + b)
        out = Y + y_b * syb + (g * G + h)[:, None] * syh + d[None, :]
        tl.store(out, y.to(Y.dtype.element_ty), mask=h_ok[:, None])  # in the output's dtype: no cast launched after


def split_size(n_programs: int, T_max: int, device: torch.device, block_n: int = 64) -> int:
    """Context positions per split program, for a context of up to T_max positions (the views fused_qada is given:
    the filled length, or the cache's capacity): enough splits that the long-context groups' programs fill the GPU
    (four per multiprocessor if every (row, KV head) reads), at most 64 splits per group. A power of two from 256
    (whole blocks of block_n): the split is a compile-time constant of the kernel, so eager steps over a context
    growing from 8k to 128k compile a few variants, not one per step, and a captured step over a fixed capacity one."""
    slots = 4 * (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8)
    per_group = min(64, triton.cdiv(slots, n_programs))
    return max(256, block_n, triton.next_power_of_2(triton.cdiv(T_max, per_group)))


def kernel_thresholds(tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tau (n,) float64 -> the kernel's thresholds, tau and criterion.tau_logit(tau), both (n,) fp32: a caller that
    decides every layer with the same taus makes them once instead of launching their arithmetic per layer."""
    return tau.float(), tau_logit(tau.double())


def fused_qada(q, k, v, rows, start, n_sink: int, n_local: int, form, tau, rule: str | None = None,
               correction: Correction | None = None, length: torch.Tensor | None = None, split: int | None = None,
               block_n: int = 64, count_reads: bool = False, out=None):
    """QAdA for one layer and n rows in three Triton kernels: the same labels and output as the `qada` path of each
    row, up to fp32 rounding. q (n, H, D), any strides but the last; k, v (B, Hkv, T_max, D), views of the cache (any
    stride over T), of which row rows[i] is query i's (integers, (n,)); start (n,), each row's first filled position
    (left padding); form: each row's (A (n, Hkv, D, D), b (n, Hkv, D)) fp32; tau (n,), float64 so that the threshold
    is criterion.tau_logit's, or kernel_thresholds(tau); rule as criterion.local_labels; correction: one layer's
    criterion.Correction (Calibration.layer()). Returns y (n, H, D) in q's dtype and labels (n, H) bool, on
    the device; with `out` (B, H, D), any strides but the last, query i's output is written to out[rows[i]] in out's
    dtype instead and out is returned. With `count_reads` (for tests) also the splits of each (row, KV head)
    that read the cache, (n, Hkv). `split`: context positions per program (default split_size's for T_max).

    `length`: the filled length T, an int32 device tensor, 0-d or (1,) for every row or (n,) for each query's row;
    the views may then run to the cache's capacity T_max > T (model.KVCache's whole buffer), and nothing the kernels
    are launched with changes as T grows: one step captured in a CUDA graph is replayed as the cache fills, T advanced
    in place. Without it, T is the views' own length (T_max), put into a device tensor here."""
    if triton is None:
        raise RuntimeError("the fused kernel needs triton (pip install triton); the torch path runs without it")
    B, H, D = q.shape
    if q.stride(-1) != 1 or (out is not None and out.stride(-1) != 1):
        raise ValueError("fused_qada reads q and writes its output with unit stride over the head dim")
    Hkv, T_max = k.shape[1], k.shape[2]
    G = H // Hkv
    G_pad = max(16, triton.next_power_of_2(G))  # tl.dot's smallest tile
    dev, f32 = q.device, torch.float32
    if length is None:  # the views end at the filled length
        length = torch.full((1,), T_max, dtype=torch.int32, device=dev)
    if length.dtype != torch.int32 or length.device != dev or length.numel() not in (1, B):
        raise ValueError(f"length: an int32 tensor of 1 or {B} elements on {dev}, got {length.dtype} "
                         f"{tuple(length.shape)} on {length.device}")
    len_per_row = int(length.numel() == B > 1)  # a constexpr: row b reads LENGTH[b * len_per_row]
    # The grid and the split size come from the capacity T_max, not from T: the split is a compile-time constant (the
    # inner loop's trip count) and a captured graph replays one grid, so neither may follow T from step to step.
    # Programs past the filled length load two integers and return at once: up to 64 idle programs per (row, KV
    # head), a fraction of a wave of launch slots. The larger cost is parallelism: at T = T_max / 8 only one in eight
    # of a group's programs read, so a small batch fills the GPU less than splits sized for T would; a few graphs,
    # one per bucket of capacities, bound that.
    split = split or split_size(B * Hkv, T_max, q.device, block_n)
    if split % block_n:
        raise ValueError(f"split {split} must be a multiple of block_n {block_n}")
    n_splits = triton.cdiv(T_max, split)
    A, bvec = (x.to(f32).contiguous() for x in form)
    y_win = torch.empty(B, H, D, device=dev, dtype=f32)
    log_local = torch.empty(B, H, device=dev, dtype=f32)
    labels = torch.empty(B, H, device=dev, dtype=torch.int8)
    read = torch.empty(B, Hkv, device=dev, dtype=torch.int8)
    ca, cb, cs = (correction.a, correction.b, correction.s) if correction is not None else (None, None, None)
    tau_f32, tau_lgt = tau if isinstance(tau, tuple) else kernel_thresholds(tau)
    dummy = log_local  # never read: HAS_CAL / HAS_SCALE are off
    sm_scale = 1 / math.sqrt(D)
    w_pad = max(16, triton.next_power_of_2(n_local))
    _window_decide_kernel[(B, Hkv)](
        q, k, v, rows, start, length, A, bvec, tau_f32, tau_lgt, ca if ca is not None else dummy,
        cb if cb is not None else dummy, cs if cs is not None else dummy, y_win, log_local, labels, read, sm_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        A.stride(0), A.stride(1), bvec.stride(0), bvec.stride(1),
        H=H, HKV=Hkv, G=G, G_PAD=G_pad, D=D, N_SINK=n_sink, N_LOCAL=n_local,
        W_PAD=w_pad, RULE=RULES[rule], HAS_CAL=ca is not None,
        HAS_SCALE=cs is not None, BLOCK_W=min(32, w_pad), BLOCK_D=min(32, D), LEN_PER_ROW=len_per_row)
    o_part = torch.empty(B, Hkv, n_splits, G_pad, D, device=dev, dtype=f32)
    m_part = torch.empty(B, Hkv, n_splits, G_pad, device=dev, dtype=f32)
    if count_reads:
        m_part.fill_(math.inf)  # what no split program writes: a max score is finite, -inf or NaN
    l_part = torch.empty(B, Hkv, n_splits, G_pad, device=dev, dtype=f32)
    _split_attention_kernel[(B, Hkv, n_splits)](
        q, k, v, rows, start, length, read, o_part, m_part, l_part, n_splits, sm_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        H=H, HKV=Hkv, G=G, G_PAD=G_pad, D=D, SPLIT=split, BLOCK_N=block_n,
        LOW=k.dtype != torch.float32 and not INTERPRETED,  # the interpreter multiplies bf16 tiles wrongly
        LEN_PER_ROW=len_per_row)
    y = torch.empty(B, H, D, device=dev, dtype=q.dtype) if out is None else out
    _merge_kernel[(B, Hkv)](y_win, labels, read, o_part, m_part, l_part, y, rows, start, length, y.stride(0),
                            y.stride(1), n_splits, H=H, HKV=Hkv, G=G, G_PAD=G_pad, D=D, SPLIT=split,
                            BY_ROW=out is not None, LEN_PER_ROW=len_per_row)
    labels = labels.view(torch.bool)  # 0 / 1 bytes reinterpreted, no launch
    if count_reads:  # a split that read the cache wrote its max score
        return y, labels, (m_part[..., 0] != math.inf).sum(-1)
    return y, labels
