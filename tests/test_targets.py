"""Targets as users load them: remote code (DeepSeek-V3-like, old-style outputs), transformers' MoE models,
multimodal wrappers around the text model, accelerate device maps with disk offload. Speculative greedy output must
equal the target's own, and hook-based capture must read the same states as `output_hidden_states`."""

import pytest
import torch
from transformers import GenerationConfig
from target_fixtures import (
    ToyVLMForConditionalGeneration,
    build_remote_target,
    load_remote_target,
    offloaded_target,
    tiny_llava,
    tiny_qwen3_moe,
)
from tiny import make_successor_target, oracle_dspark, random_dflash, random_dspark, tiny_target
from torch import nn

from dflash_hf.generation_dflash import TargetStateCapture, find_decoder_layers

VOCAB = 16  # small enough that random drafts are sometimes right
NUM_LAYERS = 4
TARGETS = [
    "remote_toyseek",
    "deepseek_v3",
    "qwen3_moe",
    "llava",
    "vlm_deepseek_v3",
    "vlm_remote_toyseek",
    "offloaded_llama",
    "offloaded_remote_toyseek",
    "offloaded_llama_head_on_disk",
]
PROMPTS = [[3, 9, 4, 11, 7], [5], [12, 12, 6, 3, 14, 8, 10, 4, 9], [7, 3]]


class Zoo:
    """Builds each target once per module (plain random weights, or the successor-rule variant)."""

    def __init__(self, root):
        self.root = root
        self.built = {}

    def get(self, name: str, successor: bool = False):
        key = (name, successor)
        if key not in self.built:
            self.built[key] = self._build(name, successor)
        return self.built[key]

    def _text_model(self, family: str, successor: bool, tag: str):
        if family == "remote_toyseek":
            folder = build_remote_target(self.root / f"{tag}-src", vocab_size=VOCAB, initializer_range=0.2)
            model = load_remote_target(folder)
        elif family == "qwen3_moe":
            model = tiny_qwen3_moe(vocab_size=VOCAB, num_layers=NUM_LAYERS)
        else:
            model = tiny_target(family, vocab_size=VOCAB, num_layers=NUM_LAYERS)
        return make_successor_target(model) if successor else model

    def _build(self, name: str, successor: bool):
        tag = f"{name}-{'succ' if successor else 'rand'}"
        if name == "llava":
            model = tiny_llava(vocab_size=VOCAB, num_layers=NUM_LAYERS)
            return make_successor_target(model) if successor else model
        if name.startswith("vlm_"):
            return ToyVLMForConditionalGeneration.wrap(self._text_model(name[4:], successor, tag))
        if name.startswith("offloaded_"):
            family = name.removeprefix("offloaded_").removesuffix("_head_on_disk")
            model = self._text_model(family, successor, tag)
            return offloaded_target(model, self.root / tag, disk_modules=("lm_head",) if "on_disk" in name else ())
        return self._text_model(name, successor, tag)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return Zoo(tmp_path_factory.mktemp("targets"))


def greedy(target, prompt, max_new_tokens, eos_token_id, **kwargs):
    """Greedy generation; with a draft, full blocks every step (the fixed policy) so every step verifies proposals:
    the length policy only chooses how many (tests/test_policy.py covers its choices, any k, being exact)."""
    ids = torch.tensor([prompt])
    if "assistant_model" in kwargs:
        kwargs.setdefault("generation_config", GenerationConfig(dflash_policy="fixed"))
    return target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                           pad_token_id=0, **kwargs)


def random_drafts(target):
    """One DFlash draft reading middle layers, one DSpark draft whose last layer id is the target's last layer
    (the state transformers reports after the final norm)."""
    return {
        "dflash": random_dflash(target, num_layers=2, layer_ids=[0, 2]),
        "dspark": random_dspark(target, markov_rank=4, markov_head_type="rnn", layer_ids=[1, NUM_LAYERS - 1]),
    }


def decoder_hook_count(target) -> int:
    return sum(len(module._forward_hooks) for module in target.modules())


def settled_hook_count(target) -> int:
    """Forward hooks on the target once transformers has installed its own (lazily, on the first hidden-state
    request; they stay), so that any further change is ours."""
    with torch.no_grad():
        target(torch.tensor([[3, 4]]), output_hidden_states=True)
    return decoder_hook_count(target)


