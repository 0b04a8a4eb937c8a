"""fp32 GEMMs on CPU: oneDNN (models/cpu_gemm.py, `model.cpu_gemm`) against PyTorch's own MKL path (the
named baseline), at the shapes a run multiplies, in one process.

- decode: 8 and 32 rows through the 25M model's eight layers' four products (fused q|k|v, o, gate|up, down),
  one layer after another so the weights (100 MB) leave the cache as they do in a decode step; MKL on the
  (out, in) weight's transposed view, on an (in, out) copy and in its packed format (the decoder's choices
  before oneDNN), and oneDNN;
- training: 1,024 rows through the same products, forward (x W^T), input gradient (g W) and weight gradient
  (g^T x);
- the model: the 25M model's forward + backward on 32 x 36 tokens, its linear layers routed or not.

    .venv/bin/python benchmarks/bench_cpu_gemm.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from hybridflow.models import cpu_gemm
from hybridflow.rollout.cpu.mkl_packed import MklPacked, mkl_pack_works

HIDDEN, INTER, KV, LAYERS = 512, 1536, 256, 8  # models/tiny.py "medium"
SHAPES = [(HIDDEN, HIDDEN + 2 * KV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]  # (in, out)


def best(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def layer_pass(weights, fn, loops: int):
    """fn(w) for every layer's every product, `loops` times: one decode step after another."""

    def run():
        for _ in range(loops):
            for layer in weights:
                for w in layer:
                    fn(w)

    return run


def decode_rows(rows: int) -> list[tuple[str, float]]:
    g = torch.Generator().manual_seed(0)
    ws = [[torch.randn(o, i, generator=g) * 0.02 for i, o in SHAPES] for _ in range(LAYERS)]
    x = {i: torch.randn(rows, i, generator=g) for i in (HIDDEN, INTER)}
    flops = 32 * LAYERS * sum(2 * rows * i * o for i, o in SHAPES)
    cands = [("MKL, (out, in).t() view", ws, lambda w: x[w.shape[1]] @ w.t())]
    copies = [[w.t().contiguous() for w in layer] for layer in ws]
    cands.append(("MKL, (in, out) copy", copies, lambda w: x[w.shape[0]] @ w))
    if mkl_pack_works():
        packed = [[(MklPacked(w), w.shape[1]) for w in layer] for layer in ws]
        cands.append(("MKL packed", packed, lambda p: p[0](x[p[1]], None)))
    cands.append(("oneDNN", ws, lambda w: cpu_gemm.matmul(x[w.shape[1]], w)))
    return [(name, flops / best(layer_pass(w, fn, 32))) for name, w, fn in cands]


def training_rows(rows: int = 1024) -> list[tuple[str, float, float]]:
    g = torch.Generator().manual_seed(0)
    ws = [[torch.randn(o, i, generator=g) * 0.02 for i, o in SHAPES] for _ in range(LAYERS)]
    x = {i: torch.randn(rows, i, generator=g) for i in (HIDDEN, INTER)}
    up = {o: torch.randn(rows, o, generator=g) for _, o in SHAPES}
    flops = 4 * LAYERS * sum(2 * rows * i * o for i, o in SHAPES)
    lp = cpu_gemm._mm  # rows already a bucket (1,024)
    pairs = [
        ("forward x W^T", lambda w: F.linear(x[w.shape[1]], w), lambda w: lp(x[w.shape[1]], w)),
        ("input grad g W", lambda w: up[w.shape[0]] @ w, lambda w: lp(up[w.shape[0]], w.t())),
        ("weight grad g^T x", lambda w: up[w.shape[0]].t() @ x[w.shape[1]], lambda w: lp(up[w.shape[0]].t(), x[w.shape[1]].t())),
    ]  # fmt: skip
    return [
        (name, flops / best(layer_pass(ws, a, 4)), flops / best(layer_pass(ws, b, 4))) for name, a, b in pairs
    ]


def model_step() -> tuple[float, float]:
    from hybridflow.models.tiny import build_tiny_model

    plain, routed = (build_tiny_model("medium", "llama", seed=0) for _ in range(2))
    cpu_gemm.use_onednn(routed)
    ids = torch.randint(3, plain.config.vocab_size, (32, 36), generator=torch.Generator().manual_seed(0))

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()

        return run

    return best(step(plain), 3), best(step(routed), 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_gemm.available():
        raise SystemExit("this torch build has no oneDNN linear op")
    print(f"## fp32 GEMMs on CPU, {args.threads} threads: oneDNN against MKL (PyTorch's own path)\n")
    print("| decode rows | kernel | GFLOP/s | / MKL view |\n|---|---|---|---|")
    for rows in (8, 32):
        res = decode_rows(rows)
        base = res[0][1]
        for name, rate in res:
            print(f"| {rows} | {name} | {rate / 1e9:.1f} | {rate / base:.2f}x |")
    print("\n| training, 1,024 rows | MKL GFLOP/s | oneDNN GFLOP/s | **oneDNN / MKL** |\n|---|---|---|---|")
    for name, mkl, dnn in training_rows():
        print(f"| {name} | {mkl / 1e9:.1f} | {dnn / 1e9:.1f} | **{dnn / mkl:.2f}x** |")
    plain, routed = model_step()
    print(
        f"\n25M model forward + backward, 32 x 36 tokens: MKL {plain * 1e3:.0f} ms, oneDNN {routed * 1e3:.0f} ms "
        f"(**{plain / routed:.2f}x**); model.cpu_gemm=auto picks "
        f"{'oneDNN' if cpu_gemm.mkl_slow_path() else 'MKL'} here"
    )


if __name__ == "__main__":
    main()
