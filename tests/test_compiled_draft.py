"""`draft.compile_draft_step(...)`: the block forward compiled at fixed shapes over a static context cache proposes
what the eager draft proposes, keeps `target.generate(assistant_model=draft)` exact for B = 1 and B > 1, runs its
compiled graph every step (no silent eager fallback, no recompile per step) and says when the context outgrows it.

On the CPU the tests compile with "aot_eager" (seconds); one compiles with inductor (C++ through gcc: up to a minute cold,
seconds once inductor has cached it)."""

import pytest
import torch
from transformers import GenerationConfig

from dflash_hf import DFlashContextCache
from dflash_hf.layers_dflash import StaticContextCache
from test_batched import PAD, left_padded
from test_generate import SMALL_VOCAB, pair
from tiny import make_successor_target, oracle_dspark, random_dflash, random_dflash2, tiny_target

KINDS = ["dflash", "dspark", "dflash2", "sliding_window"]


class CountingBackend:
    """aot_eager, counting the graphs it compiles and the times they run: a step that fell back to eager, or that
    recompiled, shows in the counts."""

    def __init__(self):
        self.compiles = self.calls = 0

    def __call__(self, graph, example_inputs):
        self.compiles += 1
        compiled = torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)

        def run(*args):
            self.calls += 1
            return compiled(*args)

        return run


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every draft compiles the same function: start each test with none of the earlier tests' graphs (they would
    count toward dynamo's recompile limit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=KINDS)
