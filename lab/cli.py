"""What the harness's command lines share: a bad argument is one line on stderr and exit 2 (no usage block, no
traceback), --help shows each default once, and argument types that check a value before anything is loaded.

The checked lists (`ints`, `fractions`, `taus`) return the text they checked, so that a command's run function takes
the same strings from Python as from the command line.
"""

import argparse
import math
import os
import sys
import time
from pathlib import Path


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """"(default: X)" after an option's help, unless the help states its default itself, the option is a flag (a
    store_true's default is its absence, a store_false's its presence) or the default is None or empty."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not text or action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or action.default == []
                or "default" in text.lower()):
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with Help and one-line errors: "error: argument --samples: must be at least 1, got 0", exit 2. Flags
    are spelled whole: an abbreviation (--samp) would hide from what reads the command line which flags were given
    (lab.sweep --quick keeps those, run.json records them)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", Help)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")

    def parse(self, argv=None) -> argparse.Namespace | int:
        """parse_args, or the exit status where parsing ends: 0 after --help, 2 after a bad argument (its line
        printed), so that main(argv) returns it."""
        try:
            return self.parse_args(argv)
        except SystemExit as e:
            return e.code


def fail(e: Exception | str) -> int:
    """A caught error (or its text) as one line on stderr; the exit status of bad input."""
    text = f"missing key {e}" if isinstance(e, KeyError) else " ".join(str(e).split())
    print(f"error: {text}", file=sys.stderr)
    return 2


def interrupted() -> int:
    """Ctrl-C in a command that writes as it goes: one line, not a traceback, and the exit status of SIGINT."""
    print("interrupted: what was written is kept; the same command resumes from it", file=sys.stderr)
    return 130


def at_least(low: int):
    """An argparse type: an integer >= low."""
    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return integer


def thread_count(text: str) -> int:
    """An argparse type: torch's CPU threads, in [1, this machine's CPUs] (torch crashes far above the cores, and
    runs slower anywhere above them), as generate.py's --threads."""
    value, cpus = at_least(1)(text), os.cpu_count() or 1
    if value > cpus:
        raise argparse.ArgumentTypeError(f"must lie in [1, {cpus}] (this machine's CPUs), got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"takes a finite number above 0, got {text!r}")
    return value


def int_list(low: int, example: str):
    """An argparse type: comma-separated integers >= low (`example` shows some), returned as given."""
    def integers(text: str) -> str:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes comma-separated integers, e.g. {example}; got {text!r}") from None
        if not values or min(values) < low:
            raise argparse.ArgumentTypeError(f"takes comma-separated integers of at least {low}, got {text!r}")
        return text
    return integers


ints = int_list(1, "2048,8192")  # lengths, batch sizes
# page budgets in tokens: 0 (or a budget below a page) reads the window alone, the end of a page path's curve, as
# budget=0 does in generate.py
budgets = int_list(0, "128,1024")


def fractions(text: str) -> str:
    """An argparse type: comma-separated numbers in [0, 1] (a sparsity grid, "0.5,0.8"), returned as given; an empty
    text is an empty grid."""
    return numbers_in(text, "[0, 1]", lambda v: 0 <= v <= 1)


def taus(text: str) -> str:
    """An argparse type: comma-separated taus, numbers in (0, 1] (criterion.check_tau), returned as given; an empty
    text is an empty grid."""
    return numbers_in(text, "(0, 1]", lambda v: 0 < v <= 1)


def numbers_in(text: str, interval: str, inside) -> str:
    """`text` if it is comma-separated numbers for which `inside` holds (`interval` says which, in the messages)."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated numbers in {interval}, e.g. 0.6,0.9; got {text!r}"
                                         ) from None
    bad = [v for v in values if not inside(v)]  # NaN fails too
    if bad:
        raise argparse.ArgumentTypeError(f"takes numbers in {interval}, got {bad[0]:g} in {text!r}")
    return text


def named_twice(names: list[str]) -> str | None:
    """The first name that a comma-separated list (--tasks, --methods) gives more than once, else None."""
    return next((n for n in dict.fromkeys(names) if names.count(n) > 1), None)


def make_folder(path: str | Path, flag: str = "--out") -> Path:
    """The folder `path` made, with its parents, before a command's work begins: a place that cannot hold it (a
    file, a read-only or missing mount) is one line naming `flag`, not a traceback after the minutes of timing."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file; give a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot make the folder ({e.strerror or e})") from None
    return path


def note_replaced(out: Path, names, what: str = "table") -> None:
    """Says on stderr each of the tables `names` (out/NAME.json) an earlier run left in `out`: a benchmark run into a
    folder replaces them, as asked, but not silently. `what`: "table", or "tables" where one part writes several."""
    for name in names:
        if (out / f"{name}.json").is_file():
            them = "them" if what.endswith("s") else "it"
            print(f"note: {out} holds an earlier run's {name} {what}; this run replaces {them}", file=sys.stderr)


def fresh_folder(root: str) -> Path:
    """A new folder root/YYYYmmdd-HHMMSS (-2, -3, ... when that exists): where a command writes by default, so that a
    run never overwrites an earlier one's, the committed results/ least of all."""
    base = Path(root) / time.strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path
