"""Encoder models (BERT, XLM-RoBERTa) on tiny random checkpoints saved by HF transformers
(encoder_models.py): LLM.embed equals sentence-transformers' `encode` (its Pooling and
Normalize modules read from the checkpoint), LLM.classify equals transformers' softmax over
the head's logits, and LLM.score on a cross-encoder equals sentence-transformers'
`CrossEncoder.predict` (BERT's segment ids included), all within 1e-4 in float32; prompts
batch whole into steps of a token budget; nothing is left behind; what an encoder cannot do
is refused by name."""

from __future__ import annotations

import pytest
import torch
from encoder_models import PAIRS, TEXTS, save_bert, save_xlm_roberta

from ember import LLM
from ember.pooling import PoolerConfig

transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")

SAVERS = {"bert": save_bert, "xlm_roberta": save_xlm_roberta}
# a budget that holds only a few of TEXTS at once: several steps, every prompt whole in one
ENGINE = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=64, block_size=8)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> {kind: checkpoint directory} for embedding (bert: mean pooling, xlm-r: CLS),
    three-label classification and one-label cross-encoder checkpoints."""
    out = {}
    for family, save in SAVERS.items():
        root = tmp_path_factory.mktemp(family)
        out[family] = {"embed": save(root / "embed"), "classify": save(root / "classify", head="classify",
                                                                       num_labels=3, seed=1),
                       "rerank": save(root / "rerank", head="classify", num_labels=1, seed=2)}
    return out


@pytest.mark.parametrize("family", SAVERS)
def test_embeddings_equal_sentence_transformers(models, family):
    path = models[family]["embed"]
    llm = LLM(str(path), **ENGINE)
    assert llm.config.runner == "pooling"  # an encoder's "auto"
    assert llm.config.pooler_config == PoolerConfig("MEAN" if family == "bert" else "CLS", normalize=True)
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])
    theirs = st.SentenceTransformer(str(path), device="cpu").encode(TEXTS, convert_to_tensor=True)
    assert ours.shape == theirs.shape == (len(TEXTS), 64)
    assert torch.allclose(ours, theirs.float(), atol=1e-4, rtol=0)
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
    llm.check_idle()


@pytest.mark.parametrize("family", SAVERS)
def test_classification_equals_transformers(models, family):
    path = models[family]["classify"]
    llm = LLM(str(path), **ENGINE)
    assert llm.config.model_config.label_names == ("negative", "neutral", "positive")
    outs = llm.classify(TEXTS)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    for text, out in zip(TEXTS, outs):
        with torch.no_grad():
            want = hf(**tok(text, return_tensors="pt")).logits[0].softmax(-1)
        assert out.outputs.num_classes == 3
        assert torch.allclose(torch.tensor(out.outputs.probs), want, atol=1e-5, rtol=0), text
        assert out.prompt_token_ids == tok(text)["input_ids"]
    llm.check_idle()


@pytest.mark.parametrize("family", SAVERS)
def test_cross_encoder_scores_equal_sentence_transformers(models, family):
    path = models[family]["rerank"]
    llm = LLM(str(path), **ENGINE)
    queries, docs = zip(*PAIRS)
    ours = [o.outputs.score for o in llm.score(list(queries), list(docs))]
    theirs = st.CrossEncoder(str(path), device="cpu").predict(PAIRS)  # the sigmoid of the one logit
    assert torch.allclose(torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64), atol=1e-4,
                          rtol=0)
    one = llm.score(queries[0], list(docs))  # one query against each document
    assert [o.outputs.score for o in one][0] == pytest.approx(ours[0], abs=1e-6)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert one[0].prompt_token_ids == tok(queries[0], docs[0])["input_ids"]
    llm.check_idle()


def test_bert_segment_ids_reach_the_model(models):
    """A pair's second text is segment 1 in BERT: the score with every token in segment 0
    differs, and equals transformers' on those ids."""
    path = models["bert"]["rerank"]
    llm = LLM(str(path), **ENGINE)
    pair = llm.inputs.pair_prompt(*PAIRS[0])
    assert set(pair["token_type_ids"]) == {0, 1} and len(pair["token_type_ids"]) == len(pair["prompt_token_ids"])
    flat = llm.classify([pair, {"prompt_token_ids": pair["prompt_token_ids"]}])
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([pair["prompt_token_ids"]])
    with torch.no_grad():
        paired = torch.sigmoid(hf(ids, token_type_ids=torch.tensor([pair["token_type_ids"]])).logits[0, 0]).item()
        zeros = torch.sigmoid(hf(ids).logits[0, 0]).item()
    assert flat[0].outputs.probs[0] == pytest.approx(paired, abs=1e-5)
    assert flat[1].outputs.probs[0] == pytest.approx(zeros, abs=1e-5)
    assert abs(paired - zeros) > 1e-4


def test_an_embedding_model_scores_by_cosine(models):
    path = models["bert"]["embed"]
    llm = LLM(str(path), **ENGINE)
    scores = [o.outputs.score for o in llm.score(PAIRS[1][0], [PAIRS[1][1], PAIRS[3][1]])]
    model = st.SentenceTransformer(str(path), device="cpu")
    a, b, c = model.encode([PAIRS[1][0], PAIRS[1][1], PAIRS[3][1]], convert_to_tensor=True)
    want = [torch.cosine_similarity(a, x, dim=0).item() for x in (b, c)]
    assert scores == pytest.approx(want, abs=1e-4)


