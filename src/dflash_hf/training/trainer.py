"""Block training of a DFlash, DSpark or DFlash 2 draft on cached target features, through `accelerate`.

One training row is one sequence with several random anchors. Each anchor opens a block `[anchor, MASK, ...]` at its
real positions; the queries of all blocks are built at once and one boolean mask lets every block see the context
strictly before its anchor and itself (bidirectionally), nothing else: exactly what the block sees at inference,
where the context is the verified prefix and the anchor the last verified token. The layer math is the draft's own
modules (`fc`, `hidden_norm`, `project_kv`, the decoder layers, `norm`, the heads), so training and inference
cannot drift apart. DFlash 2's convolutions are told where each block starts (`block_len`), so with every block in one
sequence they still never reach into another block, and its candidate selector is walked teacher-forced by the one
walk function generation uses (`selector_walk`).

Which sequences and anchors a step uses is a pure function of (seed, step, rank), so a run resumed from a checkpoint
(model, optimizer, scheduler, RNG, step) continues exactly as the uninterrupted one would.
"""

import copy
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..configuration_dflash import DFlashConfig, DSparkConfig, default_target_layer_ids
from ..configuration_dflash2 import DFlash2Config
from ..layers_dflash import layer_attention_mask
from ..modeling_dflash import DFlashDraftModel, DSparkDraftModel, markov_walk, sorted_kept_ids, vocab_maps
from ..modeling_dflash2 import DFlash2DraftModel, selector_walk
from .features import check_part_weights, read_sequences, teacher_logits
from .losses import dflash_loss, dspark_loss, selector_loss, selector_training_candidates, slot_weights
from .vocab import target_to_draft_ids

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "step-"
TRAINER_STATE_FILE = "trainer_state.json"
METRICS_FILE = "metrics.jsonl"
# Seeds of the per-step streams are spread with a large odd multiplier so (seed, step) pairs never collide, and
# ranks are offset by a prime so no two processes draw the same anchors.
_SEED_STRIDE = 1_000_003
_RANK_STRIDE = 997
EVAL_READ = 16  # held-out sequences read at once (online: one target forward for them)


