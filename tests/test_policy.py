"""The speculation-length policy: its arithmetic, its choices under known costs, and generate under it (exact)."""

import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

from dflash_hf.policy_dflash import (
    COST_REFRESH_STEPS,
    OPTION_MIN_STEPS,
    PROBE_BUDGET,
    PROBE_INTERVAL,
    PROBE_INTERVAL_MAX,
    AcceptanceRates,
    ConfidenceCalibration,
    CostTable,
    LengthPolicy,
    MeasuredCosts,
    expected_tokens,
)
from tiny import make_successor_target, oracle_dspark, random_dflash, tiny_target

MS = 1e-3


def filled(points: dict) -> dict:
    """A machine's cost at every size from 1 to the largest given, linear between the given ones (the smallest
    given below it)."""
    sizes = sorted(points)
    out = {n: points[sizes[0]] for n in range(1, sizes[0])}
    for low, high in zip(sizes, sizes[1:]):
        for n in range(low, high):
            out[n] = points[low] + (n - low) / (high - low) * (points[high] - points[low])
    out[sizes[-1]] = points[sizes[-1]]
    return out


def costs(verify_ms: dict, draft_ms: dict | None = None) -> MeasuredCosts:
    """Measurements of every size up to the largest given (the policy measures any size it has not seen)."""
    measured = MeasuredCosts()
    for _ in range(2):  # the first measurement of a size is its warm-up, dropped
        for rows, ms in filled(verify_ms).items():
            measured.verify.observe(rows, ms * MS)
        for slots, ms in (filled(draft_ms) if draft_ms else {}).items():
            measured.draft_table("draft").observe(slots, ms * MS)
    return measured


def test_expected_tokens():
    assert expected_tokens([]) == [1.0]
    assert expected_tokens([0.5, 0.5]) == [1.0, 1.5, 1.75]
    assert expected_tokens([1.0, 0.0, 1.0]) == [1.0, 2.0, 2.0, 2.0]


def test_cost_table_drops_the_warm_up_keeps_the_median_and_infers_nothing():
    table = CostTable()
    table.observe(1, 300 * MS)  # a shape's first run: warm-up
    assert table.estimate(1) is None
    for ms in (70, 64, 90):
        table.observe(1, ms * MS)
    assert table.estimate(1) == pytest.approx(70 * MS)
    for ms in (110, 120, 100):
        table.observe(9, ms * MS)
    assert table.estimate(9) == pytest.approx(110 * MS)
    assert table.estimate(5) is None  # between measured sizes: unknown too (costs are not monotonic), to be measured


def test_costs_measured_under_load_are_measured_again_once_it_goes():
    """Another process held the cores while the sizes were measured (a decode 200 ms, a 2-row verify 360): a draft
    accepted half the time then loses to plain decoding. Once the load goes, the decode's median follows on the plain
    steps and every size measured when a decode cost over COST_STALE_RATIO times more is unknown again, so the policy
    measures it instead of decoding plainly for good."""
    policy = LengthPolicy(costs({1: 200, 2: 360, 8: 420}, {1: 40, 7: 40}), max_slots=7)
    for _ in range(20):
        policy.costs.rates("draft").observe(7, 1)
    assert policy.plan_draft("draft") == (0, False)
    policy.record(None, 0, 0, False, 0.1)  # decodes at 100 ms now: the median (200, 100) is 150, not stale yet
    assert policy.plan_draft("draft") == (0, False)
    policy.record(None, 0, 0, False, 0.1)
    assert policy.costs.verify.estimate(1) == pytest.approx(0.1)
    assert policy.plan_draft("draft") == (1, False)  # the 2-row verify and the draft step are measured again
    assert policy.costs.verify.estimate(1) == pytest.approx(0.1)  # the decode's own estimate stands


def test_a_dearer_or_slightly_cheaper_decode_keeps_the_estimates():
    """Load arriving makes every size dearer, and the sizes in use are measured again by being used; a decode 20%
    cheaper is within COST_STALE_RATIO (noise, a shorter context). Neither drops what was measured."""
    for decode_ms in (300, 80):
        measured = costs({1: 100, 2: 180, 8: 210}, {7: 20})
        for _ in range(8):
            measured.verify.observe(1, decode_ms * MS)
        assert measured.verify.estimate(1) == pytest.approx(decode_ms * MS)
        assert measured.verify.estimate(2) == pytest.approx(180 * MS)
        assert measured.draft_table("draft").estimate(7) == pytest.approx(20 * MS)


