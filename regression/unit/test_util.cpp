// ptrain-test: np=1 labels=quick timeout=60
#include <gtest/gtest.h>

#include "util/error.hpp"
#include "util/memory.hpp"

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

TEST(Util, FormatBytes) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(3.0 * 1024 * 1024 * 1024), "3.00 GiB");
}
