"""Mean and covariance of bulk keys per (layer, KV head): what QAdA's Gaussian estimate needs (paper 3.2, App. B).

Every source hands QAdA the same thing, a `KeyMoments`: for a layer, Eq. 6's quadratic form in the query.

    prompt          Option 1 (App. B): the current prompt's bulk keys (positions n_sink .. T - (n_local - n_sink)),
                    computed once after prefill and kept fixed while decoding, as the paper does.
    prompt-online   Option 1 kept exact while decoding (ours, not the paper's): a Welford update, O(D^2) per
                    layer and step, as each key leaves the recent window and joins the bulk.
    random-words    Option 2 (the paper's default): keys of a seeded random-words prompt. For a prompt of T
                    tokens the moments come from the reference prompt's first T - 1024 positions (sinks left
                    out), exactly; the paper's reason: a shorter reference is harmless, a longer one harmful.
                    Prompts shorter than 1024 + T_local take the T_local first positions, whatever their own
                    bulk's size (reference_end).
    one-word        Option 2 with one word repeated (the paper's "single words" ablation, Fig. 5e-f).
    random-words-full  Option 2 over the whole context allowed (--max-context, default the model's), longer than
                    any prompt (Fig. 5g's ablation).

Option 2's reference keys are computed by one dense forward pass and cached on disk (in the folder `root`). A
causal model's keys at the first n positions depend on the first n tokens only, so the pass runs only as far as the
prompts seen so far need (rounded up to a multiple of 1024 positions, so that a sweep of prompts of similar
lengths computes it once) and is run again, longer, when a longer prompt comes. For the same reason one file serves
every context length (--max-context): the reference prompt of a shorter context is a prefix of a longer one's, and
the file keeps the ids its keys were computed from, so that a prefix that differs is never served. It is mapped into
memory, not read whole: a short context reads only its part of a long context's file.
"""

import hashlib
import json
import math
import os
import random
import sys
from importlib.resources import files
from pathlib import Path
from typing import Protocol

import torch

from criterion import gaussian_form

SOURCES = ("random-words", "prompt", "prompt-online", "one-word", "random-words-full")
REFERENCE_VERSION = 3  # bump when the file layout or the way the reference keys are computed changes
LENGTH_MARGIN = 1024  # the paper's T - 1024
ROUND = 1024  # the reference pass is run to a multiple of this many positions
ONE_WORD = "the"


