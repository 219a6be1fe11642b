"""Configuration of DFlash 2 block drafters (z-lab / Inco AI): the DFlash backbone plus grouped dynamic causal
convolutions around every attention and MLP sublayer and a top-K candidate selector walked over the block.

A Hub remote-code file: it imports only transformers and its sibling `configuration_dflash.py`, so
`AutoConfig.from_pretrained(repo, trust_remote_code=True)` works where `dflash_hf` is not installed.
"""

import math
from numbers import Real

from .configuration_dflash import DFlashConfig, _invalid

# Beside DFlash's own: no default is right for every DFlash 2 draft, and a wrong one loads and drafts garbage.
DFLASH2_REQUIRED_FIELDS = {
    **DFlashConfig.required_fields,
    "conv_kernel_size": "taps of each grouped dynamic causal convolution (the released drafts: 2)",
    "conv_group_size": "channels sharing one dynamic tap weight (the released drafts: 16)",
    "selector_rank": "rank of the candidate selector's codebooks (the released drafts: 256)",
    "selector_top_k": "candidates the selector scores per slot (the released drafts: 16)",
}


class DFlash2Config(DFlashConfig):
    r"""Configuration of a DFlash 2 draft: a DFlash draft whose layers convolve each sublayer's input and output
    along the block, and whose proposals come from a walk over each slot's top-K candidates.

    DFlash 2 fields:
        conv_kernel_size: taps `T` of each causal convolution; tap `t` reads the position `t` earlier in the same
            block (never the context or another block).
        conv_group_size: channels per group; each group of `hidden_size / conv_group_size` channels gets one
            position-dependent tap weight per tap, added to the per-channel base weight.
        selector_rank: rank `r` of the predecessor/successor codebooks and the hidden projection.
        selector_top_k: `K`, how many of a slot's highest draft logits the selector chooses among.
        input_embedding_scale: multiplies the block's token embeddings (None: 1). Read by DFlash drafts too.
        output_multiplier: multiplies the draft logits (None: 1). Read by DFlash drafts too.
        final_logit_softcapping: `cap * tanh(logits / cap)` after the multiplier; None or 0: off. Read by DFlash
            drafts too.
    """

    model_type = "dflash2"
    required_fields = DFLASH2_REQUIRED_FIELDS

    def __init__(
        self,
        conv_kernel_size: int = 2,
        conv_group_size: int = 16,
        selector_rank: int = 256,
        selector_top_k: int = 16,
        input_embedding_scale: float | None = None,
        output_multiplier: float | None = None,
        final_logit_softcapping: float | None = None,
        **kwargs,
    ):
        self.conv_kernel_size = conv_kernel_size
        self.conv_group_size = conv_group_size
        self.selector_rank = selector_rank
        self.selector_top_k = selector_top_k
        self.input_embedding_scale = input_embedding_scale
        self.output_multiplier = output_multiplier
        self.final_logit_softcapping = final_logit_softcapping
        super().__init__(**kwargs)

    def validate_draft(self) -> None:
        super().validate_draft()
        for field in ("conv_kernel_size", "conv_group_size", "selector_rank"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise _invalid(field, value, "a positive integer")
        if self.hidden_size % self.conv_group_size:
            raise _invalid("conv_group_size", self.conv_group_size, f"a divisor of hidden_size ({self.hidden_size})")
        top_k = self.selector_top_k
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 < top_k <= self.draft_vocab_size:
            bound = "draft_vocab_size" if self.drafts_pruned_vocab else "vocab_size"  # the candidates come from it
            raise _invalid("selector_top_k", top_k, f"an integer in [1, {bound}={self.draft_vocab_size}]")
        for field, lowest, expected in (
            ("input_embedding_scale", None, "a number or None"),
            ("output_multiplier", None, "a number or None"),
            ("final_logit_softcapping", 0.0, "a number >= 0 (0 or None: no capping)"),
        ):
            value = getattr(self, field)
            if value is None:
                continue
            if not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value) or (
                lowest is not None and value < lowest
            ):
                raise _invalid(field, value, expected)


__all__ = ["DFlash2Config"]
