"""Bad input found by probing, each item refused by name (or, item 8, a layout once refused, now read and written).

Item 1: a config without a field no default can stand in for. Item 2: `AutoModel.from_pretrained` of inconsistent
vocabulary maps. Item 3: NaN/inf weights. Item 7: the hidden partial folder a killed `dflash-hf convert` leaves.
Item 8: a DSpark checkpoint as speculators 0.9.0 writes it (its own pruned lm_head, the verifier's embedding).
Item 9: DFlash 2 checkpoints (ours, z-lab's, speculators'): malformed fields, codebooks, causality, variants.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel

import dialects
from dflash_hf.cli import main as cli_main
from dflash_hf.configuration_dflash import default_target_layer_ids
from dflash_hf.formats import PARTIAL_MARKER, export_draft, load_draft
from tiny import tiny_target


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One checkpoint per dialect (tiny shapes), written once; tests copy before they break one."""
    root = tmp_path_factory.mktemp("bad-input")
    # Stands in for `tiny_target("llama")`, the target item 8 generates with.
    verifier = str(dialects.write_verifier(root / "verifier", dialects.TINY_TARGET_LAYERS, ["LlamaForCausalLM"]))
    pruned = dialects.tiny_dspark_draft(seed=1, draft_vocab_size=40, sample_from_anchor=False,
                                        dtype=torch.float32)
    return {
        "ours-dflash": dialects.write_ours(root / "ours-dflash", dialects.tiny_dflash_draft(seed=0)),
        "ours-dspark": dialects.write_ours(root / "ours-dspark", pruned),
        "zlab": dialects.write_zlab(root / "zlab", dialects.tiny_dflash_draft(seed=2)),
        "modelopt-kimi": dialects.write_modelopt(root / "modelopt-kimi", dialects.kimi_dflash_draft(seed=3), shards=2),
        "speculators": dialects.write_speculators(root / "speculators", pruned, verifier),
        "deepspec": dialects.write_deepspec(root / "deepspec", dialects.tiny_dspark_draft(seed=4)),
        "ours-dflash2": dialects.write_ours(root / "ours-dflash2", dialects.tiny_dflash2_draft(seed=5)),
        "zlab-dflash2": dialects.write_zlab_dflash2(root / "zlab-dflash2", dialects.released_dflash2_draft(seed=6)),
        "speculators-dflash2": dialects.write_speculators(root / "speculators-dflash2",
                                                          dialects.tiny_dflash2_draft(seed=7), verifier),
        "verifier": Path(verifier),
    }


def copy(folders, name: str, tmp_path: Path) -> Path:
    destination = tmp_path / name
    destination.mkdir()
    for file in folders[name].iterdir():
        (destination / file.name).write_bytes(file.read_bytes())
    return destination


def edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def edit_tensors(file: Path, edit) -> None:
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


# ----------------------------------------------------------------------------------------------------------------------
# Item 1: required config fields are named, in every dialect and by every loader
# ----------------------------------------------------------------------------------------------------------------------


def drop(*path):
    """An edit removing config[path[0]][path[1]]...: the field a checkpoint forgot."""

    def edit(config):
        for key in path[:-1]:
            config = config[key]
        del config[path[-1]]

    return edit


