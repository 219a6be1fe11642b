"""The statistical check behind every "sampling keeps the target's distribution" test: the exact distribution of two
sampled tokens under the target alone, and a chi-square goodness of fit of what speculative generate sampled.

The draws are not reproducible across runs: the length policy `auto` chooses from measured wall-clock costs, and other
CPUs round differently. So each test is a real hypothesis test, and ALPHA is its false-failure rate per run: at 1e-3
a lossless path failed a CI run by chance (p = 3.4e-4, while 40,000 draws of the same test pooled gave p = 0.80).
At 1e-6 with RUNS = 2,000 the test keeps the power it had at 1e-3 with 1,000 draws (the chi-square's noncentrality
doubles with the draws), and the negative controls still fail (DFlash's landed at p = 1e-18 to 1e-26 over three
seeds of 1,000 draws).
"""

import torch
from transformers import (GenerationConfig, LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper)

SAMPLE_VOCAB = 6
SAMPLING = dict(do_sample=True, temperature=0.6, top_k=4, repetition_penalty=1.3)
PROMPT = [1, 3, 2]
RUNS = 2000
ALPHA = 1e-6


def exact_pair_distribution(target, prompt):
    """P(t2, t3) of the target alone under SAMPLING (t1 marginalised), from its logits and the same processors."""
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(SAMPLING["repetition_penalty"]),
                                      TemperatureLogitsWarper(SAMPLING["temperature"]),
                                      TopKLogitsWarper(SAMPLING["top_k"])])

    def next_probs(seq):
        ids = torch.tensor([seq])
        with torch.no_grad():
            return processors(ids, target(ids).logits[:, -1].float()).softmax(-1)[0].double()

    joint = torch.zeros(SAMPLE_VOCAB, SAMPLE_VOCAB, dtype=torch.float64)
    p1 = next_probs(prompt)
    for t1 in p1.nonzero()[:, 0].tolist():
        p2 = next_probs(prompt + [t1])
        for t2 in p2.nonzero()[:, 0].tolist():
            joint[t2] += p1[t1] * p2[t2] * next_probs(prompt + [t1, t2])
    return joint.flatten()


def sampled_pair_counts(target, draft, prompt=PROMPT, runs=RUNS, policy="fixed"):
    """(counts of (t2, t3) over `runs` speculative generations of 4 tokens under SAMPLING, proposals accepted)."""
    counts = torch.zeros(SAMPLE_VOCAB * SAMPLE_VOCAB, dtype=torch.float64)
    ids = torch.tensor([prompt])
    accepted = 0
    torch.manual_seed(0)
    config = GenerationConfig(dflash_policy=policy)
    for _ in range(runs):
        out = target.generate(ids, max_new_tokens=4, assistant_model=draft, generation_config=config,
                              **SAMPLING)[0, len(prompt):]
        counts[out[1] * SAMPLE_VOCAB + out[2]] += 1
        accepted += draft.generation_stats["accepted_tokens"]
    return counts, accepted


def chi_square_p_value(counts, probs):
    """Pearson chi-square goodness of fit, cells expecting fewer than 5 pooled."""
    expected = probs * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    return float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2, dtype=torch.float64), stat / 2))
