// ptrain-test: np=1,2,4 labels=quick timeout=120
// comm/ HierarchicalComm on the staged transport: every test of test_comm_hierarchical.cpp
// with each level's tensor buffers copied through host staging buffers, as in a CUDA build
// without a CUDA-aware MPI.
#define PTRAIN_TEST_TRANSPORT Transport::staged_mpi
#include "test_comm_hierarchical.cpp"
