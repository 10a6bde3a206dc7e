#include <Python.h>  // first, as Python asks

#include <pthread.h>

#include "op_interceptor.h"

#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace cotenant::torch_ext {
namespace {

template <typename Hook>
struct HookSlot {
  std::atomic<Hook> hook{nullptr};
  std::atomic<void*> context{nullptr};
};

// Registered hooks, at op entry and at op exit. A slot is live when its hook
// is non-null; slots are filled and cleared under registration_mutex, read
// lock-free at op entry and exit.
std::array<HookSlot<OpEntryHook>, kMaxOpEntryHooks> hook_slots;
std::array<bool, kMaxOpEntryHooks> slot_needs_inputs{};  // under registration_mutex
std::atomic<int> highest_slot_plus_one{0};
std::array<HookSlot<OpExitHook>, kMaxOpExitHooks> exit_hook_slots;
std::atomic<int> highest_exit_slot_plus_one{0};
std::mutex registration_mutex;

// Fills the first free slot with `hook` after prepare(slot) (which installs
// the callback the hook needs), and returns the slot. Under registration_mutex.
template <typename Hook, std::size_t N, typename Prepare>
int fill_free_slot(std::array<HookSlot<Hook>, N>& slots, std::atomic<int>& used_plus_one, Hook hook, void* context,
                   const char* kind, Prepare prepare) {
  for (std::size_t i = 0; i < N; ++i) {
    if (slots[i].hook.load(std::memory_order_relaxed) != nullptr) continue;
    prepare(i);
    slots[i].context.store(context, std::memory_order_release);
    slots[i].hook.store(hook, std::memory_order_release);
    if (static_cast<int>(i) + 1 > used_plus_one.load(std::memory_order_relaxed)) {
      used_plus_one.store(static_cast<int>(i) + 1, std::memory_order_release);
    }
    return static_cast<int>(i);
  }
  throw std::runtime_error("cotenant: more than " + std::to_string(N) + " " + kind + " hooks registered at once");
}
// The installed callback, and whether it takes the ops' inputs; under
// registration_mutex.
at::CallbackHandle callback_handle = at::INVALID_CALLBACK_HANDLE;
bool callback_takes_inputs = false;

// Outermost ops currently running, all threads.
std::atomic<std::int64_t> outermost_ops{0};

// The launch pause. pause_depth > 0 means entering threads wait, except the
// thread that holds the pause (it synchronizes and remaps, and may itself
// need to run ops while it holds it).
std::atomic<int> pause_depth{0};
std::atomic<std::thread::id> pause_owner{};
std::mutex pause_mutex;
std::condition_variable pause_released;  // entering threads wait on this
std::condition_variable ops_drained;     // the pausing thread waits on this

// Set once cotenant has used CUDA in this process (note_cuda_in_use()).
std::atomic<bool> cuda_in_use{false};
// Set in a child forked from this process after cotenant used CUDA in it,
// or while a pause was in effect (see the header): the child cannot use
// CUDA, and the pause is the parent's, copied.
std::atomic<bool> forked_child{false};
// This thread's op nesting depth: only the outermost op runs the hooks.
thread_local int op_depth = 0;
// Set while this thread runs hooks: a hook that runs an op (e.g. a
// synchronize through ATen) must not re-enter the hooks.
thread_local bool running_hooks = false;

// Around fork: pause_mutex is held, so the child's copy is not locked by a
// thread it does not have. In the child, where the parent had not used CUDA
// through cotenant and held no pause, interception goes on (a worker forked
// before the parent's first CUDA tensor may use the GPU, and a cap there
// must move pages at op entry); the ops counted in flight are the forking
// thread's own, the parent's other threads are not here.
void before_fork() { pause_mutex.lock(); }
void after_fork_in_parent() { pause_mutex.unlock(); }
void after_fork_in_child() {
  const bool paused = pause_depth.load(std::memory_order_relaxed) != 0;
  pause_mutex.unlock();
  if (cuda_in_use.load(std::memory_order_relaxed) || paused) {
    forked_child.store(true, std::memory_order_relaxed);
    return;
  }
  outermost_ops.store(op_depth > 0 && !running_hooks ? 1 : 0, std::memory_order_relaxed);
}
[[maybe_unused]] const int fork_noted = ::pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);