REQUIRED = [
    # (checkpoint, edit, the name the error must give)
    ("ours-dflash", drop("block_size"), "`block_size`"),
    ("ours-dflash", drop("mask_token_id"), "`mask_token_id`"),
    ("ours-dflash", lambda c: (c.pop("target_layer_ids"), c.pop("num_target_layers")), "`num_target_layers`"),
    ("ours-dspark", drop("sample_from_anchor"), "`sample_from_anchor`"),
    ("zlab", drop("block_size"), "`block_size`"),
    ("zlab", drop("dflash_config", "mask_token_id"), "`dflash_config.mask_token_id`"),
    ("zlab", lambda c: (c["dflash_config"].pop("target_layer_ids"), c.pop("num_target_layers")), "`num_target_layers`"),
    ("modelopt-kimi", drop("block_size"), "`block_size`"),
    ("speculators", drop("block_size"), "`block_size`"),
    ("speculators", drop("mask_token_id"), "`mask_token_id`"),
    ("speculators", drop("draft_vocab_size"), "`draft_vocab_size`"),
    ("speculators", drop("aux_hidden_state_layer_ids"), "`aux_hidden_state_layer_ids`"),
    ("speculators", drop("transformer_layer_config"), "`transformer_layer_config`"),
    ("deepspec", drop("block_size"), "`block_size`"),
    ("deepspec", drop("mask_token_id"), "`mask_token_id`"),
    ("ours-dflash2", drop("conv_group_size"), "`conv_group_size`"),
    ("ours-dflash2", drop("selector_top_k"), "`selector_top_k`"),
    ("zlab-dflash2", drop("dflash_config", "conv_kernel_size"), "`conv_kernel_size`"),
    ("zlab-dflash2", drop("dflash_config", "selector_rank"), "`selector_rank`"),
    ("zlab-dflash2", drop("dflash_config", "block_size"), "`block_size`"),
    ("zlab-dflash2", drop("dflash_config", "mask_token_id"), "`mask_token_id`"),
    ("speculators-dflash2", drop("mask_token_id"), "`mask_token_id`"),
]


@pytest.mark.parametrize("name,edit,named", REQUIRED, ids=[f"{n}-{f.strip('`')}" for n, _, f in REQUIRED])
def test_item1_missing_required_config_field_is_named(folders, tmp_path, name, edit, named):
    folder = copy(folders, name, tmp_path)
    edit_config(folder, edit)
    with pytest.raises(ValueError, match="has no .*" + named) as error:
        load_draft(folder)
    assert str(folder) in str(error.value)
    if name.startswith("ours"):  # our format is also read by transformers' Auto classes
        for load in (AutoConfig.from_pretrained, AutoModel.from_pretrained):
            with pytest.raises(ValueError, match="has no .*" + named):
                load(folder)


def test_item1_target_layer_ids_default_from_num_target_layers(folders, tmp_path):
    """The one documented default of our format: layer ids follow the target's depth, as in z-lab's code."""
    folder = copy(folders, "ours-dflash", tmp_path)
    edit_config(folder, drop("target_layer_ids"))
    for config in (AutoConfig.from_pretrained(folder), load_draft(folder).config):
        assert config.target_layer_ids == default_target_layer_ids(dialects.TINY_TARGET_LAYERS, 2)


# ----------------------------------------------------------------------------------------------------------------------
# Item 2: AutoModel.from_pretrained checks the vocabulary maps as load_draft does
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("corrupt,message", [
    (lambda t: t["d2t"].__setitem__(-1, 10_000), "outside the target vocabulary"),
    (lambda t: t["d2t"].__setitem__(0, t["d2t"][0] + 1), "disagree"),
], ids=["out-of-range", "inconsistent"])
def test_item2_automodel_refuses_bad_vocabulary_maps(folders, tmp_path, corrupt, message):
    folder = copy(folders, "ours-dspark", tmp_path)
    edit_tensors(folder / "model.safetensors", corrupt)
    with pytest.raises(ValueError, match=message) as error:
        AutoModel.from_pretrained(folder)
    assert str(folder / "model.safetensors") in str(error.value) and "`d2t`" in str(error.value)


# ----------------------------------------------------------------------------------------------------------------------
# Item 3: NaN/inf weights are named with their file, by both loaders
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name,load", [
    ("ours-dspark", AutoModel.from_pretrained),
    ("ours-dspark", load_draft),
    ("modelopt-kimi", load_draft),  # sharded: the message names the shard
], ids=["automodel", "load_draft", "load_draft-sharded"])
def test_item3_nonfinite_weights_are_named(folders, tmp_path, name, load, bad):
    folder = copy(folders, name, tmp_path)
    tensor = "layers.0.mlp.up_proj.weight"
    index = folder / "model.safetensors.index.json"
    file = folder / (json.loads(index.read_text())["weight_map"][tensor] if index.is_file() else "model.safetensors")
    edit_tensors(file, lambda t: t[tensor].view(-1).__setitem__(3, bad))
    with pytest.raises(ValueError, match=rf"Non-finite weights.*{re.escape(str(file))}: `{tensor}` \(") as error:
        load(folder)
    assert ("1 NaN" if math.isnan(bad) else "0 NaN, 1 inf") in str(error.value)


