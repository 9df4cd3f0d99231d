"""Qwen2-VL's and Qwen2.5-VL's vision tower (the image side of Qwen2VLForConditionalGeneration
and Qwen2_5_VLForConditionalGeneration less their language model, which is models/llama.py's
Qwen2): dynamic resolution. The image processor cuts an image of any size into patches of
temporal_patch_size x patch x patch (an image is its frame repeated), in an order where each
merge x merge block of patches is consecutive; `grid_thw` says each image's (t, h, w) in patches.

    patches [N, C * tps * p * p] -> patch_embed (a Conv3d whose kernel is the patch: one matmul)
      -> blocks: pre-norm attention, bidirectional within each frame, q and k turned by a 2-D
         RoPE (half the frequencies by the patch's row, half by its column), then an MLP
      -> merger: norm, each merge x merge block's patches side by side, linear-GELU-linear
      -> [N / merge^2, text hidden]: one embedding an image token, in the processor's order

Qwen2.5-VL: RMSNorm and a gated SiLU MLP (with biases), and attention within windows of
window_size pixels (blocks of merged patches, in a window-major order the tower permutes into
and back out of) except in the blocks `full_attention_blocks` names.

Math only, under transformers' names (the hub checkpoints' `visual.*`); the loader maps them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ember.layers.activation import silu_and_mul
from ember.layers.norm import RMSNorm
from ember.layers.rotary import apply_rotary
from ember.layers.transfer import to_device
from ember.models.clip import vision_activation
from ember.models.vision_config import VisionConfig

Grid = tuple[int, int, int]  # an image's (t, h, w) in patches
MLP_PAD = 64  # VisionMLP.finish_loading's multiple of columns


def _norm(cfg: VisionConfig, size: int) -> nn.Module:
    return RMSNorm(size, 1e-6) if cfg.kind == "qwen2_5_vl" else nn.LayerNorm(size, eps=1e-6)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig, bias: bool = False) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.num_channels, cfg.hidden_size, kernel, kernel, bias=bias)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[N, C * tps * p * p] -> [N, hidden]: the kernel covers the whole patch, so the
        convolution is one matmul with the kernel flattened."""
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.view(weight.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, segments: Segments) -> torch.Tensor:
        """x [N, hidden]; rope [N, head_dim] (cos | sin); segments: the runs of rows that attend
        to each other (a frame, or a window)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k, _ = apply_rotary(q, k, rope)  # in place on qkv's views (last dim contiguous): no copies
        return self.proj(segment_attention(q, k, v, segments, self.head_dim ** -0.5).reshape(n, -1))


@dataclass
class Segments:
    """Runs of consecutive rows that attend only to each other (a frame, a window, an image), in
    two forms: their bounds, for one varlen flash-attention call over all of them on CUDA in half
    precision (no rows gathered or scattered: ~470 gather and scatter kernels of a step of seven
    images were the tower's before), and grouped by length, (count, length, their rows
    [count * length]), each group one batched SDPA call, elsewhere."""

    groups: list[tuple[int, int, torch.Tensor]]
    bounds: torch.Tensor  # [runs + 1] int32 row offsets, on the device
    longest: int


# not cuDNN's attention, PyTorch's first choice on Hopper: it builds a plan for each new shape (tenths of a
# second), and a step's segments take new counts whenever its mix of images changes
SEGMENT_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def segments_of(runs: list[tuple[int, int]], device: torch.device) -> Segments:
    """(start, end) runs (consecutive, from row 0) as Segments, built once a forward for every block."""
    by_length: dict[int, list[int]] = {}
    for start, end in runs:
        by_length.setdefault(end - start, []).append(start)
    groups = [(len(starts), length, to_device((torch.tensor(starts)[:, None] + torch.arange(length)).flatten(), device))
              for length, starts in by_length.items()]
    bounds = to_device([0] + [end for _, end in runs], device, torch.int32)
    return Segments(groups, bounds, max(by_length))


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                      scale: float) -> torch.Tensor:
    """Bidirectional attention within each segment of rows ([N, heads, dim] each)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
        return torch.ops.aten._flash_attention_forward(q, k, v, segments.bounds, segments.bounds, segments.longest,
                                                       segments.longest, 0.0, False, False, scale=scale)[0]
    out = torch.empty_like(q)
    with sdpa_kernel(SEGMENT_BACKENDS):
        for count, length, rows in segments.groups:
            qs, ks, vs = (t[rows].view(count, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
            out[rows] = o.transpose(1, 2).reshape(-1, *q.shape[1:])
    return out


class VisionMLP(nn.Module):
    """Qwen2-VL: fc2(act(fc1(x))); Qwen2.5-VL: down(act(gate(x)) * up(x)), every projection biased.
    Once loaded (`finish_loading`), Qwen2.5-VL's gate and up are one matmul whose halves are padded
    to a multiple of MLP_PAD columns with zeros, down's inputs likewise: the same sums. Its 3,420
    columns are 6,840 bytes a bf16 row, not a multiple of 16, and cuBLAS then ran Ampere's kernels
    for 2-element alignment on the H100: 30 % of a 7-image prefill step's GPU time."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.act, self.gated = cfg.hidden_act, cfg.kind == "qwen2_5_vl"
        size, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_up: nn.Linear | None = None  # Qwen2.5-VL once loaded: [gate | up], each padded
        if self.gated:
            self.gate_proj, self.up_proj = nn.Linear(size, inter), nn.Linear(size, inter)
            self.down_proj = nn.Linear(inter, size)
        else:
            self.fc1, self.fc2 = nn.Linear(size, inter), nn.Linear(inter, size)

    @torch.no_grad()
    def finish_loading(self) -> None:
        if not self.gated or self.gate_up is not None:
            return
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        inter, size = gate.weight.shape
        padded = -(-inter // MLP_PAD) * MLP_PAD
        self.gate_up = nn.Linear(size, 2 * padded, device=gate.weight.device, dtype=gate.weight.dtype)
        self.gate_up.weight.zero_()
        self.gate_up.bias.zero_()
        for half, linear in enumerate((gate, up)):
            self.gate_up.weight[half * padded:half * padded + inter] = linear.weight
            self.gate_up.bias[half * padded:half * padded + inter] = linear.bias
        self.down_proj = nn.Linear(padded, size, device=down.weight.device, dtype=down.weight.dtype)
        self.down_proj.weight.zero_()
        self.down_proj.weight[:, :inter] = down.weight
        self.down_proj.bias.copy_(down.bias)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate_up = self.gate_up(x)
            if self.act == "silu":
                return self.down_proj(silu_and_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(vision_activation(self.act, gate) * up)
        if self.gated:
            return self.down_proj(vision_activation(self.act, self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(vision_activation(self.act, self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(cfg, cfg.hidden_size), _norm(cfg, cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, segments)
        return x + self.mlp(self.norm2(x))

    def fused(self, h: torch.Tensor, residual: torch.Tensor | None, rope: torch.Tensor,
              segments: Segments) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() with RMSNorms, the residual stream apart: the block's input is residual + h
        (h alone where residual is None), its output the returned mlp output + residual. Each add
        runs inside the next norm's kernel (in place on `residual`), none in a kernel of its own."""
        normed, residual = (self.norm1(h), h) if residual is None else self.norm1(h, residual)
        normed, residual = self.norm2(self.attn(normed, rope, segments), residual)
        return self.mlp(normed), residual


@dataclass
class TowerPlan:
    """What a packed tower's forward derives from the images' grids alone (built once, on the
    device): the run of the blocks over their patches reads nothing else."""

    rope: torch.Tensor  # [N, head_dim] cos | sin, in the order the blocks see the patches
    frames: Segments  # each frame's rows
    sizes: list[int]  # each image's output rows
    windows: Segments | None = None  # Qwen2.5-VL: each window's rows (window-major order)
    rows: torch.Tensor | None = None  # Qwen2.5-VL: the patches in window-major order
    unorder: torch.Tensor | None = None  # Qwen2.5-VL: the merged rows back in the processor's order
    positions: torch.Tensor | None = None  # Qwen3-VL: each patch's learned position [N, hidden]


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merged = cfg.hidden_size * cfg.merge_size ** 2
        self.ln_q = _norm(cfg, cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(),
                                 nn.Linear(self.merged, cfg.text_hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The merged rows of x (of x + residual, the add inside the norm's kernel, where given)."""
        normed = self.ln_q(x) if residual is None else self.ln_q(x, residual)[0]
        return self.mlp(normed.view(-1, self.merged))


class Qwen2VisionTower(nn.Module):
    """Images of any sizes in one call: their patches concatenated [sum N, C * tps * p * p] and
    their grids -> each image's embeddings [N / merge^2, text hidden]."""

    packed = True  # runner/multimodal.py: images of any size go in one call, not batched by shape

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_layers))
        self.merger = PatchMerger(cfg)
        self.register_buffer("inv_freq", axial_inv_freq(cfg), persistent=False)

    def forward(self, patches: torch.Tensor, grids: list[Grid]) -> list[torch.Tensor]:
        return self.run(patches, self.plan(grids, patches.device))

    def plan(self, grids: list[Grid], device: torch.device) -> TowerPlan:
        """Every tensor the forward derives from the grids, on `device` (runner/tower_graphs.py
        keeps one alive beside the CUDA graph that reads it)."""
        cfg, unit = self.config, self.config.merge_size ** 2
        plan = TowerPlan(axial_rope(grids, cfg.merge_size, self.inv_freq, device), frame_segments(grids, device),
                         [t * h * w // unit for t, h, w in grids])
        if cfg.window_size:  # window-major order of merge blocks: each window's rows consecutive
            order, runs = _window_order(grids, cfg.window_size // cfg.merge_size // cfg.patch_size, cfg.merge_size)
            plan.windows = segments_of(runs, device)
            plan.rows = (to_device(order, device)[:, None] * unit + torch.arange(unit, device=device)).flatten()
            plan.rope = plan.rope[plan.rows]
            plan.unorder = to_device(np.argsort(order), device)
        return plan

    def run(self, patches: torch.Tensor, plan: TowerPlan) -> list[torch.Tensor]:
        """The forward over the patches of the images `plan` was made for (no host work: it
        replays as a CUDA graph)."""
        cfg = self.config
        x = self.patch_embed(patches)
        if plan.rows is not None:
            x = x[plan.rows]
        fused = isinstance(self.merger.ln_q, RMSNorm)  # Qwen2.5-VL: the residual adds inside the norms
        residual = None
        for i, block in enumerate(self.blocks):
            full = plan.windows is None or i in cfg.full_attention_blocks
            segments = plan.frames if full else plan.windows
            if fused:
                x, residual = block.fused(x, residual, plan.rope, segments)
            else:
                x = block(x, plan.rope, segments)
        merged = self.merger(x, residual)
        if plan.unorder is not None:
            merged = merged[plan.unorder]
        return list(merged.split(plan.sizes))


def axial_inv_freq(cfg: VisionConfig) -> torch.Tensor:
    """The tower RoPE's frequencies: a quarter of head_dim's for the row, as many for the column
    (HF's axial RoPE)."""
    head_dim = cfg.hidden_size // cfg.num_heads
    quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
    return 1.0 / cfg.rope_theta ** quarter


def axial_rope(grids: list[Grid], merge: int, inv_freq: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[N, head_dim]: cos | sin of each patch's angles, its row's frequencies then its column's,
    the patches in the processor's order (each merge block's consecutive, each frame alike)."""
    rows, cols = [], []
    for t, h, w in grids:
        for pos, out in zip(merge_order(h, w, merge), (rows, cols)):
            out.append(np.tile(pos, t))
    pos = to_device(np.stack([np.concatenate(rows), np.concatenate(cols)], axis=1), device)
    angles = (pos[..., None].float() * inv_freq.to(device)).flatten(1)  # [N, head_dim / 2]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def merge_order(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """The (row, column) of each patch of an h x w frame in the processor's order: merge x merge
    blocks in raster order, the block's patches consecutive."""
    hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return tuple(pos.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).ravel() for pos in (hh, ww))


def frame_segments(grids: list[Grid], device: torch.device) -> Segments:
    """Each frame's patches attend to each other only."""
    return segments_of(_runs([h * w for t, h, w in grids for _ in range(t)]), device)


def _runs(lengths: list[int]) -> list[tuple[int, int]]:
    ends = np.cumsum(lengths).tolist()
    return list(zip([0] + ends[:-1], ends))


def _window_order(grids: list[Grid], window: int, merge: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Qwen2.5-VL's windows: each frame's merge blocks ([h / merge, w / merge] of them) cut into
    windows of window x window blocks (the last row and column of windows smaller). Returns the
    merge blocks in window-major order (indices into the processor's order) and each window's
    (start, end) rows in that order."""
    order, lengths, base = [], [], 0
    for t, h, w in grids:
        bh, bw = h // merge, w // merge
        index = np.arange(t * bh * bw).reshape(t, bh, bw) + base
        for frame in index:
            for r in range(0, bh, window):
                for c in range(0, bw, window):
                    cell = frame[r:r + window, c:c + window].ravel()
                    order.append(cell)
                    lengths.append(len(cell) * merge * merge)
        base += t * bh * bw
    return np.concatenate(order), _runs(lengths)


# a checkpoint's names for the tower (the hub's visual.*, transformers 5's modules' model.visual.*)
_PREFIXES = ("model.visual.", "visual.")


def qwen2_vl_tensor_name(name: str, cfg: VisionConfig) -> str | None:
    """Qwen2VisionTower's name for a checkpoint tensor of the image side; None for any other."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None
