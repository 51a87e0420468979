//! Property tests of the intent journal's reader over damaged files in a
//! real state dir: one instance's file truncated, bit-flipped, overwritten,
//! zero-filled, replaced by garbage, by another instance's file or by
//! another format version; and stray files of any name and content beside
//! the real ones. Whatever is on disk: `load_all` never panics and never
//! fails while the directory is readable; every other instance's entry
//! comes back exactly as written; the damaged file is either reported
//! corrupt (with its path, its instance and a reason) or, when only its
//! layout changed, read as exactly the entry written; a corrupt instance refuses writes
//! until it is quarantined, and is journaled afresh after.
//!
//! CI runs proptest's default case count. A longer campaign:
//! `PROPTEST_CASES=20000 cargo test --release -p node-agent --test fuzz_journal`.

use std::ffi::OsString;
use std::fs;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
use std::sync::OnceLock;

use genswap_crds::{Cause, InstanceKind, Mode, Outcome};
use node_agent::gate::InstanceKey;
use node_agent::journal::{
    AttemptRef, CorruptEntry, GenerationRecord, InstanceEntry, Journal, JournalError,
    OutcomeRecord, Phase, Record,
};
use proptest::prelude::*;
use proptest::test_runner::Config;

/// The instances of the template journal; the damage hits one of them.
const INSTANCES: [&str; 3] = ["web", "db", "cache"];

fn key(name: &str) -> InstanceKey {
    InstanceKey::new("apps", name).expect("instance key")
}

/// Fewer cases by default: each case writes a journal dir and fsyncs a
/// quarantine. `PROPTEST_CASES` still wins.
fn config() -> Config {
    let mut config = Config::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        config.cases = 128;
    }
    config
}

/// A journal written through the real API once: for each instance a
/// counter, a serving generation, an unacknowledged outcome moved to
/// `unreported` and an attempt in flight with a pid. The file bytes are
/// copied into each case's fresh dir; the dir they were written in is
/// removed at once (a static is never dropped, so it could not hold it).
struct Template {
    files: Vec<(String, Vec<u8>)>,
    entries: Vec<InstanceEntry>,
}

impl Template {
    /// The first journal file: its name, bytes, instance and entry.
    fn first_file(&self) -> (&str, &Vec<u8>, InstanceKey, &InstanceEntry) {
        let (name, bytes) = &self.files[0];
        let instance: InstanceKey = name
            .strip_suffix(".json")
            .expect("a .json name")
            .parse()
            .expect("an instance key");
        let entry = entry_of(&self.entries, &instance).expect("its entry");
        (name, bytes, instance, entry)
    }
}

fn template() -> &'static Template {
    static TEMPLATE: OnceLock<Template> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let journal = Journal::open(dir.path()).expect("journal");
        for (i, name) in INSTANCES.iter().enumerate() {
            let instance = key(name);
            let base = i64::try_from(i).expect("small") * 10;
            journal
                .observe_generation(&instance, u64::try_from(i).expect("small"))
                .expect("observe");
            journal
                .set_serving(&instance, Some(generation(&instance, 1, "b1")))
                .expect("serving");
            let mut finished = record(&instance, base + 1);
            finished.finish(OutcomeRecord {
                outcome: Outcome::Failed,
                effective_mode: Mode::Overlap,
                generation: Some(2),
                reason: format!("health: {name} answered 500 \"Internal Server Error\" ü"),
                executed: true,
                clean_exit: false,
                drain_ms: None,
                listener_handover: None,
                steps: Vec::new(),
                started_at_ms: 1_750_000_000_000,
                finished_at_ms: 1_750_000_001_000,
            });
            journal.record(&finished).expect("finished");
            let mut in_flight = record(&instance, base + 2);
            in_flight.successor = Some(generation(&instance, 3, "b3"));
            in_flight.advance(Phase::Spawned { pid: 4242 });
            journal.record(&in_flight).expect("in flight");
        }
        let mut files: Vec<(String, Vec<u8>)> = fs::read_dir(journal.dir())
            .expect("journal dir")
            .map(|e| {
                let e = e.expect("entry");
                (
                    e.file_name().into_string().expect("utf-8 name"),
                    fs::read(e.path()).expect("read"),
                )
            })
            .collect();
        files.sort();
        let (entries, corrupt) = journal.load_all().expect("load");
        assert!(corrupt.is_empty(), "{corrupt:?}");
        assert_eq!(entries.len(), INSTANCES.len());
        drop(journal);
        drop(dir);
        Template { files, entries }
    })
}

