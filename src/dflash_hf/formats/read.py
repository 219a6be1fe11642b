"""Each dialect's config.json as our config, and what happens to its tensors on the way in: a `LoadPlan`.

`plan_load` picks the reader for the dialect `detect_dialect` names. The readers check every required field (no
default is right for every draft), the target layer ids (in each dialect's own convention), RoPE, which sliding-window
layers attend causally, the vocabulary maps and the codebooks' spelling, and refuse the variants this package does not
compute; nothing here reads a tensor, only the names the checkpoint holds.
"""

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig

from ..configuration_dflash import DFlashConfig, DSparkConfig
from ..configuration_dflash2 import DFlash2Config
from ..modeling_dflash import DFlashDraftModel, DSparkDraftModel
from ..modeling_dflash2 import DFlash2DraftModel
from .files import CONFIG_NAME
from .recognise import (
    DEEPSPEC,
    MODELOPT,
    OURS,
    SPECULATORS_DFLASH,
    SPECULATORS_DFLASH2,
    SPECULATORS_DIALECTS,
    SPECULATORS_DSPARK,
    ZLAB,
    ZLAB_DFLASH2,
    detect_dialect,
)

logger = logging.getLogger(__name__)

# speculators' own defaults for fields a checkpoint may leave out (its DFlash/DSpark/DFlash2 pydantic configs; DFlash2's
# from the "experimental DFlash2" PR, vllm-project/speculators#1006: note its sliding layers default to bidirectional).
SPECULATORS_DEFAULTS = {
    "dflash": {"sample_from_anchor": False, "sliding_window_non_causal": False},
    "dspark": {"sample_from_anchor": True, "markov_rank": 256, "markov_head_type": "vanilla",
               "enable_confidence_head": True, "confidence_head_with_markov": True,
               "sliding_window_non_causal": False},
    "dflash2": {"sample_from_anchor": False, "sliding_window_non_causal": True, "conv_kernel_size": 2,
                "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16},
}
# DFlash 2's own config fields, required by z-lab's code (no default there) and by our config.
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Optional z-lab 0.1.0 fields (dflash_config or top level) that change what the draft computes.
ZLAB_OPTIONAL_FIELDS = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")
# The selector's codebooks are bare tensors in the released checkpoints; a checkpoint re-saved from z-lab's own model
# (whose codebooks are `nn.Embedding`s) spells them with `.weight`. Both load.
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
# Tensors some dialects ship that only their training uses (the frozen verifier head/norm, RoPE caches).
TRAINING_ONLY_TENSORS = {
    ZLAB: {"rotary_emb.inv_freq"},
    MODELOPT: {"rotary_emb.inv_freq"},
    ZLAB_DFLASH2: {"rotary_emb.inv_freq"},
    SPECULATORS_DFLASH: {"verifier_norm.weight", "verifier_lm_head.weight"},
    SPECULATORS_DSPARK: {"verifier_norm.weight", "verifier_lm_head.weight"},
    SPECULATORS_DFLASH2: {"verifier_norm.weight", "verifier_lm_head.weight"},
    DEEPSPEC: {"rotary_emb.inv_freq"},
    OURS: {"rotary_emb.inv_freq"},
}
# z-lab/ModelOpt drafter variants whose extra math our model does not implement: loading them would draft garbage.
UNSUPPORTED_DFLASH_CONFIG_KEYS = ("attention_sink_bias", "attention_value_scale", "projector_type")
# speculators DFlash variants (newer releases) that change the math or the label alignment: value -> what we compute.
SPECULATORS_PLAIN_VALUES = {"projector_type": (None, "dflash"), "shift_label": (None, False)}


@dataclass
class LoadPlan:
    """How one checkpoint becomes our model: the config, and what happens to each tensor on the way in."""

    dialect: str
    config: DFlashConfig
    ignored: set[str] = field(default_factory=set)  # checkpoint tensors we knowingly drop
    fills: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)  # our tensors the dialect omits
    renames: dict[str, str] = field(default_factory=dict)  # checkpoint name -> ours, where a dialect spells it apart

    @property
    def model_class(self) -> type[DFlashDraftModel]:
        if isinstance(self.config, DSparkConfig):
            return DSparkDraftModel
        return DFlash2DraftModel if isinstance(self.config, DFlash2Config) else DFlashDraftModel


