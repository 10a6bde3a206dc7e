#!/usr/bin/env python3
"""cotenant's allocator against PyTorch's own, side by side in one run (needs a GPU).

Figures (written to benchmarks/results/allocator-<device>-<time>.json):
  alloc_free_ratio_vs_native             malloc+free time, cotenant / native, realistic size mix (target <= 1.0)
  alloc_free_raw_ratio_vs_native         the same pairs made with torch.cuda.caching_allocator_alloc / _delete:
                                         the allocator's calls alone, no tensor and no ATen op (so no op-entry
                                         interception); with the figure above it says which side a gap is on
  step_time_ratio_vs_native              training step time, no cap pressure, worst model (target <= 1.01)
  step_time_ratio_vs_native.<model>      the same per model (resnet50, gpt)
  spill_bandwidth_ratio_vs_memcpy        device->host page moves GB/s over pinned cudaMemcpy GB/s (target >= 0.9),
                                         the job's first spill: it pins the host pages it fills
  restore_bandwidth_ratio_vs_memcpy      host->device, the same
  spill_bandwidth_ratio_vs_memcpy_kept   a second spill and restore, into the host pages the first kept (under a
  restore_bandwidth_ratio_vs_memcpy_kept cap they stay pinned with the job: what this figure trades away); a first
                                         spill with a host reserve (reserve_host_memory) takes the same path
  (measured: moves.reserve_pin_gbps      the rate at which reserve_host_memory pins host pages: the cost a host
                                         reserve moves from the first squeeze to enable)
  region_pause_ratio_vs_memcpy           pause_region(keep=True) / resume_region of a region as large as the moves
  region_resume_ratio_vs_memcpy          above, GB/s over pinned cudaMemcpy: each pause pins its host pages and
                                         each resume gives them back (an RL job that pauses every step pays it
                                         every step)
  region_pause_ratio_vs_memcpy_reserved  the same with a host reserve of the region's size: the pause takes the
  region_resume_ratio_vs_memcpy_reserved reserve's pages and the resume returns them (what it trades: that much
                                         host memory pinned for the job's life)
  shrink_response_s_1GiB / _4GiB / _16GiB  seconds from a cap command to device bytes under the cap
  step_time_ratio_spilled_25pct / _50pct step time with a quarter / half of the working set on the host, over none
  spilled_step_driver_share_25pct / _50pct  the share of that step's time spent in driver calls (page moves and
                                         their device synchronizes; the table under the figures breaks it down)

Each measurement that needs a fresh CUDA context (native vs cotenant) runs in
its own worker process: `bench_allocator.py --worker NAME --allocator native|cotenant`.
The comparisons with PyTorch's allocator (alloc+free, step time; with
--over-fake too) run each allocator twice, native, cotenant, cotenant,
native, and take each side's mean; each run's result is kept under
measured.*.runs.

On the CPU, `bench_allocator.py --over-fake` runs the alloc+free measurement
alone, with torch over the fake CUDA runtime of tests/fake_cuda
(benchmarks/pytorch_allocator/over_fake.py; the core build's fake_cudart,
found as COTENANT_PYTORCH_REPLAY names it): the same torch.empty and del
through PyTorch's allocator and through cotenant's (torch's allocator
interface, cotenant's adapter and core). Warm, neither should call the
driver, so the path is all CPU work and its time carries over to a GPU
machine with the same CPU; the driver and runtime calls each makes per pair
in the timed loop are counted to show it. It also counts the calls per page
of spill_all() and restore_all() on 64 MiB of tensors under a cap, twice
(figures spill_vmm_calls_per_page, restore_vmm_calls_per_page, and the
second time, into the host pages the first kept, *_kept: the driver's
virtual memory calls, which bound a page move's speed). What it leaves out: a
driver call made there costs nothing over the fake (the counts are what
show one), and GPU-side time. Writes results/allocator_over_fake.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from result_file import gpu_environment, result_base, write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(HERE, "results")
GIB = 1 << 30
MIB = 1 << 20

OVER_FAKE_VARIABLE = "COTENANT_BENCH_OVER_FAKE"  # a worker's: the fake libcudart it runs over
# The driver's virtual memory calls a page move makes: what bounds its speed
# while each 2 MiB page is its own mapping (docs/allocator.md, Known limits).
VMM_CALLS = ("cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess")

FIGURES = [
    "alloc_free_ratio_vs_native",
    "step_time_ratio_vs_native",
    "spill_bandwidth_ratio_vs_memcpy",
    "restore_bandwidth_ratio_vs_memcpy",
    "spill_bandwidth_ratio_vs_memcpy_kept",
    "restore_bandwidth_ratio_vs_memcpy_kept",
    "shrink_response_s_1GiB",
    "shrink_response_s_4GiB",
    "shrink_response_s_16GiB",
    "step_time_ratio_spilled_25pct",
    "step_time_ratio_spilled_50pct",
]

# A size mix as training jobs allocate it: many small activations and
# gradients, some mid-sized weights, a few large buffers (bytes, weight).
SIZE_MIX = [(512, 20), (4096, 20), (65536, 15), (1 * MIB, 15), (4 * MIB, 12), (16 * MIB, 10),
            (64 * MIB, 6), (256 * MIB, 2)]


# ---- pure helpers (tested without a GPU) ----------------------------------------------------


def ratio(numerator: float, denominator: float) -> Optional[float]:
    """numerator / denominator, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def size_sequence(count: int, seed: int = 0) -> List[int]:
    """`count` sizes drawn from SIZE_MIX, the same for both allocators."""
    import random

    rng = random.Random(seed)
    sizes, weights = zip(*SIZE_MIX)
    return rng.choices(sizes, weights=weights, k=count)


