"""Three fixes to Triton 3.6's interpreter, so the kernels run on the CPU as they do on a GPU,
applied on import where TRITON_INTERPRET is 1 and triton is installed (tests/kernels' conftest
imports it; a test elsewhere that runs the fused MoE kernels' loops, or spawns ranks that do,
imports it too).

1. It turns a loop bound into an int with `int(array)`, which NumPy >= 2.4 refuses for its
   one-element arrays (every interpreter scalar is one): the kernels' runtime-bounded `for`
   loops then fail on the CPU only. Read the one element.
2. Its float -> float8e4nv conversion drops the carry when rounding up crosses a power of
   two (1.9973 becomes 1.0 instead of 2.0; ~2% of random values are off by a factor 2),
   and reads the e4m3fn NaN code as 480. The GPU converts with cvt.rn.satfinite (round to
   nearest even), as torch does: convert fp8 through torch instead.
3. Its float32 -> bfloat16 conversion truncates the mantissa; the GPU's (cvt.rn) rounds to
   nearest even, as torch does: convert it through torch too.

And two for speed:
1. A launch patches triton.language with the interpreter's builtins and restores it after its
   last program, but every call of a @triton.jit device function patches it all over again
   (inspect.getmembers on the language, thousands of calls a launch: measured 4-15 % of an
   interpreted test's CPU time). Inside a launch that already patched the modules a device
   function sees, its call patches nothing more; any other call patches as before, and what it
   patched (triton.language.core, for Triton's own tl.sum / tl.max / tl.zeros / tl.cdiv: the
   interpreter never restores a device call's patches) counts as patched for the launch's rest.
2. Each integer +, - and * computes Triton's overflow check (both operands cast to int64, the op
   again, two compares) for a device_assert that asserts only in debug mode, and the
   interpreter's options are never in debug mode: the check's result is thrown away (measured
   ~40 % of an interpreted decode kernel's CPU time). The interpreter skips computing it."""

import importlib.util
import os

if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    _patch = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_lang_tensor

    _convert_float = interpreter._convert_float
    _TORCH = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
              tl.float8e4nv: torch.float8_e4m3fn}

    def _convert_float_fp8(data, input_dtype, output_dtype, rounding_mode):
        downcast = input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode is None
        if tl.float8e4nv not in (input_dtype, output_dtype) and not downcast:
            return _convert_float(data, input_dtype, output_dtype, rounding_mode)
        # the interpreter keeps bfloat16 as uint16 and fp8 as uint8: reinterpret the bits
        bits = torch.from_numpy(np.ascontiguousarray(data).reshape(-1)).view(_TORCH[input_dtype])
        out = bits.to(_TORCH[output_dtype])
        width = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}[out.element_size()]
        return out.view(width).numpy().reshape(np.shape(data))

    interpreter._convert_float = _convert_float_fp8

    def _bf16_as_float32(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = (np.ascontiguousarray(handle.data).astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    _create_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return _create_dot(self, _bf16_as_float32(a), _bf16_as_float32(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot

    _patch_lang = interpreter._patch_lang
    _launch_langs: set = set()  # the language modules the running launch patched

    def _patch_lang_once(fn):
        langs = {v for v in fn.__globals__.values() if v is tl or v is tl.core}
        if _launch_langs and langs <= _launch_langs:
            return interpreter._LangPatchScope()  # a device function's call inside the launch
        scope = _patch_lang(fn)
        if not _launch_langs:  # a launch (device functions run only inside one): until it restores
            _launch_langs.update(langs)
            restore = scope.restore

            def restore_and_forget():
                restore()
                _launch_langs.clear()

            scope.restore = restore_and_forget
        else:  # a device function that sees a module the launch did not patch (triton.language.core, as
            # tl.sum / tl.max / tl.zeros / tl.cdiv do): its patch stays (the interpreter drops a device
            # call's scope unrestored), so the launch's later calls need not patch it again
            _launch_langs.update(langs)
        return scope

    interpreter._patch_lang = _patch_lang_once

    from triton.language.semantic import TritonSemantic

    _sanitize_overflow = TritonSemantic.binary_op_sanitize_overflow_impl

    def binary_op_sanitize_overflow_impl(self, lhs, rhs, binary_op):
        if isinstance(self.builder, interpreter.InterpreterBuilder) and not self.builder.options.debug:
            return  # the check's device_assert asserts only in debug mode, which the interpreter never is
        return _sanitize_overflow(self, lhs, rhs, binary_op)

    TritonSemantic.binary_op_sanitize_overflow_impl = binary_op_sanitize_overflow_impl
