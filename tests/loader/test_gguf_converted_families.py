"""The newer families as llama.cpp users get them: tiny random HF models converted to GGUF
by llama.cpp's own convert_hf_to_gguf.py (f32), then run by ember from the GGUF file. The
same greedy tokens as ember from the HF directory, as transformers and as llama.cpp itself
(where its llama-server is built); one forward's logits as transformers'; and generation
ends at each family's end-of-turn token.

Six models, each with a SentencePiece tokenizer.model (trained in tests/conftest.py) and
the added tokens its family's chat format uses:

- Gemma 1: the plain one (pre-norms only, no window, no caps)
- Gemma 2: soft-caps, a local layer then a global one (window 16, shorter than the prompts)
- Gemma 3: 7 layers (every 6th global, so the 7th slides again), q/k norms, its sliding
  layers' own RoPE base (10000) and linear scaling on the global ones
- Phi-3: fused q/k/v and gate/up, LongRoPE (short and long factors, stored as tensors)
- Qwen3: q/k norms (an LM head of its own: a tiny random model's tied one mostly repeats
  the last token, and greedy tokens would tell little)
- Llama 3.1: llama3 RoPE scaling, which the converter bakes into a rope_freqs tensor

Gemma's attention scale is head_dim ** -0.5 here (query_pre_attn_scalar = head_dim): the
converter does not write query_pre_attn_scalar, and llama.cpp derives it from the model's
size (head_dim, or hidden / heads for the 27B ones), as ember does for a GGUF.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams
from ember.layers.rotary import rope_inv_freq
from ember.loader.dummy import iter_dummy_weights
from ember.loader.gguf import open_gguf
from ember.loader.tokenizer import Tokenizer
from ember.loader.tokenizer_files import load_tokenizer
from ember.models.config import ModelConfig

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
from safetensors.torch import save_file  # noqa: E402

pytestmark = pytest.mark.slow

WINDOW = 16
BASE = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
GEMMA = BASE | {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 16, "sliding_window": WINDOW}
GEMMA_TURNS = ("<start_of_turn>", "<end_of_turn>")
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                  "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@dataclass(frozen=True)
class Variant:
    config: dict
    arch: str  # the GGUF's general.architecture
    tokenizer_class: str
    added: tuple[str, ...]  # added special tokens, ids 512, 513, ...
    end_of_turn: str  # the chat format's end-of-turn token
    end_of_generation: frozenset[int]  # the ids llama.cpp stops at: EOS, the turn's end, </s>, ...
    eos: str = "</s>"  # tokenizer_config's eos_token
    chat_template: str | None = None
    eot_id: int | None = None  # tokenizer.ggml.eot_token_id as the converter writes it


VARIANTS = {
    # Gemma 1: no window, soft caps or sandwich norms; config.json's legacy "gelu". The converter
    # writes the real Gemma's <end_of_turn> (107) as the EOT id whatever the vocabulary: llama.cpp
    # and ember stop there too
    "gemma": Variant(BASE | {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "vocab_size": 514,
                             "hidden_act": "gelu", "rope_theta": 10000.0},
                     "gemma", "GemmaTokenizer", GEMMA_TURNS, "<end_of_turn>", frozenset({2, 107, 513}),
                     chat_template=GEMMA_TEMPLATE, eot_id=107),
    "gemma2": Variant(GEMMA | {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 514,
                               "rope_theta": 10000.0, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
                      "gemma2", "GemmaTokenizer", GEMMA_TURNS, "<end_of_turn>", frozenset({2, 513}),
                      chat_template=GEMMA_TEMPLATE),
    "gemma3": Variant(GEMMA | {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 514,
                               "num_hidden_layers": 7,
                               "layer_types": ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
                               "rope_parameters": {
                                   "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
                      "gemma3", "GemmaTokenizer", GEMMA_TURNS, "<end_of_turn>", frozenset({2, 513}),
                      chat_template=GEMMA_TEMPLATE),
    # Phi-3-mini's layout: <|endoftext|> the EOS, <|end|> the end of a turn
    "phi3": Variant(BASE | {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 516,
                            "rope_theta": 10000.0, "max_position_embeddings": 1024,
                            "original_max_position_embeddings": 256, "tie_word_embeddings": False, "eos_token_id": 512,
                            "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                             "long_factor": [2.0 + 0.5 * i for i in range(8)]}},
                    "phi3", "LlamaTokenizer", ("<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"),
                    "<|end|>", frozenset({2, 512, 514}), eos="<|endoftext|>"),
    # a Qwen base model's layout: <|endoftext|> the EOS, ChatML's <|im_end|> the end of a turn
    "qwen3": Variant(BASE | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 515,
                             "rope_theta": 1e6, "tie_word_embeddings": False, "eos_token_id": 512},
                     "qwen3", "LlamaTokenizer", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                     "<|im_end|>", frozenset({2, 512, 514}), eos="<|endoftext|>"),
    # wavelengths 6, 33, 168, ... against an original context of 64: one frequency kept, one
    # blended, the rest divided by the factor
    "llama31": Variant(BASE | {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 514,
                               "rope_theta": 500000.0, "tie_word_embeddings": False,
                               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
                       "llama", "LlamaTokenizer", ("<|eot_id|>", "<|eom_id|>"), "<|eot_id|>",
                       frozenset({2, 512, 513})),
}
PROMPTS = ["The quick brown fox", "def load(path):\n",
           "Every request has a prompt and a budget of new tokens; the scheduler gives each request a share"]
MAX_TOKENS = 32
# a float32 KV cache: auto is float16 with GGUF blocks on the CPU (llama.cpp's default), and
# the logits are compared with transformers' float32 ones at 1e-4
ENGINE = dict(num_kv_blocks=32, block_size=8, max_model_len=256, dtype="float32", kv_cache_dtype="float32")


def write_tokenizer(root: Path, spm_dir: Path, v: Variant) -> None:
    """tokenizer.model, tokenizer.json and tokenizer_config.json (with added_tokens_decoder,
    which the converter reads the added tokens from) for the variant's tokenizer class."""
    shutil.copy(spm_dir / "tokenizer.model", root / "tokenizer.model")
    added = {str(512 + i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                            "single_word": False} for i, t in enumerate(v.added)}
    # no pad or mask token of its own (GemmaTokenizer would add both)
    config = {"tokenizer_class": v.tokenizer_class, "bos_token": "<s>", "eos_token": v.eos, "unk_token": "<unk>",
              "pad_token": "<unk>", "mask_token": None, "add_bos_token": True, "add_eos_token": False,
              "added_tokens_decoder": added}
    if v.tokenizer_class == "LlamaTokenizer":
        config["legacy"] = True  # as spm_tokenizer_dir: llama.cpp's "▁" after special tokens
    if v.chat_template:
        config["chat_template"] = v.chat_template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    hf = transformers.AutoTokenizer.from_pretrained(str(root))
    assert len(hf) == v.config["vocab_size"]
    hf.save_pretrained(str(root))  # tokenizer.json
    (root / "tokenizer_config.json").write_text(json.dumps(config))  # saving drops some keys


