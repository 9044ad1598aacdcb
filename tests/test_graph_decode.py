"""The decode step that generate.py replays from CUDA graphs (generate.decode_static): the cache in static mode, the
attention's inputs in fixed device buffers (attention.StaticAttention). On the CPU the step runs eagerly (the fused
kernel under Triton's interpreter) and is held against the eager loop, generate.decode_batch: the same tokens,
labels, sparsity and KV read; and it reads no host value that changes from step to step, so that what a graph
captured once is what every step needs. On a GPU (QADA_TEST_DEVICE=cuda) the graphs themselves are held against the
eager loop."""

import contextlib
import json
import math
import shutil

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import generate
import decode_kernels
from attention import BatchAttention, StaticAttention, build_attention, static_refusal
from criterion import Calibration, save_calibration
from model import KVCache, Llama, load_model
from moments import FixedMoments
from pages import PageIndex
from tests.test_generate import make_tiny_dir, write_prompt
from tests.test_kernel_pages import KERNELS  # every kernel a step may launch

pytest.importorskip("triton")
N_SINK, N_LOCAL = 4, 16
# the fused kernel on CPU tensors needs Triton's interpreter (conftest sets it where there is no CUDA)
needs_kernel = pytest.mark.skipif(not (torch.cuda.is_available() or decode_kernels.INTERPRETED),
                                  reason="the fused kernel needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_dir(tmp_path_factory.mktemp("tiny_graph"))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir))


def calibration(device=None):
    """A correction that spreads the heads' estimated log ratios (the tiny random model's are all alike), so that
    each step labels some heads local and some not; the other way round in layer 1, so that each layer's own
    correction matters."""
    a = torch.linspace(-1.5, 1.5, 4, device=device).repeat(2, 1)  # (L, H)
    a[1] = a[1].flip(0)
    return Calibration(a, torch.ones(2, 4, device=device), torch.tensor([[0.8, 1.2], [1.1, 0.9]], device=device), {})


# The prompts of a batch: the longest ends 4 positions before the view boundary at 256, so decoding crosses it (two
# views, two graphs on a GPU); the 200-token row is stopped early.
LENGTHS = {1: (240,), 3: (240, 200, 252)}
N_NEW = 7


def tau(method, n):
    """A tau at which the row's heads part: the tiny random model's window shares are all near 16.2 / T, and fall
    as T grows, so qada's tau sits there; the correction spreads the calibrated paths' shares around 0.064."""
    return 16.2 / (n + 3.5) if method == "qada" else 0.064


# The page paths' budgets: two pages of 16 (one of 32) per group, per head for Quest, of a bulk of ~15 pages of 16,
# or a fraction of the context
BUDGETS = {"qada_pages_frac": dict(budget_frac=0.15)}


def prefilled(model, method, batch):
    """Each prompt prefilled alone, its attention built (Option 1 moments; a page path's page index), then stacked as
    generate.run_batch does: (cache, last logits, the rows' DecodeAttentions)."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 100, (1, n), generator=g).to(model.device) for n in LENGTHS[batch]]
    caches = [model.new_cache(p.shape[1] + N_NEW) for p in prompts]
    logits = torch.cat([model.prefill(p, c) for p, c in zip(prompts, caches)])
    inputs = dict(calibration=calibration(model.device)) if method != "dense" else {}
    inputs.update(BUDGETS.get(method, dict(budget=32)))  # what a path does not read, build_attention drops
    rows = [build_attention(method, c, n_sink=N_SINK, n_local=N_LOCAL, moments_source="prompt", **inputs,
                            **({} if method == "dense" else {"tau": tau(method, c.length)})) for c in caches]
    if batch > 1 and rows[1].moments is not None:  # a step that read row 0's moments or tau for every row would label
        # as each row's own: the tiny model's keys and queries are near 0, so its prompts' moments hardly move an
        # estimate, and the calibrated paths share one tau. The second row's variance and the third row's tau are set
        # far enough apart to turn some or all of those rows' heads long.
        m = rows[1].moments
        rows[1].inputs["moments"] = FixedMoments(m.mean, 5000 * m.cov, m.n_keys)
        rows[2].inputs["tau"] = 3 * rows[2].tau
    cache = caches[0] if batch == 1 else KVCache.stack(caches, N_NEW)
    return cache, logits, rows


def stop_early(model, method):
    """A stop rule that ends the second row of the batch after 3 tokens: the row whose first token (from its prefill)
    is the second row's, which no other row's is."""
    firsts = prefilled(model, method, 3)[1].argmax(-1).tolist()
    assert firsts.count(firsts[1]) == 1
    return lambda ids: len(ids) == 3 and ids[0] == firsts[1]


def eager_and_static(model, method, batch, capture=False, finest_static=False):
    """The eager loop (decode_batch: a DecodeAttention alone, a BatchAttention for a batch) and the static loop, from
    the same prefill: (tokens, rows, the logits of every step) of each. `finest_static`: the static loop's kernels cut
    the context into the smallest splits they take (one tile of positions or pages a program), the eager loop's as
    they choose."""
    finished = None if batch == 1 else stop_early(model, method)
    out = []
    for loop in ("eager", "static"):
        cache, logits, rows = prefilled(model, method, batch)
        seen, sample = [], generate.sample
        with pytest.MonkeyPatch.context() as patch:  # every step's logits, as the loop samples from them
            patch.setattr(generate, "sample", lambda logits, *a: seen.append(logits.clone()) or sample(logits, *a))
            if finest_static and loop == "static":
                patch.setattr(decode_kernels, "split_size", lambda n, T, device, block_n=64: block_n)
                patch.setattr(decode_kernels, "page_split", lambda n, U, tile_pages, device: tile_pages)
            if loop == "eager":
                attention = rows[0] if batch == 1 else BatchAttention(rows, start=cache.start.tolist())
                tokens = generate.decode_batch(model, cache, logits, N_NEW, attention, finished=finished)
            else:
                tokens = generate.decode_static(model, cache, logits, N_NEW, rows, finished=finished, capture=capture)
        out.append((tokens, rows, seen))
    return out


def assert_same(eager, static, method, batch, same_splits=True):
    """`same_splits`: both loops' kernels cut the context into the same splits, as they do at these sizes (the static
    loop picks its split from the view it reads, the eager loop from T, and a page split from the rows launched
    together; at long contexts or with many rows they can differ, and the merge then adds the same terms in another
    order)."""
    (tokens, rows, logits), (tokens_static, rows_static, logits_static) = eager, static
    assert tokens_static == tokens
    for b, row in enumerate(tokens):  # each row's logits while it decoded (an ended row's are discarded)
        got, want = (torch.stack([step[b] for step in x[:len(row)]]) for x in (logits_static, logits))
        if method == "dense" or not same_splits:  # the static loop's dense (decode_kernels.fused_dense where the
            # kernel runs, else SDPA over the view, masked past T) against SDPA over the filled part; or other splits
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4 if got.is_cuda else 1e-5)
        else:  # the same kernel reading the same T in the same splits: bit for bit
            assert torch.equal(got, want)
    for a, b in zip(rows, rows_static):
        assert b.stats.lengths == a.stats.lengths  # T of each step the row decoded, its padding left out
        assert torch.equal(b.stats.label_tensor(), a.stats.label_tensor())
        assert b.stats.summary(2) == a.stats.summary(2)  # sparsity, KV read, per-layer sparsity
    if batch > 1:
        assert [len(t) for t in tokens] == [N_NEW, 3, N_NEW]  # the second row ended early, the others did not
    labels = torch.cat([a.stats.label_tensor().flatten() for a in rows])
    assert not labels.any() if method == "dense" or method.startswith("quest") else 0 < labels.float().mean() < 1
    if method in PAGE_METHODS:  # the entries read, step by step, and fewer than dense reads
        for a, b in zip(rows, rows_static):
            assert a.stats.read_tensor() is not None and torch.equal(b.stats.read_tensor(), a.stats.read_tensor())
            assert b.stats.summary(2)["kv_read"] < 0.5


PAGE_METHODS = ("quest", "quest_p32", "qada_pages", "qada_pages_frac", "qada_pages_share")


@pytest.mark.parametrize("loop", ["eager", "static"])
def test_the_stop_rule_is_asked_about_each_token_once_it_is_read(tiny, loop, monkeypatch):
    """Each row's stop rule is called once per token but its last (which ends the row anyway), after the step that
    gave the token was sampled and read: lab.bench_gpu's step_ms times the loops' steps by these calls."""
    cache, logits, rows = prefilled(tiny, "qada_cal", 3)
    sampled, calls, sample = [], [], generate.sample
    monkeypatch.setattr(generate, "sample", lambda logits, *a: sampled.append(1) or sample(logits, *a))
    finished = lambda ids: calls.append((len(ids), len(sampled))) or False  # noqa: E731
    if loop == "eager":
        generate.decode_batch(tiny, cache, logits, N_NEW, BatchAttention(rows, start=cache.start.tolist()),
                              finished=finished)
    else:
        generate.decode_static(tiny, cache, logits, N_NEW, rows, finished=finished)
    assert calls == [(n, n) for n in range(1, N_NEW) for _ in range(3)]


def keep_static(monkeypatch) -> list:
    """The StaticAttention each decode_static makes, with its cache, (static, cache), kept to look at afterwards."""
    made, of = [], StaticAttention.of
    monkeypatch.setattr(StaticAttention, "of", classmethod(
        lambda cls, *a, **kw: made.append((of(*a, **kw), a[1])) or made[-1][0]))
    return made


def assert_pages_current(static, cache):
    """The static step's page statistics (StaticAttention.pages) after decoding: each row's, of every key its cache
    holds now, prompt and decoded tokens, as a page index built from scratch over the row's filled part has them."""
    start, P = static.start.tolist(), static.page["page_size"]
    for layer, (lo, hi) in enumerate(static.pages):
        for b in range(lo.shape[0]):
            want_lo, want_hi = PageIndex(None, P, N_SINK).bounds(0, cache.k[layer, b, :, start[b]:cache.length])
            n = want_lo.shape[1]
            assert torch.equal(lo[b, :, :n], want_lo) and torch.equal(hi[b, :, :n], want_hi)
            assert (lo[b, :, n:] == math.inf).all() and (hi[b, :, n:] == -math.inf).all()


