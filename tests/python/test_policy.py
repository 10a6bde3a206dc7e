"""The coordinator's pure policies, driven by tables of cases."""

import dataclasses

import pytest

from cotenant.coordinator import policy
from cotenant.coordinator.policy import (
    ADMIT, QUEUE, REFUSE, Baseline, BaselineConfig, JobObservation as Job, MemoryPolicyConfig, SharePolicyConfig,
)

MiB = 1 << 20
GiB = 1 << 30
G, O = policy.GUARANTEED, policy.OPPORTUNISTIC
CONFIG = MemoryPolicyConfig(headroom_bytes=1 * GiB, burst_margin_bytes=512 * MiB, min_cap_bytes=2 * MiB)


# (case, device total, jobs, expected caps by job id)
MEMORY_CASES = [
    ("guaranteed_alone_gets_everything_but_the_headroom", 16 * GiB,
     [Job(1, G, device_bytes=4 * GiB, allocated_bytes=4 * GiB, cap=15 * GiB)],
     {1: 15 * GiB}),
    ("opportunistic_alone_gets_everything_it_wants_and_the_rest_stays_unlent", 16 * GiB,
     [Job(2, O, device_bytes=2 * GiB, cap=None)],
     {2: 2 * GiB + 512 * MiB}),
    ("spare_beyond_guaranteed_need_goes_to_opportunistic_up_to_its_want", 16 * GiB,
     [Job(1, G, device_bytes=4 * GiB, allocated_bytes=4 * GiB, cap=8 * GiB),
      Job(2, O, device_bytes=3 * GiB, cap=4 * GiB)],
     {1: 15 * GiB - (3 * GiB + 512 * MiB), 2: 3 * GiB + 512 * MiB}),
    ("opportunistic_jobs_split_a_short_spare_evenly", 10 * GiB,
     [Job(1, G, device_bytes=5 * GiB, allocated_bytes=5 * GiB - 512 * MiB, cap=5 * GiB),
      Job(2, O, device_bytes=4 * GiB, cap=4 * GiB), Job(3, O, device_bytes=4 * GiB, cap=4 * GiB)],
     {1: 5 * GiB, 2: 2 * GiB, 3: 2 * GiB}),
    ("water_filling_gives_a_small_job_its_want_and_the_rest_to_the_big_one", 10 * GiB,
     [Job(1, G, device_bytes=4 * GiB + 512 * MiB, allocated_bytes=4 * GiB, cap=4 * GiB + 512 * MiB),
      Job(2, O, device_bytes=512 * MiB, cap=GiB), Job(3, O, device_bytes=4 * GiB, cap=4 * GiB)],
     {1: 4 * GiB + 512 * MiB, 2: GiB, 3: 3 * GiB + 512 * MiB}),
    ("guaranteed_burst_shrinks_opportunistic_at_once_but_grows_guaranteed_only_into_free_memory", 16 * GiB,
     # g bursts from 4 to 10 GiB (6 GiB spilled to host); o holds 8 GiB on the device.
     [Job(1, G, device_bytes=4 * GiB, host_bytes=6 * GiB, allocated_bytes=10 * GiB, cap=4 * GiB),
      Job(2, O, device_bytes=8 * GiB, cap=8 * GiB)],
     # o shrinks to the spare (15 - 10.5); g grows only by the 3 GiB free now (15 - 12 used).
     {1: 7 * GiB, 2: 4 * GiB + 512 * MiB}),
    ("after_opportunistic_shrank_guaranteed_cap_reaches_its_need", 16 * GiB,
     [Job(1, G, device_bytes=7 * GiB, host_bytes=3 * GiB, allocated_bytes=10 * GiB, cap=7 * GiB),
      Job(2, O, device_bytes=4 * GiB + 512 * MiB, host_bytes=3 * GiB + 512 * MiB, cap=4 * GiB + 512 * MiB)],
     {1: 10 * GiB + 512 * MiB, 2: 4 * GiB + 512 * MiB}),
    ("opportunistic_cap_does_not_grow_while_guaranteed_has_spilled_bytes", 16 * GiB,
     [Job(1, G, device_bytes=6 * GiB, host_bytes=1 * GiB, allocated_bytes=5 * GiB, cap=6 * GiB),
      Job(2, O, device_bytes=2 * GiB, host_bytes=4 * GiB, cap=2 * GiB)],
     {1: 15 * GiB - 2 * GiB, 2: 2 * GiB}),
    ("opportunistic_grows_again_once_guaranteed_memory_is_back", 16 * GiB,
     [Job(1, G, device_bytes=7 * GiB, allocated_bytes=5 * GiB, cap=13 * GiB),
      Job(2, O, device_bytes=2 * GiB, host_bytes=4 * GiB, cap=2 * GiB)],
     {1: 15 * GiB - (6 * GiB + 512 * MiB), 2: 6 * GiB + 512 * MiB}),
    ("guaranteed_cache_above_live_bytes_is_lent_to_opportunistic", 16 * GiB,
     [Job(1, G, device_bytes=10 * GiB, allocated_bytes=2 * GiB, cap=10 * GiB),
      Job(2, O, device_bytes=6 * GiB, host_bytes=6 * GiB, cap=5 * GiB)],
     {1: 2 * GiB + 512 * MiB, 2: 12 * GiB + 512 * MiB}),
    ("administrator_cap_bounds_a_job", 16 * GiB,
     [Job(1, G, device_bytes=GiB, allocated_bytes=GiB, cap=GiB),
      Job(2, O, device_bytes=6 * GiB, cap=6 * GiB, user_cap=3 * GiB)],
     # g would get 12 GiB, but grows only into the 8 GiB free until o has shrunk.
     {1: 9 * GiB, 2: 3 * GiB}),
    ("two_guaranteed_jobs_over_the_gpu_are_scaled_to_fit_and_opportunistic_gets_the_minimum", 8 * GiB,
     [Job(1, G, device_bytes=5 * GiB, allocated_bytes=5 * GiB - 512 * MiB, cap=5 * GiB),
      Job(2, G, device_bytes=5 * GiB, allocated_bytes=5 * GiB - 512 * MiB, cap=5 * GiB),
      Job(3, O, device_bytes=GiB, cap=GiB)],
     {1: 3 * GiB + 512 * MiB, 2: 3 * GiB + 512 * MiB, 3: 2 * MiB}),
    ("a_guaranteed_job_over_its_cap_mid_burst_grows_only_into_free_memory", 16 * GiB,
     # g allocated 2 GiB over its cap since its last safe point; o still holds 6 GiB: nothing is free.
     [Job(1, G, device_bytes=10 * GiB, allocated_bytes=10 * GiB, cap=8 * GiB),
      Job(2, O, device_bytes=6 * GiB, cap=6 * GiB)],
     {1: 8 * GiB, 2: 4 * GiB + 512 * MiB}),
    ("two_guaranteed_jobs_bursting_at_once_share_the_free_memory", 16 * GiB,
     # 2 GiB free: the first takes it, the second waits for o to shrink.
     [Job(1, G, device_bytes=4 * GiB, host_bytes=2 * GiB, allocated_bytes=6 * GiB, cap=4 * GiB),
      Job(2, G, device_bytes=4 * GiB, host_bytes=2 * GiB, allocated_bytes=6 * GiB, cap=4 * GiB),
      Job(3, O, device_bytes=5 * GiB, cap=5 * GiB)],
     {1: 6 * GiB, 2: 4 * GiB, 3: 2 * GiB}),
    ("a_guaranteed_cap_waits_for_what_opportunistic_may_take_back_under_the_cap_it_follows", 16 * GiB,
     # o spilled ahead to 4 GiB under the 8 GiB cap it applied: it may bring 4 GiB back before
     # it applies its lower cap, so g grows into the 3 GiB left (15 - 8 - 4), not 7.
     [Job(1, G, device_bytes=4 * GiB, host_bytes=2 * GiB, allocated_bytes=6 * GiB, cap=4 * GiB),
      Job(2, O, device_bytes=4 * GiB, host_bytes=2 * GiB, cap=8 * GiB, cap_bound=8 * GiB)],
     {1: 7 * GiB, 2: 6 * GiB + 512 * MiB}),
    ("queued_opportunistic_job_gets_the_minimum_cap", 16 * GiB,
     [Job(1, G, device_bytes=GiB, allocated_bytes=GiB, cap=15 * GiB),
      Job(2, O, device_bytes=GiB, cap=GiB, admitted=False)],
     {1: 15 * GiB - 2 * MiB, 2: 2 * MiB}),
]


