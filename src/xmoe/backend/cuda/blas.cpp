// Dense and grouped GEMMs on cuBLAS (host code). Row-major C (M, N) = op(A) op(B) is computed as
// the column-major product C^T (N, M) = op(B)^T op(A)^T, i.e. cuBLAS gets (b, a) swapped, with
// the leading dimensions of the row-major storage. Math is f32 (CUBLAS_COMPUTE_32F: bf16 inputs
// use tensor cores with f32 accumulation; f32 inputs do not use TF32).
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xmoe/backend/cuda/check.h"
#include "xmoe/backend/cuda/kernels.h"
#include "xmoe/backend/cuda/sm90/grouped_gemm.h"
#include "xmoe/core/device_api.h"
#include "xmoe/core/env.h"
#include "xmoe/core/fp8.h"

/// CUBLAS_CHECK(cublasGemmEx(...)): throws xmoe::Error naming the call and the status.
#define CUBLAS_CHECK(call)                                                             \
  do {                                                                                 \
    const cublasStatus_t status_ = (call);                                             \
    XMOE_CHECK(status_ == CUBLAS_STATUS_SUCCESS, "[cublas] {} failed: {} ({})", #call, \
               cublasGetStatusString(status_), static_cast<int>(status_));             \
  } while (0)

namespace xmoe::cuda {

namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // cuBLAS' recommendation for Hopper

struct BlasContext {
  cublasHandle_t handle = nullptr;
  void* workspace = nullptr;
  // [inputs bf16][output bf16]: cleared once cublasGemmGroupedBatchedEx declines those dtypes
  bool grouped_supported[2][2] = {{true, true}, {true, true}};
  std::mutex mutex;  // one handle per stream: its calls are serialised
};

/// The cuBLAS handle of the current device and `stream`, bound to it once. Each stream has its
/// own handle and 32 MiB workspace: GEMMs on two streams (a SideStream's beside the compute
/// stream's) may run at once, and a shared workspace would be written by both. The workspaces
/// are held outside the caching allocator (they live as long as the process, not tensors).
BlasContext& blas_context(Stream stream) {
  static std::mutex mutex;
  // per device: stream -> context; leaked on purpose
  static auto* contexts = new std::vector<std::map<Stream, std::unique_ptr<BlasContext>>>();
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (contexts->size() <= static_cast<size_t>(device))
    contexts->resize(static_cast<size_t>(device) + 1);
  std::unique_ptr<BlasContext>& slot = (*contexts)[static_cast<size_t>(device)][stream];
  if (!slot) {
    auto ctx = std::make_unique<BlasContext>();
    CUBLAS_CHECK(cublasCreate(&ctx->handle));
    CUDA_CHECK(cudaMalloc(&ctx->workspace, kWorkspaceBytes));
    CUBLAS_CHECK(cublasSetMathMode(ctx->handle, CUBLAS_DEFAULT_MATH));
    // cublasSetStream resets the workspace to cuBLAS' own pool, so set ours after it.
    CUBLAS_CHECK(cublasSetStream(ctx->handle, stream));
    CUBLAS_CHECK(cublasSetWorkspace(ctx->handle, ctx->workspace, kWorkspaceBytes));
    slot = std::move(ctx);
  }
  return *slot;
}

cudaDataType_t cuda_type(DType dt, const char* op) {
  switch (dt) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    default:
      XMOE_FAIL("[{}] dtype {} has no cuBLAS path (expected f32 or bf16)", op, dtype_name(dt));
  }
}

int to_int(int64_t v, const char* op) {
  XMOE_CHECK(v >= 0 && v <= INT_MAX, "[{}] dimension {} exceeds the 32-bit cuBLAS API", op, v);
  return static_cast<int>(v);
}

void check_types(DType c_dt, DType ab_dt, const char* op) {
  XMOE_CHECK(c_dt == ab_dt || c_dt == DType::f32,
             "[{}] output dtype {} with inputs {}: expected the inputs' dtype or f32", op,
             dtype_name(c_dt), dtype_name(ab_dt));
}

