// The CPU quota of a process's cgroups (common.h's available_cores), from the text of its
// /proc/self/cgroup and a cgroup file system root, so that tests can hand it a tree of their own.
#pragma once

#include <string>
#include <string_view>

namespace zeroflat::detail {

// The tightest CPU quota on the way from the process's cgroup (v1: the hierarchy holding the
// cpu controller, under root/cpu or root/cpu,cpuacct; v2: the unified one, under root) up to the
// hierarchy's root, in whole cores rounded up; 0 when no level has one.
unsigned cgroup_cpu_quota(std::string_view proc_self_cgroup, const std::string& root) noexcept;

}  // namespace zeroflat::detail
