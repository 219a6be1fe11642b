"""Every draft checkpoint users bring: recognise its dialect, load it as our model, export it for serving engines.

Dialects (REFERENCE.md sections 5 and 9): ours (`model_type` dflash/dspark/dflash2), z-lab (DFlash and DFlash 2),
NVIDIA ModelOpt exports, speculators DFlash, DSpark and DFlash 2, and DeepSpec's flat DSpark configs. Their conventions
differ in layer ids (speculators' aux id `a` is our `a - 1`), config keys, RoPE spelling, anchor layout, vocabulary
maps, the input order of the rnn Markov projection, which draft layers attend causally inside the block, and (DFlash 2)
whether the selector's codebooks carry a `.weight` suffix. All of that is converted once, here, so the model classes
know a single convention.

Loading builds the model on the meta device and assigns the checkpoint's tensors, so a large draft never exists
twice in memory; every check (required config fields, tensor names, shapes, finite values, vocabulary maps, layer
ids) runs before the model is filled, so a bad checkpoint raises and nothing is half-loaded. Exports are written to a
temporary folder beside the destination and renamed into place; one a killed export left behind is removed by the
next export to the same destination (`atomic_folder`).
"""

import glob
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

from .configuration_dflash import DFlashConfig, DSparkConfig
from .configuration_dflash2 import DFlash2Config
from .modeling_dflash import DFlashDraftModel, DSparkDraftModel, check_finite_weights, check_vocab_mapping
from .modeling_dflash2 import DFlash2DraftModel

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

OURS, ZLAB, MODELOPT, ZLAB_DFLASH2 = "dflash-hf", "z-lab", "modelopt", "z-lab-dflash2"
SPECULATORS_DFLASH, SPECULATORS_DSPARK, DEEPSPEC = "speculators-dflash", "speculators-dspark", "deepspec-dspark"
SPECULATORS_DFLASH2 = "speculators-dflash2"
DIALECTS = (OURS, ZLAB, MODELOPT, ZLAB_DFLASH2, SPECULATORS_DFLASH, SPECULATORS_DSPARK, SPECULATORS_DFLASH2, DEEPSPEC)
EXPORT_FORMATS = ("hf", "speculators", "zlab")
SPECULATORS_DIALECTS = {"dflash": SPECULATORS_DFLASH, "dspark": SPECULATORS_DSPARK, "dflash2": SPECULATORS_DFLASH2}

ZLAB_ARCHITECTURE = "DFlashDraftModel"
ZLAB_DFLASH2_ARCHITECTURE = "DFlash2DraftModel"  # z-lab `dflash` 0.1.0; speculators' dflash2 configs name it too
DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"
SPECULATORS_ARCHITECTURES = {"dflash": "DFlashSpeculator", "dspark": "DSparkSpeculator",
                             "dflash2": ZLAB_DFLASH2_ARCHITECTURE}
# The speculators release whose config layout `export_draft(to="speculators")` writes.
SPECULATORS_FORMAT_VERSION = "0.9.0"
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

FOLDER_MODE = 0o777  # before the umask, as mkdir would
# Inside each export's temporary folder while it is written: who writes it, so a later export can prove a leftover
# folder is a dead export's and remove it (`_remove_stale_partials`).
PARTIAL_MARKER = ".dflash-hf-partial.json"
PARTIAL_WRITER = "dflash-hf export"
# A partial this old is stale even when its writer cannot be checked (another host, or a pid reused since): an export
# writes one draft, minutes even at Kimi-K2.6 size, so nothing is still writing it a day later.
STALE_PARTIAL_SECONDS = 24 * 3600

LOAD_OPTIONS = ("dtype", "torch_dtype", "device", "revision", "cache_dir", "token", "local_files_only",
                "trust_remote_code", "num_target_layers")


# ----------------------------------------------------------------------------------------------------------------------
# Finding the files
# ----------------------------------------------------------------------------------------------------------------------


def resolve_checkpoint(path_or_repo_id, *, revision=None, cache_dir=None, token=None, local_files_only=False) -> Path:
    """A local folder as is; anything else is a Hub repo id, fetched (config and safetensors only) into the cache."""
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        return path
    if path.exists() or path.is_absolute() or str(path_or_repo_id).startswith((".", "~")):
        raise FileNotFoundError(f"No checkpoint folder at {path} (expected a folder with {CONFIG_NAME}).")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path_or_repo_id), revision=revision, cache_dir=cache_dir, token=token,
                                  local_files_only=local_files_only, allow_patterns=["*.json", "*.safetensors"]))


