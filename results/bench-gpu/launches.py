"""Kernels one dense bf16 decode step launches per layer, eager and with the model's norms, RoPE and MLP compiled
(model.Llama.compile_pointwise, generate.py --compile on).

    python results/bench-gpu/launches.py                  # the CPU: counted from torch's dispatch and inductor's code
    python results/bench-gpu/launches.py --device cuda    # a GPU: the CUDA kernels torch.profiler records

A random-weight Llama with Llama-3-8B's head layout (32 query heads, 8 KV heads of 128) at a small width, decoding
one token after a short prompt, with 2 and 3 layers: the difference is one layer's. On a GPU every kernel the
profiler records counts. The CPU launches none, so there a launch is counted where CUDA would make one: eager, each
operation that computes (a view of its input is not one; an operation that reads the whole tensor into a new one,
a cast or a reshape that copies, is); compiled, each kernel inductor fused for a compiled module, each matmul inside
it, and each computing operation outside the compiled modules.
"""

import argparse
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
import torch._inductor.config
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project's top-level files
from lab.bench_gpu import random_llama  # noqa: E402
from model import MLP, LlamaConfig, RMSNorm, RoPE  # noqa: E402

COMPILED = (RMSNorm, RoPE, MLP)  # what compile_pointwise compiles


def computes(func, args, out) -> bool:
    """Whether an operation writes memory: in place (copy_), or into a tensor of its own, not a view of an input."""
    if func._schema.is_mutable:
        return True
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return any(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs for o in outs)


class Ops(TorchDispatchMode):
    """The computing operations dispatched, each with the compiled module it ran in (None: outside them)."""

    def __init__(self, model):
        super().__init__()
        self.ops, self.inside = [], []
        for m in model.modules():
            if isinstance(m, COMPILED):
                m.register_forward_pre_hook(self.enter)
                m.register_forward_hook(self.leave)

    def enter(self, module, args):
        self.inside.append(type(module).__name__)

    def leave(self, module, args, out):
        self.inside.pop()  # returns nothing: a forward hook's return value would replace the module's output

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if computes(func, args, out):
            self.ops.append((str(func.overloadpacket), self.inside[-1] if self.inside else None))
        return out


def one_step(layers: int, device: torch.device, compiled: bool, watch):
    """Decode one token after an 8-token prompt (two untimed steps first: a compiled module compiles at its first
    decode shape) and return what `watch(model)`, a context manager, saw of the third step."""
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=512)
    torch.manual_seed(0)
    model = random_llama(cfg, device)
    if compiled:
        model.compile_pointwise()
    cache, token = model.new_cache(16), torch.tensor([3], device=device)
    with torch.inference_mode():
        model.prefill(torch.randint(0, 512, (1, 8), device=device), cache)
        for _ in range(2):
            model.decode_step(token, cache)
        with watch(model) as seen:
            model.decode_step(token, cache)
            if device.type == "cuda":
                torch.cuda.synchronize()
    return seen


def per_layer(count) -> Counter:
    """count(layers) for 3 layers less for 2: one layer's share, the embedding, final norm and head cancelling."""
    return count(3) - count(2)


@contextmanager
def dispatched(model):
    """The computing operations one step dispatches, by (name, compiled module or None)."""
    seen, mode = Counter(), Ops(model)
    with mode:
        yield seen
    seen.update(mode.ops)


def profiled(activity, keep):
    """A watch for one_step: the names of the profiler's events that keep(event) keeps."""
    @contextmanager
    def watch(model):
        seen = Counter()
        with profile(activities=[activity]) as prof:
            yield seen
        seen.update(e.name for e in prof.events() if keep(e))
    return watch


def count_cuda(device) -> dict:
    kernels = profiled(ProfilerActivity.CUDA, lambda e: e.device_type == torch.autograd.DeviceType.CUDA)
    return {mode: per_layer(lambda L: one_step(L, device, mode == "compiled", kernels))
            for mode in ("eager", "compiled")}


def count_cpu(device) -> dict:
    by_module = per_layer(lambda L: one_step(L, device, False, dispatched))
    eager = Counter()
    for (name, _), n in by_module.items():
        eager[name] += n
    # Compiled code runs out of the dispatch mode's reach, so its own part is read from the profiler: inductor's CPU
    # kernels record themselves under their names (cpp_fused_...) when asked to
    torch._inductor.config.cpp.enable_kernel_profile = True
    fused_kernels = profiled(ProfilerActivity.CPU, lambda e: "cpp_fused" in e.name)
    fused = per_layer(lambda L: one_step(L, device, True, fused_kernels))
    compiled = Counter({f"{name} in {module}" if module else name: n for (name, module), n in by_module.items()
                        if module is None or name == "aten.linear"})  # what stays outside, and the matmuls inside
    compiled.update({"fused: " + name.split("cpp_fused_")[1].rsplit("_", 1)[0]: n for name, n in fused.items()})
    return {"eager": eager, "compiled": compiled}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python results/bench-gpu/launches.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("launches.py: --device cuda, but this machine has no CUDA", file=sys.stderr)
        return 2
    counts = count_cuda(device) if device.type == "cuda" else count_cpu(device)
    for mode, seen in counts.items():
        print(f"{mode}: {sum(seen.values())} per layer")
        for name, n in sorted(seen.items(), key=lambda kv: (-kv[1], str(kv[0]))):
            print(f"  {n:3d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
