"""`dflash-hf train` and its Python API, `train_draft`: data -> features -> vocabulary -> training -> saved draft.

Every stage caches its output under a work directory and resumes from it, so one command reproduces (or, after a
kill, finishes) a whole run. Presets hold the numbers of the shipped drafts; flags override them.
"""

import argparse
import copy
import hashlib
import json
import logging
import shlex
import sys
import time
from dataclasses import asdict, dataclass, is_dataclass, replace
from pathlib import Path

import torch

from .cards import model_card, previous_training
from .corpus_shards import load_corpus_records
from .data import DataConfig, build_dataset, eos_ids
from .features import OnlineFeatures, RecordFeatures, ShardedFeatures, cache_features, cache_features_by_shard
from .trainer import (
    DraftSpec,
    TrainConfig,
    balance_fc_init,
    build_draft,
    draft_config_for,
    heldout_tau,
    part_shares,
    train_loop,
    vocabulary_copy,
    warm_start_draft,
)
from .vocab import build_vocab_mapping, coverage, most_frequent_ids

logger = logging.getLogger(__name__)

DEFAULT_WORK_ROOT = Path.home() / ".cache" / "dflash-hf" / "train"
EMBEDDED_TARGET = "embedded:smollm2-135m"
RUN_SHARDS_FILE = "corpus_shards.json"  # in a run's directory: the corpus shards it trains on


@dataclass
class Preset:
    """Everything a reproducible run needs besides the output folder."""

    target: str
    data: DataConfig
    drafts: dict[str, DraftSpec]
    train: dict[str, TrainConfig]
    notes: str = ""


# SmolLM2-135M-Instruct drafts on one thread of a shared 2-core CPU with AMX (target in bf16): ~25 min of data (the
# target answers 2400 prompts in batches of 32, features captured on the way), then the training runs. The shipped
# DFlash draft is this preset's; the shipped DSpark one is its GPU scaling, `scripts/gpu_train.sh` (flags on top of
# it; the exact command is in the draft's card).
_SMOLLM2_DRAFT = {"num_layers": 1, "num_target_layers_read": 3, "block_size": 8, "mask_token_id": 0,
                  "init_from_target_layer": -1}
PRESETS = {
    "smollm2-135m": Preset(
        target=EMBEDDED_TARGET,
        data=DataConfig(num_topic_prompts=400, num_code_prompts=2000, max_new_tokens=128, batch_size=32),
        drafts={
            # DFlash and DFlash 2 train over the whole vocabulary and keep DSpark's 4,096 ids afterwards (same tau,
            # a third of the draft step on a CPU: README, "Drafts that propose from fewer ids").
            "dflash": DraftSpec(kind="dflash", draft_vocab_size=4096, **_SMOLLM2_DRAFT),
            "dspark": DraftSpec(kind="dspark", draft_vocab_size=4096, markov_rank=32, markov_head_type="vanilla",
                                enable_confidence_head=True, **{**_SMOLLM2_DRAFT, "num_layers": 2}),
            # The released drafts' conv and top-K, a rank sized to this target; DSpark's two layers.
            "dflash2": DraftSpec(kind="dflash2", draft_vocab_size=4096, conv_kernel_size=2, conv_group_size=16,
                                 selector_rank=64, selector_top_k=16, **{**_SMOLLM2_DRAFT, "num_layers": 2}),
        },
        train={
            "dflash": TrainConfig(max_steps=3000, sequences_per_step=2, anchors_per_sequence=16, learning_rate=1e-3,
                                  eval_every=200, eval_sequences=6, checkpoint_every=50),
            "dspark": TrainConfig(max_steps=4000, sequences_per_step=2, anchors_per_sequence=32, learning_rate=1e-3,
                                  eval_every=200, eval_sequences=6, checkpoint_every=50),
            "dflash2": TrainConfig(max_steps=3000, sequences_per_step=2, anchors_per_sequence=16, learning_rate=1e-3,
                                   eval_every=200, eval_sequences=6, checkpoint_every=50, selector_weight=1.0),
        },
        notes="DFlash 1 draft layer, DSpark 2 (initialised from the target's last layer), reading target layers "
              "[1, 14, 27]; block 8; mask token id 0 (<|endoftext|>, never inside an answer). DSpark: one 2-layer "
              "run beat a 1-layer 6000-step one (HumanEval tau 1.78 vs 1.60 on 6 prompts). DFlash 2: DSpark's "
              "two layers plus 2-tap convolutions over 16-channel groups and a rank-64 top-16 selector; the shipped "
              "one and its DFlash / DSpark twins were trained on the corpus with the same steps (its card).",
    ),
}


