#include <catch2/catch.hpp>

#include <pthread.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cotenant/caching_allocator.h"
#include "cotenant/errors.h"
#include "cotenant/job_channel.h"
#include "cotenant/job_process.h"
#include "cotenant/shm/job_block.h"
#include "cotenant/shm/shm_region.h"
#include "cotenant/simulated_backend.h"

using namespace cotenant;
using namespace std::chrono_literals;

namespace {

constexpr std::uint64_t MiB = 1u << 20;

// The coordinator's side of one job: creates and owns the block.
struct CoordinatorBlock {
  explicit CoordinatorBlock(const char* what, shm::JobRole role = shm::JobRole::kOpportunistic)
      : region(shm::ShmRegion::create("/cotenant-test-channel-" + std::string(what) + "-" +
                                          std::to_string(::getpid()),
                                      shm::kJobBlockBytes, /*unlink_on_destroy=*/true)) {
    shm::JobIdentity identity;
    identity.job_id = 7;
    identity.name = what;
    identity.role = role;
    identity.device = 1;
    identity.pid = static_cast<std::uint64_t>(::getpid());
    shm::initialize_job_block(block(), identity, shm::JobControl{});
  }
  shm::JobBlock& block() { return *static_cast<shm::JobBlock*>(region.data()); }
  void set(std::uint64_t cap, double share) {
    auto control = shm::read_control(block());
    control.memory_cap = cap;
    control.share = share;
    shm::write_control(block(), control);
  }
  // The coordinator's heartbeat as of `age` ago, with its silence limit.
  void beat(std::chrono::nanoseconds age, std::chrono::nanoseconds limit) {
    shm::CoordinatorHeartbeat heartbeat;
    heartbeat.heartbeat_ns = shm::monotonic_ns() - static_cast<std::uint64_t>(age.count());
    heartbeat.silence_limit_ns = static_cast<std::uint64_t>(limit.count());
    REQUIRE(shm::try_write_coordinator_heartbeat(block(), heartbeat));
  }
  void command(shm::JobCommand command) {
    auto control = shm::read_control(block());
    control.command = command;
    ++control.command_sequence;
    shm::write_control(block(), control);
  }
  shm::ShmRegion region;
};

template <typename Predicate>
bool eventually(Predicate predicate, std::chrono::milliseconds within = 1000ms) {
  auto deadline = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < deadline) {
    if (predicate()) return true;
    std::this_thread::sleep_for(1ms);
  }
  return predicate();
}

// A job on a 256 MiB simulated device, driven through the same JobProcess a
// real job's channel uses.
struct SimulatedJob {
  SimulatedJob() : backend(config()), allocator(backend), process(allocator) {}
  static SimulatedDeviceConfig config() {
    SimulatedDeviceConfig c;
    c.device_capacity = 256 * MiB;
    return c;
  }
  SimulatedBackend backend;
  CachingAllocator allocator;
  SimulatedJobProcess process;
};

}  // namespace

TEST_CASE("block_identity_control_and_report_round_trip", "[job_channel]") {
  CoordinatorBlock coordinator("roundtrip", shm::JobRole::kGuaranteed);
  auto identity = shm::read_identity(coordinator.block());
  CHECK(identity.job_id == 7);
  CHECK(identity.name == "roundtrip");
  CHECK(identity.role == shm::JobRole::kGuaranteed);
  CHECK(identity.device == 1);
  coordinator.set(300 * MiB, 0.25);
  auto control = shm::read_control(coordinator.block());
  CHECK(control.memory_cap == 300 * MiB);
  CHECK(control.share == 0.25);
  CHECK(shm::read_report(coordinator.block()).heartbeat_ns == 0);  // no job attached yet
}

TEST_CASE("block_of_another_version_is_refused_with_a_sentence", "[job_channel]") {
  CoordinatorBlock coordinator("version");
  coordinator.block().version.store(shm::kJobBlockVersion + 1);
  CHECK_THROWS_WITH(JobChannel(coordinator.region.name(), {}), Catch::Contains("same cotenant version"));
}

