"""Every dialect loads as the draft it encodes; convert/export round trips are exact; bad checkpoints fail by name."""

import importlib.util
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

import dialects
from dflash_hf import DFlashContextCache
from dflash_hf.cli import main as cli_main
from dflash_hf.formats import (
    DEEPSPEC,
    MODELOPT,
    OURS,
    SPECULATORS_DFLASH,
    SPECULATORS_DFLASH2,
    SPECULATORS_DSPARK,
    ZLAB,
    ZLAB_DFLASH2,
    export_draft,
    identify,
    load_draft,
)
from tiny import assert_same_logits

ZLAB_INSTALLED = importlib.util.find_spec("dflash") is not None

# Config entries that name the writer rather than the draft.
WRITER_KEYS = {"_name_or_path", "transformers_version", "architectures", "auto_map", "dtype", "torch_dtype"}


# ----------------------------------------------------------------------------------------------------------------------
# Cases: a reference draft in our format, the dialect folder written from it, and how to load it
# ----------------------------------------------------------------------------------------------------------------------


def _verifier(root: Path, num_layers: int = dialects.TINY_TARGET_LAYERS) -> str:
    return str(dialects.write_verifier(root / f"verifier-{num_layers}", num_layers))


def _speculators(root, name, draft):
    return dialects.write_speculators(root / name, draft, _verifier(root), verifier_architectures=["Qwen3ForCausalLM"])


def _ours_dflash(root):
    draft = dialects.tiny_dflash_draft()
    return draft, dialects.write_ours(root / "ours-dflash", draft), {}


def _ours_dspark(root):
    draft = dialects.tiny_dspark_draft(head_type="gated", draft_vocab_size=40, sample_from_anchor=False)
    return draft, dialects.write_ours(root / "ours-dspark", draft), {}


def _zlab(root):
    draft = dialects.tiny_dflash_draft(seed=1)
    return draft, dialects.write_zlab(root / "zlab", draft), {}


def _modelopt_kimi(root):
    draft = dialects.kimi_dflash_draft(seed=2)
    return draft, dialects.write_modelopt(root / "modelopt-kimi", draft, shards=2), {}


def _speculators_dflash_pruned(root):
    # speculators' trainer prunes the vocabulary by default: a DFlash draft with d2t/t2d and its own head rows.
    draft = dialects.tiny_dflash_draft(seed=3, own_embeddings=True, draft_vocab_size=40)
    return draft, _speculators(root, "spec-dflash-pruned", draft), {}


def _speculators_dflash_full(root):
    draft = dialects.tiny_dflash_draft(seed=4, own_embeddings=True)
    return draft, _speculators(root, "spec-dflash-full", draft), {}


def _speculators_dspark_gated(root):
    draft = dialects.tiny_dspark_draft(seed=5, head_type="gated", sample_from_anchor=True)
    return draft, _speculators(root, "spec-dspark-gated", draft), {}


def _speculators_dspark_rnn(root):
    draft = dialects.tiny_dspark_draft(seed=6, head_type="rnn", draft_vocab_size=40, sample_from_anchor=False)
    return draft, _speculators(root, "spec-dspark-rnn", draft), {}


def _speculators_090_dspark(root):
    # speculators 0.9.0's own save: pruned lm_head shipped, embed_tokens not (the verifier's is borrowed).
    draft = dialects.speculators_090_dspark_draft(seed=10)
    folder = dialects.write_speculators_090(root / "spec-090-dspark", draft, _verifier(root),
                                            verifier_architectures=["Qwen3ForCausalLM"])
    return draft, folder, {}


def _novita_kimi_dspark(root):
    draft = dialects.kimi_dspark_draft(seed=7)
    folder = dialects.write_speculators(root / "kimi-dspark", draft, dialects.KIMI_VERIFIER, legacy=True,
                                        verifier_architectures=["KimiK25ForConditionalGeneration"])
    # The verifier is a Hub id we cannot reach here: the target's depth is given, as a user without it would.
    return draft, folder, {"num_target_layers": dialects.KIMI_TARGET_LAYERS, "local_files_only": True}


def _deepspec_rnn(root):
    draft = dialects.tiny_dspark_draft(seed=8, head_type="rnn", sample_from_anchor=True, dtype=torch.float32)
    return draft, dialects.write_deepspec(root / "deepspec-rnn", draft), {}


def _deepspec_dflash(root):
    draft = dialects.tiny_dspark_draft(seed=9, markov_rank=0, confidence=False, sample_from_anchor=True)
    return draft, dialects.write_deepspec(root / "deepspec-dflash", draft), {}