// c = beta * c for an empty inner dimension (cuBLAS is not asked to handle k = 0).
void scale_output(void* c, DType c_dt, int64_t count, float beta, Stream stream) {
  if (beta == 0.f) {
    CUDA_CHECK(cudaMemsetAsync(c, 0, static_cast<size_t>(count) * dtype_size(c_dt), stream));
  } else if (beta != 1.f) {
    scale_inplace(c, c_dt, beta, count, stream);
  }
}

// One column-major cublasGemmEx for row-major c (m, n) = alpha op(a) op(b) + beta c.
void gemm_ex(cublasHandle_t handle, void* c, cudaDataType_t ct, const void* a, const void* b,
             cudaDataType_t abt, int m, int n, int k, bool ta, bool tb, int lda_rows, int ldb_rows,
             float alpha, float beta) {
  CUBLAS_CHECK(cublasGemmEx(handle, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                            n, m, k, &alpha, b, abt, ldb_rows, a, abt, lda_rows, &beta, c, ct, n,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

void gemm(void* c, DType c_dt, const void* a, const void* b, DType ab_dt, int64_t m, int64_t n,
          int64_t k, bool trans_a, bool trans_b, float alpha, float beta, Stream stream) {
  check_types(c_dt, ab_dt, "matmul");
  if (m == 0 || n == 0) return;
  if (k == 0) return scale_output(c, c_dt, m * n, beta, stream);
  BlasContext& ctx = blas_context(stream);
  std::lock_guard<std::mutex> lock(ctx.mutex);
  // Row-major leading dimensions: a is (M, K) or (K, M), b is (K, N) or (N, K).
  gemm_ex(ctx.handle, c, cuda_type(c_dt, "matmul"), a, b, cuda_type(ab_dt, "matmul"),
          to_int(m, "matmul"), to_int(n, "matmul"), to_int(k, "matmul"), trans_a, trans_b,
          to_int(trans_a ? m : k, "matmul"), to_int(trans_b ? k : n, "matmul"), alpha, beta);
}

namespace {

/// One GEMM per non-empty group, described for cublasGemmGroupedBatchedEx (column-major view:
/// C' (n', m') = op(A') op(B'), each problem its own group of batch size 1).
struct GroupedProblems {
  std::vector<cublasOperation_t> ta, tb;
  std::vector<int> m, n, k, lda, ldb, ldc, batch;
  std::vector<float> alpha, beta;
  std::vector<const void*> a, b;
  std::vector<void*> c;

  void add(cublasOperation_t op_a, cublasOperation_t op_b, int m_, int n_, int k_, const void* a_,
           int lda_, const void* b_, int ldb_, void* c_, int ldc_, float beta_) {
    ta.push_back(op_a);
    tb.push_back(op_b);
    m.push_back(m_);
    n.push_back(n_);
    k.push_back(k_);
    a.push_back(a_);
    lda.push_back(lda_);
    b.push_back(b_);
    ldb.push_back(ldb_);
    c.push_back(c_);
    ldc.push_back(ldc_);
    alpha.push_back(1.f);
    beta.push_back(beta_);
    batch.push_back(1);
  }
  size_t size() const { return m.size(); }
};

/// Runs the problems in one cublasGemmGroupedBatchedEx launch when cuBLAS takes the dtypes, else
/// (or once it has declined) as a loop of cublasGemmEx.
void run_grouped(GroupedProblems& p, cudaDataType_t abt, cudaDataType_t ct, Stream stream,
                 const char* op) {
  if (p.size() == 0) return;
  BlasContext& ctx = blas_context(stream);
  std::lock_guard<std::mutex> lock(ctx.mutex);
  bool& grouped = ctx.grouped_supported[abt == CUDA_R_16BF][ct == CUDA_R_16BF];
  if (grouped && p.size() > 1) {
    // The pointer arrays must be in device memory: one stream-ordered copy into a block of the
    // caching allocator, handed back right after (a later use on this stream is ordered after
    // the GEMM; cudaMemcpyAsync has staged the pageable source before it returns).
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    Allocator& alloc = backend::cuda_allocator(device);
    const size_t count = p.size(), bytes = 3 * count * sizeof(void*);
    std::vector<const void*> host(3 * count);
    for (size_t i = 0; i < count; ++i) {
      host[i] = p.a[i];
      host[count + i] = p.b[i];
      host[2 * count + i] = p.c[i];
    }
    void* dev = alloc.allocate(bytes);
    CUDA_CHECK(cudaMemcpyAsync(dev, host.data(), bytes, cudaMemcpyHostToDevice, stream));
    auto** ptrs = static_cast<void**>(dev);  // [a pointers | b pointers | c pointers]
    const cublasStatus_t status = cublasGemmGroupedBatchedEx(
        ctx.handle, p.ta.data(), p.tb.data(), p.m.data(), p.n.data(), p.k.data(), p.alpha.data(),
        ptrs, abt, p.lda.data(), ptrs + count, abt, p.ldb.data(), p.beta.data(), ptrs + 2 * count,
        ct, p.ldc.data(), static_cast<int>(count), p.batch.data(), CUBLAS_COMPUTE_32F);
    alloc.deallocate(dev, bytes);
    if (status == CUBLAS_STATUS_SUCCESS) return;
    XMOE_CHECK(status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE,
               "[{}] cublasGemmGroupedBatchedEx failed: {} ({})", op, cublasGetStatusString(status),
               static_cast<int>(status));
    grouped = false;  // this cuBLAS declines these dtypes: loop from now on
    spdlog::warn("[{}] cublasGemmGroupedBatchedEx declined ({}); using one cublasGemmEx per group",
                 op, cublasGetStatusString(status));
  }
  for (size_t i = 0; i < p.size(); ++i)
    CUBLAS_CHECK(cublasGemmEx(ctx.handle, p.ta[i], p.tb[i], p.m[i], p.n[i], p.k[i], &p.alpha[i],
                              p.a[i], abt, p.lda[i], p.b[i], abt, p.ldb[i], &p.beta[i], p.c[i], ct,
                              p.ldc[i], CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

const char* byte_ptr(const void* p) {
  return static_cast<const char*>(p);
}

/// XMOE_GROUPED_GEMM: `cutlass` (default) runs the expert GEMMs on the sm90 kernels where they
/// apply; `cublas` keeps them on cuBLAS (a comparison, or a GPU where CUTLASS misbehaves).
bool cutlass_grouped_enabled() {
  static const bool on = env::choice("XMOE_GROUPED_GEMM") != "cublas";
  return on;
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

/// Weight gradients reduce over each group's rows, so all of a group's (K/128) x (M/256) tiles
/// are as long as the group: one group far above the mean leaves a few SMs working after the
/// rest are done (measured at moe-1b's shapes: 1.7-1.9x slower with a quarter of the rows in one
/// group). Where a group's tiles cannot fill the GPU, groups longer than twice the mean are cut
/// into pieces of that many rows. XMOE_WEIGHT_GRAD_PIECE_ROWS=N sets the length (0: no cutting).
/// Returns the piece length, or 0 for no cutting.
int64_t weight_grad_piece_rows(const int64_t* group_sizes, int64_t groups, int64_t k, int64_t m,
                               int device) {
  static const int64_t forced = env::integer("XMOE_WEIGHT_GRAD_PIECE_ROWS").value_or(-1);
  if (forced >= 0) return forced;
  constexpr int64_t kTileM = 128, kTileN = 256, kMinPiece = 256;
  const int64_t tiles = ((k + kTileM - 1) / kTileM) * ((m + kTileN - 1) / kTileN);
  if (tiles >= sm90::sm_count(device) || groups < 1) return 0;
  int64_t total = 0;
  for (int64_t g = 0; g < groups; ++g) total += group_sizes[g];
  return std::max(kMinPiece, 2 * ((total + groups - 1) / groups));
}

/// The persistent kernel deals tiles to the SMs in list order, round robin; weight-gradient
/// tiles last as long as their problem's rows, so dealing the longest first evens the SMs' loads.
void sort_longest_first(sm90::ProblemList& list) {
  thread_local std::vector<std::array<int32_t, 4>> problems;
  problems.resize(static_cast<size_t>(list.count));
  for (int i = 0; i < list.count; ++i)
    problems[i] = {list.rows[i], list.group[i], list.row_start[i], list.partial[i]};
  std::stable_sort(problems.begin(), problems.end(),
                   [](const auto& a, const auto& b) { return a[0] > b[0]; });
  for (int i = 0; i < list.count; ++i) {
    list.rows[i] = problems[i][0];
    list.group[i] = problems[i][1];
    list.row_start[i] = problems[i][2];
    list.partial[i] = problems[i][3];
  }
}

/// Partial outputs of the pieces after a group's first: at most this many bytes (else no cutting).
constexpr size_t kMaxPartialBytes = size_t{512} << 20;

std::atomic<int64_t> g_sm90_calls[4], g_cublas_calls[4];

void count_call(GroupedGemmKind kind, bool sm90) {
  (sm90 ? g_sm90_calls : g_cublas_calls)[static_cast<int>(kind)].fetch_add(
      1, std::memory_order_relaxed);
}

/// An empty problem list of a call: the layer's K and M, its operands and output.
void start_list(sm90::ProblemList& list, int64_t k, int64_t m, const void* x, const void* w_or_dy,
                void* out) {
  list.count = 0;
  list.k = k;
  list.m = m;
  list.x = x;
  list.w_or_dy = w_or_dy;
  list.out = out;
  list.partials = nullptr;
}

/// The problems of a call: one per non-empty group, or, with piece > 0, groups longer than that
/// cut into pieces of `piece` rows, each after a group's first writing a partial output
/// (counted in `partials`; `sums` says which to add where; it may be null when piece is 0).
/// False where they do not fit the list (kMaxProblems, int rows).
bool fill_problems(sm90::ProblemList& list, sm90::PartialSums* sums, int64_t& partials,
                   const int64_t* group_sizes, int64_t groups, int64_t piece) {
  if (sums) sums->count = 0;
  partials = 0;
  int64_t row = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = group_sizes[g];
    if (row + rows > INT_MAX) return false;
    const int64_t step = piece > 0 && rows > piece ? piece : std::max<int64_t>(rows, 1);
    for (int64_t start = 0; start < rows; start += step) {
      if (list.count == sm90::kMaxProblems) return false;
      const int i = list.count++;
      list.group[i] = static_cast<int32_t>(g);
      list.rows[i] = static_cast<int32_t>(std::min(step, rows - start));
      list.row_start[i] = static_cast<int32_t>(row + start);
      list.partial[i] = start == 0 ? -1 : static_cast<int32_t>(partials++);
    }
    if (rows > step) {
      const int j = sums->count++;
      sums->group[j] = static_cast<int32_t>(g);
      sums->pieces[j] = static_cast<int32_t>((rows + step - 1) / step - 1);
      sums->first[j] = static_cast<int32_t>(partials) - sums->pieces[j];
    }
    row += rows;
  }
  return true;
}

/// One sm90 grouped GEMM over the non-empty groups of bf16 rows (weight gradients: over their
/// pieces, see weight_grad_piece_rows). Returns false, having queued nothing, where it does not
/// apply (no sm90 device, K or M not a multiple of 8, unaligned bases, more than kMaxProblems
/// groups, nothing to do): the caller then uses cuBLAS.
bool sm90_grouped(sm90::GroupedKind kind, void* out, const void* x, const void* w_or_dy,
                  const int64_t* group_sizes, int64_t groups, int64_t k, int64_t m, float beta,
                  Stream stream) {
  if (!cutlass_grouped_enabled() || k <= 0 || m <= 0 || k % 8 != 0 || m % 8 != 0 || k > INT_MAX ||
      m > INT_MAX || !aligned16(out) || !aligned16(x) || !aligned16(w_or_dy))
    return false;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  if (!sm90::supported(device)) return false;
  const bool weight_grad =
      kind == sm90::GroupedKind::weight_grad || kind == sm90::GroupedKind::weight_grad_bf16;
  // Partial outputs have dw's dtype.
  const size_t partial_size =
      dtype_size(kind == sm90::GroupedKind::weight_grad_bf16 ? DType::bf16 : DType::f32);
  int64_t piece = weight_grad ? weight_grad_piece_rows(group_sizes, groups, k, m, device) : 0;
  thread_local sm90::ProblemList list;  // 16 KB each: kept off the stack and off the heap
  thread_local sm90::PartialSums sums;
  int64_t partials = 0;  // pieces after a group's first: each a [K, M] partial output
  // Fills list (and sums); false if the problems do not fit.
  auto build = [&] {
    start_list(list, k, m, x, w_or_dy, out);
    return fill_problems(list, &sums, partials, group_sizes, groups, piece) &&
           static_cast<size_t>(partials) * static_cast<size_t>(k * m) * partial_size <=
               kMaxPartialBytes;
  };
  if (!build()) {
    if (piece == 0) return false;
    piece = 0;  // uncut groups may still fit
    if (!build()) return false;
  }
  if (list.count == 0) return false;
  if (weight_grad) sort_longest_first(list);
  const size_t bytes = sm90::scratch_bytes(kind, list, beta);
  if (bytes == 0) {  // CUTLASS's can_implement said no: unexpected once the checks above passed
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true))
      spdlog::warn(
          "[grouped_matmul] the sm90 kernel (kind {}) cannot take K = {}, M = {}, {} "
          "problems: cuBLAS instead",
          static_cast<int>(kind), k, m, list.count);
    return false;
  }
  Allocator& alloc = backend::cuda_allocator(device);
  void* scratch = alloc.allocate(bytes);
  const size_t partial_bytes = static_cast<size_t>(partials * k * m) * partial_size;
  if (sums.count > 0) {
    list.partials = alloc.allocate(partial_bytes);
    // All problems share beta: accumulating pieces start from zero.
    if (beta != 0.f) CUDA_CHECK(cudaMemsetAsync(list.partials, 0, partial_bytes, stream));
    sums.k = k;
    sums.m = m;
    sums.bf16 = kind == sm90::GroupedKind::weight_grad_bf16;
    sums.dw = out;
    sums.partials = list.partials;
  }
  sm90::run(kind, list, beta, scratch, stream);
  if (sums.count > 0) {
    sm90::add_partials(sums, stream);
    alloc.deallocate(list.partials, partial_bytes);
  }
  alloc.deallocate(scratch, bytes);  // stream-ordered: a later use on `stream` runs after the GEMM
  return true;
}

}  // namespace

// The FP8 kernel's scale blocks are the quantisers' (fp8.cu, cpu/fp8.cpp).
static_assert(sm90::kFp8Block == fp8::kBlock);

bool grouped_gemm_fp8(void* y, const uint8_t* x, const float* x_scales, const uint8_t* w,
                      const float* w_scales, const int64_t* group_sizes, int64_t groups, int64_t k,
                      int64_t n, Stream stream) {
  // The fallback (dequantised bf16 GEMMs) is correct but slower than bf16 experts: say why, once.
  const auto decline = [&](std::string_view why) {
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true))
      spdlog::warn(
          "[grouped_matmul_fp8] the sm90 FP8 kernel does not take K = {}, N = {} ({}): its "
          "operands are dequantised and multiplied in bf16, slower than bf16 experts",
          k, n, why);
    count_call(GroupedGemmKind::fp8, false);
    return false;
  };
  if (!cutlass_grouped_enabled())
    return decline("XMOE_GROUPED_GEMM=cublas turns the CUTLASS grouped GEMMs off");
  if (k <= 0 || n <= 0 || k % 16 != 0 || n % 16 != 0 || k > INT_MAX || n > INT_MAX)
    return decline("K and N must be positive multiples of 16");
  if (!aligned16(y) || !aligned16(x) || !aligned16(w))
    return decline("an operand is not 16-byte aligned");
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  if (!sm90::supported(device))
    return decline("no sm_90 GPU, or a build without CUTLASS (XMOE_CUTLASS off)");
  thread_local sm90::ProblemList list;
  start_list(list, k, n, x, w, y);
  int64_t partials = 0;  // none: no group is cut
  if (!fill_problems(list, nullptr, partials, group_sizes, groups, 0))
    return decline("over 2^31 rows, or more groups than one launch takes");
  if (list.count == 0) return true;  // no rows: nothing to write
  const size_t bytes = sm90::fp8_scratch_bytes(list);
  if (bytes == 0) return decline("CUTLASS refuses the problem list");
  Allocator& alloc = backend::cuda_allocator(device);
  void* scratch = alloc.allocate(bytes);
  sm90::fp8_run(list, sm90::Fp8Scales{x_scales, w_scales}, scratch, stream);
  alloc.deallocate(scratch, bytes);  // stream-ordered, as in sm90_grouped
  count_call(GroupedGemmKind::fp8, true);
  return true;
}

GroupedGemmCalls grouped_gemm_calls(GroupedGemmKind kind) {
  const int i = static_cast<int>(kind);
  return {g_sm90_calls[i].load(std::memory_order_relaxed),
          g_cublas_calls[i].load(std::memory_order_relaxed)};
}

bool grouped_gemm_sm90_available(int device) {
  return cutlass_grouped_enabled() && sm90::supported(device);
}

void grouped_gemm(void* y, const void* x, const void* w, DType dt, const int64_t* group_sizes,
                  int64_t groups, int64_t k, int64_t m, bool trans_w, Stream stream) {
  const char* op = "grouped_matmul";
  const GroupedGemmKind kind =
      trans_w ? GroupedGemmKind::forward_trans_w : GroupedGemmKind::forward;
  if (dt == DType::bf16 &&
      sm90_grouped(trans_w ? sm90::GroupedKind::forward_trans_w : sm90::GroupedKind::forward, y, x,
                   w, group_sizes, groups, k, m, 0.f, stream)) {
    count_call(kind, true);
    return;
  }
  count_call(kind, false);
  const size_t es = dtype_size(dt);
  const int ik = to_int(k, op), im = to_int(m, op);
  GroupedProblems p;
  int64_t row = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = group_sizes[g];
    if (rows > 0 && m > 0) {
      void* yg = static_cast<char*>(y) + static_cast<size_t>(row * m) * es;
      if (k == 0) {
        CUDA_CHECK(cudaMemsetAsync(yg, 0, static_cast<size_t>(rows * m) * es, stream));
      } else {
        // y_g (rows, M) = x_g (rows, K) @ w_g: column-major y_g^T (M, rows) = w_g^T x_g^T
        p.add(trans_w ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, im, to_int(rows, op), ik,
              byte_ptr(w) + static_cast<size_t>(g * k * m) * es, trans_w ? ik : im,
              byte_ptr(x) + static_cast<size_t>(row * k) * es, ik, yg, im, 0.f);
      }
    }
    row += rows;
  }
  run_grouped(p, cuda_type(dt, op), cuda_type(dt, op), stream, op);
}

namespace {

// Padded-batch limit: the strided batch computes groups x the largest group's rows; beyond this
// multiple of the real rows the per-group GEMMs waste less.
constexpr double kMaxPaddedWork = 1.5;

/// Weight gradients of bf16 rows into f32 (or bf16) in one launch. cuBLAS has no grouped launch for
/// bf16 x bf16 -> f32, and one GEMM per group (2 E per MoE layer) leaves the GPU idle: host cost
/// per call, and a fine-grained expert's K x M tile grid fills a quarter of an H200. So the rows
/// are padded per group to the largest group, [groups, cap, K] and [groups, cap, M] (zero rows add
/// nothing), and one strided-batched GEMM computes every group. Returns false (nothing done) where
/// it does not apply: other dtypes, one group, or routing too uneven (kMaxPaddedWork).
bool padded_weight_grad(size_t problems, void* dw, DType dw_dt, const void* x, const void* dy,
                        DType dt, const int64_t* group_sizes, int64_t groups, int64_t k, int64_t m,
                        bool accumulate, Stream stream, const char* op) {
  int64_t total = 0, cap = 0;
  for (int64_t g = 0; g < groups; ++g) {
    total += group_sizes[g];
    cap = std::max(cap, group_sizes[g]);
  }
  if (dt != DType::bf16 || problems < 2 || k == 0 || m == 0 ||
      static_cast<double>(cap * groups) > kMaxPaddedWork * static_cast<double>(total))
    return false;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  Allocator& alloc = backend::cuda_allocator(device);
  const size_t es = dtype_size(dt);
  std::vector<int64_t> offsets(static_cast<size_t>(groups) + 1, 0);
  for (int64_t g = 0; g < groups; ++g) offsets[g + 1] = offsets[g] + group_sizes[g];
  const size_t off_bytes = offsets.size() * sizeof(int64_t);
  const size_t xb = static_cast<size_t>(groups * cap * k) * es;
  const size_t yb = static_cast<size_t>(groups * cap * m) * es;
  void* off_dev = alloc.allocate(off_bytes);
  void* xp = alloc.allocate(xb);
  void* yp = alloc.allocate(yb);
  // Pageable source: the copy is staged before cudaMemcpyAsync returns.
  CUDA_CHECK(cudaMemcpyAsync(off_dev, offsets.data(), off_bytes, cudaMemcpyHostToDevice, stream));
  const auto* off = static_cast<const int64_t*>(off_dev);
  pad_groups(xp, x, dt, off, groups, cap, k, stream);
  pad_groups(yp, dy, dt, off, groups, cap, m, stream);
  BlasContext& ctx = blas_context(stream);
  {
    std::lock_guard<std::mutex> lock(ctx.mutex);
    const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
    // dw_g (K, M) = xp_g^T dyp_g: column-major dw_g^T (M, K) = dyp_g^T (M, cap) xp_g (cap, K)
    CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        ctx.handle, CUBLAS_OP_N, CUBLAS_OP_T, to_int(m, op), to_int(k, op), to_int(cap, op), &alpha,
        yp, CUDA_R_16BF, to_int(m, op), cap * m, xp, CUDA_R_16BF, to_int(k, op), cap * k, &beta, dw,
        cuda_type(dw_dt, op), to_int(m, op), k * m, to_int(groups, op), CUBLAS_COMPUTE_32F,
        CUBLAS_GEMM_DEFAULT));
  }
  // Stream-ordered reuse: later work on `stream` runs after the GEMM.
  alloc.deallocate(yp, yb);
  alloc.deallocate(xp, xb);
  alloc.deallocate(off_dev, off_bytes);
  return true;
}

}  // namespace

