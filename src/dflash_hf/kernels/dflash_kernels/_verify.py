"""Verification of one drafted block per row, in one launch per batch.

Greedy: the target's argmax at every block position (one pass over the vocabulary with all positions in the
tile), compared with the proposals; the agreeing prefix length and the bonus token fall out in-register.
Sampling: rejection sampling with given uniforms; the residual distribution is sampled by inverse CDF in a
second pass, so nothing is normalised or materialised.
"""

import torch
import triton
import triton.language as tl

from ._common import next_pow2, prepare

TILE = 16384  # elements per [positions, vocab] tile


@triton.jit
def _verify_greedy_kernel(
    logits_ptr, prop_ptr, accepted_ptr, next_ptr, ids_ptr, N1, V,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.arange(0, BLOCK_N)
    pos_ok = pos < N1
    base = logits_ptr + row * N1 * V + pos.to(tl.int64)[:, None] * V
    best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK_N,), tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = pos_ok[:, None] & (cols < V)[None, :]
        tile = tl.load(base + cols[None, :], mask=ok, other=float("-inf")).to(tl.float32)
        chunk_max = tl.max(tile, 1)
        # First index of the maximum, as torch.argmax: the smallest column holding it, earlier chunks winning ties.
        chunk_idx = tl.min(tl.where(tile == chunk_max[:, None], cols[None, :], V), 1)
        better = chunk_max > best
        best_idx = tl.where(better, chunk_idx, best_idx)
        best = tl.where(better, chunk_max, best)
    num = N1 - 1
    props = tl.load(prop_ptr + row * num + pos, mask=pos < num, other=-1)
    miss = (pos < num) & (best_idx.to(tl.int64) != props)
    accepted = tl.min(tl.where(miss, pos, num), 0)
    bonus = tl.sum(tl.where(pos == accepted, best_idx, 0), 0)
    tl.store(ids_ptr + row * N1 + pos, best_idx.to(tl.int64), mask=pos_ok)
    tl.store(accepted_ptr + row, accepted.to(tl.int64))
    tl.store(next_ptr + row, bonus.to(tl.int64))


@triton.jit
def _verify_rejection_kernel(
    p_ptr, q_ptr, prop_ptr, ua_ptr, us_ptr, accepted_ptr, next_ptr, N, V,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.arange(0, BLOCK_N)
    pos_ok = pos < N
    p_base = p_ptr + row * (N + 1) * V
    q_base = q_ptr + row * N * V
    tok = tl.load(prop_ptr + row * N + pos, mask=pos_ok, other=0)
    p_tok = tl.load(p_base + pos.to(tl.int64) * V + tok, mask=pos_ok, other=0.0).to(tl.float32)
    q_tok = tl.load(q_base + pos.to(tl.int64) * V + tok, mask=pos_ok, other=0.0).to(tl.float32)
    u = tl.load(ua_ptr + row * N + pos, mask=pos_ok, other=0.0).to(tl.float32)
    rejected = pos_ok & ~(u * q_tok < p_tok)
    first_reject = tl.min(tl.where(rejected, pos, N), 0)

    # Next token: from norm(max(p_m - q_m, 0)) at the first rejection m, from p_n when all were accepted
    # (q is masked out there), and from p_m when the residual has no mass.
    # q's row is read only where it is used: a column bound of V or 0 (also keeps masks plain vectors).
    q_len = tl.where(first_reject < N, V, 0)
    p_row = p_base + first_reject.to(tl.int64) * V
    q_row = q_base + first_reject.to(tl.int64) * V
    offs = tl.arange(0, BLOCK_V)
    residual_sum = tl.zeros((), tl.float32)
    p_sum = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        ok = cols < V
        p = tl.load(p_row + cols, mask=ok, other=0.0).to(tl.float32)
        q = tl.load(q_row + cols, mask=cols < q_len, other=0.0).to(tl.float32)
        residual_sum += tl.sum(tl.maximum(p - q, 0.0), 0)
        p_sum += tl.sum(p, 0)
    use_p = residual_sum <= 0.0
    target = tl.load(us_ptr + row).to(tl.float32) * tl.where(use_p, p_sum, residual_sum)
    q_len = tl.where(use_p, 0, q_len)
    carry = tl.zeros((), tl.float32)
    token = tl.full((), -1, tl.int32)
    last = tl.full((), -1, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        ok = cols < V
        p = tl.load(p_row + cols, mask=ok, other=0.0).to(tl.float32)
        q = tl.load(q_row + cols, mask=cols < q_len, other=0.0).to(tl.float32)
        w = tl.maximum(p - q, 0.0)
        running = tl.cumsum(w, 0) + carry
        hit = tl.min(tl.where((running > target) & (w > 0.0), cols, V), 0)
        token = tl.where((token < 0) & (hit < V), hit, token)
        last = tl.maximum(last, tl.max(tl.where(w > 0.0, cols, -1), 0))
        carry += tl.sum(w, 0)
    token = tl.where(token < 0, tl.maximum(last, 0), token)
    tl.store(accepted_ptr + row, first_reject.to(tl.int64))
    tl.store(next_ptr + row, token.to(tl.int64))


def verify_greedy(logits: torch.Tensor, proposals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, positions, vocab = logits.shape
    lc, pc = prepare(logits), proposals.long().contiguous()
    accepted = torch.empty(batch, dtype=torch.long, device=logits.device)
    next_token = torch.empty_like(accepted)
    target_ids = torch.empty((batch, positions), dtype=torch.long, device=logits.device)
    if batch:
        block_n = max(2, next_pow2(positions))
        block_v = max(16, min(next_pow2(vocab), TILE // block_n))
        _verify_greedy_kernel[(batch,)](
            lc, pc, accepted, next_token, target_ids, positions, vocab, BLOCK_N=block_n, BLOCK_V=block_v, num_warps=8
        )
    return accepted, next_token, target_ids


def verify_rejection(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    proposals: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, num = proposals.shape
    vocab = target_probs.shape[-1]
    p, q = prepare(target_probs), prepare(draft_probs)
    ua, us = prepare(accept_uniforms.float()), prepare(sample_uniforms.float())
    accepted = torch.empty(batch, dtype=torch.long, device=target_probs.device)
    next_token = torch.empty_like(accepted)
    if batch:
        block_v = min(next_pow2(vocab), 4096)
        _verify_rejection_kernel[(batch,)](
            p, q if num else p, proposals.long().contiguous(), ua if num else us, us, accepted, next_token, num, vocab,
            BLOCK_N=max(2, next_pow2(num)), BLOCK_V=block_v, num_warps=8,
        )
    return accepted, next_token