@pytest.mark.parametrize("case,total,jobs,expected", MEMORY_CASES, ids=[c[0] for c in MEMORY_CASES])
def test_memory_caps(case, total, jobs, expected):
    caps = policy.plan_memory_caps(total, jobs, CONFIG)
    assert caps == expected


@pytest.mark.parametrize("case,total,jobs,expected", MEMORY_CASES, ids=[c[0] for c in MEMORY_CASES])
def test_memory_caps_never_lend_the_headroom_or_go_below_one_page(case, total, jobs, expected):
    caps = policy.plan_memory_caps(total, jobs, CONFIG)
    assert all(cap >= CONFIG.min_cap_bytes for cap in caps.values())
    opportunistic = sum(caps[j.job_id] for j in jobs if j.role == O)
    guaranteed_need = sum(min(j.live_bytes + CONFIG.burst_margin_bytes, total) for j in jobs if j.role == G)
    assert opportunistic <= max(len([j for j in jobs if j.role == O]) * CONFIG.min_cap_bytes,
                                total - CONFIG.headroom_bytes - guaranteed_need)


@pytest.mark.parametrize("case,total,jobs,expected", MEMORY_CASES, ids=[c[0] for c in MEMORY_CASES])
def test_a_guaranteed_cap_grows_only_into_memory_free_now(case, total, jobs, expected):
    caps = policy.plan_memory_caps(total, jobs, CONFIG)
    grown = [j for j in jobs if j.role == G and j.cap is not None and caps[j.job_id] > j.cap]
    if grown:
        held = sum(j.may_hold_bytes for j in jobs)
        assert held + sum(max(0, caps[j.job_id] - j.may_hold_bytes) for j in grown) <= total - CONFIG.headroom_bytes


