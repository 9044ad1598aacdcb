"""lab.sweep under torchrun: 2 CPU processes (gloo) on the tiny model give, once rank 0 has merged their files, the
same records in the same order as one process (timings aside), with run.json written once and no rank file left;
a restart decodes only what no file holds yet. About 40 s on 2 busy cores: six subprocesses of a few seconds each."""

import lzma
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab import records, sweep
from tests.test_generate import make_tiny_dir

ROOT = Path(__file__).resolve().parent.parent
TIMING = ("decode_s", "prefill_s")
# static_oracle in the grid: whole tasks per rank (fwe, niah_single_2 | niah_single_1), 3 configurations each. At
# length 300 the tiny model's own-task oracle frequencies for niah_single_1 (sample 1 reads sample 0's) and its
# calibration frequencies give different labels; round-robin would decode niah_single_1#0 on rank 1 and #1 on
# rank 0, which reads the records on disk before rank 1 has written any.
BY_TASK = ["--tasks", "fwe,niah_single_1,niah_single_2", "--length", "300", "--samples", "2",
           "--methods", "dense,oracle,static_oracle", "--taus", "0.6", "--sparsities", "0.5", "--ctxfree-samples", "0"]
BY_TASK_LINES = [12, 6]
# no own-task labels: the jobs go round-robin, fwe#0, fwe#1 | ctxfree#0, fwe#2 (5 + 5 | 2 + 5 configurations),
# so the merged order interleaves the two rank files
ROUND_ROBIN = ["--tasks", "fwe", "--length", "400", "--samples", "3", "--methods", "dense,local,random,oracle,qada_rw",
               "--taus", "0.6", "--sparsities", "0.5", "--ctxfree-samples", "1"]
ROUND_ROBIN_LINES = [10, 7]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_dir(tmp_path_factory.mktemp("tiny_dist"))


