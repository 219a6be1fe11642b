"""Row-exact attention: in bfloat16 a verify block must score its tokens with the bits of one-token decodes."""

import inspect

import pytest
import torch
import torch.nn.functional as F
from tiny import random_dspark
from transformers import DynamicCache, GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash_hf.exact_attention import EXACT_ATTENTION, EXACT_VERIFY_ROWS, visible_key_counts

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def test_visible_key_counts_reads_causal_masks_and_refuses_the_rest():
    q_len, kv_len = 3, 7
    assert visible_key_counts(None, q_len, kv_len) == [5, 6, 7]
    causal = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
    assert visible_key_counts(causal[None, None], q_len, kv_len) == [5, 6, 7]
    additive = torch.zeros(q_len, kv_len).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert visible_key_counts(additive[None, None], q_len, kv_len) == [5, 6, 7]
    padded = causal.clone()
    padded[:, 0] = False  # a left pad: the visible keys no longer start at 0
    assert visible_key_counts(padded[None, None], q_len, kv_len) is None
    window = causal.clone()
    window[2, 1] = False  # a sliding window
    assert visible_key_counts(window[None, None], q_len, kv_len) is None
    assert visible_key_counts(causal[None, None].expand(2, 1, -1, -1), q_len, kv_len) is None  # batch of two


def bf16_target(family: str, attention: str):
    """A small random target with 64-wide heads (as real models have: with narrower ones SDPA happens to round a block
    like single rows, and the negative control below would have nothing to show)."""
    torch.manual_seed(0)
    fields = dict(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, eos_token_id=2, pad_token_id=0, bos_token_id=1)
    config_class, model_class = FAMILIES[family]
    target = model_class(config_class(**fields)).to(torch.bfloat16).eval()
    target.set_attn_implementation(attention)
    return target


def matmuls_are_row_invariant(target, max_rows: int = EXACT_VERIFY_ROWS) -> bool:
    """Whether this machine's bf16 matmuls give a row the same bits whatever the row count, for every linear layer's
    shape of `target` and every count up to `max_rows` (true with oneDNN on AMX; elsewhere it depends on the CPU and
    the shape). Without it no attention can make a block verify exact, so the end-to-end checks below would test the
    platform, not the attention."""
    weights = {tuple(m.weight.shape): m.weight for m in target.modules() if isinstance(m, torch.nn.Linear)}
    generator = torch.Generator().manual_seed(0)
    for weight in weights.values():
        rows = torch.randn(max_rows, weight.shape[1], generator=generator).to(weight.dtype)
        single = torch.cat([F.linear(rows[i : i + 1], weight) for i in range(max_rows)])
        if not all(torch.equal(F.linear(rows[:count], weight), single[:count]) for count in range(2, max_rows + 1)):
            return False
    return True


def block_and_stepwise_logits(target, ids: torch.Tensor, prefix: int):
    """Logits of ids[prefix:] scored as one block after a prefill, and one token at a time after the same prefill."""
    # transformers 5.24 renames the forward's `past_key_values` to `cache` (the old name warns until 5.40).
    name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    with torch.no_grad():
        cache = DynamicCache(config=target.config)
        target(ids[:, :prefix], **{name: cache})
        block = target(ids[:, prefix:], **{name: cache}).logits[0]
        cache = DynamicCache(config=target.config)
        target(ids[:, :prefix], **{name: cache})
        steps = [target(ids[:, i : i + 1], **{name: cache}).logits[0, 0] for i in range(prefix, ids.shape[1])]
    return block, torch.stack(steps)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_block_verify_has_the_bits_of_one_token_decodes(family):
    target = bf16_target(family, EXACT_ATTENTION)
    if not matmuls_are_row_invariant(target):
        pytest.skip("this machine's bf16 matmuls depend on the row count (no AMX/oneDNN path)")
    ids = torch.randint(3, 90, (1, 120), generator=torch.Generator().manual_seed(1))
    differing_with_sdpa = 0
    for prefix, block_size in ((20, 9), (57, 2), (100, 16), (111, 9)):
        block, steps = block_and_stepwise_logits(target, ids[:, : prefix + block_size], prefix)
        assert torch.equal(block, steps), f"prefix {prefix}: {(block != steps).any(-1).sum()} rows differ"
        target.set_attn_implementation("sdpa")
        block, steps = block_and_stepwise_logits(target, ids[:, : prefix + block_size], prefix)
        differing_with_sdpa += int((block != steps).any(-1).sum())
        target.set_attn_implementation(EXACT_ATTENTION)
    # The negative control: plain SDPA does round a block differently, which is what this attention is for.
    assert differing_with_sdpa > 0


