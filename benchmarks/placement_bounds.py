#!/usr/bin/env python3
"""What placement could reach on each bundled trace with knowledge that an
allocator does not have: offline packings of the trace's own requests.

    python benchmarks/placement_bounds.py [TRACE ...] [--out benchmarks/results/placement_bounds.json]

Each figure is a fragmentation (peak reserved / peak allocated, requests
rounded to 512 bytes as the allocator rounds them) of a layout that never
moves a block and never unmaps a page: reserved memory is every 2 MiB page
that some block of the layout touches at some time. cotenant's allocator
works under the same rule once a loop is warm (no page maps, so no unmaps
either); its figure, from the replay, is printed beside them.

- floor: peak allocated rounded up to whole pages. No layout goes below it.
- whole run: every request's lifetime known before the first one is made.
  Greedy by size (largest first, each at the lowest address that is free for
  its whole lifetime; Pisarchyk and Lee, "Efficient memory management for
  deep neural net inference", 2020); among equal sizes the earlier first,
  or the longer-lived first (the better layout of the two counts). A
  heuristic, not an optimum (the problem is NP-hard), so not a bound.
- step by step: at each iteration mark the coming step's requests and
  their lifetimes are known exactly, and the blocks alive at the mark stay
  where earlier steps put them; each step is packed greedy by size around
  them. This is the most that a plan made one step ahead can know (the
  allocator's step plan, docs/allocator.md, knows less: the step before).
- step by step, pages released: the same layout, with each page mapped only
  while a live block touches it (its peak of pages in use). What remapping
  every free page at once would reach, at a page map and unmap for each
  page each time it is freed and used again.

Not a measurement of cotenant (the replay is): the packings are made here,
in Python, over the requests of the trace. Writes
{"benchmark": "placement_bounds", "traces": {name: {...}}} to --out.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bundled_traces  # noqa: E402

PAGE = 2 << 20
ROUND = 512
NEVER = np.iinfo(np.int64).max  # the death of a block the trace never frees


@dataclass
class Requests:
    """A trace's allocations as arrays, in the order they were made: rounded
    size, birth and death (op indices), and the step (iterations before it);
    and (born, index) for each birth and death, in time order."""

    size: np.ndarray
    birth: np.ndarray
    death: np.ndarray
    step: np.ndarray
    events: List[Tuple[bool, int]]


def requests_of(ops: Sequence[tuple]) -> Requests:
    """The allocations of replay ops (cotenant.replay's tuples). Frees of ids
    not allocated are refused with ValueError; record_stream, cap and
    empty_cache change no lifetime and are passed over."""
    size: List[int] = []
    birth: List[int] = []
    death: List[int] = []
    step: List[int] = []
    live: Dict[int, int] = {}
    steps = 0
    for t, op in enumerate(ops):
        kind = op[0]
        if kind == "alloc":
            ident, nbytes = op[1], op[2]
            if ident in live:
                raise ValueError(f"op {t}: id {ident} is allocated again before it was freed")
            if nbytes == 0:
                continue
            live[ident] = len(size)
            size.append(-(-nbytes // ROUND) * ROUND)
            birth.append(t)
            death.append(int(NEVER))
            step.append(steps)
        elif kind == "free":
            index = live.pop(op[1], None)
            if index is None:
                raise ValueError(f"op {t}: free of id {op[1]}, which is not allocated")
            death[index] = t
        elif kind == "iteration":
            steps += 1
    timed = sorted([(b, True, i) for i, b in enumerate(birth)] +
                   [(d, False, i) for i, d in enumerate(death) if d != NEVER])
    return Requests(np.array(size, dtype=np.int64), np.array(birth, dtype=np.int64),
                    np.array(death, dtype=np.int64), np.array(step, dtype=np.int64),
                    [(born, i) for _, born, i in timed])


def peak_allocated(requests: Requests) -> int:
    """The most bytes live at once."""
    events = np.concatenate([requests.birth, requests.death[requests.death != NEVER]])
    change = np.concatenate([requests.size, -requests.size[requests.death != NEVER]])
    order = np.argsort(events, kind="stable")
    return int(np.max(np.cumsum(change[order]), initial=0))


class Layout:
    """Addresses of placed blocks; a block goes at the lowest address free
    over its lifetime, given every block placed so far."""

    def __init__(self, requests: Requests):
        self.requests = requests
        self.address = np.full(len(requests.size), -1, dtype=np.int64)
        self.placed = np.zeros(len(requests.size), dtype=bool)

    def place(self, i: int) -> None:
        r = self.requests
        others = np.flatnonzero(self.placed & (r.birth < r.death[i]) & (r.death > r.birth[i]))
        address = 0
        if len(others):
            start = self.address[others]
            order = np.argsort(start, kind="stable")
            start = start[order]
            end = np.maximum.accumulate(start + r.size[others][order])
            gap_start = np.concatenate([[0], end[:-1]])
            fits = np.flatnonzero(start - gap_start >= r.size[i])
            address = int(gap_start[fits[0]]) if len(fits) else int(end[-1])
        self.address[i] = address
        self.placed[i] = True

    def pack(self, indices: np.ndarray, tie_break: str) -> None:
        """Greedy by size over `indices`: largest first; among equal sizes,
        the earlier first ("birth"), or the longer-lived first and then the
        earlier ("life")."""
        r = self.requests
        if tie_break == "birth":
            order = np.lexsort((r.birth[indices], -r.size[indices]))
        else:
            life = np.minimum(r.death[indices], r.birth.max(initial=0) + 1) - r.birth[indices]
            order = np.lexsort((r.birth[indices], -life, -r.size[indices]))
        for i in indices[order]:
            self.place(int(i))

    def reserved_kept(self) -> int:
        """Bytes of the pages any block touches at any time."""
        r = self.requests
        pages = set()
        for first, last in zip(self.address // PAGE, (self.address + r.size - 1) // PAGE):
            pages.update(range(int(first), int(last) + 1))
        return len(pages) * PAGE

    def reserved_released(self) -> int:
        """The most pages touched by live blocks at once, in bytes."""
        r = self.requests
        first = self.address // PAGE
        last = (self.address + r.size - 1) // PAGE
        in_use: Dict[int, int] = {}
        most = 0
        for born, i in r.events:
            for page in range(int(first[i]), int(last[i]) + 1):
                count = in_use.get(page, 0) + (1 if born else -1)
                if count:
                    in_use[page] = count
                else:
                    del in_use[page]
            most = max(most, len(in_use))
        return most * PAGE


TIE_BREAKS = ("birth", "life")


def whole_run(requests: Requests, tie_break: str) -> Layout:
    layout = Layout(requests)
    layout.pack(np.arange(len(requests.size)), tie_break)
    return layout


def step_by_step(requests: Requests, tie_break: str) -> Layout:
    layout = Layout(requests)
    for step in range(int(requests.step.max(initial=-1)) + 1):
        layout.pack(np.flatnonzero(requests.step == step), tie_break)
    return layout


def check_layout(layout: Layout) -> None:
    """AssertionError when two blocks live at the same time overlap."""
    r = layout.requests
    live: Dict[int, int] = {}  # address -> index, of live blocks
    starts: List[int] = []
    for born, i in r.events:
        a = int(layout.address[i])
        if not born:
            del live[a]
            starts.pop(bisect.bisect_left(starts, a))
            continue
        k = bisect.bisect_left(starts, a)
        if k < len(starts) and a + r.size[i] > starts[k]:
            raise AssertionError(f"blocks {i} and {live[starts[k]]} overlap")
        if k > 0 and starts[k - 1] + r.size[live[starts[k - 1]]] > a:
            raise AssertionError(f"blocks {live[starts[k - 1]]} and {i} overlap")
        live[a] = i
        starts.insert(k, a)


def bounds(ops: Sequence[tuple]) -> Dict[str, Any]:
    """The figures of one trace's ops: for each packing, the reserved bytes
    of each tie-break and the fragmentation of the better one."""
    requests = requests_of(ops)
    peak = peak_allocated(requests)
    figures: Dict[str, Any] = {
        "peak_allocated_bytes": peak,
        "iterations": int(requests.step.max(initial=0)),
        "floor_reserved_bytes": -(-peak // PAGE) * PAGE,
    }
    for tie_break in TIE_BREAKS:
        whole = whole_run(requests, tie_break)
        steps = step_by_step(requests, tie_break)
        check_layout(whole)
        check_layout(steps)
        figures[f"whole_run_reserved_bytes_by_{tie_break}"] = whole.reserved_kept()
        figures[f"step_by_step_reserved_bytes_by_{tie_break}"] = steps.reserved_kept()
        figures[f"step_by_step_released_reserved_bytes_by_{tie_break}"] = steps.reserved_released()
    for key in PACKINGS:
        if key != "floor":
            figures[f"{key}_reserved_bytes"] = min(figures[f"{key}_reserved_bytes_by_{t}"] for t in TIE_BREAKS)
        figures[f"{key}_fragmentation"] = figures[f"{key}_reserved_bytes"] / peak if peak else 1.0
    return figures


PACKINGS = ("floor", "whole_run", "step_by_step", "step_by_step_released")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="*", help="traces or snapshots (default: every bundled one)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "placement_bounds.json"))
    args = parser.parse_args(argv)

    from cotenant.replay import load_trace, replay_trace

    rows = {}
    for path in args.traces or bundled_traces.every():
        trace = load_trace(path)
        figures = bounds(trace.ops)
        figures["cotenant_fragmentation"] = replay_trace(trace)["fragmentation"]
        rows[os.path.basename(path).split(".")[0]] = figures

    columns = PACKINGS + ("cotenant",)
    print("fragmentation (peak reserved / peak allocated) of offline layouts; cotenant's from the replay")
    print(f"{'trace':<26}" + "".join(f"{c:>24}" for c in columns))
    for name, figures in rows.items():
        print(f"{name:<26}" + "".join(f"{figures[c + '_fragmentation']:>24.3f}" for c in columns))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"benchmark": "placement_bounds", "device": "none (offline layouts)", "traces": rows},
                  f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"\nwrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
