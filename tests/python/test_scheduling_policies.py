"""The node's scheduling policies, each driven alone with hand-made states."""

import pytest

from cotenant.scheduling.admission import fits_together, refusal
from cotenant.scheduling.policies import DiscretizedLas, Fifo, Packing, TimeSlicing, make_policy
from cotenant.scheduling.state import (
    GUARANTEED, OPPORTUNISTIC, RUNNING, STOPPING, SUSPENDED, JobView, NodeState,
)

GiB = 1 << 30


def job(job_id, num_gpus=1, submit=0.0, **fields):
    return JobView(job_id=job_id, num_gpus=num_gpus, submit_time=submit, **fields)


def running(job_id, gpus, submit=0.0, started=0.0, as_role=GUARANTEED, **fields):
    return JobView(job_id=job_id, num_gpus=len(gpus), submit_time=submit, status=RUNNING, gpus=tuple(gpus),
                   running_role=as_role, first_started_at=started, last_started_at=started, **fields)


def node(*jobs, gpus=2, now=0.0, memory=None):
    return NodeState(now=now, gpu_count=gpus, gpu_memory_bytes=memory, jobs=tuple(jobs))


# --- Salus' admission -----------------------------------------------------------------


def test_salus_counts_every_persistent_set_and_only_the_largest_ephemeral_one():
    a = job(1, persistent_bytes=10 * GiB, peak_bytes=30 * GiB)  # 20 GiB ephemeral
    b = job(2, persistent_bytes=10 * GiB, peak_bytes=15 * GiB)  # 5 GiB ephemeral
    assert fits_together([a, b], 40 * GiB)
    assert not fits_together([a, b], 40 * GiB - 1)


def test_a_job_needing_more_gpus_than_the_node_has_is_refused_by_every_policy():
    state = node(job(1, num_gpus=4), job(2), gpus=2)
    for name in ("fifo", "las", "timeslice", "antman"):
        plan = make_policy(name).plan(state)
        assert "needs 4 GPUs and this node has 2" in plan.refused[1], name
        assert 1 not in plan.placements and 2 in plan.placements, name


def test_a_job_whose_peak_exceeds_a_gpu_is_refused_with_the_sizes():
    reason = refusal(job(1, persistent_bytes=GiB, peak_bytes=90 * GiB), 8, 80 * GiB)
    assert "90.00 GiB" in reason and "80.00 GiB" in reason


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="fifo, las, timeslice, antman"):
        make_policy("srtf")


# --- FIFO ------------------------------------------------------------------------------


def test_fifo_starts_in_submission_order_and_the_first_that_does_not_fit_blocks_the_rest():
    state = node(job(3, submit=2), job(1, submit=0), job(2, num_gpus=2, submit=1), gpus=2)
    plan = Fifo().plan(state)
    assert list(plan.placements) == [1]
    assert plan.waiting == (2, 3)  # job 3 would fit on the free GPU, but waits behind job 2


def test_fifo_never_preempts_a_running_job():
    state = node(running(5, [0, 1], submit=10), job(1, submit=0), gpus=2)
    plan = Fifo().plan(state)
    assert plan.placements[5].gpus == (0, 1)
    assert plan.waiting == (1,)


# --- Tiresias' discretized 2D-LAS ------------------------------------------------------


def test_las_queue_is_the_number_of_thresholds_the_attained_service_passed():
    las = DiscretizedLas(thresholds_gpu_s=(100.0, 1000.0))
    assert [las.queue_of(job(1, attained_service=s)) for s in (0, 99.9, 100, 999, 1000, 5000)] == [0, 0, 1, 1, 2, 2]


def test_las_preempts_a_job_past_the_threshold_for_a_new_job():
    veteran = running(1, [0], attained_service=150.0)
    state = node(veteran, job(2, submit=5), gpus=1, now=100)
    plan = DiscretizedLas(thresholds_gpu_s=(100.0,)).plan(state)
    assert 1 not in plan.placements  # suspended at its next iteration boundary
    assert plan.priorities == {1: 1, 2: 0}
    assert plan.waiting[0] == 2  # starts once the veteran's GPU is given back


