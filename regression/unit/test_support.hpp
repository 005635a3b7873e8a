// Helpers shared by the unit tests: MPI rank and size, host/device vectors, random data,
// relative errors and central finite differences.
#pragma once
#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "model/layout.hpp"
#include "util/staging.hpp"

namespace ptrain::test {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
inline int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

using HVec = std::vector<double>;
const double kNegInf = -std::numeric_limits<double>::infinity();

inline HVec random_vec(std::size_t n, unsigned seed, double lo = -1, double hi = 1) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  HVec v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// Tensors to and from the host through util/staging.hpp, as the program moves them.
template <class T>
inline Kokkos::View<T*> dev(const HVec& h) {
  Kokkos::View<T*> v("dev", h.size());
  std::vector<T> m(h.begin(), h.end());
  staging::from_host(v, m.data(), m.size());
  return v;
}

template <class T>
inline HVec host(const Kokkos::View<T*>& v) {
  const auto m = staging::to_host(v);
  return HVec(m.begin(), m.end());
}

// One element of a tensor, read or written from the host.
template <class T>
inline double get(const Kokkos::View<T*>& v, std::size_t i) {
  return double(
      staging::to_host(Kokkos::View<T*>(Kokkos::subview(v, Kokkos::make_pair(i, i + 1))))[0]);
}
template <class T>
inline void set(const Kokkos::View<T*>& v, std::size_t i, double x) {
  const T value(x);
  staging::from_host(Kokkos::View<T*>(Kokkos::subview(v, Kokkos::make_pair(i, i + 1))), &value, 1);
}

inline double dot(const HVec& a, const HVec& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// |a - b| / max(|a|, |b|, tiny) over finite entries; infinities must match exactly.
inline double rel_err(const HVec& a, const HVec& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, na = 0, nb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) || std::isinf(b[i])) {
      EXPECT_EQ(a[i], b[i]) << "entry " << i;
      continue;
    }
    num += (a[i] - b[i]) * (a[i] - b[i]);
    na += a[i] * a[i];
    nb += b[i] * b[i];
  }
  return std::sqrt(num) / std::max({std::sqrt(na), std::sqrt(nb), 1e-300});
}

inline HVec fd_grad(HVec x, const std::function<double(const HVec&)>& f, double h = 1e-5) {
  HVec g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double fp = f(x);
    x[i] = x0 - h;
    const double fm = f(x);
    x[i] = x0;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

inline Kokkos::View<int*> dev_ints(const std::vector<int>& h) {
  Kokkos::View<int*> v("ints", h.size());
  auto m = Kokkos::create_mirror_view(v);
  for (std::size_t i = 0; i < h.size(); ++i) m(i) = h[i];
  Kokkos::deep_copy(v, m);
  return v;
}

// Number of entries where a and b differ (not bit-for-bit equal as doubles).
inline std::size_t differing(const HVec& a, const HVec& b) {
  EXPECT_EQ(a.size(), b.size());
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) n += a[i] != b[i];
  return n;
}

inline HVec minus(const HVec& a, const HVec& b) {
  HVec d(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

// A folder under /tmp made by rank 0 for one test, removed (after a barrier) at its end.
class TempDir {
 public:
  TempDir() {
    char name[64] = "/tmp/ptrain-test-XXXXXX";
    if (world_rank() == 0 && !mkdtemp(name)) name[0] = '\0';
    MPI_Bcast(name, sizeof name, MPI_CHAR, 0, MPI_COMM_WORLD);
    path_ = name;
    EXPECT_FALSE(path_.empty());
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() == 0) std::filesystem::remove_all(path_);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Row-major index in a tensor of global shape g of element k of slab s.
inline std::int64_t global_index(const model::Shape& g, const model::Slab& s, std::int64_t k) {
  std::vector<std::int64_t> pos(g.size());
  for (std::size_t j = g.size(); j-- > 0;) {
    pos[j] = s.start[j] + k % s.count[j];
    k /= s.count[j];
  }
  std::int64_t idx = 0;
  for (std::size_t j = 0; j < g.size(); ++j) idx = idx * g[j] + pos[j];
  return idx;
}

}  // namespace ptrain::test