# (case, current share, slowdown, expected)
SHARE_STEPS = [
    ("no_measurement_holds", 0.5, None, 0.5),
    ("under_target_adds", 0.5, 1.0, 0.55),
    ("just_under_the_band_adds", 0.5, 1.029, 0.55),
    ("inside_the_band_holds", 0.5, 1.04, 0.5),
    ("at_target_holds", 0.5, 1.05, 0.5),
    ("over_target_halves", 0.5, 1.2, 0.25),
    ("never_above_one", 0.98, 1.0, 1.0),
    ("paused_starts_climbing", 0.0, 1.0, 0.05),
    ("halving_above_the_pause_floor_halves", 0.04, 2.0, 0.02),
    ("halving_under_the_pause_floor_pauses", 0.015, 2.0, 0.0),
]


@pytest.mark.parametrize("case,current,slowdown,expected", SHARE_STEPS, ids=[c[0] for c in SHARE_STEPS])
def test_aimd_share_step(case, current, slowdown, expected):
    assert policy.next_share(current, slowdown, SharePolicyConfig()) == pytest.approx(expected)


# (case, current shares, slowdowns, warming up, has guaranteed, pinned, admitted, expected)
SHARE_PLANS = [
    ("no_guaranteed_job_everyone_runs_unthrottled", {2: 0.3}, [], False, False, {}, {}, {2: 1.0}),
    ("guaranteed_warming_up_pauses_opportunistic", {2: 0.7, 3: 1.0}, [None], True, True, {}, {}, {2: 0.0, 3: 0.0}),
    ("worst_guaranteed_slowdown_decides", {2: 0.8}, [1.0, 1.3], False, True, {}, {}, {2: 0.4}),
    ("pinned_share_is_kept", {2: 0.8}, [2.0], False, True, {2: 0.9}, {}, {2: 0.9}),
    ("queued_job_stays_paused", {2: 0.0}, [1.0], False, True, {}, {2: False}, {2: 0.0}),
]


