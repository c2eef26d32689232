#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>

#include "algorithms/algorithms.h"
#include "common/knobs.h"

namespace ringcomm {

const AlgorithmTuning& AlgorithmTuning::get() {
  static const AlgorithmTuning tuning{
      size_t(knob_int("RINGCOMM_RING_SLICE_BYTES").value_or(0)),  // 0: by ring size (ring.cc)
      size_t(knob_int("RINGCOMM_TREE_CHUNK_BYTES").value()),
      size_t(knob_int("RINGCOMM_FUSION_SLICE_BYTES").value()),
  };
  return tuning;
}

namespace {

std::string measured_sizes() {
  std::string text;
  for (size_t point = 0; point < kMeasuredBytes.size(); ++point)
    text += str_cat(point ? (point + 1 < kMeasuredBytes.size() ? ", " : " and ") : "",
                    kMeasuredBytes[point]);
  return text + " bytes";
}

std::string measured_algorithms() {
  std::string text;
  for (size_t a = 0; a < kMeasuredAlgorithms.size(); ++a)
    text += str_cat(a ? (a + 1 < kMeasuredAlgorithms.size() ? ", " : " and ") : "",
                    algorithm_name(kMeasuredAlgorithms[a]));
  return text;
}

// A line "factor <algorithm> <bytes> <value>": where in LinkModel::factors it goes.
std::pair<size_t, size_t> factor_place(const std::string& path, const std::string& algo,
                                       size_t bytes) {
  size_t point = 0, column = 0;
  while (point < kMeasuredBytes.size() && kMeasuredBytes[point] != bytes) ++point;
  while (column < kMeasuredAlgorithms.size() && algo != algorithm_name(kMeasuredAlgorithms[column]))
    ++column;
  RC_CHECK_ARG(point < kMeasuredBytes.size() && column < kMeasuredAlgorithms.size(),
               "RINGCOMM_TUNING: '", path, "' holds a factor for ", algo, " at ", bytes,
               " bytes; the probe measures ", measured_algorithms(), " at ", measured_sizes());
  return {point, column};
}

}  // namespace

bool load_link_model(const std::string& path, LinkModel* model) {
  std::ifstream file(path);
  std::map<std::string, double> values;
  std::vector<std::array<double, kMeasuredAlgorithms.size()>> factors(kMeasuredBytes.size());
  size_t factor_lines = 0;
  std::string line;
  while (std::getline(file, line)) {
    std::istringstream words(line);
    std::string name;
    if (!(words >> name)) continue;
    if (name == "factor") {
      std::string algo;
      size_t bytes;
      double value;
      RC_CHECK_ARG(bool(words >> algo >> bytes >> value) && value > 0 && std::isfinite(value),
                   "RINGCOMM_TUNING: '", path,
                   "': expected 'factor <algorithm> <bytes> <positive value>', got '", line, "'");
      const auto [point, column] = factor_place(path, algo, bytes);
      factors[point][column] = value;
      ++factor_lines;
    } else {
      double value;
      if (words >> value) values[name] = value;
    }
  }
  if (!values.count("alpha_us") || !values.count("bytes_per_s") ||
      !values.count("reduce_bytes_per_s"))
    return false;
  RC_CHECK_ARG(
      values["alpha_us"] >= 0 && values["bytes_per_s"] > 0 && values["reduce_bytes_per_s"] > 0,
      "RINGCOMM_TUNING: '", path, "' holds a negative or zero figure");
  model->alpha_s = values["alpha_us"] * 1e-6;
  model->bytes_per_s = values["bytes_per_s"];
  model->reduce_bytes_per_s = values["reduce_bytes_per_s"];
  model->local_alpha_s =
      values.count("local_alpha_us") ? values["local_alpha_us"] * 1e-6 : model->alpha_s;
  model->local_bytes_per_s =
      values.count("local_bytes_per_s") ? values["local_bytes_per_s"] : model->bytes_per_s;
  model->single_copy = !values.count("single_copy") || values["single_copy"] != 0;
  bool complete = true;
  for (const auto& row : factors)
    for (double f : row) complete = complete && f > 0;
  RC_CHECK_ARG(factor_lines == 0 || complete, "RINGCOMM_TUNING: '", path,
               "' holds some factors but not all: one for each of ", measured_algorithms(),
               " at each size, or none (a file saved before shared_buffer was measured: delete it "
               "to probe again)");
  model->factors = factor_lines ? factors : decltype(factors){};
  RC_CHECK_ARG(model->local_alpha_s >= 0 && model->local_bytes_per_s > 0, "RINGCOMM_TUNING: '",
               path, "' holds a negative or zero figure");
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
         << "\nsingle_copy " << int(model.single_copy) << "\n";
    for (size_t point = 0; point < model.factors.size(); ++point)
      for (size_t a = 0; a < kMeasuredAlgorithms.size(); ++a)
        file << "factor " << algorithm_name(kMeasuredAlgorithms[a]) << " " << kMeasuredBytes[point]
             << " " << model.factors[point][a] << "\n";
    if (!file.good()) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

}  // namespace ringcomm
