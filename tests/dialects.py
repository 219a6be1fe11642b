"""Tiny checkpoints in every dialect a user may bring, written the way each dialect's own tools write them.

Each `write_*` takes a reference draft in our format (the ground truth for the tests) and writes its weights in one
dialect: that dialect's config keys, tensor names, layer-id convention, vocabulary maps and Markov-projection layout,
as read from the dialect's public code (z-lab `dflash/model.py` and its Hub configs, `dflash` 0.1.0 for DFlash 2;
NVIDIA ModelOpt `hf_spec_export.DFlashExporter`; speculators `models/dflash|dspark|dflash2`; DeepSpec
`modeling/dspark`). Nothing here uses `dflash_hf.formats`: these files are what its loader is checked against.

Reference drafts include the Kimi-K2.6 shapes scaled down: nvidia/Kimi-K2.6-DFlash (6 layers over 61 target layers,
YaRN factor 16 over 4096, theta 50000, block 8) and novita/kimi-k2.6-dspark (3 layers, aux ids [1, 29, 57], a pruned
draft vocabulary with d2t/t2d, vanilla Markov head and a confidence head reading it, block 8, sample_from_anchor).
The DFlash 2 reference scales down z-lab's released Qwen3.8-27B-DFlash2 (5 sliding-window layers, block 8, 2 taps in
groups of 16 channels, top-16 candidates; REFERENCE.md section 9).
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config

from dflash_hf import DFlash2Config, DFlash2DraftModel, DFlashConfig, DFlashDraftModel, DSparkConfig, DSparkDraftModel

# Kimi-K2.6 shapes, hidden sizes divided down; layer counts, layer ids, block size and RoPE kept.
KIMI_TARGET_LAYERS = 61
KIMI_DFLASH = dict(vocab_size=640, hidden_size=64, num_attention_heads=8, num_key_value_heads=1, head_dim=8,
                   intermediate_size=164, num_hidden_layers=6, block_size=8, mask_token_id=639,
                   max_position_embeddings=262144,
                   rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                                    "rope_theta": 50000.0})
KIMI_DSPARK = dict(vocab_size=640, draft_vocab_size=125, hidden_size=56, num_attention_heads=7, num_key_value_heads=1,
                   head_dim=8, intermediate_size=144, num_hidden_layers=3, block_size=8, mask_token_id=638,
                   rope_theta=50000.0, max_position_embeddings=20000, markov_rank=4, markov_head_type="vanilla",
                   enable_confidence_head=True, confidence_head_with_markov=True, sample_from_anchor=True)
KIMI_DSPARK_AUX_IDS = [1, 29, 57]  # speculators convention: hidden_states[a]
KIMI_VERIFIER = "moonshotai/Kimi-K2.6"

TINY = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=48, block_size=4, mask_token_id=95, rope_theta=10000.0, max_position_embeddings=512)
TINY_TARGET_LAYERS = 4
# z-lab/Qwen3.8-27B-DFlash2 scaled down: every layer slides (window 2048 there, 6 here, so it binds in the tests),
# block 8, 2 taps over groups of 16 channels, top-16 candidates (rank 256 there, 16 here).
RELEASED_DFLASH2 = dict(num_hidden_layers=5, layer_types=["sliding_attention"] * 5, sliding_window=6, block_size=8,
                        conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=16)


def _randomize(model):
    """Random norms and biases too, so a tensor loaded into the wrong slot cannot go unnoticed."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1 + 0.3 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    return model.eval()


