"""GGUF -> Hugging Face folder conversion: the q/k un-permutation, tiny synthetic Llama and Qwen2 GGUFs
(round trip, and transformers' own GGUF loader as the oracle), the CLI, and the real SmolLM2 GGUF against
transformers. Fetching, assembling and caching the named models is tested in test_checkpoints.py."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from weights import convert_gguf
from weights.convert_gguf import convert, unpermute_qk

ROOT = Path(__file__).resolve().parent.parent


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf.py does to q/k rows (written out again here, independently).
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_rotate_half(x, pos, theta=10000.0):
    # x: (T, H, D); HF Llama convention, pairs (i, i + D/2).
    D = x.shape[-1]
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64, device=x.device) / D)
    ang = pos.to(x.device)[:, None].double() * inv[None]  # (T, D/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def rope_interleaved(x, pos, theta=10000.0):
    # x: (T, H, D); llama.cpp / GPT-J convention, pairs (2i, 2i+1).
    D = x.shape[-1]
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64, device=x.device) / D)
    ang = pos.to(x.device)[:, None].double() * inv[None]  # (T, D/2)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    for n_heads, D in [(4, 8), (3, 64)]:
        w = rng.standard_normal((n_heads * D, 16)).astype(np.float32)
        stored = llama_cpp_permute(w, n_heads)
        assert not np.array_equal(stored, w)  # the permutation is not the identity
        np.testing.assert_array_equal(unpermute_qk(stored, n_heads), w)


def test_unpermuted_weights_with_rotate_half_equal_gguf_weights_with_interleaved_rope():
    # The reason for un-permuting: attention scores must be the same as llama.cpp computes them.
    torch.manual_seed(0)
    T, H, D, C = 7, 2, 8, 12
    x = torch.randn(T, C, dtype=torch.float64)
    wq, wk = torch.randn(H * D, C, dtype=torch.float64), torch.randn(H * D, C, dtype=torch.float64)
    # the conversion runs in numpy; back on x's device (CUDA under QADA_TEST_DEVICE=cuda)
    gq, gk = (torch.from_numpy(llama_cpp_permute(w.cpu().numpy(), H)).to(x.device) for w in (wq, wk))  # in the GGUF
    hq, hk = (torch.from_numpy(unpermute_qk(w.cpu().numpy(), H)).to(x.device) for w in (gq, gk))  # after conversion
    pos = torch.arange(T)

    def scores(wq, wk, rope):
        q, k = rope((x @ wq.T).view(T, H, D), pos), rope((x @ wk.T).view(T, H, D), pos)
        return torch.einsum("thd,shd->hts", q, k)

    ref = scores(gq, gk, rope_interleaved)
    torch.testing.assert_close(scores(hq, hk, rope_rotate_half), ref)
    assert not torch.allclose(scores(gq, gk, rope_rotate_half), ref)  # the wrong pairing is detectably wrong


# ---- a tiny synthetic GGUF, written with gguf.GGUFWriter: fast and independent of the download ----

TINY = dict(layers=2, hidden=32, ffn=48, heads=4, kv_heads=2, head_dim=8, ctx=64)
GGUF_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                    "post_attention_layernorm": "ffn_norm"}


def write_tiny_gguf(path: Path, tied: bool = True, add_bos: bool = False, arch: str = "llama",
                    eot: int | None = None, tokenizer: str = "gpt2", pre: str | None = None,
                    omit: tuple[str, ...] = (), key_length: bool = False,
                    bias: bool | None = None) -> dict[str, np.ndarray]:
    """Write a 2-layer Llama (or Qwen2: q/k/v biases, q/k not permuted, pre-tokenizer qwen2) GGUF with random
    F32 weights, and an end-of-turn token id `eot` where given; `tokenizer` and `pre` override the tokenizer's
    names, `omit` leaves out metadata a GGUF may lack ("head_count_kv", "vocab_size", "rope_freq_base", "pre",
    "token_type"), `key_length` writes attention.key_length/value_length (the head size), `bias` q/k/v biases
    (default: Qwen2 only; a Llama's q/k biases are permuted as its weights); return the HF-layout weights it encodes."""
    import gguf
    from tokenizers import pre_tokenizers

    qwen = arch == "qwen2"
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ċ Ġ"]
    tokens = specials + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "ll", "hell", "hello", "Ġw", "ĊĠ"]
    tokens.append("<tool_call>")  # a user-defined added token (GGUF type 4), as Qwen2.5 has
    V, C, F, H, Hkv, D = len(tokens), TINY["hidden"], TINY["ffn"], TINY["heads"], TINY["kv_heads"], TINY["head_dim"]
    rng = np.random.default_rng(0)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    hf = {"model.embed_tokens.weight": r(V, C), "model.norm.weight": r(C)}
    if not tied:
        hf["lm_head.weight"] = r(V, C)
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        hf |= {
            p + "self_attn.q_proj.weight": r(H * D, C), p + "self_attn.k_proj.weight": r(Hkv * D, C),
            p + "self_attn.v_proj.weight": r(Hkv * D, C), p + "self_attn.o_proj.weight": r(C, H * D),
            p + "mlp.gate_proj.weight": r(F, C), p + "mlp.up_proj.weight": r(F, C), p + "mlp.down_proj.weight": r(C, F),
            p + "input_layernorm.weight": r(C), p + "post_attention_layernorm.weight": r(C),
        }
        if qwen if bias is None else bias:
            hf |= {p + "self_attn.q_proj.bias": r(H * D), p + "self_attn.k_proj.bias": r(Hkv * D),
                   p + "self_attn.v_proj.bias": r(Hkv * D)}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(TINY["layers"])
    w.add_context_length(TINY["ctx"])
    w.add_embedding_length(C)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    if "head_count_kv" not in omit:
        w.add_head_count_kv(Hkv)
    if not qwen:  # Qwen2 GGUFs have no rope.dimension_count: head_dim is hidden / heads
        w.add_rope_dimension_count(D)
    if key_length:
        w.add_key_length(D)
        w.add_value_length(D)
    if "rope_freq_base" not in omit:
        w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if "vocab_size" not in omit:
        w.add_vocab_size(V)
    w.add_tokenizer_model(tokenizer)
    if "pre" not in omit:
        w.add_tokenizer_pre(pre or ("qwen2" if qwen else "smollm"))
    w.add_token_list(tokens)
    if "token_type" not in omit:
        w.add_token_types([3] * len(specials) + [1] * (V - len(specials) - 1) + [4])
    w.add_token_merges(merges)
    w.add_bos_token_id(0 if qwen else 1)
    w.add_eos_token_id(2)
    if eot is not None:
        w.add_eot_token_id(eot)
    if not qwen:
        w.add_unk_token_id(0)
    w.add_pad_token_id(0 if qwen else 2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}")
    for name, t in hf.items():
        if name.startswith("model.layers."):
            i, rest = name.split(".")[2], name.split(".", 3)[3]
            kind, suffix = rest.rsplit(".", 1)
            gname = f"blk.{i}.{GGUF_LAYER_NAMES[kind]}.{suffix}"
            if kind == "self_attn.q_proj" and not qwen:
                t = llama_cpp_permute(t, H)
            elif kind == "self_attn.k_proj" and not qwen:
                t = llama_cpp_permute(t, Hkv)
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def pieces_of(tok, ids) -> list[str]:
    return [tok.tokenizer.id_to_token(i) for i in ids]