void grouped_gemm_weight_grad(void* dw, DType dw_dt, const void* x, const void* dy, DType dt,
                              const int64_t* group_sizes, int64_t groups, int64_t k, int64_t m,
                              bool accumulate, Stream stream) {
  const char* op = "grouped_matmul_weight_grad";
  check_types(dw_dt, dt, op);
  const size_t es = dtype_size(dt), ws = dtype_size(dw_dt);
  const int ik = to_int(k, op), im = to_int(m, op);
  // Overwriting: empty groups get zeros (no GEMM writes them); the GEMMs cover the rest.
  if (!accumulate && k * m > 0)
    for (int64_t g = 0; g < groups; ++g)
      if (group_sizes[g] <= 0)
        CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(dw) + static_cast<size_t>(g * k * m) * ws, 0,
                                   static_cast<size_t>(k * m) * ws, stream));
  if (dt == DType::bf16 &&
      sm90_grouped(dw_dt == DType::f32 ? sm90::GroupedKind::weight_grad
                                       : sm90::GroupedKind::weight_grad_bf16,
                   dw, x, dy, group_sizes, groups, k, m, accumulate ? 1.f : 0.f, stream)) {
    count_call(GroupedGemmKind::weight_grad, true);
    return;
  }
  count_call(GroupedGemmKind::weight_grad, false);
  GroupedProblems p;
  int64_t row = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = group_sizes[g];
    if (rows > 0 && k > 0 && m > 0) {
      // dw_g (K, M) = x_g^T (K, rows) @ dy_g (rows, M): column-major dw_g^T (M, K) = dy_g^T x_g
      void* dwg = static_cast<char*>(dw) + static_cast<size_t>(g * k * m) * ws;
      p.add(CUBLAS_OP_N, CUBLAS_OP_T, im, ik, to_int(rows, op),
            byte_ptr(dy) + static_cast<size_t>(row * m) * es, im,
            byte_ptr(x) + static_cast<size_t>(row * k) * es, ik, dwg, im, accumulate ? 1.f : 0.f);
    }
    row += rows;
  }
  if (padded_weight_grad(p.size(), dw, dw_dt, x, dy, dt, group_sizes, groups, k, m, accumulate,
                         stream, op))
    return;
  run_grouped(p, cuda_type(dt, op), cuda_type(dw_dt, op), stream, op);
}

}  // namespace xmoe::cuda
