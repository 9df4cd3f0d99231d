"""Offline (no GPU): compile the decode split kernel for sm_90 per variant@BLOCK_N,warps,stages and
count its shared-memory / mma instructions in the PTX (fp8 cache, bf16 queries, GROUP 2).
`python3 benchmarks/scripts/decode_ptx_stats.py plain@128,4,4 vreg@128,4,4 ka+vreg@128,4,4`"""
import sys, time, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
import ember.kernels.decode_attention as da

def build(variant, bn, nw, ns, fp8=True, group=2, splits=1):
    fn = da._decode_split_kernel
    kv = "*fp8e4nv" if fp8 else "*bf16"
    sig = dict(q_ptr="*bf16", k_cache_ptr=kv, v_cache_ptr=kv, tables_ptr="*i32", seq_lens_ptr="*i32",
               o_ptr="*bf16" if splits == 1 else "*fp32", lse_ptr="*bf16" if splits == 1 else "*fp32",
               k_scale_ptr="*fp32", v_scale_ptr="*fp32", scale_log2="fp32", stride_qt="i32", stride_qh="i32",
               stride_tb="i32", stride_cb="i32", stride_cs="i32", stride_ch="i32", stride_ob="i32", stride_oh="i32",
               stride_os="i32")
    flags = {flag: name in variant.split("+") for name, flag in da.VARIANT_FLAGS.items()}
    consts = dict(GROUP=group, BLOCK_H=16, D=128, BLOCK_N=bn, PAGE=16, NUM_SPLITS=splits, FP8=fp8, DOT_FP16=fp8, **flags)
    for k, v in consts.items():
        sig[k] = "constexpr"
    # divisibility by 16 like the JIT's specialization of pointers and the strides
    div = [["tt.divisibility", 16]]
    attrs = {(fn.arg_names.index(n),): div for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "tables_ptr", "seq_lens_ptr",
             "o_ptr", "lse_ptr", "k_scale_ptr", "v_scale_ptr", "stride_qt", "stride_qh", "stride_cb", "stride_cs",
             "stride_ch", "stride_ob", "stride_oh")}
    src = ASTSource(fn, sig, consts, attrs)
    t = time.time()
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=nw, num_stages=ns))
    return k, time.time() - t

for spec in sys.argv[1:]:
    var, cfg = spec.split("@")
    bn, nw, ns = map(int, cfg.split(","))
    var = "" if var == "plain" else var
    try:
        k, dt = build(var, bn, nw, ns)
        ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
        n = lambda pat: len(re.findall(pat, ptx))
        print(f"{spec:28s} {dt:4.1f}s smem {k.metadata.shared:6d} regs {k.n_regs if hasattr(k,'n_regs') else '?'} "
              f"wgmma {n(r'wgmma.mma_async')} mma.sync {n(r'mma.sync')} ldmatrix {n(r'ldmatrix')} "
              f"ld.shared {n(r'ld.shared')} st.shared {n(r'st.shared')} cvt.e4m3 {n(r'cvt.rn.f16x2.e4m3x2')} "
              f"cp.async {n(r'cp.async.cg|cp.async.ca')} ptx_lines {ptx.count(chr(10))}", flush=True)
        open(f"/tmp/decode_{spec.replace('+','_').replace('@','_').replace(',','_')}.ttgir", "w").write(ttgir)
        open(f"/tmp/decode_{spec.replace('+','_').replace('@','_').replace(',','_')}.ptx", "w").write(ptx)
    except Exception as e:
        print(f"{spec:28s} FAILED {type(e).__name__}: {str(e)[-300:]}", flush=True)
