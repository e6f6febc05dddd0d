// The table of xmoe's environment variables (core/env.h). A new knob is one row here and one
// row in docs/training.md's "Environment variables" table.
#include "xmoe/core/env.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "xmoe/core/error.h"

namespace xmoe::env {

namespace {

/// "R:S", two integers >= 0.
bool rank_colon_step(std::string_view v) {
  const size_t colon = v.find(':');
  auto digits = [](std::string_view s) {
    return !s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos;
  };
  return colon != std::string_view::npos && digits(v.substr(0, colon)) &&
         digits(v.substr(colon + 1));
}

}  // namespace

// A function-local static: knobs are read during other files' static initialisation
// (core/profile.cpp), before this file's globals would exist.
const std::vector<Knob>& knobs() {
  static const std::vector<Knob> table = {
      {"XMOE_PROFILE",
       Kind::flag,
       "0",
       {"0", "1"},
       "the region profiler starts on; xmoe train prints its table at exit (slower steps: each "
       "region boundary synchronises the device)"},
      {"XMOE_CUDA_CHECK_INDICES",
       Kind::flag,
       "0",
       {"0", "1"},
       "gather_rows / scatter_add_rows check their CUDA indices on the host (one wait per call)"},
      {"XMOE_INJECT_FAULT",
       Kind::text,
       "",
       {"R:S (two integers >= 0)"},
       "rank R fails at step S: the test of how a job stops",
       rank_colon_step},
      {"XMOE_INJECT_HANG",
       Kind::text,
       "",
       {"R:S (two integers >= 0)"},
       "rank R stops answering (sleeps) before step S: the test of the collective watchdog",
       rank_colon_step},
      {"XMOE_GROUPED_GEMM",
       Kind::choice,
       "cutlass",
       {"cutlass", "cublas"},
       "the expert grouped GEMMs: the CUTLASS sm90 kernels where they apply, or cuBLAS"},
      {"XMOE_WEIGHT_GRAD_PIECE_ROWS",
       Kind::integer,
       "",
       {"an integer >= 0"},
       "rows per piece when the sm90 weight gradient cuts long expert groups (0: never cut; "
       "unset: automatic)"},
      {"XMOE_SM90_RASTER",
       Kind::choice,
       "m",
       {"m", "n"},
       "the axis along which the sm90 grouped GEMMs' scheduler walks each group's output tiles"},
      {"XMOE_SM90_FP8_TILE",
       Kind::choice,
       "128x128-c2x1",
       {"128x128-c2x1", "128x128", "128x128-c1x2", "64x128-pp"},
       "the sm90 FP8 grouped GEMM's tiles and clusters (model.moe.expert_dtype = fp8)"},
      {"XMOE_SM90_SWIZZLE",
       Kind::choice,
       "1",
       {"1", "2", "4", "8"},
       "strips of that many tiles across the raster for the sm90 grouped GEMMs' scheduler"},
      {"XMOE_ATTENTION",
       Kind::choice,
       "cudnn",
       {"cudnn", "native"},
       "bf16 attention on cuDNN's fused kernels or on xmoe's own"},
      {"XMOE_MEMORY_LIMIT",
       Kind::integer,
       "0",
       {"a number of bytes >= 0"},
       "every device's allocator refuses (OutOfMemory) a request that would take its live bytes "
       "past this many (0: no cap), as a device of that size would"},
      {"XMOE_ATTENTION_DETERMINISTIC",
       Kind::flag,
       "1",
       {"0", "1"},
       "0: cuDNN's attention backward may accumulate with atomics (faster, not bitwise "
       "repeatable)"},
  };
  return table;
}

namespace {

std::string joined(const std::vector<std::string>& values) {
  std::string out;
  for (size_t i = 0; i < values.size(); ++i)
    out += (i == 0 ? "" : i + 1 == values.size() ? " or " : ", ") + values[i];
  return out;
}

/// The knob `name`, which must be of `kind`.
const Knob& knob_of(const char* name, Kind kind) {
  const Knob& k = knob(name);
  XMOE_CHECK(k.kind == kind, "[env] {} is a {} knob, read with env::{}, not env::{}", name,
             kind_name(k.kind), kind_name(k.kind), kind_name(kind));
  return k;
}

/// The variable's value; nullptr when unset or empty.
const char* value_of(const Knob& k) {
  const char* v = std::getenv(k.name);
  return v && *v ? v : nullptr;
}

[[noreturn]] void bad_value(const Knob& k, const char* value) {
  XMOE_FAIL("[env] {} = '{}': expected {}. {}: {}", k.name, value, joined(k.values), k.name, k.doc);
}

bool one_of(const Knob& k, std::string_view v) {
  for (const std::string& allowed : k.values)
    if (v == allowed) return true;
  return false;
}

}  // namespace

const Knob& knob(std::string_view name) {
  for (const Knob& k : knobs())
    if (name == k.name) return k;
  XMOE_FAIL(
      "[env] {} is not in the table of environment variables (core/env.cpp): declare it "
      "there and in docs/training.md",
      name);
}

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::flag:
      return "flag";
    case Kind::choice:
      return "choice";
    case Kind::integer:
      return "integer";
    case Kind::text:
      return "text";
  }
  return "?";
}

bool flag(const char* name) {
  const Knob& k = knob_of(name, Kind::flag);
  const char* v = value_of(k);
  const std::string_view value = v ? v : k.default_value;
  if (!one_of(k, value)) bad_value(k, v);
  return value == "1";
}

std::string choice(const char* name) {
  const Knob& k = knob_of(name, Kind::choice);
  const char* v = value_of(k);
  if (!v) return k.default_value;
  if (!one_of(k, v)) bad_value(k, v);
  return v;
}

std::optional<int64_t> integer(const char* name) {
  const Knob& k = knob_of(name, Kind::integer);
  const char* v = value_of(k);
  if (!v) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(v, &end, 10);
  if (*end != '\0' || errno != 0 || n < 0 || !std::isdigit(static_cast<unsigned char>(*v)))
    bad_value(k, v);
  return static_cast<int64_t>(n);
}

const char* text(const char* name) {
  const Knob& k = knob_of(name, Kind::text);
  const char* v = value_of(k);
  if (v && k.valid && !k.valid(v)) bad_value(k, v);
  return v;
}

}  // namespace xmoe::env