def load_target(name: str, dtype: "str | torch.dtype" = "auto", device: str = "cpu"):
    """(model, tokenizer): the embedded SmolLM2 (GGUF, offline) or any Hub id / folder, in `dtype` (`auto`: bfloat16
    where the hardware has fast bf16 matmuls). The draft learns the states of this dtype: serve in it, or in one whose
    states are close (bfloat16 states, three times cheaper than float32 on an AVX512-BF16 CPU, are within 1% of them,
    and the drafts trained on them serve float32 as well: docs/training.md).
    Attention is plain SDPA: training verifies nothing, so row-exact attention would only cost time (on an H200 a
    bf16 run spent its whole 10 minutes in it before the first step)."""
    from ..defaults import load_target as load

    return load(None if name == EMBEDDED_TARGET else name, dtype, device, row_exact=False)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def hardware(device: torch.device) -> str:
    """Where training ran, in words, for the summary and the model card."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from ..bench.report import cpu_name

    threads = torch.get_num_threads()
    return f"{cpu_name()}, {threads} thread{'s' if threads > 1 else ''}"


def train_draft(kind: str, out: Path, *, target_name: str, data: DataConfig, spec: DraftSpec, train: TrainConfig,
                work_dir: Path, online_features: bool = False, save_dtype: torch.dtype = torch.bfloat16,
                command: str | None = None, target=None, tokenizer=None, corpus: Path | None = None,
                init_from: Path | None = None, feature_minutes: float | None = None,
                rechoose_vocab: bool = False) -> dict:
    """Run the whole pipeline for one draft and save it with `save_pretrained` (plus a model card) into `out`.

    `target`/`tokenizer` may be passed in to skip loading; `work_dir` holds the data, the feature cache (shared by
    every draft reading the same layers of a target in the same dtype) and the checkpoints of this draft. `corpus`:
    train on the answer shards of that folder (`dflash-hf corpus`) instead of generating data; their features are
    computed here. `init_from`: a saved draft of the same shape to continue from (a new schedule over
    `train.max_steps` more steps);
    `rechoose_vocab`: a DSpark one's pruned vocabulary is chosen again from every training answer of the data,
    cached or not (`spec.draft_vocab_size` ids), as DFlash and DFlash 2 drafts' always is.
    `feature_minutes`: with `corpus`, compute features of uncached shards for at most this long, then train on the
    cached ones (`cache_features_by_shard`).
    """
    if feature_minutes is not None and corpus is None:
        raise ValueError("feature_minutes (--feature-minutes) budgets the features of a corpus: pass corpus too.")
    started = time.time()
    work_dir = Path(work_dir)
    if target is None:
        target, tokenizer = load_target(target_name)
    layer_ids = draft_config_for(target, spec).target_layer_ids
    # Loaded first, so that a draft of another shape fails here, not after the long pass over features below.
    draft = None if init_from is None else warm_start_draft(target, spec, init_from, same_vocab_size=not rechoose_vocab)
    run_dir = run_directory(work_dir, kind, out=out, target=target_name, corpus=corpus, init_from=init_from,
                            rechoose_vocab=rechoose_vocab, data=data, spec=spec, train=train)
    # Features come from the generation pass itself unless they must be recomputed online (big targets).
    if corpus is not None:
        records = load_corpus_records(corpus, tokenizer, data.heldout_fraction)
        if not records:
            raise ValueError(f"No answer shards in {corpus}/shards: run `dflash-hf corpus --out {corpus}` first.")
    else:
        records = build_dataset(target, tokenizer, data, work_dir / "data", None if online_features else layer_ids)
    captured = all(r.get("features", {}).get("layer_ids") == list(layer_ids) for r in records)
    parts = None  # per corpus part: answers, answer tokens, weight, share of an epoch
    target_dtype = str(target.dtype).removeprefix("torch.")
    # States depend on the target's dtype: caches of a float32 and a bfloat16 target must never mix.
    cache_name = "features-" + "-".join(map(str, layer_ids)) + "-" + target_dtype
    if online_features:
        store = OnlineFeatures(target, records, layer_ids)
    elif corpus is not None:  # the corpus grows between runs: a cache per shard, computed once
        # A resumed run keeps the shards it started with, though the corpus or the cache has grown since.
        pinned = run_dir / RUN_SHARDS_FILE
        shards = json.loads(pinned.read_text()) if pinned.is_file() else None
        store = cache_features_by_shard(target, records, layer_ids, work_dir / f"{cache_name}-corpus", feature_minutes,
                                        shards=shards, part_weights=train.part_weights)
        run_dir.mkdir(parents=True, exist_ok=True)
        pinned.write_text(json.dumps(store.names))
        parts = part_shares(store, store.split(heldout=False), train.part_weights)
        logger.info("Answer tokens one epoch reads, by part: %s",
                    ", ".join(f"{name} {part['epoch_share']:.1%}" for name, part in parts.items()))
    elif captured:
        store = ShardedFeatures(records, work_dir / "data" / "features")
    else:
        store = cache_features(target, records, layer_ids, work_dir / cache_name)
    vocab_size = target.config.get_text_config(decoder=True).vocab_size
    pruned = bool(spec.draft_vocab_size and spec.draft_vocab_size < vocab_size)
    pruned_in_training = pruned and spec.kind == "dspark"  # DFlash and DFlash 2 are pruned after training
    keep_eos = eos_ids(tokenizer, target)
    counts = store.token_counts(vocab_size)  # of the training answers' tokens: ids and masks only, cheap
    # A pruned vocabulary is ranked on every training answer, cached or not: a partial cache is a sample, too small to
    # rank the rarer ids a wide vocabulary keeps. Coverage is stated on what the run read.
    vocab_counts = RecordFeatures(records, layer_ids).token_counts(vocab_size) if pruned else None
    # DFlash and DFlash 2 train over the whole vocabulary and keep these ids (the answers' most frequent) at the end.
    final_ids = (most_frequent_ids(vocab_counts, spec.draft_vocab_size, always_keep=keep_eos)
                 if pruned and not pruned_in_training else None)
    vocab_coverage, previous = None, None
    measured = store.split(heldout=True)[: train.final_eval_sequences or None]  # the same answers before and after
    if init_from is not None:  # its weights and vocabulary, as trained
        previous = previous_training(Path(init_from))
        # What it reaches on this data before any step here, for the card beside what it reaches after: with the
        # vocabulary the run ends with, so that pruning is not counted as a loss or a gain of training.
        as_final = draft
        if final_ids is not None:
            as_final = vocabulary_copy(draft, final_ids)
            as_final.bind_target(target)
        previous["heldout_here"] = heldout_tau(as_final, store, measured, train.eval_anchor_chunk)
        del as_final
        logger.info("Held-out tau before continuing: %s", previous["heldout_here"])
        if pruned_in_training:
            vocab_coverage = coverage(counts, draft.t2d.cpu())
            if rechoose_vocab:
                previous["vocab_here"] = {"draft_vocab_size": draft.config.draft_vocab_size, "coverage": vocab_coverage}
                logger.info("Re-choosing the vocabulary: %d ids covered %.4f here", draft.config.draft_vocab_size,
                            vocab_coverage)
                kept = most_frequent_ids(vocab_counts, spec.draft_vocab_size, always_keep=keep_eos)
                draft = vocabulary_copy(draft, kept)
                draft.bind_target(target)
                vocab_coverage = coverage(counts, draft.t2d.cpu())
    else:
        mapping = None
        if pruned_in_training:
            mapping = build_vocab_mapping(vocab_counts, spec.draft_vocab_size, always_keep=keep_eos)
            vocab_coverage = coverage(counts, mapping[1])
        draft = build_draft(target, spec, mapping, seed=train.seed)
        if spec.balance_fc_init:
            balance_fc_init(draft, store)
    if vocab_coverage is not None:
        logger.info("Draft vocabulary: %d ids cover %.4f of the assistant tokens", spec.draft_vocab_size,
                    vocab_coverage)
    logger.info("Checkpoints and metrics of this run: %s", run_dir)
    last = train_loop(draft, store, train, run_dir)
    if final_ids is not None:  # trained over the whole vocabulary, now keeping the ids used most
        draft.prune_vocabulary(final_ids)
        vocab_coverage = coverage(counts, draft.t2d.cpu())
        logger.info("Pruned to %d ids covering %.4f of the assistant tokens", spec.draft_vocab_size, vocab_coverage)
    heldout = heldout_tau(draft, store, measured, train.eval_anchor_chunk)
    used = records
    if parts is not None:  # the answers of the shards this run read, where a feature budget left some out
        read = set(store.names)
        used = [r for r in records if r["shard"] in read]
    code_prompts = sum(r["source"].startswith(("stdlib-docstring", "mined")) for r in used)
    logger.info("Held-out tau (teacher-forced, greedy): %s", heldout)
    summary = {
        "kind": kind,
        "target": target_name,
        "target_dtype": target_dtype,
        "command": command,
        "corpus": str(corpus) if corpus is not None else None,
        "corpus_shards": ({"used": len(store.stores), "total": len({r["shard"] for r in records})}
                          if corpus is not None and not online_features else None),
        "prompts": {"code": code_prompts, "topic": len(used) - code_prompts},
        "parts": parts,
        "train_sequences": len(store.split(heldout=False)),
        "heldout_sequences": len(store.split(heldout=True)),
        "train_tokens_assistant": int(counts.sum()),
        "draft_vocab_coverage": vocab_coverage,
        "final_train_metrics": last,
        "heldout": heldout,
        "layer_ids": list(layer_ids),
        "minutes": round((time.time() - started) / 60, 1),
        "hardware": hardware(target.device),
        "steps_run": last.get("step"),
        "init_from": previous,
        "data": asdict(data),
        "draft": asdict(spec),
        "train": asdict(train),
    }
    save_draft(draft, Path(out), summary, save_dtype)
    return summary


def run_directory(work_dir: Path, kind: str, *, out, init_from, **settings) -> Path:
    """`<work_dir>/run-<kind>-<digest>`: where one run keeps its checkpoints and metrics. The digest covers what
    defines the run (output folder, settings, and the weights of the draft it continues), so the same command resumes
    its own run after a kill, while another run of the same kind (a new schedule, shape or warm start, or the same
    command continuing a draft that has since changed) starts afresh instead of resuming a stranger's checkpoint."""
    identity = {"out": str(Path(out).resolve()), "init_from": None,
                **{k: asdict(v) if is_dataclass(v) else v for k, v in settings.items()}}
    if init_from is not None:
        weights = hashlib.sha256()
        for file in sorted(Path(init_from).glob("*.safetensors")):
            weights.update(file.read_bytes())
        identity["init_from"] = [str(Path(init_from).resolve()), weights.hexdigest()]
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return Path(work_dir) / f"run-{kind}-{digest}"


