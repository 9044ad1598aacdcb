"""Mean and covariance of bulk keys per (layer, KV head): what QAdA's Gaussian estimate needs (paper 3.2, App. B).

Option 1, `PromptMoments`: the current prompt's bulk keys (positions n_sink .. T - n_recent), computed
after prefill and kept exact during decoding with a Welford update, O(D^2) per layer and step, as keys
leave the recent window and join the bulk.

Option 2, `RandomWordsMoments` (the paper's robust default): keys from one forward pass over a seeded
random-words prompt as long as the model's context, run once per model and key-changing setting and
cached on disk. For a prompt of length T the moments come from the random prompt's first T - 1024 keys
(the paper's rule: moments from a somewhat shorter prompt are harmless, from a longer one harmful). The
cache stores the moments at 32 evenly spaced lengths (not the keys), so its size is bounded:
32 * L * Hkv * (D + D^2) * 4 bytes = 48 MB for SmolLM2-135M, 541 MB for Llama-3-8B at 32k.
"""

import hashlib
import json
import math
import os
import random
from pathlib import Path

import torch

from criterion import gaussian_form

MOMENTS_VERSION = 1  # bump when the file layout or the way moments are computed changes
N_CHECKPOINTS = 32
LENGTH_MARGIN = 1024  # the paper's T - 1024


