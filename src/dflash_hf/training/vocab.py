"""Pruned draft vocabulary: keep the target ids the assistant actually writes.

The draft's output head over the full vocabulary dominates its cost on small targets (REFERENCE section 8), and most
ids never appear in answers. The mapping follows the speculators convention that `check_vocab_mapping` enforces:
`d2t[i]` is the offset of draft id i (target id = i + d2t[i]) and `t2d` marks the kept target ids, in increasing order.
"""

import logging
from collections.abc import Iterable

import torch

from ..modeling_dflash import check_vocab_mapping

logger = logging.getLogger(__name__)


def build_vocab_mapping(counts: torch.Tensor, draft_vocab_size: int, always_keep: Iterable[int] = ()):
    """(d2t, t2d) keeping `always_keep` (e.g. EOS, which ends every answer) and then the most frequent ids.

    Ties, including never-seen ids when the data has fewer distinct tokens than the draft vocabulary, go to the lower
    id, so the mapping is a pure function of the counts.
    """
    vocab_size = counts.shape[0]
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size = {draft_vocab_size}, expected an integer in [1, vocab_size={vocab_size}].")
    keep = sorted({int(t) for t in always_keep})
    if len(keep) > draft_vocab_size:
        raise ValueError(f"{len(keep)} ids must be kept but draft_vocab_size is only {draft_vocab_size}.")
    score = counts.double().clone()
    score[keep] = float("inf")
    order = torch.argsort(-score, stable=True)
    kept = order[:draft_vocab_size].sort().values
    d2t = kept - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    check_vocab_mapping(d2t, t2d, draft_vocab_size, vocab_size)
    return d2t, t2d


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of the counted tokens the pruned vocabulary can propose: an upper bound on its acceptance."""
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0


def target_to_draft_ids(target_ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Draft id of each target id, -1 where the draft cannot propose it."""
    draft_index = torch.cumsum(t2d.long(), 0) - 1
    ids = draft_index.to(target_ids.device)[target_ids]
    return torch.where(t2d.to(target_ids.device)[target_ids], ids, torch.full_like(ids, -1))