fn generation(instance: &InstanceKey, n: u64, build: &str) -> GenerationRecord {
    GenerationRecord {
        n,
        build: build.into(),
        sha256: "a".repeat(64),
        store_path: Some(PathBuf::from(format!("/store/sha256-{}", "a".repeat(64)))),
        cgroup: PathBuf::from(format!("/sys/fs/cgroup/genswap/{instance}/gen-{n}")),
        socket: PathBuf::from(format!("/run/genswap/{instance}/gen-{n}.sock")),
        config_rev: String::new(),
        restart_id: String::new(),
        serving_since_ms: Some(1_750_000_000_000),
        stop: None,
    }
}

fn record(instance: &InstanceKey, rev: i64) -> Record {
    Record::admitted(
        instance.clone(),
        AttemptRef {
            name: format!("{}-node-a-{rev}", instance.name()),
            uid: Some(format!("uid-{rev}")),
            sched_rev: rev,
        },
        Cause::Release,
        InstanceKind::Instance,
        Mode::Overlap,
        Mode::Overlap,
    )
}

/// A fresh state dir holding the template's files.
fn fresh() -> (tempfile::TempDir, Journal) {
    let dir = tempfile::tempdir().expect("temp dir");
    let journal = Journal::open(dir.path()).expect("journal");
    for (name, bytes) in &template().files {
        fs::write(journal.dir().join(name), bytes).expect("copy a journal file");
    }
    (dir, journal)
}

/// How a file is damaged.
#[derive(Clone, Debug)]
enum Damage {
    /// Cut at a relative position (a torn write).
    Truncate(prop::sample::Index),
    /// Flip these bits.
    Flip(Vec<(prop::sample::Index, u8)>),
    /// Overwrite a range with these bytes.
    Overwrite(prop::sample::Index, Vec<u8>),
    /// A block of zeros where data was (a lost block after a crash).
    Zeros(prop::sample::Index, usize),
    /// Replace the whole file.
    Replace(Vec<u8>),
    /// Append bytes after the JSON.
    Append(Vec<u8>),
    /// The file of another instance, copied over this one.
    Another(prop::sample::Index),
    /// A valid entry of an unknown format version.
    Version(u32),
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        any::<prop::sample::Index>().prop_map(Damage::Truncate),
        prop::collection::vec((any::<prop::sample::Index>(), 0u8..8), 1..6).prop_map(Damage::Flip),
        (
            any::<prop::sample::Index>(),
            prop::collection::vec(any::<u8>(), 1..32)
        )
            .prop_map(|(at, bytes)| Damage::Overwrite(at, bytes)),
        (any::<prop::sample::Index>(), 1usize..4096).prop_map(|(at, n)| Damage::Zeros(at, n)),
        prop_oneof![
            prop::collection::vec(any::<u8>(), 0..256),
            "[\\[\\]{}\":,0-9a-z ]{0,80}".prop_map(String::into_bytes),
            Just(b"null".to_vec()),
            Just(b"{}".to_vec()),
            Just(b"[]".to_vec()),
            Just(br#"{"version":1}"#.to_vec()),
            Just(vec![b'['; 100_000]),
        ]
        .prop_map(Damage::Replace),
        prop::collection::vec(any::<u8>(), 1..64).prop_map(Damage::Append),
        any::<prop::sample::Index>().prop_map(Damage::Another),
        prop_oneof![Just(0u32), Just(2), any::<u32>()].prop_map(Damage::Version),
    ]
}

