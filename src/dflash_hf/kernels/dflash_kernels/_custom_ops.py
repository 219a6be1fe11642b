"""The kernels as `torch.library` custom ops, with fake implementations so they trace under torch.compile.

The op namespace is derived from this module's import name and file: the `kernels` loader imports each copy (Hub
snapshot, local build, the package's own folder) separately, and two copies must not register the same op.
"""

import hashlib

import torch

from . import _context_kv, _markov, _rmsnorm, _selector

NAMESPACE = "dflash_kernels_" + hashlib.sha1(f"{__name__}:{__file__}".encode()).hexdigest()[:12]


def _op(name: str):
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())


@_op("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, same rounding as `DFlashRMSNorm`."""
    return _rmsnorm.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@_op("context_kv")
def context_kv(
    x: torch.Tensor,
    k_weight: torch.Tensor,
    v_weight: torch.Tensor,
    k_bias: torch.Tensor | None,
    v_bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context K/V of all draft layers: [B, C, H] -> two [L, B, KVH, C, D] tensors (see `reference.context_kv`)."""
    if (k_bias is None) != (v_bias is None):
        raise ValueError("context_kv takes both k_bias and v_bias or neither (attention_bias covers both).")
    return _context_kv.context_kv(x, k_weight, v_weight, k_bias, v_bias, norm_weight, cos, sin, eps)


@context_kv.register_fake
def _(x, k_weight, v_weight, k_bias, v_bias, norm_weight, cos, sin, eps):
    layers, width = k_weight.shape[:2]
    head_dim = norm_weight.shape[-1]
    shape = (layers, x.shape[0], width // head_dim, x.shape[1], head_dim)
    k_dtype = torch.promote_types(torch.promote_types(x.dtype, norm_weight.dtype), cos.dtype)
    return x.new_empty(shape, dtype=k_dtype), x.new_empty(shape)


@_op("markov_walk")
def markov_walk(
    base_logits: torch.Tensor,
    hidden: torch.Tensor,
    anchor_ids: torch.Tensor,
    w1: torch.Tensor | None,
    w2: torch.Tensor | None,
    d2t: torch.Tensor | None,
    conf_weight: torch.Tensor | None,
    conf_bias: torch.Tensor | None,
    uniforms: torch.Tensor | None,
    temperature: float,
    conf_with_markov: bool,
    return_logits: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DSpark's walk over one block: (ids, logits, confidence, survival); see `reference.markov_walk`."""
    if (w1 is None) != (w2 is None):
        raise ValueError("markov_walk takes both Markov weights (w1, w2) or neither.")
    return _markov.markov_walk(base_logits, hidden, anchor_ids, w1, w2, d2t, conf_weight, conf_bias, uniforms,
                               temperature, conf_with_markov, return_logits)


@markov_walk.register_fake
def _(base_logits, hidden, anchor_ids, w1, w2, d2t, conf_weight, conf_bias, uniforms, temperature, conf_with_markov,
      return_logits):
    batch, num, vocab = base_logits.shape
    logits = base_logits.new_empty((batch, num, vocab) if return_logits else (0,), dtype=torch.float32)
    confidence = base_logits.new_empty((batch, num) if conf_weight is not None else (0,), dtype=torch.float32)
    return (base_logits.new_empty((batch, num), dtype=torch.long), logits, confidence,
            confidence.new_empty(confidence.shape))


@_op("selector_walk")
def selector_walk(
    unary: torch.Tensor,
    candidates: torch.Tensor,
    projected: torch.Tensor,
    predecessor: torch.Tensor,
    successor: torch.Tensor,
    anchor_ids: torch.Tensor,
    uniforms: torch.Tensor | None,
    temperature: float,
    return_scores: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DFlash 2's candidate walk over one block: (ids, scores); see `reference.selector_walk`."""
    if candidates.shape != unary.shape:
        raise ValueError(f"selector_walk: candidates {tuple(candidates.shape)} and unary {tuple(unary.shape)} differ.")
    return _selector.selector_walk(unary, candidates, projected, predecessor, successor, anchor_ids, uniforms,
                                   temperature, return_scores)


@selector_walk.register_fake
def _(unary, candidates, projected, predecessor, successor, anchor_ids, uniforms, temperature, return_scores):
    batch, num, top_k = unary.shape
    scores = unary.new_empty((batch, num, top_k) if return_scores else (0,), dtype=torch.float32)
    return unary.new_empty((batch, num), dtype=torch.long), scores
