"""ModelConfig.architecture -> model class."""

from torch import nn

from ember.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma2": LlamaForCausalLM,
    "gemma3": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
    "mixtral": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,
    "qwen2_moe": LlamaForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; ember runs {sorted(_MODELS)}")
    return _MODELS[architecture]
