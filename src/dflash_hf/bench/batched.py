"""`dflash-hf bench --batch-size B [B ...]`: batches of prompts, ours against plain batched generate.

For each batch size the samples' first turns are cut into consecutive batches of B (ragged lengths, left-padded as
transformers' batched generate takes them); every batch runs through plain `target.generate` and through each of our
drafts, in rotating order, and under greedy decoding every row must equal the baseline's. Throughput counts each
row's real new tokens (up to and including its EOS, not the padding after it). Per-row tau is each row's own tokens
per target forward it took part in, averaged over rows.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from .metrics import percentile
from .paths import BASELINE, FIXED_SUFFIX, OURS, BenchSettings
from .runner import BenchMismatchError


def encode_batch(tokenizer, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask of the prompts (chat template applied where there is one)."""
    if getattr(tokenizer, "chat_template", None):
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                 tokenize=False) for p in prompts]
        kwargs = {"add_special_tokens": False}
    else:
        kwargs = {}
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        encoded = tokenizer(prompts, padding=True, return_tensors="pt", **kwargs)
    finally:
        tokenizer.padding_side = side
    return encoded["input_ids"].to(device), encoded["attention_mask"].to(device)


def new_token_counts(sequences: torch.Tensor, prompt_width: int, eos_ids: set[int]) -> list[int]:
    """Each row's generated tokens up to and including its first EOS (what follows is padding)."""
    counts = []
    for row in sequences[:, prompt_width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos_ids), len(row))
        counts.append(end)
    return counts


def _paths(target, drafts: dict, settings: BenchSettings, pad_token_id) -> dict:
    config = copy.deepcopy(target.generation_config)
    config.update(do_sample=not settings.greedy, pad_token_id=pad_token_id, max_new_tokens=settings.max_new_tokens)
    if not settings.greedy:
        config.temperature = settings.temperature

    def plain(ids, mask):
        return target.generate(ids, attention_mask=mask, generation_config=config), None

    def speculative(draft, policy):
        ours = copy.deepcopy(config)
        settings.apply_to(ours, policy)

        def run(ids, mask):
            out = target.generate(ids, attention_mask=mask, assistant_model=draft, generation_config=ours)
            return out, draft.generation_stats

        return run

    paths = {BASELINE: plain}
    for policy in ("auto", "fixed") if settings.policy == "both" else (settings.policy,):
        suffix = FIXED_SUFFIX if settings.policy == "both" and policy == "fixed" else ""
        paths |= {OURS[kind] + suffix: speculative(draft, policy) for kind, draft in drafts.items()}
    return paths


def row_taus(stats: dict | None) -> list[float]:
    """Per-row tau from a call's stats (one sequence: its tau; a batch: each row's), of the rows that took part in a
    verify step (a row done at its first token has none)."""
    if stats is None:
        return []
    rows = stats["rows"] if "rows" in stats else [stats]
    return [row["mean_acceptance_length"] for row in rows if row["acceptance_lengths"]]


def run_batched_bench(target, tokenizer, drafts: dict, samples, settings: BenchSettings, batch_sizes: list[int],
                      progress: bool = True) -> dict:
    """Every batch size, every batch, every path (rotating), checked against the baseline under greedy decoding."""
    from tqdm.auto import tqdm

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = target.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    paths = _paths(target, drafts, settings, pad)
    names = list(paths)
    prompts = [sample.turns[0] for sample in samples]
    # Warm every path (first calls pay for allocation and the policy's first measurements).
    ids, mask = encode_batch(tokenizer, prompts[: max(batch_sizes)], target.device)
    for name in names:
        torch.manual_seed(settings.seed)
        with torch.inference_mode():
            paths[name](ids, mask)
    results = {}
    call = 0
    for size in batch_sizes:
        per_path = {name: {"time_s": 0.0, "tokens": 0, "speedups": [], "row_taus": []} for name in names}
        batches = [prompts[i : i + size] for i in range(0, len(prompts), size)]
        for batch in tqdm(batches, desc=f"batch {size}", disable=not progress):
            ids, mask = encode_batch(tokenizer, batch, target.device)
            shift = call % len(names)
            outputs, seconds = {}, {}
            for name in names[shift:] + names[:shift]:
                torch.manual_seed(settings.seed + call)
                start = time.perf_counter()
                with torch.inference_mode():
                    sequences, stats = paths[name](ids, mask)
                seconds[name] = time.perf_counter() - start
                outputs[name] = sequences
                per_path[name]["row_taus"] += row_taus(stats)
            call += 1
            tokens = sum(new_token_counts(outputs[BASELINE], ids.shape[1], eos_ids))
            for name in names:
                if settings.greedy and outputs[name].tolist() != outputs[BASELINE].tolist():
                    raise BenchMismatchError(f"path `{name}` at batch size {size} differs from plain batched "
                                             f"generate on the batch starting with {batch[0][:60]!r}.")
                per_path[name]["time_s"] += seconds[name]
                per_path[name]["tokens"] += tokens
                per_path[name]["speedups"].append(seconds[BASELINE] / seconds[name])
        base_rate = per_path[BASELINE]["tokens"] / per_path[BASELINE]["time_s"]
        results[size] = {
            name: {
                "tokens_per_s": entry["tokens"] / entry["time_s"],
                "throughput_vs_plain": entry["tokens"] / entry["time_s"] / base_rate,
                "median_batch_speedup": statistics.median(entry["speedups"]),
                "worst_batch_speedup": min(entry["speedups"]),
                "p10_batch_speedup": percentile(entry["speedups"], 10),
                "row_tau": statistics.fmean(entry["row_taus"]) if entry["row_taus"] else None,
                "batches": len(entry["speedups"]),
                "tokens": entry["tokens"],
            }
            for name, entry in per_path.items()
        }
    return results


def format_batched_table(results: dict) -> str:
    lines = [f"{'B':>3} {'path':<20} {'tok/s':>8} {'vs plain':>9} {'median':>7} {'worst':>6} {'row tau':>8}"]
    for size, per_path in results.items():
        for name, r in per_path.items():
            tau = "" if r["row_tau"] is None else f"{r['row_tau']:.2f}"
            lines.append(f"{size:>3} {name:<20} {r['tokens_per_s']:>8.1f} {r['throughput_vs_plain']:>8.2f}x "
                         f"{r['median_batch_speedup']:>6.2f}x {r['worst_batch_speedup']:>5.2f}x {tau:>8}")
    return "\n".join(lines)


__all__ = ["encode_batch", "format_batched_table", "new_token_counts", "row_taus", "run_batched_bench"]
