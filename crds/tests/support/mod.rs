//! Shared by the `crds` test binaries; each uses its own part.
#![allow(dead_code)]

pub mod schema_table;
