"""Triton kernels, each small and next to a typed wrapper that checks layouts.

Triton is imported only here and only when a kernel is used, so the engine core stays
importable with torch alone. Tests run the same kernels on the CPU under Triton's
interpreter (TRITON_INTERPRET=1, set before triton is first imported).

`cpu/` holds the CPU's C++ kernels (paged decode attention and the fused small ops),
built on first use and tested against the plain-torch code they replace.
"""
