// COMET-Caffe: the plan as a pure function of a built net (comet/plan.cpp), on branching nets:
// Split, Slice, Concat, Eltwise shortcuts, BatchNorm/Scale in place, labels read by losses.
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

#include "caffe/comet/plan.hpp"
#include "caffe/common.hpp"
#include "caffe/net.hpp"

#include "caffe/test/test_caffe_main.hpp"

namespace caffe {

namespace {

const char* kFill = " weight_filler { type: 'gaussian' std: 0.1 } ";

class CometPlanTest : public ::testing::Test {
 protected:
  virtual void SetUp() { Caffe::set_mode(Caffe::CPU); }

  void Build(const std::string& layers, const std::string& comet = "") {
    NetParameter np;
    CHECK(google::protobuf::TextFormat::ParseFromString("name: 'plan' " + layers, &np));
    np.mutable_state()->set_phase(TRAIN);
    net_.reset(new Net<float>(np));
    CHECK(google::protobuf::TextFormat::ParseFromString(comet, &param_));
    Plan();
  }
  void Plan(const CometAliases& data = CometAliases()) {
    plan_ = MakeCometPlan(*net_, param_, data, CometAliases());
  }
  int Blob(const std::string& name) const {
    for (int b = 0; b < net_->blob_names().size(); ++b)
      if (net_->blob_names()[b] == name) return b;
    ADD_FAILURE() << "no blob " << name;
    return 0;
  }
  int Layer(const std::string& name) const {
    for (int i = 0; i < net_->layer_names().size(); ++i)
      if (net_->layer_names()[i] == name) return i;
    ADD_FAILURE() << "no layer " << name;
    return 0;
  }
  // The entry storing a blob, or NULL when it stays dense.
  const CometPlanEntry* EntryOf(const std::string& blob) const {
    const int e = plan_.entry_of_blob[Blob(blob)];
    return e < 0 ? NULL : &plan_.entries[e];
  }
  CometActions::Action ActionOf(const std::string& blob) const {
    const CometPlanEntry* e = EntryOf(blob);
    return e ? e->action : CometActions::KEEP;
  }

