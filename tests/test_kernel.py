"""The fused Triton decode step (decode_kernels.fused_qada) against the torch paths, and every path's skipping: a KV
group labelled local must not be read. On a machine without CUDA the kernels run under Triton's interpreter
(TRITON_INTERPRET=1, set by conftest.py), on CPU tensors."""

import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import attention
import decode_kernels
from attention import BatchAttention, DecodeAttention, qada, reference_attention
from criterion import Calibration, Correction, gaussian_form, gaussian_log_bulk
from decode_kernels import fused_qada
from lab.kernel_resources import Launch  # a recording stand-in for a kernel
from moments import FixedMoments
from tests.test_qada import random_cov

triton = pytest.importorskip("triton")

N_SINK, N_LOCAL = 4, 32


class Form:
    """A row's fixed quadratic form, as moments.KeyMoments hands it to the qada path."""

    def __init__(self, A, b):
        self.A, self.b = A, b

    def quadratic_form(self, layer, k):
        return self.A, self.b


def case(B, H, Hkv, D, T, seed=0, dtype=torch.float32):
    """q (B, H, D), a cache (B, Hkv, T, D) whose sinks pull some heads local, and each row's quadratic form."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g) * 2
    k, v = torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    G = H // Hkv
    k[:, :, :N_SINK] += 2 * q.view(B, Hkv, G, D).mean(2)[:, :, None]  # strong sinks: some heads local
    mean = torch.randn(B, Hkv, D, generator=g) * 0.3
    cov = torch.stack([random_cov(Hkv, D, seed=seed + i) for i in range(B)]) * 0.2
    A, b = gaussian_form(mean, cov)
    return q.to(dtype), k.to(dtype), v.to(dtype), A, b


def tie_free(q, k, start, A, b, tau, margin=1e-3):
    """Heads whose estimated log ratio is not within `margin` of the threshold (fp32 rounding may flip those)."""
    from attention import window_attention
    from criterion import gaussian_log_bulk
    out = []
    for i in range(q.shape[0]):
        kk = k[i, :, int(start[i]):].float()
        T = kk.shape[1]
        if T <= N_LOCAL:
            out.append(torch.ones(q.shape[1], dtype=torch.bool))
            continue
        _, log_local = window_attention(q[i].float(), kk, kk, N_SINK, N_LOCAL)
        r = log_local - gaussian_log_bulk(q[i].float(), (A[i], b[i]), T - N_LOCAL)
        out.append((r - math.log(tau[i] / (1 - tau[i]))).abs() > margin)
    return torch.stack(out)


@pytest.mark.parametrize("rule", [None, "mean", "all"])
@pytest.mark.parametrize("H, Hkv, D", [(4, 4, 16), (6, 2, 16), (8, 2, 64), (16, 2, 16)],
                         ids=["G1", "G3", "G4-D64", "G8"])
@pytest.mark.parametrize("T", [20, N_LOCAL, N_LOCAL + 1, 301])
def test_the_kernel_decides_and_attends_as_the_torch_path(rule, H, Hkv, D, T, monkeypatch):
    monkeypatch.setenv("QADA_KERNEL", "torch")
    B = 3
    q, k, v, A, b = case(B, H, Hkv, D, T, seed=T + H)
    start = torch.tensor([0, min(7, T - 1), max(T - N_LOCAL - 1, 0)], dtype=torch.int32)  # left padding per row
    tau = [0.6, 0.3, 0.9]
    y, labels = fused_qada(q, k, v, torch.arange(B, dtype=torch.int32), start, N_SINK, N_LOCAL, (A, b),
                           torch.tensor(tau), rule, split=64, block_n=16)
    ok = tie_free(q, k, start, A, b, tau)
    if rule is not None:  # a group's decision: leave out groups with a head near the threshold
        ok = ok.view(B, Hkv, -1).all(-1, keepdim=True).expand(-1, -1, H // Hkv).reshape(B, H)
    for i in range(B):
        s = int(start[i])
        want_y, want = qada(q[i], k[i, :, s:], v[i, :, s:], layer=0, n_sink=N_SINK, n_local=N_LOCAL, tau=tau[i],
                            moments=Form(A[i], b[i]), rule=rule)
        assert torch.equal(labels[i][ok[i]], want[ok[i]])
        ref = reference_attention(q[i], k[i, :, s:], v[i, :, s:], labels[i], N_SINK, N_LOCAL)
        torch.testing.assert_close(y[i].float(), ref, atol=2e-5, rtol=1e-4)
    assert y.dtype == q.dtype and labels.dtype == torch.bool


@pytest.mark.parametrize("T", [15, 20, 21, 150])
def test_a_window_of_no_power_of_two_decides_and_attends_as_the_torch_path(T, monkeypatch):
    """--n-sink 3 --n-local 20: the kernel pads the window to 32 slots, and the 12 past the window must stay out of
    its mass and output (they would read past the filled length, or a recent key twice). Labels away from the
    threshold and outputs as the torch path's, per row with its own left padding, in a cache filled to T of T + 4."""
    monkeypatch.setenv("QADA_KERNEL", "torch")
    n_sink, n_local, B, H, Hkv, D = 3, 20, 2, 6, 2, 16
    q, k, v, A, b = case(B, H, Hkv, D, T + 4, seed=T)
    start = torch.tensor([0, 4], dtype=torch.int32)
    y, labels = fused_qada(q, k, v, torch.arange(B, dtype=torch.int32), start, n_sink, n_local, (A, b),
                           torch.tensor([0.5, 0.5]), None, split=64, block_n=16,
                           length=torch.tensor(T, dtype=torch.int32))  # 4 positions past T: capacity not yet filled
    for i in range(B):
        s = int(start[i])
        kk, vv = k[i, :, s:T], v[i, :, s:T]
        _, want = qada(q[i], kk, vv, layer=0, n_sink=n_sink, n_local=n_local, tau=0.5, moments=Form(A[i], b[i]))
        if kk.shape[1] > n_local:  # away from the threshold: fp32 rounding may flip a head on it
            _, log_local = attention.window_attention(q[i], kk, vv, n_sink, n_local)
            far = (log_local - gaussian_log_bulk(q[i], (A[i], b[i]), kk.shape[1] - n_local)).abs() > 1e-3
        else:
            far = torch.ones(H, dtype=torch.bool)
        assert torch.equal(labels[i][far], want[far])
        ref = reference_attention(q[i], kk, vv, labels[i], n_sink, n_local)
        torch.testing.assert_close(y[i].float(), ref, atol=2e-5, rtol=1e-4)


def test_bf16_caches_and_a_correction(monkeypatch):
    monkeypatch.setenv("QADA_KERNEL", "torch")
    B, H, Hkv, D, T = 2, 6, 2, 64, 257
    q, k, v, A, b = case(B, H, Hkv, D, T, seed=5, dtype=torch.bfloat16)
    ca, cb, cs = torch.linspace(-2, 2, H), torch.full((H,), 0.7), torch.tensor([0.5, 1.5])
    start = torch.zeros(B, dtype=torch.int32)
    y, labels = fused_qada(q, k, v, torch.arange(B, dtype=torch.int32), start, N_SINK, N_LOCAL, (A, b),
                           torch.tensor([0.5, 0.5]), None, Correction(ca, cb, cs), split=128, block_n=32)
    for i in range(B):
        want_y, want = qada(q[i], k[i], v[i], layer=0, n_sink=N_SINK, n_local=N_LOCAL, tau=0.5,
                            moments=Form(A[i], b[i]), correction=Correction(ca, cb, cs))
        assert (labels[i] == want).float().mean() >= 5 / 6  # bf16 scores: a head may sit on the threshold
        ref = reference_attention(q[i], k[i], v[i], labels[i], N_SINK, N_LOCAL)
        torch.testing.assert_close(y[i].float(), ref, atol=3e-2, rtol=3e-2)
    assert y.dtype == torch.bfloat16


@pytest.mark.parametrize("spread", [1, 4])
@pytest.mark.parametrize("rule, order", [(None, "in order"), ("mean", "in order"), (None, "interleaved")])
@pytest.mark.parametrize("taus", [(0.6, 0.3, 0.9), (0.05, 0.05, 0.05), (0.99, 0.99, 0.99), (0.6, 0.9, 0.99)],
                         ids=["mixed", "all-local", "mostly-long", "uneven"])
