//! The in-cluster token must stay readable after the agent joins the host's
//! mount namespace, where the pod's service-account path no longer names the
//! projected volume. Renaming the directory away takes its path from under
//! the agent the same way; the pinned paths must still reach the files.

use kube::config::Config;
use node_agent::kube::pinned_through_fd;

#[test]
fn pinned_token_and_ca_stay_readable_when_the_path_goes_away() {
    let root = tempfile::tempdir().expect("temp dir");
    let account = root.path().join("serviceaccount");
    std::fs::create_dir(&account).expect("service account dir");
    std::fs::write(account.join("token"), "token-v1").expect("token");
    std::fs::write(account.join("ca.crt"), "ca-bytes").expect("ca");

    let config = Config::new("https://10.0.0.1:443".parse().expect("uri"));
    let (_dir, pinned) = pinned_through_fd(&account, config).expect("pins the directory");
    std::fs::rename(&account, root.path().join("elsewhere")).expect("path goes away");
    assert!(!account.exists());

    let token_file = pinned.auth_info.token_file.clone().expect("token file set");
    assert!(token_file.starts_with("/proc/self/fd/"), "{token_file}");
    assert_eq!(
        std::fs::read_to_string(&token_file).expect("token readable"),
        "token-v1"
    );
    // A rotated token is read through the same pinned path.
    std::fs::write(root.path().join("elsewhere/token"), "token-v2").expect("rotate");
    assert_eq!(
        std::fs::read_to_string(&token_file).expect("token readable"),
        "token-v2"
    );
    let ca_file = pinned.root_cert_file.clone().expect("ca file set");
    assert_eq!(
        std::fs::read_to_string(ca_file).expect("ca readable"),
        "ca-bytes"
    );
}

#[test]
fn a_missing_service_account_dir_is_refused_with_its_path() {
    let config = Config::new("https://10.0.0.1:443".parse().expect("uri"));
    let err = pinned_through_fd(std::path::Path::new("/nonexistent/serviceaccount"), config)
        .expect_err("refused");
    assert!(
        err.to_string().contains("/nonexistent/serviceaccount"),
        "{err}"
    );
}