def driver_time_table(times: Dict[str, Dict[str, int]], pages: int) -> List[str]:
    """Lines of a table of where a page move's time went, from _C._driver_call_times():
    per kind of driver call, its calls, total ms, microseconds per call and per page
    moved, busiest first; kinds never called are left out."""
    rows = sorted(((name, t["calls"], t["ns"]) for name, t in times.items() if t["calls"] > 0),
                  key=lambda row: -row[2])
    lines = [f"{'driver call':<20} {'calls':>7} {'ms':>9} {'us/call':>9} {'us/page':>9}"]
    for name, calls, ns in rows:
        per_page = f"{ns / 1e3 / pages:9.1f}" if pages > 0 else f"{'-':>9}"
        lines.append(f"{name:<20} {calls:>7} {ns / 1e6:9.2f} {ns / 1e3 / calls:9.1f} {per_page}")
    return lines


def compute_figures(measured: Dict[str, Dict]) -> Dict[str, Optional[float]]:
    """The result file's figures from the workers' raw measurements."""
    figures: Dict[str, Optional[float]] = {}
    alloc = measured.get("alloc_free", {})
    figures["alloc_free_ratio_vs_native"] = ratio(alloc.get("cotenant_s_per_pair"),
                                                  alloc.get("native_s_per_pair"))
    figures["alloc_free_raw_ratio_vs_native"] = ratio(alloc.get("cotenant_raw_s_per_pair"),
                                                      alloc.get("native_raw_s_per_pair"))
    steps = measured.get("step_time", {})
    per_model = {}
    for model, times in steps.items():
        per_model[model] = ratio(times.get("cotenant_s"), times.get("native_s"))
        figures[f"step_time_ratio_vs_native.{model}"] = per_model[model]
    known = [r for r in per_model.values() if r is not None]
    figures["step_time_ratio_vs_native"] = max(known) if known else None
    moves = measured.get("moves", {})
    figures["spill_bandwidth_ratio_vs_memcpy"] = ratio(moves.get("spill_gbps"), moves.get("memcpy_d2h_gbps"))
    figures["restore_bandwidth_ratio_vs_memcpy"] = ratio(moves.get("restore_gbps"), moves.get("memcpy_h2d_gbps"))
    figures["spill_bandwidth_ratio_vs_memcpy_kept"] = ratio(moves.get("spill_kept_gbps"), moves.get("memcpy_d2h_gbps"))
    figures["restore_bandwidth_ratio_vs_memcpy_kept"] = ratio(moves.get("restore_kept_gbps"),
                                                              moves.get("memcpy_h2d_gbps"))
    for name, memcpy in (("pause", "memcpy_d2h_gbps"), ("resume", "memcpy_h2d_gbps")):
        for suffix in ("", "_reserved"):
            figures[f"region_{name}_ratio_vs_memcpy{suffix}"] = ratio(moves.get(f"region_{name}{suffix}_gbps"),
                                                                      moves.get(memcpy))
    for gib in (1, 4, 16):
        figures[f"shrink_response_s_{gib}GiB"] = measured.get("shrink", {}).get(f"{gib}GiB")
    spilled = measured.get("spilled", {})
    for pct in (25, 50):
        figures[f"step_time_ratio_spilled_{pct}pct"] = ratio(spilled.get(f"{pct}pct_s"), spilled.get("0pct_s"))
        per_step = spilled.get(f"{pct}pct_per_step")
        driver_s = step_driver_ns(per_step) / 1e9 if per_step else None
        figures[f"spilled_step_driver_share_{pct}pct"] = ratio(driver_s, spilled.get(f"{pct}pct_s"))
    return figures


