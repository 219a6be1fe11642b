"""Row-exact attention: every query row gets the bits a one-token decode would give it.

Greedy speculative decoding reproduces the target's own output only if the target scores a block of drafted tokens
exactly as it would score them one at a time. In float32 the two disagree by ~1e-7 and a near-tie almost never
flips; in bfloat16 every op rounds to 8 mantissa bits and flips are common (3 in 10 HumanEval answers with SmolLM2).
On CPUs with AMX, oneDNN's bf16 matmuls give a row the same bits whatever the row count, up to `EXACT_VERIFY_ROWS`
rows (a verify block), so attention, whose reduction over keys changes with the query count, the key count and the
mask, is the one op left. Here each query row attends,
unmasked, to exactly the keys it may see, which is the very call a one-token decode makes. Prefills go row by row
too (one SDPA call per row and layer: a 170-token SmolLM2 prefill on one CPU thread takes 340 ms instead of 163), so
a prompt's rows get the same attention whatever follows them; their matmuls still may not, which is why a generator
whose first forward carries the prompt *and* candidates (prompt lookup) is not guaranteed exact in bf16, while ours,
which prefills the prompt alone, is.

A batch (padding, or the holes batched speculation leaves) goes the same way, one (row, query) at a time over the
keys its mask leaves visible, gathered in order: each row then gets what it would get alone, in plain batched
generate and in batched speculation alike (as far as the matmuls stay row-invariant: the whole forward's rows
within `EXACT_VERIFY_ROWS`).

Use it by loading the target with `attn_implementation=EXACT_ATTENTION` (after `import dflash_hf`) or calling
`target.set_attn_implementation(EXACT_ATTENTION)`. What it cannot make exact (position biases, soft-capping, masks
that are not boolean-like) goes through transformers' SDPA unchanged.
"""

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward, use_gqa_in_sdpa
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

EXACT_ATTENTION = "row_exact"  # no "flash" or "sdpa" in it: transformers reads meaning into those
# Rows a verify forward may carry and keep a decode's bits: how far oneDNN's bf16 matmuls stay row-invariant (measured
# on SmolLM2's shapes; beyond it some shapes change kernels). Candidates per step must stay below it.
EXACT_VERIFY_ROWS = 32


def visible_key_counts(attention_mask: torch.Tensor | None, q_len: int, kv_len: int) -> list[int] | None:
    """How many leading keys each query row sees, or None when some row's visible keys are not a leading run."""
    if attention_mask is None:  # SDPA's causal skip: the block is the last q_len positions
        return [kv_len - q_len + row + 1 for row in range(q_len)]
    if attention_mask.shape[0] != 1 or attention_mask.shape[1] != 1:
        return None
    mask = attention_mask[0, 0]
    visible = mask if mask.dtype == torch.bool else mask == 0
    counts = visible.sum(-1)
    leading = torch.arange(mask.shape[-1], device=mask.device)[None, :] < counts[:, None]
    if not torch.equal(visible, leading) or bool((counts == 0).any()):
        return None
    return counts.tolist()


_last_counts: tuple = (None, None, None)  # (mask, its version, counts): every layer of a forward gets the same mask


def _counts_for(attention_mask, q_len: int, kv_len: int) -> list[int] | None:
    """`visible_key_counts`, computed once per mask rather than once per layer (the mask is held, so no later mask
    can be the same object; its version catches in-place edits, where autograd tracks one). The entry is one tuple,
    read and replaced whole, so a forward in another thread can replace it but never hand this one its counts."""
    global _last_counts
    if attention_mask is None:
        return visible_key_counts(None, q_len, kv_len)
    version = None if attention_mask.is_inference() else attention_mask._version
    mask, seen_version, counts = _last_counts
    if mask is not attention_mask or seen_version != version:
        counts = visible_key_counts(attention_mask, q_len, kv_len)
        _last_counts = (attention_mask, version, counts)
    return counts


def _decode_call_kwargs(module, key, value, kwargs) -> dict | None:
    """The keyword arguments transformers' SDPA passes `F.scaled_dot_product_attention` for a one-token decode
    with no mask, or None where its call would take another form (then each row goes through it)."""
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return None
    if getattr(module, "num_key_value_groups", 1) > 1:
        return {"enable_gqa": True} if use_gqa_in_sdpa(None, key, value) else None
    return {}


def _batch_row_by_row(query, key, value, attention_mask, dropout, scaling, direct) -> torch.Tensor | None:
    """A batch's attention, one (row, query) at a time over the keys its boolean-like mask leaves visible, as the
    decode of that row alone would call it; None where the mask is not a [B, 1, Q, K] boolean or additive 0/-inf."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None:  # causal, no padding: the block is the last q_len positions
        ends = torch.arange(kv_len - q_len, kv_len, device=query.device)
        visible = (torch.arange(kv_len, device=query.device)[None, :] <= ends[:, None])[None, None]
    elif attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        return None
    elif attention_mask.dtype == torch.bool:
        visible = attention_mask
    else:
        visible = attention_mask == 0
        if bool((~visible & (attention_mask > torch.finfo(attention_mask.dtype).min)).any()):
            return None  # an additive bias, not a visibility mask
    visible = visible.expand(query.shape[0], 1, q_len, kv_len)
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])  # [B, Q, heads, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for b in range(query.shape[0]):
        for q in range(q_len):
            keys = visible[b, 0, q].nonzero()[:, 0]
            if keys.numel():  # a padding query sees nothing: its output is never read
                out[b, q] = sdpa(query[b : b + 1, :, q : q + 1], key[b : b + 1, :, keys], value[b : b + 1, :, keys],
                                 dropout_p=dropout, scale=scaling, **direct)[0, :, 0]
    return out


def row_exact_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA, one query row at a time over its own visible keys (see the module docstring)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    counts = None
    if q_len > 1 and query.shape[0] == 1 and kwargs.get("position_bias") is None:
        counts = _counts_for(attention_mask, q_len, kv_len)
    if counts is None:
        if query.shape[0] > 1 and kwargs.get("position_bias") is None:
            direct = _decode_call_kwargs(module, key, value, {k: v for k, v in kwargs.items() if k != "is_causal"})
            out = None if direct is None else _batch_row_by_row(query, key, value, attention_mask, dropout, scaling,
                                                                  direct)
            if out is not None:
                return out, None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kwargs.pop("is_causal", None)
    direct = _decode_call_kwargs(module, key, value, kwargs)
    if direct is None:
        rows = [
            sdpa_attention_forward(module, query[:, :, row : row + 1], key[:, :, :count], value[:, :, :count], None,
                                   dropout=dropout, scaling=scaling, is_causal=False, **kwargs)[0]
            for row, count in enumerate(counts)
        ]
        return torch.cat(rows, dim=1), None
    # The decode's own call, minus the wrapper's per-call checks (a verify makes one per row and layer).
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = [
        sdpa(query[:, :, row : row + 1], key[:, :, :count], value[:, :, :count], dropout_p=dropout, scale=scaling,
             **direct)
        for row, count in enumerate(counts)
    ]
    return torch.cat(rows, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(EXACT_ATTENTION, row_exact_attention)
AttentionMaskInterface.register(EXACT_ATTENTION, sdpa_mask)
