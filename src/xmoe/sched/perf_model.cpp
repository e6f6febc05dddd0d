#include "xmoe/sched/perf_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "xmoe/core/error.h"
#include "xmoe/io/file.h"

namespace xmoe::sched {

namespace {

using nlohmann::json;

constexpr std::array<std::string_view, kNumTasks> kTaskNames = {
    "all_to_all_v",     "all_gather",         "reduce_scatter",       "all_reduce",
    "gemm_forward",     "gemm_backward_data", "gemm_backward_weight", "gather_rows",
    "scatter_rows",     "attention_forward",  "attention_backward",   "adamw",
    "quantize_rows_fp8"};
constexpr const char* kFormat = "xmoe-profile";
constexpr int kFormatVersion = 1;

std::string task_list() {
  std::string s;
  for (std::string_view n : kTaskNames) s += (s.empty() ? "" : ", ") + std::string(n);
  return s;
}

double median(std::vector<double> v) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

json samples_json(const std::vector<double>& x, const std::vector<double>& t) {
  json a = json::array();
  for (size_t i = 0; i < x.size(); ++i) a.push_back({x[i], t[i]});
  return a;
}

/// Reads one file's JSON, naming the file and the key of anything missing or malformed.
class Reader {
 public:
  explicit Reader(const std::string& source) : source_(source) {}

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    XMOE_FAIL("[profile] {}: {} {}", source_, key, what);
  }
  const json& member(const json& obj, const std::string& where, const char* key) const {
    const std::string name = where.empty() ? key : where + "." + key;
    if (!obj.is_object()) fail(where.empty() ? "the top level" : where, "is not an object");
    const auto it = obj.find(key);
    if (it == obj.end()) fail(name, "is missing");
    return *it;
  }
  double number(const json& obj, const std::string& where, const char* key) const {
    const json& v = member(obj, where, key);
    if (!v.is_number() || !std::isfinite(v.get<double>()))
      fail(where + "." + key, "is not a finite number: " + v.dump());
    return v.get<double>();
  }
  int64_t integer(const json& obj, const std::string& where, const char* key, int64_t lo) const {
    const json& v = member(obj, where, key);
    if (!v.is_number_integer() || v.get<int64_t>() < lo)
      fail(where + "." + key, "is not a whole number >= " + std::to_string(lo) + ": " + v.dump());
    return v.get<int64_t>();
  }
  std::string string(const json& obj, const std::string& where, const char* key) const {
    const json& v = member(obj, where, key);
    if (!v.is_string()) fail(where + "." + key, "is not a string: " + v.dump());
    return v.get<std::string>();
  }
  void samples(const json& obj, const std::string& where, const char* key, std::vector<double>& x,
               std::vector<double>& t) const {
    const json& a = member(obj, where, key);
    const std::string name = where + "." + key;
    if (!a.is_array()) fail(name, "is not an array of [x, seconds] pairs");
    for (size_t i = 0; i < a.size(); ++i) {
      const json& p = a[i];
      if (!p.is_array() || p.size() != 2 || !p[0].is_number() || !p[1].is_number() ||
          !(p[0].get<double>() > 0) || !(p[1].get<double>() > 0))
        fail(name + "[" + std::to_string(i) + "]",
             "is not an [x, seconds] pair of positive numbers: " + p.dump());
      x.push_back(p[0].get<double>());
      t.push_back(p[1].get<double>());
    }
  }

