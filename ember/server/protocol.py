"""The OpenAI API's request and response shapes (pydantic), and how a request becomes
SamplingParams. Field names and defaults are OpenAI's; ember's extras (top_k, min_p,
repetition_penalty, ignore_eos, ...) are vLLM's.

A sampling field the request leaves unset (temperature, top_p, top_k, min_p,
repetition_penalty) takes the model's default from its generation_config.json where it
sets one (vLLM's --generation-config auto), else OpenAI's.

Requests are strict: numbers must be numbers (no `"temperature": true` or `"1"`), every
number is range-checked here (64-bit integers, finite floats), and an unknown field is
refused with 400, never silently ignored. (Text must be valid Unicode: the server checks
the raw body, see `has_lone_surrogate`.) Caps that bound the work one request can make
(n, prompts, logit_bias entries, stop strings, choices) come from `RequestLimits`.

Fields that can hold many elements (prompts, token ids, messages, logit_bias, stop strings,
choices) are typed `Bulk`: pydantic, which runs on the event loop and holds the GIL for
the whole body, only documents them; `to_sampling_params()`, `prompts()` and
`conversation()`, which the server runs on its input pool, check them element by element,
after the caps. So a large body costs the event loop one JSON parse and no more.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, WithJsonSchema, model_serializer

from ember.sampling_params import SEED_RANGE, BeamSearchParams, SamplingParams, StructuredOutputsParams
from ember.server import field_policy
from ember.server.limits import MAX_LOGPROBS, MAX_STOP_CHARS, RequestLimits

INT64 = (-(1 << 63), (1 << 63) - 1)

NO_DEFAULTS: Mapping[str, float | int] = MappingProxyType({})

Int64 = Annotated[int, Field(ge=INT64[0], le=INT64[1])]
Count = Annotated[int, Field(ge=1, le=INT64[1])]


class InvalidRequest(ValueError):
    """A request the server refuses with 400; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# "\\ud800".."\\udfff" escapes: the only way a JSON body can carry a lone surrogate
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def has_lone_surrogate(body: bytes) -> bool:
    """Whether a JSON body holds a string that is not valid Unicode text (a lone UTF-16
    surrogate, which a "\\ud800" escape can carry): it could not be tokenized or echoed
    back. A scan of the raw bytes rules most bodies out at once; otherwise the body is
    parsed and walked, without recursion (a body that does not parse is left to the app)."""
    if not _SURROGATE_ESCAPE.search(body):
        return False
    try:
        stack = [json.loads(body)]
    except (ValueError, RecursionError):
        return False
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class _Strict(BaseModel):
    """Strict types, finite numbers, no unknown field."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


def Bulk(documented: Any) -> Any:  # noqa: N802 - a type, as used in annotations
    """A field that may hold many elements: the schema documents it as `documented`, and
    the code checks it on the input pool (see the module docstring)."""
    schema = TypeAdapter(documented).json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:  # the field's own $defs (a message's shape) written in place
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            return inline(defs[ref.rsplit("/", 1)[-1]]) if ref.startswith("#/$defs/") else \
                {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return Annotated[Any, WithJsonSchema(inline(schema))]


_SLICE = 1 << 16  # elements checked per C-level pass: each pass holds the interpreter lock ~1 ms


def token_ids(value: Any, name: str) -> list[int]:
    """A list of token ids (integers in [0, 2**63)), checked in C-speed passes over slices."""
    if not isinstance(value, list):
        raise InvalidRequest(f"{name} must be a list of token ids (integers)", name)
    for i in range(0, len(value), _SLICE):
        part = value[i:i + _SLICE]
        if not set(map(type, part)) <= {int}:
            raise InvalidRequest(f"{name} must be a list of token ids (integers)", name)
        if min(part) < 0 or max(part) > INT64[1]:
            raise InvalidRequest(f"{name} must be token ids in [0, 2**63)", name)
    return value


def strings_dicts(value: Any, name: str) -> list[dict[str, str]]:
    """A list of objects of strings (a chat template's documents)."""
    if not isinstance(value, list) or not all(isinstance(d, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in d.items()) for d in value):
        raise InvalidRequest(f"{name} must be a list of objects of strings", name)
    return value


def strings(value: Any, name: str) -> list[str]:
    if not isinstance(value, list) or not all(set(map(type, value[i:i + _SLICE])) <= {str}
                                              for i in range(0, len(value), _SLICE)):
        raise InvalidRequest(f"{name} must be a list of strings", name)
    return value


# -- requests --------------------------------------------------------------------------------


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far (with include_usage)
    include_obfuscation: bool | None = None  # OpenAI's: no effect (field_policy.py)


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # vLLM's structural_tag format, refused by name
    structures: Any = None
    triggers: Any = None
    format: Any = None


class _SamplingRequest(_Strict):
    """What chat and completions requests share."""

    honoured: ClassVar[frozenset[str]] = frozenset()  # fields of field_policy's tables this route honours

    model: str | None = None
    n: Count = 1
    temperature: float | None = Field(default=None, ge=0)  # OpenAI's default: 1
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=INT64[1])
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: Bulk(Union[str, list[str], None]) = None
    stop_token_ids: Bulk(list[Annotated[int, Field(ge=0, le=INT64[1])]] | None) = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=INT64[1])] = 0
    logit_bias: Bulk(dict[Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[float, Field(ge=-100, le=100)]]
                     | None) = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Int64 = 0
    user: str | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs, and the older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: Bulk(list[str] | None) = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's: each prompt token's logprob
    # SGLang's fields, which its router (sglang-router) writes into every request it forwards:
    # no_stop_trim is include_stop_str_in_output; return_hidden_states only at its default
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    regex: str | None = None  # SGLang's guided_regex
    ebnf: str | None = None  # SGLang's guided_grammar
    rid: str | None = None  # SGLang's request_id
    # vLLM's extras
    request_id: str | None = Field(default=None, min_length=1, max_length=256)  # the response's id carries it
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT64[1])  # keep the last k (-1: max_model_len)
    return_token_ids: bool = False  # the prompt's and each choice's token ids in the response
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:ID" (default: the server flag)
    best_of: int | None = Field(default=None, ge=1, le=INT64[1])  # only as n: ember samples n, keeps n
    allowed_token_ids: Bulk(list[Annotated[int, Field(ge=0, le=INT64[1])]] | None) = None  # only these are sampled
    bad_words: Bulk(list[str] | None) = None  # never generated
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)  # prefix cache shared within a salt
    # OpenAI's fields that change nothing here, and fields refused by name: field_policy.py
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prediction: dict[str, Any] | None = None
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    verbosity: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    logits_processors: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None
    kv_transfer_params: Any = None
    spaces_between_special_tokens: bool | None = None
    thinking_token_budget: Any = None
    lora_path: Any = None
    custom_logit_processor: Any = None
    session_params: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: the usage so far in every chunk."""
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)

    @property
    def engine_request_id(self) -> str | None:
        """The id the client gave the request (vLLM's request_id, SGLang's rid), if any."""
        return self.request_id if self.request_id is not None else self.rid

    def check_policy_fields(self) -> None:
        """The fields field_policy.py rules on (but those this route honours): refused by name,
        or logged as having no effect."""
        given = {name: getattr(self, name) for name in self.model_fields_set
                 if name in field_policy.RULED and name not in self.honoured}
        if self.stream_options is not None and "include_obfuscation" in self.stream_options.model_fields_set:
            given["include_obfuscation"] = self.stream_options.include_obfuscation
        problem = field_policy.refused(given)
        if problem is not None:
            raise InvalidRequest(problem[1], problem[0])
        if self.request_id is not None and self.rid is not None:
            raise InvalidRequest("give request_id or rid, not both", "rid")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest(f"best_of {self.best_of} is not supported: ember keeps every completion it samples; "
                                 f"ask for n={self.best_of} and choose among them", "best_of")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, limits: RequestLimits,
                         defaults: Mapping[str, float | int], prompt_logprobs: int | None = None) -> SamplingParams:
        """`prompt_logprobs`: what the engine computes for the prompt, if more than the field asks."""
        self.check_policy_fields()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
        if self.return_hidden_states:
            raise InvalidRequest("return_hidden_states is not supported", "return_hidden_states")
        if self.n > limits.max_n:
            raise InvalidRequest(f"n must be at most {limits.max_n}; got {self.n}", "n")
        bias = self._logit_bias(limits)
        if logprobs is not None and not 0 <= logprobs <= limits.max_logprobs:
            raise InvalidRequest(f"logprobs must be in [0, {limits.max_logprobs}] (--max-logprobs); got {logprobs}",
                                 "logprobs")
        stop = [self.stop] if isinstance(self.stop, str) else strings(self.stop, "stop") if self.stop is not None \
            else []
        if len(stop) > limits.max_stop:
            raise InvalidRequest(f"stop may have at most {limits.max_stop} strings; got {len(stop)}", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in stop):
            raise InvalidRequest(f"a stop string may be at most {MAX_STOP_CHARS} characters long", "stop")

        def given(name: str, default: float | int) -> float | int:
            """The request's value; where it leaves it unset, the model's default (from its
            generation_config.json), else OpenAI's."""
            value = getattr(self, name)
            return defaults.get(name, default) if value is None else value

        structured = self._structured_outputs(limits)
        if prompt_logprobs is None:
            prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is not None and prompt_logprobs > limits.max_logprobs:
            raise InvalidRequest(f"prompt_logprobs must be in [0, {limits.max_logprobs}] (--max-logprobs); got "
                                 f"{prompt_logprobs}", "prompt_logprobs")
        if prompt_logprobs is not None and self.stream:
            raise InvalidRequest("prompt logprobs (prompt_logprobs, or echo with logprobs) are not supported with "
                                 "stream: send the request with stream false", "prompt_logprobs")
        allowed = None if self.allowed_token_ids is None else token_ids(self.allowed_token_ids, "allowed_token_ids")
        if allowed == []:
            raise InvalidRequest("allowed_token_ids must name at least one token", "allowed_token_ids")
        bad_words = self._bad_words(limits)

        try:
            return SamplingParams(
                n=self.n,
                temperature=given("temperature", 1.0),
                top_p=given("top_p", 1.0),
                top_k=given("top_k", 0),
                min_p=given("min_p", 0.0),
                presence_penalty=given("presence_penalty", 0.0),
                frequency_penalty=given("frequency_penalty", 0.0),
                repetition_penalty=given("repetition_penalty", 1.0),
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=stop,
                stop_token_ids=[] if self.stop_token_ids is None else self.stop_token_ids,  # SamplingParams checks each
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
                skip_special_tokens=self.skip_special_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=bias,
                structured_outputs=structured,
                allowed_token_ids=allowed,
                bad_words=bad_words,
            )
        except ValueError as e:  # "SamplingParams.top_p must be ..." names the field
            message = str(e)
            param = message.split(" ", 1)[0].removeprefix("SamplingParams.") if message.startswith(
                "SamplingParams.") else None
            raise InvalidRequest(message, param) from None

    def _bad_words(self, limits: RequestLimits) -> list[str]:
        if self.bad_words is None:
            return []
        words = strings(self.bad_words, "bad_words")
        if len(words) > limits.max_stop:
            raise InvalidRequest(f"bad_words may have at most {limits.max_stop} words; got {len(words)}", "bad_words")
        if any(len(w) > MAX_STOP_CHARS for w in words):
            raise InvalidRequest(f"a bad word may be at most {MAX_STOP_CHARS} characters long", "bad_words")
        return words

    def _logit_bias(self, limits: RequestLimits) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        if not isinstance(self.logit_bias, dict):
            raise InvalidRequest("logit_bias must be an object of token id -> bias", "logit_bias")
        if len(self.logit_bias) > limits.max_logit_bias:
            raise InvalidRequest(f"logit_bias may have at most {limits.max_logit_bias} entries; got "
                                 f"{len(self.logit_bias)}", "logit_bias")
        bias = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()):
                raise InvalidRequest(f"logit_bias keys are token ids; got {key!r:.40}", "logit_bias")
            if type(value) not in (int, float) or not -100 <= value <= 100:
                raise InvalidRequest(f"logit_bias values must be numbers in [-100, 100]; got {value!r:.40}",
                                     "logit_bias")
            bias[int(key)] = float(value)
        return bias

    def _structured_outputs(self, limits: RequestLimits) -> StructuredOutputsParams | None:
        """The one output constraint the request gives, from whichever field gives it."""
        given: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type != "structural_tag" and fmt.model_fields_set & {"structures", "triggers",
                                                                                          "format"}:
            raise InvalidRequest("structures, triggers and format belong to a response_format of type "
                                 "structural_tag", "response_format")
        if fmt is not None and fmt.type == "structural_tag":
            tag = {name: getattr(fmt, name) for name in ("structures", "triggers", "format")
                   if getattr(fmt, name) is not None}
            if not tag:
                raise InvalidRequest("a response_format of type structural_tag needs structures and triggers, or a "
                                     "format", "response_format")
            given.append(("response_format", {"structural_tag": json.dumps({"type": "structural_tag", **tag})}))
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise InvalidRequest("response_format of type json_schema needs json_schema.schema",
                                     "response_format")
            given.append(("response_format", {"json": fmt.json_schema.json_schema}))
        if self.structured_outputs:
            given.append(("structured_outputs", {k: v for k, v in self.structured_outputs.items() if v is not None}))
        if self.guided_choice is not None:
            strings(self.guided_choice, "guided_choice")
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                given.append((f"guided_{name}", {name: value}))
        for field_name, name in (("regex", "regex"), ("ebnf", "grammar")):  # SGLang's
            value = getattr(self, field_name)
            if value is not None:
                given.append((field_name, {name: value}))
        if not given:
            return None
        if len(given) > 1:
            raise InvalidRequest(f"give one output constraint; got {', '.join(n for n, _ in given)}", given[1][0])
        name, fields = given[0]
        choice = fields.get("choice")
        if isinstance(choice, list) and len(choice) > limits.max_choices:
            raise InvalidRequest(f"{name}: at most {limits.max_choices} choices; got {len(choice)}", name)
        try:
            return StructuredOutputsParams(**fields)
        except (TypeError, ValueError) as e:
            raise InvalidRequest(f"{name}: {e}", name) from None


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class MessageFunctionCall(_Strict):
    name: str
    arguments: str  # JSON text


class MessageToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(_Strict):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers
    reasoning_content: str | None = None  # an assistant's reasoning, as answers give it (templates may show it)

    def as_template_dict(self) -> dict[str, Any]:
        """{"role", "content"} with the content as one string (text parts joined), or, where
        the message has image parts, as its list of text and image_url parts (the input
        processor loads the images and gives the template {"type": "image"} for each)."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") == "image_url":
                    _check_image_part(part)
                elif part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest(f"only text and image_url content parts are supported; got type "
                                         f"{part.get('type')!r:.40}", "messages")
                else:
                    texts.append(part["text"])
            if len(texts) == len(content):
                content = "\n".join(texts)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            if self.role != "assistant":
                raise InvalidRequest(f"only assistant messages have tool_calls; got a {self.role!r:.40} message",
                                     "messages")
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


def _check_image_part(part: dict[str, Any]) -> None:
    """OpenAI's {"type": "image_url", "image_url": {"url": ..., "detail": "auto"}}."""
    image = part.get("image_url")
    if isinstance(image, str):  # vLLM takes the URL alone too
        image = {"url": image}
    if set(part) != {"type", "image_url"} or not isinstance(image, dict) or not isinstance(image.get("url"), str) \
            or set(image) - {"url", "detail"}:
        raise InvalidRequest("an image_url content part is {'type': 'image_url', 'image_url': {'url': 'data:...'}}",
                             "messages")
    if image.get("detail", "auto") != "auto":
        raise InvalidRequest(f"image_url.detail {image['detail']!r:.20} is not supported: the model's processor sets "
                             "each image's resolution; leave detail out or send 'auto'", "messages")


