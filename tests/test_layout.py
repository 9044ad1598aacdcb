"""The project runs from its root, where its top-level modules come first on sys.path: none of them may take the
import name of an installed package, or every import of that package made from here gets ours instead. (transformers
imports Hugging Face's `kernels` package: a kernels.py here would be imported in its place, and transformers would
fail at its own import.)"""

from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_top_level_module_takes_an_installed_packages_name():
    ours = {p.stem for p in ROOT.glob("*.py")} | {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert {"model", "attention", "decode_kernels", "generate", "lab", "weights"} <= ours  # what the check covers
    installed = packages_distributions()  # import name -> the distributions that install it
    assert {name: installed[name] for name in ours if name in installed} == {}