 private:
  const std::string& source_;
};

TaskModel read_model(const Reader& r, const json& m, const std::string& where) {
  TaskModel tm;
  const std::string task = r.string(m, where, "task");
  try {
    tm.task = parse_task(task);
  } catch (const Error&) {
    r.fail(where + ".task", "'" + task + "' is not a task (" + task_list() + ")");
  }
  tm.dtype = r.string(m, where, "dtype");
  if (is_collective(tm.task)) {
    const std::string link = r.string(m, where, "link");
    if (link == link_name(comm::LinkClass::intra_node))
      tm.link = comm::LinkClass::intra_node;
    else if (link == link_name(comm::LinkClass::inter_node))
      tm.link = comm::LinkClass::inter_node;
    else
      r.fail(where + ".link", "'" + link + "' is not intra_node or inter_node");
    tm.ranks = static_cast<int>(r.integer(m, where, "ranks", 2));
  } else if (is_gemm(tm.task)) {
    tm.in = r.integer(m, where, "in", 1);
    tm.out = r.integer(m, where, "out", 1);
    tm.groups = r.integer(m, where, "groups", 1);
  } else if (is_attention(tm.task)) {
    tm.head_dim = r.integer(m, where, "head_dim", 1);
    tm.seq_len = r.integer(m, where, "seq_len", 1);
  } else if (tm.task != Task::adamw) {
    tm.width = r.integer(m, where, "width", 1);
  }
  const std::string fit_key = where + ".fit";
  const json& fit = r.member(m, where, "fit");
  tm.fit.alpha = r.number(fit, fit_key, "alpha");
  tm.fit.beta = r.number(fit, fit_key, "beta");
  tm.fit.r2 = r.number(fit, fit_key, "r2");
  tm.fit.n = static_cast<int>(r.integer(fit, fit_key, "n", 2));
  tm.fit.unit = r.string(fit, fit_key, "unit");
  if (tm.fit.unit != task_unit(tm.task))
    r.fail(fit_key + ".unit", "is '" + tm.fit.unit + "', but " + task + " counts " +
                                  std::string(task_unit(tm.task)) + "s");
  if (tm.fit.alpha < 0 || tm.fit.beta < 0)
    r.fail(fit_key, "has a negative coefficient (alpha and beta are times, >= 0)");
  r.samples(m, where, "samples", tm.x, tm.t);
  r.samples(m, where, "heldout", tm.heldout_x, tm.heldout_t);
  if (static_cast<int>(tm.x.size()) != tm.fit.n)
    r.fail(fit_key + ".n", "is " + std::to_string(tm.fit.n) + ", but " + where + ".samples has " +
                               std::to_string(tm.x.size()));
  return tm;
}

/// The model of `kind` (among those `keep` accepts) whose shape (a, b) is nearest (a0, b0) in
/// log2 distance, or nullptr.
template <typename Shape, typename Keep>
const TaskModel* nearest_model(const std::vector<TaskModel>& models, Task kind, Shape shape,
                               int64_t a0, int64_t b0, Keep keep) {
  const TaskModel* best = nullptr;
  double best_distance = 0;
  for (const TaskModel& m : models) {
    if (m.task != kind || !keep(m)) continue;
    const auto [a, b] = shape(m);
    const double distance = std::abs(std::log2(static_cast<double>(a) / a0)) +
                            std::abs(std::log2(static_cast<double>(b) / b0));
    if (!best || distance < best_distance) best = &m, best_distance = distance;
  }
  return best;
}

}  // namespace

std::string_view task_name(Task task) {
  return kTaskNames[static_cast<size_t>(task)];
}

Task parse_task(std::string_view name) {
  for (size_t i = 0; i < kTaskNames.size(); ++i)
    if (kTaskNames[i] == name) return static_cast<Task>(i);
  XMOE_FAIL("[profile] '{}' is not a task ({})", name, task_list());
}

bool is_collective(Task task) {
  return task <= Task::all_reduce;
}
bool is_gemm(Task task) {
  return task >= Task::gemm_forward && task <= Task::gemm_backward_weight;
}
bool is_attention(Task task) {
  return task == Task::attention_forward || task == Task::attention_backward;
}
std::string_view task_unit(Task task) {
  return is_gemm(task) || is_attention(task) ? "flop" : "byte";
}
std::string_view link_name(comm::LinkClass link) {
  return link == comm::LinkClass::intra_node ? "intra_node" : "inter_node";
}

double TaskModel::heldout_error() const {
  return heldout_x.empty() ? std::numeric_limits<double>::quiet_NaN()
                           : median_relative_error(fit, heldout_x, heldout_t);
}

const TaskModel* Profile::find(Task task, comm::LinkClass link) const {
  for (const TaskModel& m : models)
    if (m.task == task && (!is_collective(task) || m.link == link)) return &m;
  return nullptr;
}

double Profile::predict_collective(Task task, comm::LinkClass link, double bytes) const {
  XMOE_CHECK(is_collective(task), "[profile] predict_collective: {} is not a collective",
             task_name(task));
  const TaskModel* m = find(task, link);
  XMOE_CHECK(m != nullptr,
             "[profile] the profile has no {} model over {} links (measured on {} ranks, {} "
             "per node: inter-node models need several declared nodes, intra-node ones several "
             "ranks per node)",
             task_name(task), link_name(link), machine.world_size, machine.ranks_per_node);
  return m->fit.predict(bytes);
}