fn apply(bytes: &mut Vec<u8>, damage: &Damage, victim: usize) {
    let files = &template().files;
    match damage {
        Damage::Truncate(at) => bytes.truncate(at.index(bytes.len())),
        Damage::Flip(flips) => {
            for (at, bit) in flips {
                let at = at.index(bytes.len());
                bytes[at] ^= 1 << bit;
            }
        }
        Damage::Overwrite(at, new) => {
            let start = at.index(bytes.len());
            let end = (start + new.len()).min(bytes.len());
            bytes.splice(start..end, new.iter().copied());
        }
        Damage::Zeros(at, n) => {
            let start = at.index(bytes.len());
            let end = (start + n).min(bytes.len());
            bytes[start..end].fill(0);
        }
        Damage::Replace(new) => *bytes = new.clone(),
        Damage::Append(tail) => bytes.extend_from_slice(tail),
        Damage::Another(pick) => {
            let others: Vec<usize> = (0..files.len()).filter(|i| *i != victim).collect();
            *bytes = files[*pick.get(&others)].1.clone();
        }
        Damage::Version(version) => {
            let mut value: serde_json::Value =
                serde_json::from_slice(bytes).expect("template json");
            value["version"] = (*version).into();
            *bytes = serde_json::to_vec(&value).expect("json");
        }
    }
}

fn entry_of<'a>(entries: &'a [InstanceEntry], instance: &InstanceKey) -> Option<&'a InstanceEntry> {
    entries.iter().find(|e| e.instance == *instance)
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn a_damaged_file_is_reported_and_hides_no_other_instance(
        victim in 0..INSTANCES.len(),
        damage in damage(),
    ) {
        let template = template();
        let (_dir, journal) = fresh();
        let (victim_name, original) = &template.files[victim];
        let victim_path = journal.dir().join(victim_name);
        let victim_key: InstanceKey = victim_name
            .strip_suffix(".json")
            .expect("a .json name")
            .parse()
            .expect("an instance key");
        let mut bytes = original.clone();
        apply(&mut bytes, &damage, victim);
        fs::write(&victim_path, &bytes).expect("write the damaged file");

        let (entries, corrupt) = journal.load_all().expect("the directory is readable");

        prop_assert_eq!(entries.len() + corrupt.len(), INSTANCES.len());
        for expected in &template.entries {
            if expected.instance == victim_key {
                continue;
            }
            prop_assert_eq!(entry_of(&entries, &expected.instance), Some(expected));
        }
        match corrupt.as_slice() {
            [] => {
                // Damage the checksum does not see (layout only) leaves the
                // entry exactly as written.
                let read = entry_of(&entries, &victim_key).expect("the victim is an entry");
                prop_assert_eq!(Some(read), entry_of(&template.entries, &victim_key));
            }
            [bad] => {
                prop_assert_eq!(&bad.path, &victim_path);
                prop_assert_eq!(bad.instance.as_ref(), Some(&victim_key));
                prop_assert!(!bad.error.trim().is_empty());
                assert_refuses_writes_until_quarantined(&journal, bad, &victim_key, &bytes)?;
            }
            more => prop_assert!(false, "only the victim can be corrupt: {:?}", more),
        }

        // The other instances keep working: their outcomes are there to
        // report and can be acknowledged.
        let pending = journal.pending_reports().expect("pending reports");
        for name in INSTANCES {
            let instance = key(name);
            if instance == victim_key {
                continue;
            }
            let revs: Vec<i64> = pending
                .iter()
                .filter(|r| r.instance == instance)
                .map(|r| r.attempt.sched_rev)
                .collect();
            prop_assert_eq!(revs.len(), 1, "{} pending {:?}", name, revs);
            prop_assert!(journal.acknowledge(&instance, revs[0]).expect("acknowledge"));
        }
    }

    #[test]
    fn stray_files_never_hide_the_real_ones(
        strays in prop::collection::vec(
            (
                prop_oneof![
                    "[a-z0-9.\\-]{1,20}\\.json",
                    "[a-z0-9]{1,10}\\.[a-z0-9]{1,10}\\.json",
                    "[a-z]{1,8}\\.[a-z]{1,8}\\.json\\.tmp-[0-9]{1,4}",
                    "[a-z]{1,8}\\.[a-z]{1,8}\\.json\\.corrupt-[0-9]{1,4}",
                    "[a-z]{1,12}",
                ],
                prop_oneof![
                    prop::collection::vec(any::<u8>(), 0..128),
                    Just(b"{}".to_vec()),
                ],
            ),
            1..6,
        ),
        odd_name in prop::collection::vec(any::<u8>().prop_filter("a name byte", |b| *b != b'/' && *b != 0), 1..24),
    ) {
        let template = template();
        let (_dir, journal) = fresh();
        let real: Vec<&String> = template.files.iter().map(|(name, _)| name).collect();
        let mut written = Vec::new();
        for (name, bytes) in &strays {
            if real.contains(&name) || name == "." || name == ".." {
                continue;
            }
            fs::write(journal.dir().join(name), bytes).expect("stray file");
            written.push(name.clone());
        }
        let odd = OsString::from_vec(odd_name.clone());
        let odd_written = odd != "."
            && odd != ".."
            && !real.iter().any(|r| odd == r.as_str())
            && fs::write(journal.dir().join(&odd), b"x").is_ok();

        let (entries, corrupt) = journal.load_all().expect("the directory is readable");

        for expected in &template.entries {
            prop_assert_eq!(entry_of(&entries, &expected.instance), Some(expected));
        }
        for bad in &corrupt {
            prop_assert!(!bad.error.trim().is_empty());
            prop_assert!(bad.path.starts_with(journal.dir()));
        }
        // Only `*.json` files that are not temp or quarantined files are
        // read at all; each one is an entry or reported.
        let considered = written
            .iter()
            .filter(|n| n.ends_with(".json"))
            .count()
            + usize::from(odd_written && odd_considered(&odd));
        prop_assert!(
            entries.len() + corrupt.len() <= template.entries.len() + considered,
            "entries {:?} corrupt {:?}", entries.len(), corrupt
        );
    }
}

