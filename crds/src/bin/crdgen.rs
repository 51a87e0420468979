//! Prints the genswap CRDs as YAML, one document each.
//!
//! `cargo run -p crds --bin crdgen -- --write` writes them to `crds/` and
//! `charts/genswap/crds/`; without arguments it prints them to stdout.

use std::path::Path;
use std::process::ExitCode;

fn main() -> ExitCode {
    let write = std::env::args().nth(1).as_deref() == Some("--write");
    let rendered = match genswap_crds::crdgen::render() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("crdgen: {e}");
            return ExitCode::FAILURE;
        }
    };
    if !write {
        for (_, yaml) in &rendered {
            print!("{yaml}");
        }
        return ExitCode::SUCCESS;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for dir in genswap_crds::crdgen::OUTPUT_DIRS {
        for (file, yaml) in &rendered {
            let path = root.join(dir).join(file);
            if let Err(e) = std::fs::write(&path, yaml) {
                eprintln!("crdgen: writing {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
