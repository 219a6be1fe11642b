"""Each generate call owns its generator, capture and books: output options, threads sharing one draft, failures
part-way, and the transformers API the hook wraps."""

import subprocess
import sys
import threading

import pytest
import torch
from transformers import GenerationConfig, GenerationMixin

from dflash_hf import generation_dflash
from dflash_hf.generation_dflash import PATCHED_METHODS, DFlashCandidateGenerator, check_patchable
from tiny import random_dflash, random_dspark, tiny_target


def hook_count(target) -> int:
    """Forward hooks on the target's modules: what a leaked capture would leave behind. transformers installs its
    own output-recording hooks on the first forward that records hidden states, so that one runs first."""
    with torch.no_grad():
        target(torch.tensor([[1, 2]]), output_hidden_states=True)
    return sum(len(module._forward_hooks) for module in target.modules())


@pytest.fixture(params=["outputs", "hooks"])
def capture_mode(request):
    return request.param


def test_return_dict_with_every_hidden_state(capture_mode):
    """Item 4: `return_dict_in_generate` + `output_hidden_states` used to crash inside transformers; now it returns
    the target's own hidden states and the call's stats on the output."""
    target = tiny_target("qwen3")
    draft = random_dflash(target, layer_ids=[1, 2])
    draft.capture_mode = capture_mode
    ids = torch.tensor([[1, 5, 7, 9]])
    plain = target.generate(ids, do_sample=False, max_new_tokens=12, return_dict_in_generate=True,
                            output_hidden_states=True)
    hooks = hook_count(target)
    ours = target.generate(ids, do_sample=False, max_new_tokens=12, return_dict_in_generate=True,
                           output_hidden_states=True, assistant_model=draft)
    assert torch.equal(ours.sequences, plain.sequences)
    # One tuple per generated token, each with every layer (embeddings + 4 layers), as plain generate gives.
    assert len(ours.hidden_states) == len(plain.hidden_states) == 12
    assert all(len(step) == target.config.num_hidden_layers + 1 for step in ours.hidden_states)
    assert ours.generation_stats is draft.generation_stats
    assert sum(ours.generation_stats["acceptance_lengths"]) == 11  # the prefill emits the first token
    assert hook_count(target) == hooks


def test_a_failing_bind_leaves_no_hook_on_the_target():
    """Item 5: `bind_target` raising (here: a target whose lm_head is not what the draft borrows) must not leave
    recording hooks on the target, call after call."""
    target = tiny_target("llama")
    draft = random_dflash(target, layer_ids=[1, 2])
    draft.capture_mode = "hooks"
    hooks = hook_count(target)
    head = target.lm_head
    target.lm_head = torch.nn.Linear(32, 50, bias=False)  # the wrong vocabulary
    try:
        for _ in range(3):
            with pytest.raises(ValueError, match="lm_head has shape"):
                target.generate(torch.tensor([[1, 5, 7]]), assistant_model=draft, max_new_tokens=4, do_sample=False)
            assert hook_count(target) == hooks
    finally:
        target.lm_head = head


