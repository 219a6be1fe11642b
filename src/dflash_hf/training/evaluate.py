"""Acceptance of trained drafts on evaluation prompts (MT-Bench, HumanEval), measured the cheap exact way.

The target answers every prompt greedily in one batched pass that also captures the states the drafts read; then each
draft's greedy decode walk over those answers (`trainer.heldout_tau`) gives the tau that speculative decoding of the
same prompts gets (tests/test_training.py checks the walk against `generate(assistant_model=draft)` step for step),
without paying a speculative generation per prompt and per draft. Evaluation prompts are only read here, never
trained on.
"""

import logging
from pathlib import Path

import torch

from .data import batched_chat_generate
from .trainer import heldout_tau

logger = logging.getLogger(__name__)


class MemoryFeatures:
    """The `FeatureStore` interface over in-memory sequences (all of them count as held out)."""

    def __init__(self, items: list[dict], layer_ids: list[int]):
        self.items, self.layer_ids = items, list(layer_ids)

    def __len__(self) -> int:
        return len(self.items)

    def split(self, heldout: bool) -> list[int]:
        return list(range(len(self.items))) if heldout else []

    def sequence(self, index: int) -> dict:
        return self.items[index]


def answer_with_features(target, tokenizer, prompts: list[str], layer_ids: list[int], max_new_tokens: int,
                         batch_size: int) -> MemoryFeatures:
    """The target's greedy answers to `prompts`, with the states of `layer_ids` captured on the way."""
    items = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        for prompt_ids, response_ids, features in batched_chat_generate(
            target, tokenizer, batch, max_new_tokens, capture_layers=layer_ids, do_sample=False
        ):
            items.append({
                "tokens": torch.tensor(prompt_ids + response_ids),
                "loss_mask": torch.tensor([False] * len(prompt_ids) + [True] * len(response_ids)),
                "context": features.context, "final": features.final, "lse": features.lse,
            })
    return MemoryFeatures(items, layer_ids)


def cached_answers(cache: Path | None, target, tokenizer, prompts: list[str], layer_ids: list[int],
                   max_new_tokens: int, batch_size: int) -> MemoryFeatures:
    """`answer_with_features`, kept in `cache` (a .pt file) when given: answering is the slow part, and it depends
    only on the target (and its dtype), the prompts and the layers, not on the drafts being compared."""
    if cache is not None and Path(cache).exists():
        saved = torch.load(cache)
        if saved["prompts"] == prompts and saved["layer_ids"] == list(layer_ids) and \
                saved["max_new_tokens"] == max_new_tokens:
            return MemoryFeatures(saved["items"], layer_ids)
        logger.warning("Ignoring %s: made for other prompts, layers or lengths.", cache)
    store = answer_with_features(target, tokenizer, prompts, layer_ids, max_new_tokens, batch_size)
    if cache is not None:
        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"prompts": prompts, "layer_ids": list(layer_ids), "max_new_tokens": max_new_tokens,
                    "items": store.items}, cache)
    return store


def cache_name(dataset: str, num_prompts: int, max_new_tokens: int, layer_ids, dtype: torch.dtype) -> str:
    """The answers and states depend on the target's dtype too: a float32 and a bfloat16 target get their own file."""
    layers, dtype_name = "-".join(map(str, layer_ids)), str(dtype).removeprefix("torch.")
    return f"{Path(dataset).stem}-{num_prompts}p-{max_new_tokens}t-layers{layers}-{dtype_name}.pt"


def prompt_set_tau(drafts: dict, target, tokenizer, prompts: list[str], max_new_tokens: int = 128,
                   batch_size: int = 16, cache_dir: Path | None = None, dataset: str = "prompts") -> dict:
    """{draft name: heldout_tau dict} for drafts reading the same target layers (answers are generated once)."""
    by_layers: dict[tuple, list[str]] = {}
    for name, draft in drafts.items():
        draft.bind_target(target)
        by_layers.setdefault(tuple(draft.config.target_layer_ids), []).append(name)
    results = {}
    for layer_ids, names in by_layers.items():
        file = cache_name(dataset, len(prompts), max_new_tokens, layer_ids, target.dtype)
        cache = Path(cache_dir) / file if cache_dir else None
        store = cached_answers(cache, target, tokenizer, prompts, list(layer_ids), max_new_tokens, batch_size)
        for name in names:
            results[name] = heldout_tau(drafts[name], store, store.split(heldout=True))
            logger.info("%s: tau %.3f over %d prompts", name, results[name]["tau_decode"], len(prompts))
    return results
