"""lab.bench_gpu on this CPU, at tiny shapes: the label patterns it times are the ones it claims (the real criterion,
checked), the table's arithmetic, and the end-to-end part's fixed-label correction. Its timings need a GPU."""

import math

import pytest
import torch

pytest.importorskip("triton")
import attention  # noqa: E402
import decode_kernels  # noqa: E402
import pages  # noqa: E402
from lab import bench_gpu  # noqa: E402
from lab.bench import full_pattern, ideal_speedup  # noqa: E402
from model import LlamaConfig  # noqa: E402

TINY = {"tiny": dict(H=4, Hkv=2, D=16)}
# The benchmark's kernel path on CPU tensors: Triton's interpreter (conftest sets it where there is no CUDA).
pytestmark = pytest.mark.skipif(not decode_kernels.INTERPRETED,
                                reason="needs TRITON_INTERPRET=1 to run kernels on the CPU")


@pytest.fixture
def tiny_shapes(monkeypatch):
    monkeypatch.setattr(bench_gpu, "SHAPES", TINY)
    monkeypatch.setattr(bench_gpu, "timed_ms", lambda fn, device, quick=False: (fn(), 1.0)[1])
    monkeypatch.setenv("QADA_KERNEL", "torch")


@pytest.mark.parametrize("f", [1.0, 0.5, 0.0])
def test_the_moments_give_each_pattern_and_a_wrong_one_is_refused(f, tiny_shapes):
    layer = bench_gpu.Layer(4, 2, 16, B=3, T=200, device=torch.device("cpu"), dtype=torch.float32)
    full = full_pattern(3, 2, f)
    batch = layer.attention(full)
    layer.check(batch, full)  # labels are the pattern; at f = 1 the output is packed dense's
    if 0 < f < 1:
        with pytest.raises(RuntimeError, match="intended label pattern"):
            layer.check(layer.attention(full), ~full)


@pytest.mark.parametrize("f", [0.5, 1.0])
def test_the_kernels_table_times_the_step_batch_attention_takes(f, monkeypatch):
    """static_step, the step the kernels table times (fused_qada as generate's static loop calls it), gives the
    output of the BatchAttention call it stands for, bit for bit."""
    monkeypatch.setenv("QADA_KERNEL", "triton")
    layer = bench_gpu.Layer(8, 2, 16, B=2, T=400, device=torch.device("cpu"), dtype=torch.float32)
    batch = layer.attention(full_pattern(2, 2, f))
    want = batch(layer.q, layer.k, layer.v, 0)[:, :, 0]
    assert torch.equal(bench_gpu.static_step(batch, layer)(), want)


def test_the_stacked_step_runs_each_layers_own_step(monkeypatch):
    """stacked_step, which the kernels table captures in one graph for its per-layer time, runs the fused step of
    every layer it is given on that layer's own queries, cache and forms, one after another."""
    monkeypatch.setenv("QADA_KERNEL", "triton")
    layers = [bench_gpu.Layer(8, 2, 16, B=2, T=400, device=torch.device("cpu"), dtype=torch.float32)
              for _ in range(3)]
    for i, layer in enumerate(layers):  # (Layer seeds its data alike) queries of their own
        layer.q = layer.q * (1 + i)
    full = full_pattern(2, 2, 0.5)
    got = bench_gpu.stacked_step(layers, full)()
    want = [layer.attention(full)(layer.q, layer.k, layer.v, 0)[:, :, 0] for layer in layers]
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(got[0], got[1])


