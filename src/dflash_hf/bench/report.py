"""The bench's results: per-path summaries, the JSON report (versioned schema), the text table and the PNG."""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import torch

from .metrics import _ratio, ideal_speedup, json_safe, spread, tau
from .paths import BASELINE, TARGET_AGAIN, BenchPath, BenchSettings

SCHEMA_NAME = "dflash-hf-bench"
# Bump on any change a reader of the JSON would notice (renamed, removed or re-defined fields).
SCHEMA_VERSION = 1


# ----------------------------------------------------------------------------------------------------------------------
# Summaries
# ----------------------------------------------------------------------------------------------------------------------


def _sum(records: list[dict], name: str, key: str) -> float:
    return sum(record["paths"][name][key] for record in records)


def summarize_path(records: list[dict], name: str, decode_step_s: float, greedy: bool) -> dict:
    """One path's figures from the per-generation records (and the baseline's, present in the same records)."""
    lengths = [n for record in records for n in record["paths"][name]["acceptance_lengths"]]
    steps = len(lengths)
    tokens, wall = _sum(records, name, "new_tokens"), _sum(records, name, "time_s")
    prefill, verify, draft = (_sum(records, name, k) for k in ("prefill_s", "verify_s", "draft_s"))
    other = _sum(records, name, "other_s")
    base_tokens, base_wall = _sum(records, BASELINE, "new_tokens"), _sum(records, BASELINE, "time_s")
    base_prefill = _sum(records, BASELINE, "prefill_s")

    per_prompt: dict = {}  # sample (all its turns) -> [path tokens, path s, baseline tokens, baseline s]
    for record in records:
        entry = per_prompt.setdefault(record["index"], [0, 0.0, 0, 0.0])
        path, base = record["paths"][name], record["paths"][BASELINE]
        entry[0] += path["new_tokens"]
        entry[1] += path["time_s"]
        entry[2] += base["new_tokens"]
        entry[3] += base["time_s"]
    ratios = [_ratio(t / s, bt / bs) for t, s, bt, bs in per_prompt.values() if s > 0 and bs > 0]

    categories: dict[str, list[int]] = {}
    for record in records:
        categories.setdefault(record["category"], []).extend(record["paths"][name]["acceptance_lengths"])
    tau_value = tau(lengths)
    verify_step = _ratio(verify, steps)
    draft_step = _ratio(draft, steps)
    ideal = ideal_speedup(tau_value, decode_step_s, verify_step, draft_step)
    decode_speedup = _ratio(_ratio(tokens, wall - prefill), _ratio(base_tokens, base_wall - base_prefill))
    reported = [n for record in records for n in record["paths"][name].get("acceptance_lengths_reported", [])]
    summary = {
        "status": "ok",
        "tau": tau_value,
        "tokens_per_s": _ratio(tokens, wall),
        "speedup": spread(ratios)["median"],
        "speedup_per_prompt": spread(ratios),
        "speedup_aggregate": _ratio(_ratio(tokens, wall), _ratio(base_tokens, base_wall)),
        "decode_speedup": decode_speedup,
        "ideal_speedup": ideal,
        "efficiency": _ratio(decode_speedup, ideal),
        "tau_per_category": {category: tau(values) for category, values in sorted(categories.items())},
        "acceptance_histogram": {str(k): v for k, v in sorted(Counter(lengths).items())},
        "new_tokens": int(tokens),
        "generations": len(records),
        "verify_steps": steps,
        "time_s": {"total": wall, "prefill": prefill, "verify": verify, "draft": draft, "other": other},
        "time_share": {key: _ratio(value, wall) for key, value in
                       (("prefill", prefill), ("verify", verify), ("draft", draft), ("other", other))},
        "per_step_ms": {"verify": 1e3 * verify_step, "draft": 1e3 * draft_step},
        "exact": True if greedy else None,
    }
    if reported:
        summary["tau_reported_by_draft"] = tau(reported)
    return summary