@dataclass
class Converted:
    name: str
    variant: Variant
    hf_dir: Path
    gguf: Path
    hf_tokenizer: object  # transformers', from the HF directory
    tokenizer: Tokenizer  # ember's, from the GGUF


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def converted(request, tmp_path_factory, gguf_convert, spm_tokenizer_dir) -> Converted:
    name, v = request.param, VARIANTS[request.param]
    root = tmp_path_factory.mktemp(name)
    (root / "config.json").write_text(json.dumps(v.config))
    cfg = ModelConfig.from_hf_config(v.config)
    save_file({n: t.contiguous() for n, t in iter_dummy_weights(cfg, seed=11)}, str(root / "model.safetensors"))
    write_tokenizer(root, spm_tokenizer_dir, v)
    path = gguf_convert(root, "f32")
    return Converted(name, v, root, path, transformers.AutoTokenizer.from_pretrained(str(root)), load_tokenizer(path))


def test_the_converter_wrote_what_we_test(converted: Converted) -> None:
    f = open_gguf(converted.gguf)
    md, v = f.metadata, converted.variant
    assert f.architecture == v.arch
    assert md["tokenizer.ggml.model"] == "llama"
    assert {f.tensor_info(n).qtype_name for n in f.tensor_names} == {"F32"}
    assert md["tokenizer.ggml.eos_token_id"] == converted.tokenizer.backend.token_to_id(v.eos)
    assert md.get("tokenizer.ggml.eot_token_id") == v.eot_id  # else the end of a turn is known by its text alone
    rope_tensors = {n for n in f.tensor_names if n.startswith("rope_")}
    if converted.name == "gemma3":
        assert (md["gemma3.rope.freq_base"], md["gemma3.rope.freq_base_swa"]) == (1e6, 10000.0)
        assert (md["gemma3.rope.scaling.type"], md["gemma3.rope.scaling.factor"]) == ("linear", 8.0)
        assert md["gemma3.attention.sliding_window"] == WINDOW
        assert "gemma3.attention.sliding_window_pattern" not in md  # llama.cpp's default: every 6th global
    if converted.name == "gemma2":
        assert (md["gemma2.attention.sliding_window"], md["gemma2.attn_logit_softcapping"],
                md["gemma2.final_logit_softcapping"]) == (WINDOW, 5.0, 3.0)
    assert rope_tensors == {"phi3": {"rope_factors_long.weight", "rope_factors_short.weight"},
                            "llama31": {"rope_freqs.weight"}}.get(converted.name, set())
    if converted.name == "phi3":
        assert md["phi3.rope.scaling.original_context_length"] == 256
        assert md["phi3.rope.scaling.attn_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(256)))


def test_config_from_gguf_is_the_hf_one(converted: Converted) -> None:
    """Every field the same as from config.json, up to float32 rounding of the stored numbers,
    and the same RoPE frequencies (Llama 3.1's as a tensor of divisors, LongRoPE's factors
    from tensors): global and local."""
    f = open_gguf(converted.gguf)
    ours = ModelConfig.from_gguf_metadata(f.metadata, f.tensor_names, lambda n: f.tensor(n).tolist())
    hf = ModelConfig.from_hf_config(converted.variant.config)
    assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-7)
    assert ours == dataclasses.replace(hf, rms_norm_eps=ours.rms_norm_eps, rope_scaling=ours.rope_scaling)
    for theta, scaling, hf_theta, hf_scaling in [(ours.rope_theta, ours.rope_scaling, hf.rope_theta, hf.rope_scaling),
                                                 (ours.local_rope_theta, ours.local_rope_scaling, hf.local_rope_theta,
                                                  hf.local_rope_scaling)]:
        if theta is None:
            continue
        inv_freq, factor = rope_inv_freq(ours.head_dim, theta, scaling, ENGINE["max_model_len"])
        hf_inv_freq, hf_factor = rope_inv_freq(hf.head_dim, hf_theta, hf_scaling, ENGINE["max_model_len"])
        torch.testing.assert_close(inv_freq, hf_inv_freq, rtol=1e-6, atol=0)
        assert factor == pytest.approx(hf_factor, rel=1e-7)
    if converted.name == "llama31":  # one frequency kept, one blended, the rest divided by 8
        factors = ours.rope_scaling.freq_factors
        assert (factors[0], factors[2:]) == (1.0, (8.0,) * 6) and 1.0 < factors[1] < 8.0
    if converted.name == "gemma3":
        assert (ours.layer_windows, ours.local_rope_theta) == ((WINDOW,) * 5 + (None, WINDOW), 10000.0)


