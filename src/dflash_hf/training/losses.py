"""Block-drafting losses: weighted cross-entropy (DFlash), CE + total variation + confidence BCE (DSpark), and the
K-way cross-entropy of DFlash 2's candidate selector.

Every loss takes flat rows (one per drafted slot that has a label) with a per-row weight, so the caller decides which
slots count (loss mask, sequence end) and how much (the positional decay): a slot deep in the block only matters if
all slots before it were accepted, hence the decay.
"""

import torch
import torch.nn.functional as F


def slot_weights(num_slots: int, gamma: float) -> torch.Tensor:
    """exp(-(k-1)/gamma) for the k-th drafted slot, k = 1..num_slots (the first drafted token weighs 1)."""
    return torch.exp(-torch.arange(num_slots, dtype=torch.float32) / gamma)


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    total = weights.sum()
    return (values * weights).sum() / total.clamp_min(torch.finfo(weights.dtype).tiny)


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted CE. logits [M, V], labels [M] (ids in the logits' vocabulary), weights [M]."""
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    return _weighted_mean(ce, weights)


def total_variation(draft_logits: torch.Tensor, teacher_kept_logits: torch.Tensor,
                    teacher_lse: torch.Tensor) -> torch.Tensor:
    """TV distance per row between the draft (over its vocabulary) and the target (over the full one).

    teacher_kept_logits [M, V_draft] are the target's logits at the kept ids and teacher_lse [M] their normaliser over
    the full vocabulary, so the target's mass outside the draft vocabulary (which the draft can never match) counts.
    """
    q = draft_logits.float().softmax(-1)
    p = (teacher_kept_logits.float() - teacher_lse.float()[:, None]).exp()
    outside = (1.0 - p.sum(-1)).clamp_min(0.0)
    return 0.5 * ((p - q).abs().sum(-1) + outside)


def dspark_loss(draft_logits, labels, teacher_kept_logits, teacher_lse, confidence_logits, weights,
                ce_weight: float = 0.1, tv_weight: float = 0.9, confidence_weight: float = 1.0):
    """(loss, parts): ce_weight*CE + tv_weight*TV + confidence_weight*BCE(confidence, 1 - TV).

    labels [M] are draft-vocabulary ids, -1 where the true token is outside the draft vocabulary (no CE there).
    confidence_logits [M] or None; its target 1 - TV is the chance a sampled draft token is accepted, detached so
    the confidence head cannot pull the drafter towards easy slots.
    """
    tv = total_variation(draft_logits, teacher_kept_logits, teacher_lse)
    known = labels >= 0
    ce = F.cross_entropy(draft_logits.float(), labels.clamp_min(0), reduction="none")
    ce_loss = _weighted_mean(ce * known, weights * known)
    tv_loss = _weighted_mean(tv, weights)
    loss = ce_weight * ce_loss + tv_weight * tv_loss
    parts = {"ce": ce_loss.detach(), "tv": tv_loss.detach()}
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), (1.0 - tv).detach(), reduction="none")
        bce_loss = _weighted_mean(bce, weights)
        loss = loss + confidence_weight * bce_loss
        parts["bce"] = bce_loss.detach()
    return loss, parts


def selector_training_candidates(candidates: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidates, label positions) for DFlash 2's selector loss: each slot's unary top-K [..., K] (best first) with
    the label [...] put in place of the weakest candidate where the top-K misses it, so every slot has its label among
    K choices (speculators' recipe; generation walks the plain top-K). Positions index the label in the candidates."""
    hit = candidates == labels[..., None]
    found = hit.any(-1)
    candidates = candidates.clone()
    candidates[..., -1] = torch.where(found, candidates[..., -1], labels)
    positions = torch.where(found, hit.long().argmax(-1), torch.full_like(labels, candidates.shape[-1] - 1))
    return candidates, positions


def selector_loss(scores: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted K-way CE of the selector's candidate scores [M, K] against the label's position [M] among them."""
    ce = F.cross_entropy(scores.float(), positions, reduction="none")
    return _weighted_mean(ce, weights)
