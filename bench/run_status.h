#pragma once
// Shared by the benchmarks: one run (a shape, a preset) in a scope of its own, a failure turned
// into the fields of its JSON line, so the next run still goes (docs/benchmarks.md, "A shape
// that does not fit").
#include <exception>
#include <nlohmann/json.hpp>

#include "xmoe/core/error.h"

namespace xmoe::bench {

enum class RunStatus { ok, out_of_memory, error };

/// Runs `run`. When it throws, adds "status" to `line` — "out_of_memory" with the bytes asked,
/// free, total and live (xmoe::OutOfMemory), or "error" for any other exception — and the
/// "message". What `run` allocated is freed as the exception leaves it.
template <class Run>
RunStatus run_reporting_failure(Run&& run, nlohmann::ordered_json& line) {
  try {
    run();
    return RunStatus::ok;
  } catch (const OutOfMemory& e) {
    line["status"] = "out_of_memory";
    line["bytes_asked"] = e.bytes_asked();
    line["bytes_free"] = e.bytes_free();
    line["bytes_total"] = e.bytes_total();
    line["live_bytes"] = e.live_bytes();
    line["message"] = e.what();
    return RunStatus::out_of_memory;
  } catch (const std::exception& e) {
    line["status"] = "error";
    line["message"] = e.what();
    return RunStatus::error;
  }
}

}  // namespace xmoe::bench
