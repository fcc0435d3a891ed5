// COMET-Caffe: large matrix products as fixed tiles on the cores' team (include/caffe/comet/gemm.hpp).
#include <dlfcn.h>
#include <stdint.h>

#include <algorithm>
#include <mutex>  // NOLINT(build/c++11)
#include <string>

#include "caffe/comet/float_mode.hpp"
#include "caffe/comet/gemm.hpp"
#include "caffe/comet/worker.hpp"
#include "caffe/common.hpp"
#include "caffe/util/mkl_alternate.hpp"

namespace caffe {

std::atomic<int> CometGemm::users_(0);

namespace {

// Tiles of 8 M flops or more (some 80 us on one core) pay for waking a thread; two per core at
// most keep OpenBLAS's packing of the other operand, once per tile, small (on 2 cores 8 tiles
// lost up to 25% on CaffeNet's convolutions against OpenBLAS's own split, 2 or 4 tiles
// stayed within -8% to +7%).
const double kTileFlops = 8388608.0;
const int kTilesPerCore = 2;
// Below the tiles, products that OpenBLAS would split over its threads (M*N*K >= 262144, its
// default SMP_THRESHOLD_MIN * GEMM_MULTITHREAD_THRESHOLD) run on one thread fewer than the
// cores, leaving the worker's core to it (on 2 cores: the calling thread alone): split over
// every core, one part shares the worker's core and the others wait for it. GoogLeNet's
// inception branches make thousands a step (1x1 reductions to 16-64 channels): on 2 cores one
// thread for them cut its step by about 5% with COMET on (docs/comet.md).
const double kSplitFlops = 524288.0;
const int kTileAlign = 16;  // rows or columns: a multiple of the kernels' unrolling

// Rows or columns of C in units of kTileAlign.
int Units(int dim) { return (dim + kTileAlign - 1) / kTileAlign; }

// A symbol of the BLAS this library calls: in the global scope, or else in the library that
// holds cblas_sgemm (pycaffe's module, loaded without RTLD_GLOBAL, keeps it out of that scope).
void* BlasSymbol(const char* name) {
  void* symbol = dlsym(RTLD_DEFAULT, name);
  Dl_info info;
  if (symbol || !dladdr(reinterpret_cast<void*>(&cblas_sgemm), &info) || !info.dli_fname) return symbol;
  void* lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (lib) {
    symbol = dlsym(lib, name);
    dlclose(lib);  // it stays loaded: RTLD_NOLOAD only counted one more reference
  }
  return symbol;
}

// OpenBLAS, found at run time: the process may link another BLAS.
struct OpenBlas {
  void (*set_threads)(int);
  int threads;      // its own count, for every call but our tiles
  std::string why;  // why tiling cannot work here; empty when it can
  std::mutex mutex;  // one tiled product or remaking at a time: the count is the whole process's
  // The pthread build's thread pool, stopped and started again (its own fork handlers); null
  // elsewhere (an OpenMP build's threads are OpenMP's).
  int (*stop_threads)();
  int (*start_threads)();
  unsigned threads_mode;  // the mode its threads were made in, flags cleared; ~0u: not known
  OpenBlas() : set_threads(NULL), threads(0), stop_threads(NULL), start_threads(NULL),
               threads_mode(~0u) {
    typedef int (*GetThreads)();
    typedef char* (*GetConfig)();
    set_threads = reinterpret_cast<void (*)(int)>(BlasSymbol("openblas_set_num_threads"));
    GetThreads get = reinterpret_cast<GetThreads>(BlasSymbol("openblas_get_num_threads"));
    GetConfig config = reinterpret_cast<GetConfig>(BlasSymbol("openblas_get_config"));
    if (!set_threads || !get || !config) {
      why = "the BLAS in this process is not OpenBLAS";
    } else {
      const std::string c(config());
      if (c.find("OPENMP") == std::string::npos) {
        stop_threads = reinterpret_cast<int (*)()>(BlasSymbol("blas_thread_shutdown_"));
        start_threads = reinterpret_cast<int (*)()>(BlasSymbol("blas_thread_init"));
        if (!stop_threads || !start_threads) stop_threads = start_threads = NULL;
      }
      threads = get();
      // With affinity a change of count pins or unpins the calling thread; with OpenMP the count
      // is each thread's own setting, so the team's threads would keep theirs.
      if (c.find("NO_AFFINITY") == std::string::npos) why = "OpenBLAS pins its threads (" + c + ")";
      else if (c.find("OPENMP") != std::string::npos) why = "OpenBLAS uses OpenMP (" + c + ")";
      else if (threads < 2) why = "OpenBLAS runs one thread (OPENBLAS_NUM_THREADS)";
      else if (CometTeam::Get().size() < 2) why = "this machine has one core";
    }
    if (!why.empty()) set_threads = NULL;
  }
  static OpenBlas& Get() {
    static OpenBlas* blas = new OpenBlas();  // never destroyed: threads may outlive statics
    return *blas;
  }
};

struct Product {
  bool trans_a, trans_b, rows;
  int M, N, K, tiles;
  float alpha, beta;
  const float* A;
  const float* B;
  float* C;

