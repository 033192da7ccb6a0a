// mnjax's MPI collectives as XLA FFI handlers (CPU): allreduce (in place, in two halves), alltoall,
// allgather, and for `mnjax.functions` (model parallelism) send, recv, bcast, gather,
// scatter and reduce.
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
// Timeline (mnjax.guard.Timeline): while enabled, every handler writes one event (kind,
// bytes, communicator, the tag its lowering passed, the step the last step mark set, entry
// and exit on CLOCK_MONOTONIC) into a ring buffer that Python drains; disabled, a handler
// pays one relaxed atomic load. The `_tagged` targets take one more attribute, `tag`
// (mnjax.comm._instep._recorder's id for "bucket k of the gradient allreduce", ...), and exist so
// that a step traced without a timeline lowers exactly as before.
//
// Allreduce in two halves: a start posts MPI_Iallreduce and returns, a done returns a future
// that this process's progress thread completes, so XLA:CPU computes while the bytes move
// (docs/design/allreduce.md, "The exchange beside compute").
//
// Waits: every wait polls its request, paced so that it leaves the core to the step, and a
// peer that finished its program ends the job with a named error instead of a hang; send and
// recv also end after MNJAX_WAIT_TIMEOUT (AwaitPeer; docs/design/functions.md, "Waits that
// cannot complete").
//
// MPI handles arrive as int64 attributes (mpi4py's handle values), converted with memcpy so
// both integer (MPICH) and pointer (Open MPI) handle types work. Built by
// `python -m mnjax.native` with the MPI compiler wrapper.

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <sched.h>
#include <time.h>

#include "mpi_ranks.h"
#include "wait_notices.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace mnjax;  // NOLINT: the helpers of mpi_ranks.h and wait_notices.h

