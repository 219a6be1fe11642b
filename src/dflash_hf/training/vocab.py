"""Pruned draft vocabulary: keep the target ids the assistant actually writes; `dflash-hf prune-vocab` prunes a
trained draft after the fact (again, to another size or corpus, when it borrows the target's head).

The draft's output head over the full vocabulary dominates its cost on small targets (REFERENCE section 8), and most
ids never appear in answers. The mapping follows the speculators convention that `check_vocab_mapping` enforces:
`d2t[i]` is the offset of draft id i (target id = i + d2t[i]) and `t2d` marks the kept target ids, in increasing order.
"""

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from ..modeling_dflash import check_vocab_mapping, vocab_maps

logger = logging.getLogger(__name__)


def most_frequent_ids(counts: torch.Tensor, draft_vocab_size: int, always_keep: Iterable[int] = ()) -> torch.Tensor:
    """The sorted target ids a pruned vocabulary keeps: `always_keep` (e.g. EOS, which ends every answer), then the
    most frequent ids.

    Ties, including never-seen ids when the data has fewer distinct tokens than the draft vocabulary, go to the lower
    id, so the choice is a pure function of the counts.
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
    return order[:draft_vocab_size].sort().values


def build_vocab_mapping(counts: torch.Tensor, draft_vocab_size: int, always_keep: Iterable[int] = ()):
    """(d2t, t2d) of `most_frequent_ids`."""
    d2t, t2d = vocab_maps(most_frequent_ids(counts, draft_vocab_size, always_keep), counts.shape[0])
    check_vocab_mapping(d2t, t2d, draft_vocab_size, counts.shape[0])
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


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "prune-vocab", help="make a draft propose only the ids a corpus's answers use most (faster, still lossless); "
                            "a pruned draft that borrows the target's head can be pruned again, to any size")
    parser.add_argument("draft", help="the draft: folder or Hub id, any dialect `dflash-hf convert` reads")
    parser.add_argument("--out", type=Path, required=True, help="folder for the pruned draft (ours, trust_remote_code)")
    parser.add_argument("--size", type=int, required=True, help="how many target ids the draft keeps")
    parser.add_argument("--corpus", type=Path, default=None,
                        help="corpus folder whose answers are counted (default: the committed SmolLM2 corpus)")
    parser.add_argument("--target", default=None,
                        help="the target, for its EOS ids, always kept (default: the embedded SmolLM2-135M)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.set_defaults(func=run_prune)


def run_prune(args) -> int:
    from ..defaults import load_target
    from ..formats import export_draft, load_draft
    from .corpus_shards import DEFAULT_CORPUS_DIR, answer_token_counts
    from .data import eos_ids
    from .trainer import vocabulary_copy

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    corpus = args.corpus or DEFAULT_CORPUS_DIR
    draft = load_draft(args.draft)
    target, tokenizer = load_target(args.target, "float32")
    counts = answer_token_counts(corpus, draft.config.vocab_size)
    if not int(counts.sum()):
        raise ValueError(f"--corpus: {corpus} has no answer shards to count.")
    was = coverage(counts, draft.t2d.cpu()) if draft.config.drafts_pruned_vocab else 1.0
    draft = vocabulary_copy(draft, most_frequent_ids(counts, args.size, always_keep=eos_ids(tokenizer, target)))
    export_draft(draft, args.out, "hf", overwrite=args.overwrite)
    print(json.dumps({"out": str(args.out), "draft_vocab_size": args.size,
                      "coverage": round(coverage(counts, draft.t2d.cpu()), 4), "coverage_before": round(was, 4),
                      "answer_tokens": int(counts.sum())}))
    return 0
