"""lab.peers on tiny random models: the shared prefill against kvpress's own press(model) prefill and answer loop,
under both protocols, and the runner's records, pairing check and resume. Seconds. kvpress pins an older transformers
than the suite is held to, so these run in an environment of their own (.ci/run makes it); elsewhere they are
skipped."""

import json
import shutil
import time
import types

import numpy as np
import pytest
import torch

kvpress = pytest.importorskip("kvpress")
from kvpress.pipeline import KVPressTextGenerationPipeline  # noqa: E402
from kvpress.utils import compute_n_kept  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from lab import peers, report  # noqa: E402
from lab.records import ids_hash, read_records, write_records  # noqa: E402
from lab.sweep import FolderLocked, folder_lock  # noqa: E402
from tests.test_generate import make_tiny_dir  # noqa: E402
from tests.test_model import save_tiny  # noqa: E402
from weights.tokenizer import Tokenizer  # noqa: E402

T, N_CTX = 300, 200  # prompt length, and where its "question" starts


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    model = save_tiny("llama-gqa", tmp_path_factory.mktemp("peer"))
    model.generation_config.eos_token_id = 0
    return model


def kvpress_cache(hf, ids, press):
    """kvpress's way: a prefill of `ids` under `with press(model)`."""
    cache = DynamicCache()
    with torch.no_grad(), press(hf):
        hf.model(input_ids=ids, past_key_values=cache)
    return cache


def kvpress_answer(hf, cache, rest, start, max_new):
    """kvpress's answer loop (KVPressTextGenerationPipeline.generate_answer), its ids instead of text."""
    me = types.SimpleNamespace(model=hf, tokenizer=types.SimpleNamespace(
        decode=lambda ids, skip_special_tokens: json.dumps(ids.tolist())))
    with torch.no_grad():
        return json.loads(KVPressTextGenerationPipeline.generate_answer(me, rest, cache, start, max_new))


@pytest.mark.parametrize("peer", [peers.Peer("snapkv", "question", 0.5),
                                  peers.Peer("expected_attention", "question", 0.75),
                                  peers.Peer("snapkv", "context", 0.5),
                                  peers.Peer("expected_attention", "context", 0.5),
                                  peers.Peer("knorm", "context", 0.75), peers.Peer("streaming_llm", "question", 0.5)],
                         ids=lambda p: p.key)
