"""Beam search inside the engine: each search's beams are running requests (a group), decoded
together with everything else, one token a step, and re-formed after each step by its
`BeamSearch` (engine/beam_search.py: transformers' choices, exactly):

    a step       every beam of the group samples one token (greedy, with the top 2k
                 log-probabilities); the group advances once all of them have
    advance      BeamSearch picks the next beams, each a (beam it continues, token): the
                 first beam continuing a request takes that request over (its sampled token
                 replaced by the chosen one: that token's KV is not computed yet); each further
                 one is a fork (Scheduler.fork_beam: the parent's full blocks shared, its
                 partial one copied, as n > 1 forks); a request no beam continues finishes
    done         the group's finished hypotheses are the request's outputs, best first: one a
                 sample (index), with its summed log-probability (cumulative_logprob)

So a search costs what decoding its beams costs, with no request made or prefix looked up a
step (as vLLM's LLM.beam_search does, and this engine's did: every step a new one-token
request a beam). A beam whose token is in while others of its group wait (preempted, or a fork
recomputing for want of a free block) is `held`: not scheduled nor preempted, its seat and
blocks kept. Should held beams leave nothing runnable (they hold the blocks or seats the
waiting head needs), `unblock` requeues those of other groups than the head's, their token
dropped (recomputed when they run again: the same token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.engine.beam_search import BeamSearch
from ember.request import Request, RequestStatus
from ember.runner.sampler import TokenLogprobs
from ember.scheduler.scheduler import Scheduler


@dataclass
class BeamGroup:
    root: Request  # the request as added: its id is the search's
    search: BeamSearch
    beams: list[Request]  # the running beams, in the search's order
    tops: dict[str, dict[int, float]] = field(default_factory=dict)  # a beam's {token: logprob} of this step
    forks: int = 0  # beams forked so far (their ids: "<root id>#b<n>")


@dataclass
class BeamResult:
    """A finished search's hypothesis: sample `index` of its request."""

    root: Request
    index: int
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str


class BeamGroups:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.groups: dict[str, BeamGroup] = {}  # by the root's id
        self.num_unblocked = 0  # beams requeued to make room, since start

    def add(self, req: Request) -> None:
        self.groups[req.request_id] = BeamGroup(req, BeamSearch(req.prompt_token_ids, req.beam,
                                                                set(req.eos_token_ids)), [req])

    def group_of(self, req: Request) -> BeamGroup | None:
        return self.groups.get(req.parent.request_id if req.parent is not None else req.request_id)

    def step(self, stepped: list[Request], logprobs: dict[str, list[TokenLogprobs]]
             ) -> tuple[list[BeamResult], list[Request]]:
        """A step's beams (those of `stepped` with a search): their tokens' top log-probabilities
        noted; each group whose beams are all in advances. Returns the finished searches'
        hypotheses and the beams it finished (their blocks freed)."""
        ready: dict[str, BeamGroup] = {}
        for req in stepped:
            group = self.group_of(req) if req.beam is not None else None
            if group is None:
                continue  # not a beam, or its search failed while this step was applied (fail_request)
            top = logprobs[req.request_id][0]
            group.tops[req.request_id] = dict(zip(top.top_ids, top.top_logprobs))
            req.held = True
            if len(group.tops) == len(group.beams):
                ready[group.root.request_id] = group
        results: list[BeamResult] = []
        left: list[Request] = []
        for group in ready.values():
            results += self._advance(group, left)
        return results, left

    def _advance(self, group: BeamGroup, left: list[Request]) -> list[BeamResult]:
        search = group.search
        search.advance([group.tops[b.request_id] for b in group.beams])
        group.tops.clear()
        if search.done:
            for beam in group.beams:
                self._finish(beam, left)
            del self.groups[group.root.request_id]
            return [BeamResult(group.root, i, tokens, float(cum), "stop" if tokens and tokens[-1] in search.eos
                               else "length") for i, (tokens, _, _, cum) in enumerate(search.finished)]
        beams, taken = [], set()
        for parent, token in search.parents:
            beam = group.beams[parent]
            assert not beam.status.is_finished, "a search ends at max_tokens, the step its beams do"
            if parent not in taken:  # the request itself goes on, with the chosen token for its sampled one
                taken.add(parent)
                beam.output_token_ids[-1] = token
                beam.held = False
                beams.append(beam)
            else:
                group.forks += 1
                beams.append(self.scheduler.fork_beam(beam, f"{group.root.request_id}#b{group.forks}", token))
        for i, beam in enumerate(group.beams):
            if i not in taken:
                self._finish(beam, left)
        group.beams = beams
        return []

    def _finish(self, beam: Request, left: list[Request]) -> None:
        beam.held = False
        if not beam.status.is_finished:  # (the scheduler ends a beam at max_tokens itself: not left here)
            self.scheduler.finish(beam, "length")
            left.append(beam)

    def drop(self, root_id: str) -> None:
        """Forget a search whose beams were aborted or failed."""
        self.groups.pop(root_id, None)

    def unblock(self) -> bool:
        """When nothing could be scheduled and held beams may be why: requeue the held beams of
        every group but the waiting head's (their tokens dropped). Whether any was."""
        waiting = self.scheduler.waiting
        head = self.group_of(waiting[0]) if waiting and waiting[0].beam is not None else None
        moved = False
        for group in self.groups.values():
            if group is head:
                continue
            for beam in group.beams:
                if beam.held and beam.status is RequestStatus.RUNNING:
                    beam.output_token_ids.pop()
                    del group.tops[beam.request_id]
                    self.scheduler.requeue(beam)
                    self.num_unblocked += 1
                    moved = True
        return moved