def _load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def cpu_name() -> str:
    """The CPU's model name (a speed claim names it: CPUs with and without AMX differ several-fold)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def machine_info() -> dict:
    import transformers

    def version(dist: str):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        # Other processes share these cores: the load says how much the timings can be trusted.
        "load_average_1m": _load_average(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dflash_hf": version("dflash-hf"),
        "dflash_zlab": version("dflash"),
    }


def build_report(records: list[dict], paths: list[BenchPath], skipped: dict[str, str], settings: BenchSettings,
                 dataset: dict, models: dict, machine: dict | None = None) -> dict:
    """The JSON document: schema, machine, settings, per-path figures, and the raw per-generation records."""
    base_steps = sum(len(record["paths"][BASELINE]["acceptance_lengths"]) for record in records)
    decode_step_s = _ratio(_sum(records, BASELINE, "verify_s"), base_steps)
    summaries = {path.name: {"description": path.description, "speculative": path.speculative,
                             **summarize_path(records, path.name, decode_step_s, settings.greedy)} for path in paths}
    for name, reason in skipped.items():
        summaries[name] = {"status": "skipped", "reason": reason}
    return json_safe({
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine if machine is not None else machine_info(),
        "settings": {
            "dataset": dataset,
            "max_new_tokens": settings.max_new_tokens,
            "temperature": settings.temperature,
            "greedy": settings.greedy,
            "seed": settings.seed,
            "warmup_new_tokens": settings.warmup_new_tokens,
            "prompt_lookup_num_tokens": settings.prompt_lookup_num_tokens,
            "policy": settings.policy,
            "verify_matmul": settings.verify_matmul,
            "confidence_threshold": settings.confidence_threshold,
            "repeats": settings.repeats,
            "models": models,
            "path_order": "rotated by one path per generation (and per repeat)",
        },
        "baseline_decode_ms": 1e3 * decode_step_s,
        "exact": True if settings.greedy else None,
        "paths": summaries,
        "generations": records,
    })


# ----------------------------------------------------------------------------------------------------------------------
# Table and plot
# ----------------------------------------------------------------------------------------------------------------------


def _fmt(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_table(report: dict) -> str:
    """A readable summary: one row per path, then tau per category."""
    lines = []
    settings, machine = report["settings"], report["machine"]
    lines.append(f"machine: {machine.get('cpu')}, {machine.get('cores')} cores, torch {machine.get('torch')}, "
                 f"transformers {machine.get('transformers')}, load average {_fmt(machine.get('load_average_1m'), '.1f')}"
                 f" -> {_fmt(machine.get('load_average_1m_end'), '.1f')}")
    lines.append(f"dataset {settings['dataset']['name']}: {settings['dataset']['samples']} prompts, "
                 f"{settings['dataset']['generations']} generations, max_new_tokens {settings['max_new_tokens']}, "
                 f"temperature {settings['temperature']}; "
                 f"baseline decode step {_fmt(report['baseline_decode_ms'], '.1f')} ms")
    header = (f"{'path':<20} {'tau':>5} {'tok/s':>7} {'speedup':>8} {'[q25-q75]':>13} {'worst':>6} {'decode':>7} {'ideal':>6} "
              f"{'eff':>5} {'verify':>7} {'draft':>6} {'prefill':>7} {'other':>6}")
    lines += [header, "-" * len(header)]
    ok = {name: p for name, p in report["paths"].items() if p["status"] == "ok"}
    for name, p in ok.items():
        s, share = p["speedup_per_prompt"], p["time_share"]
        lines.append(
            f"{name:<20} {_fmt(p['tau'], '5.2f')} {_fmt(p['tokens_per_s'], '7.2f')} {_fmt(p['speedup'], '7.2f')}x "
            f"{'[' + _fmt(s['q25'], '.2f') + '-' + _fmt(s['q75'], '.2f') + ']':>13} {_fmt(s['min'], '5.2f')}x "
            f"{_fmt(p['decode_speedup'], '6.2f')}x {_fmt(p['ideal_speedup'], '5.2f')}x {_fmt(p['efficiency'], '5.2f')} "
            f"{_fmt(100 * share['verify'], '6.0f')}% {_fmt(100 * share['draft'], '5.0f')}% "
            f"{_fmt(100 * share['prefill'], '6.0f')}% {_fmt(100 * share['other'], '5.0f')}%")
    for name, p in report["paths"].items():
        if p["status"] == "skipped":
            lines.append(f"{name:<20} skipped: {p['reason']}")
    categories = sorted({c for p in ok.values() for c in p["tau_per_category"]})
    if len(categories) > 1:
        lines.append("")
        lines.append("tau per category")
        lines.append(f"{'path':<20} " + " ".join(f"{c[:10]:>10}" for c in categories))
        for name, p in ok.items():
            if name != BASELINE:
                lines.append(f"{name:<20} " + " ".join(f"{_fmt(p['tau_per_category'].get(c), '10.2f')}"
                                                        for c in categories))
    lines.append("")
    lines.append("speedup: median over prompts of (path tok/s / baseline tok/s); worst: the slowest prompt's; decode: the same excluding prefill; "
                 "ideal: tau x decode step / (verify step + draft step); eff = decode / ideal.")
    if TARGET_AGAIN in ok:
        lines.append(f"{TARGET_AGAIN}: the target alone, run again: its spread is this run's noise floor.")
    if report["exact"]:
        lines.append("every path reproduced the baseline's greedy tokens exactly.")
    return "\n".join(lines)


def plot_report(report: dict, out_path: str | Path) -> None:
    """Acceptance-length histogram of the speculative paths, and speed-up bars (median, IQR, ideal)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {name: p for name, p in report["paths"].items() if p["status"] == "ok"}
    speculative = [name for name, p in ok.items() if p["speculative"]]
    figure, (hist_ax, bar_ax) = plt.subplots(1, 2, figsize=(13, 4.8))
    max_len = max([int(k) for name in speculative for k in ok[name]["acceptance_histogram"]] + [1])
    width = 0.8 / max(len(speculative), 1)
    for i, name in enumerate(speculative):
        histogram = ok[name]["acceptance_histogram"]
        total = sum(histogram.values()) or 1
        xs = list(range(1, max_len + 1))
        hist_ax.bar([x + (i - (len(speculative) - 1) / 2) * width for x in xs],
                    [histogram.get(str(x), 0) / total for x in xs], width=width,
                    label=f"{name} (tau {ok[name]['tau']:.2f})")
    hist_ax.set_xlabel("tokens emitted per verify step (acceptance length)")
    hist_ax.set_ylabel("share of steps")
    hist_ax.set_title("acceptance lengths")
    hist_ax.legend(fontsize=8)

    names = list(ok)
    medians = [ok[n]["speedup"] or 0.0 for n in names]
    low = [max(m - (ok[n]["speedup_per_prompt"]["q25"] or m), 0.0) for n, m in zip(names, medians)]
    high = [max((ok[n]["speedup_per_prompt"]["q75"] or m) - m, 0.0) for n, m in zip(names, medians)]
    bar_ax.bar(range(len(names)), medians, yerr=[low, high], capsize=4, color="tab:blue", label="measured (median, IQR)")
    ideal = [ok[n]["ideal_speedup"] if ok[n]["ideal_speedup"] is not None else float("nan") for n in names]
    bar_ax.scatter(range(len(names)), ideal, marker="_", s=400, color="tab:red",
                   zorder=3, label="ideal given tau and step costs")
    bar_ax.axhline(1.0, color="grey", linewidth=0.8)
    bar_ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    bar_ax.set_ylabel("speed-up vs target.generate")
    bar_ax.set_title(f"{report['settings']['dataset']['name']}: speed-up ({report['machine']['cpu'][:40]})")
    bar_ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out_path, dpi=110)
    plt.close(figure)