@pytest.mark.parametrize("tied", [True, False])
def test_convert_tiny_gguf_round_trip(tmp_path, tied):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from weights.tokenizer import Tokenizer

    expected = write_tiny_gguf(tmp_path / "tiny.gguf", tied=tied)
    out = convert(tmp_path / "tiny.gguf", tmp_path / "tiny")

    weights = load_file(out / "model.safetensors")
    assert sorted(weights) == sorted(expected)
    for name, w in expected.items():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], torch.from_numpy(w)), name
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}

    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (2, 4, 2)
    assert (config["head_dim"], config["hidden_size"], config["intermediate_size"]) == (8, 32, 48)
    assert (config["rope_theta"], config["rms_norm_eps"], config["max_position_embeddings"]) == (500000.0, 1e-6, 64)
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}

    tok = Tokenizer.from_dir(out)
    ids = tok.encode("hello world\n 42<|im_end|>")
    pieces = [tok.tokenizer.id_to_token(i) for i in ids]
    # merges applied, the special token kept whole, digits split off first (smollm pre-tokenizer) so
    # that "\n " stays one pre-token and merges (without Digits: "\n" | " 42" -> Ċ, Ġ, 4, 2)
    assert pieces == ["hello", "Ġw", "o", "r", "l", "d", "ĊĠ", "4", "2", "<|im_end|>"]
    assert tok.eos_ids == {2} and tok.bos_id == 1
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"
    # every digit a pre-token of its own (llama.cpp's smollm split), even where a merge could join digits
    assert [p for p, _ in tok.tokenizer.pre_tokenizer.pre_tokenize_str("a 123\n 45")] == [
        "a", "Ġ", "1", "2", "3", "ĊĠ", "4", "5"]
    # control tokens are special (dropped when decoding), a user-defined one is kept whole and kept; bytes decode back;
    # no BOS on raw text when the GGUF does not ask for one
    text = "<|im_start|>hello world<|im_end|><tool_call>"
    assert tok.decode(tok.encode(text)) == "hello world<tool_call>"
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert pieces_of(tok, tok.encode("<tool_call>hello")) == ["<tool_call>", "hello"]
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello")
    header = (out / "model.safetensors").read_bytes()[:8]
    assert int.from_bytes(header, "little") % 8 == 0  # the data starts 8-byte aligned


