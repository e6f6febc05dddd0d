#pragma once
// Process-level knobs. Every XMOE_* environment variable xmoe reads is declared once, in the
// table of core/env.cpp (name, kind, default, allowed values, one-line doc), and read through
// the accessors below; docs/training.md ("Environment variables") lists the same knobs
// (tests/test_env.cpp checks both ways). Asking for a name the table lacks, or with the
// accessor of another kind, is a programming error; a value the knob does not take is an
// error naming the variable and what it takes. Unset and empty mean the knob's default.
// Configuration keys are not here: config/config.cpp declares those.
//
// Plain header (no fmt, no CUDA): .cu files include it too.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace xmoe::env {

enum class Kind : uint8_t {
  flag,     ///< a switch: 0 or 1
  choice,   ///< one of a fixed list of words
  integer,  ///< an integer >= 0
  text,     ///< free text in a documented format, checked by the knob
};

struct Knob {
  const char* name;  ///< XMOE_...
  Kind kind;
  const char* default_value;        ///< what unset means: a value, or "" (none: the caller decides)
  std::vector<std::string> values;  ///< what it takes: the choices, or a format in words
  const char* doc;                  ///< one line
  /// text only: whether a value has the documented format
  bool (*valid)(std::string_view value) = nullptr;
};

/// Every knob, in table order.
const std::vector<Knob>& knobs();
/// The knob called `name`; throws for a name not in the table.
const Knob& knob(std::string_view name);
/// "flag", "choice", "integer", "text".
const char* kind_name(Kind kind);

/// A switch: "0" or "1" (unset or empty: its default).
bool flag(const char* name);
/// One of the knob's words (unset or empty: its default).
std::string choice(const char* name);
/// An integer >= 0; nullopt when unset or empty (the caller's automatic choice).
std::optional<int64_t> integer(const char* name);
/// The value as set, checked against the knob's format; nullptr when unset or empty.
const char* text(const char* name);

}  // namespace xmoe::env
