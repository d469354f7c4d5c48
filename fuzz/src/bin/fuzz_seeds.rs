//! Writes each target's starting inputs (`imagefeed::fuzzing::seeds`) to `DIR/<target>/`:
//! `fuzz-seeds DIR`.

fn main() {
    let Some(dir) = std::env::args_os().nth(1) else {
        eprintln!("usage: fuzz-seeds DIR");
        std::process::exit(2);
    };
    let dir = std::path::PathBuf::from(dir);
    for (name, _) in imagefeed::fuzzing::TARGETS {
        let target_dir = dir.join(name);
        if let Err(e) = std::fs::create_dir_all(&target_dir) {
            eprintln!("{}: {e}", target_dir.display());
            std::process::exit(1);
        }
        for (i, seed) in imagefeed::fuzzing::seeds(name).iter().enumerate() {
            let path = target_dir.join(format!("seed-{i}"));
            if let Err(e) = std::fs::write(&path, seed) {
                eprintln!("{}: {e}", path.display());
                std::process::exit(1);
            }
        }
    }
}
