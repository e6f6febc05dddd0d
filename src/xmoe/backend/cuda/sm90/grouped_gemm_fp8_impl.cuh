#pragma once
// The FP8 grouped GEMM of the expert layers (model.moe.expert_dtype = fp8, docs/fp8.md): CUTLASS
// 3's ptr-array kernel with block-scaled accumulation (e4m3 operands, per 1 x 128 scales of the
// rows and 128 x 128 of the weights applied to f32 partial sums at every 128-deep k-block), bf16
// output. Both operands are K-major (WGMMA's rule for 8-bit types), so y_g = x_g @ w_g^T with
// w_g stored [N, K]: the forward reads the transposed weight copy, the data gradient the plain.
// Templated on the tile, the cluster and the schedule; each configuration is instantiated in its
// own grouped_gemm_fp8_<config>.cu (XMOE_SM90_FP8_TILE picks one at run time).
#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>

#include <cute/tensor.hpp>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>
#include <vector>

#include "xmoe/backend/cuda/cuda_check.cuh"
#include "xmoe/backend/cuda/sm90/grouped_gemm_impl.cuh"

namespace xmoe::cuda::sm90 {

namespace detail {

/// Cooperative: two consumer warpgroups share each TileShape tile; ping-pong: each warpgroup
/// owns a TileShape tile and the two alternate between main loop and epilogue.
template <class TileShape_, class ClusterShape_, bool kPingpong>
struct Fp8Gemm {
  using ElementAB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using KernelSchedule = std::conditional_t<
      kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8BlockScaledAccum,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum>;
  using EpilogueSchedule =
      std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                         cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  // Scales: 1 x 128 (row, k-block) for A, 128 x 128 (n-block, k-block) for B, M/N-major.
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kFp8Block, kFp8Block>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  static constexpr int kAlignAB = 16;  // 16 bytes
  static constexpr int kAlignD = 8;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RowMajor*, kAlignD,
      ElementD, RowMajor*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB,
      cute::tuple<RowMajor*, LayoutSFA*>, kAlignAB, ElementAB,
      cute::tuple<ColumnMajor*, LayoutSFB*>, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;

  struct Arrays {
    Shape3* shapes;
    const ElementAB** a;
    const ElementAB** b;
    ElementD** d;
    const float** sfa;
    const float** sfb;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
    LayoutSFA* layout_sfa;
    LayoutSFB* layout_sfb;
  };

  static size_t arrays_bytes(int count) {
    const auto n = static_cast<size_t>(count);
    using C = ScratchCarver;
    return C::align(n * sizeof(Shape3)) + 5 * C::align(n * sizeof(void*)) +
           C::align(n * sizeof(StrideA)) + C::align(n * sizeof(StrideB)) +
           C::align(n * sizeof(StrideD)) + C::align(n * sizeof(LayoutSFA)) +
           C::align(n * sizeof(LayoutSFB));
  }
  static Arrays carve(void* scratch, int count) {
    const auto n = static_cast<size_t>(count);
    ScratchCarver c{static_cast<char*>(scratch)};
    return {c.take<Shape3>(n),    c.take<const ElementAB*>(n), c.take<const ElementAB*>(n),
            c.take<ElementD*>(n), c.take<const float*>(n),     c.take<const float*>(n),
            c.take<StrideA>(n),   c.take<StrideB>(n),          c.take<StrideD>(n),
            c.take<LayoutSFA>(n), c.take<LayoutSFB>(n)};
  }

  /// Group i's (M, N, K) = (rows, N, K).
  static CUTLASS_HOST_DEVICE Shape3 shape_of(const ProblemList& list, int i) {
    return Shape3{list.rows[i], static_cast<int>(list.m), static_cast<int>(list.k)};
  }

  static typename Gemm::Arguments arguments(const ProblemList& list, const Shape3* host_shapes,
                                            const Arrays& arr, int device) {
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {list.count, arr.shapes, host_shapes},
                                  {arr.a, arr.stride_a, arr.b, arr.stride_b, arr.sfa,
                                   arr.layout_sfa, arr.sfb, arr.layout_sfb},
                                  {{}, nullptr, nullptr, arr.d, arr.stride_d},
                                  cutlass::KernelHardwareInfo{device, sm_count(device)}};
    const TileOrder order = tile_order();
    using Raster = decltype(args.scheduler.raster_order);
    args.scheduler.raster_order = order.raster == 1 ? Raster::AlongN : Raster::AlongM;
    args.scheduler.max_swizzle_size = order.swizzle;
    args.epilogue.thread.alpha = 1.f;
    args.epilogue.thread.beta = 0.f;
    return args;
  }

