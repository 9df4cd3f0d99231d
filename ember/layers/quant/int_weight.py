"""Integer weights with group scales (W4A16, W8A16): what AWQ, GPTQ and compressed-tensors
pack-quantized checkpoints hold, each read into one layout here (layers/quant/awq.py,
gptq.py, compressed_tensors.py do the reading):

    W[n, k] = (q[n, k] - zeros[n, g(k)]) * scales[n, g(k)]

    qweight  int32 [N, ceil(K / per)]   per = 32 / bits unsigned values a word along K, value k
                                        at bits (k % per) * bits (little-endian; compressed-
                                        tensors' own layout, padded with zeros)
    scales   [N, G]                     float16 / bfloat16 / float32 as the checkpoint stores them
    zeros    uint8 [N, G] or None       None: 2^(bits - 1) (symmetric)
    g_idx    int32 [K] or None          column k's group (GPTQ's act-order); None: k // group_size

    IntTensor     one weight so (narrow for tensor-parallel ranks, stack for merged layers)
    IntWeight     the format on CUDA: the Triton kernels dequantize in registers
                  (kernels/wna16.py for many rows, kernels/int_gemv.py's GEMV for a few;
                  act-order weights sorted by group where the GEMV's word kernel then takes
                  them, x's columns read in the order taken)
    int_format    the format a layer takes: IntWeight on CUDA; on the CPU the same numbers as
                  GGUF blocks where they are exactly one (cpu_blocks), else dequantized at load

The CPU mapping (cpu_blocks): with a group size a multiple of 32, every GGUF block of 32
values lies in one group, and
    4 bits, symmetric (zero 8)   w = (q - 8) * s         is Q4_0 with d = s, exactly
    4 bits, zero points          w = q * s - z * s       is Q4_1 with d = s, m = -z * s rounded
                                                         to float16 (the one rounding; a weight
                                                         moves by at most half an ulp of z * s)
    8 bits, symmetric (zero 128) w = (q - 128) * s       is Q8_0 with d = s, exactly
The scales must be float16 values (AWQ's and GPTQ's are; bfloat16 ones are within float16's
range). Act-order weights (g_idx) whose groups each hold group_size columns are sorted by group
at load, and the layer permutes x's columns to match at run time (PermutedInput). What maps to
no block type (8 bits with zero points, groups not a multiple of 32, act-order groups of
uneven sizes) is dequantized to the run dtype at load, named in one log line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ember.layers.kernel_paths import cuda_paths, uses_int_gemv
from ember.layers.quant import KernelFormat, WeightFormat
from ember.layers.quant.gguf_blocks import BlockTensor, GGUFBlocks
from ember.layers.quant.split import Dense

logger = logging.getLogger(__name__)

BITS = (4, 8)
GGUF_BLOCK = 32  # values a GGUF block; a group size must be a multiple for the CPU mapping


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W * 32 / bits]: value j of word w at bits j * bits, little-endian."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    values = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2).to(torch.uint8)


def pack_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., K] (each < 2^bits) -> int32 [..., ceil(K * bits / 32)], padded with zeros:
    the inverse of unpack_words."""
    per = 32 // bits
    k = values.shape[-1]
    padded = F.pad(values.to(torch.int64), (0, _cdiv(k, per) * per - k)).unflatten(-1, (-1, per))
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    words = (padded << shifts).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


