// Wait notices: two ranks that wait for each other in operations that can never meet.
//
// A rank blocked in an in-step exchange (XLA waits on it) and a peer blocked in a host round
// (a Python wait of mnjax.comm) that each need the other, or two ranks blocked in host rounds
// of two communicators that share them (each rank entered the two in another order), can only
// end at the wait bound (MNJAX_WAIT_TIMEOUT, minutes). Instead, every wait that lasts past
// kNoticeAfter tells the ranks it waits for: one 128-byte notice on MPI_COMM_WORLD (tag
// `notice_tag`), and one more when it ends. A host wait's notice carries its communicator's
// `uid` (its scope; 0: unknown). Two waits may be one and the same operation when they are of
// one kind and, for host rounds, of one communicator (or one scope is unknown). A rank none of
// whose waits may be the same operation as any wait of a peer it waits for, whose notices are
// all older than kNoticeGrace, knows that neither can go on: it names both waits and ends the
// job (the peer, seeing the same, names them too). A peer that waits in both kinds (its
// Python in a host round while XLA waits on its step) may be in the very round this rank
// waits in: no conclusion. The host rounds of one process are taken to run one at a time (its
// Python thread blocks in each): a process that runs host rounds of two communicators from
// two threads at once may be taken for one that entered them in another order.
//
// This process's own notices are drained here only (Python reads them through
// `mnjax_wait_*` in mpi_collectives.cc), under one mutex; the notices need MPI_THREAD_MULTIPLE
// (without it, none is sent).

#pragma once

#include <mpi.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "mpi_ranks.h"

