"""Shared pytest fixtures: the embedded model (converted once into the cache) and transformers' own
GGUF loading of the same file, the independent oracle the conversion is held against."""

import sys
from pathlib import Path

import pytest

# The project is flat top-level files (`from model import Llama`); make them importable from tests/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: uses the real embedded model (seconds to tens of seconds); still run by default")


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    from convert_gguf import ensure_embedded_model

    return ensure_embedded_model(progress=False)


@pytest.fixture(scope="session")
def embedded_gguf_file(embedded_dir) -> Path:
    from convert_gguf import embedded_gguf

    return embedded_gguf()


@pytest.fixture(scope="session")
def hf_gguf_model(embedded_gguf_file):
    """transformers' LlamaForCausalLM loaded straight from the GGUF (fp32, eval mode; ~20-30 s)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers refuses GGUF files without it

    model = transformers.AutoModelForCausalLM.from_pretrained(
        embedded_gguf_file.parent, gguf_file=embedded_gguf_file.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(embedded_gguf_file):
    """transformers' tokenizer built from the GGUF metadata (a plain ByteLevel pre-tokenizer, no Digits split)."""
    transformers = pytest.importorskip("transformers")

    return transformers.AutoTokenizer.from_pretrained(embedded_gguf_file.parent, gguf_file=embedded_gguf_file.name)