# ----------------------------------------------------------------------------------------------------------------------
# What every reader shares
# ----------------------------------------------------------------------------------------------------------------------


def _layer_fields(raw: dict, context: str) -> dict:
    """Our layer fields from a Qwen3-style config dict, read the way the dialect's own code reads it.

    transformers' config class for the dict's model_type supplies the defaults and standardizes RoPE
    (`rope_theta` + `rope_scaling`, or `rope_parameters`); the sliding window is read from the dict itself, because
    Qwen3Config drops it unless `use_sliding_window` is set while z-lab and vLLM honour it per `layer_types`.
    """
    model_type = raw.get("model_type") or "qwen3"
    try:
        parsed = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{context}: cannot read the layer config (model_type={model_type!r}): {error}") from error
    num_layers = parsed.num_hidden_layers
    fields = {
        name: getattr(parsed, name)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range",
                     "rms_norm_eps", "attention_bias", "attention_dropout")
    }
    fields["head_dim"] = getattr(parsed, "head_dim", None) or parsed.hidden_size // parsed.num_attention_heads
    fields["layer_types"] = list(raw.get("layer_types") or getattr(parsed, "layer_types", None)
                                 or ["full_attention"] * num_layers)
    fields["sliding_window"] = raw.get("sliding_window")
    fields["rope_parameters"] = _rope_parameters(parsed, context)
    return fields


def _rope_parameters(parsed, context: str) -> dict:
    rope = dict(getattr(parsed, "rope_parameters", None) or {})
    if "full_attention" in rope or "sliding_attention" in rope:
        variants = {json.dumps(v, sort_keys=True) for v in rope.values()}
        if len(variants) != 1:
            raise ValueError(f"{context}: per-layer-type RoPE parameters {rope} are not supported (one RoPE per draft).")
        rope = next(iter(rope.values()))
    rope.pop("type", None)  # the legacy spelling of rope_type, already standardized
    rope.setdefault("rope_type", "default")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{context}: partial rotary embeddings (partial_rotary_factor="
                         f"{rope['partial_rotary_factor']}) are not supported by this draft model.")
    rope.pop("partial_rotary_factor", None)
    return rope


def _check_layer_ids(context: str, field_name: str, raw_ids, ours: list[int], num_target_layers: int) -> None:
    """Layer ids out of range would read the wrong hidden states (or none): say which field and convention."""
    bad = [t for t in ours if not 0 <= t < num_target_layers]
    if bad:
        shown = f"{field_name}={raw_ids}" + (f" (ours: {ours})" if list(raw_ids) != ours else "")
        raise ValueError(
            f"{context}: target layer ids out of range: {shown}; with num_target_layers={num_target_layers} our ids "
            f"(t reads hidden_states[t + 1]) must lie in [0, {num_target_layers})."
        )


def _require(fields: dict, dialect: str, note: str = "") -> None:
    """Raise naming every required config field that is absent or null: no default is right for every draft, and a
    wrong one loads and drafts garbage silently."""
    missing = [f"`{name}`" for name, value in fields.items() if value is None]
    if missing:
        raise ValueError(f"{CONFIG_NAME} has no {', '.join(missing)}{note}, which a {dialect} draft config must "
                         "state; add the values the draft was trained with.")


