"""Our Tokenizer on the default SmolLM2 folder and on the Qwen2.5-Coder-0.5B folder, held against transformers
(its GGUF tokenizer and AutoTokenizer on our folder) and, for Qwen's split, against the regex itself; plus the
chat-template environment and the error paths."""

import json
import re
import shutil

import pytest

from weights.tokenizer import Tokenizer

# No whitespace runs before digits: there transformers' GGUF tokenizer (no Digits split) and the
# original SmolLM2 tokenizer (with it) legitimately differ; see test_whitespace_run_before_a_digit.
TEXTS = [
    "Hello world! How are you today?",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>qada<file_sep>model.py\nimport torch<|endoftext|>",
    "Grüße aus Zürich: naïve café, 日本語のテキスト, Ελληνικά, "
    "emoji 🦙🚀 and ∑ x² ≤ ∞.",
    "def f(x):\n    return x ** 2  # square it\n\tif x: print(f'{x!r}')\n\n\nclass A: pass\n",
    "One of the special magic numbers for W is: 4829173. Pi is 3.14159; the date 2025-11-21, 0x1F.",
    "   leading spaces, trailing spaces   \n\n\r\n tabs\t\tand  double  spaces",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Italy?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write café in Japanese: 日本"},
    ],
]


@pytest.fixture(scope="module")
def tok(embedded_dir) -> Tokenizer:
    return Tokenizer.from_dir(embedded_dir)


def pieces(tok: Tokenizer, ids) -> list[str]:
    return [tok.tokenizer.id_to_token(i) for i in ids]


def without_digits(tok: Tokenizer):
    # The variant transformers builds from a GGUF: the same BPE with a plain ByteLevel pre-tokenizer.
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import pre_tokenizers

    other = HFTokenizer.from_str(tok.tokenizer.to_str())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return other


def test_special_tokens_and_ids(tok):
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.bos_id == 1
    assert tok.eos_ids == {2}
    assert tok.vocab_size == 49152
    assert tok.has_chat_template
    assert tok.encode("Hello world", add_special_tokens=True) == tok.encode("Hello world")  # SmolLM2 adds no BOS


def test_digits_are_split_one_by_one(tok):
    ids = tok.encode("12345")
    assert pieces(tok, ids) == ["1", "2", "3", "4", "5"]
    assert pieces(tok, tok.encode(" 4829173")) == ["Ġ", "4", "8", "2", "9", "1", "7", "3"]


def test_whitespace_run_before_a_digit(tok):
    # The one documented difference of the Digits split: digits are cut off first, so the whitespace
    # run before them stays one pre-token ("\n " -> ĊĠ) instead of the GPT-2 regex giving "\n" and " 1".
    assert pieces(tok, tok.encode("a\n 1")) == ["a", "ĊĠ", "1"]
    assert pieces(tok, without_digits(tok).encode("a\n 1").ids) == ["a", "Ċ", "Ġ", "1"]


@pytest.mark.parametrize("text", TEXTS + ["12345", "a\n 1", "x =  42\n    7"])
def test_decode_round_trip(tok, text):
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_decode_skips_special_tokens(tok):
    ids = tok.encode("<|im_start|>user\nHi there<|im_end|>\n")
    assert tok.decode(ids) == "user\nHi there\n"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi there<|im_end|>\n"


def test_chat_template_renders_smollm2_chatml(tok):
    text = tok.apply_chat_template(CHATS[0])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tok.apply_chat_template(CHATS[0], add_generation_prompt=False).endswith("assistant\n")
    ids = tok.encode_chat(CHATS[0])
    assert ids[0] == 1 and ids.count(1) == 3 and ids[-4:] == tok.encode("<|im_start|>assistant\n")


def test_decode_takes_any_sequence_of_ids(tok):
    """decode takes ids as a tensor (a model's output) or an iterator too, not only a list."""
    import torch

    ids = tok.encode("Hello world")
    assert tok.decode(torch.tensor(ids)) == tok.decode(iter(ids)) == tok.decode(ids) == "Hello world"


def test_an_eos_id_of_zero_is_a_stop_id(tmp_path, embedded_dir):
    """generation_config's eos_token_id 0 is a stop id, not taken for none; [] is none."""
    shutil.copy(embedded_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    for eos, ids in [(0, {0}), ([0, 2], {0, 2}), ([], set())]:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
        assert Tokenizer.from_dir(tmp_path).eos_ids == ids, eos


def test_missing_tokenizer_json_names_the_file(tmp_path):
    """No tokenizer.json, or one the tokenizers library cannot parse (its bare Exception): an error naming the file,
    which the CLIs print in one line."""
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 'tokenizer.json'))} is not a tokenizers file"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json", "config.json"])
@pytest.mark.parametrize("text,says", [("{bad", "is not a JSON object: not JSON"),
                                       ("[]", "is not a JSON object: a JSON list, not an object"),
                                       (b"\xff\xfe{", "is not a JSON object: not UTF-8 text")])
