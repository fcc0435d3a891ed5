#ifndef CAFFE_COMET_GEMM_HPP_
#define CAFFE_COMET_GEMM_HPP_

#include <atomic>  // NOLINT(build/c++11)
#include <string>

namespace caffe {

// Large single-precision matrix products as fixed tiles, each a one-thread OpenBLAS call, that
// the cores' team (CometTeam) claims one by one. With a COMET store's worker running beside
// the step (CPU, comet { async }), three threads share the cores: OpenBLAS's own threading
// splits a product evenly over its threads and the one that lost its core to the worker holds
// the rest back, spinning. Tiles are claimed by whichever thread runs, so none waits for
// another. The tiles follow from the product's shape alone, never from timing, so a run gives
// the same numbers every time and a resume stays exact (docs/comet.md#asynchronous-work).
class CometGemm {
 public:
  // caffe_cpu_gemm<float>'s product (row major): C = alpha op(A) op(B) + beta C, op(A) M x K,
  // op(B) K x N. True when it ran here: as tiles, or, too small for tiles but large enough for
  // OpenBLAS to split it, as one OpenBLAS call on a thread fewer than the cores (on 2 cores the
  // calling thread alone: a part on the worker's core would hold the others back); false when
  // tiling is off or the product is smaller (the caller then calls BLAS, as upstream does).
  static bool Run(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
                  const float* B, float beta, float* C) {
    return users_.load(std::memory_order_relaxed) > 0 &&
           RunTiles(trans_a, trans_b, M, N, K, alpha, A, B, beta, C, false);
  }
  // The same tiles, one after the other on the calling thread (the tests' reference).
  static bool RunTilesInOrder(bool trans_a, bool trans_b, int M, int N, int K, float alpha,
                              const float* A, const float* B, float beta, float* C) {
    return RunTiles(trans_a, trans_b, M, N, K, alpha, A, B, beta, C, true);
  }
  // Tiles along rows (of C) or columns, and how many, for a product of this shape; 0 tiles
  // below the size worth splitting.
  static int Tiles(int M, int N, int K, bool* along_rows);
  // Whether tiling can work in this process: OpenBLAS's pthread build without thread affinity
  // (where openblas_set_num_threads only stores the count), on two cores or more; otherwise
  // the reason, in *why.
  static bool Available(std::string* why);
  // A store starts (true) or stops using tiles; products are tiled while any store does.
  static void Use(bool on);
  // Gives OpenBLAS's own threads the floating-point mode `mode` (float_mode.hpp), as a store's
  // step gives its own thread: a thread keeps the mode of the thread that made it, and OpenBLAS
  // makes its threads once, so this stops them and makes them again (about 70 us on 2 cores)
  // when they were made in another mode. Products too small for the tiles run on them. False
  // where this BLAS has no such threads (not OpenBLAS, or its OpenMP build). No BLAS call may
  // run meanwhile on another thread: a store calls it between its steps' products.
  static bool SetBlasThreadsMode(unsigned mode);
  // Whether SetBlasThreadsMode can work in this process.
  static bool CanSetBlasThreadsMode();

 private:
  static bool RunTiles(bool trans_a, bool trans_b, int M, int N, int K, float alpha,
                       const float* A, const float* B, float beta, float* C, bool in_order);
  static std::atomic<int> users_;
};

}  // namespace caffe

#endif  // CAFFE_COMET_GEMM_HPP_