@pytest.mark.parametrize("case,current,slowdowns,warming,has_g,pinned,admitted,expected", SHARE_PLANS,
                         ids=[c[0] for c in SHARE_PLANS])
def test_share_plan(case, current, slowdowns, warming, has_g, pinned, admitted, expected):
    shares = policy.plan_shares(current, slowdowns, warming, has_g, pinned=pinned, admitted=admitted)
    assert shares == pytest.approx(expected)


def test_aimd_reaches_a_pause_in_a_few_decisions_from_full_share():
    share, decisions = 1.0, 0
    while share > 0.0:
        share = policy.next_share(share, 2.0)
        decisions += 1
    assert decisions == 7  # 1/2 ... 1/64, then 1/128 = 0.0078 < 0.01 pauses; rounding alone took 21


def test_min_share_wins_over_the_pause_floor():
    config = SharePolicyConfig(min_share=0.02)
    assert policy.next_share(0.03, 2.0, config) == pytest.approx(0.02)
    assert policy.next_share(0.015, 2.0, SharePolicyConfig(min_share=0.005)) == pytest.approx(0.005)
    # A floor of 0 keeps plain halving.
    assert policy.next_share(0.001, 2.0, SharePolicyConfig(pause_below=0.0)) == pytest.approx(0.0005)


def test_aimd_converges_below_target_under_a_share_dependent_slowdown():
    # A guaranteed job slowed by 20% at full opportunistic share, linearly: the
    # share settles where the slowdown sits at or under the target.
    share, history = 0.0, []
    for _ in range(200):
        slowdown = 1.0 + 0.2 * share
        share = policy.next_share(share, slowdown)
        history.append(slowdown)
    tail = history[-50:]
    assert max(tail) <= 1.05 + 0.2 * 0.05  # at most one additive step over the target
    assert sum(tail) / len(tail) >= 1.01   # and it does use the room it has


# (case, state, iteration count, summed iteration time in ns, expected)
BASELINE_CASES = [
    ("skips_the_first_iterations", Baseline(), 2, 9_000_000, Baseline()),
    ("opens_the_window_after_the_skipped_iterations", Baseline(), 3, 9_000_000,
     Baseline(start_count=3, start_total_ns=9_000_000)),
    ("waits_for_a_full_window", Baseline(start_count=3, start_total_ns=9_000_000), 12, 9_900_000,
     Baseline(start_count=3, start_total_ns=9_000_000)),
    # 10 iterations took 1 ms together: 100 µs each, whatever came before the window
    ("takes_the_window_mean_when_the_window_is_full", Baseline(start_count=3, start_total_ns=9_000_000), 13,
     10_000_000, Baseline(3, 100.0, 9_000_000)),
    ("a_measured_baseline_never_changes", Baseline(3, 100.0), 500, 900_000_000, Baseline(3, 100.0)),
    ("a_measurement_again_skips_from_where_it_was_asked", Baseline(skip_until=503), 502, 90_000_000,
     Baseline(skip_until=503)),
    ("and_opens_there", Baseline(skip_until=503), 503, 90_000_000,
     Baseline(start_count=503, start_total_ns=90_000_000, skip_until=503)),
]


@pytest.mark.parametrize("case,state,count,total_ns,expected", BASELINE_CASES, ids=[c[0] for c in BASELINE_CASES])
def test_baseline_warm_up(case, state, count, total_ns, expected):
    assert policy.update_baseline(state, count, total_ns, BaselineConfig(skip_iterations=3, window_iterations=10)) \
        == expected


def test_the_baseline_is_the_windows_mean_not_an_ewma_that_remembers_the_warm_up():
    # A job's warm-up steps run without its data loading (26 ms), the steps
    # after with it (48 ms). The EWMA (weight 1/8) at the window's end still
    # holds a quarter of the warm-up: a baseline 12% low, and the job alone
    # looks 12% slow, over any target an opportunistic neighbour could meet.
    times_ms = [26.0] * 3 + [48.0] * 10
    config = BaselineConfig(skip_iterations=3, window_iterations=10)
    state, total_ns, ewma = Baseline(), 0, 0.0
    for count, took in enumerate(times_ms, start=1):
        total_ns += int(took * 1e6)
        ewma = took if count == 1 else ewma + (took - ewma) / 8
        state = policy.update_baseline(state, count, total_ns, config)
    assert state.baseline_us == pytest.approx(48_000.0)
    assert ewma * 1000 < 0.9 * state.baseline_us  # what the EWMA would have made of it
    assert policy.slowdown_of(48_000.0, state) == pytest.approx(1.0)


