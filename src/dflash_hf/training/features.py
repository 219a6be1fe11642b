"""What the draft learns from: the target's hidden states of the chosen layers, plus what its teacher loss needs.

Per token we keep: the concatenated states of `target_layer_ids` (z-lab meaning: id t is `hidden_states[t + 1]`), the
input of the target's lm_head (to rebuild its logits over any vocabulary subset) and the log-sum-exp of its full
logits (so probabilities over a pruned vocabulary stay normalised over the whole one). A target forward costs far
more than a draft step, so for small targets these are computed once and read back from disk
(`FeatureStore`); for targets too big to cache, `OnlineFeatures` computes the same dict on demand.
"""

import json
import logging
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock, Timeout
from tqdm.auto import tqdm

from .corpus_shards import shard_part

logger = logging.getLogger(__name__)

META_FILE = "meta.json"
PROGRESS_FILE = "progress.json"
LOCK_FILE = "lock"
ARRAYS = {  # name -> numpy dtype; shapes come from meta
    "tokens": np.int32,
    "loss_mask": np.uint8,
    "context": np.float16,
    "final": np.float16,
    "lse": np.float32,
}


@dataclass
class TargetFeatures:
    """The states one forward of the target gives for one sequence ([T, ...] tensors, float32)."""

    context: torch.Tensor  # [T, K*H_t] chosen layers, concatenated
    final: torch.Tensor  # [T, H_t] input of the lm_head
    lse: torch.Tensor  # [T] logsumexp of the full logits


def target_features(target, input_ids: torch.Tensor, layer_ids: list[int]) -> TargetFeatures:
    """One target forward on `input_ids` [T]; a hook on the lm_head takes exactly what the head sees."""
    return batch_target_features(target, [input_ids], layer_ids)[0]


@torch.no_grad()
def batch_target_features(target, sequences: list[torch.Tensor], layer_ids: list[int]) -> list[TargetFeatures]:
    """`target_features` of several sequences in one forward, right-padded (a GPU runs a tiny target's forward in
    about the time of its kernel launches, so one forward for a training step's sequences instead of one each)."""
    captured = {}
    head = target.get_output_embeddings()

    def grab(module, args):
        captured["final"] = args[0]

    lengths = [int(ids.shape[0]) for ids in sequences]
    input_ids = torch.zeros(len(sequences), max(lengths), dtype=torch.long)
    for row, ids in enumerate(sequences):
        input_ids[row, : lengths[row]] = ids
    mask = None
    if len(set(lengths)) > 1:
        mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long().to(target.device)
    handle = head.register_forward_pre_hook(grab)
    try:
        out = target(input_ids=input_ids.to(target.device), attention_mask=mask, output_hidden_states=True,
                     use_cache=False)
    finally:
        handle.remove()
    features = []
    for row, n in enumerate(lengths):
        context = torch.cat([out.hidden_states[t + 1][row, :n] for t in layer_ids], dim=-1).float()
        features.append(TargetFeatures(context.cpu(), captured["final"][row, :n].float().cpu(),
                                       out.logits[row, :n].float().logsumexp(-1).cpu()))
    return features


