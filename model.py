"""A Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2) read from a Hugging Face checkpoint.

The model the QAdA paper (arXiv 2502.09647, section 2) sparsifies: RMSNorm, rotary position embeddings
(RoPE) with an optional theta override, grouped-query attention (GQA), a SwiGLU MLP and an optional tied
LM head. Prefill is dense (SDPA, chunked when long) and returns last-position logits only; a decode step
hands each layer's attention to a pluggable decode-time path (see attention.py). Parameter names mirror
Hugging Face's, so checkpoints load strictly with no name map.

Dims vocabulary: B batch, T tokens, C hidden size, H query heads, Hkv key/value heads, D head dim,
L layers, V vocabulary.
"""

import copy
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


# What transformers assumes where a config.json leaves the context or the sliding window out, per model_type.
CONTEXT_DEFAULTS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}
SLIDING_DEFAULTS = {"mistral": 4096, "qwen2": 4096}


def sliding_window(hf: dict, model_type: str) -> int | None:
    """The window of the layers that slide in transformers' reading of config.json `hf`, or None where none does:
    Mistral slides every layer by sliding_window (null or 0: none); Qwen2 only with use_sliding_window, and then the
    layers layer_types names "sliding_attention" (without it, those from max_window_layers on)."""
    if model_type not in SLIDING_DEFAULTS:
        return None
    window = hf.get("sliding_window", SLIDING_DEFAULTS[model_type])
    if model_type == "qwen2":
        first = hf.get("max_window_layers", 28)
        kinds = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                          for i in range(hf["num_hidden_layers"])]
        if not hf.get("use_sliding_window", False) or "sliding_attention" not in kinds:
            return None
    return window or None


@dataclass
class LlamaConfig:
    vocab_size: int = 32000  # V
    hidden_size: int = 4096  # C
    intermediate_size: int = 11008  # SwiGLU inner width
    num_hidden_layers: int = 32  # L
    num_attention_heads: int = 32  # H
    num_key_value_heads: int = 32  # Hkv; H % Hkv == 0, G = H // Hkv query heads share one KV head
    head_dim: int = 128  # D; usually C // H, but Qwen/Mistral variants may differ
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # RoPE base; the paper overrides it to 2e6 to run 32k contexts
    rope_scaling: dict | None = None  # Llama-3.1's {"rope_type": "llama3", ...} or {"rope_type": "linear", ...}
    max_position_embeddings: int = 4096  # the trained context; generate.py goes past it only with --rope-theta or
    # a config's rope_scaling (generate.check_context)
    tie_word_embeddings: bool = False  # LM head shares the embedding matrix (SmolLM2, Qwen2-0.5B)
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    model_type: str = "llama"

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        """Read a Hugging Face config.json dict (Llama, Mistral or Qwen2)."""
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in hf]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}: not a Llama-family config")
        model_type = hf.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"unsupported model_type {model_type!r}: this implementation covers llama, mistral and "
                             "qwen2")
        context = hf.get("max_position_embeddings", CONTEXT_DEFAULTS[model_type])
        if window := sliding_window(hf, model_type):
            if window < context:  # a window as long as the context never slides: full attention, which we run
                raise ValueError(f"{model_type} sliding-window attention (window {window} of a {context}-token "
                                 "context) is not supported")
        # transformers >= 5 writes rope settings into one "rope_parameters" dict; older files split them.
        rope = dict(hf.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        H = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=H,
            num_key_value_heads=hf.get("num_key_value_heads") or H,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // H,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=context,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", model_type == "qwen2"),
            model_type=model_type,
        )


# ---------------------------------------------------------------------------------------------------------
# RoPE. Rotate-half convention (pairs i and i + D/2), which is how Hugging Face stores q/k weights, so they
# load unpermuted. Angles are computed in fp32 from integer positions on every call: no table to size, and
# bf16 angles at position 30k would be off by whole radians.


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """(D/2,) fp32 inverse frequencies, including Llama-3.1 or linear rope_scaling."""
    D = cfg.head_dim
    # Same fp32 arithmetic as transformers, so positions in the thousands give bit-identical angles.
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    s = cfg.rope_scaling
    kind = (s or {}).get("rope_type", (s or {}).get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / s["factor"]
    elif kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_ctx = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_ctx / wavelen - lo) / (hi - lo)).clamp(0, 1)
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    elif kind != "default":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
    return inv_freq


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, D), or (B, 1, T, D) for positions per row (B, T), in fp32 for integer `positions`."""
    if positions.dim() == 2:
        cos, sin = rope_cos_sin(inv_freq, positions.flatten())
        shape = (positions.shape[0], 1, positions.shape[1], -1)  # (B, 1, T, D): broadcast over heads
        return cos.view(shape), sin.view(shape)
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, D)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, D) by the angles in cos/sin (T, D) or (B, 1, T, D); computed in fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class RoPE(nn.Module):
    """A step's queries and keys rotated (apply_rope), as one tensor: their heads side by side, so that eager runs one
    rotation's seven operations, not two, and compiled (Llama.compile_pointwise, which is why this is a module) it is
    one kernel. q and k come back as views of it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        qk = apply_rope(torch.cat([q, k], dim=1), cos, sin)  # (B, H + Hkv, T, D)
        return qk.split([q.shape[1], k.shape[1]], dim=1)  # (B, H, T, D), (B, Hkv, T, D)


