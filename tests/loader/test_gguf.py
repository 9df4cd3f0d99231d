"""ember.loader.gguf: dequantization bit-exact with gguf-py, the GGUF -> HF name map, the
Q/K un-permutation (checked against HF transformers' own GGUF loading) and bad files."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ember.loader.default_model import fetch_default_model
from ember.loader.gguf import GGUFFile, dequantize, gguf_to_hf_names, iter_hf_weights, unpermute_rows
from ember.loader.weights import hf_weight_shapes
from ember.models.config import ModelConfig

Q = gguf.GGMLQuantizationType
NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS = 30, 9, 3

# Every type ember decodes itself (the rest go to gguf-py).
EMBER_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]


@pytest.fixture(scope="module")
def model_path() -> Path:
    return fetch_default_model()


@pytest.fixture(scope="module")
def model(model_path: Path) -> GGUFFile:
    return GGUFFile(model_path)


@pytest.fixture(scope="module")
def hf_state(model_path: Path, gguf_path: Path, hf_model) -> dict[str, torch.Tensor]:
    """HF transformers' own reading of the same GGUF file (dequantized, un-permuted): the
    session's `hf_model` (tests/conftest.py), on the same file."""
    assert model_path == gguf_path
    return {k: v.detach() for k, v in hf_model.state_dict().items()}


@pytest.fixture(scope="module")
def config(model: GGUFFile) -> ModelConfig:
    return ModelConfig.from_gguf_metadata(model.metadata, model.tensor_names)


@pytest.fixture(scope="module")
def ember_state(model: GGUFFile, config: ModelConfig) -> dict[str, torch.Tensor]:
    return dict(iter_hf_weights(model, config))


def assert_bit_exact(ours: torch.Tensor, ref: np.ndarray | torch.Tensor) -> None:
    """Same shape, float32, same bits (stricter than ==: tells -0.0 from 0.0, compares NaNs)."""
    ref = torch.from_numpy(np.array(ref, dtype=np.float32)) if isinstance(ref, np.ndarray) else ref
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))


def gguf_reference(raw: np.ndarray, qtype: Q) -> np.ndarray:
    return gguf.quants.dequantize(raw, qtype)


# ---- dequantization: real tensors --------------------------------------------------------


def test_default_model_has_the_types_we_test(model: GGUFFile) -> None:
    types = {model.tensor_info(n).qtype for n in model.tensor_names}
    assert types == {Q.F32, Q.Q4_1, Q.Q8_0}
    assert model.tensor_info("token_embd.weight").qtype == Q.Q8_0


