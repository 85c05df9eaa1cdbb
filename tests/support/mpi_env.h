// The environment every test that runs mpirun gives it (as "NAME=VALUE ..." for env(1)):
// shared-memory and self transports only, oversubscription allowed (the suite runs 4 ranks
// on 2 cores), root allowed (CI runs as root), and ranks that yield when idle.
//
// Under AddressSanitizer, leak detection is off for what mpirun starts: Open MPI and NCCL
// do not free their initialization state by design, and the libraries they dlopen are
// unloaded before LeakSanitizer runs, so their frames show as "<unknown module>" (or with
// a wrong module) and no suppression can name them. Memory errors are still caught there,
// and the same code paths run leak-checked without mpirun (one rank, Gloo, in process).
#ifndef RACKRUN_TESTS_SUPPORT_MPI_ENV_H_
#define RACKRUN_TESTS_SUPPORT_MPI_ENV_H_

namespace rackrun::testing {

inline constexpr char kMpiEnv[] =
    "OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none "
    "OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_ALLOW_RUN_AS_ROOT=1 "
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1"
#if defined(__SANITIZE_ADDRESS__)
    " ASAN_OPTIONS=detect_leaks=0"
#endif
    ;

}  // namespace rackrun::testing

#endif  // RACKRUN_TESTS_SUPPORT_MPI_ENV_H_
