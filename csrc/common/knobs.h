// The environment ringcomm reads: one table (knobs.cc) of every variable, RINGCOMM_* and the
// launcher's, with its type, default and meaning. Readers look a knob up by name here, so a name
// not in the table fails at its first read, and each type is parsed in one place; Python reads
// through the same functions (ringcomm/_env.py) and docs/configuration.md is generated from the
// table (python -m ringcomm._knobs).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace ringcomm {

enum class KnobType : uint8_t {
  kInt,     // a decimal integer, as strtoll reads one
  kSize,    // bytes: a decimal integer >= 0
  kFlag,    // on when set to anything but 0
  kSwitch,  // 0 or 1
  kEnum,    // one of `values`
  kString,
  kPath,
};
const char* knob_type_name(KnobType type);

struct Knob {
  std::string name;
  KnobType type;
  std::vector<std::string> values;  // kEnum: what it takes
  // As documented. A value of the type is what the knob reads as when unset (or set empty);
  // else, in parentheses (or empty for strings), it describes what the reader works out then.
  // "auto" for an int or size: the reader works it out, and "auto" may also be set.
  std::string default_text;
  std::string section;  // the heading it is listed under
  std::string doc;      // one line
};

// Every knob, grouped by section.
const std::vector<Knob>& knobs();
// The row of `name`; std::logic_error if the table has none.
const Knob& knob(const char* name);

// The value of an int or size knob: as set, else the default; nullopt where the default is
// worked out by the reader. std::invalid_argument: not an integer, or a negative size.
std::optional<int64_t> knob_int(const char* name);
// A flag (anything but 0) or a switch (0 or 1, else std::invalid_argument), or its default.
bool knob_on(const char* name);
// A string or path as set, else its default value ("" where there is none); an enum's value,
// checked against its values (std::invalid_argument), else its default.
std::string knob_string(const char* name);

// An enum knob that also takes values known only as the program runs (RINGCOMM_ALGO: the names
// of registered algorithms, algorithms/registered.h): `takes` says whether it takes one, `what`
// names them where a value is refused. The table's values stay as listed.
void extend_enum(const char* name, std::function<bool(const std::string&)> takes,
                 const std::string& what);

}  // namespace ringcomm
