//! genswap node agent: swaps host processes between generations under cgroup v2.
#![deny(rust_2018_idioms)]
