"""The grammar backends on ember's own tokenizer (no model): the vocabulary they see,
the bitmask they fill (exact token sets), accepting, terminating, jump-forward, and the
constraint parameters' own checks."""

from __future__ import annotations

import pytest
import torch

from ember.runner.sampler import SamplingRow, apply_grammar_masks, unpack_bitmask
from ember.sampling_params import SamplingParams
from ember.sampling_params import StructuredOutputsParams as S
from ember.structured.base import UnavailableBackend, bitmask_words
from ember.structured.registry import make_backend

VOCAB = 49152  # SmolLM2's logits width (the `tok` and `backend` fixtures: conftest.py)
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


STOP = {0, 2, 4}  # the default model's end-of-generation tokens


def allowed(matcher) -> set[int]:
    bitmask = torch.zeros(2, bitmask_words(VOCAB), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 1)
    assert not bitmask[0].any()  # only its own row is written
    return set(torch.nonzero(unpack_bitmask(bitmask, VOCAB)[1]).flatten().tolist())


def test_the_backends_see_the_models_vocabulary(tok):
    from ember.structured.xgrammar_backend import tokenizer_info

    info = tokenizer_info(tok, VOCAB)
    assert info.vocab_size == VOCAB == tok.vocab_size
    assert info.vocab_type.name == "BYTE_LEVEL"
    assert tok.all_special_ids == list(range(17))
    # the stop tokens are llama.cpp's end-of-generation set for this file (ember/loader/gguf_tokenizer.py):
    # <|endoftext|>, <|im_end|> and <reponame> (a fill-in-the-middle token); xgrammar lists them apart
    assert info.stop_token_ids == [0, 2, 4]
    assert info.special_token_ids == [i for i in range(17) if i not in (0, 2, 4)]
    with pytest.raises(ValueError, match="the tokenizer has 49152 tokens but the model's logits are 100 wide"):
        tokenizer_info(tok, 100)


def test_a_choice_allows_exactly_the_prefixes_of_its_options(backend, tok):
    m = backend.compile(S(choice=["yes", "no"])).matcher()
    first = allowed(m)
    assert {tok.decode([t]) for t in first} == {"y", "ye", "yes", "n", "no"}
    assert m.accept_token(tok.encode("yes", add_special_tokens=False)[0])
    assert allowed(m) == STOP  # complete: only the stop tokens
    assert m.is_terminated() == (backend.name == "guidance")
    assert not m.accept_token(tok.encode(" maybe", add_special_tokens=False)[0])


def test_json_accepts_a_valid_object_token_by_token_and_no_special_token_inside(backend, tok):
    m = backend.compile(S(json=PERSON)).matcher()
    assert m.jump_forward() == '{"name": "'
    ids = tok.encode('{"name": "Bob", "age": 42}', add_special_tokens=False)
    assert m.accept_tokens(ids[:5]) == 5  # {" name ": space-" ... inside the string now
    inside = allowed(m)
    assert not inside & set(range(17)) and len(inside) > 1000  # free text, but no special token
    assert m.accept_tokens(ids[5:]) == len(ids) - 5
    assert allowed(m) == STOP  # complete: only the stop tokens
    assert m.accept_token(2) or backend.name == "guidance"
    assert m.is_terminated()


def test_a_token_the_grammar_forbids_is_refused_and_changes_nothing(backend, tok):
    m = backend.compile(S(regex=r"\d{3}")).matcher()
    before = allowed(m)
    assert not m.accept_token(tok.encode("a", add_special_tokens=False)[0])
    assert allowed(m) == before
    digits = tok.encode("123", add_special_tokens=False)
    assert m.accept_tokens(digits + digits) == 3  # the longest allowed prefix
    m.rollback(1)
    assert m.accept_token(digits[2])


def test_jump_forward_inside_a_json_object(backend, tok):
    m = backend.compile(S(json=PERSON)).matcher()
    ids = tok.encode('{"name": "Al"', add_special_tokens=False)
    assert m.accept_tokens(ids) == len(ids)
    assert m.jump_forward() == ', "age": '


