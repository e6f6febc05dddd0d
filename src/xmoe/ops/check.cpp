#include "xmoe/ops/dispatch.h"
#include "xmoe/ops/ops.h"

namespace xmoe::ops {

void check_float(const char* op, const char* name, const Tensor& t) {
  detail::require_float(op, name, t);
}

void check_same_device(const char* op, const char* name, const Tensor& t, const char* ref_name,
                       const Tensor& ref) {
  detail::require_same_device(op, name, t, ref_name, ref);
}

void check_index_values(const char* op, const char* name, const Tensor& ids, int64_t limit,
                        bool allow_negative) {
  detail::check_index_values(op, name, ids, limit, allow_negative);
}

}  // namespace xmoe::ops
