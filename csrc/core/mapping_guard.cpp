#include "cotenant/shm/mapping_guard.h"

#include <setjmp.h>
#include <signal.h>

#include <atomic>

namespace cotenant::shm {
namespace {

// The calling thread's guard, read by the handler. Initial-exec TLS: reading
// it in a signal handler never allocates.
struct Guard {
  sigjmp_buf* jump = nullptr;
  const char* begin = nullptr;
  const char* end = nullptr;
  bool chained = false;  // a SIGBUS outside the guard went to the previous handler once
};
__attribute__((tls_model("initial-exec"))) thread_local Guard t_guard;

struct sigaction g_previous {};  // the handler ours replaced, for every other SIGBUS

void on_sigbus(int signal, siginfo_t* info, void* context) {
  Guard& guard = t_guard;
  const char* address = static_cast<const char*>(info->si_addr);
  if (guard.jump != nullptr && info->si_code > 0 && address >= guard.begin && address < guard.end) {
    sigjmp_buf* jump = guard.jump;
    guard.jump = nullptr;
    siglongjmp(*jump, 1);
  }
  // Not ours: what would have happened without this handler. The previous
  // handler runs once; a fault it returns to comes back here and takes the
  // default action (a previous handler that chains back to this one cannot loop).
  if (!guard.chained) {
    guard.chained = true;
    if ((g_previous.sa_flags & SA_SIGINFO) && g_previous.sa_sigaction != nullptr) {
      g_previous.sa_sigaction(signal, info, context);
      return;
    }
    if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN && g_previous.sa_handler != nullptr) {
      g_previous.sa_handler(signal);
      return;
    }
  }
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  ::sigaction(SIGBUS, &fallback, nullptr);
  if (info->si_code <= 0) ::raise(SIGBUS);  // sent, not a fault: a fault repeats when the handler returns
}

// Puts on_sigbus in place unless it already is (someone may have replaced it
// since, e.g. faulthandler.enable()); keeps the one it replaces.
void ensure_handler() {
  struct sigaction current {};
  ::sigaction(SIGBUS, nullptr, &current);
  if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus) return;
  struct sigaction ours {};
  ours.sa_sigaction = on_sigbus;
  ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&ours.sa_mask);
  ::sigaction(SIGBUS, &ours, &g_previous);
}

}  // namespace

bool access_guarded(const void* base, std::size_t bytes, void (*access)(void*), void* context) {
  ensure_handler();
  Guard& guard = t_guard;
  sigjmp_buf jump;
  // The jump restores the thread's signal mask (savemask 1): the kernel, or a
  // runtime that wraps the handler (ThreadSanitizer's does), blocks SIGBUS
  // while it runs, and a SIGBUS raised while blocked kills the process, so a
  // second shrunk block would otherwise end it. One sigprocmask per access.
  if (sigsetjmp(jump, 1) != 0) {
    return false;  // the handler cleared guard.jump
  }
  guard.begin = static_cast<const char*>(base);
  guard.end = guard.begin + bytes;
  guard.jump = &jump;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  access(context);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  guard.jump = nullptr;
  return true;
}

}  // namespace cotenant::shm
