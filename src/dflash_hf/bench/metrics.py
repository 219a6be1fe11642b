"""Report math: pure functions over plain numbers (the tests check them by hand)."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def spread(values: list[float]) -> dict:
    """Median and spread of per-prompt ratios: a few slow prompts should not hide in a mean."""
    q25, q75 = percentile(values, 25), percentile(values, 75)
    return {
        "n": len(values),
        "median": percentile(values, 50),
        "q25": q25,
        "q75": q75,
        "iqr": q75 - q25,
        "min": min(values) if values else float("nan"),
        "max": max(values) if values else float("nan"),
    }


def acceptance_from_starts(starts: list[int], final_length: int) -> list[int]:
    """Tokens emitted by each verify forward, from where each target forward started.

    `starts[i]` is the number of tokens already in the target's cache when forward i ran (0 for the prefill).
    Every loop here crops the cache to all verified tokens but the newest, so forward i+1 starting at
    `starts[i+1]` means forward i emitted `starts[i+1] - starts[i]` tokens; the last one emitted up to the final
    sequence length (its cache would start at `final_length - 1`). The prefill emits one token and is not a step.
    """
    if len(starts) < 2:
        return []
    ends = starts[2:] + [final_length - 1]
    return [end - start for start, end in zip(starts[1:], ends)]


def tau(acceptance_lengths: list[int]) -> float:
    """Mean tokens emitted per verify forward, counting the bonus token (1.0 for plain decoding)."""
    return sum(acceptance_lengths) / len(acceptance_lengths) if acceptance_lengths else float("nan")


def ideal_speedup(tau_value: float, decode_s: float, verify_s: float, draft_s: float) -> float:
    """What the decode phase would gain with no overhead: tau tokens per step that costs one verify plus one draft,
    against one token per plain decode step (all per-step times measured in the same run)."""
    step = verify_s + draft_s
    return tau_value * decode_s / step if step > 0 else float("nan")


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else float("nan")


def json_safe(value):
    """NaN/inf -> None, recursively: the report must be strict JSON (NaN is not) for any reader."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value
