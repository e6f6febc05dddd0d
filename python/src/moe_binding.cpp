// xmoe._C: xmoe's MoE layer for PyTorch (python/xmoe/torch.py registers the torch ops).
//
// The extension takes raw pointers, dtypes and torch's current CUDA stream instead of torch's
// C++ tensors, so it compiles without torch's headers (a fast build, no ABI tie to one torch
// release): the Python side checks the tensors and passes data_ptr(). Parameters, their
// gradients and the input are viewed in torch's memory (Tensor::from_external, no copy); the
// outputs y and dx are copied once into tensors torch allocated.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "torch_group.h"
#include "xmoe/backend/cuda/runtime.h"
#include "xmoe/config/config.h"
#include "xmoe/core/device_api.h"
#include "xmoe/moe/layer.h"

namespace py = pybind11;

namespace xmoe::torch_ext {

namespace {

DType parse_dtype(const std::string& name) {
  if (name == "float32") return DType::f32;
  if (name == "bfloat16") return DType::bf16;
  throw Error(fmt::format("[xmoe.torch] dtype {} is not supported (float32 or bfloat16)", name));
}

Device make_device(const std::string& type, int index) {
  if (type == "cpu") return Device::cpu();
  XMOE_CHECK(type == "cuda", "[xmoe.torch] device type '{}' is not supported (cpu or cuda)", type);
  return Device::cuda(index);
}

Tensor view(uintptr_t ptr, Shape shape, const std::string& dtype, Device device) {
  return Tensor::from_external(reinterpret_cast<void*>(ptr), std::move(shape), parse_dtype(dtype),
                               device);
}

/// Makes torch's current stream xmoe's current stream of the device for one call, and puts
/// xmoe's back afterwards. torch reports its legacy default stream as 0; CUDA names it
/// cudaStreamLegacy (0x1), which xmoe can queue on (the null handle would mean per-thread
/// streams in some builds).
class StreamScope {
 public:
  StreamScope(Device device, uintptr_t torch_stream) : device_(device) {
    if (!device.is_cuda()) return;
    previous_ = cuda::current_stream(device.index);
    cuda::set_current_stream(
        device.index, reinterpret_cast<cuda::Stream>(torch_stream ? torch_stream : uintptr_t{1}));
    cuda::activate(device.index);
  }
  ~StreamScope() {
    if (device_.is_cuda()) cuda::set_current_stream(device_.index, previous_);
  }
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  Device device_;
  cuda::Stream previous_ = nullptr;
};

/// Copies src into torch's memory at dst, a tensor like `like` (the shape and dtype torch
/// allocated), ordered on the current stream (no host wait on CUDA).
void copy_out(uintptr_t dst, const Tensor& src, const Tensor& like) {
  XMOE_CHECK(src.shape() == like.shape() && src.dtype() == like.dtype(),
             "[xmoe.torch] the layer made {}, but torch allocated {}", src.str(), like.str());
  if (src.is_cpu()) {
    backend::copy_bytes(reinterpret_cast<void*>(dst), src.device(), src.raw(), src.device(),
                        src.nbytes());
    return;
  }
  backend::copy_bytes_async(reinterpret_cast<void*>(dst), src.device(), src.raw(), src.device(),
                            src.nbytes(), cuda::current_stream(src.device().index));
}

/// Copies src (on the host or on `device`) to torch's memory at dst on `device`: on the stream
/// from the device, at once from the host.
void copy_to(uintptr_t dst, Device device, const Tensor& src) {
  if (src.is_cpu() || device.is_cpu()) {
    backend::copy_bytes(reinterpret_cast<void*>(dst), device, src.raw(), src.device(),
                        src.nbytes());
    return;
  }
  backend::copy_bytes_async(reinterpret_cast<void*>(dst), device, src.raw(), src.device(),
                            src.nbytes(), cuda::current_stream(device.index));
}

}  // namespace

/// What forward reports on the host beside y (and the aux losses, written on the device): the
/// routing.
struct ForwardStats {
  std::vector<int64_t> tokens_per_expert, expert_load;
  int64_t dropped = 0;
  int64_t pass_id = 0;
};

/// One MoELayer whose parameters (and the sigmoid gate's routing bias) live in torch tensors.
/// With an ep group it holds experts [r E/ep, (r + 1) E/ep) of ep rank r and moves rows over
/// it; the aux statistics and the sigmoid gate's load are summed over the world group (null:
/// this process alone).
class TorchMoE {
 public:
  TorchMoE(int64_t d_model, const std::vector<std::pair<std::string, std::string>>& options,
           uint64_t seed, float init_std, std::shared_ptr<TorchProcessGroup> ep,
           std::shared_ptr<TorchProcessGroup> world) {
    Config config;
    for (const auto& [key, value] : options) config_set(config, "model.moe." + key, value);
    layer_ = std::make_unique<moe::MoELayer>(config.model.moe, d_model, "moe", seed, init_std,
                                             std::nullopt, moe::LayerGroups{world, ep});
    params_ = layer_->parameters();
    for (Parameter* p : params_) {
      shapes_.push_back(p->value.shape());
      grad_dtypes_.push_back(p->grad.dtype());
    }
    unbind();  // torch allocates the gradients for each backward
  }

