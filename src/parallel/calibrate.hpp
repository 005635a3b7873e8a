// parallel/calibrate.hpp — `ptrain --calibrate DECK`: what the cost model (parallel/cost.hpp)
// needs, measured on the ranks it runs on, every rank at once (as in a run: ranks that share a
// node share its cores and memory bandwidth), the median rank's figure kept:
//  * gemm: every compute type at the deck's shapes (its layers' products at tp 1, 2, 4, 8 and
//    a few micro-batch sizes), fitted to t = 2MNK (d + d0) / (peak d) + t0 (d: the smallest
//    dimension): the peak, the half dimension d0 and the cost of a call t0;
//  * attention forward and backward at the deck's (micro-batch, sequence, heads, head size);
//  * the row and elementwise kernels (LayerNorm, GELU) and the optimizer's update, as bytes
//    moved per second by the cost model's own byte counts;
//  * communication inside a node (the node's ranks) and across nodes (one rank per node) for
//    all-reduce, all-gather, all-to-all and send/recv at sizes from 64 B to 16 MiB, fitted to
//    t = latency * ring steps + bytes / bandwidth (bytes as each Comm counts them); a kind with
//    no such group here (one rank a node, one node) keeps the node class's figure, and the
//    machine's name says which were not measured;
//  * oversubscription: a node running more rank threads than it has CPUs (measured above with
//    every rank computing) gets the rates of a rank alone, machine%cores_per_node, and the
//    share of a core a rank waiting in MPI still takes (machine%wait_load);
//  * the deck itself: a few real steps on this grid, each phase's compute (its time less the
//    time blocked in communication) against the model's: forward, backward and optimizer
//    factors the model scales by.
// Progress lines on rank 0. Collective over the grid's world.
#pragma once
#include "deck/config.hpp"
#include "grid/grid.hpp"

namespace ptrain::parallel {

// `config` with its &machine group measured (the same on every rank); `threads`: each rank's.
Config calibrate(const Config& config, const Grid& grid, int threads);

}  // namespace ptrain::parallel
