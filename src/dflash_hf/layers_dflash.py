"""The building blocks of a DFlash draft: norms, RoPE, the block attention, the MLP, the decoder layer, the
context cache, and `layer_attention_mask`, the one sliding-window mask inference and training both build through.

A Hub remote-code file (torch and transformers only), imported by `modeling_dflash.py`.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .configuration_dflash import DFlashConfig


# ----------------------------------------------------------------------------------------------------------------------
# Building blocks (Qwen3-style)
# ----------------------------------------------------------------------------------------------------------------------


class DFlashRMSNorm(nn.Module):
    _kernels = None  # the owning draft hands its norms a `KernelPath` while its Triton path is on

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self._kernels is not None and not torch.compiler.is_compiling():  # compiled, inductor fuses the norm
            out = self._kernels("rms_norm", hidden_states, self.weight, self.variance_epsilon)
            if out is not None:
                return out
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32, round back to the input dtype, then scale (the rounding points the kernel matches)."""
    dtype = x.dtype
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


class DFlashRotaryEmbedding(nn.Module):
    """cos/sin tables at absolute positions; scaled RoPE types (YaRN, llama3, ...) come from transformers.

    The inverse frequencies are computed on first use rather than held in a buffer: models are built on the meta
    device when loaded, and a non-persistent buffer would then have to be re-created by version-specific hooks.
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self._tables: dict[torch.device, tuple[torch.Tensor, float]] = {}

    def _inverse_frequencies(self, device: torch.device) -> tuple[torch.Tensor, float]:
        if device not in self._tables:
            rope_type = self.config.rope_parameters["rope_type"]
            if rope_type == "default":
                dim, theta = self.config.head_dim, self.config.rope_parameters["rope_theta"]
                inv_freq, scaling = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
            else:
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](self.config, torch.device("cpu"))
            self._tables[device] = (inv_freq.to(device), scaling)
        return self._tables[device]

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scaling = self._inverse_frequencies(position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DFlashAttention(nn.Module):
    """Block queries attend to the cached context K/V and, bidirectionally, to the whole block."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        self.causal = self.sliding_window is not None and config.sliding_window_causal
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of `x` [B, T, H] at the positions of cos/sin -> two [B, KVH, T, D] tensors."""
        shape = (*x.shape[:2], self.num_kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        block_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x: normed block states [B, b, H]; context_kv: all context K/V; mask: bool [B|1, 1, b, C+b] or None;
        block_kv: the block's own K/V when the caller already projected them."""
        batch, length = x.shape[:2]
        q = self.q_norm(self.q_proj(x).view(batch, length, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        block_k, block_v = block_kv if block_kv is not None else self.project_kv(x, cos, sin)
        k = torch.cat([context_kv[0], block_k], dim=2)
        v = torch.cat([context_kv[1], block_v], dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, scale=self.scaling, enable_gqa=self.num_kv_heads != self.num_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DFlashDecoderLayer(GradientCheckpointingLayer):
    """Attention over context and block, then the MLP, each pre-normed. Recomputed in the backward pass under
    `draft.gradient_checkpointing_enable()` (transformers' layer mechanism; non-reentrant, so the context K/V tuple
    keeps its gradients)."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def attention_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the attention reads of the block's residual stream (its queries and the block's own K/V)."""
        return self.input_layernorm(x)

    def forward(self, x, cos, sin, context_kv, attention_mask, block_kv=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_kv, attention_mask, block_kv)
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------------------------------------------------
# Context cache
# ----------------------------------------------------------------------------------------------------------------------


def gather_columns(t: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """`t` with, in each batch row i, the entries `index[i]` ([B, W]) along `dim`, in that order: how a batch keeps
    each row's own columns (its real context, once finished rows leave and holes close)."""
    shape = [1] * t.dim()
    shape[0], shape[dim] = index.shape
    expand = list(t.shape)
    expand[dim] = index.shape[1]
    return torch.gather(t, dim, index.view(shape).expand(expand))


class DFlashContextCache:
    """Per-layer K/V of the *context* (verified) tokens only; block entries are never stored.

    Context K/V depend only on the projected target states, so a token's entries are computed once, when it
    is accepted, and never need rolling back.
    """

    keeps_context_only = True

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.positions: torch.Tensor | None = None  # [B, C] each entry's absolute position (sliding windows read it)

    def get_seq_length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def layer(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx < len(self.keys):
            return self.keys[layer_idx], self.values[layer_idx]
        empty = like.new_zeros(like.shape[0], 0, 0, 0)
        return empty, empty

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx < len(self.keys):
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], k], dim=2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], v], dim=2)
        else:
            self.keys.append(k)
            self.values.append(v)
        return self.keys[layer_idx], self.values[layer_idx]

    def append_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Record the positions [B, C] of the entries just appended; returns every entry's position."""
        self.positions = positions if self.positions is None else torch.cat([self.positions, positions], dim=1)
        return self.positions

    def reindex(self, rows: torch.Tensor, columns: torch.Tensor) -> None:
        """Keep batch rows `rows` [B'] and, of row `rows[i]`, the entries `columns[i]` [B', C'] in that order (a
        batched generation dropping finished rows and closing the holes rejected drafts left)."""
        self.keys = [gather_columns(k[rows], columns, 2) for k in self.keys]
        self.values = [gather_columns(v[rows], columns, 2) for v in self.values]
        if self.positions is not None:
            self.positions = gather_columns(self.positions[rows], columns, 1)


