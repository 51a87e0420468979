//! Bad objects in standalone mode's manifest directory: text that is not
//! YAML, a document that is not an InstanceGeneration, bytes that are not
//! UTF-8, a name that cannot name an instance, a CEL rule broken. Each file
//! gets a status file saying why (`Stalled=True`, reason `InvalidManifest`,
//! the message naming the problem), runs nothing, and disturbs nothing
//! else: the instance of the good file keeps serving from the same process.
//! Bad artifacts show their reason in the attempt the status file lists.
//! `standalone_files.rs` has unknown fields, a broken edit of a serving
//! file and duplicate names. Real processes, real cgroups.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "standalone_support/mod.rs"]
mod standalone_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::fs;

use genswap_crds::{ConditionType, Outcome};
use node_agent::standalone::status::reasons;
use standalone_support::{Manifest, StandaloneHost, key};

/// A host serving `hello` from `hello.yaml`; returns who serves.
async fn host_serving_hello(tag: &str) -> (StandaloneHost, swap_host::Identity) {
    let host = StandaloneHost::start(tag);
    let one = host.build("build-1");
    host.write(
        "hello.yaml",
        &Manifest::new("hello", "build-1", &one).yaml(),
    );
    host.settled_after("hello.yaml", 0).await;
    let serving = host.who_serves(&key("hello")).await.expect("hello answers");
    (host, serving)
}

