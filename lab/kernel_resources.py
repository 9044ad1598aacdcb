"""What the fused step's kernels take of an NVIDIA GPU, from Triton's own compile for one that need not be here:
registers per thread and the stack frame (bytes per thread that did not fit in registers, spilled to local memory),
for each kernel of QAdA's fused step and of QAdA + pages' at the default launch (decode_kernels.WINDOW_LAUNCH,
BOUND_LAUNCH, SPLIT_LAUNCH) and the window kernel of both at every launch lab.bench_gpu times beside it
(WINDOW_VARIANTS), at Llama-3-8B's shapes in bf16, 32k.

    python -m lab.kernel_resources                     # sm_90 (H100, H200), with the installed Triton
    python -m lab.kernel_resources --arch 80 --out DIR # kernel_resources.md in DIR

The numbers are the compiler's, so they follow the Triton version: run it with the one the GPU has (for the H200
machine, Triton 3.6: `pip install --target /tmp/t36 triton==3.6.0`, then `PYTHONPATH=/tmp/t36 python -m
lab.kernel_resources`). Each launch is captured as the step makes it on CPU tensors (the kernels replaced by a
recorder, tensor cores on as on a GPU), its arguments specialized as the JIT specializes them on a GPU (specs: the
alignment marks decide whether a loop's loads are asynchronous copies, and so its registers), compiled in a fresh
interpreter without TRITON_INTERPRET (Triton set up for its interpreter cannot compile for a GPU in the same
process), and read from the cubin by the cuobjdump Triton bundles. The tests compile every kernel of a step this way
too (tests/test_kernel_pages.py), so that a launch the interpreter runs but the GPU compiler refuses is found without
a GPU.
"""

import contextlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import decode_kernels
from lab.cli import Parser, at_least, fail, make_folder

# The compile, in a fresh interpreter: each spec's kernel compiled for sys.argv[1]; with a folder as sys.argv[2],
# each cubin written there as <i>.cubin. `aligned`: the arguments the JIT would mark divisible by 16.
COMPILE = """
import json, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import decode_kernels
for i, (name, signature, constexprs, aligned, options) in enumerate(json.load(sys.stdin)):
    fn = getattr(decode_kernels, name)
    index = {p.name: i for i, p in enumerate(fn.params)}
    source = ASTSource(fn, signature, constexprs={(index[k],): v for k, v in constexprs.items()},
                       attrs={(index[k],): [["tt.divisibility", 16]] for k in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", int(sys.argv[1]), 32), options=options)
    if len(sys.argv) > 2:
        (Path(sys.argv[2]) / f"{i}.cubin").write_bytes(compiled.asm["cubin"])
"""


def nvidia_backend() -> Path | None:
    """The folder of the NVIDIA tools Triton bundles (ptxas, cuobjdump), where its NVIDIA backend and ptxas are found
    (its own copy, TRITON_PTXAS_PATH, or one on the PATH); else None."""
    import shutil

    from triton import backends
    tools = Path(backends.__file__).parent / "nvidia" / "bin"
    found = (tools / "ptxas").exists() or bool(os.environ.get("TRITON_PTXAS_PATH")) or shutil.which("ptxas")
    return tools if "nvidia" in backends.backends and found else None


def specs(launches: list) -> list:
    """Captured launches (kernel, grid, args, kwargs) as COMPILE takes them, each argument specialized as Triton's JIT
    does at a launch on a GPU: a tensor as a pointer to its dtype, an int as i32 or i64, an int equal to 1 (a unit
    stride) as a constant, and a tensor at a 16-byte aligned address or an int divisible by 16 marked so (which
    decides, among others, whether a load can be an asynchronous copy and so whether a loop is software-pipelined);
    a constexpr as its value (its default where the launch left it); num_warps, num_stages and launch_pdl as the
    options. The CPU tensors stand for the GPU's: torch aligns both allocators' storage, and a view's offset is the
    same on either."""
    import triton
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl
    out = []
    for kernel, _, args, kwargs in launches:
        params = inspect.signature(kernel.fn).parameters  # the Python function, compiled or interpreted
        values = dict(zip(params, args)) | kwargs
        signature, constexprs, aligned = {}, {}, []
        for name, p in params.items():
            x = values[name] if name in values else p.default
            if p.annotation is triton.language.constexpr:
                signature[name], constexprs[name] = "constexpr", x
                continue
            # the JIT's own rule: (value, is_const, specialize, align) -> ("*bf16", "i32", ... or "constexpr", "D")
            kind, attribute = native_specialize_impl(BaseBackend, x, False, True, True)
            signature[name] = kind
            if kind == "constexpr":
                constexprs[name] = x
            elif attribute == "D":
                aligned.append(name)
        options = {k: kwargs[k] for k in ("num_warps", "num_stages", "launch_pdl") if k in kwargs}
        out.append((kernel.fn.__name__, signature, constexprs, aligned, options))
    return out


def compile_launches(launches: list, arch: int = 90, cubins: Path | None = None) -> tuple[int, str]:
    """Compile captured launches for an NVIDIA GPU of compute capability `arch` with the installed Triton (into
    `cubins`, a folder, when given). Returns the compiler's exit status and its error output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-c", COMPILE, str(arch)] + ([str(cubins)] if cubins is not None else [])
    done = subprocess.run(command, input=json.dumps(specs(launches)), text=True, env=env, capture_output=True,
                          cwd=Path(decode_kernels.__file__).parent, timeout=900)
    return done.returncode, done.stderr


def usage(cubin: Path, tools: Path) -> dict:
    """REG and STACK of the one kernel in a cubin, as cuobjdump's resource usage says them."""
    text = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    return {key: int(value) for key, value in re.findall(r"\b(REG|STACK):(\d+)", text.split("Function")[-1])}