def test_tokenizer_ids_match_hf(converted: Converted) -> None:
    hf, tok = converted.hf_tokenizer, converted.tokenizer
    texts = PROMPTS + ["Hello world", "multiple   spaces\tand\ttabs", "line one\nline two\n\n",
                       "".join(f"{t}a" for t in converted.variant.added)]
    for text in texts:
        assert tok.encode(text) == hf.encode(text), text
        assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text)), text
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (len(hf), hf.bos_token_id, hf.eos_token_id)


@pytest.fixture(scope="module")
def engines(converted: Converted):
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(converted.hf_dir), dtype=torch.float32).eval()
    return LLM(str(converted.gguf), **ENGINE), LLM(str(converted.hf_dir), **ENGINE), hf_model


@pytest.fixture(scope="module")
def greedy(converted: Converted, engines) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy tokens) of ember from the GGUF for each of PROMPTS, MAX_TOKENS
    tokens (ignore_eos), checked against ember from the HF directory and transformers."""
    from_gguf, from_dir, hf_model = engines
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ours, theirs = from_gguf.generate(PROMPTS, params), from_dir.generate(PROMPTS, params)
    for prompt, a, b in zip(PROMPTS, ours, theirs):
        ids = converted.hf_tokenizer.encode(prompt)
        assert a.prompt_token_ids == b.prompt_token_ids == ids
        assert len(a.outputs[0].token_ids) == MAX_TOKENS
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, prompt
        ref = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert a.outputs[0].token_ids == ref[0, len(ids):].tolist(), prompt
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in ours]


def test_greedy_matches_hf_dir_and_transformers(greedy) -> None:
    assert [len(tokens) for _, tokens in greedy] == [MAX_TOKENS] * len(PROMPTS)


def test_logits_match_transformers(converted: Converted, engines, greedy, forward_logits) -> None:
    """One forward over each prompt and its greedy continuation (longer than the window)."""
    from_gguf, _, hf_model = engines
    sequences = [prompt + tokens for prompt, tokens in greedy]
    assert min(len(ids) for ids in sequences) > WINDOW
    for ids, ours in zip(sequences, forward_logits(from_gguf, sequences)):
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_greedy_matches_llama_cpp(converted: Converted, greedy, llama_greedy) -> None:
    """llama.cpp's own greedy tokens on the same file, from the same prompt ids, and the same
    end-of-generation ids. llama.cpp stops at one of those (and includes it) or after
    MAX_TOKENS; ember's greedy tokens (the fixture's) went on past them (ignore_eos:
    llama.cpp's would bias them away instead), so they are cut after the first."""
    theirs = llama_greedy(converted.gguf, [prompt for prompt, _ in greedy], MAX_TOKENS, ctx=ENGINE["max_model_len"])
    eog = converted.tokenizer.eos_token_ids
    assert theirs.end_of_generation == eog
    ours = []
    for _, tokens in greedy:
        stop = next((i for i, t in enumerate(tokens) if t in eog), len(tokens) - 1)
        ours.append(tokens[:stop + 1])
    assert ours == theirs.tokens


def test_longrope_long_factors_match_llama_cpp(converted: Converted, engines, greedy, llama_greedy,
                                               forward_logits) -> None:
    """Served past Phi-3's trained context (256), ember and llama.cpp both turn by the long
    factors (each picks them by the context it serves). The tiny model's logits lie close
    together, so there a greedy path may part from llama.cpp's at a near tie: only where
    ember's best two logits are within 1e-4 (float32 rounding, summed in another order,
    decides), and llama.cpp's pick is ember's runner-up; up to there the tokens are equal."""
    if converted.name != "phi3":
        pytest.skip("Phi-3's LongRoPE")
    llm = LLM(str(converted.gguf), **(ENGINE | {"num_kv_blocks": 64, "max_model_len": 512}))
    prompts = [prompt for prompt, _ in greedy]
    ours = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
    theirs = llama_greedy(converted.gguf, prompts, MAX_TOKENS, ctx=512).tokens
    for prompt, a, b in zip(prompts, ours, theirs):
        part = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if part is None:
            assert a == b
            continue
        best = torch.topk(forward_logits(llm, [prompt + a[:part]])[0][-1], 2)
        assert best.indices.tolist() == [a[part], b[part]] and best.values[0] - best.values[1] < 1e-4, (part, best)
    # the long factors are in use: the same tokens get other logits than within 256
    sequences = [prompt + tokens for prompt, tokens in greedy]
    long, short = forward_logits(llm, sequences), forward_logits(engines[0], sequences)
    assert max((a - b).abs().max().item() for a, b in zip(long, short)) > 1e-3


def test_generation_ends_at_the_end_of_turn_token(converted: Converted, engines) -> None:
    """The end-of-turn token ends generation though the file's EOS is another token; pushed
    up by a logit bias, it is the first token sampled, and the last."""
    from_gguf = engines[0]
    v, tok = converted.variant, converted.tokenizer
    end = tok.backend.token_to_id(v.end_of_turn)
    assert end != tok.eos_token_id
    assert tok.eos_token_ids == v.end_of_generation
    params = SamplingParams(temperature=0, max_tokens=8, logit_bias={end: 100.0})
    if v.chat_template:
        out = from_gguf.chat([{"role": "user", "content": "Hello world"}], params)[0]
        turn = tok.encode("<start_of_turn>model\n", add_special_tokens=False)
        assert out.prompt_token_ids[-len(turn):] == turn
    else:
        out = from_gguf.generate(PROMPTS[:1], params)[0]
    assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == ([end], "stop")


def test_q8_0_blocks_give_a_prompt_the_same_bits_however_it_is_batched(converted: Converted, gguf_convert) -> None:
    """The family as the CPU runs GGUF blocks by default (Q8_0 here: every 2-D weight in the
    int8 kernels, a float16 cache): batch invariance (tests/invariance.py), windows and soft-caps
    included."""
    from invariance import assert_batch_invariant, prompts_with_a_shared_prefix

    from ember.layers.linear import Linear
    from ember.layers.quant.gguf_blocks import GGUFBlocks

    path = gguf_convert(converted.hf_dir, "q8_0")
    llm = assert_batch_invariant(path, prompts_with_a_shared_prefix(converted.variant.config["vocab_size"]))
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert layers and all(isinstance(m.format, GGUFBlocks) for m in layers)
    assert (llm.config.quantization, llm.config.kv_cache_dtype) == ("gguf", "float16")
