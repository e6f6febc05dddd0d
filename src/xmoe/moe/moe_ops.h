#pragma once
// Moved: the MoE row ops are declared in xmoe/ops/moe.h (namespace xmoe::ops), their CPU loops
// live in backend/cpu/moe.cpp. This header keeps the old names in xmoe::moe for code not yet
// switched (moe/layer.cpp, moe/dispatch_rbd.cpp, branches in flight); include xmoe/ops/moe.h
// instead, and delete this file once nothing includes it.
#include "xmoe/ops/moe.h"

namespace xmoe::moe {

using xmoe::ops::as_dtype;
using xmoe::ops::gather_rows_masked;
using xmoe::ops::gather_sum_rows;
using xmoe::ops::gather_weighted_rows_dot;
using xmoe::ops::L2NormResult;
using xmoe::ops::l2_normalize_rows;
using xmoe::ops::l2_normalize_rows_backward;
using xmoe::ops::put_along_rows_add;
using xmoe::ops::renormalize_rows;
using xmoe::ops::renormalize_rows_backward;
using xmoe::ops::row_dot_f32;
using xmoe::ops::scale_rows_;
using xmoe::ops::scatter_add_rows_masked;
using xmoe::ops::take_along_rows;
using xmoe::ops::transpose;
using xmoe::ops::WeightedGather;

}  // namespace xmoe::moe
