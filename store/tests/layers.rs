//! Layers applied in order, as an image's are: OCI whiteouts remove what
//! the layers below put there, an opaque directory keeps only its own
//! layer's entries, and an entry of another kind replaces what was there.

use std::fs;
use std::path::Path;

use genswap_store::TreeLimits;
use genswap_store::unpack::TreeWriter;

enum Item<'a> {
    File(&'a str, &'a str),
    Dir(&'a str),
    Symlink(&'a str, &'a str),
}

fn layer(items: &[Item<'_>]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for item in items {
        let mut header = tar::Header::new_gnu();
        header.set_mode(0o755);
        match item {
            Item::File(path, body) => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_size(body.len() as u64);
                builder
                    .append_data(&mut header, path, body.as_bytes())
                    .expect("file");
            }
            Item::Dir(path) => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_size(0);
                builder
                    .append_data(&mut header, path, &[][..])
                    .expect("dir");
            }
            Item::Symlink(path, target) => {
                header.set_entry_type(tar::EntryType::Symlink);
                header.set_size(0);
                builder
                    .append_link(&mut header, path, target)
                    .expect("symlink");
            }
        }
    }
    builder.into_inner().expect("tar")
}

fn listing(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for entry in fs::read_dir(dir).expect("read") {
            let entry = entry.expect("entry");
            let rel = entry
                .path()
                .strip_prefix(root)
                .expect("rel")
                .display()
                .to_string();
            let meta = fs::symlink_metadata(entry.path()).expect("lstat");
            if meta.is_dir() {
                out.push(format!("{rel}/"));
                walk(root, &entry.path(), out);
            } else if meta.file_type().is_symlink() {
                out.push(format!(
                    "{rel} -> {}",
                    fs::read_link(entry.path()).expect("link").display()
                ));
            } else {
                out.push(format!(
                    "{rel} = {}",
                    fs::read_to_string(entry.path()).expect("read")
                ));
            }
        }
    }
    walk(root, root, &mut out);
    out.sort();
    out
}

#[test]
fn three_layers_with_a_whiteout_and_an_opaque_directory() {
    let dir = tempfile::tempdir().expect("temp");
    let root = dir.path().join("rootfs");
    fs::create_dir(&root).expect("root");
    let mut tree = TreeWriter::new(&root, TreeLimits::default()).expect("writer");
    tree.apply(
        &layer(&[
            Item::Dir("etc"),
            Item::File("etc/app.conf", "v1"),
            Item::File("etc/old.conf", "old"),
            Item::Dir("var/cache"),
            Item::File("var/cache/a", "a"),
            Item::File("var/cache/b", "b"),
            Item::File("bin/tool", "tool"),
            Item::Dir("share"),
        ])[..],
        "layer 1",
    )
    .expect("layer 1");
    tree.apply(
        &layer(&[
            Item::File("etc/.wh.old.conf", ""),
            Item::File("etc/app.conf", "v2"),
            // An opaque directory: the layer's own entry before the marker
            // stays, the lower layer's go.
            Item::File("var/cache/c", "c"),
            Item::File("var/cache/.wh..wh..opq", ""),
            // A file where a directory was, and a directory where a file was.
            Item::File("share", "now a file"),
            Item::Dir("bin/tool"),
            Item::File("bin/tool/inner", "inner"),
        ])[..],
        "layer 2",
    )
    .expect("layer 2");
    tree.apply(
        &layer(&[
            Item::File(".wh.share", ""),
            Item::Symlink("etc/current", "app.conf"),
            // Whiting out what is not there is no error.
            Item::File("nothing/.wh.here", ""),
        ])[..],
        "layer 3",
    )
    .expect("layer 3");
    let counts = tree.counts();
    tree.seal().expect("sealed");
    assert_eq!(
        listing(&root),
        vec![
            "bin/",
            "bin/tool/",
            "bin/tool/inner = inner",
            "etc/",
            "etc/app.conf = v2",
            "etc/current -> app.conf",
            "var/",
            "var/cache/",
            "var/cache/c = c",
        ]
    );
    assert!(counts.entries >= 15, "{counts:?}");
    // Sealed trees are removed by path whatever their modes.
    genswap_store::tree::remove_entry(&root).expect("remove");
}
