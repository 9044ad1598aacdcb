"""Peers on the sweep's own samples: kvpress's presses through transformers, in the sweep's record format.

    python -m venv --system-site-packages .venv-peers && .venv-peers/bin/pip install -r lab/requirements-peers.txt
    .venv-peers/bin/python -m lab.peers --tasks niah_single_2,niah_multikey_1 --length 8192 --samples 15 \\
        --presses snapkv,expected_attention --ratios 0.5,0.75 --pair results/qwen0.5b-8k --out results/peers-8k

What a user would pick instead of QAdA. kvpress (NVIDIA) compresses the KV cache at prefill: in every layer a
*press* scores the prompt's entries and keeps the top (1 - compression ratio) of each KV head; decoding then reads,
and the cache holds, only what was kept. QAdA keeps the whole cache and decides at every step which heads read past
their window. The two save different things: a press frees memory for good (an entry it dropped is gone for every
later question), QAdA saves reading and frees nothing.

The prompts are the sweep's (lab.tasks with the same tasks, seeds and length, tokenized by the same tokenizer), so
the records pair with a sweep's sample for sample; `--pair RUN` checks every prompt's token count (and its ids' hash,
where RUN's records keep one) against RUN's records. Two protocols, in the config's name:

    snapkv@0.5          question-aware: all of the prompt but its last token is compressed, the question inside it
                        (what QAdA sees when it decides); the last token then reads the compressed cache
    snapkv_ctx@0.5      kvpress's own protocol (its RULER benchmark): only the context is compressed, the user
                        turn up to its last line; the question and the answer prefix follow through the compressed
                        cache at the positions they would have had

Greedy decoding from there, up to the task's max new tokens or EOS (the sweep's `--stop eos`). `hf_dense` is the
control: the same pipeline with nothing dropped, which should score as the sweep's own dense decoding.

One prefill serves every press. A press runs as a hook after each layer's attention and only rewrites that layer's
cache: the hidden states the next layer sees are the dense prefill's. So every press sees the hidden states, keys
and values of one dense prefill, layer by layer: exactly those of its own prefill under the question-aware protocol
(the same tokens), and under the context protocol a prefix of them, equal to a prefill of the context alone up to
rounding (attention is causal; only the matrix shapes differ). `compress_all` hands each press its slice and keeps
each result as a cache of its own; tests/test_peers.py holds this to kvpress's own `with press(model)` prefill.
Then one batch decodes them all: each press's cache is a row, left-padded and masked so that it decodes as it would
alone (`greedy_rows`).

Records (one JSON line per sample and config, resumable, merged into samples.jsonl.xz at the end) carry the sweep's
fields, with `kv_read` the mean over the forward passes that produced the answer's tokens (`steps` of them, the first
included: here it reads the compressed cache, in the sweep it comes from the dense prefill) of the entries read
against what dense reads at that position, `kv_kept` the fraction of the compressed span kept, `kv_bytes` the cache
held while decoding, `compress_s` the press's own time at prefill, `decode_s` the batch's decoding time over its
rows (`batch`), `ids_sha1` a hash of the prompt's token ids and `peak_bytes` (CUDA only) the memory the batch's
decoding took beyond what was allocated when it began. `sparsity` is null: a
press has no notion of a local head. lab.report pairs these records with a sweep's (`--with`).
"""

import argparse
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from generate import pick_device
from lab.calibrate import task_names
from lab.cli import Parser, at_least, fail, thread_count
from lab.records import differs, ids_hash, read_records, read_run, write_run
from lab.sweep import folder_lock, merge, parse_grid
from lab.tasks import Sample, make_sample, score
from weights.checkpoints import DEFAULT, DTYPES, resolve
from weights.tokenizer import Tokenizer

# Presses whose compress() reads only the module, hidden states, keys, values and rotary tables: what compress_all
# slices. One that reads the attention weights, the mask or cache positions (ObservedAttentionPress, ...) would see
# the whole prefill's and is not listed.
PRESSES = {  # our name -> kvpress class
    "snapkv": "SnapKVPress",                    # attention of the prompt's last 64 queries, pooled
    "expected_attention": "ExpectedAttentionPress",  # expected attention of future queries from their statistics
    "knorm": "KnormPress",                      # keys of small norm
    "streaming_llm": "StreamingLLMPress",       # sinks and recent tokens: a fixed window, as our `local`
}