  /// (name, shape, grad dtype, written whole by backward) of each parameter, in the order every
  /// call takes their pointers.
  py::list parameter_info() const {
    py::list out;
    for (size_t i = 0; i < params_.size(); ++i) {
      const Parameter& p = *params_[i];
      out.append(py::make_tuple(p.name, shapes_[i],
                                grad_dtypes_[i] == DType::bf16 ? "bfloat16" : "float32",
                                p.lazy_zero_grad));
    }
    return out;
  }

  /// The sigmoid gate's routing bias [E] lives in a torch buffer (true), else none.
  bool has_routing_bias() { return layer_->gate().routing_bias() != nullptr; }
  /// Whether any aux loss has a weight: without, backward needs no upstream aux gradient (and
  /// reading it would make the host wait for the GPU).
  bool has_aux_losses() const {
    const auto& c = layer_->config();
    return c.aux_loss_weight != 0 || c.seq_aux_loss_weight != 0 || c.z_loss_weight != 0;
  }

  /// Copies xmoe's initial values (counter-based, docs/architecture.md) into f32 CPU tensors,
  /// and frees them here: from now on the layer computes with the torch tensors only.
  void copy_initial_values(const std::vector<uintptr_t>& dst) {
    check_count(dst, "copy_initial_values");
    for (size_t i = 0; i < params_.size(); ++i) {
      copy_out(dst[i], params_[i]->value, params_[i]->value);
      params_[i]->value = Tensor();
    }
  }

  /// x [T, d] at x_ptr; writes y [T, d] at y_ptr and the aux losses (f64 [4]: load balance,
  /// sequence balance, z-loss, weighted sum) at aux_ptr, both on x's device and ordered on the
  /// stream: reading the aux losses here would make the host wait for the whole layer, and the
  /// GPU would idle while Python queues the next layer's work. Without need_backward the saved
  /// activations are freed at once.
  ForwardStats forward(uintptr_t x_ptr, const Shape& x_shape, const std::string& dtype,
                       const std::string& device_type, int device_index, uintptr_t stream,
                       int64_t seq_len, const std::vector<uintptr_t>& param_ptrs,
                       const std::string& param_dtype, uintptr_t routing_bias_ptr,
                       uintptr_t aux_ptr, uintptr_t y_ptr, bool need_backward) {
    const Device device = make_device(device_type, device_index);
    StreamScope scope(device, stream);
    bind_values(param_ptrs, param_dtype, device);
    bind_routing_bias(routing_bias_ptr, device);
    const Tensor x = view(x_ptr, x_shape, dtype, device);
    Tensor y = layer_->forward(x, seq_len);
    copy_out(y_ptr, y, x);  // torch's y: empty_like(x)
    const Tensor terms = layer_->aux_terms().as_tensor();
    copy_to(aux_ptr, device, terms);
    ForwardStats s;
    s.tokens_per_expert = layer_->tokens_per_expert();
    s.expert_load = layer_->expert_load();
    s.dropped = layer_->dropped_tokens();
    if (need_backward) {
      s.pass_id = ++pass_id_;
    } else {
      layer_->release();
      unbind();
    }
    return s;
  }