# -- exactness -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TARGETS)
def test_greedy_is_exact_with_random_drafts(zoo, name):
    """Block sizes 2..8, DFlash and DSpark, several prompts, EOS inside the run and never reached. Random drafts are
    mostly rejected (the crop-everything path); long accepted runs are the next test's job."""
    target = zoo.get(name)
    drafts = random_drafts(target)
    hooks_before = settled_hook_count(target)
    for case, block_size in enumerate(range(2, 9)):
        kind = ("dflash", "dspark")[case % 2]
        draft = drafts[kind]
        draft.config.block_size = block_size
        prompt = PROMPTS[case % len(PROMPTS)]
        max_new = 8 + 3 * case
        free = greedy(target, prompt, max_new, None)[0, len(prompt):].tolist()
        # EOS: a token the target will produce (cut mid-run), every third case one it never produces.
        never = next(t for t in range(VOCAB - 1, -1, -1) if t not in free)
        eos = free[(3 * case + 2) % len(free)] if case % 3 != 2 else never
        expected = greedy(target, prompt, max_new, eos)
        got = greedy(target, prompt, max_new, eos, assistant_model=draft)
        assert got.tolist() == expected.tolist(), f"{name} {kind} block={block_size} prompt={prompt} eos={eos}"
        lengths = draft.generation_stats["acceptance_lengths"]
        assert sum(lengths) + 1 == got.shape[1] - len(prompt)
    assert decoder_hook_count(target) == hooks_before  # no capture hook outlives its generate call


@pytest.mark.parametrize("name", TARGETS)
def test_long_accepted_runs_are_exact(zoo, name):
    """Exact drafts (full blocks accepted) and drafts wrong after some tokens, cut by EOS and max_new_tokens."""
    target = zoo.get(name, successor=True)
    assert greedy(target, [4, 5], 5, None)[0, 2:].tolist() == [6, 7, 8, 9, 10]
    draft = oracle_dspark(target, block_size=6, layer_ids=[1, 2])
    out = greedy(target, [4, 5], 1 + 6 * 4, None, assistant_model=draft)
    assert out.tolist() == greedy(target, [4, 5], 1 + 6 * 4, None).tolist()
    assert draft.generation_stats["acceptance_lengths"] == [6] * 4
    cases = [(2, (), 3, 9, [3]), (5, (9,), 7, 23, [1, 4]), (8, (4, 12), 0, 30, [15]), (3, (6,), 13, 17, [2, 5, 8]),
             (7, (), None, 40, [10]), (4, (1, 2, 3), 11, 12, [14, 0])]
    for block_size, wrong_after, eos, max_new, prompt in cases:
        draft = oracle_dspark(target, block_size=block_size, wrong_after=wrong_after, layer_ids=[1, 2])
        expected = greedy(target, prompt, max_new, eos)
        got = greedy(target, prompt, max_new, eos, assistant_model=draft)
        assert got.tolist() == expected.tolist(), f"{name} block={block_size} wrong_after={wrong_after} eos={eos}"


# -- capture -------------------------------------------------------------------------------------------------------


CAPTURE_TARGETS = ["llama", "remote_toyseek", "deepseek_v3", "qwen3_moe", "llava", "vlm_remote_toyseek",
                   "offloaded_remote_toyseek"]


@pytest.mark.parametrize("layer_ids", [[0, 2], [1, NUM_LAYERS - 1], [NUM_LAYERS - 1, 0]])
@pytest.mark.parametrize("name", CAPTURE_TARGETS)
def test_hook_and_output_capture_give_identical_contexts(zoo, name, layer_ids):
    target = tiny_target("llama", vocab_size=VOCAB) if name == "llama" else zoo.get(name)
    ids = torch.tensor([[3, 9, 4, 11, 7, 5, 13]])
    with torch.no_grad():
        every_state = target(ids, output_hidden_states=True).hidden_states
    expected = torch.cat([every_state[t + 1] for t in layer_ids], dim=-1)
    hooks_before = settled_hook_count(target)
    contexts = {}
    for mode in ("hooks", "outputs"):
        capture = TargetStateCapture(target, layer_ids, mode=mode)
        try:
            with torch.no_grad():
                outputs = target(ids, **capture.model_kwargs_overrides)
            contexts[mode] = capture.states(outputs, ids.shape[1], torch.device("cpu"))
        finally:
            capture.close()
    assert decoder_hook_count(target) == hooks_before
    assert contexts["hooks"].shape == (1, ids.shape[1], len(layer_ids) * every_state[0].shape[-1])
    assert torch.equal(contexts["hooks"], contexts["outputs"])
    assert torch.equal(contexts["hooks"], expected)


