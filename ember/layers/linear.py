"""Linear layers. A merged layer takes several checkpoint tensors, one per shard, through
the `weight_loader` its parameters carry; plain ones are copied whole by the loader. A layer
multiplies its `weight` parameter unless it has a weight format (layers/quant/): GGUF blocks,
FP8, integer (AWQ, GPTQ, compressed-tensors) or W8A8 weights the loader handed it (`load_blocks`
/ `load_fp8` / `load_int` / `load_w8a8`, then `finish_loading`), its own weight quantized to FP8
at load (`quantize_fp8`, --quantization fp8), or on the CPU the dense weight prepacked once for
oneDNN (`pack_for_cpu`). On CUDA, one row (a decode step of
one sequence) times a weight of a small model goes through ember's GEMV kernel
(kernels/gemv.py), which is faster than cuBLAS there and can take the op before it
(layers/fused.py); layers/kernel_paths.py says when, and `EMBER_SMALL_BATCH_GEMV=0` leaves
every size to cuBLAS.

Tensor parallelism (ember/distributed/): a merged layer is column-parallel where asked (each
rank holds its rows of every shard: `MergedLinear.column_parallel`, `QKVLinear` by heads), a
`RowParallelLinear` holds its columns of the input and all-reduces its output. Their weight
loaders narrow each checkpoint tensor to the rank's part before copying it; GGUF blocks, FP8
and integer weights kept as they are are narrowed alike (columns on whole blocks or groups)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed.parallel_state import all_reduce, tp_rank, tp_size
from ember.distributed.sharding import shard_heads, split_evenly
from ember.layers.batch_invariant import invariant_linear
from ember.layers.kernel_paths import gemv_on_cpu, uses_gemv  # noqa: F401 (tests take gemv_on_cpu from here)
from ember.layers.quant import WeightFormat
from ember.layers.quant.fp8 import FP8Tensor, FP8Weight, quantize_weight, stack_fp8
from ember.layers.quant.gguf_blocks import BlockTensor, stack_rows
from ember.layers.quant.gguf_cuda import gguf_format
from ember.layers.quant.int_weight import IntTensor, int_format, quantize_int, stack_int
from ember.layers.quant.split import Dense, Split
from ember.layers.quant.unquantized import OneDNNPacked
from ember.layers.quant.w8a8 import W8A8Tensor, W8A8Weight, quantize_w8a8, stack_w8a8

# a weight the loader hands over in its checkpoint format
Quantized = BlockTensor | FP8Tensor | IntTensor | W8A8Tensor


def _format(tensor: Quantized, dtype: torch.dtype) -> WeightFormat:
    if isinstance(tensor, IntTensor):
        return int_format(tensor, dtype)
    if isinstance(tensor, W8A8Tensor):
        return W8A8Weight(tensor)
    return gguf_format(tensor) if isinstance(tensor, BlockTensor) else FP8Weight(tensor)


def _stack(parts: list[Quantized]) -> Quantized | None:
    """The shards' rows as one weight of one format, or None where they do not stack."""
    if all(isinstance(p, BlockTensor) for p in parts) and len({p.qtype for p in parts}) == 1:
        return stack_rows(parts)
    if all(isinstance(p, FP8Tensor) for p in parts):
        return stack_fp8(parts)
    if all(isinstance(p, IntTensor) for p in parts):
        return stack_int(parts)
    if all(isinstance(p, W8A8Tensor) for p in parts):
        return stack_w8a8(parts)
    return None


