"""lab.sweep and lab.report on a tiny random model: batch rows against runs alone, records against a float64 brute
force over every score, configurations, resume, random-head sparsity, the stop rule and the summary arithmetic.
Seconds in all; no real model, no long prompts."""

import argparse
import csv
import hashlib
import json
import math
import re
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from criterion import Calibration, load_labels, save_calibration
from lab import calibrate, cli, records, report, sweep
from tests.test_generate import kv_read_by_hand, make_tiny_dir

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
    res = sweep.load_resources(tiny, tok, [], [sweep.Config("qada_rw", 0.6), sweep.Config("qada_word", 0.6)], None, {},
                            progress=False)
    freq = torch.linspace(0, 1, L * H).view(L, H)
    res["static_freq"] = {"ruler": freq, "niah_single_1": freq.flip(0)}
    return tok, res


def prefill(tiny, tok, length=400):
    sample = sweep.make("niah_single_1", 0, length, tok, seed=3)
    sample.max_new_tokens = 12  # short answers keep the test fast
    ids = tok.encode(sample.prompt)
    assert N_LOCAL < len(ids) <= length
    cache = tiny.new_cache(len(ids) + sample.max_new_tokens)
    return sample, ids, cache, tiny.prefill(torch.tensor([ids]), cache)


CONFIGS = [sweep.Config("dense"), sweep.Config("local"), sweep.Config("random", 0.5), sweep.Config("static", 0.5),
           sweep.Config("static_oracle", 0.8), sweep.Config("oracle", 0.6), sweep.Config("qada_rw", 0.6),
           sweep.Config("qada_prompt", 0.9), sweep.Config("qada_word", 0.6), sweep.Config("qada_long", 0.6),
           sweep.Config("static_oracle_kv", 0.5), sweep.Config("oracle_kv", 0.6), sweep.Config("qada_kv", 0.6),
           sweep.Config("qada_kv_all", 0.2)]


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
    t0 = time.perf_counter()
    batched = dict(zip(CONFIGS, sweep.run_configs(CONFIGS, *args, cache, logits, len(ids), res, {"qada_rw"}, 0,
                                               N_SINK, N_LOCAL, stop)))
    wall = time.perf_counter() - t0
    assert cache.length == len(ids)  # the prefilled cache is left as it was
    # each row's decode_s is its share of the batch's time, so that the rows' seconds add up to no more than the call's
    shares = {r["decode_s"] for r in batched.values()}
    assert len(shares) == 1 and len(CONFIGS) * shares.pop() <= wall + 0.005 * len(CONFIGS), wall
    for c in CONFIGS:
        _, _, fresh_cache, fresh_logits = prefill(tiny, tok)
        alone, = sweep.run_configs([c], *args, fresh_cache, fresh_logits, len(ids), res, {"qada_rw"}, 0, N_SINK,
                                   N_LOCAL, stop)
        assert batched[c]["batch"] == len(CONFIGS) and alone["batch"] == 1
        same = {k for k in alone if k not in ("batch", "decode_s")}  # the timing fields aside, the whole record
        assert {k: alone[k] for k in same} == {k: batched[c][k] for k in same}, c
    # the methods really differ, so the comparison above is not trivial
    assert batched[sweep.Config("local")]["sparsity"] == 1.0 and batched[sweep.Config("dense")]["sparsity"] == 0.0
    assert len({batched[c]["pred"] for c in CONFIGS}) > 1
    if stop == "sentence":
        assert len({batched[c]["n_new"] for c in CONFIGS}) > 1  # rows end at different steps


class Recorder:
    """A configuration's attention that keeps the (layer, q (H, D), k (Hkv, T, D)) of every call."""

    def __init__(self, att):
        self.att, self.calls = att, []

    @property
    def stats(self):
        return self.att.stats

    def __call__(self, q, k, v, layer):
        self.calls.append((layer, q[0, :, 0].clone(), k[0].clone()))
        return self.att(q, k, v, layer)


def brute_force(q, k, tau, mean=None, cov=None):
    """Eq. 2 (and Eq. 7 given the bulk keys' mean (Hkv, D) and cov (Hkv, D, D)) from every score, in float64.
    Returns oracle labels, qada labels (or None), log A_local, log A_bulk, the Gaussian log bulk (or None), and
    the smallest distance of any head's log ratio to the threshold."""
    H, D = q.shape
    Hkv, T, _ = k.shape
    G = H // Hkv
    s = torch.einsum("hd,htd->ht", q.double(), k.double().repeat_interleave(G, 0)) / math.sqrt(D)  # (H, T)
    pos = torch.arange(T)
    window = (pos < N_SINK) | (pos >= T - (N_LOCAL - N_SINK))
    share = s.softmax(-1)[:, window].sum(-1)  # A_local / (A_local + A_bulk)
    oracle = share >= tau
    log_local, log_bulk = s[:, window].logsumexp(-1), s[:, ~window].logsumexp(-1)
    logit = math.log(tau / (1 - tau))
    margin = float((log_local - log_bulk - logit).abs().min())
    if mean is None:
        return oracle, None, log_local, log_bulk, None, margin
    mu, sigma = mean.double().repeat_interleave(G, 0), cov.double().repeat_interleave(G, 0)  # (H, D), (H, D, D)
    qd = q.double()
    log_gauss = (math.log(T - N_LOCAL) + (qd * mu).sum(-1) / math.sqrt(D)  # Eq. 6: log T_bulk + mu_s + sigma_s^2 / 2
                 + torch.einsum("hd,hde,he->h", qd, sigma, qd) / (2 * D))
    qada = log_local - log_gauss >= logit
    return oracle, qada, log_local, log_bulk, log_gauss, min(margin, float((log_local - log_gauss - logit).abs().min()))


def truth_of(recorder, L):
    """Per decode step, the sequence lengths and per layer brute_force() of the recorded query and keys."""
    att = recorder.att
    moments = [att.moments.mean_cov(layer, None) for layer in range(L)] if att.moments is not None else None
    steps = [recorder.calls[i:i + L] for i in range(0, len(recorder.calls), L)]
    lengths = [s[0][2].shape[1] for s in steps]
    return lengths, [[brute_force(q, k, att.tau, *(moments[layer] if moments else ())) for layer, q, k in s]
                     for s in steps]


def stacked(truth, i):
    """Entry i of every brute_force() result as an (S, L, H) tensor."""
    return torch.stack([torch.stack([t[i] for t in step]) for step in truth])


def close(recorded, expected: torch.Tensor, atol: float):
    """A record's (rounded) list of numbers against the float64 tensor computed here."""
    got = torch.tensor(recorded, dtype=torch.float64, device="cpu")
    torch.testing.assert_close(got, expected.double().cpu(), rtol=0, atol=atol)


def test_records_carry_the_statistics(tiny, resources, monkeypatch):
    """A record's statistics against an independent computation from the queries and keys each step saw: the
    oracle and QAdA labels in float64 from every score, agreement counts, sparsity, KV read by hand, the
    Gaussian log-mass errors (Table 2)."""
    tok, res = resources
    sample, ids, cache, logits = prefill(tiny, tok)
    built, make = [], sweep.config_attention
    monkeypatch.setattr(sweep, "config_attention", lambda *a, **k: built.append(Recorder(make(*a, **k))) or built[-1])
    cfgs = [sweep.Config("qada_rw", 0.5), sweep.Config("oracle", 0.5)]  # the tiny model attends nearly
    # uniformly, so a 253-token prompt puts about half its mass on the window: tau 0.5 gives both labels
    qada, oracle_run = sweep.run_configs(cfgs, tiny, tok, sample, cache, logits, len(ids), res, {"qada_rw"}, 0,
                                      N_SINK, N_LOCAL, "eos")
    L, Hkv = tiny.cfg.num_hidden_layers, tiny.cfg.num_key_value_heads
    assert (qada["path"], qada["source"], qada["threshold_kind"]) == ("qada", "random-words", "tau")
    assert (oracle_run["path"], oracle_run["source"], oracle_run["threshold_kind"]) == ("oracle", None, "tau")
    assert oracle_run["kv_read_implied"] is True and "kv_read_implied" not in qada
    assert "agreement" not in oracle_run  # only qada_rw is tracked

    for rec, recorder in zip((qada, oracle_run), built):
        lengths, truth = truth_of(recorder, L)
        assert len(lengths) == rec["steps"] == rec["n_new"] - 1 >= 10
        assert lengths == [len(ids) + 1 + i for i in range(len(lengths))]
        assert min(t[5] for step in truth for t in step) > 1e-4  # no head sits on the threshold: fp32 = fp64
        labels = stacked(truth, 0 if rec is oracle_run else 1)  # (S, L, H) bool
        assert torch.equal(recorder.stats.label_tensor(), labels.cpu())  # the statistics are kept on the CPU
        assert rec["sparsity"] == pytest.approx(labels.double().mean().item(), abs=1e-12)
        assert rec["kv_read"] == pytest.approx(kv_read_by_hand(labels.tolist(), lengths, Hkv, N_LOCAL), abs=1e-12)
        close(rec["local_freq"], labels.double().mean(0), 1e-4)
        close(rec["step_sparsity"], labels.double().mean((1, 2)), 1e-4)

    # tracked (qada_rw): the oracle's labels beside QAdA's, and the Gaussian estimate beside the true bulk mass
    _, truth = truth_of(built[0], L)
    oracle, labels = stacked(truth, 0), stacked(truth, 1)
    log_local, log_bulk, log_gauss = stacked(truth, 2), stacked(truth, 3), stacked(truth, 4)
    a = qada["agreement"]
    assert a == {"TP": int((labels & oracle).sum()), "FP": int((labels & ~oracle).sum()),
                 "TN": int((~labels & ~oracle).sum()), "FN": int((~labels & oracle).sum())}
    assert min(a.values()) > 0  # every kind of (dis)agreement occurs, so a swapped count shows
    close(qada["oracle_step_sparsity"], oracle.double().mean((1, 2)), 1e-4)
    close(qada["oracle_freq"], oracle.double().mean(0), 1e-4)
    close(qada["both_freq"], (labels & oracle).double().mean(0), 1e-4)
    close(qada["log_err"], (log_bulk - log_gauss).abs().mean(0), 2e-4)
    close(qada["log_bias"], (log_gauss - log_bulk).mean(0), 2e-4)
    close(qada["dist_local"], (log_bulk - log_local).abs().mean(0), 2e-4)
    # the same Gaussian estimate from the exact moments of each step's bulk keys (torch.cov in float64)
    exact = []
    for step in [built[0].calls[i:i + L] for i in range(0, len(built[0].calls), L)]:
        per_layer = []
        for layer, q, k in step:
            T = k.shape[1]
            bulk = k[:, N_SINK:T - (N_LOCAL - N_SINK)].double()  # (Hkv, N, D)
            mean = bulk.mean(1)
            cov = torch.stack([torch.cov(b.T, correction=0) for b in bulk])
            per_layer.append(brute_force(q, k, 0.5, mean, cov)[4])
        exact.append(torch.stack(per_layer))
    exact = torch.stack(exact)  # (S, L, H)
    close(qada["log_err_exact"], (exact - log_bulk).abs().mean(0), 2e-4)
    close(qada["log_bias_exact"], (exact - log_bulk).mean(0), 2e-4)
    assert (exact - log_gauss).abs().max() > 1e-2  # the reference prompt's moments are not the prompt's own


def test_a_configuration_is_a_path_and_a_source():
    """Named methods map to (path, source); a bare path name runs with the default source; the threshold's kind
    (and so the grid a configuration gets) follows from what the path reads."""
    assert (sweep.path_and_source("qada_prompt") == ("qada", "prompt")
            and sweep.path_and_source("static_oracle") == ("static", "own-task"))
    assert (sweep.path_and_source("qada") == ("qada", "random-words")
            and sweep.path_and_source("static") == ("static", "calibrated"))
    assert sweep.path_and_source("dense") == ("dense", None) and sweep.path_and_source("oracle") == ("oracle", None)
    assert (sweep.path_and_source("static_kv") == ("static", "calibrated-kv")
            and sweep.path_and_source("qada_kv") == ("qada_kv", "random-words"))
    assert ([sweep.threshold_kind(m) for m in ("static_oracle_kv", "oracle_kv", "qada_kv_all")]
            == ["sparsity", "tau", "tau"])
    kinds = {m: sweep.threshold_kind(m) for m in ("dense", "local", "oracle", "qada", "random", "qada_prompt_online")}
    assert kinds == {"dense": None, "local": None, "oracle": "tau", "qada": "tau", "random": "sparsity",
                     "qada_prompt_online": "tau"}
    grids = sweep.parse_grids(["oracle=0.6,0.9", "random=0.25"])
    assert grids == {"oracle": [0.6, 0.9], "random": [0.25]}
    keys = [c.key for c in sweep.build_configs(["dense", "qada_rw", "oracle", "random", "static"], [0.4, 0.8], [0.5],
                                            grids)]
    assert keys == ["dense", "qada_rw@0.4", "qada_rw@0.8", "oracle@0.6", "oracle@0.9", "random@0.25", "static@0.5"]
    for bad in (["nope=0.5"], ["oracle"], ["oracle="]):
        with pytest.raises(ValueError):
            sweep.parse_grids(bad)
    with pytest.raises(ValueError, match="unknown method"):
        sweep.build_configs(["qada_nope"], [0.6], [0.5])


