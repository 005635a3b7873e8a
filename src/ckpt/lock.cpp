#include "ckpt/lock.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>
#include <vector>

#include "ckpt/common.hpp"
#include "ckpt/h5.hpp"
#include "util/cleanup.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/mpi.hpp"
#include "util/timer.hpp"

namespace ptrain::ckpt {

namespace {
namespace fs = std::filesystem;

constexpr int kHeartbeatSeconds = 10;
constexpr long kStaleSeconds = 120;

struct Held {
  std::string path, folder;  // the lock file; its folder, canonical
  dev_t dev = 0;
  ino_t ino = 0;
};

struct Locks {
  std::mutex m;
  std::condition_variable cv;
  std::vector<Held> held;
  bool beating = false;  // the heartbeat thread runs
};
// Never freed: the heartbeat thread lives until the process ends.
Locks& locks() {
  static Locks* l = new Locks;
  return *l;
}

bool same_file(const std::string& path, const Held& h) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && st.st_dev == h.dev && st.st_ino == h.ino;
}

// Every 10 s, the modification time of each lock still this run's is set to now.
void heartbeat() {
  Locks& l = locks();
  for (;;) {
    std::vector<Held> held;
    {
      std::unique_lock<std::mutex> g(l.m);
      l.cv.wait_for(g, std::chrono::seconds(kHeartbeatSeconds));
      held = l.held;
    }
    for (const Held& h : held)
      if (same_file(h.path, h)) utimensat(AT_FDCWD, h.path.c_str(), nullptr, 0);
  }
}

std::string this_host() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return host;
}

std::string this_job() {
  const char* job = std::getenv("SLURM_JOB_ID");
  return job && *job ? job : "none";
}

// What a lock file says of its holder (values from another run's file: shown escaped).
struct Holder {
  std::string host, pid, job, started;
  long age = 0;  // seconds since the heartbeat last refreshed it
  bool named() const { return !host.empty() && !pid.empty(); }
  std::string describe() const {
    if (!named()) return cat("its lock names no holder yet, written ", age, " s ago");
    return cat("host ", h5::printable(host, 80), ", pid ", h5::printable(pid, 20),
               job.empty() || job == "none" ? std::string(", no Slurm job")
                                            : cat(", Slurm job ", h5::printable(job, 40)),
               started.empty() ? std::string() : cat(", started ", h5::printable(started, 40)),
               ", lock refreshed ", age, " s ago");
  }
};

Holder read_holder(const std::string& path, const struct stat& st) {
  Holder h;
  std::ifstream in(path, std::ios::binary);
  std::string text(4096, '\0');
  in.read(text.data(), std::streamsize(text.size()));
  text.resize(std::size_t(in.gcount()));
  std::size_t at = 0;
  while (at < text.size()) {
    const std::size_t end = std::min(text.find('\n', at), text.size());
    const std::string line = text.substr(at, end - at);
    at = end + 1;
    const std::size_t eq = line.find(" = ");
    if (eq == std::string::npos) continue;
    const std::string key = line.substr(0, eq), value = line.substr(eq + 3);
    if (key == "host") h.host = value;
    if (key == "pid") h.pid = value;
    if (key == "slurm_job") h.job = value;
    if (key == "started") h.started = value;
  }
  h.age = std::max(0L, long(std::time(nullptr) - st.st_mtime));
  return h;
}

// Whether process `pid` of this host has ended and waits to be reaped (state Z in
// /proc/<pid>/stat): kill(pid, 0) still finds it, but its run is over (a killed job whose
// parent is gone, under an init that does not reap).
bool is_zombie(long pid) {
  std::ifstream in(cat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(in, line)) return false;
  const std::size_t close = line.rfind(')');  // the name, in parentheses, may hold anything
  return close != std::string::npos && close + 2 < line.size() &&
         (line[close + 2] == 'Z' || line[close + 2] == 'X');
}