def read_config(folder: Path) -> dict:
    config_file = Path(folder) / CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"No {CONFIG_NAME} in {folder}: a draft checkpoint folder needs one.")
    return json.loads(config_file.read_text())


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files holding the weights: the shards an index names, or the single file."""
    folder = Path(folder)
    index = folder / WEIGHTS_INDEX_NAME
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not there: {', '.join(missing)}.")
        return [folder / name for name in shards]
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    candidates = sorted(folder.glob("*.safetensors"))
    if len(candidates) == 1:
        return candidates
    raise FileNotFoundError(
        f"No weights in {folder}: looked for {WEIGHTS_INDEX_NAME}, {WEIGHTS_NAME} or a single *.safetensors file "
        f"(found {[c.name for c in candidates]})."
    )


def tensor_headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """name -> (file, shape, dtype) from the safetensors headers, without reading any tensor data."""
    headers = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                if name in headers:
                    raise ValueError(f"Tensor `{name}` appears in both {headers[name][0].name} and {file.name}.")
                piece = handle.get_slice(name)
                headers[name] = (file, tuple(piece.get_shape()), piece.get_dtype())
    return headers


# ----------------------------------------------------------------------------------------------------------------------
# Recognising the dialect
# ----------------------------------------------------------------------------------------------------------------------


def detect_dialect(config: dict, source: str = CONFIG_NAME) -> str:
    """Which dialect a config.json speaks; raises listing every rule checked when none matches."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    speculators_type = config.get("speculators_model_type")
    if model_type in (DFlashConfig.model_type, DSparkConfig.model_type, DFlash2Config.model_type):
        return OURS
    if speculators_type is not None:
        dialect = SPECULATORS_DIALECTS.get(speculators_type)
        if dialect is None:
            raise ValueError(
                f"{source} is a speculators checkpoint of type {speculators_type!r}; only the block drafters "
                f"{', '.join(map(repr, SPECULATORS_DIALECTS))} load here."
            )
        return dialect
    if ZLAB_DFLASH2_ARCHITECTURE in architectures:  # its fields may sit at the top level: no dflash_config needed
        return ZLAB_DFLASH2
    if ZLAB_ARCHITECTURE in architectures and isinstance(config.get("dflash_config"), dict):
        return ZLAB if "auto_map" in config else MODELOPT
    if DEEPSPEC_ARCHITECTURE in architectures and "target_layer_ids" in config:
        return DEEPSPEC
    raise ValueError(
        f"Cannot tell which draft format {source} is. Checked: model_type in ('dflash', 'dspark', 'dflash2') (ours), "
        f"found {model_type!r}; speculators_model_type in {tuple(SPECULATORS_DIALECTS)} (speculators), found "
        f"{speculators_type!r}; architectures containing {ZLAB_DFLASH2_ARCHITECTURE!r} (z-lab DFlash 2) or "
        f"{ZLAB_ARCHITECTURE!r} with a `dflash_config` dict (z-lab with auto_map, NVIDIA "
        f"ModelOpt without), found architectures={architectures} and dflash_config="
        f"{'present' if 'dflash_config' in config else 'absent'}; architectures containing "
        f"{DEEPSPEC_ARCHITECTURE!r} with top-level `target_layer_ids` (DeepSpec), found "
        f"target_layer_ids={'present' if 'target_layer_ids' in config else 'absent'}."
    )


def identify(path_or_repo_id, **hub_options) -> str:
    """The dialect of a checkpoint folder or Hub repo."""
    folder = resolve_checkpoint(path_or_repo_id, **hub_options)
    return detect_dialect(read_config(folder), str(folder / CONFIG_NAME))


# ----------------------------------------------------------------------------------------------------------------------
# Dialect -> our config
# ----------------------------------------------------------------------------------------------------------------------


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


def _recorded_layer_count(recorded, overrides: dict, context: str) -> int:
    requested = overrides.get("num_target_layers")
    if recorded is None and requested is None:
        raise ValueError(f"{context}: {CONFIG_NAME} has no `num_target_layers` (the target's decoder layer count, "
                         "which checks the target layer ids, or gives them when absent); pass num_target_layers=N.")
    if recorded is not None and requested is not None and int(requested) != int(recorded):
        raise ValueError(f"{context}: num_target_layers={requested} was requested but the checkpoint records "
                         f"{recorded}.")
    return int(recorded if recorded is not None else requested)


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
    if not (kind == "dspark" or pruned or settings["sample_from_anchor"]):
        return LoadPlan(dialect, DFlashConfig(**common), ignored=ignored)
    # A pruned vocabulary or the anchor-sampling layout needs DSpark's machinery, with or without its heads.
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


