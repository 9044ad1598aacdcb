"""Batched decoding: B prompts of different lengths in one left-padded cache, each row with its own attention,
held against each prompt decoded alone (tokens, logits, labels, statistics)."""

import json

import pytest
import torch

from attention import BatchAttention, DecodeAttention, path_inputs, reference_attention
from criterion import Calibration, gaussian_form
import generate
from model import load_model
from moments import FixedMoments
from tests.test_generate import make_tiny_dir, write_prompt


def test_batch_attention_gives_each_row_its_own_attention_on_its_own_part_of_the_cache():
    """Row b is attns[b] on row b's query and row b's cache from start[b] on (held against the fp32 reference with
    that row's labels); ended rows output zeros and their attention is not called."""
    B, H, Hkv, T, D = 3, 4, 2, 300, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, 1, D, generator=g), torch.randn(B, Hkv, T, D, generator=g),
               torch.randn(B, Hkv, T, D, generator=g))
    static = torch.tensor([[True, False, False, True]])  # (L, H) for layer 0: one local head in each group
    labels = [torch.zeros(H, dtype=torch.bool), torch.ones(H, dtype=torch.bool), static[0]]
    atts = [DecodeAttention("dense"), DecodeAttention("local"),
            DecodeAttention("static", inputs=dict(static_local=static))]
    start = [0, 40, 7]
    rows = BatchAttention(atts, start=start)
    y = rows(q, k, v, 0)
    for b, att in enumerate(atts):
        s = start[b]
        ref = reference_attention(q[b, :, 0], k[b, :, s:], v[b, :, s:], labels[b], 16, 128)  # the default window
        torch.testing.assert_close(y[b, :, 0], ref)
        assert att.stats.lengths == [T - s] and torch.equal(att.stats.labels[0][0], labels[b])
        other = reference_attention(q[b, :, 0], k[b - 1, :, s:], v[b - 1, :, s:], labels[b], 16, 128)  # another row's
        assert not torch.allclose(y[b, :, 0], other, atol=1e-3)
        if s:  # the padding before start really changes the result, so reading it would be caught
            assert not torch.allclose(y[b, :, 0], reference_attention(q[b, :, 0], k[b], v[b], labels[b], 16, 128),
                                      atol=1e-3)
    rows.done[1] = True
    y = rows(q, k, v, 0)
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    assert len(atts[1].stats.lengths) == 1 and len(atts[0].stats.lengths) == 2  # the ended row's path never ran
    with pytest.raises(ValueError, match="rows"):
        BatchAttention(atts, start=[0, 1])
    with pytest.raises(ValueError, match="a batch of 2 rows for 3 attentions"):  # not a short batch read as 3
        rows(q[:2], k[:2], v[:2], 0)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("method", ["qada", "qada_kv", "qada_kv_all", "qada_cal", "qada_kv_cal"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_qada_rows_decide_for_the_batch_as_each_row_alone(monkeypatch, method, dtype, tol, kernel):
    """B prompts under a QAdA path, each with its own moments and padding (and tau, per query head): the batched
    decision (one window pass and one Gaussian term for every row) gives each row the labels and output of its own
    path, and a row that ended is left out of it. The row-by-row path is not called on the batched route. Both
    routes through the torch path and through the fused kernel (which writes each live row's output in place)."""
    if kernel == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("QADA_KERNEL", kernel)
    B, H, Hkv, T, D, L = 4, 6, 2, 400, 16, 2
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(B, H, 1, D, generator=g) * torch.linspace(0.5, 3.0, H)[:, None, None]).to(dtype)
    k, v = torch.randn(B, Hkv, T, D, generator=g).to(dtype), torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    start = [0, 50, 13, 200]
    taus = [0.6, 0.3, 0.8, 0.5]
    # qada_cal: one correction for the batch, different per layer and head, variance scaled per KV head
    gc = torch.Generator().manual_seed(7)
    calibration = Calibration(torch.randn(L, H, generator=gc), torch.rand(L, H, generator=gc) + 0.5,
                              torch.rand(L, Hkv, generator=gc) + 0.5, {})

    def attentions():
        gm = torch.Generator().manual_seed(5)  # the same moments for both routes, different for every row
        moments = [FixedMoments(torch.randn(L, Hkv, D, generator=gm) * 0.5, torch.eye(D).expand(L, Hkv, D, D) * 0.1 *
                                torch.rand(L, Hkv, 1, 1, generator=gm), 100) for _ in range(B)]
        moments[0] = FixedMoments(moments[0].mean * 3, moments[0].cov, 100)  # apart enough to move qada_kv's labels
        return [DecodeAttention(method, 4, 32, dict(tau=tau, moments=m, calibration=calibration))
                for tau, m in zip(taus, moments)]

    alone = BatchAttention(attentions(), start=start, batched=False)
    rows = BatchAttention(attentions(), start=start)
    want = [alone(q, k, v, layer) for layer in range(L)]
    monkeypatch.setattr(DecodeAttention, "__call__", lambda *a: pytest.fail("the row-by-row path ran"))
    got = [rows(q, k, v, layer) for layer in range(L)]
    for w, y in zip(want, got):
        torch.testing.assert_close(y.float(), w.float(), rtol=0, atol=tol)
    labels = torch.stack([a.stats.label_tensor() for a in rows.rows])  # (B, S, L, H)
    assert torch.equal(labels, torch.stack([a.stats.label_tensor() for a in alone.rows]))
    assert 0.1 < labels.float().mean() < 0.9 and len({float(m) for m in labels.float().mean((1, 2, 3))}) > 1
    assert [a.stats.lengths for a in rows.rows] == [[T - s] for s in start]  # one decode step, each row's own T
    rows.done[2] = True
    y = rows(q, k, v, 0)
    assert torch.equal(y[2], torch.zeros_like(y[2])) and len(rows.rows[2].stats.lengths) == 1
    torch.testing.assert_close(y[3].float(), want[0][3].float(), rtol=0, atol=tol)


def test_rows_whose_moments_change_every_step_decode_as_each_row_alone():
    """Moments that are not FixedMoments (here those of the latest keys, new at every step) keep the rows off the
    batched decision, which makes each set of rows' forms once: over several steps, each row's labels and output are
    its own path's."""
    B, H, Hkv, T, D, steps = 2, 4, 2, 100, 16, 3

    class Latest:  # the moments of the row's 8 latest keys
        def quadratic_form(self, layer, k):
            return gaussian_form(k[:, -8:].float().mean(1) * 4, torch.eye(D).expand(Hkv, D, D) * 0.1)

    g = torch.Generator().manual_seed(9)
    q = torch.randn(steps, B, H, 1, D, generator=g) * 2
    k, v = torch.randn(B, Hkv, T + steps, D, generator=g), torch.randn(B, Hkv, T + steps, D, generator=g)
    alone, rows = ([DecodeAttention("qada", 4, 32, dict(tau=0.3, moments=Latest())) for _ in range(B)]
                   for _ in range(2))
    alone, together = BatchAttention(alone, start=[0, 10], batched=False), BatchAttention(rows, start=[0, 10])
    for step in range(steps):
        n = T + step + 1
        torch.testing.assert_close(together(q[step], k[:, :, :n], v[:, :, :n], 0),
                                   alone(q[step], k[:, :, :n], v[:, :, :n], 0), rtol=0, atol=1e-5)
    for a, b in zip(alone.rows, together.rows):
        assert torch.equal(b.stats.label_tensor(), a.stats.label_tensor())
    labels = torch.stack([a.stats.label_tensor() for a in alone.rows])  # (B, steps, 1, H)
    assert (labels[:, 1:] != labels[:, :1]).any()  # the labels move with the moments


def test_rows_with_their_own_window_or_correction_decode_as_each_row_alone():
    """The batched decision takes one path, one window and one correction for every row: rows on other qada paths,
    with other windows, or with corrections that are other objects (here of other values), are each decided on their
    own path, as alone."""
    B, H, Hkv, T, D, L = 2, 4, 2, 200, 16, 1
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, 1, D, generator=g) * torch.linspace(0.5, 3.0, H)[:, None, None]
    k, v = torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    moments = FixedMoments(torch.zeros(L, Hkv, D), torch.eye(D).expand(L, Hkv, D, D) * 0.1, 100)
    corrections = [Calibration(torch.full((L, H), a), torch.ones(L, H), None, {}) for a in (2.0, -2.0)]

    def rows(batched):
        windows = [DecodeAttention("qada", 4, n_local, dict(tau=0.3, moments=moments, calibration=corrections[0]))
                   for n_local in (32, 64)]
        paths = [DecodeAttention(m, 4, 32, dict(tau=0.2, moments=moments)) for m in ("qada", "qada_kv")]  # row 1:
        # its group rule labels a group local whose heads qada's per-head rule parts
        own = [DecodeAttention("qada_cal", 4, 32, dict(tau=0.3, moments=moments, calibration=c)) for c in corrections]
        return [BatchAttention(r, start=[0, 20], batched=batched) for r in (paths, windows, own)]

    for alone, together in zip(rows(False), rows(True)):
        torch.testing.assert_close(together(q, k, v, 0), alone(q, k, v, 0), rtol=0, atol=1e-5)
        assert [torch.equal(a.stats.label_tensor(), b.stats.label_tensor())
                for a, b in zip(alone.rows, together.rows)] == [True, True]
    labels = torch.stack([a.stats.label_tensor()[0, 0] for a in alone.rows])
    assert labels[0].all() and not labels[1].any()  # the corrections part the rows