def test_hooks_capture_only_the_fresh_prefix_of_a_verify_forward(zoo):
    """`states(outputs, count)` keeps the first `count` positions of the last forward, not of the whole history."""
    target = zoo.get("remote_toyseek")
    ids = torch.tensor([[3, 9, 4, 11, 7, 5, 13, 2]])
    with torch.no_grad():
        expected = torch.cat([target(ids, output_hidden_states=True).hidden_states[t + 1] for t in (0, 2)], dim=-1)
    capture = TargetStateCapture(target, [0, 2], mode="hooks")
    try:
        with torch.no_grad():
            first = target(ids[:, :5], use_cache=True)
            target(ids[:, 5:], cache=first.cache, use_cache=True)
        second = capture.states(None, 2, torch.device("cpu"))
    finally:
        capture.close()
    torch.testing.assert_close(second, expected[:, 5:7], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["remote_toyseek", "vlm_remote_toyseek", "offloaded_remote_toyseek", "llava",
                                  "offloaded_llama_head_on_disk"])
def test_contexts_fed_during_generation_are_the_targets_states(zoo, name):
    """Every context the draft is handed while generating equals the states a single full forward over the final
    sequence gives (up to float reordering): nothing skipped, repeated, or read from a rejected candidate."""
    target = zoo.get(name)
    draft = random_dspark(target, markov_rank=4, layer_ids=[1, NUM_LAYERS - 1], block_size=5)
    fed = []
    propose = draft.propose

    def recording_propose(context, *args, **kwargs):
        fed.append(context.detach().clone())
        return propose(context, *args, **kwargs)

    draft.propose = recording_propose
    out = greedy(target, PROMPTS[2], 30, None, assistant_model=draft)
    with torch.no_grad():
        every_state = target(out, output_hidden_states=True).hidden_states
    expected = torch.cat([every_state[t + 1] for t in draft.config.target_layer_ids], dim=-1)
    fed = torch.cat(fed, dim=1)
    stats = draft.generation_stats
    assert len(stats["proposals"]) > 1
    # The draft has read every verified token before the anchor of its last step (a final step with no room left
    # for proposals does not draft, so what it verified is never fed).
    last_draft = max(i for i, step in enumerate(stats["policy"]) if step["source"] == "draft")
    assert fed.shape[1] == out.shape[1] - 1 - sum(stats["acceptance_lengths"][last_draft:])
    torch.testing.assert_close(fed, expected[:, : fed.shape[1]], rtol=1e-4, atol=1e-4)


def record_forward_kwargs(target):
    seen = []
    handle = target.register_forward_pre_hook(lambda module, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    return seen, handle


@pytest.mark.parametrize("name,selective", [("remote_toyseek", False), ("vlm_remote_toyseek", False),
                                            ("deepseek_v3", True), ("qwen3_moe", True)])
def test_verify_forwards_ask_only_for_the_chosen_layers(zoo, name, selective):
    """Targets that can select get `output_hidden_states=[t + 1, ...]`; the others are not asked for any states
    (hooks read the chosen layers), so no target ever materialises all of its hidden states."""
    target = zoo.get(name)
    draft = random_dflash(target, num_layers=1, layer_ids=[0, 2], block_size=4)
    seen, handle = record_forward_kwargs(target)
    try:
        greedy(target, PROMPTS[0], 12, None, assistant_model=draft)
    finally:
        handle.remove()
    assert len(seen) == draft.generation_stats["target_forwards"] > 1
    for kwargs in seen:
        assert kwargs.get("output_hidden_states") == ([1, 3] if selective else None)


# -- finding the pieces --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,path", [("remote_toyseek", "model.layers"), ("llava", "model.language_model.layers"),
                                       ("vlm_remote_toyseek", "language_model.model.layers"),
                                       ("offloaded_llama", "model.layers")])
def test_decoder_layers_are_found_on_nested_models(zoo, name, path):
    target = zoo.get(name)
    expected = target.get_submodule(path)
    assert find_decoder_layers(target) is expected
    assert len(expected) == NUM_LAYERS


def test_decoder_layers_under_an_unusual_name_are_found_and_ambiguity_is_reported():
    target = tiny_target("llama", vocab_size=VOCAB)
    layers = target.model.layers
    del target.model.layers
    target.model.blocks = layers
    assert find_decoder_layers(target) is layers
    target.model.adapters = nn.ModuleList(nn.Identity() for _ in range(NUM_LAYERS))
    with pytest.raises(ValueError, match="decoder layers"):
        find_decoder_layers(target)


def test_offloaded_target_really_is_offloaded(zoo):
    """Guard for the device-map cases above: some layers live on disk and run through accelerate hooks."""
    for name in ("offloaded_llama", "offloaded_remote_toyseek", "offloaded_llama_head_on_disk"):
        target = zoo.get(name)
        placements = set(target.hf_device_map.values())
        assert {"cpu", "disk"} <= placements, target.hf_device_map
        last = target.model.layers[-1]
        assert hasattr(last, "_hf_hook") and next(last.parameters()).device.type == "meta"
    assert zoo.get("offloaded_llama_head_on_disk").lm_head.weight.device.type == "meta"
