"""lab.bench_gpu on this CPU, at tiny shapes: the label patterns it times are the ones it claims (the real criterion,
checked), the table's arithmetic, and the end-to-end part's fixed-label correction. Its timings need a GPU."""

import json
import math
import os

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
    if f == 1:  # every head long-context: an output other than packed dense's is refused
        layer.packed = lambda: torch.zeros(3, 2, 2, 16)
        with pytest.raises(AssertionError):
            layer.check(batch, full)


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
    launches = dict(decode_kernels.WINDOW_LAUNCH), dict(decode_kernels.SPLIT_LAUNCH)
    programs, chosen = [], decode_kernels.split_size  # the split column asks as the kernel does: a program per KV head

    def split_size(n_programs, T_max, device, block_n=64):
        programs.append(n_programs)
        return chosen(n_programs, T_max, device, block_n)
    monkeypatch.setattr(decode_kernels, "split_size", split_size)
    rows = bench_gpu.bench_kernels(300, 1, torch.device("cpu"))
    assert set(programs) == {2}  # batch 1 of 2 KV heads, in the kernel and the table alike
    assert [r["f"] for r in rows] == [0.0, 0.5, 1.0]  # of 2 KV heads
    assert [math.isnan(r["stacked_us"]) for r in rows] == [False, False, True]
    # timed_ms's ticks: the step's graph 1, the split size's 2, the stacked graph's 3, over its 2 layers
    assert (rows[0]["graph_us"], rows[0]["stacked_us"], rows[0]["splits"]) == (1e3, 1.5e3, "256: 2000.0")
    assert rows[0]["device_us"] == 3.0  # the profiled kernels' sum
    assert "form_apart=True: 1.0 (|dy| 0e+00)" in rows[1]["window"] and "spread=2: " in rows[1]["split_launches"]
    assert [r["window"] == r["split_launches"] == "" for r in rows] == [True, False, True]  # at read 0.3 only
    assert all(bench_gpu.format_row(bench_gpu.KERNEL_COLUMNS, r).count(" | ") == len(bench_gpu.KERNEL_COLUMNS) - 1
               for r in rows)
    assert " | n/a | " in bench_gpu.format_row(bench_gpu.KERNEL_COLUMNS, rows[2])  # no stacked graph at read 1
    # what the variants and the splits changed is put back: the next step launches as before
    assert (decode_kernels.WINDOW_LAUNCH, decode_kernels.SPLIT_LAUNCH) == launches
    assert decode_kernels.split_size is split_size


def test_a_launch_variant_gives_its_time_and_change_and_one_that_fails_says_so():
    """launch_variants: each change's time and the largest change of the step's output against the default launch's;
    a change the step fails under is a cell saying so, not a crash of the table; the config is put back each time."""
    config = {"X": 1}

    def step():
        if config["X"] == 3:
            raise RuntimeError("out of resources")
        return torch.tensor([1.0, config["X"] ** 2])

    cells = bench_gpu.launch_variants(step, config, [dict(X=2), dict(X=3), dict(X=4)], lambda fn: 5.0 * config["X"])
    assert cells == "x=2: 10.0 (|dy| 3e+00); x=3: failed (RuntimeError); x=4: 20.0 (|dy| 2e+01)"
    assert config == {"X": 1}


def test_the_attention_table_compares_with_the_best_dense(tiny_shapes, monkeypatch):
    """Against the faster of the two dense: packed SDPA at batch 2 (every time a later tick than the last), flash at
    batch 4 (0.5 ms). The torch path's times are those taken under QADA_KERNEL=torch (1000 ms more here); each % of
    bound is its own column's time; dense GB/s is the keys' and values' bytes over the best dense time."""
    times = iter(range(1, 1000))
    flash = iter([1000.0, 0.5])  # per bench_layer call: slower than packed, then faster

    def fake(fn, device, quick=False):
        fn()
        name = getattr(fn, "__name__", "")
        if name == "flash":
            return next(flash)
        return float(next(times)) + (1000.0 if name != "packed" and os.environ["QADA_KERNEL"] == "torch" else 0.0)

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
        assert r["torch_ms"] > 1000 > max(r["fused_ms"], r["graph_ms"]) and r["fused_ms"] != r["graph_ms"]
        assert r["eager_of_bound"] == pytest.approx(best / r["fused_ms"] / r["ideal"])
        assert r["torch_of_bound"] == pytest.approx(best / r["torch_ms"] / r["ideal"])
        kv_bytes = 2 * r["B"] * 2 * 200 * 16 * 2  # keys and values, B rows, Hkv 2, T 200, D 16, bf16
        assert r["dense_GBps"] == pytest.approx(kv_bytes / 1e9 / (best / 1e3))