TEST_CASE("channel_applies_cap_and_share_once_per_change", "[job_channel]") {
  CoordinatorBlock coordinator("levels");
  std::vector<std::uint64_t> caps;
  std::vector<double> shares;
  JobChannelHooks hooks;
  hooks.set_memory_cap = [&](std::uint64_t bytes) { caps.push_back(bytes); };
  hooks.set_share = [&](double share) { shares.push_back(share); };
  JobChannel channel(coordinator.region.name(), hooks);
  CHECK_FALSE(channel.poll_once());  // defaults: nothing to apply
  coordinator.set(512 * MiB, 0.5);
  CHECK(channel.poll_once());
  CHECK_FALSE(channel.poll_once());
  CHECK(caps == std::vector<std::uint64_t>{512 * MiB});
  CHECK(shares == std::vector<double>{0.5});
  auto report = shm::read_report(coordinator.block());
  CHECK(report.applied_memory_cap == 512 * MiB);
  CHECK(report.applied_share == 0.5);
  CHECK(report.pid == static_cast<std::uint64_t>(::getpid()));
  CHECK(report.state == shm::JobState::kRunning);
}

TEST_CASE("share_outside_zero_to_one_is_clamped", "[job_channel]") {
  CoordinatorBlock coordinator("clamp");
  double last = -1;
  JobChannelHooks hooks;
  hooks.set_share = [&](double share) { last = share; };
  JobChannel channel(coordinator.region.name(), hooks);
  coordinator.set(kNoCap, 3.0);
  channel.poll_once();
  CHECK(last == -1);  // clamped to 1.0, which was already applied: nothing to run
  CHECK(shm::read_report(coordinator.block()).applied_share == 1.0);
  coordinator.set(kNoCap, -2.0);
  channel.poll_once();
  CHECK(last == 0.0);
}

TEST_CASE("each_command_runs_once_and_is_acknowledged_by_sequence", "[job_channel]") {
  CoordinatorBlock coordinator("commands");
  int spills = 0, restores = 0;
  std::vector<bool> suspended;
  JobChannelHooks hooks;
  hooks.spill_all = [&] { ++spills; };
  hooks.restore_all = [&] { ++restores; };
  hooks.set_suspended = [&](bool value) {
    suspended.push_back(value);
    return true;
  };
  JobChannel channel(coordinator.region.name(), hooks);
  coordinator.command(shm::JobCommand::kSpillAll);
  channel.poll_once();
  channel.poll_once();
  CHECK(spills == 1);
  coordinator.command(shm::JobCommand::kSuspend);
  channel.poll_once();
  CHECK(spills == 2);
  CHECK(shm::read_report(coordinator.block()).state == shm::JobState::kSuspended);
  coordinator.command(shm::JobCommand::kResume);
  channel.poll_once();
  CHECK(restores == 1);
  CHECK(suspended == std::vector<bool>{true, false});
  auto report = shm::read_report(coordinator.block());
  CHECK(report.applied_command_sequence == 3);
  CHECK(report.state == shm::JobState::kRunning);
}

TEST_CASE("a_throwing_hook_is_counted_and_not_retried", "[job_channel]") {
  CoordinatorBlock coordinator("errors");
  int calls = 0;
  JobChannelHooks hooks;
  hooks.set_memory_cap = [&](std::uint64_t) {
    ++calls;
    throw Error("refused");
  };
  JobChannel channel(coordinator.region.name(), hooks);
  coordinator.set(1, 1.0);
  channel.poll_once();
  channel.poll_once();
  CHECK(calls == 1);
  CHECK(shm::read_report(coordinator.block()).apply_errors == 1);
}

