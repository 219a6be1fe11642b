"""ToySeek: a toy-sized DeepSeek-V3-shaped causal LM written the way older Hub remote code is.

On purpose: a plain boolean `output_hidden_states` (a list of indices is read as "all of them"), decoder layers
returning tuples, its own `PreTrainedModel` + `GenerationMixin` subclass, modules under `model.model.layers`, and
transformers' `DynamicCache` (so assisted generation can crop it).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
)

from .configuration_toyseek import ToySeekConfig


class ToySeekRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class ToySeekRotaryEmbedding(nn.Module):
    """cos/sin for the rope part of the heads, computed on use (no buffers to lose on meta-device loading)."""

    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.base = base

    def forward(self, position_ids, dtype):
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device=position_ids.device) / self.dim
        inv_freq = 1.0 / (self.base**exponents)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """DeepSeek-V3's rope: the rope dims come interleaved (pairs), so de-interleave before rotating halves."""
    cos = cos[:, None]
    sin = sin[:, None]
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class ToySeekMLP(nn.Module):
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ToySeekMoEGate(nn.Module):
    """Sigmoid router with a score-correction bias used only for choosing experts, as in DeepSeek-V3."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, hidden_states):
        scores = F.linear(hidden_states.float(), self.weight.float()).sigmoid()
        topk_idx = torch.topk(scores + self.e_score_correction_bias.float(), k=self.top_k, dim=-1, sorted=False)[1]
        topk_weight = scores.gather(1, topk_idx)
        if self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_idx, topk_weight * self.routed_scaling_factor


class ToySeekMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.experts = nn.ModuleList(
            ToySeekMLP(config, intermediate_size=config.moe_intermediate_size) for _ in range(config.n_routed_experts)
        )
        self.gate = ToySeekMoEGate(config)
        self.shared_experts = ToySeekMLP(config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        topk_idx, topk_weight = self.gate(flat)
        routed = torch.zeros_like(flat)
        for expert_idx, expert in enumerate(self.experts):
            token, slot = torch.where(topk_idx == expert_idx)
            if token.numel() == 0:
                continue
            weight = topk_weight[token, slot, None].to(flat.dtype)
            routed.index_add_(0, token, expert(flat[token]) * weight)
        return routed.view(shape) + self.shared_experts(hidden_states)


class ToySeekAttention(nn.Module):
    """Multi-head latent attention: low-rank queries, a compressed KV plus one shared rope key per token."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.q_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.softmax_scale = self.q_head_dim**-0.5

        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_layernorm = ToySeekRMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, config.kv_lora_rank + config.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = ToySeekRMSNorm(config.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            config.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, config.hidden_size, bias=False)
        self.rotary_emb = ToySeekRotaryEmbedding(self.qk_rope_head_dim, base=config.rope_theta)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(bsz, q_len, self.num_heads, self.q_head_dim).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        compressed_kv, k_pe = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.view(bsz, q_len, 1, self.qk_rope_head_dim).transpose(1, 2)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed_kv))
        kv = kv.view(bsz, q_len, self.num_heads, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
        k_nope, value_states = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)

        cos, sin = self.rotary_emb(position_ids, dtype=hidden_states.dtype)
        q_pe, k_pe = apply_rotary_pos_emb(q_pe, k_pe, cos, sin)
        query_states = torch.cat([q_nope, q_pe], dim=-1)
        key_states = torch.cat([k_nope, k_pe.expand(-1, self.num_heads, -1, -1)], dim=-1)

        if past_key_value is not None and use_cache:
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.softmax_scale
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.v_head_dim)
        attn_output = self.o_proj(attn_output)
        return attn_output, (attn_weights if output_attentions else None), past_key_value


class ToySeekDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = ToySeekAttention(config, layer_idx)
        self.mlp = ToySeekMoE(config) if layer_idx >= config.first_k_dense_replace else ToySeekMLP(config)
        self.input_layernorm = ToySeekRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = ToySeekRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False):
        residual = hidden_states
        hidden_states, self_attn_weights, present_key_value = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask=attention_mask, position_ids=position_ids,
            past_key_value=past_key_value, output_attentions=output_attentions, use_cache=use_cache,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = residual + self.mlp(self.post_attention_layernorm(hidden_states))

        outputs = (hidden_states,)
        if output_attentions:
            outputs += (self_attn_weights,)
        if use_cache:
            outputs += (present_key_value,)
        return outputs


class ToySeekPreTrainedModel(PreTrainedModel):
    config_class = ToySeekConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["ToySeekDecoderLayer"]

    def _init_weights(self, module):
        super()._init_weights(module)
        # The router weight is a bare parameter the generic initialiser does not know; leave loaded ones alone.
        if isinstance(module, ToySeekMoEGate) and not getattr(module.weight, "_is_hf_initialized", False):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)


def _causal_mask(attention_mask, q_len, past_len, dtype, device):
    """Additive (batch, 1, q_len, past_len + q_len) mask: causal, and padding from a 2-D `attention_mask`."""
    total = past_len + q_len
    query_pos = torch.arange(past_len, total, device=device)[:, None]
    key_pos = torch.arange(total, device=device)[None, :]
    allowed = (key_pos <= query_pos)[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, -total:].to(device=device, dtype=torch.bool)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


class ToySeekModel(ToySeekPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(ToySeekDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = ToySeekRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None):
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        # Older code knows only the flag: a list of indices (transformers' selective form) means "all of them".
        output_hidden_states = bool(output_hidden_states)
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        return_dict = return_dict if return_dict is not None else self.config.return_dict

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        bsz, q_len = inputs_embeds.shape[:2]
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + q_len, device=inputs_embeds.device)[None].expand(bsz, -1)
        mask = _causal_mask(attention_mask, q_len, past_len, inputs_embeds.dtype, inputs_embeds.device)

        hidden_states = inputs_embeds
        all_hidden_states = () if output_hidden_states else None
        all_self_attns = () if output_attentions else None
        for decoder_layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            layer_outputs = decoder_layer(
                hidden_states, attention_mask=mask, position_ids=position_ids, past_key_value=past_key_values,
                output_attentions=output_attentions, use_cache=use_cache,
            )
            hidden_states = layer_outputs[0]
            if output_attentions:
                all_self_attns += (layer_outputs[1],)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)

        next_cache = past_key_values if use_cache else None
        if not return_dict:
            return tuple(v for v in (hidden_states, next_cache, all_hidden_states, all_self_attns) if v is not None)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states, past_key_values=next_cache, hidden_states=all_hidden_states,
            attentions=all_self_attns,
        )


class ToySeekForCausalLM(ToySeekPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = ToySeekModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, cache=None):
        """`cache` is the name transformers 5 passes the KV cache under; `past_key_values` the older one."""
        past_key_values = cache if past_key_values is None else past_key_values
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
        )
        logits = self.lm_head(outputs.last_hidden_state).float()
        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].reshape(-1, self.config.vocab_size)
            loss = F.cross_entropy(shift_logits, labels[..., 1:].reshape(-1).to(shift_logits.device))
        if not return_dict:
            output = (logits,) + tuple(v for v in (outputs.past_key_values, outputs.hidden_states) if v is not None)
            return (loss,) + output if loss is not None else output
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