def _ours_dflash2(root):
    draft = dialects.tiny_dflash2_draft(seed=11, input_embedding_scale=1.5, output_multiplier=0.75,
                                        final_logit_softcapping=8.0)
    return draft, dialects.write_ours(root / "ours-dflash2", draft), {}


def _zlab_dflash2_released(root):
    # The released layout: every field in dflash_config, every layer sliding (causal, z-lab's default), shards.
    draft = dialects.released_dflash2_draft(seed=12)
    return draft, dialects.write_zlab_dflash2(root / "zlab-dflash2-released", draft, shards=2), {}


def _zlab_dflash2_top_level(root):
    # The fields beside the layer fields, `is_causal: false`: the sliding layer is bidirectional, as the full one is.
    draft = dialects.tiny_dflash2_draft(seed=13, layer_types=["sliding_attention", "full_attention"],
                                        sliding_window=3, sliding_window_causal=False)
    return draft, dialects.write_zlab_dflash2(root / "zlab-dflash2-top-level", draft, top_level=True), {}


def _speculators_dflash2(root):
    # speculators' dflash2 defaults its sliding layers to bidirectional (sliding_window_non_causal true).
    draft = dialects.tiny_dflash2_draft(seed=14, layer_types=["full_attention", "sliding_attention"],
                                        sliding_window=3, sliding_window_causal=False)
    return draft, _speculators(root, "spec-dflash2", draft), {}


# name -> (builder, dialect, native export format)
CASES = {
    "ours-dflash": (_ours_dflash, OURS, "hf"),
    "ours-dspark": (_ours_dspark, OURS, "hf"),
    "zlab": (_zlab, ZLAB, "zlab"),
    "modelopt-kimi": (_modelopt_kimi, MODELOPT, "zlab"),
    "speculators-dflash-pruned": (_speculators_dflash_pruned, SPECULATORS_DFLASH, "speculators"),
    "speculators-dflash-full": (_speculators_dflash_full, SPECULATORS_DFLASH, "speculators"),
    "speculators-dspark-gated": (_speculators_dspark_gated, SPECULATORS_DSPARK, "speculators"),
    "speculators-dspark-rnn": (_speculators_dspark_rnn, SPECULATORS_DSPARK, "speculators"),
    "speculators-090-dspark": (_speculators_090_dspark, SPECULATORS_DSPARK, "speculators"),
    "novita-kimi-dspark": (_novita_kimi_dspark, SPECULATORS_DSPARK, "speculators"),
    "deepspec-rnn": (_deepspec_rnn, DEEPSPEC, "speculators"),
    "deepspec-dflash": (_deepspec_dflash, DEEPSPEC, "speculators"),
    "ours-dflash2": (_ours_dflash2, OURS, "hf"),
    "zlab-dflash2-released": (_zlab_dflash2_released, ZLAB_DFLASH2, "zlab"),
    "zlab-dflash2-top-level": (_zlab_dflash2_top_level, ZLAB_DFLASH2, "zlab"),
    "speculators-dflash2": (_speculators_dflash2, SPECULATORS_DFLASH2, "speculators"),
}
DFLASH2_CASES = [name for name in CASES if name.endswith(("dflash2", "dflash2-released", "dflash2-top-level"))]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every case's (reference draft, folder, load options), built once."""
    root = tmp_path_factory.mktemp("dialects")
    return {name: builder(root) for name, (builder, _, _) in CASES.items()}


# ----------------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------------


def embedding_target(draft):
    """A real (one-layer) causal LM whose embedding and head fit the draft, for drafts that borrow them."""
    c = draft.config
    torch.manual_seed(11)
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1)
    return LlamaForCausalLM(config).eval()


def borrows(draft) -> bool:
    return draft.config.shares_target_input_embedding or draft.config.shares_target_lm_head


def propose(draft, target=None, steps=2):
    """Two consecutive block proposals (the second reuses the context cache) from fixed random context."""
    if borrows(draft):
        draft.bind_target(target)
    generator = torch.Generator().manual_seed(0)
    width = len(draft.config.target_layer_ids) * draft.config.target_hidden_size
    cache, out = DFlashContextCache(), []
    for step in range(steps):
        context = torch.randn(1, 5 - 2 * step, width, generator=generator)
        out.append(draft.propose(context, torch.tensor([3 + step]), cache, need_logits=True))
    return out