def mean_cov(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Population mean (..., D) and covariance (..., D, D) of keys (..., N, D), in fp32 (the paper's 1/N)."""
    k = keys.float()
    mean = k.mean(-2)
    centred = k - mean[..., None, :]
    return mean, centred.transpose(-1, -2) @ centred / k.shape[-2]


class PromptMoments:
    """Option 1: moments of the current prompt's bulk keys, kept up to date as the context grows."""

    def __init__(self, cache, n_sink: int = 16, n_local: int = 128):
        self.n_sink, self.n_recent = n_sink, n_local - n_sink
        L, _, Hkv, _, D = cache.k.shape
        end = max(cache.length - self.n_recent, n_sink)  # bulk = [n_sink, end)
        bulk = cache.k[:, 0, :, n_sink:end]  # (L, Hkv, N, D)
        self.count = torch.full((L,), end - n_sink, dtype=torch.long)
        if end > n_sink:
            self.mean, cov = mean_cov(bulk)
        else:
            self.mean, cov = torch.zeros(L, Hkv, D, device=cache.k.device), torch.zeros(L, Hkv, D, D, device=cache.k.device)
        self.m2 = cov * (end - n_sink)  # Welford's co-moment: sum of outer products of centred keys

    def add(self, layer: int, key: torch.Tensor) -> None:
        """Welford update of one layer with one new bulk key per KV head, key (Hkv, D)."""
        key = key.float()
        self.count[layer] += 1
        delta = key - self.mean[layer]
        self.mean[layer] += delta / int(self.count[layer])
        self.m2[layer] += delta[:, :, None] * (key - self.mean[layer])[:, None, :]

    def layer(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean (Hkv, D), cov (Hkv, D, D)) of the bulk of k (Hkv, T, D), the layer's filled cache."""
        end = k.shape[-2] - self.n_recent
        have = self.n_sink + int(self.count[layer])
        if end < have:
            raise ValueError("the KV cache was rolled back below these moments; build new PromptMoments")
        for pos in range(have, end):  # one key per decode step
            self.add(layer, k[:, pos])
        n = max(int(self.count[layer]), 1)
        return self.mean[layer], self.m2[layer] / n

    def gaussian(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """criterion.gaussian_form of the current moments: (A (Hkv, D, D), b (Hkv, D))."""
        return gaussian_form(*self.layer(layer, k))


class FixedMoments:
    """Moments that do not change during decoding (Option 2 after choosing the length)."""

    def __init__(self, mean: torch.Tensor, cov: torch.Tensor, n_keys: int):
        self.mean, self.cov, self.n_keys = mean, cov, n_keys  # (L, Hkv, D), (L, Hkv, D, D)
        A, b = gaussian_form(mean, cov)  # once for the whole generation: decoding only indexes a list
        self.forms = list(zip(A.unbind(0), b.unbind(0)))

    def layer(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mean[layer], self.cov[layer]

    def gaussian(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forms[layer]


# ---------------------------------------------------------------------------------------------------------
# Option 2


def random_words_text(n_words: int, seed: int) -> str:
    """n_words English words drawn with replacement from wonderwords' packaged lists, seeded."""
    from importlib.resources import files
    words = []
    for name in ("nounlist.txt", "verblist.txt", "adjectivelist.txt"):
        words += (files("wonderwords") / "assets" / name).read_text(encoding="utf-8").split()
    return " ".join(random.Random(seed).choices(sorted(set(words)), k=n_words))


def model_identity(model) -> dict:
    """What makes the keys of `model` what they are: weights files (names, sizes, first bytes), config, dtype."""
    model_dir = Path(model.model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for p in sorted(model_dir.glob("*.safetensors")):
        with open(p, "rb") as f:
            h.update(f"{p.name}:{p.stat().st_size}".encode() + f.read(1 << 20))
    cfg = model.cfg
    return {"weights": h.hexdigest()[:16], "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
            "dtype": str(model.dtype).removeprefix("torch.")}


class RandomWordsMoments:
    """Moments of a random-words prompt's keys at N_CHECKPOINTS lengths; `for_prompt(T)` picks one."""

    def __init__(self, ends: list[int], mean: torch.Tensor, cov: torch.Tensor, settings: dict):
        self.ends = ends  # bulk keys [n_sink, end) at each checkpoint
        self.mean, self.cov = mean, cov  # (K, L, Hkv, D), (K, L, Hkv, D, D)
        self.settings = settings

    def for_prompt(self, T: int) -> FixedMoments:
        """Moments from the first T - 1024 keys; prompts shorter than that use the shortest checkpoint."""
        target = T - LENGTH_MARGIN
        i = max([j for j, e in enumerate(self.ends) if e <= target], default=0)
        return FixedMoments(self.mean[i], self.cov[i], self.ends[i] - self.settings["n_sink"])

    def to(self, device) -> "RandomWordsMoments":
        return RandomWordsMoments(self.ends, self.mean.to(device), self.cov.to(device), self.settings)


def random_words_settings(model, tokenizer, n_tokens: int | None = None, seed: int = 0, n_sink: int = 16,
                          words: str = "random") -> dict:
    """Every setting that changes the cached moments: the cache key."""
    n_tokens = n_tokens or model.cfg.max_position_embeddings
    return {"version": MOMENTS_VERSION, "model": model_identity(model), "n_tokens": n_tokens, "seed": seed,
            "n_sink": n_sink, "words": words, "tokenizer": hashlib.sha256(tokenizer.encode(
                "The quick brown fox, 1234 times.", add_special_tokens=True).__repr__().encode()).hexdigest()[:8]}


def compute_random_words_moments(model, tokenizer, settings: dict, progress: bool = True) -> RandomWordsMoments:
    """One dense forward pass over the prompt; moments of its bulk keys at N_CHECKPOINTS lengths."""
    n_tokens, n_sink = settings["n_tokens"], settings["n_sink"]
    if settings["words"] == "random":
        text = random_words_text(2 * n_tokens, settings["seed"])  # surely more than n_tokens tokens
    else:  # the paper's "single word" ablation: one word repeated
        text = " ".join([settings["words"]] * (2 * n_tokens))
    ids = tokenizer.encode(text, add_special_tokens=True)[:n_tokens]
    ids = torch.tensor([ids], device=model.device)
    cache = model.new_cache(ids.shape[1])
    model.prefill(ids, cache, progress=progress)
    stride = math.ceil((n_tokens - n_sink) / N_CHECKPOINTS)
    ends = [min(n_sink + stride * (i + 1), n_tokens) for i in range(N_CHECKPOINTS)]
    # Running sums in float64 so that one pass gives every checkpoint's covariance exactly.
    L, _, Hkv, _, D = cache.k.shape
    s1 = torch.zeros(L, Hkv, D, dtype=torch.float64, device=model.device)
    s2 = torch.zeros(L, Hkv, D, D, dtype=torch.float64, device=model.device)
    means, covs, start = [], [], n_sink
    for end in ends:
        k = cache.k[:, 0, :, start:end].double()  # (L, Hkv, n, D)
        s1 += k.sum(-2)
        s2 += k.transpose(-1, -2) @ k
        n = end - n_sink
        mean = s1 / n
        means.append(mean.float())
        covs.append((s2 / n - mean[..., :, None] * mean[..., None, :]).float())
        start = end
    return RandomWordsMoments(ends, torch.stack(means), torch.stack(covs), settings)


def load_or_compute_random_words_moments(model, tokenizer, cache_root: Path | None = None, progress: bool = True,
                                         **kwargs) -> RandomWordsMoments:
    """The cached moments for this model and these settings, computing and caching them on first use."""
    from cache import cache_dir
    settings = random_words_settings(model, tokenizer, **kwargs)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:20]
    path = Path(cache_root or cache_dir() / "moments") / f"{key}.pt"
    if path.is_file():
        data = torch.load(path, map_location=model.device, weights_only=True)
        if data["settings"] == json.loads(json.dumps(settings)):  # never serve a file made with other settings
            return RandomWordsMoments(data["ends"], data["mean"], data["cov"], data["settings"])
    if progress:
        print(f"computing random-words key moments ({settings['n_tokens']} tokens, once per model and setting)...")
    m = compute_random_words_moments(model, tokenizer, settings, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    torch.save({"settings": settings, "ends": m.ends, "mean": m.mean.cpu(), "cov": m.cov.cpu()}, tmp)
    os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
    return m
