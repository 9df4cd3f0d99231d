"""Images over HTTP: the official `openai` client sends a base64 image to a real `ember serve`
of a tiny LLaVA-1.5 and gets what LLM.chat answers offline; a file:// image under
--allowed-local-media-path is the same image; and every bad image gets its own 400 in
OpenAI's shape while the server keeps answering. A tiny Qwen2.5-VL server answers images of
two sizes (M-RoPE, dynamic resolution) as LLM.chat does. vLLM's mm_processor_kwargs
{"do_pan_and_scan": true}: a tiny Gemma 3's app takes it, a LLaVA's refuses it, both refuse
every other key (in this process: FastAPI's TestClient over an AsyncEngine)."""

from __future__ import annotations

import json

import pytest
from gemma3_vision_model import save_tiny_gemma3
from llava_model import data_url, image, save_tiny_llava
from qwen_vl_model import save_tiny_qwen_vl
from servers import MODEL, Server, assert_openai_error, post, running

from ember import LLM, EngineConfig, SamplingParams
from ember.engine.async_engine import AsyncEngine
from ember.server.openai_api import ServerConfig, build_app

RED, BLUE = image((200, 30, 30)), image((20, 40, 220), (24, 36))
MAX_PIXELS = 4000  # a 40 x 30 image passes, 100 x 100 does not


def content(*parts: dict | str) -> list[dict]:
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]


def image_part(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


@pytest.fixture(scope="module")
def model_dir(bpe_tokenizer_dir, tmp_path_factory):
    return save_tiny_llava(bpe_tokenizer_dir, tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    RED.save(folder / "red.png")
    return folder


@pytest.fixture(scope="module")
def vision_server(model_dir, media, tmp_path_factory):
    log = tmp_path_factory.mktemp("vision-server") / "server.log"
    yield from running(Server(model_dir, log, "--limit-mm-per-prompt", '{"image": 2}', "--max-image-pixels",
                              str(MAX_PIXELS), "--allowed-local-media-path", str(media), "--max-model-len", "256"))


def chat_answer(model_dir, *parts) -> str:
    """LLM.chat's greedy answer offline to one user message of these parts (PIL images, text)."""
    llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=256)
    parts = [p if isinstance(p, str) else {"type": "image_pil", "image_pil": p} for p in parts]
    messages = [{"role": "user", "content": content(*parts)}]
    return llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text


@pytest.fixture(scope="module")
def expected(model_dir) -> str:
    """LLM.chat's greedy answer offline, on the same model."""
    return chat_answer(model_dir, RED, "What is this?")


def ask(server: Server, *parts) -> str:
    out = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content(*parts)}], temperature=0, max_tokens=8,
        extra_body={"ignore_eos": True})
    return out.choices[0].message.content


def test_the_openai_client_sends_an_image_and_gets_llm_chats_answer(vision_server, media, expected):
    assert ask(vision_server, image_part(data_url(RED)), "What is this?") == expected
    assert ask(vision_server, image_part(data_url(RED, "WEBP")), "What is this?") != ask(
        vision_server, image_part(data_url(BLUE)), "What is this?")
    assert ask(vision_server, image_part((media / "red.png").as_uri()), "What is this?") == expected
    assert ask(vision_server, image_part(data_url(RED)), image_part(data_url(BLUE)), "Which is red?")


def _png_bytes_url(cut: int) -> str:
    url = data_url(RED)
    head, payload = url.split(",")
    import base64

    return f"{head},{base64.b64encode(base64.b64decode(payload)[:cut]).decode()}"


# (name, the user message's content, words in the 400's message)
BAD_IMAGES = [
    ("not-an-image", content(image_part("data:image/png;base64,aGVsbG8gd29ybGQ="), "hi"), ["cannot be decoded"]),
    ("not-base64", content(image_part("data:image/png;base64,@@@"), "hi"), ["base64"]),
    ("truncated-png", content(image_part(_png_bytes_url(60)), "hi"), ["truncated or corrupt"]),
    ("three-images", content(*[image_part(data_url(RED))] * 3, "hi"), ["3 images", "limit of 2"]),
    ("too-many-pixels", content(image_part(data_url(image((1, 2, 3), (100, 100)))), "hi"),
     ["100x100", "--max-image-pixels"]),
    ("http-url", content(image_part("https://example.com/cat.png"), "hi"), ["--allowed-media-domains"]),
    ("file-outside", content(image_part("file:///etc/hostname"), "hi"), ["outside --allowed-local-media-path"]),
    ("detail-high", content(image_part(data_url(RED), detail="high"), "hi"), ["detail"]),
    ("bad-part-shape", content({"type": "image_url", "image_url": {"link": "x"}}), ["image_url"]),
    ("audio-part", content({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}), ["input_audio"]),
    ("placeholder-in-text", content(image_part(data_url(RED)), "look: <image>"), ["2 image placeholders", "1 images"]),
]


