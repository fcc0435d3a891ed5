// COMET-Caffe: the store's background thread and the cores' team (include/caffe/comet/worker.hpp).
#include <algorithm>
#include <atomic>  // NOLINT(build/c++11)
#include <chrono>  // NOLINT(build/c++11)

#include "caffe/comet/float_mode.hpp"
#include "caffe/comet/worker.hpp"

namespace caffe {

namespace {
thread_local bool on_worker = false;
std::atomic<uint64_t> forked(0);
std::atomic<int> busy_workers(0);
std::atomic<uint64_t> jobs_on_workers(0);  // jobs run by workers' threads, not a step's
}  // namespace

CometTeam& CometTeam::Get() {
  static CometTeam* team = new CometTeam();  // never destroyed: its threads sleep until exit
  return *team;
}

uint64_t CometTeam::forked_calls() { return forked.load(); }

CometTeam::CometTeam()
    : generation_(0), n_(0), next_(0), left_(0), active_(0), task_(NULL), arg_(NULL),
      mode_(CometFloatMode()) {
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  for (unsigned i = 1; i < hw; ++i) threads_.push_back(std::thread(&CometTeam::Serve, this));
  for (size_t i = 0; i < threads_.size(); ++i) threads_[i].detach();
}

// Cores the team's threads may use now: those that no busy worker keeps.
int CometTeam::FreeCores() const {
  return std::max(0, static_cast<int>(size()) - 1 - busy_workers.load());
}

void CometTeam::Work(std::unique_lock<std::mutex>* lock, bool helper) {
  // A helper stops claiming when a worker has taken its core back (it finishes its task first).
  while (next_ < n_ && (!helper || active_ <= FreeCores())) {
    const int t = next_++;
    void (*task)(void*, int) = task_;
    void* arg = arg_;
    const unsigned mode = mode_;
    lock->unlock();
    CometSetFloatMode(mode);  // the caller's (a store's step flushes denormals)
    task(arg, t);
    lock->lock();
    if (--left_ == 0) done_.notify_all();
  }
}

void CometTeam::Serve() {
  std::unique_lock<std::mutex> lock(mutex_);
  uint64_t seen = 0;
  for (;;) {
    go_.wait(lock, [this, seen] { return generation_ != seen; });
    seen = generation_;
    // Joins the call on a core no busy worker keeps: at once, or when a worker goes idle while
    // tasks are left (CoreFreed), so that a product started while the worker encoded does not
    // leave that core idle once the encode is done.
    while (generation_ == seen && next_ < n_) {
      if (active_ < FreeCores()) {
        ++active_;
        Work(&lock, true);
        --active_;
      } else {
        go_.wait(lock);  // CoreFreed, or the next call
      }
    }
  }
}

void CometTeam::CoreFreed() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (next_ < n_) go_.notify_all();
}

void CometTeam::Run(int n, void (*task)(void*, int), void* arg, bool fork_when_busy) {
  if (n <= 1 || threads_.empty()) {
    for (int t = 0; t < n; ++t) task(arg, t);
    return;
  }
  std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
  if (!busy.owns_lock() && (!fork_when_busy || FreeCores() == 0)) {
    for (int t = 0; t < n; ++t) task(arg, t);
    return;
  }
  if (!busy.owns_lock()) {
    ++forked;
    std::vector<std::thread> own;
    for (int t = 1; t < n; ++t) own.push_back(std::thread(task, arg, t));
    task(arg, 0);
    for (size_t t = 0; t < own.size(); ++t) own[t].join();
    return;
  }
  // Posted even when busy workers keep every other core (on 2 cores, while the worker encodes):
  // a team thread joins when one goes idle.
  std::unique_lock<std::mutex> lock(mutex_);
  task_ = task;
  arg_ = arg;
  mode_ = CometFloatMode();
  n_ = n;
  next_ = 1;  // task 0 is the caller's
  left_ = n;
  ++generation_;
  go_.notify_all();
  lock.unlock();
  task(arg, 0);
  lock.lock();
  if (--left_ == 0) done_.notify_all();
  Work(&lock, false);  // the caller claims the tasks no team thread has
  done_.wait(lock, [this] { return left_ == 0; });
}

CometWorker::CometWorker(const Job& on_start) : submitted_(0), finished_(0), stop_(false) {
  thread_ = std::thread(&CometWorker::Run, this, on_start);
}

CometWorker::~CometWorker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

bool CometWorker::OnWorker() { return on_worker; }

uint64_t CometWorker::jobs_run_on_workers() { return jobs_on_workers.load(); }

bool CometWorker::AnyBusy() { return busy_workers.load(std::memory_order_relaxed) > 0; }

uint64_t CometWorker::Submit(const Job& job) {
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ticket = ++submitted_;
    queue_.push_back(std::make_pair(ticket, job));
  }
  wake_.notify_one();
  return ticket;
}

bool CometWorker::Done(uint64_t ticket) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return finished_ >= ticket;
}

// Jobs start in ticket order but may end out of it (the worker and a waiting step each run
// one): finished_ is the last ticket before the oldest job not yet ended. Under mutex_.
void CometWorker::Ended(uint64_t ticket) {
  running_.erase(ticket);
  finished_ = running_.empty() ? (queue_.empty() ? submitted_ : queue_.front().first - 1)
                               : *running_.begin() - 1;
  done_.notify_all();
}

double CometWorker::Wait(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (finished_ >= ticket) return 0;
  const std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  while (finished_ < ticket) {
    // A job the step waits for that has not started runs here, beside the worker's, instead of
    // the step sleeping on a core while the worker works through the queue alone (the end of
    // the forward pass waits for every encode still queued).
    if (!queue_.empty() && queue_.front().first <= ticket) {
      std::pair<uint64_t, Job> next = queue_.front();
      queue_.pop_front();
      running_.insert(next.first);
      lock.unlock();
      next.second();
      lock.lock();
      Ended(next.first);
      continue;
    }
    done_.wait(lock);
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

void CometWorker::Run(Job on_start) {
  on_worker = true;
  if (on_start) on_start();
  std::unique_lock<std::mutex> lock(mutex_);
  bool busy = false;
  for (;;) {
    wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_, and nothing left to run
    std::pair<uint64_t, Job> next = queue_.front();
    queue_.pop_front();
    running_.insert(next.first);
    lock.unlock();
    if (!busy) {
      busy = true;
      ++busy_workers;
    }
    next.second();  // jobs report their own failures in their results; they do not throw
    ++jobs_on_workers;
    lock.lock();
    const bool idle = queue_.empty();
    if (idle) {
      busy = false;
      --busy_workers;
    }
    Ended(next.first);
    if (idle) {  // this core is free again: a product running on the step alone may use it
      lock.unlock();
      CometTeam::Get().CoreFreed();
      lock.lock();
    }
  }
}

}  // namespace caffe
