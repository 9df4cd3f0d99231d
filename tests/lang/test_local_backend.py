"""ember.lang on an in-process LLM (the default model, float32, greedy): a gen is
LLM.generate's tokens, roles are the chat template's, turns reuse the cache, select scores
are HF transformers' logprobs, constraints hold, and errors end only their own state."""

from __future__ import annotations

import json
import re

import pytest
import torch

import ember.lang as sgl
from ember import SamplingParams


@pytest.fixture(scope="module")
def backend(llm):
    backend = sgl.LocalBackend(llm)
    yield backend
    backend.shutdown()


def test_a_gen_is_llm_generate_on_the_same_text(backend, llm):
    @sgl.function
    def complete(s, prompt):
        s += prompt + sgl.gen("answer", max_tokens=12, temperature=0)

    state = complete.run("The capital of France is", backend=backend)
    ref = llm.generate("The capital of France is", SamplingParams(max_tokens=12, temperature=0))[0]
    assert state["answer"] == ref.outputs[0].text
    eos = ref.outputs[0].token_ids[-1:] if ref.outputs[0].finish_reason == "stop" else []
    assert state.token_ids() + eos == ref.prompt_token_ids + list(ref.outputs[0].token_ids)


def test_roles_are_the_chat_templates_rendering(backend, llm):
    @sgl.function
    def chat(s):
        s += sgl.system("You are terse.")
        with s.user():
            s += "Name a color."
        s += sgl.assistant_begin() + "Blue." + sgl.assistant_end()
        s += sgl.user("Another one?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=8, temperature=0))

    state = chat.run(backend=backend)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    rendered = llm.inputs.chat_prompt(messages, add_generation_prompt=False)
    assert state.text() == rendered["prompt"]
    assert state.token_ids() == rendered["prompt_token_ids"]
    ref = llm.chat(messages[:4], SamplingParams(max_tokens=8, temperature=0))[0]
    assert state["answer"] == ref.outputs[0].text.strip()
    assert state.get_meta_info("answer")["prompt_tokens"] == len(ref.prompt_token_ids)


def test_four_turns_reuse_every_earlier_token(backend, llm):
    @sgl.function
    def turns(s):
        for i, ask in enumerate(["Hi!", "Name a fruit.", "And a tree?", "Thanks."]):
            s += sgl.user(ask)
            s += sgl.assistant(sgl.gen(f"t{i}", max_tokens=6, temperature=0))

    block = llm.config.block_size
    state = turns.run(backend=backend)
    for i in range(1, 4):
        before, meta = state.get_meta_info(f"t{i - 1}"), state.get_meta_info(f"t{i}")
        # every whole block of the previous call's computed tokens (all but its last, sampled one)
        computed = before["prompt_tokens"] + before["completion_tokens"] - 1
        assert meta["cached_tokens"] >= computed // block * block > computed - block, (i, before, meta)


def test_special_tokens_the_model_wrote_stay_in_the_state(backend, llm):
    """With ignore_eos the model writes <|im_end|> (2) and <|im_start|> (1) inside a gen; its text
    skips them, its state keeps them, so the next call's prompt is the model's own tokens and
    hits the cache up to its last one."""
    @sgl.function
    def answer(s):
        s += sgl.user("What is 2+2?") + sgl.assistant_begin()
        s += sgl.gen("a", max_tokens=24, temperature=0, ignore_eos=True) + "\nNext:" + sgl.gen("b", max_tokens=2)

    state = answer.run(backend=backend)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ref = llm.chat(messages, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    ids = list(ref.outputs[0].token_ids)
    assert ids[11:16] == [2, 198, 2, 1, 9690] and state["a"] == ref.outputs[0].text  # the text without them
    tokens = state.token_ids()
    meta = state.get_meta_info("b")
    assert tokens[:meta["prompt_tokens"]] == ref.prompt_token_ids + ids + backend.encode("\nNext:", False)
    assert meta["cached_tokens"] == meta["prompt_tokens"] - 1 - len(backend.encode("\nNext:", False))


def _hf_logprobs(hf_model, prefix: list[int], choice: list[int]) -> list[float]:
    ids = torch.tensor([prefix + choice])
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(ids).logits[0].float(), -1)
    return [logprobs[len(prefix) + j - 1, t].item() for j, t in enumerate(choice)]


def _hf_logprobs_after(hf_model, prefix: list[int], choices: list[list[int]]) -> list[list[float]]:
    """_hf_logprobs of each choice after one long prefix: transformers computes the prefix once
    and each choice on a copy of its KV cache (its incremental decoding, as generate does)."""
    import copy

    with torch.no_grad():
        out = hf_model(torch.tensor([prefix]), use_cache=True)
        last = torch.log_softmax(out.logits[0, -1:].float(), -1)
        scores = []
        for choice in choices:
            rows = last
            if len(choice) > 1:
                more = hf_model(torch.tensor([choice[:-1]]), cache=copy.deepcopy(out.cache),
                                use_cache=True)
                rows = torch.cat([last, torch.log_softmax(more.logits[0].float(), -1)])
            scores.append([rows[j, t].item() for j, t in enumerate(choice)])
    return scores


def test_select_scores_are_hf_logprobs_in_one_engine_call(backend, llm, hf_model):
    prompt = "Q: What is the capital of France?\nA: The capital of France is"
    choices = [" Paris", " Paris, France", " Lyon", " the city of Paris"]  # sharing tokens with each other

    @sgl.function
    def pick(s, options):
        s += prompt + sgl.select("city", choices=options)

    backend.flush_cache()
    pick.run(choices, backend=backend)  # the prompt is cached: the next select scores only its choices' tokens
    calls = backend.num_engine_calls
    state = pick.run(choices, backend=backend)
    assert backend.num_engine_calls == calls + 1
    meta = state.get_meta_info("city")
    prefix = llm.get_tokenizer().encode(prompt)
    for tokens, cached, total in zip(meta["input_token_logprobs"], meta["cached_tokens"], meta["prompt_tokens"]):
        ids = [t[1] for t in tokens]
        assert ids == llm.get_tokenizer().encode(choices[meta["input_token_logprobs"].index(tokens)],
                                                 add_special_tokens=False)
        assert [t[0] for t in tokens] == pytest.approx(_hf_logprobs(hf_model, prefix, ids), abs=1e-3)
        assert total - cached <= len(ids) + llm.config.block_size  # only the choice and the prefix's last block
    means = meta["normalized_prompt_logprobs"]
    assert state["city"] == choices[means.index(max(means))]
    reordered = pick.run(choices[::-1], backend=backend).get_meta_info("city")["normalized_prompt_logprobs"]
    assert reordered[::-1] == pytest.approx(means, abs=1e-5)
    assert state.token_ids() == prefix + llm.get_tokenizer().encode(state["city"], add_special_tokens=False)


def test_a_select_over_a_fresh_prefix_computes_it_once(backend, llm, hf_model):
    block = llm.config.block_size
    def length(notes: str) -> int:
        return len(backend.encode_first(notes + "\nAnswer:"))

    notes = "Notes:" + "".join(f" item {i} is {['red', 'green', 'blue'][i % 3]}." for i in range(45))
    while length(notes) % block != 1:
        notes += " a"
    prompt = notes + "\nAnswer:"  # ~300 tokens, one past a block boundary: a later hit can take all its blocks
    choices = [" yes", " no", " maybe so", " not at all"]

    @sgl.function
    def pick(s):
        s += prompt + sgl.select("answer", choices=choices)

    backend.flush_cache()
    meta = pick.run(backend=backend).get_meta_info("answer")
    prefix, own = backend.encode_first(prompt), [backend.encode(c, False) for c in choices]
    computed = sum(p - c for p, c in zip(meta["prompt_tokens"], meta["cached_tokens"]))
    # the first choice computes the prefix; the others wait a step and take its blocks from the
    # cache, computing only the prefix's last token (whose logits score their first) and their own
    assert 290 < len(prefix) < 340
    assert computed == len(prefix) + sum(map(len, own)) + len(choices) - 1, meta
    for tokens, want in zip(meta["input_token_logprobs"], _hf_logprobs_after(hf_model, prefix, own), strict=True):
        assert [t[0] for t in tokens] == pytest.approx(want, abs=1e-3)


def test_select_methods(backend):
    @sgl.function
    def pick(s, method):
        s += "The sky is" + sgl.select("color", choices=[" blue", " green", " blue and wide"], choices_method=method)

    for method in (sgl.token_length_normalized, sgl.greedy_token_selection, sgl.token_logprob_sum,
                   sgl.unconditional_likelihood_normalized):
        meta = pick.run(method, backend=backend).get_meta_info("color")
        sums = [sum(t[0] for t in tokens) for tokens in meta["input_token_logprobs"]]
        if method is sgl.token_logprob_sum:
            assert pick.run(method, backend=backend)["color"] == [" blue", " green", " blue and wide"][
                sums.index(max(sums))]
        if method is sgl.unconditional_likelihood_normalized:
            alone = meta["unconditional_token_logprobs"]
            assert alone[0][0][0] is None and all(t[0] < 0 for t in alone[2][1:])


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer"}, "ok": {"type": "boolean"}},
     "required": ["age", "ok"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "maxItems": 2}}, "required": ["tags"]},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]},
]


