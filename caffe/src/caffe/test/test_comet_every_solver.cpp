// COMET-Caffe: COMET_EVERY_SOLVER="<comet { } block as text>" gives every solver these tests
// make without a comet { } block that one (CometGiveBlockIfWithout, patch 0009). scripts/test
// runs upstream's own solver tests (SGD, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam: updates
// against a reference computed by hand, iter_size, shared weights, snapshot and restore) once
// more so, with a lossless block: they must pass unchanged with the store on.
#include <cstdlib>
#include <string>

#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

#include "caffe/comet/store.hpp"
#include "caffe/common.hpp"
#include "caffe/solver.hpp"
#include "caffe/solver_factory.hpp"

#include "caffe/test/test_caffe_main.hpp"

namespace caffe {

namespace {

const char* kEnv = "COMET_EVERY_SOLVER";

// Set before the first test, so that every solver of the run sees it.
class CometEverySolverEnvironment : public ::testing::Environment {
 public:
  virtual void SetUp() {
    const char* text = getenv(kEnv);
    if (!text) return;
    CometParameter block;
    CHECK(google::protobuf::TextFormat::ParseFromString(text, &block))
        << kEnv << "='" << text << "' is not a comet { } block's text";
    CometSetBlockForSolversWithout(block);
    LOG(INFO) << "COMET: every solver without a comet { } block gets { " << block.ShortDebugString()
              << " } (" << kEnv << ")";
  }
};

::testing::Environment* const kEverySolver =
    ::testing::AddGlobalTestEnvironment(new CometEverySolverEnvironment);

SolverParameter SolverWithoutBlock() {
  SolverParameter sp;
  CHECK(google::protobuf::TextFormat::ParseFromString(
      "base_lr: 0.01 lr_policy: 'fixed' solver_mode: CPU "
      "net_param { layer { name: 'data' type: 'DummyData' top: 'x' top: 'y' "
      "  dummy_data_param { shape { dim: 2 dim: 3 } shape { dim: 2 dim: 1 } } } "
      "  layer { name: 'ip' type: 'InnerProduct' bottom: 'x' top: 'p' "
      "    inner_product_param { num_output: 1 } } "
      "  layer { name: 'loss' type: 'EuclideanLoss' bottom: 'p' bottom: 'y' top: 'loss' } }",
      &sp));
  return sp;
}

}  // namespace

// The run that scripts/test makes with the variable set proves its solvers had stores: without
// the hook, upstream's tests would pass just the same with COMET off.
TEST(CometEverySolverTest, SolversWithoutABlockGetTheRunnersBlock) {
  Caffe::set_mode(Caffe::CPU);
  const SolverParameter sp = SolverWithoutBlock();
  shared_ptr<Solver<float> > solver(SolverRegistry<float>::CreateSolver(sp));
  if (getenv(kEnv)) {
    ASSERT_TRUE(solver->param().has_comet());
    EXPECT_TRUE(solver->comet() != NULL);
  } else {
    EXPECT_FALSE(solver->param().has_comet());
    EXPECT_TRUE(solver->comet() == NULL);
  }
  // a solver's own block is never replaced
  SolverParameter own = sp;
  own.mutable_comet()->set_enabled(false);
  shared_ptr<Solver<float> > off(SolverRegistry<float>::CreateSolver(own));
  EXPECT_TRUE(off->comet() == NULL);
  EXPECT_FALSE(off->param().comet().enabled());
}

}  // namespace caffe