def eval_py(out: Path, args: list[str], tiny_dir: Path, cache: Path, ranks: int = 0, report_at_end: bool = False):
    """lab.sweep in a subprocess of one thread: alone (ranks 0) or under torchrun with `ranks` CPU processes."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", QADA_CACHE=str(cache))
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks else []
    cmd = [sys.executable, *launcher, "-m", "lab.sweep", "--out", str(out), *args, "--model", str(tiny_dir),
           "--ablations", "", "--device", "cpu"] + ([] if report_at_end else ["--no-report"])  # tracks qada_rw if run
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def lines(out: Path) -> list[dict]:
    """The records of a finished run: one compressed file."""
    assert records.result_files(out) == [out / "samples.jsonl.xz"]
    return [json.loads(line) for line in lzma.decompress((out / "samples.jsonl.xz").read_bytes()).decode().splitlines()]


def untimed(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def keys(records: list[dict]) -> list[tuple]:
    return [(r["task"], r["index"], r["config"]) for r in records]


def assert_one_run(out: Path, lines_per_rank: list[int]):
    """The files one process leaves: samples.jsonl.xz alone and run.json with one run, written by rank 0; and
    the lines each rank wrote in that run."""
    assert records.result_files(out) == [out / "samples.jsonl.xz"]  # the rank files are merged and gone
    runs = json.loads((out / "run.json").read_text())["runs"]
    assert len(runs) == 1 and runs[0]["ranks"] == 2
    assert runs[0]["lines_per_rank"] == lines_per_rank and runs[0]["lines_written"] == sum(lines_per_rank)


@pytest.mark.parametrize("by_task", [True, False], ids=["by-task", "round-robin"])
def test_two_ranks_write_what_one_process_writes(tiny_dir, tmp_path, by_task):
    args = BY_TASK if by_task else ROUND_ROBIN
    alone = eval_py(tmp_path / "alone", args, tiny_dir, tmp_path / "cache_alone")
    # their own cache: both ranks compute (and save) the reference keys of qada_rw at once
    eval_py(tmp_path / "ranks", args, tiny_dir, tmp_path / "cache_ranks", ranks=2, report_at_end=by_task)
    one, two = lines(tmp_path / "alone"), lines(tmp_path / "ranks")
    assert keys(two) == keys(one)  # the same (task, index, config), in the same order
    assert untimed(two) == untimed(one)
    assert_one_run(tmp_path / "ranks", BY_TASK_LINES if by_task else ROUND_ROBIN_LINES)
    assert "runs written" in alone.stdout
    assert len({r["pred"] for r in one}) > 1 and len(one) == len(set(keys(one)))  # the records are not all alike
    if by_task:  # the labels that need the split: sample 1's static oracle read sample 0's oracle record
        labels = {r["index"]: r["local_freq"] for r in one
                  if (r["task"], r["method"]) == ("niah_single_1", "static_oracle")}
        assert labels[0] != labels[1]
        assert (tmp_path / "ranks" / "summary.md").is_file()  # the report, from rank 0
    else:
        assert [r["task"] for r in one].index(sweep.CTXFREE) == 5  # after fwe#0
        assert len(list((tmp_path / "cache_ranks" / "moments").glob("*.pt"))) == 1  # no temporary file left


def test_a_restart_decodes_only_what_is_missing(tiny_dir, tmp_path):
    """A previous run left fwe#0 merged and ctxfree#0 in rank 1's file (rank 1 was then killed while writing
    its next batch, a torn line): the restart decodes the rest, keeps those lines as they were and merges all."""
    eval_py(tmp_path / "alone", ROUND_ROBIN, tiny_dir, tmp_path / "cache")
    one = lines(tmp_path / "alone")
    out = tmp_path / "ranks"
    out.mkdir()
    merged = [r for r in one if (r["task"], r["index"]) == ("fwe", 0)]
    kept = [dict(r, decode_s=-1.0) for r in one if r["task"] == sweep.CTXFREE]  # marked
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in merged))
    (out / "samples.1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"task": "fwe", "ind')
    eval_py(out, ROUND_ROBIN, tiny_dir, tmp_path / "cache", ranks=2)
    two = lines(out)
    assert keys(two) == keys(one) and untimed(two) == untimed(one)
    assert two[:len(merged)] == merged and [r for r in two if r["task"] == sweep.CTXFREE] == kept  # not decoded again
    assert_one_run(out, [5, 5])  # fwe#1 | fwe#2: only the missing records


def test_the_split_covers_every_job_once():
    """--shard and torchrun share one rule: whole tasks (the context-free samples one more task), or round-robin."""
    cfgs = [sweep.Config("dense")]
    jobs = sweep.plan(["a", "b", "c"], 2, cfgs, [], 0, cfgs, 1)
    by_task = [sweep.split(jobs, ["a", "b", "c"], k, 2, True) for k in range(2)]
    assert [{t for t, _, _ in share} for share in by_task] == [{"a", "c"}, {"b", sweep.CTXFREE}]
    robin = [sweep.split(jobs, ["a", "b", "c"], k, 2, False) for k in range(2)]
    assert [len(share) for share in robin] == [4, 3] and robin[0][1] == jobs[2]
    for shares in (by_task, robin):
        assert sorted(j[:2] for share in shares for j in share) == sorted(j[:2] for j in jobs)


def test_merge_orders_as_one_process_and_keeps_each_record_once(tmp_path):
    """Rank files in the wrong order, a record both merged and in a rank file, a torn line and a record of an
    earlier run: one line per record, the earlier run's first, then plan order."""
    jobs = sweep.plan(["a", "b"], 2, [sweep.Config("dense"), sweep.Config("local")], [], 0, [], 0)

    def write(name, records, tail=""):
        (tmp_path / name).write_text("".join(json.dumps(dict(task=t, index=i, config=c)) + "\n" for t, i, c in records)
                                     + tail)
    write("samples.jsonl", [("old", 0, "dense"), ("a", 0, "dense")])
    write("samples.0.jsonl", [("a", i, c) for i in (1, 0) for c in ("local", "dense")])
    write("samples.1.jsonl", [("b", i, c) for i in (1, 0) for c in ("local", "dense")], '{"task": "b", "ind')
    sweep.merge(tmp_path, jobs)
    assert keys(lines(tmp_path)) == [("old", 0, "dense")] + [(t, i, c.key) for t, i, cs in jobs for c in cs]


@pytest.mark.parametrize("device, message", [("tpu", "--device takes cpu, cuda or cuda:N"),
                                             ("cuda:x", "--device takes"), ("cuda:0", "no CUDA")])
def test_a_bad_device_is_one_line(tmp_path, capsys, device, message):
    if sweep.torch.cuda.is_available() and device == "cuda:0":
        pytest.skip("this machine has CUDA")
    assert sweep.main(["--out", str(tmp_path / "run"), "--device", device]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


RANK_ZERO_FAILS = """
import sys
from datetime import timedelta
import torch.distributed as dist
from lab import sweep
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2,
                        timeout=timedelta(seconds=30))
try:
    with sweep.rank_zero_first(rank, 2):
        if rank == 0:
            raise RuntimeError("rank 0 failed inside the block")
    print("through")
except RuntimeError as e:
    print(e)
"""


def test_rank_zero_failing_first_lets_the_other_ranks_through(tmp_path):
    """Rank 0 raising inside rank_zero_first still meets the barrier on its way out: rank 1 gets through and goes on
    to fail on its own error, instead of waiting in the barrier until rank 0's process is gone (a rank 0 that catches
    the error and lives on would hold it there for lab.sweep's whole timeout, a week)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", RANK_ZERO_FAILS, str(rank), str(tmp_path / "store")], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert outs == ["rank 0 failed inside the block", "through"]
