"""The research harness's command lines on bad input and on what they would overwrite: a bad argument is one
line on stderr and exit 2, found before a model loads; nothing written is replaced unless asked (--force, or a fresh
default folder); a sweep folder is locked while a sweep writes it; a damaged record stops lab.report and a sweep's
resume with its file and line, unless --skip-damaged, which leaves it out and counts it."""

import argparse
import dataclasses
import hashlib
import json
import lzma
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from criterion import Calibration, save_calibration, save_labels
import decode_kernels
import generate
from lab import bench, calibrate, cli, records, report, sweep
from model import LlamaConfig
from tests.test_generate import make_tiny_dir
from weights.checkpoints import DEFAULT

ROOT = Path(__file__).resolve().parent.parent
RUN = ["--tasks", "fwe", "--length", "400", "--samples", "2", "--methods", "dense,local", "--ablations", "",
       "--ctxfree-samples", "0", "--track", "dense", "--device", "cpu", "--no-report"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_dir(tmp_path_factory.mktemp("tiny_lab_cli"))


@pytest.fixture
def no_model(monkeypatch):
    """Every CLI's model loading (and lab.bench's timing) fails the test: what is checked must be found before."""
    def loaded(*a, **k):
        raise AssertionError("a model was loaded: the check should come before")
    for module in (sweep, calibrate, bench):
        monkeypatch.setattr(module, "load", loaded)
    monkeypatch.setattr(bench, "bench_attention", loaded)


def one_line(capsys, rc: int, *expected: str) -> str:
    """The command ended with exit 2 and one line on stderr naming each `expected` text, and no traceback."""
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err


def record(task="fwe", index=0, config="dense", **extra) -> dict:
    return dict(task=task, index=index, config=config, method=config.split("@")[0], threshold=None, score=1.0,
                sparsity=0.0, kv_read=1.0, n_new=3, decode_s=0.1, prefill_s=0.1, **extra)


def run_folder(path: Path, body: bytes, name: str = "samples.jsonl", settings: dict | None = None) -> Path:
    """A run folder holding run.json and one record file with the bytes `body`."""
    path.mkdir(parents=True)
    (path / "run.json").write_text(json.dumps({"settings": settings or {"tasks": ["fwe"]}, "runs": []}))
    (path / name).write_bytes(body)
    return path


LINES = [json.dumps(record(index=i, config=c)).encode() + b"\n" for i in range(3) for c in ("dense", "local")]
WHOLE = lzma.compress(b"".join(LINES))
# (name, file, bytes, the damaged place): every kind of damage the report and the resume must stop at
DAMAGED = [("cut", "samples.jsonl", b"".join(LINES[:2]) + LINES[2][:25] + b"\n" + b"".join(LINES[3:]),
            "samples.jsonl:3"),
           ("number", "samples.jsonl", LINES[0] + b"42\n" + b"".join(LINES[1:]), "samples.jsonl:2: a JSON int (42)"),
           ("no-index", "samples.jsonl", LINES[0] + b'{"task": "fwe", "config": "dense"}\n', "without a valid index"),
           ("latin-1", "samples.jsonl", LINES[0] + b'{"task": "f\xe9"}\n', "samples.jsonl:2: not UTF-8"),
           ("truncated-xz", "samples.jsonl.xz", WHOLE[:len(WHOLE) // 2], "end early"),
           ("empty-xz", "samples.jsonl.xz", b"", "samples.jsonl.xz:1: an empty file"),
           ("not-xz", "samples.jsonl.xz", b"".join(LINES), "not readable as xz")]
# the records each keeps when its damage is left out: a plain file's other lines, nothing of an xz file it cannot read
KEPT = {"cut": 5, "number": 6, "no-index": 1, "latin-1": 1, "truncated-xz": 0, "empty-xz": 0, "not-xz": 0}


# ---------------------------------------------------------------------------------------------------------
# Damaged records


@pytest.mark.parametrize("name, file, body, where", DAMAGED, ids=[d[0] for d in DAMAGED])
def test_a_damaged_record_is_named_by_file_and_line_or_left_out_and_counted(tmp_path, name, file, body, where):
    out = run_folder(tmp_path / "run", body, file)
    with pytest.raises(records.DamagedRecord, match=re.escape(where)):
        records.read_records(out)
    damaged = []
    rows = records.read_records(out, damaged.append)
    assert len(damaged) == 1 and where in damaged[0] and str(out / file) in damaged[0]
    assert len(rows) == KEPT[name] and all(r["config"] in ("dense", "local") for r in rows)


def test_what_is_no_damage_reads_whole(tmp_path):
    """A byte-order mark, blank lines, and the last line of a plain file still being written (no newline yet)."""
    body = b"\xef\xbb\xbf" + LINES[0] + b"\n" + b"".join(LINES[1:]) + LINES[0][:30]
    assert len(records.read_records(run_folder(tmp_path / "a", body))) == 6
    assert len(records.read_records(run_folder(tmp_path / "b", WHOLE, "samples.jsonl.xz"))) == 6


def test_a_record_line_names_its_cause_and_a_boolean_is_no_index():
    """JSON true is an int to Python, but no sample index; a byte that is not UTF-8 is named by its 1-based
    position: in '{"task": "f' + 0xe9 the 12th."""
    assert records.record(b'{"task": "a", "index": true, "config": "dense"}') == (
        None, "a record without a valid index")
    assert records.record(b'{"task": "a", "index": 1, "config": "dense"}')[0] == {"task": "a", "index": 1,
                                                                                 "config": "dense"}
    assert records.record(b'{"task": "f\xe9"}') == (None, "not UTF-8 text (byte 12)")


def test_bytes_after_compressed_data_that_end_on_a_read_chunk_are_damage(tmp_path):
    """The xz file is read in chunks of 1 MiB: compressed data that end exactly at a chunk's end leave nothing over
    in the decompressor, and bytes after them are damage all the same. Incompressible filler (one damaged line)
    sized here until the compressed stream is exactly 1 MiB long."""
    head, target = json.dumps(record()).encode() + b"\n", 1 << 20
    filler, size = random.Random(0).randbytes(target).replace(b"\n", b"x"), target
    for _ in range(8):
        data = lzma.compress(head + filler[:size] + b"\n", preset=0)
        if len(data) == target:
            break
        size -= len(data) - target
    assert len(data) == target
    path = tmp_path / "samples.jsonl.xz"
    path.write_bytes(data + b"\0" * 4)
    damaged = []
    rows, read = records.file_records(path, damaged.append)
    assert rows == [record()] and read == target + 4
    assert len(damaged) == 2 and "bytes after the end of the compressed data" in damaged[1], damaged


def test_records_left_in_a_plain_file_beside_the_merged_one_are_read_once(tmp_path):
    """A merge stopped after it wrote samples.jsonl.xz, before it removed the plain files it merged: each (task,
    index, config) is read once, the compressed file's record, so that summary counts and means are not skewed by
    samples counted twice."""
    out = run_folder(tmp_path / "run", b"".join(LINES[:2]) + json.dumps(record(index=5)).encode() + b"\n")
    (out / "samples.jsonl.xz").write_bytes(lzma.compress(b"".join(LINES)))
    rows = records.read_records(out)
    keys = [(r["index"], r["config"]) for r in rows]
    assert keys == [(i, c) for i in range(3) for c in ("dense", "local")] + [(5, "dense")]
    s = {r["config"]: r for r in records.summary_rows(rows)}
    assert s["dense"]["n"] == 4 and s["local"]["n"] == 3


def test_report_stops_at_a_damaged_record_and_with_the_flag_counts_what_it_left_out(tmp_path, capsys):
    out = run_folder(tmp_path / "run", dict(DAMAGED_BODIES)["cut"])
    one_line(capsys, report.main([str(out)]), f"{out / 'samples.jsonl'}:3:", "--skip-damaged")
    assert not (out / "summary.md").exists()  # nothing rewritten from a damaged run
    assert report.main([str(out), "--skip-damaged"]) == 0
    err = capsys.readouterr().err
    assert "left out 1 damaged record line" in err and "samples.jsonl:3" in err
    for table in ("summary.md", "analysis.md"):
        assert "**1 damaged record line(s) left out**" in (out / table).read_text()
        assert f"Written by `python -m lab.report {out} --skip-damaged`." in (out / table).read_text()
    assert "| dense | 100.0 (2)" in (out / "summary.md").read_text()  # the two whole dense records, not three


def test_an_empty_tasks_is_every_task_and_compare_states_the_damaged_lines_it_left_out(tmp_path, capsys):
    """lab.report --tasks '' (or names with blanks and a trailing comma) means the run's tasks, as no --tasks; --compare
    and --dense-table with --skip-damaged say on stderr how many damaged lines they left out, and where; a report
    that left out more than three names the first three and points to summary.md for the rest."""
    assert report.task_subset(" vt , fwe,") == ["vt", "fwe"] and report.task_subset("") == []
    lines = [json.dumps(record(index=i, config=c, pred="x")).encode() + b"\n" for i in range(3)
             for c in ("dense", "local")]
    out = run_folder(tmp_path / "run", b"".join(lines))
    assert report.main([str(out), "--tasks", ""]) == 0 and "| fwe | 3 |" in (out / "summary.md").read_text()
    cut = run_folder(tmp_path / "pilot" / "cut", b"".join(lines[:2]) + b"{\n" + b"".join(lines[2:]),
                     settings={"tasks": ["fwe"], "length": 512})
    capsys.readouterr()
    for argv in ([str(out), "--compare", str(cut)], [str(tmp_path / "pilot"), "--dense-table"]):
        assert report.main(argv + ["--skip-damaged"]) == 0
        err = capsys.readouterr().err
        assert "left out 1 damaged record line(s) (--skip-damaged)" in err and f"{cut / 'samples.jsonl'}:3" in err
    many = run_folder(tmp_path / "many", b"".join(lines[:2]) + b"{\n" * 4)
    assert report.main([str(many), "--skip-damaged"]) == 0
    err = capsys.readouterr().err
    assert "left out 4 damaged record line(s)" in err and "samples.jsonl:5:" in err and "samples.jsonl:6" not in err
    assert err.count("samples.jsonl:") == 3 and "... (all in summary.md)" in err
    assert all(f"samples.jsonl:{n}" in (many / "summary.md").read_text() for n in (3, 4, 5, 6))


def test_the_report_of_an_unfinished_sweep_says_it_is_partial(tmp_path, capsys):
    """A sweep stopped before its end (its run.json entry started, never finished), with a task of its settings not
    yet reached: both table files say so at the top, and the report says so on stderr. A finished run's do not; nor
    does one whose last command finished after an interrupted one."""
    out = run_folder(tmp_path / "run", b"".join(LINES), settings={"tasks": ["fwe", "vt"]})
    info = json.loads((out / "run.json").read_text())
    info["runs"] = [{"command": "lab.sweep ...", "started": "2026-01-02 03:04:05 UTC", "threads": 1}]
    (out / "run.json").write_text(json.dumps(info))
    assert report.main([str(out)]) == 0
    said = ("**A partial run**: the last sweep into this folder, started 2026-01-02 03:04:05 UTC, did not finish; no "
            "record yet of vt.")
    assert said.replace("**", "") in capsys.readouterr().err
    for table in ("summary.md", "analysis.md"):
        assert said in (out / table).read_text()
    info["runs"].append(dict(info["runs"][0], finished="2026-01-02 04:00:00 UTC"))  # resumed to its end
    info["settings"]["tasks"] = ["fwe"]
    (out / "run.json").write_text(json.dumps(info))
    assert report.main([str(out)]) == 0
    assert "partial" not in capsys.readouterr().err and "partial" not in (out / "summary.md").read_text()


def test_the_tables_of_some_of_a_runs_tasks_go_to_another_folder(tmp_path, capsys):
    """lab.report RUN --tasks SUBSET would write the subset's summary.md, analysis.md and figures over RUN's own, beside
    RUN's summary.csv of every task: refused in one line, RUN untouched. With --out DIR the subset's files go there,
    summary.csv too, and their first lines say whose tasks they hold; never into another run's folder. --tasks naming
    every task of the run, in another order (results/ruler-4k's README), writes RUN's own."""
    body = b"".join(json.dumps(record(task=t, index=i, config=c)).encode() + b"\n"
                    for t in ("fwe", "vt") for i in range(2) for c in ("dense", "local"))
    out = run_folder(tmp_path / "run", body, settings={"tasks": ["fwe", "vt"]})
    one_line(capsys, report.main([str(out), "--tasks", "vt"]), "--tasks vt leaves out fwe", "give --out DIR")
    assert sorted(p.name for p in out.iterdir()) == ["run.json", "samples.jsonl"]
    sub = tmp_path / "vt"
    assert report.main([str(out), "--tasks", "vt", "--out", str(sub)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["run.json", "samples.jsonl"]
    summary = (sub / "summary.md").read_text()
    assert summary.startswith("# Summary of run, tasks vt\n") and "fwe left out" in summary and "| fwe |" not in summary
    assert f"Written by `python -m lab.report {out} --tasks vt --out {sub}`." in summary
    assert (sub / "analysis.md").read_text().startswith("# Analysis of run, tasks vt\n")
    assert {line.split(",")[0] for line in (sub / "summary.csv").read_text().splitlines()[1:]} == {"vt"}
    assert report.main([str(out), "--tasks", "vt,fwe"]) == 0
    assert (out / "summary.md").read_text().startswith("# Summary of run\n")
    other = run_folder(tmp_path / "other", body, settings={"tasks": ["fwe", "vt"]})  # another run's own tables
    one_line(capsys, report.main([str(out), "--tasks", "vt", "--out", str(other)]), "is another run's folder")
    assert sorted(p.name for p in other.iterdir()) == ["run.json", "samples.jsonl"]


def test_a_run_with_no_record_yet_reports_so_before_pairing_a_baseline(tmp_path, capsys):
    """A run folder with run.json and no record yet: "no results yet", whatever --with names (here a folder of
    another length, which would be refused as a pairing), and no table written."""
    out = run_folder(tmp_path / "run", b"", settings={"tasks": ["fwe"], "length": 400, "seed": 1, "model": "m"})
    other = run_folder(tmp_path / "other", b"".join(LINES), settings={"tasks": ["fwe"], "length": 800, "seed": 1,
                                                                       "model": "m"})
    assert report.main([str(out), "--with", str(other)]) == 0
    assert "no results yet" in capsys.readouterr().out and not (out / "summary.md").exists()


def test_tables_made_with_another_run_are_not_rewritten_without_it(tmp_path, capsys):
    """lab.report RUN --with OTHER writes OTHER's configurations into RUN's tables; RUN alone would rewrite them
    without those rows: refused in one line naming them, the tables untouched. The same --with again writes them,
    and --out DIR the tables of RUN's records alone."""
    settings = {"tasks": ["fwe"], "length": 400, "seed": 1, "model": "m"}
    out = run_folder(tmp_path / "run", b"".join(LINES), settings=settings)
    other = run_folder(tmp_path / "other", b"".join(json.dumps(record(index=i, config=c)).encode() + b"\n"
                                                    for i in range(3) for c in ("static@0.5", "static@0.8")),
                       settings=settings)
    assert report.main([str(out)]) == 0 and report.main([str(out)]) == 0  # its own tables, rewritten
    assert report.main([str(out), "--with", str(other)]) == 0
    tables = {p.name: p.read_bytes() for p in out.iterdir()}
    assert b"| static@0.8 |" in tables["summary.md"]
    for name in ("summary.md", "analysis.md"):  # the command that wrote them, to write them again
        assert f"Written by `python -m lab.report {out} --with {other}`.".encode() in tables[name]
    capsys.readouterr()
    one_line(capsys, report.main([str(out)]), "2 configuration(s) these records lack (static@0.5, static@0.8)",
             "give that --with again (summary.md names the command")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == tables
    assert report.main([str(out), "--with", str(other)]) == 0
    assert report.main([str(out), "--out", str(tmp_path / "alone")]) == 0
    assert "static" not in (tmp_path / "alone" / "summary.md").read_text()
    (out / "summary.csv").write_bytes(b"\xff\xfe garbage")  # a damaged table: what it held cannot be told
    capsys.readouterr()
    one_line(capsys, report.main([str(out)]), f"{out / 'summary.csv'}: not readable as an earlier report's table",
             "remove it")
    assert (out / "summary.csv").read_bytes() == b"\xff\xfe garbage"


def test_the_tables_of_some_tasks_keep_the_context_free_samples(tmp_path):
    """--tasks SUBSET --out DIR: the run's context-free samples are no task of it and stay in the subset's tables:
    the sparsity table's ctxfree column and Fig. 6c's section."""
    body = b"".join(json.dumps(record(task=t, index=i, config=c)).encode() + b"\n"
                    for t in ("fwe", "vt") for i in range(2) for c in ("dense", "local"))
    body += json.dumps(dict(record("ctxfree", 0, "local"), score=None, sparsity=0.9, pred=" 1")).encode() + b"\n"
    out = run_folder(tmp_path / "run", body, settings={"tasks": ["fwe", "vt"]})
    assert report.main([str(out), "--tasks", "vt", "--out", str(tmp_path / "vt")]) == 0
    assert "| config | vt | ctxfree |\n" in (tmp_path / "vt" / "summary.md").read_text()
    assert "| local | 0.000 ± 0.000 | 0.900 | 1 |\n" in (tmp_path / "vt" / "analysis.md").read_text()


def test_a_sweep_of_context_free_samples_alone_gets_whole_tables(tmp_path):
    """--tasks '' (the context-free samples only): every table's rows have its header's columns, and the sparsity
    table has the context-free configs' rows."""
    fields = dict(sparsity=0.8, score=None, pred=" 1", path="qada", source="random-words", threshold=0.6,
                  threshold_kind="tau", steps=2, n_prompt=300)  # a context-free sample has no score
    body = b"".join(json.dumps(record("ctxfree", i, "qada_rw@0.6") | fields).encode() + b"\n" for i in range(2))
    out = run_folder(tmp_path / "run", body, settings={"tasks": []})
    assert report.main([str(out)]) == 0
    text = (out / "summary.md").read_text()
    for table in text.split("\n\n"):
        rows = [line for line in table.splitlines() if line.startswith("|")]
        assert len({line.count("|") for line in rows}) <= 1, table
    assert "| qada_rw@0.6 | 0.800 |" in text


def test_a_run_whose_dense_scored_nothing_gets_its_figures(tmp_path, capsys):
    """Dense scoring 0 on every task (a small model on a hard task) leaves no score / dense to plot: the moments
    ablation figure is drawn without those points, not a traceback from matplotlib."""
    def rec(i, config):
        tau = {"threshold": 0.6, "path": "qada", "threshold_kind": "tau"} if "@" in config else {}
        return record("fwe", i, config) | tau | {"score": 0.0}
    body = b"".join(json.dumps(rec(i, c)).encode() + b"\n" for i in range(2)
                    for c in ("dense", "qada_rw@0.6", "qada_word@0.6"))
    out = run_folder(tmp_path / "run", body, settings={"tasks": ["fwe"]})
    assert report.main([str(out)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert (out / "fig5efg_moments_ablation.png").is_file()


def test_with_no_tasks_a_static_method_calibrates_nothing(tmp_path, tiny_dir, monkeypatch):
    """--tasks '' runs the context-free samples alone, so the tasks' configurations are not run and what they would
    read is not made: no static labels calibrated (on no tasks, which failed inside torch.stack)."""
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    argv = ["--out", str(out), "--model", str(tiny_dir), "--length", "400", "--tasks", "", "--ctxfree-samples", "1",
            "--methods", "dense,static", "--sparsities", "0.5", "--ablations", "", "--device", "cpu", "--no-report"]
    assert sweep.main(argv) == 0
    assert not (out / "static_labels").exists()
    # the context-free runs
    assert {r["config"].split("@")[0] for r in records.read_records(out)} == {"oracle", "qada_rw"}


def test_a_resume_stops_at_a_damaged_record_before_loading_and_with_the_flag_decodes_it_again(tmp_path, tiny_dir,
                                                                                              monkeypatch, capsys):
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["--out", str(out), "--model", str(tiny_dir)] + RUN
    assert sweep.main(argv) == 0
    capsys.readouterr()
    whole = records.read_records(out)
    lines = [json.dumps(r) + "\n" for r in whole]
    (out / "samples.jsonl.xz").unlink()
    (out / "samples.jsonl").write_text(lines[0] + lines[1][:40] + "\n" + "".join(lines[2:]))  # cut mid-file
    load = sweep.load
    monkeypatch.setattr(sweep, "load", lambda *a, **k: pytest.fail("loaded a model before finding the damage"))
    one_line(capsys, sweep.main(argv), f"{out / 'samples.jsonl'}:2:", "--skip-damaged")
    monkeypatch.setattr(sweep, "load", load)
    assert sweep.main(argv + ["--skip-damaged"]) == 0
    assert "left out 1 damaged record line" in capsys.readouterr().err
    again = records.read_records(out)
    assert ([(r["task"], r["index"], r["config"]) for r in again]
            == [(r["task"], r["index"], r["config"]) for r in whole])
    kept = (out / "samples.jsonl.damaged").read_text()  # kept beside (out of result_files) as it stood at the merge:
    assert lines[1][:40] + "\n" in kept and kept.count("\n") == 5  # its 4 lines and the record decoded again
    runs = json.loads((out / "run.json").read_text())["runs"]
    assert runs[-1]["lines_written"] == 1 and len(runs[-1]["damaged_lines_left_out"]) == 1


def test_a_merge_keeps_a_file_that_grew_after_it_was_read(tmp_path, monkeypatch):
    """A writer outside the lock (a sweep of an older version) appends after the merge read its file: the file stays,
    with the new line, for the next merge."""
    (tmp_path / "samples.1.jsonl").write_bytes(LINES[0])
    read = sweep.file_records

    def then_append(path, on_damage=None):
        got = read(path, on_damage)
        with open(tmp_path / "samples.1.jsonl", "ab") as f:
            f.write(LINES[1])
        return got
    monkeypatch.setattr(sweep, "file_records", then_append)
    sweep.merge(tmp_path, [])
    assert (tmp_path / "samples.1.jsonl").read_bytes() == LINES[0] + LINES[1]
    assert {r["config"] for r in records.read_records(tmp_path)} == {"dense", "local"}  # the new one is not lost


# ---------------------------------------------------------------------------------------------------------
# The folder's lock


def test_a_second_sweep_is_refused_while_one_holds_the_folder(tmp_path, tiny_dir, no_model, capsys):
    out = tmp_path / "run"
    out.mkdir()
    argv = ["--out", str(out), "--model", str(tiny_dir)] + RUN
    with sweep.folder_lock(out):
        one_line(capsys, sweep.main(argv), "another lab.sweep", f"pid {os.getpid()}")
        one_line(capsys, sweep.main(argv + ["--shard", "1/2"]), "another lab.sweep")  # a shard waits for it too
    assert not (out / "run.json").exists() and list(out.iterdir()) == []  # the refused run wrote nothing


def test_shards_share_the_folder_but_not_a_file_and_keep_a_merging_sweep_out(tmp_path):
    with sweep.folder_lock(tmp_path, 0), sweep.folder_lock(tmp_path, 1):  # --shard 0/2 and 1/2 by hand
        with pytest.raises(sweep.FolderLocked):
            with sweep.folder_lock(tmp_path):  # its merge would remove their files
                pass
        with pytest.raises(sweep.FolderLocked):
            with sweep.folder_lock(tmp_path, 1):  # two writers of samples.1.jsonl
                pass
    assert list(tmp_path.iterdir()) == []  # the last one out removes the lock files
    with sweep.folder_lock(tmp_path):
        pass


def test_the_lock_of_another_process_is_seen_and_goes_with_it(tmp_path, capsys):
    hold = subprocess.Popen([sys.executable, "-c", "import sys, time; from lab import sweep\n"
                             f"with sweep.folder_lock({str(tmp_path)!r}):\n"
                             "    print('held', flush=True); time.sleep(60)"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert hold.stdout.readline().strip() == "held"
        with pytest.raises(sweep.FolderLocked, match=f"pid {hold.pid}\\)"):
            with sweep.folder_lock(tmp_path):
                pass
    finally:
        hold.kill()  # killed, not let go: the kernel releases the lock
        hold.wait()
    with sweep.folder_lock(tmp_path):
        assert (tmp_path / "sweep.lock").read_text().strip() == str(os.getpid())


# ---------------------------------------------------------------------------------------------------------
# Nothing overwritten unless asked


def other_labels(folder: Path, model: str = "/other") -> None:
    """Static labels of another model in `folder`, with the settings lab.calibrate's defaults would write."""
    common = dict(length=400, samples=1, seed=1, max_new_tokens=4, tau=0.6, n_sink=16, n_local=128, model=model)
    save_labels(folder / "fwe.json", torch.full((2, 4), 0.25), dict(task="fwe", **common))
    save_labels(folder / "ruler.json", torch.full((2, 4), 0.25),
                dict(tasks=["fwe"], **{k: v for k, v in common.items() if k != "max_new_tokens"}))


def test_calibrate_refuses_to_overwrite_another_models_labels_unless_forced(tmp_path, tiny_dir, monkeypatch, capsys):
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "labels"
    out.mkdir()
    other_labels(out)
    before = (out / "fwe.json").read_text()
    argv = ["--tasks", "fwe", "--length", "400", "--samples", "1", "--max-new-tokens", "4", "--model", str(tiny_dir),
            "--out", str(out), "--device", "cpu"]
    load = calibrate.load
    monkeypatch.setattr(calibrate, "load", lambda *a, **k: pytest.fail("loaded a model before refusing"))
    one_line(capsys, calibrate.main(argv), f"{out / 'fwe.json'} holds static labels of other settings",
             "model: '/other' there", "--force")
    assert (out / "fwe.json").read_text() == before
    monkeypatch.setattr(calibrate, "load", load)
    assert calibrate.main(argv + ["--force"]) == 0
    assert json.loads((out / "fwe.json").read_text())["settings"]["model"] == str(tiny_dir)
    again = (out / "fwe.json").read_text()
    assert calibrate.main(argv) == 0 and (out / "fwe.json").read_text() == again  # the same settings: reused


def test_calibrate_tells_the_model_of_the_labels_in_out_before_loading_it(tmp_path, tiny_dir, no_model, monkeypatch,
                                                                          capsys):
    """The model a calibration will load is known before it loads where its name tells it: a named model (the
    default without --model) by its folder in the cache, a local folder as itself, the same folder run by transformers
    (--hf) as another runner; a hub id only once loaded. So labels in --out of another model are refused before any
    model is fetched or loaded."""
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(calibrate, "resolve", lambda *a, **k: pytest.fail("fetched a model before refusing"))
    monkeypatch.setattr("integrations.transformers.load", lambda *a, **k: pytest.fail("loaded a model before refusing"))
    named = str(tmp_path / "cache" / "models" / DEFAULT)
    assert calibrate.planned_model(None) == calibrate.planned_model(DEFAULT) == named
    assert calibrate.planned_model(str(tiny_dir)) == str(tiny_dir) and calibrate.planned_model("owner/none") is None
    out = tmp_path / "labels"
    out.mkdir()
    other_labels(out, model=str(tiny_dir))
    argv = ["--tasks", "fwe", "--length", "400", "--samples", "1", "--max-new-tokens", "4", "--out", str(out),
            "--device", "cpu"]
    one_line(capsys, calibrate.main(argv), f"model: {str(tiny_dir)!r} there, {named!r} asked")
    one_line(capsys, calibrate.main(argv + ["--hf", str(tiny_dir)]), f"'transformers:{tiny_dir}' asked")


def test_calibrate_qada_refuses_unreadable_masses_and_corrections_of_other_settings(tmp_path, tiny_dir, no_model,
                                                                                    capsys):
    argv = ["--qada", "--tasks", "fwe", "--length", "400", "--samples", "1", "--model", str(tiny_dir), "--device",
            "cpu"]
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "masses.pt").write_bytes(b"PK\x03\x04 cut short")
    one_line(capsys, calibrate.main(argv + ["--out", str(cut)]), f"{cut / 'masses.pt'}: unreadable masses", "--force")
    fitted = tmp_path / "fitted"
    fitted.mkdir()
    save_calibration(fitted / "affine.json", Calibration(torch.zeros(2, 4), torch.ones(2, 4), None,
                                                         dict(tasks=["vt"], length=400, kind="affine")))
    one_line(capsys, calibrate.main(argv + ["--out", str(fitted)]), "affine.json holds a correction fitted with "
             "other settings (tasks: ['vt'] there, ['fwe'] asked", "--force")


def test_bench_writes_a_fresh_folder_by_default_never_the_committed_results(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "Timer", lambda device: None)
    monkeypatch.setattr(bench, "bench_attention", lambda *a: [])
    monkeypatch.setattr(bench, "profile_qada", lambda *a, **k: "")
    monkeypatch.setattr(bench, "plot", lambda *a, **k: None)
    argv = ["--parts", "attention", "--lengths", "300", "--device", "cpu"]
    assert bench.main(argv) == 0 and bench.main(argv) == 0
    folders = sorted((tmp_path / "runs" / "bench").iterdir())
    assert len(folders) == 2 and all((f / "attention.json").is_file() for f in folders)  # one each, none replaced
    assert not (tmp_path / "results").exists()
    assert "runs/bench/" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------
# Bad input, table-driven: exit 2, one line naming the cause, before any model loads


def places(tmp_path: Path, tiny_dir: Path) -> dict[str, str]:
    """The files and folders the bad-input table names, made in tmp_path."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("x")
    labels = tmp_path / "labels"
    labels.mkdir()
    other_labels(labels)
    cal = tmp_path / "cal"
    cal.mkdir()
    save_calibration(cal / "affine.json", Calibration(torch.zeros(2, 4), torch.ones(2, 4), None, dict(kind="affine")))
    run_folder(tmp_path / "no_settings", LINES[0]).joinpath("run.json").write_text('{"runs": []}')
    run_folder(tmp_path / "bad_runs", LINES[0]).joinpath("run.json").write_text('{"settings": {}, "runs": [5]}')
    run_folder(tmp_path / "bad_tasks", LINES[0]).joinpath("run.json").write_text('{"settings": {"tasks": 5}}')
    run_folder(tmp_path / "run", b"".join(LINES))
    save_labels(labels / "window.json", torch.full((2, 4), 0.25), dict(n_sink=16, n_local=64))
    for name, n_prompt in (("prompts_a", 300), ("prompts_b", 600)):  # another length: other prompts, same keys
        run_folder(tmp_path / name, json.dumps(record(n_prompt=n_prompt)).encode() + b"\n")
    save_calibration(cal / "window.json", Calibration(torch.zeros(2, 4), torch.ones(2, 4), None,
                                                      dict(kind="affine", n_sink=16, n_local=64)))
    (tmp_path / "cal_window").mkdir()  # a lab.calibrate --qada folder whose correction has another window
    shutil.copy(cal / "window.json", tmp_path / "cal_window" / "affine.json")
    (tmp_path / "records_only").mkdir()
    (tmp_path / "records_only" / "samples.jsonl").write_bytes(LINES[0])
    run_folder(tmp_path / "cut", dict(DAMAGED_BODIES)["cut"])
    run_folder(tmp_path / "truncated", dict(DAMAGED_BODIES)["truncated-xz"], "samples.jsonl.xz")
    (tmp_path / "cut" / "run.json").write_text(json.dumps({"settings": dict(
        tasks=["fwe"], length=400, seed=42, stop="eos", n_sink=16, n_local=128, model=str(tiny_dir), calib_seed=1,
        dtype="float32")}))
    return {k: str(tmp_path / k) for k in ("empty", "a_file", "labels", "cal", "no_settings", "run", "cut",
                                           "truncated", "missing", "records_only", "prompts_a", "prompts_b",
                                           "cal_window", "bad_runs", "bad_tasks")} | {
        "tiny": str(tiny_dir)}


DAMAGED_BODIES = [(name, body) for name, _, body, _ in DAMAGED]
SWEEP = [  # (argv after --out OUT --model TINY and RUN, what the line names)
    (["--samples", "0"], "argument --samples: must be at least 1"),
    (["--samples", "x"], "argument --samples: takes an integer"),
    (["--taus", "abc"], "argument --taus: takes comma-separated numbers"),
    (["--taus", "nan"], "argument --taus: takes numbers in (0, 1]"),
    (["--taus", "1.5"], "argument --taus: takes numbers in (0, 1], got 1.5"),  # the range that --taus 0 is held to
    (["--grid", "oracle=0"], "--grid oracle=0: takes numbers in (0, 1], got 0"),
    (["--sparsities", "1.5"], "argument --sparsities"),
    (["--threads", "0"], "argument --threads: must be at least 1"),
    (["--threads", "-1"], "argument --threads"),
    (["--threads", "100000"], "argument --threads: must lie in [1, "),  # a segfault in torch, after run.json
    (["--batch", "0"], "argument --batch"),
    (["--tasks", "nope"], "unknown task 'nope'"),
    (["--methods", "dense,nope"], "--methods: unknown method 'nope'"),
    (["--length", "600"], "--length 600 exceeds the model's trained context of 512"),  # positions it never saw
    (["--methods", "dense,dense"], "--methods: names dense twice"),  # decoded twice, one record, "2 runs written"
    (["--ablations", "qada_word,qada_word"], "--ablations: names qada_word twice"),
    (["--methods", "dense,qada", "--taus", "0.6,0.60"], "--methods: the threshold grid of qada gives qada@0.6 twice"),
    (["--methods", "dense,quest", "--grid", "quest=64,64"], "the threshold grid of quest gives quest@64 twice"),
    (["--track", "qada_wr"], "--track: unknown method 'qada_wr'"),
    (["--track", "dense,oracle"], "--track oracle: not among --methods, --ablations or the context-free runs"),
    (["--grid", "oracle=abc"], "--grid oracle=abc"),
    (["--grid", "nope=0.5"], "--grid nope=0.5: unknown method"),
    (["--shard", "2/2"], "argument --shard: takes K/N"),
    (["--n-sink", "128"], "--n-sink"),
    (["--tasks", "fwe,fwe"], "argument --tasks: names fwe twice"),  # its samples would count twice in every average
    (["--static-tasks", "nosuch"], "argument --static-tasks: unknown task 'nosuch'"),  # a KeyError after calibrating
    (["--static-tasks", "fwe,fwe"], "argument --static-tasks: names fwe twice"),
    (["--static-tasks", "fwe"], "--static-tasks fwe: no method run reads static labels"),  # ignored, silently
    (["--static-labels", "{labels}"], "--static-labels {labels}: no method run reads static labels"),
    (["--methods", "dense,static", "--sparsities", "0.5", "--static-labels", "{labels}/window.json"],
     "window.json holds the oracle's statistics with n_local 64, not 128"),  # a folder's labels are checked so too
    (["--methods", "dense,qada", "--taus", ""], "--methods qada: its grid is empty, so it would not run"),
    (["--methods", "dense,quest", "--grid", "quest=256", "--grid", "quest=512"], "--grid quest is given twice"),
    ("QADA_KERNEL=bogus", "QADA_KERNEL takes auto, triton or torch; got 'bogus'"),  # said at the first decode step
    (["--set", "pages=abc"], "--set pages: the page index is built from the prompt's keys, not set"),
    (["--samp", "1"], "unrecognized arguments: --samp"),  # --quick would not see it given
    (["--out", "{cut}", "--methods", "dense,static", "--static-labels", "{labels}/ruler.json"],
     "holds a run with other settings {{'static_labels': (None, '{labels}/ruler.json')}}"),  # not mixed in
    (["--tasks", "", "--ctxfree-samples", "0"], "nothing to decode"),
    (["--methods", "", "--track", ""], "nothing to run: --methods and --ablations give no"),
    (["--grid", "oracle=0.6"], "--grid oracle=...: oracle is not among --methods with a threshold"),
    (["--methods", "dense,qada", "--taus", "0,0.6"], "argument --taus: takes numbers in (0, 1], got 0"),
    (["--ablations", "oracle", "--ablation-taus", "0"], "argument --ablation-taus: takes numbers in (0, 1], got 0"),
    (["--methods", "dense,qada_cal"], "qada_cal reads the affine calibration: give --calibration"),
    (["--methods", "dense,qada_cal", "--calibration", "{empty}"], "{empty}: the folder holds no affine.json"),
    (["--methods", "dense,qada_cal", "--calibration", "{missing}"], "{missing}: no such file or folder"),
    (["--methods", "dense,qada_cal_offset", "--calibration", "{cal}/affine.json"],
     "holds the affine correction, not the offset one"),
    (["--methods", "dense", "--calibration", "{cal}"], "--calibration {cal}: no method of --methods reads it"),
    (["--methods", "dense,qada_cal_transfer", "--calibration-transfer", "{cal}", "--calibration", "{cal}"],
     "--calibration {cal}: no method of --methods reads it"),  # the *_transfer methods read the other flag's
    (["--methods", "dense,static_oracle", "--sparsities", "0.5", "--static-labels", "{labels}/ruler.json"],
     "is one file; static_oracle reads one per task"),
    (["--methods", "dense,static", "--sparsities", "0.5", "--static-labels", "{labels}"],
     "fwe.json holds static labels of other settings"),
    (["--device", "tpu"], "--device takes cpu, cuda or cuda:N"),
    (["--out", "{a_file}"], "is a file"),
    (["--out", "{no_settings}"], 'no_settings/run.json: no "settings"'),
    (["--out", "{cut}"], "cut/samples.jsonl:3:"),
]
REPORT = [  # (argv, what the line names)
    (["{missing}"], "no such run folder"),
    (["{a_file}"], "a file, not a run folder"),
    (["{empty}"], "is not a run folder"),
    (["{run}", "--with", "{empty}"], "{empty} is not a run folder"),
    (["{run}", "--with", "{records_only}"], "{records_only} has records but no run.json"),
    (["{run}", "--tasks", "vt"], "--tasks vt: no record of it"),
    (["{run}", "--tasks", "fwe,fwe"], "argument --tasks: names fwe twice"),  # its rows twice, counted twice
    (["{empty}", "--dense-table"], "no run folder in it"),
    (["{no_settings}"], 'run.json: no "settings"'),
    (["{bad_runs}"], 'bad_runs/run.json: "runs" is no list of objects or settings.tasks no list of task names'),
    (["{bad_tasks}"], 'bad_tasks/run.json: "runs" is no list of objects or settings.tasks no list'),
    (["{cut}"], "cut/samples.jsonl:3:"),
    (["{truncated}"], "truncated/samples.jsonl.xz:1: the compressed data end early"),
    (["{run}", "--compare", "{cut}"], "cut/samples.jsonl:3:"),
    (["{run}", "--compare", "{run}", "--tasks", "vt"], "--tasks vt: {run} and {run} share no record of it"),
    (["{run}", "--compare", "{run}", "--with", "{run}"], "--with is for one run's tables; --compare reads no"),
    (["{prompts_a}", "--compare", "{prompts_b}"], "did not decode the same prompts: fwe#0 has 300 prompt tokens in"),
    (["{empty}", "--dense-table", "--with", "{run}"], "--with is for one run's tables; --dense-table reads no"),
    (["{empty}", "--dense-table", "--compare", "{run}"], "--compare and --dense-table are two different tables"),
    (["{run}", "--compare", "{run}", "--out", "{empty}"], "--out is for one run's tables; --compare writes none"),
    (["{run}", "--out", "{a_file}"], "--out {a_file} is a file"),
]
CALIBRATE = [  # (argv after --model TINY --device cpu, what the line names)
    (["--out", "{empty}"], "the following arguments are required: --tasks"),
    (["--tasks", "nope", "--out", "{empty}"], "unknown task 'nope'"),
    (["--tasks", "", "--out", "{empty}"], "argument --tasks: names no task"),
    (["--tasks", ",", "--qada", "--out", "{empty}"], "argument --tasks: names no task"),
    (["--tasks", "fwe", "--samples", "0", "--out", "{empty}"], "argument --samples: must be at least 1"),
    (["--tasks", "fwe", "--threads", "-1", "--out", "{empty}"], "argument --threads"),
    (["--tasks", "fwe", "--threads", "100000", "--out", "{empty}"], "argument --threads: must lie in [1, "),
    (["--tasks", "fwe", "--eps", "nan", "--out", "{empty}"], "argument --eps: must lie in (0, 1)"),
    (["--tasks", "fwe", "--qada", "--eps", "0", "--out", "{empty}"], "argument --eps: must lie in (0, 1), got '0'"),
    (["--tasks", "fwe", "--qada", "--eps", "1", "--out", "{empty}"], "argument --eps: must lie in (0, 1), got '1'"),
    (["--tasks", "fwe", "--qada", "--eps", "x", "--out", "{empty}"], "argument --eps: must lie in (0, 1), got 'x'"),
    (["--tasks", "fwe", "--out", "{a_file}"], "is a file"),
    (["--tasks", "fwe", "--model", "{missing}", "--out", "{empty}"], "no such folder"),  # an OSError
    (["--tasks", "fwe", "--model", "~nosuchuser/m", "--out", "{empty}"], "no such folder"),  # no RuntimeError
    (["--tasks", "fwe", "--model", "{empty}", "--qada", "--out", "{empty}"], "has no config.json"),
    (["--tasks", "fwe", "--length", "600", "--out", "{empty}"],
     "--length 600 exceeds the model's trained context of 512"),
    (["--tasks", "fwe,vt", "--length", "130", "--out", "{missing}"], "a length of 130 tokens is too short for fwe"),
    (["--tasks", "fwe", "--eps", "0.1", "--out", "{empty}"], "--eps sets how --qada fits its correction; without "
     "--qada it is unused"),
    (["--tasks", "fwe", "--moments", "prompt", "--out", "{empty}"], "--moments sets how --qada fits"),
    (["--tasks", "fwe", "--length", "400", "--samples", "1", "--max-new-tokens", "4", "--out", "{labels}"],
     "holds static labels of other settings"),
]
BENCH = [  # (argv after --device cpu, what the line names)
    (["--lengths", "abc"], "argument --lengths: takes comma-separated integers"),
    (["--lengths", "0"], "argument --lengths"),
    (["--batches", "1,x"], "argument --batches"),
    (["--repeats", "0"], "argument --repeats"),
    (["--threads", "-1"], "argument --threads"),
    (["--threads", "100000"], "argument --threads: must lie in [1, "),
    (["--decode-tokens", "0"], "argument --decode-tokens"),
    (["--rope-theta", "nan"], "argument --rope-theta"),
    (["--e2e-methods", "qada@x"], "--e2e-methods 'qada@x'"),
    (["--e2e-methods", "qada@0"], "--e2e-methods 'qada@0': TAU takes a number in (0, 1]"),  # before any timing
    (["--e2e-methods", "nope@0.6"], "--e2e-methods takes PATH@TAU"),
    (["--calibration", "{cal}"], "no method of --e2e-methods reads a calibration"),
    (["--e2e-methods", "qada_cal@0.2", "--calibration", "{empty}"], "{empty}: the folder holds no affine.json"),
    (["--e2e-methods", "qada_cal@0.2", "--calibration", "{missing}"], "no such file or folder"),
    (["--prefill-only", "--parts", "e2e"], "--prefill-only fills --prefill-cache"),
    (["--out", "{a_file}"], "is a file"),
    (["--lengths", "2048,50"], "each length must exceed the window (128), got '2048,50'"),
    (["--lengths", "128"], "each length must exceed the window (128), got '128'"),  # no bulk left to estimate
    (["--prefill-only", "--prefill-cache", "{empty}"], "--prefill-only is for the end-to-end part: give --parts e2e"),
    (["--parts", "attention", "--batches", "1"], "--batches is for the end-to-end part"),
    (["--parts", "attention", "--rope-theta", "1e5"], "--rope-theta is for the end-to-end part"),
    (["--model", "{missing}"], "no such folder"),  # before the attention part runs (no_model fails it)
    (["--model", "{empty}", "--parts", "e2e"], "has no config.json"),
    (["--model", "{tiny}", "--e2e-methods", "qada_cal@0.2"], "ships no calibration: give --calibration FILE"),
    (["--e2e-methods", "qada_cal@0.2", "--calibration", "{cal}/window.json"], "was fitted with n_local 64, not 128"),
    (["--e2e-methods", "qada_cal@0.2", "--calibration", "{cal_window}"], "was fitted with n_local 64, not 128"),
    ("QADA_KERNEL=bogus", "QADA_KERNEL takes auto, triton or torch; got 'bogus'"),  # a traceback mid-run
    (["--parts", "e2e", "--compile"], "--compile is for the attention part, which --parts e2e leaves out"),  # unused
    (["--parts", "attention", "--dtype", "bfloat16"], "--dtype is for the end-to-end part"),  # silently
    (["--parts", "attention", "--e2e-methods", "qada_kv@0.6"], "--e2e-methods is for the end-to-end part"),
]
CASES = ([("sweep", a, m) for a, m in SWEEP] + [("report", a, m) for a, m in REPORT]
         + [("calibrate", a, m) for a, m in CALIBRATE] + [("bench", a, m) for a, m in BENCH])


@pytest.mark.parametrize("cli, argv, message", CASES,
                         ids=[f"{c}:{a if isinstance(a, str) else ' '.join(a)}" for c, a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2_before_any_model_loads(tmp_path, tiny_dir, no_model, capsys, monkeypatch,
                                                                 cli, argv, message):
    where = places(tmp_path, tiny_dir)
    if isinstance(argv, str):  # an environment variable, the command otherwise good
        name, value = argv.split("=")
        monkeypatch.setenv(name, value)
        argv = []
    argv, message = [a.format(**where) for a in argv], message.format(**where)
    if cli == "sweep":
        rc = sweep.main(["--out", str(tmp_path / "out"), "--model", where["tiny"]] + RUN + argv)
    elif cli == "report":
        rc = report.main(argv)
    elif cli == "calibrate":
        rc = calibrate.main(["--model", where["tiny"], "--device", "cpu"] + argv)
    else:
        rc = bench.main(["--device", "cpu"] + argv)
    one_line(capsys, rc, message)


@pytest.mark.parametrize("argv, message", [
    (["--length", "100"], "a length of 100 tokens is too short for fwe"),
    (["--length", "600"], "--length 600 exceeds the model's trained context of 512"),
    (["--methods", "dense,qada_cal", "--calibration", "{cal}/window.json"], "n_local 64, not 128"),
    (["--methods", "dense,dense"], "--methods: names dense twice"),
    (["--tasks", "", "--ctxfree-samples", "1", "--track", "", "--length", "150"],
     "the context-free samples (--ctxfree-samples, built on qa_2's documents): a length of 150 tokens is too short"),
], ids=["too-short", "past-the-context", "calibration-window", "flag", "context-free-too-short"])
def test_a_refused_sweep_makes_no_out_folder(tmp_path, tiny_dir, no_model, capsys, argv, message):
    """What refuses a run is found before --out is made (and before the weights load: the model's config and
    tokenizer serve the checks): the folder appears only once the run goes ahead."""
    where = places(tmp_path, tiny_dir)
    out = tmp_path / "new" / "out"
    argv = ["--out", str(out), "--model", str(tiny_dir)] + RUN + [a.format(**where) for a in argv]
    one_line(capsys, sweep.main(argv), message)
    assert not (tmp_path / "new").exists()


def test_a_refused_calibration_makes_no_out_folder(tmp_path, tiny_dir, no_model, capsys):
    """A length too short for a task is found from the model's tokenizer before the weights load and --out is made."""
    for qada in ([], ["--qada"]):
        one_line(capsys, calibrate.main(["--model", str(tiny_dir), "--device", "cpu", "--tasks", "fwe", "--length",
                                         "130", "--out", str(tmp_path / "new" / "cal")] + qada),
                 "a length of 130 tokens is too short for fwe")
    assert not (tmp_path / "new").exists()


def test_a_length_past_the_trained_context_is_refused_unless_the_config_extends_it():
    """lab.sweep's and lab.calibrate's --length, held as generate.py's --max-context is: up to the model's trained
    context, or past it where the config's rope_scaling says how far the model reaches."""
    generate.check_context(512, LlamaConfig(max_position_embeddings=512), "--length")
    with pytest.raises(ValueError, match="--length 513 exceeds the model's trained context of 512; give at most 512"):
        generate.check_context(513, LlamaConfig(max_position_embeddings=512), "--length")
    generate.check_context(4096, LlamaConfig(max_position_embeddings=512, rope_scaling={"rope_type": "linear",
                                                                                       "factor": 8}), "--length")


def test_static_tasks_name_the_tasks_of_the_ruler_labels(tmp_path, tiny_dir, monkeypatch):
    """--static-tasks, not --tasks, names the tasks whose calibration makes the static (RULER) labels: the labels
    folder is checked for both tasks' files and for a ruler.json of --static-tasks (stopped there, before any model
    loads)."""
    seen = []

    def check_labels(folder, tasks, ruler_tasks, common, force=False, hint=""):
        seen.append((tasks, ruler_tasks))
        raise ValueError("checked")

    monkeypatch.setattr(calibrate, "check_labels", check_labels)
    run = [a if a != "dense,local" else "dense,static" for a in RUN] + ["--sparsities", "0.5"]
    argv = ["--out", str(tmp_path / "out"), "--model", str(tiny_dir)] + run
    assert sweep.main(argv.copy()) == 2 and seen[-1] == (["fwe"], ["fwe"])
    assert (sweep.main(argv + ["--static-tasks", "vt,,qa_1"]) == 2
            and seen[-1] == (["fwe", "vt", "qa_1"], ["vt", "qa_1"]))


def test_one_new_token_decodes_no_step_and_is_refused_before_loading(tmp_path, tiny_dir, no_model, capsys):
    """One new token is the prefill's: a calibration with no decode step fits nothing, said at once rather than after
    every prompt's prefill, and no --out folder is made."""
    for qada in ([], ["--qada"]):
        one_line(capsys, calibrate.main(["--model", str(tiny_dir), "--device", "cpu", "--tasks", "fwe", "--length",
                                         "400", "--max-new-tokens", "1", "--out", str(tmp_path / "cal")] + qada),
                 "argument --max-new-tokens: must be at least 2")
    one_line(capsys, sweep.main(["--out", str(tmp_path / "run"), "--model", str(tiny_dir), "--calib-max-new-tokens",
                                 "1"] + RUN), "argument --calib-max-new-tokens: must be at least 2")
    assert not (tmp_path / "cal").exists() and not (tmp_path / "run").exists()


def test_calibrate_qada_with_no_step_past_the_window_says_so(tmp_path, tiny_dir, capsys, monkeypatch):
    """Answers that end at their first token (the prefill's): no decode step runs, so no mass is recorded and there
    is nothing to fit."""
    make = calibrate.make_sample
    monkeypatch.setattr(calibrate, "make_sample", lambda *a, **k: dataclasses.replace(make(*a, **k), max_new_tokens=1))
    rc = calibrate.main(["--model", str(tiny_dir), "--device", "cpu", "--qada", "--tasks", "fwe", "--length", "400",
                         "--samples", "1", "--max-new-tokens", "4", "--out", str(tmp_path / "cal")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err  # after the prompt's progress line, one line of error
    assert err.splitlines()[-1].startswith("error: no decode step of the calibration prompts went past the window "
                                           "(128 tokens)")


def test_a_shard_keeps_the_command_another_shard_recorded_while_it_ran(tmp_path, tiny_dir, monkeypatch):
    """--shard processes run side by side and each adds its command to run.json when it starts and completes it at
    its end: the last to end keeps the others' (it read run.json when it started, before they ended). Shard K of N
    decodes every N-th task from the K-th (whole tasks, not every N-th sample) into samples.K.jsonl and merges
    nothing: another shard's file stays where it is."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "samples.0.jsonl").write_text(json.dumps(record()) + "\n")  # shard 0's, written meanwhile
    seen = {}

    def other_shard_ends(net, tok, folder, mine, *args):  # this shard's decoding, during which the other one ends
        seen.update(jobs=[(t, i) for t, i, _ in mine], path=args[8])
        info = json.loads((folder / "run.json").read_text())
        info["runs"].append({"command": "the other shard"})
        (folder / "run.json").write_text(json.dumps(info))
        return 0
    monkeypatch.setattr(sweep, "sweep", other_shard_ends)
    argv = ["--out", str(out), "--model", str(tiny_dir), "--shard", "1/3"] + RUN + ["--tasks", "fwe,niah_single_1"]
    assert sweep.main(argv) == 0
    assert seen == {"jobs": [("niah_single_1", 0), ("niah_single_1", 1)], "path": out / "samples.1.jsonl"}
    assert (out / "samples.0.jsonl").is_file() and not (out / "samples.jsonl.xz").exists()
    runs = json.loads((out / "run.json").read_text())["runs"]
    assert len(runs) == 2 and runs[1] == {"command": "the other shard"}
    assert runs[0]["lines_written"] == 0 and runs[0]["started"] and runs[0]["finished"]  # this one's, completed


def test_torchrun_refuses_a_shard_by_hand(tmp_path, tiny_dir, no_model, capsys, monkeypatch):
    """Under torchrun the ranks split the sweep, so a --shard K/N given as well would be silently ignored: refused in
    one line before a model loads or --out is made."""
    monkeypatch.setattr(sweep.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sweep.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(sweep.dist, "get_world_size", lambda: 2)
    argv = ["--out", str(tmp_path / "out"), "--model", str(tiny_dir), "--shard", "1/2"] + RUN
    one_line(capsys, sweep.main(argv), "--shard splits a sweep by hand")
    assert not (tmp_path / "out").exists()


def test_run_from_python_refuses_a_tau_of_0_before_loading(tmp_path, tiny_dir, no_model, monkeypatch):
    """sweep.run called from Python takes values that no CLI parser checked: a tau of 0 is refused there, naming the
    method, and a batch of 0, before a model loads or --out is made."""
    seen, run = {}, sweep.run
    monkeypatch.setattr(sweep, "run", lambda **kwargs: seen.update(kwargs))
    assert sweep.main(["--out", str(tmp_path / "out"), "--model", str(tiny_dir)] + RUN) == 0
    with pytest.raises(ValueError, match=re.escape("oracle (--taus, --ablation-taus or --grid): ")):
        run(**dict(seen, methods="dense,oracle", taus="0,0.6"))
    with pytest.raises(ValueError, match="--batch must be at least 1, got 0"):  # no batch of rows to decode
        run(**dict(seen, batch=0))
    assert not (tmp_path / "out").exists()


def test_a_resume_with_other_tasks_adds_them_to_the_settings(tmp_path, tiny_dir, monkeypatch):
    """--tasks is no setting that clashes: a folder resumed with another task goes on, and run.json's settings name
    the tasks of both runs, the earlier first (lab.report's tables read them)."""
    out = tmp_path / "out"
    settings = dict(tasks=["niah_single_1"], length=400, seed=42, stop="eos", n_sink=16, n_local=128,
                    model=str(tiny_dir), calib_seed=1, dtype="float32")
    run_folder(out, LINES[0], settings=settings)
    monkeypatch.setattr(sweep, "sweep", lambda *args: 0)
    assert sweep.main(["--out", str(out), "--model", str(tiny_dir)] + RUN) == 0
    assert json.loads((out / "run.json").read_text())["settings"]["tasks"] == ["niah_single_1", "fwe"]


def test_a_grid_of_qada_rw_reaches_the_context_free_runs(tmp_path, tiny_dir, no_model, monkeypatch):
    """--grid qada_rw=... with qada_rw run only on the context-free samples is their grid, not a grid that no
    configuration takes: the run goes on (up to the model's loading here)."""
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    argv = ["--out", str(tmp_path / "out"), "--model", str(tiny_dir)] + RUN + ["--ctxfree-samples", "1", "--grid",
                                                                              "qada_rw=0.9"]
    with pytest.raises(AssertionError, match="a model was loaded"):
        sweep.main(argv)


def test_a_killed_sweep_leaves_its_command_in_run_json(tmp_path, tiny_dir, monkeypatch):
    """A sweep killed while it decodes (no exception to catch: the end of a session, kill -9) has already written
    its command to run.json, without "finished"; the same command, run again, completes its own entry."""
    out = tmp_path / "out"
    argv = ["--out", str(out), "--model", str(tiny_dir)] + RUN

    def killed(net, tok, folder, *args):
        runs = json.loads((folder / "run.json").read_text())["runs"]
        assert (len(runs) == 1 and "finished" not in runs[0]
                and runs[0]["command"] == shlex.join(["python", "-m", "lab.sweep"] + argv))
        raise SystemExit(9)
    with monkeypatch.context() as m:
        m.setattr(sweep, "sweep", killed)
        with pytest.raises(SystemExit):
            sweep.main(argv)
    assert sweep.main(argv) == 0
    runs = json.loads((out / "run.json").read_text())["runs"]
    assert len(runs) == 2 and "finished" not in runs[0] and runs[1]["lines_written"] == 4 and runs[1]["finished"]


def test_a_resume_reads_the_static_labels_it_started_with(tmp_path, tiny_dir, no_model, capsys):
    """A run that read --static-labels FILE, resumed without the flag, would read the folder's own labels: refused.
    Resumed with methods that read no static labels, it goes on (up to the model's loading here)."""
    other_labels(tmp_path)
    out = tmp_path / "out"
    settings = dict(tasks=["fwe"], length=400, seed=42, stop="eos", n_sink=16, n_local=128, model=str(tiny_dir),
                    calib_seed=1, dtype="float32", static_labels=str(tmp_path / "ruler.json"))
    run_folder(out, LINES[0], settings=settings)
    argv = ["--out", str(out), "--model", str(tiny_dir)] + RUN
    one_line(capsys, sweep.main(argv + ["--methods", "dense,static"]),
             f"holds a run with other settings {{'static_labels': ('{tmp_path / 'ruler.json'}', None)}}")
    with pytest.raises(AssertionError, match="a model was loaded"):
        sweep.main(argv)


def test_a_sweep_resumes_under_another_spelling_of_its_model_and_refuses_another_model(tmp_path, tiny_dir, no_model,
                                                                                        capsys, monkeypatch):
    """run.json's model is compared by the model it names (weights.checkpoints.model_key), not by its text: a sweep
    started with --model /abs/DIR resumes with --model ./DIR/ (up to the model's loading); a copy of the folder
    elsewhere is another model, refused; a named model and its converted folder are one."""
    out = tmp_path / "out"
    settings = dict(tasks=["fwe"], length=400, seed=42, stop="eos", n_sink=16, n_local=128, model=str(tiny_dir),
                    calib_seed=1, dtype="float32")
    run_folder(out, LINES[0], settings=settings)
    monkeypatch.chdir(tiny_dir.parent)
    with pytest.raises(AssertionError, match="a model was loaded"):
        sweep.main(["--out", str(out), "--model", f"./{tiny_dir.name}/"] + RUN)
    other = tmp_path / "copy"
    shutil.copytree(tiny_dir, other)
    one_line(capsys, sweep.main(["--out", str(out), "--model", str(other)] + RUN),
             f"holds a run with other settings {{'model': ('{tiny_dir}', '{other}')}}")
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "models" / "smollm2-135m").mkdir(parents=True)
    assert not records.differs("model", "smollm2-135m", str(tmp_path / "cache" / "models" / "smollm2-135m"))
    assert records.differs("model", "smollm2-135m", str(other)) and records.differs("model", "owner/m", str(other))


def test_a_resumed_sweep_refuses_a_correction_refitted_under_the_same_name(tmp_path, tiny_dir, no_model, capsys):
    """lab.calibrate --force rewrites a folder's affine.json in place: a sweep resumed on that folder would decode the
    next samples with the new correction beside records of the old. run.json keeps each file's sha1, and a resume
    reading other bytes is refused; a run.json from before the digest was kept resumes (up to the model's loading)."""
    cal = tmp_path / "cal"
    cal.mkdir()
    save_calibration(cal / "affine.json", Calibration(torch.zeros(2, 4), torch.ones(2, 4), None,
                                                      {"kind": "affine", "moments_source": "random-words"}))
    out = tmp_path / "out"
    settings = dict(tasks=["fwe"], length=400, seed=42, stop="eos", n_sink=16, n_local=128, model=str(tiny_dir),
                    calib_seed=1, dtype="float32", calibration=str(cal))
    run_folder(out, LINES[0], settings=dict(settings, calibration_sha1={"affine": "0" * 40}))
    argv = ["--out", str(out), "--model", str(tiny_dir), "--calibration", str(cal)] + RUN + ["--methods",
                                                                                            "dense,qada_cal"]
    err = one_line(capsys, sweep.main(argv), "holds a run with other settings {'calibration_sha1': ({'affine': '000")
    assert hashlib.sha1((cal / "affine.json").read_bytes()).hexdigest() in err
    older = tmp_path / "older"
    run_folder(older, LINES[0], settings=settings)
    with pytest.raises(AssertionError, match="a model was loaded"):
        sweep.main([older.as_posix() if a == str(out) else a for a in argv])


def test_a_resumed_sweep_refuses_a_static_labels_file_rewritten_in_place(tmp_path, tiny_dir, no_model, capsys):
    """--static-labels FILE replaced by other labels under the same name (another lab.calibrate run, a copy): a resumed
    sweep would rank heads by the new labels beside records of the old. run.json keeps the file's sha1, and a resume
    reading other bytes is refused; a run.json from before the digest was kept resumes (up to the model's loading)."""
    other_labels(tmp_path)
    labels = tmp_path / "ruler.json"
    out = tmp_path / "out"
    settings = dict(tasks=["fwe"], length=400, seed=42, stop="eos", n_sink=16, n_local=128, model=str(tiny_dir),
                    calib_seed=1, dtype="float32", static_labels=str(labels))
    run_folder(out, LINES[0], settings=dict(settings, static_labels_sha1="0" * 40))
    argv = ["--out", str(out), "--model", str(tiny_dir), "--static-labels", str(labels)] + RUN + [
        "--methods", "dense,static", "--sparsities", "0.5"]
    err = one_line(capsys, sweep.main(argv), "holds a run with other settings {'static_labels_sha1': ('000")
    assert hashlib.sha1(labels.read_bytes()).hexdigest() in err
    older = tmp_path / "older"
    run_folder(older, LINES[0], settings=settings)
    with pytest.raises(AssertionError, match="a model was loaded"):
        sweep.main([older.as_posix() if a == str(out) else a for a in argv])


@pytest.mark.parametrize("cli", ["sweep", "calibrate"])
def test_ctrl_c_is_one_line_and_exit_130(tmp_path, tiny_dir, capsys, monkeypatch, cli):
    """A sweep or a calibration stopped with Ctrl-C says that what it wrote is kept, and no traceback."""
    def stopped(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(*((sweep, "run") if cli == "sweep" else (calibrate, "ensure")), stopped)
    argv = (["--out", str(tmp_path / "out"), "--model", str(tiny_dir)] + RUN if cli == "sweep" else
            ["--model", str(tiny_dir), "--device", "cpu", "--tasks", "fwe", "--length", "400", "--out", str(tmp_path)])
    try:
        rc = (sweep if cli == "sweep" else calibrate).main(argv)
    except KeyboardInterrupt:  # caught here, or it would stop the whole test session
        pytest.fail("Ctrl-C went through main() as a traceback")
    assert rc == 130
    assert capsys.readouterr().err.splitlines()[-1] == ("interrupted: what was written is kept; the same command "
                                                        "resumes from it")


def test_a_sweep_that_cannot_start_leaves_no_settings_behind(tmp_path, tiny_dir, capsys):
    """A length too short for a task's smallest prompt is found once the tokenizer has loaded, before run.json is
    written: the same folder then takes a run of another length."""
    out = tmp_path / "out"
    argv = ["--out", str(out), "--model", str(tiny_dir)] + RUN
    one_line(capsys, sweep.main(argv + ["--length", "100"]), "a length of 100 tokens is too short for fwe")
    assert not (out / "run.json").exists()


@pytest.mark.parametrize("argv, message", [(["--lengths", "100"], "exceed the window"),
                                           (["--e2e", "8y3"], "BATCHxLAYERS"),
                                           (["--steps", "0"], "argument --steps"), (["--batches", "0"], "--batches"),
                                           (["--parts", "kernels", "--device", "cpu"],
                                            "kernels part needs a GPU: no CUDA"),
                                           (["--e2e", "8x0"], "BATCHxLAYERS"), (["--e2e", "8x32x2"], "BATCHxLAYERS"),
                                           (["--parts", "e2e", "--device", "cpu"],
                                            "end-to-end part needs a GPU: no CUDA"),
                                           (["--e2e-length", "4096", "--capacity", "4143"],  # 4096 + 4 * 10 steps + 8
                                            "--capacity 4143 holds fewer positions than --e2e-length 4096 and the "
                                            "steps timed after it take (4144)"),
                                           (["--parts", "e2e", "--device", "cpu", "--e2e-length", "4096", "--capacity",
                                             "4144"], "end-to-end part needs a GPU")])  # just enough: past that check
def test_bench_gpu_arguments_are_one_line_and_exit_2(capsys, argv, message):
    bench_gpu = pytest.importorskip("lab.bench_gpu")
    one_line(capsys, bench_gpu.main(argv), message)


def test_what_the_gpu_benchmarks_lack_here_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """No triton, or a CPU run without Triton's interpreter (the kernels are defined for a GPU): each said in one line
    before any folder is made, by both GPU benchmarks."""
    bench_gpu = pytest.importorskip("lab.bench_gpu")
    bench_pages_gpu = pytest.importorskip("lab.bench_pages_gpu")
    out = ["--out", str(tmp_path / "out")]
    attention_on_cpu = ["--parts", "attention", "--device", "cpu"] + out
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    one_line(capsys, bench_gpu.main(attention_on_cpu), "runs on the CPU only under TRITON_INTERPRET=1")
    monkeypatch.setattr(decode_kernels, "INTERPRETED", False)
    one_line(capsys, bench_pages_gpu.main(["--interpret-smoke"] + out), "set TRITON_INTERPRET=1")
    monkeypatch.setattr(decode_kernels, "triton", None)
    one_line(capsys, bench_gpu.main(attention_on_cpu), "the fused kernel needs triton")
    one_line(capsys, bench_pages_gpu.main(["--interpret-smoke"] + out), "no triton")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [(["--lengths", "100"], "each length must exceed the window (128)"),
                                           (["--reps", "0"], "argument --reps: must be at least 1"),
                                           (["--out", "{a_file}"], "is a file; give a folder"),
                                           (["--quick", "--lengths", "4096"], "--quick sets --lengths itself"),
                                           (["--interpret-smoke", "--reps", "3", "--budgets", "64"],
                                            "--interpret-smoke sets --budgets, --reps itself"),
                                           (["--quick", "--interpret-smoke"], "each set the sizes: give one"),
                                           (["--fraction", "1.5"], "--fraction takes a share in [0, 1], got 1.5"),
                                           (["--launch", '{{"window": {{"LOW": 0}}}}'],  # argv is formatted
                                            "argument --launch: the window launch's LOW takes a bool, got 0")])
def test_bench_pages_gpu_arguments_are_one_line_and_exit_2_before_any_timing(tmp_path, capsys, argv, message):
    """--out a file was a FileExistsError once every row was timed; --reps 0 a median of nothing; a preset's sizes
    replaced the ones given silently."""
    bench_pages_gpu = pytest.importorskip("lab.bench_pages_gpu")
    (tmp_path / "a_file").write_text("x")
    one_line(capsys, bench_pages_gpu.main([a.format(a_file=tmp_path / "a_file") for a in argv]), message)


def test_an_out_that_cannot_be_made_is_one_line_before_any_timing(tmp_path, tiny_dir, no_model, capsys, monkeypatch):
    """--out under a file (or on a read-only mount) was a traceback from mkdir, after the timings in lab.bench_gpu and
    lab.bench_pages_gpu (and after the compiles in lab.kernel_resources; lab.bench's --prefill-cache after a prefill):
    one line now, and nothing timed."""
    bench_gpu = pytest.importorskip("lab.bench_gpu")
    bench_pages_gpu = pytest.importorskip("lab.bench_pages_gpu")

    def timed(*a, **k):
        raise AssertionError("timed before the folder was made")
    monkeypatch.setattr(bench_gpu, "bench_attention", timed)
    monkeypatch.setattr(bench_pages_gpu, "self_check", timed)
    (tmp_path / "a_file").write_text("x")
    out = ["--out", str(tmp_path / "a_file" / "sub")]
    one_line(capsys, bench.main(["--device", "cpu", "--parts", "attention", "--lengths", "300"] + out),
             "cannot make the folder")
    one_line(capsys, bench_gpu.main(["--parts", "attention", "--lengths", "300", "--batches", "1", "--quick"] + out),
             "cannot make the folder")
    smoke = [] if torch.cuda.is_available() else ["--interpret-smoke"]  # its CPU run is the interpreter's
    one_line(capsys, bench_pages_gpu.main(smoke + out), "cannot make the folder")
    kernel_resources = pytest.importorskip("lab.kernel_resources")
    monkeypatch.setattr(kernel_resources, "table", timed)  # the compiles come after the folder
    one_line(capsys, kernel_resources.main(out), "cannot make the folder")
    # lab.bench's prefill cache: said before the minutes of prefill, not from torch.save after them
    monkeypatch.setattr(bench, "bench_end_to_end", timed)
    one_line(capsys, bench.main(["--device", "cpu", "--parts", "e2e", "--model", str(tiny_dir),
                                 "--prefill-cache", str(tmp_path / "a_file" / "prefills")]),
             f"--prefill-cache {tmp_path / 'a_file' / 'prefills'}: cannot make the folder")


@pytest.mark.parametrize("argv, message", [(["--samples", "0"], "argument --samples: must be at least 1"),
                                           (["--threads", "0"], "argument --threads: must be at least 1"),
                                           (["--threads", "100000"], "argument --threads: must lie in [1, "),
                                           (["--length", "-5"], "argument --length: must be at least 1"),
                                           (["--dense-samples", "-1"], "argument --dense-samples: must be at least 0"),
                                           (["--tasks", "nope"], "unknown task 'nope'")])
def test_peers_arguments_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    """Checked before kvpress is imported: the main suite's environment, which lacks it, can run these."""
    peers = pytest.importorskip("lab.peers")
    base = {"--out": str(tmp_path / "out"), "--tasks": "fwe"}
    base.update(dict(zip(argv[::2], argv[1::2])))
    one_line(capsys, peers.main([x for kv in base.items() for x in kv]), message)
    assert not (tmp_path / "out").exists()


def test_the_argument_types_take_their_bounds_and_refuse_past_them(tmp_path, monkeypatch, capsys):
    """Each checked type at its bounds (taken) and just past them (refused): --threads up to this machine's CPUs, a
    positive float neither 0 nor infinite, a sparsity grid in [0, 1] both ends included, taus in (0, 1] with 1, integer
    lists of at least 1 with a trailing comma let through but not an empty list. An error of several lines is said in
    one; default folders made in the same second get names of their own."""
    Bad = argparse.ArgumentTypeError
    cpus = os.cpu_count() or 1
    assert cli.thread_count(str(cpus)) == cpus and cli.at_least(2)("2") == 2
    assert cli.positive_float("1e-9") == 1e-9 and cli.ints("2048,") == "2048," and cli.ints("1") == "1"
    assert cli.fractions("0,1") == "0,1" and cli.taus("1") == "1" and cli.fractions("") == ""
    for parse, text in ((cli.thread_count, str(cpus + 1)), (cli.at_least(2), "1"), (cli.at_least(2), "x"),
                        (cli.positive_float, "0"), (cli.positive_float, "inf"), (cli.ints, ""), (cli.ints, "0"),
                        (cli.fractions, "1.01"), (cli.fractions, "-0.01"), (cli.taus, "0"), (cli.taus, "1.01")):
        with pytest.raises(Bad):
            parse(text)
    assert cli.fail(ValueError("a\n  b")) == 2 and capsys.readouterr().err == "error: a b\n"
    monkeypatch.setattr(cli.time, "strftime", lambda fmt: "20260101-000000")  # three runs in the same second
    names = []
    for _ in range(3):
        names.append(cli.fresh_folder(str(tmp_path)))
        names[-1].mkdir()
    assert [p.name for p in names] == ["20260101-000000", "20260101-000000-2", "20260101-000000-3"]


def test_kernel_resources_refuses_an_arch_triton_has_no_backend_for(capsys):
    """--arch 0 compiled on to an LLVM error about an intrinsic; Triton's NVIDIA backend starts at sm_80."""
    kernel_resources = pytest.importorskip("lab.kernel_resources")
    one_line(capsys, kernel_resources.main(["--arch", "0"]), "argument --arch: must be at least 80, got 0")
    one_line(capsys, kernel_resources.main(["--arch", "75"]), "argument --arch: must be at least 80, got 75")


def test_kernel_resources_says_a_launch_that_does_not_compile_in_one_line(monkeypatch, capsys):
    """A launch the GPU compiler refuses: the compiler's last line, not a traceback from reading a cubin never made."""
    kernel_resources = pytest.importorskip("lab.kernel_resources")
    monkeypatch.setattr(kernel_resources, "nvidia_backend", lambda: Path("/no/nvidia/tools"))
    monkeypatch.setattr(kernel_resources, "compile_launches", lambda launches, arch, out: (1, "ptxas\nout of memory\n"))
    one_line(capsys, kernel_resources.main([]), "the default launch did not compile: out of memory")


def test_kernel_resources_leaves_another_triton_s_table_alone(tmp_path, monkeypatch, capsys):
    """--out holding another Triton's kernel_resources.md (results/bench-gpu's is Triton 3.6's; a newer Triton goes
    to results/bench-gpu/triton-X.Y) is refused before the compiles and the table kept; this Triton's own is
    rewritten."""
    kernel_resources = pytest.importorskip("lab.kernel_resources")
    import triton
    monkeypatch.setattr(kernel_resources, "table", lambda arch: ["| kernel |"])
    old = tmp_path / "kernel_resources.md"
    old.write_text("# table\n\ntriton 0.1.0; torch 2.0\n")
    one_line(capsys, kernel_resources.main(["--out", str(tmp_path)]), f"{old} is another Triton's table (this is "
             f"{triton.__version__}): give this Triton's own --out")
    assert old.read_text() == "# table\n\ntriton 0.1.0; torch 2.0\n"
    old.write_text(f"triton {triton.__version__}; torch 2.0\n")
    assert kernel_resources.main(["--out", str(tmp_path)]) == 0
    assert old.read_text().endswith("| kernel |\n")


@pytest.mark.parametrize("cli", ["sweep", "report", "calibrate", "bench", "bench_gpu", "bench_pages_gpu", "peers",
                                 "kernel_resources"])
def test_help_shows_each_default_once_and_no_flag_default(cli, capsys):
    module = pytest.importorskip(f"lab.{cli}")
    assert module.main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: True)" not in text and "(default: False)" not in text and "(default: None)" not in text
    assert "(default: [])" not in text  # an option given once per value (--with, --grid, --set) has none
    for option in text.split(" --")[1:]:  # each option's entry, roughly
        assert option.count("default") <= 1, option


def test_quick_keeps_the_grids_of_the_methods_it_runs(tmp_path, tiny_dir, no_model, capsys):
    """--quick's own grids (oracle, qada_prompt) go with its default methods: with --methods of others they are
    dropped, not refused as grids no configuration takes (the calibration's refusal comes next instead)."""
    rc = sweep.main(["--quick", "--methods", "dense,local", "--out", str(tmp_path / "out"), "--model", str(tiny_dir),
                     "--device", "cpu", "--calibration", str(tmp_path)])
    one_line(capsys, rc, "no method of --methods reads it")


def test_quick_sees_the_flags_given_not_their_values(tmp_path, tiny_dir, monkeypatch):
    """--quick applies its defaults where a flag was not given (one given keeps its value): a value that spells a
    flag's name (an --out folder called length) does not count as that flag, so the quick length still applies."""
    seen = {}
    monkeypatch.setattr(sweep, "run", lambda **kwargs: seen.update(kwargs))
    monkeypatch.chdir(tmp_path)
    assert sweep.main(["--quick", "--out", "length", "--model", str(tiny_dir), "--samples", "1"]) == 0
    assert seen["length"] == sweep.QUICK["length"] and seen["out"] == "length"
    assert seen["samples"] == 1 != sweep.QUICK["samples"]  # a flag given keeps its value


def test_an_unknown_method_lists_each_choice_once():
    with pytest.raises(ValueError) as e:
        sweep.path_and_source("nope")
    names = str(e.value).split("choose from ")[1].split(", ")
    assert len(names) == len(set(names)) and {"qada_cal", "static", "static_oracle"} <= set(names)


def test_compare_and_the_dense_table_keep_to_the_tasks_asked(tmp_path):
    """lab.report --compare and --dense-table with --tasks: the other tasks' records count nowhere, and a task of
    no record is one line."""
    body = b"".join(json.dumps(record(task=t, index=i, config=c, pred="x")).encode() + b"\n"
                    for t, n in (("fwe", 3), ("vt", 2)) for i in range(n) for c in ("dense", "local"))
    a = run_folder(tmp_path / "pilot" / "a", body, settings={"tasks": ["fwe", "vt"], "length": 512})
    b = run_folder(tmp_path / "b", body, settings={"tasks": ["fwe", "vt"], "length": 512})
    rows = {line.split(" | ")[0]: line.split(" | ")[1] for line in report.compare_runs(a, b, tasks=["vt"]).splitlines()
            if line.startswith("| dense") or line.startswith("| local")}
    assert rows == {"| dense": "2", "| local": "2"}  # vt's 2 samples, not fwe's 3 beside them
    assert " 5 " in report.compare_runs(a, b)
    table = report.dense_table(tmp_path / "pilot", tasks=["vt"], out=tmp_path / "vt")
    assert "| vt |" in table and "| fwe |" not in table and "--tasks vt" in table
    assert (tmp_path / "vt" / "dense.md").read_text() == table
    with pytest.raises(ValueError, match="--tasks niah_single_1: no dense record of it"):
        report.dense_table(tmp_path / "pilot", tasks=["niah_single_1"])


def test_the_commands_that_compare_and_the_dense_table_print_quote_a_path_with_spaces(tmp_path):
    """The command --compare and --dense-table write above their tables is one to copy and rerun: a folder whose name
    holds a space is quoted, not split into two arguments."""
    body = b"".join(json.dumps(record(index=i, config="dense", pred="x")).encode() + b"\n" for i in range(2))
    a = run_folder(tmp_path / "my runs" / "run a", body, settings={"tasks": ["fwe"], "length": 512})
    b = run_folder(tmp_path / "run b", body, settings={"tasks": ["fwe"], "length": 512})
    assert f"`python -m lab.report '{a}' --compare '{b}'`" in report.compare_runs(a, b)
    assert f"`python -m lab.report --dense-table '{tmp_path / 'my runs'}'`" in report.dense_table(tmp_path / "my runs")


def test_compare_by_hand(tmp_path):
    """lab.report --compare on two folders of the same three prompts (one bf16 against fp32, say): per configuration
    the answers alike (the text, not the score), the scores alike, the mean absolute change of sparsity (samples
    without one aside) and of each head's local frequency; a pair of records of the same prompt length whose prompt
    ids differ is refused."""
    def recs(preds, scores, sparsities, freqs):
        return b"".join(json.dumps(dict(record(index=i), pred=p, score=s, sparsity=sp, local_freq=f, n_prompt=300,
                                        ids_sha1="abc")).encode() + b"\n"
                        for i, (p, s, sp, f) in enumerate(zip(preds, scores, sparsities, freqs)))
    a = run_folder(tmp_path / "a", recs(["x", "y", "z"], [1.0, 0.0, 1.0], [0.5, 0.2, None],
                                         [[0.5, 0.5], [1.0, 0.0], None]))
    theirs = recs(["x", "y2", "z2"], [1.0, 0.0, 0.0], [0.75, 0.1, 0.3], [[0.5, 1.0], [0.0, 0.0], [1.0, 1.0]])
    b = run_folder(tmp_path / "b", theirs)
    row = next(line for line in report.compare_runs(a, b).splitlines() if line.startswith("| dense |"))
    # answers: x alike, y and z not (y scores 0 in both); sparsity |0.25| and |0.1|, the third has none in a;
    # frequencies: mean |0, 0.5| = 0.25 and mean |1, 0| = 0.5, the third has none in a
    # mean scores 2/3 and 1/3; sparsity 0.35 (the third has none in a) and 0.383
    assert row == "| dense | 3 | 1/3 | 2/3 | 0.667 | 0.333 | 0.350 | 0.383 | 0.1750 | 0.3750 |"
    other = run_folder(tmp_path / "other", theirs.replace(b'"abc"', b'"abd"', 1))  # sample 0's ids
    with pytest.raises(ValueError, match="did not decode the same prompts: fwe#0 .* and other ids"):
        report.compare_runs(a, other)


def test_the_dense_table_by_hand(tmp_path):
    """--dense-table: runs sorted by model, then length; tasks in lab.tasks' order (vt before fwe); a cell the mean
    score x100 and its samples, dense records alone and without a score aside; the mean over tasks; the seconds per
    sample the median over records of prefill + decode seconds, a record decoded in a batch counting the batch's whole
    decoding time (its decode_s, its share, times the batch); the dtypes of the runs, float32 where none is named."""
    def body(*recs):
        return b"".join(json.dumps(dict(record(task=t, index=i, config=c), score=sc, prefill_s=p, decode_s=d,
                                        batch=n)).encode() + b"\n" for t, i, c, sc, p, d, n in recs)
    fwe = body(("fwe", 0, "dense", 1.0, 1.0, 2.0, 1), ("fwe", 1, "dense", 1.0, 1.0, 1.0, 4),
               ("fwe", 2, "dense", 0.0, 1.0, 10.0, 1), ("fwe", 3, "dense", None, 1.0, 9.0, 1),
               ("fwe", 0, "local", 0.0, 1.0, 99.0, 1))
    run_folder(tmp_path / "pilot" / "z", fwe, settings={"tasks": ["fwe"], "model": "b-model", "length": 1024})
    vt = body(("vt", 0, "dense", 1.0, 2.0, 2.0, 1), ("vt", 1, "dense", 0.0, 2.0, 2.0, 1))
    run_folder(tmp_path / "pilot" / "a", vt, settings={"tasks": ["vt"], "model": "a-model", "length": 4096,
                                                       "dtype": "bfloat16"})
    lines = report.dense_table(tmp_path / "pilot").splitlines()
    assert lines[2] == (f"`python -m lab.report --dense-table {tmp_path / 'pilot'}`; dtype bfloat16, float32. "
                        "s/sample = median of prefill + decode seconds, a batch's decoding whole for each of its "
                        "samples (the wall-clock a sample waits).")
    # fwe: scores 1, 1 and 0 (the one without a score aside); seconds 1 + 2, 1 + 1 x 4, 1 + 10: median 5, mean 6
    assert lines[4:] == ["| task | a-model 4k | b-model 1k |", "|---|---|---|", "| vt | 50 (2) | – |",
                         "| fwe | – | 67 (3) |", "| **mean over tasks** | **50** | **67** |", "| s/sample | 4 | 5 |"]
    three = body(*[(t, 0, "dense", float(t == "fwe"), 1.0, 1.0, 1) for t in ("fwe", "vt", "cwe")])
    run_folder(tmp_path / "three" / "a", three, settings={"tasks": ["fwe", "vt", "cwe"], "length": 512})
    assert "| **mean over tasks** | **33** |" in report.dense_table(tmp_path / "three")  # the mean, not the median 0


def test_the_dense_table_of_some_tasks_goes_to_another_folder(tmp_path, capsys):
    """RUN/dense.md covers every task of the runs under RUN: --dense-table --tasks SUBSET without --out (or with RUN
    as --out) is refused in one line, the committed table untouched; --tasks naming every task writes it."""
    body = b"".join(json.dumps(record(task=t, index=i)).encode() + b"\n" for t in ("fwe", "vt") for i in range(2))
    run_folder(tmp_path / "pilot" / "a", body, settings={"tasks": ["fwe", "vt"], "length": 512})
    whole = report.dense_table(tmp_path / "pilot")
    for out in ([], ["--out", str(tmp_path / "pilot")]):
        one_line(capsys, report.main([str(tmp_path / "pilot"), "--dense-table", "--tasks", "vt"] + out),
                 "--tasks vt leaves out fwe", "give --out DIR")
        assert (tmp_path / "pilot" / "dense.md").read_text() == whole
    assert report.main([str(tmp_path / "pilot"), "--dense-table", "--tasks", "vt", "--out", str(tmp_path / "vt")]) == 0
    assert "| fwe |" not in (tmp_path / "vt" / "dense.md").read_text()
    assert report.main([str(tmp_path / "pilot"), "--dense-table", "--tasks", "vt,fwe"]) == 0
    assert "| fwe |" in (tmp_path / "pilot" / "dense.md").read_text()


def test_the_dense_table_names_each_run_apart(tmp_path):
    """lab.report --dense-table: a length that is no multiple of 1024 in tokens (not 512 as "0k"), and runs of one
    model and length told apart by their folders."""
    body = b"".join(LINES)
    for folder, length in (("a", 512), ("b", 2048), ("c", 2048)):
        run_folder(tmp_path / folder, body, settings={"tasks": ["fwe"], "model": "m", "length": length})
    head = report.dense_table(tmp_path).splitlines()[4]
    assert head == "| task | m 512 | m 2k (b) | m 2k (c) |", head


def test_the_dense_tables_mean_is_over_tasks_and_a_folder_without_run_json_has_no_ctxfree_column(tmp_path):
    """--dense-table's mean over tasks is the mean of the task means (fwe's 3 samples at 1 and vt's 1 at 0: 50, not a
    pooled 75); a folder of records without run.json takes its tasks from them, the context-free runs aside."""
    body = b"".join(json.dumps(dict(record(task=t, index=i), score=s)).encode() + b"\n"
                    for t, n, s in (("fwe", 3, 1.0), ("vt", 1, 0.0)) for i in range(n))
    run_folder(tmp_path / "pilot" / "a", body, settings={"tasks": ["fwe", "vt"], "length": 512, "model": "m"})
    assert "| **mean over tasks** | **50** |" in report.dense_table(tmp_path / "pilot")
    out = tmp_path / "bare"
    out.mkdir()
    lines = [record(task="fwe", index=i, config=c) for i in range(2) for c in ("dense", "local")]
    lines += [dict(record(task="ctxfree", index=0, config="dense"), score=None)]
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert report.main([str(out)]) == 0
    header = next(line for line in (out / "summary.md").read_text().splitlines() if line.startswith("| config |"))
    assert "fwe" in header and "ctxfree" not in header
