"""Adding a method is one function and one PATHS entry: a toy path registered in attention.PATHS runs through
generate.py, lab.sweep and lab.report with no other change, and its threshold grid follows from what it reads. A path
that reads an input nobody else reads gets it by name, set with --set NAME=VALUE in both CLIs."""

import json

import pytest
import torch

import attention
from attention import mixed_attention
import generate
from lab import records, report, sweep
from tests.test_generate import make_tiny_dir, write_prompt


def toy(q, k, v, *, n_sink, n_local):
    """The first half of the query heads on their local window, the others on the whole cache."""
    H = q.shape[0]
    labels = torch.arange(H, device=q.device) < H // 2  # (H,) bool, True = local
    return mixed_attention(q, k, v, labels, n_sink, n_local), labels


def toy_tau(q, k, v, *, n_sink, n_local, tau):
    """Every head local when tau >= 0.5, none otherwise: a path whose labels show the tau it was given."""
    labels = torch.full((q.shape[0],), tau >= 0.5, device=q.device)
    return mixed_attention(q, k, v, labels, n_sink, n_local), labels


def toy_share(q, k, v, *, n_sink, n_local, share):
    """A new input, `share`: the first round(share * H) query heads on their local window, the others on the whole
    cache."""
    H = q.shape[0]
    labels = torch.arange(H, device=q.device) < round(share * H)
    return mixed_attention(q, k, v, labels, n_sink, n_local), labels


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_dir(tmp_path_factory.mktemp("tiny_registry"))


@pytest.fixture
def registered(monkeypatch, tmp_path):
    """The toy paths in the one registry (for this test only), and a cache folder of the test's own."""
    monkeypatch.setitem(attention.PATHS, "toy", toy)
    monkeypatch.setitem(attention.PATHS, "toy_tau", toy_tau)
    monkeypatch.setitem(attention.PATHS, "toy_share", toy_share)
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))


def toy_kv_read(lengths, n_local=128):
    """Of the tiny model's 2 KV heads, the first (query heads 0, 1: local) reads its window, the second all T."""
    return sum(min(T, n_local) + T for T in lengths) / sum(2 * T for T in lengths)