class StaticContextCache:
    """`DFlashContextCache`'s interface over buffers preallocated to `max_context` entries per row and written in
    place, so their addresses never change: what a compiled draft step replayed as a CUDA graph reads
    (`DFlashDraftModel.compile_draft_step`).

    Per layer, K and V are [R, KVH, max_context, D]; the positions are [R, max_context]. `reset` empties the cache
    but keeps the buffers, so one cache serves every generate call of a draft (a larger batch or another dtype
    reallocates them). A batch that drops rows (`reindex`) keeps using the first rows; the compiled step still reads
    as many rows as the batch it started with (`step_buffers`), so its shapes never change within a generate call.
    """

    keeps_context_only = True
    static_buffers = True  # what the draft's forward looks for (duck-typed, as `keeps_context_only`)

    def __init__(self, max_context: int):
        if max_context < 1:
            raise ValueError(f"max_context={max_context}: the static context cache needs at least one entry.")
        self.max_context = max_context
        self._keys: list[torch.Tensor | None] = []  # per layer [R, KVH, max_context, D]
        self._values: list[torch.Tensor | None] = []
        self._positions: torch.Tensor | None = None  # [R, max_context]
        self._valid: torch.Tensor | None = None  # [R, max_context] bool: the entries a step reads
        self._lengths: list[int] = []  # entries written per layer (the layers append one after another)
        self._positions_length = 0
        self.rows = 0  # the batch in use
        self._step_rows: int | None = None  # the batch this fill started with: the rows the compiled step reads

    def reset(self) -> None:
        """Forget every entry; the buffers (and so their addresses) stay."""
        self._lengths = [0] * len(self._lengths)
        self._positions_length, self.rows, self._step_rows = 0, 0, None

    def get_seq_length(self) -> int:
        return self._lengths[0] if self._lengths else 0

    @property
    def positions(self) -> torch.Tensor | None:
        return None if self._positions is None else self._positions[: self.rows, : self._positions_length]

    def layer(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx < len(self._lengths) and self._lengths[layer_idx]:
            end = self._lengths[layer_idx]
            return self._keys[layer_idx][: self.rows, :, :end], self._values[layer_idx][: self.rows, :, :end]
        empty = like.new_zeros(like.shape[0], 0, 0, 0)
        return empty, empty

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == len(self._lengths):
            self._lengths.append(0)
            self._keys.append(None)
            self._values.append(None)
        start = self._lengths[layer_idx]
        end = self._check_room(start + k.shape[2])
        self._start_rows(k.shape[0])
        if start == 0:
            shape = (k.shape[0], k.shape[1], self.max_context, k.shape[3])
            self._keys[layer_idx] = _fit(self._keys[layer_idx], shape, k.dtype, k.device)
            self._values[layer_idx] = _fit(self._values[layer_idx], shape, v.dtype, v.device)
        self._keys[layer_idx][: self.rows, :, start:end] = k
        self._values[layer_idx][: self.rows, :, start:end] = v
        self._lengths[layer_idx] = end
        return self._keys[layer_idx][: self.rows, :, :end], self._values[layer_idx][: self.rows, :, :end]

    def append_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Record the positions [B, C] of the entries just appended; returns every entry's position."""
        start = self._positions_length
        end = self._check_room(start + positions.shape[1])
        self._start_rows(positions.shape[0])
        if start == 0:
            shape = (positions.shape[0], self.max_context)
            self._positions = _fit(self._positions, shape, positions.dtype, positions.device)
            self._valid = _fit(self._valid, shape, torch.bool, positions.device)
        self._positions[: self.rows, start:end] = positions
        self._positions_length = end
        return self.positions

    def reindex(self, rows: torch.Tensor, columns: torch.Tensor) -> None:
        """Keep batch rows `rows` [B'] and, of row `rows[i]`, the entries `columns[i]` [B', C'] in that order, moved
        to the first B' rows and C' entries of the same buffers."""
        kept = columns.shape[1]
        for layer_idx, length in enumerate(self._lengths):
            for buffers in (self._keys, self._values):
                buffers[layer_idx][: rows.shape[0], :, :kept] = gather_columns(buffers[layer_idx][rows, :, :length],
                                                                               columns, 2)
        if self._positions_length:
            self._positions[: rows.shape[0], :kept] = gather_columns(self.positions[rows], columns, 1)
        self._lengths = [kept] * len(self._lengths)
        self._positions_length, self.rows = kept, rows.shape[0]

    def step_buffers(self, attention_mask: torch.Tensor | None, block_len: int):
        """What the compiled step reads, as many rows as the batch started with: per-layer keys and values, the
        positions, and which entries to read: those written, narrowed by `attention_mask` [B, entries + block_len]
        (1 = attend) when given; rewritten in place."""
        rows, length = self._step_rows, self.get_seq_length()
        valid = self._valid[:rows]
        valid[:, length:] = False
        if attention_mask is None:
            valid[:, :length] = True
        else:
            valid[: self.rows, :length] = attention_mask[:, -(length + block_len) : attention_mask.shape[1] - block_len]
        keys = [_static(k[:rows]) for k in self._keys]
        values = [_static(v[:rows]) for v in self._values]
        return keys, values, _static(self._positions[:rows]), _static(valid)

    def _start_rows(self, rows: int) -> None:
        if self.rows != rows and self.get_seq_length() + self._positions_length:
            raise ValueError(f"The context cache holds {self.rows} rows; these entries have {rows}.")
        self.rows = rows
        if self._step_rows is None:
            self._step_rows = rows

    def _check_room(self, end: int) -> int:
        if end > self.max_context:
            raise ValueError(
                f"The draft's static context cache holds max_context={self.max_context} entries per row, and this "
                f"step needs {end}. Call `draft.compile_draft_step(max_context=...)` with at least the prompt length "
                "plus max_new_tokens (batched generation also keeps rejected drafts' columns until it compacts them)."
            )
        return end


def _fit(held: torch.Tensor | None, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`held` when it can hold `shape` (as many rows or more), else a new buffer. Zeros, never `empty`: the entries a
    step masks still enter attention's matmul with weight 0, and 0 * NaN is NaN."""
    if held is not None and held.shape[0] >= shape[0] and held.shape[1:] == shape[1:] and (
        (held.dtype, held.device) == (dtype, torch.device(device))
    ):
        return held
    return torch.zeros(shape, dtype=dtype, device=device)


def _static(t: torch.Tensor) -> torch.Tensor:
    """Mark a buffer view's address as fixed, so CUDA graphs read it in place instead of copying it in each replay
    (a new address, after a reallocation, makes them re-record rather than recompile)."""
    torch._dynamo.mark_static_address(t, guard=False)
    return t


def layer_attention_mask(attn: "DFlashAttention", mask, query_pos: torch.Tensor, key_pos: torch.Tensor):
    """`mask` (bool [B, 1, Q, K], or None for "all visible") narrowed to the layer's sliding window: keys within
    `sliding_window` positions of the query, and none after it when the layer is causal. Inference (one block after
    its context) and training (many blocks in one pass) build their per-layer masks through here."""
    if attn.sliding_window is None:
        return mask
    distance = query_pos[:, :, None] - key_pos[:, None, :]
    window = distance.abs() < attn.sliding_window
    if attn.causal:
        window &= distance >= 0
    return window[:, None] if mask is None else mask & window[:, None]


__all__ = ["DFlashAttention", "DFlashContextCache", "DFlashDecoderLayer", "DFlashMLP", "DFlashRMSNorm",
           "DFlashRotaryEmbedding", "StaticContextCache", "apply_rope", "gather_columns", "layer_attention_mask",
           "rms_norm", "rotate_half"]
