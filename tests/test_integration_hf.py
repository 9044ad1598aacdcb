"""integrations/transformers.py: greedy generation through transformers' `generate` with the adapter against our own
model on the same weights (the same tokens, the same labels at every step, layer and head), Option 2's reference keys
through the adapter against moments.ReferenceKeys', transformers models our loader never read, left-padded batches
against each row alone, the refusals, and lab.calibrate --hf against --model."""

import dataclasses
import gc
import json
import re
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from attention import build_attention, path_inputs  # noqa: E402
from criterion import Calibration, load_calibration, save_calibration, weights_probe  # noqa: E402
from generate import decode, default_tau  # noqa: E402
from integrations.transformers import HFAttention, HFModel, disable, enable, left_padding, load  # noqa: E402
from lab import calibrate  # noqa: E402
from model import KVCache, load_model  # noqa: E402
from moments import FixedMoments, ReferenceKeys  # noqa: E402
from tests.test_generate import make_tiny_dir  # noqa: E402
from tests.test_model import TINY  # noqa: E402
from weights.checkpoints import MODELS, shipped_calibration  # noqa: E402
from weights.tokenizer import Tokenizer  # noqa: E402

PROMPT, NEW, TAU = 300, 10, 0.4  # past the 128-token window; at tau 0.4 this model's heads are mixed (checked below)


@pytest.fixture(scope="module", autouse=True)
def cache_root(tmp_path_factory):
    """Option 2's reference keys go to a fresh cache of this module."""
    mp = pytest.MonkeyPatch()
    mp.setenv("QADA_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory):
    """The tiny random Llama of test_generate (2 layers, 4 query heads, 2 KV heads) with its q and k weights scaled by
    4: a random model at init attends almost uniformly, so every head's window share would be ~128/T and every label
    the same; sharper scores make the labels differ between heads, layers and steps."""
    path = make_tiny_dir(tmp_path_factory.mktemp("sharp"))
    state = load_file(path / "model.safetensors")
    state = {k: v * 4 if "q_proj" in k or "k_proj" in k else v for k, v in state.items()}
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


def hf_model(folder_or_config, cls=None):
    """A transformers causal LM (from a folder, or random from a config) in eval mode, greedy to the last token: no
    EOS (our decode is given none either)."""
    if cls is None:
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder_or_config, dtype=torch.float32)
    else:
        torch.manual_seed(0)
        hf = cls(folder_or_config)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def prompt_ids(n: int = PROMPT, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 100, (1, n), generator=torch.Generator().manual_seed(seed))


def generate_hf(hf, ids, mask=None, new: int = NEW) -> list[list[int]]:
    """transformers' greedy generate: the new tokens of each row."""
    mask = torch.ones_like(ids) if mask is None else mask
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    return out[:, ids.shape[1]:].tolist()


def generate_ours(ours, tok, ids, method, moments_source, tau, calibration, new: int = NEW, **inputs):
    """generate.py's decoding on our model: the new tokens and the attention (its labels in stats)."""
    cache = ours.new_cache(ids.shape[1] + new)
    logits = ours.prefill(ids, cache)
    reference = ReferenceKeys(ours, tok, "random", progress=False)
    att = build_attention(method, cache, moments_source=moments_source, reference=reference, tau=tau,
                          calibration=calibration, **inputs)
    return decode(ours, cache, logits, new, att), att


def random_calibration(L=2, H=4, Hkv=2, seed=0, taus=None) -> Calibration:
    g = torch.Generator().manual_seed(seed)
    return Calibration(torch.randn(L, H, generator=g) * 0.3, torch.rand(L, H, generator=g) + 0.5,
                       torch.rand(L, Hkv, generator=g) + 0.5,
                       {"moments_source": "random-words", "operating_tau": taus or {}})


CASES = [("dense", None, False), ("qada", "random-words", False), ("qada", "prompt", False),
         ("qada_kv_all", "prompt-online", False), ("qada_cal", "random-words", True),
         ("qada_kv_all_cal", "random-words", True), ("quest", None, False),
         ("qada_pages", "random-words", True)]  # None: the path reads no moments


@pytest.mark.parametrize("method,moments_source,calibrated", CASES)
def test_greedy_generation_equals_ours_token_and_label(sharp_dir, tmp_path, method, moments_source, calibrated):
    """The adapter inside transformers' generate against generate.py's decoding on our model, same weights and
    prompt: the same tokens, the same (step, layer, head) labels and, for a page path (a budget of 64 tokens), the
    same entries read. A calibrated path runs at the operating point stored with its correction (tau not given),
    read from a file."""
    ours, tok, hf = load_model(sharp_dir), Tokenizer.from_dir(sharp_dir), hf_model(sharp_dir)
    ids = prompt_ids()
    calibration = None
    if calibrated:
        calibration = tmp_path / "affine.json"
        save_calibration(calibration, random_calibration(taus={method: TAU}))
    c = load_calibration(calibration) if calibrated else None
    tau = default_tau(method, c)[0] if calibrated else (TAU if "tau" in path_inputs(method) else None)
    pages = {"budget": 64} if "pages" in path_inputs(method) else {}
    attention = enable(hf, method, tau=None if calibrated else tau, calibration=calibration, moments=moments_source,
                       tokenizer=tok, **pages)
    got = generate_hf(hf, ids)[0]
    want, att = generate_ours(ours, tok, ids, method, moments_source, tau, c, **pages)
    assert attention.tau == tau and (attention.tau_from == "the calibration's operating point") == calibrated
    assert got == want
    labels, ours_labels = attention.rows[0].stats.label_tensor(), att.stats.label_tensor()
    assert labels.shape == (NEW - 1, 2, 4) and torch.equal(labels, ours_labels)
    assert attention.rows[0].stats.lengths == att.stats.lengths == list(range(PROMPT + 1, PROMPT + NEW))
    if pages:
        assert torch.equal(torch.stack([torch.stack(s) for s in attention.rows[0].stats.reads]),
                           torch.stack([torch.stack(s) for s in att.stats.reads]))
    if method not in ("dense", "quest"):  # labels that differ between heads and layers: a layer off by one shows
        assert 0 < labels.float().mean() < 1 and not torch.equal(labels[:, 0], labels[:, 1])
    report = attention.report()
    assert f"method {method}" in report and f"{NEW - 1} decode steps" in report
    summary = attention.summary()
    assert summary["sparsity"] == pytest.approx(labels.double().mean().item())
    assert summary["kv_read"] == pytest.approx(att.stats.summary(2)["kv_read"])
    disable(hf)