@dataclass
class DraftSpec:
    """The draft's shape; None fields follow the target."""

    kind: str = "dflash"  # "dflash", "dspark" or "dflash2"
    num_layers: int = 1
    num_target_layers_read: int | None = None  # how many target layers feed `fc`; None = num_layers (z-lab)
    target_layer_ids: list[int] | None = None
    block_size: int = 8
    mask_token_id: int | None = None  # None: the tokenizer's unk/pad-free choice made by the caller
    intermediate_size: int | None = None
    init_from_target_layer: int | None = None  # copy this target layer (negative: from the end) into each draft layer
    balance_fc_init: bool = True  # scale fc's input columns by the features' spread (see `balance_fc_init`)
    # Pruned vocabulary size (None = full): DSpark trains over it, DFlash and DFlash 2 are pruned after training.
    draft_vocab_size: int | None = None
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    sample_from_anchor: bool = False
    conv_kernel_size: int = 2  # DFlash 2 (the released drafts' values)
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping of one training run."""

    max_steps: int = 1000
    # A wall-clock budget for the loop: once the step rate is measured (see PROBE_STEPS) the schedule is shortened to
    # the steps that fit (never lengthened), so the learning rate still decays to its floor when time runs out.
    max_minutes: float | None = None
    sequences_per_step: int = 4  # per process
    anchors_per_sequence: int = 16
    learning_rate: float = 6e-4
    weight_decay: float = 0.01
    adam_betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    gamma: float = 4.0  # positional decay of the loss over the block
    ce_weight: float = 0.1  # DSpark
    tv_weight: float = 0.9  # DSpark
    confidence_weight: float = 1.0  # DSpark
    selector_weight: float = 1.0  # DFlash 2: alpha of the K-way selector CE beside the DFlash CE (speculators' default)
    # "bf16": autocast matmuls (weights and optimiser stay float32). Pays off on GPUs and on CPUs with bf16 instructions
    # (avx512_bf16, AMX): a DSpark step of 4 x 32 takes 0.70 s against 1.05 s on one AMD EPYC core.
    mixed_precision: str = "no"
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200
    eval_sequences: int = 8  # held-out sequences for the periodic tau
    # Held-out sequences for the tau before and after a run (the card's); 0: all. A corpus of 700 held-out answers
    # costs 5-15 minutes of one CPU core per pass.
    final_eval_sequences: int = 0
    eval_anchor_chunk: int = 64  # anchors per draft forward during evaluation (bounds memory)
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    # Corpus part -> times each of its training sequences is listed per epoch ({"topics": 3}; others once): leans a
    # run towards a part (conversation, say) without new data. Needs a corpus run (`--corpus`).
    part_weights: dict[str, int] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------------------
# Building the draft
# ----------------------------------------------------------------------------------------------------------------------


DRAFT_KINDS = ("dflash", "dspark", "dflash2")


def draft_config_for(target, spec: DraftSpec):
    """A `DFlashConfig`/`DSparkConfig`/`DFlash2Config` sized for `target` (heads, hidden size, RoPE follow the
    target)."""
    text = target.config.get_text_config(decoder=True)
    num_read = spec.num_target_layers_read or spec.num_layers
    layer_ids = spec.target_layer_ids or default_target_layer_ids(text.num_hidden_layers, num_read)
    rope = getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": text.rope_theta}
    fields = {
        "vocab_size": text.vocab_size,
        "hidden_size": text.hidden_size,
        "intermediate_size": spec.intermediate_size or text.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        "rms_norm_eps": text.rms_norm_eps,
        "rope_parameters": dict(rope),
        "max_position_embeddings": text.max_position_embeddings,
        "target_hidden_size": text.hidden_size,
        "num_target_layers": text.num_hidden_layers,
        "target_layer_ids": list(layer_ids),
        "block_size": spec.block_size,
        "mask_token_id": spec.mask_token_id if spec.mask_token_id is not None else 0,
    }
    if spec.kind == "dflash":
        return DFlashConfig(**fields)
    if spec.kind == "dflash2":
        return DFlash2Config(conv_kernel_size=spec.conv_kernel_size, conv_group_size=spec.conv_group_size,
                             selector_rank=spec.selector_rank, selector_top_k=spec.selector_top_k, **fields)
    if spec.kind != "dspark":
        raise ValueError(f"Unknown draft kind {spec.kind!r}: expected one of {DRAFT_KINDS}.")
    return DSparkConfig(
        draft_vocab_size=spec.draft_vocab_size or text.vocab_size, markov_rank=spec.markov_rank,
        markov_head_type=spec.markov_head_type, enable_confidence_head=spec.enable_confidence_head,
        confidence_head_with_markov=spec.confidence_head_with_markov, sample_from_anchor=spec.sample_from_anchor,
        **fields,
    )


def init_layers_from_target(draft: DFlashDraftModel, target, layer_index: int) -> None:
    """Start every draft layer from a trained target layer (same names for attention, MLP and norms).

    A one-layer draft trained for minutes learns faster from a layer that already maps embeddings to next-token
    features than from noise. Tensors the target layer lacks (q_norm/k_norm on Llama; DFlash 2's convolutions, which
    so stay identities) keep their initialisation.
    """
    source = target.get_decoder().layers[layer_index].state_dict()
    for layer in draft.layers:
        own = layer.state_dict()
        loaded = {name: tensor for name, tensor in source.items() if name in own and own[name].shape == tensor.shape}
        layer.load_state_dict(loaded, strict=False)
        logger.info("Initialised a draft layer from target layer %d (%d of %d tensors).", layer_index, len(loaded),
                    len(own))


@torch.no_grad()
def balance_fc_init(draft: DFlashDraftModel, store, max_sequences: int = 32) -> torch.Tensor:
    """Divide each input column of `fc` by the RMS of that feature over some training tokens (keeping the mean
    column scale), and return those RMS values.

    The concatenated target layers differ in scale by an order of magnitude (deeper layers are larger, and a few
    "massive activation" dimensions reach 1e4 on sink tokens). `hidden_norm(fc(x))` is scale-invariant, so with
    a plain random `fc` the deepest layer and the massive dimensions drown the rest until training undoes it;
    starting balanced spends the short CPU budget on learning instead.
    """
    indices = store.split(heldout=False)[:max_sequences]
    squares = torch.zeros(draft.fc.in_features, dtype=torch.float64)
    count = 0
    for index in indices:
        context = store.sequence(index)["context"].double()
        squares += context.pow(2).sum(0)
        count += context.shape[0]
    rms = (squares / max(count, 1)).sqrt().clamp_min(torch.finfo(torch.float32).eps).float()
    scale = rms.mean() / rms
    draft.fc.weight.mul_(scale.to(draft.fc.weight)[None, :])
    return rms


def build_draft(target, spec: DraftSpec, vocab_mapping=None, seed: int = 0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    config = draft_config_for(target, spec)
    # DFlash 2 starts as a DFlash draft: identity convolutions (its `_init_weights`), random codebooks.
    draft = {"dspark": DSparkDraftModel, "dflash2": DFlash2DraftModel}.get(spec.kind, DFlashDraftModel)(config)
    if vocab_mapping is not None:
        draft.set_vocab_mapping(*vocab_mapping)
    if spec.init_from_target_layer is not None:
        init_layers_from_target(draft, target, spec.init_from_target_layer)
    draft.to(target.device)  # trains where the target runs (`train_loop` follows the draft)
    draft.bind_target(target)
    return draft


def vocabulary_copy(draft: DFlashDraftModel, kept_ids=None) -> DFlashDraftModel:
    """The same draft proposing from the target ids `kept_ids` (None: the whole vocabulary again), before it is
    bound to a target: e.g. a draft pruned on an early corpus whose vocabulary a larger one re-chooses.

    Nothing trained is lost for ids kept before. A draft that borrows the target's head has no head rows of its own;
    DSpark's Markov output rows are carried over and start at zero (no bias) for newly kept ids. A draft with its own
    pruned lm_head holds rows only for the ids it kept, so it can move only within them."""
    vocab_size = draft.config.vocab_size
    kept = torch.arange(vocab_size) if kept_ids is None else sorted_kept_ids(kept_ids, vocab_size).cpu()
    old = draft.draft_to_target().cpu() if draft.config.drafts_pruned_vocab else torch.arange(vocab_size)
    old_row = torch.full((vocab_size,), -1, dtype=torch.long)
    old_row[old] = torch.arange(old.numel())
    rows = old_row[kept]  # -1: an id the draft did not propose before
    if not draft.config.shares_target_lm_head and bool((rows < 0).any()):
        raise ValueError("This pruned draft has its own lm_head, which holds only the kept rows; train it pruned or "
                         "from its unpruned checkpoint.")
    config = copy.deepcopy(draft.config)
    config.draft_vocab_size = kept.numel()
    config.validate_draft()
    moved = type(draft)(config)
    state = {k: v for k, v in draft.state_dict().items() if k not in ("d2t", "t2d")}
    for name in ("lm_head.weight", "markov_head.markov_w2.weight"):
        if name in state:
            weight, at = state[name], rows.to(state[name].device)
            state[name] = torch.where((at >= 0)[:, None], weight[at.clamp(min=0)], 0.0)
    state.update({k: v for k, v in moved.state_dict().items() if k in ("d2t", "t2d")})  # installed below
    moved.load_state_dict(state)
    if config.drafts_pruned_vocab:
        moved.set_vocab_mapping(*vocab_maps(kept, vocab_size))
    return moved.to(device=draft.fc.weight.device, dtype=draft.fc.weight.dtype)  # bf16 stays bf16


@torch.no_grad()
def deepened_copy(draft: DFlashDraftModel, num_layers: int) -> DFlashDraftModel:
    """The same draft with layers appended up to `num_layers`, before it is bound to a target: each new layer's
    attention output and MLP down projections start at zero, so it adds nothing to the residual stream and the
    deeper draft drafts exactly as the shallow one did, while training gives the new layers capacity to learn (a
    continued draft whose held-out tau stopped rising at its depth). New layers repeat the last layer's type."""
    have = draft.config.num_hidden_layers
    if num_layers < have:
        raise ValueError(f"num_layers (--num-layers) is {num_layers}, but the draft to continue has {have} layers: a "
                         "warm start can add layers, not drop them.")
    config = copy.deepcopy(draft.config)
    config.num_hidden_layers = num_layers
    config.layer_types = list(config.layer_types) + [config.layer_types[-1]] * (num_layers - have)
    config.validate_draft()
    deeper = type(draft)(config)
    missing, unexpected = deeper.load_state_dict(draft.state_dict(), strict=False)
    new_prefixes = tuple(f"layers.{i}." for i in range(have, num_layers))
    if unexpected or any(not name.startswith(new_prefixes) for name in missing):
        raise RuntimeError(f"Deepening left weights unmatched: missing {missing}, unexpected {unexpected}.")
    for layer in deeper.layers[have:]:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    return deeper.to(draft.fc.weight.device)


