//! Filled by the swap engine work.