@pytest.mark.parametrize("name,parts,words", BAD_IMAGES, ids=[c[0] for c in BAD_IMAGES])
def test_bad_images_get_their_own_400(vision_server, name, parts, words):
    r = post(vision_server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": parts}]})
    assert_openai_error(r, 400, *words)


def test_a_completion_prompt_cannot_bring_the_image_token_alone(vision_server, expected):
    r = post(vision_server, "/v1/completions", {"model": MODEL, "max_tokens": 2, "prompt": "USER: <image>\nhi"})
    assert_openai_error(r, 400, "image token")
    assert ask(vision_server, image_part(data_url(RED)), "What is this?") == expected  # still serving, the same
    vision_server.wait_idle()
    assert json.loads(post(vision_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}).text)


def test_the_responses_api_takes_input_image_parts(vision_server, expected):
    out = vision_server.client().responses.create(
        model=MODEL, temperature=0, max_output_tokens=8,
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url(RED)},
                                            {"type": "input_text", "text": "What is this?"}]}])
    assert out.output_text == expected


@pytest.fixture(scope="module")
def qwen_dir(bpe_tokenizer_dir, tmp_path_factory):
    return save_tiny_qwen_vl(bpe_tokenizer_dir, tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl")


@pytest.fixture(scope="module")
def qwen_server(qwen_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("qwen-server") / "server.log"
    yield from running(Server(qwen_dir, log, "--max-model-len", "256"))


def test_the_openai_client_sends_images_of_two_sizes_to_qwen2_5_vl(qwen_server, qwen_dir):
    wide, tall = image((200, 30, 30), (84, 56)), image((20, 40, 220), (60, 100))  # 6 and 8 image tokens
    want = chat_answer(qwen_dir, wide, tall, "Which is red?")
    assert ask(qwen_server, image_part(data_url(wide)), image_part(data_url(tall)), "Which is red?") == want
    assert ask(qwen_server, image_part(data_url(tall)), image_part(data_url(wide)), "Which is red?") != want
    # the same images again: their pixels went to the engine core once (engine/pixel_link.py), now
    # they come without them and the core puts them back
    assert ask(qwen_server, image_part(data_url(wide)), image_part(data_url(tall)), "Which is red?") == want


@pytest.fixture(scope="module")
def gemma3_dir(bpe_tokenizer_dir, tmp_path_factory):
    return save_tiny_gemma3(bpe_tokenizer_dir, tmp_path_factory.mktemp("gemma3"))


def app_client(model_dir):
    """The server's app over an AsyncEngine of the model, in this process."""
    from fastapi.testclient import TestClient

    engine = AsyncEngine(EngineConfig(model=str(model_dir), dtype="float32", quantization="none", max_model_len=256))
    return TestClient(build_app(ServerConfig(engine.config, (MODEL,)), engine)), engine


def test_mm_processor_kwargs_do_pan_and_scan_for_gemma3_alone(gemma3_dir, model_dir):
    """A 768 x 256 image is 4 views with pan-and-scan (the image, 3 crops): the prompt the chat
    route runs (and /tokenize counts) is the offline chat prompt's with the same
    mm_processor_kwargs, not the one without."""
    wide = image((200, 30, 30), (768, 256))
    messages = [{"role": "user", "content": content(image_part(data_url(wide)), "What is this?")}]
    offline = [{"role": "user", "content": content({"type": "image_pil", "image_pil": wide}, "What is this?")}]
    body = {"messages": messages, "max_tokens": 2, "temperature": 0, "return_token_ids": True}
    client, engine = app_client(gemma3_dir)
    with client:
        want = {on: engine.inputs.chat_prompt(offline, mm_processor_kwargs={"do_pan_and_scan": on})["prompt_token_ids"]
                for on in (True, False)}
        assert want[True].count(engine.tokenizer.backend.token_to_id("<start_of_image>")) == 4
        r = client.post("/v1/chat/completions", json=body | {"mm_processor_kwargs": {"do_pan_and_scan": True}})
        assert r.status_code == 200, r.text
        assert r.json()["prompt_token_ids"] == want[True] != want[False]
        r = client.post("/tokenize", json={"messages": messages, "mm_processor_kwargs": {"do_pan_and_scan": True}})
        assert r.status_code == 200 and r.json()["tokens"] == want[True]
        r = client.post("/v1/chat/completions", json=body | {"mm_processor_kwargs": {"do_pan_and_scan": True,
                                                                                    "num_crops": 2}})
        assert_openai_error(r, 400, "mm_processor_kwargs 'num_crops' is not supported")
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                 "mm_processor_kwargs": {"do_pan_and_scan": True}})
        assert_openai_error(r, 400, "mm_processor_kwargs is not supported", "chat request")
    client, _ = app_client(model_dir)
    with client:
        r = client.post("/v1/chat/completions", json=body | {"mm_processor_kwargs": {"do_pan_and_scan": True}})
        assert_openai_error(r, 400, "do_pan_and_scan is not supported by this model (llava)")