def test_convert_tiny_gguf_with_add_bos_adds_bos_to_raw_text_only(tmp_path):
    from weights.tokenizer import Tokenizer

    write_tiny_gguf(tmp_path / "tiny.gguf", add_bos=True)
    tok = Tokenizer.from_dir(convert(tmp_path / "tiny.gguf", tmp_path / "tiny"))
    assert tok.encode("hello", add_special_tokens=True) == [1, tok.tokenizer.token_to_id("hello")]
    assert tok.encode("hello") == [tok.tokenizer.token_to_id("hello")]
    assert tok.encode_chat([{"role": "user", "content": "hello"}]).count(1) == 1  # no BOS on top of the template's


def test_an_end_of_turn_token_stops_generation_too(tmp_path):
    """A GGUF's eot_token_id (Llama-3's <|eot_id|>: a chat turn ends there, not at eos) joins the ids generation
    stops on, after eos, and the tokenizer stops on both; written once where it equals eos."""
    from weights.tokenizer import Tokenizer

    write_tiny_gguf(tmp_path / "tiny.gguf", eot=0)
    out = convert(tmp_path / "tiny.gguf", tmp_path / "tiny")
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": [2, 0]}
    assert Tokenizer.from_dir(out).eos_ids == {0, 2}
    write_tiny_gguf(tmp_path / "same.gguf", eot=2)
    out = convert(tmp_path / "same.gguf", tmp_path / "same")
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}


