// COMET-Caffe: the memory pools of SyncedMemory (include/caffe/comet/pool.hpp).
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "boost/thread/mutex.hpp"
#include "caffe/comet/block_pool.hpp"
#include "caffe/comet/payload.hpp"
#include "caffe/comet/pool.hpp"
#include "caffe/comet/stream.hpp"
#include "caffe/common.hpp"
#include "caffe/syncedmem.hpp"

namespace caffe {

void* CometHostMap(size_t size) {
  void* p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(p != MAP_FAILED) << "COMET: host allocation of " << size << " bytes failed";
  return p;
}
void CometHostUnmap(void* ptr, size_t size) { CHECK_EQ(munmap(ptr, size), 0) << "COMET: munmap"; }

namespace {

BlockPool& HostPool() {  // never destroyed: frees come at exit
  static BlockPool* pool = new BlockPool(CometHostUnmap, true);
  return *pool;
}

// Small blocks are served well by malloc; the pool is for activation-sized ones.
const size_t kHostPoolMinBytes = 1 << 20;

bool HostPoolApplies(size_t size) {
  return size >= kHostPoolMinBytes && Caffe::mode() == Caffe::CPU;  // GPU mode: pinned memory
}

// This thread's memory whose allocation now is filled whole: a CometFillWhole's, and the one a
// FILL marker announced (consumed by that allocation).
thread_local const SyncedMemory* g_fills_whole = NULL;
thread_local const SyncedMemory* g_fill_next = NULL;
}  // namespace

CometFillWhole::CometFillWhole(const SyncedMemory* mem) : previous_(g_fills_whole) {
  g_fills_whole = mem;
}
CometFillWhole::~CometFillWhole() { g_fills_whole = previous_; }
void CometFillNext(const SyncedMemory* mem) { g_fill_next = mem; }
bool CometFillsWhole(const SyncedMemory* mem) {
  if (!mem) return false;
  const bool next = mem == g_fill_next;
  g_fill_next = NULL;
  return next || mem == g_fills_whole;
}

void CometHostPoolEnable(bool on) {
  BlockPool& pool = HostPool();
  boost::mutex::scoped_lock lock(pool.mutex);
  pool.enabled += on ? 1 : -1;
  if (!pool.enabled) pool.Disable();
}

void CometHostMalloc(void** ptr, size_t size, bool* use_cuda) {
  BlockPool& pool = HostPool();
  if (HostPoolApplies(size)) {
    boost::mutex::scoped_lock lock(pool.mutex);
    if (pool.enabled) {
      *use_cuda = false;
      *ptr = pool.Take(BlockPool::Key(-1, size));
      if (!*ptr) {
        *ptr = CometHostMap(size);
        pool.Track(*ptr, size);
      }
      return;
    }
  }
  CaffeMallocHost(ptr, size, use_cuda);
}

void CometHostFree(void* ptr, size_t size, bool use_cuda) {
  if (!use_cuda && size >= kHostPoolMinBytes) {  // the pool's own blocks are freed by the pool
    BlockPool& pool = HostPool();
    boost::mutex::scoped_lock lock(pool.mutex);
    if (pool.Give(ptr, BlockPool::Key(-1, size))) return;
  }
  CaffeFreeHost(ptr, use_cuda);
}

CometPoolStats CometHostPoolQuery() {
  BlockPool& pool = HostPool();
  boost::mutex::scoped_lock lock(pool.mutex);
  return pool.Stats();
}

#ifndef CPU_ONLY
namespace {

void GpuRelease(void* ptr, size_t) { CUDA_CHECK(cudaFree(ptr)); }

void* RecordEvent(void* event, void* stream) {
  cudaEvent_t e = static_cast<cudaEvent_t>(event);
  if (!e) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(e, static_cast<cudaStream_t>(stream)));
  return e;
}
void WaitEvent(void* event, void* stream) {
  COMET_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream),
                                 static_cast<cudaEvent_t>(event), 0));
}
void DestroyEvent(void* event) { CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(event))); }
const BlockPool::Fences kGpuFences = {RecordEvent, WaitEvent, DestroyEvent};

