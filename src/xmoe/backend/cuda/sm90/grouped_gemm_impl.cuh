#pragma once
// One CUTLASS 3 ptr-array grouped GEMM instantiation (see grouped_gemm.h). Each kind lives in a
// .cu of its own: a CUTLASS kernel is minutes of nvcc, and separate files build in parallel.
#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>

#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>
#include <type_traits>
#include <vector>

#include "xmoe/backend/cuda/cuda_check.cuh"
#include "xmoe/backend/cuda/sm90/grouped_gemm.h"

/// CUTLASS_STATUS_CHECK(gemm.run(stream)): throws xmoe::Error naming the call and the status.
#define CUTLASS_STATUS_CHECK(call)                                                         \
  do {                                                                                     \
    const cutlass::Status status_ = (call);                                                \
    if (status_ != cutlass::Status::kSuccess) [[unlikely]]                                 \
      ::xmoe::cuda::throw_cuda_error(#call, static_cast<int>(status_),                     \
                                     cutlassGetStatusString(status_), __FILE__, __LINE__); \
  } while (0)

namespace xmoe::cuda::sm90 {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using Shape3 = ProblemShape::UnderlyingProblemShape;  // (M, N, K) of one group

/// Carves 256-byte-aligned arrays, one after another, from the front of a scratch block.
struct ScratchCarver {
  char* next;
  static size_t align(size_t bytes) { return (bytes + 255) & ~size_t{255}; }
  template <class T>
  T* take(size_t count) {
    char* here = next;
    next += align(count * sizeof(T));
    return reinterpret_cast<T*>(here);
  }
};

/// Tile shape and schedules of one instantiation.
template <class TileShape_, class ClusterShape_, bool kPingpong>
struct TileConfig {
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  // Cooperative: two consumer warpgroups share each tile. Ping-pong: each warpgroup owns a tile
  // and one's epilogue overlaps the other's mainloop (pays where the epilogue is heavy).
  using KernelSchedule =
      std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule =
      std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                         cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};

/// Row-major activations and outputs; LayoutA / LayoutB say how A (M, K) and B (K, N) are stored.
/// kRowsAreK: the group's rows are the reduction (weight gradients) rather than M.
template <class LayoutA, class LayoutB, class ElementC, class ElementD, class Config,
          bool kRowsAreK_>
struct GroupedGemm {
  using TileShape = typename Config::TileShape;
  using ClusterShape = typename Config::ClusterShape;
  static constexpr bool kRowsAreK = kRowsAreK_;
  using Element = cutlass::bfloat16_t;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 8;  // 16 bytes: TMA's rule for addresses and strides
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  static constexpr int kAlignC =
      std::is_void_v<ElementC> ? kAlignD : 128 / cutlass::sizeof_bits<ElementC>::value;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD*, kAlignC,
      ElementD, LayoutD*, kAlignD, typename Config::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignAB, Element,
      LayoutB*, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Config::KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  static_assert(std::is_same_v<typename Kernel::InternalStrideC, StrideD>);

  /// The per-group arrays CUTLASS reads, carved from the front of the scratch block.
  struct Arrays {
    Shape3* shapes;
    const Element** a;
    const Element** b;
    ElementD** d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
  };

  static size_t arrays_bytes(int count) {
    const auto n = static_cast<size_t>(count);
    using C = ScratchCarver;
    return C::align(n * sizeof(Shape3)) + 3 * C::align(n * sizeof(void*)) +
           C::align(n * sizeof(StrideA)) + C::align(n * sizeof(StrideB)) +
           C::align(n * sizeof(StrideD));
  }
  static Arrays carve(void* scratch, int count) {
    const auto n = static_cast<size_t>(count);
    ScratchCarver c{static_cast<char*>(scratch)};
    Arrays r;
    r.shapes = c.take<Shape3>(n);
    r.a = c.take<const Element*>(n);
    r.b = c.take<const Element*>(n);
    r.d = c.take<ElementD*>(n);
    r.stride_a = c.take<StrideA>(n);
    r.stride_b = c.take<StrideB>(n);
    r.stride_d = c.take<StrideD>(n);
    return r;
  }

  /// Group i's (M, N, K): (rows, M, K) forward, (K, M, rows) for weight gradients.
  static CUTLASS_HOST_DEVICE Shape3 shape_of(const ProblemList& list, int i) {
    const int rows = list.rows[i], k = static_cast<int>(list.k), m = static_cast<int>(list.m);
    return kRowsAreK ? Shape3{k, m, rows} : Shape3{rows, m, k};
  }

  static cutlass::KernelHardwareInfo hardware(int device) {
    return cutlass::KernelHardwareInfo{device, sm_count(device)};  // 0: CUTLASS queries it
  }