def test_a_page_budget_of_0_is_the_window_alone_and_taken_by_budgets_and_grid():
    """--budgets' help calls 0 the window alone, the curve's end (generate.py takes --set budget=0 too): --budgets 0,64
    and --grid quest=0,64 are accepted; a negative budget or a fraction is not."""
    assert cli.budgets("0,64") == "0,64" and sweep.parse_grids(["quest=0,64"]) == {"quest": [0.0, 64.0]}
    for bad in ("-1,64", "0.5", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.budgets(bad)
    with pytest.raises(ValueError, match="--grid quest=-1"):
        sweep.parse_grids(["quest=-1"])


@pytest.mark.parametrize("sparsity", [0.0, 0.25, 0.5, 1.0])
def test_random_heads_match_the_requested_sparsity(sparsity):
    a = sweep.random_labels(30, 9, sparsity, seed=1)
    assert a.shape == (30, 9) and int(a.sum()) == round(sparsity * 270)
    assert torch.equal(a, sweep.random_labels(30, 9, sparsity, seed=1))
    if 0 < sparsity < 1:
        assert not torch.equal(a, sweep.random_labels(30, 9, sparsity, seed=2))


def test_random_heads_are_drawn_anew_for_each_sample(tiny, resources):
    """The random-heads baseline draws its heads per (task, sample, sparsity): one draw for every sample would make
    the baseline one fixed head set, which a lucky or unlucky draw would bias over the whole run; one draw for every
    sparsity would nest the sparsities' head sets."""
    tok, res = resources
    cfg = sweep.Config("random", 0.5)
    class S:  # noqa: E701
        task, index = "niah_single_1", 0
    first = sweep.config_labels(cfg, "random", tiny, S, res, seed=3)
    assert torch.equal(first, sweep.config_labels(cfg, "random", tiny, S, res, seed=3))  # reproducible
    more = sweep.config_labels(sweep.Config("random", 0.75), "random", tiny, S, res, seed=3)
    assert not bool((first <= more).all())  # another sparsity draws anew, not 0.5's heads and some more
    S.index = 1
    assert not torch.equal(first, sweep.config_labels(cfg, "random", tiny, S, res, seed=3))


def test_plan_runs_the_context_free_samples_past_the_tasks_own():
    """More context-free samples than task samples: the tasks stop at their own count."""
    dense, oracle = [sweep.Config("dense")], [sweep.Config("oracle", 0.6)]
    jobs = sweep.plan(["fwe"], 1, dense, [], 0, oracle, 3)
    assert [(t, i) for t, i, _ in jobs] == [("fwe", 0), (sweep.CTXFREE, 0), (sweep.CTXFREE, 1), (sweep.CTXFREE, 2)]


def test_static_oracle_uses_earlier_samples_only(resources):
    tok, res = resources
    res = dict(res, oracle_freq={("niah_single_1", 0): (torch.ones(2, 4), 3),
                                 ("niah_single_1", 2): (torch.zeros(2, 4), 5),
                                 ("fwe", 0): (torch.zeros(2, 4), 9)})
    class S:  # noqa: E701
        task, index = "niah_single_1", 0
    assert torch.equal(sweep.own_task_freq(res, S), res["static_freq"]["niah_single_1"])  # sample 0: calibration
    S.index = 1
    assert torch.equal(sweep.own_task_freq(res, S), torch.ones(2, 4))  # only sample 0 of the same task
    S.index = 3
    assert torch.allclose(sweep.own_task_freq(res, S), torch.full((2, 4), 3 / 8))  # step-weighted


def test_kv_label_sources_take_whole_kv_groups(tiny, resources):
    """static_kv and static_oracle_kv label whole KV groups, ranked by their query heads' mean frequency, at the
    requested sparsity; the per-head methods at the same sparsity pick other heads."""
    tok, res = resources
    L, H, Hkv = tiny.cfg.num_hidden_layers, tiny.cfg.num_attention_heads, tiny.cfg.num_key_value_heads
    G = H // Hkv
    gen = torch.Generator().manual_seed(0)  # frequencies in no order, so heads and groups rank differently
    ruler = torch.rand(L, H, generator=gen)  # the task's ranking reversed: the two sources pick other groups
    res = dict(res, static_freq={"ruler": ruler, "niah_single_1": 1 - ruler})
    class S:  # noqa: E701
        task, index = "niah_single_1", 0
    for name, freq in (("static_kv", res["static_freq"]["ruler"]),
                       ("static_oracle_kv", res["static_freq"]["niah_single_1"])):
        got = sweep.config_labels(sweep.Config(name, 0.5), sweep.path_and_source(name)[1], tiny, S, res, seed=0)
        group_mean = [[float(freq[layer, g * G:(g + 1) * G].mean()) for g in range(Hkv)] for layer in range(L)]
        ranked = sorted(((m, layer, g) for layer, row in enumerate(group_mean) for g, m in enumerate(row)),
                        reverse=True)
        want = torch.zeros(L, H, dtype=torch.bool)
        for _, layer, g in ranked[:L * Hkv // 2]:
            want[layer, g * G:(g + 1) * G] = True
        assert torch.equal(got, want), name
        per_head = sweep.config_labels(sweep.Config(name.removesuffix("_kv"), 0.5),
                                       sweep.path_and_source(name.removesuffix("_kv"))[1],
                                    tiny, S, res, seed=0)
        assert int(per_head.sum()) == int(got.sum()) and not torch.equal(per_head, got)


def test_sweep_resumes_where_it_stopped(tiny, resources, tmp_path, monkeypatch):
    tok, res = resources
    # the task's calibration frequencies rank layer 1 first; the tiny model's oracle labels no head local, whose ties
    # rank layer 0 first: sample 1's static oracle tells which of the two it learnt from
    res = dict(res, static_freq=dict(res["static_freq"], niah_single_1=res["static_freq"]["ruler"]))
    fresh = lambda: dict(res, oracle_freq={})  # noqa: E731  each call a new process's: nothing learnt in memory
    out = tmp_path / "run"
    out.mkdir()
    cfgs = [sweep.Config("dense"), sweep.Config("local"), sweep.Config("oracle", 0.6),
            sweep.Config("static_oracle", 0.5)]
    jobs = sweep.plan(["niah_single_1"], 2, cfgs, [sweep.Config("qada_rw", 0.9)], 1, [], 0)
    assert [(t, i, len(c)) for t, i, c in jobs] == [("niah_single_1", 0, 5), ("niah_single_1", 1, 4)]
    make = sweep.make

    def short(*a):
        s = make(*a)
        s.max_new_tokens = 12
        return s
    monkeypatch.setattr(sweep, "make", short)
    first = sweep.sweep(tiny, tok, out, jobs[:1], fresh(), 400, 3, {"qada_rw"}, N_SINK, N_LOCAL, progress=False)
    with open(out / "samples.jsonl", "a") as f:
        f.write('{"task": "niah_single_1", "ind')  # a torn line from a killed run
    second = sweep.sweep(tiny, tok, out, jobs, fresh(), 400, 3, {"qada_rw"}, N_SINK, N_LOCAL, progress=False)
    assert (first, second) == (5, 4)
    assert sweep.sweep(tiny, tok, out, jobs, fresh(), 400, 3, {"qada_rw"}, N_SINK, N_LOCAL, progress=False) == 0
    rows = records.read_records(out)
    assert len(rows) == 9 and len({(r["task"], r["index"], r["config"]) for r in rows}) == 9
    hashes = {(r["index"], r["ids_sha1"]) for r in rows}  # each sample's prompt, as lab.report --with pairs them
    assert len(hashes) == 2 and len({h for _, h in hashes}) == 2
    # the same records as a run in one go: resumed, sample 1's static oracle still learns from sample 0's oracle
    # records (read back from the file, not from the run that decoded them), not from the calibration prompts
    whole = tmp_path / "whole"
    whole.mkdir()
    sweep.sweep(tiny, tok, whole, jobs, fresh(), 400, 3, {"qada_rw"}, N_SINK, N_LOCAL, progress=False)
    timing = ("decode_s", "prefill_s")
    same = lambda rs: {(r["task"], r["index"], r["config"]):  # noqa: E731
                       {k: v for k, v in r.items() if k not in timing}
                       for r in rs}
    assert same(rows) == same(records.read_records(whole))
    report.report(out, ["niah_single_1"])  # tables and plots from a partial run do not fail
    assert (out / "summary.md").is_file() and (out / "fig4_score_vs_sparsity.png").is_file()


def test_ctxfree_runs_without_qada_among_the_methods(tmp_path, monkeypatch):
    """The context-free samples decode under oracle and qada_rw whatever --methods holds."""
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    tiny_dir = make_tiny_dir(tmp_path / "tiny")
    out = tmp_path / "run"
    assert sweep.main(["--out", str(out), "--tasks", "", "--length", "400", "--methods", "dense",
                    "--taus", "0.6", "--ablations", "", "--ctxfree-samples", "1", "--model", str(tiny_dir),
                    "--no-report"]) == 0
    assert {r["config"] for r in records.read_records(out)} == {"oracle@0.6", "qada_rw@0.6"}


def test_an_ablation_that_is_also_among_the_methods_decodes_once(tmp_path, monkeypatch):
    """qada_word@0.6 in --methods and in --ablations: the first sample decodes it once, not twice in one batch, and
    run.json's lines written are the records there are (5: dense and qada_word@0.6 on both samples, @0.9 on one)."""
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    tiny_dir = make_tiny_dir(tmp_path / "tiny")
    out = tmp_path / "run"
    assert sweep.main(["--out", str(out), "--tasks", "fwe", "--length", "400", "--samples", "2", "--methods",
                       "dense,qada_word", "--taus", "0.6", "--ablations", "qada_word", "--ablation-taus", "0.6,0.9",
                       "--ablation-samples", "1", "--ctxfree-samples", "0", "--track", "", "--model", str(tiny_dir),
                       "--no-report"]) == 0
    got = sorted((r["index"], r["config"]) for r in records.read_records(out))
    assert got == [(0, "dense"), (0, "qada_word@0.6"), (0, "qada_word@0.9"), (1, "dense"), (1, "qada_word@0.6")]
    assert json.loads((out / "run.json").read_text())["runs"][-1]["lines_written"] == 5


def test_a_resume_that_reads_no_correction_keeps_the_one_the_run_was_made_with(tmp_path, monkeypatch):
    """A run of qada_cal with --calibration A, continued by a run of dense and local alone (no --calibration): run.json
    still names A, so the first command resumes, and a second correction B under qada_cal's name is refused."""
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    tiny_dir = make_tiny_dir(tmp_path / "tiny")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path, offset in ((a, 0.0), (b, 1.0)):
        save_calibration(path, Calibration(torch.full((2, 4), offset), torch.ones(2, 4), None,
                                           {"kind": "affine", "moments_source": "random-words"}))
    out = tmp_path / "run"
    common = ["--out", str(out), "--tasks", "fwe", "--length", "400", "--ablations", "", "--ctxfree-samples", "0",
              "--track", "", "--model", str(tiny_dir), "--no-report"]
    cal = ["--methods", "dense,qada_cal", "--taus", "0.6"]
    assert sweep.main(common + cal + ["--samples", "1", "--calibration", str(a)]) == 0
    assert sweep.main(common + ["--samples", "1", "--methods", "dense,local"]) == 0
    assert json.loads((out / "run.json").read_text())["settings"]["calibration"] == str(a)
    assert sweep.main(common + cal + ["--samples", "2", "--calibration", str(a)]) == 0  # the first command resumes
    assert sweep.main(common + cal + ["--samples", "3", "--calibration", str(b)]) == 2  # not mixed with another


@pytest.mark.parametrize("text, done", [(" 1234567.", False), (" 1234567. This", True), (" France.\n", True),
                                        ("", False), (":\n", False), (':\n\n1. "abc"\n2. "', False),
                                        (" a, b, c. ", True),
                                        (" 3.5 is", False), (" 12. ", False), (" 123. ", True)])
def test_sentence_stop_rule(text, done):
    assert sweep.answer_finished("niah_single_1", text) == done
    assert sweep.answer_finished("cwe", text) is False  # list answers only stop at EOS or in a loop


def test_a_looping_answer_stops():
    loop = ":\n\n- 3149930\n- 3529890\n- 3529890\n"
    assert sweep.answer_finished("niah_multivalue", loop) and sweep.answer_finished("cwe", loop)
    assert not sweep.answer_finished("cwe", loop[:-1])  # the repeated line is not finished yet
    assert not sweep.answer_finished(sweep.CTXFREE, loop)
    assert sweep.answer_finished("fwe", '\n\n1. "pztfps"\n2. "pztfps"\n')  # numbered items repeat too
    assert not sweep.answer_finished("fwe", '\n\n1. "pztfps"\n2. "eexcre"\n')


def row(task, index, config, score, sparsity):
    method, _, thr = config.partition("@")
    return {"task": task, "index": index, "config": config, "method": method, "threshold": float(thr) if thr else None,
            "score": score, "sparsity": sparsity, "kv_read": 1 - sparsity, "n_new": 3, "decode_s": 0.1, "pred": ""}


def test_the_bootstrap_tables_show_progress_on_stderr(capsys):
    """The lossless and matched tables' bootstrap draws take minutes on a large run: each shows a bar over its
    methods on stderr, not minutes of silence."""
    rows = [row("a", i, c, 1.0, sp) for i in range(3) for c, sp in (("dense", 0.0), ("qada_rw@0.6", 0.5))]
    records.lossless_table(rows, ["a"], n_boot=10)
    records.matched_table(rows, ["a"], "sparsity", n_boot=10)
    err = capsys.readouterr().err
    assert "lossless sparsity" in err and "score / dense at matched sparsity" in err and "method" in err


def test_summary_averages_over_common_samples():
    rows = [row("a", 0, "dense", 1.0, 0.0), row("a", 1, "dense", 0.5, 0.0), row("b", 0, "dense", 0.5, 0.0),
            row("a", 0, "qada_rw@0.6", 0.5, 0.8), row("b", 0, "qada_rw@0.6", 0.5, 0.6)]  # a#1 has no qada run yet
    s = {(r["task"], r["config"]): r for r in records.summary_rows(rows)}
    assert s["a", "dense"]["score"] == 0.75 and s["a", "dense"]["n"] == 2
    cur = records.curves(rows, ["a", "b"], ["dense", "qada_rw@0.6"])
    assert cur["dense"]["score"] == pytest.approx(0.75)  # a#0 and b#0 only: (1.0 + 0.5) / 2
    assert cur["qada_rw@0.6"]["norm"] == pytest.approx((0.5 / 1.0 + 0.5 / 0.5) / 2)
    assert cur["qada_rw@0.6"]["worst_drop"] == pytest.approx(0.5)
    assert cur["qada_rw@0.6"]["sparsity"] == pytest.approx(0.7)


def test_curves_leave_out_a_sample_dense_has_not_run():
    """A sample the configuration ran but dense has not yet (a#2) is left out of its mean too, so that both are means
    over the same samples, whether or not dense is among the configurations asked for."""
    rows = [row("a", i, "dense", [1.0, 0.5][i], 0.0) for i in range(2)]
    rows += [row("a", i, "qada_rw@0.6", [1.0, 0.5, 0.0][i], 0.8) for i in range(3)]
    for configs in (["qada_rw@0.6"], ["dense", "qada_rw@0.6"]):
        cur = records.curves(rows, ["a"], configs)
        assert cur["qada_rw@0.6"]["score"] == pytest.approx(0.75) and cur["qada_rw@0.6"]["norm"] == pytest.approx(1.0)


def test_summary_averages_a_configuration_dropped_part_way_on_its_own_samples(tmp_path):
    """A sweep that stops running a configuration after its first samples (old@0.6 on sample 0 only, older@0.6 on
    sample 1 only): each is averaged on its own samples, and the configurations that ran every sample on all of
    them, not on the few they share with the dropped ones."""
    rows = [row(t, i, "dense", 1.0, 0.0) for t in "ab" for i in range(4)]
    rows += [row(t, i, "qada_rw@0.6", 1.0 if i == 0 else 0.5, 0.8) for t in "ab" for i in range(4)]
    rows += [row(t, 0, "old@0.6", 0.25, 0.9) for t in "ab"] + [row(t, 1, "older@0.6", 0.75, 0.9) for t in "ab"]
    cur = report.write_summary(tmp_path, rows, ["a", "b"])
    assert cur["qada_rw@0.6"]["n"] == 8 and cur["qada_rw@0.6"]["norm"] == pytest.approx((1 + 3 * 0.5) / 4)
    assert cur["old@0.6"]["n"] == 2 and cur["old@0.6"]["norm"] == pytest.approx(0.25)
    assert cur["older@0.6"]["n"] == 2 and cur["older@0.6"]["norm"] == pytest.approx(0.75)
    assert "| qada_rw@0.6 | 62.5 (4) | 62.5 (4) | 62.5 | 0.62 |" in (tmp_path / "summary.md").read_text()


def test_dense_is_averaged_with_the_configurations_of_the_most_samples(tmp_path):
    """Dense, the reference, is never set aside as a configuration run on fewer samples: with dense on a#0, a#1 and
    b#0 and two configurations on four samples each (x on a#0-3, y on a#0, a#1, b#0, b#1), dense's average is over
    the samples every one of them finished (a#0, a#1: 1.0), not over its own three (b#0 scores 0)."""
    rows = [row("a", 0, "dense", 1.0, 0.0), row("a", 1, "dense", 1.0, 0.0), row("b", 0, "dense", 0.0, 0.0)]
    rows += [row("a", i, "x@0.6", 1.0, 0.5) for i in range(4)]
    rows += [row(t, i, "y@0.6", 1.0, 0.5) for t in "ab" for i in range(2)]
    cur = report.write_summary(tmp_path, rows, ["a", "b"])
    assert cur["dense"]["n"] == 2 and cur["dense"]["score"] == 1.0


def test_summary_md_by_hand(tmp_path):
    """summary.md's tables against hand values: the dense score, the local floor (0 scores "0.0", not "–") and
    dense's answer tokens per task; each config's per-task score with its sample count, its average score (x100),
    normalised score, worst drop (x100), sparsity and KV read; the sparsity table holds sparsity, not KV read, and a
    column for the context-free samples where they ran. summary.csv rounds to four decimals."""
    rows = [dict(row(t, i, "dense", 1.0, 0.0), n_new=5) for t in "ab" for i in range(2)]
    rows += [dict(row(t, i, "local", 0.0, 0.9), n_new=7) for t in "ab" for i in range(2)]
    rows += [dict(row(t, i, "qada_rw@0.6", 0.5 if t == "a" else 1.0, 0.5), kv_read=0.25)
             for t in "ab" for i in range(2)]
    rows += [dict(row(report.CTXFREE, 0, "qada_rw@0.6", 0.0, 0.75), kv_read=0.25)]
    rows += [row(t, i, "x@0.5", 1.0, 1 / 3) for t in "ab" for i in range(2)]
    report.write_summary(tmp_path, rows, ["a", "b"])
    with open(tmp_path / "summary.csv", newline="") as f:
        (x,) = [r for r in csv.DictReader(f) if (r["task"], r["config"]) == ("a", "x@0.5")]
    assert (x["n"], x["score"], x["sparsity"], x["kv_read"]) == ("2", "1.0", "0.3333", "0.6667")  # 4 decimals
    text = (tmp_path / "summary.md").read_text()
    for line in ("| a | 2 | 100.0 | 0.0 | 5.0 |", "| b | 2 | 100.0 | 0.0 | 5.0 |",
                 "| config | a | b | avg score | avg norm. | worst drop | sparsity | KV read |",
                 "| dense | 100.0 (2) | 100.0 (2) | 100.0 | 1.00 | 0.0 | 0.000 | 1.000 |",
                 "| local | 0.0 (2) | 0.0 (2) | 0.0 | 0.00 | 100.0 | 0.900 | 0.100 |",
                 "| qada_rw@0.6 | 50.0 (2) | 100.0 (2) | 75.0 | 0.75 | 50.0 | 0.500 | 0.250 |",
                 f"| config | a | b | {report.CTXFREE} |", "| local | 0.900 | 0.900 | – |",
                 "| qada_rw@0.6 | 0.500 | 0.500 | 0.750 |"):
        assert line + "\n" in text


def test_lossless_sparsity_and_kv_read_with_intervals():
    """The lossless point on either axis is the last measured point before the first one under 0.95 of dense,
    written out by hand here; with every sample alike the bootstrap interval is that point."""
    rows = []
    for task in ("a", "b"):
        for i in range(4):
            rows.append(row(task, i, "dense", 1.0, 0.0))
            # sparsity 0.5 and 0.7 keep the score, 0.9 loses it; the KV read is not 1 - sparsity here (GQA)
            for thr, sp, kv, sc in ((0.8, 0.5, 0.8, 1.0), (0.6, 0.7, 0.6, 0.96), (0.2, 0.9, 0.3, 0.5)):
                rows.append(dict(row(task, i, f"qada_rw@{thr}", sc, sp), kv_read=kv))
    sp, = records.lossless_table(rows, ["a", "b"], n_boot=50)
    assert (sp["method"], sp["lossless"], sp["lo"], sp["hi"], sp["kv_read"]) == ("qada_rw", 0.7, 0.7, 0.7, 0.6)
    kv, = records.lossless_table(rows, ["a", "b"], axis="kv_read", n_boot=50)
    assert kv["lossless"] == pytest.approx(0.6) and kv["lo"] == pytest.approx(0.6) and kv["sparsity"] == 0.7
    assert kv["min_kv_read"] == 0.3
    # one task's sample 0 loses at 0.7: the point drops to 0.5 / KV read 0.8, and the interval spans both
    rows = [dict(r, score=0.0) if (r["task"], r["index"], r["config"]) == ("a", 0, "qada_rw@0.6") else r for r in rows]
    sp, = records.lossless_table(rows, ["a", "b"], n_boot=200)
    kv, = records.lossless_table(rows, ["a", "b"], axis="kv_read", n_boot=200)
    assert sp["lossless"] == 0.5 and (sp["lo"], sp["hi"]) == (0.5, 0.7)
    assert kv["lossless"] == pytest.approx(0.8) and (kv["lo"], kv["hi"]) == pytest.approx((0.6, 0.8))


def grid_rows() -> list[dict]:
    """Dense and two methods on four samples of tasks a and b, every sample of a task alike. qada_rw at head sparsity
    (KV read) 0.5 (0.6), 0.7 (0.45), 0.8 (0.35) and 0.9 (0.2) keeps 1.0, 0.96, 0.92 and 0.5 of dense on task a, 1.0,
    1.0, 1.0 and 0.5 on task b; static at 0.4 (0.6), 0.6 (0.4) and 0.8 (0.3) keeps 1.0, 0.9 and 0.7 on both."""
    rows = []
    for t in ("a", "b"):
        for i in range(4):
            rows.append(row(t, i, "dense", 1.0, 0.0))
            rows += [dict(row(t, i, f"qada_rw@{thr}", sa if t == "a" else sb, sp), kv_read=kv) for thr, sp, kv, sa, sb
                     in ((0.8, 0.5, 0.6, 1.0, 1.0), (0.7, 0.7, 0.45, 0.96, 1.0), (0.6, 0.8, 0.35, 0.92, 1.0),
                         (0.2, 0.9, 0.2, 0.5, 0.5))]
            rows += [dict(row(t, i, f"static@{thr}", sc, sp), kv_read=kv)
                     for thr, sp, kv, sc in ((0.8, 0.4, 0.6, 1.0), (0.9, 0.6, 0.4, 0.9), (0.95, 0.8, 0.3, 0.7))]
    return rows


def test_the_lossless_tables_in_analysis_by_hand():
    """write_lossless's three tables on grid_rows: qada_rw keeps >= 0.95 of dense on the mean over tasks up to
    sparsity 0.8 (KV read 0.35; (0.92 + 1) / 2 = 0.96), on its worst task only up to 0.7 (0.45); static up to 0.4
    (0.6); each row with the other axis there, the number of points, the highest sparsity (lowest read) measured and
    the samples. When sample 0 of task a loses at 0.7, a draw holding it stops at 0.5 (read 0.6), one without it
    (3/4 ** 4 of the draws) reaches 0.8 (0.35), 0.7 (0.45) on the worst task: the interval runs from the low to the
    high end."""
    qada, static = (records.label(m) for m in ("qada_rw", "static"))
    lines = report.write_lossless(Path("unused"), grid_rows(), ["a", "b"])
    for line in (f"| {qada} | 0.80 | [0.80, 0.80] | 0.35 | 4 | 0.90 | 8 |",
                 f"| {static} | 0.40 | [0.40, 0.40] | 0.60 | 3 | 0.80 | 8 |",
                 f"| {qada} | 0.35 | [0.35, 0.35] | 0.80 | 4 | 0.20 | 8 |",
                 f"| {static} | 0.60 | [0.60, 0.60] | 0.40 | 3 | 0.30 | 8 |",
                 f"| {qada} | 0.70 | [0.70, 0.70] | 0.45 | [0.45, 0.45] | 8 |",
                 f"| {static} | 0.40 | [0.40, 0.40] | 0.60 | [0.60, 0.60] | 8 |"):
        assert line in lines
    lost = [dict(r, score=0.0) if (r["task"], r["index"], r["config"]) == ("a", 0, "qada_rw@0.7") else r
            for r in grid_rows()]
    ours = [line for line in report.write_lossless(Path("unused"), lost, ["a", "b"]) if line.startswith(f"| {qada} |")]
    assert ours == [f"| {qada} | 0.50 | [0.50, 0.80] | 0.60 | 4 | 0.90 | 8 |",
                    f"| {qada} | 0.60 | [0.35, 0.60] | 0.50 | 4 | 0.20 | 8 |",
                    f"| {qada} | 0.50 | [0.50, 0.70] | 0.60 | [0.45, 0.60] | 8 |"]


def test_the_matched_tables_by_hand():
    """matched_tables on grid_rows: score / dense interpolated between the two measured points around each target
    (qada_rw at sparsity 0.85: halfway from 0.96 to 0.5, 0.73; at KV read 0.5: 1 - 0.02 * 0.1 / 0.15, 0.99; at 0.25:
    0.5 + 0.46 / 3, 0.65), and minus static at the same target where both reach it; blank outside a method's
    range (static past sparsity 0.8 and below a read of 0.3)."""
    qada, static = (records.label(m) for m in ("qada_rw", "static"))
    lines = report.matched_tables(grid_rows(), ["a", "b"], n_boot=50)
    pt = lambda *v: " | ".join(f"{x:.2f} [{x:.2f}, {x:.2f}]" if x is not None else "" for x in v)  # noqa: E731
    vs = lambda *v: " | ".join(f"{x:+.2f} [{x:+.2f}, {x:+.2f}]" if x is not None else "" for x in v)  # noqa: E731
    assert lines[2] == ("| method | @0.7 | @0.8 | @0.85 | @0.9 | vs static @0.7 | vs static @0.8 | vs static @0.85 | "
                        "vs static @0.9 | samples |")
    assert f"| {static} | {pt(0.8, 0.7, None, None)} |  |  |  |  | 8 |" in lines
    assert f"| {qada} | {pt(0.98, 0.96, 0.73, 0.5)} | {vs(0.18, 0.26, None, None)} | 8 |" in lines
    assert "**At KV read** 0.6, 0.5, 0.4, 0.25 (score / dense; then minus static)" in lines
    assert f"| {static} | {pt(1.0, 0.95, 0.9, None)} |  |  |  |  | 8 |" in lines
    assert f"| {qada} | {pt(1.0, 0.99, 0.97, 0.65)} | {vs(0.0, 0.04, 0.07, None)} | 8 |" in lines
    # a page path (a curve over its page budget) is held against Quest in the page tables, not here
    quest = [dict(row(t, i, f"quest@{b}", sc, 0.0), kv_read=kv, threshold_kind="budget") for t in ("a", "b")
             for i in range(4) for b, kv, sc in ((128, 0.3, 0.9), (512, 0.6, 1.0))]
    assert report.matched_tables(grid_rows() + quest, ["a", "b"], n_boot=50) == lines


def test_score_points_carry_a_paired_interval():
    """A figure's point: mean over tasks of score / dense on the shared samples, by hand, and its bootstrap interval
    (a point when every sample agrees; around it when one sample of four fails)."""
    rows = [row(t, i, "dense", 1.0, 0.0) for t in ("a", "b") for i in range(4)]
    rows += [row(t, i, "qada_rw@0.6", 0.0 if (t, i) == ("a", 0) else 1.0, 0.7) for t in ("a", "b") for i in range(4)]
    rows += [row("a", 4, "dense", 0.0, 0.0)]  # dense only: not shared, left out
    p = records.score_points(rows, ["a", "b"], "qada_rw@0.6", n_boot=300)
    assert p["norm"] == pytest.approx((3 / 4 + 1) / 2) and p["n"] == 8 and p["sparsity"] == pytest.approx(0.7)
    # task a's draw holds k failures ~ Binomial(4, 1/4): P(k >= 3) = 5.1 %, P(k = 4) = 0.4 %, so the 2.5th
    # percentile is k = 3, normalised (1/4 + 1) / 2; the 97.5th is k = 0
    assert p["lo"] == pytest.approx(0.625) and p["hi"] == 1.0
    same = records.score_points([dict(r, score=1.0) for r in rows if r["index"] < 4], ["a", "b"], "qada_rw@0.6",
                                n_boot=50)
    assert same["lo"] == same["norm"] == same["hi"] == 1.0
    # analysis.md's table lists that point (and no row for dense, the reference) with the same interval
    table = report.score_table(records.measured_points(rows, ["a", "b"]))
    assert table[2:] == ["| qada_rw@0.6 | 0.70 | 0.30 | 0.88 | [0.62, 1.00] | 8 |"]


def test_recall_rows_weight_each_run_by_its_steps():
    """Appendix C's table (recall_rows) from two tracked runs of one task, 10 and 30 steps, worked out by hand: steps
    S = 40; local (QAdA) [[40, 38], [35, 30]], oracle local [[39, 40], [0, 15]], both [[39, 38], [0, 15]] step-heads.
    The oracle needs the whole context on [[1, 0], [40, 25]] (66), QAdA labels long [[0, 0], [5, 10]] of those (15);
    QAdA's sparsity 143 / 160 makes static labels of all 4 heads local, which leave none of the 66 long. An untracked
    run and a task without static frequencies are left out."""
    one = {"task": "a", "config": "qada_rw@0.6", "steps": 10, "oracle_freq": [[0.9, 1.0], [0.0, 0.0]],
           "local_freq": [[1.0, 0.8], [0.5, 0.0]], "both_freq": [[0.9, 0.8], [0.0, 0.0]]}
    two = dict(one, steps=30, oracle_freq=[[1.0, 1.0], [0.0, 0.5]], local_freq=[[1.0, 1.0], [1.0, 1.0]],
               both_freq=[[1.0, 1.0], [0.0, 0.5]])
    untracked = {"task": "a", "config": "qada_rw@0.6", "steps": 50, "local_freq": [[0.0, 0.0], [0.0, 0.0]]}
    (got,) = records.recall_rows([one, two, untracked, dict(one, task="c")], {"a": [[0.9, 0.95], [0.1, 0.0]]})
    assert got["task"] == "a" and got["config"] == "qada_rw@0.6"
    assert got["qada_sparsity"] == pytest.approx(143 / 160) and got["oracle_sparsity"] == pytest.approx(94 / 160)
    assert got["recall_qada"] == pytest.approx(15 / 66) and got["recall_static_oracle"] == 0.0


def test_the_recall_table_gives_each_task_and_their_plain_mean():
    """Appendix C's table in analysis.md: task a as in test_recall_rows_weight_each_run_by_its_steps (sparsity 143/160,
    oracle 94/160, recall 15/66 against 0), task b one 10-step run (23/40, 19/40, 15/21 against 20/21: static labels at
    0.575 make layer 0 local, and the oracle needs layer 1 on 20 of its 21 long step-heads); each column's mean over
    the two tasks, unweighted."""
    one = {"task": "a", "config": "qada_rw@0.6", "steps": 10, "oracle_freq": [[0.9, 1.0], [0.0, 0.0]],
           "local_freq": [[1.0, 0.8], [0.5, 0.0]], "both_freq": [[0.9, 0.8], [0.0, 0.0]]}
    two = dict(one, steps=30, oracle_freq=[[1.0, 1.0], [0.0, 0.5]], local_freq=[[1.0, 1.0], [1.0, 1.0]],
               both_freq=[[1.0, 1.0], [0.0, 0.5]])
    freq = [[0.9, 0.95], [0.1, 0.0]]
    lines = report.recall_table(records.recall_rows([one, two, dict(one, task="b")], {"a": freq, "b": freq}))
    assert [line for line in lines if line.startswith("| ") and "---" not in line][1:] == [
        "| a | qada_rw@0.6 | 0.894 | 0.588 | 0.227 | 0.000 |",
        "| b | qada_rw@0.6 | 0.575 | 0.475 | 0.714 | 0.952 |",
        "| mean | qada_rw@0.6 | 0.734 | 0.531 | 0.471 | 0.476 |"]


def test_the_recall_tables_mean_rows_are_plain_means_over_three_tasks():
    """recall_table's mean row per configuration over three tasks is their plain mean (0.3 from 0.1, 0.2 and 0.6, not
    the median 0.2), each configuration's rows apart, in configuration order."""
    keys = ("qada_sparsity", "oracle_sparsity", "recall_qada", "recall_static_oracle")
    rr = [dict(task=t, config=c, **dict.fromkeys(keys, x + (c == "qada_rw@0.8")))
          for c in ("qada_rw@0.8", "qada_rw@0.6") for t, x in (("a", 0.1), ("b", 0.2), ("c", 0.6))]
    means = [line for line in report.recall_table(rr) if line.startswith("| mean |")]
    assert means == ["| mean | qada_rw@0.6 | 0.300 | 0.300 | 0.300 | 0.300 |",
                     "| mean | qada_rw@0.8 | 1.300 | 1.300 | 1.300 | 1.300 |"]


def test_the_peers_table_reads_only_the_samples_every_press_finished():
    """kvpress's presses ran on samples 0 and 1, the sweep on 0-2, and QAdA missed on sample 2 alone: paired on the
    presses' samples, QAdA keeps 1.00 at a KV read of 0.5 (0.67 with sample 2 let in) and SnapKV, halfway between its
    0.5 at a read of 0.3 and its 1.0 at 0.7, keeps 0.75, 0.25 less."""
    def rec(i, config, score, kv_read, **more):
        return dict(row("t", i, config, score, 1 - kv_read), kv_read=kv_read, **more)
    press = dict(path="kvpress", sparsity=None, kv_kept=0.5, kv_bytes=2**20, compress_s=0.1, batch=1)
    rows = [rec(i, "dense", 1.0, 1.0) for i in range(3)]
    rows += [rec(i, c, float(i < 2), kv) for i in range(3) for c, kv in (("qada_kv_cal@0.6", 0.4),
                                                                          ("qada_kv_cal@0.3", 0.6))]
    rows += [rec(i, c, sc, kv, **press) for i in range(2) for c, kv, sc in (("snapkv@0.25", 0.3, 0.5),
                                                                           ("snapkv@0.75", 0.7, 1.0))]
    lines = report.peer_tables(rows, ["t"], n_boot=50)
    assert lines[0].startswith("2 samples (t 2); differences against QAdA calibrated per KV group")
    assert "| QAdA calibrated per KV group (mean share) | 1.00 [1.00, 1.00] |  |  |  |" in lines
    assert "| kvpress SnapKV (question in the press) | 0.75 [0.75, 0.75] |  | -0.25 [-0.25, -0.25] |  |" in lines


def test_the_peers_cost_table_by_hand():
    """peer_tables on three samples: differences against the first of PEER_AGAINST that ran (calibrated QAdA per KV
    group before QAdA per KV group); a press run on fewer samples (knorm, on one) named and left out of both tables;
    each press's costs by hand: the mean fraction of the compressed span kept, of the KV cache held (MiB), of its
    press seconds, and the seconds per decoded token of its records decoded alone (batch 1; a batch's time is
    shared), with their count, "–" where none was."""
    def rec(i, config, score, kv_read, **more):
        return dict(row("t", i, config, score, 1 - kv_read), kv_read=kv_read, **more)
    press = dict(path="kvpress", sparsity=None)
    rows = [rec(i, "dense", 1.0, 1.0) for i in range(3)]
    rows += [rec(i, c, 1.0, kv) for i in range(3)
             for c, kv in (("qada_kv_cal@0.6", 0.4), ("qada_kv_cal@0.3", 0.6), ("qada_kv@0.6", 0.45))]
    for i in range(3):  # decoded alone: 0.4 s over 4 tokens, 0.9 s over 3; sample 2 in a batch of 2
        rows.append(rec(i, "snapkv@0.25", 0.5, 0.3, **press, kv_kept=[0.1, 0.2, 0.3][i], kv_bytes=(i + 1) * 2**20,
                        compress_s=[0.1, 0.2, 0.6][i], batch=[1, 1, 2][i], decode_s=[0.4, 0.9, 5.0][i],
                        n_new=[4, 3, 1][i]))
        rows.append(rec(i, "snapkv@0.75", 1.0, 0.7, **press, kv_kept=0.8, kv_bytes=2**22, compress_s=0.05, batch=2))
    rows.append(rec(0, "knorm@0.5", 1.0, 0.5, **press, kv_kept=0.5, kv_bytes=2**20, compress_s=0.0, batch=1))
    lines = report.peer_tables(rows, ["t"], n_boot=50)
    assert lines[0] == ("3 samples (t 3); differences against QAdA calibrated per KV group (mean share). Run on fewer "
                        "samples, left out here: knorm@0.5 (1 runs).")
    assert lines[2] == "| method | @0.5 | @0.25 | minus qada_kv_cal @0.5 | minus qada_kv_cal @0.25 |"
    assert "| kvpress SnapKV (question in the press) | 0.75 [0.75, 0.75] |  | -0.25 [-0.25, -0.25] |  |" in lines
    assert not [line for line in lines if "knorm" in line.lower()][1:]  # named in the first line alone
    assert lines[-3:] == ["|---|---:|---:|---:|---:|---:|", "| snapkv@0.25 | 0.200 | 2.0 | 0.30 | 0.200 (2) | 3 |",
                          "| snapkv@0.75 | 0.800 | 4.0 | 0.05 | – | 3 |"]


def test_claims_table_against_hand_computed_values():
    """Every claim's figure and verdict, worked out by hand from records where all samples agree (so each interval
    is its point): lossless points, paired differences, Table 2's factors (every layer and layers 1 up) and the
    recall of long-context heads against static-oracle labels at the run's own sparsity."""
    grid = {"oracle": [(0.2, 0.95, 0.5)], "static_oracle": [(0.5, 0.5, 1.0), (0.7, 0.7, 0.5)],
            "static": [(0.5, 0.5, 1.0), (0.8, 0.8, 1.0)], "qada_rw": [(0.2, 0.9, 0.2)],
            "qada_prompt": [(0.6, 0.5, 1.0), (0.1, 0.7, 0.9)]}
    # (layer, head) maps of 2 x 2: the oracle needs layer 1 every step; QAdA keeps layer 1 head 0 local half the time
    # and layer 0 head 1 long on 2 steps where the oracle has it local (not a recall of a long-context pair); the
    # oracle needs layer 0 head 0 on 1 step, which QAdA misses
    tracked = {"steps": 10, "log_err": [[10.0, 10.0], [1.0, 1.0]], "dist_local": [[3.0, 3.0], [3.0, 3.0]],
               "oracle_freq": [[0.9, 1.0], [0.0, 0.0]], "local_freq": [[1.0, 0.8], [0.5, 0.0]],
               "both_freq": [[0.9, 0.8], [0.0, 0.0]]}
    rows = []
    for task in ("a", "b"):
        for i in range(4):
            rows += [row(task, i, "dense", 1.0, 0.0), dict(row(task, i, "qada_rw@0.6", 1.0, 0.85), **tracked),
                     dict(row(task, i, "oracle@0.6", 1.0, 0.88), steps=10, local_freq=[[1.0, 1.0], [0.0, 0.0]])]
            rows += [row(task, i, f"{m}@{thr}", sc, sp) for m, points in grid.items() for thr, sp, sc in points]
    rows = [dict(r, **tracked) if r["config"] == "qada_prompt@0.6" else r for r in rows]  # its recall claim too
    table = report.claims_table(rows, ["a", "b"], n_boot=50)
    got = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[3:] for line in table[2:]}
    # where the paper says it, and its figure
    assert [line.split(" | ")[1:3] for line in table[2:] if line.startswith("| ")] == [
        ["§4.1, Fig. 4", "0.6-0.7"], ["§1, Fig. 2, §4.1", "0.85-0.9"], ["§4.1: ~+0.2", "> 0"],
        ["§4.2: QAdA outperforms static", "> 0"], ["§4.2: matches it", "≈ 0"],
        ["App. E: Option 2 better", "> 0"]] + [
        ["App. C, Table 2", "2-5"]] * 2 + [["App. C, Table 2", "15-50"]] * 2 + [["App. C, Fig. 9", "> 0"]] * 2
    assert table[-1].startswith("≥ (≤): the method (the one subtracted) was still lossless")  # "≤ 0.05" below

    def check(prefix, ours, interval, verdict):
        (cells,) = [v for k, v in got.items() if k.startswith(prefix)]
        assert cells == [ours, interval, verdict + " |"], (prefix, cells)

    check("static oracle heads", "0.50", "[0.50, 0.50]", "below the paper")
    check("adaptive oracle: lossless", "0.88", "[0.88, 0.88]", "consistent")
    check("adaptive oracle minus static oracle", "0.38", "[0.38, 0.38]", "holds")
    # static heads still lossless at their sparsest point (0.8): QAdA's lead is at most 0.05, its sign not decided
    check("QAdA (random words) minus static heads", "≤ 0.05", "[0.05, 0.05]", "not resolved: the grid ends lossless")
    check("QAdA (random words) minus static oracle", "0.35", "[0.35, 0.35]", "ours higher")
    check("random-words moments minus", "0.35", "[0.35, 0.35]", "holds")  # prompt moments: 0.9 of dense at 0.7
    check("Gaussian bulk estimate off by a factor (exp of the mean abs. log error), every layer", "244.7",
          "[244.7, 244.7]", "above the paper")  # exp((10 + 1) / 2)
    check("Gaussian bulk estimate off by a factor (exp of the mean abs. log error), layers 1", "2.7", "[2.7, 2.7]",
          "consistent")
    check("A_bulk and A_local differ by a factor (exp of the mean abs. log ratio), every", "20.1", "[20.1, 20.1]",
          "consistent")
    # QAdA keeps 15 of the oracle's 21 long (step, head) pairs long; static labels at its sparsity 0.575 (2 heads:
    # layer 0's, the oracle's most local) keep 20: 15/21 - 20/21
    check("recall of the oracle's long-context heads, qada_rw", "-0.238", "[-0.238, -0.238]", "reversed")
    check("recall of the oracle's long-context heads, qada_prompt", "-0.238", "[-0.238, -0.238]", "reversed")
    # one sample of task a where QAdA (its one point, 0.85) and the oracle (0.88) lose: neither has a lossless point
    # measured, so no figure is stated (not the 0 of "none"), and the intervals open
    lost = {("a", 0, "qada_rw@0.6"), ("a", 0, "oracle@0.6")}
    rows = [dict(r, score=0.0) if (r["task"], r["index"], r["config"]) in lost else r for r in rows]
    table = report.claims_table(rows, ["a", "b"], n_boot=200)
    got = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[3:] for line in table[2:]}
    check("QAdA (random words) minus static heads", report.NONE, "[-0.80, 0.05]",
          "not resolved: the grid ends lossless")
    check("adaptive oracle: lossless", report.NONE, "[0.00, 0.88]", "consistent")
    # the oracle's grid ending lossless: at 0.88 it only bounds the claim from below, which leaves the paper's 0.85-0.9
    # open (it read "consistent", and "below the paper" under a range above it); at 0.95 it is above the paper
    for sparsest, ours, said in ((0.88, "≥ 0.88", "not resolved: the grid ends lossless"),
                                 (0.95, "≥ 0.95", "above the paper")):
        kept = [dict(r, score=1.0, sparsity=sparsest) if r["config"] == "oracle@0.2" else r for r in rows
                if (r["task"], r["index"], r["config"]) not in lost]
        got = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[3:]
               for line in report.claims_table(kept, ["a", "b"], n_boot=50)[2:] if line.startswith("| ")}
        check("adaptive oracle: lossless", ours, f"[{sparsest:.2f}, {sparsest:.2f}]", said)
        check("adaptive oracle minus static oracle", f"≥ {sparsest - 0.5:.2f}", f"[{sparsest - 0.5:.2f}, "
              f"{sparsest - 0.5:.2f}]", "holds")  # a lower bound above 0 still holds
    # the verdict's edges: an interval touching the paper's side is not yet on it
    assert [report.verdict(0.0, 0.1, 0.0), report.verdict(0.01, 0.1, 0.0), report.verdict(-0.1, -0.01, 0.0)] == [
        "not resolved", "holds", "reversed"]
    assert [report.verdict(0.5, 0.59, (0.6, 0.7)), report.verdict(0.5, 0.6, (0.6, 0.7)),
            report.verdict(0.71, 0.8, (0.6, 0.7)),
            report.verdict(-0.1, 0.0, None), report.verdict(0.01, 0.1, None)] == [
        "below the paper", "consistent", "above the paper", "consistent", "ours higher"]
    # a bound decides only on its own side
    assert [report.verdict(0.91, 0.95, (0.85, 0.9), "lower"), report.verdict(0.8, 0.84, (0.85, 0.9), "lower"),
            report.verdict(0.1, 0.2, 0.0, "lower"), report.verdict(0.1, 0.2, 0.0, "upper"),
            report.verdict(-0.2, -0.1, 0.0, "upper"), report.verdict(0.1, 0.2, None, "lower"),
            report.verdict(-0.2, -0.1, None, "upper"), report.verdict(0.1, 0.2, 0.0, "neither")] == [
        "above the paper", "not resolved: the grid ends lossless", "holds", "not resolved: the grid ends lossless",
        "reversed", "ours higher", "ours lower", "not resolved: the grid ends lossless"]
    # an interval reaching across either edge of the paper's range, or holding it, is consistent with it
    assert [report.verdict(0.65, 0.75, (0.6, 0.7)), report.verdict(0.55, 0.65, (0.6, 0.7)),
            report.verdict(0.5, 0.8, (0.6, 0.7)), report.verdict(0.7, 0.8, (0.6, 0.7))] == ["consistent"] * 4