def test_acceptance_rates_learn_per_position_and_decay():
    rates = AcceptanceRates(prior=0.5)
    assert rates.rates(3) == [0.5, 0.5, 0.5]
    for _ in range(30):
        rates.observe(proposed=4, accepted=1)  # position 1 always accepted, position 2 never
    first, second, third = rates.rates(3)
    assert first > 0.9 and second < 0.1
    assert third == pytest.approx(second, abs=0.05)  # never reached: borrows its predecessor's rate


def test_costly_rows_and_weak_drafts_mean_plain_decoding():
    """float32 on a CPU: a verify of 8 rows costs two decodes; a draft accepted a third of the time loses."""
    policy = LengthPolicy(costs({1: 100, 2: 180, 8: 210}, {7: 20}), max_slots=7)
    for _ in range(20):
        policy.costs.rates("draft").observe(7, 0)
    assert policy.plan_draft("draft") == (0, False)


def test_cheap_rows_and_good_drafts_mean_full_blocks():
    """A GPU: a verify of 8 rows costs about one decode."""
    policy = LengthPolicy(costs({1: 10, 2: 10.2, 8: 11}, {7: 2}), max_slots=7)
    for _ in range(20):
        policy.costs.rates("draft").observe(7, 7)
    assert policy.plan_draft("draft") == (7, False)


def test_unknown_costs_are_measured_first():
    policy = LengthPolicy(MeasuredCosts(), max_slots=7)
    for _ in range(2):  # decode steps first (the first one warms up)
        assert policy.plan_draft("draft") == (0, False)
        policy.record(None, 0, 0, False, 50 * MS)
    assert policy.plan_draft("draft") == (1, False)  # then every block size, smallest first


def test_a_size_cheaper_than_its_neighbours_is_found():
    """Weight-first verify matmuls on a float32 CPU: 2 rows cost less than a decode, 3 and more cost more. Every size
    is measured once, and a draft accepted 40% of the time then proposes one token a step."""
    machine = {1: 64, 2: 50, 3: 72, 4: 66, 5: 90, 6: 98, 7: 108, 8: 110}
    policy = LengthPolicy(costs({1: 64}, {1: 10, 7: 14}), max_slots=7)
    for _ in range(20):
        policy.costs.rates("draft").observe(1, 0)
        policy.costs.rates("draft").observe(1, 1)
    swept = []
    for _ in range(20):
        slots, probe = policy.plan_draft("draft")
        swept.append(slots)
        policy.record("draft" if slots else None, slots, 0, probe, machine[slots + 1] * MS)
    assert swept[:14] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]  # each twice: the first run warms it up
    assert set(swept[14:]) == {1}


def test_a_size_measured_in_a_slow_moment_is_measured_again():
    """A 2-row verify measured dear in the first steps (above the decode) and never chosen again would never be
    measured again, so a good draft would propose two or four tokens a step where one wins. A size left unchosen for
    COST_REFRESH_STEPS steps is measured again, and wins from then on."""
    machine = {1: 56, 2: 47, 3: 70, 4: 80, 5: 90, 6: 95, 7: 100, 8: 110}
    policy = LengthPolicy(costs({**machine, 2: 90}), max_slots=7)
    for _ in range(50):
        policy.costs.rates("draft").observe(7, 1)
        policy.costs.rates("draft").observe(7, 0)  # half the first slots accepted
    chosen = []
    for _ in range(2000):
        k, _, _ = policy.choose("draft", 7, None)
        chosen.append(k)
        policy.record(None, k, 0, False, machine[k + 1] * MS)  # costs only: the acceptance stays as set
    first = chosen.index(1)  # measured again (the sizes are, in turn, smallest first)
    assert chosen[:first] == [2] * first and first <= COST_REFRESH_STEPS
    assert policy.costs.verify.estimate(2) == pytest.approx(47 * MS)
    later = chosen[first + 1 :]
    assert later.count(1) >= 0.97 * len(later), later  # what wins, with the other sizes measured again now and then


