"""DFlash and DSpark block drafters, their candidate generator, and the `generate` hook.

This file is also a Hub remote-code file: it imports only torch, transformers and its sibling
`configuration_dflash.py`, so a draft saved by `save_pretrained` runs with
`AutoModel.from_pretrained(repo, trust_remote_code=True)` and `target.generate(assistant_model=draft)`
where the `dflash_hf` package is not installed. Importing this file installs the `generate` hook.
"""

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.modeling_outputs import ModelOutput
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .configuration_dflash import DFlashConfig, DSparkConfig

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------------------
# Building blocks (Qwen3-style)
# ----------------------------------------------------------------------------------------------------------------------


class DFlashRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self._kernels is not None:  # set by the owning draft when its Triton path is on (see "Kernels")
            out = self._kernels("rms_norm", hidden_states, self.weight, self.variance_epsilon)
            if out is not None:
                return out
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


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


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, cos, sin, context_kv, attention_mask, block_kv=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_kv, attention_mask, block_kv)
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------------------------------------------------
# Context cache
# ----------------------------------------------------------------------------------------------------------------------


class DFlashContextCache:
    """Per-layer K/V of the *context* (verified) tokens only; block entries are never stored.

    Context K/V depend only on the projected target states, so a token's entries are computed once, when it
    is accepted, and never need rolling back.
    """

    keeps_context_only = True

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

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


# ----------------------------------------------------------------------------------------------------------------------
# Kernels: optional Triton kernels from a Hub kernel repo (through `kernels`); the torch code above everywhere else
# ----------------------------------------------------------------------------------------------------------------------

import os  # only this section needs it

KERNELS_REPO_ID = "dflash-hf/dflash-kernels"
KERNELS_VERSION = 1  # Hub branch `v1` = the kernel package's API_VERSION
KERNELS_ENV = "DFLASH_KERNELS"
_KERNEL_MODES = {"auto": "auto", "1": "on", "on": "on", "true": "on", "0": "off", "off": "off", "false": "off"}
_KERNEL_OPS = ("rms_norm", "context_kv", "markov_walk", "verify_greedy", "verify_rejection")
# Ops `auto` leaves to torch because their kernel measured slower than torch on a GPU (`scripts/gpu_check.sh` on an
# H200, docs/gpu_check_h200.txt): the walk runs one program per row, 5-25x slower than torch's per-slot launches at
# Kimi/Qwen sizes. `on` still runs them (that is how they are tested).
_AUTO_TORCH_OPS = frozenset({"markov_walk"})
_kernel_modules: dict[str, tuple] = {}  # device kind -> (module or None, source, why not); one load per process
_kernel_paths: dict[tuple, "KernelPath"] = {}
DFlashRMSNorm._kernels = None  # a draft hands its norms a `KernelPath` while its Triton path is on


class KernelPath:
    """A loaded kernel module, where it came from, and whether a failing call may fall back to torch.

    Calling it runs one op; in `auto` mode a failure (say, Triton cannot compile for this GPU) logs one warning,
    retires the kernels for the rest of the process and returns None so the caller runs its torch code.
    """

    def __init__(self, module, kind: str, source: str, strict: bool):
        self.module, self.kind, self.source, self.strict = module, kind, source, strict
        self.failed = False

    @property
    def label(self) -> str:
        return f"triton:{self.source}"

    def runs(self, op: str) -> bool:
        """Whether `op` takes the kernel on this path (`auto` skips the ones slower than torch)."""
        return not self.failed and (self.strict or op not in _AUTO_TORCH_OPS)

    def __call__(self, op: str, *args):
        if self.failed:
            return None
        try:
            return getattr(self.module, op)(*args)
        except Exception as error:
            if self.strict:
                raise
            self.failed = True
            _kernel_modules[self.kind] = (None, "torch", f"{op} failed: {type(error).__name__}: {error}")
            for key in [key for key in _kernel_paths if key[0] == self.kind]:
                del _kernel_paths[key]
            logger.warning("DFlash kernel `%s` failed (%s: %s); using torch from now on.", op, type(error).__name__,
                           error)
            return None


def kernel_mode(config=None) -> str:
    """"auto" | "on" | "off": `DFLASH_KERNELS` when set (auto/1/0), else the config's `use_kernels`, else auto."""
    raw = os.environ.get(KERNELS_ENV, "").strip()
    if not raw:
        raw = getattr(config, "use_kernels", None)
        raw = "auto" if raw is None else raw
    mode = _KERNEL_MODES.get(str(raw).strip().lower())
    if mode is None:
        raise ValueError(f"Kernel switch {KERNELS_ENV} / `use_kernels` = {raw!r}; expected auto, 1 (on) or 0 (off).")
    return mode


def load_kernels(mode: str, device: torch.device) -> KernelPath | None:
    """The Triton kernels for `device`, or None for the torch path.

    auto: kernels on CUDA when they load, torch otherwise. on: kernels or an error (on the CPU they run only
    under TRITON_INTERPRET=1, for testing). off: torch.
    """
    if mode == "off":
        return None
    if device.type == "cuda":
        kind = "cuda"
    elif device.type == "cpu" and mode == "on" and os.environ.get("TRITON_INTERPRET") == "1":
        kind = "interpret"
    elif mode == "on":
        raise RuntimeError(
            f"{KERNELS_ENV}=1 asks for the Triton kernels, but the draft runs on {device}: they need a CUDA device "
            f"(or TRITON_INTERPRET=1 on the CPU, for testing). Set {KERNELS_ENV}=auto or 0 to use torch."
        )
    else:
        return None
    if kind not in _kernel_modules:
        _kernel_modules[kind] = _import_kernel_module(kind)
    module, source, reason = _kernel_modules[kind]
    if module is None:
        if mode == "on":
            raise RuntimeError(f"{KERNELS_ENV}=1 but the DFlash kernels could not be loaded: {reason}")
        return None
    strict = mode == "on"
    if (kind, strict) not in _kernel_paths:
        _kernel_paths[(kind, strict)] = KernelPath(module, kind, source, strict)
    return _kernel_paths[(kind, strict)]