def test_config_differences_against_hand_computed_values():
    """Two single configurations compared on the samples dense and both finished: where each sits (sparsity / KV
    read), score / dense as the mean over tasks, the difference, and a paired interval that is its point when every
    sample agrees and opens when one does not."""
    rows = []
    for task, dense in (("a", 1.0), ("b", 0.5)):
        for i in range(4):
            rows += [row(task, i, "dense", dense, 0.0), row(task, i, "x@0.2", dense, 0.9),
                     row(task, i, "y@0.8", dense / 2, 0.5)]
    rows.append(row("a", 4, "x@0.2", 0.0, 0.1))  # a sample dense and y never ran: left out
    header = "| x | y | score x | score y | difference | interval | samples |"
    lines = report.config_differences(rows, ["a", "b"], [("x@0.2", "y@0.8")], header, n_boot=50)
    assert lines[0] == header
    assert lines[2] == "| x@0.2 (0.90 / 0.10) | y@0.8 (0.50 / 0.50) | 1.00 | 0.50 | +0.50 | [+0.50, +0.50] | 8 |"
    rows = [dict(r, score=0.0) if (r["task"], r["index"], r["config"]) == ("a", 0, "x@0.2") else r for r in rows]
    cells = report.config_differences(rows, ["a", "b"], [("x@0.2", "y@0.8")], header, n_boot=200)[2].split(" | ")
    assert cells[2:5] == ["0.88", "0.50", "+0.38"]  # task a: 3/4 of dense; (0.75 + 1) / 2
    lo, hi = (float(x) for x in cells[5].strip("[]").split(", "))
    assert lo < 0.38 < hi == 0.50