namespace {

// Completed allreduces, for tests that prove a step issued no collective (mnjax.native).
std::atomic<int64_t> completed_allreduces{0};
// Every collective entered and left, for the stall watchdog (mnjax.watchdog): a rank with
// more entered than completed is waiting for peers that have not entered yet.
std::atomic<int64_t> entered_collectives{0};
std::atomic<int64_t> completed_collectives{0};

// One timeline event (mirrored by mnjax.comm._instep._recorder.EVENT_DTYPE).
struct Event {
  int64_t start_ns, end_ns, bytes, comm, tag, step, kind, published;
};
// Event kinds (names: mnjax.comm._instep._recorder.NATIVE_KINDS).
enum Kind : int64_t { kAllreduce = 0, kAlltoall = 1, kAllgather = 2, kStepBegin = 3,
                      kStepEnd = 4, kOther = 5, kSend = 6, kRecv = 7, kBcast = 8, kGather = 9,
                      kScatter = 10, kReduce = 11 };

std::atomic<bool> timeline_on{false};
std::atomic<uint64_t> timeline_next{0};  // events ever claimed
// Never freed: a handler that saw the timeline on may still write into the old ring.
Event* timeline_ring = nullptr;
uint64_t timeline_capacity = 0;
std::atomic<int64_t> timeline_step{-1};  // set by the last step mark

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The one recording function every handler calls (new ones too: point-to-point ops).
void RecordEvent(int64_t kind, int64_t start_ns, int64_t bytes, int64_t comm, int64_t tag) {
  uint64_t i = timeline_next.fetch_add(1, std::memory_order_relaxed);
  Event& e = timeline_ring[i % timeline_capacity];
  e.published = 0;
  std::atomic_thread_fence(std::memory_order_release);
  e = Event{start_ns, NowNs(), bytes, comm, tag, timeline_step.load(std::memory_order_relaxed),
            kind, 0};
  std::atomic_thread_fence(std::memory_order_release);
  reinterpret_cast<std::atomic<int64_t>*>(&e.published)->store(static_cast<int64_t>(i + 1),
                                                                std::memory_order_release);
}

// The hook every handler uses: counts one collective as entered now and completed when it
// goes out of scope (the watchdog's counters), and times it into the timeline when that is
// on. `Counted counted;` records an unnamed exchange; pass what it is where known:
// `Counted counted(kSend, bytes, comm);` (`tag`: the lowering's, see the `_tagged` targets).
struct Counted {
  explicit Counted(int64_t kind = kOther, int64_t bytes = 0, int64_t comm = 0, int64_t tag = 0)
      : on(timeline_on.load(std::memory_order_relaxed)), kind(kind), bytes(bytes),
        comm(comm), tag(tag), start(on ? NowNs() : 0) {
    entered_collectives.fetch_add(1, std::memory_order_relaxed);
  }
  ~Counted() {
    if (on) RecordEvent(kind, start, bytes, comm, tag);
    completed_collectives.fetch_add(1, std::memory_order_relaxed);
  }
  bool on;
  int64_t kind, bytes, comm, tag, start;
};

int64_t TypeSize(MPI_Datatype t) {
  int size = 0;
  MPI_Type_size(t, &size);
  return size;
}

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

// How long an in-step point-to-point wait may last, and the tag of the exit notices
// (mnjax.comm._departures), both set from Python by `mnjax_configure_waits`.
std::atomic<double> wait_limit_s{300.0};
std::atomic<int> departure_tag{-1};

// Whether world rank `source`'s exit notice has arrived (left in the queue for Python).
bool Departed(int source) {
  int tag = departure_tag.load(std::memory_order_relaxed);
  if (tag < 0 || source == MPI_UNDEFINED) return false;
  int flag = 0;
  MPI_Iprobe(source, tag, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE);
  return flag != 0;
}

// Completes `request` of an in-step exchange with `peer` of `c`, polling: a peer that finished
// its program (its exit notice arrived) or a wait past `wait_limit_s` ends the whole job with
// a message that names this rank, what it waits in, the peer, and the fix.
// `status` (may be MPI_STATUS_IGNORE) receives the completed request's status.
void AwaitPeer(MPI_Request* request, MPI_Status* status, MPI_Comm c, const char* what, int peer,
               int64_t tag) {
  using Clock = std::chrono::steady_clock;
  auto start = Clock::now();
  auto next_check = start + std::chrono::milliseconds(50);
  Clock::time_point gone_since{};
  bool gone = false;
  const int world_peer = WorldRank(c, peer);
  int64_t wait_id = 0;
  for (;;) {
    int done = 0;
    AbortOnError(MPI_Test(request, &done, status), c, what);
    if (done) {
      EndWait(wait_id);
      return;
    }
    auto now = Clock::now();
    if (now < next_check) continue;
    next_check = now + std::chrono::milliseconds(10);
    double waited = std::chrono::duration<double>(now - start).count();
    WatchInStepWait(
        &wait_id, waited, c,
        [&] {
          char line[96];
          std::snprintf(line, sizeof(line), "an in-step %s with world rank %d (tag %lld)", what,
                        world_peer, static_cast<long long>(tag));
          return std::string(line);
        },
        [&] { return std::vector<int>{world_peer}; });
    if (!gone && (gone = Departed(world_peer))) gone_since = now;
    // The peer may have done its part of this very exchange just before it left: 2 s grace.
    bool departed = gone && std::chrono::duration<double>(now - gone_since).count() > 2.0;
    double limit = wait_limit_s.load(std::memory_order_relaxed);
    if (!departed && waited <= limit) continue;
    int me = RankOf(c);
    if (departed) {
      std::fprintf(stderr,
                   "mnjax: rank %d (world rank %d) waits in an in-step %s with rank %d (world rank"
                   " %d, tag %lld), but rank %d finished its program (exited normally): the"
                   " exchange can never complete. The ranks must run the same steps: look for a"
                   " loop, a condition or a stage list that differs between ranks. Aborting the"
                   " job.\n",
                   me, WorldRank(c, me), what, peer, world_peer, static_cast<long long>(tag),
                   peer);
    } else {
      std::fprintf(stderr,
                   "mnjax: rank %d (world rank %d) waited %.0f s in an in-step %s with rank %d"
                   " (world rank %d, tag %lld), which has not done its part: it is stuck, or runs"
                   " another program (a send without its recv, another order of stages). Make"
                   " every send meet its recv in the same order on both ranks, or raise the limit"
                   " with MNJAX_WAIT_TIMEOUT=<seconds> if the peer is only slow. Aborting the"
                   " job.\n",
                   me, WorldRank(c, me), waited, what, peer, world_peer,
                   static_cast<long long>(tag));
    }
    std::fflush(stderr);
    MPI_Abort(c, 1);
  }
}

// The first rank of `c` whose exit notice has arrived (MPI_UNDEFINED: none). One probe while
// no notice has arrived at all; the ranks of `c` are looked at only once one has.
int DepartedMember(MPI_Comm c) {
  int any = 0;
  MPI_Iprobe(MPI_ANY_SOURCE, departure_tag.load(std::memory_order_relaxed), MPI_COMM_WORLD,
             &any, MPI_STATUS_IGNORE);
  if (!any) return MPI_UNDEFINED;
  for (int r = 0, n = SizeOf(c); r < n; ++r) {
    if (Departed(WorldRank(c, r))) return r;
  }
  return MPI_UNDEFINED;
}

// How a wait on a request paces its tests: spin for the first 50 us (where a fast exchange
// ends), then yield the core between tests until 2 ms, then sleep 50 us between them, so that
// a wait on a slow link leaves the core to the step's compute. Each test drives MPI's progress.
void Pace(std::chrono::steady_clock::duration waited) {
  if (waited < std::chrono::microseconds(50)) return;
  if (waited < std::chrono::milliseconds(2)) {
    sched_yield();
    return;
  }
  struct timespec pause = {0, 50000};
  nanosleep(&pause, nullptr);
}

// One in-step collective in flight: its request, what it is (for messages, the watchdog and
// the timeline), and the future XLA waits on.
struct InFlight {
  MPI_Request request;
  MPI_Comm comm;
  const char* what;
  int64_t tag;
  std::unique_ptr<Counted> counted;  // destroyed when the collective completes
  ffi::Promise promise;              // completed (by the Completer) with the request
  std::optional<ffi::Future> future;  // made at the start (one Future per Promise), done returns it
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point next_check = start + std::chrono::milliseconds(100);
  std::chrono::steady_clock::time_point gone_since{};
  int gone = MPI_UNDEFINED;          // a rank of `comm` whose exit notice arrived
  // Set once XLA waits on the collective (its done ran): from then on a wait notice stands
  // (wait_notices.h) while it lasts.
  std::atomic<bool> awaited{false};
  std::chrono::steady_clock::time_point awaited_at{};
  int64_t wait_id = 0;
};

// Ends the job if a rank of the collective finished its program (its exit notice arrived
// over 2 s ago: it may have done its part of this very collective just before it left), or
// the collective has waited past `wait_limit_s` (a rank stuck, or in another program).
void CheckDeparted(InFlight& f, std::chrono::steady_clock::time_point now) {
  if (now < f.next_check) return;
  f.next_check = now + std::chrono::milliseconds(100);
  double waited = std::chrono::duration<double>(now - f.start).count();
  if (waited > wait_limit_s.load(std::memory_order_relaxed)) {
    int me = RankOf(f.comm);
    std::fprintf(stderr,
                 "mnjax: rank %d (world rank %d) waited %.0f s in an in-step %s (tag %lld) of %d"
                 " ranks that not all of them have reached: a rank is stuck, or runs another"
                 " program (a step fewer, a condition on the rank, another model). Make every"
                 " rank run the same steps, or raise the limit with MNJAX_WAIT_TIMEOUT=<seconds>"
                 " if a rank is only slow (a long checkpoint write or compile). Aborting the"
                 " job.\n",
                 me, WorldRank(f.comm, me), waited, f.what, static_cast<long long>(f.tag),
                 SizeOf(f.comm));
    std::fflush(stderr);
    MPI_Abort(f.comm, 1);
  }
  if (f.awaited.load(std::memory_order_acquire)) {
    WatchInStepWait(
        &f.wait_id, std::chrono::duration<double>(now - f.awaited_at).count(), f.comm,
        [&] {
          char line[96];
          std::snprintf(line, sizeof(line), "an in-step %s (tag %lld) of %d ranks", f.what,
                        static_cast<long long>(f.tag), SizeOf(f.comm));
          return std::string(line);
        },
        [&] { return WorldPeers(f.comm); });
  }
  if (departure_tag.load(std::memory_order_relaxed) < 0) return;
  if (f.gone == MPI_UNDEFINED && (f.gone = DepartedMember(f.comm)) != MPI_UNDEFINED) {
    f.gone_since = now;
  }
  if (f.gone == MPI_UNDEFINED || now - f.gone_since < std::chrono::seconds(2)) return;
  int me = RankOf(f.comm);
  std::fprintf(stderr,
               "mnjax: rank %d (world rank %d) waits in an in-step %s (tag %lld), but rank %d"
               " (world rank %d) finished its program (exited normally): the collective can"
               " never complete. The ranks must run the same steps: look for a loop or a"
               " condition that differs between ranks. Aborting the job.\n",
               me, WorldRank(f.comm, me), f.what, static_cast<long long>(f.tag), f.gone,
               WorldRank(f.comm, f.gone));
  std::fflush(stderr);
  MPI_Abort(f.comm, 1);
}

// Completes the futures of finished collectives, off the progress thread: XLA runs what
// waited on a future on the thread that completes it, and that work may block (a
// multi-device step's threads meet in XLA's own rendezvous) until another collective
// completes. A thread per completion in flight: one is started when every thread is busy,
// and they stay for the next.
class Completer {
 public:
  static Completer& Get() {
    static Completer* completer = new Completer();  // never destroyed, as its threads
    return *completer;
  }

