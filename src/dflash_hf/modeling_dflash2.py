"""DFlash 2 block drafters: the DFlash backbone with grouped dynamic causal convolutions around each sublayer, and a
top-K candidate selector walked over the block.

A Hub remote-code file: it imports only torch, transformers and its siblings (`configuration_dflash2.py`,
`modeling_dflash.py`, `kernels_dflash.py`), so a DFlash 2 draft saved by `save_pretrained` loads with
`AutoModel.from_pretrained(repo, trust_remote_code=True)` and drafts through `target.generate(assistant_model=draft)`
without the `dflash_hf` package.

Two facts live here once, for generation, training and the kernel references alike: `grouped_dynamic_conv` (the
convolution, block by block) and `selector_walk` (the left-to-right walk over each slot's candidates, chosen by the
caller or teacher-forced).

The math, as z-lab's `dflash` 0.1.0 computes it: each layer normalises its input as DFlash does, reads dynamic tap
weights from that normed input (one projection for both convolutions of the sublayer), convolves the normed input
before the sublayer and the sublayer's output after it, then adds the residual. The block's own K/V come from the
convolved input; the context K/V do not pass through any convolution. Slot k's K candidates are the top-K of its draft
logits, scored `u + <P[prev] * proj(h_k), S[c]>`, where `prev` is the token picked at slot k-1 (the anchor first).
"""

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_dflash2 import DFlash2Config
from .kernels_dflash import selector_walk_kernel
from .layers_dflash import DFlashDecoderLayer
from .modeling_dflash import DFlashDraftModel, DraftProposal, nonfinite_proposal

# ----------------------------------------------------------------------------------------------------------------------
# Grouped dynamic causal convolution
# ----------------------------------------------------------------------------------------------------------------------


