"""`dflash-hf bench`: acceptance length, tokens/s and speed-up on real prompts, against what users would use instead.

One run measures, interleaved per prompt with the same seed: plain `target.generate` (the baseline, and once more as
`target_again`, whose per-prompt ratios are the run's noise floor), our speculative
generate (DFlash and/or DSpark), transformers' built-in `speculation_type="dflash"` on the same DFlash weights,
prompt-lookup decoding, and z-lab's `dflash_generate` (PyPI `dflash`) on the same weights where it can run them.
Under greedy decoding every path must reproduce the baseline token for token; a path that does not stops the run.

Timing is taken the same way for every path: hooks on the target count its forwards and time them, so prefill,
verify, draft and "other" (bookkeeping) time and the per-step acceptance come from one definition, whichever code
drives the loop. The report is a JSON document with a versioned schema (`SCHEMA_VERSION`), a text table and a PNG.

The modules, in the order a run goes through them (every public name is importable from here):

- `datasets`: the prompts (MT-Bench, HumanEval, any JSONL file) as `Sample`s, and a round-robin selection of them.
- `paths`: the path names, `BenchSettings`, and `build_paths`: each way of generating as a `BenchPath`.
- `recorder`: `ForwardRecorder`, the hooks that time every target, lm_head and draft forward.
- `runner`: `run_bench`: every path on every turn, interleaved, with the exactness check.
- `metrics`: the report math (percentiles, tau, ideal speed-up), pure functions over plain numbers.
- `report`: per-path summaries, the JSON report, the text table and the plot.
- `cli`: the `dflash-hf bench` command and the loading of the models it names.
"""

from .cli import EMBEDDED_KINDS, add_parser, load_models, run
from .datasets import (
    BUILTIN_DATASETS,
    HUMANEVAL_INSTRUCTION,
    UNCATEGORIZED,
    DatasetUnavailableError,
    Sample,
    load_samples,
    samples_from_records,
    select_samples,
)
from .metrics import acceptance_from_starts, ideal_speedup, json_safe, percentile, spread, tau
from .paths import (
    BASELINE,
    DEFAULT_PROMPT_LOOKUP_TOKENS,
    FIXED_SUFFIX,
    OURS,
    OURS_LOOKUP,
    POLICIES,
    PROMPT_LOOKUP,
    TARGET_AGAIN,
    TRANSFORMERS_DFLASH,
    WARMUP_NEW_TOKENS,
    ZLAB,
    BenchPath,
    BenchSettings,
    GenerateFn,
    build_paths,
    keep_paths,
)
from .recorder import ForwardLog, ForwardRecorder
from .report import SCHEMA_NAME, SCHEMA_VERSION, build_report, format_table, machine_info, plot_report, summarize_path
from .runner import BenchMismatchError, check_same_tokens, encode_turns, run_bench

__all__ = [
    "BASELINE",
    "BUILTIN_DATASETS",
    "BenchMismatchError",
    "BenchPath",
    "BenchSettings",
    "DEFAULT_PROMPT_LOOKUP_TOKENS",
    "DatasetUnavailableError",
    "EMBEDDED_KINDS",
    "FIXED_SUFFIX",
    "ForwardLog",
    "ForwardRecorder",
    "GenerateFn",
    "HUMANEVAL_INSTRUCTION",
    "OURS",
    "OURS_LOOKUP",
    "POLICIES",
    "PROMPT_LOOKUP",
    "TARGET_AGAIN",
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "Sample",
    "TRANSFORMERS_DFLASH",
    "UNCATEGORIZED",
    "WARMUP_NEW_TOKENS",
    "ZLAB",
    "acceptance_from_starts",
    "add_parser",
    "build_paths",
    "keep_paths",
    "build_report",
    "check_same_tokens",
    "encode_turns",
    "format_table",
    "ideal_speedup",
    "json_safe",
    "load_models",
    "load_samples",
    "machine_info",
    "percentile",
    "plot_report",
    "run",
    "run_bench",
    "samples_from_records",
    "select_samples",
    "spread",
    "summarize_path",
    "tau",
]
