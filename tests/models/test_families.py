"""The families beyond Llama, and every RoPE scaling, on tiny random models saved by HF
transformers: ember's logits and greedy tokens equal transformers' (float32). Sliding
windows are shorter than the prompts, and are also run through chunked prefill and a
prefix-cache hit. Partial RoPE (Phi-4-mini's), from HF files and from llama.cpp's GGUF; and
Gemma 3's vision-language checkpoints (Gemma3ForConditionalGeneration) on text prompts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from family_checks import (
    CACHED,
    MAX_TOKENS,
    PROMPTS,
    WHOLE_BLOCKS,
    assert_chunked_and_cached,
    assert_logits_match,
    greedy_tokens,
    hf_greedy,
)

from ember import LLM, SamplingParams
from ember.loader.dummy import iter_dummy_weights
from ember.loader.model_files import ModelFiles
from ember.loader.weights import hf_weight_shapes
from ember.models.config import ModelConfig
from ember.scheduler.sliding_window import shared_window

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

pytestmark = pytest.mark.slow  # HF transformers on every model

BASE = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
LLAMA = BASE | {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 10000.0,
                "tie_word_embeddings": False}
WINDOW = 7  # shorter than most prompts below, and not a multiple of the block size (8)
PHI3 = BASE | {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "rope_theta": 10000.0,
               "max_position_embeddings": 1024, "original_max_position_embeddings": 256, "tie_word_embeddings": False}
FAMILIES = {
    # Gemma 1 as Google's config.json has it: the legacy "gelu" that means the tanh one, head_dim
    # apart from hidden / heads, no sandwich norms, windows or soft caps
    "gemma": BASE | {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "head_dim": 32,
                     "hidden_act": "gelu", "rope_theta": 10000.0},
    "gemma2": BASE | {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 32,
                      "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 24,
                      "sliding_window": WINDOW, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
                      "rope_theta": 10000.0},
    "gemma3": BASE | {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 32,
                      "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 32,
                      "sliding_window": WINDOW, "num_hidden_layers": 6,
                      "layer_types": ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
                      + ["full_attention"],
                      "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                             "rope_theta": 1000000.0},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "phi3": PHI3 | {"sliding_window": 2 * WINDOW,
                    "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                     "long_factor": [2.0 + 0.5 * i for i in range(8)]}},
    # Phi-4-mini: RoPE on 3/4 of each head (12 of 16 dims), LongRoPE factors for those 12
    "phi3_partial": PHI3 | {"partial_rotary_factor": 0.75,
                            "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(6)],
                                             "long_factor": [2.0 + 0.7 * i for i in range(6)]}},
    "mistral_window": BASE | {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                              "rope_theta": 10000.0, "sliding_window": WINDOW, "tie_word_embeddings": False},
    "qwen2_window": BASE | {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_theta": 10000.0,
                            "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2,
                            "tie_word_embeddings": True},
}
# each RoPE scaling on a Llama: one forward's logits (greedy tokens of a tiny random model
# hardly depend on the RoPE, the logits do)
ROPES = {
    "rope_linear": LLAMA | {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "rope_dynamic": LLAMA | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "rope_yarn": LLAMA | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 128}},
    "rope_yarn_mscale": LLAMA | {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "mscale": 0.707,
                                                  "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2,
                                                  "original_max_position_embeddings": 64}},
    # partial RoPE without scaling, the factor where transformers 5 writes it: among the RoPE parameters
    "rope_partial": PHI3 | {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5}},
}
# config.json as Google writes Gemma 3's: the text_config states its sizes, the window and the
# RoPE scaling, and leaves the rest (8 heads of 256, 4 KV heads, query_pre_attn_scalar, both
# RoPE bases, every sixth layer global, bos / eos) to Gemma3TextConfig's defaults; eos is outside
GEMMA3_VL = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 5],
    "boi_token_index": 317, "eoi_token_index": 318, "image_token_index": 319, "mm_tokens_per_image": 4,
    "text_config": {"model_type": "gemma3_text", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
                    "num_hidden_layers": 6, "sliding_window": WINDOW,
                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                      "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
}
# what the text_configs of Google's three state beside the window and the RoPE scaling
GEMMA3_SIZES = {
    "4b": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34},
    "12b": {"hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
            "num_key_value_heads": 8},
    "27b": {"hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32,
            "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168},
}
# the other spelling: transformers' own module names since 4.52 (model.language_model.*, ...),
# which checkpoints saved by some of its versions carry
NEWER_NAMES = {"language_model.model.": "model.language_model.", "vision_tower.": "model.vision_tower.",
               "multi_modal_projector.": "model.multi_modal_projector."}


def save_tiny_model(config: dict, path) -> ModelConfig:
    """config.json and seeded random weights (safetensors) in `path`, as a checkpoint would be."""
    (path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_hf_config(config)
    save_file({n: t.contiguous() for n, t in iter_dummy_weights(cfg, seed=7)}, str(path / "model.safetensors"))
    return cfg


def build(name: str, config: dict, tmp_path_factory, max_model_len: int = 256):
    path = tmp_path_factory.mktemp(name)
    cfg = save_tiny_model(config, path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return cfg, hf, LLM(str(path), num_kv_blocks=128, block_size=8, max_model_len=max_model_len, dtype="float32")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    # max_model_len 256: within Phi-3's trained context, where transformers uses LongRoPE's short factors
    cfg, hf, llm = build(request.param, FAMILIES[request.param], tmp_path_factory)
    expected = [hf_greedy(hf, ids, MAX_TOKENS) for ids in PROMPTS]
    return request.param, cfg, hf, llm, expected


def test_hf_holds_exactly_the_tensors_ember_expects(family):
    _, cfg, hf, _, _ = family
    theirs = set(hf.state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert set(hf_weight_shapes(cfg)) == theirs


def test_logits_match_hf(family, forward_logits):
    _, _, hf, llm, _ = family
    assert_logits_match(llm, hf, PROMPTS, forward_logits)


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_scaling_logits_match_hf(name, tmp_path_factory, forward_logits):
    _, hf, llm = build(name, ROPES[name], tmp_path_factory)
    assert_logits_match(llm, hf, PROMPTS, forward_logits)


@pytest.mark.parametrize("name,length", [("phi3", 300), ("phi3_partial", 300), ("rope_dynamic", 600)])
def test_context_dependent_rope_beyond_the_trained_context(name, length, tmp_path_factory, forward_logits):
    """LongRoPE's long factors and dynamic NTK's larger base hold for a served context past
    the trained one; transformers picks them by the sequence's length, so a prompt of the
    served length gets the same RoPE from both."""
    config = (FAMILIES | ROPES)[name]
    _, hf, llm = build(name, config, tmp_path_factory, max_model_len=length)
    prompt = torch.randint(3, 320, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = forward_logits(llm, [prompt])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_greedy_matches_hf(family):
    _, _, _, llm, expected = family
    assert greedy_tokens(llm) == expected


def test_chunked_prefill_and_prefix_hit_match_hf(family):
    """The window must see the same keys through chunks and over the cache. Where every layer has
    a window, blocks behind it go back to the pool and a hit ends on a block boundary."""
    _, _, _, llm, expected = family
    windowed = shared_window(llm.config.model_config.layer_windows) is not None
    assert_chunked_and_cached(llm.config.model, expected, WHOLE_BLOCKS if windowed else CACHED)


def test_config_reads_the_options():
    g2 = ModelConfig.from_hf_config(FAMILIES["gemma2"])
    assert (g2.layer_windows, g2.attn_logit_softcap, g2.final_logit_softcap) == ((7, None, 7, None), 5.0, 3.0)
    assert (g2.hidden_act, g2.norm_unit_offset, g2.sandwich_norms, g2.tie_word_embeddings) == \
        ("gelu_tanh", True, True, True)
    assert g2.attention_scale == 24 ** -0.5 and g2.embed_scale == 8.0
    g3 = ModelConfig.from_hf_config(FAMILIES["gemma3"])
    assert g3.layer_windows == (7, 7, None, 7, 7, None) and g3.qk_norm
    assert (g3.rope_theta, g3.rope_scaling.kind, g3.rope_scaling.factor, g3.local_rope_theta) == \
        (1e6, "linear", 8.0, 10000.0)
    phi = ModelConfig.from_hf_config(FAMILIES["phi3"])
    assert (phi.rope_scaling.kind, phi.rope_scaling.factor, phi.rope_scaling.original_max_position_embeddings) == \
        ("longrope", 4.0, 256)
    assert (phi.head_dim, phi.rotary_dim) == (16, 16)
    assert ModelConfig.from_hf_config(FAMILIES["phi3_partial"]).rotary_dim == 12
    assert ModelConfig.from_hf_config(ROPES["rope_partial"]).rotary_dim == 8
    assert ModelConfig.from_hf_config(FAMILIES["qwen2_window"]).layer_windows == (None, None, 7, 7)
    assert ModelConfig.from_hf_config(FAMILIES["mistral_window"]).layer_windows == (7,) * 4
    off = FAMILIES["qwen2_window"] | {"use_sliding_window": False}
    assert ModelConfig.from_hf_config(off).layer_windows is None


@pytest.mark.parametrize("config,message", [
    (LLAMA | {"architectures": ["FooForCausalLM"]}, "unsupported architecture 'FooForCausalLM'"),
    (LLAMA | {"rope_scaling": {"rope_type": "fancy", "factor": 2.0}},
     "unsupported rope_scaling type 'fancy'; ember supports default, linear, dynamic, yarn, longrope, llama3"),
    (FAMILIES["phi3"] | {"partial_rotary_factor": 0.75},
     "LongRoPE's short_factor has 8 entries; a RoPE over 12 dims of each head needs 6"),
    (LLAMA | {"partial_rotary_factor": 0.2}, "rotary_dim 3 must be even and within head_dim 16"),
    ({k: v for k, v in GEMMA3_VL.items() if k != "text_config"},
     "a Gemma3ForConditionalGeneration config.json needs a `text_config`"),
    (GEMMA3_VL | {"text_config": {"model_type": "gemma3_text", "intermediate_size": 96}},
     "the text_config of this Gemma3ForConditionalGeneration config.json lacks hidden_size, num_hidden_layers: "
     "no default stands in for the language model's sizes"),
    (FAMILIES["gemma2"] | {"layer_types": ["sliding_attention", "chunked_attention"] * 2},
     "layer_types must list"),
])
def test_refusals_say_what_is_wrong(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_hf_config(config)


def test_partial_rope_from_a_llama_cpp_gguf_matches_hf(tmp_path_factory, gguf_convert, spm_tokenizer_dir,
                                                       forward_logits):
    """llama.cpp's converter writes Phi-4-mini's partial RoPE as phi3.rope.dimension_count and
    the LongRoPE factors (rotary_dim / 2 each) as tensors: ember's model from the GGUF file
    gives transformers' logits."""
    path = tmp_path_factory.mktemp("phi3_partial_gguf")
    save_tiny_model(FAMILIES["phi3_partial"] | {"vocab_size": 512}, path)  # the SentencePiece tokenizer's
    for f in spm_tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    gguf = gguf_convert(path, "f32")
    cfg = ModelFiles(gguf, "gguf").model_config()
    assert (cfg.architecture, cfg.head_dim, cfg.rotary_dim) == ("phi3", 16, 12)
    stored = torch.tensor(FAMILIES["phi3_partial"]["rope_scaling"]["short_factor"]).tolist()  # float32 in the file
    assert (cfg.rope_scaling.kind, list(cfg.rope_scaling.short_factor)) == ("longrope", stored)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert_logits_match(LLM(str(gguf), num_kv_blocks=64, block_size=8, max_model_len=256, kv_cache_dtype="float32"), hf, PROMPTS, forward_logits)


