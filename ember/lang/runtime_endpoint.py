"""RuntimeEndpoint: programs on an `ember serve` (or any server of SGLang's native API plus
vLLM's /tokenize and /detokenize) over HTTP, in token space as LocalBackend: each call sends
the state's token ids (`input_ids`), so the server tokenizes nothing twice and its prefix
cache finds every earlier call. The chat template is the server's: /tokenize renders it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ember.lang.backend import Backend, GenResult, ScoreResult

SCORE = {"max_new_tokens": 0, "temperature": 0}


class RuntimeEndpoint(Backend):
    """A program's backend at `base_url` (http://host:port): SGLang's name and arguments."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        super().__init__()
        import httpx

        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self.model_info = self._request("GET", "/get_model_info")

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self.client.request(method, path, json=body)
        _check(response)
        return response.json()

    # -- the tokenizer and the chat template ------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._request("POST", "/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})["tokens"]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        body = {"tokens": ids} | ({"skip_special_tokens": True} if skip_special_tokens else {})
        return self._request("POST", "/detokenize", body)["prompt"]

    def render(self, messages: list[dict[str, str]]) -> str:
        ids = self._request("POST", "/tokenize", {"messages": messages, "add_generation_prompt": False})["tokens"]
        return self.decode(ids)

    # -- the model -------------------------------------------------------------------------

    def generate(self, input_ids: list[int], sampling: dict[str, Any], logprobs: dict[str, Any],
                 on_text: Callable[[str], None] | None = None) -> GenResult:
        body = {"input_ids": input_ids, "sampling_params": _plain(sampling), **logprobs}
        self.count_call()
        if on_text is None:
            return _result(self._request("POST", "/generate", body))
        last = None
        with self.client.stream("POST", "/generate", json={**body, "stream": True}) as response:
            _check(response)
            for line in response.iter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                last = json.loads(line[5:])
                if "error" in last:
                    raise RuntimeError(f"the server's stream failed: {last['error'].get('message')}")
                on_text(last["text"])
        if last is None:
            raise RuntimeError("the server's stream ended without an answer")
        return _result(last)

    def score(self, prefix: list[int], choices: list[list[int]], unconditional: bool) -> ScoreResult:
        prompts = [prefix + c for c in choices] + (list(choices) if unconditional else [])
        starts = [len(prefix)] * len(choices) + ([0] * len(choices) if unconditional else [])
        self.count_call(len(prompts))
        answers = self._request("POST", "/generate", {
            "input_ids": prompts, "sampling_params": [SCORE] * len(prompts), "return_logprob": [True] * len(prompts),
            "logprob_start_len": starts})
        own = [[e[0] for e in a["meta_info"]["input_token_logprobs"]] for a in answers]
        n = len(choices)
        return ScoreResult(own[:n], own[n:] if unconditional else None,
                           [a["meta_info"]["prompt_tokens"] for a in answers[:n]],
                           [a["meta_info"]["cached_tokens"] for a in answers[:n]])

    def flush_cache(self) -> bool:
        return self.client.post("/flush_cache").status_code == 200

    def get_server_info(self) -> dict[str, Any]:
        return self._request("GET", "/get_server_info")

    def shutdown(self) -> None:
        self.client.close()


def _plain(sampling: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in sampling.items()}


def _check(response: Any) -> None:
    """The server's refusal as the error LocalBackend raises for the same input: ValueError
    for a 400, RuntimeError otherwise."""
    if response.status_code == 200:
        return
    response.read()
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    raise (ValueError if response.status_code == 400 else RuntimeError)(
        f"{response.request.method} {response.request.url.path}: {response.status_code}: {message}")


def _result(answer: dict[str, Any]) -> GenResult:
    meta = answer["meta_info"]
    as_tuples = (lambda rows: None if rows is None else [tuple(r) for r in rows])
    return GenResult(answer["text"], answer["output_ids"], meta["finish_reason"], meta["prompt_tokens"],
                     meta["cached_tokens"], as_tuples(meta.get("output_token_logprobs")),
                     None if meta.get("output_top_logprobs") is None else
                     [as_tuples(r) for r in meta["output_top_logprobs"]])