def test_spread_programs_decide_and_attend_as_the_fixed_splits(rule, taus, spread, order, monkeypatch):
    """SPLIT_LAUNCH's SPREAD: the grid's programs dealt out to the long groups alone, each long group's context cut
    into as many pieces as it gets programs, up to SPREAD times the fixed splits (here 5; with 3 groups of 6 long,
    10 pieces at 4, 5 at 1), give the fixed splits' labels and, up to fp32 rounding, their output; fused_dense (every
    group long) likewise. The programs left over (the grid's 30 less what the long groups take: 2 where the "mean"
    rule leaves 4 groups long at "uneven", 7 programs each) write nothing and count nowhere: every arrival count is
    zero again after the step. Run in the interpreter's order (one group's pieces after another's) and interleaved
    (the grid's last axis slowest), so that groups whose slots overlapped would overwrite each other's partial results
    before their merge."""
    B, H, Hkv, D, T = 3, 6, 2, 16, 300
    q, k, v, A, b = case(B, H, Hkv, D, T, seed=7)
    rows, start = torch.arange(B, dtype=torch.int32), torch.tensor([0, 5, 40], dtype=torch.int32)
    tau = torch.tensor(taus, dtype=torch.float64)
    arrived = torch.zeros(B, Hkv, dtype=torch.int32)
    with_dense = taus == (0.6, 0.3, 0.9)  # fused_dense reads no tau: once per launch

    def step():  # into outputs of NaN: a head no program writes stays NaN
        y, labels = fused_qada(q, k, v, rows, start, N_SINK, N_LOCAL, (A, b), tau, rule, split=64, block_n=16,
                               arrived=arrived, out=torch.full_like(q, math.nan))
        dense = decode_kernels.fused_dense(q, k, v, rows, start, split=64, block_n=16,
                                           out=torch.full_like(q, math.nan)) if with_dense else None
        return y, labels, dense

    if (rule, taus) not in FIXED_SPLITS:  # the fixed splits' step, the same for every spread and order: once
        FIXED_SPLITS[rule, taus] = step()
    want = FIXED_SPLITS[rule, taus]
    monkeypatch.setitem(decode_kernels.SPLIT_LAUNCH, "SPREAD", spread)
    if order == "interleaved":
        last_axis_slowest(monkeypatch)
    got = step()
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    if with_dense:
        torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=1e-5)
    assert not arrived.any()


FIXED_SPLITS = {}  # (rule, taus) -> the step at the fixed splits (SPREAD off), for the spread test's cases