def assert_same_proposals(loaded, reference):
    """The same proposals; logits and confidences to a few ulp, as equal weights in other memory compute them
    (`assert_same_logits`). Ids exactly: a flipped argmax needs two logits within that tolerance, and the fixed seeds
    leave none. Logits that are -inf (ids a pruned draft or a DFlash 2 slot's candidates leave out) must be -inf at
    the same ids; the tolerance then scales with the finite ones."""
    target = embedding_target(reference) if borrows(reference) else None
    dtype = reference.fc.weight.dtype
    for got, want in zip(propose(loaded, target), propose(reference, target), strict=True):
        assert got.draft_ids.shape[1] == reference.config.num_speculative_slots
        assert torch.equal(got.draft_ids, want.draft_ids)
        finite = torch.isfinite(want.draft_logits)
        assert torch.equal(torch.isfinite(got.draft_logits), finite)
        assert_same_logits(got.draft_logits[finite], want.draft_logits[finite], dtype)
        assert (got.confidence is None) == (want.confidence is None)
        if want.confidence is not None:
            assert_same_logits(got.confidence, want.confidence, dtype)


def assert_same_draft(loaded, reference):
    assert type(loaded) is type(reference)
    want = {k: v for k, v in reference.config.to_dict().items() if k not in WRITER_KEYS}
    got = {k: v for k, v in loaded.config.to_dict().items() if k not in WRITER_KEYS}
    assert got == want
    mine, theirs = loaded.state_dict(), reference.state_dict()
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert mine[name].dtype == tensor.dtype, name
        assert torch.equal(mine[name], tensor), name  # bit for bit: loading copies tensors, it computes nothing


def load_case(built, name, **extra):
    draft, folder, options = built[name]
    return draft, folder, load_draft(folder, **{**options, **extra})


def copy_case(built, name, tmp_path) -> Path:
    destination = tmp_path / name
    shutil.copytree(built[name][1], destination)
    return destination


def rewrite_tensors(folder: Path, edit) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def rewrite_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


# ----------------------------------------------------------------------------------------------------------------------
# Each dialect loads as the draft it encodes
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_dialect_is_recognised(built, name):
    assert identify(built[name][1]) == CASES[name][1]


@pytest.mark.parametrize("name", CASES)
def test_dialect_loads_as_the_same_draft(built, name):
    reference, _, loaded = load_case(built, name)
    assert_same_draft(loaded, reference)
    assert all(p.device.type == "cpu" for p in loaded.parameters())  # nothing left on the meta device
    assert_same_proposals(loaded, reference)


def test_kimi_shapes_and_conventions_survive(built):
    """The scaled-down Kimi checkpoints: bf16 kept, shards read, YaRN and speculators' layer ids converted."""
    _, folder, dflash = load_case(built, "modelopt-kimi")
    assert (folder / "model.safetensors.index.json").is_file()
    assert dflash.dtype == torch.bfloat16 and dflash.config.num_target_layers == 61
    assert dflash.config.rope_parameters == {"rope_type": "yarn", "factor": 16.0,
                                             "original_max_position_embeddings": 4096, "rope_theta": 50000.0}
    assert dflash.config.target_layer_ids == [1, 12, 24, 35, 47, 58]  # z-lab default: evenly over 1..N-3
    _, folder, dspark = load_case(built, "novita-kimi-dspark")
    assert dspark.dtype == torch.bfloat16
    assert dspark.config.target_layer_ids == [0, 28, 56]  # aux [1, 29, 57] read hidden_states[a]
    assert dspark.config.sample_from_anchor and dspark.config.num_speculative_slots == 8
    assert (dspark.config.draft_vocab_size, dspark.config.vocab_size) == (125, 640)
    assert int(dspark.t2d.sum()) == 125 and not torch.equal(dspark.d2t, torch.zeros_like(dspark.d2t))