def _import_kernel_module(kind: str) -> tuple:
    """Hub repo (or its LOCAL_KERNELS override) on CUDA, then the copy shipped in `dflash_hf`; the reasons if none."""
    try:
        import kernels as hub_kernels
    except ImportError as error:
        logger.info("DFlash kernels unavailable (the `kernels` package is not installed): torch path.")
        return None, "torch", f"`kernels` is not installed ({error})"
    overrides = os.environ.get("LOCAL_KERNELS", "")
    overridden = any(entry.split("=", 1)[0] == KERNELS_REPO_ID for entry in overrides.split(":") if entry)
    attempts = []
    if kind == "cuda" or overridden:
        attempts.append(("LOCAL_KERNELS" if overridden else "hub", _hub_kernel_module))
    attempts.append(("local", _shipped_kernel_module))
    reasons = []
    for source, load in attempts:
        try:
            module = load(hub_kernels)
            missing = [op for op in _KERNEL_OPS if not hasattr(module, op)]
            if getattr(module, "API_VERSION", None) != KERNELS_VERSION or missing:
                raise ImportError(f"API_VERSION {getattr(module, 'API_VERSION', None)} (expected "
                                  f"{KERNELS_VERSION}), missing ops {missing}")
        except Exception as error:  # noqa: BLE001  any failure to load means the next source, then torch
            reasons.append(f"{source}: {type(error).__name__}: {error}")
            continue
        logger.info("DFlash kernels: Triton path, loaded from %s (%s).", source, kind)
        return module, source, None
    reason = "; ".join(reasons)
    logger.info("DFlash kernels unavailable (%s): torch path.", reason)
    return None, "torch", reason


def _hub_kernel_module(hub_kernels):
    return hub_kernels.get_kernel(KERNELS_REPO_ID, version=KERNELS_VERSION, trust_remote_code=[KERNELS_REPO_ID])


def _shipped_kernel_module(hub_kernels):
    try:
        from dflash_hf.kernels import shipped_kernel_repo  # the package's own copy; absent for remote-code users
    except ImportError as error:
        raise ImportError(f"no shipped copy (dflash_hf is not installed: {error})") from error
    return hub_kernels.get_local_kernel(shipped_kernel_repo())


def _sync_draft_kernels(draft, like: torch.Tensor) -> KernelPath | None:
    """Pick this forward's path (mode, device; torch while autograd needs gradients) and hand it to the norms."""
    path = None
    if not (torch.is_grad_enabled() and draft.fc.weight.requires_grad):  # the kernels have no backward
        path = load_kernels(kernel_mode(draft.config), like.device)
    state = draft.__dict__
    if "_kernel_path" not in state or state["_kernel_path"] is not path:
        for module in draft.modules():
            if isinstance(module, DFlashRMSNorm):
                module._kernels = path
        state["_kernel_path"] = path
        logger.info("%s: %s path.", type(draft).__name__, "torch" if path is None else path.label)
    stats = draft.generation_stats
    if isinstance(stats, dict) and "kernels" in stats:
        stats["kernels"] = "torch" if path is None or path.failed else path.label
    return path


def _stacked_kv_weights(draft) -> tuple:
    """k/v projection and k_norm weights of all layers stacked for the one-pass kernel; rebuilt when any changes."""
    attns = [layer.self_attn for layer in draft.layers]
    parts = [(a.k_proj.weight, a.v_proj.weight, a.k_proj.bias, a.v_proj.bias, a.k_norm.weight) for a in attns]
    key = tuple((t.data_ptr(), t._version) for group in parts for t in group if t is not None)
    cached = draft.__dict__.get("_kv_stack")
    if cached is None or cached[0] != key:
        stacked = tuple(None if group[0] is None else torch.stack(group) for group in zip(*parts))
        draft.__dict__["_kv_stack"] = cached = (key, stacked)
    return cached[1]