def _pruned_maps(vocab_size: int, draft_vocab_size: int, seed: int):
    """A consistent pruned vocabulary: t2d marks the kept target ids, d2t[i] = kept[i] - i (offsets)."""
    generator = torch.Generator().manual_seed(seed)
    kept = torch.randperm(vocab_size, generator=generator)[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return kept - torch.arange(draft_vocab_size), t2d


def kimi_dflash_draft(seed: int = 0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    config = DFlashConfig(**KIMI_DFLASH, num_target_layers=KIMI_TARGET_LAYERS)  # z-lab's default layer ids
    return _randomize(DFlashDraftModel(config)).to(torch.bfloat16)


def kimi_dspark_draft(seed: int = 0) -> DSparkDraftModel:
    torch.manual_seed(seed)
    config = DSparkConfig(**KIMI_DSPARK, num_target_layers=KIMI_TARGET_LAYERS,
                          target_layer_ids=[a - 1 for a in KIMI_DSPARK_AUX_IDS], shares_target_embeddings=False)
    draft = _randomize(DSparkDraftModel(config))
    draft.set_vocab_mapping(*_pruned_maps(config.vocab_size, config.draft_vocab_size, seed))
    return draft.to(torch.bfloat16)


def tiny_dflash_draft(seed: int = 0, num_layers: int = 2, layer_ids=(0, 2), own_embeddings: bool = False,
                      draft_vocab_size: int | None = None, **extra) -> DFlashDraftModel:
    """draft_vocab_size: pruned after the fact (`prune_vocabulary`) to that many random target ids."""
    torch.manual_seed(seed)
    config = DFlashConfig(**{**TINY, **extra}, num_hidden_layers=num_layers, num_target_layers=TINY_TARGET_LAYERS,
                          target_layer_ids=list(layer_ids), shares_target_embeddings=not own_embeddings)
    draft = _randomize(DFlashDraftModel(config))
    if draft_vocab_size is not None:
        d2t, _ = _pruned_maps(config.vocab_size, draft_vocab_size, seed)
        draft.prune_vocabulary(d2t + torch.arange(draft_vocab_size))
    return draft.to(torch.bfloat16)


def tiny_dflash2_draft(seed: int = 0, num_layers: int = 2, layer_ids=(0, 2), spread: float = 0.5,
                       dtype=torch.bfloat16, **extra) -> DFlash2DraftModel:
    """A DFlash 2 draft borrowing the target's embedding and head (as z-lab's and speculators' do), with its
    convolutions and codebooks moved well off their initialisation (identity taps and near-zero codebooks would
    hide a tensor loaded into the wrong slot)."""
    torch.manual_seed(seed)
    fields = {**TINY, "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5,
              "num_hidden_layers": num_layers, **extra}
    config = DFlash2Config(**fields, num_target_layers=TINY_TARGET_LAYERS, target_layer_ids=list(layer_ids))
    draft = _randomize(DFlash2DraftModel(config))
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "_conv." in name or "candidate_selector." in name:
                param.add_(spread * torch.randn_like(param))
    return draft.to(dtype)


def released_dflash2_draft(seed: int = 0, dtype=torch.bfloat16) -> DFlash2DraftModel:
    return tiny_dflash2_draft(seed, layer_ids=(0, 1, 2), dtype=dtype, **RELEASED_DFLASH2)


def tiny_dspark_draft(seed: int = 0, head_type: str = "vanilla", markov_rank: int = 4, confidence: bool = True,
                      with_markov: bool = True, draft_vocab_size: int | None = None, sample_from_anchor: bool = True,
                      own_embeddings: bool = True, own_head: bool | None = None,
                      dtype=torch.bfloat16) -> DSparkDraftModel:
    """own_embeddings: the draft has its own embedding and (unless own_head says otherwise) its own lm_head."""
    torch.manual_seed(seed)
    config = DSparkConfig(**TINY, num_hidden_layers=1, num_target_layers=TINY_TARGET_LAYERS, target_layer_ids=[1, 2],
                          markov_rank=markov_rank, markov_head_type=head_type, enable_confidence_head=confidence,
                          confidence_head_with_markov=with_markov and markov_rank > 0,
                          draft_vocab_size=draft_vocab_size, sample_from_anchor=sample_from_anchor,
                          shares_target_input_embedding=not own_embeddings,
                          shares_target_lm_head=not (own_embeddings if own_head is None else own_head))
    draft = _randomize(DSparkDraftModel(config))
    if draft_vocab_size is not None and draft_vocab_size < config.vocab_size:
        draft.set_vocab_mapping(*_pruned_maps(config.vocab_size, draft_vocab_size, seed))
    return draft.to(dtype)


# ----------------------------------------------------------------------------------------------------------------------
# Writing folders
# ----------------------------------------------------------------------------------------------------------------------


def write_folder(folder: Path, config: dict, tensors: dict, shards: int = 1) -> Path:
    """config.json plus the tensors, as one model.safetensors or `shards` files with a safetensors index."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {name: tensor.detach().contiguous().clone() for name, tensor in tensors.items()}
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    names = sorted(tensors)
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[shard::shards]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return folder


def dtype_name(draft) -> str:
    return str(draft.fc.weight.dtype).removeprefix("torch.")


def _rope_legacy(config) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) as transformers-4 era configs (z-lab, ModelOpt) spell RoPE."""
    rope = dict(config.rope_parameters)
    theta = rope.pop("rope_theta")
    return theta, (None if rope["rope_type"] == "default" else rope)


def body_tensors(draft) -> dict:
    """The DFlash body only: what z-lab and ModelOpt checkpoints hold (the target's embedding/head are borrowed)."""
    skip = ("embed_tokens.", "lm_head.", "markov_head.", "confidence_head.")
    return {k: v for k, v in draft.state_dict().items() if not k.startswith(skip) and k not in ("d2t", "t2d")}


def zlab_config(draft) -> dict:
    """Keys as in z-lab/Qwen3-*-DFlash-b16 config.json (Qwen3Config written by transformers 4.57, plus z-lab's)."""
    c = draft.config
    theta, scaling = _rope_legacy(c)
    return {
        "architectures": ["DFlashDraftModel"], "attention_bias": c.attention_bias,
        "attention_dropout": c.attention_dropout, "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": c.block_size, "bos_token_id": 1,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
        "dtype": dtype_name(draft), "eos_token_id": 2, "head_dim": c.head_dim, "hidden_act": c.hidden_act,
        "hidden_size": c.hidden_size, "initializer_range": c.initializer_range,
        "intermediate_size": c.intermediate_size, "layer_types": list(c.layer_types),
        "max_position_embeddings": c.max_position_embeddings, "max_window_layers": c.num_hidden_layers,
        "model_type": "qwen3", "num_attention_heads": c.num_attention_heads,
        "num_hidden_layers": c.num_hidden_layers, "num_key_value_heads": c.num_key_value_heads,
        "num_target_layers": c.num_target_layers, "rms_norm_eps": c.rms_norm_eps, "rope_scaling": scaling,
        "rope_theta": theta, "sliding_window": None, "tie_word_embeddings": True, "transformers_version": "4.57.3",
        "use_cache": True, "use_sliding_window": False, "vocab_size": c.vocab_size,
    }


def modelopt_config(draft) -> dict:
    """Keys as NVIDIA ModelOpt's DFlash exporter writes them (z-lab layout, no auto_map, rope_scaling injected)."""
    c = draft.config
    theta, scaling = _rope_legacy(c)
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": c.block_size,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
        "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings, "initializer_range": c.initializer_range,
        "attention_bias": c.attention_bias, "attention_dropout": c.attention_dropout, "rope_theta": theta,
        "rope_scaling": scaling, "tie_word_embeddings": False, "torch_dtype": dtype_name(draft),
        "num_target_layers": c.num_target_layers, "layer_types": list(c.layer_types),
    }


def write_zlab(folder, draft, shards: int = 1) -> Path:
    return write_folder(folder, zlab_config(draft), body_tensors(draft), shards)


def zlab_dflash2_config(draft, top_level: bool = False) -> dict:
    """A DFlash 2 config as z-lab's `dflash` 0.1.0 reads it: architecture `DFlash2DraftModel` on a Qwen3 config, the
    DFlash fields and the four DFlash 2 ones in `dflash_config` (the released drafts) or, `top_level`, beside the
    layer fields (`_draft_value` reads either). Bidirectional sliding layers are `is_causal: false` at the top level;
    causal ones leave it null, z-lab's default."""
    c = draft.config
    config = zlab_config(draft)
    del config["auto_map"]  # the released DFlash 2 drafts run on z-lab's pip package, not on remote code
    config["architectures"] = ["DFlash2DraftModel"]
    fields = {**config.pop("dflash_config"), "block_size": config.pop("block_size"), "conv_kernel_size":
              c.conv_kernel_size, "conv_group_size": c.conv_group_size, "selector_rank": c.selector_rank,
              "selector_top_k": c.selector_top_k}
    if top_level:
        config.update(fields)
        config["is_causal"] = None
    else:
        config["dflash_config"] = fields
    if "sliding_attention" in c.layer_types:
        config.update(sliding_window=c.sliding_window, use_sliding_window=True)
        if not c.sliding_window_causal:
            config["is_causal"] = False
    return config


def dflash2_body_tensors(draft, suffixed_codebooks: bool = False) -> dict:
    """The DFlash 2 body: the DFlash one plus the convolutions and the selector (codebooks bare, as released, or
    with the `.weight` a re-save from z-lab's `nn.Embedding` codebooks would give them)."""
    tensors = body_tensors(draft)
    if suffixed_codebooks:
        for name in ("predecessor_codebook", "successor_codebook"):
            tensors[f"candidate_selector.{name}.weight"] = tensors.pop(f"candidate_selector.{name}")
    return tensors


def write_zlab_dflash2(folder, draft, top_level: bool = False, suffixed_codebooks: bool = False,
                       shards: int = 1) -> Path:
    return write_folder(folder, zlab_dflash2_config(draft, top_level), dflash2_body_tensors(draft, suffixed_codebooks),
                        shards)


def write_modelopt(folder, draft, shards: int = 1) -> Path:
    return write_folder(folder, modelopt_config(draft), body_tensors(draft), shards)


def speculators_layer_config(draft, legacy: bool = False) -> dict:
    """`transformer_layer_config`: the draft layers as a Qwen3Config diff (speculators serializes it that way).

    legacy=True spells it as transformers 4.x did (rope_theta/rope_scaling, torch_dtype), as Novita's fork wrote it.
    """
    c = draft.config
    if legacy:
        theta, scaling = _rope_legacy(c)
        return {"model_type": "qwen3", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
                "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
                "head_dim": c.head_dim, "hidden_act": c.hidden_act,
                "max_position_embeddings": c.max_position_embeddings, "initializer_range": c.initializer_range,
                "rms_norm_eps": c.rms_norm_eps, "use_cache": True, "tie_word_embeddings": False,
                "rope_theta": theta, "rope_scaling": scaling, "attention_bias": c.attention_bias,
                "use_sliding_window": False, "sliding_window": None, "max_window_layers": c.num_hidden_layers,
                "layer_types": list(c.layer_types), "attention_dropout": c.attention_dropout,
                "torch_dtype": dtype_name(draft), "transformers_version": "4.57.1"}
    sliding = "sliding_attention" in c.layer_types
    return Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, initializer_range=c.initializer_range,
        rms_norm_eps=c.rms_norm_eps, attention_bias=c.attention_bias, attention_dropout=c.attention_dropout,
        rope_parameters=dict(c.rope_parameters), layer_types=list(c.layer_types), use_sliding_window=sliding,
        sliding_window=c.sliding_window if sliding else None, tie_word_embeddings=False,
    ).to_diff_dict()


