#pragma once
// `xmoe plot RUN_DIR [--out DIR] [--compare RUN_DIR...]`: PNG plots of a run's metrics.jsonl, drawn
// by the Python helper xmoe_plot.py (matplotlib) that the build puts next to the xmoe binary.
#include <string>
#include <vector>

namespace xmoe::cli {

/// Runs the helper on RUN_DIR/metrics.jsonl into `out_dir` (default RUN_DIR/plots) and returns
/// the files it wrote; with `compare_dirs`, also compare_loss.png, every run's loss on one axis.
/// Throws naming what is missing: a run's metrics, python3, matplotlib.
std::vector<std::string> plot_run(const std::string& run_dir, std::string out_dir,
                                  const std::vector<std::string>& compare_dirs = {});

}  // namespace xmoe::cli