def test_the_confidence_head_cuts_the_block():
    """DSpark: after drafting, slots the head doubts are not worth their verify rows."""
    policy = LengthPolicy(costs({1: 100, 2: 120, 3: 140, 4: 160, 8: 240}), max_slots=7)
    k, expected, seconds = policy.choose("draft", 7, [0.95, 0.9, 0.05, 0.05, 0.05, 0.05, 0.05])
    assert k == 2 and expected == pytest.approx(1 + 0.95 + 0.95 * 0.9)
    assert seconds == pytest.approx(0.14)  # the draft is paid for: only the verify weighs
    assert policy.choose("draft", 7, [0.1] * 7)[0] == 0  # a likely miss is not worth its rows


def test_calibration_maps_predictions_to_observed_acceptance():
    calibration = ConfidenceCalibration()
    assert calibration([0.05, 0.62, 0.97]) == pytest.approx([0.05, 0.62, 0.97])  # nothing seen: taken at its word
    for step in range(100):  # the head says 0.6 at both slots; the target accepts the first a third of the time
        calibration.observe([0.62, 0.61, 0.9], accepted=1 if step % 3 == 0 else 0)
    low, mid, high = calibration([0.05, 0.65, 0.97])
    assert low == pytest.approx(0.05) and high == pytest.approx(0.97)  # bins never tested keep the prediction
    assert mid == pytest.approx(0.25, abs=0.05)  # per three steps the 0.6 bin saw four slots tested, one accepted


def test_an_over_confident_head_stops_winning_steps():
    """A head trusted at its word makes a marginal block look worth its rows; what the target accepts corrects it."""
    policy = LengthPolicy(costs({1: 100, 2: 130, 3: 160, 8: 300}), max_slots=7)
    head = [0.65] * 7
    assert policy.choose("draft", 7, head)[0] > 0
    for _ in range(20):
        k = policy.choose("draft", 7, head)[0]
        policy.record("draft", max(k, 1), 0, False, 0.13)
    assert policy.choose("draft", 7, head)[0] == 0
    assert policy.choose("draft", 7, [0.95] * 7)[0] > 0  # a confident slot in a bin the target never refuted


def test_a_confident_draft_is_run_only_while_its_choices_pay_for_it():
    """DSpark must draft before its head says whether to verify: a draft whose head keeps cutting the block to
    nothing costs a draft step for no token, whatever the rates of the steps it did verify say. It then looks now and
    then, within the probe budget, and the head (not a forced verify) says what a look proposes."""
    policy = LengthPolicy(costs({1: 100, 2: 180, 8: 210}, {7: 20}), max_slots=7)
    for _ in range(20):
        policy.costs.rates("draft").observe(7, 7)  # the few verified blocks were all accepted
    for _ in range(OPTION_MIN_STEPS):
        assert policy.plan_draft("draft") == (7, False)
        assert policy.choose("draft", 7, [0.1] * 7)[0] == 0  # ... but most drafts are cut to nothing
    looks = []
    for step in range(200):
        slots, probe = policy.plan_draft("draft")
        assert not probe
        if slots:
            looks.append(step)
            assert policy.choose("draft", 7, [0.1] * 7)[0] == 0
        policy.record(None, 0, 0, False, 0.1)
    spacing = policy.probe_spacing(20 * MS)
    assert spacing == round(20 / (100 * PROBE_BUDGET))
    assert looks and all(b - a == spacing for a, b in zip(looks, looks[1:]))
    for _ in range(2):  # the text turned predictable: looks whose choices pay
        while not policy.plan_draft("draft")[0]:
            policy.record(None, 0, 0, False, 0.1)
        assert policy.choose("draft", 7, [0.99] * 7)[0] == 7
    assert policy.plan_draft("draft") == (7, False)  # drafting every step again


