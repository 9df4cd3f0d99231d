"""Decode attention with a bfloat16 vs an fp8 KV cache at the benchmark shapes, the default
kernel config (DECODE_CONFIG): time and KV bandwidth per step of one layer.
`python3 benchmarks/scripts/decode_fp8.py`"""

import torch
from triton.testing import do_bench

from decode_sweep import SHAPES, case
from ember.kernels.decode_attention import decode_attention, num_decode_splits

for name, (batch, heads, kv_heads, lo, hi) in SHAPES.items():
    times = {}
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        q, kc, vc, tables, lens, nbytes = case(batch, heads, kv_heads, lo, hi, kv_dtype=kv_dtype)
        splits = num_decode_splits(batch, kv_heads)
        ms = do_bench(lambda: decode_attention(q, kc, vc, tables, lens, 0.088, splits), warmup=10, rep=50)
        times[kv_dtype] = ms
        print(f"{name}, {str(kv_dtype)[6:]:13s}: {ms * 1e3:8.1f} us  {nbytes / ms / 1e6:6.0f} GB/s")
    print(f"  fp8 / bf16 time: {times[torch.float8_e4m3fn] / times[torch.bfloat16]:.2f}")
