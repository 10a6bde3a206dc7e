"""cotenant's allocator on a real GPU: statistics, training loops with and without
caps, record_stream, CUDA graphs, torch.compile.

Every test runs its workload in a fresh Python process, because cotenant must be
enabled before the process's first CUDA allocation. Marked `gpu`: skipped,
with the reason shown, on machines without one (tests/python/conftest.py).
"""

import os
import subprocess
import sys
import textwrap

import pytest
from fresh_process import run_json

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AUTOENABLE_DIR = os.path.join(REPO, "python", "cotenant", "_autoenable")
MIB = 1 << 20

# Shared by the training tests: deterministic kernels, so two runs of the same
# loop produce the same bits whichever allocator hands out the memory.
MODELS = r'''
import os, json, torch, torch.nn as nn

def deterministic():
    torch.manual_seed(0)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)

class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(128, 10)
    def forward(self, x):
        return self.head(self.features(x).flatten(1))

class SmallTransformer(nn.Module):
    def __init__(self, vocab=1000, dim=256, layers=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 8, 4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.out = nn.Linear(dim, vocab)
    def forward(self, tokens):
        return self.out(self.encoder(self.embed(tokens)))

def batches(kind, steps):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        if kind == "cnn":
            yield torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
        else:
            t = torch.randint(0, 1000, (16, 64), generator=g)
            yield t, torch.roll(t, -1, dims=1)

def train(kind, steps, on_step=None):
    deterministic()
    model = (SmallCNN() if kind == "cnn" else SmallTransformer()).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for step, (x, y) in enumerate(batches(kind, steps)):
        x, y = x.cuda(), y.cuda()
        out = model(x)
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()  # cotenant's optimizer-step safe point runs after this
        losses.append(loss.item().hex())
        if on_step:
            on_step(step)
    return losses
'''


def run_script(body, use_cotenant=True, env_extra=None, pythonpath_prefix=None, timeout=300, as_job=False):
    """Runs `body` in a fresh process and returns the JSON object it prints last."""
    prelude = "import cotenant\ncotenant.enable()\n" if use_cotenant else ""
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    if pythonpath_prefix:
        env["PYTHONPATH"] = os.pathsep.join([*pythonpath_prefix, env.get("PYTHONPATH", "")])
    from coordinator_harness import AS_JOB

    launcher = AS_JOB if as_job else None  # as_job: the process `cotenant run` marks as the job
    return run_json(prelude + MODELS + textwrap.dedent(body), env=env, env_extra=env_extra, launcher=launcher,
                    timeout=timeout)


# ---- statistics ------------------------------------------------------------------------


def test_torch_memory_statistics_agree_with_the_core():
    out = run_script("""
        stats = {}
        xs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (100, 4096, 3 << 20, 25 << 20)]
        core = cotenant.memory_stats()
        stats["allocated"] = [torch.cuda.memory_allocated(), core["allocated_bytes"]]
        stats["reserved"] = [torch.cuda.memory_reserved(), core["reserved_bytes"]]
        stats["device_plus_host"] = core["device_bytes"] + core["host_bytes"]
        stats["snapshot_total"] = sum(s["total_size"] for s in torch.cuda.memory_snapshot())
        stats["count"] = torch.cuda.memory_stats()["allocation.all.current"]
        peak = torch.cuda.max_memory_allocated()
        del xs
        stats["after_free"] = torch.cuda.memory_allocated()
        stats["peak_kept"] = torch.cuda.max_memory_allocated() == peak
        torch.cuda.reset_peak_memory_stats()
        stats["peak_reset"] = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        stats["reserved_after_empty"] = torch.cuda.memory_reserved()
        stats["mode"] = core["mode"]
        stats["backend"] = torch.cuda.memory.get_allocator_backend() if hasattr(torch.cuda.memory, "get_allocator_backend") else None
        print(json.dumps(stats))
    """)
    assert out["allocated"][0] == out["allocated"][1] > 28 * MIB
    assert out["reserved"][0] == out["reserved"][1] == out["device_plus_host"]
    # A snapshot's segments are the mapped pages (reserved), one per run of one residency.
    assert out["snapshot_total"] == out["reserved"][0]
    assert out["count"] == 4
    assert out["after_free"] == 0 and out["peak_kept"] and out["peak_reset"] == 0
    assert out["reserved_after_empty"] == 0
    assert out["mode"] in ("remap", "pinned_fallback")


def test_enable_after_a_cuda_allocation_says_how_to_fix_it():
    out = run_script("""
        import cotenant
        x = torch.ones(1024, device="cuda")
        try:
            cotenant.enable()
            print(json.dumps({"error": None}))
        except RuntimeError as error:
            print(json.dumps({"error": str(error)}))
    """, use_cotenant=False)
    assert "must run before the first CUDA allocation" in out["error"]
    assert "cotenant run" in out["error"]