def save_draft(draft, out: Path, summary: dict, dtype: torch.dtype) -> None:
    """save_pretrained in `dtype` (a copy: the trained draft stays as it was), the summary, and a model card."""
    out.mkdir(parents=True, exist_ok=True)
    saved = copy.deepcopy(draft)
    saved._target_embedding = saved._target_head = None
    saved.to(dtype).save_pretrained(out, safe_serialization=True)
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "README.md").write_text(model_card(summary))


def continued_shape(init_from: Path) -> dict:
    """The shape flags' values (`_SPEC_FLAGS`) of the draft a warm start continues, read from its config: a run
    continues that draft as it is unless a flag changes it (more layers; another vocabulary with --rechoose-vocab),
    whatever the preset says (the shipped DSpark draft keeps 8,192 ids, the preset 4,096)."""
    config_file = Path(init_from) / "config.json"
    if not config_file.is_file():
        return {}  # `warm_start_draft` says what is missing
    config = json.loads(config_file.read_text())
    keys = {name: "num_hidden_layers" if name == "num_layers" else name for name in _SPEC_FLAGS}
    return {name: config[key] for name, key in keys.items() if config.get(key) is not None}


def train_from_preset(preset_name: str, kind: str, out: Path, work_dir: Path | None = None, command: str | None = None,
                      data_overrides: dict | None = None, spec_overrides: dict | None = None,
                      train_overrides: dict | None = None, **kwargs) -> dict:
    """`train_draft` with a preset's numbers, each group optionally overridden (dicts of dataclass fields); with
    `init_from`, the draft's shape is the continued draft's (`continued_shape`) where `spec_overrides` is silent."""
    if preset_name not in PRESETS:
        raise ValueError(f"Unknown preset {preset_name!r}; known: {sorted(PRESETS)}.")
    preset = PRESETS[preset_name]
    if kind not in preset.drafts:
        raise ValueError(f"Preset {preset_name!r} has no {kind!r} draft; it has {sorted(preset.drafts)}.")
    kwargs.setdefault("target_name", preset.target)
    shape = continued_shape(kwargs["init_from"]) if kwargs.get("init_from") is not None else {}
    return train_draft(
        kind, out,
        data=replace(preset.data, **(data_overrides or {})),
        spec=replace(preset.drafts[kind], **{**shape, **(spec_overrides or {})}),
        train=replace(preset.train[kind], **(train_overrides or {})),
        work_dir=Path(work_dir) if work_dir else DEFAULT_WORK_ROOT / preset_name,
        command=command, **kwargs,
    )


