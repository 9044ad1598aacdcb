"""eval.py and report.py on a tiny random model: rollback equivalence, resume, random-head sparsity, the stop
rule and the summary arithmetic. Seconds in all; no real model, no long prompts."""

import re

import pytest
import torch

import eval as ev
import report

N_SINK, N_LOCAL = 16, 128


class TinyTokenizer:
    """Words and punctuation marks are tokens with ids < 101 (the tiny model's vocabulary); id 0 is EOS."""
    has_chat_template = True
    eos_ids = (0,)

    def encode(self, text, add_special_tokens=False):
        return [1 + sum(map(ord, t)) % 100 for t in re.findall(r"\w+|[^\w\s]", text)]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" w{i}" + ("." if i % 7 == 0 else "") for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages) + "<|assistant|>\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from model import load_model
    from tests.test_model import save_tiny
    path = tmp_path_factory.mktemp("tiny")
    save_tiny("llama-gqa", path)
    return load_model(str(path))


@pytest.fixture
def resources(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))  # moments cached in the test's folder only
    tok = TinyTokenizer()
    L, H = tiny.cfg.num_hidden_layers, tiny.cfg.num_attention_heads
    res = ev.load_resources(tiny, tok, [], [ev.Config("qada_rw", 0.6), ev.Config("qada_word", 0.6)], None, 512, N_SINK, {})
    freq = torch.linspace(0, 1, L * H).view(L, H)
    res["static_freq"] = {"ruler": freq, "niah_single_1": freq.flip(0)}
    return tok, res


def prefill(tiny, tok, length=400):
    sample = ev.make("niah_single_1", 0, length, tok, seed=3)
    sample.max_new_tokens = 12  # short answers keep the test fast
    ids = tok.encode(sample.prompt)
    assert N_LOCAL < len(ids) <= length
    cache = tiny.new_cache(len(ids) + sample.max_new_tokens)
    return sample, ids, cache, tiny.prefill(torch.tensor([ids]), cache)


CONFIGS = [ev.Config("dense"), ev.Config("local"), ev.Config("random", 0.5), ev.Config("static", 0.5),
           ev.Config("static_oracle", 0.8), ev.Config("oracle", 0.6), ev.Config("qada_rw", 0.6),
           ev.Config("qada_prompt", 0.9), ev.Config("qada_word", 0.6), ev.Config("qada_long", 0.6)]


@pytest.mark.parametrize("stop", ["eos", "sentence"])
def test_a_batch_row_decodes_as_the_configuration_alone(tiny, resources, stop):
    """Every configuration of a sample decoded side by side (one batch row each) gives the record it gets when
    decoded alone from a fresh prefill: the same tokens and the same head statistics. Under "eos" every row runs
    all 12 steps; under "sentence" the rows end at different steps. (On this tiny random model a row that read
    another row's query or cache would still pick the same tokens, so the routing itself is held by
    test_row_attention_gives_each_row_its_own_attention.)"""
    tok, res = resources
    sample, ids, cache, logits = prefill(tiny, tok)
    args = (tiny, tok, sample)
    batched = dict(zip(CONFIGS, ev.run_configs(CONFIGS, *args, cache, logits, len(ids), res, {"qada_rw"}, 0,
                                               N_SINK, N_LOCAL, stop)))
    assert cache.length == len(ids)  # the prefilled cache is left as it was
    for c in CONFIGS:
        _, _, fresh_cache, fresh_logits = prefill(tiny, tok)
        alone, = ev.run_configs([c], *args, fresh_cache, fresh_logits, len(ids), res, {"qada_rw"}, 0, N_SINK, N_LOCAL, stop)
        assert alone["pred"] == batched[c]["pred"] and alone["n_new"] == batched[c]["n_new"]
        assert alone.get("local_freq") == batched[c].get("local_freq")
        assert alone.get("agreement") == batched[c].get("agreement")
        assert batched[c]["batch"] == len(CONFIGS) and alone["batch"] == 1
    # the methods really differ, so the comparison above is not trivial
    assert batched[ev.Config("local")]["sparsity"] == 1.0 and batched[ev.Config("dense")]["sparsity"] == 0.0
    assert len({batched[c]["pred"] for c in CONFIGS}) > 1
    if stop == "sentence":
        assert len({batched[c]["n_new"] for c in CONFIGS}) > 1  # rows end at different steps