def test_real_tensors_bit_exact(model: GGUFFile) -> None:
    by_type: dict[int, list[str]] = {}
    for name in model.tensor_names:
        by_type.setdefault(model.tensor_info(name).qtype, []).append(name)
    for qtype, names in by_type.items():
        picked = sorted(set(names[:2] + names[len(names) // 2 : len(names) // 2 + 2] + names[-2:]))
        for name in picked:
            info = model.tensor_info(name)
            ours = model.tensor(name)
            rows = model.raw(name).reshape(math.prod(info.shape[:-1]), -1)  # the bytes, a row a line
            ref = gguf_reference(rows, Q(qtype)).reshape(info.shape)
            assert_bit_exact(ours, ref)
            assert ours.shape == info.shape


def test_shape_is_reversed_ne(model: GGUFFile) -> None:
    # ne = [in_features, out_features] in the file; PyTorch order is (out, in)
    assert model.tensor("token_embd.weight").shape == (49152, 576)
    assert model.tensor("blk.0.ffn_down.weight").shape == (576, 1536)
    assert model.tensor("blk.0.attn_k.weight").shape == (192, 576)
    assert model.tensor("output_norm.weight").shape == (576,)


# ---- dequantization: synthetic data ------------------------------------------------------


def _random_values(rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((8, 256)).astype(np.float32)
    x *= np.float32(10.0) ** rng.integers(-6, 3, size=(8, 1)).astype(np.float32)  # rows of all scales
    x[0, :32] = 0.0  # an all-zero block (scale 0)
    x[1, 32:64] = 3.0  # a constant block (max == min)
    return x


@pytest.mark.parametrize("qtype", EMBER_TYPES, ids=lambda q: q.name)
def test_synthetic_quantized_bit_exact(qtype: Q) -> None:
    x = _random_values(np.random.default_rng(int(qtype)))
    if qtype == Q.F16:
        x[2, :4] = [np.inf, -np.inf, -0.0, 1e-7]  # specials and an f16 subnormal
    raw = gguf.quants.quantize(x, qtype)
    assert_bit_exact(dequantize(raw, qtype, x.shape), gguf_reference(raw, qtype))
    if qtype not in (Q.F32,):  # a lossy type actually changed something, so it was decoded
        assert not np.array_equal(gguf_reference(raw, qtype), x)


def _random_bytes(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks whose f16 scale fields are finite (incl. negative and subnormal)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    scale_bytes = {Q.Q4_0: [0], Q.Q5_0: [0], Q.Q8_0: [0], Q.Q4_1: [0, 2], Q.Q5_1: [0, 2],
                   Q.Q4_K: [0, 2], Q.F16: [0]}[qtype]
    for at in scale_bytes:
        scale = raw[:, at : at + 2].copy().view(np.uint16)
        scale[(scale & 0x7C00) == 0x7C00] &= np.uint16(0xBFFF)  # inf/NaN exponent -> finite
        raw[:, at : at + 2] = scale.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda q: q.name)
def test_random_bytes_bit_exact(qtype: Q) -> None:
    raw = _random_bytes(qtype, 16, 512, np.random.default_rng(100 + int(qtype)))
    assert_bit_exact(dequantize(raw, qtype, (16, 512)), gguf_reference(raw, qtype))


def test_bf16_all_bit_patterns() -> None:
    raw = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.uint8)  # NaNs too
    assert_bit_exact(dequantize(raw, Q.BF16, (256, 256)), gguf_reference(raw.reshape(256, 512), Q.BF16))


def test_falls_back_to_gguf_py_for_k_quants() -> None:
    raw = _random_bytes(Q.Q4_K, 4, 512, np.random.default_rng(7))
    assert_bit_exact(dequantize(raw, Q.Q4_K, (4, 512)), gguf_reference(raw, Q.Q4_K))


def test_dequantize_refuses_what_it_cannot_decode() -> None:
    with pytest.raises(ValueError, match="I32"):
        dequantize(np.zeros(16, np.int32), Q.I32, (16,))
    with pytest.raises(ValueError, match="unknown GGML tensor type 999"):
        dequantize(np.zeros(4, np.uint8), 999, (1,))
    with pytest.raises(ValueError, match="needs 40 bytes, got 39"):
        dequantize(np.zeros(39, np.uint8), Q.Q4_1, (64,))
    with pytest.raises(ValueError, match="whole blocks of 32"):
        dequantize(np.zeros(20, np.uint8), Q.Q4_1, (2, 16))


@pytest.mark.parametrize("qtype", EMBER_TYPES, ids=lambda q: q.name)
def test_dequantize_reads_read_only_bytes_into_a_new_tensor(qtype: Q) -> None:
    raw = gguf.quants.quantize(_random_values(np.random.default_rng(3)), qtype)
    raw.flags.writeable = False  # as the memory map of a file
    before = raw.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = dequantize(raw, qtype, (8, 256))
    out.fill_(7.0)
    assert np.array_equal(raw.view(np.uint8), before.view(np.uint8))


def test_dequantize_returns_a_private_tensor(model: GGUFFile) -> None:
    t = model.tensor("output_norm.weight")
    t.zero_()  # would crash or corrupt the file if it were the read-only memory map
    assert model.tensor("output_norm.weight").abs().sum() > 0


# ---- metadata ----------------------------------------------------------------------------


def test_metadata_is_plain_python(model: GGUFFile) -> None:
    md = model.metadata
    assert model.architecture == "llama"
    assert md["llama.block_count"] == NUM_LAYERS and type(md["llama.block_count"]) is int
    assert md["llama.attention.head_count"] == NUM_HEADS
    assert md["llama.attention.head_count_kv"] == NUM_KV_HEADS
    assert md["llama.rope.freq_base"] == 100000.0 and type(md["llama.rope.freq_base"]) is float
    assert md["tokenizer.ggml.add_bos_token"] is False
    assert md["general.languages"] == ["en"]
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and tokens[1] == "<|im_start|>"
    assert md["tokenizer.ggml.token_type"][:2] == [3, 3]
    assert not any(k.startswith("GGUF.") for k in md)
    plain = (str, int, float, bool)
    for key, value in md.items():
        items = value if isinstance(value, list) else [value]
        assert all(type(v) in plain for v in items), key


def test_tensors_streams_in_file_order(model: GGUFFile) -> None:
    it = model.tensors()
    assert next(it)[0] == model.tensor_names[0] == "token_embd.weight"
    assert len(model.tensor_names) == 272
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        model.tensor("nope")


# ---- name map ----------------------------------------------------------------------------


def expected_hf_names(num_layers: int) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}  # tied: no lm_head.weight
    per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    for i in range(num_layers):
        names |= {f"model.layers.{i}.{p}.weight" for p in per_layer}
    return names


def test_every_tensor_maps_to_the_hf_llama_names(model: GGUFFile, config: ModelConfig,
                                                 ember_state: dict[str, torch.Tensor]) -> None:
    names = gguf_to_hf_names("llama", hf_weight_shapes(config), NUM_LAYERS)
    assert sorted(names) == sorted(model.tensor_names)
    assert len(ember_state) == len(model.tensor_names)  # no two GGUF names map to one HF name
    assert set(ember_state) == expected_hf_names(NUM_LAYERS)
    assert ember_state["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ember_state["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(t.dtype == torch.float32 for t in ember_state.values())


def test_rope_dimension_count_is_the_rotary_dim(model: GGUFFile, config: ModelConfig) -> None:
    """llama.cpp writes {arch}.rope.dimension_count: the whole head here (SmolLM2). For a
    llama GGUF a partial one is refused, since the loader's un-permutation turns whole heads
    back into HF's layout (Phi-3's partial RoPE from GGUF: tests/models/test_families.py)."""
    assert model.metadata["llama.rope.dimension_count"] == config.rotary_dim == config.head_dim == 64
    partial = model.metadata | {"llama.rope.dimension_count": 48}
    with pytest.raises(ValueError, match=r"a llama GGUF with RoPE on 48 of each head's 64 dims"):
        ModelConfig.from_gguf_metadata(partial, model.tensor_names)


def test_name_map_examples() -> None:
    hf = ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight", "model.layers.12.self_attn.q_proj.bias",
          "model.layers.3.self_attn.k_norm.weight", "model.layers.3.mlp.gate_proj.weight",
          "model.layers.3.post_attention_layernorm.weight"]
    assert gguf_to_hf_names("qwen3", hf, 16) == {
        "output.weight": "lm_head.weight",
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "blk.12.attn_q.bias": "model.layers.12.self_attn.q_proj.bias",
        "blk.3.attn_k_norm.weight": "model.layers.3.self_attn.k_norm.weight",
        "blk.3.ffn_gate.weight": "model.layers.3.mlp.gate_proj.weight",
        "blk.3.ffn_norm.weight": "model.layers.3.post_attention_layernorm.weight",
    }
    # llama has no q/k norm in llama.cpp's tensor list: left out, so the loader reports it missing
    assert "blk.3.attn_k_norm.weight" not in gguf_to_hf_names("llama", hf, 16)
    # gemma2's four norms a layer (names from gguf-py, the same table the converter used)
    gemma2 = [f"model.layers.0.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm",
                                                     "pre_feedforward_layernorm", "post_feedforward_layernorm")]
    assert gguf_to_hf_names("gemma2", gemma2, 1) == {
        "blk.0.attn_norm.weight": gemma2[0], "blk.0.post_attention_norm.weight": gemma2[1],
        "blk.0.ffn_norm.weight": gemma2[2], "blk.0.post_ffw_norm.weight": gemma2[3],
    }
    with pytest.raises(ValueError, match="architecture 'nope' is unknown to gguf-py .*upgrade"):
        gguf_to_hf_names("nope", hf, 16)


# ---- un-permutation ----------------------------------------------------------------------


def permute_like_llama_cpp(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The forward reordering, row by row: in each head, row i and row i + head_dim/2 of
    the HF layout become neighbours 2i and 2i + 1."""
    head_dim = w.shape[0] // num_heads
    half = head_dim // 2
    rows = []
    for h in range(num_heads):
        for i in range(half):
            rows.append(w[h * head_dim + i])
            rows.append(w[h * head_dim + half + i])
    return torch.stack(rows)


def test_unpermute_undoes_permute() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3 * 8, 5, generator=g)  # 3 heads of head_dim 8
    permuted = permute_like_llama_cpp(w, 3)
    assert not torch.equal(permuted, w)
    assert torch.equal(permuted[:4, 0], w[[0, 4, 1, 5], 0])
    assert torch.equal(unpermute_rows(permuted, 3), w)
    assert not torch.equal(unpermute_rows(w, 3), w)
    bias = torch.randn(3 * 8, generator=g)
    assert torch.equal(unpermute_rows(permute_like_llama_cpp(bias, 3), 3), bias)
    with pytest.raises(ValueError, match="heads of even size"):
        unpermute_rows(torch.zeros(9, 2), 3)


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    w = gguf.GGUFWriter(path, arch)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_only_llama_is_unpermuted_and_unknown_names_pass_through(tmp_path: Path, arch: str) -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2 * 4, 6)).astype(np.float32)  # 2 heads, head_dim 4
    k = rng.standard_normal((1 * 4, 6)).astype(np.float32)  # 1 kv head
    qb = rng.standard_normal(2 * 4).astype(np.float32)
    v = rng.standard_normal((4, 6)).astype(np.float32)
    freqs = np.ones(2, np.float32)
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(path, arch, {"blk.0.attn_q.weight": q, "blk.0.attn_q.bias": qb, "blk.0.attn_k.weight": k,
                             "blk.0.attn_v.weight": v, "rope_freqs.weight": freqs})
    cfg = ModelConfig(architecture=arch, vocab_size=8, hidden_size=6, intermediate_size=8, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
                      tie_word_embeddings=True, attention_bias=True)
    out = dict(iter_hf_weights(GGUFFile(path), cfg))
    assert set(out) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                        "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
                        "rope_freqs.weight"}
    t = torch.from_numpy
    if arch == "llama":
        assert torch.equal(permute_like_llama_cpp(out["model.layers.0.self_attn.q_proj.weight"], 2), t(q))
        assert torch.equal(permute_like_llama_cpp(out["model.layers.0.self_attn.q_proj.bias"], 2), t(qb))
        assert torch.equal(permute_like_llama_cpp(out["model.layers.0.self_attn.k_proj.weight"], 1), t(k))
    else:
        assert torch.equal(out["model.layers.0.self_attn.q_proj.weight"], t(q))
        assert torch.equal(out["model.layers.0.self_attn.k_proj.weight"], t(k))
    assert torch.equal(out["model.layers.0.self_attn.v_proj.weight"], t(v))
    assert torch.equal(out["rope_freqs.weight"], t(freqs))
    # a tensor the caller reads itself (the config, for rope_freqs) is not yielded
    assert set(dict(iter_hf_weights(GGUFFile(path), cfg, consumed={"rope_freqs.weight"}))) == set(out) - {"rope_freqs.weight"}


@pytest.mark.slow
def test_matches_transformers_gguf_loading(ember_state: dict[str, torch.Tensor], hf_state: dict[str, torch.Tensor]) -> None:
    assert set(hf_state) - {"lm_head.weight"} == set(ember_state)  # HF ties lm_head to the embedding
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.embed_tokens.weight", "model.layers.7.mlp.down_proj.weight", "model.norm.weight",
                 "model.layers.7.post_attention_layernorm.weight"]:
        assert torch.equal(ember_state[name], hf_state[name]), name
    mismatched = [name for name, t in ember_state.items() if not torch.equal(t, hf_state[name])]
    assert mismatched == []


# ---- config from metadata: the keys llama.cpp reads for the newer families ------------------


def _metadata(arch: str, layers: int = 7, **keys) -> dict:
    """The keys every GGUF of `arch` has (as llama.cpp's converter writes them), then `keys`
    (dots written as __): heads of 16, hidden 64."""
    md = {"general.architecture": arch, f"{arch}.embedding_length": 64, f"{arch}.attention.head_count": 4,
          f"{arch}.attention.head_count_kv": 2, f"{arch}.attention.key_length": 16, f"{arch}.block_count": layers,
          f"{arch}.context_length": 512, f"{arch}.feed_forward_length": 96,
          f"{arch}.attention.layer_norm_rms_epsilon": 1e-6}
    return md | {f"{arch}.{k.replace('__', '.')}": v for k, v in keys.items()}


def _config(md: dict, tensors: tuple[str, ...] = ()) -> ModelConfig:
    return ModelConfig.from_gguf_metadata(md, ["token_embd.weight", *tensors], lambda name: [1.0] * 8)


def test_gemma3_local_rope_and_sliding_pattern_from_metadata() -> None:
    g3 = _config(_metadata("gemma3", attention__sliding_window=8, rope__freq_base=1e6, rope__freq_base_swa=20000.0,
                           rope__scaling__type="linear", rope__scaling__factor=8.0))
    assert g3.layer_windows == (8, 8, 8, 8, 8, None, 8)  # llama.cpp's default pattern: each 6th layer global
    assert (g3.rope_theta, g3.rope_scaling.kind, g3.local_rope_theta, g3.local_rope_scaling) == \
        (1e6, "linear", 20000.0, None)  # the scaling is the global layers' alone
    assert (g3.attention_scale, g3.final_logit_softcap, g3.attn_logit_softcap) == (16 ** -0.5, None, None)
    every_third = _config(_metadata("gemma3", attention__sliding_window=8, attention__sliding_window_pattern=3))
    assert (every_third.layer_windows, every_third.local_rope_theta) == ((8, 8, None, 8, 8, None, 8), 10000.0)
    flags = [True, False, False, True, True, True, False]
    listed = _config(_metadata("gemma3", attention__sliding_window=8, attention__sliding_window_pattern=flags))
    assert listed.layer_windows == (8, None, None, 8, 8, 8, None)
    assert _config(_metadata("gemma3", attention__sliding_window=8, attention__sliding_window_pattern=0)) \
        .layer_windows == (8,) * 7
    assert _config(_metadata("gemma3")).layer_windows is None  # no window key: every layer global
    assert _config(_metadata("gemma3", attention__sliding_window=0)).layer_windows is None
    with pytest.raises(ValueError, match=r"gemma3.attention.sliding_window_pattern has 2 flags for 7 layers"):
        _config(_metadata("gemma3", attention__sliding_window=8, attention__sliding_window_pattern=[True, False]))


def test_gemma2_defaults_are_llama_cpps() -> None:
    """Where a Gemma 2 file lacks the keys: window 4096 on every other layer, soft-caps 50
    and 30, and the local layers turn as the global ones."""
    g2 = _config(_metadata("gemma2", layers=4, rope__freq_base=10000.0))
    assert (g2.layer_windows, g2.attn_logit_softcap, g2.final_logit_softcap) == ((4096, None, 4096, None), 50.0, 30.0)
    assert (g2.local_rope_theta, g2.local_rope_scaling) == (None, None)
    local = _config(_metadata("gemma2", layers=4, rope__freq_base_swa=5000.0, rope__scaling__type="linear",
                              rope__scaling__factor=2.0, attn_logit_softcapping=5.0, final_logit_softcapping=3.0))
    assert (local.local_rope_theta, local.local_rope_scaling) == (5000.0, local.rope_scaling)
    assert local.rope_scaling.factor == 2.0 and (local.attn_logit_softcap, local.final_logit_softcap) == (5.0, 3.0)


def test_gemma_27b_attention_scale_by_layer_count() -> None:
    """llama.cpp tells the 27B models by their layers (Gemma 2: 46, Gemma 3: 62) and scales
    their queries by (hidden / heads) ** -0.5; the others by head_dim ** -0.5."""
    wide = {"gemma2.attention.key_length": 32}
    assert _config(_metadata("gemma2", layers=46) | wide).query_pre_attn_scalar == 16
    assert _config(_metadata("gemma2", layers=62) | wide).query_pre_attn_scalar == 32
    wide = {"gemma3.attention.key_length": 32}
    assert _config(_metadata("gemma3", layers=62) | wide).query_pre_attn_scalar == 16
    assert _config(_metadata("gemma3", layers=46) | wide).query_pre_attn_scalar == 32


def test_partial_rope_from_gguf() -> None:
    assert _config(_metadata("phi3", rope__dimension_count=12)).rotary_dim == 12


@pytest.mark.parametrize("md,tensors,message", [
    (_metadata("phi3"), ("rope_factors_long.weight", "rope_factors_short.weight"),
     "a GGUF with LongRoPE factors needs phi3.rope.scaling.original_context_length"),
])
def test_gguf_config_refusals_say_what_is_wrong(md: dict, tensors: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(md, tensors)


# ---- bad files ---------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no such file: .*nowhere\.gguf.*default_model"):
        GGUFFile(tmp_path / "nowhere.gguf")


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a file"):
        GGUFFile(tmp_path)


@pytest.mark.parametrize("content", [b"", b"hello, I am a text file\n", b"GGU"], ids=["empty", "text", "short"])
def test_not_a_gguf_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"model\.gguf is not a GGUF file: it starts with"):
        GGUFFile(path)


def test_truncated_to_half(tmp_path: Path, model_path: Path) -> None:
    path = tmp_path / "half.gguf"
    size = model_path.stat().st_size
    with open(model_path, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(size // 2))
    with pytest.raises(ValueError, match=r"half\.gguf .*truncated or corrupt.*again"):
        GGUFFile(path)


def test_truncated_inside_the_header(tmp_path: Path, model_path: Path) -> None:
    path = tmp_path / "head.gguf"
    with open(model_path, "rb") as src:
        path.write_bytes(src.read(100_000))  # metadata cut in the middle of the vocabulary
    with pytest.raises(ValueError, match=r"head\.gguf .*truncated or corrupt"):
        GGUFFile(path)


@pytest.mark.parametrize("version", [b"", b"\x03\x00\x00\x00"], ids=["garbage", "v3-then-garbage"])
def test_magic_then_garbage(tmp_path: Path, version: bytes) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + version + np.random.default_rng(1).bytes(4096))
    with pytest.raises(ValueError, match=r"garbage\.gguf .*truncated or corrupt"):
        GGUFFile(path)
