// The per-GPU peer segment's life cycle: create and attach, slots claimed and
// reclaimed from crashed holders (a forked child killed with SIGKILL), stale
// heartbeats, segments left by an earlier run or another version.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <fcntl.h>

#include <atomic>
#include <cstring>
#include <set>
#include <string>

#include "cotenant/errors.h"
#include "cotenant/shm/gpu_block.h"

using namespace cotenant;
using namespace cotenant::shm;

namespace {

constexpr Nanoseconds kMs = 1'000'000;

class FakeClock final : public Clock {
 public:
  Nanoseconds now_ns() const override { return now_.load(); }
  void advance(Nanoseconds by) { now_ += by; }

 private:
  std::atomic<Nanoseconds> now_{MonotonicClock::instance().now_ns()};
};

// A segment name no other test or process uses; removed when the test ends.
struct ScopedName {
  std::string name;
  ScopedName() {
    static int counter = 0;
    name = "/cotenant-test-gpu-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    GpuPeerSegment::remove(name);
  }
  ~ScopedName() { GpuPeerSegment::remove(name); }
};

// The pid of a process that has exited and been reaped: certainly dead.
std::uint64_t dead_pid() {
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  return static_cast<std::uint64_t>(child);
}

}  // namespace

TEST_CASE("first_open_creates_the_segment_and_later_opens_attach", "[segment]") {
  ScopedName n;
  auto first = GpuPeerSegment::open(n.name, 3);
  CHECK(first.opening() == SegmentOpening::kCreated);
  CHECK(first.block().magic.load() == kGpuBlockMagic);
  CHECK(first.block().device.load() == 3);
  auto second = GpuPeerSegment::open(n.name, 3);
  CHECK(second.opening() == SegmentOpening::kAttached);
  CHECK(second.view().generation == first.view().generation);
  // Both map the same bytes.
  first.claim_guaranteed(::getpid());
  CHECK(second.view().guaranteed.pid == static_cast<std::uint64_t>(::getpid()));
  CHECK(second.view().guaranteed.live);
}

TEST_CASE("default_name_is_per_gpu_uuid_and_per_user_or_group", "[segment]") {
  const std::string uuid = "GPU-8f3c2a10-1b2c-3d4e-5f60-718293a4b5c6";
  // The UUID, not the CUDA index: two indices of one GPU meet in one segment.
  CHECK(GpuPeerSegment::default_name(uuid, 0, 1000) == "/cotenant-gpu-" + uuid + "-u1000");
  CHECK(GpuPeerSegment::default_name(uuid, 3, 1000) == GpuPeerSegment::default_name(uuid, 0, 1000));
  CHECK(GpuPeerSegment::default_name(uuid, 0, 1000, gid_t{42}) == "/cotenant-gpu-" + uuid + "-g42");
  CHECK(GpuPeerSegment::default_name("", 7, 0) == "/cotenant-gpu-index7-u0");
  CHECK(GpuPeerSegment::default_name("MIG-1/2.3", 0, 5) == "/cotenant-gpu-MIG-1_2_3-u5");  // one name component
}

TEST_CASE("jobs_that_see_one_gpu_under_two_indices_share_its_segment", "[segment]") {
  ScopedName n;
  GpuPeerSegmentOptions options;
  options.gpu_uuid = "GPU-11111111-2222-3333-4444-555555555555";
  auto as_index_0 = GpuPeerSegment::open(n.name, 0, options);
  as_index_0.claim_guaranteed(::getpid());
  auto as_index_1 = GpuPeerSegment::open(n.name, 1, options);  // CUDA_VISIBLE_DEVICES differs
  CHECK(as_index_1.opening() == SegmentOpening::kAttached);    // not wiped as another GPU's
  CHECK(as_index_1.view().guaranteed.live);
  options.gpu_uuid = "GPU-99999999-2222-3333-4444-555555555555";
  auto other_gpu = GpuPeerSegment::open(n.name, 0, options);
  CHECK(other_gpu.opening() == SegmentOpening::kReinitialised);
}

TEST_CASE("a_group_segment_is_given_to_the_group_and_accepted_from_its_members", "[segment][security]") {
  ScopedName n;
  GpuPeerSegmentOptions options;
  options.group = ::getegid();
  auto segment = GpuPeerSegment::open(n.name, 0, options);
  int fd = ::shm_open(n.name.c_str(), O_RDONLY, 0);
  REQUIRE(fd >= 0);
  struct stat info {};
  REQUIRE(::fstat(fd, &info) == 0);
  CHECK(info.st_gid == ::getegid());
  CHECK((info.st_mode & 0777) == 0660);
  if (::geteuid() == 0) {  // a member of the group made it: accepted; anyone else's: refused
    REQUIRE(::fchown(fd, 65534, static_cast<gid_t>(-1)) == 0);
    CHECK_NOTHROW(GpuPeerSegment::open(n.name, 0, options));
    REQUIRE(::fchown(fd, 65534, 65534) == 0);
    CHECK_THROWS_WITH(GpuPeerSegment::open(n.name, 0, options), Catch::Contains("or to group"));
  }
  ::close(fd);
}

