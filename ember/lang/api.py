"""The public functions of ember.lang, as `sglang.lang`'s: `function`, `gen` and its
typed forms, `select`, the roles, `set_default_backend`."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ember.lang.backend import Backend
from ember.lang.choices import ChoicesSamplingMethod, token_length_normalized
from ember.lang.interpreter import ProgramState, run_program, run_program_batch
from ember.lang.ir import Expr, ExprList, RoleBegin, RoleEnd, Select, as_expr, gen_expr

_default_backend: Backend | None = None


def set_default_backend(backend: Backend) -> None:
    """The backend programs run on when `run` names none."""
    global _default_backend
    if not isinstance(backend, Backend):
        raise ValueError(f"a backend is a LocalBackend or RuntimeEndpoint; got {type(backend).__name__}")
    _default_backend = backend


def _backend(backend: Backend | None) -> Backend:
    backend = backend or _default_backend
    if backend is None:
        raise ValueError("no backend: pass backend= or call ember.lang.set_default_backend(LocalBackend(llm))")
    return backend


class SglFunction:
    """A program: a function whose first argument is the state `s`."""

    def __init__(self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None) -> None:
        self.func = func
        self.bind_arguments = bind_arguments or {}
        spec = inspect.getfullargspec(func)
        if not spec.args or spec.args[0] != "s":
            raise ValueError(f"a program's first argument is the state, named s; {func.__name__} takes {spec.args}")
        self.arg_names = spec.args[1:]
        self.arg_defaults = spec.defaults or ()

    def bind(self, **kwargs: Any) -> SglFunction:
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise ValueError(f"{self.func.__name__} has no argument(s) {', '.join(sorted(unknown))}")
        return SglFunction(self.func, {**self.bind_arguments, **kwargs})

    def run(self, *args: Any, max_new_tokens: int = 128, stop: str | list[str] | None = None,
            stop_token_ids: list[int] | None = None, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
            min_p: float = 0.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
            ignore_eos: bool = False, return_logprob: bool | None = None, logprob_start_len: int | None = None,
            top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None, stream: bool = False,
            backend: Backend | None = None, **kwargs: Any) -> ProgramState:
        """Run the program once; its state (raises what the program raised, unless stream)."""
        sampling, logprobs = _defaults(locals())
        return run_program(self.func, _backend(backend), args, {**kwargs, **self.bind_arguments}, sampling,
                           logprobs, stream)

    def run_batch(self, batch_kwargs: list[dict[str, Any]] | list[tuple], *, max_new_tokens: int = 128,
                  stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
                  temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
                  frequency_penalty: float = 0.0, presence_penalty: float = 0.0, ignore_eos: bool = False,
                  return_logprob: bool | None = None, logprob_start_len: int | None = None,
                  top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None,
                  backend: Backend | None = None, num_threads: int | str = "auto",
                  progress_bar: bool = False) -> list[ProgramState]:
        """Run the program on each argument set, at most `num_threads` at once; the states
        in input order (a failed one holds its error: `state.error()`)."""
        sampling, logprobs = _defaults(locals())
        batch = []
        for item in batch_kwargs:
            if not isinstance(item, dict):
                if not isinstance(item, (list, tuple)) or \
                        not len(self.arg_names) - len(self.arg_defaults) <= len(item) <= len(self.arg_names):
                    raise ValueError(f"{item!r} does not match {self.func.__name__}'s arguments {self.arg_names}")
                item = dict(zip(self.arg_names, item))
            batch.append({**item, **self.bind_arguments})
        return run_program_batch(self.func, _backend(backend), batch, sampling, logprobs, num_threads, progress_bar)

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def _defaults(arguments: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A run's sampling defaults (SGLang's names) and logprob options from its arguments."""
    if arguments.get("logprob_start_len") is not None:
        raise ValueError("logprob_start_len (a gen's prompt logprobs) is not supported by ember.lang: score "
                         "choices with select")
    sampling = {k: arguments[k] for k in ("max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p",
                                          "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos")
                if arguments[k] is not None}
    logprobs = {k: arguments[k] for k in ("return_logprob", "top_logprobs_num", "return_text_in_logprobs")
                if arguments[k] is not None}
    return sampling, logprobs


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None):
    """@function: a program. (API speculative execution, num_api_spec_tokens, is for
    chat-only API backends: not supported.)"""
    if num_api_spec_tokens is not None:
        raise ValueError("num_api_spec_tokens (speculative execution on chat-only APIs) is not supported by "
                         "ember.lang: leave it out")
    if func is not None:
        return SglFunction(func)
    return SglFunction


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None, n: int | None = None,
        stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None, temperature: float | None = None, top_p: float | None = None,
        top_k: int | None = None, min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None, return_logprob: bool | None = None,
        logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None, dtype: Any = None, choices: list[str] | None = None,
        choices_method: ChoicesSamplingMethod | None = None, regex: str | None = None,
        json_schema: Any = None) -> Expr:
    """A model call whose text is appended and kept as `name`. `choices`: a select;
    `regex` / `json_schema` (its text, a dict or a pydantic model) / `dtype` (int, float,
    bool, str): the text is constrained to it (checked here, before any request)."""
    if choices:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)
    for field, value, why in (("n", n if n != 1 else None, "run the program n times (run_batch) or fork"),
                              ("stop_regex", stop_regex, "use stop strings"),
                              ("logprob_start_len", logprob_start_len, "score choices with select")):
        if value is not None:
            raise ValueError(f"gen {field} is not supported by ember.lang: {why}")
    sampling = {"max_new_tokens": max_tokens, "min_new_tokens": min_tokens, "stop": stop,
                "stop_token_ids": stop_token_ids, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                "min_p": min_p, "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty,
                "ignore_eos": ignore_eos, "regex": regex, "json_schema": json_schema}
    logprobs = {"return_logprob": return_logprob, "top_logprobs_num": top_logprobs_num,
                "return_text_in_logprobs": return_text_in_logprobs}
    return gen_expr(name, sampling, logprobs, dtype)


def gen_int(name: str | None = None, **kwargs: Any) -> Expr:
    """gen constrained to an integer."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Expr:
    """gen constrained to a double-quoted string of word characters and spaces."""
    return gen(name, dtype=str, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> Expr:
    """The choice the model finds likeliest after the state (by `choices_method`), appended
    and kept as `name`: every choice's tokens scored in one engine call over the cached prefix."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select needs choices: a list of non-empty strings")
    if temperature != 0:
        raise ValueError("select picks by its choices_method; temperature (sampling a choice) is not supported")
    if not isinstance(choices_method, ChoicesSamplingMethod):
        raise ValueError(f"choices_method must be a ChoicesSamplingMethod; got {choices_method!r}")
    return Select(name, list(choices), choices_method)


def _role(role: str, expr: Any = None) -> Expr:
    if expr is None:
        return ExprList([RoleBegin(role), RoleEnd(role)])
    return ExprList([RoleBegin(role), as_expr(expr), RoleEnd(role)])


def system(expr: Any = None) -> Expr:
    return _role("system", expr)


def user(expr: Any = None) -> Expr:
    return _role("user", expr)


def assistant(expr: Any = None) -> Expr:
    return _role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


def flush_cache(backend: Backend | None = None) -> bool:
    return _backend(backend).flush_cache()


def get_server_info(backend: Backend | None = None) -> dict[str, Any]:
    return _backend(backend).get_server_info()
