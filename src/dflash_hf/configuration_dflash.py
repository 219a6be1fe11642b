"""Configurations of DFlash and DSpark block drafters.

This file is also a Hub remote-code file: it imports only transformers (and the standard library),
so `AutoConfig.from_pretrained(repo, trust_remote_code=True)` works where `dflash_hf` is not installed.
"""

from transformers import PretrainedConfig

ALLOWED_LAYER_TYPES = ("full_attention", "sliding_attention")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default choice of target layers: the middle one, or evenly spread over 1..N-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _invalid(field: str, value, expected: str) -> ValueError:
    return ValueError(f"Invalid draft config: `{field}` = {value!r}, expected {expected}.")


# Fields a saved config must state, with what each means: no default is right for every draft, and a wrong one
# still loads and drafts garbage. (`target_layer_ids` may be left out: it follows from `num_target_layers`, as in
# z-lab's code. Layer fields keep Qwen3's defaults, as Qwen3Config does; a wrong one shows as a shape mismatch.)
DFLASH_REQUIRED_FIELDS = {
    "block_size": "ids per drafted block, as the draft was trained",
    "mask_token_id": "the id the draft was trained to read in the masked block slots",
    "num_target_layers": "the target's decoder layer count (`target_layer_ids` default from it)",
}
DSPARK_REQUIRED_FIELDS = {
    **DFLASH_REQUIRED_FIELDS,
    "sample_from_anchor": "false: slot 0 is the anchor (DFlash layout); true: every slot predicts the next token",
}


