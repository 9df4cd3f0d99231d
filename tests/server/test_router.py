"""`ember router`: the cache-aware policy (pure, exact expectations), then end to end: two
real `ember serve` workers on the default model behind a real router process, driven by the
official `openai` client."""

from __future__ import annotations

import pytest

from ember.router.policy import CacheAwarePolicy, NoHealthyWorker, PolicyConfig, PrefixTree

A, B, C = "http://a", "http://b", "http://c"
SYSTEM = "You are a helpful assistant who answers in one short sentence. "  # 64 characters


# ---- the prefix tree ---------------------------------------------------------------------


def test_prefix_tree_matches_the_longest_prefix_it_holds():
    t = PrefixTree(max_chars=1000)
    assert t.match("hello") == 0
    t.insert("hello world")
    t.insert("hello there")  # splits the edge after "hello "
    t.insert("help")
    assert t.size == len("hel") + len("lo ") + len("world") + len("there") + len("p")
    assert [t.match(s) for s in ["hello world", "hello world!", "hello wx", "hello", "helium", "x", ""]] == \
        [11, 11, 7, 5, 3, 0, 0]
    t.insert("hello")  # inside an edge: a split, no new characters
    assert t.size == 17 and t.match("hello") == 5


def test_prefix_tree_evicts_the_least_recently_used_leaves_first():
    t = PrefixTree(max_chars=12)
    t.insert("aaaa1111")  # 8
    t.insert("bbbb")  # 12: full
    t.insert("aaaa2222")  # "aaaa" is used again; 16 > 12: the oldest leaf, "1111", goes
    assert (t.size, t.match("aaaa1111"), t.match("bbbb"), t.match("aaaa2222")) == (12, 4, 4, 8)
    t.insert("bbbb")  # used again: now "2222" is the oldest leaf
    t.insert("cc")  # 14 > 12: "2222" goes; "aaaa" becomes a leaf, but 10 fits
    assert (t.size, t.match("aaaa2222"), t.match("aaaa"), t.match("bbbb"), t.match("cc")) == (10, 4, 4, 4, 2)
    t.insert("dddddddd")  # 18: "aaaa" (the oldest), then "bbbb"
    assert (t.size, t.match("aaaa"), t.match("bbbb"), t.match("cc"), t.match("dddddddd")) == (10, 0, 0, 2, 8)
    t.clear()
    assert (t.size, t.match("cc")) == (0, 0)


def test_prefix_tree_refuses_a_size_of_zero():
    with pytest.raises(ValueError, match="max_chars must be positive"):
        PrefixTree(0)


# ---- the policy --------------------------------------------------------------------------


def _urls(policy: CacheAwarePolicy, texts: list[str], finish: bool = True) -> list[str]:
    out = []
    for text in texts:
        w = policy.route(text)
        out.append(w.url)
        if finish:
            policy.finished(w)
    return out


def test_new_prefixes_spread_and_a_shared_prefix_follows_its_worker():
    policy = CacheAwarePolicy([A, B, C])
    convs = [SYSTEM + f"conversation {i}: hello" for i in range(3)]
    # idle workers with empty trees: the first listed; then the one with the smallest tree
    assert _urls(policy, [convs[0], "other text entirely", convs[1]]) == [A, B, A]
    # convs[1] matches A for 64 + 13 of 86 chars (>= 0.5): A; a follow-up turn of each conversation goes where it began
    assert _urls(policy, [convs[1] + " and more", convs[0] + " again", "other text entirely, a second turn"]) == [A, A, B]
    assert [(w.routed, w.cache_routed) for w in policy.workers] == [(4, 3), (2, 1), (0, 0)]


def test_the_cache_threshold_decides_between_the_match_and_the_least_loaded():
    text = "x" * 50 + "y" * 50
    for threshold, expected in [(0.5, A), (0.51, B)]:  # A holds exactly half of the text
        policy = CacheAwarePolicy([A, B], PolicyConfig(cache_threshold=threshold))
        policy.worker(A).tree.insert("x" * 50)
        assert _urls(policy, [text]) == [expected]
    # below the threshold, the least loaded wins even over a longer match
    policy = CacheAwarePolicy([A, B], PolicyConfig(cache_threshold=0.9))
    policy.worker(A).tree.insert("x" * 80)
    policy.worker(B).tree.insert("x" * 10)
    busy = policy.route("z")  # B: A's tree is larger
    assert busy.url == B
    assert _urls(policy, [text]) == [A]  # A: no request in flight