def test_row_attention_gives_each_row_its_own_attention():
    """Row b of RowAttention is attns[b] applied to row b's query and cache alone; ended rows output zeros."""
    from attention import SparseAttention
    B, H, Hkv, T, D = 3, 4, 2, 300, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    atts = [None, SparseAttention("local"), SparseAttention("dense")]
    rows = ev.RowAttention(atts)
    y = rows(q, k, v, 0)
    for b, att in enumerate(atts):
        qb, kb, vb = q[b:b + 1], k[b:b + 1], v[b:b + 1]
        alone = att(qb, kb, vb, 0) if att is not None else torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, enable_gqa=True)
        torch.testing.assert_close(y[b:b + 1], alone)
    assert not torch.allclose(y[0], y[1])  # the rows really differ
    rows.done[1] = True
    assert rows(q, k, v, 0)[1].abs().sum() == 0


def test_records_carry_the_statistics(tiny, resources):
    tok, res = resources
    sample, ids, cache, logits = prefill(tiny, tok)
    r, = ev.run_configs([ev.Config("qada_rw", 0.6)], tiny, tok, sample, cache, logits, len(ids), res, {"qada_rw"}, 0,
                        N_SINK, N_LOCAL, "eos")
    L, H = tiny.cfg.num_hidden_layers, tiny.cfg.num_attention_heads
    assert r["steps"] == r["n_new"] - 1 == len(r["step_sparsity"]) == len(r["oracle_step_sparsity"])
    assert len(r["local_freq"]) == L and len(r["local_freq"][0]) == H
    a = r["agreement"]
    assert sum(a.values()) == r["steps"] * L * H
    assert abs((a["TP"] + a["FP"]) / (r["steps"] * L * H) - r["sparsity"]) < 1e-9
    assert all(x >= 0 for row in r["log_err"] for x in row)


@pytest.mark.parametrize("sparsity", [0.0, 0.25, 0.5, 1.0])
def test_random_heads_match_the_requested_sparsity(sparsity):
    a = ev.random_labels(30, 9, sparsity, seed=1)
    assert a.shape == (30, 9) and int(a.sum()) == round(sparsity * 270)
    assert torch.equal(a, ev.random_labels(30, 9, sparsity, seed=1))
    if 0 < sparsity < 1:
        assert not torch.equal(a, ev.random_labels(30, 9, sparsity, seed=2))


def test_static_oracle_uses_earlier_samples_only(resources):
    tok, res = resources
    res = dict(res, oracle_freq={("niah_single_1", 0): (torch.ones(2, 4), 3), ("niah_single_1", 2): (torch.zeros(2, 4), 5),
                                 ("fwe", 0): (torch.zeros(2, 4), 9)})
    class S:  # noqa: E701
        task, index = "niah_single_1", 0
    assert torch.equal(ev.own_task_freq(res, S), res["static_freq"]["niah_single_1"])  # sample 0: calibration
    S.index = 1
    assert torch.equal(ev.own_task_freq(res, S), torch.ones(2, 4))  # only sample 0 of the same task
    S.index = 3
    assert torch.allclose(ev.own_task_freq(res, S), torch.full((2, 4), 3 / 8))  # step-weighted


def test_sweep_resumes_where_it_stopped(tiny, resources, tmp_path):
    tok, res = resources
    out = tmp_path / "run"
    out.mkdir()
    cfgs = [ev.Config("dense"), ev.Config("local"), ev.Config("oracle", 0.6), ev.Config("static_oracle", 0.5)]
    jobs = ev.plan(["niah_single_1"], 2, cfgs, [ev.Config("qada_rw", 0.9)], 1, [], 0)
    assert [(t, i, len(c)) for t, i, c in jobs] == [("niah_single_1", 0, 5), ("niah_single_1", 1, 4)]
    make = ev.make
    def short(*a):
        s = make(*a)
        s.max_new_tokens = 12
        return s
    ev.make = short
    first = ev.sweep(tiny, tok, out, jobs[:1], dict(res), 400, 3, {"qada_rw"}, N_SINK, N_LOCAL, progress=False)
    with open(out / "samples.jsonl", "a") as f:
        f.write('{"task": "niah_single_1", "ind')  # a torn line from a killed run
    second = ev.sweep(tiny, tok, out, jobs, dict(res), 400, 3, {"qada_rw"}, N_SINK, N_LOCAL, progress=False)
    assert (first, second) == (5, 4)
    assert ev.sweep(tiny, tok, out, jobs, dict(res), 400, 3, {"qada_rw"}, N_SINK, N_LOCAL, progress=False) == 0
    rows = report.load(out)
    assert len(rows) == 9 and len({(r["task"], r["index"], r["config"]) for r in rows}) == 9
    report.report(out, ["niah_single_1"])  # tables and plots from a partial run do not fail
    assert (out / "summary.md").is_file() and (out / "fig4_score_vs_sparsity.png").is_file()


