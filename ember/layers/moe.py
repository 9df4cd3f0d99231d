"""A sparse mixture-of-experts MLP in one layer: hidden states in, hidden states out.

The router (`gate`, hidden -> one logit per expert) is inside, and so are the top-k
selection and its weights: softmax over the logits in float32, the k largest, renormalized
to sum to 1 where `renormalize` (Mixtral, Qwen3-MoE with norm_topk_prob). DeepSeek's routers
(`GroupedRouting`) score by softmax or sigmoid, pick within the best groups of experts and
scale the weights; they run as torch ops on every device. The experts'
weights are stacked: `w13` [E, 2I, H] (gate | up of each expert) and `w2` [E, H, I] (down),
in the run dtype, or quantized (gpt-oss's MXFP4, an FP8 checkpoint's float8 with its scales,
an AWQ / GPTQ / compressed-tensors checkpoint's packed integers with theirs: FusedMoE's doc);
the loader fills them one checkpoint tensor (shard) at a time.

On CUDA (and for tests through Triton's interpreter) the routing and the experts run as
kernels/moe.py's fused kernels, which CUDA graphs capture (gpt-oss's biases and clamped
SwiGLU too). The torch path (the CPU) groups
the (token, expert) pairs by expert and runs gate|up and down matmuls per expert that
received a token, on blocks of batch_invariant.ROWS rows, then adds each token's k outputs, times
their routing weights, in slot order: a token's result does not depend on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed.parallel_state import all_reduce, tp_rank, tp_size
from ember.distributed.sharding import split_evenly
from ember.layers.activation import silu_and_mul
from ember.layers.batch_invariant import in_row_blocks
from ember.layers.kernel_paths import cuda_paths
from ember.layers.linear import Linear
from ember.layers.quant.fp8 import BLOCK, FP8, FP8Tensor, dequantize_experts
from ember.layers.quant.int_weight import IntTensor
from ember.layers.quant.mxfp4 import dequantize_mxfp4


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's router. "softmax" (V2): the scores are the softmax of the logits, a group's
    score its best expert's. "sigmoid" (V3): the scores are sigmoids, a per-expert bias
    (`gate.e_score_correction_bias`) is added to choose by but not to weigh by, and a
    group's score is the sum of its best two. The top-k is taken among the experts of the
    `topk_groups` best of `groups` groups; the weights (renormalized where asked) are
    multiplied by `scale`."""

    scoring: str  # "softmax" | "sigmoid"
    groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0


