// model/moe.hpp — the mixture-of-experts layer in a block's MLP slot (docs/ARCHITECTURE.md,
// "The model"): a router (linear, softmax, the top_k experts of each token, gates
// renormalised over them), experts that are GELU MLPs split over tp like the dense one, a
// capacity per expert and micro-batch, and the Switch load-balancing loss
//   aux = aux_loss_coef * E * sum_e f_e P_e
// (f_e: the share of the micro-batch's token choices that picked e, P_e: e's mean router
// probability). Routing is deterministic and the same on every grid: ties go to the lower
// expert index, and an expert's capacity ceil(capacity_factor * top_k * N / E) over the N
// tokens of the micro-batch is filled in token order (sample, then sequence position; a
// token's choices in gate order). A token past capacity contributes nothing for that choice
// (it passes the residual); evaluation forwards are dropless. Tokens travel to the ep rank that
// owns their expert and back with all-to-all(v) over the ep group; with context parallelism the
// micro-batch's tokens are spread over the cp group, which takes part in the capacity order and in
// f and P.
#pragma once
#include <cstdint>
#include <vector>

#include "comm/comm.hpp"
#include "kernels/view.hpp"
#include "model/activations.hpp"
#include "util/element_types.hpp"

namespace ptrain::model {

struct Ctx;

// One micro-batch's routing through one MoE layer, kept (per activation slot) for the
// backward. Rows are in "send order": by destination ep rank, then its local expert, then
// token order.
struct Routing {
  std::vector<int> expert;                    // (BT, k) the chosen experts, in gate order
  std::vector<int> row;                       // (BT, k) send row of each choice, -1 when dropped
  std::vector<int> send_token;                // (rows sent) the token of each send row
  std::vector<int> send_counts, recv_counts;  // (ep * El): rows per (rank, local expert)
  std::vector<double> f;           // (E) share of the micro-batch's token choices that picked e
  double aux = 0;                  // this micro-batch's load-balancing loss, aux_loss_coef included
  std::vector<std::int64_t> load;  // (E) choices kept per expert, among this rank's tokens
  std::int64_t dropped = 0, choices = 0;        // among this rank's tokens
  Kokkos::View<int*> rows_dev, send_token_dev;  // row and send_token on the device
};

template <class P>
struct MoE {
  PTRAIN_POLICY_TYPES(P);
  kernels::Vec<T> router;                          // (E, C), replicated over tp
  kernels::Vec<G> drouter;                         // its gradient
  kernels::Vec<T> fc_w, fc_b, proj_w, proj_b;      // (El, Fl, C), (El, Fl), (El, C, Fl), (El, C)
  kernels::Vec<G> dfc_w, dfc_b, dproj_w, dproj_b;  // their gradients (empty: forward only)
  int C = 0, Fl = 0, E = 0, El = 0, k = 0;         // El = E / ep, this rank's experts
  double capacity_factor = 0, aux_coef = 0;
  double aux_scale = 1;  // d(objective)/d(aux) of one micro-batch: 1 / micro-batches per step
  Comm* ep = nullptr;    // null or size 1: every expert here

  using Acts = MoeActs<kernels::Vec<T>>;
  using Grads = MoeScratch<kernels::Vec<T>>;
  // x (BT, C) with this rank's rows in place (gathered over tp under SP); y (R, C) [=] the
  // gated sum of the chosen experts' outputs. Fills `r`; `partial` (BT, C) is scratch.
  void forward(const Ctx& c, kernels::Vec<T> x, const Acts& a, Routing& r, kernels::Vec<T> partial,
               kernels::Vec<T> y) const;
  // dy (R, C) -> d(x) rows (R, C), like ColumnParallelLinear::backward: `full` (BT, C) and
  // dx (BT, C) are scratch, rows (R, C) under SP; the router's gradient includes aux's.
  kernels::Vec<T> backward(const Ctx& c, kernels::CVec<T> x, const Acts& a, const Routing& r,
                           kernels::Vec<T> dy, const Grads& g, kernels::Vec<T> full,
                           kernels::Vec<T> dx, kernels::Vec<T> rows) const;

 private:
  void exchange(const Routing& r, kernels::Vec<T> from, kernels::Vec<T> to, bool to_experts) const;
  template <class F>
  void for_each_segment(const Routing& r, F&& f) const;
};

}  // namespace ptrain::model