  /// dy [T, d] -> dx at dx_ptr, every parameter's gradient at grad_ptrs (zeroed by the caller,
  /// except those written whole, which backward overwrites). aux_grad_ptr: the upstream gradient
  /// of the aux loss, f32 [] on dy's device, read where the kernels run (reading it on the host
  /// would wait for the GPU); 0: the layer has no weighted aux loss. pass_id: the forward this
  /// backward belongs to.
  void backward(uintptr_t dy_ptr, const Shape& dy_shape, const std::string& dtype,
                const std::string& device_type, int device_index, uintptr_t stream,
                uintptr_t aux_grad_ptr, const std::vector<uintptr_t>& param_ptrs,
                const std::string& param_dtype, const std::vector<uintptr_t>& grad_ptrs,
                uintptr_t dx_ptr, int64_t pass_id) {
    XMOE_CHECK(pass_id == pass_id_ && pass_id > 0,
               "[xmoe.torch] backward of forward pass {}, but the layer last ran forward pass {}: "
               "a layer that runs forward again before the backward of the first (reuse in one "
               "graph, activation checkpointing) is not supported yet",
               pass_id, pass_id_);
    const Device device = make_device(device_type, device_index);
    StreamScope scope(device, stream);
    bind_values(param_ptrs, param_dtype, device);
    check_count(grad_ptrs, "backward");
    for (size_t i = 0; i < params_.size(); ++i) {
      Parameter& p = *params_[i];
      p.grad = Tensor::from_external(reinterpret_cast<void*>(grad_ptrs[i]), shapes_[i],
                                     grad_dtypes_[i], device);
      p.grad_zero_pending = p.lazy_zero_grad;  // torch.empty: backward overwrites it
    }
    layer_->set_aux_grad_scale(
        1.0f, aux_grad_ptr ? view(aux_grad_ptr, {1}, "float32", device) : Tensor());
    const Tensor dy = view(dy_ptr, dy_shape, dtype, device);
    Tensor dx = layer_->backward(dy);
    copy_out(dx_ptr, dx, dy);          // torch's dx: empty_like(x), and dy has x's dtype
    layer_->set_aux_grad_scale(1.0f);  // drops the view of torch's d_aux
    pass_id_ = 0;
    unbind();
  }

  /// The sigmoid gate's aux-loss-free bias step from the load since the last call, in place on
  /// the torch buffer at routing_bias_ptr (no-op for other gates); call after the optimizer
  /// step. Collective over the world group.
  void update_routing_bias(uintptr_t routing_bias_ptr, const std::string& device_type,
                           int device_index, uintptr_t stream) {
    const Device device = make_device(device_type, device_index);
    StreamScope scope(device, stream);
    bind_routing_bias(routing_bias_ptr, device);
    layer_->update_routing_bias();
  }

 private:
  void check_count(const std::vector<uintptr_t>& ptrs, const char* what) const {
    XMOE_CHECK(ptrs.size() == params_.size(), "[xmoe.torch] {}: {} parameter pointers, expected {}",
               what, ptrs.size(), params_.size());
  }

  /// Views the torch parameters for this call (they may have moved since the last one).
  void bind_values(const std::vector<uintptr_t>& ptrs, const std::string& dtype, Device device) {
    check_count(ptrs, "parameters");
    for (size_t i = 0; i < params_.size(); ++i)
      params_[i]->value = view(ptrs[i], shapes_[i], dtype, device);
  }

  /// Views the torch buffer of the sigmoid gate's routing bias [E] f32 (0: the gate has none).
  void bind_routing_bias(uintptr_t ptr, Device device) {
    Tensor* bias = layer_->gate().routing_bias();
    XMOE_CHECK((bias != nullptr) == (ptr != 0),
               "[xmoe.torch] routing bias: the gate {} one, but {} was passed",
               bias ? "has" : "has no", ptr ? "one" : "none");
    if (bias) *bias = view(ptr, {layer_->config().num_experts}, "float32", device);
  }

