"""`dflash-hf average`: the weighted mean of drafts of one shape and vocabulary, saved as a draft that generates
losslessly and carries how it was made; drafts that cannot be averaged are refused by name, and nothing is written."""

import json

import pytest
import torch
from transformers import AutoModel

from dflash_hf import cli
from dflash_hf.training.average import average_drafts
from dflash_hf.training.cards import previous_training, training_history
from tiny import random_dflash, random_dspark, tiny_target

KEPT = torch.arange(0, 96, 2)  # a pruned vocabulary of 48 ids


def pruned_dspark(target, seed: int, kept=KEPT, **kwargs):
    draft = random_dspark(target, seed=seed, draft_vocab_size=len(kept), **kwargs)
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[kept] = True
    draft.set_vocab_mapping(kept - torch.arange(len(kept)), t2d)
    return draft


def test_average_is_the_weighted_mean_and_generates_losslessly(tmp_path, capsys):
    target = tiny_target("llama")
    first, second = pruned_dspark(target, seed=0), pruned_dspark(target, seed=1)
    first.save_pretrained(tmp_path / "a")
    second.save_pretrained(tmp_path / "b")
    summary = {"steps_run": 7, "train": {"sequences_per_step": 2, "anchors_per_sequence": 4}, "hardware": "a test",
               "train_tokens_assistant": 99, "command": "made a", "init_from": None, "target": "tiny"}
    (tmp_path / "a" / "training_summary.json").write_text(json.dumps(summary))
    args = ["average", "--draft", str(tmp_path / "a"), "--draft", str(tmp_path / "b"), "--weight", "3", "--weight", "1",
            "--out", str(tmp_path / "soup")]
    assert cli.main(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["weights"] == [0.75, 0.25]

    soup = AutoModel.from_pretrained(tmp_path / "soup").eval()
    assert type(soup) is type(first)
    a, b = first.state_dict(), second.state_dict()
    for name, value in soup.state_dict().items():
        want = 0.75 * a[name] + 0.25 * b[name] if value.is_floating_point() else a[name]
        assert torch.equal(value, want.to(value.dtype)), name
    assert not torch.equal(soup.fc.weight, first.fc.weight)

    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    alone = target.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
    out = target.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0, assistant_model=soup)
    assert out.tolist() == alone.tolist()
    assert soup.generation_stats["acceptance_lengths"]  # it drafted

    card = (tmp_path / "soup" / "README.md").read_text()
    assert "# DSPARK draft for tiny: the weight average of 2 drafts" in card
    assert f"| `{tmp_path / 'a'}` | 0.750 | 7 steps of 2 x 4 on 99 assistant tokens on a test (`made a`) |" in card
    assert f"| `{tmp_path / 'b'}` | 0.250 | no training summary |" in card
    # A warm start from the average names it, then follows the first draft it averaged.
    history = training_history(previous_training(tmp_path / "soup"))
    assert history.startswith(f"- Continued from `{tmp_path / 'soup'}`, the weight average of `{tmp_path / 'a'}` (0.75)")
    assert history.endswith(f"- Continued from `{tmp_path / 'a'}`, made by 7 steps of 2 x 4 on 99 assistant tokens on "
                            "a test, from a fresh initialisation (`made a`).\n")


@pytest.mark.parametrize("other, weights, message", [
    (lambda t: pruned_dspark(t, seed=1, kept=torch.arange(1, 96, 2)), None, "tensor `d2t` differs"),
    (lambda t: pruned_dspark(t, seed=1, markov_rank=8), None, "config field `markov_rank` is 8 in draft 1 and 4"),
    (lambda t: random_dflash(t, seed=1), None, "draft 1 is a DFlashDraftModel and draft 0 a DSparkDraftModel"),
    (lambda t: pruned_dspark(t, seed=1), [1.0], "--weight: 1 weights for 2 drafts"),
    (lambda t: pruned_dspark(t, seed=1), [1.0, -1.0], "every weight must be a positive number"),
    (lambda t: pruned_dspark(t, seed=1), [1.0, float("nan")], "every weight must be a positive number"),
])
def test_drafts_that_cannot_be_averaged_are_refused_by_name(other, weights, message):
    target = tiny_target("llama")
    with pytest.raises(ValueError, match=message):
        average_drafts([pruned_dspark(target, seed=0), other(target)], weights)


def test_a_refused_average_writes_nothing(tmp_path):
    target = tiny_target("llama")
    pruned_dspark(target, seed=0).save_pretrained(tmp_path / "a")
    pruned_dspark(target, seed=1, kept=torch.arange(1, 96, 2)).save_pretrained(tmp_path / "b")
    with pytest.raises(ValueError, match="--draft: averaging needs at least two drafts, got 1"):
        cli.main(["average", "--draft", str(tmp_path / "a"), "--out", str(tmp_path / "soup")])
    with pytest.raises(ValueError, match="`d2t`"):
        cli.main(["average", "--draft", str(tmp_path / "a"), "--draft", str(tmp_path / "b"),
                  "--out", str(tmp_path / "soup")])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a", "b"]