def qada_pair(start: list[int], track_first: bool = False):
    """Two rows of a 100-position cache (4 heads on 2 KV heads, seed 1) on qada at tau 0.3 with a window of 32 after 4
    sinks, starting at `start`, the first tracking the oracle if asked: (q, k, v, row by row, batched)."""
    B, H, Hkv, T, D = 2, 4, 2, 100, 16
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    moments = FixedMoments(torch.zeros(1, Hkv, D), torch.eye(D).expand(1, Hkv, D, D) * 0.01, 100)

    def rows(batched):
        atts = [DecodeAttention("qada", 4, 32, dict(tau=0.3, moments=moments)) for _ in range(B)]
        atts[0].stats.track_oracle = track_first
        return BatchAttention(atts, start=start, batched=batched)

    return q, k, v, rows(False), rows(True)


@pytest.mark.parametrize("short", [16, 32])
def test_a_row_within_its_window_keeps_the_batch_off_the_batched_decision(short, monkeypatch):
    """A row whose context fits its window (n_local = 32 positions here, or fewer) has no bulk to decide on: its path
    attends to all of it, every head local, and the rows are not decided together; every row decodes as alone."""
    q, k, v, alone, together = qada_pair([0, 100 - short])
    monkeypatch.setattr(BatchAttention, "qada_rows", lambda *args: pytest.fail("the rows were decided together"))
    torch.testing.assert_close(together(q, k, v, 0), alone(q, k, v, 0), rtol=0, atol=1e-5)
    assert [torch.equal(a.stats.label_tensor(), b.stats.label_tensor()) for a, b in zip(alone.rows, together.rows)] == [
        True, True] and together.rows[1].stats.label_tensor().all()


