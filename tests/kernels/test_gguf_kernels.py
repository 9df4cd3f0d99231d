"""The GGUF block kernels on CUDA (kernels/gguf.py: the GEMV, the tensor-core matmul, the rows
gather) and their format (layers/quant/gguf_cuda.py) against ggml's own decoding: gguf-py's
(layers/quant/ggml.py) weight in float32 times x. Every type, random bytes in the file's
block layout (every bit pattern of the values) and, where gguf-py quantizes the type, a
weight quantized by it; odd shapes (rows 1, 3 and 33; N no multiple of a tile; K of several
blocks, its last step of groups cut short), the bias, the fused prologues, q|k|v stacked and
mixed, a tensor-parallel rank's columns, the embedding and a head tied to it. CPU: Triton's
interpreter; `-m gpu`: CUDA, and the kernels at Llama-3.1-8B's shapes, in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")

from ggml_blocks import QUANTIZABLE, quantized_blocks, random_blocks  # noqa: E402
from graph_replay import assert_graph_replays  # noqa: E402
from hopper_compile import run_compile_script  # noqa: E402

from ember.kernels import cpu as cpu_kernels  # noqa: E402
from ember.kernels.gguf import gguf_gemv, gguf_matmul, gguf_rows  # noqa: E402
from ember.kernels.gguf_gemv import WORD_TYPES  # noqa: E402
from ember.layers.activation import silu_and_mul  # noqa: E402
from ember.layers.embedding import LMHead, VocabEmbedding  # noqa: E402
from ember.layers.kernel_paths import gemv_on_cpu  # noqa: E402
from ember.layers.linear import MergedLinear  # noqa: E402
from ember.layers.norm import RMSNorm  # noqa: E402
from ember.layers.quant.gguf_blocks import KERNEL_TYPES, BlockTensor  # noqa: E402
from ember.layers.quant.gguf_cuda import GGUFCudaBlocks, GGUFPlanes  # noqa: E402
from ember.layers.quant.split import Split  # noqa: E402

T = gguf.GGMLQuantizationType
TYPES = [T(q) for q in KERNEL_TYPES]
DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


@pytest.fixture(autouse=True)
def plain_torch_reference():
    with cpu_kernels.disabled():
        yield


def blocks(qtype: T, n: int, k: int, seed: int, device: str = "cpu", quantized: bool = False) -> BlockTensor:
    raw = (quantized_blocks if quantized else random_blocks)(qtype, n, k, seed)
    return BlockTensor(int(qtype), (n, k), torch.from_numpy(raw).to(device))


def _k(qtype: T, blocks_: int) -> int:
    return blocks_ * gguf.GGML_QUANT_SIZES[qtype][0]


def _assert_close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """Within rel of the output's largest magnitude: random-byte K-quant weights reach the thousands."""
    err = (got.float().cpu() - want).abs().max().item() / want.abs().max().item()
    assert err < rel, err


