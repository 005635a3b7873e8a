#include "parallel/pipeline.hpp"

#include <algorithm>
#include <chrono>
#include <thread>

#include "kernels/kernels.hpp"
#include "util/error.hpp"
#include "util/timer.hpp"
#include "util/trace.hpp"

namespace ptrain::parallel {

namespace K = kernels;

namespace {

template <class T>
K::Vec<T> head_of(const K::Vec<T>& v, std::int64_t n) {
  return Kokkos::subview(v, Kokkos::make_pair(std::int64_t(0), n));
}

// A compute as a run%trace event: "F3" forward, "B3" backward (whole, or a split one's B),
// "W3" weight (".1" for chunk 1 of several).
void trace_op(OpKind kind, int mb, int chunk, int chunks, double t0) {
  if (!trace::enabled()) return;
  Kokkos::fence();
  const bool f = kind == OpKind::forward, w = kind == OpKind::backward_weight;
  trace::record(cat(f   ? "F"
                    : w ? "W"
                        : "B",
                    mb, chunks > 1 ? cat(".", chunk) : std::string()),
                f   ? "forward"
                : w ? "weight"
                    : "backward",
                t0, wall_seconds());
}

}  // namespace

template <class P>
PipelineExecutor<P>::PipelineExecutor(Comm& pp, std::vector<Chunk> chunks, OpList ops,
                                      int micro_batch, bool v_shape)
    : pp_(pp),
      chunks_(std::move(chunks)),
      ops_(std::move(ops)),
      P_(pp.size()),
      rank_(pp.rank()),
      micro_batch_(micro_batch),
      v_shape_(v_shape) {
  const int v = int(chunks_.size());
  int m = 0;
  for (const Op& op : ops_) m = std::max(m, op.mb + 1);
  slot_of_.assign(std::size_t(v), std::vector<int>(std::size_t(m), -1));
  free_slots_.resize(std::size_t(v));
  last_input_.assign(std::size_t(v), -1);
  last_weight_.assign(std::size_t(v), -1);
  for (std::size_t i = 0; i < ops_.size(); ++i) {
    const OpKind k = ops_[i].kind;
    if (k == OpKind::backward || k == OpKind::backward_input)
      last_input_[std::size_t(ops_[i].chunk)] = int(i);
    if (k == OpKind::backward || k == OpKind::backward_weight)
      last_weight_[std::size_t(ops_[i].chunk)] = int(i);
  }
  for (int c = 0; c < v; ++c)
    for (int s = chunks_[std::size_t(c)].stage->slots() - 1; s >= 0; --s)
      free_slots_[std::size_t(c)].push_back(s);
}

template <class P>
std::int64_t PipelineExecutor<P>::elements(int samples) const {
  return std::int64_t(chunks_.front().stage->input(0, samples).extent(0));
}

template <class P>
int PipelineExecutor<P>::tag(bool grad, int mb, int receiver_chunk) const {
  return 2 * (mb * int(chunks_.size()) + receiver_chunk) + (grad ? 1 : 0);
}

template <class P>
int PipelineExecutor<P>::take_buffer() {
  if (free_buffers_.empty()) {
    reap_sends(false);
    if (free_buffers_.empty()) {
      buffers_.emplace_back(MemCategory::comm, "ptrain::pipeline_message",
                            std::size_t(elements(micro_batch_)));
      return int(buffers_.size()) - 1;
    }
  }
  const int b = free_buffers_.back();
  free_buffers_.pop_back();
  return b;
}

template <class P>
void PipelineExecutor<P>::post_recv(bool grad, int mb, int chunk, int peer, int samples) {
  Message msg;
  msg.buffer = take_buffer();
  msg.request = pp_.recv(buffers_[std::size_t(msg.buffer)].data(), std::size_t(elements(samples)),
                         peer, tag(grad, mb, chunk));
  recvs_[tag(grad, mb, chunk)] = std::move(msg);
}

template <class P>
auto PipelineExecutor<P>::wait_recv(bool grad, int mb, int chunk, int samples) -> K::Vec<T> {
  auto it = recvs_.find(tag(grad, mb, chunk));
  PTRAIN_REQUIRE(it != recvs_.end(), "pipeline: ", grad ? "gradient" : "activation",
                 " of micro-batch ", mb, " for chunk ", chunk, " was never received (schedule)");
  it->second.request.wait();
  return head_of(buffers_[std::size_t(it->second.buffer)].view(), elements(samples));
}

template <class P>
void PipelineExecutor<P>::release_recv(bool grad, int mb, int chunk) {
  auto it = recvs_.find(tag(grad, mb, chunk));
  free_buffers_.push_back(it->second.buffer);
  recvs_.erase(it);
}

template <class P>
void PipelineExecutor<P>::release_slot(int chunk, int mb) {
  int& slot = slot_of_[std::size_t(chunk)][std::size_t(mb)];
  free_slots_[std::size_t(chunk)].push_back(slot);
  slot = -1;
}

template <class P>
void PipelineExecutor<P>::send(bool grad, int mb, int chunk, int peer, const K::Vec<T>& data) {
  // The receiving chunk: the next global chunk for an activation, the previous for a gradient.
  const int to = place(global(chunk) + (grad ? -1 : 1)).chunk;
  Message msg;
  msg.buffer = take_buffer();
  auto buf = head_of(buffers_[std::size_t(msg.buffer)].view(), std::int64_t(data.extent(0)));
  K::copy<T>(buf, data);
  Kokkos::fence();  // the copy is complete before MPI reads the buffer
  msg.request = pp_.send(buf.data(), buf.extent(0), peer, tag(grad, mb, to));
  sends_.push_back(std::move(msg));
}

template <class P>
void PipelineExecutor<P>::reap_sends(bool all) {
  auto done = [&](Message& m) {
    if (!(all || m.request.test())) return false;
    m.request.wait();
    free_buffers_.push_back(m.buffer);
    return true;
  };
  sends_.erase(std::remove_if(sends_.begin(), sends_.end(), done), sends_.end());
}

template <class P>
void PipelineExecutor<P>::forward(int mb, int chunk, const MicroBatches& mbs, bool for_backward) {
  model::Stage<P>& stage = *chunks_[std::size_t(chunk)].stage;
  auto& free = free_slots_[std::size_t(chunk)];
  PTRAIN_REQUIRE(!free.empty(), "pipeline: no free activation slot on chunk ", chunk,
                 " for micro-batch ", mb, " (the schedule keeps more in flight than checked)");
  const int slot = free.back();
  free.pop_back();
  auto& slots = slot_of_[std::size_t(chunk)];
  if (std::size_t(mb) >= slots.size()) slots.resize(std::size_t(mb) + 1, -1);
  slots[std::size_t(mb)] = slot;
  const int B = mbs.samples(mb);
  if (global(chunk) > 0) {
    K::copy<T>(stage.input(slot, B), wait_recv(false, mb, chunk, B));
    release_recv(false, mb, chunk);
  }
  const bool tokens = stage.layout().has_embedding || stage.layout().has_head;
  const model::MicroBatch batch = tokens ? mbs.fetch(mb) : model::MicroBatch{nullptr, nullptr, B};
  const double t0 = wall_seconds(), blocked = exposed_seconds();
  const double loss = stage.forward(slot, batch, for_backward);
  Kokkos::fence();
  if (slow_down_ > 0)
    std::this_thread::sleep_for(std::chrono::duration<double>(slow_down_ * (wall_seconds() - t0)));
  seconds_.forward += wall_seconds() - t0;
  seconds_.forward_blocked += exposed_seconds() - blocked;
  trace_op(OpKind::forward, mb, chunk, int(chunks_.size()), t0);
  if (std::size_t(mb) >= losses_.size()) losses_.resize(std::size_t(mb) + 1, 0.0);
  losses_[std::size_t(mb)] += loss;
}

template <class P>
void PipelineExecutor<P>::backward(std::size_t i, const MicroBatches& mbs, A dloss) {
  const Op& op = ops_[i];
  Chunk& ch = chunks_[std::size_t(op.chunk)];
  const int slot = slot_of_[std::size_t(op.chunk)][std::size_t(op.mb)];
  const bool weight = op.kind == OpKind::backward_weight;
  // A W reads no message; a backward or B its d(output), except on the last stage.
  const bool dout_message = !weight && global(op.chunk) < last_global();
  K::CVec<T> dout;
  if (dout_message) dout = wait_recv(true, op.mb, op.chunk, mbs.samples(op.mb));
  const int last = op.kind == OpKind::backward_input ? last_input_[std::size_t(op.chunk)]
                                                     : last_weight_[std::size_t(op.chunk)];
  ch.dp->begin_micro_batch(int(i) == last);
  const double t0 = wall_seconds(), blocked = exposed_seconds();
  if (op.kind == OpKind::backward) ch.stage->backward(slot, dloss, dout);
  if (op.kind == OpKind::backward_input) ch.stage->backward_input(slot, dloss, dout);
  if (weight) ch.stage->backward_weight(slot);
  Kokkos::fence();
  seconds_.backward += wall_seconds() - t0;
  seconds_.backward_blocked += exposed_seconds() - blocked;
  trace_op(op.kind, op.mb, op.chunk, int(chunks_.size()), t0);
  if (dout_message) release_recv(true, op.mb, op.chunk);
  // The micro-batch's activations are done with its weight gradient.
  if (op.kind != OpKind::backward_input) release_slot(op.chunk, op.mb);
}

template <class P>
auto PipelineExecutor<P>::take_compute_seconds() -> ComputeSeconds {
  const ComputeSeconds t = seconds_;
  seconds_ = {};
  return t;
}

template <class P>
double PipelineExecutor<P>::train(const MicroBatches& mbs, A dloss) {
  losses_.assign(std::size_t(mbs.count), 0.0);
  op_seconds_.clear();
  input_wait_s_ = 0;
  double since = wall_seconds(), waited = pp_.stats().exposed_s;  // at the last compute's end
  const auto compute_done = [&] {
    const double now = wall_seconds(), waits = pp_.stats().exposed_s;
    op_seconds_.push_back(std::max(0.0, (now - since) - (waits - waited)));
    input_wait_s_ += waits - waited;
    since = now, waited = waits;
  };
  for (std::size_t i = 0; i < ops_.size(); ++i) {
    const Op& op = ops_[i];
    const int B = mbs.samples(op.mb);
    switch (op.kind) {
      case OpKind::recv_act:
        post_recv(false, op.mb, op.chunk, op.peer, B);
        break;
      case OpKind::recv_grad:
        post_recv(true, op.mb, op.chunk, op.peer, B);
        break;
      case OpKind::forward:
        forward(op.mb, op.chunk, mbs, true);
        compute_done();
        break;
      case OpKind::send_act: {
        const int slot = slot_of_[std::size_t(op.chunk)][std::size_t(op.mb)];
        send(false, op.mb, op.chunk, op.peer, chunks_[std::size_t(op.chunk)].stage->output(slot));
        break;
      }
      case OpKind::backward:
      case OpKind::backward_input:
      case OpKind::backward_weight:
        backward(i, mbs, dloss);
        compute_done();
        break;
      case OpKind::send_grad:
        send(true, op.mb, op.chunk, op.peer, chunks_[std::size_t(op.chunk)].stage->input_grad());
        break;
    }
    reap_sends(false);  // lets MPI progress the messages in flight
  }
  reap_sends(true);
  PTRAIN_REQUIRE(recvs_.empty(), "pipeline: ", recvs_.size(), " messages received but never used");
  double loss = 0;
  for (double l : losses_) loss += l;
  return loss;
}

template <class P>
std::vector<double> PipelineExecutor<P>::forward_only(const MicroBatches& mbs) {
  losses_.assign(std::size_t(mbs.count), 0.0);
  const int v = int(chunks_.size());
  for (int mb = 0; mb < mbs.count; ++mb)
    for (int c = 0; c < v; ++c) {
      const int g = global(c), B = mbs.samples(mb);
      if (g > 0) post_recv(false, mb, c, place(g - 1).rank, B);
      forward(mb, c, mbs, false);
      if (g < last_global()) {
        const int slot = slot_of_[std::size_t(c)][std::size_t(mb)];
        send(false, mb, c, place(g + 1).rank, chunks_[std::size_t(c)].stage->output(slot));
      }
      release_slot(c, mb);
      reap_sends(false);
    }
  reap_sends(true);
  return losses_;
}

template class PipelineExecutor<Fp32>;
template class PipelineExecutor<Fp64>;
template class PipelineExecutor<Bf16>;
template class PipelineExecutor<Bf16Grads>;

}  // namespace ptrain::parallel