def _recorded_layer_count(recorded, overrides: dict, context: str) -> int:
    requested = overrides.get("num_target_layers")
    if recorded is None and requested is None:
        raise ValueError(f"{context}: {CONFIG_NAME} has no `num_target_layers` (the target's decoder layer count, "
                         "which checks the target layer ids, or gives them when absent); pass num_target_layers=N.")
    if recorded is not None and requested is not None and int(requested) != int(recorded):
        raise ValueError(f"{context}: num_target_layers={requested} was requested but the checkpoint records "
                         f"{recorded}.")
    return int(recorded if recorded is not None else requested)


def _codebook_renames(names: set[str], context: str) -> dict[str, str]:
    """`candidate_selector.*_codebook.weight` (a checkpoint re-saved from z-lab's `nn.Embedding` codebooks) read as
    the bare tensors the released DFlash 2 checkpoints hold, and ours."""
    renames = {}
    for name in CODEBOOKS:
        suffixed = f"{name}.weight"
        if suffixed in names:
            if name in names:
                raise ValueError(f"{context}: the checkpoint holds both `{name}` and `{suffixed}`: one codebook "
                                 "stored twice, and nothing says which is meant.")
            renames[suffixed] = name
    return renames


def _embedding_plan(names: set[str], context: str) -> dict[str, bool]:
    """What the draft borrows from the target: each table the checkpoint does not ship. speculators 0.9.0 ships a
    pruned lm_head and never the embedding (the verifier's is borrowed, as vLLM does); no dialect ships an embedding
    without a head, so that is a file missing its `lm_head`."""
    embedding, head = "embed_tokens.weight" in names, "lm_head.weight" in names
    if embedding and not head:
        raise ValueError(f"{context}: missing tensors: lm_head.weight (a draft that ships its embedding ships its "
                         "lm_head too).")
    return {"shares_target_input_embedding": not embedding, "shares_target_lm_head": not head}


def _identity_vocab_fills(config: DSparkConfig) -> dict:
    return {"d2t": lambda: torch.zeros(config.draft_vocab_size, dtype=torch.long),
            "t2d": lambda: torch.ones(config.vocab_size, dtype=torch.bool)}


# ----------------------------------------------------------------------------------------------------------------------
# z-lab and NVIDIA ModelOpt (DFlash), z-lab DFlash 2
# ----------------------------------------------------------------------------------------------------------------------


def _zlab_plan(raw: dict, dialect: str, context: str, overrides: dict) -> LoadPlan:
    dflash = raw["dflash_config"]
    unsupported = [key for key in UNSUPPORTED_DFLASH_CONFIG_KEYS
                   if dflash.get(key) not in (None, False, "dflash")]
    if unsupported:
        raise ValueError(f"{context}: dflash_config uses {', '.join(f'{k}={dflash[k]!r}' for k in unsupported)}, "
                         "a drafter variant this package does not implement.")
    fields = _layer_fields(raw, context)
    if dflash.get("use_swa") and "sliding_attention" not in fields["layer_types"]:
        # ModelOpt's all-layer sliding window: every draft layer slides, over `swa_window_size` tokens.
        fields["layer_types"] = ["sliding_attention"] * fields["num_hidden_layers"]
        fields["sliding_window"] = dflash.get("swa_window_size", fields["sliding_window"])
    fields["sliding_window_causal"] = _zlab_sliding_causal(raw, dflash, fields["layer_types"], context)
    num_target_layers = _recorded_layer_count(raw.get("num_target_layers"), overrides, context)
    block_size = raw.get("block_size", dflash.get("block_size"))
    # z-lab's own code derives `target_layer_ids` from `num_target_layers` when dflash_config has none; so do we.
    _require({"block_size": block_size, "dflash_config.mask_token_id": dflash.get("mask_token_id")}, dialect,
             " (block_size: at the top level or in dflash_config)" if block_size is None else "")
    target_layer_ids = dflash.get("target_layer_ids")
    if target_layer_ids is not None:
        _check_layer_ids(context, "dflash_config.target_layer_ids", target_layer_ids, list(target_layer_ids),
                         num_target_layers)
    # z-lab 0.1.0 applies these to DFlash drafts too; set only when the checkpoint states them.
    optional = {name: dflash.get(name, raw.get(name)) for name in ZLAB_OPTIONAL_FIELDS}
    config = DFlashConfig(
        **fields,
        **{name: value for name, value in optional.items() if value is not None},
        target_hidden_size=raw.get("target_hidden_size") or fields["hidden_size"],
        num_target_layers=num_target_layers,
        target_layer_ids=target_layer_ids,
        block_size=block_size,
        mask_token_id=dflash["mask_token_id"],
        shares_target_input_embedding=True,
        shares_target_lm_head=True,
    )
    return LoadPlan(dialect, config, ignored=set(TRAINING_ONLY_TENSORS[dialect]))


