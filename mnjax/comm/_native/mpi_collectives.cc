// mnjax's MPI collectives as XLA FFI handlers (CPU): allreduce (in place), alltoall,
// allgather.
//
// In place: mpi4jax's handler always calls MPI_Allreduce(send, recv) on two buffers, so
// XLA allocates a fresh result buffer per call (first-touch page faults on every page) and
// MPI copies the input into it before reducing. Here the result aliases the operand (the
// lowering sets operand_output_aliases = {0: 0}) and the handler reduces with MPI_IN_PLACE
// in the operand's own, already touched, memory: no allocation, no copy.
//
// Ordering: every handler takes a second operand, `after`, that it never reads. mnjax
// passes the previous collective's result there, so XLA:CPU (whose runtime runs
// independent operations concurrently, in any order) must finish one collective before it
// starts the next, and every rank issues them in the same order.
//
// MPI handles arrive as int64 attributes (mpi4py's handle values), converted with memcpy so
// both integer (MPICH) and pointer (Open MPI) handle types work. Built by
// `python -m mnjax.native` with the MPI compiler wrapper.

#include <mpi.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Completed allreduces, for tests that prove a step issued no collective (mnjax.native).
std::atomic<int64_t> completed_allreduces{0};
// Every collective entered and left, for the stall watchdog (mnjax.watchdog): a rank with
// more entered than completed is waiting for peers that have not entered yet.
std::atomic<int64_t> entered_collectives{0};
std::atomic<int64_t> completed_collectives{0};

// Counts one collective as entered now and completed when it goes out of scope.
struct Counted {
  Counted() { entered_collectives.fetch_add(1, std::memory_order_relaxed); }
  ~Counted() { completed_collectives.fetch_add(1, std::memory_order_relaxed); }
};

template <typename Handle>
Handle FromInt(int64_t value) {
  Handle handle;
  std::memcpy(&handle, &value, sizeof(handle));
  return handle;
}

// Returning an error would raise on this rank only and leave the others blocked in the
// collective: end the whole job instead, saying why.
void AbortOnError(int ierr, MPI_Comm comm, const char* what) {
  if (ierr == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(ierr, text, &length);
  int rank = -1;
  MPI_Comm_rank(comm, &rank);
  std::fprintf(stderr, "mnjax: rank %d: %s failed (%.*s); aborting the job\n", rank, what,
               length, text);
  std::fflush(stderr);
  MPI_Abort(comm, ierr);
}

ffi::Error CheckCount(int64_t count) {
  if (count > INT_MAX) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "mnjax: more than INT_MAX items in one MPI call");
  }
  return ffi::Error::Success();
}

ffi::Error Allreduce(ffi::AnyBuffer operand, ffi::AnyBuffer after,
                     ffi::Result<ffi::AnyBuffer> result, int64_t count, int64_t op,
                     int64_t comm, int64_t dtype) {
  if (auto e = CheckCount(count); e.failure()) return e;
  MPI_Comm c = FromInt<MPI_Comm>(comm);
  void* send = operand.untyped_data();
  void* recv = result->untyped_data();
  Counted counted;
  AbortOnError(MPI_Allreduce(send == recv ? MPI_IN_PLACE : send, recv, static_cast<int>(count),
                             FromInt<MPI_Datatype>(dtype), FromInt<MPI_Op>(op), c),
               c, "MPI_Allreduce");
  completed_allreduces.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

// MPI_Alltoall and MPI_Allgather share one signature: `count` items to (and from) each rank.
using PairwiseCall = int (*)(const void*, int, MPI_Datatype, void*, int, MPI_Datatype,
                             MPI_Comm);

template <PairwiseCall kCall>
ffi::Error Pairwise(const char* name, ffi::AnyBuffer operand, ffi::Result<ffi::AnyBuffer> result,
                    int64_t count, int64_t comm, int64_t dtype) {
  if (auto e = CheckCount(count); e.failure()) return e;
  MPI_Comm c = FromInt<MPI_Comm>(comm);
  MPI_Datatype t = FromInt<MPI_Datatype>(dtype);
  Counted counted;
  AbortOnError(kCall(operand.untyped_data(), static_cast<int>(count), t, result->untyped_data(),
                     static_cast<int>(count), t, c),
               c, name);
  return ffi::Error::Success();
}

ffi::Error Alltoall(ffi::AnyBuffer operand, ffi::AnyBuffer after,
                    ffi::Result<ffi::AnyBuffer> result, int64_t count, int64_t comm,
                    int64_t dtype) {
  return Pairwise<MPI_Alltoall>("MPI_Alltoall", operand, result, count, comm, dtype);
}

ffi::Error Allgather(ffi::AnyBuffer operand, ffi::AnyBuffer after,
                     ffi::Result<ffi::AnyBuffer> result, int64_t count, int64_t comm,
                     int64_t dtype) {
  return Pairwise<MPI_Allgather>("MPI_Allgather", operand, result, count, comm, dtype);
}

// (operand, after) -> result, with the attributes every handler shares.
auto Binding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<int64_t>("count");
}

}  // namespace

extern "C" int64_t mnjax_allreduce_calls() { return completed_allreduces.load(); }
extern "C" int64_t mnjax_collectives_entered() { return entered_collectives.load(); }
extern "C" int64_t mnjax_collectives_completed() { return completed_collectives.load(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_allreduce, Allreduce,
                              Binding().Attr<int64_t>("op").Attr<int64_t>("comm").Attr<int64_t>(
                                  "dtype"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_alltoall, Alltoall,
                              Binding().Attr<int64_t>("comm").Attr<int64_t>("dtype"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_allgather, Allgather,
                              Binding().Attr<int64_t>("comm").Attr<int64_t>("dtype"));