# ---- workers (each in a fresh process) ------------------------------------------------------


def _setup(allocator: str):
    if allocator == "cotenant":
        import cotenant

        cotenant.enable()
    import torch

    torch.backends.cudnn.benchmark = True
    return torch


def _timed_steps(torch, step, warmup: int, steps: int, after_warmup=None) -> float:
    """Median seconds per step, synchronized; `after_warmup()` runs between
    the warm-up steps and the timed ones."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    if after_warmup is not None:
        after_warmup()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _model(torch, name: str):
    nn = torch.nn
    if name == "resnet50":
        try:
            import torchvision

            model = torchvision.models.resnet50()
        except ImportError:  # a ResNet-like stack of the same shape class, without torchvision
            blocks = []
            channels = 64
            for out in (64, 128, 256, 512):
                blocks += [nn.Conv2d(channels, out, 3, padding=1, stride=2 if out > 64 else 1),
                           nn.BatchNorm2d(out), nn.ReLU(), nn.Conv2d(out, out, 3, padding=1),
                           nn.BatchNorm2d(out), nn.ReLU()]
                channels = out
            model = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3), nn.BatchNorm2d(64), nn.ReLU(),
                                  *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000))
        x = torch.randn(64, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (64,), device="cuda")
        return model.cuda(), x, y
    # GPT-style: causal decoder stack.
    dim, layers, vocab, seq = 768, 12, 32000, 512

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            layer = nn.TransformerEncoderLayer(dim, 12, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers)
            self.head = nn.Linear(dim, vocab)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

        def forward(self, tokens):
            return self.head(self.blocks(self.embed(tokens), mask=self.mask, is_causal=True))

    tokens = torch.randint(0, vocab, (8, seq), device="cuda")
    return GPT().cuda(), tokens, torch.roll(tokens, -1, 1)


def _train_step(torch, model, x, y, opt):
    def step():
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def _fake_then_setup(allocator: str):
    """(the fake's handle, or None on a GPU, torch): under --over-fake the
    fake is reset before torch starts, and torch must see it."""
    if not os.environ.get(OVER_FAKE_VARIABLE):
        return None, _setup(allocator)
    sys.path.insert(0, os.path.join(HERE, "pytorch_allocator"))
    import over_fake

    fake = over_fake.open_preloaded(os.environ[OVER_FAKE_VARIABLE], 80 * GIB)
    torch = _setup(allocator)
    over_fake.check_torch_sees_the_fake(torch)
    return fake, torch


def _calls_since(fake, before: Dict[str, int], per: int) -> Dict[str, float]:
    """The fake's calls since `before`, each divided by `per`; entries not called left out."""
    calls = {name: count - before.get(name, 0) for name, count in fake.all_calls().items()}
    return {name: count / per for name, count in sorted(calls.items()) if count}


def worker_alloc_free(allocator: str, args) -> Dict:
    fake, torch = _fake_then_setup(allocator)
    sizes = size_sequence(args.alloc_pairs)
    live_window = 32  # tensors alive at once, as in a forward pass

    def run():
        live = []
        for n in sizes:
            live.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
            if len(live) > live_window:
                live.pop(0)
        live.clear()

    # The same pairs through the allocator's own calls: no tensor, no op.
    stream = torch.cuda.current_stream()
    alloc, delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete

    def run_raw():
        live = []
        for n in sizes:
            live.append(alloc(n, stream=stream))
            if len(live) > live_window:
                delete(live.pop(0))
        for pointer in live:
            delete(pointer)

    def timed(loop) -> float:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            loop()
            times.append(time.perf_counter() - start)
        # The median pass: a pass the machine interrupted does not move it.
        return statistics.median(times) / len(sizes)

    run()  # fills the cache: both allocators measured warm
    torch.cuda.synchronize()
    calls_before = fake.all_calls() if fake is not None else {}
    result = {"s_per_pair": timed(run)}
    if fake is not None:
        result["calls_per_pair"] = _calls_since(fake, calls_before, args.repeats * len(sizes))
    run_raw()
    torch.cuda.synchronize()
    result["raw_s_per_pair"] = timed(run_raw)
    if fake is not None:
        result["violations"] = fake.violations()
    return result


# The page moves both move workers make: under a cap (so that host pages
# given up are kept), spill and restore, then again into the kept pages.
MOVE_ROUNDS = (("spill", "spill_all"), ("restore", "restore_all"), ("spill_kept", "spill_all"),
               ("restore_kept", "restore_all"))


def worker_move_calls(allocator: str, args) -> Dict:
    """--over-fake only: the driver and runtime calls per 2 MiB page that
    spill_all and restore_all make, on 64 MiB of tensors, twice."""
    fake, torch = _fake_then_setup("cotenant")
    import cotenant

    blocks = [torch.empty(16 * MIB, dtype=torch.uint8, device="cuda") for _ in range(4)]
    pages = sum(block.numel() for block in blocks) // (2 * MIB)
    from cotenant import _C

    # A cap the job is under (the whole device: a fraction of 1.0 would be no cap).
    cotenant.set_memory_cap(_C.device_total_bytes(torch.cuda.current_device()))
    result = {"pages": pages}
    for name, move in MOVE_ROUNDS:
        before = fake.all_calls()
        moved = getattr(cotenant, move)()
        result[f"{name}_moved_bytes"] = moved
        result[f"{name}_calls_per_page"] = _calls_since(fake, before, pages)
    result["host_pool_bytes_after"] = cotenant.memory_stats()["host_pool_bytes"]
    result["violations"] = fake.violations()
    return result


def worker_step_time(allocator: str, args) -> Dict:
    torch = _setup(allocator)
    model, x, y = _model(torch, args.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return {"s": _timed_steps(torch, _train_step(torch, model, x, y, opt), args.warmup, args.steps)}


def worker_moves(allocator: str, args) -> Dict:
    torch = _setup("cotenant")
    import cotenant

    nbytes = args.move_gib * GIB
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    x.fill_(7)
    # Pinned cudaMemcpy, the reference, in the same process.
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    pinned.copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    d2h = nbytes / (time.perf_counter() - start) / 1e9
    start = time.perf_counter()
    x.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    h2d = nbytes / (time.perf_counter() - start) / 1e9
    del pinned
    mode = cotenant.memory_stats()["mode"]
    if mode != "remap":
        return {"memcpy_d2h_gbps": d2h, "memcpy_h2d_gbps": h2d, "mode": mode}
    from cotenant import _C

    device = torch.cuda.current_device()
    # A cap the job is under (the whole device: a fraction of 1.0 would be no
    # cap), so that host pages given up are kept.
    cotenant.set_memory_cap(_C.device_total_bytes(device))
    result = {"memcpy_d2h_gbps": d2h, "memcpy_h2d_gbps": h2d, "mode": mode, "page_bytes": _C._page_bytes(device)}
    for name, move in MOVE_ROUNDS:
        _C._reset_driver_call_times(device)
        start = time.perf_counter()
        moved = getattr(cotenant, move)()
        result[f"{name}_gbps"] = moved / (time.perf_counter() - start) / 1e9
        result[f"{name}_moved"] = moved
        result[f"{name}_driver_calls"] = _C._driver_call_times(device)
    result["host_pool_bytes_after"] = cotenant.memory_stats()["host_pool_bytes"]
    result["data_intact"] = bool((x[:: 1 << 20] == 7).all().item())
    # What a host reserve costs at enable: pinning as many host pages as the
    # first spill did (the kept ones go back with the cap first).
    cotenant.set_memory_cap(None)
    _C._reset_driver_call_times(device)
    start = time.perf_counter()
    reserved = cotenant.reserve_host_memory(nbytes)
    result["reserve_pin_gbps"] = reserved / (time.perf_counter() - start) / 1e9
    result["reserve_driver_calls"] = _C._driver_call_times(device)
    cotenant.reserve_host_memory(0)
    del x
    torch.cuda.empty_cache()

    # A region paused with keep=True and resumed, as an RL job does with its
    # rollout engine's memory each step: without a reserve (each pause pins,
    # each resume releases), then with one of the region's size.
    with cotenant.region("bench"):
        r = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    r.fill_(9)
    torch.cuda.synchronize()
    for suffix, reserve in (("", 0), ("_reserved", nbytes)):
        cotenant.reserve_host_memory(reserve)
        for name, call in (("pause", lambda: cotenant.pause_region("bench", keep=True)),
                           ("resume", lambda: cotenant.resume_region("bench"))):
            _C._reset_driver_call_times(device)
            start = time.perf_counter()
            moved = call()
            result[f"region_{name}{suffix}_gbps"] = moved / (time.perf_counter() - start) / 1e9
            result[f"region_{name}{suffix}_moved"] = moved
            result[f"region_{name}{suffix}_driver_calls"] = _C._driver_call_times(device)
    result["region_data_intact"] = bool((r[:: 1 << 20] == 9).all().item())
    cotenant.reserve_host_memory(0)
    return result


# The extent sizes the driver probe (_C._probe_vmm_costs) tries, in pages.
VMM_PROBE_EXTENT_PAGES = (1, 4, 16, 64, 256)


def worker_vmm_probe(allocator: str, args) -> Dict:
    """What each virtual memory call costs as the extent grows, on the device
    and the host (CudaBackend::probe_vmm_costs): whether a page move's driver
    time is per call, per mapping or per byte. The probe runs twice; the
    first pass warms the driver's paths and the second is kept."""
    fake, torch = _fake_then_setup("cotenant")
    from cotenant import _C

    device = torch.cuda.current_device()
    page = _C._page_bytes(device)
    total = args.probe_mib * MIB
    extents = [pages * page for pages in VMM_PROBE_EXTENT_PAGES if total % (pages * page) == 0]
    _C._probe_vmm_costs(device, total, extents)
    result = {"page_bytes": page, "total_bytes": total, "rows": _C._probe_vmm_costs(device, total, extents)}
    if fake is not None:
        result["violations"] = fake.violations()
    return result


def worker_shrink(allocator: str, args) -> Dict:
    torch = _setup("cotenant")
    import cotenant

    out = {}
    for gib in args.shrink_gib:
        keep = torch.empty(GIB, dtype=torch.uint8, device="cuda")
        victim = torch.empty(gib * GIB, dtype=torch.uint8, device="cuda")
        keep.fill_(1)
        victim.fill_(2)
        torch.cuda.synchronize()
        held = cotenant.memory_stats()["device_bytes"]
        start = time.perf_counter()
        cotenant.set_memory_cap(held - gib * GIB)  # returns after the safe point moved the pages
        elapsed = time.perf_counter() - start
        stats = cotenant.memory_stats()
        out[f"{gib}GiB"] = elapsed if stats["device_bytes"] <= stats["memory_cap"] else None
        cotenant.set_memory_cap(None)
        del keep, victim
        torch.cuda.empty_cache()
    return out


def _move_counters(cotenant) -> Dict[str, int]:
    raw = cotenant.memory_stats()["raw"]
    return {name: int(raw.get(name, 0)) for name in ("spilled_bytes", "restored_bytes", "num_migrations")}


def worker_spilled(allocator: str, args) -> Dict:
    torch = _setup("cotenant")
    import cotenant
    from cotenant import _C

    device = torch.cuda.current_device()
    model, x, y = _model(torch, "gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = _train_step(torch, model, x, y, opt)
    torch.cuda.reset_peak_memory_stats()
    out = {"0pct_s": _timed_steps(torch, step, args.warmup, args.steps)}
    # The step's working set is its peak (activations included), not what
    # stays allocated between steps: a cap at 75% of the latter puts most of
    # the activations on the host, far more than a quarter.
    working_set = torch.cuda.max_memory_allocated()
    out["working_set_bytes"] = working_set
    for pct in (25, 50):
        cotenant.set_memory_cap(None)
        cotenant.restore_all()
        cotenant.set_memory_cap(int(working_set * (100 - pct) / 100))
        counted: Dict[str, Dict[str, int]] = {}

        def start_counting():
            _C._reset_driver_call_times(device)
            counted["before"] = _move_counters(cotenant)

        out[f"{pct}pct_s"] = _timed_steps(torch, step, args.warmup, args.steps, after_warmup=start_counting)
        stats = cotenant.memory_stats()
        out[f"{pct}pct_host_bytes"] = stats["host_bytes"]
        # Of those, the pages holding a live block at the step's end: what
        # kernels read across the bus (the rest is the layout's free pages).
        out[f"{pct}pct_host_live_bytes"] = stats["host_live_bytes"]
        # Where a spilled step's time goes: the page moves of the timed steps
        # and the driver calls they made, per step.
        after = _move_counters(cotenant)
        per_step = {name: (after[name] - counted["before"][name]) / args.steps for name in after}
        per_step["driver_calls"] = {name: {"calls": t["calls"] / args.steps, "ns": t["ns"] / args.steps}
                                    for name, t in _C._driver_call_times(device).items()}
        out[f"{pct}pct_per_step"] = per_step
    out["page_bytes"] = _C._page_bytes(device)
    return out


def step_driver_ns(per_step: Dict) -> float:
    """Nanoseconds of driver calls in one spilled step (measured.spilled.*pct_per_step)."""
    return sum(t["ns"] for t in per_step["driver_calls"].values())


def spilled_step_table(spilled: Dict) -> List[str]:
    """Lines of a table of where a training step's time goes under a cap that
    puts 25% / 50% of its working set on the host: the step's time, what its
    page moves carried, the device synchronizes of its safe points, and the
    time of all its driver calls (the rest is the step's own work, including
    kernels that read host pages over the bus)."""
    if "error" in spilled:
        return [f"spilled steps: failed: {spilled['error']}"]
    base = spilled.get("0pct_s")
    lines = [f"{'on the host':<12} {'step ms':>8} {'x none':>7} {'MiB out':>8} {'MiB back':>8} {'moves':>6} "
             f"{'syncs':>6} {'driver ms':>9} {'share':>6}"]
    for pct in (25, 50):
        seconds, per_step = spilled.get(f"{pct}pct_s"), spilled.get(f"{pct}pct_per_step")
        if seconds is None or per_step is None:
            continue
        driver_ns = step_driver_ns(per_step)
        syncs = per_step["driver_calls"].get("device_synchronize", {}).get("calls", 0)
        times = f"{seconds / base:7.1f}" if base else f"{'-':>7}"
        lines.append(f"{f'{pct}%':<12} {seconds * 1e3:8.1f} {times} {per_step['spilled_bytes'] / 2**20:8.1f} "
                     f"{per_step['restored_bytes'] / 2**20:8.1f} {per_step['num_migrations']:6.0f} {syncs:6.0f} "
                     f"{driver_ns / 1e6:9.1f} {driver_ns / 1e9 / seconds:6.0%}")
    return lines


WORKERS = {
    "alloc_free": worker_alloc_free,
    "move_calls": worker_move_calls,
    "step_time": worker_step_time,
    "moves": worker_moves,
    "vmm_probe": worker_vmm_probe,
    "shrink": worker_shrink,
    "spilled": worker_spilled,
}


# ---- the driver ---------------------------------------------------------------------------


def _run_worker(name: str, allocator: str, extra: List[str], env: Optional[Dict[str, str]] = None) -> Dict:
    command = [sys.executable, os.path.abspath(__file__), "--worker", name, "--allocator", allocator, *extra]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.stderr.write(f"worker {name}/{allocator} failed:\n{result.stderr}\n")
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}
    return json.loads(result.stdout.strip().splitlines()[-1])


# Each comparison runs each allocator twice, in this order: a drift of the
# machine over the four runs (clocks, another tenant, the order itself)
# then weighs on both sides alike. One run each, native first, gave
# ResNet-50 steps 0.91x, 0.97x and 1.10x PyTorch's in three runs of the same
# allocator on one H200.
ALTERNATION = ("native", "cotenant", "cotenant", "native")


def alternated(name: str, extra: List[str], keys: Sequence[str],
               env: Optional[Dict[str, str]] = None) -> Dict[str, Dict]:
    """Runs worker `name` in ALTERNATION's order and returns, per allocator,
    the mean of each of `keys` over its runs (left out when a run failed) and
    each run's result under "runs"; a failed run's error under "error"."""
    rows: Dict[str, List[Dict]] = {"native": [], "cotenant": []}
    for allocator in ALTERNATION:
        rows[allocator].append(_run_worker(name, allocator, extra, env))
    out: Dict[str, Dict] = {}
    for allocator, runs in rows.items():
        row: Dict = {"runs": runs}
        errors = [run["error"] for run in runs if "error" in run]
        if errors:
            row["error"] = errors[0]
        for key in keys:
            values = [run.get(key) for run in runs]
            if all(isinstance(value, (int, float)) for value in values):
                row[key] = statistics.fmean(values)
        out[allocator] = row
    return out


def over_fake_table(measured: Dict[str, Dict]) -> List[str]:
    """Lines of the --over-fake table: microseconds and driver or runtime
    calls per alloc+free pair, per allocator."""
    lines = [f"{'allocator':<10} {'us/pair':>8} {'raw':>8}  calls per pair (timed tensor loop, warm)"]
    for allocator in ("native", "cotenant"):
        row = measured[allocator]
        if "s_per_pair" not in row:
            lines.append(f"{allocator:<10} {'-':>8}  failed: {row.get('error')}")
            continue
        calls = ", ".join(f"{name} {count:g}" for name, count in row["calls_per_pair"].items()) or "none"
        lines.append(f"{allocator:<10} {row['s_per_pair'] * 1e6:8.3f} {row['raw_s_per_pair'] * 1e6:8.3f}  {calls}")
    return lines


def vmm_probe_table(probe: Dict) -> List[str]:
    """Lines of the driver probe's table: per side and extent size, each
    step's microseconds per call and per page (the page the allocator maps)."""
    if "error" in probe:
        return [f"driver probe: failed: {probe['error']}"]
    steps = list(dict.fromkeys(row["step"] for row in probe["rows"]))  # in the order the probe takes them
    page, total = probe["page_bytes"], probe["total_bytes"]
    lines = [f"driver probe, {total // MIB} MiB a pass; us per call / us per {page // MIB} MiB page",
             f"{'side':<7}{'extent':>8}  " + "".join(f"{step:>22}" for step in steps)]
    cells: Dict[tuple, Dict[str, str]] = {}
    for row in probe["rows"]:
        # pages per call: one piece, the whole pass, or one allocation
        pages = {"map_piece": 1, "set_access_piece": 1, "set_access_whole": total // page}.get(
            row["step"], row["extent_bytes"] // page)
        if row["error"]:
            text = row["error"]
        elif row["calls"]:
            per_call = row["ns"] / 1e3 / row["calls"]
            text = f"{per_call:.1f} / {per_call / pages:.1f}"
        else:
            text = "-"
        cells.setdefault((row["side"], row["extent_bytes"]), {})[row["step"]] = text
    for (side, extent), by_step in cells.items():
        lines.append(f"{side:<7}{extent // MIB:>5} MiB  " + "".join(f"{by_step.get(step, ''):>22}" for step in steps))
    return lines


def move_calls_table(moves: Dict) -> List[str]:
    """Lines of the --over-fake table of driver calls per page moved, each round."""
    if "error" in moves:
        return [f"page moves: failed: {moves['error']}"]
    lines = [f"{'page move':<13} calls per 2 MiB page ({moves['pages']} pages; *_kept: into the kept host pages)"]
    for name, _ in MOVE_ROUNDS:
        calls = ", ".join(f"{call} {count:g}" for call, count in moves[f"{name}_calls_per_page"].items())
        lines.append(f"{name:<13} {calls}")
    return lines


def main_over_fake(args, extra: List[str]) -> int:
    """--over-fake: the alloc+free measurement and the calls of page moves,
    torch over the fake CUDA runtime, on the CPU."""
    sys.path.insert(0, os.path.join(HERE, "pytorch_allocator"))
    import over_fake
    from result_file import cpu_model, torch_version

    try:
        library = over_fake.fake_library()
    except ValueError as error:
        sys.stderr.write(f"{error} (COTENANT_PYTORCH_REPLAY names the core build's pytorch_replay)\n")
        return 2
    env = {**over_fake.environment(library), OVER_FAKE_VARIABLE: library}
    env = {k: v for k, v in env.items() if not k.startswith("COTENANT_") or k == OVER_FAKE_VARIABLE}
    pairs = alternated("alloc_free", extra, ("s_per_pair", "raw_s_per_pair"), env)
    measured = {}
    for allocator, row in pairs.items():
        measured[allocator] = row
        if "error" not in row:  # the same loop each run: its calls are the first run's; every run's violations
            row["calls_per_pair"] = row["runs"][0].get("calls_per_pair", {})
            row["violations"] = [v for run in row["runs"] for v in run.get("violations", [])]
    moves = _run_worker("move_calls", "cotenant", extra, env)
    probe = _run_worker("vmm_probe", "cotenant", extra, env)
    figures = {"alloc_free_ratio_vs_native": ratio(measured["cotenant"].get("s_per_pair"),
                                                   measured["native"].get("s_per_pair")),
               "alloc_free_raw_ratio_vs_native": ratio(measured["cotenant"].get("raw_s_per_pair"),
                                                       measured["native"].get("raw_s_per_pair"))}
    for name, _ in MOVE_ROUNDS:
        calls = moves.get(f"{name}_calls_per_page", {})
        figure = f"{name.split('_')[0]}_vmm_calls_per_page" + ("_kept" if name.endswith("_kept") else "")
        figures[figure] = sum(calls.get(call, 0) for call in VMM_CALLS) if calls else None
    measured["moves"] = moves
    measured["vmm_probe"] = probe
    result = {"device": f"simulated (CPU: {cpu_model()}), torch over the fake CUDA runtime", "torch": torch_version(),
              "benchmark": "allocator_over_fake", "figures": figures, "measured": measured, "quick": args.quick}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "allocator_over_fake.json")
    write_json(result, path)
    print("\n".join(over_fake_table(measured)))
    print("\n".join(move_calls_table(moves)))
    print("\n".join(vmm_probe_table(probe)))
    print(json.dumps(figures, indent=2))
    print(f"wrote {path}")
    failed = [name for name, row in measured.items() if "error" in row or row.get("violations")]
    return 1 if failed else 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=RESULTS_DIR, help="directory for the JSON result")
    parser.add_argument("--quick", action="store_true", help="fewer steps and smaller sizes (a smoke run)")
    parser.add_argument("--over-fake", action="store_true",
                        help="on the CPU, torch over the fake CUDA runtime: only the alloc+free measurement "
                             "and the driver calls of page moves")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--allocator", choices=["native", "cotenant"], default="cotenant", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="gpt", help=argparse.SUPPRESS)
    parser.add_argument("--alloc-pairs", type=int, default=20000, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=30, help=argparse.SUPPRESS)
    parser.add_argument("--move-gib", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--probe-mib", type=int, default=512, help=argparse.SUPPRESS)
    parser.add_argument("--shrink-gib", type=int, nargs="+", default=[1, 4, 16], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(WORKERS[args.worker](args.allocator, args)))
        return 0

    quick = ["--steps", "5", "--warmup", "2", "--alloc-pairs", "2000", "--repeats", "2", "--move-gib", "1",
             "--shrink-gib", "1", "--probe-mib", "128"] if args.quick else []
    if args.over_fake:
        return main_over_fake(args, quick)
    measured: Dict[str, Dict] = {}
    pairs = alternated("alloc_free", quick, ("s_per_pair", "raw_s_per_pair"))
    measured["alloc_free"] = {f"{allocator}_{key}": pairs[allocator].get(key)
                              for allocator in ("native", "cotenant") for key in ("s_per_pair", "raw_s_per_pair")}
    measured["alloc_free"]["runs"] = {allocator: pairs[allocator]["runs"] for allocator in ("native", "cotenant")}
    measured["step_time"] = {}
    for model in ("resnet50", "gpt"):
        steps = alternated("step_time", quick + ["--model", model], ("s",))
        measured["step_time"][model] = {"native_s": steps["native"].get("s"), "cotenant_s": steps["cotenant"].get("s"),
                                        "runs": {allocator: [run.get("s") for run in steps[allocator]["runs"]]
                                                 for allocator in ("native", "cotenant")}}
    measured["moves"] = _run_worker("moves", "cotenant", quick)
    measured["vmm_probe"] = _run_worker("vmm_probe", "cotenant", quick)
    measured["shrink"] = _run_worker("shrink", "cotenant", quick)
    measured["spilled"] = _run_worker("spilled", "cotenant", quick)

    result = {**gpu_environment(), "benchmark": "allocator", "figures": compute_figures(measured),
              "measured": measured, "quick": args.quick}
    path = result_base(args.out, "allocator", result["device"]) + ".json"
    write_json(result, path)
    print(json.dumps(result["figures"], indent=2))
    moves = measured["moves"]
    for name, _ in MOVE_ROUNDS:
        if f"{name}_driver_calls" in moves:
            print(f"\n{name}: {moves[name + '_gbps']:.2f} GB/s; where the time of "
                  f"{moves[name + '_moved'] / GIB:.2f} GiB of page moves went")
            pages = moves[name + "_moved"] // moves["page_bytes"]
            print("\n".join(driver_time_table(moves[f"{name}_driver_calls"], pages)))
    for name in ("region_pause", "region_resume", "region_pause_reserved", "region_resume_reserved"):
        if f"{name}_driver_calls" in moves:
            print(f"\n{name}: {moves[name + '_gbps']:.2f} GB/s; where the time of "
                  f"{moves[name + '_moved'] / GIB:.2f} GiB of page moves went")
            pages = moves[name + "_moved"] // moves["page_bytes"]
            print("\n".join(driver_time_table(moves[f"{name}_driver_calls"], pages)))
    print()
    print("\n".join(vmm_probe_table(measured["vmm_probe"])))
    print()
    print("\n".join(spilled_step_table(measured["spilled"])))
    per_step = measured["spilled"].get("50pct_per_step")
    if per_step is not None:
        pages = (per_step["spilled_bytes"] + per_step["restored_bytes"]) / measured["spilled"]["page_bytes"]
        print("\nwhere a step's driver time went with half its working set on the host (per step)")
        print("\n".join(driver_time_table(per_step["driver_calls"], pages)))
    if "reserve_driver_calls" in moves:
        pages = moves["spill_moved"] // moves["page_bytes"]  # the reserve pins as many pages as the first spill
        print(f"\nhost reserve: pinned at {moves['reserve_pin_gbps']:.2f} GB/s; where its time went")
        print("\n".join(driver_time_table(moves["reserve_driver_calls"], pages)))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
