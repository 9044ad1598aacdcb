"""The optimised decode paths lab.bench times, held against the fp32 reference; and the benchmark's own set-up.

No timings are asserted: speed is what lab.bench reports, these tests only pin what it computes."""

import json
from pathlib import Path

import pytest
import torch

import attention
from attention import full_attention, mixed_attention, reference_attention
from lab import bench

N_SINK, N_LOCAL = 16, 128


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def cache_views(Hkv, T, D, seed, dtype=torch.float32):
    """k, v (Hkv, T, D) sliced from a longer (Hkv, T + 7, D) buffer, as model.KVCache hands them out."""
    k, v = rand(Hkv, T + 7, D, seed=seed, dtype=dtype), rand(Hkv, T + 7, D, seed=seed + 1, dtype=dtype)
    return k[:, :T], v[:, :T]


@pytest.fixture(params=[1, 2, 3], ids=["1 thread", "2 threads", "3 threads"])
def threads(request):
    """full_attention splits a lone KV head's context between the threads when there are several (overlapping
    slices when their number does not divide T)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("n,G,T", [(1, 1, 5), (1, 2, 2), (1, 3, 700), (1, 2, 1001), (3, 3, 300), (2, 4, 1000)])
def test_full_attention_reads_groups_as_positions(n, G, T, dtype, tol, threads):
    """Query heads of a group fed to SDPA as query positions give each head's own full attention (a context shorter
    than the threads is not split: a slice would hold no position of its own)."""
    D = 32
    q = rand(n, G, D, seed=T, dtype=dtype)
    k, v = cache_views(n, T, D, seed=T + 1, dtype=dtype)
    got = full_attention(q, k, v)
    no_local = torch.zeros(n * G, dtype=torch.bool)
    ref = torch.cat([reference_attention(q[i], k[i:i + 1], v[i:i + 1], no_local[:G], N_SINK, N_LOCAL)
                     for i in range(n)])
    assert got.shape == (n, G, D) and got.dtype == dtype
    assert (got.float().reshape(n * G, D) - ref).abs().max() < tol


# Llama-3-8B's grouping (8 KV heads of 4) with small heads: runs of long groups of every kind.
H, HKV, D = 32, 8, 16
GROUP_PATTERNS = {
    "all long": [0] * 8,
    "all local": [1] * 8,
    "one run": [1, 1, 0, 0, 0, 1, 1, 1],
    "runs at both ends": [0, 1, 1, 0, 0, 1, 1, 0],
    "alternating": [0, 1] * 4,
}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("T", [N_LOCAL + 1, 1000])
@pytest.mark.parametrize("pattern", list(GROUP_PATTERNS))
@pytest.mark.parametrize("mixed_groups", ["none", "every", "the first read"])
def test_mixed_attention_runs_equal_reference(pattern, T, mixed_groups, dtype, tol, threads):
    """Groups read in full (in runs of consecutive KV heads), local heads inside them (in none, in every group, or in
    the first group read alone), cache views."""
    q = rand(H, D, seed=T, dtype=dtype)
    k, v = cache_views(HKV, T, D, seed=T + 1, dtype=dtype)
    groups = torch.tensor(GROUP_PATTERNS[pattern], dtype=torch.bool)
    local = groups.repeat_interleave(H // HKV)
    if mixed_groups == "every":  # one local head inside every group that is read in full, one long head elsewhere
        local[0::H // HKV] = ~local[0::H // HKV]
    if mixed_groups == "the first read" and not groups.all():  # the other runs read in full have no local head
        local[int((~groups).nonzero()[0]) * (H // HKV)] = True
    got = mixed_attention(q, k, v, local, N_SINK, N_LOCAL)
    ref = reference_attention(q, k, v, local, N_SINK, N_LOCAL)
    assert got.dtype == dtype
    assert (got.float() - ref).abs().max() < tol


@pytest.mark.parametrize("name", ["sdpa_gqa", "dense", "local"])
def test_the_baselines_equal_the_reference(name, threads):
    """The stack through each baseline lab.bench times, every layer: SDPA with enable_gqa, the project's packed
    dense path and the all-local floor, against the fp32 reference (no head local, every head local)."""
    stack = bench.Stack(H=9, Hkv=3, D=64, L=3, T=700, device=torch.device("cpu"))
    path = bench.sdpa_gqa if name == "sdpa_gqa" else name
    local = torch.full((9,), name == "local")
    for i, y in enumerate(stack.run(path)):
        ref = reference_attention(stack.q[i], *stack.kv[i], local, N_SINK, N_LOCAL)
        assert (y - ref).abs().max() < 1e-5
        assert (y - reference_attention(stack.q[i], *stack.kv[i], ~local, N_SINK, N_LOCAL)).abs().max() > 1e-3


def test_full_pattern_meets_the_fractions_exactly():
    for dims in bench.SHAPES.values():
        for f in bench.FRACTIONS:
            full = bench.full_pattern(dims["L"], dims["Hkv"], f)
            assert full.shape == (dims["L"], dims["Hkv"]) and float(full.float().mean()) == pytest.approx(f)


def test_ideal_bound():
    assert bench.ideal_speedup(1.0, 8192) == 1.0
    assert bench.ideal_speedup(0.0, 8192) == pytest.approx(64.0)
    assert bench.ideal_speedup(0.15, 8192) == pytest.approx(1 / (0.15 + 0.85 / 64))


@pytest.mark.parametrize("f", bench.FRACTIONS)
def test_synthetic_moments_give_the_pattern_and_qada_the_reference(f):
    """The benchmark's stack: the real criterion labels the intended pattern, qada's output is the reference's."""
    stack = bench.Stack(H=9, Hkv=3, D=64, L=4, T=700, device=torch.device("cpu"))
    full = bench.full_pattern(stack.L, stack.Hkv, f)
    moments = stack.moments(full)
    stack.check(full, moments)  # raises if the labels differ
    local = (~full).repeat_interleave(3, 1)
    for i, y in enumerate(stack.run("qada", moments)):
        ref = reference_attention(stack.q[i], *stack.kv[i], local[i], N_SINK, N_LOCAL)
        assert (y - ref).abs().max() < 1e-5


