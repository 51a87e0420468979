//! Filled by the cgroup/spawn work.
