//! The programs a run needs: the agent, the controller and the test app built from this
//! workspace in this program's own profile and target dir, and nginx.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{BenchError, Binaries};

/// Builds `node-agent`, `genswap-controller` and `genswap-testapp` beside this executable (cargo
/// does nothing when they are fresh; under `cargo run` they are always
/// handed to cargo so a stale binary never runs), and finds or installs
/// nginx when `nginx_needed`.
pub fn ensure(nginx_needed: bool) -> Result<Binaries, BenchError> {
    let bench = std::env::current_exe().map_err(|source| BenchError::Setup {
        what: "find this executable".into(),
        source,
    })?;
    let profile_dir = bench
        .parent()
        .ok_or_else(|| BenchError::Missing(format!("the directory of {}", bench.display())))?
        .to_path_buf();
    let agent = profile_dir.join("node-agent");
    let controller = profile_dir.join("genswap-controller");
    let testapp = profile_dir.join(testapp::BINARY_NAME);
    if std::env::var_os("CARGO").is_some()
        || !agent.is_file()
        || !testapp.is_file()
        || !controller.is_file()
    {
        build(&profile_dir)?;
    }
    if cfg!(debug_assertions) {
        println!("note: a debug build; benchmark figures come from `cargo run --release`");
    }
    let nginx = if nginx_needed {
        crate::nginx::ensure_installed()?
    } else {
        PathBuf::from("nginx")
    };
    Ok(Binaries {
        agent,
        controller,
        testapp,
        bench,
        nginx,
    })
}

fn build(profile_dir: &Path) -> Result<(), BenchError> {
    let target_dir = profile_dir.parent().ok_or_else(|| {
        BenchError::Missing(format!("the target dir of {}", profile_dir.display()))
    })?;
    let profile = profile_dir
        .file_name()
        .and_then(|n| n.to_str())
        .map(|name| if name == "debug" { "dev" } else { name })
        .unwrap_or("release")
        .to_string();
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let command_text = format!(
        "cargo build --profile {profile} -p node-agent -p controller -p testapp --bins --target-dir {}",
        target_dir.display()
    );
    println!(
        "Building the agent, the controller and the test app if they are not up to date: {command_text}"
    );
    let status = Command::new(cargo)
        .args(["build", "-q", "--profile", &profile])
        .args([
            "-p",
            "node-agent",
            "-p",
            "controller",
            "-p",
            "testapp",
            "--bins",
        ])
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("--target-dir")
        .arg(target_dir)
        .status()
        .map_err(|source| BenchError::Setup {
            what: format!("run {command_text}"),
            source,
        })?;
    if status.success() {
        Ok(())
    } else {
        Err(BenchError::Missing(format!(
            "the agent, the controller and the test app: `{command_text}` failed ({status})"
        )))
    }
}