def test_a_cpu_time_is_the_median_of_the_calls_after_a_warm_up(monkeypatch):
    """timed_ms off CUDA (and graph_ms, which has no graph there): one untimed call, then the median of the timed
    calls' wall-clock, 3 of them, 2 with quick."""
    now, costs = [0.0], iter([100.0, 0.003, 0.001, 0.002, 100.0, 0.004, 0.001])  # seconds
    monkeypatch.setattr(bench_gpu.time, "perf_counter", lambda: now[0])

    def fn():
        now[0] += next(costs)
    cpu = torch.device("cpu")
    assert bench_gpu.graph_ms(fn, cpu) == pytest.approx(2.0)
    assert bench_gpu.timed_ms(fn, cpu, quick=True) == pytest.approx(2.5)


@pytest.mark.parametrize("launch", ['{"split": {"SPREAD": "8"}}', '{"split": {"SPREED": 8}}', "split=8"])
def test_a_bad_launch_is_one_line_and_exit_2(launch, capsys):
    assert bench_gpu.main(["--parts", "attention", "--launch", launch]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--launch" in err and "Traceback" not in err


def test_each_part_writes_its_table_as_it_goes_under_its_own_name(tmp_path, monkeypatch, capsys):
    """main with each part's timing stubbed (a GPU made up for the end-to-end and kernels parts): attention.md after
    each length with every row so far, end_to_end_<T>k.md (…_of_<T_max>k.md with --capacity) after each setup, kernels
    only when asked (not in "all"), each table with the command as given and the launch from --launch applied. A part
    whose table the folder already holds says that this run replaces it; the other parts' tables are not named."""
    monkeypatch.setattr(bench_gpu, "pick_device", lambda device: "cuda")
    monkeypatch.setattr(bench_gpu, "setup_line", lambda device: "a made-up GPU")
    monkeypatch.setattr(bench_gpu, "plot", lambda rows, path, setup: None)
    monkeypatch.setitem(decode_kernels.SPLIT_LAUNCH, "SPREAD", decode_kernels.SPLIT_LAUNCH["SPREAD"])  # put back after
    spread = []
    monkeypatch.setattr(bench_gpu, "bench_attention", lambda lengths, batches, device, quick: spread.append(
        decode_kernels.SPLIT_LAUNCH["SPREAD"]) or [dict(shape="tiny", T=T, B=B, f=1.0) for T in lengths
                                                   for B in batches])
    monkeypatch.setattr(bench_gpu, "bench_end_to_end", lambda T, setups, device, n, capacity, budget, compiled: [
        dict(B=B, L=L, T=T, capacity=capacity, method="dense") for B, L in setups])
    monkeypatch.setattr(bench_gpu, "bench_kernels", lambda T, B, device: [dict(T=T, B=B, f=0.0)])

    def written(out, part):
        table = json.loads((out / f"{part}.json").read_text())
        assert f"`{table['command']}`" in (out / f"{part}.md").read_text()
        return table["command"], [tuple(r.values())[:4] for r in table["rows"]]

    argv = ["--lengths", "300,400", "--batches", "1,2", "--e2e", "2x2,4x1", "--e2e-length", "16384", "--capacity",
            "32768", "--launch", '{"split": {"SPREAD": 8}}', "--out", str(tmp_path / "all")]
    assert bench_gpu.main(argv) == 0
    command, rows = written(tmp_path / "all", "attention")
    assert command == "python -m lab.bench_gpu " + " ".join(argv[:-3]) + f" '{argv[-3]}' --out {tmp_path / 'all'}"
    assert rows == [("tiny", 300, 1, 1.0), ("tiny", 300, 2, 1.0), ("tiny", 400, 1, 1.0), ("tiny", 400, 2, 1.0)]
    assert spread == [8, 8]
    assert written(tmp_path / "all", "end_to_end_16k_of_32k")[1] == [(2, 2, 16384, 32768), (4, 1, 16384, 32768)]
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == [
        "attention.json", "attention.md", "end_to_end_16k_of_32k.json", "end_to_end_16k_of_32k.md"]
    assert bench_gpu.main(["--parts", "e2e", "--e2e", "2x2", "--out", str(tmp_path / "e2e")]) == 0
    assert written(tmp_path / "e2e", "end_to_end_32k")[1] == [(2, 2, 32768, None)]
    assert bench_gpu.main(["--parts", "kernels", "--lengths", "300", "--batches", "1,2", "--out",
                           str(tmp_path / "kernels")]) == 0
    assert written(tmp_path / "kernels", "kernels")[1] == [(300, 1, 0.0), (300, 2, 0.0)]
    capsys.readouterr()
    assert bench_gpu.main(["--parts", "e2e", "--e2e", "2x2", "--out", str(tmp_path / "all"), "--e2e-length", "16384",
                           "--capacity", "32768"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert notes == [f"note: {tmp_path / 'all'} holds an earlier run's end_to_end_16k_of_32k table; this run "
                     "replaces it"]


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
    runs = []
    timed = bench_gpu.step_ms(lambda k, finished=None: runs.append((k, finished is None)) or decode(k, finished),
                              lambda: None, 1)  # --steps 1: step 2 alone
    assert timed == pytest.approx((2.0, 2.0, 2.0))
    assert runs == [(2, True), (4, False)]  # an untimed run first compiles what the loop launches


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
    runs = []

    def one_run(decode, reset, n):  # step_ms at its cheapest: one run, its clock (the loop's stop rule) handed down,
        runs.append(n)              # for dense's eager and graph loops; every method's is the same closure
        if len(runs) <= 2:
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
    assert not math.isnan(rows["qada"]["kv_read"]) and len(runs) == 2 * len(rows)
    # the page rows: every group its window; half of them long-context, each reading 4 pages of 16 (the last candidate
    # page, when chosen, reads its bulk positions only: 1 to 16) and one entry per candidate page for their bounds
    m = pages.candidates(T + 1, bench_gpu.N_SINK, bench_gpu.N_LOCAL, 16)
    read = rows["kv 0.5 + pages 64"]["kv_read"] * (T + 1)
    assert 128 + 0.5 * (64 - 15 + m) - 1e-6 <= read <= 128 + 0.5 * (64 + m) + 1e-6
    assert window < rows["quest 64"]["kv_read"] < rows["kv 1.0"]["kv_read"]  # each head's pages, a group their union


def test_the_compiled_rows_compile_the_model_once_and_are_held_to_their_own_dense(small_e2e, monkeypatch):
    """--compiled: dense, kv E2E_PAGES_F and kv 0.0 again after every other row was timed, the model's pointwise
    arithmetic compiled once before the first of them (a spy here), the same labels read, and their speedups and
    bounds against the compiled dense and floor, not the eager modules' (each timing its own number here). Every
    row's speedup is dense's time over its own, of the same mode; its bound dense / (floor + read (dense - floor));
    the graph loop times GRAPH_STEPS times the eager steps; a capture that fails leaves its row's graph cells
    empty and says so, and the table goes on."""
    timed, compiled_after = [], []
    monkeypatch.setattr(bench_gpu.Llama, "compile_pointwise", lambda self: compiled_after.append(len(timed)))

    def step_ms(decode, reset, n):
        timed.append(n)
        if len(timed) == 14:  # the 7th row's graph loop: quest's
            raise RuntimeError("capture failed\nand more")
        return 10.0 + len(timed), 9.5 + len(timed), 10.5 + len(timed)
    monkeypatch.setattr(bench_gpu, "step_ms", step_ms)
    # the step at T + 1 = 257 passes a view of 256: its graph's view is the next, 512, short of the capacity
    rows = bench_gpu.bench_end_to_end(256, [(1, 2)], torch.device("cpu"), 1, 1024, budget=32, compiled=True)
    names = [r["method"] for r in rows]
    assert names == ["dense", "kv 1.0", "kv 0.5", "kv 0.0", "qada", "kv 0.5 + pages 32", "quest 32", "dense again",
                     "compiled: dense", "compiled: kv 0.5", "compiled: kv 0.0"]
    assert compiled_after == [2 * (len(names) - 3)]  # once, after each other row's eager and graph timing
    assert timed == [1, bench_gpu.GRAPH_STEPS] * len(names)
    by = {r["method"]: r for r in rows}
    assert math.isnan(by["quest 32"]["graph_ms"]) and by["quest 32"]["host_syncs"] == "capture: capture failed"
    assert by["quest 32"]["eager_ms"] == 23.0 and by["dense again"]["graph_quartiles"] == "25.50-26.50"
    assert all(r["view"] == 512 and r["capacity"] == 1024 for r in rows)
    for name in ("dense", "kv 0.5", "kv 0.0"):
        assert by[f"compiled: {name}"]["kv_read"] == by[name]["kv_read"]
    for r in rows:
        family = "compiled: " if r["method"].startswith("compiled: ") else ""
        for mode in ("eager", "graph"):
            dense, floor = by[f"{family}dense"][f"{mode}_ms"], by[f"{family}kv 0.0"][f"{mode}_ms"]
            assert r[f"{mode}_speedup"] == pytest.approx(dense / r[f"{mode}_ms"], nan_ok=True)
            assert r[f"{mode}_of_bound"] == pytest.approx(
                r[f"{mode}_speedup"] * (floor + r["kv_read"] * (dense - floor)) / dense, nan_ok=True)
    assert by["compiled: dense"]["graph_of_bound"] == 1.0 == by["dense"]["eager_of_bound"]  # reads all: bound 1