# ----------------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------------


def _torch_dtype(value) -> torch.dtype | None:
    if value is None or value == "auto" or isinstance(value, torch.dtype):
        return None if value == "auto" else value
    resolved = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"Unknown dtype {value!r}; use e.g. 'bfloat16', 'float32' or 'auto'.")
    return resolved


def _check_tensors(plan: LoadPlan, expected: dict[str, tuple], headers: dict, context: str) -> dict[str, str]:
    """{our name: checkpoint name} of the tensors to read; raises, naming every problem at once, unless they fill the
    model exactly.

    Every dialect studied names the body, heads and vocabulary maps as we do (unprefixed), so names map to themselves
    but for the few a plan renames (DFlash 2 codebooks spelled with `.weight`); what differs is which tensors exist,
    and which are training-only.
    """
    present = {plan.renames.get(name, name): name for name in set(headers) - plan.ignored}
    problems = []
    missing = sorted(set(expected) - set(present) - set(plan.fills))
    unexpected = sorted(present[name] for name in set(present) - set(expected))
    mismatched = [
        f"{present[name]}: checkpoint {list(headers[present[name]][1])} vs expected {list(expected[name])}"
        for name in sorted(set(present) & set(expected)) if headers[present[name]][1] != expected[name]
    ]
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {'; '.join(mismatched)}")
    if problems:
        raise ValueError(f"{context} does not fill the {plan.model_class.__name__} its config describes; "
                         + "; ".join(problems) + ".")
    return present


def _read_tensors(plan: LoadPlan, names: dict[str, str], headers: dict, dtype, device) -> dict[str, torch.Tensor]:
    """Our state dict from the checkpoint tensors `names` ({our name: checkpoint name}) and the plan's fills."""
    by_file: dict[Path, list[str]] = {}
    for name in sorted(names):
        by_file.setdefault(headers[names[name]][0], []).append(name)
    state = {}
    for file, file_names in by_file.items():
        with safe_open(str(file), framework="pt", device=str(device)) as handle:
            for name in file_names:
                tensor = handle.get_tensor(names[name])
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                state[name] = tensor
    for name, make in plan.fills.items():
        if name not in state:
            state[name] = make().to(device)
    # Vocabulary maps are indices and flags whatever the file stored them as.
    if "d2t" in state:
        state["d2t"] = state["d2t"].long()
    if "t2d" in state:
        state["t2d"] = state["t2d"].bool()
    return state


def load_draft(path_or_repo_id, **from_pretrained_kwargs) -> DFlashDraftModel:
    """Load a DFlash/DSpark/DFlash 2 draft from any known dialect as our `DFlashDraftModel` / `DSparkDraftModel` /
    `DFlash2DraftModel`.

    Accepted keyword arguments: dtype (or torch_dtype; "auto"/None keeps the checkpoint's, e.g. bf16), device,
    the Hub options revision / cache_dir / token / local_files_only, and num_target_layers for checkpoints that do not
    record the target's depth (speculators). trust_remote_code is accepted and ignored: no checkpoint code runs.
    """
    unknown = sorted(set(from_pretrained_kwargs) - set(LOAD_OPTIONS))
    if unknown:
        raise TypeError(f"load_draft got unsupported arguments {unknown}; it accepts {list(LOAD_OPTIONS)}.")
    options = dict(from_pretrained_kwargs)
    dtype = _torch_dtype(options.pop("dtype", options.pop("torch_dtype", None)))
    device = torch.device(options.pop("device", None) or "cpu")
    options.pop("trust_remote_code", None)
    overrides = {"num_target_layers": options.pop("num_target_layers", None)}
    folder = resolve_checkpoint(path_or_repo_id, **options)
    raw = read_config(folder)
    headers = tensor_headers(weight_files(folder))
    plan = plan_load(raw, set(headers), str(folder), overrides, options)
    context = f"{folder} ({plan.dialect} checkpoint)"

    with torch.device("meta"):
        model = plan.model_class(plan.config)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    names = _check_tensors(plan, expected, headers, context)
    state = _read_tensors(plan, names, headers, dtype, device)
    check_finite_weights(state, lambda name: str(headers[names[name]][0]) if name in names
                         else f"{context} (filled in)")
    if isinstance(plan.config, DSparkConfig):
        try:
            check_vocab_mapping(state["d2t"], state["t2d"], plan.config.draft_vocab_size, plan.config.vocab_size)
        except ValueError as error:
            raise ValueError(f"{context}: {error}") from error
    model.load_state_dict(state, strict=True, assign=True)
    floating = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(floating) == 1:
        model.config.dtype = floating.pop()
    model.config._name_or_path = str(path_or_repo_id)
    logger.info("Loaded %s as %s (%d tensors).", context, type(model).__name__, len(state))
    return model.eval()


