// The key table: every configuration key is declared here once, with its type (from the
// struct member), default (the struct's), range or choices, and a one-line doc. Parsing,
// overrides, validation, YAML output and docs/config.md are all derived from it.
#include "xmoe/config/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <variant>

#include "xmoe/core/device.h"
#include "xmoe/core/error.h"

namespace xmoe {

namespace {

using Ref = std::variant<int*, float*, bool*, std::string*, uint64_t*, std::vector<std::string>*>;

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Range {
  double lo = -kInf, hi = kInf;
  bool lo_open = false, hi_open = false;
};
Range any() {
  return {};
}
Range at_least(double lo) {
  return {lo, kInf, false, false};
}
Range positive() {
  return {0, kInf, true, false};
}
Range half_open(double lo, double hi) {
  return {lo, hi, false, true};
}

struct Key {
  std::string name;
  Ref (*ref)(Config&);
  Range range;
  std::vector<std::string> choices;  // strings: allowed values; lists: allowed entries
  std::string doc;
  std::string range_text = {};  // overrides the generated range text
};

// The dotted key is the C++ member path, so the name and the accessor cannot disagree.
#define XMOE_KEY(path, ...)                                       \
  Key {                                                           \
#path, [](Config & c) -> Ref { return &c.path; }, __VA_ARGS__ \
  }

const std::vector<Key>& table() {
  static const std::vector<Key> keys = {
      // model
      XMOE_KEY(model.vocab_size, at_least(1), {}, "vocabulary size (256 for the byte tokenizer)"),
      XMOE_KEY(model.d_model, at_least(1), {}, "hidden width d"),
      XMOE_KEY(model.num_layers, at_least(1), {}, "transformer blocks"),
      XMOE_KEY(model.num_heads, at_least(1), {}, "attention query heads"),
      XMOE_KEY(model.num_kv_heads, at_least(1), {},
               "key/value heads; fewer than num_heads gives grouped-query attention"),
      XMOE_KEY(model.max_seq_len, at_least(1), {},
               "longest sequence the model supports (RoPE table)"),
      XMOE_KEY(model.dense_hidden, at_least(1), {},
               "SwiGLU hidden width of the first_dense_layers dense FFNs"),
      XMOE_KEY(model.first_dense_layers, at_least(0), {},
               "leading blocks with a dense FFN instead of an MoE layer"),
      XMOE_KEY(model.rope_theta, positive(), {}, "RoPE base frequency"),
      XMOE_KEY(model.norm_eps, positive(), {}, "RMSNorm epsilon"),
      XMOE_KEY(model.init_std, positive(), {}, "standard deviation of the normal weight init"),
      XMOE_KEY(model.tie_embeddings, any(), {}, "share the token embedding with the LM head"),
      XMOE_KEY(model.recompute, any(), {"attention", "attention_core", "ffn", "moe", "router"},
               "modules recomputed in backward instead of keeping activations"),
      // model.moe
      XMOE_KEY(model.moe.num_experts, at_least(1), {}, "routed experts E per MoE layer"),
      XMOE_KEY(model.moe.top_k, at_least(1), {}, "routed experts per token k"),
      XMOE_KEY(model.moe.expert_hidden, at_least(1), {}, "hidden width f of one routed expert"),
      XMOE_KEY(model.moe.num_shared_experts, at_least(0), {},
               "always-on experts, run as one SwiGLU of width num_shared_experts * f"),
      XMOE_KEY(model.moe.shared_overlap, any(), {"off", "routing", "all"},
               "CUDA: the shared experts on a second stream: off; routing (beside the gate, the "
               "order and dispatch forward, the I-Order and combine backward; joined before the "
               "routed experts' GEMMs); all (the default: beside the whole routed path, joined "
               "before the sum). The same bits either way (docs/moe.md, \"Shared experts beside "
               "the routed path\"). No effect on the CPU"),
      XMOE_KEY(model.moe.gate, any(), {"softmax_topk", "sigmoid", "switch", "xmoe"},
               "gate function: GShard/Mixtral softmax top-k, DeepSeek-V3 sigmoid, Switch top-1, "
               "X-MoE cosine router"),
      XMOE_KEY(model.moe.softmax_before_topk, any(), {},
               "softmax_topk: softmax over all E then top-k (GShard); false: top-k then softmax "
               "(Mixtral)"),
      XMOE_KEY(model.moe.renormalize, any(), {}, "renormalise the k routing weights to sum to 1"),
      XMOE_KEY(model.moe.num_groups, at_least(1), {},
               "sigmoid: expert groups for group-limited routing"),
      XMOE_KEY(model.moe.topk_groups, at_least(1), {}, "sigmoid: groups a token may route into"),
      XMOE_KEY(model.moe.routed_scaling, positive(), {}, "multiplies the routed experts' weights"),
      XMOE_KEY(model.moe.bias_update_rate, at_least(0), {},
               "sigmoid: step of the aux-loss-free balancing bias (0 = off)"),
      XMOE_KEY(model.moe.router_dtype, any(), {"f32", "bf16"},
               "operands of the linear router's GEMMs (softmax_topk, switch, sigmoid): f32, or "
               "bf16 with f32 accumulation and f32 logits (Megatron's default; tensor cores on "
               "CUDA, the same rounding on the CPU)"),
      XMOE_KEY(model.moe.router_dim, at_least(1), {},
               "xmoe: width of the low-dimensional routing projection"),
      XMOE_KEY(model.moe.router_temperature, positive(), {},
               "xmoe: initial cosine-router temperature (learned)"),
      XMOE_KEY(model.moe.aux_loss_weight, at_least(0), {},
               "GShard/Switch load-balance loss weight"),
      XMOE_KEY(model.moe.seq_aux_loss_weight, at_least(0), {},
               "sequence-level balance loss weight"),
      XMOE_KEY(model.moe.z_loss_weight, at_least(0), {}, "router z-loss weight"),
      XMOE_KEY(model.moe.impl, any(), {"pft", "padded"},
               "pft: padding-free token buffers; padded: fixed capacity, drops overflow tokens"),
      XMOE_KEY(model.moe.capacity_factor, positive(), {},
               "padded: expert capacity = capacity_factor * tokens * k / E"),
      XMOE_KEY(model.moe.dispatch, any(), {"auto", "local", "all_to_all", "rbd"},
               "token exchange: auto (local when parallel.ep = 1, else all_to_all), local, "
               "all_to_all, or redundancy-bypassing dispatch"),
      XMOE_KEY(model.moe.expert_grad_dtype, any(), {"f32", "bf16"},
               "dtype of the routed experts' weight gradients: f32, or bf16 (f32 accumulation "
               "in each GEMM, rounded once on the store; Megatron-Core's default): half the "
               "gradient memory and traffic of the largest parameters. Master weights, optimizer "
               "state and the gradient all-reduce stay f32"),
      XMOE_KEY(model.moe.expert_dtype, any(), {"bf16", "fp8"},
               "the routed experts' forward and data-gradient GEMMs: bf16 (the compute dtype: "
               "bf16 on CUDA, f32 on the CPU) or fp8 (E4M3 with DeepSeek-V3's block scales, 1 x "
               "128 for activations and 128 x 128 for weights, f32 accumulation; CUTLASS' "
               "block-scaled kernel on Hopper, emulated elsewhere). Weight gradients, master "
               "weights and optimizer state keep their dtypes (docs/fp8.md)"),
      XMOE_KEY(model.moe.keep_expert_rows, any(), {},
               "keep the routed experts' input rows [T*k, d] from forward to backward instead of "
               "gathering them again from x in backward: one gather pass less per MoE layer, for "
               "T*k*d values more per layer (where one rank's dispatch moves no rows and nothing "
               "is chunked; else they are kept anyway). Not with FP8 experts, whose quantiser "
               "gathers x itself (docs/moe.md, \"Activation memory\")"),
      XMOE_KEY(model.moe.expert_chunks, at_least(0), {},
               "the experts' SwiGLU output and its gradient [N, f] are made this many row chunks "
               "at a time (cut between experts), so the layer never holds them for all N rows; "
               "0 = auto: 4 where expert_hidden > d_model and each chunk keeps >= 2048 rows, "
               "else 1"),
      XMOE_KEY(model.moe.pipeline, any(), {},
               "pipelined MoE layer (FSMoE): Dispatch, Expert and Combine in N chunks of local "
               "experts, the exchange of one chunk overlapping the experts of another; outputs "
               "and gradients bitwise equal to off. auto: N from the fitted performance models "
               "of model.moe.pipeline_profile (docs/pipeline.md)",
               "off | auto | N >= 1"),
      XMOE_KEY(model.moe.pipeline_backward, any(), {},
               "chunks of the MoE layer's backward: same (as model.moe.pipeline; auto chooses "
               "the backward's own), off, auto or N",
               "same | off | auto | N >= 1"),
      XMOE_KEY(model.moe.pipeline_profile, any(), {},
               "the `xmoe profile` file that model.moe.pipeline = auto reads; empty: "
               "<train.out_dir>/profile.json when it exists, else the default of "
               "docs/pipeline.md",
               "a path, or empty"),
      // data
      XMOE_KEY(data.corpus, any(), {}, "a text file or a folder of text files to prepare"),
      XMOE_KEY(data.dir, any(), {},
               "folder of prepared token files (train.bin, val.bin, meta.json)"),
      XMOE_KEY(data.val_fraction, half_open(0, 1), {},
               "fraction of the tokens (the last ones) held out for validation"),
      XMOE_KEY(data.mix, any(), {},
               "several prepared folders trained on together, each \"DIR:WEIGHT\": windows drawn "
               "from each in proportion to its weight (data.dir and data.corpus are then unused); "
               "the folders must share one tokenizer"),
      // train
      XMOE_KEY(train.steps, at_least(1), {}, "optimizer steps"),
      XMOE_KEY(train.batch_size, at_least(1), {},
               "sequences per micro-batch per data-parallel rank"),
      XMOE_KEY(train.seq_len, at_least(1), {}, "tokens per training sequence"),
      XMOE_KEY(train.grad_accum, at_least(1), {}, "micro-batches accumulated per step"),
      XMOE_KEY(train.lr, positive(), {}, "peak learning rate"),
      XMOE_KEY(train.min_lr, at_least(0), {}, "learning rate at the end of the cosine decay"),
      XMOE_KEY(train.warmup_steps, at_least(0), {}, "linear warmup steps"),
      XMOE_KEY(train.weight_decay, at_least(0), {}, "AdamW decoupled weight decay"),
      XMOE_KEY(train.beta1, half_open(0, 1), {}, "AdamW beta1"),
      XMOE_KEY(train.beta2, half_open(0, 1), {}, "AdamW beta2"),
      XMOE_KEY(train.adam_eps, positive(), {}, "AdamW epsilon"),
      XMOE_KEY(train.adam_moments_dtype, any(), {"f32", "bf16"},
               "storage of the AdamW moments m, v: bf16 halves them (8 -> 4 bytes per "
               "parameter, DeepSeek-V3's choice); the update reads them as f32, computes in f32 "
               "and stores them rounded to nearest even. Checkpoints hold them as f32 either way"),
      XMOE_KEY(train.grad_clip, at_least(0), {}, "global gradient-norm clip (0 = off)"),
      XMOE_KEY(train.eval_every, at_least(0), {}, "steps between evaluations (0 = never)"),
      XMOE_KEY(train.eval_batches, at_least(1), {}, "validation batches per evaluation"),
      XMOE_KEY(train.save_every, at_least(0), {},
               "steps between checkpoints (0 = only at the end)"),
      XMOE_KEY(train.keep_checkpoints, at_least(0), {},
               "newest checkpoints kept in train.out_dir; older ones are deleted once a new one "
               "is complete (0 = keep all)"),
      XMOE_KEY(train.async_checkpoint, any(), {},
               "write checkpoints on a side thread: the step copies the state to host memory "
               "and goes on while the copy is written (one save at a time)"),
      XMOE_KEY(train.on_save_error, any(), {"stop", "continue"},
               "a failed checkpoint save (full disk, quota, I/O error): stop (exit code 75) or "
               "continue (warn, keep training, try again at the next save)"),
      XMOE_KEY(train.log_every, at_least(1), {}, "steps between log lines"),
      XMOE_KEY(train.max_bad_steps, at_least(1), {},
               "consecutive NaN/Inf steps before the run stops"),
      XMOE_KEY(train.seed, any(), {}, "seed of parameter init, data order and sampling"),
      XMOE_KEY(train.out_dir, any(), {}, "run folder: checkpoints and logs"),
      XMOE_KEY(train.device, any(), {}, "device of this process", "cpu | cuda | cuda:N"),
      XMOE_KEY(train.dtype, any(), {"auto", "f32", "bf16"},
               "compute dtype of activations and matmuls: auto = bf16 on cuda, f32 on cpu; "
               "master weights and gradients stay f32 (but model.moe.expert_grad_dtype), AdamW "
               "moments train.adam_moments_dtype"),
      XMOE_KEY(train.offload_optimizer, any(), {},
               "f32 master weights and AdamW moments in pinned host memory, the update on CPU "
               "threads overlapped with the copies; the GPU keeps gradients and the bf16 (or f32) "
               "weights forward reads"),
      XMOE_KEY(train.offload_overlap, any(), {},
               "train.offload_optimizer: copy each module's gradients to the host during "
               "backward, as soon as they are final (one process without parallel.zero = 2: no "
               "sync changes them); the update itself waits for the gradient norm. The same bits "
               "either way; false (or several ranks, zero 2): the gradients travel during the "
               "update through two group-sized host buffers instead of one per gradient, 2-4 "
               "bytes per parameter less pinned memory"),
      XMOE_KEY(
          train.offload_delayed_update_from, at_least(-1), {},
          "train.offload_optimizer: -1 off; N >= 0: steps 1..N update as usual, then each "
          "step's host update runs during the next step's forward and backward, which read "
          "the weights one update behind (ZeRO-Offload's delayed parameter update). Needs "
          "train.offload_overlap, parallel.zero = 0 and parallel.expert_placement = none; "
          "costs the device a second copy of the weights forward reads, and convergence (much on "
          "small models at high lr: docs/training.md)"),
      // parallel
      XMOE_KEY(parallel.ep, at_least(1), {}, "expert-parallel degree (divides num_experts)"),
      XMOE_KEY(parallel.tp, at_least(1), {},
               "tensor-parallel degree: attention heads and dense FFN columns split over tp "
               "consecutive ranks, which share a micro-batch, each on 1/tp of its tokens "
               "(divides the processes, num_kv_heads, dense_hidden and batch_size)"),
      XMOE_KEY(parallel.ssmb, any(), {},
               "sequence-sharded MoE blocks (tp > 1): each tp rank routes only its 1/tp of the "
               "tokens; false: the MoE layer runs the whole micro-batch replicated on the tp "
               "ranks"),
      XMOE_KEY(parallel.ranks_per_node, at_least(0), {},
               "ranks per node: 0 = detect, >0 declares simulated nodes"),
      XMOE_KEY(parallel.expert_placement, any(), {"none", "affinity"},
               "expert placement at start/resume: none, or affinity (permute experts over "
               "nodes so that experts chosen together share a node)"),
      XMOE_KEY(parallel.placement_batches, at_least(1), {},
               "batches whose routing is recorded to choose the affinity placement"),
      XMOE_KEY(parallel.zero, {0, 2}, {},
               "optimizer-state sharding over data-parallel replicas: 0: every rank holds the "
               "whole optimizer state; 1: AdamW moments sharded over each parameter's "
               "data-parallel group, and with bf16 compute the f32 master weights of the "
               "parameters read through bf16 copies (the update all-gathers the copies); 2: "
               "also gradients reduce-scattered, each rank keeps its shard (MPI on CPU ranks, "
               "NCCL on GPUs)"),
      XMOE_KEY(parallel.bucket_kib, at_least(1), {},
               "size of a gradient bucket (KiB of f32 gradients): the gradients are all-reduced "
               "(zero 2: reduce-scattered) in buckets of one parameter kind, filled in parameter "
               "order"),
      XMOE_KEY(parallel.overlap_grad_sync, any(), {},
               "start each bucket's all-reduce (parallel.zero = 2: reduce-scatter, freeing the "
               "gradients) during backward, as soon as its gradients are final (false: all "
               "after backward; the same bits)"),
      XMOE_KEY(parallel.grad_partition, any(), {"off", "auto"},
               "dense gradients' buckets: off (filled to bucket_kib in parameter order) or auto "
               "(FSMoE's adaptive partitioning: pieces along backward sized from the profile's "
               "all-reduce and backward-compute models to hide inside backward; without a "
               "profile one piece per module; docs/pipeline.md)"),
      XMOE_KEY(parallel.collective_timeout_s, at_least(0), {},
               "seconds a collective may wait for the other ranks before every rank ends "
               "(naming the collective); 0 = no watchdog"),
  };
  return keys;
}

#undef XMOE_KEY

const Key* find_key(const std::string& name) {
  static const std::map<std::string, const Key*> index = [] {
    std::map<std::string, const Key*> m;
    for (const Key& k : table()) m[k.name] = &k;
    return m;
  }();
  auto it = index.find(name);
  return it == index.end() ? nullptr : it->second;
}

// "model", "model.moe", "data", ...: every proper prefix of a key.
bool is_section(const std::string& name) {
  for (const Key& k : table())
    if (k.name.size() > name.size() && k.name.compare(0, name.size(), name) == 0 &&
        k.name[name.size()] == '.')
      return true;
  return false;
}

ConfigType type_of(const Ref& r) {
  return static_cast<ConfigType>(r.index());
}

const char* type_name(ConfigType t) {
  switch (t) {
    case ConfigType::int_:
      return "int";
    case ConfigType::float_:
      return "float";
    case ConfigType::bool_:
      return "bool";
    case ConfigType::string:
      return "string";
    case ConfigType::uint64:
      return "uint64";
    case ConfigType::string_list:
      return "list of string";
  }
  return "?";
}

std::string last_part(const std::string& name) {
  const size_t dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

// The closest known key: by whole-name edit distance, or by the last component (so a key put
// in the wrong section, `top_k` or `train.top_k`, still finds `model.moe.top_k`).
std::string suggest(const std::string& unknown) {
  std::string best;
  size_t best_score = std::numeric_limits<size_t>::max();
  for (const Key& k : table()) {
    const size_t score = std::min(edit_distance(unknown, k.name),
                                  edit_distance(last_part(unknown), last_part(k.name)) + 1);
    if (score < best_score) best_score = score, best = k.name;
  }
  const size_t limit = std::max<size_t>(2, last_part(unknown).size() / 2 + 1);
  return best_score <= limit ? best : "";
}

[[noreturn]] void unknown_key(const std::string& name, const std::string& where) {
  const std::string s = suggest(name);
  XMOE_FAIL(
      "[config] {}unknown key '{}'{}", where, name,
      s.empty() ? " (see docs/config.md for the keys)" : fmt::format(" (did you mean '{}'?)", s));
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

std::vector<std::string> split_list(std::string v) {
  v = trim(v);
  if (v.size() >= 2 && v.front() == '[' && v.back() == ']') v = v.substr(1, v.size() - 2);
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= v.size()) {
    const size_t comma = std::min(v.find(',', start), v.size());
    std::string item = trim(v.substr(start, comma - start));
    if (item.size() >= 2 && (item.front() == '"' || item.front() == '\'') &&
        item.back() == item.front())
      item = item.substr(1, item.size() - 2);
    if (!item.empty()) out.push_back(item);
    start = comma + 1;
  }
  return out;
}

// What each numeric type holds, in words, for the errors below.
const char* type_words(ConfigType t) {
  switch (t) {
    case ConfigType::int_:
      return "a whole number from -2147483648 to 2147483647";
    case ConfigType::uint64:
      return "a whole number from 0 to 2^64 - 1 = 18446744073709551615";
    case ConfigType::float_:
      return "a finite number of magnitude below about 3.4e38";
    case ConfigType::bool_:
      return "true or false";
    default:
      return "";
  }
}

const char* with_article(ConfigType t) {
  return t == ConfigType::int_ ? "an int" : t == ConfigType::uint64 ? "a uint64" : "a float";
}

// "key = 'value'", the value shortened when long: a 300-digit number is not worth echoing.
std::string key_equals(const Key& k, const std::string& value) {
  if (value.size() <= 40) return fmt::format("{} = '{}'", k.name, value);
  return fmt::format("{} = '{}...' ({} characters)", k.name, value.substr(0, 24), value.size());
}

// "[config] train.seed = '-1' is negative; train.seed is a uint64 (a whole number from 0 to
// ...)": the key, the value as given and what the type holds, in words.
[[noreturn]] void type_error(const Key& k, ConfigType t, const std::string& value,
                             const std::string& problem = {}) {
  const char* words = type_words(t);
  XMOE_FAIL("[config] {} {}{}", key_equals(k, value),
            problem.empty() ? fmt::format("is not a valid {}", type_name(t)) : problem,
            *words ? fmt::format(" ({})", words) : "");
}

// Whole numbers: from_chars reads no sign for unsigned types and stops at the first non-digit,
// so a negative seed or "12abc" is refused here rather than wrapped or cut.
template <typename T>
T parse_whole(const Key& k, ConfigType t, const std::string& raw, const std::string& v) {
  T x{};
  const char* end = v.data() + v.size();
  const auto [p, ec] = std::from_chars(v.data(), end, x);
  const bool negative = !v.empty() && v[0] == '-';
  if (std::is_unsigned_v<T> && negative && v.size() > 1 &&
      std::all_of(v.begin() + 1, v.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
    type_error(k, t, raw, fmt::format("is negative; {} is {}", k.name, with_article(t)));
  if (ec == std::errc::result_out_of_range && p == end)
    type_error(k, t, raw,
               fmt::format("is too {} for {}", negative ? "small" : "large", with_article(t)));
  if (v.empty() || ec != std::errc() || p != end) type_error(k, t, raw);
  return x;
}

void set_from_text(Config& c, const Key& k, const std::string& raw) {
  const Ref r = k.ref(c);
  const ConfigType t = type_of(r);
  const std::string v = trim(raw);
  switch (t) {
    case ConfigType::int_:
      *std::get<int*>(r) = parse_whole<int>(k, t, raw, v);
      return;
    case ConfigType::float_: {
      char* end = nullptr;
      errno = 0;
      const double x = v.empty() ? 0 : std::strtod(v.c_str(), &end);
      const bool range_error = errno == ERANGE;
      if (v.empty() || end != v.c_str() + v.size() || std::isnan(x)) type_error(k, t, raw);
      // strtod accepts "inf"; a double beyond float's range would become inf when stored.
      if (std::isinf(x) && !range_error)
        type_error(k, t, raw, fmt::format("is not finite; {} is a float", k.name));
      if (std::fabs(x) > std::numeric_limits<float>::max())
        type_error(k, t, raw, "is too large in magnitude for a float");
      // Nonzero text that rounds to 0 (1e-50) would silently turn off whatever it sets.
      if ((x == 0 && range_error) || (x != 0 && static_cast<float>(x) == 0))
        XMOE_FAIL(
            "[config] {} is too small for a float: it would be stored as 0 (nonzero "
            "floats need a magnitude of at least about 1.4e-45)",
            key_equals(k, raw));
      *std::get<float*>(r) = static_cast<float>(x);
      return;
    }
    case ConfigType::bool_: {
      std::string l = v;
      std::transform(l.begin(), l.end(), l.begin(),
                     [](unsigned char ch) { return std::tolower(ch); });
      if (l == "true" || l == "yes" || l == "on" || l == "1") {
        *std::get<bool*>(r) = true;
      } else if (l == "false" || l == "no" || l == "off" || l == "0") {
        *std::get<bool*>(r) = false;
      } else {
        type_error(k, t, raw);
      }
      return;
    }
    case ConfigType::string:
      *std::get<std::string*>(r) = v;
      return;
    case ConfigType::uint64:
      *std::get<uint64_t*>(r) = parse_whole<uint64_t>(k, t, raw, v);
      return;
    case ConfigType::string_list:
      *std::get<std::vector<std::string>*>(r) = split_list(v);
      return;
  }
}

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;
  }
  return out + "\"";
}

std::string format_value(const Config& cc, const Key& k) {
  Config& c = const_cast<Config&>(cc);  // the accessor only reads here
  return std::visit(
      [](auto* p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool>) {
          return *p ? "true" : "false";
        } else if constexpr (std::is_same_v<T, float>) {
          std::string s = fmt::format("{}", *p);  // shortest text that round-trips
          if (s.find_first_of(".en") == std::string::npos) s += ".0";
          return s;
        } else if constexpr (std::is_same_v<T, std::string>) {
          return quote(*p);
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          std::string s = "[";
          for (size_t i = 0; i < p->size(); ++i) s += (i ? ", " : "") + quote((*p)[i]);
          return s + "]";
        } else {
          return fmt::format("{}", *p);
        }
      },
      k.ref(c));
}

std::string fmt_num(double x) {
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  return fmt::format("{}", x);
}

std::string range_text(const Key& k) {
  if (!k.range_text.empty()) return k.range_text;
  static Config probe;  // only the variant's index is used
  const ConfigType t = type_of(k.ref(probe));
  if (!k.choices.empty()) {
    std::string s;
    for (size_t i = 0; i < k.choices.size(); ++i) s += (i ? " | " : "") + k.choices[i];
    return t == ConfigType::string_list ? "each of " + s : s;
  }
  if (t == ConfigType::string) return "non-empty";
  if (t == ConfigType::bool_ || t == ConfigType::uint64) return "any";
  const Range& r = k.range;
  if (r.lo == -kInf && r.hi == kInf) return "any";
  return fmt::format("{}{}, {}{}", r.lo_open ? "(" : "[", fmt_num(r.lo), fmt_num(r.hi),
                     r.hi_open || r.hi == kInf ? ")" : "]");
}

void check_range(const Config& cc, const Key& k, std::vector<std::string>& errors) {
  Config& c = const_cast<Config&>(cc);
  const Ref r = k.ref(c);
  auto in_range = [&](double x) {
    const Range& g = k.range;
    return (g.lo_open ? x > g.lo : x >= g.lo) && (g.hi_open ? x < g.hi : x <= g.hi);
  };
  const std::string shown = format_value(cc, k);
  if (auto* p = std::get_if<int*>(&r)) {
    if (!in_range(**p))
      errors.push_back(fmt::format("{} = {} is outside {}", k.name, shown, range_text(k)));
  } else if (auto* f = std::get_if<float*>(&r)) {
    if (!std::isfinite(**f) || !in_range(**f))
      errors.push_back(fmt::format("{} = {} is outside {}", k.name, shown, range_text(k)));
  } else if (auto* s = std::get_if<std::string*>(&r)) {
    if (!k.choices.empty()) {
      if (std::find(k.choices.begin(), k.choices.end(), **s) == k.choices.end())
        errors.push_back(fmt::format("{} = {} is not one of {}", k.name, shown, range_text(k)));
    } else if (k.range_text.empty() && (*s)->empty()) {
      errors.push_back(fmt::format("{} is empty", k.name));
    }
  } else if (auto* l = std::get_if<std::vector<std::string>*>(&r)) {
    for (const std::string& e : **l)
      if (!k.choices.empty() && std::find(k.choices.begin(), k.choices.end(), e) == k.choices.end())
        errors.push_back(fmt::format("{} entry '{}' is not one of {}", k.name, e, range_text(k)));
  }
}

// ---- YAML ----------------------------------------------------------------------------

std::string node_text(const YAML::Node& n) {
  YAML::Emitter e;
  e << YAML::Flow << n;
  return e.c_str();
}

// yaml-cpp keeps both entries of a repeated key when a map is iterated, and load_node would let
// the last one win silently; a config that says two things is refused instead, at any depth.
void check_duplicate_keys(const YAML::Node& node, const std::string& prefix,
                          const std::string& src) {
  if (node.IsSequence()) {
    for (const auto& e : node) check_duplicate_keys(e, prefix, src);
    return;
  }
  if (!node.IsMap()) return;
  std::map<std::string, int> line_of;  // key -> 1-based line of its first occurrence
  for (const auto& item : node) {
    const std::string k = item.first.IsScalar() ? item.first.Scalar() : node_text(item.first);
    const std::string name = prefix.empty() ? k : prefix + "." + k;
    const int line = item.first.Mark().line + 1;  // Mark() is 0-based, -1 when unknown
    const auto [it, fresh] = line_of.emplace(k, line);
    if (!fresh) {
      const std::string where = it->second <= 0 || line <= 0 ? ""
                                : it->second == line
                                    ? fmt::format(" (both on line {})", line)
                                    : fmt::format(" (lines {} and {})", it->second, line);
      XMOE_FAIL("[config] {}: key '{}' appears twice{}; keep one", src, name, where);
    }
    check_duplicate_keys(item.second, name, src);
  }
}

void load_node(Config& c, const YAML::Node& map, const std::string& prefix,
               const std::string& src) {
  const std::string where = src + ": ";
  for (const auto& item : map) {
    // A map or list as a key (YAML's `? {a: 1}: 2`) names nothing.
    XMOE_CHECK(item.first.IsScalar(), "[config] {}{} has a key {} that is not a name", where,
               prefix.empty() ? "the top level" : "'" + prefix + "'", node_text(item.first));
    const std::string k = item.first.Scalar();
    const std::string name = prefix.empty() ? k : prefix + "." + k;
    const YAML::Node& v = item.second;
    if (prefix.empty() && k == "preset") continue;  // applied before the other keys
    if (const Key* key = find_key(name)) {
      const ConfigType t = type_of(key->ref(c));
      if (t == ConfigType::string_list) {
        std::vector<std::string> list;
        if (v.IsSequence()) {
          for (const auto& e : v) {
            XMOE_CHECK(e.IsScalar(), "[config] {}{} entry {} is not a string", where, name,
                       node_text(e));
            list.push_back(e.Scalar());
          }
        } else if (v.IsScalar()) {
          list = split_list(v.Scalar());
        } else {
          XMOE_CHECK(v.IsNull(), "[config] {}{} = {} is not a list of strings", where, name,
                     node_text(v));
        }
        *std::get<std::vector<std::string>*>(key->ref(c)) = list;
      } else {
        XMOE_CHECK(v.IsScalar(), "[config] {}{} = {} is not a valid {}", where, name,
                   v.IsNull() ? "(nothing)" : node_text(v), type_name(t));
        set_from_text(c, *key, v.Scalar());
      }
    } else if (is_section(name)) {
      XMOE_CHECK(v.IsMap() || v.IsNull(),
                 "[config] {}'{}' is a section; expected a map of keys, got {}", where, name,
                 node_text(v));
      if (v.IsMap()) load_node(c, v, name, src);
    } else {
      // Name the first leaf under an unknown section ("modle.d_model"), which finds the
      // closest key better than the section name alone.
      std::string leaf = name;
      for (YAML::Node n = v; n.IsMap() && n.size() > 0;) {
        const auto first = n.begin();
        leaf += '.';  // two appends: `"." + key` trips a GCC 12 -Wrestrict false positive
        leaf += first->first.IsScalar() ? first->first.Scalar() : node_text(first->first);
        n = first->second;
      }
      unknown_key(leaf, where);
    }
  }
}

}  // namespace

std::vector<DataMixEntry> parse_data_mix(const std::vector<std::string>& mix) {
  std::vector<DataMixEntry> out;
  for (const std::string& raw : mix) {
    const std::string e = trim(raw);
    const size_t colon = e.rfind(':');
    XMOE_CHECK(colon != std::string::npos,
               "[config] data.mix entry '{}' has no weight; write it as DIR:WEIGHT (e.g. "
               "data/books:0.7)",
               raw);
    DataMixEntry m;
    m.dir = trim(e.substr(0, colon));
    const std::string w = trim(e.substr(colon + 1));
    char* end = nullptr;
    m.weight = w.empty() ? 0 : std::strtod(w.c_str(), &end);
    XMOE_CHECK(!w.empty() && end == w.c_str() + w.size() && std::isfinite(m.weight) && m.weight > 0,
               "[config] data.mix entry '{}': weight '{}' is not a finite positive number", raw, w);
    XMOE_CHECK(!m.dir.empty(), "[config] data.mix entry '{}' names no folder", raw);
    for (const DataMixEntry& o : out)
      XMOE_CHECK(o.dir != m.dir, "[config] data.mix lists {} twice; give each folder once", m.dir);
    out.push_back(m);
  }
  return out;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

const std::vector<ConfigKeyInfo>& config_keys() {
  static const std::vector<ConfigKeyInfo> infos = [] {
    const Config defaults;
    std::vector<ConfigKeyInfo> out;
    for (const Key& k : table()) {
      const ConfigType t = type_of(k.ref(const_cast<Config&>(defaults)));
      out.push_back({k.name, t, type_name(t), format_value(defaults, k), range_text(k), k.doc});
    }
    return out;
  }();
  return infos;
}

std::string config_get(const Config& config, const std::string& key) {
  const Key* k = find_key(key);
  if (!k) unknown_key(key, "");
  return format_value(config, *k);
}

void config_set(Config& config, const std::string& key, const std::string& value) {
  const Key* k = find_key(key);
  if (!k) unknown_key(key, "");
  set_from_text(config, *k, value);
}

void apply_override(Config& config, const std::string& key_eq_value) {
  const size_t eq = key_eq_value.find('=');
  XMOE_CHECK(eq != std::string::npos, "[config] override '{}' is not key=value", key_eq_value);
  config_set(config, trim(key_eq_value.substr(0, eq)), key_eq_value.substr(eq + 1));
}

namespace {

YAML::Node parse_yaml(const std::string& yaml, const std::string& source) {
  try {
    return YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    XMOE_FAIL("[config] {}: invalid YAML: {}", source, e.what());
  }
}

Config load_root(const YAML::Node& root, const std::string& source) {
  if (root.IsNull()) return Config{};
  XMOE_CHECK(root.IsMap(), "[config] {}: expected a map of keys at the top level", source);
  check_duplicate_keys(root, "", source);
  Config c;
  if (const YAML::Node p = root["preset"]) {
    XMOE_CHECK(p.IsScalar(), "[config] {}: preset = {} is not a name", source, node_text(p));
    c = preset(p.Scalar());
  }
  load_node(c, root, "", source);
  return c;
}

}  // namespace

Config load_config_string(const std::string& yaml, const std::string& source) {
  return load_root(parse_yaml(yaml, source), source);
}

Config load_config_file(const std::string& path) {
  std::error_code ec;
  XMOE_CHECK(!std::filesystem::is_directory(path, ec),
             "[config] {} is a directory, not a YAML file", path);
  std::string text;
  {
    FILE* f = std::fopen(path.c_str(), "rb");
    XMOE_CHECK(f, "[config] cannot open config file {}", path);
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
    std::fclose(f);
  }
  const YAML::Node root = parse_yaml(text, path);
  // A file that sets nothing would silently run every default: most likely a wrong path or an
  // unsaved editor buffer.
  XMOE_CHECK(!root.IsNull(), "[config] {} is empty (no keys, only whitespace or comments)", path);
  return load_root(root, path);
}

int parse_pipeline_chunks(const std::string& value, const char* key) {
  if (value == "off") return 1;
  if (value == "auto") return 0;
  int n = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
  XMOE_CHECK(ec == std::errc() && end == value.data() + value.size() && n >= 1,
             "[config] {} = '{}' is not off, auto or a chunk count >= 1", key, value);
  return n;
}

void validate(const Config& c) {
  std::vector<std::string> errors;
  for (const Key& k : table()) check_range(c, k, errors);

  const ModelConfig& m = c.model;
  const MoeConfig& moe = m.moe;
  auto fail = [&]<typename... A>(fmt::format_string<A...> f, A&&... a) {
    errors.push_back(fmt::format(f, std::forward<A>(a)...));
  };
  if (moe.top_k > moe.num_experts)
    fail("model.moe.top_k = {} exceeds model.moe.num_experts = {}", moe.top_k, moe.num_experts);
  if (m.num_heads > 0 && m.d_model % m.num_heads != 0)
    fail("model.d_model = {} is not divisible by model.num_heads = {}", m.d_model, m.num_heads);
  else if (m.num_heads > 0 && (m.d_model / m.num_heads) % 2 != 0)
    fail("head dimension model.d_model / model.num_heads = {} / {} = {} is odd; RoPE needs it even",
         m.d_model, m.num_heads, m.d_model / m.num_heads);
  if (m.num_kv_heads > 0 && m.num_heads % m.num_kv_heads != 0)
    fail("model.num_heads = {} is not divisible by model.num_kv_heads = {}", m.num_heads,
         m.num_kv_heads);
  if (c.parallel.ep > 0 && moe.num_experts % c.parallel.ep != 0)
    fail("model.moe.num_experts = {} is not divisible by parallel.ep = {}", moe.num_experts,
         c.parallel.ep);
  // Tensor parallelism splits the kv heads (so the query heads too), the dense FFN's hidden
  // units, and each micro-batch's sequences over the tp ranks.
  if (const int tp = c.parallel.tp; tp > 1) {
    if (m.num_kv_heads > 0 && m.num_kv_heads % tp != 0)
      fail("model.num_kv_heads = {} is not divisible by parallel.tp = {}", m.num_kv_heads, tp);
    if (m.first_dense_layers > 0 && m.dense_hidden % tp != 0)
      fail("model.dense_hidden = {} is not divisible by parallel.tp = {}", m.dense_hidden, tp);
    if (c.train.batch_size % tp != 0)
      fail(
          "train.batch_size = {} is not divisible by parallel.tp = {} (each tp rank takes "
          "whole sequences of the micro-batch)",
          c.train.batch_size, tp);
  }
  const auto pipeline_ok = [](const std::string& value) {
    try {
      parse_pipeline_chunks(value, "");
      return true;
    } catch (const Error&) {
      return false;
    }
  };
  if (!pipeline_ok(moe.pipeline))
    fail("model.moe.pipeline = '{}' is not off, auto or a chunk count >= 1", moe.pipeline);
  if (moe.pipeline_backward != "same" && !pipeline_ok(moe.pipeline_backward))
    fail("model.moe.pipeline_backward = '{}' is not same, off, auto or a chunk count >= 1",
         moe.pipeline_backward);
  if (const int from = c.train.offload_delayed_update_from; from >= 0) {
    if (!c.train.offload_optimizer)
      fail(
          "train.offload_delayed_update_from = {} delays the offloaded update; it needs "
          "train.offload_optimizer = true",
          from);
    if (!c.train.offload_overlap)
      fail(
          "train.offload_delayed_update_from = {} needs train.offload_overlap = true (whole host "
          "gradient buffers, which the delayed update reads while the next step runs)",
          from);
    if (c.parallel.zero != 0)
      fail(
          "train.offload_delayed_update_from = {} needs parallel.zero = 0 (got {}): the "
          "delayed update publishes whole weights, not gathered shards",
          from, c.parallel.zero);
    if (c.parallel.expert_placement != "none")
      fail(
          "train.offload_delayed_update_from = {} needs parallel.expert_placement = none (got "
          "{}): the placement writes the weights outside the optimizer",
          from, c.parallel.expert_placement);
  }
  if (c.parallel.zero > 0 && c.parallel.expert_placement == "affinity")
    fail(
        "parallel.zero = {} shards the AdamW moments, but parallel.expert_placement = affinity "
        "permutes whole moments; set parallel.expert_placement = none or parallel.zero = 0",
        c.parallel.zero);
  if (moe.gate == "xmoe" && moe.router_dtype != "f32")
    fail(
        "model.moe.router_dtype = \"{}\" applies to the linear routers; the xmoe cosine "
        "router runs in f32",
        moe.router_dtype);
  if (moe.gate == "switch" && moe.top_k != 1)
    fail("model.moe.gate = \"switch\" routes to one expert but model.moe.top_k = {}", moe.top_k);
  if (moe.gate == "sigmoid" && moe.num_groups > 0 && moe.topk_groups > 0) {
    if (moe.num_experts % moe.num_groups != 0) {
      fail("model.moe.num_experts = {} is not divisible by model.moe.num_groups = {}",
           moe.num_experts, moe.num_groups);
    } else {
      if (moe.topk_groups > moe.num_groups)
        fail("model.moe.topk_groups = {} exceeds model.moe.num_groups = {}", moe.topk_groups,
             moe.num_groups);
      const int reachable =
          std::min(moe.topk_groups, moe.num_groups) * (moe.num_experts / moe.num_groups);
      if (moe.top_k > reachable)
        fail(
            "model.moe.top_k = {} exceeds the {} experts reachable in model.moe.topk_groups = {} "
            "of model.moe.num_groups = {} groups",
            moe.top_k, reachable, moe.topk_groups, moe.num_groups);
    }
  }
  if (m.first_dense_layers > m.num_layers)
    fail("model.first_dense_layers = {} exceeds model.num_layers = {}", m.first_dense_layers,
         m.num_layers);
  if (c.train.seq_len > m.max_seq_len)
    fail("train.seq_len = {} exceeds model.max_seq_len = {}", c.train.seq_len, m.max_seq_len);
  if (c.train.min_lr > c.train.lr)
    fail("train.min_lr = {} exceeds train.lr = {}", c.train.min_lr, c.train.lr);
  if (c.train.eval_every > 0 && c.data.val_fraction <= 0)
    fail("train.eval_every = {} needs a validation split but data.val_fraction = {}",
         c.train.eval_every, c.data.val_fraction);
  try {
    parse_data_mix(c.data.mix);
  } catch (const Error& e) {
    std::string what = e.what();
    if (what.rfind("[config] ", 0) == 0) what = what.substr(9);
    errors.push_back(what);
  }
  try {
    parse_device(c.train.device);
  } catch (const Error&) {
    fail("train.device = \"{}\" is not cpu, cuda or cuda:N", c.train.device);
  }
  if (c.train.dtype == "bf16" && c.train.device == "cpu")
    fail("train.dtype = bf16 needs train.device = cuda (the CPU path computes in f32)");

  if (errors.size() == 1) XMOE_FAIL("[config] {}", errors[0]);
  if (!errors.empty()) {
    std::string msg = fmt::format("[config] {} problems:", errors.size());
    for (const std::string& e : errors) msg += "\n  - " + e;
    XMOE_FAIL("{}", msg);
  }
}

std::string to_yaml(const Config& c) {
  std::string out;
  std::vector<std::string> open;  // sections currently open, outermost first
  for (const Key& k : table()) {
    std::vector<std::string> parts;
    size_t start = 0, dot;
    while ((dot = k.name.find('.', start)) != std::string::npos) {
      parts.push_back(k.name.substr(start, dot - start));
      start = dot + 1;
    }
    const std::string leaf = k.name.substr(start);
    size_t common = 0;
    while (common < open.size() && common < parts.size() && open[common] == parts[common]) ++common;
    open.resize(common);
    for (size_t i = common; i < parts.size(); ++i) {
      out += std::string(2 * i, ' ') + parts[i] + ":\n";
      open.push_back(parts[i]);
    }
    out += std::string(2 * parts.size(), ' ') + leaf + ": " + format_value(c, k) + "\n";
  }
  return out;
}

std::string config_reference_markdown() {
  std::string md =
      "# Configuration reference\n\n"
      "<!-- Generated by xmoe::config_reference_markdown() from the key table in "
      "src/xmoe/config/config.cpp; tests/test_config.cpp checks that this file is up to date. "
      "-->\n\n"
      "A run is configured by a YAML file of nested maps that mirror the dotted key names\n"
      "(`model: {moe: {top_k: 6}}` sets `model.moe.top_k`), optionally starting from a preset\n"
      "(`preset: moe-1b` at the top level), then by `--set key=value` overrides (lists are\n"
      "comma-separated: `--set model.recompute=attention,moe`). Unknown keys, a key given twice,\n"
      "values of the wrong type or beyond it (an int past 2147483647, a negative `uint64`) and an\n"
      "empty config file are errors. `validate()` checks every range below and these cross-key\n"
      "rules:\n\n"
      "- `model.moe.top_k <= model.moe.num_experts`; `switch` gate needs `top_k == 1`;\n"
      "  `model.moe.router_dtype: bf16` needs a linear router (not the `xmoe` gate)\n"
      "- `model.d_model % model.num_heads == 0`, the head dimension is even (RoPE),\n"
      "  `model.num_heads % model.num_kv_heads == 0`\n"
      "- `model.moe.num_experts % parallel.ep == 0`; `parallel.tp` divides `model.num_kv_heads`,\n"
      "  `model.dense_hidden` (with dense layers) and `train.batch_size`; `parallel.zero > 0`\n"
      "  needs `parallel.expert_placement: none`\n"
      "- `sigmoid` gate: `num_experts % num_groups == 0`, `topk_groups <= num_groups`,\n"
      "  `top_k <= topk_groups * num_experts / num_groups`\n"
      "- `model.first_dense_layers <= model.num_layers`; `train.seq_len <= model.max_seq_len`;\n"
      "  `train.min_lr <= train.lr`; `train.eval_every > 0` needs `data.val_fraction > 0`\n"
      "- each `data.mix` entry is `DIR:WEIGHT` with a finite positive weight, each folder once\n\n";
  std::string section;
  for (const ConfigKeyInfo& k : config_keys()) {
    const std::string s = k.name.substr(0, k.name.rfind('.'));
    if (s != section) {
      section = s;
      md += fmt::format(
          "\n## `{}`\n\n| key | type | default | range | meaning |\n|---|---|---|---|---|\n",
          section);
    }
    std::string range = k.range;
    for (size_t p = 0; (p = range.find('|', p)) != std::string::npos; p += 2)
      range.replace(p, 1, "\\|");
    std::string doc = k.doc;
    for (size_t p = 0; (p = doc.find('|', p)) != std::string::npos; p += 2)
      doc.replace(p, 1, "\\|");
    md += fmt::format("| `{}` | {} | `{}` | {} | {} |\n", k.name, k.type_name, k.default_value,
                      range, doc);
  }
  md +=
      "\n## Presets\n\n"
      "`preset: <name>` in a config file, or `xmoe train --preset <name>`. Parameter counts are\n"
      "from `count_parameters()` (embedding and LM head included; active = with k of the E\n"
      "routed experts).\n\n"
      "| preset | total params | active params | description |\n|---|---|---|---|\n";
  for (const std::string& name : preset_names()) {
    const ParamCount pc = count_parameters(preset(name).model);
    auto human = [](int64_t n) {
      return n >= 1000000000 ? fmt::format("{:.2f}B", n / 1e9) : fmt::format("{:.1f}M", n / 1e6);
    };
    md += fmt::format("| `{}` | {} | {} | {} |\n", name, human(pc.total), human(pc.active),
                      preset_description(name));
  }
  return md;
}

}  // namespace xmoe