double Profile::predict_gemm(Task kind, int64_t rows, int64_t in, int64_t out, bool fp8) const {
  XMOE_CHECK(is_gemm(kind), "[profile] predict_gemm: {} is not a GEMM kind", task_name(kind));
  XMOE_CHECK(rows >= 0 && in > 0 && out > 0,
             "[profile] predict_gemm: rows {} in {} out {} (need rows >= 0, in and out > 0)", rows,
             in, out);
  const TaskModel* best = nearest_model(
      models, kind, [](const TaskModel& m) { return std::pair(m.in, m.out); }, in, out,
      [fp8](const TaskModel& m) { return (m.dtype == "fp8") == fp8; });
  XMOE_CHECK(best != nullptr, "[profile] the profile has no {}{} model{}", fp8 ? "FP8 " : "",
             task_name(kind), fp8 ? " (xmoe profile --fp8 measures them)" : "");
  return best->fit.predict(2.0 * static_cast<double>(rows) * static_cast<double>(in) *
                           static_cast<double>(out));
}

bool Profile::has_fp8_gemm(Task kind) const {
  return std::any_of(models.begin(), models.end(),
                     [kind](const TaskModel& m) { return m.task == kind && m.dtype == "fp8"; });
}

std::optional<double> Profile::predict_quantize_fp8(double bytes) const {
  const TaskModel* m = find(Task::quantize_rows_fp8, comm::LinkClass::intra_node);
  if (!m) return std::nullopt;
  return m->fit.predict(bytes);
}

double Profile::predict_rows(Task task, double bytes) const {
  XMOE_CHECK(task == Task::gather_rows || task == Task::scatter_rows,
             "[profile] predict_rows: {} is not gather_rows or scatter_rows", task_name(task));
  const TaskModel* m = find(task, comm::LinkClass::intra_node);
  XMOE_CHECK(m != nullptr, "[profile] the profile has no {} model", task_name(task));
  return m->fit.predict(bytes);
}

std::optional<double> Profile::predict_attention(Task kind, int64_t pairs, int64_t head_dim,
                                                 int64_t seq_len) const {
  XMOE_CHECK(is_attention(kind), "[profile] predict_attention: {} is not an attention task",
             task_name(kind));
  XMOE_CHECK(pairs >= 0 && head_dim > 0 && seq_len > 0,
             "[profile] predict_attention: pairs {} head_dim {} seq_len {}", pairs, head_dim,
             seq_len);
  const TaskModel* best = nearest_model(
      models, kind, [](const TaskModel& m) { return std::pair(m.head_dim, m.seq_len); }, head_dim,
      seq_len, [](const TaskModel&) { return true; });
  if (!best) return std::nullopt;
  const double s = static_cast<double>(seq_len);
  return best->fit.predict(4.0 * static_cast<double>(pairs) * s * s *
                           static_cast<double>(head_dim));
}

std::optional<double> Profile::predict_adamw(int64_t elements) const {
  const TaskModel* m = find(Task::adamw, comm::LinkClass::intra_node);
  if (!m) return std::nullopt;
  return m->fit.predict(16.0 * static_cast<double>(elements));
}

double Profile::heldout_error() const {
  std::vector<double> errors;
  for (const TaskModel& m : models)
    for (size_t i = 0; i < m.heldout_x.size(); ++i)
      errors.push_back(std::abs(m.fit.predict(m.heldout_x[i]) - m.heldout_t[i]) / m.heldout_t[i]);
  return median(std::move(errors));
}

std::string profile_table(const Profile& p) {
  std::string s =
      fmt::format("{:<21} {:<10} {:>5} {:<13} {:>10} {:>15} {:>14} {:>8} {:>6} {:>8}\n", "task",
                  "link", "ranks", "shape", "alpha us", "beta", "rate", "R2", "points", "held-out");
  for (const TaskModel& m : p.models) {
    const bool flops = task_unit(m.task) == "flop";
    const std::string shape =
        is_collective(m.task)   ? m.dtype
        : is_gemm(m.task)       ? fmt::format("{}x{} g{} {}", m.in, m.out, m.groups, m.dtype)
        : is_attention(m.task)  ? fmt::format("hd{} s{} {}", m.head_dim, m.seq_len, m.dtype)
        : m.task == Task::adamw ? m.dtype
                                : fmt::format("w{} {}", m.width, m.dtype);
    const std::string beta = flops ? fmt::format("{:.4g} ms/GFLOP", m.fit.beta * 1e12)
                                   : fmt::format("{:.4g} ns/B", m.fit.beta * 1e9);
    const std::string rate = m.fit.beta <= 0 ? "-"
                             : flops         ? fmt::format("{:.4g} GFLOP/s", 1e-9 / m.fit.beta)
                                             : fmt::format("{:.4g} GB/s", 1e-9 / m.fit.beta);
    const double err = m.heldout_error();
    s += fmt::format("{:<21} {:<10} {:>5} {:<13} {:>10.2f} {:>15} {:>14} {:>8.5f} {:>6} {:>8}\n",
                     task_name(m.task), is_collective(m.task) ? link_name(m.link) : "-", m.ranks,
                     shape, m.fit.alpha * 1e6, beta, rate, m.fit.r2, m.fit.n,
                     std::isnan(err) ? "-" : fmt::format("{:.1f}%", 100 * err));
  }
  return s;
}

