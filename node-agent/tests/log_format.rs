//! The agent's own log in text format carries no terminal escape codes when
//! it goes to a file or a pipe (a pod's log, journald), as the controller's
//! does not: a refused start logs its error through a pipe here.

use std::process::Command;

#[test]
fn the_text_log_into_a_pipe_has_no_escape_codes() {
    let output = Command::new(env!("CARGO_BIN_EXE_node-agent"))
        // Refused before anything on the host is touched.
        .args(["run", "--no-host-namespaces", "--node-name", "Not_A_Node"])
        .args(["--log-format", "text"])
        .output()
        .expect("run node-agent");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("ERROR"), "the refusal is logged: {stderr}");
    assert!(stderr.contains("is not a node name"), "{stderr}");
    assert!(
        !stderr.contains('\u{1b}'),
        "escape codes in a pipe: {stderr:?}"
    );
}
