"""Which files of an HF checkpoint directory are read: the shards model.safetensors.index.json
names (a consolidated.safetensors beside them is ignored, as vLLM does), every .safetensors
where there is no index, and pytorch_model*.bin (memory-mapped, tensors only) where there is
no safetensors at all. Each layout gives the logits of the same weights in one file."""

from __future__ import annotations

import datetime
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_model_files import TINY, TINY_ARGS, tiny_cfg, write_hf_dir

from ember import LLM, SamplingParams
from ember.loader.dummy import iter_dummy_weights

PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [7, 1, 2]]


def tensors() -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in iter_dummy_weights(tiny_cfg(), seed=0)}


def halves(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    names = sorted(w)
    return {n: w[n] for n in names[: len(names) // 2]}, {n: w[n] for n in names[len(names) // 2:]}


def write_index(path: Path, name: str, shards: dict[str, dict[str, torch.Tensor]]) -> None:
    weight_map = {tensor: shard for shard, part in shards.items() for tensor in part}
    (path / name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> LLM:
    """The tiny model from one model.safetensors."""
    return LLM(str(write_hf_dir(tmp_path_factory.mktemp("one") / "m")), **TINY_ARGS)


def assert_same_model(llm: LLM, reference: LLM, forward_logits) -> None:
    for ours, theirs in zip(forward_logits(llm, PROMPTS), forward_logits(reference, PROMPTS)):
        assert torch.equal(ours, theirs)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)] == \
        [o.outputs[0].token_ids for o in reference.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def sharded_dir(path: Path) -> Path:
    """config.json, an index, two shards, and a decoy consolidated.safetensors whose tensors
    have other shapes and names than the model's."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY))
    first, second = halves(tensors())
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    for name, part in shards.items():
        save_file(part, str(path / name))
    write_index(path, "model.safetensors.index.json", shards)
    save_file({"model.norm.weight": torch.zeros(3), "tok_embeddings.weight": torch.zeros(4, 4)},
              str(path / "consolidated.safetensors"))
    return path


def test_the_index_chooses_the_shards(tmp_path, reference, forward_logits):
    llm = LLM(str(sharded_dir(tmp_path / "m")), **TINY_ARGS)
    assert llm.config.load_format == "safetensors"
    assert_same_model(llm, reference, forward_logits)


def test_an_index_naming_a_missing_shard(tmp_path):
    path = sharded_dir(tmp_path / "m")
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError) as info:
        LLM(str(path), **TINY_ARGS)
    assert str(info.value) == (f"{path / 'model.safetensors.index.json'} names model-00002-of-00002.safetensors, "
                               f"missing from {path}: download the missing shard(s) again")


def test_an_index_without_a_weight_map(tmp_path):
    path = sharded_dir(tmp_path / "m")
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"model.safetensors.index.json has no weight_map: download it again$"):
        LLM(str(path), **TINY_ARGS)


def test_one_pytorch_model_bin(tmp_path, reference, forward_logits, caplog):
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY))
    torch.save(tensors(), path / "pytorch_model.bin")
    with caplog.at_level(logging.WARNING, logger="ember.loader.safetensors"):
        llm = LLM(str(path), **TINY_ARGS)
    assert llm.config.load_format == "pt"
    assert f"{path}: loading pytorch_model*.bin files; safetensors is preferred (faster to load, and no pickle)" \
        in caplog.messages
    assert_same_model(llm, reference, forward_logits)


def test_sharded_pytorch_model_bin(tmp_path, reference, forward_logits):
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY))
    first, second = halves(tensors())
    shards = {"pytorch_model-00001-of-00002.bin": first, "pytorch_model-00002-of-00002.bin": second}
    for name, part in shards.items():
        torch.save(part, path / name)
    write_index(path, "pytorch_model.bin.index.json", shards)
    torch.save({"junk": torch.zeros(1)}, path / "pytorch_model-old.bin")  # not in the index: not read
    assert_same_model(LLM(str(path), **TINY_ARGS), reference, forward_logits)


def test_safetensors_win_over_bin(tmp_path, reference):
    path = write_hf_dir(tmp_path / "m")
    torch.save({"junk": torch.zeros(1)}, path / "pytorch_model.bin")
    assert LLM(str(path), **TINY_ARGS).config.load_format == "safetensors"


def test_a_bin_that_holds_more_than_tensors_is_refused(tmp_path):
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY))
    torch.save({"model.norm.weight": torch.ones(64), "saved": datetime.date(2026, 12, 1)}, path / "pytorch_model.bin")
    with pytest.raises(ValueError) as info:
        LLM(str(path), **TINY_ARGS)
    assert str(info.value) == (f"{path / 'pytorch_model.bin'} holds more than tensors (datetime.date), and ember "
                               "loads .bin files with weights_only=True (no pickled object is made): convert the "
                               "checkpoint to safetensors")


def test_load_format_must_fit_the_files(tmp_path):
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(ValueError, match=rf"^{path} holds no pytorch_model\*\.bin file: pass an HF checkpoint"):
        LLM(str(path), load_format="pt", **TINY_ARGS)
    shutil.copyfile(write_hf_dir(tmp_path / "st") / "model.safetensors", path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"^{path} holds no pytorch_model\*\.bin file"):
        LLM(str(path), load_format="pt", **TINY_ARGS)