# The paths whose step test_an_emulated_graph_decodes_as_the_eager_loop runs, as a graph records and replays it; the
# others' run eagerly in test_the_static_step_decodes_as_the_eager_loop. Each is the same step held to the same loop.
GRAPHED = ("dense", "qada_cal", "qada_pages", "quest")


@needs_kernel
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method", [m for m in ("qada", "qada_kv_cal", *PAGE_METHODS) if m not in GRAPHED])
def test_the_static_step_decodes_as_the_eager_loop(tiny, method, batch, monkeypatch):
    """decode_static's step run eagerly against decode_batch, both on the fused kernels for the qada and page paths:
    the same tokens, labels (bit for bit: the kernel reads T from the device and gives what it gives on the sliced
    cache), context lengths, sparsity and KV read (a page path's entries read, step by step), for one prompt and for a
    left-padded batch whose second row ends early. A page path's statistics, kept in place by the step, end as those
    of every key the cache holds. (The GRAPHED paths: the same, through the emulated graph.)"""
    monkeypatch.setenv("QADA_KERNEL", "triton")
    made = keep_static(monkeypatch)
    eager, static = eager_and_static(tiny, method, batch)
    assert_same(eager, static, method, batch)
    if method in PAGE_METHODS:
        assert_pages_current(*made[0])