namespace mnjax {

constexpr double kNoticeAfter = 5.0;  // seconds a wait lasts before it is told
constexpr double kNoticeGrace = 5.0;  // seconds a peer's notice stands before it is believed
constexpr int kSayingPause = 3;       // seconds a rank that names a mismatch waits to end the job
enum WaitKind : int64_t { kEnded = 0, kInStepWait = 1, kHostWait = 2 };

struct Notice {  // on the wire
  int64_t world_rank, id, kind, scope;
  char what[96];  // what the sender waits in, nul-terminated
};
static_assert(sizeof(Notice) == 128, "a notice is 128 bytes");

struct Heard {
  int64_t kind, scope;
  std::string what;
  std::chrono::steady_clock::time_point since;
};

struct Mine {
  int64_t kind, scope;
  std::vector<int> peers;  // world ranks this wait needs
  std::string what;
  bool told = false;
  std::set<int> alongside;  // peers heard waiting in what may be this operation (ever)
};

// Whether a wait of this rank and a peer's may be one and the same operation.
inline bool MayMeet(int64_t kind, int64_t scope, const Heard& theirs) {
  if (kind != theirs.kind) return false;
  return kind != kHostWait || scope == 0 || theirs.scope == 0 || scope == theirs.scope;
}

// Notes `peer`'s wait `theirs` in every wait of this rank that needs it and that it may be.
inline void NoteAlongside(std::map<int64_t, Mine>& waits, int peer, const Heard& theirs) {
  for (auto& [_, own] : waits) {
    for (int p : own.peers) {
      if (p == peer && MayMeet(own.kind, own.scope, theirs)) own.alongside.insert(peer);
    }
  }
}

inline std::atomic<int> notice_tag{-1};
inline std::mutex notice_mutex;
inline std::map<int, std::map<int64_t, Heard>> heard;  // the peers' waits now told, by world rank, id
inline std::map<int64_t, Mine> mine;                   // this rank's waits in progress, by id
inline int64_t next_wait_id = 1;
inline std::vector<std::pair<MPI_Request, std::unique_ptr<Notice>>> outgoing;

inline int MyWorldRank() {
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

inline bool NoticesOn() { return notice_tag.load(std::memory_order_relaxed) >= 0 && ThreadMultiple(); }

// Sends notice (id, kind, scope) of this rank to `peers` (under notice_mutex). 128 bytes each:
// complete locally at once (eager); their buffers are freed once MPI is done with them.
inline void Tell(const std::vector<int>& peers, int64_t id, int64_t kind, int64_t scope,
                 const std::string& what) {
  for (auto it = outgoing.begin(); it != outgoing.end();) {
    int done = 0;
    MPI_Test(&it->first, &done, MPI_STATUS_IGNORE);
    it = done ? outgoing.erase(it) : it + 1;
  }
  for (int peer : peers) {
    auto notice = std::make_unique<Notice>();
    notice->world_rank = MyWorldRank();
    notice->id = id;
    notice->kind = kind;
    notice->scope = scope;
    std::snprintf(notice->what, sizeof(notice->what), "%s", what.c_str());
    MPI_Request request;
    MPI_Isend(notice.get(), sizeof(Notice), MPI_BYTE, peer, notice_tag.load(), MPI_COMM_WORLD,
              &request);
    outgoing.emplace_back(request, std::move(notice));
  }
}

// Takes in every notice that has arrived (under notice_mutex).
inline void Drain() {
  int tag = notice_tag.load(std::memory_order_relaxed);
  for (;;) {
    int any = 0;
    MPI_Status status;
    MPI_Message message;  // matched: Python's exit drain may take notices from another thread
    MPI_Improbe(MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, &any, &message, &status);
    if (!any) return;
    Notice notice;
    MPI_Mrecv(&notice, sizeof(Notice), MPI_BYTE, &message, MPI_STATUS_IGNORE);
    notice.what[sizeof(notice.what) - 1] = '\0';
    auto& waits = heard[status.MPI_SOURCE];
    if (notice.kind == kEnded) {
      waits.erase(notice.id);
    } else {
      waits[notice.id] =
          Heard{notice.kind, notice.scope, notice.what, std::chrono::steady_clock::now()};
      NoteAlongside(mine, status.MPI_SOURCE, waits[notice.id]);
    }
  }
}

// Registers a wait of this rank for `peers` (world ranks) in `scope` (a host round's
// communicator uid; 0: unknown, or an in-step wait); 0 when notices are off.
inline int64_t BeginWait(int64_t kind, int64_t scope, std::vector<int> peers, std::string what) {
  if (!NoticesOn()) return 0;
  std::lock_guard<std::mutex> lock(notice_mutex);
  int64_t id = next_wait_id++;
  Mine& own = mine[id] = Mine{kind, scope, std::move(peers), std::move(what)};
  for (int peer : own.peers) {  // peers already waiting when this wait began
    auto found = heard.find(peer);
    if (found == heard.end()) continue;
    for (const auto& [_, wait] : found->second) {
      if (MayMeet(kind, scope, wait)) own.alongside.insert(peer);
    }
  }
  return id;
}

inline void EndWait(int64_t id) {
  if (id == 0) return;
  std::lock_guard<std::mutex> lock(notice_mutex);
  auto it = mine.find(id);
  if (it == mine.end()) return;
  if (it->second.told) Tell(it->second.peers, id, kEnded, 0, "");
  mine.erase(it);
}

// For wait `id`, `waited` seconds long: tells its peers once it is long, and returns the world
// rank of a peer it waits for none of whose waits may meet any of this rank's (what the two
// wait in: `*ours`, `*theirs`; the peer's kind: `*their_kind`), else -1.
inline int CheckWait(int64_t id, double waited, std::string* ours, std::string* theirs,
                     int64_t* their_kind) {
  if (id == 0 || waited < kNoticeAfter) return -1;
  std::lock_guard<std::mutex> lock(notice_mutex);
  auto it = mine.find(id);
  if (it == mine.end()) return -1;
  if (!it->second.told) {
    it->second.told = true;
    Tell(it->second.peers, id, it->second.kind, it->second.scope, it->second.what);
  }
  Drain();
  auto now = std::chrono::steady_clock::now();
  for (int peer : it->second.peers) {
    auto found = heard.find(peer);
    if (found == heard.end() || found->second.empty()) continue;
    bool settled = true, may_meet = false;
    for (const auto& [_, wait] : found->second) {
      settled = settled && std::chrono::duration<double>(now - wait.since).count() > kNoticeGrace;
      for (const auto& [__, own] : mine) may_meet = may_meet || MayMeet(own.kind, own.scope, wait);
    }
    if (settled && !may_meet) {
      const Heard& first = found->second.begin()->second;
      *ours = it->second.what;
      *theirs = first.what;
      *their_kind = first.kind;
      return peer;
    }
  }
  return -1;
}

// The peers of wait `id` that told, while it lasted, of a wait that may be this very operation
// (they wait in it too, or did until their own bound); the others never reached it, or are
// somewhere this rank was not told of.
inline std::vector<int> Alongside(int64_t id) {
  if (id == 0) return {};
  std::lock_guard<std::mutex> lock(notice_mutex);
  Drain();
  auto it = mine.find(id);
  if (it == mine.end()) return {};
  return std::vector<int>(it->second.alongside.begin(), it->second.alongside.end());
}

// The world ranks of `c` other than this rank's.
inline std::vector<int> WorldPeers(MPI_Comm c) {
  std::vector<int> peers;
  int me = RankOf(c);
  for (int r = 0, n = SizeOf(c); r < n; ++r) {
    if (r != me) peers.push_back(WorldRank(c, r));
  }
  return peers;
}

// Ends the job: this in-step wait and the peer's host round can never meet.
[[noreturn]] inline void AbortMismatch(MPI_Comm c, const std::string& mine_what, int peer,
                                const std::string& theirs) {
  std::fprintf(stderr,
               "mnjax: world rank %d waits in %s, which needs world rank %d, while world rank %d"
               " waits for this rank in %s: the two can never meet (one rank reached a step's"
               " exchange, the other a host round of mnjax: the ranks run different programs)."
               " Every rank must call mnjax's steps, collectives and checks in the same order:"
               " look for a condition on the rank, a loop or a model that differs between"
               " ranks. Aborting the job.\n",
               MyWorldRank(), mine_what.c_str(), peer, peer, theirs.c_str());
  std::fflush(stderr);
  // The peer names the same two waits at about the same time: leave it a moment (on a loaded
  // machine, seconds) to say so before the job ends.
  struct timespec pause = {kSayingPause, 0};
  nanosleep(&pause, nullptr);
  MPI_Abort(c, 1);
  std::abort();
}

// The in-step side of wait `*id` (0: not yet registered), `waited` seconds long: registered
// once it is long (its description and peers asked then), then checked; a mismatch ends the
// job. `describe()` says what it waits in, `peers()` gives the world ranks it waits for.
template <typename Describe, typename Peers>
inline void WatchInStepWait(int64_t* id, double waited, MPI_Comm c, Describe describe,
                            Peers peers) {
  if (waited < kNoticeAfter || !NoticesOn()) return;
  if (*id == 0) *id = BeginWait(kInStepWait, 0, peers(), describe());
  std::string ours, theirs;
  int64_t their_kind = 0;
  int peer = CheckWait(*id, waited, &ours, &theirs, &their_kind);
  if (peer >= 0) AbortMismatch(c, ours, peer, theirs);
}

}  // namespace mnjax
