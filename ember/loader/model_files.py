"""Where a model's weights, config and tokenizer come from, and loading them."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ember.layers.quant.fp8 import FP8Tensor
from ember.layers.quant.gguf_blocks import BlockTensor
from ember.models.config import ModelConfig
from ember.pooling import PoolerConfig

if TYPE_CHECKING:
    from ember.layers.quant.int_weight import IntTensor
    from ember.layers.quant.w8a8 import W8A8Tensor
    from ember.loader.fp8_checkpoint import FP8Scheme
    from ember.loader.int_checkpoint import IntScheme

# what generation_config.json may set for requests that leave it unset (as vLLM's
# --generation-config auto; do_sample is not read there either)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


# GGUF tensors that ModelConfig reads (RoPE factors), not weights of the model
GGUF_CONFIG_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})


@dataclass(frozen=True)
class ModelFiles:
    path: Path  # a .gguf file or an HF directory
    load_format: str  # gguf | safetensors | pt | dummy

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    def model_config(self) -> ModelConfig:
        if self.is_gguf:
            f = self._gguf()
            return ModelConfig.from_gguf_metadata(f.metadata, f.tensor_names, lambda n: f.tensor(n).tolist())
        return ModelConfig.from_hf_dir(self.path)

    def quantization_scheme(self) -> FP8Scheme | IntScheme | None:
        """The scheme an HF directory's config.json names (quantization_config: FP8 or integer
        weights); None for a GGUF file or a directory without one. A method ember does not
        run: ValueError."""
        if self.is_gguf:
            return None
        from ember.loader.quant_config import checkpoint_scheme

        file = self.path / "config.json"
        return checkpoint_scheme(json.loads(file.read_text(encoding="utf-8")), str(file))

    def weights(self, cfg: ModelConfig, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
                quantization: str = "none"
                ) -> Iterator[tuple[str, torch.Tensor | BlockTensor | FP8Tensor | IntTensor | W8A8Tensor]]:
        """HF-named tensors; with quantization 'gguf', a GGUF's block-quantized weights as
        BlockTensor; an FP8 checkpoint's weights as FP8Tensor with quantization 'fp8', an
        AWQ / GPTQ / compressed-tensors one's as IntTensor (W8A8Tensor for int-quantized W8A8)
        with quantization its method, else dequantized (float32)."""
        if self.load_format == "dummy":
            from ember.loader.dummy import iter_dummy_weights

            if device == "cpu":
                return iter_dummy_weights(cfg, seed)
            return iter_dummy_weights(cfg, seed, dtype, device)
        if self.is_gguf:
            from ember.loader.gguf import iter_hf_weights

            return iter_hf_weights(self._gguf(), cfg, GGUF_CONFIG_TENSORS, keep_quantized=quantization == "gguf")
        from ember.loader.safetensors import iter_pt, iter_safetensors
        from ember.loader.weights import checkpoint_names, checkpoint_tensors

        read = iter_pt if self.load_format == "pt" else iter_safetensors
        scheme = self.quantization_scheme()
        if scheme is None:
            return checkpoint_tensors(cfg, read(self.path, checkpoint_names(cfg)))
        from ember.loader.int_checkpoint import IntScheme, int_weights

        if isinstance(scheme, IntScheme):
            from ember.loader.weights import check_int_family

            check_int_family(cfg, scheme.method)
            return int_weights(read(self.path, checkpoint_names(cfg)), scheme, dequantize=quantization != scheme.method,
                               source=str(self.path))
        from ember.loader.fp8_checkpoint import fp8_weights

        tensors = checkpoint_tensors(cfg, read(self.path, checkpoint_names(cfg)))
        return fp8_weights(tensors, scheme, dequantize=quantization != "fp8", source=str(self.path))

    def tensor_names(self, cfg: ModelConfig) -> list[str]:
        """An HF directory's tensor names as the loader names them (checkpoint_names), read
        from its index or headers, no tensor read; [] for a GGUF file or dummy weights."""
        if self.is_gguf or self.load_format == "dummy":
            return []
        from ember.loader.safetensors import tensor_names
        from ember.loader.weights import checkpoint_names

        rename = checkpoint_names(cfg) or (lambda name: name)
        return [n for n in map(rename, tensor_names(self.path, self.load_format)) if n is not None]

    def tensor_bytes(self) -> int:
        """Bytes of the checkpoint's tensors as stored (0 for dummy weights)."""
        if self.load_format == "dummy":
            return 0
        if self.is_gguf:
            f = self._gguf()
            return sum(f.tensor_info(n).nbytes for n in f.tensor_names)
        from ember.loader.safetensors import pt_files, safetensors_files

        files = pt_files(self.path) if self.load_format == "pt" else safetensors_files(self.path)
        return sum(p.stat().st_size for p in files)

    def sampling_defaults(self) -> dict[str, float | int]:
        """The sampling fields generation_config.json sets (those vLLM reads); {} for a GGUF
        file or a directory without one."""
        file = self.path / "generation_config.json"
        if self.is_gguf or not file.is_file():
            return {}
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{file} is not valid JSON ({e}): fix or remove the file, or pass "
                             "generation_config='vllm' (--generation-config vllm) to ignore it") from None
        if not isinstance(config, dict):
            raise ValueError(f"{file} is not a JSON object: fix or remove it, or pass generation_config='vllm'")
        return {k: config[k] for k in SAMPLING_FIELDS if config.get(k) is not None}

    def pooler_defaults(self) -> PoolerConfig | None:
        """How the checkpoint's sentence-transformers files (modules.json) pool: its Pooling
        module's mode (CLS, mean or last token) and whether a Normalize module follows; None
        without them. A mode ember does not pool by (max, weighted mean) is refused."""
        file = self.path / "modules.json"
        if self.is_gguf or not file.is_file():
            return None
        try:
            modules = json.loads(file.read_text(encoding="utf-8"))
            kinds = {m["type"].rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
            pooling = json.loads((self.path / kinds["Pooling"] / "config.json").read_text(encoding="utf-8")) \
                if "Pooling" in kinds else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{file} or its Pooling module's config.json is not what sentence-transformers writes "
                             f"({type(e).__name__}: {e}): fix them, or pass pooler_config") from None
        if pooling is None:
            return None
        modes = [m for m in ("cls_token", "mean_tokens", "lasttoken", "max_tokens", "mean_sqrt_len_tokens",
                             "weightedmean_tokens") if pooling.get(f"pooling_mode_{m}")]
        mode = pooling.get("pooling_mode")  # sentence-transformers 5+: a mode or a list; before: a flag each
        if mode is not None:
            modes = [mode] if isinstance(mode, str) else list(mode)
        kind = {"cls_token": "CLS", "cls": "CLS", "mean_tokens": "MEAN", "mean": "MEAN", "lasttoken": "LAST"}
        if len(modes) != 1 or modes[0] not in kind:
            raise ValueError(f"{self.path}: sentence-transformers pools by {' + '.join(modes) or 'nothing'}; ember pools "
                             "by one of the CLS token, the mean or the last token: pass pooler_config to choose")
        return PoolerConfig(kind[modes[0]], normalize="Normalize" in kinds)

    def gguf_metadata(self) -> dict[str, Any]:
        """A GGUF model's metadata (its keys and values)."""
        return dict(self._gguf().metadata)

    def _gguf(self):
        from ember.loader.gguf import open_gguf

        return open_gguf(self.path)