def test_convert_tiny_qwen2_gguf(tmp_path):
    """qwen2: biases mapped, q/k taken as stored (no un-permutation), both head copies kept untied, the model
    stops on <|im_end|> and <|endoftext|>, and the tokenizer uses Qwen's NFC + split regex."""
    from safetensors.torch import load_file

    from weights.tokenizer import Tokenizer

    expected = write_tiny_gguf(tmp_path / "tiny.gguf", tied=False, arch="qwen2")
    out = convert(tmp_path / "tiny.gguf", tmp_path / "tiny")
    weights = load_file(out / "model.safetensors")
    assert sorted(weights) == sorted(expected) and "model.layers.1.self_attn.k_proj.bias" in weights
    for name, w in expected.items():
        assert torch.equal(weights[name], torch.from_numpy(w)), name

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert config["attention_bias"] is True and config["tie_word_embeddings"] is False
    assert config["head_dim"] == TINY["hidden"] // TINY["heads"]
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 0, "eos_token_id": [2, 0]}

    tok = Tokenizer.from_dir(out)
    assert tok.eos_ids == {0, 2}
    pieces = [tok.tokenizer.id_to_token(i) for i in tok.encode("hello world\n 42<|im_end|>")]
    # The qwen2 regex: "\n" alone ("\s*[\r\n]+" stops there), then " 4" is not a pre-token: a space is not
    # part of \p{N} and "\s+(?!\S)" leaves it alone, so " ", "4", "2".
    assert pieces == ["hello", "Ġw", "o", "r", "l", "d", "Ċ", "Ġ", "4", "2", "<|im_end|>"]
    assert tok.encode("cafe\u0301") == tok.encode("caf\u00e9")  # NFC before the split
    # the pre-tokens are the regex's matches and no finer (GPT-2's regex after it would cut "'T" into "'", "T")
    regex = pytest.importorskip("regex")
    from tokenizers import decoders
    for text in ["DON'T you THINK'S? We've I'd", "a\n 1\n  22\t333 x  44, 0.5e-3", "   \n \n\r\n    x\u3000y  "]:
        pre = tok.tokenizer.pre_tokenizer.pre_tokenize_str(text)
        assert [decoders.ByteLevel().decode([p]) for p, _ in pre] == regex.findall(convert_gguf.QWEN2_SPLIT, text), text


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_folder_logits_equal_transformers_reading_the_gguf(tmp_path, arch):
    """Our model on the converted folder against transformers' own GGUF loader on the same tiny file."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from model import load_model

    write_tiny_gguf(tmp_path / "tiny.gguf", tied=arch == "llama", arch=arch)
    ours = load_model(convert(tmp_path / "tiny.gguf", tmp_path / "tiny"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, last_only=False), theirs.eval()(ids).logits, rtol=1e-5, atol=1e-5)


def test_tiny_folder_tokenizer_reads_in_transformers_with_its_tokens_and_text(tmp_path):
    """transformers' AutoTokenizer on the converted folder: the GGUF's bos/eos/pad/unk tokens, and decoding gives the
    text back: the folder turns off the clean-up of spaces before punctuation (transformers 4.x applies it to BPE too;
    5.x ignores it there with a warning)."""
    transformers = pytest.importorskip("transformers")
    write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert(tmp_path / "tiny.gguf", tmp_path / "tiny")
    assert json.loads((out / "tokenizer_config.json").read_text())["clean_up_tokenization_spaces"] is False
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert (hf.bos_token, hf.eos_token, hf.pad_token, hf.unk_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>",
                                                                        "<|endoftext|>")
    text = "hello , world . it 's"
    assert hf.decode(hf(text, add_special_tokens=False)["input_ids"]) == text


def test_metadata_a_gguf_may_lack_takes_the_defaults(tmp_path, monkeypatch):
    """A GGUF without head_count_kv (multi-head attention: as many KV heads as heads) converts to the weights it holds;
    one without vocab_size (then the token list's length) or rope.freq_base (Llama's 10000) gives transformers' logits
    on the same file. (transformers' loader leaves the q/k rows permuted when head_count_kv is missing, so it is no
    oracle for that one.)"""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from safetensors.torch import load_file

    from model import load_model

    monkeypatch.setitem(TINY, "kv_heads", TINY["heads"])
    expected = write_tiny_gguf(tmp_path / "mha.gguf", omit=("head_count_kv",))
    out = convert(tmp_path / "mha.gguf", tmp_path / "mha")
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == TINY["heads"]
    weights = load_file(out / "model.safetensors")
    assert all(torch.equal(weights[name], torch.from_numpy(w)) for name, w in expected.items())

    write_tiny_gguf(tmp_path / "tiny.gguf", omit=("vocab_size", "rope_freq_base"))
    out = convert(tmp_path / "tiny.gguf", tmp_path / "tiny")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 10000.0
    assert config["vocab_size"] == len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])
    ours = load_model(out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, last_only=False), theirs.eval()(ids).logits, rtol=1e-5, atol=1e-5)


def test_head_dim_is_the_rope_dimension_count(tmp_path, monkeypatch):
    """A Llama GGUF whose heads are narrower than hidden / heads (Mistral-Nemo: 32 heads of 128 in 5120) takes head_dim
    from rope.dimension_count: here 4 heads of 8 in 48, and the folder loads with those shapes."""
    from model import load_model

    monkeypatch.setitem(TINY, "hidden", 48)
    write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert(tmp_path / "tiny.gguf", tmp_path / "tiny")
    assert json.loads((out / "config.json").read_text())["head_dim"] == TINY["head_dim"]
    assert load_model(out).cfg.head_dim == TINY["head_dim"]


def test_a_non_finite_weight_is_refused_naming_the_tensor(tmp_path):
    """A GGUF holding a NaN (a damaged file, a broken quantization) is refused naming the tensor, and leaves neither
    the folder nor its temporary sibling, instead of converting into a model that answers NaN."""
    import gguf

    write_tiny_gguf(tmp_path / "tiny.gguf")
    t = next(t for t in gguf.GGUFReader(tmp_path / "tiny.gguf").tensors if t.name == "blk.1.ffn_up.weight")
    data = bytearray((tmp_path / "tiny.gguf").read_bytes())
    data[t.data_offset + 8:t.data_offset + 12] = np.float32(np.nan).tobytes()
    (tmp_path / "nan.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="GGUF tensor blk.1.ffn_up.weight holds non-finite values"):
        convert_gguf.convert_atomically(tmp_path / "nan.gguf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan.gguf", "tiny.gguf"]


def test_a_concurrent_conversion_that_finished_first_is_taken_and_other_rename_errors_raise(tmp_path, monkeypatch):
    """Two runs converting the same model: the one whose rename finds the other's complete folder takes it; a rename
    failing otherwise is raised, not taken for success. Neither leaves its temporary folder."""
    import shutil

    write_tiny_gguf(tmp_path / "tiny.gguf")

    def other_run_first(src, dst):
        shutil.copytree(src, dst)
        raise OSError(39, "Directory not empty")

    monkeypatch.setattr(convert_gguf.os, "replace", other_run_first)
    assert convert_gguf.convert_atomically(tmp_path / "tiny.gguf", tmp_path / "a") == tmp_path / "a"
    assert convert_gguf.is_complete(tmp_path / "a")

    def failing(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(convert_gguf.os, "replace", failing)
    with pytest.raises(OSError, match="No space left"):
        convert_gguf.convert_atomically(tmp_path / "tiny.gguf", tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "tiny.gguf"]


def test_chunked_dequantization_gives_the_same_file(tmp_path, monkeypatch):
    # Conversion streams each tensor in row chunks; the chunk size must not change a byte.
    write_tiny_gguf(tmp_path / "tiny.gguf", tied=False, arch="qwen2")
    whole = (convert(tmp_path / "tiny.gguf", tmp_path / "a") / "model.safetensors").read_bytes()
    monkeypatch.setattr(convert_gguf, "ROWS_PER_CHUNK", 5)
    assert (convert(tmp_path / "tiny.gguf", tmp_path / "b") / "model.safetensors").read_bytes() == whole


def test_convert_rejects_other_architectures_and_files(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma3")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="general.architecture is 'gemma3'; supported: llama, qwen2"):
        convert(tmp_path / "gemma.gguf", tmp_path / "out")
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        convert(tmp_path / "notes.txt", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        convert(tmp_path / "missing.gguf", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="a folder, not a GGUF file"):
        convert(tmp_path, tmp_path / "out")


def test_convert_refuses_a_tokenizer_it_cannot_rebuild_before_writing_weights(tmp_path):
    """A SentencePiece GGUF (tokenizer.ggml.model "llama": Llama-2, Mistral) or a pre-tokenizer split not reproduced
    here (Llama-3's "llama-bpe") would tokenize silently wrong: refused, before the output folder is made."""
    for tokenizer, pre in [("llama", "smollm"), ("gpt2", "llama-bpe")]:
        write_tiny_gguf(tmp_path / "other.gguf", tokenizer=tokenizer, pre=pre)
        with pytest.raises(ValueError, match=f"tokenizer '{tokenizer}' with pre-tokenizer '{pre}' is not supported"):
            convert(tmp_path / "other.gguf", tmp_path / "out")
        assert not (tmp_path / "out").exists()


def test_only_the_known_tensor_names_map():
    """Biases only on q/k/v; any other tensor (an MLP bias, Qwen3's q_norm, Llama-3.1's rope_freqs, a longer name) is
    refused by name rather than written into a folder the model cannot load."""
    assert convert_gguf.hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert convert_gguf.hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    for name in ("blk.0.ffn_up.bias", "blk.0.attn_output.bias", "blk.0.attn_q_norm.weight", "rope_freqs.weight",
                 "blk.0.attn_q.weight.scale"):
        with pytest.raises(ValueError, match=f"unexpected GGUF tensor '{name}'"):
            convert_gguf.hf_name(name)


def test_cli_converts_a_file_and_reports_errors_in_one_line(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    cli = [sys.executable, "-m", "weights.convert_gguf", "--gguf"]
    done = subprocess.run(cli + [str(tmp_path / "tiny.gguf")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert convert_gguf.is_complete(tmp_path / "tiny") and f"wrote {tmp_path / 'tiny'}" in done.stdout
    # The suffix in capitals (as some downloads name it) gives the default folder too.
    (tmp_path / "upper.GGUF").write_bytes((tmp_path / "tiny.gguf").read_bytes())
    assert convert_gguf.main(["--gguf", str(tmp_path / "upper.GGUF")]) == 0
    assert convert_gguf.is_complete(tmp_path / "upper")

    failed = subprocess.run(cli + [str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "x")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    assert failed.stderr.strip().splitlines() == [f"error: {tmp_path / 'missing.gguf'}: no such GGUF file"]
    assert not (tmp_path / "x").exists()


def test_cli_refuses_an_out_file_a_cut_gguf_and_no_gguf_in_one_line(tmp_path, capsys):
    """--out naming a file is refused before the conversion (it failed after it, with a Python object in the
    message); a GGUF cut short says so, one cut after its magic too (the reader's IndexError); a missing --gguf is
    argparse's error as one line, not the usage block; a GGUF named without the .gguf suffix, or a name with no file
    name (/), and no --out is told to give --out (no folder follows from its name)."""
    write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "tiny_named_so").write_bytes((tmp_path / "tiny.gguf").read_bytes())
    (tmp_path / "a_file").write_text("x")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((tmp_path / "tiny.gguf").read_bytes()[:-1000])  # the last tensor runs past the end
    magic = tmp_path / "magic.gguf"
    magic.write_bytes(b"GGUF")  # nothing after the magic
    cases = [(["--gguf", str(tmp_path / "tiny.gguf"), "--out", str(tmp_path / "a_file")],
              f"error: --out {tmp_path / 'a_file'} is a file; give a folder"),
             (["--gguf", str(cut), "--out", str(tmp_path / "out")], f"{cut} cannot be read as a GGUF file ("),
             (["--gguf", str(magic), "--out", str(tmp_path / "out")], f"{magic} cannot be read as a GGUF file ("),
             (["--gguf", "/"], "error: --gguf / does not end in .gguf"),
             ([], "error: the following arguments are required: --gguf (see --help)"),
             (["--gguf", str(tmp_path / "tiny_named_so")], "does not end in .gguf, so no output folder follows from "
                                                           "it; give --out FOLDER")]
    for argv, message in cases:
        assert convert_gguf.main(argv) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("reading ")]
        assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err
    assert not (tmp_path / "out").exists() and (tmp_path / "a_file").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "cut.gguf", "magic.gguf", "tiny.gguf",
                                                          "tiny_named_so"]


@pytest.mark.parametrize("error", [ValueError("Found duplicated tensor with name x"),
                                   KeyError("Duplicate general.name already in list at offset 40")])
def test_a_gguf_the_reader_refuses_is_one_line_with_the_readers_words(tmp_path, monkeypatch, error):
    """gguf's reader refuses a file with a name twice, a tensor twice by ValueError, a metadata field twice by KeyError
    (a traceback before); either is one line with the reader's own words, the file's size beside them."""
    import gguf
    write_tiny_gguf(tmp_path / "tiny.gguf")

    def refuse(path):
        raise error
    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    size = (tmp_path / "tiny.gguf").stat().st_size
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'tiny.gguf'} cannot be read as a GGUF file "
                                                   f"({error.args[0]}): damaged or cut short? its size is {size:,} "
                                                   "bytes")):
        convert(tmp_path / "tiny.gguf", tmp_path / "out")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_folder_config_reads_in_transformers_like_its_gguf_config(tmp_path, arch):
    """config.json as transformers reads it equals transformers' config of the same GGUF in every field both set (pad
    id, hidden_act, mlp_bias, rope, ...); it names the causal-LM class transformers maps its model_type to, and the
    dtype the weights are stored in."""
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    write_tiny_gguf(tmp_path / "tiny.gguf", tied=arch == "llama", arch=arch)
    out = convert(tmp_path / "tiny.gguf", tmp_path / "tiny")
    ours = transformers.AutoConfig.from_pretrained(out).to_dict()
    theirs = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file="tiny.gguf").to_dict()
    assert np.float32(ours.pop("rms_norm_eps")) == np.float32(theirs.pop("rms_norm_eps"))
    both = {k for k in set(ours) & set(theirs) if theirs[k] is not None} - {"_name_or_path"}
    assert {"pad_token_id", "bos_token_id", "eos_token_id", "hidden_act", "max_position_embeddings",
            "tie_word_embeddings", "num_key_value_heads"} <= both
    assert {k: ours[k] for k in both} == {k: theirs[k] for k in both}
    assert ours["architectures"] == [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[ours["model_type"]]]
    with safe_open(out / "model.safetensors", "pt") as f:
        stored = {str(f.get_tensor(k).dtype).removeprefix("torch.") for k in f.keys()}
    assert stored == {ours.get("dtype", ours.get("torch_dtype"))}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_folder_tokenizer_in_transformers_equals_its_gguf_tokenizer(tmp_path, arch):
    """transformers' AutoTokenizer on the folder and on the GGUF: the same special tokens (Qwen2's pad is <|endoftext|>,
    not its eos) and ids, single texts and pairs, with the GGUF's BOS; the folder's length limit is the context, and
    its add_bos_token/add_eos_token are the GGUF's."""
    transformers = pytest.importorskip("transformers")
    write_tiny_gguf(tmp_path / "tiny.gguf", arch=arch, add_bos=arch == "llama")
    out = convert(tmp_path / "tiny.gguf", tmp_path / "tiny")
    ours = transformers.AutoTokenizer.from_pretrained(out)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.pad_token == ("<|endoftext|>" if arch == "qwen2" else "<|im_end|>")
    for args in [("hello world",), ("hello", "hello world")]:
        assert ours(*args)["input_ids"] == theirs(*args)["input_ids"], args
        bare = {"add_special_tokens": False}
        assert ours(*args, **bare)["input_ids"] == theirs(*args, **bare)["input_ids"], args
    assert ours("hello")["input_ids"][0] == (1 if arch == "llama" else ours.convert_tokens_to_ids("hello"))
    assert ours.model_max_length == TINY["ctx"]
    config = json.loads((out / "tokenizer_config.json").read_text())  # the GGUF's flags, recorded as they are
    assert (config["add_bos_token"], config["add_eos_token"]) == (arch == "llama", False)