def test_reference_keys_through_the_adapter_equal_ours(sharp_dir):
    """Option 2's keys, taken by the adapter's attention function from a transformers forward pass, against
    moments.ReferenceKeys on our model; kept on disk under the transformers model's own identity."""
    ours, tok, hf = load_model(sharp_dir), Tokenizer.from_dir(sharp_dir), hf_model(sharp_dir)
    logging = transformers.utils.logging
    logging.set_verbosity_warning()  # transformers' default, whatever an earlier test left
    attention = enable(hf, "qada", tau=TAU, tokenizer=tok)
    assert logging.get_verbosity() == logging.WARNING  # quiet only while it tokenized the reference prompt
    got = attention.reference.ensure(PROMPT)
    want = ReferenceKeys(ours, tok, "random", progress=False).ensure(PROMPT)
    assert got.shape == want.shape == (2, 2, PROMPT, 16)  # (L, Hkv, N, D)
    assert attention.reference.length == 512  # the pass ran as far as ReferenceKeys rounds: the context of 512
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    mine, theirs = attention.reference.for_prompt(PROMPT), ReferenceKeys(ours, tok, "random").for_prompt(PROMPT)
    for layer in range(2):
        for a, b in zip(mine.mean_cov(layer, None), theirs.mean_cov(layer, None)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert attention.reference.path.is_file() and attention.reference.settings["model"]["runner"] == "transformers"
    disable(hf)
    again = enable(hf, "qada", tau=TAU, tokenizer=tok)  # a second enable reads the keys from disk
    assert again.reference.length == 512 and again.reference.passes == 0
    disable(hf)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_a_random_transformers_model_runs_through_enable_and_generate(sharp_dir, name):
    """A model our loader never read: a random LlamaForCausalLM or Qwen2ForCausalLM (biases, one KV head) built from
    a config. Dense through the adapter gives transformers' own tokens; the default method runs with a correction."""
    cls, cfg = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**TINY)),
                "qwen2": (transformers.Qwen2ForCausalLM,
                          transformers.Qwen2Config(**dict(TINY, num_key_value_heads=1)))}[name]
    hf, tok, ids = hf_model(cfg, cls), Tokenizer.from_dir(sharp_dir), prompt_ids(200)
    plain = generate_hf(hf, ids, new=8)
    enable(hf, "dense")
    assert generate_hf(hf, ids, new=8) == plain
    disable(hf)
    Hkv = cfg.num_key_value_heads
    attention = enable(hf, calibration=random_calibration(Hkv=Hkv, taus={"qada_cal": 0.3}), tokenizer=tok)
    assert attention.method == "qada_cal" and attention.tau == 0.3  # the recommended method, as generate.py's README
    generate_hf(hf, ids, new=8)
    assert attention.summary()["steps"] == 7 and attention.rows[0].stats.label_tensor().shape == (7, 2, 4)
    head, line = attention.report().splitlines()
    assert head.endswith(", calibration given") and line.startswith("heads labelled local (sparsity)")
    disable(hf)
    assert hf.config._attn_implementation == "sdpa" and generate_hf(hf, ids, new=8) == plain


def test_a_mistral_whose_window_is_its_context_decodes(sharp_dir):
    """A Mistral whose sliding window is as long as its context never slides: enable() takes it, as model.py does, and
    transformers hands each layer that window at every decode step, which the adapter does not refuse. Dense through
    the adapter gives transformers' own tokens; a window shorter than the keys held is refused (below)."""
    cfg = transformers.MistralConfig(**dict(TINY, sliding_window=TINY["max_position_embeddings"]))
    hf, tok, ids = hf_model(cfg, transformers.MistralForCausalLM), Tokenizer.from_dir(sharp_dir), prompt_ids(200)
    plain = generate_hf(hf, ids, new=8)
    enable(hf, "dense")
    assert generate_hf(hf, ids, new=8) == plain
    disable(hf)
    attention = enable(hf, "qada", tau=TAU, tokenizer=tok)
    generate_hf(hf, ids, new=8)
    assert attention.summary()["steps"] == 7
    disable(hf)


