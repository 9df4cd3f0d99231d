"""Shared fixtures: the default model, ember on it, and HF transformers on the same GGUF;
llama.cpp's own converter and tokenizer, and tokenizer files for tiny models to convert."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

# OpenMP's threads wait for each other at the end of every parallel region by spinning: where
# another busy process (a server the test started, a tensor-parallel rank, a replica, a second
# test run) shares the CPUs, the spinning thread keeps the one it waits for off them (measured
# on 2 CPUs beside one other busy process: 30 decode steps of the default model in 32 s, 1.3 s
# passive). Passive waiters sleep; the threads and the arithmetic are the same. It must be set
# before torch is imported, and the processes the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # the Triton kernel tests run on the CPU through the interpreter; it must be chosen
    # before triton is first imported (tests/kernels)
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    from ember.loader.default_model import fetch_default_model

    return fetch_default_model()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def two_nodes(monkeypatch_module):
    """A simulated two-node Ray cluster on this machine (two raylets: 2 CPUs and 1), joined by
    this process and, through RAY_ADDRESS, by the processes it starts. It gets a temp dir of its
    own and is stopped by its handle (never `ray stop`: that ends every Ray process here)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    monkeypatch_module.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch_module.setenv("RAY_TMPDIR", tempfile.mkdtemp(prefix="r", dir="/tmp"))  # short: socket paths
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=1)
    monkeypatch_module.setenv("RAY_ADDRESS", cluster.address)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


# the default model dequantized, in float32: HF transformers' numbers on any CPU (the
# default, GGUF blocks with int8 activations, follows llama.cpp instead: tests/models/test_quantized_vs_llama_cpp.py)
EXACT = {"quantization": "none", "dtype": "float32"}


@pytest.fixture(scope="session")
def llm(gguf_path):
    from ember import LLM

    return LLM(str(gguf_path), **EXACT)


