"""The roofline floor's byte and FLOP counts (ember/bench/roofline.py) on the shapes the
benchmarks race: a dense model reads every weight each step; a mixture of experts reads its
dense part plus the experts its batch touches, and its FLOPs count only the active experts."""

import json
from pathlib import Path

import pytest

from ember.bench.roofline import expert_bytes_read, model_sizes
from ember.models.config import ModelConfig

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def _config(name: str) -> ModelConfig:
    return ModelConfig.from_hf_config(json.loads((CONFIGS / name / "config.json").read_text()))


def test_a_dense_model_reads_all_its_matmul_weights():
    resident, active, kv, _ = model_sizes(_config("llama-3.1-8b"))
    layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    assert active == 32 * layer + 128256 * 4096 and resident == 2 * active
    assert kv == 2 * 32 * 1024 * 2
    assert expert_bytes_read(_config("llama-3.1-8b"), 512) == 0


def test_qwen3_30b_a3b_reads_its_touched_experts():
    cfg = _config("qwen3-30b-a3b")
    resident, active, _, _ = model_sizes(cfg)
    attn = 2048 * (4096 + 2 * 512) + 4096 * 2048
    expert = 3 * 2048 * 768
    assert resident == 2 * (48 * (attn + 2048 * 128) + 151936 * 2048)
    assert active == resident / 2 + 48 * 8 * expert  # 3.04e9: the "A3B"
    assert expert_bytes_read(cfg, 1) == pytest.approx(2 * 48 * 8 * expert)
    # 512 tokens touch all but a (1 - 8/128)^512 share of the 128 experts
    assert expert_bytes_read(cfg, 512) == pytest.approx(2 * 48 * 128 * expert, rel=1e-12)


def test_mixtral_one_token_reads_two_of_eight_experts():
    cfg = _config("mixtral-8x7b")
    expert = 3 * 4096 * 14336
    assert expert_bytes_read(cfg, 1) == pytest.approx(2 * 32 * 2 * expert)
    assert expert_bytes_read(cfg, 2) == pytest.approx(2 * 32 * 8 * (1 - 0.75 ** 2) * expert)


def test_gpt_oss_120b_reads_its_experts_as_mxfp4():
    cfg = _config("gpt-oss-120b")
    expert = 3 * 2880 * 2880
    assert expert_bytes_read(cfg, 1) == pytest.approx(36 * 4 * expert * 17 / 32)  # 4.25 bits a weight