class DFlashConfig(PretrainedConfig):
    r"""Configuration of a DFlash draft: a few Qwen3-style layers reading the target's hidden states.

    Layer fields follow Qwen3. Target fields:
        vocab_size: the *target's* vocabulary (transformers' `generate` insists the assistant's matches).
        target_hidden_size: hidden size of the target model.
        num_target_layers: number of decoder layers of the target.
        target_layer_ids: target decoder layers read by the draft, z-lab meaning: id `t` is the output of
            decoder layer `t`, i.e. `output_hidden_states[t + 1]`.
        block_size: ids per drafted block (`[anchor, MASK, ...]`).
        mask_token_id: the id filling the non-anchor block slots; any id inside `vocab_size`.
        shares_target_input_embedding: the draft has no input embedding of its own and borrows the target's.
        shares_target_lm_head: the draft has no lm_head of its own and borrows the target's (the kept rows of it,
            for a pruned vocabulary). speculators 0.9.0 ships a pruned lm_head but borrows the embedding.
        draft_vocab_size: size of the draft's output vocabulary; `vocab_size` (None) when it proposes from all of
            it. Smaller: the draft proposes only the target ids its `d2t`/`t2d` maps keep, and its head computes
            only their rows (a CPU draft step's largest cost with a 49k-151k vocabulary). Verification stays exact.
        shares_target_embeddings: the earlier single flag, still read: both of the above at once. Reading it back
            tells whether the draft borrows both.
        use_kernels: "auto" (Triton kernels on CUDA when they load, else torch), "1" (kernels or an error) or "0"
            (torch only); the environment variable DFLASH_KERNELS overrides it. None = "auto".
        sliding_window_causal: sliding-window layers are causal inside the block (the engines' default); full
            attention layers are always bidirectional inside the block.
    """

    model_type = "dflash"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 1024,
        intermediate_size: int = 3072,
        num_hidden_layers: int = 1,
        num_attention_heads: int = 16,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 40960,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 1_000_000.0,
        rope_parameters: dict | None = None,
        rope_scaling: dict | None = None,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        sliding_window_causal: bool = True,
        target_hidden_size: int | None = None,
        num_target_layers: int = 28,
        target_layer_ids: list[int] | None = None,
        block_size: int = 16,
        mask_token_id: int = 0,
        shares_target_input_embedding: bool | None = None,
        shares_target_lm_head: bool | None = None,
        shares_target_embeddings: bool | None = None,
        use_kernels: str | None = None,
        draft_vocab_size: int | None = None,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.draft_vocab_size = vocab_size if draft_vocab_size is None else draft_vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        if head_dim is None:
            if not isinstance(num_attention_heads, int) or num_attention_heads <= 0 or hidden_size % num_attention_heads:
                raise _invalid("num_attention_heads", num_attention_heads, f"a divisor of hidden_size ({hidden_size})")
            head_dim = hidden_size // num_attention_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.sliding_window = sliding_window
        self.sliding_window_causal = sliding_window_causal
        self.layer_types = list(layer_types) if layer_types is not None else ["full_attention"] * num_hidden_layers
        self.target_hidden_size = hidden_size if target_hidden_size is None else target_hidden_size
        self.num_target_layers = num_target_layers
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_hidden_layers)
        self.target_layer_ids = [int(t) for t in target_layer_ids]
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self._set_sharing(shares_target_input_embedding, shares_target_lm_head, shares_target_embeddings)
        self.use_kernels = use_kernels
        # One home for RoPE: a standardized `rope_parameters` dict, whatever the checkpoint called it.
        rope = dict(rope_parameters or rope_scaling or {})
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", rope_theta)
        self.rope_parameters = rope
        # Ours first: transformers' own validators raise less specific errors for some of the same fields.
        self.validate_draft()
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def _set_sharing(self, embedding: bool | None, head: bool | None, both: bool | None) -> None:
        """The two sharing flags, given or taken from the earlier single flag (all that older saved configs carry)."""
        for field, value in (("shares_target_input_embedding", embedding), ("shares_target_lm_head", head)):
            if both is not None and value is not None and value != both:
                raise _invalid(field, value, f"the same as `shares_target_embeddings` ({both}) when both are given")
        default = True if both is None else both
        self.shares_target_input_embedding = default if embedding is None else embedding
        self.shares_target_lm_head = default if head is None else head

    @property
    def shares_target_embeddings(self) -> bool:
        """True when the draft borrows both the target's embedding and lm_head (the earlier flag's meaning)."""
        return self.shares_target_input_embedding and self.shares_target_lm_head

    @shares_target_embeddings.setter
    def shares_target_embeddings(self, value: bool) -> None:
        self.shares_target_input_embedding = self.shares_target_lm_head = value

    required_fields = DFLASH_REQUIRED_FIELDS

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """As transformers', but a config read from a checkpoint must state the fields no default can stand in for
        (`DFlashConfig()` itself keeps its defaults: transformers builds bare configs internally)."""
        missing = [field for field in cls.required_fields if field not in config_dict and field not in kwargs]
        if missing:
            hints = "; ".join(f"`{field}`: {cls.required_fields[field]}" for field in missing)
            raise ValueError(
                f"The {cls.model_type} draft config (config.json) has no {', '.join(f'`{f}`' for f in missing)}. "
                f"No default is right for every draft; add the value the draft was trained with ({hints})."
            )
        # Given as overrides, they must reach __init__ (validation, derived layer ids), not be set afterwards.
        config_dict = {**config_dict, **{field: kwargs.pop(field) for field in cls.required_fields if field in kwargs}}
        return super().from_dict(config_dict, **kwargs)

    def validate_draft(self) -> None:
        """Reject configurations that would load but compute something wrong; the message names the field."""
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "target_hidden_size",
            "num_target_layers",
        )
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise _invalid(field, value, "a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise _invalid(
                "num_key_value_heads",
                self.num_key_value_heads,
                f"a divisor of num_attention_heads ({self.num_attention_heads})",
            )
        if self.head_dim % 2:
            raise _invalid("head_dim", self.head_dim, "an even number (RoPE rotates pairs)")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise _invalid("block_size", self.block_size, "an integer >= 2 (anchor plus at least one slot)")
        if not self.target_layer_ids:
            raise _invalid("target_layer_ids", self.target_layer_ids, "a non-empty list of target layer ids")
        for t in self.target_layer_ids:
            if not 0 <= t < self.num_target_layers:
                raise _invalid(
                    "target_layer_ids", self.target_layer_ids, f"ids in [0, num_target_layers={self.num_target_layers})"
                )
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise _invalid("mask_token_id", self.mask_token_id, f"an id in [0, vocab_size={self.vocab_size})")
        if len(self.layer_types) != self.num_hidden_layers:
            raise _invalid("layer_types", self.layer_types, f"{self.num_hidden_layers} entries (num_hidden_layers)")
        for layer_type in self.layer_types:
            if layer_type not in ALLOWED_LAYER_TYPES:
                raise _invalid("layer_types", self.layer_types, f"entries from {ALLOWED_LAYER_TYPES}")
        for field in ("shares_target_input_embedding", "shares_target_lm_head"):
            if not isinstance(getattr(self, field), bool):
                raise _invalid(field, getattr(self, field), "true or false")
        if "sliding_attention" in self.layer_types and not (
            isinstance(self.sliding_window, int) and self.sliding_window > 0
        ):
            raise _invalid("sliding_window", self.sliding_window, "a positive integer when a layer slides")
        if self.rope_parameters["rope_type"] != "default" and "factor" not in self.rope_parameters:
            raise _invalid("rope_parameters", self.rope_parameters, "a `factor` for a scaled RoPE type")
        draft_vocab = self.draft_vocab_size
        if not isinstance(draft_vocab, int) or isinstance(draft_vocab, bool) or not 0 < draft_vocab <= self.vocab_size:
            raise _invalid("draft_vocab_size", draft_vocab, f"an integer in [1, vocab_size={self.vocab_size}]")

    @property
    def num_speculative_slots(self) -> int:
        """Proposals per block: the anchor slot drafts nothing in the DFlash layout."""
        return self.block_size - 1

    @property
    def drafts_pruned_vocab(self) -> bool:
        return self.draft_vocab_size < self.vocab_size