def _project_context_kv(draft, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[tuple]:
    """Per layer (k, v) [B, KVH, C, D] of the context: one kernel launch for all layers, else each `project_kv`."""
    path = draft.__dict__.get("_kernel_path")
    if path is not None and context.shape[1]:
        k_weight, v_weight, k_bias, v_bias, norm_weight = _stacked_kv_weights(draft)
        eps = draft.layers[0].self_attn.k_norm.variance_epsilon
        out = path("context_kv", context, k_weight, v_weight, k_bias, v_bias, norm_weight, cos, sin, eps)
        if out is not None:
            return list(zip(out[0].unbind(0), out[1].unbind(0)))
    return [layer.self_attn.project_kv(context, cos, sin) for layer in draft.layers]


def _plain_temperature(logits_processor) -> float | None:
    """The temperature when the processors amount to at most one temperature warper, else None (torch walk)."""
    if not logits_processor:
        return 1.0
    try:
        from transformers.generation.logits_process import TemperatureLogitsWarper
    except ImportError:
        return None
    if len(logits_processor) == 1 and isinstance(logits_processor[0], TemperatureLogitsWarper):
        return float(logits_processor[0].temperature)
    return None


def _markov_walk_kernel(draft, hidden, base, anchor_ids, logits_processor, do_sample, need_logits, threshold):
    """DSpark's walk in one launch, or None when the torch walk must run (no kernels, non-vanilla head, processors).

    Sampling draws one uniform per slot up front (same distribution as the torch walk's multinomial, other draws).
    The kernel walks the whole block; cutting at the first slot where every row's survival is below `threshold`
    afterwards gives what the torch walk's early stop gives, since picks do not depend on the threshold.
    """
    path = draft.__dict__.get("_kernel_path")
    head, conf_head = draft.markov_head, draft.confidence_head
    if path is None or not path.runs("markov_walk") or (head is not None and head.head_type != "vanilla"):
        return None
    temperature = _plain_temperature(logits_processor)
    if temperature is None:
        return None
    uniforms = torch.rand(base.shape[:2], device=base.device) if do_sample else None
    out = path(
        "markov_walk", base, hidden, anchor_ids,
        None if head is None else head.markov_w1.weight, None if head is None else head.markov_w2.weight,
        draft.d2t if draft.config.drafts_pruned_vocab else None,
        None if conf_head is None else conf_head.proj.weight[0], None if conf_head is None else conf_head.proj.bias,
        uniforms, temperature, bool(draft.config.confidence_head_with_markov), bool(need_logits),
    )
    if out is None:
        return None
    ids, logits, confidence, survival = out
    stop = ids.shape[1]
    if conf_head is not None and threshold is not None:
        below = (survival < threshold).all(0).nonzero()
        if len(below):
            stop = int(below[0, 0])
    draft_logits = draft.to_target_logits(logits[:, :stop]) if need_logits else None
    return DraftProposal(ids[:, :stop], draft_logits, confidence[:, : stop + 1] if conf_head is not None else None)


# ----------------------------------------------------------------------------------------------------------------------
# Draft models
# ----------------------------------------------------------------------------------------------------------------------


class DFlashPreTrainedModel(PreTrainedModel):
    config_class = DFlashConfig
    base_model_prefix = "dflash"
    main_input_name = "noise_embeds"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq"]

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """As transformers', but a checkpoint that does not fill the model exactly is an error, not a warning:
        a draft with re-initialised tensors would silently propose garbage."""
        want_info = kwargs.pop("output_loading_info", False)
        # Let loading finish so the report below can name every offending tensor; we raise on any mismatch anyway.
        kwargs["ignore_mismatched_sizes"] = True
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
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
            raise ValueError(f"The checkpoint does not match the {cls.__name__} its config describes; " + "; ".join(problems))
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
    """

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DFlashRotaryEmbedding(config)
        if not config.shares_target_embeddings:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.lm_head = nn.Linear(config.hidden_size, self._head_vocab_size(), bias=False)
        # Borrowed from the target by `bind_target`; plain attributes so they are neither saved nor moved.
        self._target_embedding: torch.Tensor | None = None
        self._target_head: torch.Tensor | None = None
        self.confidence_threshold = getattr(config, "confidence_threshold", None)
        # How the generator reads the target's states ("auto", "outputs", "hooks"), and whether it moves the draft
        # next to the target's last decoder layer (set False to keep the draft where you put it).
        self.capture_mode = "auto"
        self.place_with_target = True
        self.generation_stats: dict = {}
        self._build_heads(config)
        self.post_init()

    def _build_heads(self, config: DFlashConfig) -> None:
        """Modules a subclass adds on top of the DFlash backbone (before weights are initialised)."""

    def _head_vocab_size(self) -> int:
        return self.config.vocab_size

    # -- embeddings borrowed from the target ---------------------------------------------------------------------------

    def bind_target(self, target: PreTrainedModel) -> None:
        """Borrow the target's input embedding and lm_head when the checkpoint has none of its own."""
        if not self.config.shares_target_embeddings:
            return
        embedding, head = target.get_input_embeddings(), target.get_output_embeddings()
        if embedding is None or head is None:
            raise ValueError(
                f"The draft borrows the target's embedding and lm_head, but {type(target).__name__} exposes "
                f"input embeddings={type(embedding).__name__} and output embeddings={type(head).__name__}."
            )
        embedding_weight, head_weight = materialized_weight(embedding), materialized_weight(head)
        for name, weight in (("embedding", embedding_weight), ("lm_head", head_weight)):
            if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
                raise ValueError(
                    f"The target's {name} has shape {tuple(weight.shape)}, the draft expects "
                    f"(vocab_size={self.config.vocab_size}, hidden_size={self.config.hidden_size})."
                )
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        self._target_embedding = embedding_weight.to(device=device, dtype=dtype)
        self._target_head = self._select_head_rows(head_weight.to(device=device, dtype=dtype))

    def _select_head_rows(self, head: torch.Tensor) -> torch.Tensor:
        return head

    def embedding_weight(self) -> torch.Tensor:
        if not self.config.shares_target_embeddings:
            return self.embed_tokens.weight
        if self._target_embedding is None:
            raise RuntimeError("This draft borrows the target's embeddings: call `draft.bind_target(target)` first.")
        return self._target_embedding

    def head_weight(self) -> torch.Tensor:
        if not self.config.shares_target_embeddings:
            return self.lm_head.weight
        if self._target_head is None:
            raise RuntimeError("This draft borrows the target's lm_head: call `draft.bind_target(target)` first.")
        return self._target_head

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Raw lookup in the (target's) table: no embedding scale or norm the target may apply."""
        return F.embedding(ids, self.embedding_weight())

    def get_input_embeddings(self):
        return getattr(self, "embed_tokens", None)

    def get_output_embeddings(self):
        return getattr(self, "lm_head", None)

    # -- the forward -------------------------------------------------------------------------------------------------

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
        _sync_draft_kernels(self, noise_embeds)
        context = self.hidden_norm(self.fc(context_hidden_states.to(dtype)))
        ctx_len = context.shape[1]
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + ctx_len + block_len, device=noise_embeds.device)[None]
            position_ids = position_ids.expand(batch, -1)
        cos, sin = self.rotary_emb(position_ids, dtype)
        ctx_cos, ctx_sin = cos[:, :ctx_len], sin[:, :ctx_len]
        block_cos, block_sin = cos[:, ctx_len:], sin[:, ctx_len:]
        query_pos = position_ids[:, ctx_len:]

        all_context_kv = _project_context_kv(self, context, ctx_cos, ctx_sin)  # every layer at once
        x = noise_embeds
        for layer, (ctx_k, ctx_v) in zip(self.layers, all_context_kv):
            attn = layer.self_attn
            block_kv = None
            if getattr(cache, "keeps_context_only", False):  # duck-typed: the package and remote-code copies mix
                context_kv = cache.append(attn.layer_idx, ctx_k, ctx_v)
                block_context_kv = context_kv
            elif cache is not None:
                # transformers' DFlashCache stores context and block; it crops the block itself next step.
                block_kv = attn.project_kv(layer.input_layernorm(x), block_cos, block_sin)  # reused by the layer
                keys, values = cache.update(torch.cat([ctx_k, block_kv[0]], 2), torch.cat([ctx_v, block_kv[1]], 2),
                                            attn.layer_idx)
                block_context_kv = (keys[:, :, :-block_len], values[:, :, :-block_len])
            else:
                block_context_kv = (ctx_k, ctx_v)
            mask = self._block_mask(attn, block_context_kv[0].shape[2], query_pos, attention_mask)
            x = layer(x, block_cos, block_sin, block_context_kv, mask, block_kv)
        return DFlashDraftOutput(last_hidden_state=self.norm(x))

    def _block_mask(self, attn: DFlashAttention, num_context: int, query_pos, attention_mask) -> torch.Tensor | None:
        """Bidirectional over the block and full over the context, narrowed by padding and sliding windows."""
        block_len = query_pos.shape[1]
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = attention_mask[:, -(num_context + block_len) :].bool()[:, None, None, :]
        if attn.sliding_window is not None:
            offsets = torch.arange(-num_context, 0, device=query_pos.device)
            key_pos = torch.cat([query_pos[:, :1] + offsets, query_pos], 1)
            distance = query_pos[:, :, None] - key_pos[:, None, :]
            window = distance.abs() < attn.sliding_window
            if attn.causal:
                window &= distance >= 0
            mask = window[:, None] if mask is None else mask & window[:, None]
        return mask

    # -- drafting ----------------------------------------------------------------------------------------------------

    def block_hidden(
        self, context_hidden: torch.Tensor, anchor_ids: torch.Tensor, cache: DFlashContextCache
    ) -> torch.Tensor:
        """Hidden states of the block `[anchor, MASK, ...]` placed right after the cached + new context."""
        mask_ids = anchor_ids.new_full((anchor_ids.shape[0], self.config.block_size - 1), self.config.mask_token_id)
        block_ids = torch.cat([anchor_ids[:, None], mask_ids], dim=1)
        return self(self.embed(block_ids), context_hidden, cache=cache).last_hidden_state

    @torch.no_grad()
    def extend_context(self, context_hidden: torch.Tensor, cache: DFlashContextCache) -> None:
        """Add verified tokens' states to `cache` without drafting, for a step whose candidates come from elsewhere
        (prompt lookup): the same entries `block_hidden` would have added."""
        _sync_draft_kernels(self, context_hidden)
        dtype = self.embedding_weight().dtype  # the dtype `forward` computes in (that of the embedded block)
        context = self.hidden_norm(self.fc(context_hidden.to(dtype)))
        past = cache.get_seq_length()
        positions = torch.arange(past, past + context.shape[1], device=context.device)[None]
        cos, sin = self.rotary_emb(positions.expand(context.shape[0], -1), dtype)
        for layer, (k, v) in zip(self.layers, _project_context_kv(self, context, cos, sin)):
            cache.append(layer.self_attn.layer_idx, k, v)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Flattened first: given a non-contiguous 3-D slice (the block's slots), matmul cannot fold the batch and
        # copies the whole [vocab, hidden] head for a bmm on every call (~150 ms for a 49k vocabulary on a CPU).
        return F.linear(hidden.reshape(-1, hidden.shape[-1]), self.head_weight()).view(*hidden.shape[:-1], -1)

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
    ) -> DraftProposal:
        """Draft one block. The one entry point shared by generation, benchmarks, the demo and evaluation.

        context_hidden: [B, C, K*H_t] states of the tokens verified since the last call (the whole prompt first).
        anchor_ids: [B] the last verified token, not yet part of the context.
        prefix_ids: [B, T] all verified ids (the sequence the target's logits processors see).
        need_logits: return processed logits (the draft's q for rejection sampling).
        """
        hidden = self.block_hidden(context_hidden, anchor_ids, cache)[:, 1:]
        logits = self.logits(hidden).float()
        return _pick_tokens(logits, prefix_ids, logits_processor, do_sample, need_logits)


def _pick_tokens(logits, prefix_ids, logits_processor, do_sample, need_logits) -> DraftProposal:
    """Choose one token per slot left to right, applying the target's logits processors to each."""
    if not logits_processor and not do_sample:
        return DraftProposal(logits.argmax(-1), logits if need_logits else None)
    ids = prefix_ids
    picked = []
    for k in range(logits.shape[1]):
        if logits_processor:
            logits[:, k] = logits_processor(ids, logits[:, k])
        token = _choose(logits[:, k], do_sample)
        picked.append(token)
        ids = torch.cat([ids, token[:, None]], dim=1) if ids is not None else None
    return DraftProposal(torch.stack(picked, 1), logits if need_logits else None)


def _choose(logits: torch.Tensor, do_sample: bool) -> torch.Tensor:
    if do_sample:
        return torch.multinomial(logits.softmax(-1), 1)[:, 0]
    return logits.argmax(-1)


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

    def initial_state(self, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(like.shape[0], self.markov_w1.embedding_dim)

    def forward(self, prev_ids: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor):
        """prev_ids [B], hidden [B, H], state [B, r] -> (bias [B, V_draft], new state, W1[prev])."""
        e = self.markov_w1(prev_ids)
        if self.head_type == "vanilla":
            return self.markov_w2(e), state, e
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, e], -1)))
            return self.markov_w2(gate * e), state, e
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
    """DFlash backbone plus a Markov walk over the block, a pruned draft vocabulary and a confidence head.

    Pruned vocabulary (speculators convention): `d2t[i]` is an offset, target id = `i + d2t[i]`; `t2d[j]` marks the
    kept target ids. Ids fed back to the Markov head are always target ids.
    """

    config_class = DSparkConfig

    def _build_heads(self, config: DSparkConfig) -> None:
        # Identity mapping until a pruned vocabulary is installed (`set_vocab_mapping` or the checkpoint).
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)
        self.markov_head = DSparkMarkovHead(config) if config.markov_rank > 0 else None
        self.confidence_head = DSparkConfidenceHead(config) if config.enable_confidence_head else None

    def _head_vocab_size(self) -> int:
        return self.config.draft_vocab_size

    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def _select_head_rows(self, head: torch.Tensor) -> torch.Tensor:
        if not self.config.drafts_pruned_vocab:
            return head
        return head[self.draft_to_target().to(head.device)]

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a pruned-vocabulary mapping after checking it is consistent (offsets <-> kept ids)."""
        check_vocab_mapping(d2t, t2d, self.config.draft_vocab_size, self.config.vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        if self._target_head is not None:
            raise RuntimeError("Set the vocabulary mapping before `bind_target`, which selects the head rows.")

    def to_target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Scatter draft-vocabulary logits into the target vocabulary (-inf where the draft cannot propose)."""
        if not self.config.drafts_pruned_vocab:
            return draft_logits
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., self.draft_to_target()] = draft_logits
        return full

    @torch.no_grad()
    def propose(
        self,
        context_hidden,
        anchor_ids,
        cache,
        *,
        prefix_ids=None,
        logits_processor=None,
        do_sample=False,
        need_logits=False,
        confidence_threshold=None,
    ) -> DraftProposal:
        hidden = self.block_hidden(context_hidden, anchor_ids, cache)
        if not self.config.sample_from_anchor:
            hidden = hidden[:, 1:]
        base = self.logits(hidden).float()
        if self.markov_head is None and self.confidence_head is None:
            return _pick_tokens(self.to_target_logits(base), prefix_ids, logits_processor, do_sample, need_logits)
        return self._markov_walk(hidden, base, anchor_ids, prefix_ids, logits_processor, do_sample, need_logits,
                                 confidence_threshold)

    def _markov_walk(self, hidden, base, anchor_ids, prefix_ids, logits_processor, do_sample, need_logits, threshold):
        """Left to right: bias slot k by the token chosen at k-1 (the anchor for k=0); stop when the predicted
        survival (product of per-slot acceptance) falls below `threshold`."""
        walked = _markov_walk_kernel(self, hidden, base, anchor_ids, logits_processor, do_sample, need_logits, threshold)
        if walked is not None:  # the one-launch Triton walk ran (vanilla head, no processor beyond temperature)
            return walked
        # Greedy with nothing to process: pick in the draft vocabulary and map the id, instead of scattering every
        # slot's logits into the target's (a 49k-wide fill, scatter and argmax per slot).
        draft_argmax = not (logits_processor or do_sample or need_logits)
        to_target = self.draft_to_target() if draft_argmax and self.config.drafts_pruned_vocab else None
        prev = anchor_ids
        ids = prefix_ids
        state = self.markov_head.initial_state(hidden[:, 0]) if self.markov_head is not None else None
        survival = torch.ones_like(anchor_ids, dtype=torch.float32)
        picked, slot_logits, confidence = [], [], []
        for k in range(base.shape[1]):
            logits_k, features = base[:, k], hidden[:, k]
            if self.markov_head is not None:
                bias, state, e = self.markov_head(prev, hidden[:, k], state)
                logits_k = logits_k + bias.float()
                if self.config.confidence_head_with_markov:
                    features = torch.cat([features, e], -1)
            if self.confidence_head is not None:
                conf = torch.sigmoid(self.confidence_head(features).float())
                confidence.append(conf)
                survival = survival * conf
                if threshold is not None and bool((survival < threshold).all()):
                    break
            if draft_argmax:
                prev = logits_k.argmax(-1) if to_target is None else to_target[logits_k.argmax(-1)]
                picked.append(prev)
                continue
            logits_k = self.to_target_logits(logits_k)
            if logits_processor:
                logits_k = logits_processor(ids, logits_k)
            prev = _choose(logits_k, do_sample)
            picked.append(prev)
            slot_logits.append(logits_k)
            if ids is not None:
                ids = torch.cat([ids, prev[:, None]], dim=1)
        empty = anchor_ids.new_zeros(anchor_ids.shape[0], 0)
        draft_ids = torch.stack(picked, 1) if picked else empty
        logits = torch.stack(slot_logits, 1) if (picked and need_logits) else None
        if need_logits and not picked:
            logits = base.new_zeros(base.shape[0], 0, self.config.vocab_size)
        conf = torch.stack(confidence, 1) if confidence else None
        return DraftProposal(draft_ids, logits, conf)


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


