"""The kernel tests run on Triton 3.6's interpreter with its fixes (tests/triton_interpreter.py)."""

import triton_interpreter  # noqa: F401