TEST_CASE("a_second_live_guaranteed_job_is_refused_with_the_holder_named", "[segment]") {
  ScopedName n;
  auto segment = GpuPeerSegment::open(n.name, 0);
  const auto parent = static_cast<std::uint64_t>(::getppid());  // alive: it runs us
  segment.claim_guaranteed(parent);
  try {
    segment.claim_guaranteed(::getpid());
    FAIL("the second claim should have been refused");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("pid " + std::to_string(parent)));
    CHECK_THAT(e.what(), Catch::Contains("opportunistic"));
  }
  segment.release_guaranteed(parent);
  segment.claim_guaranteed(::getpid());
  CHECK(segment.view().guaranteed.pid == static_cast<std::uint64_t>(::getpid()));
}

TEST_CASE("a_guaranteed_job_killed_with_sigkill_is_detected_and_its_slot_reclaimed", "[segment]") {
  ScopedName n;
  auto segment = GpuPeerSegment::open(n.name, 0);
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    auto own = GpuPeerSegment::open(n.name, 0);
    own.claim_guaranteed(::getpid());
    own.publish_activity(true, 4, MonotonicClock::instance().now_ns());
    char byte = 1;
    (void)::write(ready[1], &byte, 1);
    for (;;) ::pause();
  }
  char byte = 0;
  REQUIRE(::read(ready[0], &byte, 1) == 1);
  ::close(ready[0]);
  ::close(ready[1]);
  CHECK(segment.guaranteed_busy());
  CHECK_THROWS_AS(segment.claim_guaranteed(::getpid()), Error);

  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  REQUIRE(WIFSIGNALED(status));

  CHECK_FALSE(segment.view().guaranteed.live);
  CHECK(segment.reclaim_crashed() == 1);
  CHECK_FALSE(segment.guaranteed_busy());  // opportunistic jobs run again
  CHECK(segment.view().guaranteed.pid == 0);
  segment.claim_guaranteed(::getpid());
  CHECK(segment.view().guaranteed.busy == false);  // the new holder starts clean
}

TEST_CASE("a_holder_whose_heartbeat_went_stale_counts_as_crashed", "[segment]") {
  ScopedName n;
  FakeClock clock;
  GpuPeerSegmentOptions options;
  options.stale_after_ns = 1000 * kMs;
  auto segment = GpuPeerSegment::open(n.name, 0, options, clock);
  const auto hung = static_cast<std::uint64_t>(::getppid());  // alive, but never beats
  segment.claim_guaranteed(hung);
  segment.publish_activity(true, 1, clock.now_ns());
  CHECK(segment.guaranteed_busy());
  clock.advance(500 * kMs);
  segment.heartbeat(hung);
  clock.advance(900 * kMs);
  CHECK(segment.guaranteed_busy());  // beat 900 ms ago: still alive
  CHECK(segment.reclaim_crashed() == 0);
  clock.advance(200 * kMs);
  CHECK_FALSE(segment.guaranteed_busy());  // 1.1 s without a beat
  CHECK(segment.reclaim_crashed() == 1);
}

TEST_CASE("attaching_to_a_segment_from_an_earlier_run_frees_its_dead_holders_slots", "[segment]") {
  ScopedName n;
  const std::uint64_t gone = dead_pid();
  {
    auto earlier = GpuPeerSegment::open(n.name, 1);
    earlier.claim_guaranteed(gone);
    earlier.publish_activity(true, 2, MonotonicClock::instance().now_ns());
    earlier.claim_opportunistic(gone);
  }
  auto later = GpuPeerSegment::open(n.name, 1);
  CHECK(later.opening() == SegmentOpening::kAttached);
  CHECK(later.view().guaranteed.pid == 0);
  CHECK(later.view().opportunistic.empty());
  CHECK_FALSE(later.guaranteed_busy());
}

TEST_CASE("a_segment_with_foreign_bytes_or_another_version_is_reinitialised", "[segment]") {
  ScopedName n;
  std::uint64_t generation = 0;
  {
    auto segment = GpuPeerSegment::open(n.name, 0);
    generation = segment.view().generation;
    segment.block().version.store(kGpuBlockVersion + 1);  // as another version left it
  }
  {
    auto segment = GpuPeerSegment::open(n.name, 0);
    CHECK(segment.opening() == SegmentOpening::kReinitialised);
    CHECK(segment.block().version.load() == kGpuBlockVersion);
    CHECK(segment.view().generation == generation + 1);
  }
  // Garbage, and too short for the layout.
  int fd = ::shm_open(n.name.c_str(), O_RDWR | O_TRUNC, 0660);
  REQUIRE(fd >= 0);
  const char junk[] = "not a cotenant segment";
  REQUIRE(::write(fd, junk, sizeof junk) == static_cast<ssize_t>(sizeof junk));
  ::close(fd);
  auto segment = GpuPeerSegment::open(n.name, 0);
  CHECK(segment.opening() == SegmentOpening::kReinitialised);
  CHECK(segment.block().magic.load() == kGpuBlockMagic);
  CHECK(segment.block().block_bytes.load() == sizeof(GpuBlock));
  segment.claim_guaranteed(::getpid());
  CHECK(segment.view().guaranteed.live);
}

