"""Encoders on CUDA (`-m gpu`): a BERT and an XLM-RoBERTa classifier (encoder_models.py) give
transformers' probabilities in float32 within 1e-4, and in bfloat16 within bfloat16's
error; the engine holds no KV memory for them and no block afterwards."""

from __future__ import annotations

import pytest
import torch
from encoder_models import TEXTS, save_bert, save_xlm_roberta

from ember import LLM

transformers = pytest.importorskip("transformers")


@pytest.mark.gpu
@pytest.mark.parametrize("save", [save_bert, save_xlm_roberta])
def test_classifiers_on_cuda_equal_transformers(save, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = save(tmp_path / "model", head="classify", num_labels=3, seed=1)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    with torch.no_grad():
        want = torch.stack([hf(**tok(t, return_tensors="pt")).logits[0].softmax(-1) for t in TEXTS])
    for dtype, atol in (("float32", 1e-4), ("bfloat16", 3e-2)):
        llm = LLM(str(path), device="cuda", dtype=dtype, max_model_len=64)
        assert llm.engine.runner.kv_cache.numel() == 0 and llm.engine.runner.graphs is None
        got = torch.tensor([o.outputs.probs for o in llm.classify(TEXTS)], dtype=torch.float64)
        assert torch.allclose(got, want.double(), atol=atol, rtol=0), (dtype, (got - want).abs().max())
        llm.check_idle()
        del llm
        torch.cuda.empty_cache()