def test_markdown_table():
    rows = [dict(shape="s", T=2048, f=0.15, dense_ms=1.0, qada_ms=0.5, speedup=2.0, ideal=4.9, of_bound=0.41,
                 criterion=0.1, packed_ms=0.8, speedup_packed=1.6, of_bound_packed=0.33, fused_ms=None,
                 fused_of_bound=None)]  # no fused kernel timed off CUDA
    lines = bench.table(bench.ATTENTION_COLUMNS, rows).splitlines()
    assert len(lines) == 3 and lines[2].count("|") == lines[0].count("|") and "2.00x" in lines[2]
    assert lines[2].endswith("| – | – |") and "nan" not in lines[2]


def test_end_to_end_runs_batches_of_different_prompts(tmp_path, monkeypatch):
    """Part 2 on a tiny random model: a row per (batch, method) with the bound computed from the row's own
    timings and KV read; batch 3 holds three different needles in one left-padded cache."""
    from tests.test_generate import make_tiny_dir
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))  # the reference keys cached in the test's folder only
    folder = make_tiny_dir(tmp_path / "tiny")
    methods = bench.parse_methods("qada@0.6,qada_kv@0.3")
    rows, _ = bench.bench_end_to_end(str(folder), [300], [1, 3], methods, repeats=2, n_new=3,
                                     device=torch.device("cpu"), dtype=torch.float32, rope_theta=4e5)
    assert [(r["batch"], r["method"]) for r in rows] == [(1, "qada@0.6"), (1, "qada_kv@0.3"), (3, "qada@0.6"),
                                                         (3, "qada_kv@0.3")]
    for r in rows:
        assert r["bound"] == pytest.approx(r["dense_ms"]
                                           / (r["local_ms"] + r["kv_read"] * (r["dense_ms"] - r["local_ms"])))
        assert r["of_bound"] == pytest.approx(r["speedup"] / r["bound"]) and 0 < r["kv_read"] <= 1
        assert r["needle"].endswith(f"/{r['batch']}") and 250 < r["T"] <= 300 - bench.NEEDLE_TOKENS
    # Batch 3 after batch 1 decodes the prompts as they were prefilled: the batch-1 run's tokens are not left in
    # the first prompt's cache (they were, and shifted the batch by n_new positions).
    alone, _ = bench.bench_end_to_end(str(folder), [300], [3], methods, repeats=1, n_new=3,
                                      device=torch.device("cpu"), dtype=torch.float32, rope_theta=4e5)
    assert [(r["T"], r["sparsity"], r["kv_read"], r["needle"]) for r in alone] == \
        [(r["T"], r["sparsity"], r["kv_read"], r["needle"]) for r in rows if r["batch"] == 3]
    with pytest.raises(ValueError, match="PATH@TAU"):
        bench.parse_methods("local@0.5")
    assert bench.parse_methods("qada@1,quest_frac:1") == [("qada@1", "qada", {"tau": 1.0}),
                                                         ("quest_frac:1", "quest_frac", {"budget_frac": 1.0})]  # (0, 1]


