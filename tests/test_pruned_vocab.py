"""A full-vocabulary DFlash or DFlash 2 draft pruned after training (`prune_vocabulary`, `dflash-hf prune-vocab`),
or a pruned one moved to another vocabulary (`vocabulary_copy`):
it proposes what the unpruned draft proposes with the other ids masked out, saves and loads as such, is trained further
over the whole vocabulary, and refuses what it cannot be. Generation with it stays exact: the pruned cases of
`test_generate.py` and `test_dflash2.py` (greedy and sampling)."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from dflash_hf import DFlashConfig, DFlashContextCache, cli
from dflash_hf.formats import export_draft, load_draft
from dflash_hf.modeling_dflash2 import scatter_candidates, selector_walk
from dflash_hf.training.corpus_shards import write_shard
from dflash_hf.training.trainer import vocabulary_copy
from tiny import draft_fields, random_dflash, random_dflash2, random_dspark, tiny_target
from tiny_pair import char_tokenizer, save_tiny_pair

VOCAB = 40
KEPT = [i for i in range(VOCAB) if i % 3]  # 26 ids, every third left out


def pair(kind: str, **extra):
    """(target, full draft, the same draft pruned to KEPT), both bound to the target."""
    target = tiny_target("llama", vocab_size=VOCAB)
    make = {"dflash": random_dflash, "dflash2": random_dflash2}[kind]
    full = make(target, block_size=6, num_layers=2, layer_ids=[0, 2], seed=1,
                **({"selector_top_k": 5} if kind == "dflash2" else {}), **extra)
    pruned = copy.deepcopy(full)
    pruned.prune_vocabulary(torch.tensor(KEPT)[torch.randperm(len(KEPT))])  # any order
    for draft in (full, pruned):
        draft.bind_target(target)
    return target, full, pruned


def block_inputs(draft, seed: int = 0):
    """Target states for 7 context tokens of 2 rows, and the rows' anchors."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, 7, draft.fc.in_features, generator=generator), torch.tensor([5, 17])


def propose(draft, context, anchors, **kwargs):
    return draft.propose(context, anchors, DFlashContextCache(), **kwargs)