def conversation(messages: Any) -> list[dict[str, Any]]:
    """The template's messages from a request's `messages` (checked one message at a time)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {'role', 'content'} messages", "messages")
    try:
        return [(m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m)).as_template_dict()
                for m in messages]
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(x) for x in error.get("loc", ()))
        raise InvalidRequest(f"messages: {where + ': ' if where else ''}{error.get('msg')}", "messages") from None


# chat_template_kwargs may not set what the server itself passes to the template
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tools"})


class ChatCompletionRequest(_SamplingRequest):
    messages: Bulk(list[ChatMessage])
    max_tokens: Count | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Bulk(list[ChatTool] | None) = None  # checked by ember.server.tool_calls
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None  # OpenAI's: the template's reasoning_effort, where it has that variable
    # vLLM's
    continue_final_message: bool = False  # the last message is left open and the answer continues it
    echo: bool = False  # the answer starts with the last message's content where that is the answer's role
    add_special_tokens: bool = False  # special tokens (a BOS) added on top of the template's text
    documents: Bulk(list[dict[str, str]] | None) = None  # the template's documents (RAG templates)
    chat_template: str | None = None  # this request's template (with --trust-request-chat-template)
    include_reasoning: bool = True  # false: no reasoning_content in the answer (with --reasoning-parser)
    thinking_token_budget: int | None = Field(default=None, ge=0, le=INT64[1])  # then the reasoning is ended
    # mm_processor_kwargs: vLLM's, {"do_pan_and_scan": bool} alone, checked by the model (InputProcessor.pan_and_scan)
    honoured: ClassVar[frozenset[str]] = frozenset({"thinking_token_budget", "mm_processor_kwargs"})
    # SGLang's, as its router sends them: accepted at the values that are ember's behaviour
    # (reasoning is separated, and streamed, wherever --reasoning-parser is set)
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    def to_sampling_params(self, limits: RequestLimits = RequestLimits(),
                           defaults: Mapping[str, float | int] = NO_DEFAULTS) -> SamplingParams:
        """`defaults`: the model's sampling defaults (EngineConfig.sampling_defaults)."""
        for name, supported in (("separate_reasoning", True), ("stream_reasoning", True)):
            if getattr(self, name) != supported:
                raise InvalidRequest(f"{name} {str(not supported).lower()} is not supported: ember runs as "
                                     f"{name} {str(supported).lower()}", name)
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest("continue_final_message continues the last message: send add_generation_prompt "
                                 "false with it", "continue_final_message")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, limits,
                                     defaults)

    def conversation(self) -> list[dict[str, Any]]:
        return conversation(self.messages)

    def template_kwargs(self, template: str | None = None) -> dict[str, Any]:
        """The template's variables beyond messages and tools: chat_template_kwargs, documents,
        and reasoning_effort, which `template` (the source) must read, or it is refused."""
        kwargs = dict(self.chat_template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(reserved)}: give them as request "
                                 "fields", "chat_template_kwargs")
        for name in ("documents", "reasoning_effort"):
            value = getattr(self, name)
            if value is None:
                continue
            if name in kwargs:
                raise InvalidRequest(f"{name} is given twice: as a field and in chat_template_kwargs", name)
            kwargs[name] = strings_dicts(value, name) if name == "documents" else value
        if self.reasoning_effort is not None and "reasoning_effort" not in (template or ""):
            raise InvalidRequest("reasoning_effort is not supported by this model: its chat template has no "
                                 "reasoning_effort variable", "reasoning_effort")
        return kwargs

    def echoed(self, conversation: list[dict[str, Any]]) -> str:
        """What vLLM's echo puts before the answer: the last message's content where that
        message has the answer's role (assistant, or the last role without a generation prompt)."""
        if not self.echo or not conversation:
            return ""
        role = "assistant" if self.add_generation_prompt else conversation[-1]["role"]
        last = conversation[-1]
        return last["content"] if last["role"] == role and isinstance(last.get("content"), str) else ""