# -- Gemma 3 4B/12B/27B: Gemma3ForConditionalGeneration on text prompts (images: test_gemma3_vision.py)

GEMMA_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
# a Gemma 3 style chat template (string or text-part contents, the system text in the first user turn)
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
  {%- set system = messages[0]['content'] -%}
  {%- set first_user_prefix = (system if system is string else system[0]['text']) + '\\n\\n' -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set first_user_prefix = '' -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
  {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
  {%- if message['content'] is string -%}
    {{ message['content'] | trim }}
  {%- else -%}
    {%- for part in message['content'] -%}
      {%- if part['type'] == 'image' -%}{{ '<start_of_image>' }}
      {%- elif part['type'] == 'text' -%}{{ part['text'] | trim }}{%- endif -%}
    {%- endfor -%}
  {%- endif -%}
  {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"""


def write_gemma3_processor_files(path) -> None:
    """The tokenizer and processor files a Gemma 3 checkpoint carries, made up: a word-level
    tokenizer.json (Gemma's special tokens first, the image tokens last), tokenizer_config.json,
    the processor's chat_template.json, processor_config.json, preprocessor_config.json, and
    generation_config.json with end_of_turn among the eos ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    image_tokens = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    words = ["user", "model", "be", "terse", "what", "is", "the", "capital", "of", "france", "?", "."]
    vocab = {t: i for i, t in enumerate(GEMMA_TOKENS + words)}
    vocab |= {f"w{i}": i for i in range(len(vocab), 317)} | {t: 317 + i for i, t in enumerate(image_tokens)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA_TOKENS + image_tokens])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.decoder = decoders.WordPiece()
    tok.save(str(path / "tokenizer.json"))
    files = {
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
                                  "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                                  "add_bos_token": True, "processor_class": "Gemma3Processor",
                                  "boi_token": image_tokens[0], "eoi_token": image_tokens[1],
                                  "image_token": image_tokens[2]},
        "chat_template.json": {"chat_template": GEMMA3_TEMPLATE},
        "processor_config.json": {"image_seq_length": 4, "processor_class": "Gemma3Processor"},
        "preprocessor_config.json": {"image_processor_type": "Gemma3ImageProcessor",
                                     "size": {"height": 28, "width": 28}, "image_mean": [0.5] * 3,
                                     "image_std": [0.5] * 3},
        "generation_config.json": {"bos_token_id": 2, "eos_token_id": [1, 5], "pad_token_id": 0},
    }
    for name, content in files.items():
        (path / name).write_text(json.dumps(content))


@pytest.fixture(scope="module")
def gemma3_vl(tmp_path_factory):
    """(directory as transformers saved it, the same with the newer tensor names, the HF model,
    the ModelConfig, HF's greedy tokens for PROMPTS): the language model's weights are ember's
    seeded dummy ones, the vision tower's transformers' own random init."""
    cfg = ModelConfig.from_hf_config(GEMMA3_VL)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config.from_dict(GEMMA3_VL))
    text = {n.removeprefix("model."): t for n, t in iter_dummy_weights(cfg, seed=7)}
    model.model.language_model.load_state_dict(text, strict=True)
    saved = tmp_path_factory.mktemp("gemma3_vl")
    model.save_pretrained(str(saved))
    (saved / "config.json").write_text(json.dumps(GEMMA3_VL))  # Google's terse one, not transformers' full one
    write_gemma3_processor_files(saved)
    renamed = tmp_path_factory.mktemp("gemma3_vl_newer_names")
    shutil.copytree(saved, renamed, dirs_exist_ok=True)
    from safetensors.torch import load_file

    tensors = load_file(str(saved / "model.safetensors"))
    save_file({_rename(n, NEWER_NAMES): t for n, t in tensors.items()}, str(renamed / "model.safetensors"),
              metadata={"format": "pt"})
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(saved), dtype=torch.float32).eval()
    return saved, renamed, hf, cfg, [hf_greedy(hf, ids, MAX_TOKENS) for ids in PROMPTS]