# Config fields that fix what a draft computes: a warm start must agree with the run's spec on every one.
_WARM_START_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "target_layer_ids", "block_size", "mask_token_id",
                      "draft_vocab_size", "markov_rank", "markov_head_type", "enable_confidence_head",
                      "confidence_head_with_markov", "sample_from_anchor", "conv_kernel_size", "conv_group_size",
                      "selector_rank", "selector_top_k")


def warm_start_draft(target, spec: DraftSpec, path: Path, same_vocab_size: bool = True) -> DFlashDraftModel:
    """The draft saved in `path` (weights and, for DSpark, its pruned vocabulary), to train further, e.g. a shipped
    draft continued on a larger corpus later. Its config must match the draft `spec` describes (named
    field by field), so a warm start never silently trains another shape, except that `spec` may ask for more layers
    (`deepened_copy`); `same_vocab_size=False` when the caller chooses its vocabulary again (`vocabulary_copy`)."""
    wanted = draft_config_for(target, spec)
    classes = {"dspark": DSparkDraftModel, "dflash2": DFlash2DraftModel, "dflash": DFlashDraftModel}
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"No draft to warm-start from in {path}: it has no config.json.")
    saved_type = json.loads(config_file.read_text()).get("model_type")
    if saved_type != wanted.model_type:
        raise ValueError(f"The draft in {path} is a {saved_type!r} draft, but this run trains {spec.kind!r} (--kind).")
    draft = classes[spec.kind].from_pretrained(path, dtype=torch.float32)
    if spec.kind != "dspark" and draft.config.drafts_pruned_vocab:
        draft = vocabulary_copy(draft)  # pruned after training, so trained further over the whole vocabulary
    if draft.config.num_hidden_layers != wanted.num_hidden_layers:
        draft = deepened_copy(draft, wanted.num_hidden_layers)
    for name in _WARM_START_FIELDS:
        if name == "draft_vocab_size" and not same_vocab_size:
            continue
        have, want = getattr(draft.config, name, None), getattr(wanted, name, None)
        if have != want:
            raise ValueError(f"The draft in {path} has {name}={have!r}, but this run's spec gives {want!r}: pass its "
                             f"value (its config.json) or train from scratch.")
    draft.to(target.device)
    draft.bind_target(target)
    return draft