std::string profile_to_json(const Profile& p) {
  const Machine& mc = p.machine;
  json j;
  j["format"] = kFormat;
  j["version"] = kFormatVersion;
  j["machine"] = {{"device", mc.device},
                  {"device_name", mc.device_name},
                  {"host", mc.host},
                  {"backend", mc.backend},
                  {"world_size", mc.world_size},
                  {"ranks_per_node", mc.ranks_per_node},
                  {"nodes", mc.nodes},
                  {"date", mc.date},
                  {"xmoe_version", mc.xmoe_version}};
  j["measurement"] = {{"statistic", p.measurement.statistic},
                      {"warmup", p.measurement.warmup},
                      {"repetitions", p.measurement.repetitions}};
  json models = json::array();
  for (const TaskModel& m : p.models) {
    json e;
    e["task"] = task_name(m.task);
    if (is_collective(m.task)) {
      e["link"] = link_name(m.link);
      e["ranks"] = m.ranks;
    } else if (is_gemm(m.task)) {
      e["in"] = m.in;
      e["out"] = m.out;
      e["groups"] = m.groups;
    } else if (is_attention(m.task)) {
      e["head_dim"] = m.head_dim;
      e["seq_len"] = m.seq_len;
    } else if (m.task != Task::adamw) {
      e["width"] = m.width;
    }
    e["dtype"] = m.dtype;
    e["fit"] = {{"alpha", m.fit.alpha},
                {"beta", m.fit.beta},
                {"r2", m.fit.r2},
                {"n", m.fit.n},
                {"unit", m.fit.unit}};
    e["samples"] = samples_json(m.x, m.t);
    e["heldout"] = samples_json(m.heldout_x, m.heldout_t);
    const double err = m.heldout_error();
    e["heldout_median_error"] = std::isnan(err) ? json(nullptr) : json(err);
    models.push_back(std::move(e));
  }
  j["models"] = std::move(models);
  return j.dump(1) + "\n";
}

Profile profile_from_json(std::string_view text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    XMOE_FAIL("[profile] {}: not valid JSON ({})", source, e.what());
  }
  const Reader r(source);
  if (r.string(j, "", "format") != kFormat)
    r.fail("format", "is not '" + std::string(kFormat) + "' (not a profile xmoe wrote)");
  const int64_t version = r.integer(j, "", "version", 0);
  if (version != kFormatVersion)
    r.fail("version", "is " + std::to_string(version) + "; this xmoe reads version " +
                          std::to_string(kFormatVersion) + " (run xmoe profile again)");
  Profile p;
  const json& mj = r.member(j, "", "machine");
  Machine& mc = p.machine;
  mc.device = r.string(mj, "machine", "device");
  mc.device_name = r.string(mj, "machine", "device_name");
  mc.host = r.string(mj, "machine", "host");
  mc.backend = r.string(mj, "machine", "backend");
  mc.world_size = static_cast<int>(r.integer(mj, "machine", "world_size", 1));
  mc.ranks_per_node = static_cast<int>(r.integer(mj, "machine", "ranks_per_node", 1));
  mc.nodes = static_cast<int>(r.integer(mj, "machine", "nodes", 1));
  mc.date = r.string(mj, "machine", "date");
  mc.xmoe_version = r.string(mj, "machine", "xmoe_version");
  const json& how = r.member(j, "", "measurement");
  p.measurement.statistic = r.string(how, "measurement", "statistic");
  if (p.measurement.statistic != "median" && p.measurement.statistic != "min")
    r.fail("measurement.statistic", "'" + p.measurement.statistic + "' is not median or min");
  p.measurement.warmup = static_cast<int>(r.integer(how, "measurement", "warmup", 0));
  p.measurement.repetitions = static_cast<int>(r.integer(how, "measurement", "repetitions", 1));
  const json& models = r.member(j, "", "models");
  if (!models.is_array()) r.fail("models", "is not an array");
  for (size_t i = 0; i < models.size(); ++i)
    p.models.push_back(read_model(r, models[i], "models[" + std::to_string(i) + "]"));
  return p;
}

void save_profile(const Profile& profile, const std::string& path) {
  io::write_file_atomic(path, profile_to_json(profile));
}

Profile load_profile(const std::string& path) {
  return profile_from_json(io::read_file(path), path);
}

}  // namespace xmoe::sched