class FusedMoE(nn.Module):
    """`biased` (gpt-oss): the router and each expert's projections add a bias (w13_bias
    [E, 2I], w2_bias [E, H]); `swiglu` (alpha, limit): the clamped SwiGLU in place of
    silu(gate) * up. Both on the torch path and in the fused kernels. `mxfp4` (gpt-oss's
    checkpoints on CUDA): w13 and w2 held as MXFP4 (w13_blocks [E, 2I, H / 2] uint8,
    w13_scales [E, 2I, H / 32], w2_blocks [E, H, I / 2], w2_scales [E, H, I / 32]), which the
    fused kernels decode as they multiply; the torch path decodes them whole each call.
    `fp8` ("block" or "row": an FP8 checkpoint's experts on CUDA): w13 and w2 held as
    float8_e4m3fn with float32 scales, w13_scale and w2_scale, per row ([E, 2I], [E, H]) or per
    128 x 128 block ([E, 2 ceil(I / 128), ceil(H / 128)]: the gate's row blocks, then the
    up's, each half's its own whatever I; [E, ceil(H / 128), ceil(I / 128)]), loaded with
    their weights' shards (kernels/moe.py's FP8Experts); the fused kernels scale each value
    in registers, the torch path dequantizes them whole each call. `int_experts` (bits,
    group_size, symmetric: an AWQ / GPTQ / compressed-tensors checkpoint's experts on CUDA): w13
    and w2 held packed as IntWeight holds a linear layer's weight (layers/quant/int_weight.py),
    int32 words of 4- or 8-bit values along K ([E, 2I, ceil(H / per)], [E, H, ceil(I / per)],
    per = 32 / bits), with w13_scales / w2_scales a group of columns ([E, 2I, ceil(H / group)],
    [E, H, ceil(I / group)]; group_size -1: one group a row) in the checkpoint's float dtype and,
    unless symmetric, uint8 w13_zeros / w2_zeros shaped as the scales; loaded from IntTensors
    with their weights' shards (gate rows, then up rows, as the dense w13), the groups in
    column order (act-order experts are not held so). The fused kernels unpack them in
    registers (kernels/moe.py's IntExperts), the torch path dequantizes them whole each call.

    Tensor parallelism splits every expert as Megatron splits an MLP: a rank holds rows
    [start, start + I / tp) of each expert's gate and up and the same columns of its down, and
    the ranks' outputs are all-reduced (the router runs whole on every rank; gpt-oss's down
    bias is added by rank 0 alone). Block-scaled FP8 experts split on whole 128-row blocks,
    integer experts' downs on whole groups of columns (and int32 words)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, grouped: GroupedRouting | None = None, biased: bool = False,
                 swiglu: tuple[float, float] | None = None, mxfp4: bool = False,
                 fp8: Literal["block", "row"] | None = None, int_experts: tuple[int, int, bool] | None = None
                 ) -> None:
        super().__init__()
        self.reduces = tp_size() > 1
        if mxfp4 and self.reduces:
            raise ValueError("tensor parallelism does not split MXFP4 experts yet: run the model with "
                             "tensor_parallel_size 1")
        self.full_intermediate = intermediate_size
        self.start, intermediate_size = split_evenly(intermediate_size, tp_rank(), tp_size(), "the experts' "
                                                     "intermediate size (moe_intermediate_size)")
        if fp8 not in (None, "row", "block"):
            raise ValueError(f"fp8 experts are scaled per 'row' or 'block', not {fp8!r}")
        end = self.start + intermediate_size
        if fp8 == "block" and (self.start % BLOCK or end % BLOCK and end != self.full_intermediate):
            raise ValueError(f"tensor parallelism over {tp_size()} ranks gives rank {tp_rank()} rows [{self.start}, "
                             f"{end}) of each expert's {self.full_intermediate} (moe_intermediate_size), which cuts "
                             f"the FP8 experts' {BLOCK}-row scale blocks: use a tensor_parallel_size that splits "
                             f"moe_intermediate_size into multiples of {BLOCK}, or quantization='none'")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be within 1..num_experts ({num_experts})")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        if int_experts is not None and (mxfp4 or fp8):
            raise ValueError("experts are integer, MXFP4 or FP8, one of them")
        self.int_experts, self.hidden_size = int_experts, hidden_size
        if int_experts is not None:
            self.int_groups = self._int_groups(hidden_size, *int_experts)
        self.grouped = grouped
        if grouped is not None and num_experts % grouped.groups:
            raise ValueError(f"{num_experts} experts do not split into n_group {grouped.groups} groups")
        self.gate = Linear(hidden_size, num_experts, bias=biased)
        self.swiglu = swiglu
        if grouped is not None and grouped.scoring == "sigmoid":
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))
        self.mxfp4, self.fp8 = mxfp4, fp8
        if mxfp4:
            if hidden_size % 32 or intermediate_size % 32:
                raise ValueError(f"MXFP4 experts need hidden ({hidden_size}) and intermediate ({intermediate_size}) "
                                 "sizes that are multiples of 32")
            for name, rows, cols in (("w13", 2 * intermediate_size, hidden_size), ("w2", hidden_size,
                                                                                   intermediate_size)):
                for part, width in (("blocks", cols // 2), ("scales", cols // 32)):
                    setattr(self, f"{name}_{part}", nn.Parameter(
                        torch.empty(num_experts, rows, width, dtype=torch.uint8), requires_grad=False))
        else:
            if int_experts is not None:
                self._int_parameters(num_experts, hidden_size, intermediate_size)
            else:
                self.w13 = _experts(num_experts, 2 * intermediate_size, hidden_size, fp8)
                self.w2 = _experts(num_experts, hidden_size, intermediate_size, fp8)
            if fp8:  # filled with their weights' shards (load_w13, load_w2), so not read by name
                self.w13_scale = _fp8_scales(num_experts, 2 * intermediate_size, hidden_size, 2, fp8)
                self.w2_scale = _fp8_scales(num_experts, hidden_size, intermediate_size, 1, fp8)
            # shards: w13's 2e is expert e's gate, 2e + 1 its up; w2's e is expert e's down
            self.w13.num_shards, self.w13.weight_loader = 2 * num_experts, self.load_w13
            self.w2.num_shards, self.w2.weight_loader = num_experts, self.load_w2
            # FP8 and integer experts take the checkpoint's quantized tensors (loader/weights.py)
            self.w13.loads_quantized = self.w2.loads_quantized = bool(fp8) or int_experts is not None
        self.biased = biased
        if biased:
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
            self.w13_bias.weight_loader, self.w2_bias.weight_loader = self.load_w13, self._load_w2_bias

    def _int_groups(self, hidden_size: int, bits: int, group_size: int, symmetric: bool) -> tuple[int, int]:
        """Columns a group of w13 (K = hidden) and of this rank's w2 (K = its intermediate
        columns) as the checkpoint's IntTensors hold them: group_size, or K where one group spans
        the row. A rank's columns of the down projection are whole groups and whole int32 words,
        else a ValueError names the split."""
        if bits not in (4, 8):
            raise ValueError(f"integer experts of {bits} bits are not supported: ember takes 4 and 8")
        full, start, local = self.full_intermediate, self.start, self.intermediate_size
        end = start + local
        group = full if group_size <= 0 else min(group_size, full)
        unit, what = (32 // bits, "int32 words") if group == full else (group, f"groups of {group} columns")
        if local != full and (start % unit or end % unit and end != full):
            raise ValueError(f"tensor parallelism over {tp_size()} ranks gives rank {tp_rank()} columns [{start}, {end}) "
                             f"of each expert's down projection ({full}: moe_intermediate_size), which cuts its "
                             f"{bits}-bit integer {what}: use a tensor_parallel_size that splits moe_intermediate_size "
                             f"into multiples of {unit}, or quantization='none'")
        return (hidden_size if group_size <= 0 else min(group_size, hidden_size)), (local if group == full else group)

    def _int_parameters(self, experts: int, hidden: int, inter: int) -> None:
        """w13 / w2 as packed integers, their scales (float16 until the first expert loads
        with its own dtype) and zero points (unless symmetric), filled shard by shard."""
        bits, _, symmetric = self.int_experts
        per = 32 // bits
        for name, rows, cols, group in (("w13", 2 * inter, hidden, self.int_groups[0]),
                                        ("w2", hidden, inter, self.int_groups[1])):
            setattr(self, name, nn.Parameter(torch.empty(experts, rows, -(-cols // per), dtype=torch.int32),
                                             requires_grad=False))
            groups = -(-cols // group)
            for part, dtype in (("scales", torch.float16), ("zeros", torch.uint8))[:1 if symmetric else 2]:
                param = nn.Parameter(torch.empty(experts, rows, groups, dtype=dtype), requires_grad=False)
                param.loads_with_weight = True  # loader/weights.py expects no checkpoint tensor of its own
                setattr(self, f"{name}_{part}", param)
        self._int_scales_set = False

    def _rank_rows(self, t: torch.Tensor | FP8Tensor | IntTensor, dim: int) -> torch.Tensor | FP8Tensor | IntTensor:
        """This rank's slice of an intermediate dimension (all of it on one rank); an FP8
        weight's with its scales (FP8Tensor.narrow: on whole blocks, as __init__ checked), an
        integer one's with its groups (IntTensor.narrow: whole groups, likewise)."""
        if t.shape[dim] != self.full_intermediate:
            raise ValueError(f"{self.full_intermediate} intermediate rows expected, checkpoint {tuple(t.shape)}")
        return t if self.intermediate_size == self.full_intermediate else t.narrow(dim, self.start,
                                                                                  self.intermediate_size)

    def load_w13(self, param: nn.Parameter, loaded: torch.Tensor | FP8Tensor, shard: int | None) -> None:
        """Expert e's gate (shard 2e) or up (2e + 1); shard None: every expert's stacked, gate
        rows then up rows (gpt-oss, Llama 4; and w13_bias, [E, 2I])."""
        if self.int_experts is not None and param is self.w13:
            return self._load_int("w13", loaded, shard)
        if param.dtype == FP8:
            return self._load_fp8("w13", loaded, shard)
        if shard is None:
            gate, up = loaded.chunk(2, dim=1)
            return _copy(param.data, torch.cat([self._rank_rows(gate, 1), self._rank_rows(up, 1)], dim=1), "all")
        expert, half = divmod(shard, 2)
        _copy(param.data[expert].narrow(0, half * self.intermediate_size, self.intermediate_size),
              self._rank_rows(loaded, 0), shard)

    def load_w2(self, param: nn.Parameter, loaded: torch.Tensor | FP8Tensor, shard: int | None) -> None:
        if self.int_experts is not None:
            return self._load_int("w2", loaded, shard)
        if param.dtype == FP8:
            return self._load_fp8("w2", loaded, shard)
        _copy(param.data if shard is None else param.data[shard], self._rank_rows(loaded, loaded.dim() - 1),
              "all" if shard is None else shard)

    def _load_fp8(self, name: str, loaded: torch.Tensor | FP8Tensor, shard: int | None) -> None:
        """A shard of FP8 experts (w13's 2e + half: expert e's gate or up; w2's e), an FP8Tensor
        scaled as the others, with its scales: per row, those rows'; per block, its half's row
        blocks (w13's gate blocks, then its up blocks)."""
        if shard is None or not isinstance(loaded, FP8Tensor) or loaded.blockwise != (self.fp8 == "block"):
            got = "stacked" if shard is None else f"{'block' if loaded.blockwise else 'row'}-scaled FP8" \
                if isinstance(loaded, FP8Tensor) else str(loaded.dtype)
            raise ValueError(f"the experts are FP8 scaled per {self.fp8} (the checkpoint's quantization_config), "
                             f"loaded one expert's projection at a time; this tensor is {got} (quantization='none' "
                             "loads the experts dequantized)")
        halves = 2 if name == "w13" else 1
        expert, half = divmod(shard, halves)
        loaded = self._rank_rows(loaded, 0 if name == "w13" else 1)
        weight, scale = getattr(self, name).data[expert], getattr(self, f"{name}_scale").data[expert]
        rows, blocks = weight.shape[0] // halves, scale.shape[0] // halves
        _copy(weight.narrow(0, half * rows, rows), loaded.weight, shard)
        _copy(scale.narrow(0, half * blocks, blocks), loaded.scale, shard)

    def _load_int(self, name: str, loaded: torch.Tensor | IntTensor, shard: int | None) -> None:
        """A shard of integer experts (w13's 2e + half: expert e's gate or up; w2's e), an
        IntTensor of the layer's bits and groups, its groups in column order, with its scales
        (their dtype the first expert's) and zero points (2^(bits - 1) where it has none)."""
        bits, _, symmetric = self.int_experts
        if shard is None or not isinstance(loaded, IntTensor):
            got = "stacked" if shard is None else str(loaded.dtype) if isinstance(loaded, torch.Tensor) \
                else type(loaded).__name__
            raise ValueError(f"the experts are {bits}-bit integers (the checkpoint's quantization_config), loaded one "
                             f"expert's projection at a time; this tensor is {got} (quantization='none' loads the "
                             "experts dequantized)")
        gated = name == "w13"
        t = self._rank_rows(loaded, 0 if gated else 1)
        group = self.int_groups[0 if gated else 1]
        if (t.bits, t.group_size, t.g_idx) != (bits, group, None) or (t.zeros is not None and symmetric):
            raise ValueError(f"the experts are {bits}-bit integers in groups of {group} columns in order"
                             f"{'' if not symmetric else ', symmetric'} (the checkpoint's quantization_config); this "
                             f"tensor is {t.bits}-bit in groups of {t.group_size}"
                             + (", act-order (g_idx)" if t.g_idx is not None else "")
                             + (", with zero points" if t.zeros is not None and symmetric else "")
                             + ": load the model with quantization='none'")
        scales = getattr(self, f"{name}_scales")
        if t.scales.dtype != scales.dtype:
            if self._int_scales_set:
                raise ValueError(f"experts whose scales are {scales.dtype} and {t.scales.dtype}: ember holds one "
                                 "dtype a layer's experts (quantization='none' loads them dequantized)")
            for param in (self.w13_scales, self.w2_scales):
                param.data = torch.empty_like(param.data, dtype=t.scales.dtype)
        self._int_scales_set = True
        halves = 2 if gated else 1
        expert, half = divmod(shard, halves)
        parts = [(getattr(self, name), t.qweight), (getattr(self, f"{name}_scales"), t.scales)]
        if not symmetric:
            parts.append((getattr(self, f"{name}_zeros"), t.zero_points()))
        for param, value in parts:
            rows = param.shape[1] // halves
            _copy(param.data[expert].narrow(0, half * rows, rows), value, shard)

    def _load_w2_bias(self, param: nn.Parameter, loaded: torch.Tensor, shard: None = None) -> None:
        """Added after the down projection: by rank 0 only, as the ranks' outputs are summed."""
        _copy(param.data, loaded if tp_rank() == 0 else torch.zeros_like(loaded), "all")

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, E] logits -> (weights [T, k] in float32, expert ids [T, k])."""
        if self.grouped is not None:
            return self._route_grouped(router_logits.float())
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def _route_grouped(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.grouped
        sigmoid = g.scoring == "sigmoid"
        scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
        choice = scores + self.gate.e_score_correction_bias if sigmoid else scores
        if g.groups > 1:
            per_group = choice.view(len(choice), g.groups, -1)
            group_score = per_group.topk(2, dim=-1).values.sum(-1) if sigmoid else per_group.max(dim=-1).values
            best = group_score.topk(g.topk_groups, dim=-1).indices
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(per_group.shape[-1], dim=1),
                                        float("-inf") if sigmoid else 0.0)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * g.scale, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cuda_paths(x) and self.grouped is not None:
            return self.run_experts(x, *self.route(self.gate(x)))
        if cuda_paths(x):
            from ember.kernels.moe import route_topk

            # gpt-oss's softmax over its top-k logits is softmax, top-k, renormalized (norm_topk_prob)
            return self.run_experts(x, *route_topk(self.gate(x), self.top_k, self.renormalize))
        return self.run_experts(x, *self.route(in_row_blocks(self.gate, x)))

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each token through its experts ids [T, k], the outputs summed times weights [T, k]
        (float32): the fused kernels on CUDA (MXFP4, FP8 and integer experts decoded in them), the
        grouped torch path elsewhere."""
        biases = (self.w13_bias, self.w2_bias) if self.biased else None
        if cuda_paths(x):
            from ember.kernels.moe import FP8Experts, MXFP4Experts, fused_experts

            if self.mxfp4:
                w13, w2 = MXFP4Experts(self.w13_blocks, self.w13_scales), MXFP4Experts(self.w2_blocks, self.w2_scales)
            elif self.int_experts is not None:
                from ember.kernels.moe import IntExperts

                w13, w2 = (IntExperts(getattr(self, name), getattr(self, f"{name}_scales"),
                                      getattr(self, f"{name}_zeros", None), self.int_experts[0], group, cols)
                           for name, group, cols in self._int_shapes())
            elif self.fp8:
                w13, w2 = FP8Experts(self.w13, self.w13_scale), FP8Experts(self.w2, self.w2_scale)
            else:
                w13, w2 = self.w13, self.w2
            # the kernels take int32 ids, as route_topk gives them
            out = fused_experts(x.contiguous(), w13, w2, weights.contiguous(), ids.to(torch.int32), biases,
                                self.swiglu)
        else:
            w13, w2 = self._decoded("w13", x.dtype), self._decoded("w2", x.dtype)
            out = grouped_experts(x, w13, w2, weights.to(x.dtype), ids, biases, self.swiglu)
        return all_reduce(out) if self.reduces else out

    def _int_shapes(self) -> list[tuple[str, int, int]]:
        """(name, columns a group, columns) of the integer w13 and w2."""
        return [("w13", self.int_groups[0], self.hidden_size), ("w2", self.int_groups[1], self.intermediate_size)]

    def _decoded(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """w13 or w2 as the torch path multiplies it: MXFP4, FP8 and integer experts decoded whole."""
        if self.int_experts is not None:
            _, group, cols = next(shape for shape in self._int_shapes() if shape[0] == name)
            qweight, scales = getattr(self, name), getattr(self, f"{name}_scales")
            zeros = getattr(self, f"{name}_zeros", None)
            return torch.stack([IntTensor(qweight[e], scales[e], None if zeros is None else zeros[e], None,
                                          self.int_experts[0], group, cols).dequantize(dtype)
                                for e in range(qweight.shape[0])])
        if self.mxfp4:
            blocks, scales = getattr(self, f"{name}_blocks"), getattr(self, f"{name}_scales")
            return dequantize_mxfp4(blocks.unflatten(-1, (-1, 16)), scales).to(dtype)
        if self.fp8:
            return dequantize_experts(getattr(self, name), getattr(self, f"{name}_scale"), 2 if name == "w13" else 1,
                                      dtype)
        return getattr(self, name)


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                    swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """sum over k, in slot order, of weights[t, k] * expert ids[t, k] (x[t]): the (token, slot)
    pairs grouped by expert, each expert's rows in calls of batch_invariant.ROWS (a dense
    matmul's kernel follows its row count: fixed-size calls keep a token's bits its own)."""
    top_k = ids.shape[1]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    xs = x[order // top_k]
    ys = torch.empty_like(xs)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            bias = None if biases is None else (biases[0][expert], biases[1][expert])
            ys[start:start + n] = _expert(xs[start:start + n], w13[expert], w2[expert], bias, swiglu)
            start += n
    per_slot = torch.empty_like(ys)
    per_slot[order] = ys  # back in (token, slot) order
    per_slot = per_slot.view(x.shape[0], top_k, -1) * weights.unsqueeze(-1)
    out = per_slot[:, 0].clone()
    for slot in range(1, top_k):
        out += per_slot[:, slot]
    return out


def _expert(xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            bias: tuple[torch.Tensor, torch.Tensor] | None = None,
            swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    if bias is None and swiglu is None:
        return in_row_blocks(lambda rows: silu_and_mul(rows @ w13.t()) @ w2.t(), xs)
    b13, b2 = bias if bias is not None else (None, None)
    act = silu_and_mul if swiglu is None else lambda gate_up: clamped_swiglu(gate_up, *swiglu)
    return in_row_blocks(lambda rows: F.linear(act(F.linear(rows, w13, b13)), w2, b2), xs)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of [gate | up]: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),
    g = min(gate, limit)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)


def _experts(experts: int, rows: int, cols: int, fp8: str | None) -> nn.Parameter:
    """A stacked expert weight [E, rows, cols]: in the run dtype, or float8_e4m3fn."""
    if fp8 is None:
        return nn.Parameter(torch.empty(experts, rows, cols))
    return nn.Parameter(torch.empty(experts, rows, cols, dtype=FP8), requires_grad=False)


def _fp8_scales(experts: int, rows: int, cols: int, halves: int, fp8: str) -> nn.Parameter:
    """The float32 scales of an FP8 expert weight [E, rows, cols]: per row [E, rows], or per
    128 x 128 block of each of its halves [E, halves * ceil(rows / halves / 128), ceil(cols / 128)]."""
    shape = (experts, rows) if fp8 == "row" else (experts, halves * -(-(rows // halves) // BLOCK), -(-cols // BLOCK))
    scale = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
    scale.loads_with_weight = True  # loader/weights.py expects no checkpoint tensor of its own
    return scale


def _copy(rows: torch.Tensor, loaded: torch.Tensor, shard: int | str) -> None:
    if rows.shape != loaded.shape:
        raise ValueError(f"shape mismatch for shard {shard}: parameter {tuple(rows.shape)}, "
                         f"checkpoint {tuple(loaded.shape)}")
    rows.copy_(loaded)