// Calls each live hook of `slots` with `args` and its context, on this
// thread, with running_hooks set: an op a hook runs is not an outermost op of
// its own. Reset however the hooks end: a hook that throws (RecordFunction
// catches and logs it) must not leave this thread's hooks off for good.
template <typename Hook, std::size_t N, typename... Args>
void call_hooks(const std::array<HookSlot<Hook>, N>& slots, const std::atomic<int>& used_plus_one, Args&&... args) {
  const int used = used_plus_one.load(std::memory_order_acquire);
  if (used == 0) return;
  struct Running {
    Running() { running_hooks = true; }
    ~Running() { running_hooks = false; }
  } running;
  for (int i = 0; i < used; ++i) {
    Hook hook = slots[i].hook.load(std::memory_order_acquire);
    if (hook != nullptr) hook(args..., slots[i].context.load(std::memory_order_acquire));
  }
}

void run_hooks(const char* name, const at::RecordFunction* record) {
  call_hooks(hook_slots, highest_slot_plus_one, OpEntry{name, record});
}

void wait_while_paused() {
  if (pause_depth.load(std::memory_order_acquire) == 0) return;
  if (pause_owner.load(std::memory_order_acquire) == std::this_thread::get_id()) return;
  GilReleasedForWait without_gil;  // before the lock: see its comment
  std::unique_lock<std::mutex> lock(pause_mutex);
  pause_released.wait(lock, [] { return pause_depth.load(std::memory_order_acquire) == 0; });
}

// Wakes a pausing thread to re-check the op count. Only while a pause is in
// effect (otherwise nobody waits); the lock orders the wake-up after the
// waiter's check, so it cannot be lost.
void notify_drain_waiter() {
  if (pause_depth.load(std::memory_order_seq_cst) == 0) return;
  std::lock_guard<std::mutex> lock(pause_mutex);
  ops_drained.notify_all();
}

// Entry and exit of any op, ATen's or an explicit one: only a thread's
// outermost op runs the hooks and counts as in flight.
void enter_op(const char* name, const at::RecordFunction* record) {
  if (op_depth++ > 0 || running_hooks) return;
  if (forked_child.load(std::memory_order_relaxed)) return;
  // A hook that throws: the op still counts as in flight (its exit uncounts
  // it) and waits out a pause; then the error goes on to the caller.
  std::exception_ptr hook_failed;
  try {
    run_hooks(name, record);
  } catch (...) {
    hook_failed = std::current_exception();
  }
  // Count the op before re-checking the pause, so a pausing thread either
  // sees this op in flight or this thread sees the pause (both are seq_cst).
  for (;;) {
    outermost_ops.fetch_add(1, std::memory_order_seq_cst);
    if (pause_depth.load(std::memory_order_seq_cst) == 0 ||
        pause_owner.load(std::memory_order_acquire) == std::this_thread::get_id()) {
      break;
    }
    outermost_ops.fetch_sub(1, std::memory_order_seq_cst);
    notify_drain_waiter();
    wait_while_paused();
  }
  if (hook_failed) std::rethrow_exception(hook_failed);
}

void exit_op() {
  if (op_depth == 0) return;  // the callback was installed while this op ran
  if (--op_depth > 0 || running_hooks) return;
  if (forked_child.load(std::memory_order_relaxed)) return;
  // Before the op stops counting: a pause that waits for it also waits for
  // what its exit hooks do (a marker recorded on its stream).
  try {
    call_hooks(exit_hook_slots, highest_exit_slot_plus_one);
  } catch (...) {
    // Exit hooks must not throw; one that does must not leave the op counted.
  }
  outermost_ops.fetch_sub(1, std::memory_order_seq_cst);
  notify_drain_waiter();
}