def _zlab_sliding_causal(raw: dict, dflash: dict, layer_types: list[str], context: str) -> bool:
    """Whether the draft's sliding-window layers attend causally inside the block (our `sliding_window_causal`).

    z-lab 0.1.0 reads a top-level `is_causal`: null makes sliding layers causal and full ones bidirectional, a bool
    applies to every layer. ModelOpt writes `dflash_config.causal` (sliding layers only; bidirectional by default under
    its all-layer `use_swa`). Our full-attention layers are always bidirectional, so `is_causal: true` beside a
    full-attention layer describes a draft this package does not compute: refused rather than loaded wrong.
    """
    default = bool(dflash.get("causal", not dflash.get("use_swa", False)))
    is_causal = raw.get("is_causal")
    if is_causal is None:
        return default
    if not isinstance(is_causal, bool):
        raise ValueError(f"{context}: `is_causal` = {is_causal!r}, expected true, false or null.")
    full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    if is_causal and full:
        raise ValueError(
            f"{context}: `is_causal` = true makes every draft layer causal inside the block, the full-attention "
            f"layers {full} included (layer_types={layer_types}); this package's full-attention draft layers are "
            "always bidirectional inside the block, so that draft would compute something else. Only "
            "sliding-window layers can be causal here (`is_causal` null or absent: sliding causal, full "
            "bidirectional)."
        )
    if "causal" in dflash and bool(dflash["causal"]) != is_causal:
        raise ValueError(f"{context}: `is_causal` = {is_causal} and `dflash_config.causal` = {dflash['causal']!r} "
                         "disagree about the sliding-window layers; keep one of them.")
    return is_causal


def _zlab_dflash2_plan(raw: dict, context: str, names: set[str], overrides: dict) -> LoadPlan:
    """z-lab's DFlash 2 layout: its fields in `dflash_config` or at the top level, `dflash_config` winning (z-lab's
    `_draft_value`); `is_causal` at the top level."""
    dflash = raw.get("dflash_config")
    if dflash is None:
        dflash = {}
    if not isinstance(dflash, dict):
        raise ValueError(f"`dflash_config` is {type(dflash).__name__}, expected a dict (or absent, with the DFlash 2 "
                         "fields at the top level).")

    def value(name):
        return dflash.get(name, raw.get(name))

    unsupported = [key for key in (*UNSUPPORTED_DFLASH_CONFIG_KEYS, "fc_layernorm")
                   if value(key) not in (None, False, "dflash")]
    if unsupported:
        raise ValueError(f"{context}: uses {', '.join(f'{k}={value(k)!r}' for k in unsupported)}, a drafter variant "
                         "this package does not implement.")
    fields = _layer_fields(raw, context)
    # Seen in other DFlash 2 families, read by neither z-lab's code nor ours: a selector vocabulary other than the
    # draft's would mean a different walk, so it is refused rather than ignored.
    selector_vocab = value("selector_vocab_size")
    if selector_vocab is not None and selector_vocab != fields["vocab_size"]:
        raise ValueError(f"{context}: selector_vocab_size={selector_vocab!r} differs from vocab_size="
                         f"{fields['vocab_size']}; a selector over another vocabulary is not implemented here.")
    fields["sliding_window_causal"] = _zlab_sliding_causal(raw, dflash, fields["layer_types"], context)
    num_target_layers = _recorded_layer_count(raw.get("num_target_layers"), overrides, context)
    required = {name: value(name) for name in ("block_size", "mask_token_id", *DFLASH2_FIELDS)}
    _require(required, ZLAB_DFLASH2, " (in dflash_config or at the top level)")
    target_layer_ids = value("target_layer_ids")
    if target_layer_ids is not None:
        _check_layer_ids(context, "target_layer_ids", target_layer_ids, list(target_layer_ids), num_target_layers)
    config = DFlash2Config(
        **fields,
        **required,
        **{name: value(name) for name in ZLAB_OPTIONAL_FIELDS},
        target_hidden_size=raw.get("target_hidden_size") or fields["hidden_size"],
        num_target_layers=num_target_layers,
        target_layer_ids=target_layer_ids,
        shares_target_input_embedding=True,
        shares_target_lm_head=True,
    )
    return LoadPlan(ZLAB_DFLASH2, config, ignored=set(TRAINING_ONLY_TENSORS[ZLAB_DFLASH2]),
                    renames=_codebook_renames(names, context))


