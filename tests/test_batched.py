"""`target.generate(**batch, assistant_model=draft)` with B > 1: every row equal to what plain batched generate returns
for it (greedy), distributed as the target's (sampling), and clear errors for what the batched loop does not do."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from dflash_hf import EXACT_ATTENTION
from dflash_hf.batching_dflash import right_aligned
from sampling_check import ALPHA, PROMPT, RUNS, SAMPLE_VOCAB, SAMPLING, chi_square_p_value, exact_pair_distribution
from test_generate import FAMILIES, SMALL_VOCAB, _sampling_pair, pair
from test_exact_attention import bf16_target, matmuls_are_row_invariant
from tiny import make_successor_target, oracle_dspark, random_dflash2, random_dspark, tiny_target

PAD = 0


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def generate_both(target, draft, prompts, policy="fixed", **kwargs):
    """(plain batched greedy generate, ours) on the left-padded prompts."""
    ids, mask = left_padded(prompts)
    settings_ = dict(do_sample=False, pad_token_id=PAD, **kwargs)
    plain = target.generate(ids, attention_mask=mask, generation_config=GenerationConfig(**settings_))
    ours = target.generate(ids, attention_mask=mask, assistant_model=draft,
                           generation_config=GenerationConfig(dflash_policy=policy, **settings_))
    return plain, ours


prompt_lists = st.lists(st.lists(st.integers(3, SMALL_VOCAB - 1), min_size=1, max_size=10), min_size=2, max_size=6)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_greedy_batch_equals_plain_batched_generate(family, data):
    """Random drafts (small vocabulary, so some proposals are right and rows accept different lengths)."""
    kind = data.draw(st.sampled_from(["dflash", "dspark"]), label="kind")
    target, draft = pair(family, kind)
    draft.config.block_size = data.draw(st.integers(2, 8), label="block_size")
    prompts = data.draw(prompt_lists, label="prompts")
    max_new = data.draw(st.integers(1, 48), label="max_new_tokens")
    eos = data.draw(st.sampled_from([None, 1, 2, SMALL_VOCAB - 1] + list(range(3, SMALL_VOCAB))), label="eos")
    policy = data.draw(st.sampled_from(["fixed", "auto"]), label="policy")
    plain, ours = generate_both(target, draft, prompts, policy, max_new_tokens=max_new, eos_token_id=eos)
    assert ours.tolist() == plain.tolist()


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(prompts=prompt_lists, max_new=st.integers(1, 48), block=st.integers(2, 9),
       wrong=st.lists(st.integers(0, SMALL_VOCAB - 1), max_size=4), eos=st.sampled_from([None, 2, 9, 15]),
       policy=st.sampled_from(["fixed", "auto"]))
def test_long_accepted_runs_with_holes_and_eos(prompts, max_new, block, wrong, eos, policy):
    """A draft right except after the tokens in `wrong`: rows accept long, different runs, so holes open every step
    and rows finish at different steps."""
    target = _successor()
    draft = oracle_dspark(target, block_size=block, wrong_after=tuple(wrong))
    plain, ours = generate_both(target, draft, prompts, policy, max_new_tokens=max_new, eos_token_id=eos)
    assert ours.tolist() == plain.tolist()
    if policy == "fixed" and not wrong and max_new > block:
        assert all(r["mean_acceptance_length"] > 1.5 for r in draft.generation_stats["rows"])


_successors = {}


def _successor():
    if "llama" not in _successors:
        _successors["llama"] = make_successor_target(tiny_target("llama", vocab_size=SMALL_VOCAB))
    return _successors["llama"]


def test_per_row_acceptance_does_not_fall_with_the_batch():
    """Each row advances by its own accepted length: a row the draft always gets right keeps the whole block accepted
    beside rows it gets wrong."""
    target = _successor()
    draft = oracle_dspark(target, block_size=5, wrong_after=(6, 7, 8, 9, 10, 11, 12, 13))
    prompts = [[3], [7], [8, 9], [4, 5]]  # (the tiny target's EOS is 2)
    plain, ours = generate_both(target, draft, prompts, max_new_tokens=4, eos_token_id=None)
    assert ours.tolist() == plain.tolist()
    rows = draft.generation_stats["rows"]
    assert rows[0]["acceptance_lengths"] == [3]  # 3 -> 4 from the prefill, then 5, 6 accepted and the target's 7
    assert rows[1]["acceptance_lengths"] == [1, 1, 1]  # the draft is wrong after 6..13: one token per step
    _, alone = generate_both(target, draft, [[3]], max_new_tokens=4, eos_token_id=None)
    assert alone[0].tolist() == ours[0, -5:].tolist()


def test_dflash2_batch_equals_plain_batched_generate():
    target = tiny_target("qwen3", vocab_size=SMALL_VOCAB)
    draft = random_dflash2(target, block_size=4)
    for prompts in ([[3, 4, 5], [6]], [[7, 7, 7, 7], [8, 9], [10, 11, 12]]):
        plain, ours = generate_both(target, draft, prompts, max_new_tokens=20, eos_token_id=None)
        assert ours.tolist() == plain.tolist()


class StopAfter(StoppingCriteria):
    """Stops a row once its last token is `token` (per row, as plain generate applies criteria)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("eos", [None, 15])