@pytest.mark.parametrize("method, moments", [("qada", None), ("qada", "prompt"), ("quest", None)])
def test_left_padded_rows_decode_as_each_alone(sharp_dir, method, moments):
    """Two prompts of different lengths, left-padded into one batch: each row's tokens, labels and KV entries read
    are its own run's, with the reference prompt's moments, with the prompt's own (Option 1, from each row's keys
    past its padding) and with Quest's page index (built from them too). Right padding is refused with one line."""
    tok, hf = Tokenizer.from_dir(sharp_dir), hf_model(sharp_dir)
    long, short = prompt_ids(PROMPT, 1), prompt_ids(PROMPT - 40, 2)
    tau = 0.5 if moments == "prompt" else TAU  # where this model's heads are mixed under the prompt's own moments
    given = dict(tau=tau, moments=moments, tokenizer=tok) if method == "qada" else dict(budget=32)
    attention = enable(hf, method, **given)
    alone = []
    for ids in (long, short):
        tokens = generate_hf(hf, ids)[0]
        stats = attention.rows[0].stats
        alone.append((tokens, stats.label_tensor(), stats.read_tensor()))
    ids = torch.cat([long, torch.cat([torch.zeros(1, 40, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    batch = generate_hf(hf, ids, mask)
    for b, (tokens, labels, read) in enumerate(alone):
        assert batch[b] == tokens
        assert torch.equal(attention.rows[b].stats.label_tensor(), labels)
        got = attention.rows[b].stats.read_tensor()  # what a page path reports reading (None for the others)
        assert (got is None and read is None) if method == "qada" else torch.equal(got, read)
    if method == "qada":
        assert 0 < alone[1][1].float().mean() < 1
    right = torch.cat([short, torch.zeros(1, 40, dtype=torch.long)], 1)
    with pytest.raises(ValueError, match="padded on the left") as e:
        generate_hf(hf, torch.cat([long, right]), torch.cat([torch.ones_like(long), mask[1:].flip(1)]))
    assert "\n" not in str(e.value)
    disable(hf)


def test_the_report_states_each_rows_numbers_and_outlives_disable(sharp_dir, tmp_path):
    """report(): the method, its tau and where it came from, the moments (by default a correction's own), the
    correction's file and the rest of what the path reads (a page budget, a window not the paper's), then one line per
    row of the last generation with that row's summary; the same after disable() (the statistics stay)."""
    tok, hf = Tokenizer.from_dir(sharp_dir), hf_model(sharp_dir)
    long, short = prompt_ids(PROMPT, 1), prompt_ids(PROMPT - 40, 2)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 40, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :40] = 0

    def lines(attention, rows):
        return [f"{prefix}heads labelled local (sparsity) {s['sparsity']:.3f} | KV entries read {s['kv_read']:.3f} | "
                f"{NEW - 1} decode steps" for prefix, s in
                ((f"row {b}: " if rows > 1 else "", attention.summary(b)) for b in range(rows))]

    attention = enable(hf, "qada", tau=0.5, moments="prompt")
    generate_hf(hf, ids, mask)
    s0, s1 = attention.summary(0), attention.summary(1)
    assert s0["sparsity"] != s1["sparsity"] and s0["sparsity"] != s0["kv_read"]  # each number tells its own
    want = "\n".join(["method qada at tau 0.5 (given), prompt moments"] + lines(attention, 2)
                     + ["(each row counted to the batch's last step, past its own end: report(sequences), with "
                        "generate's output, stops each row at its end-of-sequence token)"])
    assert attention.report() == want
    disable(hf)
    assert attention.report() == want and attention.summary(1) == s1
    save_calibration(tmp_path / "affine.json", random_calibration(taus={"qada_cal": TAU}))
    attention = enable(hf, "qada_cal", calibration=tmp_path / "affine.json", tokenizer=tok)
    generate_hf(hf, long)
    assert attention.report() == "\n".join([f"method qada_cal at tau {TAU} (the calibration's operating point), "
                                            "random-words moments, calibration affine.json"] + lines(attention, 1))
    disable(hf)
    fitted = random_calibration(taus={"qada_cal": TAU})  # fitted on the prompt's moments: those it is run with
    fitted.settings["moments_source"] = "prompt"
    attention = enable(hf, "qada_cal", calibration=fitted)
    generate_hf(hf, long)
    assert attention.report().splitlines()[0] == (f"method qada_cal at tau {TAU} (the calibration's operating point), "
                                                  "prompt moments, calibration given")
    disable(hf)
    attention = enable(hf, "quest", budget=64, n_local=96)  # what else the path read, as generate.py's report says
    generate_hf(hf, long)
    assert attention.report().splitlines()[0] == "method quest, budget 64, n_local 96"
    disable(hf)


def test_report_of_the_sequences_counts_each_row_to_its_end(sharp_dir):
    """transformers keeps decoding a batch row that has ended (on padding) until every row has: report(sequences) counts
    each row up to its end-of-sequence token, as that row decoded alone, which report() without them does not (it says
    so); the token is the model's generation_config's when reported, not when enabled. Sequences of another shape, no
    EOS to look for, or an eos_token_id that is no token id nor a list of them, are refused with one line."""
    long, short = prompt_ids(PROMPT, 1), prompt_ids(PROMPT - 40, 2)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 40, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    hf = hf_model(sharp_dir)
    first, second = generate_hf(hf, ids, mask)
    k, eos = next((i, t) for i, t in enumerate(second) if i > 2 and t not in first and t not in second[:i])
    attention = enable(hf, "qada", tau=0.5, moments="prompt")
    hf.generation_config.eos_token_id = eos  # after enable(): read when reported. Row 1 ends at new token k, row 0 not
    generate_hf(hf, short)
    alone = attention.summary()
    assert alone["steps"] == k
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert out[1, ids.shape[1] + k] == eos and out.shape[1] == ids.shape[1] + NEW
    assert attention.summary(1)["steps"] == NEW - 1 and attention.summary(1, out) == alone
    assert attention.summary(0, out) == attention.summary(0) and attention.summary(0)["steps"] == NEW - 1
    assert attention.report(out).splitlines()[2] == (f"row 1: heads labelled local (sparsity) {alone['sparsity']:.3f}"
                                                     f" | KV entries read {alone['kv_read']:.3f} | {k} decode steps")
    assert attention.report().splitlines()[-1].startswith("(each row counted to the batch's last step")
    assert len(attention.report(out).splitlines()) == 3
    for bad, message in ((out[:1], "sequences: generate's output for the last generation"),
                         (out[:, :ids.shape[1]], "sequences: generate's output"),
                         (out.tolist(), "got list")):
        with pytest.raises(ValueError, match=message):
            attention.report(bad)
    hf.generation_config.eos_token_id = None
    with pytest.raises(ValueError, match="names no eos_token_id"):
        attention.report(out)
    assert attention.summary(1, out, eos_token_id=eos) == alone
    for bad in (str(eos), float(eos), torch.tensor([eos, 0]), [eos, None]):  # the argument named, not torch.tensor's
        with pytest.raises(ValueError, match="^eos_token_id: a token id or a list of them, got ") as e:
            attention.report(out, eos_token_id=bad)
        assert "\n" not in str(e.value)
    assert attention.summary(1, out, eos_token_id=[eos]) == alone
    disable(hf)
    del hf
    gc.collect()  # the adapter holds the model weakly: gone, its end-of-sequence token is asked for
    with pytest.raises(ValueError, match="the model is gone"):
        attention.report(out)
    assert attention.summary(1, out, eos_token_id=eos) == alone


def test_report_of_sequences_from_inputs_embeds_counts_each_row_to_its_end(sharp_dir):
    """generate from inputs_embeds returns the new tokens only, no prompt: report(sequences) counts each row to its end
    in them as in the prompt-then-new output of the same generation from input_ids (where it passed over a prompt's
    length of new tokens, more new tokens than the prompt has: a row's end there went unseen). Other widths are
    refused with one line naming both."""
    hf, ids, new = hf_model(sharp_dir), torch.cat([prompt_ids(20, 3), prompt_ids(20, 4)]), 30
    first, second = generate_hf(hf, ids, new=new)
    k, eos = next((i, t) for i, t in enumerate(second) if 2 < i and t not in first + second[:i] + [0])  # 0: padding
    hf.generation_config.eos_token_id = eos  # row 1 ends at new token k, row 0 not
    attention = enable(hf, "dense")
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    want = [attention.summary(b, out) for b in range(2)]
    assert want[1]["steps"] == k and want[0]["steps"] == new - 1
    embeds = hf.generate(inputs_embeds=hf.get_input_embeddings()(ids), attention_mask=torch.ones_like(ids),
                         max_new_tokens=new, do_sample=False)
    assert torch.equal(embeds, out[:, ids.shape[1]:])
    assert [attention.summary(b, embeds) for b in range(2)] == want
    assert attention.report(embeds) == attention.report(out)
    with pytest.raises(ValueError, match=r"\(2, 50\) token ids .*; \(2, 30\) from inputs_embeds, .*got \(2, 29\)$"):
        attention.report(embeds[:, 1:])
    disable(hf)


def test_a_one_token_prompt_is_a_prefill(sharp_dir):
    """A prompt of one token (BOS, say) is one query on a cache of one key: a prefill, dense, not a decode step; the
    steps after it decode (within the window: dense's tokens)."""
    hf, ids = hf_model(sharp_dir), prompt_ids(1)
    plain = generate_hf(hf, ids)
    attention = enable(hf, "qada", tau=TAU, moments="prompt")
    assert generate_hf(hf, ids) == plain and attention.summary()["steps"] == NEW - 1
    disable(hf)


def test_what_a_decode_step_refuses(sharp_dir):
    """Forward passes on one DynamicCache, as generate's variants make them: a cache cut back to the very length of the
    last pass of several tokens (an assisted decoder rejecting a candidate), a padding other than the prompt's, and
    a layer whose scores are scaled otherwise than by 1/sqrt(D) are refused with one line."""
    hf, ids = hf_model(sharp_dir), prompt_ids(200)
    enable(hf, "qada", tau=TAU, moments="prompt")

    def forward(ids, cache, mask=None):  # the cache by position: past_key_values before transformers 5.25, then cache
        with torch.no_grad():
            return hf(ids, mask, None, cache)

    cache = transformers.DynamicCache(config=hf.config)
    forward(ids, cache)
    forward(prompt_ids(3, 1), cache)  # three tokens in one pass: a candidate and two more
    cache.crop(-1)  # the last rejected: the next token goes where the pass's last one was
    with pytest.raises(ValueError, match="cut back, as assisted and prompt-lookup decoding do") as e:
        forward(prompt_ids(1, 2), cache)
    assert "\n" not in str(e.value)
    padded = torch.cat([torch.zeros(1, 8, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 8, dtype=torch.long), torch.ones_like(ids)], 1)
    cache = transformers.DynamicCache(config=hf.config)
    forward(padded, cache, mask)
    with pytest.raises(ValueError, match="padded on the left"):  # the padding attended at the next step
        forward(prompt_ids(1, 2), cache, torch.ones(1, padded.shape[1] + 1, dtype=torch.long))
    hf.model.layers[1].self_attn.scaling = 0.5
    with pytest.raises(ValueError, match="layer 1 scales its scores by 0.5, the paths by 1/sqrt\\(16\\)"):
        generate_hf(hf, ids, new=2)
    disable(hf)


def test_static_labels_and_moments_of_the_callers_equal_ours(sharp_dir):
    """What enable takes beside a method's name, read as our paths read it: static labels (a bool tensor of the
    model's (layers, heads)) and a KeyMoments object of the caller's in place of a moments source. The same tokens
    and the same labels as generate.py's decoding with those very labels and moments; the static path's labels are
    the given ones at every step, and the report says the moments were given."""
    ours, tok, hf = load_model(sharp_dir), Tokenizer.from_dir(sharp_dir), hf_model(sharp_dir)
    ids = prompt_ids()
    local = torch.tensor([[True, False, False, True], [False, True, True, False]])
    attention = enable(hf, "static", static_local=local)
    got = generate_hf(hf, ids)[0]
    want, att = generate_ours(ours, tok, ids, "static", None, None, None, static_local=local)
    labels = attention.rows[0].stats.label_tensor()
    assert got == want and torch.equal(labels, att.stats.label_tensor())
    assert torch.equal(labels, local.expand(NEW - 1, -1, -1))
    disable(hf)
    g = torch.Generator().manual_seed(5)
    moments = FixedMoments(torch.randn(2, 2, 16, generator=g), torch.eye(16).expand(2, 2, 16, 16) * 0.5, 100)
    attention = enable(hf, "qada", tau=TAU, moments=moments)
    got = generate_hf(hf, ids)[0]
    want, att = generate_ours(ours, tok, ids, "qada", None, TAU, None, moments=moments)
    assert got == want and torch.equal(attention.rows[0].stats.label_tensor(), att.stats.label_tensor())
    assert ", given moments" in attention.report()
    disable(hf)


def test_what_a_decode_call_refuses_before_it_decodes(sharp_dir):
    """The attention function called by hand as transformers would call it for one decode step: a layer with a
    sliding window or a softcap, which no path models, and a decode step with no prefill of this prompt before it
    (another cache than transformers' DynamicCache), each refused with one line. Before any generation the report
    says no decode step ran."""
    hf = hf_model(sharp_dir)
    attention = enable(hf, "qada", tau=TAU, moments="prompt")
    assert attention.summary() == {"steps": 0, "sparsity": None, "kv_read": None, "layer_sparsity": []}
    assert attention.report().splitlines()[1:] == ["no decode step ran"]
    module = hf.model.layers[0].self_attn
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 200, 16)
    for option in ({"sliding_window": 64}, {"softcap": 30.0}):
        with pytest.raises(ValueError, match="layer 0 has a sliding window or a softcap: not supported"):
            attention(module, q, k, k, None, **option)
    with pytest.raises(ValueError, match="saw no prefill of this prompt"):
        attention(module, q, k, k, None)
    disable(hf)


def test_left_padding_reads_a_bool_or_a_float_mask():
    """Each row's first attended position from transformers' 4D mask at its last query, whether it marks attended
    positions True or adds 0 to them (and -inf elsewhere); None without padding; one line for a hole in a row."""
    attended = torch.ones(2, 1, 3, 6, dtype=torch.bool).tril(3)  # causal: the last query attends to every position
    attended[1, :, :, :2] = False  # row 1 padded by two
    additive = torch.zeros(attended.shape).masked_fill(~attended, -torch.inf)
    assert left_padding(attended, 6) == left_padding(additive, 6) == [0, 2]
    assert left_padding(attended[:1], 6) is None and left_padding(None, 6) is None
    attended[0, :, :, 3] = False  # a hole: right padding, or a static cache's unfilled positions
    with pytest.raises(ValueError, match="padded on the left"):
        left_padding(torch.zeros(attended.shape).masked_fill(~attended, -torch.inf), 6)


def test_the_reference_keys_on_disk_are_keyed_by_the_models_weights_config_and_dtype(sharp_dir):
    """HFModel.identity names a transformers model's keys for ReferenceKeys' file: the same for the same model loaded
    again, another for changed weights, config or dtype (another model's moments would be served otherwise)."""
    a, b = load(str(sharp_dir))[0], load(str(sharp_dir))[0]
    assert a.identity == b.identity
    c = load(str(sharp_dir))[0]
    with torch.no_grad():
        c.hf.model.layers[0].self_attn.k_proj.weight.mul_(2)
    d = load(str(sharp_dir))[0]
    d.cfg = dataclasses.replace(d.cfg, rope_theta=2 * d.cfg.rope_theta)
    e = load(str(sharp_dir), dtype=torch.float64)[0]  # the same values as float32: only the dtype differs
    assert e.dtype == torch.float64 and e.identity["dtype"] == "float64"
    assert len({json.dumps(m.identity, sort_keys=True) for m in (a, c, d, e)}) == 4


def test_gpt2_is_refused_with_one_line():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    before = gpt2.config._attn_implementation
    with pytest.raises(ValueError) as e:
        enable(gpt2, "qada", tau=0.6, moments="prompt")
    assert str(e.value).startswith("GPT2LMHeadModel (model_type 'gpt2') is not a Llama-family decoder")
    assert "\n" not in str(e.value) and gpt2.config._attn_implementation == before


def test_enable_says_a_kernel_choice_that_cannot_run(sharp_dir, monkeypatch):
    """QADA_KERNEL is checked when QAdA is enabled, in one line, not inside generate's first decode step."""
    hf = hf_model(sharp_dir)
    monkeypatch.setenv("QADA_KERNEL", "bogus")
    with pytest.raises(ValueError, match="QADA_KERNEL takes auto, triton or torch; got 'bogus'"):
        enable(hf, "qada", tau=0.6, moments="prompt")
    monkeypatch.setenv("QADA_KERNEL", "triton")
    monkeypatch.setattr("decode_kernels.triton", None)
    with pytest.raises(ValueError, match="QADA_KERNEL=triton: triton is not installed"):
        enable(hf, "qada", tau=0.6, moments="prompt")
    assert hf.config._attn_implementation == "sdpa"


def test_what_enable_and_disable_refuse(sharp_dir, tmp_path):
    hf, tok = hf_model(sharp_dir), Tokenizer.from_dir(sharp_dir)
    c = random_calibration()
    fitted = Calibration(c.a, c.b, c.s, dict(c.settings, n_sink=16, n_local=128))  # a correction of another window
    # one fitted on the same shape's other weights, the plain tiny model's: told by the probe alone
    probe = weights_probe(load_model(make_tiny_dir(tmp_path / "plain")))
    elsewhere = Calibration(c.a, c.b, c.s, dict(c.settings, weights_probe=probe, model="plain"))
    assert weights_probe(hf) == weights_probe(load_model(sharp_dir))  # transformers' names are model.Llama's
    unshipped = next(m for m in MODELS if shipped_calibration(m) is None)  # a named model with no correction
    for kwargs, message in [(dict(method="qada_cal", tokenizer=tok), "reads a calibration"),
                            (dict(method="dense", tau=0.5), "tau: the dense path does not read it"),
                            (dict(method="nope"), "unknown method 'nope'"),
                            (dict(method="qada"), "give enable\\(model, tokenizer=...\\)"),
                            (dict(method="qada", tau=1.5, moments="prompt"), "tau"),
                            (dict(method="qada", moments="other"), "unknown moments source"),
                            (dict(method="quest"), "the quest path reads budget: give enable\\(model, 'quest', "
                                                   "budget=...\\)"),
                            (dict(method="static"), "the static path reads static_local: give"),
                            (dict(method="qada_cal", tokenizer=tok, calibration=random_calibration(L=3)),
                             "the model has \\(2, 4\\)"),
                            (dict(method="qada", tau="0.5", moments="prompt"), "tau must be a number"),
                            (dict(method="qada", tau=0.5, moments=123), "moments: a name of moments.SOURCES"),
                            (dict(method="qada", tau=0.5, moments="prompt", n_sink=128), "0 <= n_sink < n_local"),
                            (dict(method="local", moments="prompt"), "moments: the local path does not read it"),
                            (dict(method="quest", budget="abc"), "budget is a number, got 'abc'"),  # was at the
                            (dict(method="quest", budget=-5), "budget is a number of tokens >= 0"),  # first step
                            (dict(method="quest_frac", budget_frac=2.0), "budget_frac"),
                            (dict(method="qada", tokenizer="x"), "tokenizer: the model's tokenizer"),
                            (dict(method="static", static_local=torch.ones(2, 2, dtype=torch.bool)),
                             "static_local: a bool tensor \\(layers, heads\\) = \\(2, 4\\)"),
                            (dict(method="qada", tau=0.5, moments="prompt", calibration=random_calibration()),
                             "calibration: the qada path does not read it"),
                            (dict(method="qada_cal", calibration=random_calibration(), moments="prompt"),
                             "corrects the random-words moments' estimate"),
                            (dict(method="qada_cal", tokenizer=tok, calibration=fitted, n_sink=4, n_local=64),
                             "was fitted with n_sink 16, not 4"),
                            (dict(method="qada_cal", tokenizer=tok, calibration=elsewhere),
                             "the given calibration was fitted on other weights than this model's "
                             "\\(those of plain\\)"),
                            (dict(method="qada_sampled_cal", calibration=random_calibration()),
                             "corrects the gaussian estimate of the bulk mass"),
                            (dict(method="qada_cal", tokenizer=tok, calibration="qwen2.5-coder-0.5b"),
                             "qwen2.5-coder-0.5b.json corrects \\(24, 14\\) heads; the model has \\(2, 4\\)"),
                            (dict(method="qada_cal", tokenizer=tok, calibration=unshipped),
                             f"{unshipped} ships no calibration")]:
        with pytest.raises(ValueError, match=message):
            enable(hf, **kwargs)
        assert hf.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="not enabled"):
        disable(hf)
    with pytest.raises(ValueError, match="is not a Llama-family decoder"):
        enable(object())
    attention = enable(hf, "dense")
    assert isinstance(attention, HFAttention) and hf.config._attn_implementation == attention.name
    with pytest.raises(ValueError, match="already enabled"):
        enable(hf, "dense")
    generate_hf(hf, prompt_ids(200), new=3)
    for row in (1, -1, "0", True, 0.0):  # "0" and 0.0 were TypeErrors in Python's words; True is no row index
        with pytest.raises(ValueError, match=f"row {re.escape(repr(row))}: the last generation had 1 row"):
            attention.summary(row)
    assert attention.summary(0)["steps"] == 2
    disable(hf)


def test_a_model_moved_after_enable_is_refused_in_one_line(sharp_dir):
    """enable() reads the correction, static labels and reference keys onto the model's device; a model moved after
    it (enable(model); model.cuda()) would decode with them on the device it left: refused at its first decode step in
    one line saying what to do. Here the move is the other way round, to run without CUDA: enable() is told the model
    was on a CUDA device, and it decodes on the CPU."""
    hf = hf_model(sharp_dir)
    attention = enable(hf, "qada", tau=TAU, moments="prompt")
    assert attention.device == next(hf.parameters()).device
    ids = prompt_ids(200).to(attention.device)
    assert len(generate_hf(hf, ids, new=3)[0]) == 3  # where it was enabled: decodes
    attention.device = torch.device("cuda", 0) if attention.device.type != "cuda" else torch.device("cpu")
    with pytest.raises(ValueError, match="^the model decodes on .* but was enabled on .*: enable\\(\\) it where it "
                                         "decodes \\(disable\\(model\\), move it, enable again\\)$"):
        generate_hf(hf, ids, new=3)
    disable(hf)


def test_a_disabled_model_is_freed(sharp_dir):
    """transformers' registry keeps an enabled attention for good; it must not keep the model alive with it."""
    hf, tok = hf_model(sharp_dir), Tokenizer.from_dir(sharp_dir)
    enable(hf, "qada", tau=TAU, tokenizer=tok)
    generate_hf(hf, prompt_ids(200), new=3)
    disable(hf)
    ref = weakref.ref(hf)
    del hf
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("method,kept", [("quest", "a page index"), ("qada_pages", "a page index"),
                                         ("qada", "online moments")])
def test_beam_search_is_refused_where_a_row_keeps_state_of_its_own(sharp_dir, method, kept):
    """Beam search reorders the cache's rows between steps. A page index or online moments kept per row would then be
    another row's: refused with one line. A path that keeps nothing per row decodes the beams as transformers does
    (tau 1: dense's tokens)."""
    hf, tok, ids = hf_model(sharp_dir), Tokenizer.from_dir(sharp_dir), prompt_ids()
    beams = dict(attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, num_beams=3)
    plain = hf.generate(ids, **beams)
    inputs = {"quest": dict(budget=64), "qada_pages": dict(budget=64, calibration=random_calibration(), tokenizer=tok),
              "qada": dict(tau=TAU, moments="prompt-online")}[method]
    enable(hf, method, **inputs)
    with pytest.raises(ValueError, match=f"reordered between two decode steps \\(beam search\\): the {method} path "
                                         f"keeps {kept} per row") as e:
        hf.generate(ids, **beams)
    assert "\n" not in str(e.value)
    generate_hf(hf, ids)  # one beam: nothing reordered, nothing refused
    disable(hf)
    attention = enable(hf, "qada", tau=1.0, moments="prompt")  # fixed moments: nothing kept per row
    out = hf.generate(ids, **beams)
    assert torch.equal(out, plain)
    # its statistics are the cache's rows', which the beams moved between: not one returned sequence's each
    assert attention.report().count("decode steps") == 3  # the three cache rows
    with pytest.raises(ValueError, match="reordered between decode steps \\(beam search\\), so a row's statistics"):
        attention.report(out.expand(3, -1))
    disable(hf)


@pytest.mark.parametrize("method,inputs", [("qada", dict(tau=TAU, moments="prompt")), ("quest", dict(budget=64))])
def test_a_prompt_prefilled_in_chunks_decodes_as_in_one_pass(sharp_dir, method, inputs):
    """transformers' chunked prefill (prefill_chunk_size: 128 + 128 + 44 tokens here) hands the adapter the prompt in
    passes of several tokens; the prompt's keys it keeps (Option 1's moments, a page index) are the last pass's whole
    cache: the same tokens, labels and report as a prompt prefilled in one pass."""
    hf, ids = hf_model(sharp_dir), prompt_ids()
    attention = enable(hf, method, **inputs)
    whole = generate_hf(hf, ids)
    labels, report = attention.rows[0].stats.label_tensor(), attention.report()
    chunked = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                          prefill_chunk_size=128)[:, PROMPT:].tolist()
    assert chunked == whole and torch.equal(attention.rows[0].stats.label_tensor(), labels)
    assert attention.report() == report and f"{NEW - 1} decode steps" in report
    disable(hf)


def test_prompt_lookup_decoding_is_refused_with_one_line(sharp_dir):
    """Prompt-lookup decoding checks several tokens in one pass, then cuts the cache back: the adapter decodes one
    token per pass and says so, where it said it saw no prefill."""
    hf = hf_model(sharp_dir)
    ids = prompt_ids(150, 4).repeat(1, 2)  # repeated: the lookup finds candidates
    enable(hf, "dense")
    with pytest.raises(ValueError, match="cut back, as assisted and prompt-lookup decoding do"):
        # an end token named (<unk>, in no prompt): transformers 5.12, for one, compares the candidates with it and
        # fails on None
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                    prompt_lookup_num_tokens=4, eos_token_id=100)
    disable(hf)


