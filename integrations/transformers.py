"""QAdA inside a Hugging Face transformers model: `model.generate` decodes every token with the very path of
attention.PATHS (paper Listing 1 and our variants), through transformers' public attention interface
(`AttentionInterface.register`); nothing of transformers is patched.

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from integrations.transformers import enable, disable

    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    qada = enable(model, "qada_cal", calibration="qwen2.5-coder-0.5b", tokenizer=tok)  # at its stored tau
    out = model.generate(**tok(prompt, return_tensors="pt"), max_new_tokens=64, do_sample=False)
    print(qada.report(out))  # heads labelled local (sparsity) and KV entries read, as generate.py prints them
    disable(model)

enable() registers one attention function, an `HFAttention`, under a name of its own (with transformers' SDPA mask)
and sets the model's attn_implementation to it. transformers hands it, per layer, the module (module.layer_idx is the
layer), the rotated queries (B, H, Tq, D) and the layer's filled cache k, v (B, Hkv, T, D) after the cache update:

    prefill (Tq > 1, or a fresh cache)  transformers' own sdpa function; the prompt's length, its left padding and,
                                        for Option 1, its keys are noted
    decode  (Tq = 1)                    the DecodeAttention generate.py builds (attention.build_attention), one per
                                        row (a BatchAttention for a batch) -> attention.run_path -> PATHS[method]
                                        (the fused kernel on CUDA), on one row's q (H, D) and k, v (Hkv, T, D)

Moments (Eq. 6) come from the model itself, at the same function: Option 1 (`prompt`, `prompt-online`) from the
prompt's keys as the cache holds them after prefill; Option 2 (`random-words`, ...) from moments.ReferenceKeys run on
`HFModel` (the transformers model seen as ours: a KVCache, prefill, decode_step), cached on disk under the model's
identity. `HFModel` is also how lab.calibrate fits a correction through this adapter (--hf).

Scope: transformers' llama, mistral and qwen2 models without a layer that slides over a window shorter than the context;
its default DynamicCache; batches padded on the left; greedy decoding, sampling, and beam search with the paths that
keep nothing per row (a page path's index and online moments follow each row's keys, which beam search reorders: refused
there); prefill in chunks (prefill_chunk_size), where a last chunk of one token is, to an attention function, a decode
step: it is decoded by the path and counted as the first step. Right padding, static caches, and assisted or
prompt-lookup decoding (several tokens a pass) are refused with one line; without a cache (use_cache=False, or a forward
of the whole sequence) every pass is a prefill: dense, and the report says no decode step ran; prefill runs on SDPA (not
flash-attention), decode eagerly, launch by launch (no CUDA graphs or torch.compile here; the torch paths read their
labels to the host, the fused kernel does not). Quantized and paged caches are not supported and not checked for. A
model offloaded in part by accelerate's device_map runs: the correction's weights check and the reference keys' identity
read the offloaded weights' values. Tested with transformers 5.25. """

import dataclasses
import hashlib
import json
import math
import re
import weakref
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.utils import logging as hf_logging

from attention import BatchAttention, build_attention, bulk_estimate, missing_inputs, path_inputs
from criterion import Calibration, check_calibration, check_tau, check_window, weights_probe
from decode_kernels import check_kernel
from generate import default_tau, inputs_said, read_calibration
from model import KVCache, LlamaConfig
from moments import SOURCES, OnlineMoments, ReferenceKeys, reference_words
from weights.checkpoints import MODELS, shipped_calibration
from weights.downloads import cache_dir

FAMILY = ("llama", "mistral", "qwen2")  # transformers' model types the adapter takes (model.py's scope)
PADDING = ("the QAdA adapter takes batches padded on the left (tokenizer.padding_side = 'left') and transformers' "
           "default DynamicCache; this mask leaves positions inside the cache unattended (right padding, or a static "
           "cache)")
REORDERED = ("the cache's rows were reordered between two decode steps (beam search): the {} path keeps {} per row, "
             "which would no longer be the row's; generate with num_beams=1, or with a path that keeps nothing per row "
             "(qada_cal, say)")


