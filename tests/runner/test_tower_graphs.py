"""The vision towers' CUDA graphs (runner/tower_graphs.py). On the CPU: the packed towers' plan /
run split (a plan, made once from the grids, serves any patches of those grids: what a graph
replays) and GraphLRU's policy. On CUDA (`-m gpu`): a replayed tower's output equals the eager
one bit for bit (the same kernels), for Qwen2.5-VL's windows, Qwen3-VL's deepstack and Gemma 3's
SigLIP at padded batches; the engine's tokens with the graphs equal --enforce-eager's. And the
start-up profile's tower run at the encoder budget (ImageEmbedder.profile_inputs), on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

from ember.models.gemma3_vision import Gemma3Vision
from ember.models.qwen2_vl import Qwen2VisionTower
from ember.models.qwen3_vl import Qwen3VisionTower
from ember.models.vision_config import VisionConfig
from ember.runner.tower_graphs import GraphLRU

BASE = dict(image_token_id=0, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2, num_channels=3,
            layer_norm_eps=1e-6, text_hidden_size=64, temporal_patch_size=2, merge_size=2)
CONFIGS = {
    "qwen2_vl": VisionConfig(kind="qwen2_vl", patch_size=14, hidden_act="quick_gelu", **BASE),
    "qwen2_5_vl": VisionConfig(kind="qwen2_5_vl", patch_size=14, hidden_act="silu", window_size=56,
                               full_attention_blocks=(1,), **BASE),
    "qwen3_vl": VisionConfig(kind="qwen3_vl", patch_size=16, hidden_act="gelu_pytorch_tanh",
                             num_position_embeddings=9, deepstack_blocks=(0, 1), **BASE | {"num_layers": 3}),
}
# an image of 6 x 10 patches (Qwen2.5-VL: windows of 2 x 2 merged patches, the last column of windows
# narrower), then it beside one of 4 x 4 and a two-frame video of 4 x 6
GRIDS = [[(1, 6, 10)], [(1, 6, 10), (1, 4, 4)], [(2, 4, 6), (1, 4, 4)]]
GEMMA3 = VisionConfig(kind="gemma3", image_token_id=0, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      patch_size=8, num_channels=3, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh",
                      text_hidden_size=96, image_size=64, mm_tokens_per_image=16)


def tower(kind: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    module = (Qwen3VisionTower if kind == "qwen3_vl" else Qwen2VisionTower)(CONFIGS[kind])
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
    return module.to(device, dtype).eval()


def patches(cfg: VisionConfig, grids: list, seed: int, device: str = "cpu",
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    width = cfg.num_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sum(math.prod(g) for g in grids), width, generator=gen).to(device, dtype)


@pytest.mark.parametrize("kind", list(CONFIGS))
@torch.inference_mode()
def test_a_plan_serves_any_patches_of_its_grids(kind):
    """run(patches, plan) for a plan made once equals the forward (which plans anew) on two sets of
    patches; the forward is the path the engine's tests check against transformers."""
    vision = tower(kind)
    for grids in GRIDS:
        plan = vision.plan(grids, torch.device("cpu"))
        for seed in (1, 2):
            x = patches(vision.config, grids, seed)
            got, want = vision.run(x, plan), vision(x, grids)
            assert [o.shape for o in got] == [(math.prod(g) // 4, 64 * (1 + len(vision.config.deepstack_blocks)))
                                              for g in grids]
            for a, b in zip(got, want):
                assert torch.equal(a, b)


def test_qwen2_5_vl_plans_window_rows_and_their_inverse():
    """The window-major rows and the merged rows' way back are inverse permutations; Qwen2-VL's
    plan has neither, Qwen3-VL's has the learned positions."""
    plan = tower("qwen2_5_vl").plan([(1, 6, 10)], torch.device("cpu"))
    blocks = plan.rows.view(-1, 4)[:, 0] // 4  # each merge block's index, window-major
    assert sorted(blocks.tolist()) == list(range(15))
    assert torch.equal(blocks[plan.unorder], torch.arange(15))
    # windows of 2 x 2 merge blocks over 3 x 5 of them: 2 x 2, 2 x 2, 2 x 1, then 1 x 2, 1 x 2, 1 x 1
    assert [(count, length) for count, length, _ in plan.windows.groups] == [(2, 16), (3, 8), (1, 4)]
    assert plan.windows.bounds.tolist() == [0, 16, 32, 40, 48, 56, 60] and plan.windows.longest == 16
    assert tower("qwen2_vl").plan([(1, 6, 10)], torch.device("cpu")).rows is None
    assert tower("qwen3_vl").plan([(1, 6, 10)], torch.device("cpu")).positions.shape == (60, 32)


def test_graph_lru_runs_a_key_eagerly_then_captures_it_then_replays():
    lru = GraphLRU(max_entries=2, max_bytes=100)
    assert lru.decide("a", 10) == ("eager", [])
    assert lru.decide("b", 10) == ("eager", [])
    assert lru.decide("a", 10) == ("capture", [])
    assert lru.decide("a", 10) == ("replay", [])
    assert lru.decide("b", 10) == ("capture", [])
    assert lru.nbytes == 20


def test_graph_lru_evicts_the_least_recently_used_past_its_entries():
    lru = GraphLRU(max_entries=2, max_bytes=100)
    for key in "abcab":
        lru.decide(key, 10)  # a, b, c seen; a, b captured
    assert lru.decide("a", 10)[0] == "replay"  # b is now the least recently used
    assert lru.decide("c", 10) == ("capture", ["b"])
    assert list(lru.captured) == ["a", "c"]
    assert lru.decide("b", 10) == ("eager", [])  # dropped: seen anew


def test_graph_lru_keeps_its_static_bytes_under_the_bound():
    lru = GraphLRU(max_entries=8, max_bytes=100)
    for key, size in (("a", 40), ("b", 40), ("c", 30)):
        lru.decide(key, size)
    assert lru.decide("a", 40) == ("capture", [])
    assert lru.decide("b", 40) == ("capture", [])
    assert lru.decide("c", 30) == ("capture", ["a"])  # 40 + 40 + 30 > 100
    assert lru.nbytes == 70
    assert [lru.decide("big", 101)[0] for _ in range(3)] == ["eager"] * 3  # its buffers alone pass the bound


def test_graph_lru_remembers_a_bounded_number_of_keys_seen_once():
    lru = GraphLRU(max_entries=2, max_bytes=100, max_seen=2)
    for key in "abc":
        lru.decide(key, 1)
    assert list(lru.seen) == ["b", "c"]
    assert lru.decide("a", 1)[0] == "eager"


SMALL_TOWER = dict(image_token_id=0, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2, num_channels=3,
                   layer_norm_eps=1e-6, text_hidden_size=64)
OTHER_TOWERS = {  # kind -> (config, the dummy input the budget of 1,100 tokens makes, the rows it fills)
    "gemma3": (GEMMA3, lambda: torch.zeros(68, 3, 64, 64), 68 * 16),  # 1,100 // 16 images of 16 tokens
    "llava": (VisionConfig(kind="llava", patch_size=8, hidden_act="quick_gelu", image_size=32, drop_cls=True,
                           **SMALL_TOWER), lambda: torch.zeros(68, 3, 32, 32), 68 * 16),
    # 32 x 32 tokens, then 32 x 2 of the rest's 76; Pixtral: a break token after each row
    "pixtral": (VisionConfig(kind="pixtral", patch_size=4, hidden_act="silu", **SMALL_TOWER),
                lambda: ([(1, 32, 32), (1, 32, 2)], 3 * 16), 32 * 33 + 32 * 3),
    "mistral3": (VisionConfig(kind="mistral3", patch_size=4, hidden_act="silu", merge_size=2, **SMALL_TOWER),
                 lambda: ([(1, 64, 64), (1, 64, 4)], 3 * 16), 32 * 33 + 32 * 3),
}


def _other_tower(kind: str) -> torch.nn.Module:
    from ember.models.llava import LlavaVision
    from ember.models.pixtral import PixtralVision

    torch.manual_seed(0)
    cfg = OTHER_TOWERS[kind][0]
    vision = {"gemma3": Gemma3Vision, "llava": LlavaVision}.get(kind, PixtralVision)(cfg)
    with torch.no_grad():
        for p in vision.parameters():
            p.normal_(0, 0.2)
    return vision.eval()


@pytest.mark.parametrize("kind", [*CONFIGS, *OTHER_TOWERS])
def test_the_start_up_profile_runs_the_tower_over_its_budget_and_places_its_rows(kind):
    """ImageEmbedder.profile_inputs (the runner's start-up profile on CUDA) with a budget of 1,100
    tokens: a packed tower over an image of 32 x 32 merged patches (1,024 tokens) and one of the
    rest's (76: 32 x 2, its sides at most 32), a fixed-shape one over as many images as fit; their
    embeddings over the first rows, the tokens' own after; Qwen3-VL's deepstack rows [layers, rows,
    hidden]."""
    from ember.runner.multimodal import ImageEmbedder

    vision = tower(kind) if kind in CONFIGS else _other_tower(kind)
    hidden = vision.config.text_hidden_size
    embed = torch.nn.Embedding(16, hidden)
    images = ImageEmbedder(vision, embed, torch.device("cpu"), (0,))
    ids = torch.arange(1300) % 16
    got = images.profile_inputs(ids, 1100)
    with torch.inference_mode():
        if kind in CONFIGS:
            rows = 1024 + 64
            want = torch.cat(vision(torch.zeros(4096 + 256, 3 * 2 * vision.config.patch_size ** 2),
                                    [(1, 64, 64), (1, 64, 4)]))
        elif kind in ("gemma3", "llava"):
            rows = OTHER_TOWERS[kind][2]
            want = vision(OTHER_TOWERS[kind][1]()).flatten(0, 1)
        else:
            grids, width = OTHER_TOWERS[kind][1]()
            rows = OTHER_TOWERS[kind][2]
            want = torch.cat(vision(torch.zeros(sum(math.prod(g) for g in grids), width), grids))
        assert want.shape[0] == rows
        assert torch.equal(got.embeds[:rows], want[:, :hidden])
        assert torch.equal(got.embeds[rows:], embed(ids[rows:]))
    if kind == "qwen3_vl":
        assert got.deepstack[1].shape == (2, rows, hidden)
        assert torch.equal(got.deepstack[0], torch.arange(rows))
        assert torch.equal(got.deepstack[1][1], want[:, 2 * hidden:])
    else:
        assert got.deepstack is None


# ---- CUDA ----

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_replayed_packed_tower_equals_eager_on_cuda(kind, dtype):
    """Three grid keys (one image; two; a video's two frames and an image), each eager, then
    captured, then replayed, every output the eager forward's bits."""
    from ember.runner.tower_graphs import PackedTowerGraphs

    vision = tower(kind, "cuda", dtype)
    graphs = PackedTowerGraphs(vision, max_tokens=4096, max_bytes=1 << 30, reserve=4 << 30)
    for grids in GRIDS:
        ran = []
        for seed in range(3):  # eager, captured, replayed
            x = patches(vision.config, grids, seed, "cuda", dtype)
            with torch.inference_mode():
                outs, replayed = graphs(x, grids)
                outs = [o.clone() for o in outs]
                want = vision(x, grids)
            ran.append(replayed)
            for a, b in zip(outs, want):
                assert torch.equal(a, b)
        assert ran == [False, True, True]
    assert len(graphs.entries) == len(GRIDS) and graphs.pool_bytes > 0
    x = patches(vision.config, GRIDS[0], 9, "cuda", dtype)  # the first key again: still captured
    with torch.inference_mode():
        outs, replayed = graphs(x, GRIDS[0])
        assert replayed and all(torch.equal(a, b) for a, b in zip(outs, vision(x, GRIDS[0])))



@pytest.mark.gpu
def test_replayed_siglip_tower_equals_eager_at_padded_batches_on_cuda():
    """Gemma 3's tower captured for batches 1, 2, 4 (4 images' tokens of budget): a batch of 3
    replays the graph of 4, whose rows equal an eager batch of those 3 and a stale fourth."""
    from ember.runner.tower_graphs import tower_graphs

    torch.manual_seed(0)
    vision = Gemma3Vision(GEMMA3)
    with torch.no_grad():
        for p in vision.parameters():
            p.normal_(0, 0.2)
    vision = vision.cuda().eval()
    graphs, reserve = tower_graphs(vision, 4 * 16, torch.float32, torch.device("cuda"))
    assert reserve == 0 and graphs.sizes == [1, 2, 4]
    gen = torch.Generator().manual_seed(0)
    for n in (1, 3, 4):
        pixels = torch.randn(n, 3, 64, 64, generator=gen).cuda()
        with torch.inference_mode():
            got = graphs(pixels).clone()
            padded = torch.cat([pixels, graphs.pixels[n:next(s for s in graphs.sizes if s >= n)]])
            assert torch.equal(got, vision(padded)[:n])
            # an eager batch of n runs the matmuls at another row count: the kernels may differ in the last bits
            torch.testing.assert_close(got, vision(pixels), rtol=1e-3, atol=1e-3)
    assert graphs(torch.zeros(5, 3, 64, 64, device="cuda")) is None  # more images than captured: eager


@pytest.mark.gpu
def test_the_engine_replays_the_tower_and_its_tokens_equal_eager_on_cuda(tmp_path_factory):
    """A tiny Qwen2.5-VL: prompts with different images of one size, one at a time (each a miss of
    the encoder cache and the prefix cache): the first runs the tower eagerly, the second captures
    its grid, the rest replay; the greedy tokens equal --enforce-eager's."""
    pytest.importorskip("transformers")
    pytest.importorskip("PIL")
    from llava_model import image, word_tokenizer_dir
    from qwen_vl_model import V, save_tiny_qwen_vl

    from ember import LLM, SamplingParams

    model_dir = save_tiny_qwen_vl(word_tokenizer_dir(tmp_path_factory.mktemp("words")),
                                  tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    asks = [{"prompt": f"USER What is in the picture ? {V} ASSISTANT", "multi_modal_data": {"image": [image((40 * i, 200 - 30 * i, 90), (60, 45))]}}
            for i in range(4)]
    tokens = {}
    for eager in (True, False):
        llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=512, num_kv_blocks=16,
                  enforce_eager=eager)
        tokens[eager] = [llm.generate(ask, greedy)[0].outputs[0].token_ids for ask in asks]
        images = llm.engine.runner.images
        if eager:
            assert images.graphs is None and images.num_tower_replays == 0 and images.num_tower_eager == 4
        else:
            assert (images.num_tower_eager, images.num_tower_replays) == (1, 3)
        llm.engine.check_idle()
        del llm
    assert tokens[False] == tokens[True]
    assert len({tuple(t) for t in tokens[True]}) > 1  # the images change the answer: the tower's output is read
