"""Matmul options for SmolLM2-135M's weight shapes on this CPU (one decode step's worth of
linear layers: 30 x (qkv, o, gate_up, down) + the LM head), at batch 1 and 16.

    .venv/bin/python benchmarks/scripts/cpu_matmul.py
"""

import time

import torch

SHAPES = [(1728, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
GROUP = 32


def ms(fn, reps: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1000


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    int4 = [(torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1),
             torch.rand(k // GROUP, n, 2, dtype=torch.bfloat16)) for n, k in SHAPES]
    for dtype in (torch.float32, torch.bfloat16):
        weights = [torch.randn(n, k, dtype=dtype) for n, k in SHAPES]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
        for m in (1, 16):
            xs = {k: torch.randn(m, k, dtype=dtype) for _, k in SHAPES}
            plain = ms(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights])
            onednn = ms(lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                 for w, p in zip(weights, packed)])
            line = f"{str(dtype):15} batch {m:2}: F.linear {plain:6.1f} ms, oneDNN prepacked {onednn:6.1f} ms"
            if dtype == torch.bfloat16:
                q4 = ms(lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k], w, GROUP, sz)
                                 for (w, sz), (_, k) in zip(int4, SHAPES)])
                line += f", int4 weight-only {q4:6.1f} ms"
            print(line)


if __name__ == "__main__":
    main()