class Linear(nn.Module):
    batch_invariant = False  # deterministic mode (layers/batch_invariant.py) sets it on the instance

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.format: WeightFormat | None = None
        self._quantized: dict[int | None, Quantized] = {}  # shard (None: whole) -> its weight, until loaded

    def set_format(self, fmt: WeightFormat) -> None:
        """The format holds the weight from now on; the parameter keeps its shape and dtype on
        the meta device."""
        self.format = fmt
        self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)

    def pack_for_cpu(self) -> None:
        """The dense weight (the parameter, or one a format dequantized at load) prepacked for oneDNN."""
        if self.format is None:
            self.set_format(OneDNNPacked(self.weight))
        elif isinstance(self.format, Dense):
            self.format = OneDNNPacked(self.format.weight)

    def load_blocks(self, tensor: BlockTensor, shard: int | None) -> None:
        """A GGUF weight kept in its blocks: the whole weight (shard None) or one shard's rows."""
        self._keep(tensor.to(self.weight.device), shard)

    def load_fp8(self, tensor: FP8Tensor, shard: int | None) -> None:
        """An FP8 checkpoint's weight (values and scales): the whole weight or one shard's rows."""
        self._keep(tensor.to(self.weight.device), shard)

    def load_int(self, tensor: IntTensor, shard: int | None) -> None:
        """An AWQ / GPTQ / compressed-tensors weight (packed integers, group scales and zeros):
        the whole weight or one shard's rows."""
        self._keep(tensor.to(self.weight.device), shard)

    def load_w8a8(self, tensor: W8A8Tensor, shard: int | None) -> None:
        """A W8A8 (compressed-tensors int-quantized) weight: int8 values, a scale a row and the
        static input scale if any; the whole weight or one shard's rows."""
        self._keep(tensor.to(self.weight.device), shard)

    def _keep(self, tensor: Quantized, shard: int | None) -> None:
        rows = self.weight.shape[0] if shard is None else self.out_sizes[shard]
        if tuple(tensor.shape) != (rows, self.weight.shape[1]):
            raise ValueError(f"parameter rows {(rows, self.weight.shape[1])}, checkpoint {tuple(tensor.shape)}")
        self._quantized[shard] = tensor

    def finish_loading(self) -> None:
        """Once every checkpoint tensor is in: the quantized weights become the layer's
        format, one where the shards stack (GGUF blocks of one type, FP8 of one kind, integer
        weights of one scheme, W8A8 weights whose activations quantize alike), else a Split of
        the shards side by side, dense ones among them."""
        quantized, self._quantized = self._quantized, {}
        if not quantized:
            return
        dtype = self.weight.dtype
        if None in quantized:
            return self.set_format(_format(quantized[None], dtype))
        parts = [quantized.get(i) for i in range(len(self.out_sizes))]
        stacked = _stack(parts) if None not in parts else None
        if stacked is not None:
            return self.set_format(_format(stacked, dtype))
        dense = self.weight.data.split(self.out_sizes)
        self.set_format(Split([_format(p, dtype) if p is not None else Dense(d.clone()) for p, d in zip(parts, dense)]))

    def quantize_fp8(self) -> None:
        """The loaded dense weight in FP8 with a scale per output row (--quantization fp8)."""
        if self.format is None:
            self.set_format(FP8Weight(quantize_weight(self.weight)))

    def quantize_int(self, bits: int, group_size: int, symmetric: bool) -> None:
        """The loaded dense weight in integers with group scales (dummy weights under an AWQ /
        GPTQ / compressed-tensors config)."""
        if self.format is None:
            self.set_format(int_format(quantize_int(self.weight, bits, group_size, symmetric), self.weight.dtype))

    def quantize_w8a8(self, input_scale: float | None) -> None:
        """The loaded dense weight in int8 with a scale a row, its activations quantized per token
        (input_scale None) or by input_scale (dummy weights under a W8A8 config)."""
        if self.format is None:
            self.set_format(W8A8Weight(quantize_w8a8(self.weight, input_scale)))

    @property
    def fused_bias(self) -> torch.Tensor | None:
        """The bias the matmul adds (a row-parallel layer adds its own after the reduce)."""
        return self.bias

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        """The matmul's output made the layer's: itself here (a row-parallel layer sums the ranks')."""
        return y

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """x runs as ember's GEMV kernel (kernel_paths.uses_gemv), never in deterministic mode."""
        return self.format is None and not self.batch_invariant and uses_gemv(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return self.reduce_output(invariant_linear(x, self.weight, self.format, self.fused_bias))
        if self.format is not None:
            return self.reduce_output(self.format.apply(x, self.fused_bias))
        if uses_gemv(x, self.weight):
            from ember.kernels.gemv import gemv  # triton is imported only on this path

            return self.reduce_output(gemv(x, self.weight, self.fused_bias))
        return self.reduce_output(F.linear(x, self.weight, self.fused_bias))


class RowParallelLinear(Linear):
    """Input columns split among the ranks: each multiplies its columns of x (the output of a
    column-parallel layer, split alike) and the partial sums are all-reduced; the bias is
    added once, after the reduce. One rank: a plain Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, what: str = "input features") -> None:
        self.in_start, local = split_evenly(in_features, tp_rank(), tp_size(), what)
        super().__init__(local, out_features, bias)
        self.full_in_features = in_features
        self.reduces = tp_size() > 1
        self.weight.weight_loader = self.load_columns

    def load_columns(self, param: nn.Parameter, loaded: torch.Tensor, shard: None = None) -> None:
        if tuple(loaded.shape) != (param.shape[0], self.full_in_features):
            raise ValueError(f"parameter {(param.shape[0], self.full_in_features)}, checkpoint {tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(1, self.in_start, param.shape[1]))

    def _keep(self, tensor: Quantized, shard: None) -> None:
        if self.reduces:
            if tensor.shape[1] != self.full_in_features:
                raise ValueError(f"parameter {(self.weight.shape[0], self.full_in_features)}, checkpoint {tensor.shape}")
            tensor = tensor.narrow(1, self.in_start, self.weight.shape[1])
        super()._keep(tensor, shard)

    @property
    def fused_bias(self) -> torch.Tensor | None:
        return None if self.reduces else self.bias

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        if not self.reduces:
            return y
        y = all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)


class MergedLinear(Linear):
    """Several projections of the same input in one matmul (q|k|v, gate|up).

    Output rows:  [ shard 0 | shard 1 | ... ]; checkpoint shard i fills rows
    offsets[i] : offsets[i] + sizes[i].
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 rows: list[tuple[int, int]] | None = None) -> None:
        """out_sizes: each shard's rows in the checkpoint; rows: the (start, length) of each
        that this rank holds (column parallelism), None for all of them."""
        self.full_sizes = list(out_sizes)
        self.rank_rows = rows if rows is not None else [(0, n) for n in out_sizes]
        out_sizes = [n for _, n in self.rank_rows]
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes = out_sizes
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.weight.weight_loader = self.load_shard
        if self.bias is not None:
            self.bias.weight_loader = self.load_shard

    def _keep(self, tensor: Quantized, shard: int | None) -> None:
        if self.out_sizes == self.full_sizes:  # one rank
            return super()._keep(tensor, shard)
        if shard is None:  # the shards stored merged (Phi-3's GGUF)
            for i, part in enumerate(self._merged_parts(tensor)):
                self._keep(part, i)
            return
        if tensor.shape[0] != self.full_sizes[shard]:
            raise ValueError(f"shard {shard} of {self.full_sizes[shard]} rows, checkpoint {tuple(tensor.shape)}")
        super()._keep(tensor.narrow(0, self.rank_rows[shard][0], self.out_sizes[shard]), shard)

    def _merged_parts(self, merged: torch.Tensor | BlockTensor) -> list[torch.Tensor | BlockTensor]:
        """A checkpoint tensor holding every shard, one after another, cut into the shards."""
        if merged.shape[0] != sum(self.full_sizes):
            raise ValueError(f"merged parameter of {sum(self.full_sizes)} rows, checkpoint {tuple(merged.shape)}")
        return [merged.narrow(0, sum(self.full_sizes[:i]), n) for i, n in enumerate(self.full_sizes)]

    @classmethod
    def column_parallel(cls, in_features: int, out_sizes: list[int], bias: bool = False,
                        what: str = "output rows") -> MergedLinear:
        """Each shard's rows split evenly among the ranks (gate|up by intermediate rows)."""
        return cls(in_features, out_sizes, bias, [split_evenly(n, tp_rank(), tp_size(), what) for n in out_sizes])

    @property
    def num_shards(self) -> int:
        return len(self.out_sizes)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        """Checkpoint shard `shard`, or all of them stored merged (shard None: Phi-3's q|k|v),
        narrowed to this rank's rows."""
        if shard is None:
            for i, part in enumerate(self._merged_parts(loaded)):
                self.load_shard(param, part, i)
            return
        rows = param.data.narrow(0, self.offsets[shard], self.out_sizes[shard])
        expected = (self.full_sizes[shard],) + tuple(rows.shape[1:])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"shape mismatch for shard {shard}: parameter {expected}, checkpoint {tuple(loaded.shape)}")
        rows.copy_(loaded.narrow(0, self.rank_rows[shard][0], self.out_sizes[shard]))

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.out_sizes, dim=-1)


class QKVLinear(MergedLinear):
    """q|k|v, column-parallel by heads (distributed/sharding.py: KV heads replicated where
    there are fewer than ranks). num_heads and num_kv_heads are this rank's."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        heads = shard_heads(num_heads, num_kv_heads, tp_rank(), tp_size())
        q = (heads.q_start * head_dim, heads.num_heads * head_dim)
        kv = (heads.kv_start * head_dim, heads.num_kv_heads * head_dim)
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, [q, kv, kv])
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
