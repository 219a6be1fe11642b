"""The target's answers to the `corpus` prompts, as compact committed shards (written by `dflash-hf corpus`).

A shard holds the answers to one fixed slice of one part: prompt `i` of part `p` belongs to shard
`crc32(id) % SHARDS[p]`, so every machine assigns the same prompts to the same shard whatever it has already done,
and a run only writes shards that are missing. A shard is one `.npz` (numpy's zip, deflate-compressed) of uint16
token ids: the answers always, the chat-templated prompt ids only where the prompt may be committed (for prompts mined
from installed packages the ids are rebuilt from those packages; a crc32 of the ids checks that the rebuild matches).
Prompt and answer lengths give back the loss mask. Features are not stored: the trainer recomputes them.
"""

import json
import logging
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from . import corpus
from .continuous_batching import continuous_generate
from .data import DataConfig, chat_ids, eos_ids, is_heldout, read_jsonl

logger = logging.getLogger(__name__)

FORMAT = 1
# About 60-90 prompts a shard: minutes of one CPU core each. Never change a count: it decides which shard holds what.
SHARDS = {"mined": 1024, "topics": 96, "written": 32, "tasks": 96, "studies": 96}
BASE_PARTS = tuple(SHARDS)
PREFIX_PARTS = {"mined": "mined", "topic": "topics", "written": "written", "task": "tasks",
                "study": "studies"}  # item id prefix -> part
WRITTEN_FILE = "written_prompts.jsonl"
WRITTEN_PROMPTS = 1000  # the target's own questions: they cost generation, so a modest share
DEFAULT_CORPUS_DIR = Path("data") / "smollm2-135m"
UINT16_MAX = np.iinfo(np.uint16).max


@dataclass
class GenerationConfig:
    """How the target answers: greedy mostly, one prompt in `sample_every` sampled."""

    max_new_tokens: int = 256
    batch_size: int = 32
    sample_every: int = 4
    temperature: float = 0.7
    top_k: int = 50  # generate's default, which the shards written before continuous batching were sampled with
    top_p: float = 0.9


def shard_name(part: str, index: int) -> str:
    return f"{part}-{index:04d}"


def shard_part(name: str) -> str:
    """`shard_name`'s part: "derived-topics-0003" -> "derived-topics"."""
    return name.rsplit("-", 1)[0]


def shard_of(item_id: str, part: str) -> int:
    return corpus.stable_hash(item_id) % SHARDS[part.removeprefix("derived-")]


def is_sampled(item_id: str, sample_every: int) -> bool:
    return sample_every > 0 and corpus.stable_hash(item_id + "|sample") % sample_every == 0


def to_uint16(field: str, ids) -> np.ndarray:
    """`ids` as uint16, or a clear error: the format cannot hold vocabularies above 65,536 ids."""
    array = np.asarray(ids, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() > UINT16_MAX):
        raise ValueError(f"{field}: token id {int(array.max())} does not fit in uint16 (vocabulary above 65536 ids); "
                         "this shard format only holds smaller vocabularies.")
    return array.astype(np.uint16)


def ids_crc(ids) -> int:
    return zlib.crc32(to_uint16("prompt_ids", ids).tobytes())


# ----------------------------------------------------------------------------------------------------------------------
# Shard files
# ----------------------------------------------------------------------------------------------------------------------