# ----------------------------------------------------------------------------------------------------------------------
# Generation: the candidate generator and the hook that lets `generate(assistant_model=draft)` pick it
# ----------------------------------------------------------------------------------------------------------------------


def check_draft_fits_target(draft_config: DFlashConfig, target_config) -> None:
    """Raise, naming the field, when a draft cannot read this target's states or speak its vocabulary."""
    text_config = target_config.get_text_config(decoder=True)
    expected = {
        "vocab_size": text_config.vocab_size,
        "target_hidden_size": text_config.hidden_size,
        "num_target_layers": text_config.num_hidden_layers,
    }
    for name, value in expected.items():
        if getattr(draft_config, name) != value:
            raise ValueError(
                f"The draft does not fit this target: draft `{name}` = {getattr(draft_config, name)}, the target "
                f"({type(target_config).__name__}) has {value}. Load the draft made for this target."
            )
    if any(not 0 <= t < expected["num_target_layers"] for t in draft_config.target_layer_ids):
        raise ValueError(
            f"The draft reads target layers {draft_config.target_layer_ids} but the target has "
            f"{expected['num_target_layers']} decoder layers."
        )
    if not 0 <= draft_config.mask_token_id < expected["vocab_size"]:
        raise ValueError(
            f"The draft's `mask_token_id` = {draft_config.mask_token_id} is outside the target vocabulary "
            f"[0, {expected['vocab_size']})."
        )


