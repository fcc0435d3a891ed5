#ifndef CAFFE_COMET_STREAM_HPP_
#define CAFFE_COMET_STREAM_HPP_

// COMET-Caffe: the CUDA stream COMET's device work goes to. Caffe queues all its work on the
// legacy default stream. A store's worker (comet { async }) encodes and decodes device blobs on
// a stream of its own, so that the step's thread goes on queueing layers while the worker waits
// for the sizes, counts and checksums the codecs read back. Streams are void* (cudaStream_t), so
// that CPU-only code includes this header.

#include <functional>
#include <stdexcept>
#include <string>

namespace caffe {

// A failure of COMET's own device work (COMET_CUDA_CHECK, an allocation the device cannot make).
// In a store's job (an encode or decode; CometJobScope on the thread, on the worker or in the
// step) it is thrown as a CometJobFailure, which the job keeps as its error: the step then stops
// naming the blob, the layer and the iteration (the worker thread cannot stop the step, and a
// bare abort there named nothing). Elsewhere it is a fatal error (CometFatal: pycaffe raises)
// naming what the step was doing (CometReadContext).
class CometJobFailure : public std::runtime_error {
 public:
  explicit CometJobFailure(const std::string& what) : std::runtime_error(what) {}
};
class CometJobScope {
 public:
  CometJobScope();
  ~CometJobScope();

 private:
  bool previous_;
};
void CometWorkFailed(const std::string& message);
#ifndef CPU_ONLY
// `error`: a cudaError_t; `call`: the expression, for the message.
void CometCudaFailed(int error, const char* call, const char* file, int line);
#define COMET_CUDA_CHECK(call)                                              \
  do {                                                                      \
    const cudaError_t comet_error_ = (call);                                \
    if (comet_error_ != cudaSuccess)                                        \
      ::caffe::CometCudaFailed(comet_error_, #call, __FILE__, __LINE__);    \
  } while (0)
#endif

// This thread's stream for COMET's kernels, copies and sz calls: NULL (the default stream)
// unless a CometOnStream scope names another.
void* CometStream();

class CometOnStream {
 public:
  explicit CometOnStream(void* stream);
  ~CometOnStream();

 private:
  void* previous_;
};

// This thread's current CUDA device is `device` for the scope's life, and what it was after.
class CometOnDevice {
 public:
  explicit CometOnDevice(int device);
  ~CometOnDevice();
  int previous() const { return previous_; }  // the device current before the scope

 private:
  int previous_, device_;
};

// What a store's worker thread runs first on a GPU: it takes the caller's current device for
// good. A thread starts on device 0, where (CUDA 12 and later) setting it makes a context, and a
// host allocation makes the thread's Caffe, with a cuBLAS handle on the current device: a run on
// another device (`caffe train -gpu 1`) would make them on device 0.
std::function<void()> CometTakeThisDevice();

// A non-blocking stream on the device current when it is made, for one store's device jobs.
// The step's thread marks (Mark) how far it has queued work on the default stream when it
// submits a job; the job first waits for the device to get there (WaitFor, on the worker's
// thread: the step goes on), then works on this stream (Run), which it synchronizes at its end,
// so that a finished job's results are ready for every stream. While one exists the device pools
// carry events with their blocks (CometGpuPoolFence).
class CometSideStream {
 public:
  CometSideStream();
  ~CometSideStream();  // waits for what runs on it
  void* Mark();        // an event on the default stream, consumed by WaitFor
  void WaitFor(void* mark);
  void Run(const std::function<void()>& work);

 private:
  int device_;
  void* stream_;
};

}  // namespace caffe

#endif  // CAFFE_COMET_STREAM_HPP_