# ----------------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------------

_DATA_FLAGS = {"num_topic_prompts": int, "num_code_prompts": int, "max_new_tokens": int, "batch_size": int}
_SPEC_FLAGS = {"block_size": int, "num_layers": int, "draft_vocab_size": int, "markov_rank": int,
               "selector_rank": int, "selector_top_k": int, "conv_kernel_size": int, "conv_group_size": int}
_TRAIN_FLAGS = {"max_steps": int, "sequences_per_step": int, "anchors_per_sequence": int, "learning_rate": float,
                "seed": int, "eval_every": int, "final_eval_sequences": int, "checkpoint_every": int,
                "mixed_precision": str, "max_minutes": float, "selector_weight": float, "gamma": float,
                "ce_weight": float, "tv_weight": float, "confidence_weight": float}


def part_weight(text: str) -> tuple[str, int]:
    """`--part-weight topics=3` -> ("topics", 3)."""
    part, _, weight = text.partition("=")
    if not part or not weight.isdigit() or int(weight) < 1:
        raise argparse.ArgumentTypeError(f"--part-weight takes PART=N with N a whole number >= 1, got {text!r}")
    return part, int(weight)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train a DFlash, DSpark or DFlash 2 draft for a target (resumable)")
    parser.add_argument("--preset", default="smollm2-135m", choices=sorted(PRESETS))
    parser.add_argument("--kind", choices=("dflash", "dspark", "dflash2", "both"), default="dflash",
                        help="the draft to train; both: dflash then dspark")
    parser.add_argument("--out", required=True, type=Path,
                        help="folder for the trained draft (with --kind both: a parent of <preset>-<kind>)")
    parser.add_argument("--target", default=None, help="Hub id or folder of another target (default: the preset's)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help=f"data, features and checkpoints (default {DEFAULT_WORK_ROOT}/<preset>)")
    parser.add_argument("--online-features", action="store_true", help="recompute target states instead of caching")
    parser.add_argument("--corpus", type=Path, default=None,
                        help="train on the answer shards of this folder (e.g. data/smollm2-135m, made by `dflash-hf "
                             "corpus`) instead of generating data")
    parser.add_argument("--feature-minutes", type=float, default=None,
                        help="with --corpus: compute the target's states of uncached shards for at most this long, "
                             "then train on the shards cached so far (runs sharing a work dir split the shards)")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="continue training the draft saved in this folder (e.g. a shipped one on a grown "
                             "corpus): its weights and vocabulary, a new schedule of --max-steps steps; its shape "
                             "must match the run's, except that --num-layers may add layers (they start as "
                             "identities, so it first drafts as before)")
    parser.add_argument("--rechoose-vocab", action="store_true",
                        help="with --init-from a DSpark draft: choose its pruned vocabulary again from the training "
                             "answers of every shard, cached or not (--draft-vocab-size ids; kept ids keep their "
                             "Markov rows). DFlash and DFlash 2 drafts choose theirs after every training anyway")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--dtype", default="auto", help="the target's dtype: auto (bfloat16 where fast), float32, ...")
    parser.add_argument("--device", default=None, help="where the target answers and the draft trains (default: "
                        "cuda when available, else cpu)")
    parser.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default=None,
                        help="bf16: matmuls autocast, weights and optimiser in float32; on GPUs and on CPUs with bf16 "
                             "instructions (avx512_bf16, AMX) more steps per minute (default: no)")
    parser.add_argument("--part-weight", action="append", type=part_weight, default=None, metavar="PART=N",
                        help="with --corpus: list each training answer of a corpus part N times per epoch (repeat "
                             "for several parts; e.g. topics=3 written=3 to lean towards conversation)")
    for flags in (_DATA_FLAGS, _SPEC_FLAGS, _TRAIN_FLAGS):
        for name, kind in flags.items():
            if name != "mixed_precision":  # declared above, with its choices
                parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    parser.set_defaults(func=run)

    evaluate = subparsers.add_parser(
        "train-eval", help="tau of trained drafts on MT-Bench/HumanEval prompts (teacher-forced greedy decode walk)")
    evaluate.add_argument("--draft", action="append", required=True, help="draft folder (repeat for several)")
    evaluate.add_argument("--dataset", action="append", required=True, help="mt-bench, humaneval or a JSONL file")
    evaluate.add_argument("--target", default=EMBEDDED_TARGET)
    evaluate.add_argument("--max-samples", type=int, default=None)
    evaluate.add_argument("--max-new-tokens", type=int, default=128)
    evaluate.add_argument("--batch-size", type=int, default=16)
    evaluate.add_argument("--threads", type=int, default=None)
    evaluate.add_argument("--dtype", default="auto", help="the target's dtype (as in `train`)")
    evaluate.add_argument("--json", type=Path, default=None, help="write the results here")
    evaluate.add_argument("--cache-dir", type=Path, default=None, help="keep the target's answers here for reuse")
    evaluate.set_defaults(func=run_eval)


