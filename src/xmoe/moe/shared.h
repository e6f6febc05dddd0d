#pragma once
// Shared experts: an always-on SwiGLU FFN of width S*f (S = moe.num_shared_experts) beside the
// routed experts; its output is added to theirs. Dense parameters
//   "<prefix>.shared.gate_up" [d, 2*S*f],  "<prefix>.shared.down" [S*f, d].
#include <string>

#include "xmoe/core/parameter.h"

namespace xmoe::moe {

class SharedExperts : public Module {
 public:
  SharedExperts(const std::string& prefix, int64_t d_model, int64_t hidden, uint64_t seed,
                float init_std, float down_std);
  Tensor forward(const Tensor& x);    ///< x [T, d] -> [T, d]
  Tensor backward(const Tensor& dy);  ///< dy [T, d] -> dx [T, d]
  void release() { x_ = h_ = wgu_ = wd_ = Tensor(); }
  void collect_parameters(std::vector<Parameter*>& out) override {
    out.push_back(&gate_up_);
    out.push_back(&down_);
  }

 private:
  Parameter gate_up_, down_;
  Tensor x_, h_;
  Tensor wgu_, wd_;  // the weights in x's dtype (the parameters themselves when f32)
};

}  // namespace xmoe::moe
