// The launch gate in a real PyTorch process: cotenant::LaunchGate (the logic,
// csrc/core) wired to CUDA events, the per-GPU peer segment and the op-entry
// interception point.
//
// Opportunistic role:
//   - every outermost ATen op, on every thread, is admitted at op entry
//     (op_interceptor.h) and its completion marker (a CUDA event on the
//     current stream) is recorded when the op returns;
//   - the gate reads the guaranteed job's busy flag and this job's share
//     from the per-GPU segment ("/cotenant-gpu<index>-<uid>");
//   - gate_enter()/gate_exit() admit hand-launched work (Triton kernels, raw
//     CUDA launches, CUDA graph replays) as one op.
// Guaranteed role:
//   - at op entry a BusyTracker notes the launch (a CUDA event at most every
//     50 us); iteration_boundary()/iteration_begin() time iterations; both
//     publish to the segment.
// Either role: a background pulse thread beats the heartbeat, refreshes the
// busy state (guaranteed, every 100 us) or the share accounting
// (opportunistic), and reclaims slots of crashed peers.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "cotenant/launch_gate.h"

namespace cotenant::torch_ext {

enum class GateRole : std::uint8_t { kNone, kGuaranteed, kOpportunistic };
GateRole parse_gate_role(const std::string& role);  // "", "guaranteed", "opportunistic"

struct GateActivation {
  GateRole role = GateRole::kNone;
  int device = 0;
  // Segment name; empty: GpuPeerSegment::default_name(device, getuid()).
  std::string segment_name;
  std::size_t max_in_flight = 2;
  Nanoseconds share_window_ns = 50'000'000;
  // The share of a newly registered opportunistic job when no coordinator
  // sets one.
  double default_share = 1.0;
};

// Activates the gate for this process (once; a second call with the same
// role and device does nothing, another role throws cotenant::Error).
void activate_gate(const GateActivation& activation);
// Stops the pulse thread, removes the hooks and gives the segment slot back.
void deactivate_gate();
GateRole active_gate_role();

// The process's gate, for C++ callers (the job channel's set_share). Null
// until an opportunistic activation.
LaunchGate* process_launch_gate();
// The share the process's gate applies; kept and applied at activation when
// called before it. Thread-safe, no GIL needed.
void set_process_share(double share);
double process_share();

// Explicit admission of work the op hook cannot see. Nest per thread: only
// the outermost enter admits. ATen ops inside pass without admission (they
// are part of the admitted work). No-ops unless opportunistic.
void gate_enter();
void gate_exit();

// Guaranteed side: iteration boundaries (optimizer.step()) and begin marks
// (`with cotenant.iteration():`). No-ops unless guaranteed.
void iteration_boundary();
void iteration_begin();

}  // namespace cotenant::torch_ext