def _rename(name: str, prefixes: dict[str, str]) -> str:
    return next((new + name[len(old):] for old, new in prefixes.items() if name.startswith(old)), name)


def _tensor_names(path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_gemma3_vl_names_as_transformers_writes_them(gemma3_vl):
    """The installed transformers writes the older spelling; it reads the newer one into the
    same model (so both are checkpoints people have)."""
    saved, renamed, hf = gemma3_vl[:3]
    tops = {".".join(n.split(".")[:2]) if n.startswith("language_model") else n.split(".")[0]
            for n in _tensor_names(saved)}
    assert tops == {"language_model.model", "vision_tower", "multi_modal_projector"}
    assert {_rename(n, NEWER_NAMES) for n in _tensor_names(saved)} == _tensor_names(renamed)
    again = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(renamed), dtype=torch.float32)
    theirs = again.state_dict()
    assert all(torch.equal(t, theirs[n]) for n, t in hf.state_dict().items())


def test_gemma3_vl_config_is_its_text_config_filled_as_transformers_fills_it(gemma3_vl):
    hf, cfg = gemma3_vl[2:4]
    text = hf.config.text_config
    assert (cfg.architecture, cfg.multimodal, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        ("gemma3", True, text.num_attention_heads, text.num_key_value_heads, text.head_dim) == \
        ("gemma3", True, 8, 4, 256)
    assert cfg.attention_scale == text.query_pre_attn_scalar ** -0.5 == 256 ** -0.5
    assert (cfg.rope_theta, cfg.rope_scaling.kind, cfg.rope_scaling.factor, cfg.local_rope_theta) == \
        (1e6, "linear", 8.0, 10000.0)
    assert cfg.layer_windows == tuple(WINDOW if t == "sliding_attention" else None for t in text.layer_types) == \
        (WINDOW,) * 5 + (None,)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.max_position_embeddings, cfg.hidden_act, cfg.tie_word_embeddings) \
        == (2, 1, 131072, "gelu_tanh", True)


