"""Finding and loading model files: every way it can go wrong is a ValueError that says what
is wrong and what to do; load_format="dummy" gives seeded random weights at real shapes.

The HF directories here hold a tiny Llama (hidden 64, 2 layers, 4 heads, 2 KV heads) whose
safetensors are written from `iter_dummy_weights`, with one thing broken per test."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ember import LLM, SamplingParams
from ember.loader.dummy import iter_dummy_weights
from ember.loader.model_files import load_model, locate_model
from ember.loader.weights import hf_weight_shapes
from ember.models.config import ModelConfig

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
TINY_ARGS = {"num_kv_blocks": 8, "block_size": 16, "dtype": "float32"}  # a small KV pool: no need for the 1 GiB default


def tiny_cfg() -> ModelConfig:
    return ModelConfig.from_hf_config(TINY)


def write_hf_dir(path: Path, tensors: dict[str, torch.Tensor] | None = None, config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY if config is None else config))
    if tensors is None:
        tensors = dict(iter_dummy_weights(tiny_cfg(), seed=0))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def weights(changes: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """The tiny model's seed-0 tensors, with some replaced (a tensor) or removed (None)."""
    w = dict(iter_dummy_weights(tiny_cfg(), seed=0))
    for name, t in changes.items():
        if t is None:
            del w[name]
        else:
            w[name] = t
    return w


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_hf_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def load_error(path: Path | str, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        LLM(str(path), **TINY_ARGS, **kwargs)
    return str(info.value)


# ---- where the model is ----------------------------------------------------------------

def test_missing_path():
    msg = load_error("/nonexistent/model.gguf")
    assert "model '/nonexistent/model.gguf' not found" in msg
    assert "pass a .gguf file, an HF model directory (config.json + *.safetensors), or a Hugging Face Hub id" in msg


def test_directory_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    msg = load_error(tmp_path)
    assert msg == f"{tmp_path} has no config.json: an HF model directory needs config.json and *.safetensors"


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 64)
    msg = load_error(path)
    assert msg == f"{path} is a file but not a .gguf: pass a .gguf file or an HF model directory"


def test_truncated_gguf(tmp_path, gguf_path):
    path = tmp_path / "x.gguf"
    with open(gguf_path, "rb") as src:
        path.write_bytes(src.read(gguf_path.stat().st_size // 2))
    msg = load_error(path)
    # the header is whole; the first tensor past the end is named
    assert msg.startswith(f"{path} is truncated or corrupt: tensor 'blk.15.attn_output.weight' needs bytes")
    assert msg.endswith("Download or convert it again.")


def test_gguf_name_on_something_else(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"hello, this is text")
    msg = load_error(path)
    assert msg.startswith(f"{path} is not a GGUF file: it starts with b'hell', a GGUF file starts with b'GGUF'")


def test_load_format_that_does_not_fit(tiny_dir, gguf_path):
    assert load_error(gguf_path, load_format="safetensors") == (
        "load_format='safetensors' does not fit a .gguf file: use 'auto' or 'gguf'")
    assert load_error(tiny_dir, load_format="gguf") == (
        "load_format='gguf' does not fit an HF directory: use 'auto', 'safetensors' or 'pt'")


def test_locate_model_picks_the_format(tiny_dir, gguf_path):
    assert locate_model(str(gguf_path), "auto").load_format == "gguf"
    assert locate_model(str(tiny_dir), "auto").load_format == "safetensors"
    assert locate_model(str(tiny_dir), "dummy").load_format == "dummy"


# ---- config.json ------------------------------------------------------------------------

def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4}))
    msg = load_error(tmp_path)
    assert "unsupported architecture 'GPTNeoXForCausalLM' (model_type 'gpt_neox')" in msg
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                      "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"):
        assert supported in msg


def test_heads_not_a_multiple_of_kv_heads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY | {"num_key_value_heads": 3}))
    assert load_error(tmp_path) == "num_heads (4) must be a multiple of num_kv_heads (3)"


