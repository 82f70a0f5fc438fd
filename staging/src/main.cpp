// hpcdl-stage: node-local staging process. Usage in docs/staging.md; normally started by
// hpcdl.staging (training) or `python -m hpcdl.stage` (stage-only runs).
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>

#include "common.h"
#include "copy_engine.h"
#include "plan.h"
#include "stager.h"
#include "status_map.h"

#ifndef HPCDL_VERSION
#define HPCDL_VERSION "0.0.0"
#endif

namespace {

const char* kUsage =
    "usage: hpcdl-stage --stage-dir DIR --session NAME [--threads T] [--capacity BYTES]\n"
    "                   [--window-steps N] [--protect-steps N] [--verify] [--once]\n"
    "                   [--parent-pid PID] [--quiet] [--peer [--peer-listen-fd FD]]\n"
    "                   [--nice N] [--nice-later N]\n"
    "       hpcdl-stage --stage-dir DIR --session NAME --remove-temporaries\n"
    "       hpcdl-stage --check-plan FILE...\n"
    "       hpcdl-stage --print-layout          (status map and progress file layout, JSON)\n"
    "       hpcdl-stage --default-capacity DIR  (bytes staged into DIR without --capacity)\n"
    "       hpcdl-stage --version\n"
    "Reads the plan and progress files in DIR/.hpcdl/sessions/NAME, copies files into DIR,\n"
    "records them in DIR/.hpcdl/manifest, publishes states in DIR/.hpcdl/sessions/NAME/status.\n"
    "See docs/staging.md.\n";

bool parse_number(const char* text, unsigned long long* out) {
  if (text == nullptr || *text == '\0' || std::strspn(text, "0123456789") != std::strlen(text)) {
    return false;
  }
  errno = 0;
  *out = std::strtoull(text, nullptr, 10);
  return errno == 0;
}

// Validates each plan file; exit 1 when any is refused (one line each on stderr).
int check_plans(int count, char** paths) {
  int code = 0;
  for (int k = 0; k < count; ++k) {
    try {
      const auto plan = hpcdl::read_plan(paths[k]);
      std::cout << "plan " << paths[k] << ": " << plan.entries.size() << " files, epochs "
                << plan.epoch_begin << ".." << plan.epoch_end << "\n";
    } catch (const hpcdl::StageError& e) {
      std::cerr << "hpcdl-stage: error: " << e.what() << "\n";
      code = 1;
    }
  }
  return code;
}

// A session name is one path component that needs no quoting.
bool valid_session(const std::string& name) {
  return !name.empty() && name.size() <= 100 && name[0] != '.' &&
         name.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-") ==
             std::string::npos;
}

int usage_error(const std::string& msg) {
  std::cerr << "hpcdl-stage: " << msg << "\n" << kUsage;
  return 2;
}

// The commands that answer and exit (--version, --help, --print-layout, --default-capacity,
// --check-plan), when argv[i] is one: their exit code.
std::optional<int> answer(int argc, char** argv, int i) {
  const std::string arg = argv[i];
  const char* value = i + 1 < argc ? argv[i + 1] : nullptr;
  if (arg == "--version") {
    std::cout << "hpcdl-stage " << HPCDL_VERSION << "\n";
    return 0;
  } else if (arg == "--help" || arg == "-h") {
    std::cout << kUsage;
    return 0;
  } else if (arg == "--print-layout") {
    std::cout << hpcdl::layout_json() << "\n";
    return 0;
  } else if (arg == "--default-capacity") {
    if (value == nullptr) return usage_error("--default-capacity needs a directory");
    std::cout << hpcdl::default_capacity(value) << "\n";
    return 0;
  } else if (arg == "--check-plan") {
    if (value == nullptr) return usage_error("--check-plan needs a file");
    return check_plans(argc - i - 1, argv + i + 1);
  }
  return std::nullopt;
}

// The stager's option at argv[i] (and its value, which `i` then passes) into `opt`; the exit
// code when it is refused.
std::optional<int> read_option(int argc, char** argv, int& i, hpcdl::StagerOptions& opt,
                               bool& remove_temporaries) {
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
  if (arg == "--stage-dir") {
    if (value == nullptr) return usage_error("--stage-dir needs a directory");
    opt.stage_dir = value;
    ++i;
  } else if (arg == "--session") {
    if (value == nullptr || !valid_session(value)) {
      return usage_error("--session needs a name of 1-100 characters from A-Z a-z 0-9 . _ -");
    }
    opt.session = value;
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
  } else if (arg == "--peer") {
    opt.peer = true;  // the job's secret follows on stdin
  } else if (arg == "--remove-temporaries") {
    remove_temporaries = true;
  } else if (arg == "--peer-listen-fd") {
    opt.peer_listen_fd = static_cast<int>(numeric("--peer-listen-fd"));
  } else if (arg == "--nice") {
    opt.nice = static_cast<unsigned>(numeric("--nice"));
    if (opt.nice > 19) return usage_error("--nice must be 0..19");
  } else if (arg == "--nice-later") {
    opt.nice_later = static_cast<unsigned>(numeric("--nice-later"));
    if (opt.nice_later > 19) return usage_error("--nice-later must be 0..19");
  } else {
    return usage_error("unknown argument '" + arg + "'");
  }
  return std::nullopt;
}

// --remove-temporaries: what a SIGKILLed stager left behind; a running stager removes its own.
int remove_left_temporaries(const hpcdl::StagerOptions& opt) {
  try {
    hpcdl::remove_temporaries(opt.stage_dir + "/.hpcdl/sessions/" + opt.session);
  } catch (const hpcdl::StageError& e) {
    std::cerr << "hpcdl-stage: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  hpcdl::StagerOptions opt;
  bool remove_temporaries = false;
  for (int i = 1; i < argc; ++i) {
    if (auto code = answer(argc, argv, i)) return *code;
    if (auto code = read_option(argc, argv, i, opt, remove_temporaries)) return *code;
  }
  if (opt.stage_dir.empty()) return usage_error("--stage-dir is required");
  if (opt.session.empty()) return usage_error("--session is required");
  if (opt.peer_listen_fd >= 0 && !opt.peer) return usage_error("--peer-listen-fd needs --peer");
  if (remove_temporaries) return remove_left_temporaries(opt);
  return hpcdl::run_stager(opt);
}
