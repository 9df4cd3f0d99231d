"""Probe for one request at Llama-8B (goal 4.0 ms a step, ember 4.5): the step's matmuls
read 16 GB at 4.0 TB/s where 4.3 would be needed, because each one pays its ramp and tail
(q|k|v 3.1 TB/s, o 2.8), while between them HBM idles under RoPE, attention and the norms.

l2_prefetch_probe.py warmed the next weight in L2 from the main stream with
prefetch.global.L2 and lost. Here the warming runs on a side stream of the graph, beside
the small kernels, and is joined only before the matmul that needs it:

  A. how fast the matmuls are with their weight already in L2 (hot) and not (cold);
  B. whether a warming kernel (real loads, or prefetch.global.L2) leaves the weight in L2
     for a matmul 10 µs later;
  C. the 8B chain with stand-ins for the small kernels (as l2_prefetch_probe.py), with o's
     weight (and the first part of gate|up's) warmed on the side stream.

`python3 benchmarks/scripts/l2_warm_probe.py` (CUDA)."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ember.kernels.gemv import gemv
from l2_prefetch_probe import prefetch_l2
from step_chain import HIDDEN, INTER, QKV, Spinner, layer_weights


@triton.jit
def _warm_kernel(w_ptr, sink_ptr, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program p reads elements [p * CHUNK, (p + 1) * CHUNK) of w, kept in L2 (evict_last);
    the sum only keeps the loads alive (stored where it can never be)."""
    base = tl.program_id(0).to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, CHUNK, BLOCK):
        offs = base + i + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
    total = tl.sum(acc, 0)
    tl.store(sink_ptr, total, mask=total == 12345.678)


def warm(w: torch.Tensor, sink: torch.Tensor, how: str, programs: int, fraction: float = 1.0) -> None:
    n = int(w.numel() * fraction)
    if how == "load":
        chunk = triton.cdiv(triton.cdiv(n, programs), 4096) * 4096
        _warm_kernel[(triton.cdiv(n, chunk),)](w, sink, n, CHUNK=chunk, BLOCK=4096, num_warps=8)
    else:
        prefetch_l2(w, fraction)


def main() -> None:
    from gemv_bench import time_us

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    sink = torch.zeros(1, device=dev)
    spin = Spinner()

    # A: hot vs cold
    x = torch.randn(1, HIDDEN, device=dev, dtype=dt)
    copies = 20
    ws = {name: [torch.randn(n, HIDDEN, device=dev, dtype=dt) / 64 for _ in range(copies)]
          for name, n in (("o", HIDDEN), ("qkv", QKV))}
    print("A. one matmul, weight in L2 (hot: the same weight each call) or not (cold: 20 copies in turn)")
    for name, fn in (("o, ember gemv", lambda w: gemv(x, w)), ("o, cuBLAS", lambda w: F.linear(x, w)),
                     ("qkv, cuBLAS", lambda w: F.linear(x, w))):
        lst = ws[name.split(",")[0]]
        hot = time_us(lambda i: fn(lst[0]), copies=1)
        cold = time_us(lambda i: fn(lst[i]), copies=copies)
        print(f"   {name:15s} hot {hot:6.1f} us   cold {cold:6.1f} us", flush=True)

    # B: does a warming kernel leave the weight in L2 for a matmul 10 µs later?
    print("B. warm W_o, spin 10 us, then the o matmul (ember gemv); copies in turn, so cold otherwise")
    wo = ws["o"]
    base = time_us(lambda i: spin(10.0), copies=1)
    for how, programs in (("none", 0), ("load", 132), ("load", 264), ("load", 528), ("prefetch", 0)):
        def seq(i, with_gemv):
            if how != "none":
                warm(wo[i], sink, how, programs)
            spin(10.0)
            if with_gemv:
                gemv(x, wo[i])
        t_all = time_us(lambda i: seq(i, True), copies=copies)
        t_pre = time_us(lambda i: seq(i, False), copies=copies)
        print(f"   warm {how:8s} {programs:3d} programs: warm + spin {t_pre:6.1f} us (spin alone {base:5.1f}); "
              f"the matmul after it {t_all - t_pre:6.1f} us", flush=True)
    del ws

    # C: the chain, warming on a side stream
    layers = layer_weights(dev=dev, dt=dt)
    nbytes = sum(w.numel() * 2 for l in layers for w in l.values())
    side = torch.cuda.Stream()

    def step(how: str, programs: int, gu_fraction: float) -> torch.Tensor:
        main = torch.cuda.current_stream()
        h = x
        for l in layers:
            spin(2.0)  # the norm
            qkv = F.linear(h, l["qkv"])
            ev_o = ev_gu = None
            if how != "none":
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    warm(l["o"], sink, how, programs)
                    ev_o = torch.cuda.Event()
                    ev_o.record(side)
                    if gu_fraction:
                        warm(l["gate_up"], sink, how, programs, gu_fraction)
                        ev_gu = torch.cuda.Event()
                        ev_gu.record(side)
            spin(9.0)  # RoPE + attention
            if ev_o is not None:
                main.wait_event(ev_o)
            o = gemv(qkv[:, :HIDDEN], l["o"])
            spin(2.0)  # the norm
            if ev_gu is not None:
                main.wait_event(ev_gu)
            gu = F.linear(o, l["gate_up"])
            spin(1.6)  # SiLU
            h = F.linear(gu[:, :INTER], l["down"])
        if how != "none":  # join only a side stream that this capture forked
            main.wait_stream(side)
        return h

    print("C. the 8B chain with stand-ins; o's weight (and a part of gate|up's) warmed on a side stream")
    ref = step("none", 0, 0.0).float()
    for how, programs, gu in (("none", 0, 0.0), ("load", 66, 0.0), ("load", 132, 0.0), ("load", 264, 0.0),
                              ("prefetch", 0, 0.0), ("load", 132, 0.1), ("load", 132, 0.2)):
        try:
            us = time_us(lambda i: step(how, programs, gu), copies=1, reps=1)
            same = torch.equal(step(how, programs, gu).float(), ref)
            print(f"   warm {how:8s} {programs:3d} programs, gate|up {gu:.1f}: {us:8.1f} us a step "
                  f"({nbytes / us / 1e6:5.2f} TB/s of weights), same output {same}", flush=True)
        except Exception as e:
            print(f"   warm {how} {programs} {gu}: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
