// ptrain-test: np=1,2,4 labels=quick timeout=120
// comm/ on the staged transport: every test of test_comm.cpp with each tensor buffer copied
// to a host staging buffer before its operation starts and back after it completes, as a CUDA
// build without a CUDA-aware MPI moves device memory.
#define PTRAIN_TEST_TRANSPORT Transport::staged_mpi
#include "test_comm.cpp"