  // Tile t: rows (or columns) [lo, hi) of C.
  void Run(int t) const {
    const int dim = rows ? M : N, units = Units(dim);
    const int lo = std::min(dim, kTileAlign * static_cast<int>(static_cast<int64_t>(units) * t / tiles));
    const int hi = t + 1 == tiles ? dim
        : std::min(dim, kTileAlign * static_cast<int>(static_cast<int64_t>(units) * (t + 1) / tiles));
    if (hi <= lo) return;
    const int lda = trans_a ? M : K, ldb = trans_b ? K : N;
    const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans;
    const CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;
    if (rows) {  // op(A)'s rows lo..hi: A's rows, or its columns when transposed
      const float* a = trans_a ? A + lo : A + static_cast<int64_t>(lo) * K;
      cblas_sgemm(CblasRowMajor, ta, tb, hi - lo, N, K, alpha, a, lda, B, ldb, beta,
                  C + static_cast<int64_t>(lo) * N, N);
    } else {  // op(B)'s columns lo..hi: B's columns, or its rows when transposed
      const float* b = trans_b ? B + static_cast<int64_t>(lo) * K : B + lo;
      cblas_sgemm(CblasRowMajor, ta, tb, M, hi - lo, K, alpha, A, lda, b, ldb, beta, C + lo, N);
    }
  }
  static void Task(void* arg, int t) { static_cast<const Product*>(arg)->Run(t); }
};

}  // namespace

int CometGemm::Tiles(int M, int N, int K, bool* along_rows) {
  const double flops = 2.0 * M * N * K;
  *along_rows = M >= N;  // split the larger side: the other operand is the one each tile packs
  const int units = Units(*along_rows ? M : N);
  const int most = kTilesPerCore * static_cast<int>(CometTeam::Get().size());
  int tiles = static_cast<int>(std::min<double>(most, flops / kTileFlops));
  tiles = std::min(tiles, units);
  return tiles >= 2 ? tiles : 0;
}

bool CometGemm::Available(std::string* why) {
  OpenBlas& blas = OpenBlas::Get();
  if (why) *why = blas.why;
  return blas.set_threads != NULL;
}

void CometGemm::Use(bool on) { users_ += on ? 1 : -1; }

bool CometGemm::CanSetBlasThreadsMode() { return OpenBlas::Get().stop_threads != NULL; }

bool CometGemm::SetBlasThreadsMode(unsigned mode) {
  OpenBlas& blas = OpenBlas::Get();
  if (!blas.stop_threads) return false;
  std::lock_guard<std::mutex> lock(blas.mutex);
  const unsigned want = mode & ~kCometFloatFlags;
  if (blas.threads_mode == want) return true;
  // A new thread starts in its maker's mode: make them again from this thread, in `mode`.
  const unsigned caller = CometFloatMode();
  CometSetFloatMode(want | (caller & kCometFloatFlags));
  blas.stop_threads();
  blas.start_threads();
  CometSetFloatMode(caller);
  blas.threads_mode = want;
  return true;
}

bool CometGemm::RunTiles(bool trans_a, bool trans_b, int M, int N, int K, float alpha,
                         const float* A, const float* B, float beta, float* C, bool in_order) {
  OpenBlas& blas = OpenBlas::Get();
  Product p;
  p.tiles = Tiles(M, N, K, &p.rows);
  if (!blas.set_threads) return false;
  int threads = 1;  // OpenBLAS's count for each call: one a tile
  if (p.tiles == 0) {  // below the tiles: one call, leaving the worker's core (kSplitFlops)
    if (in_order || 2.0 * M * N * K < kSplitFlops) return false;
    threads = std::max(1, std::min(blas.threads, static_cast<int>(CometTeam::Get().size()) - 1));
    if (threads == blas.threads) return false;
    p.tiles = 1;
  }
  p.trans_a = trans_a;
  p.trans_b = trans_b;
  p.M = M;
  p.N = N;
  p.K = K;
  p.alpha = alpha;
  p.beta = beta;
  p.A = A;
  p.B = B;
  p.C = C;
  // Who runs which tile changes nothing in the numbers: the team's threads join unless a worker
  // needs their core (on 2 cores: the step then runs every tile itself, the worker the other core).
  // OpenBLAS runs one thread for the tiles and its own count for every other call: each call's
  // count follows from the program, never from timing, so neither do its numbers.
  std::lock_guard<std::mutex> lock(blas.mutex);
  blas.set_threads(threads);
  if (in_order || p.tiles == 1) {
    for (int t = 0; t < p.tiles; ++t) p.Run(t);
  } else {
    CometTeam::Get().Run(p.tiles, &Product::Task, &p, false);
  }
  blas.set_threads(blas.threads);
  return true;
}

}  // namespace caffe