def teacher_logits(head_weight: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """The target's logits over the rows of `head_weight` (all of them, or a pruned subset) from its lm_head input
    `final`, in float32 even under autocast: DSpark's TV loss sets them against the cached float32 logsumexp, and
    bf16 logits (about 0.1 off at magnitude 20) would move every teacher probability by up to 10%."""
    with torch.autocast(final.device.type, enabled=False):
        return final.float() @ head_weight.float().T


class FeatureStore:
    """Features of a whole data set on disk, one flat token axis with per-sequence offsets.

    Rows are read from the files per sequence rather than kept memory-mapped: a map holds a file descriptor, and a
    corpus of hundreds of shards at five files each would pass the usual limit of 1,024 open files.
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.meta = json.loads((self.directory / META_FILE).read_text())
        self.offsets = self.meta["offsets"]

    def _rows(self, name: str, start: int, end: int) -> np.ndarray:
        dtype, row = np.dtype(ARRAYS[name]), _shape(self.meta, name)[1:]
        per_token, path = int(np.prod(row)), self.directory / f"{name}.bin"
        count = (end - start) * per_token
        rows = np.fromfile(path, dtype=dtype, count=count, offset=start * per_token * dtype.itemsize)
        if rows.size != count:
            raise ValueError(f"{path} is shorter than its {META_FILE} says; delete {self.directory} to recompute it.")
        return rows.reshape(end - start, *row)

    def __len__(self) -> int:
        return len(self.meta["ids"])

    @property
    def layer_ids(self) -> list[int]:
        return list(self.meta["layer_ids"])

    def split(self, heldout: bool) -> list[int]:
        return [i for i, flag in enumerate(self.meta["heldout"]) if bool(flag) == heldout]

    def complete(self) -> bool:
        return progress_count(self.directory) == len(self)

    def answer_tokens(self, index: int) -> int:
        """How many of the sequence's tokens the loss reads (its answer's)."""
        return int(self._rows("loss_mask", self.offsets[index], self.offsets[index + 1]).sum())

    def sequence(self, index: int) -> dict:
        start, end = self.offsets[index], self.offsets[index + 1]
        item = {name: torch.from_numpy(self._rows(name, start, end)) for name in ARRAYS}
        item["tokens"] = item["tokens"].long()
        item["loss_mask"] = item["loss_mask"].bool()
        for name in ("context", "final"):
            item[name] = item[name].float()
        return item

    def token_counts(self, vocab_size: int, assistant_only: bool = True, heldout: bool = False) -> torch.Tensor:
        """Token frequencies of the training split (assistant tokens only by default), for vocabulary pruning."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for index in self.split(heldout):  # ids and mask only: the states are ~900 times their bytes
            start, end = self.offsets[index], self.offsets[index + 1]
            tokens = torch.from_numpy(self._rows("tokens", start, end)).long()
            if assistant_only:
                tokens = tokens[torch.from_numpy(self._rows("loss_mask", start, end)).bool()]
            counts += torch.bincount(tokens, minlength=vocab_size)
        return counts


def _shape(meta: dict, name: str) -> tuple[int, ...]:
    """Shape of array `name` of a feature cache: a row of states per token, or one value per token."""
    width = {"context": meta["context_width"], "final": meta["hidden_size"]}.get(name)
    return (meta["num_tokens"],) if width is None else (meta["num_tokens"], width)


def progress_count(directory: Path) -> int:
    path = Path(directory) / PROGRESS_FILE
    return json.loads(path.read_text())["done"] if path.exists() else 0


def _write_progress(directory: Path, done: int) -> None:
    tmp = Path(directory) / (PROGRESS_FILE + ".tmp")
    tmp.write_text(json.dumps({"done": done}))
    tmp.replace(Path(directory) / PROGRESS_FILE)


