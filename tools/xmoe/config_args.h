#pragma once
// --preset / --config / --set: how the commands that take a run's config resolve it.
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "xmoe/config/config.h"
#include "xmoe/core/error.h"

namespace xmoe::cli {

struct ConfigArgs {
  std::string preset_name;
  std::string config_file;
  std::vector<std::string> overrides;

  void add_to(CLI::App* cmd) {
    cmd->add_option("--preset", preset_name, "Start from a named preset (xmoe config presets)")
        ->default_str("tiny");
    cmd->add_option("--config", config_file, "YAML config file (may name a preset itself)");
    cmd->add_option("--set", overrides, "Override a key: --set model.moe.top_k=4 (repeatable)");
  }

  Config resolve() const {
    XMOE_CHECK(preset_name.empty() || config_file.empty(),
               "[config] give --preset or --config, not both");
    Config c = !config_file.empty()   ? load_config_file(config_file)
               : !preset_name.empty() ? preset(preset_name)
                                      : preset("tiny");
    for (const std::string& o : overrides) apply_override(c, o);
    validate(c);
    return c;
  }
};

}  // namespace xmoe::cli
