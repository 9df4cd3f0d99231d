"""Embeddings (runner="pooling") on a tiny random Llama saved by HF transformers: LLM.embed
equals transformers' final hidden states (after the final norm) pooled the same way, in
float32, for each pooling type, with and without normalization, for a batch of prompts of
different lengths, prompts longer than a step's token budget (chunked prefill) and in
a pool that holds one prompt at a time; no KV block or pooling state is left behind."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_families import LLAMA, save_tiny_model

from ember import LLM
from ember.pooling import PoolerConfig

transformers = pytest.importorskip("transformers")

# lengths 13, 1, 40, 27 and 16: the 40- and 27-token prompts take several steps of 16 tokens
PROMPTS = [[5, 17, 99, 3, 250, 41, 8, 77, 12, 19, 200, 6, 3], [7], list(range(3, 43)),
           [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26],
           list(range(100, 116))]
BUDGET = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(LLAMA, path)
    hf = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = [hf(torch.tensor([ids])).last_hidden_state[0] for ids in PROMPTS]
    return path, hidden


def reference(hidden: torch.Tensor, config: PoolerConfig) -> torch.Tensor:
    pooled = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[config.pooling_type]
    return F.normalize(pooled, dim=-1) if config.normalize else pooled


def pooling_llm(path, config: PoolerConfig | None, **kw) -> LLM:
    return LLM(str(path), runner="pooling", pooler_config=config, dtype="float32", block_size=8,
               max_num_batched_tokens=BUDGET, **({"num_kv_blocks": 64} | kw))


@pytest.mark.parametrize("config", [PoolerConfig("LAST"), PoolerConfig("MEAN"), PoolerConfig("CLS"),
                                    PoolerConfig("MEAN", normalize=False), PoolerConfig("LAST", normalize=False)],
                         ids=lambda c: f"{c.pooling_type}-{'norm' if c.normalize else 'raw'}")
def test_embed_equals_hf_pooled_hidden_states(tiny, config):
    path, hidden = tiny
    llm = pooling_llm(path, config)
    outputs = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS])
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert all(o.finished for o in outputs)
    for out, h in zip(outputs, hidden):
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == (LLAMA["hidden_size"],)
        torch.testing.assert_close(got, reference(h, config), atol=1e-4, rtol=0)
    if config.normalize:
        assert all(abs(torch.tensor(o.outputs.embedding).norm().item() - 1) < 1e-5 for o in outputs)
    llm.check_idle()
    assert llm.engine.block_pool.num_in_use == 0


def test_async_scheduling_gives_the_same_vectors(tiny):
    """With async scheduling the next step is scheduled while a prompt's last chunk runs:
    the prompt is not scheduled again, and ends when its vector is collected."""
    path, hidden = tiny
    config = PoolerConfig("MEAN")
    llm = pooling_llm(path, config, async_scheduling=True)
    outputs = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS])
    for out, h in zip(outputs, hidden):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), reference(h, config), atol=1e-4, rtol=0)
    llm.check_idle()


def test_default_is_last_token_normalized_without_prefix_cache(tiny):
    path, hidden = tiny
    llm = pooling_llm(path, None)
    assert llm.config.pooler_config == PoolerConfig("LAST", normalize=True)
    assert llm.config.enable_prefix_caching is False  # a hit would skip positions that MEAN reads
    one = llm.embed({"prompt_token_ids": PROMPTS[0]})
    assert len(one) == 1
    torch.testing.assert_close(torch.tensor(one[0].outputs.embedding), F.normalize(hidden[0][-1], dim=-1),
                               atol=1e-4, rtol=0)
    again = llm.embed({"prompt_token_ids": PROMPTS[0]})  # the same prompt twice gives the same vector
    assert again[0].outputs.embedding == one[0].outputs.embedding
    llm.check_idle()


def test_mean_pooling_in_a_pool_that_holds_one_prompt_at_a_time(tiny):
    """Five blocks of 8 a 40-token prompt, 6 in the pool: each prompt waits for the blocks
    the one before gives back when it ends, and is averaged over its own chunks only."""
    path, hidden = tiny
    config = PoolerConfig("MEAN")
    llm = pooling_llm(path, config, num_kv_blocks=6, max_model_len=48)
    prompts = [PROMPTS[2], PROMPTS[3], PROMPTS[2][::-1]]
    outputs = llm.embed([{"prompt_token_ids": ids} for ids in prompts])
    with torch.no_grad():
        hf = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
        want = [reference(hf(torch.tensor([ids])).last_hidden_state[0], config) for ids in prompts]
    for out, w in zip(outputs, want):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), w, atol=1e-4, rtol=0)
    llm.check_idle()


def test_generate_and_embed_each_need_their_runner(tiny):
    path, _ = tiny
    pooling = pooling_llm(path, None)
    with pytest.raises(ValueError, match=r"LLM.generate, chat and stream needs an LLM made with "
                                         r"runner='generate'; this one has runner='pooling'"):
        pooling.generate({"prompt_token_ids": [1, 2]})
    generating = LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"LLM.embed needs an LLM made with runner='pooling'; this one has "
                                         r"runner='generate'"):
        generating.embed({"prompt_token_ids": [1, 2]})


@pytest.mark.parametrize("kwargs, message", [
    ({"runner": "embed"}, "runner must be one of auto, generate, pooling; got 'embed'"),
    ({"runner": "generate", "pooler_config": {"pooling_type": "MEAN"}}, "pooler_config applies to runner='pooling' only"),
    ({"runner": "pooling", "pooler_config": {"pooling_type": "ALL"}},
     "pooling_type must be one of LAST, MEAN, CLS; got 'ALL'"),
    ({"runner": "pooling", "pooler_config": '{"pooling": "MEAN"}'},
     "pooler_config: unknown key 'pooling' (known: normalize, pooling_type)"),
    ({"runner": "pooling", "pooler_config": "MEAN"}, "pooler_config must be a JSON object"),
])
def test_bad_pooling_options_are_refused(kwargs, message):
    from ember.config import EngineConfig

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("base", ["llama", "qwen2_window"])
def test_a_decoder_sequence_classifier_gives_transformers_probabilities(base, tmp_path):
    """A *ForSequenceClassification decoder (its `score` head over the last token, no LM head)
    runs as a pooling model by default: LLM.classify equals transformers' softmax over its
    logits, for prompts within one step and across chunks; it cannot generate."""
    from test_families import FAMILIES

    lm = LLAMA if base == "llama" else FAMILIES[base]
    config = lm | {"architectures": [lm["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")],
                               "id2label": {"0": "bad", "1": "ok", "2": "good"}, "pad_token_id": 0}
    save_tiny_model(config, tmp_path)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    llm = LLM(str(tmp_path), dtype="float32", block_size=8, num_kv_blocks=64, max_num_batched_tokens=BUDGET,
              max_model_len=128)
    assert llm.config.runner == "pooling" and llm.config.pooler_config == PoolerConfig("LAST", normalize=False)
    assert llm.config.model_config.label_names == ("bad", "ok", "good")
    outs = llm.classify([{"prompt_token_ids": ids} for ids in PROMPTS])
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].softmax(-1)
        assert torch.allclose(torch.tensor(out.outputs.probs, dtype=torch.float64), want.double(), atol=1e-5), ids
    llm.check_idle()
    with pytest.raises(ValueError, match="this checkpoint is a sequence classifier"):
        LLM(str(tmp_path), runner="generate")
