"""DFlash 2's candidate-selector walk over one block in one launch.

Slot k scores its K candidates against the token picked at k-1, so the walk is sequential; one program per row
walks all slots with the K scores in registers: each slot gathers the predecessor's codebook row and the K successor
rows, reduces them against the projected slot state in rank chunks, then takes the argmax or an inverse-CDF draw over
the K scores. The torch walk pays several small launches per slot; this pays one per block.

Unlike DSpark's walk (`_markov.py`), no slot here touches the vocabulary: the top-K over it runs once for all slots
before the walk, and a slot's work is K x r (16 x 256 for z-lab's released draft), one tile. Splitting a slot over
programs would take a launch per slot, which costs more than the slot's work.
"""

import torch
import triton
import triton.language as tl

from ._common import next_pow2, prepare


@triton.jit
def _selector_walk_kernel(
    unary_ptr, cand_ptr, proj_ptr, pred_ptr, succ_ptr, anchor_ptr, u_ptr,
    ids_ptr, scores_ptr,
    N, K, R, temperature,
    SAMPLE: tl.constexpr, WRITE_SCORES: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < K
    rr = tl.arange(0, BLOCK_R)
    prev = tl.load(anchor_ptr + row).to(tl.int64)
    for s in range(N):
        slot = row * N + s
        cand = tl.load(cand_ptr + slot * K + kk, mask=k_ok, other=0).to(tl.int64)
        pair = tl.zeros((BLOCK_K,), tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r_ok = r0 + rr < R
            p = tl.load(pred_ptr + prev * R + r0 + rr, mask=r_ok, other=0.0).to(tl.float32)
            h = tl.load(proj_ptr + slot * R + r0 + rr, mask=r_ok, other=0.0).to(tl.float32)
            succ = tl.load(succ_ptr + cand[:, None] * R + r0 + rr[None, :], mask=k_ok[:, None] & r_ok[None, :],
                           other=0.0).to(tl.float32)
            pair += tl.sum(succ * (p * h)[None, :], 1)
        scores = tl.load(unary_ptr + slot * K + kk, mask=k_ok, other=0.0).to(tl.float32) + pair
        scores = tl.where(k_ok, tl.div_rn(scores, temperature), float("-inf"))
        if WRITE_SCORES:
            tl.store(scores_ptr + slot * K + kk, scores, mask=k_ok)
        best = tl.max(scores, 0)
        if SAMPLE:
            # Inverse CDF of softmax(scores) at this slot's uniform; the last index with mass when rounding leaves
            # the running sum short of the target.
            w = tl.where(k_ok & (scores > float("-inf")), tl.exp(scores - best), 0.0)
            target = tl.load(u_ptr + slot).to(tl.float32) * tl.sum(w, 0)
            hit = tl.min(tl.where((tl.cumsum(w, 0) > target) & (w > 0.0), kk, BLOCK_K), 0)
            last = tl.max(tl.where(w > 0.0, kk, -1), 0)
            index = tl.where(hit < BLOCK_K, hit, tl.maximum(last, 0))
        else:
            index = tl.min(tl.where(scores == best, kk, BLOCK_K), 0)
        pick = tl.sum(tl.where(kk == index, cand, 0), 0)
        tl.store(ids_ptr + slot, pick)
        prev = pick


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
    batch, num, top_k = unary.shape
    rank = projected.shape[-1]
    device = unary.device
    ids = torch.empty((batch, num), dtype=torch.long, device=device)
    scores = torch.empty((batch, num, top_k) if return_scores else (0,), dtype=torch.float32, device=device)
    if batch and num:
        uc = prepare(uniforms.float()) if uniforms is not None else None
        unary_c = prepare(unary.float())
        block_k = max(2, next_pow2(top_k))
        _selector_walk_kernel[(batch,)](
            unary_c, candidates.long().contiguous(), prepare(projected), prepare(predecessor), prepare(successor),
            anchor_ids.long().contiguous(), uc if uc is not None else unary_c,
            ids, scores,
            num, top_k, rank, float(temperature),
            SAMPLE=uniforms is not None, WRITE_SCORES=return_scores,
            BLOCK_K=block_k, BLOCK_R=max(16, min(next_pow2(rank), 4096 // block_k)), num_warps=4,
        )
    return ids, scores
