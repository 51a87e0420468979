//! genswap-testapp: filled by the swap engine work.
fn main() {}