  void Complete(ffi::Promise promise) {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(promise));
    if (queue_.size() > idle_) {
      std::thread([this] { Run(); }).detach();
    } else {
      wake_.notify_one();
    }
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      while (queue_.empty()) {
        ++idle_;
        wake_.wait(lock);
        --idle_;
      }
      ffi::Promise promise = std::move(queue_.front());
      queue_.erase(queue_.begin());
      lock.unlock();
      promise.SetAvailable();
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<ffi::Promise> queue_;
  size_t idle_ = 0;
};

// Completes in-step collectives asynchronously: a handler posts a non-blocking MPI call and
// returns a future at once, so XLA:CPU runs the step's other operations (the backward
// layers after an early bucket, the whole step beside double buffering's exchange) while the
// bytes move; this process's one progress thread tests the requests in flight (paced:
// `Pace`) and completes their futures, and XLA runs what waited on them. Needs
// MPI_THREAD_MULTIPLE (mpi4py's default); without it the handler waits itself (`Await`).
class Progress {
 public:
  static Progress& Get() {
    static Progress* progress = new Progress();  // never destroyed: its thread outlives main
    return *progress;
  }

  void Add(std::shared_ptr<InFlight> f) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      incoming_.push_back(std::move(f));
    }
    wake_.notify_one();
  }

 private:
  Progress() { std::thread([this] { Run(); }).detach(); }

  void Run() {
    std::vector<std::shared_ptr<InFlight>> active;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (active.empty()) wake_.wait(lock, [this] { return !incoming_.empty(); });
        for (auto& f : incoming_) active.push_back(std::move(f));
        incoming_.clear();
      }
      auto now = std::chrono::steady_clock::now();
      auto oldest = now;
      for (size_t i = 0; i < active.size();) {
        InFlight& f = *active[i];
        int done = 0;
        AbortOnError(MPI_Test(&f.request, &done, MPI_STATUS_IGNORE), f.comm, f.what);
        if (!done) {
          CheckDeparted(f, now);
          oldest = std::min(oldest, f.start);
          ++i;
          continue;
        }
        std::shared_ptr<InFlight> finished = std::move(active[i]);
        active.erase(active.begin() + static_cast<std::ptrdiff_t>(i));
        EndWait(finished->wait_id);
        completed_allreduces.fetch_add(1, std::memory_order_relaxed);
        finished->counted.reset();
        Completer::Get().Complete(finished->promise);
      }
      if (!active.empty()) Pace(now - oldest);
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::shared_ptr<InFlight>> incoming_;
};