# ----------------------------------------------------------------------------------------------------------------------
# Item 7: a killed convert's hidden partial folder is removed by the next convert, and nothing else is
# ----------------------------------------------------------------------------------------------------------------------

# Runs `dflash-hf convert` until its output is written into the hidden partial folder, says so, and waits to be killed.
CONVERT_UNTIL_KILLED = textwrap.dedent(
    """
    import sys, time
    from dflash_hf.formats import export
    from dflash_hf.cli import main

    write = export._write_checkpoint

    def write_and_wait(*args):
        write(*args)
        print("written", flush=True)
        time.sleep(300)

    export._write_checkpoint = write_and_wait
    main(["convert", sys.argv[1], sys.argv[2], "--to", "zlab"])
    """
)


def partials(dst: Path) -> set[str]:
    return {p.name for p in dst.parent.glob(f".{dst.name}.*.partial")}


@pytest.mark.parametrize("kill", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_item7_convert_removes_what_a_killed_convert_left(folders, tmp_path, kill):
    dst = tmp_path / "out"
    run = subprocess.Popen([sys.executable, "-c", CONVERT_UNTIL_KILLED, str(folders["zlab"]), str(dst)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert run.stdout.readline().strip() == "written", run.stderr.read()[-3000:]
        left = partials(dst)
        assert len(left) == 1
        killed_partial = dst.parent / left.pop()
        marker_file = killed_partial / PARTIAL_MARKER
        marker = json.loads(marker_file.read_text())
    finally:
        run.send_signal(kill)
        run.wait(timeout=60)
    # SIGKILL runs no cleanup: the partial stays until the next convert. SIGTERM cleans up at once.
    assert killed_partial.exists() == (kill == signal.SIGKILL)

    # Folders that look alike but are not provably a dead export's: they must survive.
    unrelated = dst.parent / ".out.handmade.partial"  # same-looking name, no marker
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("mine")
    running = dst.parent / ".out.running.partial"  # a marker whose writer is alive (this process)
    running.mkdir()
    (running / marker_file.name).write_text(json.dumps({**marker, "pid": os.getpid()}))
    other_destination = dst.parent / ".out.x.dead.partial"  # a dead export to `out.x`, whose partials look alike
    other_destination.mkdir()
    (other_destination / marker_file.name).write_text(json.dumps({**marker, "destination": "out.x"}))

    assert cli_main(["convert", str(folders["zlab"]), str(dst), "--to", "zlab"]) == 0
    assert not killed_partial.exists()
    assert partials(dst) == {unrelated.name, running.name, other_destination.name}
    assert (unrelated / "notes.txt").read_text() == "mine"
    assert not (dst / PARTIAL_MARKER).exists()  # the finished export holds no marker
    load_draft(dst)


# ----------------------------------------------------------------------------------------------------------------------
# Item 8: speculators 0.9.0's DSpark layout (own pruned lm_head, borrowed embedding) loads, generates, exports
# ----------------------------------------------------------------------------------------------------------------------


def test_item8_speculators_090_dspark_loads_generates_and_exports(folders, tmp_path):
    reference = dialects.speculators_090_dspark_draft(seed=5, dtype=torch.float32)
    folder = dialects.write_speculators_090(tmp_path / "spec-090", reference, str(folders["verifier"]),
                                            verifier_architectures=["LlamaForCausalLM"])
    draft = load_draft(folder)
    assert draft.config.shares_target_input_embedding and not draft.config.shares_target_lm_head
    assert "embed_tokens.weight" not in draft.state_dict()
    assert torch.equal(draft.lm_head.weight, reference.lm_head.weight)  # the shipped rows, copied

    target = tiny_target("llama")  # vocabulary 96, hidden 32, 4 layers: what the draft was built for
    ids = torch.tensor([[5, 9, 17, 33, 4, 60]])
    alone = target.generate(ids, do_sample=False, max_new_tokens=20)
    assisted = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=20)
    assert torch.equal(assisted, alone)
    assert draft.generation_stats["acceptance_lengths"]  # the draft really ran
    assert torch.equal(draft.embedding_weight(), target.get_input_embeddings().weight)

    # Exported for speculators/vLLM: what speculators 0.9.0 writes itself (config and tensors), and it reads back.
    assert cli_main(["convert", str(folder), str(tmp_path / "out"), "--to", "speculators"]) == 0
    written, shipped = dialects.read_folder(tmp_path / "out"), dialects.read_folder(folder)
    assert written[1] == shipped[1] and "embed_tokens.weight" not in written[1]
    assert written[1]["lm_head.weight"][0] == (40, reference.config.hidden_size)
    strip = ("transformers_version",)
    assert {k: v for k, v in written[0].items() if k not in strip} == \
        {k: v for k, v in shipped[0].items() if k not in strip}
    again = load_draft(tmp_path / "out")
    assert again.config.to_dict() | {"_name_or_path": ""} == draft.config.to_dict() | {"_name_or_path": ""}
    export_draft(again, tmp_path / "hf")  # and ours, read back by transformers
    config = AutoModel.from_pretrained(tmp_path / "hf").config
    assert config.shares_target_input_embedding and not config.shares_target_lm_head

    # Configs saved before the flag was split carry `shares_target_embeddings` alone: it still means both.
    old = copy(folders, "ours-dspark", tmp_path)  # its own embedding and lm_head
    edit_config(old, lambda c: (c.pop("shares_target_input_embedding"), c.pop("shares_target_lm_head"),
                                c.update(shares_target_embeddings=False)))
    config = load_draft(old).config
    assert not config.shares_target_input_embedding and not config.shares_target_lm_head


# ----------------------------------------------------------------------------------------------------------------------
# Item 9: DFlash 2 checkpoints, malformed: each refused naming the field, tensor or variant
# ----------------------------------------------------------------------------------------------------------------------

VOCAB, RANK = dialects.TINY["vocab_size"], dialects.RELEASED_DFLASH2["selector_rank"]


def in_dflash_config(**values):
    return lambda config: config["dflash_config"].update(values)


BAD_DFLASH2_CONFIGS = [
    # (checkpoint, edit, what the error must say)
    ("zlab-dflash2", in_dflash_config(selector_top_k=VOCAB + 1),
     rf"`selector_top_k` = {VOCAB + 1}, expected an integer in \[1, vocab_size={VOCAB}\]"),
    ("zlab-dflash2", in_dflash_config(selector_top_k=0), "`selector_top_k` = 0"),
    ("zlab-dflash2", in_dflash_config(conv_group_size=5), r"`conv_group_size` = 5, expected a divisor of hidden_size"),
    ("zlab-dflash2", in_dflash_config(conv_kernel_size=0), "`conv_kernel_size` = 0, expected a positive integer"),
    ("zlab-dflash2", in_dflash_config(selector_rank="16"), "`selector_rank` = '16', expected a positive integer"),
    ("zlab-dflash2", in_dflash_config(final_logit_softcapping=-2.0), "`final_logit_softcapping` = -2.0"),
    ("zlab-dflash2", lambda c: c.update(is_causal=True, layer_types=["sliding_attention"] * 4 + ["full_attention"]),
     r"`is_causal` = true makes every draft layer causal inside the block, the full-attention layers \[4\]"),
    ("zlab-dflash2", lambda c: c.update(is_causal="yes"), "`is_causal` = 'yes', expected true, false or null"),
    ("zlab-dflash2", lambda c: (c.update(is_causal=False), c["dflash_config"].update(causal=True)), "disagree"),
    ("zlab-dflash2", lambda c: c.update(dflash_config=[1, 2]), "`dflash_config` is list, expected a dict"),
    ("zlab-dflash2", in_dflash_config(attention_sink_bias=True), "attention_sink_bias=True"),
    ("zlab-dflash2", in_dflash_config(fc_layernorm=True), "fc_layernorm=True"),
    ("zlab-dflash2", in_dflash_config(selector_vocab_size=VOCAB - 3), rf"selector_vocab_size={VOCAB - 3} differs"),
    ("speculators-dflash2", lambda c: c.update(draft_vocab_size=40), "proposes from the full target vocabulary"),
    ("speculators-dflash2", lambda c: c.update(sample_from_anchor=True), "sample_from_anchor=true"),
    ("speculators-dflash2", lambda c: c.update(projector_type="domino"), "projector_type='domino'"),
    ("speculators-dflash2", lambda c: c.update(shift_label=True), "shift_label=True"),
    ("speculators-dflash2", lambda c: c.update(selector_top_k=VOCAB + 1), "`selector_top_k`"),
    ("speculators-dflash2", lambda c: c.update(speculators_model_type="dflash3"),
     "speculators checkpoint of type 'dflash3'"),
    ("ours-dflash2", lambda c: c.update(conv_group_size=3), "`conv_group_size` = 3"),
]


@pytest.mark.parametrize("name,edit,message", BAD_DFLASH2_CONFIGS,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_DFLASH2_CONFIGS)])
def test_item9_malformed_dflash2_configs_are_named(folders, tmp_path, name, edit, message):
    folder = copy(folders, name, tmp_path)
    edit_config(folder, edit)
    with pytest.raises(ValueError, match=message) as error:
        load_draft(folder)
    if "speculators checkpoint of type" not in message:
        assert str(folder) in str(error.value)


