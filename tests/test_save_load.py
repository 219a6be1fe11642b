"""Configs validate with messages naming the field; save -> load (package and remote code) is exact."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel

from dflash_hf import DFLASH2_CODE_FILES, REMOTE_CODE_FILES, DFlashConfig, DFlashContextCache, DSparkConfig
from tiny import assert_same_logits, random_dflash, random_dflash2, random_dspark, tiny_target

ROOT = Path(__file__).resolve().parent.parent
BASE = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_target_layers=6)


@pytest.mark.parametrize(
    "fields,named",
    [
        ({"target_layer_ids": [6]}, "target_layer_ids"),
        ({"target_layer_ids": []}, "target_layer_ids"),
        ({"mask_token_id": 64}, "mask_token_id"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_attention_heads": 5}, "num_attention_heads"),
        ({"block_size": 1}, "block_size"),
        ({"layer_types": ["full_attention", "full_attention"]}, "layer_types"),
        ({"layer_types": ["sliding_attention"]}, "sliding_window"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "rope_parameters"),
        ({"hidden_size": 0}, "hidden_size"),
    ],
)
def test_bad_dflash_config_names_the_field(fields, named):
    with pytest.raises(ValueError, match=f"`{named}`"):
        DFlashConfig(**{**BASE, **fields})


@pytest.mark.parametrize(
    "fields,named",
    [
        ({"draft_vocab_size": 65}, "draft_vocab_size"),
        ({"markov_rank": -1}, "markov_rank"),
        ({"markov_head_type": "lstm"}, "markov_head_type"),
        ({"confidence_threshold": 1.5}, "confidence_threshold"),
    ],
)
def test_bad_dspark_config_names_the_field(fields, named):
    with pytest.raises(ValueError, match=f"`{named}`"):
        DSparkConfig(**{**BASE, **fields})


def test_default_layer_ids_follow_zlab():
    assert DFlashConfig(**{**BASE, "num_target_layers": 36, "num_hidden_layers": 5}).target_layer_ids == [1, 9, 17, 25, 33]
    assert DFlashConfig(**{**BASE, "num_target_layers": 30}).target_layer_ids == [15]


def test_yarn_config_is_standardized():
    config = DFlashConfig(**BASE, rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096},
                          max_position_embeddings=65536)
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 16.0


def test_auto_classes_are_registered():
    assert AutoConfig.for_model("dflash").__class__ is DFlashConfig
    assert AutoConfig.for_model("dspark").__class__ is DSparkConfig


def test_top_level_remote_code_files_are_the_package_files():
    for name in REMOTE_CODE_FILES + DFLASH2_CODE_FILES:
        assert (ROOT / name).read_bytes() == (ROOT / "src" / "dflash_hf" / name).read_bytes()


def proposals(draft, target, seed=0):
    draft.bind_target(target)
    torch.manual_seed(seed)
    context = torch.randn(1, 9, len(draft.config.target_layer_ids) * draft.config.target_hidden_size)
    return draft.propose(context, torch.tensor([3]), DFlashContextCache(), need_logits=True)


def code_files(kind: str) -> tuple[str, ...]:
    """The remote-code files a saved draft of this kind carries."""
    return REMOTE_CODE_FILES + (DFLASH2_CODE_FILES if kind == "dflash2" else ())


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2"])
def test_save_load_round_trip(tmp_path, kind):
    target = tiny_target("qwen3")
    draft = {"dflash": lambda: random_dflash(target, num_layers=2),
             "dspark": lambda: random_dspark(target, markov_head_type="gated"),
             "dflash2": lambda: random_dflash2(target, num_layers=2)}[kind]()
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    module = "modeling_dflash2" if kind == "dflash2" else "modeling_dflash"
    assert config["auto_map"]["AutoModel"] == f"{module}.{type(draft).__name__}"
    assert all((tmp_path / name).exists() for name in code_files(kind))
    if kind != "dflash2":  # a DFlash or DSpark draft carries no DFlash 2 code
        assert not any((tmp_path / name).exists() for name in DFLASH2_CODE_FILES)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(draft)
    a, b = proposals(draft, target), proposals(loaded, target)
    # Same weights, but the loaded ones live in other memory: equal to a few ulp (see `assert_same_logits`).
    assert torch.equal(a.draft_ids, b.draft_ids)
    assert_same_logits(b.draft_logits, a.draft_logits, draft.fc.weight.dtype)


def test_pruned_vocabulary_survives_save(tmp_path):
    target = tiny_target("llama")
    draft = random_dspark(target, draft_vocab_size=40)
    kept = torch.arange(96)[torch.randperm(96)[:40]].sort().values
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[kept] = True
    draft.set_vocab_mapping(kept - torch.arange(40), t2d)
    draft.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)  # integer maps, copied
    assert torch.equal(proposals(draft, target).draft_ids, proposals(loaded, target).draft_ids)


def test_shape_mismatched_weights_name_the_tensor(tmp_path):
    target = tiny_target("llama")
    random_dflash(target).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 40
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="mlp"):
        AutoModel.from_pretrained(tmp_path)


REMOTE_ONLY = textwrap.dedent(
    """
    import sys, json
    sys.modules["dflash_hf"] = None  # the package must not be needed
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    draft = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    assert type(draft).__module__.startswith("transformers_modules"), type(draft).__module__
    target = AutoModelForCausalLM.from_pretrained(sys.argv[2]).eval()
    ids = torch.tensor([json.loads(sys.argv[3])])
    out = target.generate(ids, assistant_model=draft, max_new_tokens=24, do_sample=False)
    print(json.dumps({"ids": out[0].tolist(), "steps": len(draft.generation_stats["acceptance_lengths"])}))
    """
)


@pytest.mark.parametrize("kind", ["dflash", "dspark", "dflash2"])
def test_remote_code_alone_generates_identically(tmp_path, kind):
    target = tiny_target("llama")
    draft = {"dflash": random_dflash, "dspark": random_dspark, "dflash2": random_dflash2}[kind](target, block_size=5)
    draft.save_pretrained(tmp_path / "draft")
    target.save_pretrained(tmp_path / "target")
    prompt = [5, 9, 17, 33, 4]
    expected = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0].tolist()
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_ONLY, str(tmp_path / "draft"), str(tmp_path / "target"), json.dumps(prompt)],
        capture_output=True, text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                                                           "HF_HOME": str(tmp_path / "hf")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reply = json.loads(result.stdout.strip().splitlines()[-1])
    assert reply["ids"] == expected
    assert reply["steps"] > 0  # the block drafter really ran
