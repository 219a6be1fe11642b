"""Running a bench: every path on every turn of every prompt, interleaved, timed by the hooks, checked for exactness."""

from __future__ import annotations

import logging
import random
import time

import torch

from .datasets import Sample
from .metrics import acceptance_from_starts
from .paths import BASELINE, BenchPath, BenchSettings
from .recorder import ForwardLog, ForwardRecorder

logger = logging.getLogger(__name__)


class BenchMismatchError(RuntimeError):
    """A path produced different tokens from the baseline under greedy decoding: it is not lossless."""


def _record(path: BenchPath, log: ForwardLog, sequence: torch.Tensor, prompt_length: int, wall_s: float) -> dict:
    """One path's measurements for one generate call (plain numbers, as they go into the JSON)."""
    lengths = acceptance_from_starts(log.starts, sequence.shape[-1])
    prefill_s = log.target_s[0] if log.target_s else 0.0
    verify_s = sum(log.target_s[1:])
    if path.stats_draft is not None:
        stats = path.stats_draft.generation_stats
        draft_s = float(stats["time_s"]["draft"])
        own_lengths = list(stats["acceptance_lengths"])
        proposed = [step["k"] for step in stats["policy"]]  # what the length policy chose (0: a decode step)
        costs = stats["cost_estimates_ms"]  # what it weighed, as it stood at the end of the call
    else:
        draft_s = log.draft_module_s + log.head_outside_s
        own_lengths = proposed = costs = None
    record = {
        "new_tokens": int(sequence.shape[-1] - prompt_length),
        "time_s": wall_s,
        "prefill_s": prefill_s,
        "verify_s": verify_s,
        "draft_s": draft_s,
        "other_s": max(wall_s - prefill_s - verify_s - draft_s, 0.0),
        "target_forwards": len(log.starts),
        "acceptance_lengths": lengths,
    }
    if own_lengths is not None:
        record["acceptance_lengths_reported"] = own_lengths
        record["proposed"] = proposed
        record["cost_estimates_ms"] = costs
    return record


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    length = min(a.shape[-1], b.shape[-1])
    unequal = (a[..., :length] != b[..., :length]).reshape(-1).nonzero()
    return int(unequal[0]) if unequal.numel() else length


def check_same_tokens(path_name: str, sample: Sample, turn: int, baseline: torch.Tensor, output: torch.Tensor,
                      prompt_length: int) -> None:
    """Raise `BenchMismatchError` naming the path, prompt and first differing token unless the sequences match."""
    if output.shape == baseline.shape and torch.equal(output.cpu(), baseline.cpu()):
        return
    at = _first_difference(baseline.cpu(), output.cpu())
    base_token = baseline[0, at].item() if at < baseline.shape[-1] else "<end>"
    path_token = output[0, at].item() if at < output.shape[-1] else "<end>"
    raise BenchMismatchError(
        f"path `{path_name}` is not lossless: on sample {sample.id!r} (category {sample.category!r}, turn {turn + 1}) "
        f"its greedy output differs from the baseline at new token {at - prompt_length} "
        f"(baseline {base_token}, {path_name} {path_token}; lengths {baseline.shape[-1] - prompt_length} vs "
        f"{output.shape[-1] - prompt_length} new tokens)."
    )


def encode_turns(tokenizer, history: list[dict], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the conversation so far, ready for the assistant's reply (chat template when there is one)."""
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(history, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)
    else:
        encoded = tokenizer("\n\n".join(message["content"] for message in history), return_tensors="pt")
    input_ids = encoded["input_ids"].to(device)
    attention_mask = encoded.get("attention_mask")
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)
    return input_ids, attention_mask


def _timed_call(path: BenchPath, recorder: ForwardRecorder, input_ids, attention_mask, max_new_tokens, seed):
    random.seed(seed)
    torch.manual_seed(seed)
    recorder.reset()
    start = time.perf_counter()
    with torch.inference_mode():
        sequence = path.generate(input_ids, attention_mask, max_new_tokens)
    wall_s = time.perf_counter() - start
    return sequence, wall_s, recorder.log


def run_bench(target, tokenizer, paths: list[BenchPath], samples: list[Sample], settings: BenchSettings,
              extra_modules: list[torch.nn.Module] = (), progress: bool = True) -> list[dict]:
    """Run every path on every turn of every sample, interleaved, and return the per-generation records.

    Path order rotates from one generation to the next (the baseline included) so no path always runs right after
    another one warmed the caches. Under greedy decoding every path's tokens are checked against the baseline's as
    soon as all paths have run that turn. Later MT-Bench turns follow the baseline's own earlier answers. With
    `settings.repeats` > 1 every path runs that many times per turn (the order rotating again each time) and its
    fastest run is the one recorded (`time_s_runs` keeps them all): on a shared machine noise only adds time, and a
    per-prompt ratio of single runs moved by 7% between identical runs here.
    """
    from tqdm.auto import tqdm

    if not paths or paths[0].name != BASELINE:
        raise ValueError("The first path must be the baseline: every other path is measured against it.")
    device = target.device
    drafts = [p.stats_draft for p in paths if p.stats_draft is not None] + list(extra_modules)
    records: list[dict] = []
    with ForwardRecorder(target, drafts) as recorder:
        if settings.warmup_new_tokens > 0 and samples:
            input_ids, attention_mask = encode_turns(tokenizer, [{"role": "user", "content": samples[0].turns[0]}], device)
            logger.info("warm-up: %d new tokens per path", settings.warmup_new_tokens)
            warm = {p.name: _timed_call(p, recorder, input_ids, attention_mask, settings.warmup_new_tokens,
                                        settings.seed)[0] for p in paths}
            if settings.greedy:
                for path in paths[1:]:
                    check_same_tokens(path.name, samples[0], 0, warm[BASELINE], warm[path.name], input_ids.shape[-1])
        generation = 0
        for index, sample in enumerate(tqdm(samples, desc="bench", unit="prompt", disable=not progress)):
            history: list[dict] = []
            for turn, text in enumerate(sample.turns):
                history.append({"role": "user", "content": text})
                input_ids, attention_mask = encode_turns(tokenizer, history, device)
                prompt_length = input_ids.shape[-1]
                outputs, per_path = {}, {}
                for repeat in range(settings.repeats):
                    shift = (generation + repeat) % len(paths)
                    runs = {}
                    for path in paths[shift:] + paths[:shift]:
                        sequence, wall_s, log = _timed_call(path, recorder, input_ids, attention_mask,
                                                            settings.max_new_tokens, settings.seed + generation)
                        runs[path.name] = sequence
                        record = _record(path, log, sequence, prompt_length, wall_s)
                        kept = per_path.get(path.name)
                        times = (kept["time_s_runs"] if kept else []) + [wall_s]
                        if kept is None or wall_s < kept["time_s"]:  # interference only ever adds time
                            per_path[path.name] = record
                        per_path[path.name]["time_s_runs"] = times
                    if settings.greedy:  # every repeat is checked, not only the kept one
                        for path in paths[1:]:
                            check_same_tokens(path.name, sample, turn, runs[BASELINE], runs[path.name], prompt_length)
                    outputs = outputs or runs
                baseline = outputs[BASELINE]
                records.append({"index": index, "sample": sample.id, "category": sample.category, "turn": turn,
                                "prompt_tokens": int(prompt_length), "paths": per_path})
                answer = tokenizer.decode(baseline[0, prompt_length:], skip_special_tokens=True)
                history.append({"role": "assistant", "content": answer})
                generation += 1
    return records
