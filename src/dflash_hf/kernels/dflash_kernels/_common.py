"""Launch helpers shared by the kernels: interpreter detection, dtype handling, block sizes."""

import os

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

HALF_DTYPES = (torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """True under `TRITON_INTERPRET=1`, where Triton runs on the CPU through numpy."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_interpreter() -> None:
    """Fail at import, clearly, when the interpreter was switched on after triton was imported.

    Triton decides at import whether its own library functions (tl.sum, tl.max, ...) are interpreted; set later,
    TRITON_INTERPRET=1 gives interpreted kernels calling compiled helpers, which fails only at the first launch.
    """
    if interpreting() and isinstance(tl.sum, JITFunction):
        raise ImportError(
            "TRITON_INTERPRET=1 was set after triton was imported (torch and transformers import it): set it in the "
            "environment before the process starts."
        )


check_interpreter()


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The interpreter has no bf16/fp16 arithmetic (and rounds casts toward zero): run half inputs in fp32 there."""
    if interpreting() and dtype in HALF_DTYPES:
        return torch.float32
    return dtype


def prepare(t: torch.Tensor | None) -> torch.Tensor | None:
    """Contiguous, and upcast to fp32 under the interpreter when it is a half-precision float tensor."""
    if t is None:
        return None
    if t.is_floating_point():
        t = t.to(compute_dtype(t.dtype))
    return t.contiguous()


def dot_precision(dtype: torch.dtype) -> str | None:
    """`tl.dot` precision that reproduces torch's own matmul: IEEE fp32 unless torch itself allows TF32."""
    if dtype != torch.float32:
        return None
    if interpreting() or not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"