/// Whether `load_all` looks at a file of this name (a `.json` name that is
/// not a temp or quarantined file; a non-UTF-8 name is reported).
fn odd_considered(name: &std::ffi::OsStr) -> bool {
    match name.to_str() {
        None => true,
        Some(name) => name.ends_with(".json"),
    }
}

/// A corrupt instance: every write is refused and the bytes stay for a
/// human; quarantine moves them aside and the instance starts afresh.
fn assert_refuses_writes_until_quarantined(
    journal: &Journal,
    bad: &CorruptEntry,
    instance: &InstanceKey,
    bytes: &[u8],
) -> Result<(), TestCaseError> {
    let refused = journal.record(&record(instance, 99));
    prop_assert!(
        matches!(refused, Err(JournalError::Corrupt { .. })),
        "{:?}",
        refused
    );
    prop_assert!(journal.next_generation(instance).is_err());
    prop_assert!(journal.acknowledge(instance, 1).is_err());
    prop_assert_eq!(
        fs::read(&bad.path).expect("still there"),
        bytes,
        "never overwritten"
    );

    let moved = journal.quarantine(bad).expect("quarantine");
    prop_assert_eq!(fs::read(&moved).expect("kept"), bytes);
    let (entries, corrupt) = journal.load_all().expect("readable");
    prop_assert!(corrupt.is_empty(), "{:?}", corrupt);
    prop_assert_eq!(entries.len(), INSTANCES.len() - 1);
    prop_assert_eq!(journal.next_generation(instance).expect("afresh"), 1);
    Ok(())
}

