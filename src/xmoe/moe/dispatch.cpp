#include "xmoe/moe/dispatch.h"

namespace xmoe::moe {

namespace {

/// One process owns every expert: dispatch and combine hand the rows through unchanged.
class LocalDispatcher final : public Dispatcher {
 public:
  explicit LocalDispatcher(const DispatchConfig& c) : num_experts_(c.num_experts) {
    XMOE_CHECK(c.ep_size == 1, "[moe dispatch local] needs ep_size = 1, got {}", c.ep_size);
  }
  std::string_view name() const override { return "local"; }

  DispatchResult dispatch(const Tensor& rows, std::span<const int64_t> tpe) override {
    XMOE_CHECK(static_cast<int64_t>(tpe.size()) == num_experts_,
               "[moe dispatch local] {} counts for {} experts", tpe.size(), num_experts_);
    DispatchResult r;
    r.rows = rows;
    r.handle.send_tokens_per_expert.assign(tpe.begin(), tpe.end());
    r.handle.recv_tokens_per_expert.assign(tpe.begin(), tpe.end());
    r.handle.num_send_rows = r.handle.num_recv_rows = rows.size(0);
    r.handle.send_counts = r.handle.recv_counts = {rows.size(0)};
    return r;
  }
  Tensor combine(const Tensor& out, const DispatchHandle& h) override { return checked(out, h); }
  Tensor dispatch_backward(const Tensor& d, const DispatchHandle& h) override {
    return checked(d, h);
  }
  Tensor combine_backward(const Tensor& d, const DispatchHandle& h) override {
    return checked(d, h);
  }

 private:
  static Tensor checked(const Tensor& t, const DispatchHandle& h) {
    XMOE_CHECK(t.dim() == 2 && t.size(0) == h.num_recv_rows,
               "[moe dispatch local] {} does not match the handle's {} rows", t.str(),
               h.num_recv_rows);
    return t;
  }
  int64_t num_experts_;
};

std::unique_ptr<Dispatcher> not_yet(const DispatchConfig& c) {
  XMOE_FAIL("[moe] moe.dispatch = '{}' needs the comm layer, which is not implemented yet; use "
            "'local'",
            c.algorithm);
}

}  // namespace

DispatchRegistry& dispatch_registry() {
  static DispatchRegistry registry = [] {
    DispatchRegistry r("moe.dispatch");
    r.add("local", [](const DispatchConfig& c) -> std::unique_ptr<Dispatcher> {
      return std::make_unique<LocalDispatcher>(c);
    });
    r.add("all_to_all", not_yet);
    r.add("rbd", not_yet);
    return r;
  }();
  return registry;
}

std::unique_ptr<Dispatcher> make_dispatcher(const DispatchConfig& config) {
  return dispatch_registry().create(config.algorithm, config);
}

}  // namespace xmoe::moe