class TargetStateCapture:
    """Captures the outputs of the target's chosen decoder layers during its forwards.

    mode "outputs": transformers' selective `output_hidden_states=[t + 1, ...]` (only those layers are kept);
    mode "hooks": forward hooks on the decoder layers, for targets whose modeling code cannot select (remote code,
    older code). "auto" picks "outputs" where the target records hidden states through transformers' output capture.
    Either way, only the chosen layers' states are held, and only until the next forward.
    """

    def __init__(self, target: PreTrainedModel, layer_ids: list[int], mode: str = "auto"):
        self.layer_ids = list(layer_ids)
        self.layers = find_decoder_layers(target)
        if mode == "auto":
            mode = "outputs" if "hidden_states" in (getattr(target, "_can_record_outputs", None) or {}) else "hooks"
        if mode not in ("outputs", "hooks"):
            raise ValueError(f"capture mode must be 'auto', 'outputs' or 'hooks', got {mode!r}.")
        self.mode = mode
        self._captured: dict[int, torch.Tensor] = {}
        self._handles = []
        if mode == "hooks":
            for t in self.layer_ids:
                # `hidden_states[N]` is the final-normed state in transformers, so the last layer is read after the norm.
                module = self.layers[t] if t < len(self.layers) - 1 else find_final_norm(target, self.layers)
                self._handles.append(module.register_forward_hook(self._recorder(t)))

    def _recorder(self, layer_id: int):
        def record(module, args, output):
            self._captured[layer_id] = (output[0] if isinstance(output, (tuple, list)) else output).detach()

        return record

    @property
    def model_kwargs_overrides(self) -> dict:
        return {"output_hidden_states": [t + 1 for t in self.layer_ids]} if self.mode == "outputs" else {}

    def states(self, model_outputs, count: int, device: torch.device) -> torch.Tensor:
        """[B, count, K*H]: the first `count` positions of the last target forward, layers concatenated."""
        if self.mode == "hooks":
            parts = [self._captured[t] for t in self.layer_ids]
        else:
            hidden = getattr(model_outputs, "hidden_states", None)
            if hidden is None or any(hidden[t + 1] is None for t in self.layer_ids):
                raise RuntimeError(
                    "The target did not return the requested hidden states; set `draft.capture_mode = 'hooks'`."
                )
            parts = [hidden[t + 1] for t in self.layer_ids]
        return torch.cat([p[:, :count].to(device) for p in parts], dim=-1)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._captured.clear()