# ----------------------------------------------------------------------------------------------------------------------
# speculators (DFlash, DSpark, DFlash 2)
# ----------------------------------------------------------------------------------------------------------------------


def _speculators_layer_count(raw: dict, overrides: dict, context: str, hub_options: dict) -> int:
    """speculators configs do not store the target's depth: ask the caller, else read the verifier's config."""
    if overrides.get("num_target_layers") is not None:
        return int(overrides["num_target_layers"])
    verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    verifier_config = _verifier_config(verifier, hub_options) if verifier else None
    if verifier_config is None:
        raise ValueError(
            f"{context}: speculators checkpoints do not record the target's layer count and its verifier "
            f"({verifier!r}) could not be read; pass num_target_layers=N (the target's decoder layer count)."
        )
    text = verifier_config.get("text_config") or verifier_config
    return int(text["num_hidden_layers"])


def _verifier_config(name_or_path: str, hub_options: dict) -> dict | None:
    local = Path(name_or_path).expanduser()
    if (local / CONFIG_NAME).is_file():
        return json.loads((local / CONFIG_NAME).read_text())
    if local.is_absolute() or local.exists():
        return None
    try:
        from huggingface_hub import hf_hub_download

        options = {k: hub_options[k] for k in ("cache_dir", "token", "local_files_only") if k in hub_options}
        return json.loads(Path(hf_hub_download(name_or_path, CONFIG_NAME, **options)).read_text())
    except Exception as error:  # offline, gated or gone: the caller then asks for num_target_layers
        logger.info("Could not read the verifier config %s: %s", name_or_path, error)
        return None