def test_a_row_that_tracks_the_oracle_keeps_the_batch_off_the_batched_decision():
    """The oracle's statistics read every score of a row, on its own path: with one row tracking them the rows are not
    decided together, and that row's oracle labels and masses are recorded beside its labels, as alone."""
    q, k, v, alone, together = qada_pair([0, 10], track_first=True)
    torch.testing.assert_close(together(q, k, v, 0), alone(q, k, v, 0), rtol=0, atol=1e-5)
    tracked, want = together.rows[0].stats, alone.rows[0].stats
    assert tracked.oracle_tensor().shape == (1, 1, 4) and torch.equal(tracked.oracle_tensor(), want.oracle_tensor())
    assert torch.equal(tracked.log_masses[0][0], want.log_masses[0][0])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(make_tiny_dir(tmp_path_factory.mktemp("tiny_batch"))))


def test_a_stacked_cache_decodes_each_prompt_as_alone(tiny):
    """Plain dense decoding of three prompts of different lengths in one left-padded cache: each row's logits
    equal that prompt's decoded alone at every step (RoPE positions counted from the row's own first token, the
    padding masked)."""
    lengths, steps = [37, 90, 64], 6
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 100, (1, n), generator=g) for n in lengths]
    alone, caches, firsts = [], [], []
    for ids in prompts:
        cache = tiny.new_cache(ids.shape[1] + steps)
        logits = tiny.prefill(ids, cache)
        caches.append(tiny.new_cache(ids.shape[1] + steps))
        firsts.append(tiny.prefill(ids, caches[-1]))
        seq = [logits]
        for _ in range(steps):
            logits = tiny.decode_step(logits.argmax(-1), cache)
            seq.append(logits)
        alone.append(torch.cat(seq))  # (steps + 1, V)
    stacked = type(caches[0]).stack(caches, steps)
    assert stacked.start.tolist() == [90 - 37, 0, 90 - 64] and stacked.length == 90
    logits, seq = torch.cat(firsts), [torch.cat(firsts)]
    for _ in range(steps):
        logits = tiny.decode_step(logits.argmax(-1), stacked)
        seq.append(logits)
    batched = torch.stack(seq, 1)  # (B, steps + 1, V)
    for b in range(3):
        torch.testing.assert_close(batched[b], alone[b], rtol=0, atol=1e-4)
    assert (alone[0] - alone[1][:, :]).abs().max() > 1e-2  # the prompts really differ