# Where decoder layers live in the models users bring: causal LMs, multimodal wrappers, GPT-style and encoder-decoder.
DECODER_LAYER_PATHS = (
    "model.layers",
    "model.language_model.layers",
    "language_model.model.layers",
    "language_model.layers",
    "model.text_model.layers",
    "text_model.layers",
    "model.decoder.layers",
    "transformer.h",
)


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's decoder layer list, found by the usual paths, else by its length (num_hidden_layers)."""
    for path in DECODER_LAYER_PATHS:
        module = model
        for name in path.split("."):
            module = getattr(module, name, None)
            if module is None:
                break
        if isinstance(module, nn.ModuleList):
            return module
    expected = model.config.get_text_config(decoder=True).num_hidden_layers
    candidates = [m for _, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == expected]
    if len(candidates) == 1:
        return candidates[0]
    raise ValueError(
        f"Could not find the decoder layers of {type(model).__name__}: none of {', '.join(DECODER_LAYER_PATHS)} exists "
        f"and {len(candidates)} ModuleLists have num_hidden_layers={expected} entries. Set `draft.capture_mode` and "
        "capture the layers yourself, or report the model layout."
    )


FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_norm", "ln_f")


def find_final_norm(model: nn.Module, layers: nn.ModuleList) -> nn.Module:
    """The norm applied after the decoder layers: a sibling of the layer list under one of the usual names."""
    for _, parent in model.named_modules():
        if any(child is layers for child in parent.children()):
            for name in FINAL_NORM_NAMES:
                if isinstance(getattr(parent, name, None), nn.Module):
                    return getattr(parent, name)
    raise ValueError(
        f"The draft reads the last decoder layer, whose state transformers reports after the final norm, but no final "
        f"norm ({', '.join(FINAL_NORM_NAMES)}) sits beside the layers of {type(model).__name__}."
    )