def peer_markov_bias(tensors: dict, head_type: str, prev, hidden, state):
    """The Markov bias as speculators/DeepSpec compute it, from their tensors (REFERENCE.md section 4)."""
    e = tensors["markov_head.markov_w1.weight"][prev]
    w2 = tensors["markov_head.markov_w2.weight"]
    if head_type == "vanilla":
        return e @ w2.T, state
    if head_type == "gated":
        gate = torch.sigmoid(torch.cat([hidden, e], -1) @ tensors["markov_head.gate_proj.weight"].T
                             + tensors["markov_head.gate_proj.bias"])
        return (gate * e) @ w2.T, state
    joint = torch.cat([state, e, hidden], -1) @ tensors["markov_head.joint_proj.weight"].T \
        + tensors["markov_head.joint_proj.bias"]
    g, cand, out = joint.chunk(3, -1)
    g = torch.sigmoid(g)
    return torch.tanh(out) @ w2.T, g * state + (1 - g) * torch.tanh(cand)


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_loaded_markov_heads_compute_the_peers_math(tmp_path, head_type):
    draft = dialects.tiny_dspark_draft(head_type=head_type, dtype=torch.float32)
    folder = dialects.write_speculators(tmp_path / head_type, draft, _verifier(tmp_path))
    loaded = load_draft(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    state = torch.zeros(2, loaded.config.markov_rank)
    for step in range(3):  # several steps, so the rnn state is exercised
        prev = torch.randint(0, loaded.config.vocab_size, (2,), generator=generator)
        hidden = torch.randn(2, loaded.config.hidden_size, generator=generator)
        want, want_state = peer_markov_bias(tensors, head_type, prev, hidden, state)
        with torch.no_grad():
            got, got_state, _ = loaded.markov_head(prev, hidden, state)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)
        state = got_state


# ----------------------------------------------------------------------------------------------------------------------
# Round trips and exported layouts
# ----------------------------------------------------------------------------------------------------------------------


def convert(src, dst, *args):
    assert cli_main(["convert", str(src), str(dst), *args]) == 0


@pytest.mark.parametrize("name", CASES)
def test_convert_load_export_load_is_exact(built, name, tmp_path, capsys):
    reference, folder, options = built[name]
    layers = ["--num-target-layers", str(options["num_target_layers"])] if "num_target_layers" in options else []
    convert(folder, tmp_path / "hf", *layers)
    assert f": {CASES[name][1]} -> " in capsys.readouterr().out  # the CLI says which dialect it read
    first = load_draft(tmp_path / "hf")
    assert_same_draft(first, reference)
    native = CASES[name][2]
    verifier = _verifier(tmp_path, reference.config.num_target_layers)
    export_draft(first, tmp_path / "native", to=native, verifier=verifier)
    second = load_draft(tmp_path / "native")
    assert_same_draft(second, reference)
    export_draft(second, tmp_path / "again", to=native, verifier=verifier)
    (config_a, layout_a), (config_b, layout_b) = (dialects.read_folder(tmp_path / d) for d in ("native", "again"))
    assert layout_a == layout_b
    assert {k: v for k, v in config_a.items() if k not in WRITER_KEYS} == \
        {k: v for k, v in config_b.items() if k not in WRITER_KEYS}


def _tensors(folder):
    files = sorted(Path(folder).glob("*.safetensors"))
    return {name: tensor for file in files for name, tensor in load_file(str(file)).items()}


def assert_same_tensors(exported, fixture):
    mine, theirs = _tensors(exported), _tensors(fixture)
    assert sorted(mine) == sorted(theirs)
    for name, tensor in theirs.items():  # bit for bit: an export copies tensors, it computes nothing
        assert mine[name].dtype == tensor.dtype and torch.equal(mine[name], tensor), name


def without_versions(config: dict) -> dict:
    config = {k: v for k, v in config.items() if k != "transformers_version"}
    if isinstance(config.get("transformer_layer_config"), dict):
        config["transformer_layer_config"] = without_versions(config["transformer_layer_config"])
    return config


@pytest.mark.parametrize("name", ["speculators-dflash-pruned", "speculators-dflash-full", "speculators-dspark-gated",
                                  "speculators-dspark-rnn", "speculators-090-dspark", "speculators-dflash2"])
def test_speculators_export_matches_the_dialect(built, name, tmp_path):
    _, folder, loaded = load_case(built, name)
    fixture_config = json.loads((folder / "config.json").read_text())
    verifier = fixture_config["speculators_config"]["verifier"]["name_or_path"]
    export_draft(loaded, tmp_path / "out", to="speculators", verifier=verifier)
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert without_versions(exported) == without_versions(fixture_config)
    assert_same_tensors(tmp_path / "out", folder)


def test_speculators_export_of_novita_kimi_has_its_keys_and_tensors(built, tmp_path):
    _, folder, loaded = load_case(built, "novita-kimi-dspark")
    export_draft(loaded, tmp_path / "out", to="speculators", verifier=dialects.KIMI_VERIFIER)
    fixture_config = json.loads((folder / "config.json").read_text())
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    # Novita's fork wrote transformers-4 spellings (torch_dtype, rope_theta in the layer config); we write today's.
    assert set(exported) == {"dtype" if k == "torch_dtype" else k for k in fixture_config}
    same = {k for k in fixture_config if k not in ("torch_dtype", "transformers_version", "transformer_layer_config")}
    assert {k: exported[k] for k in same if k != "speculators_config"} == \
        {k: fixture_config[k] for k in same if k != "speculators_config"}
    assert exported["speculators_config"]["proposal_methods"] == fixture_config["speculators_config"]["proposal_methods"]
    assert_same_tensors(tmp_path / "out", folder)
    assert len(_tensors(tmp_path / "out")) == 44  # as the Novita card counts for its 3-layer draft


