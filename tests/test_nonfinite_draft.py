"""A draft whose logits turn NaN or inf at run time (an fp16 overflow, a broken fine-tune) never ends the call: each
such step decodes without it, the output stays the target's, the draft is named in one warning and the steps are
counted in `generation_stats["nonfinite_steps"]`."""

import logging

import pytest
import torch
from dflash_hf.batching_dflash import speculative_accept
from test_generate import FIXED, SMALL_VOCAB  # FIXED: a block every step, so every step meets the broken logits
from tiny import random_dflash, random_dflash2, random_dspark, tiny_target

MAKERS = {"dflash": random_dflash, "dspark": random_dspark, "dflash2": random_dflash2}


def broken_pair(kind: str):
    target = tiny_target("llama", vocab_size=SMALL_VOCAB)
    draft = MAKERS[kind](target, layer_ids=[0, 2], block_size=4)
    with torch.no_grad():
        draft.norm.weight.fill_(float("inf"))  # inf * 0 and inf - inf: the slots' logits become NaN
    return target, draft


def prompts(batch: int):
    ids = torch.tensor([[3, 4, 5, 6], [0, 7, 8, 9]][:batch])
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_greedy_with_a_nan_draft_is_the_target_alone(kind, batch, caplog):
    target, draft = broken_pair(kind)
    inputs = prompts(batch)
    expected = target.generate(**inputs, do_sample=False, max_new_tokens=12, eos_token_id=None)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # a second call warns no more
            out = target.generate(**inputs, do_sample=False, max_new_tokens=12, eos_token_id=None,
                                  assistant_model=draft, generation_config=FIXED)
            assert torch.equal(out, expected)
    stats = draft.generation_stats
    assert stats["nonfinite_steps"] == stats["draft_forwards"] > 0
    assert stats["drafted_tokens"] == 0
    warnings = [r.getMessage() for r in caplog.records if "NaN or inf" in r.getMessage()]
    assert len(warnings) == 1 and type(draft).__name__ in warnings[0]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_sampling_with_a_nan_draft_draws_what_the_target_alone_draws(kind, batch):
    """Every step is a plain decode drawing one token per row from the target's processed distribution, as
    plain sampling does, and the draft draws nothing: with one seed, the tokens are the target's own."""
    target, draft = broken_pair(kind)
    inputs = prompts(batch)
    sampling = dict(do_sample=True, temperature=0.9, top_k=8, max_new_tokens=12, eos_token_id=None)
    torch.manual_seed(7)
    expected = target.generate(**inputs, **sampling)
    torch.manual_seed(7)
    out = target.generate(**inputs, **sampling, assistant_model=draft, generation_config=FIXED)
    assert torch.equal(out, expected)
    assert draft.generation_stats["nonfinite_steps"] > 0


def test_a_finite_draft_counts_no_nonfinite_steps():
    target = tiny_target("llama", vocab_size=SMALL_VOCAB)
    draft = random_dspark(target, layer_ids=[0, 2], block_size=4)
    target.generate(**prompts(1), do_sample=True, max_new_tokens=8, assistant_model=draft, generation_config=FIXED)
    assert draft.generation_stats["nonfinite_steps"] == 0 < draft.generation_stats["drafted_tokens"]


def test_rejection_never_accepts_a_token_the_target_rules_out():
    """`r < p/q` (transformers >= 5.25): with p = 0 a candidate is rejected even for the draw r = 0, which `<=`
    would accept; with p > 0 the draw r = 0 accepts."""
    p = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])  # [B=1, k+1=2, V=2]
    q = torch.tensor([[[1.0, 0.0]]])  # the draft is sure of token 0, which the target rules out
    candidates = torch.tensor([[0]])
    accepted, after = speculative_accept(p, q, candidates, uniforms=torch.zeros(1, 1))
    assert accepted.tolist() == [0] and after.tolist() == [1]  # rejected; the residual (p - q)+ leaves token 1
    p = torch.tensor([[[0.25, 0.75], [0.5, 0.5]]])
    accepted, _ = speculative_accept(p, q, candidates, uniforms=torch.zeros(1, 1))
    assert accepted.tolist() == [1]