def test_constrained_gens_are_valid(backend):
    @sgl.function
    def extract(s, schema):
        s += "Phone: " + sgl.gen("phone", max_tokens=16, regex=r"\d{3}-\d{4}", temperature=0) + "\n"
        s += "Legs of a spider: " + sgl.gen_int("legs", max_tokens=6, temperature=0) + "\n"
        s += "Facts as JSON: " + sgl.gen("facts", max_tokens=48, json_schema=schema, temperature=0)

    states = extract.run_batch([{"schema": json.dumps(schema)} for schema in SCHEMAS], backend=backend)
    for schema, state in zip(SCHEMAS, states):
        assert state.error() is None
        assert re.fullmatch(r"\d{3}-\d{4}", state["phone"])
        assert re.fullmatch(sgl.api.gen_expr.__globals__["REGEX_INT"], state["legs"])
        facts = json.loads(state["facts"])
        assert set(schema["required"]) <= set(facts)


def test_a_bad_regex_or_schema_raises_at_gen(backend):
    calls = backend.num_engine_calls
    with pytest.raises(ValueError, match="not a valid regular expression"):
        sgl.gen("x", regex="[0-9")
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        sgl.gen("x", json_schema="{not json")
    with pytest.raises(ValueError, match="stop_regex is not supported"):
        sgl.gen("x", stop_regex="a+")
    assert backend.num_engine_calls == calls