def test_the_kernels_table_runs_through_the_interpreter(monkeypatch):
    """bench_kernels, which only a GPU times, run at tiny shapes on the CPU with its GPU-only parts stubbed (the
    profiler's per-kernel times, the device's compute capability, its allocator): every row and column of its table
    is made, the stacked graph's per-layer time where the targets are read (KV read 0 and 0.3, not 1), and each
    window and split launch it times beside the default (here one of each) runs, so that the device call's table
    has run before."""
    monkeypatch.setenv("QADA_KERNEL", "triton")
    ticks = iter(range(1, 10_000))
    monkeypatch.setattr(bench_gpu, "SHAPES", {"Llama-3-8B": dict(H=8, Hkv=2, D=16)})
    monkeypatch.setattr(bench_gpu, "timed_ms", lambda fn, device, quick=False: (fn(), float(next(ticks)))[1])
    monkeypatch.setattr(bench_gpu, "kernel_us", lambda step, device: {"_window_decide_kernel": 1.0, "split": 2.0})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench_gpu, "SPLITS", (256,))
    monkeypatch.setattr(bench_gpu, "STACK", 2)
    monkeypatch.setattr(bench_gpu, "WINDOW_VARIANTS", [dict(FORM_APART=True)])
    monkeypatch.setattr(bench_gpu, "SPLIT_VARIANTS", [dict(SPREAD=2)])
    rows = bench_gpu.bench_kernels(300, 1, torch.device("cpu"))
    assert [r["f"] for r in rows] == [0.0, 0.5, 1.0]  # of 2 KV heads
    assert [math.isnan(r["stacked_us"]) for r in rows] == [False, False, True]
    # timed_ms's ticks: the step's graph 1, the split size's 2, the stacked graph's 3, over its 2 layers
    assert (rows[0]["graph_us"], rows[0]["stacked_us"]) == (1e3, 1.5e3)
    assert "form_apart=True: 1.0 (|dy| 0e+00)" in rows[1]["window"] and "spread=2: " in rows[1]["split_launches"]
    assert all(bench_gpu.format_row(bench_gpu.KERNEL_COLUMNS, r).count(" | ") == len(bench_gpu.KERNEL_COLUMNS) - 1
               for r in rows)


def test_the_attention_table_compares_with_the_best_dense(tiny_shapes, monkeypatch):
    """Against the faster of the two dense: packed SDPA at batch 2 (every time a later tick than the last), flash at
    batch 4 (0.5 ms)."""
    times = iter(range(1, 1000))
    flash = iter([1000.0, 0.5])  # per bench_layer call: slower than packed, then faster

    def fake(fn, device, quick=False):
        fn()
        return next(flash) if getattr(fn, "__name__", "") == "flash" else float(next(times))

    monkeypatch.setattr(bench_gpu, "timed_ms", fake)
    rows = bench_gpu.bench_attention([200], [2, 4], torch.device("cpu"), quick=True)
    assert [r["f"] for r in rows if r["B"] == 2] == [1.0, 0.5, 0.25, 0.25, 0.0]  # round(f * 4) of 4 (row, KV head)
    assert [r["flash_ms"] < r["packed_ms"] for r in rows] == [False] * 5 + [True] * 5
    for r in rows:
        best = min(r["packed_ms"], r["flash_ms"])
        assert r["speedup"] == pytest.approx(best / r["graph_ms"])
        assert r["ideal"] == pytest.approx(ideal_speedup(r["f"], 200))
        assert r["of_bound"] == pytest.approx(r["speedup"] / r["ideal"])
        none_read = next(x for x in rows if x["B"] == r["B"] and x["f"] == 0)  # deciding alone, at this batch
        assert r["decision"] == pytest.approx(none_read["graph_ms"] / best)


@pytest.mark.parametrize("launch", ['{"split": {"SPREAD": "8"}}', '{"split": {"SPREED": 8}}', "split=8"])
def test_a_bad_launch_is_one_line_and_exit_2(launch, capsys):
    assert bench_gpu.main(["--parts", "attention", "--launch", launch]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--launch" in err and "Traceback" not in err


def test_a_step_is_timed_from_one_read_of_its_tokens_to_the_next(monkeypatch):
    """step_ms: the median and quartiles of the steps after the first (a graph's capture), each from the loop's first
    stop-rule call after one step to the first after the next, on the host's clock."""
    now = [0.0]
    monkeypatch.setattr(bench_gpu.time, "perf_counter", lambda: now[0])
    cost = {1: 5.0, 3: 1.0, 5: 0.004}  # seconds: step 1 the capture, step 3 an outlier; any other step 2 ms

    def decode(k, finished=None):  # generate's loop: each token read, then the stop rule asked for each row but
        outs = [[], []]  # about its last token
        for step in range(k):  # token step + 1 read after step `step` (0: the prefill's logits, no step)
            now[0] += cost.get(step, 0.002) if step else 0.0
            for out in outs:
                out.append(0)
                if len(out) < k and finished is not None:
                    finished(out)
        return outs

    median, q1, q3 = bench_gpu.step_ms(decode, lambda: None, 4)  # steps 2, 3, 4 and 5
    assert median == pytest.approx(3.0) and q1 == pytest.approx(2.0) and q3 > 4.0


@pytest.fixture
def small_e2e(monkeypatch):
    """The end-to-end part at a small model's shapes, kv 1.0, 0.5 and 0.0, its GPU-only steps (a graph, the sync
    check) made no-ops."""
    monkeypatch.setenv("QADA_KERNEL", "torch")
    monkeypatch.setattr(bench_gpu, "LLAMA3_8B", LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=128,
                                                            num_hidden_layers=4, num_attention_heads=4,
                                                            num_key_value_heads=2, head_dim=16))
    monkeypatch.setattr(bench_gpu, "graphed", lambda step, reset, device: step)
    monkeypatch.setattr(bench_gpu, "sync_free", lambda step: "none")
    monkeypatch.setattr(bench_gpu, "E2E_FRACTIONS", (1.0, 0.5, 0.0))
    monkeypatch.setattr(bench_gpu, "E2E_PAGES_F", 0.5)