def test_stopping_criteria_per_row(eos):
    """With EOS, a row stopped by a criterion is padded after it; without, plain generate keeps decoding stopped rows
    until every row stopped, then cuts all at the longest: both as plain generate does."""
    target = _successor()
    draft = oracle_dspark(target, block_size=6)
    ids, mask = left_padded([[3], [9, 10], [5]])
    kwargs = dict(attention_mask=mask, max_new_tokens=30, stopping_criteria=StoppingCriteriaList([StopAfter(12)]))
    config = dict(do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    plain = target.generate(ids, generation_config=GenerationConfig(**config), **kwargs)
    ours = target.generate(ids, assistant_model=draft, generation_config=GenerationConfig(dflash_policy="fixed",
                                                                                           **config), **kwargs)
    assert ours.tolist() == plain.tolist()
    assert plain.shape[1] < ids.shape[1] + 30  # the criterion, not the length, ended it


def test_logits_processors_see_each_rows_own_ids():
    """Repetition penalty, n-gram bans and a minimum length read the ids: each row gets its own, as in plain generate."""
    target, draft = pair("qwen3", "dspark")
    prompts = [[3, 4, 3, 4, 3], [5], [6, 7, 8]]
    for extra in (dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=2), dict(min_new_tokens=5, eos_token_id=4)):
        extra.setdefault("eos_token_id", None)
        plain, ours = generate_both(target, draft, prompts, max_new_tokens=16, **extra)
        assert ours.tolist() == plain.tolist(), extra


def test_bf16_rows_equal_plain_batched_generate_with_row_exact_attention():
    """In bfloat16 a rounding flip is common unless every row's attention sees exactly its own keys: with row-exact
    attention both plain batched generate and ours give each row what it would get alone."""
    target = bf16_target("llama", EXACT_ATTENTION)
    if not matmuls_are_row_invariant(target):
        pytest.skip("this machine's bf16 matmuls depend on the row count (no AMX/oneDNN path)")
    draft = random_dspark(target, block_size=4).to(torch.bfloat16)
    torch.manual_seed(0)
    # Every forward within the 32 rows bf16 matmuls keep row-invariant: 4 prompts of at most 8, blocks of 4.
    prompts = [torch.randint(3, 90, (n,)).tolist() for n in (7, 4, 8, 5)]
    plain, ours = generate_both(target, draft, prompts, "fixed", max_new_tokens=24, eos_token_id=None)
    assert ours.tolist() == plain.tolist()
    assert draft.generation_stats["accepted_tokens"] > 0
    width = max(map(len, prompts))
    for row, prompt in enumerate(prompts):  # and each row is what it is alone (up to its EOS)
        alone, _ = generate_both(target, draft, [prompt], max_new_tokens=24, eos_token_id=None)
        new = alone[0, len(prompt):].tolist()
        assert ours[row, width : width + len(new)].tolist() == new


