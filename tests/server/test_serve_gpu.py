"""`ember serve` on CUDA (`-m gpu`; `h200.sh serve`, on one GPU or two): a real server at
the Llama-3.1-8B shape in bfloat16 (dummy weights drawn from seed 0) with SmolLM2's
tokenizer and chat template (benchmarks/scripts/served_model.py writes the directory; the
device gets it carried as .serve-model, or from EMBER_SERVED_MODEL), driven by the `openai`
client:

- one request at a time, its greedy text streamed or not, chat or text, equals the offline
  engine's on the same weights (batches of one: no batch-shape rounding to differ);
- 48 streams at once each get all their tokens, a client that leaves mid-stream is dropped,
  and the KV pool is empty after both;
- with two GPUs, `--data-parallel-size 2` puts one replica on each (both GPUs fill) and answers
  what one GPU answered, from both replicas;
- `--api-server-count 4` (four API processes, one core) answers what one process answered and
  spreads 48 streams over its processes.

The offline engine runs last, after the servers have exited, so each holds the GPU alone."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from processes import children  # noqa: E402
from servers import KEY, MODEL, Server  # noqa: E402

from ember import LLM, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

ARGS = ("--dtype", "bfloat16", "--load-format", "dummy", "--seed", "0", "--max-model-len", "4096",
        "--api-key", KEY)
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?"]
TEXTS = ["The capital of France is", "Once upon a time"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def served_model() -> Path:
    path = Path(os.environ.get("EMBER_SERVED_MODEL", ".serve-model"))
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"no served model at {path}: make it with benchmarks/scripts/served_model.py and carry it")
    return path


def _chat(client: openai.OpenAI, question: str, stream: bool = False) -> str:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                   if c.choices)


def _text(client: openai.OpenAI, prompt: str, stream: bool = False) -> str:
    kw = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)


def _answers(client: openai.OpenAI) -> dict[str, list[str]]:
    return {"chat": [_chat(client, q) for q in QUESTIONS], "text": [_text(client, p) for p in TEXTS]}


@pytest.fixture(scope="module")
def one_gpu(served_model, tmp_path_factory) -> dict:
    """What a one-GPU server answered, and what it did under load; the server has exited."""
    s = Server(served_model, tmp_path_factory.mktemp("serve") / "serve.log", *ARGS)
    seen: dict = {}
    try:
        s.wait_ready(timeout=600)
        client = s.client()
        seen["answers"] = _answers(client)
        seen["streamed"] = {"chat": [_chat(client, q, stream=True) for q in QUESTIONS],
                            "text": [_text(client, p, stream=True) for p in TEXTS]}
        seen["idle_after_answers"] = s.wait_idle()

        def stream(i: int) -> int:
            chunks = client.completions.create(model=MODEL, prompt=f"Story number {i}:", max_tokens=64,
                                               temperature=0.8, seed=i, stream=True,
                                               stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            return [c.usage.completion_tokens for c in chunks if c.usage][0]

        with ThreadPoolExecutor(48) as pool:
            seen["concurrent_tokens"] = list(pool.map(stream, range(48)))
        left = client.completions.create(model=MODEL, prompt="A long story:", max_tokens=3000, stream=True,
                                         extra_body={"ignore_eos": True})
        seen["read_before_leaving"] = sum(1 for _, _ in zip(range(5), left))
        left.close()
        seen["idle_after_load"] = s.wait_idle(timeout=60)
        seen["log"] = s.log.read_text(errors="replace")
    finally:
        seen["exit_code"] = s.stop()
    return seen


def test_the_server_sizes_its_pool_on_the_gpu_captures_graphs_and_exits_cleanly(one_gpu):
    assert one_gpu["exit_code"] == 0, one_gpu.get("log")
    memory = [line for line in one_gpu["log"].splitlines() if "memory (GiB): total" in line]
    assert len(memory) == 1 and "CUDA graphs" in memory[0] and "(bfloat16)" in memory[0], one_gpu["log"][-3000:]


def test_streamed_answers_equal_the_whole_ones(one_gpu):
    assert one_gpu["streamed"] == one_gpu["answers"]
    assert all(one_gpu["answers"]["chat"]) and all(one_gpu["answers"]["text"])


def test_48_streams_get_all_their_tokens_and_a_client_that_leaves_frees_its_blocks(one_gpu):
    assert one_gpu["concurrent_tokens"] == [64] * 48
    assert one_gpu["read_before_leaving"] == 5
    for key in ("idle_after_answers", "idle_after_load"):
        m = one_gpu[key]
        assert m["num_requests_running"] == m["num_requests_waiting"] == m["kv_cache_usage_perc"] == 0


def test_two_replicas_take_a_gpu_each_and_answer_as_one_gpu(one_gpu, served_model, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA GPUs (nvidia-h200-x2); {torch.cuda.device_count()} visible")
    s = Server(served_model, tmp_path / "dp.log", *ARGS, "--data-parallel-size", "2")
    try:
        s.wait_ready(timeout=600)
        assert len(children(s.proc.pid)) == 2, s.log_tail()
        free = [torch.cuda.mem_get_info(i) for i in range(2)]
        assert all(f < 0.3 * total for f, total in free), f"each replica fills its own GPU: {free}"
        assert _answers(s.client()) == one_gpu["answers"]
        stats = httpx.get(f"{s.url}/router/stats", timeout=10).json()["workers"]
        assert sum(w["routed"] for w in stats) == len(QUESTIONS) + len(TEXTS)
        assert min(w["routed"] for w in stats) >= 1, stats  # new text spreads over both replicas
    finally:
        code = s.stop()
    assert code == 0, s.log_tail()


def test_four_api_processes_answer_as_one_and_share_48_streams(one_gpu, served_model, tmp_path):
    """`--api-server-count 4` in front of the one core on the GPU: the one-process answers, every
    stream's tokens, streams spread over the processes, an empty KV pool after, a clean exit."""
    s = Server(served_model, tmp_path / "asc.log", *ARGS, "--api-server-count", "4")
    try:
        s.wait_ready(timeout=600)
        s.wait_api_servers(4)
        assert _answers(s.client()) == one_gpu["answers"]

        def stream(i: int) -> tuple[int, int]:
            raw = s.client().completions.with_raw_response.create(
                model=MODEL, prompt=f"Story number {i}:", max_tokens=64, temperature=0.8, seed=i, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            index = int(raw.headers["x-ember-api-server"].split()[0])
            return index, [c.usage.completion_tokens for c in raw.parse() if c.usage][0]

        with ThreadPoolExecutor(48) as pool:
            got = list(pool.map(stream, range(48)))
        assert [n for _, n in got] == [64] * 48
        assert len({i for i, _ in got}) > 1, got
        m = s.wait_idle(timeout=60)
        assert m["num_requests_running"] == m["num_requests_waiting"] == m["kv_cache_usage_perc"] == 0
        assert m['request_success_total{finished_reason="length"}'] >= 48
    finally:
        code = s.stop()
    assert code == 0, s.log_tail()


def test_served_answers_equal_the_offline_engines(one_gpu, served_model):
    llm = LLM(str(served_model), dtype="bfloat16", load_format="dummy", seed=0, max_model_len=4096)  # the GPU's last user
    try:
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        chat = [llm.chat([{"role": "user", "content": q}], greedy)[0].outputs[0].text for q in QUESTIONS]
        text = [llm.generate([p], greedy)[0].outputs[0].text for p in TEXTS]
    finally:
        llm.shutdown()
    assert one_gpu["answers"] == {"chat": chat, "text": text}
