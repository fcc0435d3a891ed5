// COMET-Caffe: with COMET on, the train net's layers whose cuDNN Backward reads both input and
// output get Caffe's engine (comet/engines.cpp, patch 0029); everything else keeps its engine.
#include <string>
#include <vector>

#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

#include "caffe/comet/engines.hpp"
#include "caffe/common.hpp"
#include "caffe/net.hpp"
#include "caffe/solver.hpp"
#include "caffe/solver_factory.hpp"

#include "caffe/test/test_caffe_main.hpp"

namespace caffe {

namespace {

const char* kLayers =
    "layer { name: 'conv' type: 'Convolution' bottom: 'd' top: 'c' "
    "  convolution_param { num_output: 2 kernel_size: 1 } } "
    "layer { name: 'relu' type: 'ReLU' bottom: 'c' top: 'c' } "
    "layer { name: 'relu_cudnn' type: 'ReLU' bottom: 'c' top: 'c2' relu_param { engine: CUDNN } } "
    "layer { name: 'leaky' type: 'ReLU' bottom: 'c' top: 'c3' relu_param { negative_slope: 0.1 } } "
    "layer { name: 'lrn' type: 'LRN' bottom: 'c' top: 'n' } "
    "layer { name: 'lcn' type: 'LRN' bottom: 'c' top: 'n2' lrn_param { norm_region: WITHIN_CHANNEL } } "
    "layer { name: 'avg' type: 'Pooling' bottom: 'c' top: 'p' pooling_param { pool: AVE kernel_size: 1 } } "
    "layer { name: 'max' type: 'Pooling' bottom: 'c' top: 'p2' pooling_param { pool: MAX kernel_size: 1 } } "
    "layer { name: 'sig' type: 'Sigmoid' bottom: 'c' top: 's' } "
    "layer { name: 'tanh' type: 'TanH' bottom: 'c' top: 't' } "
    "layer { name: 'soft' type: 'Softmax' bottom: 'c' top: 'x' } "
    "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'c' bottom: 'l' top: 'loss' } ";

NetParameter Layers() {
  NetParameter np;
  CHECK(google::protobuf::TextFormat::ParseFromString(kLayers, &np));
  return np;
}

SolverParameter SolverParam(const std::string& text) {
  SolverParameter sp;
  CHECK(google::protobuf::TextFormat::ParseFromString(text, &sp));
  return sp;
}

const LayerParameter& ByName(const NetParameter& np, const std::string& name) {
  for (int i = 0; i < np.layer_size(); ++i)
    if (np.layer(i).name() == name) return np.layer(i);
  LOG(FATAL) << "no layer " << name;
  return np.layer(0);
}

}  // namespace

TEST(CometEnginesTest, LayersWhoseCuDNNBackwardReadsBothGetCaffesEngine) {
  NetParameter np = Layers();
  const std::vector<std::string> changed = CometChooseEngines(SolverParam("comet { }"), &np);
  // a leaky ReLU too: cuDNN's class would run Caffe's Backward for it, but the class is cuDNN's
  const char* expect[] = {"relu", "leaky", "lrn", "lcn", "avg", "sig", "tanh", "soft"};
  ASSERT_EQ(changed, std::vector<std::string>(expect, expect + 8));
  EXPECT_EQ(ByName(np, "leaky").relu_param().engine(), ReLUParameter_Engine_CAFFE);
  EXPECT_EQ(ByName(np, "relu").relu_param().engine(), ReLUParameter_Engine_CAFFE);
  EXPECT_EQ(ByName(np, "lrn").lrn_param().engine(), LRNParameter_Engine_CAFFE);
  EXPECT_EQ(ByName(np, "lcn").lrn_param().engine(), LRNParameter_Engine_CAFFE);
  EXPECT_EQ(ByName(np, "avg").pooling_param().engine(), PoolingParameter_Engine_CAFFE);
  EXPECT_EQ(ByName(np, "sig").sigmoid_param().engine(), SigmoidParameter_Engine_CAFFE);
  EXPECT_EQ(ByName(np, "tanh").tanh_param().engine(), TanHParameter_Engine_CAFFE);
  EXPECT_EQ(ByName(np, "soft").softmax_param().engine(), SoftmaxParameter_Engine_CAFFE);
  // a named engine, max pooling (Caffe's in upstream's factory), the convolution and the loss
  // keep what they had
  EXPECT_EQ(ByName(np, "relu_cudnn").relu_param().engine(), ReLUParameter_Engine_CUDNN);
  const char* untouched[] = {"conv", "max", "loss"};
  NetParameter before = Layers();
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(ByName(np, untouched[i]).DebugString(), ByName(before, untouched[i]).DebugString())
        << untouched[i];
}

TEST(CometEnginesTest, NothingChangesWithCometOffOrCuDNNEnginesKept) {
  const char* solvers[] = {"", "comet { enabled: false }", "comet { cudnn_engines: true }"};
  for (int s = 0; s < 3; ++s) {
    NetParameter np = Layers();
    EXPECT_TRUE(CometChooseEngines(SolverParam(solvers[s]), &np).empty()) << solvers[s];
    EXPECT_EQ(np.DebugString(), Layers().DebugString()) << solvers[s];
  }
}

// The solver applies it to the train net it builds (patch 0029), not to its test nets.
TEST(CometEnginesTest, TheSolverBuildsItsTrainNetWithThem) {
  Caffe::set_mode(Caffe::CPU);
  const std::string net =
      "layer { name: 'data' type: 'DummyData' top: 'd' top: 'l' "
      "  dummy_data_param { shape { dim: 2 dim: 3 } shape { dim: 2 } } } "
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'd' top: 'ip' "
      "  inner_product_param { num_output: 3 } } "
      "layer { name: 'relu' type: 'ReLU' bottom: 'ip' top: 'ip' } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'l' top: 'loss' } ";
  for (int on = 0; on < 2; ++on) {
    SolverParameter sp = SolverParam(std::string("base_lr: 0.01 lr_policy: 'fixed' test_iter: 1 "
                                                 "test_interval: 100 ") + (on ? "comet { }" : ""));
    CHECK(google::protobuf::TextFormat::ParseFromString(net, sp.mutable_net_param()));
    shared_ptr<caffe::Solver<float> > solver(SolverRegistry<float>::CreateSolver(sp));
    const ReLUParameter::Engine want = on ? ReLUParameter_Engine_CAFFE : ReLUParameter_Engine_DEFAULT;
    EXPECT_EQ(solver->net()->layer_by_name("relu")->layer_param().relu_param().engine(), want);
    ASSERT_EQ(solver->test_nets().size(), 1);
    EXPECT_EQ(solver->test_nets()[0]->layer_by_name("relu")->layer_param().relu_param().engine(),
              ReLUParameter_Engine_DEFAULT);
  }
}

}  // namespace caffe
