//! `node-agent sandbox`: each example's sandbox as a systemd unit, scored
//! by the real `systemd-analyze security --offline=yes` where it is
//! installed (Debian's systemd; CI has it). The score of the unit a
//! genswap instance was before the sandbox (a user and no_new_privs) is
//! scored beside them.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// systemd-analyze's "OK" ends here; CI fails an example above it.
const GOAL: f64 = 2.0;

fn examples() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut found: Vec<PathBuf> = fs::read_dir(&dir)
        .expect("examples/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    found.sort();
    assert!(!found.is_empty(), "no example in {}", dir.display());
    found
}

fn sandbox_of(manifest: &Path) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_node-agent"))
        .args(["sandbox", "--manifest"])
        .arg(manifest)
        .output()
        .expect("run node-agent sandbox");
    assert!(
        output.status.success(),
        "{}: {}",
        manifest.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// systemd-analyze's exposure of `unit`, or `None` without it.
fn score(unit: &str, dir: &Path, name: &str) -> Option<f64> {
    let file = dir.join(format!("{name}.service"));
    fs::write(&file, unit).expect("write the unit");
    let output = Command::new("systemd-analyze")
        .args(["security", "--offline=yes"])
        .arg(&file)
        .output()
        .ok()?;
    let said = String::from_utf8_lossy(&output.stdout);
    let line = said
        .lines()
        .find(|l| l.contains("Overall exposure level"))
        .unwrap_or_else(|| {
            panic!(
                "systemd-analyze said: {said}{}",
                String::from_utf8_lossy(&output.stderr)
            )
        });
    let value = line
        .rsplit_once(": ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no score in {line:?}"));
    Some(value)
}

#[test]
fn every_examples_sandbox_is_a_unit_systemd_scores_ok() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let before =
        "[Service]\nExecStart=/usr/bin/app\nUser=65534\nGroup=65534\nNoNewPrivileges=yes\n";
    let Some(was) = score(before, dir.path(), "before") else {
        println!("no systemd-analyze here: the units are not scored");
        return;
    };
    println!("{:<40} {was:>4.1}", "a user and no_new_privs only (before)");
    for example in examples() {
        let unit = sandbox_of(&example);
        for line in [
            "NoNewPrivileges=yes",
            "SystemCallFilter=@system-service",
            "SystemCallArchitectures=native",
            "LimitNOFILE=1024:",
            "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
            "ProtectSystem=strict",
            "PrivateTmp=yes",
            "ProtectHome=yes",
            "PrivateDevices=yes",
            "ProtectProc=invisible",
        ] {
            assert!(
                unit.contains(line),
                "{}: no {line}:\n{unit}",
                example.display()
            );
        }
        // The run dir writable; in its build's tree, bound in with the
        // node's resolver files.
        let run_dir = if unit.contains("RootDirectory=/var/lib/genswap/store/tree-sha256-") {
            assert!(
                unit.contains("BindReadOnlyPaths=-/etc/resolv.conf -/etc/hosts"),
                "{unit}"
            );
            "BindPaths=/run/genswap/"
        } else {
            "ReadWritePaths=/run/genswap/"
        };
        assert!(
            unit.contains(run_dir),
            "{}: no {run_dir}:\n{unit}",
            example.display()
        );
        let name = example.file_stem().and_then(|s| s.to_str()).unwrap_or("x");
        let now = score(&unit, dir.path(), name).expect("scored above");
        println!(
            "{:<40} {now:>4.1}",
            example
                .display()
                .to_string()
                .rsplit('/')
                .next()
                .unwrap_or(name)
        );
        assert!(now < was, "{name}: {now} is no better than {was}");
        assert!(
            now <= GOAL,
            "{name} scores {now}, above the goal of {GOAL}:\n{unit}"
        );
    }
}

