"""The embedded SmolLM2-135M-Instruct end to end: logits against transformers reading the same GGUF file,
a sensible greedy chat answer, and the QAdA paths on the real model."""

import math

import pytest
import torch

from attention import build_attention
from generate import decode
from model import load_model
from weights.tokenizer import Tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(embedded_dir):
    return load_model(str(embedded_dir)), Tokenizer.from_dir(embedded_dir)


def test_logits_match_transformers_gguf(smol, hf_gguf_model):
    model, tok = smol
    text = ("The Eiffel Tower, completed in 1889, is a wrought-iron lattice tower on the Champ de Mars in Paris. "
            "It was named after the engineer Gustave Eiffel, whose company designed and built it.")
    ids = torch.tensor([tok.encode(text)])
    assert 40 <= ids.shape[1] <= 60
    with torch.no_grad():
        ref = hf_gguf_model(ids).logits
        got = model(ids, last_only=False)
    assert (got - ref).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def chat(model, tok, question, attention=None, max_new_tokens=24):
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))
    cache = model.new_cache(len(ids) + max_new_tokens)
    logits = model.prefill(torch.tensor([ids]), cache)
    return tok.decode(decode(model, cache, logits, max_new_tokens, attention, tok.eos_ids))


def test_greedy_chat_answer_is_sensible(smol):
    answer = chat(*smol, "What is the capital of France?")
    assert "Paris" in answer
    assert answer.count(" ") >= 3  # a sentence, not a bare token


def test_qada_on_a_needle_prompt(smol):
    """On a ~1k-token needle prompt: dense finds the number, every head local does not, QAdA at tau 0.6
    finds it while labelling many heads local, and tau = 1 reproduces dense token for token."""
    model, tok = smol
    ids, n, cache, first = needle_prefill(model, tok)

    def run(method, **kw):
        cache.length = n  # roll back to the prompt: the same prefill serves every method
        attention = build_attention(method, cache, **kw)
        return decode(model, cache, first, 32, attention, tok.eos_ids), attention

    dense, _ = run("dense")
    assert "7302916" in tok.decode(dense)
    assert "7302916" not in tok.decode(run("local")[0])
    found, qada = run("qada", tau=0.6, moments_source="prompt")
    assert "7302916" in tok.decode(found)
    assert qada.stats.summary(3)["sparsity"] > 0.5
    assert run("qada", tau=1.0, moments_source="prompt")[0] == dense


def needle_prefill(model, tok):
    """A ~1k-token needle prompt, prefilled: ids, their number, the cache, the last logits."""
    noise = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    lines = [noise] * 45
    lines.insert(12, "One of the special magic numbers for quiet-lantern is: 7302916.")
    prompt = ("A special magic number is hidden within the following text. Make sure to memorize it.\n"
              + "\n".join(lines)
              + "\nWhat is the special magic number for quiet-lantern mentioned in the provided text?")
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
    n = len(ids)
    assert 900 < n < 1400
    cache = model.new_cache(n + 40)
    return ids, n, cache, model.prefill(torch.tensor([ids]), cache)



def eq7_labels(q, k, mean, cov, n_sink, n_local, tau):
    """Eq. 7 from the equation alone, in float64, with no project function: for each query head h,
    A_local = sum over the window of exp(q k_i / sqrt d); mu_s = q mu_K / sqrt d; sigma_s^2 = q Sigma_K q^T / d;
    local iff A_local / (A_local + (T - T_local) exp(mu_s + sigma_s^2 / 2)) >= tau. Also returns the shares.
    q (H, D); k (Hkv, T, D); mean (Hkv, D), cov (Hkv, D, D) of the group's bulk keys."""
    H, D = q.shape
    Hkv, T, _ = k.shape
    window = list(range(n_sink)) + list(range(T - (n_local - n_sink), T))
    labels, shares = [], []
    for h in range(H):
        g = h // (H // Hkv)  # the KV head of query head h
        qh = q[h].double()
        a_local = sum(math.exp(float(qh @ k[g, i].double()) / math.sqrt(D)) for i in window)
        mu_s = float(qh @ mean[g]) / math.sqrt(D)
        sigma2 = float(qh @ cov[g] @ qh) / D
        share = a_local / (a_local + (T - n_local) * math.exp(mu_s + sigma2 / 2))
        labels.append(share >= tau)
        shares.append(share)
    return labels, shares


def test_qada_labels_equal_eq7_from_first_principles(smol):
    """On the real model, QAdA's labels (tau 0.6, Option 1: the prompt's bulk moments fixed after prefill)
    for every (layer, head) over several decode steps equal Eq. 7 recomputed in float64 from the queries, the
    cached keys and moments taken independently from the prefilled cache (torch.cov). A query whose share lies
    within 1e-4 of tau may fall either way (fp32 vs fp64) and is left out."""
    model, tok = smol
    ids, n, cache, first = needle_prefill(model, tok)
    n_sink, n_local, tau = 16, 128, 0.6
    bulk = cache.k[:, 0, :, n_sink:n - (n_local - n_sink)].double()  # (L, Hkv, N, D) at prefill
    mean = bulk.mean(-2)
    cov = torch.stack([torch.stack([torch.cov(b.T, correction=0) for b in layer]) for layer in bulk])
    attention = build_attention("qada", cache, tau=tau, moments_source="prompt", n_sink=n_sink, n_local=n_local)
    checked, disagree, n_local_labels = 0, [], 0

    def recording(q, k, v, layer):
        y = attention(q, k, v, layer)
        want, shares = eq7_labels(q[0, :, 0], k[0], mean[layer], cov[layer], n_sink, n_local, tau)
        got = attention.stats.labels[-1][layer].tolist()
        nonlocal checked, n_local_labels
        for h, (w, g, share) in enumerate(zip(want, got, shares)):
            if abs(share - tau) > 1e-4:
                checked += 1
                n_local_labels += w
                if w != g:
                    disagree.append((layer, h, share))
        return y

    decode(model, cache, first, 6, recording, tok.eos_ids)
    L, H = model.cfg.num_hidden_layers, model.cfg.num_attention_heads
    assert checked > 0.95 * len(attention.stats.labels) * L * H
    assert 0.2 * checked < n_local_labels < 0.95 * checked  # both labels occur: the check has teeth
    assert not disagree, disagree[:5]