// The collectives started and not yet claimed by their done, by the address of their buffer
// (the start's result aliases its operand, and the done's operand is that result).
std::mutex started_mutex;
std::vector<std::pair<void*, std::shared_ptr<InFlight>>> started;

// The handler's own wait, where MPI allows no progress thread.
void Await(InFlight& f) {
  for (;;) {
    int done = 0;
    AbortOnError(MPI_Test(&f.request, &done, MPI_STATUS_IGNORE), f.comm, f.what);
    if (done) break;
    auto now = std::chrono::steady_clock::now();
    CheckDeparted(f, now);
    Pace(now - f.start);
  }
  completed_allreduces.fetch_add(1, std::memory_order_relaxed);
  f.counted.reset();
  f.promise.SetAvailable();
}

// Completes a non-blocking collective that its handler waits for itself (alltoall, allgather,
// bcast, gather, scatter, reduce): polled and paced as the allreduce, so that a rank that
// finished its program or a wait past `wait_limit_s` ends the job with a named error, not a
// hang inside MPI.
void AwaitCollective(MPI_Request request, MPI_Comm c, const char* what, int64_t tag) {
  InFlight f;  // its promise and future stay unused
  f.request = request;
  f.comm = c;
  f.what = what;
  f.tag = tag;
  f.awaited_at = f.start;
  f.awaited.store(true, std::memory_order_release);
  for (;;) {
    int done = 0;
    AbortOnError(MPI_Test(&f.request, &done, MPI_STATUS_IGNORE), c, what);
    if (done) {
      EndWait(f.wait_id);
      return;
    }
    auto now = std::chrono::steady_clock::now();
    CheckDeparted(f, now);
    Pace(now - f.start);
  }
}

ffi::Error CheckCount(int64_t count) {
  if (count > INT_MAX) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "mnjax: more than INT_MAX items in one MPI call");
  }
  return ffi::Error::Success();
}

// An allreduce in two halves, so that XLA:CPU computes while the bytes move. The start
// posts MPI_Iallreduce on its operand, in place, and returns at once (the progress thread
// drives it); its result is the same buffer, in flight, which only the done reads. The done
// returns a future that completes with the request. Two calls, not one asynchronous call:
// XLA:CPU's executor orders a call after every later operation that reuses the memory of one
// of its operands, and the start's small `after` operand is reused at once; the in-flight
// buffer stays live until the done, so nothing else is placed in it.
ffi::Error AllreduceStartTagged(ffi::AnyBuffer operand, ffi::AnyBuffer after,
                                ffi::Result<ffi::AnyBuffer> result, int64_t count, int64_t op,
                                int64_t comm, int64_t dtype, int64_t tag) {
  if (auto e = CheckCount(count); e.failure()) return e;
  MPI_Comm c = FromInt<MPI_Comm>(comm);
  void* send = operand.untyped_data();
  void* recv = result->untyped_data();
  auto f = std::make_shared<InFlight>();
  f->comm = c;
  f->what = "allreduce";
  f->tag = tag;
  f->counted = std::make_unique<Counted>(
      kAllreduce, count * TypeSize(FromInt<MPI_Datatype>(dtype)), comm, tag);
  f->future.emplace(f->promise);
  AbortOnError(MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, static_cast<int>(count),
                              FromInt<MPI_Datatype>(dtype), FromInt<MPI_Op>(op), c, &f->request),
               c, "MPI_Iallreduce");
  {
    std::lock_guard<std::mutex> lock(started_mutex);
    started.emplace_back(recv, f);
  }
  if (ThreadMultiple()) Progress::Get().Add(std::move(f));
  return ffi::Error::Success();
}