  /// Drops the gradient views (the values stay viewed: the saved activations may hold a cast of
  /// them, and a view only refers to torch's memory). Parameter::device() then reads value's.
  void unbind() {
    for (Parameter* p : params_) {
      p->grad = Tensor();
      p->grad_zero_pending = false;
    }
  }

  std::unique_ptr<moe::MoELayer> layer_;
  std::vector<Parameter*> params_;
  std::vector<Shape> shapes_;
  std::vector<DType> grad_dtypes_;
  int64_t pass_id_ = 0;
};

}  // namespace xmoe::torch_ext

PYBIND11_MODULE(_C, m) {
  using xmoe::torch_ext::ForwardStats;
  using xmoe::torch_ext::TorchMoE;
  using xmoe::torch_ext::TorchProcessGroup;
  m.doc() = "xmoe's MoE layer on memory PyTorch owns (see xmoe.torch)";
  py::register_exception<xmoe::Error>(m, "Error", PyExc_ValueError);
  py::class_<ForwardStats>(m, "ForwardStats")
      .def_readonly("tokens_per_expert", &ForwardStats::tokens_per_expert)
      .def_readonly("expert_load", &ForwardStats::expert_load)
      .def_readonly("dropped", &ForwardStats::dropped)
      .def_readonly("pass_id", &ForwardStats::pass_id);
  // A torch.distributed process group as xmoe's comm::Group (torch_group.h).
  py::class_<TorchProcessGroup, std::shared_ptr<TorchProcessGroup>>(m, "ProcessGroup")
      .def(py::init([](py::object ops, int rank, int size, const std::string& device_type,
                       int device_index) {
             return std::make_shared<TorchProcessGroup>(
                 std::move(ops), rank, size,
                 xmoe::torch_ext::make_device(device_type, device_index));
           }),
           py::arg("ops"), py::arg("rank"), py::arg("size"), py::arg("device_type"),
           py::arg("device_index"))
      .def("rank", &TorchProcessGroup::rank)
      .def("size", &TorchProcessGroup::size)
      .def("all_to_all_bytes", [](const TorchProcessGroup& g) {
        return g.counters().of(xmoe::comm::ByteCounters::all_to_all,
                               xmoe::comm::LinkClass::intra_node);
      });
  py::class_<TorchMoE>(m, "MoELayer")
      .def(
          py::init<int64_t, const std::vector<std::pair<std::string, std::string>>&, uint64_t,
                   float, std::shared_ptr<TorchProcessGroup>, std::shared_ptr<TorchProcessGroup>>(),
          py::arg("d_model"), py::arg("options"), py::arg("seed"), py::arg("init_std"),
          py::arg("ep_group"), py::arg("world_group"))
      .def("has_routing_bias", &TorchMoE::has_routing_bias)
      .def("has_aux_losses", &TorchMoE::has_aux_losses)
      .def("parameter_info", &TorchMoE::parameter_info)
      .def("copy_initial_values", &TorchMoE::copy_initial_values)
      .def("forward", &TorchMoE::forward, py::call_guard<py::gil_scoped_release>())
      .def("backward", &TorchMoE::backward, py::call_guard<py::gil_scoped_release>())
      .def("update_routing_bias", &TorchMoE::update_routing_bias);
  m.def("cuda_available", &xmoe::cuda_available);
  // xmoe's allocator of a device (the layer's saved activations and temporaries), which torch's
  // memory statistics do not see.
  m.def(
      "memory_stats",
      [](const std::string& type, int index) {
        const xmoe::MemoryStats s = xmoe::memory_stats(xmoe::torch_ext::make_device(type, index));
        return py::dict(py::arg("live_bytes") = s.live_bytes, py::arg("peak_bytes") = s.peak_bytes,
                        py::arg("total_bytes") = s.total_bytes,
                        py::arg("num_allocs") = s.num_allocs);
      },
      py::arg("type"), py::arg("index") = 0);
  m.def(
      "reset_peak_memory",
      [](const std::string& type, int index) {
        xmoe::reset_peak_memory(xmoe::torch_ext::make_device(type, index));
      },
      py::arg("type"), py::arg("index") = 0);
}
