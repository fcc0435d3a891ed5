// COMET-Caffe: the memory pools of SyncedMemory (include/caffe/comet/pool.hpp).
#include <algorithm>
#include <list>
#include <map>
#include <utility>
#include <vector>

#include <sys/mman.h>

#include "boost/thread/mutex.hpp"
#include "caffe/comet/pool.hpp"
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

// Freed blocks kept by (device, size) for the next allocation of that size. The pool tracks the
// blocks it handed out (allocated with its own alloc/free functions) and only ever caches those;
// in_use counts them. The cache is trimmed so that in_use + cached never exceeds the largest
// in_use seen: reuse saves the allocation and its page faults without raising the peak. Training
// repeats the same allocations every step, so the pool remembers the sizes the last step asked
// for, in order, and evicts the cached block whose size is asked for again furthest ahead.
class BlockPool {
 public:
  typedef std::pair<int, size_t> Key;
  typedef void (*FreeFn)(void* ptr, size_t size);
  explicit BlockPool(FreeFn free_fn)
      : enabled(0), headroom(0), in_use(0), cached(0), peak_in_use(0), hits(0), misses(0),
        evicted(0), free_fn_(free_fn) {}

  // A cached block for key, or NULL (the caller allocates and calls Track).
  void* Take(const Key& key) {
    requests_.push_back(key);
    std::multimap<Key, std::list<Block>::iterator>::iterator it = by_key_.find(key);
    if (it == by_key_.end()) {
      ++misses;
      return NULL;
    }
    void* ptr = it->second->ptr;
    lru_.erase(it->second);
    by_key_.erase(it);
    cached -= key.second;
    ++hits;
    Track(ptr, key.second);
    return ptr;
  }
  void Track(void* ptr, size_t size) {
    live_[ptr] = size;
    in_use += size;
    peak_in_use = std::max(peak_in_use, in_use);
    Trim();
  }
  // Takes back a block the pool handed out: cached, or freed when the pool is off. False for
  // any other block, which the caller frees itself.
  bool Give(void* ptr, const Key& key) {
    std::map<void*, size_t>::iterator it = live_.find(ptr);
    if (it == live_.end()) return false;
    in_use -= it->second;
    live_.erase(it);
    if (!enabled) {
      free_fn_(ptr, key.second);
      return true;
    }
    Block b = {key, ptr};
    by_key_.insert(std::make_pair(key, lru_.insert(lru_.end(), b)));
    cached += key.second;
    Trim();
    return true;
  }
  void ReleaseCached() {
    for (std::list<Block>::iterator it = lru_.begin(); it != lru_.end(); ++it)
      free_fn_(it->ptr, it->key.second);
    evicted += lru_.size();
    lru_.clear();
    by_key_.clear();
    cached = 0;
  }
  // The last user is gone: the cache goes back, and the next user starts its own peak.
  void Disable() {
    headroom = 0;
    ReleaseCached();
    peak_in_use = in_use;
    requests_.clear();
    last_step_.clear();
  }
  // A training step starts: what the last one asked for guides the next evictions.
  void MarkStep() {
    last_step_.swap(requests_);
    requests_.clear();
  }
  CometPoolStats Stats() const {
    CometPoolStats s = {in_use, cached, peak_in_use, hits, misses, evicted};
    return s;
  }

  boost::mutex mutex;
  int enabled;
  double headroom;  // the cache may reach (1 + headroom) x the peak in use
  size_t in_use, cached, peak_in_use, hits, misses, evicted;

 private:
  struct Block {
    Key key;
    void* ptr;
  };
  // Position in the last step's requests at which key is asked for next (the steps repeat, so
  // a size asked for only earlier comes after all of this step's); never asked: furthest.
  size_t NextUse(const Key& key) const {
    const size_t now = requests_.size(), n = last_step_.size();
    for (size_t i = now; i < n; ++i) if (last_step_[i] == key) return i;
    for (size_t i = 0; i < std::min(now, n); ++i) if (last_step_[i] == key) return n + i;
    return 2 * n + 1;
  }
  void Trim() {
    const size_t cap = peak_in_use + static_cast<size_t>(headroom * peak_in_use);
    while (!lru_.empty() && in_use + cached > cap) {
      // the victim: furthest next use; among equals the oldest (lru_ is oldest first)
      std::list<Block>::iterator victim = lru_.begin();
      size_t furthest = NextUse(victim->key);
      for (std::list<Block>::iterator b = lru_.begin(); b != lru_.end(); ++b) {
        const size_t next = b->key == victim->key ? furthest : NextUse(b->key);
        if (next > furthest) {
          victim = b;
          furthest = next;
        }
      }
      std::multimap<Key, std::list<Block>::iterator>::iterator it = by_key_.find(victim->key);
      while (it->second != victim) ++it;
      by_key_.erase(it);
      cached -= victim->key.second;
      free_fn_(victim->ptr, victim->key.second);
      lru_.erase(victim);
      ++evicted;
    }
  }
  std::list<Block> lru_;  // cached blocks, oldest first
  std::vector<Key> requests_, last_step_;  // sizes asked for in this step and in the last
  std::multimap<Key, std::list<Block>::iterator> by_key_;
  std::map<void*, size_t> live_;
  FreeFn free_fn_;
};



