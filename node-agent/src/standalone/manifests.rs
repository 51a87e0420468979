//! The manifest directory: which files are manifests, and what each one
//! says (an InstanceGeneration, validated as the API server would, or the
//! reason it is refused).

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Read};
use std::path::Path;

use genswap_crds::InstanceGeneration;
use genswap_crds::manifest::parse_instance_generation;

use crate::gate::InstanceKey;

/// The namespace of a manifest without `metadata.namespace`.
pub const DEFAULT_NAMESPACE: &str = "default";

/// The largest manifest read; the API server refuses objects above about
/// 1.5 MB, and no InstanceGeneration comes near it.
pub const MAX_MANIFEST_BYTES: u64 = 1024 * 1024;

/// Whether a directory entry named `name` is a manifest: `*.yaml` or
/// `*.yml`, not hidden (editors' and atomic writers' temp files start with a
/// dot) and not a backup (`~`).
pub fn is_manifest_name(name: &str) -> bool {
    !name.starts_with('.')
        && !name.ends_with('~')
        && (name.ends_with(".yaml") || name.ends_with(".yml"))
        && name.len() > ".yml".len()
}

/// What one manifest file says.
#[derive(Clone, Debug, PartialEq)]
pub enum Parsed {
    /// A valid InstanceGeneration and the instance it names.
    Valid {
        key: InstanceKey,
        ig: Box<InstanceGeneration>,
    },
    /// Why it is refused, naming the field or rule.
    Invalid(String),
}

/// One manifest file as read.
#[derive(Clone, Debug, PartialEq)]
pub struct ManifestFile {
    /// Its bytes (a read error is kept as text, so a fixed permission is
    /// seen as a change).
    pub content: Result<Vec<u8>, String>,
    /// What it says.
    pub parsed: Parsed,
}

/// Reads every manifest in `dir`, by file name. `previous` holds the files
/// of the last scan: a file whose bytes did not change is not parsed again.
/// Entries that are not regular files (after following symlinks) are
/// skipped; so are names that are not UTF-8.
pub fn scan(
    dir: &Path,
    previous: &BTreeMap<String, ManifestFile>,
) -> io::Result<BTreeMap<String, ManifestFile>> {
    let mut files = BTreeMap::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            tracing::warn!(dir = %dir.display(), name = ?entry.file_name(), "skipping a file whose name is not UTF-8");
            continue;
        };
        if !is_manifest_name(&name) {
            continue;
        }
        let path = entry.path();
        match fs::metadata(&path) {
            Ok(meta) if meta.is_file() => {}
            // Gone between the listing and now, a directory, or a dangling
            // link: not a manifest (yet).
            _ => continue,
        }
        let content = read_limited(&path).map_err(|error| format!("cannot read {name}: {error}"));
        if let Some(known) = previous.get(&name).filter(|known| known.content == content) {
            files.insert(name, known.clone());
            continue;
        }
        let parsed = match &content {
            Ok(bytes) => parse(bytes),
            Err(error) => Parsed::Invalid(error.clone()),
        };
        files.insert(name, ManifestFile { content, parsed });
    }
    Ok(files)
}

fn read_limited(path: &Path) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    fs::File::open(path)?
        .take(MAX_MANIFEST_BYTES + 1)
        .read_to_end(&mut bytes)?;
    if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > MAX_MANIFEST_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("larger than {MAX_MANIFEST_BYTES} bytes"),
        ));
    }
    Ok(bytes)
}

/// Parses and validates one manifest: the InstanceGeneration schema with
/// unknown fields refused and every CEL rule evaluated, and a namespace and
/// name that can name an instance.
pub fn parse(bytes: &[u8]) -> Parsed {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return Parsed::Invalid("the file is not UTF-8 text".into());
    };
    let ig = match parse_instance_generation(text) {
        Ok(ig) => ig,
        Err(error) => return Parsed::Invalid(error.to_string()),
    };
    let namespace = ig
        .metadata
        .namespace
        .clone()
        .filter(|ns| !ns.is_empty())
        .unwrap_or_else(|| DEFAULT_NAMESPACE.to_string());
    let name = ig.metadata.name.clone().unwrap_or_default();
    match InstanceKey::new(namespace, name) {
        Ok(key) => Parsed::Valid {
            key,
            ig: Box::new(ig),
        },
        Err(error) => Parsed::Invalid(format!("metadata: {error}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = r#"
apiVersion: genswap.dev/v1alpha1
kind: InstanceGeneration
metadata:
  name: hello
spec:
  build:
    id: hello-1
    artifact:
      path: /var/lib/genswap/staging/hello-1
    sha256: 2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae
"#;

    #[test]
    fn manifest_names_skip_hidden_backup_and_other_files() {
        for name in ["a.yaml", "web.yml", "x.y.yaml"] {
            assert!(is_manifest_name(name), "{name}");
        }
        for name in [
            ".a.yaml",
            "a.yaml~",
            "a.json",
            "a.yaml.tmp",
            ".yaml",
            "README",
        ] {
            assert!(!is_manifest_name(name), "{name}");
        }
    }

    #[test]
    fn a_valid_manifest_names_its_instance_in_the_default_namespace() {
        match parse(VALID.as_bytes()) {
            Parsed::Valid { key, ig } => {
                assert_eq!(key.to_string(), "default.hello");
                assert_eq!(ig.spec.build.id, "hello-1");
            }
            Parsed::Invalid(error) => panic!("refused: {error}"),
        }
    }

    #[test]
    fn an_unknown_field_and_a_bad_digest_are_refused_with_the_field() {
        let unknown = VALID.replace("  build:", "  bogus: 1\n  build:");
        let Parsed::Invalid(error) = parse(unknown.as_bytes()) else {
            panic!("an unknown field was accepted");
        };
        assert!(error.contains("spec.bogus"), "{error}");
        let digest = VALID.replace("2c26b46b", "XYZ");
        let Parsed::Invalid(error) = parse(digest.as_bytes()) else {
            panic!("a bad digest was accepted");
        };
        assert!(error.contains("sha256"), "{error}");
    }

    #[test]
    fn a_name_that_cannot_name_an_instance_is_refused() {
        let upper = VALID.replace("name: hello", "name: Hello");
        assert!(matches!(parse(upper.as_bytes()), Parsed::Invalid(_)));
    }

    #[test]
    fn scan_reads_manifests_and_reuses_unchanged_ones() {
        let dir = tempfile::tempdir().expect("temp dir");
        fs::write(dir.path().join("hello.yaml"), VALID).expect("write");
        fs::write(dir.path().join("bad.yml"), "kind: [").expect("write");
        fs::write(dir.path().join(".hidden.yaml"), VALID).expect("write");
        fs::create_dir(dir.path().join("status")).expect("mkdir");
        let first = scan(dir.path(), &BTreeMap::new()).expect("scan");
        assert_eq!(
            first.keys().cloned().collect::<Vec<_>>(),
            vec!["bad.yml".to_string(), "hello.yaml".to_string()]
        );
        assert!(matches!(first["hello.yaml"].parsed, Parsed::Valid { .. }));
        assert!(matches!(first["bad.yml"].parsed, Parsed::Invalid(_)));
        let second = scan(dir.path(), &first).expect("rescan");
        assert_eq!(first, second);
    }
}