def test_errors_surface_at_run_and_stay_in_their_state_under_run_batch(backend):
    @sgl.function
    def program(s, fail_in):
        s += "Count: 1, 2," + sgl.gen("n", max_tokens=3, temperature=0)
        if fail_in == "program":
            raise RuntimeError("the program failed")
        if fail_in == "gen":
            s += sgl.gen("bad", max_tokens=3, stop_token_ids=[10 ** 9])  # refused by the engine's check
        s += "done"

    with pytest.raises(RuntimeError, match="the program failed"):
        program.run("program", backend=backend)
    with pytest.raises(ValueError, match="stop_token_ids"):
        program.run("gen", backend=backend)
    states = program.run_batch([{"fail_in": f} for f in ("none", "program", "gen", "none")], backend=backend,
                               num_threads=2)
    assert [type(s.error()).__name__ for s in states] == ["NoneType", "RuntimeError", "ValueError", "NoneType"]
    assert states[0].text() == states[3].text() and states[0].text().endswith("done")
    with pytest.raises(ValueError):
        states[2]["bad"]


def test_fork_join_and_copy(backend, llm):
    @sgl.function
    def expand(s):
        s += "Three animals: cat, dog, cow.\n"
        forks = s.fork(3)
        forks += lambda i: f"Animal {i + 1} in one word:" + sgl.gen("word", max_tokens=4, temperature=0, stop="\n")
        forks.join()
        with s.copy() as c:
            c += "Aside:" + sgl.gen("aside", max_tokens=3, temperature=0)
        s += "Done."

    state = expand.run(backend=backend)
    words = state["word"]
    assert isinstance(words, list) and len(words) == 3
    for i, word in enumerate(words):
        ref = llm.generate(f"Three animals: cat, dog, cow.\nAnimal {i + 1} in one word:",
                           SamplingParams(max_tokens=4, temperature=0, stop=["\n"]))[0]
        assert word == ref.outputs[0].text
    assert state["aside"] == [state["aside"][0]] and state.text() == "Three animals: cat, dog, cow.\nDone."


def test_streaming_text_iter(backend):
    @sgl.function
    def story(s):
        s += "Once upon a time" + sgl.gen("rest", max_tokens=12, temperature=0)

    state = story.run(stream=True, backend=backend)
    pieces = list(state.text_iter("rest"))
    assert "".join(pieces) == state["rest"] and len(pieces) > 1
    assert state.text() == "Once upon a time" + state["rest"]


def test_an_async_engine_backend_gives_the_llms_outputs(gguf_path, backend):
    from ember.config import EngineConfig
    from ember.engine.async_engine import AsyncEngine

    @sgl.function
    def chat(s, ask):
        s += sgl.user(ask)
        s += sgl.assistant(sgl.gen("answer", max_tokens=6, temperature=0))
        s += sgl.user("Sure?") + sgl.assistant(sgl.select("sure", choices=["Yes", "No"]))

    engine = AsyncEngine(EngineConfig(model=str(gguf_path), quantization="none", dtype="float32"))  # the llm's
    on_engine = sgl.LocalBackend(engine)
    try:
        asks = [{"ask": "Name a fruit."}, {"ask": "Name a tree."}]
        for a, b in zip(chat.run_batch(asks, backend=backend), chat.run_batch(asks, backend=on_engine)):
            assert b.error() is None and a.token_ids() == b.token_ids()
            assert (a["answer"], a["sure"]) == (b["answer"], b["sure"])
        assert on_engine.flush_cache()
    finally:
        on_engine.shutdown()
        engine.stop()