class DSparkConfig(DFlashConfig):
    r"""Configuration of a DSpark draft: DFlash plus a Markov logit bias and a confidence head.

    DSpark fields:
        markov_rank: rank `r` of the Markov bias `W2(W1[prev])`; 0 disables it.
        markov_head_type: "vanilla", "gated" or "rnn".
        enable_confidence_head: predict per-slot acceptance from `[h_k ; W1[prev_k]]` (or `h_k`).
        confidence_head_with_markov: feed `W1[prev_k]` to the confidence head.
        sample_from_anchor: False = DFlash layout (slot 0 is the anchor, b-1 proposals); True = every slot
            predicts the next token (b proposals, the first conditioned on the anchor).
        confidence_threshold: default survival threshold below which drafting stops; None = full block.
    """

    model_type = "dspark"
    required_fields = DSPARK_REQUIRED_FIELDS

    def __init__(
        self,
        markov_rank: int = 0,
        markov_head_type: str = "vanilla",
        enable_confidence_head: bool = False,
        confidence_head_with_markov: bool = True,
        sample_from_anchor: bool = False,
        confidence_threshold: float | None = None,
        **kwargs,
    ):
        self.markov_rank = markov_rank
        self.markov_head_type = markov_head_type
        self.enable_confidence_head = enable_confidence_head
        self.confidence_head_with_markov = confidence_head_with_markov
        self.sample_from_anchor = sample_from_anchor
        self.confidence_threshold = confidence_threshold
        super().__init__(**kwargs)

    def validate_draft(self) -> None:
        super().validate_draft()
        if not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            raise _invalid("markov_rank", self.markov_rank, "an integer >= 0")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise _invalid("markov_head_type", self.markov_head_type, f"one of {MARKOV_HEAD_TYPES}")
        if self.confidence_threshold is not None and not 0.0 <= self.confidence_threshold <= 1.0:
            raise _invalid("confidence_threshold", self.confidence_threshold, "a probability in [0, 1] or None")

    @property
    def num_speculative_slots(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1


__all__ = ["DFlashConfig", "DSparkConfig", "default_target_layer_ids"]