def cache_features(target, records: list[dict], layer_ids: list[int], directory: Path,
                   flush_every: int = 16) -> FeatureStore:
    """Compute and store on disk the features of `records` (dicts with `id`, `input_ids`, `loss_mask`, `heldout`).

    Resumable: the layout is fixed by the first call (meta.json) and `progress.json` counts finished sequences, so a
    killed run recomputes at most `flush_every` of them. A different record list or layer choice is an error rather
    than a silent mix.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    text = target.config.get_text_config(decoder=True)
    ids = [record["id"] for record in records]
    lengths = [len(record["input_ids"]) for record in records]
    meta = {
        "ids": ids,
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).tolist(),
        "heldout": [bool(record.get("heldout", False)) for record in records],
        "num_tokens": int(sum(lengths)),
        "layer_ids": [int(t) for t in layer_ids],
        "hidden_size": text.hidden_size,
        "context_width": len(layer_ids) * text.hidden_size,
        "vocab_size": text.vocab_size,
    }
    meta_path = directory / META_FILE
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old != meta:
            raise ValueError(
                f"The feature cache in {directory} was made for other records or layers "
                f"(layers {old['layer_ids']} vs {meta['layer_ids']}, {len(old['ids'])} vs {len(ids)} sequences). "
                "Use a new directory, or delete this one to recompute."
            )
    else:
        for name, dtype in ARRAYS.items():
            np.memmap(directory / f"{name}.bin", dtype=dtype, mode="w+", shape=_shape(meta, name)).flush()
        _write_progress(directory, 0)
        meta_path.write_text(json.dumps(meta))
    done = progress_count(directory)
    arrays = {name: np.memmap(directory / f"{name}.bin", dtype=dtype, mode="r+", shape=_shape(meta, name))
              for name, dtype in ARRAYS.items()}
    for index in tqdm(range(done, len(records)), total=len(records), initial=done, desc="target features",
                      unit="seq"):
        record = records[index]
        start, end = meta["offsets"][index], meta["offsets"][index + 1]
        tokens = torch.tensor(record["input_ids"], dtype=torch.long)
        features = target_features(target, tokens, layer_ids)
        arrays["tokens"][start:end] = tokens.numpy().astype(np.int32)
        arrays["loss_mask"][start:end] = np.asarray(record["loss_mask"], dtype=np.uint8)
        arrays["context"][start:end] = features.context.numpy().astype(np.float16)
        arrays["final"][start:end] = features.final.numpy().astype(np.float16)
        arrays["lse"][start:end] = features.lse.numpy()
        if (index + 1) % flush_every == 0 or index + 1 == len(records):
            for array in arrays.values():
                array.flush()
            _write_progress(directory, index + 1)
    return FeatureStore(directory)


@contextmanager
def _claimed(directory: Path):
    """Yields whether this process holds `directory`'s lock (False while another run holds it). The operating system
    drops the lock when its holder exits, so a killed run never leaves a shard locked."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = FileLock(directory / LOCK_FILE)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def by_shard(records: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(record["shard"], []).append(record)
    return groups


def shard_folders(groups: dict[str, list[dict]], root: Path) -> dict[str, Path]:
    """{shard: its cache folder}, named by the shard and a checksum of its records: a shard whose records change
    (another held-out fraction, prompts dropped under other package versions) gets a new folder, not a stale cache."""
    folders = {}
    for name, group in groups.items():
        key = json.dumps([[r["id"], len(r["input_ids"]), bool(r.get("heldout", False))] for r in group])
        folders[name] = Path(root) / f"{name}-{zlib.crc32(key.encode()):08x}"
    return folders


def check_part_weights(parts: set[str], part_weights: dict[str, int]) -> None:
    """A clear error for `--part-weight`s that name no part of this run's shards or are not whole numbers >= 1."""
    unknown = sorted(set(part_weights) - parts)
    if unknown:
        raise ValueError(f"part_weights (--part-weight) names {unknown}, which this run's shards do not hold; "
                         f"its parts are {sorted(parts)}.")
    bad = {part: weight for part, weight in part_weights.items() if not (isinstance(weight, int) and weight >= 1)}
    if bad:
        raise ValueError(f"part_weights (--part-weight) must be whole numbers >= 1; got {bad}.")


def shuffled(names) -> list[str]:
    """Shards in a fixed shuffled order: the order a corpus store reads them in, so that its first held-out answers
    sample every part."""
    return sorted(names, key=lambda name: (zlib.crc32(name.encode()), name))


def caching_order(names) -> list[str]:
    """The order shards' states are computed in: every part at the same pace (each part's shards shuffled, the parts
    interleaved by the share of their shards done), so that a partial cache holds the same share of every part and an
    epoch over it reads the parts, `--part-weight`s included, in the proportions the whole corpus would give."""
    parts: dict[str, list[str]] = {}
    for name in shuffled(names):
        parts.setdefault(shard_part(name), []).append(name)
    pace = {name: (rank + 0.5) / len(group) for group in parts.values() for rank, name in enumerate(group)}
    return sorted(names, key=lambda name: (pace[name], zlib.crc32(name.encode()), name))