def test_prompts_run_whole_within_the_budget(models):
    """Each step holds whole prompts only: a budget of 24 tokens runs the 8 texts in more
    steps than a budget of 512, with the same vectors; a prompt longer than the budget is
    refused at admission, as is a prompt past max_model_len."""
    path = models["xlm_roberta"]["embed"]
    wide = LLM(str(path), dtype="float32", max_model_len=64, max_num_batched_tokens=512)
    narrow = LLM(str(path), dtype="float32", max_model_len=64, max_num_batched_tokens=24)
    steps = {}
    for name, llm in (("wide", wide), ("narrow", narrow)):
        plans = []
        schedule = llm.engine.scheduler.schedule

        def recording(schedule=schedule, plans=plans):
            plan = schedule()
            plans.append([(c.request.request_id, c.num_new_tokens, c.request.num_prompt_tokens) for c in plan.chunks])
            return plan

        llm.engine.scheduler.schedule = recording
        short = [t for t in TEXTS if len(llm.get_tokenizer().encode(t)) <= 24]
        steps[name] = ([o.outputs.embedding for o in llm.embed(short)], [p for p in plans if p])
    (vectors_wide, plans_wide), (vectors_narrow, plans_narrow) = steps["wide"], steps["narrow"]
    assert torch.allclose(torch.tensor(vectors_wide), torch.tensor(vectors_narrow), atol=1e-6)
    assert len(plans_wide) == 1 and len(plans_narrow) > 1
    for plan in plans_narrow:
        assert sum(n for _, n, _ in plan) <= 24
        assert all(n == total for _, n, total in plan)  # never a part of a prompt
    long = TEXTS[-1]
    assert len(narrow.get_tokenizer().encode(long)) > 24
    with pytest.raises(ValueError, match="an encoder model runs a prompt in one step of at most "
                                         "max_num_batched_tokens=24: shorten it or raise max_num_batched_tokens"):
        narrow.embed(long)
    with pytest.raises(ValueError, match="max_model_len"):
        narrow.embed({"prompt_token_ids": [5] * 65})
    narrow.check_idle()


def test_what_an_encoder_cannot_do_is_refused(models):
    embed, classify = str(models["bert"]["embed"]), str(models["bert"]["classify"])
    with pytest.raises(ValueError, match="bert is an encoder: it embeds and classifies, it does not generate text"):
        LLM(embed, runner="generate")
    with pytest.raises(ValueError, match="tensor parallelism does not split encoders"):
        LLM(embed, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="pooler_config does not apply to it"):
        LLM(classify, pooler_config={"pooling_type": "MEAN"})
    llm = LLM(embed, **ENGINE)
    with pytest.raises(ValueError, match="LLM.generate, chat and stream needs an LLM made with runner='generate'"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="LLM.classify needs a sequence-classification model"):
        llm.classify("hello")
    with pytest.raises(ValueError, match=r"token_type_ids must be 3 ints \(one a prompt token\) in \[0, 2\)"):
        llm.embed({"prompt_token_ids": [2, 7, 3], "token_type_ids": [0, 2, 0]})
    classifier = LLM(classify, **ENGINE)
    with pytest.raises(ValueError, match="LLM.embed needs an embedding model"):
        classifier.embed("hello")
    with pytest.raises(ValueError, match="LLM.score needs a cross-encoder of one label; this model has 3"):
        classifier.score("a", "b")
    xlmr = LLM(str(models["xlm_roberta"]["embed"]), **ENGINE)
    with pytest.raises(ValueError, match="token_type_ids are read by encoder models with token types"):
        xlmr.embed({"prompt_token_ids": [0, 7, 2], "token_type_ids": [0, 0, 0]})
    for engine in (llm, classifier, xlmr):
        engine.check_idle()


def test_a_decoder_with_a_pooler_config_and_no_pooling_runner_is_refused(tmp_path):
    from test_families import LLAMA, save_tiny_model

    save_tiny_model(LLAMA, tmp_path)
    with pytest.raises(ValueError, match="pooler_config applies to runner='pooling' only"):
        LLM(str(tmp_path), pooler_config={"pooling_type": "MEAN"})


def test_sentence_transformers_pooling_files_of_either_age_are_read(models, tmp_path):
    """sentence-transformers 5+ writes `pooling_mode`; older files (all-MiniLM-L6-v2's) a
    flag per mode: both are read, and a mode ember does not pool by is refused by name."""
    import json
    import shutil

    from ember.loader.model_files import ModelFiles

    path = tmp_path / "old"
    shutil.copytree(models["bert"]["embed"], path)
    old = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
           "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(old))
    modules = json.loads((path / "modules.json").read_text())
    (path / "modules.json").write_text(json.dumps([m for m in modules if not m["type"].endswith("Normalize")]))
    assert ModelFiles(path, "safetensors").pooler_defaults() == PoolerConfig("MEAN", normalize=False)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(old | {"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="sentence-transformers pools by mean_tokens \\+ max_tokens; ember pools by "
                                         "one of the CLS token, the mean or the last token"):
        ModelFiles(path, "safetensors").pooler_defaults()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "weightedmean"}))
    with pytest.raises(ValueError, match="pools by weightedmean"):
        LLM(str(path))
    assert LLM(str(path), pooler_config={"pooling_type": "CLS"}, **ENGINE).config.pooler_config.pooling_type == "CLS"
