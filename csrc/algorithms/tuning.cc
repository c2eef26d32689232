#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>

#include "algorithms/algorithms.h"
#include "common/env.h"

namespace ringcomm {

const AlgorithmTuning& AlgorithmTuning::get() {
  static const AlgorithmTuning tuning{
      size_t(env_int("RINGCOMM_RING_SLICE_BYTES", 0)),  // 0: by ring size (ring.cc)
      size_t(env_int("RINGCOMM_TREE_CHUNK_BYTES", 256 << 10)),
      size_t(env_int("RINGCOMM_FUSION_SLICE_BYTES", 128 << 10)),
  };
  return tuning;
}

bool load_link_model(const std::string& path, LinkModel* model) {
  std::ifstream file(path);
  std::map<std::string, double> values;
  std::string name;
  double value;
  while (file >> name >> value) values[name] = value;
  if (!values.count("alpha_us") || !values.count("bytes_per_s") ||
      !values.count("reduce_bytes_per_s"))
    return false;
  RC_CHECK_ARG(values["alpha_us"] >= 0 && values["bytes_per_s"] > 0 &&
                   values["reduce_bytes_per_s"] > 0,
               "RINGCOMM_TUNING: '", path, "' holds a negative or zero figure");
  model->alpha_s = values["alpha_us"] * 1e-6;
  model->bytes_per_s = values["bytes_per_s"];
  model->reduce_bytes_per_s = values["reduce_bytes_per_s"];
  model->local_alpha_s =
      values.count("local_alpha_us") ? values["local_alpha_us"] * 1e-6 : model->alpha_s;
  model->local_bytes_per_s =
      values.count("local_bytes_per_s") ? values["local_bytes_per_s"] : model->bytes_per_s;
  model->single_copy = !values.count("single_copy") || values["single_copy"] != 0;
  model->halving_doubling_s_per_byte =
      values.count("halving_doubling_s_per_byte") ? values["halving_doubling_s_per_byte"] : 0;
  RC_CHECK_ARG(model->halving_doubling_s_per_byte >= 0, "RINGCOMM_TUNING: '", path,
               "' holds a negative halving_doubling_s_per_byte");
  RC_CHECK_ARG(model->local_alpha_s >= 0 && model->local_bytes_per_s > 0,
               "RINGCOMM_TUNING: '", path, "' holds a negative or zero figure");
  return true;
}

bool save_link_model(const std::string& path, const LinkModel& model) {
  const std::string tmp = str_cat(path, ".tmp", getpid());
  {
    std::ofstream file(tmp);
    file.precision(9);
    file << "alpha_us " << model.alpha_s * 1e6 << "\nbytes_per_s " << model.bytes_per_s
         << "\nreduce_bytes_per_s " << model.reduce_bytes_per_s << "\nlocal_alpha_us "
         << model.local_alpha_s * 1e6 << "\nlocal_bytes_per_s " << model.local_bytes_per_s
         << "\nsingle_copy " << int(model.single_copy) << "\nhalving_doubling_s_per_byte "
         << model.halving_doubling_s_per_byte << "\n";
    if (!file.good()) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

}  // namespace ringcomm