# ----------------------------------------------------------------------------------------------------------------------
# Exporting
# ----------------------------------------------------------------------------------------------------------------------


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":
        return True  # no harmless liveness probe (os.kill(pid, 0) signals on Windows): rely on the age
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def _is_stale_partial(folder: Path, dst: Path) -> bool:
    """Whether `folder` is provably an export to `dst` whose writer is gone: its marker names our writer and `dst`,
    and the writer's pid is dead on this host, or the marker is older than STALE_PARTIAL_SECONDS."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    try:
        marker = json.loads((folder / PARTIAL_MARKER).read_text())
        pid, host, started = int(marker["pid"]), str(marker["host"]), float(marker["started"])
        if marker["writer"] != PARTIAL_WRITER or marker["destination"] != dst.name:
            return False
    except (OSError, ValueError, TypeError, KeyError):
        return False  # no marker, or not ours: never touched
    if time.time() - started > STALE_PARTIAL_SECONDS:
        return True
    return host == socket.gethostname() and not _pid_alive(pid)


def _remove_stale_partials(dst: Path) -> None:
    """Remove the temporary folders that killed exports to `dst` left (SIGKILL runs no cleanup), and nothing else."""
    for folder in dst.parent.glob(f".{glob.escape(dst.name)}.*.partial"):
        if _is_stale_partial(folder, dst):
            shutil.rmtree(folder, ignore_errors=True)
            logger.info("Removed %s, left by an export to %s that did not finish.", folder, dst)


@contextmanager
def atomic_folder(dst, overwrite: bool = False):
    """Yield a temporary folder beside `dst`; on success it replaces `dst` by rename, on failure it vanishes.

    The folder holds a marker (writer, pid, host, start time) until the rename, so a later call for the same `dst`
    can remove what a killed run left, and only that.
    """
    dst = Path(dst)
    if dst.exists() and not overwrite and (dst.is_file() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} exists and is not empty; pass overwrite=True (--overwrite) to replace it.")
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(dst)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    try:
        marker = {"writer": PARTIAL_WRITER, "destination": dst.name, "pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.time()}
        (staging / PARTIAL_MARKER).write_text(json.dumps(marker))
        yield staging
        (staging / PARTIAL_MARKER).unlink()
        staging.chmod(FOLDER_MODE & ~_umask())  # mkdtemp makes it private; the result is an ordinary folder
        if dst.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
            os.replace(dst, retired / dst.name)
            try:
                os.replace(staging, dst)
            except BaseException:
                os.replace(retired / dst.name, dst)
                raise
            finally:
                shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _dtype_name(model) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _layer_config_dict(config: DFlashConfig) -> dict:
    """The draft's layers as a transformers Qwen3 config diff: how speculators stores `transformer_layer_config`."""
    sliding = "sliding_attention" in config.layer_types
    layer_config = AutoConfig.for_model(
        "qwen3",
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings, initializer_range=config.initializer_range,
        rms_norm_eps=config.rms_norm_eps, attention_bias=config.attention_bias,
        attention_dropout=config.attention_dropout, rope_parameters=dict(config.rope_parameters),
        layer_types=list(config.layer_types), use_sliding_window=sliding,
        sliding_window=config.sliding_window if sliding else None, tie_word_embeddings=False,
    )
    return layer_config.to_diff_dict()


def _has_dspark_heads(config: DFlashConfig) -> bool:
    return isinstance(config, DSparkConfig) and (config.markov_rank > 0 or config.enable_confidence_head)


def _verifier_entry(verifier) -> dict:
    if verifier is None:
        return {"name_or_path": None, "architectures": []}
    local = Path(str(verifier)).expanduser()
    architectures = []
    if (local / CONFIG_NAME).is_file():
        architectures = json.loads((local / CONFIG_NAME).read_text()).get("architectures") or []
    return {"name_or_path": str(verifier), "architectures": architectures}


def _speculators_kind(config: DFlashConfig) -> str:
    if isinstance(config, DFlash2Config):
        return "dflash2"
    return "dspark" if _has_dspark_heads(config) else "dflash"