// One pool per device: each caps its cache at its own device's peak, and a trim or an
// out-of-memory retry frees only that device's blocks. Pools are made on first use with the
// settings all pools share; they are never destroyed (frees come at exit).
struct GpuPools {
  GpuPools() : enabled(0), headroom(0), fenced(0) {}
  boost::mutex mutex;  // guards the map and the shared settings; each pool has its own
  int enabled;
  double headroom;
  int fenced;
  std::map<int, BlockPool*> by_device;
};

GpuPools& AllGpuPools() {
  static GpuPools* pools = new GpuPools();
  return *pools;
}

BlockPool& GpuPool(int device) {
  GpuPools& all = AllGpuPools();
  boost::mutex::scoped_lock lock(all.mutex);
  std::map<int, BlockPool*>::iterator it = all.by_device.find(device);
  if (it != all.by_device.end()) return *it->second;
  BlockPool* pool = new BlockPool(GpuRelease, false, &kGpuFences);
  pool->enabled = all.enabled;
  pool->headroom = all.headroom;
  pool->fenced = all.fenced;
  all.by_device[device] = pool;
  return *pool;
}

// Applies `shared` to the settings that pools made later copy, then f(device, pool) to every
// device's pool under that pool's lock, all in one critical section: a pool that another
// solver's thread makes meanwhile takes a change once, not twice (-gpu all).
template <typename S, typename F>
void UpdateGpuPools(S shared, F f) {
  GpuPools& all = AllGpuPools();
  boost::mutex::scoped_lock lock(all.mutex);
  shared(all);
  for (std::map<int, BlockPool*>::iterator it = all.by_device.begin();
       it != all.by_device.end(); ++it) {
    boost::mutex::scoped_lock pool_lock(it->second->mutex);
    f(it->first, *it->second);
  }
}

// The device a block lives on (the current device may have changed since it was allocated).
int DeviceOf(const void* ptr) {
  cudaPointerAttributes attr;
  CUDA_CHECK(cudaPointerGetAttributes(&attr, ptr));
  return attr.device;
}

}  // namespace

void CometGpuPoolEnable(bool on) {
  UpdateGpuPools([on](GpuPools& all) { all.enabled += on ? 1 : -1; },
                 [on](int device, BlockPool& pool) {
                   pool.enabled += on ? 1 : -1;
                   if (pool.enabled) return;
                   CometOnDevice here(device);  // its cached blocks and events are that device's
                   pool.Disable();
                 });
}

void CometGpuPoolFence(bool on) {
  UpdateGpuPools([on](GpuPools& all) { all.fenced += on ? 1 : -1; },
                 [on](int, BlockPool& pool) { pool.fenced += on ? 1 : -1; });
}

// The device has no room for `bytes` more (the pool's cache, if any, given back already): what
// is there and what to try, instead of CUDA's bare "out of memory" with a stack trace.
static void OutOfDeviceMemory(int device, size_t bytes, bool pooled, size_t pool_in_use) {
  size_t free_bytes = 0, total = 0;
  const bool known = cudaMemGetInfo(&free_bytes, &total) == cudaSuccess;
  cudaGetLastError();
  const double mb = 1 << 20;
  std::string message = "out of memory on GPU " + std::to_string(device) + ": " +
                        CometNum(std::round(bytes / mb * 10) / 10) + " MB more did not fit";
  if (known)
    message += " (" + CometNum(std::round(free_bytes / mb)) + " MB free of " +
               CometNum(std::round(total / mb)) + " MB)";
  if (pooled)
    message += "; COMET's memory pool had " + CometNum(std::round(pool_in_use / mb)) +
               " MB in use, its cache given back first";
  CometWorkFailed(message + ". A smaller batch fits: `cometctl plan --gpu " +
                  std::to_string(device) + " --memory SIZE` finds the largest");
}

