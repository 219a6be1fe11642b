"""Verify forwards of a few rows on a CPU in float32: the target's linear layers read each weight once.

A Hub remote-code file (torch only). A decode step multiplies one row by every weight, a memory-bound GEMV. A verify
of k + 1 rows runs `x @ W.T` as a GEMM, and with MKL on an AMD EPYC (no AMX) a GEMM of 2 to 5 rows costs far more
than the GEMV: a SmolLM2-135M forward of 2 rows took 98 ms where a decode took 61. The same product computed as
`(W @ x.T).T`, the weight as the tall left operand, streams the weight once: 49 ms for 2 rows, 66 for 4 (89 for 5,
against 100; from 6 rows on the GEMM is as fast). That moves a verify from 1.6 decodes to about one, which is what
lets speculation pay on such a CPU.

Only verify forwards switch, and only while the generator says one is in flight: the prefill and every plain decode
step run `F.linear` exactly as `generate` without a draft does. Numerically the product differs from `F.linear`'s
multi-row GEMM by float32 rounding, as that GEMM already differs from the one-row GEMV of a decode (about 1e-7
relative): greedy output stays the target's except on a near-tie, as for any float32 verify. In bfloat16 nothing
switches (oneDNN's bf16 matmuls are row-invariant there and exactness rests on it), nor on GPUs, nor for layers
that are not plain `nn.Linear` (quantized, offloaded by accelerate, already wrapped). A draft's own head, whose
numbers need no such care, always takes the faster product (`linear`): a DFlash draft proposing 3 slots multiplies 3
rows by the target's whole vocabulary head, one proposing a single slot one row.
"""

import contextvars
import threading
import types
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

# Rows per forward (over the whole batch) that go weight-first; the measured gain ends at about 6 rows.
VERIFY_ROWS = range(2, 6)
# One row by a weight of at least this many elements (32 MiB in float32, past the last-level cache) is cheaper as
# two: MKL's one-row GEMV streamed a draft's 49k x 576 head in 11-13 ms, its two-column product in 6 (AMD EPYC); at
# 4k x 576, which the caches hold, the GEMV is faster.
LARGE_WEIGHT = 1 << 23
VERIFY_MATMULS = ("auto", "linear")  # `dflash_verify_matmul`: auto = as above on CPU float32; linear = F.linear always

_verifying: contextvars.ContextVar = contextvars.ContextVar("dflash_verifying", default=False)
_live_calls: dict[int, int] = {}  # id(target) -> generate calls that installed the layers and have not ended
_lock = threading.Lock()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, computed weight-first where that is the faster product of float32 on a CPU: 2-5 rows, and one
    row by a weight larger than the caches (taken as two equal rows; only drafts' heads multiply one so)."""
    rows = x.numel() // x.shape[-1]
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return F.linear(x, weight, bias)
    if rows == 1 and weight.numel() >= LARGE_WEIGHT:
        out = torch.mm(weight, x.reshape(1, -1).repeat(2, 1).t())[:, :1].t().contiguous()
    elif rows in VERIFY_ROWS:
        out = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()
    else:
        return F.linear(x, weight, bias)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _verify_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if _verifying.get():
        return linear(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def _switchable(module: nn.Module) -> bool:
    return (type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32
            and "forward" not in vars(module) and not hasattr(module, "_hf_hook"))


@contextmanager
def verify_matmuls(target: nn.Module, mode: str | None = "auto"):
    """For one generate call: let the target's eligible linear layers go weight-stationary during verify forwards
    (`verifying`). Calls may overlap, in threads: the layers are restored when the last one ends."""
    mode = mode or "auto"
    if mode not in VERIFY_MATMULS:
        raise ValueError(f"`dflash_verify_matmul` = {mode!r}; expected one of {VERIFY_MATMULS}.")
    if mode != "auto":
        yield
        return
    key = id(target)
    with _lock:
        if not _live_calls.get(key):
            for module in target.modules():
                if _switchable(module):
                    module.forward = types.MethodType(_verify_forward, module)
        _live_calls[key] = _live_calls.get(key, 0) + 1
    token = _verifying.set(False)
    try:
        yield
    finally:
        _verifying.reset(token)
        with _lock:
            _live_calls[key] -= 1
            if not _live_calls[key]:
                del _live_calls[key]
                for module in target.modules():
                    if getattr(vars(module).get("forward"), "__func__", None) is _verify_forward:
                        del module.forward


def set_verifying(flag: bool) -> None:
    """Whether the next target forwards of this thread (or task) verify candidates."""
    _verifying.set(flag)


@contextmanager
def verifying(flag: bool = True):
    """`set_verifying` for the forwards inside the block."""
    token = _verifying.set(flag)
    try:
        yield
    finally:
        _verifying.reset(token)


__all__ = ["VERIFY_MATMULS", "VERIFY_ROWS", "linear", "set_verifying", "verify_matmuls", "verifying"]
