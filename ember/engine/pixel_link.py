"""Each image's pixels cross to the engine core's process once, not once a request: an image
that many requests carry (the same picture in every request of a batch, in every turn of a chat)
is 18.8 MB of float32 patches at Qwen2.5-VL-7B's shape, pickled and unpickled each time.

The API process's `PixelSender` and the core's `PixelReceiver` (one a client) hold the same
least-recently-used set of image hashes, bounded in the same bytes, and change it by the same
operations in the same order: the sender as it sends each request's images, the receiver as it
takes them off the same socket. So the sender knows exactly what the receiver holds: an image
it holds goes without its pixels (pixel_values None), and the receiver puts them back.
"""

from __future__ import annotations

import copy
import dataclasses

from ember.multimodal.cache import BytesLRU
from ember.request import Request

PIXEL_LINK_BYTES = 256 << 20  # the receiver's pixels, per client; the sender keeps their sizes alone


class PixelSender:
    def __init__(self, max_bytes: int = PIXEL_LINK_BYTES) -> None:
        self.sent: BytesLRU[int] = BytesLRU(max_bytes, lambda nbytes: nbytes)

    def strip(self, req: Request) -> Request:
        """What to send for `req`: itself, or a copy whose images the receiver holds go without
        their pixels. Call it in send order (the receiver follows it)."""
        if not req.mm_features:
            return req
        features = []
        for f in req.mm_features:
            if self.sent.get(f.hash) is not None:
                features.append(dataclasses.replace(f, pixel_values=None))
            else:
                self.sent.put(f.hash, f.pixel_values.nbytes)
                features.append(f)
        if all(a is b for a, b in zip(features, req.mm_features)):
            return req
        sent = copy.copy(req)  # the caller's request keeps its pixels
        sent.mm_features = features
        return sent


class PixelReceiver:
    def __init__(self, max_bytes: int = PIXEL_LINK_BYTES) -> None:
        self.held: BytesLRU = BytesLRU(max_bytes, lambda pixels: pixels.nbytes)

    def fill(self, req: Request) -> None:
        """Put back the pixels `req`'s images came without; keep those it brought. ValueError if
        one is missing (the two sides out of step: a bug, which fails this request alone)."""
        if not req.mm_features:
            return
        features = []
        for f in req.mm_features:
            if f.pixel_values is None:
                pixels = self.held.get(f.hash)
                if pixels is None:
                    raise ValueError(f"image {f.hash} came without its pixels and the engine core does not hold "
                                     "them (the API process's record of them is out of step)")
                f = dataclasses.replace(f, pixel_values=pixels)
            else:
                self.held.put(f.hash, f.pixel_values)
            features.append(f)
        req.mm_features = features