def _kept(name: str, gguf_path: Path, packages: tuple[str, ...]) -> Path:
    """Where files built from the GGUF are kept under ember's cache dir: by a hash of its bytes
    and of the versions of the packages that build and read them."""
    import hashlib
    from importlib.metadata import version

    from ember.paths import cache_dir

    h = hashlib.sha256(repr([version(p) for p in packages]).encode())
    with open(gguf_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return cache_dir() / name / h.hexdigest()


def _keep(kept: Path, save) -> None:
    """save(directory) once: written to a temp dir, renamed whole (another worker's, if it got
    there first)."""
    import shutil

    if kept.is_dir():
        return
    kept.parent.mkdir(parents=True, exist_ok=True)
    made = Path(tempfile.mkdtemp(dir=kept.parent, prefix=".part-"))
    save(made)
    try:
        made.rename(kept)
    except OSError:
        shutil.rmtree(made, ignore_errors=True)


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    """HF transformers' own GGUF loading (dequantized to float32): the reference.

    transformers reads and dequantizes the GGUF in ~24 CPU-s; the float32 model it made is kept
    under ember's cache dir (save_pretrained, by a hash of the GGUF and the versions of what
    reads and writes it) and loaded from there in a fraction of a second: the same weights'
    bits, the same config, the same logits' bits (checked when it was written)."""
    transformers = pytest.importorskip("transformers")
    kept = _kept("hf-gguf-model", gguf_path, ("transformers", "torch", "gguf", "safetensors"))

    def save(made: Path) -> None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        ).eval()
        # dequantized already: what makes save_pretrained refuse a GGUF-loaded model is its marker
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(made))
        again = transformers.AutoModelForCausalLM.from_pretrained(str(made), dtype=torch.float32).eval()
        ours, theirs = again.state_dict(), model.state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k].view(torch.int32), theirs[k].view(torch.int32))
                                                    for k in ours)
        config = [{k: v for k, v in m.config.to_dict().items() if k != "_name_or_path"} for m in (again, model)]
        assert config[0] == config[1]
        ids = torch.tensor([list(range(1, 200, 7))])
        with torch.no_grad():
            assert torch.equal(again(ids).logits, model(ids).logits)

    _keep(kept, save)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_pretrained(str(kept), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _forward_logits(llm, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits at every position of each prompt, all prompts in one ember forward."""
    from ember.request import Request
    from ember.sampling_params import SamplingParams
    from ember.scheduler.scheduler import ScheduledChunk, SchedulerOutput

    core = llm.engine
    reqs = [Request(f"logits-{i}", ids, SamplingParams(max_tokens=1)) for i, ids in enumerate(prompts)]
    for r in reqs:
        r.block_ids = core.block_pool.allocate(core.scheduler.blocks_for(r.num_tokens))
    try:
        plan = SchedulerOutput([ScheduledChunk(r, r.num_tokens) for r in reqs])
        input_ids, positions, meta, _, _ = core.runner._prepare(plan)
        meta.eager = True  # as the runner's eager forwards
        with torch.inference_mode():
            logits = core.runner.model.compute_logits(core.runner.model(input_ids, positions, meta)).float()
    finally:
        for r in reqs:
            core.block_pool.free(r.block_ids)
            core.runner.release(r.request_id)  # what the runner keeps for a request (a recurrent state's slot)
    return list(logits.split([len(p) for p in prompts]))


@pytest.fixture(scope="session")
def forward_logits():
    return _forward_logits


@pytest.fixture(scope="session")
def gguf_convert(tmp_path_factory):
    """convert(hf_dir, outtype="f32", vocab_only=False, mmproj=False) -> Path of the GGUF file
    that llama.cpp's convert_hf_to_gguf.py writes for the HF directory (mmproj: its vision
    tower's mmproj file), made once a session for each (directory, outtype, vocab_only,
    mmproj). Skips the test where the converter cannot be fetched (tests/gguf_convert.py)."""
    from gguf_convert import ConverterUnavailable, convert, converter_dir

    try:
        converter_dir()
    except ConverterUnavailable as e:
        pytest.skip(f"llama.cpp's converter is not available: {e}")
    out = tmp_path_factory.mktemp("gguf-converted")
    made: dict[tuple[Path, str, bool, bool], Path] = {}

    def convert_cached(hf_dir: Path, outtype: str = "f32", vocab_only: bool = False, mmproj: bool = False) -> Path:
        key = (Path(hf_dir).resolve(), outtype, vocab_only, mmproj)
        if key not in made:
            name = (f"{len(made)}-{'mmproj-' if mmproj else ''}{Path(hf_dir).name}-{outtype}"
                    f"{'-vocab' if vocab_only else ''}.gguf")
            made[key] = convert(key[0], out / name, outtype, vocab_only, mmproj)
        return made[key]

    return convert_cached


def _llama_cpp_tool(name: str, env: str) -> Path:
    """A tool of llama.cpp (tests/llama_cpp_tools.py); skips the test where it is not built."""
    from llama_cpp_tools import tool

    path = tool(name, env)
    if not path.is_file():
        pytest.skip(f"llama.cpp's {name} is not built ({path})")
    return path


@pytest.fixture(scope="session")
def llama_tokenize(tmp_path_factory):
    """tokenize(gguf_path, text, add_special=True) -> token ids from llama.cpp's own tokenizer
    (its llama-tokenize tool; EMBER_LLAMA_TOKENIZE names it, else the peers' build)."""
    tool = _llama_cpp_tool("llama-tokenize", "EMBER_LLAMA_TOKENIZE")
    prompt = tmp_path_factory.mktemp("llama-tokenize") / "prompt.txt"

    def tokenize(gguf_path: Path, text: str, add_special: bool = True) -> list[int]:
        prompt.write_text(text, encoding="utf-8")  # -f reads the bytes as they are
        cmd = [str(tool), "-m", str(gguf_path), "-f", str(prompt), "--ids", "--log-disable", "--no-escape"]
        done = subprocess.run(cmd + ([] if add_special else ["--no-bos"]), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"llama-tokenize failed on {gguf_path}: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    return tokenize


@pytest.fixture(scope="session")
def llama_greedy(tmp_path_factory):
    """greedy(gguf_path, prompts, max_tokens, ctx, ignore_eos=False) -> LlamaCppGreedy: llama.cpp's
    own greedy tokens and end-of-generation ids (tests/llama_cpp_tools.py `greedy`), from its
    llama-server (EMBER_LLAMA_SERVER names it, else the peers' build)."""
    from llama_cpp_tools import greedy as llama_cpp_greedy

    server = _llama_cpp_tool("llama-server", "EMBER_LLAMA_SERVER")
    logs = tmp_path_factory.mktemp("llama-server")

    def greedy(gguf_path: Path, prompts: list[list[int]], max_tokens: int, ctx: int, ignore_eos: bool = False):
        return llama_cpp_greedy(server, gguf_path, prompts, max_tokens, ctx, logs, ignore_eos)

    return greedy


# Text the SentencePiece model is trained on: English prose and code, a few accents. Other
# scripts, emoji and most symbols are not in it, so they come out as <0xNN> byte tokens.
_SPM_CORPUS = """\
The quick brown fox jumps over the lazy dog. A tiny model reads its weights from a file,
then answers one token at a time. Every request has a prompt and a budget of new tokens;
the scheduler gives each request a share of the step, and the cache keeps what was computed.
def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
Numbers like 12, 345 and 6789 appear in text; so do dates (2026-12-01) and prices ($9.99).
Café, naïve, résumé: accents are letters too. Spaces   and tabs\tmatter in code.
"""


@pytest.fixture(scope="session")
def spm_tokenizer_dir(tmp_path_factory) -> Path:
    """tokenizer.model: a SentencePiece BPE model of 512 pieces trained on _SPM_CORPUS (byte
    fallback, no normalization, split digits: Llama 2's settings), with tokenizer.json and
    tokenizer_config.json of a legacy HF LlamaTokenizer next to it. Copy the files into a
    tiny HF model's directory for llama.cpp's converter (gguf_convert)."""
    spm = pytest.importorskip("sentencepiece")
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("spm")
    # written by the trainer to memory, not to a model_prefix: the model then holds no path of
    # this run's temp dir, so its bytes (and the GGUF files converted with it, which
    # tests/gguf_convert.py keeps by their inputs' hash) are the same on every run
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_SPM_CORPUS.splitlines()), model_writer=model, vocab_size=512,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2,
    )
    (root / "tokenizer.model").write_bytes(model.getvalue())
    # legacy=True: a "▁" in front of the text after each special token, as llama.cpp and
    # SentencePiece do (transformers' default, False, puts none there)
    config = json.dumps({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                         "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "legacy": True})
    (root / "tokenizer_config.json").write_text(config)
    transformers.AutoTokenizer.from_pretrained(str(root)).save_pretrained(str(root))  # tokenizer.json
    (root / "tokenizer_config.json").write_text(config)  # saving drops legacy and add_bos_token
    return root


@pytest.fixture(scope="session")
def bpe_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer as HF files, built by transformers from the default GGUF (one
    llama.cpp's converter recognises: its pre-tokenizer comes out as "smollm")."""
    import shutil

    from ember.loader.default_model import fetch_default_model

    transformers = pytest.importorskip("transformers")
    gguf_path = fetch_default_model()
    root = tmp_path_factory.mktemp("bpe")
    # transformers builds it from the GGUF's vocabulary in 10-15 s: the files it saves are kept
    # under ember's cache dir, by a hash of the GGUF and the versions of what builds and saves them
    kept = _kept("bpe-tokenizer", gguf_path, ("transformers", "tokenizers"))
    _keep(kept, lambda made: transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(made)))
    shutil.copytree(kept, root, dirs_exist_ok=True)
    return root


@pytest.fixture
def mla_expanded_plans(monkeypatch) -> list:
    """Each forward's split for MLA's non-absorbed prefill (models/mla.py expanded_plan, called
    through), so a test knows the path ran: None where a step stayed absorbed."""
    from ember.models import mla

    plans: list = []
    real = mla.expanded_plan

    def recorded(*args):
        plans.append(real(*args))
        return plans[-1]

    monkeypatch.setattr(mla, "expanded_plan", recorded)
    return plans