# (case, state, iterations paused, slowdown, re-measured)
REMEASURE_CASES = [
    ("still_slow_after_a_warm_ups_worth_of_paused_iterations", Baseline(3, 100.0), 13, 1.2, True),
    ("at_the_climbing_threshold_counts_as_slow", Baseline(3, 100.0), 13, 1.03, True),
    ("not_yet_a_warm_ups_worth", Baseline(3, 100.0), 12, 1.2, False),
    ("under_the_climbing_threshold_the_share_climbs_again", Baseline(3, 100.0), 40, 1.02, False),
    ("no_slowdown_measured", Baseline(3, 100.0), 40, None, False),
    ("already_warming_up", Baseline(skip_until=50), 40, 1.5, False),
]


@pytest.mark.parametrize("case,state,paused,slowdown,remeasured", REMEASURE_CASES,
                         ids=[c[0] for c in REMEASURE_CASES])
def test_a_pause_that_leaves_the_job_slow_measures_its_baseline_again(case, state, paused, slowdown, remeasured):
    updated = policy.remeasure_after_pause(state, 1000, paused, slowdown,
                                           BaselineConfig(skip_iterations=3, window_iterations=10),
                                           SharePolicyConfig(target_slowdown=1.05, tolerance=0.02))
    if remeasured:
        assert updated == Baseline(skip_until=1003) and updated.warming_up
    else:
        assert updated == state


def test_slowdown_is_iteration_time_over_baseline_and_none_while_warming_up():
    assert policy.slowdown_of(150.0, Baseline(0, 100.0)) == pytest.approx(1.5)
    assert policy.slowdown_of(150.0, Baseline()) is None
    assert policy.slowdown_of(0.0, Baseline(0, 100.0)) is None


# (case, persistent, total, guaranteed live, admitted opportunistic persistent, decision, words in the reason)
ADMISSION_CASES = [
    ("fits_next_to_everyone", 2 * GiB, 16 * GiB, 8 * GiB, 2 * GiB, ADMIT, ""),
    ("exactly_fits", 5 * GiB, 16 * GiB, 8 * GiB, 2 * GiB, ADMIT, ""),
    ("does_not_fit_now_is_queued", 6 * GiB, 16 * GiB, 8 * GiB, 2 * GiB, QUEUE, "does not fit"),
    ("larger_than_the_gpu_less_headroom_is_refused", 15 * GiB + 1, 16 * GiB, 0, 0, REFUSE, "can ever give"),
    ("zero_persistent_always_fits", 0, 16 * GiB, 15 * GiB, 0, ADMIT, ""),
]


@pytest.mark.parametrize("case,persistent,total,g_live,o_persistent,decision,reason", ADMISSION_CASES,
                         ids=[c[0] for c in ADMISSION_CASES])
def test_salus_admission(case, persistent, total, g_live, o_persistent, decision, reason):
    admission = policy.admit_opportunistic(persistent, total, g_live, o_persistent, CONFIG)
    assert admission.decision == decision
    assert reason in admission.reason
    if decision != ADMIT:
        assert admission.reason.endswith(("grow", "frees up", "batch"))  # says what happens or what to do


def _in_cgroup(job_id, role, gib, room_gib, group):
    """A job whose GiB are all live on the device, at that cap, in cgroup `group` with `room_gib` to pin."""
    return Job(job_id, role, device_bytes=gib * GiB, allocated_bytes=gib * GiB, cap=gib * GiB,
               host_room_bytes=room_gib * GiB, host_room_groups=(group,))


