//! The committed fixture tree is exactly what the generator makes, and scans as torchvision would.

use crate::support;

use imagefeed::Dataset as _;
use imagefeed::format::folder::ImageFolder;
use imagefeed::synthetic;
use support::{fixture_root, fixture_spec, tree_contents};

#[test]
fn committed_fixtures_match_the_generator_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let tree = synthetic::write_image_folder(dir.path(), &fixture_spec()).unwrap();
    assert_eq!(tree.image_files, 20);
    let regenerated = tree_contents(dir.path());
    let committed = tree_contents(&fixture_root());
    let names = |t: &[(String, Vec<u8>)]| t.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(
        names(&regenerated),
        names(&committed),
        "file lists differ: run `make fixtures`"
    );
    for ((name, a), (_, b)) in regenerated.iter().zip(&committed) {
        assert!(
            a == b,
            "{name} differs from the generator's output: run `make fixtures`"
        );
    }
}

#[test]
fn fixture_tree_scans_in_imagefolder_order() {
    let folder = ImageFolder::open(fixture_root()).unwrap();
    assert_eq!(folder.classes(), ["class00", "class01", "class02"]);
    let keys: Vec<&str> = folder.entries().iter().map(|e| e.key.as_str()).collect();
    assert_eq!(
        &keys[..8],
        [
            "class00/edge-alpha.png",
            "class00/edge-cmyk.jpg",
            "class00/edge-grayscale.jpg",
            "class00/edge-progressive.JPEG",
            "class00/img00000.jpg",
            "class00/img00001.jpg",
            "class00/img00002.jpg",
            "class00/img00003.jpg",
        ]
    );
    assert_eq!(folder.len(), 20);
    assert_eq!(folder.skipped_files(), 1, "notes.txt is skipped");
    let labels: Vec<u32> = folder.entries().iter().map(|e| e.label).collect();
    assert_eq!(labels, [[0; 8].as_slice(), &[1; 8], &[2; 4]].concat());
}
