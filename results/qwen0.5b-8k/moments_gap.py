"""Why QAdA's random-words moments underestimate the bulk in the late layers: a one-off analysis.

    python results/qwen0.5b-8k/moments_gap.py --threads 1 > results/qwen0.5b-8k/moments_gap.md

For the first decode step of a few 8k samples, per (layer, query head): the true log bulk mass, the Gaussian
estimate with the random-words moments (Option 2, the sweep's qada_rw) and with the exact moments of the prompt's
own bulk keys, and the gap between the two estimates split into its two terms of Eq. 6:
    mean term       q (mu_rw - mu_prompt) / sqrt(d)
    variance term   q (Sigma_rw - Sigma_prompt) q^T / 2d
so that the table says which of the two moments is off, and in which layers.
"""

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from attention import all_scores  # noqa: E402
from weights.checkpoints import load  # noqa: E402
from weights.downloads import cache_dir  # noqa: E402
from criterion import gaussian_form, gaussian_log_bulk, oracle_log_masses  # noqa: E402
from moments import ReferenceKeys, bulk_end, mean_cov  # noqa: E402
from lab.tasks import make_sample  # noqa: E402

N_SINK, N_LOCAL = 16, 128


def main(threads: int, tasks: list[str], samples: int, length: int) -> None:
    torch.set_num_threads(threads)
    model, tok = load("qwen2.5-coder-0.5b", dtype=torch.bfloat16, progress=False)
    reference = ReferenceKeys(model, tok, "random", root=cache_dir() / "moments", progress=False)
    L, H, D = model.cfg.num_hidden_layers, model.cfg.num_attention_heads, model.cfg.head_dim
    rows = []  # per (sample, layer): (H,) tensors
    for task in tasks:
        for index in range(samples):
            sample = make_sample(task, index, length, tok)
            ids = tok.encode(sample.prompt)
            cache = model.new_cache(len(ids) + 1)
            token = model.prefill(torch.tensor([ids]), cache).argmax(-1)
            T0 = cache.length
            rw = reference.for_prompt(T0, N_SINK, N_LOCAL)
            queries = {}

            def record(q, k, v, layer):  # the first decoded token's queries; dense attention
                queries[layer] = q[0, :, 0].float()
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            model.decode_step(token, cache, record)
            T = cache.length
            for layer in range(L):
                q, k = queries[layer], cache.k[layer, 0, :, :T]
                log_local, log_bulk = oracle_log_masses(all_scores(q, k), N_SINK, N_LOCAL)
                mu_p, cov_p = mean_cov(k[:, N_SINK:bulk_end(T, N_SINK, N_LOCAL)])
                mu_r, cov_r = rw.mean_cov(layer, k)
                qg = q.view(mu_p.shape[0], -1, D)  # (Hkv, G, D)
                d_mean = (qg * (mu_r - mu_p)[:, None]).sum(-1).flatten() / math.sqrt(D)
                d_var = torch.einsum("hgd,hde,hge->hg", qg, cov_r - cov_p, qg).flatten() / (2 * D)
                rows.append(dict(layer=layer,
                                 err_rw=gaussian_log_bulk(q, gaussian_form(mu_r, cov_r), T - N_LOCAL) - log_bulk,
                                 err_exact=gaussian_log_bulk(q, gaussian_form(mu_p, cov_p), T - N_LOCAL) - log_bulk,
                                 d_mean=d_mean, d_var=d_var, margin=log_local - log_bulk))
    third = (L - 1) / 3
    groups = [("layer 0", [0])] + [(f"layers {a}-{b - 1}", list(range(a, b))) for a, b in
                                   ((1, 1 + round(third)), (1 + round(third), 1 + round(2 * third)),
                                    (1 + round(2 * third), L))]
    script = Path(__file__).relative_to(Path(__file__).resolve().parents[2])
    print(f"# Random-words moments against the prompt's own, first decode step\n\n`python {script} "
          f"--threads {threads}`: Qwen2.5-Coder-0.5B bf16, {length} tokens, tasks {', '.join(tasks)}, "
          f"{samples} samples each; "
          f"means over (sample, layer, query head). Signed errors are estimate - true log bulk mass (below 0: bulk "
          f"underestimated, heads wrongly local); the gap rw - exact = mean term + variance term.\n")
    print("| layers | error, random-words moments | error, exact moments | gap rw - exact | mean term | variance term "
          "| log A_local - log A_bulk |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, layers in groups:
        sel = [r for r in rows if r["layer"] in layers]
        m = {key: float(torch.cat([r[key] for r in sel]).mean())
             for key in ("err_rw", "err_exact", "d_mean", "d_var", "margin")}
        print(f"| {name} | {m['err_rw']:+.2f} | {m['err_exact']:+.2f} | {m['err_rw'] - m['err_exact']:+.2f} | "
              f"{m['d_mean']:+.2f} | {m['d_var']:+.2f} | {m['margin']:+.2f} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tasks", default="niah_multikey_2,niah_single_3")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--length", type=int, default=8192)
    a = p.parse_args()
    main(a.threads, a.tasks.split(","), a.samples, a.length)
