// xmoe's logits for a text, for tests/scripts/hf_logits.py to compare with transformers':
//   hf_reference_logits CHECKPOINT OUT.safetensors TEXT
// loads the checkpoint (a step-N folder or a run folder: its latest) as `xmoe generate` does,
// runs the byte tokens of TEXT through the model in one sequence and writes
// "ids" i32 [1, S] and "logits" f32 [S, V].
#include <cstdio>
#include <filesystem>

#include "xmoe/config/config.h"
#include "xmoe/data/tokenizer.h"
#include "xmoe/io/safetensors.h"
#include "xmoe/model/transformer.h"
#include "xmoe/train/checkpoint.h"
#include "xmoe/train/state.h"

int main(int argc, char** argv) {
  using namespace xmoe;
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s CHECKPOINT OUT.safetensors TEXT\n", argv[0]);
    return 2;
  }
  try {
    std::string dir = argv[1];
    if (!std::filesystem::exists(std::filesystem::path(dir) / "manifest.json"))
      dir = train::latest_checkpoint(dir).value();
    const train::Checkpoint ckpt = train::load_checkpoint(dir);
    const Config config = load_config_string(ckpt.state.at("config").get<std::string>(), dir);
    model::Transformer model(config.model, config.train.seed);
    train::restore_parameters(ckpt.tensors, model.parameters(), dir);
    train::restore_routing_biases(ckpt.tensors, model.moe_layers(), dir);
    std::vector<int32_t> ids;
    for (uint16_t t : data::encode(argv[3])) ids.push_back(t);
    const Tensor input = Tensor::from_vector(ids, {1, static_cast<int64_t>(ids.size())});
    io::save_safetensors(argv[2], {{"ids", input}, {"logits", model.forward(input)}});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hf_reference_logits: %s\n", e.what());
    return 1;
  }
  return 0;
}
