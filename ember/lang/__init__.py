"""ember.lang: SGLang's program frontend on ember. A program written for `sglang` runs by
changing its import (`import ember.lang as sgl`):

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.LocalBackend(LLM()))   # or sgl.RuntimeEndpoint("http://...")
    print(qa.run(question="...")["answer"])

The state is kept in token ids (the model's own output ids; only new text is tokenized), so
every call's prompt extends the previous one and the prefix cache finds it; roles are read
off the model's chat template; `select` scores every choice in one engine call."""

from ember.lang.api import (
    SglFunction,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from ember.lang.backend import Backend
from ember.lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    token_logprob_sum,
    unconditional_likelihood_normalized,
)
from ember.lang.interpreter import ProgramState, ProgramStateGroup


def __getattr__(name: str):
    # the backends pull in the engine (LocalBackend) or httpx (RuntimeEndpoint): on first use
    if name == "LocalBackend":
        from ember.lang.local import LocalBackend

        return LocalBackend
    if name == "RuntimeEndpoint":
        from ember.lang.runtime_endpoint import RuntimeEndpoint

        return RuntimeEndpoint
    raise AttributeError(f"module 'ember.lang' has no attribute {name!r}")


__all__ = ["Backend", "ChoicesDecision", "ChoicesSamplingMethod", "LocalBackend", "ProgramState", "ProgramStateGroup",
           "RuntimeEndpoint", "SglFunction", "assistant", "assistant_begin", "assistant_end", "flush_cache", "function",
           "gen", "gen_int", "gen_string", "get_server_info", "greedy_token_selection", "select", "set_default_backend",
           "system", "system_begin", "system_end", "token_length_normalized", "token_logprob_sum",
           "unconditional_likelihood_normalized", "user", "user_begin", "user_end"]