def write_shard(path: Path, records: list[dict], meta: dict) -> None:
    """Records (`id`, `source`, `prompt_ids` or None, `prompt_crc`, `answer_ids`, `sampled`, `finished`) into one
    compressed file, renamed into place when complete so a kill never leaves half a shard."""
    prompts = [r["prompt_ids"] or [] for r in records]
    arrays = {
        "prompt_tokens": to_uint16("prompt_ids", [t for p in prompts for t in p]),
        "prompt_lengths": np.array([len(p) for p in prompts], dtype=np.int32),
        "prompt_crc": np.array([r["prompt_crc"] for r in records], dtype=np.uint32),
        "answer_tokens": to_uint16("answer_ids", [t for r in records for t in r["answer_ids"]]),
        "answer_lengths": np.array([len(r["answer_ids"]) for r in records], dtype=np.int32),
        "sampled": np.array([r["sampled"] for r in records], dtype=np.uint8),
        "finished": np.array([r["finished"] for r in records], dtype=np.uint8),
        "meta": np.frombuffer(json.dumps({**meta, "format": FORMAT, "ids": [r["id"] for r in records],
                                          "sources": [r["source"] for r in records]}).encode(), dtype=np.uint8),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    tmp.replace(path)


def read_shard(path: Path) -> tuple[dict, list[dict]]:
    """(meta, records) of one shard; `prompt_ids` is None where the prompt must be rebuilt."""
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    meta = json.loads(arrays.pop("meta").tobytes().decode())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: shard format {meta.get('format')}, this code reads {FORMAT}.")
    prompt_ends = np.cumsum(arrays["prompt_lengths"])
    answer_ends = np.cumsum(arrays["answer_lengths"])
    records = []
    for i, item_id in enumerate(meta["ids"]):
        prompt = arrays["prompt_tokens"][prompt_ends[i] - arrays["prompt_lengths"][i] : prompt_ends[i]]
        answer = arrays["answer_tokens"][answer_ends[i] - arrays["answer_lengths"][i] : answer_ends[i]]
        records.append({"id": item_id, "source": meta["sources"][i],
                        "prompt_ids": prompt.astype(np.int64).tolist() if len(prompt) else None,
                        "prompt_crc": int(arrays["prompt_crc"][i]), "answer_ids": answer.astype(np.int64).tolist(),
                        "sampled": bool(arrays["sampled"][i]), "finished": bool(arrays["finished"][i])})
    return meta, records


def shard_paths(directory: Path) -> list[Path]:
    return sorted((Path(directory) / "shards").glob("*-[0-9][0-9][0-9][0-9].npz"))


# ----------------------------------------------------------------------------------------------------------------------
# The prompts of each shard
# ----------------------------------------------------------------------------------------------------------------------


class Corpus:
    """The prompts of a corpus folder, built on first use (mining installed packages takes a minute or two)."""

    def __init__(self, directory: Path, packages=tuple(corpus.MINED_PACKAGES)):
        self.directory = Path(directory)
        self.packages = packages
        self._parts: dict[str, dict[int, list[dict]]] = {}
        self._overlap = None
        self.stats: dict = {}

    @property
    def overlap(self) -> corpus.EvalOverlap:
        if self._overlap is None:
            self._overlap = corpus.EvalOverlap.from_installed()
        return self._overlap

    def part(self, part: str) -> dict[int, list[dict]]:
        """{shard index: items} of a base part."""
        if part not in self._parts:
            if part == "mined":
                items = corpus.mined_items(self.packages)
            elif part == "topics":
                items = corpus.topic_items()
            elif part == "tasks":
                items = corpus.task_items()
            elif part == "studies":
                items = corpus.study_items()
            else:
                items = corpus.written_items(read_jsonl(self.directory / WRITTEN_FILE))
            items = corpus.finalize(items, self.overlap, self.stats)
            shards: dict[int, list[dict]] = {}
            for item in items:
                shards.setdefault(shard_of(item["id"], part), []).append(item)
            self._parts[part] = shards
        return self._parts[part]

    def items(self, part: str, index: int, tokenizer=None) -> list[dict]:
        """The prompts of one shard; a derived shard needs its parent shard written (and the tokenizer)."""
        if not part.startswith("derived-"):
            return self.part(part).get(index, [])
        parent_part = part.removeprefix("derived-")
        parent_path = self.directory / "shards" / f"{shard_name(parent_part, index)}.npz"
        if not parent_path.exists():
            return []
        by_id = {item["id"]: item for item in self.part(parent_part).get(index, [])}
        derived = []
        for record in read_shard(parent_path)[1]:
            parent = by_id.get(record["id"])
            if parent is None:
                continue  # a prompt this machine's packages no longer produce
            answer = tokenizer.decode(record["answer_ids"], skip_special_tokens=True)
            item = corpus.derived_item(parent, answer, len(record["answer_ids"]), record["finished"])
            if item is not None:
                derived.append(item)
        return corpus.finalize(derived, self.overlap, self.stats) if derived else []

    def item_index(self, ids: set[str], tokenizer) -> dict[str, dict]:
        """The items with these ids, from whichever parts they come from (for rebuilding prompts)."""
        found = {}
        for part in BASE_PARTS:
            for items in self.part(part).values():
                found.update({item["id"]: item for item in items if item["id"] in ids})
        for part, index in sorted(_derived_shards(ids)):
            found.update({item["id"]: item for item in self.items(part, index, tokenizer) if item["id"] in ids})
        return found


def _derived_shards(ids: set[str]) -> set[tuple[str, int]]:
    """(part, index) of the derived shards holding these ids (`derived:<parent id>:<kind>`)."""
    found = set()
    for item_id in ids:
        if item_id.startswith("derived:"):
            parent = item_id.removeprefix("derived:").rsplit(":", 1)[0]
            part = PREFIX_PARTS[parent.split(":", 1)[0]]
            found.add((f"derived-{part}", shard_of(parent, part)))
    return found


def prompt_ids(tokenizer, item: dict) -> list[int]:
    return chat_ids(tokenizer, item["messages"])


# ----------------------------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------------------------


def answer_order(items: list[dict], prompts: dict[str, list[int]], sample_every: int) -> list[dict]:
    """`items` greedy first, then sampled, each by prompt length: rows decoded side by side have prompts of similar
    length (less padding in the cache), and only the rows around the seam run the samplers' warpers (a top-p sort
    over the whole vocabulary costs a fifth of a CPU decode step for a batch)."""
    return sorted(items, key=lambda i: (is_sampled(i["id"], sample_every), len(prompts[i["id"]]), i["id"]))


def answer_items(target, tokenizer, items: list[dict], config: GenerationConfig, seed: int) -> dict[str, dict]:
    """{id: record} of the target's answers to `items`, taken in `answer_order` by a continuously refilled batch."""
    eos = eos_ids(tokenizer, target)
    prompts = {item["id"]: prompt_ids(tokenizer, item) for item in items}
    ordered = answer_order(items, prompts, config.sample_every)
    sampled = [is_sampled(i["id"], config.sample_every) for i in ordered]
    answers = continuous_generate(target, [prompts[i["id"]] for i in ordered], config.max_new_tokens, eos,
                                  config.batch_size, sampled, config.temperature, config.top_k, config.top_p, seed)
    return {item["id"]: {"id": item["id"], "source": item["source"],
                         "prompt_ids": None if item["mined"] else prompts[item["id"]],
                         "prompt_crc": ids_crc(prompts[item["id"]]), "answer_ids": answer, "sampled": was_sampled,
                         "finished": bool(answer and answer[-1] in eos)}
            for item, was_sampled, answer in zip(ordered, sampled, answers)}


def shard_schedule(parts=BASE_PARTS) -> list[tuple[str, int]]:
    """(part, index) in generation order: shard k of every part, then the derived shards of k - 1 (whose parents are
    written by then), for k = 0, 1, ..., so that a partial corpus already mixes every source."""
    order = []
    for index in range(max(SHARDS[p] for p in parts) + 1):
        order += [(part, index) for part in parts if index < SHARDS[part]]
        order += [(f"derived-{part}", index - 1) for part in parts if 0 < index <= SHARDS[part]]
    return order


def generate_corpus(target, tokenizer, directory: Path, config: GenerationConfig, max_minutes: float | None = None,
                    written_prompts: int = WRITTEN_PROMPTS, parts=BASE_PARTS, corpus_obj: Corpus | None = None,
                    target_name: str = "", worker: tuple[int, int] = (0, 1), min_pass_items: int = 96) -> int:
    """Write missing shards in `shard_schedule` order until done or `max_minutes` pass; returns shards written.

    Missing shards are answered together, at least `min_pass_items` prompts a pass, and each is written as soon as its
    pass ends. `worker` (i, n): only shards whose index is i modulo n, for n workers sharing the corpus.
    """
    directory = Path(directory)
    deadline = time.time() + 60 * max_minutes if max_minutes else None
    corpus_obj = corpus_obj or Corpus(directory)
    if "written" in parts and written_prompts:
        write_written_prompts(target, tokenizer, directory / WRITTEN_FILE, written_prompts, config.batch_size)
    versions = corpus.package_versions()
    written = 0
    pending: list[tuple[str, int, list[dict]]] = []

    def answer_pending() -> int:
        started = time.time()
        items = [item for _, _, shard_items in pending for item in shard_items]
        names = "+".join(shard_name(part, index) for part, index, _ in pending)
        records = answer_items(target, tokenizer, items, config, seed=corpus.stable_hash(names))
        seconds = time.time() - started
        tokens = sum(len(r["answer_ids"]) for r in records.values())
        for part, index, shard_items in pending:
            meta = {"part": part, "index": index, "target": target_name, "generation": asdict(config),
                    "dtype": str(target.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                    "pass": {"shards": names, "seconds": round(seconds, 1), "answer_tokens": tokens},
                    "packages": versions if part in ("mined", "derived-mined") else None}
            write_shard(directory / "shards" / f"{shard_name(part, index)}.npz",
                        [records[item["id"]] for item in shard_items], meta)
        logger.info("%s: %d answers, %d answer tokens, %.0f s (%.1f tokens/s)", names, len(items), tokens, seconds,
                    tokens / max(seconds, 1e-9))
        count = len(pending)
        pending.clear()
        return count

    for part, index in shard_schedule(parts):
        if index % worker[1] != worker[0]:
            continue
        if deadline and time.time() > deadline:
            break
        if (directory / "shards" / f"{shard_name(part, index)}.npz").exists():
            continue
        parent = part.removeprefix("derived-")
        if part != parent and (parent, index) in [(p, i) for p, i, _ in pending]:
            written += answer_pending()  # a derived shard needs its parent's answers written first
        items = corpus_obj.items(part, index, tokenizer)
        if items:
            pending.append((part, index, items))
        if sum(len(shard_items) for _, _, shard_items in pending) >= min_pass_items:
            written += answer_pending()
    if pending and not (deadline and time.time() > deadline):
        written += answer_pending()
    return written


def write_written_prompts(target, tokenizer, path: Path, count: int, batch_size: int) -> None:
    """The target's own questions from seed topics (`data.write_topic_prompts`), kept in the corpus folder."""
    from .data import write_topic_prompts

    if len(read_jsonl(path)) >= count:
        return
    config = DataConfig(num_topic_prompts=count, batch_size=batch_size, topics=corpus.TOPICS)
    write_topic_prompts(target, tokenizer, config, path)


# ----------------------------------------------------------------------------------------------------------------------
# Reading for training
# ----------------------------------------------------------------------------------------------------------------------


def shards_with_prompts(directory: Path, tokenizer, corpus_obj: Corpus | None = None) -> list[tuple[Path, dict, list]]:
    """(path, meta, records) of every shard in `directory`, each record's `prompt_ids` filled in.

    Prompts not stored in the shards are rebuilt from the installed packages; a record whose rebuild does not match
    the ids it was answered for (other package versions) is left out with a warning, never trained on wrongly.
    """
    paths = shard_paths(directory)
    shards = [read_shard(path) for path in paths]
    missing = {r["id"] for _, records in shards for r in records if r["prompt_ids"] is None}
    rebuilt = {}
    if missing:
        corpus_obj = corpus_obj or Corpus(directory)
        rebuilt = {item_id: prompt_ids(tokenizer, item)
                   for item_id, item in corpus_obj.item_index(missing, tokenizer).items()}
    complete, dropped = [], 0
    for path, (meta, records) in zip(paths, shards):
        kept = []
        for record in records:
            prompt = record["prompt_ids"] if record["prompt_ids"] is not None else rebuilt.get(record["id"])
            if prompt is None or ids_crc(prompt) != record["prompt_crc"]:
                dropped += 1
            else:
                kept.append({**record, "prompt_ids": prompt})
        complete.append((path, meta, kept))
    if dropped:
        logger.warning("%d corpus records dropped: their prompts could not be rebuilt identically here (package "
                       "versions differ from the shards'; see the corpus README).", dropped)
    return complete


def load_corpus_records(directory: Path, tokenizer, heldout_fraction: float = 0.05,
                        corpus_obj: Corpus | None = None) -> list[dict]:
    """Training records (`id`, `source`, `shard`, `input_ids`, `loss_mask`, `heldout`) of every shard in `directory`."""
    return [{"id": record["id"], "source": record["source"], "shard": path.stem,
             "input_ids": record["prompt_ids"] + record["answer_ids"],
             "loss_mask": [0] * len(record["prompt_ids"]) + [1] * len(record["answer_ids"]),
             "heldout": is_heldout(record["id"], heldout_fraction)}
            for path, _, records in shards_with_prompts(directory, tokenizer, corpus_obj) for record in records]


def export_corpus(directory: Path, out: Path, tokenizer, corpus_obj: Corpus | None = None) -> int:
    """Copy every shard of `directory` into `out` with all prompt ids stored, so that a machine without the pinned
    packages (a lent GPU) trains on every record. The copy holds the packages' text: never commit it."""
    out = Path(out)
    if out.resolve() == Path(directory).resolve():
        raise ValueError(f"export (--export): {out} is the corpus itself; the copy must go to another folder.")
    complete = shards_with_prompts(directory, tokenizer, corpus_obj)
    for path, meta, records in complete:
        write_shard(out / "shards" / path.name, records, {**meta, "exported_from": str(directory)})
    return len(complete)


def prompt_counts(corpus_obj: Corpus) -> dict:
    """Prompts per base part and per source, those the overlap guard rejected, and the mined packages' versions."""
    from collections import Counter

    parts, sources = {}, Counter()
    for part in BASE_PARTS:
        items = [item for shard in corpus_obj.part(part).values() for item in shard]
        parts[part] = len(items)
        sources.update(item["source"] for item in items)
    return {"parts": parts, "total": sum(parts.values()), "sources": dict(sorted(sources.items())),
            "rejected_as_eval_overlap": corpus_obj.stats.get("rejected", 0), "packages": corpus.package_versions()}


def answer_token_counts(directory: Path, vocab_size: int) -> torch.Tensor:
    """How often each target id occurs in the answers of every shard (what a pruned draft vocabulary keeps)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for path in shard_paths(directory):
        with np.load(path, allow_pickle=False) as data:
            counts += np.bincount(data["answer_tokens"].astype(np.int64), minlength=vocab_size)[:vocab_size]
    return torch.from_numpy(counts)


def corpus_stats(directory: Path) -> dict:
    """Shards, answers and answer tokens so far, per part."""
    stats: dict[str, dict] = {}
    for path in shard_paths(directory):
        meta, records = read_shard(path)
        entry = stats.setdefault(meta["part"], {"shards": 0, "answers": 0, "answer_tokens": 0, "sampled": 0})
        entry["shards"] += 1
        entry["answers"] += len(records)
        entry["answer_tokens"] += sum(len(r["answer_ids"]) for r in records)
        entry["sampled"] += sum(r["sampled"] for r in records)
    return stats