def grouped_dynamic_conv(
    x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block_len: int | None = None
) -> torch.Tensor:
    """`out[i, c] = sum_t (base[t, c] + dynamic[i, t, g(c)]) * x[i - t, c]`, where channel c belongs to group
    `g(c) = c // (H / G)` and taps reaching before the start of i's block read zeros.

    x: [B, L, H]; dynamic: [B, L, T, G] (indexed by the output position i); base: [T, H];
    block_len: positions per block when L holds several blocks back to back (training); None: L is one block.
    """
    batch, length, hidden = x.shape
    taps, groups = dynamic.shape[-2:]
    block_len = length if block_len is None else block_len
    if block_len <= 0 or length % block_len:
        raise ValueError(f"grouped_dynamic_conv: {length} positions are not whole blocks of {block_len}.")
    grouped = x.view(batch, length, groups, hidden // groups)
    base = base.to(x.dtype).view(taps, groups, hidden // groups)
    dynamic = dynamic.unsqueeze(-1)  # one weight per group, shared by the group's channels
    offset_in_block = torch.arange(length, device=x.device) % block_len
    out = torch.zeros_like(grouped)
    for t in range(min(taps, block_len)):  # a tap as long as the block reads nothing but zeros
        shifted = grouped if t == 0 else F.pad(grouped[:, : length - t], (0, 0, 0, 0, t, 0))
        if t and block_len < length:
            shifted = shifted.masked_fill((offset_in_block < t)[None, :, None, None], 0.0)
        # z-lab's rounding order: the base tap, then the dynamic tap fused (addcmul).
        out = torch.addcmul(out + base[t] * shifted, dynamic[:, :, t], shifted)
    return out.view_as(x)


class GroupedDynamicCausalConv(nn.Module):
    """The pair of convolutions around one sublayer: `base_kernel[0]` / dynamic taps 0 on its input, `base_kernel[1]`
    / dynamic taps 1 on its output, both sets of dynamic taps projected from the sublayer's normed input."""

    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.taps = config.conv_kernel_size
        self.groups = config.hidden_size // config.conv_group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, config.hidden_size))
        self.kernel_projection = nn.Linear(config.hidden_size, 2 * self.taps * self.groups, bias=False)

    def dynamic_taps(self, normed: torch.Tensor) -> torch.Tensor:
        """[B, L, H] -> [B, L, 2, T, G]: the input's (0) and the output's (1) position-dependent tap weights."""
        return self.kernel_projection(normed).view(*normed.shape[:-1], 2, self.taps, self.groups)

    def before(self, normed: torch.Tensor, dynamic: torch.Tensor, block_len: int | None = None) -> torch.Tensor:
        return grouped_dynamic_conv(normed, dynamic[..., 0, :, :], self.base_kernel[0], block_len)

    def after(self, out: torch.Tensor, dynamic: torch.Tensor, block_len: int | None = None) -> torch.Tensor:
        return grouped_dynamic_conv(out, dynamic[..., 1, :, :], self.base_kernel[1], block_len)

    def around(self, sublayer, normed: torch.Tensor, block_len: int | None = None) -> torch.Tensor:
        """`after(sublayer(before(normed)))`, one projection of `normed` feeding both."""
        dynamic = self.dynamic_taps(normed)
        return self.after(sublayer(self.before(normed, dynamic, block_len)), dynamic, block_len)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash layer whose attention and MLP each sit between two grouped dynamic causal convolutions."""

    def __init__(self, config: DFlash2Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.attention_conv = GroupedDynamicCausalConv(config)
        self.mlp_conv = GroupedDynamicCausalConv(config)

    def attention_input(self, x: torch.Tensor, block_len: int | None = None) -> torch.Tensor:
        normed = self.input_layernorm(x)
        return self.attention_conv.before(normed, self.attention_conv.dynamic_taps(normed), block_len)

    def forward(self, x, cos, sin, context_kv, attention_mask, block_kv=None, block_len: int | None = None):
        """As `DFlashDecoderLayer.forward`; `block_len`: positions per block when `x` holds several blocks (the
        convolutions must not cross their boundaries), None when `x` is one block."""

        def attend(h):
            return self.self_attn(h, cos, sin, context_kv, attention_mask, block_kv)

        x = x + self.attention_conv.around(attend, self.input_layernorm(x), block_len)
        return x + self.mlp_conv.around(self.mlp, self.post_attention_layernorm(x), block_len)


# ----------------------------------------------------------------------------------------------------------------------
# Candidate selector
# ----------------------------------------------------------------------------------------------------------------------


class CandidateSelector(nn.Module):
    """Scores each slot's top-K candidates given the token before them. The codebooks are bare parameters (no
    `.weight`), as the released checkpoints store them."""

    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.top_k = config.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, config.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, config.selector_rank))
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(unary scores, candidate ids), each [..., K]: the K highest logits, highest first."""
        return logits.topk(self.top_k, dim=-1)


def selector_pair_scores(prev_ids, projected, candidates, predecessor, successor) -> torch.Tensor:
    """`<P[prev] * projected, S[c]>` for every candidate c, in fp32: prev_ids [...], projected [..., r],
    candidates [..., K] (target ids), predecessor / successor [V, r] -> [..., K]."""
    query = predecessor[prev_ids].float() * projected.float()
    return torch.einsum("...r,...kr->...k", query, successor[candidates].float())


def selector_walk(
    unary: torch.Tensor,
    candidates: torch.Tensor,
    projected: torch.Tensor,
    predecessor: torch.Tensor,
    successor: torch.Tensor,
    prev_ids: torch.Tensor,
    choose=None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """DFlash 2's walk over a block, left to right: slot k's candidates score `unary_k + <P[prev_k] * projected_k,
    S[c]>` (fp32). Generation, training and the kernel reference all walk here.

    unary, candidates: [B, S, K] (top-K draft logits and their target ids); projected: [B, S, r]
    (`hidden_projection` of the slot states); predecessor, successor: [V, r].
    prev_ids: [B] the anchor, after which each slot's `choose(k, scores [B, K], candidates [B, K]) -> (target ids
    [B], something to keep or None)` feeds the next; or, with `choose` None (teacher forcing), [B, S] the true
    previous token of each slot.
    Returns the picked ids [B, S] (None when teacher-forced) and the kept values stacked [B, S, ...] (when
    teacher-forced, the scores [B, S, K]), or None when nothing was kept.
    """
    if choose is None:
        return None, unary.float() + selector_pair_scores(prev_ids, projected, candidates, predecessor, successor)
    picked, kept = [], []
    prev = prev_ids
    for k in range(unary.shape[1]):
        scores = unary[:, k].float() + selector_pair_scores(prev, projected[:, k], candidates[:, k], predecessor,
                                                            successor)
        prev, keep = choose(k, scores, candidates[:, k])
        picked.append(prev)
        if keep is not None:
            kept.append(keep)
    ids = torch.stack(picked, 1) if picked else prev_ids.new_zeros(prev_ids.shape[0], 0)
    return ids, torch.stack(kept, 1) if kept else None


def scatter_candidates(scores: torch.Tensor, candidates: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Candidate scores [..., K] as logits over the whole vocabulary [..., V]: -inf where no candidate sits, so a
    softmax of them is the walk's distribution over its K candidates, zero elsewhere (the q of rejection sampling)."""
    full = scores.new_full((*scores.shape[:-1], vocab_size), float("-inf"))
    return full.scatter_(-1, candidates, scores)


# ----------------------------------------------------------------------------------------------------------------------
# The draft model
# ----------------------------------------------------------------------------------------------------------------------


class DFlash2DraftModel(DFlashDraftModel):
    """A DFlash 2 draft: DFlash's block forward through convolution-wrapped layers, proposals from the candidate
    selector's walk. Context, cache, kernels and generation are DFlash's; only the layer and the walk differ."""

    config_class = DFlash2Config
    decoder_layer_class = DFlash2DecoderLayer
    _no_split_modules = ["DFlash2DecoderLayer"]

    def _build_heads(self, config: DFlash2Config) -> None:
        self.candidate_selector = CandidateSelector(config)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, GroupedDynamicCausalConv):
            # Identity (speculators' recipe): tap 0 passes each sublayer's input and output through unchanged, and the
            # dynamic taps start at zero, so an untrained draft is a DFlash draft.
            module.base_kernel.zero_()
            module.base_kernel[:, 0] = 1.0
            module.kernel_projection.weight.zero_()
        elif isinstance(module, CandidateSelector):
            module.predecessor_codebook.normal_(mean=0.0, std=self.config.initializer_range)
            module.successor_codebook.normal_(mean=0.0, std=self.config.initializer_range)

    @torch.no_grad()
    def propose(
        self,
        context_hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        cache,
        *,
        prefix_ids: torch.Tensor | None = None,
        logits_processor=None,
        do_sample: bool = False,
        need_logits: bool = False,
        confidence_threshold: float | None = None,
        block_size: int | None = None,
        max_slots: int | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> DraftProposal:
        """Draft one block (see `DFlashDraftModel.propose`): the DFlash forward, then the selector's walk.

        With `need_logits`, `draft_logits` are the walk's processed scores over the vocabulary (-inf off the
        candidates), whose softmax is exactly the distribution each slot was drawn from. `confidence_threshold`
        is ignored: DFlash 2 has no confidence head.
        """
        hidden = self.block_hidden(context_hidden, anchor_ids, cache, block_size, position_ids, attention_mask)
        first = self.config.block_size - self.config.num_speculative_slots  # DFlash layout: slot 0 is the anchor
        hidden = hidden[:, first : first + max_slots if max_slots else None]
        logits = self.logits(hidden).float()  # over the draft vocabulary (the kept ids when pruned)
        vocab_size = self.config.vocab_size
        if (broken := nonfinite_proposal(logits, anchor_ids, vocab_size, need_logits)) is not None:
            return broken
        selector = self.candidate_selector
        unary, candidates = selector.candidates(logits)
        candidates = self.to_target_ids(candidates)  # the codebooks, the walk and q speak target ids
        projected = selector.hidden_projection(hidden)
        walked = selector_walk_kernel(self._kernel_path, self, unary, candidates, projected, anchor_ids,
                                      logits_processor, do_sample, need_logits)
        if walked is not None:  # the one-launch Triton walk ran (no processor beyond temperature)
            ids, scores = walked
            return DraftProposal(ids, None if scores is None else scatter_candidates(scores, candidates, vocab_size))
        choose = self._candidate_chooser(logits, prefix_ids, logits_processor, do_sample, need_logits)
        ids, kept = selector_walk(unary, candidates, projected, selector.predecessor_codebook,
                                  selector.successor_codebook, anchor_ids, choose)
        if need_logits and kept is None:  # no slot to propose
            kept = logits.new_zeros(logits.shape[0], 0, vocab_size)
        return DraftProposal(ids, kept if need_logits else None)

    def _candidate_chooser(self, logits, prefix_ids, logits_processor, do_sample: bool, need_logits: bool):
        """`choose` for `selector_walk`. The target's logits processors see each slot's candidate scores as logits
        over the vocabulary (-inf off the candidates) after the verified ids plus the slots picked so far, as they
        see the target's logits; the token is sampled from (or the argmax of) the processed scores, which are then
        exactly the slot's q. A processor that leaves no candidate finite (a ban on all K) makes that row draw from
        its processed full draft logits instead, again keeping them as q."""
        if not (logits_processor or do_sample or need_logits):
            return lambda k, scores, candidates: (candidates.gather(1, scores.argmax(-1, keepdim=True))[:, 0], None)
        seen = [prefix_ids]
        vocab = self.config.vocab_size

        def choose(k: int, scores: torch.Tensor, candidates: torch.Tensor):
            slot = scatter_candidates(scores, candidates, vocab)
            if logits_processor:
                slot = logits_processor(seen[0], slot)
                dead = ~(slot > float("-inf")).any(-1)
                if bool(dead.any()):
                    slot = torch.where(dead[:, None], logits_processor(seen[0], self.to_target_logits(logits[:, k].clone())), slot)
            token = torch.multinomial(slot.softmax(-1), 1)[:, 0] if do_sample else slot.argmax(-1)
            if seen[0] is not None:
                seen[0] = torch.cat([seen[0], token[:, None]], dim=1)
            return token, slot if need_logits else None

        return choose


__all__ = [
    "CandidateSelector",
    "DFlash2DecoderLayer",
    "DFlash2DraftModel",
    "GroupedDynamicCausalConv",
    "grouped_dynamic_conv",
    "scatter_candidates",
    "selector_pair_scores",
    "selector_walk",
]