def test_sampling_rows_follow_the_target_distribution():
    """Each row of a sampled batch is distributed as the target alone on that row's prompt."""
    target, draft = _sampling_pair()
    other = [4, 0]
    ids, mask = left_padded([PROMPT, other])
    probs = [exact_pair_distribution(target, PROMPT), exact_pair_distribution(target, other)]
    counts = torch.zeros(2, SAMPLE_VOCAB * SAMPLE_VOCAB, dtype=torch.float64)
    torch.manual_seed(0)
    accepted = 0
    for _ in range(RUNS):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=4, assistant_model=draft, pad_token_id=PAD,
                              generation_config=GenerationConfig(dflash_policy="fixed"), **SAMPLING)[:, ids.shape[1]:]
        for row in range(2):
            counts[row, out[row, 1] * SAMPLE_VOCAB + out[row, 2]] += 1
        accepted += draft.generation_stats["accepted_tokens"]
    assert accepted > 0
    for row in range(2):
        assert chi_square_p_value(counts[row], probs[row]) > ALPHA


def test_right_aligned_moves_each_rows_valid_columns_right_in_order():
    valid = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    index, new_valid = right_aligned(valid)
    assert index.shape == (3, 5)
    assert index[0, -3:].tolist() == [0, 2, 3] and index[1, -1:].tolist() == [2] and index[2].tolist() == [0, 1, 2, 3, 4]
    assert new_valid.sum(1).tolist() == [3, 1, 5] and new_valid[:, -1].all()


def test_pipeline_with_batch_size_and_a_draft(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    from tiny_pair import save_tiny_pair
    from dflash_hf import load_draft

    target_dir, draft_dir = save_tiny_pair(tmp_path, kind="dspark", agreeable=True)
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir, padding_side="left")
    draft = load_draft(draft_dir)
    # The pipeline compares the two configs' special token ids before it generates; the draft speaks the target's.
    draft.config.update({name: getattr(target.config, name) for name in ("bos_token_id", "eos_token_id",
                                                                         "pad_token_id")})
    prompts = ["ab", "a longer prompt", "abab", "x"]
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer, batch_size=4)
    ours = pipeline("text-generation", model=target, tokenizer=tokenizer, batch_size=4, assistant_model=draft)
    kwargs = dict(max_new_tokens=12, do_sample=False)
    assert ours(prompts, **kwargs) == plain(prompts, **kwargs)
    assert draft.generation_stats["batch_size"] == 4
    assert draft.generation_stats["mean_acceptance_length"] > 1


# -- what the batched loop refuses ---------------------------------------------------------------------------------


def _refused(match, **kwargs):
    target, draft = pair("llama", "dflash")
    ids, mask = left_padded([[3, 4], [5]])
    kwargs.setdefault("attention_mask", mask)
    with pytest.raises(ValueError, match=match):
        target.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=PAD, assistant_model=draft, **kwargs)


def test_right_padding_is_refused():
    _refused("left padding", attention_mask=torch.tensor([[1, 1], [1, 0]]))


@pytest.mark.parametrize("field", ["output_scores", "output_logits"])
def test_per_step_outputs_are_refused_naming_the_field(field):
    _refused(field, return_dict_in_generate=True, **{field: True})


def test_return_dict_carries_sequences_and_stats():
    target, draft = pair("llama", "dspark")
    ids, mask = left_padded([[3, 4], [5]])
    out = target.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD,
                          assistant_model=draft, return_dict_in_generate=True)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    assert out.sequences.tolist() == plain.tolist()
    assert out.generation_stats["batch_size"] == 2 and len(out.generation_stats["rows"]) == 2
    assert out.generation_stats["cost_estimates_ms"]["verify"][1] > 0  # two plain steps of the batch, measured first


class Quiet(BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


def test_streamer_lookup_and_prefix_functions_are_refused():
    _refused("streamer", streamer=Quiet())
    _refused("prompt_lookup_num_tokens", prompt_lookup_num_tokens=3)
    _refused("prefix_allowed_tokens_fn", prefix_allowed_tokens_fn=lambda batch, ids: [3, 4])


def test_hook_capture_serves_batches_too():
    """Remote-code targets hand over their states through forward hooks: the batched loop reads them the same way."""
    target, draft = pair("deepseek_v3", "dspark")
    hooks = [len(layer._forward_hooks) for layer in target.model.layers]  # transformers may keep its own
    draft.capture_mode = "hooks"
    try:
        plain, ours = generate_both(target, draft, [[3, 4, 5], [6], [7, 8]], max_new_tokens=24, eos_token_id=None)
    finally:
        draft.capture_mode = "auto"
    assert ours.tolist() == plain.tolist()
    assert [len(layer._forward_hooks) for layer in target.model.layers] == hooks  # ours removed after the call
