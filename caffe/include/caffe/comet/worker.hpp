#ifndef CAFFE_COMET_WORKER_HPP_
#define CAFFE_COMET_WORKER_HPP_

#include <stdint.h>

#include <condition_variable>  // NOLINT(build/c++11)
#include <deque>
#include <functional>
#include <mutex>   // NOLINT(build/c++11)
#include <set>
#include <thread>  // NOLINT(build/c++11)
#include <utility>
#include <vector>

namespace caffe {

// The threads for work the step splits over every core (a decode on demand, every codec call
// with comet { async: false }): made once per process, asleep between calls, and shared by sz
// (installed with sz_set_executor) and the store's own loops, so no call creates threads. A
// caller that finds the team busy (another solver's thread) gets threads of its own for that
// one call.
class CometTeam {
 public:
  static CometTeam& Get();
  // Runs task(arg, t) for t in [0, n), task 0 on the calling thread, and returns when all ran.
  // The team's threads claim tasks as they come, except on the cores that busy workers keep
  // (CometWorker::AnyBusy): on 2 cores the caller runs the tasks itself while the worker works,
  // and a team thread joins for those left when the worker goes idle (CoreFreed). A call that
  // finds the team busy gets threads of its own, or with fork_when_busy false (or no core free)
  // runs every task on the caller.
  void Run(int n, void (*task)(void*, int), void* arg, bool fork_when_busy = true);
  // A worker went idle: team threads waiting for a core join the call in progress.
  void CoreFreed();
  size_t size() const { return threads_.size() + 1; }  // the caller included
  // Calls that found the team busy and made threads of their own, since the start.
  static uint64_t forked_calls();

 private:
  CometTeam();
  void Serve();
  // Claims and runs tasks while any are left (a team thread: while a core is free for it).
  void Work(std::unique_lock<std::mutex>* lock, bool helper);
  int FreeCores() const;

  std::mutex busy_;  // one Run at a time
  std::mutex mutex_;
  std::condition_variable go_, done_;
  uint64_t generation_;
  int n_, next_, left_;
  int active_;   // team threads running tasks of this call
  void (*task_)(void*, int);
  void* arg_;
  unsigned mode_;  // the caller's floating-point mode (float_mode.hpp): its tasks run in it
  std::vector<std::thread> threads_;
};

// One background thread that starts the store's encodes and decodes in the order they were
// submitted, so the training step goes on while they run (docs/comet.md#asynchronous-work); a
// step that has to wait for some runs those not started yet itself. Jobs are independent.
// Jobs are plain functions that write their results where the submitter reads them after Wait.
// The thread is made once per store and sleeps when idle (no spinning next to BLAS's threads).
class CometWorker {
 public:
  typedef std::function<void()> Job;
  // on_start: what the thread runs first (a store's on a GPU: take the store's device).
  explicit CometWorker(const Job& on_start = Job());
  ~CometWorker();  // runs what is queued, then joins

  uint64_t Submit(const Job& job);  // its ticket: 1, 2, 3, ...
  bool Done(uint64_t ticket) const;
  // Blocks until the job of `ticket` (and every job before it) has run; the milliseconds waited.
  // Those of them that have not started yet run on the calling thread meanwhile.
  double Wait(uint64_t ticket);
  // True on a worker's thread: the codecs run single-threaded there, on the core the step
  // leaves free, instead of splitting each call over every core.
  static bool OnWorker();
  // True while any worker in the process has work queued or running: the step then leaves it
  // a core (CometGemm runs its tiles on the step's thread alone).
  static bool AnyBusy();
  // Jobs that workers' threads ran (not those a waiting step ran itself), since the start.
  static uint64_t jobs_run_on_workers();

 private:
  void Run(Job on_start);
  void Ended(uint64_t ticket);

  mutable std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::deque<std::pair<uint64_t, Job> > queue_;
  std::set<uint64_t> running_;  // started, not ended
  uint64_t submitted_, finished_;
  bool stop_;
  std::thread thread_;
};

}  // namespace caffe

#endif  // CAFFE_COMET_WORKER_HPP_
