// The plan picture, written as plain SVG.
#include "cli/svg.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "zeroflat/common.h"

namespace zeroflat::cli {
namespace {

std::string esc(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

}  // namespace

std::string plan_svg(const Plan& plan, const PlanInput& in, const std::string& title) {
  constexpr double kPanelW = 470, kPanelH = 310, kLeft = 70, kTop = 58, kPlotW = 370, kPlotH = 180;
  const double width = 2 * kPanelW + 20, height = 2 * kPanelH + 70;
  const std::uint64_t limit = in.capacity_bytes - std::min(in.margin_bytes, in.capacity_bytes);
  std::uint64_t top = in.capacity_bytes;
  for (const Candidate& c : plan.candidates) top = std::max(top, c.profile.peak_device_bytes);
  const double ymax = static_cast<double>(top) * 1.08;

  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
    << "\" viewBox=\"0 0 " << width << " " << height
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  o << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"14\" y=\"24\" font-size=\"16\" font-weight=\"bold\">" << esc(title)
    << ": device memory over the steps of each tier</text>\n";
  o << "<text x=\"14\" y=\"44\" fill=\"#444\">" << esc(plan.reason) << "</text>\n";

  for (std::size_t k = 0; k < plan.candidates.size(); ++k) {
    const Candidate& c = plan.candidates[k];
    const double ox = 10 + static_cast<double>(k % 2) * kPanelW;
    const double oy = 60 + static_cast<double>(k / 2) * kPanelH;
    const bool chosen = plan.chosen && *plan.chosen == c.tier;
    auto x_of = [&](std::size_t i) {
      const std::size_t n = c.steps.size();
      return ox + kLeft + kPlotW * static_cast<double>(i) / static_cast<double>(n > 0 ? n : 1);
    };
    auto y_of = [&](std::uint64_t bytes) {
      return oy + kTop + kPlotH * (1.0 - static_cast<double>(bytes) / ymax);
    };
    o << "<g>\n";
    o << "<rect x=\"" << ox << "\" y=\"" << oy << "\" width=\"" << kPanelW - 10 << "\" height=\""
      << kPanelH - 10 << "\" fill=\"" << (chosen ? "#eef6ee" : "#fafafa") << "\" stroke=\""
      << (chosen ? "#2a7d2a" : "#ccc") << "\"/>\n";
    o << "<text x=\"" << ox + 10 << "\" y=\"" << oy + 20
      << "\" font-size=\"14\" font-weight=\"bold\">" << esc(std::string(tier_name(c.tier)))
      << (chosen ? " (chosen)" : "") << (c.feasible ? "" : " (does not fit)") << "</text>\n";
    o << "<text x=\"" << ox + 10 << "\" y=\"" << oy + 36 << "\" fill=\"#555\">peak "
      << esc(format_bytes(c.profile.peak_device_bytes)) << ", host "
      << esc(format_bytes(c.profile.peak_host_bytes)) << ", " << num(c.predicted_seconds * 1e3)
      << " ms</text>\n";
    // Axes and gridlines in GB.
    for (int t = 0; t <= 4; ++t) {
      const std::uint64_t b = static_cast<std::uint64_t>(ymax * t / 4);
      const double y = y_of(b);
      o << "<line x1=\"" << ox + kLeft << "\" y1=\"" << num(y) << "\" x2=\"" << ox + kLeft + kPlotW
        << "\" y2=\"" << num(y) << "\" stroke=\"#e4e4e4\"/>\n";
      o << "<text x=\"" << ox + kLeft - 6 << "\" y=\"" << num(y + 4)
        << "\" text-anchor=\"end\" fill=\"#666\">" << esc(format_bytes(b)) << "</text>\n";
    }
    // Capacity labelled above its line at the left, capacity - margin below its line at the
    // right, so the two never collide however thin the margin.
    auto hline = [&](std::uint64_t bytes, const char* color, const char* dash, const char* label,
                     bool above) {
      const double y = y_of(bytes);
      o << "<line x1=\"" << ox + kLeft << "\" y1=\"" << num(y) << "\" x2=\"" << ox + kLeft + kPlotW
        << "\" y2=\"" << num(y) << "\" stroke=\"" << color << "\" stroke-width=\"1.5\""
        << " stroke-dasharray=\"" << dash << "\"/>\n";
      o << "<text x=\"" << (above ? ox + kLeft + 4 : ox + kLeft + kPlotW - 2) << "\" y=\""
        << num(above ? y - 4 : y + 13) << "\" text-anchor=\"" << (above ? "start" : "end")
        << "\" fill=\"" << color << "\" font-size=\"11\">" << label << "</text>\n";
    };
    hline(in.capacity_bytes, "#c0392b", "6,3", "capacity", true);
    hline(limit, "#e67e22", "2,3", "capacity - margin", false);
    // Device bytes: the state before step 0, then after each step, as a step line.
    const std::uint64_t start =
        c.profile.after_step.empty()
            ? 0
            : in.capacity_bytes - std::min(in.free_bytes, in.capacity_bytes);
    std::string path = "M";
    path += num(x_of(0)) + "," + num(y_of(start));
    std::uint64_t prev = start;
    for (std::size_t i = 0; i < c.steps.size(); ++i) {
      const std::uint64_t now = c.profile.after_step[i].device_bytes;
      path += " L" + num(x_of(i)) + "," + num(y_of(now));
      path += " L" + num(x_of(i + 1)) + "," + num(y_of(now));
      prev = now;
    }
    (void)prev;
    o << "<path d=\"" << path << "\" fill=\"none\" stroke=\""
      << (c.feasible ? "#1f5fa8" : "#b03030") << "\" stroke-width=\"2.5\"/>\n";
    for (std::size_t i = 0; i < c.steps.size(); ++i) {
      const std::uint64_t now = c.profile.after_step[i].device_bytes;
      const double x = (x_of(i) + x_of(i + 1)) / 2;
      o << "<circle cx=\"" << num(x) << "\" cy=\"" << num(y_of(now)) << "\" r=\"4\" fill=\""
        << (now > limit ? "#b03030" : "#1f5fa8") << "\"><title>" << i << ". "
        << esc(c.steps[i].describe()) << ": device " << esc(format_bytes(now)) << ", host "
        << esc(format_bytes(c.profile.after_step[i].host_bytes)) << "</title></circle>\n";
      o << "<text x=\"" << num(x) << "\" y=\"" << oy + kTop + kPlotH + 16
        << "\" text-anchor=\"middle\" fill=\"#666\" font-size=\"10\">" << i << "</text>\n";
    }
    // The reason, wrapped to the panel's width.
    std::string note = c.feasible ? "steps (hover a point for what it does)" : c.why_not;
    double line_y = oy + kTop + kPlotH + 32;
    while (!note.empty() && line_y < oy + kPanelH - 12) {
      std::size_t cut = note.size() <= 72 ? note.size() : note.rfind(' ', 72);
      if (cut == std::string::npos || cut == 0) cut = std::min<std::size_t>(72, note.size());
      o << "<text x=\"" << ox + 14 << "\" y=\"" << num(line_y) << "\" fill=\""
        << (c.feasible ? "#555" : "#8a2020") << "\" font-size=\"11\">" << esc(note.substr(0, cut))
        << "</text>\n";
      note = cut < note.size() ? note.substr(cut + 1) : "";
      line_y += 14;
    }
    o << "</g>\n";
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace zeroflat::cli
