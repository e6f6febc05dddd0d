#include "xmoe/sched/profiler.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <fstream>

#include "xmoe/core/device_api.h"
#include "xmoe/core/error.h"
#include "xmoe/core/timer.h"
#include "xmoe/ops/fp8.h"
#include "xmoe/ops/model_ops.h"
#include "xmoe/ops/ops.h"
#include "xmoe/ops/optim.h"

namespace xmoe::sched {

namespace {

/// Sizes 2^lo, 2^(lo+step), ..., 2^hi are fitted; held out: 2^(e + step/2) for every other
/// fitted interval [e, e + step], so the check covers the whole range without doubling it.
struct Sweep {
  double lo, hi, step;
  std::vector<double> fitted() const {
    std::vector<double> s;
    for (double e = lo; e <= hi + 1e-9; e += step) s.push_back(std::round(std::exp2(e)));
    return s;
  }
  std::vector<double> heldout() const {
    std::vector<double> s;
    for (double e = lo; e + step <= hi + 1e-9; e += 2 * step)
      s.push_back(std::round(std::exp2(e + step / 2)));
    return s;
  }
};

struct Plan {
  Sweep comm, gemm_rows, row_bytes, attention_pairs;
  int warmup, reps;
};

Plan make_plan(bool quick, bool cuda) {
  if (quick) return {{10, 20, 2}, {4, 11, 1}, {12, 20, 2}, {0, 5, 1}, 1, 5};
  // On a GPU the expert GEMMs stay latency-bound to about 8k rows: the sweep reaches 128k (a
  // moe-1b layer routes 98k) so that the fit sees their throughput.
  const Sweep gemm_rows = cuda ? Sweep{6, 17, 1} : Sweep{4, 13, 1};
  return {{10, 26, 2}, gemm_rows, {12, 26, 2}, {0, 8, 1}, 2, 7};
}

std::string format_size(double x, std::string_view unit) {
  if (unit == "flop") return fmt::format("{:.3g} GFLOP", x / 1e9);
  if (x >= 1 << 20) return fmt::format("{:g} MiB", x / (1 << 20));
  if (x >= 1 << 10) return fmt::format("{:g} KiB", x / (1 << 10));
  return fmt::format("{:g} B", x);
}

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(" \t", colon + 1));
    }
  return "unknown CPU";
}

