// ptrain-test: np=1 labels=quick timeout=60
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>

#include "util/error.hpp"
#include "util/memory.hpp"
#include "util/staging.hpp"

using namespace ptrain;

TEST(Util, CatJoinsAnything) { EXPECT_EQ(cat("a", 1, ':', 2.5), "a1:2.5"); }

TEST(Util, RequireThrowsOneLine) {
  try {
    PTRAIN_REQUIRE(1 == 2, "x = ", 3);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "x = 3");
    EXPECT_EQ(e.exit_code(), kExitRuntime);
  }
}

TEST(Util, TrackedViewCountsBytesAndPeak) {
  memory::reset_peaks();
  auto base = memory::stats().current[int(MemCategory::grads)];
  {
    TrackedView<double> a(MemCategory::grads, "a", 100);
    EXPECT_EQ(memory::stats().current[int(MemCategory::grads)], base + 800);
    TrackedView<double> b = std::move(a);
    EXPECT_EQ(memory::stats().current[int(MemCategory::grads)], base + 800);
    EXPECT_EQ(b.size(), 100u);
  }
  EXPECT_EQ(memory::stats().current[int(MemCategory::grads)], base);
  EXPECT_EQ(memory::stats().peak[int(MemCategory::grads)], base + 800);
}

namespace {

// The "[x]" choice of /sys/kernel/mm/transparent_hugepage/enabled ("" where there is none).
std::string transparent_huge_pages_setting() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  std::getline(in, line);
  const auto open = line.find('['), close = line.find(']');
  return open == std::string::npos || close == std::string::npos
             ? std::string()
             : line.substr(open + 1, close - open - 1);
}

// /proc/self/smaps' THPeligible for the mapping holding p: 1 where the kernel may back it
// with huge pages (for a "madvise" setting, only after madvise), -1 where it is not listed.
int huge_pages_eligible(const void* p) {
  std::ifstream in("/proc/self/smaps");
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2)
      inside = lo <= a && a < hi;
    else if (inside && line.rfind("THPeligible:", 0) == 0)
      return std::stoi(line.substr(12));
  }
  return -1;
}

}  // namespace

TEST(Util, LargeTrackedViewStartsOnAHugePageZeroedAndCountsItsOwnBytes) {
  if (device_guard::kEnabled) GTEST_SKIP() << "the device guard maps each TrackedView itself";
  const std::size_t n = 3 * memory::kHugePage / sizeof(float) + 7;
  const auto base = memory::stats().current[int(MemCategory::activations)];
  Kokkos::View<float*> copy;
  {
    TrackedView<float> big(MemCategory::activations, "big", n);
    EXPECT_EQ(memory::stats().current[int(MemCategory::activations)], base + n * sizeof(float));
    ASSERT_EQ(big.size(), n);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(big.data()) % memory::kHugePage, 0u);
    std::size_t nonzero = 0;
    staging::HostView<float> host(big.view(), staging::Access::read);
    for (std::size_t i = 0; i < n; ++i) nonzero += host[i] != 0.0f;
    EXPECT_EQ(nonzero, 0u);
    const std::string thp = transparent_huge_pages_setting();
    if (thp == "always" || thp == "madvise") {
      EXPECT_EQ(huge_pages_eligible(big.data()), 1) << "transparent huge pages: " << thp;
    }
    copy = big.view();
  }
  // The copy shares the allocation, which outlives the TrackedView that made it.
  EXPECT_EQ(memory::stats().current[int(MemCategory::activations)], base);
  copy(n - 1) = 2.5f;
  EXPECT_EQ(copy(n - 1), 2.5f);
}

TEST(Util, FormatBytes) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(3.0 * 1024 * 1024 * 1024), "3.00 GiB");
}

// ---- the device guard (a PTRAIN_DEVICE_GUARD=ON build; skipped elsewhere) ---------------

// v[first, first + n) = value, by a kernel named `name`. (A free function: nvcc takes no
// device lambda inside a gtest body, which is a private member.)
void set_range(const char* name, Kokkos::View<float*> v, int first, int n, float value) {
  Kokkos::parallel_for(
      name, Kokkos::RangePolicy<>(first, first + n), KOKKOS_LAMBDA(int i) { v(i) = value; });
}
void fill_iota(Kokkos::View<float*> v) {
  Kokkos::parallel_for(
      "test::fill", v.extent(0), KOKKOS_LAMBDA(std::size_t i) { v(i) = float(i); });
}

// A macro: GTEST_SKIP returns from the function it is written in. Death tests fork only (the
// "fast" style): a re-executed child would initialise MPI again.
#define PTRAIN_SKIP_UNLESS_GUARDED()                                                             \
  if (!device_guard::kEnabled) GTEST_SKIP() << "not a device guard build (PTRAIN_DEVICE_GUARD)"; \
  testing::FLAGS_gtest_death_test_style = "fast"

TEST(DeviceGuard, KernelsCopiesAndStagingScopesMayTouchTensors) {
  PTRAIN_SKIP_UNLESS_GUARDED();
  TrackedView<float> t(MemCategory::activations, "open", 3000);
  Kokkos::View<float*> v = t.view();
  fill_iota(v);
  std::vector<float> back = staging::to_host(v);
  EXPECT_EQ(back[2999], 2999.0f);
  {
    staging::HostView<float> host(v, staging::Access::read_write);
    host[7] = -1.0f;
  }
  std::vector<float> in(3000, 0.5f);
  staging::from_host(v, in.data(), 10);
  EXPECT_EQ(staging::to_host(v)[7], 0.5f);
  EXPECT_EQ(staging::to_host(v)[10], 10.0f);
}

TEST(DeviceGuard, CatchesAHostReadAndNamesTheTensor) {
  PTRAIN_SKIP_UNLESS_GUARDED();
  TrackedView<float> t(MemCategory::activations, "planted", 4096);
  const float* p = t.data();
  EXPECT_DEATH(
      {
        volatile float x = p[1000];
        (void)x;
      },
      "host code touched tensor 'planted' at byte 4000 of 16384");
}

TEST(DeviceGuard, CatchesAKernelWritingABufferLentToComm) {
  PTRAIN_SKIP_UNLESS_GUARDED();
  TrackedView<float> t(MemCategory::grads, "bucket", 8192);
  Kokkos::View<float*> v = t.view();
  // A Comm all-reduce holds the middle of the buffer; a kernel may still write the rest.
  device_guard::lend(t.data() + 2048, 4096 * sizeof(float), "all-reduce", false);
  set_range("test::outside", v, 0, 1024, 1.0f);
  EXPECT_DEATH(set_range("test::race", v, 4000, 1, 1.0f),
               "'test::race' touched tensor 'bucket' at byte 16000 of 32768 while it is lent to "
               "a Comm all-reduce");
  device_guard::give_back(t.data() + 2048, 4096 * sizeof(float));
  set_range("test::after", v, 4000, 1, 1.0f);
}