ffi::Error AllreduceStart(ffi::AnyBuffer operand, ffi::AnyBuffer after,
                          ffi::Result<ffi::AnyBuffer> result, int64_t count, int64_t op,
                          int64_t comm, int64_t dtype) {
  return AllreduceStartTagged(operand, after, result, count, op, comm, dtype, 0);
}

// The start with a second result, `link`: one byte written 0 that a later collective takes as
// its `after`, so that its start waits for this start only, not for this done: several
// exchanges in flight at once. (A later call taking the in-flight buffer itself as `after`
// would make XLA copy that buffer, and the done would find no exchange started on the copy.)
ffi::Error AllreduceStartLinkedTagged(ffi::AnyBuffer operand, ffi::AnyBuffer after,
                                      ffi::Result<ffi::AnyBuffer> result,
                                      ffi::Result<ffi::AnyBuffer> link, int64_t count,
                                      int64_t op, int64_t comm, int64_t dtype, int64_t tag) {
  ffi::Error e = AllreduceStartTagged(operand, after, result, count, op, comm, dtype, tag);
  if (e.failure()) return e;
  std::memset(link->untyped_data(), 0, link->size_bytes());
  return e;
}

ffi::Error AllreduceStartLinked(ffi::AnyBuffer operand, ffi::AnyBuffer after,
                                ffi::Result<ffi::AnyBuffer> result,
                                ffi::Result<ffi::AnyBuffer> link, int64_t count, int64_t op,
                                int64_t comm, int64_t dtype) {
  return AllreduceStartLinkedTagged(operand, after, result, link, count, op, comm, dtype, 0);
}

ffi::Future AllreduceDone(ffi::AnyBuffer operand, ffi::Result<ffi::AnyBuffer> result) {
  std::shared_ptr<InFlight> f;
  {
    std::lock_guard<std::mutex> lock(started_mutex);
    for (auto it = started.begin(); it != started.end(); ++it) {
      if (it->first == operand.untyped_data()) {
        f = std::move(it->second);
        started.erase(it);
        break;
      }
    }
  }
  if (!f) {
    ffi::Promise failed;
    ffi::Future future(failed);
    failed.SetError(ffi::Error(ffi::ErrorCode::kInternal,
                               "mnjax: an allreduce done found no allreduce started on its"
                               " buffer (XLA moved the in-flight buffer between the halves)"));
    return future;
  }
  f->awaited_at = std::chrono::steady_clock::now();
  f->awaited.store(true, std::memory_order_release);
  if (!ThreadMultiple()) Await(*f);  // completes the promise here
  return std::move(*f->future);
}

// The done of a start that reduced into a new buffer: `kept` is the start's operand, which MPI
// reads until the exchange completes; as an operand here it stays live (XLA places nothing
// else in it) until then. Nothing reads it.
ffi::Future AllreduceDoneKeeping(ffi::AnyBuffer operand, ffi::AnyBuffer kept,
                                 ffi::Result<ffi::AnyBuffer> result) {
  (void)kept;
  return AllreduceDone(operand, result);
}

// MPI_Ialltoall and MPI_Iallgather share one signature: `count` items to (and from) each rank.
using PairwiseCall = int (*)(const void*, int, MPI_Datatype, void*, int, MPI_Datatype,
                             MPI_Comm, MPI_Request*);

template <PairwiseCall kCall>
ffi::Error Pairwise(const char* name, const char* what, int64_t kind, ffi::AnyBuffer operand,
                    ffi::Result<ffi::AnyBuffer> result, int64_t count, int64_t comm,
                    int64_t dtype, int64_t tag) {
  if (auto e = CheckCount(count); e.failure()) return e;
  MPI_Comm c = FromInt<MPI_Comm>(comm);
  MPI_Datatype t = FromInt<MPI_Datatype>(dtype);
  Counted counted(kind, operand.size_bytes(), comm, tag);
  MPI_Request request;
  AbortOnError(kCall(operand.untyped_data(), static_cast<int>(count), t, result->untyped_data(),
                     static_cast<int>(count), t, c, &request),
               c, name);
  AwaitCollective(request, c, what, tag);
  return ffi::Error::Success();
}

ffi::Error AlltoallTagged(ffi::AnyBuffer operand, ffi::AnyBuffer after,
                          ffi::Result<ffi::AnyBuffer> result, int64_t count, int64_t comm,
                          int64_t dtype, int64_t tag) {
  return Pairwise<MPI_Ialltoall>("MPI_Ialltoall", "alltoall", kAlltoall, operand, result, count,
                                 comm, dtype, tag);
}

