"""Beam search (`LLM.beam_search`, BeamSearchParams) against transformers' `generate(num_beams=k,
do_sample=False)` on a tiny random Llama in float32 whose small vocabulary makes EOS likely: the
same sequences, in the same order, with the same scores, for k = 1..8, length penalties and
every early_stopping mode."""

from __future__ import annotations

import pytest
import torch

from ember import LLM, BeamSearchParams

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

EOS = 2
PROMPTS = [[5, 17, 33, 3, 40, 41, 8], [7], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("beams")
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # EOS often among the best tokens: hypotheses end along the way
        model.lm_head.weight[EOS] *= 6
    model.save_pretrained(path)
    return path, model.eval()


@pytest.fixture(scope="module")
def llm(tiny, live_engines):
    engine = LLM(str(tiny[0]), dtype="float32", block_size=8, num_kv_blocks=256, max_model_len=256)
    live_engines.append(engine)
    yield engine
    live_engines.remove(engine)


def hf_beams(hf, prompt: list[int], k: int, max_tokens: int, length_penalty: float, early_stopping, ignore_eos: bool):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      num_beams=k, num_return_sequences=k, do_sample=False, max_new_tokens=max_tokens,
                      length_penalty=length_penalty, early_stopping=early_stopping, pad_token_id=0,
                      eos_token_id=None if ignore_eos else EOS, return_dict_in_generate=True, output_scores=True)
    scores = out.sequences_scores.tolist() if k > 1 else [None]
    return [(row.tolist(), score) for row, score in zip(out.sequences, scores)]


def strip(row: list[int], prompt_len: int, ignore_eos: bool) -> list[int]:
    """A transformers row without the padding after its EOS (pad 0; EOS ends a hypothesis)."""
    gen = row[prompt_len:]
    if EOS in gen and not ignore_eos:
        gen = gen[:gen.index(EOS) + 1]
    return row[:prompt_len] + gen


@pytest.mark.parametrize("k, length_penalty, early_stopping, ignore_eos", [
    (1, 1.0, False, False), (2, 1.0, False, False), (3, 0.0, True, False), (4, 1.0, False, False),
    (4, 2.0, "never", False), (5, -1.0, True, False), (8, 1.0, False, False), (4, 1.0, False, True)])
def test_beams_equal_transformers(llm, tiny, k, length_penalty, early_stopping, ignore_eos):
    hf = tiny[1]
    params = BeamSearchParams(beam_width=k, max_tokens=12, length_penalty=length_penalty,
                              early_stopping=early_stopping, ignore_eos=ignore_eos)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    stopped = 0
    for prompt, out in zip(PROMPTS, outs):
        want = hf_beams(hf, prompt, k, 12, length_penalty, early_stopping, ignore_eos)
        got = [(s.tokens, s.score) for s in out.sequences]
        assert [s for s, _ in got] == [strip(row, len(prompt), ignore_eos) for row, _ in want], (prompt, k)
        if k > 1:
            torch.testing.assert_close(torch.tensor([s for _, s in got]), torch.tensor([s for _, s in want]),
                                       rtol=1e-5, atol=1e-5)
        stopped += sum(s.finish_reason == "stop" for s in out.sequences)
        for s in out.sequences:  # the summed log-probabilities, by the score's own formula
            n = len(s.tokens) - len(prompt)
            assert s.score == pytest.approx(s.cum_logprob / n ** length_penalty, rel=1e-5, abs=1e-6)
    if not ignore_eos and k > 1:
        assert stopped > 0  # some hypotheses ended with EOS
    llm.engine.check_idle()


def test_bad_beam_params_are_refused():
    with pytest.raises(ValueError, match="beam_width must be an integer in 1..10"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="leave temperature 0"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="early_stopping must be"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
