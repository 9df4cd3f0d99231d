"""A program's state and how its expressions run (SGLang's interpreter semantics).

Each state has a worker thread that runs what the program appends, in order: `s += ...`
returns at once, `s["x"]` waits for x, `text()` for everything appended so far. So a fork's
children, each with its own worker, call the model at the same time, and the engine batches
them. The state keeps its token ids beside its text: constant text is tokenized once (all
of it since the last model call, in one piece), a gen keeps the model's own output ids, and
every call's prompt is the state's tokens, so each call finds the previous ones cached.

Failures: an error in a model call ends that state's worker; waiting on it raises the error
(`s["x"]`, `text()`, `run`), and run_batch keeps it in that state alone (`state.error()`)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from ember.lang.backend import Backend, kept_tokens
from ember.lang.ir import (
    CommitPrefix,
    Concatenate,
    Constant,
    Expr,
    ExprList,
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    VarScopeBegin,
    VarScopeEnd,
    as_expr,
)

_END = object()


class StreamExecutor:
    """Runs one state's expressions on its worker thread and holds what they made."""

    def __init__(self, backend: Backend, sampling: dict[str, Any], logprobs: dict[str, Any], stream: bool) -> None:
        self.backend = backend
        self.sampling = sampling  # the run's defaults, SGLang's names
        self.logprobs = logprobs
        self.stream = stream
        self.text_ = ""
        self.tokens: list[int] = []  # what the model has read or written, as token ids
        self.pending = ""  # text appended since, not tokenized yet
        self.variables: dict[str, Any] = {}
        self.variable_event: dict[str, threading.Event] = {}
        self.meta_info: dict[str, Any] = {}
        self.messages_: list[dict[str, str]] = []
        self.cur_role: str | None = None
        self.cur_role_suffix = ""
        self.cur_role_begin_pos = 0
        self.fork_start_text_pos = 0
        self.error_: BaseException | None = None
        self.first_call = threading.Event()  # set once a model call returned (or the worker ended)
        self.text_event = threading.Event()  # streaming: the text grew
        self.stream_var_event: dict[str, threading.Event] = {}
        self.is_finished = False
        self._ended = False
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="ember-lang-state", daemon=True)
        self._worker.start()

    # -- the program's side ------------------------------------------------------------------

    def submit(self, expr: Expr) -> None:
        self._init_events(expr)
        if self._ended:  # the run is over: run it here, after the worker's last
            self.sync()
            self._execute(expr)
        else:
            self._queue.put(expr)

    def sync(self) -> None:
        if not self._ended or self._worker.is_alive():
            self._queue.join()

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._queue.put(_END)

    def fail(self, error: BaseException) -> None:
        """The program itself raised: the state keeps the error."""
        if self.error_ is None:
            self.error_ = error
        self._release_waiters()

    def get_var(self, name: str) -> Any:
        event = self.variable_event.get(name)
        if event is not None:
            event.wait()
        if name not in self.variables:
            if self.error_ is not None:
                raise self.error_
            raise KeyError(f"the program has no variable {name!r}")
        return self.variables[name]

    def text(self) -> str:
        self.sync()
        self._raise()
        return self.text_

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        self._raise()
        return self.messages_

    def fork(self, size: int) -> list[StreamExecutor]:
        if size > 1:  # the worker may not have reached the text yet: it decides whether there is any
            self.submit(CommitPrefix())
        self.sync()
        self._raise()
        children = []
        for _ in range(int(size)):
            child = StreamExecutor(self.backend, self.sampling, self.logprobs, self.stream)
            child.text_, child.tokens, child.pending = self.text_, list(self.tokens), self.pending
            child.variables = dict(self.variables)
            child.messages_ = list(self.messages_)
            child.cur_role, child.cur_role_suffix = self.cur_role, self.cur_role_suffix
            child.cur_role_begin_pos = self.cur_role_begin_pos
            child.fork_start_text_pos = len(self.text_)
            children.append(child)
        return children

    def _raise(self) -> None:
        if self.error_ is not None:
            raise self.error_

    # -- the worker ------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            if expr is _END:
                self._queue.task_done()
                break
            try:
                if self.error_ is None:
                    self._execute(expr)
            except BaseException as e:  # the state fails; what follows is skipped, nothing waits forever
                self.error_ = e
                self._release_waiters()
            finally:
                self._queue.task_done()
                self.text_event.set()
        self.is_finished = True
        self.first_call.set()
        self.text_event.set()
        self._release_waiters()

    def _release_waiters(self) -> None:
        self.first_call.set()
        for event in (*self.variable_event.values(), *self.stream_var_event.values()):
            event.set()
        self.text_event.set()

    def _init_events(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for e in expr.exprs:
                self._init_events(e)
        elif isinstance(expr, (Gen, Select, VarScopeBegin)) and expr.name is not None:
            self.variable_event[expr.name] = threading.Event()
            if self.stream:
                self.stream_var_event[expr.name] = threading.Event()

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for e in expr.exprs:
                self._execute(e)
        elif isinstance(expr, Constant):
            self._fill(expr.value)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, VarScopeBegin):
            self.variables[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            self.variables[expr.name] = self.text_[self.variables[expr.name]:]
            self.variable_event[expr.name].set()
        elif isinstance(expr, CommitPrefix):
            if self.pending:
                self._flush()
        elif isinstance(expr, Concatenate):
            for state in expr.states:
                child = state.stream_executor
                child.sync()
                child._raise()
                self._fill(child.text_[child.fork_start_text_pos:])
        else:
            raise TypeError(f"ember.lang cannot run {expr!r}")

    def _fill(self, text: str) -> None:
        text = str(text)
        self.text_ += text
        self.pending += text

    def _flush(self) -> list[int]:
        """The pending text tokenized onto the state's tokens; the tokens."""
        if self.pending:
            encode = self.backend.encode_first if not self.tokens else \
                (lambda t: self.backend.encode(t, False))
            self.tokens = self.tokens + encode(self.pending)
            self.pending = ""
        if not self.tokens:
            raise ValueError("a program calls the model after some text: append a prompt before gen or select")
        return self.tokens

    def _gen(self, expr: Gen) -> None:
        prompt = self._flush()
        start, name = len(self.text_), expr.name
        on_text = self._streamer(start, name) if self.stream else None
        sampling = {**self.sampling, **expr.sampling}
        result = self.backend.generate(prompt, sampling, {**self.logprobs, **expr.logprobs}, on_text)
        self.first_call.set()
        skip = sampling.get("skip_special_tokens", True)  # as the text was decoded
        self.tokens = prompt + kept_tokens(result.output_ids, result.text, lambda ids: self.backend.decode(ids, skip),
                                           lambda t: self.backend.encode(t, False))
        self.text_ = self.text_[:start] + result.text
        self._set(name, result.text, result.meta_info())

    def _streamer(self, start: int, name: str | None) -> Callable[[str], None]:
        def on_text(text: str) -> None:
            self.text_ = self.text_[:start] + text
            if name is not None:
                self.variables[name] = text
                self.stream_var_event[name].set()
            self.text_event.set()
        return on_text

    def _select(self, expr: Select) -> None:
        prompt = self._flush()
        ids = [self.backend.encode(c, False) for c in expr.choices]
        result = self.backend.score(prompt, ids, expr.method.requires_unconditional_logprobs)
        self.first_call.set()
        inputs = [[(lp, t, None) for lp, t in zip(lps, c)] for lps, c in zip(result.logprobs, ids)]
        uncond = None if result.unconditional is None else \
            [[(lp, t, None) for lp, t in zip(lps, c)] for lps, c in zip(result.unconditional, ids)]
        normalized = [sum(t[0] for t in tokens) / len(tokens) for tokens in inputs]
        decision = expr.method(choices=expr.choices, normalized_prompt_logprobs=normalized,
                               input_token_logprobs=inputs, output_token_logprobs=[[] for _ in ids],
                               unconditional_token_logprobs=uncond)
        chosen = expr.choices.index(decision.decision)
        self.tokens = prompt + ids[chosen]
        self.text_ += decision.decision
        meta = {**decision.meta_info, "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens}
        self._set(expr.name, decision.decision, meta)

    def _set(self, name: str | None, value: str, meta: dict[str, Any]) -> None:
        if name is None:
            return
        self.variables[name] = value
        self.meta_info[name] = meta
        self.variable_event[name].set()
        if name in self.stream_var_event:
            self.stream_var_event[name].set()

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"roles do not nest: {role!r} begins inside {self.cur_role!r}")
        prefix, self.cur_role_suffix = self.backend.role_affixes(role, tuple(m["role"] for m in self.messages_))
        self.cur_role = role
        self._fill(prefix)
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"{role!r} ends, but the open role is {self.cur_role!r}")
        content = self.text_[self.cur_role_begin_pos:].lstrip()
        self._fill(self.cur_role_suffix)
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None