def test_prompt_rows_do_not_depend_on_what_follows():
    """Prompt lookup's first forward is the prompt plus candidates: its prompt rows must match a plain prefill's."""
    target = bf16_target("llama", EXACT_ATTENTION)
    if not matmuls_are_row_invariant(target, max_rows=160):
        pytest.skip("this machine's bf16 matmuls depend on the row count up to a prompt's 160 rows")
    ids = torch.randint(3, 90, (1, 160), generator=torch.Generator().manual_seed(4))
    differing_with_sdpa = 0
    with torch.no_grad():
        for prompt, extra in ((40, 3), (97, 7), (150, 10)):
            for attention in (EXACT_ATTENTION, "sdpa"):
                target.set_attn_implementation(attention)
                alone = target(ids[:, :prompt]).logits[0]
                followed = target(ids[:, : prompt + extra]).logits[0, :prompt]
                if attention == EXACT_ATTENTION:
                    assert torch.equal(alone, followed), f"prompt {prompt} + {extra}"
                else:
                    differing_with_sdpa += int((alone != followed).any(-1).sum())
    assert differing_with_sdpa > 0  # the negative control


def test_a_padded_batch_row_gets_the_bits_it_gets_alone():
    """Left padding (or batched speculation's holes): each row attends to exactly its own keys, so a padded row scores
    as it does alone. (Whether plain SDPA over the padded batch does too depends on the CPU's kernels: on some machines
    seen here it does, on others not, so there is no negative control here.)"""
    target = bf16_target("llama", EXACT_ATTENTION)
    if not matmuls_are_row_invariant(target):
        pytest.skip("this machine's bf16 matmuls depend on the row count (no AMX/oneDNN path)")
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding in a batch of two
    with torch.no_grad():
        alone = [target(ids[:1]).logits[0], target(ids[1:, 4:]).logits[0]]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers a left-padded row
        got = target(ids, attention_mask=mask, position_ids=positions).logits
    assert torch.equal(got[0], alone[0]) and torch.equal(got[1, 4:], alone[1])


FULL_BLOCKS = GenerationConfig(dflash_policy="fixed")  # verify a block every step: what the attention must get right


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_speculative_greedy_equals_the_target_alone(family):
    target = bf16_target(family, EXACT_ATTENTION)
    if not matmuls_are_row_invariant(target):
        pytest.skip("this machine's bf16 matmuls depend on the row count (no AMX/oneDNN path)")
    draft = random_dspark(target, block_size=6).to(torch.bfloat16)
    mismatches = {}
    for attention in (EXACT_ATTENTION, "sdpa"):
        target.set_attn_implementation(attention)
        generator = torch.Generator().manual_seed(3)
        mismatches[attention] = 0
        for length in (3, 17, 40, 5, 9, 33):
            ids = torch.randint(3, 90, (1, length), generator=generator)
            alone = target.generate(ids, do_sample=False, max_new_tokens=48, eos_token_id=None)
            assisted = target.generate(ids, do_sample=False, max_new_tokens=48, eos_token_id=None,
                                       assistant_model=draft, generation_config=FULL_BLOCKS)
            mismatches[attention] += assisted.tolist() != alone.tolist()
    assert mismatches[EXACT_ATTENTION] == 0
    assert mismatches["sdpa"] > 0  # the negative control: bf16 SDPA does part ways on near-ties


def test_dtype_choice_is_exact_first():
    from dflash_hf.defaults import resolve_dtype

    assert resolve_dtype("auto", "cuda") == torch.float32  # GPU bf16 matmuls are shape-dependent: not exact
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if torch.cpu._is_amx_tile_supported() else torch.float32)
    assert resolve_dtype("float16") == torch.float16 and resolve_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype: unknown 'fp33'"):
        resolve_dtype("fp33")
