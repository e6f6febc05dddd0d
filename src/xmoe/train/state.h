#pragma once
// What a checkpoint holds for a model + optimizer, laid out so that any parallel layout can
// load it. Dense state (replicated on every rank) is written once, by world rank 0. Expert
// state is written by the dp-rank-0 replica of each ep rank, one tensor per global expert:
// "<name>@<g>" for rows g of a parameter (and of its ".adam_m" / ".adam_v"), so a checkpoint
// saved with ep = 4 loads with ep = 2 or 1 by stacking the experts a rank now owns.
#include <map>
#include <string>
#include <vector>

#include "xmoe/core/parameter.h"
#include "xmoe/optim/adamw.h"
#include "xmoe/parallel/grad_sync.h"
#include "xmoe/parallel/layout.h"

namespace xmoe::moe {
class MoELayer;
}

namespace xmoe::train {

using TensorMap = std::map<std::string, Tensor>;

/// Name of global expert g's slice of an expert tensor.
std::string expert_slice_name(const std::string& name, int64_t global_expert);

/// The optimizer's state as a checkpoint holds it, whatever parallel.zero: whole
/// "<param>.adam_m" / ".adam_v" of every parameter (this rank's local shape) and "optim.step",
/// and the f32 master weights "<param>" of the parameters whose masters the optimizer holds
/// (Parameter::master_sharded). Sharded moments and masters (zero >= 1) are all-gathered per
/// bucket by `sync`'s plan: collective.
TensorMap optimizer_state(const optim::AdamW& opt, const parallel::GradientSync& sync);

/// This rank's part of the checkpoint; `opt_state` as optimizer_state gives it (a parameter
/// whose masters are sharded takes its f32 weights from there). Tensor-parallel shards are
/// gathered into whole tensors over the tp group (collective: every rank calls it).
TensorMap checkpoint_tensors(const std::vector<Parameter*>& params, const TensorMap& opt_state,
                             const std::vector<moe::MoELayer*>& moe_layers,
                             const parallel::Layout& layout);

/// Loads parameters, optimizer state and routing biases from a merged checkpoint (all ranks'
/// files), taking the expert slices this rank owns and its tensor-parallel shards of whole
/// tensors; the optimizer takes its pieces' ranges of
/// the moments (any parallel.zero). Every missing or misshapen tensor is an error naming `dir`
/// and the tensor.
void restore_checkpoint_tensors(const TensorMap& tensors, const std::vector<Parameter*>& params,
                                optim::AdamW& opt, const std::vector<moe::MoELayer*>& moe_layers,
                                const std::string& dir);

/// Parameters only (for generation and inspection): the whole model, any layout it was saved in.
/// A parameter whose masters are sharded (Parameter::master_sharded) gets its bf16 copy cast
/// from the whole f32 tensor, as every rank's all-gather would make it (its optimizer takes the
/// f32 pieces: restore_checkpoint_tensors).
void restore_parameters(const TensorMap& tensors, const std::vector<Parameter*>& params,
                        const std::string& dir);
/// The sigmoid gate's selection biases ("<layer>.router.bias"), which choose the experts: a
/// model that runs a checkpoint needs them as much as its parameters.
void restore_routing_biases(const TensorMap& tensors, const std::vector<moe::MoELayer*>& moe_layers,
                            const std::string& dir);

}  // namespace xmoe::train