@pytest.mark.parametrize("pre", ["gpt2", "default", None])
def test_a_gpt2_default_or_missing_pre_tokenizer_splits_as_gpt2(tmp_path, pre):
    """tokenizer.ggml.pre "gpt2", "default" or none (llama.cpp's default) is GPT-2's plain byte-level split: the ids of
    transformers' GGUF tokenizer, which builds exactly that (no Digits split, no prefix space)."""
    transformers = pytest.importorskip("transformers")
    from weights.tokenizer import Tokenizer

    write_tiny_gguf(tmp_path / "tiny.gguf", pre=pre, omit=() if pre else ("pre",))
    tok = Tokenizer.from_dir(convert(tmp_path / "tiny.gguf", tmp_path / "tiny"))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    for text in ["hello world\n 42<|im_end|>", "a\n 1\n  22 hello", "hello"]:
        assert tok.encode(text) == theirs(text, add_special_tokens=False)["input_ids"], text
    assert pieces_of(tok, tok.encode("a\n 1")) == ["a", "Ċ", "Ġ", "1"]  # not the smollm split's "ĊĠ", "1"


def test_a_gguf_without_token_types_has_no_special_tokens(tmp_path):
    """Without tokenizer.ggml.token_type every token is a normal one (llama.cpp's default): none is added as special,
    so decoding keeps every piece."""
    from weights.tokenizer import Tokenizer

    write_tiny_gguf(tmp_path / "tiny.gguf", omit=("token_type",))
    tok = Tokenizer.from_dir(convert(tmp_path / "tiny.gguf", tmp_path / "tiny"))
    assert tok.tokenizer.get_added_tokens_decoder() == {}
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_head_dim_is_the_key_length_where_the_gguf_gives_one(tmp_path, monkeypatch):
    """attention.key_length is the head size where a GGUF writes it: a Qwen2 GGUF (no rope.dimension_count) whose heads
    are narrower than hidden / heads (4 of 8 in 48) takes head_dim from it, and the folder loads with those shapes."""
    from model import load_model

    monkeypatch.setitem(TINY, "hidden", 48)
    write_tiny_gguf(tmp_path / "tiny.gguf", arch="qwen2", key_length=True)
    out = convert(tmp_path / "tiny.gguf", tmp_path / "tiny")
    assert json.loads((out / "config.json").read_text())["head_dim"] == TINY["head_dim"]
    assert load_model(out).cfg.head_dim == TINY["head_dim"]


