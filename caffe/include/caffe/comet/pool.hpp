#ifndef CAFFE_COMET_POOL_HPP_
#define CAFFE_COMET_POOL_HPP_

// COMET-Caffe: the memory pools SyncedMemory allocates from while a COMET store is active
// (patch 0008 calls them), and the host mappings both the pools and large lossy payloads use.

#include <cstddef>

namespace caffe {

// Host memory straight from the kernel (mmap), not from malloc: a block given back is really
// returned, and malloc's heap is not fragmented by activation-sized blocks it would keep resident
// (glibc serves blocks below its adaptive mmap threshold, up to 32 MB, from the heap).
void* CometHostMap(size_t size);
void CometHostUnmap(void* ptr, size_t size);

// Host allocations of SyncedMemory (1 MB and more, CPU mode) go through a pool while a COMET
// store with memory_pool is active: a freed buffer is kept for the next allocation of the same
// size instead of going back to the kernel and faulting in again. The pool never holds more
// than the peak in use (times 1 + headroom), so the process's peak memory does not grow.
void CometHostMalloc(void** ptr, size_t size, bool* use_cuda);
void CometHostFree(void* ptr, size_t size, bool use_cuda);
void CometHostPoolEnable(bool on);

// GPU allocations of SyncedMemory go through a pool while a COMET store is active, so buffers
// released after compression are reused by the next iteration instead of cudaFree/cudaMalloc;
// like the host pool it holds no more than the peak in use.
void CometGpuMalloc(void** ptr, size_t size);
void CometGpuFree(void* ptr, size_t size);
void CometGpuPoolEnable(bool on);
// A stream besides the default one allocates from the device pools (on: one more, off: one
// fewer): blocks then carry events between streams (block_pool.hpp).
void CometGpuPoolFence(bool on);

class SyncedMemory;
// Upstream zero-fills fresh host and device memory when it is first accessed. Memory that the
// store itself fills whole the moment it is allocated (a decode, a rebuilt buffer, ReLU's
// gradient from its mask) skips that fill: while a CometFillWhole(mem) object lives, the
// allocation of `mem` on this thread is not zeroed (patch 0026). Scopes nest; the innermost one
// names the memory. Memory that a layer's Forward or Backward will fill whole carries a FILL
// marker instead (payload.hpp), set by the store only on memory it freed itself.
class CometFillWhole {
 public:
  explicit CometFillWhole(const SyncedMemory* mem);
  ~CometFillWhole();

 private:
  const SyncedMemory* previous_;
};
// Whether `mem`'s allocation now, on this thread, is one that a CometFillWhole covers or that
// its FILL marker announced (CometRestore, called by the same to_cpu/to_gpu just before).
bool CometFillsWhole(const SyncedMemory* mem);
// CometRestore's half: the allocation of `mem` that follows at once is filled whole.
void CometFillNext(const SyncedMemory* mem);

struct CometPoolStats {
  size_t in_use, cached, peak_in_use;  // bytes
  size_t peak_held;                    // the most in use and cached at once, bytes
  size_t hits, misses, evicted;        // allocations served from the pool, not; blocks freed
};
CometPoolStats CometGpuPoolQuery();
// A training step starts (both pools): the sizes asked for in the last step guide evictions.
void CometPoolsMarkStep();
// Lets both pools hold up to (1 + fraction) x their peak in use (comet.memory_pool_headroom).
void CometPoolsSetHeadroom(double fraction);
CometPoolStats CometHostPoolQuery();
// The pool that serves this thread's SyncedMemory in the current mode (GPU mode: the current
// device's pool; with -gpu all each solver's thread has its own device).
CometPoolStats CometPoolQueryHere();

}  // namespace caffe

#endif  // CAFFE_COMET_POOL_HPP_
