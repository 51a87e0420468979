//! Runs the tests that need a pure cgroup v2 kernel (real memory, cpu and
//! pids controllers: `node-agent/tests/vm_limits.rs`) or a PID 1 whose
//! namespaces can be joined (`node-agent/tests/vm_pod_namespaces.rs`) in a
//! QEMU guest, and the steered listeners' (`steering_real.rs`) and the
//! sandbox's (`sandbox_real.rs`) on its kernel, Debian's, as well as the
//! host's.
//!
//! The guest is Debian's kernel under software emulation (`-accel tcg`: a
//! KVM guest does not boot on these machines) with `cgroup_no_v1=all`, an
//! initramfs of a static busybox, the virtio and 9p modules and
//! `tests/vm/init`, and the host's filesystem shared read-only over 9p as
//! its root, where `tests/vm/guest` runs as PID 1: the test binaries built
//! here run there unchanged. Their output and exit codes come back through
//! a second, writable share.
//!
//! What it needs, `.ci/install-vm DIR` installs (QEMU, busybox-static, the
//! kernel unpacked into DIR); `GENSWAP_VM_DIR` names DIR (default
//! `$TMPDIR/genswap-ci-vm`). Without them the test says so in one line and
//! passes, unless `GENSWAP_VM=required` (as `.ci/run` sets): then it fails.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The guest test binaries: `(package, test target)`.
const GUEST_TESTS: [(&str, &str); 4] = [
    ("node-agent", "vm_limits"),
    ("node-agent", "vm_pod_namespaces"),
    // Another kernel than the host's for the BPF program and its maps.
    ("node-agent", "steering_real"),
    // And for the sandbox: its mount API calls, hidepid, the filter.
    ("node-agent", "sandbox_real"),
];

/// Everything the guest runs must end within this, boot included.
const DEADLINE: Duration = Duration::from_secs(25 * 60);

/// What boots the guest.
struct Kit {
    qemu: PathBuf,
    kernel: PathBuf,
    modules: PathBuf,
    busybox: PathBuf,
}

/// The kit, or why there is none.
fn kit() -> Result<Kit, String> {
    let dir = std::env::var_os("GENSWAP_VM_DIR")
        .map_or_else(|| std::env::temp_dir().join("genswap-ci-vm"), PathBuf::from);
    let kernel = dir.join("vmlinuz");
    let modules = dir.join("modules");
    if !kernel.is_file() || !modules.join("order").is_file() {
        return Err(format!(
            "no guest kernel in {} (run .ci/install-vm {0})",
            dir.display()
        ));
    }
    let qemu = which("qemu-system-x86_64").ok_or("qemu-system-x86_64 is not installed")?;
    let busybox = PathBuf::from("/bin/busybox");
    if !busybox.is_file() {
        return Err("/bin/busybox (busybox-static) is not installed".into());
    }
    Ok(Kit {
        qemu,
        kernel,
        modules,
        busybox,
    })
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| Path::new(dir).join(program))
        .find(|path| path.is_file())
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf()
}

/// The guest test binaries' paths, by test target. Asked of cargo for the
/// whole workspace, as `cargo test --workspace` built them (one package
/// alone resolves features differently and would build them again).
fn guest_binaries() -> Vec<(String, PathBuf)> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    // What cargo set for this test process describes this package: handed
    // on, it reads as changed to build scripts that watch it (ring's does),
    // and everything above them would be built again.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if [
            "CARGO_PKG_",
            "CARGO_MANIFEST_",
            "CARGO_CRATE_",
            "CARGO_BIN_",
            "CARGO_PRIMARY_PACKAGE",
            "CARGO_TARGET_TMPDIR",
            "CARGO_RUSTC_CURRENT_DIR",
        ]
        .iter()
        .any(|prefix| name.starts_with(prefix))
        {
            command.env_remove(name.as_ref());
        }
    }
    let output = command
        .current_dir(workspace())
        .args(["test", "--workspace", "--no-run", "--message-format=json"])
        .stderr(Stdio::inherit())
        .output()
        .expect("run cargo");
    assert!(output.status.success(), "building the guest tests failed");
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let name = message["target"]["name"].as_str().unwrap_or_default();
        let package = message["package_id"].as_str().unwrap_or_default();
        let wanted = GUEST_TESTS
            .iter()
            .any(|(p, test)| *test == name && package.contains(&format!("/{p}#")));
        if let (Some(path), true) = (message["executable"].as_str(), wanted) {
            found.push((name.to_owned(), PathBuf::from(path)));
        }
    }
    assert_eq!(found.len(), GUEST_TESTS.len(), "{found:?}");
    found
}

/// An initramfs in the kernel's `newc` cpio format.
struct Cpio {
    bytes: Vec<u8>,
    inode: u32,
}

impl Cpio {
    fn new() -> Cpio {
        Cpio {
            bytes: Vec::new(),
            inode: 1,
        }
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        let fields = [
            self.inode,
            mode,
            0,
            0,
            1,
            0,
            u32::try_from(data.len()).expect("a file under 4 GiB"),
            0,
            0,
            0,
            0,
            u32::try_from(name.len() + 1).expect("a short name"),
            0,
        ];
        self.inode += 1;
        self.bytes.extend_from_slice(b"070701");
        for field in fields {
            self.bytes
                .extend_from_slice(format!("{field:08x}").as_bytes());
        }
        self.bytes.extend_from_slice(name.as_bytes());
        self.bytes.push(0);
        self.pad();
        self.bytes.extend_from_slice(data);
        self.pad();
    }

    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, &[]);
    }

    fn file(&mut self, name: &str, source: &Path, permissions: u32) {
        let data = fs::read(source).unwrap_or_else(|e| panic!("read {}: {e}", source.display()));
        self.entry(name, 0o100_000 | permissions, &data);
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        self.bytes
    }

    fn pad(&mut self) {
        while !self.bytes.len().is_multiple_of(4) {
            self.bytes.push(0);
        }
    }
}