def execution_device(module: nn.Module) -> torch.device:
    """Where a module computes: accelerate's execution device if dispatched, else where its weights are."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    for param in module.parameters():
        if param.device.type != "meta":
            return param.device
    return torch.device("cpu")


def materialized_weight(module: nn.Module) -> torch.Tensor:
    """A module's weight, read from accelerate's offload map when it is offloaded (meta) between forwards."""
    weight = module.weight
    if weight.device.type != "meta":
        return weight.detach()
    weights_map = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
    if weights_map is not None and "weight" in weights_map:
        return weights_map["weight"]
    raise ValueError(f"The target's {type(module).__name__} weight is offloaded and could not be read back.")


CROPPABLE_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def check_target_cache_croppable(target: PreTrainedModel) -> None:
    """Speculation rolls the target's cache back after each verify; recurrent layers cannot be rolled back."""
    layer_types = getattr(target.config.get_text_config(decoder=True), "layer_types", None) or []
    recurrent = sorted({t for t in layer_types if t not in CROPPABLE_LAYER_TYPES})
    if getattr(target, "_is_stateful", False) or recurrent:
        raise ValueError(
            f"{type(target).__name__} keeps recurrent state ({', '.join(recurrent) or 'stateful model'}) that cannot be "
            "cropped back after a rejected draft, so block speculation cannot be lossless on it. Generate without "
            "`assistant_model`."
        )


def lookup_continuation(ids: torch.Tensor, max_ngram: int, min_ngram: int, num_tokens: int) -> torch.Tensor:
    """Prompt-lookup candidates for the one sequence in `ids` [1, T]: the tokens that followed the most recent earlier
    occurrence of its last n tokens, trying n from `max_ngram` down to `min_ngram`; empty when none occurred."""
    row = ids[0]
    for n in range(min(max_ngram, row.shape[0] - 1), min_ngram - 1, -1):
        windows = row[:-1].unfold(0, n, 1)  # every n-gram ending before the last token
        hits = (windows == row[-n:]).all(1).nonzero()
        if len(hits):
            start = int(hits[-1, 0]) + n
            return row[start : start + num_tokens]
    return row[:0]


def _new_stats(kernel_path: str) -> dict:
    return {
        "acceptance_lengths": [],
        "proposals": [],  # per verify step, the drafted ids; the first acceptance_lengths[i] - 1 were accepted
        "mean_acceptance_length": 0.0,
        "drafted_tokens": 0,
        "accepted_tokens": 0,
        "target_forwards": 0,
        "draft_forwards": 0,
        "looked_up": [],  # per verify step, whether its candidates came from prompt lookup instead of the draft
        "time_s": {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "total": 0.0},
        "kernels": kernel_path,
    }


# Prompt lookup beside a draft: n-grams tried, longest first (a longer match is likelier to go on as before). A
# one-token match is too weak to displace a block.
LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM = 5, 2


class DFlashCandidateGenerator(CandidateGenerator):
    """Drafts one block per step from the target's captured hidden states, on transformers' assisted decoding.

    The target's verification forward captures only `target_layer_ids` (`model_kwargs_overrides`); each call feeds
    the newly verified tokens' states to the draft's context cache and proposes the next block.
    """

    requires_model_outputs = True

    def __init__(self, draft: DFlashDraftModel, target: PreTrainedModel, generation_config, logits_processor=None,
                 input_ids: torch.Tensor | None = None):
        if input_ids is not None and input_ids.shape[0] != 1:
            raise ValueError(
                f"Block speculation runs one sequence at a time (got batch size {input_ids.shape[0]}), as transformers' "
                "assisted generation does. Call `generate` once per prompt, or drop `assistant_model` for batched decoding."
            )
        check_draft_fits_target(draft.config, target.config)
        check_target_cache_croppable(target)
        if target.device.type == "meta":
            raise ValueError(
                "The target's input embedding is offloaded to disk (target.device is meta), which transformers' "
                "assisted generation cannot run with: keep the embedding on a real device in your device_map."
            )
        self.capture = TargetStateCapture(target, draft.config.target_layer_ids, draft.capture_mode)
        self.model_kwargs_overrides = self.capture.model_kwargs_overrides
        if draft.place_with_target:  # beside the last decoder layer, where the states are freshest
            device = execution_device(self.capture.layers[-1])
            if draft.fc.weight.device != device:
                draft.to(device)
        draft.bind_target(target)
        self.draft = draft
        self.device = draft.fc.weight.device
        self.cache = DFlashContextCache()
        self.num_context = 0  # verified tokens whose states are in the draft's cache
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor if logits_processor else None
        threshold = getattr(generation_config, "dspark_confidence_threshold", None)
        self.confidence_threshold = threshold if threshold is not None else draft.confidence_threshold
        self.max_length = generation_config.max_length
        # `prompt_lookup_num_tokens` alongside the draft: where the sequence's last LOOKUP_MIN_NGRAM ..
        # max_matching_ngram_size (default LOOKUP_MAX_NGRAM) tokens occurred before (code repeating its prompt, say),
        # the tokens that followed are tried instead of a block.
        self.lookup_tokens = generation_config.prompt_lookup_num_tokens or 0
        self.lookup_ngram = generation_config.max_matching_ngram_size or LOOKUP_MAX_NGRAM
        eos = getattr(generation_config, "_eos_token_tensor", None)
        self.eos_ids = set() if eos is None else {int(e) for e in eos.flatten()}
        self.stats = _new_stats("torch")
        draft.generation_stats = self.stats
        self._start = self._last_return = time.perf_counter()
        self._last_length = None  # sequence length when we last returned candidates

    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False,
                       n_last_matches=0, **kwargs):
        now = time.perf_counter()
        self._account_verify(input_ids.shape[1], now)
        if is_first_iteration:
            self._last_return = time.perf_counter()
            return input_ids, None
        fresh = input_ids.shape[1] - 1 - self.num_context
        context = self.capture.states(model_outputs, fresh, self.device)
        budget = self.max_length - input_ids.shape[1] - 1
        looked_up = self._lookup(input_ids, budget)
        if looked_up is not None:
            self.draft.extend_context(context.to(self.device), self.cache)
            self._book(fresh, looked_up, now, from_lookup=True)
            return torch.cat([input_ids, looked_up], dim=1), None
        proposal = self.draft.propose(
            context.to(self.device),
            input_ids[:, -1].to(self.device),
            self.cache,
            prefix_ids=input_ids.to(self.device) if self.logits_processor else None,
            logits_processor=self.logits_processor,
            do_sample=self.do_sample,
            need_logits=self.do_sample,
            confidence_threshold=self.confidence_threshold,
        )
        self.stats["draft_forwards"] += 1
        draft_ids = proposal.draft_ids[:, : max(budget, 0)].to(input_ids.device)
        self._book(fresh, draft_ids, now, from_lookup=False)
        if draft_ids.shape[1] == 0:
            return input_ids, None
        logits = None
        if proposal.draft_logits is not None:
            logits = proposal.draft_logits[:, : draft_ids.shape[1]].to(input_ids.device)
        return torch.cat([input_ids, draft_ids], dim=1), logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        pass

    def _book(self, fresh: int, candidate_ids: torch.Tensor, now: float, from_lookup: bool) -> None:
        """Record a step's proposal (drafted or looked up) once the fresh context is in the draft's cache."""
        self.num_context += fresh
        self.stats["drafted_tokens"] += candidate_ids.shape[1]
        self.stats["proposals"].append(candidate_ids[0].tolist())
        self.stats["looked_up"].append(from_lookup)
        self._last_return = time.perf_counter()
        self.stats["time_s"]["draft"] += self._last_return - now

    def _lookup(self, input_ids: torch.Tensor, budget: int) -> torch.Tensor | None:
        """Prompt-lookup candidates [1, n] (cut before any EOS and to the length budget; a slice of `input_ids`), or
        None to draft a block."""
        if not self.lookup_tokens or budget <= 0:
            return None
        found = lookup_continuation(input_ids, self.lookup_ngram, LOOKUP_MIN_NGRAM, min(self.lookup_tokens, budget))
        for i, token in enumerate(found.tolist()):
            if token in self.eos_ids:
                found = found[:i]
                break
        return found[None] if found.shape[0] else None

    def _account_verify(self, length: int, now: float) -> None:
        """Book the target forward that ran since our last return (the prefill first) and what it emitted."""
        if self._last_length is not None:
            phase = "prefill" if self.stats["target_forwards"] == 0 else "verify"
            self.stats["time_s"][phase] += now - self._last_return
            self.stats["target_forwards"] += 1
            if phase == "verify":
                emitted = length - self._last_length
                self.stats["acceptance_lengths"].append(emitted)
                self.stats["accepted_tokens"] += emitted - 1
        self._last_length = length

    def finish(self, sequences: torch.Tensor) -> dict:
        """Close the books after `generate` returns: the last verify step and the totals."""
        self.capture.close()
        self._account_verify(sequences.shape[1], time.perf_counter())
        lengths = self.stats["acceptance_lengths"]
        self.stats["mean_acceptance_length"] = sum(lengths) / len(lengths) if lengths else 0.0
        self.stats["time_s"]["total"] = time.perf_counter() - self._start
        return self.stats


