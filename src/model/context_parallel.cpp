#include "model/context_parallel.hpp"

#include <algorithm>
#include <limits>

#include "kernels/attention.hpp"
#include "kernels/kernels.hpp"
#include "util/error.hpp"
#include "util/memory.hpp"
#include "util/profile.hpp"
#include "util/staging.hpp"

namespace ptrain::model {

namespace K = kernels;

ContextParallel::ContextParallel(Comm* cp, std::int64_t seq_len, bool zigzag)
    : comm_(cp && cp->size() > 1 ? cp : nullptr) {
  const int C = comm_ ? comm_->size() : 1;
  rank_ = comm_ ? comm_->rank() : 0;
  for (int r = 0; r < C; ++r) pieces_.push_back(sequence_pieces(seq_len, r, C, zigzag));
  local_len_ = int(seq_len / C);
  if (!comm_) return;
  const std::vector<int> pos = sequence_positions(pieces());
  positions_ = Kokkos::View<int*>("ptrain::cp_positions", pos.size());
  staging::from_host(positions_, pos.data(), pos.size());
}

namespace {

// Message tags on the cp group: K/V blocks, and the dK/dV accumulators of the backward.
constexpr int kTagKV = 0, kTagDKV = 1;

using kernels::slice;

// The heads of piece p in rows (B, L, ld) of buf, from column col: the kernel's view of one
// sequence chunk of every sample.
template <class T>
K::Heads<T> piece_heads(const K::Vec<T>& buf, const SeqPiece& p, int L, int ld, int col) {
  return K::Heads<T>(buf, std::size_t(p.local) * ld + std::size_t(col), ld, std::size_t(L) * ld);
}
template <class T>
K::Heads<const T> piece_heads(const K::CVec<T>& buf, const SeqPiece& p, int L, int ld, int col) {
  return K::Heads<const T>(buf, std::size_t(p.local) * ld + std::size_t(col), ld,
                           std::size_t(L) * ld);
}

// Causal: a key piece wholly after the query piece contributes nothing.
bool in_future(const SeqPiece& q, const SeqPiece& k) { return k.global > q.global + q.len - 1; }

K::AttentionConfig piece_config(const SeqPiece& q, const SeqPiece& k) {
  K::AttentionConfig cfg;
  cfg.q_pos0 = q.global;
  cfg.k_pos0 = k.global;
  return cfg;
}

// What every ring step needs: shapes, the group and this rank's neighbours.
struct Ring {
  const ContextParallel& cp;
  int B, NH, HS, Cl, L, C, next, prev;
  Ring(const ContextParallel& c, int B_, int NH_, int HS_)
      : cp(c),
        B(B_),
        NH(NH_),
        HS(HS_),
        Cl(NH_ * HS_),
        L(c.local_len()),
        C(c.size()),
        next((c.rank() + 1) % c.size()),
        prev((c.rank() + c.size() - 1) % c.size()) {}
  std::int64_t rows() const { return std::int64_t(B) * L; }
  std::int64_t kv_numel() const { return rows() * 2 * Cl; }  // a packed K/V block (B, L, 2Cl)
  int owner(int step) const { return (cp.rank() + C - step) % C; }  // whose block at `step`
  // Columns [Cl, 3Cl) of qkv rows (K and V) [=] into a packed block, or back.
  template <class T>
  void pack_kv(K::Vec<T> kv, K::CVec<T> qkv) const {
    K::copy_strided<T>(kv, {0, 0, std::size_t(2 * Cl)}, qkv,
                       {std::size_t(Cl), 0, std::size_t(3 * Cl)}, 1, int(rows()), 2 * Cl);
  }
  template <class T>
  void unpack_kv(K::Vec<T> qkv, K::CVec<T> kv) const {
    K::copy_strided<T>(qkv, {std::size_t(Cl), 0, std::size_t(3 * Cl)}, kv,
                       {0, 0, std::size_t(2 * Cl)}, 1, int(rows()), 2 * Cl);
  }
  // Piece p of rows (B, L, width) [<->] a dense (B, p.len, width) buffer.
  K::Strided in_rows(const SeqPiece& p, int width) const {
    return {std::size_t(p.local) * width, std::size_t(L) * width, std::size_t(width)};
  }
  static K::Strided dense(const SeqPiece& p, int width) {
    return {0, std::size_t(p.len) * width, std::size_t(width)};
  }
};

// Elements of the dense per-piece buffers of rows (B, len, width), one after another.
std::int64_t piece_numel(const std::vector<SeqPiece>& pieces, std::int64_t B, int width) {
  std::int64_t n = 0;
  for (const SeqPiece& p : pieces) n += B * p.len * width;
  return n;
}

// Dense copies of this rank's pieces of out and dout (B, len, Cl) and of lse (B, NH, len), as
// the kernel reads them, carved from w (out, dout per piece) and st (lse per piece).
template <class T>
struct PieceCopy {
  K::Vec<T> out, dout;
  K::Vec<accumulate_t<T>> lse;
};
template <class T>
std::vector<PieceCopy<T>> piece_copies(const Ring& ring, const std::vector<SeqPiece>& mine,
                                       K::CVec<T> out, K::CVec<T> dout,
                                       K::CVec<accumulate_t<T>> lse, const K::Vec<T>& w,
                                       const K::Vec<accumulate_t<T>>& st) {
  using A = accumulate_t<T>;
  const int B = ring.B, NH = ring.NH, Cl = ring.Cl, L = ring.L;
  std::vector<PieceCopy<T>> copies;
  std::int64_t at = 0, at_lse = 0;
  for (const SeqPiece& p : mine) {
    const std::int64_t n = std::int64_t(B) * p.len * Cl;
    PieceCopy<T> c{slice(w, at, n), slice(w, at + n, n),
                   slice(st, at_lse, std::int64_t(B) * NH * p.len)};
    K::copy_strided<T>(c.out, Ring::dense(p, Cl), out, ring.in_rows(p, Cl), B, p.len, Cl);
    K::copy_strided<T>(c.dout, Ring::dense(p, Cl), dout, ring.in_rows(p, Cl), B, p.len, Cl);
    K::copy_strided<A>(c.lse, {0, std::size_t(p.len), 0}, lse,
                       {std::size_t(p.local), std::size_t(L), 0}, B * NH, 1, p.len);
    copies.push_back(c);
    at += 2 * n;
    at_lse += std::int64_t(B) * NH * p.len;
  }
  return copies;
}

}  // namespace

template <class T>
void ring_attention_forward(const ContextParallel& cp, int B, int NH, int HS, K::CVec<T> qkv,
                            K::Vec<T> out, K::Vec<accumulate_t<T>> lse) {
  using A = accumulate_t<T>;
  const Ring ring(cp, B, NH, HS);
  const std::vector<SeqPiece>& mine = cp.pieces();
  const int Cl = ring.Cl, L = ring.L;
  int longest = 0;
  for (const SeqPiece& p : mine) longest = std::max(longest, p.len);
  // workspace: two K/V blocks (the one in use, the one arriving) | per-piece merged output
  // (B, len, Cl) | one call's output; and in the accumulate type, per-piece lse (B, NH, len) |
  // one call's lse
  const std::int64_t kv = ring.kv_numel(), acc = piece_numel(mine, B, Cl),
                     one = std::int64_t(B) * longest * Cl;
  TrackedView<T> work(MemCategory::workspace, "ptrain::ring_attention",
                      std::size_t(2 * kv + acc + one));
  TrackedView<A> stats(MemCategory::workspace, "ptrain::ring_attention_lse",
                       std::size_t(piece_numel(mine, B, NH) + std::int64_t(B) * longest * NH));
  const K::Vec<T> w = work.view();
  const K::Vec<A> st = stats.view();
  const K::Vec<T> blocks[2] = {slice(w, 0, kv), slice(w, kv, kv)};
  std::vector<K::Vec<T>> acc_out;
  std::vector<K::Vec<A>> acc_lse;
  std::int64_t at = 2 * kv, at_lse = 0;
  for (const SeqPiece& p : mine) {
    acc_out.push_back(slice(w, at, std::int64_t(B) * p.len * Cl));
    acc_lse.push_back(slice(st, at_lse, std::int64_t(B) * NH * p.len));
    at += std::int64_t(B) * p.len * Cl;
    at_lse += std::int64_t(B) * NH * p.len;
  }
  const K::Vec<T> one_out = slice(w, at, std::int64_t(B) * longest * Cl);
  const K::Vec<A> one_lse = slice(st, at_lse, std::int64_t(B) * NH * longest);
  ring.pack_kv<T>(blocks[0], qkv);

  std::vector<bool> filled(mine.size(), false);
  for (int step = 0; step < ring.C; ++step) {
    const K::Vec<T> held = blocks[step % 2];
    Request send, recv;
    if (step + 1 < ring.C) {  // the next block arrives while this one is used
      recv = cp.comm().recv(blocks[(step + 1) % 2].data(), std::size_t(kv), ring.prev, kTagKV);
      send = cp.comm().send(held.data(), std::size_t(kv), ring.next, kTagKV);
    }
    profile::region("attention", [&] {
      for (std::size_t qi = 0; qi < mine.size(); ++qi)
        for (const SeqPiece& kp : cp.pieces(ring.owner(step))) {
          const SeqPiece& qp = mine[qi];
          if (in_future(qp, kp)) continue;
          const K::AttentionConfig cfg = piece_config(qp, kp);
          cp.count_pairs(std::int64_t(B) * NH * K::attention_pairs(qp.len, kp.len, cfg));
          // The first result for a piece goes straight to its accumulator; later ones merge.
          const K::Vec<T> o = filled[qi] ? one_out : acc_out[qi];
          const K::Vec<A> l = filled[qi] ? one_lse : acc_lse[qi];
          K::attention_forward<T>(o, l, piece_heads<T>(qkv, qp, L, 3 * Cl, 0),
                                  piece_heads<T>(K::CVec<T>(held), kp, L, 2 * Cl, 0),
                                  piece_heads<T>(K::CVec<T>(held), kp, L, 2 * Cl, Cl), B, qp.len,
                                  kp.len, NH, HS, cfg);
          if (filled[qi]) K::attention_merge<T>(acc_out[qi], acc_lse[qi], o, l, B, qp.len, NH, HS);
          filled[qi] = true;
          recv.test();  // lets the library move the next block between kernels
        }
    });
    recv.wait();
    send.wait();
  }
  for (std::size_t qi = 0; qi < mine.size(); ++qi) {
    const SeqPiece& p = mine[qi];
    PTRAIN_REQUIRE(filled[qi], "ring attention: piece at ", p.global, " saw no keys");
    K::copy_strided<T>(out, ring.in_rows(p, Cl), acc_out[qi], Ring::dense(p, Cl), B, p.len, Cl);
    // lse (B*NH, L): the piece's columns of every (b, h) row
    K::copy_strided<A>(lse, {std::size_t(p.local), std::size_t(L), 0}, acc_lse[qi],
                       {0, std::size_t(p.len), 0}, B * NH, 1, p.len);
  }
}

template <class T>
void ring_attention_backward(const ContextParallel& cp, int B, int NH, int HS, K::CVec<T> qkv,
                             K::CVec<T> out, K::CVec<accumulate_t<T>> lse, K::CVec<T> dout,
                             K::Vec<T> dqkv) {
  using A = accumulate_t<T>;
  const Ring ring(cp, B, NH, HS);
  const std::vector<SeqPiece>& mine = cp.pieces();
  const int Cl = ring.Cl, L = ring.L;
  // workspace: two K/V blocks | two dK/dV accumulators being sent on | the one arriving |
  // per-piece copies of out and dout (B, len, Cl), and of lse (B, NH, len) in the accumulate
  // type, as the kernel reads them
  const std::int64_t kv = ring.kv_numel(), per_piece = piece_numel(mine, B, 2 * Cl);
  TrackedView<T> work(MemCategory::workspace, "ptrain::ring_attention_backward",
                      std::size_t(5 * kv + per_piece));
  TrackedView<A> stats(MemCategory::workspace, "ptrain::ring_attention_backward_lse",
                       std::size_t(piece_numel(mine, B, NH)));
  const K::Vec<T> w = work.view();
  const K::Vec<A> st = stats.view();
  const K::Vec<T> blocks[2] = {slice(w, 0, kv), slice(w, kv, kv)};
  const K::Vec<T> sums[2] = {slice(w, 2 * kv, kv), slice(w, 3 * kv, kv)};
  const K::Vec<T> arriving = slice(w, 4 * kv, kv);
  const std::vector<PieceCopy<T>> copies =
      piece_copies<T>(ring, mine, out, dout, lse, slice(w, 5 * kv, per_piece), st);
  profile::region("zero-fill", [&] { K::fill(dqkv, T(0)); });
  ring.pack_kv<T>(blocks[0], qkv);

  Request sent[2];  // the dK/dV accumulators on their way to the next rank
  for (int step = 0; step < ring.C; ++step) {
    const K::Vec<T> held = blocks[step % 2], sum = sums[step % 2];
    Request send, recv, partial;
    if (step + 1 < ring.C) {
      recv = cp.comm().recv(blocks[(step + 1) % 2].data(), std::size_t(kv), ring.prev, kTagKV);
      send = cp.comm().send(held.data(), std::size_t(kv), ring.next, kTagKV);
    }
    // The held block's dK/dV from the ranks it visited before this one.
    if (step > 0) partial = cp.comm().recv(arriving.data(), std::size_t(kv), ring.prev, kTagDKV);
    sent[step % 2].wait();
    profile::region("attention", [&] {
      K::fill(sum, T(0));
      for (std::size_t qi = 0; qi < mine.size(); ++qi)
        for (const SeqPiece& kp : cp.pieces(ring.owner(step))) {
          const SeqPiece& qp = mine[qi];
          if (in_future(qp, kp)) continue;
          K::attention_backward<T>(
              piece_heads<T>(dqkv, qp, L, 3 * Cl, 0), piece_heads<T>(sum, kp, L, 2 * Cl, 0),
              piece_heads<T>(sum, kp, L, 2 * Cl, Cl), copies[qi].dout, copies[qi].out,
              copies[qi].lse, piece_heads<T>(qkv, qp, L, 3 * Cl, 0),
              piece_heads<T>(K::CVec<T>(held), kp, L, 2 * Cl, 0),
              piece_heads<T>(K::CVec<T>(held), kp, L, 2 * Cl, Cl), B, qp.len, kp.len, NH, HS,
              piece_config(qp, kp), true);
          recv.test();
          partial.test();
        }
    });
    if (step > 0) {
      partial.wait();
      profile::region("attention", [&] { K::axpy<T>(sum, A(1), arriving); });
    }
    // On to the next rank; after the last step that is the block's owner.
    sent[step % 2] = cp.comm().send(sum.data(), std::size_t(kv), ring.next, kTagDKV);
    recv.wait();
    send.wait();
  }
  // This rank's own block, with every rank's contribution, comes home from the previous one.
  cp.comm().recv(arriving.data(), std::size_t(kv), ring.prev, kTagDKV).wait();
  ring.unpack_kv<T>(dqkv, arriving);
  sent[0].wait();
  sent[1].wait();
}

#define PTRAIN_RING_INSTANTIATE(T)                                                            \
  template void ring_attention_forward<T>(const ContextParallel&, int, int, int, K::CVec<T>,  \
                                          K::Vec<T>, K::Vec<accumulate_t<T>>);                \
  template void ring_attention_backward<T>(const ContextParallel&, int, int, int, K::CVec<T>, \
                                           K::CVec<T>, K::CVec<accumulate_t<T>>, K::CVec<T>,  \
                                           K::Vec<T>);
PTRAIN_RING_INSTANTIATE(float)
PTRAIN_RING_INSTANTIATE(double)
PTRAIN_RING_INSTANTIATE(bf16)
#undef PTRAIN_RING_INSTANTIATE

}  // namespace ptrain::model