  static std::vector<Shape3> host_shapes(const ProblemList& list) {
    std::vector<Shape3> shapes(static_cast<size_t>(list.count));
    for (int i = 0; i < list.count; ++i) shapes[static_cast<size_t>(i)] = shape_of(list, i);
    return shapes;
  }
};

/// Thread i writes group i's shape, operand and scale pointers, strides and scale layouts.
template <class Fp8Gemm>
__global__ void write_fp8_problems_kernel(const __grid_constant__ ProblemList list,
                                          const __grid_constant__ Fp8Scales scales,
                                          typename Fp8Gemm::Arrays arr) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= list.count) return;
  const Shape3 shape = Fp8Gemm::shape_of(list, i);
  const int gm = cute::get<0>(shape), gn = cute::get<1>(shape), gk = cute::get<2>(shape);
  const int64_t start = list.row_start[i], group = list.group[i], k = list.k, n = list.m;
  const int64_t kblocks = (k + kFp8Block - 1) / kFp8Block,
                nblocks = (n + kFp8Block - 1) / kFp8Block;
  arr.shapes[i] = shape;
  arr.a[i] = static_cast<const typename Fp8Gemm::ElementAB*>(list.x) + start * k;
  arr.b[i] = static_cast<const typename Fp8Gemm::ElementAB*>(list.w_or_dy) + group * n * k;
  arr.d[i] = static_cast<typename Fp8Gemm::ElementD*>(list.out) + start * n;
  arr.sfa[i] = static_cast<const float*>(scales.x) + start * kblocks;
  arr.sfb[i] = static_cast<const float*>(scales.w) + group * kblocks * nblocks;
  arr.stride_a[i] = cutlass::make_cute_packed_stride(typename Fp8Gemm::StrideA{}, {gm, gk, 1});
  arr.stride_b[i] = cutlass::make_cute_packed_stride(typename Fp8Gemm::StrideB{}, {gn, gk, 1});
  arr.stride_d[i] = cutlass::make_cute_packed_stride(typename Fp8Gemm::StrideD{}, {gm, gn, 1});
  arr.layout_sfa[i] = Fp8Gemm::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(gm, gn, gk, 1));
  arr.layout_sfb[i] = Fp8Gemm::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(gm, gn, gk, 1));
}

/// fp8_scratch_bytes and fp8_run for one configuration.
template <class Fp8Gemm>
size_t fp8_scratch_bytes(const ProblemList& list) {
  if (list.count <= 0 || list.count > kMaxProblems) return 0;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  const std::vector<Shape3> shapes = Fp8Gemm::host_shapes(list);
  const auto args = Fp8Gemm::arguments(list, shapes.data(), typename Fp8Gemm::Arrays{}, device);
  if (Fp8Gemm::Gemm::can_implement(args) != cutlass::Status::kSuccess) return 0;
  return Fp8Gemm::arrays_bytes(list.count) + Fp8Gemm::Gemm::get_workspace_size(args);
}

template <class Fp8Gemm>
void fp8_run(const ProblemList& list, const Fp8Scales& scales, void* scratch, Stream stream) {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  const typename Fp8Gemm::Arrays arr = Fp8Gemm::carve(scratch, list.count);
  constexpr int kThreads = 128;
  write_fp8_problems_kernel<Fp8Gemm>
      <<<(list.count + kThreads - 1) / kThreads, kThreads, 0, stream>>>(list, scales, arr);
  CUDA_CHECK_LAUNCH();
  const std::vector<Shape3> shapes = Fp8Gemm::host_shapes(list);
  const auto args = Fp8Gemm::arguments(list, shapes.data(), arr, device);
  void* workspace = static_cast<char*>(scratch) + Fp8Gemm::arrays_bytes(list.count);
  typename Fp8Gemm::Gemm gemm;
  CUTLASS_STATUS_CHECK(gemm.initialize(args, workspace, stream));
  CUTLASS_STATUS_CHECK(gemm.run(stream));
}

template <class Fp8Gemm>
Fp8Kernel fp8_kernel_of() {
  return {&fp8_scratch_bytes<Fp8Gemm>, &fp8_run<Fp8Gemm>};
}

}  // namespace detail

}  // namespace xmoe::cuda::sm90
