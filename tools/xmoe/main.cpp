// xmoe: the command-line entry point (train, generate, prepare, config, bench, ...).
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "xmoe/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"xmoe: training fine-grained Mixture-of-Experts language models"};
  app.require_subcommand(0, 1);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return 0;
}
