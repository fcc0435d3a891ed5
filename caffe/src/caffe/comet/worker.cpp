// COMET-Caffe: the store's background thread (include/caffe/comet/worker.hpp).
#include <chrono>  // NOLINT(build/c++11)

#include "caffe/comet/worker.hpp"

namespace caffe {

namespace {
thread_local bool on_worker = false;
}  // namespace

CometWorker::CometWorker() : submitted_(0), finished_(0), stop_(false) {
  thread_ = std::thread(&CometWorker::Run, this);
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

double CometWorker::Wait(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (finished_ >= ticket) return 0;
  const std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  done_.wait(lock, [this, ticket] { return finished_ >= ticket; });
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

void CometWorker::Run() {
  on_worker = true;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_, and nothing left to run
    std::pair<uint64_t, Job> next = queue_.front();
    queue_.pop_front();
    lock.unlock();
    next.second();  // jobs report their own failures in their results; they do not throw
    lock.lock();
    finished_ = next.first;
    done_.notify_all();
  }
}

}  // namespace caffe