@dataclass(frozen=True)
class Peer:
    press: str        # a key of PRESSES
    protocol: str     # "question" or "context"
    ratio: float      # kvpress's compression_ratio: the fraction of entries dropped; 0 keeps all (hf_dense)

    @property
    def method(self) -> str:
        if self.ratio == 0:  # nothing dropped: transformers' own dense decoding, the pipeline's control
            return "hf_dense"
        return self.press + ("_ctx" if self.protocol == "context" else "")

    @property
    def key(self) -> str:
        return self.method if self.ratio == 0 else f"{self.method}@{self.ratio:g}"

    def make(self):
        import kvpress
        return getattr(kvpress, PRESSES[self.press])(compression_ratio=self.ratio)


HF_DENSE = Peer("snapkv", "question", 0.0)  # a press at ratio 0 returns the cache it was given


def build_peers(presses: list[str], ratios: list[float], context_ratios: list[float], dense: bool = True
                ) -> list[Peer]:
    """The question-aware peers at `ratios`, the context-only ones at `context_ratios`, and with `dense` the control:
    the same pipeline with nothing dropped, which must score as our dense decoding does."""
    for p in presses:
        if p not in PRESSES:
            raise ValueError(f"unknown press {p!r}; choose from {', '.join(PRESSES)}")
    for r in ratios + context_ratios:
        if not 0 < r < 1:  # NaN fails too
            raise ValueError(f"a compression ratio lies strictly between 0 and 1, got {r:g}")
    peers = ([HF_DENSE] if dense else []) + [Peer(p, "question", r) for p in presses for r in ratios] + \
        [Peer(p, "context", r) for p in presses for r in context_ratios]
    if not peers:
        raise ValueError("nothing to run: no press, and no control (--dense-samples 0)")
    return list(dict.fromkeys(peers))  # a ratio given twice runs once


def question_start(sample: Sample, ids: list[int], tok) -> int:
    """Token index where the question begins: the last line of the sample's user turn, as kvpress's RULER data
    splits context from question. The prompt's ids must begin with the ids of the text before it, so the split is a
    token boundary of the prompt as the sweep tokenized it."""
    question = sample.input.rsplit("\n", 1)[-1]
    at = sample.prompt.rfind(question)
    if not question or at < 0:
        raise ValueError(f"{sample.task}#{sample.index}: no question line to split the prompt at")
    head = tok.encode(sample.prompt[:at])
    if ids[:len(head)] != head:
        raise ValueError(f"{sample.task}#{sample.index}: the text before the question does not end on a token boundary")
    return len(head)


# ---------------------------------------------------------------------------------------------------------
# One dense prefill, every press's compressed cache


def compress_all(hf, ids: torch.Tensor, spans: dict, presses: dict) -> tuple[dict, dict]:
    """Prefill ids (1, T) densely and compress each layer's keys and values with every press on its own span: press
    `key` sees the first spans[key] positions (hidden states, keys, values, rotary tables), as in a prefill of just
    those tokens. Returns ({key: [(k, v) per layer, each (1, Hkv, kept, D)]}, {key: seconds spent compressing})."""
    from transformers import DynamicCache
    out = {key: [] for key in presses}
    seconds = dict.fromkeys(presses, 0.0)

    def hook(module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]  # keys, values (1, Hkv, T, D): the dense cache
        h, (cos, sin) = kwargs["hidden_states"], kwargs["position_embeddings"]  # (1, T, hidden), (1, T, D) each
        for key, press in presses.items():
            n = spans[key]
            sync(ids.device)
            t0 = time.perf_counter()
            k, v = press.compress(module, h[:, :n], layer.keys[:, :, :n], layer.values[:, :, :n], None,
                                  dict(kwargs, position_embeddings=(cos[:, :n], sin[:, :n])))
            sync(ids.device)
            seconds[key] += time.perf_counter() - t0
            out[key].append((k, v))  # (1, Hkv, kept, D) each
        return output

    for press in presses.values():  # what `with press(model)` does before it hooks the layers
        press.post_init_from_model(hf)
    hooks = []
    try:
        for layer in hf.model.layers:
            layer.self_attn.rotary_emb = hf.model.rotary_emb  # ExpectedAttentionPress rotates its query statistics
            hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
        with torch.no_grad():
            hf.model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return out, seconds


