// The one wording of a rank's read progress (common.h).
#include "zeroflat/common.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "zeroflat/common.h"

namespace zeroflat {

namespace {

// Coarse on purpose: a time left is an estimate.
std::string rounded(double s) {
  char buf[48];
  if (s < 60) {
    std::snprintf(buf, sizeof buf, "%.0f s", std::ceil(s));
  } else if (s < 3600) {
    const long m = std::lround(s / 60);
    std::snprintf(buf, sizeof buf, "%ld min", m);
  } else {
    const long m = std::lround(s / 60);
    std::snprintf(buf, sizeof buf, "%ld h %02ld min", m / 60, m % 60);
  }
  return buf;
}

// "about 3 min"; "over 100 h" for a nearly stalled read (no overflowing estimate).
std::string about(double s) {
  if (!(s < 360000)) return "over 100 h";
  return "about " + rounded(s);
}

}  // namespace

std::string describe_progress(std::uint64_t done, std::uint64_t total, double seconds) {
  std::string out = "read " + format_bytes(done);
  if (total > 0) {
    const double pct = 100.0 * static_cast<double>(std::min(done, total)) /
                       static_cast<double>(total);
    char buf[24];
    std::snprintf(buf, sizeof buf, " (%.0f%%)", std::floor(pct));
    out += " of " + format_bytes(total) + buf;
  }
  if (done > 0 && seconds > 0) {
    const double rate = static_cast<double>(done) / seconds;
    out += ", " + format_bytes(static_cast<std::uint64_t>(rate)) + "/s";
    if (total > done) out += ", " + about(static_cast<double>(total - done) / rate) + " left";
  }
  return out;
}

}  // namespace zeroflat
