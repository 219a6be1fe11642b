"""DSpark's Markov walk over one block (vanilla head), parallel over the draft vocabulary.

Slot k needs the token picked at k-1, so slots run one launch each; inside a launch many programs per row each
reduce a chunk of the vocabulary: slot logits base + round(W2 W1[prev]) (W2 read once per slot, by the whole grid,
instead of by one program per row) and the chunk's partial argmax, or partial softmax max and mass when sampling.
The next launch's programs each combine those few partials into the pick (a split argmax; for sampling, the inverse
CDF over the chunks' masses, then inside the chosen chunk's stored logits), so no launch waits on another inside it.
One more launch picks the last slot: n + 1 launches a block, against several small ones per slot in torch.
"""

import torch
import triton
import triton.language as tl

from ._common import next_pow2, prepare

MAX_CHUNKS = 256  # programs per row and slot: enough to fill a large GPU, few partials to combine


@triton.jit
def _biased_logits(base_row, w2_ptr, e, cols, ok, rr, r_ok, R, temperature, HAS_MARKOV: tl.constexpr):
    """Slot logits for one vocabulary tile: (base + round(W2 e)) / temperature, -inf outside the vocabulary."""
    logits = tl.load(base_row + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_MARKOV:
        w2 = tl.load(w2_ptr + cols[:, None] * R + rr[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
        bias = tl.sum(w2.to(tl.float32) * e[None, :], 1)
        # F.linear returns the bias in the weight dtype before the walk upcasts it: round there too.
        logits = logits + bias.to(w2_ptr.dtype.element_ty).to(tl.float32)
    logits = tl.div_rn(logits, temperature)
    return tl.where(ok, logits, float("-inf"))


@triton.jit
def _pick(part_max_ptr, part_idx_ptr, part_sum_ptr, logits_ptr, u_ptr, slot, VD, CHUNK, NUM_CHUNKS,
          SAMPLE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr):
    """The draft-vocabulary index picked at `slot` from its chunks' partials: the first index of the maximum, or the
    inverse CDF of softmax(logits) at the slot's uniform (the last index with mass when rounding leaves none)."""
    cc = tl.arange(0, BLOCK_C)
    c_ok = cc < NUM_CHUNKS
    parts = slot * NUM_CHUNKS + cc
    chunk_max = tl.load(part_max_ptr + parts, mask=c_ok, other=float("-inf"))
    best = tl.max(chunk_max, 0)
    if SAMPLE:
        # Each chunk's mass relative to the global maximum; the chunk where the running mass passes u * total.
        mass = tl.load(part_sum_ptr + parts, mask=c_ok, other=0.0)
        mass = tl.where(chunk_max > float("-inf"), mass * tl.exp(chunk_max - best), 0.0)
        target = tl.load(u_ptr + slot).to(tl.float32) * tl.sum(mass, 0)
        hit = tl.min(tl.where((tl.cumsum(mass, 0) > target) & (mass > 0.0), cc, BLOCK_C), 0)
        last = tl.max(tl.where(mass > 0.0, cc, -1), 0)
        chunk = tl.where(hit < BLOCK_C, hit, tl.maximum(last, 0))
        carry = tl.sum(tl.where(cc < chunk, mass, 0.0), 0)
        # Inside that chunk, from the logits the previous launch stored.
        offs = tl.arange(0, BLOCK_V)
        start = chunk * CHUNK
        end = tl.minimum(start + CHUNK, VD)
        index = tl.full((), -1, tl.int32)
        last_index = tl.full((), -1, tl.int32)
        for v0 in range(start, end, BLOCK_V):
            cols = v0 + offs
            ok = cols < end
            logits = tl.load(logits_ptr + slot * VD + cols, mask=ok, other=float("-inf"))
            w = tl.where(ok & (logits > float("-inf")), tl.exp(logits - best), 0.0)
            found = tl.min(tl.where((tl.cumsum(w, 0) + carry > target) & (w > 0.0), cols, VD), 0)
            index = tl.where((index < 0) & (found < VD), found, index)
            last_index = tl.maximum(last_index, tl.max(tl.where(w > 0.0, cols, -1), 0))
            carry += tl.sum(w, 0)
        index = tl.where(index < 0, tl.maximum(last_index, 0), index)
    else:
        chunk_idx = tl.load(part_idx_ptr + parts, mask=c_ok, other=VD)
        index = tl.min(tl.where(chunk_max == best, chunk_idx, VD), 0)
    return index.to(tl.int64)


@triton.jit(do_not_specialize=["k"])
def _markov_slot_kernel(
    base_ptr, hidden_ptr, anchor_ptr, w1_ptr, w2_ptr, d2t_ptr, cw_ptr, cb_ptr, u_ptr,
    ids_ptr, logits_ptr, conf_ptr, surv_ptr, part_max_ptr, part_idx_ptr, part_sum_ptr,
    k, N, VD, HD, R, CHUNK, NUM_CHUNKS, temperature,
    HAS_MARKOV: tl.constexpr, PRUNED: tl.constexpr, HAS_CONF: tl.constexpr, CONF_BIAS: tl.constexpr,
    CONF_WITH_MARKOV: tl.constexpr, SAMPLE: tl.constexpr, STORE_LOGITS: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Launch k of the walk: pick slot k-1 from its partials (program (row, 0) stores it), then this program's
    vocabulary chunk of slot k (and, in chunk 0, slot k's confidence). Launch N only picks."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if k == 0:
        prev = tl.load(anchor_ptr + row).to(tl.int64)
    else:
        prev = _pick(part_max_ptr, part_idx_ptr, part_sum_ptr, logits_ptr, u_ptr, row * N + k - 1, VD, CHUNK,
                     NUM_CHUNKS, SAMPLE, BLOCK_V, BLOCK_C)
        if PRUNED:
            prev = prev + tl.load(d2t_ptr + prev).to(tl.int64)
        if chunk == 0:
            tl.store(ids_ptr + row * N + k - 1, prev)
    if k < N:
        slot = row * N + k
        rr = tl.arange(0, BLOCK_R)
        r_ok = rr < R
        if HAS_MARKOV:
            e = tl.load(w1_ptr + prev * R + rr, mask=r_ok, other=0.0).to(tl.float32)
        else:
            e = tl.zeros((BLOCK_R,), tl.float32)

        if HAS_CONF:
            if chunk == 0:
                # sigmoid(Linear([h_k ; W1[prev_k]])), the logit rounded to the head's dtype as nn.Linear returns it.
                hh = tl.arange(0, BLOCK_H)
                acc = tl.zeros((BLOCK_H,), tl.float32)
                for h0 in range(0, HD, BLOCK_H):
                    h_ok = h0 + hh < HD
                    h = tl.load(hidden_ptr + slot * HD + h0 + hh, mask=h_ok, other=0.0).to(tl.float32)
                    acc += h * tl.load(cw_ptr + h0 + hh, mask=h_ok, other=0.0).to(tl.float32)
                conf_logit = tl.sum(acc, 0)
                if CONF_WITH_MARKOV:
                    conf_logit += tl.sum(e * tl.load(cw_ptr + HD + rr, mask=r_ok, other=0.0).to(tl.float32), 0)
                if CONF_BIAS:
                    conf_logit += tl.load(cb_ptr).to(tl.float32)
                conf_logit = conf_logit.to(cw_ptr.dtype.element_ty).to(tl.float32)
                conf = 1.0 / (1.0 + tl.exp(-conf_logit))
                survival = conf
                if k > 0:
                    survival = survival * tl.load(surv_ptr + slot - 1)
                tl.store(conf_ptr + slot, conf)
                tl.store(surv_ptr + slot, survival)

        # This chunk's partial: max and first index of it, or max and mass relative to it (online, tile by tile).
        offs = tl.arange(0, BLOCK_V)
        start = chunk * CHUNK
        end = tl.minimum(start + CHUNK, VD)
        best = tl.full((), float("-inf"), tl.float32)
        best_idx = tl.zeros((), tl.int32)
        mass = tl.zeros((), tl.float32)
        for v0 in range(start, end, BLOCK_V):
            cols = v0 + offs
            ok = cols < end
            logits = _biased_logits(base_ptr + slot * VD, w2_ptr, e, cols, ok, rr, r_ok, R, temperature, HAS_MARKOV)
            if STORE_LOGITS:
                tl.store(logits_ptr + slot * VD + cols, logits, mask=ok)
            tile_max = tl.max(logits, 0)
            new_best = tl.maximum(best, tile_max)
            if SAMPLE:
                # Guarded so that tiles of -inf logits add no mass instead of NaN.
                finite = new_best > float("-inf")
                mass = (mass * tl.where(finite, tl.exp(best - new_best), 0.0)
                        + tl.where(finite, tl.sum(tl.exp(logits - new_best), 0), 0.0))
            else:
                tile_idx = tl.min(tl.where(logits == tile_max, cols, VD), 0)
                best_idx = tl.where(tile_max > best, tile_idx, best_idx)
            best = new_best
        part = slot * NUM_CHUNKS + chunk
        tl.store(part_max_ptr + part, best)
        if SAMPLE:
            tl.store(part_sum_ptr + part, mass)
        else:
            tl.store(part_idx_ptr + part, best_idx)


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
    sample = uniforms is not None
    base, hc = prepare(base_logits.float()), prepare(hidden)
    w1c, w2c, cw, cb = prepare(w1), prepare(w2), prepare(conf_weight), prepare(conf_bias)
    d2tc = d2t.long().contiguous() if d2t is not None else None
    uc = prepare(uniforms.float()) if sample else None
    has_conf = conf_weight is not None
    ids = torch.empty((batch, num), dtype=torch.long, device=device)
    # Sampling reads the chosen chunk's logits back in the next launch, so it stores them even when not returned.
    store_logits = return_logits or sample
    logits = torch.empty((batch, num, vocab) if store_logits else (0,), dtype=torch.float32, device=device)
    confidence = torch.empty((batch, num) if has_conf else (0,), dtype=torch.float32, device=device)
    survival = torch.empty_like(confidence)
    if batch and num:
        block_r = max(2, next_pow2(rank))
        block_v = max(16, min(next_pow2(vocab), 1024, 8192 // block_r))
        chunks = min(triton.cdiv(vocab, block_v), MAX_CHUNKS)
        chunk = triton.cdiv(triton.cdiv(vocab, chunks), block_v) * block_v
        chunks = triton.cdiv(vocab, chunk)
        part_max = torch.empty((batch, num, chunks), dtype=torch.float32, device=device)
        part_idx = torch.empty((batch, num, chunks) if not sample else (0,), dtype=torch.int32, device=device)
        part_sum = torch.empty((batch, num, chunks) if sample else (0,), dtype=torch.float32, device=device)
        args = (base, hc, anchor_ids.long().contiguous(),
                w1c if w1c is not None else base, w2c if w2c is not None else base,
                d2tc if d2tc is not None else ids, cw if cw is not None else base, cb if cb is not None else base,
                uc if uc is not None else base, ids, logits, confidence, survival, part_max, part_idx, part_sum)
        flags = dict(HAS_MARKOV=w1 is not None, PRUNED=d2t is not None, HAS_CONF=has_conf,
                     CONF_BIAS=conf_bias is not None, CONF_WITH_MARKOV=bool(conf_with_markov and w1 is not None),
                     SAMPLE=sample, STORE_LOGITS=store_logits, BLOCK_V=block_v, BLOCK_R=block_r,
                     BLOCK_H=min(1024, next_pow2(hidden_size)), BLOCK_C=max(2, next_pow2(chunks)), num_warps=4)
        for k in range(num + 1):
            grid = (batch, chunks if k < num else 1)
            _markov_slot_kernel[grid](*args, k, num, vocab, hidden_size, max(rank, 1), chunk, chunks,
                                      float(temperature), **flags)
    if not return_logits:
        logits = logits.new_empty(0)
    return ids, logits, confidence, survival