def last_axis_slowest(monkeypatch) -> None:
    """Triton's interpreter runs a grid's programs one after another, its last axis fastest: from here on, its last
    axis slowest, so that the split programs of every (row, KV head) pair run interleaved with the other pairs'."""
    from triton.runtime import interpreter
    builder = interpreter.interpreter_builder
    set_index = type(builder).set_grid_idx

    def transposed(x, y, z):
        nx, ny, nz = builder.grid_dim
        z_slow, xy = divmod((x * ny + y) * nz + z, nx * ny)  # the i-th program run is the i-th in (z, x, y) order
        return set_index(builder, xy // ny, xy % ny, z_slow)
    monkeypatch.setattr(builder, "set_grid_idx", transposed)


def parts_rotated(monkeypatch, r: int) -> None:
    """Triton's interpreter runs a grid's programs one after another, its last axis fastest: from here on, that axis
    rotated by r, program z run as (z + r) mod n, so the last to run is part (n - 1 + r) mod n of the window kernel's
    FORM_APART parts (the window's, or one of the form's slices), and the split programs start elsewhere."""
    from triton.runtime import interpreter
    builder = interpreter.interpreter_builder
    set_index = type(builder).set_grid_idx
    monkeypatch.setattr(builder, "set_grid_idx",
                        lambda x, y, z: set_index(builder, x, y, (z + r) % builder.grid_dim[2]))


FORM_CASE = dict(B=3, H=8, Hkv=2, D=64, T=300)


def form_step(tau, arrived=None):
    """fused_qada on FORM_CASE's rows (long, just past the window, short), its variance term large enough (A times 10)
    that a correction's scale moves labels."""
    B, T = FORM_CASE["B"], FORM_CASE["T"]
    q, k, v, A, b = case(*FORM_CASE.values(), seed=11)
    rows, start = torch.arange(B, dtype=torch.int32), torch.tensor([5, 40, T - N_LOCAL + 4], dtype=torch.int32)
    correction = Correction(torch.zeros(FORM_CASE["H"]), torch.ones(FORM_CASE["H"]), torch.tensor([0.6, 1.4]))
    return fused_qada(q, k, v, rows, start, N_SINK, N_LOCAL, (A * 10, b), tau, None, correction, split=64,
                      block_n=16, arrived=arrived)


@pytest.fixture(scope="module")
def form_default():
    """Each FORM_CASE row's tau that splits its heads most evenly (where a wrong form, scale or b flips some), and the
    default launch's labels and output there, whatever QADA_TEST_LAUNCH says."""
    with pytest.MonkeyPatch.context() as patch:
        for key in ("FORM_FIRST", "FORM_APART"):
            patch.setitem(decode_kernels.WINDOW_LAUNCH, key, False)
        grid = torch.linspace(0.1, 0.9, 9)
        share = torch.stack([form_step(torch.full((FORM_CASE["B"],), float(t)))[1].float().mean(1) for t in grid])
        tau = grid[(share - 0.5).abs().argmin(0)]  # (B,)
        return tau, form_step(tau)


@pytest.mark.parametrize("where", ["FORM_FIRST", "FORM_APART", "FORM_APART, rotated 1", "FORM_APART, rotated 2"])
def test_the_form_computed_before_or_beside_the_window_decides_and_attends_alike(where, form_default, monkeypatch):
    """WINDOW_LAUNCH's FORM_FIRST moves Eq. 6 ahead of the window's loop, and FORM_APART into programs of their own,
    one per BLOCK_D columns, beside the window's, the last of them to finish reading the others' results back to
    decide: the same labels and output as the default launch, bit for bit, with a correction's variance scale, at each
    row's tau that splits its heads most evenly, over rows of every kind (form_default); under the interpreter with
    each of the three parts in turn the last to run; with FORM_APART a caller's arrival counts are left at zero, ready
    for the next call. (The interpreter runs one program at a time, so that the parts that finish first leave the
    decision to the last, a GPU's race, only this test on CUDA sees; there each slice's own sum may also compile to
    another order of its additions than the one program's, which would flip a label only within fp32 rounding of its
    threshold.)"""
    rotation = int(where[-1]) if "rotated" in where else 0
    if rotation and not decode_kernels.INTERPRETED:
        pytest.skip("the order of a grid's programs is the interpreter's to rotate")
    tau, want = form_default
    for key in ("FORM_FIRST", "FORM_APART"):
        monkeypatch.setitem(decode_kernels.WINDOW_LAUNCH, key, key == where.split(",")[0])
    if rotation:
        parts_rotated(monkeypatch, rotation)
    arrived = torch.zeros(FORM_CASE["B"], FORM_CASE["Hkv"], dtype=torch.int32)
    for _ in range(2):  # the second call on the counts the first left
        got = form_step(tau, arrived)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
        assert not arrived.any()
    assert torch.equal(form_step(tau)[0], want[0])  # and on zeroed counts of its own
    assert 0 < want[1][:2].float().mean() < 1 and want[1][2].all()  # both kinds of head; a short row all local


# numpy under the interpreter warns where fp32's exp overflows to inf, which the second half asks for (a bulk share
# past fp32's range is 0); a GPU computes the same inf without a word
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_at_tau_1_the_mean_rule_reads_a_group_whose_shares_round_to_1():
    """The kernel's "mean" rule compares the group's mean bulk share with 1 - tau, as criterion.local_labels does: at
    tau = 1 a group reads its cache whenever its bulk's share is above 0 in fp32, also where a strong sink leaves the
    bulk e^-18 of the window's mass and every share rounds to 1; just below 1 the group is local; and where the bulk
    share underflows to 0 the group still reads. Labels as the torch path's, and the output its reference's."""
    B, H, Hkv, D, T = 2, 4, 2, 16, 300
    g = torch.Generator().manual_seed(3)
    q = torch.full((B, H, D), 2.0)
    k, v = torch.randn(B, Hkv, T, D, generator=g) * 0.1, torch.randn(B, Hkv, T, D, generator=g)
    k[:, :, 0] = 3.0  # the first sink: a score of 24 for every head, log A_local ~ 24 against log A_bulk ~ log 268
    A, b = torch.zeros(B, Hkv, D, D), torch.zeros(B, Hkv, D)  # Eq. 6 with no spread: A_bulk = T_bulk
    tau = [1.0, 1 - 1e-6]
    y, labels = fused_qada(q, k, v, torch.arange(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32), N_SINK,
                           N_LOCAL, (A, b), torch.tensor(tau, dtype=torch.float64), "mean", split=64, block_n=16)
    assert labels.tolist() == [[False] * H, [True] * H]
    for i in range(B):
        _, want = qada(q[i], k[i], v[i], layer=0, n_sink=N_SINK, n_local=N_LOCAL, tau=tau[i], moments=Form(A[i], b[i]),
                       rule="mean")
        assert torch.equal(labels[i], want)
        torch.testing.assert_close(y[i], reference_attention(q[i], k[i], v[i], labels[i], N_SINK, N_LOCAL),
                                   atol=2e-5, rtol=1e-4)
    # past fp32's range (a score of 120: the bulk e^-114 of the window's mass) every bulk share is 0, which meets the
    # cap 1 - tau = 0; but a share of 1 asks every head to be local on its own, and none is: read at tau = 1, as the
    # torch path reads it; local just below 1
    k[:, :, 0] = 15.0
    _, labels = fused_qada(q, k, v, torch.arange(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32), N_SINK,
                           N_LOCAL, (A, b), torch.tensor(tau, dtype=torch.float64), "mean", split=64, block_n=16)
    assert labels.tolist() == [[False] * H, [True] * H]
    _, want = qada(q[0], k[0], v[0], layer=0, n_sink=N_SINK, n_local=N_LOCAL, tau=1.0, moments=Form(A[0], b[0]),
                   rule="mean")
    assert not want.any()


@pytest.mark.parametrize("bad", ["int64", "shape", "strided"])
def test_arrival_counts_of_the_wrong_kind_are_refused(bad):
    """fused_qada's `arrived` is the kernels' own count buffer: (n, Hkv) int32 and contiguous, else a ValueError
    that says so, before any launch."""
    B, Hkv = FORM_CASE["B"], FORM_CASE["Hkv"]
    arrived = {"int64": torch.zeros(B, Hkv, dtype=torch.int64), "shape": torch.zeros(B + 1, Hkv, dtype=torch.int32),
               "strided": torch.zeros(Hkv, B, dtype=torch.int32).t()}[bad]
    with pytest.raises(ValueError, match="arrived: a contiguous"):
        form_step(torch.full((B,), 0.5), arrived)


def test_rows_that_share_a_form_read_one_copy_of_it():
    """attention.stacked_forms: rows whose moments are one object get their layer's form broadcast over them (a row
    stride of 0: no copy per row, the window kernel reads it once), and fused_qada decides and attends with it bit
    for bit as with a copy per row; rows with forms of their own get a copy each."""
    B, H, Hkv, D, T = 3, 6, 2, 16, 300
    q, k, v, A, b = case(B, H, Hkv, D, T, seed=4)
    shared = attention.stacked_forms([(A[0], b[0])] * B, q.device)
    assert shared[0].stride(0) == 0 and shared[1].stride(0) == 0
    assert decode_kernels.form_operands(shared)[0].stride(0) == 0  # the kernel is handed the broadcast, not a copy
    copies = (A[0].expand(B, -1, -1, -1).clone(), b[0].expand(B, -1, -1).clone())
    rows, start = torch.arange(B, dtype=torch.int32), torch.tensor([0, 5, 40], dtype=torch.int32)
    tau = torch.tensor([0.6, 0.3, 0.9], dtype=torch.float64)
    got = fused_qada(q, k, v, rows, start, N_SINK, N_LOCAL, shared, tau, "mean", split=64, block_n=16)
    want = fused_qada(q, k, v, rows, start, N_SINK, N_LOCAL, copies, tau, "mean", split=64, block_n=16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    own = attention.stacked_forms([(A[i], b[i]) for i in range(B)], q.device)
    assert own[0].stride(0) == Hkv * D * D and torch.equal(own[0], A)


@pytest.mark.parametrize("path", ["qada", "pages"])
def test_the_labels_are_also_written_at_the_step_the_device_holds(path):
    """fused_qada's and fused_pages' `history`: a record (S, L, B, H) of every step's labels, as the static decode loop
    keeps it, gets this call's labels at [step, layer] for the step in device memory, and nothing anywhere else (its
    other entries keep a sentinel); a record of the wrong shape is refused before any launch."""
    B, H, Hkv, D, T = 3, 6, 2, 16, 300
    q, k, v, A, b = case(B, H, Hkv, D, T, seed=2)
    rows, start = torch.arange(B, dtype=torch.int32), torch.tensor([0, 5, 40], dtype=torch.int32)
    tau = torch.tensor([0.6, 0.3, 0.9], dtype=torch.float64)
    record = torch.full((4, 2, B, H), 7, dtype=torch.int8)  # (S, L, B, H): 7 where nothing is written
    step = torch.tensor([2])
    if path == "qada":
        def call(history):
            return fused_qada(q, k, v, rows, start, N_SINK, N_LOCAL, (A, b), tau, "mean", split=64, block_n=16,
                              history=history)[1]
    else:
        from tests.test_kernel_pages import page_bounds
        bounds = page_bounds(k, start, torch.full((B,), T, dtype=torch.int32), 16)

        def call(history):
            return decode_kernels.fused_pages(q, k, v, rows, start, N_SINK, N_LOCAL, bounds, 16, budget=48, form=(A, b),
                                              tau=tau, history=history)[1]
    labels = call((record[:, 1], step))
    assert torch.equal(labels, call(None)) and 0 < labels.sum() < labels.numel()
    assert torch.equal(record[2, 1], labels.to(torch.int8))
    record[2, 1] = 7
    assert (record == 7).all()
    with pytest.raises(ValueError, match=r"^history: labels \(S, "):
        call((record[:, 1, :, :4], step))


@pytest.mark.parametrize("per_row, dtype, chunk", [(False, torch.float32, 8), (True, torch.float32, 8),
                                                   (True, torch.bfloat16, 8), (True, torch.float32, 2)])
def test_fused_dense_is_softmax_attention_over_each_rows_filled_context(per_row, dtype, chunk, monkeypatch):
    """decode_kernels.fused_dense: each query attends to its row's positions [start, T) and nothing past T (views to the
    capacity, T on the device, one for all rows or one per row), every head, written at its cache row with `out`;
    the merge reading its group's splits in chunks of MERGE_CHUNK (2, in splits of 32: a row's 7 splits in 4 chunks,
    the last one partial)."""
    monkeypatch.setattr(decode_kernels, "MERGE_CHUNK", chunk)
    split = 32 if chunk == 2 else 64
    B, H, Hkv, D, T_max = 3, 8, 2, 16, 300
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, H, D, generator=g)
    k, v = torch.randn(B, Hkv, T_max, D, generator=g), torch.randn(B, Hkv, T_max, D, generator=g)
    start = torch.tensor([0, 7, 100], dtype=torch.int32)
    T = [250, 250, 250] if not per_row else [250, 130, 299]
    length = torch.tensor(T[:1] if not per_row else T, dtype=torch.int32)
    rows = torch.tensor([2, 0, 1], dtype=torch.int32)  # query i reads cache row rows[i]
    out = torch.full((B, H, D), math.nan, dtype=dtype)
    decode_kernels.fused_dense(q.to(dtype), k.to(dtype), v.to(dtype), rows, start, length=length, split=split,
                               block_n=16, out=out)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for i in range(B):
        r, s, t = int(rows[i]), int(start[i]), T[i]
        kk = k[r, :, s:t].repeat_interleave(H // Hkv, 0)  # (H, n, D)
        vv = v[r, :, s:t].repeat_interleave(H // Hkv, 0)
        p = torch.softmax((kk @ q[i][:, :, None])[..., 0] / math.sqrt(D), -1)  # (H, n)
        torch.testing.assert_close(out[r].float(), (p[:, None] @ vv)[:, 0], **tol)


def test_fused_dense_leaves_its_flags_as_it_found_them():
    """One decode_kernels.dense_flags serves call after call (the static loop's dense, a graph replaying one launch per
    layer): the kernel leaves the groups' arrival counts at zero, so that a later call, at another length, merges
    its splits as a call with fresh flags does."""
    B, H, Hkv, D, T_max = 2, 4, 2, 16, 200
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, D, generator=g)
    k, v = torch.randn(B, Hkv, T_max, D, generator=g), torch.randn(B, Hkv, T_max, D, generator=g)
    rows, start = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 9], dtype=torch.int32)
    flags = decode_kernels.dense_flags(B, H, Hkv, q.device)
    for T in (150, 199, 120):
        length = torch.tensor([T], dtype=torch.int32)
        got = decode_kernels.fused_dense(q, k, v, rows, start, length=length, split=32, block_n=16, flags=flags)
        assert torch.equal(got, decode_kernels.fused_dense(q, k, v, rows, start, length=length, split=32, block_n=16))
        assert not flags[2].any() and flags[0].all() and not flags[1].any()


