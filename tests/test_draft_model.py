"""The draft forward against the published DFlash/DSpark math, written out naively here on the same weights."""

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_hf import DFlashConfig, DFlashContextCache, DFlashDraftModel, DSparkConfig, DSparkDraftModel

H, HT, VOCAB = 32, 24, 50


def make_draft(num_layers=1, heads=4, kv_heads=2, cls=DFlashDraftModel, config_cls=DFlashConfig, seed=0, **extra):
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=40, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8, target_hidden_size=HT,
        num_target_layers=6, target_layer_ids=[1, 3], block_size=5, mask_token_id=VOCAB - 1,
        rope_theta=10000.0, shares_target_embeddings=False, **extra,
    )
    model = cls(config).eval()
    with torch.no_grad():  # non-trivial norms so a missing norm cannot pass
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1 + 0.3 * torch.randn_like(param))
    return model


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta, dim):
    """x: [T, heads, D] at integer positions pos [T]."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    half = dim // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def reference_block_hidden(model, context_states, block_ids, ctx_start=0):
    """z-lab DFlash math, one batch row, no cache: the context goes through fc + hidden_norm, its K/V through each
    layer's k_proj/k_norm/v_proj (not the layer's input norm), the block attends bidirectionally to all of it."""
    c = model.config
    eps = c.rms_norm_eps
    ctx = rms(context_states @ model.fc.weight.T, model.hidden_norm.weight, eps)
    n_ctx, b = ctx.shape[0], block_ids.shape[0]
    ctx_pos = torch.arange(ctx_start, ctx_start + n_ctx)
    blk_pos = torch.arange(ctx_start + n_ctx, ctx_start + n_ctx + b)
    x = model.embed_tokens.weight[block_ids]
    rep = c.num_attention_heads // c.num_key_value_heads
    for layer in model.layers:
        a = layer.self_attn
        h = rms(x, layer.input_layernorm.weight, eps)
        q = rms((h @ a.q_proj.weight.T).view(b, c.num_attention_heads, c.head_dim), a.q_norm.weight, eps)
        q = rope(q, blk_pos, c.rope_parameters["rope_theta"], c.head_dim)
        kv_in = torch.cat([ctx, h], 0)
        pos = torch.cat([ctx_pos, blk_pos])
        k = rms((kv_in @ a.k_proj.weight.T).view(-1, c.num_key_value_heads, c.head_dim), a.k_norm.weight, eps)
        k = rope(k, pos, c.rope_parameters["rope_theta"], c.head_dim)
        v = (kv_in @ a.v_proj.weight.T).view(-1, c.num_key_value_heads, c.head_dim)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(c.head_dim)
        if c.layer_types[layer.self_attn.layer_idx] == "sliding_attention":
            distance = blk_pos[:, None] - pos[None, :]
            allowed = distance.abs() < c.sliding_window
            if c.sliding_window_causal:
                allowed &= distance >= 0
            scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(b, -1)
        x = x + out @ a.o_proj.weight.T
        m = layer.mlp
        h2 = rms(x, layer.post_attention_layernorm.weight, eps)
        x = x + (F.silu(h2 @ m.gate_proj.weight.T) * (h2 @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return rms(x, model.norm.weight, eps)


def block(anchor, model):
    return torch.tensor([anchor] + [model.config.mask_token_id] * (model.config.block_size - 1))


@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
def test_block_hidden_matches_published_math(num_layers, heads, kv_heads):
    model = make_draft(num_layers, heads, kv_heads)
    torch.manual_seed(1)
    context = torch.randn(9, 2 * HT)
    ids = block(7, model)
    ours = model(model.embed(ids[None]), context[None]).last_hidden_state[0]
    torch.testing.assert_close(ours, reference_block_hidden(model, context, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
def test_cached_context_matches_published_math(num_layers, heads, kv_heads):
    """Context fed in two chunks through the cache equals the whole context at once (and the reference)."""
    model = make_draft(num_layers, heads, kv_heads)
    torch.manual_seed(2)
    context = torch.randn(11, 2 * HT)
    cache = DFlashContextCache()
    first = model.block_hidden(context[None, :6], torch.tensor([3]), cache)
    assert cache.get_seq_length() == 6
    second = model.block_hidden(context[None, 6:], torch.tensor([4]), cache)
    assert cache.get_seq_length() == 11  # block entries are never kept
    torch.testing.assert_close(first[0], reference_block_hidden(model, context[:6], block(3, model)), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second[0], reference_block_hidden(model, context, block(4, model)), atol=1e-5, rtol=1e-5)
    whole = model.block_hidden(context[None], torch.tensor([4]), DFlashContextCache())
    torch.testing.assert_close(second, whole, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window_layers(causal):
    model = make_draft(2, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                       sliding_window_causal=causal)
    context = torch.randn(9, 2 * HT)
    ids = block(7, model)
    ours = model(model.embed(ids[None]), context[None]).last_hidden_state[0]
    torch.testing.assert_close(ours, reference_block_hidden(model, context, ids), atol=1e-5, rtol=1e-5)


def make_dspark(head_type="vanilla", pruned=True, sample_from_anchor=False, seed=0):
    model = make_draft(2, cls=DSparkDraftModel, config_cls=DSparkConfig, seed=seed, markov_rank=6,
                       markov_head_type=head_type, enable_confidence_head=True, confidence_head_with_markov=True,
                       draft_vocab_size=20 if pruned else VOCAB, sample_from_anchor=sample_from_anchor)
    if pruned:
        # Kept ids all sit above 20, so no draft id equals its target id and a mix-up cannot pass.
        kept = torch.sort(torch.randperm(VOCAB - 25)[:20] + 25).values
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[kept] = True
        model.set_vocab_mapping(kept - torch.arange(20), t2d)
    return model


@torch.no_grad()
def reference_markov_walk(model, context, anchor, threshold=None):
    """Straightforward DSpark walk: bias from the previous *target* id, pruned logits scattered to the target vocab,
    confidence on [h_k ; W1[prev_k]], stop when survival < threshold."""
    c = model.config
    hidden = model(model.embed(block(anchor, model)[None]), context[None]).last_hidden_state[0]
    slots = hidden if c.sample_from_anchor else hidden[1:]
    head = model.markov_head
    d2t_ids = torch.arange(c.draft_vocab_size) + model.d2t
    prev, state, survival = anchor, torch.zeros(c.markov_rank), 1.0
    ids, confs, seen_prev = [], [], []
    for h in slots:
        seen_prev.append(prev)
        e = head.markov_w1.weight[prev]
        if c.markov_head_type == "vanilla":
            bias = head.markov_w2.weight @ e
        elif c.markov_head_type == "gated":
            g = torch.sigmoid(head.gate_proj.weight @ torch.cat([h, e]) + head.gate_proj.bias)
            bias = head.markov_w2.weight @ (g * e)
        else:
            z = head.joint_proj.weight @ torch.cat([state, e, h]) + head.joint_proj.bias
            g, cand, out = z.split(c.markov_rank)
            g = torch.sigmoid(g)
            state = g * state + (1 - g) * torch.tanh(cand)
            bias = head.markov_w2.weight @ torch.tanh(out)
        conf = torch.sigmoid(model.confidence_head.proj.weight[0] @ torch.cat([h, e]) + model.confidence_head.proj.bias[0])
        confs.append(conf)
        survival = survival * conf
        if threshold is not None and survival < threshold:
            break
        logits = model.lm_head.weight @ h + bias
        full = torch.full((c.vocab_size,), float("-inf"))
        full[d2t_ids] = logits
        prev = int(full.argmax())
        ids.append(prev)
    return ids, torch.stack(confs), seen_prev


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_dspark_walk_matches_reference(head_type, sample_from_anchor):
    model = make_dspark(head_type, sample_from_anchor=sample_from_anchor)
    context = torch.randn(7, 2 * HT)
    proposal = model.propose(context[None], torch.tensor([5]), DFlashContextCache())
    ids, confs, _ = reference_markov_walk(model, context, 5)
    assert proposal.draft_ids[0].tolist() == ids
    assert len(ids) == model.config.num_speculative_slots
    torch.testing.assert_close(proposal.confidence[0], confs, atol=1e-5, rtol=1e-5)
    assert bool(model.t2d[proposal.draft_ids[0]].all())  # only kept target ids are proposed


def test_dspark_feeds_target_ids_to_w1():
    """The Markov head must be indexed by target ids: perturb W1 at a kept target id and only walks that pass through
    it change."""
    model = make_dspark("vanilla")
    context = torch.randn(7, 2 * HT)
    ids = model.propose(context[None], torch.tensor([5]), DFlashContextCache()).draft_ids[0].tolist()
    target_id = ids[0]
    assert target_id >= 25  # a target id, never a draft-vocabulary index
    with torch.no_grad():
        model.markov_head.markov_w1.weight[target_id] += 25 * torch.randn(6)
    changed = model.propose(context[None], torch.tensor([5]), DFlashContextCache()).draft_ids[0].tolist()
    reference, _, seen = reference_markov_walk(model, context, 5)
    assert seen[1] == target_id
    assert changed[1:] != ids[1:]  # the perturbed row reaches the walk...
    assert changed == reference  # ...exactly as when W1 is indexed by target ids


def test_confidence_threshold_truncates_where_survival_drops():
    model = make_dspark("vanilla", seed=3)
    context = torch.randn(7, 2 * HT)
    _, confs, _ = reference_markov_walk(model, context, 5)
    survival = torch.cumprod(confs, 0)
    threshold = float((survival[1] + survival[2]) / 2)  # survives two slots, not three
    proposal = model.propose(context[None], torch.tensor([5]), DFlashContextCache(), confidence_threshold=threshold)
    assert proposal.draft_ids.shape[1] == 2
    assert proposal.draft_ids[0].tolist() == reference_markov_walk(model, context, 5, threshold)[0]


def test_dspark_without_markov_or_pruning_is_dflash():
    dflash = make_draft(2, seed=4)
    dspark = make_draft(2, cls=DSparkDraftModel, config_cls=DSparkConfig, seed=4, markov_rank=0)
    dspark.load_state_dict(dflash.state_dict(), strict=False)
    context = torch.randn(1, 6, 2 * HT)
    a = dflash.propose(context, torch.tensor([1]), DFlashContextCache(), need_logits=True)
    b = dspark.propose(context, torch.tensor([1]), DFlashContextCache(), need_logits=True)
    assert torch.equal(a.draft_ids, b.draft_ids)
    # Two code paths (DSpark passes its logits through the vocabulary mapping): float32 defaults of assert_close,
    # 1e-5 absolute / 1.3e-6 relative, a few ulp of logits of order 1.
    torch.testing.assert_close(a.draft_logits, b.draft_logits)


def test_pruned_logits_scatter_into_target_vocab():
    model = make_dspark("vanilla")
    draft_logits = torch.randn(1, 3, 20)
    full = model.to_target_logits(draft_logits)
    kept = model.t2d.nonzero()[:, 0]
    assert torch.equal(full[..., kept], draft_logits)  # a scatter copies values: bit for bit
    assert bool(torch.isinf(full[..., ~model.t2d]).all())


def test_borrowed_embeddings_are_the_targets():
    from tiny import random_dflash, tiny_target

    target = tiny_target("llama")
    draft = random_dflash(target)
    with pytest.raises(RuntimeError, match="bind_target"):
        draft.embed(torch.tensor([[1]]))
    draft.bind_target(target)
    # Lookups of the same float32 tensors, no arithmetic: bit for bit on every machine.
    assert torch.equal(draft.embed(torch.tensor([[3]]))[0, 0], target.get_input_embeddings().weight[3])
    assert torch.equal(draft.head_weight(), target.get_output_embeddings().weight)
    assert "lm_head.weight" not in draft.state_dict() and "embed_tokens.weight" not in draft.state_dict()


def test_transformers_dflash_cache_gives_the_same_block_states():
    """Under transformers' own DFlashCache (which stores the block and crops it next step) the draft computes what
    it computes with its context-only cache."""
    from transformers.cache_utils import DFlashCache

    model = make_draft(2)
    context = torch.randn(1, 11, 2 * HT)
    ours, theirs = DFlashContextCache(), DFlashCache(config=model.config)
    for chunk, anchor in ((slice(0, 6), 3), (slice(6, 11), 4)):
        embeds = model.embed(block(anchor, model)[None])
        expected = model(embeds, context[:, chunk], cache=ours).last_hidden_state
        if chunk.start:
            theirs.crop(-model.config.block_size)
        got = model(embeds, context[:, chunk], cache=theirs).last_hidden_state
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_random_draft_for_each_kind_fits_the_target_and_an_unknown_kind_is_named():
    from tiny import tiny_target

    from dflash_hf.defaults import random_draft_for

    target = tiny_target()
    names = {kind: type(random_draft_for(target, kind)).__name__ for kind in ("dflash", "dspark", "dflash2")}
    assert names == {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel", "dflash2": "DFlash2DraftModel"}
    draft = random_draft_for(target, "dflash2", block_size=4)
    ids = torch.randint(1, 50, (1, 6))
    plain = target.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(target.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None,
                                       assistant_model=draft), plain)
    with pytest.raises(ValueError, match="kind: unknown draft kind 'eagle'"):
        random_draft_for(target, "eagle")