def test_a_failing_step_closes_the_capture(monkeypatch):
    """A draft that raises mid-generation: the error reaches the caller and the hooks are gone."""
    target = tiny_target("llama")
    draft = random_dflash(target, layer_ids=[1, 2])
    draft.capture_mode = "hooks"

    def broken(*args, **kwargs):
        raise RuntimeError("draft broke")

    monkeypatch.setattr(draft, "propose", broken)
    hooks = hook_count(target)
    with pytest.raises(RuntimeError, match="draft broke"):
        target.generate(torch.tensor([[1, 5, 7]]), assistant_model=draft, max_new_tokens=6, do_sample=False)
    assert hook_count(target) == hooks


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_threads_sharing_one_draft_get_exact_outputs_and_their_own_stats(capture_mode, kind):
    """Item 6: two threads generating with one draft and one target, at once. Each output equals the target alone,
    each call's stats describe that call (tau >= 1, as many tokens emitted as generated) and no hook survives."""
    target = tiny_target("qwen3", vocab_size=16)
    draft = random_dflash(target, layer_ids=[1, 2]) if kind == "dflash" else random_dspark(target, layer_ids=[1, 2])
    draft.capture_mode = capture_mode
    prompts = [torch.tensor([[1, 5, 7, 3]]), torch.tensor([[4, 9, 2, 11, 6, 13, 8]])]
    new_tokens = [40, 33]
    expected = [target.generate(p, do_sample=False, max_new_tokens=n) for p, n in zip(prompts, new_tokens)]
    hooks = hook_count(target)
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def run(i):
        try:
            barrier.wait()
            for _ in range(3):
                out = target.generate(prompts[i], do_sample=False, max_new_tokens=new_tokens[i],
                                      assistant_model=draft, return_dict_in_generate=True)
                results.setdefault(i, []).append(out)
        except Exception as error:  # noqa: BLE001  reported below, in the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for i in range(2):
        for out in results[i]:
            assert torch.equal(out.sequences, expected[i])
            stats = out.generation_stats
            emitted = out.sequences.shape[1] - prompts[i].shape[1]
            assert sum(stats["acceptance_lengths"]) == emitted - 1
            assert stats["mean_acceptance_length"] >= 1.0
            assert stats["target_forwards"] == len(stats["acceptance_lengths"]) + 1
    assert hook_count(target) == hooks


def test_per_call_block_size_leaves_the_draft_config_alone():
    """`GenerationConfig(dflash_block_size=N)` drafts N-token blocks for that call only."""
    target = tiny_target("llama")
    draft = random_dflash(target, block_size=6, layer_ids=[1, 2])
    ids = torch.tensor([[1, 5, 7]])
    expected = target.generate(ids, do_sample=False, max_new_tokens=10)
    config = GenerationConfig(do_sample=False, max_new_tokens=10, dflash_block_size=3)
    out = target.generate(ids, generation_config=config, assistant_model=draft)
    assert torch.equal(out, expected)
    assert max(len(p) for p in draft.generation_stats["proposals"]) == 2  # block 3: anchor + 2 proposals
    assert draft.config.block_size == 6
    with pytest.raises(ValueError, match="dflash_block_size"):
        target.generate(ids, generation_config=GenerationConfig(max_new_tokens=4, dflash_block_size=1),
                        assistant_model=draft)


def test_our_settings_are_generate_keyword_arguments():
    """`generate(..., dflash_block_size=3, dflash_policy="fixed")` as transformers takes its own settings; a misspelt
    one is still refused by name."""
    target = tiny_target("llama")
    draft = random_dflash(target, block_size=6, layer_ids=[1, 2])
    ids = torch.tensor([[1, 5, 7]])
    expected = target.generate(ids, do_sample=False, max_new_tokens=10)
    out = target.generate(ids, do_sample=False, max_new_tokens=10, assistant_model=draft, dflash_block_size=3,
                          dflash_policy="fixed")
    assert torch.equal(out, expected)
    assert [step["k"] for step in draft.generation_stats["policy"]][:3] == [2, 2, 2]  # fixed: full blocks of 3
    assert target.generation_config.dflash_block_size is None  # this call only
    with pytest.raises(ValueError, match="dflash_polcy"):
        target.generate(ids, max_new_tokens=4, assistant_model=draft, dflash_polcy="fixed")


def test_the_wrapped_generation_api_is_checked():
    """The installed transformers has every method and parameter the hook wraps; a release without them is named,
    with its version and the method."""
    check_patchable()  # the installed version
    assert sorted(PATCHED_METHODS) == ["_assisted_decoding", "_get_candidate_generator"]
    for name in PATCHED_METHODS:
        assert getattr(getattr(GenerationMixin, name), "_dflash_hook", False), name
    for name in ("_prepare_generation_config", "_validate_generation_mode", "_sample"):
        assert not hasattr(getattr(GenerationMixin, name), "_dflash_hook"), name  # left as transformers has them

    class Renamed:
        def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor,
                                     model_kwargs, assistant=None):
            pass

    class FrozenConfig:
        def update(self, defaults_only=False):
            pass

    import transformers

    with pytest.raises(RuntimeError) as error:
        check_patchable(Renamed, FrozenConfig)
    message = str(error.value)
    assert f"transformers {transformers.__version__}" in message
    assert "`GenerationMixin._assisted_decoding` is missing" in message
    assert "`GenerationMixin._get_candidate_generator` has no parameter(s) assistant_model" in message
    assert "`GenerationConfig.update` takes no keyword arguments" in message
    assert generation_dflash.install_generate_hook  # the hook stays installed for the supported version