def sync(device: torch.device) -> None:
    """Wait for the GPU before reading a clock (on the CPU there is nothing to wait for)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy(hf, kv: list[tuple[torch.Tensor, torch.Tensor]], rest: torch.Tensor, start: int, max_new: int,
           eos) -> tuple[list[int], list[float]]:
    """Feed `rest` (1, R) at positions start.. through the cache `kv` (per layer (1, Hkv, S, D)), then decode
    greedily, stopping at an id in `eos`. Returns the new ids and, per forward pass that produced one, the entries
    read / what dense reads. One row of `greedy_rows`."""
    return greedy_rows(hf, [(kv, rest, start)], max_new, eos)[0]


def grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention without its copies under a mask: with a padding mask its "sdpa" repeats every KV
    head for each of its G query heads (G times the cache, every step), which on a CPU costs more than a batch saves.
    Here the G query heads of a KV head are folded into its query rows instead: query (B, H, q, D) -> (B, Hkv, G q, D)
    against key and value (B, Hkv, S, D), the mask (B, 1, q, S) repeated G times along the rows. Registered as
    "grouped_sdpa" for the batched decoding of `greedy_rows`; without a mask it is transformers' own."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    B, H, q, D = query.shape
    G = H // key.shape[1]
    if attention_mask is None or G == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    y = torch.nn.functional.scaled_dot_product_attention(query.reshape(B, -1, G * q, D), key, value,
                                                         attn_mask=attention_mask.repeat(1, 1, G, 1), scale=scaling)
    return y.reshape(B, H, q, D).transpose(1, 2).contiguous(), None  # (B, q, H, D), as transformers' own


def greedy_rows(hf, rows: list[tuple[list, torch.Tensor, int]], max_new: int, eos
                ) -> list[tuple[list[int], list[float]]]:
    """Decode several compressed caches of one prompt as the rows of one batch. Row b is (kv, rest, start): its
    cache (per layer (1, Hkv, S_b, D), as many entries in every layer), the tokens (1, R_b) still to feed at
    positions start_b.., and start_b + R_b, the prompt's length, is the same for every row. Each row decodes as it
    would alone: its cache and its rest are left-padded to the batch's longest and the padding is masked out, so a
    row attends to its own entries at their own positions (tests/test_peers.py holds rows to their decoding alone).
    A CPU decode step mostly reads the weights, which the rows share, so a prompt's presses cost little more than one.
    Returns per row the new ids and, per forward pass that produced one, the entries read / what dense reads."""
    from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
    from transformers.masking_utils import sdpa_mask
    kept = []
    for kv, _, _ in rows:
        lengths = {k.shape[2] for k, _ in kv}
        if len(lengths) != 1:  # one padding mask serves every layer
            raise ValueError(f"a press kept {sorted(lengths)} entries in different layers; decode it alone")
        kept.append(lengths.pop())
    ends = {start + rest.shape[1] for _, rest, start in rows}
    if len(ends) != 1:
        raise ValueError(f"rows of one batch must end their prompts at one position, got {sorted(ends)}")
    n, B, S, R = ends.pop(), len(rows), max(kept), max(rest.shape[1] for _, rest, _ in rows)
    device = rows[0][1].device
    pad = S > min(kept) or R > min(rest.shape[1] for _, rest, _ in rows)
    mask = torch.zeros(B, S + R, dtype=torch.long, device=device)  # 1 where a row has an entry of its own
    x = torch.zeros(B, R, dtype=torch.long, device=device)  # pad id 0: masked, never read
    positions = torch.zeros(B, R, dtype=torch.long, device=device)
    for b, ((_, rest, start), s) in enumerate(zip(rows, kept)):
        r = rest.shape[1]
        mask[b, S - s:S], mask[b, S + R - r:] = 1, 1
        x[b, R - r:], positions[b, R - r:] = rest[0], torch.arange(start, n, device=device)
    cache = DynamicCache()
    for layer in range(len(rows[0][0])):
        left = lambda t, s: torch.nn.functional.pad(t, (0, 0, S - s, 0))  # noqa: E731  (1, Hkv, S, D)
        cache.update(torch.cat([left(kv[layer][0], s) for (kv, _, _), s in zip(rows, kept)]),  # (B, Hkv, S, D): new
                     torch.cat([left(kv[layer][1], s) for (kv, _, _), s in zip(rows, kept)]), layer)  # tensors
    AttentionInterface.register("grouped_sdpa", grouped_sdpa)
    AttentionMaskInterface.register("grouped_sdpa", sdpa_mask)
    was = hf.config._attn_implementation
    hf.set_attn_implementation("grouped_sdpa")
    new, read = [[] for _ in rows], [[] for _ in rows]
    live, pos = list(range(B)), n
    try:
        with torch.no_grad():
            while live and pos - n < max_new:
                logits = hf(input_ids=x, attention_mask=mask if pad else None, past_key_values=cache,
                            position_ids=positions, logits_to_keep=1).logits  # (B, 1, V)
                nxt = logits[:, -1].argmax(-1)  # (B,)
                ids = nxt.tolist()
                for b in live:
                    new[b].append(ids[b])
                    read[b].append((kept[b] + pos - rows[b][2]) / pos)  # dense reads positions 0 .. pos - 1
                live = [b for b in live if ids[b] not in eos]
                pos += 1
                x, positions = nxt[:, None], torch.full((B, 1), pos - 1, dtype=torch.long, device=device)
                mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
    finally:
        hf.set_attn_implementation(was)
    return [(new[b], read[b]) for b in range(B)]


def run_sample(hf, tok, sample: Sample, ids: list[int], n_ctx: int | None, peers: list[Peer], device: str
               ) -> list[dict]:
    """Every peer on one sample: one dense prefill of all but the last token, then every press's cache decoded as
    a row of one batch."""
    n = len(ids)  # n_ctx: where the question starts (question_start), for the context-only protocol
    x = torch.tensor([ids], device=device)
    spans = {p.key: n - 1 if p.protocol == "question" else n_ctx for p in peers}
    sync(x.device)
    t0 = time.perf_counter()
    try:
        kv, compress_s = compress_all(hf, x[:, :n - 1], spans, {p.key: p.make() for p in peers})
    except AssertionError as e:  # kvpress checks its inputs with asserts (a span no longer than its window, ...)
        raise ValueError(f"{sample.task}#{sample.index}: kvpress refused the prompt: {e}") from None
    sync(x.device)
    prefill_s = time.perf_counter() - t0 - sum(compress_s.values())
    sha = ids_hash(ids)
    if x.is_cuda:
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    out = greedy_rows(hf, [(kv[p.key], x[:, spans[p.key]:], spans[p.key]) for p in peers], sample.max_new_tokens,
                      tok.eos_ids)
    sync(x.device)
    decode_s = (time.perf_counter() - t0) / len(peers)  # the batch's time shared by its rows, as the sweep's
    decoded = dict(zip(peers, out))
    peak = torch.cuda.max_memory_allocated(device) - held if x.is_cuda else None
    records = []
    for p in peers:
        new, read = decoded[p]
        span = spans[p.key]
        text = tok.decode(new)
        kept = sum(k.shape[2] for k, _ in kv[p.key]) / len(kv[p.key])
        records.append({
            "task": sample.task, "index": sample.index, "config": p.key, "method": p.method,
            "path": "kvpress" if p.ratio else "transformers", "source": p.protocol, "threshold": p.ratio or None,
            "threshold_kind": "compression" if p.ratio else None, "n_prompt": n,
            "n_new": len(new), "decode_s": round(decode_s, 2), "batch": len(peers), "score": score(sample, text),
            "pred": text, "steps": len(new), "sparsity": None, "kv_read": sum(read) / len(read), "kv_kept": kept / span,
            "kv_bytes": sum(k.nbytes + v.nbytes for k, v in kv[p.key]), "peak_bytes": peak,
            "compress_s": round(compress_s[p.key], 3), "prefill_s": round(prefill_s, 2), "ids_sha1": sha})
    return records


# ---------------------------------------------------------------------------------------------------------
# The runner


def paired_prompts(pair: Path) -> dict[tuple[str, int], tuple[int, str | None]]:
    """{(task, index): (prompt tokens, hash of the ids where the records keep one)} of a sweep folder's records."""
    if not Path(pair).is_dir():
        raise ValueError(f"--pair {pair}: no such run folder")
    out = {}
    for r in read_records(pair):
        if "n_prompt" not in r:
            raise ValueError(f"--pair {pair}: its records have no n_prompt (not a lab.sweep folder?)")
        out[r["task"], r["index"]] = (r["n_prompt"], r.get("ids_sha1"))
    if not out:
        raise ValueError(f"--pair {pair}: no records there to check the prompts against")
    return out