@pytest.mark.parametrize("size", sorted(GEMMA3_SIZES))
def test_gemma3_vl_configs_of_google_sizes_read_as_transformers_reads_them(size):
    """Google's terse config.json and transformers' filled-in Gemma3Config of it (every key
    written out, RoPE in transformers 5's nested rope_parameters) give one ModelConfig."""
    config = GEMMA3_VL | {"text_config": {"model_type": "gemma3_text", "sliding_window": 1024,
                                          "rope_scaling": {"rope_type": "linear", "factor": 8.0}} | GEMMA3_SIZES[size]}
    ours = ModelConfig.from_hf_config(config)
    assert ours == ModelConfig.from_hf_config(transformers.Gemma3Config.from_dict(config).to_dict())
    assert (ours.vocab_size, ours.layer_windows[:6]) == (262208, (1024,) * 5 + (None,))
    text_only = config["text_config"] | {"architectures": ["Gemma3ForCausalLM"]}  # a Gemma3ForCausalLM's, as for 1B
    assert ModelConfig.from_hf_config(text_only) == \
        ModelConfig.from_hf_config(transformers.Gemma3TextConfig.from_dict(text_only).to_dict())


@pytest.fixture(scope="module", params=["as_saved", "newer_names"])
def gemma3_vl_llm(request, gemma3_vl):
    saved, renamed = gemma3_vl[:2]
    path = saved if request.param == "as_saved" else renamed
    return path, LLM(str(path), num_kv_blocks=128, block_size=8, max_model_len=256, dtype="float32")