// Whoever can write the segment sets the job's share: one that another user
// created first, or that every user may write, is refused with the fix, and
// nothing in it is touched.
TEST_CASE("a_segment_another_user_could_write_is_refused_with_the_fix", "[segment][security]") {
  ScopedName n;
  int fd = ::shm_open(n.name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::fchmod(fd, 0666) == 0);  // as a careless or hostile creator leaves it
  try {
    (void)GpuPeerSegment::open(n.name, 0);
    FAIL("a segment every user may write was used");
  } catch (const Error& error) {
    const std::string message = error.what();
    CHECK(message.find("written by every user (mode 0666)") != std::string::npos);
    CHECK(message.find("COTENANT_GPU_SEGMENT") != std::string::npos);
  }
  struct stat info {};
  REQUIRE(::fstat(fd, &info) == 0);
  CHECK(info.st_size == 0);  // nothing written into it
  if (::geteuid() == 0) {    // another owner needs root to arrange
    REQUIRE(::fchmod(fd, 0660) == 0);
    REQUIRE(::fchown(fd, 65534, 65534) == 0);
    CHECK_THROWS_WITH(GpuPeerSegment::open(n.name, 0), Catch::Contains("belongs to") && Catch::Contains("not to"));
  }
  ::close(fd);
}

TEST_CASE("claiming_an_opportunistic_slot_twice_returns_the_same_slot", "[segment]") {
  ScopedName n;
  auto segment = GpuPeerSegment::open(n.name, 0);
  const std::size_t slot = segment.claim_opportunistic(::getpid());
  CHECK(segment.claim_opportunistic(::getpid()) == slot);  // idempotent
  CHECK(segment.view().opportunistic.size() == 1);
}

TEST_CASE("the_segment_records_the_gpu_uuid_it_was_created_for", "[segment]") {
  ScopedName n;
  GpuPeerSegmentOptions options;
  options.gpu_uuid = "GPU-0b4f1c52-8a0e-4a53-9a4b-1f6f3c5d2e11";
  auto segment = GpuPeerSegment::open(n.name, 0, options);
  CHECK(segment.view().gpu_uuid == options.gpu_uuid);
}

TEST_CASE("a_gpu_takes_at_most_the_maximum_of_live_opportunistic_jobs", "[segment]") {
  ScopedName n;
  auto segment = GpuPeerSegment::open(n.name, 0);
  // Each slot needs a distinct live holder: fork sleeping children.
  std::vector<pid_t> sleepers;
  for (std::size_t i = 0; i < kMaxOpportunisticJobs; ++i) {
    pid_t child = ::fork();
    if (child == 0) {
      for (;;) ::pause();
    }
    sleepers.push_back(child);
    segment.claim_opportunistic(static_cast<std::uint64_t>(child));
  }
  try {
    segment.claim_opportunistic(::getpid());
    FAIL("a ninth opportunistic job should have been refused");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("another GPU"));
  }
  ::kill(sleepers.back(), SIGKILL);
  ::waitpid(sleepers.back(), nullptr, 0);
  sleepers.pop_back();
  CHECK(segment.claim_opportunistic(::getpid()) == kMaxOpportunisticJobs - 1);
  for (pid_t child : sleepers) {
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
  }
}

TEST_CASE("the_gate_over_the_segment_admits_only_while_the_guaranteed_job_is_idle", "[segment][gate]") {
  ScopedName n;
  auto segment = GpuPeerSegment::open(n.name, 0);
  segment.claim_guaranteed(static_cast<std::uint64_t>(::getppid()));
  const std::size_t slot = segment.claim_opportunistic(::getpid());
  SegmentPeerState peer(segment);
  struct NoWork final : InFlightWork {
    void record_marker() override {}
    std::size_t poll_in_flight() override { return 0; }
  } work;
  LaunchGate gate(MonotonicClock::instance(), work, peer);
  segment.publish_activity(true, 1, MonotonicClock::instance().now_ns());
  CHECK_FALSE(gate.try_admit());
  segment.publish_activity(false, 0, MonotonicClock::instance().now_ns());
  CHECK(gate.try_admit());
  gate.launched();
  segment.report_gate(slot, gate.stats());
  CHECK(segment.view().opportunistic.at(0).admitted_ops == 1);
}

TEST_CASE("the_layout_description_covers_every_field_once_inside_the_block", "[segment]") {
  auto fields = gpu_block_layout();
  CHECK(fields.size() == 5 + kGpuBlockUuidBytes / 8 + 5 + 5 * kMaxOpportunisticJobs);
  CHECK(fields.size() * sizeof(Word) == sizeof(GpuBlock));
  std::set<std::size_t> offsets;
  for (const auto& f : fields) {
    CHECK(f.offset + f.bytes <= sizeof(GpuBlock));
    offsets.insert(f.offset);
  }
  CHECK(offsets.size() == fields.size());
}
