//! The AFL++ harness: `fuzz-target TARGET` runs one of `imagefeed::fuzzing::TARGETS` on the
//! inputs AFL++ feeds it. Built by `cargo afl build` (`make fuzz`).

use imagefeed_fuzz::BoundedAlloc;

#[global_allocator]
static ALLOCATOR: BoundedAlloc = BoundedAlloc;

fn main() {
    let name = std::env::args().nth(1).unwrap_or_default();
    let Some(target) = imagefeed::fuzzing::target(&name) else {
        let names: Vec<&str> = imagefeed::fuzzing::TARGETS.iter().map(|t| t.0).collect();
        eprintln!("usage: fuzz-target TARGET, one of: {}", names.join(", "));
        std::process::exit(2);
    };
    afl::fuzz!(|data: &[u8]| target(data));
}
