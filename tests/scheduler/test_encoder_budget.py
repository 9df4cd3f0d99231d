"""The scheduler's encoder budget (scheduler/encoder_budget.py) on its own, no model: requests
with images built by hand (ImageFeature placeholders at chosen offsets), exact chunk sizes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_scheduler import TOKEN, assert_all_free, check_invariants, make_request, run_to_end, step

from ember.config import EngineConfig
from ember.multimodal.inputs import ImageFeature
from ember.request import Request
from ember.sampling_params import SamplingParams
from ember.scheduler.block_pool import BlockPool
from ember.scheduler.prefix_cache import RadixPrefixCache
from ember.scheduler.scheduler import Scheduler

IMAGE = 99  # the placeholder token id
PIXELS = np.zeros((1, 1, 1), np.float32)  # never read by the scheduler


def make_scheduler(encoder_budget: int | None, prefix_caching: bool = False) -> Scheduler:
    pool = BlockPool(64)
    config = EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                          max_num_encoder_input_tokens=encoder_budget)
    return Scheduler(pool, config, RadixPrefixCache(pool, 4) if prefix_caching else None)


def image_request(rid: str, layout: list[int | str], max_tokens: int = 2) -> Request:
    """A prompt from `layout`: an int is that many text tokens, "name:length" an image of that
    many placeholder tokens (its hash the name: one name, one image)."""
    ids, features = [], []
    for part in layout:
        if isinstance(part, int):
            ids += [100 + (len(ids) + i) % 50 for i in range(part)]
            continue
        name, length = part.split(":")
        features.append(ImageFeature(len(ids), int(length), name.encode().hex(), PIXELS))
        ids += [IMAGE] * int(length)
    return Request(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                   mm_features=features)


def test_a_chunk_stops_before_the_image_past_the_budget_and_a_steps_first_image_always_goes():
    """Budget 8: image a (6) goes, b (6) would make 12, so the chunk stops at b's first token;
    b goes next step, c (10, over the whole budget) the step after, as that step's first image."""
    s = make_scheduler(encoder_budget=8)
    s.add_request(image_request("r", [4, "a:6", 2, "b:6", "c:10", 12]))
    assert step(s)[0] == [("r", 12, False)]  # tokens 0..11: a; b starts at 12
    assert step(s)[0] == [("r", 6, False)]  # b alone: c would make 16
    assert step(s)[0] == [("r", 22, True)]  # c (10 > 8) and the text after it
    assert step(s)[0] == [("r", 1, True)]
    assert_all_free(s)


def test_the_default_budget_is_the_step_budget_and_below_one_is_refused():
    s = make_scheduler(encoder_budget=None)  # max_num_batched_tokens, 64: every image of this prompt at once
    s.add_request(image_request("r", [4, "a:6", 2, "b:6", "c:10", 12]))
    assert step(s)[0] == [("r", 40, True)]
    run_to_end(s)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="max_num_encoder_input_tokens must be an integer >= 1.*leave it unset"):
            EngineConfig(max_num_encoder_input_tokens=bad)


def test_other_requests_decode_while_a_many_image_prompt_is_cut():
    """A decoding text request gets its token every step; the five-image prompt starts one image
    a step (budget 8, images of 6); a later request with an image comes in with its text up to
    that image and waits there until the first prompt's images are all started."""
    s = make_scheduler(encoder_budget=8)
    s.add_request(make_request("text", 8, max_tokens=12))
    assert step(s)[0] == [("text", 8, True)]
    s.add_request(image_request("many", [2, "a:6", "b:6", "c:6", "d:6", "e:6", 4]))
    s.add_request(image_request("late", [5, "z:6", 3]))
    assert step(s)[0] == [("text", 1, True), ("many", 8, False), ("late", 5, False)]
    assert step(s)[0] == [("text", 1, True), ("many", 6, False)]  # late's z waits behind many's b
    assert step(s)[0] == [("text", 1, True), ("many", 6, False)]
    assert step(s)[0] == [("text", 1, True), ("many", 6, False)]
    assert step(s)[0] == [("text", 1, True), ("many", 10, True)]  # e, then its text: late's z still waits
    assert step(s)[0] == [("text", 1, True), ("many", 1, True), ("late", 9, True)]
    run_to_end(s)


