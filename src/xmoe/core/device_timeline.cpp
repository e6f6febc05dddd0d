#include "xmoe/core/device_timeline.h"

#include <algorithm>
#include <map>

namespace xmoe {

TimelineSummary summarize_timeline(std::span<const DeviceActivity> records, size_t longest) {
  TimelineSummary s;
  if (records.empty()) return s;
  std::vector<const DeviceActivity*> order;
  order.reserve(records.size());
  std::map<std::string, TimelineSummary::NameTotal> by_name;
  for (const DeviceActivity& r : records) {
    order.push_back(&r);
    TimelineSummary::NameTotal& total = by_name[r.name];
    total.name = r.name;
    total.ns += r.end_ns - r.start_ns;
    ++total.count;
    switch (r.kind) {
      case DeviceActivity::Kind::kernel:
        ++s.kernels;
        break;
      case DeviceActivity::Kind::memcpy:
        ++s.memcpys;
        break;
      case DeviceActivity::Kind::memset:
        ++s.memsets;
        break;
    }
  }
  std::stable_sort(
      order.begin(), order.end(),
      [](const DeviceActivity* a, const DeviceActivity* b) { return a->start_ns < b->start_ns; });
  // Sweep in start order: `end` is where the busy stretch so far ends, `last` the activity that
  // reaches it.
  std::map<std::string, int64_t> idle_before;
  std::vector<IdleGap> gaps;
  const DeviceActivity* last = order.front();
  int64_t begin = last->start_ns, end = last->end_ns, busy = 0, run_start = begin;
  for (size_t i = 1; i < order.size(); ++i) {
    const DeviceActivity& r = *order[i];
    if (r.start_ns > end) {
      busy += end - run_start;
      IdleGap g{end, r.start_ns, last->name, r.name, 0};
      if (r.launch_ns >= 0) g.host_late_ns = std::clamp<int64_t>(r.launch_ns - end, 0, g.ns());
      s.host_late_ns += g.host_late_ns;
      idle_before[r.name] += g.ns();
      gaps.push_back(std::move(g));
      run_start = r.start_ns;
    }
    if (r.end_ns > end) {
      end = r.end_ns;
      last = &r;
    }
  }
  busy += end - run_start;
  s.span_ns = end - begin;
  s.busy_ns = busy;
  s.idle_ns = s.span_ns - busy;
  std::stable_sort(gaps.begin(), gaps.end(),
                   [](const IdleGap& a, const IdleGap& b) { return a.ns() > b.ns(); });
  if (gaps.size() > longest) gaps.resize(longest);
  s.longest = std::move(gaps);
  s.idle_before.assign(idle_before.begin(), idle_before.end());
  std::stable_sort(s.idle_before.begin(), s.idle_before.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  for (auto& [name, total] : by_name) s.by_name.push_back(std::move(total));
  std::stable_sort(s.by_name.begin(), s.by_name.end(),
                   [](const auto& a, const auto& b) { return a.ns > b.ns; });
  return s;
}

std::string short_kernel_name(const std::string& demangled, size_t most) {
  // Cut the parameter list: the first '(' outside template arguments that is not part of
  // "(anonymous namespace)".
  std::string s = demangled;
  int depth = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '<') ++depth;
    if (c == '>') --depth;
    if (c == '(' && depth == 0 && s.compare(i, 21, "(anonymous namespace)") != 0) {
      s.resize(i);
      break;
    }
  }
  // Drop the return type and the namespaces: keep what follows the last ' ' or "::" outside
  // template arguments.
  depth = 0;
  size_t from = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '<') ++depth;
    if (c == '>') --depth;
    if (depth != 0) continue;
    if (c == ' ') from = i + 1;
    if (c == ':' && i + 1 < s.size() && s[i + 1] == ':') from = i + 2;
    if (c == '(' && s.compare(i, 21, "(anonymous namespace)") == 0) i += 20;
  }
  s = s.substr(from);
  if (s.size() > most) s = s.substr(0, most - 3) + "...";
  return s;
}

}  // namespace xmoe