def test_end_to_end_takes_a_calibration_and_reads_prefills_back(tmp_path, monkeypatch):
    """A calibrated method reads the --calibration file (the identity correction: qada's own labels); a
    --prefill-only run times nothing and leaves every prompt and the reference keys on disk, so that the timed run
    after it prefills nothing."""
    from criterion import Calibration, save_calibration
    from model import Llama
    from tests.test_generate import make_tiny_dir
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    folder = make_tiny_dir(tmp_path / "tiny")
    identity = tmp_path / "identity.json"
    save_calibration(identity, Calibration(torch.zeros(2, 4), torch.ones(2, 4), None, {}))
    methods = bench.parse_methods("qada@0.6,qada_cal@0.6")
    kw = dict(repeats=1, n_new=2, device=torch.device("cpu"), dtype=torch.float32, rope_theta=4e5,
              calibration=str(identity), prefill_cache=tmp_path / "prefills")
    assert bench.bench_end_to_end(str(folder), [300], [1, 2], methods, **kw, prefill_only=True) == ([], "")
    from weights.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(folder)
    distinct = {tuple(bench.needle_prompt(tok, 300 - bench.NEEDLE_TOKENS, seed=b)[0]) for b in range(2)}
    assert len(list((tmp_path / "prefills").glob("*.pt"))) == len(distinct)  # one file per prompt (the tiny
    # tokenizer spells the two needles alike)
    with monkeypatch.context() as m:
        m.setattr(Llama, "prefill", lambda *a, **k: pytest.fail("prefilled again"))
        rows, _ = bench.bench_end_to_end(str(folder), [300], [1, 2], methods, **kw)
    plain, cal = ([(r["sparsity"], r["kv_read"], r["needle"]) for r in rows if r["method"] == m]
                  for m in ("qada@0.6", "qada_cal@0.6"))
    assert plain == cal and len(plain) == 2
    with pytest.raises(ValueError, match="ships no calibration"):
        bench.bench_end_to_end(str(folder), [300], [1], methods, **dict(kw, calibration=None))
    local = tmp_path / "all_local.json"  # a correction that makes every head local: the file is really read
    save_calibration(local, Calibration(torch.full((2, 4), 40.0), torch.ones(2, 4), None, {}))
    rows, _ = bench.bench_end_to_end(str(folder), [300], [1], bench.parse_methods("qada_cal@0.6"),
                                     **dict(kw, calibration=str(local)))
    assert rows[0]["sparsity"] == 1.0 and plain[0][0] < 1.0
    elsewhere = tmp_path / "elsewhere.json"  # fitted on other weights of this shape
    save_calibration(elsewhere, Calibration(torch.zeros(2, 4), torch.ones(2, 4), None, {"weights_probe": [0.5] * 16}))
    with pytest.raises(ValueError, match="elsewhere.json was fitted on other weights than this model's"):
        bench.bench_end_to_end(str(folder), [300], [1], methods, **dict(kw, calibration=str(elsewhere)))