# ----------------------------------------------------------------------------------------------------------------------
# Anchors, batches and the training attention mask
# ----------------------------------------------------------------------------------------------------------------------


def valid_anchor_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions that can anchor a block: an assistant token followed by an assistant token, with context before it.

    At inference the anchor is the last verified token of the answer and the block predicts what follows, so the
    first predicted token must be one the loss counts.
    """
    mask = loss_mask.bool()
    ok = torch.zeros_like(mask)
    ok[1:-1] = mask[1:-1] & mask[2:]
    return ok.nonzero()[:, 0]


def sample_anchors(loss_mask: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `count` distinct valid anchors, sorted, drawn uniformly without replacement."""
    candidates = valid_anchor_positions(loss_mask)
    if candidates.numel() <= count:
        return candidates
    pick = torch.randperm(candidates.numel(), generator=generator)[:count]
    return candidates[pick].sort().values


def training_attention_mask(anchors: torch.Tensor, anchor_valid: torch.Tensor, context_len: int,
                            block_size: int) -> torch.Tensor:
    """Bool SDPA mask [B, 1, A*b, T + A*b] over keys [context ; all blocks].

    Block i sees context positions < anchors[i] and its own b slots; never another block, never its anchor's future.
    Padded anchors (anchor_valid False) still see their own block, so no query row is empty (SDPA would give NaN).
    """
    batch, num_anchors = anchors.shape
    device = anchors.device
    context = torch.arange(context_len, device=device)[None, None, :] < anchors[:, :, None]  # [B, A, T]
    context = context & anchor_valid[:, :, None]
    context = context[:, :, None, :].expand(batch, num_anchors, block_size, context_len)
    context = context.reshape(batch, num_anchors * block_size, context_len)
    block_of = torch.arange(num_anchors * block_size, device=device) // block_size
    own_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)
    return torch.cat([context, own_block], dim=-1)[:, None]


@dataclass
class BlockBatch:
    """Padded sequences and their anchors. Shapes: B sequences, T tokens, A anchors."""

    tokens: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] bool
    context: torch.Tensor  # [B, T, K*H_t]
    final: torch.Tensor  # [B, T, H_t]
    lse: torch.Tensor  # [B, T]
    lengths: torch.Tensor  # [B]
    anchors: torch.Tensor  # [B, A]
    anchor_valid: torch.Tensor  # [B, A] bool

    def to(self, device) -> "BlockBatch":
        return BlockBatch(**{name: getattr(self, name).to(device) for name in self.__dataclass_fields__})


def collate(items: list[dict], anchors: list[torch.Tensor]) -> BlockBatch:
    """Right-pad sequences (anchors never reach padded positions) and pad anchor lists with invalid slots."""
    batch = len(items)
    length = max(item["tokens"].shape[0] for item in items)
    num_anchors = max(1, max(a.numel() for a in anchors))
    width, hidden = items[0]["context"].shape[1], items[0]["final"].shape[1]
    out = BlockBatch(
        tokens=torch.zeros(batch, length, dtype=torch.long),
        loss_mask=torch.zeros(batch, length, dtype=torch.bool),
        context=torch.zeros(batch, length, width),
        final=torch.zeros(batch, length, hidden),
        lse=torch.zeros(batch, length),
        lengths=torch.tensor([item["tokens"].shape[0] for item in items]),
        anchors=torch.zeros(batch, num_anchors, dtype=torch.long),
        anchor_valid=torch.zeros(batch, num_anchors, dtype=torch.bool),
    )
    for i, (item, anchor) in enumerate(zip(items, anchors)):
        n = item["tokens"].shape[0]
        for name in ("tokens", "loss_mask", "context", "final", "lse"):
            getattr(out, name)[i, :n] = item[name]
        out.anchors[i, : anchor.numel()] = anchor
        out.anchor_valid[i, : anchor.numel()] = True
    return out


def step_sequences(step: int, train_indices: list[int], per_step: int, seed: int, rank: int = 0,
                   world_size: int = 1) -> list[int]:
    """This process's sequences for `step`: consecutive slices of per-epoch permutations of the training split."""
    total = len(train_indices)
    picked = []
    for j in range(per_step):
        global_index = (step * world_size + rank) * per_step + j
        epoch, offset = divmod(global_index, total)
        generator = torch.Generator().manual_seed(seed * _SEED_STRIDE + epoch)
        picked.append(train_indices[int(torch.randperm(total, generator=generator)[offset])])
    return picked


def weighted_indices(store, indices: list[int], part_weights: dict[str, int]) -> list[int]:
    """`indices` with each sequence of a weighted corpus part repeated `part_weights[part]` times."""
    if not part_weights:
        return indices
    if not hasattr(store, "parts"):
        raise ValueError("part_weights (--part-weight) weigh the parts of a corpus: train with --corpus.")
    parts = store.parts()
    check_part_weights(set(parts), part_weights)
    return [i for i in indices for _ in range(part_weights.get(parts[i], 1))]