def test_las_preempts_the_job_on_a_suspended_jobs_own_gpu_not_a_count_of_gpus():
    # Job 1 (queue 0) was suspended on GPU 1, which job 3 (queue 1) now holds; GPU 2 is free. Counting
    # GPUs, all three jobs fit; but job 1 can only resume on GPU 1, so job 3 is the one preempted.
    suspended = job(1, status=SUSPENDED, bound_gpus=(1,), submit=1, first_started_at=0.0, last_stopped_at=50.0)
    state = node(running(2, [0]), suspended, running(3, [1], submit=2, attained_service=150.0), gpus=3, now=100)
    plan = DiscretizedLas(thresholds_gpu_s=(100.0,), starvation_factor=0).plan(state)
    assert plan.placements[2].gpus == (0,)
    assert 3 not in plan.placements and 1 not in plan.placements  # job 1 resumes once job 3 has stopped
    assert plan.waiting == (1, 3)


def test_las_places_the_new_job_once_the_preempted_one_has_stopped():
    state = node(job(1, status=SUSPENDED, attained_service=150.0, first_started_at=0.0, last_stopped_at=101.0),
                 job(2, submit=5), gpus=1, now=101)
    plan = DiscretizedLas(thresholds_gpu_s=(100.0,), starvation_factor=0).plan(state)
    assert plan.placements[2].gpus == (0,)
    assert plan.waiting == (1,)


def test_las_within_a_queue_keeps_running_jobs_ahead_of_earlier_waiting_ones():
    state = node(running(2, [0], submit=10, attained_service=5.0), job(1, submit=0), gpus=1, now=20)
    plan = DiscretizedLas().plan(state)
    assert plan.placements[2].gpus == (0,)
    assert plan.waiting == (1,)


def test_las_skips_a_job_that_does_not_fit_and_starts_a_smaller_one_behind_it():
    state = node(running(1, [0]), job(2, num_gpus=2, submit=1), job(3, submit=2), gpus=2, now=5)
    plan = DiscretizedLas().plan(state)
    assert set(plan.placements) == {1, 3}
    assert plan.waiting == (2,)


def test_las_counts_two_dimensions_gpus_times_time():
    # Same wall time run, but the 4-GPU job attained 4x the service and falls to queue 1.
    wide = job(1, num_gpus=4, attained_service=4 * 50.0)
    narrow = job(2, num_gpus=1, attained_service=50.0)
    las = DiscretizedLas(thresholds_gpu_s=(100.0,))
    assert (las.queue_of(wide), las.queue_of(narrow)) == (1, 0)


def test_las_starvation_limit_promotes_a_long_waiting_job_to_queue_zero():
    # Ran 200 GPU-s (queue 1), then waited 450 s: past 2 x 200 = 400 s.
    starved = job(1, submit=0, status=SUSPENDED, attained_service=200.0, first_started_at=0.0,
                  last_stopped_at=200.0, waited_s=450.0)
    newcomer = job(2, submit=300)
    plan = DiscretizedLas(thresholds_gpu_s=(100.0,), starvation_factor=2.0).plan(node(starved, newcomer, gpus=1, now=650))
    assert plan.marks[1]["service_at_promotion"] == 200.0
    assert plan.marks[1]["promotions"] == 1
    assert plan.priorities[1] == 0
    assert 1 in plan.placements and plan.waiting == (2,)


def test_las_does_not_promote_before_the_starvation_limit():
    starved = job(1, submit=0, status=SUSPENDED, attained_service=200.0, first_started_at=0.0,
                  last_stopped_at=200.0, waited_s=350.0)
    plan = DiscretizedLas(thresholds_gpu_s=(100.0,), starvation_factor=2.0).plan(
        node(starved, job(2, submit=300), gpus=1, now=550))
    assert not plan.marks and 2 in plan.placements
    assert plan.wake_at == pytest.approx(550 + 50)  # when it reaches the limit


def test_las_promoted_job_is_judged_on_service_since_its_promotion():
    las = DiscretizedLas(thresholds_gpu_s=(100.0,))
    assert las.queue_of(job(1, attained_service=250.0, marks={"service_at_promotion": 200.0})) == 0


def test_las_wakes_when_a_running_job_will_cross_its_threshold_at_its_share():
    state = node(running(1, [0, 1], attained_service=100.0, share=0.5), job(2, num_gpus=2), gpus=2, now=10)
    plan = DiscretizedLas(thresholds_gpu_s=(300.0,)).plan(state)
    assert plan.wake_at == pytest.approx(10 + 200 / (2 * 0.5))


def test_las_rejects_thresholds_out_of_order():
    with pytest.raises(ValueError, match="increasing"):
        DiscretizedLas(thresholds_gpu_s=(100.0, 50.0))


