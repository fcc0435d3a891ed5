#ifndef CAFFE_COMET_BLOCK_POOL_HPP_
#define CAFFE_COMET_BLOCK_POOL_HPP_

// COMET-Caffe: the pool behind CometHostMalloc and CometGpuMalloc (pool.hpp), in a header of its
// own so that the tests can drive its choices directly. Not an interface: callers use pool.hpp.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <list>
#include <map>
#include <utility>
#include <vector>

#include "boost/thread/mutex.hpp"
#include "caffe/comet/pool.hpp"
#include "caffe/common.hpp"

namespace caffe {

// One kernel mapping (a VMA) of host memory: mremap moves only within one.
struct Piece {
  char* ptr;
  size_t len;  // a multiple of the page size
};
typedef std::vector<Piece> Pieces;

inline size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}
inline size_t RoundToPages(size_t size) { return (size + PageSize() - 1) / PageSize() * PageSize(); }

// Moves the pages of src (resident, no copy and no page fault) to dst, replacing what was there.
inline void MovePages(const Piece& src, char* dst) {
  void* moved = mremap(src.ptr, src.len, src.len, MREMAP_MAYMOVE | MREMAP_FIXED, dst);
  CHECK(moved == dst) << "COMET: moving " << src.len << " bytes of pooled memory failed";
}

// An assembled block may gather its pages from this many mappings at most; the rest is new.
// Pieces never merge again, so large blocks crumble: with 64, CaffeNet's 148 MB conv1 output at
// batch 128 reached the cap every step and faulted in 35-55 MB afresh. Every block stays below
// the cap, so the process's mappings stay far below the kernel's limit (vm.max_map_count).
const size_t kMaxPiecesPerBlock = 256;

// Freed blocks kept by (device, size) for the next allocation of that size. The pool tracks the
// blocks it handed out (allocated with its own alloc/free functions) and only ever caches those;
// in_use counts them. The cache is trimmed so that in_use + cached never exceeds the largest
// in_use seen: reuse saves the allocation and its page faults without raising the peak. Training
// repeats the same allocations every step, so the pool remembers the sizes the last step asked
// for, in order, and evicts the cached block whose size is asked for again furthest ahead.
//
// Host memory is not tied to a size: a request no cached block matches is assembled from the
// pages of cached blocks (furthest next use first), moved with mremap into one new range, so the
// pages that a step frees serve whatever it asks for next instead of faulting in afresh (CaffeNet
// at batch 256 asks for 53 blocks of 13 sizes a step; by exact size only half were reused).
//
// Device memory cannot move, and lossy streams differ in size every step: by exact size, the
// first H200 run allocated and freed about 45 blocks a CaffeNet step (cudaFree synchronizes).
// So device blocks come in sizes rounded up (BlockBytes: 2 MiB steps from 1 MiB on, which is
// cudaMalloc's own granularity there), and a request takes the smallest cached block that holds
// it with at most an eighth of it, or one rounding step, of waste (Fits). A device request that no
// cached block serves makes room first (MakeRoom): the cache is trimmed before the new block is
// allocated, not after, so the device never holds the full cache and the new block at once.
//
// Device blocks and streams: Caffe queues all its work on the default stream, so a block given
// back while kernels still read it is safe for the next allocation on that stream. A store's
// worker encodes and decodes on a stream of its own (stream.hpp); while any does (`fenced`), a
// block given back records an event on the stream it was given back from, and a taker on another
// stream makes its stream wait for that event (on the device: the host goes on). A block cached
// before fencing began was used on the default stream only: a taker on another stream waits for
// everything queued there so far.
class BlockPool {
 public:
  typedef std::pair<int, size_t> Key;
  typedef void (*FreeFn)(void* ptr, size_t size);
  struct Fences {
    void* (*record)(void* event, void* stream);  // records on stream (a new event when NULL)
    void (*wait)(void* event, void* stream);     // stream waits for the event
    void (*destroy)(void* event);
  };
  BlockPool(FreeFn free_fn, bool movable_pages, const Fences* fences = NULL)
      : enabled(0), headroom(0), fenced(0), in_use(0), cached(0), peak_in_use(0), peak_held(0),
        hits(0), misses(0), evicted(0), free_fn_(free_fn), movable_pages_(movable_pages),
        fences_(fences) {}

