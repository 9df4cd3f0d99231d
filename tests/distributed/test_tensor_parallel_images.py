"""Vision-language models at tensor_parallel_size 2 (runner/tensor_parallel.py): every rank runs
the tower over the step's images, whose pixels travel once, in the step that starts encoding
them, and keeps the encoder cache the engine's mirror keeps (EncoderCacheMirror). Tiny random
LLaVA, Qwen2.5-VL, Gemma 3 and Qwen3-VL saved by transformers (4 heads, 2 KV heads) give one
process's greedy tokens and logprobs through 8-token chunks across images, several images a
prompt, a repeated image (a prefix-cache hit; an encoder-cache hit, whose pixels are not sent
again), an encoder cache small enough to evict, an abort in the middle of an image's chunks, and
on Ray actors; `check_idle` asks every rank what it keeps (nothing, and the mirror's images)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from llava_model import image, make_llm, prompt, save_tiny_llava, tokens_and_logprobs  # noqa: E402

from ember import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
RED, BLUE, GREEN, GREY = (image(c) for c in ((200, 30, 30), (20, 40, 220), (30, 160, 40), (90, 90, 90)))


def _assert_same(got: list, want: list, atol: float = 1e-4) -> None:
    """Equal greedy tokens, logprobs within atol (the ranks' partial sums add in another order)."""
    for output, (tokens, logprobs) in zip(got, want):
        got_tokens, got_logprobs = tokens_and_logprobs(output)
        assert got_tokens == tokens
        torch.testing.assert_close(got_logprobs, logprobs, rtol=0, atol=atol)


def test_llava_at_two_ranks_sends_each_image_once_and_keeps_every_ranks_encoder_cache_in_step(
        bpe_tokenizer_dir, tmp_path, monkeypatch):
    """An encoder cache of two images' embeddings (16 tokens x 64 floats each): each step's
    images are encoded on both ranks from pixels sent once, an image back in a new prompt takes
    its cached embeddings (no pixels sent), one evicted meanwhile is sent and encoded again."""
    from ember.runner import multimodal

    model_dir = save_tiny_llava(bpe_tokenizer_dir, tmp_path / "llava")
    asks = [[prompt("USER: <image>\nand <image>\nWhich is red? ASSISTANT:", [RED, BLUE]),
             prompt("USER: <image>\nand <image>\nWhich is blue? ASSISTANT:", [BLUE, RED])],
            [prompt("USER: What is <image>\n? ASSISTANT:", [RED])],  # RED's embeddings from the cache
            [prompt("USER: What is <image>\n? ASSISTANT:", [GREEN])],  # evicts BLUE, the least recently used
            [prompt("USER: Look <image>\nthe <image>\nsky ASSISTANT:", [BLUE, RED])],  # BLUE's pixels again
            [prompt("USER: <image>\nand <image>\nWhich is red? ASSISTANT:", [RED, BLUE])]]  # the prefix cache
    one = make_llm(model_dir)
    want = [[tokens_and_logprobs(o) for o in one.generate(a, GREEDY)] for a in asks]
    one.shutdown()
    monkeypatch.setattr(multimodal, "ENCODER_CACHE_BYTES", 2 * 16 * 64 * 4)  # the engine's mirror decides
    llm = make_llm(model_dir, tensor_parallel_size=2, max_num_batched_tokens=8)
    mirror = llm.engine.runner.images
    try:
        encoded = []
        for ask, expected in zip(asks, want):
            outs = llm.generate(ask, GREEDY)
            _assert_same(outs, expected)
            encoded.append(mirror.num_encoded)
            llm.check_idle()  # every rank: nothing kept for a request, the mirror's images (and bytes)
        assert encoded == [2, 2, 3, 4, 4]
        ids = outs[0].prompt_token_ids
        assert outs[0].num_cached_tokens >= len(ids) - ids[::-1].index(llm.config.model_config.vision.image_token_id)
        # an abort while the ranks are part way through an image's chunks leaves nothing on any rank
        core = llm.engine
        req = llm.inputs.make_request("mid-image", prompt("USER: What is <image>\n? ASSISTANT:", [GREY]), GREEDY)
        core.add_request(req)
        core.step()
        assert 0 < req.num_computed_tokens < req.mm_features[0].end and mirror.num_encoded == 5
        assert mirror.cache.held == {"mid-image": {req.mm_features[0].hash}}
        core.abort_request("mid-image")
        llm.check_idle()
    finally:
        llm.shutdown()


FAMILIES = {  # (prompt with two images, with one; a step's tokens: Gemma 3 computes an image in one step)
    "qwen2_5_vl": ("<|im_start|>user\n{V}and {V}Which is red?<|im_end|>\n<|im_start|>assistant\n",
                   "<|im_start|>user\n{V}What is in the picture?<|im_end|>\n<|im_start|>assistant\n", 8),
    "gemma3": ("<start_of_image> and <start_of_image> Which is red?", "What is in the picture? <start_of_image>", 20),
}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_m_rope_and_bidirectional_images_at_two_ranks_give_one_process_tokens(bpe_tokenizer_dir, tmp_path, family):
    """Qwen2.5-VL's M-RoPE positions and Gemma 3's key_ends, made by every rank from the
    images' places (their pixels sent once): chunked, two images a prompt and one repeated."""
    two, one_image, chunk = (t.replace("{V}", "<|vision_start|><|image_pad|><|vision_end|>") if isinstance(t, str)
                             else t for t in FAMILIES[family])
    if family == "gemma3":
        from gemma3_vision_model import save_tiny_gemma3

        model_dir = save_tiny_gemma3(bpe_tokenizer_dir, tmp_path / family)
    else:
        from qwen_vl_model import save_tiny_qwen_vl

        model_dir = save_tiny_qwen_vl(bpe_tokenizer_dir, tmp_path / family, family)
    red, blue = image((200, 30, 30), (84, 56)), image((20, 40, 220), (100, 60))
    asks = [prompt(two, [red, blue]), prompt(one_image, [blue])]
    one = make_llm(model_dir)
    want = [tokens_and_logprobs(o) for o in one.generate(asks, GREEDY)]
    one.shutdown()
    llm = make_llm(model_dir, tensor_parallel_size=2, max_num_batched_tokens=chunk)
    try:
        _assert_same(llm.generate(asks, GREEDY), want)
        assert llm.engine.runner.images.num_encoded == 2
        llm.check_idle()
    finally:
        llm.shutdown()


def test_qwen3_vl_on_two_ray_actors_gives_one_process_tokens(bpe_tokenizer_dir, tmp_path, two_nodes):
    """Qwen3-VL's deepstack rows, on Ray actors of two nodes: each message's pixels in Ray's
    object store once, read by both ranks."""
    from qwen_vl_model import save_tiny_qwen_vl

    model_dir = save_tiny_qwen_vl(bpe_tokenizer_dir, tmp_path / "qwen3_vl", "qwen3_vl")
    v = "<|vision_start|><|image_pad|><|vision_end|>"
    asks = [prompt(f"<|im_start|>user\n{v}and {v}Which is red?<|im_end|>\n<|im_start|>assistant\n",
                   [image((200, 30, 30), (84, 56)), image((20, 40, 220), (100, 60))])]
    one = make_llm(model_dir)
    want = [tokens_and_logprobs(o) for o in one.generate(asks, GREEDY)]
    one.shutdown()
    llm = make_llm(model_dir, tensor_parallel_size=2, max_num_batched_tokens=8, distributed_executor_backend="ray")
    try:
        _assert_same(llm.generate(asks, GREEDY), want)
        llm.check_idle()
    finally:
        llm.shutdown()