def part_shares(store, indices: list[int], part_weights: dict[str, int]) -> dict[str, dict]:
    """Per corpus part of `indices` (the training answers): how many, their answer tokens, the part's weight, and its
    share of the answer tokens one weighted epoch reads. A partial feature cache and `part_weights` decide together
    what a run learns from; this says it before the first step."""
    parts = store.parts()
    shares: dict[str, dict] = {}
    for index in indices:
        part = shares.setdefault(parts[index], {"answers": 0, "answer_tokens": 0,
                                                "weight": part_weights.get(parts[index], 1)})
        part["answers"] += 1
        part["answer_tokens"] += store.answer_tokens(index)
    read = sum(part["answer_tokens"] * part["weight"] for part in shares.values())
    for part in shares.values():
        part["epoch_share"] = part["answer_tokens"] * part["weight"] / read if read else 0.0
    return dict(sorted(shares.items(), key=lambda item: -item[1]["epoch_share"]))


def step_batch(store, step: int, train_indices: list[int], config: TrainConfig, rank: int = 0,
               world_size: int = 1) -> BlockBatch:
    indices = step_sequences(step, train_indices, config.sequences_per_step, config.seed, rank, world_size)
    items = read_sequences(store, indices)
    anchors = []
    for j, item in enumerate(items):
        generator = torch.Generator().manual_seed((config.seed * _SEED_STRIDE + step) * _SEED_STRIDE + j
                                                + rank * _RANK_STRIDE)
        anchors.append(sample_anchors(item["loss_mask"], config.anchors_per_sequence, generator))
    return collate(items, anchors)


# ----------------------------------------------------------------------------------------------------------------------
# The block forward, shared by the loss and the evaluation
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class SlotOutputs:
    """Per drafted slot (S = num_speculative_slots): hidden state, label, previous true token, validity."""

    hidden: torch.Tensor  # [B, A, S, H]
    labels: torch.Tensor  # [B, A, S] target ids
    prev: torch.Tensor  # [B, A, S] target ids of the true previous token (Markov teacher forcing)
    valid: torch.Tensor  # [B, A, S] bool: the label exists and is an assistant token
    teacher_at: torch.Tensor  # [B, A, S] position whose target distribution predicts the label


def block_slot_outputs(draft: DFlashDraftModel, batch: BlockBatch) -> SlotOutputs:
    """Run every block of the batch in one draft forward; slot s predicts the token at anchor + s + 1."""
    config = draft.config
    block = config.block_size
    batch_size, num_anchors = batch.anchors.shape
    length = batch.tokens.shape[1]
    device = batch.tokens.device
    offsets = torch.arange(block, device=device)

    anchor_ids = batch.tokens.gather(1, batch.anchors)
    block_ids = torch.full((batch_size, num_anchors, block), config.mask_token_id, dtype=torch.long, device=device)
    block_ids[:, :, 0] = anchor_ids
    block_pos = (batch.anchors[:, :, None] + offsets).reshape(batch_size, num_anchors * block)
    context_pos = torch.arange(length, device=device)[None].expand(batch_size, -1)

    dtype = draft.fc.weight.dtype
    draft._select_kernel_path(batch.context)
    context_kv = draft.encode_context(batch.context, context_pos, dtype)
    blk_cos, blk_sin = draft.rotary_emb(block_pos, dtype)
    mask = training_attention_mask(batch.anchors, batch.anchor_valid, length, block)
    key_pos = torch.cat([context_pos, block_pos], 1)
    x = draft.embed(block_ids.reshape(batch_size, num_anchors * block)).to(dtype)
    # DFlash 2's convolutions run along the sequence: told the block length, they stop at every block's start.
    per_block = {"block_len": block} if isinstance(draft, DFlash2DraftModel) else {}
    for layer, layer_context_kv in zip(draft.layers, context_kv):
        layer_mask = layer_attention_mask(layer.self_attn, mask, block_pos, key_pos)
        x = layer(x, blk_cos, blk_sin, layer_context_kv, layer_mask, **per_block)
    hidden = draft.norm(x).reshape(batch_size, num_anchors, block, -1)

    num_slots = config.num_speculative_slots
    first_slot = 0 if getattr(config, "sample_from_anchor", False) else 1
    hidden = hidden[:, :, first_slot : first_slot + num_slots]
    label_pos = batch.anchors[:, :, None] + 1 + offsets[:num_slots]
    in_range = (label_pos < batch.lengths[:, None, None]) & batch.anchor_valid[:, :, None]
    safe_pos = label_pos.clamp_max(length - 1).reshape(batch_size, -1)
    labels = batch.tokens.gather(1, safe_pos).reshape(label_pos.shape)
    assistant = batch.loss_mask.gather(1, safe_pos).reshape(label_pos.shape)
    prev = batch.tokens.gather(1, (label_pos - 1).clamp_max(length - 1).reshape(batch_size, -1))
    return SlotOutputs(hidden, labels, prev.reshape(label_pos.shape), in_range & assistant, label_pos - 1)