def compiled_pair(request):
    """(target, draft) of a kind; the pair may be shared with other test files, so its draft leaves eager."""
    if request.param == "dflash2":
        target = tiny_target("qwen3", vocab_size=SMALL_VOCAB)
        draft = random_dflash2(target, num_layers=2, layer_ids=[0, 2])
    elif request.param == "sliding_window":  # a DFlash draft whose first layer sees 4 positions either side
        target = tiny_target("qwen3", vocab_size=SMALL_VOCAB)
        draft = random_dflash(target, num_layers=2, layer_ids=[0, 2], sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"])
    else:
        target, draft = pair("qwen3", request.param)
    yield target, draft
    draft.compile_draft_step(None)


def greedy(target, ids, mask=None, assistant_model=None, **kwargs):
    config = GenerationConfig(do_sample=False, pad_token_id=PAD, dflash_policy="fixed", **kwargs)
    return target.generate(ids, attention_mask=mask, generation_config=config, assistant_model=assistant_model)


@torch.no_grad()
def steps(draft, cache, method: str) -> list[torch.Tensor]:
    """Four draft steps of a batch of two, the context growing by a few tokens each time: the block's hidden states
    (`block_hidden`) or proposals (`propose`)."""
    torch.manual_seed(1)
    out = []
    for new, anchors in ((7, [5, 6]), (3, [1, 2]), (1, [3, 3]), (4, [7, 0])):
        context = torch.randn(2, new, draft.fc.in_features)
        if method == "block_hidden":
            out.append(draft.block_hidden(context, torch.tensor(anchors), cache))
        else:
            out.append(draft.propose(context, torch.tensor(anchors), cache).draft_ids)
    return out


def test_compiled_steps_propose_what_the_eager_draft_proposes(compiled_pair):
    target, draft = compiled_pair
    draft.bind_target(target)
    want_hidden = steps(draft, DFlashContextCache(), "block_hidden")
    want_ids = steps(draft, DFlashContextCache(), "propose")
    draft.compile_draft_step(max_context=32, backend="aot_eager")
    cache = draft.new_context_cache()
    assert isinstance(cache, StaticContextCache)
    for got, want in zip(steps(draft, cache, "block_hidden"), want_hidden):
        # The compiled step's attention also sums the masked entries of the buffer (with weight 0): a few ulp off.
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert cache.get_seq_length() == 15
    assert [ids.tolist() for ids in steps(draft, StaticContextCache(32), "propose")] == [i.tolist() for i in want_ids]
    draft.compile_draft_step(None)
    assert isinstance(draft.new_context_cache(), DFlashContextCache)
    # The static cache also serves the eager forward, through the same interface.
    assert [ids.tolist() for ids in steps(draft, StaticContextCache(32), "propose")] == [i.tolist() for i in want_ids]


def test_generate_is_exact_and_every_step_runs_the_compiled_graph(compiled_pair):
    """B = 1, two generate calls: one compile for both (the static cache keeps its buffers), one graph run per draft
    forward."""
    target, draft = compiled_pair
    prompts = [torch.tensor([[1, 3, 2, 5]]), torch.tensor([[4, 4, 9, 1, 3, 7]])]
    want = [greedy(target, ids, max_new_tokens=24) for ids in prompts]
    backend = CountingBackend()
    draft.compile_draft_step(max_context=64, backend=backend)
    forwards = 0
    for ids, expected in zip(prompts, want):
        assert greedy(target, ids, max_new_tokens=24, assistant_model=draft).tolist() == expected.tolist()
        forwards += draft.generation_stats["draft_forwards"]
    assert backend.compiles == 1
    assert backend.calls == forwards > 2


def test_batched_generate_is_exact(compiled_pair):
    """B = 2, left-padded: the padding reaches the compiled step through the cache's validity mask."""
    target, draft = compiled_pair
    ids, mask = left_padded([[1, 3, 2, 5, 7, 4], [6, 9]])
    want = greedy(target, ids, mask, max_new_tokens=20)
    backend = CountingBackend()
    draft.compile_draft_step(max_context=64, backend=backend)
    assert greedy(target, ids, mask, max_new_tokens=20, assistant_model=draft).tolist() == want.tolist()
    assert backend.compiles == 1 and backend.calls == draft.generation_stats["draft_forwards"]


def test_batched_rows_finishing_and_compaction_keep_one_graph():
    """Rows accept different runs (holes, compactions) and finish at different steps (the batch shrinks, the step
    pads it back): still exact, still one compiled graph."""
    target = make_successor_target(tiny_target("llama", vocab_size=SMALL_VOCAB))
    draft = oracle_dspark(target, block_size=4, wrong_after=(5, 11))
    ids, mask = left_padded([[3, 4], [8, 9, 10], [1, 2, 3, 4, 12]])
    want = greedy(target, ids, mask, max_new_tokens=30, eos_token_id=14)
    backend = CountingBackend()
    draft.compile_draft_step(max_context=128, backend=backend)
    assert greedy(target, ids, mask, max_new_tokens=30, eos_token_id=14, assistant_model=draft).tolist() == want.tolist()
    stats = draft.generation_stats
    assert stats["compactions"] >= 1
    assert backend.compiles == 1 and backend.calls == stats["draft_forwards"]


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
def test_inductor_generate_is_exact():
    target, draft = pair("qwen3", "dflash")
    ids = torch.tensor([[1, 3, 2, 5]])
    want = greedy(target, ids, max_new_tokens=16)
    draft.compile_draft_step(max_context=32, backend="inductor")
    try:
        assert greedy(target, ids, max_new_tokens=16, assistant_model=draft).tolist() == want.tolist()
    finally:
        draft.compile_draft_step(None)


def test_overflow_names_max_context(compiled_pair):
    target, draft = compiled_pair
    draft.compile_draft_step(max_context=4, backend="aot_eager")
    with pytest.raises(ValueError, match=r"max_context=4 entries per row, and this step needs 6"):
        greedy(target, torch.tensor([[1, 3, 2, 5, 7, 4]]), max_new_tokens=12, assistant_model=draft)


def test_static_cache_reindexes_as_the_dynamic_one():
    """Rows dropped and entries gathered (a batched compaction): the same K/V and positions, in the first rows."""
    torch.manual_seed(0)
    static, dynamic = StaticContextCache(16), DFlashContextCache()
    for new in (5, 3):
        positions = torch.randint(0, 50, (3, new))
        for cache in (static, dynamic):
            cache.append_positions(positions)
        for layer_idx in range(2):
            k, v = torch.randn(2, 3, 2, new, 4).unbind(0)
            for cache in (static, dynamic):
                cache.append(layer_idx, k, v)
    rows, columns = torch.tensor([2, 0]), torch.tensor([[1, 4, 6], [0, 2, 7]])
    static.reindex(rows, columns)
    dynamic.reindex(rows, columns)
    assert static.get_seq_length() == dynamic.get_seq_length() == 3
    assert torch.equal(static.positions, dynamic.positions)
    like = torch.zeros(2, 1)
    for layer_idx in range(2):
        for got, want in zip(static.layer(layer_idx, like), dynamic.layer(layer_idx, like)):
            assert torch.equal(got, want)
    k, v = torch.randn(2, 2, 2, 1, 4).unbind(0)
    assert static.append(0, k, v)[0].shape == (2, 2, 4, 4)  # appends after the kept entries, to the kept rows