  static size_t RoundingStep(size_t size) {
    return size >= (size_t(1) << 20) ? size_t(2) << 20 : 512;
  }
  // The bytes a block for `size` is allocated with (the caller's cudaMalloc, and Track).
  size_t BlockBytes(size_t size) const {
    if (movable_pages_) return size;
    const size_t step = RoundingStep(size);
    return (size + step - 1) / step * step;
  }
  // A cached block for key, or NULL (the caller allocates BlockBytes(key.second) and calls
  // Track with that size). `stream`: where the taker uses it (device pools; NULL: the default).
  void* Take(const Key& asked, void* stream = NULL) {
    const Key key(asked.first, BlockBytes(asked.second));
    requests_.push_back(key);
    std::multimap<Key, std::list<Block>::iterator>::iterator it = by_key_.lower_bound(key);
    if (it == by_key_.end() || !Fits(key, it->first)) {
      if (movable_pages_ && !lru_.empty()) return Assemble(key);
      ++misses;
      return NULL;
    }
    const bool fencing = fences_ && fenced;
    // Among the blocks that fit, the smallest one given back on the taker's own stream: one
    // from the other stream would make the taker's stream wait for that stream's queue.
    for (std::multimap<Key, std::list<Block>::iterator>::iterator c = it;
         fencing && c != by_key_.end() && Fits(key, c->first); ++c) {
      if (c->second->marked ? c->second->stream == stream : stream == NULL) {
        it = c;
        break;
      }
    }
    Block b = *it->second;
    it->second->event = NULL;  // goes with the block
    Uncache(it->second);
    ++hits;
    if (fencing) {
      if (!b.marked && stream) {  // used on the default stream, before fencing began
        b.event = fences_->record(b.event, NULL);
        fences_->wait(b.event, stream);
      } else if (b.marked && b.stream != stream) {
        fences_->wait(b.event, stream);
      }
    }
    Track(b.ptr, b.key.second, b.pieces, b.event);
    return b.ptr;
  }
  void Track(void* ptr, size_t size, const Pieces& pieces = Pieces(), void* event = NULL) {
    Live& l = live_[ptr];
    l.size = size;
    l.pieces = pieces;
    l.event = event;  // kept for the block's next Give
    if (movable_pages_ && l.pieces.empty()) {
      const Piece whole = {static_cast<char*>(ptr), RoundToPages(size)};
      l.pieces.push_back(whole);
    }
    in_use += size;
    peak_in_use = std::max(peak_in_use, in_use);
    peak_held = std::max(peak_held, in_use + cached);  // before Trim: what the device held
    Trim();
  }
  // A request no cached block serves: cached blocks go (furthest next use first) until they and
  // a new block of `bytes` fit under the cap that the new block's use makes.
  void MakeRoom(size_t bytes) {
    const size_t peak = std::max(peak_in_use, in_use + bytes);
    const size_t cap = peak + static_cast<size_t>(headroom * peak);
    while (!lru_.empty() && in_use + cached + bytes > cap) Evict(Victim());
  }
  // Takes back a block the pool handed out (key: its device and the size asked for), last used
  // on `stream`: cached, or freed when the pool is off. False for any other block, which the
  // caller frees itself.
  bool Give(void* ptr, const Key& key, void* stream = NULL) {
    std::map<void*, Live>::iterator it = live_.find(ptr);
    if (it == live_.end()) return false;
    in_use -= it->second.size;
    Block b = {Key(key.first, it->second.size), ptr, Pieces(), it->second.event, stream, false};
    b.pieces.swap(it->second.pieces);
    live_.erase(it);
    if (!enabled) {
      Free(b);
      return true;
    }
    if (fences_ && fenced) {
      b.event = fences_->record(b.event, stream);
      b.marked = true;
    }
    Cache(b);
    Trim();
    return true;
  }
  void ReleaseCached() {
    for (std::list<Block>::iterator it = lru_.begin(); it != lru_.end(); ++it) Free(*it);
    evicted += lru_.size();
    lru_.clear();
    by_key_.clear();
    cached = 0;
  }
  // The last user is gone: the cache goes back, and the next user starts its own peak.
  void Disable() {
    headroom = 0;
    ReleaseCached();
    peak_in_use = peak_held = in_use;
    requests_.clear();
    last_step_.clear();
  }
  // A training step starts: what the last one asked for guides the next evictions.
  void MarkStep() {
    last_step_.swap(requests_);
    requests_.clear();
  }
  CometPoolStats Stats() const {
    CometPoolStats s = {in_use, cached, peak_in_use, peak_held, hits, misses, evicted};
    return s;
  }

  boost::mutex mutex;
  int enabled;
  double headroom;  // the cache may reach (1 + headroom) x the peak in use
  int fenced;       // streams besides the default one in use (device pools)
  size_t in_use, cached, peak_in_use;
  size_t peak_held;  // the most in use and cached together (what the process or device held)
  size_t hits, misses, evicted;