def test_calibrate_through_the_adapter_equals_ours(sharp_dir, tmp_path):
    """python -m lab.calibrate --qada --hf FOLDER records, through the adapter, the masses --model FOLDER records
    through our model, and fits the same correction; the two runs' files name their runner."""
    args = ["--qada", "--tasks", "fwe", "--length", "400", "--samples", "1", "--max-new-tokens", "4"]
    assert calibrate.main(args + ["--model", str(sharp_dir), "--out", str(tmp_path / "ours")]) == 0
    assert calibrate.main(args + ["--hf", str(sharp_dir), "--out", str(tmp_path / "hf")]) == 0
    ours = torch.load(tmp_path / "ours" / "masses.pt", weights_only=True)
    hf = torch.load(tmp_path / "hf" / "masses.pt", weights_only=True)
    assert hf["settings"]["model"] == f"transformers:{sharp_dir}" and ours["settings"]["model"] == str(sharp_dir)
    (m1, n1), (m2, n2) = ours["prompts"]["fwe#0"], hf["prompts"]["fwe#0"]
    assert m1.shape == m2.shape and m1.shape[0] >= 1 and torch.equal(n1, n2)
    torch.testing.assert_close(m2, m1, atol=1e-4, rtol=1e-4)
    a, b = load_calibration(tmp_path / "ours" / "affine.json"), load_calibration(tmp_path / "hf" / "affine.json")
    torch.testing.assert_close(b.a, a.a, atol=1e-3, rtol=1e-3)
    assert b.settings["weights_probe"] == a.settings["weights_probe"]  # either one's correction runs on the other
    assert calibrate.main(args + ["--model", str(sharp_dir), "--hf", str(sharp_dir), "--out", str(tmp_path)]) == 2


