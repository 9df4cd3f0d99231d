"""GGUF files: open, read metadata, dequantize tensors, map names to HF's.

    f = GGUFFile(path)                  # checks the file; reads header and tensor table only
    f.metadata["llama.block_count"]     # plain Python values
    for name, w in iter_hf_weights(f, cfg):   # one tensor at a time
        ...                             # name is HF's ("model.layers.0.self_attn.q_proj.weight")

Tensors come out as float32 in PyTorch's shape order. GGUF lists a tensor's dims fastest
first (`ne = [cols, rows]`); PyTorch lists them slowest first, so shape = reversed(ne) and
a 2-D weight is (out_features, in_features).

`dequantize` (layers/quant/ggml.py) is ember's own vectorized torch code for the common types
and gives the same float32 bits as `gguf.quants.dequantize` (the tests check it); other types
go to gguf-py.
The `gguf` package is imported lazily so that `import ember` needs torch alone.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ember.layers.quant.ggml import dequantize  # noqa: F401 (the loader's API too)
from ember.layers.quant.gguf_blocks import KERNEL_TYPES, BlockTensor
from ember.loader.gguf_experts import is_stacked_experts, split_experts
from ember.loader.gguf_reader import CorruptGGUF, read_gguf
from ember.loader.weights import completed_pair, hf_weight_shapes, linear_rows_by_part, rope_rows_to_halves
from ember.models.config import ModelConfig
from ember.models.families import BY_GGUF_ARCHITECTURE

GGUF_MAGIC = b"GGUF"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorInfo:
    """One entry of a GGUF file's tensor table."""

    name: str
    qtype: int  # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # PyTorch order: reversed GGUF ne
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def qtype_name(self) -> str:
        import gguf

        return gguf.GGMLQuantizationType(self.qtype).name


class GGUFFile:
    """A GGUF file, opened read-only through a memory map.

    Opening reads the header, the metadata and the tensor table and checks that every
    tensor's data lies inside the file; tensor data is read only when asked for.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        _check_magic(self.path)
        try:
            raw = read_gguf(self.path)
        except CorruptGGUF as e:
            raise ValueError(f"{self.path} is not a readable GGUF file: it looks truncated or corrupt ({e}). "
                             "Download or convert it again.") from None
        except ValueError as e:  # big-endian, or a string that is not UTF-8
            raise ValueError(f"{self.path}: {e}") from None
        self._buffer = raw.buffer
        self.metadata: dict[str, Any] = raw.metadata
        self.architecture: str = str(self.metadata.get("general.architecture", ""))
        if not self.architecture:
            raise ValueError(
                f"{self.path} has no general.architecture in its metadata; it is not a model "
                "file ember can load (was it written by a GGUF converter?)"
            )
        size = len(raw.buffer)
        self._infos: dict[str, TensorInfo] = {}
        for t in raw.tensors:
            info = TensorInfo(name=t.name, qtype=t.qtype, shape=tuple(reversed(t.ne)), offset=t.offset,
                              nbytes=_tensor_bytes(t.qtype, t.ne))
            if info.offset + info.nbytes > size:
                raise ValueError(
                    f"{self.path} is truncated or corrupt: tensor {t.name!r} needs bytes "
                    f"[{info.offset}, {info.offset + info.nbytes}) but the file has {size} bytes. "
                    "Download or convert it again."
                )
            self._infos[t.name] = info
        self.tensor_names: list[str] = list(self._infos)

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, {self.architecture}, {len(self.tensor_names)} tensors)"

    def tensor_info(self, name: str) -> TensorInfo:
        return self._infos[self._check_name(name)]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (a read-only uint8 view on the memory map)."""
        info = self.tensor_info(name)
        return np.frombuffer(self._buffer, np.uint8, info.nbytes, info.offset)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32, shape in PyTorch order."""
        info = self.tensor_info(name)
        return dequantize(self.raw(name), info.qtype, info.shape)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor in file order, dequantized one at a time."""
        for name in self.tensor_names:
            yield name, self.tensor(name)

    def _check_name(self, name: str) -> str:
        if name not in self._infos:
            raise KeyError(
                f"{self.path.name} has no tensor {name!r} ({len(self.tensor_names)} tensors, "
                f"e.g. {', '.join(self.tensor_names[:3])})"
            )
        return name