std::string utc_date(std::time_t now) {
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

/// A grouped GEMM's model of `task` over w [groups, in, out] in `dtype`, before its sweep.
TaskModel gemm_model(Task task, GemmShape shape, int64_t groups, std::string dtype) {
  TaskModel m;
  m.task = task;
  m.in = shape.in;
  m.out = shape.out;
  m.groups = groups;
  m.dtype = std::move(dtype);
  return m;
}

/// `rows` split over `groups` experts as evenly as they go (the first rows % groups one more).
std::vector<int64_t> even_groups(int64_t rows, int64_t groups) {
  std::vector<int64_t> sizes(static_cast<size_t>(groups), rows / groups);
  for (int64_t g = 0; g < rows % groups; ++g) ++sizes[static_cast<size_t>(g)];
  return sizes;
}

/// Runs the measurements; each one is agreed over the world (max over ranks per repetition).
class Profiler {
 public:
  Profiler(const std::shared_ptr<comm::Group>& world, Device device, const ProfileOptions& options)
      : world_(world),
        device_(device),
        options_(options),
        plan_(make_plan(options.quick, device.is_cuda())) {}

  Profile run();

 private:
  /// Median over repetitions of the slowest rank's time of `op`, timed on `group`.
  template <typename Op>
  double time(comm::Group& group, Op&& op);
  /// Fits `x -> seconds` over the plan's sizes (`measure(x)` returns the size it really used
  /// and its time).
  template <typename Measure>
  void sweep(TaskModel& model, const Sweep& sweep, const std::string& label, Measure&& measure);
  void collectives(const std::shared_ptr<comm::Group>& group, comm::LinkClass link);
  void gemms(GemmShape shape);
  /// The FP8 experts' GEMMs (forward and data gradient; operands quantised beforehand, as the
  /// quantising passes time on their own: quantize_rows()).
  void fp8_gemms(GemmShape shape);
  void quantize_rows();
  void attention(AttentionShape shape);
  void rows();
  void adamw();
  void step(const std::string& label);
  /// A tensor of `shape` in the compute dtype on the device, every element 0.01 (small values
  /// keep accumulating outputs finite over every repetition).
  Tensor filled(Shape shape) const {
    return ops::cast(Tensor::full(std::move(shape), 0.01f, device_), compute_dtype_);
  }

  std::shared_ptr<comm::Group> world_;
  Device device_;
  const ProfileOptions& options_;
  Plan plan_;
  DType compute_dtype_ = DType::f32;
  Profile profile_;
  int done_ = 0, total_ = 0;
};

template <typename Op>
double Profiler::time(comm::Group& group, Op&& op) {
  for (int i = 0; i < plan_.warmup; ++i) op();
  backend::synchronize(device_);
  std::vector<float> seconds(static_cast<size_t>(plan_.reps));
  for (float& s : seconds) {
    group.barrier();
    const Timer timer;
    op();
    backend::synchronize(device_);
    s = static_cast<float>(timer.seconds());
  }
  Tensor slowest = Tensor::from_vector(seconds, {plan_.reps}, world_->device());
  world_->all_reduce(slowest, comm::ReduceOp::max);
  const Tensor on_host = slowest.to(Device::cpu());
  std::vector<float> host(on_host.span<float>().begin(), on_host.span<float>().end());
  std::sort(host.begin(), host.end());
  if (options_.statistic == "min") return host.front();
  const size_t h = host.size() / 2;
  return host.size() % 2 ? host[h] : 0.5 * (host[h - 1] + host[h]);
}

void Profiler::step(const std::string& label) {
  ++done_;
  if (options_.progress) options_.progress({done_, total_, label});
}

template <typename Measure>
void Profiler::sweep(TaskModel& model, const Sweep& s, const std::string& label,
                     Measure&& measure) {
  const std::string_view unit = task_unit(model.task);
  for (double x : s.fitted()) {
    const auto [used, seconds] = measure(x);
    model.x.push_back(used);
    model.t.push_back(seconds);
    step(fmt::format("{} {}", label, format_size(used, unit)));
  }
  for (double x : s.heldout()) {
    const auto [used, seconds] = measure(x);
    model.heldout_x.push_back(used);
    model.heldout_t.push_back(seconds);
    step(fmt::format("{} {} (held out)", label, format_size(used, unit)));
  }
  model.fit =
      fit_linear(model.x, model.t, std::string(unit), {.relative = true, .non_negative = true});
  profile_.models.push_back(std::move(model));
}

void Profiler::collectives(const std::shared_ptr<comm::Group>& group, comm::LinkClass link) {
  const int p = group->size();
  constexpr int64_t kWidth = 16;  // f32 elements per row: 64-byte rows
  constexpr double kRowBytes = kWidth * 4;
  const auto rows_for = [&](double bytes, int64_t multiple) {
    const int64_t rows = std::max<int64_t>(1, std::llround(bytes / kRowBytes / multiple));
    return rows * multiple;
  };
  for (Task task : {Task::all_to_all_v, Task::all_gather, Task::reduce_scatter, Task::all_reduce}) {
    TaskModel model;
    model.task = task;
    model.link = link;
    model.ranks = p;
    model.dtype = "f32";
    const std::string label = fmt::format("{} {}", task_name(task), link_name(link));
    sweep(model, plan_.comm, label, [&](double bytes) -> std::pair<double, double> {
      comm::Group& g = *group;
      if (task == Task::all_to_all_v) {
        const int64_t rows = rows_for(bytes, p);
        Tensor send = Tensor::zeros({rows, kWidth}, DType::f32, device_);
        const std::vector<int64_t> counts(static_cast<size_t>(p), rows / p);
        return {rows * kRowBytes, time(g, [&] { g.all_to_all_v(send, counts, counts); })};
      }
      if (task == Task::all_gather) {
        const int64_t rows = rows_for(bytes, p) / p;
        Tensor mine = Tensor::zeros({rows, kWidth}, DType::f32, device_);
        return {rows * p * kRowBytes, time(g, [&] { g.all_gather(mine); })};
      }
      if (task == Task::reduce_scatter) {
        const int64_t rows = rows_for(bytes, p);
        Tensor full = Tensor::zeros({rows, kWidth}, DType::f32, device_);
        return {rows * kRowBytes, time(g, [&] { g.reduce_scatter(full); })};
      }
      const int64_t rows = rows_for(bytes, 1);
      Tensor t = Tensor::zeros({rows, kWidth}, DType::f32, device_);
      return {rows * kRowBytes, time(g, [&] { g.all_reduce(t); })};
    });
  }
}

void Profiler::gemms(GemmShape shape) {
  const int64_t G = options_.gemm_groups;
  const Tensor w = filled({G, shape.in, shape.out});
  // An f32 weight gradient, the default model.moe.expert_grad_dtype.
  Tensor dw = Tensor::zeros({G, shape.in, shape.out}, DType::f32, device_);
  for (Task task : {Task::gemm_forward, Task::gemm_backward_data, Task::gemm_backward_weight}) {
    TaskModel model = gemm_model(task, shape, G, std::string(dtype_name(compute_dtype_)));
    const std::string label = fmt::format("{} {}x{}", task_name(task), shape.in, shape.out);
    sweep(model, plan_.gemm_rows, label, [&](double rows_d) -> std::pair<double, double> {
      const int64_t rows = std::max<int64_t>(1, std::llround(rows_d));
      const std::vector<int64_t> sizes = even_groups(rows, G);
      const Tensor x = filled({rows, shape.in});
      const Tensor dy = filled({rows, shape.out});
      const double flops = 2.0 * static_cast<double>(rows) * shape.in * shape.out;
      comm::Group& g = *world_;
      if (task == Task::gemm_forward)
        return {flops, time(g, [&] { ops::grouped_matmul(x, w, sizes); })};
      if (task == Task::gemm_backward_data)
        return {flops, time(g, [&] { ops::grouped_matmul(dy, w, sizes, true); })};
      return {flops, time(g, [&] { ops::grouped_matmul_weight_grad(dw, x, dy, sizes, false); })};
    });
  }
}

void Profiler::fp8_gemms(GemmShape shape) {
  const int64_t G = options_.gemm_groups;
  const ops::Fp8Weights w = ops::quantize_weights_fp8(filled({G, shape.in, shape.out}));
  for (Task task : {Task::gemm_forward, Task::gemm_backward_data}) {
    const bool data_grad = task == Task::gemm_backward_data;
    TaskModel model = gemm_model(task, shape, G, "fp8");
    const std::string label = fmt::format("{} {}x{} fp8", task_name(task), shape.in, shape.out);
    sweep(model, plan_.gemm_rows, label, [&](double rows_d) -> std::pair<double, double> {
      const int64_t rows = std::max<int64_t>(1, std::llround(rows_d));
      const std::vector<int64_t> sizes = even_groups(rows, G);
      // forward: x [rows, in] @ w; data gradient: dy [rows, out] @ w^T
      const ops::Fp8Rows x =
          ops::quantize_rows_fp8(filled({rows, data_grad ? shape.out : shape.in}), sizes);
      Tensor y = Tensor::empty({rows, data_grad ? shape.in : shape.out}, compute_dtype_, device_);
      const double flops = 2.0 * static_cast<double>(rows) * shape.in * shape.out;
      return {flops, time(*world_, [&] { ops::grouped_matmul_fp8_into(y, x, w, data_grad); })};
    });
  }
}

void Profiler::quantize_rows() {
  // Rows of whole 128-column blocks (as the experts' d and f are), at least the row width.
  const int64_t W = std::max<int64_t>(128, (options_.row_width + 127) / 128 * 128);
  const double elem = static_cast<double>(dtype_size(compute_dtype_));
  // Read in the compute dtype; written: a byte an element and an f32 scale per 128.
  const double row_bytes = static_cast<double>(W) * (elem + 1) + static_cast<double>(W) / 32;
  TaskModel model;
  model.task = Task::quantize_rows_fp8;
  model.width = W;
  model.dtype = std::string(dtype_name(compute_dtype_));
  sweep(model, plan_.row_bytes, std::string(task_name(model.task)),
        [&](double bytes) -> std::pair<double, double> {
          const int64_t n = std::max<int64_t>(1, std::llround(bytes / row_bytes));
          const Tensor x = filled({n, W});
          const int64_t groups[] = {n};
          return {static_cast<double>(n) * row_bytes,
                  time(*world_, [&] { (void)ops::quantize_rows_fp8(x, groups); })};
        });
}

void Profiler::attention(AttentionShape shape) {
  const int64_t S = shape.seq_len, hd = shape.head_dim;
  for (Task task : {Task::attention_forward, Task::attention_backward}) {
    TaskModel model;
    model.task = task;
    model.head_dim = hd;
    model.seq_len = S;
    model.dtype = std::string(dtype_name(compute_dtype_));
    const std::string label = fmt::format("{} hd{} s{}", task_name(task), hd, S);
    sweep(model, plan_.attention_pairs, label, [&](double pairs_d) -> std::pair<double, double> {
      // pairs sequences of one head: q, k, v [pairs, S, 1, hd]
      const int64_t pairs = std::max<int64_t>(1, std::llround(pairs_d));
      const Tensor q = filled({pairs, S, 1, hd});
      const double flops = 4.0 * static_cast<double>(pairs) * S * S * hd;
      comm::Group& g = *world_;
      if (task == Task::attention_forward)
        return {flops, time(g, [&] { ops::attention(q, q, q, true); })};
      const ops::AttentionResult r = ops::attention(q, q, q, true);
      return {flops, time(g, [&] { ops::attention_backward(q, q, q, r.out, r.lse, q, true); })};
    });
  }
}

void Profiler::adamw() {
  TaskModel model;
  model.task = Task::adamw;
  model.dtype = "f32";
  sweep(model, plan_.row_bytes, "adamw", [&](double bytes) -> std::pair<double, double> {
    const int64_t n = std::max<int64_t>(1, std::llround(bytes / 16));
    // As training holds them: f32 master, gradient and moments; a bf16 copy on CUDA.
    ops::AdamWTensors t{Tensor::full({n}, 0.01f, device_),
                        Tensor::full({n}, 0.01f, device_),
                        Tensor::zeros({n}, DType::f32, device_),
                        Tensor::zeros({n}, DType::f32, device_),
                        Tensor(),
                        true};
    if (device_.is_cuda()) t.param_bf16 = Tensor::zeros({n}, DType::bf16, device_);
    const ops::AdamWStep step{.lr = 1e-4f,
                              .beta1 = 0.9f,
                              .beta2 = 0.95f,
                              .eps = 1e-8f,
                              .weight_decay = 0.1f,
                              .bc1 = 0.1f,
                              .bc2 = 0.05f};
    return {16.0 * static_cast<double>(n),
            time(*world_, [&] { ops::adamw_step(std::span(&t, 1), step); })};
  });
}

void Profiler::rows() {
  const int64_t W = options_.row_width;
  const double row_bytes = static_cast<double>(W * dtype_size(compute_dtype_));
  for (Task task : {Task::gather_rows, Task::scatter_rows}) {
    TaskModel model;
    model.task = task;
    model.width = W;
    model.dtype = std::string(dtype_name(compute_dtype_));
    sweep(
        model, plan_.row_bytes, std::string(task_name(task)),
        [&](double bytes) -> std::pair<double, double> {
          const int64_t n = std::max<int64_t>(1, std::llround(bytes / row_bytes));
          // A scattered pattern (as routing gives), not a sequential copy.
          std::vector<int32_t> idx(static_cast<size_t>(n));
          for (int64_t i = 0; i < n; ++i)
            idx[static_cast<size_t>(i)] = static_cast<int32_t>((i * 2654435761ll) % n);
          const Tensor index = Tensor::from_vector(idx, {n}, device_);
          const Tensor src = filled({n, W});
          comm::Group& g = *world_;
          if (task == Task::gather_rows)
            return {n * row_bytes, time(g, [&] { ops::gather_rows(src, index); })};
          // An f32 destination, as I-Order adds bf16 expert rows into the f32 residual.
          Tensor out = Tensor::zeros({n, W}, DType::f32, device_);
          const Tensor weight = Tensor::full({n}, 0.5f, device_);
          return {n * row_bytes, time(g, [&] { ops::scatter_add_rows(out, src, index, weight); })};
        });
  }
}

Profile Profiler::run() {
  XMOE_CHECK(options_.gemm_groups >= 1 && options_.row_width >= 1,
             "[profile] gemm groups {} and row width {} must be >= 1", options_.gemm_groups,
             options_.row_width);
  XMOE_CHECK(options_.statistic == "median" || options_.statistic == "min",
             "[profile] statistic '{}' is not median or min", options_.statistic);
  XMOE_CHECK(world_->size() == 1 || world_->device() == device_,
             "[profile] the {} group moves tensors on {}, but the profile is for {}",
             world_->backend_name(), world_->device().str(), device_.str());
  compute_dtype_ = device_.is_cuda() ? DType::bf16 : DType::f32;
  const std::vector<GemmShape> shapes = options_.gemm_shapes.empty()
                                            ? default_gemm_shapes(device_, options_.quick)
                                            : options_.gemm_shapes;
  const std::vector<AttentionShape> attention_shapes =
      options_.attention_shapes.empty() ? default_attention_shapes(device_, options_.quick)
                                        : options_.attention_shapes;

  const comm::Topology& topo = world_->topology();
  const int rank = world_->rank();
  int most_on_a_node = 0;
  for (int node = 0; node < topo.num_nodes(); ++node)
    most_on_a_node = std::max(most_on_a_node, static_cast<int>(topo.ranks_on(node).size()));
  const bool intra = most_on_a_node > 1;
  const bool inter = topo.num_nodes() > 1;

  Machine& m = profile_.machine;
  m.device = device_.is_cuda() ? "cuda" : "cpu";
  m.device_name = device_.is_cuda() ? backend::cuda_device_name(device_.index) : cpu_model_name();
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  m.host = host;
  m.backend = world_->backend_name();
  m.world_size = world_->size();
  m.nodes = topo.num_nodes();
  m.ranks_per_node = most_on_a_node;
  // Rank 0's clock: ranks start a little apart and must write the same profile.
  Tensor start = Tensor::from_vector<int64_t>({static_cast<int64_t>(std::time(nullptr))}, {1})
                     .to(world_->device());
  world_->all_reduce(start, comm::ReduceOp::min);
  m.date = utc_date(static_cast<std::time_t>(start.to(Device::cpu()).data<int64_t>()[0]));
  m.xmoe_version = XMOE_VERSION;
  profile_.measurement = {options_.statistic, plan_.warmup, plan_.reps};

  const auto points = [](const Sweep& s) {
    return static_cast<int>(s.fitted().size() + s.heldout().size());
  };
  total_ = 4 * points(plan_.comm) * (int{intra} + int{inter}) +
           3 * points(plan_.gemm_rows) * static_cast<int>(shapes.size()) +
           2 * points(plan_.attention_pairs) * static_cast<int>(attention_shapes.size()) +
           3 * points(plan_.row_bytes);
  if (options_.fp8)
    total_ +=
        2 * points(plan_.gemm_rows) * static_cast<int>(shapes.size()) + points(plan_.row_bytes);

  // Intra-node: each node's ranks, all nodes at once; inter-node: one rank per node, as
  // hierarchical dispatch (RBD) uses them. Splits are collective over the world.
  if (intra) collectives(world_->split(topo.node_of(rank), rank), comm::LinkClass::intra_node);
  if (inter) collectives(world_->split(topo.local_rank(rank), rank), comm::LinkClass::inter_node);
  for (const GemmShape& s : shapes) gemms(s);
  if (options_.fp8) {
    for (const GemmShape& s : shapes) fp8_gemms(s);
    quantize_rows();
  }
  for (const AttentionShape& s : attention_shapes) attention(s);
  rows();
  adamw();
  return std::move(profile_);
}

}  // namespace