@pytest.mark.parametrize("text, done", [(" 1234567.", False), (" 1234567. This", True), (" France.\n", True),
                                        ("", False), (":\n", False), (':\n\n1. "abc"\n2. "', False), (" a, b, c. ", True),
                                        (" 3.5 is", False), (" 12. ", False)])
def test_sentence_stop_rule(text, done):
    assert ev.answer_finished("niah_single_1", text) == done
    assert ev.answer_finished("cwe", text) is False  # list answers only stop at EOS or in a loop


def test_a_looping_answer_stops():
    loop = ":\n\n- 3149930\n- 3529890\n- 3529890\n"
    assert ev.answer_finished("niah_multivalue", loop) and ev.answer_finished("cwe", loop)
    assert not ev.answer_finished("cwe", loop[:-1])  # the repeated line is not finished yet
    assert not ev.answer_finished(ev.CTXFREE, loop)
    assert ev.answer_finished("fwe", '\n\n1. "pztfps"\n2. "pztfps"\n')  # numbered items repeat too
    assert not ev.answer_finished("fwe", '\n\n1. "pztfps"\n2. "eexcre"\n')


def row(task, index, config, score, sparsity):
    method, _, thr = config.partition("@")
    return {"task": task, "index": index, "config": config, "method": method, "threshold": float(thr) if thr else None,
            "score": score, "sparsity": sparsity, "kv_read": 1 - sparsity, "n_new": 3, "decode_s": 0.1, "pred": ""}


def test_summary_averages_over_common_samples():
    rows = [row("a", 0, "dense", 1.0, 0.0), row("a", 1, "dense", 0.5, 0.0), row("b", 0, "dense", 0.5, 0.0),
            row("a", 0, "qada_rw@0.6", 0.5, 0.8), row("b", 0, "qada_rw@0.6", 0.5, 0.6)]  # a#1 has no qada run yet
    s = {(r["task"], r["config"]): r for r in report.summary_rows(rows)}
    assert s["a", "dense"]["score"] == 0.75 and s["a", "dense"]["n"] == 2
    cur = report.curves(rows, ["a", "b"], ["dense", "qada_rw@0.6"])
    assert cur["dense"]["score"] == pytest.approx(0.75)  # a#0 and b#0 only: (1.0 + 0.5) / 2
    assert cur["qada_rw@0.6"]["norm"] == pytest.approx((0.5 / 1.0 + 0.5 / 0.5) / 2)
    assert cur["qada_rw@0.6"]["worst_drop"] == pytest.approx(0.5)
    assert cur["qada_rw@0.6"]["sparsity"] == pytest.approx(0.7)


def test_calibration_files_load_as_static_labels(tiny, tmp_path, monkeypatch):
    import calibrate
    from criterion import load_labels
    tok = TinyTokenizer()
    kwargs = dict(length=400, samples=1, seed=5, max_new_tokens=6, progress=False)
    freqs = calibrate.ensure(tiny, tok, ["niah_single_1"], tmp_path, **kwargs)
    L, H = tiny.cfg.num_hidden_layers, tiny.cfg.num_attention_heads
    assert freqs["niah_single_1"].shape == (L, H) and torch.equal(freqs["ruler"], freqs["niah_single_1"])
    labels, settings = load_labels(tmp_path / "niah_single_1.json", 0.5)
    assert int(labels.sum()) == round(0.5 * L * H) and settings["seed"] == 5 and 1 <= settings["steps"] <= 5
    monkeypatch.setattr(calibrate, "oracle_frequency", lambda *a, **k: pytest.fail("recalibrated"))
    again = calibrate.ensure(tiny, tok, ["niah_single_1"], tmp_path, **kwargs)  # same settings: read back
    assert torch.allclose(again["niah_single_1"], freqs["niah_single_1"])