def speculators_config(draft, verifier: str | None, legacy: bool = False, verifier_architectures=()) -> dict:
    """speculators' DFlashSpeculatorConfig / DSparkSpeculatorConfig as save_pretrained writes them."""
    c = draft.config
    dspark = isinstance(c, DSparkConfig) and (c.markov_rank > 0 or c.enable_confidence_head)
    kind = "dflash2" if isinstance(c, DFlash2Config) else "dspark" if dspark else "dflash"
    sample_from_anchor = bool(getattr(c, "sample_from_anchor", False))
    architecture = {"dflash": "DFlashSpeculator", "dspark": "DSparkSpeculator", "dflash2": "DFlash2DraftModel"}[kind]
    config = {
        "architectures": [architecture],
        "speculators_model_type": kind,
        "speculators_version": "0.9.0",
        "transformer_layer_config": speculators_layer_config(draft, legacy),
        "draft_vocab_size": getattr(c, "draft_vocab_size", c.vocab_size),
        "block_size": c.block_size,
        "target_hidden_size": c.target_hidden_size,
        "aux_hidden_state_layer_ids": [t + 1 for t in c.target_layer_ids],
        "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": not c.sliding_window_causal,
        "sample_from_anchor": sample_from_anchor,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": c.block_size if sample_from_anchor else c.block_size - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        ("torch_dtype" if legacy else "dtype"): dtype_name(draft),
        "transformers_version": "4.57.1" if legacy else "5.10.2",
    }
    if dspark:
        config.update(markov_rank=c.markov_rank, markov_head_type=c.markov_head_type,
                      enable_confidence_head=c.enable_confidence_head,
                      confidence_head_with_markov=c.confidence_head_with_markov)
    if kind == "dflash2":  # speculators' DFlash2SpeculatorConfig (the "experimental DFlash2" PR)
        config.update(conv_kernel_size=c.conv_kernel_size, conv_group_size=c.conv_group_size,
                      selector_rank=c.selector_rank, selector_top_k=c.selector_top_k)
    return config


