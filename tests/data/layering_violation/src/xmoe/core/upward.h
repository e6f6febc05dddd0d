#pragma once
// A core header that reaches up to the trainer: cmake/CheckLayers.cmake must refuse it.
#include "xmoe/core/tensor.h"
#include "xmoe/train/trainer.h"
