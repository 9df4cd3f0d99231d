"""The per-request state of a model's recurrent layers (Qwen3-Next's gated DeltaNet), beside the
paged KV cache of its attention layers.

A request owns one slot of every linear layer's conv state and recurrent state while it runs:
it takes a free slot, zeroed, with the first chunk of its prompt (a prompt's later chunks and its
decode steps carry on from the state the last one left), and gives it back when it finishes,
is aborted or fails (ModelRunner.release) or is preempted (ModelRunner.launch: it recomputes
from its first token, into a fresh slot). The scheduler holds a seat for every running request
until it leaves (Scheduler.hold_seats), so at most max_num_seqs requests hold slots, and there
are max_num_seqs slots: the memory is fixed when the engine starts, apart from the KV pool's.

A state cannot be rebuilt from a prefix of tokens' blocks, so such a model runs without the
prefix cache (config.resolve turns it off) and a forked sample recomputes its prompt.

    conv       [linear layers, slots, conv_dim, kernel - 1]   model dtype
    recurrent  [linear layers, slots, heads, dk, dv]           float32
"""

from __future__ import annotations

import torch

from ember.models.gated_deltanet import GatedDeltaNet


class RecurrentStates:
    def __init__(self, layers: list[GatedDeltaNet], num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        conv, recurrent = layers[0].state_shapes
        self.conv = torch.zeros(len(layers), num_slots, *conv, dtype=dtype, device=device)
        self.recurrent = torch.zeros(len(layers), num_slots, *recurrent, dtype=torch.float32, device=device)
        for i, layer in enumerate(layers):
            layer.conv_state, layer.recurrent_state = self.conv[i], self.recurrent[i]
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.slots: dict[str, int] = {}  # request id -> its slot

    @staticmethod
    def bytes_per_slot(layers: list[GatedDeltaNet], dtype: torch.dtype) -> int:
        conv, recurrent = layers[0].state_shapes
        return len(layers) * (conv[0] * conv[1] * dtype.itemsize + recurrent[0] * recurrent[1] * recurrent[2] * 4)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    @property
    def num_in_use(self) -> int:
        return len(self.slots)

    def slot(self, request_id: str, start: int, fresh: list[int]) -> int:
        """The request's slot for a chunk from token `start`: at 0 a slot to start from zero
        (appended to `fresh`, which the caller zeroes before the forward), else the one it holds."""
        if start == 0:
            slot = self.slots.get(request_id)
            if slot is None:
                if not self.free:
                    raise RuntimeError(f"no free recurrent-state slot for request {request_id!r}: all "
                                       f"{self.num_slots} are held (more running requests than max_num_seqs)")
                slot = self.slots[request_id] = self.free.pop()
            fresh.append(slot)
            return slot
        slot = self.slots.get(request_id)
        if slot is None:
            raise RuntimeError(f"request {request_id!r} resumes at token {start} without a recurrent state: its "
                               "state is only built from its first token (no prefix cache for this model)")
        return slot

    def zero(self, slots: list[int]) -> None:
        index = torch.tensor(slots, dtype=torch.int64, device=self.conv.device)
        self.conv[:, index] = 0
        self.recurrent[:, index] = 0

    def release(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)