class ProgramState:
    """What a program function gets as `s`: append with `+=`, read with `s["name"]`."""

    def __init__(self, stream_executor: StreamExecutor) -> None:
        self.stream_executor = stream_executor

    def __iadd__(self, other: Any) -> ProgramState:
        if other is None:
            raise ValueError("tried to append None to the state")
        self.stream_executor.submit(as_expr(other))
        return self

    def _role(self, role: str, expr: Any = None):
        if expr is not None:
            self.stream_executor.submit(ExprList([RoleBegin(role), as_expr(expr), RoleEnd(role)]))
            return None

        @contextmanager
        def scope():
            self.stream_executor.submit(RoleBegin(role))
            yield
            self.stream_executor.submit(RoleEnd(role))

        return scope()

    def system(self, expr: Any = None):
        return self._role("system", expr)

    def user(self, expr: Any = None):
        return self._role("user", expr)

    def assistant(self, expr: Any = None):
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str):
        self.stream_executor.submit(VarScopeBegin(name))
        yield
        self.stream_executor.submit(VarScopeEnd(name))

    def fork(self, size: int = 1) -> ProgramStateGroup:
        return ProgramStateGroup([ProgramState(e) for e in self.stream_executor.fork(size)], self)

    @contextmanager
    def copy(self):
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    def text(self) -> str:
        return self.stream_executor.text()

    def messages(self) -> list[dict[str, str]]:
        return self.stream_executor.messages()

    def token_ids(self) -> list[int]:
        """The state's tokens: what the model read and wrote, then any text appended since."""
        executor = self.stream_executor
        executor.sync()
        executor._raise()
        return executor._flush() if executor.pending or executor.tokens else []

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        self.stream_executor.sync()
        return self.stream_executor.error_

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.variables[name] = value

    def get_meta_info(self, name: str) -> Any:
        self.stream_executor.get_var(name)
        return self.stream_executor.meta_info.get(name)

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text (or one variable's) as it grows, in pieces; at once without stream=True."""
        executor = self.stream_executor
        if not executor.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        seen = 0
        if var_name is None:
            while True:
                executor.text_event.wait()
                executor.text_event.clear()
                done = executor.is_finished
                piece = executor.text_[seen:]
                seen += len(piece)
                if piece:
                    yield piece
                if done:
                    executor._raise()
                    return
        while var_name not in executor.stream_var_event:
            if executor.is_finished:
                executor._raise()
                return
            executor.text_event.wait(0.05)
        event = executor.stream_var_event[var_name]
        while True:
            event.wait()
            event.clear()
            done = executor.variable_event[var_name].is_set()
            piece = str(executor.variables.get(var_name, ""))[seen:]
            seen += len(piece)
            if piece:
                yield piece
            if done:
                executor._raise()
                return

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    def __del__(self) -> None:
        executor = getattr(self, "stream_executor", None)
        if executor is not None:
            executor.end()

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """fork's children: `+=` appends to each (an expression, one a child, or a function of
    the child's index); `join` brings them back."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState) -> None:
        self.states = states
        self.src_state = src_state

    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: each variable the children made becomes a list of their values
        in the parent; concate_and_append: their text since the fork is appended in order."""
        if mode == "gather_variable":
            parent = self.src_state.stream_executor
            parent.sync()
            known = set(parent.variables)
            for state in self.states:
                child = state.stream_executor
                child.sync()
                child._raise()
                for name in set(child.variables) - known:
                    parent.variables.setdefault(name, []).append(child.variables[name])
        elif mode == "concate_and_append":
            self.src_state += Concatenate(self.states)
            self.src_state.stream_executor.sync()
        else:
            raise ValueError(f"join mode must be gather_variable or concate_and_append; got {mode!r}")
        for state in self.states:
            state.stream_executor.end()

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if callable(other) and not isinstance(other, Expr):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} forked states")
            for state, expr in zip(self.states, other):
                state += expr
        else:
            for state in self.states:
                state += other
        return self