std::unique_ptr<at::ObserverContext> on_op_entry(const at::RecordFunction& fn) {
  enter_op(fn.name(), &fn);
  return nullptr;
}

void on_op_exit(const at::RecordFunction& /*fn*/, at::ObserverContext* /*ctx*/) { exit_op(); }

// Installs the callback, or replaces it by one that does or does not take
// the ops' inputs. The new one is added before the old one goes, so no op
// goes unseen: an op that starts in between is seen by both, the second as
// nested in the first, and leaves through both (a record keeps the callbacks
// it started with). Under registration_mutex.
void install_callback(bool takes_inputs) {
  if (callback_handle != at::INVALID_CALLBACK_HANDLE && callback_takes_inputs == takes_inputs) return;
  const at::CallbackHandle previous = callback_handle;
  callback_handle = at::addGlobalCallback(at::RecordFunctionCallback(&on_op_entry, &on_op_exit)
                                              .needsInputs(takes_inputs)
                                              .needsOutputs(false)
                                              .needsIds(false)
                                              .scopes({at::RecordScope::FUNCTION}));
  callback_takes_inputs = takes_inputs;
  if (previous != at::INVALID_CALLBACK_HANDLE) at::removeCallback(previous);
}

bool any_hook_needs_inputs() {
  for (std::size_t i = 0; i < kMaxOpEntryHooks; ++i) {
    if (slot_needs_inputs[i] && hook_slots[i].hook.load(std::memory_order_relaxed) != nullptr) return true;
  }
  return false;
}

constexpr char kAtenPrefix[] = "aten::";

bool names_cuda(const c10::IValue& value) {
  if (value.isTensor()) {
    const at::Tensor& tensor = value.toTensor();
    if (!tensor.defined()) return false;
    // A subclass with __torch_dispatch__ may answer its device in Python
    // (FakeTensor does): asking would take the GIL at each op entry, and
    // Python may raise there (a KeyboardInterrupt), failing the hook. Its
    // work may be on any device.
    if (tensor.key_set().has(c10::DispatchKey::Python)) return true;
    return tensor.is_cuda();
  }
  if (value.isDevice()) return value.toDevice().is_cuda();
  if (value.isList()) {
    for (const c10::IValue& element : value.toListRef()) {
      if (names_cuda(element)) return true;
    }
    return false;
  }
  if (value.isTuple()) {
    for (const c10::IValue& element : value.toTupleRef().elements()) {
      if (names_cuda(element)) return true;
    }
  }
  return false;
}

}  // namespace

GilReleasedForWait::GilReleasedForWait()
    : state_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}

GilReleasedForWait::~GilReleasedForWait() {
  if (state_ != nullptr) PyEval_RestoreThread(static_cast<PyThreadState*>(state_));
}

bool may_use_cuda(const OpEntry& op) {
  const at::RecordFunction* record = op.record;
  if (record == nullptr || !record->needsInputs()) return true;
  // Only ATen's ops keep the rule that an op's device is among its inputs. A
  // custom op (torch.library), symm_mem::_barrier (a kernel; its one input a
  // SymmetricMemory object) may launch on the current device naming none.
  if (op.name == nullptr || std::strncmp(op.name, kAtenPrefix, sizeof(kAtenPrefix) - 1) != 0) return true;
  const c10::ArrayRef<const c10::IValue> inputs = record->inputs();
  if (inputs.empty()) return true;
  for (const c10::IValue& input : inputs) {
    if (names_cuda(input)) return true;
  }
  return false;
}

