"""BlockPool: exact block ids out of the FIFO free queue, ref counts, and the integrity check.

The free queue hands blocks out from its left end and takes them back at its right end;
a list of blocks is freed last-first (its tail goes back before its head), so the
order in which freed blocks come out again is fixed and asserted here id by id.
"""

from __future__ import annotations

import pytest

from ember.scheduler.block_pool import BlockPool


def free_queue(pool: BlockPool) -> list[int]:
    return list(pool._free)


def test_fresh_pool_allocates_in_id_order():
    pool = BlockPool(8)
    assert (pool.num_free, pool.num_in_use, pool.usage) == (8, 0, 0.0)
    pool.check_integrity()
    assert pool.allocate(3) == [0, 1, 2]
    pool.check_integrity()
    assert pool.allocate(2) == [3, 4]
    pool.check_integrity()
    assert (pool.num_free, pool.num_in_use) == (3, 5)
    assert pool.usage == 5 / 8
    assert pool.ref_counts == [1, 1, 1, 1, 1, 0, 0, 0]
    assert free_queue(pool) == [5, 6, 7]


def test_freed_blocks_go_to_the_back_last_first():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert (a, b) == ([0, 1, 2], [3, 4])
    pool.free(a)
    pool.check_integrity()
    # never-used blocks first (FIFO), then a's blocks tail-first: 2, 1, 0
    assert free_queue(pool) == [5, 6, 7, 2, 1, 0]
    assert pool.ref_counts == [0, 0, 0, 1, 1, 0, 0, 0]
    assert pool.allocate(4) == [5, 6, 7, 2]
    pool.check_integrity()
    assert pool.allocate(2) == [1, 0]
    pool.check_integrity()
    assert pool.num_free == 0
    pool.free(b)
    pool.check_integrity()
    assert free_queue(pool) == [4, 3]
    assert pool.allocate(1) == [4]
    assert pool.allocate(1) == [3]
    pool.check_integrity()


def test_interleaved_frees_keep_fifo_order():
    pool = BlockPool(6)
    x = pool.allocate(2)  # [0, 1]
    y = pool.allocate(2)  # [2, 3]
    z = pool.allocate(2)  # [4, 5]
    assert (x, y, z) == ([0, 1], [2, 3], [4, 5])
    pool.free(y)
    pool.free(x)
    pool.free(z)
    pool.check_integrity()
    assert free_queue(pool) == [3, 2, 1, 0, 5, 4]
    assert pool.allocate(6) == [3, 2, 1, 0, 5, 4]
    pool.check_integrity()


def test_share_raises_ref_counts_and_the_last_owner_frees():
    pool = BlockPool(8)
    a = pool.allocate(3)  # [0, 1, 2]
    pool.share([0, 1])
    pool.check_integrity()
    assert pool.ref_counts[:3] == [2, 2, 1]
    pool.share([0])
    assert pool.ref_counts[:3] == [3, 2, 1]
    assert pool.num_in_use == 3  # sharing takes no new block

    pool.free(a)  # the first owner lets go of 0, 1, 2: only 2 had no other owner
    pool.check_integrity()
    assert pool.ref_counts[:3] == [2, 1, 0]
    assert free_queue(pool) == [3, 4, 5, 6, 7, 2]
    assert pool.num_free == 6

    pool.free([0, 1])  # second owner
    pool.check_integrity()
    assert pool.ref_counts[:3] == [1, 0, 0]
    assert free_queue(pool) == [3, 4, 5, 6, 7, 2, 1]

    pool.free([0])  # last owner
    pool.check_integrity()
    assert pool.ref_counts == [0] * 8
    assert free_queue(pool) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert pool.num_free == 8


def test_share_of_a_free_block_raises():
    pool = BlockPool(4)
    pool.allocate(1)
    with pytest.raises(AssertionError, match="block 3 is free"):
        pool.share([3])
    pool.check_integrity()


def test_freeing_a_free_block_raises():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.free(a)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([a[0]])
    pool.check_integrity()
    with pytest.raises(AssertionError, match="block 3 freed twice"):
        pool.free([3])  # never allocated
    pool.check_integrity()
    assert pool.ref_counts == [0, 0, 0, 0]


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(8)
    pool.allocate(5)
    with pytest.raises(RuntimeError, match="asked for 4 KV blocks, 3 available"):
        pool.allocate(4)
    pool.check_integrity()
    assert free_queue(pool) == [5, 6, 7]
    assert pool.allocate(3) == [5, 6, 7]
    with pytest.raises(RuntimeError, match="asked for 1 KV blocks, 0 available"):
        pool.allocate(1)
    assert pool.allocate(0) == []
    pool.check_integrity()


@pytest.mark.parametrize("n", [0, -1])
def test_an_empty_pool_is_refused(n):
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(n)


def test_check_integrity_catches_a_free_block_with_a_ref_count():
    pool = BlockPool(4)
    pool.allocate(1)
    pool.ref_counts[2] = 1  # block 2 is still in the free queue
    with pytest.raises(AssertionError, match="block 2: ref count 1, cached=False, but free=True"):
        pool.check_integrity()


def test_check_integrity_catches_a_used_block_with_no_ref_count():
    pool = BlockPool(4)
    pool.allocate(2)
    pool.ref_counts[1] = 0  # in use, yet nobody owns it
    with pytest.raises(AssertionError, match="block 1: ref count 0, cached=False, but free=False"):
        pool.check_integrity()


def test_check_integrity_catches_a_negative_ref_count():
    pool = BlockPool(4)
    pool.allocate(1)
    pool.ref_counts[0] = -1
    with pytest.raises(AssertionError, match="block 0 has ref count -1"):
        pool.check_integrity()


def test_check_integrity_catches_a_block_queued_twice():
    pool = BlockPool(4)
    pool._free.append(0)
    with pytest.raises(AssertionError, match="free queue twice"):
        pool.check_integrity()