def run_program(func: Callable[..., Any], backend: Backend, args: tuple, kwargs: dict[str, Any],
                sampling: dict[str, Any], logprobs: dict[str, Any], stream: bool) -> ProgramState:
    """Run one program: its function appends, its worker runs. stream=True returns at once
    (read it with text_iter); otherwise once everything ran, raising the program's error."""
    state = ProgramState(StreamExecutor(backend, sampling, logprobs, stream))
    if stream:
        threading.Thread(target=_run_in, args=(state, func, args, kwargs), name="ember-lang-program",
                         daemon=True).start()
        return state
    _run_in(state, func, args, kwargs)
    state.stream_executor._raise()
    return state


def run_program_batch(func: Callable[..., Any], backend: Backend, batch: list[dict[str, Any]],
                      sampling: dict[str, Any], logprobs: dict[str, Any], num_threads: int | str,
                      progress_bar: bool) -> list[ProgramState]:
    """Every program of the batch, at most `num_threads` at a time; the states in input
    order, a failed one holding its error (`state.error()`). The first program runs until
    its first model call has returned before the rest start, so what they share is cached."""
    if not batch:
        return []
    threads = min(64 if num_threads == "auto" else int(num_threads), len(batch))
    if threads < 1:
        raise ValueError(f"num_threads must be >= 1 or 'auto'; got {num_threads!r}")
    states: list[ProgramState | None] = [None] * len(batch)  # made when their program starts
    states[0] = ProgramState(StreamExecutor(backend, sampling, logprobs, False))
    bar = None
    if progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=len(batch))

    def one(i: int) -> None:
        if states[i] is None:
            states[i] = ProgramState(StreamExecutor(backend, sampling, logprobs, False))
        _run_in(states[i], func, (), batch[i])
        if bar is not None:
            bar.update()

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(one, 0)]
        states[0].stream_executor.first_call.wait()
        futures += [pool.submit(one, i) for i in range(1, len(batch))]
        for f in futures:
            f.result()
    if bar is not None:
        bar.close()
    return states  # type: ignore[return-value]


def _run_in(state: ProgramState, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> None:
    """The program's function on `state`, then its worker to the end; an error stays in the state."""
    executor = state.stream_executor
    try:
        state.ret_value = func(state, *args, **kwargs)
    except BaseException as e:
        executor.fail(e)
    finally:
        executor.end()
    executor.sync()
