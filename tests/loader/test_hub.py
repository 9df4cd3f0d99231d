"""Hugging Face Hub ids, resolved offline from a real HF cache laid out in a tmp folder:
models--org--name/{blobs, snapshots/<commit>/..., refs/<branch>}, as huggingface_hub writes
it, with HF_HUB_OFFLINE=1. huggingface_hub itself runs (snapshot_download); nothing is
mocked. The cache is passed as download_dir in-process (huggingface_hub reads HF_HUB_CACHE
once, at import) and through HF_HUB_CACHE / HF_HOME in subprocesses."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hub_server import COMMIT, HubStandIn
from test_checkpoint_files import sharded_dir
from test_model_files import TINY_ARGS, tiny_cfg, write_hf_dir

from ember import LLM, EngineConfig, SamplingParams
from ember.loader.dummy import iter_dummy_weights
from ember.loader.hub import choose_weight_files, parse_hub_id, pick_gguf, resolve_hub_tokenizer
from ember.loader.model_files import locate_model

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
IDS = [5, 17, 99, 3, 250, 41, 8]


def add_snapshot(cache: Path, repo_id: str, files: dict[str, Path], commit: str, refs: tuple[str, ...] = ("main",),
                 symlinks: bool = True) -> Path:
    """One commit of a repo in an HF cache: every file a blob named by its hash, linked from
    snapshots/<commit>/ (or a plain copy there), and refs/<branch> naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, src in files.items():
        dest = snapshot / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not symlinks:
            shutil.copyfile(src, dest)
            continue
        blob = repo / "blobs" / hashlib.sha256(f"{src.resolve()}:{src.stat().st_size}".encode()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.symlink_to(src.resolve())  # huggingface_hub's blobs are files; a link saves copying a model
        dest.symlink_to(os.path.relpath(blob, dest.parent))
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def hf_files(path: Path) -> dict[str, Path]:
    return {p.name: p for p in path.iterdir() if p.is_file()}


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def write_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer for the tiny vocabulary: "w0".."w255", split on whitespace."""
    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Two tiny Llamas: seed-0 weights with a word tokenizer, seed-1 weights without."""
    root = tmp_path_factory.mktemp("models")
    a = write_hf_dir(root / "a")
    write_word_tokenizer(a)
    return {"a": a, "b": write_hf_dir(root / "b", dict(iter_dummy_weights(tiny_cfg(), seed=1)))}


@pytest.fixture(scope="module")
def cache(tmp_path_factory, models, gguf_path) -> Path:
    """org/tiny: commit A (seed 0) on main, commit B (seed 1) on the dev branch, B as plain
    files; org/smol-GGUF: the default model as a Q4_1 file beside another .gguf."""
    cache = tmp_path_factory.mktemp("hf-cache")
    add_snapshot(cache, "org/tiny", hf_files(models["a"]), COMMIT_A)
    add_snapshot(cache, "org/tiny", hf_files(models["b"]), COMMIT_B, refs=("dev",), symlinks=False)
    other = tmp_path_factory.mktemp("other") / "other.gguf"
    other.write_bytes(b"GGUF not loaded in these tests")
    add_snapshot(cache, "org/smol-GGUF", {"smollm2-135m-instruct-Q4_1.gguf": gguf_path,
                                          "smollm2-135m-instruct-Q8_0.gguf": other}, COMMIT_A)
    return cache


def greedy_ids(llm: LLM) -> list[int]:
    out = llm.generate({"prompt_token_ids": IDS}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return out[0].outputs[0].token_ids


# ---- what a hub id is --------------------------------------------------------------------

@pytest.mark.parametrize("model, repo, tag", [
    ("org/name", "org/name", None),
    ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B", None),
    ("bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M", "bartowski/SmolLM2-135M-Instruct-GGUF", "Q4_K_M"),
])
def test_hub_ids(model, repo, tag):
    hub = parse_hub_id(model)
    assert (hub.repo_id, hub.tag) == (repo, tag)


@pytest.mark.parametrize("model", ["/abs/dir", "./rel/dir", "~/x", "a/b/c", "org/name:", "gpt2", "model.gguf",
                                   "org/..", "org/name-"])
def test_not_hub_ids(model):
    assert parse_hub_id(model) is None


# ---- resolving from the cache -----------------------------------------------------------

def test_hub_id_loads_the_same_model_as_its_directory(cache, models, offline):
    llm = LLM("org/tiny", download_dir=str(cache), **TINY_ARGS)
    snapshot = cache / "models--org--tiny" / "snapshots" / COMMIT_A
    assert llm.config.model == str(snapshot)
    assert llm.config.load_format == "safetensors"
    assert greedy_ids(llm) == greedy_ids(LLM(str(models["a"]), **TINY_ARGS))


def test_revision_picks_a_commit_or_a_branch(cache, offline):
    snapshots = cache / "models--org--tiny" / "snapshots"
    for revision, commit in [(None, COMMIT_A), ("main", COMMIT_A), (COMMIT_B, COMMIT_B), ("dev", COMMIT_B)]:
        assert locate_model("org/tiny", "auto", revision, str(cache)).path == snapshots / commit


def test_pinned_revision_loads_that_commit(cache, models, offline):
    pinned = LLM("org/tiny", revision=COMMIT_B, download_dir=str(cache), **TINY_ARGS)
    assert greedy_ids(pinned) == greedy_ids(LLM(str(models["b"]), **TINY_ARGS))
    assert greedy_ids(pinned) != greedy_ids(LLM(str(models["a"]), **TINY_ARGS))


def test_gguf_tag_picks_one_file_in_any_case(cache, offline):
    snapshot = cache / "models--org--smol-GGUF" / "snapshots" / COMMIT_A
    for tag, name in [("Q4_1", "smollm2-135m-instruct-Q4_1.gguf"), ("q8_0", "smollm2-135m-instruct-Q8_0.gguf"),
                      ("smollm2-135m-instruct-Q8_0.gguf", "smollm2-135m-instruct-Q8_0.gguf")]:
        files = locate_model(f"org/smol-GGUF:{tag}", "auto", None, str(cache))
        assert (files.path, files.load_format) == (snapshot / name, "gguf")


def test_gguf_bad_tag_lists_the_files(cache, offline):
    with pytest.raises(ValueError) as info:
        locate_model("org/smol-GGUF:Q5_K_M", "auto", None, str(cache))
    assert str(info.value) == (
        "no .gguf file in org/smol-GGUF matches the tag 'Q5_K_M'; its .gguf files: smollm2-135m-instruct-Q4_1.gguf, "
        "smollm2-135m-instruct-Q8_0.gguf: pass one of their quant tags (as in org/smol-GGUF:Q4_K_M) (offline: the "
        "files listed are those in the local cache)")


def test_gguf_repo_without_a_tag_needs_one_when_it_has_several(cache, offline):
    with pytest.raises(ValueError, match=r"^org/smol-GGUF holds 2 \.gguf files \(smollm2-135m-instruct-Q4_1\.gguf, "
                                         r"smollm2-135m-instruct-Q8_0\.gguf\): pick one by its quant tag, as in "
                                         r"org/smol-GGUF:Q4_K_M$"):
        locate_model("org/smol-GGUF", "auto", None, str(cache))


def test_tokenizer_from_the_hub(cache, models, offline, tmp_path):
    smol = cache / "models--org--smol-GGUF" / "snapshots" / COMMIT_A / "smollm2-135m-instruct-Q4_1.gguf"
    assert resolve_hub_tokenizer("org/smol-GGUF:Q4_1", str(cache)) == smol
    assert resolve_hub_tokenizer("org/tiny", str(cache)) == cache / "models--org--tiny" / "snapshots" / COMMIT_A
    config = EngineConfig(model=str(models["b"]), tokenizer="org/tiny", download_dir=str(cache)).resolve()
    assert config.tokenizer == str(cache / "models--org--tiny" / "snapshots" / COMMIT_A)
    add_snapshot(tmp_path, "org/bare", {"config.json": models["b"] / "config.json"}, COMMIT_A)
    with pytest.raises(ValueError, match=r"^org/bare has no tokenizer.json or tokenizer.model \(in the local cache; "
                                         r"offline\): pass a repo, directory or .gguf file that holds the tokenizer$"):
        resolve_hub_tokenizer("org/bare", str(tmp_path))


def test_which_weight_files_are_fetched():
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    mistral = ["config.json", "consolidated.safetensors", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "model.safetensors.index.json", "original/x.safetensors"]
    assert choose_weight_files(mistral, {"model.safetensors.index.json": index}.__getitem__) == \
        ["model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert choose_weight_files(["model.safetensors", "pytorch_model.bin", "sub/y.safetensors"], None) == \
        ["model.safetensors"]
    pt_index = {"weight_map": {"a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"}}
    bins = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json",
            "training_args.bin"]
    assert choose_weight_files(bins, {"pytorch_model.bin.index.json": pt_index}.__getitem__) == \
        ["pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
    assert choose_weight_files(["pytorch_model.bin", "training_args.bin"], None) == ["pytorch_model.bin"]
    assert choose_weight_files(["config.json", "model.gguf", "README.md"], None) == []


# ---- refusals ---------------------------------------------------------------------------

def test_repo_not_in_the_cache_offline(cache, offline):
    with pytest.raises(ValueError) as info:
        locate_model("org/absent", "auto", None, str(cache))
    assert str(info.value) == (
        f"'org/absent' is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set: connect once (unset "
        "HF_HUB_OFFLINE) to download it, point HF_HUB_CACHE or download_dir at a cache that holds it, or pass a "
        "local path")


def test_revision_not_in_the_cache_offline(cache, offline):
    with pytest.raises(ValueError, match=r"^'org/tiny' at revision 'v2' is not in the Hugging Face cache "):
        locate_model("org/tiny", "auto", "v2", str(cache))


def test_index_naming_an_uncached_shard_offline(tmp_path, models, offline):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}')
    add_snapshot(tmp_path / "cache", "org/partial", {"config.json": models["a"] / "config.json",
                                                     "model.safetensors.index.json": index}, COMMIT_A)
    with pytest.raises(ValueError, match=r"^org/partial is in the local cache without "
                                         r"model-00002-of-00002.safetensors: unset HF_HUB_OFFLINE and connect"):
        locate_model("org/partial", "auto", None, str(tmp_path / "cache"))


def test_a_missing_path_that_is_no_hub_id_says_so():
    with pytest.raises(ValueError) as info:
        locate_model("./no/such/dir", "auto")
    assert str(info.value) == (
        "model './no/such/dir' not found: pass a .gguf file, an HF model directory (config.json + *.safetensors), "
        "or a Hugging Face Hub id (org/name, or org/name-GGUF:Q4_K_M for one quant of a GGUF repo)")


def test_split_gguf_is_refused():
    files = ["Q2_K/m-Q2_K-00001-of-00002.gguf", "Q2_K/m-Q2_K-00002-of-00002.gguf", "m-Q8_0.gguf"]
    with pytest.raises(ValueError) as info:
        pick_gguf(files, "Q2_K", "org/m-GGUF")
    assert str(info.value) == (
        "'Q2_K' in org/m-GGUF is a GGUF split into 2 files (Q2_K/m-Q2_K-00001-of-00002.gguf, "
        "Q2_K/m-Q2_K-00002-of-00002.gguf): ember loads one .gguf file; merge them with llama.cpp's "
        "`llama-gguf-split --merge` and pass the merged file's path, or pick another quant")


def test_a_tag_stands_alone_in_the_name():
    files = ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-IQ4_XS.gguf", "mmproj-m-F16.gguf", "m-F16.gguf"]
    assert [pick_gguf(files, t, "o/m") for t in ("q4_k_m", "Q4_K_S", "IQ4_XS", "f16")] == \
        ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-IQ4_XS.gguf", "m-F16.gguf"]
    for tag in ("Q4_K", "Q4_XS"):  # no prefix of a longer tag, no tail of another
        with pytest.raises(ValueError, match=f"no .gguf file in o/m matches the tag '{tag}'"):
            pick_gguf(files, tag, "o/m")
    with pytest.raises(ValueError, match=r"^the tag 'Q4' matches 2 .gguf files in o/m: m-Q4.gguf, n-Q4.gguf: "):
        pick_gguf(["m-Q4.gguf", "n-Q4.gguf"], "Q4", "o/m")


# ---- the environment, as a user sets it -------------------------------------------------

def _ember(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember.server.cli", *args], capture_output=True, text=True,
                          timeout=300, env=os.environ | {"HF_HUB_OFFLINE": "1"} | env)


def test_cli_generate_with_a_hub_id_from_hf_hub_cache(cache, models):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = LLM(str(models["a"]), **TINY_ARGS).generate("w5 w17 w99", params)[0].outputs[0].text
    done = _ember({"HF_HUB_CACHE": str(cache)}, "generate", "w5 w17 w99", "org/tiny", "--max-tokens", "5",
                  "--num-kv-blocks", "8", "--block-size", "16")
    assert done.returncode == 0, done.stderr
    assert want and done.stdout == want + "\n"


def test_hf_home_places_the_cache(models, tmp_path):
    add_snapshot(tmp_path / "home" / "hub", "org/tiny", hf_files(models["a"]), COMMIT_A)
    code = "from ember.loader.model_files import locate_model; print(locate_model('org/tiny', 'auto').path)"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{tmp_path / 'home' / 'hub' / 'models--org--tiny' / 'snapshots' / COMMIT_A}\n"



# ---- online, against a stand-in for the hub's HTTP API ------------------------------------

ONLINE = """
import json, os, sys
from ember import LLM, SamplingParams
from ember.loader.model_files import locate_model

cache, out = sys.argv[1], {}
def listing(path):
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else [path.name]
def resolve(model, revision=None):
    try:
        path = locate_model(model, "auto", revision, cache).path
        return {"path": str(path), "files": listing(path)}
    except ValueError as e:
        return {"error": str(e)}
for model in ("org/tiny", "org/bin", "org/quant-GGUF:Q4_1"):
    out[model] = resolve(model)
out["nope"], out["v9"] = resolve("org/nope"), resolve("org/tiny", "v9")
llm = LLM("org/tiny", download_dir=cache, num_kv_blocks=8, block_size=16)
out["ids"] = llm.generate({"prompt_token_ids": [5, 17, 99]}, SamplingParams(temperature=0, max_tokens=4))[0] \
    .outputs[0].token_ids
print("ONLINE-DONE", flush=True)
sys.stdin.readline()
os.environ["HF_HUB_OFFLINE"] = "1"  # set after import: ember reads it when it resolves a model
for model in ("org/tiny", "org/quant-GGUF:Q4_1", "org/quant-GGUF:Q8_0", "org/quant-GGUF"):
    out["offline " + model] = resolve(model)
print(json.dumps(out))
"""


def test_online_fetches_only_what_ember_reads_then_works_offline(tmp_path, models):
    repos = tmp_path / "repos"
    (repos / "org").mkdir(parents=True)
    tiny = sharded_dir(repos / "org" / "tiny")  # + a decoy consolidated.safetensors
    (tiny / "generation_config.json").write_text('{"temperature": 0.5}')
    (tiny / "README.md").write_text("a model card")
    (tiny / "original").mkdir()
    (tiny / "original" / "consolidated.00.pth").write_bytes(b"not fetched")
    (repos / "org" / "bin").mkdir()
    shutil.copyfile(models["a"] / "config.json", repos / "org" / "bin" / "config.json")
    torch.save(dict(iter_dummy_weights(tiny_cfg(), seed=0)), repos / "org" / "bin" / "pytorch_model.bin")
    (repos / "org" / "bin" / "training_args.bin").write_bytes(b"not fetched")
    (repos / "org" / "quant-GGUF").mkdir()
    for name in ("m-Q4_1.gguf", "m-Q8_0.gguf", "README.md"):
        (repos / "org" / "quant-GGUF" / name).write_bytes(b"GGUF " + name.encode())

    cache = tmp_path / "cache"
    snapshot = lambda repo: cache / f"models--{repo.replace('/', '--')}" / "snapshots" / COMMIT  # noqa: E731
    with HubStandIn(repos) as hub:
        proc = subprocess.Popen([sys.executable, "-c", ONLINE, str(cache)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
                                | {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1"})
        first = proc.stdout.readline()
        assert first == "ONLINE-DONE\n", proc.stderr.read()
        online_requests = len(hub.requests)
        stdout, stderr = proc.communicate("go\n", timeout=120)
        assert proc.returncode == 0, stderr
        assert len(hub.requests) == online_requests  # HF_HUB_OFFLINE=1: the hub, still up, is not asked
    out = json.loads(stdout)

    assert out["org/tiny"] == {"path": str(snapshot("org/tiny")), "files": [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json"]}
    assert out["org/bin"] == {"path": str(snapshot("org/bin")), "files": ["config.json", "pytorch_model.bin"]}
    assert out["org/quant-GGUF:Q4_1"] == {"path": str(snapshot("org/quant-GGUF") / "m-Q4_1.gguf"),
                                          "files": ["m-Q4_1.gguf"]}
    assert out["nope"] == {"error": "'org/nope' is neither a local path nor a model repo on the Hugging Face Hub "
                                    "(or it is private: log in with `hf auth login` or set HF_TOKEN): check the name"}
    assert out["v9"] == {"error": "'org/tiny' has no revision 'v9' on the Hugging Face Hub: pass a branch, tag or "
                                  "commit hash that exists"}
    assert out["ids"] == LLM(str(tiny), **TINY_ARGS).generate(
        {"prompt_token_ids": [5, 17, 99]}, SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids

    assert out["offline org/tiny"] == out["org/tiny"]
    assert out["offline org/quant-GGUF:Q4_1"] == out["org/quant-GGUF:Q4_1"]
    # the repo's listing, cached by huggingface_hub, is what offline picks from: the same as online
    assert out["offline org/quant-GGUF:Q8_0"] == {"error": "org/quant-GGUF is in the local cache without m-Q8_0.gguf: "
                                                           "unset HF_HUB_OFFLINE and connect to the Hugging Face Hub "
                                                           "once to fetch them"}
    assert out["offline org/quant-GGUF"] == {"error": "org/quant-GGUF holds 2 .gguf files (m-Q4_1.gguf, m-Q8_0.gguf): "
                                                      "pick one by its quant tag, as in org/quant-GGUF:Q4_K_M"}
