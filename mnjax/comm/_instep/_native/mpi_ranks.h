// Ranks and threading of an MPI communicator, for the handlers (mpi_collectives.cc) and the wait
// notices (wait_notices.h).

#pragma once

#include <mpi.h>

namespace mnjax {

inline int SizeOf(MPI_Comm c) {
  int size = 0;
  MPI_Comm_size(c, &size);
  return size;
}

inline int RankOf(MPI_Comm c) {
  int rank = -1;
  MPI_Comm_rank(c, &rank);
  return rank;
}

// The world rank of `rank` of `c`.
inline int WorldRank(MPI_Comm c, int rank) {
  MPI_Group group, world;
  MPI_Comm_group(c, &group);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  int out = MPI_UNDEFINED;
  MPI_Group_translate_ranks(group, 1, &rank, world, &out);
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  return out;
}

// Whether MPI runs with MPI_THREAD_MULTIPLE (mpi4py's default): a progress thread may call it.
inline bool ThreadMultiple() {
  static const bool multiple = [] {
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    return level == MPI_THREAD_MULTIPLE;
  }();
  return multiple;
}

}  // namespace mnjax
