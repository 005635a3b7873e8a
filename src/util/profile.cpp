#include "util/profile.hpp"

namespace ptrain::profile {

namespace {
bool g_on = false;
std::vector<std::pair<std::string, double>> g_totals;
}  // namespace

void enable(bool on) { g_on = on; }

bool is_communication(const char* name) {
  const std::string n = name;
  return n == "tp-comm" || n == "grad-sync" || n == "param-gather";
}
bool enabled() { return g_on; }

void add(const char* name, double seconds) {
  for (auto& [n, t] : g_totals)
    if (n == name) {
      t += seconds;
      return;
    }
  g_totals.emplace_back(name, seconds);
}

std::vector<std::pair<std::string, double>> totals() { return g_totals; }
void reset() { g_totals.clear(); }

}  // namespace ptrain::profile