def slot_logits(draft: DFlashDraftModel, hidden: torch.Tensor, prev: torch.Tensor):
    """(draft-vocabulary logits [N, S, V_d], confidence logits [N, S] or None) with the Markov head teacher-forced on
    the true previous tokens: while a block is accepted the walk's own picks *are* the true tokens."""
    base = draft.logits(hidden)
    if draft.markov_head is None and draft.confidence_head is None:
        return base, None
    _, logits, confidence = markov_walk(base, hidden, prev, draft.markov_head, draft.confidence_head,
                                        bool(draft.config.confidence_head_with_markov))
    return logits, confidence


def selector_scores(draft: DFlash2DraftModel, logits: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor,
                    candidates: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [N, S, K], candidates [N, S, K]): DFlash 2's selector walked teacher-forced on the true previous tokens
    `prev` [N, S]. `candidates` default to each slot's unary top-K, the set generation walks over; the unary scores are
    the candidates' draft logits, so the selector's loss trains the backbone too."""
    selector = draft.candidate_selector
    if candidates is None:
        top = selector.candidates(logits.detach())[1]
        unary, candidates = logits.float().gather(-1, top), draft.to_target_ids(top)
    elif draft.config.drafts_pruned_vocab:
        raise ValueError("A DFlash 2 draft trains over the whole vocabulary; prune it after training.")
    else:
        unary = logits.float().gather(-1, candidates)
    _, scores = selector_walk(unary, candidates, selector.hidden_projection(hidden), selector.predecessor_codebook,
                              selector.successor_codebook, prev)
    return scores, candidates


def greedy_picks(draft: DFlashDraftModel, logits: torch.Tensor, hidden: torch.Tensor,
                 prev: torch.Tensor) -> torch.Tensor:
    """Target ids [N, S] the greedy walk picks, teacher-forced (`slot_logits`' logits; DFlash 2: its selector's
    argmax). While a block is accepted the walk's own picks are the true tokens, so the leading picks that match the
    labels are exactly what greedy speculative decoding accepts."""
    with torch.no_grad():
        if isinstance(draft, DFlash2DraftModel):
            scores, candidates = selector_scores(draft, logits, hidden, prev)
            return candidates.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
        picks = logits.argmax(-1)
        if getattr(draft.config, "drafts_pruned_vocab", False):
            picks = draft.draft_to_target()[picks]
        return picks


def _draft_labels(draft: DFlashDraftModel, labels: torch.Tensor) -> torch.Tensor:
    if getattr(draft.config, "drafts_pruned_vocab", False):
        return target_to_draft_ids(labels, draft.t2d)
    return labels


class BlockTrainingModule(nn.Module):
    """The draft plus its loss, as one module, so `accelerate` (DDP/FSDP) sees a plain forward -> loss."""

    def __init__(self, draft: DFlashDraftModel, config: TrainConfig):
        super().__init__()
        self.draft = draft
        self.config = config
        weights = slot_weights(draft.config.num_speculative_slots, config.gamma)
        self.register_buffer("weights", weights, persistent=False)

    def forward(self, batch: BlockBatch):
        draft, config = self.draft, self.config
        out = block_slot_outputs(draft, batch)
        rows = out.valid.reshape(-1, out.valid.shape[-1]).any(-1)  # blocks with at least one label
        num_slots = out.hidden.shape[2]
        hidden = out.hidden.reshape(-1, num_slots, out.hidden.shape[-1])[rows]
        prev = out.prev.reshape(-1, num_slots)[rows]
        valid = out.valid.reshape(-1, num_slots)[rows]
        labels = out.labels.reshape(-1, num_slots)[rows]
        logits, confidence = slot_logits(draft, hidden, prev)
        weights = self.weights[None].expand_as(valid)[valid]
        accepted = _accepted_lengths(greedy_picks(draft, logits, hidden, prev), labels, valid)
        metrics = {"tau": (1.0 + accepted.float()).mean().detach()}
        if isinstance(draft, DSparkDraftModel):
            teacher_at = out.teacher_at.reshape(-1, num_slots)[rows][valid]
            block_rows = torch.arange(valid.shape[0], device=valid.device)[:, None].expand_as(valid)[valid]
            batch_index = rows.nonzero()[:, 0][block_rows] // out.valid.shape[1]
            final = batch.final[batch_index, teacher_at]
            lse = batch.lse[batch_index, teacher_at]
            teacher = teacher_logits(draft.head_weight(), final)
            loss, parts = dspark_loss(
                logits[valid], _draft_labels(draft, labels[valid]), teacher, lse,
                confidence[valid] if confidence is not None else None, weights,
                config.ce_weight, config.tv_weight, config.confidence_weight,
            )
            metrics.update(parts)
        elif isinstance(draft, DFlash2DraftModel):
            # The DFlash CE on the full draft logits, plus the selector's K-way CE over each slot's unary top-K with
            # the label put in (in place of the weakest candidate) where it is missing (speculators' recipe).
            unary_loss = dflash_loss(logits[valid], labels[valid], weights)
            top = draft.candidate_selector.candidates(logits.detach())[1]
            candidates, positions = selector_training_candidates(top, labels)
            scores, _ = selector_scores(draft, logits, hidden, prev, candidates)
            chosen_loss = selector_loss(scores[valid], positions[valid], weights)
            loss = unary_loss + config.selector_weight * chosen_loss
            recall = (top == labels[..., None]).any(-1)[valid].float().mean()  # the labels a selector could pick
            metrics.update(unary=unary_loss.detach(), selector=chosen_loss.detach(), candidate_recall=recall)
        else:
            loss = dflash_loss(logits[valid], labels[valid], weights)
        return loss, metrics


def _accepted_lengths(picks: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Greedy accepted length per block [N]: leading slots whose pick (`greedy_picks`) equals the label."""
    hits = (picks == labels) & valid
    return hits.long().cumprod(-1).sum(-1)