def _sources(qtype: T) -> list[bool]:
    return [False, True] if qtype in QUANTIZABLE else [False]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_are_ggml_s_values_bit_for_bit(device, qtype):
    """The gather an embedding looks up with: ggml's float32 values, rounded once to the dtype."""
    for quantized in _sources(qtype):
        t = blocks(qtype, 37, _k(qtype, 3), int(qtype), device, quantized)
        want = t.dequantize()
        planes = GGUFPlanes.from_blocks(t).kernel_args()
        ids = torch.tensor([[0, 36, 17], [15, 16, 17]], device=device)
        got = gguf_rows(ids, int(qtype), planes, 37, t.shape[1], torch.float32)
        assert got.shape == (2, 3, t.shape[1]) and torch.equal(got.cpu(), want[ids.cpu()])
        whole = gguf_rows(torch.arange(37, device=device), int(qtype), planes, 37, t.shape[1], torch.bfloat16)
        assert torch.equal(whole.cpu(), want.to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gemv_and_matmul_are_x_times_the_dequantized_weight(device, qtype):
    """float32 x: the sums' order alone (per-value GEMV: float32 products; the word GEMV of
    gguf_gemv.py's types: float32 but the dot factored, scales once a sub-block; matmul: IEEE
    tl.dot), 1 to 4 rows; bfloat16 x (the matmul rounds the weight to bfloat16): 2^-8 of the
    output's scale. The word GEMV's types through the per-value kernel too."""
    n = 37
    k = _k(qtype, 17 if qtype < T.Q4_K else 3)  # 17 or 24 groups: two steps of 16 groups, the last cut short
    g = torch.Generator().manual_seed(int(qtype))
    t = blocks(qtype, n, k, int(qtype) + 1, device)
    w = t.dequantize()
    planes = GGUFPlanes.from_blocks(t).kernel_args()
    bias = torch.randn(n, generator=g)
    words = int(qtype) in WORD_TYPES
    gemv_config = ((16, 16, 4, 1) if words else (16, 16, 4)) if device == "cpu" else None  # several steps
    for rows in (1, 2, 3, 4) if words else (1, 3):
        x = torch.randn(rows, k, generator=g)
        got = gguf_gemv(x.to(device), int(qtype), planes, n, bias.to(device), config=gemv_config)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        _assert_close(got, F.linear(x, w, bias), 1e-5)
    if words:
        got = gguf_gemv(x[:1].to(device), int(qtype), planes, n, bias.to(device), per_value=True,
                        config=(16, 16, 4) if device == "cpu" else None)
        _assert_close(got, F.linear(x[:1], w, bias), 1e-5)
    x = torch.randn(33, k, generator=g)
    config = (64, 64, 16, 4, 1) if device == "cpu" else None
    _assert_close(gguf_matmul(x.to(device), int(qtype), planes, n, bias.to(device), config), F.linear(x, w, bias), 1e-5)
    xb = x.to(torch.bfloat16)
    got = gguf_matmul(xb.to(device), int(qtype), planes, n, None, config)
    assert got.dtype == torch.bfloat16
    _assert_close(got, F.linear(xb.float(), w), 4e-3)
    assert gguf_matmul(x[:0].to(device), int(qtype), planes, n).shape == (0, n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [T(q) for q in WORD_TYPES], ids=lambda t: t.name)
def test_word_gemv_is_within_float32_roundings_of_the_exact_dot(device, qtype):
    """The word GEMV's contract, each output against the exact (float64) dot over ggml's values:
    |y - x w| <= 2^-20 sum_k |x_k| |w_k| (the factored dot's few float32 roundings; 2^-24 is one),
    at 1 to 4 rows, on random bytes (their terms cancel) and gguf-py's quantized weights."""
    n, k = 37, _k(qtype, 17 if qtype < T.Q4_K else 3)
    g = torch.Generator().manual_seed(int(qtype) + 2)
    for quantized in _sources(qtype):
        t = blocks(qtype, n, k, int(qtype) + 3, device, quantized)
        w = t.dequantize().double()
        planes = GGUFPlanes.from_blocks(t).kernel_args()
        for rows in (1, 4):
            x = torch.randn(rows, k, generator=g)
            got = gguf_gemv(x.to(device), int(qtype), planes, n, config=(16, 16, 4, 1) if device == "cpu" else None)
            bound = 2.0 ** -20 * (x.abs().double() @ w.abs().T)
            assert ((got.cpu().double() - x.double() @ w.T).abs() <= bound).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [T.Q5_K, T.Q5_0, T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_gemv_prologues_equal_the_plain_ops_then_the_layer(device, qtype):
    """The norm (with the residual, which comes back as h) and SiLU fused into the GEMV (the
    per-value kernel: Q5_K, Q5_0; the others the word kernel, its 3 rows in one program), as
    kernels/gemv.py's: the same roundings as layers/norm.py and silu_and_mul."""
    dtype, n, k = torch.bfloat16, 40, _k(qtype, 2 if qtype >= T.Q4_K else 16)
    t = blocks(qtype, n, k, 3, device)
    w = t.dequantize()
    planes = GGUFPlanes.from_blocks(t).kernel_args()
    g = torch.Generator().manual_seed(4)
    norm = RMSNorm(k, 1e-6).to(dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    x, res = (torch.randn(3, k, generator=g).to(dtype) for _ in range(2))
    want_h, want_res = norm(x, res.clone())
    y, h = gguf_gemv(x.to(device), int(qtype), planes, n, None, "norm", res.to(device), norm.weight.to(device), 1e-6)
    assert torch.equal(h.cpu(), want_res)
    _assert_close(y, F.linear(want_h.float(), w), 1e-2)
    y, h = gguf_gemv(x.to(device), int(qtype), planes, n, None, "norm", None, norm.weight.to(device), 1e-6)
    assert torch.equal(h.cpu(), x)  # no residual: x itself
    _assert_close(y, F.linear(norm(x).float(), w), 1e-2)
    gate_up = torch.randn(1, 2 * k, generator=g).to(dtype)
    got = gguf_gemv(gate_up.to(device), int(qtype), planes, n, None, "silu")
    _assert_close(got, F.linear(silu_and_mul(gate_up).float(), w), 1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_merged_layer_stacks_one_type_splits_mixed_ones_and_a_rank_takes_whole_blocks(device):
    """q|k|v of one type: one format over the stacked rows; a Q6_K v beside Q4_K q and k (a Q4_K_M
    file): a Split of the formats. A tensor-parallel rank's columns (whole super-blocks) give its
    columns of the weight. The path follows the rows (GEMV up to 4, matmul beyond)."""
    k = 256
    shards = [blocks(T.Q4_K, 32, k, 1, device), blocks(T.Q4_K, 16, k, 2, device), blocks(T.Q6_K, 16, k, 3, device)]
    same = [shards[0], shards[1], blocks(T.Q4_K, 16, k, 4, device)]
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(64, generator=g)
    with gemv_on_cpu():
        for parts, kinds in [(same, GGUFCudaBlocks), (shards, Split)]:
            layer = MergedLinear(k, [32, 16, 16], bias=True).to(device)
            layer.bias.data.copy_(bias)
            for i, s in enumerate(parts):
                layer.load_blocks(s, i)
            layer.finish_loading()
            assert isinstance(layer.format, kinds) and layer.weight.device.type == "meta"
            w = torch.cat([s.dequantize() for s in parts])
            for rows in (1, 5):
                x = torch.randn(rows, k, generator=g)
                _assert_close(layer(x.to(device)), F.linear(x, w, bias), 1e-5)
        wide = blocks(T.Q6_K, 16, 3 * k, 5, device)  # a row-parallel layer's input split among 3 ranks
        fmt = GGUFCudaBlocks(wide.narrow(1, k, k))
        x = torch.randn(2, k, generator=g)
        _assert_close(fmt.apply(x.to(device)), x @ wide.dequantize()[:, k:2 * k].T, 1e-5)
        with pytest.raises(ValueError, match=r"columns \[128, 384\) of a Q6_K weight cut its blocks of 256"):
            wide.narrow(1, 128, 256)
    if device == "cpu":  # off the CUDA paths (without gemv_on_cpu): F.linear on the dequantized weight
        assert fmt.uses_gemv(x) is False
        torch.testing.assert_close(fmt.apply(x), x @ wide.dequantize()[:, k:2 * k].T)


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_looks_rows_up_and_a_tied_head_multiplies_the_same_blocks(device):
    """The default model's layout: a Q8_0 token embedding tied to the LM head."""
    vocab, hidden = 300, 64
    t = blocks(T.Q8_0, vocab, hidden, 6, device, quantized=True)
    w = t.dequantize()
    with gemv_on_cpu(), torch.device(device):
        embed = VocabEmbedding(vocab, hidden)
        head = LMHead(vocab, hidden, tied_to=embed)
        embed.load_blocks(t)
        assert isinstance(embed.blocks, GGUFCudaBlocks) and embed.weight.device.type == "meta"
        ids = torch.tensor([[3, 299, 0, 3]])
        assert torch.equal(embed(ids).cpu(), w[ids.cpu()])
        for rows in (1, 6):
            hidden_states = torch.randn(rows, hidden)
            _assert_close(head(hidden_states), hidden_states.cpu() @ w.T, 1e-5)
    assert embed.blocks.nbytes == t.data.nbytes  # Q8_0: the file's bytes


def test_planes_hold_the_file_s_bytes_but_the_unpacked_k_scales():
    n = 3
    for qtype in TYPES:
        t = blocks(qtype, n, _k(qtype, 2), 7)
        extra = 2 * 4 * n if qtype in (T.Q4_K, T.Q5_K) else 0  # 12 bytes of 6-bit scales become 16, a block
        assert GGUFCudaBlocks(t).nbytes == t.data.nbytes + extra, qtype.name
    with pytest.raises(ValueError, match=r"GGML type 12 planes of 8 rows of 300 values \(a multiple of 256\)"):
        gguf_matmul(torch.randn(2, 300), 12, GGUFPlanes.from_blocks(blocks(T.Q4_K, 8, 512, 1)).kernel_args(), 8)
    with pytest.raises(ValueError, match="the GGUF GEMV takes 1 to 4 rows, got 5"):
        gguf_gemv(torch.randn(5, 512), 12, GGUFPlanes.from_blocks(blocks(T.Q4_K, 8, 512, 1)).kernel_args(), 8)


# Llama-3.1-8B's linear layers: q|k|v, o, gate|up, down
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_llama_8b_shapes_on_the_gpu(n, k, qtype):
    """bf16 activations at decode (GEMV, 1 and 4 rows) and prefill (16 .. 512 rows) sizes against
    the float32 matmul over ggml's dequantized weight."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    t = blocks(qtype, n, k, 8, "cuda", quantized=qtype in QUANTIZABLE)
    layer = GGUFCudaBlocks(t)
    dense = t.dequantize().cuda()
    assert torch.equal(layer.dequantize(torch.float32), dense)
    g = torch.Generator(device="cuda").manual_seed(9)
    for rows in (1, 4, 16, 64, 512):
        x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
        want = F.linear(x.float(), dense)
        err = (layer.apply(x).float() - want).abs().max().item() / want.abs().max().item()
        print(f"{qtype.name} [{n}, {k}] x {rows} rows: max |diff| / max |y| = {err:.2e}")
        assert err < 1e-2


@pytest.mark.gpu
def test_gguf_layer_in_a_cuda_graph_replays_as_run():
    """No host sync, no shape-dependent surprise: the GEMV (1 row) and the matmul (64 rows) of Q4_K
    and Q6_K, and the rows gather, captured and replayed on new inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for qtype in (T.Q4_K, T.Q6_K):
        layer = GGUFCudaBlocks(blocks(qtype, 4096, 4096, 10, "cuda"))
        for rows in (1, 64):
            x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
            assert_graph_replays(lambda: layer.apply(x), [x], [torch.randn_like(x)])
        ids = torch.randint(0, 4096, (8,), device="cuda")
        assert_graph_replays(lambda: layer.rows(ids, torch.bfloat16), [ids], [torch.randint_like(ids, 4096)])


_COMPILE = """
import re
import sys

import triton

sys.path.insert(0, "tests/kernels")
from hopper_compile import compile_aligned

from ember.kernels.gguf import SPANS, _gguf_gemv_kernel, _gguf_matmul_kernel, _gguf_rows_kernel, gemv_config, \\
    matmul_config
from ember.kernels.gguf_gemv import TUNED, WORD_TYPES, _gguf_word_gemv_kernel, gguf_word_gemv_config

H100_SHARED = 232448  # bytes of shared memory a program may take on the H100 (sm_90)
PLANES = {2: ("*u8", "*u8", "*fp16", "*fp16", "*u8", "*u8"), 3: ("*u8", "*u8", "*fp16", "*fp16", "*u8", "*u8"),
          6: ("*u8", "*i32", "*fp16", "*fp16", "*u8", "*u8"), 7: ("*u8", "*i32", "*fp16", "*fp16", "*u8", "*u8"),
          8: ("*i8", "*i8", "*fp16", "*fp16", "*i8", "*i8"), 12: ("*u8", "*u8", "*fp16", "*fp16", "*u8", "*u8"),
          13: ("*u8", "*u8", "*fp16", "*fp16", "*u8", "*u8"), 14: ("*u8", "*u8", "*fp16", "*fp16", "*i8", "*i8")}
NAMES = ("q_ptr", "h_ptr", "d_ptr", "m_ptr", "s_ptr", "mn_ptr")
block_n, groups, warps = gemv_config(4096)
block_m, mblock_n, mgroups, mwarps, stages = matmul_config(512)
for qtype, planes in PLANES.items():
    for kernel, constants, options in [
            (_gguf_gemv_kernel, dict(BLOCK_N=block_n, GROUPS=groups, PROLOGUE=1, HAS_RES=True),
             {"num_warps": warps}),
            (_gguf_matmul_kernel, dict(PRECISION="tf32", BLOCK_M=block_m, BLOCK_N=mblock_n, GROUPS=mgroups,
                                       GROUP_M=8), {"num_warps": mwarps, "num_stages": stages}),
            (_gguf_rows_kernel, dict(BLOCK_R=4, GROUPS=32), {"num_warps": 4})]:
        constants = dict(constants, K=4096, QTYPE=qtype, SPAN=SPANS[qtype])
        if kernel is not _gguf_rows_kernel:
            constants["HAS_BIAS"] = True
        compiled = compile_aligned(kernel, constants, dict(zip(NAMES, planes), ids_ptr="*i64", eps="fp32"), options)
        what = f"{kernel.fn.__name__} on GGML type {qtype}"
        assert "st.local" not in compiled.asm["ptx"], f"{what} spills registers to local memory"
        assert compiled.metadata.shared <= H100_SHARED, f"{what}: {compiled.metadata.shared} bytes of shared memory"
        if kernel is _gguf_matmul_kernel:
            assert "mma" in compiled.asm["ptx"], f"{what}: no tensor-core instruction in the PTX"
        else:  # a program's 16 bytes of qs (Q8_0: 16 values) in one load
            assert "ld.global.v4.b32" in compiled.asm["ptx"], f"{what}: the quants are read a byte at a time"
for qtype in WORD_TYPES:
    planes = ("*i32", "*i32") + PLANES[qtype][2:]
    for (n, k), prologue in (((6144, 4096), 1), ((4096, 4096), 0), ((4096, 14336), 2)):
        for rows in (1, 2, 4):
            block_n, block_j, warps, stages = gguf_word_gemv_config(qtype, rows, n, k)
            constants = dict(M=rows, M_PAD=triton.next_power_of_2(rows), K=k, QTYPE=qtype, BLOCK_N=block_n,
                             BLOCK_J=block_j, PROLOGUE=prologue, HAS_RES=prologue == 1, HAS_BIAS=False, STAGES=stages)
            compiled = compile_aligned(_gguf_word_gemv_kernel, constants, dict(zip(NAMES, planes), eps="fp32"),
                                       {"num_warps": warps, "num_stages": stages})
            ptx, what = compiled.asm["ptx"], f"the word GEMV of type {qtype} at [{n}, {k}], {rows} rows"
            assert "st.local" not in ptx, f"{what} spills registers to local memory"
            assert compiled.metadata.shared <= H100_SHARED, f"{what}: {compiled.metadata.shared} bytes of shared"
            # the reasoned tiles pipeline their loads; a measured one (TUNED) may not: 512 words a step
            if (qtype, triton.next_power_of_2(rows), n, k) not in TUNED:
                assert "cp.async.c" in ptx, f"{what}: no load is software-pipelined (cp.async)"
            assert not re.search(r"cvt\\.rn\\.f32\\.[su]32", ptx), f"{what} converts the words to float"
print("compiled")
"""


@pytest.mark.slow
def test_the_kernels_compile_for_hopper():
    """Triton compiles the per-value GEMV (with the norm prologue), the matmul and the rows gather
    of every type at K = 4096 to sm_90 PTX here, without a GPU, at the tiles their wrappers
    launch, and the word GEMV of its types at Llama-3.1-8B's shapes, 1 to 4 rows, each prologue:
    none spills registers, each fits the H100's shared memory, the matmul uses tensor cores, the
    per-value GEMV and the gather read the quants 16 bytes a load, the word GEMV's loads are
    software-pipelined (cp.async) at the tiles reasoned, not measured, and no 32-bit integer is converted to float (the words' values: the
    float trick; only the 8-bit scales convert)."""
    assert "compiled" in run_compile_script(_COMPILE)