@pytest.mark.parametrize("options, message", [
    ({"thresholds_gpu_s": (float("nan"),)}, "thresholds must be positive and increasing"),
    ({"thresholds_gpu_s": (600.0, float("nan"))}, "thresholds must be positive and increasing"),
    ({"starvation_factor": float("nan")}, "starvation factor must be 0 .off. or positive"),
])
def test_las_rejects_a_threshold_or_starvation_factor_that_is_not_a_number(options, message):
    # NaN compares false with everything: a NaN threshold was never reached (one queue, FIFO by
    # submission) and a NaN factor never starved anyone (promotion off), without a word.
    with pytest.raises(ValueError, match=message):
        DiscretizedLas(**options)


# --- Gandiva's time-slicing -----------------------------------------------------------


def test_timeslice_runs_everything_while_everything_fits():
    state = node(running(1, [0], started=0.0), job(2, submit=1), gpus=2, now=500)
    plan = TimeSlicing(quantum_s=60).plan(state)
    assert set(plan.placements) == {1, 2}
    assert plan.wake_at is None


def test_timeslice_preempts_a_job_whose_quantum_expired_for_the_one_waiting():
    state = node(running(1, [0], started=0.0), running(2, [1], started=30.0), job(3, submit=5), gpus=2, now=60)
    plan = TimeSlicing(quantum_s=60).plan(state)
    assert 1 not in plan.placements       # its quantum is over: suspended at the iteration boundary
    assert plan.placements[2].gpus == (1,)  # 30 s into its quantum
    assert plan.waiting[0] == 3
    assert plan.wake_at == pytest.approx(90)


def test_timeslice_gives_the_turn_to_the_job_that_has_waited_longest():
    state = node(job(1, status=SUSPENDED, first_started_at=0.0, last_stopped_at=120.0),
                 job(2, status=SUSPENDED, first_started_at=60.0, last_stopped_at=61.0),
                 job(3, submit=100), gpus=1, now=130)
    plan = TimeSlicing(quantum_s=60).plan(state)
    assert plan.placements[2].gpus == (0,)
    assert plan.waiting == (3, 1)


def test_timeslice_keeps_freed_gpus_for_the_job_whose_turn_it_is():
    # Job 3 needs both GPUs: the single-GPU job 4 behind it must not take the GPU job 1 frees.
    state = node(running(1, [0], started=0.0), running(2, [1], started=30.0), job(3, num_gpus=2, submit=1),
                 job(4, submit=2), gpus=2, now=60)
    plan = TimeSlicing(quantum_s=60).plan(state)
    assert set(plan.placements) == {2}
    assert plan.waiting == (3, 4, 1)


def test_timeslice_gives_a_free_gpu_to_the_next_job_while_a_suspended_one_waits_for_its_own():
    # Job 1's turn, but it resumes only on GPU 1, which job 4's quantum still holds: GPU 0 goes to job 2.
    state = node(job(1, status=SUSPENDED, bound_gpus=(1,), first_started_at=0.0, last_stopped_at=10.0),
                 running(4, [1], started=100.0), job(2, submit=20), gpus=2, now=130)
    plan = TimeSlicing(quantum_s=60).plan(state)
    assert plan.placements[2].gpus == (0,) and plan.placements[4].gpus == (1,)
    assert plan.waiting == (1,)


def test_timeslice_keeps_a_suspended_jobs_own_free_gpus_for_its_turn():
    # Job 1 resumes on GPUs 0 and 1; GPU 0 is free, GPU 1 is job 4's until its quantum ends. GPU 0
    # stays free for job 1 rather than going to job 2, so job 1 resumes as soon as job 4 yields.
    state = node(job(1, status=SUSPENDED, num_gpus=2, bound_gpus=(0, 1), first_started_at=0.0, last_stopped_at=10.0),
                 running(4, [1], started=100.0), job(2, submit=20), gpus=2, now=130)
    plan = TimeSlicing(quantum_s=60).plan(state)
    assert set(plan.placements) == {4}
    assert plan.waiting == (1, 2)
    later = node(job(1, status=SUSPENDED, num_gpus=2, bound_gpus=(0, 1), first_started_at=0.0, last_stopped_at=10.0),
                 running(4, [1], started=100.0), job(2, submit=20), gpus=2, now=160)
    assert TimeSlicing(quantum_s=60).plan(later).placements == {}  # job 4 yields; GPU 1 frees when it stops