@pytest.mark.parametrize("kwargs,message", [
    ({}, "exactly one of json, regex, choice, grammar, json_object, structural_tag; got none"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one of json, regex, choice, grammar, json_object, structural_tag; got json, regex"),
    ({"json": "{not json"}, "StructuredOutputsParams.json is not valid JSON"),
    ({"json": [1]}, "StructuredOutputsParams.json must be a JSON schema object"),
    ({"choice": []}, "StructuredOutputsParams.choice must be a non-empty list of non-empty strings; got \\[\\]"),
    ({"choice": ["a", ""]}, "StructuredOutputsParams.choice must be a non-empty list of non-empty strings"),
    ({"choice": "ab"}, "StructuredOutputsParams.choice must be a non-empty list"),
    ({"regex": 3}, "StructuredOutputsParams.regex must be a non-empty string"),
])
def test_structured_outputs_params_check_their_shape(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        S(**kwargs)


def test_params_keys_and_schema_text():
    assert S(json={"b": 1, "a": 2}).key == ("json", '{"b": 1, "a": 2}')  # key order kept: it orders the output
    assert S(json_object=True).schema == '{"type": "object"}'
    assert S(choice=["x", "y"]).key == ("choice", '["x", "y"]') and S(choice=["x", "y"]).choice == ("x", "y")
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


def test_without_a_tokenizer_the_null_backend_refuses_at_the_boundary():
    backend = make_backend("xgrammar", None, VOCAB)
    assert isinstance(backend, UnavailableBackend)
    with pytest.raises(ValueError, match="structured output is not available: the model has no tokenizer"):
        backend.validate(S(regex="a"))
    with pytest.raises(ValueError, match="structured_outputs_backend must be one of xgrammar, guidance, llguidance; got 'outlines'"):
        make_backend("outlines", None, VOCAB)


def test_the_sampler_masks_exactly_the_forbidden_tokens_of_constrained_rows():
    logits = torch.randn(3, 70)
    bits = torch.zeros(bitmask_words(70), dtype=torch.int32)
    for t in (0, 31, 33, 69):
        bits[t // 32] |= torch.tensor(1 << t % 32, dtype=torch.int64).to(torch.int32)  # bit 31: the sign bit
    row = lambda allowed: SamplingRow(SamplingParams(temperature=0), None, [1], [], frozenset(), allowed)  # noqa: E731
    out = apply_grammar_masks(logits, [row(None), row(bits), row(None)])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [0, 31, 33, 69]
    assert torch.equal(out[1][[0, 31, 33, 69]], logits[1][[0, 31, 33, 69]])


def test_xgrammar_refuses_a_choice_no_token_sequence_can_spell(xgrammar_backend, tok):
    """SmolLM2's vocabulary holds no token with the byte 0xF1 (the first byte of U+40000 to
    U+7FFFF): such a choice would meet a dead end mid-output, so it is refused at the boundary."""
    with pytest.raises(ValueError, match=r"^choice 1 \('%J\\U00078282Æ\{'\) holds bytes no token of the model's "
                                         r"vocabulary has \(0xF1\), so it can never be generated"):
        xgrammar_backend.validate(S(choice=(";", "%J\U00078282Æ{")))
    xgrammar_backend.validate(S(choice=("café", "\U0001F600", "\U00100000")))  # spellable
    assert xgrammar_backend._spelled >= set(range(0x20, 0x7F)) and 0xF1 not in xgrammar_backend._spelled


def test_a_structural_tag_is_xgrammars_and_checked_at_the_boundary(backend):
    tag = '{"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], ' \
          '"triggers": ["<f"]}'
    if backend.name == "guidance":
        with pytest.raises(ValueError, match="a structural_tag needs the xgrammar backend"):
            backend.validate(S(structural_tag=tag))
    else:
        backend.validate(S(structural_tag=tag))
        with pytest.raises(ValueError, match="invalid structural tag for structured output"):
            backend.validate(S(structural_tag='{"type": "structural_tag", "format": {"type": "nope"}}'))
    with pytest.raises(ValueError, match="structural_tag must be a JSON object's text"):
        S(structural_tag="[1]")
    assert S(structural_tag=tag).key == ("structural_tag", tag)
