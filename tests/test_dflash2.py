"""DFlash 2: the forward and the candidate walk against the published math written out naively here on the same
weights, generation token-for-token identical to the target alone under greedy and distributed as the target under
sampling, and the config, registration and remote-code rules."""

import copy
import functools
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModel, GenerationConfig, LogitsProcessorList

from dflash_hf import DFlash2Config, DFlash2DraftModel, DFlashConfig, DFlashContextCache, DFlashDraftModel
from dflash_hf.kernels import reference_ops
from dflash_hf.modeling_dflash2 import grouped_dynamic_conv, selector_walk
from sampling_check import (ALPHA, PROMPT, RUNS, SAMPLE_VOCAB, chi_square_p_value, exact_pair_distribution,
                            sampled_pair_counts)
from tiny import draft_fields, make_successor_target, random_dflash2, tiny_target

H, HT, VOCAB = 32, 24, 50


def backbone_fields(num_layers=1, block_size=6, **extra):
    return dict(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=40, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, target_hidden_size=HT, num_target_layers=6, target_layer_ids=[1, 3],
        block_size=block_size, mask_token_id=VOCAB - 1, rope_theta=10000.0, shares_target_embeddings=False, **extra,
    )


def make_draft(num_layers=1, taps=2, group_size=8, rank=6, top_k=5, block_size=6, seed=0, **extra):
    """A DFlash 2 draft with its own embedding and head, every weight random (norms around 1)."""
    torch.manual_seed(seed)
    config = DFlash2Config(conv_kernel_size=taps, conv_group_size=group_size, selector_rank=rank, selector_top_k=top_k,
                           **backbone_fields(num_layers, block_size, **extra))
    model = DFlash2DraftModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn_like(param))
            elif "base_kernel" in name:
                param.copy_(torch.randn_like(param) * 0.7)
            elif "codebook" in name:
                param.copy_(torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) * 0.3)
    return model