# (case, jobs, planned caps, host room, expected caps, expected held back)
HOST_BOUND_CASES = [
    ("unknown_host_memory_bounds_nothing",
     [Job(2, O, device_bytes=8 * GiB, allocated_bytes=8 * GiB, cap=8 * GiB)], {2: 4 * GiB}, None,
     {2: 4 * GiB}, {}),
    ("a_squeeze_that_fits_is_left_alone",
     [Job(2, O, device_bytes=8 * GiB, allocated_bytes=8 * GiB, cap=8 * GiB)], {2: 4 * GiB}, 4 * GiB,
     {2: 4 * GiB}, {}),
    ("no_room_keeps_the_live_device_bytes_where_they_are",
     [Job(2, O, device_bytes=8 * GiB, allocated_bytes=8 * GiB, cap=8 * GiB)], {2: 4 * GiB}, 0,
     {2: 8 * GiB}, {2: 4 * GiB}),
    ("negative_room_is_no_room",
     [Job(2, O, device_bytes=8 * GiB, allocated_bytes=8 * GiB, cap=8 * GiB)], {2: 4 * GiB}, -GiB,
     {2: 8 * GiB}, {2: 4 * GiB}),
    ("kept_host_pages_take_a_squeeze_first_then_the_room",
     # 4 GiB to spill: 1 GiB into the pages it keeps, 1 GiB of room; 2 GiB stay on the device.
     [Job(2, O, device_bytes=8 * GiB, host_pool_bytes=GiB, allocated_bytes=8 * GiB, cap=8 * GiB)], {2: 4 * GiB},
     GiB, {2: 6 * GiB}, {2: 2 * GiB}),
    ("cache_above_the_live_bytes_goes_back_without_pinning",
     [Job(2, O, device_bytes=8 * GiB, allocated_bytes=3 * GiB, cap=8 * GiB)], {2: 3 * GiB}, 0,
     {2: 3 * GiB}, {}),
    ("bytes_spilled_already_are_not_pinned_again",
     # 10 GiB live, 4 on the host: 6 on the device, 2 of them above the new cap.
     [Job(2, O, device_bytes=6 * GiB, host_bytes=4 * GiB, allocated_bytes=10 * GiB, cap=6 * GiB)], {2: 4 * GiB},
     2 * GiB, {2: 4 * GiB}, {}),
    ("two_opportunistic_squeezes_share_the_room_evenly",
     [Job(2, O, device_bytes=8 * GiB, allocated_bytes=8 * GiB, cap=8 * GiB),
      Job(3, O, device_bytes=8 * GiB, allocated_bytes=8 * GiB, cap=8 * GiB)], {2: 4 * GiB, 3: 4 * GiB}, 4 * GiB,
     {2: 6 * GiB, 3: 6 * GiB}, {2: 2 * GiB, 3: 2 * GiB}),
    ("opportunistic_squeezes_come_before_a_guaranteed_one",
     [Job(1, G, device_bytes=6 * GiB, allocated_bytes=6 * GiB, cap=6 * GiB),
      Job(2, O, device_bytes=4 * GiB, allocated_bytes=4 * GiB, cap=4 * GiB)], {1: 5 * GiB, 2: 2 * GiB}, 2 * GiB,
     {1: 6 * GiB, 2: 2 * GiB}, {1: GiB}),
    ("an_administrators_cap_is_never_raised_and_takes_the_room_first",
     [Job(2, O, device_bytes=8 * GiB, allocated_bytes=8 * GiB, cap=8 * GiB, user_cap=5 * GiB),
      Job(3, O, device_bytes=8 * GiB, allocated_bytes=8 * GiB, cap=8 * GiB)], {2: 5 * GiB, 3: 6 * GiB}, 2 * GiB,
     {2: 5 * GiB, 3: 8 * GiB}, {3: 2 * GiB}),
    ("a_jobs_own_room_holds_back_its_squeeze_on_a_roomy_host",
     # Its memory cgroup leaves it 1 GiB to pin: it would stop part way, over its cap, so the cap stays higher.
     [Job(2, O, device_bytes=8 * GiB, allocated_bytes=8 * GiB, cap=8 * GiB, host_room_bytes=GiB)], {2: 4 * GiB},
     1 << 50, {2: 7 * GiB}, {2: 3 * GiB}),
    ("a_job_at_its_own_limit_keeps_its_pages",
     [Job(2, O, device_bytes=8 * GiB, allocated_bytes=8 * GiB, cap=8 * GiB, host_room_bytes=0)], {2: 4 * GiB},
     1 << 50, {2: 8 * GiB}, {2: 4 * GiB}),
    ("a_jobs_own_room_holds_when_the_nodes_is_unknown",
     [Job(2, O, device_bytes=8 * GiB, allocated_bytes=8 * GiB, cap=8 * GiB, host_room_bytes=2 * GiB)], {2: 4 * GiB},
     None, {2: 6 * GiB}, {2: 2 * GiB}),
    ("node_room_a_limited_job_cannot_use_goes_to_the_others",
     [Job(2, O, device_bytes=8 * GiB, allocated_bytes=8 * GiB, cap=8 * GiB, host_room_bytes=GiB),
      Job(3, O, device_bytes=8 * GiB, allocated_bytes=8 * GiB, cap=8 * GiB)], {2: 4 * GiB, 3: 4 * GiB}, 6 * GiB,
     {2: 7 * GiB, 3: 4 * GiB}, {2: 3 * GiB}),
    ("an_administrators_cap_is_not_raised_for_the_jobs_own_room_either",
     [Job(2, O, device_bytes=8 * GiB, allocated_bytes=8 * GiB, cap=8 * GiB, user_cap=5 * GiB, host_room_bytes=GiB)],
     {2: 5 * GiB}, 1 << 50, {2: 5 * GiB}, {}),
    ("jobs_of_one_cgroup_share_its_room",
     # Two ranks in one container: each reads the container's 2 GiB of room, which they share.
     [_in_cgroup(2, O, 8, 2, "pod"), _in_cgroup(3, O, 8, 2, "pod")], {2: 4 * GiB, 3: 4 * GiB}, 1 << 50,
     {2: 7 * GiB, 3: 7 * GiB}, {2: 3 * GiB, 3: 3 * GiB}),
    ("jobs_of_two_cgroups_each_have_their_own_room",
     [_in_cgroup(2, O, 8, 2, "a"), _in_cgroup(3, O, 8, 2, "b")], {2: 4 * GiB, 3: 4 * GiB}, 1 << 50,
     {2: 6 * GiB, 3: 6 * GiB}, {2: 2 * GiB, 3: 2 * GiB}),
    ("in_a_shared_cgroup_the_opportunistic_squeeze_comes_first",
     [_in_cgroup(1, G, 6, 3, "pod"), _in_cgroup(2, O, 4, 3, "pod")], {1: 4 * GiB, 2: 2 * GiB}, 1 << 50,
     {1: 5 * GiB, 2: 2 * GiB}, {1: GiB}),
]