def test_an_extra_stop_token_the_vocabulary_lacks_is_skipped(tmp_path):
    """An architecture's extra stop tokens (Qwen2's <|endoftext|>) join the stop ids only where the vocabulary has them;
    one it lacks is skipped, not a ValueError from list.index."""
    import dataclasses

    import gguf

    write_tiny_gguf(tmp_path / "tiny.gguf", arch="qwen2")
    arch = dataclasses.replace(convert_gguf.ARCHITECTURES["qwen2"], extra_eos=("<|not_in_vocab|>", "<|endoftext|>"))
    assert convert_gguf.eos_ids(gguf.GGUFReader(tmp_path / "tiny.gguf"), arch) == [2, 0]


def test_qwen2_split_equals_transformers_qwen2_regex():
    """QWEN2_SPLIT against an independent copy of Qwen's regex (transformers' Qwen2 tokenizer) on texts where each part
    matters: case-insensitive contractions ("'S" before letters), one digit per match, trailing-whitespace runs."""
    regex = pytest.importorskip("regex")
    qwen2 = pytest.importorskip("transformers.models.qwen2.tokenization_qwen2")
    texts = ["IT'SOK WE'LLGO it'sok I'M", "a\n 1\n  22\t333 x  44, 0.5e-3", "   \n \n\r\n    x\u3000y  ", "x  \n  y "]
    for text in texts:
        assert regex.findall(convert_gguf.QWEN2_SPLIT, text) == regex.findall(qwen2.PRETOKENIZE_REGEX, text), text


