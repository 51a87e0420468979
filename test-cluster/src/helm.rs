//! A real helm binary for the tests that render or install the chart.
//!
//! `$HELM` when set (CI installs one with `.ci/install-helm` and exports
//! it); otherwise `.ci/install-helm` puts one under the cargo target
//! directory, once, under a file lock, so parallel test processes do not
//! race on it. A test never skips for want of helm.

use std::fs::{self, File};
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use crate::workspace;

/// The helm binary.
pub fn helm() -> PathBuf {
    static HELM: OnceLock<PathBuf> = OnceLock::new();
    HELM.get_or_init(|| {
        if let Some(path) = std::env::var_os("HELM").filter(|p| !p.is_empty()) {
            let path = PathBuf::from(path);
            assert!(
                path.is_file(),
                "HELM={} is not a file; unset it to let the tests install helm",
                path.display()
            );
            return path;
        }
        install()
    })
    .clone()
}

fn install() -> PathBuf {
    // <target>/<profile>/deps/<test binary>
    let exe = std::env::current_exe().expect("the test binary's path");
    let target = exe
        .ancestors()
        .nth(3)
        .expect("the test binary lies in <target>/<profile>/deps")
        .to_path_buf();
    let dest = target.join("helm");
    fs::create_dir_all(&dest).expect("create the helm dir under the target dir");
    let lock = File::create(target.join("helm.lock")).expect("create the helm install lock");
    lock.lock().expect("take the helm install lock");
    let output = Command::new(workspace().join(".ci/install-helm"))
        .arg(&dest)
        .output()
        .expect("run .ci/install-helm (needs npm and python3)");
    assert!(
        output.status.success(),
        ".ci/install-helm failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let path = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    assert!(
        path.is_file(),
        ".ci/install-helm printed {path:?}, which is not a file"
    );
    path
}