def cache_features_by_shard(target, records: list[dict], layer_ids: list[int], root: Path,
                            max_minutes: float | None = None, poll_seconds: float = 5.0,
                            shards: list[str] | None = None,
                            part_weights: dict[str, int] | None = None) -> "ChainedFeatures":
    """`cache_features` one corpus shard at a time (records carry their `shard`), each in its own folder under `root`.

    A grown corpus then only computes its new shards, and `train` runs sharing `root` (one per draft kind, a core
    each) split the shards between them through a lock per folder. With `max_minutes`, shards not cached by then are
    left out of this run; they go in `caching_order`, every part at the same pace. The store reads them `shuffled`.
    `shards`: exactly these and no others, whatever the budget (a resumed run keeps the data it started with).
    `part_weights`: checked against the shards' parts before any state is computed.
    """
    deadline = time.time() + 60 * max_minutes if max_minutes is not None and shards is None else None
    groups = by_shard(records)
    if shards is not None:
        missing = sorted(set(shards) - set(groups))
        if missing:
            raise ValueError(f"This run trained on corpus shards that are gone or no longer readable: {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}; restore them or start a new run.")
        groups = {name: groups[name] for name in shards}
    check_part_weights({shard_part(name) for name in groups}, part_weights or {})
    folders = shard_folders(groups, root)
    order = caching_order(groups)

    def cached(name: str) -> bool:  # the folder's name pins its records, so its progress count says it all
        return progress_count(folders[name]) == len(groups[name])

    while True:
        waiting = []
        for name in order:
            if cached(name) or (deadline is not None and time.time() > deadline):
                continue
            with _claimed(folders[name]) as mine:
                if mine:
                    logger.info("Target states of shard %s (%d answers)", name, len(groups[name]))
                    cache_features(target, groups[name], layer_ids, folders[name])
                else:
                    waiting.append(name)  # another run is computing it
        if not waiting or (deadline is not None and time.time() > deadline):
            break
        time.sleep(poll_seconds)
    done = [name for name in shuffled(groups) if cached(name)]  # other runs' shards finished meanwhile included
    if not done:
        raise ValueError(f"No shard's features were cached within {max_minutes} minutes; allow more time.")
    if len(done) < len(order):
        logger.warning("Training on the %d of %d shards whose features are cached (%s minutes for features).",
                       len(done), len(order), max_minutes)
    return ChainedFeatures([FeatureStore(folders[name]) for name in done], names=done)


class ChainedFeatures:
    """Several `FeatureStore`s read as one: index i runs through them in order (`names`: the corpus shards they
    hold, where they are ones)."""

    def __init__(self, stores: list[FeatureStore], names: list[str] | None = None):
        self.names = names
        layer_sets = {tuple(store.layer_ids) for store in stores}
        if len(layer_sets) != 1:
            raise ValueError(f"Feature stores read different target layers: {sorted(layer_sets)}.")
        self.stores = stores
        self._where = [(store, i) for store in stores for i in range(len(store))]

    def __len__(self) -> int:
        return len(self._where)

    @property
    def layer_ids(self) -> list[int]:
        return self.stores[0].layer_ids

    def split(self, heldout: bool) -> list[int]:
        flags = [flag for store in self.stores for flag in store.meta["heldout"]]
        return [i for i, flag in enumerate(flags) if bool(flag) == heldout]

    def complete(self) -> bool:
        return all(store.complete() for store in self.stores)

    def parts(self) -> list[str]:
        """Each sequence's corpus part (`shard_part` of its shard's name)."""
        if self.names is None:
            raise ValueError("These feature stores are not corpus shards: they have no parts.")
        return [shard_part(name) for store, name in zip(self.stores, self.names) for _ in range(len(store))]

    def answer_tokens(self, index: int) -> int:
        store, local = self._where[index]
        return store.answer_tokens(local)

    def sequence(self, index: int) -> dict:
        store, local = self._where[index]
        return store.sequence(local)

    def token_counts(self, vocab_size: int, assistant_only: bool = True, heldout: bool = False) -> torch.Tensor:
        return sum(store.token_counts(vocab_size, assistant_only, heldout) for store in self.stores)


