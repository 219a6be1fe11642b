"""DFlash and DSpark block drafters: the draft models, the DSpark heads, and the checks a loaded draft must pass.

A Hub remote-code file: it imports only torch, transformers and its siblings (`configuration_dflash.py`,
`layers_dflash.py`, `kernels_dflash.py`, `generation_dflash.py`), so a draft saved by `save_pretrained` runs with
`AutoModel.from_pretrained(repo, trust_remote_code=True)` and `target.generate(assistant_model=draft)` where the
`dflash_hf` package is not installed. Constructing a draft installs the `generate` hook (see `generation_dflash.py`).

Two facts live here once, for generation, training and the kernel references alike: `encode_context` (target states
-> per-layer context K/V) and `markov_walk` (DSpark's left-to-right walk, sampled or teacher-forced); the third,
`layer_attention_mask`, lives with the layers.
"""

import copy
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import ModelOutput

from .configuration_dflash import DFlashConfig, DSparkConfig
from .generation_dflash import DFlashCandidateGenerator, install_generate_hook
from .kernels_dflash import context_kv_kernel, kernel_path_for, markov_walk_kernel, path_label
from .layers_dflash import (
    DFlashAttention,
    DFlashContextCache,
    DFlashDecoderLayer,
    DFlashRMSNorm,
    DFlashRotaryEmbedding,
    StaticContextCache,
    layer_attention_mask,
)
from .verify_matmul import linear

logger = logging.getLogger(__name__)


@dataclass
class DFlashDraftOutput(ModelOutput):
    last_hidden_state: torch.Tensor | None = None


@dataclass
class DraftProposal:
    """What one draft step proposes: target-vocabulary ids, the (processed) logits they were picked from,
    and, for DSpark, the per-slot confidence (predicted conditional acceptance)."""

    draft_ids: torch.Tensor  # [B, n]
    draft_logits: torch.Tensor | None  # [B, n, vocab_size] (target vocabulary), None when not needed
    confidence: torch.Tensor | None = None  # [B, n_computed]
    finite: bool = True  # False: the draft's logits held NaN or inf this step, and it proposes nothing


def nonfinite_proposal(logits: torch.Tensor, anchor_ids: torch.Tensor, vocab_size: int,
                       need_logits: bool) -> DraftProposal | None:
    """An empty proposal when a block's logits hold NaN or inf (an fp16 overflow, a broken fine-tune), else None.

    Sampling from such logits fails inside `torch.multinomial` (a device assert on CUDA), and as q they would poison
    rejection sampling; proposing nothing makes the step a plain decode, so the target's output stays exact.
    """
    if bool(torch.isfinite(logits).all()):
        return None
    empty = anchor_ids.new_zeros(anchor_ids.shape[0], 0)
    return DraftProposal(empty, logits.new_zeros(anchor_ids.shape[0], 0, vocab_size) if need_logits else None,
                         finite=False)


