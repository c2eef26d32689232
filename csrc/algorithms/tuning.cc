#include "algorithms/algorithms.h"
#include "common/env.h"

namespace ringcomm {

const AlgorithmTuning& AlgorithmTuning::get() {
  static const AlgorithmTuning tuning{
      size_t(env_int("RINGCOMM_RING_SLICE_BYTES", 512 << 10)),
      size_t(env_int("RINGCOMM_TREE_CHUNK_BYTES", 256 << 10)),
      size_t(env_int("RINGCOMM_SMALL_MESSAGE_BYTES", 64 << 10)),
      size_t(env_int("RINGCOMM_CHAIN_MIN_BYTES", 256 << 10)),
      size_t(env_int("RINGCOMM_FUSION_SLICE_BYTES", 128 << 10)),
  };
  return tuning;
}

}  // namespace ringcomm