class KeyMoments(Protocol):
    """What QAdA asks of the keys' moments, per layer; `k` (Hkv, T, D) is that layer's filled KV cache."""

    def quadratic_form(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 6 as (A (Hkv, D, D), b (Hkv, D)) with mu_s + sigma_s^2 / 2 = q A q^T + q b (criterion.gaussian_form)."""

    def mean_cov(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The moments themselves: mean (Hkv, D), covariance (Hkv, D, D); for analysis."""


def mean_cov(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Population mean (..., D) and covariance (..., D, D) of keys (..., N, D), in fp32 (the paper's 1/N)."""
    if keys.shape[-2] == 0:
        raise ValueError("moments of no keys asked for")
    k = keys.float()
    mean = k.mean(-2)
    centred = k - mean[..., None, :]
    return mean, centred.transpose(-1, -2) @ centred / k.shape[-2]


class FixedMoments:
    """Moments that do not change while decoding: Option 1 as the paper runs it, and Option 2."""

    def __init__(self, mean: torch.Tensor, cov: torch.Tensor, n_keys: int):
        self.mean, self.cov, self.n_keys = mean, cov, n_keys  # (L, Hkv, D), (L, Hkv, D, D)
        A, b = gaussian_form(mean, cov)  # once per generation: a decode step only indexes a list
        self.forms = list(zip(A.unbind(0), b.unbind(0)))

    def quadratic_form(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forms[layer]

    def mean_cov(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mean[layer], self.cov[layer]


def bulk_end(T: int, n_sink: int, n_local: int) -> int:
    """End of the bulk [n_sink, end) of a context of T positions: the recent n_local - n_sink are the window's."""
    return max(T - (n_local - n_sink), n_sink)


def prompt_moments(cache, n_sink: int = 16, n_local: int = 128) -> FixedMoments | None:
    """Option 1 as the paper runs it: the moments of the prefilled prompt's bulk (row 0 of `cache`), fixed.
    None when the prompt has no bulk (T <= n_local): decoding then starts exact and OnlineMoments takes over."""
    end = bulk_end(cache.length, n_sink, n_local)
    if end <= n_sink:
        return None
    mean, cov = mean_cov(cache.k[:, 0, :, n_sink:end])  # (L, Hkv, N, D) -> (L, Hkv, D), (L, Hkv, D, D)
    return FixedMoments(mean, cov, end - n_sink)


class OnlineMoments:
    """Option 1 kept exact as the context grows (ours): each key that leaves the recent window joins the bulk
    through Welford's update; starts from the prefilled prompt's bulk (row 0 of `cache`), empty or not."""

    def __init__(self, cache, n_sink: int = 16, n_local: int = 128):
        self.n_sink, self.n_local = n_sink, n_local
        L, _, Hkv, _, D = cache.k.shape
        end = bulk_end(cache.length, n_sink, n_local)
        self.count = [end - n_sink] * L  # bulk keys absorbed so far, per layer
        if end > n_sink:
            self.mean, cov = mean_cov(cache.k[:, 0, :, n_sink:end])
            self.m2 = cov * (end - n_sink)  # Welford's co-moment: sum of outer products of centred keys
        else:
            self.mean = torch.zeros(L, Hkv, D, device=cache.k.device)
            self.m2 = torch.zeros(L, Hkv, D, D, device=cache.k.device)

    def _absorb(self, layer: int, k: torch.Tensor) -> None:
        """Welford update with the keys of k (Hkv, T, D) that joined the bulk since the last call."""
        have, end = self.n_sink + self.count[layer], bulk_end(k.shape[-2], self.n_sink, self.n_local)
        if end < have:
            raise ValueError("the KV cache is shorter than the keys these moments absorbed (rolled back?); "
                             "make new OnlineMoments")
        for pos in range(have, end):  # one key per decode step
            key = k[:, pos].float()  # (Hkv, D)
            self.count[layer] += 1
            delta = key - self.mean[layer]
            self.mean[layer] += delta / self.count[layer]
            self.m2[layer] += delta[:, :, None] * (key - self.mean[layer])[:, None, :]

    def mean_cov(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._absorb(layer, k)
        return self.mean[layer], self.m2[layer] / max(self.count[layer], 1)

    def quadratic_form(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gaussian_form(*self.mean_cov(layer, k))


# ---------------------------------------------------------------------------------------------------------
# Option 2: keys of a reference prompt


def random_words_text(n_words: int, seed: int) -> str:
    """n_words English words drawn with replacement from wonderwords' packaged lists, seeded."""
    words = []
    for name in ("nounlist.txt", "verblist.txt", "adjectivelist.txt"):
        words += (files("wonderwords") / "assets" / name).read_text(encoding="utf-8").split()
    return " ".join(random.Random(seed).choices(sorted(set(words)), k=n_words))


def model_identity(model) -> dict:
    """What makes the keys of `model` what they are: weights files (names, sizes, first bytes), config, dtype. A model
    not read from a folder of ours states its own (`model.identity`: a transformers model through the adapter)."""
    if hasattr(model, "identity"):
        return model.identity
    model_dir = Path(model.model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for p in sorted(model_dir.glob("*.safetensors")):
        with open(p, "rb") as f:
            h.update(f"{p.name}:{p.stat().st_size}".encode() + f.read(1 << 20))
    cfg = model.cfg
    return {"weights": h.hexdigest()[:16], "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
            "dtype": str(model.dtype).removeprefix("torch.")}


def reference_end(T: int, n_sink: int, n_local: int) -> int:
    """Option 2's rule: the reference prompt's bulk is [n_sink, end) for a prompt of T positions: the first
    T - 1024 positions, never more than the prompt's own bulk, but at least n_local. The floor wins where the two
    meet: a prompt whose bulk is shorter than n_local (or still forming while decoding) takes the n_local first, so
    the reference never shrinks as the prompt grows (one key, covariance zero, at T = n_local + 1 otherwise)."""
    return max(min(T - LENGTH_MARGIN, bulk_end(T, n_sink, n_local)), n_local)


SHARED = 8  # Option 2 moments a ReferenceKeys keeps for reuse: a batch's distinct prompt lengths, say


class ReferenceKeys:
    """Keys (L, Hkv, N, D) of the first N positions of a reference prompt, computed as far as needed."""

    def __init__(self, model, tokenizer, words: str = "random", seed: int = 0, n_max: int | None = None,
                 root: Path | None = None, progress: bool = True):
        """`root`: the folder of the on-disk cache (one file per model and reference prompt); None keeps the keys
        in memory only."""
        self.model, self.progress = model, progress
        n_max = n_max or model.cfg.max_position_embeddings  # more with a RoPE theta override
        # The ids of the whole context are fixed first, so every length is a prefix of the same sequence.
        text = random_words_text(2 * n_max, seed) if words == "random" else " ".join([words] * (2 * n_max))
        self.ids = tokenizer.encode(text, add_special_tokens=True)[:n_max]
        # n_max is not among the settings: the file serves every context length, its ids checked on loading.
        self.settings = {"version": REFERENCE_VERSION, "model": model_identity(model), "words": words, "seed": seed}
        key = hashlib.sha256(json.dumps(self.settings, sort_keys=True).encode()).hexdigest()[:20]
        self.path = Path(root) / f"{key}.pt" if root is not None else None
        # (L, Hkv, N, D) in the model's dtype: on the model's device when computed here, mapped from the file on the
        # CPU when read from it (the file may hold a longer context than this one: what is read is what is used)
        self.keys = None
        if self.path is not None and self.path.is_file():
            data = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
            n = min(len(self.ids), data["ids"].numel())  # the file's keys cover data["ids"] (N,)
            same_ids = data["ids"][:n].tolist() == self.ids[:n]  # another tokenizer's ids differ
            if data["settings"] == json.loads(json.dumps(self.settings)) and same_ids:  # never serve other keys
                self.keys = data["keys"]
        self.passes = 0  # forward passes run by this object (what a test checks the rule "only as needed" by)
        self.shared = {}  # (end, n_sink) -> FixedMoments, the last SHARED made (bulk_moments)

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def ensure(self, n: int) -> torch.Tensor:
        """The keys of the first n positions (at least), running the reference pass further if needed."""
        if n > len(self.ids):
            raise ValueError(f"the reference prompt has {len(self.ids)} positions; {n} asked for")
        if n > self.length:
            n_run = min(math.ceil(n / ROUND) * ROUND, len(self.ids))
            if self.progress:
                print(f"computing reference keys ({self.settings['words']} words, {n_run} positions)...",
                      file=sys.stderr)  # progress, as tqdm's: stdout is the answer's
            cache = self.model.new_cache(n_run)
            ids = torch.tensor([self.ids[:n_run]], device=self.model.device)
            self.model.prefill(ids, cache, progress=self.progress)
            self.keys, self.passes = cache.k[:, 0], self.passes + 1  # (L, Hkv, n_run, D)
            if self.path is None:
                return self.keys[:, :, :n]
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.tmp{os.getpid()}")
            ids = torch.tensor(self.ids[:n_run], dtype=torch.int32)
            torch.save({"settings": self.settings, "ids": ids, "keys": self.keys.cpu()}, tmp)
            os.replace(tmp, self.path)  # atomic: a reader sees the old file or the whole new one
        return self.keys[:, :, :n].to(self.model.device)  # a copy only of what a file on the CPU serves a GPU

    def bulk_moments(self, end: int, n_sink: int = 16) -> FixedMoments:
        """Moments of the reference keys at positions [n_sink, end), one object for the prompts of one length: a batch
        of them then reads one quadratic form per layer and KV head, not a copy per row (attention.stacked_forms).
        The last SHARED are kept, so that a sweep over many lengths does not keep them all."""
        key = (end, n_sink)
        if key not in self.shared:
            self.shared[key] = FixedMoments(*mean_cov(self.ensure(end)[:, :, n_sink:end]), end - n_sink)  # (L,Hkv,N,D)
            while len(self.shared) > SHARED:
                self.shared.pop(next(iter(self.shared)))  # the oldest
        return self.shared[key]

    def for_prompt(self, T: int, n_sink: int = 16, n_local: int = 128) -> FixedMoments:
        """Option 2's moments for a prompt of T positions (reference_end)."""
        return self.bulk_moments(reference_end(T, n_sink, n_local), n_sink)


def make_moments(source: str, cache, reference: ReferenceKeys | None = None, n_sink: int = 16,
                 n_local: int = 128) -> KeyMoments:
    """The moments of `source` (SOURCES) for the prompt prefilled in `cache`; Option 2 needs its `reference`
    (reference_words(source) says which). A prompt with no bulk at prefill (T <= n_local) has no Option 1
    moments to fix: its bulk forms while decoding, and is then followed online."""
    if source not in SOURCES:
        raise ValueError(f"unknown moments source {source!r}; choose from {', '.join(SOURCES)}")
    if source == "prompt":
        return prompt_moments(cache, n_sink, n_local) or OnlineMoments(cache, n_sink, n_local)
    if source == "prompt-online":
        return OnlineMoments(cache, n_sink, n_local)
    if reference is None:
        raise ValueError(f"moments source {source!r} needs the reference prompt's keys (ReferenceKeys)")
    if source == "random-words-full":
        return reference.bulk_moments(len(reference.ids), n_sink)
    return reference.for_prompt(cache.length, n_sink, n_local)


def reference_words(source: str) -> str | None:
    """Which reference prompt a source reads: "random", ONE_WORD, or None (the prompt's own keys)."""
    return {"random-words": "random", "random-words-full": "random", "one-word": ONE_WORD}.get(source)