# ----------------------------------------------------------------------------------------------------------------------
# Held-out acceptance
# ----------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def heldout_tau(draft: DFlashDraftModel, store, indices: list[int], anchor_chunk: int = 64,
                return_walks: bool = False) -> dict:
    """Teacher-forced greedy acceptance on held-out sequences.

    `tau_anchors`: mean of 1 + accepted over every valid anchor. `tau_decode`: the greedy decode walk over the
    target's own (greedy) answer: start at the first answer token, accept, jump to the bonus token, repeat; with
    greedy responses this is the tau speculative decoding of that prompt gets (the last step is capped as generate
    caps it: the sequence's last token is always a bonus). `return_walks` adds the per-sequence step lists.
    """
    was_training = draft.training
    draft.eval()
    anchor_taus, walks = [], []
    items = (item for start in range(0, len(indices), EVAL_READ) for item in
             read_sequences(store, indices[start : start + EVAL_READ]))
    for item in items:
        anchors = valid_anchor_positions(item["loss_mask"])
        if anchors.numel() == 0:
            continue
        accepted = []
        for start in range(0, anchors.numel(), anchor_chunk):
            chunk = anchors[start : start + anchor_chunk]
            batch = collate([item], [chunk]).to(draft.fc.weight.device)
            out = block_slot_outputs(draft, batch)
            num_slots = out.hidden.shape[2]
            hidden = out.hidden.reshape(-1, num_slots, out.hidden.shape[-1])
            prev = out.prev.reshape(-1, num_slots)
            logits, _ = slot_logits(draft, hidden, prev)
            accepted.append(_accepted_lengths(greedy_picks(draft, logits, hidden, prev),
                                              out.labels.reshape(-1, num_slots),
                                              out.valid.reshape(-1, num_slots)).cpu())
        accepted = torch.cat(accepted)
        anchor_taus.extend((1 + accepted).tolist())
        by_position = dict(zip(anchors.tolist(), accepted.tolist()))
        length = item["tokens"].shape[0]
        position, walk = int(anchors[0]), []
        while position in by_position:
            taken = min(by_position[position], length - 2 - position)
            walk.append(1 + taken)
            position += 1 + taken
        walks.append(walk)
    draft.train(was_training)
    steps = [step for walk in walks for step in walk]

    def mean(values):
        return sum(values) / len(values) if values else 0.0

    result = {"tau_anchors": mean(anchor_taus), "tau_decode": mean(steps), "blocks": len(anchor_taus),
              "sequences": len(indices)}
    if return_walks:
        result["walks"] = walks
    return result


# ----------------------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------------------


# A `max_minutes` budget fixes the step count from the rate of PROBE_STEPS steps, timed after PROBE_WARMUP ones
# (the first steps pay for CUDA start-up and kernel selection: on an H200 they halved the measured rate).
PROBE_WARMUP, PROBE_STEPS = 5, 20


def fit_steps(done: int, elapsed_s: float, per_step_s: float, budget_minutes: float, max_steps: int) -> int:
    """The step count that fits what is left of `budget_minutes` at `per_step_s`, within [done, max_steps]."""
    left = budget_minutes * 60 - elapsed_s
    return max(done, min(max_steps, done + int(left / max(per_step_s, 1e-9))))


def cosine_with_warmup(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Learning-rate factor: linear warm-up, then cosine down to `min_ratio`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _checkpoints(directory: Path) -> list[Path]:
    found = [p for p in directory.glob(f"{CHECKPOINT_PREFIX}*") if (p / TRAINER_STATE_FILE).exists()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]))


def _to_float(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items()}


