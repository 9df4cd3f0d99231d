"""GGUF dequantization on this CPU: ember's torch decoders (`ember.loader.gguf.dequantize`)
against gguf-py's numpy ones (`gguf.quants.dequantize`), per type and tensor shape. Both
give the same float32 bits (checked here too); the faster one per type is what ember should use.

    .venv/bin/python benchmarks/scripts/dequant_cpu.py [--reps 7]

Each time is the best of `reps` calls (the machine is shared; the best is the least
disturbed), from the stored bytes to a float32 torch tensor of the PyTorch shape. Last,
all 272 tensors of the default model (SmolLM2-135M Q4_1: Q4_1, Q8_0 and F32 tensors).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
import warnings
from importlib.metadata import version

import gguf
import numpy as np
import torch

from ember.loader.default_model import fetch_default_model
from ember.loader.gguf import GGUFFile, dequantize

Q = gguf.GGMLQuantizationType
TYPES = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]
SHAPES = [(576, 1536), (4096, 4096)]  # SmolLM2-135M's down_proj; a Llama-3-8B square projection


def best_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # gguf-py's read-only results


def gguf_py(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)).reshape(shape)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), numpy {np.__version__}, "
          f"gguf-py {version('gguf')}")
    print(f"{'type':5} {'shape':>10} {'ember ms':>9} {'gguf-py ms':>10} {'gguf-py/ember':>13}")
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        values = rng.standard_normal(shape).astype(np.float32)
        for qtype in TYPES:
            raw = gguf.quants.quantize(values, qtype)
            ours, theirs = dequantize(raw, qtype, shape), gguf_py(raw, qtype, shape)
            assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), qtype.name
            a = best_ms(lambda: dequantize(raw, qtype, shape), args.reps)
            b = best_ms(lambda: gguf_py(raw, qtype, shape), args.reps)
            print(f"{qtype.name:5} {shape[0]:>4}x{shape[1]:<5} {a:9.2f} {b:10.2f} {b / a:12.1f}x")
    f = GGUFFile(fetch_default_model())
    infos = [f.tensor_info(n) for n in f.tensor_names]
    raws = [f.raw(n) for n in f.tensor_names]
    a = best_ms(lambda: [dequantize(r, i.qtype, i.shape) for r, i in zip(raws, infos)], args.reps)
    b = best_ms(lambda: [gguf_py(r, gguf.GGMLQuantizationType(i.qtype), i.shape) for r, i in zip(raws, infos)], args.reps)
    print(f"the default model, {len(infos)} tensors: ember {a:.0f} ms, gguf-py {b:.0f} ms ({b / a:.1f}x)")


if __name__ == "__main__":
    main()