def test_a_config_that_is_not_a_json_object_names_the_file(tmp_path, embedded_dir, name, text, says):
    """A folder's config the tokenizer reads that is damaged, or JSON but no object, is one ValueError naming the file
    (generate.py's one line), not a bare decoder message or an AttributeError further on."""
    shutil.copy(embedded_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    path = tmp_path / name
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))} {says}"):
        Tokenizer.from_dir(tmp_path)


def test_template_list_dict_tokens_eos_list_and_environment(tmp_path, embedded_dir):

    shutil.copy(embedded_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    default = "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}{{ eos_token }}"
    config = {
        "chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": default}],
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|endoftext|>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_ids == {0, 2, 5}
    assert t.bos_id == 1
    # tojson like transformers: no HTML escaping, non-ASCII kept
    assert t.apply_chat_template([{"role": "user", "content": "<a & b> é"}]) == '<|im_start|>"<a & b> é"<|endoftext|>'

    # trim_blocks and lstrip_blocks, as transformers: block tags leave no newlines or indentation behind
    t.chat_template, t._template = ("{% for m in messages %}\n    {% if m.role %}{{ m.role }}{% endif %}\n"
                                    "{% endfor %}"), None
    assert t.apply_chat_template(CHATS[1]) == "systemuser"

    t.chat_template, t._template = "{{ raise_exception('bad role') }}", None
    with pytest.raises(ValueError, match="chat_template failed: TemplateError: bad role"):
        t.apply_chat_template(CHATS[0])
    t.chat_template, t._template = "{{ messages.append(1) }}", None  # sandboxed: no mutation of inputs
    with pytest.raises(ValueError, match="chat_template failed: SecurityError: .* unsafe"):
        t.apply_chat_template(CHATS[0])
    t.chat_template, t._template = "{% if %}", None  # a template that does not compile
    with pytest.raises(ValueError, match="chat_template failed: TemplateSyntaxError"):
        t.apply_chat_template(CHATS[0])


def test_a_template_saved_apart_and_ids_from_the_configs(tmp_path, embedded_dir):
    """A folder saved by newer transformers keeps its template in chat_template.jinja, not tokenizer_config.json; a
    tokenizer that names no BOS token takes generation_config's id, else config.json's."""
    shutil.copy(embedded_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 7, "eos_token_id": 3}))
    t = Tokenizer.from_dir(tmp_path)
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"
    assert (t.bos_id, t.eos_ids) == (7, {3})
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 9}))
    assert Tokenizer.from_dir(tmp_path).bos_id == 9


def test_a_template_saved_apart_wins_over_tokenizer_config(tmp_path, embedded_dir):
    """A folder with a template in both places (a repo that added chat_template.jinja and kept an older template in
    tokenizer_config.json) renders chat_template.jinja's, as transformers does; it rendered the other one."""
    from transformers import AutoTokenizer

    shutil.copy(embedded_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "old{{ messages[0]['content'] }}"}))
    (tmp_path / "chat_template.jinja").write_text("new{{ messages[0]['content'] }}")
    chat = [{"role": "user", "content": "hi"}]
    theirs = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(chat, tokenize=False)
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(chat) == theirs == "newhi"


