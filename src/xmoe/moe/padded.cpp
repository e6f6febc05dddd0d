#include "xmoe/moe/padded.h"

#include <cmath>

namespace xmoe::moe {

int64_t padded_capacity(float capacity_factor, int64_t tokens, int64_t top_k, int64_t experts) {
  const double c = std::ceil(static_cast<double>(capacity_factor) * static_cast<double>(tokens) *
                             static_cast<double>(top_k) / static_cast<double>(experts));
  return std::max<int64_t>(1, static_cast<int64_t>(c));
}

namespace {

class PaddedOrder final : public Order {
 public:
  explicit PaddedOrder(const MoeConfig& c)
      : Order(c.num_experts), capacity_factor_(c.capacity_factor) {
    XMOE_CHECK(capacity_factor_ > 0.f, "[moe] moe.capacity_factor = {} must be > 0",
               capacity_factor_);
  }
  std::string_view name() const override { return "padded"; }

 protected:
  int64_t capacity_for(int64_t tokens, int64_t top_k) const override {
    return padded_capacity(capacity_factor_, tokens, top_k, num_experts_);
  }

 private:
  float capacity_factor_;
};

}  // namespace

std::unique_ptr<Order> make_padded_order(const MoeConfig& config) {
  return std::make_unique<PaddedOrder>(config);
}

}  // namespace xmoe::moe