def _is_block_drafter(model) -> bool:
    return getattr(model, "_is_dflash_block_drafter", False)


DFlashDraftModel._is_dflash_block_drafter = True


def _make_candidate_generator(self, target, generation_config, logits_processor, input_ids):
    generator = DFlashCandidateGenerator(self, target, generation_config, logits_processor, input_ids)
    self._active_generator = generator
    return generator


DFlashDraftModel.make_candidate_generator = _make_candidate_generator


def install_generate_hook() -> None:
    """Make `target.generate(..., assistant_model=draft)` use the draft's own candidate generator.

    Idempotent (the first installer wins, whichever module it came from, since the dispatch goes through the draft's
    own `make_candidate_generator`); every other assistant type, and `speculation_type="dflash"`, keep transformers'
    own behaviour.
    """
    if getattr(GenerationMixin._get_candidate_generator, "_dflash_hook", False):
        return
    original_get = GenerationMixin._get_candidate_generator
    original_validate = GenerationMixin._validate_generation_mode
    original_assisted = GenerationMixin._assisted_decoding

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, *args, **kwargs):
        if _is_block_drafter(assistant_model) and getattr(generation_config, "speculation_type", None) != "dflash":
            return assistant_model.make_candidate_generator(self, generation_config, logits_processor, input_ids)
        return original_get(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                            assistant_model, *args, **kwargs)

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        drafter = generation_mode_kwargs.get("assistant_model")
        if _is_block_drafter(drafter):
            check_draft_fits_target(drafter.config, self.config)
        return original_validate(self, generation_mode, generation_config, generation_mode_kwargs)

    def _assisted_decoding(self, input_ids, *args, assistant_model=None, **kwargs):
        try:
            result = original_assisted(self, input_ids, *args, assistant_model=assistant_model, **kwargs)
        finally:
            generator = getattr(assistant_model, "_active_generator", None) if _is_block_drafter(assistant_model) else None
            if generator is not None:
                assistant_model._active_generator = None
                generator.capture.close()  # never leave hooks on the target, even when generation raised
        if generator is not None:
            generator.finish(result if isinstance(result, torch.Tensor) else result.sequences)
        return result

    for name, wrapper in (
        ("_get_candidate_generator", _get_candidate_generator),
        ("_validate_generation_mode", _validate_generation_mode),
        ("_assisted_decoding", _assisted_decoding),
    ):
        wrapper._dflash_hook = True
        setattr(GenerationMixin, name, wrapper)


install_generate_hook()

__all__ = [
    "DFlashDraftModel",
    "DSparkDraftModel",
    "DFlashCandidateGenerator",
    "DFlashContextCache",
    "DraftProposal",
    "TargetStateCapture",
    "find_decoder_layers",
    "check_draft_fits_target",
    "check_vocab_mapping",
    "install_generate_hook",
]