// Why the holder's run is over ("" when it may be alive).
std::string stale_reason(const Holder& h) {
  if (h.age > kStaleSeconds)
    return cat("its heartbeat stopped ", h.age, " s ago (a live run refreshes it every ",
               kHeartbeatSeconds, " s)");
  if (!h.named()) return "";
  if (h.host == this_host()) {
    char* end = nullptr;
    const long pid = std::strtol(h.pid.c_str(), &end, 10);
    if (end == h.pid.c_str() || *end || pid <= 0) return "";
    if (pid == long(getpid())) return "its process is gone (this process has its pid now)";
    if (kill(pid_t(pid), 0) != 0 && errno == ESRCH) return "its process is gone";
    if (is_zombie(pid)) return "its process is gone (a zombie, not yet reaped)";
    return "";
  }
  if (h.job != "none" && !h.job.empty() && h.job == this_job())
    return cat("Slurm job ", h.job, " is this job, requeued");
  return "";
}

// Moves the stale lock `path` out of the way, if it is still the file judged (`judged`); a lock
// made meanwhile by another run is put back. Whether the way is free.
bool set_aside(const std::string& path, const struct stat& judged) {
  const std::string aside = cat(path, ".stale.", this_host(), ".", getpid());
  if (rename(path.c_str(), aside.c_str()) != 0) return false;  // another run moved it first
  struct stat now {};
  const bool same = stat(aside.c_str(), &now) == 0 && now.st_dev == judged.st_dev &&
                    now.st_ino == judged.st_ino && now.st_mtime == judged.st_mtime;
  if (!same) (void)link(aside.c_str(), path.c_str());  // back, unless a newer one is there
  unlink(aside.c_str());
  return same;
}

// Makes the lock file: "" when made, "exists" when another is there, else the OS's reason.
std::string create_lock(const std::string& path, Held& held) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
  if (fd < 0) return errno == EEXIST ? "exists" : std::strerror(errno);
  const std::string text = cat("host = ", this_host(), "\npid = ", getpid(),
                               "\nslurm_job = ", this_job(), "\nstarted = ", utc_now(), "\n");
  struct stat st {};
  int err = write(fd, text.data(), text.size()) == ssize_t(text.size()) ? 0 : (errno ? errno : EIO);
  if (!err && fsync(fd) != 0 && errno != EINVAL) err = errno;
  if (!err && fstat(fd, &st) != 0) err = errno;
  close(fd);
  if (err) {
    unlink(path.c_str());
    return std::strerror(err);
  }
  held.path = path;
  held.dev = st.st_dev;
  held.ino = st.st_ino;
  return "";
}
}  // namespace

std::string lock_folder(const std::string& key, const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);  // a save on a signal into a folder not made yet
  const fs::path canonical = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  const std::string path = (fs::path(dir) / kLockName).string();
  Locks& l = locks();
  {
    std::lock_guard<std::mutex> g(l.m);
    for (const Held& h : l.held)
      if (h.folder == canonical.string()) return "";
  }
  for (int attempt = 0; attempt < 5; ++attempt) {
    Held held;
    const std::string made = create_lock(path, held);
    if (made.empty()) {
      held.folder = canonical.string();
      cleanup::remove_on_abort(path);
      std::lock_guard<std::mutex> g(l.m);
      l.held.push_back(held);
      if (!l.beating) std::thread(heartbeat).detach();
      l.beating = true;
      return "";
    }
    if (made != "exists") return cat(key, " '", dir, "': cannot make the lock ", path, ": ", made);
    struct stat st {};
    if (stat(path.c_str(), &st) != 0) continue;  // removed meanwhile: try again
    const Holder holder = read_holder(path, st);
    const std::string reason = stale_reason(holder);
    if (reason.empty())
      return cat(key, " '", dir, "' is in use by another run (", holder.describe(),
                 "); if that run has ended, remove ", path);
    if (!set_aside(path, st)) continue;  // someone else's move, or a new lock: judge again
    log::warn(cat(key, " '", dir, "': took over the lock of a run that has ended (",
                  holder.describe(), "): ", reason));
  }
  return cat(key, " '", dir, "': cannot take the lock ", path,
             " (it changed at every attempt); remove it if no run uses the folder");
}

void hold_folder(MPI_Comm comm, const std::string& key, const std::string& dir) {
  mpi::agree(comm, mpi::rank(comm) == 0 ? lock_folder(key, dir) : std::string(), kExitInput);
}

void release_folders() {
  std::vector<Held> held;
  {
    std::lock_guard<std::mutex> g(locks().m);
    held.swap(locks().held);
  }
  for (const Held& h : held) {
    if (same_file(h.path, h)) unlink(h.path.c_str());
    cleanup::keep_on_abort(h.path);
  }
}

}  // namespace ptrain::ckpt