def test_hopeless_drafting_still_probes_less_and_less_often():
    # Cheap probes (a verify row costs 4% of a decode, as on a GPU), so the schedule, not the budget, spaces them.
    policy = LengthPolicy(costs({1: 100, 2: 104, 8: 130}, {1: 1, 7: 1}), max_slots=7)
    for _ in range(20):
        policy.costs.rates("draft").observe(7, 0)
    probes = []
    for step in range(500):
        slots, probe = policy.plan_draft("draft")
        if probe:
            probes.append(step)
        policy.record("draft" if slots else None, slots, 0, probe, 0.1)
    assert probes[0] == PROBE_INTERVAL - 1
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == [2 * PROBE_INTERVAL, 4 * PROBE_INTERVAL, 8 * PROBE_INTERVAL, 16 * PROBE_INTERVAL]
    assert set(gaps[4:]) <= {PROBE_INTERVAL_MAX}
    # The schedule belongs to the measurements, not the call: a new call does not start probing afresh.
    call = LengthPolicy(policy.costs, max_slots=7)
    call.costs.idle_steps = 0
    for _ in range(2 * PROBE_INTERVAL):
        assert call.plan_draft("draft") == (0, False)
        call.record(None, 0, 0, False, 0.1)


def test_costly_probes_stay_within_their_budget():
    """float32 on a CPU: a probe (draft + a 2-row verify) costs a decode more than a decode step; probes then wait until
    they cost at most PROBE_BUDGET of the decode time, whatever the schedule, and a draft the policy has just
    written off again (the interval back at its start) does not probe every few steps."""
    policy = LengthPolicy(costs({1: 100, 2: 180, 8: 210}, {1: 20, 7: 20}), max_slots=7)
    for _ in range(20):
        policy.costs.rates("draft").observe(7, 0)
    spacing = policy.probe_spacing((180 + 20 - 100) * MS)  # a 2-row verify and a draft, beyond a decode
    assert spacing == round(100 / (100 * PROBE_BUDGET))
    probes = []
    for step in range(1000):
        policy.costs.probe_interval = PROBE_INTERVAL  # as after a step the policy drafted of its own accord
        slots, probe = policy.plan_draft("draft")
        if probe:
            probes.append(step)
        policy.record("draft" if slots else None, slots, 0, probe, {0: 0.1, 1: 0.18}.get(slots, 0.21))
    assert probes and all(b - a >= spacing for a, b in zip(probes, probes[1:]))
    assert probes[0] == spacing - 1


def test_fixed_policy_is_todays_behaviour():
    policy = LengthPolicy(costs({1: 100, 8: 1000}), max_slots=7, mode="fixed")
    assert policy.plan_draft("draft") == (7, False)
    assert policy.choose("draft", 5, [0.01] * 5) == (5, None, None)
    with pytest.raises(ValueError, match="dflash_policy"):
        LengthPolicy(MeasuredCosts(), max_slots=7, mode="fastest")


def slow_rows(target, per_extra_row_s: float, base_s: float = 0.0):
    """Make each target forward cost `base_s` more, and `per_extra_row_s` per row beyond the first (a CPU's verify,
    exaggerated). A base that dwarfs the tiny model's own time makes the costs the policy measures these, not the
    machine's noise (a busy core once made a full block's verify look dearer than a shorter one's)."""

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows = 0 if ids is None else ids.shape[1]
        time.sleep(base_s + per_extra_row_s * max(rows - 1, 0))

    return target.register_forward_pre_hook(hook, with_kwargs=True)


def test_generate_skips_drafting_when_rows_are_costly_and_drafts_wrong():
    """A draft that is always wrong and verify rows that cost 20 ms each: the policy settles on decode steps, and the
    output stays the target's own."""
    target = tiny_target("llama", vocab_size=16)
    draft = random_dflash(target, block_size=6, layer_ids=[1, 2])
    ids = torch.tensor([[3, 9, 4, 11]])
    expected = target.generate(ids, do_sample=False, max_new_tokens=60, eos_token_id=None)
    handle = slow_rows(target, 0.02)
    try:
        out = target.generate(ids, do_sample=False, max_new_tokens=60, eos_token_id=None, assistant_model=draft)
    finally:
        handle.remove()
    assert torch.equal(out, expected)
    steps = draft.generation_stats["policy"]
    assert sum(step["k"] == 0 for step in steps[-30:]) >= 24  # mostly plain decode steps once measured
    assert all(len(p) == step["k"] for p, step in zip(draft.generation_stats["proposals"], steps))