def test_zlab_export_matches_modelopt_and_zlab_layouts(built, tmp_path):
    _, folder, loaded = load_case(built, "modelopt-kimi")
    export_draft(loaded, tmp_path / "kimi", to="zlab")
    assert json.loads((tmp_path / "kimi" / "config.json").read_text()) == \
        json.loads((folder / "config.json").read_text())
    assert_same_tensors(tmp_path / "kimi", folder)
    _, folder, loaded = load_case(built, "zlab")
    export_draft(loaded, tmp_path / "tiny", to="zlab")
    assert_same_tensors(tmp_path / "tiny", folder)
    # We write ModelOpt's key set: z-lab's own adds auto_map (its dflash.py, which we cannot ship) and
    # transformers-4.57 defaults that no engine reads.
    assert set(json.loads((tmp_path / "tiny" / "config.json").read_text())) == \
        set(dialects.modelopt_config(loaded))


def test_cross_dialect_conversion_keeps_the_draft(built, tmp_path):
    """ModelOpt -> speculators (for vLLM) and DeepSpec -> speculators both load back as the same draft."""
    for name in ("modelopt-kimi", "deepspec-rnn"):
        reference, folder, _ = built[name]
        verifier = _verifier(tmp_path, reference.config.num_target_layers)
        convert(folder, tmp_path / name, "--to", "speculators", "--verifier", verifier)
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["aux_hidden_state_layer_ids"] == [t + 1 for t in reference.config.target_layer_ids]
        assert_same_draft(load_draft(tmp_path / name), reference)


# ----------------------------------------------------------------------------------------------------------------------
# DFlash 2: z-lab's own code agrees, every layout converts to every other, z-lab's spellings and causality
# ----------------------------------------------------------------------------------------------------------------------


def zlab_block(zlab_model, target, context, anchor: int, block_size: int, mask_token_id: int):
    """z-lab `dflash` 0.1.0's draft forward and greedy selector walk for one block (as its `dflash_generate` runs
    them): (block hidden states [1, b, H], proposed ids [1, b - 1])."""
    ids = torch.tensor([[anchor] + [mask_token_id] * (block_size - 1)])
    noise = torch.nn.functional.embedding(ids, target.get_input_embeddings().weight)
    positions = torch.arange(context.shape[1] + block_size)[None]
    hidden = zlab_model(target_hidden=context, noise_embedding=noise, position_ids=positions, use_cache=False)
    proposed, _, _ = zlab_model.propose(hidden[:, 1:], torch.tensor([anchor]), target.get_output_embeddings(), 0.0)
    return hidden, proposed


@pytest.mark.skipif(not ZLAB_INSTALLED, reason="needs z-lab's `dflash` package (pip install --no-deps dflash)")
@pytest.mark.parametrize("name", ["zlab-dflash2-released", "zlab-dflash2-top-level", "zlab-dflash2-causal-mixed",
                                  "exported-from-speculators"])
