// The one interception point at ATen op entry, on every thread.
//
// A single global at::RecordFunction callback (scope FUNCTION, no inputs
// unless a hook asks for them, so its cost is one callback per op) observes every ATen operator a process
// runs: from Python, from C++ and from autograd's backward threads. Features
// that must act before an op launches work register here instead of adding
// their own RecordFunction callbacks:
//   - the allocator's safe point (move pages when a cap change needs it);
//   - the launch gate (admission of an opportunistic job's ops);
// and features that act when an op's work is enqueued register exit hooks
// on the same callback (the gate's markers, the guaranteed job's tracker).
//
// Only the outermost op of a thread runs the hooks: ops that an op calls
// internally (e.g. aten::add inside aten::linear) pass straight through, so a
// hook runs once per user-visible op and never while its own thread is in the
// middle of launching one.
//
// What it cannot see: kernels launched outside ATen (hand-launched Triton or
// CUDA kernels, cuBLAS called directly) unless they are wrapped in
// begin_explicit_op()/end_explicit_op(), as CUDA graph replays are.
//
// Launch pause: pause_launches() stops every thread at its next outermost op
// entry and waits until no thread is inside an outermost op, so the caller
// can synchronize the device and remap memory with no kernel being launched.
// Threads entering ops wait until the pause ends.
//
// In a child forked after cotenant used CUDA in the process (a DataLoader's
// worker; note_cuda_in_use()), or while a pause was in effect, none of this
// runs: the child may not use CUDA, has none of the parent's threads (one
// of them may hold a pause the child copied, with nobody left to end it),
// and its ops run no hooks and never wait; pause_launches() there returns
// false and resume_launches() does nothing. A child forked before that (the
// job enabled cotenant, then forked workers that use the GPU) intercepts
// as any process does, counting only its own ops.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace at {
struct RecordFunction;
}

namespace cotenant::torch_ext {

// What a hook learns about the op being entered.
struct OpEntry {
  const char* name;  // e.g. "aten::mm"; valid only during the hook call
  // The ATen op's record, its inputs boxed when a registered hook asked for
  // them (OpInputs::kNeeded); null for an explicit op.
  const at::RecordFunction* record = nullptr;
};

// True when the op may put work on a CUDA device, false only for an ATen op
// (named aten::) whose boxed inputs name no CUDA tensor (alone, in a list or
// a tuple) and no CUDA device: model set-up and data preparation on the CPU.
// An explicit op, an op seen without its inputs, an op with none (a record
// named by a string may carry none) and an op of another namespace may: the
// answer errs towards the device. A factory op's device is among its inputs
// (torch.zeros(3, device="cuda") names it; torch.set_default_device passes it
// explicitly); a custom op's need not be (one may upload to, or launch on,
// the current device from host inputs, as symm_mem::_barrier does). A
// tensor subclass with __torch_dispatch__ counts as naming the GPU: its
// device is not asked (that runs Python, which may raise). Never throws.
bool may_use_cuda(const OpEntry& op);

// Lets the GIL go for a blocking wait at op entry, where this thread holds
// it. Some ops begin with the GIL held (tensor indexing and assignment, C++
// launchers such as torch.compile's): waiting with the GIL would stop every
// Python thread of the job, the one that ends the wait among them. Construct
// it before taking the lock the wait is on, so the GIL is taken back after
// that lock is released, never while holding it (a thread holding the GIL
// may take that lock). Does nothing on a thread without the GIL.
class GilReleasedForWait {
 public:
  GilReleasedForWait();
  ~GilReleasedForWait();
  GilReleasedForWait(const GilReleasedForWait&) = delete;
  GilReleasedForWait& operator=(const GilReleasedForWait&) = delete;

 private:
  void* state_;  // the PyThreadState the GIL is taken back with, or null
};

// Called at every outermost op entry, on the thread running the op, before
// the op runs. `context` is the pointer given at registration. A hook must be
// cheap on its fast path (a few atomic loads) and must not throw. It may
// block (the gate does) but then must not hold locks a running op needs.
using OpEntryHook = void (*)(const OpEntry& op, void* context);

// Registers `hook` (hooks run in registration order) and installs the
// RecordFunction callback on first use. Returns an id for
// remove_op_entry_hook(). At most kMaxOpEntryHooks hooks at once; throws
// std::runtime_error beyond that. Thread-safe.
//
// A hook registered with OpInputs::kNeeded sees each op's inputs (for
// may_use_cuda): while one is registered, the dispatcher boxes every op's
// arguments for the callback, nested ops' too (on the stack, but a list
// argument such as a shape is copied into a heap list), a cost the process
// pays per op, so only the opportunistic gate asks for it.
inline constexpr std::size_t kMaxOpEntryHooks = 8;
enum class OpInputs { kNotNeeded, kNeeded };
int add_op_entry_hook(OpEntryHook hook, void* context, OpInputs inputs = OpInputs::kNotNeeded);
// Unregisters; a hook already running on another thread finishes its call.
void remove_op_entry_hook(int id);

// Work launched outside ATen (a CUDA graph replay) as one op: it runs the
// entry hooks, waits while launches are paused, and a pause waits for it to
// finish launching. Each begin_explicit_op() needs one end_explicit_op() on
// the same thread.
void begin_explicit_op(const char* name);
void end_explicit_op();

// Called when a thread's outermost op ends, ATen's or an explicit one (its
// work is then enqueued), on that thread, before the op stops counting as in
// flight. Through the same RecordFunction callback as the entry hooks: a
// second callback would cost every op, nested ones too, a second call (the
// guaranteed job's tracker used to add one). At most kMaxOpExitHooks at
// once; throws std::runtime_error beyond that. A hook must be cheap and must
// not throw. Thread-safe.
inline constexpr std::size_t kMaxOpExitHooks = 4;
using OpExitHook = void (*)(void* context);
int add_op_exit_hook(OpExitHook hook, void* context);
// Unregisters; a hook already running on another thread finishes its call.
void remove_op_exit_hook(int id);

// Number of outermost ops currently running in this process (all threads).
std::int64_t ops_in_flight();

// Called when cotenant first uses CUDA in the process (an allocator's
// device, the launch gate's activation): a child forked from then on
// cannot, and intercepts nothing (see the file comment).
void note_cuda_in_use();
// True in such a child: the launch gate is off there too.
bool in_forked_child();

// True on a thread that is inside an op (a hook or a kernel launch path).
bool inside_op_on_this_thread();

// Stops launches process-wide (see the file comment). Returns true when the
// pause is in effect: no other thread is inside an op, and every thread
// entering one waits until resume_launches(). Returns false (and changes
// nothing) when other threads' ops did not finish within `drain_timeout`,
// e.g. because one of them waits for something the caller holds; the caller
// retries at a later safe point. A pause taken from inside an op (a hook)
// does not count that op. Pauses nest: each successful call needs one
// resume_launches().
bool pause_launches(std::chrono::microseconds drain_timeout);
void resume_launches();

// RAII form: `if (LaunchPause pause{timeout}; pause) { ...remap... }`.
class LaunchPause {
 public:
  explicit LaunchPause(std::chrono::microseconds drain_timeout)
      : held_(pause_launches(drain_timeout)) {}
  ~LaunchPause() {
    if (held_) resume_launches();
  }
  LaunchPause(const LaunchPause&) = delete;
  LaunchPause& operator=(const LaunchPause&) = delete;
  explicit operator bool() const { return held_; }

 private:
  bool held_;
};

}  // namespace cotenant::torch_ext