// A settle that throws at every poll (a safe point the driver keeps
// refusing) is counted each time, and the report keeps moving: the
// coordinator sees the job's bytes as they are, not as they were.
TEST_CASE("a_settle_that_throws_is_counted_and_the_report_still_moves", "[job_channel]") {
  CoordinatorBlock coordinator("settle");
  std::int64_t allocated = 1 * MiB;
  JobChannelHooks hooks;
  hooks.settle = [] { throw Error("refused"); };
  hooks.stats = [&] {
    AllocatorStats stats;
    stats.allocated_bytes.all.current = allocated;
    return stats;
  };
  JobChannel channel(coordinator.region.name(), hooks);
  channel.poll_once();
  allocated = 3 * MiB;
  channel.poll_once();
  const shm::JobReport report = shm::read_report(coordinator.block());
  CHECK(report.allocated_bytes == 3 * MiB);
  CHECK(report.apply_errors >= 2);
}

TEST_CASE("iteration_times_are_the_trackers_figures_in_nanoseconds", "[job_channel]") {
  CoordinatorBlock coordinator("iterations");
  SimulatedJob job;
  auto& process = job.process;
  JobChannel channel(coordinator.region.name(), job_channel_hooks(process));
  process.iteration_tracker().record(100'000);
  process.iteration_tracker().record(200'000);
  channel.poll_once();
  auto report = shm::read_report(coordinator.block());
  CHECK(report.iteration_count == 2);
  CHECK(report.iteration_last_ns == 200'000);
  CHECK(report.iteration_ewma_ns == process.iterations().ewma_ns);
  CHECK(report.iteration_p99_ns == 200'000);
  CHECK(report.iteration_total_ns == 300'000);
}

TEST_CASE("suspend_stops_launches_for_every_role_and_a_cap_change_brings_nothing_back", "[job_channel]") {
  CoordinatorBlock coordinator("suspend");
  SimulatedJob job;
  auto& [backend, allocator, process] = job;
  std::vector<DevicePtr> live;
  for (int i = 0; i < 4; ++i) live.push_back(allocator.allocate(16 * MiB, 0));
  JobChannel channel(coordinator.region.name(), job_channel_hooks(process));

  coordinator.command(shm::JobCommand::kSuspend);
  channel.poll_once();
  CHECK(process.launches_paused());
  auto report = shm::read_report(coordinator.block());
  CHECK(report.state == shm::JobState::kSuspended);
  CHECK(report.device_bytes == 0);
  CHECK(report.host_bytes >= 64 * MiB);
  CHECK(report.effective_share == 0.0);

  // A new cap while suspended is recorded, and moves nothing back.
  coordinator.set(128 * MiB, 1.0);
  channel.poll_once();
  report = shm::read_report(coordinator.block());
  CHECK(report.applied_memory_cap == 128 * MiB);
  CHECK(report.device_bytes == 0);
  CHECK(allocator.memory_cap() == 128 * MiB);
  CHECK(allocator.stats().memory_cap == 128 * MiB);  // one value for the cap, spilled or not
  CHECK(allocator.spilled_all());

  coordinator.command(shm::JobCommand::kResume);
  channel.poll_once();
  CHECK_FALSE(process.launches_paused());
  report = shm::read_report(coordinator.block());
  CHECK(report.state == shm::JobState::kRunning);
  CHECK(report.device_bytes >= 64 * MiB);
  CHECK(report.host_bytes == 0);
  for (auto address : live) allocator.free(address);
}

TEST_CASE("a_suspended_job_runs_on_its_own_while_its_coordinator_is_silent_and_suspends_again_when_it_returns",
          "[job_channel]") {
  CoordinatorBlock coordinator("silent-suspended");
  SimulatedJob job;
  auto& [backend, allocator, process] = job;
  std::vector<DevicePtr> live;
  for (int i = 0; i < 4; ++i) live.push_back(allocator.allocate(16 * MiB, 0));
  JobChannel channel(coordinator.region.name(), job_channel_hooks(process));
  coordinator.set(96 * MiB, 1.0);
  coordinator.command(shm::JobCommand::kSuspend);
  channel.poll_once();
  REQUIRE(process.launches_paused());
  REQUIRE(shm::read_report(coordinator.block()).device_bytes == 0);

  // Silent for 5 s against a limit of 1 s: the coordinator is taken for gone.
  coordinator.beat(5s, 1s);
  channel.poll_once();
  CHECK(channel.coordinator_lost());
  CHECK_FALSE(process.launches_paused());
  auto report = shm::read_report(coordinator.block());
  CHECK(report.state == shm::JobState::kRunning);
  CHECK(report.device_bytes >= 64 * MiB);  // its pages came back, within the cap it keeps
  CHECK(report.host_bytes == 0);
  CHECK(report.effective_share == 1.0);
  CHECK(allocator.memory_cap() == 96 * MiB);
  channel.poll_once();  // once: it stays on its own without doing it again
  CHECK(channel.coordinator_lost());
  CHECK(shm::read_report(coordinator.block()).num_migrations == report.num_migrations);

  // The heartbeat moves again: the suspension the coordinator never lifted holds again.
  coordinator.beat(0s, 1s);
  channel.poll_once();
  CHECK_FALSE(channel.coordinator_lost());
  CHECK(process.launches_paused());
  report = shm::read_report(coordinator.block());
  CHECK(report.state == shm::JobState::kSuspended);
  CHECK(report.device_bytes == 0);
  CHECK(report.effective_share == 0.0);

  coordinator.command(shm::JobCommand::kResume);
  channel.poll_once();
  CHECK_FALSE(process.launches_paused());
  CHECK(shm::read_report(coordinator.block()).device_bytes >= 64 * MiB);
  for (auto address : live) allocator.free(address);
}

TEST_CASE("a_job_the_coordinator_paused_runs_at_full_share_while_it_is_silent_and_takes_its_share_back",
          "[job_channel]") {
  CoordinatorBlock coordinator("silent-paused");
  SimulatedJob job;
  auto& process = job.process;
  JobChannel channel(coordinator.region.name(), job_channel_hooks(process));
  coordinator.set(kNoCap, 0.0);
  channel.poll_once();
  REQUIRE(shm::read_report(coordinator.block()).effective_share == 0.0);

  coordinator.beat(3s, 2s);
  channel.poll_once();
  CHECK(channel.coordinator_lost());
  CHECK(shm::read_report(coordinator.block()).effective_share == 1.0);
  // While it is silent, what its control section holds is not the coordinator's word: nothing is applied.
  coordinator.set(kNoCap, 0.5);
  channel.poll_once();
  CHECK(shm::read_report(coordinator.block()).effective_share == 1.0);

  coordinator.beat(0s, 2s);
  channel.poll_once();
  CHECK_FALSE(channel.coordinator_lost());
  auto report = shm::read_report(coordinator.block());
  CHECK(report.applied_share == 0.5);
  CHECK(report.effective_share == 0.5);
  // The same share as before the silence is applied again too (the job ran at 1 meanwhile).
  coordinator.set(kNoCap, 0.0);
  channel.poll_once();
  coordinator.beat(3s, 2s);
  channel.poll_once();
  REQUIRE(shm::read_report(coordinator.block()).effective_share == 1.0);
  coordinator.beat(0s, 2s);
  channel.poll_once();
  CHECK(shm::read_report(coordinator.block()).effective_share == 0.0);
}

TEST_CASE("a_silence_limit_of_zero_keeps_the_job_waiting_for_its_coordinator", "[job_channel]") {
  CoordinatorBlock coordinator("silent-forever");
  SimulatedJob job;
  auto& process = job.process;
  JobChannel channel(coordinator.region.name(), job_channel_hooks(process));
  coordinator.command(shm::JobCommand::kSuspend);
  coordinator.beat(3600s, 0s);
  channel.poll_once();
  channel.poll_once();
  CHECK_FALSE(channel.coordinator_lost());
  CHECK(process.launches_paused());
  // A fresh block carries the default limit and a heartbeat of its creation.
  CoordinatorBlock fresh("silent-default");
  const auto beat = shm::read_coordinator_heartbeat(fresh.block());
  CHECK(beat.silence_limit_ns == shm::kDefaultCoordinatorSilenceLimitNs);
  CHECK(beat.heartbeat_ns <= shm::monotonic_ns());
  CHECK(shm::monotonic_ns() - beat.heartbeat_ns < 10'000'000'000ull);
}

TEST_CASE("a_launch_stop_that_did_not_take_is_retried_at_the_next_poll", "[job_channel]") {
  CoordinatorBlock coordinator("suspend-retry");
  SimulatedJob job;
  auto& process = job.process;
  JobChannel channel(coordinator.region.name(), job_channel_hooks(process));
  process.set_pause_fails(true);  // work in flight does not drain
  coordinator.command(shm::JobCommand::kSuspend);
  channel.poll_once();
  CHECK_FALSE(process.launches_paused());
  process.set_pause_fails(false);
  channel.poll_once();
  CHECK(process.launches_paused());
  channel.poll_once();
  process.resume_launches();
  CHECK_FALSE(process.launches_paused());  // paused once, not once per poll
}

TEST_CASE("the_coordinator_share_reaches_the_job_as_a_cap_on_its_own_share", "[job_channel]") {
  CoordinatorBlock coordinator("share");
  SimulatedJob job;
  auto& process = job.process;
  JobChannel channel(coordinator.region.name(), job_channel_hooks(process));
  process.set_user_share(0.6);
  coordinator.set(kNoCap, 0.25);
  channel.poll_once();
  auto report = shm::read_report(coordinator.block());
  CHECK(report.applied_share == 0.25);
  CHECK(report.effective_share == 0.25);
  coordinator.set(kNoCap, 1.0);
  channel.poll_once();
  CHECK(shm::read_report(coordinator.block()).effective_share == Approx(0.6));  // the job's own holds
}

TEST_CASE("a_job_that_leaves_its_report_mid_update_does_not_hold_the_coordinator_up", "[job_channel]") {
  CoordinatorBlock coordinator("tampered");
  JobChannel channel(coordinator.region.name(), {});
  channel.poll_once();
  coordinator.block().report.sequence.fetch_add(1);  // odd forever: a hostile or killed job
  // 40 reads of the stuck block, as a coordinator with 40 such jobs would do:
  // with the job channel's 250 ms patience they would take 10 s; with
  // kCoordinatorPatience (2 ms) well under that, even on a loaded machine.
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 40; ++i) CHECK_FALSE(shm::try_read_report(coordinator.block()).has_value());
  CHECK(std::chrono::steady_clock::now() - start < 40 * shm::kCoordinatorPatience + 5s);
  // The coordinator's writes of the control section never wait on the job.
  coordinator.block().control.sequence.fetch_add(1);
  shm::JobControl control;
  control.memory_cap = 8 * MiB;
  shm::write_control(coordinator.block(), control);
  CHECK(shm::read_control(coordinator.block()).memory_cap == 8 * MiB);
}

TEST_CASE("a_coordinator_resuming_a_control_section_left_mid_update_sends_commands_the_job_has_not_applied",
          "[job_channel]") {
  CoordinatorBlock coordinator("resume");
  JobChannel channel(coordinator.region.name(), {});
  coordinator.command(shm::JobCommand::kRestoreAll);
  CHECK(channel.poll_once());
  coordinator.command(shm::JobCommand::kRestoreAll);
  CHECK(channel.poll_once());
  REQUIRE(channel.report().applied_command_sequence == 2);
  coordinator.block().control.sequence.fetch_add(1);  // the coordinator was killed inside a write
  auto control = shm::control_to_resume(coordinator.block());
  CHECK(control.command_sequence == 2);  // not the defaults' 0
  control.command = shm::JobCommand::kRestoreAll;
  ++control.command_sequence;
  shm::write_control(coordinator.block(), control);
  CHECK(channel.poll_once());
  CHECK(channel.report().applied_command_sequence == 3);
}

TEST_CASE("a_block_its_job_shrank_fails_the_coordinators_accesses_instead_of_raising_sigbus", "[job_channel]") {
  CoordinatorBlock coordinator("shrunk");
  REQUIRE(shm::try_read_report(coordinator.block()).has_value());
  // The job may write its block, so it may also truncate it: every page of
  // the coordinator's mapping is then gone (touching one raises SIGBUS).
  REQUIRE(::truncate(("/dev/shm" + coordinator.region.name()).c_str(), 0) == 0);
  CHECK_FALSE(shm::try_read_report(coordinator.block()).has_value());
  shm::JobBlock copy;
  CHECK_FALSE(shm::try_copy_job_block(coordinator.block(), copy));
  CHECK_FALSE(shm::try_write_control(coordinator.block(), shm::JobControl{}));
  // Whole again (zeroed pages), the block is read and written as before.
  REQUIRE(::truncate(("/dev/shm" + coordinator.region.name()).c_str(), shm::kJobBlockBytes) == 0);
  CHECK(shm::try_write_control(coordinator.block(), shm::JobControl{}));
  CHECK(shm::try_copy_job_block(coordinator.block(), copy));
}

TEST_CASE("a_job_that_keeps_its_report_sequence_moving_but_never_even_does_not_hold_the_coordinator_up",
          "[job_channel]") {
  // A hostile job needs no stopped writer to look alive: it keeps its report's
  // sequence odd and moving. The coordinator's read must still give up within
  // its patience, not for as long as the job keeps spinning. Reader and
  // spinner share one CPU, so the reader sees the sequence move at every try
  // whatever else the machine runs.
  cpu_set_t allowed;
  REQUIRE(::sched_getaffinity(0, sizeof allowed, &allowed) == 0);
  int cpu = 0;
  while (!CPU_ISSET(cpu, &allowed)) ++cpu;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  REQUIRE(::pthread_setaffinity_np(::pthread_self(), sizeof one, &one) == 0);
  CoordinatorBlock coordinator("spinning");
  std::atomic<bool> stop{false};
  coordinator.block().report.sequence.fetch_add(1);  // odd
  std::thread spinner([&] {
    ::pthread_setaffinity_np(::pthread_self(), sizeof one, &one);
    const auto until = std::chrono::steady_clock::now() + 5s;  // never longer than this, even unfixed
    while (!stop.load(std::memory_order_relaxed) && std::chrono::steady_clock::now() < until) {
      for (int i = 0; i < 1000; ++i) coordinator.block().report.sequence.fetch_add(2);  // stays odd
    }
  });
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 20; ++i) CHECK_FALSE(shm::try_read_report(coordinator.block()).has_value());
  const auto took = std::chrono::steady_clock::now() - start;
  stop = true;
  spinner.join();
  ::pthread_setaffinity_np(::pthread_self(), sizeof allowed, &allowed);
  // 20 reads of 2 ms each, with room for a loaded machine; the spinner runs 5 s.
  CHECK(took < 20 * shm::kCoordinatorPatience + 1s);
}

TEST_CASE("polling_thread_applies_a_cap_within_milliseconds_and_heartbeats", "[job_channel]") {
  CoordinatorBlock coordinator("thread");
  std::atomic<std::uint64_t> cap{0};
  JobChannelHooks hooks;
  hooks.set_memory_cap = [&](std::uint64_t bytes) { cap = bytes; };
  JobChannel channel(coordinator.region.name(), hooks);
  channel.start();
  auto first_beat = shm::read_heartbeat_ns(coordinator.block());
  coordinator.set(64 * MiB, 1.0);
  CHECK(eventually([&] { return cap.load() == 64 * MiB; }, 500ms));
  CHECK(eventually([&] { return shm::read_heartbeat_ns(coordinator.block()) > first_beat; }, 500ms));
  channel.stop();
  CHECK_FALSE(channel.running());
}

TEST_CASE("destroyed_channel_reports_the_job_exited", "[job_channel]") {
  CoordinatorBlock coordinator("exit");
  {
    JobChannel channel(coordinator.region.name(), {});
    channel.start();
  }
  CHECK(shm::read_report(coordinator.block()).state == shm::JobState::kExited);
}

TEST_CASE("shrinking_cap_spills_a_simulated_allocator_and_reports_its_bytes", "[job_channel]") {
  CoordinatorBlock coordinator("allocator");
  SimulatedJob job;
  auto& [backend, allocator, process] = job;
  std::vector<DevicePtr> live;
  for (int i = 0; i < 8; ++i) live.push_back(allocator.allocate(16 * MiB, 0));
  const char pattern[] = "survives the spill";
  backend.write(live[0], pattern, sizeof pattern);

  JobChannel channel(coordinator.region.name(), job_channel_hooks(process));
  channel.poll_once();
  auto before = shm::read_report(coordinator.block());
  CHECK(before.allocated_bytes == 128 * MiB);
  CHECK(before.device_bytes >= 128 * MiB);
  CHECK(before.host_bytes == 0);

  coordinator.set(64 * MiB, 1.0);
  channel.poll_once();
  auto after = shm::read_report(coordinator.block());
  CHECK(after.device_bytes <= 64 * MiB);
  CHECK(after.host_bytes >= 64 * MiB);
  CHECK(after.device_bytes + after.host_bytes == after.reserved_bytes);
  CHECK(after.spilled_bytes >= 64 * MiB);
  CHECK(after.applied_memory_cap == 64 * MiB);
  char read_back[sizeof pattern] = {};
  backend.read(live[0], read_back, sizeof read_back);
  CHECK(std::string(read_back) == pattern);
  CHECK(after.host_pool_bytes == 0);  // every host page holds a tensor's bytes

  // Raised under a cap: the pages come back, their host pages stay pinned with the job.
  coordinator.set(256 * MiB, 1.0);
  channel.poll_once();
  channel.poll_once();
  auto raised = shm::read_report(coordinator.block());
  CHECK(raised.host_bytes == 0);
  CHECK(raised.host_pool_bytes == after.host_bytes);
  CHECK(raised.host_pool_bytes == static_cast<std::uint64_t>(allocator.stats().host_pool_bytes.current));

  coordinator.set(kNoCap, 1.0);
  channel.poll_once();
  channel.poll_once();
  auto restored = shm::read_report(coordinator.block());
  CHECK(restored.host_bytes == 0);
  CHECK(restored.host_pool_bytes == 0);  // no cap: nothing kept
  CHECK(restored.restored_bytes >= 64 * MiB);
  for (auto address : live) allocator.free(address);
}

TEST_CASE("concurrent_reader_never_sees_a_torn_control_or_report", "[job_channel]") {
  CoordinatorBlock coordinator("seqlock");
  std::atomic<bool> done{false};
  // Writers keep every field of a section equal to one counter; a torn read
  // would show two different values. Start from counter 0 in both.
  shm::JobControl zero;
  zero.memory_cap = 0;
  zero.share = 0.0;
  shm::write_control(coordinator.block(), zero);
  shm::write_report(coordinator.block(), shm::JobReport{});
  std::thread control_writer([&] {
    for (std::uint64_t k = 1; !done.load(); ++k) {
      shm::JobControl control;
      control.memory_cap = k;
      control.share = static_cast<double>(k);
      control.command_sequence = k;
      shm::write_control(coordinator.block(), control);
    }
  });
  std::thread report_writer([&] {
    for (std::uint64_t k = 1; !done.load(); ++k) {
      shm::JobReport report;
      report.device_bytes = report.host_bytes = report.iteration_count = k;
      shm::write_report(coordinator.block(), report);
    }
  });
  std::uint64_t torn = 0, reads = 0, changes = 0, last_cap = 0;
  auto deadline = std::chrono::steady_clock::now() + 2s;
  for (; changes < 1000 && std::chrono::steady_clock::now() < deadline; ++reads) {
    auto control = shm::read_control(coordinator.block());
    auto report = shm::read_report(coordinator.block());
    torn += control.memory_cap != control.command_sequence ||
            control.share != static_cast<double>(control.memory_cap);
    torn += report.device_bytes != report.host_bytes || report.host_bytes != report.iteration_count;
    changes += control.memory_cap != last_cap;
    last_cap = control.memory_cap;
  }
  done = true;
  control_writer.join();
  report_writer.join();
  CHECK(changes >= 2);  // the reader really raced the writers (few changes on a loaded machine)
  CHECK(torn == 0);
}

TEST_CASE("section_left_mid_update_by_a_killed_writer_is_refused_then_repaired_by_the_next_write",
          "[job_channel]") {
  CoordinatorBlock coordinator("killed-writer");
  JobChannel channel(coordinator.region.name(), {});
  // A coordinator killed inside write_control leaves the sequence odd.
  coordinator.block().control.sequence.fetch_add(1);
  CHECK_THROWS_WITH(shm::read_control(coordinator.block()), Catch::Contains("stopped while writing"));
  auto beat = shm::read_heartbeat_ns(coordinator.block());
  std::this_thread::sleep_for(1ms);
  CHECK_FALSE(channel.poll_once());  // skips applying, keeps reporting
  CHECK(shm::read_heartbeat_ns(coordinator.block()) > beat);
  shm::JobControl fresh;  // the restarted coordinator's first write
  fresh.memory_cap = 32 * MiB;
  shm::write_control(coordinator.block(), fresh);
  CHECK(shm::read_control(coordinator.block()).memory_cap == 32 * MiB);
  CHECK(channel.poll_once());
  CHECK(shm::read_report(coordinator.block()).applied_memory_cap == 32 * MiB);
}

TEST_CASE("report_carries_the_host_room_read_at_most_once_an_interval_and_none_when_unknown", "[job_channel]") {
  CoordinatorBlock coordinator("hostroom");
  SimulatedBackend backend(SimulatedJob::config());
  auto host_pages = std::make_shared<HostPagePool>(backend);
  host_pages->set_headroom(64 * MiB);
  CachingAllocator allocator(backend, {}, host_pages);
  SimulatedJobProcess process(allocator);
  CHECK(allocator.host_room() == host_pages->room());
  JobChannelOptions options;
  options.host_room_interval = std::chrono::hours(1);
  JobChannel channel(coordinator.region.name(), job_channel_hooks(process), options);
  channel.poll_once();
  const std::uint64_t first = shm::read_report(coordinator.block()).host_room_bytes;
  CHECK(first == backend.host_available_bytes().value() - 64 * MiB);

  // A cap spills 64 MiB to host pages: less room, but not read again within the interval.
  const DevicePtr live = allocator.allocate(128 * MiB, 0);
  allocator.set_memory_cap(64 * MiB);
  allocator.apply_pending_migrations();
  channel.poll_once();
  CHECK(shm::read_report(coordinator.block()).host_room_bytes == first);

  JobChannelOptions often;
  often.host_room_interval = std::chrono::milliseconds(0);
  JobChannel again(coordinator.region.name(), job_channel_hooks(process), often);
  again.poll_once();
  CHECK(shm::read_report(coordinator.block()).host_room_bytes == first - 64 * MiB);
  allocator.free(live);

  // No hook: the room is unknown, which the block says as kNoCap.
  CoordinatorBlock other("hostroom_none");
  JobChannel bare(other.region.name(), {});
  bare.poll_once();
  CHECK(shm::read_report(other.block()).host_room_bytes == kNoCap);
}

TEST_CASE("a_forked_child_dropping_its_copy_of_the_channel_leaves_the_parents_job_alone", "[job_channel]") {
  // A child forked while the channel's thread runs has a copy of the channel
  // but not the thread. Dropping the copy (the child's exit handlers) must
  // neither wait for that thread nor report the parent's job exited or
  // remove its block.
  CoordinatorBlock coordinator("fork");
  auto channel = std::make_unique<JobChannel>(coordinator.region.name(), JobChannelHooks{});
  channel->start();
  std::this_thread::sleep_for(10ms);  // the thread waits between polls
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::alarm(5);  // a child stuck in a join would never exit
    channel.reset();
    ::_exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(shm::read_report(coordinator.block()).state == shm::JobState::kRunning);
  CHECK_NOTHROW(shm::ShmRegion::open(coordinator.region.name(), shm::kJobBlockBytes));
  CHECK(channel->running());
  channel.reset();
  CHECK(shm::read_report(coordinator.block()).state == shm::JobState::kExited);
}
