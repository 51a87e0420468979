//! Filled by the staging/health/journal work.