def test_a_file_whose_magic_differs_in_its_fourth_byte_is_not_a_gguf(tmp_path):
    """The whole four-byte magic is checked: b"GGUX..." is "not a GGUF file", not a GGUF "cut short"."""
    (tmp_path / "ggux.gguf").write_bytes(b"GGUX" + bytes(64))
    with pytest.raises(ValueError, match=r"is not a GGUF file \(it does not start with b'GGUF'\)"):
        convert(tmp_path / "ggux.gguf", tmp_path / "out")


def test_only_tensors_in_blocks_map_to_layers():
    """A four-part name outside the blk.{i} blocks (another model's "enc.0.attn_q.weight") is refused, not taken for
    layer 0."""
    for name in ("enc.0.attn_q.weight", "dec.1.ffn_up.weight"):
        with pytest.raises(ValueError, match=f"unexpected GGUF tensor '{name}'"):
            convert_gguf.hf_name(name)


def test_a_tensor_dequantized_short_is_refused_naming_it(tmp_path, monkeypatch):
    """A tensor whose dequantization gives fewer values than its shape (a chunk lost) is refused naming it, not written
    as a file whose data no longer matches its header."""
    write_tiny_gguf(tmp_path / "tiny.gguf")
    chunks = convert_gguf.fp32_chunks

    def one_chunk_short(t, shape, heads):
        out = list(chunks(t, shape, heads))
        return out[:-1] if t.name == "blk.0.ffn_up.weight" else out

    monkeypatch.setattr(convert_gguf, "ROWS_PER_CHUNK", 5)
    monkeypatch.setattr(convert_gguf, "fp32_chunks", one_chunk_short)
    with pytest.raises(ValueError, match=r"GGUF tensor blk.0.ffn_up.weight: dequantized 1440 values, expected shape "
                                         r"\(48, 32\)"):
        convert(tmp_path / "tiny.gguf", tmp_path / "out")