@dataclass(frozen=True)
class IntTensor:
    """A weight W [N, K] of `bits`-bit integers with a scale (and zero) a group of columns."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    bits: int
    group_size: int  # columns a group; in_features for one group a row
    in_features: int

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"{self.bits}-bit integer weights are not supported: ember takes {BITS}")
        n, k = self.qweight.shape[0], self.in_features
        words = _cdiv(k, 32 // self.bits)
        if self.qweight.dtype != torch.int32 or tuple(self.qweight.shape) != (n, words):
            raise ValueError(f"a {self.bits}-bit weight [{n}, {k}] packs into int32 [{n}, {words}]; got "
                             f"{self.qweight.dtype} {tuple(self.qweight.shape)}")
        groups = self.scales.shape[1] if self.scales.dim() == 2 else -1
        want = groups if self.g_idx is not None else _cdiv(k, self.group_size)
        if not self.scales.is_floating_point() or tuple(self.scales.shape) != (n, want):
            raise ValueError(f"the scales of a weight [{n}, {k}] in groups of {self.group_size} are float [{n}, "
                             f"{want}]; got {self.scales.dtype} {tuple(self.scales.shape)}")
        if self.zeros is not None and (self.zeros.dtype != torch.uint8 or self.zeros.shape != self.scales.shape):
            raise ValueError(f"zero points are uint8 shaped as the scales {tuple(self.scales.shape)}; got "
                             f"{self.zeros.dtype} {tuple(self.zeros.shape)}")
        if self.g_idx is not None and (self.g_idx.dtype != torch.int32 or tuple(self.g_idx.shape) != (k,)):
            raise ValueError(f"g_idx is int32 [{k}] (a group per input column); got {self.g_idx.dtype} "
                             f"{tuple(self.g_idx.shape)}")

    @staticmethod
    def from_values(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, g_idx: torch.Tensor | None,
                    bits: int, group_size: int) -> IntTensor:
        """From unpacked values q [N, K] (unsigned, < 2^bits); zero points that are all 2^(bits - 1)
        are dropped (symmetric), a g_idx that is k // group_size too; a group size of K or more
        is one group a row."""
        k = q.shape[1]
        if q.numel() and int(q.max()) >= 1 << bits:
            raise ValueError(f"values of {bits} bits are below {1 << bits}; got {int(q.max())}")
        if zeros is not None:
            if int(zeros.max()) >= 1 << bits:
                raise ValueError(f"a zero point of {int(zeros.max())} does not fit {bits} bits")
            zeros = zeros.to(torch.uint8)
            if bool((zeros == 1 << (bits - 1)).all()):
                zeros = None
        group_size = min(group_size, k)
        return IntTensor(pack_words(q, bits), scales.contiguous(), zeros if zeros is None else zeros.contiguous(),
                         act_order(g_idx, k, group_size, scales.shape[1]), bits, group_size, k)

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.in_features

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    def column_groups(self) -> torch.Tensor:
        """int64 [K]: each input column's group."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.qweight.device) // self.group_size

    def values(self) -> torch.Tensor:
        """uint8 [N, K]: the unsigned integers."""
        return unpack_words(self.qweight, self.bits)[:, : self.in_features]

    def zero_points(self) -> torch.Tensor:
        """uint8 [N, G]: the zero points, 2^(bits - 1) where symmetric."""
        if self.zeros is not None:
            return self.zeros
        return torch.full(self.scales.shape, 1 << (self.bits - 1), dtype=torch.uint8, device=self.scales.device)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(q - zero) * scale in float32 (exact: a < 9-bit integer times a scale), then rounded once to dtype."""
        groups = self.column_groups()
        q = self.values().float() - self.zero_points().float()[:, groups]
        return (q * self.scales.float()[:, groups]).to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> IntTensor:
        """Rows (dim 0) or input columns (dim 1) [start, start + length): a tensor-parallel rank's
        part. Columns must begin and end on whole words and, without g_idx, on whole groups (a
        group that spans two ranks is refused by name); with g_idx each column keeps its group,
        and the rank keeps every group's scales."""
        end = start + length
        if dim == 0:
            rows = slice(start, end)
            return replace(self, qweight=self.qweight[rows].contiguous(), scales=self.scales[rows].contiguous(),
                           zeros=None if self.zeros is None else self.zeros[rows].contiguous())
        per = 32 // self.bits
        if start % per or (end % per and end != self.in_features):
            raise ValueError(f"columns [{start}, {end}) of a {self.bits}-bit weight cut its int32 words of {per} "
                             "values: load the model with quantization='none' to split it among tensor-parallel ranks")
        qweight = self.qweight[:, start // per: _cdiv(end, per)].contiguous()
        if self.g_idx is not None:
            return replace(self, qweight=qweight, g_idx=self.g_idx[start:end].contiguous(), in_features=length)
        groups = self.scales.shape[1]
        if groups == 1:
            return replace(self, qweight=qweight, group_size=length, in_features=length)
        gs = self.group_size
        if start % gs or (end % gs and end != self.in_features):
            raise ValueError(f"columns [{start}, {end}) of a weight quantized in groups of {gs} columns: a group "
                             f"spans two tensor-parallel ranks (group {start // gs if start % gs else end // gs}). "
                             "Use a tensor_parallel_size whose shards hold whole groups, or quantization='none'")
        cols = slice(start // gs, _cdiv(end, gs))
        return replace(self, qweight=qweight, scales=self.scales[:, cols].contiguous(),
                       zeros=None if self.zeros is None else self.zeros[:, cols].contiguous(), in_features=length)

    def to(self, device: torch.device | str) -> IntTensor:
        return replace(self, qweight=self.qweight.to(device), scales=self.scales.to(device),
                       zeros=None if self.zeros is None else self.zeros.to(device),
                       g_idx=None if self.g_idx is None else self.g_idx.to(device))

    def sorted_by_group(self) -> tuple[IntTensor, torch.Tensor] | None:
        """(the weight with its columns sorted by group, the order taken) where that makes it a
        plain grouped weight (each group then holds group_size columns in a row), else None.
        x[..., order] times the sorted weight is x times this one."""
        if self.g_idx is None:
            return None
        order = torch.argsort(self.g_idx, stable=True)
        k = self.in_features
        plain = torch.arange(k, device=order.device, dtype=torch.int32) // self.group_size
        if self.scales.shape[1] != _cdiv(k, self.group_size) or not torch.equal(self.g_idx[order], plain):
            return None
        values = self.values()[:, order]
        return replace(self, qweight=pack_words(values, self.bits), g_idx=None), order


def quantize_int(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool) -> IntTensor:
    """A float weight [N, K] rounded to nearest in groups of `group_size` columns (-1: one
    group a row), float16 scales: symmetric (zero 2^(bits - 1), the largest magnitude at the
    top of the range) or with a zero point a group (its range over 2^bits - 1 steps). What
    dummy weights become under an integer scheme's config (benchmarks)."""
    n, k = weight.shape
    group_size = k if group_size <= 0 else min(group_size, k)
    groups = _cdiv(k, group_size)
    w = F.pad(weight.detach().float(), (0, groups * group_size - k)).view(n, groups, group_size)
    top = (1 << bits) - 1
    low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    scales = (torch.maximum(-low, high) / (top / 2) if symmetric else (high - low) / top).half()
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a group of zeros (or of float16 underflow)
    if symmetric:
        zeros = torch.full_like(scales, 1 << (bits - 1), dtype=torch.int32)
    else:
        zeros = torch.round(-low / scales.float()).clamp(0, top).to(torch.int32)
    q = torch.round(w / scales.float()[..., None]) + zeros[..., None]
    q = q.clamp(0, top).to(torch.uint8).view(n, -1)[:, :k]
    return IntTensor.from_values(q, scales, None if symmetric else zeros, None, bits, group_size)


def act_order(g_idx: torch.Tensor | None, k: int, group_size: int, groups: int) -> torch.Tensor | None:
    """A checkpoint's g_idx as int32, or None where it is k // group_size (no act-order)."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int32)
    if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"g_idx must name one of {groups} groups for each of {k} input columns; got "
                         f"{list(g_idx.shape)} values {int(g_idx.min())} .. {int(g_idx.max())}")
    plain = torch.arange(k, device=g_idx.device, dtype=torch.int32) // group_size
    return None if groups == _cdiv(k, group_size) and torch.equal(g_idx, plain) else g_idx


def stack_int(parts: list[IntTensor]) -> IntTensor | None:
    """The parts' rows one after another (q|k|v, gate|up), or None where they differ in
    anything but their rows (bits, groups, zero points kept or not, g_idx, scale dtype): the
    layer keeps them side by side (Split)."""
    first = parts[0]
    same = all((p.bits, p.group_size, p.in_features, p.zeros is None, p.scales.dtype, p.g_idx is None)
               == (first.bits, first.group_size, first.in_features, first.zeros is None, first.scales.dtype,
                   first.g_idx is None) for p in parts)
    if not same or (first.g_idx is not None and not all(torch.equal(p.g_idx, first.g_idx) for p in parts)):
        return None
    return replace(first, qweight=torch.cat([p.qweight for p in parts]), scales=torch.cat([p.scales for p in parts]),
                   zeros=None if first.zeros is None else torch.cat([p.zeros for p in parts]))


# ---- the CPU: GGUF blocks ----------------------------------------------------------------------------------------


def cpu_blocks(tensor: IntTensor) -> BlockTensor | str:
    """The weight as GGUF blocks of 32 (Q4_0, Q4_1 or Q8_0; see the module's doc), or the reason it is none."""
    n, k = tensor.shape
    if tensor.g_idx is not None:
        return "act-order groups of uneven sizes (g_idx)"
    if k % GGUF_BLOCK or tensor.group_size % GGUF_BLOCK:  # one group a row: group_size is k
        return f"groups of {tensor.group_size} columns over {k} (GGUF blocks hold 32)"
    if tensor.bits == 8 and tensor.zeros is not None:
        return "8-bit weights with zero points (no GGUF block type holds q - z exactly)"
    half = tensor.scales.to(torch.float16)
    if not torch.equal(half.float(), tensor.scales.float()) or not bool(half.isfinite().all()):
        return f"{tensor.scales.dtype} scales that are not float16 values"
    blocks = k // GGUF_BLOCK
    per_block = torch.arange(blocks, device=half.device) * GGUF_BLOCK // tensor.group_size
    d = half[:, per_block]  # [N, blocks]
    q = tensor.values().view(n, blocks, GGUF_BLOCK)

    def f16_bytes(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8).view(n, blocks, 2)

    if tensor.bits == 8:
        qs = (q.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
        return BlockTensor(8, (n, k), torch.cat([f16_bytes(d), qs], -1).reshape(n, -1))
    qs = q[..., :16] | (q[..., 16:] << 4)
    if tensor.zeros is None:
        return BlockTensor(2, (n, k), torch.cat([f16_bytes(d), qs], -1).reshape(n, -1))
    m = (-(tensor.zeros.float() * tensor.scales.float())).to(torch.float16)[:, per_block]
    return BlockTensor(3, (n, k), torch.cat([f16_bytes(d), f16_bytes(m), qs], -1).reshape(n, -1))


class PermutedInput(WeightFormat):
    """An act-order weight whose columns were sorted by group at load: inner(x[..., order])."""

    def __init__(self, inner: WeightFormat, order: torch.Tensor) -> None:
        self.inner, self.order = inner, order
        self.out_features, self.in_features = inner.out_features, inner.in_features

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes + self.order.nbytes

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.apply(x.index_select(-1, self.order), bias)


_logged: set[str] = set()


def int_format(tensor: IntTensor, dtype: torch.dtype) -> WeightFormat:
    """The format a layer holding this weight takes: IntWeight on CUDA (and where tests send
    CPU tensors down the CUDA paths, kernel_paths.gemv_on_cpu); on the CPU GGUF blocks (act-
    order columns sorted), or the weight dequantized to `dtype` where no block type holds it
    (logged once a reason) or ember's CPU kernels did not build."""
    if cuda_paths(tensor.qweight):
        return IntWeight(tensor)
    from ember.kernels.cpu import ops

    sorted_ = tensor.sorted_by_group()
    blocks = cpu_blocks(sorted_[0] if sorted_ is not None else tensor)
    if isinstance(blocks, str) or ops() is None:
        reason = blocks if isinstance(blocks, str) else "ember's CPU kernels did not build"
        if reason not in _logged:
            _logged.add(reason)
            logger.warning("%d-bit integer weights dequantized to %s at load on the CPU: %s", tensor.bits,
                           str(dtype).removeprefix("torch."), reason)
        return Dense(tensor.dequantize(dtype))
    fmt = GGUFBlocks(blocks)
    return fmt if sorted_ is None else PermutedInput(fmt, sorted_[1])


# ---- CUDA: the Triton kernels ------------------------------------------------------------------------------------


class IntWeight(KernelFormat):
    """x @ W^T with W dequantized in registers: a few rows (decode) through kernels/int_gemv.py
    (weight-only, its prologues fused: layers/fused.py), more through kernels/wna16.py's
    tensor-core matmul. Off the CUDA paths, F.linear on the dequantized weight (the reference).
    An act-order weight whose groups each hold group_size columns, group_size a whole number of
    int32 words, is sorted by group here (as on the CPU): `order` [K] names x's column for each
    of its columns; the GEMV reads x through it, the matmul takes x's columns in that order."""

    def __init__(self, tensor: IntTensor) -> None:
        self.order: torch.Tensor | None = None
        sorted_ = tensor.sorted_by_group()
        if sorted_ is not None and sorted_[0].group_size % (32 // tensor.bits) == 0:  # int_gemv's word kernel
            tensor, order = sorted_
            self.order = order.to(torch.int32)
        self.tensor = tensor
        self.out_features, self.in_features = tensor.shape

    @property
    def nbytes(self) -> int:
        t = self.tensor
        return sum(x.nbytes for x in (t.qweight, t.scales, t.zeros, t.g_idx, self.order) if x is not None)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        w = self.tensor.dequantize(dtype)
        if self.order is None:
            return w
        out = torch.empty_like(w)
        out[:, self.order.long()] = w
        return out

    def uses_gemv(self, x: torch.Tensor) -> bool:
        return uses_int_gemv(x)

    def gemv(self, x: torch.Tensor, bias: torch.Tensor | None = None, prologue: str = "none",
             residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6):
        from ember.kernels.int_gemv import int_gemv  # triton is imported only on the CUDA paths

        t = self.tensor
        return int_gemv(x, t.qweight, t.scales, t.zeros, t.g_idx, t.bits, t.group_size, bias, prologue, residual,
                        norm_weight, eps, self.order)

    def matmul(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from ember.kernels.wna16 import wna16_matmul

        t = self.tensor
        if self.order is not None:
            rows = rows.index_select(1, self.order)
        return wna16_matmul(rows, t.qweight, t.scales, t.zeros, t.g_idx, t.bits, t.group_size, bias)
