"""benchmarks/placement_bounds.py: the offline packings place no two live
blocks on the same bytes, count pages as the allocator does, and give the
figures worked out by hand on small traces."""

import json
import os

import numpy as np
import pytest

from script_loader import load_script

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "..", "..", "benchmarks", "placement_bounds.py")
TRACES = os.path.join(HERE, "..", "..", "benchmarks", "traces")
P = 2 << 20  # one page


@pytest.fixture(scope="module")
def bounds():
    return load_script(PATH)


# x lives only in the first step, y for ever; z (two pages) comes in the
# second step, after x is gone. Peak allocated: y + z, three pages.
# Lowest address first in the order of the program: x at 0, y at 1 page, and
# z finds no two free pages below y, so it goes at 2: four pages.
TWO_STEPS = [("alloc", 1, P, 0), ("alloc", 2, P, 0), ("free", 1), ("iteration",), ("alloc", 3, 2 * P, 0)]


def test_requests_round_to_512_bytes_and_carry_lifetimes_and_steps(bounds):
    ops = [("alloc", 7, 1000, 0), ("alloc", 8, 0, 0), ("iteration",), ("free", 7), ("alloc", 7, 512, 0)]
    r = bounds.requests_of(ops)
    assert r.size.tolist() == [1024, 512]          # the 0-byte request takes no room
    assert r.birth.tolist() == [0, 4]
    assert r.death.tolist() == [3, bounds.NEVER]   # id 7 is allocated again after its free
    assert r.step.tolist() == [0, 1]


def test_a_free_of_an_id_not_allocated_is_refused_with_its_op(bounds):
    with pytest.raises(ValueError, match="op 1: free of id 9"):
        bounds.requests_of([("alloc", 1, P, 0), ("free", 9)])
    with pytest.raises(ValueError, match="op 1: id 1 is allocated again"):
        bounds.requests_of([("alloc", 1, P, 0), ("alloc", 1, P, 0)])


def test_peak_allocated_counts_a_free_before_a_later_allocation(bounds):
    assert bounds.peak_allocated(bounds.requests_of(TWO_STEPS)) == 3 * P


def test_the_whole_run_packing_reaches_the_floor_where_program_order_cannot(bounds):
    figures = bounds.bounds(TWO_STEPS)
    assert figures["floor_reserved_bytes"] == 3 * P
    # z first (largest) at 0; y beside it; x at 0, where z is not yet alive.
    assert figures["whole_run_reserved_bytes"] == 3 * P
    assert figures["whole_run_fragmentation"] == 1.0


def test_step_by_step_keeps_what_earlier_steps_placed_and_each_tie_break_counts(bounds):
    figures = bounds.bounds(TWO_STEPS)
    # Step 0 packs x and y (same size). By birth x goes first, at 0, and y
    # at 1 page: step 1's z then goes above y, four pages. Longer-lived
    # first puts y at 0, and z fits right above it: three.
    assert figures["step_by_step_reserved_bytes_by_birth"] == 4 * P
    assert figures["step_by_step_reserved_bytes_by_life"] == 3 * P
    assert figures["step_by_step_reserved_bytes"] == 3 * P
    assert figures["step_by_step_fragmentation"] == 1.0
    assert figures["iterations"] == 1


def test_released_pages_count_only_pages_live_blocks_touch_at_once(bounds):
    layout = bounds.Layout(bounds.requests_of(TWO_STEPS))
    layout.address[:] = [0, P, 2 * P]      # program order, lowest address first
    layout.placed[:] = True
    bounds.check_layout(layout)
    assert layout.reserved_kept() == 4 * P      # pages 0-3 are each touched at some time
    assert layout.reserved_released() == 3 * P  # at most y and z at once


def test_check_layout_refuses_two_live_blocks_on_the_same_bytes(bounds):
    layout = bounds.Layout(bounds.requests_of(TWO_STEPS))
    layout.address[:] = [0, 0, 2 * P]      # x and y live at once at the same address
    layout.placed[:] = True
    with pytest.raises(AssertionError, match="overlap"):
        bounds.check_layout(layout)
    layout.address[:] = [0, P, 0]          # z over y's page, while y lives
    with pytest.raises(AssertionError, match="overlap"):
        bounds.check_layout(layout)
    layout.address[:] = [0, 2 * P, 0]      # z where x was, after x died: fine
    bounds.check_layout(layout)


def test_placement_never_overlaps_on_random_programs(bounds):
    rng = np.random.default_rng(0)
    for _ in range(20):
        ops, live, next_id = [], [], 0
        for _ in range(200):
            if live and rng.random() < 0.45:
                ops.append(("free", live.pop(int(rng.integers(len(live))))))
            elif rng.random() < 0.05:
                ops.append(("iteration",))
            else:
                ops.append(("alloc", next_id, int(rng.integers(1, 3 * P)), 0))
                live.append(next_id)
                next_id += 1
        figures = bounds.bounds(ops)  # each packing is checked inside
        for key in ("whole_run", "step_by_step", "step_by_step_released"):
            assert figures[f"{key}_reserved_bytes"] >= figures["floor_reserved_bytes"]
        assert figures["step_by_step_released_reserved_bytes"] <= figures["step_by_step_reserved_bytes"]


def test_the_script_writes_every_figure_beside_cotenants_for_a_bundled_trace(bounds, tmp_path):
    out = tmp_path / "bounds.json"
    assert bounds.main([os.path.join(TRACES, "resnet_train.jsonl.gz"), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "placement_bounds"
    figures = data["traces"]["resnet_train"]
    from cotenant.replay import load_trace, replay_trace

    assert figures["cotenant_fragmentation"] == replay_trace(load_trace(os.path.join(TRACES, "resnet_train.jsonl.gz")))[
        "fragmentation"]
    assert figures["floor_fragmentation"] <= figures["whole_run_fragmentation"]
    assert figures["peak_allocated_bytes"] > 0
