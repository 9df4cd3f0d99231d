"""models/families.py: one row a family, and the lookups every reader of a checkpoint uses."""

from __future__ import annotations

from ember.models.config import GGUF_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from ember.models.families import BY_GGUF_ARCHITECTURE, BY_GGUF_EXPERTS, BY_HF_ARCHITECTURE, BY_HF_MODEL_TYPE


def test_the_lookups_name_each_family_once():
    assert SUPPORTED_ARCHITECTURES == ("llama", "mistral", "mistral3", "qwen2", "qwen3", "gemma", "gemma2", "gemma3",
                                       "phi3", "mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3",
                                       "glm4_moe", "gpt_oss", "llama4", "qwen3_next", "gpt2", "opt", "phi", "bert",
                                       "xlm_roberta")
    assert GGUF_ARCHITECTURES == ("llama", "mistral", "mistral3", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3",
                                  "qwen3moe", "qwen2moe", "deepseek2", "glm4moe", "gpt-oss", "llama4", "qwen3next",
                                  "gpt2", "phi2", "qwen2vl", "qwen3vl")
    assert BY_GGUF_ARCHITECTURE["phi2"].name == "phi"
    # Qwen2-VL's and Qwen3-VL's text GGUFs: the qwen2 / qwen3 rows with M-RoPE
    assert BY_GGUF_ARCHITECTURE["qwen2vl"] is BY_GGUF_ARCHITECTURE["qwen2"]
    assert BY_GGUF_ARCHITECTURE["qwen3vl"].gguf_mrope == ("qwen3vl", True)
    assert BY_GGUF_ARCHITECTURE["mistral3"].gguf_rope_permuted  # Mistral 3's text GGUF: no HF architecture of its own
    assert {a: f.name for a, f in BY_GGUF_EXPERTS.items()} == {"llama": "mixtral", "qwen3moe": "qwen3_moe",
                                                               "qwen2moe": "qwen2_moe", "deepseek2": "deepseek_v2",
                                                               "glm4moe": "glm4_moe", "gpt-oss": "gpt_oss",
                                                               "llama4": "llama4", "qwen3next": "qwen3_next"}
    assert BY_HF_ARCHITECTURE["Gemma3ForConditionalGeneration"].name == "gemma3"
    assert BY_HF_MODEL_TYPE["gemma3_text"] is BY_HF_MODEL_TYPE["gemma3"] is BY_GGUF_ARCHITECTURE["gemma3"]
    assert len(BY_HF_ARCHITECTURE) == 35 and len(BY_HF_MODEL_TYPE) == 29
    assert BY_HF_ARCHITECTURE["Qwen2_5_VLForConditionalGeneration"] is BY_HF_MODEL_TYPE["qwen2_vl"] \
        is BY_HF_ARCHITECTURE["Qwen2ForCausalLM"]
    assert BY_HF_MODEL_TYPE["kimi_k2"] is BY_HF_ARCHITECTURE["DeepseekV3ForCausalLM"]
    assert BY_HF_ARCHITECTURE["XLMRobertaForSequenceClassification"] is BY_HF_MODEL_TYPE["xlm-roberta"]