def test_generate_drafts_full_blocks_when_rows_are_cheap_and_drafts_right():
    target = make_successor_target(tiny_target("llama", vocab_size=16))
    draft = oracle_dspark(target, block_size=6)
    ids = torch.tensor([[4, 5]])
    expected = target.generate(ids, do_sample=False, max_new_tokens=60, eos_token_id=None)
    handle = slow_rows(target, 0.0, base_s=0.05)  # every forward ~50 ms, whatever its rows
    try:
        out = target.generate(ids, do_sample=False, max_new_tokens=60, eos_token_id=None, assistant_model=draft,
                              generation_config=GenerationConfig(dflash_policy="auto"))
    finally:
        handle.remove()
    assert torch.equal(out, expected)
    steps = draft.generation_stats["policy"]
    slots = draft.config.num_speculative_slots
    sweep = [0, 0] + [k for k in range(1, slots + 1) for _ in range(2)]  # decode, then each size, twice (warm-up)
    assert [step["k"] for step in steps[: len(sweep)]] == sweep
    later = steps[len(sweep) :]
    assert later and sum(step["k"] == slots for step in later) >= len(later) - 1  # then full blocks, all accepted
    weighed = draft.generation_stats["cost_estimates_ms"]  # what it chose from, as the call left it
    assert sorted(weighed["verify"]) == list(range(1, slots + 2))
    assert all(ms >= 50 for ms in weighed["verify"].values())  # each forward slept 50 ms
    assert sorted(weighed["draft"]) == ["draft"] and slots in weighed["draft"]["draft"]


def test_generate_recovers_from_a_loaded_start():
    """Verify rows dear while the policy measures them (every forward 30 ms more, and 60 ms per extra row: speculation
    loses even with a draft always right), then the load goes (10 ms a forward, rows free): the policy, which had
    settled on plain decoding, measures the sizes again and drafts blocks, all in one generate call."""
    target = make_successor_target(tiny_target("llama", vocab_size=16))
    draft = oracle_dspark(target, block_size=6)
    ids = torch.tensor([[4, 5]])
    expected = target.generate(ids, do_sample=False, max_new_tokens=100, eos_token_id=None)
    forwards = []

    def load(module, args, kwargs):
        rows = kwargs["input_ids"].shape[1]
        forwards.append(rows)
        loaded = len(forwards) <= 20
        time.sleep(0.03 + 0.06 * (rows - 1) if loaded else 0.01)

    handle = target.register_forward_pre_hook(load, with_kwargs=True)
    try:
        out = target.generate(ids, do_sample=False, max_new_tokens=100, eos_token_id=None, assistant_model=draft)
    finally:
        handle.remove()
    assert torch.equal(out, expected)
    ks = [step["k"] for step in draft.generation_stats["policy"]]
    slots = draft.config.num_speculative_slots
    assert ks[12:19].count(0) == 7  # settled on plain decoding under the load (after the sweep of every size)
    after = ks[19:-1]  # once the load went (the last step is cut to the length budget)
    assert set(range(1, slots + 1)) <= set(after)  # every size measured again
    assert min(after[-4:]) >= slots - 1  # and blocks drafted (one noisy measurement may favour one slot less)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_length_choice_is_exact(data):
    """Whatever k the policy picks each step (0 = decode, a cut block, a cut lookup), greedy output is the target's."""
    target = make_successor_target(tiny_target("llama", vocab_size=16))
    wrong = data.draw(st.sets(st.integers(0, 15), max_size=5), label="draft wrong after")
    draft = oracle_dspark(target, block_size=data.draw(st.integers(2, 8), label="block"), wrong_after=wrong)
    lookup = data.draw(st.sampled_from([None, 3, 9]), label="lookup tokens")
    choices = iter(data.draw(st.lists(st.integers(0, 9), min_size=80, max_size=80), label="k per step"))
    original_choose = LengthPolicy.choose

    def plan(self, source):
        return next(choices), False

    def choose(self, source, available, confidence):
        _, expected, seconds = original_choose(self, source, available, confidence)
        return min(next(choices), available), expected, seconds

    ids = torch.tensor([data.draw(st.lists(st.integers(0, 15), min_size=1, max_size=6), label="prompt")])
    max_new = data.draw(st.integers(1, 40), label="max_new_tokens")
    expected = target.generate(ids, do_sample=False, max_new_tokens=max_new, eos_token_id=None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LengthPolicy, "plan_draft", plan)
        patch.setattr(LengthPolicy, "choose", choose)
        out = target.generate(ids, do_sample=False, max_new_tokens=max_new, eos_token_id=None, assistant_model=draft,
                              prompt_lookup_num_tokens=lookup)
    assert out.tolist() == expected.tolist()
    steps = draft.generation_stats["policy"]
    assert all(len(p) == step["k"] for p, step in zip(draft.generation_stats["proposals"], steps))