def _check_magic(path: Path) -> None:
    if not path.exists():
        raise ValueError(
            f"no such file: {path}. Pass the path of a .gguf model file "
            "(`python -m ember.loader.default_model` fetches the default one and prints its path)."
        )
    if not path.is_file():
        raise ValueError(f"{path} is not a file; pass the path of the .gguf file itself")
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head != GGUF_MAGIC:
        raise ValueError(
            f"{path} is not a GGUF file: it starts with {head!r}, a GGUF file starts with "
            f"{GGUF_MAGIC!r}. For an HF model, pass its directory (config.json + safetensors)."
        )


# (values a block, bytes a block) of the common types, so that opening a file needs no gguf-py;
# other types are looked up there
_TYPE_SIZES = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
               10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210)}


def _tensor_bytes(qtype: int, ne: tuple[int, ...]) -> int:
    if qtype in _TYPE_SIZES:
        values, nbytes = _TYPE_SIZES[qtype]
    else:
        import gguf

        try:
            values, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        except ValueError:
            raise ValueError(f"unknown GGML tensor type {qtype}; is the file from a newer llama.cpp?") from None
    return math.prod(ne) // values * nbytes


# ---------------------------------------------------------------------------------------
# Dequantization. Each quantized type stores a row as a run of fixed-size blocks of
# ---------------------------------------------------------------------------------------
# GGUF -> HF tensor names, from gguf-py's TensorNameMap (the table llama.cpp's converter
# writes names with), asked for each HF name ember expects and inverted.