def test_kv_read_differences_are_paired():
    """The KV-group comparison by hand: the group rule is lossless down to 0.7 of the KV read, per-head QAdA to 0.8, so
    the difference is -0.10, a point when every sample agrees; the pairs with methods that never ran are left out."""
    rows = []
    for task in ("a", "b"):
        for i in range(4):
            rows.append(row(task, i, "dense", 1.0, 0.0))
            for m, points in {"qada_kv_all": [(0.6, 0.3, 0.7, 1.0), (0.2, 0.6, 0.4, 0.5)],
                              "qada_rw": [(0.8, 0.5, 0.9, 1.0), (0.6, 0.6, 0.8, 0.97), (0.4, 0.8, 0.6, 0.6)]}.items():
                rows += [dict(row(task, i, f"{m}@{thr}", sc, sp), kv_read=kv) for thr, sp, kv, sc in points]
    lines = report.kv_read_differences(rows, ["a", "b"], n_boot=50)
    assert len(lines) == 1
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    assert cells[1:] == ["0.70", "QAdA (random words)", "0.80", "-0.10", "[-0.10, -0.10]", "8"]


def test_the_paired_intervals_run_from_the_2_5th_to_the_97_5th_percentile_of_the_draws():
    """Three samples per task; qada_kv_all@0.6 (KV read 0.3) keeps 0.88 of dense on sample a#0, all of it elsewhere,
    so it stays lossless unless a draw takes a#0 for all three of task a's samples (1/27 = 3.7 % of the draws: then
    its read is 0.6); qada_rw@0.8 (read 0.5) keeps everything. The lossless-read difference is -0.20, its interval
    reaching +0.10 at the 97.5th percentile (not at the 95th). The configurations' difference is -0.02 per draw of
    a#0: -0.02 on all samples, 0 at the 97.5th percentile (no a#0: 30 % of the draws), -0.06 at the 2.5th (three
    draws of a#0, 3.7 %; two are 22 %). analysis.md's lossless tables state that difference in their section on the
    KV groups."""
    rows = []
    for task in ("a", "b"):
        for i in range(3):
            rows += [row(task, i, "dense", 1.0, 0.0), dict(row(task, i, "qada_rw@0.8", 1.0, 0.5), kv_read=0.5),
                     dict(row(task, i, "qada_kv_all@0.6", 0.88 if (task, i) == ("a", 0) else 1.0, 0.7), kv_read=0.3),
                     dict(row(task, i, "qada_kv_all@0.2", 1.0, 0.4), kv_read=0.6)]
    (line,) = report.kv_read_differences(rows, ["a", "b"], pairs=[("qada_kv_all", "qada_rw")])
    assert line.split(" | ")[1:] == ["0.30", "QAdA (random words)", "0.50", "-0.20", "[-0.20, +0.10]", "6 |"]
    lossless = report.write_lossless(Path("unused"), rows, ["a", "b"])  # analysis.md states it under the KV groups
    start = lossless.index("## Per KV group against per query head and static per KV head: lossless KV read, paired")
    assert line in lossless[start:]
    header = "| x | y | score x | score y | difference | interval | samples |"
    line = report.config_differences(rows, ["a", "b"], [("qada_kv_all@0.6", "qada_rw@0.8")], header)[2]
    assert line.split(" | ")[2:] == ["0.98", "1.00", "-0.02", "[-0.06, +0.00]", "6 |"]


