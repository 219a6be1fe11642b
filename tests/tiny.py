"""Tiny random targets (transformers' own classes) and drafts that fit them, shared by the tests."""

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash_hf import DFlashConfig, DFlashDraftModel, DSparkConfig, DSparkDraftModel
from dflash_hf import DFlash2Config, DFlash2DraftModel

VOCAB = 96
EOS = 2


def tiny_target(family: str = "llama", seed: int = 0, vocab_size: int = VOCAB, num_layers: int = 4):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=EOS, pad_token_id=0, bos_token_id=1)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common))
    elif family == "deepseek_v3":
        config = DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, moe_intermediate_size=16, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
            q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        )
        model = DeepseekV3ForCausalLM(config)
    else:
        raise ValueError(family)
    return model.eval()


def draft_fields(target, block_size: int = 4, num_layers: int = 1, layer_ids=None, mask_token_id=None, **extra):
    text = target.config.get_text_config(decoder=True)
    return dict(
        vocab_size=text.vocab_size, hidden_size=text.hidden_size, intermediate_size=48, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, target_hidden_size=text.hidden_size,
        num_target_layers=text.num_hidden_layers, target_layer_ids=layer_ids, block_size=block_size,
        mask_token_id=text.vocab_size - 1 if mask_token_id is None else mask_token_id, **extra,
    )


def random_dflash(target, seed: int = 0, **kwargs) -> DFlashDraftModel:
    torch.manual_seed(seed)
    return DFlashDraftModel(DFlashConfig(**draft_fields(target, **kwargs))).eval()


def random_dspark(target, seed: int = 0, markov_rank: int = 4, markov_head_type: str = "vanilla",
                  confidence: bool = True, sample_from_anchor: bool = False, **kwargs) -> DSparkDraftModel:
    torch.manual_seed(seed)
    config = DSparkConfig(markov_rank=markov_rank, markov_head_type=markov_head_type,
                          enable_confidence_head=confidence, sample_from_anchor=sample_from_anchor,
                          **draft_fields(target, **kwargs))
    return DSparkDraftModel(config).eval()


def random_dflash2(target, seed: int = 0, conv_kernel_size: int = 2, conv_group_size: int = 8, selector_rank: int = 8,
                   selector_top_k: int = 4, spread: float = 0.5, **kwargs) -> DFlash2DraftModel:
    """A DFlash 2 draft with its convolutions and selector moved off their initialisation (identity convolutions and
    near-zero codebooks would make it a DFlash draft), so tests exercise them."""
    torch.manual_seed(seed)
    config = DFlash2Config(conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                           selector_rank=selector_rank, selector_top_k=selector_top_k, **draft_fields(target, **kwargs))
    draft = DFlash2DraftModel(config).eval()
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "_conv." in name or "candidate_selector." in name:
                param.add_(torch.randn_like(param) * spread)
    return draft


def make_successor_target(model, seed: int = 11):
    """Make the greedy next token `(current + 1) mod vocab`, whatever the architecture: every attention output and
    MLP/expert down projection is zeroed (the layers add nothing to the residual stream), the embedding rows are
    orthonormal and the lm_head maps each row to its successor's."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                param.zero_()
        embedding = model.get_input_embeddings().weight
        vocab, hidden = embedding.shape
        basis = torch.linalg.qr(torch.randn(hidden, hidden)).Q[:vocab]
        embedding.copy_(basis)
        model.get_output_embeddings().weight.copy_(torch.roll(basis, 1, dims=0) * 10)
    return model


def oracle_dspark(target, block_size: int, wrong_after=(), layer_ids=None) -> DSparkDraftModel:
    """A DSpark draft whose Markov head encodes the successor rule (it proposes exactly the successor target's greedy
    tokens), except after the tokens in `wrong_after`, where it proposes a wrong one."""
    vocab = target.config.get_text_config(decoder=True).vocab_size
    draft = random_dspark(target, markov_rank=vocab, confidence=False, block_size=block_size, layer_ids=layer_ids)
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
        successor = torch.roll(torch.eye(vocab), 1, dims=0)
        for token in wrong_after:
            successor[:, token] = torch.roll(successor[:, token], 1)
        draft.markov_head.markov_w2.weight.copy_(successor * 1000)
    return draft


def assert_same_logits(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Outputs of two drafts holding the same weights, equal to within 8 ulp of their compute `dtype`, relative to
    the largest magnitude in `want`.

    Equal bits do not give equal sums: a draft loaded from safetensors keeps its weights inside the file's buffer
    (4- to 32-byte aligned, where a fresh allocation is 64-byte aligned), and CPU BLAS chooses its vectorised loop, so
    the order of a dot product's partial sums, by operand alignment. On an AMD EPYC without AMX that moves float32
    logits by one ulp. A rounding changed in one layer is carried a few ulp further by the layers and norms after it;
    a wrong convention (layer ids, Markov input order, vocabulary map) moves logits by their whole scale.
    """
    atol = 8 * torch.finfo(dtype).eps * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