def test_timeslice_places_nothing_on_gpus_a_stopping_job_still_holds():
    stopping = JobView(job_id=1, status=STOPPING, gpus=(0,), running_role=GUARANTEED, first_started_at=0.0,
                       last_started_at=0.0)
    plan = TimeSlicing(quantum_s=60).plan(node(stopping, job(2), gpus=1, now=61))
    assert plan.placements == {} and plan.waiting == (2,)


# --- AntMan's packing -------------------------------------------------------------------


def test_antman_runs_a_job_waiting_behind_the_fifo_head_opportunistically_on_an_idle_gpu():
    state = node(running(1, [0]), job(2, num_gpus=2, submit=1), job(3, submit=2), gpus=2, now=5)
    plan = Packing().plan(state)
    assert plan.placements[3].role == OPPORTUNISTIC and plan.placements[3].gpus == (1,)
    assert plan.placements[3].share == 1.0
    assert plan.waiting == (2,)


def test_antman_packs_an_opportunistic_job_beside_a_guaranteed_one_at_the_idle_share():
    g = running(1, [0], utilization=0.6, persistent_bytes=10 * GiB, peak_bytes=30 * GiB)
    o = job(2, submit=1, role=OPPORTUNISTIC, utilization=0.8, persistent_bytes=5 * GiB, peak_bytes=10 * GiB)
    plan = Packing().plan(node(g, o, gpus=1, now=5, memory=80 * GiB))
    assert plan.placements[2].gpus == (0,)
    assert plan.placements[2].share == pytest.approx(0.4 / 0.8)


def test_antman_does_not_pack_where_salus_says_the_memory_does_not_fit():
    g = running(1, [0], utilization=0.5, persistent_bytes=40 * GiB, peak_bytes=70 * GiB)
    o = job(2, submit=1, role=OPPORTUNISTIC, persistent_bytes=20 * GiB, peak_bytes=25 * GiB)
    plan = Packing().plan(node(g, o, gpus=1, now=5, memory=80 * GiB))  # 40 + 20 + 30 > 80
    assert 2 not in plan.placements and plan.waiting == (2,)


def test_antman_does_not_pack_beside_a_guaranteed_job_that_leaves_no_idle_compute():
    g = running(1, [0], utilization=1.0)
    plan = Packing().plan(node(g, job(2, submit=1, role=OPPORTUNISTIC), gpus=1, now=5))
    assert 2 not in plan.placements


def test_antman_promotes_an_opportunistic_job_in_place_when_its_turn_comes():
    o = running(2, [1], submit=1, as_role=OPPORTUNISTIC)  # ran opportunistically while job 1 held GPU 0
    plan = Packing().plan(node(o, gpus=2, now=50))
    assert plan.placements[2].role == GUARANTEED and plan.placements[2].gpus == (1,)


def test_antman_keeps_a_job_running_beside_a_guaranteed_one_where_it_is_and_lets_later_jobs_pass():
    # Job 2 waits for a guaranteed place but runs opportunistically beside guaranteed job 1. GPU 1 is
    # free: job 2 cannot move there (a suspended job resumes where it was), so it stays as it is and
    # job 3, behind it, takes GPU 1. Suspending job 2 would only resume it on GPU 0 again, over and over.
    g = running(1, [0], utilization=0.5)
    o = running(2, [0], submit=1, as_role=OPPORTUNISTIC, utilization=0.5)
    plan = Packing().plan(node(g, o, job(3, submit=2), gpus=2, now=50))
    assert plan.placements[2].gpus == (0,) and plan.placements[2].role == OPPORTUNISTIC
    assert plan.placements[3].gpus == (1,) and plan.placements[3].role == GUARANTEED
    ended = Packing().plan(node(o, job(3, submit=2, status=RUNNING, gpus=(1,), running_role=GUARANTEED), now=60))
    assert ended.placements[2].role == GUARANTEED and ended.placements[2].gpus == (0,)  # promoted in place


def test_antman_guaranteed_job_preempts_an_opportunistic_one_that_does_not_fit_beside_it():
    o = running(2, [0], submit=1, as_role=OPPORTUNISTIC, role=OPPORTUNISTIC, persistent_bytes=30 * GiB, peak_bytes=40 * GiB)
    g = job(3, submit=0, role=GUARANTEED, persistent_bytes=30 * GiB, peak_bytes=60 * GiB)
    plan = Packing().plan(node(o, g, gpus=1, now=5, memory=80 * GiB))
    assert 2 not in plan.placements  # suspended to make room
    assert 3 not in plan.placements and plan.waiting == (3, 2)  # starts once job 2 has stopped