def gguf_to_hf_names(arch: str, hf_names: Iterable[str], num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> HF name, for each of `hf_names` that gguf-py maps for `arch`.

    arch: the file's `general.architecture` ("llama", "qwen2", "gemma2", ...).
    An HF name gguf-py does not map for this architecture is left out (the loader's
    completeness check then names it as missing).

    The map renames only: a GGUF tensor holds the same numbers as the HF one, except where
    the converter changed them, which is the caller's business. Two such changes: the
    rows of Q and K of architecture "llama" (see `unpermute_rows`), and Gemma's RMSNorm
    weights, stored as 1 + w (HF's Gemma norm multiplies by 1 + w; the converter adds the 1).
    """
    import gguf

    by_name = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in by_name:
        raise ValueError(
            f"GGUF architecture {arch!r} is unknown to gguf-py {_gguf_version()}, so its tensor "
            "names cannot be mapped: upgrade the gguf package, or load the model's HF directory"
        )
    table = gguf.get_tensor_name_map(by_name[arch], num_layers)
    out: dict[str, str] = {}
    for hf in hf_names:
        # DeepSeek-V3's router bias: the converter names it as a `.bias` of e_score_correction
        # gpt-oss's sinks: a weight of attn_sinks (a parameter of no suffix in transformers)
        # Qwen3-Next's dt_bias: a bias of dt_proj
        lookup = hf + ".weight" if hf.endswith(".self_attn.sinks") else \
            hf.replace(".dt_bias", ".dt_proj.bias") if hf.endswith(".linear_attn.dt_bias") else hf
        name = table.get_name(lookup.replace("e_score_correction_bias", "e_score_correction.bias"),
                              try_suffixes=(".weight", ".bias"))
        if name is None:
            continue
        if name in out:
            raise ValueError(f"HF tensors {out[name]!r} and {hf!r} both map to GGUF {name!r} for {arch!r}")
        out[name] = hf
    return out


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(version unknown)"


# llama.cpp's convert_hf_to_gguf.py reorders the rows of each head of Q and K (for
# architecture "llama" only) so that its rope can rotate adjacent pairs. With head_dim 8:
#
#   HF   (rotate_half pairs row i with i + 4):  r0 r1 r2 r3 | r4 r5 r6 r7   = (2, head_dim/2)
#   GGUF (adjacent pairs):                      r0 r4 | r1 r5 | r2 r6 | r3 r7 = (head_dim/2, 2)
#
# GGUF's order is HF's viewed as (2, head_dim/2) and transposed; undoing it views GGUF's
# rows as (heads, head_dim/2, 2) and swaps the last two axes. Biases are rows of length 1.
def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows = w.shape[0]
    if rows % num_heads or (rows // num_heads) % 2:
        raise ValueError(f"cannot split {rows} rows into {num_heads} heads of even size")
    head_dim = rows // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_hf_weights(f: GGUFFile, cfg: ModelConfig, consumed: Collection[str] = (),
                    keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | BlockTensor]]:
    """Every tensor of `f` as (HF name, float32 tensor), one at a time, in file order.

    cfg: the model's config; its HF tensor names (`hf_weight_shapes`) are the names asked for.
    consumed: GGUF tensor names the caller reads itself (e.g. "rope_freqs.weight" where the
    config takes RoPE scaling from it); they are not yielded.
    keep_quantized: 2-D weights of a type the block kernels multiply (gguf_blocks.KERNEL_TYPES:
    the CPU's, and kernels/gguf.py's on CUDA) come out as BlockTensor, their bytes as stored
    (rows reordered where the converter reordered them); other quantized types are
    dequantized, named in one warning. llama.cpp's stacked experts
    (blk.N.ffn_gate_exps, ...) come out dequantized, one tensor per expert under its HF name
    (loader/gguf_experts.py).

    A tensor with no HF counterpart is yielded under its GGUF name, so the model loader's
    completeness check names it rather than it being dropped: rope_freqs.weight (Llama 3.1's
    RoPE scaling, baked into a tensor) carries real information. A tied model has no
    output.weight, so no lm_head.weight comes out.
    """
    names = gguf_to_hf_names(f.architecture, list(hf_weight_shapes(cfg)) + _linear_gguf_parts(cfg), cfg.num_layers)
    family = BY_GGUF_ARCHITECTURE.get(f.architecture)
    unpermute = family is not None and family.gguf_rope_permuted
    no_kernel: dict[str, list[str]] = {}
    pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (blk.N, what): one part of a pair read
    for gguf_name in f.tensor_names:
        if gguf_name in consumed:
            continue
        if (block := _BLOCK.match(gguf_name)) is not None and int(block[1]) >= cfg.num_layers:
            continue  # a multi-token-prediction layer after the model's (GLM-4.5's converter writes them)
        if (m := _EXPERT_BIAS.fullmatch(gguf_name)) is not None:  # gpt-oss: FusedMoE's w13_bias (gate | up), w2_bias
            if m[2] == "down":
                yield f"model.layers.{m[1]}.mlp.w2_bias", f.tensor(gguf_name)
                continue
            if (pair := completed_pair(pending, (m[1], "biases"), m[2], f.tensor(gguf_name))) is not None:
                yield f"model.layers.{m[1]}.mlp.w13_bias", torch.cat([pair["gate"], pair["up"]], dim=1)
            continue
        if (m := _LATENT_B.fullmatch(gguf_name)) is not None:
            if (pair := completed_pair(pending, (m[1], "kv_b"), m[2], f.tensor(gguf_name))) is not None:
                yield _kv_b_proj(int(m[1]), pair["k"], pair["v"])
            continue
        info = f.tensor_info(gguf_name)
        blocks = keep_quantized and len(info.shape) == 2 and info.qtype in KERNEL_TYPES
        if keep_quantized and not blocks and info.qtype not in _DENSE_TYPES:
            no_kernel.setdefault(info.qtype_name, []).append(gguf_name)
        w = _block_tensor(f, info) if blocks else f.tensor(gguf_name)
        if is_stacked_experts(gguf_name):  # 3-D, so dequantized above (see loader/gguf_experts.py)
            yield from split_experts(gguf_name, w)
            continue
        name = names.get(gguf_name)
        if name is None:
            yield gguf_name, w
            continue
        rows = w.data if blocks else w
        if cfg.rope_interleaved and (rope := _ROPE_PROJECTION.search(name)) is not None:
            rows = rope_rows_to_halves(cfg, rope[1], rows)
        elif unpermute and ".self_attn.q_proj." in name:
            rows = unpermute_rows(rows, cfg.num_heads)
        elif unpermute and ".self_attn.k_proj." in name:
            rows = unpermute_rows(rows, cfg.num_kv_heads)
        elif ".linear_attn." in name:
            rows = _linear_attention_tensor(cfg, name, rows)
        elif cfg.norm_unit_offset and name.endswith("norm.weight"):
            rows = rows - 1.0  # llama.cpp stores Gemma's norms as 1 + w; HF's w (exact: Sterbenz)
        out = BlockTensor(info.qtype, info.shape, rows.contiguous()) if blocks else rows
        if name.endswith(".linear_attn.in_proj_qkv.weight"):
            yield from _linear_qkv_parts(cfg, name, out)
            continue
        yield name, out
    if no_kernel:
        listed = "; ".join(f"{t}: {', '.join(n[:4])}{' ...' if len(n) > 4 else ''} ({len(n)})"
                           for t, n in no_kernel.items())
        logger.warning("%s: no kernel of ember's (CPU or CUDA) multiplies these types (or stacked experts' weights) "
                       "yet, so these tensors were dequantized to the run dtype: %s", f.path.name, listed)


_DENSE_TYPES = (0, 1, 30)  # F32, F16, BF16: plain weights, not quantized

# llama.cpp's converter splits MLA's kv_b_proj per head into k_b (W_UK transposed: [H, r, nope])
# and v_b (W_UV: [H, v, r]), the absorbed forms its graph multiplies by; ember's kv_b_proj is
# [H x (nope + v), r], each head's W_UK rows then its W_UV rows
_BLOCK = re.compile(r"blk\.(\d+)\.")
_EXPERT_BIAS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.bias")
_LATENT_B = re.compile(r"blk\.(\d+)\.attn_(k|v)_b\.weight")
_ROPE_PROJECTION = re.compile(r"\.self_attn\.(q_proj|q_b_proj|kv_a_proj_with_mqa)\.")


def _linear_gguf_parts(cfg: ModelConfig) -> list[str]:
    """Qwen3-Next's in_proj_qkvz as llama.cpp's converter writes it: q | k | v (attn_qkv) and z
    (attn_gate) apart, under the names gguf-py gives them (cut into in_proj_qkvz's shards q, k, v
    and z: `_linear_qkv_parts`, loader/weights.PACKED)."""
    return [f"model.layers.{i}.linear_attn.{part}.weight" for i in range(cfg.num_layers) if cfg.layer_is_linear(i)
            for part in ("in_proj_qkv", "in_proj_z")]


def _linear_qkv_parts(cfg: ModelConfig, name: str, qkv: torch.Tensor | BlockTensor
                      ) -> Iterator[tuple[str, torch.Tensor | BlockTensor]]:
    """A GGUF's q | k | v rows as in_proj_qkvz's shards q, k and v: a tensor-parallel rank takes
    its key heads' rows of each (models/gated_deltanet.py)."""
    keys = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    for part, start, rows in (("q", 0, keys), ("k", keys, keys), ("v", 2 * keys, qkv.shape[0] - 2 * keys)):
        yield name.replace(".in_proj_qkv.", f".in_proj_{part}."), qkv.narrow(0, start, rows)


def _linear_attention_tensor(cfg: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """A Qwen3-Next linear layer's tensor as the converter changed it, back to the checkpoint's:
    ssm_a is -exp(A_log), ssm_conv1d lost its middle axis, ssm_ba keeps the rows grouped by
    key head (reordered here as an HF checkpoint's are, loader/weights.linear_rows_by_part);
    its gated norm's weight is stored as it is (no 1 + w)."""
    if name.endswith(".A_log"):
        return torch.log(-t)
    if name.endswith(".conv1d.weight"):
        return t.unsqueeze(1)
    if name.endswith(".in_proj_ba.weight"):
        return linear_rows_by_part(cfg, "ba", t)
    return t


def _kv_b_proj(layer: int, k_b: torch.Tensor, v_b: torch.Tensor) -> tuple[str, torch.Tensor]:
    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise ValueError(f"layer {layer}: attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} are not "
                         "[heads, kv_lora_rank, nope] and [heads, v_head_dim, kv_lora_rank]: convert the file again")
    kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
    return f"model.layers.{layer}.self_attn.kv_b_proj.weight", kv_b.reshape(-1, kv_b.shape[-1])


def _block_tensor(f: GGUFFile, info: TensorInfo) -> BlockTensor:
    """The tensor's bytes, copied out of the memory map, as rows of blocks."""
    data = torch.from_numpy(np.array(f.raw(info.name), dtype=np.uint8, copy=True).reshape(info.shape[0], -1))
    return BlockTensor(info.qtype, info.shape, data)


def open_gguf(path: str | Path) -> GGUFFile:
    """A GGUFFile, opened once per file version: the config, the tokenizer and the weights
    all read the same file, and parsing its metadata costs seconds."""
    p = Path(path).expanduser().resolve()
    stat = p.stat() if p.exists() else None
    return _open_cached(p, stat.st_mtime_ns if stat else 0, stat.st_size if stat else 0)


@functools.lru_cache(maxsize=2)
def _open_cached(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)