# ---------------------------------------------------------------------------------------------------------
# KV cache


class KVCache:
    """Keys and values for every layer, allocated once per generation; hands out views of the filled part.

    `length` is the number of positions filled. Rolling back to an earlier length (for example to decode
    the same prefilled prompt under several methods) is just `cache.length = n`: later writes overwrite.
    Keys are stored after RoPE, which is what the attention scores and the QAdA moments need.

    Prompts of different lengths share one cache left-padded (`stack`): row b's prompt fills positions
    start[b] .. length - 1, it counts its RoPE positions from start[b], and nothing attends to its padding.

    Static mode (`fix`, gpt-fast's static cache): the filled length is a device tensor that each decode step advances
    in place, the new entry is written at a device position and the views have a fixed length, so that a step reads
    no host value that changes and one captured CUDA graph can be replayed for every step.
    """

    def __init__(self, cfg: LlamaConfig, max_len: int, batch: int = 1, device=None, dtype=torch.float32):
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)  # (L, B, Hkv, T, D)
        self.cfg = cfg
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0
        self.start = None  # (B,) long: each row's first filled position when left-padded (stack); None: all 0
        # Static mode (fix): the filled length lives on the device, so that one decode step captured in a CUDA graph
        # can be replayed as the cache fills; the views then run to `view` positions, a fixed number, not to T.
        self.filled = None  # (1,) int32: the filled length T, advanced in place by each step
        self.position = None  # (1,) long: where the step writes (T before it), for index_copy_
        self.view = None

    @classmethod
    def stack(cls, caches: list["KVCache"], extra: int) -> "KVCache":
        """One cache whose row b holds the filled part of caches[b] (each of batch 1), right-aligned at the longest
        length, with room for `extra` more positions: prompts of different lengths decoded side by side."""
        n = max(c.length for c in caches)
        first = caches[0]
        out = cls(first.cfg, n + extra, len(caches), device=first.k.device, dtype=first.k.dtype)
        for b, c in enumerate(caches):
            out.k[:, b, :, n - c.length:n] = c.k[:, 0, :, :c.length]  # (L, Hkv, length, D)
            out.v[:, b, :, n - c.length:n] = c.v[:, 0, :, :c.length]
        out.length = n
        out.start = torch.tensor([n - c.length for c in caches], device=first.k.device)
        return out

    def fix(self, view: int | None = None) -> None:
        """Static mode from the current length on: the filled length becomes the device tensor `filled`, a decode step
        writes at the device position and hands out views of `view` positions (default: the capacity), whatever T is.
        `view` may be changed between steps (one captured graph per view); `release` goes back to host lengths."""
        self.filled = torch.tensor([self.length], dtype=torch.int32, device=self.k.device)
        self.position = torch.zeros(1, dtype=torch.long, device=self.k.device)
        self.view = view or self.max_len

    def release(self) -> None:
        """Back from static mode: the host length is the device's (one read)."""
        self.length = int(self.filled)
        self.filled = self.position = self.view = None

    def advance(self) -> torch.Tensor:
        """Static mode: one more position filled, in place; the position it is written at, (1,) long on the device."""
        self.position.copy_(self.filled)
        self.filled.add_(1)
        return self.position

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, Hkv, T, D) at positions [length, length + T); return views of all filled keys/values.
        In static mode one token at `position`, and views of `view` positions (past T: not yet filled)."""
        if self.filled is not None:
            if k.shape[2] != 1:
                raise ValueError("a cache in static mode decodes one token at a time")
            self.k[layer].index_copy_(2, self.position, k)  # (B, Hkv, 1, D) at the device position
            self.v[layer].index_copy_(2, self.position, v)
            return self.k[layer, :, :, :self.view], self.v[layer, :, :, :self.view]  # (B, Hkv, view, D)
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; writing up to {end}")
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, Hkv, end, D)

    def select_rows(self, rows: list[int]) -> "KVCache":
        """A new cache holding only `rows` (copied), at the same length: a batch drops the rows that have ended."""
        out = copy.copy(self)
        index = torch.tensor(rows, device=self.k.device)
        out.k, out.v = self.k.index_select(1, index), self.v.index_select(1, index)  # (L, len(rows), Hkv, T, D)
        out.start = None if self.start is None else self.start[index]
        return out

    def repeat_rows(self, batch: int) -> "KVCache":
        """A new cache of `batch` rows, each a copy of row 0 at the same length: several continuations of one
        prefill decoded side by side (lab/sweep.py decodes every method of a sample this way)."""
        out = copy.copy(self)
        out.k, out.v = self.k[:, :1].repeat(1, batch, 1, 1, 1), self.v[:, :1].repeat(1, batch, 1, 1, 1)
        out.start = None if self.start is None else self.start[:1].repeat(batch)
        return out


# ---------------------------------------------------------------------------------------------------------
# Modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # the mean square in fp32: bf16 loses the small activations otherwise
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor | None,
                 filled: torch.Tensor | None = None) -> torch.Tensor:
    """Dense attention of one decoded token per row, q (B, H, 1, D), over the filled cache k, v (B, Hkv, T, D) whose
    row b starts at start[b] (left padding; None: every row at 0): (B, H, 1, D). One of two SDPA layouts, picked by
    device, dtype and shape; each reads a KV head once for its G query heads. `filled` (a static cache's device
    length): the views run past it, and the positions from it on are masked too."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    if (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and start is None and filled is None
            and B * Hkv < multiprocessors(q.device)):
        # On a GPU with few (row, KV head) pairs: FlashAttention's decoding splits each head's context across thread
        # blocks (flash-decoding); the packed layout below would give it only B * Hkv blocks to fill the GPU with.
        # (16-bit only: in fp32 SDPA would fall back to a kernel that copies each KV head per query head.)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # (B, H, 1, D)
    # Packed: a group's G query heads go to SDPA as G query positions of their KV head, so each KV head is read once
    # (enable_gqa reads it once per query head on the CPU).
    mask = None
    if start is not None:  # left-padded rows: no row sees its padding
        mask = (torch.arange(k.shape[2], device=q.device) >= start[:, None])[:, None, None]  # (B, 1, 1, T)
    if filled is not None:  # nor what lies past the filled length
        filled_part = (torch.arange(k.shape[2], device=q.device) < filled)[None, None, None]  # (1, 1, 1, T)
        mask = filled_part if mask is None else mask & filled_part  # (1 or B, 1, 1, T)
    y = F.scaled_dot_product_attention(q.view(B, Hkv, -1, D), k, v, attn_mask=mask)  # (B, Hkv, G, D)
    return y.reshape(B, H, 1, D)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.H, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        C, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(C, self.H * self.D, bias=bias)
        self.k_proj = nn.Linear(C, self.Hkv * self.D, bias=bias)
        self.v_proj = nn.Linear(C, self.Hkv * self.D, bias=bias)
        self.o_proj = nn.Linear(self.H * self.D, C, bias=False)
        self.rope = RoPE()

    def forward(self, x, cos, sin, cache: KVCache, decode_attention=None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.D).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.Hkv, self.D).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, self.Hkv, self.D).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = self.rope(q, k, cos, sin)
        start = cache.length
        k, v = cache.write(self.layer, k, v)  # (B, Hkv, start + T, D)
        if T == 1 and decode_attention is not None:  # the pluggable decode-time path (attention.py)
            y = decode_attention(q, k, v, self.layer)  # (B, H, 1, D)
        elif T == 1:
            y = dense_decode(q, k, v, cache.start, cache.filled)
        elif cache.start is not None:
            raise ValueError("a stacked (left-padded) cache decodes one token at a time; prefill each prompt alone")
        elif start == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            # A chunk continuing a filled cache: query i (absolute start + i) sees keys 0 .. start + i.
            mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.H * self.D))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache, decode_attention=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, decode_attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
            layers=nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers)),
            norm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        ))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def compile_pointwise(self) -> None:
        """torch.compile the arithmetic between each layer's matmuls: its two norms, RoPE and the gated MLP, and the
        final norm. Eager in bf16, a decode step launches 38 kernels per layer, 28 of them small elementwise ones (a
        norm is eight, RoPE eight; results/bench-gpu/launches.py counts them); at batches of 1-8 on a GPU each costs a
        few microseconds however little it computes. Compiled, each of these modules is one fused kernel beside its
        matmuls (gpt-fast compiles its whole step; here the attention stays eager, since the decode hook may be any
        Python). The modules' code is unchanged and every layer's instance shares one compiled graph per shape; the
        first call at a new shape compiles (seconds), and the fused sums may round otherwise than eager's."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, RoPE, MLP)):
                module.compile()

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        return KVCache(self.cfg, max_len, batch, device=self.device, dtype=self.dtype)

    def forward(self, ids: torch.Tensor, cache: KVCache | None = None, decode_attention=None,
                last_only: bool = True) -> torch.Tensor:
        """Run ids (B, T) at positions [cache.length, cache.length + T); return logits (B, V) or (B, T, V) in fp32.

        With no cache a temporary one is used (a plain full forward pass). `decode_attention` replaces
        dense attention for single-token steps (see attention.py).
        """
        B, T = ids.shape
        cache = cache if cache is not None else self.new_cache(T, B)
        if cache.filled is not None:  # static: the position is a device tensor, so the step can be replayed
            positions = cache.advance()  # (1,)
        else:
            positions = torch.arange(cache.length, cache.length + T, device=ids.device)  # (T,)
        if cache.start is not None:  # left-padded rows count their positions from their own first token
            positions = positions[None] - cache.start[:, None]  # (B, T)
        cos, sin = rope_cos_sin(self.inv_freq, positions)
        x = self.model.embed_tokens(ids)  # (B, T, C)
        for block in self.model.layers:
            x = block(x, cos, sin, cache, decode_attention)
        if cache.filled is None:
            cache.length += T
        if last_only:
            x = x[:, -1]
        return self.lm_head(self.model.norm(x)).float()

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, cache: KVCache, chunk: int = 2048, progress: bool = False) -> torch.Tensor:
        """Dense prefill of ids (B, T) into cache in chunks (bounded activation memory); last-position logits (B, V)."""
        starts = range(0, ids.shape[1], chunk)
        if progress and len(starts) > 1:
            from tqdm import tqdm
            starts = tqdm(starts, desc="prefill", unit="chunk", leave=False)
        for s in starts:
            logits = self(ids[:, s:s + chunk], cache)
        return logits

    @torch.inference_mode()
    def decode_step(self, token: torch.Tensor, cache: KVCache, decode_attention=None) -> torch.Tensor:
        """One token (B,) at the next position; returns logits (B, V)."""
        return self(token[:, None], cache, decode_attention)


# ---------------------------------------------------------------------------------------------------------
# Loading from a Hugging Face style folder (weights/checkpoints.py finds or builds the folder for a name or hub id).


def read_json_object(path: Path, what: str = "a JSON object") -> dict:
    """The JSON object in file `path` (config.json, the shard index, criterion's calibration and labels files):
    anything else is one ValueError naming the file and `what` it should have been, not a decoder message without it
    or a TypeError further on (a binary file's bytes are not quoted back)."""
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not {what}: not UTF-8 text (a binary file?)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not {what}: not JSON ({e})") from None
    if not isinstance(data, dict):  # a list or a number indexes into a TypeError of Python's words
        raise ValueError(f"{path} is not {what}: a JSON {type(data).__name__}, not an object of named entries")
    return data


def read_state_dict(model_dir: Path, device=None, dtype=None) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's single or sharded safetensors, read onto `device` and cast to `dtype` one
    tensor at a time (so a bf16 load of fp32 files never holds two copies of the model)."""
    from safetensors import SafetensorError, safe_open
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, "a shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index} has no weight_map of tensor names to file names")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    state = {}
    for name in files:
        path = model_dir / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} is listed in the shard index but missing")
        try:
            with safe_open(path, framework="pt", device=str(device or "cpu")) as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    state[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ValueError(f"{path} is corrupt or truncated: {e}") from None
    return state


def read_config(model_dir: str | Path) -> LlamaConfig:
    """The config of a Hugging Face style folder, without its weights."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model folder")
    return LlamaConfig.from_hf(read_json_object(model_dir / "config.json", "a model config"))


def load_model(model_dir: str | Path, device=None, dtype=torch.float32, rope_theta: float | None = None) -> Llama:
    """Build the model of a Hugging Face style folder with its weights, strictly: any missing, unexpected or
    mis-shaped tensor is an error naming it. `rope_theta` overrides the config's base."""
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    if rope_theta is not None:
        if not rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {rope_theta}")
        cfg.rope_theta = rope_theta
    device = torch.device(device) if device is not None else torch.get_default_device()  # "cpu" unless set otherwise
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} asked for, but this machine has no CUDA (torch {torch.__version__})")
    with torch.device("meta"):
        model = Llama(cfg)
    state = read_state_dict(model_dir, device, dtype)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    expected = {k: v.shape for k, v in model.state_dict().items()
                if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(k for k in set(state) - set(expected) if not k.endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise ValueError(f"{model_dir}: weights do not match the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for k, shape in expected.items():
        if state[k].shape != shape:
            raise ValueError(f"{model_dir}: tensor {k} has shape {tuple(state[k].shape)}, the config implies "
                             f"{tuple(shape)}")
    model.load_state_dict(state, strict=False, assign=True)  # strictness checked above, tied head included
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)
    model.model_dir = model_dir
    return model.eval()