  shared_ptr<Net<float> > net_;
  CometParameter param_;
  CometPlan plan_;
};

std::string Dummy(const std::string& shape, const std::string& label_shape) {
  return "layer { name: 'data' type: 'DummyData' top: 'data' top: 'label' dummy_data_param { "
         "shape { " + shape + " } shape { " + label_shape + " } "
         "data_filler { type: 'gaussian' } data_filler { type: 'constant' value: 1 } } } ";
}

std::string Conv(const std::string& name, const std::string& bottom, int out, int k = 3) {
  std::ostringstream os;
  os << "layer { name: '" << name << "' type: 'Convolution' bottom: '" << bottom << "' top: '"
     << name << "' convolution_param { num_output: " << out << " kernel_size: " << k
     << " pad: " << k / 2 << kFill << "} } ";
  return os.str();
}

std::string InPlace(const std::string& name, const std::string& type, const std::string& blob,
                    const std::string& extra = "") {
  return "layer { name: '" + name + "' type: '" + type + "' bottom: '" + blob + "' top: '" + blob +
         "' " + extra + " } ";
}

}  // namespace

// A branch through Split: the split's tops are the bottom's memory, so the group lives until
// the last branch has read it in forward, and is stored for the branch convolutions' backward.
TEST_F(CometPlanTest, SplitBranchesAreOneGroupStoredAfterTheLastBranch) {
  Build(Dummy("dim: 2 dim: 3 dim: 8 dim: 8", "dim: 2") + Conv("conv1", "data", 4) +
        InPlace("relu1", "ReLU", "conv1") + Conv("a", "conv1", 4) + Conv("b", "conv1", 4) +
        "layer { name: 'cat' type: 'Concat' bottom: 'a' bottom: 'b' top: 'cat' } "
        "layer { name: 'ip' type: 'InnerProduct' bottom: 'cat' top: 'ip' inner_product_param { "
        "num_output: 3" + kFill + "} } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ");
  const CometPlanEntry* e = EntryOf("conv1");
  ASSERT_TRUE(e);
  EXPECT_EQ(e->action, CometActions::LOSSY);
  EXPECT_TRUE(e->signs);  // relu1 reads its sign
  EXPECT_EQ(e->blob_ids.size(), 3u) << "conv1 and the two split tops";
  EXPECT_EQ(e->last_forward, Layer("b"));
  EXPECT_EQ(plan_.entry_of_blob[Blob("conv1_relu1_0_split_1")], plan_.entry_of_blob[Blob("conv1")]);
  EXPECT_EQ(e->last_backward, Layer("relu1"));  // the sign read comes last in backward
  // Concat's inputs are read by nobody in backward; its output is read by ip (lossy).
  EXPECT_EQ(ActionOf("a"), CometActions::RELEASE);
  EXPECT_EQ(ActionOf("cat"), CometActions::LOSSY);
  // data and label are a source's tops, the loss an output: never touched
  EXPECT_EQ(ActionOf("data"), CometActions::KEEP);
  EXPECT_EQ(ActionOf("label"), CometActions::KEEP);
  EXPECT_EQ(ActionOf("loss"), CometActions::KEEP);
}

// A label that reaches the loss through Slice is read by the loss's backward: it stays, exactly.
TEST_F(CometPlanTest, ALabelThroughSliceStaysForTheLossBackward) {
  Build("layer { name: 'data' type: 'DummyData' top: 'pair' dummy_data_param { "
        "shape { dim: 4 dim: 4 } data_filler { type: 'uniform' min: 0 max: 2 } } } "
        "layer { name: 'slice' type: 'Slice' bottom: 'pair' top: 'x' top: 'label' "
        "  slice_param { axis: 1 slice_point: 3 } } "
        "layer { name: 'flat' type: 'Flatten' bottom: 'label' top: 'flat' } "
        "layer { name: 'ip' type: 'InnerProduct' bottom: 'x' top: 'ip' inner_product_param { "
        "num_output: 2" + std::string(kFill) + "} } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'flat' top: 'loss' } "
        "layer { name: 'acc' type: 'Accuracy' bottom: 'ip' bottom: 'flat' top: 'acc' } ");
  EXPECT_EQ(ActionOf("flat"), CometActions::KEEP);
  EXPECT_EQ(ActionOf("label"), CometActions::KEEP) << "Flatten's top is the label's memory";
  EXPECT_EQ(plan_.data_group[Blob("flat")], plan_.data_group[Blob("label")]);
  EXPECT_EQ(plan_.diff_group[Blob("flat")], plan_.diff_group[Blob("label")]);
  // x is read by ip's backward: lossy; ip's output by nothing (the loss keeps its softmax)
  EXPECT_EQ(ActionOf("x"), CometActions::LOSSY);
}

// Power with an exponent other than 1 and 2 reads its output in backward.
TEST_F(CometPlanTest, PowerKeepsTheOutputItsBackwardReads) {
  Build(Dummy("dim: 2 dim: 3 dim: 8 dim: 8", "dim: 2") + Conv("conv1", "data", 4) +
        "layer { name: 'pow' type: 'Power' bottom: 'conv1' top: 'pow' power_param { power: 3 } } "
        "layer { name: 'pool' type: 'Pooling' bottom: 'pow' top: 'pool' pooling_param { "
        "pool: MAX kernel_size: 2 stride: 2 } } "
        "layer { name: 'ip' type: 'InnerProduct' bottom: 'pool' top: 'ip' inner_product_param { "
        "num_output: 3" + kFill + "} } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ");
  EXPECT_EQ(ActionOf("pow"), CometActions::KEEP);
  EXPECT_EQ(ActionOf("conv1"), CometActions::KEEP) << "Power's input is read exactly too";
}

// Sigmoid and TanH compute their derivative from their output: it is stored lossy for them (and
// for the layer above that reads it), under the derivative rule; a Sigmoid whose only backward
// reader is itself is stored for it alone. compress_type without them keeps them dense.
TEST_F(CometPlanTest, SigmoidAndTanHOutputsAreLossyUnderTheDerivativeRule) {
  const std::string net =
      Dummy("dim: 2 dim: 3 dim: 8 dim: 8", "dim: 2") + Conv("conv1", "data", 4) +
      "layer { name: 'sig1' type: 'Sigmoid' bottom: 'conv1' top: 'sig1' } " + Conv("conv2", "sig1", 4) +
      InPlace("tanh2", "TanH", "conv2") +
      "layer { name: 'pool' type: 'Pooling' bottom: 'conv2' top: 'pool' pooling_param { pool: AVE "
      "kernel_size: 2 stride: 2 } } "
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'pool' top: 'ip' inner_product_param { "
      "num_output: 3" + kFill + "} } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  Build(net);
  EXPECT_EQ(ActionOf("conv1"), CometActions::RELEASE) << "Sigmoid reads its output, not its input";
  ASSERT_EQ(ActionOf("sig1"), CometActions::LOSSY);
  const CometPlanEntry* s = EntryOf("sig1");
  EXPECT_EQ(s->name, "sig1+conv2");  // its readers in the net's order
  ASSERT_EQ(s->eb_layers.size(), 2u);
  EXPECT_EQ(plan_.bounds[s->eb_layers[0]].rule, CometPlanBound::DERIVATIVE);
  EXPECT_EQ(plan_.bounds[s->eb_layers[0]].layer, "sig1");
  EXPECT_TRUE(plan_.bounds[s->eb_layers[0]].adapt);
  EXPECT_EQ(plan_.bounds[s->eb_layers[1]].rule, CometPlanBound::WEIGHT_GRADIENT);
  EXPECT_EQ(s->last_backward, Layer("sig1"));
  // TanH in place: conv2's blob holds its output, read by TanH's backward alone (average pooling
  // reads nothing)
  ASSERT_EQ(ActionOf("conv2"), CometActions::LOSSY);
  const CometPlanEntry* t = EntryOf("conv2");
  ASSERT_EQ(t->eb_layers.size(), 1u);
  EXPECT_EQ(plan_.bounds[t->eb_layers[0]].rule, CometPlanBound::DERIVATIVE);
  EXPECT_EQ(t->last_forward, Layer("pool"));
  EXPECT_EQ(t->last_backward, Layer("tanh2"));

  Build(net, "compress_type: 'Convolution' compress_type: 'InnerProduct'");
  EXPECT_EQ(ActionOf("sig1"), CometActions::KEEP) << "Sigmoid's read is not lossy unless chosen";
  EXPECT_EQ(ActionOf("conv2"), CometActions::KEEP);
}

// ELU reads its output's values and takes its branch from their sign (patch 0042): not in place,
// nothing reads the input (released) and the output is lossy under the derivative rule with its
// sign mask; in place the same for the one blob. With alpha < 0 it reads its input's sign: that
// input is kept dense, not made a mask, which only ReLU's backward (the store's) can read.
TEST_F(CometPlanTest, ELUKeepsItsOutputsSignAndItsOutputLossy) {
  const std::string tail =
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'conv2' top: 'ip' inner_product_param { "
      "num_output: 3" + std::string(kFill) + "} } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  Build(Dummy("dim: 2 dim: 3 dim: 8 dim: 8", "dim: 2") + Conv("conv1", "data", 4) +
        "layer { name: 'elu1' type: 'ELU' bottom: 'conv1' top: 'e1' } " + Conv("conv2", "e1", 4) +
        InPlace("elu2", "ELU", "conv2") + tail);
  EXPECT_EQ(ActionOf("conv1"), CometActions::RELEASE);
  ASSERT_EQ(ActionOf("e1"), CometActions::LOSSY);
  EXPECT_TRUE(EntryOf("e1")->signs);
  EXPECT_EQ(plan_.bounds[EntryOf("e1")->eb_layers[0]].rule, CometPlanBound::DERIVATIVE);
  ASSERT_EQ(ActionOf("conv2"), CometActions::LOSSY);
  EXPECT_TRUE(EntryOf("conv2")->signs);
  EXPECT_EQ(EntryOf("conv2")->name, "elu2+ip");
  Build(Dummy("dim: 2 dim: 3 dim: 8 dim: 8", "dim: 2") + Conv("conv1", "data", 4) +
        "layer { name: 'elu1' type: 'ELU' bottom: 'conv1' top: 'e1' elu_param { alpha: -1 } } " +
        Conv("conv2", "e1", 4) + tail);
  EXPECT_EQ(ActionOf("conv1"), CometActions::KEEP);
  EXPECT_EQ(ActionOf("e1"), CometActions::LOSSY);
}

// PReLU reads its input's values (its slope's gradient) and exact signs (its input gradient): in
// place its own copy of the input (patch 0035), lossy with a sign mask under its weight rule, the
// blob being read by the next layer alone; not in place, its input blob, lossy with a sign mask.
TEST_F(CometPlanTest, PReLUInputsAreLossyWithTheirSigns) {
  Build(Dummy("dim: 2 dim: 3 dim: 8 dim: 8", "dim: 2") + Conv("conv1", "data", 4) +
        InPlace("prelu1", "PReLU", "conv1") + Conv("conv2", "conv1", 4) +
        "layer { name: 'prelu2' type: 'PReLU' bottom: 'conv2' top: 'p2' } "
        "layer { name: 'ip' type: 'InnerProduct' bottom: 'p2' top: 'ip' inner_product_param { "
        "num_output: 3" + kFill + "} } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ");
  ASSERT_EQ(ActionOf("conv1"), CometActions::LOSSY);
  EXPECT_FALSE(EntryOf("conv1")->signs) << "the blob holds PReLU's output, read by conv2 only";
  ASSERT_EQ(ActionOf("conv2"), CometActions::LOSSY);
  EXPECT_TRUE(EntryOf("conv2")->signs);
  EXPECT_EQ(EntryOf("conv2")->name, "prelu2");
  EXPECT_EQ(plan_.bounds[EntryOf("conv2")->eb_layers[0]].rule, CometPlanBound::WEIGHT_GRADIENT);
  EXPECT_TRUE(plan_.bounds[EntryOf("conv2")->eb_layers[0]].adapt) << "a slope's gradient";
  int copies = 0;
  for (int e = 0; e < plan_.entries.size(); ++e) {
    const CometPlanEntry& en = plan_.entries[e];
    if (en.layer != Layer("prelu1")) continue;
    ++copies;
    EXPECT_EQ(en.blob, "prelu1 copy");
    EXPECT_EQ(en.action, CometActions::LOSSY);
    EXPECT_TRUE(en.signs);
    ASSERT_EQ(en.eb_layers.size(), 1u);
    EXPECT_EQ(plan_.bounds[en.eb_layers[0]].layer, "prelu1");
    EXPECT_EQ(en.last_backward, Layer("prelu1"));
  }
  EXPECT_EQ(copies, 1);
}

// LRN within a channel, as in upstream's CIFAR-10 full net (pooling, ReLU in place, LRN, conv):
// its input is lossy with relu1's signs under LRN's rule, which follows conv2's (the reader of
// LRN's output); its output, which its backward never reads, is stored for conv2 alone; its
// three internal outputs are entries of their own, recomputed from the input.
TEST_F(CometPlanTest, LRNWithinAChannelStoresItsInputAndRecomputesItsInternals) {
  Build(Dummy("dim: 2 dim: 3 dim: 8 dim: 8", "dim: 2") + Conv("conv1", "data", 4) +
        "layer { name: 'pool1' type: 'Pooling' bottom: 'conv1' top: 'pool1' pooling_param { "
        "pool: MAX kernel_size: 2 stride: 2 } } " + InPlace("relu1", "ReLU", "pool1") +
        "layer { name: 'norm1' type: 'LRN' bottom: 'pool1' top: 'norm1' lrn_param { "
        "local_size: 3 alpha: 5e-05 beta: 0.75 norm_region: WITHIN_CHANNEL } } " +
        Conv("conv2", "norm1", 4) +
        "layer { name: 'ip' type: 'InnerProduct' bottom: 'conv2' top: 'ip' inner_product_param { "
        "num_output: 3" + kFill + "} } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ",
        "recompute_lrn: true");
  ASSERT_EQ(ActionOf("pool1"), CometActions::LOSSY);
  EXPECT_TRUE(EntryOf("pool1")->signs);
  const CometPlanBound& lrn = plan_.bounds[EntryOf("pool1")->eb_layers[0]];
  EXPECT_EQ(lrn.rule, CometPlanBound::LRN);
  ASSERT_GE(lrn.follow, 0);
  EXPECT_EQ(plan_.bounds[lrn.follow].layer, "conv2");
  ASSERT_EQ(ActionOf("norm1"), CometActions::LOSSY);
  EXPECT_EQ(EntryOf("norm1")->name, "conv2");
  const char* parts[] = {"norm1 squares", "norm1 means", "norm1 scale"};
  std::vector<int> own = plan_.private_of_layer[Layer("norm1")];
  ASSERT_EQ(own.size(), 3u);
  for (int p = 0; p < 3; ++p) {
    const CometPlanEntry& en = plan_.entries[own[p]];
    EXPECT_EQ(en.blob, parts[p]);
    EXPECT_EQ(en.part, p);
    EXPECT_EQ(en.action, CometActions::RECOMPUTE);
    EXPECT_TRUE(en.unread) << "the store computes LRN's backward from its input";
  }
  std::ostringstream log;
  log << DescribeCometPlan(plan_, *net_, param_);
  EXPECT_NE(log.str().find("blob norm1 means -> freed after norm1 forward, not read: the store "
                           "computes norm1's backward from its input"), std::string::npos)
      << log.str();
}

// A ReLU's zeros are one value in a BatchNorm's x_norm_, and sz makes their errors alike: such an
// x_norm_ is marked (batchnorm_moments.hpp), through a max pooling and a Split; after a
// Convolution or a leaky ReLU it is not.
TEST_F(CometPlanTest, ABatchNormAfterAReluHasTiesInItsXNorm) {
  Build(Dummy("dim: 2 dim: 3 dim: 8 dim: 8", "dim: 2") + Conv("conv1", "data", 4) +
        "layer { name: 'bn1' type: 'BatchNorm' bottom: 'conv1' top: 'bn1' } " +
        Conv("conv2", "bn1", 4) + InPlace("relu2", "ReLU", "conv2") +
        "layer { name: 'pool2' type: 'Pooling' bottom: 'conv2' top: 'pool2' pooling_param { "
        "pool: MAX kernel_size: 2 stride: 2 } } "
        "layer { name: 'bn2' type: 'BatchNorm' bottom: 'pool2' top: 'bn2' } "
        "layer { name: 'side' type: 'InnerProduct' bottom: 'pool2' top: 'side' "
        "inner_product_param { num_output: 3" + kFill + "} } " +
        Conv("conv3", "bn2", 4) +
        InPlace("relu3", "ReLU", "conv3", "relu_param { negative_slope: 0.1 }") +
        "layer { name: 'bn3' type: 'BatchNorm' bottom: 'conv3' top: 'bn3' } "
        "layer { name: 'ip' type: 'InnerProduct' bottom: 'bn3' top: 'ip' inner_product_param { "
        "num_output: 3" + kFill + "} } "
        "layer { name: 'sum' type: 'Eltwise' bottom: 'ip' bottom: 'side' top: 'sum' } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'sum' bottom: 'label' "
        "top: 'loss' } ");
  const char* bns[] = {"bn1", "bn2", "bn3"};
  for (int k = 0; k < 3; ++k) {
    const int i = Layer(bns[k]);
    EXPECT_GE(plan_.lossy_x_norm[i], 0) << bns[k] << "'s x_norm_ is stored lossy";
    EXPECT_EQ(plan_.x_norm_ties[i], k == 1) << bns[k];
  }
}

// A residual block: Convolution, BatchNorm, Scale and ReLU in place on one blob, a shortcut
// through Split, Eltwise SUM, ReLU in place, global average pooling.
TEST_F(CometPlanTest, AResidualBlockMasksAndCompressesWhatItCan) {
  Build(Dummy("dim: 2 dim: 4 dim: 8 dim: 8", "dim: 2") + Conv("conv1", "data", 4) +
        InPlace("bn1", "BatchNorm", "conv1") +
        InPlace("sc1", "Scale", "conv1", "scale_param { bias_term: true }") +
        InPlace("relu1", "ReLU", "conv1") + Conv("conv2", "conv1", 4) +
        InPlace("bn2", "BatchNorm", "conv2") +
        InPlace("sc2", "Scale", "conv2", "scale_param { bias_term: true }") +
        "layer { name: 'sum' type: 'Eltwise' bottom: 'conv1' bottom: 'conv2' top: 'sum' } " +
        InPlace("relu2", "ReLU", "sum") +
        "layer { name: 'gap' type: 'Pooling' bottom: 'sum' top: 'gap' pooling_param { pool: AVE "
        "global_pooling: true } } "
        "layer { name: 'ip' type: 'InnerProduct' bottom: 'gap' top: 'ip' inner_product_param { "
        "num_output: 3" + kFill + "} } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } "
        "layer { name: 'acc' type: 'Accuracy' bottom: 'ip' bottom: 'label' top: 'acc' } ");
  // conv1's blob: read by conv2 (values, lossy) and relu1 (sign); BatchNorm and Scale in place
  // read their own copies, the shortcut (Eltwise SUM) reads nothing.
  EXPECT_EQ(ActionOf("conv1"), CometActions::LOSSY);
  EXPECT_TRUE(EntryOf("conv1")->signs);
  // conv2's blob: read by nothing in backward (BatchNorm/Scale in place, Eltwise SUM)
  EXPECT_EQ(ActionOf("conv2"), CometActions::RELEASE);
  // the block's output: only relu2 reads it, by sign
  EXPECT_EQ(ActionOf("sum"), CometActions::MASK);
  EXPECT_EQ(ActionOf("gap"), CometActions::LOSSY);
  // conv2 and ip for their inputs (conv1 reads a source's top), bn1, bn2 and the Scales after
  // them for the BatchNorms' x_norm_
  EXPECT_EQ(plan_.bounds.size(), 6u);
  int xnorm = 0;
  for (int e = 0; e < plan_.entries.size(); ++e) {
    const CometPlanEntry& en = plan_.entries[e];
    if (en.blob == "bn1 x_norm" || en.blob == "bn2 x_norm") {
      ++xnorm;
      EXPECT_EQ(en.action, CometActions::LOSSY) << en.blob;
      ASSERT_EQ(en.eb_layers.size(), 2u) << en.blob << ": BatchNorm's bound and its Scale's";
      EXPECT_EQ(plan_.bounds[en.eb_layers[0]].rule, CometPlanBound::BATCHNORM);
      EXPECT_EQ(plan_.bounds[en.eb_layers[1]].layer, en.blob == "bn1 x_norm" ? "sc1" : "sc2");
      EXPECT_TRUE(plan_.bounds[en.eb_layers[1]].adapt);
    }
  }
  EXPECT_EQ(xnorm, 2);
}

// A layer class without a fact row keeps its blobs dense, and the plan says so.
TEST_F(CometPlanTest, ALayerWithoutARowKeepsItsBlobsDense) {
  Build("layer { name: 'data' type: 'DummyData' top: 'c' top: 'x' top: 'cont' top: 'label' "
        "dummy_data_param { shape { dim: 1 dim: 2 dim: 3 } shape { dim: 1 dim: 2 dim: 12 } "
        "shape { dim: 1 dim: 2 } shape { dim: 2 } data_filler { type: 'gaussian' } "
        "data_filler { type: 'gaussian' } data_filler { type: 'constant' value: 1 } "
        "data_filler { type: 'constant' value: 0 } } } "
        "layer { name: 'xin' type: 'InnerProduct' bottom: 'x' top: 'xin' inner_product_param { "
        "num_output: 12 axis: 2" + std::string(kFill) + "} } "
        "layer { name: 'unit' type: 'LSTMUnit' bottom: 'c' bottom: 'xin' bottom: 'cont' top: 'c1' "
        "top: 'h1' } "
        "layer { name: 'ip' type: 'InnerProduct' bottom: 'h1' top: 'ip' inner_product_param { "
        "num_output: 3 axis: 2" + kFill + "} } "
        "layer { name: 'silence' type: 'Silence' bottom: 'c1' } "
        "layer { name: 'flat' type: 'Reshape' bottom: 'ip' top: 'logits' reshape_param { "
        "shape { dim: 2 dim: 3 } } } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'logits' bottom: 'label' "
        "top: 'loss' } ");
  EXPECT_FALSE(plan_.facts[Layer("unit")].known);
  EXPECT_EQ(ActionOf("xin"), CometActions::KEEP);
  EXPECT_EQ(ActionOf("h1"), CometActions::KEEP);
  EXPECT_EQ(ActionOf("c1"), CometActions::KEEP);
  ASSERT_EQ(plan_.notes.size(), 1u);
  EXPECT_NE(plan_.notes[0].find("layer unit (LSTMUnit)"), std::string::npos) << plan_.notes[0];
  // Reshape's top is ip's memory at setup already, and its diff too
  EXPECT_EQ(plan_.data_group[Blob("logits")], plan_.data_group[Blob("ip")]);
}

// Sharing found at run time joins two groups: neither is freed while the other is needed.
TEST_F(CometPlanTest, AnAliasFoundAtRunTimeJoinsTheGroups) {
  Build(Dummy("dim: 2 dim: 3 dim: 8 dim: 8", "dim: 2") + Conv("conv1", "data", 4) +
        Conv("conv2", "conv1", 4) +
        "layer { name: 'ip' type: 'InnerProduct' bottom: 'conv2' top: 'ip' inner_product_param { "
        "num_output: 3" + kFill + "} } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ");
  EXPECT_NE(plan_.data_group[Blob("conv1")], plan_.data_group[Blob("ip")]);
  EXPECT_EQ(ActionOf("ip"), CometActions::RELEASE);
  Plan(CometAliases(1, std::make_pair(Blob("conv1"), Blob("ip"))));
  EXPECT_EQ(plan_.data_group[Blob("conv1")], plan_.data_group[Blob("ip")]);
  const CometPlanEntry* e = EntryOf("ip");
  ASSERT_TRUE(e);
  EXPECT_EQ(e, EntryOf("conv1"));
  EXPECT_EQ(e->last_forward, Layer("loss")) << "freed only after its last reader in either role";
  EXPECT_EQ(e->action, CometActions::LOSSY);
}

// A diff nobody writes (the Split top that feeds Accuracy) is never freed: the Split's backward
// reads its zeros every step.
TEST_F(CometPlanTest, DiffsNobodyWritesAreNotFreed) {
  Build(Dummy("dim: 2 dim: 3 dim: 4 dim: 4", "dim: 2") + Conv("conv1", "data", 4) +
        "layer { name: 'ip' type: 'InnerProduct' bottom: 'conv1' top: 'ip' inner_product_param { "
        "num_output: 3" + kFill + "} } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } "
        "layer { name: 'acc' type: 'Accuracy' bottom: 'ip' bottom: 'label' top: 'acc' } ");
  std::vector<int> freed;
  for (int i = 0; i < plan_.diff_release.size(); ++i)
    freed.insert(freed.end(), plan_.diff_release[i].begin(), plan_.diff_release[i].end());
  bool acc_split = false, conv1 = false;
  for (int k = 0; k < freed.size(); ++k) {
    const std::string& n = net_->blob_names()[freed[k]];
    if (n == "ip_ip_0_split_1") acc_split = true;
    if (n == "conv1") conv1 = true;
  }
  EXPECT_FALSE(acc_split) << "the diff feeding Accuracy holds zeros the Split reads";
  EXPECT_TRUE(conv1) << "conv1's diff is written by ip's backward and freed after conv1's";
}

// MVN's backward reads no input (patch 0037) and its output only to undo the variance's
// normalization: the input is freed after the forward; the output, read by conv2 for its
// weights' gradient, is kept for MVN (values, no lossy rule) or, for mean subtraction alone,
// stored lossy for conv2 alone. Its temp_, which each pass writes whole before reading, is freed
// after the forward and not rebuilt.
TEST_F(CometPlanTest, MVNKeepsNoInputAndItsOutputOnlyToNormalizeTheVariance) {
  const std::string tail =
      Conv("conv2", "mvn", 4) +
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'conv2' top: 'ip' inner_product_param { "
      "num_output: 3" + std::string(kFill) + "} } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  for (int normalize = 0; normalize < 2; ++normalize) {
    Build(Dummy("dim: 2 dim: 3 dim: 8 dim: 8", "dim: 2") + Conv("conv1", "data", 4) +
          "layer { name: 'mvn' type: 'MVN' bottom: 'conv1' top: 'mvn' mvn_param { "
          "normalize_variance: " + (normalize ? "true" : "false") + " } } " + tail);
    EXPECT_EQ(ActionOf("conv1"), CometActions::RELEASE) << "normalize_variance " << normalize;
    EXPECT_EQ(ActionOf("mvn"), normalize ? CometActions::KEEP : CometActions::LOSSY);
    const CometPlanEntry* temp = NULL;
    for (int e = 0; e < plan_.entries.size(); ++e)
      if (plan_.entries[e].blob == "mvn temp") temp = &plan_.entries[e];
    ASSERT_TRUE(temp != NULL) << "normalize_variance " << normalize;
    EXPECT_EQ(temp->action, CometActions::REBUILD);
    EXPECT_TRUE(temp->unread);
    EXPECT_NE(DescribeCometPlan(plan_, *net_, param_).find(
                  "blob mvn temp -> freed after mvn forward, not read: mvn's backward writes it anew"),
              std::string::npos);
  }
}

// SENet's channel attention: a Scale whose scale is its second bottom (a Sigmoid's output, one
// per sample and channel) reads its first bottom only for that scale's gradient, sum x dy per
// element: stored lossy under the weight rule, which watches the second bottom's gradient. The
// scale itself moves the first bottom's gradient directly and stays exact. A Scale with its own
// parameter, not in place, stores its input so too.
TEST_F(CometPlanTest, AScaleByASecondBottomStoresItsInputLossyAndItsScaleExactly) {
  Build(Dummy("dim: 2 dim: 3 dim: 8 dim: 8", "dim: 2") + Conv("conv1", "data", 4) +
        "layer { name: 'sc1' type: 'Scale' bottom: 'conv1' top: 'sc1' } "
        "layer { name: 'squeeze' type: 'Pooling' bottom: 'sc1' top: 'squeeze' pooling_param { "
        "pool: AVE global_pooling: true } } "
        "layer { name: 'excite' type: 'InnerProduct' bottom: 'squeeze' top: 'excite' "
        "inner_product_param { num_output: 4" + kFill + "} } " +
        InPlace("gate", "Sigmoid", "excite") +
        "layer { name: 'se' type: 'Scale' bottom: 'sc1' bottom: 'excite' top: 'se' "
        "scale_param { axis: 0 } } "
        "layer { name: 'ip' type: 'InnerProduct' bottom: 'se' top: 'ip' inner_product_param { "
        "num_output: 3" + kFill + "} } "
        "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ");
  const CometPlanEntry* conv1 = EntryOf("conv1");
  ASSERT_TRUE(conv1 != NULL);
  EXPECT_EQ(conv1->action, CometActions::LOSSY) << "sc1 reads it for its scale's gradient";
  const CometPlanEntry* sc1 = EntryOf("sc1");
  ASSERT_TRUE(sc1 != NULL);
  EXPECT_EQ(sc1->action, CometActions::LOSSY);
  EXPECT_EQ(sc1->name, "se") << "and not excite, which reads only 'squeeze'";
  ASSERT_EQ(sc1->eb_layers.size(), 1);
  const CometPlanBound& bd = plan_.bounds[sc1->eb_layers[0]];
  EXPECT_EQ(bd.rule, CometPlanBound::WEIGHT_GRADIENT);
  EXPECT_TRUE(bd.adapt);
  EXPECT_TRUE(EntryOf("excite") == NULL) << "the scale is kept exactly (dense)";
}

// A layer with frozen weights between learning ones runs a backward for its input's gradient,
// which needs the weights and the output's gradient, not the input (patch 0036): the frozen
// conv2 leaves relu1's signs the only backward read of conv1 (a mask, not lossy values), and a
// fixed upsampling Deconvolution (FCN's, lr_mult 0) leaves its input to be freed.
TEST_F(CometPlanTest, AFrozenLayerBetweenLearningOnesDoesNotKeepItsInput) {
  const std::string frozen = "param { lr_mult: 0 } param { lr_mult: 0 } ";
  const std::string tail =
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'up' top: 'ip' inner_product_param { "
      "num_output: 3" + std::string(kFill) + "} } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  const std::string conv2 =
      "layer { name: 'conv2' type: 'Convolution' bottom: 'conv1' top: 'conv2' " + frozen +
      "convolution_param { num_output: 4 kernel_size: 3 pad: 1" + kFill + "} } ";
  const std::string up =
      "layer { name: 'up' type: 'Deconvolution' bottom: 'conv2' top: 'up' param { lr_mult: 0 } "
      "convolution_param { num_output: 4 kernel_size: 2 stride: 2 group: 4 bias_term: false "
      "weight_filler { type: 'bilinear' } } } ";
  const std::string learning_up = "layer { name: 'up' type: 'Deconvolution' bottom: 'conv2' "
      "top: 'up' convolution_param { num_output: 4 kernel_size: 2 stride: 2" + std::string(kFill) +
      "} } ";
  const std::string learning_conv2 = Conv("conv2", "conv1", 4);
  for (int variant = 0; variant < 2; ++variant) {
    Build(Dummy("dim: 2 dim: 3 dim: 8 dim: 8", "dim: 2") + Conv("conv1", "data", 4) +
          InPlace("relu1", "ReLU", "conv1") + (variant ? learning_conv2 : conv2) +
          (variant ? learning_up : up) + tail);
    EXPECT_TRUE(net_->layer_need_backward()[Layer("conv2")]) << "conv1 learns below it";
    if (variant == 0) {
      EXPECT_EQ(ActionOf("conv1"), CometActions::MASK) << "conv2 (frozen) does not read it";
      EXPECT_EQ(ActionOf("conv2"), CometActions::RELEASE) << "up (frozen) does not read it";
    } else {  // the same net learning everywhere reads both
      EXPECT_EQ(ActionOf("conv1"), CometActions::LOSSY);
      EXPECT_EQ(ActionOf("conv2"), CometActions::LOSSY);
    }
  }
}

// Frozen layers (lr_mult 0, an input without gradient) run no backward: their blobs and private
// buffers are freed after their forward. A BatchNorm after them without ParamSpecs runs one all
// the same (Net counts its statistics as learnable): the plan says so and how to freeze it.
TEST_F(CometPlanTest, FrozenLayersFreeTheirBuffersAndAnUnfrozenBatchNormIsNamed) {
  const std::string frozen = "param { lr_mult: 0 } param { lr_mult: 0 } ";
  const std::string head =
      "layer { name: 'pool' type: 'Pooling' bottom: 'conv1' top: 'pool' pooling_param { "
      "pool: MAX kernel_size: 2 stride: 2 } } "
      "layer { name: 'ip' type: 'InnerProduct' bottom: 'pool' top: 'ip' inner_product_param { "
      "num_output: 3" + std::string(kFill) + "} } "
      "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' } ";
  const std::string conv1 =
      "layer { name: 'conv1' type: 'Convolution' bottom: 'data' top: 'conv1' " + frozen +
      "convolution_param { num_output: 4 kernel_size: 3 pad: 1" + kFill + "} } ";
  const std::string bn = "layer { name: 'bn1' type: 'BatchNorm' bottom: 'conv1' top: 'conv1' ";
  Build(Dummy("dim: 2 dim: 3 dim: 8 dim: 8", "dim: 2") + conv1 + bn +
        "param { lr_mult: 0 } param { lr_mult: 0 } param { lr_mult: 0 } } " + head);
  EXPECT_TRUE(plan_.notes.empty()) << plan_.notes[0];
  EXPECT_EQ(ActionOf("conv1"), CometActions::RELEASE) << "nothing below ip runs a backward";
  std::map<std::string, const CometPlanEntry*> buffers;
  for (int e = 0; e < plan_.entries.size(); ++e)
    if (plan_.entries[e].layer >= 0) buffers[plan_.entries[e].blob] = &plan_.entries[e];
  const char* names[] = {"bn1 temp", "bn1 x_norm", "pool argmax"};
  const CometActions::Action which[] = {CometActions::REBUILD, CometActions::KEEP,
                                        CometActions::ARGMAX};
  for (int b = 0; b < 3; ++b) {
    ASSERT_TRUE(buffers.count(names[b])) << names[b];
    const CometPlanEntry& e = *buffers[names[b]];
    EXPECT_EQ(e.action, CometActions::RELEASE) << names[b];
    EXPECT_EQ(e.buffer, which[b]) << names[b];
    EXPECT_EQ(e.last_forward, Layer(names[b] == std::string("pool argmax") ? "pool" : "bn1"));
    EXPECT_EQ(e.last_backward, -1) << names[b];
    for (int i = 0; i < plan_.after_backward.size(); ++i)
      for (int k = 0; k < plan_.after_backward[i].size(); ++k)
        EXPECT_NE(&plan_.entries[plan_.after_backward[i][k]], &e) << names[b];
  }

  Build(Dummy("dim: 2 dim: 3 dim: 8 dim: 8", "dim: 2") + conv1 + bn + "} " + head);
  ASSERT_EQ(plan_.notes.size(), 1u);
  EXPECT_NE(plan_.notes[0].find("layer bn1 (BatchNorm) runs a backward although nothing below"),
            std::string::npos) << plan_.notes[0];
  for (int e = 0; e < plan_.entries.size(); ++e) {  // stored for backwards that run for nothing
    if (plan_.entries[e].blob == "bn1 x_norm") EXPECT_EQ(plan_.entries[e].action, CometActions::LOSSY);
    if (plan_.entries[e].blob == "pool argmax") EXPECT_EQ(plan_.entries[e].action, CometActions::ARGMAX);
  }

  // Learning below (conv1 without lr_mult 0): BatchNorm's backward is needed, nothing to say.
  Build(Dummy("dim: 2 dim: 3 dim: 8 dim: 8", "dim: 2") + Conv("conv1", "data", 4) + bn + "} " +
        head);
  EXPECT_TRUE(plan_.notes.empty()) << plan_.notes[0];
}

}  // namespace caffe
