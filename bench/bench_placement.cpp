// Expert placement by affinity on a trained model's routing: how many inter-node pilots RBD
// sends with the contiguous placement and with the affinity placement, per MoE layer, for 2 and
// 4 nodes. The co-activation of the first half of the validation batches chooses the placement;
// the pilots are counted on the second half (held out). Prints JSON lines, then checks that a
// placed model computes the same validation loss.
//
//   bench_placement [--run runs/default] [--batches 8]
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "xmoe/config/config.h"
#include "xmoe/data/data_loader.h"
#include "xmoe/model/transformer.h"
#include "xmoe/moe/layer.h"
#include "xmoe/moe/placement.h"
#include "xmoe/train/checkpoint.h"
#include "xmoe/train/state.h"

using namespace xmoe;
using namespace xmoe::moe;
namespace fs = std::filesystem;

int main(int argc, char** argv) {
  std::string run = "runs/default";
  int64_t max_batches = 8;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--run")) run = argv[i + 1];
    if (!std::strcmp(argv[i], "--batches")) max_batches = std::stoll(argv[i + 1]);
  }
  try {
    const auto ckpt = train::latest_checkpoint(run);
    XMOE_CHECK(ckpt.has_value(), "[bench_placement] no checkpoint in {} (run `xmoe train` first)",
               run);
    const train::Checkpoint c = train::load_checkpoint(*ckpt);
    const Config cfg = load_config_string(c.state.at("config").get<std::string>(), *ckpt);
    model::Transformer model(cfg.model, cfg.train.seed);
    train::restore_parameters(c.tensors, model.parameters(), *ckpt);
    data::TokenFile::Options topt;
    topt.vocab_size = cfg.model.vocab_size;
    topt.min_tokens = cfg.train.seq_len + 1;
    data::DataLoader val(data::TokenFile::open((fs::path(cfg.data.dir) / "val.bin").string(), topt),
                         cfg.train.batch_size, cfg.train.seq_len, cfg.train.seed);

    auto layers = model.moe_layers();
    const int64_t E = cfg.model.moe.num_experts, k = cfg.model.moe.top_k;
    std::vector<std::vector<int32_t>> fit(layers.size()), held(layers.size());
    bool fitting = true;
    for (size_t l = 0; l < layers.size(); ++l)
      layers[l]->hooks().on<GateOut>([&, l](GateOut& g) {
        const auto v = g.topk_idx.to_vector<int32_t>();
        auto& dst = fitting ? fit[l] : held[l];
        dst.insert(dst.end(), v.begin(), v.end());
      });
    const int64_t batches = std::min<int64_t>(max_batches, val.num_eval_batches());
    XMOE_CHECK(batches >= 2, "[bench_placement] need at least 2 validation batches");
    std::vector<float> losses;
    for (int64_t i = 0; i < batches; ++i) {
      fitting = i < batches / 2;
      const data::Batch b = val.eval_batch(i);
      losses.push_back(model.evaluate_loss(b.inputs, b.targets));
    }
    for (size_t l = 0; l < layers.size(); ++l) {
      const CoactivationMatrix cm = CoactivationMatrix::from_routing(fit[l], k, E);
      for (int nodes : {2, 4}) {
        if (E % nodes) continue;
        const int per = static_cast<int>(E / nodes);
        const std::vector<int> perm = optimize_placement(cm, nodes, per);
        const PilotCount base = count_pilots(held[l], k, {}, nodes, per);
        const PilotCount placed = count_pilots(held[l], k, perm, nodes, per);
        std::printf(
            "{\"bench\":\"placement\",\"checkpoint\":\"%s\",\"moe_layer\":%zu,\"nodes\":%d,"
            "\"tokens\":%lld,\"a2a_internode_rows\":%.0f,\"rbd_internode_pilots\":%.0f,"
            "\"rbd_placed_internode_pilots\":%.0f,\"placement_vs_rbd_pct\":%.1f,"
            "\"placed_vs_a2a_pct\":%.1f}\n",
            ckpt->c_str(), l + 1, nodes, static_cast<long long>(base.tokens), base.internode_pairs,
            base.internode_pilots, placed.internode_pilots,
            100.0 * (placed.internode_pilots / base.internode_pilots - 1.0),
            100.0 * (placed.internode_pilots / base.internode_pairs - 1.0));
      }
    }
    // A placed model computes the same function.
    for (size_t l = 0; l < layers.size(); ++l)
      layers[l]->permute_experts(
          optimize_placement(CoactivationMatrix::from_routing(fit[l], k, E), 2, int(E / 2)));
    fitting = true;
    double worst = 0;
    for (int64_t i = 0; i < 2; ++i) {
      const data::Batch b = val.eval_batch(i);
      worst =
          std::max<double>(worst, std::fabs(model.evaluate_loss(b.inputs, b.targets) - losses[i]));
    }
    std::printf("{\"bench\":\"placement\",\"validation_loss_change_after_placement\":%.2e}\n",
                worst);
    return worst <= 1e-4 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_placement: %s\n", e.what());
    return 1;
  }
}