def test_one_shared_prefill_gives_each_press_its_own_prefill(hf, peer):
    """Every press compressed from one dense prefill equals that press run as kvpress runs it, on a prefill of its
    own span; the answer decoded from it equals kvpress's answer loop's, and the KV read follows from the kept count."""
    ids = torch.randint(1, 101, (1, T), generator=torch.Generator().manual_seed(3))
    span = T - 1 if peer.protocol == "question" else N_CTX
    others = [peers.Peer("snapkv", "question", 0.25), peers.Peer("knorm", "context", 0.5)]  # beside it, as in a run
    spans = {p.key: (T - 1 if p.protocol == "question" else N_CTX) for p in [peer] + others}
    kv, seconds = peers.compress_all(hf, ids[:, :T - 1], spans, {p.key: p.make() for p in [peer] + others})
    ref = kvpress_cache(hf, ids[:, :span], peer.make())
    kept = compute_n_kept(span, peer.ratio)  # kvpress's rounding
    for layer, (k, v) in enumerate(kv[peer.key]):
        assert k.shape[2] == kept
        torch.testing.assert_close(k, ref.layers[layer].keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(v, ref.layers[layer].values, rtol=0, atol=1e-5)
    new, read = peers.greedy(hf, kv[peer.key], ids[:, span:], span, 12, {0})
    assert new == kvpress_answer(hf, ref, ids[:, span:], span, 12)
    positions = [T + i for i in range(len(new))]  # the forward passes that produced a token, by entries read
    assert read == pytest.approx([(kept + p - span) / p for p in positions])


def test_grouped_sdpa_is_transformers_sdpa_without_the_copies():
    """The folded attention equals transformers' own (which repeats each KV head per query head) under a padding and
    causal mask, for several queries at once (the rest of a prompt) and one."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    g = torch.Generator().manual_seed(0)
    B, Hkv, G, S, D = 3, 2, 4, 40, 8
    module = types.SimpleNamespace(num_key_value_groups=G, is_causal=True)
    key, value = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    for q in (7, 1):
        query = torch.randn(B, Hkv * G, q, D, generator=g)
        mask = torch.rand(B, 1, q, S, generator=g) > 0.3
        mask[..., -1] = True  # every query row sees something
        want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
        got, _ = peers.grouped_sdpa(module, query, key, value, mask, scaling=0.3)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_a_batch_of_presses_decodes_each_as_it_would_alone(hf):
    """Every press of a prompt decoded as one batch (caches of different lengths, both protocols, the uncompressed
    control) gives each row the ids and KV reads of that row decoded alone: the padding is masked, the positions are
    the row's own, and no KV head is copied for the padded batch (grouped_sdpa)."""
    ids = torch.randint(1, 101, (1, T), generator=torch.Generator().manual_seed(5))
    todo = [peers.HF_DENSE, peers.Peer("snapkv", "question", 0.5), peers.Peer("expected_attention", "question", 0.75),
            peers.Peer("knorm", "question", 0.5), peers.Peer("snapkv", "context", 0.5),
            peers.Peer("knorm", "context", 0.9)]
    spans = {p.key: (T - 1 if p.protocol == "question" else N_CTX) for p in todo}
    kv, _ = peers.compress_all(hf, ids[:, :T - 1], spans, {p.key: p.make() for p in todo})
    rows = [(kv[p.key], ids[:, spans[p.key]:], spans[p.key]) for p in todo]
    alone = [peers.greedy(hf, *row, 10, {0}) for row in rows]
    assert peers.greedy_rows(hf, rows, 10, {0}) == alone
    assert len({tuple(new) for new, _ in alone}) > 2  # the rows answer differently: a mix-up would show
    assert hf.config._attn_implementation == "sdpa"  # put back
    with pytest.raises(ValueError, match="one position"):  # a row whose prompt ends elsewhere
        peers.greedy_rows(hf, [rows[0], (rows[1][0], ids[:, T - 3:T - 1], T - 3)], 4, {0})


def test_an_uncompressed_cache_decodes_as_dense(hf):
    """The answer loop with nothing dropped is plain greedy decoding of the whole prompt, reading everything."""
    ids = torch.randint(1, 101, (1, T), generator=torch.Generator().manual_seed(4))
    cache = DynamicCache()
    with torch.no_grad():
        hf.model(input_ids=ids[:, :T - 1], past_key_values=cache)
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    new, read = peers.greedy(hf, kv, ids[:, T - 1:], T - 1, 8, set())
    ref = hf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert new == ref[0, T:].tolist()
    assert read == [1.0] * 8


def test_expected_attention_runs_on_a_model_kvpress_never_hooked(tmp_path):
    """ExpectedAttentionPress rotates its query statistics with the layer's rotary table, which only kvpress's own
    `press(model)` attaches: compress_all attaches it, so a freshly loaded model compresses as kvpress would."""
    model = save_tiny("llama-gqa", tmp_path)  # not the module's `hf`, which kvpress_cache has already hooked
    ids = torch.randint(1, 101, (1, T), generator=torch.Generator().manual_seed(9))
    peer = peers.Peer("expected_attention", "question", 0.5)
    kv, _ = peers.compress_all(model, ids[:, :T - 1], {peer.key: T - 1}, {peer.key: peer.make()})
    ref = kvpress_cache(model, ids[:, :T - 1], peer.make())
    for layer, (k, v) in enumerate(kv[peer.key]):
        torch.testing.assert_close(k, ref.layers[layer].keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(v, ref.layers[layer].values, rtol=0, atol=1e-5)


def test_caches_of_different_lengths_with_one_token_left_are_masked_and_folded(hf, monkeypatch):
    """Rows whose caches alone differ in length (the question-aware protocol, several ratios: one token left to
    feed in every row) are padded and masked too, and their attention runs folded (grouped_sdpa) under that mask."""
    ids = torch.randint(1, 101, (1, T), generator=torch.Generator().manual_seed(7))
    todo = [peers.HF_DENSE, peers.Peer("snapkv", "question", 0.5), peers.Peer("knorm", "question", 0.75)]
    kv, _ = peers.compress_all(hf, ids[:, :T - 1], dict.fromkeys([p.key for p in todo], T - 1),
                               {p.key: p.make() for p in todo})
    rows = [(kv[p.key], ids[:, T - 1:], T - 1) for p in todo]
    alone = [peers.greedy(hf, *row, 10, {0}) for row in rows]
    masked = []
    grouped = peers.grouped_sdpa
    monkeypatch.setattr(peers, "grouped_sdpa", lambda module, q, k, v, mask, *a, **kw:  # counts the masked calls
                        masked.append(mask is not None) or grouped(module, q, k, v, mask, *a, **kw))
    assert peers.greedy_rows(hf, rows, 10, {0}) == alone
    assert len({tuple(new) for new, _ in alone}) > 1  # the rows answer differently: a mix-up would show
    assert masked and all(masked)  # every layer's every step under the padding mask, not transformers' copies


def test_each_row_feeds_its_rest_at_its_own_positions_and_stops_at_its_own_eos(hf):
    """A row's remaining prompt tokens go in at positions start .. n - 1 (the padding before them masked), its answer
    at n, n + 1, ...; a row that says EOS stops there while the others decode on."""
    ids = torch.randint(1, 101, (1, T), generator=torch.Generator().manual_seed(19))
    todo = [peers.Peer("snapkv", "question", 0.5), peers.Peer("knorm", "context", 0.5)]
    spans = {p.key: (T - 1 if p.protocol == "question" else N_CTX) for p in todo}
    kv, _ = peers.compress_all(hf, ids[:, :T - 1], spans, {p.key: p.make() for p in todo})
    rows = [(kv[p.key], ids[:, spans[p.key]:], spans[p.key]) for p in todo]
    positions = []
    hook = hf.model.register_forward_pre_hook(lambda m, a, kw: positions.append(kw["position_ids"].clone()),
                                              with_kwargs=True)
    try:
        free = peers.greedy_rows(hf, rows, 6, set())
    finally:
        hook.remove()
    R = T - N_CTX  # the longest rest: the context row's
    assert positions[0].shape == (2, R) and positions[0][0, R - 1].item() == T - 1  # the question row: its last token
    assert positions[0][1].tolist() == list(range(N_CTX, T))
    assert [p.tolist() for p in positions[1:]] == [[[T + i]] * 2 for i in range(5)]  # the answer, 6 passes in all
    eos = free[0][0][0]  # the first row's first answer token, which the second row never says
    assert eos not in free[1][0]
    assert [new for new, _ in peers.greedy_rows(hf, rows, 6, {eos})] == [[eos], free[1][0]]


def test_a_press_keeping_different_counts_per_layer_is_refused_from_a_batch(hf):
    """One padding mask serves every layer, so a cache whose layers hold different counts cannot be a row."""
    ids = torch.randint(1, 101, (1, T), generator=torch.Generator().manual_seed(6))
    kv, _ = peers.compress_all(hf, ids[:, :T - 1], {"d": T - 1}, {"d": peers.HF_DENSE.make()})
    ragged = [(k[:, :, :T - 1 - i], v[:, :, :T - 1 - i]) for i, (k, v) in enumerate(kv["d"])]
    with pytest.raises(ValueError, match="in different layers"):
        peers.greedy_rows(hf, [(ragged, ids[:, T - 1:], T - 1)], 4, {0})


def test_a_prompt_kvpress_refuses_is_one_clear_error(hf):
    """kvpress checks its inputs with asserts: SnapKV's window (64 queries) longer than the span is a ValueError
    naming the sample, not an AssertionError's traceback."""
    ids = torch.randint(1, 101, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    sample = types.SimpleNamespace(task="niah_single_1", index=4, max_new_tokens=4)
    with pytest.raises(ValueError, match="niah_single_1#4: kvpress refused the prompt: Query length 39"):
        peers.run_sample(hf, None, sample, ids, None, [peers.Peer("snapkv", "question", 0.5)], "cpu")


def test_a_bad_press_or_ratio_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown press 'snap'"):
        peers.build_peers(["snap"], [0.5], [])
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        peers.build_peers(["snapkv"], [1.0], [])
    with pytest.raises(ValueError, match="nothing to run"):
        peers.build_peers([], [0.5], [], dense=False)
    assert len(peers.build_peers(["snapkv"], [0.5, 0.5], [], dense=False)) == 1
    assert ([p.key for p in peers.build_peers(["snapkv"], [0.5], [0.25])]
            == ["hf_dense", "snapkv@0.5", "snapkv_ctx@0.25"])


def test_every_ratio_of_either_protocol_lies_strictly_between_0_and_1():
    """A ratio of 0 (the control's, not a press's), NaN or one past 1 is refused under either protocol."""
    for ratios, context_ratios in (([0.0], []), ([float("nan")], []), ([0.5], [1.5]), ([], [0.0])):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            peers.build_peers(["snapkv"], ratios, context_ratios)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_dir(tmp_path_factory.mktemp("peer_cli"))


def run(tiny_dir, out, **kw):
    args = dict(out=str(out), tasks="niah_single_1", length=400, samples=2, presses="snapkv", ratios="0.5",
                context_ratios="0.5", seed=42, model=str(tiny_dir), dtype="float32", device="cpu", pair=None,
                threads=None, progress=False) | kw
    return peers.run(**args)


def test_the_runner_writes_sweep_records_that_pair_and_resume(tiny_dir, tmp_path, monkeypatch):
    out = run(tiny_dir, tmp_path / "peers")
    rows = read_records(out)
    assert sorted((r["index"], r["config"]) for r in rows) == [(i, c) for i in (0, 1)
                                                               for c in ("hf_dense", "snapkv@0.5", "snapkv_ctx@0.5")]
    assert not list(out.glob("samples*.jsonl"))  # merged into samples.jsonl.xz
    for r in rows:
        assert {"task", "index", "config", "method", "path", "source", "threshold", "threshold_kind", "n_prompt",
                "n_new", "score", "pred", "steps", "sparsity", "kv_read"} <= r.keys()
        assert r["sparsity"] is None and r["score"] in (0.0, 1.0)
        assert r["kv_read"] == 1.0 if r["config"] == "hf_dense" else 0 < r["kv_read"] < 1
        if r["config"] == "snapkv@0.5":
            span = r["n_prompt"] - 1
            assert r["kv_kept"] == pytest.approx(compute_n_kept(span, 0.5) / span)
    # resuming decodes nothing; a pair folder with other prompt lengths is refused
    monkeypatch.setattr(peers, "run_sample", lambda *a: pytest.fail("resumed run decoded again"))
    run(tiny_dir, tmp_path / "peers")
    pair = tmp_path / "sweep"
    pair.mkdir()
    (pair / "samples.jsonl").write_text("".join(json.dumps(dict(r, n_prompt=r["n_prompt"] + 1, config="dense")) + "\n"
                                                for r in rows))
    with pytest.raises(ValueError, match="prompt tokens here"):
        run(tiny_dir, tmp_path / "other", pair=str(pair))
    assert not (tmp_path / "other" / "run.json").exists()  # a refused run leaves no settings to clash with later
    with pytest.raises(ValueError, match="nothing to run"):
        run(tiny_dir, tmp_path / "empty", samples=0)


def test_a_folder_another_run_holds_is_refused_before_anything_is_written(tiny_dir, tmp_path):
    out = tmp_path / "peers"
    out.mkdir()
    with folder_lock(out):  # a sweep (or another lab.peers) writing the folder
        with pytest.raises(FolderLocked, match="another lab.sweep or lab.peers"):
            run(tiny_dir, out)
    assert list(out.iterdir()) == []  # no settings, no records


def test_the_control_runs_on_the_first_samples_only_when_asked(tiny_dir, tmp_path):
    out = run(tiny_dir, tmp_path / "peers", samples=3, context_ratios="", dense_samples=1)
    assert sorted((r["index"], r["config"]) for r in read_records(out)) == [
        (0, "hf_dense"), (0, "snapkv@0.5"), (1, "snapkv@0.5"), (2, "snapkv@0.5")]
    with pytest.raises(ValueError, match="count >= 0"):
        run(tiny_dir, tmp_path / "bad", dense_samples=-1)


def sweep_folder(path, settings, rows, configs=("dense",), score=lambda config, index: 1.0):
    """A sweep's folder holding, for each record of `rows`, a copy under each of `configs` (reading everything)."""
    path.mkdir()
    (path / "run.json").write_text(json.dumps({"runs": [], "settings": dict(settings, n_sink=16, n_local=128)}))
    out = [dict(r, config=c, method=c.split("@")[0], path=c.split("@")[0], threshold=None, threshold_kind=None,
                score=score(c, r["index"]), sparsity=0.0, kv_read=1.0) for r in rows for c in configs]
    (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def test_report_pairs_peer_records_with_a_sweep(tiny_dir, tmp_path):
    """A sweep folder reported --with a peers folder: the peers join its KV-read tables on the shared samples, at
    the values their records give (scores set here: the tiny random model answers nothing)."""
    out = run(tiny_dir, tmp_path / "peers", ratios="0.25,0.5,0.75", context_ratios="")  # + hf_dense
    rows = read_records(out)
    wins = {"snapkv@0.25": (1.0, 1.0), "snapkv@0.5": (1.0, 0.0), "snapkv@0.75": (0.0, 0.0)}  # per sample index
    for r in rows:
        r["score"] = wins.get(r["config"], (1.0, 1.0))[r["index"]]
    narrowed = dict(next(r for r in rows if r["config"] == "snapkv@0.75" and r["index"] == 0), config="snapkv@0.9",
                    kv_read=0.05, score=0.0)  # a configuration the grid dropped after one sample
    write_records(out / "samples.jsonl.xz", rows + [narrowed])
    settings = json.loads((out / "run.json").read_text())["settings"]
    sweep_dir = sweep_folder(tmp_path / "sweep", settings, [r for r in rows if r["config"] == "hf_dense"])
    report.report(sweep_dir, baselines=[out])
    text = (sweep_dir / "analysis.md").read_text()
    section = text.split("## Peers: kvpress's presses at matched KV read")[1].split("\n## ")[0]
    kv = {c: np.mean([r["kv_read"] for r in rows if r["config"] == c]) for c in wins}
    at_half = np.interp(0.5, [kv["snapkv@0.75"], kv["snapkv@0.5"]], [0.0, 0.5])  # between its two points around 0.5
    assert kv["snapkv@0.75"] < 0.5 < kv["snapkv@0.5"]
    assert f"| kvpress SnapKV (question in the press) | {at_half:.2f} [" in section  # both samples: 0.9 left out
    assert "2 samples (niah_single_1 2)" in section and "left out here: snapkv@0.9 (1 runs)" in section
    assert "| snapkv@0.75 | 0.248 |" in section  # kept of the compressed span
    assert "| hf_dense | – | 1.00 | 1.00 |" in text  # the control: no head sparsity, everything read, as dense
    assert (sweep_dir / "figKV_score_vs_kv_read.png").is_file()


def test_peers_on_fewer_samples_leave_the_sweep_averages_alone(tiny_dir, tmp_path):
    """The summary averages a sweep's configurations on the samples they all finished; peers that ran on fewer
    samples join the report without shrinking that set. A peers folder reported alone has nothing to pair with."""
    out = run(tiny_dir, tmp_path / "peers", samples=1, ratios="0.5", context_ratios="")
    two = run(tiny_dir, tmp_path / "peers2", samples=2, ratios="0.5", context_ratios="", dense_samples=0)
    settings = json.loads((out / "run.json").read_text())["settings"]
    sweep_dir = sweep_folder(tmp_path / "sweep", settings, read_records(two), ("dense", "local"),
                             lambda config, index: float(config == "dense" or index == 0))  # local: 1, then 0
    report.report(sweep_dir)
    alone = (sweep_dir / "summary.md").read_text()
    report.report(sweep_dir, baselines=[out])
    row = lambda text: next(line for line in text.splitlines() if line.startswith("| local |"))  # noqa: E731
    assert row((sweep_dir / "summary.md").read_text()) == row(alone) and "| 50.0 | 0.50 |" in row(alone)
    assert report.main([str(out)]) == 0  # no dense there: the peers table says so instead of failing
    assert "No sample has every press configuration and dense" in (out / "analysis.md").read_text()


def tiny_tok(tiny_dir):
    return Tokenizer.from_dir(tiny_dir)  # words w0 .. w99, one token each; anything else is <unk>


def test_the_question_starts_at_the_last_line_of_the_user_turn(tiny_dir):
    """The split falls before the user turn's last line, at its last occurrence in the prompt (its words also appear
    earlier, in the context), and the answer prefix after it stays with the question."""
    tok = tiny_tok(tiny_dir)
    sample = types.SimpleNamespace(task="t", index=0, input="w4 w5 w6\nw7 w8\nw4 w5",
                                   prompt="w0 w4 w5 w6\nw7 w8\nw4 w5 w9")  # w0: the template's, w9: the answer prefix
    ids = tok.encode(sample.prompt)
    at = peers.question_start(sample, ids, tok)
    assert ids[:at] == tok.encode("w0 w4 w5 w6\nw7 w8") and ids[at:] == tok.encode("w4 w5 w9")


def test_a_prompt_without_a_question_line_or_split_inside_a_token_is_refused(tiny_dir):
    """A user turn ending in a newline has no question line; a question glued to the word before it (one token in
    the prompt) leaves no token boundary to split the cache at."""
    tok = tiny_tok(tiny_dir)
    for text, message in (("w0 w1\n", "no question line"), ("w0 w1\nw7 w8", "no question line"),
                          ("w0 w1\nw5", "the text before the question does not end on a token boundary")):
        sample = types.SimpleNamespace(task="t", index=3, input=text, prompt="w0 w1\nw1w5")
        with pytest.raises(ValueError, match=f"t#3: {message}"):
            peers.question_start(sample, tok.encode(sample.prompt), tok)


def test_each_record_says_which_pipeline_ran_and_what_its_cache_held(tiny_dir, tmp_path, monkeypatch):
    """The control through transformers, the presses through kvpress at their ratio; the KV read the mean over the
    answer's steps, the cache's bytes those of the entries kept, and the batch's decoding time shared by its rows."""
    decoding = []
    greedy_rows = peers.greedy_rows

    def timed(*a):  # the batch's wall time, made long enough that sharing it shows past the records' rounding
        t0 = time.perf_counter()
        time.sleep(0.3)
        out = greedy_rows(*a)
        decoding.append(time.perf_counter() - t0)
        return out
    monkeypatch.setattr(peers, "greedy_rows", timed)
    out = run(tiny_dir, tmp_path / "peers", samples=1)
    rows = {r["config"]: r for r in read_records(out)}
    config = json.loads((tiny_dir / "config.json").read_text())
    entry = 2 * config["num_key_value_heads"] * config["head_dim"] * 4 * config["num_hidden_layers"]  # K and V, fp32
    assert rows.keys() == {"hf_dense", "snapkv@0.5", "snapkv_ctx@0.5"}
    for r in rows.values():
        assert r["batch"] == 3 and r["decode_s"] == pytest.approx(decoding[0] / 3, abs=0.02)
    dense, snap = rows["hf_dense"], rows["snapkv@0.5"]
    # the control decodes as the sweep's dense does: the whole prompt but its last token prefilled, nothing dropped
    assert (dense["path"], dense["source"], dense["threshold"], dense["threshold_kind"]) == (
        "transformers", "question", None, None)
    assert dense["kv_bytes"] == entry * (dense["n_prompt"] - 1)
    assert (snap["path"], snap["source"], snap["threshold"], snap["threshold_kind"]) == (
        "kvpress", "question", 0.5, "compression")
    assert rows["snapkv_ctx@0.5"]["source"] == "context"
    n, kept = snap["n_prompt"], compute_n_kept(snap["n_prompt"] - 1, 0.5)
    assert snap["steps"] > 1  # a mean over several steps, each reading one entry more
    assert snap["kv_read"] == pytest.approx(np.mean([(kept + 1 + i) / (n + i) for i in range(snap["steps"])]))
    assert snap["kv_bytes"] == entry * kept


def test_a_pair_folder_that_cannot_pair_is_one_clear_error(tmp_path):
    """--pair: a missing folder, records without prompt lengths, no records, a sample the sweep never ran and a
    prompt of the same length but other ids are each refused by name, not a KeyError (main catches ValueError)."""
    with pytest.raises(ValueError, match="no such run folder"):
        peers.paired_prompts(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no records there"):
        peers.paired_prompts(tmp_path / "empty")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "samples.jsonl").write_text(json.dumps({"task": "fwe", "index": 0, "config": "dense"}) + "\n")
    with pytest.raises(ValueError, match="no n_prompt"):
        peers.paired_prompts(tmp_path / "bare")
    ids = [5, 6, 7]
    sample = types.SimpleNamespace(task="fwe", index=1)
    with pytest.raises(ValueError, match="fwe#1: not in SWEEP's records"):
        peers.check_pairing([(sample, ids)], {("fwe", 0): (3, None)}, "SWEEP")
    with pytest.raises(ValueError, match=r"fwe#1: 3 prompt tokens here, 3 in SWEEP \(and other ids\)"):
        peers.check_pairing([(sample, ids)], {("fwe", 1): (3, ids_hash([5, 6, 8]))}, "SWEEP")
    peers.check_pairing([(sample, ids)], {("fwe", 1): (3, ids_hash(ids))}, "SWEEP")  # the same ids pair


def test_no_press_and_no_control_is_nothing_to_run(tiny_dir, tmp_path):
    """--presses '' with --dense-samples 0 leaves nothing to run: said before the folder is made."""
    with pytest.raises(ValueError, match="nothing to run"):
        run(tiny_dir, tmp_path / "peers", presses="", dense_samples=0)
    assert not (tmp_path / "peers").exists()


def test_a_second_run_in_a_folder_adds_its_tasks_and_other_settings_are_refused(tiny_dir, tmp_path, monkeypatch):
    """Another task's samples join a folder's run, its settings listing both tasks, its model named as the same folder
    by another path (relative, with a trailing slash: lab.records.differs); another seed is refused, and so is a copy
    of the model's folder elsewhere (another model, to a run.json that keeps no weights probe)."""
    one = dict(samples=1, context_ratios="", dense_samples=0)  # one press, one sample: one decoding a run
    out = run(tiny_dir, tmp_path / "peers", **one)
    monkeypatch.chdir(tiny_dir.parent)
    run(tiny_dir, out, tasks="niah_multikey_2", model=f"./{tiny_dir.name}/", **one)
    assert json.loads((out / "run.json").read_text())["settings"]["model"] == str(tiny_dir)  # the first spelling
    copy = shutil.copytree(tiny_dir, tmp_path / "copy" / tiny_dir.name)
    with pytest.raises(ValueError, match="other settings {'model'"):
        run(tiny_dir, out, model=str(copy), **one)
    assert json.loads((out / "run.json").read_text())["settings"]["tasks"] == ["niah_single_1", "niah_multikey_2"]
    assert sorted((r["task"], r["config"]) for r in read_records(out)) == [("niah_multikey_2", "snapkv@0.5"),
                                                                          ("niah_single_1", "snapkv@0.5")]
    with pytest.raises(ValueError, match="other settings"):
        run(tiny_dir, out, seed=7, **one)


def test_the_question_aware_protocol_alone_never_splits_a_prompt(tiny_dir, tmp_path, monkeypatch):
    """Without context ratios no prompt is split, so a task whose prompt could not be runs all the same."""
    def refuse(*a):
        raise ValueError("split")
    monkeypatch.setattr(peers, "question_start", refuse)
    out = run(tiny_dir, tmp_path / "peers", samples=1, context_ratios="", dense_samples=0)
    assert [r["config"] for r in read_records(out)] == ["snapkv@0.5"]


def test_a_ratio_grid_that_is_not_numbers_is_refused_by_its_flag(tiny_dir, tmp_path):
    """A grid that is not numbers is refused naming its flag, which parse_grid's own error would not."""
    for flag in ("ratios", "context_ratios"):
        with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} takes comma-separated numbers, got 'x'"):
            run(tiny_dir, tmp_path / "peers", **{flag: "x"})


def test_a_task_named_twice_is_refused_before_anything_is_written(tiny_dir, tmp_path):
    """--tasks fwe,fwe would decode each sample twice and list the task twice in run.json's settings (every mean
    over tasks counting it twice): refused in one line, as lab.sweep and lab.report refuse it."""
    with pytest.raises(ValueError, match="--tasks names niah_single_1 twice"):
        run(tiny_dir, tmp_path / "peers", tasks="niah_single_1,niah_multikey_2,niah_single_1")
    assert not (tmp_path / "peers").exists()


def test_the_thread_count_is_set_before_anything_is_checked(tiny_dir, tmp_path, monkeypatch):
    """--threads is set first, before the checks and the decoding it is meant for."""
    threads = []
    monkeypatch.setattr(peers.torch, "set_num_threads", threads.append)  # not this process's own thread count
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        run(tiny_dir, tmp_path / "peers", tasks="nope", threads=3)
    assert threads == [3]


def test_an_out_that_cannot_be_made_is_one_line_and_exit_2(tiny_dir, tmp_path, capsys):
    """--out under a file: mkdir's OSError is said in one line by main, not a traceback."""
    (tmp_path / "a_file").write_text("x")
    assert peers.main(["--out", str(tmp_path / "a_file" / "sub"), "--tasks", "niah_single_1", "--model",
                       str(tiny_dir), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "a_file" in err


@pytest.mark.parametrize("text", ["[]", "{\"runs\": []", "{\"runs\": []}"])
def test_a_damaged_run_json_is_one_line_naming_it(tiny_dir, tmp_path, capsys, text):
    """A run.json that is not JSON, not an object or holds no settings is refused in one line that names the file,
    before anything is decoded, and nothing in the folder is rewritten."""
    out = tmp_path / "peers"
    out.mkdir()
    (out / "run.json").write_text(text)
    assert peers.main(["--out", str(out), "--tasks", "niah_single_1", "--samples", "1", "--model", str(tiny_dir),
                       "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and str(out / "run.json") in err
    assert (out / "run.json").read_text() == text and not (out / "samples.jsonl").exists()
