#include "model/moe.hpp"

#include <algorithm>
#include <climits>
#include <cmath>

#include "kernels/gemm.hpp"
#include "kernels/kernels.hpp"
#include "model/layers.hpp"
#include "util/error.hpp"
#include "util/profile.hpp"
#include "util/staging.hpp"

namespace ptrain::model {

namespace K = kernels;

namespace {

using kernels::slice;

template <class T>
std::vector<double> to_host(const K::Vec<T>& v, std::int64_t n) {
  const std::vector<T> h = staging::to_host(slice(v, 0, n));
  return std::vector<double>(h.begin(), h.end());
}

template <class T, class U>
void to_device(const K::Vec<T>& v, const std::vector<U>& h) {
  staging::HostView<T> m(slice(v, 0, std::int64_t(h.size())), staging::Access::write);
  for (std::size_t i = 0; i < h.size(); ++i) m[i] = T(h[i]);
}

void to_device(Kokkos::View<int*>& v, const std::vector<int>& h) {
  if (v.extent(0) < h.size())
    v = Kokkos::View<int*>("ptrain::moe_rows", std::max<std::size_t>(h.size(), 1));
  Kokkos::deep_copy(
      Kokkos::subview(v, Kokkos::make_pair(std::size_t(0), h.size())),
      Kokkos::View<const int*, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>(h.data(), h.size()));
}

// The k largest of p[0..E), highest first, ties to the lower index.
void top_k(const double* p, int E, int k, int* out) {
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken = taken || out[i] == e;
      if (!taken && (best < 0 || p[e] > p[best])) best = e;
    }
    out[j] = best;
  }
}

// Rows (elements) per ep rank of rows counted per (rank, local expert).
std::vector<int> per_rank(const std::vector<int>& counts, int El, int width) {
  std::vector<int> out(counts.size() / std::size_t(El), 0);
  for (std::size_t i = 0; i < counts.size(); ++i) out[i / std::size_t(El)] += counts[i] * width;
  return out;
}

// Every token's choices of the micro-batch in its token order (sample, position), and which
// of them are this rank's: with context parallelism the cp group's choices are gathered.
struct TokenOrder {
  std::vector<int> choices;  // (N, k) of the whole micro-batch, token order
  std::vector<int> mine;     // (N) this rank's token index, or -1
};
TokenOrder token_order(const Ctx& c, const std::vector<int>& expert, int k) {
  TokenOrder o;
  if (!c.ring()) {
    o.choices = expert;
    o.mine.resize(std::size_t(c.BT));
    for (std::int64_t t = 0; t < c.BT; ++t) o.mine[std::size_t(t)] = int(t);
    return o;
  }
  const ContextParallel& cp = *c.cp;
  const int C = cp.size(), L = c.S, S = L * C, n = int(c.BT) * k;
  std::vector<int> all(std::size_t(n) * C);
  cp.comm().all_gather(expert.data(), all.data(), std::vector<int>(std::size_t(C), n)).wait();
  o.choices.resize(std::size_t(c.B) * S * k);
  o.mine.assign(std::size_t(c.B) * S, -1);
  for (int r = 0; r < C; ++r) {
    const std::vector<int> pos = sequence_positions(cp.pieces(r));
    for (int b = 0; b < c.B; ++b)
      for (int i = 0; i < L; ++i) {
        const std::size_t g = std::size_t(b) * S + std::size_t(pos[std::size_t(i)]),
                          t = std::size_t(b) * L + std::size_t(i);
        std::copy_n(all.begin() + std::ptrdiff_t((std::size_t(r) * n) + t * k), k,
                    o.choices.begin() + std::ptrdiff_t(g * k));
        if (r == cp.rank()) o.mine[g] = int(t);
      }
  }
  return o;
}

// Each token's k experts (r.expert, (BT, k), in gate order) from its router probabilities
// p (BT, E); returns their gates, renormalised over the k.
std::vector<double> choose_experts(const std::vector<double>& p, int BT, int E, int k,
                                   std::vector<int>& expert) {
  std::vector<double> gates(std::size_t(BT) * k);
  expert.assign(std::size_t(BT) * k, 0);
  for (int t = 0; t < BT; ++t) {
    const double* pt = p.data() + std::size_t(t) * E;
    int* chosen = expert.data() + std::size_t(t) * k;
    top_k(pt, E, k, chosen);
    double s = 0;
    for (int j = 0; j < k; ++j) s += pt[chosen[j]];
    for (int j = 0; j < k; ++j) gates[std::size_t(t) * k + j] = pt[chosen[j]] / s;
  }
  return gates;
}

