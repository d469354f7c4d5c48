//! Kill loops (issue: reliability): every writer SIGKILLed at random moments, then checked.
//!
//! Writers: `imagefolder2lmdb`, `imagefolder2hdf5`, `imagefolder2records`, `convert`, `join`,
//! and a `--force` overwrite of an existing dataset. After each kill:
//! - OUT either does not exist, or (the run had finished) opens as complete and verifies
//!   against the source; an overwritten OUT is the old dataset intact or the new one complete;
//! - `--resume` (for `--force`: the same command again) then finishes, and
//!   `verify --against SRC` passes.
//!
//! `IMAGEFEED_KILLS=N` sets the number of kills in total, spread over the six writers (default
//! 18: the short version in `make test`); `make kill-loop` runs the long one (120).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Instant;

use imagefeed::rng::SampleRng;
use imagefeed::synthetic::{self, SyntheticSpec};

mod support;
use support::{bin, copy_path, partial};

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `verify OUT --against SRC`: Ok(summary) or Err(output).
fn verify(out: &Path, src: &Path) -> Result<String, String> {
    let o = bin()
        .arg("verify")
        .arg(out)
        .arg("--against")
        .arg(src)
        .output()
        .unwrap();
    if o.status.success() {
        Ok(String::from_utf8_lossy(&o.stdout).replace(&*out.to_string_lossy(), ""))
    } else {
        Err(text(&o))
    }
}

fn remove(path: &Path) {
    let _ = std::fs::remove_dir_all(path);
    let _ = std::fs::remove_file(path);
}

fn copy_dataset(src: &Path, dst: &Path) {
    remove(dst);
    copy_path(src, dst);
}

/// One writer under test.
struct Writer {
    name: &'static str,
    /// The arguments, OUT excluded (`join` takes it as `--out OUT`).
    args: Vec<String>,
    out: PathBuf,
    /// The source OUT must verify against when complete.
    src: PathBuf,
    /// For an overwrite: the old dataset, restored before each run, and its verify summary.
    old: Option<(PathBuf, String)>,
}

impl Writer {
    fn command(&self, extra: &str) -> Command {
        let mut cmd = bin();
        cmd.args(&self.args);
        if self.name == "join" {
            cmd.arg("--out");
        }
        cmd.arg(&self.out);
        if !extra.is_empty() {
            cmd.arg(extra);
        }
        cmd.stdout(Stdio::null()).stderr(Stdio::piped());
        cmd
    }

    fn reset(&self) {
        remove(&self.out);
        remove(&partial(&self.out));
        if let Some((old, _)) = &self.old {
            copy_dataset(old, &self.out);
        }
    }
}