@pytest.mark.parametrize("method", ["dense", "local", "oracle", "qada", "qada_kv", "static"])
def test_generate_decodes_several_prompts_as_one_batch_each_as_alone(tiny_dir_batch, tmp_path, method):
    """generate.run_batch on three prompt files of different lengths gives each prompt the tokens, labels and
    statistics it gets decoded alone."""
    files = [str(write_prompt(tmp_path, n)) for n in (60, 150, 97)]
    labels_file = tmp_path / "labels.json"
    from criterion import save_labels
    save_labels(labels_file, torch.linspace(0, 1, 8).view(2, 4), {"test": True})
    reads = path_inputs(method)
    kw = dict(model=str(tiny_dir_batch), max_new_tokens=12, method=method, n_sink=4, n_local=16, progress=False,
              moments_source="prompt" if "moments" in reads else None, tau=0.2 if "tau" in reads else None,
              static_labels=str(labels_file) if "static_local" in reads else None)  # what the path reads, only
    batched = generate.run_batch(files, **kw)
    assert [r["batch"] for r in batched] == [3, 3, 3] and [r["prompt"] for r in batched] == files
    for f, r in zip(files, batched):
        alone = generate.run(f, **kw)
        same = ("new_token_ids", "text", "sparsity", "kv_read", "layer_sparsity", "prompt_tokens", "new_tokens")
        assert {k: r[k] for k in same} == {k: alone[k] for k in same}, (method, f)
    assert len({tuple(r["new_token_ids"]) for r in batched}) > 1  # different prompts, different answers
    if method in ("qada", "qada_kv", "oracle"):
        assert len({r["sparsity"] for r in batched}) > 1  # each row decided on its own


@pytest.fixture(scope="module")
def tiny_dir_batch(tmp_path_factory):
    return make_tiny_dir(tmp_path_factory.mktemp("tiny_batch_cli"))


def test_cli_takes_several_files_and_a_jsonl(tiny_dir_batch, tmp_path, capsys):
    a, b = write_prompt(tmp_path, 40), write_prompt(tmp_path, 70)
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(json.dumps({"prompt": a.read_text()}) + "\n\n" + json.dumps(b.read_text()) + "\n")
    base = ["--model", str(tiny_dir_batch), "--max-new-tokens", "4", "--n-local", "16", "--n-sink", "4", "--json"]
    assert generate.main(["--prompt", str(a), str(b)] + base) == 0
    from_files = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert generate.main(["--prompt", str(jsonl)] + base) == 0
    from_jsonl = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in from_jsonl] == [f"{jsonl}:1", f"{jsonl}:3"]
    assert [r["new_token_ids"] for r in from_files] == [r["new_token_ids"] for r in from_jsonl]
    assert [r["prompt_tokens"] for r in from_files] == [40, 70]
    assert generate.main(["--prompt", str(a), str(b)] + base[:-1]) == 0
    out = capsys.readouterr().out
    assert out.count("2 prompts decoded as one batch") == 2 and out.count("KV entries read") == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "w1 w2"}\n')
    assert generate.main(["--prompt", str(bad)] + base) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "line 1" in err and "Traceback" not in err


@pytest.mark.parametrize("loop", ["eager", "static"])
def test_a_row_stops_at_its_first_end_token(tiny, loop):
    """With an end token that row 0's greedy run emits at its third step and row 1's never does, row 0 ends there
    (the end token kept, as the last) and row 1 runs to max_new_tokens, in decode_batch and in decode_static."""
    from model import KVCache
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 100, (1, n), generator=g) for n in (40, 57)]
    n_new = 8

    def run(eos_ids):
        caches = [tiny.new_cache(p.shape[1] + n_new) for p in prompts]
        logits = torch.cat([tiny.prefill(p, c) for p, c in zip(prompts, caches)])
        cache = KVCache.stack(caches, n_new)
        if loop == "eager":
            return generate.decode_batch(tiny, cache, logits, n_new, None, eos_ids)
        rows = [DecodeAttention("dense", 4, 16) for _ in prompts]
        return generate.decode_static(tiny, cache, logits, n_new, rows, eos_ids)

    free = run(())
    end = free[0][2]
    assert end not in free[0][:2] and end not in free[1], "the prompts need another end token"
    assert run((end,)) == [free[0][:3], free[1]]


