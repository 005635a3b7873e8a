// model/context_parallel.hpp — context parallelism (docs/ARCHITECTURE.md, "The model"): each
// sequence is cut over the cp group (model/layout.hpp's sequence_pieces: zigzag or contiguous), and
// attention becomes a ring. K/V blocks travel round the group in C-1 steps while each rank
// attends its queries to the block it holds; the partial results are merged exactly with
// the log-sum-exp. Causal masking is by global position: block pairs wholly in the future
// are skipped, diagonal ones masked. The backward runs the same ring, recomputing the
// probabilities from the saved (merged) log-sum-exp; each block's dK/dV accumulates as it
// travels and takes one last hop home. The next block's transfer overlaps this block's work.
#pragma once
#include <cstdint>
#include <vector>

#include "comm/comm.hpp"
#include "kernels/view.hpp"
#include "model/layout.hpp"
#include "util/element_types.hpp"

namespace ptrain::model {

// The cp group as the layers use it. Without one (null, or of size 1) the rank holds whole
// sequences and attention is local.
class ContextParallel {
 public:
  ContextParallel() = default;
  // This rank's pieces of a seq_len sequence under `cp` (rank c of C), zigzag or contiguous.
  ContextParallel(Comm* cp, std::int64_t seq_len, bool zigzag);

  bool active() const { return comm_ != nullptr; }
  int rank() const { return rank_; }
  int size() const { return int(pieces_.size()); }
  int local_len() const { return local_len_; }  // positions of each sample held here
  const std::vector<SeqPiece>& pieces(int r) const { return pieces_.at(std::size_t(r)); }
  const std::vector<SeqPiece>& pieces() const { return pieces(rank_); }
  // (local_len) global position of each local row; empty without context parallelism.
  kernels::IntVec positions() const { return positions_; }
  Comm& comm() const { return *comm_; }

  // (query, key) pairs this rank's attention has scored: the causal work, which zigzag
  // balances over the group (the test of that balance reads it).
  std::int64_t attention_pairs() const { return pairs_; }
  void count_pairs(std::int64_t n) const { pairs_ += n; }

 private:
  Comm* comm_ = nullptr;
  int rank_ = 0, local_len_ = 0;
  std::vector<std::vector<SeqPiece>> pieces_;  // of every rank of the group
  Kokkos::View<int*> positions_;
  mutable std::int64_t pairs_ = 0;
};

// Attention of B samples over this rank's NH heads of size HS, on its local rows.
// qkv: (B*L, 3*NH*HS), L = local_len; out: (B*L, NH*HS) [=]; lse: (B, NH, L) [=].
template <class T>
void ring_attention_forward(const ContextParallel& cp, int B, int NH, int HS, kernels::CVec<T> qkv,
                            kernels::Vec<T> out, kernels::Vec<accumulate_t<T>> lse);
// dqkv: (B*L, 3*NH*HS) [=] from dout (B*L, NH*HS) and the forward's out and lse.
template <class T>
void ring_attention_backward(const ContextParallel& cp, int B, int NH, int HS, kernels::CVec<T> qkv,
                             kernels::CVec<T> out, kernels::CVec<accumulate_t<T>> lse,
                             kernels::CVec<T> dout, kernels::Vec<T> dqkv);

}  // namespace ptrain::model
