"""DSpark's sequential Markov walk over one block in one launch (vanilla head).

Slot k needs the token picked at k-1, so the walk is inherently sequential; one program per row walks all slots,
computing the low-rank bias W2 W1[prev] chunk by chunk inside the vocabulary pass instead of materialising it, and
the confidence head alongside. The torch path pays several small launches per slot; this pays one per block.
"""

import torch
import triton
import triton.language as tl

from ._common import next_pow2, prepare


@triton.jit
def _biased_logits(base_row, w2_ptr, e, cols, ok, rr, r_ok, R, temperature, HAS_MARKOV: tl.constexpr):
    """Slot logits for one vocabulary chunk: (base + round(W2 e)) / temperature, -inf outside the vocabulary."""
    logits = tl.load(base_row + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_MARKOV:
        w2 = tl.load(w2_ptr + cols[:, None] * R + rr[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
        bias = tl.sum(w2.to(tl.float32) * e[None, :], 1)
        # F.linear returns the bias in the weight dtype before the walk upcasts it: round there too.
        logits = logits + bias.to(w2_ptr.dtype.element_ty).to(tl.float32)
    logits = tl.div_rn(logits, temperature)
    return tl.where(ok, logits, float("-inf"))


@triton.jit
def _markov_walk_kernel(
    base_ptr, hidden_ptr, anchor_ptr, w1_ptr, w2_ptr, d2t_ptr, cw_ptr, cb_ptr, u_ptr,
    ids_ptr, logits_ptr, conf_ptr, surv_ptr,
    N, VD, HD, R, temperature,
    HAS_MARKOV: tl.constexpr, PRUNED: tl.constexpr, HAS_CONF: tl.constexpr, CONF_BIAS: tl.constexpr,
    CONF_WITH_MARKOV: tl.constexpr, SAMPLE: tl.constexpr, WRITE_LOGITS: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < R
    offs = tl.arange(0, BLOCK_V)
    hh = tl.arange(0, BLOCK_H)
    prev = tl.load(anchor_ptr + row).to(tl.int64)
    survival = tl.full((), 1.0, tl.float32)
    for k in range(N):
        slot = row * N + k
        base_row = base_ptr + slot * VD
        if HAS_MARKOV:
            e = tl.load(w1_ptr + prev * R + rr, mask=r_ok, other=0.0).to(tl.float32)
        else:
            e = tl.zeros((BLOCK_R,), tl.float32)

        if HAS_CONF:
            # sigmoid(Linear([h_k ; W1[prev_k]])), the logit rounded to the head's dtype as nn.Linear returns it.
            acc = tl.zeros((BLOCK_H,), tl.float32)
            for h0 in range(0, HD, BLOCK_H):
                h_ok = h0 + hh < HD
                h = tl.load(hidden_ptr + slot * HD + h0 + hh, mask=h_ok, other=0.0).to(tl.float32)
                w = tl.load(cw_ptr + h0 + hh, mask=h_ok, other=0.0).to(tl.float32)
                acc += h * w
            conf_logit = tl.sum(acc, 0)
            if CONF_WITH_MARKOV:
                we = tl.load(cw_ptr + HD + rr, mask=r_ok, other=0.0).to(tl.float32)
                conf_logit += tl.sum(e * we, 0)
            if CONF_BIAS:
                conf_logit += tl.load(cb_ptr).to(tl.float32)
            conf_logit = conf_logit.to(cw_ptr.dtype.element_ty).to(tl.float32)
            conf = 1.0 / (1.0 + tl.exp(-conf_logit))
            survival = survival * conf
            tl.store(conf_ptr + slot, conf)
            tl.store(surv_ptr + slot, survival)

        # Pass 1: argmax, or the softmax max and normaliser (online), and the processed logits if asked for.
        best = tl.full((), float("-inf"), tl.float32)
        best_idx = tl.zeros((), tl.int32)
        run_max = tl.full((), float("-inf"), tl.float32)
        run_sum = tl.zeros((), tl.float32)
        for v0 in range(0, VD, BLOCK_V):
            cols = v0 + offs
            ok = cols < VD
            logits = _biased_logits(base_row, w2_ptr, e, cols, ok, rr, r_ok, R, temperature, HAS_MARKOV)
            if WRITE_LOGITS:
                tl.store(logits_ptr + slot * VD + cols, logits, mask=ok)
            chunk_max = tl.max(logits, 0)
            if SAMPLE:
                new_max = tl.maximum(run_max, chunk_max)
                # Guarded so that chunks (or rows) of -inf logits add no mass instead of NaN.
                finite = new_max > float("-inf")
                scale = tl.where(finite, tl.exp(run_max - new_max), 0.0)
                mass = tl.where(finite, tl.sum(tl.exp(logits - new_max), 0), 0.0)
                run_sum = run_sum * scale + mass
                run_max = new_max
            else:
                chunk_idx = tl.min(tl.where(logits == chunk_max, cols, VD), 0)
                better = chunk_max > best
                best_idx = tl.where(better, chunk_idx, best_idx)
                best = tl.where(better, chunk_max, best)

        if SAMPLE:
            # Pass 2: inverse CDF of softmax(logits) at this slot's uniform.
            target = tl.load(u_ptr + slot).to(tl.float32) * run_sum
            carry = tl.zeros((), tl.float32)
            best_idx = tl.full((), -1, tl.int32)
            last = tl.full((), -1, tl.int32)
            for v0 in range(0, VD, BLOCK_V):
                cols = v0 + offs
                ok = cols < VD
                logits = _biased_logits(base_row, w2_ptr, e, cols, ok, rr, r_ok, R, temperature, HAS_MARKOV)
                w = tl.where(ok & (logits > float("-inf")), tl.exp(logits - run_max), 0.0)
                running = tl.cumsum(w, 0) + carry
                hit = tl.min(tl.where((running > target) & (w > 0.0), cols, VD), 0)
                best_idx = tl.where((best_idx < 0) & (hit < VD), hit, best_idx)
                last = tl.maximum(last, tl.max(tl.where(w > 0.0, cols, -1), 0))
                carry += tl.sum(w, 0)
            best_idx = tl.where(best_idx < 0, tl.maximum(last, 0), best_idx)

        pick = best_idx.to(tl.int64)
        if PRUNED:
            pick = pick + tl.load(d2t_ptr + pick).to(tl.int64)
        tl.store(ids_ptr + slot, pick)
        prev = pick


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
    batch, num, vocab = base_logits.shape
    device = base_logits.device
    hidden_size = hidden.shape[-1]
    rank = w1.shape[-1] if w1 is not None else 0
    base, hc = prepare(base_logits.float()), prepare(hidden)
    w1c, w2c, cw, cb = prepare(w1), prepare(w2), prepare(conf_weight), prepare(conf_bias)
    d2tc = d2t.long().contiguous() if d2t is not None else None
    uc = prepare(uniforms.float()) if uniforms is not None else None
    has_conf = conf_weight is not None
    ids = torch.empty((batch, num), dtype=torch.long, device=device)
    logits = torch.empty((batch, num, vocab) if return_logits else (0,), dtype=torch.float32, device=device)
    confidence = torch.empty((batch, num) if has_conf else (0,), dtype=torch.float32, device=device)
    survival = torch.empty_like(confidence)
    if batch and num:
        block_r = max(2, next_pow2(rank))
        block_v = max(16, min(next_pow2(vocab), 1024, 8192 // block_r))
        _markov_walk_kernel[(batch,)](
            base, hc, anchor_ids.long().contiguous(),
            w1c if w1c is not None else base, w2c if w2c is not None else base,
            d2tc if d2tc is not None else ids, cw if cw is not None else base, cb if cb is not None else base,
            uc if uc is not None else base,
            ids, logits, confidence, survival,
            num, vocab, hidden_size, max(rank, 1), float(temperature),
            HAS_MARKOV=w1 is not None, PRUNED=d2t is not None, HAS_CONF=has_conf,
            CONF_BIAS=conf_bias is not None, CONF_WITH_MARKOV=bool(conf_with_markov and w1 is not None),
            SAMPLE=uniforms is not None, WRITE_LOGITS=return_logits,
            BLOCK_V=block_v, BLOCK_R=block_r, BLOCK_H=min(1024, next_pow2(hidden_size)), num_warps=4,
        )
    return ids, logits, confidence, survival