def test_looked_up_steps_do_not_restart_the_draft_probing():
    """Prompt lookup proposing (and being accepted) says nothing about the draft: the draft's probes stay rare."""
    policy = LengthPolicy(costs({1: 100, 2: 180, 8: 210}, {1: 20, 7: 20}), max_slots=7)
    for _ in range(20):
        policy.costs.rates("draft").observe(7, 0)
    policy.costs.probe_interval = PROBE_INTERVAL_MAX
    for _ in range(PROBE_INTERVAL_MAX - 1):
        assert policy.plan_draft("draft") == (0, False)
        policy.record("lookup", 6, 4, False, 0.15)
    assert policy.costs.probe_interval == PROBE_INTERVAL_MAX
    assert policy.plan_draft("draft")[1]  # the long interval ran out: now a probe


def test_a_written_off_source_is_tried_again():
    """Prompt lookup that failed on prose is passed over, but not forever: its learnt rates fade toward the prior."""
    policy = LengthPolicy(costs({1: 100, 2: 120, 4: 150, 17: 300}), max_slots=7)
    for _ in range(20):
        policy.costs.rates("lookup").observe(16, 0)
    passed_over = 0
    while policy.choose("lookup", 16, None)[0] == 0:
        passed_over += 1
        assert passed_over < 200, "never tried again"
    assert passed_over > 10  # but not at once


def test_a_batch_size_not_measured_borrows_the_nearest_larger_one():
    """Rows finishing shrink a batch one size at a time: each size starts from its neighbours' costs, not from zero."""
    measured = MeasuredCosts()
    for _ in range(2):  # the first measurement of a size is its warm-up, dropped
        measured.verify_table(8).observe(1, 0.2)
        measured.verify_table(8).observe(4, 0.3)
        measured.verify_table(2).observe(1, 0.1)
    assert measured.verify_estimate(6, 4) == 0.3  # the larger neighbour: an upper bound
    assert measured.verify_estimate(6, 1) == 0.2
    assert measured.verify_estimate(12, 1) == 0.2  # nothing larger: the nearest smaller
    assert measured.verify_estimate(2, 1) == 0.1  # its own, once measured
    assert measured.verify_estimate(1, 1) == 0.1 and measured.verify_estimate(1, 4) == 0.3
    policy = LengthPolicy(measured, max_slots=7, batch=6)
    assert policy.plan_draft("draft")[0] > 0  # no decode step spent measuring what is known


def test_the_estimates_reported_are_the_ones_weighed_per_batch_size():
    measured = MeasuredCosts()
    for _ in range(2):  # the first measurement of a size is its warm-up, dropped
        measured.verify.observe(1, 0.05)
        measured.verify.observe(3, 0.08)
        measured.verify_table(4).observe(3, 0.2)
        measured.draft_table("draft").observe(2, 0.01)
        measured.draft_table("draft", batch=4).observe(2, 0.03)
    measured.verify.observe(5, 0.5)  # a warm-up only: no estimate yet, nothing reported
    assert measured.estimates_ms() == {"verify": {1: 50.0, 3: 80.0}, "draft": {"draft": {2: 10.0}}}
    assert measured.estimates_ms(batch=4) == {"verify": {3: 200.0}, "draft": {"draft": {2: 30.0}}}
