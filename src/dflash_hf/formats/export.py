"""Our draft written in each layout serving engines read: ours ("hf"), speculators' and z-lab's (`export_draft`).

Each layout's config and tensors are built first (refusing a draft the layout cannot hold), then written through
`atomic_folder`, so a failed or killed export never leaves a half-written destination.
"""

import json
import logging
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoConfig

from ..configuration_dflash import DFlashConfig, DSparkConfig
from ..configuration_dflash2 import DFlash2Config
from ..modeling_dflash import DFlashDraftModel, DSparkDraftModel
from .atomic import atomic_folder
from .files import CONFIG_NAME, WEIGHTS_NAME
from .read import DFLASH2_FIELDS, ZLAB_OPTIONAL_FIELDS
from .recognise import ZLAB_ARCHITECTURE, ZLAB_DFLASH2_ARCHITECTURE

logger = logging.getLogger(__name__)

EXPORT_FORMATS = ("hf", "speculators", "zlab")
SPECULATORS_ARCHITECTURES = {"dflash": "DFlashSpeculator", "dspark": "DSparkSpeculator",
                             "dflash2": ZLAB_DFLASH2_ARCHITECTURE}
# The speculators release whose config layout `export_draft(to="speculators")` writes.
SPECULATORS_FORMAT_VERSION = "0.9.0"


def _dtype_name(model) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------------------------------
# speculators
# ----------------------------------------------------------------------------------------------------------------------


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
    if config.drafts_pruned_vocab and isinstance(config, DFlash2Config):
        raise ValueError("speculators refuses a DFlash 2 draft with a pruned vocabulary; export it with to='hf'.")
    if config.drafts_pruned_vocab and config.shares_target_lm_head:
        raise ValueError("A pruned-vocabulary draft that borrows the target's lm_head cannot be exported to "
                         "speculators: vLLM needs the draft's own head rows. Load it with its own lm_head.")
    if not config.drafts_pruned_vocab:  # speculators registers no maps for a full vocabulary
        state.pop("d2t", None)
        state.pop("t2d", None)
    return state


# ----------------------------------------------------------------------------------------------------------------------
# z-lab
# ----------------------------------------------------------------------------------------------------------------------


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
    if model.config.drafts_pruned_vocab:
        raise ValueError("The z-lab format has no pruned vocabulary (`d2t`/`t2d`); export this draft with to='hf'.")
    if not model.config.shares_target_embeddings:  # borrows both
        raise ValueError("The z-lab format has no embedding or lm_head (the target's are borrowed), but this draft "
                         "has its own; export it with to='speculators'.")
    return dict(model.state_dict())


# ----------------------------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------------------------


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