// Capacity over the micro-batch's N tokens, filled in token order: returns which of this
// rank's (BT, k) choices are kept, and sets r.f (over all choices) and the aux loss r.aux.
std::vector<char> keep_within_capacity(const Ctx& c, const std::vector<double>& p, int BT, int E,
                                       int k, double capacity_factor, double aux_coef, Routing& r) {
  const TokenOrder order = token_order(c, r.expert, k);
  const double N = double(order.mine.size());
  const std::int64_t cap = capacity_factor > 0
                               ? std::int64_t(std::ceil(capacity_factor * k * N / E - 1e-9))
                               : std::int64_t(INT_MAX);
  std::vector<std::int64_t> used(std::size_t(E), 0), picked(std::size_t(E), 0);
  std::vector<char> kept(std::size_t(BT) * k, 0);
  for (std::size_t g = 0; g < order.mine.size(); ++g)
    for (int j = 0; j < k; ++j) {
      const int e = order.choices[g * k + std::size_t(j)];
      ++picked[std::size_t(e)];
      const bool keep = used[std::size_t(e)] < cap;
      used[std::size_t(e)] += keep;
      if (order.mine[g] >= 0) kept[std::size_t(order.mine[g]) * k + std::size_t(j)] = keep;
    }
  r.f.assign(std::size_t(E), 0);
  for (int e = 0; e < E; ++e) r.f[std::size_t(e)] = double(picked[std::size_t(e)]) / (N * k);
  std::vector<double> P(std::size_t(E), 0);
  for (int t = 0; t < BT; ++t)
    for (int e = 0; e < E; ++e) P[std::size_t(e)] += p[std::size_t(t) * E + std::size_t(e)];
  if (c.ring()) c.cp->comm().all_reduce_sum(P.data(), P.size()).wait();
  r.aux = 0;
  for (int e = 0; e < E; ++e) r.aux += r.f[std::size_t(e)] * P[std::size_t(e)] / N;
  r.aux *= aux_coef * E;
  return kept;
}

// Send order: expert by expert (so destination rank by rank), each in token order. Sets
// r's rows, send tokens, counts, loads and drops; returns the gate of each send row.
std::vector<double> send_order(const std::vector<char>& kept, const std::vector<double>& gates,
                               int BT, int E, int k, Routing& r) {
  std::vector<double> send_gates;
  r.row.assign(std::size_t(BT) * k, -1);
  r.send_token.clear();
  r.send_counts.assign(std::size_t(E), 0);
  r.load.assign(std::size_t(E), 0);
  r.dropped = 0;
  r.choices = std::int64_t(BT) * k;
  for (int e = 0; e < E; ++e)
    for (int t = 0; t < BT; ++t)
      for (int j = 0; j < k; ++j) {
        const std::size_t i = std::size_t(t) * k + std::size_t(j);
        if (r.expert[i] != e) continue;
        if (!kept[i]) {
          ++r.dropped;
          continue;
        }
        r.row[i] = int(r.send_token.size());
        r.send_token.push_back(t);
        send_gates.push_back(gates[i]);
        ++r.send_counts[std::size_t(e)];
        ++r.load[std::size_t(e)];
      }
  return send_gates;
}

}  // namespace