def test_end_to_end_times_the_page_paths(tmp_path, monkeypatch):
    """Quest alone and QAdA + pages run end to end from their PATH[@TAU]:BUDGET items: each reads what its budget
    allows (a bigger budget reads more), the budget reaches the path (a budget covering the context reads as much
    as dense would), and malformed items are one-line errors naming the syntax."""
    from criterion import Calibration, save_calibration
    from tests.test_generate import make_tiny_dir
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    folder = make_tiny_dir(tmp_path / "tiny")
    always_long = tmp_path / "long.json"  # every group long-context: the pages decide what is read
    save_calibration(always_long, Calibration(torch.full((2, 4), -40.0), torch.ones(2, 4), None, {}))
    methods = bench.parse_methods("quest:16,quest:512,qada_pages@0.6:16,quest_frac:0.25")
    assert methods[2] == ("qada_pages@0.6:16", "qada_pages", {"tau": 0.6, "budget": 16})
    assert methods[3] == ("quest_frac:0.25", "quest_frac", {"budget_frac": 0.25})
    assert bench.parse_methods("quest_p32:32") == [("quest_p32:32", "quest_p32", {"budget": 32})]  # one page of 32
    rows, _ = bench.bench_end_to_end(str(folder), [300], [1, 2], methods, repeats=1, n_new=2,
                                     device=torch.device("cpu"), dtype=torch.float32, rope_theta=4e5,
                                     calibration=str(always_long))
    read = {(r["batch"], r["method"]): r["kv_read"] for r in rows}
    assert len(read) == 8
    for B in (1, 2):
        assert read[B, "quest:16"] < read[B, "quest_frac:0.25"] < read[B, "quest:512"]
        assert read[B, "qada_pages@0.6:16"] < 1 and read[B, "quest:512"] > 0.99  # 512 covers the 268-token bulk
    for bad in ("quest", "quest@0.5:16", "qada_pages:16", "qada_pages@0.6", "quest:-1", "quest_frac:2",
                "page_oracle:16", "qada@0.6:16", "quest:0", "quest:15", "quest_p32:16"):  # 0 pages: the window alone
        with pytest.raises(ValueError, match="--e2e-methods"):
            bench.parse_methods(bad)