@needs_kernel
@pytest.mark.parametrize("method", ["qada_kv_cal", "qada_pages"])
def test_the_split_is_a_choice_of_speed_that_changes_only_the_order_of_the_sums(tiny, method, monkeypatch):
    """The static loop with its context cut into the finest splits (a tile of positions, or of pages, per program),
    against the eager loop's own: the same tokens, labels, lengths, sparsity and KV read, the logits within fp32
    rounding, and not bit for bit (the splits did change)."""
    monkeypatch.setenv("QADA_KERNEL", "triton")
    eager, static = eager_and_static(tiny, method, 3, finest_static=True)
    assert_same(eager, static, method, 3, same_splits=False)
    assert any(not torch.equal(a, b) for a, b in zip(eager[2], static[2]))


class NoSync(TorchDispatchMode):
    """Fails on every operation that reads a tensor's value back to the host (item, int, bool, a data-dependent shape)
    and keeps the rest as the step's trace: each operation with its Python arguments, a tensor by dtype, shape and
    strides, or by name when it is one of the step's buffers (`named`, by address)."""

    HOST_READS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.nonzero", "aten.equal",
                  "aten.masked_select", "aten.unique")

    def __init__(self, named):
        super().__init__()
        self.named, self.trace = named, []

    def describe(self, x):
        if isinstance(x, torch.Tensor):
            return self.named.get(x.data_ptr()) or (x.dtype, tuple(x.shape), x.stride())
        if isinstance(x, (list, tuple)):
            return type(x)(self.describe(a) for a in x)
        if isinstance(x, dict):
            return {k: self.describe(a) for k, a in x.items()}
        return x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in self.HOST_READS or name.removeprefix("aten.") in ("item", "_local_scalar_dense"):
            raise AssertionError(f"the step read a value back to the host: {func}")
        self.trace.append((str(func), self.describe(args), self.describe(kwargs or {})))
        return func(*args, **(kwargs or {}))