class CompletionRequest(_SamplingRequest):
    honoured: ClassVar[frozenset[str]] = frozenset({"use_beam_search", "length_penalty"})  # beam_search_params
    prompt: Bulk(Union[str, list[str], list[Int64], list[list[Int64]]])
    max_tokens: Annotated[int, Field(ge=0, le=INT64[1])] | None = 16  # OpenAI's default; 0 with echo: scoring
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: false tokenizes text prompts without a BOS

    def to_sampling_params(self, limits: RequestLimits = RequestLimits(),
                           defaults: Mapping[str, float | int] = NO_DEFAULTS) -> SamplingParams:
        """`defaults`: the model's sampling defaults (EngineConfig.sampling_defaults)."""
        if self.suffix:
            raise InvalidRequest("suffix is not supported", "suffix")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("max_tokens must be at least 1 (0 only with echo: the prompt scored, nothing "
                                 "generated)", "max_tokens")
        if self.echo and self.stream:
            raise InvalidRequest("echo is not supported with stream: send the request with stream false", "echo")
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens get logprobs too
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        return self._sampling_params(self.max_tokens, self.logprobs, limits, defaults, prompt_logprobs)

    def beam_search_params(self) -> BeamSearchParams | None:
        """vLLM's use_beam_search: n beams (transformers' beam search, non-streaming), with
        length_penalty; None without it. A field that would change a sampled completion but
        means nothing to beam search is refused by name."""
        if not self.use_beam_search:
            if self.use_beam_search is not None and self.use_beam_search is not False:
                raise InvalidRequest("use_beam_search must be true or false", "use_beam_search")
            if self.length_penalty not in (None, 1, 1.0):
                raise InvalidRequest("length_penalty applies to beam search: send use_beam_search true with it, or "
                                     "leave it out", "length_penalty")
            return None
        if self.use_beam_search is not True:
            raise InvalidRequest("use_beam_search must be true or false", "use_beam_search")
        self.check_policy_fields()
        allowed = {"prompt", "model", "max_tokens", "n", "use_beam_search", "length_penalty", "temperature",
                   "ignore_eos", "stream", "request_id", "rid", "priority", "add_special_tokens", "return_token_ids"} \
            | field_policy.RULED
        for name in sorted(self.model_fields_set - allowed):
            raise InvalidRequest(f"{name} does not apply to beam search (use_beam_search: the n best sequences by "
                                 "their summed log-probabilities): leave it out", name)
        if self.stream:
            raise InvalidRequest("beam search is not streamed (the best beams are known at the end): send stream "
                                 "false", "stream")
        if self.temperature not in (None, 0, 0.0):
            raise InvalidRequest("beam search here is deterministic (transformers' do_sample=False): send "
                                 "temperature 0 or leave it out", "temperature")
        penalty = 1.0 if self.length_penalty is None else self.length_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty):
            raise InvalidRequest(f"length_penalty must be a number; got {penalty!r:.40}", "length_penalty")
        if self.max_tokens is None or self.max_tokens < 1:
            raise InvalidRequest("beam search needs max_tokens >= 1", "max_tokens")
        try:
            return BeamSearchParams(beam_width=self.n, max_tokens=self.max_tokens, ignore_eos=bool(self.ignore_eos),
                                    length_penalty=float(penalty))
        except ValueError as e:
            raise InvalidRequest(str(e).replace("beam_width", "n (the beam width)"), "n") from None

    def prompts(self, limits: RequestLimits = RequestLimits()) -> list[str | dict[str, Any]]:
        """One engine prompt per prompt given: text, or {"prompt_token_ids": [...]}."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif not isinstance(p, list) or not p:
            raise InvalidRequest("prompt must be a non-empty string, list of strings, token ids, or list of "
                                 "lists of token ids", "prompt")
        elif type(p[0]) is int:  # the ids themselves are checked with the prompt (InputProcessor.check_prompt)
            prompts = [{"prompt_token_ids": p}]
        elif type(p[0]) is list:
            prompts = [{"prompt_token_ids": ids} for ids in p]
        else:
            prompts = strings(p, "prompt")
        if len(prompts) > limits.max_prompts:
            raise InvalidRequest(f"at most {limits.max_prompts} prompts in one request; got {len(prompts)}", "prompt")
        return prompts


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: Bulk(list[ChatMessage] | None) = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: Bulk(list[ChatTool] | None) = None  # rendered with messages
    mm_processor_kwargs: Any = None  # vLLM's, with messages: as a chat request's


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: Bulk(list[Int64])
    skip_special_tokens: bool = False  # ember's: the text a completion with it would show (ember.lang's state)


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


class PromptLogprob(BaseModel):
    """One entry of vLLM's prompt_logprobs: token id -> this."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]  # None for the first token (no context)


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatCompletionTokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ToolCall] | None = None


def _asked(description: str) -> Any:
    """vLLM's token-id fields: in a response only where the request asked (return_token_ids)."""
    return Field(default=None, exclude_if=lambda value: value is None, description=description)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None
    prompt_logprobs: PromptLogprobs | None = None
    token_ids: list[int] | None = _asked("the choice's token ids (return_token_ids)")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = _asked("the prompt's token ids (return_token_ids)")


class _NoNulls(BaseModel):
    """Serialized without its unset (None) fields, as OpenAI sends tool-call deltas."""

    @model_serializer(mode="wrap")
    def _drop_nulls(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_NoNulls):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_NoNulls):
    """A call's first delta has its id, type and name; later ones pieces of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None
    token_ids: list[int] | None = _asked("the tokens new in this chunk (return_token_ids)")


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = _asked("the prompt's token ids, in the first chunk (return_token_ids)")


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
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = _asked("the prompt's token ids (streamed: in its first chunk)")
    token_ids: list[int] | None = _asked("the choice's token ids (streamed: those new in the chunk)")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


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
