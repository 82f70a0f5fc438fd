// hpcdl-stage: node-local staging process. Usage in docs/staging.md; normally started by
// hpcdl.staging (training) or `python -m hpcdl.stage` (stage-only runs).
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

#include "common.h"
#include "plan.h"
#include "stager.h"

#ifndef HPCDL_VERSION
#define HPCDL_VERSION "0.0.0"
#endif

namespace {

const char* kUsage =
    "usage: hpcdl-stage --stage-dir DIR [--threads T] [--capacity BYTES] [--window-steps N]\n"
    "                   [--protect-steps N] [--verify] [--once] [--parent-pid PID] [--quiet]\n"
    "       hpcdl-stage --check-plan FILE\n"
    "       hpcdl-stage --version\n"
    "Reads DIR/.hpcdl/plan and DIR/.hpcdl/progress, copies files into DIR, publishes states in\n"
    "DIR/.hpcdl/status. See docs/staging.md.\n";

bool parse_number(const char* text, unsigned long long* out) {
  if (text == nullptr || *text == '\0' || std::strspn(text, "0123456789") != std::strlen(text)) {
    return false;
  }
  errno = 0;
  *out = std::strtoull(text, nullptr, 10);
  return errno == 0;
}

int usage_error(const std::string& msg) {
  std::cerr << "hpcdl-stage: " << msg << "\n" << kUsage;
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  hpcdl::StagerOptions opt;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : nullptr;
    unsigned long long n = 0;
    auto numeric = [&](const char* name) {
      if (!parse_number(value, &n)) {
        std::exit(usage_error(std::string(name) + " needs a non-negative integer"));
      }
      ++i;
      return n;
    };
    if (arg == "--version") {
      std::cout << "hpcdl-stage " << HPCDL_VERSION << "\n";
      return 0;
    } else if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      return 0;
    } else if (arg == "--check-plan") {
      if (value == nullptr) return usage_error("--check-plan needs a file");
      try {
        const auto plan = hpcdl::read_plan(value);
        std::cout << "plan " << value << ": " << plan.entries.size() << " files, epochs "
                  << plan.epoch_begin << ".." << plan.epoch_end << "\n";
        return 0;
      } catch (const hpcdl::StageError& e) {
        std::cerr << "hpcdl-stage: error: " << e.what() << "\n";
        return 1;
      }
    } else if (arg == "--stage-dir") {
      if (value == nullptr) return usage_error("--stage-dir needs a directory");
      opt.stage_dir = value;
      ++i;
    } else if (arg == "--threads") {
      opt.threads = static_cast<unsigned>(numeric("--threads"));
      if (opt.threads == 0 || opt.threads > 1024) return usage_error("--threads must be 1..1024");
    } else if (arg == "--capacity") {
      opt.capacity = numeric("--capacity");
    } else if (arg == "--window-steps") {
      opt.window_steps = static_cast<uint32_t>(numeric("--window-steps"));
    } else if (arg == "--protect-steps") {
      opt.protect_steps = static_cast<uint32_t>(numeric("--protect-steps"));
    } else if (arg == "--parent-pid") {
      opt.parent_pid = static_cast<long>(numeric("--parent-pid"));
    } else if (arg == "--verify") {
      opt.verify = true;
    } else if (arg == "--once") {
      opt.once = true;
    } else if (arg == "--quiet") {
      opt.quiet = true;
    } else {
      return usage_error("unknown argument '" + arg + "'");
    }
  }
  if (opt.stage_dir.empty()) return usage_error("--stage-dir is required");
  return hpcdl::run_stager(opt);
}