@pytest.mark.slow
def test_the_embedded_model_through_transformers_gguf_loader_equals_ours(embedded_dir, hf_gguf_model):
    """SmolLM2-135M as transformers' GGUF loader reads it and as our converter does: the shipped needle prompt's start
    decoded greedily through the adapter and through our model, with QAdA at the paper's tau: the same tokens and
    labels."""
    from pathlib import Path
    hf, ours, tok = hf_gguf_model, load_model(embedded_dir), Tokenizer.from_dir(embedded_dir)
    text = (Path(__file__).resolve().parent.parent / "examples" / "needle.txt").read_text()
    ids = torch.tensor([tok.encode(text, add_special_tokens=True)[:1200]])  # its first 1,200 tokens: a shorter run
    eos = hf.generation_config.eos_token_id
    hf.generation_config.eos_token_id = None
    try:
        attention = enable(hf, "qada", tau=0.6, tokenizer=tok)
        got = generate_hf(hf, ids, new=12)[0]
        want, att = generate_ours(ours, tok, ids, "qada", "random-words", 0.6, None, new=12)
        assert got == want
        labels = attention.rows[0].stats.label_tensor()
        assert torch.equal(labels, att.stats.label_tensor()) and 0 < labels.float().mean() < 1
    finally:
        hf.generation_config.eos_token_id = eos
        if isinstance(transformers.AttentionInterface().get(hf.config._attn_implementation), HFAttention):
            disable(hf)