/// Writes `bytes` as `file` (atomically), waits for its refusal and checks
/// it: InvalidManifest with every phrase of `says`, no attempt, no
/// instance; `hello` still served by the same process.
async fn assert_file_refused(
    host: &StandaloneHost,
    serving: &swap_host::Identity,
    file: &str,
    bytes: &[u8],
    says: &[&str],
) {
    let temp = host.dir.join(format!(".{file}.tmp"));
    fs::write(&temp, bytes).expect("write the file");
    fs::rename(&temp, host.dir.join(file)).expect("move it into place");
    let doc = host
        .status(file, &format!("the refusal of {file}"), |doc| {
            doc.is_true(ConditionType::Stalled)
        })
        .await;
    let stalled = doc.condition(ConditionType::Stalled).expect("Stalled");
    assert_eq!(stalled.reason, reasons::INVALID_MANIFEST, "{doc:?}");
    let error = doc.error.as_deref().expect("the status says why");
    for words in says {
        assert!(
            stalled.message.contains(words),
            "{words:?} not in {:?}",
            stalled.message
        );
        assert!(error.contains(words), "{words:?} not in {error:?}");
    }
    assert!(!doc.is_true(ConditionType::Ready), "{doc:?}");
    assert!(
        doc.attempts.is_empty(),
        "a refused file runs nothing: {doc:?}"
    );
    assert_eq!(doc.generation, None, "no spec in force: {doc:?}");

    let hello = key("hello");
    assert_eq!(
        host.who_serves(&hello).await.as_ref(),
        Some(serving),
        "the good file's instance is undisturbed"
    );
    let good = host.status("hello.yaml", "hello's status", |_| true).await;
    assert!(
        good.error.is_none() && good.is_true(ConditionType::Ready),
        "{good:?}"
    );
    assert_eq!(good.generation, Some(1));
    let mut pids = host.pids_in_tree();
    pids.sort_unstable();
    assert_eq!(pids, vec![serving.pid], "nothing else runs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_that_is_not_yaml_is_refused_with_the_parsers_reason() {
    let (host, serving) = host_serving_hello("bad-yaml").await;
    assert_file_refused(
        &host,
        &serving,
        "broken.yaml",
        b"apiVersion: genswap.dev/v1alpha1\nkind: [InstanceGeneration\nspec:\n",
        &["not valid YAML"],
    )
    .await;
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_document_that_is_not_an_instance_generation_is_refused_saying_what_it_is() {
    let (host, serving) = host_serving_hello("bad-kind").await;
    assert_file_refused(
        &host,
        &serving,
        "settings.yaml",
        b"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: hello\ndata:\n  level: debug\n",
        &[
            "v1 ConfigMap",
            "expected \"genswap.dev/v1alpha1 InstanceGeneration\"",
        ],
    )
    .await;
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_that_are_not_utf8_are_refused() {
    let (host, serving) = host_serving_hello("bad-utf8").await;
    assert_file_refused(
        &host,
        &serving,
        "binary.yaml",
        &[0x7f, b'E', b'L', b'F', 0xff, 0xfe, 0x00, 0x01],
        &["not UTF-8"],
    )
    .await;
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_that_cannot_name_an_instance_and_a_broken_rule_are_refused() {
    let (host, serving) = host_serving_hello("bad-object").await;
    let one = host.build("build-1");
    let upper = Manifest::new("Hello_World", "build-1", &one).yaml();
    assert_file_refused(
        &host,
        &serving,
        "upper.yaml",
        upper.as_bytes(),
        &["metadata"],
    )
    .await;
    let rule = Manifest::new("ruled", "build-1", &one)
        .yaml()
        .replace("timeoutSeconds: 20", "timeoutSeconds: 0");
    assert_file_refused(
        &host,
        &serving,
        "ruled.yaml",
        rule.as_bytes(),
        &["health.timeoutSeconds must be greater than 0"],
    )
    .await;
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_artifact_is_abandoned_with_the_reason_in_the_status_file() {
    let (host, serving) = host_serving_hello("bad-missing").await;
    let two = host.build("build-2");
    fs::remove_file(&two.path).expect("remove build-2");
    // The swap's own stage step refuses it (with pre-staging the ask to
    // stage would, and the swap would wait: standalone_prestage.rs).
    let mut manifest = Manifest::new("hello", "build-2", &two);
    manifest.rollout = Some("{prestage: false}".into());
    host.write("hello.yaml", &manifest.yaml());
    // Abandoned is never the build's fault: the scheduler retries it with
    // backoff, so the first refusal is what to wait for, not a settled state.
    let doc = host
        .status("hello.yaml", "the refusal of build-2", |doc| {
            doc.last_attempt().is_some_and(|l| l.sched_rev > 1)
        })
        .await;
    let last = doc.last_attempt().expect("a last attempt");
    assert_eq!(last.outcome, Outcome::Abandoned, "{last:?}");
    assert!(!last.executed);
    let path = two.path.display().to_string();
    for words in [path.as_str(), "does not exist"] {
        assert!(
            last.reason.contains(words),
            "{words:?} not in {:?}",
            last.reason
        );
    }
    let attempt = doc.attempt(last.sched_rev).expect("the attempt");
    let reported = attempt.status.reason.as_deref().unwrap_or_default();
    assert!(reported.contains("does not exist"), "{reported:?}");
    assert!(
        doc.status.held_down.is_empty(),
        "abandoned is not the build's fault"
    );
    assert!(!doc.is_true(ConditionType::Ready), "build-2 does not serve");
    assert_eq!(
        host.who_serves(&key("hello")).await,
        Some(serving),
        "build-1 keeps serving"
    );
    host.stop().await;
}

/// A refusal that keeps coming back says a human must act: after three
/// abandoned attempts with one reason (the scheduler's backoff between
/// them: 5 s, then 10 s) the status is `Stalled=True RepeatedRefusal`, and a
/// spec change clears it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_repeated_three_times_is_stalled_until_the_spec_changes() {
    let (host, serving) = host_serving_hello("bad-repeated").await;
    let one = host.build("build-1");
    let two = host.build("build-2");
    fs::remove_file(&two.path).expect("remove build-2");
    fs::create_dir(&two.path).expect("a directory where the artifact should be");
    // Refusals of the swap itself (pre-staging's asks stall by their
    // deadline instead: standalone_prestage.rs).
    let mut manifest = Manifest::new("hello", "build-2", &two);
    manifest.rollout = Some("{prestage: false}".into());
    host.write("hello.yaml", &manifest.yaml());
    let reason = |doc: &node_agent::standalone::StatusDocument| {
        doc.status
            .conditions
            .iter()
            .find(|c| c.type_ == "Stalled")
            .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
            .unwrap_or_default()
    };
    let stalled = host
        .status("hello.yaml", "Stalled=True RepeatedRefusal", |doc| {
            let (status, why, _) = reason(doc);
            status == "True" && why == "RepeatedRefusal"
        })
        .await;
    let (_, _, message) = reason(&stalled);
    assert!(
        message.contains(&two.path.display().to_string()),
        "the refusal is named: {message}"
    );
    let refused = stalled
        .attempts
        .iter()
        .filter(|a| a.status.outcome == Some(Outcome::Abandoned))
        .count();
    assert!(refused >= 3, "{:?}", stalled.attempts);
    assert_eq!(host.who_serves(&key("hello")).await, Some(serving));

    // Back to build-1: a new desired state, which already serves.
    host.write(
        "hello.yaml",
        &Manifest::new("hello", "build-1", &one).yaml(),
    );
    host.status("hello.yaml", "Ready again, not stalled", |doc| {
        doc.is_true(ConditionType::Ready) && reason(doc).0 == "False"
    })
    .await;
    host.stop().await;
}