ffi::Error Alltoall(ffi::AnyBuffer operand, ffi::AnyBuffer after,
                    ffi::Result<ffi::AnyBuffer> result, int64_t count, int64_t comm,
                    int64_t dtype) {
  return AlltoallTagged(operand, after, result, count, comm, dtype, 0);
}

ffi::Error AllgatherTagged(ffi::AnyBuffer operand, ffi::AnyBuffer after,
                           ffi::Result<ffi::AnyBuffer> result, int64_t count, int64_t comm,
                           int64_t dtype, int64_t tag) {
  return Pairwise<MPI_Iallgather>("MPI_Iallgather", "allgather", kAllgather, operand, result,
                                  count, comm, dtype, tag);
}

ffi::Error Allgather(ffi::AnyBuffer operand, ffi::AnyBuffer after,
                     ffi::Result<ffi::AnyBuffer> result, int64_t count, int64_t comm,
                     int64_t dtype) {
  return AllgatherTagged(operand, after, result, count, comm, dtype, 0);
}

// A step mark (traced only while a timeline is on): `operand` is the step number (int32),
// copied to the result; `kind` 0 marks the step's start (later collectives belong to it), 1
// its end (`after`: a value computed from the step's outputs).
ffi::Error Mark(ffi::AnyBuffer operand, ffi::AnyBuffer after, ffi::Result<ffi::AnyBuffer> result,
                int64_t kind) {
  int32_t step = *static_cast<const int32_t*>(operand.untyped_data());
  *static_cast<int32_t*>(result->untyped_data()) = step;
  if (!timeline_on.load(std::memory_order_relaxed)) return ffi::Error::Success();
  if (kind == 0) timeline_step.store(step, std::memory_order_relaxed);
  RecordEvent(kind == 0 ? kStepBegin : kStepEnd, NowNs(), 0, 0, step);
  return ffi::Error::Success();
}

// Point-to-point and rooted collectives for `mnjax.functions`. Each takes the same unused
// `after` operand for ordering. A result a rank has no data for (a send's, a non-root's gather
// or reduce) is a small buffer written with zeros: the next collective's `after`.
void Zero(ffi::Result<ffi::AnyBuffer>& result) {
  std::memset(result->untyped_data(), 0, result->size_bytes());
}

ffi::Error Send(ffi::AnyBuffer operand, ffi::AnyBuffer after, ffi::Result<ffi::AnyBuffer> done,
                int64_t count, int64_t peer, int64_t tag, int64_t comm, int64_t dtype) {
  if (auto e = CheckCount(count); e.failure()) return e;
  MPI_Comm c = FromInt<MPI_Comm>(comm);
  Counted counted;
  MPI_Request request;
  AbortOnError(MPI_Isend(operand.untyped_data(), static_cast<int>(count),
                         FromInt<MPI_Datatype>(dtype), static_cast<int>(peer),
                         static_cast<int>(tag), c, &request),
               c, "MPI_Isend");
  AwaitPeer(&request, MPI_STATUS_IGNORE, c, "send", static_cast<int>(peer), tag);
  Zero(done);
  return ffi::Error::Success();
}

ffi::Error Recv(ffi::AnyBuffer after, ffi::Result<ffi::AnyBuffer> result, int64_t count,
                int64_t peer, int64_t tag, int64_t comm, int64_t dtype) {
  if (auto e = CheckCount(count); e.failure()) return e;
  MPI_Comm c = FromInt<MPI_Comm>(comm);
  MPI_Datatype t = FromInt<MPI_Datatype>(dtype);
  MPI_Status status;
  Counted counted;
  MPI_Request request;
  AbortOnError(MPI_Irecv(result->untyped_data(), static_cast<int>(count), t,
                         static_cast<int>(peer), static_cast<int>(tag), c, &request),
               c, "MPI_Irecv");
  AwaitPeer(&request, &status, c, "recv", static_cast<int>(peer), tag);
  int got = 0;
  MPI_Get_count(&status, t, &got);
  if (got != count) {  // the pre-flight pairs shapes: only a bypassed check gets here
    std::fprintf(stderr, "mnjax: MPI_Recv from rank %d got %d items, expected %lld; aborting\n",
                 static_cast<int>(peer), got, static_cast<long long>(count));
    std::fflush(stderr);
    MPI_Abort(c, 1);
  }
  return ffi::Error::Success();
}

ffi::Error Bcast(ffi::AnyBuffer operand, ffi::AnyBuffer after, ffi::Result<ffi::AnyBuffer> result,
                 int64_t count, int64_t root, int64_t comm, int64_t dtype) {
  if (auto e = CheckCount(count); e.failure()) return e;
  MPI_Comm c = FromInt<MPI_Comm>(comm);
  if (result->untyped_data() != operand.untyped_data()) {  // not aliased: start from the operand
    std::memcpy(result->untyped_data(), operand.untyped_data(), result->size_bytes());
  }
  Counted counted;
  MPI_Request request;
  AbortOnError(MPI_Ibcast(result->untyped_data(), static_cast<int>(count),
                          FromInt<MPI_Datatype>(dtype), static_cast<int>(root), c, &request),
               c, "MPI_Ibcast");
  AwaitCollective(request, c, "bcast", 0);
  return ffi::Error::Success();
}

