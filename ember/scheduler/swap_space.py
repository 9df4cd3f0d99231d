"""Host slots for the blocks of requests preempted by swap (--preemption-mode swap / auto,
--swap-space GiB): the scheduler lists (device block, slot) copies in the plan that preempts
(its blocks held until that plan is collected) and (slot, device block) copies in the plan that
resumes; the runner moves the bytes (runner/kv_copies.py), every plan's copies out before its
copies in. A slot a plan reads is given back only when the next
schedule starts, so no copy out of the same plan overwrites it first."""

from __future__ import annotations

SWAP_MIN_TOKENS = 512  # auto: a preempted context this long or longer is swapped, a shorter one recomputed


class SwapSpace:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))
        self.returned: list[int] = []  # given back during the plan being built

    def take(self, n: int) -> list[int] | None:
        """n slots, or None when fewer are free (the request is recomputed instead)."""
        if n > len(self.free):
            return None
        taken, self.free = self.free[len(self.free) - n:], self.free[:len(self.free) - n]
        return taken

    def give_back(self, slots: list[int]) -> None:
        self.returned += slots

    def new_plan(self) -> None:
        self.free += self.returned
        self.returned = []

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.returned)