fn initramfs(kit: &Kit) -> Vec<u8> {
    let mut cpio = Cpio::new();
    for dir in ["bin", "modules", "proc", "sys", "dev", "newroot"] {
        cpio.dir(dir);
    }
    cpio.file("init", &workspace().join("tests/vm/init"), 0o755);
    cpio.file("bin/busybox", &kit.busybox, 0o755);
    let order = fs::read_to_string(kit.modules.join("order")).expect("the module order");
    cpio.file("modules/order", &kit.modules.join("order"), 0o644);
    for module in order.split_whitespace() {
        let name = format!("{module}.ko");
        cpio.file(&format!("modules/{name}"), &kit.modules.join(&name), 0o644);
    }
    cpio.finish()
}

#[test]
fn the_cgroup_v2_tests_pass_in_a_pure_cgroup_v2_guest() {
    let kit = match kit() {
        Ok(kit) => kit,
        Err(why) if std::env::var("GENSWAP_VM").as_deref() == Ok("required") => {
            panic!("GENSWAP_VM=required, but the VM cannot run: {why}")
        }
        Err(why) => {
            eprintln!("skipped: the pure cgroup v2 guest cannot run here: {why}");
            return;
        }
    };
    let binaries = guest_binaries();
    let work = tempfile::Builder::new()
        .prefix("genswap-vm-")
        .tempdir()
        .expect("a temp dir");
    let results = work.path().join("results");
    fs::create_dir(&results).expect("the results dir");
    // A developer may narrow the guest run (a test name filter, say).
    let extra = std::env::var("GENSWAP_VM_TEST_ARGS").unwrap_or_default();
    let mut commands = String::new();
    for (name, path) in &binaries {
        commands.push_str(&format!(
            "{name}\t{} --test-threads=1 {extra}\n",
            path.display()
        ));
    }
    fs::write(results.join("commands"), commands).expect("write the commands");
    fs::copy(workspace().join("tests/vm/guest"), results.join("guest"))
        .expect("copy the guest script");
    // The guest covers /tmp with its own; what it runs must stay visible.
    let target = binaries[0]
        .1
        .ancestors()
        .nth(3)
        .expect("<target>/<profile>/deps/<binary>")
        .to_path_buf();
    fs::write(
        results.join("keep"),
        format!("{}\n{}\n", workspace().display(), target.display()),
    )
    .expect("write the kept paths");
    let initrd = work.path().join("initramfs.cpio");
    fs::write(&initrd, initramfs(&kit)).expect("write the initramfs");

    let console = work.path().join("console.log");
    let started = Instant::now();
    let mut qemu = Command::new(&kit.qemu)
        .args(["-accel", "tcg", "-cpu", "max", "-smp", "2", "-m", "4096"])
        .args(["-nodefaults", "-display", "none", "-no-reboot"])
        .arg("-serial")
        .arg(format!("file:{}", console.display()))
        .arg("-kernel")
        .arg(&kit.kernel)
        .arg("-initrd")
        .arg(&initrd)
        .args(["-append", "console=ttyS0 cgroup_no_v1=all panic=-1 quiet"])
        .args([
            "-fsdev",
            "local,id=hostroot,path=/,security_model=passthrough,multidevs=remap,readonly=on",
            "-device",
            "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
        ])
        .arg("-fsdev")
        .arg(format!(
            "local,id=results,path={},security_model=passthrough",
            results.display()
        ))
        .args(["-device", "virtio-9p-pci,fsdev=results,mount_tag=results"])
        .stdin(Stdio::null())
        .spawn()
        .expect("start qemu");
    let status = loop {
        if let Some(status) = qemu.try_wait().expect("wait for qemu") {
            break Some(status);
        }
        if started.elapsed() > DEADLINE {
            // By its pid: this test started it.
            let _ = qemu.kill();
            let _ = qemu.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let elapsed = started.elapsed();
    let console_text = fs::read_to_string(&console).unwrap_or_default();
    let seconds = |file: &str| -> Option<f64> {
        fs::read_to_string(results.join(file))
            .ok()
            .and_then(|text| text.trim().parse().ok())
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "vm: qemu ended ({status:?}) after {:.1} s; the guest booted in {} s and ran its tests until {} s",
        elapsed.as_secs_f64(),
        seconds("booted-at").map_or("?".into(), |s| format!("{s:.1}")),
        seconds("finished-at").map_or("?".into(), |s| format!("{s:.1}")),
    );
    let mut failures = Vec::new();
    for (name, _) in &binaries {
        let log = fs::read_to_string(results.join(format!("{name}.log"))).unwrap_or_default();
        let _ = writeln!(out, "---- {name} in the guest ----\n{log}");
        match fs::read_to_string(results.join(format!("{name}.rc"))) {
            Ok(rc) if rc.trim() == "0" => {}
            Ok(rc) => failures.push(format!("{name} exited {}", rc.trim())),
            Err(_) => failures.push(format!("{name} did not finish")),
        }
    }
    assert!(
        status.is_some(),
        "the guest did not finish within {DEADLINE:?}; its console:\n{console_text}"
    );
    assert!(
        failures.is_empty(),
        "{}; the guest's console:\n{console_text}",
        failures.join(", ")
    );
}
