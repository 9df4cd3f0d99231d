"""The per-request state of a model's recurrent layers (Qwen3-Next's gated DeltaNet), beside the
paged KV cache of its attention layers.

A request owns one slot of every linear layer's conv state and recurrent state while it runs:
it takes a free slot with its first chunk, zeroed, or filled from a snapshot where a prefix-cache
hit lets it start later (a prompt's later chunks and its decode steps carry on from the state the
last one left), and gives it back when it finishes, is aborted or fails (ModelRunner.release) or
is preempted (ModelRunner.launch: it starts again, into a fresh slot). The scheduler holds a seat
for every running request until it leaves (Scheduler.hold_seats), so at most max_num_seqs
requests hold slots, and there are max_num_seqs slots: the memory is fixed when the engine starts,
apart from the KV pool's.

A state cannot be rebuilt from a prefix's KV blocks, so with the prefix cache on the runner also
keeps snapshot slots (`keep_snapshots`): copies of a request's state where a chunk of it ended on
a block boundary (`save`, after the step's forward), which a later request with that prefix starts
from (`slot`, before the forward). Which snapshot holds which prefix is the scheduler's
bookkeeping (scheduler/state_snapshots.py); here they are only tensors and copies.

    conv       [linear layers, slots, conv_dim, kernel - 1]       model dtype
    recurrent  [linear layers, slots, heads, dk, dv]               float32
    snapshots  the same two, [linear layers, snapshots, ...]
"""

from __future__ import annotations

import torch

from ember.layers.transfer import to_device
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
        self.keep_snapshots(0)
        self._starts: list[tuple[int, int | None]] = []  # slots taken this step: (slot, snapshot or None: zeroed)

    @staticmethod
    def bytes_per_slot(layers: list[GatedDeltaNet], dtype: torch.dtype) -> int:
        conv, recurrent = layers[0].state_shapes
        return len(layers) * (conv[0] * conv[1] * dtype.itemsize + recurrent[0] * recurrent[1] * recurrent[2] * 4)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    @property
    def snapshot_bytes(self) -> int:
        return self.snapshot_conv.nbytes + self.snapshot_recurrent.nbytes

    def keep_snapshots(self, num_snapshots: int) -> None:
        """Room for `num_snapshots` copies of a slot (uninitialized: each is saved before it is read)."""
        self.snapshot_conv = torch.empty(self.conv.shape[0], num_snapshots, *self.conv.shape[2:],
                                         dtype=self.conv.dtype, device=self.conv.device)
        self.snapshot_recurrent = torch.empty(self.recurrent.shape[0], num_snapshots, *self.recurrent.shape[2:],
                                              dtype=self.recurrent.dtype, device=self.recurrent.device)
        self.num_snapshots = num_snapshots

    @property
    def num_in_use(self) -> int:
        return len(self.slots)

    def slot(self, request_id: str, start: int, snapshot: int | None = None) -> int:
        """The request's slot for a chunk from token `start`: at 0 a slot that starts from zero,
        given `snapshot` one that starts from it (a prefix-cache hit), else the one it holds. A
        slot's start is set by `start_slots`, before the forward."""
        slot = self.slots.get(request_id)
        if start == 0 or snapshot is not None:
            if slot is None:
                if not self.free:
                    raise RuntimeError(f"no free recurrent-state slot for request {request_id!r}: all "
                                       f"{self.num_slots} are held (more running requests than max_num_seqs)")
                slot = self.slots[request_id] = self.free.pop()
            self._starts.append((slot, snapshot))
            return slot
        if slot is None:
            raise RuntimeError(f"request {request_id!r} resumes at token {start} without a recurrent state and "
                               "no snapshot to start from")
        return slot

    def start_slots(self) -> None:
        """Zero the slots taken this step from token 0; fill those that start from a snapshot."""
        zeroed = [slot for slot, snapshot in self._starts if snapshot is None]
        restored = [(slot, snapshot) for slot, snapshot in self._starts if snapshot is not None]
        self._starts = []
        if zeroed:
            index = self._index(zeroed)
            self.conv[:, index] = 0
            self.recurrent[:, index] = 0
        if restored:
            slots, snapshots = (self._index(list(x)) for x in zip(*restored))
            self.conv[:, slots] = self.snapshot_conv[:, snapshots]
            self.recurrent[:, slots] = self.snapshot_recurrent[:, snapshots]

    def save(self, saves: list[tuple[str, int]]) -> None:
        """(request id, snapshot): copy each request's state into the snapshot (after the forward)."""
        slots, snapshots = (self._index(list(x)) for x in zip(*[(self.slots[r], s) for r, s in saves]))
        self.snapshot_conv[:, snapshots] = self.conv[:, slots]
        self.snapshot_recurrent[:, snapshots] = self.recurrent[:, slots]

    def _index(self, ids: list[int]) -> torch.Tensor:
        return to_device(ids, self.conv.device, torch.int64)

    def release(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)