def llama_config(model) -> LlamaConfig:
    """The shape of a transformers model as model.LlamaConfig (whose from_hf refuses sliding windows shorter than the
    context); ValueError with one line for a model of another architecture."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FAMILY:
        raise ValueError(f"{type(model).__name__} (model_type {kind!r}) is not a Llama-family decoder: the QAdA "
                         f"adapter takes {', '.join(FAMILY)} models (rotary keys, grouped-query attention)")
    return LlamaConfig.from_hf(config.to_dict())


@contextmanager
def onloaded(model, names: list[str]):
    """The parameters and buffers `names` of `model` (state_dict names) hold their values while the block runs: where
    accelerate's device_map offloaded them ("cpu" or "disk": on the meta device, their values in its hooks), their
    modules are brought onto their execution device, as their forward would, and sent back after."""
    modules = {model.get_submodule(name.rpartition(".")[0]) for name in names}
    offloaded = [m for m in modules if any(t.is_meta for t in [*m.parameters(False), *m.buffers(False)])]
    if not offloaded:
        yield
        return
    from accelerate.utils import align_module_device  # whatever offloaded the model is installed

    with ExitStack() as stack:
        for module in offloaded:
            stack.enter_context(align_module_device(module))
        yield


def held_device(model) -> torch.device:
    """The device the model computes on: its first parameter's, passing over those offloaded to the meta device (an
    offloaded embedding runs on the device its hook brings it to, the one the rest of the model holds)."""
    device = next((p.device for p in model.parameters() if not p.is_meta), None)
    if device is None:
        raise ValueError("every parameter of the model is offloaded (on the meta device): keep some of it on the "
                         "device it should decode on")
    return device


def offloaded_probe(model) -> list[float]:
    """criterion.weights_probe of a model that may lie partly offloaded: its first and last k_proj onloaded."""
    layers = {int(m[1]): name for name, _ in model.named_parameters()
              if (m := re.search(r"layers\.(\d+)\.self_attn\.k_proj\.weight$", name))}
    with onloaded(model, [layers[min(layers)], layers[max(layers)]] if layers else []):
        return weights_probe(model)


def left_padding(mask: torch.Tensor | None, T: int) -> list[int] | None:
    """Each row's first attended position from transformers' 4D mask (B, 1, Tq, T), read at the last query: None when
    there is no mask (no padding). ValueError unless every row attends to one run of positions that ends at T."""
    if mask is None:
        return None
    valid = mask[:, 0, -1, :T]  # (B, T)
    valid = valid if valid.dtype == torch.bool else valid == 0  # a float mask adds 0 where attended
    start = T - valid.sum(-1)  # (B,)
    if not torch.equal(valid, torch.arange(T, device=valid.device) >= start[:, None]):
        raise ValueError(PADDING)
    start = start.tolist()
    return start if any(start) else None


@dataclasses.dataclass
class Prompt:
    """One row's prefilled prompt as build_attention reads a cache (make_moments, pages.PageIndex): its length and,
    for Option 1 and the page paths, its keys (L, 1, Hkv, T, D)."""
    length: int
    k: torch.Tensor | None = None

    @property
    def max_len(self) -> int:  # what a PageIndex sizes its tables by (they grow as decoding goes on)
        return self.length


class HFAttention:
    """The attention function enable() registers for one model, and what it keeps: the method with what its path
    reads, the current generation's attention per row (its statistics: `rows`, `summary`, `report`)."""

    def __init__(self, model, method: str, tau: float | None, calibration, moments, tokenizer, n_sink: int,
                 n_local: int, inputs: dict):
        self.cfg = llama_config(model)  # the model itself is not kept: transformers' registry keeps this object
        self.method, self.n_sink, self.n_local = method, n_sink, n_local
        reads = path_inputs(method)  # ValueError naming the methods for an unknown one
        device = self.device = held_device(model)  # where the correction, labels and reference keys are read onto
        given = [name for name in inputs if name not in reads]
        given += [name for name, value in (("tau", tau), ("calibration", calibration), ("moments", moments))
                  if value is not None and name not in reads]
        if given:
            raise ValueError(f"{given[0]}: the {method} path does not read it (it reads "
                             f"{', '.join(reads) or 'nothing'})")
        correction, name = self.read_calibration(calibration) if "calibration" in reads else (None, None)
        if moments is None:  # a correction fixes the moments it corrects (as in generate.py); else the paper's Option 2
            moments = correction.settings.get("moments_source", "random-words") if correction else "random-words"
        if isinstance(moments, str) and moments not in SOURCES:
            raise ValueError(f"unknown moments source {moments!r}; choose from {', '.join(SOURCES)}")
        if not isinstance(moments, str) and not hasattr(moments, "quadratic_form"):
            raise ValueError("moments: a name of moments.SOURCES or a moments.KeyMoments, got "
                             f"{type(moments).__name__}")
        check_window(n_sink, n_local)
        self.moments_source = moments if isinstance(moments, str) else None
        # Option 1 and the page paths read the prompt's keys: prefill keeps each layer's until the first decode step
        # builds the moments or the page index
        self.keeps_prompt = ("moments" in reads and self.moments_source in ("prompt", "prompt-online")
                             or "pages" in reads)
        if "moments" in reads and not isinstance(moments, str):
            inputs = dict(inputs, moments=moments)  # a KeyMoments of the caller's
        if correction is not None:
            cfg = self.cfg
            check_calibration(correction, name, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                              n_sink, n_local, self.moments_source, bulk_estimate(method), offloaded_probe(model))
            inputs["calibration"] = correction.to(device)
        if tau is not None:
            check_tau(tau)
        self.tau, self.tau_from = (tau, "given") if tau is not None else default_tau(method, inputs.get("calibration"))
        if "tau" in reads:
            inputs["tau"] = self.tau
        if inputs.get("static_local") is not None:
            shape = (self.cfg.num_hidden_layers, self.cfg.num_attention_heads)
            local = inputs["static_local"]
            if not (isinstance(local, torch.Tensor) and local.dtype == torch.bool and tuple(local.shape) == shape):
                raise ValueError(f"static_local: a bool tensor (layers, heads) = {shape}, one label per head, got "
                                 + (f"{local.dtype} {tuple(local.shape)}" if isinstance(local, torch.Tensor)
                                    else type(local).__name__))
            inputs["static_local"] = local.to(device)
        made_here = ("layer", "n_sink", "n_local", "tau", "moments", "calibration", "pages")  # the rest is the caller's
        missing = missing_inputs(method, inputs, made_here)  # and a budget that is no number: now, not after prefill
        if missing:
            raise ValueError(f"the {method} path reads {', '.join(missing)}: give enable(model, {method!r}, "
                             + ", ".join(f"{name}=..." for name in missing) + ")")
        words = reference_words(self.moments_source) if "moments" in reads and self.moments_source else None
        self.reference = None  # Option 2: the reference prompt's keys, run through this very function
        if words:
            if tokenizer is None:
                raise ValueError(f"{self.moments_source} moments tokenize a reference prompt: give "
                                 "enable(model, tokenizer=...) (the model's tokenizer)")
            try:  # what the reference prompt asks of it, tried on one word
                tokenizer.encode("a", add_special_tokens=True)
            except (AttributeError, TypeError):
                raise ValueError("tokenizer: the model's tokenizer, whose encode(text, add_special_tokens=True) makes "
                                 f"the reference prompt; got a {type(tokenizer).__name__}") from None
            quiet = hf_logging.get_verbosity()  # a transformers tokenizer warns of the reference text's length
            hf_logging.set_verbosity_error()
            try:
                self.reference = ReferenceKeys(HFModel(model, self), tokenizer, words, root=cache_dir() / "moments",
                                               progress=False)
            finally:
                hf_logging.set_verbosity(quiet)
        self.inputs = inputs
        self.model = weakref.ref(model)  # report(sequences) reads its generation_config then (a weak ref: see above)
        self.name, self.previous = None, None
        self.store, self.hook = None, None  # HFModel's forward: our KVCache keeps the keys, `hook` decodes
        self.rows, self.decoder = [], None  # this generation's attention per row, and what decodes the batch
        self.prompt, self.starts, self.prompt_len = None, None, None  # the last prefill's keys, padding and length
        # A row's page index and online moments follow its own keys; beam search reorders the cache's rows under
        # them. The last layer's newest key (B, Hkv, D), seen again one step later, says whether that happened:
        # refused at once where a row keeps such state, else noted (`moved`, on the device: no sync per step) for
        # report(sequences), whose rows then are not the cache's
        self.follows_rows, self.last_key, self.moved = False, None, False

    def read_calibration(self, calibration) -> tuple[Calibration, str]:
        """The correction a qada*_cal path reads, and its name in error messages: a Calibration, a file or a
        lab.calibrate folder, or a named model (weights.checkpoints) whose shipped one it takes; __init__ checks it
        against the model (its shape, and its weights by their criterion.weights_probe), the window and the moments."""
        if calibration is None:
            raise ValueError(f"the {self.method} path reads a calibration: give enable(model, calibration=FILE) "
                             f"(made by python -m lab.calibrate --qada --hf MODEL), or a named model's "
                             f"({', '.join(m for m in MODELS if shipped_calibration(m))})")
        if isinstance(calibration, str) and calibration in MODELS:
            if shipped_calibration(calibration) is None:
                raise ValueError(f"{calibration} ships no calibration")
            calibration = shipped_calibration(calibration)
        if isinstance(calibration, Calibration):
            c = calibration  # the report names it "given"
            return Calibration(c.a, c.b, c.s, dict(c.settings, file=c.settings.get("file", "given"))), \
                "the given calibration"
        c = read_calibration(str(calibration), self.method, "calibration")
        return c, c.settings["file"]

    # -----------------------------------------------------------------------------------------------------
    # What transformers calls, per layer

    def __call__(self, module, query, key, value, attention_mask, scaling: float | None = None, dropout: float = 0.0,
                 **kwargs):
        """query (B, H, Tq, D), key/value (B, Hkv, T, D) -> attention output (B, Tq, H, D), no weights."""
        layer = module.layer_idx
        if self.store is not None:  # HFModel: the keys go into our KVCache, which gives the filled views back
            start = self.store.length
            key, value = self.store.write(layer, key, value)
            if query.shape[2] > 1:
                mask = None if start == 0 else torch.ones(query.shape[2], key.shape[2], dtype=torch.bool,
                                                          device=query.device).tril(diagonal=start)
                return sdpa(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
            if self.hook is None:  # dense
                return sdpa(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
            return self.hook(query, key, value, layer).transpose(1, 2), None
        if query.shape[2] > 1 or key.shape[2] == query.shape[2]:  # a prompt (of one token too): dense, as in the paper
            self.prefilled(layer, key, attention_mask)
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        D = query.shape[-1]
        if scaling is not None and not math.isclose(scaling, D ** -0.5, rel_tol=1e-6):
            raise ValueError(f"layer {layer} scales its scores by {scaling}, the paths by 1/sqrt({D})")
        # a window as long as the keys held slides over none of them: full attention (model.py and enable() take a
        # Mistral whose window is as long as its context, and transformers hands every layer of it that window)
        window = kwargs.get("sliding_window")
        if (window and window < key.shape[2]) or kwargs.get("softcap"):
            raise ValueError(f"layer {layer} has a sliding window or a softcap: not supported by the QAdA adapter")
        if layer == 0:
            self.begin_step(key, attention_mask)
        if layer == self.cfg.num_hidden_layers - 1:
            self.check_rows(key)
        y = self.decoder(query, key, value, layer)  # (B, H, 1, D)
        return y.transpose(1, 2), None

    def prefilled(self, layer: int, key: torch.Tensor, mask) -> None:
        """A prompt's forward pass: a new generation begins at layer 0; each layer's keys are kept for Option 1 and the
        page paths."""
        if layer == 0:
            self.rows, self.decoder, self.moved = [], None, False
            self.prompt, self.prompt_len = [None] * self.cfg.num_hidden_layers, key.shape[2]
            self.starts = left_padding(mask, key.shape[2])
        if self.keeps_prompt:
            self.prompt[layer] = key  # (B, Hkv, T, D); the cache's next update makes a new tensor, this one stays
        if layer == self.cfg.num_hidden_layers - 1:
            self.last_key = key[:, :, -1].clone()  # (B, Hkv, D): what check_rows compares the next step with

    def begin_step(self, key: torch.Tensor, mask) -> None:
        """Layer 0 of a decode step: after a prefill, each row's attention is built; each step, the padding is
        checked to be the prefill's."""
        T = key.shape[2]
        starts = left_padding(mask, T)
        if self.prompt_len is None:
            raise ValueError("the QAdA adapter saw no prefill of this prompt (enable() the model before its prompt "
                             "runs, and use transformers' default DynamicCache)")
        if T <= self.prompt_len:
            raise ValueError("the cache is shorter than the prompt the QAdA adapter saw: it was cut back, as assisted "
                             "and prompt-lookup decoding do after checking several tokens in one pass; the adapter "
                             "decodes one token per pass (generate without assistant_model or "
                             "prompt_lookup_num_tokens)")
        if (starts or [0] * key.shape[0]) != (self.starts or [0] * key.shape[0]):
            raise ValueError(PADDING)
        if key.device != self.device:  # moved after enable(): what it read lies on the device it left
            raise ValueError(f"the model decodes on {key.device} but was enabled on {self.device}: enable() it where "
                             "it decodes (disable(model), move it, enable again)")
        if self.decoder is None:
            self.build(key.shape[0])

    def build(self, B: int) -> None:
        """Each row's DecodeAttention, as generate.py builds it for a prefilled prompt (build_attention): the moments
        of the row's own prompt (Option 1) or of the reference prompt for its length (Option 2), a page path's index of
        the row's prompt."""
        starts = self.starts or [0] * B
        for b in range(B):
            s = starts[b]
            keys = torch.stack([k[b:b + 1, :, s:self.prompt_len] for k in self.prompt]) if self.keeps_prompt else None
            self.rows.append(build_attention(self.method, Prompt(self.prompt_len - s, keys), n_sink=self.n_sink,
                                             n_local=self.n_local, moments_source=self.moments_source or "random-words",
                                             reference=self.reference, **self.inputs))
        self.prompt = None  # the moments hold what they need
        self.decoder = self.rows[0] if B == 1 and self.starts is None else BatchAttention(self.rows, self.starts)
        self.follows_rows = any(self.kept_per_row(row) for row in self.rows)

    @staticmethod
    def kept_per_row(row) -> str | None:
        """What of a row's DecodeAttention follows the row's own keys as it decodes, if anything."""
        if row.inputs.get("pages") is not None:
            return "a page index"
        return "online moments" if isinstance(row.inputs.get("moments"), OnlineMoments) else None

    def check_rows(self, key: torch.Tensor) -> None:
        """The last layer of a decode step: its key one position back (B, Hkv, D) is still the one each row appended a
        step ago, or the rows were reordered (that key depends on every token before it): refused where a row keeps
        state of its own, else kept in `moved`."""
        if self.follows_rows:
            if not torch.equal(key[:, :, -2], self.last_key):
                raise ValueError(REORDERED.format(self.method, self.kept_per_row(self.rows[0])))
        else:
            self.moved = self.moved | (key[:, :, -2] != self.last_key).any()  # a bool tensor once a step has run
        self.last_key = key[:, :, -1].clone()

    # -----------------------------------------------------------------------------------------------------
    # The report

    def summary(self, row: int = 0, sequences: torch.Tensor | None = None, eos_token_id=None) -> dict:
        """HeadStats.summary of the last generation's row `row`: decode steps, head sparsity, KV read, per layer. With
        `sequences` (generate's output), only the steps up to the row's first end-of-sequence token: transformers
        decodes a row that has ended, on padding, until every row of the batch has (`eos_token_id`: the model's
        generation_config's by default). Refused after beam search, whose cache rows are no one sequence each."""
        if not self.rows:
            return {"steps": 0, "sparsity": None, "kv_read": None, "layer_sparsity": []}
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < len(self.rows):  # True is an int too
            raise ValueError(f"row {row!r}: the last generation had {len(self.rows)} row(s), 0 to {len(self.rows) - 1}")
        stats = self.rows[row].stats
        if sequences is not None:
            stats = stats.first(self.steps_to_end(sequences, eos_token_id)[row])
        return stats.summary(self.cfg.num_key_value_heads)

    def steps_to_end(self, sequences: torch.Tensor, eos_token_id=None) -> list[int]:
        """Per row of generate's output `sequences` (B, prompt + new), or (B, new) from inputs_embeds, the decode steps
        that made its new tokens up to its first end-of-sequence token: the first new token comes from the prefill, step
        i makes token i."""
        if bool(self.moved):
            raise ValueError("sequences: the cache's rows were reordered between decode steps (beam search), so a "
                             "row's statistics follow no one sequence; report() without them gives each cache row's")
        if eos_token_id is None:
            model = self.model()
            if model is None:
                raise ValueError("sequences: the model is gone, and with it its generation_config's eos_token_id; "
                                 "give report(sequences, eos_token_id=...)")
            config = model.generation_config
            eos_token_id = config.eos_token_id if config is not None else None
        eos = [eos_token_id] if isinstance(eos_token_id, int) else [] if eos_token_id is None else eos_token_id
        # checked here: torch.tensor(eos) below would fail on another kind of id in a line that names no argument
        if not (isinstance(eos, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in eos)):
            raise ValueError(f"eos_token_id: a token id or a list of them, got {eos_token_id!r}")
        if not eos:
            raise ValueError("sequences: the model's generation_config names no eos_token_id; give report(sequences, "
                             "eos_token_id=...)")
        # generate's output: the prompt, then the prefill's token and one per decode step; from inputs_embeds, the new
        # tokens only (their first `prompt_len` are no prompt to pass over). The width says which, or another output
        B, steps = len(self.rows), len(self.rows[0].stats.labels)
        prompt = {self.prompt_len + steps + 1: self.prompt_len, steps + 1: 0}  # width -> prompt tokens to pass over
        if not (isinstance(sequences, torch.Tensor) and sequences.dim() == 2 and sequences.shape[0] == B
                and sequences.shape[1] in prompt):
            shape = tuple(sequences.shape) if isinstance(sequences, torch.Tensor) else type(sequences).__name__
            raise ValueError(f"sequences: generate's output for the last generation, ({B}, "
                             f"{self.prompt_len + steps + 1}) token ids (its rows, prompt then new tokens; ({B}, "
                             f"{steps + 1}) from inputs_embeds, the new ones), got {shape}")
        ended = torch.isin(sequences[:, prompt[sequences.shape[1]]:], torch.tensor(eos, device=sequences.device))
        first = torch.where(ended.any(1), ended.int().argmax(1), ended.shape[1]).tolist()  # no end: every step
        return [min(n, len(r.stats.labels)) for n, r in zip(first, self.rows)]

    def report(self, sequences: torch.Tensor | None = None, eos_token_id=None) -> str:
        """generate.py's lines for the last generation (its decode steps since the last pass of several tokens: a
        forward that scores a text starts anew): the method and where its tau came from, then per row the heads
        labelled local and the KV entries read; with `sequences`, each row up to its end (summary)."""
        head = (f"method {self.method}" + (f" at tau {self.tau} ({self.tau_from})" if self.tau is not None else "")
                + (f", {self.moments_source or 'given'} moments" if "moments" in path_inputs(self.method) else "")
                + (f", calibration {Path(self.inputs['calibration'].settings['file']).name}"
                   if "calibration" in self.inputs else "")
                # the rest of what the path reads as numbers (a page budget, ...) and a window not the paper's
                + inputs_said(self.inputs | ({"n_sink": self.n_sink, "n_local": self.n_local}
                                             if "n_sink" in path_inputs(self.method) else {})))
        lines = [head]
        for b in range(max(len(self.rows), 1)):
            s = self.summary(b, sequences, eos_token_id)
            row = f"row {b}: " if len(self.rows) > 1 else ""
            if s["steps"]:
                lines.append(f"{row}heads labelled local (sparsity) {s['sparsity']:.3f} | KV entries read "
                             f"{s['kv_read']:.3f} | {s['steps']} decode steps")
            else:
                lines.append(f"{row}no decode step ran")
        if len(self.rows) > 1 and sequences is None:
            lines.append("(each row counted to the batch's last step, past its own end: report(sequences), with "
                         "generate's output, stops each row at its end-of-sequence token)")
        return "\n".join(lines)


def sdpa(module, query, key, value, mask, **kwargs):
    """transformers' own SDPA attention function: (B, Tq, H, D), None."""
    return AttentionInterface()["sdpa"](module, query, key, value, mask, **kwargs)


def enable(model, method: str = "qada_cal", tau: float | None = None, calibration=None,
           moments=None, *, tokenizer=None, n_sink: int = 16, n_local: int = 128, **inputs) -> HFAttention:
    """Decode `model` (a transformers llama, mistral or qwen2 causal LM) with the path attention.PATHS[method] (default
    qada_cal, the recommended one: its stored tau, a correction from `calibration`).

    tau: the threshold; None is the method's own operating point (generate.default_tau: a calibrated path at the one
    stored with its correction, else the paper's 0.6). calibration: what a qada*_cal path reads (a Calibration, a file,
    a folder of lab.calibrate --qada, or a named model whose shipped one it takes). moments: a moments.SOURCES name or a
    KeyMoments, for the paths that read moments (None: those a calibrated path's correction was fitted on, else
    random-words, the paper's Option 2); Option 2's sources need `tokenizer` (the model's: its encode(text,
    add_special_tokens=True) makes the reference prompt). inputs: more of what the path reads (static_local, a new
    path's own). Returns the registered attention: its `report(sequences)` and `summary(row, sequences)` give the last
    generation's statistics, each row up to its end-of-sequence token in generate's output `sequences` (without them, to
    the batch's last step)."""
    llama_config(model)  # one line for what is not a Llama-family transformers model
    check_kernel()  # QADA_KERNEL said now, not inside generate's first decode step
    current = model.config._attn_implementation
    if isinstance(AttentionInterface().get(current), HFAttention):
        raise ValueError(f"QAdA is already enabled on this model ({current}); disable(model) first")
    attention = HFAttention(model, method, tau, calibration, moments, tokenizer, n_sink, n_local, inputs)
    attention.name, attention.previous = f"qada_{id(attention):x}", current
    AttentionInterface.register(attention.name, attention)
    AttentionMaskInterface.register(attention.name, AttentionMaskInterface()["sdpa"])  # the masks its prefill reads
    model.set_attn_implementation(attention.name)
    if model.config._attn_implementation != attention.name:  # transformers declined (it only warns)
        model.set_attn_implementation(current)
        raise ValueError(f"{type(model).__name__} does not take its attention through transformers' "
                         "AttentionInterface: the QAdA adapter cannot reach its layers")
    return attention


def disable(model) -> None:
    """The model's attention as it was before enable(). (transformers has no public way to unregister a function: the
    name stays registered to an HFAttention that no model uses, emptied of all but the last generation's statistics,
    which its report() and summary() still give.)"""
    attention = AttentionInterface().get(model.config._attn_implementation)
    if not isinstance(attention, HFAttention):
        raise ValueError("QAdA is not enabled on this model")
    model.set_attn_implementation(attention.previous)
    for row in attention.rows:  # what a row read goes (moments, a page index); what it labelled stays
        row.inputs, row.exact = {}, None
    attention.decoder, attention.prompt, attention.reference = None, None, None


# ---------------------------------------------------------------------------------------------------------
# The transformers model seen as ours: what moments.ReferenceKeys and lab.calibrate call


class HFModel:
    """A transformers model through the interface model.Llama offers the harness: new_cache, prefill and decode_step
    (with a decode hook), cfg, device, dtype. transformers computes everything but attention; its attention function
    (an HFAttention) writes each layer's rotated keys and values into our KVCache and attends on the filled views,
    densely or with the hook, as model.Attention does. `identity` names the model's keys for ReferenceKeys' disk
    cache."""

    def __init__(self, hf, attention: HFAttention, model_dir: str | None = None):
        self.hf, self.attention, self.cfg = hf, attention, attention.cfg
        self.model_dir = f"transformers:{model_dir or hf.config.name_or_path or type(hf).__name__}"
        self._identity = None

    @property
    def device(self) -> torch.device:
        return held_device(self.hf)

    def named_parameters(self):  # transformers' names, which criterion.weights_probe reads as model.Llama's
        return self.hf.named_parameters()

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    @property
    def identity(self) -> dict:
        """The config as model.py reads it, the dtype, and 64 evenly spaced values of every weight, hashed: what
        makes this model's keys what they are (moments.model_identity's role for a model not read from a folder)."""
        if self._identity is None:
            h = hashlib.sha256(json.dumps(dataclasses.asdict(self.cfg), sort_keys=True).encode())
            for name, p in self.hf.state_dict().items():
                with onloaded(self.hf, [name]):  # an offloaded weight's values, not the meta device's none
                    module, _, attr = name.rpartition(".")
                    flat = getattr(self.hf.get_submodule(module), attr).detach().reshape(-1)
                    picked = flat[torch.arange(64, device=flat.device) * (flat.numel() - 1) // 63]
                h.update(f"{name}{tuple(p.shape)}".encode() + picked.float().cpu().numpy().tobytes())
            self._identity = {"weights": h.hexdigest()[:16], "runner": "transformers",
                              "dtype": str(self.dtype).removeprefix("torch.")}
        return self._identity

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        return KVCache(self.cfg, max_len, batch, device=self.device, dtype=self.dtype)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, decode_attention=None) -> torch.Tensor:
        """ids (B, T) at positions [cache.length, cache.length + T): last-position logits (B, V) in fp32."""
        if cache.start is not None:
            raise ValueError("HFModel takes caches of rows that start at position 0")
        positions = torch.arange(cache.length, cache.length + ids.shape[1], device=ids.device)[None]  # (1, T)
        held = self.attention.store, self.attention.hook  # a reference pass may run inside a decode step
        self.attention.store, self.attention.hook = cache, decode_attention
        try:
            logits = self.hf(input_ids=ids, position_ids=positions.expand(ids.shape[0], -1), use_cache=False,
                             logits_to_keep=1).logits[:, -1]
        finally:
            self.attention.store, self.attention.hook = held
        cache.length += ids.shape[1]
        return logits.float()

    def prefill(self, ids: torch.Tensor, cache: KVCache, chunk: int = 2048, progress: bool = False) -> torch.Tensor:
        """Dense prefill of ids (B, T) in chunks, as model.Llama.prefill: last-position logits (B, V)."""
        for s in range(0, ids.shape[1], chunk):
            logits = self.forward(ids[:, s:s + chunk], cache)
        return logits

    def decode_step(self, token: torch.Tensor, cache: KVCache, decode_attention=None) -> torch.Tensor:
        """One token (B,) at the next position, its attention by `decode_attention(q, k, v, layer)` (None: dense)."""
        return self.forward(token[:, None], cache, decode_attention)


def load(name: str | None = None, device=None, dtype=torch.float32):
    """A named model, a folder or a hub id (weights.checkpoints.resolve) loaded by transformers and seen as ours
    (HFModel, its attention function registered for dense decoding), with our tokenizer of the folder."""
    from transformers import AutoModelForCausalLM
    from weights.checkpoints import resolve
    from weights.tokenizer import Tokenizer
    folder = resolve(name)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    hf = hf.to(device) if device is not None else hf
    return HFModel(hf, enable(hf, "dense"), str(folder)), Tokenizer.from_dir(folder)
