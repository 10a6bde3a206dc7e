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

#include <sys/types.h>

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
  // Segment name; empty: GpuPeerSegment::default_name(gpu_uuid, device, getuid(), group).
  // The GPU's UUID names the segment and tells it from another GPU's.
  std::string segment_name;
  std::size_t max_in_flight = 2;
  Nanoseconds share_window_ns = 50'000'000;
  // The GPU's UUID, recorded in a segment this process creates.
  std::string gpu_uuid;
  // The group whose members' jobs share the GPU's segment (COTENANT_GATE_GROUP);
  // none: this uid's own segment.
  std::optional<gid_t> group;
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
// The process's two shares (launch_gate.h): the job's own (cotenant.gate.
// set_share) and the coordinator's (the job channel). Kept and applied at
// activation when set before it. The gate admits at min(own, coordinator's).
// Thread-safe, no GIL needed.
void set_process_share(double share);
double process_share();
void set_process_coordinator_share(double share);
double process_effective_share();

// Explicit admission of work the op hook cannot see. Nest per thread: only
// the outermost enter admits. ATen ops inside pass without admission (they
// are part of the admitted work). No-ops unless opportunistic.
void gate_enter();
void gate_exit();

// Iteration boundaries (optimizer.step()) and begin marks (`with
// cotenant.iteration():`), for every role: they feed the process's one
// IterationTracker (which the job channel reports to the coordinator), and
// for a guaranteed job also mark its busy tracker.
void iteration_boundary();
void iteration_begin();
IterationStats process_iterations();

}  // namespace cotenant::torch_ext