  static typename Gemm::Arguments arguments(const ProblemList& list, const Shape3* host_shapes,
                                            const Arrays& arr, float beta, int device) {
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {list.count, arr.shapes, host_shapes},
                                  {arr.a, arr.stride_a, arr.b, arr.stride_b},
                                  {{}, nullptr, nullptr, arr.d, arr.stride_d},
                                  hardware(device)};
    const TileOrder order = tile_order();
    using Raster = decltype(args.scheduler.raster_order);
    args.scheduler.raster_order = order.raster == 1 ? Raster::AlongN : Raster::AlongM;
    args.scheduler.max_swizzle_size = order.swizzle;
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 1.f;
    fusion.beta = 0.f;
    if constexpr (!std::is_void_v<ElementC>) {
      // Accumulation reads the output in place: C and D are the same arrays.
      fusion.beta = beta;
      args.epilogue.ptr_C = const_cast<const ElementC**>(reinterpret_cast<ElementC**>(arr.d));
      args.epilogue.dC = arr.stride_d;
    }
    return args;
  }

  static std::vector<Shape3> host_shapes(const ProblemList& list) {
    std::vector<Shape3> shapes(static_cast<size_t>(list.count));
    for (int i = 0; i < list.count; ++i) shapes[static_cast<size_t>(i)] = shape_of(list, i);
    return shapes;
  }

  static size_t scratch_bytes(const ProblemList& list) {
    if (list.count <= 0 || list.count > kMaxProblems) return 0;
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    const std::vector<Shape3> shapes = host_shapes(list);
    // beta 0: with no arrays yet, C is null, and CUTLASS refuses beta != 0 without a source.
    const auto args = arguments(list, shapes.data(), Arrays{}, 0.f, device);
    if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return 0;
    return arrays_bytes(list.count) + Gemm::get_workspace_size(args);
  }

  static void run(const ProblemList& list, float beta, void* scratch, Stream stream);
};

/// Thread i writes group i's shape, operand pointers and strides.
template <class G>
__global__ void write_problems_kernel(const __grid_constant__ ProblemList list,
                                      typename G::Arrays arr) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= list.count) return;
  using Element = typename G::Element;
  using ElementD = std::remove_pointer_t<std::remove_pointer_t<decltype(arr.d)>>;
  const Shape3 shape = G::shape_of(list, i);
  const int gm = cute::get<0>(shape), gn = cute::get<1>(shape), gk = cute::get<2>(shape);
  const int64_t start = list.row_start[i], group = list.group[i], k = list.k, m = list.m;
  const auto* x = static_cast<const Element*>(list.x);
  const auto* other = static_cast<const Element*>(list.w_or_dy);
  auto* out = static_cast<ElementD*>(list.out);
  arr.shapes[i] = shape;
  arr.a[i] = x + start * k;
  if constexpr (G::kRowsAreK) {  // dw_g = x_g^T dy_g, or one piece of it into a partial
    arr.b[i] = other + start * m;
    const int32_t partial = list.partial[i];
    arr.d[i] = partial < 0 ? out + group * k * m
                           : static_cast<ElementD*>(list.partials) + int64_t{partial} * k * m;
  } else {  // y_g = x_g w_g
    arr.b[i] = other + group * k * m;
    arr.d[i] = out + start * m;
  }
  arr.stride_a[i] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {gm, gk, 1});
  arr.stride_b[i] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {gn, gk, 1});
  arr.stride_d[i] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {gm, gn, 1});
}

template <class LayoutA, class LayoutB, class ElementC, class ElementD, class Config,
          bool kRowsAreK>
void GroupedGemm<LayoutA, LayoutB, ElementC, ElementD, Config, kRowsAreK>::run(
    const ProblemList& list, float beta, void* scratch, Stream stream) {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  const Arrays arr = carve(scratch, list.count);
  constexpr int kThreads = 128;
  write_problems_kernel<GroupedGemm>
      <<<(list.count + kThreads - 1) / kThreads, kThreads, 0, stream>>>(list, arr);
  CUDA_CHECK_LAUNCH();
  // The host shapes size the persistent grid; CUTLASS reads them until run() returns.
  const std::vector<Shape3> shapes = host_shapes(list);
  const auto args = arguments(list, shapes.data(), arr, beta, device);
  void* workspace = static_cast<char*>(scratch) + arrays_bytes(list.count);
  Gemm gemm;
  CUTLASS_STATUS_CHECK(gemm.initialize(args, workspace, stream));
  CUTLASS_STATUS_CHECK(gemm.run(stream));
}

using Cluster1 = cute::Shape<cute::_1, cute::_1, cute::_1>;
// 128 x 256 tiles, 64-deep k-blocks, two consumer warpgroups of 64 x 256 each. On the H200 it
// matched or beat ping-pong 128 x 128, ping-pong 64 x 256 and a 2 x 1 cluster for every kind
// at the MoE shapes of docs/benchmarks.md, so all three kinds use it.
using Cooperative128x256 =
    TileConfig<cute::Shape<cute::_128, cute::_256, cute::_64>, Cluster1, false>;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

}  // namespace xmoe::cuda::sm90