def test_config_json_missing_a_required_key(tmp_path):
    config = dict(TINY)
    del config["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    msg = load_error(tmp_path)
    assert "num_attention_heads" in msg and "config.json" in msg


def test_config_json_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    msg = load_error(tmp_path)
    assert "config.json" in msg


def test_directory_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert load_error(tmp_path) == (
        f"{tmp_path} holds no .safetensors file: ember loads HF checkpoints in safetensors format "
        "(or pytorch_model*.bin)")


# ---- the checkpoint's tensors -------------------------------------------------------------

def test_missing_tensor(tmp_path):
    path = write_hf_dir(tmp_path / "m", weights({"model.layers.1.mlp.down_proj.weight": None}))
    assert load_error(path) == (
        f"{path} does not match the model (LlamaForCausalLM): 1 missing: model.layers.1.mlp.down_proj.weight")


def test_missing_shard_of_a_merged_projection_is_reported(tmp_path):
    path = write_hf_dir(tmp_path / "m", weights({"model.layers.0.self_attn.k_proj.weight": None}))
    msg = load_error(path)
    assert "1 missing" in msg and "model.layers.0.self_attn" in msg


def test_missing_shard_is_named_as_in_the_checkpoint(tmp_path):
    path = write_hf_dir(tmp_path / "m", weights({"model.layers.0.self_attn.k_proj.weight": None}))
    assert "model.layers.0.self_attn.k_proj.weight" in load_error(path)


def test_extra_unknown_tensor(tmp_path):
    path = write_hf_dir(tmp_path / "m", weights({"model.layers.0.mlp.extra_proj.weight": torch.zeros(3, 4)}))
    assert load_error(path) == (
        f"{path} does not match the model (LlamaForCausalLM): 1 unknown tensor(s): "
        "model.layers.0.mlp.extra_proj.weight")


def test_missing_and_unknown_together(tmp_path):
    w = weights({"model.norm.weight": None})
    w["model.final_norm.weight"] = torch.ones(64)
    path = write_hf_dir(tmp_path / "m", w)
    assert load_error(path) == (
        f"{path} does not match the model (LlamaForCausalLM): 1 unknown tensor(s): model.final_norm.weight "
        "1 missing: model.norm.weight")


def test_tensor_of_the_wrong_shape(tmp_path):
    path = write_hf_dir(tmp_path / "m", weights({"model.layers.1.mlp.down_proj.weight": torch.zeros(64, 100)}))
    msg = load_error(path)
    assert "'model.layers.1.mlp.down_proj.weight'" in msg
    assert "parameter (64, 128), checkpoint (64, 100)" in msg


def test_shard_of_the_wrong_shape(tmp_path):
    path = write_hf_dir(tmp_path / "m", weights({"model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 64)}))
    msg = load_error(path)
    assert "'model.layers.0.self_attn.q_proj.weight'" in msg
    assert "parameter (64, 64), checkpoint (32, 64)" in msg


def test_tied_checkpoint_may_carry_an_lm_head_copy(tmp_path):
    """Some tied checkpoints store lm_head.weight anyway: it is skipped, not 'unknown'."""
    config = TINY | {"tie_word_embeddings": True}
    w = dict(iter_dummy_weights(ModelConfig.from_hf_config(config), seed=0))
    assert "lm_head.weight" not in w
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
    path = write_hf_dir(tmp_path / "m", w, config)
    llm = LLM(str(path), **TINY_ARGS)
    assert llm.engine.runner.model.config.tie_word_embeddings


# ---- load_format="dummy" -----------------------------------------------------------------

# ember's parameters (q|k|v and gate|up merged) for the tiny config
EXPECTED_SHAPES = {
    "model.embed_tokens.weight": (256, 64),
    "model.norm.weight": (64,),
    "lm_head.weight": (256, 64),
    **{name: shape for i in range(2) for name, shape in {
        f"model.layers.{i}.input_layernorm.weight": (64,),
        f"model.layers.{i}.post_attention_layernorm.weight": (64,),
        f"model.layers.{i}.self_attn.qkv_proj.weight": (64 + 32 + 32, 64),
        f"model.layers.{i}.self_attn.o_proj.weight": (64, 64),
        f"model.layers.{i}.mlp.gate_up_proj.weight": (2 * 128, 64),
        f"model.layers.{i}.mlp.down_proj.weight": (64, 128),
    }.items()},
}


def dummy_model(path: Path, seed: int):
    files = locate_model(str(path), "dummy")
    return load_model(files, tiny_cfg(), max_positions=128, dtype=torch.float32, device="cpu",
                      attention_backend="torch", seed=seed)


def test_hf_weight_shapes_of_the_tiny_config():
    shapes = hf_weight_shapes(tiny_cfg())
    assert len(shapes) == 3 + 2 * 9
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (32, 64)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (128, 64)


def test_dummy_weights_have_the_model_shapes(tiny_dir):
    model = dummy_model(tiny_dir, seed=0)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == EXPECTED_SHAPES
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())


def test_dummy_weights_are_seeded(tiny_dir):
    a, b, c = (dict(dummy_model(tiny_dir, seed=s).named_parameters()) for s in (0, 0, 1))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert all(not torch.equal(a[n], c[n]) for n in a)


def test_dummy_ignores_the_checkpoint_files(tmp_path):
    """load_format='dummy' needs config.json alone: a broken checkpoint is never read."""
    path = write_hf_dir(tmp_path / "m", weights({"model.norm.weight": None}))
    model = dummy_model(path, seed=0)
    assert tuple(model.get_parameter("model.norm.weight").shape) == (64,)


@pytest.fixture(scope="module")
def dummy_llm(tiny_dir):
    return LLM(str(tiny_dir), load_format="dummy", **TINY_ARGS)


def test_dummy_llm_generates_from_token_ids(dummy_llm, tiny_dir):
    params = SamplingParams(temperature=0, max_tokens=4)
    out = dummy_llm.generate({"prompt_token_ids": [1, 2, 3]}, params)[0]
    assert out.prompt is None and out.prompt_token_ids == [1, 2, 3]
    c = out.outputs[0]
    assert len(c.token_ids) == 4 and all(0 <= t < 256 for t in c.token_ids)
    assert c.text == ""  # no tokenizer: no text
    assert c.finish_reason == "length"
    # the dummy weights are the seed-0 tensors written to model.safetensors: same tokens
    from_files = LLM(str(tiny_dir), **TINY_ARGS).generate({"prompt_token_ids": [1, 2, 3]}, params)[0]
    assert from_files.outputs[0].token_ids == c.token_ids
    pool = dummy_llm.engine.block_pool
    assert pool.num_in_use == 0 and pool.num_free == pool.num_blocks - 1  # its 6 tokens' partly filled block is cached


def test_no_tokenizer_text_prompt_says_to_pass_token_ids(dummy_llm, tiny_dir):
    expected = f"{tiny_dir} has no tokenizer: pass {{'prompt_token_ids': [...]}} prompts"
    for call in (lambda: dummy_llm.generate("hello"),
                 lambda: dummy_llm.chat([{"role": "user", "content": "hello"}]),
                 lambda: dummy_llm.get_tokenizer()):
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == expected


def test_no_tokenizer_and_no_eos_runs_to_max_tokens(dummy_llm):
    out = dummy_llm.generate([{"prompt_token_ids": [5]}, {"prompt_token_ids": list(range(40))}],
                             SamplingParams(temperature=0, max_tokens=6))
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]


def test_copied_dir_without_tokenizer_is_fine_with_safetensors(tmp_path, tiny_dir):
    """A tokenizer is optional for any HF dir, not only for dummy weights."""
    path = tmp_path / "copy"
    shutil.copytree(tiny_dir, path)
    llm = LLM(str(path), **TINY_ARGS)
    assert llm.tokenizer is None
    out = llm.generate({"prompt_token_ids": [7, 8]}, SamplingParams(temperature=0, max_tokens=2))[0]
    assert len(out.outputs[0].token_ids) == 2
