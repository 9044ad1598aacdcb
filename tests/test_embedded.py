"""The embedded SmolLM2-135M-Instruct end to end: logits against transformers reading the same GGUF file,
a sensible greedy chat answer, and the QAdA paths on the real model."""

import pytest
import torch

from attention import SparseAttention
from generate import decode
from model import load_model
from moments import PromptMoments
from tokenizer import Tokenizer

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
    noise = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    lines = [noise] * 45
    lines.insert(12, "One of the special magic numbers for quiet-lantern is: 7302916.")
    prompt = ("A special magic number is hidden within the following text. Make sure to memorize it.\n"
              + "\n".join(lines) + "\nWhat is the special magic number for quiet-lantern mentioned in the provided text?")
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
    n = len(ids)
    assert 900 < n < 1400
    cache = model.new_cache(n + 40)
    first = model.prefill(torch.tensor([ids]), cache)

    def run(attention):
        cache.length = n  # roll back to the prompt: the same prefill serves every method
        return decode(model, cache, first, 32, attention, tok.eos_ids)

    dense = run(None)
    assert "7302916" in tok.decode(dense)
    assert "7302916" not in tok.decode(run(SparseAttention("local")))
    cache.length = n  # moments of the prompt's own bulk, not of the previous run's answer
    qada = SparseAttention("qada", 0.6, moments=PromptMoments(cache))
    assert "7302916" in tok.decode(run(qada))
    assert qada.stats.summary(3)["sparsity"] > 0.5
    cache.length = n
    assert run(SparseAttention("qada", 1.0, moments=PromptMoments(cache))) == dense