FAR_ROWS = """
import sys, torch
import decode_kernels
from criterion import gaussian_form
dev = sys.argv[1]
B, H, Hkv, D, T = 3, 8, 2, 16, 200
S = 2**30 + 64  # the rows' stride in elements: row 2 starts past 2^31, as a layer's cache of 4 GiB in bf16 does
base = torch.empty(2 * S + 2 * Hkv * T * D, dtype=torch.bfloat16, device=dev)  # only the rows' pages are touched
far = [base.as_strided((B, Hkv, T, D), (S, T * D, D, 1), offset) for offset in (0, Hkv * T * D)]  # k, v
g = torch.Generator().manual_seed(0)
near = [torch.randn(B, Hkv, T, D, generator=g).to(torch.bfloat16).to(dev) for _ in range(2)]
for x, y in zip(far, near):
    x.copy_(y)
q = torch.randn(B, H, D, generator=g).to(torch.bfloat16).to(dev)
A, b = gaussian_form(torch.randn(B, Hkv, D, generator=g).to(dev) * 0.3, torch.eye(D, device=dev).expand(B, Hkv, D, D))
rows, start = torch.arange(B, dtype=torch.int32, device=dev), torch.zeros(B, dtype=torch.int32, device=dev)
tau = torch.tensor([0.3, 0.6, 0.9], dtype=torch.float64, device=dev)
got, labels = decode_kernels.fused_qada(q, *far, rows, start, 4, 32, (A, b), tau, "mean", split=64, block_n=16)
want, want_labels = decode_kernels.fused_qada(q, *near, rows, start, 4, 32, (A, b), tau, "mean", split=64, block_n=16)
assert torch.equal(labels, want_labels) and not labels.all(), labels
assert torch.equal(got, want), (got - want).abs().amax((1, 2))
dense = decode_kernels.fused_dense(q, *far, rows, start, split=64, block_n=16)
assert torch.equal(dense, decode_kernels.fused_dense(q, *near, rows, start, split=64, block_n=16))
print("equal")
"""


def test_a_row_past_2_to_the_31_elements_is_read_where_it_lies():
    """The kernels address a cache row at row * (the rows' stride) in 64 bits: where a layer's cache passes 2^31
    elements (4 GiB in bf16, batch 32 at 64k of Llama-3-8B), an i32 product would wrap and read another layer's
    keys, silently. A row placed there gives what the same row gives in a compact cache, bit for bit. In a process of
    its own: the wrapped address is a segfault under the interpreter (an illegal address on a GPU)."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    device = str(torch.empty(0).device)  # torch's default: cuda under QADA_TEST_DEVICE=cuda
    done = subprocess.run([sys.executable, "-c", FAR_ROWS, device], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "QADA_KERNEL": "triton"}, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "equal", (done.returncode, done.stderr[-2000:])


@pytest.mark.parametrize("T_max", [8192, 32768, 32786, 36864, 131072, 131200])
@pytest.mark.parametrize("n_programs", [1, 8, 64, 256])
def test_split_size_gives_each_group_16_to_32_splits_or_more_below_twice_that(T_max, n_programs):
    """A power of two with at least 16 splits per group (32 for a few groups) and fewer than twice that, whatever
    the capacity: one just past a power of two splits as that power does, not in half as many."""
    split = decode_kernels.split_size(n_programs, T_max, torch.device("cpu"))
    per_group = 32 if n_programs == 1 else 16  # this CPU counts 8 multiprocessors: 32 slots
    assert split & (split - 1) == 0 and split >= 256
    assert per_group <= math.ceil(T_max / split) <= 2 * per_group


def test_split_size_on_an_h200_gives_the_measured_splits(monkeypatch):
    """On a GPU of 132 multiprocessors (an H200's or H100's) a 32k context splits as measured fastest there
    (results/bench-gpu): 1024 positions at batch 1 (8 KV heads: 32 splits a group, not the 64 its free slots would
    allow), 2048 at batch 8."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    cuda = torch.device("cuda")  # a name only: nothing is allocated there
    assert [decode_kernels.split_size(B * 8, 32768, cuda) for B in (1, 8)] == [1024, 2048]


def test_the_forms_and_the_history_reach_the_kernel_in_its_layout():
    """form_operands: an fp32 form whose rows' blocks are not contiguous (a transposed A) is copied into them, one of
    another dtype cast, one already so (or broadcast over rows) handed on as it is. history_operands: labels (S, B, H)
    bool or int8 with each step's block contiguous and a (1,) int64 step, else one line naming what it takes."""
    A, b = torch.randn(2, 2, 4, 4), torch.randn(2, 2, 4)
    for form in ((A.transpose(-1, -2), b), (A.double(), b)):
        got = decode_kernels.form_operands(form)
        assert all(x.dtype == torch.float32 and x[0].is_contiguous() and torch.equal(x, y.float())
                   for x, y in zip(got, form))
    assert all(x is y for x, y in zip(decode_kernels.form_operands((A, b)), (A, b)))
    dummy, labels = torch.zeros(1), torch.zeros(5, 2, 3, dtype=torch.bool)
    step = torch.zeros(1, dtype=torch.int64)
    history, got_step, stride, on = decode_kernels.history_operands((labels, step), 2, 3, dummy)
    assert history.dtype == torch.int8 and got_step is step and stride == 6 and on
    assert decode_kernels.history_operands(None, 2, 3, dummy) == (dummy, dummy, 0, False)
    for bad in ((labels.float(), step), (labels.transpose(1, 2).contiguous().transpose(1, 2), step),
                (labels, step.int()), (labels, torch.zeros(2, dtype=torch.int64)), (labels[:, :1], step)):
        with pytest.raises(ValueError, match="^history: labels \\(S, 2, 3\\) bool or int8, each step's block "
                                             "contiguous, and a \\(1,\\) int64 step"):
            decode_kernels.history_operands(bad, 2, 3, dummy)


def test_the_fused_entry_points_refuse_strides_and_splits_they_cannot_launch():
    """q and the output with unit stride over the head dim (the kernels address them so), a split of whole blocks:
    each a one-line ValueError before any launch, for fused_qada's output and fused_dense's split alike."""
    B, H, Hkv, D, T = 1, 4, 2, 16, 300
    q, k, v, A, b = case(B, H, Hkv, D, T)
    rows, start = torch.zeros(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32)
    strided = torch.empty(B, H, 2 * D)[..., ::2]
    with pytest.raises(ValueError, match="^fused_qada reads q and writes its output with unit stride"):
        fused_qada(q, k, v, rows, start, N_SINK, N_LOCAL, (A, b), torch.tensor([0.5]), out=strided)
    with pytest.raises(ValueError, match="^fused_dense reads q and writes its output with unit stride"):
        decode_kernels.fused_dense(torch.empty(B, H, 2 * D)[..., ::2], k, v, rows, start)
    with pytest.raises(ValueError, match="^split 100 must be a multiple of block_n 64"):
        decode_kernels.fused_dense(q, k, v, rows, start, split=100, block_n=64)