#[test]
fn every_writer_killed_at_random_moments_leaves_nothing_half_written_and_resumes() {
    let kills: usize = std::env::var("IMAGEFEED_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(18);
    let dir = tempfile::tempdir().unwrap();
    let tree = |name: &str, per_class: usize, seed: u64| {
        let root = dir.path().join(name);
        let spec = SyntheticSpec {
            classes: 3,
            per_class,
            width: 64,
            height: 48,
            seed,
            ..SyntheticSpec::default()
        };
        synthetic::write_image_folder(&root, &spec).unwrap();
        root
    };
    let (src, old_src) = (tree("src", 150, 1), tree("old-src", 60, 2));
    let s = |p: &Path| p.to_string_lossy().to_string();
    let pack = |command: &str, from: &Path, out: &Path, extra: &[&str]| {
        let o = bin()
            .args([command, "-q", "--threads", "1"])
            .args(extra)
            .arg(from)
            .arg(out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
    };
    // Inputs for convert, join and the overwrite.
    let packed = dir.path().join("in.lmdb");
    pack("imagefolder2lmdb", &src, &packed, &[]);
    let parts: Vec<String> = (0..2)
        .map(|i| {
            let part = dir.path().join(format!("part{i}.lmdb"));
            pack(
                "imagefolder2lmdb",
                &src,
                &part,
                &["--num-shards", "2", "--shard-index", &i.to_string()],
            );
            s(&part)
        })
        .collect();
    let old = dir.path().join("old.records");
    pack(
        "imagefolder2records",
        &old_src,
        &old,
        &["--shard-size", "16K"],
    );
    let old_summary = verify(&old, &old_src).unwrap();
    let common = ["-q", "--threads", "1"].map(String::from);
    let with = |command: &str, extra: &[&str]| -> Vec<String> {
        let mut args = vec![command.to_string()];
        args.extend(common.iter().cloned());
        args.extend(extra.iter().map(|a| a.to_string()));
        args
    };
    let writers = [
        Writer {
            name: "imagefolder2lmdb",
            args: with("imagefolder2lmdb", &[&s(&src)]),
            out: dir.path().join("o.lmdb"),
            src: src.clone(),
            old: None,
        },
        Writer {
            name: "imagefolder2hdf5",
            args: with("imagefolder2hdf5", &[&s(&src)]),
            out: dir.path().join("o.h5"),
            src: src.clone(),
            old: None,
        },
        Writer {
            name: "imagefolder2records",
            args: with("imagefolder2records", &["--shard-size", "16K", &s(&src)]),
            out: dir.path().join("o.records"),
            src: src.clone(),
            old: None,
        },
        Writer {
            name: "convert",
            args: with(
                "convert",
                &["--to", "records", "--shard-size", "16K", &s(&packed)],
            ),
            out: dir.path().join("c.records"),
            src: src.clone(),
            old: None,
        },
        Writer {
            name: "join",
            args: {
                let mut args = vec![
                    "join".to_string(),
                    "-q".into(),
                    "--to".into(),
                    "hdf5".into(),
                ];
                args.extend(parts.iter().cloned());
                args
            },
            out: dir.path().join("j.h5"),
            src: src.clone(),
            old: None,
        },
        Writer {
            name: "force",
            args: with(
                "imagefolder2records",
                &["--force", "--shard-size", "16K", &s(&src)],
            ),
            out: dir.path().join("f.records"),
            src: src.clone(),
            old: Some((old, old_summary.clone())),
        },
    ];
    let mut moments = SampleRng::new(kills as u64, 0, 0);
    let (mut done, mut finished_before_kill, mut staged, mut leftovers) = (0, 0, 0, 0);
    let mut findings = Vec::new();
    for (position, writer) in writers.iter().enumerate() {
        // How long an uninterrupted run takes; kills land in [0, 1.1 x that].
        writer.reset();
        let started = Instant::now();
        let o = writer.command("").output().unwrap();
        assert!(o.status.success(), "{}: {}", writer.name, text(&o));
        let full = started.elapsed();
        assert!(verify(&writer.out, &writer.src).is_ok(), "{}", writer.name);
        let share = kills / writers.len() + usize::from(position < kills % writers.len());
        for k in 0..share {
            let what = format!("{} kill {k}", writer.name);
            writer.reset();
            let mut child = writer.command("").spawn().unwrap();
            std::thread::sleep(full.mul_f64(1.1 * moments.unit()));
            let finished = child.try_wait().unwrap().is_some_and(|s| s.success());
            let _ = child.kill();
            child.wait().unwrap();
            done += 1;
            finished_before_kill += usize::from(finished);
            staged += usize::from(partial(&writer.out).exists());
            // What the kill left at OUT.
            let now = if writer.out.exists() {
                verify(&writer.out, &writer.src).or_else(|e| {
                    // An overwrite may leave the old dataset, intact.
                    match &writer.old {
                        Some((_, old_summary)) => verify(&writer.out, &old_src)
                            .ok()
                            .filter(|s| s == old_summary)
                            .map(|_| "old".to_string())
                            .ok_or(e),
                        None => Err(e),
                    }
                })
            } else {
                Ok("absent".to_string())
            };
            match &now {
                Err(e) => findings.push(format!("{what}: OUT is neither complete nor absent: {e}")),
                Ok(state) if finished && (state == "absent" || state == "old") => {
                    findings.push(format!("{what}: the run had finished but OUT is {state}"))
                }
                Ok(state) if writer.old.is_some() && state == "absent" => {
                    findings.push(format!("{what}: the overwritten dataset is gone"))
                }
                Ok(_) => {}
            }
            // Then the finishing command completes it: `--resume` when the kill left a staging
            // output, the same command again otherwise. An overwrite always runs again (a kill
            // just after the swap leaves the old dataset's remains at OUT.partial, never taken
            // for a dataset; the next run must clear them).
            let complete = matches!(&now, Ok(state) if state != "absent" && state != "old");
            if complete && writer.old.is_none() && partial(&writer.out).exists() {
                // Killed between publishing OUT and deleting the staging output (HDF5: the
                // staging directory is deleted only after the rename into OUT is fsynced, so
                // that a power cut cannot lose both). What is left must never read as a
                // dataset, and `--force` must clear it.
                leftovers += 1;
                if verify(&partial(&writer.out), &writer.src).is_ok() {
                    findings.push(format!(
                        "{what}: the leftover staging output reads as a dataset"
                    ));
                }
                let o = writer.command("--force").output().unwrap();
                if !o.status.success() {
                    findings.push(format!(
                        "{what}: --force over the leftover failed: {}",
                        text(&o)
                    ));
                }
            }
            if !complete || writer.old.is_some() {
                let extra = match (&writer.old, partial(&writer.out).exists()) {
                    (Some(_), _) => "",
                    (None, true) => "--resume",
                    (None, false) => "",
                };
                let o = writer.command(extra).output().unwrap();
                if !o.status.success() {
                    findings.push(format!(
                        "{what}: finishing ({extra:?}) failed: {}",
                        text(&o)
                    ));
                    continue;
                }
            }
            match verify(&writer.out, &writer.src) {
                Ok(_) => {}
                Err(e) => findings.push(format!("{what}: after finishing, verify fails: {e}")),
            }
            if partial(&writer.out).exists() {
                findings.push(format!(
                    "{what}: the staging output was left behind (after the kill OUT was {now:?})"
                ));
            }
        }
    }
    println!(
        "{done} kills: {staged} left a staging output to resume, {finished_before_kill} came after \
         the run had finished, {leftovers} left a complete OUT beside its staging output \
         (cleared by --force); {} findings",
        findings.len()
    );
    assert!(done >= kills, "{done} kills, asked for {kills}");
    assert!(findings.is_empty(), "{}", findings.join("\n"));
}