def test_fixed_labels_read_the_share_asked_for(small_e2e, monkeypatch):
    """The end-to-end part's correction makes the real decision label a share f of (layer, KV head) pairs long."""
    def one_run(decode, reset, n):  # step_ms at its cheapest: one run, its clock (the loop's stop rule) handed down
        asked = []
        reset()
        decode(2, lambda ids: asked.append(len(ids)) or False)
        assert asked == [1, 1]  # each row asked about its first token
        return 1.0, 1.0, 1.0

    monkeypatch.setattr(bench_gpu, "step_ms", one_run)
    T = 300  # 2 rows of 2 layers: 4 (layer, KV head) pairs, half of them long-context at f = 0.5
    rows = {r["method"]: r for r in bench_gpu.bench_end_to_end(T, [(2, 2)], torch.device("cpu"), 1, budget=64)}
    window = attention.kv_read_fraction(torch.ones(1, 1, 4), torch.tensor([T + 1]), 2, 128)  # all local
    for f in (1.0, 0.5, 0.0):
        assert rows[f"kv {f}"]["kv_read"] == pytest.approx(f + (1 - f) * window, abs=1e-6)
    assert rows["dense"]["kv_read"] == 1.0 and all(r["logits_ok"] for r in rows.values())
    assert not math.isnan(rows["qada"]["kv_read"])
    # the page rows: every group its window; half of them long-context, each reading 4 pages of 16 (the last candidate
    # page, when chosen, reads its bulk positions only: 1 to 16) and one entry per candidate page for their bounds
    m = pages.candidates(T + 1, bench_gpu.N_SINK, bench_gpu.N_LOCAL, 16)
    read = rows["kv 0.5 + pages 64"]["kv_read"] * (T + 1)
    assert 128 + 0.5 * (64 - 15 + m) - 1e-6 <= read <= 128 + 0.5 * (64 + m) + 1e-6
    assert window < rows["quest 64"]["kv_read"] < rows["kv 1.0"]["kv_read"]  # each head's pages, a group their union


def test_the_compiled_rows_compile_the_model_once_and_are_held_to_their_own_dense(small_e2e, monkeypatch):
    """--compiled: dense, kv E2E_PAGES_F and kv 0.0 again after every other row was timed, the model's pointwise
    arithmetic compiled once before the first of them (a spy here), the same labels read, and their speedups against
    the compiled dense, not the eager modules' (every compiled step is timed at half the others' here)."""
    timed, compiled_after = [], []
    monkeypatch.setattr(bench_gpu.Llama, "compile_pointwise", lambda self: compiled_after.append(len(timed)))
    monkeypatch.setattr(bench_gpu, "step_ms", lambda decode, reset, n: timed.append(n) or (
        (0.5 if compiled_after else 1.0),) * 3)
    rows = bench_gpu.bench_end_to_end(200, [(1, 2)], torch.device("cpu"), 1, budget=32, compiled=True)
    names = [r["method"] for r in rows]
    assert names[-3:] == ["compiled: dense", "compiled: kv 0.5", "compiled: kv 0.0"]
    assert compiled_after == [2 * (len(names) - 3)]  # once, after each other row's eager and graph timing
    by = {r["method"]: r for r in rows}
    assert by["dense"]["graph_ms"] == 1.0 and by["compiled: dense"]["graph_ms"] == 0.5
    assert by["compiled: dense"]["graph_speedup"] == 1.0 == by["compiled: kv 0.5"]["graph_speedup"]
    for name in ("dense", "kv 0.5", "kv 0.0"):
        assert by[f"compiled: {name}"]["kv_read"] == by[name]["kv_read"]