def test_filled_length_refuses_a_length_of_another_kind():
    """The kernels' LENGTH: int32, one or B elements, on the step's device (a kernel would read another device's
    pointer); without one, T_max in a tensor of its own, read by every row."""
    cpu = torch.device("cpu")
    for bad in (torch.zeros(1, dtype=torch.int64), torch.zeros(3, dtype=torch.int32),
                torch.zeros(1, dtype=torch.int32, device="meta")):
        with pytest.raises(ValueError, match="^length: an int32 tensor of 1 or 2 elements on cpu"):
            decode_kernels.filled_length(bad, 2, 10, cpu)
    length, per_row = decode_kernels.filled_length(None, 2, 10, cpu)
    assert length.tolist() == [10] and length.dtype == torch.int32 and per_row == 0
    assert decode_kernels.filled_length(torch.zeros(2, dtype=torch.int32), 2, 10, cpu)[1] == 1
    assert decode_kernels.filled_length(torch.zeros(1, dtype=torch.int32), 1, 10, cpu)[1] == 0  # B = 1: either


def test_the_window_kernel_is_launched_as_window_launch_says(monkeypatch):
    """decode_kernels.WINDOW_LAUNCH is read at each launch: other tiles give the same labels and output up to fp32
    rounding, and a precision tl.dot does not know fails the launch."""
    B, H, Hkv, D, T = 2, 8, 2, 64, 301
    q, k, v, A, b = case(B, H, Hkv, D, T, seed=3)
    args = (q, k, v, torch.arange(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32), N_SINK, N_LOCAL, (A, b),
            torch.tensor([0.5, 0.5]))
    y, labels = fused_qada(*args)
    monkeypatch.setitem(decode_kernels.WINDOW_LAUNCH, "BLOCK_W", 16)
    monkeypatch.setitem(decode_kernels.WINDOW_LAUNCH, "BLOCK_D", 64)
    y2, labels2 = fused_qada(*args)
    assert torch.equal(labels, labels2)
    torch.testing.assert_close(y, y2, atol=1e-5, rtol=1e-5)
    monkeypatch.setitem(decode_kernels.WINDOW_LAUNCH, "PRECISION", "no such precision")
    with pytest.raises(Exception, match="no such precision"):
        fused_qada(*args)


def test_low_products_only_where_they_are_exact(monkeypatch):
    """A launch's LOW applies to a 16-bit query and stored operand of one dtype, compiled, and only when asked."""
    bf, f32 = torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2)
    monkeypatch.setattr(decode_kernels, "INTERPRETED", False)
    on, off = {"LOW": True}, {"LOW": False}
    assert decode_kernels.low(on, bf, bf) and decode_kernels.low(on, bf.half(), bf.half())
    low = decode_kernels.low
    assert not low(off, bf, bf) and not low(on, f32, f32) and not low(on, f32, bf)
    assert not low(on, bf, bf.half()) and not low(on, bf, bf, bf.half())  # each operand: q's dtype
    monkeypatch.setattr(decode_kernels, "INTERPRETED", True)  # the interpreter multiplies 16-bit tiles wrongly
    assert not decode_kernels.low(on, bf, bf)


@pytest.mark.parametrize("method", ["qada", "qada_kv", "qada_cal", "qada_kv_all_cal"])
def test_run_path_dispatches_a_qada_path_to_the_kernel_and_the_path_itself_stays_torch(method, monkeypatch):
    """The kernel dispatch lives in attention.run_path, outside `qada` (Listing 1): with QADA_KERNEL=triton run_path
    calls decode_kernels.fused_qada and gives the torch path's labels and output, while the registered path computes in
    torch whatever is set; a context that fits the window never reaches the kernel."""
    calls = []
    real = attention.fused_qada
    monkeypatch.setattr(attention, "fused_qada", lambda *a, **kw: calls.append(method) or real(*a, **kw))
    q, k, v, A, b = case(1, 6, 2, 16, 300, seed=8)
    cal = Calibration(torch.linspace(-1, 1, 6)[None], torch.full((1, 6), 0.8), torch.tensor([[0.5, 1.5]]), {})
    given = dict(layer=0, n_sink=N_SINK, n_local=N_LOCAL, tau=0.7, moments=Form(A[0], b[0]), calibration=cal)
    inputs = {name: given[name] for name in attention.path_inputs(method)}
    q, k, v = q[0], k[0], v[0]
    monkeypatch.setenv("QADA_KERNEL", "torch")
    want_y, want = attention.run_path(method, q, k, v, **inputs)
    monkeypatch.setenv("QADA_KERNEL", "triton")
    y_path, labels_path = attention.PATHS[method](q, k, v, **inputs)
    assert calls == [] and torch.equal(labels_path, want) and torch.equal(y_path, want_y)
    attention.run_path(method, q, k[:, :N_LOCAL], v[:, :N_LOCAL], **inputs)
    assert calls == []
    y, labels = attention.run_path(method, q, k, v, **inputs)
    assert calls == [method]
    assert torch.equal(labels, want) and 0 < int(labels.sum()) < len(labels)  # some heads local, some not
    torch.testing.assert_close(y, want_y, atol=2e-5, rtol=1e-4)