def test_generate_runs_a_registered_path(tiny_dir, tmp_path, capsys, registered):
    prompt = str(write_prompt(tmp_path, 300))
    assert generate.main(["--prompt", prompt, "--model", str(tiny_dir), "--method", "toy", "--max-new-tokens", "5",
                          "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["method"] == "toy" and r["tau"] is None and r["moments"] is None  # toy reads neither
    assert r["new_tokens"] == 5 and r["sparsity"] == 0.5 and r["layer_sparsity"] == [0.5, 0.5]
    assert r["kv_read"] == pytest.approx(toy_kv_read([301, 302, 303, 304]), abs=1e-12)


def eval_run(out, tiny_dir, methods, *extra):
    argv = ["--out", str(out), "--tasks", "fwe", "--length", "400", "--samples", "1", "--methods", methods,
            "--ablations", "", "--ctxfree-samples", "0", "--track", "", "--model", str(tiny_dir), "--no-report", *extra]
    assert sweep.main(argv) == 0
    return {r["config"]: r for r in records.read_records(out)}


def test_eval_and_report_run_a_registered_path(tiny_dir, tmp_path, registered):
    out = tmp_path / "run"
    records = eval_run(out, tiny_dir, "dense,toy")
    assert set(records) == {"dense", "toy"}
    r = records["toy"]
    assert (r["path"], r["source"], r["threshold"], r["threshold_kind"]) == ("toy", None, None, None)
    assert r["sparsity"] == 0.5 and r["steps"] == r["n_new"] - 1 >= 1 and r["n_prompt"] > 128
    lengths = [r["n_prompt"] + 1 + i for i in range(r["steps"])]
    assert r["kv_read"] == pytest.approx(toy_kv_read(lengths), abs=1e-12)
    assert records["dense"]["sparsity"] == 0.0 and records["dense"]["kv_read"] == 1.0

    report.report(out)
    summary = (out / "summary.md").read_text()
    assert "| toy | 0.500 |" in summary  # its row in the sparsity table (one task)
    assert (out / "fig4_score_vs_sparsity.png").stat().st_size > 0


def test_the_threshold_grid_follows_what_a_path_reads(tiny_dir, tmp_path, registered):
    assert sweep.threshold_kind("toy_tau") == "tau" and sweep.threshold_kind("toy") is None
    keys = [c.key for c in sweep.build_configs(["toy_tau", "toy"], [0.3, 0.7], [0.5])]
    assert keys == ["toy_tau@0.3", "toy_tau@0.7", "toy"]
    records = eval_run(tmp_path / "run", tiny_dir, "toy_tau,toy", "--taus", "0.3,0.7")
    assert set(records) == {"toy_tau@0.3", "toy_tau@0.7", "toy"}
    assert records["toy"]["threshold"] is None and records["toy"]["threshold_kind"] is None
    for tau, sparsity in ((0.3, 0.0), (0.7, 1.0)):  # the grid's tau reached the path
        r = records[f"toy_tau@{tau:g}"]
        assert (r["threshold"], r["threshold_kind"], r["sparsity"]) == (tau, "tau", sparsity)


def test_a_path_with_a_new_input_runs_through_generate_the_sweep_and_the_report(tiny_dir, tmp_path, capsys,
                                                                                 registered):
    prompt = str(write_prompt(tmp_path, 300))
    argv = ["--prompt", prompt, "--model", str(tiny_dir), "--method", "toy_share", "--max-new-tokens", "5", "--json"]
    for share, sparsity in ((0.5, 0.5), (0.25, 0.25)):  # the value reaches the path: 2 or 1 of 4 heads local
        assert generate.main(argv + ["--set", f"share={share}"]) == 0
        r = json.loads(capsys.readouterr().out)
        assert r["method"] == "toy_share" and r["sparsity"] == sparsity and r["new_tokens"] == 5

    # unset, misspelt, or set for a path that does not read it: one line naming the input, exit 2
    assert generate.main(argv) == 2 and "reads share" in capsys.readouterr().err
    assert generate.main(argv + ["--set", "shar=0.5"]) == 2 and "--set shar: the toy_share path does not read it" in \
        capsys.readouterr().err
    assert generate.main(argv + ["--set", "tau=0.5"]) == 2 and "flag of its own" in capsys.readouterr().err

    out = tmp_path / "run"
    found = eval_run(out, tiny_dir, "dense,toy_share", "--set", "share=0.25")
    assert found["toy_share"]["sparsity"] == 0.25 and found["dense"]["sparsity"] == 0.0
    assert json.loads((out / "run.json").read_text())["settings"]["inputs"] == {"share": 0.25}
    report.report(out)
    assert "| toy_share | 0.250 |" in (out / "summary.md").read_text()
    capsys.readouterr()
    assert sweep.main(["--out", str(tmp_path / "other"), "--methods", "dense", "--set", "share=0.5",
                       "--model", str(tiny_dir)]) == 2
    assert "--set share: no path of --methods reads it" in capsys.readouterr().err


def test_the_readmes_snippet_runs_as_written(tiny_dir, tmp_path, capsys, monkeypatch):
    """README's "Adding a method" code, executed where it says to put it (attention.py's namespace), registers a path
    that generate.py then runs; its labels are what the snippet says."""
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Adding a method", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.setattr(attention, "PATHS", dict(attention.PATHS))  # the registration is this test's only
    monkeypatch.setattr(generate, "PATHS", attention.PATHS)
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    exec(code, vars(attention))
    name = re.search(r'PATHS\["(\w+)"\]', code).group(1)
    assert generate.main(["--prompt", str(write_prompt(tmp_path, 300)), "--model", str(tiny_dir), "--method", name,
                          "--max-new-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sparsity"] == 0.5  # half the query heads local at every step


def test_a_misspelt_method_or_an_input_left_none_is_refused_when_the_attention_is_made(registered):
    """In Python as on the command line: a misspelt method is told the registered ones, and an input handed as None
    (a keyword left unset) is missing, not given, before any step is decoded."""
    with pytest.raises(ValueError, match="unknown method 'toy_shar'; choose from .*toy_share"):
        attention.DecodeAttention("toy_shar")
    with pytest.raises(ValueError, match="the toy_share path reads share; give --set share=VALUE"):
        attention.DecodeAttention("toy_share", 4, 16, dict(share=None))
    assert attention.DecodeAttention("toy_share", 4, 16, dict(share=0.5)).inputs == dict(n_sink=4, n_local=16,
                                                                                          share=0.5)