def test_equal_matches_go_to_the_least_loaded_then_the_first_listed():
    policy = CacheAwarePolicy([A, B, C])
    for w in policy.workers:
        w.tree.insert(SYSTEM)
    assert _urls(policy, [SYSTEM + "q"], finish=False) == [A]  # all equal: the first; A now has 1 in flight
    assert _urls(policy, [SYSTEM + "r"], finish=False) == [B]
    assert _urls(policy, [SYSTEM + "s"], finish=False) == [C]
    assert _urls(policy, [SYSTEM + "q!"], finish=False) == [A]  # the longest match beats a lower load


def test_imbalanced_loads_fall_back_to_the_shortest_queue():
    policy = CacheAwarePolicy([A, B], PolicyConfig(balance_abs_threshold=4, balance_rel_threshold=2.0))
    # one long conversation keeps going to A while B is idle: A's queue grows
    assert _urls(policy, [SYSTEM + f"turn {i}" for i in range(5)], finish=False) == [A] * 5
    # A: 5 in flight, B: 0; 5 - 0 > 4 and 5 > 2 x 0: imbalanced, the next goes to B despite the match
    assert _urls(policy, [SYSTEM + "turn 5"], finish=False) == [B]
    # 5 vs 1: 4 is not > 4: balanced again; A holds the longest prefix (all of "turn 4"), B only "turn "
    assert _urls(policy, [SYSTEM + "turn 4, more"], finish=False) == [A]
    # 6 vs 1: 5 > 4 and 6 > 2 x 1: imbalanced
    assert _urls(policy, [SYSTEM + "turn 4, more again"], finish=False) == [B]
    assert (policy.worker(A).in_flight, policy.worker(B).in_flight) == (6, 2)
    # equal matches ("turn " on both): the less loaded
    assert _urls(policy, [SYSTEM + "turn 9"], finish=False) == [B]


def test_the_relative_threshold_alone_keeps_loads_balanced():
    policy = CacheAwarePolicy([A, B], PolicyConfig(balance_abs_threshold=2, balance_rel_threshold=3.0))
    for w in (A, B):
        policy.worker(w).in_flight = {A: 9, B: 3}[w]
    policy.worker(A).tree.insert(SYSTEM)
    assert _urls(policy, [SYSTEM]) == [A]  # 9 - 3 > 2 but 9 is not > 3 x 3: the match decides
    policy.worker(B).in_flight = 2
    assert _urls(policy, [SYSTEM]) == [B]  # 9 - 2 > 2 and 9 > 6: shortest queue


def test_a_worker_out_of_rotation_gets_nothing_and_forgets_its_cache():
    policy = CacheAwarePolicy([A, B])
    assert _urls(policy, [SYSTEM]) == [A]
    policy.mark_down(policy.worker(A))
    assert _urls(policy, [SYSTEM, SYSTEM]) == [B, B]
    assert policy.worker(A).tree.size == 0
    policy.mark_up(policy.worker(A))
    assert _urls(policy, [SYSTEM, "new"]) == [B, A]  # B holds the prefix; A is back for new text
    assert policy.route(SYSTEM, exclude=frozenset({B})).url == A
    policy.mark_down(policy.worker(A))
    policy.mark_down(policy.worker(B))
    with pytest.raises(NoHealthyWorker):
        policy.route(SYSTEM)


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="at least one worker"):
        CacheAwarePolicy([])
    with pytest.raises(ValueError, match="listed twice"):
        CacheAwarePolicy([A, A])
    with pytest.raises(ValueError, match="cache_threshold"):
        PolicyConfig(cache_threshold=1.5)
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        PolicyConfig(balance_rel_threshold=0.5)