def markov_walk(
    base_logits: torch.Tensor,
    hidden: torch.Tensor,
    prev_ids: torch.Tensor,
    markov: Callable | None,
    confidence: Callable | None,
    with_markov_features: bool,
    choose: Callable | None = None,
    threshold: float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """DSpark's walk over a block, left to right: slot k's logits are `base_k + markov(prev_k)` and its confidence
    logit reads `[h_k ; W1[prev_k]]` (or `h_k`). Generation, training and the kernel reference all walk here.

    base_logits: [B, S, V_d]; hidden: [B, S, H]; markov: `(prev [B], h [B, H], state) -> (bias, state, W1[prev])`
    (state starts None) or None; confidence: `features -> logit [B]` or None.
    prev_ids: [B] the anchor, after which each slot's `choose(k, logits_k) -> (target ids [B], logits to keep or
    None)` feeds the next; or, with `choose` None (teacher forcing), [B, S] the true previous token of each slot.
    threshold: stop before the first slot where every row's survival (product of sigmoid confidences) is below it.
    Returns the picked ids [B, S'] (None when teacher-forced), the kept logits [B, S', ...] or None, and the
    confidence logits [B, S''] or None (S'' = S' + 1 when the walk stopped: the slot that stopped it).
    """
    picked, kept, confidences = [], [], []
    prev, state, survival = prev_ids, None, None
    for k in range(base_logits.shape[1]):
        if choose is None:
            prev = prev_ids[:, k]
        logits_k, features = base_logits[:, k], hidden[:, k]
        if markov is not None:
            bias, state, embedded = markov(prev, hidden[:, k], state)
            logits_k = logits_k + bias.to(logits_k.dtype)
            if with_markov_features:
                features = torch.cat([features, embedded], -1)
        if confidence is not None:
            confidences.append(confidence(features))
            if threshold is not None:
                survival_k = torch.sigmoid(confidences[-1].float())
                survival = survival_k if survival is None else survival * survival_k
                if bool((survival < threshold).all()):
                    break
        if choose is None:
            kept.append(logits_k)
            continue
        prev, keep = choose(k, logits_k)
        picked.append(prev)
        if keep is not None:
            kept.append(keep)
    ids = None
    if choose is not None:
        ids = torch.stack(picked, 1) if picked else prev_ids.new_zeros(prev_ids.shape[0], 0)
    return (ids, torch.stack(kept, 1) if kept else None, torch.stack(confidences, 1) if confidences else None)


def materialized_weight(module: nn.Module) -> torch.Tensor:
    """A module's weight, read from accelerate's offload map when it is offloaded (meta) between forwards."""
    weight = module.weight
    if weight.device.type != "meta":
        return weight.detach()
    weights_map = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
    if weights_map is not None and "weight" in weights_map:
        return weights_map["weight"]
    raise ValueError(f"The target's {type(module).__name__} weight is offloaded and could not be read back.")


# ----------------------------------------------------------------------------------------------------------------------
# Draft models
# ----------------------------------------------------------------------------------------------------------------------


class DFlashPreTrainedModel(PreTrainedModel):
    config_class = DFlashConfig
    base_model_prefix = "dflash"
    main_input_name = "noise_embeds"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq"]

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        install_generate_hook()  # idempotent; how a remote-code draft teaches `generate` about itself

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """As transformers', but a checkpoint that does not fill the model exactly, holds NaN/inf weights or (DSpark)
        inconsistent vocabulary maps is an error naming the file and tensors, and the model is never returned:
        loaded, it would propose garbage silently or fail later, deep inside generate."""
        want_info = kwargs.pop("output_loading_info", False)
        # Let loading finish so the report below can name every offending tensor; we raise on any mismatch anyway.
        kwargs["ignore_mismatched_sizes"] = True
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        source = str(pretrained_model_name_or_path)
        problems = [
            f"{label}: {', '.join(sorted(str(k) for k in info.get(key) or []))}"
            for key, label in (
                ("missing_keys", "missing tensors"),
                ("unexpected_keys", "unexpected tensors"),
                ("mismatched_keys", "shape mismatches (checkpoint vs config)"),
            )
            if info.get(key)
        ]
        if problems:
            raise ValueError(f"{source} does not match the {cls.__name__} its config describes; " + "; ".join(problems))
        state = model.state_dict()
        check_finite_weights(state, lambda name: _weights_file(source, name))
        if "d2t" in state and "t2d" in state:
            try:
                check_vocab_mapping(state["d2t"], state["t2d"], model.config.draft_vocab_size, model.config.vocab_size)
            except ValueError as error:
                raise ValueError(f"{_weights_file(source, 'd2t')}: {error}") from error
        return (model, info) if want_info else model

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(mean=0.0, std=std)
        elif isinstance(module, DFlashRMSNorm):
            module.weight.fill_(1.0)


class DFlashDraftModel(DFlashPreTrainedModel):
    """A DFlash draft: `[anchor, MASK, ...]` in, one block of proposals out, in a single forward.

    The draft reads the concatenated states of `config.target_layer_ids` (`context_hidden_states`), projects
    them once (`fc` + `hidden_norm`) and keeps their K/V per layer in a `DFlashContextCache`.

    Pruned vocabulary (speculators convention, any draft kind): the draft proposes from `draft_vocab_size` target
    ids; `d2t[i]` is an offset, target id = `i + d2t[i]`; `t2d[j]` marks the kept target ids.
    """

    decoder_layer_class = DFlashDecoderLayer  # a subclass may swap the layer (DFlash 2 wraps its sublayers)
    always_has_vocab_maps = False  # `d2t`/`t2d` buffers only when the vocabulary is pruned

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DFlashRotaryEmbedding(config)
        if not config.shares_target_input_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if not config.shares_target_lm_head:
            self.lm_head = nn.Linear(config.hidden_size, self._head_vocab_size(), bias=False)
        # Borrowed from the target by `bind_target`; plain attributes so they are neither saved nor moved.
        self._target_embedding: torch.Tensor | None = None
        self._target_head: torch.Tensor | None = None
        self.confidence_threshold = getattr(config, "confidence_threshold", None)
        # How the generator reads the target's states ("auto", "outputs", "hooks"), and whether it moves the draft
        # next to the target's last decoder layer (set False to keep the draft where you put it).
        self.capture_mode = "auto"
        self.place_with_target = True
        # The stats of the last *finished* generate call (each call keeps its own; see `generation_dflash.py`).
        self.generation_stats: dict = {}
        self._kernel_path = None  # this draft's kernel path (`_select_kernel_path`), handed to its norms
        self._kernel_path_chosen = False
        self._draft_step: CompiledDraftStep | None = None  # `compile_draft_step`'s; off by default
        self.markov_head = self.confidence_head = None  # DSpark's heads; a DFlash draft walks without them
        if config.drafts_pruned_vocab or self.always_has_vocab_maps:
            # Identity maps until the checkpoint's (or `set_vocab_mapping`'s) are loaded.
            n = config.draft_vocab_size
            self.register_buffer("d2t", torch.zeros(n, dtype=torch.long))
            self.register_buffer("t2d", torch.arange(config.vocab_size) < n)
        self._build_heads(config)
        self.post_init()

    def _build_heads(self, config: DFlashConfig) -> None:
        """Modules a subclass adds on top of the DFlash backbone (before weights are initialised)."""

    def _head_vocab_size(self) -> int:
        return self.config.draft_vocab_size

    # -- embeddings borrowed from the target ---------------------------------------------------------------------------

    def bind_target(self, target: PreTrainedModel) -> None:
        """Borrow the target's input embedding and/or lm_head, whichever the checkpoint has none of its own of."""
        borrowed = {
            "embedding": (self.config.shares_target_input_embedding, target.get_input_embeddings),
            "lm_head": (self.config.shares_target_lm_head, target.get_output_embeddings),
        }
        weights = {}
        for name, (shared, getter) in borrowed.items():
            if not shared:
                continue
            module = getter()
            if module is None:
                raise ValueError(f"The draft borrows the target's {name}, but {type(target).__name__} exposes none.")
            weights[name] = materialized_weight(module)
            if tuple(weights[name].shape) != (self.config.vocab_size, self.config.hidden_size):
                raise ValueError(
                    f"The target's {name} has shape {tuple(weights[name].shape)}, the draft expects "
                    f"(vocab_size={self.config.vocab_size}, hidden_size={self.config.hidden_size})."
                )
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        if "embedding" in weights:
            self._target_embedding = weights["embedding"].to(device=device, dtype=dtype)
        if "lm_head" in weights:
            self._target_head = self._select_head_rows(weights["lm_head"].to(device=device, dtype=dtype))

    # -- pruned vocabulary -------------------------------------------------------------------------------------------

    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def _select_head_rows(self, head: torch.Tensor) -> torch.Tensor:
        if not self.config.drafts_pruned_vocab:
            return head
        return head[self.draft_to_target().to(head.device)]

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a pruned-vocabulary mapping after checking it is consistent (offsets <-> kept ids)."""
        if self._target_head is not None:
            raise RuntimeError("Set the vocabulary mapping before `bind_target`, which selects the head rows.")
        check_vocab_mapping(d2t, t2d, self.config.draft_vocab_size, self.config.vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @torch.no_grad()
    def prune_vocabulary(self, kept_ids) -> None:
        """Propose only from `kept_ids` (target ids, e.g. the most frequent in the draft's training answers, EOS
        among them) from now on: the head then computes only their rows, which for a 49k-151k vocabulary is most of
        a CPU draft step. Lossless (verification is unchanged): greedy drafts the best kept id, sampling draws from
        the softmax over the kept ids, which rejection sampling accepts as the draft's q; a slot whose target token
        is not kept is simply rejected. For a draft trained on the full vocabulary; `save_pretrained` keeps the
        result (`draft_vocab_size`, `d2t`, `t2d`)."""
        if self.config.drafts_pruned_vocab:
            raise ValueError(f"This draft already proposes from {self.config.draft_vocab_size} ids; prune a draft "
                             "that keeps the whole vocabulary.")
        vocab_size = self.config.vocab_size
        kept = sorted_kept_ids(kept_ids, vocab_size)
        trial = copy.copy(self.config)  # the config it will have, checked before anything changes
        trial.draft_vocab_size = kept.numel()
        trial.validate_draft()
        d2t, t2d = vocab_maps(kept, vocab_size)
        device = self.fc.weight.device
        rows = kept.to(device)
        # Every row indexed by a draft id: the own head, DSpark's Markov output, the borrowed head once bound.
        own_head = None if self.config.shares_target_lm_head else self.lm_head
        markov_out = None if self.markov_head is None else self.markov_head.markov_w2
        for linear in filter(None, (own_head, markov_out)):
            linear.weight = nn.Parameter(linear.weight[rows].clone())
            linear.out_features = kept.numel()
        if self._target_head is not None:
            self._target_head = self._target_head[rows]
        self.config.draft_vocab_size = kept.numel()
        self.register_buffer("d2t", d2t.to(device))
        self.register_buffer("t2d", t2d.to(device))

    def to_target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits over the target vocabulary (-inf where a pruned draft cannot propose)."""
        if not self.config.drafts_pruned_vocab:
            return draft_logits
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., self.draft_to_target()] = draft_logits
        return full

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids as target ids (the same ids unless the vocabulary is pruned)."""
        return self.draft_to_target()[draft_ids] if self.config.drafts_pruned_vocab else draft_ids

    def embedding_weight(self) -> torch.Tensor:
        if not self.config.shares_target_input_embedding:
            return self.embed_tokens.weight
        if self._target_embedding is None:
            raise RuntimeError("This draft borrows the target's embedding: call `draft.bind_target(target)` first.")
        return self._target_embedding

    def head_weight(self) -> torch.Tensor:
        if not self.config.shares_target_lm_head:
            return self.lm_head.weight
        if self._target_head is None:
            raise RuntimeError("This draft borrows the target's lm_head: call `draft.bind_target(target)` first.")
        return self._target_head

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Raw lookup in the (target's) table: no embedding scale or norm the target may apply, only the draft's own
        `input_embedding_scale` when its config carries one (z-lab 0.1.0)."""
        embedded = F.embedding(ids, self.embedding_weight())
        scale = getattr(self.config, "input_embedding_scale", None)
        return embedded if scale is None else embedded * scale

    def get_input_embeddings(self):
        return getattr(self, "embed_tokens", None)

    def get_output_embeddings(self):
        return getattr(self, "lm_head", None)

    # -- the forward -------------------------------------------------------------------------------------------------

    def _select_kernel_path(self, like: torch.Tensor):
        """Choose this forward's kernel path (mode, device; torch while autograd needs gradients) and hand it to
        the norms when it changed."""
        training = torch.is_grad_enabled() and self.fc.weight.requires_grad
        path = kernel_path_for(self.config, like, training)
        if not self._kernel_path_chosen or self._kernel_path is not path:
            for module in self.modules():
                if isinstance(module, DFlashRMSNorm):
                    module._kernels = path
            self._kernel_path, self._kernel_path_chosen = path, True
            logger.info("%s: %s path.", type(self).__name__, path_label(path))
        return path

    @property
    def kernel_label(self) -> str:
        """"torch" or "triton:<source>": the path the last forward took."""
        return path_label(self._kernel_path)

    def encode_context(self, context_hidden: torch.Tensor, position_ids: torch.Tensor,
                       dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the context K/V ([B, KVH, C, D] each) of target states `context_hidden` [B, C, K*H_t] at
        `position_ids` [B, C]: `hidden_norm(fc(.))` once, then each layer's k_proj + k_norm + RoPE and v_proj (the
        layer's input norm is not applied). One kernel launch for all layers on the Triton path."""
        context = self.hidden_norm(self.fc(context_hidden.to(dtype)))
        cos, sin = self.rotary_emb(position_ids, dtype)
        fused = context_kv_kernel(self._kernel_path, self.layers, self.__dict__, context, cos, sin)
        return fused if fused is not None else [layer.self_attn.project_kv(context, cos, sin) for layer in self.layers]

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        past_key_values=None,
        **kwargs,
    ) -> DFlashDraftOutput:
        """Block hidden states (after the final norm) for `noise_embeds` [B, b, H].

        context_hidden_states: [B, C, K*H_t] target states of the tokens verified since the last call.
        position_ids: [B, C + b] absolute positions of those context tokens and the block; by default they follow
            the cached context.
        cache: a `DFlashContextCache` (keeps context only), or a transformers `Cache` such as the `DFlashCache` of
            transformers' own `speculation_type="dflash"` path (which crops the block back itself).
        attention_mask: optional [B, cached + C + b] key padding mask (1 = attend).
        """
        cache = cache if cache is not None else past_key_values
        batch, block_len = noise_embeds.shape[:2]
        dtype = noise_embeds.dtype
        if context_hidden_states is None:
            context_hidden_states = noise_embeds.new_zeros(batch, 0, self.fc.in_features)
        self._select_kernel_path(noise_embeds)
        ctx_len = context_hidden_states.shape[1]
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + ctx_len + block_len, device=noise_embeds.device)[None]
            position_ids = position_ids.expand(batch, -1)
        all_context_kv = self.encode_context(context_hidden_states, position_ids[:, :ctx_len], dtype)
        query_pos = position_ids[:, ctx_len:]
        context_pos = None  # of every context key, where a sliding window needs them (else: just before the block)
        if getattr(cache, "keeps_context_only", False):
            context_pos = cache.append_positions(position_ids[:, :ctx_len])
        if self._draft_step is not None and getattr(cache, "static_buffers", False):
            for layer, (ctx_k, ctx_v) in zip(self.layers, all_context_kv):
                cache.append(layer.self_attn.layer_idx, ctx_k, ctx_v)
            return DFlashDraftOutput(last_hidden_state=self._draft_step(self, noise_embeds, query_pos, cache,
                                                                        attention_mask))
        block_cos, block_sin = self.rotary_emb(query_pos, dtype)
        x = noise_embeds
        for layer, (ctx_k, ctx_v) in zip(self.layers, all_context_kv):
            attn = layer.self_attn
            block_kv = None
            if getattr(cache, "keeps_context_only", False):  # duck-typed: the package and remote-code copies mix
                block_context_kv = cache.append(attn.layer_idx, ctx_k, ctx_v)
            elif cache is not None:
                # transformers' DFlashCache stores context and block; it crops the block itself next step.
                block_kv = attn.project_kv(layer.attention_input(x), block_cos, block_sin)  # reused by the layer
                keys, values = cache.update(torch.cat([ctx_k, block_kv[0]], 2), torch.cat([ctx_v, block_kv[1]], 2),
                                            attn.layer_idx)
                block_context_kv = (keys[:, :, :-block_len], values[:, :, :-block_len])
            else:
                block_context_kv = (ctx_k, ctx_v)
            mask = self._block_mask(attn, block_context_kv[0].shape[2], query_pos, attention_mask, context_pos)
            x = layer(x, block_cos, block_sin, block_context_kv, mask, block_kv)
        return DFlashDraftOutput(last_hidden_state=self.norm(x))

    def _block_mask(self, attn: DFlashAttention, num_context: int, query_pos, attention_mask,
                    context_pos=None) -> torch.Tensor | None:
        """Bidirectional over the block and full over the context, narrowed by padding and sliding windows."""
        block_len = query_pos.shape[1]
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = attention_mask[:, -(num_context + block_len) :].bool()[:, None, None, :]
        if attn.sliding_window is None:
            return mask
        if context_pos is None:
            context_pos = query_pos[:, :1] + torch.arange(-num_context, 0, device=query_pos.device)
        return layer_attention_mask(attn, mask, query_pos, torch.cat([context_pos, query_pos], 1))

    def _static_block(self, x, query_pos, context_pos, context_valid, keys, values) -> torch.Tensor:
        """The block forward at fixed shapes, what `compile_draft_step` compiles: each layer attends to its whole
        context buffer (`keys`/`values` [B, KVH, max_context, D], at `context_pos`, the entries `context_valid`
        [B, max_context] marks) and to the block `x` [B, b, H] at `query_pos` [B, b]; then the final norm."""
        cos, sin = self.rotary_emb(query_pos, x.dtype)
        key_pos = torch.cat([context_pos, query_pos], 1)
        visible = torch.cat([context_valid, context_valid.new_ones(query_pos.shape)], 1)[:, None, None, :]
        for layer, ctx_k, ctx_v in zip(self.layers, keys, values):
            x = layer(x, cos, sin, (ctx_k, ctx_v), layer_attention_mask(layer.self_attn, visible, query_pos, key_pos))
        return self.norm(x)

    def compile_draft_step(self, max_context: int | None = 4096, backend="inductor", mode: str | None = None) -> None:
        """Run each drafted block through one compiled graph at fixed shapes (off by default). `None` turns it off.

        Afterwards `new_context_cache()` returns a `StaticContextCache` of `max_context` entries per row (the prompt
        plus every generated token must fit; batched generation also counts rejected drafts' columns until it
        compacts them), and the block forward (the draft layers and the final norm) runs `torch.compile`d with
        `fullgraph=True`, reading the whole buffer under a mask, so its shapes never change. On CUDA, inductor's
        "reduce-overhead" mode replays it as one CUDA graph instead of launching every op: worth it where the
        draft is launch-bound; on a CPU it only adds compile time. The context's K/V (a new length every step) are
        still computed eagerly and written into the buffers, and the heads (DSpark's and DFlash 2's walks) stay
        eager. The first step of a generate call compiles (seconds to minutes); a new block size or starting batch
        size compiles again. `backend` and `mode` go to `torch.compile` (mode None: "reduce-overhead" for inductor
        on CUDA, torch's default elsewhere).
        """
        self._draft_step = None if max_context is None else CompiledDraftStep(max_context, backend, mode)

    # -- drafting ----------------------------------------------------------------------------------------------------

    def block_hidden(self, context_hidden: torch.Tensor, anchor_ids: torch.Tensor, cache: DFlashContextCache,
                     block_size: int | None = None, position_ids: torch.Tensor | None = None,
                     attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states of the block `[anchor, MASK, ...]` (`block_size` ids, the config's by default) placed
        right after the cached + new context (or at `position_ids`; see `forward`)."""
        block_size = block_size or self.config.block_size
        mask_ids = anchor_ids.new_full((anchor_ids.shape[0], block_size - 1), self.config.mask_token_id)
        block_ids = torch.cat([anchor_ids[:, None], mask_ids], dim=1)
        return self(self.embed(block_ids), context_hidden, position_ids=position_ids, attention_mask=attention_mask,
                    cache=cache).last_hidden_state

    def new_context_cache(self) -> DFlashContextCache | StaticContextCache:
        """An empty context cache for one generate call; with the compiled step on, the step's static cache, reset
        (its buffers keep their addresses from call to call, so recorded CUDA graphs stay valid)."""
        if self._draft_step is None:
            return DFlashContextCache()
        self._draft_step.cache.reset()
        return self._draft_step.cache

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Flattened first: given a non-contiguous 3-D slice (the block's slots), matmul cannot fold the batch and
        # copies the whole [vocab, hidden] head for a bmm on every call (~150 ms for a 49k vocabulary on a CPU).
        logits = linear(hidden.reshape(-1, hidden.shape[-1]), self.head_weight()).view(*hidden.shape[:-1], -1)
        # Gemma-style drafts (z-lab 0.1.0): a multiplier, then `cap * tanh(logits / cap)`; None or 0 cap: off.
        multiplier = getattr(self.config, "output_multiplier", None)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if multiplier is not None:
            logits = logits * multiplier
        return torch.tanh(logits / cap) * cap if cap else logits

    @torch.no_grad()
    def propose(
        self,
        context_hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        cache: DFlashContextCache,
        *,
        prefix_ids: torch.Tensor | None = None,
        logits_processor=None,
        do_sample: bool = False,
        need_logits: bool = False,
        confidence_threshold: float | None = None,
        block_size: int | None = None,
        max_slots: int | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> DraftProposal:
        """Draft one block. The one entry point shared by generation, benchmarks, the demo and evaluation.

        context_hidden: [B, C, K*H_t] states of the tokens verified since the last call (the whole prompt first).
        anchor_ids: [B] the last verified token, not yet part of the context.
        prefix_ids: [B, T] all verified ids (the sequence the target's logits processors see).
        need_logits: return processed logits (the draft's q for rejection sampling).
        confidence_threshold: DSpark stops before the first slot whose predicted survival is below it.
        block_size: ids in the drafted block for this call (the config's by default).
        max_slots: propose at most this many tokens (the first slots): the head and walk skip the rest, the
            backbone still sees the whole block (what it was trained on), so the proposals are the same.
        position_ids, attention_mask: as `forward` takes them, for rows at their own positions with padding or
            holes (batched generation); by default the context and block follow the cache contiguously.
        """
        hidden = self.block_hidden(context_hidden, anchor_ids, cache, block_size, position_ids, attention_mask)
        first = self.config.block_size - self.config.num_speculative_slots  # DFlash layout: slot 0 is the anchor
        hidden = hidden[:, first : first + max_slots if max_slots else None]
        base = self.logits(hidden).float()
        if (broken := nonfinite_proposal(base, anchor_ids, self.config.vocab_size, need_logits)) is not None:
            return broken
        walks = self.markov_head is not None or self.confidence_head is not None
        if walks:
            walked = markov_walk_kernel(self._kernel_path, self, hidden, base, anchor_ids, logits_processor,
                                        do_sample, need_logits, confidence_threshold)
            if walked is not None:  # the one-launch Triton walk ran (vanilla head, no processor beyond temperature)
                ids, logits, confidence = walked
                return DraftProposal(ids, None if logits is None else self.to_target_logits(logits), confidence)
        elif not (logits_processor or do_sample):  # every slot at once
            logits = self.to_target_logits(base) if need_logits else None
            return DraftProposal(self.to_target_ids(base.argmax(-1)), logits)
        choose = self._slot_chooser(prefix_ids, logits_processor, do_sample, need_logits)
        ids, logits, confidence = markov_walk(
            base, hidden, anchor_ids, self.markov_head, self.confidence_head,
            bool(getattr(self.config, "confidence_head_with_markov", False)), choose, confidence_threshold,
        )
        if need_logits and logits is None:  # stopped before the first slot
            logits = base.new_zeros(base.shape[0], 0, self.config.vocab_size)
        return DraftProposal(ids, logits, None if confidence is None else torch.sigmoid(confidence.float()))

    def _slot_chooser(self, prefix_ids, logits_processor, do_sample: bool, need_logits: bool) -> Callable:
        """`choose` for `markov_walk`: each slot's token under the target's logits processors (which see the
        verified ids plus the slots picked so far), sampled or argmax, and its processed target-vocabulary logits
        when the caller needs q."""
        if not (logits_processor or do_sample or need_logits):
            # Greedy with nothing to process: pick in the draft vocabulary and map the id, instead of scattering
            # every slot's logits into the target's (a 49k-wide fill, scatter and argmax per slot).
            return lambda k, logits_k: (self.to_target_ids(logits_k.argmax(-1)), None)
        seen = [prefix_ids]

        def choose(k: int, logits_k: torch.Tensor):
            logits_k = self.to_target_logits(logits_k)
            if logits_processor:
                logits_k = logits_processor(seen[0], logits_k)
            token = torch.multinomial(logits_k.softmax(-1), 1)[:, 0] if do_sample else logits_k.argmax(-1)
            if seen[0] is not None:
                seen[0] = torch.cat([seen[0], token[:, None]], dim=1)
            return token, logits_k if need_logits else None

        return choose

    # -- generation ----------------------------------------------------------------------------------------------------

    _is_dflash_block_drafter = True  # what the generate hook looks for (duck-typed: package and remote-code copies)

    def make_candidate_generator(self, target, generation_config, logits_processor, input_ids):
        """The candidate generator `target.generate(assistant_model=self)` runs on; called by the generate hook,
        once per call (the generator and its books belong to that call)."""
        return DFlashCandidateGenerator(self, target, generation_config, logits_processor, input_ids)


class CompiledDraftStep:
    """`DFlashDraftModel._static_block` under `torch.compile` (see `compile_draft_step`), with the static cache it
    reads. A batch that dropped rows is padded back to the rows the cache's step started with, so one graph serves
    every step of a generate call."""

    def __init__(self, max_context: int, backend, mode: str | None):
        self.cache = StaticContextCache(max_context)
        self.backend, self.mode = backend, mode
        self._compiled = None  # compiled at first use, when the device (and so the mode) is known
        self._cuda_graphs = False

    def __call__(self, draft: "DFlashDraftModel", x, query_pos, cache: StaticContextCache, attention_mask):
        keys, values, context_pos, context_valid = cache.step_buffers(attention_mask, x.shape[1])
        # A slice of the caller's positions: its shape stays, its strides change (and would recompile the step).
        query_pos = query_pos.clone(memory_format=torch.contiguous_format)
        rows, padded = x.shape[0], context_valid.shape[0]
        if rows < padded:
            x = F.pad(x, (0, 0, 0, 0, 0, padded - rows))
            query_pos = F.pad(query_pos, (0, 0, 0, padded - rows))
        if self._compiled is None:
            mode = self.mode
            if mode is None and self.backend == "inductor" and x.is_cuda:
                mode = "reduce-overhead"
            self._cuda_graphs = x.is_cuda and mode in ("reduce-overhead", "max-autotune")
            options = {} if mode is None else {"mode": mode}
            self._compiled = torch.compile(draft._static_block, backend=self.backend, fullgraph=True, dynamic=False,
                                           **options)
        if self._cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        hidden = self._compiled(x, query_pos, context_pos, context_valid, keys, values)[:rows]
        # A CUDA graph's output is overwritten by its next replay: hand out a copy.
        return hidden.clone() if self._cuda_graphs else hidden


class DSparkMarkovHead(nn.Module):
    """Low-rank logit bias from the previous token (a target-vocabulary id): `W2(f(W1[prev], h))`."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        rank, hidden = config.markov_rank, config.hidden_size
        self.head_type = config.markov_head_type
        self.markov_w1 = nn.Embedding(config.vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, config.draft_vocab_size, bias=False)
        if self.head_type == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif self.head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def forward(self, prev_ids: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """prev_ids [B], hidden [B, H], state [B, r] (None: zeros, the walk's start) -> (bias [B, V_draft],
        new state, W1[prev])."""
        e = self.markov_w1(prev_ids)
        if self.head_type == "vanilla":
            return self.markov_w2(e), state, e
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, e], -1)))
            return self.markov_w2(gate * e), state, e
        state = torch.zeros_like(e) if state is None else state
        gate, cand, out = self.joint_proj(torch.cat([state, e, hidden], -1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(cand)
        return self.markov_w2(torch.tanh(out)), state, e


class DSparkConfidenceHead(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        extra = config.markov_rank if config.confidence_head_with_markov and config.markov_rank else 0
        self.proj = nn.Linear(config.hidden_size + extra, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features)[..., 0]


class DSparkDraftModel(DFlashDraftModel):
    """DFlash backbone plus a Markov walk over the block and a confidence head; usually a pruned vocabulary.
    Ids fed back to the Markov head are always target ids."""

    config_class = DSparkConfig
    always_has_vocab_maps = True  # DSpark checkpoints carry `d2t`/`t2d` even unpruned (identity maps)

    def _build_heads(self, config: DSparkConfig) -> None:
        self.markov_head = DSparkMarkovHead(config) if config.markov_rank > 0 else None
        self.confidence_head = DSparkConfidenceHead(config) if config.enable_confidence_head else None


def check_finite_weights(tensors: dict[str, torch.Tensor], file_of: Callable[[str], str]) -> None:
    """Raise naming every floating tensor that holds NaN or inf, with its file (`file_of(name)`): loaded, such a
    draft fails only later, in sampling (torch.multinomial), without a word of which weight was bad."""
    bad: dict[str, list[str]] = {}
    for name, tensor in tensors.items():
        if not tensor.is_floating_point() or tensor.device.type == "meta":
            continue
        finite = torch.isfinite(tensor)
        if not bool(finite.all()):
            nan = int(torch.isnan(tensor).sum())
            count = f"{nan} NaN, {int((~finite).sum()) - nan} inf of {tensor.numel()}"
            bad.setdefault(file_of(name), []).append(f"`{name}` ({count})")
    if bad:
        where = "; ".join(f"{file}: {', '.join(names)}" for file, names in bad.items())
        raise ValueError(
            f"Non-finite weights (NaN/inf): {where}. The checkpoint is corrupt (saved from a diverged run, or broken "
            "by a conversion): re-export or re-download it. If the file's values are finite, the dtype it was "
            "loaded in overflows them: load it in its own dtype (dtype='auto')."
        )


def _weights_file(source: str, name: str) -> str:
    """The file of a local checkpoint folder that holds tensor `name` (for error messages); else `source` itself."""
    folder = Path(source)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shard = json.loads(index.read_text()).get("weight_map", {}).get(name)
        if shard:
            return str(folder / shard)
    if (folder / "model.safetensors").is_file():
        return str(folder / "model.safetensors")
    return source


def sorted_kept_ids(kept_ids, vocab_size: int) -> torch.Tensor:
    """The distinct target ids `kept_ids` (any order, any iterable) sorted, as `t2d` order requires; a ValueError
    unless they are a non-empty set within the vocabulary."""
    kept = torch.as_tensor(kept_ids, dtype=torch.long).flatten().unique()
    if kept.numel() == 0 or int(kept[0]) < 0 or int(kept[-1]) >= vocab_size:
        raise ValueError(f"`kept_ids` must be a non-empty set of target ids in [0, vocab_size={vocab_size}).")
    return kept


def vocab_maps(kept_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the pruned vocabulary keeping the sorted, distinct target ids `kept_ids`."""
    d2t = kept_ids - torch.arange(kept_ids.numel(), device=kept_ids.device)
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=kept_ids.device)
    t2d[kept_ids] = True
    return d2t, t2d


def check_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int, vocab_size: int) -> None:
    """Raise unless `d2t` (offsets) and `t2d` (kept mask) describe the same pruned vocabulary."""
    if tuple(d2t.shape) != (draft_vocab_size,):
        raise ValueError(f"`d2t` has shape {tuple(d2t.shape)}, expected ({draft_vocab_size},) (draft_vocab_size).")
    if tuple(t2d.shape) != (vocab_size,):
        raise ValueError(f"`t2d` has shape {tuple(t2d.shape)}, expected ({vocab_size},) (vocab_size).")
    target_ids = torch.arange(draft_vocab_size, device=d2t.device) + d2t.long()
    if bool((target_ids < 0).any()) or bool((target_ids >= vocab_size).any()):
        raise ValueError(f"`d2t` maps draft ids outside the target vocabulary [0, {vocab_size}).")
    if int(t2d.sum()) != draft_vocab_size:
        raise ValueError(f"`t2d` marks {int(t2d.sum())} kept ids, expected draft_vocab_size={draft_vocab_size}.")
    if not torch.equal(t2d.nonzero()[:, 0].to(target_ids.device), target_ids):
        raise ValueError("`d2t` and `t2d` disagree: arange(draft_vocab_size) + d2t must equal nonzero(t2d).")


__all__ = [
    "CompiledDraftStep",
    "DFlashContextCache",
    "DFlashDraftModel",
    "DSparkDraftModel",
    "DraftProposal",
    "StaticContextCache",
    "check_finite_weights",
    "check_vocab_mapping",
    "markov_walk",
    "nonfinite_proposal",
    "vocab_maps",
]