def locate_model(model: str | None, load_format: str, revision: str | None = None,
                 download_dir: str | None = None) -> ModelFiles:
    """Check that `model` names something ember can load: a .gguf file, an HF directory, or a
    Hugging Face Hub id (fetched into the HF cache, or `download_dir`, at `revision`); None
    means the default model."""
    from ember.loader.hub import parse_hub_id, resolve_hub_model

    if model is None:
        from ember.loader.default_model import fetch_default_model

        path = fetch_default_model()
    else:
        path = Path(model).expanduser()
        if not path.exists() and parse_hub_id(model) is not None:
            path = resolve_hub_model(model, revision, download_dir)
    if not path.exists():
        raise ValueError(
            f"model {model!r} not found: pass a .gguf file, an HF model directory (config.json + *.safetensors), "
            "or a Hugging Face Hub id (org/name, or org/name-GGUF:Q4_K_M for one quant of a GGUF repo)"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf: pass a .gguf file or an HF model directory")
        fmt = "gguf" if load_format == "auto" else load_format
        if fmt not in ("gguf", "dummy"):
            raise ValueError(f"load_format={load_format!r} does not fit a .gguf file: use 'auto' or 'gguf'")
    else:
        from ember.loader.safetensors import checkpoint_format

        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json: an HF model directory needs config.json and *.safetensors")
        fmt = checkpoint_format(path) if load_format == "auto" else load_format
        if fmt not in ("safetensors", "pt", "dummy"):
            raise ValueError(f"load_format={load_format!r} does not fit an HF directory: use 'auto', "
                             "'safetensors' or 'pt'")
    return ModelFiles(path, fmt)


def locate_tokenizer(tokenizer: str, download_dir: str | None = None) -> Path:
    """A tokenizer override: a directory, a .gguf file, or a Hugging Face Hub id (its
    tokenizer files alone are fetched)."""
    from ember.loader.hub import parse_hub_id, resolve_hub_tokenizer

    path = Path(tokenizer).expanduser()
    if path.exists():
        return path
    if parse_hub_id(tokenizer) is not None:
        return resolve_hub_tokenizer(tokenizer, download_dir)
    raise ValueError(f"tokenizer {tokenizer!r} not found: pass a directory with tokenizer.json (or "
                     "tokenizer.model), a .gguf file, or a Hugging Face Hub id")


def load_model(files: ModelFiles, cfg: ModelConfig, max_positions: int, dtype: torch.dtype,
               device: str, attention_backend: str, seed: int = 0, quantization: str = "none") -> nn.Module:
    from ember.layers.attention import get_attention_backend
    from ember.loader.weights import load_weights
    from ember.models.llama import LlamaForCausalLM  # every family: ModelConfig says how they differ

    if cfg.mxfp4_experts and torch.device(device).type != "cuda":  # no MXFP4 kernel off CUDA: decoded at load
        cfg = dataclasses.replace(cfg, mxfp4_experts=False)
    from ember.loader.fp8_checkpoint import FP8Scheme

    scheme = files.quantization_scheme()
    if quantization == "fp8" and torch.device(device).type == "cuda" and files.load_format != "dummy":
        # an FP8 checkpoint's experts stay FP8 for the fused MoE kernels (off CUDA: dequantized at load)
        from ember.loader.fp8_checkpoint import fp8_experts

        fp8 = scheme if isinstance(scheme, FP8Scheme) else None
        cfg = dataclasses.replace(cfg, fp8_experts=fp8_experts(cfg, fp8))
    from ember.loader.int_checkpoint import IntScheme

    if isinstance(scheme, IntScheme) and quantization == scheme.method and files.load_format != "dummy":
        # an integer checkpoint's experts stay packed for the fused MoE kernels (else dequantized at load)
        from ember.layers.kernel_paths import kernels_on
        from ember.loader.int_checkpoint import int_experts

        cfg = dataclasses.replace(cfg, int_experts=int_experts(cfg, scheme, lambda: files.tensor_names(cfg),
                                                               kernels_on(device)))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are made in the run dtype, on the device
    try:
        with torch.device(device):
            if cfg.bidirectional:
                from ember.models.bert import BertModel

                model = BertModel(cfg)
            else:
                model = LlamaForCausalLM(cfg, max_positions, get_attention_backend(attention_backend))
    finally:
        torch.set_default_dtype(previous)
    load_weights(model, files.weights(cfg, seed, device, dtype, quantization), source=str(files.path))
    if quantization == "fp8" and (not isinstance(scheme, FP8Scheme) or files.load_format == "dummy"):
        # dense weights (a bf16 checkpoint, or dummy ones at an FP8 checkpoint's shapes): FP8 per
        # output row, every linear layer but what the checkpoint's ignore-list names
        from ember.loader.fp8_checkpoint import quantize_linear_layers

        quantize_linear_layers(model, scheme if isinstance(scheme, FP8Scheme) else None)
    if isinstance(scheme, IntScheme) and quantization == scheme.method and files.load_format == "dummy":
        from ember.loader.int_checkpoint import quantize_int_layers  # dense random weights at the model's shapes

        quantize_int_layers(model, scheme)
    if quantization != "none" and device == "cuda":
        # the dense parameters quantized layers replaced: their memory back to the device, where the
        # KV pool's sizing (free memory) sees it
        torch.cuda.empty_cache()
    return model.eval()


def load_vision_model(files: ModelFiles, cfg: ModelConfig, dtype: torch.dtype, device: str,
                      seed: int = 0, mmproj: str | None = None) -> nn.Module:
    """A vision-language checkpoint's image side (ModelConfig.vision: its tower and projector,
    models/llava.py, llava_next.py, qwen2_vl.py, qwen3_vl.py, pixtral.py), in `dtype` on `device`, its tensors
    read from the checkpoint, or from the `mmproj` GGUF beside a GGUF model (dummy weights:
    random); ValueError naming a tensor missing or of the wrong shape. A parameter with a
    `weight_loader` (a Gemma norm's 1 + w) loads through it."""
    from ember.loader.safetensors import iter_pt, iter_safetensors
    from ember.models.gemma3_vision import Gemma3Vision, gemma3_tensor_name
    from ember.models.llava import LlavaVision, llava_tensor_name
    from ember.models.llava_next import LlavaNextVision, llava_next_tensor_name
    from ember.models.pixtral import PixtralVision, pixtral_tensor_name
    from ember.models.qwen2_vl import Qwen2VisionTower, qwen2_vl_tensor_name
    from ember.models.qwen3_vl import Qwen3VisionTower, qwen3_vl_tensor_name

    vision = cfg.vision
    module, tensor_name = {"llava": (LlavaVision, llava_tensor_name),
                           "llava_next": (LlavaNextVision, llava_next_tensor_name),
                           "qwen2_vl": (Qwen2VisionTower, qwen2_vl_tensor_name),
                           "qwen2_5_vl": (Qwen2VisionTower, qwen2_vl_tensor_name),
                           "qwen3_vl": (Qwen3VisionTower, qwen3_vl_tensor_name),
                           "pixtral": (PixtralVision, pixtral_tensor_name),
                           "mistral3": (PixtralVision, pixtral_tensor_name),
                           "gemma3": (Gemma3Vision, gemma3_tensor_name)}[vision.kind]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = module(vision)
    finally:
        torch.set_default_dtype(previous)
    params = dict(model.named_parameters())
    if files.load_format == "dummy":
        generator = torch.Generator().manual_seed(seed)
        for param in params.values():
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        return _finish_loading(model)
    if mmproj is not None:
        from ember.loader.mmproj import iter_mmproj_weights

        source, tensors = mmproj, iter_mmproj_weights(mmproj, vision, list(params))
    else:
        read = iter_pt if files.load_format == "pt" else iter_safetensors
        source, tensors = files.path, read(files.path, lambda n: tensor_name(n, vision))
    done = set()
    for name, tensor in tensors:
        param = params.get(name)
        if param is None or param.shape != tensor.shape:
            raise ValueError(f"{source}: the image side's tensor {name!r} {tuple(tensor.shape)} fits no parameter "
                             f"of ember's {vision.kind} vision model")
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor)
        else:
            param.data.copy_(tensor)
        done.add(name)
    if missing := sorted(set(params) - done):
        raise ValueError(f"{source}: the checkpoint lacks the image side's tensors {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    return _finish_loading(model)


def _finish_loading(model: nn.Module) -> nn.Module:
    """The loaded image side in eval mode, each module with a `finish_loading` (layouts the
    weights take once read: qwen2_vl.VisionMLP's) told that its weights are in."""
    for module in list(model.modules()):
        if hasattr(module, "finish_loading"):
            module.finish_loading()
    return model.eval()