def run_eval(args) -> int:
    from transformers import AutoModel

    from ..bench import load_samples, select_samples
    from .evaluate import prompt_set_tau

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    target, tokenizer = load_target(args.target, args.dtype)
    # float32 like the training-time evaluation (the borrowed embedding and head are cast to it).
    drafts = {path: AutoModel.from_pretrained(path, dtype=torch.float32).eval() for path in args.draft}
    report = {}
    for dataset in args.dataset:
        samples, _ = load_samples(dataset)
        prompts = [sample.turns[0] for sample in select_samples(samples, args.max_samples)]
        report[dataset] = prompt_set_tau(drafts, target, tokenizer, prompts, args.max_new_tokens, args.batch_size,
                                         cache_dir=args.cache_dir, dataset=dataset)
        for path, result in report[dataset].items():
            print(f"{dataset} ({len(prompts)} prompts, first turn, greedy, {args.max_new_tokens} new tokens) "
                  f"{path}: tau {result['tau_decode']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    def picked(flags):
        return {n: getattr(args, n) for n in flags if getattr(args, n) is not None}

    train_overrides = picked(_TRAIN_FLAGS)
    if args.part_weight:
        if args.corpus is None:
            raise SystemExit("--part-weight weighs the parts of a corpus: pass --corpus too.")
        train_overrides["part_weights"] = dict(args.part_weight)
    command = "dflash-hf " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    kinds = ("dflash", "dspark") if args.kind == "both" else (args.kind,)
    if args.init_from is not None and args.kind == "both":
        raise SystemExit("--init-from continues one draft: pass --kind dflash, dspark or dflash2 with it.")
    preset = PRESETS[args.preset]
    target_name = args.target or preset.target
    target, tokenizer = load_target(target_name, args.dtype, args.device or default_device())
    for kind in kinds:
        out = args.out / f"{args.preset}-{kind}" if args.kind == "both" else args.out
        summary = train_from_preset(
            args.preset, kind, out, work_dir=args.work_dir, command=command, data_overrides=picked(_DATA_FLAGS),
            spec_overrides=picked(_SPEC_FLAGS), train_overrides=train_overrides,
            online_features=args.online_features, target=target, tokenizer=tokenizer, target_name=target_name,
            corpus=args.corpus, init_from=args.init_from, feature_minutes=args.feature_minutes,
            rechoose_vocab=args.rechoose_vocab,
        )
        heldout = summary["heldout"]
        measured = (f"held-out tau {heldout['tau_decode']:.2f} (decode walk), {heldout['tau_anchors']:.2f} (all anchors)"
                    if heldout["blocks"] else "no held-out answer to measure")
        print(f"{kind}: {measured}; saved to {out}")
    return 0