def test_gemma3_vl_logits_and_greedy_match_hf(gemma3_vl, gemma3_vl_llm, forward_logits):
    """Text-only input: ember's language model gives Gemma3ForConditionalGeneration's logits
    and greedy tokens, from either spelling of the checkpoint."""
    hf, expected = gemma3_vl[2], gemma3_vl[4]
    llm = gemma3_vl_llm[1]
    assert_logits_match(llm, hf, PROMPTS, forward_logits)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_gemma3_vl_language_model_reads_only_its_tensors(gemma3_vl, gemma3_vl_llm, monkeypatch):
    """The language model's loader reads only its tensors (the header lists the vision tower's,
    which models/gemma3_vision.py's loader reads: get_tensor is never asked for them here), under
    the causal LM's names."""
    import safetensors

    path = gemma3_vl_llm[0]
    cfg = gemma3_vl[3]
    read: list[str] = []
    opened = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = opened(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.file.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    names = [name for name, _ in ModelFiles(path, "safetensors").weights(cfg, seed=0)]
    assert set(names) == set(hf_weight_shapes(cfg)) and len(names) == len(read)
    prefix = "language_model.model." if path == gemma3_vl[0] else "model.language_model."
    assert all(n.startswith(prefix) for n in read)
    assert len(_tensor_names(path)) > len(read)  # the vision tower and the projector are in the file


def test_gemma3_vl_chat_through_the_checkpoint_tokenizer_files(gemma3_vl, gemma3_vl_llm):
    """tokenizer.json + tokenizer_config.json + the processor's chat_template.json, as Gemma 3
    checkpoints carry them: the chat prompt (text parts too) renders and tokenizes as
    transformers' does with that template, the eos ids include generation_config.json's
    end_of_turn, and the greedy tokens are transformers'."""
    path, llm = gemma3_vl_llm
    hf = gemma3_vl[2]
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path))
    messages = [{"role": "system", "content": "be terse ."},
                {"role": "user", "content": [{"type": "text", "text": "what is the capital of france ?"}]}]
    template = json.loads((path / "chat_template.json").read_text())["chat_template"]  # as the processor reads it
    want = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=template)
    assert want == "<bos><start_of_turn>user\nbe terse .\n\nwhat is the capital of france ?<end_of_turn>\n" \
                   "<start_of_turn>model\n"
    ids = hf_tok.encode(want, add_special_tokens=False)
    assert ids[:3] == [2, 4, 6] and ids.count(2) == 1  # one bos, then <start_of_turn> user
    tok = llm.get_tokenizer()
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (2, 1, {1, 5})
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.prompt == want and out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, 8)
