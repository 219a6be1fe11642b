"""Torch references of every kernel, with the kernels' own signatures: the torch path of `ops_for`, and what the
kernels are tested against (here and by `gpu_check`).

Where the model computes the same thing, the reference calls the model's own function (`rms_norm`, `apply_rope`,
`markov_walk` of `modeling_dflash.py`, `selector_walk` of `modeling_dflash2.py`), so the kernels are held to the math
generation and training run. Randomness enters only through the uniforms passed in, so results are deterministic. Not
part of the Hub kernel package, which may import nothing but torch and triton.
"""

import torch
import torch.nn.functional as F

from ..layers_dflash import apply_rope, rms_norm
from ..modeling_dflash import markov_walk as model_markov_walk
from ..modeling_dflash2 import selector_walk as model_selector_walk


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
    """Context K/V of every draft layer: `k_norm(k_proj(x))` with RoPE, and `v_proj(x)`.

    x: [B, C, H] projected context; k/v_weight: [L, KVH*D, H]; k/v_bias: [L, KVH*D] or None; norm_weight: [L, D];
    cos/sin: [B, C, D] -> K, V: [L, B, KVH, C, D] (`DFlashAttention.project_kv` of each layer, stacked).
    """
    batch, length = x.shape[:2]
    head_dim = norm_weight.shape[-1]
    keys, values = [], []
    for layer in range(k_weight.shape[0]):
        k = F.linear(x, k_weight[layer], None if k_bias is None else k_bias[layer])
        v = F.linear(x, v_weight[layer], None if v_bias is None else v_bias[layer])
        k = rms_norm(k.view(batch, length, -1, head_dim), norm_weight[layer], eps).transpose(1, 2)
        v = v.view(batch, length, -1, head_dim).transpose(1, 2)
        keys.append(apply_rope(k, cos, sin))
        values.append(v)
    return torch.stack(keys), torch.stack(values)


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index drawn from unnormalised `weights` [B, V] (>= 0) with one uniform in [0, 1) per row.

    The first index whose running sum exceeds u * total; the last index with mass when rounding leaves none.
    """
    cdf = weights.cumsum(-1)
    target = uniforms.to(weights.dtype) * weights.sum(-1)
    index = torch.searchsorted(cdf, target[:, None].contiguous(), right=True)[:, 0]
    positions = torch.arange(weights.shape[-1], device=weights.device)
    last = torch.where(weights > 0, positions, -1).amax(-1).clamp_min(0)
    return torch.where(index >= weights.shape[-1], last, index)


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
    """DSpark's left-to-right walk over one block with the vanilla Markov head (`modeling_dflash.markov_walk`).

    base_logits: [B, n, Vd] fp32 draft-vocabulary logits; hidden: [B, n, Hd]; anchor_ids: [B] target ids;
    w1: [V, r] and w2: [Vd, r] Markov weights (None: no Markov bias); d2t: [Vd] offsets of a pruned vocabulary
    (target id = i + d2t[i]) or None; conf_weight: [Hd (+ r)] and conf_bias: [1] or None of the confidence head
    (None weight: no head); uniforms: [B, n] to sample (inverse CDF of softmax(logits / temperature)), None = argmax.
    Slot k's logits are base_k + W2 W1[prev_k] (scaled by 1/temperature); prev_0 is the anchor and prev_{k+1} the
    target id picked at k. Returns ids [B, n] (target vocabulary), logits [B, n, Vd] (empty unless
    return_logits), confidence [B, n] = sigmoid(conf([h_k ; W1[prev_k]])) and survival [B, n] (its running product),
    both empty without a confidence head.
    """
    batch, num, vocab = base_logits.shape

    def markov(prev, hidden_k, state):
        embedded = F.embedding(prev, w1)
        return F.linear(embedded, w2), state, embedded

    def confidence(features):
        return F.linear(features, conf_weight[None], conf_bias)[..., 0]

    def choose(k, logits_k):
        logits_k = logits_k / temperature
        if uniforms is None:
            pick = logits_k.argmax(-1)
        else:
            pick = inverse_cdf(torch.exp(logits_k - logits_k.amax(-1, keepdim=True)), uniforms[:, k])
        return (pick + d2t[pick] if d2t is not None else pick), logits_k if return_logits else None

    ids, logits, conf_logits = model_markov_walk(
        base_logits.float(), hidden, anchor_ids, None if w1 is None else markov,
        None if conf_weight is None else confidence, conf_with_markov, choose,
    )
    empty = base_logits.new_zeros(0)
    if return_logits and logits is None:
        logits = base_logits.new_zeros(batch, 0, vocab)
    if conf_logits is None:
        return ids, logits if return_logits else empty, empty, empty
    conf = torch.sigmoid(conf_logits.float())
    return ids, logits if return_logits else empty, conf, conf.cumprod(1)


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
    """DFlash 2's left-to-right candidate walk over one block (`modeling_dflash2.selector_walk`).

    unary: [B, n, K] top-K draft logits; candidates: [B, n, K] their target ids; projected: [B, n, r] the slot states
    through `hidden_projection`; predecessor, successor: [V, r] codebooks; anchor_ids: [B]; uniforms: [B, n] to sample
    (inverse CDF of softmax(scores / temperature) over the K candidates), None = argmax.
    Slot k's scores are (unary_k + <P[prev_k] * projected_k, S[c]>) / temperature; prev_0 is the anchor and
    prev_{k+1} the candidate picked at k. Returns ids [B, n] and the scores [B, n, K] (empty unless return_scores).
    """
    batch, num, top_k = unary.shape

    def choose(k, scores, cands):
        scores = scores / temperature
        if uniforms is None:
            pick = scores.argmax(-1)
        else:
            pick = inverse_cdf(torch.exp(scores - scores.amax(-1, keepdim=True)), uniforms[:, k])
        return cands.gather(1, pick[:, None])[:, 0], scores if return_scores else None

    ids, scores = model_selector_walk(unary.float(), candidates, projected, predecessor, successor, anchor_ids, choose)
    if not return_scores:
        return ids, unary.new_zeros(0, dtype=torch.float32)
    return ids, scores if scores is not None else unary.new_zeros(batch, 0, top_k, dtype=torch.float32)