class RecordFeatures:
    """The `FeatureStore` interface over data records (token ids, loss mask, held-out flag); subclasses say where
    each sequence's features come from."""

    def __init__(self, records: list[dict], layer_ids: list[int]):
        self.records, self._layer_ids = records, list(layer_ids)

    def __len__(self) -> int:
        return len(self.records)

    @property
    def layer_ids(self) -> list[int]:
        return self._layer_ids

    def split(self, heldout: bool) -> list[int]:
        return [i for i, record in enumerate(self.records) if bool(record.get("heldout", False)) == heldout]

    def complete(self) -> bool:
        return True

    def token_counts(self, vocab_size: int, assistant_only: bool = True, heldout: bool = False) -> torch.Tensor:
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for index in self.split(heldout):
            record = self.records[index]
            tokens = torch.tensor(record["input_ids"], dtype=torch.long)
            if assistant_only:
                tokens = tokens[torch.tensor(record["loss_mask"], dtype=torch.bool)]
            counts += torch.bincount(tokens, minlength=vocab_size)
        return counts


def read_sequences(store, indices: list[int]) -> list[dict]:
    """`store.sequence` of each index; an online store computes them in one target forward."""
    if isinstance(store, OnlineFeatures):
        return store.sequences(indices)
    return [store.sequence(i) for i in indices]


class OnlineFeatures(RecordFeatures):
    """Features computed on demand, for targets whose states are too big to cache."""

    def __init__(self, target, records: list[dict], layer_ids: list[int]):
        super().__init__(records, layer_ids)
        self.target = target

    def sequence(self, index: int) -> dict:
        return self.sequences([index])[0]

    def sequences(self, indices: list[int]) -> list[dict]:
        """Several sequences from one padded target forward (a training step's worth)."""
        records = [self.records[index] for index in indices]
        tokens = [torch.tensor(record["input_ids"], dtype=torch.long) for record in records]
        features = batch_target_features(self.target, tokens, self._layer_ids)
        return [{"tokens": ids, "loss_mask": torch.tensor(record["loss_mask"], dtype=torch.bool),
                 "context": f.context, "final": f.final, "lse": f.lse}
                for ids, record, f in zip(tokens, records, features)]


# ----------------------------------------------------------------------------------------------------------------------
# Features captured during data generation: one shard per generated batch
# ----------------------------------------------------------------------------------------------------------------------

SHARD_ARRAYS = {"context": np.float16, "final": np.float16, "lse": np.float32}


def _shard_path(directory: Path, shard: int, name: str) -> Path:
    return Path(directory) / f"shard-{shard:05d}.{name}.npy"


def write_feature_shard(directory: Path, shard: int, features: list[TargetFeatures]) -> list[int]:
    """Save a batch's features as .npy files (memory-mappable), each renamed into place when complete; returns the
    row offset of every sequence in the shard."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lengths = [f.context.shape[0] for f in features]
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist()
    for name, dtype in SHARD_ARRAYS.items():
        array = torch.cat([getattr(f, name) for f in features]).numpy().astype(dtype)
        final_path = _shard_path(directory, shard, name)
        tmp = final_path.with_suffix(".tmp.npy")
        np.save(tmp, array)
        tmp.replace(final_path)
    return offsets


class ShardedFeatures(RecordFeatures):
    """Features captured while the target wrote the records, read back from its .npy shards."""

    def __init__(self, records: list[dict], directory: Path):
        missing = [r["id"] for r in records if "features" not in r]
        if missing:
            raise ValueError(f"{len(missing)} records have no captured features (first: {missing[0]}); "
                             "use `cache_features` for them.")
        layer_sets = {tuple(r["features"]["layer_ids"]) for r in records}
        if len(layer_sets) != 1:
            raise ValueError(f"Records were captured with different target layers: {sorted(layer_sets)}.")
        super().__init__(records, list(layer_sets.pop()))
        self.directory = Path(directory)

    def sequence(self, index: int) -> dict:
        record = self.records[index]
        shard, start = record["features"]["shard"], record["features"]["offset"]
        end = start + len(record["input_ids"])
        item = {}
        for name in SHARD_ARRAYS:  # mapped for this read only: a map kept open holds a file descriptor
            array = np.load(_shard_path(self.directory, shard, name), mmap_mode="r")
            item[name] = torch.from_numpy(np.array(array[start:end])).float()
        item["tokens"] = torch.tensor(record["input_ids"], dtype=torch.long)
        item["loss_mask"] = torch.tensor(record["loss_mask"], dtype=torch.bool)
        return item