@pytest.mark.parametrize("method", [None, "qada", "oracle"])
def test_rows_that_end_leave_the_batch_and_the_rest_decode_as_alone(tiny, monkeypatch, method):
    """Rows ending at different steps: once half have ended the batch goes on with the others only (their
    cache rows copied out); every row's tokens and labels still equal its prompt decoded alone."""
    from attention import build_attention
    from model import KVCache
    g = torch.Generator().manual_seed(4)  # six prompts whose greedy continuations all differ
    prompts = [torch.randint(0, 100, (1, n), generator=g) for n in (150, 40, 97, 120, 66, 131)]
    n_new = 16

    def prefilled():
        caches = [tiny.new_cache(p.shape[1] + n_new) for p in prompts]
        return caches, [tiny.prefill(p, c) for p, c in zip(prompts, caches)]

    def attn(cache):
        return None if method is None else build_attention(method, cache, tau=0.3, moments_source="prompt", n_sink=4,
                                                           n_local=16)

    caches, firsts = prefilled()
    free = [generate.decode(tiny, c, f, n_new, attn(c)) for c, f in zip(caches, firsts)]  # no EOS: the paths
    # A stop rule that ends five rows early, each at its own step (once its tokens are its free run's first 2, 4,
    # ... 10), so that the batch shrinks twice (6 -> 3 -> 1 rows); the row that runs on is the one whose tokens
    # vary most
    survivor = max(range(len(free)), key=lambda r: len(set(free[r])))
    assert len({tuple(seq) for seq in free}) == len(free) and len(set(free[survivor])) >= 8
    stops = [free[r][:2 * (i + 1)] for i, r in enumerate(r for r in range(len(free)) if r != survivor)]
    finished = lambda ids: ids in stops  # noqa: E731
    caches, firsts = prefilled()
    alone_atts = [attn(c) for c in caches]
    alone = [generate.decode_batch(tiny, c, f, n_new, a, finished=finished)[0]
             for c, f, a in zip(caches, firsts, alone_atts)]
    caches, firsts = prefilled()
    stacked = KVCache.stack(caches, n_new)
    atts = [attn(c) for c in caches]
    batch_attn = None if method is None else BatchAttention(atts, start=stacked.start.tolist())
    selected = []
    original = KVCache.select_rows
    monkeypatch.setattr(KVCache, "select_rows", lambda self, rows: selected.append(list(rows)) or original(self, rows))
    batched = generate.decode_batch(tiny, stacked, torch.cat(firsts), n_new, batch_attn, finished=finished)
    assert batched == alone and sorted(map(len, alone)) == [2, 4, 6, 8, 10, n_new]
    assert [len(rows) for rows in selected] == [3, 1]  # compacted twice, to the rows still decoding
    if method is not None:
        for a, b in zip(atts, alone_atts):
            assert a.stats.lengths == b.stats.lengths and torch.equal(a.stats.label_tensor(), b.stats.label_tensor())


def test_a_static_cache_decodes_as_the_growing_one(tiny):
    """model.KVCache's static mode (the filled length a device tensor, writes at a device position, views of a fixed
    length): the model's dense decoding of a left-padded stack gives the logits and cache entries of the usual cache,
    whose views grow with T, at every step; the host length stays put until release, then is the device's."""
    lengths, steps = [37, 90, 64], 6
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 100, (1, n), generator=g) for n in lengths]

    def stacked():
        caches = [tiny.new_cache(ids.shape[1] + steps) for ids in prompts]
        firsts = torch.cat([tiny.prefill(ids, c) for ids, c in zip(prompts, caches)])
        return type(caches[0]).stack(caches, steps + 20), firsts  # room past the last step: views run into it

    growing, logits = stacked()
    static, _ = stacked()
    static.fix()
    tokens = logits.argmax(-1)
    for i in range(steps):
        want = tiny.decode_step(tokens, growing)
        got = tiny.decode_step(tokens, static)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert static.length == 90 and int(static.filled) == 90 + i + 1
        tokens = want.argmax(-1)
    static.release()
    assert static.length == growing.length == 90 + steps and static.filled is None
    torch.testing.assert_close(static.k[:, :, :, :static.length], growing.k[:, :, :, :growing.length], rtol=0,
                               atol=1e-5)  # the entries each step wrote, at the positions it wrote them
    with pytest.raises(ValueError, match="one token at a time"):
        static.fix()
        tiny(torch.zeros(3, 2, dtype=torch.long), static)
