// The cache sizes the CPU kernels' streaming rule (scatter.h want_streaming) is measured against:
// those of the caches cpu0 uses, as sysfs lists them, whose L3 is the slice one core shares (a CCX's
// on AMD EPYC). sysconf's _SC_LEVEL3_CACHE_SIZE may report the whole package's L3 instead (ten times
// a CCX's 32 MB on an EPYC guest), which held streaming off for caches far past the core's LLC. The L3
// counts at most kLlcPerCpu for each CPU sysfs says shares it (llc_share): a guest of 2 vCPUs on an
// Intel Xeon lists the whole socket's 300 MiB, which every other core of the host also fills, so rows
// new to a 268 MB cache are cold and plain stores would read each line first (docs/performance.md
// "The LLC's share" has the measurement). 16 MiB a CPU is more than any x86 part has, so bare metal
// and an EPYC guest (32 MB for 2 CPUs) keep their whole L3. Read
// once per module (the first call of a kernel that asks); each CPU module exports cpu_cache_bytes(level)
// (isa.h) so a caller can see what its rule used.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace jitkv {
namespace cpu {

// Line `name` of /sys/devices/system/cpu/cpu0/cache/index<i>/ into text; false if there is none.
template <size_t N>
inline bool sysfs_cache_field(int i, const char* name, char (&text)[N]) {
  char path[80];
  std::snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/%s", i, name);
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  const bool ok = std::fgets(text, sizeof text, f) != nullptr;
  std::fclose(f);
  return ok;
}

// The sysfs index of cpu0's data or unified cache of `level` (index<i>/), the first listed; -1 if none.
inline int sysfs_cache_index(int level) {
  char text[32];
  for (int i = 0; sysfs_cache_field(i, "level", text); ++i) {
    if (std::atoi(text) == level && sysfs_cache_field(i, "type", text) && std::strncmp(text, "Instruction", 11) != 0)
      return i;
  }
  return -1;
}

// Bytes of cpu0's data or unified cache of `level` as sysfs lists it ("32768K"); 0 if it lists none.
inline int64_t sysfs_cache_bytes(int level) {
  char text[32];
  const int i = sysfs_cache_index(level);
  if (i < 0 || !sysfs_cache_field(i, "size", text)) return 0;
  char* unit = nullptr;
  const int64_t v = std::strtoll(text, &unit, 10);
  return v << (*unit == 'K' ? 10 : *unit == 'M' ? 20 : *unit == 'G' ? 30 : 0);
}

// Bytes of the level's cache: sysfs, else sysconf(sc_name), else fallback.
inline int64_t cache_bytes(int level, int sc_name, int64_t fallback) {
  if (const int64_t b = sysfs_cache_bytes(level); b > 0) return b;
  const long s = sysconf(sc_name);
  return s > 0 ? int64_t(s) : fallback;
}

constexpr int64_t kLlcPerCpu = int64_t(16) << 20;

// CPUs in a sysfs cpu list ("0-1", "0-7,64-71", "0,2"); 0 if it is none.
inline int64_t cpu_list_count(const char* list) {
  int64_t count = 0;
  const char* p = list;
  while (*p >= '0' && *p <= '9') {
    char* end = nullptr;
    const long first = std::strtol(p, &end, 10);
    long last = first;
    if (*end == '-') last = std::strtol(end + 1, &end, 10);
    if (last < first) return 0;
    count += last - first + 1;
    p = *end == ',' ? end + 1 : end;
  }
  return count;
}

// The CPUs sharing cpu0's level-`level` cache, as sysfs lists them; 0 if it lists none.
inline int64_t sysfs_cache_cpus(int level) {
  char list[512];
  const int i = sysfs_cache_index(level);
  return i >= 0 && sysfs_cache_field(i, "shared_cpu_list", list) ? cpu_list_count(list) : 0;
}

// An L3 of `bytes` shared by `cpus` CPUs as the streaming rule counts it (cpus 0: unknown, no cap).
inline int64_t llc_share(int64_t bytes, int64_t cpus) { return cpus > 0 ? std::min(bytes, cpus * kLlcPerCpu) : bytes; }

inline int64_t llc_bytes() {
  static const int64_t b = llc_share(cache_bytes(3, _SC_LEVEL3_CACHE_SIZE, int64_t(32) << 20), sysfs_cache_cpus(3));
  return b;
}

inline int64_t l2_bytes() {
  static const int64_t b = cache_bytes(2, _SC_LEVEL2_CACHE_SIZE, int64_t(1) << 20);
  return b;
}

// What want_streaming measures against: level 2 -> l2_bytes(), 3 -> llc_bytes(), else 0.
inline int64_t cache_bytes_of(int64_t level) { return level == 2 ? l2_bytes() : level == 3 ? llc_bytes() : 0; }

}  // namespace cpu
}  // namespace jitkv