// Blocks are reused by the solver threads' allocations on the default stream and on the stores'
// own streams (CometStream; fenced as block_pool.hpp says). A data layer's prefetch thread
// allocates plainly (async_gpu_push, patch 0008); the prefetch buffers its setup takes on the
// solver's thread may be cached blocks, and that thread's first load reads each back
// (mutable_cpu_data of a buffer whose head is on the GPU: a cudaMemcpy on the legacy default
// stream, after the fence's wait), so that its own stream writes it only once every earlier
// use has ended.
void CometGpuMalloc(void** ptr, size_t size) {
  int device = 0;
  COMET_CUDA_CHECK(cudaGetDevice(&device));
  BlockPool& pool = GpuPool(device);
  boost::mutex::scoped_lock lock(pool.mutex);
  if (pool.enabled && (*ptr = pool.Take(BlockPool::Key(device, size), CometStream()))) return;
  const size_t bytes = pool.enabled ? pool.BlockBytes(size) : size;
  if (pool.enabled) pool.MakeRoom(bytes);  // cached blocks go before, not after, cudaMalloc
  cudaError_t err = cudaMalloc(ptr, bytes);
  if (err == cudaErrorMemoryAllocation && pool.cached) {
    cudaGetLastError();  // clear it, give this device's cache back and try once more
    pool.ReleaseCached();
    err = cudaMalloc(ptr, bytes);
  }
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    const bool pooled = pool.enabled;
    const size_t in_use = pool.Stats().in_use;
    lock.unlock();
    OutOfDeviceMemory(device, bytes, pooled, in_use);
  }
  COMET_CUDA_CHECK(err);
  if (pool.enabled) pool.Track(*ptr, bytes);
}

void CometGpuFree(void* ptr, size_t size) {
  const int device = DeviceOf(ptr);
  // A block of another device is given back on that device's default stream: its event must be
  // made and recorded there (this thread's stream belongs to the current device).
  CometOnDevice on(device);
  BlockPool& pool = GpuPool(device);
  boost::mutex::scoped_lock lock(pool.mutex);
  void* stream = on.previous() == device ? CometStream() : NULL;
  if (!pool.Give(ptr, BlockPool::Key(device, size), stream)) CUDA_CHECK(cudaFree(ptr));
}

namespace {
CometPoolStats GpuPoolQueryCurrent() {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  BlockPool& pool = GpuPool(device);
  boost::mutex::scoped_lock lock(pool.mutex);
  return pool.Stats();
}
}  // namespace

CometPoolStats CometGpuPoolQuery() {  // all devices together
  CometPoolStats total = {0, 0, 0, 0, 0, 0, 0};
  UpdateGpuPools([](GpuPools&) {}, [&total](int, BlockPool& pool) {
    const CometPoolStats s = pool.Stats();
    total.in_use += s.in_use;
    total.cached += s.cached;
    total.peak_in_use += s.peak_in_use;
    total.peak_held += s.peak_held;
    total.hits += s.hits;
    total.misses += s.misses;
    total.evicted += s.evicted;
  });
  return total;
}
#else
void CometGpuPoolEnable(bool) {}
void CometGpuPoolFence(bool) {}
void CometGpuMalloc(void**, size_t) { NO_GPU; }  // never reached: no device payload here
void CometGpuFree(void*, size_t) { NO_GPU; }
CometPoolStats CometGpuPoolQuery() {
  CometPoolStats s = {0, 0, 0, 0, 0, 0, 0};
  return s;
}
namespace {
CometPoolStats GpuPoolQueryCurrent() { return CometGpuPoolQuery(); }
}  // namespace
#endif  // CPU_ONLY

CometPoolStats CometPoolQueryHere() {
  return Caffe::mode() == Caffe::GPU ? GpuPoolQueryCurrent() : CometHostPoolQuery();
}

void CometPoolsSetHeadroom(double fraction) {
  {
    BlockPool& pool = HostPool();
    boost::mutex::scoped_lock lock(pool.mutex);
    pool.headroom = std::max(0.0, fraction);
  }
#ifndef CPU_ONLY
  UpdateGpuPools([fraction](GpuPools& all) { all.headroom = std::max(0.0, fraction); },
                 [fraction](int, BlockPool& pool) { pool.headroom = std::max(0.0, fraction); });
#endif
}

void CometPoolsMarkStep() {
  {
    BlockPool& pool = HostPool();
    boost::mutex::scoped_lock lock(pool.mutex);
    pool.MarkStep();
  }
#ifndef CPU_ONLY
  // This solver's device alone: with -gpu all each solver's thread marks its own steps, and one
  // marking every device's pool would cut the others' steps where its own begin.
  if (Caffe::mode() == Caffe::GPU) {
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    BlockPool& pool = GpuPool(device);
    boost::mutex::scoped_lock lock(pool.mutex);
    pool.MarkStep();
  }
#endif
}

}  // namespace caffe