#[test]
fn added_capabilities_and_an_unconfined_filter_show_in_the_unit() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let manifest = dir.path().join("web.yaml");
    fs::write(
        &manifest,
        "apiVersion: genswap.dev/v1alpha1
kind: InstanceGeneration
metadata: {name: web, namespace: prod}
spec:
  build:
    id: web-1
    artifact: {path: /opt/builds/web-1}
    sha256: 2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae
  process:
    user: 65534
    group: 65534
    args: [--listen, ':80']
    capabilities: {add: [NET_BIND_SERVICE]}
    limits: {nofile: {soft: 4096, hard: 8192}}
    writablePaths: [/var/lib/web]
    seccomp: Unconfined
    umask: '0027'
",
    )
    .expect("write the manifest");
    let unit = sandbox_of(&manifest);
    for line in [
        "ExecStart=/opt/builds/web-1 --listen :80",
        "CapabilityBoundingSet=CAP_NET_BIND_SERVICE",
        "AmbientCapabilities=CAP_NET_BIND_SERVICE",
        "LimitNOFILE=4096:8192",
        "UMask=0027",
        "ReadWritePaths=/run/genswap/prod.web /var/lib/web",
    ] {
        assert!(unit.lines().any(|l| l == line), "no {line}:\n{unit}");
    }
    assert!(!unit.contains("SystemCallFilter"), "{unit}");
    assert!(!unit.contains("RestrictAddressFamilies"), "{unit}");

    // The host's filesystem: none of the mount namespace's directives.
    let host = fs::read_to_string(&manifest)
        .expect("read")
        .replace("seccomp: Unconfined", "filesystem: Host");
    fs::write(&manifest, host).expect("write");
    let unit = sandbox_of(&manifest);
    for directive in [
        "ProtectSystem",
        "PrivateTmp",
        "ProtectHome",
        "ReadWritePaths",
    ] {
        assert!(!unit.contains(directive), "{directive}:\n{unit}");
    }
}

/// `node-agent sandbox NAMESPACE/NAME`: the spec the agent's journal holds
/// for an instance it runs, under the same flags as the agent.
#[tokio::test]
async fn an_instance_the_agent_runs_is_read_from_its_journal() {
    let host = swap_host::SwapHost::new("sandbox-unit");
    let build = host.build("b1");
    let mut attempt = host.attempt(1, &build, "b1");
    attempt.spec.process.writable_paths = vec![host.staging.display().to_string()];
    let result = host.swap(&attempt).await;
    assert_eq!(result.outcome, genswap_crds::Outcome::Done, "{result:?}");
    let output = Command::new(env!("CARGO_BIN_EXE_node-agent"))
        .args([
            "sandbox",
            &format!("{}/{}", host.instance.namespace(), host.instance.name()),
            "--run-dir",
        ])
        .arg(&host.run_dir)
        .arg("--state-dir")
        .arg(&host.state_dir)
        .output()
        .expect("run node-agent sandbox");
    host.tear_down().await;
    let unit = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(unit.contains("build b1"), "{unit}");
    let run = node_agent::switch::RunLayout::new(&host.run_dir).instance_dir(&host.instance);
    let writable = format!(
        "ReadWritePaths={} {}",
        run.display(),
        host.staging.display()
    );
    assert!(
        unit.lines().any(|l| l == writable),
        "no {writable}:\n{unit}"
    );

    let output = Command::new(env!("CARGO_BIN_EXE_node-agent"))
        .args(["sandbox", "default/never-ran", "--state-dir"])
        .arg(&host.state_dir)
        .output()
        .expect("run node-agent sandbox");
    assert!(!output.status.success());
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(
        said.contains("holds no spec of default/never-ran"),
        "{said}"
    );
}

#[test]
fn a_manifest_that_is_not_one_is_refused_naming_the_file() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let manifest = dir.path().join("bad.yaml");
    fs::write(&manifest, "kind: Pod\n").expect("write");
    let output = Command::new(env!("CARGO_BIN_EXE_node-agent"))
        .args(["sandbox", "--manifest"])
        .arg(&manifest)
        .output()
        .expect("run node-agent sandbox");
    assert!(!output.status.success());
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(said.contains("bad.yaml"), "{said}");
}