def check_pairing(samples: list[tuple[Sample, list[int]]], expected: dict, pair: str) -> None:
    """Every prompt must be one the paired sweep decoded: the same token count (and ids, where it kept their hash)."""
    for sample, ids in samples:
        key = sample.task, sample.index
        if key not in expected:
            raise ValueError(f"{sample.task}#{sample.index}: not in {pair}'s records, so nothing to pair it with")
        n, sha = expected[key]
        if n != len(ids) or (sha and sha != ids_hash(ids)):
            raise ValueError(f"{sample.task}#{sample.index}: {len(ids)} prompt tokens here, {n} in {pair}"
                             + (" (and other ids)" if n == len(ids) else ""))


def load_hf(folder: Path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()  # a bar per weight; ours counts the runs
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()


def run(out: str, tasks: str, length: int, samples: int, presses: str, ratios: str, context_ratios: str, seed: int,
        model: str | None, dtype: str, device: str | None, pair: str | None, threads: int | None,
        dense_samples: int | None = None, progress: bool = True, command: str = "") -> Path:
    if threads:
        torch.set_num_threads(threads)
    try:  # lab.sweep's check: a known task each, none named twice (its samples would be decoded, and count, twice)
        task_list = task_names(tasks)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--tasks {e}") from None
    grids = {}
    for flag, text in (("--ratios", ratios), ("--context-ratios", context_ratios)):
        try:
            grids[flag] = parse_grid(text)
        except ValueError:
            raise ValueError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    peers = build_peers([p for p in presses.split(",") if p], grids["--ratios"], grids["--context-ratios"],
                        dense=dense_samples != 0)
    if dense_samples is not None and dense_samples < 0:
        raise ValueError(f"--dense-samples takes a count >= 0, got {dense_samples}")
    wanted = lambda p, i: p != HF_DENSE or dense_samples is None or i < dense_samples  # noqa: E731
    try:
        import kvpress  # noqa: F401
    except ImportError as e:
        raise ValueError(f"kvpress does not import here ({e}): run lab.peers in its own environment (lab/README.md, "
                         "lab/requirements-peers.txt)") from None
    device = pick_device(device)
    model = model or DEFAULT
    expected = paired_prompts(Path(pair)) if pair else {}
    if not task_list or samples < 1:
        raise ValueError("nothing to run: give --tasks and --samples >= 1")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with folder_lock(out):  # before the folder is read: no other sweep or lab.peers writes or merges it meanwhile
        settings = dict(tasks=task_list, length=length, seed=seed, stop="eos", model=model, dtype=dtype,
                        runner="lab.peers")
        info = read_run(out) if (out / "run.json").is_file() else {"runs": []}  # a damaged one: one line naming it
        info.setdefault("runs", [])
        if info.get("settings"):
            clash = {k: (info["settings"].get(k), v) for k, v in settings.items()
                     if k != "tasks" and differs(k, info["settings"].get(k), v)}
            if clash:
                raise ValueError(f"{out} holds a run with other settings {clash}; use another --out")
            settings["tasks"] = list(dict.fromkeys(info["settings"]["tasks"] + task_list))
            settings["model"] = info["settings"]["model"]  # its first spelling, as lab.sweep keeps it

        folder = resolve(model, progress=progress)
        tok = Tokenizer.from_dir(folder)
        path = out / "samples.jsonl"
        done = {(r["task"], r["index"], r["config"]) for r in read_records(out)}
        jobs = [(t, i, [p for p in peers if (t, i, p.key) not in done and wanted(p, i)])
                for i in range(samples) for t in task_list]
        jobs = [j for j in jobs if j[2]]
        prompts, context = {}, any(p.protocol == "context" for p in peers)
        for task, index, _ in jobs:  # every prompt, its split and its pairing, before the first hour of decoding
            sample = make_sample(task, index, length, tok, seed)
            ids = tok.encode(sample.prompt)
            prompts[task, index] = sample, ids, question_start(sample, ids, tok) if context else None
        if pair:
            check_pairing([(sample, ids) for sample, ids, _ in prompts.values()], expected, pair)
        info["settings"] = settings  # written once every check has passed
        write_run(out, info)
        hf = load_hf(folder, DTYPES[dtype], device)
        bar = tqdm(total=sum(len(ps) for _, _, ps in jobs), unit="run", desc="peers", file=sys.stderr,
                   dynamic_ncols=True, disable=not progress)
        t_start = time.perf_counter()
        for task, index, todo in jobs:
            sample, ids, n_ctx = prompts[task, index]
            bar.set_postfix_str(f"{task}#{index}")
            records = run_sample(hf, tok, sample, ids, n_ctx, todo, device)
            with open(path, "a") as f:  # a sample's records at once: an interruption loses one sample
                for rec in records:
                    f.write(json.dumps(rec) + "\n")
            bar.update(len(records))
        bar.close()
        merge(out, [(t, i, peers) for i in range(samples) for t in task_list])  # sweep order: sample, task, config
        info["runs"].append({"command": command or "lab.peers.run(...)", "seconds":
                             round(time.perf_counter() - t_start), "torch": torch.__version__, "device": device})
        write_run(out, info)
    return out


def main(argv=None) -> int:
    p = Parser(prog="python -m lab.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="run folder for the records")
    p.add_argument("--tasks", required=True, help="comma-separated tasks (lab.tasks.TASKS)")
    p.add_argument("--length", type=at_least(1), default=8192, help="prompt token budget, as the sweep's")
    p.add_argument("--samples", type=at_least(1), default=15, help="samples per task (indices 0 .. N-1)")
    p.add_argument("--seed", type=int, default=42, help="task seed, as the sweep's")
    p.add_argument("--presses", default="snapkv,expected_attention", help=f"comma-separated: {', '.join(PRESSES)}")
    p.add_argument("--ratios", default="0.25,0.5,0.75,0.9", help="compression ratios, question-aware protocol (a "
                   "press reads a little more than 1 - ratio: the answer's own entries; 0.9 brackets KV read 0.25)")
    p.add_argument("--context-ratios", default="0.5,0.75,0.9", help="compression ratios, kvpress's protocol "
                   "(context only)")
    p.add_argument("--model", default=None, help=f"named model, folder or hub id (default {DEFAULT})")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--pair", default=None, metavar="RUN", help="a sweep folder whose prompts these must be: every "
                   "sample's prompt token count is checked against its records")
    p.add_argument("--threads", type=thread_count, default=None, help="torch threads")
    p.add_argument("--dense-samples", type=at_least(0), default=None, metavar="N", help="run hf_dense, the "
                   "pipeline with nothing dropped (the control: it should score as the sweep's dense), on the first N "
                   "samples of each task only (default: all; 0: none)")
    a = p.parse(argv)
    if isinstance(a, int):  # --help, or a bad argument's line printed
        return a
    try:
        out = run(a.out, a.tasks, a.length, a.samples, a.presses, a.ratios, a.context_ratios, a.seed, a.model, a.dtype,
                  a.device, a.pair, a.threads, a.dense_samples,
                  command="python -m lab.peers " + shlex.join(sys.argv[1:] if argv is None else argv))
    except (OSError, ValueError) as e:  # bad input: one line
        return fail(e)
    print(f"records in {out}; compare: python -m lab.report SWEEP --with {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