def speculators_tensors(draft) -> dict:
    """Unprefixed names; d2t/t2d only when the vocabulary is pruned (speculators registers None buffers otherwise)."""
    tensors = dict(draft.state_dict())
    c = draft.config
    if not getattr(c, "drafts_pruned_vocab", False):
        tensors.pop("d2t", None)
        tensors.pop("t2d", None)
    return tensors


def write_speculators(folder, draft, verifier: str | None, legacy: bool = False, verifier_architectures=()) -> Path:
    return write_folder(folder, speculators_config(draft, verifier, legacy, verifier_architectures),
                        speculators_tensors(draft))


def speculators_090_dspark_draft(seed: int = 0, dtype=torch.bfloat16) -> DSparkDraftModel:
    """A DSpark draft as speculators 0.9.0 trains it: a pruned vocabulary with its own lm_head (the kept rows), the
    verifier's embedding borrowed, and speculators' defaults (sample_from_anchor, vanilla Markov head, confidence
    head reading it). TINY shapes, so it fits the tiny targets of `tiny.py` and can generate."""
    return tiny_dspark_draft(seed=seed, draft_vocab_size=40, sample_from_anchor=True, own_embeddings=False,
                             own_head=True, dtype=dtype)


def speculators_090_tensors(draft) -> dict:
    """speculators 0.9.0's save rule (`_keys_to_ignore_on_save`): never `embed_tokens` (the verifier's is borrowed,
    as vLLM does), `lm_head` only for a pruned vocabulary (a full one is the verifier's head, borrowed too)."""
    tensors = speculators_tensors(draft)
    tensors.pop("embed_tokens.weight", None)
    if not getattr(draft.config, "drafts_pruned_vocab", False):
        tensors.pop("lm_head.weight", None)
    return tensors