 private:
  struct Block {
    Key key;  // device, and the bytes the block has
    void* ptr;
    Pieces pieces;
    void* event;   // device pools: an event of the pool's own, or NULL
    void* stream;  // the stream it was given back from
    bool marked;   // event recorded there when it was given back
  };
  void Free(const Block& b) {
    free_fn_(b.ptr, b.key.second);  // cudaFree waits for the device: no fence needed
    if (b.event) fences_->destroy(b.event);
  }
  // A request is served by a cached block of its own size, or on a device by a larger one that
  // wastes at most an eighth of the request or one rounding step, whichever is more (host pages
  // move, so host blocks match exactly).
  bool Fits(const Key& request, const Key& block) const {
    if (request.first != block.first || block.second < request.second) return false;
    if (block.second == request.second) return true;
    if (movable_pages_) return false;
    const size_t waste = block.second - request.second;
    return waste <= std::max(request.second / 8, RoundingStep(request.second));
  }
  // Position in the last step's requests at which a block of key's size is asked for next (the
  // steps repeat, so one asked for only earlier comes after all of this step's); never: furthest.
  size_t NextUse(const Key& key) const {
    const size_t now = requests_.size(), n = last_step_.size();
    for (size_t i = now; i < n; ++i) if (Fits(last_step_[i], key)) return i;
    for (size_t i = 0; i < std::min(now, n); ++i) if (Fits(last_step_[i], key)) return n + i;
    return 2 * n + 1;
  }
  // The cached block to give up first: furthest next use; among equals the oldest (lru_ is
  // oldest first).
  std::list<Block>::iterator Victim() {
    std::list<Block>::iterator victim = lru_.begin();
    size_t furthest = NextUse(victim->key);
    for (std::list<Block>::iterator b = lru_.begin(); b != lru_.end(); ++b) {
      const size_t next = b->key == victim->key ? furthest : NextUse(b->key);
      if (next > furthest) {
        victim = b;
        furthest = next;
      }
    }
    return victim;
  }
  void Cache(const Block& b) {
    by_key_.insert(std::make_pair(b.key, lru_.insert(lru_.end(), b)));
    cached += b.key.second;
  }
  void Uncache(std::list<Block>::iterator block) {
    std::multimap<Key, std::list<Block>::iterator>::iterator it = by_key_.find(block->key);
    while (it->second != block) ++it;
    by_key_.erase(it);
    cached -= block->key.second;
    lru_.erase(block);
  }
  void Trim() {
    const size_t cap = peak_in_use + static_cast<size_t>(headroom * peak_in_use);
    while (!lru_.empty() && in_use + cached > cap) Evict(Victim());
  }
  void Evict(std::list<Block>::iterator victim) {
    Free(*victim);
    Uncache(victim);
    ++evicted;
  }
  // A new range for key filled with cached pages as far as they go (the rest is new memory);
  // a cached block used in part stays cached as its remainder.
  void* Assemble(const Key& key) {
    const size_t len = RoundToPages(key.second);
    char* const dst = static_cast<char*>(CometHostMap(len));
    Pieces pieces;
    size_t filled = 0;
    while (filled < len && !lru_.empty() && pieces.size() < kMaxPiecesPerBlock) {
      std::list<Block>::iterator source = Victim();
      Block rest = {Key(), NULL, Pieces(), NULL, NULL, false};
      for (size_t i = 0; i < source->pieces.size(); ++i) {
        Piece p = source->pieces[i];
        if (filled == len || pieces.size() == kMaxPiecesPerBlock) {
          rest.pieces.push_back(p);
          continue;
        }
        if (p.len > len - filled) {  // split: the tail stays where it is, as the remainder
          const Piece tail = {p.ptr + (len - filled), p.len - (len - filled)};
          rest.pieces.push_back(tail);
          p.len = len - filled;
        }
        MovePages(p, dst + filled);
        const Piece moved = {dst + filled, p.len};
        pieces.push_back(moved);
        filled += p.len;
      }
      Uncache(source);
      if (!rest.pieces.empty()) {
        rest.ptr = rest.pieces[0].ptr;
        size_t bytes = 0;
        for (size_t i = 0; i < rest.pieces.size(); ++i) bytes += rest.pieces[i].len;
        rest.key = Key(key.first, bytes);
        Cache(rest);
      }
    }
    if (filled < len) {  // the untouched rest of the new mapping
      const Piece fresh = {dst + filled, len - filled};
      pieces.push_back(fresh);
      ++misses;
    } else {
      ++hits;
    }
    Track(dst, key.second, pieces);
    return dst;
  }
  struct Live {
    size_t size;
    Pieces pieces;  // host blocks: the mappings the block is made of, in order
    void* event;    // device blocks: the event it had in the cache, recorded again at Give
  };
  std::list<Block> lru_;  // cached blocks, oldest first
  std::vector<Key> requests_, last_step_;  // sizes asked for in this step and in the last
  std::multimap<Key, std::list<Block>::iterator> by_key_;
  std::map<void*, Live> live_;
  FreeFn free_fn_;
  bool movable_pages_;  // host memory: pages may move between blocks (mremap)
  const Fences* fences_;
};

}  // namespace caffe

#endif  // CAFFE_COMET_BLOCK_POOL_HPP_