class Launches:
    """The fused kernels' launches, recorded (grid, and every argument: a tensor by dtype, shape and strides or by
    name, a Python value as it is) and then run outside the NoSync mode: Triton's interpreter moves the tensors' data
    through torch storages, host work a GPU launch does not do; the launch's own Python values are what a graph
    fixes."""

    def __init__(self, monkeypatch):
        self.records, self.mode = [], None
        for name in KERNELS:
            monkeypatch.setattr(decode_kernels, name, self.wrap(getattr(decode_kernels, name)))

    def wrap(self, kernel):
        launches = self

        class Wrapped:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    describe = launches.mode.describe if launches.mode else (lambda x: x)
                    launches.records.append((grid, describe(args), describe(kwargs)))
                    with torch.utils._python_dispatch._disable_current_modes():
                        return kernel[grid](*args, **kwargs)
                return launch
        return Wrapped()


def no_tolist(monkeypatch):
    """Tensor.tolist and .numpy read CPU tensors without dispatching: fail on them too."""
    def host_read(*args, **kwargs):
        raise AssertionError("the step read a value back to the host")
    for method in ("tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, method, host_read)


@needs_kernel
@pytest.mark.parametrize("method", ["qada_cal", "dense", "qada_pages", "quest"])
def test_the_step_reads_no_host_value_that_changes(tiny, method, monkeypatch):
    """Every decode step of the static loop (a batch of three, the second row ending early) is called with the same
    Python objects, sees the same host values on them (the cache's and the attention's attributes), makes no host
    read, and at one view does the same operations on the same buffers with the same Python arguments, kernel
    launches included (grids, constexprs): what one graph captures is what every step at that view needs. Only the
    view changes, once, where graph_view moves to the next bucket."""
    monkeypatch.setenv("QADA_KERNEL", "triton")
    finished = stop_early(tiny, method)
    cache, logits, rows = prefilled(tiny, method, 3)
    steps, real = [], tiny.decode_step
    launches = Launches(monkeypatch)  # every fused_qada launch, with its Python values
    made = StaticAttention.of

    def spy(token, c, attention):
        # the host state the step can see: every attribute of the cache and of the attention, a tensor by identity
        def state(obj):
            return {k: id(v) if isinstance(v, (torch.Tensor, list, tuple)) else v for k, v in vars(obj).items()}
        static = made_static[0]
        buffers = [("k", c.k), ("v", c.v), ("filled", c.filled), ("position", c.position), ("token", token),
                   ("labels", static.labels), ("step", static.step), ("start", static.start), ("rows", static.rows)]
        if static.pages:  # a page path's statistics, each layer's, and its reads
            buffers += [("reads", static.reads), ("read_now", static.read_now),
                        *((f"pages {i}", x) for i, x in enumerate(sum(static.pages, ())))]
        named = {x.data_ptr(): name for name, x in buffers}
        before = len(launches.records)
        with contextlib.ExitStack() as stack:
            launches.mode = stack.enter_context(NoSync(named))
            patch = stack.enter_context(pytest.MonkeyPatch.context())
            no_tolist(patch)
            out = real(token, c, attention)
        steps.append(dict(args=(id(token), id(c), id(attention)), cache=state(c), static=state(static),
                          trace=launches.mode.trace, launches=launches.records[before:], view=c.view))
        return out

    made_static = []
    monkeypatch.setattr(StaticAttention, "of", classmethod(
        lambda cls, *a, **kw: made_static.append(made(*a, **kw)) or made_static[-1]))
    monkeypatch.setattr(tiny, "decode_step", spy)
    generate.decode_static(tiny, cache, logits, N_NEW, rows, finished=finished)
    monkeypatch.undo()
    assert len(steps) == N_NEW - 1
    views = [s["view"] for s in steps]
    T = [252 + 1 + i for i in range(N_NEW - 1)]  # the filled length during each step
    assert views == [generate.graph_view(t, cache.max_len) for t in T] == [256] * 4 + [252 + N_NEW] * 2
    for s in steps[1:]:
        first = steps[0] if s["view"] == 256 else steps[4]
        assert s["args"] == first["args"] and s["static"] == first["static"]
        assert {k: v for k, v in s["cache"].items() if k != "view"} == {
            k: v for k, v in first["cache"].items() if k != "view"}
        assert s["trace"] == first["trace"] and s["launches"] == first["launches"]
    assert steps[0]["launches"]  # every path runs its kernels
    if method == "dense":  # the split kernel alone (decode_kernels.fused_dense), once per layer
        assert len(steps[0]["launches"]) == tiny.cfg.num_hidden_layers
    assert cache.length == T[-1] and cache.filled is None  # released: the host length is the device's again


class Tape(TorchDispatchMode):
    """A CUDA graph emulated on the CPU: what one call of a step runs is recorded, every tensor operation with the
    tensors it was given and the tensors it made, every kernel launch with its grid and arguments; `replay` runs the
    same again on the same tensors, each operation's result copied into the tensor it made when recorded. As a
    captured graph, a replay sees nothing of the Python that made the step: a host value read at recording is what
    every replay uses."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.entries, self.recording = [], False
        for name in KERNELS:
            monkeypatch.setattr(decode_kernels, name, self.launcher(getattr(decode_kernels, name)))

    def launcher(self, kernel):
        tape = self

        class Launcher:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    if tape.recording:
                        tape.entries.append(("launch", kernel, grid, args, kwargs))
                    with torch.utils._python_dispatch._disable_current_modes():  # the interpreter's own work
                        return kernel[grid](*args, **kwargs)
                return launch
        return Launcher()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.entries.append(("op", func, args, kwargs or {}, out))
        return out

    def record(self, step):
        self.entries, self.recording = [], True
        try:
            with self:
                return step()
        finally:
            self.recording = False

    def replay(self):
        for kind, fn, *rest in self.entries:
            if kind == "launch":
                grid, args, kwargs = rest
                fn[grid](*args, **kwargs)
                continue
            args, kwargs, made = rest
            result = fn(*args, **kwargs)
            for new, old in zip(*(x if isinstance(x, (tuple, list)) else (x,) for x in (result, made))):
                if isinstance(old, torch.Tensor) and new is not old and (
                        new.untyped_storage().data_ptr() != old.untyped_storage().data_ptr()):  # not a view of it
                    old.copy_(new)


@needs_kernel
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method", GRAPHED)
def test_an_emulated_graph_decodes_as_the_eager_loop(tiny, method, batch, monkeypatch):
    """decode_static with capture on, its graphs emulated on the CPU (Tape: warm-up, rewind, then one recorded step,
    replayed for every later step at that view): the eager loop's tokens, labels and logits. A step that read a host
    value which changes would replay the recorded one."""
    monkeypatch.setenv("QADA_KERNEL", "triton")
    tapes = []

    def captured(step, rewind, device, pool=None):  # generate.captured's contract, with a Tape for the graph
        tape = Tape(monkeypatch)
        step(), rewind()
        out = step()
        rewind()
        static_out = tape.record(step)  # runs the step once more: its effects are the warm-up's again
        assert torch.equal(static_out, out)
        tapes.append(tape)
        return tape.replay, static_out, None

    monkeypatch.setattr(generate, "captured", captured)
    made = keep_static(monkeypatch)
    eager, static = eager_and_static(tiny, method, batch, capture=True)
    assert_same(eager, static, method, batch)
    if method in PAGE_METHODS:  # every replay folded its own key into the pages
        assert_pages_current(*made[0])
    assert len(tapes) == (1 if batch == 1 else 2)  # one graph per view: the batch crosses into a second view


@needs_kernel
@pytest.mark.parametrize("method", ["qada_cal", "qada_pages"])
def test_the_form_apart_decodes_through_the_static_loop_with_no_fill_per_step(tiny, method, monkeypatch):
    """WINDOW_LAUNCH's FORM_APART through the static loop: the eager loop's tokens, logits and labels, with its parts'
    arrival counts the loop's one buffer (StaticAttention.arrived), back at zero after every step; and no step fills
    a tensor, as a zeroed buffer made per call would (a node of its own in the graph)."""
    monkeypatch.setenv("QADA_KERNEL", "triton")
    monkeypatch.setitem(decode_kernels.WINDOW_LAUNCH, "FORM_APART", True)
    Launches(monkeypatch)  # the kernels run outside the mode below: the interpreter's own copies are not the step's
    made, ops, call = keep_static(monkeypatch), [], StaticAttention.__call__

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    def step(static, *args):
        with Ops():
            out = call(static, *args)
        assert not static.arrived.any()
        return out

    monkeypatch.setattr(StaticAttention, "__call__", step)
    eager, static = eager_and_static(tiny, method, 3)
    assert_same(eager, static, method, 3)
    assert made[0][0].arrived is not None and ops
    assert not {op for op in ops if "fill" in op or "zero" in op}, sorted(set(ops))


@needs_kernel
@pytest.mark.parametrize("method", ["dense", "qada_kv_cal", "qada_pages"])
def test_generate_reports_the_same_through_the_static_loop(tiny_dir, tmp_path, method, monkeypatch):
    """run_batch with the static loop (graph_refusal made to find nothing: on the CPU the step runs eagerly, on CUDA
    it replays real graphs) gives the eager loop's report (--cuda-graphs off) for every prompt of a batch: tokens,
    text, sparsity, KV read, steps; and says which loop ran."""
    monkeypatch.setenv("QADA_KERNEL", "triton")
    files = [str(write_prompt(tmp_path, n)) for n in (60, 150, 97)]
    cal = tmp_path / "cal.json"
    c = calibration()
    save_calibration(cal, Calibration(c.a, c.b, c.s, {"moments_source": "prompt"}))
    kw = dict(model=str(tiny_dir), max_new_tokens=6, method=method, n_sink=N_SINK, n_local=N_LOCAL, progress=False)
    if method != "dense":
        kw.update(moments_source="prompt", tau=0.25, calibration=str(cal))
    if method == "qada_pages":
        kw.update(budget=32)
    eager = generate.run_batch(files, cuda_graphs="off", **kw)
    assert all(r["cuda_graphs"] == "off: --cuda-graphs off" for r in eager)
    monkeypatch.setattr(generate, "graph_refusal", lambda *args: None)
    static = generate.run_batch(files, **kw)
    same = ("new_token_ids", "text", "sparsity", "kv_read", "layer_sparsity", "decode_steps", "new_tokens")
    for a, b in zip(eager, static):
        assert {k: b[k] for k in same} == {k: a[k] for k in same}
        assert b["cuda_graphs"].startswith("on")
    if method != "dense":
        assert 0 < static[0]["sparsity"] < 1


@needs_kernel
@pytest.mark.skipif(generate.compiler_missing(torch.device("cpu")) is not None, reason="no C++ compiler here")
def test_the_static_loop_with_the_pointwise_compiled_reports_as_the_eager_modules(tiny_dir, tmp_path, monkeypatch):
    """run_batch with --compile on through the static loop (graph_refusal made to find nothing): the model's norms,
    RoPE and MLP compiled before decoding, and every prompt's tokens, text, sparsity and KV read those of the eager
    loop with the eager modules; the report says it compiled."""
    monkeypatch.setenv("QADA_KERNEL", "triton")
    files = [str(write_prompt(tmp_path, n)) for n in (60, 150)]
    cal = tmp_path / "cal.json"
    c = calibration()
    save_calibration(cal, Calibration(c.a, c.b, c.s, {"moments_source": "prompt"}))
    kw = dict(model=str(tiny_dir), max_new_tokens=5, method="qada_kv_cal", moments_source="prompt", tau=0.25,
              calibration=str(cal), n_sink=N_SINK, n_local=N_LOCAL, progress=False)
    eager = generate.run_batch(files, cuda_graphs="off", **kw)
    monkeypatch.setattr(generate, "graph_refusal", lambda *args: None)
    calls = []
    real = Llama.compile_pointwise
    monkeypatch.setattr(Llama, "compile_pointwise", lambda self: calls.append(self) or real(self))
    static = generate.run_batch(files, compiled="on", **kw)
    assert len(calls) == 1
    same = ("new_token_ids", "text", "sparsity", "kv_read", "layer_sparsity", "decode_steps")
    for a, b in zip(eager, static):
        assert {k: b[k] for k in same} == {k: a[k] for k in same}
        assert b["compiled"] and not a["compiled"] and b["cuda_graphs"].startswith("on")
    assert 0 < static[0]["sparsity"] < 1


def test_cuda_graphs_auto_on_the_cpu_says_it_is_off_and_why(tiny_dir, tmp_path, capsys):
    argv = ["--prompt", str(write_prompt(tmp_path, 40)), "--model", str(tiny_dir), "--max-new-tokens", "2",
            "--method", "dense", "--device", "cpu"]
    assert generate.main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "CUDA graphs" in line]
    assert lines == ["decode loop: CUDA graphs off: no CUDA device (cpu); the eager loop runs"]
    assert generate.main(argv + ["--cuda-graphs", "off", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cuda_graphs"] == "off: --cuda-graphs off"


def test_a_bad_cuda_graphs_value_is_one_line_and_exit_2(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(generate, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert generate.main(["--prompt", str(write_prompt(tmp_path, 20)), "--model", str(tiny_dir), "--cuda-graphs",
                          "on"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --cuda-graphs takes auto or off, got 'on'"


def test_what_cannot_run_from_fixed_buffers_says_why(tiny):
    """graph_refusal on a CUDA device (no CUDA needed to ask): the paths that decide on the host, moments that change
    every step, the oracle's statistics tracked beside, and the flag itself."""
    cache = tiny.new_cache(300)
    tiny.prefill(torch.randint(0, 100, (1, 200), generator=torch.Generator().manual_seed(0)).to(tiny.device), cache)
    cuda = torch.device("cuda")

    def why(method, **kw):
        att = build_attention(method, cache, n_sink=N_SINK, n_local=N_LOCAL, **kw)
        return generate.graph_refusal("auto", cuda, [att], [200], tiny)

    assert "the oracle path decides on the host" in why("oracle", tau=0.5)
    assert "the page_oracle path decides on the host" in why("page_oracle", budget=32)
    for method, kw in (("quest", dict(budget=32)),
                       ("qada_pages_frac", dict(tau=0.5, budget_frac=0.2, moments_source="prompt",
                                                calibration=calibration()))):
        assert static_refusal([build_attention(method, cache, n_sink=N_SINK, n_local=N_LOCAL, **kw)]) is None
    rows = [build_attention("quest", cache, n_sink=N_SINK, n_local=N_LOCAL, budget=b) for b in (32, 64)]
    assert static_refusal(rows) == "the rows read different page budgets"
    # a row with a page index of other pages never reaches the graph: its attention is refused when built
    for P in (32, 16):  # another page size; the right one, counted from other sinks
        with pytest.raises(ValueError, match=f"a page index holds pages of {P} tokens after 16 sinks; the path reads "
                                             "pages of 16 after 4"):
            build_attention("quest", cache, n_sink=N_SINK, n_local=N_LOCAL, budget=32, pages=PageIndex(cache, P))
    kw = dict(n_sink=N_SINK, n_local=N_LOCAL, tau=0.5, moments_source="prompt")
    one, other = calibration(), calibration()  # two objects (alike here): the step holds the first row's for all
    assert static_refusal([build_attention("qada_cal", cache, calibration=one, **kw)] * 2) is None
    assert static_refusal([build_attention("qada_cal", cache, calibration=c, **kw) for c in (one, other)]) == (
        "the rows run different paths")
    with pytest.raises(ValueError, match="not in static mode"):
        StaticAttention.of(rows[:1], cache, 4, 4)
    assert "the static path decides on the host" in why("static", static_local=torch.zeros(2, 4, dtype=torch.bool))
    assert "the moments change every step (OnlineMoments)" in why("qada", tau=0.5, moments_source="prompt-online")
    assert "oracle's statistics" in why("qada", tau=0.5, moments_source="prompt", track_oracle=True)
    dense = build_attention("dense", cache)
    assert static_refusal([dense]) is None
    assert generate.graph_refusal("off", cuda, [dense], [200], tiny) == "--cuda-graphs off"
    assert generate.graph_refusal("auto", torch.device("cpu"), [dense], [200], tiny).startswith("no CUDA device")
    with pytest.raises(ValueError, match="decides on the host"):
        StaticAttention.of([build_attention("local", cache)], cache, 4, 4)


class CpuProbe:
    """torch as generate.graph_refusal sees it, its probe tensor made on the CPU whatever device it names: the refusal
    asked about a CUDA device where there is none."""

    @staticmethod
    def empty(*shape, device=None, **kw):
        return torch.empty(*shape, **kw)

    def __getattr__(self, name):
        return getattr(torch, name)


def test_graph_refusal_names_the_torch_path_and_a_prompt_inside_the_window(tiny, monkeypatch):
    """On CUDA a qada path decodes through graphs where it takes the fused kernel and every prompt is longer than its
    window; else the refusal says which of the two it is. Dense needs no kernel (the model's own decoding replays)."""
    cache = tiny.new_cache(300)
    tiny.prefill(torch.randint(0, 100, (1, 200), generator=torch.Generator().manual_seed(0)).to(tiny.device), cache)
    att = build_attention("qada_cal", cache, n_sink=N_SINK, n_local=N_LOCAL, tau=0.5, moments_source="prompt",
                          calibration=calibration())
    dense = build_attention("dense", cache)
    monkeypatch.setattr(generate, "torch", CpuProbe())
    cuda = torch.device("cuda")
    monkeypatch.setenv("QADA_KERNEL", "triton")
    assert generate.graph_refusal("auto", cuda, [att], [200], tiny) is None
    assert generate.graph_refusal("auto", cuda, [att, att], [200, N_LOCAL + 1], tiny) is None
    for lengths in ([200, N_LOCAL], [N_LOCAL, 200]):  # one row inside its window is enough
        assert generate.graph_refusal("auto", cuda, [att, att], lengths, tiny) == (
            f"a prompt fits in the window ({N_LOCAL} tokens): its first steps take the torch path")
    monkeypatch.setenv("QADA_KERNEL", "torch")
    assert generate.graph_refusal("auto", cuda, [att], [200], tiny).startswith(
        "the qada_cal path takes the torch path here (QADA_KERNEL=torch")
    assert generate.graph_refusal("auto", cuda, [dense], [200], tiny) is None
    assert generate.graph_refusal("auto", cuda, [dense, dense], [200, N_LOCAL], tiny) is None


def test_the_static_loop_ends_rows_at_the_models_end_token_and_samples_as_the_eager_loop(tiny_dir, tmp_path,
                                                                                         monkeypatch):
    """run_batch through the static loop (graph_refusal made to find nothing; dense on the CPU: the model's own
    decoding over the view) and through the eager one: a row ends at the end token the model's folder names (kept,
    as the last), the other runs on; at temperature 1 both draw the same tokens from the seed, not greedy ones."""
    monkeypatch.setenv("QADA_KERNEL", "torch")
    files = [str(write_prompt(tmp_path, n)) for n in (40, 57)]
    kw = dict(max_new_tokens=6, method="dense", progress=False)
    refusal = generate.graph_refusal

    def run(model, loop, **more):
        monkeypatch.setattr(generate, "graph_refusal", (lambda *args: None) if loop == "static" else refusal)
        reports = generate.run_batch(files, model=str(model), **kw, **more)
        assert all(r["cuda_graphs"].startswith("on" if loop == "static" else "off") for r in reports)
        return [r["new_token_ids"] for r in reports]

    free = run(tiny_dir, "eager")
    end = free[0][2]
    assert end not in free[0][:2] and end not in free[1], "the prompts need another end token"
    ending = tmp_path / "ending"
    shutil.copytree(tiny_dir, ending)
    (ending / "generation_config.json").write_text(json.dumps({"eos_token_id": end}))
    for loop in ("eager", "static"):
        assert run(ending, loop) == [free[0][:3], free[1]], loop
    drawn = run(tiny_dir, "eager", temperature=1.0, seed=5)
    assert drawn != free and run(tiny_dir, "static", temperature=1.0, seed=5) == drawn


def test_graph_views_reach_past_T_by_at_most_a_quarter():
    """graph_view: at least T, at most the capacity, less than an eighth or 256 positions past T, and it moves rarely:
    few graphs per generation."""
    for capacity in (300, 5000, 40000, 131072):
        views = [generate.graph_view(T, capacity) for T in range(1, capacity + 1)]
        for T, view in zip(range(1, capacity + 1), views):
            assert T <= view <= capacity and view - T < max(T / 8, 256)
        assert len(set(views)) <= 16 * (capacity.bit_length() - 7)  # 16 per power of two above 256
    assert generate.graph_view(32768, 40000) == 32768 and generate.graph_view(32769, 40000) == 36864


# ---------------------------------------------------------------------------------------------------------
# On a GPU: the graphs themselves


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method", ["dense", "qada", "qada_cal", "qada_kv_cal", *PAGE_METHODS])
def test_graph_replays_decode_as_the_eager_loop(tiny_dir, method, batch):
    """decode_static capturing and replaying CUDA graphs (two views: two graphs for the batch) against decode_batch
    on the same GPU: equal tokens, labels and statistics."""
    model = load_model(str(tiny_dir), device="cuda")
    eager, static = eager_and_static(model, method, batch, capture=True)
    assert_same(eager, static, method, batch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method", ["dense", "qada_kv_cal", "qada_pages"])
def test_generate_on_cuda_decodes_through_graphs_as_eager(tiny_dir, tmp_path, method, capsys):
    """The CLI on CUDA: auto captures (and says so), and gives --cuda-graphs off's tokens and statistics."""
    files = [str(write_prompt(tmp_path, n)) for n in (60, 150, 97)]
    cal = tmp_path / "cal.json"
    c = calibration()
    save_calibration(cal, Calibration(c.a, c.b, c.s, {"moments_source": "prompt"}))
    argv = ["--prompt", *files, "--model", str(tiny_dir), "--max-new-tokens", "6", "--method", method, "--device",
            "cuda", "--json"]
    if method != "dense":  # dense has no window, moments, tau or calibration
        argv += ["--n-sink", str(N_SINK), "--n-local", str(N_LOCAL), "--moments", "prompt", "--tau", "0.25",
                 "--calibration", str(cal)]
    if method == "qada_pages":
        argv += ["--set", "budget=32"]
    reports = {}
    for mode in ("auto", "off"):
        assert generate.main(argv + ["--cuda-graphs", mode]) == 0
        reports[mode] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(reports["auto"]) == len(reports["off"]) == len(files)  # a report per prompt: none vacuous below
    assert all(r["cuda_graphs"].startswith("on") for r in reports["auto"])
    same = ("new_token_ids", "sparsity", "kv_read", "decode_steps")
    assert [{k: r[k] for k in same} for r in reports["auto"]] == [{k: r[k] for k in same} for r in reports["off"]]
