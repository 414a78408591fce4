// Sizes and durations for people to read ("1.5 GiB", "3m05s").
#pragma once

#include <string>

namespace ptk {

std::string HumanBytes(double bytes);       // "1.5 GiB"
std::string HumanDuration(double seconds);  // "1h02m", "3m05s", "12.3s"

}  // namespace ptk
