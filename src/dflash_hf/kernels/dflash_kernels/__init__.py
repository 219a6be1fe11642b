"""Triton kernels for DFlash / DSpark / DFlash 2 block drafting.

A Hugging Face kernel-Hub package (stdlib, torch and triton only; relative imports), loaded with
`kernels.get_kernel("<org>/dflash-kernels", version=1)` or `kernels.get_local_kernel(<repo folder>)`. Every op has a
torch reference of the same signature in `dflash_hf.kernels.reference` (outside this package: it calls the model's own
torch code), which defines what the op computes. On the CPU the kernels run
under `TRITON_INTERPRET=1` (half-precision inputs are computed in fp32 there).

Ops:
    rms_norm(x, weight, eps)
    context_kv(x, k_weight, v_weight, k_bias, v_bias, norm_weight, cos, sin, eps) -> (K, V)   [L, B, KVH, C, D]
    markov_walk(base_logits, hidden, anchor_ids, w1, w2, d2t, conf_weight, conf_bias, uniforms, temperature,
                conf_with_markov, return_logits) -> (ids, logits, confidence, survival)
    selector_walk(unary, candidates, projected, predecessor, successor, anchor_ids, uniforms, temperature,
                  return_scores) -> (ids, scores)
"""

from ._custom_ops import NAMESPACE, context_kv, markov_walk, rms_norm, selector_walk

# The Hub branch `v{API_VERSION}` carries this API; bump both when a signature or a result changes meaning.
API_VERSION = 1
OPS = ("rms_norm", "context_kv", "markov_walk", "selector_walk")

__all__ = ["API_VERSION", "NAMESPACE", "OPS", "context_kv", "markov_walk", "rms_norm", "selector_walk"]
