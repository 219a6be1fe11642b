"""The corpus's continuously refilled batch answers every prompt as the target alone would."""

import torch
from tiny import tiny_target

from dflash_hf.training.continuous_batching import continuous_generate

MAX_NEW = 10


def sharp_target():
    """A tiny random target whose attention is peaked (random init leaves it near uniform, blind to positions and to
    what the mask hides), so a wrong position or an unmasked pad column changes its answers."""
    target = tiny_target(seed=3)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.q_proj.weight.mul_(12)
            layer.self_attn.k_proj.weight.mul_(12)
    return target


def prompts_and_eos(target):
    """Prompts of 2-12 tokens, and an EOS set taken from their greedy answers so rows end at different steps."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (2 + (5 * n) % 11,), generator=generator).tolist() for n in range(9)]
    free = continuous_generate(target, prompts, MAX_NEW, eos=set(), batch_size=len(prompts))
    return prompts, {free[0][2], free[4][5]}


def alone(target, prompt, eos):
    out = target.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=sorted(eos),
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_refilled_rows_answer_greedily_as_each_prompt_alone():
    target = sharp_target()
    prompts, eos = prompts_and_eos(target)
    expected = [alone(target, p, eos) for p in prompts]
    assert 0 < sum(len(a) < MAX_NEW for a in expected) < len(prompts)  # some rows end early, the batch refills
    for batch_size in (1, 3, 4):
        assert continuous_generate(target, prompts, MAX_NEW, eos, batch_size) == expected


def test_sampled_rows_draw_from_the_seeded_generator_and_greedy_rows_stay_exact():
    target = sharp_target()
    prompts, eos = prompts_and_eos(target)
    greedy = continuous_generate(target, prompts, MAX_NEW, eos, batch_size=3)
    sampled = [n % 2 == 1 for n in range(len(prompts))]

    def draw(seed):
        return continuous_generate(target, prompts, MAX_NEW, eos, 3, sampled, temperature=5.0, top_p=0.95, seed=seed)

    first, again, other = draw(0), draw(0), draw(1)
    assert first == again and first != other
    assert all(a == g for a, g, s in zip(first, greedy, sampled) if not s)
    assert any(a != g for a, g, s in zip(first, greedy, sampled) if s)
    assert all(0 < len(a) <= MAX_NEW and all(t not in eos for t in a[:-1]) for a in first)