def masked(logits: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(logits, float("-inf"))
    out[..., KEPT] = logits[..., KEPT]
    return out


def test_pruned_dflash_proposes_the_best_kept_id_with_the_full_drafts_logits():
    target, full, pruned = pair("dflash")
    context, anchors = block_inputs(full)
    want = masked(propose(full, context, anchors, need_logits=True).draft_logits)
    got = propose(pruned, context, anchors, need_logits=True)
    assert pruned.head_weight().shape == (len(KEPT), target.config.hidden_size)  # only the kept rows are computed
    torch.testing.assert_close(got.draft_logits, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.draft_ids, want.argmax(-1))
    assert torch.equal(propose(pruned, context, anchors).draft_ids, got.draft_ids)  # greedy without q: same ids
    assert not set(got.draft_ids.flatten().tolist()) - set(KEPT)


def test_pruned_dflash2_walks_the_top_k_of_the_kept_ids():
    target, full, pruned = pair("dflash2")
    context, anchors = block_inputs(full, seed=1)
    # The walk written out on the full draft's tensors: top-K of the masked logits, candidates as target ids.
    hidden = full.block_hidden(context, anchors, DFlashContextCache())[:, 1:]
    unary, candidates = masked(full.logits(hidden).float()).topk(5, dim=-1)
    selector = full.candidate_selector

    def greedy(k, scores, slot_candidates):
        pick = slot_candidates.gather(1, scores.argmax(-1, keepdim=True))[:, 0]
        return pick, scatter_candidates(scores, slot_candidates, VOCAB)

    want_ids, want_q = selector_walk(unary, candidates, selector.hidden_projection(hidden),
                                     selector.predecessor_codebook, selector.successor_codebook, anchors, greedy)
    got = propose(pruned, context, anchors, need_logits=True)
    assert torch.equal(got.draft_ids, want_ids)
    torch.testing.assert_close(got.draft_logits, want_q, rtol=1e-5, atol=1e-5)
    assert torch.equal(propose(pruned, context, anchors).draft_ids, want_ids)
    assert not set(want_ids.flatten().tolist()) - set(KEPT)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_save_and_load_keep_the_pruned_vocabulary(kind, tmp_path):
    target, _, pruned = pair(kind)
    pruned.save_pretrained(tmp_path / "draft")
    saved = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert (saved["vocab_size"], saved["draft_vocab_size"]) == (VOCAB, len(KEPT))
    context, anchors = block_inputs(pruned, seed=2)
    want = propose(pruned, context, anchors, need_logits=True)
    for loaded in (type(pruned).from_pretrained(tmp_path / "draft"), load_draft(tmp_path / "draft")):
        assert type(loaded) is type(pruned)
        assert loaded.t2d.nonzero()[:, 0].tolist() == KEPT
        loaded.bind_target(target)
        got = propose(loaded, context, anchors, need_logits=True)
        assert torch.equal(got.draft_ids, want.draft_ids)
        torch.testing.assert_close(got.draft_logits, want.draft_logits)


def test_a_dspark_draft_pruned_around_its_own_picks_proposes_the_same_walk():
    """The Markov head's output rows are pruned with the head's: where every pick of the full walk is kept, the
    pruned walk makes the same picks with the same logits on the kept ids and the same confidence."""
    target = tiny_target("llama", vocab_size=VOCAB)
    full = random_dspark(target, block_size=6, markov_rank=4, seed=2)
    full.bind_target(target)
    context, anchors = block_inputs(full, seed=5)
    want = propose(full, context, anchors, need_logits=True)
    kept = sorted(set(want.draft_ids.flatten().tolist()) | set(range(0, VOCAB, 4)))
    pruned = copy.deepcopy(full)
    pruned.prune_vocabulary(kept)
    assert pruned.markov_head.markov_w2.weight.shape[0] == len(kept)
    got = propose(pruned, context, anchors, need_logits=True)
    assert torch.equal(got.draft_ids, want.draft_ids)
    torch.testing.assert_close(got.draft_logits[..., kept], want.draft_logits[..., kept], rtol=1e-5, atol=1e-5)
    assert torch.isinf(got.draft_logits[..., [i for i in range(VOCAB) if i not in kept]]).all()
    torch.testing.assert_close(got.confidence, want.confidence)


def test_a_checkpoint_whose_maps_disagree_is_refused_naming_the_file(tmp_path):
    _, _, pruned = pair("dflash")
    pruned.save_pretrained(tmp_path / "draft")
    weights = tmp_path / "draft" / "model.safetensors"
    tensors = load_file(weights)
    tensors["t2d"] = torch.roll(tensors["t2d"], 1)  # marks other ids than d2t names
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors.*disagree"):
        type(pruned).from_pretrained(tmp_path / "draft")


def test_an_own_lm_head_keeps_only_the_kept_rows():
    target = tiny_target("llama", vocab_size=VOCAB)
    full = random_dflash(target, block_size=4, shares_target_embeddings=False)
    pruned = copy.deepcopy(full)
    pruned.prune_vocabulary(KEPT)
    assert torch.equal(pruned.lm_head.weight, full.lm_head.weight[KEPT])
    assert pruned.lm_head.out_features == len(KEPT)
    context, anchors = block_inputs(full, seed=3)
    want = masked(propose(full, context, anchors, need_logits=True).draft_logits)
    torch.testing.assert_close(propose(pruned, context, anchors, need_logits=True).draft_logits, want)


def test_training_continues_over_the_whole_vocabulary():
    """A warm start un-prunes a draft that borrows the target's head (nothing was cut from it) and refuses one
    whose own head lost the rows."""
    target, full, pruned = pair("dflash2")
    again = vocabulary_copy(pruned)
    assert not again.config.drafts_pruned_vocab and "d2t" not in again.state_dict()
    again.bind_target(target)
    context, anchors = block_inputs(full, seed=4)
    assert torch.equal(propose(again, context, anchors).draft_ids, propose(full, context, anchors).draft_ids)
    own = random_dflash(target, block_size=4, shares_target_embeddings=False)
    own.prune_vocabulary(KEPT)
    with pytest.raises(ValueError, match="own lm_head"):
        vocabulary_copy(own)


def test_a_pruned_dspark_draft_moves_to_another_vocabulary():
    """Re-chosen on a larger corpus, a DSpark draft keeps its Markov bias for the ids it kept before and starts the
    newly kept ones at none: it proposes what the full draft with those rows zeroed proposes over the new ids."""
    target = tiny_target("llama", vocab_size=VOCAB)
    full = random_dspark(target, block_size=6, num_layers=2, layer_ids=[0, 2], seed=2)
    with torch.no_grad():
        full.markov_head.markov_w2.weight.normal_(0.0, 3.0)  # biases large enough to change the walk
    pruned = copy.deepcopy(full)
    pruned.prune_vocabulary(KEPT)
    other = [i for i in range(VOCAB) if i % 2]  # half of them kept before, half new
    moved = vocabulary_copy(pruned, other)
    reference = copy.deepcopy(full)
    with torch.no_grad():
        reference.markov_head.markov_w2.weight[[i for i in other if i not in KEPT]] = 0.0
    reference.prune_vocabulary(other)
    assert torch.equal(moved.t2d, reference.t2d) and moved.config.draft_vocab_size == len(other)
    for draft in (moved, reference):
        draft.bind_target(target)
    context, anchors = block_inputs(full, seed=5)
    got, want = (propose(d, context, anchors, need_logits=True) for d in (moved, reference))
    torch.testing.assert_close(got.draft_logits, want.draft_logits)
    assert torch.equal(got.draft_ids, want.draft_ids)
    own = random_dflash(target, block_size=4, shares_target_embeddings=False)
    own.prune_vocabulary(KEPT)
    assert vocabulary_copy(own, KEPT[:10]).lm_head.weight.shape == (10, target.config.hidden_size)
    with pytest.raises(ValueError, match="own lm_head"):
        vocabulary_copy(own, other)


@pytest.mark.parametrize("kept, message", [([], "non-empty"), ([3, VOCAB], r"\[0, vocab_size=40\)"),
                                           ([-1, 4], r"\[0, vocab_size=40\)")])
def test_bad_kept_ids_are_refused_and_leave_the_draft_whole(kept, message):
    target = tiny_target("llama", vocab_size=VOCAB)
    draft = random_dflash(target, block_size=4)
    with pytest.raises(ValueError, match=message):
        draft.prune_vocabulary(kept)
    assert not draft.config.drafts_pruned_vocab and "d2t" not in draft.state_dict()


def test_fewer_kept_ids_than_dflash2_candidates_is_refused_naming_the_field():
    target = tiny_target("llama", vocab_size=VOCAB)
    draft = random_dflash2(target, block_size=4, selector_top_k=5)
    with pytest.raises(ValueError, match=r"`selector_top_k` = 5, expected an integer in \[1, draft_vocab_size=4\]"):
        draft.prune_vocabulary([1, 2, 3, 4])
    assert not draft.config.drafts_pruned_vocab and "d2t" not in draft.state_dict()


def test_pruning_twice_is_refused():
    _, _, pruned = pair("dflash")
    with pytest.raises(ValueError, match="already proposes from 26 ids"):
        pruned.prune_vocabulary(KEPT[:10])


@pytest.mark.parametrize("value", [0, VOCAB + 1, 2.5, True])
def test_a_bad_draft_vocab_size_names_the_field(value):
    target = tiny_target("llama", vocab_size=VOCAB)
    with pytest.raises(ValueError, match="`draft_vocab_size`"):
        DFlashConfig(**draft_fields(target), draft_vocab_size=value)


@pytest.mark.parametrize("kind, to, message", [("dflash", "zlab", "no pruned vocabulary"),
                                               ("dflash2", "speculators", "refuses a DFlash 2"),
                                               ("dflash", "speculators", "own head rows")])
def test_exports_that_cannot_hold_it_are_refused(kind, to, message, tmp_path):
    _, _, pruned = pair(kind)
    with pytest.raises(ValueError, match=message):
        export_draft(pruned, tmp_path / "out", to=to)
    assert not (tmp_path / "out").exists()


def test_prune_vocab_command_keeps_eos_and_the_most_frequent_answer_ids(tmp_path, capsys):
    target_dir, draft_dir = save_tiny_pair(tmp_path, kind="dflash2")
    stored = load_draft(draft_dir).to(torch.bfloat16)  # as drafts ship: pruning must not double the file to float32
    export_draft(stored, draft_dir, "hf", overwrite=True)
    tokenizer = char_tokenizer()
    # Answers over 15 letters, letter i written i + 1 times; EOS (id 2) ends only the one answer.
    letters = tokenizer.convert_tokens_to_ids(list("abcdefghijklmno"))
    answer = [t for i, t in enumerate(letters) for _ in range(i + 1)]
    records = [{"id": "t:0", "source": "topics", "prompt_ids": [5, 6], "prompt_crc": 0, "answer_ids": answer + [2],
                "sampled": False, "finished": True}]
    write_shard(tmp_path / "corpus" / "shards" / "topics-0000.npz", records, {"part": "topics"})
    args = ["prune-vocab", str(draft_dir), "--out", str(tmp_path / "pruned"), "--size", "8",
            "--corpus", str(tmp_path / "corpus"), "--target", str(target_dir)]
    assert cli.main(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    kept_letters = letters[-7:]  # the 7 most frequent, beside EOS
    assert report["coverage"] == pytest.approx((sum(range(9, 16)) + 1) / (len(answer) + 1), abs=1e-4)
    pruned = load_draft(tmp_path / "pruned")
    assert pruned.config.draft_vocab_size == 8
    assert pruned.fc.weight.dtype == torch.bfloat16 and torch.equal(pruned.fc.weight, stored.fc.weight)
    assert pruned.t2d.nonzero()[:, 0].tolist() == sorted([2] + kept_letters)
    auto = AutoModel.from_pretrained(tmp_path / "pruned", trust_remote_code=True)  # as a Hub user loads it
    assert type(auto).__name__ == "DFlash2DraftModel" and torch.equal(auto.t2d, pruned.t2d)
    # Pruned again, smaller (it borrows the target's head, so any size would do): EOS and the 3 most frequent.
    again = ["prune-vocab", str(tmp_path / "pruned"), "--out", str(tmp_path / "again"), "--size", "4", *args[6:]]
    assert cli.main(again) == 0
    report_again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report_again["coverage_before"] == report["coverage"]
    assert load_draft(tmp_path / "again").t2d.nonzero()[:, 0].tolist() == sorted([2] + letters[-3:])