def speculators_config(model: DFlashDraftModel, verifier=None) -> dict:
    """Our config in speculators' layout (what vLLM's `speculators` loader reads; DFlash 2 as speculators'
    experimental `dflash2` type writes it)."""
    config = model.config
    kind = _speculators_kind(config)
    sample_from_anchor = bool(getattr(config, "sample_from_anchor", False))
    draft_vocab_size = getattr(config, "draft_vocab_size", config.vocab_size)
    speculative_tokens = config.block_size if sample_from_anchor else config.block_size - 1
    exported = {
        "architectures": [SPECULATORS_ARCHITECTURES[kind]],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_FORMAT_VERSION,
        "transformer_layer_config": _layer_config_dict(config),
        "draft_vocab_size": draft_vocab_size,
        "block_size": config.block_size,
        "target_hidden_size": config.target_hidden_size,
        "aux_hidden_state_layer_ids": [t + 1 for t in config.target_layer_ids],
        "mask_token_id": config.mask_token_id,
        "sliding_window_non_causal": not config.sliding_window_causal,
        "sample_from_anchor": sample_from_anchor,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": _verifier_entry(verifier),
        },
        "dtype": _dtype_name(model),
        "transformers_version": transformers.__version__,
    }
    if kind == "dspark":
        exported.update(markov_rank=config.markov_rank, markov_head_type=config.markov_head_type,
                        enable_confidence_head=config.enable_confidence_head,
                        confidence_head_with_markov=config.confidence_head_with_markov)
    if kind == "dflash2":
        exported.update({name: getattr(config, name) for name in DFLASH2_FIELDS})
    unsaid = [name for name in ZLAB_OPTIONAL_FIELDS if getattr(config, name, None) is not None]
    if unsaid:
        raise ValueError(f"The speculators {kind} config has no {', '.join(unsaid)}, which this draft sets; export it "
                         "with to='zlab' (z-lab's layout carries them) or to='hf'.")
    return exported


def speculators_tensors(model: DFlashDraftModel) -> dict[str, torch.Tensor]:
    config = model.config
    state = dict(model.state_dict())
    if isinstance(config, DSparkConfig):
        if config.drafts_pruned_vocab and config.shares_target_lm_head:
            raise ValueError("A pruned-vocabulary draft that borrows the target's lm_head cannot be exported to "
                             "speculators: vLLM needs the draft's own head rows. Load it with its own lm_head.")
        if not config.drafts_pruned_vocab:
            del state["d2t"], state["t2d"]
    return state


def zlab_config(model: DFlashDraftModel) -> dict:
    """Our DFlash config in the z-lab layout, as NVIDIA ModelOpt writes it (no `auto_map`: no z-lab code ships).

    A DFlash 2 draft is written as z-lab's released DFlash 2 drafts are: architecture `DFlash2DraftModel`, its
    fields (and the block size) in `dflash_config`, bidirectional sliding layers as a top-level `is_causal: false`
    (z-lab 0.1.0 reads no `dflash_config.causal`).
    """
    config = model.config
    dflash2 = isinstance(config, DFlash2Config)
    rope = dict(config.rope_parameters)
    rope_theta = rope.pop("rope_theta")
    exported = {
        "architectures": [ZLAB_DFLASH2_ARCHITECTURE if dflash2 else ZLAB_ARCHITECTURE],
        "model_type": "qwen3",
        "block_size": config.block_size,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)},
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "attention_bias": config.attention_bias,
        "attention_dropout": config.attention_dropout,
        "rope_theta": rope_theta,
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(model),
        "num_target_layers": config.num_target_layers,
        "layer_types": list(config.layer_types),
    }
    if "sliding_attention" in config.layer_types:
        # Without use_sliding_window, transformers' Qwen3Config (which z-lab's `dflash` 0.1.0 loads configs with)
        # drops the window, and its sliding layers would attend over the whole context.
        exported.update(sliding_window=config.sliding_window, use_sliding_window=True)
        if not dflash2:
            exported["dflash_config"]["causal"] = config.sliding_window_causal
        elif not config.sliding_window_causal:
            exported["is_causal"] = False
    if config.target_hidden_size != config.hidden_size:
        exported["target_hidden_size"] = config.target_hidden_size  # vLLM sizes fc from it
    if dflash2:
        del exported["block_size"]
        exported["dflash_config"].update(block_size=config.block_size,
                                         **{name: getattr(config, name) for name in DFLASH2_FIELDS})
    exported["dflash_config"].update({name: getattr(config, name) for name in ZLAB_OPTIONAL_FIELDS
                                      if getattr(config, name, None) is not None})
    return exported