def replace_tensor(name: str, make):
    return lambda tensors: tensors.update({name: make(tensors[name])})


BAD_DFLASH2_TENSORS = [
    (replace_tensor("candidate_selector.predecessor_codebook", lambda t: t[:, :-1].contiguous()),
     rf"shape mismatches: candidate_selector\.predecessor_codebook: checkpoint \[{VOCAB}, {RANK - 1}\] vs expected "
     rf"\[{VOCAB}, {RANK}\]"),
    (replace_tensor("candidate_selector.successor_codebook", lambda t: t[:-1].contiguous()),
     rf"candidate_selector\.successor_codebook: checkpoint \[{VOCAB - 1}, {RANK}\]"),
    (replace_tensor("candidate_selector.successor_codebook", lambda t: t.reshape(-1).contiguous()),
     rf"candidate_selector\.successor_codebook: checkpoint \[{VOCAB * RANK}\]"),
    (replace_tensor("candidate_selector.hidden_projection.weight", lambda t: t.T.contiguous()),
     r"candidate_selector\.hidden_projection\.weight: checkpoint \[32, 16\] vs expected \[16, 32\]"),
    (replace_tensor("layers.2.mlp_conv.base_kernel", lambda t: torch.cat([t, t[:, :1]], 1)),
     r"layers\.2\.mlp_conv\.base_kernel: checkpoint \[2, 3, 32\] vs expected \[2, 2, 32\]"),
    (lambda t: t.pop("candidate_selector.successor_codebook"),
     r"missing tensors: candidate_selector\.successor_codebook"),
    (lambda t: t.pop("layers.0.attention_conv.kernel_projection.weight"),
     r"missing tensors: layers\.0\.attention_conv\.kernel_projection\.weight"),
    (lambda t: t.update({"candidate_selector.successor_codebook.weight":
                         t["candidate_selector.successor_codebook"] + 0}),  # a copy: safetensors refuses shared memory
     "holds both `candidate_selector.successor_codebook` and `candidate_selector.successor_codebook.weight`"),
    (lambda t: t["candidate_selector.predecessor_codebook"].view(-1).__setitem__(5, float("nan")),
     r"Non-finite weights.*`candidate_selector\.predecessor_codebook` \(1 NaN"),
]


@pytest.mark.parametrize("edit,message", BAD_DFLASH2_TENSORS, ids=range(len(BAD_DFLASH2_TENSORS)))
def test_item9_malformed_dflash2_tensors_are_named(folders, tmp_path, edit, message):
    folder = copy(folders, "zlab-dflash2", tmp_path)
    edit_tensors(folder / "model.safetensors", edit)
    with pytest.raises(ValueError, match=message):
        load_draft(folder)


def test_item9_automodel_names_a_wrong_codebook_too(folders, tmp_path):
    folder = copy(folders, "ours-dflash2", tmp_path)
    edit_tensors(folder / "model.safetensors",
                 replace_tensor("candidate_selector.predecessor_codebook", lambda t: t[:, :-1].contiguous()))
    for load in (AutoModel.from_pretrained, load_draft):
        with pytest.raises(ValueError, match=r"candidate_selector\.predecessor_codebook"):
            load(folder)