BlockPool& HostPool() {
  static BlockPool* pool = new BlockPool(CometHostUnmap);  // never destroyed: frees come at exit
  return *pool;
}

// Small blocks are served well by malloc; the pool is for activation-sized ones.
const size_t kHostPoolMinBytes = 1 << 20;

bool HostPoolApplies(size_t size) {
  return size >= kHostPoolMinBytes && Caffe::mode() == Caffe::CPU;  // GPU mode: pinned memory
}

}  // namespace

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

// One pool per device: each caps its cache at its own device's peak, and a trim or an
// out-of-memory retry frees only that device's blocks. Pools are made on first use with the
// settings all pools share; they are never destroyed (frees come at exit).
struct GpuPools {
  GpuPools() : enabled(0), headroom(0) {}
  boost::mutex mutex;  // guards the map and the shared settings; each pool has its own
  int enabled;
  double headroom;
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
  BlockPool* pool = new BlockPool(GpuRelease);
  pool->enabled = all.enabled;
  pool->headroom = all.headroom;
  all.by_device[device] = pool;
  return *pool;
}

// Applies f to every device's pool, under each pool's lock.
template <typename F>
void ForEachGpuPool(F f) {
  GpuPools& all = AllGpuPools();
  boost::mutex::scoped_lock lock(all.mutex);
  for (std::map<int, BlockPool*>::iterator it = all.by_device.begin();
       it != all.by_device.end(); ++it) {
    boost::mutex::scoped_lock pool_lock(it->second->mutex);
    f(*it->second);
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
  {
    GpuPools& all = AllGpuPools();
    boost::mutex::scoped_lock lock(all.mutex);
    all.enabled += on ? 1 : -1;
  }
  ForEachGpuPool([on](BlockPool& pool) {
    pool.enabled += on ? 1 : -1;
    if (!pool.enabled) pool.Disable();
  });
}

// Blocks are reused only by allocations on the default stream of the threads that use the pool
// (solver threads): the data layers' prefetch threads allocate plainly (patch 0008), so a cached
// block is never handed to work on another stream while the default stream may still read it.
void CometGpuMalloc(void** ptr, size_t size) {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  BlockPool& pool = GpuPool(device);
  boost::mutex::scoped_lock lock(pool.mutex);
  if (pool.enabled && (*ptr = pool.Take(BlockPool::Key(device, size)))) return;
  cudaError_t err = cudaMalloc(ptr, size);
  if (err == cudaErrorMemoryAllocation && pool.cached) {
    cudaGetLastError();  // clear it, give this device's cache back and try once more
    pool.ReleaseCached();
    err = cudaMalloc(ptr, size);
  }
  CUDA_CHECK(err);
  if (pool.enabled) pool.Track(*ptr, size);
}

void CometGpuFree(void* ptr, size_t size) {
  const int device = DeviceOf(ptr);
  BlockPool& pool = GpuPool(device);
  boost::mutex::scoped_lock lock(pool.mutex);
  if (!pool.Give(ptr, BlockPool::Key(device, size))) CUDA_CHECK(cudaFree(ptr));
}

CometPoolStats CometGpuPoolQuery() {  // all devices together
  CometPoolStats total = {0, 0, 0, 0, 0, 0};
  ForEachGpuPool([&total](BlockPool& pool) {
    const CometPoolStats s = pool.Stats();
    total.in_use += s.in_use;
    total.cached += s.cached;
    total.peak_in_use += s.peak_in_use;
    total.hits += s.hits;
    total.misses += s.misses;
    total.evicted += s.evicted;
  });
  return total;
}
#else
void CometGpuPoolEnable(bool) {}
void CometGpuMalloc(void**, size_t) { NO_GPU; }  // never reached: no device payload here
void CometGpuFree(void*, size_t) { NO_GPU; }
CometPoolStats CometGpuPoolQuery() {
  CometPoolStats s = {0, 0, 0, 0, 0, 0};
  return s;
}
#endif  // CPU_ONLY

CometPoolStats CometPoolQuery() {
  return Caffe::mode() == Caffe::GPU ? CometGpuPoolQuery() : CometHostPoolQuery();
}

void CometPoolsSetHeadroom(double fraction) {
  {
    BlockPool& pool = HostPool();
    boost::mutex::scoped_lock lock(pool.mutex);
    pool.headroom = std::max(0.0, fraction);
  }
#ifndef CPU_ONLY
  {
    GpuPools& all = AllGpuPools();
    boost::mutex::scoped_lock lock(all.mutex);
    all.headroom = std::max(0.0, fraction);
  }
  ForEachGpuPool([fraction](BlockPool& pool) { pool.headroom = std::max(0.0, fraction); });
#endif
}

void CometPoolsMarkStep() {
  {
    BlockPool& pool = HostPool();
    boost::mutex::scoped_lock lock(pool.mutex);
    pool.MarkStep();
  }
#ifndef CPU_ONLY
  ForEachGpuPool([](BlockPool& pool) { pool.MarkStep(); });
#endif
}

}  // namespace caffe