def _speculators_plan(raw: dict, dialect: str, context: str, names: set[str], overrides: dict,
                      hub_options: dict) -> LoadPlan:
    kind = raw["speculators_model_type"]
    settings = {**SPECULATORS_DEFAULTS[kind],
                **{k: raw[k] for k in SPECULATORS_DEFAULTS[kind] if raw.get(k) is not None}}
    _require({name: raw.get(name) for name in ("transformer_layer_config", "draft_vocab_size", "block_size",
                                                "aux_hidden_state_layer_ids", "mask_token_id")}, dialect)
    variants = [f"{key}={raw[key]!r}" for key, plain in SPECULATORS_PLAIN_VALUES.items() if raw.get(key) not in plain]
    if variants:
        raise ValueError(f"{context}: {', '.join(variants)} is a speculators DFlash variant (another projector or "
                         "shifted labels) this package does not implement.")
    layer_config = raw["transformer_layer_config"]
    if not isinstance(layer_config, dict):
        raise ValueError(f"`transformer_layer_config` is {type(layer_config).__name__}, expected a dict.")
    fields = _layer_fields(layer_config, context)
    fields["sliding_window_causal"] = not settings["sliding_window_non_causal"]
    num_target_layers = _speculators_layer_count(raw, overrides, context, hub_options)
    aux_ids = raw["aux_hidden_state_layer_ids"]
    if not aux_ids:
        raise ValueError(f"`aux_hidden_state_layer_ids` = {aux_ids!r}, expected the ids of the layers the draft reads.")
    target_layer_ids = [int(a) - 1 for a in aux_ids]  # speculators' a reads hidden_states[a]; ours t reads [t + 1]
    _check_layer_ids(context, "aux_hidden_state_layer_ids", aux_ids, target_layer_ids, num_target_layers)
    vocab_size = fields["vocab_size"]
    draft_vocab_size = int(raw["draft_vocab_size"])
    pruned = draft_vocab_size < vocab_size
    if kind == "dflash2":
        # speculators' DFlash2 model refuses both, as the serving engines' DFlash 2 contract does.
        if pruned:
            raise ValueError(f"{context}: draft_vocab_size={draft_vocab_size} < vocab_size={vocab_size}, but a DFlash "
                             "2 draft proposes from the full target vocabulary (its codebooks are indexed by target "
                             "ids); speculators itself refuses this config.")
        if settings["sample_from_anchor"]:
            raise ValueError(f"{context}: sample_from_anchor=true, but a DFlash 2 draft keeps the anchor as the bonus "
                             "token (DFlash layout); speculators itself refuses this config.")
    if pruned and not {"d2t", "t2d"} <= names:
        absent = sorted({"d2t", "t2d"} - names)
        raise ValueError(f"{context}: missing tensors: {', '.join(absent)} (draft_vocab_size={draft_vocab_size} < "
                         f"vocab_size={vocab_size} needs both vocabulary maps).")
    common = dict(
        **fields,
        target_hidden_size=raw.get("target_hidden_size") or fields["hidden_size"],
        num_target_layers=num_target_layers,
        target_layer_ids=target_layer_ids,
        block_size=raw["block_size"],
        mask_token_id=raw["mask_token_id"],
        **_embedding_plan(names, context),
        tie_word_embeddings=False,
    )
    ignored = set(TRAINING_ONLY_TENSORS[dialect]) | (set() if pruned else _unpruned_maps(names, vocab_size, context))
    if kind == "dflash2":
        config = DFlash2Config(**common, **{name: settings[name] for name in DFLASH2_FIELDS})
        return LoadPlan(dialect, config, ignored=ignored, renames=_codebook_renames(names, context))
    if not (kind == "dspark" or settings["sample_from_anchor"]):
        return LoadPlan(dialect, DFlashConfig(**common, draft_vocab_size=draft_vocab_size), ignored=ignored)
    # The anchor-sampling layout needs DSpark's machinery, with or without its heads.
    heads = {k: settings[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                      "confidence_head_with_markov")} if kind == "dspark" else {
        "markov_rank": 0, "enable_confidence_head": False, "confidence_head_with_markov": False}
    config = DSparkConfig(**common, **heads, draft_vocab_size=draft_vocab_size,
                          sample_from_anchor=settings["sample_from_anchor"])
    fills = {} if pruned else _identity_vocab_fills(config)
    return LoadPlan(dialect, config, ignored=ignored, fills=fills)


def _unpruned_maps(names: set[str], vocab_size: int, context: str) -> set[str]:
    """speculators ignores d2t/t2d when the draft keeps the whole vocabulary; so do we, after logging it."""
    present = {"d2t", "t2d"} & names
    if present:
        logger.info("%s: ignoring %s: draft_vocab_size equals vocab_size=%d.", context, sorted(present), vocab_size)
    return present