// Routing on the host: top-k and gates, capacity in token order, the aux loss, the send order.
template <class P>
void MoE<P>::forward(const Ctx& c, K::Vec<T> x, const Acts& a, Routing& r, K::Vec<T> partial,
                     K::Vec<T> y) const {
  const int BT = int(c.BT), ep_size = ep ? ep->size() : 1;
  c.tp->gather_rows(x);
  profile::region("moe-router", [&] {
    K::matmul_forward<T>(a.logits, x, router, K::Vec<T>(), BT, C, E);
    K::softmax_rows_forward<T>(a.probs, a.logits, BT, E);
  });
  const std::vector<double> p = to_host(a.probs, std::int64_t(BT) * E);
  const std::vector<double> gates = choose_experts(p, BT, E, k, r.expert);
  const std::vector<char> kept = keep_within_capacity(c, p, BT, E, k, capacity_factor, aux_coef, r);
  const std::vector<double> send_gates = send_order(kept, gates, BT, E, k, r);
  to_device(a.gates, gates);
  to_device(a.send_gates, send_gates);
  to_device(r.rows_dev, r.row);
  to_device(r.send_token_dev, r.send_token);
  const int sent = int(r.send_token.size());
  r.recv_counts = r.send_counts;
  if (ep_size > 1)
    ep->all_to_all(r.send_counts.data(), r.recv_counts.data(), std::size_t(El)).wait();

  // Tokens to the experts' ranks, through the experts, and back.
  const K::Vec<T> xs = ep_size > 1 ? a.xs : a.xr, ys = ep_size > 1 ? a.ys : a.yr;
  profile::region("moe-dispatch", [&] {
    K::combine_rows<T>(xs, x, r.send_token_dev, K::CVec<T>(), sent, 1, C, false);
  });
  exchange(r, xs, a.xr, true);
  for_each_segment(r, [&](int l, std::int64_t at, int n) {
    profile::region("matmul", [&] {
      K::matmul_forward<T>(slice(a.fch, at * Fl, std::int64_t(n) * Fl),
                           slice(a.xr, at * C, std::int64_t(n) * C),
                           slice(fc_w, std::int64_t(l) * Fl * C, std::int64_t(Fl) * C),
                           slice(fc_b, std::int64_t(l) * Fl, Fl), n, C, Fl);
    });
    profile::region("gelu", [&] {
      K::gelu_forward<T>(slice(a.fch_gelu, at * Fl, std::int64_t(n) * Fl),
                         slice(a.fch, at * Fl, std::int64_t(n) * Fl), std::size_t(n) * Fl);
    });
    profile::region("matmul", [&] {
      K::matmul_forward<T>(slice(a.yr, at * C, std::int64_t(n) * C),
                           slice(a.fch_gelu, at * Fl, std::int64_t(n) * Fl),
                           slice(proj_w, std::int64_t(l) * C * Fl, std::int64_t(C) * Fl),
                           c.tp->rank() == 0 ? slice(proj_b, std::int64_t(l) * C, C) : K::Vec<T>(),
                           n, Fl, C);
    });
  });
  exchange(r, a.yr, ys, false);
  const K::Vec<T> out = c.tp->sp() ? partial : y;
  profile::region("moe-combine",
                  [&] { K::combine_rows<T>(out, ys, r.rows_dev, a.gates, BT, k, C, false); });
  c.tp->sum_to_rows(out, y);
}