def train_loop(draft: DFlashDraftModel, store, config: TrainConfig, out_dir: Path,
               step_callback: Callable[[int, dict], None] | None = None, accelerator=None) -> dict:
    """Train `draft` on `store` (a `FeatureStore`/`OnlineFeatures`), resuming from the newest checkpoint in
    `out_dir/checkpoints`. Returns the final metrics. `step_callback(step, metrics)` runs after every step."""
    from accelerate import Accelerator

    out_dir = Path(out_dir)
    checkpoint_dir = out_dir / "checkpoints"
    on_cpu = draft.fc.weight.device.type == "cpu"
    accelerator = accelerator or Accelerator(cpu=on_cpu, mixed_precision=config.mixed_precision,
                                             step_scheduler_with_optimizer=False)
    if list(store.layer_ids) != list(draft.config.target_layer_ids):
        raise ValueError(f"The features hold target layers {store.layer_ids} but the draft reads "
                         f"{draft.config.target_layer_ids} (`target_layer_ids`); cache features for its layers.")
    train_indices, heldout_indices = store.split(heldout=False), store.split(heldout=True)
    train_indices = weighted_indices(store, train_indices, config.part_weights)
    if not train_indices:
        raise ValueError("The feature store has no training sequences (all are held out).")
    module = BlockTrainingModule(draft, config)
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        (no_decay if param.ndim < 2 or "norm" in name else decay).append(param)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.learning_rate, betas=tuple(config.adam_betas),
    )
    # `max_minutes` may lower the step count once the step rate is known; the plan is checkpointed, so a resumed run
    # keeps the schedule it was fitted to (and a finished one run again does no more steps).
    plan = {"steps": config.max_steps, "fitted": not config.max_minutes}

    def lr_factor(step: int) -> float:
        warmup = max(1, int(config.warmup_ratio * plan["steps"]))
        return cosine_with_warmup(step, plan["steps"], warmup, config.min_lr_ratio)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    module, optimizer, scheduler = accelerator.prepare(module, optimizer, scheduler)
    step, last = 0, {}
    existing = _checkpoints(checkpoint_dir)
    if existing:
        accelerator.load_state(str(existing[-1]))
        state = json.loads((existing[-1] / TRAINER_STATE_FILE).read_text())
        step, last = state["step"], state.get("metrics", {})
        plan.update(state.get("plan", {}))
        logger.info("Resumed from %s at step %d of %d", existing[-1], step, plan["steps"])
    unwrapped = accelerator.unwrap_model(module).draft
    metrics_path = out_dir / METRICS_FILE
    heldout_sample = heldout_indices[: config.eval_sequences]
    bar = tqdm(total=plan["steps"], initial=step, desc=f"train {type(unwrapped).__name__}", unit="step",
               disable=not accelerator.is_local_main_process)
    module.train()
    first_step, started = step, time.monotonic()
    while step < plan["steps"]:
        batch = step_batch(store, step, train_indices, config, accelerator.process_index,
                           accelerator.num_processes).to(accelerator.device)
        with accelerator.autocast():
            loss, metrics = module(batch)
        accelerator.backward(loss)
        grad_norm = accelerator.clip_grad_norm_(module.parameters(), config.max_grad_norm)
        optimizer.step()
        step += 1
        if step == first_step + PROBE_WARMUP:
            probe_start = time.monotonic()
        if not plan["fitted"] and step == first_step + PROBE_WARMUP + PROBE_STEPS:  # before the next rate is set
            now = time.monotonic()
            plan["steps"] = fit_steps(step, now - started, (now - probe_start) / PROBE_STEPS, config.max_minutes,
                                      config.max_steps)
            plan["fitted"] = True
            bar.total = plan["steps"]
            logger.info("%.1f-minute budget: %d steps", config.max_minutes, plan["steps"])
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        last = {"step": step, "loss": float(loss.detach()), "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm), **_to_float(metrics)}
        bar.update(1)
        bar.set_postfix(loss=f"{last['loss']:.3f}", tau=f"{last['tau']:.2f}")
        if config.eval_every and (step % config.eval_every == 0 or step == plan["steps"]) and heldout_sample:
            last.update({f"heldout_{k}": v for k, v in heldout_tau(unwrapped, store, heldout_sample,
                                                                   config.eval_anchor_chunk).items()})
        if accelerator.is_main_process and (step % config.log_every == 0 or "heldout_tau_anchors" in last):
            logger.info("step %d %s", step, json.dumps({k: round(v, 4) for k, v in last.items()}))
            metrics_path.parent.mkdir(parents=True, exist_ok=True)
            with metrics_path.open("a") as handle:
                handle.write(json.dumps(last) + "\n")
        if step % config.checkpoint_every == 0 or step == plan["steps"]:
            save_checkpoint(accelerator, checkpoint_dir, {"step": step, "plan": plan, "metrics": last},
                            config.keep_checkpoints)
        if step_callback is not None:
            step_callback(step, last)
    bar.close()
    return last


def save_checkpoint(accelerator, checkpoint_dir: Path, state: dict, keep: int) -> Path:
    """Model, optimizer, scheduler and RNG through accelerate, then `state` (step, plan, last metrics); the state file
    is written last, so a checkpoint cut by a kill is never picked up."""
    path = Path(checkpoint_dir) / f"{CHECKPOINT_PREFIX}{state['step']:07d}"
    accelerator.save_state(str(path))
    if accelerator.is_main_process:
        (path / TRAINER_STATE_FILE).write_text(json.dumps(state))
        for old in _checkpoints(Path(checkpoint_dir))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


def config_dict(config) -> dict:
    return asdict(config)