def test_hook_capture_records_only_its_own_threads_forwards():
    """The ownership rule behind item 6, without relying on a race: a forward run by another thread (another
    generate call on the shared target) leaves this capture untouched."""
    target = tiny_target("llama")
    capture = generation_dflash.TargetStateCapture(target, [1, 2], "hooks")
    try:
        other = threading.Thread(target=lambda: target(torch.tensor([[1, 2, 3]])))
        other.start()
        other.join()
        assert capture._captured == {}
        target(torch.tensor([[1, 2, 3]]))
        assert set(capture._captured) == {1, 2}
    finally:
        capture.close()


@pytest.mark.parametrize("lookup,expected", [(0, 5), (3, 5), (9, 9)])
def test_num_drafting_tokens_is_the_longest_proposal_a_step_can_make(lookup, expected):
    """transformers >= 5.25 keeps this many recurrent states for rollback: a block's slots (6 - 1 for the DFlash
    layout), or the prompt-lookup length when larger."""
    target = tiny_target("llama")
    draft = random_dflash(target, block_size=6, layer_ids=[1, 2])
    config = GenerationConfig(prompt_lookup_num_tokens=lookup or None, max_length=64)
    generator = DFlashCandidateGenerator(draft, target, config, input_ids=torch.tensor([[1, 5, 7]]))
    try:
        assert generator.num_drafting_tokens == expected
    finally:
        generator.capture.close()


def test_the_hook_is_installed_by_a_draft_not_by_importing_its_code(tmp_path):
    """Remote code without the package: importing the saved `modeling_dflash.py` changes nothing in transformers;
    loading the draft installs the hook, and `generate` then drafts with it."""
    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    random_dflash(target, layer_ids=[1, 2]).save_pretrained(tmp_path / "draft")
    script = f"""
import json, pathlib, sys, torch
from transformers import AutoModelForCausalLM, GenerationMixin
from transformers.dynamic_module_utils import get_class_from_dynamic_module
folder = {str(tmp_path / "draft")!r}
auto_map = json.loads(pathlib.Path(folder, "config.json").read_text())["auto_map"]
cls = get_class_from_dynamic_module(auto_map["AutoModel"], folder)
assert "dflash_hf" not in sys.modules
assert not hasattr(GenerationMixin._get_candidate_generator, "_dflash_hook")
draft = cls.from_pretrained(folder)
assert GenerationMixin._get_candidate_generator._dflash_hook and GenerationMixin._assisted_decoding._dflash_hook
target = AutoModelForCausalLM.from_pretrained({str(tmp_path / "target")!r})
ids = torch.tensor([[1, 5, 7]])
expected = target.generate(ids, do_sample=False, max_new_tokens=8)
assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=8, assistant_model=draft), expected)
assert draft.generation_stats["draft_forwards"] > 0
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


def _recurrent_targets():
    from transformers import MambaConfig, MambaForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    yield MambaForCausalLM(MambaConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, state_size=4,
                                       intermediate_size=64, conv_kernel=4)).eval()
    yield Qwen3NextForCausalLM(Qwen3NextConfig(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)).eval()


@pytest.mark.parametrize("batch", [1, 2])
def test_targets_with_recurrent_layers_are_refused_by_name(batch):
    """transformers >= 5.25 assists stateful targets (it keeps recurrent states to roll back); block speculation does
    not roll them back yet, so such a target is refused, naming its layer types, before anything runs. (Before 5.25
    transformers' own check refuses stateful models first.)"""
    import transformers
    from packaging.version import Version

    ours = "linear_attention.*cannot be cropped back"
    expected = ours if Version(transformers.__version__) >= Version("5.25") else f"{ours}|stateful models"
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])[:batch]
    for target in _recurrent_targets():
        draft = random_dflash(target, layer_ids=[0, 1], block_size=4)
        with pytest.raises(ValueError, match=expected):
            target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4,
                            assistant_model=draft)
