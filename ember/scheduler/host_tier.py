"""A host-memory tier under the prefix cache (--kv-offload-gib): the blocks the device pool's
prefix cache evicts are copied to host memory instead of forgotten, and a prefix match that
runs past the device's cached blocks continues here; those blocks come back to freshly
allocated device blocks before the step that needs them (SGLang's HiCache, vLLM's CPU
offloading).

Blocks are keyed by a chain hash of their tokens and everything before them (and the request's
cache_salt), as vLLM's prefix-cache keys are, so a block is found whatever tree node held it.
The tier is an LRU of `num_slots` host slots. It only keeps the bookkeeping; the runner moves
the bytes (runner/kv_copies.py), in the order each plan lists them: `kv_offloads` (device block ->
host slot) before the step's forward writes into a reused block, `kv_offloads_held` (blocks
evicted ahead of need, held until the step is collected), then `kv_onloads` (host slot -> device
block). A slot a plan reads is pinned until the next schedule, so no offload of the same plan
overwrites it; on CUDA all copies run in order on one copy stream, so neither does a later plan's."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int, salt: str | None) -> list[int]:
    """The chain hash after each of the first `num_blocks` whole blocks of `token_ids`."""
    h, out = hash(("ember-kv", salt)), []
    for i in range(num_blocks):
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(h)
    return out


class HostKVTier:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slots: OrderedDict[int, int] = OrderedDict()  # chain hash -> slot, least recently used first
        self.free = list(range(num_slots - 1, -1, -1))
        self.pinned: set[int] = set()  # slots the plan being built reads
        self.offloads: list[tuple[int, int]] = []  # (device block, host slot) not yet handed to a plan
        self.num_offloaded = 0  # blocks copied to host slots, since start
        self.num_onloaded = 0  # blocks copied back for admitted requests (the scheduler counts them)

    def offload(self, chain_hash: int, block_id: int) -> bool:
        """An evicted block with this chain hash: kept (copied to a slot), unless the tier holds it.
        Whether a copy was queued."""
        if chain_hash in self.slots:
            self.slots.move_to_end(chain_hash)
            return False
        slot = self._take_slot()
        if slot is None:
            return False
        self.slots[chain_hash] = slot
        self.offloads.append((block_id, slot))
        self.num_offloaded += 1
        return True

    def _take_slot(self) -> int | None:
        if self.free:
            return self.free.pop()
        for chain_hash, slot in self.slots.items():  # the least recently used unpinned one goes
            if slot not in self.pinned:
                del self.slots[chain_hash]
                return slot
        return None

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The slots of the leading run of `hashes` the tier holds (pinned: a plan will read them)."""
        found = []
        for h in hashes:
            slot = self.slots.get(h)
            if slot is None:
                break
            self.slots.move_to_end(h)
            found.append(slot)
        self.pinned.update(found)
        return found

    def new_plan(self) -> None:
        """A schedule starts: the last plan's reads are queued on the device already."""
        self.pinned.clear()

    def take_offloads(self) -> list[tuple[int, int]]:
        out, self.offloads = self.offloads, []
        return out

    def drop_offloads(self) -> None:
        """Forget the blocks queued for a copy that no plan will make (the device pool is being
        freed: /sleep): their slots hold nothing yet, so their hashes must not be found."""
        queued = {slot for _, slot in self.offloads}
        for chain_hash in [h for h, slot in self.slots.items() if slot in queued]:
            del self.slots[chain_hash]
        self.free.extend(sorted(queued, reverse=True))
        self.num_offloaded -= len(self.offloads)
        self.offloads = []