def test_the_core_imports_neither_transformers_nor_the_adapter():
    """transformers is an extra: no top-level file imports it or integrations/, and requirements.txt does not
    list it."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("transformers", "integrations") for n in names), path.name
    assert "transformers" not in (root / "requirements.txt").read_text()


def test_a_chunked_prefill_through_our_cache_gives_the_whole_prompts_logits(sharp_dir):
    """HFModel.prefill in chunks of 16 (the later chunks attend to the cache the earlier ones filled, under a causal
    mask offset by the cache's length) against one chunk: the same last logits and the same cache. Left-padded rows
    (generate.py's stacked caches) are refused in one line: HFModel counts every row's positions from 0."""
    model, _ = load(str(sharp_dir))
    ids = prompt_ids(70, 3)
    caches = [model.new_cache(ids.shape[1]) for _ in range(3)]
    whole, chunked = model.prefill(ids, caches[0]), model.prefill(ids, caches[1], chunk=16)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1].k, caches[0].k, atol=1e-5, rtol=1e-5)
    model.prefill(ids[:, :30], caches[2])
    # a dense decode step through our cache: our model's logits on the same weights
    ours = load_model(sharp_dir)
    theirs, mine = model.new_cache(ids.shape[1] + 1), ours.new_cache(ids.shape[1] + 1)
    model.prefill(ids, theirs), ours.prefill(ids, mine)
    torch.testing.assert_close(model.decode_step(ids[:, 5], theirs), ours.decode_step(ids[:, 5], mine),
                               atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="HFModel takes caches of rows that start at position 0"):
        model.decode_step(torch.tensor([1, 2]), KVCache.stack([caches[0], caches[2]], 4))


def test_a_model_offloaded_in_part_is_probed_and_decodes_as_in_memory(sharp_dir, tmp_path):
    """A model loaded with accelerate's device_map, its embeddings and last layer offloaded to disk (their weights on
    the meta device, their values in accelerate's hooks): the calibrated path decodes on the device the rest of the
    model holds, checks the correction against the offloaded k_proj's values, and decodes the tokens and labels of the
    model held whole in memory."""
    pytest.importorskip("accelerate")
    whole = hf_model(sharp_dir)
    device_map = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "cpu"}
    offloaded = transformers.AutoModelForCausalLM.from_pretrained(sharp_dir, dtype=torch.float32, device_map=device_map,
                                                                  offload_folder=str(tmp_path / "offload")).eval()
    offloaded.generation_config.eos_token_id, offloaded.generation_config.pad_token_id = None, 0
    assert offloaded.model.layers[1].self_attn.k_proj.weight.is_meta
    with pytest.raises(ValueError, match="on the meta device"):  # the core's probe says why it cannot read them
        weights_probe(offloaded)
    c = random_calibration(taus={"qada_cal": TAU})
    c.settings["weights_probe"] = weights_probe(whole)
    tok, ids, tokens, labels, identities = Tokenizer.from_dir(sharp_dir), prompt_ids(), [], [], []
    for hf in (whole, offloaded):
        attention = enable(hf, "qada_cal", calibration=c, tokenizer=tok)
        tokens.append(generate_hf(hf, ids))
        labels.append(attention.rows[0].stats.label_tensor())
        identities.append(HFModel(hf, attention).identity)  # what keys Option 2's reference keys on disk
        disable(hf)
    assert tokens[0] == tokens[1] and torch.equal(labels[0], labels[1]) and identities[0] == identities[1]
    other = Calibration(c.a, c.b, c.s, dict(c.settings, weights_probe=[x * 1.1 for x in c.settings["weights_probe"]]))
    with pytest.raises(ValueError, match="other weights"):  # the offloaded values are what the check reads
        enable(offloaded, "qada_cal", calibration=other, tokenizer=tok)
    with torch.device("meta"):  # nothing held anywhere: no device to decode on, said in one line
        nowhere = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    with pytest.raises(ValueError, match="every parameter of the model is offloaded"):
        enable(nowhere, "dense")