def zlab_tensors(model: DFlashDraftModel) -> dict[str, torch.Tensor]:
    if isinstance(model, DSparkDraftModel):
        raise ValueError("The z-lab format holds DFlash and DFlash 2 drafts only; export a DSpark draft with "
                         "to='speculators'.")
    if not model.config.shares_target_embeddings:  # borrows both
        raise ValueError("The z-lab format has no embedding or lm_head (the target's are borrowed), but this draft "
                         "has its own; export it with to='speculators'.")
    return dict(model.state_dict())


def _write_checkpoint(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()},
              str(folder / WEIGHTS_NAME), metadata={"format": "pt"})


def export_draft(model: DFlashDraftModel, dst, to: str = "hf", *, verifier=None, overwrite: bool = False) -> Path:
    """Write `model` to `dst` as ours ("hf": trust_remote_code format), "speculators" or "zlab", atomically.

    verifier: target model id or folder recorded in a speculators export (speculators configs name their verifier,
    and it is the only place the target's layer count can be read back from).
    """
    if to not in EXPORT_FORMATS:
        raise ValueError(f"Unknown export format {to!r}; choose one of {EXPORT_FORMATS}.")
    if to == "zlab":
        payload = (zlab_config(model), zlab_tensors(model))
    elif to == "speculators":
        payload = (speculators_config(model, verifier), speculators_tensors(model))
    with atomic_folder(dst, overwrite) as staging:
        if to == "hf":
            model.save_pretrained(staging)
        else:
            _write_checkpoint(staging, *payload)
    logger.info("Exported %s to %s (%s).", type(model).__name__, dst, to)
    return Path(dst)


# ----------------------------------------------------------------------------------------------------------------------
# CLI: dflash-hf convert SRC DST [--to hf|speculators|zlab]
# ----------------------------------------------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("convert", help="load a draft in any known format and write it as ours, "
                                                   "speculators or z-lab")
    parser.add_argument("src", help="draft folder or Hub repo id, in any known dialect")
    parser.add_argument("dst", help="output folder (written atomically)")
    parser.add_argument("--to", choices=EXPORT_FORMATS, default="hf",
                        help="hf: our trust_remote_code format (default); speculators: for vLLM and speculators; "
                             "zlab: for vLLM/SGLang (DFlash and DFlash 2)")
    parser.add_argument("--verifier", default=None,
                        help="target id/folder: recorded in speculators exports and read for its layer count "
                             "(default: the source's own verifier, if it names one)")
    parser.add_argument("--num-target-layers", type=int, default=None,
                        help="the target's decoder layer count, for sources that do not record it")
    parser.add_argument("--dtype", default="auto", help="auto (keep the checkpoint's), bfloat16, float16, float32")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.set_defaults(func=run_convert)


@contextmanager
def _sigterm_exits():
    """SIGTERM (a job scheduler's stop, `kill`) raises SystemExit, so `atomic_folder` removes its partial folder
    at once, as on Ctrl-C; Python's default would die without cleaning up. Only the main thread can take signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_now(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_convert(args) -> int:
    with _sigterm_exits():
        return _convert(args)


def _convert(args) -> int:
    folder = resolve_checkpoint(args.src)
    raw = read_config(folder)
    dialect = detect_dialect(raw, str(folder / CONFIG_NAME))
    # A speculators source names its verifier; carry it over unless the user names another.
    verifier = args.verifier or ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    num_target_layers = args.num_target_layers
    if num_target_layers is None and args.verifier and dialect in SPECULATORS_DIALECTS.values():
        verifier_config = _verifier_config(args.verifier, {})
        if verifier_config is not None:
            num_target_layers = (verifier_config.get("text_config") or verifier_config)["num_hidden_layers"]
    model = load_draft(folder, dtype=args.dtype, num_target_layers=num_target_layers)
    export_draft(model, args.dst, args.to, verifier=verifier, overwrite=args.overwrite)
    print(f"{args.src}: {dialect} -> {type(model).__name__} ({_dtype_name(model)}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters) -> {args.dst} ({args.to})")
    return 0


__all__ = [
    "DIALECTS",
    "EXPORT_FORMATS",
    "LoadPlan",
    "detect_dialect",
    "export_draft",
    "identify",
    "load_draft",
    "plan_load",
    "resolve_checkpoint",
]
