"""EncoderBudget: how much image encoding one step may start (vLLM's encoder compute budget,
`--max-num-encoder-input-tokens`), so one prompt with many images cannot hold every other
request's next token up behind its vision tower.

An image's cost is its placeholder tokens (`ImageFeature.length`), as vLLM counts it: known for
every family without asking its tower, in the same units as the step's token budget, and the
tower's work in proportion within a family (LLaVA: a patch a token; Qwen2-VL: merge^2 patches a
token; Pixtral: a patch a token plus its row breaks). Gemma 3's pan-and-scan crops are features
of their own: each pays its tokens and may start in a later step than its image's other views
(vLLM's item is the image with all its crops). A chunk *starts* an image when it covers the
image's first token, or when it is a request's first chunk since admission and begins inside
the image (a prefix hit or a swap-in that ends there: the runner has to encode it again, unless
its encoder cache still has it, which the scheduler does not see). Then:

- an image that a prefix hit covers entirely, or that an earlier chunk of the running request
  started, costs nothing (the runner holds its embeddings until the prefill passes it);
- the same image (hash) started twice in a step is paid once: the runner encodes it once;
- the first image of a step always goes, so an image larger than the budget is never starved;
- a chunk that would start an image past what is left is cut right before that image's first
  token (a chunk cut to nothing waits for the next step).

Images are in prompt order (`Request.mm_features`), so the walk stops at the chunk's end.

A model whose image tokens attend to each other both ways (Gemma 3: `whole_images`) computes an
image's tokens in one step: first, a chunk whose end falls inside an image ends before it, and
one that begins at or inside that image (a prefix hit may end inside one) grows to the image's
end, within the step's budget, else it waits for a step with room (EngineConfig makes sure
max_num_batched_tokens holds an image)."""

from __future__ import annotations

from ember.multimodal.inputs import ImageFeature
from ember.request import Request


class EncoderBudget:
    """Placeholder tokens of the images a step starts, at most `max_tokens` (but one image)."""

    def __init__(self, max_tokens: int, whole_images: bool = False) -> None:
        self.max_tokens = max_tokens
        self.whole_images = whole_images
        self.used = 0
        self.started: set[str] = set()  # hashes of the images this step starts

    def new_step(self) -> None:
        self.used = 0
        self.started.clear()

    def cut(self, req: Request, n: int, admitted: bool, budget: int) -> tuple[int, list[ImageFeature]]:
        """The request's next `n` tokens cut before the first image they would start past the
        budget, and the images the cut chunk starts (pay for them with `spend` once the chunk
        is in the plan). `admitted`: the chunk is the request's first since admission.
        `budget`: the step's tokens left, into which a chunk grows to finish an image it begins
        in (`whole_images`)."""
        if self.whole_images:
            n = _whole_images(req, n, budget)
        start = req.num_computed_tokens
        end = start + n
        cost, starts, hashes = 0, [], set(self.started)
        for f in req.mm_features:
            if f.offset >= end:
                break
            if f.end <= start or (f.offset < start and not admitted) or f.hash in hashes:
                continue
            if self.used + cost and self.used + cost + f.length > self.max_tokens:
                return max(f.offset - start, 0), starts
            cost += f.length
            starts.append(f)
            hashes.add(f.hash)
        return n, starts

    def spend(self, features: list[ImageFeature]) -> None:
        for f in features:
            if f.hash not in self.started:
                self.started.add(f.hash)
                self.used += f.length


def _whole_images(req: Request, n: int, budget: int) -> int:
    """The request's next `n` tokens, ending outside every image (see the module's note): before
    the image their end falls inside, or at its end when they begin at or inside it and `budget`
    holds that (else 0)."""
    start = req.num_computed_tokens
    end = start + n
    for f in req.mm_features:
        if f.offset >= end:
            break
        if f.end <= end:
            continue
        if f.offset > start:
            return f.offset - start
        return f.end - start if f.end - start <= budget else 0
    return n
