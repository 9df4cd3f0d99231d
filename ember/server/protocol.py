"""The OpenAI API's request and response shapes (pydantic), and how a request becomes
SamplingParams. Field names and defaults are OpenAI's; ember's extras (top_k, min_p,
repetition_penalty, ignore_eos, ...) are vLLM's. Unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ember.sampling_params import SamplingParams, StructuredOutputsParams

MAX_LOGPROBS = 20  # top alternatives one token may ask for (OpenAI's top_logprobs limit)


class InvalidRequest(ValueError):
    """A request the server refuses with 400; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# -- requests --------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(BaseModel):
    """What chat and completions requests share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None  # OpenAI's default: 1
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    user: str | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs, and the older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
        bias = None
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                try:
                    token = int(key)
                except ValueError:
                    raise InvalidRequest(f"logit_bias keys are token ids; got {key!r}", "logit_bias") from None
                if not -100 <= value <= 100:
                    raise InvalidRequest(f"logit_bias values must be in [-100, 100]; got {value}", "logit_bias")
                bias[token] = value
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}]; got {logprobs}", "logprobs")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

        def given(value, default):
            return default if value is None else value

        structured = self._structured_outputs()

        try:
            return SamplingParams(
                n=self.n,
                temperature=given(self.temperature, 1.0),
                top_p=given(self.top_p, 1.0),
                top_k=given(self.top_k, 0),
                min_p=given(self.min_p, 0.0),
                presence_penalty=given(self.presence_penalty, 0.0),
                frequency_penalty=given(self.frequency_penalty, 0.0),
                repetition_penalty=given(self.repetition_penalty, 1.0),
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                logprobs=logprobs,
                logit_bias=bias,
                structured_outputs=structured,
            )
        except ValueError as e:  # "SamplingParams.top_p must be ..." names the field
            message = str(e)
            param = message.split(" ", 1)[0].removeprefix("SamplingParams.") if message.startswith(
                "SamplingParams.") else None
            raise InvalidRequest(message, param) from None


    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one output constraint the request gives, from whichever field gives it."""
        given: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise InvalidRequest("response_format of type json_schema needs json_schema.schema",
                                     "response_format")
            given.append(("response_format", {"json": fmt.json_schema.json_schema}))
        if self.structured_outputs:
            given.append(("structured_outputs", {k: v for k, v in self.structured_outputs.items() if v is not None}))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                given.append((f"guided_{name}", {name: value}))
        if not given:
            return None
        if len(given) > 1:
            raise InvalidRequest(f"give one output constraint; got {', '.join(n for n, _ in given)}", given[1][0])
        name, fields = given[0]
        try:
            return StructuredOutputsParams(**fields)
        except (TypeError, ValueError) as e:
            raise InvalidRequest(f"{name}: {e}", name) from None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """{"role", "content"} with the content as one string (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest(f"only text content parts are supported; got type {part.get('type')!r}",
                                         "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be in [0, {MAX_LOGPROBS}]; got {self.top_logprobs}",
                                 "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def conversation(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise InvalidRequest("messages is empty: give at least one {'role', 'content'} message", "messages")
        return [m.as_template_dict() for m in self.messages]


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def to_sampling_params(self) -> SamplingParams:
        if self.echo:
            raise InvalidRequest("echo is not supported", "echo")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", "suffix")
        return self._sampling_params(self.max_tokens, self.logprobs)

    def prompts(self) -> list[str | dict[str, Any]]:
        """One engine prompt per prompt given: text, or {"prompt_token_ids": [...]}."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [{"prompt_token_ids": list(p)}]
        else:
            prompts = [x if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in p]
        if not prompts:
            raise InvalidRequest("prompt is empty: give a string, a list of strings, or token ids", "prompt")
        return prompts


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


# -- responses -------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # found in the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatCompletionTokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ember"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: Union[str, int, None] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
