//! Finding the test app the demo installs, and building it when this
//! checkout has not yet.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::DemoError;

/// The command that builds the test app into the default target dir.
pub const BUILD_COMMAND: &str = "cargo build -p testapp --bin genswap-testapp";

/// The built `genswap-testapp` beside this executable, building it with
/// cargo first when it is missing (as after `cargo run -p node-agent`,
/// which builds only the agent). Under `cargo run` it is always handed to
/// cargo, which does nothing when it is fresh: a binary left by an older
/// checkout would otherwise run a story the source no longer tells.
pub fn ensure_built() -> Result<PathBuf, DemoError> {
    match testapp::binary() {
        Ok(path) if std::env::var_os("CARGO").is_some() => {
            build(&path)?;
            Ok(path)
        }
        Ok(path) => Ok(path),
        Err(testapp::Error::NotBuilt { path }) => {
            build(&path)?;
            testapp::binary().map_err(|error| DemoError::Testapp {
                problem: error.to_string(),
                command: BUILD_COMMAND.to_string(),
            })
        }
        Err(error) => Err(DemoError::Testapp {
            problem: format!("{error}: the demo runs the test app built from this repository"),
            command: format!(
                "cargo run -p node-agent -- demo (from the repository, after {BUILD_COMMAND})"
            ),
        }),
    }
}

/// `cargo build -p testapp` into the target and profile dir `missing` is
/// expected in.
fn build(missing: &Path) -> Result<(), DemoError> {
    let command_text = command_text(missing);
    let not_built = |problem: String| DemoError::Testapp {
        problem,
        command: command_text.clone(),
    };
    let profile_dir = missing
        .parent()
        .ok_or_else(|| not_built(format!("{} has no profile dir", missing.display())))?;
    let target_dir = profile_dir
        .parent()
        .ok_or_else(|| not_built(format!("{} has no target dir", profile_dir.display())))?;
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    if !manifest.exists() {
        return Err(not_built(format!(
            "the genswap workspace ({}) is not here to build it from",
            manifest.display()
        )));
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    println!("Building the test app if it is not up to date: {command_text}");
    let mut command = Command::new(&cargo);
    command
        .args([
            "build",
            "-q",
            "-p",
            "testapp",
            "--bin",
            testapp::BINARY_NAME,
        ])
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("--target-dir")
        .arg(target_dir);
    if let Some(profile) = profile_name(profile_dir) {
        command.args(["--profile", &profile]);
    }
    let status = command
        .status()
        .map_err(|error| not_built(format!("cannot run {}: {error}", cargo.to_string_lossy())))?;
    if !status.success() {
        return Err(not_built(format!("cargo build failed ({status})")));
    }
    Ok(())
}

/// The cargo profile of a profile dir; `None` for `debug` (the default).
fn profile_name(profile_dir: &Path) -> Option<String> {
    let name = profile_dir.file_name()?.to_str()?;
    (name != "debug").then(|| name.to_string())
}

/// What a human runs to build it into the same place.
fn command_text(missing: &Path) -> String {
    let profile_dir = missing.parent();
    let mut text = BUILD_COMMAND.to_string();
    if let Some(target) = profile_dir.and_then(Path::parent) {
        text.push_str(&format!(" --target-dir {}", target.display()));
    }
    if let Some(profile) = profile_dir.and_then(profile_name) {
        text.push_str(&format!(" --profile {profile}"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_names_the_target_dir_and_a_non_default_profile() {
        let debug = command_text(Path::new("/w/target/debug/genswap-testapp"));
        assert_eq!(debug, format!("{BUILD_COMMAND} --target-dir /w/target"));
        let release = command_text(Path::new("/w/t/release/genswap-testapp"));
        assert_eq!(
            release,
            format!("{BUILD_COMMAND} --target-dir /w/t --profile release")
        );
    }
}