def test_a_prefill_read_back_is_the_prefill(tmp_path):
    """`prefilled` from its file: the same keys, values, length and first logits as the prefill that wrote it."""
    from model import load_model
    from tests.test_generate import make_tiny_dir
    model = load_model(make_tiny_dir(tmp_path / "tiny"))
    ids = torch.randint(1, 100, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    fresh, first, seconds = bench.prefilled(model, ids, 5, tmp_path / "prefills")
    back, first_back, seconds_back = bench.prefilled(model, ids, 5, tmp_path / "prefills")
    other, _, _ = bench.prefilled(model, ids[:-1], 5, tmp_path / "prefills")  # another prompt: its own file
    assert len(list((tmp_path / "prefills").glob("*.pt"))) == 2
    assert back.length == fresh.length == 40 and back.max_len == fresh.max_len == 45 and other.length == 39
    assert torch.equal(back.k, fresh.k) and torch.equal(back.v, fresh.v) and back.k.dtype == fresh.k.dtype
    assert torch.equal(first_back, first) and seconds_back == seconds


def test_the_two_parts_run_apart_into_one_folder(tmp_path, monkeypatch, capsys):
    """Each part writes its own table, profile and rows; the second run keeps the first's, and the plot draws both.
    A part run again into the folder says that it replaces the earlier run's tables."""
    from tests.test_generate import make_tiny_dir
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    folder, out = make_tiny_dir(tmp_path / "tiny"), tmp_path / "bench"
    common = dict(device="cpu", threads=None, repeats=1, lengths="300", quick=True, decode_tokens=2, rope_theta=4e5,
                  out=str(out), model=str(folder), batches="1", e2e_methods="qada@0.6", dtype="float32",
                  compile_decision=False)
    assert bench.run(parts="attention", **common) == 0
    first = (out / "attention.json").read_text()
    assert bench.run(parts="e2e", **common) == 0
    assert (out / "attention.json").read_text() == first  # not overwritten by the other part
    assert "replaces" not in capsys.readouterr().err
    def strict(constant):  # NaN and Infinity are not JSON: jq and most parsers refuse the file
        raise ValueError(f"{constant} in attention.json")
    rows = json.loads(first, parse_constant=strict)["rows"]
    assert rows and all(r["fused_ms"] is None for r in rows)  # no fused kernel timed off CUDA: null, not NaN
    assert "| – | – |" in (out / "attention.md").read_text()
    for part in ("attention", "end_to_end"):
        assert (out / f"{part}.md").is_file() and (out / f"{part}_profile.md").read_text().startswith("Profiles")
    assert len(json.loads((out / "end_to_end.json").read_text())["rows"]) == 1 and (out / "speedup.png").is_file()
    assert "RoPE theta" not in (out / "end_to_end.md").read_text().splitlines()[0]  # 300 tokens: within the context
    assert bench.run(parts="attention", **common) == 0
    assert f"note: {out} holds an earlier run's attention tables; this run replaces them" in capsys.readouterr().err


def cells(columns, row) -> dict:
    """A table's row as {column title: cell text}, read back from the markdown bench.table writes."""
    head, _, line = bench.table(columns, [row]).splitlines()
    return dict(zip([c.strip() for c in head.strip("|").split("|")], [c.strip() for c in line.strip("|").split("|")]))


class FakeClock:
    """time.perf_counter for lab.bench: advanced only by the callables timed (and what the test says), so that each
    timing is a number the test chose."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_timer_excludes_the_warm_up_rotates_the_order_and_takes_the_median(monkeypatch):
    """Each callable runs once untimed, then `repeats` rounds in an order rotated each round, each timed call after a
    cache flush that is not timed itself; the figure is the median of the timed calls (1, 6, 2 -> 2: not the warm-up's
    9, not the mean 3)."""
    clock, log = FakeClock(), []
    monkeypatch.setattr(bench, "time", clock)

    class Flush:
        def sum(self):
            log.append("flush")
            clock.now += 100.0  # outside the timed span

    durations = {"a": [9, 1, 6, 2], "b": [5, 4, 4, 4], "c": [7, 3, 8, 30]}

    def fn(name):
        def call():
            log.append(name)
            clock.now += durations[name][sum(x == name for x in log) - 1]
        return call

    timer = bench.Timer(torch.device("cpu"), flush=False)
    timer.flush_buf = Flush()
    t = timer.interleaved({name: fn(name) for name in "abc"}, repeats=3)
    assert t == {"a": 2, "b": 4, "c": 8}
    assert log == (["a", "b", "c"] + ["flush", "a", "flush", "b", "flush", "c"]
                   + ["flush", "b", "flush", "c", "flush", "a"] + ["flush", "c", "flush", "a", "flush", "b"])


def test_attention_rows_are_the_ratios_of_the_timings(monkeypatch):
    """bench_attention's rows from timings the test chose (seconds per stack of L layers): ms per layer, speedup =
    dense / qada at the same f, the packed columns against packed dense, the criterion over packed dense, and the
    bound at the pattern's f and T; the table puts each under its own title."""
    seconds = {"dense": 2.0, "packed": 1.0, 1.0: 2.5, 0.5: 1.0, 0.15: 0.5, 0.0: 0.25, "criterion": 0.1}

    class FakeTimer:
        def interleaved(self, fns, repeats):
            assert set(fns) == set(seconds) and repeats == 7
            return dict(seconds)

    rows = bench.bench_attention([300], 7, torch.device("cpu"), FakeTimer())
    assert ([(r["shape"], pytest.approx(r["f"])) for r in rows]
            == [(s, f) for s in bench.SHAPES for f in bench.FRACTIONS])
    ideal = 1 / (0.15 + 0.85 * 128 / 300)  # = 1.9506
    for r in rows:
        assert r["T"] == 300 and r["fused_ms"] is None and r["fused_of_bound"] is None
        assert r["ideal"] == pytest.approx(1 / (r["f"] + (1 - r["f"]) * 128 / 300), rel=1e-6)
    smol = {round(r["f"], 6): r for r in rows if r["shape"] == "SmolLM2-135M"}  # 20 layers
    r = smol[0.15]
    assert (r["dense_ms"], r["packed_ms"], r["qada_ms"]) == pytest.approx((100.0, 50.0, 25.0))
    assert (r["speedup"], r["speedup_packed"], r["criterion"]) == pytest.approx((4.0, 2.0, 0.1))
    assert (r["ideal"], r["of_bound"], r["of_bound_packed"]) == pytest.approx((ideal, 4.0 / ideal, 2.0 / ideal),
                                                                               rel=1e-6)
    assert smol[1.0]["speedup"] == pytest.approx(0.8) and smol[1.0]["ideal"] == 1.0
    assert smol[0.0]["speedup"] == pytest.approx(8.0) and smol[0.0]["speedup_packed"] == pytest.approx(4.0)
    llama = next(r for r in rows if r["shape"] == "Llama-3-8B" and round(r["f"], 6) == 0.5)  # 5 layers
    assert (llama["dense_ms"], llama["packed_ms"], llama["qada_ms"]) == pytest.approx((400.0, 200.0, 200.0))
    assert cells(bench.ATTENTION_COLUMNS, r) == {
        "shapes": "SmolLM2-135M", "T": "300", "f (KV read)": "0.15", "dense ms": "100.000", "packed dense ms": "50.000",
        "qada ms": "25.000", "speedup": "4.00x", "ideal": "1.95x", "% of bound": "205%", "speedup vs packed": "2.00x",
        "% of bound vs packed": "103%", "criterion / packed": "10.0%", "fused kernel ms": "–",
        "fused % of bound vs packed": "–"}


def test_end_to_end_rows_from_chosen_timings_reads_and_answers(tmp_path, monkeypatch):
    """Part 2's arithmetic on the tiny model with what it measures replaced by numbers the test chose: each row's
    prefill seconds are its batch's prompts' (1.5, then 1.5 + 2.5), ms per step the median of the timed runs (not the
    untimed answer run), sparsity and KV read the mean over the batch's rows, the bound dense / (local + read * (dense -
    local)), and the needles counted per row against that row's own needle, dense first."""
    from attention import HeadStats
    from tests.test_generate import make_tiny_dir
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    folder = make_tiny_dir(tmp_path / "tiny")
    mark = {0: [40, 41], 1: [50, 51]}  # the answer tokens that spell prompt b's needle ("w40 w41", "w50 w51")
    needle_prompt, prefilled, decode_timed, build = (bench.needle_prompt, bench.prefilled, bench.decode_timed,
                                                     bench.build_attention)
    monkeypatch.setattr(bench, "needle_prompt", lambda tok, n, seed=0: (needle_prompt(tok, n, seed)[0],
                                                                         f"w{mark[seed][0]} w{mark[seed][1]}"))
    prefills = iter([1.5, 2.5])
    monkeypatch.setattr(bench, "prefilled", lambda *a: prefilled(*a)[:2] + (next(prefills),))
    rows_of = []  # (attention, its row: its cache's prompt)
    caches = []

    def build_attention(method, cache, **kw):
        att = build(method, cache, **kw)
        if all(c is not cache for c in caches):
            caches.append(cache)
        rows_of.append((att, next(i for i, c in enumerate(caches) if c is cache)))
        return att
    monkeypatch.setattr(bench, "build_attention", build_attention)
    per_row = {0: dict(sparsity=0.9, kv_read=0.2), 1: dict(sparsity=0.5, kv_read=0.6)}
    monkeypatch.setattr(HeadStats, "summary", lambda self, n: next(per_row[i] for a, i in rows_of if a.stats is self))
    timed = {"dense": [0.020, 0.100, 0.010], "local": [0.004] * 3, "qada": [0.008, 0.008, 0.050]}  # medians 20, 4, 8 ms
    calls = {name: 0 for name in timed}

    def fake_decode(model, cache, n, logits, n_new, attn):
        s, outs = decode_timed(model, cache, n, logits, n_new, attn)
        name = "dense" if attn is None else getattr(attn, "rows", [attn])[0].method
        if n_new == bench.NEEDLE_TOKENS:  # the answers: dense finds row 0's needle, qada row 1's, local none
            found = {"dense": 0, "qada": 1}.get(name)
            return s, [mark[b] if b == found else [0] * n_new for b in range(len(outs))]
        calls[name] += 1
        return timed[name][(calls[name] - 1) % 3], outs
    monkeypatch.setattr(bench, "decode_timed", fake_decode)
    rows, _ = bench.bench_end_to_end(str(folder), [300], [1, 2], bench.parse_methods("qada@0.6"), repeats=3, n_new=2,
                                     device=torch.device("cpu"), dtype=torch.float32, rope_theta=4e5)
    assert calls == {"dense": 6, "local": 6, "qada": 6}
    got = [{k: r[k] for k in ("batch", "prefill_s", "dense_ms", "local_ms", "ms", "speedup", "bound", "of_bound",
                              "sparsity", "kv_read", "needle")} for r in rows]
    assert got == [
        dict(batch=1, prefill_s=1.5, dense_ms=pytest.approx(20), local_ms=pytest.approx(4), ms=pytest.approx(8),
             speedup=pytest.approx(2.5), bound=pytest.approx(20 / 7.2), of_bound=pytest.approx(0.9), sparsity=0.9,
             kv_read=0.2, needle="1/1, 0/1"),
        dict(batch=2, prefill_s=4.0, dense_ms=pytest.approx(20), local_ms=pytest.approx(4), ms=pytest.approx(8),
             speedup=pytest.approx(2.5), bound=pytest.approx(20 / 10.4), of_bound=pytest.approx(1.3),
             sparsity=pytest.approx(0.7), kv_read=pytest.approx(0.4), needle="1/2, 1/2")]
    assert {k: v for k, v in cells(bench.E2E_COLUMNS, rows[0]).items() if k not in ("prompt tokens", "RoPE theta")} == {
        "batch": "1", "prefill s": "1.5", "method": "qada@0.6", "packed dense ms/step": "20.0",
        "window-only ms/step": "4.0", "method ms/step": "8.0", "speedup": "2.50x", "bound": "2.78x",
        "% of bound": "90%", "sparsity": "0.90", "KV read": "0.20", "needles found dense, method": "1/1, 0/1"}


def test_decode_timed_is_seconds_per_step_and_answers_from_the_first_token(tmp_path, monkeypatch):
    """decode_timed: n_new decode steps, timed as one span divided by n_new; each row's tokens start with the
    prefill's argmax (the answer's first token) and number n_new; the cache is left at the prompt."""
    from model import load_model
    from tests.test_generate import make_tiny_dir
    model = load_model(make_tiny_dir(tmp_path / "tiny"))
    ids = torch.randint(1, 100, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    cache, first, _ = bench.prefilled(model, ids, 5, None)
    clock, steps = FakeClock(), []
    monkeypatch.setattr(bench, "time", clock)
    step = model.decode_step

    def decode_step(token, cache, attn):
        steps.append(token.tolist())
        clock.now += 0.5
        return step(token, cache, attn)
    monkeypatch.setattr(model, "decode_step", decode_step)
    seconds, outs = bench.decode_timed(model, cache, 40, first, 4, None)
    assert seconds == pytest.approx(0.5) and len(steps) == 4 and cache.length == 40
    assert outs == [[s[0] for s in steps]] and outs[0][0] == int(first.argmax(-1))