#[test]
fn a_directory_named_like_a_journal_file_is_reported_not_fatal() {
    let (_dir, journal) = fresh();
    let path = journal.dir().join("apps.ghost.json");
    fs::create_dir(&path).expect("a directory");
    let (entries, corrupt) = journal.load_all().expect("the directory is readable");
    assert_eq!(entries, template().entries);
    assert_eq!(corrupt.len(), 1, "{corrupt:?}");
    assert_eq!(corrupt[0].path, path);
    assert!(!corrupt[0].error.is_empty());
}

/// Every single-bit flip of one journal file, exhaustively: each is either
/// reported corrupt or (a flip in the layout, such as whitespace) read as
/// exactly the entry written. Before the journal carried a checksum, 4908 of
/// these 17264 flips were read as a different, well-formed entry: a changed
/// digit or letter that JSON alone cannot tell.
#[test]
fn every_single_bit_flip_is_reported_or_read_as_this_instance() {
    let template = template();
    // Some 18000 file writes: in memory where the host has it.
    let dir = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("temp dir");
    let journal = Journal::open(dir.path()).expect("journal");
    let (name, original, instance, expected) = template.first_file();
    let path = journal.dir().join(name);
    let (mut corrupt, mut changed, mut same) = (0usize, 0usize, 0usize);
    for at in 0..original.len() {
        for bit in 0..8 {
            let mut bytes = original.clone();
            bytes[at] ^= 1 << bit;
            fs::write(&path, &bytes).expect("write the flipped file");
            match journal.load_entry(&instance) {
                Err(JournalError::Corrupt { error, .. }) => {
                    assert!(!error.is_empty());
                    corrupt += 1;
                }
                Err(other) => panic!("byte {at} bit {bit}: not a corrupt report: {other}"),
                Ok(None) => panic!("byte {at} bit {bit}: the file was not seen"),
                Ok(Some(entry)) => {
                    assert_eq!(entry.instance, instance, "byte {at} bit {bit}");
                    for record in entry.attempt.iter().chain(&entry.unreported) {
                        assert_eq!(record.instance, instance, "byte {at} bit {bit}");
                    }
                    if entry == *expected {
                        same += 1;
                    } else {
                        changed += 1;
                        eprintln!("byte {at} bit {bit}: read as a different entry");
                    }
                }
            }
        }
    }
    eprintln!(
        "{} single-bit flips of {name}: {corrupt} reported corrupt, {changed} read as a different well-formed entry, {same} read as the same entry",
        original.len() * 8
    );
    assert_eq!(corrupt + changed + same, original.len() * 8);
    assert_eq!(changed, 0, "flips read as a different entry");
}

/// The case the property found once the checksum was in: two flips, one in
/// the content and one in the checksum's name, made the file look like one
/// written before checksums. Such a file has an unknown member, and is
/// refused; a real file from before checksums (nothing but the entry) is
/// still read.
#[test]
fn a_file_without_a_checksum_is_read_only_when_it_holds_nothing_else() {
    let template = template();
    let (_dir, journal) = fresh();
    let (name, original, instance, expected) = template.first_file();
    let path = journal.dir().join(name);

    let text = String::from_utf8(original.clone()).expect("utf-8");
    assert!(text.contains("\"checksum\""), "{text}");
    let damaged = text
        .replacen("\"checksum\"", "\"checksul\"", 1)
        .replacen("\"b1\"", "\"b0\"", 1);
    fs::write(&path, damaged).expect("write");
    match journal.load_entry(&instance) {
        Err(JournalError::Corrupt { error, .. }) => {
            assert!(error.contains("unknown member \"checksul\""), "{error}")
        }
        other => panic!("a damaged file passed as one without a checksum: {other:?}"),
    }

    let before_checksums = serde_json::to_vec_pretty(expected).expect("json");
    fs::write(&path, before_checksums).expect("write");
    let read = journal
        .load_entry(&instance)
        .expect("a file from before checksums is read")
        .expect("an entry");
    assert_eq!(read, *expected);
}
