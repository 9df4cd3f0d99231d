"""layers/transfer.py: host arrays joined onto the device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.layers.transfer import join_to_device


def _arrays() -> list[np.ndarray]:
    """Read-only, as the image processor's cache keeps its patches."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((n, 6)).astype(np.float32) for n in (3, 1, 5)]
    for a in arrays:
        a.flags.writeable = False
    return arrays


def _same_shape() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.standard_normal((2, 3, 4)).astype(np.float32) for _ in range(3)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.filterwarnings("error")
def test_joined_arrays_arrive_as_numpy_joins_them(device):
    dev = torch.device(device)
    joined = join_to_device(_arrays(), dev)
    assert joined.device.type == device and joined.dtype == torch.float32
    assert torch.equal(joined.cpu(), torch.from_numpy(np.concatenate(_arrays())))
    stacked = join_to_device(_same_shape(), dev, torch.bfloat16, stack=True)
    assert stacked.shape == (3, 2, 3, 4) and stacked.dtype == torch.bfloat16
    assert torch.equal(stacked.cpu(), torch.from_numpy(np.stack(_same_shape())).to(torch.bfloat16))
