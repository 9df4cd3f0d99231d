"""Triton 3.6's interpreter turns a loop bound into an int with `int(array)`, which
NumPy >= 2.4 refuses for its one-element arrays (every interpreter scalar is one): the
kernels' runtime-bounded `for` loops then fail on the CPU only. Read the one element."""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    triton = pytest.importorskip("triton")
    from triton.runtime import interpreter

    _patch = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_lang_tensor
