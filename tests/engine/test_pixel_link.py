"""Pixels cross to the engine core's process once an image (engine/pixel_link.py): the sender
strips an image the receiver holds, the receiver puts it back, and both evict the same images
in the same order, so a stripped image always finds its pixels."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from ember.engine.pixel_link import PixelReceiver, PixelSender
from ember.multimodal.inputs import ImageFeature, pixels_hash
from ember.request import Request
from ember.sampling_params import SamplingParams


def image(seed: int, patches: int = 4) -> ImageFeature:
    pixels = np.random.default_rng(seed).standard_normal((patches, 8), dtype=np.float32)  # 32 bytes a patch
    return ImageFeature(offset=1, length=patches, hash=pixels_hash(pixels), pixel_values=pixels)


def request(request_id: str, *features: ImageFeature) -> Request:
    return Request(request_id, [0] * 10, SamplingParams(max_tokens=1), mm_features=list(features))


def through(sender: PixelSender, receiver: PixelReceiver, req: Request) -> tuple[Request, list[bool]]:
    """`req` as the core gets it (pickled both ways), and which of its images came stripped."""
    got = pickle.loads(pickle.dumps(sender.strip(req)))
    stripped = [f.pixel_values is None for f in got.mm_features]
    receiver.fill(got)
    return got, stripped


def test_an_image_crosses_once_and_every_request_gets_its_pixels():
    a, b, c = image(1), image(2), image(3, patches=8)  # 128, 128 and 256 bytes
    sender, receiver = PixelSender(max_bytes=400), PixelReceiver(max_bytes=400)
    sent = []
    for i, features in enumerate([(a,), (a, b), (a, a), (c,), (b,), (a,), (c, b)]):
        req = request(f"r{i}", *features)
        got, stripped = through(sender, receiver, req)
        sent.append(stripped)
        for mine, theirs in zip(req.mm_features, got.mm_features):
            np.testing.assert_array_equal(theirs.pixel_values, mine.pixel_values)
            assert (theirs.hash, theirs.offset, theirs.length) == (mine.hash, mine.offset, mine.length)
        assert all(f.pixel_values is not None for f in req.mm_features)  # the caller's request keeps its pixels
    # 400 bytes hold two of them: c pushes out b (a was used since), b then a, a then c; in r6 c pushes out b
    # and b then a: each side evicted the same image at the same point, so nothing stripped went missing
    assert sent == [[False], [True, False], [True, True], [False], [False], [False], [False, False]]
    assert list(receiver.held._entries) == list(sender.sent._entries) == [c.hash, b.hash]


def test_a_receiver_out_of_step_fails_the_request_by_name():
    a = image(1)
    sender = PixelSender()
    sender.strip(request("r0", a))  # sent, but never received
    stripped = sender.strip(request("r1", a))
    with pytest.raises(ValueError, match="came without its pixels and the engine core does not hold them"):
        PixelReceiver().fill(stripped)