def test_run_path_gives_the_kernel_the_moments_and_correction_of_its_layer(monkeypatch):
    """At layer 1 of two whose moments (then whose corrections) differ, run_path's kernel labels and attends as the
    torch path at layer 1, which labels otherwise than at layer 0."""
    q, k, v, _, _ = case(1, 6, 2, 16, 300, seed=8)
    q, k, v = q[0], k[0], v[0]
    mean = torch.randn(2, 2, 16, generator=torch.Generator().manual_seed(3)) * 0.3
    cov = torch.stack([random_cov(2, 16, seed=s) for s in (1, 2)]) * torch.tensor([20.0, 0.2])[:, None, None, None]
    identity = Calibration(torch.zeros(2, 6), torch.ones(2, 6), None, {})
    layer_0_long = Calibration(torch.tensor([[-5.0] * 6, [0.0] * 6]), torch.ones(2, 6), None, {})
    for moments, calibration in ((FixedMoments(mean, cov, 1000), identity),  # layer 0's bulk estimated far larger
                                 (FixedMoments(mean[[1, 1]], cov[[1, 1]], 1000), layer_0_long)):
        inputs = dict(n_sink=N_SINK, n_local=N_LOCAL, tau=0.5, moments=moments, calibration=calibration)
        monkeypatch.setenv("QADA_KERNEL", "torch")
        _, at_0 = attention.run_path("qada_cal", q, k, v, layer=0, **inputs)
        want_y, want = attention.run_path("qada_cal", q, k, v, layer=1, **inputs)
        monkeypatch.setenv("QADA_KERNEL", "triton")
        y, labels = attention.run_path("qada_cal", q, k, v, layer=1, **inputs)
        assert torch.equal(labels, want) and not torch.equal(want, at_0)
        torch.testing.assert_close(y, want_y, atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# Skipping: a local group's bulk is poisoned with NaN, which any read of it would carry into the output.


def poisoned(H=6, Hkv=2, D=16, T=300, seed=1):
    """One row whose KV group 0 is made local (its bulk far below its window) and group 1 long-context, with group
    0's bulk keys and values NaN; a calibration forces the same split whatever the Gaussian says."""
    q, k, v, A, b = case(1, H, Hkv, D, T, seed=seed)
    bulk = slice(N_SINK, T - (N_LOCAL - N_SINK))
    k[0, 0, bulk], v[0, 0, bulk] = math.nan, math.nan
    G = H // Hkv
    a = torch.tensor([40.0] * G + [-40.0] * (H - G))  # group 0: share ~1, the rest: ~0
    return q, k, v, A, b, Calibration(a[None], torch.zeros(1, H), None, {})


def no_nan_read(monkeypatch):
    """The torch paths read a KV head's whole cache through full_attention only: fail if it is handed NaN."""
    full = attention.full_attention

    def checked(q, k, v):
        assert not k.isnan().any() and not v.isnan().any(), "a local group's cache was read"
        return full(q, k, v)
    monkeypatch.setattr(attention, "full_attention", checked)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("method", ["qada_cal", "qada_kv_cal", "qada_kv_all_cal", "static"])
def test_a_local_group_is_not_read(method, kernel, monkeypatch):
    monkeypatch.setenv("QADA_KERNEL", kernel)
    no_nan_read(monkeypatch)
    q, k, v, A, b, cal = poisoned()
    H, G = q.shape[1], q.shape[1] // k.shape[1]
    static_local = (torch.arange(H) < G)[None]  # group 0 local for every query
    att = DecodeAttention(method, N_SINK, N_LOCAL, dict(tau=0.6, moments=FixedMoments(torch.zeros(1, 2, 16),
                                                                                      torch.zeros(1, 2, 16, 16), 1),
                                                         calibration=cal, static_local=static_local))
    if method != "static":
        att.inputs["moments"] = Form(A[0], b[0])
    y = att(q[:, :, None], k, v, 0)[0, :, 0]
    labels = att.stats.labels[0][0]
    assert labels.tolist() == [True] * G + [False] * (H - G)
    assert torch.isfinite(y).all()  # group 0's NaN bulk was never read
    clean = k.clone(), v.clone()
    for x in clean:
        x[0, 0] = torch.nan_to_num(x[0, 0], nan=0.0)
    torch.testing.assert_close(y, reference_attention(q[0], clean[0][0], clean[1][0], labels, N_SINK, N_LOCAL),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_the_batched_decision_skips_a_local_group(kernel, monkeypatch):
    """BatchAttention's qada_rows for two left-padded rows of different starts (row 1 holds three more keys than row 0),
    group 0 of each poisoned and local: each row's output is its own attention from its own start."""
    monkeypatch.setenv("QADA_KERNEL", kernel)
    no_nan_read(monkeypatch)
    q, k, v, A, b, _ = poisoned()
    H, Hkv, T, D = q.shape[1], k.shape[1], k.shape[2], k.shape[3]
    # moments that make group 0 local: a bulk mean pointing away from its queries, group 1 towards them
    G = H // Hkv
    direction = q[0].view(Hkv, G, D).mean(1)
    mean = torch.stack([-direction[0], direction[1]]) * 20
    moments = FixedMoments(mean[None], torch.zeros(1, Hkv, D, D), T - N_LOCAL)
    pad, starts = 5, [5, 2]
    kk, vv = torch.zeros(2, Hkv, T + pad, D), torch.zeros(2, Hkv, T + pad, D)
    kk[:, :, pad:], vv[:, :, pad:] = k[0], v[0]
    g = torch.Generator().manual_seed(7)
    kk[1, :, 2:pad], vv[1, :, 2:pad] = torch.randn(Hkv, 3, D, generator=g), torch.randn(Hkv, 3, D, generator=g)
    kk[:, :, :2], kk[0, :, :pad] = math.nan, math.nan  # padding: never attended
    rows = [DecodeAttention("qada", N_SINK, N_LOCAL, dict(tau=0.6, moments=moments)) for _ in range(2)]
    batch = BatchAttention(rows, start=starts)
    y = batch(q.expand(2, -1, -1)[:, :, None], kk, vv, 0)[:, :, 0]
    labels = torch.arange(H) < G
    for r in rows:
        assert r.stats.labels[0][0].tolist() == labels.tolist()
    assert torch.isfinite(y).all()
    for r, s in enumerate(starts):  # the NaN bulk of group 0 as zeros: the reference reads what the path skips
        ref = reference_attention(q[0], kk[r, :, s:].nan_to_num(0.0), vv[r, :, s:].nan_to_num(0.0), labels, N_SINK,
                                  N_LOCAL)
        torch.testing.assert_close(y[r], ref, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(y[0], y[1], atol=1e-3)  # the rows' windows differ: a row read from the other's start
    # would show


@pytest.mark.parametrize("rule", [None, "mean", "all"])
def test_the_kernel_reads_the_splits_of_the_groups_it_needs_only(rule):
    """Group 0 local, group 1 long-context: group 0's split programs return at once, group 1's each read."""
    q, k, v, A, b, cal = poisoned(T=300)
    y, labels, reads = fused_qada(q, k, v, torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                  N_SINK, N_LOCAL, (A, b), torch.tensor([0.6]), rule, cal.layer(0), split=64,
                                  block_n=16, count_reads=True)
    assert reads.tolist() == [[0, math.ceil(300 / 64)]]
    assert torch.isfinite(y).all() and labels[0].tolist() == [True] * 3 + [False] * 3


def test_a_launch_change_is_checked_whole_before_any_of_it_applies(monkeypatch):
    """decode_kernels.set_launch (QADA_TEST_LAUNCH, lab.bench_gpu --launch): a change to a config the kernels have, with
    its keys and their types, applies; a name or key they lack, or a value of another type, raises and changes nothing,
    though an earlier part of the same change was good."""
    for name, config in decode_kernels.LAUNCHES.items():  # put back afterwards, whatever the test does
        monkeypatch.setitem(decode_kernels.LAUNCHES, name, config)
        for key, value in config.items():
            monkeypatch.setitem(config, key, value)
    before = {name: dict(config) for name, config in decode_kernels.LAUNCHES.items()}
    for bad, match in [({"split": {"SPREAD": 8}, "splt": {}}, "names window, bound, split"),
                       ({"split": {"SPREAD": 8}, "window": {"TILE": 64}}, "window launch takes"),
                       ({"split": {"SPREAD": 8}, "window": {"LOW": 1}}, "LOW takes a bool"),
                       # a bool is no int
                       ({"split": {"BLOCK_N": True}}, "split launch's BLOCK_N takes a int, got True"),
                       ({"split": 3}, "split launch takes"), ([1], "a mapping")]:
        with pytest.raises(ValueError, match=match):
            decode_kernels.set_launch(bad)
        assert {name: dict(config) for name, config in decode_kernels.LAUNCHES.items()} == before
    decode_kernels.set_launch({"split": {"SPREAD": 8, "PDL": True}, "window": {"BLOCK_W": 64}})
    assert decode_kernels.SPLIT_LAUNCH["SPREAD"] == 8 and decode_kernels.SPLIT_LAUNCH["PDL"]
    assert decode_kernels.WINDOW_LAUNCH["BLOCK_W"] == 64
    assert decode_kernels.SPLIT_LAUNCH["BLOCK_N"] == before["split"]["BLOCK_N"]  # the rest as it was


def test_check_kernel_says_what_the_asked_for_kernel_lacks(monkeypatch):
    """QADA_KERNEL=triton where the kernel cannot run is one line saying why, in the asker's words: no CUDA and no
    interpreter, or no triton; under the interpreter it runs. auto and torch ask nothing; set empty, it is auto."""
    monkeypatch.setenv("QADA_KERNEL", "triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(decode_kernels, "INTERPRETED", False)
    with pytest.raises(ValueError, match="^--kernel triton: no CUDA; on the CPU the kernel runs only under Triton's "
                                         "interpreter \\(TRITON_INTERPRET=1\\)$"):
        decode_kernels.check_kernel("--kernel triton")
    monkeypatch.setattr(decode_kernels, "INTERPRETED", True)
    decode_kernels.check_kernel()
    monkeypatch.setattr(decode_kernels, "triton", None)
    with pytest.raises(ValueError, match="^QADA_KERNEL=triton: triton is not installed"):
        decode_kernels.check_kernel()
    for choice in ("auto", "torch", ""):
        monkeypatch.setenv("QADA_KERNEL", choice)
        decode_kernels.check_kernel()
        assert decode_kernels.kernel_choice() == (choice or "auto")


def test_window_launch_fits_its_tiles_to_the_window_and_the_head_dim(monkeypatch):
    """window_launch: tiles no larger than the padded window or the head dim, and the form apart only where the
    kernel decides (Quest's window kernel has no form)."""
    q = k = v = torch.zeros(1, 4, 16)
    monkeypatch.setitem(decode_kernels.WINDOW_LAUNCH, "FORM_APART", True)
    launch = decode_kernels.window_launch(16, q, k, v)
    assert (launch["BLOCK_W"], launch["BLOCK_D"], launch["FORM_APART"]) == (16, 16, True)
    assert not decode_kernels.window_launch(16, q, k, v, decide=False)["FORM_APART"]
    wide = decode_kernels.window_launch(256, *(torch.zeros(1, 4, 128),) * 3)
    assert (wide["BLOCK_W"], wide["BLOCK_D"]) == (decode_kernels.WINDOW_LAUNCH["BLOCK_W"],
                                                  decode_kernels.WINDOW_LAUNCH["BLOCK_D"])


def test_the_kernel_path_reads_nothing_back_to_the_host(monkeypatch):
    """Around its two launches the kernel path makes no host sync: with the kernels stubbed out, every Tensor method
    that reads a value back to the host raises, and a decode step of one row and of a batch still goes through. (On
    CUDA, torch.cuda.set_sync_debug_mode("error") checks the same with the real kernels.)"""
    monkeypatch.setenv("QADA_KERNEL", "triton")
    launches = []
    for name in ("_window_decide_kernel", "_split_attention_kernel"):
        monkeypatch.setattr(decode_kernels, name, Launch(launches))
    q, k, v, A, b = case(2, 6, 2, 16, 300)
    moments = FixedMoments(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16, 16), 1)
    rows = [DecodeAttention("qada", N_SINK, N_LOCAL, dict(tau=0.6, moments=moments)) for _ in range(2)]
    batch = BatchAttention(rows, start=[0, 3])
    batch(q[:, :, None], k, v, 0)  # the first step builds the rows' cached forms (host work, once per set of rows)

    def no_sync(*args, **kwargs):
        raise AssertionError("a value was read back to the host")
    for method in ("tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, method, no_sync)
    launches.clear()
    batch(q[:, :, None], k, v, 0)
    rows[0](q[:1, :, None], k[:1], v[:1], 0)
    # two kernels per step, fixed grids (split_size: 256 positions per split, two splits of T = 300); the window
    # kernel's third axis its parts: 1, or with FORM_APART (QADA_TEST_LAUNCH's) the window and one per BLOCK_D columns
    launch = decode_kernels.WINDOW_LAUNCH
    parts = 1 + (16 // min(16, launch["BLOCK_D"]) if launch["FORM_APART"] else 0)
    assert [grid for _, grid, _, _ in launches] == [(2, 2, parts), (2, 2, 2), (1, 2, parts), (1, 2, 2)]
    assert len(rows[0].stats.labels) == 3 and rows[0].stats.labels[-1][0].device == q.device


def eq7_ratio(q, k, mean, cov, T):
    """The estimated log ratio log A_local - log(T_bulk exp(mu_s + sigma_s^2 / 2)) per query head, in float64."""
    H, D = q.shape
    Hkv = k.shape[0]
    G = H // Hkv
    s = torch.einsum("hd,htd->ht", q.double(), k.double().repeat_interleave(G, 0)) / math.sqrt(D)
    window = torch.cat([s[:, :N_SINK], s[:, T - (N_LOCAL - N_SINK):]], 1)
    qg = q.double().view(Hkv, G, D)
    expo = (torch.einsum("gld,gd->gl", qg, mean.double()) / math.sqrt(D)
            + torch.einsum("gld,gde,gle->gl", qg, cov.double(), qg) / (2 * D)).reshape(H)
    return window.logsumexp(-1) - (math.log(T - N_LOCAL) + expo)


GROUP_SHARE = {"qada": lambda share: share, "qada_kv": lambda share: share.mean(-1, keepdim=True).expand_as(share),
               "qada_kv_all": lambda share: share.min(-1, keepdim=True).values.expand_as(share)}


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("rule", ["qada", "qada_kv", "qada_kv_all"])
def test_batched_rows_with_their_own_tau_at_the_first_step_past_the_window(rule, kernel, monkeypatch):
    """BatchAttention's batched decision, the torch path's and the fused kernel's, against Eq. 7 re-derived in
    float64, rows with their own taus, at T = n_local + 1 (a single bulk position) and past it. Each row's tau sits
    halfway between what the right T_bulk and one more bulk position give for its first group, so a T_bulk off by one
    flips that group."""
    monkeypatch.setenv("QADA_KERNEL", kernel)
    H, Hkv, D = 6, 2, 16
    G = H // Hkv
    for T in (N_LOCAL + 1, N_LOCAL + 40):
        q, k, v, A, b = case(3, H, Hkv, D, T, seed=T)
        mean, cov = b * math.sqrt(D), A * 2 * D  # gaussian_form's inverse
        shares, taus = [], []
        for i in range(3):
            r = eq7_ratio(q[i], k[i], mean[i], cov[i], T)
            share = GROUP_SHARE[rule](torch.sigmoid(r).view(Hkv, G))  # (Hkv, G): what each head's label follows
            off_by_one = GROUP_SHARE[rule](torch.sigmoid(r - math.log((T - N_LOCAL + 1) / (T - N_LOCAL))).view(Hkv, G))
            shares.append(share)
            taus.append(float(share[0, 0] + off_by_one[0, 0]) / 2)
        rows = [DecodeAttention(rule, N_SINK, N_LOCAL,
                                dict(tau=t, moments=FixedMoments(mean[i][None], cov[i][None], 1)))
                for i, t in enumerate(taus)]
        BatchAttention(rows)(q[:, :, None], k, v, 0)
        for i, tau in enumerate(taus):
            assert rows[i].stats.labels[-1][0].tolist() == (shares[i] >= tau).reshape(H).tolist(), (T, tau)


def test_the_kernel_applies_each_term_of_the_correction(monkeypatch):
    """fused_qada's calibrated labels against the correction applied in float64 (the variance term scaled by s per
    KV head, then a + b r per head), at taus where the labels with s = 1, or b = 1, or a = 0 would differ: a kernel
    that drops any term of the correction fails."""
    monkeypatch.setenv("QADA_KERNEL", "triton")
    B, H, Hkv, D, T = 2, 6, 2, 16, N_LOCAL + 40
    q, k, v, A, b = case(B, H, Hkv, D, T, seed=11)
    mean, cov = b * math.sqrt(D), A * 2 * D  # gaussian_form's inverse
    ca = torch.linspace(-1, 1, H, dtype=torch.float64)
    cb = torch.linspace(0.4, 1.8, H, dtype=torch.float64)
    cs = torch.tensor([0.3, 2.5], dtype=torch.float64)
    one = torch.ones_like

    def ratio(i, a, b_, s):  # (H,) the corrected log ratio of row i, float64
        return a + b_ * eq7_ratio(q[i], k[i], mean[i], cov[i] * s[:, None, None], T)

    correction = Correction(ca.float(), cb.float(), cs.float())
    for dropped in ("s", "b", "a"):  # each term in turn: a tau per row at which leaving it out moves a label
        taus = []
        for i in range(B):
            r = ratio(i, ca, cb, cs)
            other = {"s": ratio(i, ca, cb, one(cs)), "b": ratio(i, ca, one(cb), cs), "a": ratio(i, 0 * ca, cb, cs)}
            cuts = torch.cat([r, other[dropped]]).sort().values
            fits = [c for c in ((cuts[1:] + cuts[:-1]) / 2).tolist() if (r - c).abs().min() > 1e-3
                    and ((other[dropped] >= c) != (r >= c)).any()]
            assert fits, f"no tau at which {dropped} moves a label (the case needs other numbers)"
            taus.append(1 / (1 + math.exp(-fits[0])))
        _, labels = fused_qada(q, k, v, torch.arange(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32),
                               N_SINK, N_LOCAL, (A, b), torch.tensor(taus, dtype=torch.float64), None, correction,
                               split=64, block_n=16)
        for i in range(B):
            want = ratio(i, ca, cb, cs) >= math.log(taus[i] / (1 - taus[i]))
            assert labels[i].tolist() == want.tolist(), (dropped, i)


# ---------------------------------------------------------------------------------------------------------
# The step a CUDA graph captures: T read from a device tensor, views running to the cache's capacity.


class Recorded:
    """A Triton kernel whose launches are recorded, then run: the grid and every Python value it is given (integers,
    floats, constexprs) as they are, a tensor by name when it is one of `named` (the caller's buffers, by address),
    else by dtype, shape and strides (a temporary the step allocates)."""

    def __init__(self, kernel, launches, named):
        self.kernel, self.launches, self.named = kernel, launches, named

    def describe(self, x):
        if not isinstance(x, torch.Tensor):
            return x
        return self.named.get(x.data_ptr()) or (x.dtype, tuple(x.shape), x.stride())

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, [self.describe(a) for a in args],
                                  {name: self.describe(a) for name, a in kwargs.items()}))
            return self.kernel[grid](*args, **kwargs)
        return launch


def record_launches(monkeypatch, **named):
    launches = []
    names = {x.data_ptr(): name for name, x in named.items()}
    for name in ("_window_decide_kernel", "_split_attention_kernel"):
        monkeypatch.setattr(decode_kernels, name, Recorded(getattr(decode_kernels, name), launches, names))
    return launches


@pytest.mark.parametrize("length_shape", [(), (1,)])
def test_a_step_over_the_capacity_launches_the_same_whatever_T(length_shape, monkeypatch):
    """fused_qada at T and at T + 1, the filled length in a device tensor changed in place in between, the views
    running to the capacity: the two launches get the same grids, the same Python values and the same buffers, so
    one captured step can be replayed as the cache fills. The split size comes from the capacity: the default split
    here gives several splits, of which the filled length uses fewer than the grid holds."""
    B, H, Hkv, D, T_max = 2, 6, 2, 16, 2100
    q, k, v, A, b = case(B, H, Hkv, D, T_max, seed=2)
    rows, start = torch.arange(B, dtype=torch.int32), torch.tensor([0, 9], dtype=torch.int32)
    length = torch.full(length_shape, 1000, dtype=torch.int32)
    tau = decode_kernels.kernel_thresholds(torch.tensor([0.6, 0.4], dtype=torch.float64))
    y = torch.empty(B, H, D)
    launches = record_launches(monkeypatch, q=q, k=k, v=v, rows=rows, start=start, length=length, A=A, b=b,
                               cap=tau[0], tau_logit=tau[1], y=y)
    outputs = []
    for T in (1000, 1001):
        length.fill_(T)
        _, labels = fused_qada(q, k, v, rows, start, N_SINK, N_LOCAL, (A, b), tau, "mean", length=length, out=y)
        outputs.append((y.clone(), labels.clone()))
    assert len(launches) == 4 and launches[:2] == launches[2:]
    split = decode_kernels.split_size(B * Hkv, T_max, q.device)
    assert launches[1][0] == (B, Hkv, math.ceil(T_max / split)) and math.ceil(1001 / split) < math.ceil(T_max / split)
    monkeypatch.undo()
    for i, T in enumerate((1000, 1001)):  # what T it read: the sliced views' output and labels, bit for bit
        y_cut, labels_cut = fused_qada(q, k[:, :, :T], v[:, :, :T], rows, start, N_SINK, N_LOCAL, (A, b), tau, "mean",
                                       split=split)
        assert torch.equal(outputs[i][0], y_cut) and torch.equal(outputs[i][1], labels_cut)
    assert not torch.equal(outputs[0][0], outputs[1][0])


@pytest.mark.parametrize("rule", [None, "all"])
def test_views_to_the_capacity_give_the_sliced_views_result_per_row_lengths_included(rule):
    """Per-row lengths (n,): each query's row read to its own T, bit for bit what that row gives alone on its
    cache sliced to T; the splits past T never ran (count_reads), though the grid covers the capacity."""
    B, H, Hkv, D, T_max = 3, 8, 2, 16, 450
    q, k, v, A, b = case(B, H, Hkv, D, T_max, seed=4)
    rows, start = torch.tensor([2, 0, 1], dtype=torch.int32), torch.tensor([0, 20, 3], dtype=torch.int32)
    lengths = torch.tensor([T_max, 200, 33 + N_LOCAL], dtype=torch.int32)  # T past a split boundary, at one, short
    tau = torch.tensor([0.5, 0.7, 0.3], dtype=torch.float64)
    y, labels, reads = fused_qada(q, k, v, rows, start, N_SINK, N_LOCAL, (A, b), tau, rule, length=lengths, split=64,
                                  block_n=16, count_reads=True)
    for i in range(B):
        T, r = int(lengths[i]), int(rows[i])
        y_i, labels_i, reads_i = fused_qada(q[i:i + 1], k[r:r + 1, :, :T], v[r:r + 1, :, :T],
                                            torch.zeros(1, dtype=torch.int32), start[i:i + 1], N_SINK, N_LOCAL,
                                            (A[i:i + 1], b[i:i + 1]), tau[i:i + 1], rule, split=64, block_n=16,
                                            count_reads=True)
        assert torch.equal(y[i], y_i[0]) and torch.equal(labels[i], labels_i[0]) and torch.equal(reads[i], reads_i[0])
        long = ~labels_i[0].view(Hkv, -1).all(-1)
        assert reads[i].tolist() == (long * math.ceil((T - int(start[i])) / 64)).tolist()
    assert 0 < int(labels.sum()) < labels.numel()


def test_decoding_through_fixed_buffers_matches_the_eager_steps(monkeypatch):
    """N decode steps two ways, each step's query depending on the last step's output. Eagerly: the new key and value
    written at position T from the host, fused_qada on the cache sliced to T + 1. Through fixed buffers, as a captured
    graph replays them: the new entry written at a device position, the length advanced in place, fused_qada on the
    cache's whole capacity. Every step's labels and output are the same bit for bit, and every step of the buffered
    loop launches the same kernels with the same Python values and buffers."""
    B, H, Hkv, D, T_max, T0, steps = 2, 6, 2, 16, 512, 250, 8  # crosses the split boundary at 256
    q0, k, v, A, b = case(B, H, Hkv, D, T_max, seed=6)
    g = torch.Generator().manual_seed(7)
    new_q, new_k, new_v = (torch.randn(steps, B, n, D, generator=g) for n in (H, Hkv, Hkv))
    rows, start = torch.arange(B, dtype=torch.int32), torch.tensor([0, 11], dtype=torch.int32)
    tau = decode_kernels.kernel_thresholds(torch.tensor([0.6, 0.5], dtype=torch.float64))

    def query(t, y):  # the next step's query follows this step's output, so any difference would carry on
        return q0 + new_q[t] + 0.5 * y

    k_eager, v_eager = k.clone(), v.clone()
    y, eager = torch.zeros(B, H, D), []
    for t in range(steps):
        T = T0 + t
        k_eager[:, :, T], v_eager[:, :, T] = new_k[t], new_v[t]
        y, labels = fused_qada(query(t, y), k_eager[:, :, :T + 1], v_eager[:, :, :T + 1], rows, start, N_SINK,
                               N_LOCAL, (A, b), tau, "mean", split=64, block_n=16)
        eager.append((y, labels))

    k_buf, v_buf = k.clone(), v.clone()
    length = torch.tensor([T0], dtype=torch.int32)
    q_buf, k_new, v_new, y_buf = (torch.zeros(B, H, D), torch.empty(B, Hkv, D), torch.empty(B, Hkv, D),
                                  torch.zeros(B, H, D))
    launches = record_launches(monkeypatch, q=q_buf, k=k_buf, v=v_buf, rows=rows, start=start, length=length, A=A,
                               b=b, cap=tau[0], tau_logit=tau[1], y=y_buf)

    def step():  # reads device tensors only: what a CUDA graph would capture once
        k_buf.index_copy_(2, length.long(), k_new[:, :, None])  # (B, Hkv, 1, D) at position T
        v_buf.index_copy_(2, length.long(), v_new[:, :, None])
        length.add_(1)
        return fused_qada(q_buf, k_buf, v_buf, rows, start, N_SINK, N_LOCAL, (A, b), tau, "mean", length=length,
                          split=64, block_n=16, out=y_buf)[1]

    for t in range(steps):
        q_buf.copy_(query(t, y_buf)), k_new.copy_(new_k[t]), v_new.copy_(new_v[t])
        labels = step()
        assert torch.equal(y_buf, eager[t][0]) and torch.equal(labels, eager[t][1]), t
    assert int(length) == T0 + steps
    assert all(launches[i] == launches[i % 2] for i in range(len(launches))) and len(launches) == 2 * steps
    every = torch.stack([labels for _, labels in eager])
    assert 0 < int(every.sum()) < every.numel()  # some groups read the cache, some not
