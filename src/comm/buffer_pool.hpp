// comm/buffer_pool.hpp (private to comm/) — byte buffers in one Kokkos memory space, reused
// across operations: the staged transport's host copies, the hierarchical Comm's shards.
// Counted under MemCategory::comm while they exist.
#pragma once
#include <Kokkos_Core.hpp>
#include <cstddef>
#include <vector>

#include "util/memory.hpp"

namespace ptrain::comm_detail {

template <class Memory>
class BufferPool {
 public:
  BufferPool() = default;
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;
  ~BufferPool() {
    for (const Slot& s : slots_) memory::sub(MemCategory::comm, s.buffer.extent(0));
  }
  // A free buffer of at least `bytes` (its index), taken until give_back.
  int take(std::size_t bytes) {
    for (std::size_t i = 0; i < slots_.size(); ++i)
      if (!slots_[i].taken && slots_[i].buffer.extent(0) >= bytes) {
        slots_[i].taken = true;
        return int(i);
      }
    // Rounded up to a power of two, so that slowly growing requests reuse buffers.
    std::size_t size = 4096;
    while (size < bytes) size *= 2;
    slots_.push_back(
        Slot{Buffer(Kokkos::view_alloc(Kokkos::WithoutInitializing, "comm_buffer"), size), true});
    memory::add(MemCategory::comm, size);
    return int(slots_.size()) - 1;
  }
  char* data(int i) { return slots_[std::size_t(i)].buffer.data(); }
  void give_back(int i) { slots_[std::size_t(i)].taken = false; }

 private:
  using Buffer = Kokkos::View<char*, Memory>;
  struct Slot {
    Buffer buffer;
    bool taken;
  };
  std::vector<Slot> slots_;
};

}  // namespace ptrain::comm_detail