class Launch:
    """A stand-in for a Triton kernel: `kernel[grid](...)` records the launch, (kernel, grid, args, kwargs), and runs
    nothing (`kernel`: the one it stands for, for those that compile what was launched; the tests' stubs too)."""

    def __init__(self, launches: list, kernel=None):
        self.launches, self.kernel = launches, kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, grid, args, kwargs))


@contextlib.contextmanager
def recorded(launches: list):
    """The step's kernels recorded into `launches` instead of run, tensor cores on as a GPU has them."""
    names = ("_window_decide_kernel", "_split_attention_kernel", "_page_bound_kernel", "_page_select_kernel")
    kept = {name: getattr(decode_kernels, name) for name in names} | {"INTERPRETED": decode_kernels.INTERPRETED}
    try:
        decode_kernels.INTERPRETED = False
        for name in names:
            setattr(decode_kernels, name, Launch(launches, kept[name]))
        yield
    finally:
        for name, value in kept.items():
            setattr(decode_kernels, name, value)


def step_launches(window_change: dict | None = None) -> dict[str, list]:
    """The launches of QAdA's fused step ("qada": window and split kernels) and of QAdA + pages' as the static loop
    runs it ("qada_pages": window, bound, select and split kernels, the appended key folded, the entries read
    counted), Llama-3-8B in bf16 at 32k, with the window kernel's launch changed by `window_change`."""
    from lab.bench_gpu import launch
    H, Hkv, D, T, P = 32, 8, 128, 32768, 16
    q = torch.zeros(1, H, D, dtype=torch.bfloat16)
    k = v = torch.zeros(1, Hkv, T, D, dtype=torch.bfloat16)
    rows = start = torch.zeros(1, dtype=torch.int32)
    length = torch.full((1,), T, dtype=torch.int32)
    form = (torch.zeros(1, Hkv, D, D), torch.zeros(1, Hkv, D))
    tau = torch.full((1,), 0.6, dtype=torch.float64)
    n_pages = (T - 16) // P + 1
    bounds = (torch.zeros(1, Hkv, n_pages, D, dtype=torch.bfloat16),) * 2
    steps = {"qada": [], "qada_pages": []}
    with launch(decode_kernels.WINDOW_LAUNCH, **(window_change or {})):
        with recorded(steps["qada"]):
            decode_kernels.fused_qada(q, k, v, rows, start, 16, 128, form, tau, "mean", length=length)
        with recorded(steps["qada_pages"]):
            decode_kernels.fused_pages(q, k, v, rows, start, 16, 128, bounds, P, budget=1024, form=form, tau=tau,
                                       length=length, fold=True, with_read=True)
    return steps


def table(arch: int) -> list[str]:
    """Rows of kernel, step, launch, registers and stack bytes: every kernel of both steps at the default launch,
    then the window kernel of both at each of WINDOW_VARIANTS."""
    from lab.bench_gpu import WINDOW_VARIANTS
    tools = nvidia_backend()
    if tools is None:
        raise RuntimeError("this Triton has no NVIDIA backend or finds no ptxas: nothing to compile for a GPU with")
    lines = ["| kernel | step | launch | registers | stack bytes |", "|---|---|---|---:|---:|"]
    for change in [None] + WINDOW_VARIANTS:
        name = json.dumps(change) if change else "default"
        launches = [(step, launch) for step, made in step_launches(change).items() for launch in made
                    if change is None or launch[0].fn.__name__ == "_window_decide_kernel"]
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder)
            status, errors = compile_launches([launch for _, launch in launches], arch, out)
            if status:
                raise RuntimeError(f"the {name} launch did not compile: {errors.strip().splitlines()[-1]}")
            for i, (step, (kernel, *_rest)) in enumerate(launches):
                got = usage(out / f"{i}.cubin", tools)
                lines.append(f"| {kernel.fn.__name__} | {step} | {name} | {got['REG']} | {got['STACK']} |")
    return lines


def main(argv=None) -> int:
    p = Parser(prog="python -m lab.kernel_resources", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=at_least(80), default=90, help="the GPU's compute capability, as major * 10 + minor "
                   "(Triton's NVIDIA backend: 80 and above)")
    p.add_argument("--out", help="a folder for kernel_resources.md (default: print only)")
    args = p.parse(argv)
    if isinstance(args, int):
        return args
    try:
        import triton
        if args.out:  # said before the compiles
            make_folder(args.out)
            old = Path(args.out) / "kernel_resources.md"
            if old.is_file() and f"triton {triton.__version__};" not in old.read_text():  # a committed table
                raise ValueError(f"{old} is another Triton's table (this is {triton.__version__}): give this Triton's "
                                 f"own --out, e.g. results/bench-gpu/triton-{triton.__version__.rsplit('.', 1)[0]}")
        lines = table(args.arch)
    except (RuntimeError, ImportError, ValueError) as e:
        return fail(e)
    head = [f"# The fused step's kernels compiled for sm_{args.arch}: Llama-3-8B, bf16, 32k", "",
            f"`{' '.join(['python -m lab.kernel_resources', *(argv if argv is not None else sys.argv[1:])])}`", "",
            f"triton {triton.__version__}; torch {torch.__version__}", ""]
    text = "\n".join(head + lines) + "\n"
    print(text)
    if args.out:
        (Path(args.out) / "kernel_resources.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