template <class P>
auto MoE<P>::backward(const Ctx& c, K::CVec<T> x, const Acts& a, const Routing& r, K::Vec<T> dy,
                      const Grads& g, K::Vec<T> full, K::Vec<T> dx, K::Vec<T> rows) const
    -> K::Vec<T> {
  const int BT = int(c.BT), ep_size = ep ? ep->size() : 1, sent = int(r.send_token.size());
  // d(output) of every token (gathered under SP), then of each send row: gate * dY.
  K::Vec<T> dY = dy;
  if (c.tp->sp()) {
    K::copy<T>(own_rows(c, full, C), dy);
    c.tp->gather_rows(full);
    dY = full;
  }
  const K::Vec<T> ys = ep_size > 1 ? a.ys : a.yr, dys = ep_size > 1 ? g.dys : g.dyr,
                  dxs = ep_size > 1 ? g.dxs : g.dxr;
  profile::region("moe-combine", [&] {
    K::row_dots<T>(g.dgates, dY, ys, r.rows_dev, BT, k, C);  // partial over tp (ys is)
    K::combine_rows<T>(dys, dY, r.send_token_dev, a.send_gates, sent, 1, C, false);
  });
  c.tp->sum(slice(g.dgates, 0, std::int64_t(BT) * k));
  exchange(r, dys, g.dyr, true);
  for_each_segment(r, [&](int l, std::int64_t at, int n) {
    const auto rowsC = [&](const K::Vec<T>& v) { return slice(v, at * C, std::int64_t(n) * C); };
    const auto rowsF = [&](const K::Vec<T>& v) { return slice(v, at * Fl, std::int64_t(n) * Fl); };
    profile::region("matmul", [&] {
      K::matmul_backward<T, G>(
          rowsF(g.dh), slice(dproj_w, std::int64_t(l) * C * Fl, std::int64_t(C) * Fl),
          slice(dproj_b, std::int64_t(l) * C, C), rowsC(g.dyr), rowsF(a.fch_gelu),
          slice(proj_w, std::int64_t(l) * C * Fl, std::int64_t(C) * Fl), n, Fl, C);
    });
    profile::region("gelu", [&] {
      K::gelu_backward<T>(rowsF(g.dpre), rowsF(a.fch), rowsF(g.dh), std::size_t(n) * Fl);
    });
    profile::region("matmul", [&] {
      K::matmul_backward<T, G>(
          rowsC(g.dxr), slice(dfc_w, std::int64_t(l) * Fl * C, std::int64_t(Fl) * C),
          slice(dfc_b, std::int64_t(l) * Fl, Fl), rowsF(g.dpre), rowsC(a.xr),
          slice(fc_w, std::int64_t(l) * Fl * C, std::int64_t(Fl) * C), n, C, Fl);
    });
  });
  exchange(r, g.dxr, dxs, false);
  profile::region("moe-combine",
                  [&] { K::combine_rows<T>(dx, dxs, r.rows_dev, K::CVec<T>(), BT, k, C, false); });

  // The router: the gates' gradient through their renormalisation, plus aux's
  // d(aux)/d(p_te) = aux_coef * E * f_e / N for every token (f is not differentiated).
  const std::vector<double> p = to_host(a.probs, std::int64_t(BT) * E),
                            dg = to_host(g.dgates, std::int64_t(BT) * k);
  const double N = double(c.ring() ? c.BT * c.cp->size() : c.BT);
  std::vector<double> dp(std::size_t(BT) * E);
  for (int t = 0; t < BT; ++t) {
    double* d = dp.data() + std::size_t(t) * E;
    for (int e = 0; e < E; ++e) d[e] = aux_scale * aux_coef * E * r.f[std::size_t(e)] / N;
    const int* chosen = r.expert.data() + std::size_t(t) * k;
    double s = 0, dot = 0;
    for (int j = 0; j < k; ++j) s += p[std::size_t(t) * E + std::size_t(chosen[j])];
    for (int j = 0; j < k; ++j)
      dot += dg[std::size_t(t) * k + std::size_t(j)] *
             p[std::size_t(t) * E + std::size_t(chosen[j])] / s;
    for (int j = 0; j < k; ++j) d[chosen[j]] += (dg[std::size_t(t) * k + std::size_t(j)] - dot) / s;
  }
  to_device(g.dprobs, dp);
  profile::region("moe-router", [&] {
    K::softmax_rows_backward<T>(g.dlogits, a.probs, g.dprobs, BT, E);
    // Every tp rank computes the same router gradient; d(x) through the router is added
    // once, by tp rank 0, before the experts' partial sums are reduced.
    K::matmul_backward<T, G>(c.tp->rank() == 0 ? dx : K::Vec<T>(), drouter, K::Vec<G>(), g.dlogits,
                             x, router, BT, C, E, /*accumulate_dinp=*/true);
  });
  const K::Vec<T> mine = c.tp->sp() ? rows : dx;
  c.tp->sum_to_rows(dx, mine);
  return mine;
}

// Rows between send order (this rank's tokens, by destination) and receive order (the
// experts' inputs here, by source): all-to-allv over ep; nothing to move without ep.
template <class P>
void MoE<P>::exchange(const Routing& r, K::Vec<T> from, K::Vec<T> to, bool to_experts) const {
  if (!ep || ep->size() == 1) return;
  const std::vector<int> sent = per_rank(r.send_counts, El, C),
                         got = per_rank(r.recv_counts, El, C);
  ep->all_to_allv(from.data(), to_experts ? sent : got, to.data(), to_experts ? got : sent).wait();
}

// f(local expert, first row, rows) for each non-empty (source rank, local expert) block of
// the receive order.
template <class P>
template <class F>
void MoE<P>::for_each_segment(const Routing& r, F&& f) const {
  std::int64_t at = 0;
  for (std::size_t seg = 0; seg < r.recv_counts.size(); ++seg) {
    const int n = r.recv_counts[seg];
    if (n > 0) f(int(seg) % El, at, n);
    at += n;
  }
}

template struct MoE<Fp32>;
template struct MoE<Fp64>;
template struct MoE<Bf16>;
template struct MoE<Bf16Grads>;

}  // namespace ptrain::model