def test_the_extension_refuses_to_install_after_a_cuda_allocation_too():
    # enable() refuses in Python first; _C.install() has its own check, which
    # reads PyTorch's allocator statistics. The result is flushed before the
    # process ends and faulthandler names the frame of a crash, so a failure
    # here says whether the check or the interpreter's exit went wrong.
    out = run_script("""
        import faulthandler, sys
        faulthandler.enable()
        from cotenant import _C
        x = torch.ones(1024, device="cuda")
        try:
            _C.install()
            print(json.dumps({"error": None}), flush=True)
        except RuntimeError as error:
            print(json.dumps({"error": str(error)}), flush=True)
    """, use_cotenant=False)
    assert "must run before the first CUDA allocation" in out["error"]
    assert "4.00 KiB" in out["error"] and "cuda:0" in out["error"]


# ---- training loops -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cnn", "transformer"])
def test_training_losses_are_bitwise_identical_with_and_without_cotenant(kind):
    body = f"print(json.dumps(train('{kind}', 30)))"
    native = run_script(body, use_cotenant=False)
    ours = run_script(body)
    assert ours == native


@pytest.mark.parametrize("kind", ["cnn", "transformer"])
def test_cap_cut_below_the_working_set_and_raised_again_keeps_losses_identical(kind):
    native = run_script(f"print(json.dumps(train('{kind}', 30)))", use_cotenant=False)
    out = run_script(f"""
        checks = []
        def on_step(step):
            if step == 9:   # cut to half of what the job holds: live parameters must spill
                held = cotenant.memory_stats()["device_bytes"]
                # The driver's figures: under a cap torch.cuda.mem_get_info reports the room under it.
                free_before, total = torch.cuda.mem_get_info.__wrapped__()
                cotenant.set_memory_cap(max(held // 2, 4 << 20))
                free_after, _ = torch.cuda.mem_get_info.__wrapped__()
                checks.append({{"step": step, "held": held, "returned": free_after - free_before}})
            if step == 19:
                cotenant.set_memory_cap(None)
                cotenant.restore_all()
            s = cotenant.memory_stats()
            cap = s["memory_cap"]
            checks.append({{"step": step, "device": s["device_bytes"], "host": s["host_bytes"], "cap": cap,
                           "within": cap is None or s["device_bytes"] <= cap}})
        losses = train('{kind}', 30, on_step)
        print(json.dumps({{"losses": losses, "checks": checks}}))
    """)
    assert out["losses"] == native
    per_step = [c for c in out["checks"] if "within" in c]
    assert all(c["within"] for c in per_step), per_step
    capped = [c for c in per_step if 9 <= c["step"] < 19]
    assert all(c["host"] > 0 for c in capped), "nothing spilled while the cap was below the working set"
    cut = next(c for c in out["checks"] if "returned" in c)
    # cudaMemGetInfo sees the device memory come back (minus what the cap keeps).
    assert cut["returned"] >= (cut["held"] - cut["held"] // 2) * 0.9
    assert per_step[-1]["host"] == 0, "restore_all left pages on the host with no cap"


def test_spill_all_and_restore_all_keep_addresses_and_values():
    out = run_script("""
        from cotenant import _C
        x = torch.arange(4 << 20, dtype=torch.float32, device="cuda")
        ptr, total = x.data_ptr(), x.sum().item()
        moved_out = cotenant.spill_all()
        spilled = {"resident": _C.is_device_resident(ptr, 0), "sum": (x * 1).sum().item(),
                   "host": cotenant.memory_stats()["host_bytes"]}
        moved_in = cotenant.restore_all()
        print(json.dumps({"ptr_same": x.data_ptr() == ptr, "total": total, "spilled": spilled,
                          "moved_out": moved_out, "moved_in": moved_in,
                          "resident_after": _C.is_device_resident(ptr, 0),
                          "sum_after": x.sum().item(), "mode": cotenant.memory_stats()["mode"]}))
    """)
    if out["mode"] != "remap":
        pytest.skip("this GPU has no host virtual memory management: live pages cannot move")
    assert out["ptr_same"]
    assert out["spilled"]["resident"] is False and out["spilled"]["host"] >= 16 * MIB
    assert out["spilled"]["sum"] == out["total"] == out["sum_after"]
    assert out["moved_out"] >= 16 * MIB and out["moved_in"] >= 16 * MIB
    assert out["resident_after"] is True


def test_a_job_squeezed_twice_pins_host_pages_once_and_keeps_its_values():
    """Under a cap, host pages a restore gives up stay with the job: the second
    spill creates none (driver call counts), a kernel reads the spilled tensor
    through its host pages both times (each host page is mapped twice: at its
    copy address and at the tensor's), and lifting the cap gives them back."""
    out = run_script("""
        from cotenant import _C
        device = torch.cuda.current_device()
        cotenant.set_memory_cap(_C.device_total_bytes(device))  # a cap the job is under
        x = torch.arange(16 << 20, dtype=torch.float32, device="cuda")  # 64 MiB
        total = x.sum().item()
        rounds = []
        for _ in range(2):
            _C._reset_driver_call_times(device)
            cotenant.spill_all()
            calls = _C._driver_call_times(device)
            rounds.append({"sum_on_host": (x * 1).sum().item(),
                           "host_pages_created": calls["create_host_page"]["calls"],
                           "restored": cotenant.restore_all(), "sum_after": x.sum().item(),
                           "kept": cotenant.memory_stats()["host_pool_bytes"]})
        cotenant.set_memory_cap(None)
        print(json.dumps({"mode": cotenant.memory_stats()["mode"], "total": total, "rounds": rounds,
                          "kept_after_lifting": cotenant.memory_stats()["host_pool_bytes"]}))
    """)
    if out["mode"] != "remap":
        pytest.skip("this GPU has no host virtual memory management: live pages cannot move")
    first, second = out["rounds"]
    assert first["host_pages_created"] >= 32 and second["host_pages_created"] == 0, out
    for r in (first, second):
        assert r["sum_on_host"] == r["sum_after"] == out["total"], out
        assert r["restored"] >= 64 * MIB and r["kept"] >= 64 * MIB, out
    assert out["kept_after_lifting"] == 0


def test_a_host_reserve_lets_the_first_squeeze_pin_nothing_and_keeps_the_values():
    """reserve_host_memory() pins host pages before any cap: the first spill
    creates none (driver call counts), a kernel reads the spilled tensor
    through the reserve's pages, and the reserve outlives the cap's removal."""
    out = run_script("""
        from cotenant import _C
        device = torch.cuda.current_device()
        reserved = cotenant.reserve_host_memory("64MiB")
        x = torch.arange(16 << 20, dtype=torch.float32, device="cuda")  # 64 MiB
        total = x.sum().item()
        _C._reset_driver_call_times(device)
        cotenant.spill_all()
        calls = _C._driver_call_times(device)
        sum_on_host = (x * 1).sum().item()
        cotenant.restore_all()
        cotenant.set_memory_cap(None)
        stats = cotenant.memory_stats()
        print(json.dumps({"mode": stats["mode"], "reserved": reserved, "total": total, "sum_on_host": sum_on_host,
                          "sum_after": x.sum().item(), "host_pages_created": calls["create_host_page"]["calls"],
                          "kept": stats["host_pool_bytes"], "reserve": stats["host_reserve_bytes"]}))
    """)
    if out["mode"] != "remap":
        pytest.skip("this GPU has no host virtual memory management: no host pages to reserve")
    assert out["reserved"] == out["reserve"] == 64 * MIB, out
    assert out["host_pages_created"] == 0, out
    assert out["sum_on_host"] == out["sum_after"] == out["total"], out
    assert out["kept"] == 64 * MIB, out


def test_a_host_headroom_holds_a_squeeze_on_the_device_and_a_kernel_still_reads_the_tensor():
    """With a headroom no host has, the squeeze pins nothing (driver call
    counts): the pages stay on the device, a kernel reads the tensor, an
    allocation past the cap names the headroom, and a headroom of 0 lets the
    next safe point move the pages."""
    out = run_script("""
        from cotenant import _C
        device = torch.cuda.current_device()
        cotenant.set_host_headroom("1024TiB")
        x = torch.arange(16 << 20, dtype=torch.float32, device="cuda")  # 64 MiB
        total = x.sum().item()
        # Under the cap with nothing movable, no new page may be made (an
        # allocation would be refused): the kernel that reads x writes into
        # memory taken before the cut.
        index = torch.arange(0, 16 << 20, 1 << 20, device="cuda")
        probe = torch.empty(16, dtype=torch.float32, device="cuda")
        torch.cuda.synchronize()
        _C._reset_driver_call_times(device)
        cotenant.set_memory_cap("32MiB")
        created = _C._driver_call_times(device)["create_host_page"]["calls"]
        held = cotenant.memory_stats()
        torch.index_select(x, 0, index, out=probe)
        read_held = probe.cpu().tolist()
        try:
            torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
            oom = None
        except torch.OutOfMemoryError as error:
            oom = str(error)
        cotenant.set_host_headroom(0)
        cotenant.safe_point()
        after = cotenant.memory_stats()
        from cotenant.coordinator.host_memory import read_meminfo
        mem_available = read_meminfo()["available_bytes"]
        print(json.dumps({"mode": held["mode"], "created": created, "held_host": held["host_bytes"],
                          "held_pending": held["pending_spill_bytes"], "total": total, "read_held": read_held,
                          "oom": oom, "after_host": after["host_bytes"], "sum_after": x.sum().item(),
                          "available": after["host_available_bytes"], "mem_available": mem_available}))
    """)
    if out["mode"] != "remap":
        pytest.skip("this GPU has no host virtual memory management: pages cannot move")
    assert out["created"] == 0 and out["held_host"] == 0 and out["held_pending"] >= 32 * MIB, out
    assert out["read_held"] == [float(i << 20) for i in range(16)], out
    assert out["oom"] is not None and "at its headroom" in out["oom"], out
    assert out["after_host"] >= 32 * MIB, out
    assert out["sum_after"] == out["total"], out
    # What the job may take: MemAvailable, or less where its memory cgroup's limit is nearer.
    assert 0 < out["available"] <= out["mem_available"] + (512 << 20), out


def test_a_region_paused_with_keep_takes_its_host_pages_from_the_reserve():
    """The host reserve is the device's: a region's kept pause creates no host
    page (driver call counts), a kernel reads the paused tensor over the
    host mapping, and the resume gives the pages back to the reserve."""
    out = run_script("""
        from cotenant import _C
        device = torch.cuda.current_device()
        cotenant.reserve_host_memory("64MiB")
        with cotenant.region("kv_cache"):
            kv = torch.arange(16 << 20, dtype=torch.float32, device="cuda")  # 64 MiB
        total = kv.sum().item()
        created, sums = [], []
        for _ in range(2):
            _C._reset_driver_call_times(device)
            cotenant.pause_region("kv_cache", keep=True)
            created.append(_C._driver_call_times(device)["create_host_page"]["calls"])
            sums.append((kv * 1).sum().item())
            cotenant.resume_region("kv_cache")
            sums.append(kv.sum().item())
        stats = cotenant.memory_stats()
        print(json.dumps({"mode": stats["mode"], "total": total, "created": created, "sums": sums,
                          "kept": stats["host_pool_bytes"]}))
    """)
    if out["mode"] != "remap":
        pytest.skip("this GPU has no host virtual memory management: a kept pause needs host pages")
    assert out["created"] == [0, 0], out
    assert out["sums"] == [out["total"]] * 4, out
    assert out["kept"] == 64 * MIB, out


# ---- streams, graphs, compile, cuDNN, IPC ------------------------------------------------------


def test_record_stream_holds_a_block_until_the_other_stream_is_done():
    # Both kernels run once first: CUDA loads a kernel's module at its first
    # launch (lazy loading), and loading waits for the work already on the
    # device, so a first x.add_(1) behind the sleep would wait it out and
    # leave the side stream idle by the time x is freed.
    out = run_script("""
        side = torch.cuda.Stream()
        warm = torch.zeros(16, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(side):
            torch.cuda._sleep(1000)
            warm.add_(1)
        torch.cuda.synchronize()
        x = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
        ptr = x.data_ptr()
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000_000)  # keeps the side stream busy for a while
            x.add_(1)
        x.record_stream(side)
        del x
        y = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
        reused_while_busy = y.data_ptr() == ptr
        busy_at_reuse = not side.query()
        side.synchronize()
        del y
        z = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
        z2 = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
        print(json.dumps({"reused_while_busy": reused_while_busy, "busy_at_reuse": busy_at_reuse,
                          "reused_after": ptr in (z.data_ptr(), z2.data_ptr())}))
    """)
    assert out["busy_at_reuse"] is True, "the side stream was already idle: the test shows nothing"
    assert out["reused_while_busy"] is False
    assert out["reused_after"] is True


def test_cuda_graph_capture_and_replay_match_eager():
    out = run_script("""
        deterministic()
        model = SmallCNN().cuda().eval()
        static_in = torch.randn(8, 3, 32, 32, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.no_grad():
            for _ in range(3):
                model(static_in)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            static_out = model(static_in)
        results = []
        for i in range(3):
            static_in.copy_(torch.randn(8, 3, 32, 32, device="cuda"))
            graph.replay()
            with torch.no_grad():
                results.append(torch.equal(static_out, model(static_in)))
        pools = {tuple(s["segment_pool_id"]) for s in torch.cuda.memory_snapshot()
                 if "segment_pool_id" in s}
        del graph, static_out
        torch.cuda.empty_cache()
        print(json.dumps({"equal": results, "pools": len(pools)}))
    """)
    assert out["equal"] == [True, True, True]


def test_triton_launches_wait_for_a_pause_and_count_as_ops():
    # Triton kernels launch outside ATen. A hand-written @triton.jit kernel is
    # seen only through Triton's launch hooks; torch.compile's kernels through
    # those or Inductor's launcher. Either launch must wait while launches are
    # paused (a safe point moves pages then).
    out = run_script("""
        import threading
        import triton
        import triton.language as tl
        from cotenant import _C

        @triton.jit
        def add_one(x_ptr, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

        x = torch.zeros(1024, device="cuda")
        compiled = torch.compile(lambda t: t.add_(1))
        launches = {"hand-written": lambda: add_one[(4,)](x, 1024, BLOCK=256), "torch.compile": lambda: compiled(x)}
        for launch in launches.values():
            launch()  # compiled and loaded
        torch.cuda.synchronize()
        result = {}
        for name, launch in launches.items():
            _C._count_op_entries(True)
            before = _C._counted_op_entries()
            launch()
            counted = _C._counted_op_entries() - before
            _C._count_op_entries(False)
            assert _C._pause_launches(10.0)
            done = threading.Event()
            thread = threading.Thread(target=lambda: (launch(), done.set()))
            thread.start()
            held = not done.wait(0.5)
            _C._resume_launches()
            thread.join(60)
            result[name] = {"counted": counted, "held": held, "done": done.is_set()}
        torch.cuda.synchronize()
        result["value"] = x[0].item()
        result["in_flight"] = _C.ops_in_flight()
        result["hooked"] = _C.triton_launch_enter in triton.knobs.runtime.launch_enter_hook.calls
        print(json.dumps(result))
    """)
    assert out["hooked"] is True
    for name in ("hand-written", "torch.compile"):
        assert out[name]["counted"] >= 1, name
        assert out[name]["held"] is True and out[name]["done"] is True, name
    assert out["value"] == 6.0  # two warm-ups, two counted launches, two held ones
    assert out["in_flight"] == 0


def test_torch_compile_smoke():
    out = run_script("""
        def f(x, y):
            return torch.sin(x) * torch.cos(y) + x @ y
        x = torch.randn(64, 64, device="cuda")
        y = torch.randn(64, 64, device="cuda")
        compiled = torch.compile(f)
        print(json.dumps({"close": torch.allclose(compiled(x, y), f(x, y), atol=1e-4)}))
    """)
    assert out["close"] is True


def test_torch_compile_reduce_overhead_runs_cuda_graph_trees_that_checkpoint_their_pool():
    # f replays, then a g that needs a new graph (k changes shape) starts its
    # warm-up mid-path: the tree puts the pool back to its checkpoint first.
    # Each step is marked: without the mark, inference starts a new generation
    # at every compiled call, and g's input (f's output) reads as overwritten,
    # under PyTorch's allocator as under cotenant's (H200, 2026-11-27). The same
    # script runs under both and must give the same results.
    script = """
        from torch._inductor import cudagraph_trees
        def f(x, w):
            return torch.relu(x @ w)
        def g(h, k):
            return (h @ k).sum(dim=0)
        cf, cg = torch.compile(f, mode="reduce-overhead"), torch.compile(g, mode="reduce-overhead")
        x, w = torch.randn(64, 256, device="cuda"), torch.randn(256, 256, device="cuda")
        close = []
        for step in range(10):
            torch.compiler.cudagraph_mark_step_begin()
            k = torch.randn(256, 32 if step < 5 else 48, device="cuda")
            y = cg(cf(x, w), k).clone()
            close.append(torch.allclose(y, g(f(x, w), k), rtol=1e-3, atol=1e-2))
        manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
        print(json.dumps({"close": close, "checkpoints": manager.debug_checkpointing_counter}))
    """
    pytorch = run_script(script, use_cotenant=False)
    ours = run_script(script)
    assert pytorch["close"] == [True] * 10
    assert pytorch["checkpoints"] >= 1, "the script no longer makes the tree checkpoint its pool"
    assert ours == pytorch


def test_cudnn_benchmark_mode_works():
    out = run_script("""
        torch.backends.cudnn.benchmark = True
        conv = torch.nn.Conv2d(3, 64, 3).cuda()
        y = conv(torch.randn(16, 3, 64, 64, device="cuda"))
        y.sum().backward()
        print(json.dumps({"shape": list(y.shape)}))
    """)
    assert out["shape"] == [16, 64, 62, 62]


def test_cudnn_benchmark_under_a_cap_sizes_its_workspace_to_stay_on_the_device():
    """cuDNN's benchmark mode tries algorithms with workspaces up to what
    torch's cacheInfo answers. Under a cap that answer is the room below it,
    so the trial workspaces stay on the device: nothing spills, and the
    convolution computes what the CPU computes."""
    out = run_script("""
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = False
        cotenant.set_memory_cap("256MiB")
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(64, 64, 3, padding=1)
        x = torch.randn(16, 64, 64, 64)
        expected = conv(x)
        conv_gpu, x_gpu = conv.cuda(), x.cuda()
        from cotenant import _C
        limit = _C._cache_info(0)
        y = conv_gpu(x_gpu)
        y.sum().backward()
        torch.cuda.synchronize()
        cotenant.safe_point()
        stats = cotenant.memory_stats()
        print(json.dumps({"limit": limit, "spilled": stats["spilled_bytes"], "host": stats["host_bytes"],
                          "device": stats["device_bytes"], "peak": torch.cuda.max_memory_allocated(),
                          "error": (y.cpu() - expected).abs().max().item()}))
    """)
    assert 0 < out["limit"] <= 256 * MIB
    assert out["spilled"] == 0 and out["host"] == 0
    assert out["device"] <= 256 * MIB and out["peak"] <= 256 * MIB
    assert out["error"] < 1e-3


def test_sharing_a_cuda_tensor_between_processes_raises_a_clear_error():
    out = run_script("""
        x = torch.ones(16, device="cuda")
        try:
            x.untyped_storage()._share_cuda_()
            print(json.dumps({"error": None}))
        except RuntimeError as error:
            print(json.dumps({"error": str(error)}))
    """)
    assert "not supported while cotenant manages CUDA memory" in out["error"]


def test_each_gpu_gets_its_own_allocator_state():
    out = run_script("""
        if torch.cuda.device_count() < 2:
            print(json.dumps({"skip": True})); raise SystemExit
        a = torch.empty(4 << 20, dtype=torch.uint8, device="cuda:0")
        b = torch.empty(12 << 20, dtype=torch.uint8, device="cuda:1")
        cotenant.set_memory_cap("64MiB", device=1)
        print(json.dumps({"skip": False, "a": torch.cuda.memory_allocated(0), "b": torch.cuda.memory_allocated(1),
                          "cap0": cotenant.memory_cap(0), "cap1": cotenant.memory_cap(1)}))
    """)
    if out["skip"]:
        pytest.skip("needs two GPUs")
    assert out["a"] == 4 * MIB and out["b"] == 12 * MIB
    assert out["cap0"] is None and out["cap1"] == 64 * MIB


def test_autoenable_enables_cotenant_from_the_environment():
    out = run_script("""
        import cotenant
        x = torch.ones(1, device="cuda")
        print(json.dumps({"enabled": cotenant.is_enabled(), "cap": cotenant.memory_cap(),
                          "allocated": torch.cuda.memory_allocated() == cotenant.memory_stats()["allocated_bytes"]}))
    """, use_cotenant=False, pythonpath_prefix=[AUTOENABLE_DIR], as_job=True,
        env_extra={"COTENANT_ENABLE": "1", "COTENANT_MEMORY_CAP": "1GiB"})
    assert out == {"enabled": True, "cap": 1 << 30, "allocated": True}


# ---- with the coordinator -------------------------------------------------------------------

CAPPED_JOB = r'''
import json, time, torch, cotenant
assert cotenant.is_enabled(), "cotenant run did not enable cotenant"
x = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
deadline = time.time() + 60
while time.time() < deadline:
    s = cotenant.memory_stats()
    if s["memory_cap"] is not None and s["memory_cap"] <= 128 << 20 and s["device_bytes"] <= s["memory_cap"]:
        break
    time.sleep(0.05)  # the job is idle: the job channel's thread moves the pages
print(json.dumps({"cap": s["memory_cap"], "device": s["device_bytes"], "host": s["host_bytes"],
                  "mode": s["mode"], "sum": int(x.sum().item())}))
'''


def test_mem_get_info_reports_the_cap_so_a_buffer_sized_from_it_fits_under_it():
    """As an inference server sizes its KV cache: 0.9 of the free memory
    torch.cuda.mem_get_info() reports, under a 1 GiB cap, fits without a
    spill; the driver's own figures stay at __wrapped__."""
    out = run_script("""
        cotenant.set_memory_cap("1GiB")
        weights = torch.ones(64 << 20, device="cuda")  # 256 MiB, written by a kernel
        held = cotenant.memory_stats()["device_bytes"]
        free, total = torch.cuda.mem_get_info()
        driver_free, driver_total = torch.cuda.mem_get_info.__wrapped__()
        cache = torch.zeros(int(free * 0.9) // 4, device="cuda")
        torch.cuda.synchronize()
        cotenant.safe_point()
        stats = cotenant.memory_stats()
        print(json.dumps({"held": held, "free": free, "total": total, "driver_total": driver_total,
                          "driver_free": driver_free, "host": stats["host_bytes"], "device": stats["device_bytes"],
                          "ones": bool((weights == 1).all()), "cache_zero": bool((cache == 0).all())}))
    """)
    assert out["total"] == 1 << 30 and out["free"] == (1 << 30) - out["held"]
    assert out["driver_total"] > out["total"] and out["driver_free"] > out["free"]
    assert out["host"] == 0 and out["device"] <= 1 << 30
    assert out["ones"] and out["cache_zero"]


def test_a_cap_set_through_the_coordinator_reaches_a_running_job():
    from coordinator_harness import cap_a_job_through_the_coordinator

    env = {k: v for k, v in os.environ.items() if not k.startswith("COTENANT_")}
    result = cap_a_job_through_the_coordinator(CAPPED_JOB, "128MiB", env)
    assert result["cap"] == 128 * MIB
    assert result["device"] <= result["cap"]
    assert result["sum"] == 256 * MIB  # the bytes survived the move
    if result["mode"] == "remap":
        assert result["host"] >= 128 * MIB


REGION_JOB = r'''
import json, os, time, torch, cotenant
from cotenant.coordinator import client
sock = os.environ["COTENANT_SOCKET"]
assert cotenant.is_enabled(), "cotenant run did not enable cotenant"
with cotenant.region("kv"):
    kv = torch.full((64 << 20,), 3, dtype=torch.uint8, device="cuda")  # 64 MiB
x = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
def now():
    row = [r for r in cotenant.regions() if r["name"] == "kv"][0]
    s = cotenant.memory_stats()
    return {"cap": s["memory_cap"], "main_device": s["device_bytes"], "region_device": row["device_bytes"]}
deadline = time.time() + 60
while time.time() < deadline and not (now()["cap"] is not None and now()["cap"] <= 128 << 20
                                      and now()["main_device"] <= now()["cap"]):
    time.sleep(0.05)  # the job is idle: the job channel's thread moves the pages
capped = now()
client.send_command("regionjob", "suspend", sock)  # no op runs on this thread while suspended
while time.time() < deadline and not (now()["region_device"] == 0 and now()["main_device"] == 0):
    time.sleep(0.05)
suspended = now()
client.send_command("regionjob", "resume", sock)
while time.time() < deadline and now()["region_device"] < 64 << 20:
    time.sleep(0.05)
print(json.dumps({"capped": capped, "suspended": suspended, "resumed": now(),
                  "x": int(x.sum().item()), "kv": int(kv.sum().item())}))
'''


def test_the_coordinators_cap_counts_a_jobs_region_and_suspend_moves_the_region_too():
    from coordinator_harness import cap_a_job_through_the_coordinator

    env = {k: v for k, v in os.environ.items() if not k.startswith("COTENANT_")}
    result = cap_a_job_through_the_coordinator(REGION_JOB, "192MiB", env, name="regionjob")
    assert result["capped"]["cap"] == 128 * MIB  # the job's 192 MiB less the region's 64
    assert result["capped"]["main_device"] <= 128 * MIB
    # Suspended, nothing of the job is on the device (main's cap rose to the job's: the region left it).
    assert result["suspended"]["main_device"] == 0 and result["suspended"]["region_device"] == 0
    assert result["resumed"]["region_device"] == 64 * MIB
    assert result["x"] == 256 * MIB and result["kv"] == 3 * 64 * MIB  # the bytes survived both moves


def test_cap_changes_from_another_thread_during_training_keep_losses_identical():
    native = run_script("print(json.dumps(train('transformer', 40)))", use_cotenant=False)
    out = run_script("""
        import threading, time
        stop = threading.Event()
        def move_the_cap():
            held = None
            while not stop.is_set():
                s = cotenant.memory_stats()
                held = held or s["device_bytes"]
                cotenant.set_memory_cap(max(held // 3, 8 << 20))
                time.sleep(0.02)
                cotenant.set_memory_cap(None)
                cotenant.restore_all()
                time.sleep(0.02)
        mover = threading.Thread(target=move_the_cap)
        mover.start()
        try:
            losses = train('transformer', 40)
        finally:
            stop.set()
            mover.join()
        print(json.dumps({"losses": losses, "spilled": cotenant.memory_stats()["spilled_bytes"]}))
    """)
    assert out["losses"] == native


# ---- graphs and memory pools as PyTorch's own code drives them ------------------------------


def test_a_second_graph_capture_keeps_the_first_graph_replayable():
    # torch.cuda.graph() calls empty_cache() on entry: it must not release the
    # pages of a pool that graph A still replays.
    out = run_script("""
        x = torch.randn(1 << 20, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            (x * 2 + 1).sum()
        torch.cuda.current_stream().wait_stream(s)
        graph_a = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph_a):
            ya = x * 2 + 1
        torch.cuda.empty_cache()
        graph_b = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph_b):
            yb = x * 3 - 1
        junk = [torch.randn(1 << 20, device="cuda") for _ in range(8)]  # reuse anything released
        results = []
        for _ in range(3):
            x.copy_(torch.randn(1 << 20, device="cuda"))
            graph_a.replay()
            graph_b.replay()
            results.append([torch.equal(ya, x * 2 + 1), torch.equal(yb, x * 3 - 1)])
        torch.cuda.synchronize()
        print(json.dumps({"results": results}))
    """)
    assert out["results"] == [[True, True]] * 3


def test_make_graphed_callables_trains_like_eager():
    out = run_script("""
        def run(graphed):
            deterministic()
            model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).cuda()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x0 = torch.randn(32, 64, device="cuda")
            if graphed:
                model = torch.cuda.make_graphed_callables(model, (x0,))
            g = torch.Generator(device="cuda").manual_seed(3)
            losses = []
            for _ in range(10):
                x = torch.randn(32, 64, device="cuda", generator=g)
                y = torch.randint(0, 10, (32,), device="cuda", generator=g)
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            torch.cuda.empty_cache()
            return losses
        eager, graphed = run(False), run(True)
        print(json.dumps({"eager": eager, "graphed": graphed}))
    """)
    assert len(out["graphed"]) == 10
    assert out["graphed"] == pytest.approx(out["eager"], rel=1e-4)


def test_a_mem_pool_can_be_created_used_and_destroyed():
    out = run_script("""
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            x = torch.ones(4 << 20, device="cuda")
        total = x.sum().item()
        del x
        del pool
        import gc; gc.collect()
        torch.cuda.empty_cache()
        y = torch.ones(1 << 20, device="cuda")
        print(json.dumps({"total": total, "after": y.sum().item()}))
    """)
    assert out == {"total": float(4 << 20), "after": float(1 << 20)}


def test_a_mem_pool_with_its_own_allocator_computes_in_that_allocators_memory():
    # As NCCL's registered buffers and vLLM's sleep mode use it: the pool's
    # allocator (here cudaMalloc / cudaFree through ctypes) serves the pool's
    # tensors, kernels run on them, and each allocation goes back to it.
    out = run_script("""
        import ctypes, gc
        cudart = ctypes.CDLL("libcudart.so." + torch.version.cuda.split(".")[0])
        calls = {"alloc": [], "free": []}
        def my_alloc(size, device, stream):
            ptr = ctypes.c_void_p()
            assert cudart.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(size)) == 0
            calls["alloc"].append((ptr.value, size))
            return ptr.value
        def my_free(ptr, size, device, stream):
            calls["free"].append((ptr, size))
            assert cudart.cudaFree(ctypes.c_void_p(ptr)) == 0
        alloc_fn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(my_alloc)
        free_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(my_free)
        allocator = torch._C._cuda_customAllocator(ctypes.cast(alloc_fn, ctypes.c_void_p).value,
                                                   ctypes.cast(free_fn, ctypes.c_void_p).value)
        pool = torch.cuda.MemPool(allocator)
        with torch.cuda.use_mem_pool(pool):
            x = torch.ones(4 << 20, device="cuda")
            y = x * 3
        in_pool = all(any(p <= t.data_ptr() < p + n for p, n in calls["alloc"]) for t in (x, y))
        total = y.sum().item()
        del x, y, pool
        gc.collect()
        torch.cuda.empty_cache()
        print(json.dumps({"in_pool": in_pool, "total": total, "calls": len(calls["alloc"]),
                          "all_freed": sorted(calls["free"]) == sorted(calls["alloc"]),
                          "allocated_after": torch.cuda.memory_allocated()}))
    """)
    assert out == {"in_pool": True, "total": float(3 * (4 << 20)), "calls": 2, "all_freed": True,
                   "allocated_after": 0}


@pytest.mark.parametrize("kind", ["cnn"])
def test_training_under_a_cap_in_pinned_fallback_mode_keeps_losses_identical(kind):
    native = run_script(f"print(json.dumps(train('{kind}', 20)))", use_cotenant=False)
    out = run_script(f"""
        modes, within = [], []
        def on_step(step):
            s = cotenant.memory_stats()
            modes.append(s["mode"])
            if step == 5:
                cotenant.set_memory_cap(max(s["device_bytes"] // 2, 4 << 20))
            if step == 14:
                cotenant.set_memory_cap(None)
            cap = cotenant.memory_stats()["memory_cap"]
            within.append(cap is None or cotenant.memory_stats()["device_bytes"] <= cap)
        losses = train('{kind}', 20, on_step)
        print(json.dumps({{"losses": losses, "modes": sorted(set(modes)), "within": within}}))
    """, env_extra={"COTENANT_HOST_PAGES": "pinned"})
    assert out["modes"] == ["pinned_fallback"]
    assert out["losses"] == native


def test_a_kernel_on_one_gpu_reads_and_writes_another_gpus_pages():
    import torch

    if torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("needs two GPUs with peer access")
    out = run_script("""
        a = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
        b = torch.empty(1 << 20, dtype=torch.float32, device="cuda:1")
        b.copy_(a)                      # a peer copy: a kernel on one device touches the other's pages
        c = a.to("cuda:1") + b
        back = c.to("cuda:0")
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        print(json.dumps({"equal": torch.equal(back, a * 2)}))
    """)
    assert out["equal"]


def test_tensors_alive_at_interpreter_exit_are_freed_without_terminating():
    # A tensor's deleter runs in destructors, at interpreter exit too: a free
    # that fails there must be reported, not call std::terminate.
    script = textwrap.dedent("""
        import torch, cotenant
        cotenant.enable()
        cotenant.set_memory_cap("64MiB")
        keep = [torch.randn(1024, 1024, device="cuda") for _ in range(24)]  # 96 MiB: some on the host
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            keep[0].add_(1)
        keep[0].record_stream(side)
        print("ok", flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COTENANT_")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert "terminate called" not in result.stderr