int add_op_entry_hook(OpEntryHook hook, void* context, OpInputs inputs) {
  if (hook == nullptr) throw std::invalid_argument("add_op_entry_hook: hook must not be null");
  std::lock_guard<std::mutex> lock(registration_mutex);
  return fill_free_slot(hook_slots, highest_slot_plus_one, hook, context, "op-entry", [inputs](std::size_t i) {
    slot_needs_inputs[i] = inputs == OpInputs::kNeeded;
    // Inputs first: the hook may read them from its first op on.
    install_callback(slot_needs_inputs[i] || any_hook_needs_inputs());
  });
}

void remove_op_entry_hook(int id) {
  if (id < 0 || id >= static_cast<int>(kMaxOpEntryHooks)) return;
  std::lock_guard<std::mutex> lock(registration_mutex);
  hook_slots[id].hook.store(nullptr, std::memory_order_release);
  if (slot_needs_inputs[id]) {
    slot_needs_inputs[id] = false;
    install_callback(any_hook_needs_inputs());
  }
}

void begin_explicit_op(const char* name) { enter_op(name, nullptr); }

void end_explicit_op() { exit_op(); }

int add_op_exit_hook(OpExitHook hook, void* context) {
  if (hook == nullptr) throw std::invalid_argument("add_op_exit_hook: hook must not be null");
  std::lock_guard<std::mutex> lock(registration_mutex);
  // The one callback, as it is or first installed.
  return fill_free_slot(exit_hook_slots, highest_exit_slot_plus_one, hook, context, "op-exit",
                        [](std::size_t) { install_callback(any_hook_needs_inputs()); });
}

void remove_op_exit_hook(int id) {
  if (id < 0 || id >= static_cast<int>(kMaxOpExitHooks)) return;
  std::lock_guard<std::mutex> lock(registration_mutex);
  exit_hook_slots[id].hook.store(nullptr, std::memory_order_release);
}

std::int64_t ops_in_flight() { return outermost_ops.load(std::memory_order_acquire); }

void note_cuda_in_use() { cuda_in_use.store(true, std::memory_order_relaxed); }

bool in_forked_child() { return forked_child.load(std::memory_order_relaxed); }

bool inside_op_on_this_thread() { return op_depth > 0; }

bool pause_launches(std::chrono::microseconds drain_timeout) {
  if (forked_child.load(std::memory_order_relaxed)) return false;
  const auto me = std::this_thread::get_id();
  // A safe point pauses from op entry, where the GIL may be held: an op
  // running on another thread may need it to finish (one implemented in
  // Python, one that takes the GIL for a callback) and would otherwise run
  // the drain out to its timeout.
  GilReleasedForWait without_gil;  // before the lock: see its comment
  std::unique_lock<std::mutex> lock(pause_mutex);
  if (pause_depth.load(std::memory_order_acquire) > 0 && pause_owner.load() == me) {
    pause_depth.fetch_add(1);  // nested pause by the holder
    return true;
  }
  // Another thread holds a pause: wait for it to end (bounded), then take ours.
  if (!pause_released.wait_for(lock, drain_timeout,
                               [] { return pause_depth.load(std::memory_order_acquire) == 0; })) {
    return false;
  }
  pause_owner.store(me, std::memory_order_release);
  pause_depth.store(1, std::memory_order_seq_cst);
  // This thread's own outermost op (if it pauses from inside one) stays counted.
  const std::int64_t own = (op_depth > 0 && !running_hooks) ? 1 : 0;
  const bool drained = ops_drained.wait_for(lock, drain_timeout, [own] {
    return outermost_ops.load(std::memory_order_seq_cst) <= own;
  });
  if (!drained) {
    pause_depth.store(0, std::memory_order_seq_cst);
    pause_owner.store(std::thread::id{}, std::memory_order_release);
    pause_released.notify_all();
    return false;
  }
  return true;
}

void resume_launches() {
  if (forked_child.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(pause_mutex);
  if (pause_depth.load() == 0) return;
  if (pause_depth.fetch_sub(1) == 1) {
    pause_owner.store(std::thread::id{}, std::memory_order_release);
    pause_released.notify_all();
  }
}

}  // namespace cotenant::torch_ext