def write_speculators_090(folder, draft, verifier: str | None, verifier_architectures=()) -> Path:
    """The checkpoint speculators 0.9.0 itself writes; `draft` must borrow what it drops (see the two above)."""
    return write_folder(folder, speculators_config(draft, verifier, verifier_architectures=verifier_architectures),
                        speculators_090_tensors(draft))


def deepspec_config(draft) -> dict:
    """DeepSpec's build_draft_config: a copy of the target's Qwen3 config plus flat DSpark fields."""
    c = draft.config
    config = Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, initializer_range=c.initializer_range,
        rms_norm_eps=c.rms_norm_eps, rope_parameters=dict(c.rope_parameters),
        layer_types=["full_attention"] * c.num_hidden_layers, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    ).to_diff_dict()
    config.update(architectures=["Qwen3DSparkModel"], num_target_layers=c.num_target_layers,
                  block_size=c.block_size, mask_token_id=c.mask_token_id, target_layer_ids=list(c.target_layer_ids),
                  num_anchors=512, enable_confidence_head=c.enable_confidence_head, markov_rank=c.markov_rank,
                  dtype=dtype_name(draft))
    if c.enable_confidence_head:
        config["confidence_head_with_markov"] = c.confidence_head_with_markov
    if c.markov_rank > 0:
        config["markov_head_type"] = c.markov_head_type
    return config


def deepspec_tensors(draft) -> dict:
    """Full vocabulary with the target's embedding and head copied in; no vocabulary maps."""
    tensors = {k: v for k, v in draft.state_dict().items() if k not in ("d2t", "t2d")}
    return tensors


def write_deepspec(folder, draft) -> Path:
    return write_folder(folder, deepspec_config(draft), deepspec_tensors(draft))


def write_ours(folder, draft) -> Path:
    draft.save_pretrained(folder)
    return Path(folder)


def write_verifier(folder, num_layers: int, architectures=("Qwen3ForCausalLM",)) -> Path:
    """A stand-in verifier folder: speculators read the target's depth only from its config.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": list(architectures), "model_type": "qwen3",
                                                    "num_hidden_layers": num_layers}))
    return folder


def read_folder(folder) -> tuple[dict, dict]:
    """(config dict, {tensor name: (shape, dtype)}) of a written checkpoint folder, shards included."""
    from safetensors import safe_open

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    layout = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                tensor = handle.get_tensor(name)
                layout[name] = (tuple(tensor.shape), tensor.dtype)
    return config, layout