def test_a_template_sees_every_special_token_as_in_transformers(tmp_path, embedded_dir):
    """The template sees bos, eos, pad and unk tokens, each the string tokenizer_config.json names, as transformers
    renders them."""
    from transformers import AutoTokenizer

    shutil.copy(embedded_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {"chat_template": "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}",
              "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "unk_token": "<repo_name>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    theirs = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(CHATS[0], tokenize=False)
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(CHATS[0]) == theirs == "|".join(
        config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token"))


def test_a_template_list_without_a_default_is_no_template(tmp_path, embedded_dir):
    """A list of named templates none of which is "default" gives no template (a ValueError on rendering), as in
    transformers, rather than one of the named ones (tool_use, rag) picked silently."""
    from transformers import AutoTokenizer

    shutil.copy(embedded_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    templates = [{"name": "tool_use", "template": "TOOLS"}, {"name": "rag", "template": "RAG"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    with pytest.raises(ValueError, match="no default"):
        AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(CHATS[0], tokenize=False)
    t = Tokenizer.from_dir(tmp_path)
    assert not t.has_chat_template
    with pytest.raises(ValueError, match="chat_template"):
        t.apply_chat_template(CHATS[0])


def test_an_eos_token_outside_the_vocabulary_adds_no_stop_id(tmp_path, embedded_dir):
    """An eos_token string the vocabulary lacks adds nothing to the stop ids (not None); generation_config's stay."""
    shutil.copy(embedded_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not_a_token|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert Tokenizer.from_dir(tmp_path).eos_ids == {2}


def test_vocab_size_counts_tokens_added_outside_the_model(tmp_path, embedded_dir):
    """A token added to tokenizer.json beyond the BPE vocabulary (as hub folders add special tokens) counts in
    vocab_size, as it does in transformers' len(tokenizer)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import AutoTokenizer

    hf = HFTokenizer.from_file(str(embedded_dir / "tokenizer.json"))
    hf.add_special_tokens([AddedToken("<|new_token|>", special=True, normalized=False)])
    hf.save(str(tmp_path / "tokenizer.json"))
    t = Tokenizer.from_dir(tmp_path)
    assert t.vocab_size == len(AutoTokenizer.from_pretrained(tmp_path)) == 49152 + 1
    assert t.encode("<|new_token|>") == [49152]


def test_template_environment_has_loop_controls_strftime_now_and_tojson_options():
    """What transformers' template environment offers and shipped templates use: {% break %} (loopcontrols),
    strftime_now (Llama 3.x's date line), tojson's indent and sort_keys (tool schemas); an empty template is none."""
    from datetime import datetime

    template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}"
                "|{{ strftime_now('%Y') }}|{{ {'b': 1, 'a': [2]} | tojson(indent=1, sort_keys=True) }}")
    rendered = Tokenizer(None, template).apply_chat_template(CHATS[1])
    year = datetime.now().strftime("%Y")
    assert rendered == f"You answer in one word.|{year}|" + json.dumps({"a": [2], "b": 1}, indent=1)
    assert not Tokenizer(None, "").has_chat_template


def test_tojson_passes_separators_and_strftime_now_is_local_time(monkeypatch):
    """tojson's separators reach json.dumps (compact tool schemas), and strftime_now is the local time, as in
    transformers (datetime.now), not UTC: here in a zone 14 hours ahead of it."""
    import time
    from datetime import datetime

    t = Tokenizer(None, "{{ messages[0] | tojson(separators=(',', ':')) }}|{{ strftime_now('%H') }}")
    monkeypatch.setenv("TZ", "Etc/GMT-14")  # POSIX sign: UTC+14
    time.tzset()
    try:
        before = datetime.now().strftime("%H")
        rendered = t.apply_chat_template(CHATS[0])
        hours = {before, datetime.now().strftime("%H")}  # the hour may turn meanwhile
    finally:
        monkeypatch.undo()
        time.tzset()
    assert rendered in {json.dumps(CHATS[0][0], separators=(",", ":")) + "|" + h for h in hours}


def test_no_chat_template_raises(tmp_path, embedded_dir):
    shutil.copy(embedded_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    t = Tokenizer.from_dir(tmp_path)
    assert not t.has_chat_template and t.eos_ids == set() and t.bos_id is None
    with pytest.raises(ValueError, match="chat_template"):
        t.apply_chat_template(CHATS[0])


@pytest.mark.slow
def test_ids_equal_transformers_gguf_tokenizer(tok, hf_gguf_tokenizer):
    for text in TEXTS:
        theirs = hf_gguf_tokenizer(text, add_special_tokens=True)["input_ids"]
        assert tok.encode(text, add_special_tokens=True) == theirs, text
        assert tok.encode(text) == hf_gguf_tokenizer(text, add_special_tokens=False)["input_ids"], text
        assert tok.decode(theirs) == hf_gguf_tokenizer.decode(theirs, skip_special_tokens=True), text


@pytest.mark.slow
def test_transformers_gguf_tokenizer_lacks_the_digits_split(tok, hf_gguf_tokenizer):
    text = "Total:\n 1 apple,\n\t2 pears"
    theirs = hf_gguf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert theirs == without_digits(tok).encode(text).ids
    # Should transformers ever add the Digits split, this fails: then TEXTS may hold such texts too.
    assert tok.encode(text) != theirs


@pytest.mark.slow
@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(tok, hf_gguf_tokenizer, chat, add_generation_prompt):
    text = tok.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    assert text == hf_gguf_tokenizer.apply_chat_template(chat, tokenize=False,
                                                         add_generation_prompt=add_generation_prompt)
    theirs = hf_gguf_tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=add_generation_prompt)
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
    assert tok.encode_chat(chat, add_generation_prompt=add_generation_prompt) == list(theirs)


@pytest.mark.slow
def test_our_folder_loads_in_transformers_with_the_same_ids(tok, embedded_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(embedded_dir)
    for text in TEXTS + ["a\n 1", "Total:\n 1 apple,\n\t2 pears"]:  # our tokenizer.json keeps the Digits split
        assert hf(text, add_special_tokens=True)["input_ids"] == tok.encode(text, add_special_tokens=True), text
        assert hf.decode(tok.encode(text), skip_special_tokens=False) == text
    assert (hf.apply_chat_template(CHATS[1], tokenize=False, add_generation_prompt=True)
            == tok.apply_chat_template(CHATS[1]))
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token, hf.unk_token) == (1, 2, "<|im_end|>", "<|endoftext|>")


# ---- Qwen2.5-Coder (pre-tokenizer "qwen2": NFC, then Qwen's split regex, then the byte mapping) ----

QWEN_TEXTS = TEXTS + [
    "<|endoftext|><|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|><tool_call>{\"a\": 1}</tool_call>",
    "I'm sure they'll say it's 'fine' -- DON'T you THINK'S? We've I'd",
    "a\n 1\n  22\n\t333 x  44, 1234567890, ١٢٣ and ⅷ, 0.5e-3",
    "   \n \n  \n\t\n\r\n\r\n    x\u3000y\u00a0z  ",
    "ﬁ ligature, full-width ＡＢＣ１２３, Hangul 한국어, "
    "Thai ภาษาไทย, Devanagari हिन्दी",
]


@pytest.fixture(scope="module")
def qwen_tok(qwen05_dir) -> Tokenizer:
    return Tokenizer.from_dir(qwen05_dir)


@pytest.mark.slow
def test_qwen_special_tokens_and_stop_ids(qwen_tok):
    assert ([qwen_tok.encode(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
            == [[151643], [151644], [151645]])
    assert qwen_tok.eos_ids == {151643, 151645}  # <|im_end|> (the GGUF's eos) and <|endoftext|>
    assert qwen_tok.vocab_size == 151936 and qwen_tok.encode("Hi", add_special_tokens=True) == qwen_tok.encode("Hi")
    # <tool_call> is an added token that is not special (GGUF type 4): kept whole, and kept when decoding.
    ids = qwen_tok.encode("<tool_call>x</tool_call>")
    assert len(ids) == 3 and qwen_tok.decode(ids) == "<tool_call>x</tool_call>"
    assert pieces(qwen_tok, qwen_tok.encode(" 4829173")) == ["Ġ", "4", "8", "2", "9", "1", "7", "3"]


@pytest.mark.slow
@pytest.mark.parametrize("text", QWEN_TEXTS)
def test_qwen_ids_equal_transformers_gguf_tokenizer_and_round_trip(qwen_tok, hf_qwen05_tokenizer, text):
    theirs = hf_qwen05_tokenizer(text, add_special_tokens=True)["input_ids"]
    assert qwen_tok.encode(text, add_special_tokens=True) == theirs
    assert qwen_tok.decode(theirs, skip_special_tokens=False) == text


@pytest.mark.slow
def test_qwen_split_equals_the_regex(qwen_tok):
    """The pre-tokens are exactly the matches of Qwen's regex (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2), checked
    with the `regex` module, an implementation independent of `tokenizers`' Oniguruma."""
    import regex
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from weights.convert_gguf import QWEN2_SPLIT

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    for text in QWEN_TEXTS:
        pre = qwen_tok.tokenizer.pre_tokenizer.pre_tokenize_str(text)
        assert [bytes(to_byte[c] for c in piece).decode() for piece, _ in pre] == regex.findall(QWEN2_SPLIT, text), text


@pytest.mark.slow
def test_qwen_nfc_differs_from_transformers_gguf_tokenizer(qwen_tok, hf_qwen05_tokenizer):
    """Qwen's own tokenizer.json normalizes to NFC before splitting; transformers' GGUF tokenizer (and llama.cpp)
    do not, so a decomposed accent ("i" + U+0308) tokenizes differently there. We follow Qwen: the text is
    encoded as its NFC form (which then no longer round-trips byte for byte)."""
    import unicodedata

    text = "nai\u0308ve A\u030angstro\u0308m"
    assert qwen_tok.encode(text) == qwen_tok.encode(unicodedata.normalize("NFC", text))
    assert qwen_tok.decode(qwen_tok.encode(text)) == unicodedata.normalize("NFC", text)
    # Should transformers ever add the NFC step, this fails: then the two agree on every text.
    assert qwen_tok.encode(text) != hf_qwen05_tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("chat", CHATS)
def test_qwen_chat_template_equals_transformers(qwen_tok, hf_qwen05_tokenizer, chat):
    text = qwen_tok.apply_chat_template(chat)
    assert text == hf_qwen05_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    if chat[0]["role"] != "system":  # Qwen's template adds its default system turn
        assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert qwen_tok.encode_chat(chat) == hf_qwen05_tokenizer(text, add_special_tokens=False)["input_ids"]