namespace {

/// "AxB" with two whole numbers > 0; `form` and `example` name the expected text in the error.
std::pair<int64_t, int64_t> parse_pair(std::string_view text, std::string_view key,
                                       std::string_view form, std::string_view example) {
  int64_t a = 0, b = 0;
  const size_t x = text.find('x');
  const auto whole = [](std::string_view part, int64_t& v) {
    const auto [end, ec] = std::from_chars(part.data(), part.data() + part.size(), v);
    return ec == std::errc() && end == part.data() + part.size() && v > 0;
  };
  XMOE_CHECK(
      x != std::string_view::npos && whole(text.substr(0, x), a) && whole(text.substr(x + 1), b),
      "[profile] {} '{}' is not {} with two whole numbers > 0 (e.g. {})", key, text, form, example);
  return {a, b};
}

}  // namespace

GemmShape parse_gemm_shape(std::string_view text, std::string_view key) {
  const auto [in, out] = parse_pair(text, key, "INxOUT", "1024x512");
  return {in, out};
}

AttentionShape parse_attention_shape(std::string_view text, std::string_view key) {
  const auto [head_dim, seq_len] = parse_pair(text, key, "HEAD_DIMxSEQ_LEN", "64x2048");
  return {head_dim, seq_len};
}

std::vector<AttentionShape> default_attention_shapes(Device device, bool quick) {
  if (quick) return {{32, 64}};
  if (device.is_cuda()) return {{64, 2048}};
  return {{64, 128}};
}

std::vector<GemmShape> default_gemm_shapes(Device device, bool quick) {
  if (quick) return {{64, 128}};
  if (device.is_cuda()) return {{1024, 512}, {256, 1024}};
  return {{256, 256}, {128, 256}};
}

Profile run_profile(const std::shared_ptr<comm::Group>& world, Device device,
                    const ProfileOptions& options) {
  return Profiler(world, device, options).run();
}

}  // namespace xmoe::sched
