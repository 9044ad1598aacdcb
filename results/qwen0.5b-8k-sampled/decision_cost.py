"""What deciding costs per layer on this CPU, the sampled estimate beside the calibrated Gaussian, at the research
model's attention shape (14 query heads, 2 KV heads, head dim 64; bf16 cache of 8,192 tokens; one query).

Both decisions share the window's exact attention (timed apart); what differs is the bulk term: the Gaussian's
q A q^T + q b with its correction, against gathering 64 bulk keys, their scores and their log-mean-exp. Dense attention
over the whole cache is timed beside them for scale. Median of 41 repeats, one thread, nothing else running:

    python results/qwen0.5b-8k-sampled/decision_cost.py          # prints a markdown table (~10 s)
"""

import statistics
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from attention import N_SAMPLES, all_scores, bulk_sample, full_attention, window_attention  # noqa: E402
from criterion import (Correction, corrected_log_bulk, gaussian_form, gaussian_log_bulk, local_labels,  # noqa: E402
                       sampled_log_bulk)

H, HKV, D, T, N_SINK, N_LOCAL, TAU, LAYER = 14, 2, 64, 8192, 16, 128, 0.2, 12


def median_us(fn, number: int = 200, repeat: int = 41) -> float:
    fn()  # warm-up
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(H, D, generator=g).bfloat16()
    k, v = (torch.randn(HKV, T, D, generator=g).bfloat16() for _ in range(2))
    keys = k[:, N_SINK: T - N_LOCAL + N_SINK].float()
    form = gaussian_form(keys.mean(1), torch.stack([torch.cov(x.T, correction=0) for x in keys]))
    correction = Correction(torch.randn(H, generator=g) * 0.1, 1 + torch.rand(H, generator=g) * 0.1, None)  # affine
    _, log_local = window_attention(q, k, v, N_SINK, N_LOCAL)
    n_bulk = T - N_LOCAL

    def gaussian():
        log_bulk = corrected_log_bulk(log_local, gaussian_log_bulk(q, form, n_bulk), correction)
        return local_labels(log_local, log_bulk, TAU, HKV)

    def sampled():
        idx = bulk_sample(T, N_SINK, N_LOCAL, N_SAMPLES, LAYER)
        log_bulk = corrected_log_bulk(log_local, sampled_log_bulk(all_scores(q, k[:, idx]), n_bulk), correction)
        return local_labels(log_local, log_bulk, TAU, HKV)

    rows = [("window attention (both)", median_us(lambda: window_attention(q, k, v, N_SINK, N_LOCAL))),
            ("Gaussian bulk term + affine correction + labels", median_us(gaussian)),
            (f"sampled bulk term ({N_SAMPLES} keys) + affine correction + labels", median_us(sampled)),
            (f"  of which placing the {N_SAMPLES} positions (bulk_sample)",
             median_us(lambda: bulk_sample(T, N_SINK, N_LOCAL, N_SAMPLES, LAYER))),
            ("dense attention over all 8,192 tokens",
             median_us(lambda: full_attention(q.view(HKV, H // HKV, D), k, v), number=20))]
    print(f"torch {torch.__version__}, 1 thread; shape H={H}, Hkv={HKV}, D={D}, T={T}, bf16 cache\n")
    print("| per layer and decoded token | µs |\n|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