def test_calibration_files_load_as_static_labels(tiny, tmp_path, monkeypatch, capsys):
    tok = TinyTokenizer()
    kwargs = dict(length=400, samples=2, seed=5, max_new_tokens=6, progress=True)
    freqs = calibrate.ensure(tiny, tok, ["niah_single_1"], tmp_path, **kwargs)
    err = capsys.readouterr().err.splitlines()  # the task's line, then one per prompt as it ends, as --qada's
    assert err[0].startswith("calibrating static labels on niah_single_1 (2 prompts")
    assert [line.split(":")[0] for line in err[1:]] == ["niah_single_1#0", "niah_single_1#1"]
    assert all(re.fullmatch(r"niah_single_1#\d: \d+ steps, \d+ s", line) for line in err[1:])
    L, H = tiny.cfg.num_hidden_layers, tiny.cfg.num_attention_heads
    assert freqs["niah_single_1"].shape == (L, H) and torch.equal(freqs["ruler"], freqs["niah_single_1"])
    labels, settings = load_labels(tmp_path / "niah_single_1.json", 0.5)
    assert int(labels.sum()) == round(0.5 * L * H) and settings["seed"] == 5 and 1 <= settings["steps"] <= 10
    monkeypatch.setattr(calibrate, "oracle_frequency", lambda *a, **k: pytest.fail("recalibrated"))
    again = calibrate.ensure(tiny, tok, ["niah_single_1"], tmp_path, **kwargs)  # same settings: read back
    assert torch.allclose(again["niah_single_1"].cpu(), freqs["niah_single_1"].cpu())
    # a clone on another machine: the files record the model's folder in the cache of the machine that made them
    for name, model in (("niah_single_1.json", "/elsewhere/.cache/qada/models/"), ("ruler.json", "/other/home/")):
        data = json.loads((tmp_path / name).read_text())
        data["settings"]["model"] = model + Path(str(tiny.model_dir)).name
        (tmp_path / name).write_text(json.dumps(data))
    moved = calibrate.ensure(tiny, tok, ["niah_single_1"], tmp_path, **kwargs)  # the same model: read back
    assert torch.allclose(moved["niah_single_1"].cpu(), freqs["niah_single_1"].cpu())
    for other in ("/other/home/another-model", "transformers:/other/home/" + Path(str(tiny.model_dir)).name):
        data["settings"]["model"] = other  # another model, or this one run through transformers (lab.calibrate --hf)
        (tmp_path / "ruler.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match=f"ruler.json holds static labels of other settings .model: '{other}'"):
            calibrate.ensure(tiny, tok, ["niah_single_1"], tmp_path, **kwargs)


def test_records_are_read_compressed_and_plain_and_merged_into_one_compressed_file(tmp_path):
    """A finished run's samples.jsonl.xz, then the plain lines a resumed run appended (one torn): read in that order;
    the merge leaves one compressed file, the same bytes for the same records."""
    recs = [dict(task="a", index=i, config="dense", score=i) for i in range(3)]
    records.write_records(tmp_path / "samples.jsonl.xz", recs[:2])
    (tmp_path / "samples.jsonl").write_text(json.dumps(recs[2]) + "\n" + '{"task": "a", "ind')
    assert records.read_records(tmp_path) == recs
    sweep.merge(tmp_path, sweep.plan(["a"], 3, [sweep.Config("dense")], [], 0, [], 0))
    assert records.result_files(tmp_path) == [tmp_path / "samples.jsonl.xz"]
    assert records.read_records(tmp_path) == recs
    (tmp_path / "again").mkdir()
    again = records.write_records(tmp_path / "again" / "samples.jsonl.xz", recs)
    assert again.read_bytes() == (tmp_path / "samples.jsonl.xz").read_bytes()


def test_a_report_pairs_a_folder_with_an_earlier_one_of_the_same_samples(tmp_path, monkeypatch):
    """--with: the other folder's records that this one lacks join it, on this one's samples; its own win; other
    settings are refused; a model is told by the model it names, not by its text."""
    settings = dict(tasks=["a"], length=400, seed=42, stop="eos", n_sink=16, n_local=128, model="m", dtype="bfloat16")
    for name, recs in (("new", [("a", 0, "dense", 1.0), ("a", 0, "qada_cal@0.6", 1.0)]),
                       ("old", [("a", 0, "dense", 0.0), ("a", 0, "static@0.8", 0.5), ("a", 1, "dense", 1.0)])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps({"settings": settings}))
        records.write_records(tmp_path / name / "samples.jsonl.xz",
                              [dict(task=t, index=i, config=c, score=x) for t, i, c, x in recs])
    rows = report.with_baseline(tmp_path / "new", records.read_records(tmp_path / "new"), tmp_path / "old")
    assert [(r["task"], r["index"], r["config"], r["score"]) for r in rows] == [
        ("a", 0, "dense", 1.0), ("a", 0, "qada_cal@0.6", 1.0), ("a", 0, "static@0.8", 0.5)]  # sample a#1: not in new
    (tmp_path / "old" / "run.json").write_text(json.dumps({"settings": dict(settings, length=800)}))
    with pytest.raises(ValueError, match="not runs of the same samples.*length"):
        report.with_baseline(tmp_path / "new", rows, tmp_path / "old")
    # a folder whose settings do not say its seed cannot be shown to hold the same samples
    (tmp_path / "old" / "run.json").write_text(json.dumps({"settings": {k: v for k, v in settings.items()
                                                                        if k != "seed"}}))
    with pytest.raises(ValueError, match=r"not runs of the same samples: \['seed'\]"):
        report.with_baseline(tmp_path / "new", rows, tmp_path / "old")
    # a model folder named otherwise (./m/ and the absolute path) is the same model; another folder is not
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old" / "run.json").write_text(json.dumps({"settings": dict(settings, model=str(tmp_path / "m"))}))
    (tmp_path / "new" / "run.json").write_text(json.dumps({"settings": dict(settings, model="./m/")}))
    assert len(report.with_baseline(tmp_path / "new", rows, tmp_path / "old")) == 3
    (tmp_path / "new" / "run.json").write_text(json.dumps({"settings": dict(settings, model="other/m")}))
    with pytest.raises(ValueError, match="not runs of the same samples.*model"):
        report.with_baseline(tmp_path / "new", rows, tmp_path / "old")


def test_with_refuses_a_folder_of_other_settings_or_no_model(tmp_path):
    """--with pairs two folders only when every SAME_RUN setting both record agrees, each in turn checked, and both
    name their model; a setting one of them does not record (a peers run's window) is no clash."""
    settings = dict(tasks=["a"], length=400, seed=42, stop="eos", n_sink=16, n_local=128, model="m", dtype="bfloat16")
    for name in ("new", "old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps({"settings": settings}))
        records.write_records(tmp_path / name / "samples.jsonl.xz", [dict(task="a", index=0, config=name, score=1.0)])
    rows = records.read_records(tmp_path / "new")
    for key in report.SAME_RUN:
        (tmp_path / "old" / "run.json").write_text(json.dumps({"settings": dict(settings, **{key: "other"})}))
        with pytest.raises(ValueError, match=f"not runs of the same samples: {{'{key}'"):
            report.with_baseline(tmp_path / "new", rows, tmp_path / "old")
    (tmp_path / "old" / "run.json").write_text(json.dumps({"settings": {k: v for k, v in settings.items()
                                                                        if k != "model"}}))
    with pytest.raises(ValueError, match=r"not runs of the same samples: \['model'\]"):
        report.with_baseline(tmp_path / "new", rows, tmp_path / "old")
    peers = {k: v for k, v in settings.items() if k not in ("n_sink", "n_local")}
    (tmp_path / "old" / "run.json").write_text(json.dumps({"settings": peers}))
    assert [r["config"] for r in report.with_baseline(tmp_path / "new", rows, tmp_path / "old")] == ["new", "old"]


def test_matched_scores_interpolate_between_measured_points_with_paired_draws():
    """Two configurations of a method at head sparsity 0.6 and 1.0 scoring 1 and 0.5 of dense: at 0.8 the matched
    score is 0.75, at 0.9 0.625, outside [0.6, 1.0] nothing; against itself the paired difference is exactly 0."""
    rows = []
    for task in ("a", "b"):
        for i in range(4):
            rows.append(dict(task=task, index=i, config="dense", method="dense", score=1.0, sparsity=0.0, kv_read=1.0))
            rows.append(dict(task=task, index=i, config="m@1", method="m", score=1.0, sparsity=0.6, kv_read=0.7))
            rows.append(dict(task=task, index=i, config="m@2", method="m", score=0.5, sparsity=1.0,
                             kv_read=0.3))
    draws = records.matched_draws(rows, ["a", "b"], {"m": ["m@1", "m@2"]}, "sparsity", (0.5, 0.8, 0.9), n_boot=50)
    assert draws["m"].shape == (51, 3)
    assert math.isnan(draws["m"][0, 0]) and draws["m"][0, 1:].tolist() == pytest.approx([0.75, 0.625])
    table = records.matched_table(rows, ["a", "b"], "kv_read", targets=(0.5,), against="m", n_boot=50)
    assert table[0][0.5][0] == pytest.approx(0.75) and "vs 0.5" not in table[0]  # no difference from itself


def test_the_worst_task_rule_is_stricter_than_the_mean():
    """Task a keeps everything at both points, task b 0.9 of dense at the sparser one: by the mean over tasks (0.95)
    the sparser point is lossless, by the worst task (0.9) only the denser one. Every sample alike, so each interval
    is its point: the worst task's rule holds in the draws too ([0.5, 0.5], not the mean rule's [0.8, 0.8]), and the
    sparsest point measured is 0.8 either way."""
    rows = []
    for task, loss in (("a", 1.0), ("b", 0.9)):
        for i in range(4):
            rows.append(dict(task=task, index=i, config="dense", method="dense", score=1.0, sparsity=0.0, kv_read=1.0))
            rows.append(dict(task=task, index=i, config="m@1", method="m", score=1.0, sparsity=0.5, kv_read=0.6))
            rows.append(dict(task=task, index=i, config="m@2", method="m", score=loss, sparsity=0.8, kv_read=0.3))
    mean_rule = records.lossless_table(rows, ["a", "b"], n_boot=20)[0]
    worst_rule = records.lossless_table(rows, ["a", "b"], n_boot=20, worst=True)[0]
    assert (mean_rule["lossless"], worst_rule["lossless"]) == (0.8, 0.5)  # mean 0.95 passes, the worst task 0.9 not
    assert (worst_rule["lo"], worst_rule["hi"], worst_rule["max_sparsity"]) == (0.5, 0.5, 0.8)
    assert (mean_rule["lo"], mean_rule["hi"], mean_rule["max_sparsity"]) == (0.8, 0.8, 0.8)


# --- the statistics where samples differ: pairing, the 95 % percentiles, means of task means ----------------------


def varied_rows():
    """Two tasks of 10 samples; dense and two methods that score alike sample by sample (1 on even samples, 0.9 on odd
    ones for both, dense 1): any difference between them, or from dense, is paired draw by draw, or it is noise."""
    rows = []
    for t in ("a", "b"):
        for i in range(10):
            rows.append(row(t, i, "dense", 1.0, 0.0))
            for m in ("qada_kv_all", "qada_rw"):
                for thr, sp, kv in ((0.6, 0.5, 0.7), (0.2, 0.9, 0.3)):
                    score = (1.0 if i % 2 == 0 else 0.9) if thr == 0.6 else (1.0 if i % 2 else 0.0)
                    rows.append(dict(row(t, i, f"{m}@{thr}", score, sp), kv_read=kv))
    return rows


def test_differences_of_methods_alike_sample_by_sample_are_exactly_zero():
    """Each statistic that compares draws them paired: the same resampled samples for dense and every configuration,
    and for both methods of a difference. Unpaired, a difference of two methods that agree on every sample spreads
    around 0 (and a score over dense that equals it on every sample spreads around 1)."""
    rows = varied_rows()
    line, = report.kv_read_differences(rows, ["a", "b"], n_boot=200, pairs=[("qada_kv_all", "qada_rw")])
    assert "| +0.00 | [+0.00, +0.00] |" in line
    vs, = records.matched_table(rows, ["a", "b"], "kv_read", (0.5,), against="qada_rw", n_boot=200,
                                methods=["qada_kv_all"])
    assert vs["vs 0.5"] == pytest.approx((0.0, 0.0, 0.0))
    both = [dict(r, score=float(r["index"] % 2)) for r in rows if r["config"] in ("dense", "qada_rw@0.6")]
    p = records.score_points(both, ["a", "b"], "qada_rw@0.6", n_boot=200)  # dense and it: 0, 1, 0, 1, ... alike
    assert p["lo"] == p["norm"] == p["hi"] == 1.0


def test_the_lossless_interval_is_the_draws_2_5th_to_97_5th_percentile():
    """Nine configurations at sparsity 0.1 ... 0.9, the k-th failing task a's first k samples (of 10): the draws'
    lossless points spread over several configurations, and the "95 %" interval of the table and of the claims is
    their 2.5th to 97.5th percentile (here not the 5th to 95th)."""
    rows = []
    for t in ("a", "b"):
        for i in range(10):
            rows.append(row(t, i, "dense", 1.0, 0.0))
            for k in range(1, 10):
                rows.append(row(t, i, f"qada_rw@{1 - k / 10:g}", 0.0 if t == "a" and i < k else 1.0, k / 10))
    cfgs = records.method_configs(rows, ["a", "b"])
    boot = records.lossless_draws(rows, ["a", "b"], cfgs, n_boot=2000)["qada_rw"]["boot"]
    want = tuple(float(x) for x in np.percentile(boot, [2.5, 97.5]))
    assert want != tuple(float(x) for x in np.percentile(boot, [5, 95]))  # the fixture tells the two apart
    sp, = records.lossless_table(rows, ["a", "b"], n_boot=2000)
    assert (sp["lo"], sp["hi"]) == want
    oracle = [dict(r, config=r["config"].replace("qada_rw", "oracle"), method="oracle") if r["method"] == "qada_rw"
              else r for r in rows]
    claim, = [line for line in report.claims_table(oracle, ["a", "b"]) if line.startswith("| adaptive oracle:")]
    assert f"| [{want[0]:.2f}, {want[1]:.2f}] |" in claim


def test_lossless_points_stop_at_the_first_loss_and_count_0_95_as_lossless():
    """A sparser point that keeps the score after one that lost does not extend the lossless point; a point at
    0.95 of dense is lossless, and found, also where floating point sums it to an ulp below."""
    assert records.lossless_sparsity([(0.5, 1.0), (0.7, 0.9), (0.9, 0.97)]) == 0.5
    rows = [row(t, i, "dense", 1.0, 0.0) for t in ("a", "b") for i in range(3)]
    rows += [row(t, i, "qada_rw@0.6", 0.95, 0.5) for t in ("a", "b") for i in range(3)]  # a mean of 0.9499999999999998
    sp, = records.lossless_table(rows, ["a", "b"], n_boot=20)
    assert sp["found"] and sp["lossless"] == 0.5
    assert records.lossless_sparsity([(0.5, 0.95 - 1e-6)]) == 0.0  # the rounding's allowance, not a real loss's


def test_means_are_over_tasks_and_over_the_samples_dense_ran():
    """Every figure is a mean over tasks of per-task means (a task with more samples weighs the same); a sparsity or
    KV read 'there' counts only the samples dense ran too; a task where dense scores 0 is left out of score / dense,
    not a division by 0; the window-only baseline is no method of the tables; draws repeat with their seed."""
    point, boot = records.mean_draws({"a": [1.0], "b": [3.0, 3.0, 3.0]}, n_boot=10)
    assert point == 2.0 and (boot == 2.0).all()
    spread = {"a": [0.0, 1.0, 5.0], "b": [2.0, 7.0]}
    assert (records.mean_draws(spread, 50, seed=3)[1] == records.mean_draws(spread, 50, seed=3)[1]).all()
    rows = [row(t, i, "dense", 1.0 if t == "a" else 0.0, 0.0) for t in ("a", "b") for i in range(4)]
    rows += [row(t, i, "qada_rw@0.6", 1.0, 0.7) for t in ("a", "b") for i in range(4)]
    rows += [row("a", 4, "qada_rw@0.6", 1.0, 0.1)]  # dense never ran sample 4: not among the paired samples
    rows += [row(t, i, "local", 0.0, 1.0) for t in ("a", "b") for i in range(4)]
    p = records.score_points(rows, ["a", "b"], "qada_rw@0.6", n_boot=20)
    assert p["norm"] == 1.0 and p["sparsity"] == pytest.approx(0.7) and p["kv_read"] == pytest.approx(0.3)
    assert [r["method"] for r in records.lossless_table(rows, ["a", "b"], n_boot=20)] == ["qada_rw"]
    # the configurations' place on the axis: a mean over tasks, task a's 4 samples at 0.9 and b's 2 at 0.5 -> 0.7
    uneven = [row(t, i, "dense", 1.0, 0.0) for t, n in (("a", 4), ("b", 2)) for i in range(n)]
    uneven += [row(t, i, "x@1", 1.0, 0.9 if t == "a" else 0.5) for t, n in (("a", 4), ("b", 2)) for i in range(n)]
    scores = records.paired_scores(uneven, ["a", "b"], ["x@1"])
    values = records.paired_values(uneven, scores, ["x@1"], "sparsity")
    full = {t: np.arange(len(i)) for t, (i, _) in scores.items()}
    assert records.drawn_mean(values, full, "x@1") == pytest.approx(0.7)
    # a draw that picks only samples without a sparsity in one task (answers ended at their first token): that task
    # sits out of the draw's mean, as it does out of the point, instead of turning the draw (and the interval) NaN
    values["b"]["x@1"][0] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert records.drawn_mean(values, {"a": np.arange(4), "b": np.array([0, 0])}, "x@1") == pytest.approx(0.9)
        assert np.isnan(records.drawn_mean({"b": values["b"]}, {"b": np.array([0])}, "x@1"))
    assert report.verdict(-0.1, 0.0, 0.0) == "not resolved"  # touching 0 from below is not yet reversed


def test_all_draws_at_once_give_each_draw_bit_for_bit():
    """draw_picks takes the draws from the generator in the order the intervals always took them, and drawn_means and
    normalised_draws give each draw exactly what numpy gave a draw alone (the tables' intervals computed one draw at a
    time, as written below): nine tasks, so that numpy sums them pairwise; samples without a value, so that a task
    sits out of some draws; a dense scoring 0 in some draws; worst's minimum."""
    rng = np.random.default_rng(1)
    scores, values = {}, {}
    for i in range(9):
        n = 2 + i
        values[f"t{i}"] = {"c": np.where(rng.random(n) < 0.4, np.nan, rng.random(n))}
        scores[f"t{i}"] = (list(range(n)), {"dense": rng.integers(0, 2, n).astype(float), "c": rng.random(n)})
    picks = records.draw_picks(scores, 400, np.random.default_rng(2))
    draws = [{t: p[j] for t, p in picks.items()} for j in range(400)]
    rng = np.random.default_rng(2)  # drawn draw by draw, task by task: a seed gives the intervals it always gave
    assert all(all((d[t] == rng.integers(0, len(i), len(i))).all() for t, (i, _) in scores.items()) for d in draws)
    where, norm, worst = (records.drawn_means(values, picks, "c"), records.normalised_draws(scores, picks, "c"),
                          records.normalised_draws(scores, picks, "c", worst=True))

    def one_draw(d):
        picked = [v["c"][d[t]] for t, v in values.items()]
        means = [np.nanmean(x) for x in picked if not np.isnan(x).all()]
        ratios = [sc["c"][d[t]].mean() / sc["dense"][d[t]].mean() for t, (_, sc) in scores.items()
                  if sc["dense"][d[t]].mean() > 0]
        return np.mean(means), np.mean(ratios), np.min(ratios)

    sat_out = 0
    for j, d in enumerate(draws):
        assert (where[j], norm[j], worst[j]) == one_draw(d), j
        sat_out += sum(np.isnan(v["c"][d[t]]).all() for t, v in values.items()) > 0
    assert 0 < sat_out < len(draws)


def test_the_agreement_tables_by_hand():
    """The oracle-agreement tables on one tracked run of one layer: heads by decile of the oracle's local frequency,
    most local first; Table 2's most-local heads by the rank given; the per-layer kappa (Cohen's: chance agreement
    from both the local and the long-context margins); the static oracle's frequencies weighted by steps."""
    freq = [1.0 - h / 10 for h in range(10)]  # head h: oracle-local 1.0, 0.9, ..., 0.1
    run = {"task": "a", "config": "qada_rw@0.6", "steps": 1, "oracle_freq": [freq], "local_freq": [freq],
           "both_freq": [freq], "log_err": [[float(h) for h in range(10)]], "dist_local": [[1.0] * 10]}
    lines = report.agreement_by_decile([run])
    assert lines[2].startswith("| 0-10% | 1.00 |") and lines[11].startswith("| 90-100% | 0.10 |")
    table = report.log_error_table([run], np.arange(10))  # head 0 ranked most local
    assert [line.split(" | ")[1] for line in table[2:]] == ["4.50 ± 2.87", "0.50 ± 0.50", "0.00 ± 0.00"]
    # 4 heads: QAdA local on 3, the oracle on 2 of those: TP 0.5, FP 0.25, TN 0.25, FN 0; observed agreement 0.75,
    # chance (0.75 * 0.5 + 0.25 * 0.5) = 0.5, kappa 0.5
    four = dict(run, oracle_freq=[[1.0, 1.0, 0.0, 0.0]], local_freq=[[1.0, 1.0, 1.0, 0.0]],
                both_freq=[[1.0, 1.0, 0.0, 0.0]], log_err=[[0.0] * 4], dist_local=[[0.0] * 4])
    layer0 = report.layer_disagreement([four])[2]
    assert layer0.split(" | ")[1:6] == ["0.50", "0.25", "0.25", "0.00", "0.50"]
    runs = [{"task": "a", "config": "oracle@0.6", "steps": 10, "local_freq": [[1.0]]},
            {"task": "a", "config": "oracle@0.6", "steps": 30, "local_freq": [[0.0]]}]
    assert records.static_oracle_freq(records.group(runs), ["a"]) == {"a": [[0.25]]}


def test_the_agreement_and_log_error_tables_in_full_by_hand():
    """agreement_by_decile and log_error_table, every column: one tracked run of ten heads, the oracle local on head h
    a share 1 - h / 10 of the steps, QAdA always on heads 0-4 and never on 5-9. All heads: oracle local 0.55, TP 0.4
    (1 + 0.9 + ... + 0.6 over 10), FP 0.1, FN 0.15, TN 0.35, accuracy 0.75. Table 2 with log error h and distance 2h
    on head h, heads ranked 0 first: the factor is exp of the mean error (exp(4.5) = 90.0, exp(0.5) = 1.6)."""
    oracle = [1.0 - h / 10 for h in range(10)]
    qada = [1.0] * 5 + [0.0] * 5
    run = {"task": "a", "config": "qada_rw@0.6", "steps": 1, "oracle_freq": [oracle], "local_freq": [qada],
           "both_freq": [[min(x, y) for x, y in zip(oracle, qada)]], "log_err": [[float(h) for h in range(10)]],
           "dist_local": [[2.0 * h for h in range(10)]]}
    lines = report.agreement_by_decile([run])
    assert lines[2] == "| 0-10% | 1.00 | 1.000 | 0.000 | 0.000 | 0.000 | 1.000 |"
    assert lines[6] == "| 40-50% | 0.60 | 0.600 | 0.400 | 0.000 | 0.000 | 0.600 |"
    assert lines[11] == "| 90-100% | 0.10 | 0.000 | 0.000 | 0.900 | 0.100 | 0.900 |"
    assert lines[12] == "| all | 0.55 | 0.400 | 0.100 | 0.350 | 0.150 | 0.750 |"
    assert report.log_error_table([run], np.arange(10))[2:] == [
        "| all | 4.50 ± 2.87 | 90.0 | 9.00 ± 5.74 |", "| 20% most often local | 0.50 ± 0.50 | 1.6 | 1.00 ± 1.00 |",
        "| 10% most often local | 0.00 ± 0.00 | 1.0 | 0.00 ± 0.00 |"]


def test_the_agreement_table_of_fewer_than_ten_heads_has_no_empty_decile():
    """Eight heads (a tiny model's two layers of four) split into ten deciles leave two empty: those rows are left out,
    not printed as nan (with numpy's division warning on stderr), and each row, one head, is labelled by its eighth of
    the heads, not by a decile it does not hold (0-10%, ..., 70-80% with none past 80%)."""
    freq = [[1.0 - h / 8 for h in range(4)], [0.5 - h / 8 for h in range(4)]]
    run = {"task": "a", "config": "qada_rw@0.6", "steps": 1, "oracle_freq": freq, "local_freq": freq,
           "both_freq": freq}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lines = report.agreement_by_decile([run])
    assert len(lines) == 2 + 8 + 1 and not any("nan" in line for line in lines)
    assert [line.split(" | ")[0] for line in lines[2:-1]] == [
        "| 0-12%", "| 12-25%", "| 25-37%", "| 37-50%", "| 50-62%", "| 62-75%", "| 75-87%", "| 87-100%"]
    assert lines[2].startswith("| 0-12% | 1.00 |") and lines[9].startswith("| 87-100% | 0.12 |")  # most local first
    assert lines[-1].startswith("| all | 0.56 |")  # (3.25 + 1.25) / 8


def test_the_per_layer_table_by_hand():
    """layer_disagreement on two tracked runs of four layers of one head (10 and 30 steps): per layer TP, FP, TN, FN,
    kappa (– where both label every head alike: chance agreement 1), the oracle's long-context share (FP + TN) and
    QAdA's (FN + TN); the log errors as means over runs weighted by their steps, "–" for one that not every run
    recorded; then layer 0 and the thirds of layers 1-3, one layer each (named as one)."""
    freq = {"local_freq": [[1.0], [0.0], [1.0], [0.5]], "oracle_freq": [[0.0], [1.0], [1.0], [0.5]],
            "both_freq": [[0.0], [0.0], [1.0], [0.5]]}
    runs = [dict(freq, task="a", config="qada_rw@0.6", steps=steps, log_err=[[e + k] for k in range(4)],
                 log_bias=[[-e - k] for k in range(4)], log_err_exact=[[(e + k) / 2] for k in range(4)])
            for steps, e in ((10, 1.0), (30, 5.0))]
    runs[0]["log_bias_exact"] = [[0.0]] * 4  # recorded by one run only
    lines = report.layer_disagreement(runs)
    # layer l: log_err 1 + l on 10 steps, 5 + l on 30: weighted, 4 + l
    assert lines[2:] == [
        "| 0 | 0.00 | 1.00 | 0.00 | 0.00 | 0.00 | 1.00 | 0.00 | 4.00 | -4.00 | 2.00 | – |",
        "| 1 | 0.00 | 0.00 | 0.00 | 1.00 | 0.00 | 0.00 | 1.00 | 5.00 | -5.00 | 2.50 | – |",
        "| 2 | 1.00 | 0.00 | 0.00 | 0.00 | – | 0.00 | 0.00 | 6.00 | -6.00 | 3.00 | – |",
        "| 3 | 0.50 | 0.00 | 0.50 | 0.00 | 1.00 | 0.50 | 0.50 | 7.00 | -7.00 | 3.50 | – |",
        "| **layer 0** | 0.00 | 1.00 | 0.00 | 0.00 | 0.00 | 1.00 | 0.00 | 4.00 | -4.00 | 2.00 | – |",
        "| **layer 1** | 0.00 | 0.00 | 0.00 | 1.00 | 0.00 | 0.00 | 1.00 | 5.00 | -5.00 | 2.50 | – |",
        "| **layer 2** | 1.00 | 0.00 | 0.00 | 0.00 | – | 0.00 | 0.00 | 6.00 | -6.00 | 3.00 | – |",
        "| **layer 3** | 0.50 | 0.00 | 0.50 | 0.00 | 1.00 | 0.50 | 0.50 | 7.00 | -7.00 | 3.50 | – |"]
    assert report.layer_disagreement([dict(runs[0], steps=0)]) == []  # no step decoded: nothing to compare


def test_the_analysis_sections_of_tracked_context_free_and_ablation_runs(tmp_path):
    """analysis.md's later sections, by hand. qada_rw@0.6 tracked on two samples of tasks a (sparsity 0.5) and b
    (0.7), agreeing with the oracle everywhere; on the context-free sample it keeps every head local (sparsity 0.9), a
    run the per-layer table leaves out. Table 2 ranks the heads by the oracle runs' own local frequency (head 9 most
    local), not by the oracle's labels on QAdA's decoding (head 0 most). Fig. 6c's row: the mean and std over tasks,
    the context-free mean and count, and the first 300 characters of an answer. The ablation (qada_word, sample 0
    alone) is compared with dense and QAdA on its samples, which a configuration outside the comparison (static, on
    sample 1) does not shrink."""
    ten = [[h / 10 for h in range(10)]]
    tracked = {"steps": 2, "oracle_freq": [ten[0][::-1]], "local_freq": [ten[0][::-1]], "both_freq": [ten[0][::-1]],
               "log_err": [[float(h) for h in range(10)]], "dist_local": [[1.0] * 10]}
    rows = []
    for t, sp in (("a", 0.5), ("b", 0.7)):
        for i in range(2):
            rows += [row(t, i, "dense", 1.0, 0.0), dict(row(t, i, "qada_rw@0.6", 1.0, sp), **tracked),
                     dict(row(t, i, "oracle@0.6", 1.0, 0.6), local_freq=ten, steps=2)]
        rows += [row(t, 0, "qada_word@0.6", 0.5, 0.4), row(t, 1, "static@0.8", 1.0, 0.8)]  # static: no ablation
    rows.append(dict(row(report.CTXFREE, 0, "qada_rw@0.6", None, 0.9), pred="w " * 200,
                     **dict(tracked, local_freq=[[1.0] * 10])))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a mean of no layer (layers 1 and up of one) warns
        report.write_analysis(tmp_path, rows, ["a", "b"], {}, {}, [])
    text = (tmp_path / "analysis.md").read_text()
    # one layer: the Table 2 claims of every layer, none of layers 1 and up, and no NaN anywhere
    assert "off by a factor (exp of the mean abs. log error), every layer" in text and "layers 1 and up" not in text
    assert "nan" not in text.lower()
    # per layer: the tasks' runs alone, where QAdA and the oracle agree (kappa 1)
    assert "| 0 | 0.45 | 0.00 | 0.55 | 0.00 | 1.00 | 0.55 | 0.55 | 4.50 | – | – | – |\n" in text
    assert "| 10% most often local | 9.00 ± 0.00 | 8103.1 | 1.00 ± 0.00 |\n" in text  # exp(9)
    assert "| 20% most often local | 8.50 ± 0.50 | 4914.8 | 1.00 ± 0.00 |\n" in text
    assert "| qada_rw@0.6 | 0.600 ± 0.100 | 0.900 | 1 |\n" in text
    assert f"Example answer (qada_rw@0.6): {'w ' * 150!r}\n" in text
    assert "2 samples in all." in text
    for line in ("| dense | 100.0 | 1.00 | 0.000 | 100.0 | 100.0 |",
                 "| qada_rw@0.6 | 100.0 | 1.00 | 0.600 | 100.0 | 100.0 |",
                 "| qada_word@0.6 | 50.0 | 0.50 | 0.400 | 50.0 | 50.0 |"):
        assert line + "\n" in text


# --- the draws: where they place the configurations, the low end of the intervals, the rules they follow -----------


def test_bootstrap_draws_place_configurations_where_their_drawn_samples_put_them():
    """One task of two samples, the configuration keeping dense's score at sparsity 0.4 on sample 0 and 0.6 on sample
    1 (KV read the rest): a draw of sample 0 twice places it at 0.4, of sample 1 twice at 0.6, of both at 0.5, so the
    lossless draws take just these three values (not 0.5 every time, the place on all samples). Likewise the matched
    score at sparsity 0.7 between it (at x) and m@2 (1.0, scoring 0.5 of dense): 1 - 0.5 * (0.7 - x) / (1.0 - x) is
    0.8 on all samples (x = 0.5), 0.75 for sample 0 twice, 0.875 for sample 1 twice."""
    rows = [row("a", i, "dense", 1.0, 0.0) for i in range(2)]
    rows += [row("a", i, "qada_rw@0.6", 1.0, [0.4, 0.6][i]) for i in range(2)]
    boot = records.lossless_draws(rows, ["a"], {"qada_rw": ["qada_rw@0.6"]}, n_boot=200)["qada_rw"]["boot"]
    assert np.unique(np.round(boot, 9)).tolist() == [0.4, 0.5, 0.6]
    rows += [row("a", i, "m@2", 0.5, 1.0) for i in range(2)]
    draws = records.matched_draws(rows, ["a"], {"m": ["qada_rw@0.6", "m@2"]}, "sparsity", (0.7,), n_boot=200)["m"]
    assert draws[0, 0] == pytest.approx(0.8)
    assert np.unique(np.round(draws[1:, 0], 9)).tolist() == [0.75, 0.8, 0.875]


def test_the_low_end_of_the_intervals_is_the_draws_2_5th_percentile():
    """Twelve samples in each of two tasks, dense 1; qada_rw@0.8 keeps it at sparsity 0.5, qada_rw@0.6 (sparsity 0.7)
    scores 0.7 on task a's samples 0 and 1. A draw holding k of those two (k ~ Binomial(12, 1/6)) normalises to
    (1 - 0.3 k / 12 + 1) / 2 = 1 - k / 80, lossless for k <= 4: P(k >= 5) = 3.6 %, between 2.5 % and 5 %, so the 2.5th
    percentile of the lossless draws is 0.5 and their 5th 0.7. At matched sparsity 0.6, halfway, the score is
    1 - k / 160: P(k >= 6) = 0.8 % and P(k >= 4) = 12.5 %, so the 2.5th percentile is k = 5 (0.96875), the 5th k = 4
    (0.975); the 97.5th is k = 0 (P = 11 %), 1.0; the point k = 2, 0.9875."""
    rows = [row(t, i, "dense", 1.0, 0.0) for t in ("a", "b") for i in range(12)]
    rows += [row(t, i, "qada_rw@0.8", 1.0, 0.5) for t in ("a", "b") for i in range(12)]
    rows += [row(t, i, "qada_rw@0.6", 0.7 if t == "a" and i < 2 else 1.0, 0.7) for t in ("a", "b") for i in range(12)]
    sp, = records.lossless_table(rows, ["a", "b"], n_boot=2000)
    assert (sp["lossless"], sp["lo"], sp["hi"]) == pytest.approx((0.7, 0.5, 0.7))
    m, = records.matched_table(rows, ["a", "b"], "sparsity", targets=(0.6,), n_boot=2000)
    assert m[0.6] == pytest.approx((0.9875, 0.96875, 1.0))


def test_a_sample_without_sparsity_is_left_out_of_its_configurations_place():
    """An answer that ended at its first token has no sparsity (None): m@1 at 0.6 on sample 0 and none on sample 1
    sits at 0.6 (not 0.3 as if it were 0, nor nowhere), so at sparsity 0.8, halfway to m@2 (1.0, half of dense's
    score), the matched score is 0.75, on all samples and on every draw that holds sample 0 (one of sample 1 alone
    places m@1 nowhere)."""
    rows = [row("a", i, "dense", 1.0, 0.0) for i in range(2)]
    rows += [row("a", 0, "m@1", 1.0, 0.6), dict(row("a", 1, "m@1", 1.0, 0.6), sparsity=None)]
    rows += [row("a", i, "m@2", 0.5, 1.0) for i in range(2)]
    draws = records.matched_draws(rows, ["a"], {"m": ["m@1", "m@2"]}, "sparsity", (0.8,), n_boot=20)["m"]
    assert draws[0, 0] == pytest.approx(0.75)
    placed = draws[1:, 0][~np.isnan(draws[1:, 0])]
    assert 0 < len(placed) < 20 and placed.tolist() == pytest.approx([0.75] * len(placed))


def test_the_peers_dense_control_and_presses_without_head_sparsity_are_no_rows():
    """hf_dense (lab.peers' dense through transformers) is a control, not a method; a press (no head sparsity) has
    no row on the head-sparsity axis of the matched table, only on the KV-read one."""
    rows = [row("a", i, "dense", 1.0, 0.0) for i in range(2)]
    rows += [row("a", i, "hf_dense", 1.0, 0.0) for i in range(2)]
    rows += [row("a", i, c, 1.0, sp) for i in range(2) for c, sp in (("qada_rw@0.6", 0.5), ("qada_rw@0.2", 0.9))]
    rows += [dict(row("a", i, c, 1.0, 0.0), sparsity=None, kv_read=kv) for i in range(2)
             for c, kv in (("snapkv@0.25", 0.3), ("snapkv@0.75", 0.7))]
    assert list(records.method_configs(rows, ["a"])) == ["qada_rw", "snapkv"]
    assert ([r["method"] for r in records.matched_table(rows, ["a"], "sparsity", targets=(0.7,), n_boot=10)]
            == ["qada_rw"])
    assert [r["method"] for r in records.matched_table(rows, ["a"], "kv_read", targets=(0.5,), n_boot=10)] == [
        "qada_rw", "snapkv"]


def test_the_high_end_of_a_points_interval_is_the_draws_97_5th_percentile():
    """Twelve samples in each of two tasks, dense 0.5 on all; the configuration 0.5 too, but 0.65 on task a's samples
    0 and 1. A draw holding k of those two (k ~ Binomial(12, 1/6)) normalises to ((0.5 + 0.15 k / 12) / 0.5 + 1) / 2
    = 1 + k / 80: P(k >= 6) = 0.8 % and P(k >= 5) = 3.6 %, so the 97.5th percentile is k = 5
    (1.0625), the 95th k = 4 (1.05); the 2.5th k = 0 (P = 11 %), 1.0; the point k = 2, 1.025."""
    rows = [row(t, i, "dense", 0.5, 0.0) for t in ("a", "b") for i in range(12)]
    rows += [row(t, i, "qada_rw@0.6", 0.65 if t == "a" and i < 2 else 0.5, 0.7) for t in ("a", "b") for i in range(12)]
    p = records.score_points(rows, ["a", "b"], "qada_rw@0.6", n_boot=2000)
    assert (p["norm"], p["lo"], p["hi"]) == pytest.approx((1.025, 1.0, 1.0625))


def test_score_points_leave_out_draws_where_dense_scores_0():
    """One task, dense scoring 1 on sample 0 and 0 on sample 1, the configuration 1 on both: on all samples 1 / 0.5 = 2;
    a draw of sample 0 twice gives 1, of both 2, and one of sample 1 twice has no ratio and is left out (not counted as
    0), so the interval is [1, 2]."""
    rows = [row("a", i, "dense", [1.0, 0.0][i], 0.0) for i in range(2)]
    rows += [row("a", i, "qada_rw@0.6", 1.0, 0.7) for i in range(2)]
    p = records.score_points(rows, ["a"], "qada_rw@0.6", n_boot=200)
    assert (p["norm"], p["lo"], p["hi"]) == (2.0, 1.0, 2.0)


def test_means_over_three_tasks_are_means_not_medians():
    """Three tasks, every sample alike (each interval its point): the configuration scores 1, 1 and 0.7 of dense at
    sparsity 0.5, 0.6 and 1.0, so score / dense is (1 + 1 + 0.7) / 3 = 0.9 (the median would be 1) and it sits at
    (0.5 + 0.6 + 1.0) / 3 = 0.7 on all samples and in every draw (the median 0.6): scoring as dense, its lossless
    point and interval are 0.7."""
    tasks = ("a", "b", "c")
    rows = [row(t, i, "dense", 1.0, 0.0) for t in tasks for i in range(3)]
    rows += [row(t, i, "qada_rw@0.6", sc, sp) for t, sc, sp in zip(tasks, (1.0, 1.0, 0.7), (0.5, 0.6, 1.0))
             for i in range(3)]
    p = records.score_points(rows, list(tasks), "qada_rw@0.6", n_boot=20)
    assert (p["norm"], p["lo"], p["hi"]) == pytest.approx((0.9, 0.9, 0.9))
    kept = [dict(r, score=1.0) for r in rows]  # lossless: the point is where the configuration sits
    sp, = records.lossless_table(kept, list(tasks), n_boot=20)
    assert (sp["lossless"], sp["lo"], sp["hi"]) == pytest.approx((0.7, 0.7, 0.7))


def test_a_task_without_records_yet_leaves_the_lossless_point_and_interval_as_they_are():
    """Task b listed but not yet run (no records): task a alone decides, the point 0.7 and its interval [0.7, 0.7]
    (every sample alike), not an interval of NaN from b's empty draws."""
    rows = [row("a", i, "dense", 1.0, 0.0) for i in range(3)]
    rows += [row("a", i, c, 1.0, sp) for i in range(3) for c, sp in (("qada_rw@0.8", 0.5), ("qada_rw@0.6", 0.7))]
    sp, = records.lossless_table(rows, ["a", "b"], n_boot=20)
    assert (sp["lossless"], sp["lo"], sp["hi"], sp["n"]) == pytest.approx((0.7, 0.7, 0.7, 3))


def test_run_recall_by_hand_and_none_where_the_oracle_never_needs_the_whole_context():
    """One tracked run of one layer of 4 heads, 10 steps: QAdA local on heads 0-2 every step (sparsity 0.75), the
    oracle on head 0 alone (0.25), both on head 0. The oracle needs the whole context on heads 1-3 (30 step-heads);
    QAdA labels long head 3's 10 of them, 1/3; static labels at QAdA's own sparsity 0.75 make the 3 most local heads
    (frequencies 0.9, 0.1, 0.8, 0.7: heads 0, 2, 3) local and leave head 1's 10 long, 1/3 (at the oracle's 0.25, head 0
    alone local, all 30). A run where the oracle keeps every head local has no recall (None), and recall_rows gives
    its task no row."""
    run = {"task": "a", "config": "qada_rw@0.6", "steps": 10, "local_freq": [[1.0, 1.0, 1.0, 0.0]],
           "oracle_freq": [[1.0, 0.0, 0.0, 0.0]], "both_freq": [[1.0, 0.0, 0.0, 0.0]]}
    freq = [[0.9, 0.1, 0.8, 0.7]]
    assert records.run_recall(run, freq) == pytest.approx((1 / 3, 1 / 3))
    local = dict(run, oracle_freq=[[1.0] * 4], both_freq=[[1.0, 1.0, 1.0, 0.0]])
    assert records.run_recall(local, freq) is None
    assert records.recall_rows([local], {"a": freq}) == []


def test_summary_rows_and_head_counts_by_hand():
    """summary.md's row of one (task, configuration): the plain mean of each field over its records, the KV read its
    own (not 1 - sparsity: a KV-group path reads more), a sparsity of None (an answer ended at its first token) left
    out. head_counts sums step-weighted frequencies over tracked runs only (an untracked run is left out), and
    curves' sparsity spread is the population std across tasks: 0.6 and 0.8 -> 0.1."""
    recs = [dict(row("a", 0, "qada_kv@0.6", 1.0, 0.8), kv_read=0.5, n_new=2, decode_s=0.1),
            dict(row("a", 1, "qada_kv@0.6", 0.0, 0.8), sparsity=None, kv_read=0.7, n_new=4, decode_s=0.3)]
    (s,) = records.summary_rows(recs)
    assert {k: s[k] for k in ("method", "threshold", "n", "score", "sparsity", "new_tokens")} == {
        "method": "qada_kv", "threshold": 0.6, "n": 2, "score": 0.5, "sparsity": 0.8, "new_tokens": 3.0}
    assert (s["kv_read"], s["decode_s"]) == pytest.approx((0.6, 0.2))
    tracked = {"steps": 10, "local_freq": [[1.0, 0.5]], "oracle_freq": [[0.5, 0.0]], "both_freq": [[0.5, 0.0]]}
    S, q, o, b = records.head_counts([tracked, dict(tracked, steps=30, local_freq=[[0.0, 1.0]]), {"steps": 50}])
    assert S == 40 and q.tolist() == [[10.0, 35.0]] and o.tolist() == [[20.0, 0.0]] and b.tolist() == [[20.0, 0.0]]
    rows = ([row(t, 0, "dense", 1.0, 0.0) for t in "ab"]
            + [row(t, 0, "qada_rw@0.6", 1.0, sp) for t, sp in zip("ab", (0.6, 0.8))])
    assert records.curves(rows, ["a", "b"], ["qada_rw@0.6"])["qada_rw@0.6"]["sparsity_std"] == pytest.approx(0.1)


def test_a_matched_difference_counts_the_samples_both_methods_finished():
    """Dense and qada_rw ran samples 0-2, static samples 0 and 1 only: qada_rw's row against static is on the 2
    samples all of them finished (n 2, not qada_rw's own 3), its score there 1.0 (sample 2, where it scores 0, is
    out) and its difference from static (0.5 of dense at every sparsity) +0.5."""
    rows = [row("a", i, "dense", 1.0, 0.0) for i in range(3)]
    rows += [row("a", i, c, 0.0 if i == 2 else 1.0, sp) for i in range(3)
             for c, sp in (("qada_rw@0.6", 0.5), ("qada_rw@0.2", 0.9))]
    rows += [row("a", i, c, 0.5, sp) for i in range(2) for c, sp in (("static@0.5", 0.5), ("static@0.9", 0.9))]
    got, = records.matched_table(rows, ["a"], "sparsity", targets=(0.7,), against="static", n_boot=20,
                                 methods=["qada_rw"])
    assert (got["n"] == 2 and got[0.7] == pytest.approx((1.0, 1.0, 1.0))
            and got["vs 0.7"] == pytest.approx((0.5, 0.5, 0.5)))


def test_mean_draws_leave_out_a_task_without_values():
    """A task with no values yet is no task of the mean: {a: [1, 3], b: []} gives 2 (task a's mean), and every draw
    is a mean of task a's draws alone (1, 2 or 3), never NaN."""
    point, boot = records.mean_draws({"a": [1.0, 3.0], "b": []}, n_boot=50)
    assert point == 2.0 and len(boot) == 50 and set(boot.tolist()) <= {1.0, 2.0, 3.0}


# --- record keys, names and order, and the agreement counts, by hand ----------------------------------------------


def test_ids_hash_is_the_sha1_of_the_ids_in_their_order():
    """Two prompts pair only on the same token ids in the same order: the hash is SHA-1 of the JSON list as given,
    so a permutation of the ids is another prompt."""
    assert records.ids_hash([3, 1, 2]) == hashlib.sha1(b"[3, 1, 2]").hexdigest()
    assert records.ids_hash((3, 1, 2)) == records.ids_hash([3, 1, 2]) != records.ids_hash([1, 2, 3])


def test_configurations_sort_by_the_papers_order_then_by_threshold_as_a_number():
    """Methods in ORDER's order, a method ORDER does not name after all of them (by name), and a method's
    configurations by their threshold as a number: page budgets 64 < 128 < 1024 (not as text, where "1024" < "64")."""
    cfgs = ["zeta@1", "quest@1024", "quest@64", "alpha@2", "qada_rw@0.6", "dense", "quest@128", "qada_rw@0.05"]
    assert sorted(cfgs, key=records.config_sort_key) == [
        "dense", "qada_rw@0.05", "qada_rw@0.6", "quest@64", "quest@128", "quest@1024", "alpha@2", "zeta@1"]


def test_a_method_without_a_label_is_listed_under_its_own_name():
    """LABEL names the paper's methods; any other (a new path or method) keeps its own name in tables and figures."""
    assert records.label("oracle") == "adaptive oracle" and records.label("qada_new") == "qada_new"


def test_threshold_kinds_tell_tau_curves_from_page_budget_curves():
    """A method is on a tau when any of its records says so (a record without the field does not undo it; a method
    with no records is not); the page methods are those with a page budget, absolute or a fraction of T."""
    rows = [{"method": "qada_rw", "threshold_kind": "tau"}, {"method": "qada_rw"},
            {"method": "quest", "threshold_kind": "budget"}, {"method": "quest_frac", "threshold_kind": "budget_frac"},
            {"method": "snapkv", "threshold_kind": "compression"}]
    assert [records.is_tau(rows, m) for m in ("qada_rw", "quest", "snapkv", "oracle")] == [True, False, False, False]
    assert records.page_methods(rows) == {"quest", "quest_frac"}


def test_a_mean_leaves_out_missing_values_and_is_none_without_any():
    """None (a record without the value) is no 0: [1, None, 3] averages to 2, and only missing values give None."""
    assert records.mean([1.0, None, 3.0]) == 2.0 and records.mean([None, None]) is None and records.mean([]) is None


def test_summary_rows_list_tasks_by_name_then_configurations_in_the_papers_order():
    """summary.md's rows: task by task (by name), each in config_sort_key's order: dense, static before oracle
    (ORDER), quest's budgets 64 before 128 (as numbers), whatever order the records came in."""
    cfgs = ["quest@128", "oracle@0.5", "quest@64", "dense", "static@0.5"]
    rows = [row(t, 0, c, 1.0, 0.0) for t in ("b", "a") for c in cfgs]
    got = [(s["task"], s["config"]) for s in records.summary_rows(rows)]
    order = ["dense", "static@0.5", "oracle@0.5", "quest@64", "quest@128"]
    assert got == [(t, c) for t in ("a", "b") for c in order]


def test_method_configs_are_those_measured_on_the_tasks_asked_for():
    """A method run on another task only (static on b) is no method of task a's tables; dense and local are none."""
    rows = [row("a", 0, c, 1.0, 0.5) for c in ("dense", "local", "qada_rw@0.6", "qada_rw@0.2")]
    rows += [row("b", 0, c, 1.0, 0.5) for c in ("dense", "qada_rw@0.6", "static@0.5")]
    got = records.method_configs(rows, ["a"])
    assert list(got) == ["qada_rw"] and sorted(got["qada_rw"]) == ["qada_rw@0.2", "qada_rw@0.6"]
    assert list(records.method_configs(rows, ["a", "b"])) == ["static", "qada_rw"]


def test_a_method_that_never_keeps_dense_has_no_configuration_at_its_point():
    """Quest-like configurations at head sparsity 0 that all lose (half of dense): no lossless point was found, the
    point is 0 and no configuration is "at" it, though one sits at sparsity 0."""
    rows = [row("a", i, "dense", 1.0, 0.0) for i in range(3)]
    rows += [row("a", i, c, 0.5, sp) for i in range(3) for c, sp in (("m@64", 0.0), ("m@32", 0.5))]
    got = records.lossless_draws(rows, ["a"], {"m": ["m@64", "m@32"]}, n_boot=10)["m"]
    assert (got["found"], got["point"], got["at"], got["open"]) == (False, 0.0, [], False)


def test_a_points_interval_is_drawn_from_its_seed_within_each_task():
    """score_points' draws, redone here: seed's generator picks n of each task's n samples (with replacement), task by
    task, draw by draw; the interval is the 2.5th to 97.5th percentile of score / dense on them."""
    scores = [1.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0, 0.25]
    rows = [row("a", i, "dense", 1.0, 0.0) for i in range(8)]
    rows += [row("a", i, "qada_rw@0.6", s, 0.7) for i, s in enumerate(scores)]
    rng, ours = np.random.default_rng(7), np.array(scores)
    boot = [ours[rng.integers(0, 8, 8)].mean() for _ in range(300)]
    p = records.score_points(rows, ["a"], "qada_rw@0.6", n_boot=300, seed=7)
    assert (p["lo"], p["hi"]) == pytest.approx(tuple(np.percentile(boot, [2.5, 97.5])))
    assert p["norm"] == pytest.approx(np.mean(scores))


def test_measured_points_are_every_configuration_but_the_ablations():
    """analysis.md's table and Fig. 4 hold dense and every configuration, not the ablations' (qada_word, qada_long)."""
    rows = [row("a", i, c, 1.0, 0.5) for i in range(2)
            for c in ("dense", "qada_rw@0.6", "qada_word@0.6", "qada_long@0.6")]
    assert list(records.measured_points(rows, ["a"])) == ["dense", "qada_rw@0.6"]


def test_the_confusion_fractions_by_hand_and_no_negative_true_negatives():
    """QAdA local on 0.4 of the pairs, the oracle on 0.9, both on 0.3: TP 0.3, FP 0.1, FN 0.6 and TN none, exactly 0
    (1 - 0.3 - 0.1 - 0.6 in floating point is an ulp below 0)."""
    tp, fp, tn, fn = records.confusion(0.4, 0.9, 0.3, 1.0)
    assert (tp, fp, fn) == pytest.approx((0.3, 0.1, 0.6)) and tn == 0.0
    assert records.confusion(2.0, 1.0, 1.0, 4.0) == pytest.approx((0.25, 0.25, 0.5, 0.0))


def test_curves_and_points_leave_a_missing_sparsity_out_of_their_means():
    """A sample without a sparsity (its answer ended at its first token) is left out of its configuration's mean
    sparsity, in summary.md's curves and in a figure's point alike: 0.6 from the one sample that has one. The
    curves' KV read is its own mean (0.2 and 0.4: 0.3), not one drawn from the sparsity."""
    rows = [row("a", i, "dense", 1.0, 0.0) for i in range(2)]
    rows += [dict(row("a", 0, "x@1", 1.0, 0.6), kv_read=0.2), dict(row("a", 1, "x@1", 1.0, 0.6), sparsity=None)]
    cur = records.curves(rows, ["a"], ["x@1"])["x@1"]
    assert (cur["sparsity"], cur["kv_read"]) == pytest.approx((0.6, 0.3))
    assert records.score_points(rows, ["a"], "x@1", n_boot=10)["sparsity"] == pytest.approx(0.6)


def test_a_methods_configurations_are_in_config_order_and_a_tied_point_reports_the_first():
    """method_configs lists a method's configurations by threshold (config_sort_key), not in a set's order, which
    changes with each process's string hashing; so where two configurations tie at the lossless point (sparsity 0.5,
    KV reads 0.6 and 0.8), the table reports the first's KV read, 0.6, in every process."""
    cfgs = [f"qada_kv@{t:g}" for t in (0.9, 0.1, 0.7, 0.3, 0.5, 0.2)]
    rows = [row("a", 0, c, 1.0, 0.5) for c in ["dense"] + cfgs]
    assert records.method_configs(rows, ["a"]) == {"qada_kv": sorted(cfgs, key=lambda c: float(c.split("@")[1]))}
    rows = [row("a", i, "dense", 1.0, 0.0) for i in range(3)]
    rows += [dict(row("a", i, c, 1.0, 0.5), kv_read=kv) for i in range(3) for c, kv in (("qada_kv@0.6", 0.8),
                                                                                        ("qada_kv@0.4", 0.6))]
    got, = records.lossless_table(rows, ["a"], n_boot=10)
    assert (got["lossless"], got["kv_read"]) == pytest.approx((0.5, 0.6))


def test_each_method_of_a_figure_has_a_colour_of_its_own():
    """Every method lab.report orders (records.ORDER) is drawn in a colour no other one has (hf_dense is dense's own
    black: kvpress's dense beside ours), and a method it does not know gets a spare colour that is none of theirs."""
    from lab import plots
    colours = [plots.color(m) for m in records.ORDER if m != "hf_dense"]
    assert len(set(colours)) == len(colours)
    assert plots.color("hf_dense") == plots.color("dense")
    assert all(plots.color(f"new_method_{i}") not in colours for i in range(20))