ffi::Error Gather(ffi::AnyBuffer operand, ffi::AnyBuffer after, ffi::Result<ffi::AnyBuffer> result,
                  int64_t count, int64_t root, int64_t comm, int64_t dtype) {
  if (auto e = CheckCount(count); e.failure()) return e;
  MPI_Comm c = FromInt<MPI_Comm>(comm);
  MPI_Datatype t = FromInt<MPI_Datatype>(dtype);
  bool is_root = RankOf(c) == root;
  if (!is_root) Zero(result);
  Counted counted;
  MPI_Request request;
  AbortOnError(MPI_Igather(operand.untyped_data(), static_cast<int>(count), t,
                           is_root ? result->untyped_data() : nullptr, static_cast<int>(count), t,
                           static_cast<int>(root), c, &request),
               c, "MPI_Igather");
  AwaitCollective(request, c, "gather", 0);
  return ffi::Error::Success();
}

ffi::Error Scatter(ffi::AnyBuffer operand, ffi::AnyBuffer after, ffi::Result<ffi::AnyBuffer> result,
                   int64_t count, int64_t root, int64_t comm, int64_t dtype) {
  if (auto e = CheckCount(count); e.failure()) return e;
  MPI_Comm c = FromInt<MPI_Comm>(comm);
  MPI_Datatype t = FromInt<MPI_Datatype>(dtype);
  bool is_root = RankOf(c) == root;
  Counted counted;
  MPI_Request request;
  AbortOnError(MPI_Iscatter(is_root ? operand.untyped_data() : nullptr, static_cast<int>(count),
                            t, result->untyped_data(), static_cast<int>(count), t,
                            static_cast<int>(root), c, &request),
               c, "MPI_Iscatter");
  AwaitCollective(request, c, "scatter", 0);
  return ffi::Error::Success();
}

ffi::Error Reduce(ffi::AnyBuffer operand, ffi::AnyBuffer after, ffi::Result<ffi::AnyBuffer> result,
                  int64_t count, int64_t root, int64_t op, int64_t comm, int64_t dtype) {
  if (auto e = CheckCount(count); e.failure()) return e;
  MPI_Comm c = FromInt<MPI_Comm>(comm);
  bool is_root = RankOf(c) == root;
  if (!is_root) Zero(result);
  Counted counted;
  MPI_Request request;
  AbortOnError(MPI_Ireduce(operand.untyped_data(), is_root ? result->untyped_data() : nullptr,
                           static_cast<int>(count), FromInt<MPI_Datatype>(dtype),
                           FromInt<MPI_Op>(op), static_cast<int>(root), c, &request),
               c, "MPI_Ireduce");
  AwaitCollective(request, c, "reduce", 0);
  return ffi::Error::Success();
}

// (operand, after) -> result, with the attributes every handler shares.
auto Binding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<int64_t>("count");
}

// (operand, after) -> (result, link), with the allreduce's attributes.
auto LinkedBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<int64_t>("count")
      .Attr<int64_t>("op")
      .Attr<int64_t>("comm")
      .Attr<int64_t>("dtype");
}

}  // namespace

// Starts recording into a ring of at least `capacity` events (0: stops recording); returns
// the cursor to drain from.
extern "C" uint64_t mnjax_timeline_enable(int64_t capacity) {
  timeline_on.store(false);
  if (capacity > 0) {
    if (static_cast<uint64_t>(capacity) > timeline_capacity) {
      timeline_ring = new Event[capacity]();
      timeline_capacity = static_cast<uint64_t>(capacity);
      // Indices already claimed would map to other slots of the new ring: skip past them.
      timeline_next.fetch_add(timeline_capacity);
    }
    timeline_step.store(-1);
    timeline_on.store(true);
  }
  return timeline_next.load();
}

// Copies the events claimed since `*cursor` (at most the ring's capacity: older ones were
// overwritten, their number is returned through `lost`) into `out`; returns how many. An
// event still being written is left for the next drain.
extern "C" int64_t mnjax_timeline_drain(Event* out, int64_t max, uint64_t* cursor,
                                        int64_t* lost) {
  *lost = 0;
  if (timeline_capacity == 0) return 0;
  uint64_t end = timeline_next.load(std::memory_order_acquire);
  uint64_t from = *cursor;
  if (end - from > timeline_capacity) {
    *lost = static_cast<int64_t>(end - from - timeline_capacity);
    from = end - timeline_capacity;
  }
  int64_t n = 0;
  for (; from < end && n < max; ++from) {
    const Event& e = timeline_ring[from % timeline_capacity];
    auto published = reinterpret_cast<const std::atomic<int64_t>*>(&e.published)->load(
        std::memory_order_acquire);
    if (published != static_cast<int64_t>(from + 1)) break;
    out[n++] = e;
  }
  *cursor = from;
  return n;
}

