// parallel/pipeline.hpp — runs this rank's list of a pipeline schedule (parallel/schedule.hpp)
// over its chunks: forwards and backwards on the chunks' activation slots, activations and
// their gradients to and from the neighbouring stages with non-blocking point-to-point
// messages on the pp group. Receives are posted where the list posts them (ahead of the
// compute that needs them) and waited for only by that compute; sends leave from a copy, so
// the compute goes on while they travel. Every wait on the pp group is the pipeline bubble
// as this rank sees it (the comm table's exposed time of "pp").
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "comm/comm.hpp"
#include "model/stage.hpp"
#include "parallel/data_parallel.hpp"
#include "parallel/schedule.hpp"
#include "util/element_types.hpp"
#include "util/memory.hpp"

namespace ptrain::parallel {

// The micro-batches of one step (or validation pass) on this pipeline: how many, the
// samples of each (the same on every stage), and the tokens of micro-batch i (host arrays
// valid until the next call; stages without the embedding or the head ignore them).
struct MicroBatches {
  int count = 0;
  std::function<int(int)> samples;
  std::function<model::MicroBatch(int)> fetch;
};

template <class P>
class PipelineExecutor {
 public:
  PTRAIN_POLICY_TYPES(P);
  struct Chunk {
    model::Stage<P>* stage = nullptr;
    DataParallel<P>* dp = nullptr;  // told before each backward, B and W whether it is the last
  };
  // `pp`: the pipeline group (rank = stage); `chunks[c]` holds global chunk
  // model::global_chunk(P, v_shape, rank, c); `ops`: this rank's list for m micro-batches.
  // Message buffers are sized for `micro_batch`.
  PipelineExecutor(Comm& pp, std::vector<Chunk> chunks, OpList ops, int micro_batch,
                   bool v_shape = false);

  // One training step's forwards and backwards. Returns the sum of the token losses this
  // rank computed (the last stage's; 0 elsewhere). dloss is d(mean loss)/d(token loss).
  double train(const MicroBatches& mbs, A dloss);
  // Forwards only (validation), micro-batch after micro-batch through every chunk: the
  // token-loss sum of each micro-batch (the last stage's; 0 elsewhere).
  std::vector<double> forward_only(const MicroBatches& mbs);

  // Seconds in forwards and in backwards (B and W included) since the last call (waits for
  // pipeline messages excluded), and how much of each was spent blocked on other Comms inside
  // them (tp, cp and ep collectives, ZeRO 3 gathers): the difference is what the rank computed.
  struct ComputeSeconds {
    double forward = 0, backward = 0;
    double forward_blocked = 0, backward_blocked = 0;
  };
  ComputeSeconds take_compute_seconds();
  // run%debug_slow_rank: after each forward this rank sleeps `factor` times as long as the
  // forward took, counted as forward time (the straggler test).
  void slow_down(double factor) { slow_down_ = factor; }
  // The last train()'s computes in list order (forwards, backwards, Bs and Ws): each one's
  // wall time since the
  // previous compute ended (the first: since train() began) less the waits on the pp group
  // in it, so message copies and posts count with the compute they lead to. What the
  // schedule simulator replays to model this step's bubble.
  const std::vector<double>& compute_op_seconds() const { return op_seconds_; }
  // The last train()'s waits on the pp group before its last compute ended: this rank's
  // bubble. The waits after it (for its last sends to be taken) are not: the rank would
  // otherwise wait for its peers in the step's next collective anyway.
  double input_wait_seconds() const { return input_wait_s_; }

 private:
  struct Message {
    int buffer = -1;
    Request request;
  };
  int global(int chunk) const { return model::global_chunk(P_, v_shape_, rank_, chunk); }
  model::ChunkPlace place(int g) const { return model::chunk_place(P_, v_shape_, g); }
  int last_global() const { return int(chunks_.size()) * P_ - 1; }
  std::int64_t elements(int samples) const;  // of one activation message
  int tag(bool grad, int mb, int receiver_chunk) const;
  int take_buffer();
  void post_recv(bool grad, int mb, int chunk, int peer, int samples);
  kernels::Vec<T> wait_recv(bool grad, int mb, int chunk, int samples);
  void release_recv(bool grad, int mb, int chunk);  // its buffer back to the pool
  void release_slot(int chunk, int mb);             // the micro-batch's activations are done
  void send(bool grad, int mb, int chunk, int peer, const kernels::Vec<T>& data);
  void reap_sends(bool all);
  void forward(int mb, int chunk, const MicroBatches& mbs, bool for_backward);
  // A backward, B or W of op i: the data-parallel engine told whether it is the chunk's last.
  void backward(std::size_t i, const MicroBatches& mbs, A dloss);

  Comm& pp_;
  std::vector<Chunk> chunks_;
  OpList ops_;
  int P_ = 1, rank_ = 0, micro_batch_ = 0;
  bool v_shape_ = false;
  std::vector<std::vector<int>> slot_of_;     // [chunk][mb] -> activation slot, -1: none
  std::vector<std::vector<int>> free_slots_;  // per chunk
  // Per chunk, the op index of its last input gradient (backward or B) and of its last
  // weight gradient (backward or W): its data-parallel engine reduces from there on.
  std::vector<int> last_input_, last_weight_;
  std::vector<TrackedView<T>> buffers_;  // message buffers, reused
  std::vector<int> free_buffers_;
  std::map<int, Message> recvs_;  // by tag
  std::vector<Message> sends_;
  std::vector<double> losses_;  // per micro-batch
  ComputeSeconds seconds_;
  double slow_down_ = 0;
  std::vector<double> op_seconds_;
  double input_wait_s_ = 0;
};

}  // namespace ptrain::parallel
