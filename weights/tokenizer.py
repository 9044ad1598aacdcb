"""Text <-> token ids for a Hugging Face style model folder: tokenizer.json plus the chat template.

A thin wrapper over the `tokenizers` library and a sandboxed jinja2 render of `chat_template`, so the
core needs neither `transformers` nor network access. It follows transformers' conventions:
  - raw text: `encode(text, add_special_tokens=True)` lets tokenizer.json's post-processor add BOS
    (Llama-3 does; SmolLM2 has none);
  - chat: the rendered template already holds every special token (<|im_start|>, BOS, ...), so it is
    encoded with add_special_tokens=False, otherwise BOS would appear twice.
"""

import json
from datetime import datetime
from pathlib import Path

from model import read_json_object


def _read_json(path: Path) -> dict:
    """A folder's JSON file as a dict ({} when absent); one line naming the file when it is not a JSON object."""
    return read_json_object(path) if path.is_file() else {}


def _token_str(tok) -> str | None:
    # tokenizer_config.json stores special tokens either as "<s>" or as {"content": "<s>", ...}.
    return tok.get("content") if isinstance(tok, dict) else tok


def _pick_template(template) -> str | None:
    # A list of named templates ({"name": "default", "template": ...}, "tool_use", "rag") is allowed.
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def _ids(value) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


class Tokenizer:
    def __init__(self, tokenizer, chat_template: str | None = None, special_tokens: dict | None = None,
                 eos_ids: set[int] | None = None, bos_id: int | None = None):
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}  # bos_token/eos_token/... strings, seen by the template
        self.eos_ids = set(eos_ids or ())
        self.bos_id = bos_id
        self._template = None  # compiled lazily

    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path / 'tokenizer.json'} not found (expected a Hugging Face style model folder)")
        try:
            tokenizer = HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ValueError(f"{path / 'tokenizer.json'} is not a tokenizers file ({e})") from None
        tok_config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        config = _read_json(path / "config.json")

        template = _pick_template(tok_config.get("chat_template"))
        if (path / "chat_template.jinja").is_file():  # newer transformers save it apart; as there, it wins
            template = (path / "chat_template.jinja").read_text()
        special = {k: _token_str(tok_config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        special = {k: v for k, v in special.items() if v is not None}

        # Chat models stop on several ids (Llama-3: <|eot_id|> and <|end_of_text|>): take every source.
        eos_ids = _ids(generation.get("eos_token_id", config.get("eos_token_id")))
        if "eos_token" in special and tokenizer.token_to_id(special["eos_token"]) is not None:
            eos_ids.add(tokenizer.token_to_id(special["eos_token"]))
        bos_id = tokenizer.token_to_id(special["bos_token"]) if "bos_token" in special else None
        if bos_id is None:
            bos_id = generation.get("bos_token_id", config.get("bos_token_id"))
        return cls(tokenizer, template, special, eos_ids, bos_id)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) to the prompt string, as transformers does. ValueError
        for a template that does not compile, raises (its raise_exception) or breaks the sandbox."""
        import jinja2

        if not self.has_chat_template:
            raise ValueError("this tokenizer has no chat_template; encode raw text with "
                             "encode(text, add_special_tokens=True)")
        try:
            if self._template is None:
                self._template = _compile(self.chat_template)
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.TemplateError as e:  # the model's own template: a file's fault, said in one line
            raise ValueError(f"the model's chat_template failed: {type(e).__name__}: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids for a chat; the template supplies the special tokens, so none are added here."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def _compile(template: str):
    """Compile a chat template in the environment transformers uses (sandboxed: templates are untrusted code)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters (<, >, &), which would change the prompt.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
