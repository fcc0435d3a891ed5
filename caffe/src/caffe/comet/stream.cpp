// COMET-Caffe: the streams of COMET's device work (include/caffe/comet/stream.hpp).
#include "caffe/comet/stream.hpp"

#include <memory>

#include "caffe/comet/payload.hpp"
#include "caffe/comet/pool.hpp"
#include "caffe/comet/worker.hpp"
#include "caffe/common.hpp"

namespace caffe {

namespace {
thread_local void* g_stream = NULL;
thread_local bool g_in_job = false;
}  // namespace

void* CometStream() { return g_stream; }

CometJobScope::CometJobScope() : previous_(g_in_job) { g_in_job = true; }
CometJobScope::~CometJobScope() { g_in_job = previous_; }

void CometWorkFailed(const std::string& message) {
  if (g_in_job) throw CometJobFailure(message);
  CometFatal("COMET: " + message + "; where: " + CometReadContext());
}

#ifndef CPU_ONLY
namespace {
// "CUDA error cudaErrorX (its text) in WHAT"
void CudaFailedIn(cudaError_t e, const std::string& what) {
  CometWorkFailed(std::string("CUDA error ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
                  ") in " + what);
}
}  // namespace

void CometCudaFailed(int error, const char* call, const char* file, int line) {
  std::string where(file);
  where = where.substr(where.find_last_of('/') + 1);
  CudaFailedIn(static_cast<cudaError_t>(error),
               std::string(call) + " at " + where + ":" + std::to_string(line));
}
#endif

CometOnStream::CometOnStream(void* stream) : previous_(g_stream) { g_stream = stream; }
CometOnStream::~CometOnStream() { g_stream = previous_; }

#ifndef CPU_ONLY
CometSideStream::CometSideStream() : device_(0), stream_(NULL) {
  CUDA_CHECK(cudaGetDevice(&device_));
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = s;
  CometGpuPoolFence(true);
}

CometSideStream::~CometSideStream() {
  {
    CometOnDevice on(device_);
    CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
    CUDA_CHECK(cudaStreamDestroy(static_cast<cudaStream_t>(stream_)));
  }
  CometGpuPoolFence(false);
}

void* CometSideStream::Mark() {
  cudaEvent_t e;
  COMET_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  COMET_CUDA_CHECK(cudaEventRecord(e, NULL));  // the legacy default stream, Caffe's
  return e;
}

namespace {
// The calling thread's device from now on (no scope gives the last one back).
void UseDevice(int device) {
  int current = 0;
  COMET_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) COMET_CUDA_CHECK(cudaSetDevice(device));
}
}  // namespace

std::function<void()> CometTakeThisDevice() {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  return [device] { UseDevice(device); };
}

CometOnDevice::CometOnDevice(int device) : previous_(device), device_(device) {
  COMET_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device_) COMET_CUDA_CHECK(cudaSetDevice(device_));
}
CometOnDevice::~CometOnDevice() {
  if (previous_ != device_) CUDA_CHECK(cudaSetDevice(previous_));
}

namespace {
// On the stream's device. A store's worker thread serves that one device and stays on it: the
// thread starts on device 0, and setting 0 back after each job would make (CUDA 12 and later) a
// context on device 0 for a run on another (`caffe train -gpu 1`), and abort there when device 0
// is exclusive to another process. A step that runs a queued job itself gets its device back.
class OnStreamDevice {
 public:
  explicit OnStreamDevice(int device) {
    if (CometWorker::OnWorker()) UseDevice(device);
    else scoped_.reset(new CometOnDevice(device));
  }

 private:
  std::unique_ptr<CometOnDevice> scoped_;
};
}  // namespace

// A failure here comes from a kernel the step queued before the job (Caffe's or COMET's): the
// job did not start.
void CometSideStream::WaitFor(void* mark) {
  OnStreamDevice on(device_);
  const cudaError_t e = cudaEventSynchronize(static_cast<cudaEvent_t>(mark));
  if (e != cudaSuccess) CudaFailedIn(e, "the step's kernels queued before this job");
  COMET_CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(mark)));
}

void CometSideStream::Run(const std::function<void()>& work) {
  OnStreamDevice on(device_);
  CometOnStream stream(stream_);
  try {
    work();
  } catch (...) {  // a failed job's kernels end before the step frees what they use
    cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
    throw;
  }
  COMET_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
}
#else
CometOnDevice::CometOnDevice(int device) : previous_(device), device_(device) { NO_GPU; }
CometOnDevice::~CometOnDevice() {}
CometSideStream::CometSideStream() : device_(0), stream_(NULL) { NO_GPU; }
CometSideStream::~CometSideStream() {}
void* CometSideStream::Mark() {
  NO_GPU;
  return NULL;
}
void CometSideStream::WaitFor(void*) { NO_GPU; }
void CometSideStream::Run(const std::function<void()>&) { NO_GPU; }
std::function<void()> CometTakeThisDevice() {
  NO_GPU;
  return std::function<void()>();
}
#endif  // CPU_ONLY

}  // namespace caffe