def test_zlab_dflash2_loads_as_zlabs_own_code_computes(built, tmp_path, name):
    """Our load of a z-lab DFlash 2 folder and z-lab's own `DFlash2DraftModel.from_pretrained` of it give the same
    block states and proposals: the field placement, `is_causal`, sliding windows and bare codebooks are read as z-lab
    reads them. A sliding layer made causal (and a full one bidirectional) by z-lab's default is the third case; the
    fourth is our z-lab export of speculators' bidirectional sliding layer (so z-lab reads what we write)."""
    from dflash.model import DFlash2DraftModel as ZLabDFlash2DraftModel

    if name == "zlab-dflash2-causal-mixed":
        reference = dialects.tiny_dflash2_draft(seed=15, layer_types=["sliding_attention", "full_attention"],
                                                sliding_window=3)
        folder = dialects.write_zlab_dflash2(tmp_path / name, reference)
    elif name == "exported-from-speculators":
        reference, source, _ = built["speculators-dflash2"]
        folder = export_draft(load_draft(source), tmp_path / name, to="zlab")
    else:
        reference, folder, _ = built[name]
    ours = load_draft(folder, dtype="float32")
    zlab = ZLabDFlash2DraftModel.from_pretrained(folder, dtype=torch.float32).eval()
    config = ours.config
    target = embedding_target(reference)
    ours.bind_target(target)
    context = torch.randn(1, 7, len(config.target_layer_ids) * config.target_hidden_size,
                          generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for anchor in (3, 40):
            want_hidden, want_ids = zlab_block(zlab, target, context, anchor, config.block_size, config.mask_token_id)
            got_hidden = ours.block_hidden(context, torch.tensor([anchor]), DFlashContextCache())
            assert_same_logits(got_hidden, want_hidden, torch.float32)
            assert torch.equal(ours.propose(context, torch.tensor([anchor]), DFlashContextCache()).draft_ids, want_ids)
        # Negative control: flipping z-lab's causality of the first (sliding) layer moves the states far off.
        zlab.layers[0].self_attn.is_causal = not zlab.layers[0].self_attn.is_causal
        flipped, _ = zlab_block(zlab, target, context, 3, config.block_size, config.mask_token_id)
        assert float((flipped - want_hidden).abs().max()) > 1e-3


@pytest.mark.parametrize("name", DFLASH2_CASES)
def test_dflash2_converts_between_every_layout(built, name, tmp_path):
    """ours -> z-lab -> speculators -> ours and back, each hop through the CLI, each result the same draft. A draft
    with z-lab's optional scale fields cannot go to speculators (its dflash2 config has no such fields): refused."""
    reference, folder, _ = built[name]
    verifier = _verifier(tmp_path, reference.config.num_target_layers)
    sets_scales = any(getattr(reference.config, f) is not None for f in ("input_embedding_scale", "output_multiplier",
                                                                        "final_logit_softcapping"))
    hops = ["zlab", "hf"] if sets_scales else ["zlab", "speculators", "hf", "speculators", "zlab"]
    source = folder
    for i, to in enumerate(hops):
        destination = tmp_path / f"{i}-{to}"
        convert(source, destination, "--to", to, "--verifier", verifier)
        assert_same_draft(load_draft(destination), reference)
        source = destination
    if sets_scales:
        loaded = load_draft(folder)
        with pytest.raises(ValueError, match="speculators dflash2 config has no input_embedding_scale, "
                                             "output_multiplier, final_logit_softcapping"):
            export_draft(loaded, tmp_path / "refused", to="speculators")
        assert not (tmp_path / "refused").exists()
        exported = json.loads((tmp_path / "0-zlab" / "config.json").read_text())["dflash_config"]
        assert (exported["input_embedding_scale"], exported["output_multiplier"],
                exported["final_logit_softcapping"]) == (1.5, 0.75, 8.0)


def test_zlab_dflash2_export_matches_the_released_layout(built, tmp_path):
    _, folder, loaded = load_case(built, "zlab-dflash2-released")
    export_draft(loaded, tmp_path / "out", to="zlab")
    fixture = json.loads((folder / "config.json").read_text())
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["architectures"] == ["DFlash2DraftModel"] and "block_size" not in exported
    assert exported["dflash_config"] == fixture["dflash_config"]  # block size and the four DFlash 2 fields in it
    assert "is_causal" not in exported  # causal sliding layers: z-lab's default, so nothing to say
    # The rest as ModelOpt writes z-lab configs (a Qwen3 config's keys; the dtype under today's spelling).
    differ = {"torch_dtype", "tie_word_embeddings"}
    assert {k: v for k, v in exported.items() if k not in differ} == \
        {k: fixture[k] for k in exported if k not in differ}
    assert_same_tensors(tmp_path / "out", folder)
    # Bidirectional sliding layers are said the z-lab 0.1.0 way: a top-level is_causal false.
    _, _, bidirectional = load_case(built, "zlab-dflash2-top-level")
    export_draft(bidirectional, tmp_path / "bidirectional", to="zlab")
    exported = json.loads((tmp_path / "bidirectional" / "config.json").read_text())
    assert exported["is_causal"] is False and "causal" not in exported["dflash_config"]


def test_dflash2_codebooks_spelled_with_weight_load(built, tmp_path):
    """A checkpoint re-saved from z-lab's model (its codebooks are `nn.Embedding`s) names them `...codebook.weight`."""
    reference = built["zlab-dflash2-top-level"][0]
    folder = dialects.write_zlab_dflash2(tmp_path / "suffixed", reference, top_level=True, suffixed_codebooks=True)
    loaded = load_draft(folder)
    assert_same_draft(loaded, reference)
    export_draft(loaded, tmp_path / "out", to="zlab")  # written back bare, as released
    assert "candidate_selector.predecessor_codebook" in _tensors(tmp_path / "out")


def test_zlab_is_causal_true_over_sliding_layers_only_is_the_default(built, tmp_path):
    reference = built["zlab-dflash2-released"][0]
    folder = copy_case(built, "zlab-dflash2-released", tmp_path)
    rewrite_config(folder, lambda c: c.update(is_causal=True))
    assert_same_draft(load_draft(folder), reference)
    rewrite_config(folder, lambda c: c.update(is_causal=False))
    assert not load_draft(folder).config.sliding_window_causal


# ----------------------------------------------------------------------------------------------------------------------
# Errors name the problem; nothing is half-loaded or half-written
# ----------------------------------------------------------------------------------------------------------------------


def test_unknown_dialect_lists_what_was_checked(tmp_path):
    dialects.write_folder(tmp_path, {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
                          {"w": torch.zeros(1)})
    with pytest.raises(ValueError) as error:
        load_draft(tmp_path)
    for checked in ("model_type", "'llama'", "speculators_model_type", "DFlashDraftModel", "dflash_config",
                    "Qwen3DSparkModel", "target_layer_ids"):
        assert checked in str(error.value)


def test_missing_and_extra_tensors_are_named(built, tmp_path):
    folder = copy_case(built, "zlab", tmp_path)

    def edit(tensors):
        del tensors["layers.1.mlp.down_proj.weight"]
        tensors["layers.0.self_attn.g_proj.weight"] = torch.zeros(2, 2)

    rewrite_tensors(folder, edit)
    with pytest.raises(ValueError, match=r"missing tensors: layers\.1\.mlp\.down_proj\.weight.*"
                                         r"unexpected tensors: layers\.0\.self_attn\.g_proj\.weight"):
        load_draft(folder)


def test_shape_mismatch_is_named(built, tmp_path):
    folder = copy_case(built, "zlab", tmp_path)
    rewrite_tensors(folder, lambda t: t.update({"fc.weight": t["fc.weight"][:, :-8].contiguous()}))
    with pytest.raises(ValueError, match=r"shape mismatches: fc\.weight: checkpoint \[32, 56\] vs expected \[32, 64\]"):
        load_draft(folder)


def test_half_a_vocabulary_map_is_named(built, tmp_path):
    folder = copy_case(built, "speculators-dspark-rnn", tmp_path)
    rewrite_tensors(folder, lambda t: t.pop("t2d"))
    with pytest.raises(ValueError, match=r"missing tensors: t2d"):
        load_draft(folder)


@pytest.mark.parametrize("corrupt,message", [
    (lambda t: t["d2t"].__setitem__(0, t["d2t"][0] + 1), "disagree"),  # maps a draft id to an id t2d did not keep
    (lambda t: t["d2t"].__setitem__(-1, 10_000), "outside the target vocabulary"),
    (lambda t: t.update(t2d=torch.ones_like(t["t2d"])), "kept ids, expected draft_vocab_size=40"),
    (lambda t: t.update(t2d=t["t2d"][:-1].contiguous()), r"shape mismatches: t2d: checkpoint \[95\] vs expected \[96\]"),
])
def test_inconsistent_vocabulary_maps_are_named(built, tmp_path, corrupt, message):
    folder = copy_case(built, "speculators-dspark-rnn", tmp_path)
    rewrite_tensors(folder, corrupt)
    with pytest.raises(ValueError, match=message):
        load_draft(folder)


@pytest.mark.parametrize("name,edit,field", [
    ("speculators-dspark-gated", lambda c: c.update(aux_hidden_state_layer_ids=[0, 3]), "aux_hidden_state_layer_ids"),
    ("speculators-dspark-gated", lambda c: c.update(aux_hidden_state_layer_ids=[2, 5]), "aux_hidden_state_layer_ids"),
    ("zlab", lambda c: c["dflash_config"].update(target_layer_ids=[0, 4]), "dflash_config.target_layer_ids"),
    ("deepspec-rnn", lambda c: c.update(target_layer_ids=[-1, 2]), "target_layer_ids"),
])
def test_target_layer_ids_out_of_range_are_named(built, tmp_path, name, edit, field):
    folder = copy_case(built, name, tmp_path)
    rewrite_config(folder, edit)
    with pytest.raises(ValueError, match=rf"target layer ids out of range: {field}=.*\[0, 4\)"):
        load_draft(folder)


def test_speculators_without_a_readable_verifier_asks_for_the_depth(built):
    _, folder, _ = built["novita-kimi-dspark"]
    with pytest.raises(ValueError, match="pass num_target_layers=N"):
        load_draft(folder, local_files_only=True)


def test_zlab_export_refuses_what_zlab_cannot_hold(built, tmp_path):
    _, _, dspark = load_case(built, "speculators-dspark-gated")
    with pytest.raises(ValueError, match="DFlash and DFlash 2 drafts only"):
        export_draft(dspark, tmp_path / "a", to="zlab")
    _, _, own_head = load_case(built, "speculators-dflash-full")
    with pytest.raises(ValueError, match="has its own"):
        export_draft(own_head, tmp_path / "b", to="zlab")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_failed_conversion_leaves_destination_untouched(built, tmp_path):
    broken = copy_case(built, "zlab", tmp_path)
    rewrite_tensors(broken, lambda t: t.pop("norm.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: norm\.weight"):
        convert(broken, tmp_path / "new")
    convert(built["zlab"][1], tmp_path / "kept")
    before = {p.name: p.read_bytes() for p in (tmp_path / "kept").iterdir()}
    with pytest.raises(ValueError):
        convert(broken, tmp_path / "kept", "--overwrite")
    with pytest.raises(FileExistsError):
        convert(built["zlab"][1], tmp_path / "kept")
    assert {p.name: p.read_bytes() for p in (tmp_path / "kept").iterdir()} == before
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "zlab"]  # no temporary folders left behind


def test_overwrite_replaces_atomically(built, tmp_path):
    convert(built["zlab"][1], tmp_path / "out")
    convert(built["modelopt-kimi"][1], tmp_path / "out", "--overwrite")
    assert load_draft(tmp_path / "out").config.num_target_layers == 61
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("edit,named", [
    (lambda c: c["dflash_config"].update(projector_type="dspark"), "projector_type='dspark'"),
    (lambda c: c["dflash_config"].update(attention_sink_bias=True), "attention_sink_bias=True"),
    (lambda c: c.update(rope_theta=None, rope_scaling={"rope_type": "default", "rope_theta": 1e4,
                                                        "partial_rotary_factor": 0.5}), "partial_rotary_factor=0.5"),
    (lambda c: c.update(quantization_config={"quant_method": "modelopt"}), "quantization_config: 'modelopt'"),
])
def test_variants_we_do_not_compute_are_refused_by_name(built, tmp_path, edit, named):
    folder = copy_case(built, "modelopt-kimi", tmp_path)
    rewrite_config(folder, edit)
    with pytest.raises(ValueError, match=named):
        load_draft(folder)


def test_modelopt_all_layer_sliding_window(built, tmp_path, caplog):
    """ModelOpt's `use_swa`: every layer slides over `swa_window_size`, bidirectionally, as our layers do."""
    folder = copy_case(built, "modelopt-kimi", tmp_path)
    rewrite_config(folder, lambda c: (c.update(sliding_window=64),
                                      c["dflash_config"].update(use_swa=True, swa_window_size=64, causal=False)))
    with caplog.at_level(logging.WARNING, logger="dflash_hf.formats"):
        loaded = load_draft(folder)
    assert loaded.config.layer_types == ["sliding_attention"] * 6 and loaded.config.sliding_window == 64
    assert "bidirectionally" not in caplog.text
    export_draft(loaded, tmp_path / "out", to="zlab")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["sliding_window"] == 64 and exported["dflash_config"]["causal"] is False
    assert_same_draft(load_draft(tmp_path / "out"), loaded)


def test_sliding_layer_causality_is_carried_over(built, tmp_path):
    folder = copy_case(built, "zlab", tmp_path)
    rewrite_config(folder, lambda c: c.update(layer_types=["sliding_attention", "full_attention"], sliding_window=8))
    loaded = load_draft(folder)
    assert loaded.config.layer_types == ["sliding_attention", "full_attention"] and loaded.config.sliding_window == 8
    assert loaded.config.sliding_window_causal  # z-lab's default
    rewrite_config(folder, lambda c: c["dflash_config"].update(causal=False))
    assert not load_draft(folder).config.sliding_window_causal
    # z-lab 0.1.0 spells it as a top-level is_causal; a bool applies to every layer (false: the full one stays
    # bidirectional, as ours always are).
    rewrite_config(folder, lambda c: (c["dflash_config"].pop("causal"), c.update(is_causal=False)))
    assert not load_draft(folder).config.sliding_window_causal