# ----------------------------------------------------------------------------------------------------------------------
# DeepSpec (flat DSpark) and ours
# ----------------------------------------------------------------------------------------------------------------------


def _deepspec_plan(raw: dict, context: str, names: set[str], overrides: dict) -> LoadPlan:
    _require({name: raw.get(name) for name in ("block_size", "mask_token_id", "target_layer_ids")}, DEEPSPEC)
    fields = _layer_fields(raw, context)
    num_target_layers = _recorded_layer_count(raw.get("num_target_layers"), overrides, context)
    target_layer_ids = [int(t) for t in raw["target_layer_ids"]]
    _check_layer_ids(context, "target_layer_ids", target_layer_ids, target_layer_ids, num_target_layers)
    markov_rank = int(raw.get("markov_rank", 0))
    enable_confidence = bool(raw.get("enable_confidence_head", False))
    config = DSparkConfig(
        **fields,
        target_hidden_size=fields["hidden_size"],
        num_target_layers=num_target_layers,
        target_layer_ids=target_layer_ids,
        block_size=raw["block_size"],
        mask_token_id=raw["mask_token_id"],
        **_embedding_plan(names, context),
        tie_word_embeddings=False,
        markov_rank=markov_rank,
        markov_head_type=raw.get("markov_head_type", "vanilla"),
        enable_confidence_head=enable_confidence,
        confidence_head_with_markov=bool(raw.get("confidence_head_with_markov", False)) and enable_confidence,
        # DeepSpec's blocks are [anchor, MASK...] with every slot predicting the next token (labels anchor+1..+b).
        sample_from_anchor=True,
    )
    return LoadPlan(DEEPSPEC, config, ignored=set(TRAINING_ONLY_TENSORS[DEEPSPEC]),
                    fills=_identity_vocab_fills(config))


def _ours_plan(raw: dict, context: str, overrides: dict) -> LoadPlan:
    """The config class checks its own required fields (`from_dict`); a target depth the caller gives fills in."""
    config_class = {DSparkConfig.model_type: DSparkConfig,
                    DFlash2Config.model_type: DFlash2Config}.get(raw.get("model_type"), DFlashConfig)
    raw = {**raw, "num_target_layers": _recorded_layer_count(raw.get("num_target_layers"), overrides, context)}
    ids = raw.get("target_layer_ids")
    if ids is not None:
        _check_layer_ids(context, "target_layer_ids", ids, list(ids), raw["num_target_layers"])
    return LoadPlan(OURS, config_class.from_dict(raw), ignored=set(TRAINING_ONLY_TENSORS[OURS]))


# ----------------------------------------------------------------------------------------------------------------------
# Any dialect
# ----------------------------------------------------------------------------------------------------------------------


def plan_load(raw: dict, names: set[str], source: str, overrides: dict | None = None,
              hub_options: dict | None = None) -> LoadPlan:
    """The load plan for a checkpoint whose config is `raw` and whose tensors are `names`."""
    overrides, hub_options = overrides or {}, hub_options or {}
    dialect = detect_dialect(raw, source)
    context = f"{source} ({dialect} checkpoint)"
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ValueError(f"{context}: quantized checkpoints (quantization_config: {method!r}) are not supported; "
                         "load an unquantized (bf16/fp16/fp32) export of the draft.")
    try:
        if dialect == OURS:
            return _ours_plan(raw, context, overrides)
        if dialect in (ZLAB, MODELOPT):
            return _zlab_plan(raw, dialect, context, overrides)
        if dialect == ZLAB_DFLASH2:
            return _zlab_dflash2_plan(raw, context, names, overrides)
        if dialect in SPECULATORS_DIALECTS.values():
            return _speculators_plan(raw, dialect, context, names, overrides, hub_options)
        return _deepspec_plan(raw, context, names, overrides)
    except ValueError as error:
        if context in str(error):
            raise
        raise ValueError(f"{context}: {error}") from error