@pytest.mark.parametrize("case,jobs,planned,room,expected,held_back", HOST_BOUND_CASES,
                         ids=[c[0] for c in HOST_BOUND_CASES])
def test_squeezes_are_held_back_to_keep_the_host_headroom(case, jobs, planned, room, expected, held_back):
    bound = policy.bound_squeezes_by_host(planned, jobs, room)
    assert bound.caps == expected
    assert bound.held_back == held_back
    by_id = {j.job_id: j for j in jobs}
    pins = sum(by_id[k].pins_under(c) for k, c in bound.caps.items())
    assert all(bound.caps[k] >= planned[k] for k in planned)  # a cap only ever stays higher
    mandatory = sum(j.pins_under(planned[j.job_id]) for j in jobs if j.user_cap is not None)
    if room is not None:
        assert pins <= max(room, mandatory)
    groups = {}
    for job_id, cap in bound.caps.items():  # no job is asked to pin past its own room, but an administrator's cap
        job = by_id[job_id]
        if job.host_room_bytes is not None and job.user_cap is None:
            assert job.pins_under(cap) <= job.host_room_bytes
            for group in job.host_room_groups:
                room, pins = groups.get(group, (job.host_room_bytes, 0))
                groups[group] = (min(room, job.host_room_bytes), pins + job.pins_under(cap))
    assert all(pins <= room for room, pins in groups.values())  # nor a cgroup's jobs past its room together