# ---------------------------------------------------------------------------------------------------------------------
# The published math, naively (one batch row, python loops where the math has indices)
# ---------------------------------------------------------------------------------------------------------------------


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta, dim):
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    half = dim // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def naive_conv(x, dyn, base, group_size, block_len):
    """out[i, c] = sum_t (base[t, c] + dyn[i, t, c // group_size]) * x[i - t, c], nothing before i's block start.
    x: [L, H]; dyn: [L, T, G]; base: [T, H]."""
    length, hidden = x.shape
    out = torch.zeros_like(x)
    for i in range(length):
        block_start = (i // block_len) * block_len
        for t in range(base.shape[0]):
            if i - t < block_start:
                continue
            for c in range(hidden):
                out[i, c] += (base[t, c] + dyn[i, t, c // group_size]) * x[i - t, c]
    return out


def naive_around(conv, sublayer, normed, group_size):
    """z-lab's sublayer wrapping: both dynamic tap sets from the normed input, input conv, sublayer, output conv."""
    length = normed.shape[0]
    dyn = (normed @ conv.kernel_projection.weight.T).view(length, 2, conv.taps, conv.groups)
    inner = naive_conv(normed, dyn[:, 0], conv.base_kernel[0], group_size, length)
    return naive_conv(sublayer(inner), dyn[:, 1], conv.base_kernel[1], group_size, length)


def naive_block_hidden(model, context_states, block_ids):
    """DFlash 2 (z-lab dflash 0.1.0) for one block: DFlash's layer (the context projected once, not normed by the
    layer, the block bidirectional except in causal sliding layers) with the attention's input (the normed state)
    and output, and the MLP's, each convolved along the block."""
    c = model.config
    eps, gs = c.rms_norm_eps, c.conv_group_size
    ctx = rms(context_states @ model.fc.weight.T, model.hidden_norm.weight, eps)
    n_ctx, b = ctx.shape[0], block_ids.shape[0]
    ctx_pos, blk_pos = torch.arange(n_ctx), torch.arange(n_ctx, n_ctx + b)
    x = model.embed_tokens.weight[block_ids] * (c.input_embedding_scale or 1.0)
    rep = c.num_attention_heads // c.num_key_value_heads
    theta = c.rope_parameters["rope_theta"]
    for layer in model.layers:
        a = layer.self_attn

        def attention(h):
            q = rms((h @ a.q_proj.weight.T).view(b, c.num_attention_heads, c.head_dim), a.q_norm.weight, eps)
            q = rope(q, blk_pos, theta, c.head_dim)
            kv_in, pos = torch.cat([ctx, h], 0), torch.cat([ctx_pos, blk_pos])
            k = rms((kv_in @ a.k_proj.weight.T).view(-1, c.num_key_value_heads, c.head_dim), a.k_norm.weight, eps)
            k = rope(k, pos, theta, c.head_dim).repeat_interleave(rep, 1)
            v = (kv_in @ a.v_proj.weight.T).view(-1, c.num_key_value_heads, c.head_dim).repeat_interleave(rep, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(c.head_dim)
            if c.layer_types[a.layer_idx] == "sliding_attention":
                distance = blk_pos[:, None] - pos[None, :]
                allowed = distance.abs() < c.sliding_window
                if c.sliding_window_causal:
                    allowed &= distance >= 0
                scores = scores.masked_fill(~allowed, float("-inf"))
            return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(b, -1) @ a.o_proj.weight.T

        def mlp(h):
            m = layer.mlp
            return (F.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) @ m.down_proj.weight.T

        x = x + naive_around(layer.attention_conv, attention, rms(x, layer.input_layernorm.weight, eps), gs)
        x = x + naive_around(layer.mlp_conv, mlp, rms(x, layer.post_attention_layernorm.weight, eps), gs)
    return rms(x, model.norm.weight, eps)


def naive_logits(model, h):
    c = model.config
    logits = h @ model.lm_head.weight.T * (c.output_multiplier or 1.0)
    cap = c.final_logit_softcapping
    return cap * torch.tanh(logits / cap) if cap else logits


def naive_slot_q(model, h, prev, temperature=1.0):
    """The selector's distribution at one slot after `prev`, over the whole vocabulary (zero off the top-K)."""
    sel = model.candidate_selector
    logits = naive_logits(model, h)
    unary, cands = torch.topk(logits, sel.top_k)
    proj = sel.hidden_projection.weight @ h
    scores = torch.stack([
        unary[j] + sum(sel.predecessor_codebook[prev, r] * proj[r] * sel.successor_codebook[cands[j], r]
                       for r in range(proj.shape[0]))
        for j in range(sel.top_k)
    ])
    q = torch.zeros(logits.shape[0])
    q[cands] = torch.softmax(scores / temperature, 0)
    return q, scores, cands


def naive_greedy_walk(model, slots, anchor):
    prev, ids = anchor, []
    for h in slots:
        _, scores, cands = naive_slot_q(model, h, prev)
        prev = int(cands[int(scores.argmax())])
        ids.append(prev)
    return ids


def block(anchor, model, size=None):
    return torch.tensor([anchor] + [model.config.mask_token_id] * ((size or model.config.block_size) - 1))


# ---------------------------------------------------------------------------------------------------------------------
# Parity
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("taps,group_size,block_len", [(1, 4, 6), (2, 4, 6), (3, 16, 5), (4, 1, 3), (7, 8, 4)])
def test_conv_matches_the_formula(taps, group_size, block_len):
    """Every tap, group and block boundary: several blocks back to back (training's layout) convolve as each block
    alone, taps reaching before a block's start read zeros, the dynamic weight is the output position's."""
    torch.manual_seed(taps)
    num_blocks, hidden = 3, 16
    x = torch.randn(2, num_blocks * block_len, hidden)
    dyn = torch.randn(2, num_blocks * block_len, taps, hidden // group_size)
    base = torch.randn(taps, hidden)
    ours = grouped_dynamic_conv(x, dyn, base, block_len)
    for row in range(2):
        torch.testing.assert_close(ours[row], naive_conv(x[row], dyn[row], base, group_size, block_len),
                                   atol=1e-5, rtol=1e-5)
    one = grouped_dynamic_conv(x[:, :block_len], dyn[:, :block_len], base)  # one block: block_len defaults to L
    torch.testing.assert_close(one, ours[:, :block_len], atol=0, rtol=0)
    with pytest.raises(ValueError, match="whole blocks"):
        grouped_dynamic_conv(x[:, 1:], dyn[:, 1:], base, block_len)


@pytest.mark.parametrize("num_layers,taps,group_size", [(1, 2, 8), (2, 3, 4), (3, 1, 32)])
def test_block_hidden_matches_published_math(num_layers, taps, group_size):
    model = make_draft(num_layers, taps, group_size)
    torch.manual_seed(1)
    context = torch.randn(7, 2 * HT)
    ids = block(11, model)
    ours = model(model.embed(ids[None]), context[None]).last_hidden_state[0]
    torch.testing.assert_close(ours, naive_block_hidden(model, context, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window_layers(causal):
    model = make_draft(2, 3, 8, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                       sliding_window_causal=causal)
    context = torch.randn(9, 2 * HT)
    ids = block(7, model)
    ours = model(model.embed(ids[None]), context[None]).last_hidden_state[0]
    torch.testing.assert_close(ours, naive_block_hidden(model, context, ids), atol=1e-4, rtol=1e-4)


def test_cached_context_and_the_transformers_cache_match_published_math():
    """Context fed in two chunks through our cache, and through transformers' DFlashCache (whose block K/V the draft
    projects from the convolved input), both give the reference."""
    from transformers.cache_utils import DFlashCache

    model = make_draft(2, 2, 8)
    context = torch.randn(11, 2 * HT)
    ours, theirs = DFlashContextCache(), DFlashCache(config=model.config)
    for chunk, anchor in ((slice(0, 6), 3), (slice(6, 11), 4)):
        ids = block(anchor, model)
        expected = naive_block_hidden(model, context[: chunk.stop], ids)
        got = model(model.embed(ids[None]), context[None, chunk], cache=ours).last_hidden_state[0]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        if chunk.start:
            theirs.crop(-model.config.block_size)
        got = model(model.embed(ids[None]), context[None, chunk], cache=theirs).last_hidden_state[0]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("top_k,rank", [(1, 3), (5, 6), (VOCAB, 4)])
def test_greedy_walk_matches_published_math(top_k, rank):
    model = make_draft(2, rank=rank, top_k=top_k, seed=top_k)
    context = torch.randn(1, 8, 2 * HT)
    proposal = model.propose(context, torch.tensor([9]), DFlashContextCache())
    slots = naive_block_hidden(model, context[0], block(9, model))[1:]
    assert proposal.draft_ids[0].tolist() == naive_greedy_walk(model, slots, 9)
    assert len(set(proposal.draft_ids[0].tolist())) > 1 or top_k == 1  # the check can fail: proposals vary


def test_walk_reads_the_previous_pick():
    """Perturb P at the first proposed id: slot 0 (after the anchor) keeps its pick, later slots follow the reference,
    which indexes P by the token picked before each slot."""
    model = make_draft(1, top_k=8, seed=5)
    context = torch.randn(1, 8, 2 * HT)
    ids = model.propose(context, torch.tensor([9]), DFlashContextCache()).draft_ids[0].tolist()
    assert ids[0] != 9
    slots = naive_block_hidden(model, context[0], block(9, model))[1:]
    moved = 0
    for trial in range(6):
        with torch.no_grad():
            model.candidate_selector.predecessor_codebook[ids[0]] = torch.randn(
                6, generator=torch.Generator().manual_seed(trial)) * 30
        changed = model.propose(context, torch.tensor([9]), DFlashContextCache()).draft_ids[0].tolist()
        assert changed[0] == ids[0]
        assert changed == naive_greedy_walk(model, slots, 9)
        moved += changed[1] != ids[1]
    assert moved  # the perturbed row reached the walk


@pytest.mark.parametrize("seed", range(4))
def test_sampled_walk_draws_from_and_returns_its_q(seed):
    """With a seed, the walk draws what the naive walk draws from the same distributions; its draft_logits are, per
    slot, exactly that distribution (softmax of the candidate scores over temperature, zero off the K)."""
    from transformers import TemperatureLogitsWarper

    model = make_draft(2, top_k=6, seed=10 + seed)
    context, anchor, temperature = torch.randn(1, 8, 2 * HT), 9, 0.8
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    torch.manual_seed(seed)
    proposal = model.propose(context, torch.tensor([anchor]), DFlashContextCache(), do_sample=True, need_logits=True,
                             logits_processor=processors, prefix_ids=torch.tensor([[anchor]]))
    slots = naive_block_hidden(model, context[0], block(anchor, model))[1:]
    torch.manual_seed(seed)
    prev, drawn = anchor, []
    for k, h in enumerate(slots):
        q, _, cands = naive_slot_q(model, h, prev, temperature)
        torch.testing.assert_close(proposal.draft_logits[0, k].softmax(-1), q, atol=1e-5, rtol=1e-5)
        assert bool(torch.isinf(proposal.draft_logits[0, k][q == 0]).all())  # zero off the candidates
        prev = int(torch.multinomial(q[None], 1)[0, 0])
        drawn.append(prev)
    assert proposal.draft_ids[0].tolist() == drawn


def test_walk_with_fixed_uniforms_matches_inverse_cdf():
    """The walk the kernel reference runs (uniforms in, inverse CDF over the K candidates) against the naive one."""
    model = make_draft(1, top_k=7, seed=3)
    context = torch.randn(1, 8, 2 * HT)
    hidden = model(model.embed(block(4, model)[None]), context).last_hidden_state[:, 1:]
    logits = model.logits(hidden).float()
    unary, cands = model.candidate_selector.candidates(logits)
    sel = model.candidate_selector
    uniforms = torch.rand(1, hidden.shape[1], generator=torch.Generator().manual_seed(0))
    ids, scores = reference_ops().selector_walk(unary, cands, sel.hidden_projection(hidden), sel.predecessor_codebook,
                                                sel.successor_codebook, torch.tensor([4]), uniforms, 0.7, True)
    prev = 4
    for k, h in enumerate(hidden[0]):
        q, naive_scores, naive_cands = naive_slot_q(model, h, prev, 0.7)
        torch.testing.assert_close(scores[0, k], naive_scores / 0.7, atol=1e-5, rtol=1e-5)
        assert torch.equal(cands[0, k], naive_cands)
        cdf = torch.cumsum(q[naive_cands], 0)
        prev = int(naive_cands[int((cdf <= uniforms[0, k] * cdf[-1]).sum())])
        assert int(ids[0, k]) == prev


def test_teacher_forced_walk_scores_every_slot_at_once():
    """What training reads: given the true previous tokens, the scores of each slot's candidates."""
    model = make_draft(1, top_k=4, seed=2)
    hidden = torch.randn(2, 5, H)
    sel = model.candidate_selector
    unary, cands = sel.candidates(model.logits(hidden).float())
    prev = torch.randint(0, VOCAB, (2, 5))
    ids, scores = selector_walk(unary, cands, sel.hidden_projection(hidden), sel.predecessor_codebook,
                                sel.successor_codebook, prev)
    assert ids is None
    for row in range(2):
        for k in range(5):
            _, naive, _ = naive_slot_q(model, hidden[row, k], int(prev[row, k]))
            torch.testing.assert_close(scores[row, k], naive, atol=1e-5, rtol=1e-5)


def test_embedding_scale_multiplier_and_softcap():
    """z-lab 0.1.0's optional fields: the block's embeddings scaled, the logits multiplied then soft-capped; DFlash
    drafts read them too."""
    model = make_draft(1, seed=6, input_embedding_scale=1.7, output_multiplier=0.6, final_logit_softcapping=2.5)
    context = torch.randn(7, 2 * HT)
    ids = block(2, model)
    hidden = model(model.embed(ids[None]), context[None]).last_hidden_state[0]
    expected = naive_block_hidden(model, context, ids)
    torch.testing.assert_close(hidden, expected, atol=1e-4, rtol=1e-4)
    logits = model.logits(hidden)
    torch.testing.assert_close(logits, naive_logits(model, expected), atol=1e-4, rtol=1e-4)
    assert float(logits.detach().abs().max()) < 2.5  # capped...
    assert float(naive_logits(model, expected).detach().abs().max()) > 0.5 * 2.5  # ...where capping bends the logits

    dflash = DFlashDraftModel(DFlashConfig(**backbone_fields(), input_embedding_scale=1.7, output_multiplier=0.6,
                                           final_logit_softcapping=2.5))
    raw = F.linear(hidden, dflash.lm_head.weight)
    torch.testing.assert_close(dflash.logits(hidden), 2.5 * torch.tanh(raw * 0.6 / 2.5))
    assert torch.equal(dflash.embed(ids[None])[0], dflash.embed_tokens.weight[ids] * 1.7)


def test_identity_initialised_dflash2_is_dflash():
    """Untrained convolutions are identities, and a selector with zero codebooks picks the argmax: on DFlash's
    weights, DFlash 2 proposes what DFlash proposes."""
    target = tiny_target("qwen3")
    fields = draft_fields(target, block_size=6, num_layers=2)
    torch.manual_seed(0)
    dflash = DFlashDraftModel(DFlashConfig(**fields)).eval()
    dflash2 = DFlash2DraftModel(DFlash2Config(conv_group_size=8, selector_rank=4, selector_top_k=3, **fields)).eval()
    missing = dflash2.load_state_dict(dflash.state_dict(), strict=False).missing_keys
    assert all("_conv." in name or "candidate_selector." in name for name in missing) and missing
    with torch.no_grad():
        dflash2.candidate_selector.predecessor_codebook.zero_()
    for draft in (dflash, dflash2):
        draft.bind_target(target)
    context = torch.randn(1, 6, dflash.fc.in_features)
    a = dflash.block_hidden(context, torch.tensor([5]), DFlashContextCache())
    b = dflash2.block_hidden(context, torch.tensor([5]), DFlashContextCache())
    assert torch.equal(a, b)
    assert torch.equal(dflash.propose(context, torch.tensor([5]), DFlashContextCache()).draft_ids,
                       dflash2.propose(context, torch.tensor([5]), DFlashContextCache()).draft_ids)


def test_per_call_block_size_and_max_slots():
    model = make_draft(1, seed=4)
    context = torch.randn(1, 8, 2 * HT)
    full = model.propose(context, torch.tensor([9]), DFlashContextCache()).draft_ids
    assert full.shape[1] == model.config.block_size - 1
    assert torch.equal(model.propose(context, torch.tensor([9]), DFlashContextCache(), max_slots=2).draft_ids,
                       full[:, :2])
    short = model.propose(context, torch.tensor([9]), DFlashContextCache(), block_size=3).draft_ids
    slots = naive_block_hidden(model, context[0], block(9, model, 3))[1:]
    assert short[0].tolist() == naive_greedy_walk(model, slots, 9)


def test_a_processor_that_bans_every_candidate_falls_back_to_the_full_logits():
    model = make_draft(1, top_k=3, seed=8)
    context = torch.randn(1, 8, 2 * HT)
    hidden = model(model.embed(block(9, model)[None]), context).last_hidden_state[:, 1:]
    banned = model.candidate_selector.candidates(model.logits(hidden).float())[1].flatten().unique()

    def ban(input_ids, scores):
        return scores.index_fill(-1, banned, float("-inf"))

    proposal = model.propose(context, torch.tensor([9]), DFlashContextCache(), do_sample=True, need_logits=True,
                             logits_processor=LogitsProcessorList([ban]), prefix_ids=torch.tensor([[9]]))
    assert not bool(torch.isin(proposal.draft_ids, banned).any())
    expected = ban(None, model.logits(hidden).float())  # the processed full draft logits are each slot's q
    torch.testing.assert_close(proposal.draft_logits.softmax(-1), expected.softmax(-1))


# ---------------------------------------------------------------------------------------------------------------------
# Config, registration, remote code
# ---------------------------------------------------------------------------------------------------------------------

BASE = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_target_layers=6)


@pytest.mark.parametrize("fields,named", [
    ({"conv_kernel_size": 0}, "conv_kernel_size"),
    ({"conv_group_size": 5}, "conv_group_size"),
    ({"conv_group_size": 0}, "conv_group_size"),
    ({"selector_rank": -1}, "selector_rank"),
    ({"selector_top_k": 65}, "selector_top_k"),
    ({"selector_top_k": 0}, "selector_top_k"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
    ({"output_multiplier": float("nan")}, "output_multiplier"),
    ({"input_embedding_scale": "2"}, "input_embedding_scale"),
])
def test_bad_dflash2_config_names_the_field(fields, named):
    with pytest.raises(ValueError, match=f"`{named}`"):
        DFlash2Config(**{**BASE, **fields})


def test_saved_config_must_state_the_dflash2_fields():
    raw = DFlash2Config(**BASE, conv_group_size=8).to_dict()
    assert AutoConfig.for_model("dflash2").__class__ is DFlash2Config
    assert DFlash2Config.from_dict(raw).conv_group_size == 8
    for field in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        with pytest.raises(ValueError, match=f"`{field}`"):
            DFlash2Config.from_dict({k: v for k, v in raw.items() if k != field})


def test_checkpoint_names_are_zlabs(tmp_path):
    """The tensors z-lab's released DFlash 2 drafts hold, under the same names (codebooks without `.weight`)."""
    target = tiny_target("llama")
    draft = random_dflash2(target, num_layers=2)
    names = set(draft.state_dict())
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            assert {f"layers.{i}.{conv}.base_kernel", f"layers.{i}.{conv}.kernel_projection.weight"} <= names
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight"} <= names
    assert draft.state_dict()["layers.0.attention_conv.base_kernel"].shape == (2, 2, 32)
    assert draft.state_dict()["layers.0.mlp_conv.kernel_projection.weight"].shape == (2 * 2 * 4, 32)
    draft.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert type(loaded) is DFlash2DraftModel
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_remote_code_files_import_only_torch_and_transformers():
    from transformers.dynamic_module_utils import get_imports

    from dflash_hf import configuration_dflash2, modeling_dflash2

    for module in (configuration_dflash2, modeling_dflash2):
        assert set(get_imports(module.__file__)) - set(sys.stdlib_module_names) <= {"torch", "transformers"}


# ---------------------------------------------------------------------------------------------------------------------
# Generation: greedy exactness
# ---------------------------------------------------------------------------------------------------------------------

SMALL_VOCAB = 16
FAMILIES = ["llama", "qwen3", "deepseek_v3"]
# Full blocks every step ("fixed"), or the cost-based length policy ("auto", which on this CPU mostly decodes when a
# random draft is rarely right).
POLICY = {name: GenerationConfig(dflash_policy=name) for name in ("fixed", "auto")}


@functools.cache
def random_pair(family: str):
    target = tiny_target(family, vocab_size=SMALL_VOCAB)
    return target, random_dflash2(target, num_layers=2, layer_ids=[0, 2], selector_top_k=5,
                                  conv_kernel_size=3 if family == "qwen3" else 2)


@functools.cache
def random_pruned_pair(family: str):
    """`random_pair`'s draft proposing from 11 of the 16 ids (its candidates are the top-5 of those)."""
    target, draft = random_pair(family)
    pruned = copy.deepcopy(draft)
    pruned.prune_vocabulary([0, 1, 2, 3, 5, 6, 8, 9, 11, 12, 14])
    return target, pruned


@functools.cache
def successor_target(family: str):
    """The family's tiny target made to say `current + 1` (mod vocabulary) greedily."""
    torch.manual_seed(7)
    return make_successor_target(tiny_target(family, vocab_size=SMALL_VOCAB))


def oracle_dflash2(target, block_size: int, wrong_after=()):
    """A DFlash 2 draft whose selector alone encodes the successor target's rule (next = current + 1; after a token
    in `wrong_after`, current + 2): flat draft logits put every token among the candidates, the layers add nothing
    (every slot's state is the normed MASK embedding) and the codebooks score `succ(prev)` 1000, the rest 0."""
    draft = random_dflash2(target, block_size=block_size, selector_top_k=SMALL_VOCAB, selector_rank=SMALL_VOCAB,
                           shares_target_embeddings=False)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "o_proj" in name or "down_proj" in name or name == "lm_head.weight":
                param.zero_()
        slot_state = draft.norm(draft.embed(torch.tensor([draft.config.mask_token_id])))[0]
        selector = draft.candidate_selector
        selector.hidden_projection.weight.copy_(slot_state.expand(SMALL_VOCAB, -1) / slot_state.square().sum())
        selector.predecessor_codebook.copy_(torch.eye(SMALL_VOCAB))
        successor = torch.zeros(SMALL_VOCAB, SMALL_VOCAB)
        for prev in range(SMALL_VOCAB):
            successor[(prev + (2 if prev in wrong_after else 1)) % SMALL_VOCAB, prev] = 1000.0
        selector.successor_codebook.copy_(successor)
    return draft


def greedy(target, ids, **kwargs):
    return target.generate(ids, do_sample=False, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_greedy_is_exact(family, data):
    """A random draft (rarely right: rejections at every slot) or the successor oracle, wrong after a few tokens
    (long accepted runs, cut by EOS inside the run and by max_new_tokens mid-block), on each target family."""
    block_size = data.draw(st.integers(2, 12), label="block_size")
    if data.draw(st.booleans(), label="oracle"):
        target = successor_target(family)
        wrong = data.draw(st.sets(st.integers(0, SMALL_VOCAB - 1), max_size=4), label="wrong_after")
        draft = oracle_dflash2(target, block_size, tuple(sorted(wrong)))
    else:
        pruned = data.draw(st.booleans(), label="pruned vocabulary")
        target, draft = (random_pruned_pair if pruned else random_pair)(family)
        draft.config.block_size = block_size
    policy = data.draw(st.sampled_from(["fixed", "fixed", "auto"]), label="policy")
    prompt = data.draw(st.lists(st.integers(3, SMALL_VOCAB - 1), min_size=1, max_size=10), label="prompt")
    max_new = data.draw(st.integers(1, 48), label="max_new_tokens")
    ids = torch.tensor([prompt])
    free = greedy(target, ids, max_new_tokens=max_new, eos_token_id=None)[0, len(prompt):].tolist()
    # EOS: a token the target will produce (cutting the run there) or one it never produces.
    eos = data.draw(st.sampled_from(free + [SMALL_VOCAB - 1]), label="eos")
    expected = prompt + (free[: free.index(eos) + 1] if eos in free else free)
    got = greedy(target, ids, max_new_tokens=max_new, eos_token_id=eos, assistant_model=draft,
                 generation_config=POLICY[policy])
    assert got[0].tolist() == expected
    stats = draft.generation_stats
    assert sum(stats["acceptance_lengths"]) + 1 == got.shape[1] - len(prompt)  # +1: the prefill's token


@pytest.mark.parametrize("family", FAMILIES)
def test_oracle_draft_is_fully_accepted(family):
    target = successor_target(family)
    ids = torch.tensor([[4, 5]])
    draft = oracle_dflash2(target, block_size=6)
    expected = greedy(target, ids, max_new_tokens=1 + 6 * 4, eos_token_id=None)
    assert expected[0, 2:8].tolist() == [6, 7, 8, 9, 10, 11]
    got = greedy(target, ids, max_new_tokens=1 + 6 * 4, eos_token_id=None, assistant_model=draft,
                 generation_config=POLICY["fixed"])
    assert torch.equal(got, expected)
    assert draft.generation_stats["acceptance_lengths"] == [6] * 4  # tau == block_size


def test_bf16_draft_with_fp32_target():
    target = tiny_target("qwen3", vocab_size=SMALL_VOCAB)
    draft = random_dflash2(target, block_size=6, selector_top_k=5).to(torch.bfloat16)
    ids = torch.tensor([[3, 9, 4]])
    out = greedy(target, ids, max_new_tokens=20, eos_token_id=None, assistant_model=draft,
                 generation_config=POLICY["fixed"])
    assert torch.equal(out, greedy(target, ids, max_new_tokens=20, eos_token_id=None))
    assert draft.generation_stats["drafted_tokens"] > 0


def test_transformers_builtin_dflash_path_runs_a_dflash2_draft():
    """transformers' own `speculation_type="dflash"` drives our forward through its DFlashCache (no selector there:
    it takes its own argmax), still exactly."""
    target, draft = random_pair("llama")
    draft.config.block_size = 4
    ids = torch.tensor([[3, 9, 4, 11]])
    expected = greedy(target, ids, max_new_tokens=24, eos_token_id=None)
    got = greedy(target, ids, max_new_tokens=24, eos_token_id=None, assistant_model=draft, speculation_type="dflash")
    assert torch.equal(got, expected)


# ---------------------------------------------------------------------------------------------------------------------
# Generation: sampling keeps the target's distribution
# ---------------------------------------------------------------------------------------------------------------------

@functools.cache
def sampling_pair(kept_ids: tuple | None = None):
    torch.manual_seed(3)
    target = tiny_target("llama", vocab_size=SAMPLE_VOCAB)
    target.generation_config.eos_token_id = None
    with torch.no_grad():
        target.lm_head.weight.mul_(10)
    # K = 3 of 6: q lives on the candidates only, and the selector's scores (not the raw logits) decide within them.
    draft = random_dflash2(target, block_size=4, seed=5, selector_top_k=3, selector_rank=4, spread=1.0)
    if kept_ids is not None:
        draft.prune_vocabulary(kept_ids)
    return target, draft


@pytest.mark.parametrize("kept_ids", [None, (0, 2, 3, 5)], ids=["full", "pruned"])
def test_sampling_matches_the_target_distribution(kept_ids):
    """Pruned: the candidates are the top 3 of the 4 kept ids, mapped to target ids before the codebooks."""
    target, draft = sampling_pair(kept_ids)
    counts, accepted = sampled_pair_counts(target, draft)
    assert accepted > RUNS // 4  # rejection sampling really accepted proposals
    assert chi_square_p_value(counts, exact_pair_distribution(target, PROMPT)) > ALPHA


def test_sampling_negative_control_fails(monkeypatch):
    """The same check rejects a q that is not the walk's (uniform over the candidates, while the tokens come from
    the selector's scores)."""
    target, draft = sampling_pair()
    propose = draft.propose

    def wrong_q(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        logits = proposal.draft_logits
        proposal.draft_logits = torch.where(torch.isinf(logits), logits, torch.zeros_like(logits))
        return proposal

    monkeypatch.setattr(draft, "propose", wrong_q)
    counts, _ = sampled_pair_counts(target, draft)
    assert chi_square_p_value(counts, exact_pair_distribution(target, PROMPT)) < ALPHA
