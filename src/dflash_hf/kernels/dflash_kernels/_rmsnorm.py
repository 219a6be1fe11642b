"""RMSNorm over the last dimension, rounding where `DFlashRMSNorm` rounds (normalised value -> input dtype)."""

import torch
import triton
import triton.language as tl

from ._common import next_pow2, prepare

MAX_BLOCK = 8192


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, eps, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * N
    out_row = out_ptr + row * N
    in_ty = x_ptr.dtype.element_ty
    out_ty = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        ok = offs < N
        x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        y = (x * rstd).to(in_ty).to(tl.float32) * w
        tl.store(out_row + offs, y.to(out_ty), mask=ok)
    else:
        squares = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, N, BLOCK):
            ok = start + offs < N
            x = tl.load(x_row + start + offs, mask=ok, other=0.0).to(tl.float32)
            squares += x * x
        rstd = tl.rsqrt(tl.sum(squares, 0) / N + eps)
        for start in range(0, N, BLOCK):
            ok = start + offs < N
            x = tl.load(x_row + start + offs, mask=ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + start + offs, mask=ok, other=0.0).to(tl.float32)
            y = (x * rstd).to(in_ty).to(tl.float32) * w
            tl.store(out_row + start + offs, y.to(out_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    width = x.shape[-1]
    xc, wc = prepare(x), prepare(weight)
    out = torch.empty(xc.shape, dtype=torch.promote_types(xc.dtype, wc.dtype), device=x.device)
    rows = xc.numel() // width if width else 0
    if rows:
        block = min(next_pow2(width), MAX_BLOCK)
        _rms_norm_kernel[(rows,)](
            xc, wc, out, width, float(eps), BLOCK=block, ONE_PASS=block >= width, num_warps=4 if block <= 2048 else 8
        )
    return out.to(out_dtype)