extern "C" int64_t mnjax_timeline_now() { return NowNs(); }

extern "C" void mnjax_configure_waits(double limit_s, int64_t tag, int64_t notices) {
  wait_limit_s.store(limit_s, std::memory_order_relaxed);
  departure_tag.store(static_cast<int>(tag), std::memory_order_relaxed);
  notice_tag.store(static_cast<int>(notices), std::memory_order_relaxed);
}
// For Python's host waits (mnjax.comm._host._wait): begin, check and end a wait.
extern "C" int64_t mnjax_wait_begin(const int* peers, int64_t n, const char* what,
                                    int64_t scope) {
  return BeginWait(kHostWait, scope, std::vector<int>(peers, peers + n), what);
}

// The peer whose waits can never meet this host wait's (-1: none yet); what it waits in and
// its kind (1: a step's exchange, 2: a host round of another communicator) are written out.
extern "C" int64_t mnjax_wait_check(int64_t id, double waited, char* theirs, int64_t size,
                                    int64_t* their_kind) {
  std::string ours, found;
  int peer = CheckWait(id, waited, &ours, &found, their_kind);
  if (peer >= 0 && size > 0) std::snprintf(theirs, static_cast<size_t>(size), "%s", found.c_str());
  return peer;
}

// How many of wait `id`'s peers wait in it too (their world ranks: the first `size` in `out`).
extern "C" int64_t mnjax_wait_alongside(int64_t id, int* out, int64_t size) {
  std::vector<int> found = Alongside(id);
  for (int64_t i = 0; i < size && i < static_cast<int64_t>(found.size()); ++i) out[i] = found[i];
  return static_cast<int64_t>(found.size());
}

extern "C" void mnjax_wait_end(int64_t id) { EndWait(id); }

// Takes in the notices left before MPI_Finalize (mnjax.comm._departures at exit).
extern "C" void mnjax_wait_drain() {
  if (notice_tag.load(std::memory_order_relaxed) < 0) return;
  std::lock_guard<std::mutex> lock(notice_mutex);
  Drain();
}


extern "C" int64_t mnjax_allreduce_calls() { return completed_allreduces.load(); }
extern "C" int64_t mnjax_collectives_entered() { return entered_collectives.load(); }
extern "C" int64_t mnjax_collectives_completed() { return completed_collectives.load(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_allreduce_start, AllreduceStart,
                              Binding().Attr<int64_t>("op").Attr<int64_t>("comm").Attr<int64_t>(
                                  "dtype"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_allreduce_start_linked, AllreduceStartLinked,
                              LinkedBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_allreduce_start_linked_tagged,
                              AllreduceStartLinkedTagged, LinkedBinding().Attr<int64_t>("tag"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_allreduce_done, AllreduceDone,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    mnjax_mpi_allreduce_done_keeping, AllreduceDoneKeeping,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_alltoall, Alltoall,
                              Binding().Attr<int64_t>("comm").Attr<int64_t>("dtype"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_allgather, Allgather,
                              Binding().Attr<int64_t>("comm").Attr<int64_t>("dtype"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_allreduce_start_tagged, AllreduceStartTagged,
                              Binding()
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("dtype")
                                  .Attr<int64_t>("tag"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_alltoall_tagged, AlltoallTagged,
                              Binding().Attr<int64_t>("comm").Attr<int64_t>("dtype").Attr<int64_t>(
                                  "tag"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_allgather_tagged, AllgatherTagged,
                              Binding().Attr<int64_t>("comm").Attr<int64_t>("dtype").Attr<int64_t>(
                                  "tag"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mark, Mark,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("kind"));

// (after) -> result: a receive has no operand of its own.
XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_send, Send,
                              Binding().Attr<int64_t>("peer").Attr<int64_t>("tag")
                                  .Attr<int64_t>("comm").Attr<int64_t>("dtype"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_recv, Recv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("count")
                                  .Attr<int64_t>("peer")
                                  .Attr<int64_t>("tag")
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("dtype"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_bcast, Bcast,
                              Binding().Attr<int64_t>("root").Attr<int64_t>("comm").Attr<int64_t>(
                                  "dtype"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_gather, Gather,
                              Binding().Attr<int64_t>("root").Attr<int64_t>("comm").Attr<int64_t>(
                                  "dtype"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_scatter, Scatter,
                              Binding().Attr<int64_t>("root").Attr<int64_t>("comm").Attr<int64_t>(
                                  "dtype"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(mnjax_mpi_reduce, Reduce,
                              Binding().Attr<int64_t>("root").Attr<int64_t>("op").Attr<int64_t>(
                                  "comm").Attr<int64_t>("dtype"));
