"""Kernel checks that need the Triton interpreter; run them through `tests/test_kernels.py`.

Triton decides at import whether its own library is interpreted, so this module runs in a process started with
TRITON_INTERPRET=1 (the launcher in test_kernels.py does that); the rest of the suite keeps compiled Triton. The
interpreter has no bf16 arithmetic: bf16 cases draw bf16-representable values and run them in fp32.
"""

import json
import logging
import os

import pytest
import torch
from transformers import GenerationConfig
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import draft_fields, random_dflash, random_dflash2, random_dspark, tiny_target

from dflash_hf import DFlashConfig, DFlashDraftModel, kernels_dflash
from dflash_hf.kernels import KERNEL_SOURCE, reference_ops, write_hub_repo
from dflash_hf.layers_dflash import DFlashContextCache, DFlashRMSNorm

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from process start: run tests/test_kernels.py", allow_module_level=True)

REF = reference_ops()
HYPOTHESIS = settings(max_examples=25, deadline=None, derandomize=True,
                      suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
BIG_VOCAB = 163840


@pytest.fixture(autouse=True)
def kernels_unset(monkeypatch):
    monkeypatch.delenv("DFLASH_KERNELS", raising=False)


@pytest.fixture(scope="module")
def ops():
    """The kernel module as the draft loads it (the shipped copy, through `kernels.get_local_kernel`)."""
    path = kernels_dflash.load_kernels("on", torch.device("cpu"))
    assert path is not None and path.source == "local"
    return path.module


def sample(shape, dtype, generator, scale=1.0):
    """Random values representable in `dtype`, returned in fp32 (what the interpreter computes in)."""
    return (torch.randn(shape, generator=generator) * scale).to(dtype).float()


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------------------------------
# Each kernel against its reference
# ---------------------------------------------------------------------------------------------------------------------


@HYPOTHESIS
@given(rows=st.integers(1, 5), width=st.sampled_from([1, 7, 33, 64, 255, 576, 9001]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_rms_norm(ops, rows, width, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x, weight = sample((rows, width), dtype, g, 3.0), sample((width,), dtype, g)
    close(ops.rms_norm(x, weight, 1e-6), REF.rms_norm(x, weight, 1e-6))


def test_rms_norm_reference_is_the_model_norm():
    norm = DFlashRMSNorm(24, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, 24).to(dtype)
        assert torch.equal(REF.rms_norm(x, norm.weight.to(dtype), 1e-5), norm.to(dtype)(x))


@HYPOTHESIS
@given(layers=st.integers(1, 3), batch=st.integers(1, 2), length=st.integers(1, 9),
       hidden=st.sampled_from([8, 37, 64, 75]), kv_heads=st.integers(1, 3), head_dim=st.sampled_from([4, 8, 16, 128]),
       bias=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_context_kv(ops, layers, batch, length, hidden, kv_heads, head_dim, bias, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    width = kv_heads * head_dim
    x = sample((batch, length, hidden), dtype, g)
    k_weight, v_weight = (sample((layers, width, hidden), dtype, g, hidden**-0.5) for _ in range(2))
    k_bias, v_bias = (sample((layers, width), dtype, g) if bias else None for _ in range(2))
    norm_weight = sample((layers, head_dim), dtype, g)
    angles = torch.rand(batch, length, head_dim // 2, generator=g) * 6.0
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    args = (x, k_weight, v_weight, k_bias, v_bias, norm_weight, cos, sin, 1e-6)
    keys, values = ops.context_kv(*args)
    ref_keys, ref_values = REF.context_kv(*args)
    assert keys.shape == (layers, batch, kv_heads, length, head_dim)
    close(keys, ref_keys, 1e-4)
    close(values, ref_values, 1e-4)


@pytest.mark.parametrize("bias,heads,kv_heads", [(False, 4, 2), (True, 4, 1), (False, 4, 4)])
def test_context_kv_reference_is_the_model_projection(bias, heads, kv_heads):
    """The stacked reference reproduces each layer's `project_kv` exactly (GQA ratios 2, 4 and 1)."""
    target = tiny_target("qwen3")
    fields = {**draft_fields(target, num_layers=3), "attention_bias": bias, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads}
    draft = spread(DFlashDraftModel(DFlashConfig(**fields)).eval())
    context = torch.randn(2, 5, 32)
    cos, sin = draft.rotary_emb(torch.arange(3, 8)[None].expand(2, -1), torch.float32)
    stacked = kernels_dflash.stacked_kv_weights(draft.layers, {})
    keys, values = REF.context_kv(context, *stacked, cos, sin, draft.config.rms_norm_eps)
    for layer in draft.layers:
        k, v = layer.self_attn.project_kv(context, cos, sin)
        torch.testing.assert_close(keys[layer.self_attn.layer_idx], k, rtol=0, atol=1e-6)
        torch.testing.assert_close(values[layer.self_attn.layer_idx], v, rtol=0, atol=1e-6)


def assert_same_draw(got, want, weights, uniforms):
    """Equal draws, or a rounding tie: u * total sits on the CDF boundary between the two picks (fp64 check)."""
    for row in (got != want).nonzero()[:, 0].tolist():
        cdf = weights[row].double().cumsum(0)
        target = float(uniforms[row]) * float(cdf[-1])
        low, high = sorted((int(got[row]), int(want[row])))
        assert abs(float(cdf[low]) - target) <= 1e-4 * float(cdf[-1]), (row, low, high)
        assert float(cdf[high - 1] - cdf[low]) <= 1e-4 * float(cdf[-1]), (row, low, high)


def markov_case(batch, num, vocab, draft_vocab, rank, hidden, g, markov=True, conf=True, conf_markov=True,
                conf_bias=True):
    kept = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
    return dict(
        base_logits=torch.randn(batch, num, draft_vocab, generator=g) * 2.0,
        hidden=torch.randn(batch, num, hidden, generator=g),
        anchor_ids=torch.randint(0, vocab, (batch,), generator=g),
        w1=torch.randn(vocab, rank, generator=g) if markov else None,
        w2=torch.randn(draft_vocab, rank, generator=g) if markov else None,
        d2t=kept - torch.arange(draft_vocab) if draft_vocab < vocab else None,
        conf_weight=(torch.randn(hidden + (rank if markov and conf_markov else 0), generator=g) * 0.3
                     if conf else None),
        conf_bias=torch.randn(1, generator=g) if conf and conf_bias else None,
    )


def assert_walk(ops, case, uniforms, temperature, conf_with_markov, return_logits):
    args = (*case.values(), uniforms, temperature, conf_with_markov, return_logits)
    ids, logits, confidence, survival = ops.markov_walk(*args)
    ref_ids, ref_logits, ref_confidence, ref_survival = REF.markov_walk(*args)
    if uniforms is None:
        assert torch.equal(ids, ref_ids)
        valid = ids.shape[1]
    else:
        # A rounding tie at one slot changes every later slot (they condition on it): compare up to the first one.
        mismatch = (ids != ref_ids).int()
        valid = int(mismatch.argmax(1).min()) if bool(mismatch.any()) else ids.shape[1]
        if valid < ids.shape[1]:
            row = int(mismatch[:, valid].argmax())
            kept = torch.arange(ref_logits.shape[-1])
            back = kept + case["d2t"] if case["d2t"] is not None else kept
            got, want = (torch.searchsorted(back, t[row:row + 1, valid]) for t in (ids, ref_ids))
            weights = torch.exp(ref_logits[row:row + 1, valid] - ref_logits[row:row + 1, valid].amax(-1, keepdim=True))
            assert_same_draw(got, want, weights, uniforms[row:row + 1, valid])
    if return_logits:
        close(logits[:, :valid], ref_logits[:, :valid], 1e-4)
    else:
        assert logits.numel() == 0
    if case["conf_weight"] is not None:
        close(confidence[:, :valid], ref_confidence[:, :valid])
        close(survival[:, :valid], ref_survival[:, :valid])
    else:
        assert confidence.numel() == 0 and survival.numel() == 0


@HYPOTHESIS
@given(batch=st.integers(1, 2), num=st.sampled_from([8, 16]), draft_vocab=st.sampled_from([5, 97, 1000]),
       pruned=st.booleans(), rank=st.sampled_from([1, 4, 16]), hidden=st.sampled_from([7, 32, 96]),
       markov=st.booleans(), conf=st.booleans(), conf_markov=st.booleans(), conf_bias=st.booleans(),
       sampled=st.booleans(), temperature=st.sampled_from([1.0, 0.7]), return_logits=st.booleans(),
       seed=st.integers(0, 2**16))
def test_markov_walk(ops, batch, num, draft_vocab, pruned, rank, hidden, markov, conf, conf_markov, conf_bias, sampled,
                     temperature, return_logits, seed):
    g = torch.Generator().manual_seed(seed)
    vocab = draft_vocab * 3 + 1 if pruned else draft_vocab
    case = markov_case(batch, num, vocab, draft_vocab, rank, hidden, g, markov, conf, conf_markov, conf_bias)
    uniforms = torch.rand(batch, num, generator=g) if sampled else None
    assert_walk(ops, case, uniforms, temperature, conf_markov, return_logits)


def test_markov_walk_big_vocab(ops):
    """Kimi-K2.6 DSpark's shape of vocabulary: 32000 kept of 163840, block 8."""
    g = torch.Generator().manual_seed(0)
    case = markov_case(1, 8, BIG_VOCAB, 32000, 8, 64, g)
    assert_walk(ops, case, None, 1.0, True, False)


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("draft_vocab,rank,max_chunks", [(4000, 64, None), (3000, 16, 3)])
def test_markov_walk_split_over_chunks(ops, monkeypatch, sampled, draft_vocab, rank, max_chunks):
    """The split argmax and split inverse CDF: 32 one-tile chunks per slot, or 3 chunks of two tiles (the last one
    short) with the chunk count capped."""
    if max_chunks is not None:
        monkeypatch.setattr(ops._markov, "MAX_CHUNKS", max_chunks)
    g = torch.Generator().manual_seed(draft_vocab)
    case = markov_case(2, 4, draft_vocab * 2, draft_vocab, rank, 32, g)
    uniforms = torch.rand(2, 4, generator=g) if sampled else None
    assert_walk(ops, case, uniforms, 0.7, True, True)


def selector_case(batch, num, top_k, rank, vocab, dtype, g):
    unary, candidates = (torch.randn(batch, num, vocab, generator=g) * 2.0).topk(top_k, -1)
    return dict(unary=unary, candidates=candidates, projected=sample((batch, num, rank), dtype, g),
                predecessor=sample((vocab, rank), dtype, g), successor=sample((vocab, rank), dtype, g, rank**-0.5),
                anchor_ids=torch.randint(0, vocab, (batch,), generator=g))


def assert_selector_walk(ops, case, uniforms, temperature, return_scores):
    """Equal picks, or a rounding tie at a row's first differing slot (later slots condition on it); the scores
    equal up to there."""
    args = (*case.values(), uniforms, temperature)
    ids, scores = ops.selector_walk(*args, return_scores)
    ref_ids, ref_scores = REF.selector_walk(*args, True)
    assert ids.shape == ref_ids.shape and (scores.shape == ref_scores.shape if return_scores else scores.numel() == 0)
    for row in range(ids.shape[0]):
        differ = (ids[row] != ref_ids[row]).nonzero()
        first = int(differ[0, 0]) if len(differ) else ids.shape[1]
        if return_scores:
            close(scores[row, : first + 1], ref_scores[row, : first + 1], 1e-4)
        if first == ids.shape[1]:
            continue
        cands, s = case["candidates"][row, first], ref_scores[row, first]
        got, want = (int((cands == t[row, first]).nonzero()[0, 0]) for t in (ids, ref_ids))
        if uniforms is None:
            assert abs(float(s[got] - s[want])) <= 1e-4 * max(1.0, abs(float(s[want]))), (row, first)
        else:
            assert_same_draw(torch.tensor([got]), torch.tensor([want]), torch.exp(s - s.max())[None],
                             uniforms[row : row + 1, first])


@HYPOTHESIS
@given(batch=st.integers(1, 3), num=st.sampled_from([1, 7, 15]), top_k=st.sampled_from([1, 2, 16, 17]),
       rank=st.sampled_from([1, 7, 64, 256]), vocab=st.sampled_from([40, 1000]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), sampled=st.booleans(),
       temperature=st.sampled_from([1.0, 0.7]), return_scores=st.booleans(), seed=st.integers(0, 2**16))
def test_selector_walk(ops, batch, num, top_k, rank, vocab, dtype, sampled, temperature, return_scores, seed):
    g = torch.Generator().manual_seed(seed)
    case = selector_case(batch, num, top_k, rank, vocab, dtype, g)
    uniforms = torch.rand(batch, num, generator=g) if sampled else None
    assert_selector_walk(ops, case, uniforms, temperature, return_scores)


@pytest.mark.parametrize("sampled", [False, True])
def test_selector_walk_released_draft_shape(ops, sampled):
    """z-lab/Qwen3.8-27B-DFlash2's selector: vocabulary 248320, rank 256, top-16, block 8 (7 slots)."""
    g = torch.Generator().manual_seed(1)
    case = selector_case(1, 7, 16, 256, 248320, torch.float32, g)
    uniforms = torch.rand(1, 7, generator=g) if sampled else None
    assert_selector_walk(ops, case, uniforms, 1.0, True)


# ---------------------------------------------------------------------------------------------------------------------
# The draft's dispatch: kernels on against kernels off, on our own models
# ---------------------------------------------------------------------------------------------------------------------


def spread(draft, std=0.3, seed=0):
    """Wider random weights than the init's 0.02, so argmaxes are clear-cut and proposals vary."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, std)
    return draft


def with_kernels(monkeypatch, mode, fn):
    monkeypatch.setenv("DFLASH_KERNELS", mode)
    return fn()


def propose_twice(draft, context, anchor, **kwargs):
    cache = DFlashContextCache()
    first = draft.propose(context, anchor, cache, **kwargs)
    next_anchor = first.draft_ids[:, 0] if first.draft_ids.shape[1] else anchor
    second = draft.propose(context[:, :2], next_anchor, cache, **kwargs)
    return first, second, cache


def test_dflash_forward_kernels_match_torch(monkeypatch):
    target = tiny_target("qwen3")
    # A small RoPE base makes block positions differ, so the proposals vary and their equality means something.
    draft = spread(random_dflash(target, block_size=8, num_layers=2, rope_theta=10.0))
    draft.bind_target(target)
    context = torch.randn(1, 5, draft.fc.in_features)
    anchor = torch.tensor([7])
    off = with_kernels(monkeypatch, "0", lambda: propose_twice(draft, context, anchor))
    on = with_kernels(monkeypatch, "1", lambda: propose_twice(draft, context, anchor))
    assert draft.__dict__["_kernel_path"] is not None
    for a, b in zip(off[:2], on[:2]):
        assert torch.equal(a.draft_ids, b.draft_ids)
    assert len(set(off[0].draft_ids[0].tolist())) > 1  # the check can fail: proposals vary
    for a, b in zip(off[2].keys + off[2].values, on[2].keys + on[2].values):
        close(a, b, 1e-5)


@pytest.mark.parametrize("pruned,sample_from_anchor,conf_markov,threshold", [
    (False, False, True, None), (True, True, True, None), (True, False, False, 0.3), (False, True, True, 0.9),
])
def test_dspark_walk_kernels_match_torch(monkeypatch, pruned, sample_from_anchor, conf_markov, threshold):
    target = tiny_target("qwen3")
    extra = {"draft_vocab_size": 40} if pruned else {}
    draft = random_dspark(target, block_size=8, sample_from_anchor=sample_from_anchor,
                          confidence_head_with_markov=conf_markov, **extra)
    if pruned:
        kept = torch.sort(torch.randperm(96, generator=torch.Generator().manual_seed(1))[:40]).values
        t2d = torch.zeros(96, dtype=torch.bool)
        t2d[kept] = True
        draft.set_vocab_mapping(kept - torch.arange(40), t2d)
    spread(draft)
    draft.bind_target(target)
    context = torch.randn(1, 6, draft.fc.in_features)
    anchor = torch.tensor([11])
    kwargs = dict(need_logits=True, confidence_threshold=threshold)
    off = with_kernels(monkeypatch, "0", lambda: propose_twice(draft, context, anchor, **kwargs))
    on = with_kernels(monkeypatch, "1", lambda: propose_twice(draft, context, anchor, **kwargs))
    for a, b in zip(off[:2], on[:2]):
        assert torch.equal(a.draft_ids, b.draft_ids)
        assert a.draft_logits.shape == b.draft_logits.shape
        finite = torch.isfinite(a.draft_logits)
        assert torch.equal(finite, torch.isfinite(b.draft_logits))
        close(b.draft_logits[finite], a.draft_logits[finite], 1e-4)
        close(b.confidence, a.confidence)
    if threshold is not None:  # the early stop was exercised (0.3: mid-block, 0.9: before the first slot)
        assert off[0].draft_ids.shape[1] < draft.config.num_speculative_slots


def test_dflash2_walk_kernels_match_torch(monkeypatch):
    """Greedy: the same proposals and q with kernels on and off. Sampled (other draws than torch's): the kernel's q
    is, slot by slot, the torch walk's scores along the kernel's own picks, over the temperature."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    from dflash_hf import modeling_dflash2
    from dflash_hf.modeling_dflash2 import scatter_candidates, selector_walk

    launched = []
    dispatch = modeling_dflash2.selector_walk_kernel
    monkeypatch.setattr(modeling_dflash2, "selector_walk_kernel",
                        lambda *args: launched.append(dispatch(*args)) or launched[-1])
    target = tiny_target("qwen3")
    draft = spread(random_dflash2(target, block_size=8, num_layers=2, rope_theta=10.0, selector_top_k=6))
    draft.bind_target(target)
    context = torch.randn(1, 6, draft.fc.in_features)
    anchor = torch.tensor([11])
    off = with_kernels(monkeypatch, "0", lambda: propose_twice(draft, context, anchor, need_logits=True))
    on = with_kernels(monkeypatch, "1", lambda: propose_twice(draft, context, anchor, need_logits=True))
    assert draft.__dict__["_kernel_path"] is not None
    for a, b in zip(off[:2], on[:2]):
        assert torch.equal(a.draft_ids, b.draft_ids)
        finite = torch.isfinite(a.draft_logits)
        assert torch.equal(finite, torch.isfinite(b.draft_logits)) and int(finite[0, 0].sum()) == 6
        close(b.draft_logits[finite], a.draft_logits[finite], 1e-4)
    assert len(set(off[0].draft_ids[0].tolist())) > 1  # the check can fail: proposals vary

    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7)])
    sampled = with_kernels(monkeypatch, "1", lambda: draft.propose(
        context, anchor, DFlashContextCache(), do_sample=True, need_logits=True, logits_processor=processors,
        prefix_ids=anchor[None]))
    hidden = draft.block_hidden(context, anchor, DFlashContextCache())[:, 1:]
    selector = draft.candidate_selector
    unary, candidates = selector.candidates(draft.logits(hidden).float())
    prev = torch.cat([anchor[:, None], sampled.draft_ids[:, :-1]], 1)
    _, scores = selector_walk(unary, candidates, selector.hidden_projection(hidden), selector.predecessor_codebook,
                              selector.successor_codebook, prev)
    expected = scatter_candidates(scores / 0.7, candidates, draft.config.vocab_size)
    finite = torch.isfinite(expected)
    assert [walked is not None for walked in launched] == [False, False, True, True, True]  # torch twice, then Triton
    assert torch.equal(finite, torch.isfinite(sampled.draft_logits))
    close(sampled.draft_logits[finite], expected[finite], 1e-4)
    assert bool(finite.gather(-1, sampled.draft_ids[..., None]).all())  # each pick is one of its slot's candidates


def test_dflash2_generation_identical_with_kernels(monkeypatch):
    target = tiny_target("qwen3")
    draft = spread(random_dflash2(target, block_size=4, num_layers=2, rope_theta=10.0))
    proposals = recording(draft)
    prompt = torch.tensor([[1, 5, 7, 9, 11, 13]])
    fixed = GenerationConfig(dflash_policy="fixed")  # full blocks every step, whatever the timings
    runs = {}
    for mode in ("0", "1"):
        proposals.clear()
        out = with_kernels(monkeypatch, mode, lambda: target.generate(
            prompt, assistant_model=draft, max_new_tokens=10, do_sample=False, generation_config=fixed))
        runs[mode] = (out, list(proposals), draft.generation_stats["kernels"])
    assert torch.equal(runs["0"][0], runs["1"][0])
    assert len(runs["0"][1]) == len(runs["1"][1]) > 1
    assert all(torch.equal(a, b) for a, b in zip(runs["0"][1], runs["1"][1]))
    assert any(len(set(ids[0].tolist())) > 1 for ids in runs["0"][1])  # varied proposals: the check can fail
    assert (runs["0"][2], runs["1"][2]) == ("torch", "triton:local")


def recording(draft):
    proposals = []
    propose = draft.propose

    def record(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        proposals.append(proposal.draft_ids.clone())
        return proposal

    draft.propose = record
    return proposals


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_generation_identical_with_kernels(monkeypatch, kind):
    target = tiny_target("qwen3")
    make = random_dflash if kind == "dflash" else random_dspark
    draft = spread(make(target, block_size=4, num_layers=2, rope_theta=10.0))
    proposals = recording(draft)
    prompt = torch.tensor([[1, 5, 7, 9, 11, 13]])
    runs = {}
    for mode in ("0", "1"):
        proposals.clear()
        out = with_kernels(monkeypatch, mode, lambda: target.generate(
            prompt, assistant_model=draft, max_new_tokens=10, do_sample=False,
            generation_config=GenerationConfig(dflash_policy="fixed")))  # a block every step, on both paths
        runs[mode] = (out, list(proposals), dict(draft.generation_stats))
    assert torch.equal(runs["0"][0], runs["1"][0])
    assert len(runs["0"][1]) == len(runs["1"][1]) > 1
    assert all(torch.equal(a, b) for a, b in zip(runs["0"][1], runs["1"][1]))
    assert any(len(set(ids[0].tolist())) > 1 for ids in runs["0"][1])  # varied proposals: the check can fail
    assert runs["0"][2]["acceptance_lengths"] == runs["1"][2]["acceptance_lengths"]
    assert runs["0"][2]["kernels"] == "torch"
    assert runs["1"][2]["kernels"] == "triton:local"


# ---------------------------------------------------------------------------------------------------------------------
# Failures, and the Hub layout loaded the way the Hub loads it
# ---------------------------------------------------------------------------------------------------------------------


def test_failing_kernel_falls_back_in_auto_and_raises_when_on(ops, caplog):
    bad = (torch.randn(1, 2, 8), torch.randn(1, 8, 8), torch.randn(1, 8, 8), torch.randn(1, 8), None,
           torch.randn(1, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8), 1e-6)  # k_bias without v_bias
    strict = kernels_dflash.KernelPath(ops, "test-kind", "local", strict=True)
    with pytest.raises(ValueError, match="k_bias and v_bias"):
        strict("context_kv", *bad)
    lenient = kernels_dflash.KernelPath(ops, "test-kind", "local", strict=False)
    with caplog.at_level(logging.WARNING, logger=kernels_dflash.__name__):
        assert lenient("context_kv", *bad) is None
    assert lenient.failed and "using torch from now on" in caplog.text
    assert kernels_dflash._kernel_modules.pop("test-kind")[0] is None


def test_hub_repo_loads_with_get_local_kernel(tmp_path):
    from kernels import get_local_kernel

    repo = write_hub_repo(tmp_path / "repo")
    assert (repo / "README.md").read_text().startswith("---")
    for variant, backend in (("torch-cuda", "cuda"), ("torch-cpu", "cpu")):
        metadata = json.loads((repo / "build" / variant / "metadata.json").read_text())
        assert metadata["backend"]["type"] == backend and metadata["version"] == kernels_dflash.KERNELS_VERSION
        assert {p.name for p in (repo / "build" / variant).glob("*.py")} == {p.name for p in KERNEL_SOURCE.glob("*.py")}
    module = get_local_kernel(repo)
    assert module.API_VERSION == kernels_dflash.KERNELS_VERSION
    case = markov_case(2, 8, 300, 120, 4, 16, torch.Generator().manual_seed(0))
    assert_walk(module, case, None, 1.0, True, False)
    x, weight = torch.randn(3, 40), torch.randn(40)
    close(module.rms_norm(x, weight, 1e-6), REF.rms_norm(x, weight, 1e-6))
