// COMET-Caffe: tests of the activation store, its payloads and its error bounds (CPU).
#include <algorithm>
#include <atomic>  // NOLINT(build/c++11)
#include <chrono>  // NOLINT(build/c++11)
#include <climits>
#include <condition_variable>  // NOLINT(build/c++11)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>  // NOLINT(build/c++11)
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>
#include <thread>  // NOLINT(build/c++11)

#include <dlfcn.h>
#include <sys/resource.h>

#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

#include "caffe/blob.hpp"
#include "caffe/comet/batchnorm_moments.hpp"
#include "caffe/comet/block_pool.hpp"
#include "caffe/comet/codes.hpp"
#include "caffe/comet/curand_state.hpp"
#include "caffe/comet/float_mode.hpp"
#include "caffe/comet/error_model.hpp"
#include "caffe/comet/gemm.hpp"
#include "caffe/comet/layer_access.hpp"
#include "caffe/comet/lrn_within.hpp"
#include "caffe/comet/net_callbacks.hpp"
#include "caffe/comet/payload.hpp"
#include "caffe/comet/store.hpp"
#include "caffe/comet/worker.hpp"
#include "sz/sz.h"
#include "caffe/common.hpp"
#include "caffe/filler.hpp"
#include "caffe/layers/batch_norm_layer.hpp"
#include "caffe/layers/conv_layer.hpp"
#include "caffe/layers/deconv_layer.hpp"
#include "caffe/layers/elu_layer.hpp"
#include "caffe/layers/exp_layer.hpp"
#include "caffe/layers/inner_product_layer.hpp"
#include "caffe/layers/lrn_layer.hpp"
#include "caffe/layers/pooling_layer.hpp"
#include "caffe/layers/relu_layer.hpp"
#include "caffe/layers/scale_layer.hpp"
#include "caffe/layers/sigmoid_layer.hpp"
#include "caffe/layers/softmax_layer.hpp"
#include "caffe/layers/swish_layer.hpp"
#include "caffe/layers/tanh_layer.hpp"
#include "caffe/sgd_solvers.hpp"
#include "caffe/solver.hpp"
#include "caffe/syncedmem.hpp"
#include "caffe/util/io.hpp"
#include "caffe/util/math_functions.hpp"
#include "caffe/util/rng.hpp"

#include "caffe/test/test_caffe_main.hpp"

namespace caffe {

namespace {

// ReLU-like data: a fraction `zeros` of exact zeros, the rest uniform in (0, scale).
void FillActivations(Blob<float>* b, float zeros, float scale, unsigned seed) {
  float* x = b->mutable_cpu_data();
  srand(seed);
  for (int i = 0; i < b->count(); ++i) {
    const float u = static_cast<float>(rand()) / RAND_MAX;  // NOLINT
    const float v = static_cast<float>(rand()) / RAND_MAX;  // NOLINT
    x[i] = u < zeros ? 0.f : scale * v;
  }
}

// What a COMET fatal error says while `run` runs with fatal errors thrown, as pycaffe has them
// ("" when there is none).
template <typename F>
std::string FatalMessageOf(F run) {
  CometSetFatalThrows(true);
  std::string what;
  try {
    run();
  } catch (const std::runtime_error& e) {
    what = e.what();
  }
  CometSetFatalThrows(false);
  return what;
}

float MaxAbsDiff(const float* a, const float* b, int n) {
  float m = 0;
  for (int i = 0; i < n; ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

// A 3x3 stride-2 max pooling (pad 1: windows cut by the border, and overlapping ones) run forward
// once on ReLU-like data, so that its argmax holds real indices.
struct MaxPoolingRun {
  explicit MaxPoolingRun(const LayerParameter& lp, int n = 2, int c = 3, int h = 11, int w = 13)
      : layer(lp), bottom(n, c, h, w) {
    FillActivations(&bottom, 0.2f, 1.f, 3);
    std::vector<Blob<float>*> bv(1, &bottom), tv(1, &top);
    layer.SetUp(bv, tv);
    layer.Forward(bv, tv);
  }
  static LayerParameter Param() {
    LayerParameter lp;
    PoolingParameter* pp = lp.mutable_pooling_param();
    pp->set_pool(PoolingParameter_PoolMethod_MAX);
    pp->set_kernel_size(3);
    pp->set_stride(2);
    pp->set_pad(1);
    lp.add_top("pool");
    return lp;
  }
  PoolingLayer<float> layer;
  Blob<float> bottom, top;
};

// Changes one argmax code of a packed stream to one that names no element of its window (past
// the window's codes, or padding) and has the same popcount, so that the bit check alone cannot
// see it. False when the geometry leaves no such code (a 2x2 window without padding uses every
// 2-bit code on every element).
bool SwapInACodeOutsideItsWindow(uint32_t* words, size_t count, int bits,
                                 const comet_codes::PoolGeometry& g) {
  for (size_t i = 0; i < count; ++i) {
    const uint32_t c = comet_codes::code_at(words, i, bits);
    for (uint32_t d = 0; d < (1u << bits); ++d) {
      if (__builtin_popcount(d) != __builtin_popcount(c) ||
          comet_codes::argmax_code_names_its_window(d, i, g))
        continue;
      const size_t bit = i * bits;
      words[bit / 32] = (words[bit / 32] & ~(((1u << bits) - 1u) << (bit % 32))) |
                        (d << (bit % 32));
      return true;
    }
  }
  return false;
}

}  // namespace

class CometPayloadTest : public ::testing::Test {
 protected:
  virtual void SetUp() { Caffe::set_mode(Caffe::CPU); }
};

// The cores' team: every task of a call runs once, a call with more tasks than threads too, and
// two threads calling at once both get all of theirs (the second on threads of its own).
TEST(CometTeamTest, RunsEveryTaskOnceAlsoWhenTwoThreadsCallAtOnce) {
  struct Counts {
    std::vector<int> hits;
    std::mutex m;
    static void Hit(void* arg, int t) {
      Counts* c = static_cast<Counts*>(arg);
      std::lock_guard<std::mutex> lock(c->m);
      ++c->hits[t];
    }
  };
  Counts one;
  one.hits.assign(37, 0);
  CometTeam::Get().Run(37, &Counts::Hit, &one);
  EXPECT_EQ(one.hits, std::vector<int>(37, 1));
  EXPECT_EQ(CometTeam::Get().size(), std::max(1u, std::thread::hardware_concurrency()));
  Counts a, b;
  a.hits.assign(5, 0);
  b.hits.assign(5, 0);
  std::thread other([&b] {
    for (int i = 0; i < 300; ++i) CometTeam::Get().Run(5, &Counts::Hit, &b);
  });
  for (int i = 0; i < 300; ++i) CometTeam::Get().Run(5, &Counts::Hit, &a);
  other.join();
  EXPECT_EQ(a.hits, std::vector<int>(5, 300));
  EXPECT_EQ(b.hits, std::vector<int>(5, 300));
}

// On 2 cores a call made while the worker is busy runs on the caller alone (the worker keeps the
// other core), and a team thread joins for the tasks left as soon as the worker goes idle, so
// that core does not idle until the call ends.
TEST(CometTeamTest, ATeamThreadJoinsWhenTheWorkerGoesIdle) {
  if (CometTeam::Get().size() != 2) return;  // the rule below is the 2-core one
  struct Tasks {
    std::mutex m;
    std::vector<std::thread::id> ran;
    std::mutex* gate;  // held while the worker is busy; task 0 lets the worker finish
    bool release;
    static void Run(void* arg, int t) {
      Tasks* k = static_cast<Tasks*>(arg);
      if (t == 0 && k->release) k->gate->unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      std::lock_guard<std::mutex> lock(k->m);
      k->ran[t] = std::this_thread::get_id();
    }
  };
  for (int release = 0; release < 2; ++release) {
    CometWorker worker;
    std::mutex gate;
    gate.lock();
    const uint64_t job = worker.Submit([&gate] { std::lock_guard<std::mutex> hold(gate); });
    while (!CometWorker::AnyBusy()) std::this_thread::yield();
    Tasks k;
    k.ran.assign(12, std::thread::id());
    k.gate = &gate;
    k.release = release == 1;
    CometTeam::Get().Run(12, &Tasks::Run, &k);
    int others = 0;
    for (int t = 0; t < 12; ++t) others += k.ran[t] != std::this_thread::get_id();
    if (release) {
      EXPECT_GT(others, 0) << "no team thread joined after the worker went idle";
    } else {
      EXPECT_EQ(others, 0) << "a team thread took the busy worker's core";
      gate.unlock();
    }
    worker.Wait(job);
  }
}

// The team's tasks run in the caller's floating-point mode (float_mode.hpp): a store's step flushes
// denormals, and the tiles of its products run on team threads.
TEST(CometTeamTest, TasksRunInTheCallersFloatMode) {
  struct Modes {
    std::mutex m;
    std::vector<unsigned> mode;
    std::vector<std::thread::id> who;
    static void Run(void* arg, int t) {
      Modes* k = static_cast<Modes*>(arg);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::lock_guard<std::mutex> lock(k->m);
      k->mode[t] = CometFloatMode();
      k->who[t] = std::this_thread::get_id();
    }
  };
  const unsigned original = CometFloatMode();
  for (int flush = 1; flush >= 0; --flush) {
    const unsigned mine = flush ? CometFlushDenormals() : CometFloatMode();
    if (flush) {
      ASSERT_NE(CometFloatMode() & ~kCometFloatFlags, mine & ~kCometFloatFlags)
          << "no mode to set here";
    }
    Modes k;
    k.mode.assign(16, 0);
    k.who.assign(16, std::thread::id());
    CometTeam::Get().Run(16, &Modes::Run, &k);
    int others = 0;
    for (int t = 0; t < 16; ++t) {
      // the control bits, not the sticky exception flags
      EXPECT_EQ(k.mode[t] & ~kCometFloatFlags, CometFloatMode() & ~kCometFloatFlags)
          << "task " << t << (flush ? " (flushing)" : "");
      others += k.who[t] != std::this_thread::get_id();
    }
    if (CometTeam::Get().size() > 1) {
      EXPECT_GT(others, 0) << "no team thread ran a task";
    }
    CometSetFloatMode(original);
  }
}

// Tiled products: every transpose, beta 0 and not, tiles along rows and along columns. The team's
// result equals the tiles run one after the other on one thread bit for bit (who runs a tile
// changes nothing), also while a worker is busy (the step then runs every tile itself on 2
// cores), and stays within float rounding of the product in double.
// A step that waits for a ticket runs the jobs up to it that have not started, on its own
// thread, beside the worker's; a ticket is done only once every job before it has ended, even
// when a later one ended first.
TEST(CometWorkerTest, AWaitingStepRunsQueuedJobsAndTicketsEndInOrder) {
  CometWorker worker;
  std::mutex m;
  std::condition_variable cv;
  bool release = false, a_started = false;
  bool b_done_while_a_ran = true;
  std::thread::id ran_b, ran_c;
  const uint64_t a = worker.Submit([&] {  // holds the worker until job c lets it go
    std::unique_lock<std::mutex> lock(m);
    a_started = true;
    cv.notify_all();
    cv.wait_for(lock, std::chrono::seconds(20), [&] { return release; });
  });
  {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return a_started; });
  }
  const uint64_t b = worker.Submit([&] { ran_b = std::this_thread::get_id(); });
  const uint64_t c = worker.Submit([&] {
    ran_c = std::this_thread::get_id();
    b_done_while_a_ran = worker.Done(b);
    std::lock_guard<std::mutex> lock(m);
    release = true;
    cv.notify_all();
  });
  EXPECT_FALSE(worker.Done(a));
  worker.Wait(c);
  EXPECT_EQ(ran_b, std::this_thread::get_id()) << "job b waited for the worker";
  EXPECT_EQ(ran_c, std::this_thread::get_id()) << "job c waited for the worker";
  EXPECT_FALSE(b_done_while_a_ran) << "ticket b was done while job a still ran";
  EXPECT_TRUE(worker.Done(a));
  EXPECT_TRUE(worker.Done(c));
  // the worker still runs, by itself, what the step does not wait for
  std::atomic<bool> ran_d(false);
  const uint64_t d = worker.Submit([&] { ran_d = true; });
  for (int i = 0; i < 20000 && !worker.Done(d); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_TRUE(worker.Done(d));
  EXPECT_TRUE(ran_d);
}

namespace {

// Values of a 256^3 product whose sums are denormal (products of 1e-21 with 1e-21, 256 each):
// C's part that a thread with flush-to-zero computes comes out 0. How many of C's values are not.
int NonzeroOfADenormalProduct() {
  const int n = 256;
  std::vector<float> A(n * n, 1e-21f), B(n * n, 1e-21f), C(n * n, 7.f);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.f, A.data(), n, B.data(), n,
              0.f, C.data(), n);
  return static_cast<int>(n * n - std::count(C.begin(), C.end(), 0.f));
}

// Flush-to-zero alone (bit 15): DAZ on the calling thread would also zero what OpenBLAS's
// threads compute from the blocks it packed, and hide their own mode.
unsigned FlushToZeroOnly(unsigned mode) { return (mode & ~(kCometFloatFlags | 0x40u)) | 0x8000u; }

int OpenBlasThreads() {
  typedef int (*GetThreads)();
  GetThreads threads = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return threads ? threads() : 0;
}

void SetOpenBlasThreads(int n) {
  typedef void (*SetThreads)(int);
  SetThreads set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  ASSERT_TRUE(set != NULL);
  set(n);
}

}  // namespace

TEST(CometGemmTest, TilesGiveTheProductWhoeverRunsThem) {
  std::string why;
  if (!CometGemm::Available(&why)) {
    std::cout << "CometGemm not available here (" << why << "): nothing to check" << std::endl;
    return;
  }
  const int full = OpenBlasThreads();
  ASSERT_GT(full, 0);
  bool rows;
  EXPECT_EQ(CometGemm::Tiles(16, 16, 16, &rows), 0);  // small: BLAS as upstream
  float tiny = 0;
  EXPECT_FALSE(CometGemm::Run(false, false, 1, 1, 1, 1.f, &tiny, &tiny, 0.f, &tiny));
  CometGemm::Use(true);
  const int shapes[][3] = {{64, 3136, 576}, {1000, 37, 409}, {33, 999, 700}};
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (int s = 0; s < 3; ++s) {
    const int M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
    EXPECT_GE(CometGemm::Tiles(M, N, K, &rows), 2) << M << "x" << N << "x" << K;
    EXPECT_EQ(rows, M >= N);
    std::vector<float> A(static_cast<size_t>(M) * K), B(static_cast<size_t>(K) * N), C0(M * N);
    for (size_t i = 0; i < A.size(); ++i) A[i] = normal(rng);
    for (size_t i = 0; i < B.size(); ++i) B[i] = normal(rng);
    for (size_t i = 0; i < C0.size(); ++i) C0[i] = normal(rng);
    for (int mode = 0; mode < 8; ++mode) {
      const bool ta = mode & 1, tb = mode & 2;
      const float beta = mode & 4 ? 0.5f : 0.f;
      std::vector<float> team(C0), alone(C0), busy(C0);
      ASSERT_TRUE(CometGemm::Run(ta, tb, M, N, K, 1.5f, A.data(), B.data(), beta, team.data()));
      ASSERT_TRUE(CometGemm::RunTilesInOrder(ta, tb, M, N, K, 1.5f, A.data(), B.data(), beta,
                                             alone.data()));
      {
        CometWorker worker;
        std::mutex gate;
        gate.lock();
        const uint64_t job = worker.Submit([&gate] { std::lock_guard<std::mutex> hold(gate); });
        while (!CometWorker::AnyBusy()) std::this_thread::yield();
        ASSERT_TRUE(CometGemm::Run(ta, tb, M, N, K, 1.5f, A.data(), B.data(), beta, busy.data()));
        gate.unlock();
        worker.Wait(job);
      }
      // op(A) is M x K: A[i][k] or, transposed, A stored K x M; op(B) likewise K x N.
      double worst = 0;
      for (int i = 0; i < M; i += 7) {
        for (int j = 0; j < N; j += 5) {
          double sum = 0, mag = 0;
          for (int k = 0; k < K; ++k) {
            const double a = ta ? A[static_cast<size_t>(k) * M + i] : A[static_cast<size_t>(i) * K + k];
            const double b = tb ? B[static_cast<size_t>(j) * K + k] : B[static_cast<size_t>(k) * N + j];
            sum += a * b;
            mag += std::fabs(a * b);
          }
          const double want = 1.5 * sum + beta * C0[i * N + j];
          const double tol = 1.5 * mag * K * 1.2e-7 + 1.2e-7 * std::fabs(want) + 1e-6;
          worst = std::max(worst, std::fabs(team[i * N + j] - want) / tol);
        }
      }
      EXPECT_LE(worst, 1.0) << M << "x" << N << "x" << K << " mode " << mode;
      for (int i = 0; i < M * N; ++i) {
        ASSERT_EQ(team[i], alone[i]) << "team against in order, element " << i << " mode " << mode;
        ASSERT_EQ(busy[i], alone[i]) << "worker busy against in order, element " << i;
      }
    }
  }
  CometGemm::Use(false);
  EXPECT_EQ(OpenBlasThreads(), full);  // one thread for the tiles only
}


// OpenBLAS's own threads keep the mode they were made in: a flushed caller alone leaves their
// part of a product denormal; made again in the caller's mode, they flush too, and made again in
// the old mode, they give it back.
TEST(CometGemmTest, OpenBlasThreadsTakeTheModeTheyAreGiven) {
  const unsigned original = CometFloatMode();
  if (!CometGemm::SetBlasThreadsMode(original) || OpenBlasThreads() < 2) {
    std::cout << "no OpenBLAS thread pool (pthread build, 2 threads or more) here: nothing to check"
              << std::endl;
    return;
  }
  const int all = 256 * 256;
  ASSERT_EQ(NonzeroOfADenormalProduct(), all) << "nothing flushed: every sum is denormal";
  const unsigned ftz = FlushToZeroOnly(original);
  CometSetFloatMode(ftz);
  const int caller_alone = NonzeroOfADenormalProduct();
  EXPECT_GT(caller_alone, 0) << "OpenBLAS's threads flushed before they were made again";
  EXPECT_LT(caller_alone, all) << "the calling thread did not flush its part";
  ASSERT_TRUE(CometGemm::SetBlasThreadsMode(ftz));
  EXPECT_EQ(CometFloatMode() & ~kCometFloatFlags, ftz) << "the caller's own mode changed";
  EXPECT_EQ(NonzeroOfADenormalProduct(), 0) << "OpenBLAS's threads do not flush";
  ASSERT_TRUE(CometGemm::SetBlasThreadsMode(original));
  EXPECT_EQ(NonzeroOfADenormalProduct(), caller_alone) << "OpenBLAS's threads kept the flush";
  CometSetFloatMode(original);
  EXPECT_EQ(NonzeroOfADenormalProduct(), all);
}

// Products too small for tiles but split by OpenBLAS run on a thread fewer than the cores while
// a store uses tiles, on 2 cores the calling thread alone: there, with the caller set to
// flush-to-zero and OpenBLAS's threads not, a denormal product comes out all 0 (OpenBLAS's own
// split leaves their part nonzero). The values of normal products are OpenBLAS's own at that
// thread count, bit for bit (at another count they may round differently: on a Zen core 1 and 2
// threads differ in 18% of a 128x128x128 product's values, with the rows that its kernel's
// edge cases take moved by the split).
TEST(CometGemmTest, ProductsBelowTheTilesLeaveTheWorkerACore) {
  std::string why;
  const unsigned original = CometFloatMode();
  if (!CometGemm::Available(&why) || !CometGemm::SetBlasThreadsMode(original)) {
    std::cout << "CometGemm not available here (" << why << "): nothing to check" << std::endl;
    return;
  }
  const int threads = OpenBlasThreads();
  const int n = 128;  // 4 M flops: below the tiles (no tiles), above OpenBLAS's split
  bool rows;
  ASSERT_EQ(CometGemm::Tiles(n, n, n, &rows), 0);
  std::vector<float> A(n * n, 1e-21f), B(n * n, 1e-21f), C(n * n, 7.f), D(n * n, 7.f);
  CometSetFloatMode(FlushToZeroOnly(original));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.f, A.data(), n, B.data(), n,
              0.f, D.data(), n);
  EXPECT_GT(n * n - std::count(D.begin(), D.end(), 0.f), 0) << "OpenBLAS did not split it";
  CometGemm::Use(true);
  const bool ran = CometGemm::Run(false, false, n, n, n, 1.f, A.data(), B.data(), 0.f, C.data());
  CometSetFloatMode(original);
  EXPECT_TRUE(ran) << "left to OpenBLAS's threads";
  if (CometTeam::Get().size() == 2) {
    EXPECT_EQ(std::count(C.begin(), C.end(), 0.f), n * n) << "a thread that does not flush ran a part";
  }
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (int i = 0; i < n * n; ++i) A[i] = normal(rng), B[i] = normal(rng);
  const int used = std::max(1, std::min(threads, static_cast<int>(CometTeam::Get().size()) - 1));
  for (int mode = 0; mode < 8; ++mode) {  // alpha 1, beta 0 too: OpenBLAS's direct kernels
    const bool ta = mode & 1, tb = mode & 2;
    const float alpha = mode & 4 ? 1.5f : 1.f;
    ASSERT_TRUE(CometGemm::Run(ta, tb, n, n, n, alpha, A.data(), B.data(), 0.f, C.data()));
    EXPECT_EQ(OpenBlasThreads(), threads) << "OpenBLAS's count not given back";
    SetOpenBlasThreads(used);
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, n, n,
                n, alpha, A.data(), n, B.data(), n, 0.f, D.data(), n);
    SetOpenBlasThreads(threads);
    for (int i = 0; i < n * n; ++i) ASSERT_EQ(C[i], D[i]) << "element " << i << " mode " << mode;
  }
  CometGemm::Use(false);
  EXPECT_EQ(OpenBlasThreads(), threads) << "OpenBLAS's count not given back";
}

// The encoder's output buffer is sized for the worst case (about 4 bytes a value) but only the
// pages a stream writes are resident and counted: a mostly-zero 16 MB blob, 1/32 of it nonzero,
// leaves well under a byte a value held, and the stream decodes to the same values.
TEST_F(CometPayloadTest, TheEncoderHoldsWhatItWroteNotItsWorstCase) {
  CometReleaseEncoderBuffer();
  const size_t before = CometEncoderHeldBytes();
  Blob<float> blob(1, 16, 512, 512);  // 4 Mi values
  float* x = blob.mutable_cpu_data();
  for (int i = 0; i < blob.count(); ++i) x[i] = i % 1024 < 32 ? 1.f + (i % 7) : 0.f;
  shared_ptr<CometPayload> p = CometEncodeLossy(x, blob.shape(), false, 1e-3, "x");
  ASSERT_TRUE(p.get() != NULL);
  const size_t held = CometEncoderHeldBytes() - before;
  EXPECT_GT(held, p->bytes());
  EXPECT_LT(held, blob.count() / 4);  // a zero-filled worst-case buffer: 16 MB and more
  std::vector<float> out(blob.count());
  std::string error;
  ASSERT_TRUE(CometDecode(*p, out.data(), &error)) << error;
  EXPECT_LE(MaxAbsDiff(x, out.data(), blob.count()), 1e-3);
  // One buffer is held whichever thread encodes (the worker, or the step running a queued job):
  // another thread's encode, while that thread lives on, holds nothing more.
  size_t held_then = 0;
  std::thread([&] {
    ASSERT_TRUE(CometEncodeLossy(x, blob.shape(), false, 1e-3, "x").get() != NULL);
    held_then = CometEncoderHeldBytes() - before;
  }).join();
  EXPECT_EQ(held_then, held);
  CometReleaseEncoderBuffer();
  EXPECT_EQ(CometEncoderHeldBytes(), before);
}

TEST_F(CometPayloadTest, LossyRespectsTheBoundAndKeepsZeros) {
  Blob<float> blob(4, 8, 13, 11);
  FillActivations(&blob, 0.7f, 5.f, 1);
  const double ebs[] = {1e-1, 1e-2, 1e-3, 1e-4};
  for (int k = 0; k < 4; ++k) {
    shared_ptr<CometPayload> p =
        CometEncodeLossy(blob.cpu_data(), blob.shape(), false, ebs[k], "x");
    ASSERT_TRUE(p.get() != NULL);
    EXPECT_LT(p->bytes(), p->dense_bytes()) << "eb " << ebs[k];
    std::vector<float> out(blob.count(), -1.f);
    std::string error;
    ASSERT_TRUE(CometDecode(*p, out.data(), &error)) << error;
    EXPECT_LE(MaxAbsDiff(blob.cpu_data(), out.data(), blob.count()), ebs[k]);
    for (int i = 0; i < blob.count(); ++i) {
      if (blob.cpu_data()[i] == 0.f) {
        ASSERT_EQ(out[i], 0.f) << i;
      }
    }
  }
}

// The host's word loops (vectorized) must give what the per-value functions give, which the GPU
// kernels use: every bit of every result, over random words and values that sit on the edges
// (signed zeros, the smallest normal, subnormals, huge, NaN).
TEST(CometMaskTest, WordLoopsMatchTheValueFunctions) {
  const float edges[] = {0.f, -0.f, 1.17549435e-38f, -1.17549435e-38f, 1e-40f, -1e-40f, 3e38f,
                         -3e38f, 1.f, -1.f, std::numeric_limits<float>::quiet_NaN()};
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  const float slopes[] = {0.f, 0.1f, 1.f};
  auto same = [](float a, float b) { return std::memcmp(&a, &b, sizeof(a)) == 0; };
  for (int round = 0; round < 2000; ++round) {
    const uint32_t word = round == 0 ? 0u : round == 1 ? ~0u : static_cast<uint32_t>(rng());
    float x[32], t[32];
    for (int b = 0; b < 32; ++b) {
      x[b] = rng() % 4 == 0 ? edges[rng() % 11] : u(rng);
      t[b] = u(rng);
    }
    const float slope = slopes[round % 3];
    float signs[32], values[32], relu[32], diff[32];
    std::memcpy(signs, x, sizeof(x));
    std::memcpy(relu, x, sizeof(x));
    comet_mask::word32::apply_signs(signs, word);
    comet_mask::word32::values(values, word);
    comet_mask::word32::relu(relu, word, slope);
    comet_mask::word32::relu_diff(t, diff, word, slope);
    bool nonfinite = false;
    ASSERT_EQ(comet_mask::word32::pack(x), comet_mask::pack_word(x, 32, 0, &nonfinite)) << round;
    for (int b = 0; b < 32; ++b) {
      ASSERT_TRUE(same(signs[b], comet_mask::apply_sign(x[b], word, b))) << round << " " << b;
      ASSERT_TRUE(same(values[b], comet_mask::value_of(word, b))) << round << " " << b;
      ASSERT_TRUE(same(relu[b], comet_mask::relu_of(x[b], word, b, slope))) << round << " " << b;
      ASSERT_TRUE(same(diff[b], comet_codes::relu_diff(t[b], word, b, slope))) << round << " " << b;
    }
  }
}

TEST_F(CometPayloadTest, MaskKeepsTheSignAndRefusesNaN) {
  Blob<float> blob(1, 3, 7, 5);  // 105 values: the last word is partial
  FillActivations(&blob, 0.5f, 1.f, 2);
  blob.mutable_cpu_data()[3] = -2.f;
  shared_ptr<CometPayload> p = CometEncodeMask(blob.cpu_data(), blob.count(), false, "x");
  ASSERT_TRUE(p.get() != NULL);
  EXPECT_EQ(p->bytes(), 4 * sizeof(uint32_t));
  std::vector<float> out(blob.count());
  std::string error;
  ASSERT_TRUE(CometDecode(*p, out.data(), &error)) << error;
  for (int i = 0; i < blob.count(); ++i) {
    EXPECT_EQ(out[i] > 0, blob.cpu_data()[i] > 0) << i;
  }
  blob.mutable_cpu_data()[7] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(CometEncodeMask(blob.cpu_data(), blob.count(), false, "x").get() == NULL);
  blob.mutable_cpu_data()[7] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(CometEncodeMask(blob.cpu_data(), blob.count(), false, "x").get() == NULL);
}

// The rebuild of a blob that Scale and ReLU made from x_norm_ runs in pieces that start at
// multiples of 32 while planes need not (ResNet's 28x28, 14x14 and 7x7 planes): every value must
// be relu(a_c x + b_c) with its own plane's factors, across piece, plane and thread boundaries
// and in a partial last mask word; the mask's pass gives the largest magnitude too.
TEST_F(CometPayloadTest, RebuildAppliesEachPlanesFactorsAndTheMask) {
  const int shapes[][4] = {{3, 5, 7, 7}, {4, 100, 14, 14}, {2, 64, 28, 28}};
  for (int s = 0; s < 3; ++s) {
    Blob<float> x_norm(shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3]);
    FillActivations(&x_norm, 0.f, 2.f, 20 + s);
    caffe_add_scalar(x_norm.count(), -1.f, x_norm.mutable_cpu_data());  // in [-1, 1]
    const int channels = x_norm.shape(1);
    const size_t inner = x_norm.count(2), count = x_norm.count();
    std::vector<float> a(channels), b(channels);
    for (int c = 0; c < channels; ++c) {
      a[c] = 0.5f + 0.01f * c;
      b[c] = (c % 3 == 0) ? 0.3f : -0.2f * (c % 5);
    }
    for (int variant = 0; variant < 3; ++variant) {  // ReLU, leaky ReLU, no ReLU
      const float slope = variant == 1 ? 0.1f : 0.f;
      std::vector<float> y(count);
      for (size_t i = 0; i < count; ++i) {
        const int c = static_cast<int>((i / inner) % channels);
        const float v = a[c] * x_norm.cpu_data()[i] + b[c];
        y[i] = variant == 2 || v > 0 ? v : slope * v;
      }
      shared_ptr<CometPayload> source =
          CometEncodeLossy(x_norm.cpu_data(), x_norm.shape(), false, 1e-3, "x_norm");
      shared_ptr<CometPayload> mask;
      if (variant < 2) {
        float largest = -1;
        mask = CometEncodeMask(y.data(), count, false, "y", &largest);
        ASSERT_TRUE(mask.get() != NULL);
        float want = 0;
        for (size_t i = 0; i < count; ++i) want = std::max(want, std::fabs(y[i]));
        EXPECT_EQ(largest, want) << "shape " << s;
      }
      shared_ptr<CometPayload> p = CometMakeDerived(source, a, b, inner, mask, slope, "y");
      std::vector<float> out(count, -7.f);
      std::string error;
      ASSERT_TRUE(CometRebuild(*p, x_norm.cpu_data(), out.data(), &error)) << error;
      for (size_t i = 0; i < count; ++i)
        ASSERT_NEAR(out[i], y[i], 1e-6f * std::fabs(y[i])) << "shape " << s << " variant "
                                                            << variant << " value " << i;
      if (mask) {  // a changed mask bit is caught
        static_cast<uint32_t*>(mask->data())[count / 64] ^= 4u;
        EXPECT_FALSE(CometRebuild(*p, x_norm.cpu_data(), out.data(), &error));
      }
    }
  }
  Blob<float> blob(1, 2, 10, 10);
  FillActivations(&blob, 0.2f, 3.f, 5);
  blob.mutable_cpu_data()[17] = -4.5f;
  bool finite = false;
  EXPECT_EQ(CometMaxAbs(blob.cpu_data(), blob.count(), &finite), 4.5f);
  EXPECT_TRUE(finite);
  blob.mutable_cpu_data()[199] = std::numeric_limits<float>::quiet_NaN();  // in the tail
  CometMaxAbs(blob.cpu_data(), blob.count(), &finite);
  EXPECT_FALSE(finite);
}

TEST_F(CometPayloadTest, SignMaskMakesLossySignsExactWithinTheBound) {
  Blob<float> blob(2, 4, 10, 10);
  FillActivations(&blob, 0.5f, 0.05f, 9);  // many values below eb: their sign would flip
  const double eb = 1e-2;
  shared_ptr<CometPayload> plain = CometEncodeLossy(blob.cpu_data(), blob.shape(), false, eb, "x");
  shared_ptr<CometPayload> p = CometEncodeLossy(blob.cpu_data(), blob.shape(), false, eb, "x");
  p->sign_mask = CometEncodeMask(blob.cpu_data(), blob.count(), false, "x");
  std::vector<float> a(blob.count()), b(blob.count());
  std::string error;
  ASSERT_TRUE(CometDecode(*plain, a.data(), &error)) << error;
  ASSERT_TRUE(CometDecode(*p, b.data(), &error)) << error;
  int flipped_without = 0;
  for (int i = 0; i < blob.count(); ++i) {
    const float x = blob.cpu_data()[i];
    flipped_without += (a[i] > 0) != (x > 0);
    ASSERT_EQ(b[i] > 0, x > 0) << i;
    ASSERT_LE(std::fabs(b[i] - x), eb) << i;
  }
  EXPECT_GT(flipped_without, 0) << "test data too easy: nothing to correct";
  EXPECT_EQ(p->stored_bytes(), p->bytes() + p->sign_mask->bytes());
  static_cast<uint32_t*>(p->sign_mask->data())[0] ^= 1u;
  EXPECT_FALSE(CometDecode(*p, b.data(), &error));
}

// BatchNorm's x_norm_ after a ReLU: a channel's zeros are one value, t = -mean / std, and sz gives
// them one common error; stored less t (batchnorm_moments.hpp) they come back exact, and every
// value within the bound.
TEST_F(CometPayloadTest, ChannelOffsetsBringAlikeValuesBackExact) {
  const int num = 4, channels = 3, inner = 36;
  Blob<float> x(num, channels, 6, 6);
  FillActivations(&x, 0.4f, 2.f, 11);  // a ReLU's output
  const double n = num * inner;
  std::vector<float> mean(channels, 0), std(channels, 0), y(x.count());
  for (int c = 0; c < channels; ++c) {
    double s1 = 0, s2 = 0;
    for (int k = 0; k < num; ++k)
      for (int i = 0; i < inner; ++i) {
        const double v = x.cpu_data()[(k * channels + c) * inner + i];
        s1 += v;
        s2 += v * v;
      }
    mean[c] = static_cast<float>(s1 / n);
    std[c] = static_cast<float>(std::sqrt(s2 / n - (s1 / n) * (s1 / n) + 1e-5));
  }
  for (int i = 0; i < x.count(); ++i) {
    const int c = (i / inner) % channels;
    y[i] = (x.cpu_data()[i] - mean[c]) / std[c];
  }
  std::vector<float> offsets(channels), shifted(y);
  CometTieOffsets(channels, mean.data(), std.data(), n, offsets.data());
  CometAddChannelOffsets(y.size(), channels, inner, offsets.data(), -1.f, shifted.data());
  const double eb = 0.1;
  shared_ptr<CometPayload> plain = CometEncodeLossy(y.data(), x.shape(), false, eb, "x_norm");
  shared_ptr<CometPayload> p = CometEncodeLossy(
      shifted.data(), x.shape(), false, eb - comet_bn::tie_shift_slack(n, eb), "x_norm");
  p->channel_offsets.reset(new CometPayload(CometPayload::OFFSETS, false, channels, "offsets"));
  p->channel_offsets->Allocate(channels * sizeof(float));
  std::copy(offsets.begin(), offsets.end(), static_cast<float*>(p->channel_offsets->data()));
  p->channel_offsets->inner = inner;
  std::vector<float> a(y.size()), b(y.size());
  std::string error;
  ASSERT_TRUE(CometDecode(*plain, a.data(), &error)) << error;
  ASSERT_TRUE(CometDecode(*p, b.data(), &error)) << error;
  int zeros = 0, off_without = 0;
  for (int i = 0; i < x.count(); ++i) {
    ASSERT_LE(std::fabs(b[i] - y[i]), eb) << i;
    if (x.cpu_data()[i] != 0) continue;
    ++zeros;
    off_without += a[i] != y[i];
    ASSERT_EQ(b[i], y[i]) << "a zero of the ReLU, value " << i;
  }
  EXPECT_GT(zeros, x.count() / 4);
  EXPECT_GT(off_without, zeros / 2) << "test data too easy: the zeros came back exact anyway";
  EXPECT_EQ(p->stored_bytes(), p->bytes() + channels * sizeof(float));
  // offsets that do not fit the stream are refused, not applied
  p->channel_offsets->inner = 5;
  EXPECT_FALSE(CometDecode(*p, b.data(), &error));
  EXPECT_NE(error.find("channel offsets"), std::string::npos) << error;
}

TEST_F(CometPayloadTest, LossyKeepsNaNAndInfExactly) {
  Blob<float> blob(2, 3, 4, 5);
  FillActivations(&blob, 0.3f, 2.f, 3);
  float* x = blob.mutable_cpu_data();
  x[5] = std::numeric_limits<float>::quiet_NaN();
  x[6] = std::numeric_limits<float>::infinity();
  x[7] = -std::numeric_limits<float>::infinity();
  shared_ptr<CometPayload> p = CometEncodeLossy(x, blob.shape(), false, 1e-2, "x");
  std::vector<float> out(blob.count());
  std::string error;
  ASSERT_TRUE(CometDecode(*p, out.data(), &error)) << error;
  EXPECT_TRUE(std::isnan(out[5]));
  EXPECT_EQ(out[6], std::numeric_limits<float>::infinity());
  EXPECT_EQ(out[7], -std::numeric_limits<float>::infinity());
}

TEST_F(CometPayloadTest, CorruptPayloadsAreRejected) {
  Blob<float> blob(2, 4, 9, 9);
  FillActivations(&blob, 0.6f, 3.f, 4);
  std::vector<float> out(blob.count());
  std::string error;
  shared_ptr<CometPayload> lossy = CometEncodeLossy(blob.cpu_data(), blob.shape(), false, 1e-3, "x");
  for (size_t pos = 0; pos < lossy->bytes(); pos += std::max<size_t>(1, lossy->bytes() / 16)) {
    shared_ptr<CometPayload> bad = CometEncodeLossy(blob.cpu_data(), blob.shape(), false, 1e-3, "x");
    static_cast<uint8_t*>(bad->data())[pos] ^= 0x5a;
    EXPECT_FALSE(CometDecode(*bad, out.data(), &error)) << "flipped byte " << pos;
  }
  shared_ptr<CometPayload> mask = CometEncodeMask(blob.cpu_data(), blob.count(), false, "x");
  static_cast<uint32_t*>(mask->data())[1] ^= 0x10u;
  EXPECT_FALSE(CometDecode(*mask, out.data(), &error));
  EXPECT_NE(error.find("mask"), std::string::npos) << error;
}

TEST_F(CometPayloadTest, SyncedMemoryRestoresOnAccess) {
  Blob<float> blob(2, 3, 8, 8);
  FillActivations(&blob, 0.5f, 1.f, 5);
  std::vector<float> orig(blob.cpu_data(), blob.cpu_data() + blob.count());
  SyncedMemory* mem = blob.data().get();
  shared_ptr<CometPayload> p = CometEncodeLossy(blob.cpu_data(), blob.shape(), false, 1e-3, "x");
  ASSERT_TRUE(mem->comet_can_release());
  EXPECT_EQ(mem->comet_release(), blob.count() * sizeof(float));
  EXPECT_EQ(mem->head(), SyncedMemory::UNINITIALIZED);
  mem->comet_payload() = p;
  const float* back = blob.cpu_data();  // restores
  EXPECT_TRUE(mem->comet_payload().get() == NULL);
  EXPECT_LE(MaxAbsDiff(orig.data(), back, blob.count()), 1e-3);
}

TEST_F(CometPayloadTest, MemoryWeDoNotOwnIsNotReleased) {
  Blob<float> blob(1, 1, 4, 4);
  std::vector<float> external(16, 1.f);
  blob.data()->set_cpu_data(external.data());
  EXPECT_FALSE(blob.data()->comet_can_release());
}

TEST_F(CometPayloadTest, CorruptPayloadIsFatalNotUsed) {
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  Blob<float> blob(2, 3, 8, 8);
  FillActivations(&blob, 0.5f, 1.f, 6);
  shared_ptr<CometPayload> p = CometEncodeLossy(blob.cpu_data(), blob.shape(), false, 1e-3, "conv9");
  static_cast<uint8_t*>(p->data())[p->bytes() / 2] ^= 0xff;
  blob.data()->comet_release();
  blob.data()->comet_payload() = p;
  EXPECT_DEATH(blob.cpu_data(), "compressed data of blob 'conv9' is corrupt");
}

// ---------------------------------------------------------------- the error-bound derivation

// The weight gradient of a layer computed from an input stored at bound eb differs from the
// exact one by at most eb * sum|dy| per weight. Its RMS difference over the weights is what the
// adaptive rule measures on a sample of them (error_model.hpp), and, for dense inputs whose
// errors are independent, near the first rule's eb * ||dy|| / sqrt(3 O) (docs/comet.md).
// WeightGradientBench holds a layer, its input, an output gradient (any values; with
// constant_dy one value per map, as below a global average pooling) and the exact weight
// gradient, and measures both.
template <typename LayerT>
class WeightGradientBench {
 public:
  WeightGradientBench(const LayerParameter& lp, const Blob<float>& input, bool constant_dy)
      : layer_(lp), bottom_(input.shape()),
        x_(input.cpu_data(), input.cpu_data() + input.count()) {
    Caffe::set_random_seed(1701);
    Restore();
    layer_.SetUp(Bottoms(), Tops());
    FillerParameter fp;
    fp.set_std(1.f);
    GaussianFiller<float>(fp).Fill(&top_);  // any values; only the diff matters
    caffe_copy(top_.count(), top_.cpu_data(), top_.mutable_cpu_diff());
    if (constant_dy) {
      float* d = top_.mutable_cpu_diff();
      for (int m = 0; m < top_.count() / Plane(); ++m)
        for (int i = 1; i < Plane(); ++i) d[m * Plane() + i] = d[m * Plane()];
    }
    exact_ = Gradient();
  }
  // The RMS error over the weights with the input stored at eb; checks the worst case.
  double ErrorAt(double eb) {
    shared_ptr<CometPayload> p = CometEncodeLossy(x_.data(), bottom_.shape(), false, eb, "in");
    std::string error;
    EXPECT_TRUE(CometDecode(*p, bottom_.mutable_cpu_data(), &error)) << error;
    const std::vector<float> lossy = Gradient();
    Restore();
    const int O = Outputs(), per_o = exact_.size() / O;
    double sq = 0, worst_ratio = 0;
    for (int o = 0; o < O; ++o) {
      double dy_abs = 0;  // sum over n and positions of |dy[n, o, p]|
      for (int n = 0; n < top_.shape(0); ++n)
        for (int s = 0; s < Plane(); ++s)
          dy_abs += std::fabs(top_.cpu_diff()[(n * O + o) * Plane() + s]);
      for (int k = 0; k < per_o; ++k) {
        const double d = lossy[o * per_o + k] - exact_[o * per_o + k];
        sq += d * d;
        worst_ratio = std::max(worst_ratio, std::fabs(d) / (eb * dy_abs));
      }
    }
    EXPECT_LE(worst_ratio, 1.0 + 1e-3) << "worst-case bound eb * sum|dy| violated";
    return std::sqrt(sq / exact_.size());
  }
  // What the rule measures: the input sampled when encoded at eb, the errors at `bounds`.
  std::vector<double> Sampled(const CometWeightGeometry& g, double eb,
                              const std::vector<double>& bounds) const {
    const int N = bottom_.shape(0);
    const int H = bottom_.num_axes() > 2 ? bottom_.shape(2) : 1;
    const int W = bottom_.num_axes() > 3 ? bottom_.shape(3) : 1;
    const CometErrorSample s = CometSampleInput(x_.data(), false, N, bottom_.count() / (N * H * W),
                                                H, W, eb, false, g);
    const int hy = top_.num_axes() > 2 ? top_.shape(2) : 1;
    const int wy = top_.num_axes() > 3 ? top_.shape(3) : 1;
    return CometWeightErrors(s, top_.cpu_diff(), false, Outputs(), hy, wy, g, bounds);
  }
  double GradientRms() const {
    double g2 = 0;
    for (int i = 0; i < exact_.size(); ++i) g2 += exact_[i] * exact_[i];
    return std::sqrt(g2 / exact_.size());
  }
  double Independent(double eb) const {  // the first rule: eb ||dy|| / sqrt(3 O)
    double dy_sq = 0;
    for (int i = 0; i < top_.count(); ++i) dy_sq += top_.cpu_diff()[i] * top_.cpu_diff()[i];
    return eb * std::sqrt(dy_sq) / std::sqrt(3.0 * Outputs());
  }

 private:
  std::vector<Blob<float>*> Bottoms() { return std::vector<Blob<float>*>(1, &bottom_); }
  std::vector<Blob<float>*> Tops() { return std::vector<Blob<float>*>(1, &top_); }
  int Outputs() const { return top_.shape(1); }
  int Plane() const { return top_.count() / (top_.shape(0) * Outputs()); }
  void Restore() { std::copy(x_.begin(), x_.end(), bottom_.mutable_cpu_data()); }
  std::vector<float> Gradient() {  // the weight gradient from bottom_ as it is
    Blob<float>* w = layer_.blobs()[0].get();
    caffe_set(w->count(), 0.f, w->mutable_cpu_diff());
    layer_.Backward(Tops(), std::vector<bool>(1, false), Bottoms());
    return std::vector<float>(w->cpu_diff(), w->cpu_diff() + w->count());
  }

  LayerT layer_;
  Blob<float> bottom_, top_;
  const std::vector<float> x_;  // the input, exact
  std::vector<float> exact_;    // its weight gradient
};

struct GradientErrorCase {
  double rms, independent, sampled;
};
template <typename LayerT>
GradientErrorCase MeasureGradientError(const LayerParameter& lp, const CometWeightGeometry& g,
                                       const Blob<float>& bottom, double eb, bool constant_dy) {
  WeightGradientBench<LayerT> bench(lp, bottom, constant_dy);
  GradientErrorCase r = {bench.ErrorAt(eb), bench.Independent(eb),
                         bench.Sampled(g, eb, std::vector<double>(1, eb))[0]};
  return r;
}

// Small layers: the sample is every weight (of one group), so the measured error is the layer's.
template <typename LayerT>
void CheckGradientError(const LayerParameter& lp, const CometWeightGeometry& g,
                        const std::vector<int>& in_shape, double eb, double tolerance = 1e-3) {
  Blob<float> bottom(in_shape);
  FillActivations(&bottom, 0.f, 2.f, 7);  // dense: every value carries quantization error
  const GradientErrorCase r = MeasureGradientError<LayerT>(lp, g, bottom, eb, false);
  EXPECT_GT(r.rms, 0.2 * r.independent) << "estimate far too pessimistic";
  EXPECT_LT(r.rms, 2.0 * r.independent) << "estimate too optimistic";
  EXPECT_NEAR(r.sampled / r.rms, 1.0, tolerance) << "the sampled error is not the layer's";
}

TEST_F(CometPayloadTest, ConvolutionWeightGradientErrorMatchesTheDerivation) {
  LayerParameter lp;
  ConvolutionParameter* cp = lp.mutable_convolution_param();
  cp->set_num_output(6);
  cp->add_kernel_size(3);
  cp->mutable_weight_filler()->set_type("gaussian");
  CometWeightGeometry g;
  g.kernel_h = g.kernel_w = 3;
  std::vector<int> shape(4);
  shape[0] = 4; shape[1] = 5; shape[2] = 12; shape[3] = 12;
  CheckGradientError<ConvolutionLayer<float> >(lp, g, shape, 1e-2);
  CheckGradientError<ConvolutionLayer<float> >(lp, g, shape, 1e-3);
  // Stride, padding, dilation and groups pair inputs with weights as the layer does.
  cp->add_stride(2);
  cp->add_pad(2);
  cp->add_dilation(2);
  cp->set_group(2);
  cp->set_num_output(4);
  g.stride_h = g.stride_w = g.pad_h = g.pad_w = g.dilation_h = g.dilation_w = g.group = 2;
  shape[1] = 6;
  CheckGradientError<ConvolutionLayer<float> >(lp, g, shape, 1e-2);  // both groups: every weight
  // Inception-v3's asymmetric kernels (1x7 then 7x1, each padded along its long side only).
  LayerParameter asym;
  ConvolutionParameter* ap = asym.mutable_convolution_param();
  ap->set_num_output(4);
  ap->mutable_weight_filler()->set_type("gaussian");
  CometWeightGeometry ga;
  shape[1] = 5;
  for (int wide = 0; wide < 2; ++wide) {
    ap->set_kernel_h(wide ? 1 : 7);
    ap->set_kernel_w(wide ? 7 : 1);
    ap->set_pad_h(wide ? 0 : 3);
    ap->set_pad_w(wide ? 3 : 0);
    ga.kernel_h = ap->kernel_h();
    ga.kernel_w = ap->kernel_w();
    ga.pad_h = ap->pad_h();
    ga.pad_w = ap->pad_w();
    CheckGradientError<ConvolutionLayer<float> >(asym, ga, shape, 1e-2);
  }
}

// A depthwise convolution (a group per channel, MobileNet's) whose channels differ in scale, as
// a trained net's do (some nearly dead): each channel's weights err by their own channel's
// errors, so a sample of one group, its middle channel, says little about the layer. The sample
// spreads over many groups and lands near the layer's error where it holds a quarter of the
// channels.
TEST_F(CometPayloadTest, DepthwiseWeightGradientErrorIsSampledOverGroups) {
  const int C = 128;
  LayerParameter lp;
  ConvolutionParameter* cp = lp.mutable_convolution_param();
  cp->set_num_output(C);
  cp->set_group(C);
  cp->add_kernel_size(3);
  cp->add_pad(1);
  cp->set_bias_term(false);
  cp->mutable_weight_filler()->set_type("gaussian");
  CometWeightGeometry g;
  g.kernel_h = g.kernel_w = 3;
  g.pad_h = g.pad_w = 1;
  g.group = C;
  Blob<float> bottom(8, C, 32, 32);
  FillActivations(&bottom, 0.f, 2.f, 7);
  // Channel scales over two decades in no order; about a quarter of the channels nearly dead
  // (below the bound: they err by their own tiny values), the middle one among them.
  float* x = bottom.mutable_cpu_data();
  const int plane = 32 * 32;
  for (int c = 0; c < C; ++c) {
    const unsigned hash = (static_cast<unsigned>(c) * 2654435761u) >> 16;
    const bool dead = c == C / 2 || hash % 4 == 0;
    const float scale = dead ? 1e-4f : std::pow(10.f, (hash % 1000) / 500.f - 1);
    for (int n = 0; n < 8; ++n)
      for (int i = 0; i < plane; ++i) x[(n * C + c) * plane + i] *= scale;
  }
  const double eb = 2e-3;
  WeightGradientBench<ConvolutionLayer<float> > bench(lp, bottom, false);
  const double rms = bench.ErrorAt(eb);
  const double sampled = bench.Sampled(g, eb, std::vector<double>(1, eb))[0];
  EXPECT_NEAR(sampled / rms, 1.0, 0.15) << "sampled " << sampled << ", the layer's " << rms;
}

TEST_F(CometPayloadTest, InnerProductWeightGradientErrorMatchesTheDerivation) {
  LayerParameter lp;
  lp.mutable_inner_product_param()->set_num_output(10);
  lp.mutable_inner_product_param()->mutable_weight_filler()->set_type("gaussian");
  CometWeightGeometry g;
  g.kind = CometWeightGeometry::INNER_PRODUCT;
  std::vector<int> shape(2);
  shape[0] = 32; shape[1] = 200;
  CheckGradientError<InnerProductLayer<float> >(lp, g, shape, 1e-2, 0.1);  // 8 of 32 images
  shape[0] = 8;
  CheckGradientError<InnerProductLayer<float> >(lp, g, shape, 1e-2);
}

// What GoogLeNet's deep Inception layers showed (docs/comet.md#the-weight-rule-measured): an input
// of repeated maxima (2x2 patches of one value, as max pooling leaves them), half of them small
// positives that round to 0, read by a 1x1 convolution whose output gradient is constant over
// each map (below a global average pooling). The errors add coherently: several times what
// independent errors give. The sampled measurement sees it, on every weight of a small layer
// and on a sample of a large one (3x3, two groups, 16 images of 96 14x14 maps: 8 images, 20
// channels, a statistical estimate).
void FillPatches(Blob<float>* b, double eb) {
  srand(11);
  float* x = b->mutable_cpu_data();
  const int h_n = b->shape(2), w_n = b->shape(3);
  for (int m = 0; m < b->count() / (h_n * w_n); ++m) {
    for (int h = 0; h < h_n; h += 2) {
      for (int w = 0; w < w_n; w += 2) {
        const float u = static_cast<float>(rand()) / RAND_MAX;  // NOLINT
        const float v = u < 0.5f ? 1.8f * eb * u : 3.f * u;      // half below eb
        for (int dh = 0; dh < 2 && h + dh < h_n; ++dh)
          for (int dw = 0; dw < 2 && w + dw < w_n; ++dw) x[(m * h_n + h + dh) * w_n + w + dw] = v;
      }
    }
  }
}

TEST_F(CometPayloadTest, CorrelatedErrorsAreMeasuredByTheWeightRule) {
  const double eb = 0.1;
  for (int stride = 1; stride <= 2; ++stride) {
    LayerParameter lp;
    ConvolutionParameter* cp = lp.mutable_convolution_param();
    cp->set_num_output(8);
    cp->add_kernel_size(1);
    cp->add_stride(stride);
    cp->mutable_weight_filler()->set_type("gaussian");
    CometWeightGeometry g;
    g.stride_h = g.stride_w = stride;
    Blob<float> bottom(8, 32, 7, 7);
    FillPatches(&bottom, eb);
    const GradientErrorCase r =
        MeasureGradientError<ConvolutionLayer<float> >(lp, g, bottom, eb, true);
    // With stride 2 the 1x1 convolution reads one value of each patch: only the mean adds up.
    EXPECT_GT(r.rms, (stride == 1 ? 2.0 : 1.3) * r.independent)
        << "test data too easy: the errors are not coherent";
    EXPECT_NEAR(r.sampled / r.rms, 1.0, 1e-3) << "stride " << stride;
  }
  LayerParameter lp;
  ConvolutionParameter* cp = lp.mutable_convolution_param();
  cp->set_num_output(24);
  cp->add_kernel_size(3);
  cp->add_pad(1);
  cp->set_group(2);
  cp->mutable_weight_filler()->set_type("gaussian");
  CometWeightGeometry g;
  g.kernel_h = g.kernel_w = 3;
  g.pad_h = g.pad_w = 1;
  g.group = 2;
  Blob<float> bottom(16, 96, 14, 14);
  FillPatches(&bottom, eb);
  const GradientErrorCase r =
      MeasureGradientError<ConvolutionLayer<float> >(lp, g, bottom, eb, true);
  EXPECT_GT(r.rms, 2.0 * r.independent) << "test data too easy: the errors are not coherent";
  EXPECT_GT(r.sampled, 0.75 * r.rms) << "the sample underestimates the error";
  EXPECT_LT(r.sampled, 1.35 * r.rms) << "the sample overestimates the error";
}

// The bound the weight rule picks from the ladder gives the target error: the correlated input
// above, whose error grows faster than eb (more values round to 0), at targets between 1% and
// 20% of the gradient, from a bound 4x too small; measured on every weight with the bound picked.
TEST_F(CometPayloadTest, TheWeightRulesBoundMeetsItsTarget) {
  LayerParameter lp;
  ConvolutionParameter* cp = lp.mutable_convolution_param();
  cp->set_num_output(8);
  cp->add_kernel_size(1);
  cp->mutable_weight_filler()->set_type("gaussian");
  CometWeightGeometry g;
  Blob<float> bottom(8, 32, 7, 7);
  FillPatches(&bottom, 0.05);
  WeightGradientBench<ConvolutionLayer<float> > bench(lp, bottom, true);
  const double targets[] = {0.01, 0.05, 0.2};
  for (int t = 0; t < 3; ++t) {
    const double target = targets[t] * bench.GradientRms();
    // Two measuring iterations, as the store runs them: the ladder around the bound in use.
    double eb = 0.05 / 4;
    for (int step = 0; step < 2; ++step) {
      const std::vector<double> ladder = CometLadder(eb);
      const std::vector<double> errors = bench.Sampled(g, eb, ladder);
      for (int k = 1; k < errors.size(); ++k) EXPECT_GE(errors[k], errors[k - 1]) << "falling";
      eb = CometBoundForError(ladder, errors, target);
      ASSERT_GT(eb, 0);
    }
    const double achieved = bench.ErrorAt(eb);
    EXPECT_GT(achieved, 0.7 * target) << "target " << targets[t] << ": bound " << eb;
    EXPECT_LT(achieved, 1.3 * target) << "target " << targets[t] << ": bound " << eb;
  }
}

// The curve solver: exact on a power law within the ladder and beyond it (slope clamped to
// [1, 4]), the first crossing where noise makes the curve non-monotone, nothing from zeros.
TEST_F(CometPayloadTest, BoundForErrorSolvesTheMeasuredCurve) {
  const std::vector<double> b = CometLadder(0.1);
  std::vector<double> e(b.size());
  for (int i = 0; i < b.size(); ++i) e[i] = 3 * b[i] * b[i];  // error ~ eb^2
  EXPECT_NEAR(CometBoundForError(b, e, 3 * 0.07 * 0.07), 0.07, 1e-9);
  EXPECT_NEAR(CometBoundForError(b, e, 3 * 2.0 * 2.0), 2.0, 1e-9);          // above the ladder
  EXPECT_NEAR(CometBoundForError(b, e, 3 * 0.001 * 0.001), 0.001, 1e-9);    // below it
  for (int i = 0; i < b.size(); ++i) e[i] = std::pow(b[i], 6);              // steeper than 4
  EXPECT_NEAR(CometBoundForError(b, e, std::pow(b.back(), 6) * 16), b.back() * 2, 1e-9);
  for (int i = 0; i < b.size(); ++i) e[i] = std::sqrt(b[i]);                // flatter than 1
  EXPECT_NEAR(CometBoundForError(b, e, std::sqrt(b.back()) * 2), b.back() * 2, 1e-9);
  for (int i = 0; i < b.size(); ++i) e[i] = b[i];
  e[4] = 10;  // a spike: the first crossing from below counts
  EXPECT_LT(CometBoundForError(b, e, b[5]), b[4]);
  e[4] = 0;
  EXPECT_EQ(CometBoundForError(b, e, 1.0), -1);
}

// CometErrorAt reads the curve as CometBoundForError solves it: each is the other's inverse, on
// the ladder, between its rungs and beyond them.
TEST_F(CometPayloadTest, ErrorAtIsTheInverseOfBoundForError) {
  const std::vector<double> b = CometLadder(0.1);
  std::vector<double> e(b.size());
  for (int i = 0; i < b.size(); ++i) e[i] = 0.3 * std::pow(b[i], 1.5 + 0.2 * i);  // steepening
  const double probes[] = {1e-4, 0.0125, 0.03, 0.1, 0.37, 0.8, 5};
  for (int p = 0; p < 7; ++p) {
    const double err = CometErrorAt(b, e, probes[p]);
    ASSERT_GT(err, 0) << probes[p];
    EXPECT_NEAR(CometBoundForError(b, e, err) / probes[p], 1, 1e-9) << probes[p];
  }
  EXPECT_NEAR(CometErrorAt(b, e, b[2]), e[2], 1e-12);
  e[3] = 0;
  EXPECT_EQ(CometErrorAt(b, e, 0.1), -1);
}

// The drift margin: a surprise (the next curve 4x above the last at the same bound) sets it, it
// shrinks by a quarter in log per measurement without a new one, never below 1 nor above 16, and
// a measurement that says nothing only lets it shrink.
TEST_F(CometPayloadTest, DriftMarginFollowsTheSurprisesItMeasured) {
  double m = CometDriftMargin(1, 0.05, 0.2);
  EXPECT_NEAR(m, 4, 1e-12);
  m = CometDriftMargin(m, 0.05, 0.04);  // the next curve lower: only the decay
  EXPECT_NEAR(m, std::pow(4., 0.75), 1e-12);
  m = CometDriftMargin(m, 0.05, 0.15);  // a new, larger surprise than what is left
  EXPECT_NEAR(m, 3, 1e-12);
  for (int i = 0; i < 40; ++i) m = CometDriftMargin(m, 0.05, 0.01);
  EXPECT_NEAR(m, std::pow(3., std::pow(0.75, 40)), 1e-12);  // back to about 1 (1.00001)
  EXPECT_EQ(CometDriftMargin(1, 0.01, 100), kCometMaxDriftMargin);
  EXPECT_NEAR(CometDriftMargin(4, -1, 0.2), std::pow(4., 0.75), 1e-12);   // no last curve
  EXPECT_NEAR(CometDriftMargin(4, 0.05, NAN), std::pow(4., 0.75), 1e-12);
}

// Uniform in [0, 1) from a 32-bit linear congruential state (reproducible across platforms).
float NextUniform(uint32_t* state) {
  *state = *state * 1664525u + 1013904223u;
  return (*state >> 8) / 16777216.f;
}

// x filled with a Gaussian of std 3, then run through a BatchNorm in TRAIN: y is x normalised
// per channel (the layer keeps its x_norm_ and std for a Backward).
shared_ptr<BatchNormLayer<float> > NormaliseByBatchNorm(Blob<float>* x, Blob<float>* y) {
  FillerParameter fp;
  fp.set_std(3);
  GaussianFiller<float>(fp).Fill(x);
  LayerParameter lp;
  lp.set_phase(TRAIN);
  shared_ptr<BatchNormLayer<float> > bn(new BatchNormLayer<float>(lp));
  const std::vector<Blob<float>*> bottom(1, x), top(1, y);
  bn->SetUp(bottom, top);
  bn->Forward(bottom, top);
  return bn;
}

// A Scale's weight gradient with its input, BatchNorm's x_norm_, stored at eb: the errors are a
// sawtooth of smoothly spread values, so they add as independent ones (the weight rule's model
// for Scale, CometIndependentWeightError), also when the output gradient's size differs by 100x
// from channel to channel and follows the input in part. ResNet-18's Scales, measured with the
// sampled rule before (whose sample held one channel of a 56x56 map), ended 5x above target.
// Each weight's error is checked against the model for its own channel: the layer's RMS is
// dominated by its few largest channels, and so varies by +-40% from one random input to the next.
TEST_F(CometPayloadTest, ScaleWeightGradientErrorIsTheIndependentOne) {
  Caffe::set_random_seed(1701);  // 25 unseeded runs gave 0.82-1.19
  const int N = 8, C = 96, H = 20, W = 20;
  Blob<float> x(N, C, H, W), y;
  NormaliseByBatchNorm(&x, &y);
  Blob<float> xn(y.shape());
  xn.CopyFrom(y);
  std::vector<Blob<float>*> sb(1, &xn), st(1, &y);
  LayerParameter sp;
  sp.mutable_scale_param()->mutable_filler()->set_value(1.5f);
  ScaleLayer<float> scale(sp);
  scale.SetUp(sb, st);
  uint32_t state = 11;
  std::vector<float> size(C);
  for (int c = 0; c < C; ++c) size[c] = std::pow(10.f, 2.f * NextUniform(&state));
  float* dy = y.mutable_cpu_diff();
  for (int i = 0; i < y.count(); ++i)
    dy[i] = size[(i / (H * W)) % C] * (0.3f * xn.cpu_data()[i] + (NextUniform(&state) - 0.5f));
  const std::vector<float> exact_x(xn.cpu_data(), xn.cpu_data() + xn.count());
  const auto gradient = [&]() {
    caffe_set(scale.blobs()[0]->count(), 0.f, scale.blobs()[0]->mutable_cpu_diff());
    scale.Backward(st, std::vector<bool>(1, false), sb);
    return std::vector<float>(scale.blobs()[0]->cpu_diff(), scale.blobs()[0]->cpu_diff() + C);
  };
  const std::vector<float> g0 = gradient();
  const double bounds[] = {0.01, 0.05, 0.2};
  for (int k = 0; k < 3; ++k) {
    shared_ptr<CometPayload> p =
        CometEncodeLossy(exact_x.data(), xn.shape(), false, bounds[k], "x_norm");
    std::string error;
    ASSERT_TRUE(CometDecode(*p, xn.mutable_cpu_data(), &error)) << error;
    const std::vector<float> g = gradient();
    double sq = 0, g_sq = 0, per_model = 0;  // per_model: sum of (error / its model)^2
    for (int c = 0; c < C; ++c) {
      double dy_c = 0;
      for (int n = 0; n < N; ++n)
        for (int i = 0; i < H * W; ++i) dy_c += std::pow(dy[(n * C + c) * H * W + i], 2);
      const double e = g[c] - g0[c];
      per_model += std::pow(e / CometIndependentWeightError(dy_c, 1, bounds[k]), 2);
      sq += e * e;
      g_sq += g0[c] * g0[c];
    }
    const double ratio = std::sqrt(per_model / C);  // 1 where every weight errs as modelled
    EXPECT_GT(ratio, 0.7) << "eb " << bounds[k];
    EXPECT_LT(ratio, 1.3) << "eb " << bounds[k];
    EXPECT_LT(std::sqrt(sq / C), 0.2 * std::sqrt(g_sq / C))
        << "test data: the error should be the smaller part";
    std::copy(exact_x.begin(), exact_x.end(), xn.mutable_cpu_data());
  }
}

// BatchNorm's input gradient with its normalised output y off by uniform errors in [-eb, eb]:
// the RMS error of dx is eb * sqrt(S / (3 C)), S the sum over the channels of
// CometBatchNormChannelError, about (mean_c(dy y) / std_c)^2 (the rule the store's adaptive bound
// for x_norm_ uses). On 6x6 maps, and after an InnerProduct at batch 4 (1x1: four values a
// channel), where the terms in 1 / n matter: with the first term alone the estimate falls short.
TEST_F(CometPayloadTest, BatchNormInputGradientErrorMatchesTheDerivation) {
  const int shapes[][3] = {{16, 6, 6}, {4, 1, 1}};  // N, H, W
  for (int k = 0; k < 2; ++k) {
    const int N = shapes[k][0], C = 8, H = shapes[k][1], W = shapes[k][2];
    Blob<float> x(N, C, H, W), y;
    std::vector<Blob<float>*> bottom(1, &x), top(1, &y);
    shared_ptr<BatchNormLayer<float> > bn = NormaliseByBatchNorm(&x, &y);
    // a top gradient correlated with y, so that mean(dy y) is not zero
    uint32_t state = 7;
    for (int i = 0; i < y.count(); ++i)
      y.mutable_cpu_diff()[i] = 0.5f * y.cpu_data()[i] + (NextUniform(&state) - 0.5f);
    const std::vector<bool> down(1, true);
    bn->Backward(top, down, bottom);
    const std::vector<float> dx0(x.cpu_diff(), x.cpu_diff() + x.count());
    Blob<float>* xn = CometLayerAccess<float>::bn_x_norm(bn.get());
    const std::vector<float> exact(xn->cpu_data(), xn->cpu_data() + xn->count());
    const float* sd = CometLayerAccess<float>::bn_std(bn.get())->cpu_data();
    const int M = N * H * W;
    double S = 0, first = 0;  // first: (mean_c(dy y) / std_c)^2 alone
    for (int c = 0; c < C; ++c) {
      double dy_y = 0, dy_sq = 0, y_sq = 0;
      for (int n = 0; n < N; ++n)
        for (int i = 0; i < H * W; ++i) {
          const int j = (n * C + c) * H * W + i;
          dy_y += y.cpu_diff()[j] * exact[j];
          dy_sq += y.cpu_diff()[j] * y.cpu_diff()[j];
          y_sq += exact[j] * exact[j];
        }
      S += CometBatchNormChannelError(dy_y, dy_sq, y_sq, M, sd[c]);
      first += (dy_y / M / sd[c]) * (dy_y / M / sd[c]);
    }
    // many draws of the errors where a draw has few values
    const float eb = 0.05f;
    const int draws = k ? 400 : 1;
    double err = 0;
    for (int d = 0; d < draws; ++d) {
      for (int i = 0; i < xn->count(); ++i)
        xn->mutable_cpu_data()[i] = exact[i] + eb * (2.f * NextUniform(&state) - 1.f);
      bn->Backward(top, down, bottom);
      for (int i = 0; i < x.count(); ++i) err += std::pow(x.cpu_diff()[i] - dx0[i], 2);
    }
    const double rms = std::sqrt(err / x.count() / draws);
    const double predicted = eb * std::sqrt(S / (3. * C));
    EXPECT_GT(rms, 0.8 * predicted) << "N " << N << " H " << H;
    EXPECT_LT(rms, 1.2 * predicted) << "N " << N << " H " << H;
    if (k) EXPECT_GT(rms, 1.2 * eb * std::sqrt(first / (3. * C))) << "the terms in 1 / n matter here";
  }
}

// The RMS error of a layer's input gradient (its backward from dy, against `exact`) when the
// blob `read` (its output, or its input for a layer that works from it) holds `values` off by
// errors in [-eb, eb]: uniform ones (sz false) or sz's at that bound.
double InputGradientErrorWhenReadOff(Layer<float>* layer, const std::vector<Blob<float>*>& bv,
                                     const std::vector<Blob<float>*>& tv, Blob<float>* read,
                                     const std::vector<float>& values, const Blob<float>& dy,
                                     const std::vector<float>& exact, float eb, bool sz) {
  if (!sz) {
    uint32_t state = 5;
    for (int i = 0; i < read->count(); ++i)
      read->mutable_cpu_data()[i] = values[i] + eb * (2.f * NextUniform(&state) - 1.f);
  } else {
    shared_ptr<CometPayload> p = CometEncodeLossy(values.data(), read->shape(), false, eb, "v");
    std::string error;
    CHECK(CometDecode(*p, read->mutable_cpu_data(), &error)) << error;
  }
  Blob<float>& top = *tv[0];
  caffe_copy(top.count(), dy.cpu_data(), top.mutable_cpu_diff());
  layer->Backward(tv, std::vector<bool>(1, true), bv);
  double err = 0;
  for (int i = 0; i < bv[0]->count(); ++i) err += std::pow(bv[0]->cpu_diff()[i] - exact[i], 2);
  return std::sqrt(err / bv[0]->count());
}

// Sets `layer` up on bv -> tv, runs its forward, draws an output gradient into `dy` (Gaussian, std
// 1) and returns the input gradient its backward computes from it: the exact one, against which
// InputGradientErrorWhenReadOff measures errors.
std::vector<float> ExactInputGradient(Layer<float>* layer, const std::vector<Blob<float>*>& bv,
                                      const std::vector<Blob<float>*>& tv, Blob<float>* dy) {
  layer->SetUp(bv, tv);
  layer->Forward(bv, tv);
  FillerParameter fp;
  fp.set_std(1.f);
  dy->Reshape(tv[0]->shape());
  GaussianFiller<float>(fp).Fill(dy);
  caffe_copy(tv[0]->count(), dy->cpu_data(), tv[0]->mutable_cpu_diff());
  layer->Backward(tv, std::vector<bool>(1, true), bv);
  return std::vector<float>(bv[0]->cpu_diff(), bv[0]->cpu_diff() + bv[0]->count());
}

double InputGradientErrorFromOutput(Layer<float>* layer, const std::vector<Blob<float>*>& bv,
                                    const std::vector<Blob<float>*>& tv,
                                    const std::vector<float>& y, const Blob<float>& dy,
                                    const std::vector<float>& exact, float eb, bool sz) {
  return InputGradientErrorWhenReadOff(layer, bv, tv, tv[0], y, dy, exact, eb, sz);
}

// Sigmoid, TanH and ELU compute dx = dy f'(y) from their output y. An error e in y, uniform in
// [-eb, eb], moves dx by an RMS of eb sqrt(E[dy^2 g^2] / 3), g = 1 - 2y (Sigmoid), 2y (TanH) or
// 1 where y <= 0 (ELU), the derivative rule's estimate (bounds.cpp, DerivativeErrorPerBound);
// sz's errors at the same bound stay within it.
TEST_F(CometPayloadTest, SigmoidTanHAndELUGradientErrorMatchesTheDerivation) {
  for (int kind = 0; kind < 3; ++kind) {  // Sigmoid, TanH, ELU
    Blob<float> bottom(4, 6, 10, 10), top;
    std::vector<Blob<float>*> bv(1, &bottom), tv(1, &top);
    FillerParameter wide;
    wide.set_std(2.5f);  // both tails and the middle of the curve
    GaussianFiller<float>(wide).Fill(&bottom);
    LayerParameter lp;
    shared_ptr<Layer<float> > layer;
    if (kind == 0) layer.reset(new SigmoidLayer<float>(lp));
    if (kind == 1) layer.reset(new TanHLayer<float>(lp));
    if (kind == 2) layer.reset(new ELULayer<float>(lp));  // x's sign is read exactly
    Blob<float> dy;
    const std::vector<float> exact = ExactInputGradient(layer.get(), bv, tv, &dy);
    const std::vector<float> y(top.cpu_data(), top.cpu_data() + top.count());
    double sum = 0;
    for (int i = 0; i < top.count(); ++i) {
      const double g = kind == 0 ? 1. - 2. * y[i] : kind == 1 ? 2. * y[i] : y[i] <= 0;
      sum += static_cast<double>(dy.cpu_data()[i]) * dy.cpu_data()[i] * g * g;
    }
    const double per_eb = std::sqrt(sum / (3. * top.count()));
    const float eb = 1e-2f;
    for (int way = 0; way < 2; ++way) {  // uniform errors, then sz's
      const double rms = InputGradientErrorFromOutput(layer.get(), bv, tv, y, dy, exact, eb, way);
      if (way == 0) {
        EXPECT_GT(rms, 0.9 * eb * per_eb) << layer->type();
      }
      EXPECT_LT(rms, 1.1 * eb * per_eb) << layer->type() << (way ? ", sz" : ", uniform");
    }
  }
}

// Exp computes dx = c dy y (c = log(base) scale) and Softmax dx = y (dy - sum(dy y)) along its
// axis, from their output y. With y off by errors in [-eb, eb], the RMS error of dx is eb c
// sqrt(E[dy^2] / 3) and eb sqrt(E[(dy - s)^2 + y^2 sum(dy^2)] / 3), the derivative rule's estimates
// (bounds.cpp, DerivativeErrorPerBound): matched by independent uniform errors, not exceeded by
// sz's, for Softmax across channels (its values H x W apart in memory) and along the last axis
// (adjacent).
TEST_F(CometPayloadTest, ExpAndSoftmaxGradientErrorMatchesTheDerivation) {
  for (int kind = 0; kind < 3; ++kind) {  // Exp, Softmax over channels, Softmax over the last axis
    Blob<float> bottom(4, 10, 8, 8), top;
    std::vector<Blob<float>*> bv(1, &bottom), tv(1, &top);
    FillerParameter wide;
    wide.set_std(kind == 0 ? 1.f : 3.f);
    GaussianFiller<float>(wide).Fill(&bottom);
    LayerParameter lp;
    shared_ptr<Layer<float> > layer;
    if (kind == 0) {
      lp.mutable_exp_param()->set_base(2.f);
      lp.mutable_exp_param()->set_scale(0.5f);
      layer.reset(new ExpLayer<float>(lp));
    } else {
      lp.mutable_softmax_param()->set_axis(kind == 1 ? 1 : -1);
      layer.reset(new SoftmaxLayer<float>(lp));
    }
    Blob<float> dy;
    const std::vector<float> exact = ExactInputGradient(layer.get(), bv, tv, &dy);
    const std::vector<float> y(top.cpu_data(), top.cpu_data() + top.count());
    const float* g = dy.cpu_data();
    double sum = 0;
    if (kind == 0) {
      const double c = 0.5 * std::log(2.);
      for (int i = 0; i < top.count(); ++i) sum += c * c * g[i] * g[i];
    } else {
      const int channels = kind == 1 ? 10 : 8, inner = kind == 1 ? 64 : 1;
      for (int o = 0; o < top.count() / (channels * inner); ++o)
        for (int k = 0; k < inner; ++k) {
          const int at = o * channels * inner + k;
          double s = 0, d = 0;
          for (int c = 0; c < channels; ++c) {
            s += g[at + c * inner] * y[at + c * inner];
            d += g[at + c * inner] * g[at + c * inner];
          }
          for (int c = 0; c < channels; ++c)
            sum += std::pow(g[at + c * inner] - s, 2) + std::pow(y[at + c * inner], 2) * d;
        }
    }
    const double per_eb = std::sqrt(sum / (3. * top.count()));
    const float eb = kind == 0 ? 1e-2f : 1e-3f;
    for (int way = 0; way < 2; ++way) {  // uniform errors, then sz's
      const double rms = InputGradientErrorFromOutput(layer.get(), bv, tv, y, dy, exact, eb, way);
      if (way == 0) {
        EXPECT_GT(rms, 0.9 * eb * per_eb) << kind;
      }
      EXPECT_LT(rms, 1.1 * eb * per_eb) << kind << (way ? ", sz" : ", uniform");
    }
  }
}

// Swish computes dx = dy f'(x) from its input (patch 0038), or in place from its sigmoid's input
// u = beta x. An error e in x, uniform in [-eb, eb], moves dx by an RMS of eb sqrt(E[dy^2
// f''(x)^2] / 3), f''(x) = beta s (1 - s) (2 + beta x (1 - 2 s)), s = sigma(beta x), and one in u
// by eb sqrt(E[dy^2 (f''(x) / beta)^2] / 3) (bounds.cpp, DerivativeErrorPerBound); sz's errors at
// the same bound stay within it. The gradient is upstream's from the output, and in place the
// same bit for bit as not in place, with the sigmoid's output read or computed again.
TEST_F(CometPayloadTest, SwishGradientErrorFromItsInputMatchesTheDerivation) {
  const float betas[] = {1.f, 1.5f};
  for (int k = 0; k < 2; ++k) {
    const double beta = betas[k];
    std::vector<float> not_in_place;
    for (int in_place = 0; in_place < 2; ++in_place) {
      Blob<float> bottom(4, 6, 10, 10), top;
      std::vector<Blob<float>*> bv(1, &bottom), tv(1, in_place ? &bottom : &top);
      FillerParameter wide;
      wide.set_std(2.5f);
      Caffe::set_random_seed(11);  // the same x both ways
      GaussianFiller<float>(wide).Fill(&bottom);
      const std::vector<float> x(bottom.cpu_data(), bottom.cpu_data() + bottom.count());
      LayerParameter lp;
      lp.mutable_swish_param()->set_beta(betas[k]);
      SwishLayer<float> layer(lp);
      Blob<float> dy;
      Caffe::set_random_seed(12);  // the same dy both ways
      const std::vector<float> exact = ExactInputGradient(&layer, bv, tv, &dy);
      if (in_place) {
        for (int i = 0; i < bottom.count(); ++i) ASSERT_EQ(exact[i], not_in_place[i]) << i;
      } else {
        not_in_place = exact;
      }
      // upstream's form, from the output and the sigmoid: beta y + s (1 - beta y)
      const float* g = dy.cpu_data();
      double sum = 0;
      for (int i = 0; i < bottom.count(); ++i) {
        const double bx = beta * x[i], s = 0.5 * std::tanh(0.5 * bx) + 0.5, y = x[i] * s;
        ASSERT_NEAR(exact[i], g[i] * (beta * y + s * (1. - beta * y)),
                    1e-5 * (1. + std::fabs(g[i]))) << "at " << i;
        const double f2 = (in_place ? 1. : beta) * s * (1. - s) * (2. + bx * (1. - 2. * s));
        sum += g[i] * g[i] * f2 * f2;
      }
      const double per_eb = std::sqrt(sum / (3. * bottom.count()));
      // what the backward reads: x, or in place the sigmoid's input u = beta x; the sigmoid's
      // output freed, as the store frees it, so that s follows the error too
      CometLayerAccess<float>::swish_sigmoid(&layer, 1)->data()->comet_release();
      Blob<float>* read = in_place ? CometLayerAccess<float>::swish_sigmoid(&layer, 0) : &bottom;
      const std::vector<float> values(read->cpu_data(), read->cpu_data() + read->count());
      EXPECT_EQ(InputGradientErrorWhenReadOff(&layer, bv, tv, read, values, dy, exact, 0.f, false), 0.)
          << "s computed again is the sigmoid's output, bit for bit";
      const float eb = 1e-2f;
      for (int way = 0; way < 2; ++way) {  // uniform errors, then sz's
        const double rms =
            InputGradientErrorWhenReadOff(&layer, bv, tv, read, values, dy, exact, eb, way);
        if (way == 0) {
          EXPECT_GT(rms, 0.9 * eb * per_eb) << "beta " << beta << ", in place " << in_place;
        }
        EXPECT_LT(rms, 1.1 * eb * per_eb) << "beta " << beta << ", in place " << in_place
                                          << (way ? ", sz" : ", uniform");
      }
    }
  }
}

// Deconvolution's weight gradient sums its input x against its output gradient's columns: with x
// off by independent errors in [-eb, eb], the RMS error over the weights is eb ||dy|| /
// sqrt(3 C_out) at stride 1 (the independent estimate with Deconvolution's outputs, bounds.cpp
// WeightOutputs) and below it at stride 2 (each weight meets a quarter of dy).
TEST_F(CometPayloadTest, DeconvolutionWeightGradientErrorMatchesTheIndependentEstimate) {
  for (int stride = 1; stride <= 2; ++stride) {
    LayerParameter lp;
    ConvolutionParameter* cp = lp.mutable_convolution_param();
    cp->set_num_output(5);
    cp->add_kernel_size(stride == 1 ? 3 : 4);
    cp->add_stride(stride);
    cp->add_pad(1);
    cp->mutable_weight_filler()->set_type("gaussian");
    DeconvolutionLayer<float> deconv(lp);
    Blob<float> bottom(4, 6, 12, 12), top;
    std::vector<Blob<float>*> bv(1, &bottom), tv(1, &top);
    FillerParameter fp;
    fp.set_std(1.f);
    GaussianFiller<float>(fp).Fill(&bottom);
    deconv.SetUp(bv, tv);
    deconv.Forward(bv, tv);
    GaussianFiller<float>(fp).Fill(&top);
    caffe_copy(top.count(), top.cpu_data(), top.mutable_cpu_diff());
    const std::vector<bool> down(1, false);
    Blob<float>* w = deconv.blobs()[0].get();
    caffe_set(w->count(), 0.f, w->mutable_cpu_diff());
    deconv.Backward(tv, down, bv);
    const std::vector<float> exact(w->cpu_diff(), w->cpu_diff() + w->count());
    const float eb = 1e-2f;
    uint32_t state = 3;
    for (int i = 0; i < bottom.count(); ++i)
      bottom.mutable_cpu_data()[i] += eb * (2.f * NextUniform(&state) - 1.f);
    caffe_set(w->count(), 0.f, w->mutable_cpu_diff());
    deconv.Backward(tv, down, bv);
    double err = 0;
    for (int i = 0; i < w->count(); ++i)
      err += (w->cpu_diff()[i] - exact[i]) * (w->cpu_diff()[i] - exact[i]);
    const double rms = std::sqrt(err / w->count());
    ASSERT_EQ(w->shape(1), 5) << "Deconvolution's weights: input x output x kernel";
    const double estimate = CometIndependentWeightError(top.sumsq_diff(), 5, eb);
    EXPECT_LT(rms, 1.1 * estimate) << "stride " << stride;
    EXPECT_GT(rms, (stride == 1 ? 0.8 : 0.3) * estimate) << "stride " << stride;
  }
}

// ReLU's backward only asks whether its input was positive: restored from a mask, its gradient
// is exactly the one from the dense input.
TEST_F(CometPayloadTest, ReluGradientFromTheMaskIsExact) {
  Blob<float> bottom(2, 6, 9, 9), top;
  std::vector<Blob<float>*> bv(1, &bottom), tv(1, &top);
  FillerParameter fp;
  fp.set_std(1.f);
  GaussianFiller<float> filler(fp);
  filler.Fill(&bottom);
  for (int slope = 0; slope < 2; ++slope) {
    LayerParameter lp;
    lp.mutable_relu_param()->set_negative_slope(slope ? 0.1f : 0.f);
    ReLULayer<float> relu(lp);
    relu.SetUp(bv, tv);
    relu.Forward(bv, tv);
    filler.Fill(&top);
    caffe_copy(top.count(), top.cpu_data(), top.mutable_cpu_diff());
    const std::vector<bool> down(1, true);
    relu.Backward(tv, down, bv);
    std::vector<float> exact(bottom.cpu_diff(), bottom.cpu_diff() + bottom.count());
    std::vector<float> x(bottom.cpu_data(), bottom.cpu_data() + bottom.count());
    shared_ptr<CometPayload> m = CometEncodeMask(bottom.cpu_data(), bottom.count(), false, "x");
    std::string error;
    ASSERT_TRUE(CometDecode(*m, bottom.mutable_cpu_data(), &error)) << error;
    relu.Backward(tv, down, bv);
    for (int i = 0; i < bottom.count(); ++i) ASSERT_EQ(bottom.cpu_diff()[i], exact[i]) << i;
    caffe_copy(bottom.count(), x.data(), bottom.mutable_cpu_data());
  }
}

// An LRN layer (alpha 1, so that the term its input's errors move matters; beta 0.75) on
// activations of the given shape, run forward and backward once from a Gaussian output
// gradient: the exact input gradient, input and output the lossy runs compare with.
struct LrnOnActivations {
  LrnOnActivations(int num, int channels, int height, int width, int local_size, bool within,
                   unsigned seed)
      : bottom(num, channels, height, width), bv(1, &bottom), tv(1, &top), down(1, true) {
    FillActivations(&bottom, 0.5f, 3.f, seed);
    lp.mutable_lrn_param()->set_local_size(local_size);
    lp.mutable_lrn_param()->set_alpha(1.f);
    lp.mutable_lrn_param()->set_beta(0.75f);
    if (within) lp.mutable_lrn_param()->set_norm_region(LRNParameter_NormRegion_WITHIN_CHANNEL);
    lrn.reset(new LRNLayer<float>(lp));
    lrn->SetUp(bv, tv);
    lrn->Forward(bv, tv);
    FillerParameter fp;
    fp.set_std(1.f);
    GaussianFiller<float> filler(fp);
    dy.Reshape(top.shape());
    filler.Fill(&dy);
    Backward();
    exact.assign(bottom.cpu_diff(), bottom.cpu_diff() + bottom.count());
    x.assign(bottom.cpu_data(), bottom.cpu_data() + bottom.count());
    y.assign(top.cpu_data(), top.cpu_data() + top.count());
  }
  void Backward() {
    caffe_copy(top.count(), dy.cpu_data(), top.mutable_cpu_diff());
    lrn->Backward(tv, down, bv);
  }
  // The RMS error per unit of bound that LRN's adaptive rule estimates (bounds.cpp,
  // LrnErrorPerBound) over windows of n values: (2ab / (n k sqrt 3)) sqrt(n^2 E[dy^2 y^2] +
  // n E[x^2] E[dy^2]).
  double RuleEstimate(double n, double k) const {
    double dyy = 0, xx = 0, dd = 0;
    for (int i = 0; i < y.size(); ++i) {
      const double g = dy.cpu_data()[i];
      dyy += g * g * y[i] * y[i];
      xx += x[i] * x[i];
      dd += g * g;
    }
    const double m = y.size();
    return 2.0 * lp.lrn_param().alpha() * lp.lrn_param().beta() / (n * k * std::sqrt(3.0)) *
           std::sqrt(n * n * dyy / m + n * (xx / m) * (dd / m));
  }
  Blob<float> bottom, top, dy;
  std::vector<Blob<float>*> bv, tv;
  std::vector<bool> down;
  LayerParameter lp;
  shared_ptr<LRNLayer<float> > lrn;
  std::vector<float> exact, x, y;
};

// LRN's backward reads its input x and output y. With both stored at bound eb (its internal scale
// s >= k stays exact), the input gradient of element c moves by at most
// (2 alpha beta / n) eb / k * sum over its window c' of |dy_c'| (|y_c'| + |x_c| + eb).
TEST_F(CometPayloadTest, LrnGradientErrorStaysWithinItsBound) {
  const int N = 2, C = 7, H = 5, W = 6, n = 5;
  LrnOnActivations t(N, C, H, W, n, false, 13);
  Blob<float>& bottom = t.bottom;
  Blob<float>& top = t.top;
  const Blob<float>& dy = t.dy;
  const LayerParameter& lp = t.lp;
  const std::vector<float>& exact = t.exact;
  const std::vector<float>& x = t.x;
  const std::vector<float>& y = t.y;
  const double ebs[] = {1e-1, 1e-3};
  double worst[2], tightest = 0;  // tightest: largest error / bound seen
  double sq[2] = {0, 0};          // sum of squared errors
  for (int k = 0; k < 2; ++k) {
    const double eb = ebs[k];
    std::string error;
    shared_ptr<CometPayload> px = CometEncodeLossy(x.data(), bottom.shape(), false, eb, "x");
    shared_ptr<CometPayload> py = CometEncodeLossy(y.data(), top.shape(), false, eb, "y");
    ASSERT_TRUE(CometDecode(*px, bottom.mutable_cpu_data(), &error)) << error;
    ASSERT_TRUE(CometDecode(*py, top.mutable_cpu_data(), &error)) << error;
    t.Backward();
    const double c0 = 2.0 * lp.lrn_param().alpha() * lp.lrn_param().beta() / n * eb /
                      lp.lrn_param().k();
    worst[k] = 0;
    for (int img = 0; img < N; ++img) for (int c = 0; c < C; ++c)
      for (int p = 0; p < H * W; ++p) {
        const int i = (img * C + c) * H * W + p;
        double sum = 0;
        for (int cc = std::max(0, c - n / 2); cc <= std::min(C - 1, c + n / 2); ++cc) {
          const int j = (img * C + cc) * H * W + p;
          sum += std::fabs(dy.cpu_data()[j]) * (std::fabs(y[j]) + std::fabs(x[i]) + eb);
        }
        const double err = std::fabs(bottom.cpu_diff()[i] - exact[i]);
        ASSERT_LE(err, c0 * sum * (1 + 1e-4) + 1e-6) << "element " << i << " at eb " << eb;
        worst[k] = std::max(worst[k], err);
        tightest = std::max(tightest, err / (c0 * sum));
        sq[k] += err * err;
      }
    // The RMS estimate the adaptive LRN rule uses bounds the RMS error.
    const double m = top.count();
    const double per_eb = t.RuleEstimate(n, lp.lrn_param().k());
    const double rms = std::sqrt(sq[k] / m);
    EXPECT_LE(rms, eb * per_eb) << "at eb " << eb;
    EXPECT_GT(rms, 0.05 * eb * per_eb) << "the estimate is far looser than the error, eb " << eb;
  }
  EXPECT_GT(worst[0], 0) << "no error at all at eb 0.1?";
  EXPECT_LT(worst[1], worst[0]) << "a tighter bound must give a smaller gradient error";
  EXPECT_GT(tightest, 0.05) << "the bound is far looser than the errors it bounds";
}

// Within a channel LRN's backward reads its input and its internal outputs, computed from the
// input (again from the restored, lossy input with recompute_lrn; else kept from the forward on
// the exact one): either way the RMS error of its input gradient stays below LRN's rule, with n
// = local_size^2 values per window and k = 1 (bounds.cpp, LrnErrorPerBound).
TEST_F(CometPayloadTest, LrnWithinAChannelGradientErrorStaysWithinItsEstimate) {
  const int size = 3;
  LrnOnActivations t(2, 4, 9, 11, size, true, 17);
  Blob<float>& bottom = t.bottom;
  const Blob<float>& top = t.top;
  const std::vector<float>& exact = t.exact;
  const std::vector<float>& x = t.x;
  const double m = top.count();
  const double per_eb = t.RuleEstimate(size * size, 1.);  // k = 1 within a channel
  const double ebs[] = {1e-1, 1e-2};
  for (int recompute = 0; recompute < 2; ++recompute) {
    double rms[2];
    for (int k = 0; k < 2; ++k) {
      caffe_copy(bottom.count(), x.data(), bottom.mutable_cpu_data());
      t.lrn->Forward(t.bv, t.tv);  // the internal outputs of the exact input
      std::string error;
      shared_ptr<CometPayload> px = CometEncodeLossy(x.data(), bottom.shape(), false, ebs[k], "x");
      ASSERT_TRUE(CometDecode(*px, bottom.mutable_cpu_data(), &error)) << error;
      if (recompute) t.lrn->Forward(t.bv, t.tv);
      t.Backward();
      double sq = 0;
      for (int i = 0; i < m; ++i) sq += std::pow(bottom.cpu_diff()[i] - exact[i], 2);
      rms[k] = std::sqrt(sq / m);
      EXPECT_LE(rms[k], ebs[k] * per_eb) << "recompute " << recompute << ", eb " << ebs[k];
      EXPECT_GT(rms[k], 0.05 * ebs[k] * per_eb)
          << "the estimate is far looser than the error: recompute " << recompute << ", eb "
          << ebs[k];
    }
    EXPECT_LT(rms[1], rms[0]) << "a tighter bound must give a smaller gradient error";
  }
}

// The store's LRN within a channel from the input alone (lrn_within.cpp) against upstream's chain
// of internal layers: the output x S and the input gradient agree to float rounding, windows cut
// by the borders included (planes of 9 x 11, 1 x 7 and 2 x 2, local_size 3 and 5). The GPU's
// kernel computes each element with comet_lrn::backward_at, without the CPU's planes of t: here
// on the host, it gives the CPU's gradient.
TEST_F(CometPayloadTest, LrnWithinAChannelFromTheInputMatchesUpstreamsChain) {
  const int shapes[][4] = {{2, 4, 9, 11}, {1, 3, 1, 7}, {3, 2, 2, 2}};
  for (int k = 0; k < 3; ++k)
    for (int size = 3; size <= 5; size += 2) {
      const int* sh = shapes[k];
      LrnOnActivations t(sh[0], sh[1], sh[2], sh[3], size, true, 19 + size);
      const LRNParameter& p = t.lp.lrn_param();
      const int planes = sh[0] * sh[1], n = t.bottom.count();
      std::vector<float> scale(n), dx(n);
      CometLrnWithinScale(p, planes, sh[2], sh[3], t.x.data(), scale.data());
      CometLrnWithinBackward(p, planes, sh[2], sh[3], t.x.data(), t.dy.cpu_data(), dx.data());
      float ymax = 0, gmax = 0;
      for (int i = 0; i < n; ++i) {
        ymax = std::max(ymax, std::fabs(t.y[i]));
        gmax = std::max(gmax, std::fabs(t.exact[i]));
      }
      for (int i = 0; i < n; ++i) {
        ASSERT_NEAR(t.x[i] * scale[i], t.y[i], 1e-6f * ymax) << "size " << size << ", at " << i;
        ASSERT_NEAR(dx[i], t.exact[i], 1e-5f * gmax) << "size " << size << ", at " << i;
      }
      const comet_lrn::Geometry g = CometLrnGeometry(p, sh[2], sh[3]);
      const int hw = sh[2] * sh[3];
      for (int i = 0; i < n; ++i) {
        const int q = i / hw, r = i % hw;
        const float each = comet_lrn::backward_at(t.x.data() + q * hw, t.dy.cpu_data() + q * hw,
                                                  r / sh[3], r % sh[3], g);
        ASSERT_NEAR(each, dx[i], 1e-6f * gmax) << "size " << size << ", at " << i;
      }
      // and from a lossy input, within LRN's rule as upstream's chain is
      std::string error;
      shared_ptr<CometPayload> px = CometEncodeLossy(t.x.data(), t.bottom.shape(), false, 0.1, "x");
      std::vector<float> lossy(n);
      ASSERT_TRUE(CometDecode(*px, lossy.data(), &error)) << error;
      CometLrnWithinBackward(p, planes, sh[2], sh[3], lossy.data(), t.dy.cpu_data(), dx.data());
      double sq = 0;
      for (int i = 0; i < n; ++i) sq += std::pow(dx[i] - t.exact[i], 2);
      EXPECT_LE(std::sqrt(sq / n), 0.1 * t.RuleEstimate(size * size, 1.)) << "size " << size;
    }
}

TEST_F(CometPayloadTest, ReluBackwardFromTheMaskMatchesReluLayerBitForBit) {
  const float slopes[] = {0.f, 0.1f};
  for (int k = 0; k < 2; ++k) {
    LayerParameter lp;
    lp.mutable_relu_param()->set_negative_slope(slopes[k]);
    ReLULayer<float> relu(lp);
    Blob<float> bottom(2, 3, 5, 7), top;  // 210 values: a partial last mask word
    FillActivations(&bottom, 0.3f, 2.f, 11 + k);
    float* x = bottom.mutable_cpu_data();
    for (int i = 0; i < bottom.count(); i += 3) x[i] = -x[i];  // negatives, zeros, positives
    std::vector<Blob<float>*> bv(1, &bottom), tv(1, &top);
    relu.SetUp(bv, tv);
    relu.Forward(bv, tv);
    shared_ptr<CometPayload> mask =
        CometEncodeMask(bottom.cpu_data(), bottom.count(), false, "x");
    ASSERT_TRUE(mask.get() != NULL);
    FillActivations(&top, 0.f, 1.f, 5);  // top diff
    caffe_copy(top.count(), top.cpu_data(), top.mutable_cpu_diff());
    top.mutable_cpu_diff()[4] = -std::numeric_limits<float>::infinity();  // Inf * 0 stays NaN
    relu.Backward(tv, std::vector<bool>(1, true), bv);
    std::vector<float> expected(bottom.cpu_diff(), bottom.cpu_diff() + bottom.count());
    std::vector<float> got(bottom.count(), 7.f);
    std::string error;
    ASSERT_TRUE(CometReluBackward(*mask, top.cpu_diff(), got.data(), slopes[k], &error)) << error;
    for (int i = 0; i < bottom.count(); ++i) {
      if (std::isnan(expected[i])) {
        EXPECT_TRUE(std::isnan(got[i])) << i;
      } else {
        ASSERT_EQ(std::memcmp(&expected[i], &got[i], sizeof(float)), 0)
            << "element " << i << ": " << expected[i] << " vs " << got[i];
      }
    }
    // in place, as an in-place ReLU runs it
    std::vector<float> diff(top.cpu_diff(), top.cpu_diff() + top.count());
    ASSERT_TRUE(CometReluBackward(*mask, diff.data(), diff.data(), slopes[k], &error)) << error;
    EXPECT_EQ(std::memcmp(diff.data() + 5, got.data() + 5, (diff.size() - 5) * sizeof(float)), 0);
    static_cast<uint32_t*>(mask->data())[2] ^= 0x10u;
    EXPECT_FALSE(CometReluBackward(*mask, top.cpu_diff(), got.data(), slopes[k], &error));
  }
}

TEST_F(CometPayloadTest, ArgmaxCodesRoundTripAndRefuseWhatTheyCannotHold) {
  MaxPoolingRun run(MaxPoolingRun::Param());
  Blob<int>* idx = CometLayerAccess<float>::argmax(&run.layer);
  ASSERT_TRUE(idx != NULL);
  const comet_codes::PoolGeometry g = CometLayerAccess<float>::geometry(&run.layer);
  shared_ptr<CometPayload> p = CometEncodeArgmax(idx->cpu_data(), idx->count(), g, false, "a");
  ASSERT_TRUE(p.get() != NULL);
  EXPECT_EQ(p->code_bits, 4);  // 9 offsets in a 3x3 window
  EXPECT_EQ(p->bytes(), (idx->count() * 4 + 31) / 32 * 4);
  std::vector<int> out(idx->count(), -7);
  std::string error;
  ASSERT_TRUE(CometDecode(*p, out.data(), &error)) << error;
  for (int i = 0; i < idx->count(); ++i) ASSERT_EQ(out[i], idx->cpu_data()[i]) << i;
  // a max over a window of NaN leaves -1 upstream: not codable, the buffer stays dense
  std::vector<int> bad(idx->cpu_data(), idx->cpu_data() + idx->count());
  bad[5] = -1;
  EXPECT_TRUE(CometEncodeArgmax(bad.data(), bad.size(), g, false, "a").get() == NULL);
  bad[5] = idx->cpu_data()[5] + 3 * g.width;  // three rows down: outside its window
  EXPECT_TRUE(CometEncodeArgmax(bad.data(), bad.size(), g, false, "a").get() == NULL);
  static_cast<uint32_t*>(p->data())[1] ^= 0x100u;
  EXPECT_FALSE(CometDecode(*p, out.data(), &error));
}

// comet { pool_codes }: max pooling's forward straight into codes and its backward from them,
// against PoolingLayer itself (no store: upstream's loops) and CometEncodeArgmax of its argmax,
// bit for bit, over windows that overlap, are clipped by padding, tie, hold NaN or -Inf, and a
// map large enough to be split over the cores. The backward's gather (the device kernel's
// per-element function) is checked on the host against the same.
TEST_F(CometPayloadTest, MaxPoolingIntoCodesMatchesPoolingLayerBitForBit) {
  struct Case {
    int kh, kw, sh, sw, ph, pw, n, c, h, w;
  } cases[] = {{3, 3, 2, 2, 1, 1, 2, 3, 11, 13},  {2, 2, 2, 2, 0, 0, 2, 3, 10, 9},
               {3, 3, 1, 1, 0, 0, 1, 2, 7, 8},    {2, 3, 1, 2, 1, 2, 2, 2, 9, 12},
               {11, 13, 1, 1, 0, 0, 2, 3, 11, 13},  // global: 143 codes, 8 bits
               {3, 3, 2, 2, 0, 0, 3, 17, 129, 160}};  // 261,120 pooled: split
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  int outside_checked = 0;
  for (const Case& k : cases) {
    LayerParameter lp;
    PoolingParameter* pp = lp.mutable_pooling_param();
    pp->set_pool(PoolingParameter_PoolMethod_MAX);
    pp->set_kernel_h(k.kh);
    pp->set_kernel_w(k.kw);
    pp->set_stride_h(k.sh);
    pp->set_stride_w(k.sw);
    pp->set_pad_h(k.ph);
    pp->set_pad_w(k.pw);
    lp.add_top("pool");  // one top: the argmax stays inside the layer
    PoolingLayer<float> layer(lp);
    Blob<float> bottom(k.n, k.c, k.h, k.w), top;
    FillActivations(&bottom, 0.3f, 1.f, 17);  // ReLU-like: many zeros, so many ties
    float* x = bottom.mutable_cpu_data();
    for (int i = 0; i < bottom.count(); i += 37) x[i] = -x[i] - 1.f;
    x[5] = nan;
    x[k.w + 3] = -inf;
    for (int i = 0; i < k.w * 3 && i + 2 * k.w < bottom.count(); ++i) x[2 * k.w + i] = -inf;
    x[bottom.count() - 1] = nan;
    std::vector<Blob<float>*> bv(1, &bottom), tv(1, &top);
    layer.SetUp(bv, tv);
    layer.Forward(bv, tv);
    const Blob<int>* idx = CometLayerAccess<float>::argmax(&layer);
    ASSERT_TRUE(idx != NULL);
    const comet_codes::PoolGeometry g = CometLayerAccess<float>::geometry(&layer);
    const std::string where = "kernel " + std::to_string(k.kh) + "x" + std::to_string(k.kw) +
                              " on " + std::to_string(k.h) + "x" + std::to_string(k.w);
    shared_ptr<CometPayload> want = CometEncodeArgmax(idx->cpu_data(), idx->count(), g, false,
                                                      "a");
    ASSERT_TRUE(want.get() != NULL) << where;
    std::vector<float> maxima(top.count(), 7.f);
    shared_ptr<CometPayload> got =
        CometPoolToCodes(bottom.cpu_data(), maxima.data(), top.count(), g, false, "a");
    ASSERT_TRUE(got.get() != NULL) << where;
    ASSERT_EQ(std::memcmp(maxima.data(), top.cpu_data(), top.count() * sizeof(float)), 0)
        << where;
    ASSERT_EQ(got->code_bits, want->code_bits) << where;
    ASSERT_EQ(got->bytes(), want->bytes()) << where;
    ASSERT_EQ(std::memcmp(got->data(), want->data(), got->bytes()), 0) << where;
    EXPECT_EQ(got->mask_popcount, want->mask_popcount) << where;

    FillActivations(&top, 0.f, 1.f, 23);  // top diffs
    caffe_copy(top.count(), top.cpu_data(), top.mutable_cpu_diff());
    layer.Backward(tv, std::vector<bool>(1, true), bv);
    std::vector<float> diff(bottom.count(), 7.f);
    std::string error;
    ASSERT_TRUE(CometPoolBackwardFromCodes(*got, top.cpu_diff(), diff.data(), &error))
        << where << ": " << error;
    ASSERT_EQ(std::memcmp(diff.data(), bottom.cpu_diff(), diff.size() * sizeof(float)), 0)
        << where;
    const size_t plane = static_cast<size_t>(k.h) * k.w;
    const size_t pooled = static_cast<size_t>(g.pooled_height) * g.pooled_width;
    const uint32_t* words = static_cast<const uint32_t*>(got->data());
    for (size_t i = 0; i < diff.size(); ++i) {
      const size_t q = i / plane, r = i % plane;
      const float v = comet_codes::max_pool_diff_at(words, got->code_bits, q * pooled,
                                                    top.cpu_diff() + q * pooled, r / k.w,
                                                    r % k.w, g);
      ASSERT_EQ(std::memcmp(&v, &bottom.cpu_diff()[i], sizeof(float)), 0) << where << " " << i;
    }
    // A code past the window (one of the unused values of its width) or a flipped bit: refused.
    uint32_t* w0 = static_cast<uint32_t*>(got->data());
    const uint32_t keep = w0[0];
    if (k.kh * k.kw < (1 << got->code_bits)) {
      w0[0] |= (1u << got->code_bits) - 1u;
      EXPECT_FALSE(CometPoolBackwardFromCodes(*got, top.cpu_diff(), diff.data(), &error))
          << where;
    }
    w0[0] = keep ^ 0x1u;
    EXPECT_FALSE(CometPoolBackwardFromCodes(*got, top.cpu_diff(), diff.data(), &error)) << where;
    w0[0] = keep;
    // A code outside its window with the popcount kept: the backward and the argmax's decode
    // refuse it by name (the scatter would have written outside the window, or the plane).
    if (SwapInACodeOutsideItsWindow(w0, got->count(), got->code_bits, g)) {
      ++outside_checked;
      error.clear();
      EXPECT_FALSE(CometPoolBackwardFromCodes(*got, top.cpu_diff(), diff.data(), &error)) << where;
      EXPECT_EQ(error, "a code names no element of its window") << where;
      std::memcpy(want->data(), w0, want->bytes());
      std::vector<int> argmax(top.count());
      error.clear();
      EXPECT_FALSE(CometDecode(*want, argmax.data(), &error)) << where;
      EXPECT_EQ(error, "a code names no element of its window") << where;
    }
  }
  EXPECT_EQ(outside_checked, 6);  // the 2x2 window too: its last column is clipped
}

// The host's argmax encoder divides by the plane's width as a multiply and a shift: exact for
// every index an int holds, at the edges of each quotient and for divisors up to 2^31 - 1.
TEST_F(CometPayloadTest, WidthDividerIsExactForEveryIndex) {
  const uint32_t divisors[] = {1u, 2u, 3u, 5u, 7u, 13u, 27u, 55u, 56u, 112u, 224u, 1000u,
                               65535u, 65536u, 65537u, (1u << 20) + 1u, (1u << 30) + 3u,
                               (1u << 31) - 1u};
  std::mt19937 rng(7);
  for (uint32_t d : divisors) {
    const comet_codes::Divider by = comet_codes::make_divider(d);
    std::vector<uint32_t> n = {0u, 1u, d - 1u, d, d + 1u, (1u << 31) - 1u, (1u << 31) - 2u};
    for (int t = 0; t < 20000; ++t) {
      const uint32_t q = rng() % ((1u << 31) / d);
      n.push_back(q * d);
      n.push_back(q * d + d - 1u);
      n.push_back(rng() & 0x7FFFFFFFu);
    }
    for (uint32_t v : n) {
      if (v > 0x7FFFFFFFu) continue;
      ASSERT_EQ(comet_codes::divide(v, by), v / d) << v << " / " << d;
    }
  }
}

// The host decoder adds a table offset to each window's corner; on a map large enough to be
// split over the cores (the split falls inside a plane and inside a row) every index is exact.
TEST_F(CometPayloadTest, ArgmaxDecodeIsExactWhenSplitInsideARow) {
  MaxPoolingRun run(MaxPoolingRun::Param(), 3, 17, 64, 80);
  Blob<int>* idx = CometLayerAccess<float>::argmax(&run.layer);
  ASSERT_TRUE(idx != NULL);
  ASSERT_GE(idx->count(), 1 << 16);  // ParallelRanges splits from 2^16 elements
  const comet_codes::PoolGeometry g = CometLayerAccess<float>::geometry(&run.layer);
  shared_ptr<CometPayload> p = CometEncodeArgmax(idx->cpu_data(), idx->count(), g, false, "a");
  ASSERT_TRUE(p.get() != NULL);
  std::vector<int> out(idx->count(), -7);
  std::string error;
  ASSERT_TRUE(CometDecode(*p, out.data(), &error)) << error;
  for (int i = 0; i < idx->count(); ++i) ASSERT_EQ(out[i], idx->cpu_data()[i]) << i;
}

TEST_F(CometPayloadTest, DropoutMaskIsOneBitPerValue) {
  std::vector<unsigned int> v(1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = (i * 7919) % 3 == 0;
  const comet_codes::BinaryRule cpu = {0u, 1u};
  shared_ptr<CometPayload> p = CometEncodeBinary(v.data(), v.size(), cpu, false, "m");
  ASSERT_TRUE(p.get() != NULL);
  EXPECT_EQ(p->bytes(), 32u * 4);  // 1000 bits in 32 words
  std::vector<unsigned int> out(v.size(), 9);
  std::string error;
  ASSERT_TRUE(CometDecode(*p, out.data(), &error)) << error;
  EXPECT_TRUE(out == v);
  v[3] = 2;
  EXPECT_TRUE(CometEncodeBinary(v.data(), v.size(), cpu, false, "m").get() == NULL);
}

// The GPU Dropout keeps raw random words and its backward asks mask > uint_thres_; the device
// code (comet_codes::pack_codes/unpack_code, run here on the CPU as the kernels run them)
// restores UINT_MAX or 0, which answer that question as the originals did: the gradient is the
// same bit for bit. (A 0/1 restore would have zeroed every Dropout gradient on the GPU.)
TEST_F(CometPayloadTest, DeviceDropoutCodesKeepTheThresholdTest) {
  const size_t n = 999;
  const float ratio = 0.3f, scale = 1.f / (1.f - ratio);
  const comet_codes::BinaryRule gpu = {static_cast<uint32_t>(UINT_MAX * ratio), 0xffffffffu};
  std::vector<int32_t> raw(n);
  uint32_t state = 12345;
  for (size_t i = 0; i < n; ++i) raw[i] = static_cast<int32_t>(state = state * 1664525u + 1013904223u);
  raw[0] = static_cast<int32_t>(gpu.threshold);      // equal: dropped
  raw[1] = static_cast<int32_t>(gpu.threshold + 1);  // just above: kept
  const comet_codes::PoolGeometry none = {1, 1, 1, 1, 1, 1, 1, 1, 0, 0};
  std::vector<uint32_t> words(comet_codes::words(n, 1));
  bool bad = false;
  for (size_t w = 0; w < words.size(); ++w)
    words[w] = comet_codes::pack_codes(raw.data(), n, 1, w, false, none, gpu, &bad);
  EXPECT_FALSE(bad) << "raw words are all codable";
  int kept = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t restored =
        static_cast<uint32_t>(comet_codes::unpack_code(words.data(), i, 1, false, none, gpu));
    const uint32_t original = static_cast<uint32_t>(raw[i]);
    ASSERT_EQ(restored > gpu.threshold, original > gpu.threshold) << i;
    const float top_diff = 0.37f * (i % 7) - 1.f;
    const float want = top_diff * scale * (original > gpu.threshold);
    const float got = top_diff * scale * (restored > gpu.threshold);
    ASSERT_EQ(want, got) << i;
    kept += restored > gpu.threshold;
  }
  EXPECT_GT(kept, 600);  // about 70% kept
  EXPECT_LT(kept, 800);
  EXPECT_EQ(comet_codes::unpack_code(words.data(), 0, 1, false, none, gpu), 0);
}

long MinorFaults() {  // NOLINT(runtime/int): rusage's type
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_minflt;
}

// Writes a pattern over [p, p + bytes) and reads it back.
bool HoldsWrites(void* p, size_t bytes) {
  unsigned char* c = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < bytes; i += 512) c[i] = static_cast<unsigned char>(i / 512 * 7);
  for (size_t i = 0; i < bytes; i += 512)
    if (c[i] != static_cast<unsigned char>(i / 512 * 7)) return false;
  return true;
}

TEST_F(CometPayloadTest, HostPoolReusesFreedBlocksWithinThePeak) {
  const size_t mb = 1 << 20;
  CometHostPoolEnable(true);
  const CometPoolStats s0 = CometHostPoolQuery();
  void *a = NULL, *b = NULL, *c = NULL;
  bool cuda = true;
  CometHostMalloc(&a, 4 * mb, &cuda);
  EXPECT_FALSE(cuda);
  CometHostMalloc(&b, 2 * mb, &cuda);
  std::memset(a, 1, 4 * mb);
  std::memset(b, 1, 2 * mb);
  CometHostFree(a, 4 * mb, false);
  EXPECT_EQ(CometHostPoolQuery().cached, 4 * mb);
  CometHostMalloc(&c, 4 * mb, &cuda);  // the same size comes back from the pool
  EXPECT_EQ(c, a);
  EXPECT_EQ(CometHostPoolQuery().hits, s0.hits + 1);
  CometHostFree(b, 2 * mb, false);
  CometHostFree(c, 4 * mb, false);
  // both fit under the peak in use (6 MB): kept
  EXPECT_EQ(CometHostPoolQuery().cached, 6 * mb);
  // A new size is made of the cached pages (2 MB whole, 3 of the 4 MB block; its last 1 MB stays
  // cached): nothing new is mapped, so writing all of it faults no page in.
  void* d = NULL;
  long faults = MinorFaults();  // NOLINT(runtime/int)
  CometHostMalloc(&d, 5 * mb, &cuda);
  EXPECT_TRUE(HoldsWrites(d, 5 * mb));
  EXPECT_LT(MinorFaults() - faults, 64);  // fresh memory: 1,280 faults of 4 KB pages
  CometPoolStats s1 = CometHostPoolQuery();
  EXPECT_EQ(s1.hits, s0.hits + 2);
  EXPECT_EQ(s1.in_use, 5 * mb);
  EXPECT_EQ(s1.cached, 1 * mb);
  EXPECT_EQ(s1.evicted, s0.evicted);
  CometHostFree(d, 5 * mb, false);
  // The block of two sources is cached as one and moves on whole: 6 MB from it and the 1 MB left.
  void* e = NULL;
  faults = MinorFaults();
  CometHostMalloc(&e, 6 * mb, &cuda);
  EXPECT_TRUE(HoldsWrites(e, 6 * mb));
  EXPECT_LT(MinorFaults() - faults, 64);
  EXPECT_EQ(CometHostPoolQuery().cached, 0u);
  CometHostFree(e, 6 * mb, false);
  // More than the cache holds: every cached page and new memory for the rest.
  void* f = NULL;
  const size_t misses = CometHostPoolQuery().misses;
  CometHostMalloc(&f, 9 * mb, &cuda);
  s1 = CometHostPoolQuery();
  EXPECT_EQ(s1.misses, misses + 1);
  EXPECT_EQ(s1.cached, 0u);
  EXPECT_EQ(s1.in_use, 9 * mb);
  EXPECT_TRUE(HoldsWrites(f, 9 * mb));
  CometHostFree(f, 9 * mb, false);
  CometHostPoolEnable(false);  // the last user gone: everything goes back
  EXPECT_EQ(CometHostPoolQuery().cached, 0u);
  // small blocks are malloc's business
  void* g = NULL;
  CometHostPoolEnable(true);
  CometHostMalloc(&g, 1000, &cuda);
  CometHostFree(g, 1000, false);
  EXPECT_EQ(CometHostPoolQuery().cached, 0u);
  CometHostPoolEnable(false);
}

// Fresh memory is zeroed as upstream does, except the memory a CometFillWhole scope names on
// this thread (the store's decodes and rebuilds write all of it): that one keeps what its pool
// block held. A decode into such memory restores the blob whole; a failed one leaves nothing
// readable behind.
TEST_F(CometPayloadTest, OnlyMemoryTheStoreFillsWholeSkipsTheZeroFill) {
  const size_t n = (2 << 20) / sizeof(float);
  CometHostPoolEnable(true);
  const auto fill_and_release = [n](SyncedMemory* m) {
    float* p = static_cast<float*>(m->mutable_cpu_data());
    std::fill(p, p + n, 7.f);
    return std::make_pair(p, m->comet_release());
  };
  SyncedMemory a(n * sizeof(float)), b(n * sizeof(float)), c(n * sizeof(float));
  const float* block = fill_and_release(&a).first;
  {
    CometFillWhole whole(&b);
    const float* p = static_cast<const float*>(b.mutable_cpu_data());
    ASSERT_EQ(p, block);  // the pool's block, as it was left
    EXPECT_EQ(p[0], 7.f);
    EXPECT_EQ(p[n - 1], 7.f);
    EXPECT_TRUE(CometFillsWhole(&b));
    EXPECT_FALSE(CometFillsWhole(&c));
    // another memory allocated inside the scope is zeroed
    fill_and_release(&b);
    const float* q = static_cast<const float*>(c.cpu_data());
    ASSERT_EQ(q, block);
    EXPECT_EQ(*std::max_element(q, q + n), 0.f);
  }
  EXPECT_FALSE(CometFillsWhole(&b));
  fill_and_release(&c);
  const float* z = static_cast<const float*>(b.cpu_data());  // the scope is gone: zeroed
  ASSERT_EQ(z, block);
  EXPECT_EQ(*std::max_element(z, z + n), 0.f);
  EXPECT_EQ(*std::min_element(z, z + n), 0.f);

  // A restore decodes into the stale block: every value comes from the payload.
  Blob<float> blob(4, 8, 128, 128);
  ASSERT_EQ(static_cast<size_t>(blob.count()), n);
  FillActivations(&blob, 0.5f, 1.f, 11);
  std::fill(blob.mutable_cpu_data(), blob.mutable_cpu_data() + n / 4, 0.f);  // sz's zero blocks
  std::vector<float> orig(blob.cpu_data(), blob.cpu_data() + n);
  shared_ptr<CometPayload> p = CometEncodeLossy(blob.cpu_data(), blob.shape(), false, 1e-3, "x");
  blob.data()->comet_release();  // its block goes to the pool holding the blob's values
  const float* other = fill_and_release(&c).first;  // that block, now holding 7s
  const float* first = fill_and_release(&b).first;  // and the first one, 7s too
  blob.data()->comet_payload() = p;
  const float* back = blob.cpu_data();
  ASSERT_TRUE(back == other || back == first);
  EXPECT_LE(MaxAbsDiff(orig.data(), back, n), 1e-3);
  EXPECT_GT(std::count(back, back + n, 0.f), static_cast<std::ptrdiff_t>(n / 4));
  // A corrupt payload read from pycaffe (an exception): the memory is not left holding what the
  // failed decode wrote; a second read fails the same way.
  shared_ptr<CometPayload> bad = CometEncodeLossy(orig.data(), blob.shape(), false, 1e-3, "x7");
  static_cast<uint8_t*>(bad->data())[bad->bytes() / 2] ^= 0xff;
  blob.data()->comet_release();
  blob.data()->comet_payload() = bad;
  CometSetFatalThrows(true);
  for (int attempt = 0; attempt < 2; ++attempt) {
    EXPECT_THROW(blob.cpu_data(), std::runtime_error) << "attempt " << attempt;
    EXPECT_EQ(blob.data()->head(), SyncedMemory::UNINITIALIZED);
    EXPECT_TRUE(blob.data()->comet_payload() == bad);
  }
  CometSetFatalThrows(false);
  blob.data()->comet_payload().reset();
  b.comet_release();
  CometHostPoolEnable(false);
}

// The device pool (blocks that cannot move), driven here with made-up addresses.
std::vector<void*> fake_blocks_freed;
void FakeFree(void* ptr, size_t) { fake_blocks_freed.push_back(ptr); }
void* FakeBlock(int i) { return reinterpret_cast<void*>(static_cast<uintptr_t>(i) << 24); }

// What CometGpuMalloc does: a cached block, or room made and a new one of the pool's rounded size.
void* DeviceTake(BlockPool* pool, size_t size, int* next) {
  void* p = pool->Take(BlockPool::Key(0, size));
  if (!p) {
    pool->MakeRoom(pool->BlockBytes(size));
    pool->Track(p = FakeBlock((*next)++), pool->BlockBytes(size));
  }
  return p;
}

// A request that no cached block serves: the cache gives up blocks before the new one is
// allocated, so the device never holds the whole cache and the new block at once.
TEST_F(CometPayloadTest, SizedPoolMakesRoomBeforeANewBlock) {
  const size_t mb = 1 << 20;
  const size_t sizes[3] = {16 * mb, 8 * mb, 20 * mb};  // the third fits no cached block
  for (int make_room = 0; make_room < 2; ++make_room) {
    BlockPool pool(FakeFree, false);
    pool.enabled = 1;
    int next = 1;
    void* a = DeviceTake(&pool, sizes[0], &next);
    void* b = DeviceTake(&pool, sizes[1], &next);
    pool.Give(a, BlockPool::Key(0, sizes[0]));
    pool.Give(b, BlockPool::Key(0, sizes[1]));
    EXPECT_EQ(pool.cached, 24 * mb);
    EXPECT_TRUE(pool.Take(BlockPool::Key(0, sizes[2])) == NULL);
    if (make_room) pool.MakeRoom(sizes[2]);  // what CometGpuMalloc does now
    pool.Track(FakeBlock(next++), sizes[2]);
    EXPECT_EQ(pool.peak_in_use, 24 * mb);
    EXPECT_EQ(pool.in_use + pool.cached, 20 * mb);  // after the trim, either way
    if (make_room) {
      EXPECT_EQ(pool.peak_held, 24 * mb);  // never more than the peak in use
    } else {
      EXPECT_EQ(pool.peak_held, 44 * mb);  // the cache and the new block: what the device held
    }
  }
}

// Made-up streams and events for the device pool's fences: what was recorded where, and what
// each stream was made to wait for.
struct FakeFences {
  static std::vector<std::pair<void*, void*> > records, waits;  // (event, stream)
  static int made, destroyed;
  static void* Record(void* event, void* stream) {
    if (!event) event = reinterpret_cast<void*>(static_cast<uintptr_t>(++made));
    records.push_back(std::make_pair(event, stream));
    return event;
  }
  static void Wait(void* event, void* stream) { waits.push_back(std::make_pair(event, stream)); }
  static void Destroy(void*) { ++destroyed; }
};
std::vector<std::pair<void*, void*> > FakeFences::records, FakeFences::waits;
int FakeFences::made = 0, FakeFences::destroyed = 0;

// A block given back on one stream and taken on another: the taker's stream waits for the event
// recorded where it was given back (a store's worker encodes on a stream of its own); on the
// same stream nothing waits. A block cached before any second stream existed was used on the
// default stream: a taker elsewhere waits for all of it. Events go with their blocks.
TEST_F(CometPayloadTest, DevicePoolBlocksWaitForTheStreamTheyWereFreedOn) {
  const BlockPool::Fences fences = {FakeFences::Record, FakeFences::Wait, FakeFences::Destroy};
  typedef std::pair<void*, void*> Fence;
  void* const side = reinterpret_cast<void*>(0x51de);  // the worker's stream; NULL: the default
  const size_t mb = 1 << 20;
  BlockPool pool(FakeFree, false, &fences);
  pool.enabled = 1;
  int next = 1;
  void* a = DeviceTake(&pool, 8 * mb, &next);
  pool.Give(a, BlockPool::Key(0, 8 * mb), NULL);  // no second stream yet: nothing recorded
  EXPECT_TRUE(FakeFences::records.empty());
  pool.fenced = 1;
  ASSERT_EQ(pool.Take(BlockPool::Key(0, 8 * mb), side), a);
  void* const e = reinterpret_cast<void*>(1);
  ASSERT_EQ(FakeFences::records.size(), 1u);
  EXPECT_EQ(FakeFences::records[0], Fence(e, NULL));  // all the default stream has queued
  ASSERT_EQ(FakeFences::waits.size(), 1u);
  EXPECT_EQ(FakeFences::waits[0], Fence(e, side));
  pool.Give(a, BlockPool::Key(0, 8 * mb), side);  // the worker's scratch, say
  ASSERT_EQ(FakeFences::records.size(), 2u);
  EXPECT_EQ(FakeFences::records[1], Fence(e, side));  // the block's own event, recorded again
  ASSERT_EQ(pool.Take(BlockPool::Key(0, 8 * mb), side), a);
  EXPECT_EQ(FakeFences::waits.size(), 1u);  // the same stream: queue order is enough
  pool.Give(a, BlockPool::Key(0, 8 * mb), side);
  ASSERT_EQ(pool.Take(BlockPool::Key(0, 8 * mb), NULL), a);  // the step's next layer
  ASSERT_EQ(FakeFences::waits.size(), 2u);
  EXPECT_EQ(FakeFences::waits[1], Fence(e, NULL));
  pool.Give(a, BlockPool::Key(0, 8 * mb), NULL);
  ASSERT_EQ(pool.Take(BlockPool::Key(0, 8 * mb), NULL), a);
  EXPECT_EQ(FakeFences::waits.size(), 2u);
  void* b = DeviceTake(&pool, 4 * mb, &next);  // new: nothing to wait for
  EXPECT_EQ(FakeFences::waits.size(), 2u);
  pool.Give(b, BlockPool::Key(0, 4 * mb), NULL);
  pool.Give(a, BlockPool::Key(0, 8 * mb), NULL);
  EXPECT_EQ(FakeFences::made, 2);  // one event a block, however often it moves
  // Of two blocks that fit, each stream takes the one given back on it, and nothing waits
  // (without the preference the side stream would get a, the first cached, and wait).
  void* c = DeviceTake(&pool, 8 * mb, &next);  // a, from the cache
  void* d = DeviceTake(&pool, 8 * mb, &next);  // new (b is evicted to make room)
  ASSERT_EQ(c, a);
  pool.Give(c, BlockPool::Key(0, 8 * mb), NULL);  // cached first: lower_bound's pick
  pool.Give(d, BlockPool::Key(0, 8 * mb), side);
  const size_t waited = FakeFences::waits.size();
  EXPECT_EQ(pool.Take(BlockPool::Key(0, 8 * mb), side), d);
  EXPECT_EQ(pool.Take(BlockPool::Key(0, 8 * mb), NULL), a);
  EXPECT_EQ(FakeFences::waits.size(), waited);
  pool.Give(a, BlockPool::Key(0, 8 * mb), NULL);
  pool.Give(d, BlockPool::Key(0, 8 * mb), side);
  pool.ReleaseCached();
  EXPECT_EQ(FakeFences::destroyed, FakeFences::made);
  FakeFences::records.clear();
  FakeFences::waits.clear();
}

TEST_F(CometPayloadTest, SizedPoolHeadroomKeepsMoreAboveThePeak) {
  const size_t mb = 1 << 20;
  const BlockPool::Key four(0, 4 * mb), eight(0, 8 * mb);
  size_t evicted[2];
  const double headroom[2] = {0, 1};
  for (int k = 0; k < 2; ++k) {
    BlockPool pool(FakeFree, false);
    pool.enabled = 1;
    pool.headroom = headroom[k];
    EXPECT_TRUE(pool.Take(four) == NULL);
    pool.Track(FakeBlock(1), 4 * mb);
    EXPECT_TRUE(pool.Give(FakeBlock(1), four));  // cached: 4 MB, peak in use 4 MB
    EXPECT_TRUE(pool.Take(eight) == NULL);  // too small to serve it
    pool.Track(FakeBlock(2), 8 * mb);       // 8 in use + 4 cached: over 1x the new peak, under 2x
    evicted[k] = pool.evicted;
    EXPECT_LE(pool.in_use + pool.cached, static_cast<size_t>((1 + headroom[k]) * pool.peak_in_use));
    EXPECT_FALSE(pool.Give(FakeBlock(3), eight));  // not one of its blocks
  }
  EXPECT_EQ(evicted[0], 1u);
  EXPECT_EQ(evicted[1], 0u);
}

// Steps repeat their allocations; the pool keeps the block asked for soonest in the last step.
TEST_F(CometPayloadTest, SizedPoolEvictsTheBlockNeededLast) {
  const size_t mb = 1 << 20;
  const size_t small = 2 * mb, mid = 8 * mb, large = 16 * mb;  // none fits another's request
  BlockPool pool(FakeFree, false);
  pool.enabled = 1;
  size_t hits_in_step[2] = {0, 0};
  int next = 1;
  for (int step = 0; step < 2; ++step) {
    pool.MarkStep();
    const size_t h0 = pool.hits;
    void* p = DeviceTake(&pool, large, &next);  // step 2: a miss that must evict small or mid
    void* q = DeviceTake(&pool, small, &next);  // asked for next: the small block must have stayed
    pool.Give(p, BlockPool::Key(0, large));
    void* r = DeviceTake(&pool, mid, &next);
    pool.Give(q, BlockPool::Key(0, small));
    pool.Give(r, BlockPool::Key(0, mid));
    hits_in_step[step] = pool.hits - h0;
    EXPECT_LE(pool.in_use + pool.cached, pool.peak_in_use);
  }
  EXPECT_EQ(hits_in_step[0], 0u);
  EXPECT_GE(hits_in_step[1], 1u);  // oldest-first eviction would have dropped the small block
}

// Lossy streams differ in size every step. A step here: three streams of jittering size (+-6%)
// kept from forward to backward, and an encoder scratch of fixed size taken and given back
// around each. By exact size every stream would miss, and its freed block would be evicted.
TEST_F(CometPayloadTest, SizedPoolReusesBlocksWhoseSizesJitter) {
  const size_t mb = 1 << 20;
  const size_t streams[3] = {700 * 1024, 5 * mb + mb / 3, 23 * mb}, scratch = 40 * mb;
  BlockPool pool(FakeFree, false);
  pool.enabled = 1;
  int next = 1;
  uint32_t lcg = 12345;
  size_t asked = 0, missed = 0, evicted = 0;
  for (int step = 0; step < 40; ++step) {
    pool.MarkStep();
    const size_t misses0 = pool.misses, evicted0 = pool.evicted;
    void* held[3];
    size_t sizes[3];
    for (int s = 0; s < 3; ++s) {
      void* tmp = DeviceTake(&pool, scratch, &next);
      lcg = lcg * 1664525u + 1013904223u;
      const double jitter = 0.94 + 0.12 * (lcg >> 8) / double(1 << 24);
      sizes[s] = static_cast<size_t>(streams[s] * jitter);
      held[s] = DeviceTake(&pool, sizes[s], &next);
      pool.Give(tmp, BlockPool::Key(0, scratch));
    }
    for (int s = 2; s >= 0; --s) {
      void* tmp = DeviceTake(&pool, scratch, &next);  // the decode's scratch
      pool.Give(tmp, BlockPool::Key(0, scratch));
      pool.Give(held[s], BlockPool::Key(0, sizes[s]));
    }
    EXPECT_EQ(pool.in_use, 0u);
    EXPECT_LE(pool.cached, pool.peak_in_use);
    if (step >= 10) {  // after the first steps: which sizes the steps bring is known
      asked += 9;
      missed += pool.misses - misses0;
      evicted += pool.evicted - evicted0;
    }
  }
  EXPECT_LE(missed, asked / 20) << "of " << asked << " requests";
  EXPECT_LE(evicted, asked / 20);
  EXPECT_LE(pool.peak_held, pool.peak_in_use);  // misses made room first
  // What the rounding and the slack cost: the streams and one scratch, at most 30% more.
  const size_t dense = scratch + static_cast<size_t>(1.06 * (streams[0] + streams[1] + streams[2]));
  EXPECT_LE(pool.peak_in_use, dense + dense * 3 / 10);
}

// ---------------------------------------------------------------- the store in a training run

class CometStoreTest : public ::testing::Test {
 protected:
  virtual void SetUp() { Caffe::set_mode(Caffe::CPU); }

  static std::string Net() {
    return
        "name: 'cometnet' "
        "layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
        "  dummy_data_param { shape { dim: 8 dim: 3 dim: 16 dim: 16 } shape { dim: 8 } "
        "    data_filler { type: 'gaussian' std: 1 } data_filler { type: 'constant' value: 1 } } } "
        "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' "
        "  convolution_param { num_output: 8 kernel_size: 3 pad: 1 "
        "    weight_filler { type: 'gaussian' std: 0.1 } bias_filler { type: 'constant' value: 0.1 } } } "
        "layer { name: 'relu1' type: 'ReLU' bottom: 'conv1' top: 'conv1' } "
        "layer { name: 'pool1' type: 'Pooling' bottom: 'conv1' top: 'pool1' "
        "  pooling_param { pool: MAX kernel_size: 2 stride: 2 } } "
        "layer { name: 'conv2' type: 'Convolution' bottom: 'pool1' top: 'conv2' "
        "  convolution_param { num_output: 8 kernel_size: 3 pad: 1 "
        "    weight_filler { type: 'gaussian' std: 0.1 } bias_filler { type: 'constant' value: 0.1 } } } "
        "layer { name: 'relu2' type: 'ReLU' bottom: 'conv2' top: 'conv2' } "
        "layer { name: 'ip1' type: 'InnerProduct' bottom: 'conv2' top: 'ip1' "
        "  inner_product_param { num_output: 4 weight_filler { type: 'gaussian' std: 0.05 } } } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip1' bottom: 'label' top: 'loss' } ";
  }

  shared_ptr<Solver<float> > MakeSolver(const std::string& comet) {
    return SolverFor(Net(), comet, "0.01");
  }

  // An SGD solver of `net` (text) with base_lr `lr` and the `comet` block (text, or "").
  shared_ptr<Solver<float> > SolverFor(const std::string& net, const std::string& comet,
                                       const char* lr = "0.05", const char* seed = "1701") {
    SolverParameter sp;
    const std::string text =
        std::string("base_lr: ") + lr + " momentum: 0.9 lr_policy: 'fixed' max_iter: 100 "
        "display: 1 random_seed: " + seed + " snapshot_prefix: '" + prefix_ + "' " + comet;
    CHECK(google::protobuf::TextFormat::ParseFromString(text, &sp));
    CHECK(google::protobuf::TextFormat::ParseFromString(net, sp.mutable_net_param()));
    return shared_ptr<Solver<float> >(SolverRegistry<float>::CreateSolver(sp));
  }

  static std::vector<float> Params(Solver<float>* s) {
    std::vector<float> out;
    const std::vector<Blob<float>*>& ps = s->net()->learnable_params();
    for (int i = 0; i < ps.size(); ++i)
      out.insert(out.end(), ps[i]->cpu_data(), ps[i]->cpu_data() + ps[i]->count());
    return out;
  }

  // Runs n iterations from a fixed random state, so two solvers see the same DummyData.
  static void Run(Solver<float>* s, int n) {
    Caffe::set_random_seed(4242);
    s->Step(n);
  }

  // The small net of the activation tests: DummyData (8 x 3 x 16 x 16, every label 1), conv1 (16
  // outputs, 3x3), `first` (a layer reading conv1 and writing x), conv2 (reading x), `second` (a
  // layer reading conv2 and writing y), 4x4 average pooling of y into 'pool', `after_pool`,
  // InnerProduct to 4 and SoftmaxWithLoss.
  static std::string ActivationNet(const std::string& name, const std::string& first,
                                   const std::string& x, const std::string& second,
                                   const std::string& y, const std::string& after_pool = "") {
    return
        "name: '" + name + "' layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
        "dummy_data_param { shape { dim: 8 dim: 3 dim: 16 dim: 16 } shape { dim: 8 } "
        "data_filler { type: 'gaussian' std: 1 } data_filler { type: 'constant' value: 1 } } } "
        "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' convolution_param { "
        "num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: 'gaussian' std: 0.3 } } } " +
        first +
        "layer { name: 'conv2' type: 'Convolution' bottom: '" + x + "' top: 'conv2' "
        "convolution_param { num_output: 16 kernel_size: 3 pad: 1 "
        "weight_filler { type: 'gaussian' std: 0.3 } } } " +
        second +
        "layer { name: 'pool' type: 'Pooling' bottom: '" + y + "' top: 'pool' pooling_param { "
        "pool: AVE kernel_size: 4 stride: 4 } } " +
        after_pool +
        "layer { name: 'ip' type: 'InnerProduct' bottom: 'pool' top: 'ip' inner_product_param { "
        "num_output: 4 weight_filler { type: 'gaussian' std: 0.1 } } } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  }

  // `net` trained 3 steps with COMET off (*off) and with the store lossless (*exact, compress_type
  // 'None'): every weight the same, bit for bit.
  void TrainLosslessAndOff(const std::string& net, shared_ptr<Solver<float> >* exact,
                           shared_ptr<Solver<float> >* off) {
    *off = SolverFor(net, "", "0.01");
    *exact = SolverFor(net, "comet { compress_type: 'None' }", "0.01");
    Run(off->get(), 3);
    Run(exact->get(), 3);
    const std::vector<float> a = Params(off->get()), b = Params(exact->get());
    ASSERT_EQ(a.size(), b.size());
    for (int i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "param " << i;
  }

  // conv1's weight gradient error against COMET off's, a step after two of `net` (base_lr `lr`)
  // with only BatchNorm's x_norm_ lossy (`comet`: the block's fields), without ([0]) and with
  // ([1]) BatchNorm's corrections (centre_batchnorm_gradients).
  void CorrectedBatchNormErrors(const std::string& net, const std::string& comet, const char* lr,
                                double errors[2]) {
    shared_ptr<Solver<float> > off = SolverFor(net, "", lr);
    for (int corrected = 0; corrected < 2; ++corrected) {
      shared_ptr<Solver<float> > on = SolverFor(
          net, "comet { compress_type: 'BatchNorm' " + comet +
                   (corrected ? " }" : " centre_batchnorm_gradients: false }"), lr);
      Run(on.get(), 2);
      StepBothFromTheSameWeights(on.get(), off.get());
      EXPECT_GT(on->comet()->bound("bn1"), 0) << "x_norm_ is stored lossy";
      errors[corrected] = WeightGradientError(on.get(), off.get(), "conv1");
      ASSERT_GE(errors[corrected], 0);
    }
    LOG(INFO) << "conv1's weight gradient against COMET off: " << errors[0]
              << " from BatchNorm's own backward, " << errors[1] << " corrected";
  }

  // One more step's gradients of `on` and `off` from on's weights and the same batch.
  static void StepBothFromTheSameWeights(Solver<float>* on, Solver<float>* off) {
    const std::vector<Blob<float>*>& pa = on->net()->learnable_params();
    const std::vector<Blob<float>*>& pb = off->net()->learnable_params();
    for (int i = 0; i < pa.size(); ++i)
      caffe_copy(pa[i]->count(), pa[i]->cpu_data(), pb[i]->mutable_cpu_data());
    for (int k = 0; k < 2; ++k) {
      caffe::Net<float>* n = (k ? off : on)->net().get();
      n->ClearParamDiffs();
      Caffe::set_random_seed(7);
      n->Forward();
      n->Backward();
    }
  }

  // ||dW_on - dW_off|| of a layer's first blob.
  static double WeightGradientDistance(Solver<float>* on, Solver<float>* off, const char* layer) {
    const Blob<float>* a = on->net()->layer_by_name(layer)->blobs()[0].get();
    const Blob<float>* b = off->net()->layer_by_name(layer)->blobs()[0].get();
    double d = 0;
    for (int j = 0; j < a->count(); ++j)
      d += (a->cpu_diff()[j] - b->cpu_diff()[j]) * (a->cpu_diff()[j] - b->cpu_diff()[j]);
    return std::sqrt(d);
  }
  // ... over ||dW_off|| (-1 when off's gradient is zero).
  static double WeightGradientError(Solver<float>* on, Solver<float>* off, const char* layer) {
    const double r = off->net()->layer_by_name(layer)->blobs()[0]->sumsq_diff();
    return r > 0 ? WeightGradientDistance(on, off, layer) / std::sqrt(r) : -1;
  }

  // After `on`'s steps, both step once from its weights: `layer`'s bound must have come below
  // max_eb for the weights below it, and conv1's weight gradient within 7.5% of COMET off's.
  static void ExpectBoundLoweredForConv1(Solver<float>* on, Solver<float>* off, const char* layer,
                                         float max_eb) {
    StepBothFromTheSameWeights(on, off);
    const float eb = on->comet()->bound(layer);
    const double error = WeightGradientError(on, off, "conv1");
    LOG(INFO) << layer << "'s bound " << eb << ", conv1's weight gradient " << error << " off";
    ASSERT_GE(error, 0);
    EXPECT_LT(eb, max_eb) << layer << "'s bound, lowered for conv1";
    EXPECT_LT(error, 0.075) << "conv1's weight gradient, against a 5% target";
  }


  // NaN, Inf and huge values through every pooling method, and training into NaN (defined below).
  void CheckNaNThroughPooling();
  // Sigmoid, TanH and ELU outputs stored under the derivative rule (defined below).
  void CheckOutputDerivatives();
  // Exp and Softmax outputs, the same way (defined below).
  void CheckExpAndSoftmax();
  void CheckAdaptiveBounds(const std::string& net, const std::vector<std::string>& layers,
                           double saved);
  // PReLU's inputs lossy with their signs exact (defined below).
  void CheckPReLU();
  // BatchNorm's input gradient centred per channel after a lossy x_norm_ (defined below).
  void CheckCentredBatchNormGradients();
  // BatchNorm's lossy x_norm_ moved back to its exact moments (defined below).
  void CheckBatchNormMoments();
  // A BatchNorm's bound lowered for the weights below it (defined below).
  void CheckBatchNormWeightsBelow(bool reshaped);
  // ... for a Scale's or PReLU's weights between two BatchNorms (defined below).
  void CheckChannelWeightsBetweenBatchNorms(const std::string& type);
  // A derivative rule's bound lowered for the weights below it, found through a Concat or not.
  void CheckDerivativeWeightsBelow(bool concat);
  // BatchNorm after a ReLU: x_norm_ moved back at many values a channel (defined below).
  void CheckBatchNormAfterRelu(bool reshaped);
  // BatchNorm's x_norm_ stored less its ReLU zeros' value (defined below).
  void CheckBatchNormTiesShifted();
  // A fixed bound's estimate, warned of where far off (defined below).
  void CheckFixedBoundEstimate();
  // LRN within a channel: input lossy, internal buffers recomputed (defined below).
  void CheckLrnWithinChannel();
  // Swish: its input lossy, its sigmoid's buffers freed after the forward (defined below).
  void CheckSwish();
  // Frozen weights between learning layers: their inputs are not stored (defined below).
  void CheckFrozenMiddleLayers();
  // MVN's temp_ freed between its passes, not rebuilt (defined below).
  void CheckMVNTemp();
  // SENet's channel attention: a Scale by a second bottom stores its first lossy (defined below).
  void CheckSqueezeExcitation();
  // Convolutions share one column buffer (defined below).
  void CheckConvColumns();

  // conv, ReLU, max pooling with overlapping windows, LRN across channels, Dropout: a net with
  // every kind of layer-private buffer the store keeps (Caffe's engines, named).
  static std::string BuffersNet() {
    return
        "name: 'buffers' "
        "layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
        "  dummy_data_param { shape { dim: 4 dim: 3 dim: 15 dim: 15 } shape { dim: 4 } "
        "    data_filler { type: 'gaussian' std: 1 } data_filler { type: 'constant' value: 2 } } } "
        "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' "
        "  convolution_param { num_output: 6 kernel_size: 3 engine: CAFFE "
        "    weight_filler { type: 'gaussian' std: 0.2 } bias_filler { type: 'constant' value: 0.1 } } } "
        "layer { name: 'relu1' type: 'ReLU' bottom: 'conv1' top: 'conv1' relu_param { engine: CAFFE } } "
        "layer { name: 'pool1' type: 'Pooling' bottom: 'conv1' top: 'pool1' "
        "  pooling_param { pool: MAX kernel_size: 3 stride: 2 engine: CAFFE } } "
        "layer { name: 'norm1' type: 'LRN' bottom: 'pool1' top: 'norm1' "
        "  lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 engine: CAFFE } } "
        "layer { name: 'ip1' type: 'InnerProduct' bottom: 'norm1' top: 'ip1' "
        "  inner_product_param { num_output: 64 weight_filler { type: 'gaussian' std: 0.1 } } } "
        "layer { name: 'drop1' type: 'Dropout' bottom: 'ip1' top: 'ip1' "
        "  dropout_param { dropout_ratio: 0.5 } } "
        "layer { name: 'ip2' type: 'InnerProduct' bottom: 'ip1' top: 'ip2' "
        "  inner_product_param { num_output: 3 weight_filler { type: 'gaussian' std: 0.1 } } } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip2' bottom: 'label' top: 'loss' } ";
  }

  // Max pooling with overlapping windows, LRN across channels and Dropout: their private buffers are
  // stored as codes (argmax, Dropout mask) or freed and recomputed (LRN scale), all exactly. Caffe's
  // engines, named: a cuDNN build would otherwise make cuDNN's LRN, pooling and ReLU, which keep no
  // such buffers (the first GPU run found "norm1 scale" missing in the cuDNN build).
  void CheckLayerBuffers() {
    const std::string net = BuffersNet();
    shared_ptr<Solver<float> > solvers[2];
    const char* comet[] = {"", "comet { compress_type: 'None' recompute_lrn: true }"};
    for (int k = 0; k < 2; ++k) {
      solvers[k] = SolverFor(net, comet[k]);
      Run(solvers[k].get(), 6);
    }
    const std::vector<float> a = Params(solvers[0].get()), b = Params(solvers[1].get());
    ASSERT_EQ(a.size(), b.size());
    for (int i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "param value " << i;

    CometStore<float>* store = solvers[1]->comet();
    std::map<std::string, const CometStore<float>::Entry*> by_blob;
    for (int e = 0; e < store->entries().size(); ++e)
      by_blob[store->entries()[e].blob] = &store->entries()[e];
    ASSERT_TRUE(by_blob.count("pool1 argmax"));
    ASSERT_TRUE(by_blob.count("drop1 mask"));
    ASSERT_TRUE(by_blob.count("norm1 scale"));
    EXPECT_EQ(by_blob["pool1 argmax"]->action, CometStore<float>::ARGMAX);
    EXPECT_EQ(by_blob["drop1 mask"]->action, CometStore<float>::BINARY);
    EXPECT_EQ(by_blob["norm1 scale"]->action, CometStore<float>::RECOMPUTE);
    EXPECT_NEAR(by_blob["pool1 argmax"]->last_ratio, 8.0, 0.5);  // 4-bit codes
    EXPECT_NEAR(by_blob["drop1 mask"]->last_ratio, 32.0, 0.5);  // 1 bit per value
    // between forward and backward the buffers are not dense
    caffe::Net<float>* n = solvers[1]->net().get();
    n->Forward();
    Layer<float>* pool1 = n->layer_by_name("pool1").get();
    Layer<float>* norm1 = n->layer_by_name("norm1").get();
    EXPECT_TRUE(CometLayerAccess<float>::argmax(pool1)->data()->comet_payload().get() != NULL);
    EXPECT_EQ(CometLayerAccess<float>::lrn_scale(norm1)->data()->head(),
              SyncedMemory::UNINITIALIZED);
    EXPECT_TRUE(n->blob_by_name("conv1")->data()->comet_payload().get() != NULL);
    n->Backward();
    // relu1's gradient came from the mask: its input was never restored
    EXPECT_TRUE(n->blob_by_name("conv1")->data()->comet_payload().get() != NULL);
    EXPECT_EQ(CometLayerAccess<float>::lrn_scale(norm1)->data()->head(),
              SyncedMemory::UNINITIALIZED);

    // By default LRN's scale lives from LRN's forward to its backward, and a second backward
    // without a forward recomputes it rather than reading a freed buffer.
    SolverParameter sp = solvers[1]->param();
    sp.mutable_comet()->set_recompute_lrn(false);
    shared_ptr<Solver<float> > keep(SolverRegistry<float>::CreateSolver(sp));
    caffe::Net<float>* k = keep->net().get();
    Caffe::set_random_seed(4242);
    k->ClearParamDiffs();
    k->Forward();
    Layer<float>* knorm = k->layer_by_name("norm1").get();
    EXPECT_NE(CometLayerAccess<float>::lrn_scale(knorm)->data()->head(), SyncedMemory::UNINITIALIZED);
    k->Backward();
    EXPECT_EQ(CometLayerAccess<float>::lrn_scale(knorm)->data()->head(), SyncedMemory::UNINITIALIZED);
    Blob<float>* w = k->layer_by_name("conv1")->blobs()[0].get();
    std::vector<float> first(w->cpu_diff(), w->cpu_diff() + w->count());
    k->ClearParamDiffs();
    k->Backward();
    EXPECT_EQ(MaxAbsDiff(first.data(), w->cpu_diff(), w->count()), 0.f);
  }

  // Fine-tuning with the lower layers frozen (lr_mult 0, the input needs no gradient): those
  // layers run no backward, and their private buffers (BatchNorm's temp_ and x_norm_, an
  // in-place Scale's copy, max pooling's argmax, LRN's scale, Dropout's mask) are read by their
  // forward only. The store frees each after its layer's forward (release_unused), where it used
  // to keep them dense through the step; training is bit for bit that of COMET off, a read of
  // one fails loudly, and release_unused: false keeps them.
  void CheckFrozenLayersBuffers() {
    const std::string frozen2 = " param { lr_mult: 0 } param { lr_mult: 0 } ";
    const std::string net =
        "name: 'frozen' "
        "layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
        "  dummy_data_param { shape { dim: 4 dim: 3 dim: 15 dim: 15 } shape { dim: 4 } "
        "    data_filler { type: 'gaussian' std: 1 } data_filler { type: 'constant' value: 2 } } } "
        "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' " + frozen2 +
        "  convolution_param { num_output: 6 kernel_size: 3 engine: CAFFE "
        "    weight_filler { type: 'gaussian' std: 0.2 } bias_filler { type: 'constant' value: 0.1 } } } "
        "layer { name: 'bn1' type: 'BatchNorm' bottom: 'conv1' top: 'conv1' "
        "  param { lr_mult: 0 } param { lr_mult: 0 } param { lr_mult: 0 } } "
        "layer { name: 'sc1' type: 'Scale' bottom: 'conv1' top: 'conv1' " + frozen2 +
        "  scale_param { bias_term: true filler { type: 'constant' value: 1.5 } } } "
        "layer { name: 'relu1' type: 'ReLU' bottom: 'conv1' top: 'conv1' relu_param { engine: CAFFE } } "
        "layer { name: 'pool1' type: 'Pooling' bottom: 'conv1' top: 'pool1' "
        "  pooling_param { pool: MAX kernel_size: 3 stride: 2 engine: CAFFE } } "
        "layer { name: 'norm1' type: 'LRN' bottom: 'pool1' top: 'norm1' "
        "  lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 engine: CAFFE } } "
        "layer { name: 'drop1' type: 'Dropout' bottom: 'norm1' top: 'norm1' "
        "  dropout_param { dropout_ratio: 0.5 } } "
        "layer { name: 'ip1' type: 'InnerProduct' bottom: 'norm1' top: 'ip1' "
        "  inner_product_param { num_output: 16 weight_filler { type: 'gaussian' std: 0.1 } } } "
        "layer { name: 'relu2' type: 'ReLU' bottom: 'ip1' top: 'ip1' relu_param { engine: CAFFE } } "
        "layer { name: 'ip2' type: 'InnerProduct' bottom: 'ip1' top: 'ip2' "
        "  inner_product_param { num_output: 3 weight_filler { type: 'gaussian' std: 0.1 } } } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip2' bottom: 'label' top: 'loss' } ";
    const char* comet[] = {"", "comet { compress_type: 'None' }",
                           "comet { compress_type: 'None' release_unused: false }"};
    shared_ptr<Solver<float> > solvers[3];
    for (int k = 0; k < 3; ++k) {
      solvers[k] = SolverFor(net, comet[k]);
      Run(solvers[k].get(), 5);
    }
    const std::vector<float> off = Params(solvers[0].get());
    for (int k = 1; k < 3; ++k) {
      const std::vector<float> on = Params(solvers[k].get());
      ASSERT_EQ(off.size(), on.size());
      for (int i = 0; i < off.size(); ++i) ASSERT_EQ(off[i], on[i]) << comet[k] << ", param value " << i;
    }
    typedef CometLayerAccess<float> Access;
    const char* buffers[] = {"bn1 temp", "bn1 x_norm", "sc1 copy", "pool1 argmax", "norm1 scale",
                             "drop1 mask"};
    const CometActions::Action named_by[] = {CometActions::REBUILD, CometActions::KEEP,
                                             CometActions::REBUILD, CometActions::ARGMAX,
                                             CometActions::RECOMPUTE, CometActions::BINARY};
    const auto memory_of = [](int b, Layer<float>* l) -> SyncedMemory* {
      switch (b) {
        case 1: return Access::bn_x_norm(l)->data().get();
        case 3: return Access::argmax(l)->data().get();
        case 4: return Access::lrn_scale(l)->data().get();
        case 5: return Access::dropout_mask(l)->data().get();
        default: return Access::rebuildable(l)->data().get();
      }
    };
    for (int k = 1; k < 3; ++k) {
      const bool release = k == 1;
      CometStore<float>* store = solvers[k]->comet();
      caffe::Net<float>* n = solvers[k]->net().get();
      for (int i = 0; i < n->layers().size(); ++i)
        if (n->layer_names()[i] == "drop1") {
          ASSERT_FALSE(n->layer_need_backward()[i]);
        }
      std::map<std::string, const CometStore<float>::Entry*> by_blob;
      for (int e = 0; e < store->entries().size(); ++e)
        by_blob[store->entries()[e].blob] = &store->entries()[e];
      n->Forward();
      for (int b = 0; b < 6; ++b) {
        const std::string layer = std::string(buffers[b]).substr(0, std::string(buffers[b]).find(' '));
        Layer<float>* l = n->layer_by_name(layer).get();
        const CometStore<float>::Entry* e = by_blob.count(buffers[b]) ? by_blob[buffers[b]] : NULL;
        if (!release) {
          EXPECT_FALSE(e) << buffers[b] << " is planned with release_unused: false";
          EXPECT_NE(memory_of(b, l)->head(), SyncedMemory::UNINITIALIZED) << buffers[b];
          continue;
        }
        ASSERT_TRUE(e) << buffers[b] << " is not in the plan";
        EXPECT_EQ(e->action, CometStore<float>::RELEASE) << buffers[b];
        EXPECT_EQ(e->last_backward, -1) << buffers[b];
        EXPECT_EQ(e->buffer, named_by[b]) << buffers[b];
        SyncedMemory* mem = memory_of(b, l);
        EXPECT_EQ(mem->head(), SyncedMemory::UNINITIALIZED) << buffers[b] << " is still dense";
        const std::string what = FatalMessageOf([&]() { mem->cpu_data(); });
        EXPECT_NE(what.find(buffers[b]), std::string::npos) << what;
        EXPECT_NE(what.find("freed after its last use"), std::string::npos) << what;
      }
      n->Backward();  // the frozen layers run none: nothing reads the freed buffers
      Run(solvers[k].get(), 1);  // and the next forward writes them afresh
    }
  }

  // Fine-tuning with BatchNorm's statistics frozen (use_global_stats: true): BatchNorm's backward
  // divides by the deviation (temp_, rebuilt) and reads no x_norm_. bn1's x_norm_ is still the
  // source of in-place sc1's copy: stored lossy at sc1's bound; bn2's, with no Scale after it, is
  // read by nobody: freed after bn2's forward. Until 2026-12-06 both were kept dense all step.
  // With nothing lossy training is bit for bit COMET off's; lossy, sc1's gradients stay close.
  void CheckGlobalStatistics() {
    const std::string conv = " weight_filler { type: 'gaussian' std: 0.3 } bias_term: false } } ";
    const std::string global = " batch_norm_param { use_global_stats: true } } ";
    const std::string net =
        "name: 'global' "
        "layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
        "  dummy_data_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 } "
        "    data_filler { type: 'gaussian' std: 1 } data_filler { type: 'uniform' min: 0 max: 3 } } } "
        "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' "
        "  convolution_param { num_output: 6 kernel_size: 3 pad: 1" + conv +
        "layer { name: 'bn1' type: 'BatchNorm' bottom: 'conv1' top: 'conv1'" + global +
        "layer { name: 'sc1' type: 'Scale' bottom: 'conv1' top: 'conv1' scale_param { bias_term: true "
        "  filler { type: 'uniform' min: 0.5 max: 2 } bias_filler { type: 'uniform' min: -1 max: 1 } } } "
        "layer { name: 'relu1' type: 'ReLU' bottom: 'conv1' top: 'conv1' } "
        "layer { name: 'conv2' type: 'Convolution' bottom: 'conv1' top: 'conv2' "
        "  convolution_param { num_output: 5 kernel_size: 3 pad: 1" + conv +
        "layer { name: 'bn2' type: 'BatchNorm' bottom: 'conv2' top: 'conv2'" + global +
        "layer { name: 'ip' type: 'InnerProduct' bottom: 'conv2' top: 'ip' "
        "  inner_product_param { num_output: 3 weight_filler { type: 'gaussian' std: 0.3 } } } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
    const char* comet[] = {"", "comet { compress_type: 'None' }",
                           "comet { eb_mode: FIXED error_bound: 1e-3 }"};
    shared_ptr<Solver<float> > solvers[3];
    for (int k = 0; k < 3; ++k) {
      solvers[k] = SolverFor(net, comet[k], "0.01");
      // statistics as a trained net has them (0 mean, unit variance, factor 1)
      for (int b = 1; b <= 2; ++b) {
        Layer<float>* bn = solvers[k]->net()->layer_by_name(b == 1 ? "bn1" : "bn2").get();
        caffe_set(bn->blobs()[0]->count(), 0.f, bn->blobs()[0]->mutable_cpu_data());
        caffe_set(bn->blobs()[1]->count(), 1.f, bn->blobs()[1]->mutable_cpu_data());
        caffe_set(bn->blobs()[2]->count(), 1.f, bn->blobs()[2]->mutable_cpu_data());
      }
      Run(solvers[k].get(), 4);
    }
    const std::string plan = solvers[2]->comet()->Plan();
    EXPECT_NE(plan.find("bn1 x_norm -> lossy after bn1 forward, for bn1+sc1 backward"),
              std::string::npos) << plan;
    EXPECT_NE(plan.find("bn2 x_norm -> release after bn2 forward"), std::string::npos) << plan;
    EXPECT_NE(solvers[1]->comet()->Plan().find("bn1 x_norm -> kept dense"), std::string::npos)
        << "nothing lossy: sc1's source stays";
    const std::vector<float> off = Params(solvers[0].get()), exact = Params(solvers[1].get()),
                             lossy = Params(solvers[2].get());
    ASSERT_EQ(off.size(), exact.size());
    for (int i = 0; i < off.size(); ++i) ASSERT_EQ(off[i], exact[i]) << "param value " << i;
    double num = 0, den = 0;
    for (int i = 0; i < off.size(); ++i) {
      num += std::pow(off[i] - lossy[i], 2);
      den += std::pow(off[i], 2);
    }
    EXPECT_GT(num, 0) << "lossy: not a copy";
    EXPECT_LT(std::sqrt(num / den), 1e-3) << "4 steps at a bound of 1e-3";
    // between forward and backward: bn2's x_norm_ freed, bn1's held compressed
    caffe::Net<float>* n = solvers[2]->net().get();
    n->Forward();
    Layer<float>* bn1 = n->layer_by_name("bn1").get();
    Layer<float>* bn2 = n->layer_by_name("bn2").get();
    EXPECT_EQ(CometLayerAccess<float>::bn_x_norm(bn2)->data()->head(), SyncedMemory::UNINITIALIZED);
    const shared_ptr<CometPayload> held = CometLayerAccess<float>::bn_x_norm(bn1)->data()->comet_payload();
    ASSERT_TRUE(held.get() != NULL);
    EXPECT_EQ(held->kind(), CometPayload::LOSSY);
    n->Backward();
  }

  // comet { pool_codes }: max pooling's forward writes its argmax as codes and its backward reads
  // them, the int32 argmax never dense. Training is bit for bit that of COMET off and of the store
  // packing the layer's own argmax (pool_codes: false); the tracked peak, which this net reaches
  // at pool1 (its forward, and its backward with the argmax unpacked), is lower by the dense
  // argmax less its codes.
  void CheckPoolCodes() {
    const std::string net =
        "name: 'poolpeak' "
        "layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
        "  dummy_data_param { shape { dim: 8 dim: 4 dim: 32 dim: 32 } shape { dim: 8 } "
        "    data_filler { type: 'gaussian' std: 1 } "
        "    data_filler { type: 'uniform' min: 0 max: 2.99 } } } "
        "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' "
        "  convolution_param { num_output: 4 kernel_size: 1 engine: CAFFE "
        "    weight_filler { type: 'gaussian' std: 0.3 } bias_filler { type: 'constant' value: 0.1 } } } "
        "layer { name: 'pool1' type: 'Pooling' bottom: 'conv1' top: 'pool1' "
        "  pooling_param { pool: MAX kernel_size: 3 stride: 2 engine: CAFFE } } "
        "layer { name: 'ip1' type: 'InnerProduct' bottom: 'pool1' top: 'ip1' "
        "  inner_product_param { num_output: 3 weight_filler { type: 'gaussian' std: 0.05 } } } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip1' bottom: 'label' top: 'loss' } ";
    const char* comet[] = {"", "comet { compress_type: 'None' }",
                           "comet { compress_type: 'None' pool_codes: false }"};
    shared_ptr<Solver<float> > solvers[3];
    for (int k = 0; k < 3; ++k) {
      solvers[k] = SolverFor(net, comet[k], "0.001");  // labels at random: gradients stay
      Run(solvers[k].get(), 4);
    }
    const std::vector<float> off = Params(solvers[0].get());
    for (int k = 1; k < 3; ++k) {
      const std::vector<float> on = Params(solvers[k].get());
      ASSERT_EQ(off.size(), on.size());
      for (int i = 0; i < off.size(); ++i) ASSERT_EQ(off[i], on[i]) << comet[k] << " param " << i;
    }
    const CometStore<float>* codes = solvers[1]->comet();
    const CometStore<float>* packed = solvers[2]->comet();
    EXPECT_TRUE(codes->param().pool_codes());  // the default
    const CometStore<float>::Entry* argmax = NULL;
    for (int e = 0; e < codes->entries().size(); ++e)
      if (codes->entries()[e].blob == "pool1 argmax") argmax = &codes->entries()[e];
    ASSERT_TRUE(argmax != NULL);
    EXPECT_EQ(argmax->action, CometStore<float>::ARGMAX);
    EXPECT_NEAR(argmax->last_ratio, 8.0, 0.5);  // 4-bit codes, as when packed after
    const size_t dense = solvers[1]->net()->blob_by_name("pool1")->count() * sizeof(int);
    EXPECT_GE(packed->memory().peak_total, codes->memory().peak_total + dense - dense / 8)
        << "peak " << packed->memory().peak_total << " packing the layer's argmax against "
        << codes->memory().peak_total << " with codes from the start";
    // Between forward and backward: codes only; a backward leaves them as they were (a second
    // Backward() outside a step reads them again) and writes the same gradients.
    caffe::Net<float>* n = solvers[1]->net().get();
    Caffe::set_random_seed(77);
    n->ClearParamDiffs();
    n->Forward();
    SyncedMemory* mem = CometLayerAccess<float>::argmax(n->layer_by_name("pool1").get())->data().get();
    ASSERT_TRUE(mem->comet_payload().get() != NULL);
    EXPECT_EQ(mem->comet_payload()->kind(), CometPayload::ARGMAX);
    EXPECT_EQ(mem->head(), SyncedMemory::UNINITIALIZED);
    const CometPayload* held = mem->comet_payload().get();
    n->Backward();
    EXPECT_EQ(mem->comet_payload().get(), held);
    EXPECT_EQ(mem->head(), SyncedMemory::UNINITIALIZED);
    Blob<float>* w = n->layer_by_name("conv1")->blobs()[0].get();
    const std::vector<float> first(w->cpu_diff(), w->cpu_diff() + w->count());
    float largest = 0.f;
    for (int i = 0; i < first.size(); ++i) largest = std::max(largest, std::fabs(first[i]));
    EXPECT_GT(largest, 0.f);
    n->ClearParamDiffs();
    n->Backward();
    EXPECT_EQ(MaxAbsDiff(first.data(), w->cpu_diff(), w->count()), 0.f);
    // Read as an int32 buffer (its own backward's way), the codes restore the argmax that COMET
    // off finds in the same forward.
    const int* restored = static_cast<const int*>(mem->cpu_data());
    EXPECT_TRUE(mem->comet_payload().get() == NULL);
    caffe::Net<float>* o = solvers[0]->net().get();
    Caffe::set_random_seed(77);
    o->Forward();
    const Blob<int>* want = CometLayerAccess<float>::argmax(o->layer_by_name("pool1").get());
    ASSERT_EQ(static_cast<size_t>(want->count()) * sizeof(int), mem->size());
    for (int i = 0; i < want->count(); ++i) ASSERT_EQ(restored[i], want->cpu_data()[i]) << i;
  }

  // pycaffe's `net = solver.net; del solver` keeps the train net after its solver and store are
  // gone: it must run on as plain Caffe (it crashed in the store's freed hooks), with the values
  // the store did not keep still refused until a forward writes them again.
  void CheckTheNetOutlivesItsSolver() {
    const std::string net = BuffersNet();
    const size_t before = CometNetCallbacks<float>::NetsHolding();
    // A net that goes with its solver leaves nothing behind.
    SolverFor(net, "comet { eb_mode: FIXED error_bound: 1e-3 }")->Step(1);
    EXPECT_EQ(CometNetCallbacks<float>::NetsHolding(), before);

    // keep_compressed: what the store held after the step is still on the net
    shared_ptr<Solver<float> > solver =
        SolverFor(net, "comet { eb_mode: FIXED error_bound: 1e-3 keep_compressed: true }");
    Run(solver.get(), 2);
    shared_ptr<caffe::Net<float> > kept = solver->net();
    solver.reset();
    EXPECT_EQ(CometNetCallbacks<float>::NetsHolding(), before + 1);

    // Before a forward: conv1 is still held as relu1's signs, and LRN's scale, freed after its
    // backward for the store to compute again, is refused rather than read as zeros.
    std::string what = FatalMessageOf([&]() { kept->blob_by_name("conv1")->cpu_data(); });
    EXPECT_NE(what.find("blob 'conv1' is held only as the signs of its values"), std::string::npos)
        << what;
    what = FatalMessageOf([&]() {
      CometLayerAccess<float>::lrn_scale(kept->layer_by_name("norm1").get())->cpu_data();
    });
    EXPECT_NE(what.find("buffer 'norm1 scale' was freed"), std::string::npos) << what;
    EXPECT_NE(what.find("its solver is gone"), std::string::npos) << what;

    // The same net made anew, with the trained weights: both are plain Caffe now, bit for bit.
    NetParameter np;
    CHECK(google::protobuf::TextFormat::ParseFromString(net, &np));
    np.mutable_state()->set_phase(TRAIN);
    caffe::Net<float> plain(np);
    NetParameter weights;
    kept->ToProto(&weights, false);
    plain.CopyTrainedLayersFrom(weights);
    for (int round = 0; round < 2; ++round) {
      kept->ClearParamDiffs();  // Backward adds to them (the solver clears them before a step)
      plain.ClearParamDiffs();
      Caffe::set_random_seed(77 + round);
      const float loss_kept = kept->ForwardBackward();
      Caffe::set_random_seed(77 + round);
      const float loss_plain = plain.ForwardBackward();
      EXPECT_EQ(loss_kept, loss_plain) << "round " << round;
      for (int b = 0; b < plain.blobs().size(); ++b) {
        const Blob<float>& x = *kept->blobs()[b];
        const Blob<float>& y = *plain.blobs()[b];
        EXPECT_EQ(MaxAbsDiff(x.cpu_data(), y.cpu_data(), x.count()), 0.f)
            << plain.blob_names()[b] << " data, round " << round;
        EXPECT_EQ(MaxAbsDiff(x.cpu_diff(), y.cpu_diff(), x.count()), 0.f)
            << plain.blob_names()[b] << " diff, round " << round;
      }
      for (int p = 0; p < plain.learnable_params().size(); ++p) {
        const Blob<float>& x = *kept->learnable_params()[p];
        const Blob<float>& y = *plain.learnable_params()[p];
        EXPECT_EQ(MaxAbsDiff(x.cpu_diff(), y.cpu_diff(), x.count()), 0.f)
            << "param " << p << " diff, round " << round;
      }
    }
    kept.reset();
    EXPECT_EQ(CometNetCallbacks<float>::NetsHolding(), before);

    // COMET off: the resume counter's callback stays with the net just the same.
    solver = SolverFor(net, "");
    Run(solver.get(), 1);
    kept = solver->net();
    solver.reset();
    EXPECT_EQ(CometNetCallbacks<float>::NetsHolding(), before + 1);
    Caffe::set_random_seed(79);
    const float loss = kept->ForwardBackward();
    EXPECT_TRUE(std::isfinite(loss) && loss > 0) << loss;
    kept.reset();
    EXPECT_EQ(CometNetCallbacks<float>::NetsHolding(), before);
  }

  // pycaffe users feed an Input layer and reshape it to each batch. A batch smaller than the last
  // keeps the larger memory (Blob::Reshape), and max pooling's argmax was coded over all of it: the
  // stale values past the count are no offsets of this shape's windows, so the argmax was kept
  // dense, with a warning about a max over NaN. Coded over the buffer's count, every step stores
  // it; training stays bit for bit COMET off's (nothing lossy).
  void CheckBuffersOfABatchReshapedSmaller() {
    const std::string net =
        "name: 'fed' "
        "layer { name: 'data' type: 'Input' top: 'data' top: 'label' "
        "  input_param { shape { dim: 8 dim: 2 dim: 11 dim: 11 } shape { dim: 8 } } } "
        "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' "
        "  convolution_param { num_output: 4 kernel_size: 3 engine: CAFFE "
        "    weight_filler { type: 'gaussian' std: 0.2 } "
        "    bias_filler { type: 'constant' value: 0.1 } } } "
        "layer { name: 'pool1' type: 'Pooling' bottom: 'conv1' top: 'pool1' "
        "  pooling_param { pool: MAX kernel_size: 3 stride: 2 engine: CAFFE } } "
        "layer { name: 'ip1' type: 'InnerProduct' bottom: 'pool1' top: 'ip1' "
        "  inner_product_param { num_output: 12 weight_filler { type: 'gaussian' std: 0.1 } } } "
        "layer { name: 'drop1' type: 'Dropout' bottom: 'ip1' top: 'ip1' "
        "  dropout_param { dropout_ratio: 0.5 } } "
        "layer { name: 'ip2' type: 'InnerProduct' bottom: 'ip1' top: 'ip2' "
        "  inner_product_param { num_output: 3 weight_filler { type: 'gaussian' std: 0.1 } } } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip2' bottom: 'label' top: 'loss' } ";
    shared_ptr<Solver<float> > off = SolverFor(net, "");
    // keep_compressed: the codes stay after the step, where the test looks at them
    shared_ptr<Solver<float> > on =
        SolverFor(net, "comet { compress_type: 'None' keep_compressed: true }");
    const int batches[] = {8, 5, 8, 3};
    for (int step = 0; step < 4; ++step) {
      for (int k = 0; k < 2; ++k) {
        caffe::Net<float>* n = (k == 0 ? off : on)->net().get();
        Blob<float>* data = n->blob_by_name("data").get();
        Blob<float>* label = n->blob_by_name("label").get();
        data->Reshape(batches[step], 2, 11, 11);
        label->Reshape(std::vector<int>(1, batches[step]));
        n->Reshape();
        for (int i = 0; i < data->count(); ++i)
          data->mutable_cpu_data()[i] = std::sin(0.37f * i + step);
        for (int i = 0; i < label->count(); ++i) label->mutable_cpu_data()[i] = (i + step) % 3;
        Caffe::set_random_seed(900 + step);
        (k == 0 ? off : on)->Step(1);
      }
      caffe::Net<float>* n = on->net().get();
      const shared_ptr<CometPayload>& argmax =
          CometLayerAccess<float>::argmax(n->layer_by_name("pool1").get())->data()->comet_payload();
      ASSERT_TRUE(argmax.get() != NULL) << "batch " << batches[step] << ": argmax kept dense";
      EXPECT_EQ(argmax->kind(), CometPayload::ARGMAX);
      EXPECT_EQ(argmax->count(), batches[step] * 4 * 4 * 4) << "batch " << batches[step];
      const shared_ptr<CometPayload>& mask = CometLayerAccess<float>::dropout_mask(
          n->layer_by_name("drop1").get())->data()->comet_payload();
      ASSERT_TRUE(mask.get() != NULL) << "batch " << batches[step] << ": Dropout mask kept dense";
      EXPECT_EQ(mask->count(), batches[step] * 12) << "batch " << batches[step];
    }
    const std::vector<float> a = Params(off.get()), b = Params(on.get());
    ASSERT_EQ(a.size(), b.size());
    for (int i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "param value " << i;
  }

  std::string prefix_;

 public:
  CometStoreTest() { MakeTempFilename(&prefix_); }
};

// Masks, releases and freed diffs are exact: training must match COMET off bit for bit.
TEST_F(CometStoreTest, ExactStagesAreBitIdenticalToCometOff) {
  shared_ptr<Solver<float> > off = MakeSolver("");
  shared_ptr<Solver<float> > on = MakeSolver("comet { compress_type: 'None' }");
  EXPECT_FALSE(off->comet());
  ASSERT_TRUE(on->comet());
  Run(off.get(), 5);
  Run(on.get(), 5);
  const std::vector<float> a = Params(off.get()), b = Params(on.get());
  ASSERT_EQ(a.size(), b.size());
  for (int i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "param value " << i;
  // and they did something: conv1's output is stored as a mask
  bool mask = false;
  for (int e = 0; e < on->comet()->entries().size(); ++e)
    mask |= on->comet()->entries()[e].action == CometStore<float>::MASK;
  EXPECT_TRUE(mask);
}

// A residual block as ResNets write it: Convolution, BatchNorm, Scale and ReLU in place on one
// blob, an Eltwise SUM shortcut through Split, global average pooling and a softmax loss, on a
// batch of `num` 3-channel images of size x size, `channels` wide; with `accuracy`, the label
// is also read by Accuracy in TRAIN.
static std::string ResidualBlockNet(int num, int size, int channels, const char* weight_std,
                                    bool accuracy) {
  std::ostringstream n;
  const std::string conv = std::string(" weight_filler { type: 'gaussian' std: ") + weight_std +
                           " } bias_term: false } } ";
  n << "name: 'residual' "
       "layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
       "  dummy_data_param { shape { dim: " << num << " dim: 3 dim: " << size << " dim: " << size
    << " } shape { dim: " << num << " } "
       "    data_filler { type: 'gaussian' std: 1 } data_filler { type: 'uniform' min: 0 max: 3 } } } ";
  for (int k = 1; k <= 2; ++k) {
    const std::string c = k == 1 ? "conv1" : "conv2", from = k == 1 ? "data" : "conv1";
    n << "layer { name: '" << c << "' type: 'Convolution' bottom: '" << from << "' top: '" << c
      << "' convolution_param { num_output: " << channels << " kernel_size: 3 pad: 1" << conv
      << "layer { name: 'bn" << k << "' type: 'BatchNorm' bottom: '" << c << "' top: '" << c << "' } "
      << "layer { name: 'sc" << k << "' type: 'Scale' bottom: '" << c << "' top: '" << c
      << "' scale_param { bias_term: true } } ";
    if (k == 1) n << "layer { name: 'relu1' type: 'ReLU' bottom: 'conv1' top: 'conv1' } ";
  }
  n << "layer { name: 'sum' type: 'Eltwise' bottom: 'conv1' bottom: 'conv2' top: 'sum' } "
       "layer { name: 'relu2' type: 'ReLU' bottom: 'sum' top: 'sum' } "
       "layer { name: 'gap' type: 'Pooling' bottom: 'sum' top: 'gap' "
       "  pooling_param { pool: AVE global_pooling: true } } "
       "layer { name: 'ip' type: 'InnerProduct' bottom: 'gap' top: 'ip' "
       "  inner_product_param { num_output: 3 weight_filler { type: 'gaussian' std: 0.3 } } } "
       "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  if (accuracy) n << "layer { name: 'acc' type: 'Accuracy' bottom: 'ip' bottom: 'label' top: 'acc' } ";
  return n.str();
}

// The residual block with the exact stages (masks, releases, freed diffs and BatchNorm's and
// Scale's temp_ rebuilt): training matches COMET off bit for bit.
TEST_F(CometStoreTest, ResidualBlockTrainsBitIdenticallyWithExactStages) {
  const std::string net = ResidualBlockNet(4, 8, 6, "0.2", true);
  shared_ptr<Solver<float> > solvers[2];
  std::vector<float> initial;
  const char* comet[] = {"", "comet { compress_type: 'None' }"};
  for (int k = 0; k < 2; ++k) {
    SolverParameter sp;
    CHECK(google::protobuf::TextFormat::ParseFromString(
        "base_lr: 0.1 momentum: 0.9 lr_policy: 'fixed' max_iter: 100 display: 1 "
        "random_seed: 1701 snapshot_prefix: '" + prefix_ + "' " + comet[k], &sp));
    CHECK(google::protobuf::TextFormat::ParseFromString(net, sp.mutable_net_param()));
    solvers[k].reset(SolverRegistry<float>::CreateSolver(sp));
    if (k == 0) initial = Params(solvers[k].get());
    Run(solvers[k].get(), 4);
  }
  const std::vector<float> a = Params(solvers[0].get()), b = Params(solvers[1].get());
  ASSERT_EQ(a.size(), b.size());
  for (int i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "param value " << i;
  EXPECT_NE(a, initial) << "the block trained";
  std::map<std::string, const CometStore<float>::Entry*> by_blob;
  const CometStore<float>* store = solvers[1]->comet();
  for (int e = 0; e < store->entries().size(); ++e)
    by_blob[store->entries()[e].blob] = &store->entries()[e];
  const char* rebuilt[] = {"bn1 temp", "sc1 copy", "bn2 temp", "sc2 copy"};
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(by_blob.count(rebuilt[r])) << rebuilt[r] << "\n" << store->Plan();
    EXPECT_EQ(by_blob[rebuilt[r]]->action, CometStore<float>::REBUILD);
    EXPECT_GT(by_blob[rebuilt[r]]->last_dense, 0u) << rebuilt[r] << " was freed";
  }
  const std::vector<std::string>& names = solvers[1]->net()->layer_names();
  EXPECT_EQ(names[by_blob["sc1 copy"]->source], "bn1");
  EXPECT_EQ(names[by_blob["sc2 copy"]->source], "bn2");
  ASSERT_TRUE(by_blob.count("sum"));
  EXPECT_EQ(by_blob["sum"]->action, CometStore<float>::MASK);
  // between forward and backward, the temp_ buffers hold nothing
  caffe::Net<float>* n = solvers[1]->net().get();
  n->Forward();
  EXPECT_EQ(CometLayerAccess<float>::rebuildable(n->layer_by_name("bn1").get())->data()->head(),
            SyncedMemory::UNINITIALIZED);
  EXPECT_EQ(CometLayerAccess<float>::rebuildable(n->layer_by_name("sc2").get())->data()->head(),
            SyncedMemory::UNINITIALIZED);
}

// A CPU step with a store runs with denormals flushed to zero (float_mode.hpp): a callback
// registered after the store's sees the mode set in on_start; after the step the thread has its
// own mode back. Without COMET nothing changes.
TEST_F(CometStoreTest, AStepFlushesDenormalsAndGivesTheModeBack) {
  // Also what OpenBLAS's threads do with a product's denormal sums (the caller set to flush-to-zero
  // alone for it, which leaves their part as their own mode makes it): flushed in the step.
  struct Probe : public Solver<float>::Callback {
    std::vector<unsigned> seen;
    std::vector<int> nonzero;
    virtual void on_start() {
      const unsigned mode = CometFloatMode();
      seen.push_back(mode);
      CometSetFloatMode(FlushToZeroOnly(mode));
      nonzero.push_back(NonzeroOfADenormalProduct());
      CometSetFloatMode(mode);
    }
    virtual void on_gradients_ready() {}
  };
  const bool pool = OpenBlasThreads() >= 2 && CometGemm::SetBlasThreadsMode(CometFloatMode());
  const unsigned original = CometFloatMode();
  for (int comet = 1; comet >= 0; --comet) {
    shared_ptr<Solver<float> > s = MakeSolver(comet ? "comet { eb_mode: FIXED error_bound: 0.01 }" : "");
    Probe probe;
    s->add_callback(&probe);
    Run(s.get(), 2);
    ASSERT_EQ(probe.seen.size(), 2u);
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(probe.seen[i] & kCometFlushBits,
                comet ? kCometFlushBits : (original & kCometFlushBits)) << "step " << i;
      if (pool && comet) {
        EXPECT_EQ(probe.nonzero[i], 0) << "OpenBLAS's threads in step " << i;
      } else if (pool) {
        EXPECT_GT(probe.nonzero[i], 0) << "flushed without a store, step " << i;
      }
    }
    EXPECT_EQ(CometFloatMode() & ~kCometFloatFlags, original & ~kCometFloatFlags)
        << "the mode was not given back";
    volatile float tiny = 1e-30f;
    EXPECT_GT(tiny * 1e-10f, 0.f) << "denormals are flushed outside a step";
    if (pool) {
      CometSetFloatMode(FlushToZeroOnly(original));
      EXPECT_GT(NonzeroOfADenormalProduct(), 0) << "OpenBLAS's threads still flush after the steps";
      CometSetFloatMode(original);
    }
  }
}

// ResNet's branch2b input: BatchNorm, Scale and ReLU in place on a blob that a Convolution reads.
// The store keeps only its sign mask and rebuilds it from BatchNorm's lossy x_norm_ with Scale's
// factors; the rebuilt values keep the Convolution's bound, ReLU's zeros stay exact, and a read
// after the solver changed Scale's factors still sees the step's values.
TEST_F(CometStoreTest, ABlobThatScaleAndReluMadeFromBatchNormIsRebuiltWithinTheBound) {
  const std::string conv = " weight_filler { type: 'gaussian' std: 0.3 } bias_term: false } } ";
  const std::string net =
      "name: 'branch' "
      "layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
      "  dummy_data_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 } "
      "    data_filler { type: 'gaussian' std: 1 } data_filler { type: 'uniform' min: 0 max: 3 } } } "
      "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' "
      "  convolution_param { num_output: 6 kernel_size: 3 pad: 1" + conv +
      "layer { name: 'bn1' type: 'BatchNorm' bottom: 'conv1' top: 'conv1' } "
      "layer { name: 'sc1' type: 'Scale' bottom: 'conv1' top: 'conv1' scale_param { bias_term: true "
      "  filler { type: 'uniform' min: -2 max: 3 } bias_filler { type: 'uniform' min: -1 max: 1 } } } "
      "layer { name: 'relu1' type: 'ReLU' bottom: 'conv1' top: 'conv1' } "
      "layer { name: 'conv2' type: 'Convolution' bottom: 'conv1' top: 'conv2' "
      "  convolution_param { num_output: 5 kernel_size: 3 pad: 1" + conv +
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'conv2' top: 'ip' "
      "  inner_product_param { num_output: 3 weight_filler { type: 'gaussian' std: 0.3 } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  const float eb = 0.02f;
  const std::string fixed = "comet { eb_mode: FIXED error_bound: 0.02 ";
  shared_ptr<Solver<float> > off = SolverFor(net, "");
  shared_ptr<Solver<float> > on = SolverFor(net, fixed + "rebuild_from_batchnorm: true }");
  shared_ptr<Solver<float> > stored = SolverFor(net, fixed + "rebuild_from_batchnorm: false }");
  Run(on.get(), 3);
  Run(stored.get(), 3);
  EXPECT_NE(on->comet()->Plan().find("conv1 -> lossy"), std::string::npos) << on->comet()->Plan();
  EXPECT_NE(on->comet()->Plan().find("rebuilt from bn1 x_norm through sc1 and relu1"),
            std::string::npos) << on->comet()->Plan();
  EXPECT_EQ(stored->comet()->Plan().find("rebuilt from"), std::string::npos);
  // the reference: COMET off with the weights `on` trained to
  NetParameter trained;
  on->net()->ToProto(&trained);
  off->net()->CopyTrainedLayersFrom(trained);
  caffe::Net<float>* n = on->net().get();
  caffe::Net<float>* ref = off->net().get();
  for (int k = 0; k < 2; ++k) {  // the same batch of DummyData
    Caffe::set_random_seed(99);
    (k == 0 ? ref : n)->Forward();
  }
  const shared_ptr<CometPayload> held = n->blob_by_name("conv1")->data()->comet_payload();
  ASSERT_TRUE(held.get() != NULL);
  ASSERT_EQ(held->kind(), CometPayload::DERIVED) << "stored, not rebuilt";
  ASSERT_TRUE(held->sign_mask.get() != NULL);
  EXPECT_EQ(held->stored_bytes(), held->sign_mask->bytes()) << "only the mask is its own";
  EXPECT_LT(held->source->eb, eb) << "x_norm_'s bound is tightened by Scale's largest factor";
  Caffe::set_random_seed(99);
  stored->net()->CopyTrainedLayersFrom(trained);
  stored->net()->Forward();
  EXPECT_EQ(stored->net()->blob_by_name("conv1")->data()->comet_payload()->kind(),
            CometPayload::LOSSY);
  // the solver's update changes sc1's factors; the payload kept this forward's
  Blob<float>* factors = n->layer_by_name("sc1")->blobs()[0].get();
  caffe_add_scalar(factors->count(), 0.5f, factors->mutable_cpu_data());
  const Blob<float>* exact = ref->blob_by_name("conv1").get();
  const float* x = exact->cpu_data();
  const float* y = n->blob_by_name("conv1")->cpu_data();  // rebuilt now
  float worst = 0;
  int zeros = 0;
  for (int i = 0; i < exact->count(); ++i) {
    worst = std::max(worst, std::fabs(x[i] - y[i]));
    if (x[i] == 0) {
      ++zeros;
      ASSERT_EQ(y[i], 0.f) << "ReLU's zero " << i;
    }
  }
  EXPECT_LE(worst, eb);
  EXPECT_GT(worst, 0.f) << "lossy: not a copy";
  EXPECT_GT(zeros, exact->count() / 10);
  // and the backward from it stays close to COMET off's
  caffe_add_scalar(factors->count(), -0.5f, factors->mutable_cpu_data());
  ref->ClearParamDiffs();
  n->ClearParamDiffs();
  ref->Backward();
  n->Backward();
  const Blob<float>* wa = ref->layer_by_name("conv2")->blobs()[0].get();
  const Blob<float>* wb = n->layer_by_name("conv2")->blobs()[0].get();
  double num = 0, den = 0;
  for (int i = 0; i < wa->count(); ++i) {
    num += std::pow(wa->cpu_diff()[i] - wb->cpu_diff()[i], 2);
    den += std::pow(wa->cpu_diff()[i], 2);
  }
  EXPECT_GT(den, 0);
  EXPECT_LT(std::sqrt(num / den), 0.05) << "conv2's weight gradient";
}

TEST_F(CometStoreTest, GlobalStatisticsBatchNormKeepsNoDenseXNorm) { CheckGlobalStatistics(); }

// An LRN whose output only a ReLU (not in place) reads: the store keeps the output as the
// ReLU's sign mask, and LRN's rule computes the output from the input (within a channel) or the
// scale (across, on the CPU). With keep_compressed the mask is back on the output when the rule
// measures (after the ReLU's backward): the rule read it as values, a fatal "held only as the
// signs" on the first measuring step.
TEST_F(CometStoreTest, LrnMeasuresWithItsOutputKeptAsAMask) {
  for (int within = 0; within < 2; ++within) {
    const std::string net =
        "name: 'lrn_mask' layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
        "dummy_data_param { shape { dim: 8 dim: 3 dim: 16 dim: 16 } shape { dim: 8 } "
        "data_filler { type: 'gaussian' std: 1 } data_filler { type: 'uniform' min: 0 max: 3.99 } } } "
        "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' convolution_param { "
        "num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: 'gaussian' std: 0.2 } "
        "bias_filler { type: 'constant' value: 0.1 } } } "
        "layer { name: 'norm1' type: 'LRN' bottom: 'conv1' top: 'norm1' lrn_param { local_size: 3 "
        "alpha: 0.5 beta: 0.75 engine: CAFFE norm_region: " +
        std::string(within ? "WITHIN_CHANNEL" : "ACROSS_CHANNELS") + " } } "
        "layer { name: 'relu1' type: 'ReLU' bottom: 'norm1' top: 'r1' } "
        "layer { name: 'ip' type: 'InnerProduct' bottom: 'r1' top: 'ip' inner_product_param { "
        "num_output: 4 weight_filler { type: 'gaussian' std: 0.1 } } } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
    float without = 0;
    for (int keep = 0; keep < 2; ++keep) {
      const std::string block = std::string("comet { eb_mode: ADAPTIVE update_interval: 1 "
                                            "keep_compressed: ") + (keep ? "true" : "false") + " }";
      const std::string what = block + (within ? ", within a channel" : ", across channels");
      shared_ptr<Solver<float> > solver = SolverFor(net, block, "0.01");
      const std::string error = FatalMessageOf([&] { Run(solver.get(), 3); });
      EXPECT_EQ(error, "") << what;
      EXPECT_TRUE(std::isfinite(solver->net()->blob_by_name("loss")->cpu_data()[0])) << what;
      const float eb = solver->comet()->bound("norm1");
      EXPECT_GT(eb, 0.f) << what;
      if (keep) EXPECT_FLOAT_EQ(eb, without) << what << ": the same measurement either way";
      else without = eb;
    }
  }
}

// GoogLeNet's conv2/norm2 in small: an LRN across channels whose output only max pooling reads.
std::string LrnPoolNet() {
  return
      "name: 'lrn_pool' "
      "layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
      "  dummy_data_param { shape { dim: 4 dim: 3 dim: 12 dim: 12 } shape { dim: 4 } "
      "    data_filler { type: 'gaussian' std: 1 } data_filler { type: 'constant' value: 2 } } } "
      "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' "
      "  convolution_param { num_output: 6 kernel_size: 3 "
      "    weight_filler { type: 'gaussian' std: 0.2 } bias_filler { type: 'constant' value: 0.1 } } } "
      "layer { name: 'relu1' type: 'ReLU' bottom: 'conv1' top: 'conv1' } "
      "layer { name: 'norm1' type: 'LRN' bottom: 'conv1' top: 'norm1' "
      "  lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 } } "
      "layer { name: 'pool1' type: 'Pooling' bottom: 'norm1' top: 'pool1' "
      "  pooling_param { pool: MAX kernel_size: 3 stride: 2 } } "
      "layer { name: 'ip1' type: 'InnerProduct' bottom: 'pool1' top: 'ip1' "
      "  inner_product_param { num_output: 3 weight_filler { type: 'gaussian' std: 0.1 } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip1' bottom: 'label' top: 'loss' } ";
}

// LRN's CPU backward computes its output again (patch 0027), so nothing keeps it: freed after
// the pooling's forward, and training is bit for bit COMET off's, with LRN's scale kept or
// recomputed.
TEST_F(CometStoreTest, AnLrnOutputThatOnlyMaxPoolingReadsIsFreed) {
  const std::string net = LrnPoolNet();
  const char* comet[] = {"", "comet { compress_type: 'None' }",
                         "comet { compress_type: 'None' recompute_lrn: true }"};
  std::vector<float> params[3];
  for (int k = 0; k < 3; ++k) {
    shared_ptr<Solver<float> > solver = SolverFor(net, comet[k]);
    Run(solver.get(), 5);
    params[k] = Params(solver.get());
    ASSERT_EQ(params[k].size(), params[0].size());
    for (int i = 0; i < params[k].size(); ++i) ASSERT_EQ(params[0][i], params[k][i]) << comet[k];
    if (k == 0) continue;
    const CometStore<float>* store = solver->comet();
    const int norm1 = solver->net()->layer_names().size() - 4;  // data conv1 relu1 norm1 ...
    ASSERT_EQ(solver->net()->layer_names()[norm1], "norm1");
    bool freed = false;
    for (int e = 0; e < store->entries().size(); ++e) {
      const CometStore<float>::Entry& en = store->entries()[e];
      if (en.blob != "norm1") continue;
      EXPECT_EQ(en.action, CometStore<float>::RELEASE) << comet[k];
      freed = true;
    }
    EXPECT_TRUE(freed) << comet[k];
    // between forward and backward norm1's output holds nothing
    solver->net()->Forward();
    EXPECT_EQ(solver->net()->blob_by_name("norm1")->data()->head(), SyncedMemory::UNINITIALIZED);
    solver->net()->Backward();
  }
  // Stored lossy with adaptive bounds, LRN's own rule measures its error from the output it
  // computes from the scale (the freed output is not read), with the scale kept or recomputed.
  const char* adaptive[] = {"comet { eb_mode: ADAPTIVE update_interval: 2 }",
                            "comet { eb_mode: ADAPTIVE update_interval: 2 recompute_lrn: true }"};
  for (int k = 0; k < 2; ++k) {
    shared_ptr<Solver<float> > solver = SolverFor(net, adaptive[k]);
    const std::string error = FatalMessageOf([&] { Run(solver.get(), 5); });
    EXPECT_EQ(error, "") << adaptive[k];
    EXPECT_TRUE(std::isfinite(solver->net()->blob_by_name("loss")->cpu_data()[0])) << adaptive[k];
    const float eb = solver->comet()->bound("norm1");
    EXPECT_TRUE(eb > 0 && std::isfinite(eb)) << adaptive[k] << ": " << eb;
    EXPECT_NE(eb, 1e-3f) << adaptive[k] << ": LRN's bound never adapted";
  }
}

// LRN across channels with a ReLU in place on its output (found by scripts/fuzz_nets): outside a
// training step (pycaffe's net.forward() and net.backward()) the store keeps the output's sign
// mask for a second backward, and the forward that recomputes LRN's scale rewrote the output by
// restoring it first: a fatal "held only as the signs". It now writes it into memory of its own
// and puts the mask back; the gradients are COMET off's, twice in a row.
TEST_F(CometStoreTest, AnLrnRecomputedOutsideAStepLeavesWhatTheLayersAboveHold) {
  const std::string net = ActivationNet(
      "lrn_relu", "", "conv1",
      "layer { name: 'norm' type: 'LRN' bottom: 'conv2' top: 'norm' "
      "  lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 } } "
      "layer { name: 'relu' type: 'ReLU' bottom: 'norm' top: 'norm' } ", "norm");
  const char* blocks[] = {"comet { compress_type: 'None' recompute_lrn: true }",
                          "comet { compress_type: 'None' recompute_lrn: true keep_compressed: true }",
                          "comet { compress_type: 'None' }"};
  for (int k = 0; k < 3; ++k) {
    shared_ptr<Solver<float> > off = SolverFor(net, "", "0.01"), on = SolverFor(net, blocks[k], "0.01");
    Run(off.get(), 2);
    Run(on.get(), 2);
    for (int pass = 0; pass < 2; ++pass) {
      std::string error;
      for (int s = 0; s < 2; ++s) {
        caffe::Net<float>* n = (s ? off : on)->net().get();
        n->ClearParamDiffs();
        Caffe::set_random_seed(7);
        error = FatalMessageOf([&] { n->Forward(); n->Backward(); });
        ASSERT_EQ(error, "") << blocks[k] << ", pass " << pass;
      }
      const std::vector<Blob<float>*>& a = on->net()->learnable_params();
      const std::vector<Blob<float>*>& b = off->net()->learnable_params();
      for (int i = 0; i < a.size(); ++i)
        for (int j = 0; j < a[i]->count(); ++j)
          ASSERT_EQ(a[i]->cpu_diff()[j], b[i]->cpu_diff()[j]) << blocks[k] << ", param " << i;
    }
    const CometStore<float>* store = on->comet();
    bool mask = false;
    for (int e = 0; e < store->entries().size(); ++e)
      mask |= store->entries()[e].blob == "norm" && store->entries()[e].action == CometStore<float>::MASK;
    EXPECT_TRUE(mask) << blocks[k] << ": the LRN output is no longer a mask; the test tests nothing";
  }
}

// The same LRN with a Sigmoid in place on its output: the blob holds the Sigmoid's output, dense,
// which the Sigmoid's backward reads. The forward that recomputes LRN's scale wrote LRN's output
// over it: a second backward computed the Sigmoid's gradient from it, and a read after the step
// saw LRN's values (found by scripts/fuzz_nets). That forward's unread output goes to a scratch
// blob now: the blob reads as COMET off's after each step, and both backward passes match.
TEST_F(CometStoreTest, AnLrnRecomputedBeneathAnInPlaceLayerLeavesItsOutput) {
  const std::string net = ActivationNet(
      "lrn_sigmoid", "", "conv1",
      "layer { name: 'norm' type: 'LRN' bottom: 'conv2' top: 'norm' "
      "  lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 } } "
      "layer { name: 'sig' type: 'Sigmoid' bottom: 'norm' top: 'norm' } ", "norm");
  const char* block = "comet { compress_type: 'None' recompute_lrn: true }";
  shared_ptr<Solver<float> > off = SolverFor(net, "", "0.01"), on = SolverFor(net, block, "0.01");
  Run(off.get(), 2);
  Run(on.get(), 2);
  const Blob<float>* a = on->net()->blob_by_name("norm").get();
  const Blob<float>* b = off->net()->blob_by_name("norm").get();
  for (int j = 0; j < a->count(); ++j) ASSERT_EQ(a->cpu_data()[j], b->cpu_data()[j]) << "norm " << j;
  for (int pass = 0; pass < 3; ++pass) {  // one forward, then backward twice
    for (int s = 0; s < 2; ++s) {
      caffe::Net<float>* n = (s ? off : on)->net().get();
      n->ClearParamDiffs();
      Caffe::set_random_seed(7);
      const std::string error = FatalMessageOf([&] {
        if (pass == 0) n->Forward();
        n->Backward();
      });
      ASSERT_EQ(error, "") << "pass " << pass;
    }
    const std::vector<Blob<float>*>& pa = on->net()->learnable_params();
    const std::vector<Blob<float>*>& pb = off->net()->learnable_params();
    for (int i = 0; i < pa.size(); ++i)
      for (int j = 0; j < pa[i]->count(); ++j)
        ASSERT_EQ(pa[i]->cpu_diff()[j], pb[i]->cpu_diff()[j]) << "pass " << pass << ", param " << i;
  }
}

// ELU takes its backward's branch from its output's sign (patch 0042): not in place its input is
// freed after the forward, and its output stored with exact signs. With alpha < 0 it reads the
// input's sign, and that blob is kept (it was a sign mask, which no layer but ReLU can read: a
// fatal error at ELU's backward, found by scripts/fuzz_nets). Lossless, training is COMET off's.
TEST_F(CometStoreTest, AnEluNotInPlaceFreesItsInputUnlessAlphaIsNegative) {
  const std::string net = ActivationNet(
      "elu", "layer { name: 'elu1' type: 'ELU' bottom: 'conv1' top: 'elu1' } ", "elu1",
      "layer { name: 'elu2' type: 'ELU' bottom: 'conv2' top: 'elu2' elu_param { alpha: -0.5 } } ",
      "elu2");
  shared_ptr<Solver<float> > exact, off;
  TrainLosslessAndOff(net, &exact, &off);
  std::map<std::string, int> action;
  const CometStore<float>* store = exact->comet();
  for (int e = 0; e < store->entries().size(); ++e)
    action[store->entries()[e].blob] = store->entries()[e].action;
  EXPECT_EQ(action.count("conv1"), 1);
  EXPECT_EQ(action["conv1"], CometStore<float>::RELEASE) << "elu1's input";
  EXPECT_EQ(action.count("conv2"), 0) << "elu2's input (alpha < 0) is kept dense";
  // lossy: elu1's output stored with its signs (a lossy sign would flip ELU's branch), and a
  // step that runs through
  shared_ptr<Solver<float> > lossy = SolverFor(net, "comet { eb_mode: FIXED error_bound: 1e-2 }", "0.01");
  const std::string error = FatalMessageOf([&] { Run(lossy.get(), 3); });
  EXPECT_EQ(error, "");
  bool signs = false;
  for (int e = 0; e < lossy->comet()->entries().size(); ++e) {
    const CometStore<float>::Entry& en = lossy->comet()->entries()[e];
    if (en.blob == "elu1") signs = en.action == CometStore<float>::LOSSY && en.signs;
  }
  EXPECT_TRUE(signs) << "elu1 is not stored lossy with exact signs";
  StepBothFromTheSameWeights(lossy.get(), off.get());
  EXPECT_LT(WeightGradientError(lossy.get(), off.get(), "conv1"), 0.05);
}

// Max pooling with overlapping windows, LRN across channels and Dropout: their private buffers are
// stored as codes (argmax, Dropout mask) or freed and recomputed (LRN scale), all exactly.
TEST_F(CometStoreTest, LayerBuffersAreExactAndFreed) { CheckLayerBuffers(); }
TEST_F(CometStoreTest, MaxPoolingKeepsItsArgmaxAsCodesOnly) { CheckPoolCodes(); }
TEST_F(CometStoreTest, BuffersOfFrozenLayersAreFreedAfterTheirForward) {
  CheckFrozenLayersBuffers();
}

// comet { async }: encodes on the store's worker beside the forward pass, decodes started a
// backward layer ahead. The work and its inputs are the same as in the step, so training is
// bit-identical to async: false, with adaptive bounds measured on the way (update_interval 2),
// lossy BatchNorm x_norm_, argmax and Dropout codes, LRN and a residual branch.
// The worker's jobs hold dense memory: an encode its input until it has run, a decode ahead its
// output before the reader needs it. Neither may raise the host's peak in use above that of the
// step done in order (async: false). Forward, as in CaffeNet: conv1's output is packed as a sign
// mask after pool1's forward (its last reader) while norm1 writes its output and scale; a forward
// whose new memory would raise the peak waits for the encodes first. Backward: conv3's backward
// writes conv2's diff and restores conv2's output while conv1's output could be decoded ahead
// for conv2; that decode waits unless the pool has room for it beside what conv3's backward
// allocates.
TEST_F(CometStoreTest, WorkBesideTheStepStaysBelowThePeakOfTheStepInOrder) {
  const std::string data =
      "layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
      "  dummy_data_param { shape { dim: 8 dim: 3 dim: 64 dim: 64 } shape { dim: 8 } "
      "    data_filler { type: 'gaussian' std: 1 } data_filler { type: 'uniform' min: 0 max: 3.99 } } } ";
  const std::string conv =  // conv<k>: 32 maps of the input's size from `bottom`
      "layer { name: 'convK' type: 'Convolution' bottom: 'BOTTOM' top: 'convK' "
      "  convolution_param { num_output: 32 kernel_size: 3 pad: 1 engine: CAFFE "
      "    weight_filler { type: 'gaussian' std: 0.05 } } } ";
  const std::string head =
      "layer { name: 'ip1' type: 'InnerProduct' bottom: 'TOP' top: 'ip1' "
      "  inner_product_param { num_output: 4 weight_filler { type: 'gaussian' std: 0.01 } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip1' bottom: 'label' top: 'loss' } ";
  const auto layer = [](std::string text, const std::string& k, const std::string& bottom) {
    for (size_t at; (at = text.find("K")) != std::string::npos;) text.replace(at, 1, k);
    text.replace(text.find("BOTTOM"), 6, bottom);
    return text;
  };
  const auto ending = [&](const std::string& top) {
    std::string text = head;
    return text.replace(text.find("TOP"), 3, top);
  };
  const std::string nets[2] = {
      // the forward's case (conv1 4 MB, pool1 and norm1 1 MB)
      data + layer(conv, "1", "data") +
          "layer { name: 'relu1' type: 'ReLU' bottom: 'conv1' top: 'conv1' relu_param { engine: CAFFE } } "
          "layer { name: 'pool1' type: 'Pooling' bottom: 'conv1' top: 'pool1' "
          "  pooling_param { pool: MAX kernel_size: 2 stride: 2 engine: CAFFE } } "
          "layer { name: 'norm1' type: 'LRN' bottom: 'pool1' top: 'norm1' "
          "  lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 engine: CAFFE } } " + ending("norm1"),
      // the backward's case: four 4 MB convolutions, the backward's moments the largest
      data + layer(conv, "1", "data") + layer(conv, "2", "conv1") + layer(conv, "3", "conv2") +
          layer(conv, "4", "conv3") + ending("conv4")};
  for (int n = 0; n < 2; ++n) {
    size_t peak[2];
    for (int async = 0; async < 2; ++async) {
      shared_ptr<Solver<float> > s = SolverFor(
          "name: 'beside' " + nets[n], std::string("comet { eb_mode: FIXED error_bound: 1e-4 "
                                                   "async: ") + (async ? "true" : "false") + " }",
          "0.001");
      Run(s.get(), 3);
      peak[async] = CometHostPoolQuery().peak_in_use;  // this store's, while it lives
    }
    EXPECT_GT(peak[0], 0u);
    EXPECT_LE(peak[1], peak[0]) << (n ? "backward" : "forward")
                                << ": the worker's jobs raised the peak in use";
  }
}

TEST_F(CometStoreTest, AsyncWorkTrainsBitIdenticallyToWorkInTheStep) {
  const std::string conv = " weight_filler { type: 'gaussian' std: 0.2 } bias_term: false } } ";
  const std::string net =
      "name: 'async' "
      "layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
      "  dummy_data_param { shape { dim: 4 dim: 3 dim: 16 dim: 16 } shape { dim: 4 } "
      "    data_filler { type: 'gaussian' std: 1 } data_filler { type: 'uniform' min: 0 max: 3 } } } "
      "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' "
      "  convolution_param { num_output: 6 kernel_size: 3 pad: 1" + conv +
      "layer { name: 'relu1' type: 'ReLU' bottom: 'conv1' top: 'conv1' } "
      "layer { name: 'pool1' type: 'Pooling' bottom: 'conv1' top: 'pool1' "
      "  pooling_param { pool: MAX kernel_size: 3 stride: 2 } } "
      "layer { name: 'norm1' type: 'LRN' bottom: 'pool1' top: 'norm1' "
      "  lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 } } "
      "layer { name: 'conv2' type: 'Convolution' bottom: 'norm1' top: 'conv2' "
      "  convolution_param { num_output: 6 kernel_size: 3 pad: 1" + conv +
      "layer { name: 'bn2' type: 'BatchNorm' bottom: 'conv2' top: 'conv2' } "
      "layer { name: 'sc2' type: 'Scale' bottom: 'conv2' top: 'conv2' scale_param { bias_term: true } } "
      "layer { name: 'sum' type: 'Eltwise' bottom: 'norm1' bottom: 'conv2' top: 'sum' } "
      "layer { name: 'relu2' type: 'ReLU' bottom: 'sum' top: 'sum' } "
      "layer { name: 'ip1' type: 'InnerProduct' bottom: 'sum' top: 'ip1' "
      "  inner_product_param { num_output: 32 weight_filler { type: 'gaussian' std: 0.1 } } } "
      "layer { name: 'drop1' type: 'Dropout' bottom: 'ip1' top: 'ip1' "
      "  dropout_param { dropout_ratio: 0.5 } } "
      "layer { name: 'ip2' type: 'InnerProduct' bottom: 'ip1' top: 'ip2' "
      "  inner_product_param { num_output: 3 weight_filler { type: 'gaussian' std: 0.1 } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip2' bottom: 'label' top: 'loss' } ";
  // max_in_flight_mb 1e-4: every encode waits for the one before, no decode goes ahead.
  const char* comet[] = {"async: false", "", "decode_ahead: 3 max_in_flight_mb: 64",
                         "decode_ahead: 0", "max_in_flight_mb: 1e-4"};
  const int modes = sizeof(comet) / sizeof(comet[0]);
  shared_ptr<Solver<float> > solvers[modes];
  for (int k = 0; k < modes; ++k) {
    SolverParameter sp;
    CHECK(google::protobuf::TextFormat::ParseFromString(
        "base_lr: 0.05 momentum: 0.9 lr_policy: 'fixed' max_iter: 100 display: 1 "
        "random_seed: 1701 snapshot_prefix: '" + prefix_ + "' comet { eb_mode: ADAPTIVE "
        "update_interval: 2 error_bound: 1e-2 " + comet[k] + " }", &sp));
    CHECK(google::protobuf::TextFormat::ParseFromString(net, sp.mutable_net_param()));
    solvers[k].reset(SolverRegistry<float>::CreateSolver(sp));
    Run(solvers[k].get(), 5);
  }
  const std::vector<float> a = Params(solvers[0].get());
  for (int k = 1; k < modes; ++k) {
    const std::vector<float> b = Params(solvers[k].get());
    ASSERT_EQ(a.size(), b.size());
    for (int i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << comet[k] << ": param value " << i;
    for (int e = 0; e < solvers[0]->comet()->bounds().size(); ++e)
      EXPECT_EQ(solvers[0]->comet()->bounds()[e].eb, solvers[k]->comet()->bounds()[e].eb);
  }
  // The time split: in the step, the step waits for all of it; every lossy entry took time.
  std::set<std::string> lossy;
  for (int k = 0; k < 2; ++k) {
    const std::vector<CometStore<float>::Entry>& es = solvers[k]->comet()->entries();
    for (int e = 0; e < es.size(); ++e) {
      if (es[e].action != CometStore<float>::LOSSY) continue;
      lossy.insert(es[e].blob);
      EXPECT_GT(es[e].last_encode_ms, 0) << es[e].blob;
      EXPECT_GT(es[e].last_decode_ms, 0) << es[e].blob;
      // (ReLU's gradient from the sign mask is codec time but no wait: it replaces ReLU's.)
      if (k == 0 && !es[e].signs) {
        EXPECT_NEAR(es[e].last_wait_ms, es[e].last_encode_ms + es[e].last_decode_ms,
                    1e-6 * es[e].last_ms) << es[e].blob;
      } else if (k == 0) {
        EXPECT_LE(es[e].last_wait_ms, es[e].last_encode_ms + es[e].last_decode_ms + 1e-6)
            << es[e].blob;
      }
    }
  }
  EXPECT_TRUE(lossy.count("pool1") && lossy.count("bn2 x_norm")) << solvers[1]->comet()->Plan();
  // No job outlives the forward pass: every stored blob holds its payload when Forward returns.
  caffe::Net<float>* n = solvers[1]->net().get();
  n->Forward();
  EXPECT_TRUE(n->blob_by_name("pool1")->data()->comet_payload().get() != NULL);
  EXPECT_TRUE(CometLayerAccess<float>::argmax(n->layer_by_name("pool1").get())->data()
                  ->comet_payload().get() != NULL);
  EXPECT_TRUE(CometLayerAccess<float>::bn_x_norm(n->layer_by_name("bn2").get())->data()
                  ->comet_payload().get() != NULL);
  n->Backward();
}

// BatchNorm's temp_ and an in-place Scale's copy of x_norm_ are made on the worker ahead of
// their backward, beside x_norm_'s decode, in memory the backward pass has freed (the host
// pool's blocks below its peak in use, 1 MiB and more): sc2's copy during sum's backward,
// bn2's temp_ during sc2's. With decode_ahead: 0 each is made in the step before its own
// layer's backward; training is the same bit for bit.
TEST_F(CometStoreTest, RebuiltBuffersAreMadeAheadInMemoryTheBackwardFreed) {
  const std::string net = ResidualBlockNet(2, 128, 16, "0.1", false);  // 2 MiB blobs
  const char* comet[] = {"decode_ahead: 0", ""};
  shared_ptr<Solver<float> > solvers[2];
  for (int k = 0; k < 2; ++k) {
    solvers[k] = SolverFor(net, std::string("comet { eb_mode: FIXED error_bound: 0.01 "
                                            "max_in_flight_mb: 64 ") + comet[k] + " }");
    Run(solvers[k].get(), 3);
  }
  const std::vector<float> a = Params(solvers[0].get()), b = Params(solvers[1].get());
  ASSERT_EQ(a.size(), b.size());
  for (int i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "param value " << i;
  for (int k = 0; k < 2; ++k) {
    caffe::Net<float>* n = solvers[k]->net().get();
    const std::vector<std::string>& names = n->layer_names();
    const int sum = std::find(names.begin(), names.end(), "sum") - names.begin();
    ASSERT_EQ(names[sum - 1], "sc2");
    const SyncedMemory* copy =
        CometLayerAccess<float>::rebuildable(n->layer_by_name("sc2").get())->data().get();
    const SyncedMemory* temp =
        CometLayerAccess<float>::rebuildable(n->layer_by_name("bn2").get())->data().get();
    ASSERT_GE(copy->size(), size_t(1) << 20) << "a block of the host pool";
    n->Forward();
    ASSERT_EQ(copy->head(), SyncedMemory::UNINITIALIZED);
    ASSERT_EQ(temp->head(), SyncedMemory::UNINITIALIZED);
    n->BackwardFromTo(n->layers().size() - 1, sum);
    EXPECT_EQ(copy->head() != SyncedMemory::UNINITIALIZED, k == 1) << comet[k];
    EXPECT_EQ(temp->head(), SyncedMemory::UNINITIALIZED) << comet[k];
    n->BackwardFromTo(sum - 1, sum - 1);
    EXPECT_EQ(copy->head(), SyncedMemory::UNINITIALIZED) << "freed after sc2's backward";
    EXPECT_EQ(temp->head() != SyncedMemory::UNINITIALIZED, k == 1) << comet[k];
    n->BackwardFromTo(sum - 2, 0);
    EXPECT_EQ(temp->head(), SyncedMemory::UNINITIALIZED) << "freed after bn2's backward";
  }
}

// A net whose convolutions are tiled: while the store lives those products run as tiles (one
// OpenBLAS thread each), so training gives the same numbers with the worker and without it, and
// twice the same with it (the tiles never depend on when the worker runs).
TEST_F(CometStoreTest, TiledProductsTrainTheSameWithTheWorkerOrWithout) {
  std::string why;
  if (!CometGemm::Available(&why)) {
    std::cout << "CometGemm not available here (" << why << "): nothing to check" << std::endl;
    return;
  }
  const std::string net =
      "name: 'tiled' "
      "layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
      "  dummy_data_param { shape { dim: 4 dim: 32 dim: 32 dim: 32 } shape { dim: 4 } "
      "    data_filler { type: 'gaussian' std: 1 } data_filler { type: 'uniform' min: 0 max: 3 } } } "
      "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' "
      "  convolution_param { num_output: 64 kernel_size: 3 pad: 1 "
      "    weight_filler { type: 'gaussian' std: 0.05 } } } "
      "layer { name: 'relu1' type: 'ReLU' bottom: 'conv1' top: 'conv1' } "
      "layer { name: 'conv2' type: 'Convolution' bottom: 'conv1' top: 'conv2' "
      "  convolution_param { num_output: 64 kernel_size: 3 pad: 1 "
      "    weight_filler { type: 'gaussian' std: 0.05 } } } "
      "layer { name: 'relu2' type: 'ReLU' bottom: 'conv2' top: 'conv2' } "
      "layer { name: 'ip1' type: 'InnerProduct' bottom: 'conv2' top: 'ip1' "
      "  inner_product_param { num_output: 3 weight_filler { type: 'gaussian' std: 0.01 } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip1' bottom: 'label' top: 'loss' } ";
  bool rows;
  ASSERT_GE(CometGemm::Tiles(64, 32 * 32, 64 * 9, &rows), 2);  // conv2's forward product
  const char* comet[] = {"async: false", "", ""};
  std::vector<float> params[3];
  for (int k = 0; k < 3; ++k) {
    SolverParameter sp;
    CHECK(google::protobuf::TextFormat::ParseFromString(
        "base_lr: 0.05 momentum: 0.9 lr_policy: 'fixed' max_iter: 100 display: 1 "
        "random_seed: 1701 snapshot_prefix: '" + prefix_ + "' comet { eb_mode: FIXED "
        "error_bound: 1e-2 " + std::string(comet[k]) + " }", &sp));
    CHECK(google::protobuf::TextFormat::ParseFromString(net, sp.mutable_net_param()));
    shared_ptr<Solver<float> > solver(SolverRegistry<float>::CreateSolver(sp));
    Run(solver.get(), 4);
    params[k] = Params(solver.get());
  }
  for (int k = 1; k < 3; ++k) {
    ASSERT_EQ(params[0].size(), params[k].size());
    for (int i = 0; i < params[0].size(); ++i)
      ASSERT_EQ(params[0][i], params[k][i]) << "run " << k << ", param value " << i;
  }
}

// A payload that the worker finds corrupt while decoding it ahead is reported when its reader
// comes, with the reader's name, as a decode on demand is (async: false, decode_ahead: 0).
TEST_F(CometStoreTest, CorruptPayloadIsNamedAtItsReaderWithOrWithoutTheWorker) {
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  const char* modes[] = {"async: false", "decode_ahead: 0", "decode_ahead: 4"};
  for (int k = 0; k < 3; ++k) {
    shared_ptr<Solver<float> > on =
        MakeSolver(std::string("comet { eb_mode: FIXED error_bound: 1e-3 ") + modes[k] + " }");
    on->net()->Forward();
    shared_ptr<CometPayload>& p = on->net()->blob_by_name("pool1")->data()->comet_payload();
    ASSERT_TRUE(p.get() != NULL) << modes[k];
    static_cast<uint8_t*>(p->data())[p->bytes() - 3] ^= 0x01;
    EXPECT_DEATH(on->net()->Backward(), "compressed data of blob 'pool1' is corrupt .*read by "
                 "layer 'conv2' \\(Convolution\\) backward, iteration 0") << modes[k];
  }
}

TEST_F(CometStoreTest, DisabledBlockMeansNoStore) {
  EXPECT_FALSE(MakeSolver("comet { enabled: false }")->comet());
}

TEST_F(CometStoreTest, LossyTrainingStaysCloseAndSavesMemory) {
  shared_ptr<Solver<float> > off = MakeSolver(
      "comet { compress_type: 'None' relu_masks: false release_unused: false "
      "release_diffs: false }");  // a store that only measures
  shared_ptr<Solver<float> > on = MakeSolver("comet { eb_mode: FIXED error_bound: 1e-4 }");
  Run(off.get(), 5);
  Run(on.get(), 5);
  const std::vector<float> a = Params(off.get()), b = Params(on.get());
  float diff = MaxAbsDiff(a.data(), b.data(), a.size());
  EXPECT_GT(diff, 0.f) << "lossy compression had no effect at all?";
  EXPECT_LT(diff, 1e-3f);
  const CometMemory& m_off = off->comet()->memory();
  const CometMemory& m_on = on->comet()->memory();
  // Expected: the measuring store holds every activation and diff of the net at once.
  size_t acts = 0;
  std::set<const SyncedMemory*> seen;
  const std::vector<shared_ptr<Blob<float> > >& blobs = off->net()->blobs();
  for (int i = 0; i < blobs.size(); ++i)
    if (seen.insert(blobs[i]->data().get()).second) acts += blobs[i]->count() * sizeof(float);
  EXPECT_GE(m_off.peak[CometMemory::ACTIVATIONS], acts * 9 / 10);
  EXPECT_LT(m_on.peak_total, m_off.peak_total);
  // conv1's output (8x8x16x16 floats, 64 KB) and pool1's are never all dense at once with COMET
  EXPECT_LE(m_on.peak_total + 64 * 1024, m_off.peak_total);
  EXPECT_GT(m_on.peak[CometMemory::COMPRESSED], 0);
}

// What the encoders hold beyond the payloads counts as scratch: the host's worst-case stream
// buffer between encodes, and a device encode's worst-case stream and scratch while it runs.
TEST_F(CometStoreTest, EncoderBuffersCountInTheTrackedMemory) {
  shared_ptr<Solver<float> > on = MakeSolver("comet { eb_mode: FIXED error_bound: 1e-3 }");
  Run(on.get(), 1);
  // the stream pages of the largest encode (pool1's, about a quarter of its values' bytes here)
  const size_t pool1 = on->net()->blob_by_name("pool1")->count() * sizeof(float);
  EXPECT_GE(on->comet()->memory().current[CometMemory::SCRATCH], CometEncoderHeldBytes());
  EXPECT_GE(CometEncoderHeldBytes(), pool1 / 8)
      << "the host encoder's stream buffer is held between encodes";
  // a transient on top of the last sample raises the peak by exactly that much
  CometStatistics<float> stats(on->net().get(), on->comet()->param());
  stats.Sample(on->comet()->entries(), std::vector<const SyncedMemory*>(),
               std::vector<const SyncedMemory*>());
  const size_t total = stats.memory().total();
  ASSERT_EQ(stats.memory().peak_total, total);
  stats.NoteTransient(12345);
  EXPECT_EQ(stats.memory().peak_total, total + 12345);
  EXPECT_EQ(stats.memory().at_peak[CometMemory::SCRATCH],
            stats.memory().current[CometMemory::SCRATCH] + 12345);
  stats.NoteTransient(10);  // below the peak: nothing changes
  EXPECT_EQ(stats.memory().peak_total, total + 12345);
}

// Runs `what` when the net's pass reaches `layer` (registered after the store's callbacks, it
// sees what the store did there).
class AtLayer : public caffe::Net<float>::Callback {
 public:
  AtLayer(int layer, const std::function<void()>& what) : layer_(layer), what_(what) {}

 protected:
  virtual void run(int layer) {
    if (layer == layer_) what_();
  }

 private:
  int layer_;
  std::function<void()> what_;
};

// On a measuring iteration the weight rule holds a sample of each sampled input from its encode
// to its reader's backward (conv2's of pool1, all 4,096 values here, through ip1's backward);
// the tracked memory counts it as scratch. Serial and without the shared columns, so that the
// scratch is the encoder's and the samples' alone.
TEST_F(CometStoreTest, TheWeightRulesSamplesCountInTheTrackedMemory) {
  shared_ptr<Solver<float> > on = MakeSolver(
      "comet { eb_mode: ADAPTIVE update_interval: 1 async: false layer_buffers: false }");
  Run(on.get(), 1);  // the first step: the plan and the buffers settle
  const int ip1 = 6;
  ASSERT_EQ(on->net()->layer_names()[ip1], "ip1");
  size_t scratch = 0, samples = 0, encoder = 0;
  AtLayer probe(ip1, [&] {  // after the store sampled the memory there
    scratch = on->comet()->memory().current[CometMemory::SCRATCH];
    samples = on->comet()->error_sample_bytes();
    encoder = CometEncoderHeldBytes();  // a CPU step: no device pool counts
  });
  on->net()->add_after_backward(&probe);
  Run(on.get(), 1);
  EXPECT_GE(samples, on->net()->blob_by_name("pool1")->count() * sizeof(float));
  EXPECT_EQ(scratch, encoder + samples);
  EXPECT_EQ(on->comet()->error_sample_bytes(), 0u) << "each used once, in its layer's backward";
}

// Sample finds which memories are shared (in place, Split) once and again only when one changes;
// its sums must stay those of counting every memory once, also after a reshape gives blobs new
// memory.
TEST(CometStatisticsTest, EachMemoryCountsOnceAlsoAfterAReshape) {
  NetParameter np;
  CHECK(google::protobuf::TextFormat::ParseFromString(
      "name: 'sampled' "
      "layer { name: 'data' type: 'Input' top: 'data' top: 'label' "
      "  input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } } } "
      "layer { name: 'aux' type: 'Input' top: 'aux' "
      "  input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } } "
      "layer { name: 'silence' type: 'Silence' bottom: 'aux' } "
      "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' "
      "  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: 'gaussian' } } } "
      "layer { name: 'relu1' type: 'ReLU' bottom: 'conv1' top: 'conv1' } "
      "layer { name: 'ip1' type: 'InnerProduct' bottom: 'conv1' top: 'ip1' "
      "  inner_product_param { num_output: 3 weight_filler { type: 'gaussian' } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip1' bottom: 'label' top: 'loss' } ",
      &np));
  np.mutable_state()->set_phase(TRAIN);
  caffe::Net<float> net(np);
  CometStatistics<float> stats(&net, CometParameter());
  const std::vector<CometEntry> no_entries;
  const std::vector<const SyncedMemory*> no_buffers;
  // What Sample must find: every dense memory of the blobs (data and diff) and weights, once.
  const auto expected = [&net](int kind) {
    std::set<const SyncedMemory*> seen;
    size_t bytes = 0;
    const auto add = [&](const SyncedMemory* m) {
      if (seen.insert(m).second && m->head() != SyncedMemory::UNINITIALIZED) bytes += m->size();
    };
    for (int b = 0; b < net.blobs().size(); ++b) {
      if (kind == CometMemory::ACTIVATIONS) add(net.blobs()[b]->data().get());
      else seen.insert(net.blobs()[b]->data().get());
      if (kind == CometMemory::GRADIENTS) add(net.blobs()[b]->diff().get());
      else seen.insert(net.blobs()[b]->diff().get());
    }
    for (int p = 0; p < net.learnable_params().size(); ++p) {
      if (kind == CometMemory::WEIGHTS) add(net.learnable_params()[p]->data().get());
      else seen.insert(net.learnable_params()[p]->data().get());
      if (kind == CometMemory::GRADIENTS) add(net.learnable_params()[p]->diff().get());
    }
    return bytes;
  };
  const int batches[] = {2, 2, 5, 3, 7};
  for (int k = 0; k < 5; ++k) {
    net.blob_by_name("data")->Reshape(batches[k], 3, 8, 8);
    net.blob_by_name("aux")->Reshape(batches[k], 3, 8, 8);
    net.blob_by_name("label")->Reshape(std::vector<int>(1, batches[k]));
    net.Reshape();
    // from batch 3 on, pycaffe-style sharing: aux holds data's memory (a share Sample must find)
    if (k >= 3) net.blob_by_name("aux")->ShareData(*net.blob_by_name("data"));
    net.ForwardBackward();
    for (int again = 0; again < 2; ++again) {
      stats.Sample(no_entries, no_buffers, no_buffers);
      for (int kind = CometMemory::WEIGHTS; kind <= CometMemory::GRADIENTS; ++kind)
        EXPECT_EQ(stats.memory().current[kind], expected(kind))
            << CometMemory::name(kind) << ", batch " << batches[k];
    }
  }
  // conv1 and relu1's output are one memory, and aux is data's: the batch-7 activations hold
  // each once
  EXPECT_EQ(stats.memory().current[CometMemory::ACTIVATIONS],
            (7 * 3 * 8 * 8 + 7 + 7 * 4 * 6 * 6 + 7 * 3 + 1) * sizeof(float));
}

TEST_F(CometStoreTest, ReportsWithRatiosAndWritesStats) {
  shared_ptr<Solver<float> > on = MakeSolver("comet { eb_mode: FIXED error_bound: 1e-2 }");
  Run(on.get(), 3);
  const std::vector<CometStore<float>::Entry>& es = on->comet()->entries();
  int reported = 0;
  for (int e = 0; e < es.size(); ++e) {
    if (es[e].action == CometStore<float>::LOSSY) {
      EXPECT_GT(es[e].last_ratio, 1.0) << es[e].name;
      EXPECT_FLOAT_EQ(es[e].last_eb, 1e-2f);
      ++reported;
    }
  }
  EXPECT_GE(reported, 2);  // pool1 for conv2, conv2 for ip1
  std::ifstream csv((prefix_ + "_comet.csv").c_str());
  ASSERT_TRUE(csv.good());
  std::string header, line, total;
  std::getline(csv, header);
  EXPECT_EQ(header.find("iter,layer,blob,kind,ratio,eb"), 0u);
  EXPECT_NE(header.find(",buffers_dense_bytes,buffers_stored_bytes"), std::string::npos) << header;
  const int columns = std::count(header.begin(), header.end(), ',');
  int rows = 0;
  while (std::getline(csv, line)) {
    ++rows;
    EXPECT_EQ(std::count(line.begin(), line.end(), ','), columns) << line;
    if (line.find(",total,") != std::string::npos) total = line;
  }
  EXPECT_GE(rows, 3 * (reported + 1));
  // The total row's figures are the store's: dense and stored bytes of the blobs, the peak.
  std::vector<std::string> cells;
  std::stringstream split(total);
  for (std::string c; std::getline(split, c, ',');) cells.push_back(c);
  ASSERT_GE(cells.size(), 10u) << total;
  EXPECT_GT(atof(cells[7].c_str()), atof(cells[8].c_str())) << "dense > stored: " << total;
  EXPECT_EQ(static_cast<size_t>(atof(cells[9].c_str())), on->comet()->memory().peak_total);
  // ... and the codecs' time per iteration, the entries' sum, of which the step waited a part.
  EXPECT_EQ(header.substr(header.size() - 27), "encode_ms,decode_ms,wait_ms") << header;
  ASSERT_EQ(cells.size(), 20u) << total;
  double encode = 0, decode = 0;
  for (int e = 0; e < es.size(); ++e) {
    encode += es[e].last_encode_ms;
    decode += es[e].last_decode_ms;
  }
  EXPECT_GT(encode, 0);
  EXPECT_NEAR(atof(cells[17].c_str()), encode, 1e-3 * encode + 1e-3) << total;
  EXPECT_NEAR(atof(cells[18].c_str()), decode, 1e-3 * decode + 1e-3) << total;
  EXPECT_GE(atof(cells[19].c_str()), 0) << total;
}

// A statistics file with other columns (a run resumed with a newer fork) is kept aside, not
// appended to under a header that names other columns.
TEST_F(CometStoreTest, StatsOfAnotherHeaderAreKeptAside) {
  const std::string path = prefix_ + "_comet.csv";
  {
    std::ofstream old(path.c_str());
    old << "iter,layer,ratio\n0,total,2\n";
  }
  shared_ptr<Solver<float> > on = MakeSolver("comet { eb_mode: FIXED error_bound: 1e-2 }");
  Run(on.get(), 1);
  std::ifstream kept((path + ".old").c_str());
  std::string line;
  ASSERT_TRUE(static_cast<bool>(std::getline(kept, line)));
  EXPECT_EQ(line, "iter,layer,ratio");
  std::ifstream now(path.c_str());
  ASSERT_TRUE(static_cast<bool>(std::getline(now, line)));
  EXPECT_EQ(line.find("iter,layer,blob,kind,ratio,eb"), 0u);
}

TEST_F(CometStoreTest, NaNInAnActivationIsKeptNotLostNorACrash) {
  shared_ptr<Solver<float> > off = MakeSolver("");
  shared_ptr<Solver<float> > on = MakeSolver("comet { eb_mode: FIXED error_bound: 1e-3 }");
  Solver<float>* solvers[] = {off.get(), on.get()};
  for (int s = 0; s < 2; ++s) {
    Blob<float>* w = solvers[s]->net()->layer_by_name("conv2")->blobs()[0].get();
    w->mutable_cpu_data()[0] = std::numeric_limits<float>::quiet_NaN();
    Run(solvers[s], 1);
  }
  // Same outcome as without COMET: the NaN reached the loss and the weights.
  const float loss_off = off->net()->blob_by_name("loss")->cpu_data()[0];
  const float loss_on = on->net()->blob_by_name("loss")->cpu_data()[0];
  EXPECT_TRUE(std::isnan(loss_off));
  EXPECT_TRUE(std::isnan(loss_on));
  const float* ip_off = off->net()->layer_by_name("ip1")->blobs()[0]->cpu_data();
  const float* ip_on = on->net()->layer_by_name("ip1")->blobs()[0]->cpu_data();
  EXPECT_EQ(std::isnan(ip_off[0]), std::isnan(ip_on[0]));
}

// A diverging run: NaN, Inf or huge values reaching max or average pooling (stochastic pooling
// has no CPU Backward to run). Upstream left the argmax at -1
// for a window of NaN or -Inf and its backward wrote before the buffer (heap corruption); patch
// 0015 starts every window at its first element and lets NaN win.
void CometStoreTest::CheckNaNThroughPooling() {
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), 1e38f};
  for (int s = 0; s < 4; ++s) {
    const float v = specials[s];
    for (int tops = 0; tops <= 2; ++tops) {  // 0: average pooling, 1, 2: max (argmax inside, top)
      LayerParameter lp;
      lp.set_type("Pooling");
      lp.mutable_pooling_param()->set_pool(tops ? PoolingParameter_PoolMethod_MAX
                                                : PoolingParameter_PoolMethod_AVE);
      lp.mutable_pooling_param()->set_kernel_size(3);
      lp.mutable_pooling_param()->set_stride(2);
      for (int t = 0; t < std::max(tops, 1); ++t) lp.add_top(t ? "mask" : "y");
      Blob<float> x(2, 2, 5, 5), y, mask;
      FillerParameter fp;
      GaussianFiller<float>(fp).Fill(&x);
      float* d = x.mutable_cpu_data();
      for (int h = 0; h < 3; ++h)
        for (int w = 0; w < 3; ++w) d[h * 5 + w] = v;  // window (0, 0) of plane 0: all v
      d[25 + 2 * 5 + 4] = v;  // one element of plane 1
      std::vector<Blob<float>*> bottom(1, &x), top(1, &y);
      if (tops == 2) top.push_back(&mask);
      PoolingLayer<float> pool(lp);
      pool.SetUp(bottom, top);
      pool.Forward(bottom, top);
      const int* argmax = tops == 1 ? CometLayerAccess<float>::argmax(&pool)->cpu_data() : NULL;
      for (int i = 0; i < y.count() && tops; ++i) {
        const int p = i % 4, ph = p / 2, pw = p % 2;
        const int idx = argmax ? argmax[i] : static_cast<int>(mask.cpu_data()[i]);
        const int h = idx / 5, w = idx % 5;
        EXPECT_TRUE(h >= 2 * ph && h < 2 * ph + 3 && w >= 2 * pw && w < 2 * pw + 3)
            << "value " << v << ", output " << i << ": argmax " << idx << " outside its window";
      }
      if (std::isnan(v)) {
        EXPECT_TRUE(std::isnan(y.cpu_data()[0]));
        EXPECT_TRUE(std::isnan(y.cpu_data()[4 + 1]));  // plane 1, window (0, 1) holds the NaN
      } else if (tops) {
        EXPECT_EQ(y.cpu_data()[0], v);
      } else if (std::isinf(v)) {
        EXPECT_EQ(y.cpu_data()[0], v);  // the mean of a window of Inf
      }
      caffe_set(y.count(), 1.f, y.mutable_cpu_diff());
      pool.Backward(top, std::vector<bool>(1, true), bottom);
      EXPECT_NEAR(x.asum_diff(), static_cast<float>(y.count()), tops ? 0 : 1e-4)
          << "every gradient lands in x";
    }
  }
  // Training into NaN, COMET off and on: four steps, no crash, the loss says NaN.
  const std::string comet[] = {"", "comet { eb_mode: FIXED error_bound: 1e-3 }"};
  for (int k = 0; k < 2; ++k) {
    shared_ptr<Solver<float> > solver = MakeSolver(comet[k]);
    Blob<float>* w = solver->net()->layer_by_name("conv1")->blobs()[0].get();
    w->mutable_cpu_data()[0] = std::numeric_limits<float>::quiet_NaN();  // NaN windows at pool1
    Run(solver.get(), 4);
    EXPECT_TRUE(std::isnan(solver->net()->blob_by_name("loss")->cpu_data()[0])) << comet[k];
  }
}

TEST_F(CometStoreTest, NaNAndInfThroughMaxPoolingStayInTheWindow) { CheckNaNThroughPooling(); }

// Settings that would do nothing or fail late stop before training, naming the field.
TEST_F(CometStoreTest, SettingsThatCannotWorkAreRefusedBeforeTraining) {
  const char* bad[][2] = {
      {"comet { update_interval: 0 }", "comet.update_interval must be > 0 with eb_mode ADAPTIVE"},
      {"comet { error_bound: inf }", "comet.error_bound must be a finite number > 0 (got inf)"},
      {"comet { error_bound: nan }", "comet.error_bound must be a finite number > 0"},
      {"comet { adaptive_target: 0 }", "comet.adaptive_target must be a finite number > 0"},
      {"comet { min_error_bound: 0.5 max_error_bound: 0.1 }", "comet.min_error_bound (0.5) exceeds"},
      {"comet { compress_type: 'NoSuchLayer' }", "comet.compress_type 'NoSuchLayer' is not a layer"},
      {"comet { memory_pool_headroom: -1 }", "comet.memory_pool_headroom must be a finite number"},
  };
  CometSetFatalThrows(true);
  for (int i = 0; i < sizeof(bad) / sizeof(bad[0]); ++i) {
    std::string what;
    try {
      MakeSolver(bad[i][0]);
    } catch (const std::runtime_error& e) {
      what = e.what();
    }
    EXPECT_NE(what.find(bad[i][1]), std::string::npos) << bad[i][0] << " gave: " << what;
  }
  // what is fine stays fine
  std::string what;
  try {
    MakeSolver("comet { eb_mode: FIXED update_interval: 0 compress_type: 'None' }");
  } catch (const std::runtime_error& e) {
    what = e.what();
  }
  CometSetFatalThrows(false);
  EXPECT_EQ(what, "");
}

// A layer measured once has no second curve to compare with: its margin starts as if its last
// measurement had been a 2x surprise, so the first pick aims at target / 2^0.75, and every
// measurement after lets it shrink by a quarter in log where the curves agree.
TEST_F(CometStoreTest, TheFirstPickOfTheWeightRuleKeepsAMargin) {
  shared_ptr<Solver<float> > a = MakeSolver("comet { eb_mode: ADAPTIVE update_interval: 100 }");
  Run(a.get(), 1);
  a->Snapshot();
  CometState state;
  ASSERT_TRUE(ReadProtoFromTextFile(prefix_ + "_iter_1.cometstate", &state));
  int measured = 0;
  for (int i = 0; i < state.bound_size(); ++i) {
    if (!state.bound(i).curve_bound_size()) continue;  // no weight rule (LRN, BatchNorm's own)
    EXPECT_NEAR(state.bound(i).margin(), std::pow(kCometFirstDriftMargin, 0.75), 1e-6)
        << state.bound(i).layer();
    ++measured;
  }
  EXPECT_GT(measured, 0);
}

// A .cometstate that is empty, names layers the net does not store lossy, or belongs to another
// iteration than the solver state is refused, not half-restored.
TEST_F(CometStoreTest, AForeignOrEmptyCometStateIsRefused) {
  const std::string block = "comet { eb_mode: ADAPTIVE update_interval: 2 }";
  shared_ptr<Solver<float> > a = MakeSolver(block);
  Run(a.get(), 2);
  a->Snapshot();
  const std::string state = prefix_ + "_iter_2.solverstate";
  const std::string comet = prefix_ + "_iter_2.cometstate";
  std::string good;
  {
    std::ifstream in(comet.c_str());
    std::getline(in, good, '\0');
  }
  const std::string cases[][2] = {
      {"", "is empty"},
      {good + "bound { layer: 'nosuch' error_bound: 0.1 }\n", "bound for layer nosuch"},
      {"iter: 7\n", "belongs to iteration 7, the solver state to iteration 2"},
  };
  CometSetFatalThrows(true);
  for (int i = 0; i < 3; ++i) {
    std::ofstream(comet.c_str()) << cases[i][0];
    shared_ptr<Solver<float> > b = MakeSolver(block);
    std::string what;
    try {
      b->Restore(state.c_str());
    } catch (const std::runtime_error& e) {
      what = e.what();
    }
    EXPECT_NE(what.find(cases[i][1]), std::string::npos) << "case " << i << ": " << what;
  }
  CometSetFatalThrows(false);
  std::ofstream(comet.c_str()) << good;
  shared_ptr<Solver<float> > c = MakeSolver(block);
  c->Restore(state.c_str());
  EXPECT_EQ(c->iter(), 2);
}

// A solver state that is truncated, random, or of another net stops the restore with the file's
// name and what is wrong (patch 0019), instead of restoring from whatever parsed.
TEST_F(CometStoreTest, ATruncatedOrForeignSolverStateIsNamed) {
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  shared_ptr<Solver<float> > a = MakeSolver("");
  Run(a.get(), 1);
  a->Snapshot();
  const std::string state = prefix_ + "_iter_1.solverstate";
  std::string bytes;
  {
    std::ifstream in(state.c_str(), std::ios::binary);
    bytes.assign((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  ASSERT_GT(bytes.size(), 100u);
  const std::string cut = prefix_ + "_cut.solverstate";
  std::ofstream(cut.c_str(), std::ios::binary).write(bytes.data(), bytes.size() / 2);
  EXPECT_DEATH(MakeSolver("")->Restore(cut.c_str()),
               "Cannot read the solver state .*_cut.solverstate: the file is truncated");
  // a solver state of another net: conv1 with another number of outputs
  SolverParameter sp = a->param();
  sp.mutable_net_param()->mutable_layer(1)->mutable_convolution_param()->set_num_output(5);
  shared_ptr<Solver<float> > other(SolverRegistry<float>::CreateSolver(sp));
  // (the weights the state names are copied first, and upstream already says this clearly)
  EXPECT_DEATH(other->Restore(state.c_str()),
               "Cannot copy param 0 weights from layer 'conv1'; shape mismatch");
  // without ip1 (and the loss reading it): a history of another length
  SolverParameter shorter = a->param();
  NetParameter* np = shorter.mutable_net_param();
  np->mutable_layer()->RemoveLast();  // loss
  np->mutable_layer()->RemoveLast();  // ip1
  shared_ptr<Solver<float> > fewer(SolverRegistry<float>::CreateSolver(shorter));
  EXPECT_DEATH(fewer->Restore(state.c_str()), "holds 6 history blobs where this solver has 4");
}

TEST_F(CometStoreTest, AdaptiveBoundsMoveAndSurviveSnapshotAndResume) {
  shared_ptr<Solver<float> > a = MakeSolver(
      "comet { eb_mode: ADAPTIVE error_bound: 1e-1 update_interval: 2 adaptive_target: 0.01 "
      "min_error_bound: 1e-6 max_error_bound: 1 }");
  Run(a.get(), 4);
  const float eb_conv2 = a->comet()->bound("conv2");
  const float eb_ip1 = a->comet()->bound("ip1");
  EXPECT_NE(eb_conv2, 1e-1f) << "the adaptive rule never moved the bound";
  EXPECT_NE(eb_ip1, 1e-1f);
  // To where the target says: the same net aiming at 4x the error takes larger bounds, by less
  // than 4x (the error grows at least in proportion to the bound) and more than 4^(1/4).
  shared_ptr<Solver<float> > loose = MakeSolver(
      "comet { eb_mode: ADAPTIVE error_bound: 1e-1 update_interval: 2 adaptive_target: 0.04 "
      "min_error_bound: 1e-6 max_error_bound: 1 }");
  Run(loose.get(), 4);
  const char* layers[] = {"conv2", "ip1"};
  for (int i = 0; i < 2; ++i) {
    const double ratio = loose->comet()->bound(layers[i]) / a->comet()->bound(layers[i]);
    EXPECT_GT(ratio, 1.3) << layers[i] << ": " << a->comet()->bound(layers[i]);
    EXPECT_LT(ratio, 4.5) << layers[i] << ": " << a->comet()->bound(layers[i]);
  }
  a->Snapshot();
  const std::string state = prefix_ + "_iter_4.solverstate";
  std::ifstream probe((prefix_ + "_iter_4.cometstate").c_str());
  ASSERT_TRUE(probe.good());
  shared_ptr<Solver<float> > b = MakeSolver(
      "comet { eb_mode: ADAPTIVE error_bound: 1e-1 update_interval: 2 adaptive_target: 0.01 "
      "min_error_bound: 1e-6 max_error_bound: 1 }");
  EXPECT_FLOAT_EQ(b->comet()->bound("conv2"), 1e-1f);
  b->Restore(state.c_str());
  EXPECT_EQ(b->iter(), 4);
  EXPECT_FLOAT_EQ(b->comet()->bound("conv2"), eb_conv2);
  EXPECT_FLOAT_EQ(b->comet()->bound("ip1"), eb_ip1);
}

// A BatchNorm after a global pooling normalises each channel over the batch alone: 4 values
// here. The errors of its lossy x_norm_ then have a mean and a component along x_norm_ of their
// own, which its backward turns into gradient along the one direction the layers below meet
// coherently; the store moves each channel back to the exact moments before the backward
// (batchnorm_moments.hpp) and centres the gradient after it. Only x_norm_ is lossy
// (compress_type: "BatchNorm"), at FIXED 0.05: conv1's weight gradient 2.6% off COMET off's
// without the corrections, 0.94% with them (1.8% with the centring alone, as before 2026-12-07's
// second session).
void CometStoreTest::CheckBatchNormMoments() {
  const std::string net =
      "name: 'few' layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
      "dummy_data_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 } "
      "data_filler { type: 'gaussian' std: 1 } "
      "data_filler { type: 'uniform' min: 0 max: 3.99 } } } "
      "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' convolution_param { "
      "num_output: 8 kernel_size: 3 weight_filler { type: 'gaussian' std: 0.3 } } } "
      "layer { name: 'relu1' type: 'ReLU' bottom: 'conv1' top: 'conv1' } "
      "layer { name: 'pool1' type: 'Pooling' bottom: 'conv1' top: 'pool1' pooling_param { "
      "pool: MAX global_pooling: true } } "
      "layer { name: 'bn1' type: 'BatchNorm' bottom: 'pool1' top: 'bn1' } "
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'bn1' top: 'ip' inner_product_param { "
      "num_output: 4 weight_filler { type: 'gaussian' std: 0.3 } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  double errors[2];
  CorrectedBatchNormErrors(net, "eb_mode: FIXED error_bound: 0.05 release_diffs: false", "0.05",
                           errors);
  EXPECT_GT(errors[0], 0.015) << "conv1's weight gradient from BatchNorm's own backward";
  EXPECT_LT(errors[1], errors[0] / 2) << "conv1's, with x_norm_ at its exact moments";
}
TEST_F(CometStoreTest, ABatchNormOfFewValuesAChannelReadsItsXNormAtItsExactMoments) {
  CheckBatchNormMoments();
}

// scripts/fuzz_nets's input layer: 4 images of 3 x 12 x 12 drawn from N(0, 1), labels 0 to 4.
const std::string kFuzzInput =
    "layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
    "dummy_data_param { shape { dim: 4 dim: 3 dim: 12 dim: 12 } shape { dim: 4 } "
    "data_filler { type: 'gaussian' std: 1 } "
    "data_filler { type: 'uniform' min: 0 max: 4.99 } } } ";

// A BatchNorm on a 3-axis view of `blob` (N x C x H*W, as a 3-D Convolution's 5-axis output is folded
// for one, scripts/fuzz_nets's volume layers) and its output back to N x C x 12 x 12 as `top`:
// each channel holds the values it held.
std::string BatchNormOnAView(const std::string& blob, const std::string& top) {
  return "layer { name: 'view' type: 'Reshape' bottom: '" + blob + "' top: 'flat' "
         "reshape_param { shape { dim: 0 dim: 0 dim: -1 } } } "
         "layer { name: 'bn1' type: 'BatchNorm' bottom: 'flat' top: 'flat' } "
         "layer { name: 'back' type: 'Reshape' bottom: 'flat' top: '" + top + "' "
         "reshape_param { shape { dim: 0 dim: 0 dim: 12 dim: 12 } } } ";
}

// A BatchNorm right above a 1x1 Convolution of 3 inputs, over 4 x 12 x 12 = 576 values a channel
// (scripts/fuzz_nets seed 1647's): the error its lossy x_norm_ gives its input gradient is small
// against that gradient, and the BatchNorm rule took the cap of its own rule, but the error's part
// along x_norm_ adds up coherently in conv1's weight gradient (CometBatchNormWeightError). Only
// x_norm_ is lossy, ADAPTIVE: without the second rule bn1 stays at 0.253 and conv1's weight
// gradient is 13.8% off COMET off's against the 5% target; with it 0.095 and 5.7%. `reshaped`:
// the BatchNorm on a 3-axis view of conv1's output: the same figures (0.253 and
// 13.8% when the walk down stopped at the Reshape).
void CometStoreTest::CheckBatchNormWeightsBelow(bool reshaped) {
  const std::string net =
      "name: 'below' " + kFuzzInput +
      "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' convolution_param { "
      "num_output: 6 kernel_size: 1 weight_filler { type: 'gaussian' std: 0.8 } "
      "bias_filler { type: 'constant' value: 0.1 } } } " +
      (reshaped ? BatchNormOnAView("conv1", "conv1b")
                : "layer { name: 'bn1' type: 'BatchNorm' bottom: 'conv1' top: 'conv1' } ") +
      "layer { name: 'elu1' type: 'ELU' bottom: '" + (reshaped ? "conv1b" : "conv1") +
      "' top: 'elu1' elu_param { alpha: -0.5 } } "
      "layer { name: 'pool1' type: 'Pooling' bottom: 'elu1' top: 'pool1' pooling_param { "
      "pool: MAX kernel_size: 2 stride: 2 } } "
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'pool1' top: 'ip' inner_product_param { "
      "num_output: 5 weight_filler { type: 'gaussian' std: 0.07 } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  shared_ptr<Solver<float> > off = SolverFor(net, "", "0.01");
  shared_ptr<Solver<float> > on = SolverFor(
      net, "comet { eb_mode: ADAPTIVE compress_type: 'BatchNorm' update_interval: 1 }", "0.01");
  Run(on.get(), 3);
  ExpectBoundLoweredForConv1(on.get(), off.get(), "bn1", 0.2);
}
TEST_F(CometStoreTest, ABatchNormAboveAWeightedLayerBoundsItsErrorInThoseWeights) {
  CheckBatchNormWeightsBelow(false);
}
TEST_F(CometStoreTest, ABatchNormOnAReshapedViewBoundsItsErrorInTheWeightsBelow) {
  CheckBatchNormWeightsBelow(true);
}

// A Scale between two BatchNorms (scripts/fuzz_nets seed 2553's): the second normalises the
// Scale's output, so the Scale's true gradient is about 0, and all its gradient is the error
// the second's lossy x_norm_ gives it (its bias's part is centred away). A PReLU there (seed
// 2672's, over 4 values a channel) sums the error into its slopes' gradient coherently, as a
// Convolution below a BatchNorm does. Only x_norm_ is lossy, ADAPTIVE: the second BatchNorm's
// bound must come down for these weights too, and their gradient error stay small against the
// larger of their own gradient and 5% of the InnerProduct's (as the fuzzer measures it).
// Measured: Scale, 0.25 and 8.6% when the walk down knew Convolutions and InnerProducts only,
// 0.0035 and 0.13% since; PReLU, 0.25 and 5.5% before, 0.039 and 0.40% since.
void CometStoreTest::CheckChannelWeightsBetweenBatchNorms(const std::string& type) {
  const std::string between =
      type == "Scale" ? "layer { name: 'w1' type: 'Scale' bottom: 'conv1' top: 'conv1' "
                        "scale_param { bias_term: true filler { type: 'constant' value: 1.2 } "
                        "bias_filler { type: 'constant' value: 0.1 } } } "
                      : "layer { name: 'w1' type: 'PReLU' bottom: 'conv1' top: 'conv1' } ";
  const std::string net =
      "name: 'between' " + kFuzzInput +
      "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' param { lr_mult: 0 } "
      "param { lr_mult: 0 } convolution_param { num_output: 8 kernel_size: 3 pad: 1 "
      "weight_filler { type: 'gaussian' std: 0.27 } bias_filler { type: 'constant' value: 0.1 } } } "
      "layer { name: 'bn1' type: 'BatchNorm' bottom: 'conv1' top: 'conv1' } " + between +
      "layer { name: 'bn2' type: 'BatchNorm' bottom: 'conv1' top: 'conv1' } "
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'conv1' top: 'ip' inner_product_param { "
      "num_output: 5 weight_filler { type: 'gaussian' std: 0.03 } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  shared_ptr<Solver<float> > off = SolverFor(net, "", "0.01");
  shared_ptr<Solver<float> > on = SolverFor(
      net, "comet { eb_mode: ADAPTIVE compress_type: 'BatchNorm' update_interval: 1 }", "0.01");
  Run(on.get(), 3);
  StepBothFromTheSameWeights(on.get(), off.get());
  const double floor = 0.05 * std::sqrt(off->net()->layer_by_name("ip")->blobs()[0]->sumsq_diff());
  const double own = std::sqrt(off->net()->layer_by_name("w1")->blobs()[0]->sumsq_diff());
  const double error = WeightGradientDistance(on.get(), off.get(), "w1") / std::max(own, floor);
  const float eb = on->comet()->bound("bn2");
  LOG(INFO) << type << ": bn2's bound " << eb << ", w1's gradient error " << error
            << " (its gradient " << own << ", the floor " << floor << ")";
  EXPECT_LT(eb, 0.1) << "bn2's bound, lowered for the weights of the " << type;
  EXPECT_LT(error, 0.02) << "the " << type << "'s gradient error";
}
TEST_F(CometStoreTest, AScaleBetweenTwoBatchNormsBoundsTheSecondsError) {
  CheckChannelWeightsBetweenBatchNorms("Scale");
}
TEST_F(CometStoreTest, APReLUBetweenTwoBatchNormsBoundsTheSecondsError) {
  CheckChannelWeightsBetweenBatchNorms("PReLU");
}

// A TanH in place on a 1x1 Convolution, whose first channel alone goes on, through a global max
// pooling (scripts/fuzz_nets seed 2538's): conv1's weight gradient sums 4 values of TanH's input
// gradient, one per image, which nearly cancel, while their errors do not. TanH's own rule holds
// that gradient to its 5% target at a bound of 0.011, and conv1's weight gradient is 23% off;
// bounded by the weights below too, 0.0045 and 0.5%. Only TanH's output is lossy, ADAPTIVE.
// `concat`: TanH on a Concat of conv1's output and another 1x1 Convolution's (seed 680's kind:
// conv1 is found through it), the same figures (23% when the rule stopped at the Concat).
void CometStoreTest::CheckDerivativeWeightsBelow(bool concat) {
  const std::string tanh_of = concat ? "joined" : "conv1";
  const std::string net =
      "name: 'below' " + kFuzzInput +
      "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' convolution_param { "
      "num_output: 8 kernel_size: 1 bias_term: false "
      "weight_filler { type: 'gaussian' std: 0.8 } } } " +
      // conv2's weights constant: no draw, so that ip's are those of the net without it
      std::string(concat ? "layer { name: 'conv2' type: 'Convolution' bottom: 'data' top: 'conv2' "
                           "convolution_param { num_output: 4 kernel_size: 1 weight_filler { "
                           "type: 'constant' value: 0.3 } } } "
                           "layer { name: 'join' type: 'Concat' bottom: 'conv1' bottom: 'conv2' "
                           "top: 'joined' } " : "") +
      "layer { name: 'tanh1' type: 'TanH' bottom: '" + tanh_of + "' top: '" + tanh_of + "' } "
      "layer { name: 'slice1' type: 'Slice' bottom: '" + tanh_of + "' top: 'first' top: 'rest' "
      "slice_param { axis: 1 slice_point: 1 } } "
      "layer { name: 'silence1' type: 'Silence' bottom: 'rest' } "
      "layer { name: 'pool1' type: 'Pooling' bottom: 'first' top: 'pool1' pooling_param { "
      "pool: MAX global_pooling: true } } "
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'pool1' top: 'ip' inner_product_param { "
      "num_output: 5 weight_filler { type: 'gaussian' std: 1 } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  // seeded as scripts/fuzz_nets seeds its solvers: the weights and batches of seed 2538's net
  shared_ptr<Solver<float> > off = SolverFor(net, "", "0.01", "5");
  shared_ptr<Solver<float> > on = SolverFor(
      net, "comet { eb_mode: ADAPTIVE compress_type: 'TanH' update_interval: 1 tiled_gemm: false }",
      "0.01", "5");
  // each step on the batch compared below, as scripts/fuzz_nets does: how far 4 values cancel
  // changes from batch to batch, and a bound measured on one batch is no promise for the next
  for (int k = 0; k < 3; ++k) {
    Caffe::set_random_seed(7);
    on->Step(1);
  }
  ExpectBoundLoweredForConv1(on.get(), off.get(), "tanh1", 0.008);
}
TEST_F(CometStoreTest, ADerivativeRuleAboveAWeightedLayerBoundsItsErrorInThoseWeights) {
  CheckDerivativeWeightsBelow(false);
}
TEST_F(CometStoreTest, ADerivativeRuleAboveAConcatBoundsItsErrorInTheWeightsOfEachPart) {
  CheckDerivativeWeightsBelow(true);
}

// A 3x3 Convolution of the fuzz input into `outputs` channels and a ReLU in place, conv1.
std::string ReluOfConv1(int outputs) {
  std::ostringstream o;
  o << "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' convolution_param { "
       "num_output: " << outputs << " kernel_size: 3 pad: 1 weight_filler { type: 'gaussian' "
       "std: 0.27 } bias_filler { type: 'constant' value: 0.1 } } } "
       "layer { name: 'relu1' type: 'ReLU' bottom: 'conv1' top: 'conv1' } ";
  return o.str();
}

// A BatchNorm after a ReLU (scripts/fuzz_nets seed 1582's): the ReLU's zeros are one value in
// x_norm_, -mean / std, and sz reconstructs such a run with one common error: a mean and a
// component along x_norm_ far above the eb / sqrt(3 n) of independent errors, at 576 values a
// channel; a global average pooling above makes BatchNorm's output gradient nearly constant
// over a channel, which meets that error's mean. Only x_norm_ is lossy, FIXED 0.2: conv1's weight
// gradient 11.5% off COMET off's with neither correction, 1.1% with x_norm_ moved back to its
// moments and the gradient centred (11.6% as before 2026-12-07's third session, when the move was
// made only below n eb^2 = 12: here the centring alone; 1.2% since the zeros are stored exact,
// CheckBatchNormTiesShifted). `reshaped`: the BatchNorm on a 3-axis
// view of the ReLU's output: 14.2% and 1.4% (14.3% corrected when the ties were not
// looked for through the Reshape, scripts/fuzz_nets seed 314's kind).
void CometStoreTest::CheckBatchNormAfterRelu(bool reshaped) {
  const std::string net =
      "name: 'ties' " + kFuzzInput +
      ReluOfConv1(6) +
      (reshaped ? BatchNormOnAView("conv1", "bn1")
                : "layer { name: 'bn1' type: 'BatchNorm' bottom: 'conv1' top: 'bn1' } ") +
      "layer { name: 'pool1' type: 'Pooling' bottom: 'bn1' top: 'pool1' pooling_param { "
      "pool: AVE global_pooling: true } } "
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'pool1' top: 'ip' inner_product_param { "
      "num_output: 5 weight_filler { type: 'gaussian' std: 0.3 } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  double errors[2];
  CorrectedBatchNormErrors(net, "eb_mode: FIXED error_bound: 0.2", "0.01", errors);
  EXPECT_GT(errors[0], 0.1) << "conv1's weight gradient from BatchNorm's own backward";
  EXPECT_LT(errors[1], errors[0] / 3) << "conv1's, with x_norm_ at its exact moments";
}
TEST_F(CometStoreTest, ABatchNormAfterAReluReadsItsXNormAtItsExactMoments) {
  CheckBatchNormAfterRelu(false);
}
TEST_F(CometStoreTest, ABatchNormOnAReshapedReluOutputReadsItsXNormAtItsExactMoments) {
  CheckBatchNormAfterRelu(true);
}

// A ReLU, then BatchNorm, of which one channel alone goes on (scripts/fuzz_nets seed 314's kind):
// a quarter of that channel's values are the ReLU's zeros, one value of x_norm_, and conv1's
// weight gradient meets their common error through the ReLU's mask below. Moving x_norm_ back to
// its moments leaves much of it; stored less that value, the zeros come back exact. Only x_norm_
// is lossy, FIXED 0.25: conv1's weight gradient 3.0% off COMET off's with neither correction,
// 1.4% moved and centred with the zeros lossy (before the shift), 0.57% with them exact.
void CometStoreTest::CheckBatchNormTiesShifted() {
  const std::string net =
      "name: 'ties' " + kFuzzInput +
      ReluOfConv1(4) +
      "layer { name: 'bn1' type: 'BatchNorm' bottom: 'conv1' top: 'bn1' } "
      "layer { name: 'slice1' type: 'Slice' bottom: 'bn1' top: 'rest' top: 'last' "
      "slice_param { axis: 1 slice_point: 3 } } "
      "layer { name: 'silence1' type: 'Silence' bottom: 'rest' } "
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'last' top: 'ip' inner_product_param { "
      "num_output: 5 weight_filler { type: 'gaussian' std: 0.12 } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  double errors[2];
  CorrectedBatchNormErrors(net, "eb_mode: FIXED error_bound: 0.25", "0.01", errors);
  EXPECT_GT(errors[0], 0.02) << "conv1's weight gradient from BatchNorm's own backward";
  EXPECT_LT(errors[1], errors[0] / 4) << "conv1's, with the ReLU's zeros exact in x_norm_";
}
TEST_F(CometStoreTest, ABatchNormAfterAReluStoresItsZerosExact) {
  CheckBatchNormTiesShifted();
}

// glog's lines that contain `text`, with their severity, as a sink receives them.
class CometLogLines : public google::LogSink {
 public:
  explicit CometLogLines(const std::string& text) : text_(text) { google::AddLogSink(this); }
  ~CometLogLines() { google::RemoveLogSink(this); }
  void send(google::LogSeverity severity, const char*, const char*, int, const struct ::tm*,
            const char* message, size_t length) override {
    const std::string line(message, length);
    if (line.find(text_) == std::string::npos) return;
    std::lock_guard<std::mutex> lock(mutex_);
    lines_.push_back(std::make_pair(severity, line));
  }
  std::vector<std::pair<google::LogSeverity, std::string> > Take() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::pair<google::LogSeverity, std::string> > out;
    out.swap(lines_);
    return out;
  }

 private:
  std::string text_;
  std::mutex mutex_;
  std::vector<std::pair<google::LogSeverity, std::string> > lines_;
};

// With `debug_info: true` a step logs each layer's bottom diffs after its backward; the layers
// whose backward the store computes itself (ReLU from its mask, max pooling from its codes)
// log theirs too, as without COMET: the same lines, with the same figures on the first step
// (their input gradients do not depend on what is stored lossy in this net).
TEST_F(CometStoreTest, DebugInfoLogsTheBackwardOfLayersTheStoreComputes) {
  std::vector<std::string> lines[2];
  for (int on = 0; on < 2; ++on) {
    shared_ptr<Solver<float> > s = MakeSolver(
        on ? "debug_info: true comet { eb_mode: FIXED error_bound: 1e-3 }" : "debug_info: true");
    CometLogLines sink("    [Backward] Layer ");
    Run(s.get(), 1);
    const std::vector<std::pair<google::LogSeverity, std::string> > taken = sink.Take();
    for (int i = 0; i < taken.size(); ++i) lines[on].push_back(taken[i].second);
  }
  // Every line, in the same order; the bottom diffs' figures the same (the weights' gradients
  // read lossy inputs: theirs differ in the last digits).
  ASSERT_EQ(lines[1].size(), lines[0].size());
  for (int i = 0; i < lines[0].size(); ++i) {
    const size_t at = lines[0][i].find(" diff: ");
    ASSERT_NE(at, std::string::npos) << lines[0][i];
    if (lines[0][i].find(", bottom blob ") != std::string::npos) {
      EXPECT_EQ(lines[1][i], lines[0][i]);
    } else {
      EXPECT_EQ(lines[1][i].substr(0, at), lines[0][i].substr(0, at));
    }
  }
  int skipped_by_net = 0;
  for (int i = 0; i < lines[1].size(); ++i)
    skipped_by_net += lines[1][i].find("Layer relu1, bottom blob conv1 diff: ") != std::string::npos ||
                      lines[1][i].find("Layer pool1, bottom blob conv1 diff: ") != std::string::npos;
  EXPECT_EQ(skipped_by_net, 2);
}

// With iter_size above 1 a step measures its bounds on its first pass alone, where the weights'
// gradient is that pass's own: the later passes add theirs to it, and the rules took the sum for
// one batch's gradient (a larger target, a bound that could double once a pass). The first pass
// of both solvers sees the same batch and weights, so the bounds are iter_size 1's, bit for bit.
TEST_F(CometStoreTest, IterSizeMeasuresTheBoundsOnTheFirstPassOfAStep) {
  const std::string block =
      "comet { eb_mode: ADAPTIVE error_bound: 1e-1 update_interval: 2 adaptive_target: 0.01 "
      "min_error_bound: 1e-6 max_error_bound: 1 }";
  shared_ptr<Solver<float> > one = MakeSolver(block);
  shared_ptr<Solver<float> > two = MakeSolver("iter_size: 2 " + block);
  Run(one.get(), 1);
  Run(two.get(), 1);
  ASSERT_EQ(one->comet()->bounds().size(), two->comet()->bounds().size());
  int moved = 0;
  for (int e = 0; e < one->comet()->bounds().size(); ++e) {
    EXPECT_EQ(one->comet()->bounds()[e].eb, two->comet()->bounds()[e].eb) << "bound " << e;
    moved += one->comet()->bounds()[e].eb != 1e-1f;
  }
  EXPECT_GT(moved, 0) << "no bound was measured";
}

// -gpu all: every solver restores the root's snapshot. The root's random generators go back to
// where they were; another rank's stay as its own seed (random_seed + rank) made them, or every
// GPU would draw the root's numbers after a resume.
TEST_F(CometStoreTest, OnlyTheRootSolverTakesTheSavedRandomGenerators) {
  shared_ptr<Solver<float> > a = MakeSolver("comet { eb_mode: FIXED error_bound: 1e-3 }");
  Run(a.get(), 3);
  a->Snapshot();
  std::ostringstream saved;
  saved << *caffe_rng();
  const std::string state = prefix_ + "_iter_3.solverstate";
  for (int rank = 0; rank < 2; ++rank) {
    Caffe::set_solver_rank(rank);
    shared_ptr<Solver<float> > b = MakeSolver("comet { eb_mode: FIXED error_bound: 1e-3 }");
    std::ostringstream own;
    own << *caffe_rng();
    b->Restore(state.c_str());
    std::ostringstream now;
    now << *caffe_rng();
    Caffe::set_solver_rank(0);
    EXPECT_EQ(b->iter(), 3);
    EXPECT_NE(own.str(), saved.str());
    EXPECT_EQ(now.str(), rank == 0 ? saved.str() : own.str()) << "rank " << rank;
  }
}

// A net of Sigmoid, TanH and ELU (upstream's CIFAR-10 Sigmoid example and autoencoders use the
// first): their outputs, which their backward reads, are stored lossy under the derivative rule
// (ELU's with its sign mask), whose bounds move with adaptive_target as the weight rule's do;
// training stays close to COMET off.
void CometStoreTest::CheckOutputDerivatives() {
  const std::string net = ActivationNet(
      "sig", "layer { name: 'sig1' type: 'Sigmoid' bottom: 'conv1' top: 'sig1' } ", "sig1",
      "layer { name: 'tanh2' type: 'TanH' bottom: 'conv2' top: 'conv2' } ", "conv2",
      "layer { name: 'elu3' type: 'ELU' bottom: 'pool' top: 'pool' } ");
  const char* layers[] = {"sig1", "tanh2", "elu3"};
  // sig1 and conv2's blob (64 KB each) dense through the step, or compressed
  CheckAdaptiveBounds(net, std::vector<std::string>(layers, layers + 3), 64 * 1024);
}

// Layers of `net` whose lossy reads have a rule of their own (`layers`: the derivative rule of
// those whose backward reads their output or input, or the weight rule): the blobs they read are
// stored lossy under bounds that move with adaptive_target (linearly: 4x the target, 4x the
// bound); training stays close to COMET off; the activations' peak is at least `saved` bytes below
// that of a store keeping them dense (only convolutions and inner products lossy).
void CometStoreTest::CheckAdaptiveBounds(const std::string& net,
                                         const std::vector<std::string>& layers, double saved) {
  const std::string adaptive =
      "eb_mode: ADAPTIVE error_bound: 1e-1 update_interval: 1 min_error_bound: 1e-6 ";
  shared_ptr<Solver<float> > off = SolverFor(net, "", "0.01");
  shared_ptr<Solver<float> > tight =
      SolverFor(net, "comet { " + adaptive + "adaptive_target: 0.01 }", "0.01");
  shared_ptr<Solver<float> > loose =
      SolverFor(net, "comet { " + adaptive + "adaptive_target: 0.04 }", "0.01");
  shared_ptr<Solver<float> > dense = SolverFor(
      net, "comet { " + adaptive + "adaptive_target: 0.01 compress_type: 'Convolution' "
           "compress_type: 'InnerProduct' }", "0.01");
  Run(off.get(), 4);
  Run(tight.get(), 4);
  Run(loose.get(), 4);
  Run(dense.get(), 4);
  for (int i = 0; i < layers.size(); ++i) {
    const float eb = tight->comet()->bound(layers[i]);
    EXPECT_NE(eb, 1e-1f) << layers[i] << ": the rule never moved the bound";
    const double ratio = loose->comet()->bound(layers[i]) / eb;
    EXPECT_GT(ratio, 3.5) << layers[i] << " at " << eb << ": the rule is linear in the target";
    EXPECT_LT(ratio, 4.5) << layers[i] << " at " << eb;
    EXPECT_EQ(dense->comet()->bound(layers[i]), -1.f) << layers[i] << " has no bound when kept";
  }
  const std::vector<float> a = Params(off.get()), b = Params(tight.get());
  double d = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d += (a[i] - b[i]) * (a[i] - b[i]);
    n += a[i] * a[i];
  }
  EXPECT_GT(d, 0) << "lossy storage had no effect at all?";
  EXPECT_LT(std::sqrt(d / n), 2e-3) << "weights after 4 steps, relative to COMET off";
  EXPECT_LE(tight->comet()->memory().peak[CometMemory::ACTIVATIONS] + saved,
            dense->comet()->memory().peak[CometMemory::ACTIVATIONS]);
}

// Exp (a VAE's standard deviation from its log-variance) and Softmax that is not a loss's (an
// attention map over channels): their outputs, read by their own backward, are stored lossy
// under the derivative rule, as Sigmoid's are. They used to be kept dense.
void CometStoreTest::CheckExpAndSoftmax() {
  const std::string net = ActivationNet(
      "expsoft",
      "layer { name: 'exp1' type: 'Exp' bottom: 'conv1' top: 'exp1' exp_param { scale: 0.5 } } ",
      "exp1", "layer { name: 'soft2' type: 'Softmax' bottom: 'conv2' top: 'soft2' } ", "soft2");
  const char* layers[] = {"exp1", "soft2"};
  // exp1 and soft2 (128 KB each) dense through the step, or compressed
  CheckAdaptiveBounds(net, std::vector<std::string>(layers, layers + 2), 128 * 1024);
}

// BatchNorm without Scale (upstream's CIFAR-10 Sigmoid example): x_norm_ is read by BatchNorm's
// backward alone, under its own rule, whose estimate takes the errors as independent of the
// values. At a bound near x_norm_'s spread (1) they are not, and the layers below took weight
// gradients 37% off at a 5% target; the bound stays within a quarter of the spread.
TEST_F(CometStoreTest, BatchNormAloneKeepsTheWeightGradientsBelowItNearTheTarget) {
  std::string net =
      "name: 'bn' layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
      "dummy_data_param { shape { dim: 16 dim: 3 dim: 16 dim: 16 } shape { dim: 16 } "
      "data_filler { type: 'gaussian' std: 1 } data_filler { type: 'uniform' min: 0 max: 3.99 } } } ";
  const char* body[] = {"conv1", "data", "conv2", "sig1"};
  for (int k = 0; k < 2; ++k) {
    const std::string c = body[2 * k], in = body[2 * k + 1], n = k ? "2" : "1";
    net += "layer { name: '" + c + "' type: 'Convolution' bottom: '" + in + "' top: '" + c +
           "' convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "
           "'gaussian' std: 0.2 } } } "
           "layer { name: 'pool" + n + "' type: 'Pooling' bottom: '" + c + "' top: 'pool" + n +
           "' pooling_param { pool: MAX kernel_size: 2 stride: 2 } } "
           "layer { name: 'bn" + n + "' type: 'BatchNorm' bottom: 'pool" + n + "' top: 'bn" + n +
           "' } layer { name: 'sig" + n + "' type: 'Sigmoid' bottom: 'bn" + n + "' top: 'sig" +
           n + "' } ";
  }
  net += "layer { name: 'ip' type: 'InnerProduct' bottom: 'sig2' top: 'ip' inner_product_param { "
         "num_output: 4 weight_filler { type: 'gaussian' std: 0.1 } } } "
         "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  shared_ptr<Solver<float> > on = SolverFor(
      net, "comet { eb_mode: ADAPTIVE update_interval: 1 release_diffs: false }", "0.05");
  shared_ptr<Solver<float> > off = SolverFor(net, "", "0.05");
  Run(on.get(), 6);
  for (int n = 1; n <= 2; ++n) {
    const std::string bn = "bn" + std::string(n == 1 ? "1" : "2");
    EXPECT_LE(on->comet()->bound(bn), 1.05 * kCometBoundPerStoredStd) << bn << ": x_norm_'s std is 1";
  }
  // One more step's gradients from the same weights and batch, COMET on and off.
  StepBothFromTheSameWeights(on.get(), off.get());
  for (int i = 0; i < 2; ++i) {
    const double error = WeightGradientError(on.get(), off.get(), body[2 * i]);
    ASSERT_GE(error, 0) << body[2 * i];
    // twice the target (errors from several rules add up); 10% and 16% without the cap
    EXPECT_LT(error, 0.1) << body[2 * i] << "'s weight gradient, at a target of 5%";
  }
}

// BatchNorm right after a Convolution whose inputs have a mean far above their spread (3 and
// 0.05): the exact input gradient of BatchNorm sums to 0 over each channel, so the convolution's
// weight gradient never meets that mean; from a lossy x_norm_ it would not (its errors' mean
// times mean(dy y) in every value), and the mean multiplies it. The store takes each channel's
// mean out again: conv1's weight gradient 0.26% off COMET off's, 4.9% with
// centre_batchnorm_gradients: false (the largest channel sums 2e-8 and 1.6e-4);
// scripts/fuzz_nets seed 718: 29% -> 5%.
void CometStoreTest::CheckCentredBatchNormGradients() {
  const std::string net =
      "name: 'centre' layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
      "dummy_data_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 } "
      "data_filler { type: 'gaussian' mean: 3 std: 0.05 } "
      "data_filler { type: 'uniform' min: 0 max: 3.99 } } } "
      "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' convolution_param { "
      "num_output: 8 kernel_size: 3 weight_filler { type: 'gaussian' std: 0.2 } } } "
      "layer { name: 'bn1' type: 'BatchNorm' bottom: 'conv1' top: 'bn1' } "
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'bn1' top: 'ip' inner_product_param { "
      "num_output: 4 weight_filler { type: 'gaussian' std: 0.1 } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  const std::string fixed = "comet { eb_mode: FIXED error_bound: 0.02 release_diffs: false ";
  shared_ptr<Solver<float> > off = SolverFor(net, "", "0.05");
  double sums[2], errors[2];
  for (int centred = 0; centred < 2; ++centred) {
    shared_ptr<Solver<float> > on = SolverFor(
        net, fixed + (centred ? "}" : "centre_batchnorm_gradients: false }"), "0.05");
    Run(on.get(), 2);
    StepBothFromTheSameWeights(on.get(), off.get());
    EXPECT_GT(on->comet()->bound("bn1"), 0) << "x_norm_ is stored lossy";
    const Blob<float>& dx = *on->net()->blob_by_name("conv1");
    const int N = dx.shape(0), C = dx.shape(1), S = dx.count(2);
    sums[centred] = 0;  // the largest channel's sum over its RMS times its count
    for (int c = 0; c < C; ++c) {
      double sum = 0, sq = 0;
      for (int n = 0; n < N; ++n)
        for (int i = 0; i < S; ++i) {
          const double g = dx.cpu_diff()[(n * C + c) * S + i];
          sum += g;
          sq += g * g;
        }
      sums[centred] = std::max(sums[centred], std::fabs(sum) / std::sqrt(sq * N * S));
    }
    errors[centred] = WeightGradientError(on.get(), off.get(), "conv1");
    ASSERT_GE(errors[centred], 0);
  }
  EXPECT_GT(sums[0], 1e-5) << "the errors leave a mean in this net";
  EXPECT_LT(sums[1], 1e-5);
  EXPECT_GT(errors[0], 0.02) << "conv1's weight gradient from the uncentred BatchNorm gradient";
  EXPECT_LT(errors[1], 0.01) << "conv1's weight gradient, relative to COMET off";
}
TEST_F(CometStoreTest, BatchNormsInputGradientFromALossyXNormSumsToZeroOverEachChannel) {
  CheckCentredBatchNormGradients();
}

// A fixed bound is set by no rule, but the first step estimates the gradient error it gives, as
// ADAPTIVE would, and says it once: a warning where that is far off. Here a Convolution before a
// BatchNorm reads values of mean 3 and spread 0.01 (scripts/fuzz_nets seed 800's class): at FIXED
// 0.02 the values vary by less than the bound and conv1's weight gradient is far off (the
// warning is right: measured against COMET off), at 1e-4 it is close and the log says so in an
// INFO line.
void CometStoreTest::CheckFixedBoundEstimate() {
  const std::string net =
      "name: 'narrow' layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
      "dummy_data_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 } "
      "data_filler { type: 'gaussian' std: 1 } "
      "data_filler { type: 'uniform' min: 0 max: 3.99 } } } "
      "layer { name: 'narrow' type: 'Power' bottom: 'data' top: 'narrow' "
      "power_param { scale: 0.01 shift: 3 } } "
      "layer { name: 'conv1' type: 'Convolution' bottom: 'narrow' top: 'conv1' convolution_param { "
      "num_output: 8 kernel_size: 3 weight_filler { type: 'gaussian' std: 0.2 } } } "
      "layer { name: 'bn1' type: 'BatchNorm' bottom: 'conv1' top: 'bn1' } "
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'bn1' top: 'ip' inner_product_param { "
      "num_output: 4 weight_filler { type: 'gaussian' std: 0.1 } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  shared_ptr<Solver<float> > off = SolverFor(net, "", "0.05");
  const char* bounds[] = {"0.02", "1e-4"};
  for (int k = 0; k < 2; ++k) {
    shared_ptr<Solver<float> > on = SolverFor(
        net, std::string("comet { eb_mode: FIXED release_diffs: false error_bound: ") + bounds[k] +
        " }", "0.05");
    CometLogLines log("'s fixed error bound");
    Run(on.get(), 3);
    const std::vector<std::pair<google::LogSeverity, std::string> > lines = log.Take();
    int conv1 = 0, warned = 0;
    for (int i = 0; i < lines.size(); ++i) {
      if (lines[i].second.find("layer conv1's") == std::string::npos) continue;
      ++conv1;
      warned += lines[i].first == google::GLOG_WARNING;
    }
    EXPECT_EQ(conv1, 1) << "one line for conv1's bound " << bounds[k] << " in three steps";
    EXPECT_EQ(warned, k == 0 ? 1 : 0) << "conv1's bound " << bounds[k];
    StepBothFromTheSameWeights(on.get(), off.get());
    const double error = WeightGradientError(on.get(), off.get(), "conv1");
    ASSERT_GE(error, 0);
    if (k == 0) EXPECT_GT(error, kCometFixedBoundWarning) << "warned of, and far off";
    else EXPECT_LT(error, 0.05) << "not warned of, and close";
  }
}
TEST_F(CometStoreTest, AFixedBoundEstimatedFarOffIsWarnedOnceAndIsFarOff) {
  CheckFixedBoundEstimate();
}

// A PReLU whose output only a Reduction loss reads: its slope gradient sums a gradient of one
// sign over each channel's 2048 values, so the independent estimate (PReLU's slope has no sampled
// curve) allows a bound near the values themselves, where sz's errors follow the values and add
// up. The bound stays within a quarter of its input's spread and the slope gradient near the
// target; without that cap the bound reached max_error_bound and the gradient was 16% off in the
// same net at batch 4 (scripts/fuzz_nets seed 70).
TEST_F(CometStoreTest, APReLUUnderAGradientOfOneSignKeepsItsBoundWithinItsInputsSpread) {
  const std::string net =
      "name: 'prelu_sum' layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
      "dummy_data_param { shape { dim: 8 dim: 3 dim: 16 dim: 16 } shape { dim: 8 } "
      "data_filler { type: 'gaussian' std: 1 } data_filler { type: 'uniform' min: 0 max: 3.99 } } } "
      "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' convolution_param { "
      "num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: 'gaussian' std: 0.3 } "
      "bias_filler { type: 'constant' value: 0.1 } } } "
      "layer { name: 'prelu1' type: 'PReLU' bottom: 'conv1' top: 'p1' } "
      "layer { name: 'sum' type: 'Reduction' bottom: 'p1' top: 'sum' "
      "reduction_param { operation: SUM axis: 0 } loss_weight: 0.0005 } "
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'conv1' top: 'ip' inner_product_param { "
      "num_output: 4 weight_filler { type: 'gaussian' std: 0.05 } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  shared_ptr<Solver<float> > on = SolverFor(
      net, "comet { eb_mode: ADAPTIVE update_interval: 1 }", "0.01");
  shared_ptr<Solver<float> > off = SolverFor(net, "", "0.01");
  Run(on.get(), 4);
  StepBothFromTheSameWeights(on.get(), off.get());
  const Blob<float>& x = *off->net()->blob_by_name("conv1");
  double sum = 0, sq = 0;
  for (int i = 0; i < x.count(); ++i) {
    sum += x.cpu_data()[i];
    sq += static_cast<double>(x.cpu_data()[i]) * x.cpu_data()[i];
  }
  const double spread = std::sqrt(sq / x.count() - (sum / x.count()) * (sum / x.count()));
  const float eb = on->comet()->bound("prelu1");
  EXPECT_GT(eb, 0.1 * spread) << "the bound should be near its cap here";
  EXPECT_LE(eb, 1.1 * kCometBoundPerStoredStd * spread) << "conv1's spread " << spread;
  const double error = WeightGradientError(on.get(), off.get(), "prelu1");
  ASSERT_GE(error, 0);
  EXPECT_LT(error, 0.1) << "prelu1's slope gradient, at a target of 5%";
}

// PReLU, in place (its copy of the input stored lossy) and not (its input blob stored lossy), with
// the signs kept exact beside the streams: PReLU's input gradient dy (x > 0 ? 1 : a) depends on
// the signs alone, so every data gradient of a step is bit for bit COMET off's, while the weight
// and slope gradients (from lossy values) differ a little.
void CometStoreTest::CheckPReLU() {
  const std::string net =
      "name: 'prelu' layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
      "dummy_data_param { shape { dim: 8 dim: 3 dim: 16 dim: 16 } shape { dim: 8 } "
      "data_filler { type: 'gaussian' std: 1 } data_filler { type: 'uniform' min: 0 max: 3.99 } } } "
      "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' convolution_param { "
      "num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: 'gaussian' std: 0.2 } } } "
      "layer { name: 'prelu1' type: 'PReLU' bottom: 'conv1' top: 'conv1' } "
      "layer { name: 'conv2' type: 'Convolution' bottom: 'conv1' top: 'conv2' convolution_param { "
      "num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: 'gaussian' std: 0.2 } } } "
      "layer { name: 'prelu2' type: 'PReLU' bottom: 'conv2' top: 'p2' "
      "prelu_param { channel_shared: true } } "
      "layer { name: 'pool' type: 'Pooling' bottom: 'p2' top: 'pool' pooling_param { pool: MAX "
      "kernel_size: 2 stride: 2 } } "
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'pool' top: 'ip' inner_product_param { "
      "num_output: 4 weight_filler { type: 'gaussian' std: 0.1 } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  shared_ptr<Solver<float> > off = SolverFor(net, "", "0.01");
  shared_ptr<Solver<float> > on = SolverFor(
      net, "comet { eb_mode: ADAPTIVE update_interval: 1 release_diffs: false tiled_gemm: false }",
      "0.01");
  shared_ptr<Solver<float> > dense = SolverFor(
      net, "comet { eb_mode: ADAPTIVE update_interval: 1 compress_type: 'Convolution' "
           "compress_type: 'InnerProduct' tiled_gemm: false }", "0.01");
  Run(off.get(), 3);
  Run(on.get(), 3);
  Run(dense.get(), 3);
  // what the store did with them
  int lossy_signed = 0;
  for (int e = 0; e < on->comet()->entries().size(); ++e) {
    const CometStore<float>::Entry& en = on->comet()->entries()[e];
    if (en.blob == "prelu1 copy" || en.blob == "conv2") {
      EXPECT_EQ(en.action, CometStore<float>::LOSSY) << en.blob;
      EXPECT_TRUE(en.signs) << en.blob;
      lossy_signed += en.action == CometStore<float>::LOSSY && en.signs;
    }
  }
  EXPECT_EQ(lossy_signed, 2) << "prelu1's copy and prelu2's input, each with its sign mask";
  EXPECT_LT(on->comet()->memory().peak[CometMemory::ACTIVATIONS],
            dense->comet()->memory().peak[CometMemory::ACTIVATIONS]);
  // One more step from the same weights and batch: data gradients exact, weight gradients close.
  StepBothFromTheSameWeights(on.get(), off.get());
  const char* blobs[] = {"conv1", "conv2", "p2"};
  for (int b = 0; b < 3; ++b) {
    const Blob<float>* x = on->net()->blob_by_name(blobs[b]).get();
    const Blob<float>* y = off->net()->blob_by_name(blobs[b]).get();
    for (int i = 0; i < x->count(); ++i)
      ASSERT_EQ(x->cpu_diff()[i], y->cpu_diff()[i]) << "gradient of " << blobs[b] << " at " << i;
  }
  const char* layers[] = {"prelu1", "prelu2", "conv2"};
  for (int l = 0; l < 3; ++l) {
    const double error = WeightGradientError(on.get(), off.get(), layers[l]);
    EXPECT_GT(error, 0) << layers[l] << ": its input was lossy, its gradient cannot be exact";
    EXPECT_LT(error, 0.1) << layers[l] << " at " << on->comet()->bound(layers[l]);
  }
}

TEST_F(CometStoreTest, PReLUInputsAreLossyWithExactSigns) { CheckPReLU(); }

// LRN within a channel (upstream's CIFAR-10 full net: after max pooling and ReLU, and after
// average pooling) runs internal layers whose outputs (the squares, their window means, the
// scale s^-beta) and gradients are each as large as its input, and its backward never reads its
// output. Its input is stored lossy under LRN's rule. The store computes the backward from the
// input (CPU and GPU: lossless training agrees with COMET off's to float rounding), the internal
// outputs go right after the forward and the gradients are never allocated, recompute_lrn or not.
void CometStoreTest::CheckLrnWithinChannel() {
  const std::string net =
      "name: 'lcn' layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
      "dummy_data_param { shape { dim: 8 dim: 3 dim: 16 dim: 16 } shape { dim: 8 } "
      "data_filler { type: 'gaussian' std: 1 } data_filler { type: 'uniform' min: 0 max: 3.99 } } } "
      "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' convolution_param { "
      "num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: 'gaussian' std: 0.2 } "
      "bias_filler { type: 'constant' value: 0.1 } } } "
      "layer { name: 'pool1' type: 'Pooling' bottom: 'conv1' top: 'pool1' "
      "pooling_param { pool: MAX kernel_size: 3 stride: 2 } } "
      "layer { name: 'relu1' type: 'ReLU' bottom: 'pool1' top: 'pool1' } "
      "layer { name: 'norm1' type: 'LRN' bottom: 'pool1' top: 'norm1' lrn_param { local_size: 3 "
      "alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL engine: CAFFE } } "
      "layer { name: 'conv2' type: 'Convolution' bottom: 'norm1' top: 'conv2' convolution_param { "
      "num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: 'gaussian' std: 0.2 } "
      "bias_filler { type: 'constant' value: 0.1 } } } "
      "layer { name: 'relu2' type: 'ReLU' bottom: 'conv2' top: 'conv2' } "
      "layer { name: 'pool2' type: 'Pooling' bottom: 'conv2' top: 'pool2' "
      "pooling_param { pool: AVE kernel_size: 3 stride: 2 } } "
      "layer { name: 'norm2' type: 'LRN' bottom: 'pool2' top: 'norm2' lrn_param { local_size: 3 "
      "alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL engine: CAFFE } } "
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'norm2' top: 'ip' inner_product_param { "
      "num_output: 4 weight_filler { type: 'gaussian' std: 0.1 } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  const char* parts[] = {"squares", "means", "scale"};
  shared_ptr<Solver<float> > off = SolverFor(net, "", "0.01");
  Run(off.get(), 4);
  const std::vector<float> reference = Params(off.get());
  for (int recompute = 0; recompute < 2; ++recompute) {
    const std::string block = std::string("comet { compress_type: 'None' recompute_lrn: ") +
                              (recompute ? "true" : "false") + " }";
    shared_ptr<Solver<float> > exact = SolverFor(net, block, "0.01");
    Run(exact.get(), 4);
    // The store computes LRN's backward from its input in another order than upstream's chain:
    // float rounding apart.
    const std::vector<float> got = Params(exact.get());
    ASSERT_EQ(got.size(), reference.size());
    double d = 0, r = 0;
    for (int i = 0; i < got.size(); ++i) {
      d += (got[i] - reference[i]) * (got[i] - reference[i]);
      r += reference[i] * reference[i];
    }
    EXPECT_LT(std::sqrt(d / r), 1e-6) << block;
    int recomputed = 0;
    for (int e = 0; e < exact->comet()->entries().size(); ++e) {
      const CometStore<float>::Entry& en = exact->comet()->entries()[e];
      if (en.layer < 0 || en.name.substr(0, 4) != "norm") continue;
      EXPECT_EQ(en.action, CometStore<float>::RECOMPUTE) << en.blob;
      EXPECT_EQ(en.blob, en.name + " " + parts[en.part]);
      EXPECT_TRUE(en.unread) << en.blob;
      recomputed += en.action == CometStore<float>::RECOMPUTE;
    }
    EXPECT_EQ(recomputed, 6) << "three internal outputs of each of norm1 and norm2";
    // Between forward and backward the internal outputs hold nothing (recompute_lrn or not);
    // after the backward neither they nor the internal gradients do.
    caffe::Net<float>* n = exact->net().get();
    Layer<float>* norm1 = n->layer_by_name("norm1").get();
    n->ClearParamDiffs();
    n->Forward();
    for (int p = 0; p < 3; ++p) {
      EXPECT_EQ(CometLayerAccess<float>::lrn_recomputed(norm1, p)->data()->head(),
                SyncedMemory::UNINITIALIZED)
          << block << ": " << parts[p];
    }
    // a read of one before the next forward is refused, naming it, not given zeros
    const std::string what = FatalMessageOf([&]() {
      CometLayerAccess<float>::lrn_recomputed(norm1, 1)->cpu_data();
    });
    EXPECT_NE(what.find("buffer 'norm1 means' was freed"), std::string::npos) << what;
    n->Backward();
    for (int p = 0; p < 3; ++p) {
      EXPECT_EQ(CometLayerAccess<float>::lrn_recomputed(norm1, p)->data()->head(),
                SyncedMemory::UNINITIALIZED)
          << block << ": " << parts[p];
    }
    const std::vector<Blob<float>*> diffs = CometLayerAccess<float>::lrn_internal_diffs(norm1);
    ASSERT_EQ(diffs.size(), 5);
    for (int d = 0; d < diffs.size(); ++d)
      EXPECT_EQ(diffs[d]->diff()->head(), SyncedMemory::UNINITIALIZED) << block << ": diff " << d;
    // A second backward without a forward (pycaffe) computes them again: the same gradients.
    Blob<float>* w = n->layer_by_name("conv1")->blobs()[0].get();
    const std::vector<float> first(w->cpu_diff(), w->cpu_diff() + w->count());
    n->ClearParamDiffs();
    n->Backward();
    EXPECT_EQ(MaxAbsDiff(first.data(), w->cpu_diff(), w->count()), 0.f) << block;
  }

  // Lossy: LRN's input (pool1 with relu1's signs, pool2) and output (read by conv2 and ip) are
  // stored, not kept; the weight gradients stay near COMET off's.
  shared_ptr<Solver<float> > on = SolverFor(
      net, "comet { eb_mode: ADAPTIVE update_interval: 1 tiled_gemm: false }", "0.01");
  shared_ptr<Solver<float> > dense = SolverFor(
      net, "comet { eb_mode: ADAPTIVE update_interval: 1 compress_type: 'Convolution' "
           "compress_type: 'InnerProduct' tiled_gemm: false }", "0.01");
  Run(on.get(), 3);
  Run(dense.get(), 3);
  std::map<std::string, const CometStore<float>::Entry*> by_blob;
  for (int e = 0; e < on->comet()->entries().size(); ++e)
    by_blob[on->comet()->entries()[e].blob] = &on->comet()->entries()[e];
  const char* lossy[] = {"pool1", "norm1", "pool2", "norm2"};
  for (int b = 0; b < 4; ++b) {
    ASSERT_TRUE(by_blob.count(lossy[b])) << lossy[b];
    EXPECT_EQ(by_blob[lossy[b]]->action, CometStore<float>::LOSSY) << lossy[b];
  }
  EXPECT_TRUE(by_blob["pool1"]->signs) << "relu1 reads pool1's signs";
  EXPECT_LT(on->comet()->memory().peak[CometMemory::ACTIVATIONS],
            dense->comet()->memory().peak[CometMemory::ACTIVATIONS]);
  StepBothFromTheSameWeights(on.get(), off.get());
  const char* layers[] = {"conv1", "conv2", "ip"};
  for (int l = 0; l < 3; ++l) {
    const double error = WeightGradientError(on.get(), off.get(), layers[l]);
    EXPECT_GT(error, 0) << layers[l] << ": its input, or a gradient through LRN, was lossy";
    EXPECT_LT(error, 0.1) << layers[l];
  }
  EXPECT_NE(on->comet()->bound("norm1"), 1e-3f) << "norm1's bound follows conv2's, which adapts";
}

TEST_F(CometStoreTest, LRNWithinAChannelStoresItsInputAndRecomputesItsInternals) {
  CheckLrnWithinChannel();
}

// Swish (EfficientNet's activation) not in place computes its backward from its input (patch
// 0038): the input is stored lossy under the derivative rule, its output is left to the next
// layer's reads, and its sigmoid's input and output (each as large as the input) are freed after
// the forward. Before, the output and both sigmoid buffers stayed dense through the step. In
// place it computes it from its sigmoid's input (beta x), which is stored lossy the same way, and
// its output and sigmoid output go to the next layer's reads or are freed.
void CometStoreTest::CheckSwish() {
  const std::string net = ActivationNet(
      "swish", "layer { name: 'swish1' type: 'Swish' bottom: 'conv1' top: 'swish1' } ", "swish1",
      "layer { name: 'swish2' type: 'Swish' bottom: 'conv2' top: 'conv2' swish_param { beta: 1.5 } } ",
      "conv2", "layer { name: 'swish3' type: 'Swish' bottom: 'pool' top: 'pool' } ");
  // Lossless: COMET off's weights bit for bit, the sigmoid buffers empty between the passes.
  shared_ptr<Solver<float> > off, exact;
  ASSERT_NO_FATAL_FAILURE(TrainLosslessAndOff(net, &exact, &off));
  int freed = 0, kept = 0;
  for (int e = 0; e < exact->comet()->entries().size(); ++e) {
    const CometStore<float>::Entry& en = exact->comet()->entries()[e];
    if (en.layer < 0 || en.name.substr(0, 5) != "swish") continue;
    if (en.name != "swish1" && en.blob == en.name + " sigmoid_input") {
      EXPECT_EQ(en.action, CometStore<float>::KEEP) << "in place its backward reads it (dense here)";
      ++kept;
      continue;
    }
    EXPECT_EQ(en.action, CometStore<float>::RECOMPUTE) << en.blob;
    EXPECT_TRUE(en.unread) << en.blob;
    ++freed;
  }
  EXPECT_EQ(freed, 4) << "swish1's sigmoid input and output, swish2's and swish3's output";
  EXPECT_EQ(kept, 2) << "the sigmoid input of swish2 and swish3 (in place)";
  caffe::Net<float>* n = exact->net().get();
  n->ClearParamDiffs();
  n->Forward();
  for (int l = 1; l <= 3; ++l) {
    Layer<float>* swish = n->layer_by_name("swish" + std::string(1, '0' + l)).get();
    for (int p = l > 1 ? 1 : 0; p < 2; ++p) {
      EXPECT_EQ(CometLayerAccess<float>::swish_sigmoid(swish, p)->data()->head(),
                SyncedMemory::UNINITIALIZED) << "swish" << l << " part " << p;
    }
  }
  // ... and a read of them before the next forward is refused, naming the buffer
  const std::string what = FatalMessageOf([&]() {
    CometLayerAccess<float>::swish_sigmoid(n->layer_by_name("swish1").get(), 1)->cpu_data();
  });
  EXPECT_NE(what.find("buffer 'swish1 sigmoid_output' was freed"), std::string::npos) << what;
  n->Backward();
  n->Forward();  // writes them again (the marker dropped first), and frees them again after
  EXPECT_TRUE(CometLayerAccess<float>::swish_sigmoid(n->layer_by_name("swish1").get(), 1)
                  ->data()->comet_payload().get() != NULL);
  n->Backward();
  // Lossy: the bounds follow the derivative rule (swish2's on its sigmoid's input); conv1 (128
  // KB) compressed rather than dense.
  const char* layers[] = {"swish1", "swish2"};
  CheckAdaptiveBounds(net, std::vector<std::string>(layers, layers + 2), 128 * 1024);
}

TEST_F(CometStoreTest, SwishStoresItsInputAndFreesItsSigmoidBuffers) { CheckSwish(); }

// MVN keeps temp_, as large as its input, between its forward and its backward, but each pass
// writes all of it before reading it: the store frees it after the forward (a read in between is
// refused) and hands the backward fresh memory, unzeroed. Gradients are COMET off's bit for bit,
// with the variance normalized and without, per channel and across, and for a second Backward().
void CometStoreTest::CheckMVNTemp() {
  const std::string net = ActivationNet(
      "mvn", "layer { name: 'mvn1' type: 'MVN' bottom: 'conv1' top: 'mvn1' } ", "mvn1",
      "layer { name: 'mvn2' type: 'MVN' bottom: 'conv2' top: 'mvn2' mvn_param { "
      "normalize_variance: false across_channels: true } } ", "mvn2");
  shared_ptr<Solver<float> > off, exact;
  ASSERT_NO_FATAL_FAILURE(TrainLosslessAndOff(net, &exact, &off));
  int temps = 0;
  for (int e = 0; e < exact->comet()->entries().size(); ++e) {
    const CometStore<float>::Entry& en = exact->comet()->entries()[e];
    if (en.layer < 0 || en.blob.find(" temp") == std::string::npos) continue;
    EXPECT_EQ(en.action, CometStore<float>::REBUILD) << en.blob;
    EXPECT_TRUE(en.unread) << en.blob;
    EXPECT_EQ(en.last_dense, 8 * 16 * 16 * 16 * sizeof(float)) << en.blob << ": counted as freed";
    ++temps;
  }
  EXPECT_EQ(temps, 2) << "mvn1 temp and mvn2 temp";
  caffe::Net<float>* n = exact->net().get();
  n->ClearParamDiffs();
  Caffe::set_random_seed(77);  // the same data as off's below
  n->Forward();
  for (int l = 1; l <= 2; ++l) {
    Layer<float>* mvn = n->layer_by_name(l == 1 ? "mvn1" : "mvn2").get();
    EXPECT_EQ(CometLayerAccess<float>::rebuildable(mvn)->data()->head(),
              SyncedMemory::UNINITIALIZED) << "mvn" << l;
  }
  const std::string what = FatalMessageOf([&]() {
    CometLayerAccess<float>::rebuildable(n->layer_by_name("mvn2").get())->cpu_data();
  });
  EXPECT_NE(what.find("buffer 'mvn2 temp' was freed"), std::string::npos) << what;
  n->Backward();
  const Blob<float>* w1 = n->layer_by_name("conv1")->blobs()[0].get();
  const std::vector<float> first(w1->cpu_diff(), w1->cpu_diff() + w1->count());
  n->ClearParamDiffs();
  n->Backward();  // a second backward after one forward (pycaffe): temp_ handed out again
  for (int i = 0; i < w1->count(); ++i) ASSERT_EQ(first[i], w1->cpu_diff()[i]) << i;
  off->net()->ClearParamDiffs();
  Caffe::set_random_seed(77);
  off->net()->Forward();
  off->net()->Backward();
  const Blob<float>* o1 = off->net()->layer_by_name("conv1")->blobs()[0].get();
  for (int i = 0; i < w1->count(); ++i) ASSERT_EQ(o1->cpu_diff()[i], first[i]) << i;
}

TEST_F(CometStoreTest, MVNFreesItsTempBetweenThePasses) { CheckMVNTemp(); }

// SENet's block: conv, BatchNorm and Scale in place, then a channel attention (global average,
// InnerProduct, Sigmoid) that a Scale by its second bottom (axis 0: one scale per sample and
// channel) multiplies the block's output with. That Scale reads the block's output only for its
// scale's gradient: stored lossy under the weight rule, which watches the second bottom's gradient
// (before, the block's output was kept dense); the scale itself is read exactly. Lossless
// training is COMET off's bit for bit; lossy, the bound follows the target.
void CometStoreTest::CheckSqueezeExcitation() {
  const std::string net = ActivationNet(
      "se",
      "layer { name: 'bn1' type: 'BatchNorm' bottom: 'conv1' top: 'conv1' } "
      "layer { name: 'sc1' type: 'Scale' bottom: 'conv1' top: 'conv1' scale_param { "
      "bias_term: true } } "
      "layer { name: 'squeeze' type: 'Pooling' bottom: 'conv1' top: 'squeeze' pooling_param { "
      "pool: AVE global_pooling: true } } "
      "layer { name: 'excite' type: 'InnerProduct' bottom: 'squeeze' top: 'excite' "
      "inner_product_param { num_output: 16 weight_filler { type: 'gaussian' std: 0.3 } } } "
      "layer { name: 'gate' type: 'Sigmoid' bottom: 'excite' top: 'excite' } "
      "layer { name: 'se' type: 'Scale' bottom: 'conv1' bottom: 'excite' top: 'se' "
      "scale_param { axis: 0 } } ", "se",
      "layer { name: 'relu2' type: 'ReLU' bottom: 'conv2' top: 'conv2' } ", "conv2");
  shared_ptr<Solver<float> > off, exact;
  ASSERT_NO_FATAL_FAILURE(TrainLosslessAndOff(net, &exact, &off));
  const char* layers[] = {"se"};
  // conv1 (128 KB) compressed (on the CPU rebuilt from bn1's x_norm_) rather than kept dense
  CheckAdaptiveBounds(net, std::vector<std::string>(layers, layers + 1), 128 * 1024);
}

TEST_F(CometStoreTest, AScaleByASecondBottomStoresItsInputLossy) { CheckSqueezeExcitation(); }

// Convolution and Deconvolution keep col_buffer_ (one image's im2col, for a 3x3 kernel nine times
// the input image) for good, one per layer, but each pass writes all of it before reading it and
// layers run one at a time: the store gives them one buffer, as large as the largest of theirs.
// So for a frozen convolution between learning ones (its backward computes only the input's
// gradient), a Deconvolution and a 1x1 convolution (whose backward allocates the buffer without
// using it). Lossless training is COMET off's bit for bit.
void CometStoreTest::CheckConvColumns() {
  const std::string net = ActivationNet(
      "columns",
      "layer { name: 'frozen' type: 'Convolution' bottom: 'conv1' top: 'frozen' "
      "param { lr_mult: 0 } param { lr_mult: 0 } convolution_param { num_output: 8 "
      "kernel_size: 3 pad: 1 weight_filler { type: 'gaussian' std: 0.3 } } } "
      "layer { name: 'up' type: 'Deconvolution' bottom: 'frozen' top: 'up' convolution_param { "
      "num_output: 8 kernel_size: 2 stride: 2 weight_filler { type: 'gaussian' std: 0.3 } } } "
      "layer { name: 'point' type: 'Convolution' bottom: 'up' top: 'point' convolution_param { "
      "num_output: 8 kernel_size: 1 weight_filler { type: 'gaussian' std: 0.3 } } } ",
      "point", "layer { name: 'relu2' type: 'ReLU' bottom: 'conv2' top: 'conv2' } ", "conv2");
  shared_ptr<Solver<float> > off, exact;
  ASSERT_NO_FATAL_FAILURE(TrainLosslessAndOff(net, &exact, &off));
  const char* convs[] = {"conv1", "frozen", "up", "point", "conv2"};
  caffe::Net<float>* n = exact->net().get();
  n->Forward();
  n->Backward();
  int largest = 0;
  const SyncedMemory* shared = NULL;
  for (int c = 0; c < 5; ++c) {
    const Blob<float>* cols = CometLayerAccess<float>::columns(n->layer_by_name(convs[c]).get());
    largest = std::max(largest, cols->count());
    if (c == 0) shared = cols->data().get();
    EXPECT_EQ(cols->data().get(), shared) << convs[c] << " has a column buffer of its own";
  }
  // conv2's: 8 x 3 x 3 inputs at each of 32 x 32 positions, the largest
  EXPECT_EQ(largest, 72 * 32 * 32);
  EXPECT_EQ(shared->size(), largest * sizeof(float));
  // COMET off: one each
  const Layer<float>* a = off->net()->layer_by_name("conv1").get();
  const Layer<float>* b = off->net()->layer_by_name("conv2").get();
  EXPECT_NE(CometLayerAccess<float>::columns(const_cast<Layer<float>*>(a))->data(),
            CometLayerAccess<float>::columns(const_cast<Layer<float>*>(b))->data());
}

TEST_F(CometStoreTest, ConvolutionsShareOneColumnBuffer) { CheckConvColumns(); }

// A convolution with frozen weights between learning layers, and a fixed bilinear upsampling
// Deconvolution (FCN's, lr_mult 0): their backward computes the input's gradient only, from the
// weights and the output's gradient (patch 0036), so their inputs are kept as ReLU's sign masks
// alone, not as lossy values. Training reads no freed memory, and the gradient of conv1, whose
// path to the loss runs through masks and exact weights only, is COMET off's bit for bit.
void CometStoreTest::CheckFrozenMiddleLayers() {
  const std::string frozen = " param { lr_mult: 0 } param { lr_mult: 0 } ";
  const std::string net =
      "name: 'frozen_middle' layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' "
      "dummy_data_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 } "
      "data_filler { type: 'gaussian' std: 1 } data_filler { type: 'uniform' min: 0 max: 2.99 } } } "
      "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' convolution_param { "
      "num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: 'gaussian' std: 0.3 } "
      "bias_filler { type: 'constant' value: 0.1 } } } "
      "layer { name: 'relu1' type: 'ReLU' bottom: 'conv1' top: 'conv1' } "
      "layer { name: 'conv2' type: 'Convolution' bottom: 'conv1' top: 'conv2'" + frozen +
      "convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: 'gaussian' "
      "std: 0.3 } bias_filler { type: 'constant' value: 0.1 } } } "
      "layer { name: 'relu2' type: 'ReLU' bottom: 'conv2' top: 'conv2' } "
      "layer { name: 'up' type: 'Deconvolution' bottom: 'conv2' top: 'up' param { lr_mult: 0 } "
      "convolution_param { num_output: 4 group: 4 kernel_size: 4 stride: 2 pad: 1 "
      "bias_term: false weight_filler { type: 'bilinear' } } } "
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'up' top: 'ip' inner_product_param { "
      "num_output: 3 weight_filler { type: 'gaussian' std: 0.1 } } } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  shared_ptr<Solver<float> > off = SolverFor(net, "", "0.01");
  shared_ptr<Solver<float> > on = SolverFor(
      net, "comet { eb_mode: ADAPTIVE update_interval: 1 tiled_gemm: false }", "0.01");
  Run(off.get(), 3);
  Run(on.get(), 3);  // a read of memory the store freed would stop here
  std::map<std::string, const CometStore<float>::Entry*> by_blob;
  for (int e = 0; e < on->comet()->entries().size(); ++e)
    by_blob[on->comet()->entries()[e].blob] = &on->comet()->entries()[e];
  const char* masked[] = {"conv1", "conv2"};
  for (int b = 0; b < 2; ++b) {
    ASSERT_TRUE(by_blob.count(masked[b])) << masked[b];
    EXPECT_EQ(by_blob[masked[b]]->action, CometStore<float>::MASK)
        << masked[b] << ": its ReLU reads its signs, the frozen layer after it nothing";
  }
  ASSERT_TRUE(by_blob.count("up"));
  EXPECT_EQ(by_blob["up"]->action, CometStore<float>::LOSSY) << "ip learns: it reads its input";
  StepBothFromTheSameWeights(on.get(), off.get());
  EXPECT_EQ(WeightGradientError(on.get(), off.get(), "conv1"), 0.0);
  const double ip = WeightGradientError(on.get(), off.get(), "ip");
  EXPECT_GT(ip, 0) << "ip's input was lossy";
  EXPECT_LT(ip, 0.1);
  const Blob<float>* w = on->net()->layer_by_name("conv2")->blobs()[0].get();
  for (int j = 0; j < w->count(); ++j) ASSERT_EQ(w->cpu_diff()[j], 0.f) << "frozen";
}

TEST_F(CometStoreTest, AFrozenLayerBetweenLearningOnesDoesNotKeepItsInput) {
  CheckFrozenMiddleLayers();
}

TEST_F(CometStoreTest, SigmoidTanHAndELUOutputsAreStoredUnderTheirOwnBound) {
  CheckOutputDerivatives();
}
TEST_F(CometStoreTest, ExpAndSoftmaxOutputsAreStoredUnderTheirOwnBound) { CheckExpAndSoftmax(); }

TEST_F(CometStoreTest, ForwardOnlyKeepsBlobsReadable) {
  // pycaffe style: forward without backward, then read an intermediate blob.
  shared_ptr<Solver<float> > on = MakeSolver("comet { eb_mode: FIXED error_bound: 1e-3 }");
  shared_ptr<Solver<float> > off = MakeSolver("");
  Caffe::set_random_seed(4242);
  on->net()->Forward();
  Caffe::set_random_seed(4242);
  off->net()->Forward();
  const Blob<float>* a = off->net()->blob_by_name("pool1").get();
  const Blob<float>* b = on->net()->blob_by_name("pool1").get();
  EXPECT_LE(MaxAbsDiff(a->cpu_data(), b->cpu_data(), a->count()), 1e-3f);
  // a second forward drops the stored copies instead of decoding them
  Caffe::set_random_seed(4242);
  on->net()->Forward();
  EXPECT_LE(MaxAbsDiff(a->cpu_data(), on->net()->blob_by_name("pool1")->cpu_data(), a->count()),
            1e-3f);
}

TEST_F(CometStoreTest, SecondBackwardSeesTheStoredActivationsAgain) {
  shared_ptr<Solver<float> > on = MakeSolver("comet { eb_mode: FIXED error_bound: 1e-3 }");
  caffe::Net<float>* net = on->net().get();
  Caffe::set_random_seed(4242);
  net->ClearParamDiffs();
  net->ForwardBackward();
  Blob<float>* w = net->layer_by_name("conv2")->blobs()[0].get();
  std::vector<float> first(w->cpu_diff(), w->cpu_diff() + w->count());
  net->ClearParamDiffs();
  net->Backward();  // no forward in between: pool1 must come back from its compressed copy
  EXPECT_EQ(MaxAbsDiff(first.data(), w->cpu_diff(), w->count()), 0.f);
  float sum = 0;
  for (int i = 0; i < w->count(); ++i) sum += std::fabs(w->cpu_diff()[i]);
  EXPECT_GT(sum, 0.f);
}

TEST_F(CometStoreTest, AReadOfFreedMemoryIsAnErrorNamingBlobAndReader) {
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  shared_ptr<Solver<float> > on =
      MakeSolver("comet { eb_mode: FIXED error_bound: 1e-3 keep_compressed: true }");
  Run(on.get(), 1);
  // ip1 is read by the loss in forward only: freed after it. Reading it later is an error that
  // says what was freed and who read it (pycaffe: a RuntimeError), never zeros.
  const Blob<float>* ip1 = on->net()->blob_by_name("ip1").get();
  const std::string what = FatalMessageOf([&]() { ip1->cpu_data(); });
  EXPECT_NE(what.find("data of blob 'ip1' was freed"), std::string::npos) << what;
  EXPECT_NE(what.find("outside the training step (pycaffe or a tool), after iteration 0"),
            std::string::npos) << what;
  EXPECT_DEATH(ip1->cpu_data(), "data of blob 'ip1' was freed");
  // conv1 is held as relu1's sign mask: its values are not there to read
  EXPECT_DEATH(on->net()->blob_by_name("conv1")->cpu_data(),
               "blob 'conv1' is held only as the signs of its values");
  // pycaffe's own net.forward() and net.backward(): a read after them is no layer's, and no
  // read the plan should have foreseen
  on->net()->Forward();
  on->net()->Backward();
  const std::string diff = FatalMessageOf([&]() { ip1->cpu_diff(); });
  EXPECT_NE(diff.find("diff of blob 'ip1' was freed"), std::string::npos) << diff;
  EXPECT_NE(diff.find("outside a layer's forward and backward (pycaffe or a tool), after "
                      "iteration 1"), std::string::npos) << diff;
  EXPECT_EQ(diff.find("report it"), std::string::npos) << diff;
  // the next step overwrites both as usual
  Run(on.get(), 1);
  EXPECT_EQ(on->iter(), 2);
}

TEST_F(CometStoreTest, AForwardThatBeginsLaterSaysWhereToBegin) {
  // pycaffe's net.forward(start='pool1') after a step (upstream's LeNet notebook does such
  // forwards): pool1 reads conv1, which the step left as relu1's sign mask. That is the start's
  // doing, not a gap in the plan: the message says where the forward began and what to do.
  shared_ptr<Solver<float> > on =
      MakeSolver("comet { eb_mode: FIXED error_bound: 1e-3 keep_compressed: true }");
  Run(on.get(), 1);
  caffe::Net<float>* net = on->net().get();
  const int pool1 = 3;
  ASSERT_EQ(net->layer_names()[pool1], "pool1");
  const std::string what = FatalMessageOf([&]() { net->ForwardFrom(pool1); });
  EXPECT_NE(what.find("blob 'conv1' is held only as the signs"), std::string::npos) << what;
  EXPECT_NE(what.find("layer 'pool1' (Pooling) forward, iteration 1, in a forward that began at "
                      "layer 'pool1'"), std::string::npos) << what;
  EXPECT_NE(what.find("begin at that layer or earlier"), std::string::npos) << what;
  EXPECT_EQ(what.find("report it"), std::string::npos) << what;
  // beginning at conv1 computes what pool1 reads; a whole forward and a step run as usual
  net->ForwardFrom(1);
  EXPECT_TRUE(std::isfinite(net->blob_by_name("loss")->cpu_data()[0]));
  Run(on.get(), 1);
  EXPECT_EQ(on->iter(), 2);
}

TEST_F(CometStoreTest, AForwardThatStartsOverFinishesTheQueuedWorkFirst) {
  // pycaffe's forward(end='conv2') queues pool1's encode (conv2 is its last forward reader);
  // a forward(start='conv1') then rewrites pool1. The encode is finished before conv1's forward
  // runs, not read beside the rewrite (its payload, attached after, would replace the new
  // values), and the blobs read back what this forward computed. Without the pool, so that no
  // room rule (MakeRoomForForward) finishes the jobs by the way.
  shared_ptr<Solver<float> > on =
      MakeSolver("comet { eb_mode: FIXED error_bound: 1e-3 memory_pool: false }");
  Run(on.get(), 1);
  caffe::Net<float>* net = on->net().get();
  const int conv1 = 1, conv2 = 4;
  ASSERT_EQ(net->layer_names()[conv2], "conv2");
  net->ForwardFromTo(0, conv2);
  ASSERT_GT(on->comet()->jobs_queued(), 0u);
  const Blob<float>* out = net->blob_by_name("conv2").get();
  const std::vector<float> before(out->cpu_data(), out->cpu_data() + out->count());
  int queued = -1;  // the store's jobs not finished when conv1's forward starts
  AtLayer probe(conv1, [&] { queued = static_cast<int>(on->comet()->jobs_queued()); });
  net->add_before_forward(&probe);
  Blob<float>* w = net->layer_by_name("conv1")->blobs()[0].get();
  caffe_scal(w->count(), 2.f, w->mutable_cpu_data());  // new values for conv1 and pool1
  net->ForwardFromTo(conv1, conv2);
  EXPECT_EQ(queued, 0);
  // the same layers in a net without a store, from the input this forward read (lossy: the
  // data blob and pool1 are each within 1e-3 of it)
  shared_ptr<Solver<float> > off = MakeSolver("");
  NetParameter weights;
  net->ToProto(&weights, false);
  off->net()->CopyTrainedLayersFrom(weights);
  off->net()->ForwardFromTo(0, 0);
  caffe_copy(net->blob_by_name("data")->count(), net->blob_by_name("data")->cpu_data(),
             off->net()->blob_by_name("data")->mutable_cpu_data());
  off->net()->ForwardFromTo(conv1, conv2);
  const Blob<float>* plain = off->net()->blob_by_name("conv2").get();
  EXPECT_GT(MaxAbsDiff(before.data(), plain->cpu_data(), plain->count()), 0.1f);  // it changed
  EXPECT_LT(MaxAbsDiff(out->cpu_data(), plain->cpu_data(), plain->count()), 2e-2f);
}

TEST_F(CometStoreTest, WhatTheStoreHeldGoesWithTheLastBackwardReader) {
  // In a training step each blob's compressed copy (mask, codes) goes once its last backward
  // reader has run: later layers' copies are not held through the rest of the backward pass.
  // keep_compressed keeps them until the next forward, for reads after the step.
  shared_ptr<Solver<float> > drop = MakeSolver("comet { eb_mode: FIXED error_bound: 1e-3 }");
  shared_ptr<Solver<float> > keep =
      MakeSolver("comet { eb_mode: FIXED error_bound: 1e-3 keep_compressed: true }");
  Run(drop.get(), 3);
  Run(keep.get(), 3);
  const std::vector<float> a = Params(drop.get()), b = Params(keep.get());
  ASSERT_EQ(a.size(), b.size());
  for (int i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "param value " << i;  // same step
  const std::string what =
      FatalMessageOf([&]() { drop->net()->blob_by_name("pool1")->cpu_data(); });
  EXPECT_NE(what.find("data of blob 'pool1' was freed after its last use"), std::string::npos)
      << what;
  EXPECT_NE(what.find("keep_compressed: true } keeps such memory"), std::string::npos) << what;
  const shared_ptr<CometPayload>& held =
      keep->net()->blob_by_name("pool1")->data()->comet_payload();
  ASSERT_TRUE(held.get() != NULL);
  EXPECT_EQ(held->kind(), CometPayload::LOSSY);
  EXPECT_TRUE(std::isfinite(keep->net()->blob_by_name("pool1")->cpu_data()[0]));  // decodes
  // at the end of the backward pass (the store's last sample) nothing compressed is held
  EXPECT_EQ(drop->comet()->memory().current[CometMemory::COMPRESSED], 0u);
  EXPECT_GT(keep->comet()->memory().current[CometMemory::COMPRESSED], 0u);
  // pycaffe's own forward and backward, outside a step, keep them (a second Backward() works)
  drop->net()->Forward();
  drop->net()->Backward();
  EXPECT_TRUE(std::isfinite(drop->net()->blob_by_name("pool1")->cpu_data()[0]));
}

TEST_F(CometStoreTest, TheNetWorksOnAsPlainCaffeAfterItsSolverIsGone) {
  CheckTheNetOutlivesItsSolver();
}
TEST_F(CometStoreTest, BuffersOfABatchReshapedSmallerAreStillCoded) {
  CheckBuffersOfABatchReshapedSmaller();
}

TEST_F(CometStoreTest, CorruptStoredActivationIsDetected) {
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  shared_ptr<Solver<float> > on = MakeSolver("comet { eb_mode: FIXED error_bound: 1e-3 }");
  on->net()->Forward();
  shared_ptr<CometPayload>& p = on->net()->blob_by_name("pool1")->data()->comet_payload();
  ASSERT_TRUE(p.get() != NULL);
  static_cast<uint8_t*>(p->data())[p->bytes() - 3] ^= 0x01;
  EXPECT_DEATH(on->net()->Backward(), "compressed data of blob 'pool1' is corrupt .*read by "
               "layer 'conv2' \\(Convolution\\) backward, iteration 0");
}

// relu1's gradient comes from conv1's sign mask alone: a corrupt mask stops the backward naming the
// blob and the reader (in pycaffe a RuntimeError, not an abort), and the diff it was writing is not
// left to read.
TEST_F(CometStoreTest, CorruptSignMaskIsDetected) {
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  shared_ptr<Solver<float> > on = MakeSolver("comet { eb_mode: FIXED error_bound: 1e-3 }");
  on->net()->Forward();
  shared_ptr<CometPayload>& p = on->net()->blob_by_name("conv1")->data()->comet_payload();
  ASSERT_TRUE(p.get() != NULL);
  ASSERT_EQ(p->kind(), CometPayload::MASK);
  static_cast<uint32_t*>(p->data())[0] ^= 0x10u;  // one sign flipped: the popcount disagrees
  EXPECT_DEATH(on->net()->Backward(), "the sign mask of blob 'conv1' is corrupt .*read by layer "
               "'relu1' \\(ReLU\\) backward, iteration 0; refusing to use it");
  const std::string what = FatalMessageOf([&]() { on->net()->Backward(); });
  EXPECT_NE(what.find("the sign mask of blob 'conv1' is corrupt"), std::string::npos) << what;
  const std::string diff =
      FatalMessageOf([&]() { on->net()->blob_by_name("conv1")->cpu_diff(); });
  EXPECT_NE(diff.find("diff of blob 'conv1', left unfinished by a corrupt sign mask,"),
            std::string::npos) << diff;
}

// Max pooling's backward from its codes (pool_codes): corrupt codes stop the backward naming the
// buffer and the reader, and the diff it was writing is not left to read.
TEST_F(CometStoreTest, CorruptArgmaxCodesAreDetected) {
  shared_ptr<Solver<float> > on = MakeSolver("comet { eb_mode: FIXED error_bound: 1e-3 }");
  on->net()->Forward();
  shared_ptr<CometPayload>& p =
      CometLayerAccess<float>::argmax(on->net()->layer_by_name("pool1").get())->data()
          ->comet_payload();
  ASSERT_TRUE(p.get() != NULL);
  ASSERT_EQ(p->kind(), CometPayload::ARGMAX);
  static_cast<uint32_t*>(p->data())[0] ^= 0x1u;  // one code changed: the popcount disagrees
  const std::string what = FatalMessageOf([&]() { on->net()->Backward(); });
  EXPECT_NE(what.find("the argmax codes of 'pool1 argmax' are corrupt (bit check failed"),
            std::string::npos) << what;
  EXPECT_NE(what.find("read by layer 'pool1' (Pooling) backward, iteration 0; refusing"),
            std::string::npos) << what;
  const std::string diff =
      FatalMessageOf([&]() { on->net()->blob_by_name("conv1")->cpu_diff(); });
  EXPECT_NE(diff.find("diff of blob 'conv1', left unfinished by corrupt argmax codes,"),
            std::string::npos) << diff;
}

// The hooks of patch 0030 keep the calling thread's cuRAND position (GPU builds call them).
TEST(CometCurandTest, ThePositionCountsTheValuesDrawnSinceTheSeed) {
  CometCurandSeeded(42);
  CometCurandDrew(10);
  CometCurandDrew(5);
  CometCurandPosition p = CometCurandTell();
  EXPECT_TRUE(p.seeded);
  EXPECT_EQ(p.seed, 42u);
  EXPECT_EQ(p.drawn, 15u);
  CometCurandSeededAtRandom();
  p = CometCurandTell();
  EXPECT_FALSE(p.seeded);
  EXPECT_EQ(p.drawn, 0u);
  CometCurandSeeded(7);  // a new seed starts the count again
  EXPECT_EQ(CometCurandTell().drawn, 0u);
}

// A failure of COMET's device work (a CUDA error, out of memory) inside a store's job is thrown
// to the job, which keeps it as its error for the step to report with the blob and the layer (a
// worker thread cannot stop the step); outside a job it is a fatal error naming what the step
// was doing. Scopes nest: the outer job's scope holds after an inner one ends.
TEST(CometJobFailureTest, AFailureInAJobIsItsErrorAndElsewhereFatal) {
  {
    CometJobScope job;
    { CometJobScope inner; }
    std::string what;
    try {
      CometWorkFailed("out of memory on GPU 0: 2 MB more did not fit");
    } catch (const CometJobFailure& f) {
      what = f.what();
    }
    EXPECT_EQ(what, "out of memory on GPU 0: 2 MB more did not fit");
  }
  CometSetReadContext("layer 'conv1' (Convolution) backward, iteration 3");
  bool thrown_to_a_job = false;
  const std::string what = FatalMessageOf([&]() {
    try {
      CometWorkFailed("out of memory on GPU 0: 2 MB more did not fit");
    } catch (const CometJobFailure&) {
      thrown_to_a_job = true;
    }
  });
  CometSetReadContext("outside a COMET training step");
  EXPECT_FALSE(thrown_to_a_job);
  EXPECT_EQ(what, "COMET: out of memory on GPU 0: 2 MB more did not fit; where: layer 'conv1' "
                  "(Convolution) backward, iteration 3");
}

#ifndef CPU_ONLY
// ---------------------------------------------------------------- GPU (run where a GPU is present)

class CometGPUTest : public CometStoreTest {
 protected:
  virtual void SetUp() { Caffe::set_mode(Caffe::GPU); }
};

TEST_F(CometGPUTest, DeviceStreamsDecodeOnTheHostBitForBit) {
  Blob<float> blob(4, 8, 13, 11);
  FillActivations(&blob, 0.7f, 5.f, 11);
  const float* d_in = blob.gpu_data();
  shared_ptr<CometPayload> dev = CometEncodeLossy(d_in, blob.shape(), true, 1e-2, "x");
  ASSERT_TRUE(dev->on_device());
  Blob<float> back(blob.shape());
  std::string error;
  ASSERT_TRUE(CometDecode(*dev, back.mutable_gpu_data(), &error)) << error;
  EXPECT_LE(MaxAbsDiff(blob.cpu_data(), back.cpu_data(), blob.count()), 1e-2);
  // the same bytes decoded by the host decoder give the same values
  shared_ptr<CometPayload> host(new CometPayload(CometPayload::LOSSY, false, blob.count(), "x"));
  host->Allocate(dev->bytes());
  CUDA_CHECK(cudaMemcpy(host->data(), dev->data(), dev->bytes(), cudaMemcpyDeviceToHost));
  std::vector<float> h(blob.count());
  ASSERT_TRUE(CometDecode(*host, h.data(), &error)) << error;
  for (int i = 0; i < blob.count(); ++i) ASSERT_EQ(h[i], back.cpu_data()[i]) << i;
}

// The weight rule's sample of a depthwise convolution's input, and the errors it measures with
// an output gradient, read from device memory (a copy per run of neighbouring channels) are the
// host's, value for value.
// BatchNorm's tie offsets and their shift (batchnorm_moments.cu), and a device stream decoded with
// its channel offsets added back: the host's values, bit for bit.
TEST_F(CometGPUTest, ChannelOffsetsOnTheDeviceAreTheHostOnes) {
  const int channels = 5, inner = 30;
  const double n = 3 * inner;
  Blob<float> y(3, channels, 5, 6), stats(2, channels, 1, 1);
  FillActivations(&y, 0.f, 4.f, 21);
  FillActivations(&stats, 0.f, 2.f, 22);
  float* st = stats.mutable_cpu_data();
  st[0] = std::numeric_limits<float>::quiet_NaN();  // a NaN mean: no offset
  st[1] = -1e3f;                                   // beyond sqrt(n): no offset
  for (int c = 0; c < channels; ++c) st[channels + c] += 0.5f;  // the std
  std::vector<float> host(channels);
  CometTieOffsets(channels, st, st + channels, n, host.data());
  Blob<float> dev(1, channels, 1, 1);
  CometTieOffsetsGpu(channels, stats.gpu_data(), stats.gpu_data() + channels, n,
                     dev.mutable_gpu_data());
  EXPECT_EQ(host[0], 0.f);
  EXPECT_EQ(host[1], 0.f);
  for (int c = 0; c < channels; ++c) EXPECT_EQ(dev.cpu_data()[c], host[c]) << c;
  std::vector<float> shifted(y.cpu_data(), y.cpu_data() + y.count());
  CometAddChannelOffsets(y.count(), channels, inner, host.data(), -1.f, shifted.data());
  CometAddChannelOffsetsGpu(y.count(), channels, inner, dev.gpu_data(), -1.f,
                            y.mutable_gpu_data());
  EXPECT_EQ(MaxAbsDiff(shifted.data(), y.cpu_data(), y.count()), 0);
  shared_ptr<CometPayload> p = CometEncodeLossy(y.gpu_data(), y.shape(), true, 1e-2, "x");
  p->channel_offsets.reset(new CometPayload(CometPayload::OFFSETS, true, channels, "offsets"));
  p->channel_offsets->Allocate(channels * sizeof(float));
  caffe_copy(channels, dev.gpu_data(), static_cast<float*>(p->channel_offsets->data()));
  p->channel_offsets->inner = inner;
  Blob<float> back(y.shape());
  std::string error;
  ASSERT_TRUE(CometDecode(*p, back.mutable_gpu_data(), &error)) << error;
  std::vector<float> expected(y.count());
  shared_ptr<CometPayload> h = CometEncodeLossy(y.cpu_data(), y.shape(), false, 1e-2, "x");
  ASSERT_TRUE(CometDecode(*h, expected.data(), &error)) << error;
  CometAddChannelOffsets(y.count(), channels, inner, host.data(), 1.f, expected.data());
  EXPECT_EQ(MaxAbsDiff(expected.data(), back.cpu_data(), y.count()), 0);
}

TEST_F(CometGPUTest, AGroupedSampleFromDeviceMemoryIsTheHostOne) {
  const int C = 64;
  Blob<float> x(8, C, 56, 56), dy(8, C, 28, 28);
  FillActivations(&x, 0.4f, 3.f, 5);
  FillActivations(&dy, 0.f, 1.f, 6);
  caffe_copy(dy.count(), dy.cpu_data(), dy.mutable_cpu_diff());
  CometWeightGeometry g;
  g.kernel_h = g.kernel_w = 3;
  g.pad_h = g.pad_w = 1;
  g.stride_h = g.stride_w = 2;
  g.group = C;
  const CometErrorSample h = CometSampleInput(x.cpu_data(), false, 8, C, 56, 56, 1e-2, true, g);
  const CometErrorSample d = CometSampleInput(x.gpu_data(), true, 8, C, 56, 56, 1e-2, true, g);
  ASSERT_GT(h.groups.size(), 1u);
  EXPECT_EQ(h.channels, d.channels);
  EXPECT_EQ(h.images, d.images);
  ASSERT_EQ(h.x, d.x);
  const std::vector<double> ladder = CometLadder(1e-2);
  EXPECT_EQ(CometWeightErrors(h, dy.cpu_diff(), false, C, 28, 28, g, ladder),
            CometWeightErrors(d, dy.gpu_diff(), true, C, 28, 28, g, ladder));
}

TEST_F(CometGPUTest, LayerBuffersAreExactAndFreed) { CheckLayerBuffers(); }
TEST_F(CometGPUTest, MaxPoolingKeepsItsArgmaxAsCodesOnly) { CheckPoolCodes(); }
TEST_F(CometGPUTest, BuffersOfFrozenLayersAreFreedAfterTheirForward) {
  CheckFrozenLayersBuffers();
}
TEST_F(CometGPUTest, GlobalStatisticsBatchNormKeepsNoDenseXNorm) { CheckGlobalStatistics(); }
TEST_F(CometGPUTest, BatchNormsInputGradientFromALossyXNormSumsToZeroOverEachChannel) {
  CheckCentredBatchNormGradients();
}
TEST_F(CometGPUTest, ABatchNormOfFewValuesAChannelReadsItsXNormAtItsExactMoments) {
  CheckBatchNormMoments();
}
TEST_F(CometGPUTest, ABatchNormAboveAWeightedLayerBoundsItsErrorInThoseWeights) {
  CheckBatchNormWeightsBelow(false);
}
TEST_F(CometGPUTest, AScaleBetweenTwoBatchNormsBoundsTheSecondsError) {
  CheckChannelWeightsBetweenBatchNorms("Scale");
}
TEST_F(CometGPUTest, APReLUBetweenTwoBatchNormsBoundsTheSecondsError) {
  CheckChannelWeightsBetweenBatchNorms("PReLU");
}
TEST_F(CometGPUTest, ABatchNormOnAReshapedViewBoundsItsErrorInTheWeightsBelow) {
  CheckBatchNormWeightsBelow(true);
}
TEST_F(CometGPUTest, ABatchNormAfterAReluReadsItsXNormAtItsExactMoments) {
  CheckBatchNormAfterRelu(false);
}
TEST_F(CometGPUTest, ABatchNormOnAReshapedReluOutputReadsItsXNormAtItsExactMoments) {
  CheckBatchNormAfterRelu(true);
}
TEST_F(CometGPUTest, ABatchNormAfterAReluStoresItsZerosExact) {
  CheckBatchNormTiesShifted();
}
TEST_F(CometGPUTest, ADerivativeRuleAboveAWeightedLayerBoundsItsErrorInThoseWeights) {
  CheckDerivativeWeightsBelow(false);
}
TEST_F(CometGPUTest, ADerivativeRuleAboveAConcatBoundsItsErrorInTheWeightsOfEachPart) {
  CheckDerivativeWeightsBelow(true);
}
TEST_F(CometGPUTest, AFixedBoundEstimatedFarOffIsWarnedOnceAndIsFarOff) {
  CheckFixedBoundEstimate();
}
TEST_F(CometGPUTest, PReLUInputsAreLossyWithExactSigns) { CheckPReLU(); }
TEST_F(CometGPUTest, LRNWithinAChannelStoresItsInputAndRecomputesItsInternals) {
  CheckLrnWithinChannel();
}
TEST_F(CometGPUTest, SwishStoresItsInputAndFreesItsSigmoidBuffers) { CheckSwish(); }
TEST_F(CometGPUTest, MVNFreesItsTempBetweenThePasses) { CheckMVNTemp(); }
TEST_F(CometGPUTest, AScaleByASecondBottomStoresItsInputLossy) { CheckSqueezeExcitation(); }
TEST_F(CometGPUTest, ConvolutionsShareOneColumnBuffer) { CheckConvColumns(); }
TEST_F(CometGPUTest, AFrozenLayerBetweenLearningOnesDoesNotKeepItsInput) {
  CheckFrozenMiddleLayers();
}
TEST_F(CometGPUTest, SigmoidTanHAndELUOutputsAreStoredUnderTheirOwnBound) {
  CheckOutputDerivatives();
}
TEST_F(CometGPUTest, ExpAndSoftmaxOutputsAreStoredUnderTheirOwnBound) { CheckExpAndSoftmax(); }
TEST_F(CometGPUTest, TheNetWorksOnAsPlainCaffeAfterItsSolverIsGone) {
  CheckTheNetOutlivesItsSolver();
}
TEST_F(CometGPUTest, BuffersOfABatchReshapedSmallerAreStillCoded) {
  CheckBuffersOfABatchReshapedSmaller();
}

// The position of Caffe's cuRAND generator puts it back: the values drawn after a Seek are those
// drawn after the Tell, whatever the draws' sizes and kinds (cuRAND's absolute offset against
// its sequence split over calls: what an exact resume of GPU Dropout rests on).
TEST_F(CometGPUTest, TheCuRANDPositionPutsTheGeneratorBack) {
  Caffe::set_random_seed(1701);
  SyncedMemory scratch(1 << 20), a(8192 * 4), b(8192 * 4);
  const int before[] = {1000, 4097, 333, 64};
  for (int i = 0; i < 4; ++i) {
    if (i % 2) caffe_gpu_rng_uniform(before[i], static_cast<unsigned int*>(scratch.mutable_gpu_data()));
    else caffe_gpu_rng_uniform<float>(before[i], 0.f, 1.f, static_cast<float*>(scratch.mutable_gpu_data()));
  }
  // Doubles count two 32-bit values each (patch 0030); were it one, the Seek below would put the
  // generator elsewhere and a, b would differ (a double net's stochastic pooling draws them).
  caffe_gpu_rng_uniform<double>(129, 0., 1., static_cast<double*>(scratch.mutable_gpu_data()));
  const CometCurandPosition at = CometCurandTell();
  EXPECT_TRUE(at.seeded);
  EXPECT_EQ(at.seed, 1701u);
  EXPECT_EQ(at.drawn, 1000u + 4097u + 333u + 64u + 2u * 129u);
  caffe_gpu_rng_uniform(5000, static_cast<unsigned int*>(a.mutable_gpu_data()));
  caffe_gpu_rng_uniform<float>(3192, 0.f, 1.f, static_cast<float*>(a.mutable_gpu_data()) + 5000);
  Caffe::set_random_seed(5);  // elsewhere
  caffe_gpu_rng_uniform(777, static_cast<unsigned int*>(scratch.mutable_gpu_data()));
  CometCurandSeek(at);
  caffe_gpu_rng_uniform(5000, static_cast<unsigned int*>(b.mutable_gpu_data()));
  caffe_gpu_rng_uniform<float>(3192, 0.f, 1.f, static_cast<float*>(b.mutable_gpu_data()) + 5000);
  EXPECT_EQ(memcmp(a.cpu_data(), b.cpu_data(), 8192 * 4), 0);
}

// A store made in one mode and trained in the other (pycaffe: caffe.set_mode_gpu() after
// get_solver) plans again for the mode it runs in: LRN's GPU backward reads its output, which
// the CPU plan frees (and read it freed, a fatal error), and the GPU plan frees it going back to
// the CPU. Lossless, bit for bit against COMET off on the device.
TEST_F(CometGPUTest, TheStoreFollowsAModeSwitchedAfterTheSolverIsMade) {
  const std::string net = LrnPoolNet();
  shared_ptr<Solver<float> > off = SolverFor(net, "");
  Run(off.get(), 3);
  Caffe::set_mode(Caffe::CPU);
  shared_ptr<Solver<float> > on = SolverFor(net, "comet { compress_type: 'None' }");
  Caffe::set_mode(Caffe::GPU);
  Run(on.get(), 3);
  const std::vector<float> a = Params(off.get()), b = Params(on.get());
  ASSERT_EQ(a.size(), b.size());
  for (int i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << i;
  const CometStore<float>* store = on->comet();
  const auto norm1 = [store]() -> const CometStore<float>::Entry* {
    for (int e = 0; e < store->entries().size(); ++e)
      if (store->entries()[e].blob == "norm1") return &store->entries()[e];
    return NULL;
  };
  EXPECT_TRUE(!norm1() || norm1()->action != CometStore<float>::RELEASE)
      << "the GPU's backward reads norm1";
  Caffe::set_mode(Caffe::CPU);
  Run(on.get(), 1);
  ASSERT_TRUE(norm1() != NULL);
  EXPECT_EQ(norm1()->action, CometStore<float>::RELEASE);
}

// Patch 0015's Forward_gpu: the argmax stays in its window with NaN, Inf and -Inf windows.
TEST_F(CometGPUTest, NaNAndInfThroughMaxPoolingStayInTheWindow) { CheckNaNThroughPooling(); }

TEST_F(CometGPUTest, DeviceCodesMatchHostCodes) {
  MaxPoolingRun run(MaxPoolingRun::Param());  // forward on the GPU: the argmax is on the device
  Blob<int>* idx = CometLayerAccess<float>::argmax(&run.layer);
  const comet_codes::PoolGeometry g = CometLayerAccess<float>::geometry(&run.layer);
  shared_ptr<CometPayload> h = CometEncodeArgmax(idx->cpu_data(), idx->count(), g, false, "a");
  shared_ptr<CometPayload> d = CometEncodeArgmax(idx->gpu_data(), idx->count(), g, true, "a");
  ASSERT_TRUE(h.get() != NULL && d.get() != NULL);
  ASSERT_EQ(h->bytes(), d->bytes());
  EXPECT_EQ(h->mask_popcount, d->mask_popcount);
  std::vector<uint8_t> dev_bytes(d->bytes());
  CUDA_CHECK(cudaMemcpy(dev_bytes.data(), d->data(), d->bytes(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(dev_bytes.data(), h->data(), h->bytes()), 0);
  Blob<int> back(idx->shape());
  std::string error;
  ASSERT_TRUE(CometDecode(*d, back.mutable_gpu_data(), &error)) << error;
  for (int i = 0; i < idx->count(); ++i) ASSERT_EQ(back.cpu_data()[i], idx->cpu_data()[i]) << i;
  // A code outside its window with its popcount kept: the device's argmax decode and its
  // backward from the codes (a gather, which would drop it silently) refuse it as the host does.
  std::vector<uint32_t> words(d->bytes() / 4);
  std::memcpy(words.data(), dev_bytes.data(), d->bytes());
  ASSERT_TRUE(SwapInACodeOutsideItsWindow(words.data(), d->count(), d->code_bits, g));
  CUDA_CHECK(cudaMemcpy(d->data(), words.data(), d->bytes(), cudaMemcpyHostToDevice));
  EXPECT_FALSE(CometDecode(*d, back.mutable_gpu_data(), &error));
  EXPECT_EQ(error, "a code names no element of its window");
  Blob<float> top_diff(run.top.shape()), bottom_diff(run.bottom.shape());
  FillActivations(&top_diff, 0.f, 1.f, 5);
  error.clear();
  EXPECT_FALSE(CometPoolBackwardFromCodes(*d, top_diff.gpu_data(), bottom_diff.mutable_gpu_data(),
                                          &error));
  EXPECT_EQ(error, "a code names no element of its window");
}

TEST_F(CometGPUTest, DeviceMasksMatchHostMasks) {
  Blob<float> blob(3, 5, 7, 9);  // 945 values: a partial last word
  FillActivations(&blob, 0.5f, 0.05f, 12);
  shared_ptr<CometPayload> h = CometEncodeMask(blob.cpu_data(), blob.count(), false, "x");
  shared_ptr<CometPayload> d = CometEncodeMask(blob.gpu_data(), blob.count(), true, "x");
  ASSERT_TRUE(h.get() != NULL && d.get() != NULL);
  EXPECT_EQ(h->mask_popcount, d->mask_popcount);
  std::vector<uint32_t> words(h->bytes() / 4);
  CUDA_CHECK(cudaMemcpy(words.data(), d->data(), h->bytes(), cudaMemcpyDeviceToHost));
  for (int w = 0; w < words.size(); ++w)
    ASSERT_EQ(words[w], static_cast<const uint32_t*>(h->data())[w]) << w;
  Blob<float> out(blob.shape());
  std::string error;
  ASSERT_TRUE(CometDecode(*d, out.mutable_gpu_data(), &error)) << error;
  for (int i = 0; i < blob.count(); ++i)
    ASSERT_EQ(out.cpu_data()[i] > 0, blob.cpu_data()[i] > 0) << i;
}

// A bit set past the end of a mask is corruption however the other bits add up: with as many set
// bits cleared elsewhere as the last word's complement, a count that took the last word as 32
// set bits (the device's before) matched the stored popcount, and the decode went on.
TEST_F(CometGPUTest, AMaskWithABitPastItsEndIsRefusedAsOnTheHost) {
  Blob<float> blob(3, 5, 7, 9);  // 945 values: 17 bits of the last word are the mask's
  FillActivations(&blob, 0.5f, 0.05f, 12);
  shared_ptr<CometPayload> d = CometEncodeMask(blob.gpu_data(), blob.count(), true, "x");
  shared_ptr<CometPayload> h = CometEncodeMask(blob.cpu_data(), blob.count(), false, "x");
  ASSERT_TRUE(d.get() != NULL && h.get() != NULL);
  std::vector<uint32_t> words(d->bytes() / 4);
  CUDA_CHECK(cudaMemcpy(words.data(), d->data(), d->bytes(), cudaMemcpyDeviceToHost));
  uint32_t& last = words.back();
  int to_clear = 32 - __builtin_popcount(last);
  last |= 1u << 20;
  for (size_t w = 0; w + 1 < words.size() && to_clear > 0; ++w)
    for (int b = 0; b < 32 && to_clear > 0; ++b)
      if (words[w] & (1u << b)) words[w] &= ~(1u << b), --to_clear;
  ASSERT_EQ(to_clear, 0);
  CUDA_CHECK(cudaMemcpy(d->data(), words.data(), d->bytes(), cudaMemcpyHostToDevice));
  std::memcpy(h->data(), words.data(), h->bytes());
  Blob<float> out(blob.shape());
  std::string dev_error, host_error;
  EXPECT_FALSE(CometDecode(*d, out.mutable_gpu_data(), &dev_error));
  EXPECT_FALSE(CometDecode(*h, out.mutable_cpu_data(), &host_error));
  EXPECT_EQ(dev_error, host_error);
}

// Many blocks and warps (the kernels sum their popcounts per warp), and one NaN among 8 million
// values, found by the device pack as by the host's.
TEST_F(CometGPUTest, LargeDeviceMasksCountAndRefuseAsTheHostDoes) {
  Blob<float> blob(8, 64, 128, 128);  // 8 Mi values, 262,144 words
  FillActivations(&blob, 0.5f, 0.05f, 13);
  shared_ptr<CometPayload> h = CometEncodeMask(blob.cpu_data(), blob.count(), false, "x");
  shared_ptr<CometPayload> d = CometEncodeMask(blob.gpu_data(), blob.count(), true, "x");
  ASSERT_TRUE(h.get() != NULL && d.get() != NULL);
  EXPECT_EQ(h->mask_popcount, d->mask_popcount);
  Blob<float> out(blob.shape());
  std::string error;
  ASSERT_TRUE(CometDecode(*d, out.mutable_gpu_data(), &error)) << error;
  size_t ones = 0;
  for (int i = 0; i < out.count(); ++i) ones += out.cpu_data()[i] > 0;
  EXPECT_EQ(ones, static_cast<size_t>(h->mask_popcount));
  blob.mutable_cpu_data()[blob.count() / 2 + 17] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(CometEncodeMask(blob.cpu_data(), blob.count(), false, "x").get() == NULL);
  EXPECT_TRUE(CometEncodeMask(blob.gpu_data(), blob.count(), true, "x").get() == NULL)
      << "the device pack missed the NaN";
}

TEST_F(CometGPUTest, ExactStagesAreBitIdenticalToCometOff) {
  shared_ptr<Solver<float> > off = MakeSolver("");
  shared_ptr<Solver<float> > on = MakeSolver("comet { compress_type: 'None' }");
  Run(off.get(), 5);
  Run(on.get(), 5);
  const std::vector<float> a = Params(off.get()), b = Params(on.get());
  for (int i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "param value " << i;
}

TEST_F(CometGPUTest, LossyTrainingStaysCloseAndSavesDeviceMemory) {
  shared_ptr<Solver<float> > off = MakeSolver(
      "comet { compress_type: 'None' relu_masks: false release_unused: false "
      "release_diffs: false }");
  shared_ptr<Solver<float> > on = MakeSolver("comet { eb_mode: FIXED error_bound: 1e-4 }");
  Run(off.get(), 5);
  Run(on.get(), 5);
  const std::vector<float> a = Params(off.get()), b = Params(on.get());
  EXPECT_LT(MaxAbsDiff(a.data(), b.data(), a.size()), 1e-3f);
  EXPECT_LT(on->comet()->memory().peak_total, off->comet()->memory().peak_total);
}
// A payload made on the device and read on the host (pycaffe's .data in GPU mode): SyncedMemory
// restores it, within the bound, and drops it.
// comet { async } on a GPU: the store's device encodes and decodes run on its worker, on a
// stream of its own (stream.hpp), beside the kernels the step queues. They give what the same
// work gives in the step, bit for bit (no codec depends on its stream), on the worker's thread,
// and the tracked peak stays within 5% of the step's.
TEST_F(CometGPUTest, DeviceJobsOnTheStoresStreamMatchTheStepBitForBit) {
  const std::string block = "eb_mode: FIXED error_bound: 1e-3 ";
  shared_ptr<Solver<float> > in_step = MakeSolver("comet { " + block + "async: false }");
  shared_ptr<Solver<float> > beside = MakeSolver("comet { " + block + "}");
  Run(in_step.get(), 5);
  const uint64_t before = CometWorker::jobs_run_on_workers();
  Run(beside.get(), 5);
  EXPECT_GT(CometWorker::jobs_run_on_workers(), before);
  const std::vector<float> a = Params(in_step.get()), b = Params(beside.get());
  for (int i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "param value " << i;
  EXPECT_LE(beside->comet()->memory().peak_total,
            in_step->comet()->memory().peak_total * 21 / 20);
}

TEST_F(CometGPUTest, AHostReadOfADevicePayloadRestoresIt) {
  Blob<float> blob(2, 3, 8, 8);
  FillActivations(&blob, 0.5f, 1.f, 5);
  const std::vector<float> orig(blob.cpu_data(), blob.cpu_data() + blob.count());
  SyncedMemory* mem = blob.data().get();
  shared_ptr<CometPayload> p = CometEncodeLossy(blob.gpu_data(), blob.shape(), true, 1e-3, "x");
  ASSERT_TRUE(p->on_device());
  ASSERT_TRUE(mem->comet_can_release());
  mem->comet_release();
  mem->comet_payload() = p;
  const float* back = blob.cpu_data();
  EXPECT_TRUE(mem->comet_payload().get() == NULL);
  EXPECT_LE(MaxAbsDiff(orig.data(), back, blob.count()), 1e-3);
}

// Device memory the store released with nothing to restore is an error naming it, on the GPU
// as on the host; never zeros.
TEST_F(CometGPUTest, AReleasedDeviceBufferIsAnErrorNotZeros) {
  Blob<float> blob(2, 3, 8, 8);
  caffe_gpu_set(blob.count(), 1.f, blob.mutable_gpu_data());
  CometMarkReleased(blob.data().get(), "data of blob 'pool9'");
  const std::string what = FatalMessageOf([&]() { blob.gpu_data(); });
  EXPECT_NE(what.find("data of blob 'pool9' was freed"), std::string::npos) << what;
}

// A corrupt device stream: the decoder says so (no values written as if good), and a read
// through SyncedMemory is an error naming the blob.
TEST_F(CometGPUTest, ACorruptDevicePayloadIsRefused) {
  Blob<float> blob(2, 3, 8, 8);
  FillActivations(&blob, 0.5f, 1.f, 6);
  shared_ptr<CometPayload> p = CometEncodeLossy(blob.gpu_data(), blob.shape(), true, 1e-3, "conv9");
  ASSERT_TRUE(p->on_device());
  uint8_t* byte = static_cast<uint8_t*>(p->data()) + p->bytes() / 2;
  uint8_t v = 0;
  CUDA_CHECK(cudaMemcpy(&v, byte, 1, cudaMemcpyDeviceToHost));
  v ^= 0xff;
  CUDA_CHECK(cudaMemcpy(byte, &v, 1, cudaMemcpyHostToDevice));
  Blob<float> out(blob.shape());
  std::string error;
  EXPECT_FALSE(CometDecode(*p, out.mutable_gpu_data(), &error));
  EXPECT_FALSE(error.empty());
  blob.data()->comet_release();
  blob.data()->comet_payload() = p;
  const std::string what = FatalMessageOf([&]() { blob.gpu_data(); });
  EXPECT_NE(what.find("compressed data of blob 'conv9' is corrupt"), std::string::npos) << what;
}

// The device pool gives its cached blocks back and retries when cudaMalloc runs out: a device
// filled up to less than the block asked for, with a larger block cached.
TEST_F(CometGPUTest, ThePoolGivesItsCacheBackWhenTheDeviceIsFull) {
  const size_t block = size_t(256) << 20;
  CometGpuPoolEnable(true);
  void* a = NULL;
  CometGpuMalloc(&a, block);
  CometGpuFree(a, block);
  ASSERT_GE(CometGpuPoolQuery().cached, block) << "the freed block was not cached";
  // Take all free memory but half a block, in pieces (one allocation may not get it all).
  std::vector<void*> hog;
  size_t free_bytes = 0, total = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  for (size_t piece = free_bytes; piece >= (size_t(16) << 20) && free_bytes > block / 2;) {
    void* h = NULL;
    if (cudaMalloc(&h, std::min(piece, free_bytes - block / 2)) == cudaSuccess) {
      hog.push_back(h);
    } else {
      cudaGetLastError();
      piece /= 2;
    }
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  }
  void* b = NULL;
  CometGpuMalloc(&b, block + block / 4);  // more than is free: only the cache makes room
  EXPECT_TRUE(b != NULL);
  EXPECT_EQ(CometGpuPoolQuery().cached, 0u) << "the cache was not given back";
  CometGpuFree(b, block + block / 4);
  for (size_t i = 0; i < hog.size(); ++i) CUDA_CHECK(cudaFree(hog[i]));
  CometGpuPoolEnable(false);
}

// An allocation the device cannot make says how much, what the device has, and what to try, and
// in a store's job it becomes the job's error; a failed CUDA call names its error and itself.
// The device stays usable after both.
TEST_F(CometGPUTest, DeviceFailuresSayWhatFailedAndWhere) {
  size_t free_bytes = 0, total = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  for (int pooled = 0; pooled < 2; ++pooled) {
    if (pooled) CometGpuPoolEnable(true);
    void* p = NULL;
    const std::string what = FatalMessageOf([&]() { CometGpuMalloc(&p, 2 * total); });
    EXPECT_NE(what.find("COMET: out of memory on GPU "), std::string::npos) << what;
    EXPECT_NE(what.find(" MB more did not fit ("), std::string::npos) << what;
    EXPECT_NE(what.find("cometctl plan --gpu "), std::string::npos) << what;
    EXPECT_EQ(what.find("COMET's memory pool had") != std::string::npos, pooled == 1) << what;
    bool in_job = false;
    {
      CometJobScope job;
      try {
        CometGpuMalloc(&p, 2 * total);
      } catch (const CometJobFailure& f) {
        in_job = std::string(f.what()).find("out of memory on GPU ") == 0;
      }
    }
    EXPECT_TRUE(in_job);
    void* q = NULL;
    CometGpuMalloc(&q, 1 << 20);
    EXPECT_TRUE(q != NULL);
    CometGpuFree(q, 1 << 20);
    if (pooled) CometGpuPoolEnable(false);
  }
  const std::string what = FatalMessageOf([]() { COMET_CUDA_CHECK(cudaSetDevice(1 << 20)); });
  cudaGetLastError();
  EXPECT_NE(what.find("COMET: CUDA error cudaErrorInvalidDevice (invalid device ordinal) in "
                      "cudaSetDevice(1 << 20) at test_comet.cpp:"),
            std::string::npos) << what;
}

#endif  // CPU_ONLY

}  // namespace caffe