def test_a_cgroups_room_from_its_jobs_on_other_gpus_bounds_its_jobs_here():
    jobs = [Job(2, O, device_bytes=8 * GiB, allocated_bytes=8 * GiB, cap=8 * GiB, host_room_bytes=3 * GiB,
                host_room_groups=("pod",))]
    bound = policy.bound_squeezes_by_host({2: 4 * GiB}, jobs, 1 << 50, {"pod": GiB, "other": 8 * GiB})
    assert bound.caps == {2: 7 * GiB} and bound.held_back == {2: 3 * GiB}
    assert policy.bound_squeezes_by_host({2: 4 * GiB}, jobs, 1 << 50, {"pod": -GiB}).caps == {2: 8 * GiB}
    # A group room larger than what its jobs here report does not raise theirs.
    assert policy.bound_squeezes_by_host({2: 4 * GiB}, jobs, 1 << 50, {"pod": 8 * GiB}).caps == {2: 5 * GiB}


def _ranks(*own_rooms_gib):
    """Opportunistic jobs of 8 GiB, each in a task cgroup of its own under one limited Slurm step cgroup, each
    reporting the room it may pin (GiB): the step's, or its task's where that limit is nearer."""
    return [Job(2 + i, O, device_bytes=8 * GiB, allocated_bytes=8 * GiB, cap=8 * GiB, host_room_bytes=room * GiB,
                host_room_groups=(f"0::/step/task_{i}", "/step")) for i, room in enumerate(own_rooms_gib)]


def test_ranks_in_sibling_cgroups_share_the_room_of_the_limited_cgroup_above_them():
    # Each rank reads the step's 4 GiB of room; squeezed by 4 GiB each, together they may pin only those 4.
    ranks = _ranks(4, 4)
    rooms = {"0::/step/task_0": 4 * GiB, "0::/step/task_1": 4 * GiB, "/step": 4 * GiB}
    bound = policy.bound_squeezes_by_host({2: 4 * GiB, 3: 4 * GiB}, ranks, 1 << 50, rooms)
    assert bound.caps == {2: 6 * GiB, 3: 6 * GiB} and bound.held_back == {2: 2 * GiB, 3: 2 * GiB}
    # Grouped by their own cgroups only (the exact /proc/<pid>/cgroup text), each would take the step's whole room.
    apart = [dataclasses.replace(j, host_room_groups=j.host_room_groups[:1]) for j in ranks]
    assert policy.bound_squeezes_by_host({2: 4 * GiB, 3: 4 * GiB}, apart, 1 << 50, rooms).caps == \
        {2: 4 * GiB, 3: 4 * GiB}


def test_a_rank_whose_own_limit_is_nearer_leaves_the_rest_of_the_step_to_its_sibling():
    # Rank 0's task cgroup leaves it 1 GiB; the step's 4 GiB go 1 to it and 3 to rank 1 (inner groups first).
    ranks = _ranks(1, 4)
    rooms = {"0::/step/task_0": GiB, "0::/step/task_1": 4 * GiB, "/step": 4 * GiB}
    bound = policy.bound_squeezes_by_host({2: 4 * GiB, 3: 4 * GiB}, ranks, 1 << 50, rooms)
    assert bound.caps == {2: 7 * GiB, 3: 5 * GiB} and bound.held_back == {2: 3 * GiB, 3: GiB}
    # The step's room less what squeezes on other GPUs will pin (the coordinator's reading) bounds both.
    rooms["/step"] = 2 * GiB
    bound = policy.bound_squeezes_by_host({2: 4 * GiB, 3: 4 * GiB}, ranks, 1 << 50, rooms)
    assert bound.caps == {2: 7 * GiB, 3: 7 * GiB}


@pytest.mark.parametrize("case,total,jobs,expected", MEMORY_CASES, ids=[c[0] for c in MEMORY_CASES])
def test_a_roomy_host_changes_no_planned_cap(case, total, jobs, expected):
    caps = policy.plan_memory_caps(total, jobs, CONFIG)
    assert policy.bound_squeezes_by_host(caps, jobs, 1 << 50).caps == expected