def test_write_weights_returns_the_number_of_parameters(tmp_path):
    """write_weights' count (the progress line's "M params") is the number of values stored, not of bytes."""
    import gguf
    from safetensors.torch import load_file

    write_tiny_gguf(tmp_path / "tiny.gguf", tied=False)
    reader = gguf.GGUFReader(tmp_path / "tiny.gguf")
    n = convert_gguf.write_weights(reader, convert_gguf.read_config(reader), tmp_path / "model.safetensors")
    assert n == sum(w.numel() for w in load_file(tmp_path / "model.safetensors").values())


def test_a_folder_is_complete_only_with_all_five_files(tmp_path):
    """The five files the rest of the project reads (the module's docstring): a folder lacking any one of them, such as
    an older conversion without generation_config.json, is not complete and gets rebuilt."""
    import shutil

    write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert(tmp_path / "tiny.gguf", tmp_path / "tiny")
    assert convert_gguf.is_complete(out)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        shutil.copytree(out, tmp_path / "partial")
        (tmp_path / "partial" / name).unlink()
        assert not convert_gguf.is_complete(tmp_path / "partial"), name
        shutil.rmtree(tmp_path / "partial")


def test_a_stale_temporary_folder_is_cleared_before_converting(tmp_path):
    """A temporary folder left by an earlier run of the same process id is emptied first: none of its files (here a
    chat_template.jinja, which would win over the GGUF's template) reaches the new folder."""
    import os

    write_tiny_gguf(tmp_path / "tiny.gguf")
    stale = tmp_path / f"out.tmp{os.getpid()}"
    stale.mkdir()
    (stale / "chat_template.jinja").write_text("stale")
    out = convert_gguf.convert_atomically(tmp_path / "tiny.gguf", tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == sorted(convert_gguf.MODEL_FILES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]


def test_a_llama_gguf_with_biases_is_refused_naming_the_tensor(tmp_path):
    """llama.cpp's llama architecture allows q/k/v biases (permuted as their weights); model.py's llama has none, so
    such a GGUF is refused by name, leaving no folder (it gave a folder whose q/k biases stayed permuted and whose
    config said no biases, which then did not load)."""
    write_tiny_gguf(tmp_path / "tiny.gguf", bias=True)
    with pytest.raises(ValueError, match="^GGUF tensor 'blk.0.attn_[qkv].bias': attention biases are supported in "
                                         "qwen2 models only, not llama$"):
        convert_gguf.convert_atomically(tmp_path / "tiny.gguf", tmp_path / "tiny")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_embedded_config_has_the_smollm2_numbers(embedded_dir):
    config = json.loads((embedded_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["hidden_size"] == 576 and config["intermediate_size"] == 1536
    assert config["max_position_embeddings"] == 8192
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["attention_bias"] is False and config["torch_dtype"] == "float32"


@pytest.mark.slow
def test_embedded_weights_equal_transformers_gguf_loading(embedded_dir, hf_gguf_model):
    from safetensors.torch import load_file

    ours = load_file(embedded_dir / "model.safetensors")
    theirs = hf_gguf_model.state_dict()
    # transformers lists the tied lm_head as its own key; the folder stores it once, as the embeddings.
    assert set(theirs) - set(ours) == {"lm_head.weight"} and set(ours) <= set(theirs)
    assert len(ours) == 1 + 1 + 30 * 9
    for name, w in ours.items():
        assert w.dtype == torch.float32 and w.shape == theirs[name].shape, name
        assert (w - theirs[name]).abs().max().item() == 0.0, name
    assert torch.equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])


@pytest.mark.slow
def test_embedded_config_reads_in_transformers_like_its_gguf_config(embedded_dir, hf_gguf_model):
    from transformers import AutoConfig

    ours, theirs = AutoConfig.from_pretrained(embedded_dir), hf_gguf_model.config
    for key in ["model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "attention_bias", "hidden_act"]:
        assert getattr(ours, key) == getattr(theirs, key), key
    assert np.float32(ours.rms_norm_eps) == np.float32(theirs.rms_norm_eps)  # the same fp32 value

    def theta(c):
        return (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", None))

    assert theta(ours) == theta(theirs) == 100000.0