def test_an_image_a_prefix_hit_covers_costs_nothing_and_one_it_ends_inside_costs_it_all():
    """After `first` ([4 text][x: 8]) is cached: `over` hits its 12 tokens, x among them, so its
    chunk starts y (8) as the step's first image and runs to its end; `inside` (first's prompt
    again) hits 11 tokens, its hit ending inside x: x is encoded again and costs 8, past the
    step's budget once y took it, so `inside` waits for the next step."""
    s = make_scheduler(encoder_budget=8, prefix_caching=True)
    s.add_request(image_request("first", [4, "x:8"], max_tokens=1))
    assert cached_step(s) == [("first", 12, True)]
    over, inside = image_request("over", [4, "x:8", 4, "y:8", 4]), image_request("inside", [4, "x:8"])
    s.add_request(over)
    s.add_request(inside)
    assert cached_step(s) == [("over", 16, True)]
    assert over.num_cached_tokens == 12
    assert cached_step(s) == [("over", 1, True), ("inside", 1, True)]
    assert inside.num_cached_tokens == 11
    assert cached_step(s) == [("inside", 1, True)]
    assert not s.has_unfinished() and s.pool.num_in_use == 0


def cached_step(s: Scheduler) -> list[tuple[str, int, bool]]:
    """One schedule + update with a prefix cache (where requests share blocks)."""
    out = s.schedule()
    s.update(out, {c.request.request_id: [TOKEN] for c in out.chunks if c.samples})
    s.pool.check_integrity()
    return [(c.request.request_id, c.num_new_tokens, c.samples) for c in out.chunks]


def test_text_requests_never_consult_the_budget():
    s = make_scheduler(encoder_budget=1)
    s.add_request(make_request("a", 30))
    s.add_request(make_request("b", 30))
    out = s.schedule()
    check_invariants(s, out)
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("a", 30), ("b", 30)]
    assert s.encoder_budget.used == 0
    s.update(out, {"a": [TOKEN], "b": [TOKEN]})
    run_to_end(s)


def test_an_image_two_requests_start_in_one_step_is_paid_once():
    """The runner encodes an image once a step, however many chunks start it."""
    s = make_scheduler(encoder_budget=8)
    s.add_request(image_request("a", [2, "s:6", 2]))
    s.add_request(image_request("b", [3, "s:6", "t:6", 1]))
    assert step(s)[0] == [("a", 10, True), ("b", 9, False)]  # b: s free, t (6 + 6 > 8) next step
    run_to_end(s)


# Gemma 3: a language model whose image tokens attend to each other both ways (whole_images)
GEMMA3 = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 4,
          "vision_config": {"image_size": 16, "patch_size": 4},
          "text_config": {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}}


def test_a_chunk_never_ends_inside_an_image_whose_tokens_see_each_other():
    """Budget 10, images of 6 (Gemma 3: `whole_images`). `cut`'s chunk of 10 would end inside its
    image: it stops before it. `grow` (attention parity shrinking its chunk to 8 tokens at context
    4) grows to the end of the image it starts at. `wait`, behind a decoding request, has 9 tokens
    of budget left for an image of 10 it starts at: it waits until the decoding one is done."""
    from ember.models.config import ModelConfig

    pool = BlockPool(64)
    config = EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=10, max_model_len=256,
                          model_config=ModelConfig.from_hf_config(GEMMA3))
    s = Scheduler(pool, config)
    s.add_request(image_request("cut", [6, "a:6", 2]))
    assert step(s)[0] == [("cut", 6, False)]
    assert step(s)[0] == [("cut", 8, True)]
    run_to_end(s)

    s = Scheduler(pool, dataclasses.replace(config, max_num_batched_tokens=16, attention_parity_len=4))
    s.add_request(image_request("grow", [12, "b:10", 2]))
    assert step(s)[0] == [("grow", 12, False)]
    assert step(s)[0] == [("grow", 10, False)]  # parity alone: 16 * 4 / (4 + 12) = 4
    assert step(s)[0] == [("grow", 2, True)]
    run_to_end(s)

    s = Scheduler(pool, config)
    s.add_request(make_request("text", 4, max_tokens=3))
    assert step(s)[0] == [("text", 4, True)]
    s.add_request(image_request("wait", [3, "c:10", 1]))
    assert step(s)[0] == [("text", 1, True), ("wait", 3, False)]
    assert step(s)[0] == [("text", 1, True)]
    assert step(s)[0] == [("wait", 10, False)]
    run_to_end(s)
