"""The GGUF GEMVs' sm_90 machine code, counted without a GPU: kernels/gguf.py's per-value kernel
and kernels/gguf_gemv.py's word kernel, compiled by Triton for GPUTarget("cuda", 90, 32) at
K = 4096 (N = 4096) and the tiles their config functions pick, for each type the word kernel
takes, at 1 and 4 rows of x. Printed per type and rows: SASS instructions and barriers a weight
value in the main loop (its body over the values a thread takes a step; the per-value kernel
runs a program a row of x, so its 4 rows cost 4 times its one), registers a thread, spills
(local memory) and shared memory a program.
`python3 benchmarks/scripts/gguf_gemv_sass.py [--prologue norm|silu]` (from the repository root)"""

import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ember.kernels.gemv import PROLOGUES  # noqa: E402
from ember.kernels.gguf import SPANS, _gguf_gemv_kernel, gemv_config  # noqa: E402
from ember.kernels.gguf_gemv import WORD_TYPES, _gguf_word_gemv_kernel, gguf_word_gemv_config  # noqa: E402

NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}
N = K = 4096
PLANES = ("q_ptr", "h_ptr", "d_ptr", "m_ptr", "s_ptr", "mn_ptr")


def compile_kernel(kernel, constants: dict, planes: tuple, warps: int, stages: int = 3):
    """The kernel compiled for sm_90 at these constexprs, bf16 x and y."""
    names = list(kernel.arg_names)
    types = dict(zip(PLANES, planes), eps="fp32")
    signature = {a: "constexpr" if a in constants else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
                 for a in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
               if a.endswith("_ptr") or a.startswith("stride")}
    source = ASTSource(kernel, signature, {(names.index(c),): v for c, v in constants.items()}, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def sass_lines(compiled) -> list[tuple[int, str]]:
    """(address, instruction) of the cubin's SASS."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.check_output([knobs.nvidia.cuobjdump.path, "-sass", f.name], text=True)
    found = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", out)
    return [(int(a, 16), ins.strip()) for a, ins in found]


def main_loop(lines: list[tuple[int, str]]) -> list[str]:
    """The instructions of the longest loop: from a backward branch's target to the branch."""
    best: list[str] = []
    for address, ins in lines:
        hit = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", ins)
        if hit and hit.group(1) and int(hit.group(1), 16) < address:
            body = [i for a, i in lines if int(hit.group(1), 16) <= a <= address]
            best = max(best, body, key=len)
    return best


def count(compiled, values_a_step: int, warps: int) -> dict:
    body = main_loop(sass_lines(compiled))
    per_thread = values_a_step / (32 * warps)
    ptx = compiled.asm["ptx"]
    return {"ins": len(body) / per_thread, "bar": sum("BAR" in i for i in body) / per_thread,
            "regs": compiled.metadata.num_regs if hasattr(compiled.metadata, "num_regs") else regs(compiled),
            "spills": "st.local" in ptx or "STL" in " ".join(i for _, i in sass_lines(compiled)),
            "shared": compiled.metadata.shared}


def regs(compiled) -> int:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.check_output([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], text=True)
    return int(re.search(r"REG:(\d+)", out).group(1))


def planes_of(qtype: int, words: bool) -> tuple:
    """kernels/gguf.py's planes as the kernel reads them (the word kernel: qs and qh as int32)."""
    sc = "*i8" if qtype == 14 else "*u8"
    if words:
        return ("*i32", "*i32", "*fp16", "*fp16", sc, "*u8")
    return ("*i8" if qtype == 8 else "*u8", "*u8", "*fp16", "*fp16", sc, "*u8")


def main() -> None:
    prologue = sys.argv[sys.argv.index("--prologue") + 1] if "--prologue" in sys.argv else "none"
    common = dict(K=K, PROLOGUE=PROLOGUES[prologue], HAS_RES=False, HAS_BIAS=False)
    print(f"prologue {prologue}, N = K = {N}: instructions / barriers a weight value in the main loop")
    print(f"{'type':5s} {'rows':>4s} | {'per-value kernel (tile)':34s} | {'word kernel (tile)':40s}")
    for qtype in WORD_TYPES:
        block_n, groups, warps = gemv_config(N)
        old = compile_kernel(_gguf_gemv_kernel, dict(common, QTYPE=qtype, SPAN=SPANS[qtype], BLOCK_N=block_n,
                                                     GROUPS=groups), planes_of(qtype, False), warps)
        o = count(old, block_n * groups * 32, warps)
        for rows in (1, 4):
            block_n, block_j, wwarps, stages = gguf_word_gemv_config(qtype, rows, N, K)
            per = {8: 4, 14: 16}.get(qtype, 8)
            new = compile_kernel(_gguf_word_gemv_kernel,
                                 dict(common, M=rows, M_PAD=triton.next_power_of_2(rows), QTYPE=qtype,
                                      BLOCK_N=block_n, BLOCK_J=block_j, STAGES=stages),
                                 planes_of(qtype, True), wwarps, stages)
            w = count(new, block_n * block_j * per, wwarps)
            old_text = (f"{rows * o['ins']:5.2f} ins {rows * o['bar']:5.3f} bar {o['regs']:3d} regs "
                        f"{'SPILLS' if o['spills'] else ''}")
            print(f"{NAMES[qtype]:5s} {rows:4d} | {old_text:34s} | {w['ins']:5.2f} ins {w['bar']:5.3f} bar "
                  f"{w['regs']:3d} regs {w['shared']:6d} B shared {'SPILLS' if w['spills'] else 'no spills'} "
                  f"({block_n}, {block_j}, {wwarps}, {stages})")


if __name__ == "__main__":
    main()
